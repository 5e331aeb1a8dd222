//! f64 reference implementations: the literal formulas of docs/numerics.md and docs/nsa.md,
//! written to be obviously right rather than fast. Every backend is tested against these.

mod fp8;
mod nsa;

pub use fp8::{fp8_experts, fp8_linear};
pub use nsa::{nsa_layer, nsa_selection, NsaLayerReference};
