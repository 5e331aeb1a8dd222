/// Errors of the CPU kernels: always about the arguments, never about the machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A slice or dimension does not have the size the shape implies.
    #[error("{arg}: expected {expected}, got {got}")]
    Shape {
        arg: &'static str,
        expected: String,
        got: String,
    },
    /// A parameter is outside its domain (zero block size, empty matrix, ...).
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
}

/// The vocabulary's own checks (shapes, dims, schemes) report the same way as ours.
impl From<fp8nsa_types::Error> for Error {
    fn from(e: fp8nsa_types::Error) -> Self {
        let (arg, msg) = e.into_arg_msg();
        Error::Invalid { arg, msg }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn check_len(arg: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Shape {
            arg,
            expected: format!("{expected} elements"),
            got: format!("{got}"),
        })
    }
}

pub(crate) fn check_positive(arg: &'static str, v: usize) -> Result<()> {
    if v == 0 {
        Err(Error::Invalid {
            arg,
            msg: "must be at least 1, got 0".into(),
        })
    } else {
        Ok(())
    }
}
