//! Communicators: creation over local devices, channel and connection setup, and the collective
//! calls (NCCL's `init.cc`, `channel.cc`, `transport/p2p.cc` for the same-process P2P path, and
//! `enqueue.cc`).
//!
//! `Comm::init_all(devices)` creates one communicator per device in one process (NCCL's
//! `ncclCommInitAll`). Rings follow rank order. Each rank owns, per channel, a receive buffer of
//! `NCCL_BUFFSIZE` bytes and two step counters (its send connection's head, its receive
//! connection's tail); its ring neighbours write into them directly (P2P write over peer access on
//! CUDA, plain host memory on the CPU target).
use crate::cpu::{CpuStream, HostMem};
use crate::cuda;
use crate::error::{Error, Result};
use crate::mem::{DevSlice, Device, Stream};
use crate::params::Params;
use crate::tuning::Selection;
use bytemuck::Zeroable;
use oxccl_gpu::abi::{
    Algo, ConnInfo, DEFAULT_CHUNK_STEPS, DataType, DevChannel, DevComm, DevRing, FIFO_STEPS, Func,
    KernelArgs, MAX_CHANNELS, PACK_BYTES, Proto, RedOp, WorkColl,
};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default channel count on CUDA devices (overridable with `NCCL_MAX_NCHANNELS`).
pub const CUDA_DEFAULT_NCHANNELS: u32 = 64;
/// Default channel count on the CPU target (each channel is a host thread per rank).
pub const CPU_DEFAULT_NCHANNELS: u32 = 2;
/// Bytes per channel below which a call uses fewer channels.
const MIN_BYTES_PER_CHANNEL: u64 = 128 << 10;
/// Abort-flag values: this rank called abort, or another rank of its process group did.
const ABORTED_HERE: u32 = 1;
const ABORTED_BY_PEER: u32 = 2;
/// How long [`Comm::abort`] waits for in-flight operations to exit.
const ABORT_WAIT: Duration = Duration::from_secs(5);
/// How long dropping a communicator waits for its last operation before it raises the abort flag.
const DROP_WAIT: Duration = Duration::from_secs(10);
/// Bytes reserved per channel for the two step counters (head, tail), each on its own 128-byte line.
const COUNTERS_BYTES: u64 = 256;

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

/// One rank of a communicator (NCCL's `ncclComm`). Collectives are queued on the caller's stream
/// and return at once; completion is observed by synchronizing that stream.
pub struct Comm {
    rank: usize,
    nranks: usize,
    device: Device,
    params: Params,
    selection: Selection,
    nchannels: u32,
    dev_comm: u64,
    res: Res,
    inflight: Arc<AtomicUsize>,
    last: Mutex<Option<Choice>>,
}

enum Res {
    Cuda(CudaRes),
    Cpu(CpuRes),
}

struct CudaRes {
    ctx: Arc<cuda::Context>,
    group: Arc<CudaGroup>,
    last_event: cuda::Event,
    launched: std::sync::atomic::AtomicBool,
}

/// Every rank's device memory of one `init_all`, freed when the last rank is dropped: a rank's
/// kernel writes into its neighbours' FIFOs and counters (the receiver's head credit can land after
/// the sender's own kernel has finished), so no rank's memory may go before every rank is done.
struct CudaGroup {
    _comm_mem: Vec<cuda::DevAlloc>,
    _conn_mem: Vec<cuda::DevAlloc>,
    abort: Vec<cuda::HostMapped>,
}

/// The CPU target keeps every rank's memory alive until the last queued operation of any rank is
/// done: a rank's blocks write into its neighbours' FIFOs.
struct CpuRes {
    group: Arc<CpuGroup>,
    /// This rank's index in the group's `comm_mem`/`abort` (its rank for `init_all`, 0 for
    /// `init_rank`).
    slot: usize,
}

struct CpuGroup {
    comm_mem: Vec<HostMem>,
    _conn_mem: Vec<HostMem>,
    abort: Vec<HostMem>,
    /// `init_rank`: this rank's connection memory and its ring neighbours', shared across processes.
    _shm: Vec<crate::cpu::ShmSegment>,
    /// `init_rank`: the bootstrap network to the other ranks.
    _bootstrap: Option<crate::bootstrap::Bootstrap>,
}

/// Layout of one rank's connection memory: per channel a Simple receive buffer, then per channel
/// the counters block (head of the send connection at +0, tail of the receive connection at +128).
struct ConnLayout {
    buffsize: u64,
    ll_buffsize: u64,
    nch: u64,
}
impl ConnLayout {
    /// `ll`: whether connections get LL buffers (the CPU target; GPU kernels run Simple only so far).
    fn new(params: &Params, nch: u32, ll: bool) -> Self {
        ConnLayout {
            buffsize: params.buffsize,
            ll_buffsize: if ll { params.ll_buffsize } else { 0 },
            nch: nch as u64,
        }
    }
    fn per_channel(&self) -> u64 {
        self.buffsize + self.ll_buffsize
    }
    fn bytes(&self) -> u64 {
        self.nch * (self.per_channel() + COUNTERS_BYTES)
    }
    /// The Simple receive buffer of channel `c`.
    fn buff(&self, base: u64, c: u64) -> u64 {
        base + c * self.per_channel()
    }
    /// The LL receive buffer of channel `c`.
    fn ll(&self, base: u64, c: u64) -> u64 {
        self.buff(base, c) + self.buffsize
    }
    fn head(&self, base: u64, c: u64) -> u64 {
        base + self.nch * self.per_channel() + c * COUNTERS_BYTES
    }
    fn tail(&self, base: u64, c: u64) -> u64 {
        self.head(base, c) + 128
    }
}

/// Layout of one rank's communicator block: DevComm, channels, then per channel the ring's user
/// ranks.
fn comm_block_bytes(nch: usize, nranks: usize) -> usize {
    size_of::<DevComm>() + nch * size_of::<DevChannel>() + nch * nranks * 4
}

fn check_devices(devices: &[Device]) -> Result<()> {
    if devices.is_empty() {
        return Err(Error::invalid(
            "devices is empty: a communicator needs at least one rank",
        ));
    }
    let cuda = devices[0].is_cuda();
    if devices.iter().any(|d| d.is_cuda() != cuda) {
        return Err(Error::invalid("devices mixes CUDA and CPU-target devices"));
    }
    let shared_ok = crate::params::env_var("ALLOW_SHARED_DEVICE").is_some_and(|(_, v)| v == "1");
    for (i, a) in devices.iter().enumerate() {
        if let Some(j) = devices[..i].iter().position(|b| b == a)
            && !shared_ok
        {
            return Err(Error::InvalidUsage(format!(
                "ranks {j} and {i} are both on device {a:?}; one GPU per rank is required \
                     (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)"
            )));
        }
    }
    Ok(())
}

impl Comm {
    /// Creates one communicator per device, rank `i` on `devices[i]`, all in this process (NCCL's
    /// `ncclCommInitAll`). Devices must all be CUDA or all CPU-target, each used once.
    ///
    /// Errors: `InvalidArgument` for an empty or mixed list or a bad environment value
    /// (`NCCL_BUFFSIZE`, `NCCL_NTHREADS`, `NCCL_MAX_NCHANNELS`, ...), `InvalidUsage` for a
    /// repeated device, `NoCuda`/`Cuda` for driver failures, `System` when ring neighbours cannot
    /// reach each other's memory.
    pub fn init_all(devices: &[Device]) -> Result<Vec<Comm>> {
        check_devices(devices)?;
        let mut params = Params::from_env()?;
        if devices[0].is_cuda() && params.nthreads > cuda::MAX_JIT_THREADS {
            tracing::warn!(target: "oxccl::init", "NCCL_NTHREADS={} rounded down to {} (the most threads per block the kernels are built for)", params.nthreads, cuda::MAX_JIT_THREADS);
            params.nthreads = cuda::MAX_JIT_THREADS;
        }
        let selection = Selection::from_env()?;
        let nranks = devices.len();
        let default_nch = if devices[0].is_cuda() {
            CUDA_DEFAULT_NCHANNELS
        } else {
            CPU_DEFAULT_NCHANNELS
        };
        let nch = params
            .max_nchannels
            .unwrap_or(default_nch)
            .clamp(1, MAX_CHANNELS as u32);
        let layout = ConnLayout::new(&params, nch, !devices[0].is_cuda());
        let _span = tracing::debug_span!(target: "oxccl::init", "init_all", nranks, nch).entered();

        if devices[0].is_cuda() {
            let ctxs: Vec<Arc<cuda::Context>> = devices
                .iter()
                .map(|d| match d {
                    Device::Cuda(o) => cuda::Context::get(*o),
                    Device::Cpu(_) => Err(Error::Internal("CPU device in a CUDA communicator".into())),
                })
                .collect::<Result<_>>()?;
            // P2P transport, same-process path: every rank writes into its ring neighbours.
            for r in 0..nranks {
                for peer in [(r + 1) % nranks, (r + nranks - 1) % nranks] {
                    if ctxs[peer].ordinal == ctxs[r].ordinal {
                        continue;
                    }
                    if !ctxs[r].can_access_peer(&ctxs[peer])? {
                        return Err(Error::System(format!(
                            "no transport can connect rank {r} (CUDA device {}) and rank {peer} (CUDA device {}): \
                             peer access is not supported between them",
                            ctxs[r].ordinal, ctxs[peer].ordinal
                        )));
                    }
                    ctxs[r].enable_peer_access(&ctxs[peer])?;
                }
            }
            let mut conn = Vec::with_capacity(nranks);
            let mut block = Vec::with_capacity(nranks);
            let mut abort = Vec::with_capacity(nranks);
            for ctx in &ctxs {
                conn.push(cuda::DevAlloc::zeroed(ctx, layout.bytes() as usize)?);
                block.push(cuda::DevAlloc::zeroed(
                    ctx,
                    comm_block_bytes(nch as usize, nranks),
                )?);
                abort.push(cuda::HostMapped::zeroed(ctx, 64)?);
            }
            let conn_base: Vec<u64> = conn.iter().map(|a| a.ptr).collect();
            for r in 0..nranks {
                let bytes = build_comm_block(
                    r,
                    nranks,
                    nch,
                    &layout,
                    &conn_base,
                    block[r].ptr,
                    abort[r].dev_ptr,
                    &params,
                );
                block[r].write(0, &bytes)?;
                if params.initial_step != 0 {
                    for c in 0..nch as u64 {
                        for at in [layout.head(conn_base[r], c), layout.tail(conn_base[r], c)] {
                            conn[r]
                                .write((at - conn_base[r]) as usize, &params.initial_step.to_ne_bytes())?;
                        }
                    }
                }
            }
            let dev_comms: Vec<u64> = block.iter().map(|b| b.ptr).collect();
            let group = Arc::new(CudaGroup {
                _comm_mem: block,
                _conn_mem: conn,
                abort,
            });
            let mut comms = Vec::with_capacity(nranks);
            for (r, dev_comm) in dev_comms.into_iter().enumerate() {
                let ctx = ctxs[r].clone();
                let last_event = cuda::Event::new(&ctx)?;
                comms.push(Comm {
                    rank: r,
                    nranks,
                    device: devices[r],
                    params: params.clone(),
                    selection,
                    nchannels: nch,
                    dev_comm,
                    res: Res::Cuda(CudaRes {
                        ctx,
                        group: group.clone(),
                        last_event,
                        launched: false.into(),
                    }),
                    inflight: Arc::new(AtomicUsize::new(0)),
                    last: Mutex::new(None),
                });
            }
            tracing::debug!(target: "oxccl::init", nranks, nch, "CUDA communicators ready");
            Ok(comms)
        } else {
            let conn: Vec<HostMem> = (0..nranks)
                .map(|_| HostMem::zeroed(layout.bytes() as usize))
                .collect::<Result<_>>()?;
            let comm_mem: Vec<HostMem> = (0..nranks)
                .map(|_| HostMem::zeroed(comm_block_bytes(nch as usize, nranks)))
                .collect::<Result<_>>()?;
            let abort: Vec<HostMem> = (0..nranks).map(|_| HostMem::zeroed(64)).collect::<Result<_>>()?;
            let conn_base: Vec<u64> = conn.iter().map(|a| a.addr()).collect();
            for r in 0..nranks {
                let bytes = build_comm_block(
                    r,
                    nranks,
                    nch,
                    &layout,
                    &conn_base,
                    comm_mem[r].addr(),
                    abort[r].addr(),
                    &params,
                );
                // SAFETY: the block was allocated with exactly this size; nothing else uses it yet.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), comm_mem[r].addr() as *mut u8, bytes.len())
                };
                for c in 0..nch as u64 {
                    for at in [layout.head(conn_base[r], c), layout.tail(conn_base[r], c)] {
                        // SAFETY: the counters lie inside rank r's connection memory, unused so far.
                        unsafe { (at as *mut u64).write(params.initial_step) };
                    }
                }
            }
            let group = Arc::new(CpuGroup {
                comm_mem,
                _conn_mem: conn,
                abort,
                _shm: Vec::new(),
                _bootstrap: None,
            });
            Ok((0..nranks)
                .map(|r| Comm {
                    rank: r,
                    nranks,
                    device: devices[r],
                    params: params.clone(),
                    selection,
                    nchannels: nch,
                    dev_comm: group.comm_mem[r].addr(),
                    res: Res::Cpu(CpuRes {
                        group: group.clone(),
                        slot: r,
                    }),
                    inflight: Arc::new(AtomicUsize::new(0)),
                    last: Mutex::new(None),
                })
                .collect())
        }
    }

    /// Creates this process's rank `rank` of an `nranks`-rank communicator whose ranks meet through
    /// the bootstrap of `id` (NCCL's `ncclCommInitRank`; every rank calls it with the same `id`,
    /// usually in its own process). Peer information (host, process, device) is exchanged like the
    /// seed's `fillInfo` + AllGather1; two ranks on the same device of one host are an
    /// `InvalidUsage` on every rank naming both (case C26; `OXCCL_ALLOW_SHARED_DEVICE=1` allows it).
    ///
    /// CPU-target devices connect through shared memory (`/dev/shm`), so ranks may be threads or
    /// processes. CUDA devices need the IPC transport, which is not implemented yet: they are
    /// refused with `InvalidUsage` (use [`Comm::init_all`] inside one process).
    pub fn init_rank(
        nranks: usize,
        id: &crate::bootstrap::UniqueId,
        rank: usize,
        device: Device,
    ) -> Result<Comm> {
        if nranks == 0 || rank >= nranks {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for nranks {nranks} (accepted: 0..{nranks})"
            )));
        }
        let params = Params::from_env()?;
        let selection = Selection::from_env()?;
        let bootstrap = crate::bootstrap::Bootstrap::init(id, rank, nranks)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let host = crate::params::env_var("HOSTID").map_or(host.trim().to_string(), |(_, v)| v);
        let (kind, index) = match device {
            Device::Cuda(o) => ("cuda", o),
            Device::Cpu(i) => ("cpu", i),
        };
        let me = format!("{kind}\n{index}\n{host}\n{}", std::process::id());
        let peers: Vec<Vec<String>> = bootstrap
            .allgather(me.as_bytes())?
            .into_iter()
            .map(|b| {
                String::from_utf8_lossy(&b)
                    .split('\n')
                    .map(str::to_string)
                    .collect()
            })
            .collect();
        let shared_ok = crate::params::env_var("ALLOW_SHARED_DEVICE").is_some_and(|(_, v)| v == "1");
        for (a, pa) in peers.iter().enumerate() {
            if pa.len() != 4 || pa[0] != kind {
                return Err(Error::InvalidUsage(format!(
                    "rank {a} is on a {} device but rank {rank} is on a {kind} device: a communicator is all CUDA or all CPU-target",
                    pa.first().map_or("?", String::as_str)
                )));
            }
            for (b, pb) in peers.iter().enumerate().skip(a + 1) {
                if pa[..3] == pb[..3] && !shared_ok {
                    return Err(Error::InvalidUsage(format!(
                        "ranks {a} and {b} are both on {kind} device {} of host {:?}; one device per rank is required \
                         (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)",
                        pa[1], pa[2]
                    )));
                }
            }
        }
        if device.is_cuda() {
            return Err(Error::InvalidUsage(
                "init_rank on CUDA devices needs the CUDA IPC transport, which oxccl does not have yet; \
                 use Comm::init_all inside one process"
                    .into(),
            ));
        }
        let default_nch = CPU_DEFAULT_NCHANNELS;
        let nch = params
            .max_nchannels
            .unwrap_or(default_nch)
            .clamp(1, MAX_CHANNELS as u32);
        let layout = ConnLayout::new(&params, nch, true);
        // Named after the id and the creating process, unique among live processes.
        let name = |r: usize| format!("oxccl-{:08x}-{}-r{r}", id_tag(id), peers[r][3]);
        let own = crate::cpu::ShmSegment::create(&name(rank), layout.bytes() as usize)?;
        for c in 0..nch as u64 {
            for at in [layout.head(own.addr(), c), layout.tail(own.addr(), c)] {
                // SAFETY: the counters lie inside our fresh segment; no peer maps it yet.
                unsafe { (at as *mut u64).write(params.initial_step) };
            }
        }
        bootstrap.barrier()?;
        let (next, prev) = ((rank + 1) % nranks, (rank + nranks - 1) % nranks);
        let mut conn_base = vec![0u64; nranks];
        conn_base[rank] = own.addr();
        let mut shm = vec![own];
        for peer in [next, prev] {
            if conn_base[peer] == 0 {
                let seg = crate::cpu::ShmSegment::open(&name(peer), layout.bytes() as usize)?;
                conn_base[peer] = seg.addr();
                shm.push(seg);
            }
        }
        // Every neighbour has mapped our segment: its name can go (the mappings stay).
        bootstrap.barrier()?;
        if let Err(e) = shm[0].unlink() {
            tracing::warn!(target: "oxccl::init", "{e}");
        }
        let comm_mem = HostMem::zeroed(comm_block_bytes(nch as usize, nranks))?;
        let abort = HostMem::zeroed(64)?;
        let bytes = build_comm_block(
            rank,
            nranks,
            nch,
            &layout,
            &conn_base,
            comm_mem.addr(),
            abort.addr(),
            &params,
        );
        // SAFETY: the block was allocated with exactly this size; nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), comm_mem.addr() as *mut u8, bytes.len()) };
        let dev_comm = comm_mem.addr();
        let group = Arc::new(CpuGroup {
            comm_mem: vec![comm_mem],
            _conn_mem: Vec::new(),
            abort: vec![abort],
            _shm: shm,
            _bootstrap: Some(bootstrap),
        });
        tracing::debug!(target: "oxccl::init", rank, nranks, nch, "CPU-target communicator over shared memory ready");
        Ok(Comm {
            rank,
            nranks,
            device,
            params,
            selection,
            nchannels: nch,
            dev_comm,
            res: Res::Cpu(CpuRes { group, slot: 0 }),
            inflight: Arc::new(AtomicUsize::new(0)),
            last: Mutex::new(None),
        })
    }

    /// One rank per process from a launcher's environment, as torchrun and Slurm wrappers set it:
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default: `RANK`), and the rendezvous address from
    /// `NCCL_COMM_ID` / `OXCCL_COMM_ID` (`host:port`) or else `MASTER_ADDR` and `MASTER_PORT`;
    /// rank 0 runs the bootstrap root there. The device is GPU `LOCAL_RANK` when GPUs are visible,
    /// else CPU-target device `LOCAL_RANK`. Then as [`Comm::init_rank`]. Errors name the missing or
    /// malformed variable.
    pub fn from_env() -> Result<Comm> {
        let var = |k: &str| {
            std::env::var(k).map_err(|_| Error::invalid(format!("{k} is not set (needed by Comm::from_env)")))
        };
        let num = |k: &str, v: String| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| Error::invalid(format!("{k}={v:?} is not a non-negative integer")))
        };
        let rank = num("RANK", var("RANK")?)?;
        let world = num("WORLD_SIZE", var("WORLD_SIZE")?)?;
        let local = match std::env::var("LOCAL_RANK") {
            Ok(v) => num("LOCAL_RANK", v)?,
            Err(_) => rank,
        };
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "RANK={rank} is out of range for WORLD_SIZE={world} (accepted: 0..{world})"
            )));
        }
        let comm_id = match crate::params::env_var("COMM_ID") {
            Some((_, v)) => v,
            None => format!("{}:{}", var("MASTER_ADDR")?, var("MASTER_PORT")?),
        };
        let id = crate::bootstrap::UniqueId::from_comm_id(&comm_id)?;
        let ngpu = Device::cuda_count();
        let device = if ngpu > 0 {
            Device::Cuda(local % ngpu)
        } else {
            Device::Cpu(local)
        };
        Comm::init_rank(world, &id, rank, device)
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks (NCCL's `ncclCommCount`).
    pub fn nranks(&self) -> usize {
        self.nranks
    }
    /// The device of this rank.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Channels set up (the most any call uses).
    pub fn nchannels(&self) -> u32 {
        self.nchannels
    }
    /// The parameters this communicator was created with.
    pub fn params(&self) -> &Params {
        &self.params
    }
    /// Device memory used by this rank's connections and communicator state, in bytes.
    pub fn device_memory_bytes(&self) -> u64 {
        let layout = ConnLayout::new(&self.params, self.nchannels, !self.device.is_cuda());
        layout.bytes() + comm_block_bytes(self.nchannels as usize, self.nranks) as u64
    }
    /// Aborts this rank (NCCL's `ncclCommAbort`): raises the abort flag that every kernel spin
    /// loop polls, so operations still waiting for a peer exit and their streams drain, then waits
    /// up to 5 s for this rank's queued operations to finish. The communicator is unusable
    /// afterwards: later calls return `InvalidUsage`. Safe to call from any thread, more than once.
    /// Results of the interrupted operations are undefined.
    pub fn abort(&self) -> Result<()> {
        self.abort_flag().store(ABORTED_HERE, Ordering::Release);
        // Ranks of the same process group would otherwise wait for us forever: their kernels exit
        // too, and their later calls report the remote abort (case C28, one rank aborting).
        for peer in self.group_abort_flags() {
            let _ = peer.compare_exchange(0, ABORTED_BY_PEER, Ordering::AcqRel, Ordering::Acquire);
        }
        tracing::warn!(target: "oxccl::init", rank = self.rank, "communicator aborted");
        let start = Instant::now();
        let done = || -> Result<bool> {
            Ok(match &self.res {
                Res::Cuda(res) => !res.launched.load(Ordering::Acquire) || res.last_event.is_complete()?,
                Res::Cpu(_) => self.inflight.load(Ordering::Acquire) == 0,
            })
        };
        while !done()? {
            if start.elapsed() > ABORT_WAIT {
                return Err(Error::Timeout(format!(
                    "rank {}: operations still running {ABORT_WAIT:?} after abort",
                    self.rank
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// Destroys this rank (NCCL's `ncclCommDestroy`): waits for its queued operations (up to 10 s,
    /// then aborts them), then frees its resources, returning the first error met on the way.
    /// Taking `self` makes a second destroy or a use after destroy a compile error (case C27).
    pub fn destroy(self) -> Result<()> {
        let start = Instant::now();
        loop {
            let done = match &self.res {
                Res::Cuda(res) => !res.launched.load(Ordering::Acquire) || res.last_event.is_complete()?,
                Res::Cpu(_) => self.inflight.load(Ordering::Acquire) == 0,
            };
            if done {
                return Ok(());
            }
            if start.elapsed() > DROP_WAIT {
                self.abort()?;
                return Err(Error::Timeout(format!(
                    "rank {}: destroy waited {DROP_WAIT:?} for queued operations and aborted them",
                    self.rank
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// True once [`Comm::abort`] was called (or dropping raised the abort flag).
    pub fn is_aborted(&self) -> bool {
        self.abort_flag().load(Ordering::Acquire) != 0
    }

    /// The plan of the most recent collective call on this communicator.
    pub fn last_choice(&self) -> Option<Choice> {
        self.last.lock().ok().and_then(|g| *g)
    }

    /// Reduces (`op`) `count` elements of `dtype` across all ranks; every rank gets the result in
    /// `recv` (NCCL's `ncclAllReduce`). `send` and `recv` hold at least `count × dtype.size()` bytes
    /// on this rank's device and may be the same range (in place) but must not partly overlap.
    /// Queued on `stream` (on this rank's device); returns at once. Results are bitwise identical on
    /// every rank. `count == 0` is a no-op.
    pub fn all_reduce<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: RedOp,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::AllReduce,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            op,
            0,
            stream,
        )
    }

    /// Copies `count` elements of `dtype` from `send` on rank `root` to `recv` on every rank
    /// (NCCL's `ncclBroadcast`). `send` is read on the root only (others may pass `None`); on the
    /// root it may equal `recv` (in place). Errors: `root` outside `0..nranks`, `None` on the root,
    /// buffers shorter than `count` elements.
    pub fn broadcast<'a>(
        &self,
        send: Option<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::Broadcast,
            send,
            Some(recv.into()),
            count,
            dtype,
            RedOp::Sum,
            root,
            stream,
        )
    }

    /// Reduces (`op`) `count` elements of `dtype` across all ranks into `recv` on rank `root`
    /// (NCCL's `ncclReduce`). `recv` is written on the root only (others may pass `None` and are
    /// never written). Errors as for [`Comm::broadcast`].
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: Option<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: RedOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::Reduce,
            Some(send.into()),
            recv,
            count,
            dtype,
            op,
            root,
            stream,
        )
    }

    /// Gathers `count` elements from every rank into `recv` (`nranks × count` elements, rank `r`'s
    /// block at `r × count`) on every rank (NCCL's `ncclAllGather`). In place when `send` is exactly
    /// `recv`'s block of this rank; any other overlap is an error.
    pub fn all_gather<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::AllGather,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            RedOp::Sum,
            0,
            stream,
        )
    }

    /// Reduces (`op`) `nranks × count` elements of `dtype` across ranks and leaves block `r` (the
    /// `count` elements at `r × count`) in `recv` on rank `r` (NCCL's `ncclReduceScatter`). In place
    /// when `recv` is exactly this rank's block of `send`; any other overlap is an error.
    pub fn reduce_scatter<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: RedOp,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::ReduceScatter,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            op,
            0,
            stream,
        )
    }

    /// Byte sizes (send, recv) a rank's buffers need for `func` with per-call `count`.
    fn buffer_bytes(&self, func: Func, count: usize, dtype: DataType) -> Result<(u64, u64)> {
        let b = self.check_bytes(count, dtype)?;
        let all = b
            .checked_mul(self.nranks as u64)
            .ok_or_else(|| Error::invalid(format!("count {count} × {} ranks overflows", self.nranks)))?;
        Ok(match func {
            Func::AllGather => (b, all),
            Func::ReduceScatter => (all, b),
            _ => (b, b),
        })
    }

    /// Argument checks shared by the safe entry points, then [`Comm::collective_raw`].
    #[allow(clippy::too_many_arguments)]
    fn safe_call(
        &self,
        func: Func,
        send: Option<DevSlice<'_>>,
        recv: Option<DevSlice<'_>>,
        count: usize,
        dtype: DataType,
        op: RedOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.check_root(func, root)?;
        let (send_bytes, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        let is_root = self.rank == root;
        let send_needed = !(func == Func::Broadcast && !is_root);
        let recv_needed = !(func == Func::Reduce && !is_root);
        for (name, s, need, bytes) in [
            ("sendbuff", &send, send_needed, send_bytes),
            ("recvbuff", &recv, recv_needed, recv_bytes),
        ] {
            match s {
                None if need && count > 0 => {
                    return Err(Error::invalid(format!(
                        "{name} is missing on rank {} ({} needs it{})",
                        self.rank,
                        func,
                        if func == Func::Broadcast || func == Func::Reduce {
                            " on the root"
                        } else {
                            ""
                        }
                    )));
                }
                None => {}
                Some(s) => {
                    if s.device() != self.device {
                        return Err(Error::invalid(format!(
                            "{name} is on {:?} but rank {} is on {:?}",
                            s.device(),
                            self.rank,
                            self.device
                        )));
                    }
                    if need && (s.len() as u64) < bytes {
                        return Err(Error::invalid(format!(
                            "{name} holds {} bytes but {} of count {count} × {} ({} bytes each) needs {bytes} on rank {}",
                            s.len(),
                            func,
                            dtype.name(),
                            dtype.size(),
                            self.rank
                        )));
                    }
                }
            }
        }
        let sa = send.filter(|_| send_needed).map_or(0, |s| s.addr());
        let ra = recv.filter(|_| recv_needed).map_or(0, |s| s.addr());
        if sa != 0 && ra != 0 && count > 0 {
            let in_place_at = match func {
                Func::AllGather => (sa == ra + self.rank as u64 * send_bytes).then_some(()),
                Func::ReduceScatter => (ra == sa + self.rank as u64 * recv_bytes).then_some(()),
                _ => (sa == ra).then_some(()),
            };
            let overlap = sa < ra + recv_bytes && ra < sa + send_bytes;
            if overlap && in_place_at.is_none() {
                return Err(Error::invalid(format!(
                    "sendbuff and recvbuff of {func} partly overlap: in place means {}; otherwise they must be disjoint",
                    match func {
                        Func::AllGather => "sendbuff == recvbuff + rank × count elements",
                        Func::ReduceScatter => "recvbuff == sendbuff + rank × count elements",
                        _ => "sendbuff == recvbuff",
                    }
                )));
            }
        }
        // SAFETY: every range used was checked against its buffer above.
        unsafe { self.collective_raw(func, sa, ra, count, dtype, op, root, stream) }
    }

    fn check_root(&self, func: Func, root: usize) -> Result<()> {
        if matches!(func, Func::Broadcast | Func::Reduce) && root >= self.nranks {
            return Err(Error::invalid(format!(
                "root {root} is out of range for {func} (accepted: 0..={})",
                self.nranks - 1
            )));
        }
        Ok(())
    }

    /// [`Comm::all_reduce`] on raw addresses (a `CUdeviceptr`, or a host address on the CPU
    /// target), for interoperability with other CUDA code.
    ///
    /// # Safety
    /// `send` and `recv` are valid for `count × dtype.size()` bytes on this rank's device until the
    /// operation completes on `stream`, and are equal or disjoint.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: RedOp,
        stream: &Stream,
    ) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.collective_raw(Func::AllReduce, send, recv, count, dtype, op, 0, stream) }
    }

    /// Any collective on raw addresses: `func`'s buffers as in the safe entry points, 0 for a buffer
    /// NCCL lets a rank omit (Broadcast's non-root send, Reduce's non-root recv).
    ///
    /// # Safety
    /// The buffers are valid on this rank's device for the sizes `func` needs with `count` until
    /// the operation completes on `stream`, and overlap only as the in-place forms allow.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn collective_raw(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: RedOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.check_root(func, root)?;
        let (_, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        self.check_stream(stream)?;
        if self.abort_flag().load(Ordering::Acquire) == ABORTED_BY_PEER {
            return Err(Error::Remote(format!(
                "rank {}: another rank of this communicator aborted; abort or destroy this rank too",
                self.rank
            )));
        }
        if self.is_aborted() {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was aborted",
                self.rank
            )));
        }
        if count == 0 {
            return Ok(());
        }
        if self.nranks == 1 {
            // One rank: every collective is a copy of the input (Sum, Prod, Min, Max and Avg of one
            // value are that value).
            return if send == recv {
                Ok(())
            } else {
                self.copy(recv, send, recv_bytes as usize, stream)
            };
        }
        let esize = dtype.size() as u64;
        let total = match func {
            Func::AllGather | Func::ReduceScatter => {
                recv_bytes.max(count as u64 * esize) * self.nranks as u64
            }
            _ => recv_bytes.max(count as u64 * esize),
        };
        let choice = self.plan(func, total, esize)?;
        let work = WorkColl {
            sendbuff: send,
            recvbuff: recv,
            count: count as u64,
            chunk_elems: choice.chunk_elems,
            slice_elems: choice.slice_elems,
            root: root as u32,
            func: func as u8,
            redop: op as u8,
            dtype: dtype as u8,
            algo: choice.algo as u8,
            proto: choice.proto as u8,
            nchannels: choice.nchannels as u16,
            ..WorkColl::zeroed()
        };
        tracing::debug!(target: "oxccl::coll", rank = self.rank, %func, count, %dtype, %op, root, ?choice, "enqueue");
        if let Ok(mut last) = self.last.lock() {
            *last = Some(choice);
        }
        self.launch(
            KernelArgs {
                comm: self.dev_comm,
                _pad: 0,
                work,
            },
            stream,
        )
    }

    fn check_bytes(&self, count: usize, dtype: DataType) -> Result<u64> {
        (count as u64)
            .checked_mul(dtype.size() as u64)
            .filter(|b| *b <= i64::MAX as u64)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "count {count} of {} overflows the byte size",
                    dtype.name()
                ))
            })
    }

    fn check_stream(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device {
            return Err(Error::invalid(format!(
                "stream is on {:?} but rank {} is on {:?}",
                stream.device(),
                self.rank,
                self.device
            )));
        }
        Ok(())
    }

    /// Channels, chunk and slice for a call of `bytes` bytes (the seed's tuning step; the
    /// protocol/algorithm model comes with the tuning work).
    fn plan(&self, func: Func, bytes: u64, esize: u64) -> Result<Choice> {
        let (algo, proto) = self.selection.choose(func)?;
        if proto == Proto::Ll && self.device.is_cuda() {
            return Err(Error::InvalidUsage(format!(
                "{func}: NCCL_PROTO allows only LL here, and oxccl's LL protocol runs on the CPU target only \
                 so far (its GPU kernels are pending verification on a GPU); allow Simple (e.g. NCCL_PROTO=Simple)"
            )));
        }
        let min = self.params.min_nchannels.unwrap_or(1).min(self.nchannels);
        let nch = (bytes.div_ceil(MIN_BYTES_PER_CHANNEL) as u32).clamp(min, self.nchannels);
        if proto == Proto::Ll {
            // One chunk is one step of lines: 8 data bytes per 16-byte line (NCCL's LL chunk).
            let step_data = self.params.ll_buffsize / FIFO_STEPS / 16 * 8;
            let chunk = (step_data / esize).max(1);
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

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
        match stream {
            Stream::Cuda(s) => s.copy_dtod(dst, src, bytes),
            Stream::Cpu(s) => s.enqueue(move || {
                // SAFETY: the caller of the collective guarantees both ranges (all_reduce_raw).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }),
        }
    }

    fn launch(&self, args: KernelArgs, stream: &Stream) -> Result<()> {
        match (&self.res, stream) {
            (Res::Cuda(res), Stream::Cuda(s)) => {
                let w = &args.work;
                let (Some(func), Some(dtype), Some(op)) = (
                    Func::from_u8(w.func),
                    DataType::from_u8(w.dtype),
                    RedOp::from_u8(w.redop),
                ) else {
                    return Err(Error::Internal("work element with an invalid enum".into()));
                };
                let module = res
                    .ctx
                    .kernel(oxccl_gpu::abi::kernel_name(func, dtype, op).as_str())?;
                s.launch(&module, w.nchannels as u32, self.params.nthreads, &args)?;
                res.last_event.record(s)?;
                res.launched.store(true, Ordering::Release);
                Ok(())
            }
            (Res::Cpu(res), Stream::Cpu(s)) => {
                launch_cpu(args, res.group.clone(), self.rank, s, &self.inflight)
            }
            _ => Err(Error::invalid(
                "stream and communicator are of different backends",
            )),
        }
    }

    fn abort_flag(&self) -> &AtomicU32 {
        let p = match &self.res {
            Res::Cuda(r) => r.group.abort[self.rank].host_ptr() as *const u32,
            Res::Cpu(r) => r.group.abort[r.slot].addr() as *const u32,
        };
        // SAFETY: the flag lives in memory owned by `self.res`, 4-byte aligned, accessed atomically.
        unsafe { AtomicU32::from_ptr(p as *mut u32) }
    }

    /// The abort flags of the other ranks of this process's group (`init_all`); none for
    /// `init_rank`, whose peers live in other processes.
    fn group_abort_flags(&self) -> Vec<&AtomicU32> {
        let ptrs: Vec<*const u32> = match &self.res {
            Res::Cuda(r) => r
                .group
                .abort
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != self.rank)
                .map(|(_, a)| a.host_ptr() as *const u32)
                .collect(),
            Res::Cpu(r) => r
                .group
                .abort
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != r.slot)
                .map(|(_, a)| a.addr() as *const u32)
                .collect(),
        };
        // SAFETY: the flags live in memory owned by the shared group, which `self` keeps alive.
        ptrs.into_iter()
            .map(|p| unsafe { AtomicU32::from_ptr(p as *mut u32) })
            .collect()
    }
}

/// Runs one collective on the CPU target: one host thread per channel, each running the same
/// `run_block` the GPU kernel runs, queued on the CPU stream.
fn launch_cpu(
    args: KernelArgs,
    group: Arc<CpuGroup>,
    rank: usize,
    stream: &CpuStream,
    inflight: &Arc<AtomicUsize>,
) -> Result<()> {
    inflight.fetch_add(1, Ordering::AcqRel);
    let inflight = inflight.clone();
    stream.enqueue(move || {
        let nch = args.work.nchannels as u32;
        let result = std::thread::scope(|s| {
            let handles: Vec<_> = (0..nch)
                .map(|b| {
                    let args = &args;
                    s.spawn(move || {
                        oxccl_gpu::arch::set_block_idx(b);
                        let mut smem = [0u32; oxccl_gpu::abi::KERNEL_SMEM_BYTES / 4];
                        // SAFETY: `args.comm` is this rank's comm block, kept alive by `group`;
                        // the buffers are the caller's (all_reduce_raw contract).
                        unsafe { oxccl_gpu::dispatch::run_block(args, b, 0, 1, smem.as_mut_ptr()) };
                    })
                })
                .collect();
            let mut ok = true;
            for h in handles {
                ok &= h.join().is_ok();
            }
            ok
        });
        drop(group);
        inflight.fetch_sub(1, Ordering::AcqRel);
        if result {
            Ok(())
        } else {
            Err(Error::Internal(format!(
                "rank {rank}: a CPU-target channel trapped"
            )))
        }
    })
}

/// A short tag of a unique id, so segment names of different communicators never collide.
fn id_tag(id: &crate::bootstrap::UniqueId) -> u64 {
    id.to_bytes().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) & 0xffff_ffff
}

/// Builds rank `r`'s communicator block: [`DevComm`], its channels (ring + connections), and the
/// user-rank arrays of each channel's ring.
#[allow(clippy::too_many_arguments)]
fn build_comm_block(
    r: usize,
    nranks: usize,
    nch: u32,
    layout: &ConnLayout,
    conn_base: &[u64],
    block_addr: u64,
    abort_addr: u64,
    params: &Params,
) -> Vec<u8> {
    let nchu = nch as usize;
    let channels_off = size_of::<DevComm>();
    let ranks_off = channels_off + nchu * size_of::<DevChannel>();
    let mut buff_sizes = [0u64; Proto::COUNT];
    buff_sizes[Proto::Simple as usize] = params.buffsize;
    buff_sizes[Proto::Ll as usize] = layout.ll_buffsize;
    let dc = DevComm {
        rank: r as u32,
        nranks: nranks as u32,
        nchannels: nch,
        abort_flag: abort_addr,
        channels: block_addr + channels_off as u64,
        buff_sizes,
        ..DevComm::zeroed()
    };
    let mut out = Vec::with_capacity(comm_block_bytes(nchu, nranks));
    out.extend_from_slice(bytemuck::bytes_of(&dc));
    let (next, prev) = ((r + 1) % nranks, (r + nranks - 1) % nranks);
    for c in 0..nch as u64 {
        let mut send = ConnInfo::zeroed();
        send.buffs[Proto::Simple as usize] = layout.buff(conn_base[next], c);
        if layout.ll_buffsize > 0 {
            send.buffs[Proto::Ll as usize] = layout.ll(conn_base[next], c);
        }
        send.step = params.initial_step;
        send.tail = layout.tail(conn_base[next], c);
        send.head = layout.head(conn_base[r], c);
        let mut recv = ConnInfo::zeroed();
        recv.buffs[Proto::Simple as usize] = layout.buff(conn_base[r], c);
        if layout.ll_buffsize > 0 {
            recv.buffs[Proto::Ll as usize] = layout.ll(conn_base[r], c);
        }
        recv.step = params.initial_step;
        recv.tail = layout.tail(conn_base[r], c);
        recv.head = layout.head(conn_base[prev], c);
        let ch = DevChannel {
            ring: DevRing {
                prev: prev as u32,
                next: next as u32,
                index: r as u32,
                _pad: 0,
                user_ranks: block_addr + (ranks_off + c as usize * nranks * 4) as u64,
            },
            _pad: 0,
            send,
            recv,
        };
        out.extend_from_slice(bytemuck::bytes_of(&ch));
    }
    for _ in 0..nch {
        for k in 0..nranks {
            out.extend_from_slice(&(((r + k) % nranks) as u32).to_ne_bytes());
        }
    }
    out
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("device", &self.device)
            .field("nchannels", &self.nchannels)
            .field("aborted", &self.is_aborted())
            .finish_non_exhaustive()
    }
}

impl Drop for Comm {
    /// Waits (bounded) for this rank's last queued operation, then raises the abort flag so a
    /// kernel still waiting for a peer exits, then frees everything. Never panics.
    fn drop(&mut self) {
        let start = Instant::now();
        match &self.res {
            Res::Cuda(res) => {
                if !res.launched.load(Ordering::Acquire) {
                    return;
                }
                loop {
                    match res.last_event.is_complete() {
                        Ok(true) => return,
                        Ok(false) if start.elapsed() < DROP_WAIT => {
                            std::thread::sleep(Duration::from_millis(1))
                        }
                        Ok(false) => break,
                        Err(e) => {
                            tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: {e}");
                            break;
                        }
                    }
                }
                tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: operations still running after {DROP_WAIT:?}; aborting them");
                self.abort_flag().store(1, Ordering::Release);
                if let Err(e) = res.ctx.synchronize() {
                    tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: {e}");
                }
            }
            Res::Cpu(_) => {
                while self.inflight.load(Ordering::Acquire) > 0 {
                    if start.elapsed() > DROP_WAIT {
                        tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: operations still running after {DROP_WAIT:?}; aborting them");
                        self.abort_flag().store(1, Ordering::Release);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}
