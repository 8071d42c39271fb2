//! Correctness matrix of every collective on the CPU target: Broadcast (every root), Reduce (every
//! root; non-root ranks pass no receive buffer), AllGather, ReduceScatter and AllReduce × every
//! protocol of `common::PROTOS` (forced with `NCCL_PROTO`, and each call's `Comm::last_choice` must
//! show it) × every DataType × every RedOp (the reducing collectives) × out-of-place/in-place, on
//! 2, 3 and 4 ranks, and on 1 rank (every collective is a copy there and no protocol runs:
//! unforced, as the `gpu_collectives` tests on 1 GPU). The checks are `common::run_collective`'s:
//! exact expected values from `oxccl::perf::check`, guard bytes around every buffer, poisoned
//! outputs, unchanged inputs and non-root outputs, AllReduce results bitwise identical on every
//! rank.
//!
//! Counts (elements per call, the `count` argument): `COUNTS` = {0, 1, 2, 3, 7, 1023, 1025,
//! 65536+3} for every dtype × op. 0 is the no-op, 1..7 are shorter than one 16-byte pack or LL
//! line and smaller than the rank count, 1023/1025 straddle a power of two, and 65539 elements
//! span several LL steps (32 KiB of data each) even for 1-byte types and several Simple slices.
//! The count 2^20+3 (8 MiB + 24 bytes of 8-byte elements: on 2 ranks and 2 channels one byte
//! past the Simple ring's 8 MiB loop, so a second, partial loop runs) is run only for `LARGE`:
//! one (dtype, op) per element size. What it adds — many chunks, loops and channel splits —
//! depends on the byte size, not on the operator (every dtype × op is covered at the other
//! counts); running it for all 50 pairs × roots × protocols would take the debug build far past
//! its 3-minute budget on a 2-core machine. The `all_reduce` tests run AllReduce at 2^20+3 for
//! every dtype × op with the default protocol. The `gpu_collectives` tests run every count for
//! every pair on GPUs.
//!
//! One #[test] per collective × rank count, so the harness spreads them over the cores.
//! `NCCL_PROTO` is process-global but read only when a communicator is created, so
//! `common::init_comms` holds the environment lock while setting it and creating the
//! communicators, and the collectives run in parallel.
use crate::common;

use oxccl::{DataType, Device, Func, RedOp};

/// Counts run for every dtype × op (see the module comment).
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 16) + 3];
/// The large count, run for the `LARGE` pairs only.
const LARGE_COUNT: usize = (1 << 20) + 3;
/// One (dtype, op) per element size (1, 2, 4, 8 bytes) for `LARGE_COUNT`; Broadcast and AllGather
/// use the dtypes.
const LARGE: &[(DataType, RedOp)] = &[
    (DataType::I8, RedOp::Sum),
    (DataType::Bf16, RedOp::Sum),
    (DataType::F32, RedOp::Avg),
    (DataType::F64, RedOp::Prod),
];

fn matrix(func: Func, nranks: usize, test: &str) {
    let protos = common::protos();
    common::run_collective(
        test,
        &Device::cpus(nranks),
        &common::Matrix {
            func,
            counts: COUNTS,
            extra_counts: &[LARGE_COUNT],
            extra_pairs: LARGE,
            protos: Some(&protos),
            only: None,
        },
    );
}

macro_rules! cpu_tests {
    ($($name:ident: $func:ident, $n:expr;)*) => {$(
        #[test]
        fn $name() {
            matrix(Func::$func, $n, stringify!($name));
        }
    )*};
}

cpu_tests! {
    broadcast_1_rank: Broadcast, 1;
    broadcast_2_ranks: Broadcast, 2;
    broadcast_3_ranks: Broadcast, 3;
    broadcast_4_ranks: Broadcast, 4;
    reduce_1_rank: Reduce, 1;
    reduce_2_ranks: Reduce, 2;
    reduce_3_ranks: Reduce, 3;
    reduce_4_ranks: Reduce, 4;
    all_gather_1_rank: AllGather, 1;
    all_gather_2_ranks: AllGather, 2;
    all_gather_3_ranks: AllGather, 3;
    all_gather_4_ranks: AllGather, 4;
    reduce_scatter_1_rank: ReduceScatter, 1;
    reduce_scatter_2_ranks: ReduceScatter, 2;
    reduce_scatter_3_ranks: ReduceScatter, 3;
    reduce_scatter_4_ranks: ReduceScatter, 4;
    all_reduce_1_rank: AllReduce, 1;
    all_reduce_2_ranks: AllReduce, 2;
    all_reduce_3_ranks: AllReduce, 3;
    all_reduce_4_ranks: AllReduce, 4;
}
