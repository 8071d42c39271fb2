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
//! init. A call on a pending handle before the end
//! is `ncclInvalidUsage` (NCCL's users issue them after `ncclGroupEnd`).
use crate::cuda::KeepCurrent;
use crate::errors::non_null;
use crate::handles::{self, Clique, Live, Target};
use crate::types::{NCCL_SIM_INFO_MAGIC, ncclSimInfo_t};
use oxccl::bootstrap::UniqueId;
use oxccl::group::PendingComm;
use oxccl::{Device, Error, Result};
use std::cell::RefCell;

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
    let inits = if depth == 1 { DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut())) } else { Vec::new() };
    let ended = oxccl::group_end();
    publish(inits);
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
