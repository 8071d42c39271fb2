//! Groups (NCCL's `group.cc`): `ncclGroupStart`/`ncclGroupEnd` are oxccl's per-thread, nesting
//! [`oxccl::group_start`]/[`oxccl::group_end`] (sends and receives queued until the outermost
//! end), plus the collectives, inits, splits and shrinks issued inside a group, and
//! `ncclGroupSimulateEnd`.
//!
//! **Inits inside a group.** NCCL lets one thread create several ranks:
//! `ncclGroupStart(); for each GPU: cudaSetDevice(g); ncclCommInitRank(&comms[g], n, id, g);
//! ncclGroupEnd()` (nccl-tests' default). `ncclCommInitRank` inside a group is oxccl's
//! [`oxccl::group::init_rank`] and hands out a pending handle at once; the outermost
//! `ncclGroupEnd` is oxccl's, which carries the inits out together (every rank of a unique id as
//! one `Comm::init_all`, any other init on a thread of its own), then launches the group's
//! sends and receives; each pending handle then names its communicator, or the failure of its
//! init.
//!
//! **Splits and shrinks inside a group.** `ncclCommSplit` and `ncclCommShrink` inside a group
//! (how XLA splits the communicators of its local GPUs from one thread) hand out a pending
//! handle at once (NULL for `NCCL_SPLIT_NOCOLOR`); the outermost `ncclGroupEnd` runs the group's
//! splits and shrinks together, a thread each, before the group's inits and sends and receives.
//!
//! A call on a pending handle before the end
//! is `ncclInvalidUsage` (NCCL's users issue them after `ncclGroupEnd`).
//!
//! **Collectives inside a group** are checked when called (argument errors are returned there)
//! and launched at the outermost `ncclGroupEnd`, in the order issued, before the group's sends
//! and receives (NCCL launches a group's work at its end and schedules its collectives first) —
//! after those are planned: a group whose sends and receives cannot be launched (more blocks
//! than a launch holds…) fails at `ncclGroupEnd` with none of its work run.
//!
//! **Finalizes and destroys inside a group** (`ncclCommFinalize`, `ncclCommDestroy`) return at
//! once and are carried out at the outermost end, after the group's work is launched, in the
//! order issued (NCCL runs a finalize issued in a group as a job of the group's end): a rank
//! that queued a collective and then finalizes or destroys its communicator in the same group
//! has that collective run first, and ranks of one communicator driven by threads of their own
//! do not wait for each other's group. A destroyed handle is invalid at once; a finalized one
//! refuses new calls at once.
//!
//! **`ncclGroupSimulateEnd`** ends the group as `ncclGroupEnd` does except that nothing of it
//! runs: its collectives, sends and receives are dropped (its inits, splits, shrinks, finalizes
//! and destroys are carried out), and `estimatedTime` is the tuning model's time of its collectives in
//! microseconds ([`oxccl::Comm::predict_us`]): per communicator the sum of its calls, the
//! largest over the group's communicators (one thread driving N ranks of one collective gets
//! one collective's time), 0 when there are none. For a group of one collective this is what
//! NCCL reports (its model's time of the call); for several NCCL reports its last call's.
//!
//! **A refused call fails its group**, as in NCCL: a collective, send, receive, AlltoAll,
//! Gather or Scatter refused inside a group (an argument error, returned at the call) makes the
//! outermost `ncclGroupEnd` run none of the group's collectives, sends and receives and return
//! that first error (its inits, splits, shrinks, finalizes and destroys are still carried out,
//! and the communicators stay usable: every rank that issued the same calls gets the same error
//! and none of them waits for work that never comes). `ncclGroupSimulateEnd` forgets the error
//! with the rest of the group.
use crate::cuda::KeepCurrent;
use crate::errors::non_null;
use crate::handles::{self, Clique, Live, Target, Teardown};
use crate::types::{NCCL_SIM_INFO_MAGIC, ncclSimInfo_t};
use oxccl::bootstrap::UniqueId;
use oxccl::group::PendingComm;
use oxccl::{Device, Error, Result};
use std::cell::RefCell;
use std::ffi::c_int;
use std::sync::Arc;

/// What this thread's group holds for its outermost end, besides what oxccl's group queues.
#[derive(Default)]
struct Outermost {
    /// The first error of a call refused inside the group (module docs).
    refused: Option<Error>,
    /// The inits issued inside the group.
    inits: Vec<Deferred>,
    /// The splits and shrinks issued inside the group.
    splits: Vec<DeferredSplit>,
    /// The finalizes and destroys issued inside the group.
    teardowns: Vec<(Arc<Live>, Teardown)>,
}

impl Outermost {
    /// Whether the group holds nothing but oxccl's queued work (the common group of calls).
    fn is_empty(&self) -> bool {
        self.refused.is_none() && self.inits.is_empty() && self.splits.is_empty() && self.teardowns.is_empty()
    }
}

thread_local! {
    /// This thread's group's part (one thread-local: a group's end takes it in one access).
    static OUTERMOST: RefCell<Outermost> = const {
        RefCell::new(Outermost { refused: None, inits: Vec::new(), splits: Vec::new(), teardowns: Vec::new() })
    };
}

/// Records a finalize or destroy issued inside this thread's group: carried out at the group's
/// outermost end, after the group's work is launched (module docs).
pub(crate) fn defer_teardown(live: Arc<Live>, kind: Teardown) {
    OUTERMOST.with(|o| o.borrow_mut().teardowns.push((live, kind)));
}

/// Carries out a group's deferred finalizes and destroys in the order issued; the first error.
fn run_teardowns(teardowns: Vec<(Arc<Live>, Teardown)>) -> Result<()> {
    let mut first = Ok(());
    for (live, kind) in teardowns {
        let r = handles::teardown(live, kind);
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// Runs `call` (a collective or point-to-point call's body); inside a group, its error is also
/// the group's ([`group_end`] then runs none of the group's work).
#[inline(always)]
pub(crate) fn noting_refusal(call: impl FnOnce() -> Result<()>) -> Result<()> {
    noted(call())
}

/// `r`, a collective or point-to-point call's result, its error noted as the group's
/// ([`noting_refusal`]).
#[inline(always)]
pub(crate) fn noted(r: Result<()>) -> Result<()> {
    if let Err(e) = &r {
        note_refusal(e);
    }
    r
}

/// Notes `e` as the group's refused call when this thread is inside a group ([`noting_refusal`]).
#[cold]
fn note_refusal(e: &Error) {
    if oxccl::group::group_depth() > 0 {
        OUTERMOST.with(|o| {
            o.borrow_mut().refused.get_or_insert_with(|| e.clone());
        });
    }
}

/// An init issued inside a group: its handle and oxccl's pending communicator.
struct Deferred {
    handle: u64,
    pending: PendingComm,
    id: [u8; 128],
    device: Device,
}

/// Records an init for the end of this thread's group (`handle` is pending until then): oxccl's
/// [`oxccl::group::init_rank`], whose communicator the outermost end publishes.
pub(crate) fn defer_init(handle: u64, nranks: usize, rank: usize, id: [u8; 128], device: Device) -> Result<()> {
    let pending = oxccl::group::init_rank(nranks, &UniqueId::from_bytes(&id)?, rank, device)?;
    OUTERMOST.with(|o| {
        o.borrow_mut().inits.push(Deferred {
            handle,
            pending,
            id,
            device,
        })
    });
    Ok(())
}

/// How a communicator issued inside a group derives from its parent.
pub(crate) enum Derive {
    /// `ncclCommSplit` with this colour and key.
    Split { color: c_int, key: c_int },
    /// `ncclCommShrink` without these parent ranks, aborting the parent's operations first or not.
    Shrink { exclude: Vec<usize>, abort_first: bool },
}

/// A split or shrink issued inside a group: the parent, how, and the pending handle of the new
/// communicator (`None` for a split with `NCCL_SPLIT_NOCOLOR`).
struct DeferredSplit {
    handle: Option<u64>,
    parent: Arc<Live>,
    how: Derive,
}

/// Records a split or shrink for the end of this thread's group (`handle`, if any, is pending
/// until then).
pub(crate) fn defer_split(handle: Option<u64>, parent: Arc<Live>, how: Derive) {
    OUTERMOST.with(|o| o.borrow_mut().splits.push(DeferredSplit { handle, parent, how }));
}

/// Carries out one deferred split or shrink on the calling thread and names its pending handle
/// with the new communicator or the failure.
fn run_split(d: DeferredSplit) -> Result<()> {
    let made = match &d.how {
        Derive::Split { color, key } => d.parent.comm.split(*color, *key),
        Derive::Shrink { exclude, abort_first } => d.parent.comm.shrink(exclude, *abort_first).map(Some),
    };
    match (d.handle, made) {
        (Some(h), Ok(Some(child))) => crate::init::publish_derived(h, child).inspect_err(|e| handles::fail_pending(h, e)),
        (Some(h), Ok(None)) => {
            let e = Error::Internal("a split with a colour gave no communicator".into());
            handles::fail_pending(h, &e);
            Err(e)
        }
        (Some(h), Err(e)) => {
            handles::fail_pending(h, &e);
            Err(e)
        }
        (None, made) => made.map(|_| ()),
    }
}

/// Carries out a group's splits and shrinks: one thread per parent rank (each call is a
/// collective call of the parent's ranks, so one thread cannot run several ranks' calls in
/// turn), which runs that rank's calls in the order they were issued (two splits of one parent
/// must meet their peers' in the same order on every rank). Every pending handle is named with
/// its new communicator or its failure; the first failure is returned, preferring a rank's own
/// error to the `Remote` errors it causes in the others.
fn run_splits(splits: Vec<DeferredSplit>) -> Result<()> {
    let mut by_parent: Vec<Vec<DeferredSplit>> = Vec::new();
    for d in splits {
        match by_parent.iter_mut().find(|v| v[0].parent.id == d.parent.id) {
            Some(v) => v.push(d),
            None => by_parent.push(vec![d]),
        }
    }
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let mut jobs = Vec::new();
        for calls in by_parent {
            // The handles, to fail them if the thread cannot run.
            let handles: Vec<u64> = calls.iter().filter_map(|d| d.handle).collect();
            let job = std::thread::Builder::new().name("oxccl-nccl-split".into()).spawn_scoped(s, move || {
                let _keep = KeepCurrent::new();
                let mut first = Ok(());
                for d in calls {
                    let r = run_split(d);
                    if first.is_ok() {
                        first = r;
                    }
                }
                first
            });
            jobs.push((handles, job));
        }
        jobs.into_iter()
            .map(|(handles, j)| {
                let r = match j {
                    Ok(h) => h.join().unwrap_or_else(|_| Err(Error::Internal("a split thread panicked".into()))),
                    Err(e) => Err(Error::System(format!("cannot start a split thread: {e}"))),
                };
                if let Err(e) = &r
                    && matches!(e, Error::System(_) | Error::Internal(_))
                {
                    // A thread that never ran (or panicked) left its handles pending.
                    for h in handles {
                        handles::fail_pending_if_waiting(h, e);
                    }
                }
                r
            })
            .collect()
    });
    match Error::first_cause(results.into_iter().filter_map(|r| r.err())) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Names each deferred init's handle with its communicator, or its failure. Ranks created
/// together with every other rank of their id ([`oxccl::Comm::in_process_group`]) need no
/// clique.
fn publish(inits: Vec<Deferred>) {
    for d in inits {
        let made = d.pending.take().and_then(|comm| Ok((Target::of(d.device)?, comm)));
        match made {
            Ok((target, comm)) => {
                let clique = (!comm.in_process_group()).then(|| Clique::of(&d.id));
                handles::publish(Live::new(d.handle, comm, target, clique));
            }
            Err(e) => handles::fail_pending(d.handle, &e),
        }
    }
}

/// `ncclGroupEnd`: at the outermost end, the deferred inits, then oxccl's group end (the queued
/// sends and receives).
fn group_end() -> Result<()> {
    if !at_outermost("ncclGroupEnd")? {
        return oxccl::group_end();
    }
    let _keep = KeepCurrent::new();
    // A group of calls alone (the common one) holds nothing here: oxccl's end is all of it,
    // and nothing of this thread's part is moved.
    if OUTERMOST.with(|o| o.borrow().is_empty()) {
        return oxccl::group_end();
    }
    end_outermost()
}

/// [`group_end`] of an outermost group that holds inits, splits, shrinks, finalizes, destroys
/// or a refused call.
#[inline(never)]
fn end_outermost() -> Result<()> {
    let Outermost { refused, inits, splits, teardowns } = take_outermost();
    let split = if splits.is_empty() { Ok(()) } else { run_splits(splits) };
    if let Some(refused) = refused {
        // A call of the group was refused: none of its work runs (module docs).
        let ended = oxccl::group::abandon_end();
        publish(inits);
        // The finalizes and destroys are not work of the group: carried out all the same.
        let torn = run_teardowns(teardowns);
        // The inits' and splits' own failures reach their handles; the group's error is the
        // refused call's.
        if let Err(e) = split.and(ended).and(torn) {
            tracing::debug!(target: "oxccl::nccl", "group with a refused call, also: {e}");
        }
        return Err(refused);
    }
    // oxccl's end launches the group's collectives (queued there by the calls) once its sends
    // and receives are planned, so a group whose planning fails runs none of its work.
    let ended = oxccl::group_end();
    publish(inits);
    // The finalizes and destroys last: each waits for its communicator's work, launched above.
    let torn = run_teardowns(teardowns);
    split.and(ended).and(torn)
}

/// `InvalidUsage`: `what` outside a group.
#[cold]
fn no_group(what: &str) -> Error {
    Error::InvalidUsage(format!("{what} without a matching ncclGroupStart on this thread"))
}

/// Whether the end `what` ends this thread's outermost group (false: an inner one).
/// `InvalidUsage` naming `what` outside a group.
#[inline(always)]
fn at_outermost(what: &str) -> Result<bool> {
    match oxccl::group::group_depth() {
        0 => Err(no_group(what)),
        depth => Ok(depth == 1),
    }
}

/// What the outermost end of this thread's group takes: its refused call's error, its inits,
/// its splits and shrinks, and its finalizes and destroys.
fn take_outermost() -> Outermost {
    OUTERMOST.with(|o| std::mem::take(&mut *o.borrow_mut()))
}

/// `ncclGroupSimulateEnd` after its argument's checks: at the outermost end, the model's time of
/// the group's collectives ([`oxccl::group::simulate_end`]), which are dropped with its sends and
/// receives (its inits, splits, shrinks, finalizes and destroys are carried out); `None` at an
/// inner end.
fn simulate_end() -> Result<Option<f64>> {
    if !at_outermost("ncclGroupSimulateEnd")? {
        oxccl::group::simulate_end()?;
        return Ok(None);
    }
    let _keep = KeepCurrent::new();
    // The group's refused call is forgotten with the rest of its work.
    let Outermost { inits, splits, teardowns, .. } = take_outermost();
    let split = if splits.is_empty() { Ok(()) } else { run_splits(splits) };
    let ended = oxccl::group::simulate_end();
    publish(inits);
    let torn = run_teardowns(teardowns);
    split?;
    torn?;
    ended
}

nccl_api! {
    /// Starts a group on this thread, or a nested one.
    fn ncclGroupStart / pncclGroupStart() {
        oxccl::group_start()
    }

    /// Ends this thread's innermost group; the outermost end creates the communicators whose
    /// inits were issued in the group (module docs), then launches the group's sends and
    /// receives. `ncclInvalidUsage` without a matching `ncclGroupStart`.
    fn ncclGroupEnd / pncclGroupEnd() {
        group_end()
    }

    /// Ends the group as `ncclGroupEnd` does without running any of its work: its collectives,
    /// sends and receives are dropped (its inits, splits and shrinks are carried out), and
    /// `simInfo->estimatedTime` becomes the tuning model's time of its collectives in
    /// microseconds (module docs). `ncclInvalidArgument` for a NULL `simInfo` or a wrong magic
    /// (the group stays open then). At an inner level it only ends that level and leaves
    /// `estimatedTime` as it was.
    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(sim_info: *mut ncclSimInfo_t) {
        non_null("simInfo", sim_info)?;
        // SAFETY: non-NULL; NCCL's contract: an ncclSimInfo_t, which begins with its size.
        let size = unsafe { sim_info.cast::<usize>().read_unaligned() };
        let magic = if size >= 12 {
            // SAFETY: the struct holds at least the magic (its size says so).
            unsafe { (&raw const (*sim_info).magic).read_unaligned() }
        } else {
            0
        };
        if magic != NCCL_SIM_INFO_MAGIC {
            return Err(Error::InvalidArgument(format!(
                "simInfo->magic is {magic:#x} (size {size}), not {NCCL_SIM_INFO_MAGIC:#x}: initialize it with NCCL_SIM_INFO_INITIALIZER"
            )));
        }
        let Some(us) = simulate_end()? else {
            return Ok(());
        };
        if size >= std::mem::offset_of!(ncclSimInfo_t, estimated_time) + std::mem::size_of::<f32>() {
            // SAFETY: the caller's struct holds the field (its size says so).
            unsafe { (&raw mut (*sim_info).estimated_time).write_unaligned(us as f32) };
        }
        Ok(())
    }
}
