//! Channels and their connections in the device communicator block (NCCL's `channel.cc` and
//! `devCommSetup`): each rank's [`DevComm`], its channels' rings and connections, the pointer
//! exchange of direct connections, the NET step sizes, and the trees (per-channel tree
//! connections on CUDA and on the CPU target), with the ring order each channel follows.
use super::*;

/// Builds rank `r`'s communicator block: [`DevComm`], its channels (ring + connections), and the
/// user-rank arrays of each channel's ring (`rings`: channel `c`'s prev, next, index and user ranks,
/// NCCL's `setupChannel`). `conn_base[p]` is the connection memory of rank `p`
/// as this rank's kernels address it; `conn_base[r]` is this rank's own.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_comm_block(
    r: usize,
    nranks: usize,
    nch: u32,
    layout: &ConnLayout,
    conn_base: &[u64],
    block_addr: u64,
    abort_addr: u64,
    params: &Params,
    rings: &ChannelRings,
    peer: PeerChannels,
) -> Vec<u8> {
    let own = conn_base[r];
    build_comm_block_split(
        r,
        nranks,
        nch,
        layout,
        conn_base,
        &vec![[own, own]; peer.total() as usize],
        block_addr,
        abort_addr,
        params,
        rings,
        peer,
    )
}

/// The peer channels of point-to-point work (NCCL's per-peer connections of
/// `channel->peers[peer]`, which NCCL connects on first use and oxccl at init): after the
/// `first` ring channels, `per_peer` channels for each distance `k` in `1..nranks`, whose send
/// connection goes to rank `r + k` and whose receive connection comes from rank `r − k` (mod
/// `nranks`). A send from `r` to `p` and the receive of `p` from `r` use the same channel index
/// on both ranks (distance `p − r`), so every rank's connection memory has the same layout.
/// With `check`, one channel more follows them: the call check's gather
/// ([`PeerChannels::check_channel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PeerChannels {
    pub(super) first: u32,
    pub(super) per_peer: u32,
    pub(super) nranks: u32,
    pub(super) check: bool,
}

impl PeerChannels {
    /// Channels per peer of a GPU communicator of `nranks` ranks when `NCCL_NCHANNELS_PER_PEER`
    /// is unset: 8 peer channels in all, split over the peers (a power of two, at least 1 per
    /// peer), as NCCL spreads its point-to-point channels over the peers. Measured on one H200
    /// shared by 2 ranks (docs/benchmarks.md): a 128 MiB send/recv moves 80, 156 and 275 GB/s
    /// over 2, 4 and 8 channels, each ≈ 5.5 MiB of connection memory per rank.
    pub(super) fn default_per_peer(nranks: usize) -> u32 {
        let per = (8 / nranks.saturating_sub(1).max(1)).max(1) as u32;
        1 << (31 - per.leading_zeros())
    }

    /// Ring channels only (`first` of them).
    #[cfg(test)]
    pub(super) fn none(first: u32) -> PeerChannels {
        PeerChannels {
            first,
            per_peer: 0,
            nranks: 1,
            check: false,
        }
    }
    /// Peer channels in all, the check's included.
    pub(super) fn count(&self) -> u32 {
        self.per_peer * self.nranks.saturating_sub(1) + u32::from(self.check)
    }
    /// The call check's channel (`CheckDesc::channel`): after the point-to-point channels, at
    /// distance 1 (send to `r + 1`, receive from `r − 1`), used by nothing else, so that its
    /// gather never meets a send waiting in a FIFO for its receive. `None` without the check.
    pub(super) fn check_channel(&self) -> Option<u32> {
        self.check.then(|| self.first + self.per_peer * self.nranks.saturating_sub(1))
    }
    /// Ring and peer channels, the check's included.
    pub(super) fn total(&self) -> u32 {
        self.first + self.count()
    }
    /// The (next, prev) of rank `r` on channel `c`, a peer channel (`c ≥ first`).
    pub(super) fn neighbours(&self, c: u32, r: usize) -> (usize, usize) {
        let n = self.nranks as usize;
        let k = if Some(c) == self.check_channel() {
            1
        } else {
            ((c - self.first) / self.per_peer.max(1)) as usize + 1
        };
        ((r + k) % n, (r + n - k % n) % n)
    }
    /// The peer rank `r` receives from on peer channel `c`.
    pub(super) fn recv_peer(&self, r: usize, c: u64) -> usize {
        self.neighbours(c as u32, r).1
    }
    /// The channel of part `j` of a send from `r` to `peer` (`send`) or of a receive of `r`
    /// from `peer`; `peer != r`.
    pub(super) fn channel(&self, r: usize, peer: usize, j: u32, send: bool) -> u32 {
        let n = self.nranks as usize;
        let k = if send { (peer + n - r) % n } else { (r + n - peer) % n };
        self.first + (k as u32 - 1) * self.per_peer + j
    }
}

/// Points the send connection of each channel `c` with `staging[c]` set (the kernel's address
/// of the NET staging block of its next rank) in `block` (a [`build_comm_block`] result) at the
/// step sizes of that staging FIFO, [`crate::transport::STEP_SIZES_OFFSET`] bytes past its tail,
/// so the proxy sends only the bytes each Simple step filled (NCCL's `connFifo[].size` for proxy
/// connections).
pub(super) fn net_step_sizes(block: &mut [u8], layout: &ConnLayout, staging: &[Option<u64>]) {
    for (c, staging) in staging.iter().enumerate() {
        let Some(staging) = *staging else { continue };
        let at = size_of::<DevComm>()
            + c * size_of::<DevChannel>()
            + std::mem::offset_of!(DevChannel, send)
            + std::mem::offset_of!(ConnInfo, sizes);
        let sizes = layout.tail(staging, c as u64) + crate::transport::STEP_SIZES_OFFSET;
        block[at..at + 8].copy_from_slice(&sizes.to_ne_bytes());
    }
}

/// Gives both ring connections of each channel in `block` (a [`build_comm_block`] result of
/// a process group whose ring pairs all use P2P: its ranks share this process's address space) a pointer-exchange slot,
/// [`PTR_EXCHANGE_OFFSET`] bytes past the connection's head counter (in the sender's memory), so
/// the Simple protocol's direct verbs write into the receiver's output (NCCL's "P2P/direct
/// pointer"). Unchanged for one rank or with `NCCL_P2P_DIRECT_DISABLE=1`. Every rank applies the
/// same rule, so both ends of a connection agree.
pub(super) fn direct_pointers(mut block: Vec<u8>, nch: u32, nranks: usize, params: &Params) -> Vec<u8> {
    if nranks < 2 || !params.p2p_direct {
        return block;
    }
    for c in 0..nch as usize {
        let ch = size_of::<DevComm>() + c * size_of::<DevChannel>();
        for conn in [
            std::mem::offset_of!(DevChannel, send),
            std::mem::offset_of!(DevChannel, recv),
        ] {
            let at = ch + conn;
            let mut ci: ConnInfo = bytemuck::pod_read_unaligned(&block[at..at + size_of::<ConnInfo>()]);
            ci.ptr_exchange = ci.head + PTR_EXCHANGE_OFFSET;
            block[at..at + size_of::<ConnInfo>()].copy_from_slice(bytemuck::bytes_of(&ci));
        }
    }
    tracing::debug!(target: "oxccl::init", nranks, nch, "ring connections via P2P/direct pointer");
    block
}

/// Sets the `trees` field of the [`DevComm`] at the start of `block` (a [`build_comm_block`]
/// result) to `array`, the rank's [`DevTree`] array (0: none).
pub(super) fn set_trees(block: &mut [u8], array: u64) {
    let at = std::mem::offset_of!(DevComm, trees);
    block[at..at + 8].copy_from_slice(&array.to_ne_bytes());
}

/// [`build_comm_block`] where this rank's own connection memory is split by transport, per
/// channel `c`: the head counters of its send connection (written by the next rank) in block
/// `own[c][0]`, the receive FIFOs and tail of its receive connection (written by the previous
/// rank) in block `own[c][1]` (e.g. device memory for a P2P neighbour and host memory for a NET
/// one). `conn_base[r]` is unused.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_comm_block_split(
    r: usize,
    nranks: usize,
    nch: u32,
    layout: &ConnLayout,
    conn_base: &[u64],
    own: &[[u64; 2]],
    block_addr: u64,
    abort_addr: u64,
    params: &Params,
    rings: &ChannelRings,
    peer: PeerChannels,
) -> Vec<u8> {
    let nchu = nch as usize;
    let channels_off = size_of::<DevComm>();
    let ranks_off = channels_off + peer.total() as usize * size_of::<DevChannel>();
    let mut buff_sizes = [0u64; Proto::COUNT];
    buff_sizes[Proto::Simple as usize] = params.buffsize;
    buff_sizes[Proto::Ll as usize] = layout.ll_buffsize;
    buff_sizes[Proto::Ll128 as usize] = layout.ll128_buffsize;
    let dc = DevComm {
        rank: r as u32,
        nranks: nranks as u32,
        nchannels: nch,
        abort_flag: abort_addr,
        channels: block_addr + channels_off as u64,
        buff_sizes,
        ..DevComm::zeroed()
    };
    let mut out = Vec::with_capacity(comm_block_bytes(nchu, nranks, peer));
    out.extend_from_slice(bytemuck::bytes_of(&dc));
    for c in 0..peer.total() as u64 {
        // This channel's ring neighbours (rank order unless the topology's rings are used), or
        // a peer channel's.
        let ring_channel = c < nch as u64;
        let (next, prev) = if ring_channel {
            (rings.next(c as usize, r), rings.prev(c as usize, r))
        } else {
            peer.neighbours(c as u32, r)
        };
        let [own_send, own_recv] = own[c as usize];
        let mut send = ConnInfo::zeroed();
        send.buffs[Proto::Simple as usize] = layout.buff(conn_base[next], c);
        if layout.ll_buffsize > 0 {
            send.buffs[Proto::Ll as usize] = layout.ll(conn_base[next], c);
            send.buffs[Proto::Ll128 as usize] = layout.ll128(conn_base[next], c);
        }
        send.step = params.initial_step;
        send.tail = layout.tail(conn_base[next], c);
        send.head = layout.head(own_send, c);
        let mut recv = ConnInfo::zeroed();
        recv.buffs[Proto::Simple as usize] = layout.buff(own_recv, c);
        if layout.ll_buffsize > 0 {
            recv.buffs[Proto::Ll as usize] = layout.ll(own_recv, c);
            recv.buffs[Proto::Ll128 as usize] = layout.ll128(own_recv, c);
        }
        recv.step = params.initial_step;
        recv.tail = layout.tail(own_recv, c);
        recv.head = layout.head(conn_base[prev], c);
        let ch = DevChannel {
            ring: DevRing {
                prev: prev as u32,
                next: next as u32,
                index: if ring_channel { rings.index(c as usize, r) as u32 } else { 0 },
                _pad: 0,
                user_ranks: if ring_channel {
                    block_addr + (ranks_off + c as usize * nranks * 4) as u64
                } else {
                    0
                },
            },
            _pad: 0,
            send,
            recv,
        };
        out.extend_from_slice(bytemuck::bytes_of(&ch));
    }
    for c in 0..nch as usize {
        for u in rings.user_ranks(c, r) {
            out.extend_from_slice(&(u as u32).to_ne_bytes());
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Trees: the double binary tree across nodes with a chain inside each node (NCCL's
// `connectTrees` and the P2P/SHM setup of the tree peers' connections).

/// Receive FIFOs (and counter blocks) per channel of a rank's tree connection memory: peer slot 0
/// is the parent, slot 1 + i child `i`.
pub(super) const TREE_PEERS: usize = 1 + MAX_TREE_ARITY;

/// A communicator's trees as its calls see them: their shape (for the choice) and this rank's
/// tree connection memory in bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct CommTrees {
    pub(super) shape: TreeShape,
    pub(super) bytes: u64,
}

/// Every channel's tree, indexed `[channel][rank]`, for ranks split into `node_chains` (each
/// node's chain in order): the double binary tree with the child nodes attached by `pattern`
/// ([`crate::graph::double_binary_tree`]; NCCL's default is the balanced tree); channel `c` runs
/// tree `c % 2`.
pub(super) fn channel_trees(
    node_chains: &[Vec<usize>],
    nch: u32,
    pattern: crate::graph::Pattern,
) -> Result<Vec<Vec<crate::graph::Tree>>> {
    let [t0, t1] = crate::graph::double_binary_tree(node_chains, pattern)?;
    Ok((0..nch)
        .map(|c| if c % 2 == 0 { t0.clone() } else { t1.clone() })
        .collect())
}

/// The ring graph of one node of a communicator (NCCL's `ncclTopoCompute` for rings, then the
/// rank's part of `AllGather3`): `node_ranks` are the communicator ranks of the node, `node` its
/// index. On CUDA (`bus_ids` = each node rank's PCI bus id) the system is the machine's, this
/// init's `topo` (`NCCL_TOPO_FILE` completed by detection, built once per init), trimmed to the
/// node's GPUs. On the CPU target (`bus_ids` = `None`) this is a test hook: with `NCCL_TOPO_FILE` set to
/// a topology of exactly as many GPUs as the node has ranks, node rank `i` takes the file's GPU
/// of rank `i`, so CPU ranks follow that machine's rings; without it, `None`.
///
/// `None` (with a debug log) whenever no searched ring applies: no topology, a rank's GPU missing
/// from it, two ranks on one GPU, or a failed search; the caller then keeps rank order.
///
/// Errors: the file named by `NCCL_TOPO_FILE` cannot be read (`System`, naming it) or is not a
/// valid topology (`InvalidArgument` naming the file, the line where known, and why).
pub(super) fn node_ring_graph(
    node_ranks: &[usize],
    bus_ids: Option<&[String]>,
    node: usize,
    topo: &LocalTopo,
) -> Result<Option<RankGraphInfo>> {
    let skip = |why: String| {
        tracing::debug!(target: "oxccl::init", node, "rings in rank order: {why}");
        Ok(None)
    };
    let sys = match bus_ids {
        None => match crate::topo::System::from_env() {
            Ok(Some(s)) => s,
            Ok(None) => return skip("CPU target without NCCL_TOPO_FILE".into()),
            // A file the user named but that cannot be read, parsed or built fails init (as on
            // CUDA, where LocalTopo reads the same file), naming the file and why.
            Err(e) => return Err(e),
        },
        Some(_) => {
            // A file the user named but that cannot be read fails init; one that is not a valid
            // topology leaves the rings in rank order.
            topo.xml()?;
            match topo.system() {
                Ok(s) => s,
                Err(e) => return skip(format!("topology: {e}")),
            }
        }
    };
    // The system GPU rank of each node rank.
    let gpu_rank = |i: usize| -> Option<i32> {
        let id = match bus_ids {
            None => sys.gpu_by_rank(i as i32)?,
            Some(b) => sys.node_by_bus_id(crate::topo::NodeType::Gpu, &b[i])?,
        };
        sys.node(id).gpu().map(|g| g.rank)
    };
    let mut sys_ranks = Vec::with_capacity(node_ranks.len());
    for i in 0..node_ranks.len() {
        match gpu_rank(i) {
            Some(g) if !sys_ranks.contains(&g) => sys_ranks.push(g),
            Some(g) => return skip(format!("two ranks on the GPU of topology rank {g}")),
            None => return skip(format!("node rank {i}'s GPU is not in the topology")),
        }
    }
    let mut sys = sys;
    if bus_ids.is_none() && sys.count(crate::topo::NodeType::Gpu) != node_ranks.len() {
        return skip(format!(
            "NCCL_TOPO_FILE has {} GPUs for {} CPU ranks",
            sys.count(crate::topo::NodeType::Gpu),
            node_ranks.len()
        ));
    }
    if let Err(e) = sys.trim(&sys_ranks) {
        return skip(format!("trimming the topology: {e}"));
    }
    let graph = match crate::graph::search_graph(&sys, &crate::graph::GraphRequest::ring(false)) {
        Ok(g) => g,
        Err(e) => return skip(format!("ring search: {e}")),
    };
    let to_comm = |g: usize| {
        sys_ranks
            .iter()
            .position(|&s| s as usize == g)
            .map(|i| node_ranks[i])
    };
    let intra: Option<Vec<Vec<usize>>> = graph
        .intra
        .iter()
        .map(|ch| ch.iter().map(|&g| to_comm(g)).collect())
        .collect();
    let Some(intra) = intra else {
        return skip("the searched rings hold a GPU outside the node".into());
    };
    Ok(Some(RankGraphInfo {
        node,
        ring: crate::graph::GraphInfo::of(&graph),
        intra,
    }))
}

/// The rings of an `nranks`-rank communicator's `nch` channels from every rank's graph
/// information (`None` for a rank without one): NCCL's merge after `AllGather3` and
/// `connectRings` ([`ChannelRings::from_infos`]); rank order (0 → 1 → … → 0) when a rank has none.
pub(super) fn comm_rings(infos: &[Option<RankGraphInfo>], nranks: usize, nch: u32) -> Result<ChannelRings> {
    let all: Option<Vec<RankGraphInfo>> = infos.iter().cloned().collect();
    match all {
        Some(all) if all.len() == nranks => {
            let rings = ChannelRings::from_infos(&all, nch as usize)?;
            tracing::debug!(target: "oxccl::init", nranks, nch, ring0 = ?rings.ring(0), rank_order = rings.is_rank_order(), "rings from the topology");
            Ok(rings)
        }
        _ => Ok(ChannelRings::rank_order(nranks, nch as usize)),
    }
}

/// Layout of one rank's tree connection memory: per tree peer the rank has on each channel (peer
/// slots as [`TREE_PEERS`]; absent peers get none, so a leaf holds one set per channel) a receive
/// FIFO for each protocol — Simple (`NCCL_BUFFSIZE`), LL (`NCCL_LL_BUFFSIZE`) and LL128
/// (`NCCL_LL128_BUFFSIZE`) bytes, in that order, as ring connections have — then per channel and
/// peer slot a counters block: the head of the send connection to that peer at +0, the tail of the
/// receive connection from it at +128.
pub(super) struct TreeLayout {
    /// Offset of the FIFOs of (channel, peer slot), `None` for an absent peer.
    pub(super) fifo: Vec<[Option<u64>; TREE_PEERS]>,
    /// Offset of each protocol's FIFO inside a peer's FIFOs, indexed by [`Proto`].
    pub(super) proto_at: [u64; Proto::COUNT],
    pub(super) counters_at: u64,
}

impl TreeLayout {
    #[cfg(test)]
    pub(super) fn new(params: &Params, trees: &[Vec<crate::graph::Tree>], rank: usize) -> TreeLayout {
        Self::for_peers(params, trees, rank, |_| true)
    }

    /// The layout with FIFOs only for the tree peers `keep` accepts (e.g. those of one
    /// transport); the peer slots and the counters region are as in [`TreeLayout::new`].
    pub(super) fn for_peers(
        params: &Params,
        trees: &[Vec<crate::graph::Tree>],
        rank: usize,
        keep: impl Fn(usize) -> bool,
    ) -> TreeLayout {
        let mut proto_at = [0u64; Proto::COUNT];
        proto_at[Proto::Ll as usize] = params.buffsize;
        proto_at[Proto::Ll128 as usize] = params.buffsize + params.ll_buffsize;
        let buffsize = params.buffsize + params.ll_buffsize + params.ll128_buffsize;
        let mut off = 0u64;
        let fifo = trees
            .iter()
            .map(|t| {
                let me = &t[rank];
                let mut f = [None; TREE_PEERS];
                let present = std::iter::once(me.up).chain(me.down);
                for (slot, peer) in f.iter_mut().zip(present) {
                    if usize::try_from(peer).is_ok_and(&keep) {
                        *slot = Some(off);
                        off += buffsize;
                    }
                }
                f
            })
            .collect();
        TreeLayout {
            fifo,
            proto_at,
            counters_at: off.next_multiple_of(128),
        }
    }
    pub(super) fn bytes(&self) -> u64 {
        self.counters_at + (self.fifo.len() * TREE_PEERS) as u64 * COUNTERS_BYTES
    }
    /// The receive FIFOs of (channel `c`, peer slot `peer`), indexed by [`Proto`]; zeros for an
    /// absent peer.
    pub(super) fn buffs(&self, base: u64, c: usize, peer: usize) -> [u64; Proto::COUNT] {
        self.fifo[c][peer].map_or([0; Proto::COUNT], |o| self.proto_at.map(|p| base + o + p))
    }
    pub(super) fn head(&self, base: u64, c: usize, peer: usize) -> u64 {
        base + self.counters_at + (c * TREE_PEERS + peer) as u64 * COUNTERS_BYTES
    }
    pub(super) fn tail(&self, base: u64, c: usize, peer: usize) -> u64 {
        self.head(base, c, peer) + 128
    }
    /// Offsets of every head and tail counter.
    pub(super) fn counter_offsets(&self) -> Vec<u64> {
        (0..self.fifo.len())
            .flat_map(|c| {
                (0..TREE_PEERS).flat_map(move |peer| [self.head(0, c, peer), self.tail(0, c, peer)])
            })
            .collect()
    }
    /// The counters region (from `counters_at` to the end) with every head and tail at `step`,
    /// the rest zero: what a device copy writes to start the FIFOs at `step`.
    pub(super) fn counters(&self, step: u64) -> Vec<u8> {
        let mut out = vec![0u8; (self.bytes() - self.counters_at) as usize];
        for c in 0..self.fifo.len() {
            for peer in 0..TREE_PEERS {
                for at in [self.head(0, c, peer), self.tail(0, c, peer)] {
                    let i = (at - self.counters_at) as usize;
                    out[i..i + 8].copy_from_slice(&step.to_ne_bytes());
                }
            }
        }
        out
    }
}

/// A tree connection's [`ConnInfo`] at `initial_step`: FIFOs `buffs`, head and tail counters.
pub(super) fn tree_conn(buffs: [u64; Proto::COUNT], head: u64, tail: u64, initial_step: u64) -> ConnInfo {
    let mut ci = ConnInfo::zeroed();
    ci.buffs = buffs;
    ci.head = head;
    ci.tail = tail;
    ci.step = initial_step;
    ci
}

/// The (send, receive) connections of one tree edge between two ranks that reach each other's
/// tree memory (P2P, SHM, one process): this rank's memory (`lm` at `bm`) holds the receive FIFOs
/// of its peer slot `mine`, the peer's (`lp` at `bp`) those of its slot `theirs` for this rank.
/// The send connection writes the peer's FIFOs and tail and is freed through this rank's head;
/// the receive connection reads this rank's FIFOs and frees the peer's head.
pub(super) fn shared_tree_edge(
    c: usize,
    (lm, bm, mine): (&TreeLayout, u64, usize),
    (lp, bp, theirs): (&TreeLayout, u64, usize),
    initial_step: u64,
) -> (ConnInfo, ConnInfo) {
    (
        tree_conn(
            lp.buffs(bp, c, theirs),
            lm.head(bm, c, mine),
            lp.tail(bp, c, theirs),
            initial_step,
        ),
        tree_conn(
            lm.buffs(bm, c, mine),
            lp.head(bp, c, theirs),
            lm.tail(bm, c, mine),
            initial_step,
        ),
    )
}

/// Rank `r`'s [`DevTree`] of every channel: its parent and children, and a connection to and from
/// each (NCCL's tree `ncclConnInfo`s). `edge(c, peer, mine, theirs)` gives the (send, receive)
/// connections of the edge to `peer` on channel `c`, where `mine` is the peer's slot in `r`'s
/// tree memory and `theirs` is `r`'s slot in the peer's (slot 0: the parent, `1 + i`: child `i`):
/// for the edge between parent `p` and its child `r` (child slot `j` of `p`), `r` writes `p`'s
/// FIFO of slot `1 + j` and `p` writes `r`'s FIFO of slot 0 ([`shared_tree_edge`] when both reach
/// each other's memory). Errors: `Internal` when the trees are not consistent (a child that does
/// not name its parent).
pub(super) fn build_dev_trees(
    r: usize,
    trees: &[Vec<crate::graph::Tree>],
    mut edge: impl FnMut(usize, usize, usize, usize) -> Result<(ConnInfo, ConnInfo)>,
) -> Result<Vec<DevTree>> {
    let me = r;
    let mut out = Vec::with_capacity(trees.len());
    for (c, t) in trees.iter().enumerate() {
        let tr = &t[me];
        let mut d = DevTree {
            up: tr.up,
            down: tr.down,
            depth: tr.depth,
            ..DevTree::zeroed()
        };
        if let Ok(p) = usize::try_from(tr.up) {
            let j = t[p].down.iter().position(|&x| x == me as i32).ok_or_else(|| {
                Error::Internal(format!(
                    "channel {c}: rank {me}'s parent {p} does not list it among its children {:?}",
                    t[p].down
                ))
            })?;
            (d.send_up, d.recv_up) = edge(c, p, 0, 1 + j)?;
        }
        for (i, &k) in tr.down.iter().enumerate() {
            let Ok(k) = usize::try_from(k) else { continue };
            if t[k].up != me as i32 {
                return Err(Error::Internal(format!(
                    "channel {c}: rank {me} lists child {k} whose parent is {}",
                    t[k].up
                )));
            }
            (d.send_down[i], d.recv_down[i]) = edge(c, k, 1 + i, 0)?;
        }
        out.push(d);
    }
    Ok(out)
}

/// Bytes reserved per channel for the two step counters (head, tail), each on its own 128-byte line.
pub(super) const COUNTERS_BYTES: u64 = 256;

/// Layout of one rank's connection memory: per channel a Simple receive buffer, then per channel
/// the counters block (head of the send connection at +0, tail of the receive connection at +128).
pub(super) struct ConnLayout {
    pub(super) buffsize: u64,
    pub(super) ll_buffsize: u64,
    pub(super) ll128_buffsize: u64,
    pub(super) nch: u64,
}
impl ConnLayout {
    /// Every connection has a Simple, an LL and an LL128 receive buffer of `params`' sizes.
    pub(super) fn new(params: &Params, nch: u32) -> Self {
        ConnLayout {
            buffsize: params.buffsize,
            ll_buffsize: params.ll_buffsize,
            ll128_buffsize: params.ll128_buffsize,
            nch: nch as u64,
        }
    }
    pub(super) fn per_channel(&self) -> u64 {
        self.buffsize + self.ll_buffsize + self.ll128_buffsize
    }
    pub(super) fn bytes(&self) -> u64 {
        self.nch * (self.per_channel() + COUNTERS_BYTES)
    }
    /// The Simple receive buffer of channel `c`.
    pub(super) fn buff(&self, base: u64, c: u64) -> u64 {
        base + c * self.per_channel()
    }
    /// The LL receive buffer of channel `c`.
    pub(super) fn ll(&self, base: u64, c: u64) -> u64 {
        self.buff(base, c) + self.buffsize
    }
    /// The LL128 receive buffer of channel `c` (128-byte aligned: every size is a multiple of 128).
    pub(super) fn ll128(&self, base: u64, c: u64) -> u64 {
        self.ll(base, c) + self.ll_buffsize
    }
    /// Offsets of every channel's two step counters (head, tail) from the block's start.
    pub(super) fn counter_offsets(&self) -> Vec<u64> {
        (0..self.nch)
            .flat_map(|c| [self.head(0, c), self.tail(0, c)])
            .collect()
    }

    pub(super) fn head(&self, base: u64, c: u64) -> u64 {
        base + self.nch * self.per_channel() + c * COUNTERS_BYTES
    }
    pub(super) fn tail(&self, base: u64, c: u64) -> u64 {
        self.head(base, c) + 128
    }
}

/// Layout of one rank's communicator block: DevComm, the `nch` ring channels and the peer
/// channels, then per ring channel the ring's user ranks.
pub(super) fn comm_block_bytes(nch: usize, nranks: usize, peer: PeerChannels) -> usize {
    size_of::<DevComm>() + peer.total() as usize * size_of::<DevChannel>() + nch * nranks * 4
}

#[cfg(test)]
mod direct_tests {
    use super::*;

    #[test]
    fn gpu_peer_channels_are_eight_split_over_the_peers() {
        let got: Vec<u32> =
            [1usize, 2, 3, 4, 5, 6, 9, 64].iter().map(|&n| PeerChannels::default_per_peer(n)).collect();
        assert_eq!(got, [8, 8, 4, 2, 2, 1, 1, 1]);
    }

    /// A CPU `init_all` rank's own connection memory, as bytes.
    fn conn_mem(comm: &Comm) -> &[u8] {
        let Res::Cpu(res) = &comm.res else {
            panic!("CPU communicator expected")
        };
        let OwnConn::Host(m) = &res.group._own else {
            panic!("in-process host connection memory expected")
        };
        // SAFETY: the block is alive while `comm` is; the test reads it between calls only.
        unsafe { std::slice::from_raw_parts(m.addr() as *const u8, m.len()) }
    }

    #[test]
    fn pointer_exchanges_pair_the_two_ends_of_each_connection() {
        let params = Params::default();
        let layout = ConnLayout::new(&params, 2);
        let bases = [0x1000_0000_0000u64, 0x2000_0000_0000, 0x3000_0000_0000];
        let rings = ChannelRings::new(vec![vec![0, 1, 2], vec![0, 2, 1]], 3).unwrap();
        let chans = |r: usize, p: &Params| -> Vec<DevChannel> {
            let b = build_comm_block(r, 3, 2, &layout, &bases, 0x5000, 0x6000, p, &rings, PeerChannels::none(2));
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
            build_comm_block(0, 1, 2, &layout, &bases, 0x5000, 0x6000, &params, &rings, PeerChannels::none(2)),
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
            let mem = conn_mem(comm);
            let layout = ConnLayout::new(&comm.params, comm.nchannels + comm.peer_channels.count());
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
            fifo_zero(&comms[1]),
            "a direct Broadcast wrote rank 1's Simple FIFO"
        );
        // One exchange per channel: rank 0's slot (its head line) holds rank 1's output and count 1.
        let layout = ConnLayout::new(&comms[0].params, comms[0].nchannels + comms[0].peer_channels.count());
        let mem0 = conn_mem(&comms[0]);
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
            !fifo_zero(&comms[1]),
            "a Reduce to rank 1 left its FIFOs untouched"
        );
    }
}

#[cfg(test)]
mod comm_block_tests {
    use super::*;

    #[test]
    fn split_own_memory_by_transport() {
        // Rank 1 of 3, 2 channels. Channel 0: next (2) reached through P2P, prev (0) through NET:
        // its send head must be in its device block (own[0][0]) where rank 2 writes it, its
        // receive FIFOs and tail in its host block (own[0][1]) where the proxy writes them.
        // Channel 1 (rings may differ per channel, so may the transports): the other way round.
        // Peers' blocks as given.
        let params = Params::default();
        let layout = ConnLayout::new(&params, 2);
        let bases = [0x1000_0000_0000u64, 0, 0x3000_0000_0000];
        let own = [
            [0x7000_0000_0000u64, 0x9000_0000_0000],
            [0x9000_0000_0000u64, 0x7000_0000_0000],
        ];
        let rings = ChannelRings::rank_order(3, 2);
        let mut bytes =
            build_comm_block_split(1, 3, 2, &layout, &bases, &own, 0x5000, 0x6000, &params, &rings, PeerChannels::none(2));
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
            build_comm_block(1, 3, 2, &layout, &whole, 0x5000, 0x6000, &params, &rings, PeerChannels::none(2)),
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
                &rings,
                PeerChannels::none(2)
            )
        );
    }

    /// The comm block of rank 1 of 4 ranks on 2 ring channels in rank order and the channels
    /// `pc`, with its layout and the ranks' connection bases; its size checked.
    fn rank_1_of_4_block(pc: PeerChannels) -> (ConnLayout, [u64; 4], Vec<u8>) {
        let params = Params::default();
        let layout = ConnLayout::new(&params, pc.total());
        let bases = [0x1000_0000_0000u64, 0x2000_0000_0000, 0x3000_0000_0000, 0x4000_0000_0000];
        let rings = ChannelRings::rank_order(4, 2);
        let b = build_comm_block(1, 4, 2, &layout, &bases, 0x5000, 0x6000, &params, &rings, pc);
        assert_eq!(b.len(), comm_block_bytes(2, 4, pc));
        (layout, bases, b)
    }

    #[test]
    fn peer_channels_pair_each_send_with_the_peers_receive() {
        // 4 ranks, 2 ring channels, 2 channels per peer: channels 2..8, distance k on
        // 2 + 2(k − 1) and 3 + 2(k − 1).
        let pc = PeerChannels {
            first: 2,
            per_peer: 2,
            nranks: 4,
            check: false,
        };
        assert_eq!((pc.count(), pc.total(), pc.check_channel()), (6, 8, None));
        for r in 0..4usize {
            for p in (0..4usize).filter(|&p| p != r) {
                for j in 0..2 {
                    let c = pc.channel(r, p, j, true);
                    // The send goes to `p` on that channel, and `p` receives from `r` on it.
                    assert_eq!(pc.neighbours(c, r).0, p, "send {r} → {p} part {j}");
                    assert_eq!(pc.channel(p, r, j, false), c, "recv of {p} from {r} part {j}");
                    assert_eq!(pc.recv_peer(p, c as u64), r);
                    assert!((2..8).contains(&c));
                }
            }
        }
        // The block: the peer channels follow the ring channels, with the shift's neighbours
        // and no user ranks.
        let (layout, bases, b) = rank_1_of_4_block(pc);
        let chans: &[DevChannel] = bytemuck::cast_slice(&b[size_of::<DevComm>()..][..8 * size_of::<DevChannel>()]);
        for (c, ch) in chans.iter().enumerate().skip(2) {
            let k = (c - 2) / 2 + 1;
            let (next, prev) = ((1 + k) % 4, (1 + 4 - k) % 4);
            assert_eq!((ch.ring.next as usize, ch.ring.prev as usize, ch.ring.user_ranks), (next, prev, 0), "channel {c}");
            assert_eq!(ch.send.buffs[Proto::Simple as usize], layout.buff(bases[next], c as u64));
            assert_eq!(ch.recv.head, layout.head(bases[prev], c as u64));
        }
    }

    #[test]
    fn the_check_channel_follows_the_peer_channels_at_distance_one() {
        let pc = PeerChannels {
            first: 2,
            per_peer: 2,
            nranks: 4,
            check: true,
        };
        assert_eq!((pc.count(), pc.total(), pc.check_channel()), (7, 9, Some(8)));
        for r in 0..4usize {
            assert_eq!(pc.neighbours(8, r), ((r + 1) % 4, (r + 3) % 4), "rank {r}");
            for p in (0..4usize).filter(|&p| p != r) {
                for j in 0..2 {
                    for send in [true, false] {
                        assert_ne!(pc.channel(r, p, j, send), 8, "no send or receive uses the check's channel");
                    }
                }
            }
        }
        let (layout, bases, b) = rank_1_of_4_block(pc);
        let chans: &[DevChannel] = bytemuck::cast_slice(&b[size_of::<DevComm>()..][..9 * size_of::<DevChannel>()]);
        let ch = &chans[8];
        assert_eq!((ch.ring.next, ch.ring.prev), (2, 0));
        assert_eq!(ch.send.buffs[Proto::Simple as usize], layout.buff(bases[2], 8));
        assert_eq!(ch.recv.head, layout.head(bases[0], 8));
    }

    #[test]
    fn comm_block_follows_each_channels_ring() {
        // 3 ranks, 2 channels: channel 0 in rank order, channel 1 on ring 0 -> 2 -> 1 -> 0. Rank 1
        // sends to 2 and receives from 0 on channel 0, sends to 0 and receives from 2 on
        // channel 1; its user ranks are 1 2 0 and 1 0 2, its index (distance from rank 0) 1 and 2.
        let params = Params::default();
        let layout = ConnLayout::new(&params, 2);
        let bases = [0x1000_0000_0000u64, 0x2000_0000_0000, 0x3000_0000_0000];
        let rings = ChannelRings::new(vec![vec![0, 1, 2], vec![0, 2, 1]], 3).unwrap();
        let block = 0x5000u64;
        let bytes = build_comm_block(1, 3, 2, &layout, &bases, block, 0x6000, &params, &rings, PeerChannels::none(2));
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
}

#[cfg(test)]
mod tree_tests {
    use super::*;

/// [`build_dev_trees`] for ranks that all reach each other's tree memory (`layouts[k]` at
/// `bases[k]`): ranks of one process.
fn build_shared_dev_trees(
    r: usize,
    trees: &[Vec<crate::graph::Tree>],
    layouts: &[TreeLayout],
    bases: &[u64],
    initial_step: u64,
) -> Result<Vec<DevTree>> {
    build_dev_trees(r, trees, |c, p, mine, theirs| {
        Ok(shared_tree_edge(
            c,
            (&layouts[r], bases[r], mine),
            (&layouts[p], bases[p], theirs),
            initial_step,
        ))
    })
}

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
