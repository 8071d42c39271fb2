//! 200 init/destroy cycles (`init_all` and `init_rank` with rank threads) leave the thread and
//! file-descriptor counts at their baseline, and on GPUs every device's free memory too; so do
//! calls that time out (`OXCCL_TIMEOUT`) followed by abort and drop; each run in a child process,
//! alone, so other tests' threads do not disturb the counts.
use crate::common::{child, on_threads};
use crate::{all_reduce_u32, run_child};
use oxccl::bootstrap::get_unique_id;
use oxccl::{Comm, Device};
use std::time::{Duration, Instant};

/// Entries of a `/proc/self` directory (threads: `task`, open descriptors: `fd`).
fn count_dir(d: &str) -> usize {
    std::fs::read_dir(format!("/proc/self/{d}")).unwrap().count()
}

/// One cycle: a 2-rank `init_all` and a 2-rank `init_rank` (rank threads), each running one
/// AllReduce (sum of 1 and 2 = 3 everywhere) and destroyed.
fn one_cycle() {
    let comms = Comm::init_all(&Device::cpus(2)).unwrap();
    let results = on_threads(2, |r| all_reduce_u32(&comms[r], 64));
    assert!(results.iter().all(|v| v.iter().all(|&x| x == 3)));
    for c in comms {
        c.destroy().unwrap();
    }
    let id = get_unique_id().unwrap();
    let ok = on_threads(2, |r| {
        let c = Comm::init_rank(2, &id, r, Device::Cpu(r)).unwrap();
        let v = all_reduce_u32(&c, 64);
        c.destroy().unwrap();
        v.iter().all(|&x| x == 3)
    });
    assert_eq!(ok, [true, true]);
}

/// The child process of `cycles_return_to_baseline`: alone in its process, so the thread count
/// is not disturbed by other tests.
#[test]
#[ignore = "child process of cycles_return_to_baseline"]
fn child_cycles() {
    child::enter();
    // The first cycle creates what lives for the whole process (the driver probe, tracing).
    one_cycle();
    std::thread::sleep(Duration::from_millis(100));
    let (threads, fds) = (count_dir("task"), count_dir("fd"));
    let t = Instant::now();
    for _ in 0..200 {
        one_cycle();
    }
    // Threads that were told to exit may take a moment to leave /proc/self/task.
    let deadline = Instant::now() + Duration::from_secs(5);
    while count_dir("task") != threads && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "LIFECYCLE threads {threads} -> {} fds {fds} -> {} in {:.1} s",
        count_dir("task"),
        count_dir("fd"),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(count_dir("task"), threads, "threads after 200 cycles");
    assert_eq!(count_dir("fd"), fds, "open fds after 200 cycles");
    println!("LIFECYCLE-OK");
}

#[test]
fn cycles_return_to_baseline() {
    let (ok, out) = run_child(&child_entry!(child_cycles), &[], Duration::from_secs(300));
    assert!(ok && out.contains("LIFECYCLE-OK"), "{out}");
}

/// One timed-out call: a 2-rank `init_all` (`OXCCL_TIMEOUT` from the environment) where rank 0
/// calls an AllReduce and rank 1 never does; rank 0 times out, both abort and are dropped.
fn one_timeout_cycle() {
    let comms = Comm::init_all(&Device::cpus(2)).unwrap();
    let s = comms[0].device().new_stream().unwrap();
    let b = comms[0].device().alloc(256).unwrap();
    comms[0]
        .all_reduce(&b, &b, 64, oxccl::DataType::U32, oxccl::RedOp::Sum, &s)
        .unwrap();
    s.synchronize().unwrap();
    assert!(matches!(comms[0].get_async_error(), Err(oxccl::Error::Timeout(_))));
    for c in &comms {
        c.abort().unwrap();
    }
}

/// The child process of `timeouts_return_to_baseline`.
#[test]
#[ignore = "child process of timeouts_return_to_baseline"]
fn child_timeout_cycles() {
    child::enter();
    one_timeout_cycle();
    std::thread::sleep(Duration::from_millis(200));
    let (threads, fds) = (count_dir("task"), count_dir("fd"));
    for _ in 0..5 {
        one_timeout_cycle();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while count_dir("task") != threads && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(count_dir("task"), threads, "threads after 5 timed-out calls");
    assert_eq!(count_dir("fd"), fds, "open fds after 5 timed-out calls");
    println!("TIMEOUT-CYCLES-OK");
}

/// After calls that timed out, abort and drop bring threads and descriptors back to their
/// baseline (5 cycles with `OXCCL_TIMEOUT=0.2`, in a child process of its own).
#[test]
fn timeouts_return_to_baseline() {
    let (ok, out) = run_child(
        &child_entry!(child_timeout_cycles),
        &[("OXCCL_TIMEOUT", "0.2".to_string())],
        Duration::from_secs(120),
    );
    assert!(ok && out.contains("TIMEOUT-CYCLES-OK"), "{out}");
}

/// Free device memory of every visible GPU in bytes (cuMemGetInfo through the primary context).
fn free_device_memory() -> Vec<usize> {
    (0..Device::cuda_count())
        .map(|d| oxccl::cuda::Context::get(d).unwrap().mem_info().unwrap().0)
        .collect()
}

/// One CUDA cycle: an `init_all` over every visible GPU and an `init_rank` communicator (one
/// rank thread per GPU), each running one AllReduce (rank r contributes r + 1, so every element
/// is n(n+1)/2) and destroyed.
fn one_gpu_cycle() {
    let n = Device::cuda_count();
    let want = vec![(n * (n + 1) / 2) as u32; 4096];
    let comms = Comm::init_all(&Device::all_cuda()).unwrap();
    let results = on_threads(n, |r| all_reduce_u32(&comms[r], 4096));
    assert!(results.iter().all(|v| *v == want), "init_all AllReduce");
    for c in comms {
        c.destroy().unwrap();
    }
    let id = get_unique_id().unwrap();
    let ok = on_threads(n, |r| {
        let c = Comm::init_rank(n, &id, r, Device::Cuda(r)).unwrap();
        let v = all_reduce_u32(&c, 4096);
        c.destroy().unwrap();
        v == want
    });
    assert!(ok.iter().all(|&b| b), "init_rank AllReduce");
}

/// The child process of `gpu_cycles_return_to_baseline`: 200 CUDA cycles leave threads, open descriptors
/// and every GPU's free memory where they were after the first cycle (which loads the modules and
/// creates what lives for the whole process). Free memory may differ by at most 2 MiB (the
/// driver's own bookkeeping; one cycle's connection memory is hundreds of MiB, so a leak of one
/// communicator's buffers per cycle fails at once); the figure is printed.
#[test]
#[ignore = "child process of gpu_cycles_return_to_baseline"]
fn child_gpu_cycles() {
    child::enter();
    one_gpu_cycle();
    std::thread::sleep(Duration::from_millis(100));
    let (threads, fds, free) = (count_dir("task"), count_dir("fd"), free_device_memory());
    let t = Instant::now();
    for _ in 0..200 {
        one_gpu_cycle();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while count_dir("task") != threads && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let after = free_device_memory();
    println!(
        "GPU-LIFECYCLE threads {threads} -> {} fds {fds} -> {} free bytes {free:?} -> {after:?} in {:.1} s",
        count_dir("task"),
        count_dir("fd"),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(count_dir("task"), threads, "threads after 200 cycles");
    assert_eq!(count_dir("fd"), fds, "open fds after 200 cycles");
    for (d, (b, a)) in free.iter().zip(&after).enumerate() {
        assert!(
            b.abs_diff(*a) <= 2 << 20,
            "GPU {d}: free memory {b} -> {a} after 200 cycles"
        );
    }
    println!("GPU-LIFECYCLE-OK");
}

/// 200 CUDA init/destroy cycles return to baseline (GPU memory, threads, descriptors); in a
/// child process so other tests' threads do not disturb the counts.
#[test]
fn gpu_cycles_return_to_baseline() {
    if Device::cuda_count() < 1 {
        skipped!("SKIPPED: gpu_cycles_return_to_baseline: no CUDA GPU visible");
        return;
    }
    let (ok, out) = run_child(&child_entry!(child_gpu_cycles), &[], Duration::from_secs(400));
    assert!(ok && out.contains("GPU-LIFECYCLE-OK"), "{out}");
    println!(
        "{}",
        out.lines()
            .find_map(|l| l.find("GPU-LIFECYCLE threads").map(|i| &l[i..]))
            .unwrap_or("")
    );
}
