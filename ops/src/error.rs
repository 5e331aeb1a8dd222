use candle_core::DType;

/// Every error of fp8nsa-ops. Argument errors name the argument and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{arg}: expected shape {expected}, got {got:?}")]
    Shape {
        arg: &'static str,
        expected: String,
        got: Vec<usize>,
    },
    #[error("{arg}: expected dtype {expected}, got {got:?}")]
    DType {
        arg: &'static str,
        expected: &'static str,
        got: DType,
    },
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
    #[error("selection: batch {batch}, token {token}, kv head {head}, entry {entry}: {msg}")]
    Selection {
        batch: usize,
        token: usize,
        head: usize,
        entry: usize,
        msg: String,
    },
    /// An `FP8NSA_*` environment setting that does not parse.
    #[error("{var}: expected {expected}, got {got:?}")]
    Setting {
        var: &'static str,
        expected: &'static str,
        got: String,
    },
    #[error("{op}: no kernel for device {device}: {hint}")]
    Unsupported {
        op: &'static str,
        device: String,
        hint: &'static str,
    },
    /// A page pool has no free page for the step (what a server's scheduler preempts or
    /// waits on).
    #[error("pages: the {pool:?} pool ({pages} pages) has no free page left")]
    OutOfPages {
        pool: crate::nsa::NsaPool,
        pages: usize,
    },
    /// A page shared or released that its allocator does not count as held: a double
    /// release, or a share of a free page (which would hand it out twice).
    #[error("page {page} of the {pool:?} pool is not held: refused {op}")]
    PageNotHeld {
        pool: crate::nsa::NsaPool,
        page: usize,
        op: &'static str,
    },
    #[error(transparent)]
    Kernel(#[from] fp8nsa_cpu::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] fp8nsa_cuda::Error),
    #[cfg(feature = "pjrt")]
    #[error(transparent)]
    Pjrt(#[from] fp8nsa_pjrt::Error),
}

impl From<fp8nsa_types::Error> for Error {
    fn from(e: fp8nsa_types::Error) -> Self {
        match e {
            fp8nsa_types::Error::Invalid { arg, msg } => Error::Invalid { arg, msg },
            fp8nsa_types::Error::Setting { var, expected, got } => {
                Error::Setting { var, expected, got }
            }
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            // not `Error::wrap`: with RUST_BACKTRACE set it appends a whole backtrace to
            // the message a server logs or returns; our errors name their argument instead
            other => candle_core::Error::Wrapped(Box::new(other)),
        }
    }
}

pub(crate) fn shape_err(arg: &'static str, expected: impl Into<String>, got: &[usize]) -> Error {
    Error::Shape {
        arg,
        expected: expected.into(),
        got: got.to_vec(),
    }
}

pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        msg: msg.into(),
    }
}
