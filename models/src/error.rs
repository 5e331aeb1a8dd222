use std::path::PathBuf;

/// Errors of fp8nsa-models.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Ops(#[from] fp8nsa_ops::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        msg: msg.into(),
    }
}
