//! The point-to-point sweeps behind `oxccl perf send-recv|all-to-all|gather|scatter`, as
//! nccl-tests' `sendrecv_perf`, `alltoall_perf`, `gather_perf` and `scatter_perf` run them: for
//! each size, out-of-place then in-place (AlltoAll has no in-place form: its in-place columns are
//! `N/A`), timed like the collectives ([`super::run`]) and checked exactly on every rank with
//! poisoned outputs.
//!
//! | operation | each rank | S (bytes) | busbw factor |
//! |---|---|---|---|
//! | SendRecv | sends `count` elements to rank + 1, receives `count` from rank − 1, in one group | `count × size` | 1 |
//! | AlltoAll | sends block `p` of `nranks × count` elements to rank `p`, receives rank `p`'s into block `p` | `nranks × count × size` | (n−1)/n |
//! | Gather | sends `count` elements to the root, which stores rank `p`'s at block `p` | `nranks × count × size` | (n−1)/n |
//! | Scatter | receives block `rank` of the root's `nranks × count` elements | `nranks × count × size` | (n−1)/n |
//! | AlltoAllV | sends `c(rank, p)` elements to each rank `p`, packed, and receives `c(p, rank)` from each (`Comm::all_to_all_v`) | `Σ_p c(rank, p) × size`, the same on every rank | (n−1)/n |
//! | AllGatherV | sends its `c(rank, 0)` elements to every rank and receives rank `p`'s `c(p, 0)` at block `p`, packed (`Comm::all_gather_v`) | `Σ_p c(p, 0) × size` | (n−1)/n |
//! | ReduceScatterV | sums the ranks' inputs of `Σ_p c(p, 0)` elements; receives its block, `c(rank, 0)` elements (`Comm::reduce_scatter_v`, one rooted Reduce per rank) | `Σ_p c(p, 0) × size` | (n−1)/n |
//!
//! AlltoAllV (beyond NCCL and nccl-tests, which have no V-variant; NCCL users build it from a group
//! of `ncclSend`/`ncclRecv`, which is what `--compare nccl` runs) has uneven blocks: `c(r, p)` is
//! `count × 2k / (n + 1)` elements with `k = 1 + (r + p) mod n`, rounded down to 16 bytes, so each
//! rank sends blocks from half to nearly twice the average `count` and every rank the same total.
//! Its busbw factor is AlltoAll's `(n−1)/n`, nominal here: the block a rank keeps for itself
//! varies by rank.
//!
//! In-place buffers follow nccl-tests' offsets: SendRecv sends from and receives into one buffer
//! (the receive may overwrite data before it is sent, so in-place SendRecv is timed but not
//! checked: `#wrong` is `N/A`, as in nccl-tests); Gather sends from block `rank` of its receive
//! buffer; Scatter receives into block `rank` of its send buffer.
use super::check;
use super::run::{Backend, Bench, ROOT, RankBufs};
use super::table::{self, Measure, NcclCols, RefTiming, Row};
use crate::error::{Error, Result};
use crate::mem::{DeviceBuffer, Stream};
use crate::nccl::NcclComms;
use oxccl_gpu::abi::{DataType, Func, RedOp};

/// A point-to-point operation of `oxccl perf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum P2pFunc {
    /// Every rank sends to rank + 1 and receives from rank − 1 (nccl-tests' `sendrecv_perf`).
    SendRecv,
    /// `Comm::all_to_all` (`ncclAlltoAll`).
    AllToAll,
    /// `Comm::gather` (`ncclGather`) to rank [`ROOT`].
    Gather,
    /// `Comm::scatter` (`ncclScatter`) from rank [`ROOT`].
    Scatter,
    /// `Comm::all_to_all_v` with uneven blocks ([`v_count`]); NCCL: a group of sends and
    /// receives.
    AllToAllV,
    /// `Comm::all_gather_v` with uneven contributions ([`v_count`] to rank 0); NCCL: a group of
    /// sends and receives (each rank's block to every rank, itself included).
    AllGatherV,
    /// `Comm::reduce_scatter_v` (sum) with uneven blocks ([`v_count`] to rank 0); NCCL: a group
    /// of one `ncclReduce` per rank, as oxccl runs it.
    ReduceScatterV,
}

impl P2pFunc {
    /// Every operation, in the order `oxccl perf --help` lists them.
    pub const ALL: &'static [P2pFunc] =
        &[P2pFunc::SendRecv, P2pFunc::AllToAll, P2pFunc::Gather, P2pFunc::Scatter, P2pFunc::AllToAllV, P2pFunc::AllGatherV, P2pFunc::ReduceScatterV];

    /// The name nccl-tests' benchmark binary has (`sendrecv` of `sendrecv_perf`).
    pub const fn name(self) -> &'static str {
        match self {
            P2pFunc::SendRecv => "sendrecv",
            P2pFunc::AllToAll => "alltoall",
            P2pFunc::Gather => "gather",
            P2pFunc::Scatter => "scatter",
            P2pFunc::AllToAllV => "alltoallv",
            P2pFunc::AllGatherV => "allgatherv",
            P2pFunc::ReduceScatterV => "reducescatterv",
        }
    }

    /// nccl-tests' bus-bandwidth factor over `nranks` ranks: SendRecv 1, the others `(n−1)/n`.
    /// `0.0` when `nranks == 0`.
    pub fn bus_factor(self, nranks: usize) -> f64 {
        if nranks == 0 {
            return 0.0;
        }
        let n = nranks as f64;
        match self {
            P2pFunc::SendRecv => 1.0,
            P2pFunc::AllToAll
            | P2pFunc::Gather
            | P2pFunc::Scatter
            | P2pFunc::AllToAllV
            | P2pFunc::AllGatherV
            | P2pFunc::ReduceScatterV => (n - 1.0) / n,
        }
    }

    /// The per-rank element count the operation is called with for a sweep size of `bytes`
    /// (nccl-tests' `paramcount`): `bytes / dtype.size()` for SendRecv; for the others the count
    /// of one rank's block, `bytes / dtype.size() / nranks` rounded down to a multiple of 16
    /// bytes' worth of elements (`0` when `nranks == 0`).
    pub fn count_for(self, bytes: u64, dtype: DataType, nranks: usize) -> usize {
        let func = match self {
            P2pFunc::SendRecv => Func::Broadcast,
            P2pFunc::AllToAll
            | P2pFunc::Gather
            | P2pFunc::Scatter
            | P2pFunc::AllToAllV
            | P2pFunc::AllGatherV
            | P2pFunc::ReduceScatterV => Func::AllGather,
        };
        table::count_for(func, bytes, dtype, nranks)
    }

    /// The bytes `S` that algbw divides by time, also printed as the size: `count × size` for
    /// SendRecv, `nranks × count × size` (one rank's whole buffer, the root's for Gather and
    /// Scatter) for the others, with `count` as [`P2pFunc::count_for`] returns it.
    pub fn data_bytes(self, count: usize, dtype: DataType, nranks: usize) -> u64 {
        let block = count as u64 * dtype.size() as u64;
        match self {
            P2pFunc::SendRecv => block,
            P2pFunc::AllToAll | P2pFunc::Gather | P2pFunc::Scatter => block * nranks as u64,
            // AllGatherV's contributions c(p, 0) are AlltoAllV's row of rank 0, by symmetry.
            P2pFunc::AllToAllV | P2pFunc::AllGatherV | P2pFunc::ReduceScatterV => {
                (0..nranks).map(|p| v_count(count, dtype, nranks, 0, p) as u64).sum::<u64>() * dtype.size() as u64
            }
        }
    }

    /// False for AlltoAll, which has no in-place form (oxccl refuses overlapping buffers, as
    /// NCCL leaves them undefined).
    pub const fn has_in_place(self) -> bool {
        !matches!(self, P2pFunc::AllToAll | P2pFunc::AllToAllV | P2pFunc::AllGatherV | P2pFunc::ReduceScatterV)
    }

    /// The root rank, for Gather and Scatter.
    pub const fn root(self) -> Option<usize> {
        match self {
            P2pFunc::Gather | P2pFunc::Scatter => Some(ROOT),
            P2pFunc::SendRecv | P2pFunc::AllToAll | P2pFunc::AllToAllV | P2pFunc::AllGatherV | P2pFunc::ReduceScatterV => {
                None
            }
        }
    }
}

/// AlltoAllV's block from rank `from` to rank `to` (elements) for an average block of `count`
/// elements (module docs): `count × 2k / (n + 1)` with `k = 1 + (from + to) mod n`, rounded down
/// to 16 bytes' worth of elements.
pub fn v_count(count: usize, dtype: DataType, nranks: usize, from: usize, to: usize) -> usize {
    let n = nranks.max(1);
    let k = 1 + (from + to) % n;
    let c = (count as u128 * 2 * k as u128 / (n as u128 + 1)) as usize;
    let align = (16 / dtype.size()).max(1);
    c / align * align
}

/// AllGatherV's contributions (rank `p` gives [`v_count`]`(count, dtype, n, p, 0)` elements) and
/// their packed displacements in every rank's output.
fn gather_v_layout(count: usize, dtype: DataType, n: usize) -> (Vec<usize>, Vec<usize>) {
    let counts: Vec<usize> = (0..n).map(|p| v_count(count, dtype, n, p, 0)).collect();
    let displs = packed(&counts);
    (counts, displs)
}

/// The displacements of blocks of `counts` elements laid out one after another.
fn packed(counts: &[usize]) -> Vec<usize> {
    counts.iter().scan(0, |at, &x| Some(std::mem::replace(at, *at + x))).collect()
}

/// Rank `rank`'s AlltoAllV counts and packed displacements (elements): (send counts, send
/// displacements, receive counts, receive displacements).
fn v_layout(count: usize, dtype: DataType, n: usize, rank: usize) -> [Vec<usize>; 4] {
    let sc: Vec<usize> = (0..n).map(|p| v_count(count, dtype, n, rank, p)).collect();
    let rc: Vec<usize> = (0..n).map(|p| v_count(count, dtype, n, p, rank)).collect();
    let (sd, rd) = (packed(&sc), packed(&rc));
    [sc, sd, rc, rd]
}

impl std::fmt::Display for P2pFunc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to sweep.
#[derive(Clone, Debug)]
pub struct P2pConfig {
    pub func: P2pFunc,
    pub dtype: DataType,
    /// Message sizes in bytes (the sweep's `-b`/`-e` steps; each row prints its S).
    pub sizes: Vec<u64>,
    /// Untimed iterations per size and placement.
    pub warmup: usize,
    /// Timed iterations per size and placement.
    pub iters: usize,
    /// Verification runs per size and placement (0 = none; `#wrong` then prints N/A).
    pub check: usize,
}

/// Where rank `rank`'s buffers of one call sit: (send buffer, byte offset, receive buffer, byte
/// offset). Out of place each buffer from its start; in place both in the receive buffer, at
/// nccl-tests' offsets (Gather sends from block `rank`, Scatter receives into block `rank`,
/// SendRecv uses one buffer for both). `block` is one rank's block in bytes.
fn placed(
    func: P2pFunc,
    b: &RankBufs,
    rank: usize,
    block: usize,
    in_place: bool,
) -> (&DeviceBuffer, usize, &DeviceBuffer, usize) {
    if !in_place {
        return (&b.send, 0, &b.recv, 0);
    }
    match func {
        P2pFunc::Gather => (&b.recv, rank * block, &b.recv, 0),
        P2pFunc::Scatter => (&b.recv, 0, &b.recv, rank * block),
        P2pFunc::SendRecv
        | P2pFunc::AllToAll
        | P2pFunc::AllToAllV
        | P2pFunc::AllGatherV
        | P2pFunc::ReduceScatterV => (&b.recv, 0, &b.recv, 0),
    }
}

/// Queues one operation on every local rank of `backend`, all in one group (a thread drives
/// every local rank, so their sends and receives must be issued before any waits).
fn launch_all(bench: &Bench, backend: &Backend, cfg: &P2pConfig, count: usize, in_place: bool) -> Result<()> {
    let func = cfg.func;
    if in_place && !func.has_in_place() {
        return Err(Error::invalid(format!("{func} has no in-place form")));
    }
    let n = bench.nranks;
    let dtype = cfg.dtype;
    let block = count * dtype.size();
    let whole = n * block;
    let next = |r: usize| (r + 1) % n;
    let prev = |r: usize| (r + n - 1) % n;
    match backend {
        Backend::Oxccl(comms) => {
            if comms.len() != bench.bufs.len() {
                return Err(Error::Internal("no communicator for a local rank".into()));
            }
            let issue = || -> Result<()> {
                for (i, c) in comms.iter().enumerate() {
                    let (r, st) = (bench.ranks[i], &bench.streams[i]);
                    let (sb, so, rb, ro) = placed(func, &bench.bufs[i], r, block, in_place);
                    match func {
                        P2pFunc::SendRecv => {
                            c.send(sb.slice(so, block)?, count, dtype, next(r), st)?;
                            c.recv(rb.slice(ro, block)?, count, dtype, prev(r), st)?;
                        }
                        P2pFunc::AllToAll => {
                            c.all_to_all(sb.slice(so, whole)?, rb.slice(ro, whole)?, count, dtype, st)?
                        }
                        P2pFunc::Gather => {
                            let recv = (r == ROOT).then(|| rb.slice(ro, whole)).transpose()?;
                            c.gather(sb.slice(so, block)?, recv, count, dtype, ROOT, st)?;
                        }
                        P2pFunc::Scatter => {
                            let send = (r == ROOT).then(|| sb.slice(so, whole)).transpose()?;
                            c.scatter(send, rb.slice(ro, block)?, count, dtype, ROOT, st)?;
                        }
                        P2pFunc::AllToAllV => {
                            let [sc, sd, rc, rd] = v_layout(count, dtype, n, r);
                            let total = sc.iter().sum::<usize>() * dtype.size();
                            let (send, recv) = (sb.slice(so, total)?, rb.slice(ro, total)?);
                            c.all_to_all_v(send, &sc, &sd, recv, &rc, &rd, dtype, st)?
                        }
                        P2pFunc::AllGatherV => {
                            let (counts, displs) = gather_v_layout(count, dtype, n);
                            let total = counts.iter().sum::<usize>() * dtype.size();
                            let send = sb.slice(so, counts[r] * dtype.size())?;
                            c.all_gather_v(send, rb.slice(ro, total)?, &counts, &displs, dtype, st)?
                        }
                        P2pFunc::ReduceScatterV => {
                            let (counts, displs) = gather_v_layout(count, dtype, n);
                            let total = counts.iter().sum::<usize>() * dtype.size();
                            let recv = rb.slice(ro, counts[r] * dtype.size())?;
                            c.reduce_scatter_v(sb.slice(so, total)?, recv, &counts, &displs, dtype, RedOp::Sum, st)?
                        }
                    }
                }
                Ok(())
            };
            crate::group(issue)?
        }
        Backend::Nccl(nc) => {
            NcclComms::group_start()?;
            let mut res = Ok(());
            for (i, &r) in bench.ranks.iter().enumerate() {
                let Stream::Cuda(st) = &bench.streams[i] else {
                    res = Err(Error::invalid("NCCL needs CUDA streams"));
                    break;
                };
                let (sb, so, rb, ro) = placed(func, &bench.bufs[i], r, block, in_place);
                let (send, recv) = (sb.addr() + so as u64, rb.addr() + ro as u64);
                // SAFETY: each buffer holds the sweep's largest size, at least this size's S
                // bytes, which cover everything the operation touches from these offsets
                // (`count` elements for SendRecv, `nranks × count` for the others; the in-place
                // offsets are blocks inside S); buffers and streams live until the synchronize
                // that follows.
                res = unsafe {
                    match func {
                        P2pFunc::SendRecv => nc
                            .send(i, send, count, dtype, next(r), st)
                            .and_then(|_| nc.recv(i, recv, count, dtype, prev(r), st)),
                        P2pFunc::AllToAll => nc.all_to_all(i, send, recv, count, dtype, st),
                        P2pFunc::Gather => nc.gather(i, send, recv, count, dtype, ROOT, st),
                        P2pFunc::Scatter => nc.scatter(i, send, recv, count, dtype, ROOT, st),
                        P2pFunc::AllToAllV => {
                            let [sc, sd, rc, rd] = v_layout(count, dtype, n, r);
                            let at = |base: u64, d: usize| base + (d * dtype.size()) as u64;
                            (0..n).try_for_each(|p| {
                                nc.send(i, at(send, sd[p]), sc[p], dtype, p, st)?;
                                nc.recv(i, at(recv, rd[p]), rc[p], dtype, p, st)
                            })
                        }
                        P2pFunc::AllGatherV => {
                            let (counts, displs) = gather_v_layout(count, dtype, n);
                            let at = |d: usize| recv + (d * dtype.size()) as u64;
                            (0..n).try_for_each(|p| {
                                nc.send(i, send, counts[r], dtype, p, st)?;
                                nc.recv(i, at(displs[p]), counts[p], dtype, p, st)
                            })
                        }
                        P2pFunc::ReduceScatterV => {
                            let (counts, displs) = gather_v_layout(count, dtype, n);
                            (0..n).try_for_each(|p| {
                                let from = send + (displs[p] * dtype.size()) as u64;
                                let to = if p == r { recv } else { 0 };
                                nc.collective(i, Func::Reduce, from, to, counts[p], dtype, RedOp::Sum, p, st)
                            })
                        }
                    }
                };
                if res.is_err() {
                    break;
                }
            }
            NcclComms::group_end()?;
            res
        }
    }
}

/// One rank's input bytes and expected output bytes (`None` where its output is not defined:
/// Gather on non-roots).
type RankData = (Vec<u8>, Option<Vec<u8>>);

/// Inputs and expected outputs of one check of `func` for every rank, `count` elements per
/// block. Values come from [`check`]'s generator (its Sum inputs: any distinct values would do),
/// different for every rank, block and `seed`, so a block from the wrong rank or at the wrong
/// place is counted. The root of Scatter holds the only input; the other ranks' are empty.
pub fn check_data(
    func: P2pFunc,
    dtype: DataType,
    nranks: usize,
    count: usize,
    seed: u64,
) -> Result<Vec<RankData>> {
    let input_of = |r: usize, elems: usize| {
        check::fill_input(Func::AllReduce, dtype, RedOp::Sum, r, nranks, seed, elems)
            .ok_or_else(|| Error::Internal("no data generator".into()))
    };
    let block = count * dtype.size();
    let blk = |v: &[u8], p: usize| v[p * block..(p + 1) * block].to_vec();
    Ok(match func {
        P2pFunc::SendRecv => {
            let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| input_of(r, count)).collect::<Result<_>>()?;
            (0..nranks)
                .map(|r| (inputs[r].clone(), Some(inputs[(r + nranks - 1) % nranks].clone())))
                .collect()
        }
        P2pFunc::AllToAll => {
            let inputs: Vec<Vec<u8>> =
                (0..nranks).map(|r| input_of(r, nranks * count)).collect::<Result<_>>()?;
            (0..nranks)
                .map(|r| {
                    let exp: Vec<u8> = inputs.iter().flat_map(|i| blk(i, r)).collect();
                    (inputs[r].clone(), Some(exp))
                })
                .collect()
        }
        P2pFunc::Gather => {
            let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| input_of(r, count)).collect::<Result<_>>()?;
            let all = inputs.concat();
            inputs
                .into_iter()
                .enumerate()
                .map(|(r, i)| (i, (r == ROOT).then(|| all.clone())))
                .collect()
        }
        P2pFunc::Scatter => {
            let data = input_of(ROOT, nranks * count)?;
            (0..nranks)
                .map(|r| (if r == ROOT { data.clone() } else { Vec::new() }, Some(blk(&data, r))))
                .collect()
        }
        P2pFunc::ReduceScatterV => {
            let (counts, displs) = gather_v_layout(count, dtype, nranks);
            let total: usize = counts.iter().sum();
            let sum = check::expected(Func::AllReduce, dtype, RedOp::Sum, nranks, seed, total)
                .ok_or_else(|| Error::Internal("no expected values".into()))?;
            let es = dtype.size();
            (0..nranks)
                .map(|r| {
                    let exp = sum[displs[r] * es..(displs[r] + counts[r]) * es].to_vec();
                    Ok((input_of(r, total)?, Some(exp)))
                })
                .collect::<Result<_>>()?
        }
        P2pFunc::AllGatherV => {
            let (counts, _) = gather_v_layout(count, dtype, nranks);
            let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| input_of(r, counts[r])).collect::<Result<_>>()?;
            let all = inputs.concat();
            inputs.into_iter().map(|i| (i, Some(all.clone()))).collect()
        }
        P2pFunc::AllToAllV => {
            let es = dtype.size();
            let layouts: Vec<[Vec<usize>; 4]> = (0..nranks).map(|r| v_layout(count, dtype, nranks, r)).collect();
            let inputs: Vec<Vec<u8>> = layouts
                .iter()
                .enumerate()
                .map(|(r, l)| input_of(r, l[0].iter().sum()))
                .collect::<Result<_>>()?;
            (0..nranks)
                .map(|r| {
                    // From each rank p, its block for r: at p's send displacement for r.
                    let exp: Vec<u8> = (0..nranks)
                        .flat_map(|p| {
                            let (at, len) = (layouts[p][1][r] * es, layouts[p][0][r] * es);
                            inputs[p][at..at + len].to_vec()
                        })
                        .collect();
                    (inputs[r].clone(), Some(exp))
                })
                .collect()
        }
    })
}

/// Runs `cfg.func` once per check repetition with exact inputs and poisoned outputs and returns
/// the wrong elements summed over ranks and repetitions (nccl-tests' `#wrong`); `None` for
/// in-place SendRecv, whose result is not defined.
fn check_runs(
    bench: &Bench,
    backend: &Backend,
    cfg: &P2pConfig,
    count: usize,
    in_place: bool,
) -> Result<Option<u64>> {
    if in_place && cfg.func == P2pFunc::SendRecv {
        return Ok(None);
    }
    let (n, dtype) = (bench.nranks, cfg.dtype);
    let block = count * dtype.size();
    let mut wrong = 0u64;
    for rep in 0..cfg.check {
        // In-place data differs from out-of-place data, so an in-place call that read the
        // other buffer (still holding the out-of-place check's inputs) is counted.
        let seed = rep as u64 * 7919 + 2 * count as u64 + in_place as u64;
        let data = check_data(cfg.func, dtype, n, count, seed)?;
        for (b, &r) in bench.bufs.iter().zip(&bench.ranks) {
            let (input, _) = &data[r];
            let (sb, so, rb, _) = placed(cfg.func, b, r, block, in_place);
            // Poison the receive buffer as far as the operation uses it (S bytes: one block for
            // SendRecv, nranks blocks for the others), then place the input, which in place
            // lies inside it.
            let used = cfg.func.data_bytes(count, dtype, n) as usize / dtype.size();
            rb.write(0, &check::poison(dtype, used))?;
            sb.write(so, input)?;
        }
        launch_all(bench, backend, cfg, count, in_place)?;
        bench.sync()?;
        for (b, &r) in bench.bufs.iter().zip(&bench.ranks) {
            let Some(exp) = &data[r].1 else { continue };
            let (_, _, rb, ro) = placed(cfg.func, b, r, block, in_place);
            let mut got = vec![0u8; exp.len()];
            rb.read(ro, &mut got)?;
            wrong += check::count_wrong(dtype, RedOp::Sum, &got, exp, n) as u64;
        }
    }
    Ok(Some(bench.across_ranks(backend, wrong, RedOp::Sum)?))
}

/// Times and checks one sweep size (`bytes`) on `backend`: (count, out-of-place, in-place or
/// `None` where the operation has none).
pub fn measure(
    bench: &Bench,
    backend: &Backend,
    cfg: &P2pConfig,
    bytes: u64,
) -> Result<(usize, Measure, Option<Measure>)> {
    let n = bench.nranks;
    let count = cfg.func.count_for(bytes, cfg.dtype, n);
    let data = cfg.func.data_bytes(count, cfg.dtype, n);
    let factor = cfg.func.bus_factor(n);
    let one = |in_place: bool| -> Result<Measure> {
        let t = bench.time_launches(backend, cfg.warmup, cfg.iters, || {
            launch_all(bench, backend, cfg, count, in_place)
        })?;
        let wrong = if cfg.check > 0 {
            check_runs(bench, backend, cfg, count, in_place)?
        } else {
            None
        };
        Ok(Measure::with_factor(factor, data, t * 1e6, wrong))
    };
    let oop = one(false)?;
    let ip = if cfg.func.has_in_place() { Some(one(true)?) } else { None };
    Ok((count, oop, ip))
}

/// Runs the whole sweep on `main` (and `reference`, when given), printing each row through `emit`
/// as it completes; returns the rows (redop `sum` for ReduceScatterV, else `none`; root [`ROOT`]
/// for Gather and Scatter, else -1).
pub fn sweep(
    bench: &Bench,
    main: &Backend,
    reference: Option<&Backend>,
    cfg: &P2pConfig,
    mut emit: impl FnMut(&Row),
) -> Result<Vec<Row>> {
    let n = bench.nranks;
    // As nccl-tests' warmup pass: the first size's timing must not include first-touch costs.
    if let Some(&first) = cfg.sizes.first() {
        let count = cfg.func.count_for(first, cfg.dtype, n);
        for b in std::iter::once(main).chain(reference) {
            bench.time_launches(b, cfg.warmup, cfg.iters, || launch_all(bench, b, cfg, count, false))?;
        }
    }
    let mut rows = Vec::new();
    for &bytes in &cfg.sizes {
        let (count, oop, ip) = measure(bench, main, cfg, bytes)?;
        let nccl = match reference {
            Some(r) => {
                let (_, roop, rip) = measure(bench, r, cfg, bytes)?;
                let timing = |m: Measure| RefTiming {
                    time_us: m.time_us,
                    busbw: m.busbw,
                };
                Some(NcclCols {
                    out_of_place: timing(roop),
                    in_place: rip.map(timing),
                })
            }
            None => None,
        };
        let row = Row {
            bytes: cfg.func.data_bytes(count, cfg.dtype, n),
            count,
            dtype: cfg.dtype,
            redop: (cfg.func == P2pFunc::ReduceScatterV).then_some(RedOp::Sum),
            root: cfg.func.root().map_or(-1, |r| r as i32),
            out_of_place: oop,
            in_place: ip,
            nccl,
            choice: None,
        };
        emit(&row);
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_counts_and_sizes_follow_nccl_tests() {
        for n in [2usize, 3, 4, 8] {
            assert_eq!(P2pFunc::SendRecv.bus_factor(n), 1.0);
            for f in [P2pFunc::AllToAll, P2pFunc::Gather, P2pFunc::Scatter] {
                assert_eq!(f.bus_factor(n), (n as f64 - 1.0) / n as f64, "{f} n={n}");
            }
        }
        assert_eq!(P2pFunc::Gather.bus_factor(0), 0.0);
        // SendRecv: the whole size per rank; S = count × size.
        assert_eq!(P2pFunc::SendRecv.count_for(1 << 20, DataType::F32, 3), 1 << 18);
        assert_eq!(P2pFunc::SendRecv.data_bytes(1 << 18, DataType::F32, 3), 1 << 20);
        // The others: a block per rank, 16-byte aligned; S = nranks × count × size.
        for f in [P2pFunc::AllToAll, P2pFunc::Gather, P2pFunc::Scatter] {
            assert_eq!(f.count_for(1 << 20, DataType::F32, 3), 87380, "{f}");
            assert_eq!(f.data_bytes(87380, DataType::F32, 3), 87380 * 4 * 3, "{f}");
            assert_eq!(f.count_for(64, DataType::F32, 8), 0, "{f}");
        }
        assert!(!P2pFunc::AllToAll.has_in_place());
        assert!(P2pFunc::ALL.iter().filter(|f| f.has_in_place()).count() == 3);
        assert_eq!(P2pFunc::Gather.root(), Some(ROOT));
        assert_eq!(P2pFunc::SendRecv.root(), None);
        let names: Vec<String> = P2pFunc::ALL.iter().map(|f| f.to_string()).collect();
        assert_eq!(names, ["sendrecv", "alltoall", "gather", "scatter", "alltoallv", "allgatherv", "reducescatterv"]);
        // AllGatherV: rank p contributes c(p, 0); the output holds them all, packed.
        let (counts, displs) = gather_v_layout(1000, DataType::F32, 3);
        assert_eq!((counts, displs), (vec![500, 1000, 1500], vec![0, 500, 1500]));
        assert_eq!(P2pFunc::AllGatherV.data_bytes(1000, DataType::F32, 3), 3000 * 4);
        assert_eq!(P2pFunc::ReduceScatterV.data_bytes(1000, DataType::F32, 3), 3000 * 4);
        // AlltoAllV on 3 ranks: blocks of count × 2k/4, k = 1 + (from + to) mod 3, 16-byte
        // aligned; every rank sends the same total, S.
        let c: Vec<usize> = (0..3).map(|p| v_count(1000, DataType::F32, 3, 0, p)).collect();
        assert_eq!(c, [500, 1000, 1500]);
        assert_eq!(v_count(1000, DataType::F32, 3, 2, 2), 1000);
        assert_eq!(v_count(10, DataType::F32, 3, 0, 0), 4);
        assert_eq!(P2pFunc::AllToAllV.data_bytes(1000, DataType::F32, 3), 3000 * 4);
        for r in 0..3 {
            let [sc, sd, rc, rd] = v_layout(1000, DataType::F32, 3, r);
            assert_eq!(sc.iter().sum::<usize>(), 3000);
            assert_eq!(rc.iter().sum::<usize>(), 3000);
            assert_eq!((sd[1], rd[2]), (sc[0], rc[0] + rc[1]));
        }
        assert!(!P2pFunc::AllToAllV.has_in_place());
    }

    /// The expected outputs are the right blocks of the right ranks' inputs.
    #[test]
    fn check_data_moves_blocks_as_the_operations_do() {
        let (n, count, dt) = (3, 5, DataType::I32);
        let b = count * dt.size();
        let sr = check_data(P2pFunc::SendRecv, dt, n, count, 1).unwrap();
        for r in 0..n {
            assert_eq!(sr[r].1.as_ref().unwrap(), &sr[(r + n - 1) % n].0);
            assert_eq!(sr[r].0.len(), b);
        }
        assert_ne!(sr[0].0, sr[1].0);
        let a2a = check_data(P2pFunc::AllToAll, dt, n, count, 1).unwrap();
        for r in 0..n {
            let exp = a2a[r].1.as_ref().unwrap();
            for p in 0..n {
                assert_eq!(exp[p * b..(p + 1) * b], a2a[p].0[r * b..(r + 1) * b], "rank {r} block {p}");
            }
        }
        let g = check_data(P2pFunc::Gather, dt, n, count, 1).unwrap();
        let all: Vec<u8> = g.iter().flat_map(|d| d.0.clone()).collect();
        assert_eq!(g[ROOT].1.as_ref().unwrap(), &all);
        assert!(g.iter().enumerate().all(|(r, d)| (r == ROOT) == d.1.is_some()));
        let s = check_data(P2pFunc::Scatter, dt, n, count, 1).unwrap();
        for r in 0..n {
            assert_eq!(s[r].1.as_ref().unwrap()[..], s[ROOT].0[r * b..(r + 1) * b]);
            assert_eq!(s[r].0.is_empty(), r != ROOT);
        }
        let v = check_data(P2pFunc::AllToAllV, dt, n, 12, 1).unwrap();
        for r in 0..n {
            let [sc, _, rc, rd] = v_layout(12, dt, n, r);
            let exp = v[r].1.as_ref().unwrap();
            assert_eq!(v[r].0.len(), sc.iter().sum::<usize>() * 4);
            for p in 0..n {
                let [psc, psd, _, _] = v_layout(12, dt, n, p);
                let from_p = &v[p].0[psd[r] * 4..(psd[r] + psc[r]) * 4];
                assert_eq!(&exp[rd[p] * 4..(rd[p] + rc[p]) * 4], from_p, "rank {r} block {p}");
            }
        }
        // A different seed gives different data.
        assert_ne!(check_data(P2pFunc::Gather, dt, n, count, 2).unwrap()[0].0, g[0].0);
    }
}
