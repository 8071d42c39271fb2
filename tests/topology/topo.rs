//! Topology XML, system graph and paths on real topology files (`tests/topo/*.xml`, copied from
//! shared/data/topo; see tests/topo/README.md for their sources).
//!
//! Every expected value below says how it was derived: from the file's attributes and NCCL's
//! model constants (`src/graph/topo.h`: SM90 NVLink 20.6 GB/s per link, SM80 and SM70 20.0;
//! PCI bandwidth = lanes × per-lane rate / 80 with Gen3 60, Gen4 120, Gen5 240 (100 Mb/s units);
//! NET bandwidth = speed (Mb/s) / 8000; CPU-CPU: Skylake 10, Sapphire Rapids 22, Emerald Rapids
//! 40, AMD 16), and NCCL's path rules (`src/graph/paths.cc`).
//!
//! The three Azure files are partial (PCI tree only): on the VM, NCCL's detection adds the
//! `<gpu>` (with NVLinks) and `<nic><net>` elements. The tests add them the same way through
//! `Xml::fill_gpu` / `Xml::fill_net`, with what each VM type is documented to have; those
//! inputs are stated at each fill and are assumptions, not contents of the files.
use crate::common;

use common::topo::{CUBE_MESH, close, cube_mesh_nvlinks, fill_azure, fixture};
use oxccl::ResultCode;
use oxccl::topo::{
    CpuModel, CpuVendor, LinkType, NodeId, NodeType, NvLinkFill, PathOptions, PathType, System, Xml,
};
use std::time::{Duration, Instant};

const FIXTURES: [&str; 5] = [
    "h200x2-nccl-topo.xml",
    "h200x2-nccl-graph.xml",
    "azure-ndv2-topo.xml",
    "azure-ndv4-topo.xml",
    "azure-ndv5-topo.xml",
];

macro_rules! assert_bw {
    ($a:expr, $b:expr) => {{
        let (a, b): (f64, f64) = ($a, $b);
        assert!(close(a, b), "bandwidth {a} GB/s, expected {b} GB/s");
    }};
    ($a:expr, $b:expr, $($t:tt)+) => {{
        let (a, b): (f64, f64) = ($a, $b);
        assert!(close(a, b), "bandwidth {a} GB/s, expected {b} GB/s: {}", format!($($t)+));
    }};
}

fn gpu(sys: &System, dev: i32) -> NodeId {
    sys.gpu_by_dev(dev).unwrap_or_else(|| panic!("no GPU dev {dev}"))
}

fn net(sys: &System, dev: i32) -> NodeId {
    sys.net_by_dev(dev).unwrap_or_else(|| panic!("no NET dev {dev}"))
}

fn defaults() -> PathOptions {
    PathOptions::default()
}

// ---------------------------------------------------------------------------------------------
// XML reading and writing

#[test]
fn every_fixture_round_trips() {
    for name in FIXTURES {
        let path = fixture(name);
        let text = std::fs::read_to_string(&path).unwrap();
        let xml = Xml::from_file(&path).unwrap();
        let written = xml.to_xml_string();
        let again = Xml::parse(&written, "written").unwrap();
        assert_eq!(
            again.root, xml.root,
            "{name}: parse -> write -> parse changed the tree"
        );
        // All five files are in NCCL's dump layout (2-space indent, `/>`, one element a line),
        // so writing gives back the very bytes.
        assert_eq!(written, text, "{name}: not written back byte for byte");
    }
}

#[test]
fn fixture_trees_have_the_expected_elements() {
    // Counted from the files: h200x2 = system, cpu, 2 × (pci, gpu, nvlink), nic, net = 10;
    // ndv2 = system + 2 cpu + 9 pci = 12; ndv4 = system + 4 × (cpu, switch, 4 devices) = 25;
    // ndv5 = system + 2 × (cpu + 4 × (switch + 2 devices)) = 27; graph dump = graphs + 5 graph +
    // 24 channels × 3 (channel + 2 gpu) = 78.
    let counts = [
        ("h200x2-nccl-topo.xml", 10),
        ("azure-ndv2-topo.xml", 12),
        ("azure-ndv4-topo.xml", 25),
        ("azure-ndv5-topo.xml", 27),
        ("h200x2-nccl-graph.xml", 78),
    ];
    for (name, n) in counts {
        assert_eq!(Xml::from_file(fixture(name)).unwrap().root.count(), n, "{name}");
    }
    let x = Xml::from_file(fixture("h200x2-nccl-topo.xml")).unwrap();
    let gpu = x.root.find(&|n| n.name == "gpu").unwrap();
    assert_eq!(gpu.attr("sm"), Some("90"));
    assert_eq!(gpu.line, 4, "line of the first <gpu> in the file");
}

fn err_of(text: &str, name: &str) -> oxccl::Error {
    match System::from_xml_str(text, name) {
        Ok(_) => panic!("{name}: accepted"),
        Err(e) => e,
    }
}

#[test]
fn truncated_file_is_an_invalid_argument_with_file_and_line() {
    let text = std::fs::read_to_string(fixture("h200x2-nccl-topo.xml")).unwrap();
    // Cut after line 9 (inside the first <pci>): the reader reports the end of the file.
    let cut: String = text.lines().take(9).map(|l| format!("{l}\n")).collect();
    let e = err_of(&cut, "cut.xml");
    assert_eq!(e.code(), ResultCode::InvalidArgument);
    let msg = e.to_string();
    assert!(msg.contains("cut.xml:9:") && msg.contains("truncated"), "{msg}");
    // Cut in the middle of an attribute value.
    let at = text.find("link_speed=\"32").unwrap() + 14;
    let e = err_of(&text[..at], "mid.xml");
    assert_eq!(e.code(), ResultCode::InvalidArgument);
    assert!(e.to_string().contains("mid.xml:3:"), "{e}");
    // Nothing at all.
    assert!(err_of("", "empty.xml").to_string().contains("empty.xml:1:"));
}

#[test]
fn bad_attributes_are_invalid_arguments_with_file_and_line() {
    let text = std::fs::read_to_string(fixture("h200x2-nccl-topo.xml")).unwrap();
    let cases: [(&str, &str, &str, &str); 6] = [
        // (what, replace, with, expected text in the message)
        ("unquoted value", "dev=\"1\" sm", "dev=1 sm", "bad.xml:12:"),
        (
            "duplicated attribute",
            "sm=\"90\" rank=\"1\"",
            "sm=\"90\" sm=\"90\" rank=\"1\"",
            "bad.xml:12:",
        ),
        (
            "non-numeric width",
            "link_width=\"0\">\n      <gpu dev=\"1\"",
            "link_width=\"x16\">\n      <gpu dev=\"1\"",
            "bad.xml:11: <pci>: attribute link_width=\"x16\" is not an integer",
        ),
        (
            "missing sm",
            "sm=\"90\" rank=\"0\"",
            "rank=\"0\"",
            "bad.xml:4: <gpu>: attribute \"sm\" is missing",
        ),
        (
            "bad nvlink count",
            "count=\"18\" tclass=\"0x068000\"/>\n      </gpu>\n    </pci>\n  </cpu>",
            "count=\"eighteen\" tclass=\"0x068000\"/>\n      </gpu>\n    </pci>\n  </cpu>",
            "bad.xml:13: <nvlink>: attribute count=\"eighteen\"",
        ),
        (
            "bad numaid",
            "numaid=\"-1\"",
            "numaid=\"one\"",
            "bad.xml:2: <cpu>: attribute numaid=\"one\"",
        ),
    ];
    for (what, from, to, want) in cases {
        assert!(text.contains(from), "{what}: fixture changed");
        let bad = text.replacen(from, to, 1);
        let e = err_of(&bad, "bad.xml");
        assert_eq!(e.code(), ResultCode::InvalidArgument, "{what}: {e}");
        assert!(e.to_string().contains(want), "{what}: {e}");
    }
    let e = err_of("<graphs version=\"1\"/>\n", "g.xml");
    assert!(e.to_string().contains("g.xml:1: root element is <graphs>"), "{e}");
    let e = err_of("<system version=\"2\"/>\n", "v.xml");
    assert!(
        e.to_string().contains("v.xml:1:") && e.to_string().contains("version"),
        "{e}"
    );
}

#[test]
fn missing_file_is_a_system_error() {
    let e = System::from_xml_file(fixture("no-such-file.xml")).unwrap_err();
    assert_eq!(e.code(), ResultCode::SystemError);
    assert!(e.to_string().contains("no-such-file.xml"));
}

// ---------------------------------------------------------------------------------------------
// h200x2: NCCL's own dump of our 2×H200 machine (complete, no fill needed)

#[test]
fn h200x2_system_and_paths() {
    let sys = System::from_xml_with(
        Xml::from_file(fixture("h200x2-nccl-topo.xml")).unwrap(),
        defaults(),
    )
    .unwrap();
    // Nodes: 2 <gpu>, the nvlink target class 0x068000 makes one NVS, 1 <cpu>, no PCI switch
    // (both GPUs sit directly under the CPU), the CPU-level <nic> and its one <net>.
    let counts: Vec<usize> = NodeType::ALL.iter().map(|&t| sys.count(t)).collect();
    assert_eq!(counts, [2, 0, 1, 1, 1, 1], "GPU PCI NVS CPU NIC NET");
    let (g0, g1, n0) = (gpu(&sys, 0), gpu(&sys, 1), net(&sys, 0));
    let cpu = sys.ids(NodeType::Cpu)[0];
    let nvs = sys.ids(NodeType::Nvs)[0];
    let c = sys.node(cpu).cpu().unwrap();
    // <cpu numaid="-1" vendor="GenuineIntel" familyid="6" modelid="207">: model 207 = 0xCF.
    assert_eq!(
        (c.numa_id, c.vendor, c.model),
        (-1, CpuVendor::Intel, CpuModel::IntelEmeraldRapids)
    );
    assert_eq!(c.host_hash, 0xf1613fbed7514379);
    assert!(c.cores.is_empty(), "no affinity attribute in the dump");
    for (g, dev, bus) in [(g0, 0, "0000:00:06.0"), (g1, 1, "0000:00:07.0")] {
        let node = sys.node(g);
        let info = node.gpu().unwrap();
        assert_eq!((info.dev, info.rank, info.sm, info.gdr), (dev, dev, 90, true));
        let pci = node.pci.as_ref().unwrap();
        assert_eq!(pci.bus_id, bus);
        // link_width="0" is read as 16 lanes (NCCL), "32.0 GT/s PCIe" = 240: 16 × 240 / 80.
        assert_eq!(pci.link_width, 16);
        assert_bw!(node.link_to(cpu, LinkType::Pci).unwrap().bw, 48.0);
        // <nvlink count="18">, sm 90: 18 × 20.6 GB/s, both ways.
        assert_bw!(node.link_to(nvs, LinkType::Nvl).unwrap().bw, 18.0 * 20.6);
        assert_bw!(sys.node(nvs).link_to(g, LinkType::Nvl).unwrap().bw, 370.8);
        // The NVLink (370.8) sorts before PCI (48).
        assert_eq!(node.links[0].kind, LinkType::Nvl);
    }
    // eth0 speed="10000" Mb/s: 10000 / 8000 = 1.25 GB/s, gdr="0".
    let eth = sys.node(n0).net().unwrap();
    assert_eq!((eth.name.as_str(), eth.gdr), ("eth0", false));
    assert_bw!(eth.bw, 1.25);

    let p = sys.paths();
    // GPU0 <-> GPU1: NVL through the NVSwitch (GPU -> NVS -> GPU), 18 × 20.6 = 370.8 GB/s.
    for (a, b) in [(g0, g1), (g1, g0)] {
        let path = p.get(a, b).unwrap();
        assert_eq!(path.kind, PathType::Nvl);
        assert_bw!(path.bw, 370.8);
        assert_eq!(path.route, [nvs, b]);
    }
    // GPU -> eth0: GPU -PCI-> CPU -PCI-> NIC -NET-> NET: through the host bridge, PHB, limited
    // by the NIC: min(48, 5000, 1.25) = 1.25 GB/s.
    for g in [g0, g1] {
        assert_eq!(p.kind(g, n0), PathType::Phb);
        assert_bw!(p.bw(g, n0), 1.25);
        assert_eq!(p.kind(g, g), PathType::Loc);
        assert_eq!(p.kind(g, cpu), PathType::Phb);
        assert_bw!(p.bw(g, cpu), 48.0);
    }
    // NCCL's graph dump of the same run searched its rings on NVL paths (typeintra="NVL"), and
    // 12 channels × 30 GB/s = 360 GB/s fit the 370.8 GB/s path.
    let graphs = Xml::from_file(fixture("h200x2-nccl-graph.xml")).unwrap();
    let ring = graphs
        .root
        .find(&|n| n.name == "graph" && n.attr("pattern") == Some("4"))
        .unwrap();
    assert_eq!(ring.attr("typeintra"), Some(p.kind(g0, g1).as_str()));
    let ring_bw: f64 = ring.attr("nchannels").unwrap().parse::<f64>().unwrap()
        * ring.attr("speedintra").unwrap().parse::<f64>().unwrap();
    assert!(ring_bw <= p.bw(g0, g1));

    // nvidia-smi style: NV18 between the GPUs, PHB to the NIC.
    let text = sys.describe();
    assert!(text.contains("GPU0     X      NV18    PHB"), "{text}");
    assert!(text.contains("GPU1    NV18     X      PHB"), "{text}");
    assert!(text.contains("NIC0: eth0"), "{text}");
    assert_eq!(sys.to_string(), text);
    assert_eq!(
        sys.to_xml_string(),
        std::fs::read_to_string(fixture("h200x2-nccl-topo.xml")).unwrap()
    );
}

#[test]
fn h200x2_trim_to_one_rank() {
    let mut sys = System::from_xml_with(
        Xml::from_file(fixture("h200x2-nccl-topo.xml")).unwrap(),
        defaults(),
    )
    .unwrap();
    // A communicator of rank 0 only: GPU1 goes, and as every rank is local, the NET too.
    sys.trim(&[0]).unwrap();
    assert_eq!(sys.count(NodeType::Gpu), 1);
    assert_eq!(sys.count(NodeType::Net), 0);
    assert!(sys.gpu_by_rank(1).is_none());
    let g0 = gpu(&sys, 0);
    // No link to a removed node remains.
    for n in sys.nodes() {
        for l in &n.links {
            assert!(l.remote.0 < sys.nodes().len());
        }
    }
    assert_eq!(sys.node(sys.ids(NodeType::Nvs)[0]).links.len(), 1);
    assert_eq!(sys.paths().kind(g0, g0), PathType::Loc);
    assert!(sys.trim(&[0, 0]).is_err());
}

// ---------------------------------------------------------------------------------------------
// Azure NDv2: 8 × V100 (sm70) in the DGX-1 hybrid cube-mesh, one IB NIC on socket 0

fn ndv2(opts: PathOptions) -> System {
    let mut xml = Xml::from_file(fixture("azure-ndv2-topo.xml")).unwrap();
    // Detection on the VM: sm 70; the cube-mesh NVLinks; the NIC is EDR InfiniBand, 100 Gb/s.
    let (gpus, nics) = fill_azure(&mut xml, 70, &cube_mesh_nvlinks, 100_000, true);
    assert_eq!(gpus.len(), 8);
    assert_eq!(nics, ["0101:00:00.0"]);
    System::from_xml_with(xml, opts).unwrap()
}

#[test]
fn ndv2_unfilled_file_has_no_gpus() {
    // NCCL builds GPU and NIC nodes only from <gpu> / <nic> elements: the partial file alone
    // gives the two CPUs and nothing under them (the GPU/NIC PCI devices wait for detection).
    let sys = System::from_xml_with(
        Xml::from_file(fixture("azure-ndv2-topo.xml")).unwrap(),
        defaults(),
    )
    .unwrap();
    let counts: Vec<usize> = NodeType::ALL.iter().map(|&t| sys.count(t)).collect();
    assert_eq!(counts, [0, 0, 0, 2, 0, 0], "GPU PCI NVS CPU NIC NET");
}

#[test]
fn ndv2_system_and_paths() {
    let sys = ndv2(defaults());
    let counts: Vec<usize> = NodeType::ALL.iter().map(|&t| sys.count(t)).collect();
    assert_eq!(counts, [8, 0, 0, 2, 1, 1], "GPU PCI NVS CPU NIC NET");
    let cpus = sys.ids(NodeType::Cpu);
    let (c0, c1) = (sys.node(cpus[0]).cpu().unwrap(), sys.node(cpus[1]).cpu().unwrap());
    // affinity "00000000,000fffff" = cores 0-19, "000000ff,fff00000" = cores 20-39.
    assert_eq!(c0.cores, (0..20).collect::<Vec<u32>>());
    assert_eq!(c1.cores, (20..40).collect::<Vec<u32>>());
    // GenuineIntel family 6 model 85 = 0x55: Skylake, 10 GB/s between the sockets.
    assert_eq!(c0.model, CpuModel::IntelSkylake);
    assert_bw!(
        sys.node(cpus[0]).link_to(cpus[1], LinkType::Sys).unwrap().bw,
        10.0
    );
    let p = sys.paths();
    for (i, links) in CUBE_MESH.iter().enumerate() {
        let gi = gpu(&sys, i as i32);
        // "16 GT/s" × 16 lanes: 16 × 120 / 80 = 24 GB/s to the CPU.
        assert_bw!(sys.node(gi).pci.as_ref().unwrap().bw, 24.0);
        for (j, &count) in links.iter().enumerate() {
            if i == j {
                continue;
            }
            let gj = gpu(&sys, j as i32);
            let path = p.get(gi, gj).unwrap();
            if count > 0 {
                // Direct NVLinks: count × 20 GB/s (SM70).
                assert_eq!(path.kind, PathType::Nvl, "GPU{i}-GPU{j}");
                assert_bw!(path.bw, count as f64 * 20.0, "GPU{i}-GPU{j}");
            } else {
                // No direct NVLink: in the cube-mesh every such pair is two NVLink hops apart, so
                // NVB, at the best two-hop bottleneck max_k min(links(i,k), links(k,j)) × 20 GB/s
                // (e.g. GPU0-GPU7: via GPU4, min(2, 2) × 20 = 40; GPU0-GPU5: 20). The path over
                // the CPUs (3 hops, 10 GB/s) is longer and slower.
                let best = (0..8).map(|k| links[k].min(CUBE_MESH[k][j])).max().unwrap();
                assert_eq!(path.kind, PathType::Nvb, "GPU{i}-GPU{j}");
                assert_bw!(path.bw, best as f64 * 20.0, "GPU{i}-GPU{j}");
                assert_eq!(path.count(), 2);
                assert_eq!(sys.node(path.route[0]).node_type(), NodeType::Gpu);
            }
        }
    }
    assert_bw!(p.bw(gpu(&sys, 0), gpu(&sys, 7)), 40.0);
    assert_bw!(p.bw(gpu(&sys, 0), gpu(&sys, 5)), 20.0);
    // The NIC (0101:00:00.0) sits under CPU 0 with GPUs 0-3. EDR: 100000 / 8000 = 12.5 GB/s.
    let n0 = net(&sys, 0);
    for i in 0..8 {
        let gi = gpu(&sys, i);
        if i < 4 {
            // GPU -> CPU0 -> NIC: PHB, min(24, 24, 12.5) = 12.5.
            assert_eq!(p.kind(gi, n0), PathType::Phb, "GPU{i}");
            assert_bw!(p.bw(gi, n0), 12.5);
        } else {
            // GPU -> CPU1 -> CPU0 -> NIC: SYS, min(24, 10, 24, 12.5) = 10. No PXN: the GPUs next
            // to the NIC reach it through the CPU (PHB), not a PCI switch.
            assert_eq!(p.kind(gi, n0), PathType::Sys, "GPU{i}");
            assert_bw!(p.bw(gi, n0), 10.0);
        }
    }
    let text = sys.describe();
    assert!(
        text.contains("GPU0     X      NV1     NV1     NV2     NV2     NVB     NVB     NVB     PHB     0-19            0"),
        "{text}"
    );
    assert!(text.contains("GPU7    NVB     NVB     NVB     NV1     NV2     NV1     NV2      X      SYS     20-39           1"), "{text}");
}

#[test]
fn ndv2_without_nvb_goes_through_the_cpus() {
    // NCCL_NVB_DISABLE=1: no route through a GPU. GPU0-GPU5 (no NVLink) then crosses the sockets:
    // SYS; P2P is not used beyond PXB so it goes through GPU5's CPU: min(24, 10, 24) = 10 GB/s.
    let sys = ndv2(PathOptions {
        nvb_disable: true,
        ..defaults()
    });
    let p = sys.paths();
    assert_eq!(p.kind(gpu(&sys, 0), gpu(&sys, 5)), PathType::Sys);
    assert_bw!(p.bw(gpu(&sys, 0), gpu(&sys, 5)), 10.0);
    assert_eq!(p.kind(gpu(&sys, 0), gpu(&sys, 4)), PathType::Nvl);
}

// ---------------------------------------------------------------------------------------------
// Azure NDv4: 8 × A100 (sm80) on NVSwitches, 8 IB NICs, 4 NUMA nodes with one PCI switch each

fn ndv4(opts: PathOptions, net_gdr: bool) -> System {
    let mut xml = Xml::from_file(fixture("azure-ndv4-topo.xml")).unwrap();
    // Detection on the VM: sm 80; each A100 has 12 NVLinks to the NVSwitches (recorded as NCCL
    // does, to the collapsed NVSwitch); 8 HDR InfiniBand NICs, 200 Gb/s.
    let (gpus, nics) = fill_azure(
        &mut xml,
        80,
        &|_, _| vec![NvLinkFill::nvswitch(12)],
        200_000,
        net_gdr,
    );
    assert_eq!(
        gpus,
        [
            "0001:00:00.0",
            "0002:00:00.0",
            "0003:00:00.0",
            "0004:00:00.0",
            "000b:00:00.0",
            "000c:00:00.0",
            "000d:00:00.0",
            "000e:00:00.0"
        ]
    );
    assert_eq!(nics.len(), 8);
    System::from_xml_with(xml, opts).unwrap()
}

/// The PCI switch of a GPU or NET node (through its NIC for a NET).
fn switch_of(sys: &System, id: NodeId) -> NodeId {
    let mut n = id;
    if sys.node(n).node_type() == NodeType::Net {
        n = sys
            .node(n)
            .links
            .iter()
            .find(|l| l.kind == LinkType::Net)
            .unwrap()
            .remote;
    }
    sys.node(n)
        .links
        .iter()
        .find(|l| l.kind == LinkType::Pci)
        .map(|l| l.remote)
        .unwrap()
}

#[test]
fn ndv4_system_and_paths() {
    let sys = ndv4(defaults(), true);
    let counts: Vec<usize> = NodeType::ALL.iter().map(|&t| sys.count(t)).collect();
    assert_eq!(counts, [8, 4, 1, 4, 8, 8], "GPU PCI NVS CPU NIC NET");
    // AMD (AuthenticAMD, family 23): every NUMA node linked to the 3 others at 16 GB/s.
    for c in sys.ids(NodeType::Cpu) {
        let node = sys.node(c);
        assert_eq!(node.cpu().unwrap().vendor, CpuVendor::Amd);
        let sys_links: Vec<f64> = node
            .links
            .iter()
            .filter(|l| l.kind == LinkType::Sys)
            .map(|l| l.bw)
            .collect();
        assert_eq!(sys_links, [16.0; 3]);
    }
    let p = sys.paths();
    for i in 0..8 {
        let gi = gpu(&sys, i);
        for j in 0..8 {
            if i != j {
                // Through the NVSwitch: NVL, 12 × 20.0 (SM80) = 240 GB/s; shown as NV12.
                let path = p.get(gi, gpu(&sys, j)).unwrap();
                assert_eq!(path.kind, PathType::Nvl);
                assert_bw!(path.bw, 240.0);
                assert_eq!(sys.node(path.route[0]).node_type(), NodeType::Nvs);
            }
        }
        for j in 0..8 {
            let nj = net(&sys, j);
            let path = p.get(gi, nj).unwrap();
            if switch_of(&sys, gi) == switch_of(&sys, nj) {
                // Same PCI switch: PIX, min(24 GPU link, 24 NIC link, 200000 / 8000 = 25) = 24.
                assert_eq!(path.kind, PathType::Pix, "GPU{i}-NET{j}");
                assert_bw!(path.bw, 24.0);
            } else {
                // Other NUMA node: SYS at 16 GB/s over PCI, so NCCL goes through GPU j (next to
                // NET j, on NVLink with GPU i): PXN, min(240, 24) = 24 GB/s, relayed by GPU j.
                // (GPU j is the GPU that uses NET j: GPUs of a switch split its two NICs by
                // the parity of their dev, in the order NICs appear in the file.)
                assert_eq!(path.kind, PathType::Pxn, "GPU{i}-NET{j}");
                assert_bw!(path.bw, 24.0);
                assert_eq!(
                    sys.pxn_peer(gi, nj),
                    Some(gpu(&sys, j)),
                    "GPU{i}-NET{j}: PXN peer"
                );
                assert_eq!(path.route[..2], [sys.ids(NodeType::Nvs)[0], gpu(&sys, j)]);
            }
        }
    }
    // GPUs 0,1 and NICs 0101,0102 share switch ffff:ff:02.0 on NUMA 1.
    assert_eq!(p.kind(gpu(&sys, 0), net(&sys, 1)), PathType::Pix);
    assert_eq!(p.kind(gpu(&sys, 0), net(&sys, 2)), PathType::Pxn);
    // GPU-GPU over PCI would be SYS; NVLink wins.
    let text = sys.describe();
    assert!(text.contains("GPU0     X      NV12    NV12"), "{text}");
}

#[test]
fn ndv4_without_pxn_and_without_gdr() {
    // NCCL_PXN_DISABLE=1: the PCI route across NUMA nodes: GPU -> switch -> CPU -SYS-> CPU ->
    // switch -> NIC, min(24, 24, 16, 24, 24, 25) = 16 GB/s.
    let sys = ndv4(
        PathOptions {
            pxn_disable: true,
            ..defaults()
        },
        true,
    );
    assert_eq!(sys.paths().kind(gpu(&sys, 0), net(&sys, 2)), PathType::Sys);
    assert_bw!(sys.paths().bw(gpu(&sys, 0), net(&sys, 2)), 16.0);
    assert_eq!(sys.paths().kind(gpu(&sys, 0), net(&sys, 0)), PathType::Pix);
    // NICs without GPU Direct RDMA: even the NIC on the GPU's switch is reached through the CPU
    // (GPU -> CPU -> NIC): PHB, min(24, 24, 24, 25) = 24.
    let sys = ndv4(defaults(), false);
    assert_eq!(sys.paths().kind(gpu(&sys, 0), net(&sys, 0)), PathType::Phb);
    assert_bw!(sys.paths().bw(gpu(&sys, 0), net(&sys, 0)), 24.0);
}

#[test]
fn ndv4_trim_keeps_the_nets_of_a_multi_node_communicator() {
    let mut sys = ndv4(defaults(), true);
    // Ranks 0, 1 here and 8, 9 on another node: GPUs 2-7 go, NETs stay.
    sys.trim(&[0, 1, 8, 9]).unwrap();
    assert_eq!(sys.count(NodeType::Gpu), 2);
    assert_eq!(sys.count(NodeType::Net), 8);
    // NET 2's PXN peer (GPU 2) is gone: GPU 0 falls back to the PCI route, SYS at 16 GB/s.
    assert_eq!(sys.paths().kind(gpu(&sys, 0), net(&sys, 2)), PathType::Sys);
    assert_bw!(sys.paths().bw(gpu(&sys, 0), net(&sys, 2)), 16.0);
    assert_eq!(sys.paths().kind(gpu(&sys, 0), net(&sys, 0)), PathType::Pix);
    assert_eq!(sys.paths().kind(gpu(&sys, 0), gpu(&sys, 1)), PathType::Nvl);
}

// ---------------------------------------------------------------------------------------------
// Azure NDv5: 8 × H100 (sm90) on NVSwitches, 8 IB NICs, 2 sockets, one switch per GPU/NIC pair

fn ndv5(opts: PathOptions) -> System {
    let mut xml = Xml::from_file(fixture("azure-ndv5-topo.xml")).unwrap();
    // Detection on the VM: sm 90, 18 NVLinks per H100 to the NVSwitches; NDR InfiniBand,
    // 400 Gb/s.
    fill_azure(
        &mut xml,
        90,
        &|_, _| vec![NvLinkFill::nvswitch(18)],
        400_000,
        true,
    );
    System::from_xml_with(xml, opts).unwrap()
}

#[test]
fn ndv5_system_and_paths() {
    let sys = ndv5(defaults());
    let counts: Vec<usize> = NodeType::ALL.iter().map(|&t| sys.count(t)).collect();
    assert_eq!(counts, [8, 8, 1, 2, 8, 8], "GPU PCI NVS CPU NIC NET");
    let cpus = sys.ids(NodeType::Cpu);
    let c0 = sys.node(cpus[0]).cpu().unwrap();
    // family 6 model 143 = 0x8F: Sapphire Rapids, 22 GB/s between the sockets.
    assert_eq!(c0.model, CpuModel::IntelSapphireRapids);
    assert_bw!(
        sys.node(cpus[0]).link_to(cpus[1], LinkType::Sys).unwrap().bw,
        22.0
    );
    // affinity "ffffffff,ffff0000,00000000" = cores 48-95.
    assert_eq!(c0.cores, (48..96).collect::<Vec<u32>>());
    let p = sys.paths();
    // GPUs 0001,0002,0003,0008 (dev 0-3) under socket 0; 0009-000c (dev 4-7) under socket 1;
    // NIC 01xx (dev 0-7) share the switch of GPU dev i.
    for i in 0..8 {
        let gi = gpu(&sys, i);
        // "32.0 GT/s PCIe" × 16: 16 × 240 / 80 = 48 GB/s.
        assert_bw!(sys.node(gi).pci.as_ref().unwrap().bw, 48.0);
        for j in 0..8 {
            if i != j {
                // NVL through the NVSwitch: 18 × 20.6 = 370.8 GB/s.
                assert_eq!(p.kind(gi, gpu(&sys, j)), PathType::Nvl);
                assert_bw!(p.bw(gi, gpu(&sys, j)), 370.8);
            }
            let nj = net(&sys, j);
            if i == j {
                // Same switch: PIX, min(48, 48, 400000 / 8000 = 50) = 48.
                assert_eq!(p.kind(gi, nj), PathType::Pix);
                assert_bw!(p.bw(gi, nj), 48.0);
            } else {
                // Over PCI it would be PHB (48, same socket) or SYS (22): NCCL takes GPU j's
                // NIC through GPU j, PXN at min(370.8, 48) = 48.
                assert_eq!(p.kind(gi, nj), PathType::Pxn, "GPU{i}-NET{j}");
                assert_bw!(p.bw(gi, nj), 48.0);
                assert_eq!(sys.pxn_peer(gi, nj), Some(gpu(&sys, j)));
            }
        }
    }
    let sys = ndv5(PathOptions {
        pxn_disable: true,
        ..defaults()
    });
    let p = sys.paths();
    // Without PXN: same socket -> PHB at 48; other socket -> SYS at min(48, 22) = 22.
    assert_eq!(p.kind(gpu(&sys, 0), net(&sys, 3)), PathType::Phb);
    assert_bw!(p.bw(gpu(&sys, 0), net(&sys, 3)), 48.0);
    assert_eq!(p.kind(gpu(&sys, 0), net(&sys, 4)), PathType::Sys);
    assert_bw!(p.bw(gpu(&sys, 0), net(&sys, 4)), 22.0);
    let text = sys.describe();
    assert!(text.contains("GPU0     X      NV18"), "{text}");
}

#[test]
fn ndv5_gpus_without_nvlink_use_the_pci_tree() {
    // The same VM as if NVLink were absent (P2P default level PXB): GPU pairs on one socket are
    // PHB (GPU -> switch -> CPU -> switch -> GPU), min(48, 48, 48, 48) = 48; across sockets SYS,
    // min(48, 22) = 22 GB/s; both routed through the receiving GPU's CPU, same result.
    let mut xml = Xml::from_file(fixture("azure-ndv5-topo.xml")).unwrap();
    fill_azure(&mut xml, 90, &|_, _| Vec::new(), 400_000, true);
    let sys = System::from_xml_with(xml, defaults()).unwrap();
    let p = sys.paths();
    assert_eq!(sys.count(NodeType::Nvs), 0);
    assert_eq!(p.kind(gpu(&sys, 0), gpu(&sys, 3)), PathType::Phb);
    assert_bw!(p.bw(gpu(&sys, 0), gpu(&sys, 3)), 48.0);
    assert_eq!(p.kind(gpu(&sys, 0), gpu(&sys, 4)), PathType::Sys);
    assert_bw!(p.bw(gpu(&sys, 0), gpu(&sys, 4)), 22.0);
    // No NVLink, no PXN: GPU 0 to NET 3 (same socket) PHB, to NET 4 SYS.
    assert_eq!(p.kind(gpu(&sys, 0), net(&sys, 3)), PathType::Phb);
    assert_eq!(p.kind(gpu(&sys, 0), net(&sys, 4)), PathType::Sys);
}

// ---------------------------------------------------------------------------------------------
// Speed

#[test]
fn eight_gpu_fixtures_parse_and_compute_paths_fast() {
    // Parse (+ detection fill) + system graph + all paths, each 8-GPU file: well under 100 ms.
    type Build = fn() -> System;
    let builds: [(&str, Build); 3] = [
        ("ndv2", || ndv2(defaults())),
        ("ndv4", || ndv4(defaults(), true)),
        ("ndv5", || ndv5(defaults())),
    ];
    for (name, build) in builds {
        let mut best = Duration::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            let sys = build();
            let dt = t.elapsed();
            assert_eq!(sys.count(NodeType::Gpu), 8);
            best = best.min(dt);
        }
        let sys = build();
        let t = Instant::now();
        let text = sys.describe();
        let describe = t.elapsed();
        assert!(text.contains("GPU7"));
        eprintln!(
            "topo timing {name}: parse + fill + graph + paths {:.3} ms (best of 5), describe {:.3} ms",
            best.as_secs_f64() * 1e3,
            describe.as_secs_f64() * 1e3
        );
        assert!(best < Duration::from_millis(100), "{name}: {best:?}");
    }
}
