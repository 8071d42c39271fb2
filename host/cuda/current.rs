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
        if let Some(found) = s.to_restore() {
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
    let found = match scope.found {
        Some(f) => f,
        None => {
            let mut cur = std::ptr::null_mut();
            // SAFETY: the driver is loaded (a scope is only active with one); the out-pointer is
            // valid.
            super::check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
            cur
        }
    };
    let (set, next) = scope.bind(ctx, found);
    if set {
        // SAFETY: `ctx` is a retained primary context.
        super::check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
    }
    let _ = SCOPE.try_with(|s| s.set(next));
    Ok(())
}

impl Scope {
    /// A bind of `ctx` inside this scope, `found` being the context current before the scope's
    /// first bind (asked of the driver when `self.found` is `None`): whether it must call
    /// `cuCtxSetCurrent`, and the scope after it.
    fn bind(self, ctx: sys::CUcontext, found: sys::CUcontext) -> (bool, Scope) {
        let set = match self.bound {
            // Only oxccl's binds change the context inside a scope.
            Some(b) => b != ctx,
            None => found != ctx,
        };
        (
            set,
            Scope {
                found: Some(found),
                bound: Some(ctx),
                ..self
            },
        )
    }

    /// The context the end of this (outermost) scope makes current again: the one found, when a
    /// bind replaced it.
    fn to_restore(self) -> Option<sys::CUcontext> {
        match (self.found, self.bound) {
            (Some(found), Some(bound)) if found != bound => Some(found),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(n: usize) -> sys::CUcontext {
        n as sys::CUcontext
    }

    fn scope() -> Scope {
        Scope { depth: 1, ..OUTSIDE }
    }

    #[test]
    fn a_bind_of_the_context_found_makes_no_call_and_nothing_is_restored() {
        let (set, s) = scope().bind(ctx(8), ctx(8));
        assert!(!set);
        assert_eq!((s.found, s.bound), (Some(ctx(8)), Some(ctx(8))));
        assert_eq!(s.to_restore(), None);
        // Binding it again: no call either.
        assert!(!s.bind(ctx(8), ctx(8)).0);
    }

    #[test]
    fn a_bind_that_replaces_the_callers_context_is_undone_at_the_end() {
        // The caller had context 16 current, or none (NULL).
        for caller in [ctx(16), std::ptr::null_mut()] {
            let (set, s) = scope().bind(ctx(8), caller);
            assert!(set);
            assert_eq!(s.to_restore(), Some(caller));
            // A second bind of the same context inside the scope makes no call.
            let (set, s) = s.bind(ctx(8), caller);
            assert!(!set);
            assert_eq!(s.to_restore(), Some(caller));
        }
    }

    #[test]
    fn binds_of_several_contexts_each_call_and_the_callers_comes_back() {
        // The caller's own context first, then another rank's, then the caller's again.
        let (set, s) = scope().bind(ctx(8), ctx(8));
        assert!(!set);
        let (set, s) = s.bind(ctx(24), ctx(8));
        assert!(set);
        assert_eq!(s.to_restore(), Some(ctx(8)));
        let (set, s) = s.bind(ctx(8), ctx(8));
        assert!(set);
        assert_eq!(s.to_restore(), None);
    }

    #[test]
    fn a_scope_without_binds_restores_nothing() {
        assert_eq!(scope().to_restore(), None);
        assert_eq!(OUTSIDE.to_restore(), None);
    }

    #[test]
    fn a_scope_without_a_driver_is_inactive() {
        if crate::cuda::has_driver() {
            println!("SKIPPED: a_scope_without_a_driver_is_inactive: this machine has a CUDA driver");
            return;
        }
        let k = KeepCurrent::new();
        assert!(!k.active);
        assert_eq!(SCOPE.with(|s| s.get().depth), 0);
    }
}
