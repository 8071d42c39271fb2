//! The benchmark sweep behind `oxccl perf`, as nccl-tests runs it: for each size, out-of-place then
//! in-place, `warmup` untimed iterations, `iters` timed ones (host wall clock around the queued
//! iterations of every rank, then a synchronize), then `check` verification runs with exact inputs
//! and poisoned outputs, counting wrong elements on every rank. With a reference backend (NCCL) the
//! same size is timed on it right after oxccl, on the same buffers.
use super::check;
use super::table::{self, Measure, NcclCols, RefTiming, Row};
use crate::error::{Error, Result};
use crate::mem::{Device, DeviceBuffer, Stream};
use crate::nccl::NcclComms;
use crate::Comm;
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
}

/// A set of ranks that can run the collective: oxccl communicators, or NCCL's.
pub enum Backend {
    Oxccl(Vec<Comm>),
    Nccl(NcclComms),
}

impl Backend {
    fn launch_all(
        &self,
        bufs: &[RankBufs],
        streams: &[Stream],
        count: usize,
        dtype: DataType,
        op: RedOp,
        in_place: bool,
    ) -> Result<()> {
        match self {
            Backend::Oxccl(comms) => {
                for (r, c) in comms.iter().enumerate() {
                    let recv = &bufs[r].recv;
                    let send = if in_place { recv } else { &bufs[r].send };
                    let bytes = count * dtype.size();
                    c.all_reduce(send.slice(0, bytes)?, recv.slice(0, bytes)?, count, dtype, op, &streams[r])?;
                }
                Ok(())
            }
            Backend::Nccl(n) => {
                NcclComms::group_start()?;
                let mut res = Ok(());
                for r in 0..n.nranks() {
                    let recv = bufs[r].recv.addr();
                    let send = if in_place { recv } else { bufs[r].send.addr() };
                    let Stream::Cuda(s) = &streams[r] else {
                        res = Err(Error::invalid("NCCL needs CUDA streams"));
                        break;
                    };
                    // SAFETY: the buffers hold at least `count` elements on rank r's GPU (sized by
                    // the sweep's largest message) and outlive the synchronize that follows.
                    res = unsafe { n.all_reduce(r, send, recv, count, dtype, op, s) };
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

/// Per-rank send and receive buffers, sized for the largest message of the sweep.
pub struct RankBufs {
    pub send: DeviceBuffer,
    pub recv: DeviceBuffer,
}

/// Devices, streams and buffers shared by every backend of one sweep.
pub struct Bench {
    pub devices: Vec<Device>,
    pub streams: Vec<Stream>,
    pub bufs: Vec<RankBufs>,
}

impl Bench {
    /// Allocates buffers of `max_bytes` per rank (plus streams) on `devices`.
    pub fn new(devices: &[Device], max_bytes: u64) -> Result<Bench> {
        let mut streams = Vec::new();
        let mut bufs = Vec::new();
        for d in devices {
            streams.push(d.new_stream()?);
            bufs.push(RankBufs { send: d.alloc(max_bytes as usize)?, recv: d.alloc(max_bytes as usize)? });
        }
        Ok(Bench { devices: devices.to_vec(), streams, bufs })
    }

    fn sync(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    /// Seconds per iteration of `iters` back-to-back collectives on every rank, after `warmup`.
    pub fn time(&self, b: &Backend, cfg: &PerfConfig, count: usize, in_place: bool) -> Result<f64> {
        for _ in 0..cfg.warmup {
            b.launch_all(&self.bufs, &self.streams, count, cfg.dtype, cfg.op, in_place)?;
        }
        self.sync()?;
        let t = Instant::now();
        for _ in 0..cfg.iters.max(1) {
            b.launch_all(&self.bufs, &self.streams, count, cfg.dtype, cfg.op, in_place)?;
        }
        self.sync()?;
        Ok(t.elapsed().as_secs_f64() / cfg.iters.max(1) as f64)
    }

    /// Runs the collective once per check repetition with exact inputs and a poisoned output and
    /// returns the wrong elements summed over ranks and repetitions.
    pub fn check(&self, b: &Backend, cfg: &PerfConfig, count: usize, in_place: bool) -> Result<u64> {
        let n = self.devices.len();
        let bytes = count * cfg.dtype.size();
        let mut wrong = 0u64;
        for rep in 0..cfg.check {
            let seed = rep as u64 * 7919 + count as u64;
            for (r, rb) in self.bufs.iter().enumerate() {
                let input = check::fill_input(cfg.func, cfg.dtype, cfg.op, r, n, seed, count)
                    .ok_or_else(|| Error::invalid(format!("no data generator for {}", cfg.func)))?;
                if in_place {
                    rb.recv.write(0, &input)?;
                } else {
                    rb.send.write(0, &input)?;
                    rb.recv.write(0, &check::poison(cfg.dtype, count))?;
                }
            }
            b.launch_all(&self.bufs, &self.streams, count, cfg.dtype, cfg.op, in_place)?;
            self.sync()?;
            let exp = check::expected(cfg.func, cfg.dtype, cfg.op, n, seed, count)
                .ok_or_else(|| Error::invalid(format!("no reference for {}", cfg.func)))?;
            for rb in &self.bufs {
                let mut got = vec![0u8; bytes];
                rb.recv.read(0, &mut got)?;
                wrong += check::count_wrong(cfg.dtype, cfg.op, &got, &exp, n) as u64;
            }
        }
        Ok(wrong)
    }

    /// Times and checks one size on `b`, out-of-place then in-place.
    pub fn measure(&self, b: &Backend, cfg: &PerfConfig, bytes: u64) -> Result<(usize, Measure, Measure)> {
        let n = self.devices.len();
        let count = table::count_for(cfg.func, bytes, cfg.dtype, n);
        let data = table::data_bytes(cfg.func, count, cfg.dtype, n);
        let mut out = Vec::with_capacity(2);
        for in_place in [false, true] {
            let t = self.time(b, cfg, count, in_place)?;
            let wrong = if cfg.check > 0 { Some(self.check(b, cfg, count, in_place)?) } else { None };
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
    for &bytes in &cfg.sizes {
        let (count, oop, ip) = bench.measure(main, cfg, bytes)?;
        let nccl = match reference {
            Some(r) => {
                let (_, roop, rip) = bench.measure(r, cfg, bytes)?;
                Some(NcclCols {
                    out_of_place: RefTiming { time_us: roop.time_us, busbw: roop.busbw },
                    in_place: RefTiming { time_us: rip.time_us, busbw: rip.busbw },
                })
            }
            None => None,
        };
        let row = Row {
            bytes,
            count,
            dtype: cfg.dtype,
            redop: Some(cfg.op),
            root: -1,
            out_of_place: oop,
            in_place: ip,
            nccl,
        };
        emit(&row);
        rows.push(row);
    }
    Ok(rows)
}
