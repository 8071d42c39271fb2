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
//! The Azure files are PCI-only; GPUs and NVLinks are filled in as tests/topo.rs does (the
//! helper is copied below), with the same stated assumptions about each VM.
mod common;

use common::topo::{CUBE_MESH, close, cube_mesh_nvlinks, fill_azure, fixture};
use oxccl::graph::{RingGraph, search_rings, speed_array_intra};
use oxccl::topo::{NodeType, NvLinkFill, PathOptions, PathType, System, Xml};
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
    // The NDv5 PCI tree alone (no NVLink, as in tests/topo.rs): PCI Gen5 x16 = 48 GB/s per GPU
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
