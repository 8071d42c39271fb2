//! Intra-node ring graphs, NCCL's `ncclTopoCompute` (`src/graph/search.cc`) for the ring pattern
//! (`NCCL_TOPO_PATTERN_RING`) on one node.
//!
//! The search, as NCCL's first pass does it:
//! - speeds (GB/s per channel) come from NCCL's intra-node list for the smallest compute
//!   capability (`speedArrayIntra`, `sm90SpeedArrayIntra`, `sm100SpeedArrayIntra`), starting at
//!   the first one not above the best GPU-to-GPU path bandwidth (`system->maxBw`) nor above the
//!   most any GPU can send (`system->totalBw`: its NVLinks, else its PCI link);
//! - for a speed, path types are relaxed from `NVL` up to `SYS` until channels are found; each
//!   channel is a cycle over all GPUs whose hops (GPU-to-GPU paths of [`Paths`]) are at most that
//!   type and have, on every link of their route, at least the speed left after the channels
//!   already found took theirs (NCCL's `followPath` reserving bandwidth per link);
//! - a channel is first tried in PCI (rank) order for the first channel, then as a replay of the
//!   previous channel (`FORCED_ORDER_PCI`, `FORCED_ORDER_REPLAY`), then by a depth-first search
//!   over the next GPU starting from rank 0, candidates sorted as `ncclTopoSearchNextGpuSort`
//!   does for intra-node graphs: on NVSwitch systems the next and previous rank first, then the
//!   highest path bandwidth (more NVLinks), the closest path type, the fewest hops, the lowest
//!   rank. Channels are added one at a time (no backtracking across channels, unlike NCCL,
//!   which explores them under a time limit) until `max_channels` or until the channels carry
//!   `totalBw` (NCCL's optimal-solution stop);
//! - lower speeds are tried while the next speed is more than 0.49 × the best speed found
//!   (NCCL's rule), keeping the graph with the most total bandwidth (channels × speed), the
//!   first one on ties;
//! - finally `ncclTopoDupChannels`: at ≥ 25 GB/s (and, above sm80, not below 50 GB/s with more
//!   than 4 channels) the channels are doubled up to `max_channels` and the speed divided
//!   accordingly.
//!
//! Not modelled: NCCL's second pass (raising the speed with at least as many channels; never
//! changes the result on the fixtures), NET nodes (a single-node communicator trims them, so
//! the intra-node lists are used), `NCCL_GRAPH_FILE`, and the cross-channel backtracking.
//! Deterministic: no clocks or randomness; the depth-first search is bounded by a step count.
use crate::error::{Error, Result};
use crate::topo::{LinkType, NodeId, NodeType, PathType, System};

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

/// Bandwidth (GB/s) NCCL gives a fallback graph when no ring is found.
const FALLBACK_SPEED: f64 = 0.1;
/// Tolerance on bandwidth comparisons, GB/s (link bandwidths like 20.6 × 18 are not exact).
const EPS: f64 = 1e-6;
/// Depth-first steps allowed per channel search (NCCL bounds its search by a step budget too,
/// `NCCL_SEARCH_TIMEOUT`); 8 GPUs need at most 7! · 8 steps.
const MAX_STEPS: usize = 1 << 18;

/// A ring graph: `nchannels` rings, each visiting every GPU of the node once.
#[derive(Clone, Debug, PartialEq)]
pub struct RingGraph {
    /// Number of channels (`graph->nChannels`), equal to `rings.len()`.
    pub nchannels: usize,
    /// Bandwidth each channel may use on its hops, GB/s (`graph->bwIntra`, the XML
    /// `speedintra`).
    pub speed_intra: f64,
    /// Farthest path type allowed between consecutive GPUs (`graph->typeIntra`).
    pub type_intra: PathType,
    /// Per channel, the GPU ranks in ring order; the last one sends back to the first
    /// (`graph->intra`).
    pub rings: Vec<Vec<usize>>,
}

/// NCCL's intra-node speed list for the smallest compute capability `sm_min` (GB/s, descending).
pub fn speed_array_intra(sm_min: u32) -> &'static [f64] {
    if sm_min >= 100 {
        &SM100_SPEEDS_INTRA
    } else if sm_min >= 90 {
        &SM90_SPEEDS_INTRA
    } else {
        &SPEEDS_INTRA
    }
}

/// One GPU-to-GPU hop: its path type, route length and the links it crosses.
#[derive(Clone, Debug)]
struct Hop {
    kind: PathType,
    bw: f64,
    nhops: usize,
    /// (node index, link index in that node's `links`) for every link of the route.
    links: Vec<(usize, usize)>,
}

struct Search<'a> {
    n: usize,
    /// `hops[i][j]`: from the GPU of rank order i to j; `None` when unreachable or i == j.
    hops: Vec<Vec<Option<Hop>>>,
    /// `order[i]`: candidates after GPU i, best first.
    order: Vec<Vec<usize>>,
    /// Remaining bandwidth per node and link, GB/s.
    rem: Vec<Vec<f64>>,
    base: &'a [Vec<f64>],
    speed: f64,
    max_type: PathType,
    steps: usize,
}

impl Search<'_> {
    fn fits(&self, i: usize, j: usize) -> bool {
        if i == j {
            // A single-GPU ring sends to itself (LOC).
            return self.max_type >= PathType::Loc;
        }
        match &self.hops[i][j] {
            Some(h) => {
                h.kind <= self.max_type && h.links.iter().all(|&(nd, l)| self.rem[nd][l] + EPS >= self.speed)
            }
            None => false,
        }
    }

    /// Takes (sign 1) or gives back (sign -1) the speed on the links of hop i -> j.
    fn take(&mut self, i: usize, j: usize, sign: f64) {
        if i == j {
            return;
        }
        if let Some(h) = &self.hops[i][j] {
            for &(nd, l) in &h.links {
                self.rem[nd][l] -= sign * self.speed;
            }
        }
    }

    /// Tries `ring` as given; on success its bandwidth stays taken.
    fn try_fixed(&mut self, ring: &[usize]) -> bool {
        let n = ring.len();
        for k in 0..n {
            let (a, b) = (ring[k], ring[(k + 1) % n]);
            if !self.fits(a, b) {
                // Give back what the hops before this one took.
                for m in (0..k).rev() {
                    self.take(ring[m], ring[(m + 1) % n], -1.0);
                }
                return false;
            }
            self.take(a, b, 1.0);
        }
        true
    }

    /// Depth-first search for a cycle extending `ring`; on success its bandwidth stays taken.
    fn dfs(&mut self, ring: &mut Vec<usize>, used: &mut [bool]) -> bool {
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return false;
        }
        let Some(&last) = ring.last() else {
            return false;
        };
        if ring.len() == self.n {
            let first = ring[0];
            if self.fits(last, first) {
                self.take(last, first, 1.0);
                return true;
            }
            return false;
        }
        for c in 0..self.order[last].len() {
            let next = self.order[last][c];
            if used[next] || !self.fits(last, next) {
                continue;
            }
            self.take(last, next, 1.0);
            used[next] = true;
            ring.push(next);
            if self.dfs(ring, used) {
                return true;
            }
            ring.pop();
            used[next] = false;
            self.take(last, next, -1.0);
        }
        false
    }

    /// Finds up to `max_channels` rings at this speed and type (one `ncclTopoSearchRec` run).
    fn channels(&mut self, max_channels: usize, total_bw: f64) -> Vec<Vec<usize>> {
        self.rem = self.base.to_vec();
        let mut rings: Vec<Vec<usize>> = Vec::new();
        while rings.len() < max_channels && (rings.len() as f64) * self.speed + EPS < total_bw {
            let forced: Vec<usize> = match rings.last() {
                Some(r) => r.clone(),
                None => (0..self.n).collect(),
            };
            if self.try_fixed(&forced) {
                rings.push(forced);
                continue;
            }
            self.steps = 0;
            let mut ring = vec![0];
            let mut used = vec![false; self.n];
            used[0] = true;
            if self.dfs(&mut ring, &mut used) {
                rings.push(ring);
            } else {
                break;
            }
        }
        rings
    }
}

/// Builds the intra-node ring graph of `system` with at most `max_channels` channels (NCCL
/// asks for `MAXCHANNELS / 2` = 32): NCCL's `ncclTopoCompute` for `NCCL_TOPO_PATTERN_RING`
/// followed by `ncclTopoDupChannels`, as described in the [module docs](self).
///
/// Rings list GPU ranks (`<gpu rank=...>`), which must be 0..n-1 without gaps. When no ring fits
/// at any speed, NCCL's fallback is returned: one channel in rank order at 0.1 GB/s over `SYS`.
/// Errors: `InvalidArgument` for `max_channels` = 0, a system without GPUs, or ranks that are
/// not 0..n-1; `Internal` for a path whose route does not follow the system's links.
pub fn search_rings(system: &System, max_channels: usize) -> Result<RingGraph> {
    if max_channels == 0 {
        return Err(Error::invalid("search_rings: max_channels must be at least 1"));
    }
    let mut gpus: Vec<(usize, NodeId, u32)> = Vec::new();
    for id in system.ids(NodeType::Gpu) {
        let node = system.node(id);
        let Some(g) = node.gpu() else {
            return Err(Error::Internal(format!("{} is not a GPU", node.label())));
        };
        let rank = usize::try_from(g.rank)
            .map_err(|_| Error::invalid(format!("{} has no rank (rank {})", node.label(), g.rank)))?;
        gpus.push((rank, id, g.sm));
    }
    if gpus.is_empty() {
        return Err(Error::invalid("search_rings: the system has no GPU"));
    }
    gpus.sort_by_key(|g| g.0);
    if gpus.iter().enumerate().any(|(i, g)| g.0 != i) {
        let ranks: Vec<usize> = gpus.iter().map(|g| g.0).collect();
        return Err(Error::invalid(format!(
            "search_rings: GPU ranks {ranks:?} are not 0..{}",
            gpus.len()
        )));
    }
    let n = gpus.len();
    let ids: Vec<NodeId> = gpus.iter().map(|g| g.1).collect();
    let sm_min = gpus.iter().map(|g| g.2).min().unwrap_or(0);
    let paths = system.paths();
    let nodes = system.nodes();
    let has_nvs = system.count(NodeType::Nvs) > 0;

    // Hops between every GPU pair, with the links of their routes.
    let mut hops: Vec<Vec<Option<Hop>>> = vec![vec![None; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i == j {
                continue;
            }
            let Some(path) = paths.get(ids[i], ids[j]) else {
                continue;
            };
            let mut links = Vec::with_capacity(path.route.len());
            let mut prev = ids[i];
            for &next in &path.route {
                let node = &nodes[prev.0];
                let best = node
                    .links
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.remote == next)
                    .max_by(|a, b| a.1.bw.total_cmp(&b.1.bw).then(b.0.cmp(&a.0)))
                    .map(|(k, _)| k);
                let Some(k) = best else {
                    return Err(Error::Internal(format!(
                        "search_rings: the route {} -> {} crosses {} -> {}, which has no link",
                        nodes[ids[i].0].label(),
                        nodes[ids[j].0].label(),
                        node.label(),
                        nodes[next.0].label()
                    )));
                };
                links.push((prev.0, k));
                prev = next;
            }
            hops[i][j] = Some(Hop {
                kind: path.kind,
                bw: path.bw,
                nhops: path.route.len(),
                links,
            });
        }
    }

    // Candidate order after each GPU (ncclTopoSearchNextGpuSort, intra-node).
    let mut order: Vec<Vec<usize>> = Vec::with_capacity(n);
    for (i, row) in hops.iter().enumerate() {
        let mut cand: Vec<usize> = (0..n).filter(|&j| j != i && row[j].is_some()).collect();
        cand.sort_by(|&a, &b| {
            let (ha, hb) = (&row[a], &row[b]);
            match (ha, hb) {
                (Some(x), Some(y)) => {
                    y.bw.total_cmp(&x.bw)
                        .then(x.kind.cmp(&y.kind))
                        .then(x.nhops.cmp(&y.nhops))
                        .then(a.cmp(&b))
                }
                _ => a.cmp(&b),
            }
        });
        if has_nvs && n > 1 {
            // NVSwitches prefer few peers: the next rank, then the previous one, first.
            for first in [(i + n - 1) % n, (i + 1) % n] {
                if let Some(k) = cand.iter().position(|&c| c == first) {
                    cand.remove(k);
                    cand.insert(0, first);
                }
            }
        }
        order.push(cand);
    }

    // system->maxBw and system->totalBw (ncclTopoSearchInit).
    let (max_bw, total_bw) = if n == 1 {
        (crate::topo::system::LOC_BW, crate::topo::system::LOC_BW)
    } else {
        let mut max_bw = 0.0f64;
        let mut total_bw = 0.0f64;
        for i in 0..n {
            for h in hops[i].iter().flatten() {
                max_bw = max_bw.max(h.bw);
            }
            let (mut nvl, mut pci) = (0.0f64, 0.0f64);
            for l in &nodes[ids[i].0].links {
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

    let base: Vec<Vec<f64>> = nodes
        .iter()
        .map(|nd| nd.links.iter().map(|l| l.bw).collect())
        .collect();
    let speeds = speed_array_intra(sm_min);
    let mut idx = 0;
    while idx + 1 < speeds.len() && (speeds[idx] > max_bw + EPS || speeds[idx] > total_bw + EPS) {
        idx += 1;
    }
    let min_type = if n == 1 { PathType::Loc } else { PathType::Nvl };
    let mut search = Search {
        n,
        hops,
        order,
        rem: Vec::new(),
        base: &base,
        speed: speeds[idx],
        max_type: min_type,
        steps: 0,
    };

    // Pass 1 of ncclTopoCompute.
    let mut best: Option<(f64, PathType, Vec<Vec<usize>>)> = None;
    loop {
        let speed = speeds[idx];
        for ty in PathType::ALL {
            if ty < min_type || ty > PathType::Sys {
                continue;
            }
            // NCCL relaxes the type at a lower speed only up to the best graph's type.
            if let Some((_, bt, _)) = &best
                && ty > *bt
            {
                break;
            }
            search.speed = speed;
            search.max_type = ty;
            let rings = search.channels(max_channels, total_bw);
            tracing::trace!(target: "oxccl::graph", speed, typeintra = %ty, nchannels = rings.len(), "ring search");
            if rings.is_empty() {
                continue;
            }
            let better = match &best {
                None => true,
                Some((bs, _, br)) => rings.len() as f64 * speed > br.len() as f64 * bs + EPS,
            };
            if better {
                best = Some((speed, ty, rings));
            }
            break;
        }
        let Some((bs, _, br)) = &best else {
            if idx + 1 < speeds.len() {
                idx += 1;
                continue;
            }
            break;
        };
        if br.len() as f64 * bs + EPS >= total_bw {
            break;
        }
        if idx + 1 < speeds.len() && speeds[idx + 1] / bs > 0.49 {
            idx += 1;
            continue;
        }
        break;
    }

    let Some((mut speed, type_intra, mut rings)) = best else {
        tracing::warn!(target: "oxccl::graph", ngpus = n, "could not find a ring graph, falling back to rank order");
        return Ok(RingGraph {
            nchannels: 1,
            speed_intra: FALLBACK_SPEED,
            type_intra: PathType::Sys,
            rings: vec![(0..n).collect()],
        });
    };

    // ncclTopoDupChannels.
    let nch = rings.len();
    if speed >= 25.0 && !(sm_min > 80 && speed < 50.0 && nch > 4) {
        let dup = (nch * 2).min(max_channels);
        if dup > nch {
            for k in 0..dup - nch {
                let r = rings[k].clone();
                rings.push(r);
            }
            speed /= dup.div_ceil(nch) as f64;
        }
    }
    let graph = RingGraph {
        nchannels: rings.len(),
        speed_intra: speed,
        type_intra,
        rings,
    };
    tracing::debug!(target: "oxccl::graph", nchannels = graph.nchannels, speed_intra = graph.speed_intra,
        type_intra = %graph.type_intra, rings = ?graph.rings, "ring graph");
    Ok(graph)
}
