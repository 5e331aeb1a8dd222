//! The fp8 e4m3fn block-scaled format and the layer built on it.

mod cuda;
mod linear;
mod pjrt;
pub(crate) mod weight;

pub use fp8nsa_types::ActQuant;
pub use linear::Fp8Linear;
pub use weight::Fp8BlockWeight;
