//! Where an op runs. `Backend::Auto` follows the tensor's device (CPU tensors: the CPU
//! kernels; CUDA tensors: the CUDA kernels) unless `FP8NSA_BACKEND` says otherwise;
//! `Backend::Pjrt` names a PJRT runtime explicitly. Without the `pjrt` / `cuda` features the
//! types still exist (as in Candle's dummy backends), and using them is an error that says how
//! to get them.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::error::{invalid, Error, Result};

/// Environment variable overriding `Backend::Auto`: `cpu`, `cuda`, `pjrt` or `auto`.
pub const BACKEND_ENV: &str = "FP8NSA_BACKEND";

/// The fp8 linear kernel variants on PJRT: `V1` is the XLA-native program (any platform);
/// `V2` (manual async DMA, double buffering) and `V3` (V2 with the scales in SMEM) are
/// TPU-only Mosaic kernels, and asking for them elsewhere is an error naming the platform.
/// `FP8NSA_TPU_KERNEL=v1|v2|v3` picks one for `Backend::Auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TpuKernel {
    #[default]
    V1,
    V2,
    V3,
}

impl FromStr for TpuKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "v1" => Ok(TpuKernel::V1),
            "v2" => Ok(TpuKernel::V2),
            "v3" => Ok(TpuKernel::V3),
            other => Err(invalid(
                "FP8NSA_TPU_KERNEL",
                format!("expected v1, v2 or v3, got {other:?}"),
            )),
        }
    }
}

impl TpuKernel {
    /// From `FP8NSA_TPU_KERNEL`, default v1.
    pub fn from_env() -> Result<Self> {
        std::env::var("FP8NSA_TPU_KERNEL").map_or(Ok(TpuKernel::V1), |v| v.parse())
    }
}

/// Which CUDA fp8 GEMM path `Fp8Linear` runs (`FP8NSA_CUDA_FP8_KERNEL=auto|cublaslt|mma|small-m|dequant`
/// for layers left at `Auto`). `Auto` picks per call: the small-M kernel for decode, cuBLASLt
/// block scaling on sm_90 for 128x128 blocks, our fp8 tensor-core kernel for other block
/// shapes and sm_89, dequantize + cuBLAS otherwise. A forced path that does not apply to a
/// call is an error saying why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaFp8Kernel {
    #[default]
    Auto,
    /// cuBLASLt `VEC128_32F` x `BLK128x128_32F` (sm_90, 128x128 blocks, `ActQuant::Group`).
    CublasLt,
    /// Our fp8 `mma.sync` kernel (sm_89+, block K a multiple of 128, quantized activations).
    Mma,
    /// Our small-M kernel (M <= 16).
    SmallM,
    /// Dequantize the weight, then cuBLAS in the input dtype.
    Dequant,
}

impl FromStr for CudaFp8Kernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(CudaFp8Kernel::Auto),
            "cublaslt" => Ok(CudaFp8Kernel::CublasLt),
            "mma" => Ok(CudaFp8Kernel::Mma),
            "small-m" | "smallm" => Ok(CudaFp8Kernel::SmallM),
            "dequant" => Ok(CudaFp8Kernel::Dequant),
            other => Err(invalid(
                "FP8NSA_CUDA_FP8_KERNEL",
                format!("expected auto, cublaslt, mma, small-m or dequant, got {other:?}"),
            )),
        }
    }
}

impl CudaFp8Kernel {
    /// From `FP8NSA_CUDA_FP8_KERNEL`, default `Auto`.
    pub fn from_env() -> Result<Self> {
        std::env::var("FP8NSA_CUDA_FP8_KERNEL").map_or(Ok(CudaFp8Kernel::Auto), |v| v.parse())
    }
}

#[cfg(feature = "pjrt")]
pub use fp8nsa_pjrt::PjrtRuntime;

/// Stand-in for the PJRT runtime in builds without the `pjrt` feature.
#[cfg(not(feature = "pjrt"))]
#[derive(Debug)]
pub struct PjrtRuntime {
    _private: (),
}

#[cfg(not(feature = "pjrt"))]
impl PjrtRuntime {
    fn unavailable() -> Error {
        Error::Unsupported {
            op: "PjrtRuntime",
            device: "pjrt".into(),
            hint: "fp8nsa was built without the `pjrt` feature",
        }
    }

    pub fn load(_path: &str) -> Result<Self> {
        Err(Self::unavailable())
    }

    pub fn from_env() -> Result<Self> {
        Err(Self::unavailable())
    }

    pub fn platform(&self) -> &str {
        "none"
    }
}

/// Where an op runs.
#[derive(Clone, Debug, Default)]
pub enum Backend {
    /// The tensor's device (CPU tensors: the CPU kernels), unless `FP8NSA_BACKEND` is set.
    #[default]
    Auto,
    /// The CPU kernels.
    Cpu,
    /// The CUDA kernels (`cuda` feature); tensors must be on a CUDA device.
    Cuda,
    /// A PJRT plugin. Inputs are staged through the host; weights stay on the device.
    Pjrt(Arc<PjrtRuntime>),
}

/// The process-wide runtime `FP8NSA_BACKEND=pjrt` uses, loaded once.
fn env_runtime() -> Result<Arc<PjrtRuntime>> {
    static RT: OnceLock<std::result::Result<Arc<PjrtRuntime>, String>> = OnceLock::new();
    RT.get_or_init(|| {
        PjrtRuntime::from_env()
            .map(Arc::new)
            .map_err(|e| e.to_string())
    })
    .clone()
    .map_err(|msg| invalid("FP8NSA_BACKEND", format!("pjrt: {msg}")))
}

impl Backend {
    /// `Auto` resolved through `FP8NSA_BACKEND`; others as they are.
    pub(crate) fn resolve(&self) -> Result<Backend> {
        if !matches!(self, Backend::Auto) {
            return Ok(self.clone());
        }
        match std::env::var(BACKEND_ENV).ok().as_deref().map(str::trim) {
            None | Some("") | Some("auto") => Ok(Backend::Auto),
            Some("cpu") => Ok(Backend::Cpu),
            Some("cuda") => Ok(Backend::Cuda),
            Some("pjrt") => Ok(Backend::Pjrt(env_runtime()?)),
            Some(other) => Err(invalid(
                "FP8NSA_BACKEND",
                format!("expected cpu, cuda, pjrt or auto, got {other:?}"),
            )),
        }
    }
}

/// Whether the CUDA kernels run for a tensor on `device` under `backend` (already resolved):
/// `Auto` and `Cuda` on a CUDA device. `Cuda` on another device is an error.
pub(crate) fn use_cuda(
    backend: &Backend,
    device: &candle_core::Device,
    op: &'static str,
) -> Result<bool> {
    match backend {
        Backend::Auto => Ok(device.is_cuda()),
        Backend::Cuda if device.is_cuda() => Ok(true),
        Backend::Cuda => Err(Error::Unsupported {
            op,
            device: format!("{device:?}"),
            hint: "Backend::Cuda (FP8NSA_BACKEND=cuda) needs tensors on a CUDA device",
        }),
        Backend::Cpu | Backend::Pjrt(_) => Ok(false),
    }
}
