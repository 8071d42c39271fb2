//! Plan and launch of one call (NCCL's `enqueue.cc`): the plan ([`Choice`]: algorithm, protocol,
//! channels, chunk and slice from the tuning model), the launch of the kernel on a CUDA stream or
//! of its blocks on the CPU target ([`launch_cpu`]), and the launch ordering across the ranks of
//! one process.
//!
//! Launch ordering:
//! A rank's kernel spins until its peers' kernels of the same call run, so the ranks of one
//! process must never queue work that waits for one of their kernels ahead of a peer's kernel
//! that this kernel needs. Two places can:
//!
//! - **A kernel module load** may wait for every kernel running in the context (CUDA's "lazy
//!   loading" caveat): before a rank loads one, every rank of its process group must have
//!   launched its earlier calls.
//! - **A GPU's hardware queues.** Streams share the GPU's hardware queues
//!   (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default; fresh streams often land on the queue of a
//!   live one). A rank's next kernel waits in its stream for its previous one to end, and on a
//!   shared hardware queue it then holds back everything queued after it, a peer's kernel
//!   included. So a rank sharing its GPU with other ranks of its group launches its call `n + 1`
//!   only once each of them has launched its call `n` ([`wait_launches`] before every launch).
//!   Ranks on separate GPUs have queues of their own and never wait here.
//!
//! The slowest rank never waits, so the group cannot wait on itself as long as every rank issues
//! its calls: from threads of their own, or from one thread that issues call `n` on every rank
//! before call `n + 1` on any (NCCL's rule for one thread driving several devices).
//!
//! The call-signature check (`call_check.rs`) runs inside the call's kernel, so a call stays one
//! kernel (a call of count 0 is the check kernel alone).
use super::*;
use std::sync::atomic::AtomicU64;

/// How long a rank waits for its peers before it says so in the log (it keeps waiting: the
/// peers' calls are the user's, and `abort` ends the wait).
const LAUNCH_WAIT_WARN: Duration = Duration::from_secs(10);

/// Waits until every peer's count of launched kernels (`peers`: rank and counter) is at least
/// `issued` (the kernels this rank launched before its next one), or until `abort` is raised
/// (an error naming the ranks behind). `why` ends the log and error messages ("before loading
/// kernel ..."). Returns at once when no peer is behind.
pub(super) fn wait_launches(
    peers: &[(usize, &AtomicU64)],
    issued: u64,
    abort: &AtomicU32,
    rank: usize,
    why: &dyn Fn() -> String,
) -> Result<()> {
    let behind = || -> Vec<usize> {
        peers
            .iter()
            .filter(|(_, l)| l.load(Ordering::Acquire) < issued)
            .map(|(r, _)| *r)
            .collect()
    };
    if behind().is_empty() {
        return Ok(());
    }
    let start = Instant::now();
    let mut warned = false;
    let mut spins = 0u32;
    loop {
        let late = behind();
        if late.is_empty() {
            return Ok(());
        }
        if abort.load(Ordering::Acquire) != 0 {
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: the communicator was aborted while waiting for ranks {late:?} to launch their first {issued} calls {}",
                why()
            )));
        }
        if !warned && start.elapsed() > LAUNCH_WAIT_WARN {
            warned = true;
            tracing::warn!(target: "oxccl::enqueue", "rank {rank}: waiting {:?} for ranks {late:?} to launch their first {issued} calls {} (did they skip a call, or does one thread issue several calls of one rank in a row?)", start.elapsed(), why());
        }
        // A peer on another thread is usually a few microseconds behind: yield first, then sleep.
        if spins < 200 {
            spins += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}


/// What a call was planned as: algorithm, protocol, channels, chunk and slice sizes. Observable
/// through [`Comm::last_choice`] and logged at debug level (target `oxccl::coll`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub func: Func,
    pub algo: Algo,
    pub proto: Proto,
    pub nchannels: u32,
    /// Elements per ring chunk.
    pub chunk_elems: u64,
    /// Elements per FIFO step.
    pub slice_elems: u64,
}



/// Launch events per CUDA rank ([`LaunchState`]): the flight recorder sees a call's own end as
/// long as fewer than this many launches came after it.
pub(super) const LAUNCH_EVENTS: usize = 64;

/// A CUDA rank's launches: an untimed event recorded after each kernel, in a ring of
/// [`LAUNCH_EVENTS`] (launch `n` in slot `n % LAUNCH_EVENTS`), and how many were recorded.
/// Shared with its process group (`Comm::init_all`), so an abort can wait for the peers' kernels
/// (direct writes land in user buffers, see [`Comm::abort`]); the flight recorder reads a call's
/// end from its launch's event ([`super::timeout::Watch::launched`]).
pub(super) struct LaunchState {
    events: Vec<cuda::Event>,
    /// Launch events recorded so far; the newest is `recorded - 1`.
    recorded: std::sync::atomic::AtomicU64,
    pub(super) launched: std::sync::atomic::AtomicBool,
    /// Kernels this rank has launched (the group's launch ordering, [`wait_launches`]).
    pub(super) issued: std::sync::atomic::AtomicU64,
    /// The stream of the newest recorded launch (its raw handle; `u64::MAX` before the first):
    /// a launch on another stream waits for it ([`LaunchState::order`]).
    last_stream: std::sync::atomic::AtomicU64,
}

impl LaunchState {
    pub(super) fn new(ctx: &Arc<cuda::Context>) -> Result<Arc<LaunchState>> {
        Ok(Arc::new(LaunchState {
            events: (0..LAUNCH_EVENTS).map(|_| cuda::Event::new(ctx)).collect::<Result<_>>()?,
            recorded: 0.into(),
            launched: false.into(),
            issued: 0.into(),
            last_stream: u64::MAX.into(),
        }))
    }

    /// Orders a launch about to be queued on `stream` after this rank's newest launch when that
    /// one went to another stream (`cuStreamWaitEvent` on its launch event): a communicator's
    /// kernels share its connections, so they run in the order issued whatever their streams,
    /// as NCCL's do. Not for a capturing stream (an event of outside the capture cannot be
    /// waited for inside it): a graph's launch is ordered by its stream only.
    pub(super) fn order(&self, stream: &cuda::Stream) -> Result<()> {
        let last = self.last_stream.load(Ordering::Acquire);
        let n = self.recorded.load(Ordering::Acquire);
        if n == 0 || last == u64::MAX || last == stream.raw as u64 {
            return Ok(());
        }
        self.events[(n - 1) as usize % LAUNCH_EVENTS].make_wait(stream)
    }

    /// Records the next launch event behind what `stream` holds (the kernel just launched) and
    /// marks the rank launched; returns the launch's number. One launching thread per rank at a
    /// time (its calls are issued in order).
    pub(super) fn record(&self, stream: &cuda::Stream) -> Result<u64> {
        let n = self.recorded.load(Ordering::Acquire);
        self.events[n as usize % LAUNCH_EVENTS].record(stream)?;
        self.last_stream.store(stream.raw as u64, Ordering::Release);
        self.recorded.store(n + 1, Ordering::Release);
        self.launched.store(true, Ordering::Release);
        Ok(n)
    }

    /// Whether launch `n`'s kernel has completed: its event, or when a later launch has reused
    /// its slot that later launch's (a rank's kernels run in order); false for launches not
    /// recorded yet.
    pub(super) fn completed(&self, n: u64) -> Result<bool> {
        if n >= self.recorded.load(Ordering::Acquire) {
            return Ok(false);
        }
        self.events[n as usize % LAUNCH_EVENTS].is_complete()
    }

    /// Whether the newest launch's kernel has completed (true before the first launch).
    pub(super) fn last_complete(&self) -> Result<bool> {
        match self.recorded.load(Ordering::Acquire) {
            0 => Ok(true),
            n => self.completed(n - 1),
        }
    }

    /// True when nothing this rank launched is still queued or running.
    pub(super) fn idle(&self) -> Result<bool> {
        Ok(!self.launched.load(Ordering::Acquire) || self.last_complete()?)
    }
}

impl Comm {
    /// Algorithm, protocol, channels, chunk and slice for a call of `bytes` bytes (the seed's
    /// tuning step: the cost model of [`crate::tuning::Model`] among what `NCCL_ALGO` /
    /// `NCCL_PROTO` allow and this communicator implements — the tree only when it has trees).
    pub(super) fn plan(&self, func: Func, bytes: u64, esize: u64) -> Result<Choice> {
        let model = crate::tuning::Model::for_fabric(self.fabric);
        let min = self.params.min_nchannels.unwrap_or(1);
        let trees = self.trees.map(|t| t.shape);
        let (algo, proto, nch) =
            self.selection
                .choose_sized_with(&model, func, bytes, self.nranks, min, self.nchannels, trees)?;
        if algo == Algo::Tree && proto == Proto::Simple {
            // One FIFO slot per chunk and slice (NCCL's tree on Simple: chunkSteps = sliceSteps =
            // 1), halved down to 128 KiB while there are fewer than 8 chunks per channel and tree
            // level, so the levels pipeline.
            let slot_bytes = self.params.buffsize / FIFO_STEPS / PACK_BYTES * PACK_BYTES;
            let depth = trees.map_or(1, |t| t.depth.max(1)) as u64;
            let mut chunk = slot_bytes;
            while bytes / (nch as u64 * chunk) < depth * 8 && chunk > (128 << 10) {
                chunk = chunk / 2 / PACK_BYTES * PACK_BYTES;
            }
            return Ok(Choice {
                func,
                algo,
                proto,
                nchannels: nch,
                chunk_elems: chunk / esize,
                slice_elems: chunk / esize,
            });
        }
        if proto != Proto::Simple {
            let chunk = self.line_chunk_elems(proto, esize);
            return Ok(Choice {
                func,
                algo,
                proto,
                nchannels: nch,
                chunk_elems: chunk,
                slice_elems: chunk,
            });
        }
        let slot_bytes = self.params.buffsize / FIFO_STEPS / PACK_BYTES * PACK_BYTES;
        let chunk_bytes = slot_bytes * DEFAULT_CHUNK_STEPS;
        // Slices of up to half a chunk (NCCL's 2 steps per slice), and at least 4 per chunk for
        // mid-size calls so the ring still pipelines.
        let per_chunk = bytes.div_ceil(nch as u64 * self.nranks as u64);
        let slice_bytes = if per_chunk >= 4 * chunk_bytes {
            chunk_bytes / 2
        } else {
            (per_chunk.min(chunk_bytes) / 4)
                .next_multiple_of(PACK_BYTES)
                .clamp((32 << 10).min(slot_bytes), chunk_bytes / 2)
        };
        Ok(Choice {
            func,
            algo,
            proto,
            nchannels: nch,
            chunk_elems: chunk_bytes / esize,
            slice_elems: slice_bytes / esize,
        })
    }

    /// Elements of `esize` bytes per chunk of a flag-line protocol (LL or LL128): one step of
    /// lines, 8 data bytes per 16-byte LL line, 120 per 128-byte LL128 line (NCCL's LL / LL128
    /// chunk, for the ring and the tree alike).
    pub(super) fn line_chunk_elems(&self, proto: Proto, esize: u64) -> u64 {
        line_chunk_elems(&self.params, proto, esize)
    }

    /// A one-rank collective's copy, in the rank's launch order ([`ordered_copy`]).
    pub(super) fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
        let order = match &self.res {
            Res::Cuda(res) => LaunchOrder::Cuda(&res.launch),
            Res::Cpu(res) => LaunchOrder::Cpu(self.cpu_blocks(res, 1, &[]), &self.inflight),
        };
        // SAFETY: the caller of the collective guarantees both ranges (all_reduce_raw).
        unsafe { ordered_copy(order, dst, src, bytes, stream) }
    }

    /// Queues the kernel of `args` — one work, or a batch of works of one kernel entry — on
    /// `stream` (`captured`: the stream is capturing, as the call's checks found); `recorded`:
    /// the flight-recorder entries of its calls, whose kernel's start and end are marked.
    pub(super) fn launch(&self, args: KernelArgs, stream: &Stream, captured: bool, recorded: &[u64]) -> Result<()> {
        let Some((func, algo, proto, dtype, op)) = args.work.entry_key() else {
            return Err(Error::Internal("work element with an invalid enum".into()));
        };
        let nworks = args.works();
        let entry = |w: &WorkColl| {
            w.entry_key()
                .map(|(f, a, p, d, o)| (f, a, p, oxccl_gpu::abi::kernel_variant(f, d, o)))
        };
        let first = entry(&args.work);
        if (1..nworks).any(|i| entry(&args.work_at(i)) != first) || (nworks > 1 && args.check != 0) {
            return Err(Error::Internal(
                "a launch of works of different kernel entries, or a checked launch of several works".into(),
            ));
        }
        let grid = oxccl_gpu::abi::launch_blocks(&args);
        self.launches.fetch_add(1, Ordering::AcqRel);
        match (&self.res, stream) {
            (Res::Cuda(res), Stream::Cuda(s)) => {
                let checked = oxccl_gpu::abi::runs_checked_entry(&args.work, args.check);
                let name = oxccl_gpu::abi::kernel_name_for(func, algo, proto, dtype, op, checked);
                let bytes = oxccl_gpu::abi::kernel_args_bytes(nworks as usize);
                let n = self.launch_cuda(res, s, captured, &[name.as_str()], |m| {
                    s.launch_prefix(&m[0], grid, self.params.nthreads, &args, bytes)
                })?;
                if let Some(n) = n {
                    for &id in recorded {
                        self.watch.launched(id, n);
                    }
                }
                Ok(())
            }
            (Res::Cpu(res), Stream::Cpu(s)) => {
                let checked = oxccl_gpu::abi::runs_checked_entry(&args.work, args.check);
                if oxccl_gpu::dispatch::entry_for(func, algo, proto, dtype, op, checked).is_none() {
                    return Err(crate::kernels::not_built(
                        oxccl_gpu::abi::kernel_name_for(func, algo, proto, dtype, op, checked).as_str(),
                    ));
                }
                let blocks = self.cpu_blocks(res, grid, recorded);
                // A checked launch keeps the check's memory until its blocks end.
                let held = if args.check != 0 { self.call_check.as_ref().map(|c| c.held()) } else { None };
                launch_cpu(args, blocks, s, &self.inflight, held)
            }
            _ => Err(Error::invalid(
                "stream and communicator are of different backends",
            )),
        }
    }
}

/// Where a rank's launches are ordered ([`ordered_copy`]): its GPU launch state, or on the CPU
/// target a launch of one block with the rank's count of queued operations.
pub(super) enum LaunchOrder<'a> {
    Cuda(&'a LaunchState),
    Cpu(CpuBlocks, &'a Arc<AtomicUsize>),
}

/// Queues a copy of `bytes` bytes from `src` to `dst` on `stream` as one of the rank's launches
/// (a rank's work runs in the order issued whatever its streams, as its kernels do): on a GPU
/// after the rank's newest launch when that went to another stream, then recorded as the newest
/// (not in a capture, whose stream orders it); on the CPU target as a launch of one block.
///
/// # Safety
/// `src` and `dst` are valid for `bytes` bytes on the rank's device until the copy has run, and
/// equal or disjoint.
pub(super) unsafe fn ordered_copy(order: LaunchOrder<'_>, dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
    if dst == src || bytes == 0 {
        return Ok(());
    }
    match (order, stream) {
        (LaunchOrder::Cuda(launch), Stream::Cuda(s)) => {
            let captured = stream.is_capturing()?;
            if !captured {
                launch.order(s)?;
            }
            s.copy_dtod(dst, src, bytes)?;
            if !captured {
                launch.record(s)?;
            }
            Ok(())
        }
        (LaunchOrder::Cpu(blocks, inflight), Stream::Cpu(s)) => blocks.launch(
            s,
            inflight,
            move |bid, tid, _| {
                if bid == 0 && tid == 0 {
                    // SAFETY: caller contract (and at each replay of a captured copy, its graph's
                    // launcher's).
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                }
                true
            },
            || Ok(()),
        ),
        _ => Err(Error::invalid("stream and communicator are of different backends")),
    }
}

impl Comm {
    /// A CPU-target launch of `nblocks` blocks of this rank (`recorded`: the flight-recorder
    /// entries of its calls, [`timeout::Watch::begin`]).
    pub(super) fn cpu_blocks(&self, res: &CpuRes, nblocks: u32, recorded: &[u64]) -> CpuBlocks {
        CpuBlocks {
            nblocks,
            nthreads: self.params.cpu_nthreads,
            team: self.params.cpu_team,
            group: res.group.clone(),
            process: self.process.clone(),
            rank: self.rank,
            watch: self.watch.clone(),
            recorded: recorded.to_vec(),
        }
    }

    /// Queues one call's kernels on this CUDA rank's stream `s` in launch order with the ranks of
    /// its process group (module docs): after the calls of the ranks sharing its GPU; the
    /// modules `names` loaded first (one not loaded yet only once every rank of the group has
    /// launched what came before); then `go` launches them (`go` gets them in the order of
    /// `names`) and the call counts as one launch of the ordering, however many kernels it
    /// queued. Loading every module before the first kernel keeps a load from waiting for this
    /// call's own first kernel. Returns the launch's number ([`LaunchState::record`]), `None`
    /// when `s` is `capturing` (the kernels are part of a CUDA graph and have no launch event).
    pub(super) fn launch_cuda(
        &self,
        res: &CudaRes,
        s: &cuda::Stream,
        capturing: bool,
        names: &[&str],
        go: impl FnOnce(&[Arc<cuda::Module>]) -> Result<()>,
    ) -> Result<Option<u64>> {
        let issued = res.launch.issued.load(Ordering::Acquire);
        let process = self.process.as_deref();
        let counter = |p: usize| process.and_then(|g| g.launch(p)).map(|l| (p, &l.issued));
        if !res.sharing.is_empty() {
            // This kernel waits in its stream for this rank's previous one; on a hardware queue
            // shared with a rank of this GPU it would hold back that rank's kernel of the
            // previous call, which ours is waiting for (module docs).
            let peers: Vec<_> = res.sharing.iter().filter_map(|&p| counter(p)).collect();
            wait_launches(&peers, issued, self.abort_flag(), self.rank, &|| {
                "before launching its next one on the GPU they share".into()
            })?;
        }
        let mut modules = Vec::with_capacity(names.len());
        for &name in names {
            modules.push(match res.ctx.loaded_kernel(name) {
                Some(m) => m,
                None => {
                    // Loading may wait for every kernel of the context: first let every rank of
                    // the group launch what came before, so none of their kernels waits for one
                    // of ours that the load holds back.
                    let peers: Vec<_> = (0..self.nranks).filter_map(counter).collect();
                    wait_launches(&peers, issued, self.abort_flag(), self.rank, &|| {
                        format!("before loading kernel {name}")
                    })?;
                    res.ctx.kernel(name)?
                }
            });
        }
        // A kernel captured into a CUDA graph runs at the graph's launches, not now: no launch
        // event (an event recorded in a capture cannot be queried) nor order after the rank's
        // other streams, but it still counts in the ordering, as it does on every rank
        // capturing the same call.
        if !capturing {
            res.launch.order(s)?;
        }
        go(&modules)?;
        let n = if capturing { None } else { Some(res.launch.record(s)?) };
        res.launch.issued.store(issued + 1, Ordering::Release);
        Ok(n)
    }
}

/// [`Comm::line_chunk_elems`] for a communicator of `params`.
pub(super) fn line_chunk_elems(params: &Params, proto: Proto, esize: u64) -> u64 {
    let step_data = if proto == Proto::Ll {
        params.ll_buffsize / FIFO_STEPS / 16 * 8
    } else {
        params.ll128_buffsize / FIFO_STEPS / 128 * 120
    };
    // A whole number of 16-byte packs (an odd line count makes, e.g., 65 × 8 = 520 bytes): the
    // kernels round each loop's chunk to whole packs, which must stay within the chunk
    // (`coll::loop_chunk`).
    let step_data = (step_data / PACK_BYTES * PACK_BYTES).max(PACK_BYTES);
    (step_data / esize).max(1)
}

/// Runs one collective on the CPU target: per channel a host thread running a block of
/// `nthreads` threads (`OXCCL_CPU_NTHREADS`; fibers of it or host threads of their own, `team`),
/// each running the same `run_block` the GPU kernel's threads run, with the block's shared memory
/// and real barriers; queued on the CPU stream. `group` (this rank's memory) and `process` (its
/// process group's, whose memory its blocks write into) are kept until the operation ends.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_cpu(
    args: KernelArgs,
    blocks: CpuBlocks,
    stream: &CpuStream,
    inflight: &Arc<AtomicUsize>,
    held: Option<super::call_check::CheckHeld>,
) -> Result<()> {
    let nthreads = blocks.nthreads;
    blocks.launch(stream, inflight, move |b, tid, smem| {
        let _check_memory = &held;
        // SAFETY: `args.comm` is this rank's comm block, kept alive by the launch's `group`, the
        // call check's memory (if checked) by `held`;
        // the buffers are the caller's (all_reduce_raw contract); `smem` is this block's,
        // shared by its threads as on the GPU. `false` (no entry for the work) cannot happen:
        // `launch` checked it.
        unsafe { oxccl_gpu::dispatch::run_block(&args, b, tid, nthreads, smem) }
    }, || Ok(()))
}

/// A CPU-target launch: `nblocks` blocks of `nthreads` threads (`OXCCL_CPU_NTHREADS`; fibers of
/// one host thread or host threads of their own, `team`), each block on a host thread of its
/// own, with the block's shared memory and real barriers. `group` (the rank's memory) and
/// `process` (its process group's, whose memory its blocks write into) are kept until the
/// launch ends.
pub(super) struct CpuBlocks {
    pub(super) nblocks: u32,
    pub(super) nthreads: u32,
    pub(super) team: oxccl_gpu::arch::TeamKind,
    pub(super) group: Arc<CpuGroup>,
    pub(super) process: Option<Arc<ProcessGroup>>,
    pub(super) rank: usize,
    /// The rank's flight recorder.
    pub(super) watch: Arc<timeout::Watch>,
    /// The watch's numbers of the launch: its collectives' flight-recorder entries, or its
    /// point-to-point launch's ([`timeout::Watch::begin_p2p`]), marked started and ended when its
    /// blocks start and end ([`timeout::Watch::started`], [`timeout::Watch::ended`]); empty for
    /// launches not watched.
    pub(super) recorded: Vec<u64>,
}

/// The end of a CPU-target launch, which a later launch of the rank on another stream waits
/// for ([`CpuBlocks::launch`]). Set when the launch's job ends or is dropped unrun.
#[derive(Default)]
pub(super) struct LaunchDone {
    done: Mutex<bool>,
    ended: std::sync::Condvar,
}

impl LaunchDone {
    fn set(&self) {
        if let Ok(mut d) = self.done.lock() {
            *d = true;
            self.ended.notify_all();
        }
    }
    fn wait(&self) {
        let Ok(mut d) = self.done.lock() else { return };
        while !*d {
            d = match self.ended.wait(d) {
                Ok(d) => d,
                Err(_) => return,
            };
        }
    }
}

/// Sets its [`LaunchDone`] when dropped: with the job that owns it, whether it ran or not.
struct EndsLaunch(Arc<LaunchDone>);

impl Drop for EndsLaunch {
    fn drop(&mut self) {
        self.0.set();
    }
}

impl CpuBlocks {
    /// Queues the launch on `stream`: every thread `tid` of every block `b` runs
    /// `run(b, tid, smem)` (`false`: the block trapped); then `after` (its error is the
    /// launch's, reported at the stream's synchronize). On a capturing stream the launch is
    /// recorded in the capture instead and runs at each launch of its graph
    /// ([`CpuBlocks::capture`]).
    pub(super) fn launch(
        self,
        stream: &CpuStream,
        inflight: &Arc<AtomicUsize>,
        run: impl Fn(u32, u32, *mut u32) -> bool + Send + Sync + 'static,
        after: impl Fn() -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        if stream.is_capturing() {
            return self.capture(stream, inflight, run, after);
        }
        inflight.fetch_add(1, Ordering::AcqRel);
        let inflight = inflight.clone();
        let CpuBlocks {
            nblocks,
            nthreads,
            team,
            group,
            process,
            rank,
            watch,
            recorded,
        } = self;
        // A communicator's kernels run in the order issued, whatever their streams (they share
        // its connections), as NCCL's do: after the rank's previous launch when that one went
        // to another stream.
        let stream_id = stream as *const CpuStream as usize;
        let ends = EndsLaunch(Arc::new(LaunchDone::default()));
        let after_previous = match group.last_launch.lock() {
            Ok(mut last) => last
                .replace((stream_id, ends.0.clone()))
                .and_then(|(id, done)| (id != stream_id).then_some(done)),
            Err(_) => None,
        };
        stream.enqueue(move || {
            let _ends = ends;
            if let Some(previous) = &after_previous {
                previous.wait();
            }
            group.running.fetch_add(1, Ordering::AcqRel);
            for &id in &recorded {
                watch.started(id);
            }
            let result = run_blocks(nblocks, nthreads, team, &run);
            group.running.fetch_sub(1, Ordering::AcqRel);
            for &id in &recorded {
                watch.ended(id);
            }
            let after = after();
            drop(group);
            drop(process);
            inflight.fetch_sub(1, Ordering::AcqRel);
            if result {
                after
            } else {
                Err(Error::Internal(format!("rank {rank}: a CPU-target channel trapped")))
            }
        })
    }

    /// [`CpuBlocks::launch`] on a capturing stream: recorded in its capture, it runs at each
    /// launch of the captured graph as the launch would have run now, counted among the rank's
    /// operations while it runs, as a replay (not watched by `OXCCL_TIMEOUT`, as on GPUs). The
    /// graph keeps the rank's memory only while a replay runs; the flight recorder keeps the
    /// call's capture, not its replays (`recorded` is unused).
    fn capture(
        self,
        stream: &CpuStream,
        inflight: &Arc<AtomicUsize>,
        run: impl Fn(u32, u32, *mut u32) -> bool + Send + Sync + 'static,
        after: impl Fn() -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        let inflight = inflight.clone();
        let CpuBlocks {
            nblocks,
            nthreads,
            team,
            group,
            process,
            rank,
            watch: _,
            recorded: _,
        } = self;
        // The graph does not keep the rank's memory (a CUDA graph keeps nothing of its
        // communicator): a replay after the communicator is gone is refused instead.
        let (group, process) = (Arc::downgrade(&group), process.as_ref().map(Arc::downgrade));
        stream.enqueue_replayable(move || {
            let gone = || {
                Error::InvalidUsage(format!(
                    "rank {rank}: a captured call's communicator was destroyed before its graph was launched"
                ))
            };
            let group = group.upgrade().ok_or_else(gone)?;
            let _memory_of_the_process_group = match &process {
                Some(p) => Some(p.upgrade().ok_or_else(gone)?),
                None => None,
            };
            group.replaying.fetch_add(1, Ordering::AcqRel);
            inflight.fetch_add(1, Ordering::AcqRel);
            group.running.fetch_add(1, Ordering::AcqRel);
            let result = run_blocks(nblocks, nthreads, team, &run);
            group.running.fetch_sub(1, Ordering::AcqRel);
            let after = after();
            inflight.fetch_sub(1, Ordering::AcqRel);
            group.replaying.fetch_sub(1, Ordering::AcqRel);
            if result {
                after
            } else {
                Err(Error::Internal(format!("rank {rank}: a CPU-target channel trapped (in a captured graph)")))
            }
        })
    }
}

/// Runs `nblocks` blocks of `nthreads` threads, each block on a host thread of its own with its
/// shared memory, every thread `tid` of block `b` running `run(b, tid, smem)`; whether no block
/// trapped.
fn run_blocks(
    nblocks: u32,
    nthreads: u32,
    team: oxccl_gpu::arch::TeamKind,
    run: &(impl Fn(u32, u32, *mut u32) -> bool + Sync),
) -> bool {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..nblocks)
            .map(|b| {
                s.spawn(move || {
                    // u64 cells: the shared memory is 8-byte aligned, as on the GPU.
                    let mut smem = vec![0u64; oxccl_gpu::abi::KERNEL_SMEM_BYTES / 8];
                    let smem = smem.as_mut_ptr() as usize;
                    oxccl_gpu::arch::run_block_threads(b, nthreads, team, |tid| run(b, tid, smem as *mut u32))
                })
            })
            .collect();
        let mut ok = true;
        for h in handles {
            ok &= h.join().unwrap_or(false);
        }
        ok
    })
}

/// Whether `NCCL_PROTO` (or `OXCCL_PROTO`) names LL128 in a list of protocols to use (not in an
/// exclusion list): NCCL then enables LL128 even where it is off by default; oxccl still keeps it
/// off through host memory on GPUs, and says so with a warning.
pub(super) fn ll128_forced() -> bool {
    ll128_forced_by(crate::params::env_var("PROTO").map(|(_, v)| v).as_deref())
}

/// [`ll128_forced`] for the `NCCL_PROTO` value `proto` (`None`: unset).
pub(super) fn ll128_forced_by(proto: Option<&str>) -> bool {
    proto.is_some_and(|v| {
        let v = v.trim();
        !v.starts_with('^') && v.split(',').any(|p| p.trim().eq_ignore_ascii_case("LL128"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn returns_at_once_when_no_peer_is_behind() {
        let (a, b) = (AtomicU64::new(3), AtomicU64::new(5));
        let abort = AtomicU32::new(0);
        let t = Instant::now();
        wait_launches(&[(1, &a), (2, &b)], 3, &abort, 0, &|| "x".into()).unwrap();
        assert!(t.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn waits_until_the_slowest_peer_launches() {
        let late = Arc::new(AtomicU64::new(1));
        let ahead = AtomicU64::new(9);
        let abort = AtomicU32::new(0);
        let l = late.clone();
        let bump = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            l.store(2, Ordering::Release);
        });
        let t = Instant::now();
        wait_launches(&[(1, &ahead), (2, &late)], 2, &abort, 0, &|| "x".into()).unwrap();
        let waited = t.elapsed();
        bump.join().unwrap();
        assert!(
            waited >= Duration::from_millis(140),
            "returned after {waited:?}, before the peer launched"
        );
        assert_eq!(late.load(Ordering::Acquire), 2);
    }

    #[test]
    fn an_abort_ends_the_wait_naming_the_ranks_behind() {
        let late = AtomicU64::new(0);
        let abort = Arc::new(AtomicU32::new(0));
        let a = abort.clone();
        let raise = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            a.store(1, Ordering::Release);
        });
        let e = wait_launches(&[(3, &late)], 1, &abort, 2, &|| "before loading kernel k".into()).unwrap_err();
        raise.join().unwrap();
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
        assert!(
            msg.contains("rank 2")
                && msg.contains("[3]")
                && msg.contains("first 1 calls before loading kernel k"),
            "{msg}"
        );
    }
}

#[cfg(test)]
mod ll128_tests {
    use super::*;

    #[test]
    fn ll128_forced_only_by_a_positive_list() {
        for (v, want) in [
            (None, false),
            (Some("LL128"), true),
            (Some("simple, ll128"), true),
            (Some("^LL"), false),
            (Some("^LL128"), false),
            (Some("LL"), false),
        ] {
            assert_eq!(ll128_forced_by(v), want, "{v:?}");
        }
    }
}
