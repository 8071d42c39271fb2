//! AllReduce correctness matrix on the CPU target: every DataType × every RedOp × counts
//! {0, 1, 2, 3, 7, 1023, 1025, 2^20+3} × out-of-place/in-place, on 1, 2, 3, 4 and 8 ranks. Inputs,
//! poison and the exact expected results come from `oxccl::perf::check` (nccl-tests' scheme);
//! every rank's result is checked, results must be bitwise identical across ranks, guard bytes
//! around every buffer must stay untouched, and out of place the send buffer must be unchanged.
//!
//! One #[test] per rank count (one set of communicators each), so the harness runs rank counts
//! in parallel.
use crate::common;

use oxccl::Device;

fn matrix(nranks: usize, test: &str) {
    common::run_matrix(test, &Device::cpus(nranks), common::COUNTS);
}

#[test]
fn cpu_all_reduce_1_rank() {
    matrix(1, "cpu_all_reduce_1_rank");
}

#[test]
fn cpu_all_reduce_2_ranks() {
    matrix(2, "cpu_all_reduce_2_ranks");
}

#[test]
fn cpu_all_reduce_3_ranks() {
    matrix(3, "cpu_all_reduce_3_ranks");
}

#[test]
fn cpu_all_reduce_4_ranks() {
    matrix(4, "cpu_all_reduce_4_ranks");
}

#[test]
fn cpu_all_reduce_8_ranks() {
    matrix(8, "cpu_all_reduce_8_ranks");
}
