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
