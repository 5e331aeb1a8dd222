use cudarc::cublas::result::CublasError;
use cudarc::cublaslt::result::CublasError as CublasLtError;
use cudarc::driver::DriverError;

/// Every error of fp8nsa-cuda. Argument errors name the argument and what was expected; a
/// kernel that does not apply says why, so callers can fall back and log the reason.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
    #[error("{op}: {reason}")]
    Unsupported { op: &'static str, reason: String },
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("cuBLAS: {0:?}")]
    Cublas(CublasError),
    #[error("cuBLASLt: {0:?}")]
    CublasLt(CublasLtError),
}

pub type Result<T> = std::result::Result<T, Error>;

/// The vocabulary's own checks (shapes, dims) report as ours.
impl From<fp8nsa_types::Error> for Error {
    fn from(e: fp8nsa_types::Error) -> Self {
        let (arg, msg) = e.into_arg_msg();
        Error::Invalid { arg, msg }
    }
}

impl From<CublasError> for Error {
    fn from(e: CublasError) -> Self {
        Error::Cublas(e)
    }
}

pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        msg: msg.into(),
    }
}

pub(crate) fn unsupported(op: &'static str, reason: impl Into<String>) -> Error {
    Error::Unsupported {
        op,
        reason: reason.into(),
    }
}

impl From<CublasLtError> for Error {
    fn from(e: CublasLtError) -> Self {
        Error::CublasLt(e)
    }
}
