//! Where an op runs. `Backend::Auto` follows the tensor's device unless `FP8NSA_BACKEND` says
//! otherwise; `Backend::Pjrt` names a PJRT runtime explicitly. Without the `pjrt` feature the
//! PJRT types still exist (as in Candle's dummy backends), and creating a runtime is an error
//! that says how to get one.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::error::{invalid, Error, Result};

/// Environment variable overriding `Backend::Auto`: `cpu`, `pjrt` or `auto`.
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
            Some("pjrt") => Ok(Backend::Pjrt(env_runtime()?)),
            Some(other) => Err(invalid(
                "FP8NSA_BACKEND",
                format!("expected cpu, pjrt or auto, got {other:?}"),
            )),
        }
    }
}
