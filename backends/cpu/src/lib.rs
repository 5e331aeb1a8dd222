//! CPU kernels of fp8nsa on plain slices.
//!
//! Nothing here knows Candle: every entry point takes slices plus a small shape struct, so each
//! kernel can be tested alone. `fp8nsa-ops` turns tensors into these calls.
//!
//! ```
//! use fp8nsa_cpu::{fp8, linear::fp8_linear, quant};
//! use fp8nsa_types::{ActQuant, LinearShape};
//! // A 2x3 weight with one 1x2 block scale row; x is one token.
//! let w = [0.5f32, -1.0, 2.0, 4.0, 0.25, -8.0];
//! let shape = LinearShape::new(1, 2, 3, 128, 128).unwrap();
//! let (wq, sw) = quant::quantize_weight(&w, shape.n(), shape.k(), shape.bn(), shape.bk()).unwrap();
//! let mut y = [0f32; 2];
//! fp8_linear(&[1.0, 1.0, 1.0], &wq, &sw, None, shape, ActQuant::None, &mut y).unwrap();
//! assert!((y[0] - 1.5).abs() < 1e-6 && (y[1] + 3.75).abs() < 1e-6);
//! assert_eq!(fp8::e4m3_to_f32(fp8::f32_to_e4m3(448.0)), 448.0);
//! ```

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
pub mod dsa;
mod error;
pub mod experts;
pub mod fp8;
pub mod linear;
pub mod mem;
pub mod nsa;
pub mod nsa_select;
pub mod quant;
pub mod rope;
mod scratch;
pub mod simd;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use error::{Error, Result};
