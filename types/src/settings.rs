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
/// default; a value that does not parse is an error naming the variable, returned by every
/// call that needs the settings (never silently replaced by the default).
///
/// ```
/// use fp8nsa_types::{BackendKind, CudaFp8Kernel, Error, Settings};
///
/// let vars = |name: &str| match name {
///     "FP8NSA_BACKEND" => Some("cuda".to_string()),
///     "FP8NSA_CUDA_FP8_KERNEL" => Some("mma".to_string()),
///     _ => None,
/// };
/// let s = Settings::from_vars(vars)?;
/// assert_eq!((s.backend, s.cuda_fp8_kernel), (BackendKind::Cuda, CudaFp8Kernel::Mma));
/// assert_eq!(s.nsa_min_len, 2048);
///
/// let bad = Settings::from_vars(|n| (n == "FP8NSA_NSA_MIN_LEN").then(|| "lots".to_string()));
/// assert!(matches!(bad, Err(Error::Setting { var: "FP8NSA_NSA_MIN_LEN", .. })));
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub backend: BackendKind,
    pub tpu_kernel: TpuKernel,
    pub cuda_fp8_kernel: CudaFp8Kernel,
    pub nsa_min_len: usize,
    pub pjrt_plugin: Option<PathBuf>,
}

impl Default for Settings {
    /// What an empty environment gives.
    fn default() -> Self {
        Settings {
            backend: BackendKind::Auto,
            tpu_kernel: TpuKernel::V1,
            cuda_fp8_kernel: CudaFp8Kernel::Auto,
            nsa_min_len: DEFAULT_MIN_LEN,
            pjrt_plugin: None,
        }
    }
}

impl Settings {
    /// Parses the settings from `var` (a variable's value, `None` when unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let nsa_min_len = match get(NSA_MIN_LEN_ENV) {
            None => DEFAULT_MIN_LEN,
            Some(v) => v.trim().parse().map_err(|_| Error::Setting {
                var: NSA_MIN_LEN_ENV,
                expected: "a key count (an unsigned integer)",
                got: v.clone(),
            })?,
        };
        Ok(Settings {
            backend: get(BACKEND_ENV).map_or(Ok(BackendKind::Auto), |v| v.parse())?,
            tpu_kernel: get(TPU_KERNEL_ENV).map_or(Ok(TpuKernel::V1), |v| v.parse())?,
            cuda_fp8_kernel: get(CUDA_FP8_KERNEL_ENV)
                .map_or(Ok(CudaFp8Kernel::Auto), |v| v.parse())?,
            nsa_min_len,
            pjrt_plugin: get(PJRT_PLUGIN_ENV).map(PathBuf::from),
        })
    }

    /// The process's settings, read from the environment on first use and kept: a server sets
    /// its environment before it builds layers, and no call pays for parsing it again.
    pub fn global() -> Result<&'static Settings> {
        static SETTINGS: OnceLock<Result<Settings>> = OnceLock::new();
        SETTINGS
            .get_or_init(|| Settings::from_vars(|name| std::env::var(name).ok()))
            .as_ref()
            .map_err(Clone::clone)
    }
}
