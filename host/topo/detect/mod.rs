//! Topology detection: builds, from the real machine, the `<system version="1">` document that
//! NCCL's `ncclTopoGetSystem` builds before `ncclTopoGetSystemFromXml` turns it into a system
//! graph, and the CPU affinity of GPUs for host threads.
//!
//! Mirrors `src/graph/xml.cc` (`ncclTopoFillGpu`, `ncclTopoGetXmlFromSys`, `ncclTopoGetXmlFromCpu`,
//! `ncclTopoGetXmlFromGpu`, `ncclTopoFillNet`) and `src/graph/topo.cc` (`ncclTopoGetSystem`,
//! `ncclTopoGetCpuAffinity`):
//!
//! - **GPUs** through NVML ([`NvmlSource`]; [`NvmlProbe`] loads `libnvidia-ml.so.1` at run time
//!   with `nvml-wrapper`): NVML index (`dev`), compute capability (`sm`), and for each NVLink that
//!   is P2P-capable and up, the PCI bus id of its remote end. Links are counted per remote bus id
//!   into `<nvlink target count tclass>`; the remote's class comes from sysfs, and a remote that
//!   sysfs does not show (an NVSwitch hidden from a VM) is taken for an NVSwitch (`0x068000`),
//!   as NCCL does. Without NVML, a GPU known only from sysfs keeps its `<pci>` element but gets
//!   no `<gpu>` (its `sm` is unknown): a debug message says so.
//! - **PCI tree** from sysfs: the device's directory (`/sys/bus/pci/devices/<busid>`, resolved)
//!   is walked up. As in NCCL, the parent of a device is the directory two levels up (a switch's
//!   upstream port: the downstream port in between is skipped) when both levels are PCI
//!   functions (`BBBB:BB:DD.F`), else the CPU (root complex) of the device's `numa_node`.
//!   `class`, `vendor`, `device`, `subsystem_vendor`, `subsystem_device` are copied; the link
//!   speed is the slower of the device's and its port's `max_link_speed`, the width the smaller
//!   `max_link_width`. Siblings are kept ordered by bus id.
//! - **CPUs**: one `<cpu>` per NUMA node: `host_hash`, `numaid`, `affinity` (the node's
//!   `cpumap`, or its `cpulist` as a mask), `arch`, and on x86 `vendor`, `familyid`, `modelid`
//!   from `/proc/cpuinfo` (NCCL's CPUID encoding of the family).
//! - **NICs**: the network devices of the network in use: the socket interface oxccl's NET
//!   transport picks (`NCCL_SOCKET_IFNAME` rules; `/sys/class/net/<if>`), or with `NCCL_NET=IB`
//!   the active ports of `/sys/class/infiniband/*`. A NIC whose device is not on PCI (virtio,
//!   ...) hangs off the first CPU, as in NCCL.
//!
//! Everything that is missing (VMs lack `numa_node`, `max_link_width`, the NVSwitches, ...)
//! degrades with a `tracing` debug message and never fails detection; the result always builds
//! into a [`System`]. The sysfs and procfs roots are parameters ([`DetectOptions`]) and NVML a
//! trait, so tests run detection on a fake tree with fake NVML data.
//!
//!
//! | file | what | mirrors in NCCL |
//! |---|---|---|
//! | `detect/mod.rs` | options, the PCI tree and CPUs from sysfs, `<gpu>` elements, the dump hook | `ncclTopoGetSystem`, `ncclTopoFillGpu`, `ncclTopoGetXmlFromSys`, `ncclTopoGetXmlFromCpu` |
//! | `detect/nvml.rs` | what NVML says about a GPU: index, `sm`, NVLinks, C2C links | the NVML queries of `ncclTopoGetXmlFromGpu` |
//! | `detect/net.rs` | the NICs of the network in use, GPU Direct RDMA support | `ncclTopoFillNet`, `ncclTopoPopulateNics` |
//! | `detect/affinity.rs` | CPU sets, the CPUs near a GPU, thread binding | `ncclTopoGetCpuAffinity` |
//!
//! ```no_run
//! let sys = oxccl::topo::detect::detect_system()?; // this machine, every GPU NVML lists
//! print!("{}", sys.describe());
//! # Ok::<(), oxccl::Error>(())
//! ```
use super::system::System;
use super::xml::{Xml, XmlNode, bus_id_to_int};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

mod affinity;
mod net;
mod nvml;

pub use affinity::{
    AffinityGuard, CpuSet, bind_helper_thread, bind_near_gpu, bind_thread, gpu_affinity, gpu_local_cpus,
    helper_affinity, pci_local_cpus, thread_affinity,
};
pub use net::{NetDevice, NetSelect};
pub use nvml::{C2cLinks, NvmlGpu, NvmlProbe, NvmlSource};

const T: &str = "oxccl::graph";

/// PCI class NCCL assumes for an NVLink remote that sysfs does not show (an NVSwitch).
const NVSWITCH_CLASS: &str = "0x068000";

// ------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------

/// Where detection reads the machine and what it adds: the roots of sysfs and procfs (a fake
/// tree in tests), the host hash written into each `<cpu>`, and the network devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetectOptions {
    /// The sysfs mount, normally `/sys`.
    pub sys_root: PathBuf,
    /// The procfs mount, normally `/proc` (for `cpuinfo` and `sys/kernel/osrelease`).
    pub proc_root: PathBuf,
    /// `host_hash` of every `<cpu>` (NCCL's `getHostHash`): FNV-1a of the host name, or of
    /// `OXCCL_HOSTID` / `NCCL_HOSTID` when set, as oxccl's peer info computes it.
    pub host_hash: u64,
    /// Network devices to list.
    pub nets: NetSelect,
}

impl Default for DetectOptions {
    /// `/sys`, `/proc`, this host's hash and the socket network.
    fn default() -> Self {
        DetectOptions {
            sys_root: PathBuf::from("/sys"),
            proc_root: PathBuf::from("/proc"),
            host_hash: local_host_hash(),
            nets: NetSelect::Socket,
        }
    }
}

impl DetectOptions {
    /// The defaults, with the network from `NCCL_NET` / `OXCCL_NET`: `IB` (any case) lists
    /// InfiniBand ports, anything else the socket interface.
    pub fn from_env() -> DetectOptions {
        let nets = match crate::params::env_var("NET") {
            Some((_, v)) if v.trim().eq_ignore_ascii_case("ib") => NetSelect::Ib,
            _ => NetSelect::Socket,
        };
        DetectOptions {
            nets,
            ..DetectOptions::default()
        }
    }

    /// Options reading the fake sysfs `sys_root` and procfs `proc_root`, with host hash 0 and no
    /// network device (tests set `nets` as they need).
    pub fn rooted(sys_root: impl Into<PathBuf>, proc_root: impl Into<PathBuf>) -> DetectOptions {
        DetectOptions {
            sys_root: sys_root.into(),
            proc_root: proc_root.into(),
            host_hash: 0,
            nets: NetSelect::None,
        }
    }
}

/// This host's hash: FNV-1a (64 bits) of `/proc/sys/kernel/hostname` (trimmed), or of
/// `OXCCL_HOSTID` / `NCCL_HOSTID` when set — the value oxccl's peer info exchanges.
pub fn local_host_hash() -> u64 {
    crate::hash::fnv1a_64(local_host_name().as_bytes())
}

/// This host's name as peers compare it: `/proc/sys/kernel/hostname` (trimmed), or
/// `OXCCL_HOSTID` / `NCCL_HOSTID` when set.
pub(crate) fn local_host_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    crate::params::env_var("HOSTID").map_or(host.trim().to_string(), |(_, v)| v)
}

// ------------------------------------------------------------------------------------------
// Detection
// ------------------------------------------------------------------------------------------

/// One GPU of a communicator to put into the topology (NCCL fills `rank`, `dev` and `gdr` from
/// its peer info).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankGpu {
    /// Rank of the communicator on this GPU.
    pub rank: i32,
    /// CUDA ordinal, used as `dev` when NVML does not give the index.
    pub dev: i32,
    /// PCI bus id, e.g. `0000:18:00.0` (any case, 4- or 8-digit domain).
    pub bus_id: String,
    /// Compute capability × 10 from CUDA, used when NVML does not give it.
    pub sm: Option<u32>,
}

/// Detects this machine with the environment's options ([`DetectOptions::from_env`]) and NVML
/// when it loads: every GPU NVML lists (ranks 0.. in NVML order) when `gpus` is `None`, else
/// the communicator's GPUs. Never fails; see [`detect`].
pub fn detect_local(gpus: Option<&[RankGpu]>) -> Xml {
    let opts = DetectOptions::from_env();
    let nvml = NvmlProbe::shared().map(|n| n as &dyn NvmlSource);
    detect(&opts, nvml, gpus)
}

/// The system graph of this machine ([`detect_local`] of every GPU, then
/// [`System::from_xml`]). Errors: those of `System::from_xml` (bad path environment variables),
/// never a missing sysfs entry.
pub fn detect_system() -> Result<System> {
    System::from_xml(detect_local(None))
}

/// Builds the topology XML of the machine `opts` describes (NCCL's `ncclTopoGetSystem` up to
/// the dump): the PCI tree, CPUs and `<gpu>` elements of `gpus` (or, when `None`, of every GPU
/// `nvml` lists, ranks 0.. in NVML order; without NVML, the NVIDIA display/3D controllers of
/// sysfs, without `<gpu>` since their `sm` is unknown), then the network devices of
/// `opts.nets`. Missing information degrades with debug messages; this never fails.
pub fn detect(opts: &DetectOptions, nvml: Option<&dyn NvmlSource>, gpus: Option<&[RankGpu]>) -> Xml {
    let mut xml = Xml::new_system();
    xml.source = "<detected>".to_string();
    detect_into(&mut xml, opts, nvml, gpus);
    xml
}

/// As [`detect`], merging into an existing document (a partial `NCCL_TOPO_FILE`): elements
/// it already has keep their attributes, and only what they lack is filled in (NCCL's
/// `xmlInitAttr*` rule).
pub fn detect_into(
    xml: &mut Xml,
    opts: &DetectOptions,
    nvml: Option<&dyn NvmlSource>,
    gpus: Option<&[RankGpu]>,
) {
    let d = Detector { opts };
    let list: Vec<RankGpu> = match gpus {
        Some(g) => g.to_vec(),
        None => match nvml {
            Some(n) => n
                .devices()
                .into_iter()
                .enumerate()
                .map(|(r, (index, bus_id))| RankGpu {
                    rank: r as i32,
                    dev: index as i32,
                    bus_id,
                    sm: None,
                })
                .collect(),
            None => d.sysfs_gpus(),
        },
    };
    if list.is_empty() {
        tracing::debug!(target: T, "topology detection: no GPU found");
    }
    for g in &list {
        d.fill_gpu(xml, g, nvml);
    }
    let nets = d.net_devices();
    for (n, net) in nets.iter().enumerate() {
        d.fill_net(xml, n, net);
    }
    tracing::debug!(target: T, gpus = list.len(), nets = nets.len(), elements = xml.root.count(), "topology detected");
}

struct Detector<'a> {
    opts: &'a DetectOptions,
}

/// Whether `s` is a PCI function address `BBBB:BB:DD.F` (NCCL's `checkBDFFormat`).
fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && [0, 1, 2, 3, 5, 6, 8, 9, 11]
            .iter()
            .all(|&i| b[i].is_ascii_hexdigit())
}

/// A bus id in NCCL's form (`int64ToBusId`): lowercase, `%04x:%02x:%02x.%x`. `None` when `s`
/// is not `domain:bus:device.function` in hex.
pub fn normalize_bus_id(s: &str) -> Option<String> {
    let s = s.trim();
    let (rest, func) = s.rsplit_once('.')?;
    let mut parts = rest.split(':');
    let (dom, bus, dev) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let dom = u64::from_str_radix(dom, 16).ok()?;
    let bus = u32::from_str_radix(bus, 16).ok()?;
    let dev = u32::from_str_radix(dev, 16).ok()?;
    let func = u32::from_str_radix(func, 16).ok()?;
    Some(format!("{dom:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The leading float of `s` as C's `sscanf("%f GT/s")` reads it; `None` when there is none.
fn leading_f32(s: &str) -> Option<f32> {
    let t = s.trim_start();
    let end = t
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_digit() || *c == '.'))
        .map_or(t.len(), |(i, _)| i);
    t[..end].parse().ok()
}

/// C's `strtol(s, NULL, 0)` on what sysfs holds: 0 when there is no number.
fn strtol(s: &str) -> i64 {
    super::system::parse_int(s).unwrap_or_else(|| {
        let t = s.trim();
        let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        t[..end].parse().unwrap_or(0)
    })
}

/// Path of child indices from `node` to the first element (depth first) for which `pred`
/// holds.
fn find_path(node: &XmlNode, pred: &dyn Fn(&XmlNode) -> bool) -> Option<Vec<usize>> {
    if pred(node) {
        return Some(Vec::new());
    }
    for (i, s) in node.subs.iter().enumerate() {
        if let Some(mut p) = find_path(s, pred) {
            p.insert(0, i);
            return Some(p);
        }
    }
    None
}

fn at_mut<'x>(mut node: &'x mut XmlNode, path: &[usize]) -> &'x mut XmlNode {
    for &i in path {
        node = &mut node.subs[i];
    }
    node
}

fn at<'x>(mut node: &'x XmlNode, path: &[usize]) -> &'x XmlNode {
    for &i in path {
        node = &node.subs[i];
    }
    node
}

fn pci_pred(bus: i64) -> impl Fn(&XmlNode) -> bool {
    move |n: &XmlNode| n.name == "pci" && n.attr("busid").and_then(bus_id_to_int) == Some(bus)
}

/// Inserts `node` among `parent`'s children before the first one whose bus id sorts after its
/// own (NCCL keeps PCI siblings ordered by bus id); returns its index.
fn insert_sorted(parent: &mut XmlNode, node: XmlNode) -> usize {
    let key = node.attr("busid").unwrap_or("").to_string();
    let at = parent
        .subs
        .iter()
        .position(|s| s.attr("busid").is_some_and(|b| key.as_str() < b))
        .unwrap_or(parent.subs.len());
    parent.subs.insert(at, node);
    at
}

impl Detector<'_> {
    fn sys(&self, rel: &str) -> PathBuf {
        self.opts.sys_root.join(rel)
    }

    /// A sysfs attribute, trailing newline removed (NCCL's `ncclTopoGetStrFromSys`); `None`,
    /// with a debug message, when it cannot be read or is empty.
    fn read(&self, dir: &Path, file: &str) -> Option<String> {
        let p = dir.join(file);
        match std::fs::read_to_string(&p) {
            Ok(s) if !s.trim_end_matches('\n').is_empty() => Some(s.trim_end_matches('\n').to_string()),
            _ => {
                tracing::debug!(target: T, "topology detection: could not read {}, ignoring", p.display());
                None
            }
        }
    }

    /// The resolved sysfs directory of PCI function `bus_id` (NCCL's `getPciPath`).
    fn pci_path(&self, bus_id: &str) -> Option<PathBuf> {
        let b = normalize_bus_id(bus_id)?;
        let direct = self.sys("bus/pci/devices").join(&b);
        let via_bus = self
            .sys("class/pci_bus")
            .join(&b[..b.len() - 5])
            .join("../..")
            .join(&b);
        for p in [direct, via_bus] {
            if let Ok(r) = std::fs::canonicalize(&p) {
                return Some(r);
            }
        }
        tracing::debug!(target: T, bus_id, "topology detection: no sysfs directory for this PCI device");
        None
    }

    /// NVIDIA display and 3D controllers (vendor 0x10de, class 0x03....) of sysfs, in bus-id
    /// order, ranks 0..: the GPUs when NVML is not available.
    fn sysfs_gpus(&self) -> Vec<RankGpu> {
        let dir = self.sys("bus/pci/devices");
        let mut ids: Vec<String> = match std::fs::read_dir(&dir) {
            Ok(rd) => rd
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| is_bdf(n))
                .collect(),
            Err(e) => {
                tracing::debug!(target: T, "topology detection: cannot list {} ({e})", dir.display());
                return Vec::new();
            }
        };
        ids.sort();
        ids.into_iter()
            .filter(|b| {
                let d = dir.join(b);
                std::fs::read_to_string(d.join("vendor")).is_ok_and(|v| v.trim() == "0x10de")
                    && std::fs::read_to_string(d.join("class")).is_ok_and(|c| c.trim().starts_with("0x03"))
            })
            .enumerate()
            .map(|(r, bus_id)| RankGpu {
                rank: r as i32,
                dev: r as i32,
                bus_id,
                sm: None,
            })
            .collect()
    }

    /// NCCL's `ncclTopoFillGpu`: the GPU's `<pci>` (with its tree up to the CPU), then its
    /// `<gpu>` element.
    fn fill_gpu(&self, xml: &mut Xml, g: &RankGpu, nvml: Option<&dyn NvmlSource>) {
        let Some(bus_id) = normalize_bus_id(&g.bus_id) else {
            tracing::debug!(target: T, bus_id = %g.bus_id, "topology detection: not a PCI bus id, GPU skipped");
            return;
        };
        let path = self.ensure_pci(xml, &bus_id, Some("0x03"));
        let info = nvml.and_then(|n| n.probe(&bus_id));
        if nvml.is_some() && info.is_none() {
            tracing::debug!(target: T, bus_id, "topology detection: NVML does not know this GPU");
        }
        let pci = at_mut(&mut xml.root, &path);
        let gi = match pci.subs.iter().position(|s| s.name == "gpu") {
            Some(i) => i,
            None => {
                let has_sm = info.as_ref().and_then(|i| i.sm).or(g.sm).is_some();
                if !has_sm {
                    tracing::debug!(target: T, bus_id, "topology detection: compute capability unknown (no NVML): no <gpu> element for this GPU");
                    return;
                }
                pci.subs.push(XmlNode::new("gpu"));
                pci.subs.len() - 1
            }
        };
        let gpu = &mut pci.subs[gi];
        gpu.init_attr("dev", info.as_ref().map_or(g.dev, |i| i.index as i32));
        let sm = info.as_ref().and_then(|i| i.sm).or(g.sm);
        if let Some(sm) = sm {
            gpu.init_attr("sm", sm);
        }
        gpu.set_attr("rank", g.rank);
        gpu.init_attr("gdr", u8::from(self.gdr_support()));
        if gpu.sub("nvlink").is_none() {
            if let Some(info) = &info {
                let mut counts: Vec<(String, u32)> = Vec::new();
                for t in &info.nvlinks {
                    let t = t.to_lowercase();
                    match counts.iter_mut().find(|(x, _)| *x == t) {
                        Some((_, c)) => *c += 1,
                        None => counts.push((t, 1)),
                    }
                }
                for (target, count) in counts {
                    let mut l = XmlNode::new("nvlink");
                    l.set_attr("target", &target);
                    l.set_attr("count", count);
                    gpu.subs.push(l);
                }
            } else if sm.is_some_and(|s| s >= 60) {
                tracing::debug!(target: T, bus_id, "topology detection: no NVML device handle, NVLink detection skipped");
            }
        }
        if gpu.sub("c2c").is_none()
            && let Some(c) = info.as_ref().and_then(|i| i.c2c)
        {
            let mut n = XmlNode::new("c2c");
            n.set_attr("bw", c.bw_mbps);
            n.set_attr("count", c.count);
            gpu.subs.push(n);
        }
        // Target classes: from sysfs, else an NVSwitch hidden from this (virtual) machine.
        for l in gpu.subs.iter_mut().filter(|s| s.name == "nvlink") {
            if l.attr("tclass").is_some() {
                continue;
            }
            let target = l.attr("target").unwrap_or("").to_string();
            let class = self
                .pci_path(&target)
                .and_then(|p| self.read(&p, "class"))
                .unwrap_or_else(|| {
                    tracing::debug!(target: T, bus_id, nvlink_target = %target, "NVLink remote not visible in sysfs: assumed to be an NVSwitch");
                    NVSWITCH_CLASS.to_string()
                });
            l.set_attr("tclass", class);
        }
    }

    /// Finds or creates the `<pci busid>` element with its ancestors up to a `<cpu>`, filling
    /// each from sysfs (NCCL's `ncclTopoGetPciNode` + `ncclTopoGetXmlFromSys`); `class` is the
    /// class to assume when sysfs does not give one. Returns the element's path in the tree.
    fn ensure_pci(&self, xml: &mut Xml, bus_id: &str, class: Option<&str>) -> Vec<usize> {
        let sys_path = self.pci_path(bus_id);
        let num = bus_id_to_int(bus_id).unwrap_or(-1);
        if let Some(path) = find_path(&xml.root, &pci_pred(num)) {
            // Known (from a topology file): fill what it lacks, here and up the tree.
            for depth in (1..=path.len()).rev() {
                let p = &path[..depth];
                let n = at(&xml.root, p);
                if n.name == "pci" {
                    let b = n.attr("busid").unwrap_or("").to_string();
                    let sp = self.pci_path(&b);
                    self.fill_pci_attrs(at_mut(&mut xml.root, p), sp.as_deref(), None);
                } else if n.name == "cpu" {
                    self.fill_cpu(at_mut(&mut xml.root, p));
                }
            }
            return path;
        }
        let mut node = XmlNode::new("pci");
        node.set_attr("busid", bus_id);
        if let Some(c) = class {
            node.set_attr("class", c);
        }
        self.fill_pci_attrs(&mut node, sys_path.as_deref(), class);
        let parent = match &sys_path {
            None => self.ensure_cpu(xml, "-1"),
            Some(p) => {
                let p1 = p.parent();
                let p2 = p1.and_then(Path::parent);
                let name = |x: Option<&Path>| {
                    x.and_then(Path::file_name)
                        .and_then(|n| n.to_str())
                        .unwrap_or("")
                        .to_string()
                };
                let (n1, n2) = (name(p1), name(p2));
                if is_bdf(&n1) && is_bdf(&n2) {
                    // Continue on the upper PCI switch (its upstream port).
                    self.ensure_pci(xml, &n2, Some("0x060400"))
                } else {
                    let numa = self
                        .read(p, "numa_node")
                        .filter(|s| s.trim().parse::<i64>().is_ok())
                        .map_or_else(|| "-1".to_string(), |s| s.trim().to_string());
                    self.ensure_cpu(xml, &numa)
                }
            }
        };
        let parent_node = at_mut(&mut xml.root, &parent);
        let i = insert_sorted(parent_node, node);
        let mut path = parent;
        path.push(i);
        path
    }

    /// Fills a `<pci>` element's attributes from its sysfs directory `dir` where it lacks them
    /// (the class is always refreshed from sysfs, as NCCL does): class, ids, link speed and
    /// width. Without a directory, link speed `""` and width `0` (read as Gen3 x16).
    fn fill_pci_attrs(&self, node: &mut XmlNode, dir: Option<&Path>, default_class: Option<&str>) {
        match dir.and_then(|d| self.read(d, "class")) {
            Some(c) => node.set_attr("class", c),
            None => {
                if node.attr("class").is_none() {
                    let c = default_class.unwrap_or("0x060400");
                    tracing::debug!(target: T, busid = node.attr("busid").unwrap_or(""), class = c, "PCI class unknown, assumed");
                    node.set_attr("class", c);
                }
            }
        }
        if let Some(d) = dir {
            for key in ["vendor", "device", "subsystem_vendor", "subsystem_device"] {
                if node.attr(key).is_none()
                    && let Some(v) = self.read(d, key)
                {
                    node.set_attr(key, v);
                }
            }
        }
        if node.attr("link_speed").is_none() {
            let speed = match dir {
                Some(d) => {
                    let dev = self.read(d, "max_link_speed").unwrap_or_default();
                    let port = d
                        .parent()
                        .and_then(|p| self.read(p, "max_link_speed"))
                        .unwrap_or_default();
                    let ds = leading_f32(&dev).unwrap_or(f32::MAX);
                    let ps = leading_f32(&port).unwrap_or(f32::MAX);
                    if ps < ds { port } else { dev }
                }
                None => String::new(),
            };
            node.set_attr("link_speed", speed);
        }
        if node.attr("link_width").is_none() {
            let width = match dir {
                Some(d) => {
                    let dev = strtol(&self.read(d, "max_link_width").unwrap_or_default());
                    let port = strtol(
                        &d.parent()
                            .and_then(|p| self.read(p, "max_link_width"))
                            .unwrap_or_default(),
                    );
                    dev.min(port)
                }
                None => 0,
            };
            node.set_attr("link_width", width);
        }
    }

    /// Finds or creates `<cpu numaid>` under `<system>` (NCCL's root-complex case of
    /// `ncclTopoGetXmlFromSys`) and fills it; returns its path.
    fn ensure_cpu(&self, xml: &mut Xml, numa: &str) -> Vec<usize> {
        let idx = match xml
            .root
            .subs
            .iter()
            .position(|s| s.name == "cpu" && s.attr("numaid") == Some(numa))
        {
            Some(i) => i,
            None => {
                let mut cpu = XmlNode::new("cpu");
                cpu.set_attr("host_hash", format_args!("{:#x}", self.opts.host_hash));
                cpu.set_attr("numaid", numa);
                xml.root.subs.push(cpu);
                xml.root.subs.len() - 1
            }
        };
        self.fill_cpu(&mut xml.root.subs[idx]);
        vec![idx]
    }

    /// NCCL's `ncclTopoGetXmlFromCpu`: `affinity` (the NUMA node's `cpumap`, or its `cpulist`
    /// as a mask), `arch`, and on x86 `vendor`, `familyid`, `modelid`, where missing.
    fn fill_cpu(&self, cpu: &mut XmlNode) {
        if cpu.attr("affinity").is_none()
            && let Some(numa) = cpu.attr("numaid").map(str::to_string)
        {
            let dir = self.sys(&format!("devices/system/node/node{numa}"));
            let mask = if dir.is_dir() {
                std::fs::read_to_string(dir.join("cpumap"))
                    .ok()
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .or_else(|| {
                        let list = std::fs::read_to_string(dir.join("cpulist")).ok()?;
                        CpuSet::parse_list(&list).ok().map(|s| s.to_mask())
                    })
            } else {
                None
            };
            match mask {
                Some(m) => cpu.set_attr("affinity", m),
                None => {
                    tracing::debug!(target: T, numa, "topology detection: CPU affinity of NUMA node unknown")
                }
            }
        }
        if cpu.attr("arch").is_none() {
            let arch = match std::env::consts::ARCH {
                "x86_64" => Some("x86_64"),
                "aarch64" => Some("arm64"),
                "powerpc64" => Some("ppc64"),
                _ => None,
            };
            if let Some(a) = arch {
                cpu.set_attr("arch", a);
            }
        }
        if cpu.attr("arch") == Some("x86_64")
            && (cpu.attr("vendor").is_none() || cpu.attr("familyid").is_none())
        {
            let info = self.cpu_info();
            if cpu.attr("vendor").is_none() {
                // Vendor unknown: "" reads as a vendor without model-specific rules.
                cpu.set_attr("vendor", info.as_ref().map_or("", |i| i.0.as_str()));
            }
            if cpu.attr("familyid").is_none()
                && let Some((_, family, model)) = info
            {
                cpu.set_attr("familyid", family);
                cpu.set_attr("modelid", model);
            }
        }
    }

    /// Vendor, family and model of the first processor in `/proc/cpuinfo`, the family in
    /// NCCL's CPUID encoding (base family + extended family << 4, so AMD family 0x19 reads
    /// 0xf + 0xa0 = 175).
    fn cpu_info(&self) -> Option<(String, u32, u32)> {
        let p = self.opts.proc_root.join("cpuinfo");
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(target: T, "topology detection: cannot read {} ({e}): CPU vendor and model unknown", p.display());
                return None;
            }
        };
        let field = |key: &str| {
            text.lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let vendor = field("vendor_id")?;
        let family: u32 = field("cpu family")?.parse().ok()?;
        let model: u32 = field("model")?.parse().ok()?;
        let family = if family >= 0xf {
            0xf + ((family - 0xf) << 4)
        } else {
            family
        };
        Some((vendor, family, model))
    }
}

// ------------------------------------------------------------------------------------------
// Communicator hook: NCCL_TOPO_DUMP_FILE and the init thread's affinity
// ------------------------------------------------------------------------------------------

/// What communicator creation calls first for CUDA devices (NCCL's `ncclTopoGetSystem` dump
/// and the affinity step of `initTransportsRank`):
///
/// - when `NCCL_TOPO_DUMP_FILE` (or `OXCCL_TOPO_DUMP_FILE`) is set and `gpus` holds the rank
///   `NCCL_TOPO_DUMP_FILE_RANK` (default 0), writes the topology detected for `gpus` there;
/// - binds the calling thread near the GPUs' CPUs (when they share one CPU set, see
///   [`AffinityGuard::near_gpus`]) until the returned guard drops, so that helper threads
///   started meanwhile (bootstrap, proxy) run near the GPU, and [`helper_affinity`] tells
///   them the set.
///
/// Errors: `System` when the dump file cannot be written; `InvalidArgument` for a
/// `NCCL_TOPO_DUMP_FILE_RANK` that is not an integer. Detection itself never fails.
pub fn comm_init_hook(gpus: &[RankGpu]) -> Result<AffinityGuard> {
    if crate::params::env_var("TOPO_DUMP_FILE").is_some() {
        let want = match crate::params::env_var("TOPO_DUMP_FILE_RANK") {
            None => 0,
            Some((k, v)) => v.trim().parse::<i32>().map_err(|_| {
                Error::invalid(format!("{k}={v:?} is not a rank (accepted: an integer >= 0)"))
            })?,
        };
        if gpus.iter().any(|g| g.rank == want) {
            let xml = detect_local(Some(gpus));
            xml.dump_to_env_file()?;
        }
    }
    let buses: Vec<&str> = gpus.iter().map(|g| g.bus_id.as_str()).collect();
    Ok(AffinityGuard::near_gpus(&buses))
}

/// [`comm_init_hook`] for the CUDA contexts of ranks `first_rank`, `first_rank + 1`, ... (what
/// `Comm::init_all` and `Comm::init_rank` call first on CUDA devices); does nothing for an
/// empty slice. Errors: those of [`comm_init_hook`], and `Cuda` when a bus id cannot be read.
pub fn on_cuda_init(
    first_rank: usize,
    ctxs: &[std::sync::Arc<crate::cuda::Context>],
) -> Result<AffinityGuard> {
    if ctxs.is_empty() {
        return Ok(AffinityGuard::bind(None));
    }
    let gpus = ctxs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            Ok(RankGpu {
                rank: (first_rank + i) as i32,
                dev: c.ordinal as i32,
                bus_id: c.bus_id()?,
                sm: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    comm_init_hook(&gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_and_bus_ids() {
        assert!(is_bdf("0000:00:06.0"));
        assert!(!is_bdf("pci0000:00"));
        assert!(!is_bdf("0000:00:06"));
        assert_eq!(
            normalize_bus_id("00000000:1A:00.0").as_deref(),
            Some("0000:1a:00.0")
        );
        assert_eq!(normalize_bus_id("0001:02:03.1").as_deref(), Some("0001:02:03.1"));
        assert_eq!(
            normalize_bus_id("fffffff:ff:ff.0").as_deref(),
            Some("fffffff:ff:ff.0")
        );
        assert_eq!(normalize_bus_id("eth0"), None);
    }

    #[test]
    fn c_style_numbers() {
        assert_eq!(leading_f32("32.0 GT/s PCIe"), Some(32.0));
        assert_eq!(leading_f32("8 GT/s"), Some(8.0));
        assert_eq!(leading_f32("Unknown"), None);
        assert_eq!(strtol("16"), 16);
        assert_eq!(strtol("16\n"), 16);
        assert_eq!(strtol(""), 0);
    }

    #[test]
    fn sorted_insertion() {
        let mut p = XmlNode::new("cpu");
        for b in ["0000:07:00.0", "0000:05:00.0"] {
            let mut n = XmlNode::new("pci");
            n.set_attr("busid", b);
            insert_sorted(&mut p, n);
        }
        p.subs.push(XmlNode::new("nic"));
        let mut n = XmlNode::new("pci");
        n.set_attr("busid", "0000:09:00.0");
        // After the NIC (which has no bus id), as NCCL's loop does.
        assert_eq!(insert_sorted(&mut p, n), 3);
        let order: Vec<&str> = p.subs.iter().map(|s| s.attr("busid").unwrap_or("nic")).collect();
        assert_eq!(order, ["0000:05:00.0", "0000:07:00.0", "nic", "0000:09:00.0"]);
    }
}
