//! Memory (NCCL's `allocator.cc` and `register/`): `ncclMemAlloc`/`ncclMemFree` through oxccl's
//! `cuda::DevAlloc` (`cuMemAlloc` on the calling thread's current device), buffer registration
//! and symmetric windows (accepted and recorded: oxccl's kernels need no registered buffers and
//! have no symmetric variants).
use crate::cuda::{self, KeepCurrent};
use crate::errors::non_null;
use crate::handles;
use crate::types::ncclComm_t;
use oxccl::cuda::{Context, DevAlloc};
use oxccl::Error;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

/// `ncclWindow_t`: an opaque pointer.
pub type ncclWindow_t = *mut c_void;

/// The allocations of `ncclMemAlloc`, by address (freed when removed).
fn allocs() -> MutexGuard<'static, HashMap<u64, DevAlloc>> {
    static ALLOCS: LazyLock<Mutex<HashMap<u64, DevAlloc>>> = LazyLock::new(Default::default);
    ALLOCS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A buffer registration: (communicator handle, address, bytes).
type Registration = (u64, u64, usize);

fn registrations() -> MutexGuard<'static, HashMap<u64, Registration>> {
    static REGS: LazyLock<Mutex<HashMap<u64, Registration>>> = LazyLock::new(Default::default);
    REGS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The windows of `ncclCommWindowRegister`, as registrations are kept.
fn windows() -> MutexGuard<'static, HashMap<u64, Registration>> {
    static WINS: LazyLock<Mutex<HashMap<u64, Registration>>> = LazyLock::new(Default::default);
    WINS.lock().unwrap_or_else(|p| p.into_inner())
}

nccl_api! {
    /// `size` bytes of device memory on the calling thread's current CUDA device (`cuMemAlloc`,
    /// zero-filled; the call synchronizes the device), for `ncclMemFree`. `size == 0` gives NULL.
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) {
        non_null("ptr", ptr)?;
        // SAFETY: non-NULL; NCCL's contract: a writable pointer.
        unsafe { ptr.write(std::ptr::null_mut()) };
        if size == 0 {
            return Ok(());
        }
        let _keep = KeepCurrent::new();
        let ctx = Context::get(cuda::current_device()?)?;
        let a = DevAlloc::zeroed(&ctx, size)?;
        let addr = a.ptr();
        allocs().insert(addr, a);
        // SAFETY: as above.
        unsafe { ptr.write(std::ptr::without_provenance_mut(addr as usize)) };
        Ok(())
    }

    /// Frees memory from `ncclMemAlloc` (`ncclInvalidArgument` for any other address).
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) {
        non_null("ptr", ptr)?;
        let _keep = KeepCurrent::new();
        match allocs().remove(&(ptr.addr() as u64)) {
            Some(a) => {
                drop(a);
                Ok(())
            }
            None => Err(Error::InvalidArgument(format!(
                "ptr {ptr:p} was not allocated by ncclMemAlloc (or was freed already)"
            ))),
        }
    }

    /// Records `size` bytes at `buff` as registered with `comm`; `*handle` is for
    /// `ncclCommDeregister`. oxccl's kernels use any device buffer as it is, so nothing else
    /// changes.
    fn ncclCommRegister / pncclCommRegister(
        comm: ncclComm_t,
        buff: *mut c_void,
        size: usize,
        handle: *mut *mut c_void,
    ) {
        non_null("buff", buff)?;
        non_null("handle", handle)?;
        let live = handles::get(comm)?;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        // Tagged so a handle is never NULL nor a small integer another call might hand out.
        let token = 0x0cc1_0000_0000_0000 | NEXT.fetch_add(1, Ordering::Relaxed);
        registrations().insert(token, (live.id, buff.addr() as u64, size));
        // SAFETY: non-NULL; NCCL's contract: a writable pointer.
        unsafe { handle.write(std::ptr::without_provenance_mut(token as usize)) };
        Ok(())
    }

    /// Forgets a registration of `comm` (`ncclInvalidArgument` for a handle it does not hold).
    fn ncclCommDeregister / pncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) {
        non_null("handle", handle)?;
        let live = handles::get(comm)?;
        let token = handle.addr() as u64;
        let mut regs = registrations();
        match regs.get(&token) {
            Some((c, _, _)) if *c == live.id => {
                regs.remove(&token);
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "handle {handle:p} is not a registration of this communicator (ncclCommRegister), or was deregistered already"
            ))),
        }
    }

    /// Registers `size` bytes at `buff` as a window of `comm` (NCCL's symmetric-memory windows,
    /// which XLA registers inside a group): accepted and recorded, as `ncclCommRegister` is;
    /// oxccl has no symmetric kernels, so collectives on the buffer run as on any buffer.
    /// `winFlags`: `NCCL_WIN_DEFAULT` (0) or `NCCL_WIN_COLL_SYMMETRIC` (1), else
    /// `ncclInvalidArgument`; `*win` is NULL on failure.
    fn ncclCommWindowRegister / pncclCommWindowRegister(
        comm: ncclComm_t,
        buff: *mut c_void,
        size: usize,
        win: *mut ncclWindow_t,
        win_flags: c_int,
    ) {
        non_null("win", win)?;
        // SAFETY: non-NULL; NCCL's contract: a writable ncclWindow_t.
        unsafe { win.write(std::ptr::null_mut()) };
        non_null("buff", buff)?;
        let live = handles::get(comm)?;
        if !(0..=1).contains(&win_flags) {
            return Err(Error::InvalidArgument(format!(
                "winFlags {win_flags:#x} is not a window flag (accepted: 0 NCCL_WIN_DEFAULT, 1 NCCL_WIN_COLL_SYMMETRIC)"
            )));
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        // Tagged apart from buffer registrations, never NULL nor a small integer.
        let token = 0x0cc2_0000_0000_0000 | NEXT.fetch_add(1, Ordering::Relaxed);
        windows().insert(token, (live.id, buff.addr() as u64, size));
        // SAFETY: non-NULL (checked above).
        unsafe { win.write(std::ptr::without_provenance_mut(token as usize)) };
        Ok(())
    }

    /// Forgets window `win` of `comm` (`ncclInvalidArgument` for a window it does not hold).
    fn ncclCommWindowDeregister / pncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) {
        let live = handles::get(comm)?;
        non_null("win", win)?;
        let token = win.addr() as u64;
        let mut wins = windows();
        match wins.get(&token) {
            Some((c, _, _)) if *c == live.id => {
                wins.remove(&token);
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "window {win:p} is not a window of this communicator (ncclCommWindowRegister), or was deregistered already"
            ))),
        }
    }
}
