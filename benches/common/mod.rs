//! Helpers shared by the benchmarks (not a bench target itself): GPU skip reporting, CUDA-event
//! timing over several streams, medians, the single-GPU loopback pair (two ranks on GPU 0, one
//! stream each, a protocol forced through `OXCCL_PROTO`), the device-to-device copy ceiling, and
//! a watchdog that ends a hung bench.
//!
//! Timing: a sample records a start event on every stream, queues the work (`f`), records an end
//! event on every stream and waits for them; its time is the GPU clock from the earliest start to
//! the latest end. A batch of `iters` back-to-back calls gives per-call time = sample / `iters`;
//! figures are the median over `reps` samples. For latencies, [`Timer::with_busy`] first keeps
//! each stream busy with a large fill so the host's enqueue cost stays out of the timed span.
#![allow(dead_code)]

use oxccl::cuda::{self, Event};
use oxccl::{Comm, DataType, Device, DeviceBuffer, Error, Func, Proto, RedOp, Result, Stream};
use std::time::{Duration, Instant};

/// Root rank of the rooted collectives in the benches.
pub const ROOT: usize = 0;

/// True when a GPU with the kernels is there; otherwise prints `SKIPPED: <bench>: <why>`.
pub fn gpu_or_skip(bench: &str) -> bool {
    if Device::cuda_count() == 0 {
        let why = match cuda::driver_version() {
            Err(e) => e.to_string(),
            Ok(v) => format!("the CUDA driver (version {v}) reports 0 devices"),
        };
        println!("SKIPPED: {bench}: no CUDA GPU visible ({why})");
        return false;
    }
    if oxccl::kernels::PTX_MODULES.is_empty() {
        println!("SKIPPED: {bench}: oxccl was built without its kernels (OXCCL_SKIP_PTX)");
        return false;
    }
    true
}

/// Prints what ran where: bench, GPU 0's name and bus id, driver version, oxccl version.
pub fn print_header(bench: &str) -> Result<()> {
    let ctx = cuda::Context::get(0)?;
    let v = cuda::driver_version()?;
    println!(
        "# {bench}: GPU 0 = {} ({}), CUDA driver {}.{}, oxccl {}, PTX {} bytes",
        ctx.name()?,
        ctx.bus_id()?,
        v / 1000,
        v % 1000 / 10,
        oxccl::version_string(),
        oxccl::kernels::PTX_BYTES
    );
    Ok(())
}

/// Ends the process with exit status 3 and a message when the bench is still running after
/// `limit` (a collective whose two ranks never meet would otherwise hang it forever). The
/// watchdog thread never touches the environment.
pub fn watchdog(bench: &'static str, limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!(
            "TIMEOUT: {bench} still running after {limit:?} (a hung collective? both ranks' kernels \
             must be resident on the GPU at once)"
        );
        std::process::exit(3);
    });
}

/// Median of `v` (the mean of the two middle values for an even count); 0 when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `bytes` as "8 B", "64 KiB", "256 MiB" (exact powers only get the larger unit).
pub fn fmt_bytes(bytes: usize) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

/// GB/s (10^9 bytes per second) of `bytes` in `us` microseconds.
pub fn gbps(bytes: usize, us: f64) -> f64 {
    if us <= 0.0 { 0.0 } else { bytes as f64 / us / 1e3 }
}

/// The CUDA stream of `s`; an error for a CPU-target stream.
pub fn cu(s: &Stream) -> Result<&cuda::Stream> {
    match s {
        Stream::Cuda(c) => Ok(c),
        Stream::Cpu(_) => Err(Error::InvalidArgument(
            "the benches time CUDA streams only".into(),
        )),
    }
}

/// One timed sample.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// GPU time, µs: from the earliest start event to the latest end event; with a busy prefix
    /// ([`Timer::with_busy`]) from the latest start event to the latest end event.
    pub gpu_us: f64,
    /// Host wall time from before the first start event (and busy prefix) to after the last end
    /// event completed, µs.
    pub host_us: f64,
    /// Host time spent inside the queued work `f` (enqueue cost), µs.
    pub enqueue_us: f64,
    /// With a busy prefix: whether the enqueue finished before the prefix did (else the GPU may
    /// have waited for the host inside the timed span). Always true without one.
    pub covered: bool,
}

/// Bytes each stream's busy prefix fills (about 50–100 µs of `cuMemsetD8Async` on an H200).
pub const BUSY_BYTES: usize = 128 << 20;

/// Start and end events on each of a set of streams (all on one device).
pub struct Timer<'a> {
    streams: Vec<&'a cuda::Stream>,
    start: Vec<Event>,
    end: Vec<Event>,
    /// Busy prefix: per stream a device range filled before the start events, and the GPU time
    /// of those fills (µs).
    busy: Option<(Vec<u64>, f64)>,
}

impl<'a> Timer<'a> {
    /// Events for `streams`.
    pub fn new(streams: Vec<&'a cuda::Stream>) -> Result<Timer<'a>> {
        let mk = |s: &&cuda::Stream| Event::new_timed(&s.ctx_arc());
        let start = streams.iter().map(mk).collect::<Result<_>>()?;
        let end = streams.iter().map(mk).collect::<Result<_>>()?;
        Ok(Timer {
            streams,
            start,
            end,
            busy: None,
        })
    }

    /// Events for every stream of `streams` (CUDA ones only).
    pub fn for_streams(streams: &'a [Stream]) -> Result<Timer<'a>> {
        Timer::new(streams.iter().map(cu).collect::<Result<_>>()?)
    }

    /// Device time without the host: every sample first queues a [`BUSY_BYTES`] fill of
    /// `scratch[i]` on stream `i`, so the measured work is fully queued before the GPU reaches
    /// the start events, and times from the latest start event (the last stream to get there) to
    /// the latest end event. `scratch` holds one buffer of at least [`BUSY_BYTES`] per stream.
    pub fn with_busy(mut self, scratch: &[DeviceBuffer]) -> Result<Timer<'a>> {
        if scratch.len() != self.streams.len() || scratch.iter().any(|b| b.len() < BUSY_BYTES) {
            return Err(Error::InvalidArgument(format!(
                "Timer::with_busy: scratch needs {} buffers of at least {BUSY_BYTES} bytes",
                self.streams.len()
            )));
        }
        let addrs: Vec<u64> = scratch.iter().map(|b| b.addr()).collect();
        let streams = self.streams.clone();
        let fill = || -> Result<()> {
            for (s, &a) in streams.iter().zip(&addrs) {
                s.memset_d8(a, 0, BUSY_BYTES)?;
            }
            Ok(())
        };
        fill()?;
        let mut t = Vec::new();
        for _ in 0..5 {
            t.push(self.sample(&mut || fill())?.gpu_us);
        }
        self.busy = Some((addrs, median(&mut t)));
        Ok(self)
    }

    /// Runs `f` (which queues work on the streams) between the events and waits for it.
    pub fn sample(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Sample> {
        let t0 = Instant::now();
        if let Some((addrs, _)) = &self.busy {
            for (s, &a) in self.streams.iter().zip(addrs) {
                s.memset_d8(a, 0, BUSY_BYTES)?;
            }
        }
        for (e, s) in self.start.iter().zip(&self.streams) {
            e.record(s)?;
        }
        let t1 = Instant::now();
        f()?;
        let enqueue_us = t1.elapsed().as_secs_f64() * 1e6;
        let covered = self
            .busy
            .as_ref()
            .is_none_or(|(_, busy_us)| t0.elapsed().as_secs_f64() * 1e6 < *busy_us);
        for (e, s) in self.end.iter().zip(&self.streams) {
            e.record(s)?;
        }
        for e in &self.end {
            e.synchronize()?;
        }
        let host_us = t0.elapsed().as_secs_f64() * 1e6;
        // Times relative to the first stream's start event (may be negative for the others).
        let base = &self.start[0];
        let (mut first, mut latest) = (0f64, 0f64);
        for e in &self.start[1..] {
            let t = e.elapsed_ms_since(base)? as f64;
            first = first.min(t);
            latest = latest.max(t);
        }
        let mut last = f64::MIN;
        for e in &self.end {
            last = last.max(e.elapsed_ms_since(base)? as f64);
        }
        let from = if self.busy.is_some() { latest } else { first };
        Ok(Sample {
            gpu_us: (last - from) * 1e3,
            host_us,
            enqueue_us,
            covered,
        })
    }
}

/// `n` scratch buffers of [`BUSY_BYTES`] on GPU 0, for [`Timer::with_busy`].
pub fn busy_scratch(n: usize) -> Result<Vec<DeviceBuffer>> {
    (0..n).map(|_| Device::Cuda(0).alloc(BUSY_BYTES)).collect()
}

/// How to measure one figure.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Untimed single calls first (module loads, first-touch).
    pub warmup: usize,
    /// Timed samples; the figure is their median.
    pub reps: usize,
    /// Calls per sample are chosen so that a sample lasts about this long (µs); 0: one call.
    pub target_us: f64,
    /// Most calls per sample.
    pub max_iters: usize,
}

impl Plan {
    /// Throughput: batches of back-to-back calls of about 2 ms, median of 15.
    pub const THROUGHPUT: Plan = Plan {
        warmup: 2,
        reps: 15,
        target_us: 2000.0,
        max_iters: 200,
    };
    /// Latency: one call per sample, median of 201.
    pub const LATENCY: Plan = Plan {
        warmup: 20,
        reps: 201,
        target_us: 0.0,
        max_iters: 1,
    };
}

/// The median figures of one measurement (per call).
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    /// Median GPU time per call, µs.
    pub gpu_us: f64,
    /// Median host wall time per sample divided by calls per sample, µs.
    pub host_us: f64,
    /// Median host enqueue time per call, µs.
    pub enqueue_us: f64,
    /// Calls per sample.
    pub iters: usize,
    /// Samples whose enqueue outlasted the busy prefix ([`Sample::covered`] false).
    pub uncovered: usize,
}

/// Measures `call` (queues one call on the timer's streams) as `plan` says.
pub fn measure(timer: &Timer, plan: Plan, call: &mut dyn FnMut() -> Result<()>) -> Result<Stats> {
    let mut one = 0.0;
    for _ in 0..plan.warmup.max(1) {
        one = timer.sample(call)?.gpu_us;
    }
    let iters = if plan.target_us > 0.0 && one > 0.0 {
        ((plan.target_us / one).ceil() as usize).clamp(1, plan.max_iters.max(1))
    } else {
        1
    };
    let (mut g, mut h, mut q, mut uncovered) = (Vec::new(), Vec::new(), Vec::new(), 0);
    let mut batch = || -> Result<()> {
        for _ in 0..iters {
            call()?;
        }
        Ok(())
    };
    for _ in 0..plan.reps.max(1) {
        let s = timer.sample(&mut batch)?;
        g.push(s.gpu_us / iters as f64);
        h.push(s.host_us / iters as f64);
        q.push(s.enqueue_us / iters as f64);
        uncovered += usize::from(!s.covered);
    }
    Ok(Stats {
        gpu_us: median(&mut g),
        host_us: median(&mut h),
        enqueue_us: median(&mut q),
        iters,
        uncovered,
    })
}

/// Sets (`Some`) or removes (`None`) an environment variable.
fn set_env(key: &str, value: Option<&str>) {
    // SAFETY: only the benches' main thread reads or writes the environment: the library reads it
    // inside `Comm::init_all` on the calling thread, and the watchdog thread never touches it.
    unsafe {
        match value {
            Some(v) => std::env::set_var(key, v),
            None => std::env::remove_var(key),
        }
    }
}

/// Two ranks of one communicator on GPU 0 (`OXCCL_ALLOW_SHARED_DEVICE=1`), one stream each: the
/// single-GPU loopback, where the ring's "peer" FIFOs are in the same HBM.
pub struct Loopback {
    pub comms: Vec<Comm>,
    pub streams: Vec<Stream>,
}

/// A rank's send and receive buffers.
pub struct RankBufs {
    pub send: DeviceBuffer,
    pub recv: DeviceBuffer,
}

impl RankBufs {
    /// `n` pairs of `bytes`-byte buffers on GPU 0.
    pub fn on_gpu0(n: usize, bytes: usize) -> Result<Vec<RankBufs>> {
        (0..n)
            .map(|_| {
                Ok(RankBufs {
                    send: Device::Cuda(0).alloc(bytes)?,
                    recv: Device::Cuda(0).alloc(bytes)?,
                })
            })
            .collect()
    }
}

impl Loopback {
    /// The pair with protocol `proto` forced (`OXCCL_PROTO=<name>`), or the tuner's choice for
    /// `None` (then `NCCL_PROTO` from the caller's environment applies). The variables the call
    /// sets are restored afterwards.
    pub fn new(proto: Option<Proto>) -> Result<Loopback> {
        let keys = ["OXCCL_ALLOW_SHARED_DEVICE", "OXCCL_PROTO"];
        let saved: Vec<Option<String>> = keys.iter().map(|k| std::env::var(k).ok()).collect();
        set_env(keys[0], Some("1"));
        set_env(keys[1], proto.map(|p| p.name()));
        let comms = Comm::init_all(&[Device::Cuda(0), Device::Cuda(0)]);
        for (k, v) in keys.iter().zip(&saved) {
            set_env(k, v.as_deref());
        }
        let comms = comms?;
        let streams = comms
            .iter()
            .map(|c| c.device().new_stream())
            .collect::<Result<_>>()?;
        Ok(Loopback { comms, streams })
    }

    /// Queues one `func` call of `bytes` bytes per rank (`bytes / dtype.size()` elements; Sum) on
    /// both ranks, rank 0 first. Broadcast and Reduce use root [`ROOT`]; AllReduce, Broadcast and
    /// Reduce only (the others need `nranks × bytes` buffers).
    pub fn call(&self, bufs: &[RankBufs], func: Func, dtype: DataType, bytes: usize) -> Result<()> {
        let count = bytes / dtype.size();
        for (r, c) in self.comms.iter().enumerate() {
            let (send, recv) = (bufs[r].send.slice(0, bytes)?, bufs[r].recv.slice(0, bytes)?);
            let s = &self.streams[r];
            match func {
                Func::AllReduce => c.all_reduce(send, recv, count, dtype, RedOp::Sum, s)?,
                Func::Broadcast => c.broadcast((r == ROOT).then_some(send), recv, count, dtype, ROOT, s)?,
                Func::Reduce => c.reduce(
                    send,
                    (r == ROOT).then_some(recv),
                    count,
                    dtype,
                    RedOp::Sum,
                    ROOT,
                    s,
                )?,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "Loopback::call: func {func} is not benched"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Queues `k` AllReduces (Sum) of `bytes` bytes per rank on both ranks, call `i` on bytes
    /// `i × bytes ..` of the buffers: `grouped`, inside one `oxccl::group::scope` (one launch
    /// per rank: the calls share a kernel entry), else as `k` separate calls per rank.
    pub fn all_reduces(&self, bufs: &[RankBufs], k: usize, dtype: DataType, bytes: usize, grouped: bool) -> Result<()> {
        let count = bytes / dtype.size();
        let slices = |r: usize, i: usize| -> Result<(oxccl::DevSlice<'_>, oxccl::DevSlice<'_>)> {
            Ok((bufs[r].send.slice(i * bytes, bytes)?, bufs[r].recv.slice(i * bytes, bytes)?))
        };
        if !grouped {
            for i in 0..k {
                for (r, c) in self.comms.iter().enumerate() {
                    let (send, recv) = slices(r, i)?;
                    c.all_reduce(send, recv, count, dtype, RedOp::Sum, &self.streams[r])?;
                }
            }
            return Ok(());
        }
        oxccl::group::scope(|g| -> Result<()> {
            for i in 0..k {
                for (r, c) in self.comms.iter().enumerate() {
                    let (send, recv) = slices(r, i)?;
                    g.all_reduce(c, send, recv, count, dtype, RedOp::Sum, &self.streams[r])?;
                }
            }
            Ok(())
        })?
    }

    /// Events on both ranks' streams.
    pub fn timer(&self) -> Result<Timer<'_>> {
        Timer::for_streams(&self.streams)
    }

    /// The protocol rank 0's last call ran with.
    pub fn last_proto(&self) -> Option<Proto> {
        self.comms[0].last_choice().map(|c| c.proto)
    }

    /// Errors unless rank 0's last call ran with `want` (forcing took effect).
    pub fn check_proto(&self, want: Proto) -> Result<()> {
        match self.last_proto() {
            Some(p) if p == want => Ok(()),
            got => Err(Error::Internal(format!(
                "OXCCL_PROTO={want} was forced but the call ran {got:?}"
            ))),
        }
    }
}

/// Loads (JIT-compiles on a cold cache) the ring kernels of (`func`, `dtype`, Sum) on GPU 0, one
/// module per protocol, and returns their module load time in seconds (of the first load in this
/// process), so that no timed call includes a JIT.
pub fn load_kernel(func: Func, dtype: DataType) -> Result<f64> {
    let mut seconds = 0.0;
    for &proto in oxccl::Proto::ALL {
        let name = oxccl::kernel_name(func, proto, dtype, RedOp::Sum);
        seconds += cuda::Context::get(0)?.kernel(name.as_str())?.load_seconds;
    }
    Ok(seconds)
}

/// The device-to-device copy ceiling on GPU 0: `cuMemcpyDtoDAsync` of `bytes` bytes from `src` to
/// `dst` (each at least `bytes` long) on `stream`, per call, measured as `plan` says.
pub fn copy_ceiling(
    stream: &Stream,
    dst: &DeviceBuffer,
    src: &DeviceBuffer,
    bytes: usize,
    plan: Plan,
) -> Result<Stats> {
    let s = cu(stream)?;
    let timer = Timer::new(vec![s])?;
    let (d, from) = (dst.slice(0, bytes)?.addr(), src.slice(0, bytes)?.addr());
    measure(&timer, plan, &mut || s.copy_dtod(d, from, bytes))
}
