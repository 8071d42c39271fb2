//! Groups (NCCL's `group.cc`): `ncclGroupStart`/`ncclGroupEnd` are oxccl's per-thread, nesting
//! [`oxccl::group_start`]/[`oxccl::group_end`] (sends and receives queued until the outermost
//! end; collectives launch when called), plus the inits issued inside a group.
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
use crate::cuda::KeepCurrent;
use crate::errors::non_null;
use crate::handles::{self, Clique, Live, Target};
use crate::types::{NCCL_SIM_INFO_MAGIC, ncclSimInfo_t};
use oxccl::bootstrap::UniqueId;
use oxccl::group::PendingComm;
use oxccl::{Device, Error, Result};
use std::cell::RefCell;
use std::ffi::c_int;
use std::sync::Arc;

/// An init issued inside a group: its handle and oxccl's pending communicator.
struct Deferred {
    handle: u64,
    pending: PendingComm,
    id: [u8; 128],
    device: Device,
}

thread_local! {
    static DEFERRED: RefCell<Vec<Deferred>> = const { RefCell::new(Vec::new()) };
}

/// Records an init for the end of this thread's group (`handle` is pending until then): oxccl's
/// [`oxccl::group::init_rank`], whose communicator the outermost end publishes.
pub(crate) fn defer_init(handle: u64, nranks: usize, rank: usize, id: [u8; 128], device: Device) -> Result<()> {
    let pending = oxccl::group::init_rank(nranks, &UniqueId::from_bytes(&id)?, rank, device)?;
    DEFERRED.with(|d| {
        d.borrow_mut().push(Deferred {
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

thread_local! {
    static SPLITS: RefCell<Vec<DeferredSplit>> = const { RefCell::new(Vec::new()) };
}

/// Records a split or shrink for the end of this thread's group (`handle`, if any, is pending
/// until then).
pub(crate) fn defer_split(handle: Option<u64>, parent: Arc<Live>, how: Derive) {
    SPLITS.with(|d| d.borrow_mut().push(DeferredSplit { handle, parent, how }));
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
    let depth = oxccl::group::group_depth();
    if depth == 0 {
        return Err(Error::InvalidUsage(
            "ncclGroupEnd without a matching ncclGroupStart on this thread".into(),
        ));
    }
    let _keep = KeepCurrent::new();
    let (inits, splits) = if depth == 1 {
        (DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut())), SPLITS.with(|d| std::mem::take(&mut *d.borrow_mut())))
    } else {
        (Vec::new(), Vec::new())
    };
    let split = if splits.is_empty() { Ok(()) } else { run_splits(splits) };
    let ended = oxccl::group_end();
    publish(inits);
    split.and(ended)
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

    /// Not supported yet: oxccl cannot estimate a group's time without running it. Checks
    /// `sim_info` (NULL or a wrong magic: `ncclInvalidArgument`), then ends the group as
    /// `ncclGroupEnd` does — its operations run — and returns `ncclInvalidUsage` saying so.
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
        group_end()?;
        Err(Error::InvalidUsage(
            "ncclGroupSimulateEnd is not supported yet by oxccl (no time estimate): the group was ended as by ncclGroupEnd, \
             its operations were launched, and simInfo->estimatedTime was left unchanged"
                .into(),
        ))
    }
}
