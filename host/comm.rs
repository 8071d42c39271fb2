//! Communicators: creation over local devices, channel and connection setup, and the collective
//! calls (NCCL's `init.cc`, `channel.cc`, `transport/p2p.cc` for the same-process P2P path, and
//! `enqueue.cc`). The communicator block's channels and trees are built in `comm/channel.rs`,
//! the ranks' peer info and the transport of each ring edge come from `comm/peer_info.rs`.
//!
//! `Comm::init_all(devices)` creates one communicator per device in one process (NCCL's
//! `ncclCommInitAll`). Each channel's ring follows the topology's searched ring order (NCCL's
//! graph search, `AllGather3` merge and `setupChannel`: [`crate::graph::connect`]), or rank order
//! where no topology applies. Each rank owns, per channel, a receive buffer of
//! `NCCL_BUFFSIZE` bytes and two step counters (its send connection's head, its receive
//! connection's tail); its ring neighbours write into them directly (P2P write over peer access on
//! CUDA, plain host memory on the CPU target).
use crate::cpu::{CpuStream, HostMem};
use crate::cuda;
use crate::error::{Error, Result};
use crate::graph::{ChannelRings, RankGraphInfo};
use crate::mem::{DevSlice, Device, Stream};
use crate::params::Params;
use crate::redop::ReduceOp;
use crate::tuning::{Selection, TreeShape};
use bytemuck::Zeroable;
use oxccl_gpu::abi::{
    Algo, ConnInfo, DEFAULT_CHUNK_STEPS, DataType, DevChannel, DevComm, DevRedOp, DevRing, DevTree,
    FIFO_STEPS, Func, KernelArgs, MAX_CHANNELS, MAX_TREE_ARITY, PACK_BYTES, PTR_EXCHANGE_OFFSET, Proto,
    REDOP_SCALAR_DEVICE, RedOp, WorkColl,
};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod channel;
mod enqueue;
mod peer_info;
mod rank_trees;
use channel::*;
use peer_info::*;
use enqueue::wait_launches;

/// Default channel count on CUDA devices (overridable with `NCCL_MAX_NCHANNELS`).
pub const CUDA_DEFAULT_NCHANNELS: u32 = 64;
/// Default channel count on the CPU target (each channel is a host thread per rank).
pub const CPU_DEFAULT_NCHANNELS: u32 = 2;
/// Abort-flag values: this rank called abort, or another rank of its process group did.
const ABORTED_HERE: u32 = 1;
const ABORTED_BY_PEER: u32 = 2;
/// How long [`Comm::abort`] waits for in-flight operations to exit.
const ABORT_WAIT: Duration = Duration::from_secs(5);
/// How long [`Comm::abort`] waits for the other ranks of its `init_all` group when they may write
/// into its buffers directly: a running kernel stops within microseconds of its flag; only one
/// queued behind other work takes longer, and that one checks the flag before writing.
const PEER_ABORT_WAIT: Duration = Duration::from_secs(1);
/// How long [`Comm::abort`] on the CPU target waits for a peer's kernel that is running (its
/// flag raised, so it ends at its next wait, after its current copy).
const PEER_RUNNING_WAIT: Duration = Duration::from_secs(10);
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
    /// The double binary tree's connections, when the communicator spans several nodes and they
    /// were set up (`init_rank` ranks on two or more hosts unless `NCCL_ALGO` excludes the tree
    /// on some rank; `init_all` with `OXCCL_TEST_NODES`); `None` otherwise.
    trees: Option<CommTrees>,
    /// Every channel's ring (NCCL's `channel->ring`), shared by the ranks of one `init_all`.
    rings: Arc<ChannelRings>,
    /// Set by [`Comm::finalize`]: later collectives are refused.
    finalized: std::sync::atomic::AtomicBool,
    /// What the rings run over, for the tuning model (the same on every rank).
    fabric: crate::tuning::Fabric,
    /// Bytes of this rank's connection memory (laid out for at least `nchannels` channels).
    conn_bytes: u64,
    /// Whether the ring connections have pointer exchanges ([`Comm::direct_pointer`]).
    direct: bool,
}

enum Res {
    Cuda(CudaRes),
    Cpu(CpuRes),
}

struct CudaRes {
    ctx: Arc<cuda::Context>,
    group: Arc<CudaGroup>,
    launch: Arc<LaunchState>,
    /// `init_all`: the other ranks of the group on this rank's GPU, whose launches this rank's
    /// next launch waits for ([`wait_launches`]); empty for `init_rank`.
    sharing: Vec<usize>,
}

/// A CUDA rank's last launch: an event recorded after its latest kernel, and whether it ever
/// launched. Shared with its `init_all` group, so an abort can wait for the peers' kernels
/// (direct writes land in user buffers, see [`Comm::abort`]).
struct LaunchState {
    last_event: cuda::Event,
    launched: std::sync::atomic::AtomicBool,
    /// Kernels this rank has launched (the group's launch ordering, [`wait_launches`]).
    issued: std::sync::atomic::AtomicU64,
}

impl LaunchState {
    fn new(ctx: &Arc<cuda::Context>) -> Result<Arc<LaunchState>> {
        Ok(Arc::new(LaunchState {
            last_event: cuda::Event::new(ctx)?,
            launched: false.into(),
            issued: 0.into(),
        }))
    }
    /// True when nothing this rank launched is still queued or running.
    fn idle(&self) -> Result<bool> {
        Ok(!self.launched.load(Ordering::Acquire) || self.last_event.is_complete()?)
    }
}

/// Every rank's device memory of one `init_all`, freed when the last rank is dropped: a rank's
/// kernel writes into its neighbours' FIFOs and counters (the receiver's head credit can land after
/// the sender's own kernel has finished), so no rank's memory may go before every rank is done.
struct CudaGroup {
    _comm_mem: Vec<cuda::DevAlloc>,
    _conn_mem: Vec<cuda::DevAlloc>,
    /// `init_all`: every rank's abort flag (empty for `init_rank`, whose flags live in `mp`).
    abort: Vec<cuda::HostMapped>,
    /// `init_all`: every rank's last launch (empty for `init_rank`).
    launches: Vec<Arc<LaunchState>>,
    /// `init_rank`: bootstrap, peer mappings, shared abort page.
    mp: Option<InitRankRes>,
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
    /// `init_all`: every rank's count of queued operations (empty for `init_rank`).
    inflight: Vec<Arc<AtomicUsize>>,
    /// `init_all`: every rank's count of operations whose blocks are running now, a subset of
    /// `inflight` (empty for `init_rank`). A running CPU kernel whose abort flag is raised ends
    /// at its next wait, however long its current copy takes.
    running: Vec<AtomicUsize>,
    /// `init_rank`: this rank's connection memory, shared with its ring neighbours.
    _shm: Vec<crate::cpu::ShmSegment>,
    /// `init_rank`: bootstrap, peer mappings, shared abort page.
    mp: Option<InitRankRes>,
}

/// Layout of one rank's connection memory: per channel a Simple receive buffer, then per channel
/// the counters block (head of the send connection at +0, tail of the receive connection at +128).
struct ConnLayout {
    buffsize: u64,
    ll_buffsize: u64,
    ll128_buffsize: u64,
    nch: u64,
}
impl ConnLayout {
    /// `ll`: whether connections get LL and LL128 buffers (every communicator does today).
    fn new(params: &Params, nch: u32, ll: bool) -> Self {
        ConnLayout {
            buffsize: params.buffsize,
            ll_buffsize: if ll { params.ll_buffsize } else { 0 },
            ll128_buffsize: if ll { params.ll128_buffsize } else { 0 },
            nch: nch as u64,
        }
    }
    fn per_channel(&self) -> u64 {
        self.buffsize + self.ll_buffsize + self.ll128_buffsize
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
    /// The LL128 receive buffer of channel `c` (128-byte aligned: every size is a multiple of 128).
    fn ll128(&self, base: u64, c: u64) -> u64 {
        self.ll(base, c) + self.ll_buffsize
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
            "devices is empty: a communicator needs at least one rank (Device::all_cuda() is empty when no GPU is visible; Device::cpus(n) gives CPU-target ranks)",
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
    /// Rings: on CUDA, each channel's ring is the ring graph searched on this machine's topology
    /// (`NCCL_TOPO_FILE` completed by detection) over the ranks' GPUs, channel `c` on searched
    /// channel `c % count` ([`Comm::ring`] shows it); rank order (0 → 1 → … → 0) when a GPU is
    /// missing from the topology, two ranks share a GPU, or the search fails (debug log). Test
    /// hook: on the CPU target, `NCCL_TOPO_FILE` naming a topology with exactly as many GPUs as
    /// ranks gives CPU rank `r` the file's GPU of rank `r`, so CPU ranks run that machine's rings;
    /// otherwise CPU rings are in rank order.
    ///
    /// Test hook: `OXCCL_TEST_NODES=N` (a divisor of the rank count) splits the ranks into `N`
    /// equal nodes of consecutive ranks, as if on `N` hosts, and sets up the double binary tree
    /// across them (a chain inside each node; channel `c` on tree `c % 2`), so AllReduce may run
    /// (or, with `NCCL_ALGO=tree`, must run) as a tree. Rings are unchanged. On CUDA devices the
    /// tree connections live in device memory and tree neighbours reach each other over peer
    /// access, like ring neighbours (`System` error when it is not supported).
    ///
    /// Ranks sharing a GPU (`OXCCL_ALLOW_SHARED_DEVICE=1`, for testing on one GPU): each rank's
    /// kernel spins until the others' kernels of the same call run, on one GPU whose hardware
    /// queues their streams share. A rank therefore launches call `n + 1` only once every rank
    /// on its GPU has launched call `n`; issue the calls from a thread per rank, or call `n` on
    /// every rank before call `n + 1` on any (NCCL's rule for one thread driving several devices).
    /// Until every rank on the GPU has issued a call, queue nothing else behind it on any of their
    /// streams, and do not allocate, free or copy synchronously on the device: a context-wide
    /// synchronization (which [`DeviceBuffer`](crate::DeviceBuffer)'s allocation and writes do) waits
    /// for the kernel that is waiting for this thread.
    ///
    /// Errors: `InvalidArgument` for an empty or mixed list or a bad environment value
    /// (`NCCL_BUFFSIZE`, `NCCL_NTHREADS`, `NCCL_MAX_NCHANNELS`, `OXCCL_TEST_NODES`, ...), `InvalidUsage` for a
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
        let mut nch = params
            .max_nchannels
            .unwrap_or(default_nch)
            .clamp(1, MAX_CHANNELS as u32);
        let mut layout = ConnLayout::new(&params, nch, true);
        let _span = tracing::debug_span!(target: "oxccl::init", "init_all", nranks, nch).entered();

        if devices[0].is_cuda() {
            let ctxs: Vec<Arc<cuda::Context>> = devices
                .iter()
                .map(|d| match d {
                    Device::Cuda(o) => cuda::Context::get(*o),
                    Device::Cpu(_) => Err(Error::Internal("CPU device in a CUDA communicator".into())),
                })
                .collect::<Result<_>>()?;
            // Ranks sharing a GPU (OXCCL_ALLOW_SHARED_DEVICE=1) spin in kernels that must all be
            // resident at once: at most SMs / ranks-per-GPU channels (one block each) per rank, or
            // blocks waiting for an SM would wait forever for peers that cannot finish.
            let per_gpu = devices
                .iter()
                .map(|d| devices.iter().filter(|e| *e == d).count())
                .max()
                .unwrap_or(1);
            if per_gpu > 1 {
                let sms = ctxs
                    .iter()
                    .map(|c| c.multiprocessor_count())
                    .collect::<Result<Vec<_>>>()?;
                let cap = (sms.into_iter().min().unwrap_or(1) / per_gpu as u32).max(1);
                if nch > cap {
                    tracing::info!(target: "oxccl::init", "{per_gpu} ranks share a GPU: {nch} channels capped to {cap} (SMs per rank)");
                    nch = cap;
                    layout = ConnLayout::new(&params, nch, true);
                }
            }
            // NCCL_TOPO_DUMP_FILE, and this thread near the GPUs' CPUs until init returns.
            let _near = crate::topo::detect::on_cuda_init(0, &ctxs)?;
            // P2P transport, same-process path: every rank writes into its ring neighbours. It is
            // the only transport init_all sets up between GPUs, so a request to avoid P2P cannot
            // be honoured here: refuse it rather than ignore it.
            if nranks > 1
                && let Some((key, v)) = crate::params::env_var("P2P_DISABLE").filter(|(_, v)| v.trim() == "1")
            {
                return Err(Error::InvalidUsage(format!(
                    "{key}={v}: Comm::init_all connects GPUs only by P2P (SHM and NET need one process per \
                     GPU: use Comm::init_rank, e.g. `oxccl perf --procs N`), so it cannot run without P2P"
                )));
            }
            // Every channel's ring from the machine's topology (rank order without one).
            let bus_ids: Vec<String> = ctxs.iter().map(|c| c.bus_id()).collect::<Result<_>>()?;
            let all: Vec<usize> = (0..nranks).collect();
            let rings = Arc::new(comm_rings(
                &vec![node_ring_graph(&all, Some(&bus_ids), 0)?; nranks],
                nranks,
                nch,
            )?);
            for r in 0..nranks {
                for peer in ring_peers(&rings, r) {
                    if ctxs[peer].ordinal == ctxs[r].ordinal {
                        continue;
                    }
                    // NCCL_P2P_LEVEL: as for P2P_DISABLE, P2P is init_all's only transport, so
                    // a level that forbids it between two ring neighbours is refused by name.
                    if let Some(lvl) = params.p2p_level {
                        let path = gpu_path_type(&bus_ids[r], &bus_ids[peer])?;
                        if crate::params::p2p_allowed(Some(lvl), path) == Some(false) {
                            let key = crate::params::env_var("P2P_LEVEL")
                                .map_or_else(|| "NCCL_P2P_LEVEL".to_string(), |(k, _)| k);
                            return Err(Error::InvalidUsage(format!(
                                "{key}={lvl} allows P2P up to {lvl} paths, but rank {r} (CUDA device {}, {}) and \
                                 rank {peer} (CUDA device {}, {}) are {} apart and Comm::init_all connects GPUs \
                                 only by P2P (SHM and NET need one process per GPU: use Comm::init_rank, e.g. \
                                 `oxccl perf --procs N`)",
                                ctxs[r].ordinal,
                                bus_ids[r],
                                ctxs[peer].ordinal,
                                bus_ids[peer],
                                path.map_or("?", |p| p.as_str()),
                            )));
                        }
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
                    &rings,
                );
                let bytes = direct_pointers(bytes, nch, nranks, &params);
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
            // Trees across the test nodes, in device memory; freed with the ring connections.
            let (trees, tree_mem) = match test_nodes(nranks)? {
                Some(nnodes) => setup_cuda_trees(&ctxs, nnodes, nch, &params, &block)?,
                None => (Vec::new(), Vec::new()),
            };
            let dev_comms: Vec<u64> = block.iter().map(|b| b.ptr).collect();
            let launches: Vec<Arc<LaunchState>> =
                ctxs.iter().map(|c| LaunchState::new(c)).collect::<Result<_>>()?;
            let group = Arc::new(CudaGroup {
                _comm_mem: block,
                _conn_mem: conn.into_iter().chain(tree_mem).collect(),
                abort,
                launches: launches.clone(),
                mp: None,
            });
            let mut comms = Vec::with_capacity(nranks);
            for (r, (dev_comm, launch)) in dev_comms.into_iter().zip(launches).enumerate() {
                let ctx = ctxs[r].clone();
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
                        launch,
                        sharing: (0..nranks)
                            .filter(|&p| p != r && devices[p] == devices[r])
                            .collect(),
                    }),
                    inflight: Arc::new(AtomicUsize::new(0)),
                    last: Mutex::new(None),
                    trees: trees.get(r).copied(),
                    rings: rings.clone(),
                    finalized: false.into(),
                    fabric: crate::tuning::Fabric::NvLink,
                    conn_bytes: layout.bytes(),
                    direct: params.p2p_direct && nranks > 1,
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
            // Every channel's ring: rank order, or the rings of NCCL_TOPO_FILE's GPUs (test hook,
            // see node_ring_graph).
            let all: Vec<usize> = (0..nranks).collect();
            let rings = Arc::new(comm_rings(
                &vec![node_ring_graph(&all, None, 0)?; nranks],
                nranks,
                nch,
            )?);
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
                    &rings,
                );
                let bytes = direct_pointers(bytes, nch, nranks, &params);
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
            // Trees across the test nodes: their connection memory and DevTree arrays live as long
            // as the ring connections.
            let (trees, tree_mem) = match test_nodes(nranks)? {
                Some(nnodes) => setup_cpu_trees(nranks, nnodes, nch, &params, &comm_mem)?,
                None => (Vec::new(), Vec::new()),
            };
            let group = Arc::new(CpuGroup {
                comm_mem,
                _conn_mem: conn.into_iter().chain(tree_mem).collect(),
                abort,
                inflight: (0..nranks).map(|_| Arc::new(AtomicUsize::new(0))).collect(),
                running: (0..nranks).map(|_| AtomicUsize::new(0)).collect(),
                _shm: Vec::new(),
                mp: None,
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
                    inflight: group.inflight[r].clone(),
                    last: Mutex::new(None),
                    trees: trees.get(r).copied(),
                    rings: rings.clone(),
                    finalized: false.into(),
                    fabric: crate::tuning::Fabric::Host,
                    conn_bytes: layout.bytes(),
                    direct: params.p2p_direct && nranks > 1,
                })
                .collect())
        }
    }

    /// Creates this process's rank `rank` of an `nranks`-rank communicator whose ranks meet through
    /// the bootstrap of `id` (NCCL's `ncclCommInitRank`; every rank calls it with the same `id`,
    /// usually in its own process, with the same `NCCL_BUFFSIZE`/`NCCL_MAX_NCHANNELS`).
    ///
    /// Peer information (rank, device, PCI bus id, host, process, connection memory) is exchanged
    /// in one bootstrap allgather like the seed's `fillInfo` + AllGather1, then each rank connects
    /// to its two ring neighbours with the transport chosen per peer, P2P then SHM then NET
    /// (`ring_transport`, honouring `NCCL_P2P_DISABLE` / `NCCL_SHM_DISABLE`): P2P between CUDA
    /// devices of one host — the neighbour's pointer over peer access when it lives in this
    /// process, CUDA IPC (`cuIpcOpenMemHandle`) when it lives in another process; SHM on one host
    /// — the receiver's `/dev/shm` segment, on CUDA registered with the driver in both processes
    /// (`cuMemHostRegister`) so kernels use its device mapping; NET otherwise — staging FIFOs in
    /// local memory (pinned, device-mapped on CUDA) that the proxy thread sends over the network.
    /// LL128 is left out on CUDA communicators with SHM or NET connections unless `NCCL_PROTO`
    /// names it (as NCCL's tuning). The abort flags of the ranks of one host share one
    /// `/dev/shm` page, so an [`abort`](Comm::abort) on any rank reaches the kernels of every rank
    /// of its host; ranks on other hosts learn of it through their NET connections (the proxy).
    ///
    /// Errors, the same on every rank in bounded time (the bootstrap timeout): `InvalidArgument`
    /// for `rank` outside `0..nranks` or a corrupt id; `InvalidUsage` for two ranks on the same
    /// device of one host (case C26, naming both ranks and the device / bus id;
    /// `OXCCL_ALLOW_SHARED_DEVICE=1` allows it), for a mix of CUDA and CPU-target devices, or for
    /// ranks that disagree on the channel count or buffer sizes; `System` naming both ranks when
    /// P2P is chosen but refused (no peer access, `NCCL_P2P_LEVEL`), or naming the bytes needed
    /// and the path when `/dev/shm` is too small for SHM connection memory (the other ranks get
    /// `Remote` naming that rank); the network's errors for NET; `Remote`/`Timeout` from the
    /// bootstrap.
    ///
    /// Teardown is collective: destroying or dropping the communicator waits at a bootstrap
    /// barrier (bounded by the bootstrap timeout) until every rank is done with the others'
    /// memory, so ranks in one thread must be created and destroyed from separate threads.
    pub fn init_rank(
        nranks: usize,
        id: &crate::bootstrap::UniqueId,
        rank: usize,
        device: Device,
    ) -> Result<Comm> {
        let result = Self::init_rank_inner(nranks, id, rank, device);
        if result.is_err() {
            // Names this rank created and had not unlinked yet (absent ones are fine).
            let prefix = format!("/dev/shm/oxccl-{:08x}-{}", id_tag(id), std::process::id());
            let _ = std::fs::remove_file(format!("{prefix}-r{rank}"));
            let _ = std::fs::remove_file(format!("{prefix}-r{rank}-abort"));
            let _ = std::fs::remove_file(format!("{prefix}-r{rank}-tree"));
        }
        result
    }

    fn init_rank_inner(
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
        let is_cuda = device.is_cuda();
        let phases = InitPhases::start(rank);
        // The rank's own settings and device. A failure here still joins the bootstrap and
        // sends its error in the first all-gather, so every rank fails at once naming this rank
        // (a rank leaving before the bootstrap left the others waiting out its timeout, with an
        // error about the bootstrap ring rather than the cause).
        let local = (|| -> Result<_> {
            let mut params = Params::from_env()?;
            if is_cuda && params.nthreads > cuda::MAX_JIT_THREADS {
                tracing::warn!(target: "oxccl::init", "NCCL_NTHREADS={} rounded down to {} (the most threads per block the kernels are built for)", params.nthreads, cuda::MAX_JIT_THREADS);
                params.nthreads = cuda::MAX_JIT_THREADS;
            }
            let selection = Selection::from_env()?;
            let ctx = match device {
                Device::Cuda(o) => Some(cuda::Context::get(o)?),
                Device::Cpu(_) => None,
            };
            // NCCL_TOPO_DUMP_FILE, and this thread (so the helper threads it starts) near the GPU.
            let near = crate::topo::detect::on_cuda_init(rank, ctx.as_slice())?;
            Ok((params, selection, ctx, near))
        })();
        phases.mark("settings, device context and topology hook");
        let bootstrap = crate::bootstrap::Bootstrap::init(id, rank, nranks)?;
        phases.mark("bootstrap ring");
        let ((params, mut selection, ctx, _near), all) = allgather_checked(
            &bootstrap,
            rank,
            local,
            |(p, s, _, _)| plan_settings(p, s),
            "cannot initialize (its settings or device)",
        )?;
        check_plan_settings(rank, &all)?;
        let default_nch = if is_cuda {
            CUDA_DEFAULT_NCHANNELS
        } else {
            CPU_DEFAULT_NCHANNELS
        };
        let nch = params
            .max_nchannels
            .unwrap_or(default_nch)
            .clamp(1, MAX_CHANNELS as u32);
        let layout = ConnLayout::new(&params, nch, true);
        let _span = tracing::debug_span!(target: "oxccl::init", "init_rank", rank, nranks, nch).entered();
        // Names after the id and the creating process: unique among live processes.
        let prefix = format!("oxccl-{:08x}-{}", id_tag(id), std::process::id());
        let own_name = format!("{prefix}-r{rank}");
        let own = OwnConn::alloc(ctx.as_ref(), &layout, &own_name, params.initial_step)?;
        // The shared abort page is per host (a rank cannot map another host's /dev/shm): every
        // rank offers one, and the ranks of a host use that of its lowest rank (the others drop
        // theirs once the peers are known).
        let page_bytes = nranks * ABORT_LINE_BYTES;
        let page_name = format!("{own_name}-abort");
        let created_page = crate::cpu::ShmSegment::create(&page_name, page_bytes)?;
        let me = PeerInfo::local(
            device,
            ctx.as_deref(),
            nch,
            layout.bytes(),
            own.desc(&own_name)?,
            own_name.clone(),
            page_name,
            params.p2p_level,
        )?;
        let mut peers: Vec<PeerInfo> = bootstrap
            .allgather(me.encode().as_bytes())?
            .iter()
            .enumerate()
            .map(|(r, b)| PeerInfo::decode(r, b))
            .collect::<Result<_>>()?;
        check_peers(rank, &peers)?;
        exchange_p2p_denied(rank, &mut peers, &bootstrap, p2p_path_type)?;
        phases.mark("connection memory and peer all-gather");
        // The rings (NCCL's AllGather3 + connectRings): each rank's node graph travels in a second
        // all-gather. A rank connects to the next and previous rank of every channel's ring, each
        // over its own transport (rings that differ per channel may mix P2P, SHM and NET).
        let rings = {
            let hosts: Vec<&str> = {
                let mut h: Vec<&str> = Vec::new();
                for p in &peers {
                    if !h.contains(&p.host.as_str()) {
                        h.push(p.host.as_str());
                    }
                }
                h
            };
            let node = hosts.iter().position(|h| *h == peers[rank].host).unwrap_or(0);
            let node_ranks: Vec<usize> = (0..nranks)
                .filter(|&r| peers[r].host == peers[rank].host)
                .collect();
            let bus: Vec<String> = node_ranks.iter().map(|&r| peers[r].bus_id.clone()).collect();
            // A rank whose topology file fails sends its error instead, so every rank fails
            // naming it (rather than waiting in this all-gather for the bootstrap timeout).
            let (_, all) = allgather_checked(
                &bootstrap,
                rank,
                node_ring_graph(&node_ranks, is_cuda.then_some(bus.as_slice()), node),
                |m| m.as_ref().map_or(String::new(), |i| i.encode()),
                "cannot build its ring graph from its topology",
            )?;
            let infos: Vec<Option<RankGraphInfo>> = all
                .iter()
                .map(|b| {
                    (!b.is_empty())
                        .then(|| RankGraphInfo::decode(&String::from_utf8_lossy(b)))
                        .transpose()
                })
                .collect::<Result<_>>()?;
            let hosts: Vec<&str> = peers.iter().map(|p| p.host.as_str()).collect();
            comm_rings(&infos, nranks, nch)?.grouped_by_host(&hosts)?
        };
        // The tuning model's fabric, from every ring pair of every channel (so all ranks agree).
        let fabric = if is_cuda {
            crate::tuning::Fabric::of_gpu_rings(
                (0..rings.nchannels())
                    .flat_map(|c| (0..nranks).map(move |a| (c, a)))
                    .map(|(c, a)| ring_transport(&peers, a, rings.next(c, a))),
            )
        } else {
            crate::tuning::Fabric::Host
        };
        // Channels no call would use are not connected (over NET each costs two proxied socket
        // connections with their threads). The connection memory keeps its layout of
        // `layout.nch` channels; only the first `nch` are set up and used.
        let nch = crate::tuning::Model::for_fabric(fabric).connected_channels(nch, params.min_nchannels);
        let rings = Arc::new(rings.first_channels(nch as usize));
        phases.mark("ring search and all-gather");
        let leader = peers
            .iter()
            .position(|p| p.host == peers[rank].host)
            .unwrap_or(rank);
        let page = if leader == rank {
            created_page
        } else {
            if let Err(e) = created_page.unlink() {
                tracing::warn!(target: "oxccl::init", "{e}");
            }
            drop(created_page);
            let name = &peers[leader].abort_page;
            // Gone: the leader failed or exited after the all-gather (on its own error, which
            // names the cause) before this rank got here; say so rather than "no such file".
            crate::cpu::ShmSegment::open(name, page_bytes).map_err(|e| {
                if std::path::Path::new("/dev/shm").join(name).exists() {
                    e
                } else {
                    Error::Remote(format!(
                        "rank {rank}: rank {leader} left init before this rank mapped its abort page \
                         (rank {leader}'s own error names the cause): {e}"
                    ))
                }
            })?
        };
        use crate::transport::TransportKind;
        // Per channel, the transports of the send (next) and receive (prev) neighbours (the rings
        // may differ per channel, and so the transports), and every transport in use here.
        let chan_kinds: Vec<[TransportKind; 2]> = (0..nch as usize)
            .map(|c| {
                [
                    ring_transport(&peers, rank, rings.next(c, rank)),
                    ring_transport(&peers, rank, rings.prev(c, rank)),
                ]
            })
            .collect();
        let kinds: Vec<TransportKind> = chan_kinds.iter().flatten().copied().collect();
        // CUDA: the connection memory a SHM or NET neighbour (or its proxy) writes is host memory
        // that the kernels reach through its device mapping. The NET block is made here (the
        // proxy fills it), the SHM segment after connect_net.
        let mut host_conns = HostConns::default();
        if let Some(ctx) = &ctx
            && kinds.contains(&TransportKind::Net)
        {
            let m = cuda::HostMapped::zeroed(ctx, layout.bytes() as usize)?;
            for c in 0..layout.nch {
                let base = m.host_ptr() as u64;
                for at in [layout.head(base, c), layout.tail(base, c)] {
                    // SAFETY: the counters lie inside the fresh block; no one else uses it yet.
                    unsafe { (at as *mut u64).write(params.initial_step) };
                }
            }
            host_conns.net = Some(m);
        }
        // Connection memory as the kernels address it (`conn_base`) and as the proxy does
        // (`conn_host`, host addresses); the same on the CPU target.
        let mut conn_base = vec![0u64; nranks];
        conn_base[rank] = own.base();
        let mut conn_host = vec![0u64; nranks];
        conn_host[rank] = host_conns
            .net
            .as_ref()
            .map_or(own.base(), |m| m.host_ptr() as u64);
        let mut links = Vec::new();
        // Where a proxy raises a failed NET connection: this rank's line of the host's abort page
        // (flag, then who raised it) and the host's other ranks' lines.
        let proxy_abort = crate::transport::ProxyAbort {
            flag: page.addr() + (rank * ABORT_LINE_BYTES) as u64,
            who: page.addr() + (rank * ABORT_LINE_BYTES) as u64 + 4,
            host_lines: (0..nranks)
                .filter(|&r| r != rank && peers[r].host == peers[rank].host)
                .map(|r| page.addr() + (r * ABORT_LINE_BYTES) as u64)
                .collect(),
        };
        // NET neighbours (other hosts, or NCCL_SHM_DISABLE=1): local staging FIFOs and the proxy.
        // SAFETY: our connection memory and abort line outlive `links`, which holds the NET
        // resources and is dropped first at teardown (and on every error return).
        if let Some(net) = unsafe {
            crate::transport::connect_net(
                &crate::transport::RingSetup {
                    bootstrap: &bootstrap,
                    rank,
                    nranks,
                    ring: &|c, q| (rings.next(c as usize, q), rings.prev(c as usize, q)),
                    device,
                    ctx: ctx.as_deref(),
                    hosts: &peers.iter().map(|p| p.host.clone()).collect::<Vec<_>>(),
                    nch,
                    block_bytes: layout.bytes() as usize,
                    fifo: &|b, c| crate::transport::FifoAddrs {
                        simple: layout.buff(b, c),
                        ll: layout.ll(b, c),
                        ll128: layout.ll128(b, c),
                        head: layout.head(b, c),
                        tail: layout.tail(b, c),
                    },
                    buffsize: params.buffsize,
                    ll_buffsize: layout.ll_buffsize,
                    ll128_buffsize: layout.ll128_buffsize,
                    initial_step: params.initial_step,
                    abort_flag: proxy_abort.flag,
                    abort_who: proxy_abort.who,
                    host_abort_lines: proxy_abort.host_lines.clone(),
                },
                &mut conn_host,
            )?
        } {
            for peer in ring_peers(&rings, rank) {
                if let Some(b) = net.kernel_base(peer) {
                    conn_base[peer] = b;
                }
            }
            links.push(PeerLink::Net { _held: net });
        }
        let ring_pairs = (0..nch as usize)
            .flat_map(|c| [rings.next(c, rank), rings.prev(c, rank)])
            .zip(kinds.iter().copied());
        for (peer, kind) in ring_pairs {
            if peer != rank && (kind == TransportKind::Net) != (conn_base[peer] != 0) {
                return Err(Error::Internal(format!(
                    "rank {rank}: init chose {kind} for ring neighbour {peer} but the NET setup disagrees"
                )));
            }
        }
        // CUDA SHM: each rank whose neighbour uses SHM creates its segment, and every rank learns
        // whether all of them exist before any maps one (so all fail alike, naming the rank).
        if (0..nranks).any(|a| {
            peers[a].cuda
                && (0..nch as usize)
                    .any(|c| ring_transport(&peers, a, rings.next(c, a)) == TransportKind::Shm)
        }) {
            let made = match &ctx {
                Some(ctx) if kinds.contains(&TransportKind::Shm) => {
                    RegisteredShm::create(ctx, &own_name, &layout, params.initial_step).map(Some)
                }
                _ => Ok(None),
            };
            let status = made.as_ref().err().map_or(String::new(), |e| e.to_string());
            let all = bootstrap.allgather(status.as_bytes())?;
            host_conns.shm = made?;
            if let Some((r, why)) = all.iter().enumerate().find(|(_, b)| !b.is_empty()) {
                return Err(Error::Remote(format!(
                    "rank {rank}: rank {r} cannot create its SHM connection memory: {}",
                    String::from_utf8_lossy(why)
                )));
            }
        }
        // Every ring neighbour of every channel (one next and one prev unless the rings differ
        // per channel, in which case all use one transport, see above).
        let mut neighbours: Vec<(usize, TransportKind)> = Vec::new();
        for c in 0..nch as usize {
            for peer in [rings.next(c, rank), rings.prev(c, rank)] {
                if !neighbours.iter().any(|&(p, _)| p == peer) {
                    neighbours.push((peer, ring_transport(&peers, rank, peer)));
                }
            }
        }
        for (peer, kind) in neighbours {
            if conn_base[peer] == 0 {
                let target = PeerMem {
                    desc: &peers[peer].conn,
                    shm_name: &peers[peer].shm_name,
                    bytes: layout.bytes() as usize,
                };
                let link =
                    PeerLink::connect(rank, &peers, peer, kind, ctx.as_ref(), target, params.p2p_level)?;
                conn_base[peer] = link.base();
                links.push(link);
            }
        }
        // The trees, on communicators spanning hosts (every rank takes part, or none).
        let trees = rank_trees::setup(&rank_trees::TreeSetup {
            bootstrap: &bootstrap,
            rank,
            peers: &peers,
            rings: &rings,
            nch,
            params: &params,
            ctx: ctx.as_ref(),
            device,
            wanted: selection.algos.0[Algo::Tree as usize],
            shm_name: peers[rank].tree_shm_name(),
            abort: proxy_abort,
        })?;
        let (tree_mem, comm_trees, tree_array, tree_host_path) = match trees {
            Some(mut t) => {
                links.append(&mut t.links);
                let ct = CommTrees {
                    shape: t.shape,
                    bytes: t.bytes,
                };
                (t.mem, Some(ct), t.array, t.host_path)
            }
            None => (Vec::new(), None, 0, false),
        };
        // This rank's own connection memory as its kernels address it, per direction (send: the
        // head counters next writes; receive: the FIFOs prev writes).
        let mut own_split = vec![[0u64; 2]; nch as usize];
        for (split, ck) in own_split.iter_mut().zip(&chan_kinds) {
            for (at, &kind) in split.iter_mut().zip(ck) {
                *at = match (&own, kind) {
                    (OwnConn::Shm(s), _) => s.addr(),
                    (OwnConn::Dev(m), TransportKind::P2p) => m.ptr,
                    (OwnConn::Dev(_), TransportKind::Shm) => {
                        host_conns.shm.as_ref().map_or(0, |m| m.dev_base())
                    }
                    (OwnConn::Dev(_), TransportKind::Net) => {
                        host_conns.net.as_ref().map_or(0, |m| m.dev_ptr())
                    }
                };
                if *at == 0 {
                    return Err(Error::Internal(format!(
                        "rank {rank}: no connection memory for its {kind} neighbour"
                    )));
                }
            }
        }
        // LL128 trusts a 128-byte line to arrive whole, which NVLink gives and host memory (SHM,
        // NET without GPUDirect) does not: a GPU's line can land in two halves, the flag's first
        // (seen on H200: tree LL128 over NET, 64 bytes of a line wrong). So on GPUs whose ring or
        // tree connections go through host memory LL128 is off, also when NCCL_PROTO names it
        // (NCCL then runs it at the risk of silent corruption; oxccl does not). Decided from
        // every pair, and NCCL_PROTO agrees on every rank, so all ranks agree.
        let host_path = tree_host_path
            || (0..nranks).any(|a| {
                peers[a].cuda
                    && (0..nch as usize)
                        .any(|c| ring_transport(&peers, a, rings.next(c, a)) != TransportKind::P2p)
            });
        if host_path && selection.protos.0[Proto::Ll128 as usize] {
            let mut protos = selection.protos.0;
            protos[Proto::Ll128 as usize] = false;
            let (var, value) =
                crate::params::env_var("PROTO").unwrap_or(("NCCL_PROTO".into(), String::new()));
            if !protos.iter().any(|&b| b) {
                return Err(Error::invalid(format!(
                    "{var}={value:?}: LL128 cannot run on this communicator: its GPU connections go \
                     through host memory (SHM or NET), where 128-byte lines can arrive torn \
                     (accepted here: LL, Simple)"
                )));
            }
            selection.protos.0 = protos;
            if ll128_forced() {
                tracing::warn!(target: "oxccl::init", rank, "{var}={value:?} names LL128, which is off on this communicator: its GPU connections go through host memory (SHM/NET), where 128-byte lines can arrive torn");
            } else {
                tracing::info!(target: "oxccl::init", rank, "LL128 off: GPU connections through host memory (SHM/NET)");
            }
        }
        phases.mark("connections (P2P/SHM/NET)");
        // Every rank has mapped what it needs: the names can go (the mappings stay).
        bootstrap.barrier()?;
        let unlinked = match &own {
            OwnConn::Shm(s) => s.unlink(),
            OwnConn::Dev(_) => Ok(()),
        }
        .and(host_conns.shm.as_ref().map_or(Ok(()), |m| m.seg.unlink()))
        .and(rank_trees::unlink(&tree_mem));
        if let Err(e) = unlinked.and(if rank == leader { page.unlink() } else { Ok(()) }) {
            tracing::warn!(target: "oxccl::init", "{e}");
        }
        let abort = SharedAbort::new(page, rank, nranks, ctx.as_ref())?;
        let abort_dev = abort.dev_flag;
        let uses_dev = kinds.contains(&TransportKind::P2p);
        // Per channel, the kernel's address of the NET staging block its send connection writes.
        let net_staging: Vec<Option<u64>> = (0..nch as usize)
            .map(|c| (chan_kinds[c][0] == TransportKind::Net).then(|| conn_base[rings.next(c, rank)]))
            .collect();
        // The host's ranks in other processes: their death raises this host's flags.
        let me = &peers[rank];
        let host_ranks = (0..nranks).filter(|&r| r != rank && peers[r].host == me.host);
        let watch = crate::liveness::Watch {
            rank,
            own_flag: abort.own_flag(),
            own_line: abort.line(rank),
            host_lines: host_ranks.clone().map(|r| abort.line(r)).collect(),
            peers: host_ranks
                .filter(|&r| peers[r].pid != me.pid && peers[r].start_time != 0)
                .map(|r| (r, peers[r].pid, peers[r].start_time))
                .collect(),
        };
        // SAFETY: the flags and lines are in `abort`'s page (or its private flag), which
        // `InitRankRes` keeps until after the watch (field order).
        let watched = unsafe { crate::liveness::watch(watch) };
        let mp = InitRankRes {
            rank,
            peers,
            links: Mutex::new(links),
            _host_conns: host_conns,
            _tree_mem: tree_mem,
            watched: Mutex::new(watched),
            abort,
            synced: std::sync::atomic::AtomicBool::new(false),
            bootstrap,
        };
        let block_bytes = comm_block_bytes(nch as usize, nranks);
        let (dev_comm, res) = match (own, ctx) {
            (OwnConn::Shm(seg), None) => {
                let comm_mem = HostMem::zeroed(block_bytes)?;
                let mut bytes = build_comm_block(
                    rank,
                    nranks,
                    nch,
                    &layout,
                    &conn_base,
                    comm_mem.addr(),
                    abort_dev,
                    &params,
                    &rings,
                );
                net_step_sizes(&mut bytes, &layout, &net_staging);
                set_trees(&mut bytes, tree_array);
                // SAFETY: the block was allocated with exactly this size; nothing else uses it yet.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), comm_mem.addr() as *mut u8, bytes.len())
                };
                let dev_comm = comm_mem.addr();
                let group = Arc::new(CpuGroup {
                    comm_mem: vec![comm_mem],
                    _conn_mem: Vec::new(),
                    abort: Vec::new(),
                    inflight: Vec::new(),
                    running: Vec::new(),
                    _shm: vec![seg],
                    mp: Some(mp),
                });
                (dev_comm, Res::Cpu(CpuRes { group, slot: 0 }))
            }
            (OwnConn::Dev(mem), Some(ctx)) => {
                let block = cuda::DevAlloc::zeroed(&ctx, block_bytes)?;
                let mut bytes = build_comm_block_split(
                    rank, nranks, nch, &layout, &conn_base, &own_split, block.ptr, abort_dev, &params, &rings,
                );
                net_step_sizes(&mut bytes, &layout, &net_staging);
                set_trees(&mut bytes, tree_array);
                block.write(0, &bytes)?;
                let dev_comm = block.ptr;
                let launch = LaunchState::new(&ctx)?;
                let group = Arc::new(CudaGroup {
                    _comm_mem: vec![block],
                    // Without a P2P neighbour no one maps the device block: freed now.
                    _conn_mem: if uses_dev { vec![mem] } else { Vec::new() },
                    abort: Vec::new(),
                    launches: Vec::new(),
                    mp: Some(mp),
                });
                (
                    dev_comm,
                    Res::Cuda(CudaRes {
                        ctx,
                        group,
                        launch,
                        sharing: Vec::new(),
                    }),
                )
            }
            _ => return Err(Error::Internal("connection memory of the wrong kind".into())),
        };
        phases.mark("barrier and device block");
        tracing::debug!(target: "oxccl::init", rank, nranks, nch, cuda = is_cuda, total_ms = phases.total_ms(), "init_rank communicator ready");
        Ok(Comm {
            rank,
            nranks,
            device,
            params,
            selection,
            nchannels: nch,
            dev_comm,
            res,
            inflight: Arc::new(AtomicUsize::new(0)),
            last: Mutex::new(None),
            trees: comm_trees,
            rings,
            finalized: std::sync::atomic::AtomicBool::new(false),
            fabric,
            conn_bytes: layout.bytes(),
            direct: false,
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
    /// Channel `channel`'s ring as this rank's kernels walk it, starting at this rank: NCCL's
    /// `channel->ring.userRanks` (`userRanks[k]` is `k` hops downstream; `[1]` is `ring.next`).
    /// Rank order (`rank, rank + 1, …`) unless the rings follow a topology (see
    /// [`Comm::init_all`]). `None` for `channel` outside `0..nchannels()`.
    pub fn ring(&self, channel: usize) -> Option<Vec<usize>> {
        (channel < self.rings.nchannels()).then(|| self.rings.user_ranks(channel, self.rank))
    }
    /// Whether this rank's ring connections write straight into the receiver's output (NCCL's
    /// "P2P/direct pointer"): the ranks of a `Comm::init_all` share one address space, so a
    /// Broadcast, AllGather or AllReduce on the Simple protocol stores each hop's data in the
    /// next rank's output instead of its FIFO, saving the receiver a copy. False for one rank,
    /// for `Comm::init_rank` and with `NCCL_P2P_DIRECT_DISABLE=1`.
    ///
    /// On GPUs the next rank's buffers must be reachable from this rank's device: true of
    /// `cuMemAlloc`/`cudaMalloc` memory once init_all has enabled peer access, not of `cuMemCreate`
    /// memory mapped for one device only (set `NCCL_P2P_DIRECT_DISABLE=1` for such buffers, as
    /// with NCCL).
    pub fn direct_pointer(&self) -> bool {
        self.direct
    }
    /// The parameters this communicator was created with.
    pub fn params(&self) -> &Params {
        &self.params
    }
    /// Device memory used by this rank's connections and communicator state, in bytes.
    pub fn device_memory_bytes(&self) -> u64 {
        self.conn_bytes
            + comm_block_bytes(self.nchannels as usize, self.nranks) as u64
            + self.trees.map_or(0, |t| t.bytes)
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
        if let Some(mp) = self.init_rank_res() {
            mp.abort.raise_peers();
        }
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

    /// Sets `DevComm::aborted` in every comm block of this rank's `init_all` group (all their
    /// abort flags are raised already), so a kernel of any rank that starts from now on writes
    /// nothing into another rank's output: it reads that word before its first direct write.
    /// Returns once the words have landed (on GPUs through a stream of their own, while kernels
    /// run). Never fails: an error is logged (the kernel's spin loops still see the host flag).
    fn mark_group_aborted(&self) {
        let at = std::mem::offset_of!(DevComm, aborted);
        match &self.res {
            Res::Cuda(r) => {
                for (i, block) in r.group._comm_mem.iter().enumerate() {
                    if let Err(e) = block.write_beside(at, &1u32.to_ne_bytes()) {
                        tracing::warn!(target: "oxccl::init", rank = self.rank, peer = i, "abort: marking rank {i}'s comm block: {e}");
                    }
                }
            }
            Res::Cpu(r) => {
                for m in &r.group.comm_mem {
                    // SAFETY: the comm block lives as long as the group, which `self` keeps
                    // alive; the word is 4-byte aligned (DevComm is 8-aligned) and kernels only
                    // load it.
                    unsafe { AtomicU32::from_ptr((m.addr() as usize + at) as *mut u32) }
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
    fn wait_peers_after_abort(&self, start: Instant) {
        let me = self.rank;
        let peers_idle = || -> bool {
            match &self.res {
                Res::Cuda(r) => r.group.launches.iter().enumerate().filter(|(i, _)| *i != me).all(|(i, l)| {
                    l.idle().unwrap_or_else(|e| {
                        tracing::debug!(target: "oxccl::init", rank = me, peer = i, "abort: peer state unknown: {e}");
                        true
                    })
                }),
                Res::Cpu(r) => r
                    .group
                    .inflight
                    .iter()
                    .enumerate()
                    .all(|(i, n)| i == r.slot || n.load(Ordering::Acquire) == 0),
            }
        };
        // CPU target: a peer's kernel that is running (not only queued) ends at its next wait,
        // but its current copy may take far longer on host threads than on a GPU (a 128 MiB
        // slice): wait for it too, up to PEER_RUNNING_WAIT.
        let peers_running = || -> bool {
            match &self.res {
                Res::Cuda(_) => false,
                Res::Cpu(r) => r
                    .group
                    .running
                    .iter()
                    .enumerate()
                    .any(|(i, n)| i != r.slot && n.load(Ordering::Acquire) != 0),
            }
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

    /// True when this rank has no queued operation left.
    fn idle(&self) -> Result<bool> {
        Ok(match &self.res {
            Res::Cuda(res) => res.launch.idle()?,
            Res::Cpu(_) => self.inflight.load(Ordering::Acquire) == 0,
        })
    }

    /// Waits up to `limit` for this rank's queued operations; `Ok(false)` when some still run.
    fn wait_idle(&self, limit: Duration) -> Result<bool> {
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
    pub fn destroy(self) -> Result<()> {
        if !self.wait_idle(DROP_WAIT)? {
            self.abort()?;
            return Err(Error::Timeout(format!(
                "rank {}: destroy waited {DROP_WAIT:?} for queued operations and aborted them",
                self.rank
            )));
        }
        match self.init_rank_res() {
            Some(mp) => mp.sync_teardown(),
            None => Ok(()),
        }
    }

    /// Finishes this rank's part of the communicator (NCCL's `ncclCommFinalize`): waits for its
    /// queued operations (up to 10 s: `Timeout` then, without aborting), then — for
    /// [`Comm::init_rank`] communicators — closes its mappings of its neighbours' memory and waits
    /// at a bootstrap barrier until every rank has finalized too (bounded by the bootstrap
    /// timeout). Afterwards collectives are refused with `InvalidUsage` and
    /// [`destroy`](Comm::destroy) is purely local. Calling it again returns `Ok` at once.
    pub fn finalize(&self) -> Result<()> {
        if self.finalized.load(Ordering::Acquire) {
            return Ok(());
        }
        if !self.wait_idle(DROP_WAIT)? {
            return Err(Error::Timeout(format!(
                "rank {}: finalize waited {DROP_WAIT:?} for queued operations; abort to stop them",
                self.rank
            )));
        }
        self.finalized.store(true, Ordering::Release);
        match self.init_rank_res() {
            Some(mp) => mp.sync_teardown(),
            None => Ok(()),
        }
    }

    /// The error this communicator has met outside any call (NCCL's `ncclCommGetAsyncError`):
    /// `Ok(())` while healthy; `Remote` once another rank aborted (naming it when known) or, for
    /// [`Comm::init_rank`], once a peer process of this host has exited before teardown
    /// ([`Comm::finalize`]); `InvalidUsage` after this rank's own abort; `Cuda` when a kernel of
    /// this rank failed. Cheap enough to poll while waiting for a stream. After an error,
    /// [`abort`](Comm::abort) the communicator.
    pub fn get_async_error(&self) -> Result<()> {
        match self.flag_state() {
            0 => {}
            ABORTED_BY_PEER => {
                let who = match self.init_rank_res().and_then(|mp| mp.abort.raised_by_peer()) {
                    Some(r) => format!("rank {r}"),
                    None => "another rank".to_string(),
                };
                return Err(Error::Remote(format!(
                    "rank {}: {who} of this communicator aborted; abort or destroy this rank too",
                    self.rank
                )));
            }
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
            res.launch.last_event.is_complete()?;
        }
        match self.init_rank_res() {
            // After teardown (finalize) peers exit when they like.
            Some(mp) if !mp.synced.load(Ordering::Acquire) => mp.check_peers_alive(),
            _ => Ok(()),
        }
    }

    /// The abort state: 0, [`ABORTED_HERE`] or [`ABORTED_BY_PEER`] (also when a peer raised this
    /// rank's shared line while its kernels poll a private flag).
    fn flag_state(&self) -> u32 {
        let v = self.abort_flag().load(Ordering::Acquire);
        if v == 0
            && let Some(mp) = self.init_rank_res()
            && mp.abort.raised_by_peer().is_some()
        {
            return ABORTED_BY_PEER;
        }
        v
    }

    /// Number of ranks (NCCL's `ncclCommCount`; the same as [`Comm::nranks`]).
    pub fn count(&self) -> usize {
        self.nranks
    }

    /// This rank (NCCL's `ncclCommUserRank`; the same as [`Comm::rank`]).
    pub fn user_rank(&self) -> usize {
        self.rank
    }

    /// The CUDA device ordinal of this rank (NCCL's `ncclCommCuDevice`). Errors: `InvalidUsage`
    /// for a CPU-target rank.
    pub fn cu_device(&self) -> Result<usize> {
        match self.device {
            Device::Cuda(o) => Ok(o),
            Device::Cpu(i) => Err(Error::InvalidUsage(format!(
                "rank {} is on CPU-target device {i}, not on a CUDA device",
                self.rank
            ))),
        }
    }

    /// True once [`Comm::finalize`] has returned successfully or started its barrier.
    pub fn is_finalized(&self) -> bool {
        self.finalized.load(Ordering::Acquire)
    }

    /// True once [`Comm::abort`] was called (or dropping raised the abort flag).
    pub fn is_aborted(&self) -> bool {
        self.flag_state() != 0
    }

    /// The plan of the most recent collective call on this communicator.
    pub fn last_choice(&self) -> Option<Choice> {
        self.last.lock().ok().and_then(|g| *g)
    }

    /// The plan a call of `func` over `count` elements of `dtype` (the count argument of that
    /// call: per rank for AllGather/ReduceScatter) would get now, without running it: algorithm,
    /// protocol, channels, chunk and slice as [`Comm::last_choice`] reports after the call. `None`
    /// when no protocol would run (`count == 0`, or one rank, where every collective is a copy).
    /// Errors: as the call's own checks of `count` and of `NCCL_PROTO`/`NCCL_ALGO`.
    pub fn choice_for(&self, func: Func, count: usize, dtype: DataType) -> Result<Option<Choice>> {
        let (_, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        if count == 0 || self.nranks == 1 {
            return Ok(None);
        }
        let esize = dtype.size() as u64;
        self.plan(func, self.call_bytes(func, count, recv_bytes, esize), esize)
            .map(Some)
    }

    /// The size the tuning model sees for a call (nccl-tests' size: the larger of the per-rank
    /// send and receive buffers, times the rank count for AllGather/ReduceScatter), bytes.
    fn call_bytes(&self, func: Func, count: usize, recv_bytes: u64, esize: u64) -> u64 {
        let per_rank = recv_bytes.max(count as u64 * esize);
        match func {
            Func::AllGather | Func::ReduceScatter => per_rank * self.nranks as u64,
            _ => per_rank,
        }
    }

    /// Reduces (`op`) `count` elements of `dtype` across all ranks; every rank gets the result in
    /// `recv` (NCCL's `ncclAllReduce`). `send` and `recv` hold at least `count × dtype.size()` bytes
    /// on this rank's device and may be the same range (in place) but must not partly overlap.
    /// Queued on `stream` (on this rank's device); returns at once. Results are bitwise identical on
    /// every rank. `count == 0` is a no-op. `op` is a [`RedOp`] or a [`ReduceOp`] (PreMulSum, whose
    /// scalar must have `dtype`'s type: otherwise InvalidArgument). Buffers must be aligned to the
    /// element size.
    pub fn all_reduce<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::AllReduce,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            op.into(),
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
            RedOp::Sum.into(),
            root,
            stream,
        )
    }

    /// Reduces (`op`) `count` elements of `dtype` across all ranks into `recv` on rank `root`
    /// (NCCL's `ncclReduce`). `recv` is written on the root only (others may pass `None` and are
    /// never written). Errors as for [`Comm::broadcast`]; `op` as for [`Comm::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: Option<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::Reduce,
            Some(send.into()),
            recv,
            count,
            dtype,
            op.into(),
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
            RedOp::Sum.into(),
            0,
            stream,
        )
    }

    /// Reduces (`op`) `nranks × count` elements of `dtype` across ranks and leaves block `r` (the
    /// `count` elements at `r × count`) in `recv` on rank `r` (NCCL's `ncclReduceScatter`). In place
    /// when `recv` is exactly this rank's block of `send`; any other overlap is an error. `op` as for
    /// [`Comm::all_reduce`].
    pub fn reduce_scatter<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::ReduceScatter,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            op.into(),
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
        op: ReduceOp<'_>,
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
                    if need && s.addr() % dtype.size() as u64 != 0 {
                        return Err(Error::invalid(format!(
                            "{name} at {:#x} on rank {} is not aligned to the {}-byte size of {}",
                            s.addr(),
                            self.rank,
                            dtype.size(),
                            dtype.name()
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
                // Not NCCL's in-place form (e.g. a ReduceScatter with recvbuff == sendbuff on a
                // rank other than 0): the output would overwrite input still to be read. Refused
                // (case C05). Staging the input in a copy instead would need a stream-ordered
                // allocation, which can wait for the device while a peer's kernel on the same GPU
                // spins for this rank.
                return Err(Error::invalid(format!(
                    "sendbuff and recvbuff of {func} partly overlap on rank {}: in place means {}; otherwise they must be disjoint",
                    self.rank,
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
    pub unsafe fn all_reduce_raw<'a>(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
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
    pub unsafe fn collective_raw<'a>(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let op = op.into();
        self.check_root(func, root)?;
        let (_, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        if count > 0 {
            // The buffers NCCL lets a rank omit are Broadcast's send and Reduce's receive buffer
            // on non-root ranks; any other NULL would be dereferenced by the kernel.
            let is_root = self.rank == root;
            for (name, addr, optional) in [
                ("sendbuff", send, func == Func::Broadcast && !is_root),
                ("recvbuff", recv, func == Func::Reduce && !is_root),
            ] {
                if addr == 0 && !optional {
                    return Err(Error::invalid(format!(
                        "{name} is NULL on rank {} ({func} of {count} elements needs it{})",
                        self.rank,
                        if matches!(func, Func::Broadcast | Func::Reduce) {
                            " on the root"
                        } else {
                            ""
                        }
                    )));
                }
            }
        }
        let (dev_op, redop_arg, redop_flags) = self.check_op(func, &op, dtype)?;
        self.check_stream(stream)?;
        if self.flag_state() != 0 {
            // Remote (another rank aborted) or InvalidUsage (this rank did).
            return self.get_async_error();
        }
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was finalized; only destroy is allowed after finalize",
                self.rank
            )));
        }
        if count == 0 {
            return Ok(());
        }
        if self.nranks == 1 && dev_op == DevRedOp::PreMulSum {
            // One rank's PreMulSum scales the input: the kernel's one-rank path (NCCL's
            // `ncclLaunchOneRank`), on every channel.
            let work = WorkColl {
                sendbuff: send,
                recvbuff: recv,
                count: count as u64,
                redop_arg,
                func: func as u8,
                redop: dev_op as u8,
                redop_flags,
                dtype: dtype as u8,
                algo: Algo::Ring as u8,
                proto: Proto::Simple as u8,
                nchannels: self.nchannels.clamp(1, u16::MAX as u32) as u16,
                ..WorkColl::zeroed()
            };
            tracing::debug!(target: "oxccl::coll", rank = self.rank, %func, count, %dtype, %op, "enqueue (one rank)");
            return self.launch(
                KernelArgs {
                    comm: self.dev_comm,
                    _pad: 0,
                    work,
                },
                stream,
            );
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
        let choice = self.plan(func, self.call_bytes(func, count, recv_bytes, esize), esize)?;
        let work = WorkColl {
            sendbuff: send,
            recvbuff: recv,
            count: count as u64,
            chunk_elems: choice.chunk_elems,
            slice_elems: choice.slice_elems,
            root: root as u32,
            func: func as u8,
            redop: dev_op as u8,
            redop_arg,
            redop_flags,
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

    /// The kernel's operator and scalar operand (`WorkColl::redop_arg`, `redop_flags`) for `op` on
    /// a `func` call of `dtype`; Broadcast and AllGather reduce nothing and ignore `op`. A
    /// PreMulSum scalar must have the call's type (case C07); a device-resident one must lie on
    /// this rank's device, hold one element and be aligned to its size.
    fn check_op(&self, func: Func, op: &ReduceOp<'_>, dtype: DataType) -> Result<(DevRedOp, u64, u8)> {
        if matches!(func, Func::Broadcast | Func::AllGather) {
            return Ok((DevRedOp::Sum, 0, 0));
        }
        match op {
            ReduceOp::Builtin(o) => Ok(((*o).into(), 0, 0)),
            ReduceOp::PreMulSum(s) => {
                if s.dtype() != dtype {
                    return Err(Error::invalid(format!(
                        "the PreMulSum scalar is {} but {func} runs on {}: the scalar must have the call's dtype",
                        s.dtype().name(),
                        dtype.name()
                    )));
                }
                Ok((DevRedOp::PreMulSum, s.to_bits(), 0))
            }
            ReduceOp::PreMulSumDevice(s) => {
                if s.device() != self.device {
                    return Err(Error::invalid(format!(
                        "the PreMulSum scalar is on {:?} but rank {} is on {:?}",
                        s.device(),
                        self.rank,
                        self.device
                    )));
                }
                let size = dtype.size();
                if s.len() < size || s.addr() % size as u64 != 0 {
                    return Err(Error::invalid(format!(
                        "the device-resident PreMulSum scalar ({} bytes at {:#x}) must hold one {} ({size} bytes) aligned to {size} bytes",
                        s.len(),
                        s.addr(),
                        dtype.name()
                    )));
                }
                Ok((DevRedOp::PreMulSum, s.addr(), REDOP_SCALAR_DEVICE))
            }
        }
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

    /// Algorithm, protocol, channels, chunk and slice for a call of `bytes` bytes (the seed's
    /// tuning step: the cost model of [`crate::tuning::Model`] among what `NCCL_ALGO` /
    /// `NCCL_PROTO` allow and this communicator implements — the tree only when it has trees).
    fn plan(&self, func: Func, bytes: u64, esize: u64) -> Result<Choice> {
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
            // One chunk is one step of lines: 8 data bytes per 16-byte LL line, 120 per 128-byte
            // LL128 line (NCCL's LL / LL128 chunk, for the ring and the tree alike).
            let step_data = if proto == Proto::Ll {
                self.params.ll_buffsize / FIFO_STEPS / 16 * 8
            } else {
                self.params.ll128_buffsize / FIFO_STEPS / 128 * 120
            };
            // A whole number of 16-byte packs (an odd line count makes, e.g., 65 × 8 = 520
            // bytes): the kernels round each loop's chunk to whole packs, which must stay within
            // the chunk (`coll::loop_chunk`).
            let step_data = (step_data / PACK_BYTES * PACK_BYTES).max(PACK_BYTES);
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
                let Some((func, algo, proto, dtype, op)) = w.entry_key() else {
                    return Err(Error::Internal("work element with an invalid enum".into()));
                };
                let name = oxccl_gpu::abi::kernel_name_for(func, algo, proto, dtype, op);
                let issued = res.launch.issued.load(Ordering::Acquire);
                let counter = |p: usize| (p, &res.group.launches[p].issued);
                if !res.sharing.is_empty() {
                    // This kernel waits in its stream for this rank's previous one; on a hardware
                    // queue shared with a rank of this GPU it would hold back that rank's kernel
                    // of the previous call, which ours is waiting for (module docs).
                    let peers: Vec<_> = res.sharing.iter().map(|&p| counter(p)).collect();
                    wait_launches(&peers, issued, self.abort_flag(), self.rank, &|| {
                        "before launching its next one on the GPU they share".into()
                    })?;
                }
                let module = match res.ctx.loaded_kernel(name.as_str()) {
                    Some(m) => m,
                    None => {
                        // Loading may wait for every kernel of the context: first let every rank
                        // of the group launch what came before, so none of their kernels waits
                        // for one of ours that the load holds back.
                        let peers: Vec<_> = (0..res.group.launches.len()).map(counter).collect();
                        wait_launches(&peers, issued, self.abort_flag(), self.rank, &|| {
                            format!("before loading kernel {}", name.as_str())
                        })?;
                        res.ctx.kernel(name.as_str())?
                    }
                };
                s.launch(&module, w.nchannels as u32, self.params.nthreads, &args)?;
                res.launch.last_event.record(s)?;
                res.launch.launched.store(true, Ordering::Release);
                res.launch.issued.store(issued + 1, Ordering::Release);
                Ok(())
            }
            (Res::Cpu(res), Stream::Cpu(s)) => {
                let w = &args.work;
                let Some((func, algo, proto, dtype, op)) = w.entry_key() else {
                    return Err(Error::Internal("work element with an invalid enum".into()));
                };
                if oxccl_gpu::dispatch::entry_for(func, algo, proto, dtype, op).is_none() {
                    return Err(crate::kernels::not_built(
                        oxccl_gpu::abi::kernel_name_for(func, algo, proto, dtype, op).as_str(),
                    ));
                }
                launch_cpu(args, self.params.cpu_nthreads, self.params.cpu_team, res.group.clone(), self.rank, res.slot, s, &self.inflight)
            }
            _ => Err(Error::invalid(
                "stream and communicator are of different backends",
            )),
        }
    }

    fn abort_flag(&self) -> &AtomicU32 {
        let p = match (&self.res, self.init_rank_res()) {
            (_, Some(mp)) => mp.abort.own_flag() as *const u32,
            (Res::Cuda(r), None) => r.group.abort[self.rank].host_ptr() as *const u32,
            (Res::Cpu(r), None) => r.group.abort[r.slot].addr() as *const u32,
        };
        // SAFETY: the flag lives in memory owned by `self.res`, 4-byte aligned, accessed atomically.
        unsafe { AtomicU32::from_ptr(p as *mut u32) }
    }

    /// The `init_rank` state (bootstrap, peers, shared abort page); `None` for `init_all`.
    fn init_rank_res(&self) -> Option<&InitRankRes> {
        match &self.res {
            Res::Cuda(r) => r.group.mp.as_ref(),
            Res::Cpu(r) => r.group.mp.as_ref(),
        }
    }

    /// The abort flags of the other ranks of this process's group (`init_all`); none for
    /// `init_rank`, whose peers' flags [`SharedAbort::raise_peers`] raises.
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

/// Runs one collective on the CPU target: per channel a host thread running a block of
/// `nthreads` threads (`OXCCL_CPU_NTHREADS`; fibers of it or host threads of their own, `team`),
/// each running the same `run_block` the GPU kernel's threads run, with the block's shared memory
/// and real barriers; queued on the CPU stream.
#[allow(clippy::too_many_arguments)]
fn launch_cpu(
    args: KernelArgs,
    nthreads: u32,
    team: oxccl_gpu::arch::TeamKind,
    group: Arc<CpuGroup>,
    rank: usize,
    slot: usize,
    stream: &CpuStream,
    inflight: &Arc<AtomicUsize>,
) -> Result<()> {
    inflight.fetch_add(1, Ordering::AcqRel);
    let inflight = inflight.clone();
    stream.enqueue(move || {
        let running = group.running.get(slot);
        if let Some(n) = running {
            n.fetch_add(1, Ordering::AcqRel);
        }
        let nch = args.work.nchannels as u32;
        let result = std::thread::scope(|s| {
            let handles: Vec<_> = (0..nch)
                .map(|b| {
                    let args = &args;
                    s.spawn(move || {
                        // u64 cells: the shared memory is 8-byte aligned, as on the GPU.
                        let mut smem = vec![0u64; oxccl_gpu::abi::KERNEL_SMEM_BYTES / 8];
                        let smem = smem.as_mut_ptr() as usize;
                        oxccl_gpu::arch::run_block_threads(b, nthreads, team, |tid| {
                            // SAFETY: `args.comm` is this rank's comm block, kept alive by
                            // `group`; the buffers are the caller's (all_reduce_raw contract);
                            // `smem` is this block's, shared by its threads as on the GPU.
                            // `false` (no entry for the work) cannot happen: `launch` checked it.
                            unsafe { oxccl_gpu::dispatch::run_block(args, b, tid, nthreads, smem as *mut u32) }
                        })
                    })
                })
                .collect();
            let mut ok = true;
            for h in handles {
                ok &= h.join().unwrap_or(false);
            }
            ok
        });
        if let Some(n) = running {
            n.fetch_sub(1, Ordering::AcqRel);
        }
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

// ---------------------------------------------------------------------------------------------
// init_rank: peer information, per-peer transport choice, shared abort flags, teardown.

/// Bytes of one rank's line in the shared abort page: the flag its kernels poll (u32 at +0) and
/// which rank raised it, plus one (u32 at +4).
const ABORT_LINE_BYTES: usize = 64;

/// Whether `NCCL_PROTO` (or `OXCCL_PROTO`) names LL128 in a list of protocols to use (not in an
/// exclusion list): NCCL then enables LL128 even where it is off by default; oxccl still keeps it
/// off through host memory on GPUs, and says so with a warning.
fn ll128_forced() -> bool {
    ll128_forced_by(crate::params::env_var("PROTO").map(|(_, v)| v).as_deref())
}

/// [`ll128_forced`] for the `NCCL_PROTO` value `proto` (`None`: unset).
fn ll128_forced_by(proto: Option<&str>) -> bool {
    proto.is_some_and(|v| {
        let v = v.trim();
        !v.starts_with('^') && v.split(',').any(|p| p.trim().eq_ignore_ascii_case("LL128"))
    })
}

/// Rounds `bytes` up to whole pages (what `cuMemHostRegister` registers).
fn page_round(bytes: usize) -> usize {
    // SAFETY: sysconf has no memory effects.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as usize } else { 4096 };
    bytes.div_ceil(page) * page
}

/// A `/dev/shm` segment mapped here and registered with CUDA (NCCL's SHM transport:
/// `ncclShmOpen`, then `cudaHostRegister` with `DEVICEMAP | PORTABLE` and
/// `cudaHostGetDevicePointer`): the host mapping for this process, the device mapping for its
/// kernels. Dropping it unregisters, then unmaps (field order); the name is unlinked separately
/// ([`ShmSegment::unlink`](crate::cpu::ShmSegment::unlink)) once every peer has mapped it.
struct RegisteredShm {
    reg: cuda::HostRegistration,
    seg: crate::cpu::ShmSegment,
}

impl RegisteredShm {
    /// Creates `/dev/shm/<name>` for one rank's connection memory (`layout`, rounded up to whole
    /// pages), sets its step counters to `initial_step` and registers it. Errors: a `/dev/shm`
    /// without the room (`System` naming the bytes needed and the path), driver failures.
    fn create(
        ctx: &cuda::Context,
        name: &str,
        layout: &ConnLayout,
        initial_step: u64,
    ) -> Result<RegisteredShm> {
        let counters: Vec<u64> = (0..layout.nch)
            .flat_map(|c| [layout.head(0, c), layout.tail(0, c)])
            .collect();
        Self::create_with(ctx, name, layout.bytes() as usize, &counters, initial_step)
    }

    /// Creates `/dev/shm/<name>` of `bytes` (rounded up to whole pages), sets the `u64` counters
    /// at the offsets `counters` to `initial_step` and registers it. Errors: as [`Self::create`].
    fn create_with(
        ctx: &cuda::Context,
        name: &str,
        bytes: usize,
        counters: &[u64],
        initial_step: u64,
    ) -> Result<RegisteredShm> {
        let bytes = page_round(bytes);
        let seg = crate::cpu::ShmSegment::create(name, bytes)?;
        for &off in counters {
            // SAFETY: the counters lie inside our fresh segment; no peer maps it yet.
            unsafe { ((seg.addr() + off) as *mut u64).write(initial_step) };
        }
        Self::register(ctx, seg, bytes)
    }

    /// Maps and registers a peer's segment `name` of `bytes` (rounded up to whole pages).
    fn open(ctx: &cuda::Context, name: &str, bytes: usize) -> Result<RegisteredShm> {
        let bytes = page_round(bytes);
        Self::register(ctx, crate::cpu::ShmSegment::open(name, bytes)?, bytes)
    }

    fn register(ctx: &cuda::Context, seg: crate::cpu::ShmSegment, bytes: usize) -> Result<RegisteredShm> {
        // SAFETY: the mapping is page-aligned, `bytes` long, and outlives the registration (field
        // order of `RegisteredShm`).
        let reg = unsafe { cuda::HostRegistration::new(ctx, seg.addr() as *mut u8, bytes)? };
        Ok(RegisteredShm { reg, seg })
    }

    /// The address kernels use.
    fn dev_base(&self) -> u64 {
        self.reg.dev_ptr()
    }
}

/// A CUDA rank's connection memory for its SHM and NET neighbours (its P2P neighbours use
/// [`OwnConn::Dev`]): one block each, laid out as [`ConnLayout`], in host memory that both the
/// kernels (through the device mapping) and the other side reach.
#[derive(Default)]
struct HostConns {
    /// SHM: a `/dev/shm` segment that SHM neighbours map and register too.
    shm: Option<RegisteredShm>,
    /// NET: pinned, device-mapped host memory whose receive FIFOs and head counters the proxy
    /// thread writes.
    net: Option<cuda::HostMapped>,
}

/// This rank's connection memory (receive buffers and counters, [`ConnLayout`]).
enum OwnConn {
    /// CPU target: a `/dev/shm` segment its neighbours map.
    Shm(crate::cpu::ShmSegment),
    /// CUDA: `cuMemAlloc` memory its neighbours open through CUDA IPC (or use directly).
    Dev(cuda::DevAlloc),
}

impl OwnConn {
    fn alloc(
        ctx: Option<&Arc<cuda::Context>>,
        layout: &ConnLayout,
        name: &str,
        initial_step: u64,
    ) -> Result<OwnConn> {
        let bytes = layout.bytes() as usize;
        Ok(match ctx {
            None => {
                let seg = crate::cpu::ShmSegment::create(name, bytes)?;
                for c in 0..layout.nch {
                    for at in [layout.head(seg.addr(), c), layout.tail(seg.addr(), c)] {
                        // SAFETY: the counters lie inside our fresh segment; no peer maps it yet.
                        unsafe { (at as *mut u64).write(initial_step) };
                    }
                }
                OwnConn::Shm(seg)
            }
            Some(ctx) => {
                let mem = cuda::DevAlloc::zeroed(ctx, bytes)?;
                if initial_step != 0 {
                    for c in 0..layout.nch {
                        for at in [layout.head(mem.ptr, c), layout.tail(mem.ptr, c)] {
                            mem.write((at - mem.ptr) as usize, &initial_step.to_ne_bytes())?;
                        }
                    }
                }
                OwnConn::Dev(mem)
            }
        })
    }

    fn base(&self) -> u64 {
        match self {
            OwnConn::Shm(s) => s.addr(),
            OwnConn::Dev(m) => m.ptr,
        }
    }

    fn desc(&self, name: &str) -> Result<ConnDesc> {
        Ok(match self {
            OwnConn::Shm(_) => ConnDesc::Shm(name.to_string()),
            OwnConn::Dev(m) => ConnDesc::Ipc {
                ptr: m.ptr,
                handle: m.ipc_handle()?,
            },
        })
    }
}

/// A peer's connection memory as [`PeerLink::connect`] opens it: its descriptor (CPU target: the
/// `/dev/shm` name; CUDA: the IPC handle of its device memory, for P2P), on CUDA the name of its
/// `/dev/shm` segment (for SHM), and its size in bytes.
#[derive(Clone, Copy)]
struct PeerMem<'a> {
    desc: &'a ConnDesc,
    shm_name: &'a str,
    bytes: usize,
}

/// How this rank reaches one ring or tree neighbour's connection memory: the transport chosen for
/// that peer.
enum PeerLink {
    /// CPU target, NET (both neighbours that use it): staging FIFOs and the proxy registration
    /// (`transport::connect_net`); dropping it flushes and closes the network connections.
    Net { _held: crate::transport::NetResources },
    /// CPU target: the neighbour's `/dev/shm` segment, mapped here (the seed's SHM transport).
    Shm(crate::cpu::ShmSegment),
    /// CUDA, neighbour of this host reached through SHM: its `/dev/shm` segment, mapped here and
    /// registered with CUDA (unregistered and unmapped before this rank's teardown barrier).
    ShmMapped(RegisteredShm),
    /// CUDA, neighbour in this process: its device pointer, used over peer access (P2P).
    P2pDirect(u64),
    /// CUDA, neighbour in another process of this host: its memory opened through CUDA IPC
    /// (P2P/IPC), closed before this rank's teardown barrier.
    P2pIpc(cuda::IpcMapping),
}

impl PeerLink {
    /// Connects rank `me` to ring neighbour `peer` over `kind`, the transport [`ring_transport`]
    /// chose for the pair (P2P or SHM; NET connections are made by `transport::connect_net`).
    /// Between CUDA devices P2P also follows `p2p_level` (`NCCL_P2P_LEVEL`, see
    /// [`check_p2p_level`]): a guard, since [`exchange_p2p_denied`] already made pairs that
    /// either side's level forbids use SHM or NET. CUDA SHM maps the peer's segment ([`PeerInfo::shm_name`]), which must exist.
    #[allow(clippy::too_many_arguments)]
    fn connect(
        me: usize,
        peers: &[PeerInfo],
        peer: usize,
        kind: crate::transport::TransportKind,
        ctx: Option<&Arc<cuda::Context>>,
        target: PeerMem<'_>,
        p2p_level: Option<crate::topo::PathType>,
    ) -> Result<PeerLink> {
        use crate::transport::TransportKind;
        let (mi, pi) = (&peers[me], &peers[peer]);
        match (kind, ctx) {
            (TransportKind::Net, _) => {
                return Err(Error::Internal(format!(
                    "rank {me}: the NET connection to rank {peer} was not made by connect_net"
                )));
            }
            (TransportKind::Shm, Some(ctx)) => {
                let m = RegisteredShm::open(ctx, target.shm_name, target.bytes)?;
                tracing::debug!(target: "oxccl::init", rank = me, peer, "SHM (registered with CUDA)");
                return Ok(PeerLink::ShmMapped(m));
            }
            (TransportKind::P2p, None) => {
                return Err(Error::Internal(format!(
                    "rank {me}: P2P chosen for CPU-target rank {peer}"
                )));
            }
            (TransportKind::P2p, Some(_)) => check_p2p_level(me, mi, peer, pi, p2p_level, p2p_path_type)?,
            (TransportKind::Shm, None) => {}
        }
        let context = |e: Error| match e {
            Error::Cuda {
                call,
                code,
                name,
                msg,
            } => Error::Cuda {
                call,
                code,
                name,
                msg: format!("{msg} (rank {me} connecting to rank {peer}'s connection memory)"),
            },
            e => e,
        };
        match (target.desc, ctx) {
            (ConnDesc::Shm(name), None) => {
                Ok(PeerLink::Shm(crate::cpu::ShmSegment::open(name, target.bytes)?))
            }
            (ConnDesc::Ipc { ptr: 0, .. }, Some(_)) => Err(Error::Internal(format!(
                "rank {peer} offers no device memory for rank {me}'s P2P connection"
            ))),
            (ConnDesc::Ipc { ptr, handle }, Some(ctx)) => {
                let no_peer_access = || {
                    Error::System(format!(
                        "no transport can connect rank {me} ({}) and rank {peer} ({}): peer access is not supported between them",
                        mi.describe_device(),
                        pi.describe_device()
                    ))
                };
                if pi.pid == mi.pid && pi.host == mi.host {
                    if pi.dev != mi.dev {
                        let pctx = cuda::Context::get(pi.dev)?;
                        if !ctx.can_access_peer(&pctx)? {
                            return Err(no_peer_access());
                        }
                        ctx.enable_peer_access(&pctx)?;
                    }
                    tracing::debug!(target: "oxccl::init", rank = me, peer, "P2P (same process)");
                    return Ok(PeerLink::P2pDirect(*ptr));
                }
                if pi.bus_id != mi.bus_id
                    && let Some(o) = cuda::device_by_bus_id(&pi.bus_id)?
                    && !ctx.can_access_peer(&*cuda::Context::get(o)?)?
                {
                    return Err(no_peer_access());
                }
                let m = cuda::IpcMapping::open(ctx, handle).map_err(context)?;
                tracing::debug!(target: "oxccl::init", rank = me, peer, "P2P/IPC");
                Ok(PeerLink::P2pIpc(m))
            }
            _ => Err(Error::Internal(format!(
                "rank {peer}'s connection descriptor does not match rank {me}'s device kind"
            ))),
        }
    }

    fn base(&self) -> u64 {
        match self {
            PeerLink::Shm(s) => s.addr(),
            PeerLink::ShmMapped(m) => m.dev_base(),
            PeerLink::P2pDirect(p) => *p,
            PeerLink::P2pIpc(m) => m.ptr(),
            PeerLink::Net { .. } => 0,
        }
    }
}

/// Times the phases of one `init_rank` for debug logs (`OXCCL_LOG=oxccl::init=debug`): each
/// [`InitPhases::mark`] logs the milliseconds since the previous mark.
struct InitPhases {
    rank: usize,
    start: Instant,
    last: std::cell::Cell<Instant>,
}

impl InitPhases {
    fn start(rank: usize) -> InitPhases {
        let now = Instant::now();
        InitPhases {
            rank,
            start: now,
            last: std::cell::Cell::new(now),
        }
    }

    fn mark(&self, phase: &str) {
        let now = Instant::now();
        let ms = (now - self.last.get()).as_secs_f64() * 1e3;
        self.last.set(now);
        tracing::debug!(target: "oxccl::init", rank = self.rank, ms = format!("{ms:.2}"), "init_rank phase: {phase}");
    }

    fn total_ms(&self) -> String {
        format!("{:.2}", self.start.elapsed().as_secs_f64() * 1e3)
    }
}

/// The abort flags of an `init_rank` communicator: one [`ABORT_LINE_BYTES`] line per rank in a
/// `/dev/shm` page every rank of a host maps, so any rank can raise the flags of its host's ranks
/// (the lines of other hosts' ranks stay unused there). On CUDA the
/// page is registered with the driver and each rank's kernels poll its line through the device
/// mapping; if registration fails, kernels poll a private host-mapped flag instead (then an abort
/// elsewhere reaches this rank's host calls only).
struct SharedAbort {
    /// Dropped before `page`: unregistered before unmapped.
    _reg: Option<cuda::HostRegistration>,
    fallback: Option<cuda::HostMapped>,
    page: crate::cpu::ShmSegment,
    rank: usize,
    nranks: usize,
    /// The address this rank's kernels poll.
    dev_flag: u64,
}

impl SharedAbort {
    fn new(
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
    fn line(&self, r: usize) -> u64 {
        self.page.addr() + (r * ABORT_LINE_BYTES) as u64
    }

    /// Host address of the flag this rank's kernels poll.
    fn own_flag(&self) -> u64 {
        match &self.fallback {
            Some(f) => f.host_ptr() as u64,
            None => self.line(self.rank),
        }
    }

    /// Raised in this rank's line by another rank: `Some(that rank)` (or `Some(None)` when the
    /// flag was raised by an `init_all` peer).
    fn raised_by_peer(&self) -> Option<usize> {
        // SAFETY: the line lies in the mapped page, 4-byte aligned, accessed atomically.
        let (flag, who) = unsafe {
            (
                AtomicU32::from_ptr(self.line(self.rank) as *mut u32).load(Ordering::Acquire),
                AtomicU32::from_ptr((self.line(self.rank) + 4) as *mut u32).load(Ordering::Acquire),
            )
        };
        (flag == ABORTED_BY_PEER && who > 0).then(|| who as usize - 1)
    }

    /// Raises every other rank's flag, noting `self.rank` as the cause.
    fn raise_peers(&self) {
        for r in (0..self.nranks).filter(|&r| r != self.rank) {
            // SAFETY: as in `raised_by_peer`.
            unsafe {
                let _ = AtomicU32::from_ptr((self.line(r) + 4) as *mut u32).compare_exchange(
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

/// What an `init_rank` communicator holds besides its own memory: the bootstrap, the gathered
/// peer information, its mappings of ring neighbours' memory and the shared abort page.
struct InitRankRes {
    rank: usize,
    peers: Vec<PeerInfo>,
    links: Mutex<Vec<PeerLink>>,
    /// CUDA: this rank's connection memory for SHM and NET neighbours, freed after the teardown
    /// barrier (declared after `links`: the proxy stops writing into it first).
    _host_conns: HostConns,
    /// This rank's tree connection memory (P2P/SHM FIFOs its tree peers write, NET FIFOs and
    /// staging its proxy uses, its `DevTree` array), freed after the teardown barrier.
    _tree_mem: Vec<rank_trees::TreeMem>,
    /// The watch over the host's other rank processes (`crate::liveness`); declared before
    /// `abort`, whose page it writes, so it stops first. Stopped at teardown
    /// ([`InitRankRes::sync_teardown`]): once this rank's operations are done, a peer process
    /// that exits is the normal end of the job, not a failure.
    watched: Mutex<Option<crate::liveness::Watched>>,
    abort: SharedAbort,
    /// Set once the ranks have synchronized for teardown ([`InitRankRes::sync_teardown`]).
    synced: std::sync::atomic::AtomicBool,
    bootstrap: crate::bootstrap::Bootstrap,
}

impl InitRankRes {
    /// The collective part of teardown, done once: closes this rank's mappings of its
    /// neighbours' memory, then waits at a bootstrap barrier (bounded by the bootstrap timeout)
    /// so that no rank frees memory a peer may still write into or has mapped, then closes its
    /// NET connections. Those stay open across the barrier: a peer that destroys later than this
    /// rank (by more than the proxy's flush wait) would otherwise see its connections end and
    /// take this rank for dead. The barrier is skipped after an abort: the aborting rank raised
    /// every rank's flag, so no kernel keeps writing, and a peer may never arrive. The caller's
    /// own operations must be finished.
    fn sync_teardown(&self) -> Result<()> {
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
        if aborted || self.abort.raised_by_peer().is_some() {
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
    fn check_peers_alive(&self) -> Result<()> {
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

impl Drop for CudaGroup {
    /// `init_rank`: the teardown barrier before any memory is freed (see
    /// [`InitRankRes::sync_teardown`]); errors are logged there.
    fn drop(&mut self) {
        if let Some(mp) = &self.mp {
            let _ = mp.sync_teardown();
        }
    }
}

impl Drop for CpuGroup {
    /// As for [`CudaGroup`].
    fn drop(&mut self) {
        if let Some(mp) = &self.mp {
            let _ = mp.sync_teardown();
        }
    }
}

/// A short tag of a unique id, so segment names of different communicators never collide.
fn id_tag(id: &crate::bootstrap::UniqueId) -> u64 {
    id.to_bytes().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) & 0xffff_ffff
}

/// The settings that decide how each call runs and must therefore be the same on every rank
/// (NCCL requires it; a rank planning another protocol, algorithm or channel count than its peers
/// waits for them forever): one `NAME=value` line each, in a fixed order, from the parsed values
/// (so `LL,Simple` and `Simple,LL` agree).
fn plan_settings(p: &Params, s: &Selection) -> String {
    let names = |v: &[bool], all: &[&str]| -> String {
        let on: Vec<&str> = all.iter().zip(v).filter(|(_, b)| **b).map(|(n, _)| *n).collect();
        format!("{{{}}}", on.join(","))
    };
    let opt = |v: Option<u32>| v.map_or("unset".to_string(), |v| v.to_string());
    [
        (
            "NCCL_PROTO",
            names(
                &s.protos.0,
                &[Proto::Ll.name(), Proto::Ll128.name(), Proto::Simple.name()],
            ),
        ),
        (
            "NCCL_ALGO",
            names(&s.algos.0, &[Algo::Tree.name(), Algo::Ring.name()]),
        ),
        ("NCCL_MIN_NCHANNELS", opt(p.min_nchannels)),
        ("NCCL_MAX_NCHANNELS", opt(p.max_nchannels)),
        ("NCCL_NTHREADS", p.nthreads.to_string()),
        ("NCCL_BUFFSIZE", p.buffsize.to_string()),
        ("NCCL_LL_BUFFSIZE", p.ll_buffsize.to_string()),
        ("NCCL_LL128_BUFFSIZE", p.ll128_buffsize.to_string()),
        ("OXCCL_TEST_INITIAL_STEP", p.initial_step.to_string()),
    ]
    .iter()
    .map(|(k, v)| format!("{k}={v}"))
    .collect::<Vec<_>>()
    .join("\n")
}

/// Compares every rank's [`plan_settings`] record (`all`, by rank) with this rank's: the first
/// setting that differs fails init on every rank alike with `InvalidUsage` naming the variable,
/// the lowest rank whose value differs from rank 0's, and both values.
fn check_plan_settings(rank: usize, all: &[Vec<u8>]) -> Result<()> {
    let lines =
        |b: &[u8]| -> Vec<String> { String::from_utf8_lossy(b).lines().map(str::to_string).collect() };
    let Some(first) = all.first().map(|b| lines(b)) else {
        return Ok(());
    };
    for (r, b) in all.iter().enumerate().skip(1) {
        let other = lines(b);
        if let Some((a, o)) = first.iter().zip(&other).find(|(a, o)| a != o) {
            let (name, v0) = a.split_once('=').unwrap_or((a.as_str(), ""));
            let v = o.split_once('=').map_or(o.as_str(), |(_, v)| v);
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: {name} differs across ranks: rank 0 has {v0}, rank {r} has {v} \
                 (also spelled OXCCL_{}; every rank must set the same value)",
                name.trim_start_matches("NCCL_").trim_start_matches("OXCCL_")
            )));
        }
    }
    Ok(())
}

/// Prefix of a rank's record in an `init_rank` all-gather when that rank failed (its error follows).
const INIT_ERR_PREFIX: &str = "ERR ";

/// An `init_rank` all-gather after a step that may fail on some ranks: each rank sends
/// `record(&value)` of its result `mine`, or its error, so every rank learns of a failure at the
/// same step and fails at once, naming the rank (rather than one rank leaving and the others
/// waiting out the bootstrap timeout). Returns this rank's value and every rank's record.
///
/// Errors: this rank's own error as it is; else `Remote` "rank {rank}: rank {r} {what}: {error}"
/// for the first rank `r` that failed; bootstrap errors.
fn allgather_checked<T>(
    bootstrap: &crate::bootstrap::Bootstrap,
    rank: usize,
    mine: Result<T>,
    record: impl FnOnce(&T) -> String,
    what: &str,
) -> Result<(T, Vec<Vec<u8>>)> {
    let sent = match &mine {
        Ok(v) => record(v),
        Err(e) => format!("{INIT_ERR_PREFIX}{e}"),
    };
    let all = bootstrap.allgather(sent.as_bytes())?;
    let value = mine?;
    if let Some((r, e)) = all.iter().enumerate().find_map(|(r, b)| {
        String::from_utf8_lossy(b)
            .strip_prefix(INIT_ERR_PREFIX)
            .map(|e| (r, e.to_string()))
    }) {
        return Err(Error::Remote(format!("rank {rank}: rank {r} {what}: {e}")));
    }
    Ok((value, all))
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

impl Comm {
    /// The abort of a drop whose operations did not finish: this rank's flag (and, across
    /// processes, the peers' through the shared page). With direct writes the whole `init_all`
    /// group is aborted instead ([`Comm::abort`]): a peer's kernel may still be writing into this
    /// rank's buffers, which the caller frees once the drop returns.
    fn abort_on_drop(&self) {
        if self.direct {
            if let Err(e) = self.abort() {
                tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: {e}");
            }
            return;
        }
        self.abort_flag().store(ABORTED_HERE, Ordering::Release);
        if let Some(mp) = self.init_rank_res() {
            mp.abort.raise_peers();
        }
    }
}

impl Drop for Comm {
    /// Waits (bounded) for this rank's last queued operation, then raises the abort flag so a
    /// kernel still waiting for a peer exits, then frees everything. Never panics.
    fn drop(&mut self) {
        let start = Instant::now();
        match &self.res {
            Res::Cuda(res) => {
                if !res.launch.launched.load(Ordering::Acquire) {
                    return;
                }
                loop {
                    match res.launch.last_event.is_complete() {
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
                self.abort_on_drop();
                if let Err(e) = res.ctx.synchronize() {
                    tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: {e}");
                }
            }
            Res::Cpu(_) => {
                while self.inflight.load(Ordering::Acquire) > 0 {
                    if start.elapsed() > DROP_WAIT {
                        tracing::warn!(target: "oxccl::init", rank = self.rank, "destroy: operations still running after {DROP_WAIT:?}; aborting them");
                        self.abort_on_drop();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

#[cfg(test)]
mod direct_tests {
    use super::*;

    /// Rank `r`'s connection memory of a CPU `init_all` group, as bytes.
    fn conn_mem(comm: &Comm, r: usize) -> &[u8] {
        let Res::Cpu(res) = &comm.res else {
            panic!("CPU communicator expected")
        };
        let m = &res.group._conn_mem[r];
        // SAFETY: the block is alive while `comm` is; the test reads it between calls only.
        unsafe { std::slice::from_raw_parts(m.addr() as *const u8, m.len()) }
    }

    #[test]
    fn pointer_exchanges_pair_the_two_ends_of_each_connection() {
        let params = Params::default();
        let layout = ConnLayout::new(&params, 2, true);
        let bases = [0x1000_0000_0000u64, 0x2000_0000_0000, 0x3000_0000_0000];
        let rings = ChannelRings::new(vec![vec![0, 1, 2], vec![0, 2, 1]], 3).unwrap();
        let chans = |r: usize, p: &Params| -> Vec<DevChannel> {
            let b = build_comm_block(r, 3, 2, &layout, &bases, 0x5000, 0x6000, p, &rings);
            let b = direct_pointers(b, 2, 3, p);
            bytemuck::cast_slice::<u8, DevChannel>(&b[size_of::<DevComm>()..][..2 * size_of::<DevChannel>()])
                .to_vec()
        };
        let all: Vec<Vec<DevChannel>> = (0..3).map(|r| chans(r, &params)).collect();
        for c in 0..2 {
            for r in 0..3 {
                let send = all[r][c].send;
                let next = all[r][c].ring.next as usize;
                let recv = all[next][c].recv;
                // Both ends name the same slot: in the sender's memory, past its head counter.
                assert_eq!(
                    send.ptr_exchange,
                    layout.head(bases[r], c as u64) + PTR_EXCHANGE_OFFSET
                );
                assert_eq!(
                    recv.ptr_exchange, send.ptr_exchange,
                    "channel {c}: rank {r} -> {next}"
                );
                assert_eq!((send.exchanges, recv.exchanges), (0, 0));
            }
        }
        // Disabled, or one rank: no slot anywhere.
        let off = Params {
            p2p_direct: false,
            ..Params::default()
        };
        assert!(
            chans(1, &off)
                .iter()
                .all(|ch| ch.send.ptr_exchange == 0 && ch.recv.ptr_exchange == 0)
        );
        let one = direct_pointers(
            build_comm_block(0, 1, 2, &layout, &bases, 0x5000, 0x6000, &params, &rings),
            2,
            1,
            &params,
        );
        let ch: &[DevChannel] =
            bytemuck::cast_slice(&one[size_of::<DevComm>()..][..2 * size_of::<DevChannel>()]);
        assert!(
            ch.iter()
                .all(|ch| ch.send.ptr_exchange == 0 && ch.recv.ptr_exchange == 0)
        );
    }

    /// A direct Broadcast leaves the receiver's Simple FIFOs untouched (its data went straight to
    /// the output) and counts one exchange per channel; a Reduce to the same rank (never direct)
    /// then fills them, which shows the FIFO check can see writes.
    #[test]
    fn direct_broadcast_bypasses_the_receivers_fifo() {
        let devs = Device::cpus(2);
        let comms = Comm::init_all(&devs).unwrap();
        if !comms[0].direct_pointer() {
            eprintln!("skipped: NCCL_P2P_DIRECT_DISABLE is set in this environment");
            return;
        }
        let count = 1usize << 20; // 4 MiB of u32: a Simple call on the CPU target
        let want: Vec<u8> = (0..count as u32)
            .flat_map(|i| (i.wrapping_mul(2654435761)).to_ne_bytes())
            .collect();
        let streams: Vec<Stream> = devs.iter().map(|d| d.new_stream().unwrap()).collect();
        let send = devs[0].alloc(count * 4).unwrap();
        send.write(0, &want).unwrap();
        let recv: Vec<_> = devs.iter().map(|d| d.alloc(count * 4).unwrap()).collect();
        let choice = comms[0]
            .choice_for(Func::Broadcast, count, DataType::U32)
            .unwrap()
            .unwrap();
        assert_eq!(choice.proto, Proto::Simple, "{choice:?}");
        let nch = choice.nchannels as u64;
        let fifo_zero = |comm: &Comm| {
            let mem = conn_mem(comm, 1);
            let layout = ConnLayout::new(&comm.params, comm.nchannels, true);
            (0..nch).all(|c| {
                let at = layout.buff(0, c) as usize;
                mem[at..at + layout.buffsize as usize].iter().all(|&b| b == 0)
            })
        };
        std::thread::scope(|s| {
            for r in 0..2 {
                let (comm, stream, send, recv) = (&comms[r], &streams[r], &send, &recv[r]);
                s.spawn(move || {
                    let src = (r == 0).then(|| send.as_slice());
                    comm.broadcast(src, recv.as_slice(), count, DataType::U32, 0, stream)
                        .unwrap();
                    stream.synchronize().unwrap();
                });
            }
        });
        assert_eq!(recv[1].to_vec().unwrap(), want, "rank 1's output");
        assert!(
            fifo_zero(&comms[0]),
            "a direct Broadcast wrote rank 1's Simple FIFO"
        );
        // One exchange per channel: rank 0's slot (its head line) holds rank 1's output and count 1.
        let layout = ConnLayout::new(&comms[0].params, comms[0].nchannels, true);
        let mem0 = conn_mem(&comms[0], 0);
        for c in 0..nch {
            let at = (layout.head(0, c) + PTR_EXCHANGE_OFFSET) as usize;
            let slot: [u64; 2] = bytemuck::pod_read_unaligned(&mem0[at..at + 16]);
            assert_eq!(slot, [recv[1].addr(), 1], "channel {c}");
        }
        // The control: a Reduce to rank 1 goes through its FIFOs.
        std::thread::scope(|s| {
            for r in 0..2 {
                let (comm, stream, buf) = (&comms[r], &streams[r], &recv[r]);
                s.spawn(move || {
                    let out = (r == 1).then(|| buf.as_slice());
                    comm.reduce(buf.as_slice(), out, count, DataType::U32, RedOp::Max, 1, stream)
                        .unwrap();
                    stream.synchronize().unwrap();
                });
            }
        });
        assert_eq!(comms[0].last_choice().map(|c| c.proto), Some(Proto::Simple));
        assert!(
            !fifo_zero(&comms[0]),
            "a Reduce to rank 1 left its FIFOs untouched"
        );
    }
}

#[cfg(test)]
mod init_rank_tests {
    use super::*;
    use crate::liveness::proc_start;

    pub(super) fn cuda_peer(bus: &str, host: &str, pid: u32) -> PeerInfo {
        PeerInfo {
            cuda: true,
            dev: 0,
            bus_id: bus.into(),
            host: host.into(),
            host_hash: crate::hash::fnv1a_64(host.as_bytes()),
            pid,
            start_time: 77,
            p2p_disable: false,
            shm_disable: false,
            p2p_level: None,
            p2p_denied: Vec::new(),
            shm_name: format!("oxccl-1-{pid}-r0"),
            nch: 4,
            conn_bytes: 1 << 20,
            conn: ConnDesc::Ipc {
                ptr: 0x7f00_0000_0000,
                handle: std::array::from_fn(|i| i as u8 * 3),
            },
            abort_page: String::new(),
        }
    }

    /// CUDA ranks 0-2 on host h (bus ids 0000:0r:00.0), rank 3 on host k.
    fn four_peers() -> Vec<PeerInfo> {
        (0..4)
            .map(|r| {
                cuda_peer(
                    &format!("0000:{r:02x}:00.0"),
                    if r == 3 { "k" } else { "h" },
                    r as u32,
                )
            })
            .collect()
    }

    #[test]
    fn p2p_level_denies_far_pairs_which_then_use_shm() {
        use crate::topo::PathType;
        use crate::transport::TransportKind::{Net, P2p, Shm};
        // Host h: ranks 0, 1, 2; host k: rank 3. Paths on h (fake, by bus id pair): 0-1 NVL,
        // 0-2 and 1-2 SYS. Rank 2 sets NCCL_P2P_LEVEL=PHB, rank 0 NVL, rank 1 nothing.
        let mut p = four_peers();
        p[0].p2p_level = Some(PathType::Nvl);
        p[2].p2p_level = Some(PathType::Phb);
        let path = |a: &PeerInfo, b: &PeerInfo| -> Result<Option<PathType>> {
            let far = a.bus_id.ends_with("02:00.0") || b.bus_id.ends_with("02:00.0");
            Ok(Some(if far { PathType::Sys } else { PathType::Nvl }))
        };
        // Rank 0 (NVL): 1 is NVL (allowed), 2 is SYS (denied by both levels); 3 is another host.
        assert_eq!(p2p_denied_by_level(0, &p, path).unwrap(), vec![2]);
        // Rank 1 (no level): only rank 2's PHB applies to 1-2 (SYS > PHB): denied; 0-1 NVL ok.
        assert_eq!(p2p_denied_by_level(1, &p, path).unwrap(), vec![2]);
        assert_eq!(p2p_denied_by_level(2, &p, path).unwrap(), vec![0, 1]);
        assert_eq!(p2p_denied_by_level(3, &p, path).unwrap(), Vec::<usize>::new());
        // What the all-gather hands every rank; denied pairs fall back to SHM, or NET with SHM
        // off, seen alike from both ends.
        for r in 0..4 {
            p[r].p2p_denied = p2p_denied_by_level(r, &p, path).unwrap();
        }
        for (a, b, k) in [(0, 1, P2p), (1, 2, Shm), (2, 0, Shm), (2, 3, Net)] {
            assert_eq!(
                (ring_transport(&p, a, b), ring_transport(&p, b, a)),
                (k, k),
                "{a}-{b}"
            );
        }
        p[1].shm_disable = true;
        assert_eq!(ring_transport(&p, 1, 2), Net);
        // A path error is the caller's error.
        let broken =
            |_: &PeerInfo, _: &PeerInfo| -> Result<Option<PathType>> { Err(Error::invalid("bad topology")) };
        assert!(p2p_denied_by_level(0, &p, broken).is_err());
    }

    #[test]
    fn peer_info_round_trips() {
        let mut p = cuda_peer("0000:18:00.0", "node a", 4242);
        p.abort_page = "oxccl-1-2-abort".into();
        p.shm_disable = true;
        p.p2p_level = Some(crate::topo::PathType::Pxb);
        assert_eq!(PeerInfo::decode(0, p.encode().as_bytes()).unwrap(), p);
        let q = PeerInfo {
            cuda: false,
            bus_id: String::new(),
            conn: ConnDesc::Shm("oxccl-1-2-r1".into()),
            p2p_level: None,
            ..p
        };
        assert_eq!(PeerInfo::decode(1, q.encode().as_bytes()).unwrap(), q);
        let e = PeerInfo::decode(3, b"cuda\n0").unwrap_err();
        assert_eq!(
            e.to_string(),
            "remote error: rank 3 sent malformed peer information (2 fields, expected 15)"
        );
    }

    #[test]
    fn cuda_rules_name_both_ranks() {
        // Two processes whose CUDA ordinal is 0 but on different GPUs (CUDA_VISIBLE_DEVICES): fine.
        let (a, b) = (
            cuda_peer("0000:18:00.0", "h", 1),
            cuda_peer("0000:2a:00.0", "h", 2),
        );
        check_peers(0, &[a.clone(), b.clone()]).unwrap();
        // The same bus id twice: C26, naming both ranks and the bus id.
        let e = check_peers(1, &[a.clone(), a.clone()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid usage: ranks 0 and 1 are both on cuda device 0 (bus id 0000:18:00.0) of host \"h\"; one device \
             per rank is required (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)"
        );
        // NCCL_P2P_DISABLE=1 on either side, or different hosts: fine (SHM or NET connects them).
        let mut c = b.clone();
        c.p2p_disable = true;
        check_peers(0, &[a.clone(), c]).unwrap();
        let d = cuda_peer("0000:2a:00.0", "other", 2);
        check_peers(0, &[a.clone(), d]).unwrap();
        // A CPU-target rank among CUDA ranks.
        let mut cpu = b;
        cpu.cuda = false;
        let e = check_peers(0, &[a, cpu]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid usage: rank 1 is on a cpu device but rank 0 is on a cuda device: a communicator is all CUDA or \
             all CPU-target"
        );
    }

    #[test]
    fn ring_transports_follow_p2p_shm_net() {
        use crate::transport::TransportKind::{Net, P2p, Shm};
        // Ranks 0-2 on host h, rank 3 on host k; rank 1 has NCCL_P2P_DISABLE=1, rank 2
        // NCCL_SHM_DISABLE=1. Pairs: 0-1 SHM (P2P off on 1), 1-2 NET (P2P off on 1, SHM off on 2),
        // 2-3 and 3-0 NET (other host); 0-0 (a 1-rank ring) its own memory, reported as P2P.
        let mut p = four_peers();
        assert_eq!(ring_transport(&p, 0, 1), P2p);
        p[1].p2p_disable = true;
        p[2].shm_disable = true;
        let want = [
            (0, 1, Shm),
            (1, 2, Net),
            (2, 3, Net),
            (3, 0, Net),
            (0, 2, P2p),
            (0, 0, P2p),
        ];
        for (a, b, k) in want {
            assert_eq!(
                (ring_transport(&p, a, b), ring_transport(&p, b, a)),
                (k, k),
                "{a}-{b}"
            );
        }
        // CPU-target ranks never use P2P: SHM on one host (0-2 also with P2P allowed on both),
        // still NET where one side disabled SHM.
        for q in &mut p {
            q.cuda = false;
        }
        assert_eq!((ring_transport(&p, 0, 1), ring_transport(&p, 1, 2)), (Shm, Net));
        p[2].shm_disable = false;
        assert_eq!(ring_transport(&p, 0, 2), Shm);
    }

    #[test]
    fn split_own_memory_by_transport() {
        // Rank 1 of 3, 2 channels. Channel 0: next (2) reached through P2P, prev (0) through NET:
        // its send head must be in its device block (own[0][0]) where rank 2 writes it, its
        // receive FIFOs and tail in its host block (own[0][1]) where the proxy writes them.
        // Channel 1 (rings may differ per channel, so may the transports): the other way round.
        // Peers' blocks as given.
        let params = Params::default();
        let layout = ConnLayout::new(&params, 2, true);
        let bases = [0x1000_0000_0000u64, 0, 0x3000_0000_0000];
        let own = [
            [0x7000_0000_0000u64, 0x9000_0000_0000],
            [0x9000_0000_0000u64, 0x7000_0000_0000],
        ];
        let rings = ChannelRings::rank_order(3, 2);
        let mut bytes =
            build_comm_block_split(1, 3, 2, &layout, &bases, &own, 0x5000, 0x6000, &params, &rings);
        // NET step sizes on channel 1's send connection only (its next is across the network).
        net_step_sizes(&mut bytes, &layout, &[None, Some(0xa000_0000_0000)]);
        let chans: &[DevChannel] =
            bytemuck::cast_slice(&bytes[size_of::<DevComm>()..][..2 * size_of::<DevChannel>()]);
        for (c, ch) in chans.iter().enumerate() {
            let [send, recv] = own[c];
            let c = c as u64;
            assert_eq!(ch.send.buffs[Proto::Simple as usize], layout.buff(bases[2], c));
            assert_eq!(ch.send.tail, layout.tail(bases[2], c));
            assert_eq!(ch.send.head, layout.head(send, c));
            assert_eq!(ch.recv.buffs[Proto::Simple as usize], layout.buff(recv, c));
            assert_eq!(ch.recv.buffs[Proto::Ll as usize], layout.ll(recv, c));
            assert_eq!(ch.recv.buffs[Proto::Ll128 as usize], layout.ll128(recv, c));
            assert_eq!(ch.recv.tail, layout.tail(recv, c));
            assert_eq!(ch.recv.head, layout.head(bases[0], c));
        }
        assert_eq!(chans[0].send.sizes, 0);
        assert_eq!(
            chans[1].send.sizes,
            layout.tail(0xa000_0000_0000, 1) + crate::transport::STEP_SIZES_OFFSET
        );
        // Unsplit: the same as the split with conn_base[r] on both sides.
        let whole = [bases[0], own[0][1], bases[2]];
        assert_eq!(
            build_comm_block(1, 3, 2, &layout, &whole, 0x5000, 0x6000, &params, &rings),
            build_comm_block_split(
                1,
                3,
                2,
                &layout,
                &whole,
                &[[whole[1], whole[1]]; 2],
                0x5000,
                0x6000,
                &params,
                &rings
            )
        );
    }

    #[test]
    fn comm_block_follows_each_channels_ring() {
        // 3 ranks, 2 channels: channel 0 in rank order, channel 1 on ring 0 -> 2 -> 1 -> 0. Rank 1
        // sends to 2 and receives from 0 on channel 0, sends to 0 and receives from 2 on
        // channel 1; its user ranks are 1 2 0 and 1 0 2, its index (distance from rank 0) 1 and 2.
        let params = Params::default();
        let layout = ConnLayout::new(&params, 2, true);
        let bases = [0x1000_0000_0000u64, 0x2000_0000_0000, 0x3000_0000_0000];
        let rings = ChannelRings::new(vec![vec![0, 1, 2], vec![0, 2, 1]], 3).unwrap();
        let block = 0x5000u64;
        let bytes = build_comm_block(1, 3, 2, &layout, &bases, block, 0x6000, &params, &rings);
        let chans: &[DevChannel] =
            bytemuck::cast_slice(&bytes[size_of::<DevComm>()..][..2 * size_of::<DevChannel>()]);
        let ranks_off = size_of::<DevComm>() + 2 * size_of::<DevChannel>();
        let user: &[u32] = bytemuck::cast_slice(&bytes[ranks_off..ranks_off + 2 * 3 * 4]);
        assert_eq!(user, &[1, 2, 0, 1, 0, 2]);
        for (c, (next, prev, index)) in [(2usize, 0usize, 1u32), (0, 2, 2)].into_iter().enumerate() {
            let ch = &chans[c];
            let cu = c as u64;
            assert_eq!(
                (ch.ring.next as usize, ch.ring.prev as usize, ch.ring.index),
                (next, prev, index)
            );
            assert_eq!(ch.ring.user_ranks, block + (ranks_off + c * 3 * 4) as u64);
            assert_eq!(
                ch.send.buffs[Proto::Simple as usize],
                layout.buff(bases[next], cu)
            );
            assert_eq!(ch.send.tail, layout.tail(bases[next], cu));
            assert_eq!(ch.send.head, layout.head(bases[1], cu));
            assert_eq!(ch.recv.head, layout.head(bases[prev], cu));
            assert_eq!(ch.recv.buffs[Proto::Ll as usize], layout.ll(bases[1], cu));
        }
    }

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

    #[test]
    fn proc_start_of_this_process() {
        let (t, zombie) = proc_start(std::process::id()).unwrap();
        assert!(t > 0 && !zombie);
        // Pids above the kernel's maximum (4194304) never exist.
        assert_eq!(proc_start(u32::MAX), None);
    }
}

#[cfg(test)]
mod tree_tests {
    use super::*;

    #[test]
    fn tree_connections_pair_up_across_ranks() {
        // 2 nodes of 2 ranks (chains [0, 1] and [2, 3]), balanced pattern. Tree 0 (channel 0):
        // btree(2) has node 0 as root and node 1 as its child of type 1, which attaches to the
        // head c[0] = rank 0; so rank 0 has children 1 (its chain) and 2, rank 2 child 3. Tree 1
        // (channel 1) is the mirror: node 1 roots it, node 0 hangs from rank 2.
        let chains = vec![vec![0, 1], vec![2, 3]];
        let trees = channel_trees(&chains, 3, crate::graph::Pattern::BalancedTree).unwrap();
        let ud = |c: usize, r: usize| (trees[c][r].up, trees[c][r].down);
        assert_eq!(ud(0, 0), (-1, [1, 2, -1]));
        assert_eq!(ud(0, 2), (0, [3, -1, -1]));
        assert_eq!(ud(1, 2), (-1, [3, 0, -1]));
        assert_eq!(ud(1, 0), (2, [1, -1, -1]));
        // Channel 2 runs tree 0 again.
        assert_eq!(trees[2], trees[0]);

        // Per present peer one Simple (1 MiB), LL (64 KiB) and LL128 (128 KiB) FIFO.
        let params = Params {
            buffsize: 1 << 20,
            ll_buffsize: 64 << 10,
            ll128_buffsize: 128 << 10,
            ..Params::default()
        };
        let buffsize = (1 << 20) + (64 << 10) + (128 << 10);
        let layouts: Vec<TreeLayout> = (0..4).map(|r| TreeLayout::new(&params, &trees, r)).collect();
        // A FIFO set per present peer: rank 3 is a leaf in both trees (one per channel); rank 0 has
        // two children in tree 0 (channels 0, 2) and a parent and a child in tree 1 (channel 1).
        assert_eq!(layouts[3].counters_at, 3 * buffsize);
        assert_eq!(layouts[0].counters_at, (2 + 2 + 2) * buffsize);
        assert_eq!(layouts[0].bytes(), 6 * buffsize + 3 * 4 * COUNTERS_BYTES);
        let bases: Vec<u64> = (0..4).map(|r| (r as u64 + 1) << 32).collect();
        let dev: Vec<Vec<DevTree>> = (0..4)
            .map(|r| build_shared_dev_trees(r, &trees, &layouts, &bases, 7).unwrap())
            .collect();
        let (simple, ll, ll128) = (Proto::Simple as usize, Proto::Ll as usize, Proto::Ll128 as usize);
        for c in 0..3 {
            for (r, dr) in dev.iter().enumerate() {
                let d = &dr[c];
                assert_eq!((d.up, d.down), ud(c, r));
                for (i, &k) in d.down.iter().enumerate() {
                    let Ok(k) = usize::try_from(k) else {
                        assert_eq!(d.send_down[i].buffs, [0; Proto::COUNT]);
                        continue;
                    };
                    // Parent r → child k: the same FIFO, tail and head seen from both ends.
                    let (s, rv) = (&d.send_down[i], &dev[k][c].recv_up);
                    assert_eq!((s.buffs, s.head, s.tail, s.step), (rv.buffs, rv.head, rv.tail, 7));
                    // The FIFO and tail live in the child's memory, the head in the parent's.
                    assert_eq!(s.buffs[simple] >> 32, k as u64 + 1);
                    // The LL and LL128 FIFOs follow the Simple one.
                    assert_eq!(
                        (s.buffs[ll] - s.buffs[simple], s.buffs[ll128] - s.buffs[simple]),
                        (1 << 20, (1 << 20) + (64 << 10))
                    );
                    assert_eq!((s.tail >> 32, s.head >> 32), (k as u64 + 1, r as u64 + 1));
                    // Child k → parent r.
                    let (s, rv) = (&dev[k][c].send_up, &d.recv_down[i]);
                    assert_eq!((s.buffs, s.head, s.tail, s.step), (rv.buffs, rv.head, rv.tail, 7));
                    assert_eq!(s.buffs[simple] >> 32, r as u64 + 1);
                    assert_eq!((s.tail >> 32, s.head >> 32), (r as u64 + 1, k as u64 + 1));
                }
                if d.up < 0 {
                    assert_eq!(d.send_up.buffs, [0; Proto::COUNT]);
                }
            }
        }
        // Every receive FIFO of a rank is its own, one slot apart at least.
        for r in 0..4 {
            let mut fifos: Vec<u64> = dev[r]
                .iter()
                .flat_map(|d| std::iter::once(d.recv_up).chain(d.recv_down))
                .map(|ci| ci.buffs[simple])
                .filter(|&b| b != 0)
                .collect();
            let n = fifos.len();
            fifos.sort();
            fifos.dedup();
            assert_eq!(fifos.len(), n, "rank {r}");
            assert!(fifos.windows(2).all(|w| w[1] - w[0] >= buffsize));
            assert_eq!(n as u64 * buffsize, layouts[r].counters_at);
        }
    }

    #[test]
    fn counters_region_starts_every_head_and_tail_at_the_step() {
        // One rank, 3 channels: the region holds 3 channels × 4 peer slots of COUNTERS_BYTES (256),
        // head at +0 and tail at +128 of each; a CUDA init copies it to `counters_at`. Exactly those
        // 24 u64 words hold the step, every other byte is zero.
        let trees = channel_trees(&[vec![0], vec![1]], 3, crate::graph::Pattern::BalancedTree).unwrap();
        let l = TreeLayout::new(&Params::default(), &trees, 1);
        let v = l.counters(0x0102_0304_0506_0708);
        assert_eq!(v.len() as u64, 3 * 4 * COUNTERS_BYTES);
        assert_eq!(l.bytes() - l.counters_at, v.len() as u64);
        for (w, b) in v.chunks(8).enumerate() {
            let at = w as u64 * 8;
            let want = if at % COUNTERS_BYTES == 0 || at % COUNTERS_BYTES == 128 {
                0x0102_0304_0506_0708
            } else {
                0
            };
            assert_eq!(u64::from_ne_bytes(b.try_into().unwrap()), want, "byte {at}");
        }
    }
}
