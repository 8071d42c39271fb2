//! The network devices topology detection lists as `<net>` elements: the socket interface
//! oxccl's NET transport picks, or the active InfiniBand ports, and whether GPU Direct RDMA can
//! work (NCCL's `ncclTopoFillNet` and the NIC attributes of `ncclTopoPopulateNics`, in
//! `src/graph/xml.cc` and `src/graph/topo.cc`; the properties are what the socket and IB
//! plugins' `getProperties` return).
use super::{Detector, T, at_mut, find_path, leading_f32};
use crate::topo::xml::{Xml, XmlNode};
use std::path::PathBuf;

/// `maxconn` of a socket network device (NCCL's `ncclNetSocket` `maxComms`).
const SOCKET_MAXCONN: u32 = 65536;
/// `maxconn` assumed for an InfiniBand device (a ConnectX `max_qp`; sysfs does not give it).
const IB_MAXCONN: u32 = 131072;
/// Speed NCCL's socket network assumes when the interface's speed is unknown, Mb/s.
const SOCKET_DEFAULT_SPEED: i64 = 10000;

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

impl Detector<'_> {
    /// Whether GPU Direct RDMA can work here: a peer-memory kernel module is loaded
    /// (`nvidia_peermem` / `nv_peer_mem`, what NCCL's IB plugin checks) or the kernel has
    /// DMA-BUF (5.12 and later, `sys/kernel/osrelease`).
    pub(super) fn gdr_support(&self) -> bool {
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
    pub(super) fn net_devices(&self) -> Vec<NetDevice> {
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
    pub(super) fn fill_net(&self, xml: &mut Xml, dev: usize, net: &NetDevice) {
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
