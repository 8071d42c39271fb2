//! Tree AllReduce on 2 GPUs (the GPU part of the `tree` tests): `OXCCL_TEST_NODES=2`
//! makes `Comm::init_all` treat each GPU as its own node, which sets up the double binary tree's
//! connections in device memory (tree 0 on even channels, tree 1 on odd ones; with one rank per
//! node each channel's tree is a root and its one child), and `NCCL_ALGO=tree` forces the tree.
//!
//! The matrix (`common::run_collective`) runs every DataType × every RedOp × the GPU ring matrix's
//! counts {0, 1, 2, 3, 7, 1023, 1025, 65539, 2^20+3} × out-of-place/in-place: exact expected
//! values from `oxccl::perf::check`, poisoned outputs, guard bytes, unchanged send buffers, and
//! results bitwise identical on both ranks, on each protocol (LL, LL128, Simple: one
//! communicator per `NCCL_PROTO`). NCCL_ALGO=tree leaves only the tree, so a refusal fails the
//! matrix ("no protocol ran"); each configuration also checks explicitly that
//! `Comm::last_choice()` is the tree on the forced protocol. It runs with the default channel
//! count and with 3 channels (two channels on tree 0, small calls leave channels empty).
//!
//! Also: an abort releases a tree AllReduce whose peer never calls (the tree's spin loops poll the
//! abort flag), a Broadcast under NCCL_ALGO=tree is refused naming what is implemented, and the
//! tree costs one FIFO per protocol, tree peer and channel in device memory.
//!
//! Without 2 GPUs each test prints `SKIPPED: <test>: <reason>` to stderr and returns. The
//! environment is process-global, so every test holds `common::env::Env` (one at a time).
use crate::common;

use common::env::Env;
use oxccl::{Algo, DataType, Error, Func, RedOp};
use std::time::{Duration, Instant};

/// The GPU ring matrix's counts (the `gpu_collectives` tests), for every dtype × op.
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 16) + 3, (1 << 20) + 3];

/// Variables these tests set (all cleared while a test runs, restored after).
const VARS: &[&str] = &["ALGO", "PROTO", "TEST_NODES", "MIN_NCHANNELS", "MAX_NCHANNELS"];

/// The tree matrix on 2 GPUs as 2 nodes, with `nch` channels (`None`: the CUDA default), one
/// protocol at a time (`common::protos()`: LL, LL128 and Simple, or OXCCL_TEST_PROTOS).
fn tree_matrix(test: &str, nch: Option<u32>) {
    let Some(devices) = common::gpus_or_skip(test, 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let env = Env::clean(VARS);
    let ch = nch.map(|n| n.to_string());
    for proto in common::protos() {
        let mut vars = vec![
            ("NCCL_ALGO", "tree"),
            ("NCCL_PROTO", proto),
            ("OXCCL_TEST_NODES", "2"),
        ];
        if let Some(ch) = &ch {
            vars.extend([
                ("NCCL_MIN_NCHANNELS", ch.as_str()),
                ("NCCL_MAX_NCHANNELS", ch.as_str()),
            ]);
        }
        env.set(&vars);
        let comms = common::init_all(&devices).unwrap();
        for count in [1, 1025, 65539, (1 << 20) + 3] {
            for in_place in [false, true] {
                for (r, c) in common::all_reduce_f32(&comms, count, in_place).iter().enumerate() {
                    assert_eq!(
                        (c.func, c.algo, c.proto.name()),
                        (Func::AllReduce, Algo::Tree, proto),
                        "{test}: rank {r}, count {count}"
                    );
                    if let Some(n) = nch {
                        assert_eq!(c.nchannels, n, "{test}: rank {r}, count {count}");
                    }
                }
            }
        }
        drop(comms);
        common::all_reduce_matrix(&format!("{test} {proto}"), &devices, COUNTS);
    }
}

#[test]
fn tree_all_reduce_2_gpus() {
    tree_matrix("tree_all_reduce_2_gpus", None);
}

#[test]
fn tree_all_reduce_2_gpus_3_channels() {
    tree_matrix("tree_all_reduce_2_gpus_3_channels", Some(3));
}

#[test]
fn tree_broadcast_is_refused_and_memory_is_one_fifo_set_per_tree_peer() {
    let test = "tree_broadcast_is_refused_and_memory_is_one_fifo_set_per_tree_peer";
    let Some(devices) = common::gpus_or_skip(test, 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let env = Env::clean(VARS);
    env.set(&[("NCCL_MAX_NCHANNELS", "4")]);
    let ring_only: Vec<u64> = common::init_all(&devices)
        .unwrap()
        .iter()
        .map(|c| c.device_memory_bytes())
        .collect();
    env.set(&[
        ("NCCL_MAX_NCHANNELS", "4"),
        ("OXCCL_TEST_NODES", "2"),
        ("NCCL_ALGO", "tree"),
    ]);
    let comms = common::init_all(&devices).unwrap();
    // 2 nodes of 1 rank, 4 channels: on each channel one rank is the root and the other its only
    // child, so each rank has one tree peer per channel: 4 sets of FIFOs — Simple of
    // NCCL_BUFFSIZE (4 MiB), LL of NCCL_LL_BUFFSIZE (512 KiB), LL128 of NCCL_LL128_BUFFSIZE
    // (1 MiB), the defaults — the counter blocks of 4 peer slots × 4 channels × 256 bytes, and 4
    // DevTrees of 672 bytes.
    for (r, c) in comms.iter().enumerate() {
        assert_eq!(
            c.device_memory_bytes() - ring_only[r],
            4 * ((4 << 20) + (512 << 10) + (1 << 20)) + 4 * 4 * 256 + 4 * 672,
            "rank {r}"
        );
    }
    // The tree serves AllReduce only: a Broadcast under NCCL_ALGO=tree is refused.
    let s = comms[0].device().new_stream().unwrap();
    let b = comms[0].device().alloc(64).unwrap();
    let e = comms[0]
        .broadcast(Some(b.as_slice()), &b, 16, DataType::F32, 0, &s)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("broadcast is implemented only as ring/Simple, ring/LL, ring/LL128"),
        "{m}"
    );
}

#[test]
fn abort_releases_a_tree_all_reduce_waiting_for_a_missing_rank() {
    let test = "abort_releases_a_tree_all_reduce_waiting_for_a_missing_rank";
    let Some(devices) = common::gpus_or_skip(test, 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let env = Env::clean(VARS);
    env.set(&[("NCCL_ALGO", "tree"), ("OXCCL_TEST_NODES", "2")]);
    // Rank 1 never calls: rank 0's blocks wait in the tree's spin loops (for its child's data on
    // the channels where it is the root, for its parent's free slot or data where it is the
    // child) until they see the abort flag.
    let comms = common::init_all(&devices).unwrap();
    let count = 1 << 20;
    let stream = comms[0].device().new_stream().unwrap();
    let buf = comms[0].device().alloc(count * 4).unwrap();
    comms[0]
        .all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream)
        .unwrap();
    assert_eq!(comms[0].last_choice().unwrap().algo, Algo::Tree);
    std::thread::sleep(Duration::from_millis(200));
    for (r, c) in comms.iter().enumerate() {
        let t = Instant::now();
        c.abort().unwrap_or_else(|e| panic!("rank {r}: abort: {e}"));
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "rank {r}: abort took {:?}",
            t.elapsed()
        );
    }
    // The kernel left its spin loops: the stream drains and later calls are refused.
    stream.synchronize().unwrap();
    let e = comms[0]
        .all_reduce(&buf, &buf, 4, DataType::F32, RedOp::Sum, &stream)
        .unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
}
