//! Topology fixtures: the files in tests/topo/, what detection would add on the Azure VMs, whose
//! files are PCI-only (GPUs, NVLinks, NICs), and the rings the graph search finds in them.
use oxccl::topo::{GpuFill, NetFill, NvLinkFill, Xml, xml::bus_id_to_int};
use std::path::PathBuf;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/topo")
        .join(name)
}
/// The searched rings of `nvlink-mesh-4gpu-topo.xml` (4 GPUs in an NVLink mesh of unequal link
/// counts), from `oxccl topo` (the graph search of tests/topology/graph.rs): 6 channels, not all in rank
/// order; communicators with more channels repeat them (channel c uses ring c % 6).
pub const MESH_RINGS: [[usize; 4]; 6] = [
    [0, 1, 2, 3],
    [0, 1, 2, 3],
    [0, 1, 3, 2],
    [0, 3, 2, 1],
    [0, 3, 2, 1],
    [0, 2, 3, 1],
];

/// `ring` rotated to start at `rank`: the user ranks NCCL's `setupChannel` gives `rank`.
pub fn rotate(ring: &[usize], rank: usize) -> Vec<usize> {
    let i = ring.iter().position(|&r| r == rank).unwrap();
    ring[i..].iter().chain(&ring[..i]).copied().collect()
}

pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}
/// Bus ids of the `<pci>` elements whose class starts with `class`, in bus-id order.
pub fn pci_of_class(xml: &Xml, class: &str) -> Vec<String> {
    fn rec(n: &oxccl::topo::XmlNode, class: &str, out: &mut Vec<String>) {
        if n.name == "pci"
            && n.attr("class").is_some_and(|c| c.starts_with(class))
            && let Some(b) = n.attr("busid")
        {
            out.push(b.to_string());
        }
        for s in &n.subs {
            rec(s, class, out);
        }
    }
    let mut out = Vec::new();
    rec(&xml.root, class, &mut out);
    out.sort_by_key(|b| bus_id_to_int(b));
    out
}
/// What detection adds on an Azure VM: GPUs (class 0x03...) get dev = rank = their position in
/// bus-id order (CUDA's PCI order), compute capability `sm`, GDR, and the NVLinks `nvlinks(dev)`;
/// IB NICs (class 0x02...) get a `<net>` `mlx5_<i>` with dev = i in bus-id order, `speed_mbps`,
/// GDR `net_gdr`. Returns the GPU and NIC bus ids in dev order.
pub fn fill_azure(
    xml: &mut Xml,
    sm: u32,
    nvlinks: &dyn Fn(usize, &[String]) -> Vec<NvLinkFill>,
    speed_mbps: u64,
    net_gdr: bool,
) -> (Vec<String>, Vec<String>) {
    let gpus = pci_of_class(xml, "0x03");
    let nics = pci_of_class(xml, "0x02");
    for (dev, bus) in gpus.iter().enumerate() {
        let fill = GpuFill {
            dev: dev as i32,
            rank: dev as i32,
            sm,
            gdr: true,
            nvlinks: nvlinks(dev, &gpus),
        };
        xml.fill_gpu(bus, &fill).unwrap();
    }
    for (dev, bus) in nics.iter().enumerate() {
        let fill = NetFill {
            name: format!("mlx5_{dev}"),
            dev: dev as i32,
            speed_mbps,
            port: 1,
            guid: 0x1000 + dev as u64,
            gdr: net_gdr,
            maxconn: 131072,
        };
        xml.fill_net(bus, &fill).unwrap();
    }
    (gpus, nics)
}
/// NVLinks between V100s of a DGX-1 hybrid cube-mesh, as `nvidia-smi topo -m` shows them on a
/// DGX-1V (NV1/NV2; 0 = no NVLink; each GPU has 6 links). An assumption about the NDv2 VM
/// (documented as NVLink hybrid cube-mesh), with CUDA devices in bus-id order; not in the file.
pub const CUBE_MESH: [[u32; 8]; 8] = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
];

/// The NVLinks of GPU `dev` in the DGX-1V hybrid cube mesh ([`CUBE_MESH`]), for [`fill_azure`]
/// on NDv2 (`bus` = the GPUs' bus ids in dev order).
pub fn cube_mesh_nvlinks(dev: usize, bus: &[String]) -> Vec<NvLinkFill> {
    (0..8)
        .filter(|&j| CUBE_MESH[dev][j] > 0)
        .map(|j| NvLinkFill::gpu(&bus[j], CUBE_MESH[dev][j]))
        .collect()
}

/// The system of fixture `name` (tests/topo/), paths computed with NCCL's defaults (no
/// environment variables read).
pub fn load(name: &str) -> oxccl::topo::System {
    let xml = Xml::from_file(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    oxccl::topo::System::from_xml_with(xml, oxccl::topo::PathOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Fixtures written for the graph search (tests/topology/graph.rs), with what they model:
/// - `dgx-h100-topo.xml`: DGX-H100-like, 8 × H100 (sm90) with 18 NVLinks each to 4 NVSwitches
///   (5 + 4 + 4 + 5 links, NCCL merges them into one NVS node), 4 PCIe Gen5 switches of 2 GPUs,
///   2 Sapphire Rapids sockets, no compute NICs.
/// - `pcie-8gpu-2socket-topo.xml`: 8 PCIe GPUs (sm89, no NVLink, Gen4 x16 = 24 GB/s), 2 per PCIe
///   Gen4 switch, 2 switches per Sapphire Rapids socket (22 GB/s between sockets).
/// - `nvlink-mesh-4gpu-topo.xml`: 4 × sm80 GPUs, all pairs NVLinked with unequal counts
///   ([`MESH4`]), 6 links (120 GB/s) per GPU, one Ice Lake CPU.
/// - `dgx-h100-net-node0-topo.xml`, `dgx-h100-net-node1-topo.xml`: the two nodes of a 16-GPU job
///   (ranks 0-7 and 8-15, distinct `host_hash`), as NCCL models several nodes: each rank's
///   system holds its own node only, the network reached through NET nodes. Each node: 8 × H100
///   on 4 NVSwitches (18 links), each GPU sharing a PCIe Gen5 switch (48 GB/s) with one 400 Gb/s
///   NIC (50 GB/s, own guid), 4 switches per socket.
pub const GRAPH_FIXTURES: [&str; 5] = [
    "dgx-h100-topo.xml",
    "pcie-8gpu-2socket-topo.xml",
    "nvlink-mesh-4gpu-topo.xml",
    "dgx-h100-net-node0-topo.xml",
    "dgx-h100-net-node1-topo.xml",
];

/// NVLink counts between the GPUs of `nvlink-mesh-4gpu-topo.xml` (symmetric).
pub const MESH4: [[u32; 4]; 4] = [[0, 3, 1, 2], [3, 0, 2, 1], [1, 2, 0, 3], [2, 1, 3, 0]];
