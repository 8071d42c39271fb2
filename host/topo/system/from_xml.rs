//! Building the system graph from a topology XML tree (NCCL's `ncclTopoGetSystemFromXml` in
//! `src/graph/topo.cc`): `ncclTopoAddCpu`, `ncclTopoAddPci`, `ncclTopoAddGpu`, `ncclTopoAddNic`,
//! `ncclTopoAddNet`, `ncclTopoAddNvLinks`, `ncclTopoAddC2c`, `ncclTopoAddPciLinks`,
//! `ncclTopoFlattenBcmSwitches`, `ncclTopoConnectCpus` and `ncclTopoSortSystem`, with the
//! dictionaries and number parsing of NCCL's XML attributes.
use super::{
    Cpu, CpuArch, CpuModel, CpuVendor, Gpu, LOC_BW, Link, LinkType, MAX_CHANNELS, Net, Node, NodeId, NodeKind,
    NodeType, PciInfo, System, inter_cpu_bw, nvlink_bw,
};
use crate::error::{Error, Result};
use crate::topo::paths::{PathOptions, Paths};
use crate::topo::xml::{Xml, XmlNode, bus_id_to_int};
use std::fmt;

fn pci_class_type(class: &str) -> NodeType {
    const DICT: [(&str, NodeType); 5] = [
        ("0x060400", NodeType::Pci),
        ("0x068000", NodeType::Nvs),
        ("0x068001", NodeType::Cpu),
        ("0x03", NodeType::Gpu),
        ("0x02", NodeType::Nic),
    ];
    DICT.iter()
        .find(|(p, _)| class.starts_with(p))
        .map_or(NodeType::Pci, |(_, t)| *t)
}

/// Per-lane PCI rate in 100 Mb/s units, NCCL's `kvDictPciGen` (prefix match); `None` when the
/// speed is not known (NCCL then assumes Gen3, 60).
fn pci_gen_rate(speed: &str) -> Option<u32> {
    const DICT: [(&str, u32); 11] = [
        ("2.5 GT/s", 15),
        ("5 GT/s", 30),
        ("8 GT/s", 60),
        ("16 GT/s", 120),
        ("32 GT/s", 240),
        ("5.0 GT/s PCIe", 30),
        ("8.0 GT/s PCIe", 60),
        ("16.0 GT/s PCIe", 120),
        ("32.0 GT/s PCIe", 240),
        ("64.0 GT/s PCIe", 480),
        ("64 GT/s", 480),
    ];
    DICT.iter().find(|(p, _)| speed.starts_with(p)).map(|(_, r)| *r)
}

/// Parses an integer as C's `strtol(s, NULL, 0)` would for well-formed input: decimal, or hex
/// with `0x`; with an optional sign. Trailing garbage is refused.
pub(crate) fn parse_int(s: &str) -> Option<i64> {
    let t = s.trim();
    let (neg, t) = match t.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let v = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => i64::from_str_radix(h, 16).ok()?,
        None => t.parse::<i64>().ok()?,
    };
    Some(if neg { -v } else { v })
}

fn parse_hex_u64(s: &str) -> Option<u64> {
    let t = s.trim();
    let t = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    u64::from_str_radix(t, 16).ok()
}

/// The cores of a CPU mask as Linux prints it (NCCL's `ncclStrToCpuset`): 32-bit hex words
/// separated by commas, most significant first.
fn parse_cpu_mask(mask: &str) -> Option<Vec<u32>> {
    let mut cores = Vec::new();
    for (w, word) in mask.trim().rsplit(',').enumerate() {
        let bits = u32::from_str_radix(word.trim(), 16).ok()?;
        for b in 0..32 {
            if bits & (1 << b) != 0 {
                cores.push(w as u32 * 32 + b);
            }
        }
    }
    cores.sort_unstable();
    Some(cores)
}

/// Callback of `Builder::walk`: the element, the bus id of the closest `<pci>` above it, and the
/// system (host) id of its `<cpu>`.
type WalkFn<'f> = dyn FnMut(&mut Builder, &XmlNode, Option<&str>, usize) -> Result<()> + 'f;

pub(super) struct Builder {
    sys: System,
}

impl Builder {
    pub(super) fn build(xml: Xml) -> Result<System> {
        let root = &xml.root;
        if root.name != "system" {
            return Err(Error::invalid(format!(
                "{}:{}: root element is <{}>, a topology file has <system version=\"1\">",
                xml.source, root.line, root.name
            )));
        }
        match root.attr("version") {
            Some(v) if parse_int(v) == Some(1) => {}
            v => {
                return Err(Error::invalid(format!(
                    "{}:{}: <system> version is {v:?}, oxccl reads version \"1\" (NCCL_TOPO_XML_VERSION)",
                    xml.source, root.line
                )));
            }
        }
        let mut b = Builder {
            sys: System {
                xml: Xml {
                    root: XmlNode::default(),
                    source: xml.source.clone(),
                },
                nodes: Vec::new(),
                host_hashes: Vec::new(),
                options: PathOptions::default(),
                paths: Paths::default(),
            },
        };
        for cpu in root.subs_named("cpu") {
            b.add_cpu(cpu)?;
        }
        b.add_nvlinks(root)?;
        b.add_c2c(root)?;
        b.add_pci_links(root)?;
        b.flatten_bcm_switches();
        b.connect_cpus();
        b.sort_system();
        b.sys.xml = xml;
        Ok(b.sys)
    }

    fn source(&self) -> &str {
        &self.sys.xml.source
    }

    fn bad(&self, node: &XmlNode, msg: impl fmt::Display) -> Error {
        Error::invalid(format!("{}:{}: <{}>: {msg}", self.source(), node.line, node.name))
    }

    fn req_str<'x>(&self, node: &'x XmlNode, key: &str) -> Result<&'x str> {
        node.attr(key)
            .ok_or_else(|| self.bad(node, format!("attribute {key:?} is missing")))
    }

    fn req_int(&self, node: &XmlNode, key: &str) -> Result<i64> {
        let v = self.req_str(node, key)?;
        parse_int(v).ok_or_else(|| self.bad(node, format!("attribute {key}={v:?} is not an integer")))
    }

    fn opt_int(&self, node: &XmlNode, key: &str, default: i64) -> Result<i64> {
        match node.attr(key) {
            None => Ok(default),
            Some(v) => {
                parse_int(v).ok_or_else(|| self.bad(node, format!("attribute {key}={v:?} is not an integer")))
            }
        }
    }

    fn system_id(&mut self, cpu: &XmlNode) -> Result<usize> {
        let hash = match cpu.attr("host_hash") {
            None => 0,
            Some(v) => parse_hex_u64(v)
                .ok_or_else(|| self.bad(cpu, format!("attribute host_hash={v:?} is not a hex number")))?,
        };
        Ok(match self.sys.host_hashes.iter().position(|&h| h == hash) {
            Some(i) => i,
            None => {
                self.sys.host_hashes.push(hash);
                self.sys.host_hashes.len() - 1
            }
        })
    }

    fn create(&mut self, kind: NodeKind, id: i64, system_id: usize, pci: Option<PciInfo>) -> NodeId {
        self.sys.nodes.push(Node {
            id,
            system_id,
            kind,
            pci,
            links: Vec::new(),
        });
        NodeId(self.sys.nodes.len() - 1)
    }

    fn get(&self, ty: NodeType, id: i64) -> Option<NodeId> {
        self.sys
            .nodes
            .iter()
            .position(|n| n.node_type() == ty && n.id == id)
            .map(NodeId)
    }

    /// NCCL's `ncclTopoConnectNodes`: one directed link, aggregated with an existing link of the
    /// same type to the same node, kept sorted by decreasing bandwidth (stable).
    fn connect(&mut self, from: NodeId, to: NodeId, kind: LinkType, bw: f64) {
        let links = &mut self.sys.nodes[from.0].links;
        let mut i = match links.iter().position(|l| l.remote == to && l.kind == kind) {
            Some(i) => {
                links[i].bw += bw;
                i
            }
            None => {
                links.push(Link { kind, remote: to, bw });
                links.len() - 1
            }
        };
        while i > 0 && links[i - 1].bw < links[i].bw {
            links.swap(i - 1, i);
            i -= 1;
        }
    }

    fn add_cpu(&mut self, x: &XmlNode) -> Result<()> {
        let numa_id = self.req_int(x, "numaid")?;
        let numa_id =
            i32::try_from(numa_id).map_err(|_| self.bad(x, format!("numaid {numa_id} is out of range")))?;
        let system_id = self.system_id(x)?;
        let host_hash = self.sys.host_hashes[system_id];
        let affinity = x.attr("affinity").map(str::to_string);
        let cores = match &affinity {
            None => Vec::new(),
            Some(a) => parse_cpu_mask(a).ok_or_else(|| {
                self.bad(
                    x,
                    format!("attribute affinity={a:?} is not a CPU mask (hex words separated by commas)"),
                )
            })?,
        };
        let arch_str = self.req_str(x, "arch")?;
        let arch = match arch_str {
            a if a.starts_with("x86_64") => CpuArch::X86,
            a if a.starts_with("arm64") => CpuArch::Arm,
            a if a.starts_with("ppc64") => CpuArch::Power,
            _ => CpuArch::Other,
        };
        let (mut vendor, mut model) = (CpuVendor::Other, CpuModel::Other);
        if arch == CpuArch::X86 {
            vendor = match self.req_str(x, "vendor")? {
                v if v.starts_with("GenuineIntel") => CpuVendor::Intel,
                v if v.starts_with("AuthenticAMD") => CpuVendor::Amd,
                v if v.starts_with("CentaurHauls") || v.starts_with("  Shanghai  ") => CpuVendor::Zhaoxin,
                _ => CpuVendor::Other,
            };
            if vendor == CpuVendor::Intel {
                let family = self.req_int(x, "familyid")?;
                let m = self.req_int(x, "modelid")?;
                model = match (family, m) {
                    (6, 0xCF..) => CpuModel::IntelEmeraldRapids,
                    (6, 0x8F..) => CpuModel::IntelSapphireRapids,
                    (6, 0x55..) => CpuModel::IntelSkylake,
                    _ => CpuModel::IntelBroadwell,
                };
            } else if vendor == CpuVendor::Zhaoxin {
                let family = self.req_int(x, "familyid")?;
                let m = self.req_int(x, "modelid")?;
                if family == 7 && m == 0x5B {
                    model = CpuModel::ZhaoxinYongfeng;
                }
            }
        }
        let cpu = Cpu {
            numa_id,
            arch,
            vendor,
            model,
            affinity,
            cores,
            host_hash,
        };
        let id = ((system_id as i64) << 56) + numa_id as i64;
        let cpu_id = self.create(NodeKind::Cpu(cpu), id, system_id, None);
        for sub in &x.subs {
            match sub.name.as_str() {
                "pci" => self.add_pci(sub, cpu_id, system_id, numa_id)?,
                "nic" => {
                    // A NIC without a PCI element of its own (e.g. a socket NIC): attached to the
                    // CPU at LOC_BW.
                    let nic_id = ((system_id as i64) << 56) + ((numa_id as i64) << 48);
                    let nic = match self.get(NodeType::Nic, nic_id) {
                        Some(n) => n,
                        None => {
                            let n = self.create(NodeKind::Nic, nic_id, system_id, None);
                            self.connect(cpu_id, n, LinkType::Pci, LOC_BW);
                            self.connect(n, cpu_id, LinkType::Pci, LOC_BW);
                            n
                        }
                    };
                    self.add_nic(sub, nic, system_id)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn add_pci(&mut self, x: &XmlNode, parent: NodeId, system_id: usize, numa_id: i32) -> Result<()> {
        let class = self.req_str(x, "class")?.to_string();
        let mut ty = pci_class_type(&class);
        let bus_str = self.req_str(x, "busid")?;
        let bus = bus_id_to_int(bus_str)
            .ok_or_else(|| self.bad(x, format!("attribute busid={bus_str:?} is not a PCI bus id")))?;
        let sys_bits = (system_id as i64) << 56;
        let mut created: Option<NodeId> = None;
        let mut info = PciInfo {
            bus_id: bus_str.to_string(),
            class: class.clone(),
            device: 0,
            link_width: 0,
            link_speed: String::new(),
            bw: 0.0,
        };
        if let Some(g) = x.sub("gpu") {
            ty = NodeType::Gpu;
            if g.attr("rank").is_none() {
                tracing::debug!(target: "oxccl::graph", "{}:{}: GPU {bus_str} has no rank: not part of the communicator, skipped", self.source(), g.line);
                return Ok(());
            }
            let sm = self.req_int(g, "sm")?;
            let rank = self.req_int(g, "rank")?;
            let dev = self.req_int(g, "dev")?;
            let gdr = self.req_int(g, "gdr")? != 0;
            let (Ok(sm), Ok(rank), Ok(dev)) = (u32::try_from(sm), i32::try_from(rank), i32::try_from(dev))
            else {
                return Err(self.bad(g, format!("sm={sm}, rank={rank} or dev={dev} is out of range")));
            };
            // Each GPU once: a repeated bus id made two GPU nodes of one id, and the first took
            // every <nvlink> to it. (A repeated rank is left to the graph search, which names it.)
            if self.get(NodeType::Gpu, sys_bits + bus).is_some() {
                return Err(self.bad(
                    x,
                    format!("GPU busid={bus_str:?} is listed twice (each GPU once)"),
                ));
            }
            let gpu = Gpu { dev, rank, sm, gdr };
            created = Some(self.create(NodeKind::Gpu(gpu), sys_bits + bus, system_id, None));
        }
        if let Some(n) = x.sub("nic") {
            ty = NodeType::Nic;
            // Ports of one multi-port NIC (functions .0, .1, ...) share one NIC node.
            let nic_id = sys_bits + ((numa_id as i64) << 48) + (bus & !0xf);
            let nic = match self.get(NodeType::Nic, nic_id) {
                Some(nic) => nic,
                None => {
                    let nic = self.create(NodeKind::Nic, nic_id, system_id, None);
                    created = Some(nic);
                    nic
                }
            };
            self.add_nic(n, nic, system_id)?;
        } else if ty == NodeType::Pci {
            let mut device = 0u64;
            for (key, shift) in [
                ("vendor", 48),
                ("device", 32),
                ("subsystem_vendor", 16),
                ("subsystem_device", 0),
            ] {
                if let Some(v) = x.attr(key) {
                    let n = parse_int(v)
                        .ok_or_else(|| self.bad(x, format!("attribute {key}={v:?} is not an integer")))?;
                    device = device.wrapping_add((n as u64) << shift);
                }
            }
            info.device = device;
            let pci = self.create(NodeKind::Pci, sys_bits + bus, system_id, None);
            created = Some(pci);
            for sub in &x.subs {
                if sub.name != "pcilink" {
                    self.add_pci(sub, pci, system_id, numa_id)?;
                }
            }
        }
        match created {
            Some(node) => {
                let width = self.req_int(x, "link_width")?;
                let width = u32::try_from(width)
                    .map_err(|_| self.bad(x, format!("attribute link_width={width} is out of range")))?;
                let width = if width == 0 { 16 } else { width };
                let speed = self.req_str(x, "link_speed")?;
                let rate = pci_gen_rate(speed).unwrap_or_else(|| {
                    tracing::debug!(target: "oxccl::graph", "{}:{}: PCI link speed {speed:?} unknown, Gen3 (8 GT/s) assumed", self.source(), x.line);
                    60
                });
                let bw = f64::from(width) * f64::from(rate) / 80.0;
                info.link_width = width;
                info.link_speed = speed.to_string();
                info.bw = bw;
                self.sys.nodes[node.0].pci = Some(info);
                self.connect(node, parent, LinkType::Pci, bw);
                self.connect(parent, node, LinkType::Pci, bw);
            }
            None => {
                if ty != NodeType::Nic {
                    tracing::debug!(target: "oxccl::graph", "{}:{}: PCI device {bus_str} (class {class}, a {ty}) has no <{}> element: left out until detection fills it", self.source(), x.line, ty.as_str().to_lowercase());
                }
            }
        }
        Ok(())
    }

    fn add_nic(&mut self, x: &XmlNode, nic: NodeId, system_id: usize) -> Result<()> {
        for net in x.subs_named("net") {
            if net.attr("dev").is_none() {
                continue;
            }
            self.add_net(net, nic, system_id)?;
        }
        Ok(())
    }

    fn add_net(&mut self, x: &XmlNode, nic: NodeId, system_id: usize) -> Result<()> {
        let dev = self.req_int(x, "dev")?;
        let dev = i32::try_from(dev).map_err(|_| self.bad(x, format!("dev={dev} is out of range")))?;
        let guid = match x.attr("guid") {
            None => dev as u64,
            Some(v) => parse_hex_u64(v)
                .ok_or_else(|| self.bad(x, format!("attribute guid={v:?} is not a hex number")))?,
        };
        let mbps = self.opt_int(x, "speed", 0)?;
        let mbps = if mbps <= 0 { 10000 } else { mbps };
        let latency = match x.attr("latency") {
            None => 0.0,
            Some(v) => v
                .trim()
                .parse::<f64>()
                .map_err(|_| self.bad(x, format!("attribute latency={v:?} is not a number")))?,
        };
        let port = self.opt_int(x, "port", 0)?;
        let maxconn = self.opt_int(x, "maxconn", i64::from(MAX_CHANNELS))?;
        let net = Net {
            dev,
            name: x.attr("name").unwrap_or("").to_string(),
            bw: mbps as f64 / 8000.0,
            latency,
            port: port as i32,
            guid,
            max_channels: u32::try_from(maxconn).unwrap_or(0),
            gdr: self.opt_int(x, "gdr", 0)? != 0,
            coll: self.opt_int(x, "coll", 0)? != 0,
        };
        let bw = net.bw;
        let id = ((system_id as i64) << 56) + dev as i64;
        let n = self.create(NodeKind::Net(net), id, system_id, None);
        self.connect(nic, n, LinkType::Net, bw);
        self.connect(n, nic, LinkType::Net, bw);
        Ok(())
    }

    /// The CPU at the root of a node's PCI tree (NCCL's `findLocalCpu`).
    fn find_local_cpu(&self, node: NodeId, from: Option<NodeId>) -> Option<NodeId> {
        let n = &self.sys.nodes[node.0];
        if n.node_type() == NodeType::Cpu {
            return Some(node);
        }
        for l in &n.links {
            let rt = self.sys.nodes[l.remote.0].node_type();
            if l.kind == LinkType::Pci
                && Some(l.remote) != from
                && (rt == NodeType::Pci || rt == NodeType::Cpu)
                && let Some(c) = self.find_local_cpu(l.remote, Some(node))
            {
                return Some(c);
            }
        }
        None
    }

    /// Walks the XML keeping the bus id of the closest `<pci>` above and the host of the
    /// enclosing `<cpu>`; calls `f` on every element named `name`.
    fn walk(
        &mut self,
        x: &XmlNode,
        name: &str,
        parent_bus: Option<&str>,
        system_id: usize,
        f: &mut WalkFn<'_>,
    ) -> Result<()> {
        if x.name == name {
            return f(self, x, parent_bus, system_id);
        }
        let system_id = if x.name == "cpu" {
            self.system_id(x)?
        } else {
            system_id
        };
        let bus = x.attr("busid").or(parent_bus);
        for s in &x.subs {
            self.walk(s, name, bus, system_id, f)?;
        }
        Ok(())
    }

    fn parent_gpu(&self, x: &XmlNode, parent_bus: Option<&str>, system_id: usize) -> Result<Option<NodeId>> {
        let bus = parent_bus
            .and_then(bus_id_to_int)
            .ok_or_else(|| self.bad(x, "is not inside a <pci> element with a bus id"))?;
        Ok(self.get(NodeType::Gpu, ((system_id as i64) << 56) + bus))
    }

    /// NCCL's `ncclTopoAddNvLinks`.
    fn add_nvlinks(&mut self, root: &XmlNode) -> Result<()> {
        self.walk(root, "nvlink", None, 0, &mut |b, x, parent_bus, system_id| {
            let Some(gpu) = b.parent_gpu(x, parent_bus, system_id)? else {
                // The GPU was left out (no rank): its NVLinks go with it.
                return Ok(());
            };
            let count = b.req_int(x, "count")?;
            if count < 0 {
                return Err(b.bad(x, format!("count={count} is negative")));
            }
            let tclass = b.req_str(x, "tclass")?;
            let remote = match pci_class_type(tclass) {
                NodeType::Gpu => {
                    let target = b.req_str(x, "target")?;
                    let bus = bus_id_to_int(target).ok_or_else(|| {
                        b.bad(x, format!("attribute target={target:?} is not a PCI bus id"))
                    })?;
                    b.get(NodeType::Gpu, ((system_id as i64) << 56) + bus)
                }
                NodeType::Cpu => b.find_local_cpu(gpu, None),
                _ => Some(
                    match b.sys.nodes.iter().position(|n| n.node_type() == NodeType::Nvs) {
                        Some(i) => NodeId(i),
                        None => b.create(NodeKind::Nvs, 0, system_id, None),
                    },
                ),
            };
            if let Some(remote) = remote {
                let sm = b.sys.nodes[gpu.0].gpu().map_or(0, |g| g.sm);
                let bw = count as f64 * nvlink_bw(sm);
                b.connect(gpu, remote, LinkType::Nvl, bw);
                if b.sys.nodes[remote.0].node_type() != NodeType::Gpu {
                    b.connect(remote, gpu, LinkType::Nvl, bw);
                }
            }
            Ok(())
        })
    }

    /// NCCL's `ncclTopoAddC2c`: `count` C2C links of `bw` MB/s between a GPU and its CPU.
    fn add_c2c(&mut self, root: &XmlNode) -> Result<()> {
        self.walk(root, "c2c", None, 0, &mut |b, x, parent_bus, system_id| {
            let Some(gpu) = b.parent_gpu(x, parent_bus, system_id)? else {
                return Ok(());
            };
            let count = b.req_int(x, "count")?;
            let bw = b.req_int(x, "bw")?;
            let c2c_bw = (bw * count) as f64 / 1000.0;
            if let Some(cpu) = b.find_local_cpu(gpu, None) {
                b.connect(gpu, cpu, LinkType::C2c, c2c_bw);
                b.connect(cpu, gpu, LinkType::C2c, c2c_bw);
            }
            Ok(())
        })
    }

    /// NCCL's `ncclTopoAddPciLinks`: `<pcilink target=...>` peer links between PCI switches.
    fn add_pci_links(&mut self, root: &XmlNode) -> Result<()> {
        self.walk(root, "pcilink", None, 0, &mut |b, x, parent_bus, system_id| {
            let bus = parent_bus
                .and_then(bus_id_to_int)
                .ok_or_else(|| b.bad(x, "is not inside a <pci> element with a bus id"))?;
            let sys_bits = (system_id as i64) << 56;
            let Some(pci) = b.get(NodeType::Pci, sys_bits + bus) else {
                return Err(b.bad(
                    x,
                    format!("parent {} is not a PCI switch", parent_bus.unwrap_or("?")),
                ));
            };
            let target = b.req_str(x, "target")?;
            let tbus = bus_id_to_int(target)
                .ok_or_else(|| b.bad(x, format!("attribute target={target:?} is not a PCI bus id")))?;
            if let Some(remote) = b.get(NodeType::Pci, sys_bits + tbus) {
                b.connect(pci, remote, LinkType::Loc, LOC_BW);
            }
            Ok(())
        })
    }

    /// NCCL's `ncclTopoFlattenBcmSwitches`: Broadcom Gen4/Gen5 PEX switches show up as two
    /// levels of switches though they switch at full bandwidth across all ports; the sub-switches
    /// are merged into the parent.
    fn flatten_bcm_switches(&mut self) {
        fn bcm_gen(device: u64, level: u64) -> u32 {
            if device & 0xffff_ffff_ffff_f000 == 0x1000_c010_1000_a000 {
                return 4;
            }
            if device & 0xffff_ffff_ffff_f000 == (0x1000_c030_1000_0000 | (level * 0x1000)) {
                return 5;
            }
            0
        }
        let device = |b: &Builder, id: NodeId| b.sys.nodes[id.0].pci.as_ref().map_or(0, |p| p.device);
        let mut s = 0;
        while s < self.sys.nodes.len() {
            let sw = NodeId(s);
            s += 1;
            if self.sys.nodes[sw.0].node_type() != NodeType::Pci {
                continue;
            }
            let generation = bcm_gen(device(self, sw), 0);
            if generation == 0 {
                continue;
            }
            let subs: Vec<NodeId> = self.sys.nodes[sw.0]
                .links
                .iter()
                .map(|l| l.remote)
                .filter(|&r| {
                    self.sys.nodes[r.0].node_type() == NodeType::Pci
                        && bcm_gen(device(self, r), 1) == generation
                })
                .collect();
            self.sys.nodes[sw.0].links.retain(|l| !subs.contains(&l.remote));
            for &sub in &subs {
                let links: Vec<Link> = self.sys.nodes[sub.0]
                    .links
                    .iter()
                    .filter(|l| l.remote != sw)
                    .cloned()
                    .collect();
                for l in links {
                    let rem = l.remote;
                    self.sys.nodes[sw.0].links.push(l);
                    if let Some(back) = self.sys.nodes[rem.0].links.iter_mut().find(|bl| bl.remote == sub) {
                        back.remote = sw;
                    }
                }
            }
            if let Some(p) = self.sys.nodes[sw.0].pci.as_mut() {
                // Never merge this switch again.
                p.device |= 0xffff;
            }
            tracing::debug!(target: "oxccl::graph", switch = %self.sys.nodes[sw.0].label(), merged = subs.len(), "Broadcom Gen{generation} PCI switch flattened");
            let before = s;
            let removed_before = subs.iter().filter(|r| r.0 < before).count();
            self.sys.remove_nodes(&subs);
            s -= removed_before;
        }
    }

    /// NCCL's `ncclTopoConnectCpus`: every CPU to every other CPU of its host, with the
    /// inter-socket bandwidth of its kind (`ncclTopoGetInterCpuBw`).
    fn connect_cpus(&mut self) {
        let cpus: Vec<NodeId> = self.sys.ids(NodeType::Cpu);
        for &a in &cpus {
            for &b in &cpus {
                if a == b || self.sys.nodes[a.0].system_id != self.sys.nodes[b.0].system_id {
                    continue;
                }
                let bw = self.sys.nodes[a.0].cpu().map_or(LOC_BW, inter_cpu_bw);
                self.connect(a, b, LinkType::Sys, bw);
            }
        }
    }

    /// NCCL's `ncclTopoSortSystem`: in the PCI tree under each CPU, every node's link up to its
    /// parent goes last (NVLink first, then PCI down, PCI up, SYS).
    fn sort_system(&mut self) {
        for cpu in self.sys.ids(NodeType::Cpu) {
            self.sort_rec(cpu, None, 0);
        }
    }

    fn sort_rec(&mut self, node: NodeId, up: Option<NodeId>, depth: usize) {
        if depth > self.sys.nodes.len() {
            return;
        }
        if let Some(up) = up {
            let links = &mut self.sys.nodes[node.0].links;
            if let Some(i) = links.iter().position(|l| l.remote == up) {
                let l = links.remove(i);
                links.push(l);
            }
        }
        let downs: Vec<NodeId> = self.sys.nodes[node.0]
            .links
            .iter()
            .filter(|l| l.kind == LinkType::Pci && Some(l.remote) != up)
            .map(|l| l.remote)
            .collect();
        for d in downs {
            self.sort_rec(d, Some(node), depth + 1);
        }
    }
}

/// Bandwidth between two CPU sockets in GB/s, by CPU kind (NCCL's `ncclTopoGetInterCpuBw`).

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topo::PathType;

    #[test]
    fn pci_dictionaries() {
        assert_eq!(pci_class_type("0x030200"), NodeType::Gpu);
        assert_eq!(pci_class_type("0x030000"), NodeType::Gpu);
        assert_eq!(pci_class_type("0x020700"), NodeType::Nic);
        assert_eq!(pci_class_type("0x060400"), NodeType::Pci);
        assert_eq!(pci_class_type("0x068000"), NodeType::Nvs);
        assert_eq!(pci_class_type("0x010802"), NodeType::Pci);
        assert_eq!(pci_gen_rate("16 GT/s"), Some(120));
        assert_eq!(pci_gen_rate("32.0 GT/s PCIe"), Some(240));
        assert_eq!(pci_gen_rate("8.0 GT/s PCIe"), Some(60));
        assert_eq!(pci_gen_rate("Unknown"), None);
    }

    #[test]
    fn numbers_and_masks() {
        assert_eq!(parse_int("0x1f"), Some(31));
        assert_eq!(parse_int("-1"), Some(-1));
        assert_eq!(parse_int("16x"), None);
        assert_eq!(
            parse_cpu_mask("00000000,000fffff").unwrap(),
            (0..20).collect::<Vec<_>>()
        );
        assert_eq!(
            parse_cpu_mask("000000ff,fff00000").unwrap(),
            (20..40).collect::<Vec<_>>()
        );
        assert!(parse_cpu_mask("zz").is_none());
    }

    #[test]
    fn links_aggregate_and_sort() {
        let xml = Xml::parse(
            r#"<system version="1">
  <cpu numaid="0" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:01:00.0" class="0x030200" link_speed="16 GT/s" link_width="16">
      <gpu dev="0" sm="80" rank="0" gdr="1">
        <nvlink target="0000:02:00.0" count="2" tclass="0x030200"/>
        <nvlink target="0000:02:00.0" count="1" tclass="0x030200"/>
      </gpu>
    </pci>
    <pci busid="0000:02:00.0" class="0x030200" link_speed="16 GT/s" link_width="16">
      <gpu dev="1" sm="80" rank="1" gdr="1">
        <nvlink target="0000:01:00.0" count="3" tclass="0x030200"/>
      </gpu>
    </pci>
  </cpu>
</system>
"#,
            "t.xml",
        )
        .unwrap();
        let sys = System::from_xml_with(xml, PathOptions::default()).unwrap();
        let g0 = sys.gpu_by_dev(0).unwrap();
        let g1 = sys.gpu_by_dev(1).unwrap();
        let links = &sys.node(g0).links;
        assert_eq!(links.len(), 2);
        assert_eq!(
            (links[0].kind, links[0].remote, links[0].bw),
            (LinkType::Nvl, g1, 60.0)
        );
        assert_eq!((links[1].kind, links[1].bw), (LinkType::Pci, 24.0));
    }

    #[test]
    fn broadcom_switch_levels_are_flattened() {
        // A Gen4 PEX switch (vendor 0x1000, device 0xc010, subsystem 0x1000:0xa064) whose two
        // sub-switches hold one GPU each: after flattening both GPUs hang off the top switch.
        let xml = Xml::parse(
            r#"<system version="1">
  <cpu numaid="0" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:10:00.0" class="0x060400" vendor="0x1000" device="0xc010" subsystem_vendor="0x1000" subsystem_device="0xa064" link_speed="16 GT/s" link_width="16">
      <pci busid="0000:11:00.0" class="0x060400" vendor="0x1000" device="0xc010" subsystem_vendor="0x1000" subsystem_device="0xa064" link_speed="16 GT/s" link_width="16">
        <pci busid="0000:12:00.0" class="0x030200" link_speed="16 GT/s" link_width="16">
          <gpu dev="0" sm="80" rank="0" gdr="1"/>
        </pci>
      </pci>
      <pci busid="0000:13:00.0" class="0x060400" vendor="0x1000" device="0xc010" subsystem_vendor="0x1000" subsystem_device="0xa064" link_speed="16 GT/s" link_width="16">
        <pci busid="0000:14:00.0" class="0x030200" link_speed="16 GT/s" link_width="16">
          <gpu dev="1" sm="80" rank="1" gdr="1"/>
        </pci>
      </pci>
    </pci>
  </cpu>
</system>
"#,
            "bcm.xml",
        )
        .unwrap();
        let sys = System::from_xml_with(xml, PathOptions::default()).unwrap();
        assert_eq!(sys.count(NodeType::Pci), 1);
        let sw = sys.node_by_bus_id(NodeType::Pci, "0000:10:00.0").unwrap();
        let g0 = sys.gpu_by_dev(0).unwrap();
        let g1 = sys.gpu_by_dev(1).unwrap();
        assert!(sys.node(sw).link_to(g0, LinkType::Pci).is_some());
        assert!(sys.node(g1).link_to(sw, LinkType::Pci).is_some());
        // One switch between the GPUs: PIX, not PXB.
        assert_eq!(sys.paths().get(g0, g1).unwrap().kind, PathType::Pix);
    }
}
