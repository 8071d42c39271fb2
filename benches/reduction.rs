//! `cargo bench --bench reduction`: reduction throughput per data type (sum) against the device
//! copy bandwidth, on the single-GPU loopback — a 2-rank communicator with both ranks on GPU 0
//! (`OXCCL_ALLOW_SHARED_DEVICE=1`, one stream each), Simple protocol forced (`OXCCL_PROTO`,
//! checked through `Comm::last_choice`).
//!
//! For each of the ten data types: AllReduce (sum, out of place) of 16 MiB and 256 MiB per rank.
//! Each figure is the median over 15 CUDA-event-timed batches of back-to-back calls; busbw =
//! bytes / time × 2(n−1)/n (= 1 on 2 ranks), in GB/s. Every type moves the same bytes, so the
//! differences between rows are the cost of the reduction itself (f16/bf16 convert to f32 and
//! back, f64 and 64-bit integers are wider per element).
//! **Ceiling**: a `cuMemcpyDtoDAsync` of the same size on the same GPU, timed the same way, with
//! busbw as a percentage of it. On 2 ranks each AllReduce byte is read twice (own input, peer's
//! FIFO) and written twice (FIFO, output) at least, against the copy's one read and one write,
//! and both ranks share one HBM: the copy figure is an upper bound, not a target.
//!
//! Without a GPU (or a build without kernels) it prints `SKIPPED: <why>` and exits 0. Runs in
//! about 5–15 s on an H200 plus the ten module loads on a cold JIT cache (printed first).
mod common;

use common::{Loopback, Plan, RankBufs, fmt_bytes, gbps, measure};
use oxccl::{DataType, Func, Proto, Result};
use std::time::Duration;

const BENCH: &str = "reduction";
const SIZES: [usize; 2] = [16 << 20, 256 << 20];

fn main() -> Result<()> {
    if !common::gpu_or_skip(BENCH) {
        return Ok(());
    }
    common::watchdog(BENCH, Duration::from_secs(300));
    common::print_header(BENCH)?;
    for &dtype in DataType::ALL {
        println!(
            "# module load (JIT) of {}/{dtype}: {:.3} s",
            Func::AllReduce,
            common::load_kernel(Func::AllReduce, dtype)?
        );
    }
    let max = SIZES[SIZES.len() - 1];
    let bufs = RankBufs::on_gpu0(2, max)?;
    let copy_stream = oxccl::Device::Cuda(0).new_stream()?;
    let copy: Vec<_> = SIZES
        .iter()
        .map(|&b| common::copy_ceiling(&copy_stream, &bufs[1].recv, &bufs[0].send, b, Plan::THROUGHPUT))
        .collect::<Result<_>>()?;

    let pair = Loopback::new(Some(Proto::Simple))?;
    let timer = pair.timer()?;
    println!("\n## AllReduce sum, Simple, 2-rank loopback on GPU 0 (CUDA events, median of 15 batches)");
    println!(
        "{:>9} {:>9} {:>11} {:>10} {:>10} {:>10} {:>8}   ceiling",
        "dtype", "bytes", "time us", "busbw GB/s", "copy us", "copy GB/s", "of copy"
    );
    for &dtype in DataType::ALL {
        for (i, &bytes) in SIZES.iter().enumerate() {
            let s = measure(&timer, Plan::THROUGHPUT, &mut || {
                pair.call(&bufs, Func::AllReduce, dtype, bytes)
            })?;
            pair.check_proto(Proto::Simple)?;
            let (bw, cbw) = (gbps(bytes, s.gpu_us), gbps(bytes, copy[i].gpu_us));
            println!(
                "{:>9} {:>9} {:>11.2} {:>10.2} {:>10.2} {:>10.2} {:>7.1}%   cuMemcpyDtoD {} = {:.1} GB/s",
                dtype.name(),
                fmt_bytes(bytes),
                s.gpu_us,
                bw,
                copy[i].gpu_us,
                cbw,
                100.0 * bw / cbw,
                fmt_bytes(bytes),
                cbw
            );
        }
    }
    Ok(())
}
