//! The channel search shared by ring and tree graphs: NCCL's `ncclTopoCompute`
//! (`src/graph/search.cc`) for the ring, balanced-tree, split-tree and tree patterns, on one
//! node (GPUs only) or with the node's network devices (NET nodes, for communicators spanning
//! several nodes).
//!
//! What one channel is, per pattern (NCCL's "search patterns"):
//!
//! | pattern | one node | with NETs |
//! |---|---|---|
//! | ring | GPU a → b → … → x → a | NET n → GPU a → … → x → NET n (or m across NICs) |
//! | tree | GPU a → b → … → x (a chain) | NET n → GPU a → … → x, GPU a → NET n |
//! | split tree | as tree | NET n → GPU a → … → x, GPU b → NET n |
//! | balanced tree | as tree | NET n → GPU a → … → x, GPU a and GPU b → NET n, half the speed each |
//!
//! Every hop takes the channel's speed (GB/s) on each link of its route (`followPath`): PCI links
//! of a `PHB` path through an Intel CPU take 1.2 × the speed (`INTEL_P2P_OVERHEAD`), a network
//! device to a GPU older than sm80 also takes 1/8 of the speed on the link back, and NVLinks to a
//! POWER CPU take the speed both ways. Trees take bandwidth forward only but require the
//! backward path to be no farther than the allowed type either. A NET's own bandwidth is shared
//! by the NETs of one port of one NIC (same `guid` and `port`).
//!
//! The search, as `ncclTopoCompute` drives it: speeds from NCCL's lists ([`speed_array_intra`],
//! [`speed_array_inter`]), starting at the first one not above the best GPU–GPU path (GPU–NET
//! with NETs) nor, times `min_channels`, above the most a GPU can send (its NVLinks, else its PCI
//! link; × n/(n−1) for trees). For each speed: path types relaxed from the closest to the
//! farthest GPU–GPU path type (up to the GPU–NET type with NETs), then with NETs the GPU–NET
//! type relaxed (at least up to `PXN`), then crossing NICs (`NCCL_CROSS_NIC`=2 lets rings and
//! balanced trees return through another NIC), and on sm90+ a balanced tree falls back to a
//! plain tree. Lower speeds are tried while the next one is more than 0.49 × the best found.
//! The best graph has the most `nchannels × speed_intra` (fewer hops on ties) with at least
//! `min_channels`; a graph carrying the GPUs' full bandwidth, or reaching `max_channels`, ends
//! the search. Then `ncclTopoDupChannels` (double the channels, divide the speed, at ≥ 25 GB/s
//! and not for sm > 80 below 50 GB/s with more than 4 channels), then NCCL's second pass: a ring
//! tries higher speeds with at least as many channels; a tree raises its intra-node speed (up
//! to 2× the inter-node one).
//!
//! Within one channel the order of tries is NCCL's: on one node the rank (PCI) order for the
//! first channel, then a replay of the previous channel, then a depth-first search from every
//! GPU; with NETs, each NET in turn (NICs close to the GPUs first, rotated by channel), a replay,
//! then the GPUs closest to that NET. Next GPUs are sorted as `ncclTopoSearchNextGpuSort` does
//! (bandwidth to the NET, PCI width, hops to the NET, GPU–GPU bandwidth, hops, then cyclic
//! distance); on NVSwitch systems only the previous and next rank are tried.
//!
//! Differences from NCCL, stated: channels are found one at a time, each kept once found (NCCL
//! backtracks across channels within its time budget, which can only find more channels
//! than this search on unusual topologies); each channel's depth-first search is bounded by
//! [`MAX_STEPS`] instead of NCCL's time budget, so the result never depends on timing; NCCL's
//! two-socket NVLink rule (`ncclTopoSplitNvLink`, forcing 2 ring channels), the NVLS and CollNet
//! patterns and `NCCL_GRAPH_FILE` are not modelled.
//!
//! | file | what | mirrors in NCCL |
//! |---|---|---|
//! | `search/mod.rs` | requests, results, the speed lists and the search driver | `ncclTopoCompute`, `ncclTopoCompareGraphs`, `ncclTopoDupChannels` |
//! | `search/engine.rs` | the search of one channel: hops, bandwidth taken per link, next-GPU order | `ncclTopoSearchRec`, `ncclTopoSearchTryGpu`, `ncclTopoFollowPath`, `ncclTopoSearchNextGpuSort` |
use crate::error::{Error, Result};
use crate::topo::{CpuArch, CpuVendor, LinkType, NodeId, NodeType, PathType, System};

mod engine;

use engine::{Cost, Engine, Hop, NetInfo};

/// Speeds (GB/s per channel) tried for intra-node graphs, NCCL's `speedArrayIntra`.
const SPEEDS_INTRA: [f64; 13] = [
    40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0,
];
/// NCCL's `sm90SpeedArrayIntra`.
const SM90_SPEEDS_INTRA: [f64; 11] = [60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0];
/// NCCL's `sm100SpeedArrayIntra`.
const SM100_SPEEDS_INTRA: [f64; 12] = [
    90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0,
];
/// Speeds (GB/s per channel) tried for graphs with NETs, NCCL's `speedArrayInter`.
const SPEEDS_INTER: [f64; 19] = [
    48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12,
];
/// NCCL's `sm90SpeedArrayInter`.
const SM90_SPEEDS_INTER: [f64; 17] = [
    48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12,
];
/// NCCL's `sm100SpeedArrayInter`.
const SM100_SPEEDS_INTER: [f64; 20] = [
    96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2,
    0.24, 0.12,
];

/// Bandwidth (GB/s) NCCL gives its fallback graph when no channel is found.
pub const FALLBACK_SPEED: f64 = 0.1;
/// Tolerance on bandwidth comparisons, GB/s (link bandwidths like 20.6 × 18 are not exact).
const EPS: f64 = 1e-6;
/// Depth-first steps allowed for one channel (NCCL bounds its search by a step budget too,
/// `NCCL_SEARCH_TIMEOUT`); 8 GPUs without NVSwitch need at most about 8 · 7! steps.
pub const MAX_STEPS: usize = 1 << 18;
/// `MAXCHANNELS` of NCCL: the most channels a graph may have.
pub const MAX_CHANNELS: usize = 64;

/// NCCL's intra-node speed list for the smallest compute capability `sm_min` (GB/s,
/// descending): `speedArrayIntra`, `sm90SpeedArrayIntra` or `sm100SpeedArrayIntra`.
pub fn speed_array_intra(sm_min: u32) -> &'static [f64] {
    if sm_min >= 100 {
        &SM100_SPEEDS_INTRA
    } else if sm_min >= 90 {
        &SM90_SPEEDS_INTRA
    } else {
        &SPEEDS_INTRA
    }
}

/// NCCL's speed list for graphs with NETs, for the smallest compute capability `sm_min` (GB/s,
/// descending): `speedArrayInter`, `sm90SpeedArrayInter` or `sm100SpeedArrayInter`.
pub fn speed_array_inter(sm_min: u32) -> &'static [f64] {
    if sm_min >= 100 {
        &SM100_SPEEDS_INTER
    } else if sm_min >= 90 {
        &SM90_SPEEDS_INTER
    } else {
        &SPEEDS_INTER
    }
}

/// Channel patterns, numbered as NCCL's `NCCL_TOPO_PATTERN_*`.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// Tree; NIC traffic spread over the first two GPUs of the chain, parent and child 1 on
    /// the first, child 0 on the second (`NCCL_TOPO_PATTERN_BALANCED_TREE`, 1).
    BalancedTree = 1,
    /// Tree; the parent on the first GPU, both children on the second
    /// (`NCCL_TOPO_PATTERN_SPLIT_TREE`, 2).
    SplitTree = 2,
    /// Tree; all NIC traffic on the first GPU of the chain (`NCCL_TOPO_PATTERN_TREE`, 3).
    Tree = 3,
    /// Ring (`NCCL_TOPO_PATTERN_RING`, 4).
    Ring = 4,
}

impl Pattern {
    /// NCCL's pattern number (the `pattern` attribute of a graph dump).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Whether the pattern is one of the three tree patterns.
    pub fn is_tree(self) -> bool {
        self != Pattern::Ring
    }

    /// A short name: `RING`, `BALANCED_TREE`, `SPLIT_TREE`, `TREE`.
    pub fn as_str(self) -> &'static str {
        match self {
            Pattern::BalancedTree => "BALANCED_TREE",
            Pattern::SplitTree => "SPLIT_TREE",
            Pattern::Tree => "TREE",
            Pattern::Ring => "RING",
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to search for (the fields of `ncclTopoGraph` that `ncclTopoCompute` reads).
#[derive(Clone, Debug, PartialEq)]
pub struct GraphRequest {
    /// The channel pattern.
    pub pattern: Pattern,
    /// Fewest channels a graph may have to be kept (`minChannels`); NCCL asks 1 for rings and
    /// the ring's channel count for trees.
    pub min_channels: usize,
    /// Most channels (`maxChannels`), 1..=[`MAX_CHANNELS`]; NCCL asks `MAXCHANNELS / 2` = 32 for
    /// rings and the ring's channel count for trees.
    pub max_channels: usize,
    /// Use the system's NET nodes (a communicator spanning several nodes). When false, or when
    /// the system has no NET, the channels stay within the node (as NCCL does once a
    /// single-node communicator has trimmed the NETs).
    pub inter: bool,
    /// `NCCL_CROSS_NIC`: 0 = a channel returns through the NIC (port) it came in by, 1 = any
    /// NIC, 2 = first try the same NIC, then alternate NICs across channel pairs (default 2).
    pub cross_nic: u32,
}

impl GraphRequest {
    /// NCCL's ring request: 1 to `MAXCHANNELS / 2` = 32 channels, `NCCL_CROSS_NIC` = 2.
    pub fn ring(inter: bool) -> GraphRequest {
        GraphRequest {
            pattern: Pattern::Ring,
            min_channels: 1,
            max_channels: MAX_CHANNELS / 2,
            inter,
            cross_nic: 2,
        }
    }

    /// NCCL's tree request: a balanced tree with exactly `ring_channels` channels (the ring
    /// graph's count), `NCCL_CROSS_NIC` = 2.
    pub fn tree(ring_channels: usize, inter: bool) -> GraphRequest {
        GraphRequest {
            pattern: Pattern::BalancedTree,
            min_channels: ring_channels,
            max_channels: ring_channels,
            inter,
            cross_nic: 2,
        }
    }
}

/// A graph: `nchannels` channels, each an order of the node's GPUs (NCCL's `ncclTopoGraph`).
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// The pattern the channels follow (a balanced-tree request may end as a plain tree).
    pub pattern: Pattern,
    /// Number of channels, equal to `intra.len()`.
    pub nchannels: usize,
    /// Bandwidth each channel may use on GPU-to-GPU hops, GB/s (`bwIntra`, XML `speedintra`).
    pub speed_intra: f64,
    /// Bandwidth each channel may use on NET hops, GB/s (`bwInter`, XML `speedinter`); equal to
    /// `speed_intra` on one node.
    pub speed_inter: f64,
    /// Farthest path type allowed between consecutive GPUs (`typeIntra`).
    pub type_intra: PathType,
    /// Farthest path type allowed between a GPU and a NET (`typeInter`; `PIX` on one node, as
    /// NCCL's dumps show).
    pub type_inter: PathType,
    /// Whether channels may return through another NIC than the one they came in by
    /// (`crossNic`: 0, 1 or 2 as `NCCL_CROSS_NIC`).
    pub cross_nic: u32,
    /// Per channel, the GPU ranks (global ranks, as `<gpu rank>`) in order (`intra`). A ring's last GPU sends to the first (or
    /// to a NET); a tree's first GPU is the one nearest the parent.
    pub intra: Vec<Vec<usize>>,
    /// Per channel, the NET devices (`<net dev>`) the channel comes in by and goes out by
    /// (`inter`); empty without NETs.
    pub inter: Vec<[i32; 2]>,
}

/// One candidate graph's search parameters (`tmpGraph`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Params {
    pattern: Pattern,
    speed_intra: f64,
    speed_inter: f64,
    type_intra: PathType,
    type_inter: PathType,
    cross_nic: u32,
    same_channels: bool,
}

/// A found graph before duplication.
#[derive(Clone, Debug)]
struct Found {
    params: Params,
    intra: Vec<Vec<usize>>,
    /// Endpoint indexes of the NETs (ngpus + k).
    inter: Vec<[usize; 2]>,
    nhops: usize,
}

/// NCCL's `ncclTopoCompareGraphs`: whether `g` replaces `best`.
fn better(g: &Found, best: &Option<Found>, min_channels: usize) -> bool {
    if g.intra.len() < min_channels || g.intra.is_empty() {
        return false;
    }
    let Some(b) = best else {
        return true;
    };
    let (gb, bb) = (
        g.intra.len() as f64 * g.params.speed_intra,
        b.intra.len() as f64 * b.params.speed_intra,
    );
    if gb > bb + EPS {
        return true;
    }
    if gb + EPS < bb {
        return false;
    }
    g.params.pattern == b.params.pattern && g.params.cross_nic == b.params.cross_nic && g.nhops < b.nhops
}

/// Builds a graph of `system` as NCCL's `ncclTopoCompute` does (see the [module docs](self)).
///
/// Channels list GPU ranks (`<gpu rank=...>`; distinct, the lowest rank first in PCI order, as
/// NCCL's GPU index order). When nothing
/// fits at any speed, NCCL's fallback is returned: one channel in rank order at 0.1 GB/s over
/// `SYS` (with NETs: through the first NET both ways).
///
/// Errors: `InvalidArgument` for `max_channels` outside 1..=64, `min_channels` above
/// `max_channels`, `cross_nic` above 2, a system without GPUs, or two GPUs with one rank;
/// `Internal` for a path whose route does not follow the system's links.
pub fn search_graph(system: &System, req: &GraphRequest) -> Result<Graph> {
    if req.max_channels == 0 || req.max_channels > MAX_CHANNELS {
        return Err(Error::invalid(format!(
            "search_graph: max_channels is {}, accepted 1..={MAX_CHANNELS}",
            req.max_channels
        )));
    }
    if req.min_channels > req.max_channels {
        return Err(Error::invalid(format!(
            "search_graph: min_channels {} is above max_channels {}",
            req.min_channels, req.max_channels
        )));
    }
    if req.cross_nic > 2 {
        return Err(Error::invalid(format!(
            "search_graph: cross_nic (NCCL_CROSS_NIC) is {}, accepted 0, 1 or 2",
            req.cross_nic
        )));
    }
    let mut gpus: Vec<(usize, NodeId, u32, i32)> = Vec::new();
    for id in system.ids(NodeType::Gpu) {
        let node = system.node(id);
        let Some(g) = node.gpu() else {
            return Err(Error::Internal(format!("{} is not a GPU", node.label())));
        };
        let rank = usize::try_from(g.rank)
            .map_err(|_| Error::invalid(format!("{} has no rank (rank {})", node.label(), g.rank)))?;
        gpus.push((rank, id, g.sm, g.dev));
    }
    if gpus.is_empty() {
        return Err(Error::invalid("search_graph: the system has no GPU"));
    }
    gpus.sort_by_key(|g| g.0);
    if gpus.windows(2).any(|w| w[0].0 == w[1].0) {
        let ranks: Vec<usize> = gpus.iter().map(|g| g.0).collect();
        return Err(Error::invalid(format!(
            "search_graph: GPU ranks {ranks:?} list a rank twice (each GPU needs its own rank)"
        )));
    }
    let ranks: Vec<usize> = gpus.iter().map(|g| g.0).collect();
    let n = gpus.len();
    let sm_min = gpus.iter().map(|g| g.2).min().unwrap_or(0);
    let nodes = system.nodes();
    let paths = system.paths();
    let mut ids: Vec<NodeId> = gpus.iter().map(|g| g.1).collect();
    let mut nets: Vec<NetInfo> = Vec::new();
    if req.inter {
        for id in system.ids(NodeType::Net) {
            if let Some(net) = system.node(id).net() {
                ids.push(id);
                nets.push(NetInfo {
                    dev: net.dev,
                    asic_port: (net.guid, net.port),
                    bw: net.bw,
                });
            }
        }
    }
    let nets_present = !nets.is_empty();
    let intel = |id: NodeId| {
        nodes[id.0]
            .cpu()
            .is_some_and(|c| c.arch == CpuArch::X86 && c.vendor == CpuVendor::Intel)
    };

    // Hops between every endpoint pair, with the bandwidth each takes per link.
    let ne = ids.len();
    let mut hops: Vec<Vec<Option<Hop>>> = vec![vec![None; ne]; ne];
    for a in 0..ne {
        for b in 0..ne {
            if a == b || (a >= n && b >= n) {
                continue;
            }
            let (Some(path), Some(rev)) = (paths.get(ids[a], ids[b]), paths.get(ids[b], ids[a])) else {
                continue;
            };
            let start_gpu = a < n;
            let pci_mult = if path.kind == PathType::Phb && start_gpu && path.route.iter().any(|&x| intel(x))
            {
                1.2 // INTEL_P2P_OVERHEAD
            } else {
                1.0
            };
            let mut costs = Vec::with_capacity(path.route.len());
            let mut prev = ids[a];
            for &next in &path.route {
                let node = &nodes[prev.0];
                let best = node
                    .links
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.remote == next)
                    .max_by(|x, y| x.1.bw.total_cmp(&y.1.bw).then(y.0.cmp(&x.0)))
                    .map(|(k, _)| k);
                let Some(k) = best else {
                    return Err(Error::Internal(format!(
                        "search_graph: the route {} -> {} crosses {} -> {}, which has no link",
                        nodes[ids[a].0].label(),
                        nodes[ids[b].0].label(),
                        node.label(),
                        nodes[next.0].label()
                    )));
                };
                let link = &node.links[k];
                let fw = if link.kind == LinkType::Pci { pci_mult } else { 1.0 };
                let remote = &nodes[next.0];
                let mut rev_mult = 0.0;
                if !start_gpu && remote.gpu().is_some_and(|g| g.sm < 80) {
                    rev_mult += fw / 8.0;
                }
                if remote.cpu().is_some_and(|c| c.arch == CpuArch::Power) && link.kind == LinkType::Nvl {
                    rev_mult += fw;
                }
                let rev_link = if rev_mult > 0.0 {
                    remote
                        .links
                        .iter()
                        .position(|l| l.remote == prev && l.kind == link.kind)
                        .map(|r| (next.0, r, rev_mult))
                } else {
                    None
                };
                costs.push(Cost {
                    node: prev.0,
                    link: k,
                    fw,
                    rev: rev_link,
                });
                prev = next;
            }
            hops[a][b] = Some(Hop {
                kind: path.kind,
                rev_kind: rev.kind,
                bw: path.bw,
                nhops: path.route.len(),
                costs,
            });
        }
    }

    // gpuPciBw, system->maxBw, system->totalBw (ncclTopoSearchInit).
    let gpu_pci_bw: Vec<i64> = (0..n)
        .map(|g| {
            let node = &nodes[ids[g].0];
            node.links
                .iter()
                .find(|l| l.kind == LinkType::Pci)
                .and_then(|l| {
                    nodes[l.remote.0]
                        .links
                        .iter()
                        .find(|r| r.remote == ids[g])
                        .map(|r| l.bw.min(r.bw) as i64)
                })
                .unwrap_or(-1)
        })
        .collect();
    let (max_bw, total_bw) = if !nets_present && n == 1 {
        (crate::topo::system::LOC_BW, crate::topo::system::LOC_BW)
    } else {
        let (mut max_bw, mut total_bw) = (0.0f64, 0.0f64);
        for g in 0..n {
            let targets = if nets_present { n..ne } else { 0..n };
            for t in targets {
                if let Some(h) = &hops[g][t] {
                    max_bw = max_bw.max(h.bw);
                }
            }
            let (mut nvl, mut pci) = (0.0f64, 0.0f64);
            for l in &nodes[ids[g].0].links {
                match l.kind {
                    LinkType::Nvl => nvl += l.bw,
                    LinkType::Pci => pci = l.bw,
                    _ => {}
                }
            }
            total_bw = total_bw.max(nvl.max(pci));
        }
        (max_bw, total_bw)
    };

    // Path type bounds (ncclTopoGetGpuMinPath / MaxPath).
    let (mut min_ti, mut max_ti) = (PathType::Loc, PathType::Sys);
    if n > 1 {
        let kinds: Vec<PathType> = (0..n)
            .flat_map(|a| (0..n).filter(move |&b| b != a).map(move |b| (a, b)))
            .map(|(a, b)| hops[a][b].as_ref().map_or(PathType::Dis, |h| h.kind))
            .collect();
        min_ti = kinds
            .iter()
            .copied()
            .min()
            .unwrap_or(PathType::Sys)
            .min(PathType::Sys);
        max_ti = kinds.iter().copied().max().unwrap_or(PathType::Loc);
    }
    let (mut min_te, mut max_te) = (PathType::Pix, PathType::Sys);
    if nets_present {
        let kinds: Vec<PathType> = (0..n)
            .flat_map(|g| (n..ne).map(move |t| (g, t)))
            .map(|(g, t)| hops[g][t].as_ref().map_or(PathType::Dis, |h| h.kind))
            .collect();
        min_te = kinds
            .iter()
            .copied()
            .min()
            .unwrap_or(PathType::Sys)
            .min(PathType::Sys);
        max_te = kinds.iter().copied().max().unwrap_or(PathType::Loc);
        max_ti = max_te;
    }

    let base: Vec<Vec<f64>> = nodes
        .iter()
        .map(|nd| nd.links.iter().map(|l| l.bw).collect())
        .collect();
    let has_nvs = system.count(NodeType::Nvs) > 0;
    let mut pattern = req.pattern;
    if n == 1 && pattern != Pattern::Ring {
        pattern = Pattern::Tree;
    }
    let cross_nic = if nets.len() > 1
        && matches!(
            pattern,
            Pattern::Ring | Pattern::BalancedTree | Pattern::SplitTree
        ) {
        req.cross_nic
    } else {
        0
    };
    let amd = system
        .cpu_type()
        .is_some_and(|(a, v, _)| a == CpuArch::X86 && v == CpuVendor::Amd);
    let speeds = if nets_present {
        speed_array_inter(sm_min)
    } else {
        speed_array_intra(sm_min)
    };
    let mut tree_total = total_bw;
    if n > 1 && pattern != Pattern::Ring {
        tree_total *= n as f64 / (n - 1) as f64;
    }
    let mut idx = 0;
    while idx + 1 < speeds.len()
        && (speeds[idx] > max_bw + EPS || speeds[idx] * req.min_channels as f64 > tree_total + EPS)
    {
        idx += 1;
    }
    let initial = Params {
        pattern,
        speed_intra: speeds[idx],
        speed_inter: speeds[idx],
        type_intra: min_ti,
        type_inter: min_te,
        cross_nic: u32::from(cross_nic == 1),
        same_channels: true,
    };
    let mut e = Engine {
        ngpus: n,
        devs: gpus.iter().map(|g| usize::try_from(g.3).unwrap_or(0)).collect(),
        ids,
        nets,
        has_nvs,
        hops,
        gpu_pci_bw,
        base: &base,
        rem: Vec::new(),
        net_rem: Vec::new(),
        p: initial,
        steps: 0,
    };

    // Pass 1.
    let mut tmp = initial;
    let mut best: Option<Found> = None;
    loop {
        e.p = tmp;
        let found = e.run(req.max_channels);
        tracing::trace!(target: "oxccl::graph", pattern = %tmp.pattern, speed = tmp.speed_intra,
            type_intra = %tmp.type_intra, type_inter = %tmp.type_inter, cross_nic = tmp.cross_nic,
            same_channels = tmp.same_channels, nchannels = found.intra.len(), "graph search");
        let reached_max = found.intra.len() == req.max_channels;
        let copy = better(&found, &best, req.min_channels);
        if copy {
            best = Some(found);
        }
        if copy && reached_max {
            break;
        }
        if let Some(b) = &best
            && b.intra.len() as f64 * b.params.speed_inter + EPS >= total_bw
        {
            break;
        }
        if tmp.same_channels && !(amd && tmp.type_intra == PathType::Sys) {
            tmp.same_channels = false;
            continue;
        }
        tmp.same_channels = true;
        if sm_min >= 90 && tmp.pattern == Pattern::BalancedTree {
            tmp.pattern = Pattern::Tree;
            continue;
        }
        tmp.pattern = best.as_ref().map_or(pattern, |b| b.params.pattern);
        let max_intra = if nets_present { tmp.type_inter } else { max_ti };
        if tmp.type_intra < max_intra && best.as_ref().is_none_or(|b| tmp.type_intra < b.params.type_intra) {
            tmp.type_intra = next_type(tmp.type_intra);
            continue;
        }
        tmp.type_intra = min_ti;
        if nets_present
            && tmp.type_inter < max_te
            && best
                .as_ref()
                .is_none_or(|b| tmp.type_inter < b.params.type_inter || tmp.type_inter < PathType::Pxn)
        {
            tmp.type_inter = next_type(tmp.type_inter);
            continue;
        }
        tmp.type_inter = min_te;
        if cross_nic == 2 && tmp.cross_nic == 0 && matches!(pattern, Pattern::Ring | Pattern::BalancedTree) {
            tmp.cross_nic = 2;
            continue;
        }
        tmp.cross_nic = u32::from(cross_nic == 1);
        if idx + 1 < speeds.len()
            && best
                .as_ref()
                .is_none_or(|b| speeds[idx + 1] / b.params.speed_inter > 0.49)
        {
            idx += 1;
            tmp.speed_intra = speeds[idx];
            tmp.speed_inter = speeds[idx];
            continue;
        }
        break;
    }

    let Some(mut best) = best else {
        tracing::warn!(target: "oxccl::graph", ngpus = n, pattern = %pattern,
            "could not find a path for the pattern, falling back to rank order");
        let inter = if nets_present {
            vec![[e.nets[0].dev, e.nets[0].dev]]
        } else {
            Vec::new()
        };
        return Ok(Graph {
            pattern,
            nchannels: 1,
            speed_intra: FALLBACK_SPEED,
            speed_inter: FALLBACK_SPEED,
            type_intra: PathType::Sys,
            type_inter: PathType::Sys,
            cross_nic: 0,
            intra: vec![ranks.clone()],
            inter,
        });
    };

    // ncclTopoDupChannels.
    let nch = best.intra.len();
    let bw_intra = best.params.speed_intra;
    if bw_intra >= 25.0 && !(sm_min > 80 && bw_intra < 50.0 && nch > 4) {
        let dup = (nch * 2).min(req.max_channels);
        if dup > nch {
            for k in 0..dup - nch {
                let r = best.intra[k].clone();
                best.intra.push(r);
                if let Some(&i) = best.inter.get(k) {
                    best.inter.push(i);
                }
            }
            let div = dup.div_ceil(nch) as f64;
            best.params.speed_intra /= div;
            best.params.speed_inter /= div;
        }
    }

    // Pass 2: higher speeds with at least as many channels.
    let min2 = best.intra.len();
    let mut idx = 0;
    while idx + 1 < speeds.len() && speeds[idx] > best.params.speed_inter + EPS {
        idx += 1;
    }
    let mut tmp = best.params;
    tmp.speed_intra = speeds[idx];
    tmp.speed_inter = speeds[idx];
    while idx > 0 {
        if best.params.pattern == Pattern::Ring {
            idx -= 1;
            tmp.speed_intra = speeds[idx];
            tmp.speed_inter = speeds[idx];
        } else if (tmp.speed_intra - best.params.speed_intra).abs() <= EPS
            && tmp.speed_intra < tmp.speed_inter * 2.0
        {
            idx -= 1;
            tmp.speed_intra = speeds[idx];
        } else {
            break;
        }
        e.p = tmp;
        let found = e.run(req.max_channels);
        if better(&found, &Some(best.clone()), min2) {
            best = found;
        }
    }

    let intra = best
        .intra
        .iter()
        .map(|c| c.iter().map(|&g| ranks[g]).collect())
        .collect();
    let inter = best
        .inter
        .iter()
        .map(|[a, b]| [e.nets[a - n].dev, e.nets[b - n].dev])
        .collect();
    let graph = Graph {
        pattern: best.params.pattern,
        nchannels: best.intra.len(),
        speed_intra: best.params.speed_intra,
        speed_inter: best.params.speed_inter,
        type_intra: best.params.type_intra,
        type_inter: best.params.type_inter,
        cross_nic: best.params.cross_nic,
        intra,
        inter,
    };
    tracing::debug!(target: "oxccl::graph", pattern = %graph.pattern, nchannels = graph.nchannels,
        speed_intra = graph.speed_intra, speed_inter = graph.speed_inter, type_intra = %graph.type_intra,
        type_inter = %graph.type_inter, intra = ?graph.intra, inter = ?graph.inter, "graph");
    Ok(graph)
}

/// The next path type (NCCL's `typeIntra += 1`).
fn next_type(t: PathType) -> PathType {
    PathType::ALL
        .iter()
        .copied()
        .find(|&x| x > t)
        .unwrap_or(PathType::Dis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_type_steps_through_every_type() {
        assert_eq!(next_type(PathType::Nvl), PathType::Nvb);
        assert_eq!(next_type(PathType::Pxb), PathType::Pxn);
        assert_eq!(next_type(PathType::Phb), PathType::Sys);
    }

    #[test]
    fn speed_lists_are_descending() {
        for sm in [70, 80, 90, 100] {
            for l in [speed_array_intra(sm), speed_array_inter(sm)] {
                assert!(l.windows(2).all(|w| w[0] > w[1]), "{l:?}");
            }
        }
        assert_eq!(speed_array_inter(90)[0], 48.0);
        assert_eq!(speed_array_inter(100)[0], 96.0);
    }
}
