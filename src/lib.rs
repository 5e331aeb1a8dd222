//! # fp8nsa
//!
//! Drop-in layers for Rust LLM servers built on Candle:
//!
//! - [`Fp8Linear`]: fp8 e4m3fn weights with 2-D block scales (the DeepSeek-V3 / Qwen3-FP8
//!   checkpoint format), dynamic activation quantization ([`ActQuant`]), f32 accumulation.
//! - [`nsa`]: NSA selection attention over selected key blocks or arbitrary ranges, with a dense
//!   masked-SDPA fallback.
//! - [`reference`]: the f64 reference every backend is tested against.
//! - [`types`]: the vocabulary every backend shares (shapes, sequences, selections as spans,
//!   kernel choices, [`Settings`] parsed once from the environment).
//!
//! This crate only re-exports. The `fp8nsa` command (demo, `quantize`, `inspect`,
//! `export-tpu`) lives in `fp8nsa-cli`, program inspection in `fp8nsa-inspect`.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use fp8nsa::{ActQuant, Fp8BlockWeight, Fp8Linear};
//!
//! let dev = Device::Cpu;
//! let w = Tensor::randn(0f32, 0.02, (576, 3884), &dev)?; // [out, in], like candle_nn::Linear
//! let fp8 = Fp8BlockWeight::quantize(&w, [128, 128])?; // 1 byte per weight + 5x31 scales
//! let layer = Fp8Linear::new(fp8, None, ActQuant::Group)?; // W8A8, per-token 1x128 groups
//! let x = Tensor::randn(0f32, 1.0, (1, 7, 3884), &dev)?.to_dtype(DType::BF16)?;
//! let y = layer.forward(&x)?; // [1, 7, 576], bf16
//! let want = fp8nsa::reference::fp8_linear(&x, layer.weight(), None, ActQuant::Group)?;
//! assert_eq!(y.dims(), want.dims());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The same layers run on CUDA tensors with the `cuda` feature (kernels compiled by nvcc at
//! build time, cuBLASLt block scaling on sm_90); on the CPU otherwise.
//!
//! `Fp8Linear::forward_with_path` and `SelectionAttention::forward_with_path` return which
//! implementation ran; `RUST_LOG=fp8nsa=debug` (with a `tracing` subscriber) logs the same.

pub use fp8nsa_ops::Error as OpsError;
pub use fp8nsa_ops::{
    dense_linear, silu_mul, ActQuant, Backend, CudaFp8Kernel, CudaFp8Path, Fp8BlockWeight,
    Fp8Experts, Fp8Linear, Fp8Moe, Fp8Path, MoeRouter, PjrtRuntime, ScaleDType, Settings,
    TpuKernel,
};
pub use fp8nsa_ops::{Error, Result};
/// The shared vocabulary (shapes, sequences, selections as spans, kernel choices, settings)
/// that every backend takes directly.
pub use fp8nsa_types as types;

/// The CUDA backend's kernel-level API (`cuda` feature): cudarc views in, cudarc views out,
/// for callers that manage their own buffers (and for the GPU tests, which poison outputs).
#[cfg(feature = "cuda")]
pub mod cuda {
    pub use fp8nsa_cuda::*;
}

/// The Llama-family decoder on these layers, its loaders and generation.
pub mod models {
    pub use fp8nsa_models::*;
}

/// The CPU backend's instruction-set tier: which kernels run on this machine
/// (`Tier::current()`), and the cap tests use to force each one.
pub mod cpu {
    pub use fp8nsa_cpu::simd::Tier;
}

/// The fp8 block-scaled format and layer, with the CPU kernel choice a path reports.
pub mod fp8 {
    pub use fp8nsa_ops::fp8::*;
}

/// Native Sparse Attention: selection types and [`nsa::SelectionAttention`].
pub mod nsa {
    pub use fp8nsa_ops::nsa::*;
}

/// f64 reference implementations of the numerics contract.
pub mod reference {
    pub use fp8nsa_ops::reference::{
        fp8_experts, fp8_linear, nsa_layer, nsa_selection, NsaLayerReference,
    };
}
