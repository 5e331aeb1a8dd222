use std::path::PathBuf;

/// Errors of fp8nsa-serve: starting the server (loading the model, binding the address).
/// Request errors are HTTP answers, not these.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Models(#[from] fp8nsa::models::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;
