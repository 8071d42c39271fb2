//! Intra-node ring graphs (`oxccl::graph::search_rings`, NCCL's `ncclTopoCompute` for the ring
//! pattern) on the topology fixtures of tests/topo/ and on random small topologies.
//!
//! Expected values are derived by hand from NCCL's rules (`src/graph/search.cc`): link
//! bandwidths of `src/graph/topo.h` (NVLink per link: SM90 20.6, SM80 and SM70 20.0 GB/s), the
//! intra-node speed lists (sm90: 60, 50, 40, 30, ...; before sm90: 40, 30, 20, 18, ...), each
//! channel taking its speed on every link of every hop, lower speeds tried while the next one is
//! more than 0.49 × the best found, then `ncclTopoDupChannels` (double the channels and halve the speed
//! at ≥ 25 GB/s unless sm > 80, speed < 50 and > 4 channels). `max_channels` is NCCL's ring
//! default, `MAXCHANNELS / 2` = 32.
//!
//! The Azure files are PCI-only; GPUs and NVLinks are filled in as the `topo` tests do
//! (`common::topo::fill_azure`), with the same stated assumptions about each VM.
use crate::common;

use common::topo::{CUBE_MESH, MESH4, close, cube_mesh_nvlinks, fill_azure, fixture, load};
use oxccl::graph::{
    Graph, GraphRequest, Pattern, RingGraph, Tree, btree, double_binary_tree, dtree, dtree_roots,
    search_graph, search_rings, search_trees, speed_array_inter, speed_array_intra,
};
use oxccl::topo::{
    CpuArch, CpuVendor, LinkType, NodeId, NodeType, NvLinkFill, PathOptions, PathType, System, Xml,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const MAX_CHANNELS: usize = 32;

fn ndv2() -> System {
    let mut xml = Xml::from_file(fixture("azure-ndv2-topo.xml")).unwrap();
    let gpus = fill_azure(&mut xml, 70, &cube_mesh_nvlinks, 100_000, true).0;
    assert_eq!(gpus.len(), 8);
    System::from_xml_with(xml, PathOptions::default()).unwrap()
}

fn ndv4() -> System {
    let mut xml = Xml::from_file(fixture("azure-ndv4-topo.xml")).unwrap();
    // sm 80, 12 NVLinks per A100 to the (collapsed) NVSwitch.
    fill_azure(
        &mut xml,
        80,
        &|_, _| vec![NvLinkFill::nvswitch(12)],
        200_000,
        true,
    );
    System::from_xml_with(xml, PathOptions::default()).unwrap()
}

fn ndv5() -> System {
    let mut xml = Xml::from_file(fixture("azure-ndv5-topo.xml")).unwrap();
    // sm 90, 18 NVLinks per H100 to the (collapsed) NVSwitch.
    fill_azure(
        &mut xml,
        90,
        &|_, _| vec![NvLinkFill::nvswitch(18)],
        400_000,
        true,
    );
    System::from_xml_with(xml, PathOptions::default()).unwrap()
}

fn h200x2() -> System {
    let xml = Xml::from_file(fixture("h200x2-nccl-topo.xml")).unwrap();
    System::from_xml_with(xml, PathOptions::default()).unwrap()
}

/// The GPU node of each rank.
fn rank_ids(sys: &System) -> Vec<oxccl::topo::NodeId> {
    let mut v: Vec<(i32, oxccl::topo::NodeId)> = sys
        .ids(NodeType::Gpu)
        .into_iter()
        .map(|id| (sys.node(id).gpu().unwrap().rank, id))
        .collect();
    v.sort();
    v.into_iter().map(|(_, id)| id).collect()
}

/// Checks what every ring graph must satisfy: `nchannels` rings of at most `max` channels, each a
/// permutation of the ranks (so consecutive entries and last -> first form one cycle through
/// every GPU), every hop (closing one included) no farther than `type_intra`, and no link
/// carrying more than its bandwidth: channels × `speed_intra` summed over the hops whose routes
/// cross it.
fn check_graph(sys: &System, g: &RingGraph, max: usize) {
    let n = sys.count(NodeType::Gpu);
    assert_eq!(g.nchannels, g.rings.len());
    assert!(g.nchannels >= 1 && g.nchannels <= max, "{g:?}");
    assert!(g.speed_intra > 0.0);
    let ids = rank_ids(sys);
    let mut load: HashMap<(usize, usize), f64> = HashMap::new();
    for ring in &g.rings {
        let mut sorted = ring.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            (0..n).collect::<Vec<_>>(),
            "ring {ring:?} is not a cycle over all GPUs"
        );
        if n == 1 {
            continue;
        }
        for k in 0..n {
            let (a, b) = (ids[ring[k]], ids[ring[(k + 1) % n]]);
            let p = sys.paths().get(a, b).expect("hop without a path");
            assert!(
                p.kind <= g.type_intra,
                "hop {a:?} -> {b:?} is {} > {}",
                p.kind,
                g.type_intra
            );
            let mut prev = a;
            for &next in &p.route {
                *load.entry((prev.0, next.0)).or_default() += g.speed_intra;
                prev = next;
            }
        }
    }
    if g.type_intra == PathType::Sys && close(g.speed_intra, 0.1) {
        return; // NCCL's fallback graph reserves nothing.
    }
    for ((from, to), used) in load {
        let node = &sys.nodes()[from];
        let bw = node
            .links
            .iter()
            .filter(|l| l.remote.0 == to)
            .map(|l| l.bw)
            .fold(0.0, f64::max);
        assert!(
            used <= bw + 1e-6,
            "link {} -> {to}: {used} GB/s used of {bw}",
            node.label()
        );
    }
}

fn sequential(n: usize, channels: usize) -> Vec<Vec<usize>> {
    vec![(0..n).collect(); channels]
}

#[test]
fn speed_lists_are_nccls() {
    // search.cc: speedArrayIntra, sm90SpeedArrayIntra, sm100SpeedArrayIntra.
    assert_eq!(
        speed_array_intra(70),
        [
            40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0
        ]
    );
    assert_eq!(speed_array_intra(80), speed_array_intra(70));
    assert_eq!(
        speed_array_intra(90),
        [60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0]
    );
    assert_eq!(speed_array_intra(100)[0], 90.0);
}

#[test]
fn h200x2_matches_nccls_dump() {
    // tests/topo/h200x2-nccl-graph.xml, graph id 0 (pattern 4 = ring): nchannels 12,
    // speedintra 30, typeintra NVL, every channel GPU 0 then GPU 1. Derivation: each H200 has
    // 18 NVLinks × 20.6 = 370.8 GB/s to the NVSwitch (GPU0 -> NVS -> GPU1 is NVL at 370.8);
    // the sm90 list starts at 60 (<= 370.8); ring 0 -> 1 -> 0 takes 60 on GPU0->NVS, NVS->GPU1,
    // GPU1->NVS, NVS->GPU0, so floor(370.8 / 60) = 6 channels (360 GB/s). 50 (7 × 50 = 350),
    // 40 (9 × 40 = 360) and 30 (12 × 30 = 360) are not better; 24 / 60 < 0.49 stops. Dup at
    // 60 GB/s (>= 50 on sm90): 12 channels at 30. Same as NCCL, no difference.
    let sys = h200x2();
    let g = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(g.nchannels, 12);
    assert!(close(g.speed_intra, 30.0), "{}", g.speed_intra);
    assert_eq!(g.type_intra, PathType::Nvl);
    assert_eq!(g.rings, sequential(2, 12));
    check_graph(&sys, &g, MAX_CHANNELS);

    // And the numbers read from NCCL's own dump.
    let dump = Xml::from_file(fixture("h200x2-nccl-graph.xml")).unwrap();
    let ring = dump
        .root
        .subs
        .iter()
        .find(|s| s.attr("pattern") == Some("4"))
        .unwrap();
    assert_eq!(
        ring.attr("nchannels").unwrap().parse::<usize>().unwrap(),
        g.nchannels
    );
    assert_eq!(
        ring.attr("speedintra").unwrap().parse::<f64>().unwrap(),
        g.speed_intra
    );
    assert_eq!(ring.attr("typeintra").unwrap(), g.type_intra.as_str());
    let channels: Vec<Vec<usize>> = ring
        .subs
        .iter()
        .map(|c| {
            c.subs
                .iter()
                .map(|gpu| {
                    let d = gpu.attr("dev").unwrap();
                    let d = d.trim_start_matches("0x");
                    usize::from_str_radix(d, 16).unwrap()
                })
                .collect()
        })
        .collect();
    assert_eq!(channels, g.rings);
}

#[test]
fn ndv4_nvswitch_gives_sequential_rings() {
    // 8 × A100 (sm80), 12 NVLinks × 20 = 240 GB/s each to the NVSwitch. Default list starts at
    // 40; sequential rings take 40 on each GPU's link to and from the switch: 240 / 40 = 6
    // channels = 240 GB/s = totalBw (optimal, search stops). Dup (40 >= 25, sm80 is not > 80):
    // 12 channels at 20, all 0..7 in order (the NVSwitch shortcut / PCI order).
    let sys = ndv4();
    let g = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(g.nchannels, 12);
    assert!(close(g.speed_intra, 20.0), "{}", g.speed_intra);
    assert_eq!(g.type_intra, PathType::Nvl);
    assert_eq!(g.rings, sequential(8, 12));
    check_graph(&sys, &g, MAX_CHANNELS);
}

#[test]
fn ndv5_nvswitch_gives_sequential_rings() {
    // 8 × H100 (sm90), 18 × 20.6 = 370.8 GB/s to the NVSwitch: as h200x2, 6 channels at 60
    // (360 < 370.8; 50, 40, 30 are not better), dup to 12 at 30, sequential.
    let sys = ndv5();
    let g = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(g.nchannels, 12);
    assert!(close(g.speed_intra, 30.0), "{}", g.speed_intra);
    assert_eq!(g.type_intra, PathType::Nvl);
    assert_eq!(g.rings, sequential(8, 12));
    check_graph(&sys, &g, MAX_CHANNELS);
}

#[test]
fn max_channels_caps_the_graph() {
    // ndv4 with at most 4 channels: 4 at 40 (the cap stops the search), dup to min(8, 4) = 4
    // channels: nothing to duplicate, speed stays 40.
    let sys = ndv4();
    let g = search_rings(&sys, 4).unwrap();
    assert_eq!((g.nchannels, g.speed_intra), (4, 40.0));
    assert_eq!(g.rings, sequential(8, 4));
    // With 1 channel: 1 at 40, no dup.
    let g = search_rings(&sys, 1).unwrap();
    assert_eq!((g.nchannels, g.speed_intra), (1, 40.0));
    assert!(search_rings(&sys, 0).is_err());
}

#[test]
fn ndv2_cube_mesh_rings_use_nvlink_only() {
    // 8 × V100 (sm70), hybrid cube mesh: NV2 pairs 40 GB/s, NV1 pairs 20 GB/s, 6 links = 120 GB/s
    // per GPU (totalBw); maxBw 40, so the default list starts at 40.
    // - 40, NVL: rank order fails (0 -> 1 is NV1). The search from 0 takes the highest bandwidth
    //   first, lowest rank on ties: 0 3 2 1 5 6 7 4 (all NV2 hops), then the NV2 links are full
    //   one way; the next search finds the reverse 0 4 7 6 5 1 2 3. 2 channels = 80 GB/s.
    // - 30 (30/40 > 0.49): only NV2 links carry 30: 2 channels = 60, not better.
    // - 20 (20/40 = 0.5 > 0.49): the two NV2 rings twice each (replay), filling every NV2 link
    //   both ways; then the NV1 links alone form the cycle 0 1 3 7 5 4 6 2 and its reverse
    //   0 2 6 4 5 7 3 1. 6 channels × 20 = 120 = totalBw: optimal, the search stops.
    // No dup (20 < 25). NCCL's search would reach the same 6 × 20 (it stops on totalBw too); its
    // ring orders may differ, its backtracking across channels being more thorough.
    let sys = ndv2();
    let g = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(g.nchannels, 6);
    assert!(close(g.speed_intra, 20.0), "{}", g.speed_intra);
    assert_eq!(g.type_intra, PathType::Nvl);
    assert_eq!(
        g.rings,
        [
            [0, 3, 2, 1, 5, 6, 7, 4],
            [0, 3, 2, 1, 5, 6, 7, 4],
            [0, 4, 7, 6, 5, 1, 2, 3],
            [0, 4, 7, 6, 5, 1, 2, 3],
            [0, 1, 3, 7, 5, 4, 6, 2],
            [0, 2, 6, 4, 5, 7, 3, 1],
        ]
    );
    check_graph(&sys, &g, MAX_CHANNELS);
    // Every hop is a direct NVLink between the two GPUs.
    for ring in &g.rings {
        for k in 0..8 {
            let (a, b) = (ring[k], ring[(k + 1) % 8]);
            assert!(CUBE_MESH[a][b] > 0, "hop {a} -> {b} in {ring:?} has no NVLink");
        }
    }
}

#[test]
fn eight_gpu_searches_are_fast() {
    // The search itself (system already built), best of 5, each 8-GPU fixture: <= 100 ms.
    type Build = fn() -> System;
    let builds: [(&str, Build); 3] = [("ndv2", ndv2), ("ndv4", ndv4), ("ndv5", ndv5)];
    for (name, build) in builds {
        let sys = build();
        let mut best = Duration::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            let g = search_rings(&sys, MAX_CHANNELS).unwrap();
            best = best.min(t.elapsed());
            assert!(g.nchannels > 0);
        }
        eprintln!(
            "ring search {name}: {:.3} ms (best of 5)",
            best.as_secs_f64() * 1e3
        );
        assert!(best < Duration::from_millis(100), "{name}: {best:?}");
    }
}

#[test]
fn single_gpu_ring() {
    // One GPU: maxBw = totalBw = LOC_BW (5000), the sm90 list starts at 60; the ring is the GPU
    // alone over LOC, channels up to max (32 × 60 < 5000); no dup room.
    let text = r#"<system version="1">
  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="0000:01:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="90" rank="0" gdr="1"/>
    </pci>
  </cpu>
</system>
"#;
    let sys = System::from_xml_with(Xml::parse(text, "one.xml").unwrap(), PathOptions::default()).unwrap();
    let g = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(
        (g.nchannels, g.speed_intra, g.type_intra),
        (32, 60.0, PathType::Loc)
    );
    check_graph(&sys, &g, MAX_CHANNELS);
}

// ---------------------------------------------------------------------------------------------
// Random small topologies

/// splitmix64: a seeded generator, so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A random one-node topology: 1 or 2 CPUs, 2-8 GPUs each under a PCI switch (shared by up to 2)
/// or directly under a CPU, and either an NVSwitch (all GPUs 1-18 links), random direct
/// NVLinks (0-3 per pair, symmetric; pairs without fall back to PCI), or none.
#[allow(clippy::needless_range_loop)] // symmetric pair matrix
fn random_topology(rng: &mut Rng) -> String {
    let n = 2 + rng.below(7) as usize;
    let ncpu = 1 + rng.below(2) as usize;
    let sm = [70, 80, 90][rng.below(3) as usize];
    let bus = |g: usize| format!("0000:{:02x}:00.0", 0x10 + g);
    let mode = rng.below(3); // 0 NVSwitch, 1 direct NVLinks, 2 PCI only
    let nvs = 1 + rng.below(18);
    let mut links = vec![vec![0u64; n]; n];
    if mode == 1 {
        for i in 0..n {
            for j in i + 1..n {
                let c = rng.below(4);
                links[i][j] = c;
                links[j][i] = c;
            }
        }
    }
    let gpu_xml = |g: usize, indent: &str| {
        let mut s = format!(
            "{indent}<pci busid=\"{}\" class=\"0x030200\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">\n\
             {indent}  <gpu dev=\"{g}\" sm=\"{sm}\" rank=\"{g}\" gdr=\"1\">\n",
            bus(g)
        );
        if mode == 0 {
            s += &format!(
                "{indent}    <nvlink target=\"fffffff:ff:ff.0\" count=\"{nvs}\" tclass=\"0x068000\"/>\n"
            );
        }
        for (j, &c) in links[g].iter().enumerate() {
            if c > 0 {
                s += &format!(
                    "{indent}    <nvlink target=\"{}\" count=\"{c}\" tclass=\"0x030200\"/>\n",
                    bus(j)
                );
            }
        }
        s += &format!("{indent}  </gpu>\n{indent}</pci>\n");
        s
    };
    let mut cpus = vec![String::new(); ncpu];
    let mut g = 0;
    let mut sw = 0;
    while g < n {
        let c = rng.below(ncpu as u64) as usize;
        let under_switch = rng.below(2) == 0;
        if under_switch {
            let k = (1 + rng.below(2) as usize).min(n - g);
            cpus[c] += &format!(
                "    <pci busid=\"0000:{:02x}:00.0\" class=\"0x060400\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">\n",
                0x80 + sw
            );
            sw += 1;
            for _ in 0..k {
                cpus[c] += &gpu_xml(g, "      ");
                g += 1;
            }
            cpus[c] += "    </pci>\n";
        } else {
            cpus[c] += &gpu_xml(g, "    ");
            g += 1;
        }
    }
    let mut s = String::from("<system version=\"1\">\n");
    for (c, body) in cpus.iter().enumerate() {
        s += &format!(
            "  <cpu numaid=\"{c}\" arch=\"x86_64\" vendor=\"GenuineIntel\" familyid=\"6\" modelid=\"85\">\n{body}  </cpu>\n"
        );
    }
    s += "</system>\n";
    s
}

#[test]
fn random_topologies_give_valid_deterministic_rings() {
    // 300 seeded random topologies: every ring visits each GPU exactly once (a Hamiltonian
    // cycle, closing hop included), hops stay within type_intra, no link is oversubscribed,
    // at most max_channels channels, and the same input gives the same graph.
    let mut rng = Rng(0x0cc1_5eed);
    let mut seen: std::collections::BTreeMap<(usize, &str), usize> = Default::default();
    for case in 0..300 {
        let text = random_topology(&mut rng);
        let sys = System::from_xml_with(Xml::parse(&text, "random.xml").unwrap(), PathOptions::default())
            .unwrap_or_else(|e| panic!("case {case}: {e}\n{text}"));
        let max = 1 + rng.below(MAX_CHANNELS as u64) as usize;
        let t = Instant::now();
        let g = search_rings(&sys, max).unwrap_or_else(|e| panic!("case {case}: {e}\n{text}"));
        let dt = t.elapsed();
        assert!(dt < Duration::from_millis(100), "case {case}: {dt:?}\n{text}");
        check_graph(&sys, &g, max);
        assert_eq!(
            search_rings(&sys, max).unwrap(),
            g,
            "case {case}: not deterministic"
        );
        *seen
            .entry((sys.count(NodeType::Gpu), g.type_intra.as_str()))
            .or_default() += 1;
    }
    eprintln!("random cases by (GPUs, type_intra): {seen:?}");
    // The generator reaches NVLink and PCI-only rings.
    assert!(seen.keys().any(|k| k.1 == "NVL") && seen.keys().any(|k| k.1 != "NVL"));
}

#[test]
fn bad_inputs_are_invalid_arguments() {
    // Two GPUs with one rank are refused (ranks need not start at 0: the GPUs of node 1 of a
    // two-node job are ranks 8-15), and so is max_channels = 0 or above MAXCHANNELS (64).
    let text = r#"<system version="1">
  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="0000:01:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="90" rank="1" gdr="1"/>
    </pci>
    <pci busid="0000:02:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="1" sm="90" rank="1" gdr="1"/>
    </pci>
  </cpu>
</system>
"#;
    let sys = System::from_xml_with(Xml::parse(text, "dup.xml").unwrap(), PathOptions::default()).unwrap();
    let e = search_rings(&sys, MAX_CHANNELS).unwrap_err();
    assert_eq!(e.code(), oxccl::ResultCode::InvalidArgument, "{e}");
    assert!(e.to_string().contains("ranks [1, 1]"), "{e}");
    let e = search_rings(&h200x2(), 0).unwrap_err();
    assert_eq!(e.code(), oxccl::ResultCode::InvalidArgument, "{e}");
    let e = search_rings(&h200x2(), 65).unwrap_err();
    assert!(e.to_string().contains("accepted 1..=64"), "{e}");
    // A lone GPU of rank 5 is a valid one-GPU ring of rank 5.
    let text = text.replace("rank=\"1\" gdr=\"1\"/>\n    </pci>\n    <pci busid=\"0000:02:00.0\" class=\"0x030200\" link_speed=\"32.0 GT/s PCIe\" link_width=\"16\">\n      <gpu dev=\"1\" sm=\"90\" rank=\"1\"", "rank=\"5\"");
    let sys = System::from_xml_with(Xml::parse(&text, "one.xml").unwrap(), PathOptions::default()).unwrap();
    assert_eq!(sys.count(NodeType::Gpu), 1, "{text}");
    assert_eq!(search_rings(&sys, 2).unwrap().rings, [[5], [5]]);
}

#[test]
fn ndv5_without_nvlink_orders_by_pci() {
    // The NDv5 PCI tree alone (no NVLink, as in the `topo` tests): PCI Gen5 x16 = 48 GB/s per GPU
    // (maxBw = totalBw = 48), Sapphire Rapids sockets 22 GB/s each way. A ring over both sockets
    // crosses CPU0 -> CPU1 and CPU1 -> CPU0 at least once (SYS hops), so the socket link bounds
    // it: 40, 30, 24 find nothing (22 < speed); 20: rank order (GPUs 0-3 on socket 0, 4-7 on
    // socket 1: one crossing each way) once, 22 - 20 = 2 left: 1 channel = 20 GB/s; 15 and 12:
    // 1 channel, worse; 11 (11/20 > 0.49): rank order twice = 22 GB/s, better; 6 (6/11 > 0.49):
    // 3 × 6 = 18, worse; 3/11 < 0.49 stops. No dup (11 < 25): 2 channels at 11, type SYS.
    let mut xml = Xml::from_file(fixture("azure-ndv5-topo.xml")).unwrap();
    fill_azure(&mut xml, 90, &|_, _| Vec::new(), 400_000, true);
    let sys = System::from_xml_with(xml, PathOptions::default()).unwrap();
    assert_eq!(sys.count(NodeType::Nvs), 0);
    let g = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(g.nchannels, 2);
    assert!(close(g.speed_intra, 11.0), "{}", g.speed_intra);
    assert_eq!(g.type_intra, PathType::Sys);
    assert_eq!(g.rings, sequential(8, 2));
    check_graph(&sys, &g, MAX_CHANNELS);
}

// ---------------------------------------------------------------------------------------------
// Graphs of every pattern, with NETs: a checker that recomputes what NCCL's search charges.

/// The links a hop `from -> to` crosses and the bandwidth it takes on each per GB/s of channel
/// speed: 1, or 1.2 on PCI links of a PHB path that starts at a GPU and crosses an Intel CPU
/// (`INTEL_P2P_OVERHEAD`).
fn hop_costs(sys: &System, from: NodeId, to: NodeId) -> Vec<((usize, usize), f64)> {
    let p = sys.paths().get(from, to).expect("hop without a path");
    let nodes = sys.nodes();
    let intel = p.route.iter().any(|&x| {
        nodes[x.0]
            .cpu()
            .is_some_and(|c| c.arch == CpuArch::X86 && c.vendor == CpuVendor::Intel)
    });
    let mult = if p.kind == PathType::Phb && nodes[from.0].gpu().is_some() && intel {
        1.2
    } else {
        1.0
    };
    let mut prev = from;
    let mut out = Vec::new();
    for &next in &p.route {
        let kind = nodes[prev.0]
            .links
            .iter()
            .filter(|l| l.remote == next)
            .max_by(|a, b| a.bw.total_cmp(&b.bw))
            .map(|l| l.kind)
            .unwrap();
        out.push(((prev.0, next.0), if kind == LinkType::Pci { mult } else { 1.0 }));
        prev = next;
    }
    out
}

/// Checks any graph: `nchannels` channels (1..=max), each a permutation of the system's GPU
/// ranks; every GPU hop within `type_intra` (trees: both ways), every NET hop within
/// `type_inter`; and no link carrying more than its bandwidth, adding up what NCCL charges per
/// channel: a ring's hops (closing hop included, or NET in / NET out), a tree's chain hops
/// forward, its NET in and its way back to the NET (from the first GPU; the second for a split
/// tree; half from each of the first two for a balanced tree).
fn check_any(sys: &System, g: &Graph, max: usize) {
    assert_eq!(g.nchannels, g.intra.len());
    assert!(g.nchannels >= 1 && g.nchannels <= max, "{g:?}");
    let mut ranks: Vec<(usize, NodeId)> = sys
        .ids(NodeType::Gpu)
        .into_iter()
        .map(|id| (sys.node(id).gpu().unwrap().rank as usize, id))
        .collect();
    ranks.sort();
    let id_of = |r: usize| ranks.iter().find(|x| x.0 == r).unwrap().1;
    let all: Vec<usize> = ranks.iter().map(|x| x.0).collect();
    let fallback = g.type_intra == PathType::Sys && close(g.speed_intra, 0.1);
    let mut load: HashMap<(usize, usize), f64> = HashMap::new();
    let mut charge = |from: NodeId, to: NodeId, speed: f64| {
        for (l, m) in hop_costs(sys, from, to) {
            *load.entry(l).or_default() += speed * m;
        }
    };
    let n = all.len();
    for (c, chain) in g.intra.iter().enumerate() {
        let mut sorted = chain.clone();
        sorted.sort();
        assert_eq!(
            sorted, all,
            "channel {c} {chain:?} is not a permutation of the ranks"
        );
        if n > 1 {
            let hops = if g.pattern == Pattern::Ring && g.inter.is_empty() {
                n
            } else {
                n - 1
            };
            for k in 0..hops {
                let (a, b) = (id_of(chain[k]), id_of(chain[(k + 1) % n]));
                assert!(
                    sys.paths().kind(a, b) <= g.type_intra,
                    "channel {c} hop {k}: {g:?}"
                );
                if g.pattern.is_tree() {
                    assert!(
                        sys.paths().kind(b, a) <= g.type_intra,
                        "channel {c} hop {k} back: {g:?}"
                    );
                }
                charge(a, b, g.speed_intra);
            }
        }
        if let Some(&[net_in, net_out]) = g.inter.get(c) {
            let (nin, nout) = (sys.net_by_dev(net_in).unwrap(), sys.net_by_dev(net_out).unwrap());
            let first = id_of(chain[0]);
            assert!(sys.paths().kind(nin, first) <= g.type_inter, "{g:?}");
            charge(nin, first, g.speed_inter);
            let outs: Vec<(NodeId, f64)> = match g.pattern {
                Pattern::Ring => vec![(id_of(chain[n - 1]), 1.0)],
                Pattern::Tree => vec![(first, 1.0)],
                Pattern::SplitTree => vec![(id_of(chain[1.min(n - 1)]), 1.0)],
                Pattern::BalancedTree => vec![(first, 0.5), (id_of(chain[1.min(n - 1)]), 0.5)],
            };
            for (gpu, f) in outs {
                assert!(sys.paths().kind(gpu, nout) <= g.type_inter, "{g:?}");
                charge(gpu, nout, g.speed_inter * f);
            }
        }
    }
    if fallback {
        return;
    }
    for ((from, to), used) in load {
        let node = &sys.nodes()[from];
        let bw = node
            .links
            .iter()
            .filter(|l| l.remote.0 == to)
            .map(|l| l.bw)
            .fold(0.0, f64::max);
        assert!(
            used <= bw + 1e-6,
            "link {} -> {to}: {used} GB/s used of {bw}: {g:?}",
            node.label()
        );
    }
}

fn chains(v: &[&[usize]]) -> Vec<Vec<usize>> {
    v.iter().map(|c| c.to_vec()).collect()
}

#[test]
fn h200x2_tree_matches_nccls_dump() {
    // tests/topo/h200x2-nccl-graph.xml, graph id 1 (pattern 1 = balanced tree): 12 channels at
    // 60 GB/s, NVL; channels 0-5 GPU 0 then 1, channels 6-11 GPU 1 then 0. Derivation: the tree
    // asks exactly the ring's 12 channels; totalBw for trees = 370.8 × 2/1 = 741.6, so the sm90
    // list starts at 60 (60 × 12 <= 741.6). A chain takes 60 forward only: 0 -> 1 six times
    // (PCI order, then replays) fills GPU0 -> NVS (10.8 left); the replay then fails and the
    // search from GPU 1 finds 1 -> 0 six times. 12 = max channels: done. Dup: min(24, 12) = 12,
    // nothing to add.
    let sys = h200x2();
    let ring = search_rings(&sys, MAX_CHANNELS).unwrap();
    let g = search_trees(&sys, ring.nchannels, false).unwrap();
    assert_eq!(g.pattern, Pattern::BalancedTree);
    assert_eq!(
        (g.nchannels, g.speed_intra, g.type_intra),
        (12, 60.0, PathType::Nvl)
    );
    let mut want = vec![vec![0, 1]; 6];
    want.extend(vec![vec![1, 0]; 6]);
    assert_eq!(g.intra, want);
    check_any(&sys, &g, 12);
    let dump = Xml::from_file(fixture("h200x2-nccl-graph.xml")).unwrap();
    let tree = dump
        .root
        .subs
        .iter()
        .find(|s| s.attr("pattern") == Some("1"))
        .unwrap();
    assert_eq!(tree.attr("nchannels"), Some("12"));
    assert_eq!(tree.attr("speedintra"), Some("60"));
    let first: Vec<&str> = tree.subs.iter().map(|c| c.subs[0].attr("dev").unwrap()).collect();
    let want_first: Vec<&str> = want.iter().map(|c| if c[0] == 0 { "0" } else { "0x1" }).collect();
    assert_eq!(first, want_first);
}

#[test]
fn dgx_h100_rings_and_trees() {
    // dgx-h100-topo.xml: 8 × H100, NVLinks to 4 NVSwitches 5 + 4 + 4 + 5 = 18 per GPU, merged
    // into one NVS node: GPU <-> NVS 18 × 20.6 = 370.8 GB/s each way, every GPU pair NVL at
    // 370.8 (maxBw = totalBw = 370.8).
    let sys = load("dgx-h100-topo.xml");
    assert_eq!(sys.count(NodeType::Nvs), 1);
    let gpu0 = sys.gpu_by_rank(0).unwrap();
    let nvs = sys.ids(NodeType::Nvs)[0];
    assert!(close(
        sys.node(gpu0).link_to(nvs, LinkType::Nvl).unwrap().bw,
        370.8
    ));
    // Ring (as NDv5): sm90 list from 60; rank order + replays: floor(370.8 / 60) = 6 channels
    // (360); 50 (7 × 50), 40 (9 × 40 = 360, more hops) and 30 (12 × 30) are not better; 24/60 <
    // 0.49 stops. Dup at 60: 12 channels at 30. Pass 2 (40 with >= 12 channels = 480 > 370.8)
    // finds nothing. NCCL's search reaches the same 6 × 60 (it cannot exceed 370.8 per GPU).
    let ring = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(
        (ring.nchannels, ring.speed_intra, ring.type_intra),
        (12, 30.0, PathType::Nvl)
    );
    assert_eq!(ring.rings, sequential(8, 12));
    check_graph(&sys, &ring, MAX_CHANNELS);
    // Tree: exactly 12 channels; totalBw × 8/7 = 423.8, so the first speed with 12 × speed <=
    // 423.8 is 30 (60, 50, 40 × 12 are above). Rank-order chains, each GPU but the last sending
    // 30 to the NVSwitch: 12 × 30 = 360 <= 370.8, 12 replays = max channels, done. No dup
    // (sm90, 30 < 50, 12 > 4); pass 2 raises the intra speed to 40: 12 × 40 = 480 does not fit.
    let tree = search_trees(&sys, ring.nchannels, false).unwrap();
    assert_eq!(tree.pattern, Pattern::BalancedTree);
    assert_eq!(
        (tree.nchannels, tree.speed_intra, tree.type_intra),
        (12, 30.0, PathType::Nvl)
    );
    assert_eq!(tree.intra, sequential(8, 12));
    check_any(&sys, &tree, 12);
}

#[test]
fn pcie_two_sockets_ring_crosses_the_sockets_once_each_way() {
    // pcie-8gpu-2socket-topo.xml: 8 × sm89 GPUs, PCIe Gen4 x16 = 24 GB/s per GPU and per switch
    // uplink, 2 GPUs per switch, switches A, B on socket 0 (GPUs 0-3), C, D on socket 1; Sapphire
    // Rapids: 22 GB/s between sockets. Paths: same switch PIX, same socket PHB, else SYS.
    let sys = load("pcie-8gpu-2socket-topo.xml");
    let (g0, g1, g2, g4) = (0, 1, 2, 4).map_ids(&sys);
    assert_eq!(sys.paths().kind(g0, g1), PathType::Pix);
    assert_eq!(sys.paths().kind(g1, g2), PathType::Phb);
    assert_eq!(sys.paths().kind(g0, g4), PathType::Sys);
    // Ring: maxBw = totalBw = 24, pre-sm90 list: 40, 30 > 24, start at 20. PIX, PXB, PXN, P2C,
    // PHB: no cycle (it must cross sockets). SYS: rank order 0..7 fits once: PIX hops take 20;
    // PHB hops 1 -> 2 and 5 -> 6 take 20 × 1.2 = 24 on their PCI links (Intel overhead), filling
    // GPU1's and GPU5's uplinks; 3 -> 4 and 7 -> 0 take 20 of the 22 between sockets. No second
    // ring at 20 (every GPU would send 40 > 24). 18, 15, 12 give 1 channel; 10 (10/20 > 0.49)
    // 2 × 10 = 20, not better (more hops); 9/20 < 0.49 stops. 1 channel at 20, no dup (< 25).
    // NCCL cannot do better at its speeds: a GPU sends `speed` per ring on its 24 GB/s link, so
    // 2 rings need speed <= 12, and at 12 or 11 a ring crosses the sockets at least once each
    // way (24 > 22) or uses a PHB hop (1.2 × speed + speed > 24 on that GPU's link).
    let ring = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(
        (ring.nchannels, ring.speed_intra, ring.type_intra),
        (1, 20.0, PathType::Sys)
    );
    assert_eq!(ring.rings, sequential(8, 1));
    check_graph(&sys, &ring, MAX_CHANNELS);
    let pci_check = search_graph(&sys, &GraphRequest::ring(false)).unwrap();
    check_any(&sys, &pci_check, MAX_CHANNELS);
    // Tree: 1 channel (the ring's count): totalBw × 8/7 = 27.4, start at 20; SYS rank-order
    // chain (no closing hop), 1 = max channels: done.
    let tree = search_trees(&sys, 1, false).unwrap();
    assert_eq!(
        (tree.nchannels, tree.speed_intra, tree.type_intra),
        (1, 20.0, PathType::Sys)
    );
    assert_eq!(tree.intra, sequential(8, 1));
    check_any(&sys, &tree, 1);
}

trait MapIds {
    fn map_ids(self, sys: &System) -> (NodeId, NodeId, NodeId, NodeId);
}
impl MapIds for (i32, i32, i32, i32) {
    fn map_ids(self, sys: &System) -> (NodeId, NodeId, NodeId, NodeId) {
        let f = |r| sys.gpu_by_rank(r).unwrap();
        (f(self.0), f(self.1), f(self.2), f(self.3))
    }
}

#[test]
fn nvlink_mesh_with_unequal_links_uses_every_link() {
    // nvlink-mesh-4gpu-topo.xml: 4 × sm80 (20 GB/s per NVLink), links 0-1: 3, 2-3: 3, 1-2: 2,
    // 0-3: 2, 0-2: 1, 1-3: 1 (MESH4); 6 links = 120 GB/s per GPU (totalBw), maxBw 60.
    let sys = load("nvlink-mesh-4gpu-topo.xml");
    for a in 0..4 {
        for b in 0..4 {
            if a != b {
                let (ia, ib) = (sys.gpu_by_rank(a).unwrap(), sys.gpu_by_rank(b).unwrap());
                assert_eq!(sys.paths().kind(ia, ib), PathType::Nvl);
                assert!(close(
                    sys.paths().bw(ia, ib),
                    20.0 * MESH4[a as usize][b as usize] as f64
                ));
            }
        }
    }
    // Ring, speeds 40, 30, 20 (20/40 = 0.5 > 0.49):
    // - 40: 0 1 2 3 (1 -> 2 and 3 -> 0 full), then its reverse 0 3 2 1: GPU 0 has no link with
    //   40 left: 2 × 40 = 80.
    // - 30: only the 3- and 2-link pairs carry 30; 0 1 2 3 and 0 3 2 1 once each (the 2-link
    //   pairs hold one): 60.
    // - 20: 0 1 2 3 twice (1 -> 2, 3 -> 0 full), then the search from 0 by bandwidth: 0 1 3 2,
    //   then 0 3 2 1 twice, then 0 2 3 1: 6 × 20 = 120 = totalBw, every directed link full.
    //   This is the only way to fill all links (solving the 12 link equations over the 6
    //   directed Hamiltonian cycles gives 0123 × 2, 0321 × 2, 0132, 0231), so NCCL's
    //   exhaustive search cannot do more: 120 GB/s is what each GPU can send.
    // No dup (20 < 25).
    let ring = search_rings(&sys, MAX_CHANNELS).unwrap();
    assert_eq!(
        (ring.nchannels, ring.speed_intra, ring.type_intra),
        (6, 20.0, PathType::Nvl)
    );
    let want = chains(&[
        &[0, 1, 2, 3],
        &[0, 1, 2, 3],
        &[0, 1, 3, 2],
        &[0, 3, 2, 1],
        &[0, 3, 2, 1],
        &[0, 2, 3, 1],
    ]);
    assert_eq!(ring.rings, want);
    check_graph(&sys, &ring, MAX_CHANNELS);
    // Tree: exactly 6 channels; totalBw × 4/3 = 160: 40 × 6 and 30 × 6 are above, start at 20.
    // Chains take 20 forward only: 0 1 2 3 twice (1 -> 2 full), then from 0: 0 -> 1 (20 left)
    // -> 3 -> 2; then 0 3 2 1 twice; then 0 -> 2 -> 3 (20 left) -> 1. 6 = max: done.
    let tree = search_trees(&sys, ring.nchannels, false).unwrap();
    assert_eq!(
        (tree.nchannels, tree.speed_intra, tree.pattern),
        (6, 20.0, Pattern::BalancedTree)
    );
    assert_eq!(tree.intra, want);
    check_any(&sys, &tree, 6);
}

/// The graphs of one node of the two-node fixture with NETs (a 16-rank job).
fn two_node_graphs(node: usize) -> (System, Graph, Graph) {
    let sys = load(&format!("dgx-h100-net-node{node}-topo.xml"));
    let ring = search_graph(&sys, &GraphRequest::ring(true)).unwrap();
    let tree = search_trees(&sys, ring.nchannels, true).unwrap();
    (sys, ring, tree)
}

#[test]
fn two_dgx_h100_nodes_with_nics() {
    // dgx-h100-net-node{0,1}-topo.xml: per node 8 × H100 on NVSwitch (370.8 GB/s each), GPU k
    // and NET k (400 Gb/s = 50 GB/s) behind one PCIe Gen5 switch (48 GB/s): GPU k -> NET k PIX,
    // other GPUs reach NET k by PXN (NVLink to GPU k, then its switch); every GPU-NET path 48.
    // With NETs NCCL uses the inter-node speed list (sm90: 48, 45, ...) from maxBw = 48.
    for node in 0..2 {
        let (sys, ring, tree) = two_node_graphs(node);
        let base = 8 * node;
        let gk = |k: usize| sys.gpu_by_rank((base + k) as i32).unwrap();
        assert_eq!(sys.paths().kind(gk(0), sys.net_by_dev(0).unwrap()), PathType::Pix);
        assert_eq!(sys.paths().kind(gk(1), sys.net_by_dev(0).unwrap()), PathType::Pxn);
        // Ring at 48: a channel starts at NET c (NICs in GPU order, rotated by channel), at the
        // GPU closest to it, GPU c. On NVSwitch only neighbours are tried, previous first for
        // rings: c, c-1, ..., c+1. The last GPU must go back to NET c (crossNic 0): PIX fails
        // (it is PXN), PXB fails, PXN fits but each channel then makes every GPU send 48 on
        // NVLink: 7 channels (336; 8 × 48 = 384 > 370.8). Then crossNic 2 at PIX: the last
        // GPU leaves by its own NIC, NET c+1; odd channels come back the other way (start at
        // the previous channel's exit NIC, leave by its entry NIC): c odd runs c, c+1, ..., c-1
        // from NET c to NET c-1. Each GPU is last once, so sends 7 × 48 = 336 <= 370.8 on
        // NVLink: 8 channels × 48 = 384 >= totalBw 370.8: done. No dup (sm90, 48 < 50, 8 > 4).
        assert_eq!(ring.pattern, Pattern::Ring);
        assert_eq!(
            (ring.nchannels, ring.speed_intra, ring.speed_inter),
            (8, 48.0, 48.0)
        );
        assert_eq!(
            (ring.type_intra, ring.type_inter, ring.cross_nic),
            (PathType::Nvl, PathType::Pix, 2)
        );
        for c in 0..8 {
            let order: Vec<usize> = if c % 2 == 0 {
                (0..8).map(|i| base + (c + 8 - i) % 8).collect()
            } else {
                (0..8).map(|i| base + (c + i) % 8).collect()
            };
            assert_eq!(ring.intra[c], order, "ring channel {c}");
            let nets = if c % 2 == 0 { [c, c + 1] } else { [c, c - 1] };
            assert_eq!(ring.inter[c], nets.map(|d| d as i32), "ring channel {c}");
        }
        check_any(&sys, &ring, 32);
        // Tree: exactly 8 channels, totalBw × 8/7 = 423.8 >= 8 × 48: start at 48. The balanced
        // tree (first two GPUs each back to the entry NET at 24) fails at every type tried
        // before the sm90 fallback to a plain tree: the second GPU reaches NET c only by PXN.
        // Tree at PIX: NET c -> GPU c -> (NVSwitch: only the next rank for plain trees) c+1 ->
        // ... -> c-1, and GPU c back to NET c. 8 channels = max: done. Intra-node the chain
        // sends 7 × 48 per GPU over the 8 channels. NCCL reaches the same 8 × 48.
        assert_eq!(tree.pattern, Pattern::Tree);
        assert_eq!(
            (tree.nchannels, tree.speed_intra, tree.speed_inter),
            (8, 48.0, 48.0)
        );
        assert_eq!((tree.type_intra, tree.type_inter), (PathType::Nvl, PathType::Pix));
        for c in 0..8 {
            let order: Vec<usize> = (0..8).map(|i| base + (c + i) % 8).collect();
            assert_eq!(tree.intra[c], order, "tree channel {c}");
            assert_eq!(tree.inter[c], [c as i32, c as i32], "tree channel {c}");
        }
        check_any(&sys, &tree, 8);
    }
}

#[test]
fn two_dgx_h100_nodes_connect_a_double_binary_tree() {
    // Channel 0 of the tree graph: node 0 chain 0..7, node 1 chain 8..15; pattern TREE, so the
    // parent and both child nodes attach to the chain's head. dtree(2): tree 0 = node 0 root
    // with node 1 as its child 1 (ncclGetBtree(2, 0): d1 = 1); tree 1 mirrored: node 1 root,
    // node 0 its child. Depth = 16/2 - 1 + log2(2) = 8.
    let (_, _, t0) = two_node_graphs(0);
    let (_, _, t1) = two_node_graphs(1);
    let chains = [t0.intra[0].clone(), t1.intra[0].clone()];
    let [a, b] = double_binary_tree(&chains, t0.pattern).unwrap();
    let tr = |up: i32, down: [i32; 3]| Tree { depth: 8, up, down };
    assert_eq!(a[0], tr(-1, [1, 8, -1]));
    assert_eq!(a[8], tr(0, [9, -1, -1]));
    assert_eq!(a[7], tr(6, [-1, -1, -1]));
    assert_eq!(a[15], tr(14, [-1, -1, -1]));
    assert_eq!(b[8], tr(-1, [9, 0, -1]));
    assert_eq!(b[0], tr(8, [1, -1, -1]));
    check_trees(&[a, b], &chains);
}

/// Every rank once per tree (one root, every other rank the child of its parent), parents and
/// children consistent, at most 3 children, and every rank reachable from the root.
fn check_trees(trees: &[Vec<Tree>; 2], chains: &[Vec<usize>]) {
    let nranks: usize = chains.iter().map(Vec::len).sum();
    for (t, tree) in trees.iter().enumerate() {
        assert_eq!(tree.len(), nranks);
        let roots: Vec<usize> = (0..nranks).filter(|&r| tree[r].up == -1).collect();
        assert_eq!(roots.len(), 1, "tree {t}: roots {roots:?}");
        let mut child_count = vec![0; nranks];
        for (r, node) in tree.iter().enumerate() {
            for c in node.children() {
                assert_eq!(
                    tree[c].up, r as i32,
                    "tree {t}: {c} is a child of {r} but its parent is {}",
                    tree[c].up
                );
                child_count[c] += 1;
            }
            if node.up >= 0 {
                assert!(
                    tree[node.up as usize].children().any(|c| c == r),
                    "tree {t}: {r}'s parent lacks it"
                );
            }
        }
        for (r, &k) in child_count.iter().enumerate() {
            assert_eq!(
                k,
                usize::from(r != roots[0]),
                "tree {t}: rank {r} appears {k} times as a child"
            );
        }
        let mut seen = vec![false; nranks];
        let mut stack = vec![roots[0]];
        while let Some(r) = stack.pop() {
            assert!(!seen[r]);
            seen[r] = true;
            stack.extend(tree[r].children());
        }
        assert!(seen.iter().all(|&s| s), "tree {t}: not every rank reachable");
    }
}

#[test]
fn double_binary_trees_for_node_counts() {
    // ncclGetBtree: a node's lowest set bit b; parent (r ^ b) | 2b, or r ^ b when that is out of
    // range; children r - b/2 and r + b/2 (halved towards r until in range); node 0's child is
    // the highest power of two below n. Tree 1: mirror r -> n-1-r (even n), shift r -> r+1 mod n
    // (odd n). Parents by hand, per n, tree 0 then tree 1:
    let parents: [(usize, &[i32], &[i32]); 7] = [
        (1, &[-1], &[-1]),
        (2, &[-1, 0], &[1, -1]),
        (3, &[-1, 2, 0], &[1, -1, 0]),
        (4, &[-1, 2, 0, 2], &[1, 3, 1, -1]),
        (5, &[-1, 2, 4, 2, 0], &[1, -1, 3, 0, 3]),
        (8, &[-1, 2, 4, 2, 0, 6, 4, 6], &[1, 3, 1, 7, 5, 3, 5, -1]),
        (
            16,
            &[-1, 2, 4, 2, 8, 6, 4, 6, 0, 10, 12, 10, 8, 14, 12, 14],
            &[1, 3, 1, 7, 5, 3, 5, 15, 9, 11, 9, 7, 13, 11, 13, -1],
        ),
    ];
    for (n, p0, p1) in parents {
        let got: Vec<[i32; 2]> = (0..n).map(|r| dtree(n, r).unwrap().map(|b| b.up)).collect();
        let want: Vec<[i32; 2]> = (0..n).map(|r| [p0[r], p1[r]]).collect();
        assert_eq!(got, want, "n = {n}");
        // One GPU per node: the rank trees are the node trees.
        let chains: Vec<Vec<usize>> = (0..n).map(|r| vec![r]).collect();
        let trees = double_binary_tree(&chains, Pattern::Tree).unwrap();
        for r in 0..n {
            assert_eq!([trees[0][r].up, trees[1][r].up], want[r], "n = {n}, rank {r}");
        }
        check_trees(&trees, &chains);
        assert_eq!(dtree_roots(n), [0, if n % 2 == 1 && n > 1 { 1 } else { n - 1 }]);
    }
    // Children, n = 5: tree 0: 0 -> (-, 4), 4 -> (2, -), 2 -> (1, 3); tree 1 (shift): 1 -> (-, 0),
    // 0 -> (3, -), 3 -> (2, 4). n = 8: tree 0: 0 -> (-, 4), 4 -> (2, 6), 2 -> (1, 3), 6 -> (5, 7);
    // tree 1 (mirror): 7 -> (-, 3), 3 -> (5, 1), 5 -> (6, 4), 1 -> (2, 0).
    let kids = |n, r, t: usize| {
        let b = dtree(n, r).unwrap()[t];
        (b.down0, b.down1)
    };
    assert_eq!(
        [kids(5, 0, 0), kids(5, 4, 0), kids(5, 2, 0)],
        [(-1, 4), (2, -1), (1, 3)]
    );
    assert_eq!(
        [kids(5, 1, 1), kids(5, 0, 1), kids(5, 3, 1)],
        [(-1, 0), (3, -1), (2, 4)]
    );
    assert_eq!(
        [kids(8, 0, 0), kids(8, 4, 0), kids(8, 2, 0), kids(8, 6, 0)],
        [(-1, 4), (2, 6), (1, 3), (5, 7)]
    );
    assert_eq!(
        [kids(8, 7, 1), kids(8, 3, 1), kids(8, 5, 1), kids(8, 1, 1)],
        [(-1, 3), (5, 1), (6, 4), (2, 0)]
    );
    assert_eq!(kids(1, 0, 0), (-1, -1));
    assert!(dtree(4, 4).is_err() && btree(0, 0).is_err());
}

#[test]
fn each_node_is_interior_in_at_most_one_tree() {
    // For even n every node has children in exactly one tree (tree 0: the even nodes, tree 1 by
    // the mirror the odd ones). For odd n NCCL's shifted tree makes node 0 interior in both (it
    // is tree 0's root and, shifted from node n-1, an interior node of tree 1); every other node
    // is interior in exactly one. Checked for 1..=64 nodes.
    for n in 1..=64usize {
        for r in 0..n {
            let t = dtree(n, r).unwrap();
            let interior = t.iter().filter(|b| b.down0 != -1 || b.down1 != -1).count();
            let want = if n == 1 {
                0
            } else if n % 2 == 1 && r == 0 {
                2
            } else {
                1
            };
            assert_eq!(interior, want, "n = {n}, node {r}: {t:?}");
        }
    }
}

#[test]
fn balanced_tree_attaches_children_on_both_gpus() {
    // 3 nodes of 2 GPUs: chains [0, 1], [2, 3], [4, 5], balanced tree: a node's parent link
    // leaves from its head, child node 0 attaches to the second GPU, child node 1 to the first.
    // dtree(3): tree 0: node 0 root with child 1 = node 2; node 2's child 0 = node 1. Tree 1
    // (shift by one): node 1 root with child 1 = node 0; node 0's child 0 = node 2.
    // Depth = 6/3 - 1 + log2(3) = 2.
    let chains = chains(&[&[0, 1], &[2, 3], &[4, 5]]);
    let [a, b] = double_binary_tree(&chains, Pattern::BalancedTree).unwrap();
    let tr = |up: i32, down: [i32; 3]| Tree { depth: 2, up, down };
    let want_a = [
        tr(-1, [1, 4, -1]),
        tr(0, [-1, -1, -1]),
        tr(5, [3, -1, -1]),
        tr(2, [-1, -1, -1]),
        tr(0, [5, -1, -1]),
        tr(4, [2, -1, -1]),
    ];
    let want_b = [
        tr(2, [1, -1, -1]),
        tr(0, [4, -1, -1]),
        tr(-1, [3, 0, -1]),
        tr(2, [-1, -1, -1]),
        tr(1, [5, -1, -1]),
        tr(4, [-1, -1, -1]),
    ];
    assert_eq!(a, want_a);
    assert_eq!(b, want_b);
    check_trees(&[a, b], &chains);
    // Split tree: both children on the second GPU. Tree 0: node 2 hangs below rank 1.
    let [a, _] = double_binary_tree(&chains, Pattern::SplitTree).unwrap();
    assert_eq!((a[4].up, a[1].down), (1, [4, -1, -1]));
    // Bad input.
    for bad in [vec![], vec![vec![0], vec![0]], vec![vec![0, 2]], vec![vec![]]] {
        let e = double_binary_tree(&bad, Pattern::Tree).unwrap_err();
        assert_eq!(e.code(), oxccl::ResultCode::InvalidArgument, "{bad:?}: {e}");
    }
    assert!(double_binary_tree(&chains, Pattern::Ring).is_err());
}

#[test]
fn speed_lists_inter_are_nccls() {
    // search.cc: speedArrayInter, sm90SpeedArrayInter, sm100SpeedArrayInter (2.28).
    assert_eq!(speed_array_inter(80)[..4], [48.0, 30.0, 28.0, 24.0]);
    assert_eq!(speed_array_inter(80).len(), 19);
    assert_eq!(speed_array_inter(90)[..5], [48.0, 45.0, 42.0, 40.0, 30.0]);
    assert_eq!(speed_array_inter(100)[..4], [96.0, 86.0, 80.0, 48.0]);
}

#[test]
fn graph_searches_are_fast() {
    // Target: <= 100 ms per 8-GPU search (ring then tree); asserted loosely (2 s) since CI
    // machines are shared. Best of 3, printed.
    for f in [
        "dgx-h100-topo.xml",
        "pcie-8gpu-2socket-topo.xml",
        "dgx-h100-net-node0-topo.xml",
    ] {
        let sys = load(f);
        let inter = sys.count(NodeType::Net) > 0;
        let mut best = Duration::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let ring = search_graph(&sys, &GraphRequest::ring(inter)).unwrap();
            let tree = search_trees(&sys, ring.nchannels, inter).unwrap();
            best = best.min(t.elapsed());
            assert!(tree.nchannels > 0);
        }
        eprintln!(
            "ring + tree search {f}: {:.3} ms (best of 3)",
            best.as_secs_f64() * 1e3
        );
        assert!(best < Duration::from_secs(2), "{f}: {best:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Property test: random topologies give valid rings and trees.

/// A random one-node topology: `n` GPUs (1-8) of one compute capability over 1 or 2 CPUs, each
/// GPU under a PCI switch or directly under its CPU, and NVLinks: all GPUs to an NVSwitch with
/// `nvs_links` links each (mode 0), direct NVLinks with `counts` links per pair (mode 1), or none
/// (mode 2).
#[derive(Clone, Debug)]
struct RandomTopo {
    n: usize,
    sm: u32,
    mode: u8,
    nvs_links: u32,
    /// Links per GPU pair (i < j), in pair order.
    counts: Vec<u32>,
    /// Per GPU: its CPU and whether it sits under a PCI switch (shared by consecutive GPUs on
    /// the same CPU with the flag set, at most 2 per switch).
    place: Vec<(usize, bool)>,
    ncpu: usize,
}

impl RandomTopo {
    fn xml(&self) -> String {
        let bus = |g: usize| format!("0000:{:02x}:00.0", 0x10 + g);
        let pair = |i: usize, j: usize| {
            let (a, b) = (i.min(j), i.max(j));
            // Index of (a, b) among pairs in order (0,1), (0,2), ..., (1,2), ...
            a * (2 * self.n - a - 1) / 2 + (b - a - 1)
        };
        let gpu_xml = |g: usize, indent: &str| {
            let mut s = format!(
                "{indent}<pci busid=\"{}\" class=\"0x030200\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">\n\
                 {indent}  <gpu dev=\"{g}\" sm=\"{}\" rank=\"{g}\" gdr=\"1\">\n",
                bus(g),
                self.sm
            );
            if self.mode == 0 {
                s += &format!(
                    "{indent}    <nvlink target=\"fffffff:ff:ff.0\" count=\"{}\" tclass=\"0x068000\"/>\n",
                    self.nvs_links
                );
            }
            if self.mode == 1 {
                for j in (0..self.n).filter(|&j| j != g) {
                    let c = self.counts[pair(g, j)];
                    if c > 0 {
                        s += &format!(
                            "{indent}    <nvlink target=\"{}\" count=\"{c}\" tclass=\"0x030200\"/>\n",
                            bus(j)
                        );
                    }
                }
            }
            s + &format!("{indent}  </gpu>\n{indent}</pci>\n")
        };
        let mut cpus = vec![String::new(); self.ncpu];
        let mut g = 0;
        let mut sw = 0;
        while g < self.n {
            let (c, under) = self.place[g];
            let c = c % self.ncpu;
            if under {
                let mut k = 1;
                if g + 1 < self.n && self.place[g + 1].1 && self.place[g + 1].0 % self.ncpu == c {
                    k = 2;
                }
                cpus[c] += &format!(
                    "    <pci busid=\"0000:{:02x}:00.0\" class=\"0x060400\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">\n",
                    0x80 + sw
                );
                sw += 1;
                for _ in 0..k {
                    cpus[c] += &gpu_xml(g, "      ");
                    g += 1;
                }
                cpus[c] += "    </pci>\n";
            } else {
                cpus[c] += &gpu_xml(g, "    ");
                g += 1;
            }
        }
        let mut s = String::from("<system version=\"1\">\n");
        for (c, body) in cpus.iter().enumerate() {
            s += &format!(
                "  <cpu numaid=\"{c}\" arch=\"x86_64\" vendor=\"GenuineIntel\" familyid=\"6\" modelid=\"143\">\n{body}  </cpu>\n"
            );
        }
        s + "</system>\n"
    }
}

fn random_topo() -> impl proptest::strategy::Strategy<Value = RandomTopo> {
    use proptest::prelude::*;
    (
        1usize..=8,
        prop::sample::select(vec![70u32, 80, 90, 100]),
        0u8..3,
        1u32..=18,
        1usize..=2,
    )
        .prop_flat_map(|(n, sm, mode, nvs_links, ncpu)| {
            (
                prop::collection::vec(0u32..4, n * (n - 1) / 2),
                prop::collection::vec((0usize..2, any::<bool>()), n),
            )
                .prop_map(move |(counts, place)| RandomTopo {
                    n,
                    sm,
                    mode,
                    nvs_links,
                    counts,
                    place,
                    ncpu,
                })
        })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 128, ..Default::default() })]

    /// Random topologies (1-8 GPUs; NVSwitch with 1-18 links, random direct NVLink counts 0-3
    /// per pair, or PCI only; 1 or 2 sockets; PCI switches): the ring graph has valid rings
    /// (each rank once per channel, so every rank's prev and next are consistent: next(prev(r))
    /// = r, no link oversubscribed), the tree graph valid chains, and the double binary tree
    /// over 1-5 such nodes valid trees (every rank once, parents and children consistent).
    #[test]
    fn random_topologies_give_valid_rings_and_trees(t in random_topo(), max in 1usize..=32, nnodes in 1usize..=5) {
        let text = t.xml();
        let sys = System::from_xml_with(Xml::parse(&text, "random.xml").unwrap(), PathOptions::default()).unwrap();
        let ring = search_graph(&sys, &GraphRequest { max_channels: max, ..GraphRequest::ring(false) }).unwrap();
        check_any(&sys, &ring, max);
        for r in &ring.intra {
            // prev/next per rank, as a channel's ring connects them.
            let n = r.len();
            let pos = |x: usize| r.iter().position(|&y| y == x).unwrap();
            for &x in r {
                let next = r[(pos(x) + 1) % n];
                let prev = r[(pos(next) + n - 1) % n];
                proptest::prop_assert_eq!(prev, x);
            }
        }
        let tree = search_trees(&sys, ring.nchannels, false).unwrap();
        proptest::prop_assert!(tree.pattern.is_tree());
        check_any(&sys, &tree, ring.nchannels);
        let n = t.n;
        let node_chains: Vec<Vec<usize>> =
            (0..nnodes).map(|k| tree.intra[0].iter().map(|&r| k * n + r).collect()).collect();
        let trees = double_binary_tree(&node_chains, tree.pattern).unwrap();
        check_trees(&trees, &node_chains);
    }
}
