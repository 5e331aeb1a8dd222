//! The environment settings, parsed once per process into one typed value.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::kernel::{BackendKind, CudaFp8Kernel, TpuKernel};

/// `cpu`, `cuda`, `pjrt` or `auto`: where layers left at `Backend::Auto` run.
pub const BACKEND_ENV: &str = "FP8NSA_BACKEND";
/// `v1`, `v2` or `v3`: the PJRT fp8 kernel variant of layers that do not set one.
pub const TPU_KERNEL_ENV: &str = "FP8NSA_TPU_KERNEL";
/// `auto`, `cublaslt`, `mma`, `small-m` or `dequant`: the CUDA fp8 path of layers that do not
/// set one.
pub const CUDA_FP8_KERNEL_ENV: &str = "FP8NSA_CUDA_FP8_KERNEL";
/// Key count below which selection attention runs the dense fallback.
pub const NSA_MIN_LEN_ENV: &str = "FP8NSA_NSA_MIN_LEN";
/// Path of the PJRT plugin (`.so`) `PjrtRuntime::from_env` loads.
pub const PJRT_PLUGIN_ENV: &str = "FP8NSA_PJRT_PLUGIN";

/// Default of [`Settings::nsa_min_len`] (docs/nsa.md, "SDPA fallback").
pub const DEFAULT_MIN_LEN: usize = 2048;

/// Every `FP8NSA_*` setting a layer reads, parsed once. An unset or empty variable means the
/// default. A value that does not parse stays an error in its own field, naming the variable:
/// every call that needs that setting returns it (never silently replaced by the default),
/// and calls that do not need it are not affected.
///
/// ```
/// use fp8nsa_types::{BackendKind, CudaFp8Kernel, Error, Settings};
///
/// let vars = |name: &str| match name {
///     "FP8NSA_BACKEND" => Some("cuda".to_string()),
///     "FP8NSA_CUDA_FP8_KERNEL" => Some("mma".to_string()),
///     "FP8NSA_NSA_MIN_LEN" => Some("lots".to_string()),
///     _ => None,
/// };
/// let s = Settings::from_vars(vars);
/// assert_eq!(s.backend, Ok(BackendKind::Cuda));
/// assert_eq!(s.cuda_fp8_kernel, Ok(CudaFp8Kernel::Mma));
/// assert!(matches!(s.nsa_min_len, Err(Error::Setting { var: "FP8NSA_NSA_MIN_LEN", .. })));
/// assert!(s.check().is_err());
/// assert_eq!(Settings::from_vars(|_| None).nsa_min_len, Ok(2048));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub backend: Result<BackendKind>,
    pub tpu_kernel: Result<TpuKernel>,
    pub cuda_fp8_kernel: Result<CudaFp8Kernel>,
    pub nsa_min_len: Result<usize>,
    pub pjrt_plugin: Option<PathBuf>,
}

impl Settings {
    /// Parses the settings from `var` (a variable's value, `None` when unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let nsa_min_len = match get(NSA_MIN_LEN_ENV) {
            None => Ok(DEFAULT_MIN_LEN),
            Some(v) => v.trim().parse().map_err(|_| Error::Setting {
                var: NSA_MIN_LEN_ENV,
                expected: "a key count (an unsigned integer)",
                got: v.clone(),
            }),
        };
        Settings {
            backend: get(BACKEND_ENV).map_or(Ok(BackendKind::Auto), |v| v.parse()),
            tpu_kernel: get(TPU_KERNEL_ENV).map_or(Ok(TpuKernel::V1), |v| v.parse()),
            cuda_fp8_kernel: get(CUDA_FP8_KERNEL_ENV)
                .map_or(Ok(CudaFp8Kernel::Auto), |v| v.parse()),
            nsa_min_len,
            pjrt_plugin: get(PJRT_PLUGIN_ENV).map(PathBuf::from),
        }
    }

    /// The first setting that does not parse, if any (e.g. to refuse a bad environment at a
    /// server's start rather than at its first request).
    pub fn check(&self) -> Result<()> {
        self.backend.as_ref().map_err(Clone::clone)?;
        self.tpu_kernel.as_ref().map_err(Clone::clone)?;
        self.cuda_fp8_kernel.as_ref().map_err(Clone::clone)?;
        self.nsa_min_len.as_ref().map_err(Clone::clone)?;
        Ok(())
    }

    /// The process's settings, read from the environment on first use and kept: a server sets
    /// its environment before it builds layers, and no call pays for parsing it again.
    pub fn global() -> &'static Settings {
        static SETTINGS: OnceLock<Settings> = OnceLock::new();
        SETTINGS.get_or_init(|| Settings::from_vars(|name| std::env::var(name).ok()))
    }
}

impl Default for Settings {
    /// What an empty environment gives.
    fn default() -> Self {
        Settings::from_vars(|_| None)
    }
}
