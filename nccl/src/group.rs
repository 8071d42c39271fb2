//! Groups (NCCL's `group.cc`): `ncclGroupStart`/`ncclGroupEnd` are oxccl's per-thread, nesting
//! [`oxccl::group_start`]/[`oxccl::group_end`] (sends and receives queued until the outermost
//! end; collectives launch when called), plus the inits issued inside a group.
//!
//! **Inits inside a group.** NCCL lets one thread create several ranks:
//! `ncclGroupStart(); for each GPU: cudaSetDevice(g); ncclCommInitRank(&comms[g], n, id, g);
//! ncclGroupEnd()` (nccl-tests' default). `ncclCommInitRank` inside a group records the init and
//! hands out a pending handle at once; the outermost `ncclGroupEnd` carries the inits out, all
//! at the same time: the inits of a unique id that cover every rank `0..nranks` of it become
//! one `Comm::init_all` (one process group, as `ncclCommInitAll`: an in-process bootstrap,
//! direct pointers, ranks sharing a GPU launching in step); any other init runs
//! `Comm::init_rank` on a thread of its own, meeting the ranks of other processes through the
//! bootstrap. Each pending handle then names its communicator, or the failure of its init.
//! Then the group's sends and receives are launched. A call on a pending handle before the end
//! is `ncclInvalidUsage` (NCCL's users issue them after `ncclGroupEnd`).
use crate::cuda::KeepCurrent;
use crate::errors::non_null;
use crate::handles::{self, Clique, Live, Target};
use crate::types::{NCCL_SIM_INFO_MAGIC, ncclSimInfo_t};
use oxccl::bootstrap::UniqueId;
use oxccl::{Comm, Device, Error, Result};
use std::cell::RefCell;

/// An init issued inside a group.
struct Deferred {
    handle: u64,
    nranks: usize,
    rank: usize,
    id: [u8; 128],
    device: Device,
}

thread_local! {
    static DEFERRED: RefCell<Vec<Deferred>> = const { RefCell::new(Vec::new()) };
}

/// Records an init for the end of this thread's group (`handle` is pending until then).
pub(crate) fn defer_init(handle: u64, nranks: usize, rank: usize, id: [u8; 128], device: Device) {
    DEFERRED.with(|d| {
        d.borrow_mut().push(Deferred {
            handle,
            nranks,
            rank,
            id,
            device,
        })
    });
}

/// Whether `set` (the inits of one id) holds each rank `0..nranks` once, all with one `nranks`.
fn covers_every_rank(set: &[Deferred]) -> bool {
    let n = set[0].nranks;
    let mut seen = vec![false; n];
    set.len() == n
        && set
            .iter()
            .all(|d| d.nranks == n && d.rank < n && !std::mem::replace(&mut seen[d.rank], true))
}

/// Every rank of one id, as one `Comm::init_all`.
fn init_all(mut set: Vec<Deferred>) -> Result<()> {
    set.sort_by_key(|d| d.rank);
    let devices: Vec<Device> = set.iter().map(|d| d.device).collect();
    let made = devices
        .iter()
        .map(|d| Target::of(*d))
        .collect::<Result<Vec<_>>>()
        .and_then(|targets| Ok((Comm::init_all(&devices)?, targets)));
    match made {
        Ok((comms, targets)) => {
            for ((d, comm), target) in set.iter().zip(comms).zip(targets) {
                handles::publish(Live::new(d.handle, comm, target, None));
            }
            Ok(())
        }
        Err(e) => {
            for d in &set {
                handles::fail_pending(d.handle, &e);
            }
            Err(e)
        }
    }
}

/// One rank, as `Comm::init_rank`.
fn init_rank(d: Deferred) -> Result<()> {
    let made = (|| {
        let uid = UniqueId::from_bytes(&d.id)?;
        let target = Target::of(d.device)?;
        Ok((Comm::init_rank(d.nranks, &uid, d.rank, d.device)?, target))
    })();
    match made {
        Ok((comm, target)) => {
            handles::publish(Live::new(d.handle, comm, target, Some(Clique::of(&d.id))));
            Ok(())
        }
        Err(e) => {
            handles::fail_pending(d.handle, &e);
            Err(e)
        }
    }
}

/// Carries out a group's inits together (module docs); the first failure, preferring a rank's
/// own error to the `Remote` errors it causes in the others.
fn run_inits(inits: Vec<Deferred>) -> Result<()> {
    if inits.is_empty() {
        return Ok(());
    }
    let mut sets: Vec<Vec<Deferred>> = Vec::new();
    for d in inits {
        match sets.iter_mut().find(|s| s[0].id == d.id) {
            Some(s) => s.push(d),
            None => sets.push(vec![d]),
        }
    }
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let mut jobs = Vec::new();
        let thread = || std::thread::Builder::new().name("oxccl-nccl-init".into());
        for set in sets {
            if covers_every_rank(&set) {
                jobs.push(thread().spawn_scoped(s, move || init_all(set)));
            } else {
                for d in set {
                    jobs.push(thread().spawn_scoped(s, move || init_rank(d)));
                }
            }
        }
        jobs.into_iter()
            .map(|j| match j {
                Ok(h) => h.join().unwrap_or_else(|_| Err(Error::Internal("an init thread panicked".into()))),
                Err(e) => Err(Error::System(format!("cannot start an init thread: {e}"))),
            })
            .collect()
    });
    let mut errors: Vec<Error> = results.into_iter().filter_map(|r| r.err()).collect();
    if errors.is_empty() {
        return Ok(());
    }
    let at = errors.iter().position(|e| !matches!(e, Error::Remote(_))).unwrap_or(0);
    Err(errors.swap_remove(at))
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
    let inits = if depth == 1 { DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut())) } else { Vec::new() };
    let inited = run_inits(inits);
    let ended = oxccl::group_end();
    inited.and(ended)
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
