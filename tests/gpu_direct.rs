//! Direct writes on GPUs (`Comm::direct_pointer`, NCCL's "P2P/direct pointer"): the collectives
//! whose hops end in the receiver's output (Broadcast, AllGather, AllReduce's gather phase) store
//! that data straight into the next rank's output on the Simple protocol. These tests run the
//! correctness matrix of `tests/gpu_collectives.rs` for those three collectives on the Simple
//! protocol only (every dtype × op × count, every root, in and out of place, poisoned outputs,
//! guard bytes), on 2 GPUs, or on one GPU shared by 2 ranks (`OXCCL_ALLOW_SHARED_DEVICE=1`, set
//! here) when only one is visible, so the 1-GPU machine checks the pointer exchange too. The
//! other collectives keep the FIFO path and are covered by `tests/gpu_collectives.rs`.
//!
//! With `NCCL_P2P_DIRECT_DISABLE=1` in the environment the same matrices run the FIFO path (the
//! first test then checks the switch took effect). Without a GPU each test prints `SKIPPED: …`.
#[macro_use]
mod common;

use oxccl::{Comm, Device, Func};

/// Every count of the GPU matrix.
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 16) + 3, (1 << 20) + 3];

/// Two ranks: GPUs 0 and 1, or GPU 0 twice when it is the only one.
fn two_ranks_or_skip(test: &str) -> Option<Vec<Device>> {
    let have = Device::cuda_count();
    if have == 0 {
        skipped!("SKIPPED: {test}: no CUDA driver/GPU visible ({})", common::no_gpu_reason());
        return None;
    }
    if have >= 2 {
        return Some(vec![Device::Cuda(0), Device::Cuda(1)]);
    }
    // Set once and never removed, before any communicator of this binary reads it.
    // SAFETY: the caller holds the env lock, which serialises every environment access of this
    // test binary.
    unsafe { std::env::set_var("OXCCL_ALLOW_SHARED_DEVICE", "1") };
    Some(vec![Device::Cuda(0), Device::Cuda(0)])
}

fn wanted() -> bool {
    std::env::var("NCCL_P2P_DIRECT_DISABLE").map_or(true, |v| v.trim() != "1")
}

#[test]
fn init_all_reports_direct_pointers() {
    let _gpu = common::gpu_lock();
    let devices = {
        let _env = common::env_lock();
        match two_ranks_or_skip("init_all_reports_direct_pointers") {
            Some(d) => d,
            None => return,
        }
    };
    let comms = {
        let _env = common::env_lock();
        Comm::init_all(&devices).unwrap()
    };
    for c in &comms {
        assert_eq!(c.direct_pointer(), wanted(), "rank {}", c.rank());
    }
    // One rank: nothing to exchange with.
    let one = Comm::init_all(&devices[..1]).unwrap();
    assert!(!one[0].direct_pointer());
}

fn matrix(func: Func, test: &str) {
    let _gpu = common::gpu_lock();
    let devices = {
        let _env = common::env_lock();
        match two_ranks_or_skip(test) {
            Some(d) => d,
            None => return,
        }
    };
    common::run_collective(
        test,
        &devices,
        &common::Matrix {
            func,
            counts: COUNTS,
            extra_counts: &[],
            extra_pairs: &[],
            protos: Some(&["Simple"]),
        },
    );
}

#[test]
fn broadcast_simple_direct() {
    matrix(Func::Broadcast, "broadcast_simple_direct");
}

#[test]
fn all_gather_simple_direct() {
    matrix(Func::AllGather, "all_gather_simple_direct");
}

#[test]
fn all_reduce_simple_direct() {
    matrix(Func::AllReduce, "all_reduce_simple_direct");
}
