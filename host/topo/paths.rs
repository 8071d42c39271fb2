//! Paths between the nodes of a [`System`]: for every node, its best route to each CPU, GPU,
//! NET and NVS node, with the path type (how far apart, `LOC` ... `SYS`) and the bottleneck
//! bandwidth in GB/s.
//!
//! Mirrors `src/graph/paths.cc`: `ncclTopoSetPaths` (a breadth-first search from each target
//! that keeps, per node, the route of fewest hops with the highest bandwidth, routes through a
//! GPU allowed only as one NVLink hop), then `ncclTopoComputePaths`' adjustments: GPU pairs
//! that may not use P2P are routed through the CPU (`ncclTopoCheckP2p`, `NCCL_P2P_LEVEL`), GPUs
//! reach a NIC through an NVLink peer next to it (PXN), and GPU–NIC routes without GPU Direct
//! RDMA go through the CPU (`ncclTopoCheckGdr`, `NCCL_NET_GDR_LEVEL`).
//!
//! Not modelled: NVML's per-pair P2P status (NCCL disables P2P where NVML reports it
//! unsupported), the removal of GPUs that cannot reach each other through P2P or SHM (needs a
//! communicator), and the C2C-specific `P2C` paths of Grace systems.
use super::system::{LOC_BW, LinkType, NodeId, NodeType, System};
use crate::error::{Error, Result};
use std::fmt;

/// Path types from closest to farthest, numbered as NCCL's `PATH_*`.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathType {
    /// The node itself (`PATH_LOC`).
    Loc = 0,
    /// NVLink, direct or through NVSwitches (`PATH_NVL`).
    Nvl = 1,
    /// NVLink through one intermediate GPU (`PATH_NVB`).
    Nvb = 2,
    /// C2C link between a GPU and its CPU (`PATH_C2C`).
    C2c = 3,
    /// Through at most one PCI switch (`PATH_PIX`).
    Pix = 4,
    /// Through several PCI switches, not through the CPU (`PATH_PXB`).
    Pxb = 5,
    /// To a NIC through an NVLink peer GPU and its PCI switch (`PATH_PXN`).
    Pxn = 6,
    /// To a NIC through C2C and the CPU (`PATH_P2C`; not produced by oxccl yet).
    P2c = 7,
    /// Through the PCI host bridge of one CPU (`PATH_PHB`).
    Phb = 8,
    /// Across CPU sockets (`PATH_SYS`).
    Sys = 9,
    /// Through the network (`PATH_NET`).
    Net = 10,
    /// Disconnected (`PATH_DIS`).
    Dis = 11,
}

impl PathType {
    /// Every path type, closest first.
    pub const ALL: [PathType; 12] = [
        PathType::Loc,
        PathType::Nvl,
        PathType::Nvb,
        PathType::C2c,
        PathType::Pix,
        PathType::Pxb,
        PathType::Pxn,
        PathType::P2c,
        PathType::Phb,
        PathType::Sys,
        PathType::Net,
        PathType::Dis,
    ];

    /// NCCL's name (`topoPathTypeStr`).
    pub fn as_str(self) -> &'static str {
        match self {
            PathType::Loc => "LOC",
            PathType::Nvl => "NVL",
            PathType::Nvb => "NVB",
            PathType::C2c => "C2C",
            PathType::Pix => "PIX",
            PathType::Pxb => "PXB",
            PathType::Pxn => "PXN",
            PathType::P2c => "P2C",
            PathType::Phb => "PHB",
            PathType::Sys => "SYS",
            PathType::Net => "NET",
            PathType::Dis => "DIS",
        }
    }

    /// The path type named `s` (NCCL's names, as `NCCL_P2P_LEVEL` takes them).
    pub fn from_name(s: &str) -> Option<PathType> {
        PathType::ALL.into_iter().find(|t| t.as_str() == s)
    }

    fn from_link(kind: LinkType) -> PathType {
        // LINK_* and PATH_* share their numbers; LINK_NET counts as LOC (only the NIC side of a
        // network path matters).
        match kind {
            LinkType::Loc | LinkType::Net => PathType::Loc,
            LinkType::Nvl => PathType::Nvl,
            LinkType::C2c => PathType::C2c,
            LinkType::Pci => PathType::Pix,
            LinkType::Sys => PathType::Sys,
        }
    }
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One route from a node to another (NCCL's `ncclTopoLinkList`).
#[derive(Clone, Debug, PartialEq)]
pub struct Path {
    /// How far apart the two ends are.
    pub kind: PathType,
    /// Bottleneck bandwidth along the route, GB/s (`LOC_BW` for a node to itself).
    pub bw: f64,
    /// The nodes after the source, the destination last; empty for a node to itself.
    pub route: Vec<NodeId>,
}

impl Path {
    /// Number of hops (links).
    pub fn count(&self) -> usize {
        self.route.len()
    }
}

/// Knobs of path computation, NCCL's defaults unless set (`Default` is NCCL's behaviour without
/// any variable set).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PathOptions {
    /// Farthest path type over which two GPUs use P2P; farther pairs are routed through the CPU
    /// (`NCCL_P2P_LEVEL`, or `LOC` with `NCCL_P2P_DISABLE=1`). `None`: NCCL's default, PXB (SYS on
    /// AMD CPUs with at most 2 GPUs).
    pub p2p_level: Option<PathType>,
    /// No routes through an intermediate GPU (`NCCL_NVB_DISABLE=1`).
    pub nvb_disable: bool,
    /// No PXN routes to NICs (`NCCL_PXN_DISABLE=1`).
    pub pxn_disable: bool,
    /// Farthest path type between a GPU and a NIC at which GPU Direct RDMA is used
    /// (`NCCL_NET_GDR_LEVEL`). `None`: NCCL's default, PXB.
    pub net_gdr_level: Option<PathType>,
}

/// NCCL's old numeric levels for `NCCL_P2P_LEVEL` / `NCCL_NET_GDR_LEVEL` (`levelsOldToNew`).
const OLD_LEVELS: [PathType; 6] = [
    PathType::Loc,
    PathType::Pix,
    PathType::Pxb,
    PathType::Phb,
    PathType::Sys,
    PathType::Sys,
];

fn parse_level(key: &str, v: &str) -> Result<PathType> {
    let v = v.trim();
    if let Some(t) = PathType::from_name(v).filter(|t| *t <= PathType::Sys) {
        return Ok(t);
    }
    if let Ok(n) = v.parse::<u32>() {
        return Ok(OLD_LEVELS[(n as usize).min(OLD_LEVELS.len() - 1)]);
    }
    Err(Error::invalid(format!(
        "{key}={v:?} is not a path level (accepted: LOC, NVL, NVB, C2C, PIX, PXB, PXN, P2C, PHB, SYS, or 0-5)"
    )))
}

fn parse_flag(key: &str, v: &str) -> Result<bool> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(Error::invalid(format!("{key}={v:?} is not 0 or 1"))),
    }
}

impl PathOptions {
    /// Reads `NCCL_P2P_DISABLE`, `NCCL_P2P_LEVEL`, `NCCL_NVB_DISABLE`, `NCCL_PXN_DISABLE` and
    /// `NCCL_NET_GDR_LEVEL` (or their `OXCCL_` spellings). Bad values are `InvalidArgument`
    /// errors naming the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(crate::params::env_var)
    }

    /// As [`PathOptions::from_env`], with the variables given by `get` (name without prefix ->
    /// full name and value).
    pub fn from_lookup(get: impl Fn(&str) -> Option<(String, String)>) -> Result<Self> {
        let mut o = PathOptions::default();
        if let Some((key, v)) = get("P2P_DISABLE")
            && parse_flag(&key, &v)?
        {
            o.p2p_level = Some(PathType::Loc);
        }
        if o.p2p_level.is_none()
            && let Some((key, v)) = get("P2P_LEVEL")
        {
            o.p2p_level = Some(parse_level(&key, &v)?);
        }
        if let Some((key, v)) = get("NVB_DISABLE") {
            o.nvb_disable = parse_flag(&key, &v)?;
        }
        if let Some((key, v)) = get("PXN_DISABLE") {
            o.pxn_disable = parse_flag(&key, &v)?;
        }
        if let Some((key, v)) = get("NET_GDR_LEVEL") {
            o.net_gdr_level = Some(parse_level(&key, &v)?);
        }
        if o != PathOptions::default() {
            tracing::debug!(target: "oxccl::graph", options = ?o, "path options from the environment");
        }
        Ok(o)
    }
}

/// The paths of a system: for every node, its path to each CPU, GPU, NET and NVS node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Paths {
    /// `table[to][from]`: filled for targets of those four types, empty otherwise.
    table: Vec<Vec<Option<Path>>>,
}

impl Paths {
    /// The path from `from` to `to`; `None` when `to` is not a CPU, GPU, NET or NVS node or is
    /// unreachable (NCCL's `PATH_DIS`).
    pub fn get(&self, from: NodeId, to: NodeId) -> Option<&Path> {
        self.table.get(to.0)?.get(from.0)?.as_ref()
    }

    /// The path type from `from` to `to`, `DIS` when there is none.
    pub fn kind(&self, from: NodeId, to: NodeId) -> PathType {
        self.get(from, to).map_or(PathType::Dis, |p| p.kind)
    }

    /// The bottleneck bandwidth from `from` to `to` in GB/s, 0 when there is no path.
    pub fn bw(&self, from: NodeId, to: NodeId) -> f64 {
        self.get(from, to).map_or(0.0, |p| p.bw)
    }

    fn set(&mut self, from: NodeId, to: NodeId, path: Path) {
        self.table[to.0][from.0] = Some(path);
    }
}

/// NCCL's `ncclTopoSetPaths`: breadth-first from `base`, storing at every node its path to base.
fn set_paths(sys: &System, paths: &mut Paths, base: NodeId, nvb_disable: bool) -> Result<()> {
    let n = sys.nodes.len();
    let mut col: Vec<Option<Path>> = vec![None; n];
    col[base.0] = Some(Path {
        kind: PathType::Loc,
        bw: LOC_BW,
        route: Vec::new(),
    });
    let mut frontier = vec![base];
    while !frontier.is_empty() {
        let mut next: Vec<NodeId> = Vec::new();
        for &node in &frontier {
            let Some(path) = col[node.0].clone() else {
                return Err(Error::Internal(format!(
                    "topology: node {} lost its path",
                    node.0
                )));
            };
            let nd = sys.node(node);
            for link in &nd.links {
                let rem = link.remote;
                let rnd = sys.node(rem);
                let bw = path.bw.min(link.bw);
                // Route through a GPU only as one NVLink hop to another GPU.
                if node != base
                    && nd.node_type() == NodeType::Gpu
                    && (nvb_disable
                        || link.kind != LinkType::Nvl
                        || rnd.node_type() != NodeType::Gpu
                        || path.count() > 1)
                {
                    continue;
                }
                let better = match &col[rem.0] {
                    None => true,
                    Some(rp) => rp.count() > path.count() && rp.bw < bw,
                };
                if !better {
                    continue;
                }
                if rnd.link_to(node, link.kind).is_none() {
                    return Err(Error::invalid(format!(
                        "{}: {} link {} -> {} has no link back (an <nvlink> listed on one GPU only?)",
                        sys.xml.source,
                        link.kind,
                        nd.label(),
                        rnd.label()
                    )));
                }
                let mut route = Vec::with_capacity(path.count() + 1);
                route.push(node);
                route.extend_from_slice(&path.route);
                let mut kind = PathType::from_link(link.kind);
                if nd.node_type() == NodeType::Pci && rnd.node_type() == NodeType::Pci {
                    kind = PathType::Pxb;
                }
                if link.kind == LinkType::Pci
                    && (nd.node_type() == NodeType::Cpu || rnd.node_type() == NodeType::Cpu)
                {
                    kind = PathType::Phb;
                }
                if nd.node_type() == NodeType::Gpu
                    && path.kind == PathType::Nvl
                    && kind == PathType::Nvl
                    && route.len() > 1
                {
                    kind = PathType::Nvb;
                }
                col[rem.0] = Some(Path {
                    kind: path.kind.max(kind),
                    bw,
                    route,
                });
                if !next.contains(&rem) {
                    next.push(rem);
                }
            }
        }
        frontier = next;
    }
    paths.table[base.0] = col;
    Ok(())
}

/// NCCL's `addInterStep`: the path from `src` to `dst` becomes src -> `via` -> dst.
fn add_inter_step(paths: &mut Paths, via: NodeId, src: NodeId, dst: NodeId, pxn: bool) -> Result<()> {
    let (Some(a), Some(b)) = (paths.get(src, via), paths.get(via, dst)) else {
        return Err(Error::Internal(format!(
            "topology: no path {} -> {} -> {} to route through",
            src.0, via.0, dst.0
        )));
    };
    let mut route = a.route.clone();
    route.extend_from_slice(&b.route);
    let path = Path {
        kind: if pxn { PathType::Pxn } else { a.kind.max(b.kind) },
        bw: a.bw.min(b.bw),
        route,
    };
    paths.set(src, dst, path);
    Ok(())
}

/// NCCL's `ncclTopoGetLocal`: the nodes of type `ty` with the best path from `from` (highest
/// bandwidth, then closest type), in index order.
fn local_nodes(sys: &System, paths: &Paths, from: NodeId, ty: NodeType) -> Vec<NodeId> {
    let (mut max_bw, mut min_type) = (0.0f64, PathType::Dis);
    let mut out = Vec::new();
    for id in sys.ids(ty) {
        let (bw, kind) = (paths.bw(from, id), paths.kind(from, id));
        if bw > max_bw || (bw == max_bw && kind < min_type) {
            max_bw = bw;
            min_type = kind;
            out.clear();
        }
        if bw == max_bw && kind == min_type {
            out.push(id);
        }
    }
    out
}

fn mirror_bits(val: usize, pow2: usize) -> usize {
    let (mut mirror, mut b, mut mb) = (0, 1, pow2 >> 1);
    while b < pow2 {
        if val & b != 0 {
            mirror |= mb;
        }
        b <<= 1;
        mb >>= 1;
    }
    mirror
}

/// NCCL's `ncclTopoGetLocalNet`: the NET a GPU uses on `channel`, spreading GPUs over their
/// closest NICs.
fn local_net(sys: &System, paths: &Paths, gpu: NodeId, channel: usize) -> Option<NodeId> {
    let nets = local_nodes(sys, paths, gpu, NodeType::Net);
    let first = *nets.first()?;
    let gpus = local_nodes(sys, paths, first, NodeType::Gpu);
    let mut net = sys.node(gpu).gpu().map_or(0, |g| g.dev.max(0) as usize);
    if nets.len().is_power_of_two() {
        net = mirror_bits(net, nets.len());
    }
    net += channel % nets.len().div_ceil(gpus.len().max(1));
    Some(nets[net % nets.len()])
}

/// NCCL's `ncclTopoGetLocalGpu`: the GPU next to a NET that uses it first.
fn local_gpu(sys: &System, paths: &Paths, net: NodeId) -> Option<NodeId> {
    let gpus = local_nodes(sys, paths, net, NodeType::Gpu);
    for c in 0..super::system::MAX_CHANNELS as usize {
        for &g in &gpus {
            if local_net(sys, paths, g, c) == Some(net) {
                return Some(g);
            }
        }
    }
    None
}

/// NCCL's `ncclTopoComputePaths` (without a communicator).
pub(crate) fn compute(sys: &System, opts: &PathOptions) -> Result<Paths> {
    let mut paths = Paths {
        table: vec![Vec::new(); sys.nodes.len()],
    };
    for ty in [NodeType::Cpu, NodeType::Gpu, NodeType::Net, NodeType::Nvs] {
        for base in sys.ids(ty) {
            set_paths(sys, &mut paths, base, opts.nvb_disable)?;
        }
    }
    let gpus = sys.ids(NodeType::Gpu);
    let p2p_level = opts.p2p_level.unwrap_or_else(|| match sys.cpu_type() {
        Some((super::system::CpuArch::X86, super::system::CpuVendor::Amd, _)) if gpus.len() <= 2 => {
            PathType::Sys
        }
        _ => PathType::Pxb,
    });
    // GPU pairs that may not use P2P go through the CPU next to the receiving GPU.
    for &g in &gpus {
        for &p in &gpus {
            if paths.kind(p, g) <= p2p_level {
                continue;
            }
            let Some(cpu) = local_cpu(sys, &paths, g) else {
                continue;
            };
            add_inter_step(&mut paths, cpu, p, g, false)?;
        }
    }
    let gdr_level = opts.net_gdr_level.unwrap_or(PathType::Pxb);
    for net in sys.ids(NodeType::Net) {
        for &g in &gpus {
            if !opts.pxn_disable
                && let Some(peer) = local_gpu(sys, &paths, net)
                && peer != g
            {
                let (peer_net, g_net) = (paths.get(peer, net), paths.get(g, net));
                let peer_ok = peer_net.is_some_and(|p| p.kind <= PathType::Pxb)
                    && paths.kind(peer, g) <= PathType::Nvl
                    && sys.node(peer).system_id == sys.node(g).system_id;
                let gain = match (peer_net, g_net) {
                    (Some(pp), Some(gp)) => pp.bw > gp.bw || gp.kind > PathType::Pxb,
                    (Some(_), None) => true,
                    _ => false,
                };
                if peer_ok && gain {
                    add_inter_step(&mut paths, peer, g, net, true)?;
                }
            }
            // Without GPU Direct RDMA, NIC traffic goes through the CPU next to the GPU.
            if paths.kind(g, net) < PathType::Phb
                && !gdr(sys, &paths, g, net, gdr_level)
                && let Some(cpu) = local_cpu(sys, &paths, g)
            {
                add_inter_step(&mut paths, cpu, net, g, false)?;
                add_inter_step(&mut paths, cpu, g, net, false)?;
            }
        }
    }
    Ok(paths)
}

/// The GPU a PXN path goes through: the first node of the route past the NVSwitch (NCCL's
/// `ncclTopoGetIntermediateRank`); `None` for a path that is not PXN or has no such GPU.
pub(crate) fn intermediate_gpu(sys: &System, path: &Path) -> Option<NodeId> {
    if path.kind != PathType::Pxn {
        return None;
    }
    let node = *path
        .route
        .iter()
        .find(|&&n| sys.node(n).node_type() != NodeType::Nvs)?;
    (sys.node(node).node_type() == NodeType::Gpu).then_some(node)
}

pub(crate) fn local_cpu(sys: &System, paths: &Paths, gpu: NodeId) -> Option<NodeId> {
    let mut best: Option<(usize, NodeId)> = None;
    for c in sys.ids(NodeType::Cpu) {
        let hops = paths.get(gpu, c).map_or(0, |p| p.count());
        if best.is_none_or(|(h, _)| hops < h) {
            best = Some((hops, c));
        }
    }
    best.map(|(_, c)| c)
}

/// NCCL's `ncclTopoCheckGdr` for receives: both ends support GPU Direct RDMA and the GPU (or,
/// for a PXN path, the peer GPU it goes through) is no farther than `level` from the NIC.
fn gdr(sys: &System, paths: &Paths, gpu: NodeId, net: NodeId, level: PathType) -> bool {
    let net_gdr = sys.node(net).net().is_some_and(|n| n.gdr);
    let gpu_gdr = sys.node(gpu).gpu().is_some_and(|g| g.gdr);
    if !net_gdr || !gpu_gdr {
        return false;
    }
    let Some(path) = paths.get(gpu, net) else {
        return false;
    };
    let mut distance = path.kind;
    if distance == PathType::Pxn {
        match intermediate_gpu(sys, path) {
            Some(proxy) => distance = paths.kind(proxy, net),
            None => return false,
        }
    }
    distance <= level
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<PathOptions> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (format!("NCCL_{k}"), v.to_string()))
            .collect();
        PathOptions::from_lookup(|name| vars.iter().find(|(k, _)| k == &format!("NCCL_{name}")).cloned())
    }

    #[test]
    fn options_from_environment() {
        assert_eq!(with(&[]).unwrap(), PathOptions::default());
        assert_eq!(
            with(&[("P2P_LEVEL", "PHB")]).unwrap().p2p_level,
            Some(PathType::Phb)
        );
        assert_eq!(
            with(&[("P2P_LEVEL", "2")]).unwrap().p2p_level,
            Some(PathType::Pxb)
        );
        assert_eq!(
            with(&[("P2P_LEVEL", "9")]).unwrap().p2p_level,
            Some(PathType::Sys)
        );
        assert_eq!(
            with(&[("P2P_DISABLE", "1"), ("P2P_LEVEL", "SYS")])
                .unwrap()
                .p2p_level,
            Some(PathType::Loc)
        );
        assert!(with(&[("NVB_DISABLE", "1")]).unwrap().nvb_disable);
        assert!(with(&[("PXN_DISABLE", "1")]).unwrap().pxn_disable);
        assert_eq!(
            with(&[("NET_GDR_LEVEL", "SYS")]).unwrap().net_gdr_level,
            Some(PathType::Sys)
        );
        let e = with(&[("P2P_LEVEL", "FAR")]).unwrap_err();
        assert!(e.to_string().contains("NCCL_P2P_LEVEL"), "{e}");
        assert!(with(&[("PXN_DISABLE", "yes")]).is_err());
    }

    #[test]
    fn mirror() {
        assert_eq!(mirror_bits(1, 2), 1);
        assert_eq!(mirror_bits(1, 4), 2);
        assert_eq!(mirror_bits(3, 8), 6);
        assert_eq!(mirror_bits(5, 1), 0);
    }

    #[test]
    fn names() {
        for t in PathType::ALL {
            assert_eq!(PathType::from_name(t.as_str()), Some(t));
        }
    }
}
