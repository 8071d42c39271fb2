//! `cargo bench --bench all_reduce`: AllReduce time on every visible GPU (CUDA-event timing, median
//! of many runs) at a latency-bound and a bandwidth-bound size, with the ceiling next to each figure.
//! Without a GPU it says so and runs the CPU target instead (4 ranks), which measures the schedule
//! and protocol overhead on the host.
use oxccl::cuda::Event;
use oxccl::{Comm, DataType, Device, RedOp, Stream};

const RUNS: usize = 25;

fn main() -> oxccl::Result<()> {
    let gpus = Device::all_cuda();
    let (devices, label) = if gpus.is_empty() {
        println!("no CUDA GPU visible: benchmarking the CPU target (4 ranks) instead");
        (Device::cpus(4), "cpu")
    } else {
        (gpus, "cuda")
    };
    let comms = Comm::init_all(&devices)?;
    let n = comms.len();
    println!(
        "{:>12} {:>10} {:>12} {:>12}   ceiling",
        "bytes", "backend", "median us", "busbw GB/s"
    );
    for bytes in [8usize, 64 << 10, 64 << 20] {
        let count = bytes / 4;
        let streams: Vec<Stream> = devices.iter().map(|d| d.new_stream()).collect::<Result<_, _>>()?;
        let bufs: Vec<_> = devices.iter().map(|d| d.alloc(bytes)).collect::<Result<_, _>>()?;
        let mut times = Vec::with_capacity(RUNS);
        for run in 0..RUNS + 3 {
            let ev = match &streams[0] {
                Stream::Cuda(s) => {
                    let (a, b) = (Event::new(&s.ctx_arc())?, Event::new(&s.ctx_arc())?);
                    a.record(s)?;
                    Some((a, b))
                }
                Stream::Cpu(_) => None,
            };
            let t = std::time::Instant::now();
            for (r, c) in comms.iter().enumerate() {
                c.all_reduce(&bufs[r], &bufs[r], count, DataType::F32, RedOp::Sum, &streams[r])?;
            }
            if let (Some((a, b)), Stream::Cuda(s)) = (&ev, &streams[0]) {
                b.record(s)?;
            }
            for s in &streams {
                s.synchronize()?;
            }
            let us = match &ev {
                Some((a, b)) => b.elapsed_ms_since(a)? as f64 * 1e3,
                None => t.elapsed().as_secs_f64() * 1e6,
            };
            if run >= 3 {
                times.push(us);
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let busbw = bytes as f64 / med / 1e3 * 2.0 * (n as f64 - 1.0) / n as f64;
        let ceiling = if label == "cuda" {
            "H200 NVLink: ~370 GB/s per direction from SMs; empty-kernel launch ~3.4 us"
        } else {
            "host memory bandwidth"
        };
        println!("{bytes:>12} {label:>10} {med:>12.2} {busbw:>12.2}   {ceiling}");
    }
    Ok(())
}
