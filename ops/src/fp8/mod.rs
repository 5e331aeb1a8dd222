//! The fp8 e4m3fn block-scaled format and the layer built on it.

mod act;
mod cuda;
mod linear;
mod pjrt;
pub(crate) mod weight;

pub use act::ActQuant;
pub use linear::Fp8Linear;
pub use weight::Fp8BlockWeight;
