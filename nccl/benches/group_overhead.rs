//! `cargo bench -p oxccl-nccl --bench group_overhead [-- ITERS ROUNDS]`: the host cost of the C
//! entry points against the Rust API they wrap, on CPU-target ranks (no GPU needed).
//!
//! Both sides drive one communicator of 2 CPU-target ranks created in one call and time ITERS
//! (default 300,000) groups of: start a group, one AllReduce of count 0 per rank, end the group
//! ("grouped"); then ITERS times the same two calls without a group ("plain"). A call of count 0
//! is checked and recorded and launches nothing, so what differs is the library's own work.
//!
//! - C: `tests/c/group_overhead.c`, compiled with the system C compiler (`CC`, or `cc`) against
//!   `include/nccl.h`, linked with `-lnccl` to the `libnccl.so` this build made, run with
//!   `OXCCL_NCCL_TARGET=cpu`: `ncclCommInitAll`, `ncclGroupStart`, `ncclAllReduce`,
//!   `ncclGroupEnd`.
//! - Rust: the same in this process: `Comm::init_all` on `Device::Cpu(0..2)`, a stream per rank,
//!   `oxccl::group_start`, `Comm::collective_raw`, `oxccl::group_end`.
//!
//! ROUNDS (default 3) rounds alternate the two sides; each prints ns per group of 2 calls, of
//! wall time and of the calling thread's CPU time (steadier on a machine shared with other
//! work: time spent descheduled is left out).
#[path = "../tests/abi/common.rs"]
#[allow(dead_code)]
mod common;

use oxccl::{Comm, DataType, Device, Func, RedOp, Result, Stream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const NRANKS: usize = 2;

/// ns per group of 2 calls: wall time and the thread's CPU time.
#[derive(Clone, Copy)]
struct Ns {
    wall: f64,
    cpu: f64,
}

/// The calling thread's CPU time in ns.
fn thread_cpu_ns() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; the clock exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
}

/// The Rust side of one round: (grouped, plain).
fn rust_round(comms: &[Comm], streams: &[Stream], iters: usize) -> Result<(Ns, Ns)> {
    let buf = [0f32; NRANKS];
    let one = |grouped: bool| -> Result<()> {
        if grouped {
            oxccl::group_start()?;
        }
        for (r, (c, s)) in comms.iter().zip(streams).enumerate() {
            let addr = &buf[r] as *const f32 as u64;
            // SAFETY: count 0: no byte of the buffer is read or written.
            unsafe { c.collective_raw(Func::AllReduce, addr, addr, 0, DataType::F32, RedOp::Sum, 0, s)? };
        }
        if grouped {
            oxccl::group_end()?;
        }
        Ok(())
    };
    let mut out = [Ns { wall: 0.0, cpu: 0.0 }; 2];
    for (i, grouped) in [true, false].into_iter().enumerate() {
        for _ in 0..iters / 10 {
            one(grouped)?;
        }
        let (t0, c0) = (Instant::now(), thread_cpu_ns());
        for _ in 0..iters {
            one(grouped)?;
        }
        let cpu = thread_cpu_ns() - c0;
        out[i] = Ns {
            wall: t0.elapsed().as_nanos() as f64 / iters as f64,
            cpu: cpu / iters as f64,
        };
    }
    Ok((out[0], out[1]))
}

/// Compiles `tests/c/group_overhead.c` into `dir` against this build's `libnccl.so`.
fn build_c(dir: &Path) -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = common::lib_path();
    assert!(lib.exists(), "{} is missing", lib.display());
    std::fs::create_dir_all(dir).unwrap();
    for name in ["libnccl.so", "libnccl.so.2"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, link).unwrap();
    }
    let exe = dir.join("group_overhead");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(here.join("include"))
        .arg("-I")
        .arg(here.join("tests/c/cuda_stub"))
        .arg("-o")
        .arg(&exe)
        .arg(here.join("tests/c/group_overhead.c"))
        .arg("-L")
        .arg(dir)
        .arg("-lnccl")
        .output()
        .unwrap_or_else(|e| panic!("{cc}: {e}"));
    assert!(out.status.success(), "{cc} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// The C side of one round: (grouped, plain).
fn c_round(exe: &Path, iters: usize) -> (Ns, Ns) {
    let out = Command::new(exe)
        .arg(iters.to_string())
        .env("OXCCL_NCCL_TARGET", "cpu")
        .env("LD_LIBRARY_PATH", exe.parent().unwrap())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: {text}{}", exe.display(), String::from_utf8_lossy(&out.stderr));
    let value = |key: &str| -> Ns {
        text.lines()
            .find_map(|l| {
                let mut v = l.strip_prefix(key)?.split_whitespace().map(|x| x.parse::<f64>().ok());
                Some(Ns { wall: v.next()??, cpu: v.next()?? })
            })
            .unwrap_or_else(|| panic!("no `{key}` line in {text:?}"))
    };
    (value("grouped "), value("plain "))
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; the numbers are ITERS and ROUNDS.
    let nums: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let iters = nums.first().copied().unwrap_or(300_000).max(1);
    let rounds = nums.get(1).copied().unwrap_or(3).max(1);
    let dir = std::env::temp_dir().join(format!("oxccl-group-overhead-{}", std::process::id()));
    let exe = build_c(&dir);
    let devices: Vec<Device> = (0..NRANKS).map(Device::Cpu).collect();
    let comms = Comm::init_all(&devices)?;
    let streams = devices.iter().map(|d| d.new_stream()).collect::<Result<Vec<_>>>()?;
    println!("# {iters} groups of 2 AllReduce of count 0 on {NRANKS} CPU-target ranks, ns per group");
    println!("#        grouped: C  Rust  C-Rust  |  plain: C  Rust  C-Rust");
    for round in 1..=rounds {
        let (cg, cp) = c_round(&exe, iters);
        let (rg, rp) = rust_round(&comms, &streams, iters)?;
        let row = |what: &str, c: [f64; 2], r: [f64; 2]| {
            println!(
                "{round} {what:4}  {:7.1} {:7.1} {:6.1}  |  {:7.1} {:7.1} {:6.1}",
                c[0],
                r[0],
                c[0] - r[0],
                c[1],
                r[1],
                c[1] - r[1]
            )
        };
        row("wall", [cg.wall, cp.wall], [rg.wall, rp.wall]);
        row("cpu", [cg.cpu, cp.cpu], [rg.cpu, rp.cpu]);
    }
    for c in comms {
        c.destroy()?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
