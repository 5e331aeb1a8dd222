//! fp8nsa-cli: the tools around the layers, as a library the `fp8nsa` command is built on.
//!
//! - [`convert`]: quantizing a safetensors checkpoint to the fp8 block-scaled format (the
//!   `fp8nsa quantize` command);
//! - [`Error`]: the layers' errors plus those of files, JSON and safetensors.
//!
//! Program inspection (`fp8nsa inspect`) is its own crate, `fp8nsa-inspect`.

pub mod convert;
mod error;

pub use error::{Error, Result};
