//! The benchmark sweep behind `oxccl perf`, as nccl-tests runs it: for each size, out-of-place then
//! in-place, `warmup` untimed iterations, `iters` timed ones (host wall clock around the queued
//! iterations of every rank, then a synchronize), then `check` verification runs with exact inputs
//! and poisoned outputs, counting wrong elements on every rank. With a reference backend (NCCL) the
//! same size is timed on it right after oxccl, on the same buffers.
use super::check;
use super::table::{self, Measure, NcclCols, RefTiming, Row};
use crate::Comm;
use crate::error::{Error, Result};
use crate::mem::{Device, DeviceBuffer, Stream};
use crate::nccl::NcclComms;
use oxccl_gpu::abi::{DataType, Func, RedOp};
use std::time::Instant;

/// What to sweep.
#[derive(Clone, Debug)]
pub struct PerfConfig {
    pub func: Func,
    pub dtype: DataType,
    pub op: RedOp,
    /// Message sizes in bytes (nccl-tests' S).
    pub sizes: Vec<u64>,
    /// Untimed iterations per size and placement.
    pub warmup: usize,
    /// Timed iterations per size and placement.
    pub iters: usize,
    /// Verification runs per size and placement (0 = none; `#wrong` then prints N/A).
    pub check: usize,
    /// oxccl: issue each iteration's calls of the local ranks as one group ([`crate::group_start`],
    /// the calls, [`crate::group_end`]), as the NCCL backend always does with
    /// ncclGroupStart/ncclGroupEnd; else one call after the other.
    pub group: bool,
    /// oxccl, several local ranks: issue each local rank's timed calls from a thread of its own,
    /// as a process per rank would, instead of one thread issuing every rank's call in turn.
    pub threads: bool,
}

/// A set of ranks that can run the collective: oxccl communicators, or NCCL's.
pub enum Backend {
    Oxccl(Vec<Comm>),
    Nccl(NcclComms),
}

/// Root of the rooted collectives in the sweep (nccl-tests' default `-r 0`).
pub const ROOT: usize = 0;

/// Where rank `rank`'s buffers of one call sit: (send, recv) addresses, for `count` elements per
/// rank (nccl-tests' in-place offsets: AllGather sends from `recv + rank·count`, ReduceScatter
/// receives at `send + rank·count`, i.e. at `recv + rank·count` of the one in-place buffer).
fn call_addrs(
    func: Func,
    b: &RankBufs,
    rank: usize,
    count: usize,
    dtype: DataType,
    in_place: bool,
) -> (u64, u64) {
    let recv = b.recv.addr();
    let block = (rank * count * dtype.size()) as u64;
    match (func, in_place) {
        (_, false) => (b.send.addr(), recv),
        (Func::AllGather, true) => (recv + block, recv),
        (Func::ReduceScatter, true) => (recv, recv + block),
        (_, true) => (recv, recv),
    }
}

impl Backend {
    /// Queues one call on every local rank; `ranks[i]` is the global rank of local slot `i`.
    #[allow(clippy::too_many_arguments)]
    fn launch_all(
        &self,
        bufs: &[RankBufs],
        streams: &[Stream],
        ranks: &[usize],
        cfg: &PerfConfig,
        count: usize,
        in_place: bool,
    ) -> Result<()> {
        let (func, dtype, op) = (cfg.func, cfg.dtype, cfg.op);
        match self {
            Backend::Oxccl(comms) => {
                if cfg.group {
                    crate::group_start()?;
                }
                let mut res = Ok(());
                for (r, c) in comms.iter().enumerate() {
                    let (send, recv) = call_addrs(func, &bufs[r], ranks[r], count, dtype, in_place);
                    // SAFETY: the buffers hold the sweep's largest message (nccl-tests' S bytes,
                    // which covers nranks × count for AllGather/ReduceScatter) on rank r's device
                    // and stay alive until the synchronize that follows.
                    res = unsafe { c.collective_raw(func, send, recv, count, dtype, op, ROOT, &streams[r]) };
                    if res.is_err() {
                        break;
                    }
                }
                if cfg.group {
                    // After a refused call none of the group runs: its peers' calls alone
                    // would wait for it.
                    let ended = if res.is_ok() { crate::group_end() } else { crate::group::abandon_end() };
                    res = res.and(ended);
                }
                res
            }
            Backend::Nccl(n) => {
                NcclComms::group_start()?;
                let mut res = Ok(());
                for r in 0..n.local_ranks() {
                    let (send, recv) = call_addrs(func, &bufs[r], ranks[r], count, dtype, in_place);
                    let Stream::Cuda(s) = &streams[r] else {
                        res = Err(Error::invalid("NCCL needs CUDA streams"));
                        break;
                    };
                    // SAFETY: as above.
                    res = unsafe { n.collective(r, func, send, recv, count, dtype, op, ROOT, s) };
                    if res.is_err() {
                        break;
                    }
                }
                NcclComms::group_end()?;
                res
            }
        }
    }
}

/// Inputs and expected outputs of one check of `func`: per rank (input bytes, expected output
/// bytes or `None` where the output is not defined — Reduce on non-roots), with `count` elements
/// per rank. Values come from the exact generator of [`check`] (for AllGather and Broadcast the
/// Sum generator: any values would do).
fn check_data(
    cfg: &PerfConfig,
    nranks: usize,
    count: usize,
    seed: u64,
) -> Result<Vec<(Vec<u8>, Option<Vec<u8>>)>> {
    let input_of = |op: RedOp, r: usize, n: usize| {
        check::fill_input(Func::AllReduce, cfg.dtype, op, r, nranks, seed, n)
            .ok_or_else(|| Error::Internal("no data generator".into()))
    };
    let reduced = |n: usize| {
        check::expected(Func::AllReduce, cfg.dtype, cfg.op, nranks, seed, n)
            .ok_or_else(|| Error::Internal("no reference".into()))
    };
    let bytes = count * cfg.dtype.size();
    Ok(match cfg.func {
        Func::AllReduce => {
            let exp = reduced(count)?;
            (0..nranks)
                .map(|r| Ok((input_of(cfg.op, r, count)?, Some(exp.clone()))))
                .collect::<Result<_>>()?
        }
        Func::Reduce => {
            let exp = reduced(count)?;
            (0..nranks)
                .map(|r| Ok((input_of(cfg.op, r, count)?, (r == ROOT).then(|| exp.clone()))))
                .collect::<Result<_>>()?
        }
        Func::ReduceScatter => {
            let exp = reduced(nranks * count)?;
            (0..nranks)
                .map(|r| {
                    Ok((
                        input_of(cfg.op, r, nranks * count)?,
                        Some(exp[r * bytes..(r + 1) * bytes].to_vec()),
                    ))
                })
                .collect::<Result<_>>()?
        }
        Func::Broadcast => {
            let data = input_of(RedOp::Sum, ROOT, count)?;
            (0..nranks)
                .map(|r| {
                    (
                        if r == ROOT { data.clone() } else { vec![0; bytes] },
                        Some(data.clone()),
                    )
                })
                .collect()
        }
        Func::AllGather => {
            let inputs: Vec<Vec<u8>> = (0..nranks)
                .map(|r| input_of(RedOp::Sum, r, count))
                .collect::<Result<_>>()?;
            let all = inputs.concat();
            inputs.into_iter().map(|i| (i, Some(all.clone()))).collect()
        }
    })
}

/// Per-rank send and receive buffers, sized for the largest message of the sweep.
pub struct RankBufs {
    pub send: DeviceBuffer,
    pub recv: DeviceBuffer,
}

/// Devices, streams and buffers shared by every backend of one sweep: the ranks of this process
/// (all of them, or one per process with `oxccl perf --procs`).
pub struct Bench {
    pub devices: Vec<Device>,
    pub streams: Vec<Stream>,
    pub bufs: Vec<RankBufs>,
    /// Global rank of each local slot.
    pub ranks: Vec<usize>,
    /// Ranks in the communicator, over all processes.
    pub nranks: usize,
}

impl Bench {
    /// Allocates buffers of `max_bytes` per rank (plus streams) on `devices`, rank `i` on
    /// `devices[i]`: every rank in this process.
    pub fn new(devices: &[Device], max_bytes: u64) -> Result<Bench> {
        let ranks: Vec<usize> = (0..devices.len()).collect();
        Bench::with_ranks(devices, &ranks, devices.len(), max_bytes)
    }

    /// As [`Bench::new`] for the ranks `ranks` (global rank of each device) of an
    /// `nranks`-rank communicator spread over processes. Times are then the slowest rank's and
    /// `#wrong` the sum over all ranks, both combined with an AllReduce on the oxccl backend.
    pub fn with_ranks(devices: &[Device], ranks: &[usize], nranks: usize, max_bytes: u64) -> Result<Bench> {
        if ranks.len() != devices.len() || ranks.iter().any(|&r| r >= nranks) {
            return Err(Error::invalid(format!(
                "ranks {ranks:?} do not match {} devices of an {nranks}-rank communicator",
                devices.len()
            )));
        }
        let mut streams = Vec::new();
        let mut bufs = Vec::new();
        for d in devices {
            streams.push(d.new_stream()?);
            bufs.push(RankBufs {
                send: d.alloc(max_bytes as usize)?,
                recv: d.alloc(max_bytes as usize)?,
            });
        }
        Ok(Bench {
            devices: devices.to_vec(),
            streams,
            bufs,
            ranks: ranks.to_vec(),
            nranks,
        })
    }

    /// True when other processes hold some of the ranks.
    pub(super) fn spread(&self) -> bool {
        self.ranks.len() < self.nranks
    }

    /// Combines `v` over every process's ranks with `op` (an AllReduce of one u64 over the
    /// backend's own communicator, as nccl-tests combines results over MPI); `v` itself when this
    /// process holds every rank.
    pub(super) fn across_ranks(&self, b: &Backend, v: u64, op: RedOp) -> Result<u64> {
        if !self.spread() {
            return Ok(v);
        }
        let mut out = v;
        for (i, d) in self.devices.iter().enumerate() {
            let buf = d.alloc(8)?;
            buf.write(0, &v.to_ne_bytes())?;
            match (b, &self.streams[i]) {
                (Backend::Oxccl(comms), s) => {
                    let c = comms
                        .get(i)
                        .ok_or_else(|| Error::Internal("no communicator for a local rank".into()))?;
                    c.all_reduce(&buf, &buf, 1, DataType::U64, op, s)?;
                }
                (Backend::Nccl(n), Stream::Cuda(s)) => {
                    // SAFETY: `buf` is 8 bytes on this rank's GPU and lives past the synchronize.
                    unsafe {
                        n.collective(
                            i,
                            Func::AllReduce,
                            buf.addr(),
                            buf.addr(),
                            1,
                            DataType::U64,
                            op,
                            ROOT,
                            s,
                        )?
                    };
                }
                (Backend::Nccl(_), Stream::Cpu(_)) => return Err(Error::invalid("NCCL needs CUDA streams")),
            }
            self.streams[i].synchronize()?;
            let mut got = [0u8; 8];
            buf.read(0, &mut got)?;
            out = u64::from_ne_bytes(got);
        }
        Ok(out)
    }

    /// Waits for every local rank's stream.
    pub(super) fn sync(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    /// Seconds per iteration of `iters` back-to-back collectives on every rank, after `warmup`.
    pub fn time(&self, b: &Backend, cfg: &PerfConfig, count: usize, in_place: bool) -> Result<f64> {
        if let (true, Backend::Oxccl(comms)) = (cfg.threads, b)
            && comms.len() > 1
        {
            return self.time_threads(b, comms, cfg, count, in_place);
        }
        self.time_launches(b, cfg.warmup, cfg.iters, || {
            b.launch_all(&self.bufs, &self.streams, &self.ranks, cfg, count, in_place)
        })
    }

    /// [`Bench::time`] with each local rank's calls issued by a thread of its own
    /// ([`PerfConfig::threads`]): the clock starts once every thread is ready to launch.
    fn time_threads(&self, b: &Backend, comms: &[Comm], cfg: &PerfConfig, count: usize, in_place: bool) -> Result<f64> {
        let (func, dtype, op) = (cfg.func, cfg.dtype, cfg.op);
        // `n` calls on every rank, each rank's from its own thread; the start instant once all
        // are ready. After a refused call no thread launches more (as `launch_all` stops).
        let run = |n: usize| -> Result<Instant> {
            let ready = std::sync::Barrier::new(comms.len() + 1);
            let stop = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|s| {
                let threads: Vec<_> = comms
                    .iter()
                    .enumerate()
                    .map(|(r, c)| {
                        let (send, recv) = call_addrs(func, &self.bufs[r], self.ranks[r], count, dtype, in_place);
                        let (stream, ready, stop) = (&self.streams[r], &ready, &stop);
                        s.spawn(move || -> Result<()> {
                            ready.wait();
                            for _ in 0..n {
                                if stop.load(std::sync::atomic::Ordering::Acquire) {
                                    break;
                                }
                                // SAFETY: as in `Backend::launch_all`: the buffers hold the
                                // sweep's largest message on rank r's device and stay alive
                                // until the synchronize that follows.
                                let r = unsafe { c.collective_raw(func, send, recv, count, dtype, op, ROOT, stream) };
                                if r.is_err() {
                                    stop.store(true, std::sync::atomic::Ordering::Release);
                                    return r;
                                }
                            }
                            Ok(())
                        })
                    })
                    .collect();
                ready.wait();
                let start = Instant::now();
                for t in threads {
                    t.join().map_err(|_| Error::Internal("a rank's launching thread panicked".into()))??;
                }
                Ok(start)
            })
        };
        run(cfg.warmup)?;
        self.sync()?;
        let t = run(cfg.iters.max(1))?;
        self.sync()?;
        self.per_iteration(b, t, cfg.iters)
    }

    /// Seconds per iteration of `iters` (at least 1) timed from `start` to now, the slowest
    /// rank's when other processes hold ranks (every rank's operation is only done when all are).
    fn per_iteration(&self, b: &Backend, start: Instant, iters: usize) -> Result<f64> {
        let ns = (start.elapsed().as_secs_f64() * 1e9) as u64;
        let ns = self.across_ranks(b, ns, RedOp::Max)?;
        Ok(ns as f64 * 1e-9 / iters.max(1) as f64)
    }

    /// Seconds per iteration of `iters` (at least 1) back-to-back calls of `launch` (which queues
    /// one operation on every local rank of `b`), after `warmup` untimed ones: host wall clock
    /// from the first timed launch to the synchronize after the last, the slowest rank's when
    /// other processes hold ranks.
    pub(super) fn time_launches(
        &self,
        b: &Backend,
        warmup: usize,
        iters: usize,
        mut launch: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        for _ in 0..warmup {
            launch()?;
        }
        self.sync()?;
        let t = Instant::now();
        for _ in 0..iters.max(1) {
            launch()?;
        }
        self.sync()?;
        self.per_iteration(b, t, iters)
    }

    /// Runs the collective once per check repetition with exact inputs and poisoned outputs and
    /// returns the wrong elements summed over ranks and repetitions (nccl-tests' `#wrong`).
    pub fn check(&self, b: &Backend, cfg: &PerfConfig, count: usize, in_place: bool) -> Result<u64> {
        let n = self.nranks;
        let esize = cfg.dtype.size();
        let block = count * esize;
        let mut wrong = 0u64;
        for rep in 0..cfg.check {
            let seed = rep as u64 * 7919 + count as u64;
            let data = check_data(cfg, n, count, seed)?;
            for (rb, &r) in self.bufs.iter().zip(&self.ranks) {
                let (input, exp) = &data[r];
                let out_len = exp.as_ref().map_or(block, Vec::len);
                let out_elems = out_len / esize.max(1);
                match (cfg.func, in_place) {
                    (_, false) => {
                        rb.send.write(0, input)?;
                        rb.recv
                            .write(0, &check::poison(cfg.dtype, out_elems.max(count)))?;
                    }
                    (Func::AllGather, true) => {
                        rb.recv.write(0, &check::poison(cfg.dtype, n * count))?;
                        rb.recv.write(r * block, input)?;
                    }
                    (Func::Broadcast, true) if r != ROOT => {
                        rb.recv.write(0, &check::poison(cfg.dtype, count))?
                    }
                    (_, true) => rb.recv.write(0, input)?,
                }
            }
            b.launch_all(&self.bufs, &self.streams, &self.ranks, cfg, count, in_place)?;
            self.sync()?;
            for (rb, &r) in self.bufs.iter().zip(&self.ranks) {
                let Some(exp) = &data[r].1 else { continue };
                let (_, recv) = call_addrs(cfg.func, rb, r, count, cfg.dtype, in_place);
                let mut got = vec![0u8; exp.len()];
                rb.recv.read((recv - rb.recv.addr()) as usize, &mut got)?;
                wrong += check::count_wrong(cfg.dtype, cfg.op, &got, exp, n) as u64;
            }
        }
        self.across_ranks(b, wrong, RedOp::Sum)
    }

    /// Times and checks one size on `b`, out-of-place then in-place.
    pub fn measure(&self, b: &Backend, cfg: &PerfConfig, bytes: u64) -> Result<(usize, Measure, Measure)> {
        let n = self.nranks;
        let count = table::count_for(cfg.func, bytes, cfg.dtype, n);
        let data = table::data_bytes(cfg.func, count, cfg.dtype, n);
        let mut out = Vec::with_capacity(2);
        for in_place in [false, true] {
            let t = self.time(b, cfg, count, in_place)?;
            let wrong = if cfg.check > 0 {
                Some(self.check(b, cfg, count, in_place)?)
            } else {
                None
            };
            out.push(Measure::new(cfg.func, n, data, t * 1e6, wrong));
        }
        Ok((count, out[0], out[1]))
    }
}

/// Runs the whole sweep on `main` (and `reference`, when given), printing each row through `emit`
/// as it completes; returns the rows.
pub fn sweep(
    bench: &Bench,
    main: &Backend,
    reference: Option<&Backend>,
    cfg: &PerfConfig,
    mut emit: impl FnMut(&Row),
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // Like nccl-tests' warmup pass: the first size's timing must not include module loads and
    // first-touch costs of either backend.
    if let Some(&first) = cfg.sizes.first() {
        let count = table::count_for(cfg.func, first, cfg.dtype, bench.nranks);
        for b in std::iter::once(main).chain(reference) {
            bench.time(b, cfg, count, false)?;
        }
    }
    for &bytes in &cfg.sizes {
        let (count, oop, ip) = bench.measure(main, cfg, bytes)?;
        let nccl = match reference {
            Some(r) => {
                let (_, roop, rip) = bench.measure(r, cfg, bytes)?;
                Some(NcclCols {
                    out_of_place: RefTiming {
                        time_us: roop.time_us,
                        busbw: roop.busbw,
                    },
                    in_place: Some(RefTiming {
                        time_us: rip.time_us,
                        busbw: rip.busbw,
                    }),
                })
            }
            None => None,
        };
        let row = Row {
            bytes: table::data_bytes(cfg.func, count, cfg.dtype, bench.nranks),
            count,
            dtype: cfg.dtype,
            redop: (!matches!(cfg.func, Func::Broadcast | Func::AllGather)).then_some(cfg.op),
            root: if matches!(cfg.func, Func::Broadcast | Func::Reduce) {
                ROOT as i32
            } else {
                -1
            },
            out_of_place: oop,
            in_place: Some(ip),
            nccl,
            // Asked of the communicator rather than read from its last call: with --procs the
            // last call is the small AllReduce that combines the ranks' timings.
            choice: match main {
                Backend::Oxccl(comms) => match comms.first() {
                    Some(c) => c.choice_for(cfg.func, count, cfg.dtype)?,
                    None => None,
                },
                Backend::Nccl(_) => None,
            },
        };
        emit(&row);
        rows.push(row);
    }
    Ok(rows)
}
