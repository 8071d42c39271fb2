//! `cargo bench --bench protocols`: per-protocol (LL, LL128, Simple) throughput and step latency
//! on the single-GPU loopback — a 2-rank communicator with both ranks on GPU 0
//! (`OXCCL_ALLOW_SHARED_DEVICE=1`, one stream each), the protocol forced with `OXCCL_PROTO` (the
//! bench checks through `Comm::last_choice` that it took effect).
//!
//! Table 1, throughput: Broadcast (uint8, root 0) and AllReduce (float, sum), out of place, from
//! 8 B to 256 MiB (×4 steps and 256 MiB). Each figure is the median over 15 CUDA-event-timed
//! batches of back-to-back calls (a batch lasts about 2 ms); algbw = bytes / time, busbw =
//! algbw × nccl-tests' factor (1 for Broadcast, 2(n−1)/n = 1 for AllReduce on 2 ranks).
//! **Ceiling**: a `cuMemcpyDtoDAsync` of the same size on the same GPU, timed the same way
//! ("copy GB/s"), and busbw as a percentage of it. Both ranks share one HBM, and a collective
//! moves each byte more than once (Broadcast Simple: the root reads its input and writes its
//! output and the peer's FIFO, the peer reads the FIFO and writes its output — 5 passes over the
//! data against the copy's 2), so the loopback's real bound is below the copy figure; the ratio
//! compares the protocols to each other and shows how close each comes to moving bytes at copy
//! speed.
//!
//! Table 2, step latency: the device time of one 8-byte call per sample (median of 201), minus
//! the floor — one `cuMemsetD8Async` of 8 bytes on each of the two streams, timed the same way
//! (the same two launches on two streams, with no protocol work) — divided by the ring steps of
//! the call (Broadcast: n−1 = 1, AllReduce: 2(n−1) = 2). Device time: each sample first queues a
//! 128 MiB fill on both streams, so both ranks' launches are queued before the GPU reaches the
//! start events, and runs from the last stream's start event to the last end event (the host's
//! enqueue cost stays out; a warning is printed if a sample's enqueue outlasted the fill).
//! **Ceiling** (here a floor): 0 µs per step above the launch floor, which is printed next to it.
//!
//! Without a GPU (or a build without kernels) it prints `SKIPPED: <why>` and exits 0. Runs in
//! about 10–30 s on an H200 (a cold JIT cache adds the module loads, printed first).
mod common;

use common::{Loopback, Plan, RankBufs, Stats, Timer, fmt_bytes, gbps, measure};
use oxccl::{DataType, Func, Proto, Result};
use std::time::Duration;

const BENCH: &str = "protocols";
const MAX_BYTES: usize = 256 << 20;

/// 8 B, 32 B, ... 128 MiB (×4), then 256 MiB.
fn sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (0..)
        .map(|k| 8usize << (2 * k))
        .take_while(|&b| b <= 128 << 20)
        .collect();
    v.push(MAX_BYTES);
    v
}

/// The benched collectives with the element type they run on.
const FUNCS: [(Func, DataType); 2] = [(Func::Broadcast, DataType::U8), (Func::AllReduce, DataType::F32)];

/// Ring steps of one tiny call on 2 ranks (nccl-tests/NCCL ring: Broadcast n−1, AllReduce 2(n−1)).
fn ring_steps(func: Func) -> f64 {
    match func {
        Func::AllReduce => 2.0,
        _ => 1.0,
    }
}

fn main() -> Result<()> {
    if !common::gpu_or_skip(BENCH) {
        return Ok(());
    }
    common::watchdog(BENCH, Duration::from_secs(300));
    common::print_header(BENCH)?;
    for (func, dtype) in FUNCS {
        println!(
            "# module load (JIT) of {func}/{dtype}: {:.3} s",
            common::load_kernel(func, dtype)?
        );
    }
    let bufs = RankBufs::on_gpu0(2, MAX_BYTES)?;
    let scratch = common::busy_scratch(2)?;

    // The ceiling: device-to-device copy of each size on one stream.
    let copy_stream = oxccl::Device::Cuda(0).new_stream()?;
    let mut copy = Vec::new();
    for &b in &sizes() {
        copy.push(common::copy_ceiling(
            &copy_stream,
            &bufs[1].recv,
            &bufs[0].send,
            b,
            Plan::THROUGHPUT,
        )?);
    }

    let mut rows = Vec::new();
    let mut steps = Vec::new();
    for proto in [Proto::Ll, Proto::Ll128, Proto::Simple] {
        let pair = Loopback::new(Some(proto))?;
        let timer = pair.timer()?;
        let lat_timer = pair.timer()?.with_busy(&scratch)?;
        for (func, dtype) in FUNCS {
            eprintln!("{BENCH}: {func} {proto} ...");
            for (i, &bytes) in sizes().iter().enumerate() {
                let s = measure(&timer, Plan::THROUGHPUT, &mut || {
                    pair.call(&bufs, func, dtype, bytes)
                })?;
                pair.check_proto(proto)?;
                let bw = gbps(bytes, s.gpu_us);
                let cbw = gbps(bytes, copy[i].gpu_us);
                rows.push(format!(
                    "{:>10} {:>6} {:>9} {:>11.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2} {:>7.1}%",
                    func.name(),
                    proto.name(),
                    fmt_bytes(bytes),
                    s.gpu_us,
                    bw,
                    bw, // busbw factor is 1 for both on 2 ranks
                    copy[i].gpu_us,
                    cbw,
                    100.0 * bw / cbw
                ));
            }
            let tiny = measure(&lat_timer, Plan::LATENCY, &mut || {
                pair.call(&bufs, func, dtype, 8)
            })?;
            pair.check_proto(proto)?;
            let floor = launch_floor(&lat_timer, &pair, &bufs)?;
            steps.push(format!(
                "{:>10} {:>6} {:>12.2} {:>12.2} {:>6} {:>14.2}   0 above the floor{}",
                func.name(),
                proto.name(),
                tiny.gpu_us,
                floor.gpu_us,
                ring_steps(func),
                (tiny.gpu_us - floor.gpu_us) / ring_steps(func),
                uncovered_note(&[tiny, floor])
            ));
        }
    }

    println!("\n## Throughput, 2-rank loopback on GPU 0 (CUDA events, median of 15 batches)");
    println!(
        "{:>10} {:>6} {:>9} {:>11} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "coll", "proto", "bytes", "time us", "algbw", "busbw", "ceil us", "ceil GB/s", "of ceil"
    );
    println!(
        "(GB/s; ceiling = cuMemcpyDtoDAsync of the same bytes on GPU 0, timed the same way; \
         'of ceil' = busbw / ceiling)"
    );
    for r in &rows {
        println!("{r}");
    }
    println!(
        "\n## Step latency: 8-byte call minus the launch floor, per ring step (device time, median of 201)"
    );
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>6} {:>14}   ceiling",
        "coll", "proto", "8 B call us", "floor us", "steps", "us per step"
    );
    for r in &steps {
        println!("{r}");
    }
    println!(
        "(floor: one cuMemsetD8Async of 8 B on each rank's stream, timed the same way; both queued behind a \
         {} fill per stream, timed from the last stream's start event)",
        fmt_bytes(common::BUSY_BYTES)
    );
    Ok(())
}

/// A warning when some latency samples were not covered by the busy prefix.
fn uncovered_note(stats: &[Stats]) -> String {
    let n: usize = stats.iter().map(|s| s.uncovered).sum();
    if n == 0 {
        String::new()
    } else {
        format!(" (WARNING: {n} samples enqueued slower than the busy prefix: host time may be included)")
    }
}

/// One 8-byte `cuMemsetD8Async` on each of the pair's two streams, timed on `timer`.
fn launch_floor(timer: &Timer, pair: &Loopback, bufs: &[RankBufs]) -> Result<Stats> {
    let dst: Vec<u64> = bufs.iter().map(|b| b.recv.addr()).collect();
    measure(timer, Plan::LATENCY, &mut || {
        for (r, st) in pair.streams.iter().enumerate() {
            common::cu(st)?.memset_d8(dst[r], 0, 8)?;
        }
        Ok(())
    })
}
