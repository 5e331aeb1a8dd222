//! fp8nsa-cuda: the CUDA backend of fp8nsa. Kernels in `kernels/*.cu` are compiled to PTX by
//! nvcc at build time (one PTX per target family, picked by compute capability at run time)
//! and launched through cudarc on the caller's stream; cuBLASLt runs the block-scaled fp8 GEMM
//! where it applies. Nothing here knows Candle: inputs are cudarc views plus shape structs.
//!
//! - [`fp8`]: the fp8 block-scaled linear layer (activation quantization, cuBLASLt block
//!   scaling on sm_90, our tensor-core kernel for other block shapes and sm_89, a small-M
//!   kernel for decode, dequantize + cuBLAS as the last resort).
//! - [`nsa`]: NSA selection attention (tensor cores, spans normalized in-kernel, split-KV
//!   decode merged by log-sum-exp).
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! let stream = CudaContext::new(0)?.default_stream();
//! let info = fp8nsa_cuda::device_info(&stream)?;
//! println!("sm_{}{}: PTX family {:?}", info.cc.0, info.cc.1, info.family);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod blas;
mod context;
mod element;
#[cfg(feature = "emu")]
pub mod emu;
mod error;
pub mod fp8;
pub mod launch;
pub mod nsa;
pub mod ptx;
#[cfg(test)]
mod ptx_tests;
pub mod step;

pub use context::{device_info, DeviceInfo};
pub use element::Element;
pub use error::{Error, Result};

/// The nvcc release the kernels were built with.
pub const NVCC_VERSION: &str = env!("FP8NSA_NVCC_VERSION");
