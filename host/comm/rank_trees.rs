//! The trees of communicators that span several hosts (or test nodes) (NCCL's
//! `connectTrees`, then `ncclTransportP2pSetup` for the tree peers): the double binary tree
//! across the hosts with a chain inside each, connected over whatever transport each tree edge
//! needs — P2P or SHM inside a host, NET between hosts.
//!
//! Every rank owns, per transport its tree edges use, a block of tree connection memory laid out
//! as [`TreeLayout`] with FIFOs only for the peers of that transport:
//!
//! | transport | block | the peer's kernel |
//! |---|---|---|
//! | P2P | device memory, opened by the peer through CUDA IPC | writes the FIFOs and counters directly |
//! | SHM | a `/dev/shm` segment (on CUDA registered with the driver) | the same, through its mapping |
//! | NET | host memory (on CUDA pinned and device-mapped) that this rank's proxy fills | — |
//!
//! A NET edge also gets a staging block of the same layout: this rank's kernel writes its sends
//! there (FIFOs, tail and step sizes of the peer's slot) and frees its receives there (head); the
//! proxy thread sends the staged steps to the peer's proxy, which writes them into the peer's NET
//! block, exactly as for the ring's NET connections ([`crate::transport::connect_net`]).
use super::*;
use crate::transport::{FifoAddrs, FifoSizes, NetConnPlan, ProxyAbort, STEP_SIZES_OFFSET, TransportKind};

/// Bootstrap tags of the NET handles of tree edges: data going up (child → parent) on channel `c`
/// is `TREE_TAG + c`, going down `TREE_TAG + 0x100 + c`.
const TREE_TAG: u32 = 0x5452_0000;

/// One block of memory a rank owns for its trees.
pub(super) enum TreeMem {
    /// CUDA device memory: the FIFOs of P2P tree peers (which open it through CUDA IPC), or the
    /// [`DevTree`] array.
    Dev(cuda::DevAlloc),
    /// CPU target: a `/dev/shm` segment that SHM tree peers map.
    Shm(crate::cpu::ShmSegment),
    /// CUDA: a `/dev/shm` segment registered with the driver, which SHM tree peers map.
    ShmMapped(RegisteredShm),
    /// CPU target: private memory (NET FIFOs and staging, the [`DevTree`] array).
    Host(HostMem),
    /// CUDA: pinned, device-mapped host memory (NET FIFOs and staging).
    Mapped(cuda::HostMapped),
}

impl TreeMem {
    /// The address kernels use.
    fn kernel(&self) -> u64 {
        match self {
            TreeMem::Dev(m) => m.ptr,
            TreeMem::Shm(s) => s.addr(),
            TreeMem::ShmMapped(m) => m.dev_base(),
            TreeMem::Host(m) => m.addr(),
            TreeMem::Mapped(m) => m.dev_ptr(),
        }
    }

    /// The address this process's threads (the proxy) use; device memory has none.
    fn host(&self) -> Option<u64> {
        match self {
            TreeMem::Dev(_) => None,
            TreeMem::Shm(s) => Some(s.addr()),
            TreeMem::ShmMapped(m) => Some(m.seg.addr()),
            TreeMem::Host(m) => Some(m.addr()),
            TreeMem::Mapped(m) => Some(m.host_ptr() as u64),
        }
    }

    /// Zeroed host memory for NET FIFOs or staging: device-mapped on CUDA. The counters at
    /// `counters` (offsets) start at `step`.
    fn host_block(
        ctx: Option<&Arc<cuda::Context>>,
        bytes: usize,
        counters: &[u64],
        step: u64,
    ) -> Result<TreeMem> {
        let m = match ctx {
            None => TreeMem::Host(HostMem::zeroed(bytes)?),
            Some(ctx) => TreeMem::Mapped(cuda::HostMapped::zeroed(ctx, bytes)?),
        };
        let base = m.host().unwrap_or(0);
        for &off in counters {
            // SAFETY: the counters lie inside the fresh block, which no one else uses yet.
            unsafe { ((base + off) as *mut u64).write(step) };
        }
        Ok(m)
    }
}

/// What [`setup`] needs from `Comm::init_rank`.
pub(super) struct TreeSetup<'a> {
    pub bootstrap: &'a crate::bootstrap::Bootstrap,
    pub rank: usize,
    pub peers: &'a [PeerInfo],
    /// The communicator's rings: each host's chain follows channel 0's ring.
    pub rings: &'a ChannelRings,
    pub nch: u32,
    pub params: &'a Params,
    pub ctx: Option<&'a Arc<cuda::Context>>,
    pub device: Device,
    /// `NCCL_ALGO` allows the tree (the same on every rank: `init_rank` checks it first).
    pub wanted: bool,
    /// Test hook `OXCCL_TEST_NODES` ([`test_nodes`]): the ranks split into this many nodes of
    /// consecutive ranks instead of by host (transports unchanged).
    pub test_nodes: Option<usize>,
    /// Name of this rank's `/dev/shm` segment for SHM tree peers.
    pub shm_name: String,
    /// Where the proxy raises a failed NET tree connection.
    pub abort: ProxyAbort,
    /// This init's topology, for `NCCL_P2P_LEVEL` between P2P tree peers.
    pub topo: &'a LocalTopo,
}

/// A rank's set-up trees.
pub(super) struct RankTrees {
    pub shape: TreeShape,
    /// This rank's [`DevTree`] array (one per channel) as kernels address it: the `trees` field
    /// of its [`DevComm`].
    pub array: u64,
    /// Bytes of tree memory this rank allocated (FIFOs, counters, staging, the array).
    pub bytes: u64,
    /// Its mappings of tree peers' memory and its NET tree connections (the proxy
    /// registration): `init_rank` keeps them with the ring's, closed at teardown before the
    /// barrier (mappings) and after it (NET).
    pub links: Vec<PeerLink>,
    /// The memory it owns, to be freed only after the teardown barrier.
    pub mem: Vec<TreeMem>,
    /// Some tree edge between GPUs goes through host memory (SHM or NET): LL128 is then off, as
    /// for such rings.
    pub host_path: bool,
    /// The step counters in this rank's tree memory (kernel address, bytes), which its tree
    /// peers and its proxy advance: the progress the timeout watch samples.
    pub counters: Vec<(u64, usize)>,
}

/// Unlinks the name of this rank's SHM tree segment in `mem` once every peer has mapped it.
pub(super) fn unlink(mem: &[TreeMem]) -> Result<()> {
    for m in mem {
        match m {
            TreeMem::Shm(s) => s.unlink()?,
            TreeMem::ShmMapped(m) => m.seg.unlink()?,
            _ => {}
        }
    }
    Ok(())
}

/// Each host's ranks in the order channel 0's ring visits them from the host's lowest rank, the
/// hosts in the order of their lowest ranks: the chains of the double binary tree (NCCL's tree
/// graph keeps each node's GPUs in its intra-node order).
pub(super) fn host_chains(peers: &[PeerInfo], rings: &ChannelRings) -> Vec<Vec<usize>> {
    let nranks = peers.len();
    let mut chains: Vec<Vec<usize>> = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    for first in 0..nranks {
        let host = peers[first].host.as_str();
        if seen.contains(&host) {
            continue;
        }
        seen.push(host);
        let mut chain = Vec::new();
        let mut r = first;
        for _ in 0..nranks {
            if peers[r].host == host {
                chain.push(r);
            }
            r = rings.next(0, r);
        }
        chains.push(chain);
    }
    chains
}

/// A rank's part of the tree setup before the all-gather: its trees and the memory it offers.
struct Offer {
    trees: Vec<Vec<crate::graph::Tree>>,
    mem: Vec<(TransportKind, TreeMem)>,
    /// NET only: the staging block.
    staging: Option<TreeMem>,
    net: Option<Arc<dyn crate::transport::net::Net>>,
    desc: ConnDesc,
}

/// Sets up the trees of a communicator whose ranks are on two or more hosts (or test nodes,
/// [`TreeSetup::test_nodes`]); `None` (on every rank alike) for one host or when `NCCL_ALGO`
/// excludes the tree. Every rank calls it
/// at the same point of init (it all-gathers through the bootstrap).
///
/// Errors: a tree pattern hook that is not valid, memory that cannot be allocated, a network
/// that cannot be opened: on the rank concerned its own error, on every other rank `Remote`
/// naming it; then the errors of opening peers' memory (as for ring neighbours) and of the NET
/// connections ([`crate::transport::connect_planned`]).
pub(super) fn setup(s: &TreeSetup<'_>) -> Result<Option<RankTrees>> {
    let (me, nranks) = (s.rank, s.peers.len());
    let chains = match s.test_nodes {
        Some(nnodes) => {
            let k = nranks / nnodes;
            (0..nnodes).map(|n| (n * k..(n + 1) * k).collect()).collect()
        }
        None => host_chains(s.peers, s.rings),
    };
    if chains.len() < 2 || !s.wanted {
        return Ok(None);
    }
    let kind = |a: usize, b: usize| select_transport(s.peers, a, b);
    let step = s.params.initial_step;
    let layout_of = |trees: &[Vec<crate::graph::Tree>], r: usize, k: TransportKind| {
        TreeLayout::for_peers(s.params, trees, r, |p| kind(r, p) == k)
    };
    let offer = (|| -> Result<Offer> {
        let trees = channel_trees(&chains, s.nch, test_tree_pattern()?)?;
        let mut kinds: Vec<TransportKind> = Vec::new();
        for t in &trees {
            for p in tree_peers(&t[me]) {
                if !kinds.contains(&kind(me, p)) {
                    kinds.push(kind(me, p));
                }
            }
        }
        let mut mem = Vec::new();
        let mut staging = None;
        let mut net = None;
        let mut desc = match s.ctx {
            None => ConnDesc::Shm(String::new()),
            Some(_) => ConnDesc::Ipc {
                ptr: 0,
                handle: [0; cuda::IPC_HANDLE_BYTES],
            },
        };
        for k in kinds {
            let l = layout_of(&trees, me, k);
            let (bytes, counters) = (l.bytes() as usize, l.counter_offsets());
            let block = match (k, s.ctx) {
                (TransportKind::P2p, Some(ctx)) => {
                    let m = cuda::DevAlloc::zeroed(ctx, bytes)?;
                    if step != 0 {
                        m.write(l.counters_at as usize, &l.counters(step))?;
                    }
                    desc = ConnDesc::Ipc {
                        ptr: m.ptr,
                        handle: m.ipc_handle()?,
                    };
                    TreeMem::Dev(m)
                }
                (TransportKind::P2p, None) => {
                    // CPU-target ranks of one process (P2P only between those).
                    let m = HostMem::zeroed(bytes)?;
                    for &off in &counters {
                        // SAFETY: the counters lie inside the fresh block; no peer knows it yet.
                        unsafe { ((m.addr() + off) as *mut u64).write(step) };
                    }
                    desc = ConnDesc::Local(m.addr());
                    TreeMem::Host(m)
                }
                (TransportKind::Shm, None) => {
                    let seg = crate::cpu::ShmSegment::create(&s.shm_name, bytes)?;
                    for &off in &counters {
                        // SAFETY: the counters lie inside our fresh segment; no peer maps it yet.
                        unsafe { ((seg.addr() + off) as *mut u64).write(step) };
                    }
                    desc = ConnDesc::Shm(s.shm_name.clone());
                    TreeMem::Shm(seg)
                }
                (TransportKind::Shm, Some(ctx)) => TreeMem::ShmMapped(RegisteredShm::create_with(
                    ctx,
                    &s.shm_name,
                    bytes,
                    &counters,
                    step,
                )?),
                (TransportKind::Net, ctx) => {
                    staging = Some(TreeMem::host_block(ctx, bytes, &counters, step)?);
                    let near = s.bootstrap.addrs().get(me).map(|a| a.ip());
                    net = Some(crate::transport::net_from_env(near)?);
                    TreeMem::host_block(ctx, bytes, &counters, step)?
                }
            };
            mem.push((k, block));
        }
        Ok(Offer {
            trees,
            mem,
            staging,
            net,
            desc,
        })
    })();
    let record = |o: &Offer| o.desc.encode();
    let (offer, all) = s.bootstrap.allgather_checked(
        offer,
        record,
        "cannot set up its tree connections",
    )?;
    let descs: Vec<ConnDesc> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            ConnDesc::decode(&String::from_utf8_lossy(b))
                .ok_or_else(|| Error::Remote(format!("rank {r} sent a malformed tree connection descriptor")))
        })
        .collect::<Result<_>>()?;
    let Offer {
        trees,
        mem,
        staging,
        net,
        ..
    } = offer;
    let own = |k: TransportKind| mem.iter().find(|(x, _)| *x == k).map(|(_, m)| m);
    // Open every P2P/SHM tree peer's block (once per peer).
    let mut links = Vec::new();
    let mut peer_base = vec![0u64; nranks];
    for t in trees.iter() {
        for p in tree_peers(&t[me]) {
            let k = kind(me, p);
            if k == TransportKind::Net || peer_base[p] != 0 {
                continue;
            }
            let shm_name = s.peers[p].tree_shm_name();
            let target = PeerMem {
                desc: &descs[p],
                shm_name: &shm_name,
                bytes: layout_of(&trees, p, k).bytes() as usize,
            };
            let link = crate::transport::transport(k).connect(&ConnectTo {
                me,
                peers: s.peers,
                peer: p,
                ctx: s.ctx,
                target,
                p2p_level: s.params.p2p_level,
                topo: s.topo,
            })?;
            peer_base[p] = link.base();
            links.push(link);
        }
    }
    // The NET edges: a connection per channel and direction, to the proxy.
    let net_layout = layout_of(&trees, me, TransportKind::Net);
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    if let (Some(own_net), Some(staging), Some(net)) = (own(TransportKind::Net), &staging, net) {
        let (ho, hs) = (own_net.host().unwrap_or(0), staging.host().unwrap_or(0));
        let fifo = |base: u64, c: usize, slot: usize| {
            let b = net_layout.buffs(base, c, slot);
            FifoAddrs {
                simple: b[Proto::Simple as usize],
                ll: b[Proto::Ll as usize],
                ll128: b[Proto::Ll128 as usize],
                head: 0,
                tail: 0,
            }
        };
        let sizes = FifoSizes {
            buffsize: s.params.buffsize,
            ll_buffsize: s.params.ll_buffsize,
            ll128_buffsize: s.params.ll128_buffsize,
        };
        for (c, t) in trees.iter().enumerate() {
            for (p, mine) in tree_slots(&t[me]) {
                if kind(me, p) != TransportKind::Net {
                    continue;
                }
                // Up: data from a child to its parent (this rank's slot 0 is its parent).
                let (send_tag, recv_tag) = if mine == 0 {
                    (TREE_TAG + c as u32, TREE_TAG + 0x100 + c as u32)
                } else {
                    (TREE_TAG + 0x100 + c as u32, TREE_TAG + c as u32)
                };
                let stage_tail = net_layout.tail(hs, c, mine);
                let mut sp = crate::transport::fifo_spec(
                    p,
                    c as u32,
                    fifo(hs, c, mine),
                    net_layout.head(ho, c, mine),
                    stage_tail,
                    sizes,
                    step,
                );
                sp.sizes = stage_tail + STEP_SIZES_OFFSET;
                sends.push(NetConnPlan {
                    tag: send_tag,
                    spec: sp,
                    region: (hs, net_layout.bytes() as usize),
                });
                let rp = crate::transport::fifo_spec(
                    p,
                    c as u32,
                    fifo(ho, c, mine),
                    net_layout.head(hs, c, mine),
                    net_layout.tail(ho, c, mine),
                    sizes,
                    step,
                );
                recvs.push(NetConnPlan {
                    tag: recv_tag,
                    spec: rp,
                    region: (ho, net_layout.bytes() as usize),
                });
            }
        }
        // SAFETY: the NET block and the staging block are in `mem` / `staging`, which the caller
        // keeps until after the returned links (which hold the proxy registration) are dropped;
        // the abort addresses are the communicator's shared abort page (caller's contract).
        let handle = unsafe {
            crate::transport::connect_planned(s.bootstrap, me, s.device, net, sends, recvs, s.abort.clone())?
        };
        links.push(PeerLink::Net {
            _held: crate::transport::NetResources::from_handle(handle),
        });
    }
    let dev = build_dev_trees(me, &trees, |c, p, mine, theirs| {
        let k = kind(me, p);
        let (lm, bm) = (layout_of(&trees, me, k), own(k).map_or(0, TreeMem::kernel));
        Ok(match k {
            TransportKind::Net => net_tree_edge(
                c,
                &lm,
                bm,
                staging.as_ref().map_or(0, TreeMem::kernel),
                mine,
                step,
            ),
            _ => shared_tree_edge(
                c,
                (&lm, bm, mine),
                (&layout_of(&trees, p, k), peer_base[p], theirs),
                step,
            ),
        })
    })?;
    for (c, t) in trees.iter().enumerate() {
        let tr = &t[me];
        tracing::info!(target: "oxccl::init", "Trees [{c}] {}/{}/{}->{me}->{}", tr.down[0], tr.down[1], tr.down[2], tr.up);
    }
    let bytes: &[u8] = bytemuck::cast_slice(&dev);
    let array = match s.ctx {
        Some(ctx) => {
            let a = cuda::DevAlloc::zeroed(ctx, bytes.len())?;
            a.write(0, bytes)?;
            TreeMem::Dev(a)
        }
        None => {
            let a = HostMem::zeroed(bytes.len())?;
            // SAFETY: `a` was allocated with exactly this size; nothing else uses it yet.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), a.addr() as *mut u8, bytes.len()) };
            TreeMem::Host(a)
        }
    };
    let mut own_bytes = bytes.len() as u64;
    for (k, _) in &mem {
        own_bytes += layout_of(&trees, me, *k).bytes();
    }
    if staging.is_some() {
        own_bytes += net_layout.bytes();
    }
    let host_path = (0..nranks).any(|r| {
        s.peers[r].cuda
            && trees
                .iter()
                .any(|t| tree_peers(&t[r]).any(|p| kind(r, p) != TransportKind::P2p))
    });
    let shape = TreeShape {
        nnodes: chains.len(),
        depth: trees[0][0].depth.max(0) as u32,
    };
    let array_addr = array.kernel();
    let mut counters: Vec<(u64, usize)> = mem
        .iter()
        .map(|(k, m)| {
            let l = layout_of(&trees, me, *k);
            (m.kernel() + l.counters_at, (l.bytes() - l.counters_at) as usize)
        })
        .collect();
    if let Some(st) = &staging {
        counters.push((st.kernel() + net_layout.counters_at, (net_layout.bytes() - net_layout.counters_at) as usize));
    }
    let mut owned: Vec<TreeMem> = mem.into_iter().map(|(_, m)| m).collect();
    owned.extend(staging);
    owned.push(array);
    tracing::debug!(target: "oxccl::init", rank = me, nnodes = shape.nnodes, depth = shape.depth, bytes = own_bytes, "trees ready");
    Ok(Some(RankTrees {
        shape,
        array: array_addr,
        bytes: own_bytes,
        links,
        mem: owned,
        host_path,
        counters,
    }))
}

/// The (send, receive) connections of a NET tree edge on channel `c` to the peer in slot `mine`
/// of this rank's NET block (`layout` at `own`, kernel addresses) with its staging block (same
/// layout, at `staging`): the send connection writes the staging FIFOs, tail and step sizes of
/// that slot and is freed through the NET block's head (the proxy's credit); the receive
/// connection reads the NET block's FIFOs and tail (the proxy fills them) and frees its slots
/// through the staging block's head (the proxy reads it).
fn net_tree_edge(
    c: usize,
    layout: &TreeLayout,
    own: u64,
    staging: u64,
    mine: usize,
    step: u64,
) -> (ConnInfo, ConnInfo) {
    let (mut send, recv) = shared_tree_edge(c, (layout, own, mine), (layout, staging, mine), step);
    send.sizes = layout.tail(staging, c, mine) + STEP_SIZES_OFFSET;
    (send, recv)
}

/// The parent and children of `t` (without the absent ones).
fn tree_peers(t: &crate::graph::Tree) -> impl Iterator<Item = usize> + '_ {
    tree_slots(t).map(|(p, _)| p)
}

/// Each tree peer of `t` with its slot in this rank's tree memory (0: the parent, `1 + i`: child
/// `i`).
fn tree_slots(t: &crate::graph::Tree) -> impl Iterator<Item = (usize, usize)> + '_ {
    std::iter::once(t.up)
        .chain(t.down)
        .enumerate()
        .filter_map(|(slot, p)| usize::try_from(p).ok().map(|p| (p, slot)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(host: &str) -> PeerInfo {
        crate::transport::test_peers::cuda_peer("0000:01:00.0", host, 1)
    }

    #[test]
    fn chains_follow_ring_zero_inside_each_host_in_order_of_lowest_rank() {
        // Hosts b, a, b, a, b; ring 0 is 0 4 1 2 3 (-> 0). Host b (lowest rank 0) first: from 0
        // the ring visits 4 then 2; host a (lowest rank 1): 1 then 3.
        let peers: Vec<PeerInfo> = ["b", "a", "b", "a", "b"].iter().map(|h| peer(h)).collect();
        let rings = ChannelRings::new(vec![vec![0, 4, 1, 2, 3]], 5).unwrap();
        assert_eq!(host_chains(&peers, &rings), vec![vec![0, 4, 2], vec![1, 3]]);
        // One host: one chain (no trees).
        let one: Vec<PeerInfo> = (0..3).map(|_| peer("a")).collect();
        assert_eq!(
            host_chains(&one, &ChannelRings::rank_order(3, 1)),
            vec![vec![0, 1, 2]]
        );
    }

    #[test]
    fn net_edges_send_through_staging_and_receive_into_the_net_block() {
        // Rank 2 of two nodes (0, 1 | 2, 3), tree 0: 2's parent is 0 over NET (slot 0), its
        // child 3 in its chain (slot 1) is not NET, so the NET layout has FIFOs for slot 0 only.
        let params = Params::default();
        let trees = channel_trees(&[vec![0, 1], vec![2, 3]], 2, crate::graph::Pattern::BalancedTree).unwrap();
        assert_eq!((trees[0][2].up, trees[0][2].down[0]), (0, 3));
        let l = TreeLayout::for_peers(&params, &trees, 2, |p| p == 0);
        assert!(l.fifo[0][0].is_some() && l.fifo[0][1].is_none());
        let (own, staging) = (0x1000_0000u64, 0x9000_0000u64);
        let (send, recv) = net_tree_edge(0, &l, own, staging, 0, 5);
        assert_eq!(send.buffs, l.buffs(staging, 0, 0));
        assert_eq!(send.tail, l.tail(staging, 0, 0));
        assert_eq!(send.head, l.head(own, 0, 0));
        assert_eq!(send.sizes, l.tail(staging, 0, 0) + STEP_SIZES_OFFSET);
        assert_eq!(recv.buffs, l.buffs(own, 0, 0));
        assert_eq!(recv.tail, l.tail(own, 0, 0));
        assert_eq!(recv.head, l.head(staging, 0, 0));
        assert_eq!(recv.sizes, 0);
        assert_eq!((send.step, recv.step), (5, 5));
        // The step sizes stay inside the tail's 128-byte counter line, clear of the head.
        let sizes_end = send.sizes + 8 * FIFO_STEPS;
        assert!(sizes_end <= l.tail(staging, 0, 0) + 128);
        assert!(l.head(staging, 0, 0) + 8 <= l.tail(staging, 0, 0));
    }
}
