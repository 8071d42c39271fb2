//! Errors at the C boundary (NCCL's `debug.cc` and the checks of `argcheck.cc`): every exported
//! body runs through [`call`] (or [`guard`]), which catches panics, turns an [`oxccl::Error`]
//! into its `ncclResult_t` and keeps its message as the calling thread's last error, which
//! `ncclGetLastError` returns. `ncclGetErrorString` gives each code's fixed text.
//!
//! Logging: oxccl logs through `tracing`, and a library installs no subscriber of its own
//! accord; but a C program cannot install one, and NCCL's texts say "run with NCCL_DEBUG=WARN
//! for details". So the first call installs a subscriber writing to stderr when `NCCL_DEBUG`
//! (`WARN`, `INFO`, `TRACE`; `VERSION` prints the version line only) or `OXCCL_LOG` (a `tracing`
//! filter, which wins) is set, and none otherwise. Every failed call logs its message as a
//! warning.
use crate::types::{ncclComm_t, ncclInternalError, ncclResult_t, ncclSuccess};
use oxccl::{Error, Result};
use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

thread_local! {
    /// The message of this thread's last failed call ("" before the first).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error.
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// This thread's last error message (for tests of this crate).
#[cfg(test)]
pub(crate) fn last_error() -> String {
    LAST_ERROR.with(|l| l.borrow().to_string_lossy().into_owned())
}

/// Records and logs `e`, a failure of function `name`; returns its code.
#[cold]
pub(crate) fn fail(name: &str, e: &Error) -> ncclResult_t {
    let msg = format!("{name}: {e}");
    tracing::warn!(target: "oxccl::nccl", "{msg}");
    set_last_error(&msg);
    e.code() as ncclResult_t
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Runs the body of exported function `name`: `ncclSuccess`, the error's code (its message kept
/// for `ncclGetLastError`), or `ncclInternalError` when the body panicked (never unwinding into
/// the caller). Inlined into each entry point, so the body's arguments are not packed into a
/// closure and unpacked again on every call; the body's result becomes its code inside the
/// unwinding guard, so only the code leaves it (a successful call copies no `Result`).
#[inline(always)]
pub(crate) fn call(name: &str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    init_logging();
    let code = catch_unwind(AssertUnwindSafe(|| match f() {
        Ok(()) => ncclSuccess,
        Err(e) => fail(name, &e),
    }));
    code.unwrap_or_else(|p| panicked(name, p))
}

/// [`call`]'s result for a body that panicked with `p`: `ncclInternalError`, its message kept.
#[cold]
fn panicked(name: &str, p: Box<dyn std::any::Any + Send>) -> ncclResult_t {
    let code = fail(name, &Error::Internal(format!("panic: {}", panic_text(&*p))));
    debug_assert_eq!(code, ncclInternalError);
    code
}

/// As [`call`] for a function returning `T`: `fallback` when the body panicked.
#[inline(always)]
pub(crate) fn guard<T>(name: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    init_logging();
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        fail(name, &Error::Internal(format!("panic: {}", panic_text(&*p))));
        fallback
    })
}

/// `InvalidArgument` unless `p` is non-NULL: "`name` is NULL".
pub(crate) fn non_null<T>(name: &str, p: *const T) -> Result<()> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("{name} is NULL")));
    }
    Ok(())
}

/// Installs the stderr subscriber once, when `OXCCL_LOG` or `NCCL_DEBUG` asks for one (module
/// docs).
#[inline(always)]
fn init_logging() {
    static ONCE: OnceLock<()> = OnceLock::new();
    if ONCE.get().is_none() {
        init_logging_once(&ONCE);
    }
}

/// [`init_logging`]'s first call.
#[cold]
fn init_logging_once(once: &OnceLock<()>) {
    once.get_or_init(|| {
        let debug = std::env::var("NCCL_DEBUG").ok().map(|v| v.to_ascii_uppercase());
        let filter = match std::env::var("OXCCL_LOG") {
            Ok(f) => Some(f),
            Err(_) => match debug.as_deref() {
                Some("WARN") | Some("ABORT") => Some("warn".to_string()),
                Some("INFO") => Some("info".to_string()),
                Some("TRACE") => Some("trace".to_string()),
                _ => None,
            },
        };
        if let Some(f) = filter {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(f))
                .with_writer(std::io::stderr)
                .try_init();
        }
        if debug.is_some() {
            tracing::info!(target: "oxccl::nccl", "NCCL version 2.28.3 (ABI), oxccl {}", oxccl::version_string());
            if debug.as_deref() == Some("VERSION") {
                eprintln!("NCCL version 2.28.3 (oxccl {})", oxccl::version_string());
            }
        }
    });
}

/// Each result code's text, NUL-terminated: 0..=8, then the text of unknown codes.
fn texts() -> &'static [CString] {
    static TEXTS: OnceLock<Vec<CString>> = OnceLock::new();
    TEXTS.get_or_init(|| {
        (0..=9)
            .map(|c| CString::new(oxccl::error_string_of(c)).unwrap_or_default())
            .collect()
    })
}

nccl_api! {
    /// The fixed text of result code `result` ("unknown result code" outside 0..=8; 8 is NCCL
    /// 2.30's `ncclTimeout`, which oxccl returns for a call that timed out).
    fn ncclGetErrorString / pncclGetErrorString(result: ncclResult_t) -> *const c_char [panic: std::ptr::null()] {
        let t = texts();
        let i = usize::try_from(result).ok().filter(|&i| i < t.len() - 1).unwrap_or(t.len() - 1);
        t[i].as_ptr()
    }

    /// The message of the calling thread's last failed call, naming the function and what was
    /// wrong ("" when none failed). `comm` is accepted and not used (NCCL's message is global
    /// too). The text stays valid until the thread's next failed call.
    fn ncclGetLastError / pncclGetLastError(comm: ncclComm_t) -> *const c_char [panic: std::ptr::null()] {
        let _ = comm;
        LAST_ERROR.with(|l| l.borrow().as_ptr())
    }

    /// NCCL re-reads its logging variables; oxccl reads them once, at the first call, so this
    /// does nothing.
    fn ncclResetDebugInit / pncclResetDebugInit() -> () [panic: ()] {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_internal_errors_with_a_message() {
        let code = call("ncclTest", || panic!("boom"));
        assert_eq!(code, ncclInternalError);
        assert!(last_error().contains("ncclTest") && last_error().contains("boom"), "{}", last_error());
        let v = guard("ncclTest2", 7, || -> i32 { panic!("bang") });
        assert_eq!(v, 7);
        assert!(last_error().contains("bang"));
    }

    #[test]
    fn errors_keep_their_code_and_message() {
        let code = call("ncclX", || Err(Error::InvalidUsage("nope".into())));
        assert_eq!(code, 5);
        assert_eq!(last_error(), "ncclX: invalid usage: nope");
        assert_eq!(call("ncclY", || Ok(())), ncclSuccess);
        assert_eq!(last_error(), "ncclX: invalid usage: nope", "a success keeps the last error");
    }
}
