//! Kernel and backend choices: what a caller (or the environment) may force.

use std::str::FromStr;

use crate::error::Error;

/// Where an op runs when the caller leaves it to the environment (`FP8NSA_BACKEND`).
///
/// ```
/// use fp8nsa_types::BackendKind;
/// assert_eq!("PJRT".parse::<BackendKind>(), Ok(BackendKind::Pjrt));
/// assert!("tpu".parse::<BackendKind>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The tensor's device.
    #[default]
    Auto,
    Cpu,
    Cuda,
    Pjrt,
}

impl FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendKind::Auto),
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" => Ok(BackendKind::Cuda),
            "pjrt" => Ok(BackendKind::Pjrt),
            _ => Err(Error::Setting {
                var: crate::BACKEND_ENV,
                expected: "cpu, cuda, pjrt or auto",
                got: s.into(),
            }),
        }
    }
}

/// The fp8 linear kernel variants on PJRT: `V1` is the XLA-native program (any platform);
/// `V2` (manual async DMA, double buffering) and `V3` (V2 with the scales in SMEM) are
/// TPU-only Mosaic kernels, and asking for them elsewhere is an error naming the platform.
///
/// ```
/// use fp8nsa_types::TpuKernel;
/// assert_eq!(" V3 ".parse::<TpuKernel>(), Ok(TpuKernel::V3));
/// assert_eq!(TpuKernel::V2.name(), "v2");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TpuKernel {
    #[default]
    V1,
    V2,
    V3,
}

impl TpuKernel {
    pub fn name(self) -> &'static str {
        match self {
            TpuKernel::V1 => "v1",
            TpuKernel::V2 => "v2",
            TpuKernel::V3 => "v3",
        }
    }
}

impl FromStr for TpuKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "v1" => Ok(TpuKernel::V1),
            "v2" => Ok(TpuKernel::V2),
            "v3" => Ok(TpuKernel::V3),
            _ => Err(Error::Setting {
                var: crate::TPU_KERNEL_ENV,
                expected: "v1, v2 or v3",
                got: s.into(),
            }),
        }
    }
}

/// Which CUDA fp8 GEMM path `Fp8Linear` runs. `Auto` picks per call: the small-M kernel for
/// decode, cuBLASLt block scaling on sm_90 for 128x128 blocks, our fp8 tensor-core kernel for
/// other block shapes and sm_89, dequantize + cuBLAS otherwise. A forced path that does not
/// apply to a call is an error saying why.
///
/// ```
/// use fp8nsa_types::CudaFp8Kernel;
/// assert_eq!("".parse::<CudaFp8Kernel>(), Ok(CudaFp8Kernel::Auto));
/// assert_eq!("gemv".parse::<CudaFp8Kernel>(), Ok(CudaFp8Kernel::SmallM));
/// assert!("wgmma".parse::<CudaFp8Kernel>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaFp8Kernel {
    #[default]
    Auto,
    /// cuBLASLt `VEC128_32F` x `BLK128x128_32F` (sm_90, 128x128 blocks, `ActQuant::Group`).
    CublasLt,
    /// Our fp8 `mma.sync` kernel (sm_89+, block K a multiple of 128, quantized activations).
    Mma,
    /// Our small-M kernel (decode).
    SmallM,
    /// Dequantize the weight, then cuBLAS in the input dtype.
    Dequant,
}

impl FromStr for CudaFp8Kernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(CudaFp8Kernel::Auto),
            "cublaslt" => Ok(CudaFp8Kernel::CublasLt),
            "mma" => Ok(CudaFp8Kernel::Mma),
            "small-m" | "smallm" | "gemv" => Ok(CudaFp8Kernel::SmallM),
            "dequant" => Ok(CudaFp8Kernel::Dequant),
            _ => Err(Error::Setting {
                var: crate::CUDA_FP8_KERNEL_ENV,
                expected: "auto, cublaslt, mma, small-m or dequant",
                got: s.into(),
            }),
        }
    }
}

/// Rows per block of the CUDA fp8 tensor-core kernel's tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MmaTile {
    /// 128 x 128 tiles, 8 warps (large M).
    M128,
    /// 64 x 128 tiles, 4 warps.
    M64,
    /// 16 x 128 tiles, 4 warps (decode batches; usually split over K).
    M16,
}

impl MmaTile {
    pub fn rows(self) -> usize {
        match self {
            MmaTile::M128 => 128,
            MmaTile::M64 => 64,
            MmaTile::M16 => 16,
        }
    }

    /// The tile as kernel names spell it.
    pub fn name(self) -> &'static str {
        match self {
            MmaTile::M128 => "128x128",
            MmaTile::M64 => "64x128",
            MmaTile::M16 => "16x128",
        }
    }
}

/// The path one CUDA fp8 linear call takes, as the CUDA planner decides it (and as
/// `Fp8Linear::forward_with_path` reports it).
///
/// ```
/// use fp8nsa_types::{CudaFp8Path, MmaTile};
/// let p = CudaFp8Path::Mma { tile: MmaTile::M16, splits: 4 };
/// assert_eq!(p.to_string(), "mma-16x128-splitk4");
/// assert_eq!(p.kernel(), fp8nsa_types::CudaFp8Kernel::Mma);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaFp8Path {
    /// cuBLASLt with `VEC128_32F` activation and `BLK128x128_32F` weight scales (sm_90).
    CublasLt,
    /// Our fp8 tensor-core kernel; `splits > 1` splits K across blocks.
    Mma { tile: MmaTile, splits: usize },
    /// Our small-M CUDA-core kernel, the weight streamed once.
    SmallM { tokens: usize },
    /// Dequantize the weight, then cuBLAS in the input dtype.
    Dequant,
}

impl CudaFp8Path {
    /// The kernel choice that names this path (what `with_cuda_kernel` would force).
    pub fn kernel(self) -> CudaFp8Kernel {
        match self {
            CudaFp8Path::CublasLt => CudaFp8Kernel::CublasLt,
            CudaFp8Path::Mma { .. } => CudaFp8Kernel::Mma,
            CudaFp8Path::SmallM { .. } => CudaFp8Kernel::SmallM,
            CudaFp8Path::Dequant => CudaFp8Kernel::Dequant,
        }
    }
}

impl std::fmt::Display for CudaFp8Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaFp8Path::CublasLt => write!(f, "cublaslt-blockscale"),
            CudaFp8Path::Mma { tile, splits } => {
                write!(f, "mma-{}-splitk{splits}", tile.name())
            }
            CudaFp8Path::SmallM { tokens } => write!(f, "small-m{tokens}"),
            CudaFp8Path::Dequant => write!(f, "dequant-cublas"),
        }
    }
}

/// The CPU fp8 linear kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuFp8Kernel {
    /// The decode GEMV (few rows): each weight byte streamed once, decoded in registers.
    Gemv,
    /// The panel GEMM: weight panels decoded once per tile of rows.
    PanelGemm,
}

impl CpuFp8Kernel {
    pub fn name(self) -> &'static str {
        match self {
            CpuFp8Kernel::Gemv => "cpu-gemv",
            CpuFp8Kernel::PanelGemm => "cpu-panel-gemm",
        }
    }
}

/// The path a CPU fp8 linear call ran: the kernel and the SIMD tier it ran at, both decided
/// once, by the CPU backend's planner.
///
/// ```
/// use fp8nsa_types::{CpuFp8Kernel, CpuFp8Path, Tier};
/// let p = CpuFp8Path { kernel: CpuFp8Kernel::Gemv, tier: Tier::Avx2 };
/// assert_eq!(p.to_string(), "cpu-gemv/avx2");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuFp8Path {
    pub kernel: CpuFp8Kernel,
    pub tier: crate::Tier,
}

impl std::fmt::Display for CpuFp8Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kernel.name(), self.tier.name())
    }
}
