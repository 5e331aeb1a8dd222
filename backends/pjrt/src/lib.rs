//! fp8nsa-pjrt: the PJRT backend. Layered like cudarc: [`sys`] is the raw C ABI of the PJRT
//! C API 0.81 (our own `#[repr(C)]` definitions), [`safe`] owns plugin objects, and
//! [`PjrtRuntime`] runs the StableHLO [`programs`] for fp8 linear and NSA selection. Nothing
//! here knows Candle.
//!
//! ```no_run
//! use fp8nsa_pjrt::PjrtRuntime;
//! use fp8nsa_types::{ActQuant, TpuKernel};
//! let rt = PjrtRuntime::from_env()?; // FP8NSA_PJRT_PLUGIN, or the pip-installed XLA CPU plugin
//! let w = rt.upload_weight(&[0x38; 6], &[0.5], None, 2, 3, [128, 128])?; // once
//! let y = rt.fp8_linear(&[1.0, 2.0, 3.0], 1, &w, ActQuant::Group, TpuKernel::V1)?;
//! assert_eq!(y.len(), 2);
//! # Ok::<(), fp8nsa_pjrt::Error>(())
//! ```

mod error;
pub mod programs;
pub mod proto;
mod runtime;
pub mod safe;
pub mod sys;
pub mod tpu;

pub use error::{code_name, Error, Result};
pub use runtime::{locate_cpu_plugin, DeviceWeight, PjrtRuntime};
