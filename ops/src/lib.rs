//! fp8nsa-ops: the formats, the f64 reference math, the Candle custom ops and every dispatch
//! decision. Backends below it know nothing of Candle; models above it only see layers.
//!
//! ```
//! use candle_core::{Device, Module, Tensor};
//! use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Linear};
//!
//! let dev = Device::Cpu;
//! let w = Tensor::randn(0f32, 1.0, (576, 384), &dev)?;
//! let lin = Fp8Linear::new(Fp8BlockWeight::quantize(&w, [128, 128])?, None, ActQuant::Group)?;
//! let y = lin.forward(&Tensor::randn(0f32, 1.0, (2, 5, 384), &dev)?)?;
//! assert_eq!(y.dims(), &[2, 5, 576]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod act;
pub mod backend;
#[cfg(feature = "cuda")]
mod cuda;
mod dense;
mod error;
pub mod fp8;
pub mod nsa;
pub mod reference;
mod rope;
mod storage;

pub use act::{add_rms_norm, residual_add, silu_mul};
pub use backend::{Backend, PjrtRuntime};
pub use dense::dense_linear;
pub use error::{Error, Result};
pub use fp8::{
    ActQuant, Fp8BlockWeight, Fp8Experts, Fp8Linear, Fp8Moe, Fp8Path, MoeRouter, Routing,
    ScaleDType,
};
pub use fp8nsa_types::{CudaFp8Kernel, CudaFp8Path, MmaTile, RopeStyle, Settings, TpuKernel};
pub use rope::rope;
pub use storage::{advise_huge_pages, zeros_committed};
