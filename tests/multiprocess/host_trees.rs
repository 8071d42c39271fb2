//! Trees of `Comm::init_rank` communicators across simulated hosts (tree edges over SHM inside a
//! host, NET through the proxy between hosts), ranks as processes (`host_ranks`):
//! - case C11 (B): connection steps starting just below the LL flag period, 2^32 and the second
//!   period (and near the largest start the hook takes), then 1000 tree AllReduces on LL, LL128
//!   and Simple, each checked, also with the tuner switching protocols;
//! - case C12: odd line counts and the smallest accepted FIFOs, channel counts 1..64, unaligned
//!   buffers, several sockets per connection;
//! - the tuner switching protocols and algorithms back to back on the same connections;
//! - case C15: unequal hosts, three hosts, hosts whose ranks are not contiguous, NCCL_SHM_DISABLE
//!   on some ranks; trees with every edge over NET (2..7 hosts, the pattern hooks);
//! - two communicators at once and re-init; case C13 (Broadcast refused under NCCL_ALGO=tree).
use crate::host_ranks::{Env, SECS, hosts, kv, must_pass, tree_small, used_line};
use oxccl::Proto;

#[test]
fn ll_flag_wrap_on_trees_across_two_hosts_every_protocol() {
    // Hosts A {0, 1} and B {2, 3}: chains over SHM, 0 and 2 joined over NET (proxy). The
    // connections start 40 steps below the LL flag period (2^31 − 1), below 2^32 and below the
    // second period; 1000 tree AllReduces (counts 4, 700, 3001 u32 in turn: 1 to several FIFO
    // steps each) must be exact on every protocol.
    let p = (1u64 << 31) - 1;
    for (proto, start) in [
        ("LL", p - 40),
        ("LL", (1 << 32) - 40),
        ("LL", 2 * p - 40),
        ("LL128", p - 40),
        ("LL128", (1 << 32) - 40),
        ("Simple", p - 40),
        ("Simple", (1 << 32) - 40),
        // The largest start the hook accepts (i64::MAX / 2) and just below a multiple of the
        // flag period near it: no step arithmetic may overflow or lose the period.
        ("LL", (i64::MAX / 2) as u64 - 1200),
        ("LL128", (i64::MAX / 2) as u64 - 1200),
        ("Simple", (i64::MAX / 2) as u64 - 1200),
        ("LL", ((i64::MAX / 2) as u64 / p) * p - 40),
    ] {
        let mut common = tree_small(proto);
        common.push(("OXCCL_TEST_INITIAL_STEP", start.to_string()));
        common.push(("OXCCL_CHILD_ITERS", "1000".to_string()));
        must_pass(
            &format!("flag wrap {proto} from {start}"),
            "wrap",
            &common,
            &hosts(&["a", "a", "b", "b"]),
            SECS(90),
        );
    }
}

#[test]
fn ll_flag_wrap_with_the_tuner_switching_protocols() {
    // NCCL_PROTO lists every protocol (which enables LL128 over host memory too): counts 2 ..
    // 600 000 u32 make the tuner pick LL, LL128 and Simple (and 1 or 2 channels) in turn on the
    // same tree connections while their steps cross the LL flag period and 2^32.
    let p = (1u64 << 31) - 1;
    for start in [p - 30, (1u64 << 32) - 30] {
        let common = kv(&[
            ("NCCL_ALGO", "tree"),
            ("NCCL_PROTO", "LL,LL128,Simple"),
            ("OXCCL_CHILD_WANT_ALGO", "tree"),
            ("NCCL_MAX_NCHANNELS", "2"),
            ("OXCCL_CHILD_ITERS", "240"),
            ("OXCCL_CHILD_COUNTS", "2,2048,9000,32768,600000,1,2050,333"),
            ("OXCCL_TEST_INITIAL_STEP", &start.to_string()),
        ]);
        let outs = must_pass(
            &format!("flag wrap, auto protocol, from {start}"),
            "wrap",
            &common,
            &hosts(&["a", "a", "b", "b"]),
            SECS(90),
        );
        let used = used_line(&outs[0]);
        assert_eq!(
            used, "USED [(Tree, Ll), (Tree, Ll128), (Tree, Simple)]",
            "the protocols did not all take turns"
        );
    }
}

#[test]
fn odd_and_smallest_fifos_and_channel_counts_on_trees_over_net() {
    // Hosts A {0, 1}, B {2, 3}, C {4}: two NET levels of the double binary tree. Each variant
    // forces the tree and one protocol; int32 and float sum over 1, 1001 and 40 000 elements, in
    // and out of place, exact.
    let variants: Vec<(&str, Env)> = vec![
        // 65 LL lines per step (an odd line count: 520 data bytes, not a whole 16-byte pack).
        ("LL", kv(&[("NCCL_LL_BUFFSIZE", "8320")])),
        // The smallest LL FIFO: 64 lines per step.
        ("LL", kv(&[("NCCL_LL_BUFFSIZE", "8192")])),
        // 9 LL128 lines per step (odd), and the smallest (8 lines).
        ("LL128", kv(&[("NCCL_LL128_BUFFSIZE", "9216")])),
        ("LL128", kv(&[("NCCL_LL128_BUFFSIZE", "8192")])),
        // 131074 rounds down to 131072 (with a warning).
        ("LL128", kv(&[("NCCL_LL128_BUFFSIZE", "131074")])),
        // The smallest Simple FIFO (1 KiB slots), an odd pack count per slot (1040-byte slots),
        // and 1 000 000 (rounded down to 999 936: 124 992-byte slots).
        ("Simple", kv(&[("NCCL_BUFFSIZE", "8192")])),
        ("Simple", kv(&[("NCCL_BUFFSIZE", "8320")])),
        ("Simple", kv(&[("NCCL_BUFFSIZE", "1000000")])),
        // 3 000 000 (374 992-byte slots, halved for large calls to 187 488 / 93 744-byte chunks
        // while fewer than 8 chunks per channel and tree level) and the default 4 MiB, with a
        // call of 1 000 003 elements (several MB: the halving loop of plan()).
        (
            "Simple",
            kv(&[
                ("NCCL_BUFFSIZE", "3000000"),
                ("OXCCL_CHILD_COUNTS", "1,40000,1000003"),
            ]),
        ),
        (
            "Simple",
            kv(&[
                ("NCCL_BUFFSIZE", "4194304"),
                ("OXCCL_CHILD_COUNTS", "1001,1000003"),
            ]),
        ),
        // Element-aligned but not 16-byte-aligned buffers (send 4 bytes in, receive 12 bytes in,
        // int32/float; in place at 4 bytes).
        ("LL", kv(&[("OXCCL_CHILD_SOFF", "4"), ("OXCCL_CHILD_ROFF", "12")])),
        (
            "LL128",
            kv(&[("OXCCL_CHILD_SOFF", "4"), ("OXCCL_CHILD_ROFF", "12")]),
        ),
        (
            "Simple",
            kv(&[("OXCCL_CHILD_SOFF", "4"), ("OXCCL_CHILD_ROFF", "12")]),
        ),
        // half at 2-byte offsets.
        (
            "Simple",
            kv(&[
                ("OXCCL_CHILD_SOFF", "2"),
                ("OXCCL_CHILD_ROFF", "6"),
                ("OXCCL_CHILD_DTYPES", "half,int8"),
            ]),
        ),
        (
            "LL",
            kv(&[
                ("OXCCL_CHILD_SOFF", "2"),
                ("OXCCL_CHILD_ROFF", "6"),
                ("OXCCL_CHILD_DTYPES", "half,int8"),
            ]),
        ),
        // NTHREADS is a GPU setting; odd values are rounded, results must not change.
        (
            "LL",
            kv(&[("NCCL_NTHREADS", "100"), ("NCCL_LL_BUFFSIZE", "8320")]),
        ),
        // Channel counts: every channel used (MIN = MAX), and MIN above MAX.
        // (OXCCL_CHILD_WANT_NCH: every call must run on exactly that many channels.)
        (
            "LL",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "1"),
                ("NCCL_MIN_NCHANNELS", "1"),
                ("OXCCL_CHILD_WANT_NCH", "1"),
            ]),
        ),
        (
            "Simple",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "3"),
                ("NCCL_MIN_NCHANNELS", "3"),
                ("OXCCL_CHILD_WANT_NCH", "3"),
            ]),
        ),
        (
            "LL128",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "5"),
                ("NCCL_MIN_NCHANNELS", "5"),
                ("OXCCL_CHILD_WANT_NCH", "5"),
            ]),
        ),
        (
            "LL",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "8"),
                ("NCCL_MIN_NCHANNELS", "8"),
                ("OXCCL_CHILD_WANT_NCH", "8"),
            ]),
        ),
        (
            "Simple",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "8"),
                ("NCCL_MIN_NCHANNELS", "8"),
                ("OXCCL_CHILD_WANT_NCH", "8"),
            ]),
        ),
        (
            "LL128",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "3"),
                ("NCCL_MIN_NCHANNELS", "8"),
                ("OXCCL_CHILD_WANT_NCH", "3"),
            ]),
        ),
        // The most channels (64: tree NET tags TREE_TAG + c and + 0x100 + c, 64 proxy
        // connections per direction and tree edge).
        (
            "LL",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "64"),
                ("NCCL_MIN_NCHANNELS", "64"),
                ("OXCCL_CHILD_WANT_NCH", "64"),
                ("OXCCL_CHILD_COUNTS", "1,1001,300001"),
            ]),
        ),
        // Several data sockets per NET connection (2 threads × 3 sockets) with the default
        // 4 MiB FIFOs: tree Simple steps split across sockets, partial steps included.
        (
            "Simple",
            kv(&[
                ("NCCL_BUFFSIZE", "4194304"),
                ("NCCL_SOCKET_NTHREADS", "2"),
                ("NCCL_NSOCKS_PERTHREAD", "3"),
                ("OXCCL_CHILD_COUNTS", "1,1001,1000003,333333"),
            ]),
        ),
    ];
    for (proto, extra) in variants {
        let mut common = tree_small(proto);
        for (k, v) in extra.iter() {
            common.retain(|(x, _)| x != k);
            common.push((k, v.clone()));
        }
        must_pass(
            &format!("c12 {proto} {extra:?}"),
            "ar",
            &common,
            &hosts(&["a", "a", "b", "b", "c"]),
            SECS(60),
        );
    }
}

#[test]
fn tuner_switches_protocols_and_algorithms_back_to_back() {
    // No NCCL_ALGO; NCCL_PROTO lists all three (LL128 on over host memory): sizes from 1 element
    // to 4 MiB make the tuner pick tree LL, tree LL128, tree Simple, ring LL, ring LL128 and
    // ring Simple, one call after the other on the same connections, in and out of place; two
    // and three hosts; int32 and half, sum and max.
    let counts = "1,7,1024,2048,2050,4096,8192,30000,32768,70001,262144,1048576";
    for layout in [&["a", "a", "b", "b"][..], &["a", "b", "b", "c", "c", "c"][..]] {
        let common = kv(&[
            ("NCCL_PROTO", "LL,LL128,Simple"),
            ("NCCL_MAX_NCHANNELS", "2"),
            ("OXCCL_CHILD_DTYPES", "int32,half"),
            ("OXCCL_CHILD_OPS", "sum,max"),
            ("OXCCL_CHILD_COUNTS", counts),
        ]);
        let outs = must_pass(
            &format!("auto protocols {layout:?}"),
            "ar",
            &common,
            &hosts(layout),
            SECS(120),
        );
        let used = used_line(&outs[0]);
        for want in ["(Tree, Ll)", "(Tree, Ll128)", "(Tree, Simple)", "(Ring, Simple)"] {
            assert!(used.contains(want), "{layout:?}: {want} never chosen: {used}");
        }
    }
}

#[test]
fn unequal_and_non_contiguous_hosts_and_shm_disabled_ranks() {
    // Tree forced on every protocol for: 1 + 3 ranks; 3 + 1 + 2; hosts a, b, a, b (every ring
    // edge crosses hosts, the chains are 0-2 and 1-3); a, b, b, a, c; NCCL_SHM_DISABLE=1 on one
    // rank of a host only (its chain edge goes over NET); SHM disabled on one whole host.
    let shm_off = |mut e: Vec<Env>, ranks: &[usize]| {
        for &r in ranks {
            e[r].push(("NCCL_SHM_DISABLE", "1".to_string()));
        }
        e
    };
    let layouts: Vec<(&str, Vec<Env>)> = vec![
        ("1+3", hosts(&["a", "b", "b", "b"])),
        ("3+1+2", hosts(&["a", "a", "a", "b", "c", "c"])),
        ("abab", hosts(&["a", "b", "a", "b"])),
        ("abbac", hosts(&["a", "b", "b", "a", "c"])),
        (
            "shm off on rank 1",
            shm_off(hosts(&["a", "a", "a", "b", "b"]), &[1]),
        ),
        (
            "shm off on host b",
            shm_off(hosts(&["a", "a", "b", "b", "b"]), &[2, 3, 4]),
        ),
    ];
    for (what, envs) in &layouts {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = tree_small(proto);
            common.push(("OXCCL_CHILD_COUNTS", "1,1001,40000".to_string()));
            let outs = must_pass(&format!("c15 {what} {proto}"), "ar", &common, envs, SECS(60));
            if *what == "abab" {
                // The ring visits each host's ranks together (0 2 1 3, as NCCL's rings visit a
                // node's GPUs together): 0 -> 2 and 1 -> 3 over SHM, 2 -> 1 and 3 -> 0 over NET;
                // the tree chains are 0-2 and 1-3.
                let want = [
                    "Trees [0] 2/1/-1->0->-1",
                    "Trees [0] 3/-1/-1->1->0",
                    "Trees [0] -1/-1/-1->2->0",
                    "Trees [0] -1/-1/-1->3->1",
                ];
                for (r, w) in want.iter().enumerate() {
                    assert!(outs[r].contains(w), "abab: rank {r}: no {w:?} in\n{}", outs[r]);
                    let (next, via) = [(2, "SHM"), (3, "SHM"), (1, "NET"), (0, "NET")][r];
                    let ring = format!("Channel 00 : {r} -> {next} via {via}");
                    assert!(outs[r].contains(&ring), "abab: rank {r}: no {ring:?}");
                }
            }
        }
    }
}

#[test]
fn tree_shapes_with_every_edge_over_net() {
    // Every rank its own host (every tree and ring edge over NET): 2 ranks (ring and tree
    // connect the same pair on every channel, on their own sockets), 7 ranks (a deeper double
    // binary tree, an odd node count), and 6 hosts with the pattern hooks "split" and "tree"
    // (a node with three children); AllReduce on each protocol, tree forced, then for 2 ranks
    // 4 hosts with the algorithm and protocol left to the tuner (ring and tree calls take turns
    // on the same connections).
    let cases: Vec<(&str, usize, Option<&str>, Option<&str>)> = vec![
        ("2 hosts", 2, None, Some("tree")),
        ("4 hosts, tuner", 4, None, None),
        ("7 hosts", 7, None, Some("tree")),
        ("6 hosts split", 6, Some("split"), Some("tree")),
        ("6 hosts tree", 6, Some("tree"), Some("tree")),
    ];
    for (what, n, pattern, algo) in cases {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = tree_small(proto);
            common.retain(|(k, _)| *k != "NCCL_ALGO" && *k != "OXCCL_CHILD_WANT_ALGO");
            if let Some(a) = algo {
                common.push(("NCCL_ALGO", a.to_string()));
                common.push(("OXCCL_CHILD_WANT_ALGO", a.to_string()));
            } else {
                if proto != "LL" {
                    continue;
                }
                common.retain(|(k, _)| *k != "NCCL_PROTO" && *k != "OXCCL_CHILD_WANT_PROTO");
                common.push(("NCCL_PROTO", "LL,LL128,Simple".to_string()));
                common.push(("OXCCL_CHILD_COUNTS", "1,1001,2048,8192,32768,300000".to_string()));
            }
            if let Some(p) = pattern {
                common.push(("OXCCL_TEST_TREE_PATTERN", p.to_string()));
            }
            let names: Vec<String> = (0..n).map(|r| format!("solo{r}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let what = if algo.is_some() {
                format!("{what} {proto}")
            } else {
                what.to_string()
            };
            let outs = must_pass(&what, "ar", &common, &hosts(&names), SECS(60));
            if algo.is_none() {
                let used = used_line(&outs[0]);
                assert!(used.contains("Tree") && used.contains("Ring"), "{what}: {used}");
            }
        }
    }
}

#[test]
fn two_communicators_at_once_and_reinit_across_hosts() {
    // Hosts A {0, 1}, B {2}, C {3, 4}: two communicators of the same ranks whose tree NET
    // connections share each process's proxy thread, AllReduces queued on both from two threads
    // at once; then three communicators created and destroyed one after the other.
    for proto in ["LL", "Simple", "LL128"] {
        let common = tree_small(proto);
        let envs = hosts(&["a", "a", "b", "c", "c"]);
        let outs = must_pass(
            &format!("two communicators {proto}"),
            "two",
            &common,
            &envs,
            SECS(60),
        );
        let want = format!(
            "TWO Some((Tree, {:?})) Some((Tree, {:?}))",
            Proto::from_name(proto).unwrap(),
            Proto::from_name(proto).unwrap()
        );
        assert!(outs[0].contains(&want), "{proto}: no {want:?} in\n{}", outs[0]);
        let outs = must_pass(&format!("reinit {proto}"), "reinit", &common, &envs, SECS(60));
        for k in 0..3 {
            assert!(
                outs[4].contains(&format!("REINIT {k} ok Some((Tree, ")),
                "{proto}:\n{}",
                outs[4]
            );
        }
    }
}

#[test]
fn broadcast_refused_under_tree_only_and_the_tree_stays_in_step() {
    // Case C13 on a communicator with trees across hosts: NCCL_ALGO=tree and NCCL_PROTO=LL; a
    // Broadcast (ring only) must be refused with an error naming the op on every rank, not fall
    // back to another algorithm or protocol, and the tree AllReduces after it must be exact.
    let common = kv(&[("NCCL_ALGO", "tree"), ("NCCL_PROTO", "LL")]);
    let outs = must_pass("c13", "c13", &common, &hosts(&["a", "b", "b"]), SECS(60));
    for (r, o) in outs.iter().enumerate() {
        let l = o.lines().find(|l| l.starts_with("C13-BCAST")).unwrap_or_default();
        assert!(
            l.starts_with("C13-BCAST-ERR InvalidArgument") && l.contains("broadcast"),
            "rank {r}: {l}"
        );
        assert!(o.contains("C13-AR [] Some(Tree)"), "rank {r}:\n{o}");
    }
}
