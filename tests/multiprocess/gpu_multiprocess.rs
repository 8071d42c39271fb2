//! `Comm::init_rank` on CUDA across processes: the test spawns itself as 2 child processes, rank r
//! on GPU r, bootstrapped through one unique id; they connect through the P2P/IPC transport
//! (`cuIpcOpenMemHandle`) and run AllReduce with exact float results, then an abort on rank 0
//! must reach rank 1's spinning kernel through the shared abort page. Prints SKIPPED without 2
//! GPUs.
use crate::common::child::{self, wait_all};
use crate::common::unique_id;
use oxccl::{Comm, DataType, Device, Error, RedOp};
use std::time::{Duration, Instant};

const NRANKS: usize = 2;

/// Rank `rank`'s input: element i is (rank + 1) × (i mod 1000), an integer below 2^24, so sums
/// over ranks are exact in f32.
fn input(rank: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| ((rank + 1) * (i % 1000)) as f32).collect()
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// One child rank.
#[test]
#[ignore = "child process of all_reduce_two_processes_one_gpu_each"]
fn child_gpu_rank() {
    child::enter();
    let (rank, _, id) = child::rank();
    let t = Instant::now();
    let comm = Comm::init_rank(NRANKS, &id, rank, Device::Cuda(rank)).expect("init_rank");
    println!("rank {rank}: init {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    assert_eq!(
        (comm.count(), comm.user_rank(), comm.cu_device().unwrap()),
        (NRANKS, rank, rank)
    );
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    // Sizes: below one slice, several chunks, and one not a multiple of anything.
    for count in [17usize, 1 << 20, (8 << 20) + 3] {
        let send = dev.alloc(count * 4).unwrap();
        let recv = dev.alloc(count * 4).unwrap();
        send.write(0, &to_bytes(&input(rank, count))).unwrap();
        comm.all_reduce(&send, &recv, count, DataType::F32, RedOp::Sum, &stream)
            .unwrap();
        // In place too.
        comm.all_reduce(&send, &send, count, DataType::F32, RedOp::Sum, &stream)
            .unwrap();
        stream.synchronize().unwrap();
        // Sum over ranks of (r + 1) × (i mod 1000) = 3 × (i mod 1000) for 2 ranks.
        let want: Vec<f32> = (0..count).map(|i| (3 * (i % 1000)) as f32).collect();
        for (what, buf) in [("out-of-place", &recv), ("in-place", &send)] {
            let got: Vec<f32> = buf
                .to_vec()
                .unwrap()
                .chunks(4)
                .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                .collect();
            let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            assert_eq!(
                wrong, 0,
                "rank {rank} count {count} {what}: {wrong} wrong elements"
            );
        }
        comm.get_async_error().unwrap();
    }
    // Abort across processes: rank 1's AllReduce spins for a rank 0 that never joins; rank 0's
    // abort raises rank 1's flag in the shared page, so rank 1's kernel exits.
    let count = 1 << 20;
    let buf = dev.alloc(count * 4).unwrap();
    if rank == 1 {
        comm.all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream)
            .unwrap();
        let t = Instant::now();
        stream.synchronize().unwrap();
        println!(
            "rank 1: kernel exited {:.0} ms after its launch",
            t.elapsed().as_secs_f64() * 1e3
        );
        let e = comm.get_async_error().unwrap_err();
        assert!(matches!(e, Error::Remote(_)), "{e}");
        assert!(
            e.to_string().contains("rank 0 of this communicator aborted"),
            "{e}"
        );
    } else {
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        comm.abort().unwrap();
        assert!(t.elapsed() < Duration::from_secs(5));
    }
    comm.destroy().unwrap();
    println!("GPU-MP-RANK-OK");
}

#[test]
fn all_reduce_two_processes_one_gpu_each() {
    let ngpu = Device::cuda_count();
    if ngpu < NRANKS {
        skipped!("SKIPPED: all_reduce_two_processes_one_gpu_each: needs {NRANKS} GPUs, {ngpu} visible");
        return;
    }
    let id = unique_id();
    let children: Vec<_> = (0..NRANKS)
        .map(|r| {
            let mut cmd = child::command(&child_entry!(child_gpu_rank));
            child::rank_env(&mut cmd, r, NRANKS, &id).env("NCCL_NVLS_ENABLE", "0");
            child::spawn(&mut cmd)
        })
        .collect();
    let outs = wait_all(children, Instant::now() + Duration::from_secs(180));
    for (r, (ok, out)) in outs.iter().enumerate() {
        print!("{out}");
        assert!(
            *ok && out.contains("GPU-MP-RANK-OK"),
            "child rank {r} (limit 180 s):\n{out}"
        );
    }
}

/// `oxccl perf --procs 2 --compare nccl`: each process joins oxccl's communicator and NCCL's
/// (`ncclCommInitRank`, through a fresh id of rank 0's shared over the control bootstrap), and
/// rank 0 prints both libraries' columns with 0 wrong in place and out of place. Without GPUs:
/// the same command on the CPU target is refused naming `--compare nccl`, and the GPU half prints
/// SKIPPED.
#[test]
fn perf_procs_compares_with_nccl() {
    let bin = env!("CARGO_BIN_EXE_oxccl");
    let args = [
        "perf",
        "all-reduce",
        "--procs",
        "2",
        "-b",
        "1M",
        "-e",
        "4M",
        "-f",
        "4",
        "-n",
        "2",
        "-w",
        "1",
    ];
    let out = std::process::Command::new(bin)
        .args(args)
        .args(["--compare", "nccl", "--backend", "cpu"])
        .output()
        .expect("run oxccl");
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "oxccl: --compare nccl needs GPUs (NCCL does not run on the CPU target)"
    );
    let ngpu = Device::cuda_count();
    if ngpu < NRANKS {
        skipped!("SKIPPED: perf_procs_compares_with_nccl GPU half: needs {NRANKS} GPUs, {ngpu} visible");
        return;
    }
    let out = std::process::Command::new(bin)
        .args(args)
        .args(["--compare", "nccl"])
        .env("NCCL_NVLS_ENABLE", "0")
        .output()
        .expect("run oxccl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    // size count type redop root, oxccl out of place and in place (time algbw busbw #wrong),
    // NCCL out of place and in place (time busbw), the ratio: 5 + 8 + 4 + 1 columns.
    assert_eq!(rows.len(), 2, "{stdout}");
    for r in &rows {
        assert_eq!(r.len(), 18, "{stdout}");
        assert_eq!((r[8], r[12]), ("0", "0"), "#wrong in {r:?}");
        for col in [13, 14, 15, 16, 17] {
            let v: f64 = r[col].parse().unwrap_or_else(|_| panic!("column {col} of {r:?}"));
            assert!(v > 0.0, "column {col} of {r:?}");
        }
    }
    assert!(stdout.contains("# NCCL "), "{stdout}");
}
