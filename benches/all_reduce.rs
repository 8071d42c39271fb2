//! `cargo bench --bench all_reduce`: AllReduce time on every visible GPU (one rank per GPU, float
//! sum, in place) at a latency-bound and a bandwidth-bound size, with the ceiling next to each
//! figure. On CUDA each figure is the median of 25 CUDA-event-timed calls (start events on every
//! rank's stream before the call, end events after it; earliest start to latest end), after 3
//! warm-up calls; busbw = bytes / time × 2(n−1)/n (nccl-tests). Without a GPU it says so and runs
//! the CPU target instead (4 ranks, host wall clock), which measures the schedule and protocol
//! overhead on the host.
mod common;

use common::{Plan, Timer, measure, median};
use oxccl::{Comm, DataType, Device, RedOp, Stream};

const RUNS: usize = 25;
const PLAN: Plan = Plan {
    warmup: 3,
    reps: RUNS,
    target_us: 0.0,
    max_iters: 1,
};

fn main() -> oxccl::Result<()> {
    let gpus = Device::all_cuda();
    let cuda = !gpus.is_empty() && !oxccl::kernels::PTX_MODULES.is_empty();
    let (devices, label) = if cuda {
        (gpus, "cuda")
    } else {
        println!("no CUDA GPU (or no kernels in this build): benchmarking the CPU target (4 ranks) instead");
        (Device::cpus(4), "cpu")
    };
    let comms = Comm::init_all(&devices)?;
    let n = comms.len();
    println!(
        "{:>12} {:>10} {:>12} {:>12}   ceiling",
        "bytes", "backend", "median us", "busbw GB/s"
    );
    let streams: Vec<Stream> = devices.iter().map(|d| d.new_stream()).collect::<Result<_, _>>()?;
    for bytes in [8usize, 64 << 10, 64 << 20] {
        let count = bytes / 4;
        let bufs: Vec<_> = devices.iter().map(|d| d.alloc(bytes)).collect::<Result<_, _>>()?;
        let mut call = || -> oxccl::Result<()> {
            for (r, c) in comms.iter().enumerate() {
                c.all_reduce(&bufs[r], &bufs[r], count, DataType::F32, RedOp::Sum, &streams[r])?;
            }
            Ok(())
        };
        let med = if cuda {
            measure(&Timer::for_streams(&streams)?, PLAN, &mut call)?.gpu_us
        } else {
            let mut times = Vec::with_capacity(RUNS);
            for run in 0..RUNS + 3 {
                let t = std::time::Instant::now();
                call()?;
                for s in &streams {
                    s.synchronize()?;
                }
                if run >= 3 {
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            median(&mut times)
        };
        let busbw = common::gbps(bytes, med) * 2.0 * (n as f64 - 1.0) / n as f64;
        let ceiling = if cuda {
            "H200 NVLink: ~370 GB/s per direction from SMs; empty-kernel launch ~3.4 us"
        } else {
            "host memory bandwidth"
        };
        println!("{bytes:>12} {label:>10} {med:>12.2} {busbw:>12.2}   {ceiling}");
    }
    Ok(())
}
