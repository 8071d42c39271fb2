//! The calling thread's current context across oxccl's binds. oxccl makes a rank's context
//! current ([`super::Context::bind`]) before it allocates, loads or launches on it; NCCL's C
//! entry points give the caller back the device it found. A [`KeepCurrent`] scope does that
//! for every bind made inside it, lazily:
//! - the scope's first bind notes the context it is about to replace (one `cuCtxGetCurrent`),
//!   and makes no other driver call when that context is already the one to bind;
//! - a later bind of the context the scope bound last makes no driver call (inside a scope only
//!   oxccl's binds change this thread's current context);
//! - the outermost scope's end makes the noted context current again, only if a bind replaced it.
//!
//! So a call that binds nothing (a count of 0, a call queued in a group) makes no driver call
//! for the scope, and a caller whose current context is the communicator's pays one
//! `cuCtxGetCurrent` per call. Outside a scope every bind is one `cuCtxSetCurrent`.
use super::sys;
use crate::error::Result;
use std::cell::Cell;
use std::marker::PhantomData;

/// This thread's scope: how deep, the context found by its first bind, and the one bound last.
#[derive(Clone, Copy)]
struct Scope {
    depth: u32,
    /// The context current before the scope's first bind (`None` until then; NULL when none was).
    found: Option<sys::CUcontext>,
    /// The context the scope's binds made current last (`None` before the first).
    bound: Option<sys::CUcontext>,
}

const OUTSIDE: Scope = Scope {
    depth: 0,
    found: None,
    bound: None,
};

thread_local! {
    static SCOPE: Cell<Scope> = const { Cell::new(OUTSIDE) };
}

/// Keeps the calling thread's current context while alive: when it (the outermost one on the
/// thread) is dropped, the context that was current before the first bind inside it is current
/// again. Nested scopes are counted; only the outermost one restores. Makes no driver call and
/// touches nothing without a driver. Not `Send`: a scope belongs to its thread.
pub struct KeepCurrent {
    active: bool,
    _thread: PhantomData<*const ()>,
}

impl KeepCurrent {
    /// Opens a scope on the calling thread.
    pub fn new() -> KeepCurrent {
        let active = super::has_driver()
            && SCOPE
                .try_with(|s| {
                    let mut v = s.get();
                    v.depth += 1;
                    s.set(v);
                })
                .is_ok();
        KeepCurrent {
            active,
            _thread: PhantomData,
        }
    }
}

impl Default for KeepCurrent {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let Ok(s) = SCOPE.try_with(|s| {
            let mut v = s.get();
            v.depth = v.depth.saturating_sub(1);
            s.set(if v.depth == 0 { OUTSIDE } else { v });
            v
        }) else {
            return;
        };
        if s.depth > 0 {
            return;
        }
        if let (Some(found), Some(bound)) = (s.found, s.bound)
            && found != bound
        {
            // SAFETY: `found` was current on this thread when the scope's first bind ran (or is
            // NULL, which unbinds); the caller still owns it.
            let r = unsafe { sys::cuCtxSetCurrent(found) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(target: "oxccl::cuda", "restoring the caller's CUDA context: {r:?}");
            }
        }
    }
}

/// Makes `ctx` current on the calling thread, lazily inside a [`KeepCurrent`] scope (module docs).
pub(super) fn make_current(ctx: sys::CUcontext) -> Result<()> {
    let scope = SCOPE.try_with(|s| s.get()).unwrap_or(OUTSIDE);
    if scope.depth == 0 {
        return super::check(
            // SAFETY: `ctx` is a retained primary context.
            unsafe { sys::cuCtxSetCurrent(ctx) },
            "cuCtxSetCurrent",
        );
    }
    if scope.bound == Some(ctx) {
        return Ok(());
    }
    let mut next = scope;
    if scope.found.is_none() {
        let mut cur = std::ptr::null_mut();
        // SAFETY: the driver is loaded (a scope is only active with one); the out-pointer is valid.
        super::check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        next.found = Some(cur);
    }
    if next.found != Some(ctx) || scope.bound.is_some() {
        // SAFETY: `ctx` is a retained primary context.
        super::check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
    }
    next.bound = Some(ctx);
    let _ = SCOPE.try_with(|s| s.set(next));
    Ok(())
}
