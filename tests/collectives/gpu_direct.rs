//! Direct writes on GPUs (`Comm::direct_pointer`, NCCL's "P2P/direct pointer"): the collectives
//! whose hops end in the receiver's output (Broadcast, AllGather, AllReduce's gather phase) store
//! that data straight into the next rank's output on the Simple protocol. These tests run the
//! correctness matrix of the `gpu_collectives` tests for those three collectives on the Simple
//! protocol only (every dtype × op × count, every root, in and out of place, poisoned outputs,
//! guard bytes), on 2 GPUs, or on one GPU shared by 2 ranks (`OXCCL_ALLOW_SHARED_DEVICE=1`, set
//! here) when only one is visible, so the 1-GPU machine checks the pointer exchange too. The
//! other collectives keep the FIFO path and are covered by the `gpu_collectives` tests.
//!
//! With `NCCL_P2P_DIRECT_DISABLE=1` in the environment the same matrices run the FIFO path (the
//! first test then checks the switch took effect). Without a GPU each test prints `SKIPPED: …`.
use crate::common;

use oxccl::Func;

/// Every count of the GPU matrix.
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 16) + 3, (1 << 20) + 3];

/// Whether direct writes are wanted: unless the environment this binary was started with says
/// `NCCL_P2P_DIRECT_DISABLE=1` (read holding the environment lock, so no test's own setting).
fn wanted() -> bool {
    let _env = common::env::shared();
    std::env::var("NCCL_P2P_DIRECT_DISABLE").map_or(true, |v| v.trim() != "1")
}

#[test]
fn init_all_reports_direct_pointers() {
    let _gpu = common::gpu_lock();
    let Some(devices) = common::two_ranks_or_skip("init_all_reports_direct_pointers") else {
        return;
    };
    let comms = common::init_all(&devices).unwrap();
    for c in &comms {
        assert_eq!(c.direct_pointer(), wanted(), "rank {}", c.rank());
    }
    // One rank: nothing to exchange with.
    let one = common::init_all(&devices[..1]).unwrap();
    assert!(!one[0].direct_pointer());
}

fn matrix(func: Func, test: &str) {
    let _gpu = common::gpu_lock();
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
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
            only: None,
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

/// A rank that aborts never gets data written into its output afterwards, on GPUs too (the case
/// the `direct` tests found on the CPU target): rank 0's direct Broadcast is queued behind another
/// communicator's AllReduce that waits for its rank 1, so it starts only after rank 1 has aborted;
/// it must see the abort (`DevComm::aborted`, set by `Comm::abort` while kernels run) and
/// write nothing into rank 1's output, which holds 0xEE from before the calls. Only host calls that
/// wait for one stream are used while rank 0's stream is blocked (on one GPU a context-wide wait
/// would wait for the blocked kernel).
#[test]
fn late_root_writes_nothing_after_the_receiver_aborted() {
    let test = "late_root_writes_nothing_after_the_receiver_aborted";
    let _gpu = common::gpu_lock();
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    if !wanted() {
        skipped!("SKIPPED: {test}: NCCL_P2P_DIRECT_DISABLE=1 (nothing is written directly)");
        return;
    }
    let y = common::init_comms(&devices, Some("Simple"));
    let x = common::init_comms(&devices, None);
    let (d0, d1) = (devices[0], devices[1]);
    let (s0, s1, sx1) = (
        d0.new_stream().unwrap(),
        d1.new_stream().unwrap(),
        d1.new_stream().unwrap(),
    );
    let count = 8 << 20;
    let src = d0.alloc(count).unwrap();
    src.write(0, &vec![0x5A; count]).unwrap();
    let dst0 = d0.alloc(count).unwrap();
    let out1 = d1.alloc(count).unwrap();
    out1.fill(0xEE).unwrap();
    let (xa0, xa1) = (d0.alloc(4096).unwrap(), d1.alloc(4096).unwrap());
    // Holds rank 0's stream until x's rank 1 calls.
    x[0].all_reduce(&xa0, &xa0, 1024, oxccl::DataType::I32, oxccl::RedOp::Sum, &s0)
        .unwrap();
    y[0].broadcast(Some(src.as_slice()), &dst0, count, oxccl::DataType::U8, 0, &s0)
        .unwrap();
    y[1].broadcast(None, &out1, count, oxccl::DataType::U8, 0, &s1)
        .unwrap();
    assert_eq!(y[1].last_choice().map(|c| c.proto), Some(oxccl::Proto::Simple));
    // Rank 1's kernel starts, publishes its output and waits for data that cannot come yet.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let t = std::time::Instant::now();
    y[1].abort().unwrap();
    s1.synchronize().unwrap();
    let abort_s = t.elapsed().as_secs_f64();
    assert!(abort_s < 5.0, "abort took {abort_s} s");
    // Release rank 0's stream: its Broadcast starts on the aborted communicator.
    x[1].all_reduce(&xa1, &xa1, 1024, oxccl::DataType::I32, oxccl::RedOp::Sum, &sx1)
        .unwrap();
    sx1.synchronize().unwrap();
    s0.synchronize().unwrap();
    let got = out1.to_vec().unwrap();
    let written = got.iter().filter(|&&b| b != 0xEE).count();
    assert_eq!(
        written, 0,
        "rank 0 wrote {written} bytes into rank 1's output after rank 1's abort (took {abort_s} s)"
    );
    eprintln!("{test}: abort returned in {abort_s:.3} s; rank 1's output untouched");
}
