//! Where an op runs. `Backend::Auto` follows the tensor's device (CPU tensors: the CPU
//! kernels; CUDA tensors: the CUDA kernels) unless `FP8NSA_BACKEND` says otherwise;
//! `Backend::Pjrt` names a PJRT runtime explicitly. Without the `pjrt` / `cuda` features the
//! types still exist (as in Candle's dummy backends), and using them is an error that says how
//! to get them.

use std::sync::{Arc, OnceLock};

use fp8nsa_types::BackendKind;

use crate::error::{invalid, Error, Result};

pub use fp8nsa_types::{CudaFp8Kernel, TpuKernel, BACKEND_ENV};

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
        Ok(match fp8nsa_types::Settings::global().backend.clone()? {
            BackendKind::Auto => Backend::Auto,
            BackendKind::Cpu => Backend::Cpu,
            BackendKind::Cuda => Backend::Cuda,
            BackendKind::Pjrt => Backend::Pjrt(env_runtime()?),
        })
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
