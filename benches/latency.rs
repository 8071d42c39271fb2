//! `cargo bench --bench latency`: kernel launch-to-completion latency of the smallest collective
//! call against a plain driver launch as the floor.
//!
//! The call: an 8-byte call on the single-GPU loopback — a 2-rank communicator with both ranks on
//! GPU 0 (`OXCCL_ALLOW_SHARED_DEVICE=1`, one stream each) — AllReduce and Broadcast with LL forced
//! (`OXCCL_PROTO=LL`), and AllReduce with the tuner's choice (printed). (A 1-rank AllReduce is a
//! copy, not a kernel, so it would not measure the kernel.)
//!
//! Two figures per row, each the median of many single calls:
//! - host µs: wall time from just before the call is queued on both streams until both streams'
//!   synchronize returned (what a caller waits for); "enqueue µs" is the part spent inside the
//!   queuing calls (1001 samples, 20 warm-up);
//! - GPU µs: device time of one call (201 samples): each sample first queues a 128 MiB
//!   `cuMemsetD8Async` on every stream it uses, so the call is fully queued before the GPU
//!   reaches the start events, and runs from the last stream's start event to the last end event
//!   (launch from the queue to completion, without the host; a warning follows the table if a
//!   sample's enqueue outlasted the fill).
//!
//! **Floor** (the ceiling of a latency): the same measurement of `cuMemsetD8Async` of 8 bytes
//! (and of `cuMemcpyDtoDAsync` of 8 bytes) on one stream, and of one 8-byte `cuMemsetD8Async` on
//! each of the two streams — the same two launches as a loopback call with no kernel work; the
//! collective rows print their excess over that two-stream floor.
//!
//! Without a GPU (or a build without kernels) it prints `SKIPPED: <why>` and exits 0. Runs in a
//! few seconds on an H200 (plus the module loads on a cold JIT cache, printed first).
mod common;

use common::{Loopback, Plan, RankBufs, Timer, measure, median};
use oxccl::cuda;
use oxccl::{DataType, DeviceBuffer, Func, Proto, Result};
use std::time::{Duration, Instant};

const BENCH: &str = "latency";
const HOST_REPS: usize = 1001;
const HOST_WARMUP: usize = 20;

/// Median host (launch→both streams done, enqueue) times of `call` in µs.
fn host_latency(streams: &[&cuda::Stream], call: &mut dyn FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let (mut done, mut enq) = (Vec::with_capacity(HOST_REPS), Vec::with_capacity(HOST_REPS));
    for i in 0..HOST_WARMUP + HOST_REPS {
        let t0 = Instant::now();
        call()?;
        let t1 = t0.elapsed();
        for s in streams {
            s.synchronize()?;
        }
        if i >= HOST_WARMUP {
            done.push(t0.elapsed().as_secs_f64() * 1e6);
            enq.push(t1.as_secs_f64() * 1e6);
        }
    }
    Ok((median(&mut done), median(&mut enq)))
}

struct Row {
    what: String,
    host_us: f64,
    enqueue_us: f64,
    gpu_us: f64,
    /// GPU samples not covered by the busy prefix.
    uncovered: usize,
}

/// Host and GPU figures of `call`, which queues work on `streams` (`scratch[i]`: the busy prefix
/// buffer of stream `i`).
fn row(
    what: String,
    streams: Vec<&cuda::Stream>,
    scratch: &[DeviceBuffer],
    call: &mut dyn FnMut() -> Result<()>,
) -> Result<Row> {
    let (host_us, enqueue_us) = host_latency(&streams, call)?;
    let n = streams.len();
    let timer = Timer::new(streams)?.with_busy(&scratch[..n])?;
    let s = measure(&timer, Plan::LATENCY, call)?;
    Ok(Row {
        what,
        host_us,
        enqueue_us,
        gpu_us: s.gpu_us,
        uncovered: s.uncovered,
    })
}

fn main() -> Result<()> {
    if !common::gpu_or_skip(BENCH) {
        return Ok(());
    }
    common::watchdog(BENCH, Duration::from_secs(300));
    common::print_header(BENCH)?;
    for (func, dtype) in [(Func::AllReduce, DataType::F32), (Func::Broadcast, DataType::U8)] {
        println!(
            "# module load (JIT) of {func}/{dtype}: {:.3} s",
            common::load_kernel(func, dtype)?
        );
    }
    let bufs = RankBufs::on_gpu0(2, 4096)?;
    let scratch = common::busy_scratch(2)?;
    let sc = &scratch[..];
    let ll = Loopback::new(Some(Proto::Ll))?;
    let tuned = Loopback::new(None)?;
    let s0 = common::cu(&ll.streams[0])?;
    let s1 = common::cu(&ll.streams[1])?;
    let (d0, d1, src) = (bufs[0].recv.addr(), bufs[1].recv.addr(), bufs[0].send.addr());

    let mut floors = vec![
        row("cuMemsetD8Async 8 B, 1 stream".into(), vec![s0], sc, &mut || {
            s0.memset_d8(d0, 0, 8)
        })?,
        row(
            "cuMemcpyDtoDAsync 8 B, 1 stream".into(),
            vec![s0],
            sc,
            &mut || s0.copy_dtod(d0, src, 8),
        )?,
    ];
    let pair_floor = row(
        "cuMemsetD8Async 8 B on each of 2 streams".into(),
        vec![s0, s1],
        sc,
        &mut || {
            s0.memset_d8(d0, 0, 8)?;
            s1.memset_d8(d1, 0, 8)
        },
    )?;

    let mut calls = Vec::new();
    for (func, dtype) in [(Func::AllReduce, DataType::F32), (Func::Broadcast, DataType::U8)] {
        let r = row(
            format!("{func} 8 B, LL, 2-rank loopback"),
            vec![s0, s1],
            sc,
            &mut || ll.call(&bufs, func, dtype, 8),
        )?;
        ll.check_proto(Proto::Ll)?;
        calls.push(r);
    }
    // A group's calls of one kernel entry share a launch: 8 AllReduces of 8 B, as 8 calls per
    // rank and as one group (one launch per rank).
    for grouped in [false, true] {
        let before = ll.comms[0].kernel_launches();
        ll.all_reduces(&bufs, 8, DataType::F32, 8, grouped)?;
        s0.synchronize()?;
        s1.synchronize()?;
        let launches = ll.comms[0].kernel_launches() - before;
        let mut r = row(String::new(), vec![s0, s1], sc, &mut || {
            ll.all_reduces(&bufs, 8, DataType::F32, 8, grouped)
        })?;
        r.what = format!(
            "8 × AllReduce 8 B, LL, {}: {launches} launch(es)/rank",
            if grouped { "one group" } else { "8 calls" }
        );
        calls.push(r);
    }
    let (t0, t1) = (common::cu(&tuned.streams[0])?, common::cu(&tuned.streams[1])?);
    let mut r = row(String::new(), vec![t0, t1], sc, &mut || {
        tuned.call(&bufs, Func::AllReduce, DataType::F32, 8)
    })?;
    let chosen = tuned.comms[0]
        .last_choice()
        .map(|c| format!("{}, {} ch", c.proto, c.nchannels))
        .unwrap_or_else(|| "?".into());
    r.what = format!("AllReduce 8 B, tuner's choice ({chosen}), 2-rank loopback");
    calls.push(r);

    println!("\n## Launch-to-completion latency on GPU 0 (medians: host of {HOST_REPS}, GPU events of 201)");
    println!(
        "{:<58} {:>9} {:>11} {:>8}   floor",
        "call", "host us", "enqueue us", "GPU us"
    );
    floors.push(pair_floor);
    for f in &floors {
        println!(
            "{:<58} {:>9.2} {:>11.2} {:>8.2}   (is a floor)",
            f.what, f.host_us, f.enqueue_us, f.gpu_us
        );
    }
    let floor = &floors[floors.len() - 1];
    for c in &calls {
        println!(
            "{:<58} {:>9.2} {:>11.2} {:>8.2}   2-stream memset floor {:.2} host / {:.2} GPU: +{:.2} / +{:.2}",
            c.what,
            c.host_us,
            c.enqueue_us,
            c.gpu_us,
            floor.host_us,
            floor.gpu_us,
            c.host_us - floor.host_us,
            c.gpu_us - floor.gpu_us
        );
    }
    let uncovered: usize = floors.iter().chain(&calls).map(|r| r.uncovered).sum();
    if uncovered > 0 {
        println!(
            "WARNING: {uncovered} GPU samples were enqueued slower than the {} busy fill: host time may be \
             included in those",
            common::fmt_bytes(common::BUSY_BYTES)
        );
    }
    Ok(())
}
