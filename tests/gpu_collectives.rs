//! The correctness matrix of `tests/collectives.rs` on local GPUs (issue 3, deliverable 6):
//! Broadcast (every root), Reduce (every root; non-root ranks pass no receive buffer), AllGather,
//! ReduceScatter and AllReduce × every protocol of `common::PROTOS` (forced with `NCCL_PROTO`; each
//! call's `Comm::last_choice` must show it) × every DataType × every RedOp (the reducing
//! collectives) × out-of-place/in-place × the full count set {0, 1, 2, 3, 7, 1023, 1025, 65536+3,
//! 2^20+3} for every dtype × op, on 1 and 2 GPUs (and on all of them when more than 2 are
//! visible), and on 2 ranks sharing the GPU when only one is visible. Checks as in `common::run_collective`: exact expected values from
//! `oxccl::perf::check`, guard bytes around every buffer, poisoned outputs, unchanged inputs and
//! non-root outputs, AllReduce results bitwise identical on every rank. On one GPU every
//! collective is a copy and no protocol runs, so the 1-GPU matrices run once, unforced.
//!
//! Without enough GPUs (CI), each test prints `SKIPPED: <test>: <reason>` to stderr and returns.
//! GPU tests in this binary take a lock so two communicators never spin on the same GPUs at once.
#[macro_use]
mod common;

use oxccl::{Device, Func};

/// Every count of the CPU matrix, the large one for every dtype × op.
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 16) + 3, (1 << 20) + 3];

fn run(func: Func, devices: &[Device], test: &str) {
    let protos = common::protos();
    common::run_collective(
        test,
        devices,
        &common::Matrix {
            func,
            counts: COUNTS,
            extra_counts: &[],
            extra_pairs: &[],
            protos: Some(&protos),
        },
    );
}

fn matrix(func: Func, nranks: usize, test: &str) {
    let Some(devices) = common::gpus_or_skip(test, nranks) else {
        return;
    };
    let _gpu = common::gpu_lock();
    run(func, &devices, test);
}

/// Two ranks sharing GPU 0 when it is the only GPU (`OXCCL_ALLOW_SHARED_DEVICE=1`), so a 1-GPU
/// machine runs every protocol of the matrix too; with 2 or more GPUs `*_2_gpus` covers it.
fn matrix_shared_gpu(func: Func, test: &str) {
    match Device::cuda_count() {
        0 => {
            let _ = common::gpus_or_skip(test, 1); // prints why
        }
        1 => {
            let Some(devices) = common::two_ranks_or_skip(test) else {
                return;
            };
            let _gpu = common::gpu_lock();
            run(func, &devices, test);
        }
        n => skipped!("SKIPPED: {test}: {n} GPUs visible; the *_2_gpus test runs this matrix"),
    }
}

/// All GPUs when more than 2 are visible (1 and 2 have their own tests).
fn matrix_all_gpus(func: Func, test: &str) {
    if Device::cuda_count() <= 2 {
        // Prints why: no GPU, or fewer than 3 (1 and 2 GPUs run in the tests above).
        let _ = common::gpus_or_skip(test, 3);
        return;
    }
    let _gpu = common::gpu_lock();
    run(func, &Device::all_cuda(), test);
}

macro_rules! gpu_tests {
    ($($func:ident: $one:ident, $two:ident, $shared:ident, $all:ident;)*) => {$(
        #[test]
        fn $one() {
            matrix(Func::$func, 1, stringify!($one));
        }
        #[test]
        fn $two() {
            matrix(Func::$func, 2, stringify!($two));
        }
        #[test]
        fn $shared() {
            matrix_shared_gpu(Func::$func, stringify!($shared));
        }
        #[test]
        fn $all() {
            matrix_all_gpus(Func::$func, stringify!($all));
        }
    )*};
}

gpu_tests! {
    Broadcast: broadcast_1_gpu, broadcast_2_gpus, broadcast_2_ranks_1_gpu, broadcast_all_gpus;
    Reduce: reduce_1_gpu, reduce_2_gpus, reduce_2_ranks_1_gpu, reduce_all_gpus;
    AllGather: all_gather_1_gpu, all_gather_2_gpus, all_gather_2_ranks_1_gpu, all_gather_all_gpus;
    ReduceScatter: reduce_scatter_1_gpu, reduce_scatter_2_gpus, reduce_scatter_2_ranks_1_gpu,
        reduce_scatter_all_gpus;
    AllReduce: all_reduce_1_gpu, all_reduce_2_gpus, all_reduce_2_ranks_1_gpu, all_reduce_all_gpus;
}

/// `NCCL_P2P_DISABLE=1` cannot be honoured by `init_all` (P2P is the only transport it sets up
/// between GPUs): a 2-GPU `init_all` refuses it with `InvalidUsage` naming the variable and the
/// way out (`init_rank`), instead of silently using P2P. One GPU is unaffected (no neighbour).
#[test]
fn init_all_refuses_p2p_disable() {
    let Some(devices) = common::gpus_or_skip("init_all_refuses_p2p_disable", 2) else {
        return;
    };
    let _lock = common::env_lock();
    let env = common::env::Env::clean(&["P2P_DISABLE", "PROTO", "ALGO"]);
    env.set(&[("NCCL_P2P_DISABLE", "1")]);
    let e = oxccl::Comm::init_all(&devices[..2])
        .err()
        .expect("init_all must refuse NCCL_P2P_DISABLE=1");
    let m = e.to_string();
    assert!(matches!(e, oxccl::Error::InvalidUsage(_)), "{m}");
    assert!(m.contains("NCCL_P2P_DISABLE=1") && m.contains("init_rank"), "{m}");
    let one = oxccl::Comm::init_all(&devices[..1]).expect("one GPU needs no P2P");
    assert_eq!(one.len(), 1);
}

/// `NCCL_P2P_LEVEL` on `init_all`: `LOC` (P2P only within one GPU) cannot be honoured between two
/// GPUs, so a 2-GPU `init_all` refuses it with `InvalidUsage` naming the variable, both devices
/// and the way out; `SYS` (any path) allows P2P and the communicators run an exact AllReduce.
#[test]
fn init_all_honours_p2p_level() {
    let Some(devices) = common::gpus_or_skip("init_all_honours_p2p_level", 2) else {
        return;
    };
    let _lock = common::env_lock();
    let env = common::env::Env::clean(&["P2P_LEVEL", "P2P_DISABLE", "PROTO", "ALGO"]);
    env.set(&[("NCCL_P2P_LEVEL", "LOC")]);
    let e = oxccl::Comm::init_all(&devices[..2])
        .err()
        .expect("init_all must refuse NCCL_P2P_LEVEL=LOC between two GPUs");
    let m = e.to_string();
    assert!(matches!(e, oxccl::Error::InvalidUsage(_)), "{m}");
    assert!(
        m.contains("NCCL_P2P_LEVEL=LOC") && m.contains("CUDA device 0") && m.contains("init_rank"),
        "{m}"
    );
    env.set(&[("NCCL_P2P_LEVEL", "SYS")]);
    let comms = oxccl::Comm::init_all(&devices[..2]).expect("NCCL_P2P_LEVEL=SYS allows P2P");
    let _gpu = common::gpu_lock();
    for in_place in [false, true] {
        common::all_reduce_f32(&comms, 1000, in_place);
    }
}
