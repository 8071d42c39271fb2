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
//! ```no_run
//! let sys = oxccl::topo::detect::detect_system()?; // this machine, every GPU NVML lists
//! print!("{}", sys.describe());
//! # Ok::<(), oxccl::Error>(())
//! ```
use super::system::System;
use super::xml::{Xml, XmlNode, bus_id_to_int};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const T: &str = "oxccl::graph";

/// PCI class NCCL assumes for an NVLink remote that sysfs does not show (an NVSwitch).
const NVSWITCH_CLASS: &str = "0x068000";
/// `maxconn` of a socket network device (NCCL's `ncclNetSocket` `maxComms`).
const SOCKET_MAXCONN: u32 = 65536;
/// `maxconn` assumed for an InfiniBand device (a ConnectX `max_qp`; sysfs does not give it).
const IB_MAXCONN: u32 = 131072;
/// Speed NCCL's socket network assumes when the interface's speed is unknown, Mb/s.
const SOCKET_DEFAULT_SPEED: i64 = 10000;

// ------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------

/// Which network's devices detection lists as `<net>` elements (NCCL lists the devices of the
/// network plugin in use).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetSelect {
    /// The socket interface oxccl's NET transport uses: `NCCL_SOCKET_IFNAME` rules, else NCCL's
    /// default order (`ib*`, then anything but `docker*`/`lo`, ...), one interface.
    Socket,
    /// The socket interfaces named here, in this order (devices 0, 1, ...).
    SocketNamed(Vec<String>),
    /// The active ports of `/sys/class/infiniband/*` (what NCCL's IB plugin lists).
    Ib,
    /// No network device.
    None,
}

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
// NVML
// ------------------------------------------------------------------------------------------

/// What NVML says about one GPU: what `ncclTopoGetXmlFromGpu` asks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML device index (`nvmlDeviceGetIndex`; NCCL's `dev`).
    pub index: u32,
    /// The GPU's PCI bus id as NVML gives it (`0000:07:00.0`, any case).
    pub bus_id: String,
    /// Compute capability × 10 (`nvmlDeviceGetCudaComputeCapability`), when known.
    pub sm: Option<u32>,
    /// For every NVLink that supports P2P and is up, the PCI bus id of its remote end
    /// (`nvmlDeviceGetNvLinkRemotePciInfo`), one entry per link.
    pub nvlinks: Vec<String>,
    /// Chip-to-chip links to the CPU (Grace Hopper), when NVML reports any that are up.
    pub c2c: Option<C2cLinks>,
}

/// C2C links of a GPU to its CPU (`<c2c bw count>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct C2cLinks {
    /// Links that are up.
    pub count: u32,
    /// Bandwidth of one link in MB/s (`NVML_FI_DEV_C2C_LINK_GET_MAX_BW`).
    pub bw_mbps: u32,
}

/// A source of NVML data: [`NvmlProbe`] on a real machine, a list of [`NvmlGpu`] in tests.
pub trait NvmlSource {
    /// Every GPU NVML knows, by NVML index: `(index, bus id)`.
    fn devices(&self) -> Vec<(u32, String)>;
    /// What NVML says about the GPU at `bus_id` (compared as a number); `None` when NVML does
    /// not know it.
    fn probe(&self, bus_id: &str) -> Option<NvmlGpu>;
}

impl NvmlSource for [NvmlGpu] {
    fn devices(&self) -> Vec<(u32, String)> {
        self.iter().map(|g| (g.index, g.bus_id.clone())).collect()
    }

    fn probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        let want = bus_id_to_int(bus_id)?;
        self.iter()
            .find(|g| bus_id_to_int(&g.bus_id) == Some(want))
            .cloned()
    }
}

impl NvmlSource for Vec<NvmlGpu> {
    fn devices(&self) -> Vec<(u32, String)> {
        self.as_slice().devices()
    }

    fn probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        self.as_slice().probe(bus_id)
    }
}

/// NVML loaded at run time (`libnvidia-ml.so.1` through `nvml-wrapper`).
///
/// Answers are remembered for the life of the probe: a GPU's NVLinks, C2C links and compute
/// capability do not change while a process runs, and querying them (one NVML call per link and
/// field, 18 links per H200) cost tens of milliseconds at every communicator init, which
/// detects the topology up to three times (affinity, `NCCL_P2P_LEVEL` paths, ring search).
pub struct NvmlProbe {
    nvml: nvml_wrapper::Nvml,
    /// [`NvmlSource::devices`], once asked.
    devices: OnceLock<Vec<(u32, String)>>,
    /// [`NvmlSource::probe`] answers by bus id (as a number).
    probes: std::sync::Mutex<std::collections::HashMap<i64, Option<NvmlGpu>>>,
}

impl fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NvmlProbe")
    }
}

impl NvmlProbe {
    /// Loads and initialises NVML (`nvmlInit_v2`); `None`, with a debug message, when the
    /// library is missing or the driver does not answer.
    pub fn load() -> Option<NvmlProbe> {
        match nvml_wrapper::Nvml::init() {
            Ok(nvml) => Some(NvmlProbe {
                nvml,
                devices: OnceLock::new(),
                probes: std::sync::Mutex::new(std::collections::HashMap::new()),
            }),
            Err(e) => {
                tracing::debug!(target: T, "NVML not available ({e}): topology detection continues without NVLink information");
                None
            }
        }
    }

    /// The process-wide NVML, loaded on first use (`None` when it cannot be loaded).
    pub fn shared() -> Option<&'static NvmlProbe> {
        static NVML: OnceLock<Option<NvmlProbe>> = OnceLock::new();
        NVML.get_or_init(NvmlProbe::load).as_ref()
    }

    /// A device field value of scope `scope` (`nvmlDeviceGetFieldValues` with a scope id, which
    /// `nvml-wrapper` does not expose), as an unsigned integer.
    fn field_u32(&self, dev: &nvml_wrapper::Device<'_>, field: u32, scope: u32) -> Option<u32> {
        use nvml_wrapper_sys::bindings::{nvmlFieldValue_t, nvmlReturn_enum_NVML_SUCCESS};
        let get = self.nvml.lib().nvmlDeviceGetFieldValues.as_ref().ok()?;
        // SAFETY: nvmlFieldValue_t is a plain C struct (integers and a union of numbers): all
        // zeroes is a valid value.
        let mut v: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
        v.fieldId = field;
        v.scopeId = scope;
        // SAFETY: `dev` is a live handle of this NVML instance and `v` one writable value.
        let r = unsafe { get(dev.handle(), 1, &mut v) };
        if r != nvmlReturn_enum_NVML_SUCCESS || v.nvmlReturn != nvmlReturn_enum_NVML_SUCCESS {
            return None;
        }
        // SAFETY: the field ids read here (NVLink state, C2C count/status/bandwidth) are
        // unsigned-int values.
        Some(unsafe { v.value.uiVal })
    }
}

impl NvmlSource for NvmlProbe {
    fn devices(&self) -> Vec<(u32, String)> {
        self.devices.get_or_init(|| self.query_devices()).clone()
    }

    fn probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        let Some(key) = bus_id_to_int(bus_id) else {
            return self.query_probe(bus_id);
        };
        // A poisoned lock only means another thread panicked mid-insert of a complete value.
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        probes
            .entry(key)
            .or_insert_with(|| self.query_probe(bus_id))
            .clone()
    }
}

impl NvmlProbe {
    /// Every GPU NVML knows (uncached [`NvmlSource::devices`]).
    fn query_devices(&self) -> Vec<(u32, String)> {
        let n = match self.nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(target: T, "NVML: cannot count devices: {e}");
                return Vec::new();
            }
        };
        (0..n)
            .filter_map(|i| {
                let d = self.nvml.device_by_index(i).ok()?;
                Some((i, d.pci_info().ok()?.bus_id))
            })
            .collect()
    }

    /// What NVML says about the GPU at `bus_id` (uncached [`NvmlSource::probe`]).
    fn query_probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        use nvml_wrapper::enum_wrappers::nv_link::Capability;
        use nvml_wrapper::sys_exports::field_id::{
            NVML_FI_DEV_C2C_LINK_COUNT, NVML_FI_DEV_C2C_LINK_GET_MAX_BW, NVML_FI_DEV_C2C_LINK_GET_STATUS,
            NVML_FI_DEV_NVLINK_GET_STATE,
        };
        let dev = match self.nvml.device_by_pci_bus_id(bus_id) {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(target: T, bus_id, "NVML: no device at this bus id ({e})");
                return None;
            }
        };
        let index = dev.index().ok()?;
        let sm = dev
            .cuda_compute_capability()
            .ok()
            .map(|c| (c.major * 10 + c.minor) as u32);
        let mut nvlinks = Vec::new();
        let max_links = sm.map_or(0, max_nvlinks);
        for l in 0..max_links {
            let link = dev.link_wrapper_for(l);
            if !link.has_capability(Capability::P2p).unwrap_or(false) {
                continue;
            }
            // Hopper and later: the link state through a field value, as NCCL does.
            let up = match sm {
                Some(s) if s >= 90 => self
                    .field_u32(&dev, NVML_FI_DEV_NVLINK_GET_STATE, l)
                    .map(|v| v == 1)
                    .or_else(|| link.is_active().ok()),
                _ => link.is_active().ok(),
            };
            if up != Some(true) {
                continue;
            }
            match link.remote_pci_info() {
                Ok(p) => nvlinks.push(p.bus_id.to_lowercase()),
                Err(e) => tracing::debug!(target: T, bus_id, link = l, "NVML: NVLink remote unknown ({e})"),
            }
        }
        let mut c2c = None;
        if sm.is_some_and(|s| s >= 90)
            && let Some(n) = self.field_u32(&dev, NVML_FI_DEV_C2C_LINK_COUNT, 0)
        {
            let (mut count, mut bw) = (0, 0);
            for l in 0..n {
                if self.field_u32(&dev, NVML_FI_DEV_C2C_LINK_GET_STATUS, l) == Some(1)
                    && let Some(b) = self.field_u32(&dev, NVML_FI_DEV_C2C_LINK_GET_MAX_BW, l)
                {
                    bw = b;
                    count += 1;
                }
            }
            if count > 0 {
                c2c = Some(C2cLinks { count, bw_mbps: bw });
            }
        }
        let bus = dev
            .pci_info()
            .map(|p| p.bus_id)
            .unwrap_or_else(|_| bus_id.to_string());
        Some(NvmlGpu {
            index,
            bus_id: bus,
            sm,
            nvlinks,
            c2c,
        })
    }
}

/// NVLinks NCCL probes for a GPU of compute capability `sm` (× 10).
fn max_nvlinks(sm: u32) -> u32 {
    match sm {
        ..60 => 0,
        60..70 => 4,
        70..80 => 6,
        80..90 => 12,
        _ => 18,
    }
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

/// A network device to list (what a network plugin's `getProperties` returns).
#[derive(Clone, Debug, PartialEq)]
pub struct NetDevice {
    /// Device name, e.g. `eth0` or `mlx5_0`.
    pub name: String,
    /// Its sysfs device directory (resolved), when it has one; `None` for a virtual device.
    pub device_path: Option<PathBuf>,
    /// Port speed in Mb/s.
    pub speed_mbps: i64,
    /// Port number.
    pub port: u32,
    /// ASIC id (ports of one NIC share it).
    pub guid: u64,
    /// Maximum connections.
    pub maxconn: u32,
    /// Latency in µs.
    pub latency: i64,
    /// GPU Direct RDMA support.
    pub gdr: bool,
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

    /// Whether GPU Direct RDMA can work here: a peer-memory kernel module is loaded
    /// (`nvidia_peermem` / `nv_peer_mem`, what NCCL's IB plugin checks) or the kernel has
    /// DMA-BUF (5.12 and later, `sys/kernel/osrelease`).
    fn gdr_support(&self) -> bool {
        let peermem = [
            "kernel/mm/memory_peers/nv_mem/version",
            "kernel/mm/memory_peers/nv_mem_nc/version",
            "module/nvidia_peermem/version",
        ]
        .iter()
        .any(|p| self.sys(p).exists());
        if peermem {
            return true;
        }
        let rel =
            std::fs::read_to_string(self.opts.proc_root.join("sys/kernel/osrelease")).unwrap_or_default();
        let mut it = rel.trim().split(['.', '-']);
        let major: u32 = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let minor: u32 = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        (major, minor) >= (5, 12)
    }

    /// The network devices of `opts.nets`.
    fn net_devices(&self) -> Vec<NetDevice> {
        match &self.opts.nets {
            NetSelect::None => Vec::new(),
            NetSelect::Ib => self.ib_devices(),
            NetSelect::SocketNamed(names) => names
                .iter()
                .enumerate()
                .map(|(i, n)| self.socket_device(n, i))
                .collect(),
            NetSelect::Socket => {
                let ifs = match crate::bootstrap::list_interfaces() {
                    Ok(i) => i,
                    Err(e) => {
                        tracing::debug!(target: T, "topology detection: cannot list network interfaces ({e})");
                        return Vec::new();
                    }
                };
                let named = crate::params::env_var("SOCKET_IFNAME").filter(|(_, v)| !v.trim().is_empty());
                match crate::bootstrap::select_interface(
                    &ifs,
                    named.as_ref().map(|(k, v)| (k.as_str(), v.as_str())),
                    None,
                ) {
                    Ok(i) => vec![self.socket_device(&i.name, 0)],
                    Err(e) => {
                        tracing::debug!(target: T, "topology detection: no socket interface ({e})");
                        Vec::new()
                    }
                }
            }
        }
    }

    /// A socket network device (NCCL's `ncclNetSocketGetProperties`): speed from
    /// `class/net/<if>/speed` (10000 Mb/s when unknown), guid = device index.
    fn socket_device(&self, name: &str, dev: usize) -> NetDevice {
        let dir = self.sys("class/net").join(name);
        let speed = self
            .read(&dir, "speed")
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|&s| s > 0)
            .unwrap_or(SOCKET_DEFAULT_SPEED);
        NetDevice {
            name: name.to_string(),
            device_path: std::fs::canonicalize(dir.join("device")).ok(),
            speed_mbps: speed,
            port: 0,
            guid: dev as u64,
            maxconn: SOCKET_MAXCONN,
            latency: 0,
            gdr: false,
        }
    }

    /// The active ports of `class/infiniband/*` (NCCL's IB plugin devices): one device per
    /// HCA name (a second active port of the same HCA is left out, as NCCL's name lookup
    /// merges it), speed from the port's `rate` (`200 Gb/sec (4X HDR)` → 200000 Mb/s), guid
    /// from `sys_image_guid` (or `node_guid`).
    fn ib_devices(&self) -> Vec<NetDevice> {
        let dir = self.sys("class/infiniband");
        let mut names: Vec<String> = match std::fs::read_dir(&dir) {
            Ok(rd) => rd
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect(),
            Err(e) => {
                tracing::debug!(target: T, "topology detection: no InfiniBand devices ({}: {e})", dir.display());
                return Vec::new();
            }
        };
        names.sort();
        let gdr = self.gdr_support();
        let mut out = Vec::new();
        for name in names {
            let hca = dir.join(&name);
            let mut ports: Vec<u32> = std::fs::read_dir(hca.join("ports"))
                .map(|rd| {
                    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            ports.sort_unstable();
            let active = ports.into_iter().find(|p| {
                self.read(&hca.join(format!("ports/{p}")), "state")
                    .is_some_and(|s| s.contains("ACTIVE"))
            });
            let Some(port) = active else {
                tracing::debug!(target: T, hca = %name, "InfiniBand device without an active port, skipped");
                continue;
            };
            let rate = self
                .read(&hca.join(format!("ports/{port}")), "rate")
                .unwrap_or_default();
            let speed = leading_f32(&rate).map_or(0, |g| (g * 1000.0) as i64);
            let guid = self
                .read(&hca, "sys_image_guid")
                .or_else(|| self.read(&hca, "node_guid"))
                .and_then(|g| u64::from_str_radix(&g.trim().replace(':', ""), 16).ok())
                .unwrap_or(out.len() as u64);
            out.push(NetDevice {
                name,
                device_path: std::fs::canonicalize(hca.join("device")).ok(),
                speed_mbps: speed,
                port,
                guid,
                maxconn: IB_MAXCONN,
                latency: 0,
                gdr,
            });
        }
        out
    }

    /// NCCL's `ncclTopoFillNet` + the attributes of `ncclTopoPopulateNics`: the `<net>` in a
    /// `<nic>` under the device's `<pci>` (or under the first CPU for a device not on PCI).
    fn fill_net(&self, xml: &mut Xml, dev: usize, net: &NetDevice) {
        let existing = find_path(&xml.root, &|n: &XmlNode| {
            n.name == "net" && n.attr("name") == Some(net.name.as_str())
        });
        let path = match existing {
            Some(p) => p,
            None => {
                let pci = net.device_path.as_ref().filter(|p| {
                    let sub = std::fs::canonicalize(p.join("subsystem")).ok();
                    let on_pci = sub
                        .as_ref()
                        .and_then(|s| s.file_name())
                        .is_some_and(|n| n == "pci");
                    if !on_pci {
                        tracing::debug!(target: T, name = %net.name, path = %p.display(), "network device is not a PCI device: attached to the first CPU");
                    }
                    on_pci
                });
                let parent = match pci.and_then(|p| p.file_name()?.to_str().map(str::to_string)) {
                    Some(bus) => self.ensure_pci(xml, &bus, Some("0x02")),
                    None => match xml.root.subs.iter().position(|s| s.name == "cpu") {
                        Some(i) => vec![i],
                        None => self.ensure_cpu(xml, "-1"),
                    },
                };
                let p = at_mut(&mut xml.root, &parent);
                let nic = match p.subs.iter().position(|s| s.name == "nic") {
                    Some(i) => i,
                    None => {
                        p.subs.push(XmlNode::new("nic"));
                        p.subs.len() - 1
                    }
                };
                let mut n = XmlNode::new("net");
                n.set_attr("name", &net.name);
                p.subs[nic].subs.push(n);
                let mut path = parent;
                path.push(nic);
                path.push(p.subs[nic].subs.len() - 1);
                path
            }
        };
        let n = at_mut(&mut xml.root, &path);
        n.set_attr("dev", dev);
        n.init_attr("latency", net.latency);
        n.init_attr("speed", net.speed_mbps);
        n.init_attr("port", net.port);
        n.set_attr("guid", format_args!("{:#x}", net.guid));
        n.init_attr("maxconn", net.maxconn);
        n.init_attr("gdr", u8::from(net.gdr));
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

// ------------------------------------------------------------------------------------------
// CPU affinity
// ------------------------------------------------------------------------------------------

/// A set of CPU cores (logical CPU numbers), ascending, without duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuSet {
    cores: Vec<usize>,
}

impl CpuSet {
    /// The set of `cores` (sorted, duplicates dropped).
    pub fn from_cores(cores: impl IntoIterator<Item = usize>) -> CpuSet {
        let mut cores: Vec<usize> = cores.into_iter().collect();
        cores.sort_unstable();
        cores.dedup();
        CpuSet { cores }
    }

    /// Parses a Linux CPU list (`cpulist`, `local_cpulist`): comma-separated cores and
    /// inclusive ranges, e.g. `0-15,32-47`; an empty string (or only a newline) is the empty
    /// set. Errors: `InvalidArgument` naming the list and the bad part (not a number, or a
    /// range whose end is below its start).
    pub fn parse_list(list: &str) -> Result<CpuSet> {
        let mut cores = Vec::new();
        for part in list.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || {
                Error::invalid(format!(
                    "CPU list {list:?}: {part:?} is not a core or a range lo-hi with lo <= hi"
                ))
            };
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let lo: usize = lo.trim().parse().map_err(|_| bad())?;
                    let hi: usize = hi.trim().parse().map_err(|_| bad())?;
                    if hi < lo {
                        return Err(bad());
                    }
                    cores.extend(lo..=hi);
                }
                None => cores.push(part.parse().map_err(|_| bad())?),
            }
        }
        Ok(CpuSet::from_cores(cores))
    }

    /// Parses a Linux CPU mask (`cpumap`, `local_cpus`, NCCL's `affinity`): 32-bit hex words
    /// separated by commas, most significant first. Errors: `InvalidArgument` naming the mask.
    pub fn parse_mask(mask: &str) -> Result<CpuSet> {
        let mut cores = Vec::new();
        for (w, word) in mask.trim().rsplit(',').enumerate() {
            let bits = u32::from_str_radix(word.trim(), 16).map_err(|_| {
                Error::invalid(format!("CPU mask {mask:?}: {word:?} is not a 32-bit hex word"))
            })?;
            cores.extend((0..32).filter(|b| bits & (1 << b) != 0).map(|b| w * 32 + b));
        }
        Ok(CpuSet::from_cores(cores))
    }

    /// The cores, ascending.
    pub fn cores(&self) -> &[usize] {
        &self.cores
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.cores.is_empty()
    }

    /// The cores of both sets.
    pub fn intersect(&self, other: &CpuSet) -> CpuSet {
        CpuSet {
            cores: self
                .cores
                .iter()
                .copied()
                .filter(|c| other.cores.contains(c))
                .collect(),
        }
    }

    /// The set as a Linux CPU mask (as `cpumap` prints it): 32-bit words of 8 hex digits,
    /// most significant first, as many as the highest core needs (`"00000000"` when empty).
    pub fn to_mask(&self) -> String {
        let words = self.cores.last().map_or(1, |&c| c / 32 + 1);
        let mut w = vec![0u32; words];
        for &c in &self.cores {
            w[c / 32] |= 1 << (c % 32);
        }
        w.iter()
            .rev()
            .map(|x| format!("{x:08x}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The set as a Linux CPU list, e.g. `0-15,32-47`.
    pub fn to_list(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut i = 0;
        while i < self.cores.len() {
            let mut j = i;
            while j + 1 < self.cores.len() && self.cores[j + 1] == self.cores[j] + 1 {
                j += 1;
            }
            out.push(if i == j {
                self.cores[i].to_string()
            } else {
                format!("{}-{}", self.cores[i], self.cores[j])
            });
            i = j + 1;
        }
        out.join(",")
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_list())
    }
}

/// The CPUs local to the PCI device `bus_id` under sysfs root `sys_root`: its
/// `local_cpulist` (or `local_cpus` mask), else the `cpulist` of its `numa_node`. `None` when
/// sysfs says neither (a VM without NUMA information) or the bus id is malformed.
pub fn pci_local_cpus(sys_root: &Path, bus_id: &str) -> Option<CpuSet> {
    let b = normalize_bus_id(bus_id)?;
    let dir = sys_root.join("bus/pci/devices").join(&b);
    let read = |p: PathBuf| std::fs::read_to_string(p).ok().filter(|s| !s.trim().is_empty());
    if let Some(l) = read(dir.join("local_cpulist"))
        && let Ok(s) = CpuSet::parse_list(&l)
        && !s.is_empty()
    {
        return Some(s);
    }
    if let Some(m) = read(dir.join("local_cpus"))
        && let Ok(s) = CpuSet::parse_mask(&m)
        && !s.is_empty()
    {
        return Some(s);
    }
    let numa: i64 = read(dir.join("numa_node"))?.trim().parse().ok()?;
    if numa < 0 {
        return None;
    }
    let l = read(sys_root.join(format!("devices/system/node/node{numa}/cpulist")))?;
    CpuSet::parse_list(&l).ok().filter(|s| !s.is_empty())
}

/// The CPU set of the NUMA node of the CUDA device at `bus_id` on this machine (`/sys`), as
/// [`pci_local_cpus`]; `None` when unknown.
pub fn gpu_local_cpus(bus_id: &str) -> Option<CpuSet> {
    pci_local_cpus(Path::new("/sys"), bus_id)
}

/// The calling thread's CPU affinity (`sched_getaffinity`); `None` when it cannot be read.
pub fn thread_affinity() -> Option<CpuSet> {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a writable cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return None;
    }
    let max = libc::CPU_SETSIZE as usize;
    // SAFETY: `set` is initialised and every index is below CPU_SETSIZE.
    Some(CpuSet::from_cores(
        (0..max).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }),
    ))
}

/// Binds the calling thread to `cpus` (`sched_setaffinity`). Errors: `InvalidArgument` for an
/// empty set or cores beyond `CPU_SETSIZE` (1024); `System` with the OS error (e.g. none of
/// the cores is allowed in this cgroup).
pub fn bind_thread(cpus: &CpuSet) -> Result<()> {
    let max = libc::CPU_SETSIZE as usize;
    if cpus.is_empty() || cpus.cores.iter().any(|&c| c >= max) {
        return Err(Error::invalid(format!(
            "cpus {cpus}: binding needs a non-empty set of cores in 0..{max}"
        )));
    }
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in &cpus.cores {
        // SAFETY: c < CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(Error::System(format!(
            "sched_setaffinity to cpus {cpus}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// The CPUs a thread working for the GPU at `bus_id` should run on (NCCL's
/// `ncclTopoGetCpuAffinity`): the GPU's local CPUs ([`gpu_local_cpus`]) within the calling
/// thread's current affinity, or the GPU's alone with `NCCL_IGNORE_CPU_AFFINITY=1`. `None`
/// when the GPU's CPUs are unknown or the intersection is empty (the affinity is then left
/// as it is).
pub fn gpu_affinity(bus_id: &str) -> Option<CpuSet> {
    near_affinity(gpu_local_cpus(bus_id)?)
}

fn near_affinity(local: CpuSet) -> Option<CpuSet> {
    let ignore = crate::params::env_var("IGNORE_CPU_AFFINITY").is_some_and(|(_, v)| v.trim() == "1");
    let set = match (ignore, thread_affinity()) {
        (false, Some(cur)) => local.intersect(&cur),
        _ => local,
    };
    (!set.is_empty()).then_some(set)
}

/// Binds the calling thread near the GPU at `bus_id` ([`gpu_affinity`]); returns the set
/// bound, `None` when the affinity is not known or binding failed (both debug-logged, the
/// thread then keeps its affinity).
pub fn bind_near_gpu(bus_id: &str) -> Option<CpuSet> {
    let Some(set) = gpu_affinity(bus_id) else {
        tracing::debug!(target: T, bus_id, "CPU affinity of the GPU unknown: thread not bound");
        return None;
    };
    match bind_thread(&set) {
        Ok(()) => {
            tracing::debug!(target: T, bus_id, cpus = %set, "thread bound near its GPU");
            Some(set)
        }
        Err(e) => {
            tracing::debug!(target: T, bus_id, "thread not bound near its GPU: {e}");
            None
        }
    }
}

thread_local! {
    static NEAR: RefCell<Option<CpuSet>> = const { RefCell::new(None) };
}

/// The CPU set helper threads started now by the calling thread should bind to: the set of
/// the [`AffinityGuard`] active on this thread, if any. Capture it before spawning and hand it
/// to [`bind_helper_thread`] in the new thread.
pub fn helper_affinity() -> Option<CpuSet> {
    NEAR.with(|n| n.borrow().clone())
}

/// First call of a helper thread (bootstrap listener, proxy): binds the thread to `near`
/// (what [`helper_affinity`] returned in the thread that started it), so it runs near its
/// GPU as NCCL's threads do; does nothing for `None`. A failure is a debug message.
pub fn bind_helper_thread(near: Option<&CpuSet>) {
    if let Some(set) = near {
        match bind_thread(set) {
            Ok(()) => {
                tracing::debug!(target: T, cpus = %set, thread = ?std::thread::current().name(), "helper thread bound near its GPU")
            }
            Err(e) => tracing::debug!(target: T, "helper thread not bound: {e}"),
        }
    }
}

/// Binds the calling thread near a set of GPUs while it lives and restores the thread's
/// previous affinity when dropped (NCCL binds its init thread near the GPU during
/// `initTransportsRank` and restores it at the end). While it lives, [`helper_affinity`]
/// returns the set.
#[derive(Debug)]
pub struct AffinityGuard {
    saved: Option<CpuSet>,
    prev_hint: Option<CpuSet>,
    set: Option<CpuSet>,
}

impl AffinityGuard {
    /// Binds to the CPUs near the GPUs at `bus_ids` when they all have the same local CPUs
    /// (one NUMA node; [`gpu_affinity`]); otherwise, or when unknown, leaves the affinity as
    /// it is (the guard then does nothing).
    pub fn near_gpus(bus_ids: &[&str]) -> AffinityGuard {
        let sets: Vec<Option<CpuSet>> = bus_ids.iter().map(|b| gpu_local_cpus(b)).collect();
        let common = match sets.first() {
            Some(Some(first)) if sets.iter().all(|s| s.as_ref() == Some(first)) => {
                near_affinity(first.clone())
            }
            _ => None,
        };
        if common.is_none() && !bus_ids.is_empty() {
            tracing::debug!(target: T, ?bus_ids, "CPU affinity of the GPUs unknown or not shared: init thread not bound");
        }
        AffinityGuard::bind(common)
    }

    /// Binds the calling thread to `set` (nothing for `None`) until the guard drops.
    pub fn bind(set: Option<CpuSet>) -> AffinityGuard {
        let saved = thread_affinity();
        let set = set.filter(|s| match bind_thread(s) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(target: T, "init thread not bound: {e}");
                false
            }
        });
        let prev_hint = NEAR.with(|n| {
            let mut n = n.borrow_mut();
            let prev = n.clone();
            if set.is_some() {
                *n = set.clone();
            }
            prev
        });
        if let Some(s) = &set {
            tracing::debug!(target: T, cpus = %s, "init thread bound near its GPU");
        }
        AffinityGuard {
            saved,
            prev_hint,
            set,
        }
    }

    /// The set the thread is bound to, `None` when the guard did not bind.
    pub fn cpus(&self) -> Option<&CpuSet> {
        self.set.as_ref()
    }
}

impl Drop for AffinityGuard {
    fn drop(&mut self) {
        if self.set.is_none() {
            return;
        }
        NEAR.with(|n| *n.borrow_mut() = self.prev_hint.take());
        if let Some(s) = &self.saved
            && let Err(e) = bind_thread(s)
        {
            tracing::debug!(target: T, "cannot restore the thread's CPU affinity: {e}");
        }
    }
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
        assert_eq!(max_nvlinks(90), 18);
        assert_eq!(max_nvlinks(80), 12);
        assert_eq!(max_nvlinks(70), 6);
        assert_eq!(max_nvlinks(52), 0);
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
