//! The AllReduce correctness matrix of the `all_reduce` tests on local GPUs: every DataType × every
//! RedOp × counts {0, 1, 2, 3, 7, 1023, 1025, 2^20+3} × out-of-place/in-place, on 1..=N GPUs
//! (N = `Device::cuda_count()`), with guard bytes before and after every buffer, poisoned
//! outputs, exact checks on every rank and bitwise agreement across ranks.
//!
//! Without a GPU (CI), each test prints `SKIPPED: <test>: <reason>` to stderr and returns. GPU
//! tests in this binary take a lock so two communicators never spin on the same GPUs at once.

use crate::common;

use oxccl::Device;

fn matrix(nranks: usize, test: &str) {
    let Some(devices) = common::gpus_or_skip(test, nranks) else {
        return;
    };
    let _gpu = common::gpu_lock();
    common::run_matrix(test, &devices, common::COUNTS);
}

#[test]
fn gpu_all_reduce_1_gpu() {
    matrix(1, "gpu_all_reduce_1_gpu");
}

#[test]
fn gpu_all_reduce_2_gpus() {
    matrix(2, "gpu_all_reduce_2_gpus");
}

#[test]
fn gpu_all_reduce_3_gpus() {
    matrix(3, "gpu_all_reduce_3_gpus");
}

#[test]
fn gpu_all_reduce_4_gpus() {
    matrix(4, "gpu_all_reduce_4_gpus");
}

#[test]
fn gpu_all_reduce_5_gpus() {
    matrix(5, "gpu_all_reduce_5_gpus");
}

#[test]
fn gpu_all_reduce_6_gpus() {
    matrix(6, "gpu_all_reduce_6_gpus");
}

#[test]
fn gpu_all_reduce_7_gpus() {
    matrix(7, "gpu_all_reduce_7_gpus");
}

#[test]
fn gpu_all_reduce_8_gpus() {
    matrix(8, "gpu_all_reduce_8_gpus");
}

/// Rank counts 9..=N when more than 8 GPUs are visible (1..=8 have their own tests above, the
/// full count N included).
#[test]
fn gpu_all_reduce_more_than_8_gpus() {
    let test = "gpu_all_reduce_more_than_8_gpus";
    let have = Device::cuda_count();
    if have == 0 {
        skipped!(
            "SKIPPED: {test}: no CUDA driver/GPU visible ({})",
            common::no_gpu_reason()
        );
        return;
    }
    if have <= 8 {
        let by = if have == 1 {
            "gpu_all_reduce_1_gpu".to_string()
        } else {
            format!("gpu_all_reduce_{have}_gpus")
        };
        skipped!("SKIPPED: {test}: {have} GPUs visible; the full count {have} is run by {by}");
        return;
    }
    for n in 9..=have {
        matrix(n, &format!("{test} (nranks {n})"));
    }
}
