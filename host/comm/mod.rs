//! Communicators (NCCL's `ncclComm`): the [`Comm`] type, the resources a rank holds, its
//! accessors and its drop. A communicator is one rank's view of a group of ranks that run
//! collectives together: its channels (each a ring, and on several hosts a tree), its connection
//! memory and links to its neighbours, and the communicator block its kernels read.
//!
//! Where each part lives (NCCL's file in parentheses):
//!
//! | file | what | NCCL |
//! |---|---|---|
//! | `init.rs` | [`Comm::init_all`], [`Comm::init_rank`] (and their `_config` forms) | `init.cc` |
//! | `init_phases.rs` | the phase timer of one setup, for debug logs | — |
//! | `launcher.rs` | [`Comm::from_env`]: one rank per process from a launcher's variables | — |
//! | `peer_info.rs` | checks of what ranks tell each other at init, settings every rank must share | `init.cc` |
//! | `channel.rs` | channels, connection layout, the communicator block | `channel.cc` |
//! | `rank_trees.rs` | the trees of `init_rank` communicators spanning hosts | `connectTrees` |
//! | `collectives.rs` | the public calls and their argument checks | `collectives.cc`, `argcheck.cc` |
//! | `split.rs` | [`Comm::split`]: colour and key, a new communicator per colour | `init.cc` (`ncclCommSplit`) |
//! | `send_recv.rs` | send and receive: checks, works over the peer channels, launch | `collectives.cc`, `enqueue.cc` |
//! | `enqueue.rs` | plan and launch of one call | `enqueue.cc` |
//! | `abort.rs` | abort, async errors, finalize, destroy, teardown order | `init.cc` |
//! | `call_check.rs` | `OXCCL_CHECK_CALLS=1`: ranks agree on each collective call before it writes a user buffer | — |
//! | `timeout.rs` | calls that make no progress for `OXCCL_TIMEOUT` time out, naming who they wait for | (NCCL 2.30's `ncclTimeout`) |
//! | `flight_recorder.rs` | each communicator's last calls, dumped as JSON; `analyze` (`oxccl trace`) | (PyTorch's flight recorder) |
//! | `test_hooks.rs` | `OXCCL_TEST_NODES`, `OXCCL_TEST_TREE_PATTERN`: several hosts simulated on one | — |
//!
//! The transports themselves (peer information, the selection per pair, P2P with its
//! `NCCL_P2P_LEVEL` rules and peer access, SHM, NET) are in [`crate::transport`].
//!
//! Every communicator is built by one per-rank setup: `Comm::init_rank` (ranks meet through a TCP
//! bootstrap) and `Comm::init_all(devices)` (a thread per device, an in-process bootstrap: NCCL's
//! `ncclCommInitAll` as a group of `ncclCommInitRank`) differ only in how the ranks meet and in
//! what the transport decides per pair. Each channel's ring follows the topology's searched ring
//! order (NCCL's graph search, `AllGather3` merge and `setupChannel`: [`crate::graph::connect`]),
//! or rank order where no topology applies. Each rank owns, per channel, a receive buffer of
//! `NCCL_BUFFSIZE` bytes per protocol and two step counters (its send connection's head, its
//! receive connection's tail); its ring neighbours write into them through the pair's transport
//! (P2P: device pointer, CUDA IPC or, on the CPU target in one process, plain address; SHM; NET
//! through the proxy). The ranks of one `init_all` also form a process group (`ProcessGroup`).
use crate::cpu::{CpuStream, HostMem};
use crate::cuda;
use crate::error::{Error, Result};
use crate::graph::{ChannelRings, RankGraphInfo};
use crate::mem::{DevSlice, Device, Stream};
use crate::params::{CommConfig, Params};
use crate::redop::ReduceOp;
use crate::tuning::{Selection, TreeShape};
use bytemuck::Zeroable;
use oxccl_gpu::abi::{
    Algo, ConnInfo, DEFAULT_CHUNK_STEPS, DataType, DevChannel, DevComm, DevRedOp, DevRing, DevTree,
    FIFO_STEPS, Func, KernelArgs, MAX_CHANNELS, MAX_TREE_ARITY, PACK_BYTES, PTR_EXCHANGE_OFFSET, Proto,
    REDOP_SCALAR_DEVICE, RedOp, WorkColl,
};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod abort;
mod call_check;
mod channel;
mod collectives;
mod enqueue;
mod init;
mod init_phases;
mod launcher;
mod peer_info;
mod plan;
pub(crate) use plan::{EmptyCall, Planned, PlannedColl};
mod rank_trees;
mod send_recv;
mod split;
pub use split::SPLIT_NOCOLOR;
pub(crate) use send_recv::P2pTarget;
mod test_hooks;
mod timeout;
pub mod flight_recorder;
use abort::*;
use channel::*;
use peer_info::*;
use test_hooks::*;
pub use enqueue::Choice;
use enqueue::*;
use crate::topo::LocalTopo;
use crate::transport::p2p;
use crate::transport::shm::RegisteredShm;
use crate::transport::{ConnDesc, ConnectTo, HostConns, OwnConn, PeerInfo, PeerLink, PeerMem, select_transport};

/// "rank 1 of communicator 00c0ffee": how diagnostics (timeouts, call mismatches, a peer's abort)
/// name a rank, with the communicator's id ([`Comm::comm_id`], as flight-recorder dumps and
/// `oxccl trace` show it), so that a process with several communicators (splits) knows which.
pub(crate) fn rank_of(rank: usize, comm: u64) -> String {
    format!("rank {rank} of communicator {comm:08x}")
}

/// Default channel count on CUDA devices (overridable with `NCCL_MAX_NCHANNELS`).
pub const CUDA_DEFAULT_NCHANNELS: u32 = 64;
/// Default channel count on the CPU target (each channel is a host thread per rank).
pub const CPU_DEFAULT_NCHANNELS: u32 = 2;

/// One rank of a communicator (NCCL's `ncclComm`). Collectives are queued on the caller's stream
/// and return at once; completion is observed by synchronizing that stream.
///
/// A `Comm` is a handle on the rank's state, which calls queued in an open group
/// ([`crate::group::group_start`]) hold too: the rank is torn down (its drop: wait for its work,
/// then free) when its last holder is gone — the `Comm`, or the group's end that launched them.
pub struct Comm {
    state: Arc<CommState>,
}

mod state {
    use super::*;

    /// The state of one rank that every handle of it shares ([`Comm`] derefs to it).
    pub struct CommState {
        pub(in crate::comm) rank: usize,
        pub(in crate::comm) nranks: usize,
        pub(in crate::comm) device: Device,
        pub(in crate::comm) params: Params,
        pub(in crate::comm) selection: Selection,
        pub(in crate::comm) nchannels: u32,
        /// The communicator's id ([`Comm::comm_id`]).
        pub(in crate::comm) comm_tag: u64,
        /// The peer channels of point-to-point work, after the ring channels.
        pub(in crate::comm) peer_channels: PeerChannels,
        /// The point-to-point kernel, loaded at init (a load while a peer's kernel spins could
        /// wait for it); `None` on the CPU target.
        pub(in crate::comm) p2p_module: Option<Arc<cuda::Module>>,
        /// Where this rank's receives report a size mismatch.
        pub(in crate::comm) p2p_status: Arc<send_recv::StatusMem>,
        /// The call-signature check (`OXCCL_CHECK_CALLS=1`, more than one rank), else `None`.
        pub(in crate::comm) call_check: Option<call_check::CallCheck>,
        pub(in crate::comm) dev_comm: u64,
        pub(in crate::comm) res: Res,
        pub(in crate::comm) inflight: Arc<AtomicUsize>,
        /// Kernels queued by this rank ([`Comm::kernel_launches`]).
        pub(in crate::comm) launches: Arc<AtomicU64>,
        pub(in crate::comm) last: Mutex<Option<Choice>>,
        /// The double binary tree's connections, when the communicator spans several nodes and they
        /// were set up (ranks on two or more hosts, or `init_all` with `OXCCL_TEST_NODES`, unless
        /// `NCCL_ALGO` excludes the tree); `None` otherwise.
        pub(in crate::comm) trees: Option<CommTrees>,
        /// Every channel's ring (NCCL's `channel->ring`).
        pub(in crate::comm) rings: Arc<ChannelRings>,
        /// Set by [`Comm::finalize`]: later collectives are refused.
        pub(in crate::comm) finalized: std::sync::atomic::AtomicBool,
        /// Set by [`Comm::revoke`]: later collectives, sends, receives and finalize are refused.
        pub(in crate::comm) revoked: std::sync::atomic::AtomicBool,
        /// The settings it was created with, inherited by the communicators split or shrunk from it.
        pub(in crate::comm) config: CommConfig,
        /// What the rings run over, for the tuning model (the same on every rank).
        pub(in crate::comm) fabric: crate::tuning::Fabric,
        /// Bytes of this rank's connection memory (laid out for at least `nchannels` channels).
        pub(in crate::comm) conn_bytes: u64,
        /// Whether the ring connections have pointer exchanges ([`Comm::direct_pointer`]).
        pub(in crate::comm) direct: bool,
        /// The ranks of this rank's [`Comm::init_all`]; `None` for [`Comm::init_rank`].
        pub(in crate::comm) process: Option<Arc<ProcessGroup>>,
        /// The calls issued and, with `OXCCL_TIMEOUT`, the watch that times them out
        /// (`comm/timeout.rs`); retired first when the communicator is dropped.
        pub(in crate::comm) watch: Arc<timeout::Watch>,
    }
}
use state::CommState;

impl std::ops::Deref for Comm {
    type Target = CommState;
    fn deref(&self) -> &CommState {
        &self.state
    }
}

impl Comm {
    /// A communicator of `state`, its only handle.
    fn from_state(state: CommState) -> Comm {
        Comm { state: Arc::new(state) }
    }

    /// Another handle on this rank (for a call queued in a group, which runs after the caller's
    /// borrow of this one ends).
    pub(crate) fn handle(&self) -> Comm {
        Comm { state: Arc::clone(&self.state) }
    }

    /// Whether `other` is a handle on the same rank as this one.
    pub(crate) fn same_rank(&self, other: &Comm) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// Whether handles other than this one exist (calls queued in an open group).
    pub(super) fn has_other_handles(&self) -> bool {
        Arc::strong_count(&self.state) > 1
    }
}

enum Res {
    Cuda(CudaRes),
    Cpu(CpuRes),
}

struct CudaRes {
    ctx: Arc<cuda::Context>,
    group: Arc<CudaGroup>,
    launch: Arc<LaunchState>,
    /// The other ranks of this rank's process group on its GPU, whose launches this rank's next
    /// launch waits for ([`wait_launches`]); empty outside a process group.
    sharing: Vec<usize>,
}

/// A CUDA rank's memory and its links to its peers. Peers' kernels write into this memory, and
/// with direct pointers into the caller's buffers, so it is freed only after the teardown
/// barrier (across processes) or once every rank of its process group is gone.
struct CudaGroup {
    _comm_mem: cuda::DevAlloc,
    _conn_mem: Vec<cuda::DevAlloc>,
    /// Bootstrap, peer mappings, shared abort page.
    mp: InitRankRes,
}

/// The CPU target keeps a rank's memory alive until its last queued operation is done (and, in
/// a process group, until every rank of the group is: a rank's blocks write into its
/// neighbours' FIFOs).
struct CpuRes {
    group: Arc<CpuGroup>,
}

struct CpuGroup {
    comm_mem: HostMem,
    /// This rank's count of operations whose blocks are running now, a subset of its queued
    /// ones. A running CPU kernel whose abort flag is raised ends at its next wait, however long
    /// its current copy takes.
    running: AtomicUsize,
    /// This rank's newest launch: its stream and its end, which a launch on another stream
    /// waits for (a communicator's kernels run in the order issued, `CpuBlocks::launch`).
    last_launch: Mutex<Option<(usize, Arc<LaunchDone>)>>,
    /// Of this rank's queued operations, the launches of captured graphs now running
    /// (`enqueue.rs`, `CpuBlocks::capture`): not watched by `OXCCL_TIMEOUT`.
    replaying: Arc<AtomicUsize>,
    /// This rank's connection memory, shared with its ring neighbours.
    _own: OwnConn,
    /// Bootstrap, peer mappings, shared abort page.
    mp: InitRankRes,
}

/// The ranks of one [`Comm::init_all`] (NCCL's `ncclCommInitAll`: a group of `ncclCommInitRank`
/// in one process, met through an in-process bootstrap): what each rank needs of the others of
/// its process beyond its connections — their launches (ranks sharing a GPU launch in step),
/// their queued operations and communicator blocks (an abort with direct pointers waits for
/// them and marks them) — and every rank's memory, kept until the last rank of the group is
/// dropped (their kernels write into each other's memory, with direct pointers into the
/// caller's buffers).
pub(super) struct ProcessGroup {
    members: Vec<std::sync::OnceLock<Member>>,
}

/// One rank of a [`ProcessGroup`].
enum Member {
    Cuda {
        group: Arc<CudaGroup>,
        launch: Arc<LaunchState>,
    },
    Cpu {
        group: Arc<CpuGroup>,
        inflight: Arc<AtomicUsize>,
    },
}

impl ProcessGroup {
    fn new(nranks: usize) -> ProcessGroup {
        ProcessGroup {
            members: (0..nranks).map(|_| std::sync::OnceLock::new()).collect(),
        }
    }

    /// The members registered so far, by rank (every rank once init has returned).
    fn members(&self) -> impl Iterator<Item = (usize, &Member)> {
        self.members.iter().enumerate().filter_map(|(r, m)| m.get().map(|m| (r, m)))
    }

    /// Rank `r`'s launch state (CUDA ranks).
    fn launch(&self, r: usize) -> Option<&Arc<LaunchState>> {
        match self.members.get(r)?.get()? {
            Member::Cuda { launch, .. } => Some(launch),
            Member::Cpu { .. } => None,
        }
    }
}

/// What a communicator holds besides its own memory: the bootstrap, the gathered peer
/// information, its mappings of its neighbours' memory and the shared abort page.
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

impl Comm {
    /// This communicator's rank.
    /// The communicator's id: the same on every rank of it, different for every communicator
    /// (a hash of its unique id, or of its `init_all` group; NCCL's `commHash`). Names the
    /// communicator in logs, flight-recorder dumps and `/dev/shm` names.
    pub fn comm_id(&self) -> u64 {
        self.comm_tag
    }

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
    /// Kernels this rank has queued so far — collective, point-to-point and call-check kernels
    /// (a captured one counts once, when captured; one rank's copies are not kernels): how
    /// its calls were launched. A group's consecutive collectives of one kernel entry share a
    /// launch ([`crate::group::launch_collectives`]), and its sends and receives take one.
    pub fn kernel_launches(&self) -> u64 {
        self.launches.load(Ordering::Acquire)
    }
    /// Channel `channel`'s ring as this rank's kernels walk it, starting at this rank: NCCL's
    /// `channel->ring.userRanks` (`userRanks[k]` is `k` hops downstream; `[1]` is `ring.next`).
    /// Rank order (`rank, rank + 1, …`) unless the rings follow a topology (see
    /// [`Comm::init_all`]). `None` for `channel` outside `0..nchannels()`.
    pub fn ring(&self, channel: usize) -> Option<Vec<usize>> {
        (channel < self.rings.nchannels()).then(|| self.rings.user_ranks(channel, self.rank))
    }
    /// Whether this rank's ring connections write straight into the receiver's output (NCCL's
    /// "P2P/direct pointer"): the ranks of a `Comm::init_all` share one address space, so when
    /// every ring pair uses P2P a Broadcast, AllGather or AllReduce on the Simple protocol stores
    /// each hop's data in the next rank's output instead of its FIFO, saving the receiver a
    /// copy. False for one rank, for `Comm::init_rank`, when a ring pair uses SHM or NET, and
    /// with `NCCL_P2P_DIRECT_DISABLE=1`.
    ///
    /// On GPUs the next rank's buffers must be reachable from this rank's device: true of
    /// `cuMemAlloc`/`cudaMalloc` memory once init_all has enabled peer access, not of `cuMemCreate`
    /// memory mapped for one device only (set `NCCL_P2P_DIRECT_DISABLE=1` for such buffers, as
    /// with NCCL).
    pub fn direct_pointer(&self) -> bool {
        self.direct
    }
    /// The flight recorder's dump of this rank (`comm/flight_recorder.rs`): one JSON object
    /// with the communicator's id, this rank, the collectives it issued, its last
    /// `OXCCL_FLIGHT_RECORDER_SIZE` calls (collectives: sequence number, collective, count, type,
    /// operator, root, algorithm/protocol/channels; sends and receives: peer, count, type, size,
    /// number among the calls with that peer, group; each with its issue time), a timeout's
    /// message and its ring channels' step counters. Feed the dumps of every rank to `oxccl
    /// trace` (or [`flight_recorder::analyze`]) to see which rank is behind or disagrees, and
    /// which sends and receives miss their match.
    pub fn flight_record(&self) -> String {
        self.watch.dump().to_string()
    }
    /// The transport this rank's connections to `peer` use (NCCL's "via P2P/SHM/NET" of its
    /// `Channel` log lines): the one choice per pair ([`crate::transport`]), the same on both
    /// ends, for rings and trees alike; P2P for `peer == rank`. `None` for `peer` outside
    /// `0..nranks()`.
    pub fn transport_to(&self, peer: usize) -> Option<crate::transport::TransportKind> {
        (peer < self.nranks).then(|| select_transport(&self.init_rank_res().peers, self.rank, peer))
    }
    /// The parameters this communicator was created with.
    pub fn params(&self) -> &Params {
        &self.params
    }
    /// Device memory used by this rank's connections and communicator state, in bytes.
    pub fn device_memory_bytes(&self) -> u64 {
        self.conn_bytes
            + comm_block_bytes(self.nchannels as usize, self.nranks, self.peer_channels) as u64
            + self.trees.map_or(0, |t| t.bytes)
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

    /// Whether this rank was created together with every other rank of its communicator in this
    /// process ([`Comm::init_all`], or a group holding every rank of a unique id: see
    /// [`crate::group::init_rank`]); such ranks share one process group and meet no peer
    /// through a bootstrap at teardown.
    pub fn in_process_group(&self) -> bool {
        self.process.is_some()
    }

    /// True once its abort flag was raised: [`Comm::abort`] (here or on another rank of its
    /// host), a timed-out call, or a drop that had to stop queued work; not for a revoked
    /// communicator ([`Comm::is_revoked`]), whose flag stays raised but which is kept for
    /// split, shrink and destroy.
    pub fn is_aborted(&self) -> bool {
        self.flag_state() != 0 && !self.is_revoked()
    }

    /// True once [`Comm::revoke`] succeeded.
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

}

impl CommState {
    /// The bootstrap, peers, links and shared abort page of this rank.
    fn init_rank_res(&self) -> &InitRankRes {
        match &self.res {
            Res::Cuda(r) => &r.group.mp,
            Res::Cpu(r) => &r.group.mp,
        }
    }
}

impl Drop for CudaGroup {
    /// The teardown barrier before any memory is freed (see [`InitRankRes::sync_teardown`]);
    /// errors are logged there.
    fn drop(&mut self) {
        let _ = self.mp.sync_teardown();
    }
}

impl Drop for CpuGroup {
    /// As for [`CudaGroup`].
    fn drop(&mut self) {
        let _ = self.mp.sync_teardown();
    }
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

impl Drop for CommState {
    /// Waits (bounded) for this rank's last queued operation, then raises the abort flag so a
    /// kernel still waiting for a peer exits, then frees everything. Never panics.
    fn drop(&mut self) {
        self.watch.retire();
        let start = Instant::now();
        match &self.res {
            Res::Cuda(res) => {
                if !res.launch.launched.load(Ordering::Acquire) {
                    return;
                }
                loop {
                    match res.launch.last_complete() {
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
