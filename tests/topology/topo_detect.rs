//! Topology detection (`oxccl::topo::detect`) on fake sysfs/procfs trees with fake NVML data:
//! the XML it builds (exact text, derived by hand from NCCL's rules in `src/graph/xml.cc`), the
//! system graph's paths over it, NCCL's own dump of the 2×H200 VM reproduced from a replica of
//! that VM's sysfs, degradation when entries are missing, InfiniBand ports, and CPU affinity
//! (cpulist/mask parsing, local CPUs of a PCI device, binding threads).
use crate::common;

use oxccl::topo::detect::{
    self, AffinityGuard, CpuSet, DetectOptions, NetSelect, NvmlGpu, NvmlSource, RankGpu,
};
use oxccl::topo::{LinkType, NodeType, PathOptions, PathType, System, Xml, XmlNode};
use std::path::{Path, PathBuf};

/// A fake sysfs + procfs under the temp directory, removed on drop.
struct Fake {
    root: PathBuf,
}

impl Fake {
    fn new(name: &str) -> Fake {
        let root = std::env::temp_dir().join(format!("oxccl-topo-detect-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        std::fs::create_dir_all(root.join("proc/sys/kernel")).unwrap();
        Fake { root }
    }

    fn sys(&self) -> PathBuf {
        self.root.join("sys")
    }

    fn opts(&self) -> DetectOptions {
        let mut o = DetectOptions::rooted(self.sys(), self.root.join("proc"));
        o.host_hash = 0x1234;
        o
    }

    /// Writes `files` (name, content + "\n") into `sys/<rel>`, creating it.
    fn files(&self, rel: &str, files: &[(&str, &str)]) -> PathBuf {
        let d = self.sys().join(rel);
        std::fs::create_dir_all(&d).unwrap();
        for (k, v) in files {
            std::fs::write(d.join(k), format!("{v}\n")).unwrap();
        }
        d
    }

    /// A PCI function at `devices/<rel>` (its last component is its bus id), with the
    /// `bus/pci/devices/<busid>` link and `subsystem` -> `bus/pci`.
    fn pci(&self, rel: &str, files: &[(&str, &str)]) -> PathBuf {
        let d = self.files(&format!("devices/{rel}"), files);
        let bus = Path::new(rel).file_name().unwrap();
        std::os::unix::fs::symlink(&d, self.sys().join("bus/pci/devices").join(bus)).unwrap();
        std::os::unix::fs::symlink(self.sys().join("bus/pci"), d.join("subsystem")).unwrap();
        d
    }

    fn proc_file(&self, rel: &str, text: &str) {
        std::fs::write(self.root.join("proc").join(rel), text).unwrap();
    }

    fn intel_cpu(&self, model: u32) {
        self.proc_file(
            "cpuinfo",
            &format!(
                "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {model}\nmodel name\t: fake\n\n"
            ),
        );
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const GPU_IDS: [(&str, &str); 4] = [
    ("vendor", "0x10de"),
    ("device", "0x2335"),
    ("subsystem_vendor", "0x10de"),
    ("subsystem_device", "0x18bf"),
];

fn with(
    base: &[(&'static str, &'static str)],
    more: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    base.iter().chain(more).copied().collect()
}

/// One socket (NUMA node 0, CPUs 0-15,32-47), a PCI switch (upstream 0000:01:00.0 behind root
/// port 0000:00:01.0, downstream ports 0000:02:00.0 / 0000:02:01.0) holding GPUs 0000:03:00.0
/// and 0000:04:00.0, and a NIC 0000:05:00.0 (eth2, 25 Gb/s) on root port 0000:00:02.0.
fn switch_machine(name: &str) -> Fake {
    let f = Fake::new(name);
    let rc = "pci0000:00";
    f.files(&format!("devices/{rc}"), &[]);
    f.pci(
        &format!("{rc}/0000:00:01.0"),
        &[
            ("class", "0x060400"),
            ("max_link_speed", "8.0 GT/s PCIe"),
            ("max_link_width", "8"),
        ],
    );
    f.pci(
        &format!("{rc}/0000:00:01.0/0000:01:00.0"),
        &[
            ("class", "0x060400"),
            ("vendor", "0x10b5"),
            ("device", "0x8796"),
            ("subsystem_vendor", "0x10b5"),
            ("subsystem_device", "0x8796"),
            ("max_link_speed", "16.0 GT/s PCIe"),
            ("max_link_width", "16"),
            ("numa_node", "0"),
        ],
    );
    let gpu = with(
        &GPU_IDS,
        &[
            ("class", "0x030200"),
            ("max_link_speed", "32.0 GT/s PCIe"),
            ("max_link_width", "16"),
            ("numa_node", "0"),
            ("local_cpulist", "0-15,32-47"),
        ],
    );
    for (down, dev) in [("0000:02:00.0", "0000:03:00.0"), ("0000:02:01.0", "0000:04:00.0")] {
        let d = format!("{rc}/0000:00:01.0/0000:01:00.0/{down}");
        f.pci(
            &d,
            &[
                ("class", "0x060400"),
                ("max_link_speed", "16.0 GT/s PCIe"),
                ("max_link_width", "16"),
            ],
        );
        f.pci(&format!("{d}/{dev}"), &gpu);
    }
    f.pci(
        &format!("{rc}/0000:00:02.0"),
        &[
            ("class", "0x060400"),
            ("max_link_speed", "16.0 GT/s PCIe"),
            ("max_link_width", "16"),
        ],
    );
    let nic = f.pci(
        &format!("{rc}/0000:00:02.0/0000:05:00.0"),
        &[
            ("class", "0x020000"),
            ("vendor", "0x15b3"),
            ("device", "0x101b"),
            ("subsystem_vendor", "0x15b3"),
            ("subsystem_device", "0x0007"),
            ("max_link_speed", "16.0 GT/s PCIe"),
            ("max_link_width", "16"),
            ("numa_node", "0"),
        ],
    );
    let eth = f.files(
        "devices/pci0000:00/0000:00:02.0/0000:05:00.0/net/eth2",
        &[("speed", "25000")],
    );
    std::os::unix::fs::symlink(&nic, eth.join("device")).unwrap();
    std::fs::create_dir_all(f.sys().join("class/net")).unwrap();
    std::os::unix::fs::symlink(&eth, f.sys().join("class/net/eth2")).unwrap();
    f.files("devices/system/node/node0", &[("cpulist", "0-15,32-47")]);
    f.intel_cpu(143);
    f.proc_file("sys/kernel/osrelease", "6.8.0-45-generic\n");
    f
}

/// NVML of the switch machine: NVML's 8-digit-domain bus ids, sm 90, `links` NVLinks each
/// between the two GPUs.
fn switch_nvml(links: usize) -> Vec<NvmlGpu> {
    vec![
        NvmlGpu {
            index: 0,
            bus_id: "00000000:03:00.0".into(),
            sm: Some(90),
            nvlinks: vec!["0000:04:00.0".into(); links],
            c2c: None,
        },
        NvmlGpu {
            index: 1,
            bus_id: "00000000:04:00.0".into(),
            sm: Some(90),
            nvlinks: vec!["0000:03:00.0".into(); links],
            c2c: None,
        },
    ]
}

fn x86() -> bool {
    if std::env::consts::ARCH != "x86_64" {
        skipped!("SKIPPED: the expected <cpu> attributes (vendor, familyid, modelid) are x86_64's");
        return false;
    }
    true
}

/// Expected document, derived by hand from NCCL's `ncclTopoGetXmlFromSys` rules:
/// - GPUs' parent is the directory two levels up (the switch's upstream port 0000:01:00.0: the
///   downstream ports are skipped); the switch's two levels up is `pci0000:00`, not a bus id,
///   so its parent is the CPU of its `numa_node` 0; the NIC's two levels up too.
/// - link_speed: the slower of the device's and its parent directory's `max_link_speed` (GPU:
///   32 vs downstream port 16 → "16.0 GT/s PCIe"; switch: 16 vs root port 8 → "8.0 GT/s
///   PCIe"); link_width the smaller `max_link_width` (switch: min(16, 8) = 8).
/// - affinity: node0's cpulist 0-15,32-47 as a mask: word 1 = cores 32-47 = 0x0000ffff, word 0
///   = cores 0-15 = 0x0000ffff. familyid/modelid 6/143 from cpuinfo. gdr 1: kernel 6.8 ≥ 5.12.
/// - nvlink: 4 links per GPU to the other, tclass read from the target's sysfs class.
/// - net: the socket device eth2 (speed file 25000, guid = dev 0, maxconn 65536, gdr 0).
fn expected_switch_xml(nvlinks: bool) -> String {
    let cpu = r#"<cpu host_hash="0x1234" numaid="0" affinity="0000ffff,0000ffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">"#;
    let gpu_pci = |bus: &str| {
        format!(
            r#"<pci busid="{bus}" class="0x030200" vendor="0x10de" device="0x2335" subsystem_vendor="0x10de" subsystem_device="0x18bf" link_speed="16.0 GT/s PCIe" link_width="16">"#
        )
    };
    let gpu = |dev: u32, peer: &str| {
        if nvlinks {
            format!(
                "        <gpu dev=\"{dev}\" sm=\"90\" rank=\"{dev}\" gdr=\"1\">\n          <nvlink target=\"{peer}\" count=\"4\" tclass=\"0x030200\"/>\n        </gpu>\n"
            )
        } else {
            format!("        <gpu dev=\"{dev}\" sm=\"90\" rank=\"{dev}\" gdr=\"1\"/>\n")
        }
    };
    format!(
        "<system version=\"1\">\n  {cpu}\n    <pci busid=\"0000:01:00.0\" class=\"0x060400\" vendor=\"0x10b5\" device=\"0x8796\" subsystem_vendor=\"0x10b5\" subsystem_device=\"0x8796\" link_speed=\"8.0 GT/s PCIe\" link_width=\"8\">\n      {}\n{}      </pci>\n      {}\n{}      </pci>\n    </pci>\n    <pci busid=\"0000:05:00.0\" class=\"0x020000\" vendor=\"0x15b3\" device=\"0x101b\" subsystem_vendor=\"0x15b3\" subsystem_device=\"0x0007\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">\n      <nic>\n        <net name=\"eth2\" dev=\"0\" latency=\"0\" speed=\"25000\" port=\"0\" guid=\"0x0\" maxconn=\"65536\" gdr=\"0\"/>\n      </nic>\n    </pci>\n  </cpu>\n</system>\n",
        gpu_pci("0000:03:00.0"),
        gpu(0, "0000:04:00.0"),
        gpu_pci("0000:04:00.0"),
        gpu(1, "0000:03:00.0"),
    )
}

fn system(xml: Xml) -> System {
    System::from_xml_with(xml, PathOptions::default()).unwrap()
}

#[test]
fn switch_tree_with_nvlinks_gives_nccls_xml_and_nvl_paths() {
    if !x86() {
        return;
    }
    let f = switch_machine("nvl");
    let mut opts = f.opts();
    opts.nets = NetSelect::SocketNamed(vec!["eth2".into()]);
    let nvml = switch_nvml(4);
    // Every GPU NVML lists (ranks in NVML order), as `oxccl topo` does.
    let xml = detect::detect(&opts, Some(&nvml as &dyn NvmlSource), None);
    assert_eq!(xml.to_xml_string(), expected_switch_xml(true));
    // The same GPUs given as a communicator's ranks (CUDA's uppercase bus ids) build the same.
    let gpus: Vec<RankGpu> = [(0, "0000:03:00.0"), (1, "0000:04:00.0")]
        .iter()
        .map(|&(r, b)| RankGpu {
            rank: r,
            dev: r,
            bus_id: b.to_uppercase(),
            sm: None,
        })
        .collect();
    assert_eq!(
        detect::detect(&opts, Some(&nvml as &dyn NvmlSource), Some(&gpus)).to_xml_string(),
        expected_switch_xml(true)
    );

    let sys = system(xml);
    let (g0, g1) = (sys.gpu_by_dev(0).unwrap(), sys.gpu_by_dev(1).unwrap());
    let p = sys.paths().get(g0, g1).unwrap();
    // 4 NVLinks of sm90 at 20.6 GB/s each (NCCL's SM90_NVLINK_BW).
    assert_eq!((p.kind, p.bw), (PathType::Nvl, 4.0 * 20.6));
    assert_eq!(sys.node(g0).link_to(g1, LinkType::Nvl).unwrap().bw, 4.0 * 20.6);
    assert_eq!(sys.count(NodeType::Pci), 1);
    assert_eq!(sys.count(NodeType::Net), 1);
}

#[test]
fn switch_tree_without_nvlinks_is_pix_through_the_switch() {
    if !x86() {
        return;
    }
    let f = switch_machine("pix");
    let mut opts = f.opts();
    opts.nets = NetSelect::SocketNamed(vec!["eth2".into()]);
    let nvml = switch_nvml(0);
    let xml = detect::detect(&opts, Some(&nvml as &dyn NvmlSource), None);
    assert_eq!(xml.to_xml_string(), expected_switch_xml(false));
    let sys = system(xml);
    let (g0, g1) = (sys.gpu_by_dev(0).unwrap(), sys.gpu_by_dev(1).unwrap());
    let cpu = sys.ids(NodeType::Cpu)[0];
    let net = sys.net_by_dev(0).unwrap();
    // GPU0 -> switch -> GPU1: one PCI switch, PIX; each hop 16 GT/s x16 = 16 × 120 / 80 = 24 GB/s.
    let p = sys.paths().get(g0, g1).unwrap();
    assert_eq!((p.kind, p.bw, p.count()), (PathType::Pix, 24.0, 2));
    // GPU0 -> switch -> CPU: through the host bridge, PHB, bottleneck the switch's 8 GT/s x8
    // uplink = 8 × 60 / 80 = 6 GB/s.
    let p = sys.paths().get(g0, cpu).unwrap();
    assert_eq!((p.kind, p.bw), (PathType::Phb, 6.0));
    // GPU0 -> NET: through the CPU (PHB), bottleneck the 25 Gb/s port = 25000 / 8000 GB/s.
    let p = sys.paths().get(g0, net).unwrap();
    assert_eq!((p.kind, p.bw), (PathType::Phb, 25000.0 / 8000.0));
}

/// A replica of the 2×H200 VM's sysfs as NCCL 2.28.9 saw it (tests/topo/h200x2-nccl-topo.xml):
/// both GPUs directly on the root complex with `numa_node` -1 and no `max_link_width`, no NUMA
/// node directory, eth0 on virtio (not PCI), an Intel family 6 model 207 CPU, and NVML reporting
/// 18 NVLinks per GPU to the NVSwitch the VM does not show (`fffffff:ff:ff.0`).
#[test]
fn h200_vm_replica_reproduces_nccls_dump() {
    if !x86() {
        return;
    }
    let f = Fake::new("h200");
    let gpu = with(
        &GPU_IDS,
        &[
            ("class", "0x030200"),
            ("max_link_speed", "32.0 GT/s PCIe"),
            ("numa_node", "-1"),
        ],
    );
    f.files("devices/pci0000:00", &[]);
    for b in ["0000:00:06.0", "0000:00:07.0"] {
        f.pci(&format!("pci0000:00/{b}"), &gpu);
    }
    let virtio = f.files("devices/pci0000:00/0000:00:05.0/virtio1", &[]);
    std::fs::create_dir_all(f.sys().join("bus/virtio")).unwrap();
    std::os::unix::fs::symlink(f.sys().join("bus/virtio"), virtio.join("subsystem")).unwrap();
    let eth = f.files(
        "devices/pci0000:00/0000:00:05.0/virtio1/net/eth0",
        &[("speed", "-1")],
    );
    std::os::unix::fs::symlink(&virtio, eth.join("device")).unwrap();
    std::fs::create_dir_all(f.sys().join("class/net")).unwrap();
    std::os::unix::fs::symlink(&eth, f.sys().join("class/net/eth0")).unwrap();
    f.intel_cpu(207);
    f.proc_file("sys/kernel/osrelease", "6.8.0-1015-gcp\n");
    let nvml: Vec<NvmlGpu> = (0..2)
        .map(|i| NvmlGpu {
            index: i,
            bus_id: format!("00000000:00:0{}.0", 6 + i),
            sm: Some(90),
            nvlinks: vec!["fffffff:ff:ff.0".into(); 18],
            c2c: None,
        })
        .collect();
    let mut opts = f.opts();
    opts.host_hash = 0xf161_3fbe_d751_4379; // the dump's host_hash
    opts.nets = NetSelect::SocketNamed(vec!["eth0".into()]);
    let ours = detect::detect(&opts, Some(&nvml as &dyn NvmlSource), None);

    let dump = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/topo/h200x2-nccl-topo.xml");
    let mut nccl = Xml::from_file(&dump).unwrap();
    // NCCL fuses one XML per rank: rank 1's GPU lands after rank 0's NIC. In one process we
    // detect both GPUs first, then the NIC: the same elements, the <nic> last.
    let cpu = &mut nccl.root.subs[0];
    let nic = cpu.subs.iter().position(|s| s.name == "nic").unwrap();
    let n: XmlNode = cpu.subs.remove(nic);
    cpu.subs.push(n);
    assert_eq!(ours.to_xml_string(), nccl.to_xml_string());

    let sys = system(ours);
    let (g0, g1) = (sys.gpu_by_dev(0).unwrap(), sys.gpu_by_dev(1).unwrap());
    let p = sys.paths().get(g0, g1).unwrap();
    // Through the NVSwitch: NVL, 18 × 20.6 GB/s.
    assert_eq!((p.kind, p.count()), (PathType::Nvl, 2));
    assert!((p.bw - 18.0 * 20.6).abs() < 1e-9, "{}", p.bw);
    assert_eq!(sys.count(NodeType::Nvs), 1);
}

#[test]
fn missing_entries_degrade_without_errors() {
    let f = Fake::new("missing");
    // A switch without class or numa_node, a GPU without link files, no cpuinfo, no NUMA dir.
    f.files("devices/pci0000:00", &[]);
    f.pci("pci0000:00/0000:00:01.0", &[]);
    f.pci("pci0000:00/0000:00:01.0/0000:01:00.0", &[]);
    f.pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", &[]);
    f.pci(
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
        &[("vendor", "0x10de"), ("class", "0x030200")],
    );
    let opts = f.opts();

    // No NVML: the GPU is found through sysfs but has no <gpu> (its sm is unknown).
    let xml = detect::detect(&opts, None, None);
    let cpu = &xml.root.subs[0];
    assert_eq!(cpu.attr("numaid"), Some("-1"));
    assert_eq!(cpu.attr("affinity"), None);
    let sw = &cpu.subs[0];
    // Class unknown: a bridge is assumed; no speed/width anywhere: "" and 0 (Gen3 x16 assumed).
    assert_eq!(
        (
            sw.attr("busid"),
            sw.attr("class"),
            sw.attr("link_speed"),
            sw.attr("link_width")
        ),
        (Some("0000:01:00.0"), Some("0x060400"), Some(""), Some("0"))
    );
    assert_eq!(sw.subs[0].attr("busid"), Some("0000:03:00.0"));
    assert!(sw.subs[0].subs.is_empty());
    if std::env::consts::ARCH == "x86_64" {
        // Vendor unknown without cpuinfo: empty, and no family/model.
        assert_eq!((cpu.attr("vendor"), cpu.attr("familyid")), (Some(""), None));
    }
    let sys = system(xml);
    assert_eq!((sys.count(NodeType::Gpu), sys.count(NodeType::Pci)), (0, 1));

    // A communicator's GPU with sm from CUDA, plus one sysfs does not know at all: both become
    // GPUs; the unknown one under CPU -1 with an empty link speed and width 0, read as Gen3 x16.
    let gpus = [
        RankGpu {
            rank: 0,
            dev: 0,
            bus_id: "0000:03:00.0".into(),
            sm: Some(80),
        },
        RankGpu {
            rank: 1,
            dev: 1,
            bus_id: "0000:9a:00.0".into(),
            sm: Some(80),
        },
    ];
    let xml = detect::detect(&opts, None, Some(&gpus));
    let lost = xml.find_pci("0000:9a:00.0").unwrap();
    assert_eq!(
        (
            lost.attr("class"),
            lost.attr("link_speed"),
            lost.attr("link_width")
        ),
        (Some("0x03"), Some(""), Some("0"))
    );
    assert_eq!(
        lost.sub("gpu").unwrap().attrs,
        [("dev", "1"), ("sm", "80"), ("rank", "1"), ("gdr", "0")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    let sys = system(xml);
    assert_eq!(sys.count(NodeType::Gpu), 2);
    let g1 = sys.gpu_by_rank(1).unwrap();
    // Gen3 x16 = 16 × 60 / 80 = 12 GB/s (NCCL's default for an unknown speed).
    assert_eq!(sys.node(g1).links[0].bw, 12.0);
    // Both GPUs hang under CPU -1 (sysfs gives no NUMA node): PHB between them.
    let g0 = sys.gpu_by_rank(0).unwrap();
    assert_eq!(sys.paths().get(g0, g1).unwrap().kind, PathType::Phb);

    // Nothing at all (a sysfs root that does not exist): an empty <system>.
    let empty = DetectOptions::rooted(f.root.join("nowhere"), f.root.join("nowhere"));
    assert_eq!(
        detect::detect(&empty, None, None).to_xml_string(),
        "<system version=\"1\"/>\n"
    );
}

#[test]
fn infiniband_ports_become_nets_under_their_pci_device() {
    if !x86() {
        return;
    }
    let f = switch_machine("ib");
    let nic = f.sys().join("devices/pci0000:00/0000:00:02.0/0000:05:00.0");
    let hca = f.files(
        "class/infiniband/mlx5_0",
        &[
            ("sys_image_guid", "b859:9f03:00d4:5a4e"),
            ("node_guid", "b859:9f03:00d4:5a4f"),
        ],
    );
    std::os::unix::fs::symlink(&nic, hca.join("device")).unwrap();
    f.files(
        "class/infiniband/mlx5_0/ports/1",
        &[("state", "4: ACTIVE"), ("rate", "200 Gb/sec (4X HDR)")],
    );
    f.files(
        "class/infiniband/mlx5_1/ports/1",
        &[("state", "1: DOWN"), ("rate", "10 Gb/sec (4X SDR)")],
    );
    let mut opts = f.opts();
    opts.nets = NetSelect::Ib;
    let xml = detect::detect(&opts, Some(&switch_nvml(0) as &dyn NvmlSource), None);
    let pci = xml.find_pci("0000:05:00.0").unwrap();
    let nets: Vec<&XmlNode> = pci.sub("nic").unwrap().subs_named("net").collect();
    // One active port (mlx5_1's is down): 200 Gb/s = 200000 Mb/s, guid = sys_image_guid,
    // gdr 1 (kernel 6.8 has DMA-BUF).
    assert_eq!(nets.len(), 1);
    assert_eq!(
        nets[0].attrs,
        [
            ("name", "mlx5_0"),
            ("dev", "0"),
            ("latency", "0"),
            ("speed", "200000"),
            ("port", "1"),
            ("guid", "0xb8599f0300d45a4e"),
            ("maxconn", "131072"),
            ("gdr", "1"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    let sys = system(xml);
    let net = sys.net_by_dev(0).unwrap();
    assert_eq!(sys.node(net).net().unwrap().bw, 25.0);
}

#[test]
fn topology_file_elements_keep_their_attributes() {
    // A partial file (as providers ship) gives the GPU's PCI element with its own link speed:
    // detection fills only what it lacks (class is refreshed from sysfs, as NCCL does).
    let f = switch_machine("merge");
    let mut xml = Xml::parse(
        r#"<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="0000:03:00.0" class="0x030000" link_speed="8.0 GT/s PCIe" link_width="4"/>
  </cpu>
</system>
"#,
        "partial.xml",
    )
    .unwrap();
    let nvml = switch_nvml(0);
    detect::detect_into(&mut xml, &f.opts(), Some(&nvml as &dyn NvmlSource), None);
    let g = xml.find_pci("0000:03:00.0").unwrap();
    assert_eq!(
        (
            g.attr("class"),
            g.attr("link_speed"),
            g.attr("link_width"),
            g.attr("vendor")
        ),
        (Some("0x030200"), Some("8.0 GT/s PCIe"), Some("4"), Some("0x10de"))
    );
    assert_eq!(xml.root.subs[0].attr("affinity"), Some("0000ffff"));
    // The file's GPU stays under the file's CPU; the other GPU comes from sysfs, with its switch.
    assert_eq!(xml.root.subs.len(), 1);
    assert!(xml.find_pci("0000:01:00.0").unwrap().sub("pci").is_some());
    assert_eq!(system(xml).count(NodeType::Gpu), 2);
}

#[test]
fn cpu_lists_and_masks() {
    // "0-15,32-47": 16 + 16 cores; as a mask word 1 = 0x0000ffff (32-47), word 0 = 0x0000ffff.
    let s = CpuSet::parse_list("0-15,32-47\n").unwrap();
    assert_eq!(s.cores(), (0..16).chain(32..48).collect::<Vec<_>>());
    assert_eq!(s.to_mask(), "0000ffff,0000ffff");
    assert_eq!(s.to_list(), "0-15,32-47");
    assert_eq!(CpuSet::parse_list("3,1,2-2, 7").unwrap().cores(), [1, 2, 3, 7]);
    assert_eq!(CpuSet::parse_list("5").unwrap().to_mask(), "00000020");
    assert!(CpuSet::parse_list("").unwrap().is_empty());
    assert_eq!(CpuSet::parse_list("\n").unwrap().to_mask(), "00000000");
    for bad in ["3-1", "x", "1-", "0-3,a"] {
        let e = CpuSet::parse_list(bad).unwrap_err().to_string();
        assert!(e.contains(&format!("{bad:?}")), "{e}");
    }
    // An NCCL affinity mask (azure-ndv5-topo.xml, NUMA node 0): word 0 empty, word 1 = 0xffff0000
    // (cores 48-63), word 2 = 0xffffffff (cores 64-95).
    let m = CpuSet::parse_mask("ffffffff,ffff0000,00000000").unwrap();
    assert_eq!(m.cores(), (48..96).collect::<Vec<_>>());
    assert_eq!(m.to_mask(), "ffffffff,ffff0000,00000000");
    assert!(CpuSet::parse_mask("ffff,zz").is_err());
    assert_eq!(s.intersect(&CpuSet::from_cores([15, 16, 40])).cores(), [15, 40]);
}

#[test]
fn local_cpus_of_pci_devices() {
    let f = switch_machine("local");
    // local_cpulist of the GPU.
    assert_eq!(
        detect::pci_local_cpus(&f.sys(), "0000:03:00.0")
            .unwrap()
            .to_list(),
        "0-15,32-47"
    );
    // Without local_cpulist: the cpulist of its numa_node (the NIC: node 0).
    assert_eq!(
        detect::pci_local_cpus(&f.sys(), "0000:05:00.0")
            .unwrap()
            .to_list(),
        "0-15,32-47"
    );
    // The local_cpus mask when there is no list.
    let d = f.sys().join("bus/pci/devices/0000:01:00.0");
    std::fs::write(d.join("local_cpus"), "00000000,000000f0\n").unwrap();
    assert_eq!(
        detect::pci_local_cpus(&f.sys(), "0000:01:00.0")
            .unwrap()
            .to_list(),
        "4-7"
    );
    // Unknown: no NUMA node (-1 / missing) or no such device.
    std::fs::write(d.join("local_cpus"), "\n").unwrap();
    std::fs::write(d.join("numa_node"), "-1\n").unwrap();
    assert_eq!(detect::pci_local_cpus(&f.sys(), "0000:01:00.0"), None);
    assert_eq!(detect::pci_local_cpus(&f.sys(), "0000:00:01.0"), None);
    assert_eq!(detect::pci_local_cpus(&f.sys(), "0000:7f:00.0"), None);
    assert_eq!(detect::pci_local_cpus(&f.sys(), "not-a-bus-id"), None);
}

#[test]
fn binding_threads_and_the_init_guard() {
    std::thread::spawn(|| {
        let before = detect::thread_affinity().expect("sched_getaffinity");
        assert!(!before.is_empty());
        let one = CpuSet::from_cores([*before.cores().last().unwrap()]);
        {
            let guard = AffinityGuard::bind(Some(one.clone()));
            assert_eq!(guard.cpus(), Some(&one));
            assert_eq!(detect::thread_affinity().as_ref(), Some(&one));
            assert_eq!(detect::helper_affinity().as_ref(), Some(&one));
            // A helper thread binds to what its starter hands it (it would inherit the mask
            // anyway; binding makes it explicit for threads started elsewhere).
            let near = detect::helper_affinity();
            let seen = std::thread::spawn(move || {
                detect::bind_helper_thread(near.as_ref());
                (detect::thread_affinity(), detect::helper_affinity())
            })
            .join()
            .unwrap();
            assert_eq!(seen, (Some(one.clone()), None));
        }
        // Dropping the guard restores the affinity and clears the hint.
        assert_eq!(detect::thread_affinity().as_ref(), Some(&before));
        assert_eq!(detect::helper_affinity(), None);
        // A guard without a set changes nothing.
        let g = AffinityGuard::bind(None);
        assert_eq!((g.cpus(), detect::helper_affinity()), (None, None));
        drop(g);
        assert_eq!(detect::thread_affinity().as_ref(), Some(&before));
        // Bad sets are refused with the accepted range.
        let e = detect::bind_thread(&CpuSet::default()).unwrap_err().to_string();
        assert!(e.contains("0..1024"), "{e}");
        assert!(detect::bind_thread(&CpuSet::from_cores([5000])).is_err());
        // GPUs unknown to this machine's sysfs: no binding.
        assert_eq!(AffinityGuard::near_gpus(&["0000:ee:00.0"]).cpus(), None);
        assert_eq!(detect::bind_near_gpu("0000:ee:00.0"), None);
    })
    .join()
    .unwrap();
}

#[test]
fn dump_file_on_communicator_init() {
    let env = common::env::Env::clean(&["TOPO_DUMP_FILE", "TOPO_DUMP_FILE_RANK", "NET"]);
    let out = std::env::temp_dir().join(format!("oxccl-topo-detect-dump-{}.xml", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let gpus = [RankGpu {
        rank: 0,
        dev: 0,
        bus_id: "0000:ee:00.0".into(),
        sm: Some(90),
    }];
    let path = out.to_str().unwrap();
    // Not the dump rank: nothing written.
    env.set(&[("NCCL_TOPO_DUMP_FILE", path), ("NCCL_TOPO_DUMP_FILE_RANK", "1")]);
    drop(detect::comm_init_hook(&gpus).unwrap());
    assert!(!out.exists());
    // A bad rank value is an error naming the variable.
    env.set(&[("NCCL_TOPO_DUMP_FILE", path), ("NCCL_TOPO_DUMP_FILE_RANK", "x")]);
    let e = detect::comm_init_hook(&gpus).unwrap_err().to_string();
    assert!(e.contains("NCCL_TOPO_DUMP_FILE_RANK"), "{e}");
    // Rank 0 (the default) writes this machine's detection of the given GPU: its <pci> (this
    // machine has no such device: under CPU -1) with the <gpu> of rank 0, sm 90 from CUDA.
    env.set(&[("NCCL_TOPO_DUMP_FILE", path)]);
    drop(detect::comm_init_hook(&gpus).unwrap());
    let xml = Xml::from_file(&out).unwrap();
    let gpu = xml.find_pci("0000:ee:00.0").unwrap().sub("gpu").unwrap();
    assert_eq!((gpu.attr("rank"), gpu.attr("sm")), (Some("0"), Some("90")));
    assert_eq!(
        System::from_xml_with(xml, PathOptions::default())
            .unwrap()
            .count(NodeType::Gpu),
        1
    );
    let _ = std::fs::remove_file(&out);
}

/// GPU machine: detection through the real NVML and sysfs. Every GPU NVML lists gets a
/// `<gpu>` with its `sm`; on the 2×H200 VM (GPUs at 0000:00:06.0 and 0000:00:07.0) the CPU and
/// the GPUs' `<pci>` subtrees must equal NCCL's dump (tests/topo/h200x2-nccl-topo.xml) but for
/// `host_hash` (NCCL hashes the host differently).
#[test]
fn gpu_detection_matches_nccls_dump_on_the_h200_machine() {
    let Some(nvml) = detect::NvmlProbe::load() else {
        skipped!("SKIPPED: NVML (libnvidia-ml.so.1) not available: no GPU to detect");
        return;
    };
    let devices = nvml.devices();
    if devices.is_empty() {
        skipped!("SKIPPED: NVML lists no GPU");
        return;
    }
    let _env = common::env::shared();
    let xml = detect::detect_local(None);
    eprintln!("detected topology:\n{xml}");
    for (i, bus) in &devices {
        let b = detect::normalize_bus_id(bus).unwrap();
        let g = xml.find_pci(&b).and_then(|p| p.sub("gpu"));
        let g = g.unwrap_or_else(|| panic!("GPU {i} ({bus}) has no <gpu> element"));
        assert_eq!(g.attr("dev"), Some(i.to_string().as_str()));
        assert!(g.attr("sm").is_some());
    }
    let sys = system(xml.clone());
    assert_eq!(sys.count(NodeType::Gpu), devices.len());
    let buses: Vec<String> = devices
        .iter()
        .map(|(_, b)| detect::normalize_bus_id(b).unwrap())
        .collect();
    if buses != ["0000:00:06.0", "0000:00:07.0"] {
        skipped!("SKIPPED: not the 2xH200 VM of tests/topo/h200x2-nccl-topo.xml (GPUs at {buses:?})");
        return;
    }
    let dump = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/topo/h200x2-nccl-topo.xml");
    let nccl = Xml::from_file(&dump).unwrap();
    let strip = |x: &Xml| {
        let cpu = x.root.sub("cpu").unwrap();
        let attrs: Vec<_> = cpu
            .attrs
            .iter()
            .filter(|(k, _)| k != "host_hash")
            .cloned()
            .collect();
        let pcis: Vec<XmlNode> = cpu.subs_named("pci").map(canonical).collect();
        (attrs, pcis)
    };
    assert_eq!(strip(&xml), strip(&nccl));
}

/// `n` without source line numbers (a parsed file has them, a detected tree does not) and with
/// the NVSwitch pseudo bus id of NVLink targets written one way: NVML reports
/// `ffffffff:ff:ff.0`, NCCL's dump on the 2×H200 VM shows `fffffff:ff:ff.0` (seen on the GPU
/// machine on 2026-11-29); both name "the NVSwitch" (`tclass 0x068000`) and read back alike.
fn canonical(n: &XmlNode) -> XmlNode {
    let mut c = n.clone();
    c.line = 0;
    if c.name == "nvlink" && c.attr("tclass") == Some("0x068000") {
        for (k, v) in c.attrs.iter_mut() {
            if k == "target"
                && v.chars()
                    .all(|ch| ch == 'f' || ch == ':' || ch == '.' || ch == '0')
            {
                *v = "nvswitch".into();
            }
        }
    }
    c.subs = n.subs.iter().map(canonical).collect();
    c
}
