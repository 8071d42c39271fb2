//! What an `ncclComm_t` names (NCCL's `struct ncclComm`, and `init.cc`'s `commReclaim` for the
//! ranks of one process).
//!
//! A handle is a number, not an address: a per-process tag in the high 32 bits and a serial in
//! the low ones (as `oxccl::CommHandle`), never reused, so a call on a destroyed or foreign
//! handle is `InvalidArgument` saying which, never a use after free. It names a [`Slot`]:
//!
//! - `Pending`: an init issued inside a group, carried out at the outermost `ncclGroupEnd`
//!   (`group.rs`); calls on it are `InvalidUsage` until then.
//! - `Ready`: a communicator ([`Live`]).
//! - `Failed`: an init that failed at its group's end; calls report that failure until the
//!   handle is destroyed or aborted.
//!
//! **Lookups.** A thread keeps the handles it used recently ([`RECENT`]), valid while the
//! table's change count is unchanged. A collective, send or receive borrows its communicator
//! from there under the thread's pin ([`live`], `pins.rs`), touching no reference count;
//! other calls, and a handle not among the recent ones, take an `Arc` ([`get`]). A destroy or
//! abort waits for the calls that borrow or hold the communicator.
//!
//! **Teardown of ranks sharing a process.** oxccl's `init_rank` communicators meet at a
//! bootstrap barrier when finalized or destroyed, so one thread cannot finalize or destroy
//! several ranks of one communicator one after another (NCCL can: the last local rank frees
//! them all). The ranks of one process created from the same unique id form a [`Clique`]: a
//! rank's finalize or destroy is recorded, and carried out — each rank on a thread of its own,
//! together — once every rank of the clique in this process has asked for its own (or was
//! aborted); the call that completes the set returns its own rank's result, the earlier ones
//! returned success (a finalize only once the rank's issued work has run; a call on a rank
//! whose deferred finalize another thread is carrying out waits for it). A deferred finalize's failure is reported by that rank's
//! `ncclCommGetAsyncError`. Ranks of an `init_all` (`ncclCommInitAll`, or a group holding every
//! rank of an id) have no barrier and need no clique.
use crate::pins::{self, Pin, ThreadPin};
use crate::types::{ncclComm, ncclComm_t, ncclResult_t};
use oxccl::{Comm, DataType, Device, Error, Result, Scalar, Stream};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Where a rank's work runs: its device's context, or (test hook) a CPU-target stream of its own.
pub(crate) enum Target {
    Cuda(Arc<oxccl::cuda::Context>),
    /// The rank's own CPU stream (a [`Stream::Cpu`]).
    Cpu(Stream),
}

impl Target {
    /// The target of a rank on `device`.
    pub(crate) fn of(device: Device) -> Result<Target> {
        Ok(match device {
            Device::Cuda(o) => Target::Cuda(oxccl::cuda::Context::get(o)?),
            Device::Cpu(_) => match device.new_stream()? {
                s @ Stream::Cpu(_) => Target::Cpu(s),
                Stream::Cuda(_) => return Err(Error::Internal("a CPU-target device gave a CUDA stream".into())),
            },
        })
    }
}

/// A PreMulSum operator of a communicator (`redop.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PreMul {
    pub(crate) dtype: DataType,
    pub(crate) scalar: PreMulScalar,
}

/// Where a PreMulSum operator's scalar is (NCCL's `ncclScalarResidence_t`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum PreMulScalar {
    /// `ncclScalarHostImmediate`: the value, read when the operator was created.
    Host(Scalar),
    /// `ncclScalarDevice`: the address of one element on the rank's device, read by each call's
    /// kernel when it runs.
    Device(u64),
}

/// A communicator behind a handle.
pub(crate) struct Live {
    /// Waits, when the communicator is dropped, for the calls still borrowing it (`pins.rs`);
    /// the first field, so it is dropped before the others.
    _unpinned: Unpinned,
    pub(crate) id: u64,
    pub(crate) comm: Comm,
    pub(crate) target: Target,
    /// PreMulSum operators: operator `ncclNumOps + i` is entry `i` (`None` once destroyed).
    pub(crate) redops: Mutex<Vec<Option<PreMul>>>,
    /// The ranks of this process sharing this rank's teardown barrier, if any (module docs).
    pub(crate) clique: Option<Arc<Clique>>,
    /// Set when finalize was asked for: later collectives are refused.
    pub(crate) finalizing: AtomicBool,
    /// A deferred finalize's failure, for `ncclCommGetAsyncError`: (code, message).
    pub(crate) deferred_error: Mutex<Option<(ncclResult_t, String)>>,
}

impl Live {
    pub(crate) fn new(id: u64, comm: Comm, target: Target, clique: Option<Arc<Clique>>) -> Live {
        Live {
            _unpinned: Unpinned(id),
            id,
            comm,
            target,
            redops: Mutex::new(Vec::new()),
            clique,
            finalizing: AtomicBool::new(false),
            deferred_error: Mutex::new(None),
        }
    }

    /// `InvalidUsage` once finalize was asked for.
    #[inline(always)]
    pub(crate) fn check_not_finalizing(&self) -> Result<()> {
        if self.finalizing.load(Ordering::Acquire) {
            return Err(self.finalizing_error());
        }
        Ok(())
    }

    /// [`Live::check_not_finalizing`]'s error.
    #[cold]
    fn finalizing_error(&self) -> Error {
        Error::InvalidUsage(format!(
            "rank {}: ncclCommFinalize was called on this communicator; only ncclCommDestroy is allowed after it",
            self.comm.rank()
        ))
    }

    pub(crate) fn redops(&self) -> MutexGuard<'_, Vec<Option<PreMul>>> {
        self.redops.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Handle `.0`'s wait for the calls borrowing its communicator (the first field of a [`Live`]).
struct Unpinned(u64);

impl Drop for Unpinned {
    fn drop(&mut self) {
        // The communicator left the table before its last reference went (its epoch moved):
        // no new call pins it, and a call pinning it now returns.
        pins::wait_unpinned(self.0, None);
    }
}

/// What a handle names (module docs).
enum Slot {
    Pending,
    Ready(Arc<Live>),
    Failed { code: ncclResult_t, msg: String },
}

/// The hasher of the handle table: a handle is a tag and a serial, unique in the process, so one
/// multiplication spreads it (every call looks its handle up; SipHash's resistance to chosen
/// keys buys nothing here).
#[derive(Default)]
struct HandleHasher(u64);

impl Hasher for HandleHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type Slots = HashMap<u64, Slot, BuildHasherDefault<HandleHasher>>;

struct Registry {
    tag: u64,
    next: AtomicU64,
    slots: Mutex<Slots>,
    /// Changes of `slots` so far, counted under its lock after each change: a thread's
    /// [`RECENT`] handles are valid while it is unchanged.
    epoch: AtomicU64,
}

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| Registry {
        // Handles of the Rust `CommHandle` registry carry the same tag; the serials differ.
        tag: oxccl::handle::process_tag(),
        next: AtomicU64::new(1),
        slots: Mutex::new(Slots::default()),
        epoch: AtomicU64::new(0),
    })
}

impl Registry {
    fn slots(&self) -> MutexGuard<'_, Slots> {
        // Only inserted into and removed from: a panic elsewhere leaves it consistent.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The table, for a change: the epoch moves when the change is done, before the lock is
    /// released.
    fn slots_mut(&self) -> SlotsMut<'_> {
        SlotsMut(self.slots())
    }
}

/// The locked table of a change ([`Registry::slots_mut`]).
struct SlotsMut<'a>(MutexGuard<'a, Slots>);

impl std::ops::Deref for SlotsMut<'_> {
    type Target = Slots;
    fn deref(&self) -> &Slots {
        &self.0
    }
}

impl std::ops::DerefMut for SlotsMut<'_> {
    fn deref_mut(&mut self) -> &mut Slots {
        &mut self.0
    }
}

impl Drop for SlotsMut<'_> {
    fn drop(&mut self) {
        // Still under the lock (the guard field drops after this).
        registry().epoch.fetch_add(1, Ordering::Release);
    }
}

/// Handles a thread looked up recently, for [`lookup`] without the table's lock: (epoch of the
/// table they were read at, (handle, communicator) pairs). Weak, so a destroyed communicator is
/// not kept alive by a thread that once called it. With the thread's pin, which [`live`]
/// borrows them through (created with the first entry).
struct Recent {
    epoch: u64,
    live: Vec<(u64, Weak<Live>)>,
    pin: Option<ThreadPin>,
}

/// How many handles [`Recent`] keeps per thread (a thread driving the GPUs of a node).
const RECENT_HANDLES: usize = 16;

/// The streams [`CallLive::with_stream`] keeps per thread.
const RECENT_STREAMS: usize = 8;

/// A thread's recent CUDA streams, most recent first: ((context, raw handle), stream).
type Streams = Vec<((usize, usize), Stream)>;

/// What a thread keeps for its calls: its recent handles, and its recent CUDA streams
/// ([`CallLive::with_stream`]). One thread-local, so a call on a CUDA rank reaches both through
/// one access.
struct ThreadCalls {
    recent: RefCell<Recent>,
    streams: RefCell<Streams>,
}

thread_local! {
    static RECENT: ThreadCalls = const {
        ThreadCalls {
            recent: RefCell::new(Recent { epoch: u64::MAX, live: Vec::new(), pin: None }),
            streams: RefCell::new(Vec::new()),
        }
    };
}

/// The `ncclComm_t` of handle `id`.
pub(crate) fn to_comm(id: u64) -> ncclComm_t {
    std::ptr::without_provenance_mut::<ncclComm>(id as usize)
}

fn id_of(comm: ncclComm_t) -> Result<u64> {
    if comm.is_null() {
        return Err(Error::InvalidArgument("comm is NULL".into()));
    }
    Ok(comm.addr() as u64)
}

/// `InvalidArgument` saying why `id` names nothing.
fn dead(id: u64) -> Error {
    let reg = registry();
    let (tag, serial) = (id >> 32, id & 0xffff_ffff);
    if tag == reg.tag && serial > 0 && serial < reg.next.load(Ordering::Relaxed) {
        Error::InvalidArgument(format!(
            "comm {id:#x} was already destroyed (a second ncclCommDestroy, or a call after ncclCommDestroy or ncclCommAbort)"
        ))
    } else {
        Error::InvalidArgument(format!("comm {id:#x} is not a communicator of this process (never created here)"))
    }
}

/// A new handle naming a pending init.
pub(crate) fn new_pending() -> u64 {
    let reg = registry();
    let id = (reg.tag << 32) | (reg.next.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff);
    reg.slots_mut().insert(id, Slot::Pending);
    id
}

/// A new handle's number, before its communicator exists (for [`Live::id`]); [`publish`] it.
pub(crate) fn reserve() -> u64 {
    let reg = registry();
    (reg.tag << 32) | (reg.next.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff)
}

/// Makes handle `id` name `live` (a reserved or pending handle); joins its clique.
pub(crate) fn publish(live: Live) {
    let id = live.id;
    if let Some(c) = &live.clique {
        c.join(id);
    }
    registry().slots_mut().insert(id, Slot::Ready(Arc::new(live)));
}

/// Makes pending handle `id` report the failure of its init.
pub(crate) fn fail_pending(id: u64, e: &Error) {
    registry().slots_mut().insert(
        id,
        Slot::Failed {
            code: e.code() as ncclResult_t,
            msg: e.to_string(),
        },
    );
}

/// [`fail_pending`] for a handle still pending (one whose init or split never ran); a handle
/// that names a communicator or a failure already is left as it is.
pub(crate) fn fail_pending_if_waiting(id: u64, e: &Error) {
    let mut slots = registry().slots_mut();
    if let Some(slot @ Slot::Pending) = slots.get_mut(&id) {
        *slot = Slot::Failed {
            code: e.code() as ncclResult_t,
            msg: e.to_string(),
        };
    }
}

/// The state `ncclCommGetAsyncError` reports for a handle that names no communicator yet.
pub(crate) enum NotReady {
    Pending,
    Failed(ncclResult_t, String),
}

/// The communicator of `comm`, or why there is none: `Err(Ok(..))` for a pending or failed
/// init, `Err(Err(..))` for a NULL, destroyed or foreign handle.
pub(crate) fn lookup(comm: ncclComm_t) -> std::result::Result<Arc<Live>, std::result::Result<NotReady, Error>> {
    match recent(comm) {
        Some(l) => Ok(l),
        None => lookup_locked(comm),
    }
}

/// The communicator of `comm` from this thread's [`RECENT`] handles, while the table is
/// unchanged since they were read (every call's path: no lock).
#[inline(always)]
fn recent(comm: ncclComm_t) -> Option<Arc<Live>> {
    let id = comm.addr() as u64;
    let reg = registry();
    // `try_with`: a call from a destructor run after this thread's locals were torn down (at
    // thread or process exit) takes the locked path instead of panicking.
    RECENT
        .try_with(|t| {
            let r = t.recent.borrow();
            if r.epoch != reg.epoch.load(Ordering::Acquire) {
                return None;
            }
            r.live.iter().find(|(h, _)| *h == id).and_then(|(_, l)| l.upgrade())
        })
        .ok()
        .flatten()
}

/// [`lookup`] in the table, under its lock; remembers the communicator in [`RECENT`].
#[inline(never)]
fn lookup_locked(comm: ncclComm_t) -> std::result::Result<Arc<Live>, std::result::Result<NotReady, Error>> {
    let id = id_of(comm).map_err(Err)?;
    let reg = registry();
    let slots = reg.slots();
    let epoch = reg.epoch.load(Ordering::Acquire);
    match slots.get(&id) {
        Some(Slot::Ready(l)) => {
            // Nothing to remember once this thread's locals are gone (`try_with`).
            let _ = RECENT.try_with(|t| {
                let mut r = t.recent.borrow_mut();
                if r.epoch != epoch || r.live.len() == RECENT_HANDLES {
                    r.epoch = epoch;
                    r.live.clear();
                }
                r.live.push((id, Arc::downgrade(l)));
                r.pin.get_or_insert_with(ThreadPin::new);
            });
            Ok(l.clone())
        }
        Some(Slot::Pending) => Err(Ok(NotReady::Pending)),
        Some(Slot::Failed { code, msg }) => Err(Ok(NotReady::Failed(*code, msg.clone()))),
        None => Err(Err(dead(id))),
    }
}

/// The communicator of `comm` for one call (errors: as [`get`]). One among this thread's recent
/// handles is borrowed under the thread's pin, without touching its reference count
/// (`pins.rs`); any other is held through [`get`]. A guard rather than a closure's argument, so
/// the call's body is inlined into its entry point instead of being packed into a closure.
#[inline(always)]
pub(crate) fn live(comm: ncclComm_t) -> Result<CallLive> {
    Ok(match borrow(comm) {
        Some(b) => CallLive::Borrowed(b),
        None => CallLive::Held(get(comm)?),
    })
}

/// The communicator of a call ([`live`]): borrowed under the thread's pin (released when
/// dropped), or held.
pub(crate) enum CallLive {
    Borrowed(Borrowed),
    Held(Arc<Live>),
}

impl CallLive {
    /// Runs `f` with the stream of the call: the caller's `cudaStream_t` on the rank's device
    /// (NULL: the legacy default stream), or the rank's own CPU stream (the argument is ignored
    /// there). A CUDA stream is kept per thread for the next calls on the same handle (the
    /// thread's [`RECENT`] streams), so a call borrows it instead of building its own; a
    /// borrowed communicator's call reaches them through its borrow, with no second access to
    /// the thread's locals.
    ///
    /// # Safety
    /// `raw` is NULL or a stream of the rank's device, valid until the work `f` queues on it was
    /// launched (for calls in a group: the group's end).
    #[inline(always)]
    pub(crate) unsafe fn with_stream<R>(&self, raw: *mut std::ffi::c_void, f: impl FnOnce(&Stream) -> R) -> R {
        match &self.target {
            Target::Cpu(s) => f(s),
            Target::Cuda(ctx) => {
                let streams = match self {
                    CallLive::Borrowed(b) => Some(b.streams()),
                    CallLive::Held(_) => None,
                };
                // SAFETY: the caller's contract.
                unsafe { with_cuda_stream(ctx, raw, streams, f) }
            }
        }
    }
}

/// [`CallLive::with_stream`] on a rank of a CUDA device: the stream `raw` of context `ctx`, from
/// `streams` (this thread's, reached through a borrow) or, without them, from this thread's
/// [`RECENT`] streams.
///
/// # Safety
/// As [`CallLive::with_stream`].
unsafe fn with_cuda_stream<R>(
    ctx: &Arc<oxccl::cuda::Context>,
    raw: *mut std::ffi::c_void,
    streams: Option<&RefCell<Streams>>,
    f: impl FnOnce(&Stream) -> R,
) -> R {
    let key = (Arc::as_ptr(ctx) as usize, raw as usize);
    // A stream is only a raw handle and its context: a handle the caller destroyed and the
    // driver gave out again names the same stream value, so the cache never goes stale.
    // SAFETY (both): the caller's contract.
    let make = || Stream::Cuda(unsafe { oxccl::cuda::Stream::from_raw(ctx, raw.cast()) });
    if let Some(streams) = streams {
        return cached_stream(streams, key, make, f);
    }
    // This thread's locals are gone (a call from a destructor at thread exit): no cache.
    if RECENT.try_with(|_| ()).is_err() {
        return f(&make());
    }
    RECENT.with(|t| cached_stream(&t.streams, key, make, f))
}

/// Runs `f` with the stream of `key` in `streams`, made by `make` and kept there if missing
/// (the most recent first).
#[inline(always)]
fn cached_stream<R>(
    streams: &RefCell<Streams>,
    key: (usize, usize),
    make: impl Fn() -> Stream,
    f: impl FnOnce(&Stream) -> R,
) -> R {
    match streams.try_borrow_mut() {
        Ok(mut c) => {
            if let Some(i) = c.iter().position(|(k, _)| *k == key) {
                // The most recent first: a thread's calls mostly reuse a stream or two.
                c[..=i].rotate_right(1);
            } else {
                c.truncate(RECENT_STREAMS - 1);
                c.insert(0, (key, make()));
            }
            f(&c[0].1)
        }
        // A call inside a call's borrow (none does so today): its own stream.
        Err(_) => f(&make()),
    }
}

impl std::ops::Deref for CallLive {
    type Target = Live;
    #[inline(always)]
    fn deref(&self) -> &Live {
        match self {
            CallLive::Borrowed(b) => b.live(),
            CallLive::Held(l) => l,
        }
    }
}

/// A communicator borrowed under this thread's pin, released when dropped; with the thread's
/// streams (its [`RECENT`]'s), which the call reaches through it.
pub(crate) struct Borrowed {
    pin: *const Pin,
    live: *const Live,
    streams: *const RefCell<Streams>,
}

impl Borrowed {
    #[inline(always)]
    fn live(&self) -> &Live {
        // SAFETY: pinned while `self` lives: the communicator was in the table when the pin was
        // set, and nothing drops it before the pin is cleared (`pins.rs`; `Unpinned`, `take`).
        unsafe { &*self.live }
    }

    /// This thread's streams.
    #[inline(always)]
    fn streams(&self) -> &RefCell<Streams> {
        // SAFETY: in this thread's `RECENT`, which lives until the thread's locals are torn
        // down (never during a call that borrowed through it; `Borrowed` is not `Send`).
        unsafe { &*self.streams }
    }
}

impl Drop for Borrowed {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: the thread's pin, owned by its `RECENT`, which lives until the thread's
        // locals are torn down (never during a call that borrowed through it).
        unsafe { &*self.pin }.clear();
    }
}

/// `comm`'s communicator from this thread's recent handles, pinned; `None` when they do not
/// hold it, the table changed since they were read, or the pin is taken (a call inside a call).
#[inline(always)]
fn borrow(comm: ncclComm_t) -> Option<Borrowed> {
    let id = comm.addr() as u64;
    let reg = registry();
    RECENT
        .try_with(|t| {
            let r = t.recent.borrow();
            let pin = r.pin.as_ref()?.pin();
            let live = r.live.iter().find(|(h, _)| *h == id)?.1.as_ptr();
            if pin.is_set() {
                return None;
            }
            pin.set(id);
            if r.epoch != reg.epoch.load(Ordering::Acquire) {
                pin.clear();
                return None;
            }
            Some(Borrowed {
                pin,
                live,
                streams: &t.streams,
            })
        })
        .ok()
        .flatten()
}

/// The communicator of `comm`. Errors: `InvalidArgument` for a NULL, destroyed or foreign
/// handle; `InvalidUsage` for an init still waiting for its group's end, or one that failed.
#[inline(always)]
pub(crate) fn get(comm: ncclComm_t) -> Result<Arc<Live>> {
    match recent(comm) {
        Some(l) => Ok(l),
        None => get_locked(comm),
    }
}

/// [`get`] past this thread's recent handles.
#[inline(never)]
fn get_locked(comm: ncclComm_t) -> Result<Arc<Live>> {
    lookup_locked(comm).map_err(|e| match e {
        Err(e) => e,
        Ok(NotReady::Pending) => Error::InvalidUsage(format!(
            "comm {:#x} is created at the end of the group it was initialized in (ncclGroupEnd); call ncclGroupEnd first",
            comm.addr()
        )),
        Ok(NotReady::Failed(code, msg)) => Error::InvalidUsage(format!(
            "comm {:#x}: its init failed at ncclGroupEnd ({}): {msg}; destroy or abort it",
            comm.addr(),
            oxccl::error_string_of(code)
        )),
    })
}

/// Removes handle `comm` (destroy, abort): its communicator, or `None` for an init that failed.
/// Errors: as [`get`], and `InvalidUsage` for a pending init (kept).
pub(crate) fn remove(comm: ncclComm_t) -> Result<Option<Arc<Live>>> {
    let id = id_of(comm)?;
    let mut slots = registry().slots_mut();
    match slots.remove(&id) {
        Some(Slot::Ready(l)) => Ok(Some(l)),
        Some(Slot::Failed { .. }) => Ok(None),
        Some(Slot::Pending) => {
            slots.insert(id, Slot::Pending);
            Err(Error::InvalidUsage(format!(
                "comm {id:#x} is created at the end of the group it was initialized in; call ncclGroupEnd before destroying or aborting it"
            )))
        }
        None => Err(dead(id)),
    }
}

/// How long a destroy waits for calls still running on the communicator in other threads.
const IN_USE_WAIT: Duration = Duration::from_secs(10);

/// `live` (out of the table) once no other thread holds or borrows it (a call in progress);
/// `InvalidUsage` after 10 s (the last holder's drop, or the borrowing call's return, then
/// frees it).
fn take(mut live: Arc<Live>) -> Result<Live> {
    let start = Instant::now();
    if !pins::wait_unpinned(live.id, Some(start + IN_USE_WAIT)) {
        let id = live.id;
        // Freed once the call returns, on a thread of its own (the last reference's drop waits
        // for the call: `Unpinned`); kept for good if no thread can be started.
        let (tx, rx) = std::sync::mpsc::channel::<Arc<Live>>();
        match std::thread::Builder::new().name("oxccl-nccl-free".into()).spawn(move || drop(rx.recv())) {
            Ok(_) => {
                if let Err(unsent) = tx.send(live) {
                    std::mem::forget(unsent.0);
                }
            }
            Err(_) => std::mem::forget(live),
        }
        return Err(Error::InvalidUsage(format!(
            "comm {id:#x}: destroyed while another thread kept using it for {IN_USE_WAIT:?}; it is freed when that call returns"
        )));
    }
    loop {
        match Arc::try_unwrap(live) {
            Ok(l) => return Ok(l),
            Err(shared) if start.elapsed() < IN_USE_WAIT => {
                live = shared;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(shared) => {
                return Err(Error::InvalidUsage(format!(
                    "comm {:#x}: destroyed while another thread kept using it for {IN_USE_WAIT:?}; it is freed when that call returns",
                    shared.id
                )));
            }
        }
    }
}

/// A finalize or a destroy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Teardown {
    Finalize,
    Destroy,
}

/// Carries out `kind` on `live` now.
fn run(live: Arc<Live>, kind: Teardown) -> Result<()> {
    match kind {
        Teardown::Finalize => live.comm.finalize(),
        Teardown::Destroy => take(live)?.comm.destroy(),
    }
}

/// The state of one rank of a [`Clique`].
enum Member {
    /// Neither finalize nor destroy asked for.
    Live,
    /// Asked for, waiting for the others.
    Asked(Arc<Live>, Teardown),
    /// Being carried out.
    Running,
    /// Finalized: its destroy is local.
    Finalized,
    /// Destroyed or aborted.
    Gone,
}

/// The ranks of this process created from one unique id by `init_rank` (module docs).
pub(crate) struct Clique {
    members: Mutex<Vec<(u64, Member)>>,
}

impl Clique {
    /// The clique of unique id `id` (created on first use).
    pub(crate) fn of(id: &[u8; 128]) -> Arc<Clique> {
        static CLIQUES: Mutex<Vec<([u8; 128], Weak<Clique>)>> = Mutex::new(Vec::new());
        let mut all = CLIQUES.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|(_, w)| w.strong_count() > 0);
        if let Some(c) = all.iter().find(|(k, _)| k == id).and_then(|(_, w)| w.upgrade()) {
            return c;
        }
        let c = Arc::new(Clique {
            members: Mutex::new(Vec::new()),
        });
        all.push((*id, Arc::downgrade(&c)));
        c
    }

    fn members(&self) -> MutexGuard<'_, Vec<(u64, Member)>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn join(&self, id: u64) {
        self.members().push((id, Member::Live));
    }

    /// Once no rank is `Live`: every rank that asked, now `Running`.
    fn ready_batch(members: &mut [(u64, Member)]) -> Vec<(Arc<Live>, Teardown)> {
        if members.iter().any(|(_, m)| matches!(m, Member::Live)) {
            return Vec::new();
        }
        members
            .iter_mut()
            .filter(|(_, m)| matches!(m, Member::Asked(..)))
            .filter_map(|(_, m)| match std::mem::replace(m, Member::Running) {
                Member::Asked(l, k) => Some((l, k)),
                _ => None,
            })
            .collect()
    }

    /// Carries out `batch` together, a thread each; returns rank `mine`'s result (the others'
    /// failures are logged, a finalize's kept for its `ncclCommGetAsyncError`).
    fn run_batch(&self, batch: Vec<(Arc<Live>, Teardown)>, mine: Option<u64>) -> Result<()> {
        let results: Vec<(u64, Teardown, Result<()>)> = std::thread::scope(|s| {
            let handles: Vec<_> = batch
                .into_iter()
                .map(|(live, kind)| {
                    let id = live.id;
                    let keep = (kind == Teardown::Finalize).then(|| live.clone());
                    let h = std::thread::Builder::new()
                        .name("oxccl-nccl-teardown".into())
                        .spawn_scoped(s, move || run(live, kind));
                    (id, kind, keep, h)
                })
                .collect();
            handles
                .into_iter()
                .map(|(id, kind, keep, h)| {
                    let r = match h {
                        Ok(h) => h
                            .join()
                            .unwrap_or_else(|_| Err(Error::Internal("a teardown thread panicked".into()))),
                        Err(e) => Err(Error::System(format!("cannot start a teardown thread: {e}"))),
                    };
                    if let (Some(live), Err(e)) = (&keep, &r)
                        && Some(id) != mine
                    {
                        *live.deferred_error.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some((e.code() as ncclResult_t, format!("deferred ncclCommFinalize: {e}")));
                    }
                    (id, kind, r)
                })
                .collect()
        });
        let mut members = self.members();
        let mut own = Ok(());
        for (id, kind, r) in results {
            if let Some((_, m)) = members.iter_mut().find(|(i, _)| *i == id) {
                *m = match kind {
                    Teardown::Finalize => Member::Finalized,
                    Teardown::Destroy => Member::Gone,
                };
            }
            if Some(id) == mine {
                own = r;
            } else if let Err(e) = r {
                tracing::warn!(target: "oxccl::nccl", "deferred {kind:?} of comm {id:#x}: {e}");
            }
        }
        own
    }

    /// Marks rank `id` gone (aborted), and carries out what the others asked for if it was the
    /// last one they waited for.
    pub(crate) fn gone(&self, id: u64) {
        let batch = {
            let mut m = self.members();
            if let Some((_, s)) = m.iter_mut().find(|(i, _)| *i == id) {
                *s = Member::Gone;
            }
            Self::ready_batch(&mut m)
        };
        if !batch.is_empty() {
            let _ = self.run_batch(batch, None);
        }
    }
}

/// How long a rank's finalize waits for its own issued work before it is deferred, and how long
/// a finalize or destroy waits for one that another thread is carrying out.
const FLUSH_WAIT: Duration = Duration::from_secs(60);

/// Finalizes or destroys `live` (a destroyed one was removed from the registry already): at
/// once, or as its clique allows (module docs). A finalize first waits for the rank's issued
/// work, deferred or not (NCCL's finalize flushes it), so a program that reads its results
/// after `ncclCommFinalize` reads them complete.
pub(crate) fn teardown(live: Arc<Live>, kind: Teardown) -> Result<()> {
    if kind == Teardown::Finalize {
        live.finalizing.store(true, Ordering::Release);
    }
    let Some(clique) = live.clique.clone() else {
        if kind == Teardown::Finalize {
            let r = live.comm.finalize();
            if matches!(r, Err(Error::InvalidUsage(_))) {
                // Refused before anything was finalized (an open group holds the
                // communicator's calls: it asks for the group's end first): calls stay allowed.
                live.finalizing.store(false, Ordering::Release);
            }
            return r;
        }
        return run(live, kind);
    };
    let id = live.id;
    if kind == Teardown::Finalize && !live.comm.wait_idle(FLUSH_WAIT)? {
        return Err(Error::Timeout(format!(
            "comm {id:#x}: finalize waited {FLUSH_WAIT:?} for the rank's issued work; abort to stop it"
        )));
    }
    let start = Instant::now();
    let batch = loop {
        let mut members = clique.members();
        if members.iter().any(|(m, s)| *m == id && matches!(s, Member::Running)) && start.elapsed() < FLUSH_WAIT {
            // Another thread is carrying out this rank's deferred finalize: wait for it.
            drop(members);
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let Some(i) = members.iter().position(|(m, _)| *m == id) else {
            drop(members);
            return run(live, kind);
        };
        match (&members[i].1, kind) {
            (Member::Finalized, Teardown::Finalize) => return Ok(()),
            (Member::Finalized, Teardown::Destroy) => {
                members[i].1 = Member::Gone;
                drop(members);
                return run(live, kind);
            }
            (Member::Asked(_, Teardown::Finalize), Teardown::Finalize) => return Ok(()),
            (Member::Live | Member::Asked(..), _) => members[i].1 = Member::Asked(live, kind),
            (Member::Running, _) | (Member::Gone, _) => {
                return Err(Error::InvalidUsage(format!(
                    "comm {id:#x}: {kind:?} while its finalize or destroy is being carried out"
                )));
            }
        }
        break Clique::ready_batch(&mut members);
    };
    if batch.is_empty() {
        tracing::debug!(
            target: "oxccl::nccl",
            "comm {id:#x}: {kind:?} deferred until the other ranks of this process ask for theirs"
        );
        return Ok(());
    }
    clique.run_batch(batch, Some(id))
}

/// Aborts `live` (removed from the registry already) and frees it; the other ranks of its clique
/// stop waiting for it.
pub(crate) fn abort(live: Arc<Live>) -> Result<()> {
    let r = live.comm.abort();
    if let Some(c) = live.clique.clone() {
        c.gone(live.id);
    }
    // Freed here, or by the last call still using it in another thread.
    let freed = take(live).map(drop);
    r.and(freed)
}
