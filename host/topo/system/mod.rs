//! The system graph: GPU, PCI, NVS, CPU, NIC and NET nodes joined by typed links with a bandwidth
//! in GB/s, built from a topology XML tree.
//!
//! Mirrors `src/graph/topo.cc` / `topo.h`: `ncclTopoGetSystemFromXml` (`ncclTopoAddCpu`,
//! `ncclTopoAddPci`, `ncclTopoAddGpu`, `ncclTopoAddNic`, `ncclTopoAddNet`, `ncclTopoAddNvLinks`,
//! `ncclTopoAddC2c`, `ncclTopoAddPciLinks`, `ncclTopoFlattenBcmSwitches`, `ncclTopoConnectCpus`,
//! `ncclTopoSortSystem`), `ncclTopoConnectNodes`, `ncclTopoRemoveNode` and NCCL's bandwidth
//! constants.
//!
//! | file | what | mirrors in NCCL |
//! |---|---|---|
//! | `system/mod.rs` | nodes, links, the bandwidth constants, queries and trimming of the graph | `src/graph/topo.h`, `ncclTopoConnectNodes`, `ncclTopoRemoveNode`, `ncclTopoGetInterCpuBw` in `src/graph/topo.cc` |
//! | `system/from_xml.rs` | building the graph from the XML tree | `ncclTopoGetSystemFromXml` and the `ncclTopoAdd*` it calls, in `src/graph/topo.cc` |
use super::paths::{PathOptions, Paths};
use super::xml::{Xml, bus_id_to_int};
use crate::error::{Error, Result};
use std::fmt;
use std::path::Path as FsPath;

mod from_xml;

use from_xml::Builder;
pub(crate) use from_xml::parse_int;

/// Bandwidth of a node to itself and of links NCCL treats as free, in GB/s (`LOC_BW`).
pub const LOC_BW: f64 = 5000.0;
/// Per-NVLink bandwidth of Pascal (sm60), GB/s (`SM60_NVLINK_BW`).
pub const SM60_NVLINK_BW: f64 = 18.0;
/// Per-NVLink bandwidth of Volta (sm70), GB/s (`SM70_NVLINK_BW`).
pub const SM70_NVLINK_BW: f64 = 20.0;
/// Per-NVLink bandwidth of Ampere A100 (sm80), GB/s (`SM80_NVLINK_BW`).
pub const SM80_NVLINK_BW: f64 = 20.0;
/// Per-NVLink bandwidth of Ampere sm86 boards, GB/s (`SM86_NVLINK_BW`).
pub const SM86_NVLINK_BW: f64 = 12.0;
/// Per-NVLink bandwidth of Hopper (sm90), GB/s (`SM90_NVLINK_BW`): 18 links give 370.8 GB/s.
pub const SM90_NVLINK_BW: f64 = 20.6;
/// Per-NVLink bandwidth of Blackwell (sm100 and later), GB/s (`SM100_NVLINK_BW`).
pub const SM100_NVLINK_BW: f64 = 40.1;
/// PCI Gen3 x16 bandwidth, GB/s (`PCI_BW`).
pub const PCI_BW: f64 = 12.0;
/// Inter-socket bandwidth of AMD CPUs, GB/s (`AMD_BW`).
pub const AMD_BW: f64 = 16.0;
/// QPI bandwidth of Intel Broadwell and older, GB/s (`BDW_QPI_BW`).
pub const BDW_QPI_BW: f64 = 6.0;
/// UPI bandwidth of Intel Skylake to Ice Lake, GB/s (`SKL_QPI_BW`).
pub const SKL_QPI_BW: f64 = 10.0;
/// UPI bandwidth of Intel Sapphire Rapids, GB/s (`SRP_QPI_BW`).
pub const SRP_QPI_BW: f64 = 22.0;
/// UPI bandwidth of Intel Emerald Rapids and later, GB/s (`ERP_QPI_BW`).
pub const ERP_QPI_BW: f64 = 40.0;
/// Inter-socket bandwidth of Zhaoxin CPUs, GB/s (`ZPI_BW`).
pub const ZPI_BW: f64 = 6.0;
/// Inter-socket bandwidth of Zhaoxin Yongfeng CPUs, GB/s (`YONGFENG_ZPI_BW`).
pub const YONGFENG_ZPI_BW: f64 = 9.0;
/// Inter-socket bandwidth of POWER9, GB/s (`P9_BW`).
pub const P9_BW: f64 = 32.0;
/// Inter-socket bandwidth of ARM CPUs, GB/s (`ARM_BW`).
pub const ARM_BW: f64 = 6.0;
/// Network bandwidth assumed for a 100 Gb/s NIC, GB/s (`NET_BW`).
pub const NET_BW: f64 = 12.0;
/// Channels a network device allows when its `<net>` has no `maxconn` (NCCL's `MAXCHANNELS`).
pub const MAX_CHANNELS: u32 = 64;

/// Per-link NVLink bandwidth in GB/s for a GPU of compute capability `sm` (× 10), NCCL's
/// `ncclTopoNVLinkBw`.
pub fn nvlink_bw(sm: u32) -> f64 {
    match sm {
        100.. => SM100_NVLINK_BW,
        90.. => SM90_NVLINK_BW,
        86 => SM86_NVLINK_BW,
        80.. => SM80_NVLINK_BW,
        70.. => SM70_NVLINK_BW,
        60.. => SM60_NVLINK_BW,
        _ => SM80_NVLINK_BW,
    }
}

/// Node types, numbered as NCCL's (`GPU` 0 ... `NET` 5).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeType {
    /// A GPU of the communicator.
    Gpu = 0,
    /// A PCI switch or bridge.
    Pci = 1,
    /// The NVSwitch fabric (all NVSwitches collapsed into one node).
    Nvs = 2,
    /// A CPU socket / NUMA node, root of a PCI tree.
    Cpu = 3,
    /// A network card (the PCI device; its ports are NET nodes).
    Nic = 4,
    /// A network device (port) as the network plugin lists it.
    Net = 5,
}

impl NodeType {
    /// Every node type, in NCCL's order.
    pub const ALL: [NodeType; 6] = [
        NodeType::Gpu,
        NodeType::Pci,
        NodeType::Nvs,
        NodeType::Cpu,
        NodeType::Nic,
        NodeType::Net,
    ];

    /// NCCL's name (`topoNodeTypeStr`).
    pub fn as_str(self) -> &'static str {
        match self {
            NodeType::Gpu => "GPU",
            NodeType::Pci => "PCI",
            NodeType::Nvs => "NVS",
            NodeType::Cpu => "CPU",
            NodeType::Nic => "NIC",
            NodeType::Net => "NET",
        }
    }
}

impl fmt::Display for NodeType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Link types, numbered as NCCL's `LINK_*` so that a link type compares with the path type of
/// the same name (`LINK_NVL` = `PATH_NVL` = 1).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkType {
    /// Local, or a free link (`LINK_LOC`; PCI peer links `<pcilink>`).
    Loc = 0,
    /// NVLink (`LINK_NVL`).
    Nvl = 1,
    /// Chip-to-chip NVLink between a GPU and its CPU (`LINK_C2C`).
    C2c = 3,
    /// PCI Express (`LINK_PCI`).
    Pci = 4,
    /// Between CPU sockets: QPI/UPI/Infinity Fabric... (`LINK_SYS`).
    Sys = 9,
    /// Between a NIC and its network devices (`LINK_NET`).
    Net = 10,
}

impl LinkType {
    /// NCCL's name (`topoLinkTypeStr`).
    pub fn as_str(self) -> &'static str {
        match self {
            LinkType::Loc => "LOC",
            LinkType::Nvl => "NVL",
            LinkType::C2c => "C2C",
            LinkType::Pci => "PCI",
            LinkType::Sys => "SYS",
            LinkType::Net => "NET",
        }
    }
}

impl fmt::Display for LinkType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Index of a node in [`System::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub usize);

/// A directed link from one node to `remote` (NCCL's `ncclTopoLink`).
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    /// Link type.
    pub kind: LinkType,
    /// The node at the other end.
    pub remote: NodeId,
    /// Bandwidth in GB/s (links of one type to one remote are aggregated, e.g. 18 NVLinks).
    pub bw: f64,
}

/// CPU architecture (`kvDictCpuArch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuArch {
    /// `x86_64`.
    X86,
    /// `ppc64` (POWER).
    Power,
    /// `arm64`.
    Arm,
    /// Anything else.
    Other,
}

/// CPU vendor of an x86 CPU (`kvDictCpuVendor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuVendor {
    /// `GenuineIntel`.
    Intel,
    /// `AuthenticAMD`.
    Amd,
    /// `CentaurHauls` or `  Shanghai  `.
    Zhaoxin,
    /// Unknown, or not x86.
    Other,
}

/// CPU model family as far as NCCL's bandwidth model cares (`NCCL_TOPO_CPU_MODEL_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuModel {
    /// Intel Broadwell and older (family 6, model < 0x55).
    IntelBroadwell,
    /// Intel Skylake to Ice Lake (family 6, model 0x55..0x8F).
    IntelSkylake,
    /// Intel Sapphire Rapids (family 6, model 0x8F..0xCF).
    IntelSapphireRapids,
    /// Intel Emerald Rapids and later (family 6, model >= 0xCF).
    IntelEmeraldRapids,
    /// Zhaoxin Yongfeng (family 7, model 0x5B).
    ZhaoxinYongfeng,
    /// Not distinguished.
    Other,
}

/// A CPU socket / NUMA node.
#[derive(Clone, Debug, PartialEq)]
pub struct Cpu {
    /// NUMA node id (`numaid`; -1 when the machine does not say).
    pub numa_id: i32,
    /// Architecture (`arch`).
    pub arch: CpuArch,
    /// Vendor (`vendor`).
    pub vendor: CpuVendor,
    /// Model family (from `familyid` / `modelid`).
    pub model: CpuModel,
    /// The `affinity` mask as the file gives it (comma-separated 32-bit hex words, most
    /// significant first), if any.
    pub affinity: Option<String>,
    /// The CPU cores of `affinity`, ascending.
    pub cores: Vec<u32>,
    /// Host hash of the machine the CPU belongs to (`host_hash`; 0 when absent).
    pub host_hash: u64,
}

/// A GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// CUDA device index (`dev`).
    pub dev: i32,
    /// Rank of the communicator using this GPU (`rank`).
    pub rank: i32,
    /// Compute capability × 10 (`sm`, NCCL's `cudaCompCap`).
    pub sm: u32,
    /// GPU Direct RDMA support (`gdr`).
    pub gdr: bool,
}

/// A network device (one port of a NIC).
#[derive(Clone, Debug, PartialEq)]
pub struct Net {
    /// Network device index (`dev`).
    pub dev: i32,
    /// Device name (`name`), e.g. `mlx5_0` or `eth0`.
    pub name: String,
    /// Bandwidth in GB/s: `speed` (Mb/s) / 8000, with 10000 Mb/s assumed when absent or <= 0.
    pub bw: f64,
    /// Latency in µs (`latency`).
    pub latency: f64,
    /// Port number (`port`).
    pub port: i32,
    /// ASIC id (`guid`; `dev` when absent).
    pub guid: u64,
    /// Channels the device allows (`maxconn`).
    pub max_channels: u32,
    /// GPU Direct RDMA support (`gdr`).
    pub gdr: bool,
    /// Collective offload support (`coll`).
    pub coll: bool,
}

/// What a node is, with the data of its type.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    /// A GPU.
    Gpu(Gpu),
    /// A PCI switch or bridge.
    Pci,
    /// The NVSwitch fabric.
    Nvs,
    /// A CPU socket.
    Cpu(Cpu),
    /// A network card.
    Nic,
    /// A network device.
    Net(Net),
}

/// PCI attributes of a GPU, PCI switch or NIC node, from its `<pci>` element.
#[derive(Clone, Debug, PartialEq)]
pub struct PciInfo {
    /// Bus id as written in the file (`busid`).
    pub bus_id: String,
    /// PCI class (`class`), e.g. `0x060400` for a bridge.
    pub class: String,
    /// `vendor` << 48 | `device` << 32 | `subsystem_vendor` << 16 | `subsystem_device`
    /// (NCCL's `pci.device`; 0 where absent).
    pub device: u64,
    /// Link width in lanes (`link_width`; 0 in the file is read as 16, as NCCL does).
    pub link_width: u32,
    /// Link speed as written (`link_speed`, e.g. `16 GT/s` or `32.0 GT/s PCIe`).
    pub link_speed: String,
    /// Bandwidth of the link to the parent, GB/s: width × per-lane rate (Gen3 60, Gen4 120, Gen5
    /// 240, in 100 Mb/s) / 80; x16 Gen4 = 24 GB/s.
    pub bw: f64,
}

/// One node of the system graph (NCCL's `ncclTopoNode`).
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// NCCL's topology id: the system (host) id in the top 8 bits, then the bus id (GPU, PCI),
    /// NUMA id (CPU), device index (NET), or 0 (NVS).
    pub id: i64,
    /// Which host of a multi-host (MNNVL) file the node belongs to, by order of `host_hash`.
    pub system_id: usize,
    /// What the node is.
    pub kind: NodeKind,
    /// PCI attributes, for nodes made from a `<pci>` element.
    pub pci: Option<PciInfo>,
    /// Outgoing links, by decreasing bandwidth; for nodes of the PCI tree the link up to the
    /// parent comes last (NCCL's `ncclTopoSortSystem`).
    pub links: Vec<Link>,
}

impl Node {
    /// The node's type.
    pub fn node_type(&self) -> NodeType {
        match self.kind {
            NodeKind::Gpu(_) => NodeType::Gpu,
            NodeKind::Pci => NodeType::Pci,
            NodeKind::Nvs => NodeType::Nvs,
            NodeKind::Cpu(_) => NodeType::Cpu,
            NodeKind::Nic => NodeType::Nic,
            NodeKind::Net(_) => NodeType::Net,
        }
    }

    /// The GPU data, for a GPU node.
    pub fn gpu(&self) -> Option<&Gpu> {
        match &self.kind {
            NodeKind::Gpu(g) => Some(g),
            _ => None,
        }
    }

    /// The CPU data, for a CPU node.
    pub fn cpu(&self) -> Option<&Cpu> {
        match &self.kind {
            NodeKind::Cpu(c) => Some(c),
            _ => None,
        }
    }

    /// The network device data, for a NET node.
    pub fn net(&self) -> Option<&Net> {
        match &self.kind {
            NodeKind::Net(n) => Some(n),
            _ => None,
        }
    }

    /// The link to `remote` of type `kind`, if any.
    pub fn link_to(&self, remote: NodeId, kind: LinkType) -> Option<&Link> {
        self.links.iter().find(|l| l.remote == remote && l.kind == kind)
    }

    /// A short label: `GPU/0` (by dev), `NET/1`, `CPU/0` (by NUMA id), `PCI/ffff:ff:01.0`, `NVS/0`.
    pub fn label(&self) -> String {
        match &self.kind {
            NodeKind::Gpu(g) => format!("GPU/{}", g.dev),
            NodeKind::Net(n) => format!("NET/{}", n.dev),
            NodeKind::Cpu(c) => format!("CPU/{}", c.numa_id),
            NodeKind::Nvs => "NVS/0".to_string(),
            NodeKind::Pci | NodeKind::Nic => format!(
                "{}/{}",
                self.node_type(),
                self.pci.as_ref().map(|p| p.bus_id.as_str()).unwrap_or("-")
            ),
        }
    }
}

/// The system graph of one machine (or of several hosts of one NVLink domain): nodes, typed
/// links with bandwidths in GB/s, the XML it was built from, and the paths between GPUs, NICs,
/// CPUs and NVSwitches (NCCL's `ncclTopoSystem`).
#[derive(Clone, Debug)]
pub struct System {
    pub(crate) xml: Xml,
    pub(crate) nodes: Vec<Node>,
    pub(crate) host_hashes: Vec<u64>,
    pub(crate) options: PathOptions,
    pub(crate) paths: Paths,
}

impl System {
    /// Builds the system graph from a topology XML tree and computes its paths with the
    /// options of the environment ([`PathOptions::from_env`]). Mirrors
    /// `ncclTopoGetSystemFromXml` followed by `ncclTopoComputePaths`. Errors: a root that is not
    /// `<system version="1">`, or a missing / malformed attribute, as `InvalidArgument` naming
    /// the file and line.
    pub fn from_xml(xml: Xml) -> Result<System> {
        let options = PathOptions::from_env()?;
        System::from_xml_with(xml, options)
    }

    /// As [`System::from_xml`], with explicit path options.
    pub fn from_xml_with(xml: Xml, options: PathOptions) -> Result<System> {
        let mut sys = Builder::build(xml)?;
        sys.options = options;
        sys.paths = super::paths::compute(&sys, &sys.options)?;
        tracing::debug!(target: "oxccl::graph", source = %sys.xml.source, gpus = sys.count(NodeType::Gpu), nets = sys.count(NodeType::Net), nodes = sys.nodes.len(), "topology system built");
        Ok(sys)
    }

    /// Reads a topology file (`NCCL_TOPO_FILE` format) and builds its system graph.
    pub fn from_xml_file(path: impl AsRef<FsPath>) -> Result<System> {
        System::from_xml(Xml::from_file(path)?)
    }

    /// Parses topology XML text (`source` names it in errors) and builds its system graph.
    pub fn from_xml_str(text: &str, source: &str) -> Result<System> {
        System::from_xml(Xml::parse(text, source)?)
    }

    /// The system of the file named by `NCCL_TOPO_FILE` / `OXCCL_TOPO_FILE`; `None` when unset.
    pub fn from_env() -> Result<Option<System>> {
        Xml::from_env()?.map(System::from_xml).transpose()
    }

    /// The XML tree the system was built from.
    pub fn xml(&self) -> &Xml {
        &self.xml
    }

    /// The XML tree in NCCL's `NCCL_TOPO_DUMP_FILE` layout.
    pub fn to_xml_string(&self) -> String {
        self.xml.to_xml_string()
    }

    /// Every node; [`NodeId`] indexes this slice. Nodes of one type are in NCCL's index order
    /// (the order of the XML).
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    /// The nodes of type `ty`, in NCCL's index order.
    pub fn ids(&self, ty: NodeType) -> Vec<NodeId> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].node_type() == ty)
            .map(NodeId)
            .collect()
    }

    /// How many nodes of type `ty` there are.
    pub fn count(&self, ty: NodeType) -> usize {
        self.nodes.iter().filter(|n| n.node_type() == ty).count()
    }

    /// The GPU whose CUDA device index is `dev`.
    pub fn gpu_by_dev(&self, dev: i32) -> Option<NodeId> {
        self.find(|n| n.gpu().is_some_and(|g| g.dev == dev))
    }

    /// The GPU used by rank `rank` (NCCL's `ncclTopoRankToIndex`).
    pub fn gpu_by_rank(&self, rank: i32) -> Option<NodeId> {
        self.find(|n| n.gpu().is_some_and(|g| g.rank == rank))
    }

    /// The network device with index `dev`.
    pub fn net_by_dev(&self, dev: i32) -> Option<NodeId> {
        self.find(|n| n.net().is_some_and(|x| x.dev == dev))
    }

    /// The node of type `ty` whose PCI bus id is `bus_id` (compared as numbers).
    pub fn node_by_bus_id(&self, ty: NodeType, bus_id: &str) -> Option<NodeId> {
        let want = bus_id_to_int(bus_id)?;
        self.find(|n| {
            n.node_type() == ty && n.pci.as_ref().and_then(|p| bus_id_to_int(&p.bus_id)) == Some(want)
        })
    }

    fn find(&self, pred: impl Fn(&Node) -> bool) -> Option<NodeId> {
        self.nodes.iter().position(pred).map(NodeId)
    }

    /// The paths computed for this system.
    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    /// Keeps only the GPUs of the communicator whose ranks are `ranks` (all of them, on every
    /// host) and recomputes the paths (NCCL's `ncclTopoTrimSystem` + `ncclTopoComputePaths`).
    /// When every rank of `ranks` is a GPU of this system, the NET nodes go too: a communicator
    /// within one machine does not use the network. A rank listed twice is an `InvalidArgument`.
    pub fn trim(&mut self, ranks: &[i32]) -> Result<()> {
        let mut seen = ranks.to_vec();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid(format!("trim: ranks {ranks:?} list a rank twice")));
        }
        let remove: Vec<NodeId> = self
            .ids(NodeType::Gpu)
            .into_iter()
            .filter(|&id| self.node(id).gpu().is_some_and(|g| !ranks.contains(&g.rank)))
            .collect();
        let mut removed: Vec<i32> = remove
            .iter()
            .filter_map(|&id| self.node(id).gpu().map(|g| g.rank))
            .collect();
        self.remove_nodes(&remove);
        let mut nets_removed = 0;
        if self.count(NodeType::Gpu) == ranks.len() {
            let nets = self.ids(NodeType::Net);
            nets_removed = nets.len();
            self.remove_nodes(&nets);
        }
        removed.sort_unstable();
        tracing::debug!(target: "oxccl::graph", ?removed, nets_removed, gpus = self.count(NodeType::Gpu), "topology trimmed to the communicator");
        self.paths = super::paths::compute(self, &self.options)?;
        Ok(())
    }

    /// Sets the path options and recomputes the paths with them.
    pub(crate) fn set_path_options(&mut self, options: PathOptions) -> Result<()> {
        self.options = options;
        self.paths = super::paths::compute(self, &self.options)?;
        Ok(())
    }

    /// Removes nodes and every link to them, keeping the others' order (NCCL's
    /// `ncclTopoRemoveNode`). Paths must be recomputed afterwards.
    pub(crate) fn remove_nodes(&mut self, remove: &[NodeId]) {
        if remove.is_empty() {
            return;
        }
        let mut map = vec![None; self.nodes.len()];
        let mut next = 0;
        for (i, slot) in map.iter_mut().enumerate() {
            if !remove.contains(&NodeId(i)) {
                *slot = Some(NodeId(next));
                next += 1;
            }
        }
        let old = std::mem::take(&mut self.nodes);
        for (i, mut node) in old.into_iter().enumerate() {
            if map[i].is_none() {
                continue;
            }
            node.links.retain_mut(|l| match map[l.remote.0] {
                Some(n) => {
                    l.remote = n;
                    true
                }
                None => false,
            });
            self.nodes.push(node);
        }
    }

    /// The CPU type of the system, from its first CPU (NCCL's `ncclTopoCpuType`).
    pub fn cpu_type(&self) -> Option<(CpuArch, CpuVendor, CpuModel)> {
        self.nodes
            .iter()
            .find_map(|n| n.cpu())
            .map(|c| (c.arch, c.vendor, c.model))
    }

    /// The CPU closest to a GPU: the one its path reaches in the fewest hops (NCCL's
    /// `ncclGetLocalCpu`).
    pub fn local_cpu(&self, gpu: NodeId) -> Option<NodeId> {
        super::paths::local_cpu(self, &self.paths, gpu)
    }

    /// The GPU that the PXN path from `gpu` to `net` relays through (NCCL's
    /// `ncclTopoGetIntermediateRank`); `None` when that path is not PXN.
    pub fn pxn_peer(&self, gpu: NodeId, net: NodeId) -> Option<NodeId> {
        super::paths::intermediate_gpu(self, self.paths.get(gpu, net)?)
    }

    /// A multi-line description: the nodes as trees from each CPU down the PCI tree with their
    /// links (NCCL's `ncclTopoPrint`), then the path matrix of GPUs and NICs in the style of
    /// `nvidia-smi topo -m` (`NV18`, `PIX`, `SYS`, ...), then the bandwidth matrix in GB/s.
    pub fn describe(&self) -> String {
        super::describe::describe(self)
    }
}

impl fmt::Display for System {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// PCI class of an element, NCCL's `kvDictPciClass` (prefix match, default PCI).
pub fn inter_cpu_bw(cpu: &Cpu) -> f64 {
    match (cpu.arch, cpu.vendor) {
        (CpuArch::Power, _) => P9_BW,
        (CpuArch::Arm, _) => ARM_BW,
        (CpuArch::X86, CpuVendor::Intel) => match cpu.model {
            CpuModel::IntelEmeraldRapids => ERP_QPI_BW,
            CpuModel::IntelSapphireRapids => SRP_QPI_BW,
            CpuModel::IntelSkylake => SKL_QPI_BW,
            _ => BDW_QPI_BW,
        },
        (CpuArch::X86, CpuVendor::Amd) => AMD_BW,
        (CpuArch::X86, CpuVendor::Zhaoxin) => {
            if cpu.model == CpuModel::ZhaoxinYongfeng {
                YONGFENG_ZPI_BW
            } else {
                ZPI_BW
            }
        }
        _ => LOC_BW,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvlink_bandwidth_by_arch() {
        assert_eq!(nvlink_bw(90), 20.6);
        assert_eq!(nvlink_bw(80), 20.0);
        assert_eq!(nvlink_bw(86), 12.0);
        assert_eq!(nvlink_bw(70), 20.0);
        assert_eq!(nvlink_bw(100), 40.1);
        assert_eq!(nvlink_bw(120), 40.1);
    }
}
