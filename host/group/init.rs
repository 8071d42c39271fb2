//! Communicators created inside a group (NCCL's `ncclCommInitRank` between `ncclGroupStart` and
//! `ncclGroupEnd`): how one thread creates several ranks, one per GPU, as nccl-tests does by
//! default. [`init_rank`] inside a group records the init and returns a [`PendingComm`] at once;
//! the thread's outermost [`super::group_end`] carries the group's inits out together, before
//! its sends and receives: the inits of one unique id that cover every rank `0..nranks` of it
//! become one [`Comm::init_all`] (an in-process bootstrap, direct pointers, ranks sharing a GPU
//! launching in step); any other init runs [`Comm::init_rank`] on a thread of its own and meets
//! the ranks of other threads or processes through the bootstrap. Each [`PendingComm`] then
//! holds its communicator, or the error of its init.
use crate::bootstrap::UniqueId;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mem::Device;
use std::sync::{Arc, Mutex};

/// A communicator whose creation was issued inside a group: it exists once the thread's
/// outermost group has ended ([`PendingComm::take`]). A group that holds every rank of its id
/// makes one process group, whose ranks may be dropped from one thread; ranks of a group that
/// holds only some ranks of an id are `init_rank` communicators, which meet their peers at a
/// teardown barrier: drop them on a thread each.
#[derive(Clone)]
pub struct PendingComm {
    rank: usize,
    slot: Arc<Mutex<Slot>>,
}

enum Slot {
    /// The group has not ended yet.
    Waiting,
    Done(Result<Comm>),
    Taken,
}

impl std::fmt::Debug for PendingComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.slot.lock().as_deref() {
            Ok(Slot::Waiting) => "waiting for the group's end",
            Ok(Slot::Done(Ok(_))) => "ready",
            Ok(Slot::Done(Err(_))) => "failed",
            Ok(Slot::Taken) | Err(_) => "taken",
        };
        write!(f, "PendingComm(rank {}: {state})", self.rank)
    }
}

impl PendingComm {
    fn new(rank: usize, slot: Slot) -> PendingComm {
        PendingComm {
            rank,
            slot: Arc::new(Mutex::new(slot)),
        }
    }

    /// The communicator, once the group of its init has ended; the init's error if it failed.
    /// InvalidUsage before the end, and when the communicator was taken already.
    pub fn take(&self) -> Result<Comm> {
        let mut slot = self
            .slot
            .lock()
            .map_err(|_| Error::Internal("a pending communicator's lock was poisoned".into()))?;
        match std::mem::replace(&mut *slot, Slot::Taken) {
            Slot::Done(r) => r,
            Slot::Waiting => {
                *slot = Slot::Waiting;
                Err(Error::InvalidUsage(format!(
                    "rank {}: the communicator is created when the group of its init ends; call take() after group_end",
                    self.rank
                )))
            }
            Slot::Taken => Err(Error::InvalidUsage(format!(
                "rank {}: the communicator of this init was taken already",
                self.rank
            ))),
        }
    }

    fn fill(&self, r: Result<Comm>) {
        if let Ok(mut slot) = self.slot.lock() {
            *slot = Slot::Done(r);
        }
    }

    /// Fails a communicator still waiting (its init never ran); one made or failed already is
    /// left as it is.
    fn fail_if_waiting(&self, e: &Error) {
        if let Ok(mut slot) = self.slot.lock()
            && matches!(*slot, Slot::Waiting)
        {
            *slot = Slot::Done(Err(e.clone()));
        }
    }
}

/// Rank `rank` of `nranks` of unique id `id` on `device` (as [`Comm::init_rank`]). Inside a
/// group the init is recorded and runs at the outermost group end (module docs), so one thread
/// may create every rank; outside a group it runs now. Errors: InvalidArgument for `nranks == 0`
/// or `rank >= nranks` (at once); the init's own errors through [`PendingComm::take`] (and
/// from `group_end`, which returns the first of them).
///
/// ```
/// # use oxccl::{bootstrap, group, Device};
/// let id = bootstrap::get_unique_id()?;
/// let pending = oxccl::group(|| (0..2).map(|r| group::init_rank(2, &id, r, Device::Cpu(r))).collect::<Vec<_>>())?;
/// let comms = pending.into_iter().map(|p| p?.take()).collect::<oxccl::Result<Vec<_>>>()?;
/// assert_eq!(comms[1].rank(), 1);
/// # Ok::<(), oxccl::Error>(())
/// ```
pub fn init_rank(nranks: usize, id: &UniqueId, rank: usize, device: Device) -> Result<PendingComm> {
    if nranks == 0 || nranks > crate::bootstrap::MAX_NRANKS || rank >= nranks {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} of nranks {nranks}: nranks must be in 1..={} and rank in 0..nranks",
            crate::bootstrap::MAX_NRANKS
        )));
    }
    if super::group_depth() == 0 {
        return Ok(PendingComm::new(
            rank,
            Slot::Done(Comm::init_rank(nranks, id, rank, device)),
        ));
    }
    let pending = PendingComm::new(rank, Slot::Waiting);
    super::defer_init(Deferred {
        pending: pending.clone(),
        nranks,
        rank,
        id: *id,
        device,
    });
    Ok(pending)
}

/// An init issued inside a group.
pub(super) struct Deferred {
    pending: PendingComm,
    nranks: usize,
    rank: usize,
    id: UniqueId,
    device: Device,
}

/// Whether `set` (the inits of one id) holds each rank `0..nranks` once, all with one `nranks`.
fn covers_every_rank(set: &[Deferred]) -> bool {
    let n = set[0].nranks;
    if set.len() != n {
        return false;
    }
    let mut seen = vec![false; n];
    set
            .iter()
            .all(|d| d.nranks == n && d.rank < n && !std::mem::replace(&mut seen[d.rank], true))
}

/// Every rank of one id, as one [`Comm::init_all`].
fn init_all(mut set: Vec<Deferred>) -> Result<()> {
    set.sort_by_key(|d| d.rank);
    let devices: Vec<Device> = set.iter().map(|d| d.device).collect();
    match Comm::init_all(&devices) {
        Ok(comms) => {
            for (d, comm) in set.iter().zip(comms) {
                d.pending.fill(Ok(comm));
            }
            Ok(())
        }
        Err(e) => {
            for d in &set {
                d.pending.fill(Err(e.clone()));
            }
            Err(e)
        }
    }
}

/// Carries out a group's inits together (module docs); the first failure, preferring a rank's
/// own error to the `Remote` errors it causes in the others.
pub(super) fn run(inits: Vec<Deferred>) -> Result<()> {
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
        let thread = || std::thread::Builder::new().name("oxccl-group-init".into());
        for set in sets {
            if covers_every_rank(&set) {
                let pending: Vec<PendingComm> = set.iter().map(|d| d.pending.clone()).collect();
                jobs.push((pending, thread().spawn_scoped(s, move || init_all(set))));
            } else {
                for d in set {
                    let pending = vec![d.pending.clone()];
                    jobs.push((pending, thread().spawn_scoped(s, move || {
                        let r = Comm::init_rank(d.nranks, &d.id, d.rank, d.device);
                        let out = r.as_ref().map(|_| ()).map_err(Error::clone);
                        d.pending.fill(r);
                        out
                    })));
                }
            }
        }
        jobs.into_iter()
            .map(|(pending, j)| {
                let r = match j {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(Error::Internal("an init thread panicked".into()))),
                    Err(e) => Err(Error::System(format!("cannot start an init thread: {e}"))),
                };
                if let Err(e) = &r {
                    // A thread that never ran (or panicked) left its communicators waiting.
                    for p in pending {
                        p.fail_if_waiting(e);
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
