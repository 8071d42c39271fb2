//! Pins: the handle each thread's call is using right now, so that a call borrows its
//! communicator from the thread's recent handles (`handles.rs`) without touching its reference
//! count, and a destroy still never frees a communicator a call is using.
//!
//! A pin is a hazard pointer with an asymmetric fence:
//!
//! - a call stores its handle in its thread's pin, then reads the handle table's epoch; if the
//!   table is unchanged since the thread's recent handles were read from it, the communicator
//!   is in the table, and stays alive until the pin is cleared;
//! - a destroy (or any drop of a communicator's last reference) runs after the handle left the
//!   table, which moved its epoch; it then fences and waits until no pin holds the handle.
//!
//! Either the call's read sees the new epoch (and takes the locked path, which finds no
//! communicator), or the destroy's scan sees the pin (and waits for the call). That needs a
//! full fence on both sides; the call's side, taken on every call, is only a compiler fence
//! when the process is registered for `membarrier`'s private expedited command, whose call on
//! the destroy's side makes every running thread of the process execute a full fence (Linux
//! 4.14 or later, as userspace RCU uses it). Without it both sides take a full fence.
use std::sync::atomic::{AtomicU64, Ordering, compiler_fence, fence};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// `membarrier`'s commands (`linux/membarrier.h`).
const MEMBARRIER_CMD_GLOBAL: libc::c_long = 1;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 8;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 16;

/// One thread's pin: the handle its call is using (0: none). On cache lines of its own: every
/// call of its thread writes it twice, and no other thread's data may share them.
#[repr(align(128))]
pub(crate) struct Pin(AtomicU64);

impl Pin {
    /// Whether a call of this thread holds the pin already (a call inside a call).
    #[inline(always)]
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed) != 0
    }

    /// Pins handle `id`, ordered before the caller's next reads (module docs).
    #[inline(always)]
    pub(crate) fn set(&self, id: u64) {
        self.0.store(id, Ordering::Relaxed);
        if asymmetric() {
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// Releases the pin: the call is done with its communicator.
    #[inline(always)]
    pub(crate) fn clear(&self) {
        self.0.store(0, Ordering::Release);
    }
}

/// Every live thread's pin.
static PINS: Mutex<Vec<Arc<Pin>>> = Mutex::new(Vec::new());

fn pins() -> MutexGuard<'static, Vec<Arc<Pin>>> {
    // Only pushed to and removed from: a panic elsewhere leaves it consistent.
    PINS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the process registered for private expedited `membarrier` (decided before the
/// first pin exists, never changed after).
static ASYMMETRIC: OnceLock<bool> = OnceLock::new();

#[inline(always)]
fn asymmetric() -> bool {
    ASYMMETRIC.get() == Some(&true)
}

/// Calls `membarrier(cmd, 0)`; whether it succeeded.
fn membarrier(cmd: libc::c_long) -> bool {
    // SAFETY: the system call takes no pointers; an unknown or refused command returns -1.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long, 0 as libc::c_long) == 0 }
}

/// A thread's pin, one of [`PINS`] while the thread's locals live.
pub(crate) struct ThreadPin(Arc<Pin>);

impl ThreadPin {
    /// A new pin for the calling thread.
    pub(crate) fn new() -> ThreadPin {
        ASYMMETRIC.get_or_init(|| membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED));
        let pin = Arc::new(Pin(AtomicU64::new(0)));
        pins().push(pin.clone());
        ThreadPin(pin)
    }

    /// The pin.
    pub(crate) fn pin(&self) -> &Pin {
        &self.0
    }
}

impl Drop for ThreadPin {
    fn drop(&mut self) {
        let me = &self.0;
        pins().retain(|p| !Arc::ptr_eq(p, me));
    }
}

/// The destroy's side of the fence (module docs): whether it was taken.
fn heavy_fence() -> bool {
    fence(Ordering::SeqCst);
    if !asymmetric() {
        return true;
    }
    // A registration is per process; register again in case this one lost it (a fork's child).
    membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)
        || (membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) && membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED))
        || membarrier(MEMBARRIER_CMD_GLOBAL)
}

/// Waits until no thread's call holds handle `id`, which the handle table no longer names:
/// true once none does, false at `deadline` (`None`: waits as long as it takes).
pub(crate) fn wait_unpinned(id: u64, deadline: Option<Instant>) -> bool {
    loop {
        if heavy_fence() && !pinned_now(id) {
            return true;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether a thread's pin holds `id` now (after a [`heavy_fence`] since `id` left the table).
fn pinned_now(id: u64) -> bool {
    pins().iter().any(|p| p.0.load(Ordering::Acquire) == id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_is_waited_for_until_cleared() {
        let t = ThreadPin::new();
        let id = 0x5eed_0000_0001;
        t.pin().set(id);
        assert!(t.pin().is_set());
        assert!(!wait_unpinned(id, Some(Instant::now() + Duration::from_millis(5))));
        assert!(wait_unpinned(id + 1, Some(Instant::now())), "another handle is not held");
        let pin = t.0.clone();
        let clear = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            pin.clear();
        });
        assert!(wait_unpinned(id, None));
        clear.join().unwrap();
        drop(t);
        assert!(!pins().iter().any(|p| p.0.load(Ordering::Relaxed) == id));
    }
}
