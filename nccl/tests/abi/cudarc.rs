//! cudarc's `nccl` safe API (what Rust programs on NCCL use) on oxccl's libnccl.so.2, on a GPU:
//! cudarc loads `libnccl.so` by name at run time, so a child process is started with the
//! directory of the built library first on `LD_LIBRARY_PATH`, and checks that this library (not
//! a system NCCL) is the one mapped. Two ranks: on two GPUs, or sharing GPU 0
//! (`OXCCL_ALLOW_SHARED_DEVICE=1`). Without a GPU the test says why it skipped.
use crate::common::lib_path;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, ReduceOp, group_end, group_start};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHILD: &str = "cudarc::cudarc_ranks_child";
const N: usize = 1 << 16;

/// Whether a CUDA driver with at least one GPU is present (without letting cudarc panic on a
/// machine that has no driver library).
fn gpus() -> usize {
    // SAFETY: loading the driver library runs only its initializers.
    if unsafe { libloading::Library::new("libcuda.so.1") }.is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// cudarc's safe API runs AllReduce, Broadcast, AllGather, ReduceScatter and a Send/Recv ring
/// exactly on oxccl's library, which the child finds mapped in its address space.
#[test]
fn cudarc_safe_api_runs_on_oxccl_gpu() {
    if gpus() == 0 {
        println!("SKIPPED: cudarc_safe_api_runs_on_oxccl_gpu: needs a GPU (no CUDA driver or no device)");
        return;
    }
    let lib = lib_path();
    let dir = lib.parent().expect("the library's directory").to_path_buf();
    let path = std::env::var("LD_LIBRARY_PATH")
        .map_or(dir.display().to_string(), |p| format!("{}:{p}", dir.display()));
    let mut child = Command::new(std::env::current_exe().expect("the test executable"))
        .args(["--exact", CHILD, "--ignored", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", path)
        .env("OXCCL_EXPECT_LIBNCCL", &lib)
        .env("OXCCL_ALLOW_SHARED_DEVICE", "1")
        .env("NCCL_NVLS_ENABLE", "0")
        .env_remove("OXCCL_NCCL_TARGET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the child");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait for the child").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the cudarc child did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("the child's output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("cudarc ranks OK"),
        "the child did not run its checks:\n{stdout}\n{stderr}"
    );
}

fn host_input(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((r + 1) * (i % 7)) as f32).collect()
}

/// The child of [`cudarc_safe_api_runs_on_oxccl_gpu`]: not a test on its own.
#[test]
#[ignore = "child process of cudarc_safe_api_runs_on_oxccl_gpu"]
fn cudarc_ranks_child() {
    let ngpus = CudaContext::device_count().expect("device count") as usize;
    let ctxs: Vec<Arc<CudaContext>> = if ngpus >= 2 {
        (0..2).map(|d| CudaContext::new(d).expect("context")).collect()
    } else {
        let c = CudaContext::new(0).expect("context");
        vec![c.clone(), c]
    };
    let streams: Vec<Arc<CudaStream>> = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
    let comms = Comm::from_devices(streams.clone()).expect("ncclCommInitAll through cudarc");

    // The library cudarc loaded is the one this test run built.
    let want = std::env::var("OXCCL_EXPECT_LIBNCCL").expect("the parent names the library");
    let want = std::fs::canonicalize(&want).expect("the library's path");
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    let mapped: Vec<&str> = maps
        .lines()
        .filter(|l| l.contains("libnccl"))
        .filter_map(|l| l.split_whitespace().nth(5))
        .collect();
    println!("libnccl mapped: {mapped:?}");
    assert!(
        mapped
            .iter()
            .all(|p| std::fs::canonicalize(p).ok().as_deref() == Some(want.as_path())),
        "cudarc loaded another libnccl: {mapped:?}, wanted {}",
        want.display()
    );

    let up = |r: usize, v: &[f32]| -> CudaSlice<f32> { streams[r].clone_htod(v).expect("copy in") };
    let zeros = |r: usize, n: usize| -> CudaSlice<f32> { streams[r].alloc_zeros::<f32>(n).expect("alloc") };
    let down = |r: usize, s: &CudaSlice<f32>| -> Vec<f32> { streams[r].clone_dtoh(s).expect("copy out") };
    let sync = || streams.iter().for_each(|s| s.synchronize().expect("synchronize"));
    let send: Vec<CudaSlice<f32>> = (0..2).map(|r| up(r, &host_input(r, N))).collect();

    // AllReduce (sum): 1·x + 2·x.
    let mut recv: Vec<CudaSlice<f32>> = (0..2).map(|r| zeros(r, N)).collect();
    group_start().expect("group start");
    for r in 0..2 {
        comms[r]
            .all_reduce(&send[r], &mut recv[r], &ReduceOp::Sum)
            .expect("all_reduce");
    }
    group_end().expect("group end");
    sync();
    for r in 0..2 {
        assert_eq!(down(r, &recv[r]), host_input(2, N), "AllReduce on rank {r}");
    }

    // Broadcast from rank 1.
    let mut bc: Vec<CudaSlice<f32>> = (0..2).map(|r| zeros(r, N)).collect();
    group_start().expect("group start");
    for (r, b) in bc.iter_mut().enumerate() {
        comms[r].broadcast(Some(&send[r]), b, 1).expect("broadcast");
    }
    group_end().expect("group end");
    sync();
    for r in 0..2 {
        assert_eq!(down(r, &bc[r]), host_input(1, N), "Broadcast on rank {r}");
    }

    // AllGather: rank 0's block, then rank 1's.
    let mut ag: Vec<CudaSlice<f32>> = (0..2).map(|r| zeros(r, 2 * N)).collect();
    group_start().expect("group start");
    for (r, a) in ag.iter_mut().enumerate() {
        comms[r].all_gather(&send[r], a).expect("all_gather");
    }
    group_end().expect("group end");
    sync();
    let gathered: Vec<f32> = host_input(0, N).into_iter().chain(host_input(1, N)).collect();
    for r in 0..2 {
        assert_eq!(down(r, &ag[r]), gathered, "AllGather on rank {r}");
    }

    // ReduceScatter (sum) of the gathered blocks: rank r gets 2 × block r.
    let mut rs: Vec<CudaSlice<f32>> = (0..2).map(|r| zeros(r, N)).collect();
    group_start().expect("group start");
    for (r, out) in rs.iter_mut().enumerate() {
        comms[r]
            .reduce_scatter(&ag[r], out, &ReduceOp::Sum)
            .expect("reduce_scatter");
    }
    group_end().expect("group end");
    sync();
    for r in 0..2 {
        let want: Vec<f32> = host_input(r, N).iter().map(|x| 2.0 * x).collect();
        assert_eq!(down(r, &rs[r]), want, "ReduceScatter on rank {r}");
    }

    // Send/Recv: each rank sends its input to the other, in one group.
    let mut p2p: Vec<CudaSlice<f32>> = (0..2).map(|r| zeros(r, N)).collect();
    group_start().expect("group start");
    for (r, out) in p2p.iter_mut().enumerate() {
        let peer = 1 - r as i32;
        comms[r].send(&send[r], peer).expect("send");
        comms[r].recv(out, peer).expect("recv");
    }
    group_end().expect("group end");
    sync();
    for r in 0..2 {
        assert_eq!(down(r, &p2p[r]), host_input(1 - r, N), "Recv on rank {r}");
    }
    drop(comms);
    println!("cudarc ranks OK");
}
