//! The CPU target with blocks of two warps whose threads are host threads of their own
//! (`OXCCL_CPU_NTHREADS=64 OXCCL_CPU_TEAM=threads`; the rest of the suite runs them as fibers of
//! one host thread), so that the split of each step over a block's threads, the block barriers,
//! the warp exchanges and LL128's line lanes run preemptively and in parallel: every
//! collective on LL, LL128 and Simple over rings, and AllReduce over trees, checked as nccl-tests
//! checks (`common::run_collective`: exact expected values, out of place and in place, poisoned
//! outputs, guard bytes, every rank). A few (type, operator) pairs and counts that split
//! unevenly over 64 threads keep the run short: many host threads per block are slow on few cores.
use crate::common;

use common::env::Staged;
use oxccl::{DataType, Device, Func, RedOp};

/// Counts: shorter than one pack, not a multiple of 64 threads' packs, and several LL128 lines
/// and Simple slices per thread.
const COUNTS: &[usize] = &[1, 7, 1025, 70_001];
/// One type per element size, with different operators.
const PAIRS: &[(DataType, RedOp)] = &[
    (DataType::F32, RedOp::Sum),
    (DataType::Bf16, RedOp::Max),
    (DataType::I8, RedOp::Prod),
    (DataType::F64, RedOp::Avg),
];

/// Variables these tests set (all cleared while a test runs, restored after).
const VARS: &[&str] = &["CPU_NTHREADS", "CPU_TEAM", "ALGO", "PROTO", "TEST_NODES"];

/// `OXCCL_CPU_NTHREADS=64`, `OXCCL_CPU_TEAM=threads` and `extra` set while the guard lives (every
/// communicator of the test is created under it).
fn two_warps(extra: &[(&str, &str)]) -> Staged {
    let env = Staged::clean(VARS);
    let mut vars = vec![("OXCCL_CPU_NTHREADS", "64"), ("OXCCL_CPU_TEAM", "threads")];
    vars.extend_from_slice(extra);
    env.set(&vars);
    env
}

fn ring(test: &str, func: Func) {
    let _env = two_warps(&[]);
    common::run_collective(
        test,
        &Device::cpus(2),
        &common::Matrix {
            func,
            counts: &[],
            extra_counts: COUNTS,
            extra_pairs: PAIRS,
            protos: Some(common::PROTOS),
            only: None,
        },
    );
}

#[test]
fn all_reduce_on_blocks_of_two_warps() {
    ring("all_reduce_on_blocks_of_two_warps", Func::AllReduce);
}

#[test]
fn broadcast_on_blocks_of_two_warps() {
    ring("broadcast_on_blocks_of_two_warps", Func::Broadcast);
}

#[test]
fn reduce_on_blocks_of_two_warps() {
    ring("reduce_on_blocks_of_two_warps", Func::Reduce);
}

#[test]
fn all_gather_on_blocks_of_two_warps() {
    ring("all_gather_on_blocks_of_two_warps", Func::AllGather);
}

#[test]
fn reduce_scatter_on_blocks_of_two_warps() {
    ring("reduce_scatter_on_blocks_of_two_warps", Func::ReduceScatter);
}

/// Two warps per block, and the tree forced on `proto` over 2 simulated nodes of 1 rank, while
/// the guard lives.
fn tree_env(proto: &str) -> Staged {
    two_warps(&[
        ("NCCL_ALGO", "tree"),
        ("NCCL_PROTO", proto),
        ("OXCCL_TEST_NODES", "2"),
    ])
}

/// The tree AllReduce (2 simulated nodes of 1 rank, `NCCL_ALGO=tree`) on every protocol.
#[test]
fn tree_all_reduce_on_blocks_of_two_warps() {
    let devices = Device::cpus(2);
    for proto in common::PROTOS {
        {
            let _env = tree_env(proto);
            // Created now, under this environment; the matrix below creates its own.
            let comms = common::init_all(&devices).unwrap();
            for (r, c) in common::all_reduce_f32(&comms, 1025, false).iter().enumerate() {
                assert_eq!((c.algo, c.proto.name()), (oxccl::Algo::Tree, *proto), "rank {r}");
            }
        }
        let _env = tree_env(proto);
        common::run_collective(
            &format!("tree_all_reduce_on_blocks_of_two_warps {proto}"),
            &devices,
            &common::Matrix {
                func: Func::AllReduce,
                counts: &[],
                extra_counts: COUNTS,
                extra_pairs: PAIRS,
                protos: None,
                only: None,
            },
        );
    }
}
