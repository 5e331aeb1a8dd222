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
        pool: fp8nsa_types::NsaPool,
        pages: usize,
    },
    /// A page shared or released that its allocator does not count as held: a double
    /// release, or a share of a free page (which would hand it out twice).
    #[error("page {page} of the {pool:?} pool is not held: refused {op}")]
    PageNotHeld {
        pool: fp8nsa_types::NsaPool,
        page: usize,
        op: &'static str,
    },
    /// A CPU kernel's buffer check failed (the buffers ops handed it do not match the plan):
    /// a bug of ours, never the caller's argument. Argument errors arrive as [`Error::Invalid`]
    /// from every backend and entry point.
    #[error(transparent)]
    Kernel(fp8nsa_cpu::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A CUDA refusal (`Unsupported`), driver or library error (argument errors arrive as
    /// [`Error::Invalid`]).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(fp8nsa_cuda::Error),
    /// A PJRT plugin's error or refusal (argument errors arrive as [`Error::Invalid`]).
    #[cfg(feature = "pjrt")]
    #[error(transparent)]
    Pjrt(fp8nsa_pjrt::Error),
}

// One failure, one variant, whichever backend or entry point reached it: a backend's argument
// error is ours (`Invalid`, naming the argument); everything else keeps the backend's type.

impl From<fp8nsa_cpu::Error> for Error {
    fn from(e: fp8nsa_cpu::Error) -> Self {
        match e {
            fp8nsa_cpu::Error::Invalid { arg, msg } => Error::Invalid { arg, msg },
            other => Error::Kernel(other),
        }
    }
}

#[cfg(feature = "cuda")]
impl From<fp8nsa_cuda::Error> for Error {
    fn from(e: fp8nsa_cuda::Error) -> Self {
        match e {
            fp8nsa_cuda::Error::Invalid { arg, msg } => Error::Invalid { arg, msg },
            other => Error::Cuda(other),
        }
    }
}

#[cfg(feature = "pjrt")]
impl From<fp8nsa_pjrt::Error> for Error {
    fn from(e: fp8nsa_pjrt::Error) -> Self {
        match e {
            fp8nsa_pjrt::Error::Invalid { arg, msg } => Error::Invalid { arg, msg },
            other => Error::Pjrt(other),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend's argument error is the caller's `Invalid`, whichever backend refused; only
    /// a buffer check (our bug) stays the backend's.
    #[test]
    fn backend_argument_errors_are_invalid() {
        let cpu = fp8nsa_cpu::Error::Invalid {
            arg: "seqs",
            msg: "sequence 1".into(),
        };
        assert!(matches!(
            Error::from(cpu),
            Error::Invalid { arg: "seqs", .. }
        ));
        let buf = fp8nsa_cpu::Error::Shape {
            arg: "out",
            expected: "4 elements".into(),
            got: "3".into(),
        };
        assert!(matches!(
            Error::from(buf),
            Error::Kernel(fp8nsa_cpu::Error::Shape { arg: "out", .. })
        ));
        #[cfg(feature = "pjrt")]
        {
            let p = fp8nsa_pjrt::Error::Invalid {
                arg: "x",
                msg: String::new(),
            };
            assert!(matches!(Error::from(p), Error::Invalid { arg: "x", .. }));
        }
    }
}
