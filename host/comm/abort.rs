//! Abort, asynchronous errors and teardown (NCCL's `ncclCommAbort`, `ncclCommFinalize`,
//! `ncclCommDestroy`, `ncclCommGetAsyncError`): the abort flag every kernel spin loop polls, the
//! shared abort page of an `init_rank` host ([`SharedAbort`]), the waits of abort, finalize and
//! destroy, and the collective part of an `init_rank` teardown ([`InitRankRes::sync_teardown`]).
//!
//! Teardown order: a rank's queued operations finish (or are aborted), then it closes its
//! mappings of its neighbours' memory, then the ranks meet at a bootstrap barrier, then its NET
//! connections close, then its memory is freed (field order of [`InitRankRes`] and the groups).
use super::*;

/// Abort-flag values: this rank called abort, or another rank of its process group did (the value
/// the proxy and the liveness watch raise too).
pub(super) const ABORTED_HERE: u32 = 1;
pub(super) use crate::proxy::ABORTED_BY_PEER;
use crate::proxy::ABORT_LINE_WHO;
/// Abort-flag value of a revoked rank ([`Comm::revoke`]): its kernels exit as on an abort.
pub(super) const REVOKING: u32 = 4;
/// How long [`Comm::abort`] waits for in-flight operations to exit.
pub(super) const ABORT_WAIT: Duration = Duration::from_secs(5);
/// How long [`Comm::abort`] waits for the other ranks of its process group when they may write
/// into its buffers directly: a running kernel stops within microseconds of its flag; only one
/// queued behind other work takes longer, and that one checks the flag before writing.
pub(super) const PEER_ABORT_WAIT: Duration = Duration::from_secs(1);
/// How long [`Comm::abort`] on the CPU target waits for a peer's kernel that is running (its
/// flag raised, so it ends at its next wait, after its current copy).
pub(super) const PEER_RUNNING_WAIT: Duration = Duration::from_secs(10);
/// How long dropping a communicator waits for its last operation before it raises the abort flag.
pub(super) const DROP_WAIT: Duration = Duration::from_secs(10);

/// Bytes of one rank's line in the shared abort page: the flag its kernels poll (u32 at +0), the
/// stop word its own kernels raise when the call check finds the ranks' calls different (u32 at
/// +4, `oxccl_gpu::abi::ABORT_LINE_STOP`; polled with the flag in one 8-byte load, never read or
/// written by the host), and which rank raised the flag, plus one (u32 at
/// [`crate::proxy::ABORT_LINE_WHO`]). After every rank's line, each rank has a second
/// line holding how many calls it has issued (u64 at +0, for the timeout's message:
/// `comm/timeout.rs`), apart from the flag its GPU kernels read all the time.
pub(super) const ABORT_LINE_BYTES: usize = 64;

/// Bytes of the shared abort page of `nranks` ranks: the flag lines, then the issued-call lines.
pub(super) fn abort_page_bytes(nranks: usize) -> usize {
    2 * nranks * ABORT_LINE_BYTES
}

impl Comm {
    /// Aborts this rank (NCCL's `ncclCommAbort`): raises the abort flag that every kernel spin
    /// loop polls, so operations still waiting for a peer exit and their streams drain, then waits
    /// up to 5 s for this rank's queued operations to finish. The communicator is unusable
    /// afterwards: later calls return `InvalidUsage`. Safe to call from any thread, more than once.
    /// Results of the interrupted operations are undefined.
    pub fn abort(&self) -> Result<()> {
        self.state.abort()
    }

    /// Revokes this rank (NCCL 2.28's `ncclCommRevoke`): stops its in-flight operations as
    /// [`Comm::abort`] does (their outputs are undefined; the other ranks are not told, each
    /// revokes its own), waits until none is left (up to 5 s), then keeps the communicator for
    /// management only: [`split`](Comm::split), [`shrink`](Comm::shrink) and
    /// [`destroy`](Comm::destroy) work — also when another rank failed or aborted, which is what
    /// revoke is for — while collectives, sends, receives and [`finalize`](Comm::finalize)
    /// return `InvalidUsage`, and [`get_async_error`](Comm::get_async_error) is `Ok`. The way to
    /// recover from a failed peer or a timed-out call without tearing down: revoke on every
    /// surviving rank, then shrink or split. With direct pointers ([`Comm::direct_pointer`]) a
    /// peer of this process that has not revoked yet may still finish a step it was granted
    /// into this rank's output: keep the interrupted calls' buffers until every rank of the
    /// process has revoked. Errors: `InvalidUsage` when already revoked, finalized or aborted
    /// by this rank; `Timeout` when operations still run 5 s after the stop (the communicator
    /// is aborted then).
    pub fn revoke(&self) -> Result<()> {
        let why = if self.revoked.load(Ordering::Acquire) {
            Some("was already revoked")
        } else if self.finalized.load(Ordering::Acquire) {
            Some("was finalized")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::InvalidUsage(format!("rank {}: cannot revoke: the communicator {why}", self.rank)));
        }
        let flag = self.abort_flag();
        // From any state but this rank's own abort: healthy, timed out, or raised by a peer.
        let mut state = flag.load(Ordering::Acquire);
        loop {
            if state == ABORTED_HERE {
                return Err(Error::InvalidUsage(format!(
                    "rank {}: cannot revoke: the communicator was aborted",
                    self.rank
                )));
            }
            match flag.compare_exchange(state, REVOKING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        tracing::warn!(target: "oxccl::init", rank = self.rank, "communicator revoked: stopping its operations");
        if !self.wait_idle(ABORT_WAIT)? {
            flag.store(ABORTED_HERE, Ordering::Release);
            return Err(Error::Timeout(format!(
                "rank {}: operations still running {ABORT_WAIT:?} after revoke; the communicator was aborted",
                self.rank
            )));
        }
        self.revoked.store(true, Ordering::Release);
        // Quiescent. The flag stays raised (a peer that raises it meanwhile changes nothing):
        // nothing of this communicator runs any more, and its management calls do not read it.
        Ok(())
    }

    /// `InvalidUsage` once the communicator was revoked ([`Comm::revoke`]), naming `what`.
    pub(super) fn check_not_revoked(&self, what: &str) -> Result<()> {
        if self.revoked.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was revoked: {what} is refused; split, shrink or destroy it",
                self.rank
            )));
        }
        Ok(())
    }

    /// Waits up to `limit` for this rank's queued operations (every call queued so far, on
    /// any stream) to finish; `Ok(false)` when some still run then. Errors: a CUDA error of the
    /// rank's last launch.
    pub fn wait_idle(&self, limit: Duration) -> Result<bool> {
        let start = Instant::now();
        while !self.idle()? {
            if start.elapsed() > limit {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(true)
    }

    /// Destroys this rank (NCCL's `ncclCommDestroy`): waits for its queued operations (up to 10 s,
    /// then aborts them), then — for [`Comm::init_rank`] communicators not finalized or aborted —
    /// closes its mappings of its neighbours' memory and waits at a bootstrap barrier for every
    /// rank (bounded by the bootstrap timeout), then frees its resources, returning the first error
    /// met on the way. Taking `self` makes a second destroy or a use after destroy a compile error
    /// (case C27; [`crate::handle::CommHandle`] detects them at run time for handle users).
    /// Inside a group that holds calls of this communicator, destroy returns at once and the
    /// communicator is torn down once the group's end has launched them (as on a drop).
    pub fn destroy(self) -> Result<()> {
        if self.has_other_handles() {
            tracing::debug!(target: "oxccl::init", rank = self.rank, "destroy: an open group holds calls of the communicator; it is torn down after the group's end");
            return Ok(());
        }
        if !self.wait_idle(DROP_WAIT)? {
            self.abort()?;
            return Err(Error::Timeout(format!(
                "rank {}: destroy waited {DROP_WAIT:?} for queued operations and aborted them",
                self.rank
            )));
        }
        self.init_rank_res().sync_teardown()
    }

    /// Finishes this rank's part of the communicator (NCCL's `ncclCommFinalize`): waits for its
    /// queued operations (up to 10 s: `Timeout` then, without aborting), then — for
    /// [`Comm::init_rank`] communicators — closes its mappings of its neighbours' memory and waits
    /// at a bootstrap barrier until every rank has finalized too (bounded by the bootstrap
    /// timeout). Afterwards collectives are refused with `InvalidUsage` and
    /// [`destroy`](Comm::destroy) is purely local. Calling it again returns `Ok` at once.
    /// `InvalidUsage` while an open group holds calls of this communicator (they run at the
    /// group's end, which must come first).
    pub fn finalize(&self) -> Result<()> {
        if self.finalized.load(Ordering::Acquire) {
            return Ok(());
        }
        self.check_not_revoked("finalize")?;
        if self.has_other_handles() {
            return Err(Error::InvalidUsage(format!(
                "rank {}: finalize while an open group holds calls of this communicator (they are launched at the group's end); end the group first",
                self.rank
            )));
        }
        if !self.wait_idle(DROP_WAIT)? {
            return Err(Error::Timeout(format!(
                "rank {}: finalize waited {DROP_WAIT:?} for queued operations; abort to stop them",
                self.rank
            )));
        }
        self.finalized.store(true, Ordering::Release);
        self.init_rank_res().sync_teardown()
    }

    /// The error this communicator has met outside any call (NCCL's `ncclCommGetAsyncError`):
    /// `Ok(())` while healthy; `Remote` once another rank aborted (naming it when known) or, for
    /// [`Comm::init_rank`], once a peer process of this host has exited before teardown
    /// ([`Comm::finalize`]); `Timeout` once a call made no progress for `OXCCL_TIMEOUT`
    /// (naming the call and the ranks it waits for; the rank's kernels have exited, abort or
    /// destroy the communicator); `InvalidUsage` after this rank's own abort; `Cuda` when a kernel of
    /// this rank failed. Cheap enough to poll while waiting for a stream. After an error,
    /// [`abort`](Comm::abort) the communicator.
    pub fn get_async_error(&self) -> Result<()> {
        if self.revoked.load(Ordering::Acquire) {
            // Quiescent and kept for split, shrink and destroy (`revoke`).
            return Ok(());
        }
        if let Some(e) = self.p2p_mismatch() {
            return Err(e);
        }
        if let Some(e) = self.call_mismatch() {
            return Err(e);
        }
        match self.flag_state() {
            0 => {}
            timeout::TIMED_OUT => {
                return Err(Error::Timeout(self.watch.error().unwrap_or_else(|| {
                    format!("{}: a call made no progress for OXCCL_TIMEOUT", rank_of(self.rank, self.comm_id()))
                })));
            }
            ABORTED_BY_PEER => return Err(self.aborted_by_peer()),
            _ => {
                return Err(Error::InvalidUsage(format!(
                    "rank {}: the communicator was aborted",
                    self.rank
                )));
            }
        }
        if let Res::Cuda(res) = &self.res
            && res.launch.launched.load(Ordering::Acquire)
        {
            res.launch.last_complete()?;
        }
        let mp = self.init_rank_res();
        // After teardown (finalize) peers exit when they like.
        if mp.synced.load(Ordering::Acquire) {
            return Ok(());
        }
        mp.check_peers_alive()
    }

    /// The abort state: 0, [`ABORTED_HERE`] or [`ABORTED_BY_PEER`] (also when a peer raised this
    /// rank's shared line while its kernels poll a private flag).
    /// The error of a rank whose peer aborted (`Remote`, naming the peer when it is known).
    pub(super) fn aborted_by_peer(&self) -> Error {
        let who = match self.init_rank_res().abort.raised_by_peer() {
            Some(r) => format!("rank {r}"),
            None => "another rank".to_string(),
        };
        Error::Remote(format!(
            "{}: {who} of this communicator aborted; abort or destroy this rank too",
            rank_of(self.rank, self.comm_id())
        ))
    }

    /// The error of a communicator that may launch no more work, `None` while it runs: Remote
    /// (another rank aborted), Timeout (a call of this rank timed out) or InvalidUsage (this rank
    /// aborted, or the call check stopped it), as [`Comm::get_async_error`] reports it.
    pub(super) fn stopped_error(&self) -> Option<Error> {
        if self.flag_state() == 0 && self.call_mismatch().is_none() {
            return None;
        }
        Some(self.get_async_error().err().unwrap_or_else(|| {
            Error::InvalidUsage(format!("rank {}: the communicator was aborted", self.rank))
        }))
    }

    pub(super) fn flag_state(&self) -> u32 {
        let v = self.abort_flag().load(Ordering::Acquire);
        if v == 0 && self.init_rank_res().abort.raised_by_peer().is_some() {
            return ABORTED_BY_PEER;
        }
        v
    }

}

/// The abort flags of an `init_rank` communicator: one [`ABORT_LINE_BYTES`] line per rank in a
/// `/dev/shm` page every rank of a host maps, so any rank can raise the flags of its host's ranks
/// (the lines of other hosts' ranks stay unused there). On CUDA the
/// page is registered with the driver and each rank's kernels poll its line through the device
/// mapping; if registration fails, kernels poll a private host-mapped flag instead (then an abort
/// elsewhere reaches this rank's host calls only).
pub(super) struct SharedAbort {
    /// Dropped before `page`: unregistered before unmapped.
    pub(super) _reg: Option<cuda::HostRegistration>,
    pub(super) fallback: Option<cuda::HostMapped>,
    pub(super) page: crate::cpu::ShmSegment,
    pub(super) rank: usize,
    pub(super) nranks: usize,
    /// The address this rank's kernels poll.
    pub(super) dev_flag: u64,
}

impl SharedAbort {
    pub(super) fn new(
        page: crate::cpu::ShmSegment,
        rank: usize,
        nranks: usize,
        ctx: Option<&Arc<cuda::Context>>,
    ) -> Result<SharedAbort> {
        let line = (rank * ABORT_LINE_BYTES) as u64;
        let (reg, fallback, dev_flag) = match ctx {
            None => (None, None, page.addr() + line),
            // SAFETY: the page is a page-aligned mapping of nranks lines that `SharedAbort` keeps
            // until after the registration is dropped (field order).
            Some(ctx) => match unsafe {
                cuda::HostRegistration::new(ctx, page.addr() as *mut u8, nranks * ABORT_LINE_BYTES)
            } {
                Ok(r) => {
                    let d = r.dev_ptr() + line;
                    (Some(r), None, d)
                }
                Err(e) => {
                    tracing::warn!(target: "oxccl::init", rank, "registering the shared abort page failed ({e}); \
                        this rank's kernels poll a private flag, so other ranks' aborts reach its host calls only");
                    let f = cuda::HostMapped::zeroed(ctx, 64)?;
                    let d = f.dev_ptr;
                    (None, Some(f), d)
                }
            },
        };
        Ok(SharedAbort {
            _reg: reg,
            fallback,
            page,
            rank,
            nranks,
            dev_flag,
        })
    }

    /// Host address of rank `r`'s line.
    pub(super) fn line(&self, r: usize) -> u64 {
        self.page.addr() + (r * ABORT_LINE_BYTES) as u64
    }

    /// Host address of rank `r`'s issued-calls counter.
    pub(super) fn issued(&self, r: usize) -> u64 {
        self.page.addr() + ((self.nranks + r) * ABORT_LINE_BYTES) as u64
    }

    /// Host address of the flag this rank's kernels poll.
    pub(super) fn own_flag(&self) -> u64 {
        match &self.fallback {
            Some(f) => f.host_ptr() as u64,
            None => self.line(self.rank),
        }
    }

    /// Raised in this rank's line by another rank: `Some(that rank)`.
    pub(super) fn raised_by_peer(&self) -> Option<usize> {
        // SAFETY: the line lies in the mapped page, 4-byte aligned, accessed atomically.
        let (flag, who) = unsafe {
            (
                AtomicU32::from_ptr(self.line(self.rank) as *mut u32).load(Ordering::Acquire),
                AtomicU32::from_ptr((self.line(self.rank) + ABORT_LINE_WHO) as *mut u32).load(Ordering::Acquire),
            )
        };
        (flag == ABORTED_BY_PEER && who > 0).then(|| who as usize - 1)
    }

    /// Raises every other rank's flag, noting `self.rank` as the cause.
    pub(super) fn raise_peers(&self) {
        for r in (0..self.nranks).filter(|&r| r != self.rank) {
            // SAFETY: as in `raised_by_peer`.
            unsafe {
                let _ = AtomicU32::from_ptr((self.line(r) + ABORT_LINE_WHO) as *mut u32).compare_exchange(
                    0,
                    self.rank as u32 + 1,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                let _ = AtomicU32::from_ptr(self.line(r) as *mut u32).compare_exchange(
                    0,
                    ABORTED_BY_PEER,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
    }
}

impl InitRankRes {
    /// The collective part of teardown, done once: closes this rank's mappings of its
    /// neighbours' memory, then waits at a bootstrap barrier (bounded by the bootstrap timeout)
    /// so that no rank frees memory a peer may still write into or has mapped, then closes its
    /// NET connections. Those stay open across the barrier: a peer that destroys later than this
    /// rank (by more than the proxy's flush wait) would otherwise see its connections end and
    /// take this rank for dead. The barrier is skipped after an abort: the aborting rank raised
    /// every rank's flag, so no kernel keeps writing, and a peer may never arrive; and in a
    /// process group ([`ProcessGroup`]), whose memory lives until its last rank is dropped. The caller's
    /// own operations must be finished.
    pub(super) fn sync_teardown(&self) -> Result<()> {
        if self.synced.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // This rank's operations are done: peers may now exit at any time (after their own
        // teardown), which is no failure.
        drop(self.watched.lock().unwrap_or_else(|p| p.into_inner()).take());
        let (net, mapped): (Vec<PeerLink>, Vec<PeerLink>) =
            std::mem::take(&mut *self.links.lock().unwrap_or_else(|p| p.into_inner()))
                .into_iter()
                .partition(|l| matches!(l, PeerLink::Net { .. }));
        drop(mapped);
        // SAFETY: the flag lives in memory owned by `self.abort`.
        let aborted =
            unsafe { AtomicU32::from_ptr(self.abort.own_flag() as *mut u32) }.load(Ordering::Acquire) != 0;
        // The ranks of a process group keep each other's memory until the last of them is gone
        // (`ProcessGroup`): no barrier, so they can be dropped one by one from one thread.
        if aborted || self.abort.raised_by_peer().is_some() || self.bootstrap.is_in_process() {
            return Ok(());
        }
        let synced = self.bootstrap.barrier().map_err(|e| {
            tracing::warn!(target: "oxccl::init", rank = self.rank, "teardown barrier: {e}");
            e
        });
        drop(net);
        synced
    }

    /// `Remote` naming the first peer process of this host that has exited.
    pub(super) fn check_peers_alive(&self) -> Result<()> {
        let me = &self.peers[self.rank];
        for (r, p) in self.peers.iter().enumerate() {
            if p.host != me.host || p.pid == me.pid || p.start_time == 0 {
                continue;
            }
            if !crate::liveness::process_alive(p.pid, p.start_time) {
                return Err(Error::Remote(format!(
                    "rank {}: peer rank {r} (process {} on host {:?}) has exited; abort this communicator",
                    self.rank, p.pid, p.host
                )));
            }
        }
        Ok(())
    }
}

/// What the drop of a rank's state needs: its abort and the waits around it.
impl CommState {
    /// [`Comm::abort`], on the state every handle of the rank shares (its drop aborts too).
    pub(super) fn abort(&self) -> Result<()> {
        self.abort_flag().store(ABORTED_HERE, Ordering::Release);
        // The other ranks of this host would otherwise wait for us forever: their kernels exit
        // too, and their later calls report the remote abort (case C28, one rank aborting).
        self.init_rank_res().abort.raise_peers();
        tracing::warn!(target: "oxccl::init", rank = self.rank, "communicator aborted");
        let start = Instant::now();
        while !self.idle()? {
            if start.elapsed() > ABORT_WAIT {
                return Err(Error::Timeout(format!(
                    "rank {}: operations still running {ABORT_WAIT:?} after abort",
                    self.rank
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if self.direct {
            self.mark_group_aborted();
            self.wait_peers_after_abort(start);
        }
        Ok(())
    }

    /// True when this rank has no queued operation left.
    pub(super) fn idle(&self) -> Result<bool> {
        Ok(match &self.res {
            Res::Cuda(res) => res.launch.idle()?,
            Res::Cpu(_) => self.inflight.load(Ordering::Acquire) == 0,
        })
    }

    /// Sets `DevComm::aborted` in every comm block of this rank's process group (all their
    /// abort flags are raised already), so a kernel of any rank that starts from now on writes
    /// nothing into another rank's output: it reads that word before its first direct write.
    /// Returns once the words have landed (on GPUs through a stream of their own, while kernels
    /// run). Never fails: an error is logged (the kernel's spin loops still see the host flag).
    pub(super) fn mark_group_aborted(&self) {
        let at = std::mem::offset_of!(DevComm, aborted);
        let Some(process) = &self.process else { return };
        for (i, m) in process.members() {
            match m {
                Member::Cuda { group, .. } => {
                    if let Err(e) = group._comm_mem.write_beside(at, &1u32.to_ne_bytes()) {
                        tracing::warn!(target: "oxccl::init", rank = self.rank, peer = i, "abort: marking rank {i}'s comm block: {e}");
                    }
                }
                Member::Cpu { group, .. } => {
                    // SAFETY: the comm block lives as long as the group, which the process group
                    // `self` holds keeps alive; the word is 4-byte aligned (DevComm is 8-aligned)
                    // and kernels only load it.
                    unsafe { AtomicU32::from_ptr((group.comm_mem.addr() as usize + at) as *mut u32) }
                        .store(1, Ordering::Release);
                }
            }
        }
    }

    /// With direct writes ([`Comm::direct_pointer`]) a peer's kernel stores into this rank's
    /// output, which the caller may free once `abort` returns: wait (up to [`PEER_ABORT_WAIT`])
    /// until no kernel of the group's other ranks is queued or running. Their flags are raised,
    /// so a running kernel stops at its next wait; a kernel still queued behind other work when
    /// the time is up checks its flag before its first direct write and writes nothing there.
    /// On the CPU target a peer kernel that is running is waited for longer
    /// ([`PEER_RUNNING_WAIT`]): it ends after its current copy. Never fails: a peer that cannot
    /// be asked counts as idle (debug log).
    pub(super) fn wait_peers_after_abort(&self, start: Instant) {
        let me = self.rank;
        let Some(process) = &self.process else { return };
        let peers_idle = || -> bool {
            process.members().filter(|(i, _)| *i != me).all(|(i, m)| match m {
                Member::Cuda { launch, .. } => launch.idle().unwrap_or_else(|e| {
                    tracing::debug!(target: "oxccl::init", rank = me, peer = i, "abort: peer state unknown: {e}");
                    true
                }),
                Member::Cpu { inflight, .. } => inflight.load(Ordering::Acquire) == 0,
            })
        };
        // CPU target: a peer's kernel that is running (not only queued) ends at its next wait,
        // but its current copy may take far longer on host threads than on a GPU (a 128 MiB
        // slice): wait for it too, up to PEER_RUNNING_WAIT.
        let peers_running = || -> bool {
            process.members().filter(|(i, _)| *i != me).any(|(_, m)| match m {
                Member::Cuda { .. } => false,
                Member::Cpu { group, .. } => group.running.load(Ordering::Acquire) != 0,
            })
        };
        let t = Instant::now();
        while !peers_idle() {
            let waited = t.elapsed();
            if waited > PEER_ABORT_WAIT && !(peers_running() && waited < PEER_RUNNING_WAIT) {
                tracing::warn!(target: "oxccl::init", rank = me, waited_ms = waited.as_millis() as u64, "abort: other ranks of the group still have queued work; their kernels check the abort flag before writing into this rank's buffers");
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        tracing::debug!(target: "oxccl::init", rank = me, elapsed_us = start.elapsed().as_micros() as u64, "abort: group idle");
    }

    pub(super) fn abort_flag(&self) -> &AtomicU32 {
        let p = self.init_rank_res().abort.own_flag() as *const u32;
        // SAFETY: the flag lives in memory owned by `self.res`, 4-byte aligned, accessed atomically.
        unsafe { AtomicU32::from_ptr(p as *mut u32) }
    }

    /// The abort of a drop whose operations did not finish: this rank's flag (and, across
    /// processes, the peers' through the shared page). With direct writes the whole process
    /// group is aborted instead ([`Comm::abort`]): a peer's kernel may still be writing into this
    /// rank's buffers, which the caller frees once the drop returns.
    pub(super) fn abort_on_drop(&self) {
        if self.direct {
            if let Err(e) = self.abort() {
                tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: {e}");
            }
            return;
        }
        self.abort_flag().store(ABORTED_HERE, Ordering::Release);
        self.init_rank_res().abort.raise_peers();
    }
}
