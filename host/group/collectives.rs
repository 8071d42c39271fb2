//! A group's collectives launched at its end (NCCL's `groupLaunch` → `ncclPrepareTasks` →
//! `scheduleCollTasksToPlan`): each communicator's calls in the order issued, consecutive calls
//! on one stream that run on the same LL kernel entry sharing one launch (up to
//! [`oxccl_gpu::abi::MAX_COLL_WORKS`]: NCCL's work batch; LL128 and Simple calls launch alone,
//! [`oxccl_gpu::abi::proto_batches`]), the launches of different
//! communicators interleaved round by round — the first launch of every communicator before
//! the second of any — so one thread may end a group holding several ranks' calls even when
//! those ranks share a GPU and launch in step (`comm/enqueue.rs`). Every rank of a
//! communicator batches alike: its calls, their plans and so their kernel entries are the same
//! on every rank.
use crate::comm::{Comm, Planned, PlannedColl};
use crate::error::{Error, Result};
use crate::mem::Stream;
use crate::redop::ReduceOp;
use oxccl_gpu::abi::{DataType, Func, MAX_COLL_WORKS};

/// One collective call deferred to a group's end (NCCL's `ncclTaskColl`), as
/// [`Comm::collective_raw`] takes it.
pub struct CollTask<'a> {
    pub comm: &'a Comm,
    pub func: Func,
    /// Device address of the input (0 where NCCL lets a rank omit it).
    pub send: u64,
    /// Device address of the output (0 where NCCL lets a rank omit it).
    pub recv: u64,
    /// Elements, as the collective's `count` (per rank for AllGather and ReduceScatter).
    pub count: usize,
    pub dtype: DataType,
    pub op: ReduceOp<'a>,
    pub root: usize,
    pub stream: &'a Stream,
}

/// A collective issued inside a [`super::group_start`]/[`super::group_end`] pair, checked and
/// queued in the thread's group until its outermost end: it holds its communicator (a handle,
/// [`Comm::handle`]) and its stream; its buffers are held by the group (`held.rs`).
pub(crate) struct QueuedColl {
    pub(crate) comm: Comm,
    pub(crate) func: Func,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) count: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp<'static>,
    pub(crate) root: usize,
    pub(crate) stream: Stream,
}

impl QueuedColl {
    /// The call as [`launch_collectives`] takes it.
    pub(crate) fn task(&self) -> CollTask<'_> {
        CollTask {
            comm: &self.comm,
            func: self.func,
            send: self.send,
            recv: self.recv,
            count: self.count,
            dtype: self.dtype,
            op: self.op,
            root: self.root,
            stream: &self.stream,
        }
    }
}

/// What one turn of the launch does.
enum Unit<'a> {
    /// A call of a communicator whose calls do not share launches: issued alone.
    Alone(CollTask<'a>),
    /// A call of count 0: recorded.
    Empty(&'a Comm, crate::comm::EmptyCall),
    /// Planned calls launched together.
    Batch {
        comm: &'a Comm,
        stream: &'a Stream,
        works: Vec<PlannedColl>,
        captured: bool,
    },
    /// A call refused when planned: its error, at its turn.
    Refused(Error),
}

/// Launches `calls` — a group's collectives, in the order issued — as the module docs say.
/// Every call is attempted (the other ranks wait for each); returns the first error.
///
/// # Safety
/// Each call's buffers are valid on its rank's device for the sizes its collective needs with
/// its count until it completes on its stream, and overlap only as the in-place forms allow
/// ([`Comm::collective_raw`]'s contract for each).
pub unsafe fn launch_collectives(calls: Vec<CollTask<'_>>) -> Result<()> {
    let mut queues: Vec<Vec<CollTask<'_>>> = Vec::new();
    for c in calls {
        match queues.iter_mut().find(|q| q[0].comm.same_rank(c.comm)) {
            Some(q) => q.push(c),
            None => queues.push(vec![c]),
        }
    }
    // SAFETY: forwarded caller contract.
    let mut turns: Vec<_> = queues
        .into_iter()
        .map(|q| unsafe { units(q) }.into_iter())
        .collect();
    let mut first = Ok(());
    loop {
        let mut any = false;
        for t in turns.iter_mut() {
            let Some(u) = t.next() else { continue };
            any = true;
            // SAFETY: forwarded caller contract.
            let r = unsafe { run(u) };
            if first.is_ok() {
                first = r;
            }
        }
        if !any {
            return first;
        }
    }
}

/// One communicator's calls as launch turns: planned and batched when it batches
/// ([`Comm::batches_collectives`]), else each alone.
///
/// # Safety
/// As [`launch_collectives`].
unsafe fn units<'a>(queue: Vec<CollTask<'a>>) -> Vec<Unit<'a>> {
    let comm = queue[0].comm;
    if !comm.batches_collectives() {
        return queue.into_iter().map(Unit::Alone).collect();
    }
    let mut units = Vec::new();
    let mut batch: Option<(&'a Stream, Vec<PlannedColl>, bool)> = None;
    let flush = |units: &mut Vec<Unit<'a>>, batch: &mut Option<(&'a Stream, Vec<PlannedColl>, bool)>| {
        if let Some((stream, works, captured)) = batch.take() {
            units.push(Unit::Batch {
                comm,
                stream,
                works,
                captured,
            });
        }
    };
    for c in queue {
        // SAFETY: forwarded caller contract.
        let planned = unsafe {
            comm.plan_collective(c.func, c.send, c.recv, c.count, c.dtype, &c.op, c.root, c.stream)
        };
        match planned {
            Err(e) => {
                flush(&mut units, &mut batch);
                units.push(Unit::Refused(e));
            }
            Ok((Planned::Empty(e), _)) => {
                flush(&mut units, &mut batch);
                units.push(Unit::Empty(comm, e));
            }
            Ok((Planned::Work(p), captured)) => {
                let joins = batch.as_ref().is_some_and(|(s, works, cap)| {
                    s.same(c.stream)
                        && *cap == captured
                        && works.len() < MAX_COLL_WORKS
                        && works[0].shares_launch_with(&p)
                });
                if !joins {
                    flush(&mut units, &mut batch);
                    batch = Some((c.stream, Vec::new(), captured));
                }
                if let Some((_, works, _)) = batch.as_mut() {
                    works.push(p);
                }
            }
        }
    }
    flush(&mut units, &mut batch);
    units
}

/// Runs one turn.
///
/// # Safety
/// As [`launch_collectives`].
unsafe fn run(u: Unit<'_>) -> Result<()> {
    match u {
        // SAFETY: forwarded caller contract.
        Unit::Alone(c) => unsafe {
            c.comm
                .collective_raw(c.func, c.send, c.recv, c.count, c.dtype, c.op, c.root, c.stream)
        },
        Unit::Empty(comm, e) => {
            comm.record_empty(e);
            Ok(())
        }
        Unit::Batch {
            comm,
            stream,
            works,
            captured,
        } => comm.launch_batch(works, captured, stream),
        Unit::Refused(e) => Err(e),
    }
}
