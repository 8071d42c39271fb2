//! Communicator handles, as a C ABI hands them out (NCCL's `ncclComm_t`): plain copyable values
//! whose validity is checked on every use, so that a second destroy or a call on a destroyed
//! communicator is an `InvalidArgument` saying "already destroyed" instead of a use after free
//! (case C27). Rust callers hold a [`Comm`] directly, where [`Comm::destroy`] taking `self` makes
//! the same mistakes compile errors.
use crate::comm::Comm;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// An opaque communicator handle. Handles are never reused within a process: each carries a
/// per-process tag in its high 32 bits and a serial number in its low 32 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CommHandle(u64);

/// How long [`CommHandle::destroy`] waits for calls still running on the handle in other threads.
const IN_USE_WAIT: Duration = Duration::from_secs(10);

struct Registry {
    tag: u64,
    next: AtomicU64,
    live: Mutex<HashMap<u64, Arc<Comm>>>,
}

/// This process's handle tag: nonzero (so no handle is NULL), the same for the whole process,
/// and different for each process with high probability. Handles carry it in their high 32 bits,
/// so a handle of another process (or a stale integer) is recognized as foreign.
pub fn process_tag() -> u64 {
    static TAG: OnceLock<u64> = OnceLock::new();
    *TAG.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        ((t ^ (std::process::id() as u64).rotate_left(17)) as u32 | 1) as u64
    })
}

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| Registry {
        tag: process_tag(),
        next: AtomicU64::new(1),
        live: Mutex::new(HashMap::new()),
    })
}

impl Registry {
    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Comm>>> {
        // The map is only inserted into and removed from; a panic elsewhere cannot corrupt it.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl CommHandle {
    /// Registers `comm` and returns its handle (what `ncclCommInitRank` hands a C caller).
    pub fn new(comm: Comm) -> CommHandle {
        let reg = registry();
        let serial = reg.next.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff;
        let raw = (reg.tag << 32) | serial;
        reg.live().insert(raw, Arc::new(comm));
        CommHandle(raw)
    }

    /// The handle as a raw integer (for a C ABI).
    pub fn to_raw(self) -> u64 {
        self.0
    }

    /// A handle from a raw integer; validity is checked at each use.
    pub fn from_raw(raw: u64) -> CommHandle {
        CommHandle(raw)
    }

    /// `InvalidArgument` saying why this handle names no live communicator.
    fn dead(self) -> Error {
        let reg = registry();
        let (tag, serial) = (self.0 >> 32, self.0 & 0xffff_ffff);
        if tag == reg.tag && serial > 0 && serial < reg.next.load(Ordering::Relaxed) {
            Error::invalid(format!(
                "comm handle {:#x} was already destroyed (a second destroy, or a call after destroy or abort)",
                self.0
            ))
        } else {
            Error::invalid(format!(
                "comm handle {:#x} is not a communicator of this process (never created here)",
                self.0
            ))
        }
    }

    /// The live communicator behind this handle.
    ///
    /// Errors: `InvalidArgument` "already destroyed" after [`CommHandle::destroy`] or
    /// [`CommHandle::abort`], or "not a communicator" for a value never handed out here.
    pub fn get(self) -> Result<Arc<Comm>> {
        registry().live().get(&self.0).cloned().ok_or_else(|| self.dead())
    }

    /// Runs `f` on the communicator (any call of [`Comm`]); errors as [`CommHandle::get`].
    pub fn with<R>(self, f: impl FnOnce(&Comm) -> Result<R>) -> Result<R> {
        let comm = self.get()?;
        f(&comm)
    }

    /// Removes the handle; then waits (up to 10 s) for calls still running on it in other
    /// threads, so the communicator is owned here alone.
    fn take(self) -> Result<Comm> {
        let mut comm = registry().live().remove(&self.0).ok_or_else(|| self.dead())?;
        let start = Instant::now();
        loop {
            match Arc::try_unwrap(comm) {
                Ok(c) => return Ok(c),
                Err(shared) if start.elapsed() < IN_USE_WAIT => {
                    comm = shared;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => {
                    // The last caller's drop frees it.
                    return Err(Error::InvalidUsage(format!(
                        "comm handle {:#x}: destroyed while another thread kept using it for {IN_USE_WAIT:?}; \
                         it is freed when that call returns",
                        self.0
                    )));
                }
            }
        }
    }

    /// Destroys the communicator (NCCL's `ncclCommDestroy`, see [`Comm::destroy`]). A second
    /// destroy, or any use afterwards, is `InvalidArgument` "already destroyed".
    pub fn destroy(self) -> Result<()> {
        self.take()?.destroy()
    }

    /// Aborts and frees the communicator (NCCL's `ncclCommAbort`, see [`Comm::abort`]); the
    /// handle is dead afterwards, as after [`CommHandle::destroy`].
    pub fn abort(self) -> Result<()> {
        let comm = self.get()?;
        let r = comm.abort();
        drop(comm);
        let _ = self.take();
        r
    }
}
