//! oxccl's one error type, mirroring NCCL's `ncclResult_t`.
use std::fmt;

/// NCCL's result codes, numerically identical to `ncclResult_t` (for a future C ABI).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResultCode {
    Success = 0,
    UnhandledCudaError = 1,
    SystemError = 2,
    InternalError = 3,
    InvalidArgument = 4,
    InvalidUsage = 5,
    RemoteError = 6,
    InProgress = 7,
    Timeout = 8,
}

/// Every failure of the library. Messages name the argument or variable at fault and, where one
/// exists, the accepted range.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// A CUDA driver call failed (`ncclUnhandledCudaError`).
    #[error("CUDA error: {call} returned {name} ({code}): {msg}")]
    Cuda {
        call: &'static str,
        code: u32,
        name: String,
        msg: String,
    },
    /// The CUDA driver library is not there or no GPU is visible (`ncclSystemError`).
    #[error("no CUDA: {0}")]
    NoCuda(String),
    /// An OS-level failure (`ncclSystemError`).
    #[error("system error: {0}")]
    System(String),
    /// A bug or broken invariant inside oxccl (`ncclInternalError`).
    #[error("internal error: {0}")]
    Internal(String),
    /// A bad argument or environment value (`ncclInvalidArgument`).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call that is not allowed in this state (`ncclInvalidUsage`).
    #[error("invalid usage: {0}")]
    InvalidUsage(String),
    /// A peer failed (`ncclRemoteError`).
    #[error("remote error: {0}")]
    Remote(String),
    /// An operation did not finish in time (`ncclTimeout`).
    #[error("timeout: {0}")]
    Timeout(String),
}

impl Error {
    /// The `ncclResult_t` code for this error.
    pub fn code(&self) -> ResultCode {
        match self {
            Error::Cuda { .. } => ResultCode::UnhandledCudaError,
            Error::NoCuda(_) | Error::System(_) => ResultCode::SystemError,
            Error::Internal(_) => ResultCode::InternalError,
            Error::InvalidArgument(_) => ResultCode::InvalidArgument,
            Error::InvalidUsage(_) => ResultCode::InvalidUsage,
            Error::Remote(_) => ResultCode::RemoteError,
            Error::Timeout(_) => ResultCode::Timeout,
        }
    }

    /// NCCL's `ncclGetErrorString` for this error's code: a fixed text per code (the message
    /// itself, with the details, is this error's `Display`).
    pub fn error_string(&self) -> &'static str {
        error_string(self.code())
    }

    /// Of the errors several ranks' calls returned together, the cause: the first that is not
    /// `Remote` (the other ranks report the failed rank as Remote), else the first; `None` for
    /// no error.
    pub fn first_cause(errors: impl IntoIterator<Item = Error>) -> Option<Error> {
        let mut first = None;
        for e in errors {
            if !matches!(e, Error::Remote(_)) {
                return Some(e);
            }
            first.get_or_insert(e);
        }
        first
    }

    pub(crate) fn invalid(msg: impl fmt::Display) -> Self {
        Error::InvalidArgument(msg.to_string())
    }
}

impl ResultCode {
    /// The code of an `ncclResult_t` value; `None` outside 0..=8.
    pub fn from_i32(v: i32) -> Option<ResultCode> {
        use ResultCode::*;
        [
            Success,
            UnhandledCudaError,
            SystemError,
            InternalError,
            InvalidArgument,
            InvalidUsage,
            RemoteError,
            InProgress,
            Timeout,
        ]
        .into_iter()
        .find(|c| *c as i32 == v)
    }
}

/// `Result` with oxccl's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// NCCL's `ncclGetErrorString` for a code.
pub fn error_string(code: ResultCode) -> &'static str {
    match code {
        ResultCode::Success => "no error",
        ResultCode::UnhandledCudaError => "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        ResultCode::SystemError => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        ResultCode::InternalError => "internal error - please report this issue to the oxccl developers",
        ResultCode::InvalidArgument => "invalid argument (run with NCCL_DEBUG=WARN for details)",
        ResultCode::InvalidUsage => "invalid usage (run with NCCL_DEBUG=WARN for details)",
        ResultCode::RemoteError => "remote process exited or there was a network error",
        ResultCode::InProgress => "NCCL operation in progress",
        ResultCode::Timeout => "operation timed out",
    }
}

/// `ncclGetErrorString` on a raw `ncclResult_t` value (as a C caller holds it): the code's text,
/// or "unknown result code" outside 0..=8.
pub fn error_string_of(code: i32) -> &'static str {
    ResultCode::from_i32(code).map_or("unknown result code", error_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cause_is_the_first_error_that_is_not_remote() {
        let errs = || vec![Error::Remote("peer".into()), Error::Timeout("t".into()), Error::Remote("x".into())];
        assert!(matches!(Error::first_cause(errs()), Some(Error::Timeout(_))));
        assert!(matches!(Error::first_cause(vec![Error::Remote("a".into())]), Some(Error::Remote(m)) if m == "a"));
        assert!(Error::first_cause(Vec::new()).is_none());
    }

    #[test]
    fn codes_round_trip_and_have_nccl_texts() {
        // Values and texts as NCCL 2.28's nccl.h and ncclGetErrorString define them.
        for v in 0..=8 {
            assert_eq!(ResultCode::from_i32(v).map(|c| c as i32), Some(v));
        }
        assert_eq!(ResultCode::from_i32(9), None);
        assert_eq!(ResultCode::from_i32(-1), None);
        assert_eq!(
            error_string_of(6),
            "remote process exited or there was a network error"
        );
        assert_eq!(error_string_of(42), "unknown result code");
        let e = Error::Timeout("x".into());
        assert_eq!(e.code() as i32, 8);
        assert_eq!(e.error_string(), "operation timed out");
    }
}
