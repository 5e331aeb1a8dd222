use std::path::PathBuf;

/// Errors of the `fp8nsa` facade: the layers' errors plus those of the checkpoint tools.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Ops(#[from] fp8nsa::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {source}")]
    Safetensors {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },
    #[error("{path}: writing failed: {source}")]
    Write {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },
    #[error("{path}: tensor {name}: {source}")]
    Tensor {
        path: PathBuf,
        name: String,
        source: Box<fp8nsa::Error>,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;
