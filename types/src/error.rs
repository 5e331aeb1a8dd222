/// Every error of fp8nsa-types: a value that is outside its domain, named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument or shape field is outside its domain (zero block size, bm = 0, ...).
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
    /// An environment setting (or a string offered in its place) that does not parse.
    #[error("{var}: expected {expected}, got {got:?}")]
    Setting {
        var: &'static str,
        expected: &'static str,
        got: String,
    },
}

impl Error {
    /// The argument named and the message, as a backend's own argument error carries them
    /// (a setting that does not parse names its variable, with the whole message).
    ///
    /// ```
    /// let e = fp8nsa_types::LinearShape::new(1, 2, 3, 0, 4).unwrap_err();
    /// assert_eq!(e.into_arg_msg().0, "bn");
    /// ```
    pub fn into_arg_msg(self) -> (&'static str, String) {
        match self {
            Error::Invalid { arg, msg } => (arg, msg),
            Error::Setting { var, .. } => (var, self.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

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
