/// Errors of the PJRT backend. Plugin errors carry the plugin's own message and status code.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("{context}: {message} (PJRT status {code} {})", code_name(*code))]
    Plugin {
        context: &'static str,
        code: i32,
        message: String,
    },
    #[error("cannot load PJRT plugin {path}: {message}")]
    Load { path: String, message: String },
    #[error("{arg}: {msg}")]
    Invalid { arg: &'static str, msg: String },
    #[error("{what} is a TPU-only kernel; this PJRT plugin's platform is {platform:?}")]
    NotOnPlatform { what: String, platform: String },
}

impl From<fp8nsa_types::Error> for Error {
    fn from(e: fp8nsa_types::Error) -> Self {
        let (arg, msg) = e.into_arg_msg();
        Error::Invalid { arg, msg }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        msg: msg.into(),
    }
}

/// The absl status code names PJRT uses.
pub fn code_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i).copied())
        .unwrap_or("LOCAL")
}
