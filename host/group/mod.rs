//! Groups (NCCL's `group.cc`: `ncclGroupStart`/`ncclGroupEnd`): the calling thread's queue of
//! collectives and point-to-point calls, launched together when its outermost group ends.
//!
//! A group is per thread and nests: [`group_start`] deepens it, [`group_end`] ends one level,
//! and the outermost end launches what was queued, so a thread driving several ranks (NCCL's
//! one thread per process) can issue every rank's calls before any of them runs. A call is
//! checked when issued (its argument errors are returned then, and it is not queued); at the
//! end, the collectives are launched first, each communicator's in the order issued, consecutive
//! LL calls of one kernel entry and stream sharing a launch ([`launch_collectives`]; a
//! [`scope`] does the same with borrows the compiler checks, `scope.rs`), then the sends and
//! receives (NCCL schedules a group's collectives before its point-to-point work), per
//! communicator:
//!
//! - a send and a receive with the rank itself are matched in order and become a copy;
//! - every other call becomes one work per peer channel of its pair (NCCL's
//!   `NCCL_NCHANNELS_PER_PEER`); all of a communicator's works go into one launch, the works of
//!   each connection (a peer channel's send or receive side) on one thread block, one after the
//!   other in the order issued, so the calls of a pair match in order (NCCL's p2p work batches);
//! - a launch holds at most [`MAX_P2P_WORKS`] works (its kernel parameter's room): a group with
//!   more goes out in rounds instead — the first call of each (peer, direction) in the first
//!   launch, the second in the second, and so on, the launches of every communicator round by
//!   round — and a group whose round would still hold more fails at its end naming the limit,
//!   before anything of it is launched.
//!
//! Communicators may be created inside a group ([`init_rank`], NCCL's `ncclCommInitRank`
//! inside a group, how one thread creates several ranks): the outermost end creates them
//! together, before it launches the group's sends and receives (`init.rs`).
//!
//! A group's sends and receives of one communicator must use one stream. A queued call keeps
//! what it runs on: its communicator (a [`crate::Comm`] dropped or destroyed inside the group is
//! torn down after the group's end has launched its calls), its stream (destroyed after the
//! group's end when dropped inside it), and its buffers — a [`crate::DeviceBuffer`] dropped
//! inside the group is freed only after the outermost end has queued the group's work
//! (`held.rs`), and then after that work, as every buffer is. Raw addresses
//! ([`crate::Comm::send_raw`], [`crate::Comm::collective_raw`]) stay the caller's to keep valid
//! until the work has run.
use crate::comm::P2pTarget;
use crate::error::{Error, Result};
use crate::mem::Stream;
use oxccl_gpu::abi::{MAX_P2P_WORKS, P2P_AFTER_PREVIOUS, WorkP2p};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

mod collectives;
pub(crate) mod held;
mod init;
mod scope;
pub use collectives::{CollTask, launch_collectives};
pub(crate) use collectives::QueuedColl;
pub use init::{PendingComm, init_rank};
pub use scope::{GroupScope, scope};

/// One send or receive: direction, peer, buffer address and size in bytes (a send: what it
/// sends; a receive: what its output holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct P2pOp {
    pub(crate) send: bool,
    pub(crate) peer: usize,
    pub(crate) buff: u64,
    pub(crate) bytes: u64,
}

/// A queued call: its communicator's launch resources, its stream and the operation, and a
/// handle on its communicator (which then cannot be finalized or destroyed before the group's
/// end, [`crate::Comm::finalize`]).
pub(crate) struct Queued {
    pub(crate) target: P2pTarget,
    pub(crate) stream: Stream,
    pub(crate) op: P2pOp,
    pub(crate) comm: crate::Comm,
}

struct Group {
    depth: usize,
    /// The outermost group's id ([`current_group`]), while `depth > 0`.
    id: u64,
    queued: Vec<Queued>,
    /// The collectives issued inside the group, checked, in the order issued.
    collectives: Vec<QueuedColl>,
    /// The communicator inits issued inside the group ([`init_rank`]).
    inits: Vec<init::Deferred>,
    /// The first call refused inside the group ([`noted`]); a [`scope`] then runs none of it.
    refused: Option<Error>,
}

impl Drop for Group {
    /// A thread that exits inside a group drops its queued calls unrun; the memory they held is
    /// released.
    fn drop(&mut self) {
        if self.depth > 0 {
            held::release(self.id);
        }
    }
}

/// The last id given to an outermost group of any thread.
static LAST_GROUP_ID: AtomicU64 = AtomicU64::new(0);

impl Group {
    /// A thread's group before its first [`group_start`].
    const NONE: Group = Group {
        depth: 0,
        id: 0,
        queued: Vec::new(),
        collectives: Vec::new(),
        inits: Vec::new(),
        refused: None,
    };
}

thread_local! {
    // Initialized in place (`const`): every call in a group and every group's start and end
    // reads it, so each access is one check of the slot's state, not a lazy initializer's call.
    static GROUP: RefCell<Group> = const { RefCell::new(Group::NONE) };
}

/// Starts a group on this thread, or a nested one (NCCL's `ncclGroupStart`). Every call must
/// be matched by a [`group_end`] on the same thread.
pub fn group_start() -> Result<()> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            g.id = LAST_GROUP_ID.fetch_add(1, Ordering::Relaxed) + 1;
        }
        g.depth += 1;
    });
    Ok(())
}

/// Ends the innermost group of this thread (NCCL's `ncclGroupEnd`); the outermost end creates
/// the communicators of the group's [`init_rank`] calls, then launches every queued collective,
/// then every send and receive (module docs). Errors: the first failed init's (each
/// [`PendingComm`] holds its own); InvalidUsage without a matching [`group_start`];
/// InvalidUsage when a communicator's sends and receives use several streams, a send or receive
/// with the rank itself has no match, or a launch would exceed [`MAX_P2P_WORKS`] blocks
/// (nothing of the group is launched then); InvalidArgument when a matched send and receive
/// with the rank itself differ in size (the smaller size is copied); launch errors (every call
/// is still attempted: the peers wait for each).
pub fn group_end() -> Result<()> {
    // Held until the queued calls are launched (or refused): buffers dropped inside the group
    // are freed after that.
    let (outermost, inits, ended, _held) = end_level_outermost("group_end")?;
    let inited = init::run(inits);
    if !outermost {
        return inited;
    }
    let Ended { queued, collectives } = ended;
    let launched = plan_queued(queued).and_then(|planned| {
        let tasks: Vec<CollTask<'_>> = collectives.iter().map(QueuedColl::task).collect();
        // SAFETY: each call's ranges were checked against its buffers at the call, and the group
        // holds them (`held.rs`) until `_held` is dropped, after these launches; raw addresses
        // are the caller's to keep valid ([`crate::Comm::collective_raw`]'s contract).
        let own = unsafe { launch_collectives(tasks) };
        // The sends and receives are launched whatever the collectives' launch returned: the
        // peers wait for them.
        own.and(launch_planned(planned))
    });
    // The communicators' handles go after the launches: a communicator dropped inside the
    // group is torn down here, once its queued work is launched.
    drop(collectives);
    inited.and(launched)
}

/// Ends the innermost group of this thread as [`group_end`] does, except that the outermost end
/// launches nothing: the collectives, sends and receives queued in the group are dropped, unrun
/// (NCCL's `ncclGroupSimulateEnd`, which plans a group to estimate its time and discards it).
/// The communicators of the group's [`init_rank`] calls are created.
///
/// Returns, at the outermost end, the tuning model's time of the group's collectives in
/// microseconds ([`crate::Comm::predict_us`]): per communicator the sum of its calls, the
/// largest over the group's communicators (the ranks of a group run at once, so one thread
/// driving N ranks of one collective gets one collective's time), 0 when there are none;
/// `None` at an inner end. Errors: as [`group_end`]'s for the inits, else a call's model
/// error; InvalidUsage without a matching [`group_start`].
pub fn simulate_end() -> Result<Option<f64>> {
    let (outermost, inits, ended, held) = end_level_outermost("simulate_end")?;
    let estimate = outermost.then(|| estimate_us(&ended.collectives)).transpose();
    drop_unrun(ended, "simulated group end");
    drop(held);
    let inited = init::run(inits);
    let estimate = estimate?;
    inited.map(|()| estimate)
}

/// The model's time of `colls` in µs, as [`simulate_end`] reports it.
fn estimate_us(colls: &[QueuedColl]) -> Result<f64> {
    let mut per_comm: Vec<(&crate::Comm, f64)> = Vec::new();
    for c in colls {
        let t = c.comm.predict_us(c.func, c.count, c.dtype)?;
        match per_comm.iter_mut().find(|(comm, _)| comm.same_rank(&c.comm)) {
            Some((_, sum)) => *sum += t,
            None => per_comm.push((&c.comm, t)),
        }
    }
    Ok(per_comm.iter().map(|&(_, t)| t).fold(0.0, f64::max))
}

/// Ends the innermost group of this thread as [`simulate_end`] does (nothing launched, the
/// queued calls dropped, the inits carried out), for a group that must not run: one of whose
/// calls was refused (the C library's `ncclGroupEnd` fails such a group whole, as NCCL does).
/// Errors: as [`group_end`]'s for the inits; InvalidUsage without a matching [`group_start`].
pub fn abandon_end() -> Result<()> {
    let (_, inits, ended, held) = end_level_outermost("abandon_end")?;
    drop_unrun(ended, "group with a refused call");
    drop(held);
    init::run(inits)
}

/// Drops a group's queued calls unrun (`why`: the log's reason).
fn drop_unrun(ended: Ended, why: &str) {
    let calls = ended.queued.len() + ended.collectives.len();
    if calls > 0 {
        tracing::debug!(target: "oxccl::group", calls, "{why}: its calls are dropped");
    }
}

/// The queued calls of an outermost group's end.
#[derive(Default)]
struct Ended {
    queued: Vec<Queued>,
    collectives: Vec<QueuedColl>,
}

/// Ends one level of this thread's group (`what` names the call in the error): whether this
/// was the outermost end, and there the group's inits and queued calls, and what releases the
/// memory its calls hold (`held.rs`) once dropped.
fn end_level_outermost(what: &str) -> Result<(bool, Vec<init::Deferred>, Ended, held::ReleaseOnDrop)> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::InvalidUsage(format!("{what} without a group_start on this thread")));
        }
        g.depth -= 1;
        Ok(if g.depth == 0 {
            let ended = Ended {
                queued: std::mem::take(&mut g.queued),
                collectives: std::mem::take(&mut g.collectives),
            };
            g.refused = None;
            (true, std::mem::take(&mut g.inits), ended, held::ReleaseOnDrop(Some(g.id)))
        } else {
            (false, Vec::new(), Ended::default(), held::ReleaseOnDrop(None))
        })
    })
}

/// Records an init for the end of this thread's group.
fn defer_init(d: init::Deferred) {
    GROUP.with(|g| g.borrow_mut().inits.push(d));
}

/// Runs `f` inside a group ([`group_start`] … [`group_end`]): the sends and receives `f` issues
/// are launched together when it returns. `f`'s result is returned when the group's end
/// succeeds; otherwise the end's error.
pub fn group<R>(f: impl FnOnce() -> R) -> Result<R> {
    group_start()?;
    let r = f();
    group_end()?;
    Ok(r)
}

/// The depth of this thread's group (0: none).
#[inline]
pub fn group_depth() -> usize {
    GROUP.with(|g| g.borrow().depth)
}

/// The id of this thread's outermost group, unique in the process (`None` outside a group):
/// what the flight recorder tells a communicator's groups apart by.
#[inline]
pub(crate) fn current_group() -> Option<u64> {
    GROUP.with(|g| {
        let g = g.borrow();
        (g.depth > 0).then_some(g.id)
    })
}

/// `r`, its error noted as the first refused call of this thread's open group (none open:
/// nothing noted). A [`scope`] whose group has one runs none of its work. Inlined: a call's
/// success costs one test here, the refusal's noting is out of line ([`note_refused`]).
#[inline]
pub(crate) fn noted<T>(r: Result<T>) -> Result<T> {
    if let Err(e) = &r {
        note_refused(e);
    }
    r
}

/// [`noted`]'s refusal: `e` noted as the group's first refused call, if a group is open.
#[cold]
#[inline(never)]
fn note_refused(e: &Error) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.refused.is_none() {
            g.refused = Some(e.clone());
        }
    });
}

/// The first call refused in this thread's open group, taken.
fn take_refused() -> Option<Error> {
    GROUP.with(|g| g.borrow_mut().refused.take())
}

/// Queues the collective `q` in this thread's group, holding `ranges` (address, bytes: its
/// buffers) until the group's outermost end; gives `q` back when the thread has no group open.
pub(crate) fn defer_collective(q: QueuedColl, ranges: &[(u64, u64)]) -> Option<QueuedColl> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Some(q);
        }
        held::hold(g.id, ranges);
        g.collectives.push(q);
        None
    })
}

/// Queues `q` in this thread's group, or launches it at once when there is none.
pub(crate) fn enqueue(q: Queued) -> Result<()> {
    let alone = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            Some(q)
        } else {
            held::hold(g.id, &[(q.op.buff, q.op.bytes)]);
            g.queued.push(q);
            None
        }
    });
    match alone {
        Some(q) => launch_planned(plan_queued(vec![q])?),
        None => Ok(()),
    }
}

/// One communicator's part of a group.
struct CommPlan {
    /// A handle on the communicator: kept until its launches are queued, and asked at the
    /// group's end whether it may still launch ([`crate::Comm::check_launchable`]).
    comm: crate::Comm,
    target: P2pTarget,
    stream: Stream,
    /// Sends to itself matched with receives from itself: (dst, src, bytes).
    copies: Vec<(u64, u64, u64)>,
    /// The works of each launch (one launch unless the group holds more than one launch
    /// takes).
    rounds: Vec<Vec<WorkP2p>>,
}

fn plan(queued: Vec<Queued>) -> Result<(Vec<CommPlan>, Vec<Error>)> {
    let mut comms: Vec<(crate::Comm, P2pTarget, Stream, Vec<P2pOp>)> = Vec::new();
    for q in queued {
        match comms.iter_mut().find(|(_, t, _, _)| t.key() == q.target.key()) {
            Some((_, t, s, ops)) => {
                if !s.same(&q.stream) {
                    return Err(Error::InvalidUsage(format!(
                        "rank {}: the sends and receives of one communicator in a group must use one stream",
                        t.rank()
                    )));
                }
                ops.push(q.op);
            }
            None => comms.push((q.comm, q.target, q.stream, vec![q.op])),
        }
    }
    let mut plans = Vec::with_capacity(comms.len());
    let mut mismatches = Vec::new();
    for (comm, target, stream, ops) in comms {
        let me = target.rank();
        let (own, others): (Vec<P2pOp>, Vec<P2pOp>) = ops.into_iter().partition(|o| o.peer == me);
        let sends: Vec<&P2pOp> = own.iter().filter(|o| o.send).collect();
        let recvs: Vec<&P2pOp> = own.iter().filter(|o| !o.send).collect();
        if sends.len() != recvs.len() {
            return Err(Error::InvalidUsage(format!(
                "rank {me}: {} send(s) to itself and {} receive(s) from itself in one group; each needs its match in the same group",
                sends.len(),
                recvs.len()
            )));
        }
        let mut copies = Vec::new();
        for (s, r) in sends.iter().zip(&recvs) {
            if s.bytes != r.bytes {
                mismatches.push(Error::invalid(format!(
                    "rank {me}: a receive from rank {me} (itself) expected {} bytes but the send sent {} bytes ({} written)",
                    r.bytes,
                    s.bytes,
                    s.bytes.min(r.bytes)
                )));
            }
            copies.push((r.buff, s.buff, s.bytes.min(r.bytes)));
        }
        let works: Vec<WorkP2p> = others.iter().flat_map(|op| target.works_of(op)).collect();
        let rounds = if works.len() <= MAX_P2P_WORKS {
            vec![one_launch(works)]
        } else {
            rounds_of(&target, &others)?
        };
        plans.push(CommPlan {
            comm,
            target,
            stream,
            copies,
            rounds,
        });
    }
    Ok((plans, mismatches))
}

/// `works` as one launch: the works of each connection (a peer channel's send or receive side)
/// on one block, in the order issued (every one after the first flagged
/// [`P2P_AFTER_PREVIOUS`]), the connections in order of their first work.
fn one_launch(works: Vec<WorkP2p>) -> Vec<WorkP2p> {
    let mut conns: Vec<((u32, u8), Vec<WorkP2p>)> = Vec::new();
    for w in works {
        let key = (w.channel, w.kind);
        match conns.iter_mut().find(|(k, _)| *k == key) {
            Some((_, ws)) => ws.push(w),
            None => conns.push((key, vec![w])),
        }
    }
    conns
        .into_iter()
        .flat_map(|(_, ws)| {
            ws.into_iter().enumerate().map(|(i, mut w)| {
                if i > 0 {
                    w.kind |= P2P_AFTER_PREVIOUS;
                }
                w
            })
        })
        .collect()
}

/// The launches of a communicator's sends and receives (`others`, none with the rank itself)
/// whose works exceed one launch: the first call of each (peer, direction) in the first launch,
/// the second in the second, and so on; each launch at most [`MAX_P2P_WORKS`] works, else an
/// error naming the limit.
fn rounds_of(target: &P2pTarget, others: &[P2pOp]) -> Result<Vec<Vec<WorkP2p>>> {
    let me = target.rank();
    let mut rounds: Vec<Vec<WorkP2p>> = Vec::new();
    let mut seen: Vec<(usize, bool, usize)> = Vec::new();
    for op in others {
        let round = match seen.iter_mut().find(|(p, s, _)| (*p, *s) == (op.peer, op.send)) {
            Some((_, _, n)) => {
                *n += 1;
                *n - 1
            }
            None => {
                seen.push((op.peer, op.send, 1));
                0
            }
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].extend(target.works_of(op));
    }
    if let Some(r) = rounds.iter().find(|r| r.len() > MAX_P2P_WORKS) {
        return Err(Error::InvalidUsage(format!(
            "rank {me}: a group's sends and receives need {} thread blocks in one launch, more than the {MAX_P2P_WORKS} a launch holds \
             (one per peer channel of each peer and direction; fewer peers per group, or NCCL_NCHANNELS_PER_PEER=1, fit); nothing was launched",
            r.len()
        )));
    }
    Ok(rounds)
}

/// A group's sends and receives, planned ([`plan`]): per communicator its copies and launch
/// rounds, and the size mismatches of self-sends (reported after the launch).
struct Planned(Vec<CommPlan>, Vec<Error>);

/// Plans every communicator's part of `queued` (nothing to plan: an empty plan).
fn plan_queued(queued: Vec<Queued>) -> Result<Planned> {
    if queued.is_empty() {
        return Ok(Planned(Vec::new(), Vec::new()));
    }
    let (plans, mismatches) = plan(queued)?;
    Ok(Planned(plans, mismatches))
}

/// Launches a planned group: the copies, then the launches round by round across
/// communicators. A communicator that may no longer launch (aborted, revoked, finalized since
/// its calls were queued) launches none of its part; every other part is launched (its peers
/// wait for it), and the first error is returned.
fn launch_planned(Planned(plans, mismatches): Planned) -> Result<()> {
    let mut first: Result<()> = Ok(());
    let mut note = |r: Result<()>| {
        if first.is_ok() {
            first = r;
        }
    };
    let usable: Vec<bool> = plans
        .iter()
        .map(|p| {
            let r = p.comm.check_launchable();
            let ok = r.is_ok();
            note(r);
            ok
        })
        .collect();
    for (p, _) in plans.iter().zip(&usable).filter(|(_, u)| **u) {
        for &(dst, src, bytes) in &p.copies {
            // SAFETY: the send and receive buffers were checked (or promised, for the raw calls)
            // for their sizes; `bytes` is the smaller one.
            note(unsafe { p.target.copy(dst, src, bytes as usize, &p.stream) });
        }
    }
    let nrounds = plans.iter().map(|p| p.rounds.len()).max().unwrap_or(0);
    for round in 0..nrounds {
        for (p, _) in plans.iter().zip(&usable).filter(|(_, u)| **u) {
            if let Some(works) = p.rounds.get(round) {
                note(p.target.launch(works, &p.stream));
            }
        }
    }
    first.and(match mismatches.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_launch_runs_each_connections_works_on_one_block_in_issue_order() {
        use oxccl_gpu::abi::{P2P_RECV as R, P2P_SEND as S};
        const AFTER: u8 = P2P_AFTER_PREVIOUS;
        let w = |channel: u32, kind: u8, buff: u64| WorkP2p {
            buff,
            bytes: 8,
            channel,
            kind,
            part: 0,
            nparts: 1,
            proto: 0,
        };
        // Channel 3's send and receive sides are two connections; channel 4's send a third.
        let works = vec![w(3, S, 1), w(3, R, 2), w(4, S, 3), w(3, S, 4), w(3, R, 5), w(3, S, 6)];
        let got: Vec<(u64, u8)> = one_launch(works).iter().map(|w| (w.buff, w.kind)).collect();
        assert_eq!(got, vec![(1, S), (4, S | AFTER), (6, S | AFTER), (2, R), (5, R | AFTER), (3, S)]);
    }

    #[test]
    fn group_end_without_start_is_invalid_usage() {
        let e = group_end().unwrap_err();
        assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
        assert!(e.to_string().contains("without a group_start"), "{e}");
    }

    #[test]
    fn groups_nest_and_the_closure_form_closes_them() {
        assert_eq!(group_depth(), 0);
        group_start().unwrap();
        group_start().unwrap();
        assert_eq!(group_depth(), 2);
        group_end().unwrap();
        assert_eq!(group_depth(), 1);
        group_end().unwrap();
        assert_eq!(group_depth(), 0);
        let v = group(|| group_depth()).unwrap();
        assert_eq!(v, 1);
        assert_eq!(group_depth(), 0);
    }
}
