//! fp8nsa-cli: the tools around the layers, as a library the `fp8nsa` command is built on.
//!
//! - [`convert`]: quantizing a safetensors checkpoint to the fp8 block-scaled format (the
//!   `fp8nsa quantize` command);
//! - [`llama_cpp`]: a built llama.cpp found in the peers' cache and timed beside the demo's rows;
//! - [`Error`]: the layers' errors plus those of files, JSON and safetensors.
//!
//! Program inspection (`fp8nsa inspect`) is its own crate, `fp8nsa-inspect`.

pub mod convert;
mod error;
pub mod llama_cpp;

pub use error::{Error, Result};
