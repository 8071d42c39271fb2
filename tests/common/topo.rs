//! Topology fixtures shared by tests/topo.rs and tests/graph.rs: the files in tests/topo/ and
//! what detection would add on the Azure VMs, whose files are PCI-only (GPUs, NVLinks, NICs).
use oxccl::topo::{GpuFill, NetFill, NvLinkFill, Xml, xml::bus_id_to_int};
use std::path::PathBuf;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/topo")
        .join(name)
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
