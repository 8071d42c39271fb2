//! Tree AllReduce on the CPU target over simulated multi-node topologies: `OXCCL_TEST_NODES=N`
//! splits `Comm::init_all`'s ranks into N equal nodes of consecutive ranks, which sets up the
//! double binary tree across the nodes with a chain inside each node (tree 0 on even channels,
//! tree 1 on odd ones), and `NCCL_ALGO=tree` forces it.
//!
//! The matrix (`common::run_collective`) runs every DataType × every RedOp × counts {0, 1, 2, 3,
//! 7, 1023, 1025, 65539} × out-of-place/in-place on 2, 3 and 4 nodes of 1 and 2 ranks: exact
//! expected values from `oxccl::perf::check` (order-independent inputs: the tree's association
//! differs from the ring's and must give the same bits), guard bytes, unchanged send buffers, and
//! results bitwise identical on every rank, on each protocol (LL, LL128 and Simple: one
//! communicator per `NCCL_PROTO`). NCCL_ALGO=tree leaves only the tree, so a refusal would fail
//! the matrix ("no protocol ran"); each configuration also checks `Comm::last_choice()` — the tree
//! on the forced protocol — explicitly. Channel counts vary
//! (`NCCL_MIN_NCHANNELS` = `NCCL_MAX_NCHANNELS`) so that small calls use both trees, and three
//! channels put two channels on tree 0.
//!
//! The remaining tests: on one node `NCCL_ALGO=tree` is refused with an error that says why; a
//! bad `OXCCL_TEST_NODES` fails init naming it; without forcing, the cost model picks the tree
//! for a mid-size AllReduce over 4 nodes and the ring elsewhere; trees and rings interleave on the
//! same communicator; an abort releases a tree AllReduce stuck on a rank that never called; each
//! tree peer costs one FIFO. The environment is process-global: every test stages its variables
//! (`common::env::Staged`), set only while the helpers create its communicators.
use crate::common;

use common::env::Staged;
use oxccl::{Algo, DataType, Device, Error, Func, Proto, RedOp};

/// Counts run for every dtype × op: 0 is the no-op, 1..7 are shorter than one 16-byte pack (and
/// than the rank count), 1023/1025 straddle a power of two, and 65539 spans several chunks per
/// channel for every element size (4-byte elements: 256 KiB, more than one 128 KiB tree chunk).
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, 65539];

/// Variables these tests set (all cleared while a test runs, restored after).
const VARS: &[&str] = &[
    "ALGO",
    "PROTO",
    "TEST_NODES",
    "MIN_NCHANNELS",
    "MAX_NCHANNELS",
    "TEST_TREE_PATTERN",
];

/// The tree matrix on `nnodes` nodes of `per_node` ranks with `nch` channels for every call.
fn tree_matrix(test: &str, nnodes: usize, per_node: usize, nch: u32) {
    let env = Staged::clean(VARS);
    let (nodes, ch) = (nnodes.to_string(), nch.to_string());
    let devices = Device::cpus(nnodes * per_node);
    // One protocol at a time (`common::protos()`: every one, or OXCCL_TEST_PROTOS): the plan of
    // every call is the tree on that protocol over `nch` channels, then the matrix runs on
    // communicators created under the same environment.
    for proto in common::protos() {
        env.set(&[
            ("NCCL_ALGO", "tree"),
            ("NCCL_PROTO", proto),
            ("OXCCL_TEST_NODES", &nodes),
            ("NCCL_MIN_NCHANNELS", &ch),
            ("NCCL_MAX_NCHANNELS", &ch),
        ]);
        let comms = common::init_all(&devices).unwrap();
        for count in [1, 1025, 65539] {
            for in_place in [false, true] {
                for (r, c) in common::all_reduce_f32(&comms, count, in_place).iter().enumerate() {
                    assert_eq!(
                        (c.func, c.algo, c.proto.name(), c.nchannels),
                        (Func::AllReduce, Algo::Tree, proto, nch),
                        "{test}: rank {r}, count {count}"
                    );
                }
            }
        }
        drop(comms);
        common::all_reduce_matrix(&format!("{test} {proto}"), &devices, COUNTS);
    }
}

#[test]
fn tree_2_nodes_1_rank() {
    tree_matrix("tree_2_nodes_1_rank", 2, 1, 2);
}

#[test]
fn tree_2_nodes_2_ranks() {
    tree_matrix("tree_2_nodes_2_ranks", 2, 2, 3);
}

#[test]
fn tree_3_nodes_1_rank() {
    tree_matrix("tree_3_nodes_1_rank", 3, 1, 3);
}

#[test]
fn tree_3_nodes_2_ranks() {
    tree_matrix("tree_3_nodes_2_ranks", 3, 2, 2);
}

#[test]
fn tree_4_nodes_1_rank() {
    tree_matrix("tree_4_nodes_1_rank", 4, 1, 2);
}

#[test]
fn tree_4_nodes_2_ranks() {
    tree_matrix("tree_4_nodes_2_ranks", 4, 2, 2);
}

#[test]
fn tree_on_one_node_is_refused_with_the_reason() {
    let env = Staged::clean(VARS);
    // No nodes given, or one node: no trees, so NCCL_ALGO=tree leaves nothing implemented. Every
    // rank refuses before queuing anything.
    for nodes in [None, Some("1")] {
        let mut vars = vec![("NCCL_ALGO", "tree")];
        vars.extend(nodes.map(|n| ("OXCCL_TEST_NODES", n)));
        env.set(&vars);
        let comms = common::init_all(&Device::cpus(4)).unwrap();
        for c in &comms {
            let s = c.device().new_stream().unwrap();
            let b = c.device().alloc(64).unwrap();
            let e = c
                .all_reduce(&b, &b, 16, DataType::F32, RedOp::Sum, &s)
                .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            let m = e.to_string();
            assert!(
                m.contains("allreduce is implemented only as ring/Simple, ring/LL, ring/LL128")
                    && m.contains("tree needs a communicator spanning several nodes")
                    && m.contains("OXCCL_TEST_NODES"),
                "OXCCL_TEST_NODES={nodes:?}: {m}"
            );
        }
    }
    // Over several nodes the tree serves AllReduce only: Broadcast under NCCL_ALGO=tree is refused
    // (no silent ring), without the several-nodes hint (more nodes would not help).
    env.set(&[("NCCL_ALGO", "tree"), ("OXCCL_TEST_NODES", "2")]);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let s = comms[0].device().new_stream().unwrap();
    let b = comms[0].device().alloc(64).unwrap();
    let e = comms[0]
        .broadcast(Some(b.as_slice()), &b, 16, DataType::F32, 0, &s)
        .unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("broadcast is implemented only as ring/Simple, ring/LL, ring/LL128")
            && !m.contains("spanning several nodes"),
        "{m}"
    );
}

#[test]
fn bad_test_nodes_fail_init_naming_the_variable() {
    let env = Staged::clean(VARS);
    for v in ["3", "0", "5", "two", ""] {
        env.set(&[("OXCCL_TEST_NODES", v)]);
        let e = common::init_all(&Device::cpus(4))
            .err()
            .unwrap_or_else(|| panic!("OXCCL_TEST_NODES={v:?} on 4 ranks must fail"));
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(
            e.to_string(),
            format!(
                "invalid argument: OXCCL_TEST_NODES={v:?}: accepted a divisor of the rank count 4 in 1..=4 \
                 (the ranks split into that many equal nodes)"
            )
        );
    }
}

#[test]
fn model_picks_tree_for_mid_sizes_and_both_interleave() {
    let env = Staged::clean(VARS);
    env.set(&[("OXCCL_TEST_NODES", "4")]);
    let comms = common::init_all(&Device::cpus(8)).unwrap();
    // The host model (tuning::Model::for_fabric(Host)) on 8 ranks in 4 nodes (tree depth 3): 8
    // bytes go to the tree on LL (32 µs vs 48 for the ring on LL), 64 KiB to the tree on Simple
    // (125 µs vs 143 for the ring on Simple), 4 MiB to the ring on Simple (its bandwidth term is
    // lower) — see the unit test in host/tuning.rs. Alternating them checks that tree and ring
    // connections keep their own FIFO steps, per protocol, across calls.
    for round in 0..2 {
        for (count, algo, proto) in [
            (2, Algo::Tree, Proto::Ll),
            (16384, Algo::Tree, Proto::Simple),
            (1 << 20, Algo::Ring, Proto::Simple),
        ] {
            for (r, c) in common::all_reduce_f32(&comms, count, round == 1)
                .iter()
                .enumerate()
            {
                assert_eq!(
                    (c.algo, c.proto),
                    (algo, proto),
                    "round {round}, rank {r}, {count} floats: {c:?}"
                );
            }
        }
    }
}

#[test]
fn abort_releases_a_tree_all_reduce_waiting_for_a_missing_rank() {
    let env = Staged::clean(VARS);
    // On each protocol: 4 ranks in 2 nodes; rank 3 never calls, so its parent (rank 2) and
    // everything above wait in the tree's spin loops until the abort flag is seen.
    for proto in [Proto::Ll, Proto::Ll128, Proto::Simple] {
        env.set(&[
            ("NCCL_ALGO", "tree"),
            ("NCCL_PROTO", proto.name()),
            ("OXCCL_TEST_NODES", "2"),
        ]);
        let comms = common::init_all(&Device::cpus(4)).unwrap();
        let count = 1 << 16;
        let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
        let bufs: Vec<_> = comms
            .iter()
            .map(|c| c.device().alloc(count * 4).unwrap())
            .collect();
        for r in 0..3 {
            comms[r]
                .all_reduce(&bufs[r], &bufs[r], count, DataType::F32, RedOp::Sum, &streams[r])
                .unwrap();
            let c = comms[r].last_choice().unwrap();
            assert_eq!((c.algo, c.proto), (Algo::Tree, proto), "rank {r}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        for (r, c) in comms.iter().enumerate() {
            let t = std::time::Instant::now();
            c.abort()
                .unwrap_or_else(|e| panic!("{proto}: rank {r}: abort: {e}"));
            assert!(
                t.elapsed() < std::time::Duration::from_secs(5),
                "{proto}: rank {r}: abort took {:?}",
                t.elapsed()
            );
        }
        for (r, c) in comms.iter().enumerate() {
            streams[r].synchronize().unwrap();
            let e = c
                .all_reduce(&bufs[r], &bufs[r], 4, DataType::F32, RedOp::Sum, &streams[r])
                .unwrap_err();
            assert!(e.to_string().contains("aborted"), "{proto}: rank {r}: {e}");
        }
    }
}

#[test]
fn tree_memory_is_one_fifo_per_tree_peer() {
    let env = Staged::clean(VARS);
    let ring_only = common::init_all(&Device::cpus(2)).unwrap()[0].device_memory_bytes();
    env.set(&[("OXCCL_TEST_NODES", "2")]);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    // 2 nodes of 1 rank, 2 channels (the CPU default): on each channel's tree one rank is the
    // root and the other its only child, so each rank has one tree peer per channel: 2 sets of
    // FIFOs — Simple of NCCL_BUFFSIZE (4 MiB), LL of NCCL_LL_BUFFSIZE (512 KiB) and LL128 of
    // NCCL_LL128_BUFFSIZE (1 MiB), the defaults — the counter blocks of 4 peer slots × 2 channels
    // × 256 bytes, and 2 DevTrees of 672 bytes.
    for c in &comms {
        assert_eq!(
            c.device_memory_bytes() - ring_only,
            2 * ((4 << 20) + (512 << 10) + (1 << 20)) + 2 * 4 * 256 + 2 * 672,
            "rank {}",
            c.rank()
        );
    }
}

#[test]
fn three_children_per_rank_on_every_protocol() {
    // OXCCL_TEST_TREE_PATTERN=tree hangs both child nodes from a node's first rank, which then
    // has three children with its chain's next rank: the tree's widest fan (3 receive peers in
    // the reduce phase, 3 send peers in the broadcast phase). 4 nodes of 2 ranks: the trees the
    // communicator builds are `double_binary_tree` of these chains with that pattern; a rank with
    // three children exists in tree 0 or tree 1.
    use oxccl::graph::{Pattern, double_binary_tree};
    let chains: Vec<Vec<usize>> = (0..4).map(|n| vec![2 * n, 2 * n + 1]).collect();
    let trees = double_binary_tree(&chains, Pattern::Tree).unwrap();
    let widest = trees
        .iter()
        .flat_map(|t| t.iter().map(|r| r.down.iter().filter(|&&d| d >= 0).count()))
        .max()
        .unwrap();
    assert_eq!(widest, 3, "{trees:?}");
    let env = Staged::clean(VARS);
    let devices = Device::cpus(8);
    for proto in common::protos() {
        env.set(&[
            ("NCCL_ALGO", "tree"),
            ("NCCL_PROTO", proto),
            ("OXCCL_TEST_NODES", "4"),
            ("OXCCL_TEST_TREE_PATTERN", "tree"),
            ("NCCL_MIN_NCHANNELS", "2"),
            ("NCCL_MAX_NCHANNELS", "2"),
        ]);
        common::all_reduce_matrix(
            &format!("three_children_per_rank_on_every_protocol {proto}"),
            &devices,
            COUNTS,
        );
    }
    // A bad pattern fails init naming the variable.
    env.set(&[("OXCCL_TEST_NODES", "2"), ("OXCCL_TEST_TREE_PATTERN", "ring")]);
    let e = common::init_all(&Device::cpus(2))
        .err()
        .expect("a bad pattern must fail");
    assert_eq!(
        e.to_string(),
        "invalid argument: OXCCL_TEST_TREE_PATTERN=\"ring\": accepted balanced, split or tree"
    );
}
