//! Point-to-point calls (NCCL's `ncclSend`/`ncclRecv` in `collectives.cc`, their scheduling in
//! `enqueue.cc`'s `scheduleP2pTasksToPlan`): argument checks, the works of one launch over the
//! peer channels ([`PeerChannels`]), and the launch itself (GPU kernel or CPU-target blocks).
//! Calls are queued in the calling thread's group ([`crate::group`]) and launched when its
//! outermost group ends (at once outside a group).
use super::*;
use crate::group::{self, P2pOp, Queued};
use oxccl_gpu::abi::{
    MAX_P2P_WORKS, P2P_AFTER_PREVIOUS, P2P_KERNEL_NAME, P2P_RECV, P2P_SEND, P2pArgs, P2pStatus, WorkP2p,
};

/// Where this rank's receives report a size mismatch: host memory its kernels write (mapped
/// into the device on GPUs), one [`P2pStatus`] record per work of a launch.
pub(super) enum StatusMem {
    Cuda(cuda::HostMapped),
    Cpu(HostMem),
}

impl StatusMem {
    pub(super) fn new(ctx: Option<&Arc<cuda::Context>>) -> Result<StatusMem> {
        let bytes = size_of::<P2pStatus>() * MAX_P2P_WORKS;
        Ok(match ctx {
            Some(ctx) => StatusMem::Cuda(cuda::HostMapped::zeroed(ctx, bytes)?),
            None => StatusMem::Cpu(HostMem::zeroed(bytes)?),
        })
    }
    /// The address the kernels write (their records' start).
    fn kernel_addr(&self) -> u64 {
        match self {
            StatusMem::Cuda(m) => m.dev_ptr(),
            StatusMem::Cpu(m) => m.addr(),
        }
    }
    fn host(&self) -> *mut P2pStatus {
        match self {
            StatusMem::Cuda(m) => m.host_ptr() as *mut P2pStatus,
            StatusMem::Cpu(m) => m.addr() as *mut P2pStatus,
        }
    }
    /// A mismatch a receive reported since the last call (the first record flagged), every
    /// flagged record cleared.
    pub(super) fn take(&self) -> Option<P2pStatus> {
        let mut first = None;
        for i in 0..MAX_P2P_WORKS {
            // SAFETY: the records live as long as `self`; kernels write each with volatile
            // stores, its flag last (after a fence), and a record only from its own work's block.
            unsafe {
                let p = self.host().add(i);
                let flag = AtomicU64::from_ptr(&raw mut (*p).flag);
                if flag.load(Ordering::Acquire) == 0 {
                    continue;
                }
                let st = std::ptr::read_volatile(p);
                flag.store(0, Ordering::Release);
                first.get_or_insert(st);
            }
        }
        first
    }
}

/// What a queued send or receive needs of its communicator when its group ends: the launch
/// resources, shared (`Arc`) so the call does not borrow the communicator.
#[derive(Clone)]
pub(crate) struct P2pTarget {
    rank: usize,
    dev_comm: u64,
    peer: PeerChannels,
    nthreads: u32,
    cpu_nthreads: u32,
    cpu_team: oxccl_gpu::arch::TeamKind,
    /// Largest send whose data goes over LL (`NCCL_P2P_LL_THRESHOLD`).
    ll_threshold: u64,
    status: Arc<StatusMem>,
    watch: Arc<timeout::Watch>,
    /// The communicator's count of kernels queued.
    launches: Arc<AtomicU64>,
    backend: Backend,
}

#[derive(Clone)]
enum Backend {
    Cuda {
        launch: Arc<LaunchState>,
        module: Arc<cuda::Module>,
        /// Keeps the rank's memory (its kernels' connections) until the launch is queued.
        _group: Arc<CudaGroup>,
    },
    Cpu {
        group: Arc<CpuGroup>,
        process: Option<Arc<ProcessGroup>>,
        inflight: Arc<AtomicUsize>,
    },
}

impl P2pTarget {
    /// The communicator this target launches for (its communicator block's address).
    pub(crate) fn key(&self) -> u64 {
        self.dev_comm
    }
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The blocks a send or receive of `op` takes: one per peer channel of the pair; a send's
    /// data on LL up to the threshold, on Simple above (its header tells the receiver).
    pub(crate) fn works_of(&self, op: &P2pOp) -> Vec<WorkP2p> {
        let nparts = self.peer.per_peer.max(1);
        let proto = if op.send && op.bytes <= self.ll_threshold {
            Proto::Ll
        } else {
            Proto::Simple
        };
        let proto = if op.send { proto as u8 } else { 0 };
        (0..nparts)
            .map(|j| WorkP2p {
                buff: op.buff,
                bytes: op.bytes,
                channel: self.peer.channel(self.rank, op.peer, j, op.send),
                kind: if op.send { P2P_SEND } else { P2P_RECV },
                part: j as u8,
                nparts: nparts as u8,
                proto,
            })
            .collect()
    }

    /// What a launch of `works` does, for a timeout's message: "sends/receives (send of B
    /// bytes to rank p, …)".
    fn describe(&self, works: &[WorkP2p]) -> String {
        let ops: Vec<String> = works
            .iter()
            .filter(|w| w.part == 0)
            .map(|w| {
                let (to, from) = self.peer.neighbours(w.channel, self.rank);
                if w.kind & !P2P_AFTER_PREVIOUS == P2P_SEND {
                    format!("send of {} bytes to rank {to}", w.bytes)
                } else {
                    format!("receive of {} bytes from rank {from}", w.bytes)
                }
            })
            .collect();
        format!("sends/receives ({})", ops.join(", "))
    }

    /// Queues a copy of `bytes` bytes from `src` to `dst` (a send to this rank matched with its
    /// receive) on `stream`, in the rank's launch order ([`ordered_copy`]).
    ///
    /// # Safety
    /// As [`ordered_copy`].
    pub(crate) unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
        let order = match &self.backend {
            Backend::Cuda { launch, .. } => LaunchOrder::Cuda(launch),
            Backend::Cpu { group, process, inflight } => LaunchOrder::Cpu(self.cpu_blocks(1, group, process), inflight),
        };
        // SAFETY: forwarded caller contract.
        unsafe { ordered_copy(order, dst, src, bytes, stream) }
    }

    /// A CPU-target launch of `nblocks` blocks of this rank (nothing watched yet: the caller adds
    /// the launch's number to `recorded`).
    fn cpu_blocks(&self, nblocks: u32, group: &Arc<CpuGroup>, process: &Option<Arc<ProcessGroup>>) -> CpuBlocks {
        CpuBlocks {
            nblocks,
            nthreads: self.cpu_nthreads,
            team: self.cpu_team,
            group: group.clone(),
            process: process.clone(),
            rank: self.rank,
            watch: self.watch.clone(),
            recorded: Vec::new(),
        }
    }

    /// Launches `works` (at most [`MAX_P2P_WORKS`]; a block per work, but a work flagged
    /// [`P2P_AFTER_PREVIOUS`] runs on the previous one's block, after it) as one kernel on
    /// `stream`.
    pub(crate) fn launch(&self, works: &[WorkP2p], stream: &Stream) -> Result<()> {
        if works.is_empty() {
            return Ok(());
        }
        if works.len() > MAX_P2P_WORKS || works[0].kind & P2P_AFTER_PREVIOUS != 0 {
            return Err(Error::Internal(format!(
                "{} point-to-point works in one launch, the first {}",
                works.len(),
                if works[0].kind & P2P_AFTER_PREVIOUS != 0 { "after a previous one" } else { "starting a block" }
            )));
        }
        let nblocks = works.iter().filter(|w| w.kind & P2P_AFTER_PREVIOUS == 0).count() as u32;
        let mut args = P2pArgs {
            comm: self.dev_comm,
            status: self.status.kernel_addr(),
            nworks: works.len() as u32,
            ..P2pArgs::default()
        };
        args.works[..works.len()].copy_from_slice(works);
        // Captured into a graph, the launch runs at the graph's launches: nothing to watch now,
        // and no launch event (one recorded in a capture cannot be queried).
        let captured = stream.is_capturing()?;
        let watched = (!captured).then(|| self.watch.begin_p2p(|| self.describe(works)));
        self.launches.fetch_add(1, Ordering::AcqRel);
        self.watch.queued(watched.as_slice(), self.queue(nblocks, args, stream, captured, watched))
    }

    /// Queues the launch of `nblocks` blocks with `args` on `stream` (`captured`: the stream is
    /// capturing), watched as `watched` ([`timeout::Watch::begin_p2p`]).
    fn queue(&self, nblocks: u32, args: P2pArgs, stream: &Stream, captured: bool, watched: Option<u64>) -> Result<()> {
        match (&self.backend, stream) {
            (Backend::Cuda { launch, module, .. }, Stream::Cuda(s)) => {
                if !captured {
                    launch.order(s)?;
                }
                s.launch(module, nblocks, self.nthreads, &args)?;
                if let Some(id) = watched {
                    let n = launch.record(s)?;
                    self.watch.launched(id, n);
                }
                Ok(())
            }
            (Backend::Cpu { group, process, inflight }, Stream::Cpu(s)) => {
                let nthreads = self.cpu_nthreads;
                let mut blocks = self.cpu_blocks(nblocks, group, process);
                blocks.recorded.extend(watched);
                let (status, rank, peer) = (self.status.clone(), self.rank, self.peer);
                blocks.launch(
                    s,
                    inflight,
                    move |b, tid, smem| {
                        // SAFETY: the communicator block and its channels live as long as the
                        // launch's `group`; every work's buffer is the caller's, valid for its
                        // bytes (send_raw/recv_raw contract).
                        unsafe { oxccl_gpu::coll::send_recv::run_p2p_block(&args, b, tid, nthreads, smem) };
                        true
                    },
                    move || take_mismatch(&status, rank, &peer).map_or(Ok(()), Err),
                )
            }
            _ => Err(Error::invalid("stream and communicator are of different backends")),
        }
    }
}

/// The error of a mismatch a receive of rank `rank` (peer channels `peer`) reported in `status`,
/// if any (cleared).
fn take_mismatch(status: &StatusMem, rank: usize, peer: &PeerChannels) -> Option<Error> {
    status.take().map(|st| mismatch_error(rank, peer.recv_peer(rank, st.channel), &st))
}

/// The error of a receive from `peer` that got another size than it expected.
fn mismatch_error(rank: usize, peer: usize, st: &P2pStatus) -> Error {
    Error::invalid(format!(
        "rank {rank}: a receive from rank {peer} expected {} bytes but rank {peer} sent {} bytes \
         ({} written; the counts × type sizes of a send and its receive must match)",
        st.expected,
        st.sent,
        st.sent.min(st.expected)
    ))
}

impl Comm {
    /// Sends `count` elements of `dtype` from `send` to rank `peer` (NCCL's `ncclSend`). The
    /// matching [`Comm::recv`] on `peer` names this rank; sends and receives between two ranks
    /// in one direction match in the order they are issued. Queued on `stream`; inside a group
    /// ([`crate::group_start`]) launched when the outermost group ends, with the group's other
    /// calls (which is what keeps exchanges such as all-to-all from deadlocking), otherwise at
    /// once. `peer == rank` sends to this rank's own matching receive (a copy). `count == 0` is
    /// allowed (the receive must expect 0). Errors: `peer` outside `0..nranks`, a buffer shorter
    /// than `count` elements or on another device, and the errors of [`Comm::all_reduce`]'s
    /// checks of stream and communicator state.
    pub fn send<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let s = send.into();
        self.check_p2p_buffer("sendbuff", &s, count, dtype)?;
        // SAFETY: the range was checked against the buffer.
        unsafe { self.send_raw(s.addr(), count, dtype, peer, stream) }
    }

    /// Receives `count` elements of `dtype` from rank `peer` into `recv` (NCCL's `ncclRecv`);
    /// see [`Comm::send`]. A send of another size than `count` elements is an error at the
    /// stream's synchronize (CPU target) or from [`Comm::get_async_error`] (GPUs), naming both
    /// sizes; at most `count` elements are written.
    pub fn recv<'a>(
        &self,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let r = recv.into();
        self.check_p2p_buffer("recvbuff", &r, count, dtype)?;
        // SAFETY: the range was checked against the buffer.
        unsafe { self.recv_raw(r.addr(), count, dtype, peer, stream) }
    }

    /// [`Comm::send`] on a raw address (a `CUdeviceptr`, or a host address on the CPU target).
    ///
    /// # Safety
    /// `buff` is valid for `count × dtype.size()` bytes on this rank's device until the
    /// operation completes on `stream`; `stream` outlives the end of the current group.
    pub unsafe fn send_raw(&self, buff: u64, count: usize, dtype: DataType, peer: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded caller contract.
        group::noted(unsafe { self.p2p(true, buff, count, dtype, peer, stream) })
    }

    /// [`Comm::recv`] on a raw address.
    ///
    /// # Safety
    /// As [`Comm::send_raw`].
    pub unsafe fn recv_raw(&self, buff: u64, count: usize, dtype: DataType, peer: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded caller contract.
        group::noted(unsafe { self.p2p(false, buff, count, dtype, peer, stream) })
    }

    /// That `s` is on this rank's device and holds `count` elements of `dtype` (`name` names it
    /// in the error, which an open group notes as refused: [`group::noted`]).
    fn check_p2p_buffer(&self, name: &str, s: &DevSlice<'_>, count: usize, dtype: DataType) -> Result<()> {
        group::noted(self.p2p_buffer_fits(name, s, count, dtype))
    }

    fn p2p_buffer_fits(&self, name: &str, s: &DevSlice<'_>, count: usize, dtype: DataType) -> Result<()> {
        let bytes = self.check_bytes(count, dtype)?;
        if s.device() != self.device {
            return Err(Error::invalid(format!(
                "{name} is on {:?} but rank {} is on {:?}",
                s.device(),
                self.rank,
                self.device
            )));
        }
        if (s.len() as u64) < bytes {
            return Err(Error::invalid(format!(
                "{name} holds {} bytes but count {count} × {} ({} bytes each) needs {bytes} on rank {}",
                s.len(),
                dtype.name(),
                dtype.size(),
                self.rank
            )));
        }
        Ok(())
    }

    /// # Safety
    /// As [`Comm::send_raw`].
    unsafe fn p2p(&self, send: bool, buff: u64, count: usize, dtype: DataType, peer: usize, stream: &Stream) -> Result<()> {
        let call = if send { "send" } else { "recv" };
        if peer >= self.nranks {
            return Err(Error::invalid(format!(
                "peer {peer} of {call} is out of range on rank {} (accepted: 0..={})",
                self.rank,
                self.nranks - 1
            )));
        }
        let bytes = self.check_bytes(count, dtype)?;
        if buff == 0 && bytes > 0 {
            return Err(Error::invalid(format!(
                "{} is NULL on rank {} ({call} of {count} elements needs it)",
                if send { "sendbuff" } else { "recvbuff" },
                self.rank
            )));
        }
        self.check_stream(stream)?;
        self.check_not_revoked(if send { "send" } else { "recv" })?;
        self.check_launchable()?;
        tracing::debug!(target: "oxccl::coll", rank = self.rank, call, peer, count, %dtype, "enqueue");
        let recorded = flight_recorder::P2pCall {
            send,
            peer,
            count,
            dtype,
            bytes,
        };
        let target = self.p2p_target()?;
        self.watch.record_p2p(&recorded, group::current_group());
        group::enqueue(Queued {
            target,
            stream: stream.handle(),
            op: P2pOp { send, peer, buff, bytes },
            comm: self.handle(),
        })
    }

    /// The error of a size mismatch one of this rank's receives reported since the last check
    /// (cleared).
    pub(super) fn p2p_mismatch(&self) -> Option<Error> {
        let st = self.p2p_status.take()?;
        let peer = PeerChannels::recv_peer(&self.peer_channels, self.rank, st.channel);
        Some(mismatch_error(self.rank, peer, &st))
    }

    /// This communicator's launch resources for point-to-point work.
    /// That this rank may still launch work: not aborted (here or by a peer), no call found
    /// diverging, not finalized; the error as [`Comm::get_async_error`] reports it otherwise.
    pub(crate) fn check_launchable(&self) -> Result<()> {
        if let Some(e) = self.stopped_error() {
            return Err(e);
        }
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was finalized; only destroy is allowed after finalize",
                self.rank
            )));
        }
        Ok(())
    }

    fn p2p_target(&self) -> Result<P2pTarget> {
        let backend = match &self.res {
            Res::Cuda(r) => Backend::Cuda {
                launch: r.launch.clone(),
                module: self
                    .p2p_module
                    .clone()
                    .ok_or_else(|| crate::kernels::not_built(P2P_KERNEL_NAME))?,
                _group: r.group.clone(),
            },
            Res::Cpu(r) => Backend::Cpu {
                group: r.group.clone(),
                process: self.process.clone(),
                inflight: self.inflight.clone(),
            },
        };
        Ok(P2pTarget {
            rank: self.rank,
            dev_comm: self.dev_comm,
            peer: self.peer_channels,
            nthreads: self.params.nthreads,
            cpu_nthreads: self.params.cpu_nthreads,
            cpu_team: self.params.cpu_team,
            ll_threshold: self.params.p2p_ll_threshold,
            status: self.p2p_status.clone(),
            watch: self.watch.clone(),
            launches: self.launches.clone(),
            backend,
        })
    }
}

/// The calls NCCL 2.28 builds from grouped sends and receives (`ncclAlltoAll`, `ncclGather`,
/// `ncclScatter`), and the variable-size forms NCCL leaves to its users (`reduce_scatter_v` from
/// rooted Reduces).
impl Comm {
    /// Every rank sends block `p` of `send` (`count` elements of `dtype`, at element `p × count`)
    /// to rank `p`, and receives rank `p`'s block into block `p` of `recv` (NCCL's
    /// `ncclAlltoAll`). Both buffers hold `nranks × count` elements and must not overlap (no
    /// in-place form, as in NCCL). Launched as one group (inside the caller's group, if any).
    pub fn all_to_all<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        stream: &Stream,
    ) -> Result<()> {
        let n = self.nranks;
        let counts = vec![count; n];
        let displs: Vec<usize> = (0..n).map(|p| p * count).collect();
        self.all_to_all_v(send, &counts, &displs, recv, &counts, &displs, dtype, stream)
    }

    /// All-to-all with per-peer sizes (beyond NCCL; MPI's `Alltoallv`): this rank sends
    /// `send_counts[p]` elements from element `send_displs[p]` of `send` to rank `p`, and
    /// receives `recv_counts[p]` elements from rank `p` at element `recv_displs[p]` of `recv`.
    /// Every slice lies in its buffer; each rank's `recv_counts[p]` equals rank `p`'s
    /// `send_counts[this rank]` (else the receive reports a size mismatch). The received slices
    /// must not overlap the sent ones.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all_v<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        send_counts: &[usize],
        send_displs: &[usize],
        recv: impl Into<DevSlice<'a>>,
        recv_counts: &[usize],
        recv_displs: &[usize],
        dtype: DataType,
        stream: &Stream,
    ) -> Result<()> {
        let (s, r) = (send.into(), recv.into());
        let sends = self.slices("sendbuff", &s, send_counts, send_displs, dtype)?;
        let recvs = self.slices("recvbuff", &r, recv_counts, recv_displs, dtype)?;
        for &(ra, rb) in &recvs {
            if rb > 0 && sends.iter().any(|&(sa, sb)| sb > 0 && sa < ra + rb && ra < sa + sb) {
                return Err(Error::invalid(format!(
                    "rank {}: a received slice of all_to_all overlaps a sent one (sendbuff and recvbuff must be disjoint)",
                    self.rank
                )));
            }
        }
        self.grouped(|| {
            for p in 0..self.nranks {
                // SAFETY: every slice was checked against its buffer.
                unsafe {
                    self.send_raw(sends[p].0, send_counts[p], dtype, p, stream)?;
                    self.recv_raw(recvs[p].0, recv_counts[p], dtype, p, stream)?;
                }
            }
            Ok(())
        })
    }

    /// Every rank sends `count` elements of `send` to rank `root`, which receives rank `p`'s into
    /// elements `p × count ..` of `recv` (NCCL's `ncclGather`; `recv` is read on the root only,
    /// others may pass `None`). In place on the root: `send` is `recv`'s block `root`.
    pub fn gather<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: Option<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.check_root_of("gather", root)?;
        let s = send.into();
        self.check_p2p_buffer("sendbuff", &s, count, dtype)?;
        let recvs = self.rooted("recvbuff", recv, count, dtype, root)?;
        self.grouped(|| {
            // SAFETY: the slices were checked against their buffers.
            unsafe {
                self.send_raw(s.addr(), count, dtype, root, stream)?;
                for (p, &a) in recvs.iter().enumerate() {
                    self.recv_raw(a, count, dtype, p, stream)?;
                }
            }
            Ok(())
        })
    }

    /// Rank `root` sends elements `p × count ..` of `send` to rank `p`; every rank receives
    /// `count` elements into `recv` (NCCL's `ncclScatter`; `send` is read on the root only). In
    /// place on the root: `recv` is `send`'s block `root`.
    pub fn scatter<'a>(
        &self,
        send: Option<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.check_root_of("scatter", root)?;
        let r = recv.into();
        self.check_p2p_buffer("recvbuff", &r, count, dtype)?;
        let sends = self.rooted("sendbuff", send, count, dtype, root)?;
        self.grouped(|| {
            // SAFETY: the slices were checked against their buffers.
            unsafe {
                for (p, &a) in sends.iter().enumerate() {
                    self.send_raw(a, count, dtype, p, stream)?;
                }
                self.recv_raw(r.addr(), count, dtype, root, stream)?;
            }
            Ok(())
        })
    }

    /// AllGather with per-rank sizes (beyond NCCL; MPI's `Allgatherv`): this rank's
    /// `counts[rank]` elements of `send` go to every rank, which stores rank `p`'s at element
    /// `displs[p]` of `recv`. In place: `send` is `recv`'s slice of this rank.
    pub fn all_gather_v<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        counts: &[usize],
        displs: &[usize],
        dtype: DataType,
        stream: &Stream,
    ) -> Result<()> {
        let (s, r) = (send.into(), recv.into());
        let recvs = self.slices("recvbuff", &r, counts, displs, dtype)?;
        let mine = counts[self.rank];
        self.check_p2p_buffer("sendbuff", &s, mine, dtype)?;
        self.grouped(|| {
            for p in 0..self.nranks {
                // SAFETY: the slices were checked against their buffers.
                unsafe {
                    self.send_raw(s.addr(), mine, dtype, p, stream)?;
                    self.recv_raw(recvs[p].0, counts[p], dtype, p, stream)?;
                }
            }
            Ok(())
        })
    }

    /// ReduceScatter with per-rank sizes (beyond NCCL; MPI's `Reduce_scatter`): the elements
    /// `displs[p] .. displs[p] + counts[p]` of every rank's `send` are reduced (`op`) into rank
    /// `p`'s `recv` (which holds at least `counts[p]` elements). Every rank passes the same
    /// `counts` and `displs`. Runs as one Reduce per rank, rooted at it, so it moves each slice
    /// once around the ring (NCCL's ring ReduceScatter moves `(n − 1) / n` of the data per rank;
    /// this moves all of it). `recv` must not overlap the slices of `send` other ranks reduce.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter_v<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        counts: &[usize],
        displs: &[usize],
        dtype: DataType,
        op: impl Into<crate::redop::ReduceOp<'a>>,
        stream: &Stream,
    ) -> Result<()> {
        let (s, r) = (send.into(), recv.into());
        let op = op.into();
        let sends = self.slices("sendbuff", &s, counts, displs, dtype)?;
        self.check_p2p_buffer("recvbuff", &r, counts[self.rank], dtype)?;
        for (p, &(addr, bytes)) in sends.iter().enumerate() {
            let out = (p == self.rank).then(|| r.addr());
            if let Some(o) = out
                && bytes > 0
                && o != addr
                && o < addr + bytes
                && addr < o + bytes
            {
                return Err(Error::invalid(format!(
                    "rank {}: recvbuff of reduce_scatter_v partly overlaps its own slice of sendbuff (in place means recvbuff == sendbuff + displs[rank] elements)",
                    self.rank
                )));
            }
            // SAFETY: the slice was checked against `send`, the output against `recv`.
            unsafe {
                self.collective_raw(Func::Reduce, addr, out.unwrap_or(0), counts[p], dtype, op, p, stream)?;
            }
        }
        Ok(())
    }

    /// Runs `f`'s calls as one group (nested in the caller's group, if any); the first error of
    /// `f` or of the group's end.
    fn grouped(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        group::group_start()?;
        let r = f();
        let end = group::group_end();
        r.and(end)
    }

    fn check_root_of(&self, call: &str, root: usize) -> Result<()> {
        if root >= self.nranks {
            return Err(Error::invalid(format!(
                "root {root} is out of range for {call} (accepted: 0..={})",
                self.nranks - 1
            )));
        }
        Ok(())
    }

    /// The addresses and byte sizes of the slices `counts[p]` elements from element `displs[p]`
    /// of `buf`, one per rank, each checked to lie in `buf`.
    pub(super) fn slices(&self, name: &str, buf: &DevSlice<'_>, counts: &[usize], displs: &[usize], dtype: DataType) -> Result<Vec<(u64, u64)>> {
        let n = self.nranks;
        if counts.len() != n || displs.len() != n {
            return Err(Error::invalid(format!(
                "the counts and displacements of {name} hold {} and {} entries; {n} (one per rank) are needed",
                counts.len(),
                displs.len()
            )));
        }
        if buf.device() != self.device {
            return Err(Error::invalid(format!("{name} is on {:?} but rank {} is on {:?}", buf.device(), self.rank, self.device)));
        }
        let esize = dtype.size() as u64;
        (0..n)
            .map(|p| {
                let bytes = self.check_bytes(counts[p], dtype)?;
                let start = (displs[p] as u64).checked_mul(esize);
                match start.and_then(|s| s.checked_add(bytes)) {
                    Some(end) if end <= buf.len() as u64 => Ok((buf.addr() + displs[p] as u64 * esize, bytes)),
                    _ => Err(Error::invalid(format!(
                        "{name} holds {} bytes but rank {p}'s slice ({} elements at element {}, {} bytes each) ends past it on rank {}",
                        buf.len(),
                        counts[p],
                        displs[p],
                        esize,
                        self.rank
                    ))),
                }
            })
            .collect()
    }

    /// The root's `nranks` blocks of `count` elements of `buf` (required there, ignored
    /// elsewhere: empty).
    fn rooted(&self, name: &str, buf: Option<DevSlice<'_>>, count: usize, dtype: DataType, root: usize) -> Result<Vec<u64>> {
        if self.rank != root {
            return Ok(Vec::new());
        }
        let Some(b) = buf else {
            return Err(Error::invalid(format!("{name} is missing on the root, rank {root}")));
        };
        let counts = vec![count; self.nranks];
        let displs: Vec<usize> = (0..self.nranks).map(|p| p * count).collect();
        Ok(self.slices(name, &b, &counts, &displs, dtype)?.into_iter().map(|(a, _)| a).collect())
    }
}
