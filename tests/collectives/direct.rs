//! Direct writes (NCCL's "P2P/direct pointer"): on the Simple protocol, the ranks of one
//! `Comm::init_all` write each hop of a Broadcast, AllGather or AllReduce's gather phase straight
//! into the next rank's output, whose address the receiver publishes per kernel in a
//! pointer-exchange slot of the sender's head counter line. CPU target (ranks are host threads of
//! this process):
//! 1. forced Simple Broadcast (every root), AllGather and AllReduce on 2..5 ranks, in place and
//!    out of place, counts 1, 3, 4097 and 2^20+5, every rank's buffers at a different odd element
//!    offset (so the peer output a sender writes is misaligned against its 16-byte packs, and
//!    differently from its own buffers), guard bytes around every buffer;
//! 2. protocol mixing on one communicator: 400 calls of all five collectives queued in batches
//!    (ranks drift apart inside a batch), the protocol changing from call to call (LL, LL128,
//!    Simple on 1 and 2 channels, checked against `Comm::last_choice`), the FIFO-path
//!    Reduce/ReduceScatter interleaved with the direct ones; again with the smallest Simple FIFO
//!    (`NCCL_BUFFSIZE=8192`, many steps per call, 3 and 5 ranks), with steps starting just below
//!    the LL flag wrap, with tree AllReduces (`OXCCL_TEST_NODES=2`) between ring direct calls, and
//!    with two communicators interleaved on the same streams;
//! 3. per-channel rings that differ (the NVLink-mesh topology hook): 8 channels all in use, then
//!    the model's own 1..8 channels mixed;
//! 4. C28/C29-style abort while a sender spins on the pointer exchange of a receiver that never
//!    calls (from the root, from the absent rank), and looping collectives aborted at random
//!    times; no peer writes a rank's output after that rank's `abort()` returned (the FIFO path
//!    as the control);
//! 5. `NCCL_P2P_DIRECT_DISABLE` / `OXCCL_P2P_DIRECT_DISABLE` values;
//! 6. one rank and `Comm::init_rank`: no direct pointer, results exact.
//!
//! Every result is compared bit for bit with the expected bytes (`oxccl::perf::check` inputs and
//! reference reductions, the root's / every rank's input for the copies), and every byte of
//! every buffer outside the call's result must keep what was written before the call.
use crate::common;
use common::{streams, sync_all};

use common::env::Env;
use oxccl::perf::check;
use oxccl::{Algo, Comm, DataType, Device, DeviceBuffer, Error, Func, Proto, RedOp, Stream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Guard bytes before (beyond the element offset) and after every buffer's data.
const GUARD: usize = 64;

/// Every variable a test here may set: cleared (both spellings) around each init.
const VARS: &[&str] = &[
    "PROTO",
    "ALGO",
    "P2P_DIRECT_DISABLE",
    "TOPO_FILE",
    "MAX_NCHANNELS",
    "MIN_NCHANNELS",
    "TEST_NODES",
    "TEST_TREE_PATTERN",
    "BUFFSIZE",
    "LL_BUFFSIZE",
    "LL128_BUFFSIZE",
    "NTHREADS",
    "TEST_INITIAL_STEP",
    "CHECK_CALLS",
];

/// `Comm::init_all` over `n` CPU ranks with exactly `vars` set (every other variable of [`VARS`]
/// unset), the environment restored afterwards.
fn init(n: usize, vars: &[(&str, &str)]) -> oxccl::Result<Vec<Comm>> {
    let env = Env::clean(VARS);
    env.set(vars);
    common::init_all(&Device::cpus(n))
}

fn init_ok(n: usize, vars: &[(&str, &str)]) -> Vec<Comm> {
    init(n, vars).unwrap_or_else(|e| panic!("init_all({n}) with {vars:?}: {e}"))
}

/// splitmix64 bytes: a position- and seed-dependent pattern (integer copies).
fn hash_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    while out.len() < len {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_ne_bytes());
    }
    out.truncate(len);
    out
}

fn is_float(d: DataType) -> bool {
    matches!(d, DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64)
}

/// One collective call on every rank.
#[derive(Clone, Debug)]
struct Call {
    func: Func,
    dtype: DataType,
    op: RedOp,
    count: usize,
    root: usize,
    in_place: bool,
    seed: u64,
    /// Element offset of rank `r`'s buffers' data from the guard (`offs[r]` elements).
    offs: Vec<usize>,
}

impl Call {
    fn new(func: Func, dtype: DataType, count: usize, offs: Vec<usize>) -> Call {
        Call {
            func,
            dtype,
            op: RedOp::Sum,
            count,
            root: 0,
            in_place: false,
            seed: 1,
            offs,
        }
    }
    fn op(mut self, op: RedOp) -> Call {
        self.op = op;
        self
    }
    fn root(mut self, root: usize) -> Call {
        self.root = root;
        self
    }
    fn in_place(mut self, in_place: bool) -> Call {
        self.in_place = in_place;
        self
    }
    fn seed(mut self, seed: u64) -> Call {
        self.seed = seed;
        self
    }
    fn what(&self, n: usize) -> String {
        let root = if matches!(self.func, Func::Broadcast | Func::Reduce) {
            format!(" root={}", self.root)
        } else {
            String::new()
        };
        let op = if matches!(self.func, Func::Broadcast | Func::AllGather) {
            String::new()
        } else {
            format!(" op={}", self.op.name())
        };
        format!(
            "{} {}{op} count={}{root} nranks={n} {} offs={:?}",
            self.func,
            self.dtype,
            self.count,
            if self.in_place { "in-place" } else { "out-of-place" },
            self.offs
        )
    }
}

/// One buffer of one rank: what it must hold after the call (guards included).
struct Buf {
    mem: DeviceBuffer,
    want: Vec<u8>,
    /// Byte offset of the data (after the guard and the element offset) and its length.
    data_at: usize,
    data_len: usize,
    name: &'static str,
}

/// (buffer index, byte offset, byte length) of a call argument.
type Arg = Option<(usize, usize, usize)>;

struct RankPlan {
    bufs: Vec<Buf>,
    send: Arg,
    recv: Arg,
}

/// A call's buffers on every rank, written, with the expected contents.
struct Prepared {
    call: Call,
    what: String,
    ranks: Vec<RankPlan>,
}

/// Rank `r`'s input of `elems` elements for `c`.
fn input(c: &Call, r: usize, n: usize, elems: usize) -> Vec<u8> {
    let reducing = matches!(c.func, Func::AllReduce | Func::Reduce | Func::ReduceScatter);
    if reducing || is_float(c.dtype) {
        let op = if reducing { c.op } else { RedOp::Sum };
        check::fill_input(Func::AllReduce, c.dtype, op, r, n, c.seed, elems).unwrap()
    } else {
        hash_bytes(
            c.seed.wrapping_mul(1000).wrapping_add(r as u64),
            elems * c.dtype.size(),
        )
    }
}

fn prepare(comms: &[Comm], c: &Call) -> Prepared {
    let n = comms.len();
    assert_eq!(c.offs.len(), n);
    let es = c.dtype.size();
    let b = c.count * es;
    let in_elems = if c.func == Func::ReduceScatter {
        n * c.count
    } else {
        c.count
    };
    let inputs: Vec<Vec<u8>> = (0..n).map(|r| input(c, r, n, in_elems)).collect();
    let reduced = if matches!(c.func, Func::AllReduce | Func::Reduce | Func::ReduceScatter) {
        let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
        check::reduce_reference(c.dtype, c.op, &refs).unwrap()
    } else {
        Vec::new()
    };
    let gathered: Vec<u8> = if c.func == Func::AllGather {
        inputs.iter().flatten().copied().collect()
    } else {
        Vec::new()
    };
    let mut ranks = Vec::new();
    for r in 0..n {
        let at = GUARD + c.offs[r] * es;
        let dev = comms[r].device();
        let mut bufs: Vec<Buf> = Vec::new();
        // A buffer of `len` data bytes: sentinel everywhere, `init` in the data part; after the
        // call the data part must hold `want` (the sentinel elsewhere).
        let mut new_buf = |name: &'static str, init: Option<&[u8]>, want: Option<&[u8]>, len: usize| {
            let salt = (r * 8 + bufs.len() * 3 + 1) as u8;
            let total = at + len + GUARD;
            let mut full = common::sentinel(total, salt);
            if let Some(init) = init {
                full[at..at + len].copy_from_slice(init);
            }
            let mem = dev.alloc(total).unwrap();
            mem.write(0, &full).unwrap();
            if let Some(want) = want {
                full[at..at + len].copy_from_slice(want);
            }
            bufs.push(Buf {
                mem,
                want: full,
                data_at: at,
                data_len: len,
                name,
            });
            bufs.len() - 1
        };
        let own = &inputs[r];
        let is_root = r == c.root;
        let (send, recv): (Arg, Arg) = match (c.func, c.in_place) {
            (Func::AllReduce, false) => {
                let s = new_buf("send", Some(own), Some(own), b);
                let d = new_buf("recv", None, Some(&reduced), b);
                (Some((s, at, b)), Some((d, at, b)))
            }
            (Func::AllReduce, true) => {
                let s = new_buf("in-place", Some(own), Some(&reduced), b);
                (Some((s, at, b)), Some((s, at, b)))
            }
            (Func::Reduce, false) => {
                let s = new_buf("send", Some(own), Some(own), b);
                let d = if is_root {
                    Some((new_buf("recv", None, Some(&reduced), b), at, b))
                } else {
                    None
                };
                (Some((s, at, b)), d)
            }
            (Func::Reduce, true) => {
                let want = if is_root { &reduced } else { own };
                let s = new_buf("in-place", Some(own), Some(want), b);
                (Some((s, at, b)), Some((s, at, b)))
            }
            (Func::Broadcast, false) => {
                let s = if is_root {
                    Some((new_buf("send", Some(own), Some(own), b), at, b))
                } else {
                    None
                };
                let d = new_buf("recv", None, Some(&inputs[c.root]), b);
                (s, Some((d, at, b)))
            }
            (Func::Broadcast, true) => {
                let init = if is_root { Some(own.as_slice()) } else { None };
                let s = new_buf("in-place", init, Some(&inputs[c.root]), b);
                (Some((s, at, b)), Some((s, at, b)))
            }
            (Func::AllGather, false) => {
                let s = new_buf("send", Some(own), Some(own), b);
                let d = new_buf("recv", None, Some(&gathered), n * b);
                (Some((s, at, b)), Some((d, at, n * b)))
            }
            (Func::AllGather, true) => {
                // The sentinel everywhere but our own block.
                let salt = (r * 8 + 1) as u8;
                let mut init = common::sentinel(at + n * b + GUARD, salt)[at..at + n * b].to_vec();
                init[r * b..(r + 1) * b].copy_from_slice(own);
                let s = new_buf("in-place", Some(&init), Some(&gathered), n * b);
                (Some((s, at + r * b, b)), Some((s, at, n * b)))
            }
            (Func::ReduceScatter, false) => {
                let s = new_buf("send", Some(own), Some(own), n * b);
                let d = new_buf("recv", None, Some(&reduced[r * b..(r + 1) * b]), b);
                (Some((s, at, n * b)), Some((d, at, b)))
            }
            (Func::ReduceScatter, true) => {
                let mut want = own.clone();
                want[r * b..(r + 1) * b].copy_from_slice(&reduced[r * b..(r + 1) * b]);
                let s = new_buf("in-place", Some(own), Some(&want), n * b);
                (Some((s, at, n * b)), Some((s, at + r * b, b)))
            }
        };
        ranks.push(RankPlan { bufs, send, recv });
    }
    Prepared {
        call: c.clone(),
        what: c.what(n),
        ranks,
    }
}

/// Queues the call on every rank (in rank order), returning each rank's result.
fn issue_results(comms: &[Comm], streams: &[Stream], p: &Prepared) -> Vec<oxccl::Result<()>> {
    let c = &p.call;
    comms
        .iter()
        .enumerate()
        .map(|(r, comm)| {
            let rp = &p.ranks[r];
            let sl = |a: Arg| a.map(|(i, off, len)| rp.bufs[i].mem.slice(off, len).unwrap());
            let (s, d) = (sl(rp.send), sl(rp.recv));
            let st = &streams[r];
            match c.func {
                Func::Broadcast => comm.broadcast(s, d.unwrap(), c.count, c.dtype, c.root, st),
                Func::Reduce => comm.reduce(s.unwrap(), d, c.count, c.dtype, c.op, c.root, st),
                Func::AllGather => comm.all_gather(s.unwrap(), d.unwrap(), c.count, c.dtype, st),
                Func::ReduceScatter => {
                    comm.reduce_scatter(s.unwrap(), d.unwrap(), c.count, c.dtype, c.op, st)
                }
                Func::AllReduce => comm.all_reduce(s.unwrap(), d.unwrap(), c.count, c.dtype, c.op, st),
            }
        })
        .collect()
}

/// Queues the call on every rank and checks each rank's plan: the call's collective and, when
/// given, the protocol `proto` and algorithm `algo`.
fn issue(
    comms: &[Comm],
    streams: &[Stream],
    p: &Prepared,
    proto: Option<Proto>,
    algo: Option<Algo>,
) -> Vec<String> {
    for (r, res) in issue_results(comms, streams, p).into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("{}: rank {r}: {e}", p.what));
    }
    let mut errs = Vec::new();
    if comms.len() > 1 && p.call.count > 0 {
        for (r, comm) in comms.iter().enumerate() {
            match comm.last_choice() {
                Some(ch)
                    if ch.func == p.call.func
                        && proto.is_none_or(|x| x == ch.proto)
                        && algo.is_none_or(|x| x == ch.algo) => {}
                other => errs.push(format!(
                    "{}: rank {r}: planned {other:?}, wanted proto {proto:?} algo {algo:?}",
                    p.what
                )),
            }
        }
    }
    errs
}

/// Compares every buffer of every rank with what it must hold (after the streams synchronized).
fn verify(p: &Prepared) -> Vec<String> {
    let mut errs = Vec::new();
    let es = p.call.dtype.size();
    for (r, rp) in p.ranks.iter().enumerate() {
        for b in &rp.bufs {
            let got = b.mem.to_vec().unwrap();
            if got == b.want {
                continue;
            }
            let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != b.want[i]).collect();
            let i = bad[0];
            let place = if i < b.data_at {
                format!("guard byte {} before the data", b.data_at - i)
            } else if i >= b.data_at + b.data_len {
                format!("guard byte {} after the data", i - b.data_at - b.data_len)
            } else {
                format!("data element {}", (i - b.data_at) / es)
            };
            errs.push(format!(
                "{}: rank {r}: {} buffer: {} bytes wrong, first at {place}: got 0x{:02x}, want 0x{:02x}",
                p.what,
                b.name,
                bad.len(),
                got[i],
                b.want[i]
            ));
        }
    }
    errs
}

/// Runs one call (prepare, queue on every rank, synchronize, verify).
fn run(comms: &[Comm], streams: &[Stream], c: &Call, proto: Option<Proto>) -> Vec<String> {
    let p = prepare(comms, c);
    let mut errs = issue(comms, streams, &p, proto, Some(Algo::Ring));
    sync_all(streams, &p.what);
    errs.extend(verify(&p));
    errs
}

/// Queues every call of `batch` back to back on every rank (each with its own buffers, so the
/// ranks may drift apart by several calls), then synchronizes and verifies them all. `plans[i]`
/// is the (protocol, algorithm) call `i` must get.
fn run_batch(
    comms: &[Comm],
    streams: &[Stream],
    batch: &[Call],
    plans: &[(Option<Proto>, Option<Algo>)],
) -> Vec<String> {
    let preps: Vec<Prepared> = batch.iter().map(|c| prepare(comms, c)).collect();
    let mut errs = Vec::new();
    for (p, &(proto, algo)) in preps.iter().zip(plans) {
        errs.extend(issue(comms, streams, p, proto, algo));
    }
    sync_all(streams, "batch");
    for p in &preps {
        errs.extend(verify(p));
    }
    errs
}

fn assert_no_errors(test: &str, errs: &[String]) {
    assert!(
        errs.is_empty(),
        "{test}: {} failures (first 30):\n{}",
        errs.len(),
        errs.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// Element offsets of the ranks' buffers for variant `k`: odd for most ranks, 0 (16-byte aligned)
/// for some, never the same on two neighbours, so sender and receiver are misaligned differently.
fn offsets(n: usize, k: usize) -> Vec<usize> {
    const OFFS: [usize; 6] = [1, 0, 3, 7, 5, 9];
    (0..n).map(|r| OFFS[(r + k) % OFFS.len()]).collect()
}

// ---------------------------------------------------------------------------------------------
// 1. Forced Simple, misaligned outputs, every root.

/// Forced Simple (`NCCL_PROTO=Simple`) Broadcast (every root), AllGather and AllReduce on 2, 3,
/// 4 and 5 ranks, in place and out of place, at counts 1, 3, 4097 and 2^20+5, each rank's buffers
/// at its own element offset (odd, or aligned on a neighbour): the direct writes land in peer
/// outputs misaligned against the sender's packs. Every output exact, every guard byte intact,
/// every call planned as ring Simple, `direct_pointer()` true on every rank.
#[test]
fn simple_direct_misaligned_every_root_2_to_5_ranks() {
    let test = "simple_direct_misaligned_every_root_2_to_5_ranks";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let t0 = Instant::now();
    let mut errs = Vec::new();
    let mut calls = 0;
    // (count, dtype for the copies, dtype and op for AllReduce)
    let cases: [(usize, DataType, DataType, RedOp); 4] = [
        (1, DataType::F64, DataType::F64, RedOp::Prod),
        (3, DataType::I32, DataType::I32, RedOp::Max),
        (4097, DataType::Bf16, DataType::Bf16, RedOp::Sum),
        ((1 << 20) + 5, DataType::U8, DataType::F32, RedOp::Sum),
    ];
    for n in 2..=5 {
        let comms = init_ok(n, &[("NCCL_PROTO", "Simple")]);
        for c in &comms {
            assert!(
                c.direct_pointer(),
                "rank {} of {n}: direct_pointer() false",
                c.rank()
            );
        }
        let streams = streams(&comms);
        for (k, &(count, dtype, ar_dtype, ar_op)) in cases.iter().enumerate() {
            for in_place in [false, true] {
                let offs = offsets(n, k + 2 * in_place as usize);
                for root in 0..n {
                    let c = Call::new(Func::Broadcast, dtype, count, offs.clone())
                        .root(root)
                        .in_place(in_place)
                        .seed((n * 100 + k * 10 + root) as u64);
                    dog.step(c.what(n));
                    errs.extend(run(&comms, &streams, &c, Some(Proto::Simple)));
                    calls += 1;
                }
                let c = Call::new(Func::AllGather, dtype, count, offs.clone())
                    .in_place(in_place)
                    .seed((n * 100 + k) as u64 + 7);
                dog.step(c.what(n));
                errs.extend(run(&comms, &streams, &c, Some(Proto::Simple)));
                let c = Call::new(Func::AllReduce, ar_dtype, count, offs.clone())
                    .op(ar_op)
                    .in_place(in_place)
                    .seed((n * 100 + k) as u64 + 9);
                dog.step(c.what(n));
                errs.extend(run(&comms, &streams, &c, Some(Proto::Simple)));
                calls += 2;
            }
        }
    }
    eprintln!("{test}: {calls} calls in {:.2?}", t0.elapsed());
    assert_no_errors(test, &errs);
}

// ---------------------------------------------------------------------------------------------
// 2. Protocol mixing on one communicator.

const FUNCS: [Func; 5] = [
    Func::Broadcast,
    Func::AllGather,
    Func::Reduce,
    Func::AllReduce,
    Func::ReduceScatter,
];

/// For each collective of [`FUNCS`]: one count per protocol the model picks at `dtype` on
/// `comms` (the smallest count of the sweep `2^k + 3`, k < `max_k`, that gets it).
fn counts_per_proto(comm: &Comm, dtype: DataType, max_k: u32) -> Vec<(Func, Vec<(usize, Proto)>)> {
    FUNCS
        .iter()
        .map(|&f| {
            let mut found: Vec<(usize, Proto)> = Vec::new();
            for k in 0..max_k {
                let count = (1usize << k) + 3;
                let ch = comm.choice_for(f, count, dtype).unwrap().unwrap();
                if !found.iter().any(|&(_, p)| p == ch.proto) {
                    found.push((count, ch.proto));
                }
            }
            (f, found)
        })
        .collect()
}

/// `ncalls` calls cycling over [`FUNCS`], each collective cycling over its protocols' counts
/// (`table`), roots, in place / out of place, element offsets and reduction ops; queued in
/// batches of `batch`. Returns (errors, calls per protocol, protocol switches between calls, the
/// distinct (protocol, algorithm, channel count) plans).
fn mixed_sequence(
    comms: &[Comm],
    dtype: DataType,
    table: &[(Func, Vec<(usize, Proto)>)],
    ncalls: usize,
    batch: usize,
    seed: u64,
    dog: &common::Watchdog,
) -> (Vec<String>, [usize; 3], usize, Vec<(Proto, Algo, u32)>) {
    let n = comms.len();
    let streams = streams(comms);
    let ops = [RedOp::Sum, RedOp::Max, RedOp::Min, RedOp::Prod];
    let mut errs = Vec::new();
    let mut per_proto = [0usize; 3];
    let mut switches = 0;
    let mut last_proto = None;
    let mut algos = Vec::new();
    let mut i = 0;
    while i < ncalls {
        let mut calls = Vec::new();
        let mut plans = Vec::new();
        for j in i..(i + batch).min(ncalls) {
            let (func, counts) = &table[j % table.len()];
            let round = j / table.len();
            // The protocol moves on with every call (not only every round of collectives).
            let (count, _) = counts[(round + j) % counts.len()];
            let count = count + (round % 3) * 2;
            let ch = comms[0].choice_for(*func, count, dtype).unwrap().unwrap();
            let c = Call::new(*func, dtype, count, offsets(n, j))
                .op(ops[round % ops.len()])
                .root((round * 7 + j) % n)
                .in_place(j % 3 == 1)
                .seed(seed + j as u64);
            per_proto[match ch.proto {
                Proto::Ll => 0,
                Proto::Ll128 => 1,
                Proto::Simple => 2,
            }] += 1;
            if last_proto.is_some_and(|p| p != ch.proto) {
                switches += 1;
            }
            last_proto = Some(ch.proto);
            if !algos.contains(&(ch.proto, ch.algo, ch.nchannels)) {
                algos.push((ch.proto, ch.algo, ch.nchannels));
            }
            calls.push(c);
            plans.push((Some(ch.proto), Some(ch.algo)));
        }
        dog.step(format!(
            "calls {i}..{} (first: {})",
            i + calls.len(),
            calls[0].what(n)
        ));
        errs.extend(run_batch(comms, &streams, &calls, &plans));
        i += calls.len();
    }
    (errs, per_proto, switches, algos)
}

/// Adds `count` (which must plan as Simple) to every collective's counts in `table`.
fn with_simple_count(
    comm: &Comm,
    table: Vec<(Func, Vec<(usize, Proto)>)>,
    count: usize,
    dtype: DataType,
) -> Vec<(Func, Vec<(usize, Proto)>)> {
    table
        .into_iter()
        .map(|(f, mut v)| {
            let ch = comm.choice_for(f, count, dtype).unwrap().unwrap();
            assert_eq!(ch.proto, Proto::Simple, "{f} at {count} {dtype}");
            v.push((count, Proto::Simple));
            (f, v)
        })
        .collect()
}

/// 400 calls on 4 ranks with every protocol allowed: the five collectives in turn, the protocol
/// changing from one call to the next (counts the model runs on LL, LL128 and Simple, plus a
/// multi-chunk Simple count), queued 10 at a time without synchronizing, so the ranks drift apart
/// and the Simple kernels' pointer exchanges (counted per connection by both ends) go through the
/// FIFO-path Reduce/ReduceScatter and the LL/LL128 calls between the direct ones. Every call's
/// plan matches `choice_for`, every result exact, guards intact.
#[test]
fn protocol_mixing_keeps_pointer_exchanges_in_step() {
    let test = "protocol_mixing_keeps_pointer_exchanges_in_step";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let t0 = Instant::now();
    let comms = init_ok(4, &[]);
    assert!(comms.iter().all(|c| c.direct_pointer()));
    let table = counts_per_proto(&comms[0], DataType::I32, 19);
    eprintln!("{test}: counts per protocol: {table:?}");
    for (f, found) in &table {
        assert!(
            found.iter().any(|&(_, p)| p == Proto::Simple) && found.iter().any(|&(_, p)| p == Proto::Ll),
            "{f}: the sweep found no LL and Simple counts: {found:?}"
        );
    }
    let table = with_simple_count(&comms[0], table, 300_007, DataType::I32);
    let (errs, per_proto, switches, plans) =
        mixed_sequence(&comms, DataType::I32, &table, 400, 10, 1000, &dog);
    eprintln!(
        "{test}: 400 calls (LL {}, LL128 {}, Simple {}; {switches} protocol switches; plans {plans:?}) in {:.2?}",
        per_proto[0],
        per_proto[1],
        per_proto[2],
        t0.elapsed()
    );
    // Simple calls on one and on two channels: channel 1's exchange count falls behind channel
    // 0's and must still pair up.
    let simple_nch: Vec<u32> = plans
        .iter()
        .filter(|p| p.0 == Proto::Simple)
        .map(|p| p.2)
        .collect();
    assert!(simple_nch.contains(&1) && simple_nch.contains(&2), "{plans:?}");
    assert_no_errors(test, &errs);
    assert!(per_proto[0] >= 80 && per_proto[2] >= 150, "{per_proto:?}");
    assert!(switches >= 300, "only {switches} protocol switches");
}

/// The same mixing with the smallest Simple FIFO (`NCCL_BUFFSIZE=8192`: 1 KiB slots, so every
/// Simple call runs many steps and the sender runs up to 8 slots ahead of a receiver whose output
/// it writes directly, in-place AllReduce included): 3 ranks with LL and Simple, 5 ranks with
/// Simple only.
#[test]
fn protocol_mixing_smallest_simple_fifo() {
    let test = "protocol_mixing_smallest_simple_fifo";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    for (n, proto, ncalls) in [(3, "LL,Simple", 160), (5, "Simple", 100)] {
        let t0 = Instant::now();
        let comms = init_ok(n, &[("NCCL_BUFFSIZE", "8192"), ("NCCL_PROTO", proto)]);
        let table = counts_per_proto(&comms[0], DataType::U64, 16);
        eprintln!("{test}: {n} ranks, {proto}: counts per protocol: {table:?}");
        // Simple calls of many steps: 20001 elements (160 KB, 156 slots of the FIFO) per call.
        let table = with_simple_count(&comms[0], table, 20_001, DataType::U64);
        let (errs, per_proto, switches, _) =
            mixed_sequence(&comms, DataType::U64, &table, ncalls, 8, 5000 + n as u64, &dog);
        eprintln!(
            "{test}: {n} ranks: {ncalls} calls (LL {}, Simple {}; {switches} switches) in {:.2?}",
            per_proto[0],
            per_proto[2],
            t0.elapsed()
        );
        assert_no_errors(test, &errs);
        if proto == "Simple" {
            assert_eq!(per_proto[2], ncalls);
        } else {
            assert!(per_proto[0] >= 40 && per_proto[2] >= 80, "{per_proto:?}");
        }
    }
}

/// Connection steps starting just below the LL flag period (`OXCCL_TEST_INITIAL_STEP`, 2^32 − 6)
/// do not disturb the pointer exchanges (counted from 0, independently of the steps): 150 mixed
/// calls on 3 ranks across the wrap, exact.
#[test]
fn protocol_mixing_across_step_wrap() {
    let test = "protocol_mixing_across_step_wrap";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let comms = init_ok(3, &[("OXCCL_TEST_INITIAL_STEP", "4294967290")]);
    assert_eq!(comms[0].params().initial_step, 4_294_967_290);
    let table = counts_per_proto(&comms[0], DataType::F32, 19);
    let (errs, per_proto, _, _) = mixed_sequence(&comms, DataType::F32, &table, 150, 6, 9000, &dog);
    eprintln!("{test}: {per_proto:?}");
    assert_no_errors(test, &errs);
    assert!(per_proto[2] >= 30, "{per_proto:?}");
}

/// Two communicators over the same 3 CPU devices, their calls interleaved on the same streams
/// (queued 12 at a time): each has its own connections and pointer exchanges, so neither
/// communicator's direct writes may land in the other's buffers. Forced Simple.
#[test]
fn two_communicators_interleaved_on_shared_streams() {
    let test = "two_communicators_interleaved_on_shared_streams";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let a = init_ok(3, &[("NCCL_PROTO", "Simple")]);
    let b = init_ok(3, &[("NCCL_PROTO", "Simple")]);
    let streams = streams(&a);
    let n = 3;
    let mut errs = Vec::new();
    let funcs = [Func::Broadcast, Func::AllGather, Func::AllReduce, Func::Reduce];
    for round in 0..5 {
        let mut preps = Vec::new();
        for j in 0..12 {
            let comms = if j % 2 == 0 { &a } else { &b };
            let k = round * 12 + j;
            let c = Call::new(funcs[(j / 2) % 4], DataType::I32, 50_001 + 2 * k, offsets(n, k))
                .root(k % n)
                .in_place(k % 3 == 0)
                .seed(k as u64);
            let p = prepare(comms, &c);
            errs.extend(issue(comms, &streams, &p, Some(Proto::Simple), Some(Algo::Ring)));
            preps.push(p);
        }
        dog.step(format!("round {round}"));
        sync_all(&streams, "two communicators");
        for p in &preps {
            errs.extend(verify(p));
        }
    }
    assert_no_errors(test, &errs);
}

/// Tree AllReduces (`OXCCL_TEST_NODES=2` on 4 ranks, forced Simple: the model runs AllReduce as
/// a tree below ~8K elements and as a ring above) between ring Broadcast/AllGather direct calls
/// and ring AllReduces, queued in batches: the tree kernels use their own connections, so the
/// ring connections' exchange counts must not move with them. At least one AllReduce per batch
/// runs as a tree (checked against `last_choice`).
#[test]
fn tree_all_reduce_between_direct_ring_calls() {
    let test = "tree_all_reduce_between_direct_ring_calls";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let t0 = Instant::now();
    let comms = init_ok(4, &[("OXCCL_TEST_NODES", "2"), ("NCCL_PROTO", "Simple")]);
    assert!(comms.iter().all(|c| c.direct_pointer()));
    // Counts where AllReduce runs as a tree on Simple.
    let mut tree_counts = Vec::new();
    let mut ring_counts = Vec::new();
    for k in 0..22 {
        let count = (1usize << k) + 5;
        let ch = comms[0]
            .choice_for(Func::AllReduce, count, DataType::F32)
            .unwrap()
            .unwrap();
        if ch.algo == Algo::Tree {
            tree_counts.push(count);
        } else {
            ring_counts.push(count);
        }
    }
    eprintln!("{test}: AllReduce tree at {tree_counts:?}, ring at {ring_counts:?}");
    assert!(
        !tree_counts.is_empty(),
        "the model never picks the tree on Simple"
    );
    let streams = streams(&comms);
    let mut errs = Vec::new();
    let n = comms.len();
    let mut calls = Vec::new();
    let mut plans = Vec::new();
    for (j, &tc) in tree_counts.iter().cycle().take(12).enumerate() {
        let big = (1 << 16) + 3 + j;
        calls.push(
            Call::new(Func::Broadcast, DataType::I32, big, offsets(n, j))
                .root(j % n)
                .in_place(j % 2 == 0)
                .seed(j as u64),
        );
        plans.push((Some(Proto::Simple), Some(Algo::Ring)));
        calls.push(
            Call::new(Func::AllReduce, DataType::F32, tc, offsets(n, j + 1))
                .in_place(j % 2 == 1)
                .seed(100 + j as u64),
        );
        plans.push((Some(Proto::Simple), Some(Algo::Tree)));
        calls.push(
            Call::new(Func::AllGather, DataType::U8, big, offsets(n, j + 2))
                .in_place(j % 3 == 0)
                .seed(200 + j as u64),
        );
        plans.push((Some(Proto::Simple), Some(Algo::Ring)));
        if let Some(&rc) = ring_counts.get(j % ring_counts.len().max(1)) {
            calls.push(
                Call::new(Func::AllReduce, DataType::F32, rc, offsets(n, j + 3))
                    .in_place(j % 2 == 0)
                    .seed(300 + j as u64),
            );
            plans.push((Some(Proto::Simple), Some(Algo::Ring)));
        }
        if calls.len() >= 8 {
            dog.step(format!("batch ending at {j}"));
            errs.extend(run_batch(&comms, &streams, &calls, &plans));
            calls.clear();
            plans.clear();
        }
    }
    if !calls.is_empty() {
        errs.extend(run_batch(&comms, &streams, &calls, &plans));
    }
    eprintln!("{test}: done in {:.2?}", t0.elapsed());
    assert_no_errors(test, &errs);
}

// ---------------------------------------------------------------------------------------------
// 3. Per-channel rings that differ.

/// The NVLink-mesh topology hook gives 4 CPU ranks 8 channels on 4 different ring orders
/// (`common::topo::MESH_RINGS`), every channel in use (`NCCL_MIN_NCHANNELS=8`): forced Simple
/// Broadcast (every root), AllGather and AllReduce, interleaved with Reduce and ReduceScatter, in
/// and out of place at misaligned offsets, queued in batches. Each channel's sender writes into
/// its own channel's next rank (not the rank-order next), so a connection paired wrongly would
/// write another rank's output.
#[test]
fn per_channel_mesh_rings_with_direct_writes() {
    let test = "per_channel_mesh_rings_with_direct_writes";
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let t0 = Instant::now();
    let topo = common::topo::fixture("nvlink-mesh-4gpu-topo.xml");
    let comms = init_ok(
        4,
        &[
            ("NCCL_TOPO_FILE", topo.to_str().unwrap()),
            ("NCCL_MAX_NCHANNELS", "8"),
            ("NCCL_MIN_NCHANNELS", "8"),
            ("NCCL_PROTO", "Simple"),
        ],
    );
    let mut distinct: Vec<Vec<usize>> = Vec::new();
    for comm in &comms {
        assert!(comm.direct_pointer());
        assert_eq!(comm.nchannels(), 8);
        for c in 0..8 {
            let want = common::topo::rotate(&common::topo::MESH_RINGS[c % 6], comm.rank());
            assert_eq!(
                comm.ring(c),
                Some(want.clone()),
                "rank {} channel {c}",
                comm.rank()
            );
            if comm.rank() == 0 && !distinct.contains(&want) {
                distinct.push(want);
            }
        }
    }
    assert!(distinct.len() >= 3, "rings: {distinct:?}");
    let streams = streams(&comms);
    let n = 4;
    let mut errs = Vec::new();
    let mut k = 0;
    for &(count, dtype) in &[
        (13usize, DataType::I64),
        (40_001, DataType::F16),
        (300_007, DataType::U8),
        (262_147, DataType::I32),
    ] {
        for in_place in [false, true] {
            let mut calls = Vec::new();
            for root in 0..n {
                calls.push(
                    Call::new(Func::Broadcast, dtype, count, offsets(n, k))
                        .root(root)
                        .in_place(in_place)
                        .seed(k as u64),
                );
                k += 1;
            }
            for func in [
                Func::Reduce,
                Func::AllGather,
                Func::ReduceScatter,
                Func::AllReduce,
            ] {
                calls.push(
                    Call::new(func, dtype, count, offsets(n, k))
                        .root(k % n)
                        .op(if dtype == DataType::F16 {
                            RedOp::Sum
                        } else {
                            RedOp::Max
                        })
                        .in_place(in_place)
                        .seed(k as u64),
                );
                k += 1;
            }
            let plans = vec![(Some(Proto::Simple), Some(Algo::Ring)); calls.len()];
            dog.step(format!("count {count} {dtype} in_place={in_place}"));
            errs.extend(run_batch(&comms, &streams, &calls, &plans));
            for comm in &comms {
                let ch = comm.last_choice().unwrap();
                assert_eq!(ch.nchannels, 8, "{ch:?}");
            }
        }
    }
    eprintln!("{test}: {k} calls in {:.2?}", t0.elapsed());
    assert_no_errors(test, &errs);
    drop(comms);

    // The model's own channel counts (1..8) on the same rings: calls on fewer channels leave the
    // higher channels' exchange counts behind, each channel on its own ring.
    let comms = init_ok(
        4,
        &[
            ("NCCL_TOPO_FILE", topo.to_str().unwrap()),
            ("NCCL_MAX_NCHANNELS", "8"),
            ("NCCL_PROTO", "Simple"),
        ],
    );
    let table: Vec<(Func, Vec<(usize, Proto)>)> = FUNCS
        .iter()
        .map(|&f| {
            let mut seen = Vec::new();
            let mut v = Vec::new();
            for k in 0..22 {
                let count = (1usize << k) + 1;
                let ch = comms[0].choice_for(f, count, DataType::U8).unwrap().unwrap();
                if !seen.contains(&ch.nchannels) {
                    seen.push(ch.nchannels);
                    v.push((count, ch.proto));
                }
            }
            (f, v)
        })
        .collect();
    let (errs, _, _, plans) = mixed_sequence(&comms, DataType::U8, &table, 120, 10, 77, &dog);
    let nchs: Vec<u32> = plans.iter().map(|p| p.2).collect();
    eprintln!("{test}: model's channel counts: table {table:?}, plans {plans:?}");
    assert!(nchs.len() >= 3, "{plans:?}");
    assert_no_errors(test, &errs);
}

// ---------------------------------------------------------------------------------------------
// 4. Abort while a sender spins on the pointer exchange.

/// A stream and whether its work has finished, polled without blocking the test.
struct Pending {
    rx: mpsc::Receiver<oxccl::Result<()>>,
}

fn pending(stream: Stream) -> Pending {
    let stream: &'static Stream = Box::leak(Box::new(stream));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(stream.synchronize());
    });
    Pending { rx }
}

impl Pending {
    fn done_within(&self, limit: Duration) -> Option<oxccl::Result<()>> {
        self.rx.recv_timeout(limit).ok()
    }
}

/// 2 ranks, forced Simple: the root queues a large Broadcast (a direct send: its kernel spins on
/// the pointer-exchange slot, which rank 1 never fills), rank 1 never calls. After 300 ms the
/// root's stream is still busy; `abort` on the root (from another thread) returns within 5 s, the
/// root's stream finishes, later calls fail on both ranks (InvalidUsage on the root, Remote on
/// rank 1), and the root's input is unchanged.
#[test]
fn abort_root_spinning_on_pointer_exchange() {
    let test = "abort_root_spinning_on_pointer_exchange";
    let _dog = common::Watchdog::new(test, Duration::from_secs(60));
    for in_place in [false, true] {
        let comms = init_ok(2, &[("NCCL_PROTO", "Simple")]);
        assert!(comms[0].direct_pointer());
        let count = (1 << 20) + 1;
        let src = comms[0].device().alloc(count * 4).unwrap();
        let data = hash_bytes(77, count * 4);
        src.write(0, &data).unwrap();
        let dst = comms[0].device().alloc(count * 4).unwrap();
        let s0 = comms[0].device().new_stream().unwrap();
        let out = if in_place { &src } else { &dst };
        comms[0]
            .broadcast(Some(src.as_slice()), out, count, DataType::U32, 0, &s0)
            .unwrap();
        assert_eq!(comms[0].last_choice().unwrap().proto, Proto::Simple);
        let p = pending(s0);
        assert!(
            p.done_within(Duration::from_millis(300)).is_none(),
            "in_place={in_place}: the root's Broadcast finished without its receiver"
        );
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| comms[0].abort()).join().unwrap().unwrap();
        });
        let took = t.elapsed();
        assert!(took < Duration::from_secs(5), "abort took {took:?}");
        let res = p.done_within(Duration::from_secs(5));
        assert!(
            res.is_some(),
            "in_place={in_place}: the root's stream did not finish after abort"
        );
        eprintln!(
            "{test}: in_place={in_place}: abort {took:?}, stream {:?}",
            res.unwrap()
        );
        // Later calls fail on both ranks; the input is untouched.
        let s = comms[1].device().new_stream().unwrap();
        let b1 = comms[1].device().alloc(64).unwrap();
        match comms[1].broadcast(None, &b1, 16, DataType::U32, 0, &s) {
            Err(Error::Remote(_)) => {}
            other => panic!("rank 1 after the root's abort: {other:?}"),
        }
        let s = comms[0].device().new_stream().unwrap();
        match comms[0].all_reduce(&dst, &dst, 16, DataType::U32, RedOp::Sum, &s) {
            Err(Error::InvalidUsage(_)) => {}
            other => panic!("root after its abort: {other:?}"),
        }
        if !in_place {
            assert_eq!(src.to_vec().unwrap(), data, "the root's input changed");
        }
    }
}

/// 3 ranks, forced Simple Broadcast from root 1: the root (spinning on rank 2's pointer exchange)
/// and rank 0 (waiting for data from rank 2) call, rank 2 never does. Rank 2 — the absent one —
/// aborts: both waiting streams finish within 5 s, both ranks report Remote. Then the same with
/// an AllGather where rank 0 is absent (its prev spins on the exchange) and rank 1 aborts.
#[test]
fn abort_by_absent_or_other_rank_releases_exchange_waiters() {
    let test = "abort_by_absent_or_other_rank_releases_exchange_waiters";
    let _dog = common::Watchdog::new(test, Duration::from_secs(60));
    let count = 300_001;
    for (func, absent, aborter) in [(Func::Broadcast, 2usize, 2usize), (Func::AllGather, 0, 1)] {
        let comms = init_ok(3, &[("NCCL_PROTO", "Simple")]);
        let bufs: Vec<(DeviceBuffer, DeviceBuffer)> = comms
            .iter()
            .map(|c| {
                let s = c.device().alloc(count * 4).unwrap();
                s.write(0, &hash_bytes(c.rank() as u64, count * 4)).unwrap();
                (s, c.device().alloc(3 * count * 4).unwrap())
            })
            .collect();
        let mut pend = Vec::new();
        for (r, comm) in comms.iter().enumerate() {
            if r == absent {
                continue;
            }
            let st = comm.device().new_stream().unwrap();
            let (s, d) = &bufs[r];
            match func {
                Func::Broadcast => comm.broadcast(Some(s.as_slice()), d, count, DataType::F32, 1, &st),
                _ => comm.all_gather(s, d, count, DataType::F32, &st),
            }
            .unwrap();
            assert_eq!(comm.last_choice().unwrap().proto, Proto::Simple);
            pend.push((r, pending(st)));
        }
        std::thread::sleep(Duration::from_millis(300));
        for (r, p) in &pend {
            assert!(
                p.done_within(Duration::ZERO).is_none(),
                "{func}: rank {r} finished while rank {absent} never called"
            );
        }
        let t = Instant::now();
        comms[aborter].abort().unwrap();
        let took = t.elapsed();
        assert!(took < Duration::from_secs(5), "{func}: abort took {took:?}");
        for (r, p) in &pend {
            let res = p.done_within(Duration::from_secs(5));
            assert!(
                res.is_some(),
                "{func}: rank {r}'s stream did not finish after rank {aborter}'s abort"
            );
            if *r != aborter {
                assert!(
                    matches!(comms[*r].get_async_error(), Err(Error::Remote(_))),
                    "{func}: rank {r}: {:?}",
                    comms[*r].get_async_error()
                );
                // Its own abort returns too.
                let t = Instant::now();
                comms[*r].abort().unwrap();
                assert!(t.elapsed() < Duration::from_secs(5));
            }
        }
        eprintln!("{test}: {func}: abort by rank {aborter} in {took:?}");
    }
}

/// C28 on direct collectives: 2 and 3 ranks loop forced-Simple Broadcast / AllGather / AllReduce
/// (each rank on its own thread, so they drift), another thread aborts one rank after a
/// pseudo-random 0–50 ms; 6 repetitions per rank count. Abort returns within 5 s, every rank's
/// loop ends (its next call fails: InvalidUsage on the victim, Remote on the others), every rank
/// then aborts too (as after any error) within 5 s and its stream finishes.
///
/// The buffers are freed only once every rank has aborted: freeing a rank's buffers as soon as
/// its own stream finished was not safe with the first direct writes (see
/// `peer_never_writes_receiver_output_after_its_abort_returned`): it crashed this loop with
/// "corrupted size vs. prev_size" / SIGSEGV in 4 of 5 runs.
#[test]
fn abort_during_direct_collective_loops() {
    abort_during_loops("abort_during_direct_collective_loops", &[("NCCL_PROTO", "Simple")]);
}

/// The loop above with the call check on: the victim's kernels queued before its abort still
/// run their checks, and one cut short can send a later call's signature into a peer's gather
/// of an earlier call. The peers must still report the abort (`Remote`), not diverged calls.
#[test]
fn abort_during_checked_collective_loops_reports_the_abort() {
    abort_during_loops(
        "abort_during_checked_collective_loops_reports_the_abort",
        &[("NCCL_PROTO", "Simple"), ("OXCCL_CHECK_CALLS", "1")],
    );
}

/// Ranks loop Broadcast / AllGather / AllReduce on threads of their own until a random rank
/// aborts after a random delay; every rank's loop must end with the victim's `InvalidUsage` or
/// the others' `Remote`, and every abort return within 5 s. `vars`: the communicators'
/// environment.
fn abort_during_loops(test: &str, vars: &[(&str, &str)]) {
    let dog = common::Watchdog::new(test, Duration::from_secs(60));
    let mut x = 0x1234_5678u64;
    for n in [2usize, 3] {
        for rep in 0..6 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let delay = Duration::from_millis(x % 51);
            let victim = (x >> 8) as usize % n;
            dog.step(format!("n={n} rep={rep} delay={delay:?} victim={victim}"));
            let comms = init_ok(n, vars);
            let count = 200_003;
            let mut keep = Vec::new();
            std::thread::scope(|s| {
                let loops: Vec<_> = comms
                    .iter()
                    .map(|comm| {
                        s.spawn(move || {
                            let dev = comm.device();
                            let st = dev.new_stream().unwrap();
                            let a = dev.alloc(count * 4 * n).unwrap();
                            let b = dev.alloc(count * 4 * n).unwrap();
                            let mut calls = 0;
                            let err = loop {
                                let res = match calls % 3 {
                                    0 => comm.broadcast(
                                        Some(a.as_slice()),
                                        &b,
                                        count,
                                        DataType::I32,
                                        calls % n,
                                        &st,
                                    ),
                                    1 => comm.all_gather(
                                        a.slice(0, count * 4).unwrap(),
                                        &b,
                                        count,
                                        DataType::I32,
                                        &st,
                                    ),
                                    _ => comm.all_reduce(&a, &a, count, DataType::I32, RedOp::Sum, &st),
                                };
                                if let Err(e) = res {
                                    break Some(e);
                                }
                                calls += 1;
                                if calls % 4 == 0 {
                                    let _ = st.synchronize();
                                }
                                if calls > 3000 {
                                    break None;
                                }
                            };
                            let t = Instant::now();
                            let ab = comm.abort();
                            let took = t.elapsed();
                            let _ = st.synchronize();
                            (calls, err, ab, took, (a, b, st))
                        })
                    })
                    .collect();
                std::thread::sleep(delay);
                let t = Instant::now();
                comms[victim].abort().unwrap();
                let took = t.elapsed();
                assert!(took < Duration::from_secs(5), "abort took {took:?}");
                for (r, h) in loops.into_iter().enumerate() {
                    let (calls, err, ab, took, bufs) = h.join().unwrap();
                    keep.push(bufs);
                    match (&err, r == victim) {
                        (Some(Error::InvalidUsage(_)), true) | (Some(Error::Remote(_)), false) => {}
                        _ => panic!(
                            "n={n} rep={rep}: rank {r} ended its loop after {calls} calls with {err:?}"
                        ),
                    }
                    assert!(
                        ab.is_ok() && took < Duration::from_secs(5),
                        "rank {r}: abort {ab:?} after {took:?}"
                    );
                }
            });
            // Every rank aborted and its queued work finished: now the buffers may go.
            drop(keep);
        }
    }
}

/// The hazard behind the crash of the loop above, made deterministic. 2 ranks, forced Simple.
/// Rank 0's stream is held busy by an AllReduce of a second communicator, with a large Broadcast
/// (root 0) of the tested communicator queued behind it. Rank 1 queues its Broadcast (its kernel
/// starts and publishes its output in the pointer exchange), then aborts: `abort()` returns, its
/// stream finishes, and rank 1 fills its output with a marker (it could as well free it). Then
/// rank 0's stream is released: its Broadcast kernel starts on an aborted communicator. Returns
/// how many bytes of rank 1's output differ from the marker once rank 0's stream is done, i.e.
/// what rank 0 wrote into rank 1's buffer after rank 1's abort had returned (all of it the root's
/// Broadcast data at its place).
fn bytes_written_after_receiver_abort(direct_disable: &str) -> usize {
    let y = init_ok(
        2,
        &[
            ("NCCL_PROTO", "Simple"),
            ("NCCL_P2P_DIRECT_DISABLE", direct_disable),
        ],
    );
    assert_eq!(y[0].direct_pointer(), direct_disable == "0");
    let x = init_ok(2, &[]);
    let (d0, d1) = (Device::Cpu(0), Device::Cpu(1));
    let (s0, s1, sx1) = (
        d0.new_stream().unwrap(),
        d1.new_stream().unwrap(),
        d1.new_stream().unwrap(),
    );
    let (xa0, xa1) = (d0.alloc(4096).unwrap(), d1.alloc(4096).unwrap());
    // Holds rank 0's stream until x[1] calls.
    x[0].all_reduce(&xa0, &xa0, 1024, DataType::I32, RedOp::Sum, &s0)
        .unwrap();
    let count = 8 << 20;
    let src = d0.alloc(count).unwrap();
    src.write(0, &hash_bytes(5, count)).unwrap();
    let dst0 = d0.alloc(count).unwrap();
    y[0].broadcast(Some(src.as_slice()), &dst0, count, DataType::U8, 0, &s0)
        .unwrap();
    let out1 = d1.alloc(count).unwrap();
    y[1].broadcast(None, &out1, count, DataType::U8, 0, &s1).unwrap();
    assert_eq!(y[1].last_choice().unwrap().proto, Proto::Simple);
    // Rank 1's kernel starts (publishing its output) and waits for data that cannot come yet.
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    y[1].abort().unwrap();
    s1.synchronize().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    // Rank 1 is done with the communicator: its output is its own again.
    out1.fill(0xEE).unwrap();
    // Release rank 0's stream.
    x[1].all_reduce(&xa1, &xa1, 1024, DataType::I32, RedOp::Sum, &sx1)
        .unwrap();
    sx1.synchronize().unwrap();
    let p = pending(s0);
    assert!(
        p.done_within(Duration::from_secs(10)).is_some(),
        "rank 0's stream did not finish"
    );
    let got = out1.to_vec().unwrap();
    let src = src.to_vec().unwrap();
    let changed = got.iter().filter(|&&b| b != 0xEE).count();
    // What landed is the Broadcast's data, at its place.
    let from_root = (0..count).filter(|&i| got[i] != 0xEE && got[i] == src[i]).count();
    assert_eq!(changed, from_root, "bytes that are not the root's data changed");
    changed
}

/// Control of the case below: through the FIFO (`NCCL_P2P_DIRECT_DISABLE=1`) rank 0's late
/// Broadcast writes only rank 1's connection memory, never its output after rank 1's abort.
#[test]
fn fifo_path_leaves_receiver_output_alone_after_its_abort() {
    let _dog = common::Watchdog::new(
        "fifo_path_leaves_receiver_output_alone_after_its_abort",
        Duration::from_secs(60),
    );
    assert_eq!(bytes_written_after_receiver_abort("1"), 0);
}

/// Guards against a fault of the first direct writes: a peer wrote into a rank's user buffer after
/// that rank's `Comm::abort()` returned and its stream finished. Rank 0's Broadcast kernel, started
/// on the aborted communicator (queued behind another communicator's call), found rank 1's
/// published output in the pointer exchange and FIFO credits free, so its spin loops never polled
/// the abort flag (`Simple::spin` checks it only while waiting) and it copied the first FIFO window
/// of data (several MiB) straight into rank 1's output — after a one-rank abort a use of freed
/// memory once rank 1 drops the buffer. Now the Simple kernel reads its abort flag before its first
/// direct write, and rank 1's abort waits (at most a second) for the group's other ranks.
#[test]
fn peer_never_writes_receiver_output_after_its_abort_returned() {
    let _dog = common::Watchdog::new(
        "peer_never_writes_receiver_output_after_its_abort_returned",
        Duration::from_secs(60),
    );
    let n = bytes_written_after_receiver_abort("0");
    assert_eq!(
        n, 0,
        "rank 0 wrote {n} bytes into rank 1's output after rank 1's abort() had returned and its stream had finished"
    );
}

/// A rank aborting in the middle of a large direct Broadcast (both ranks inside it, the root
/// copying straight into this rank's output): once its `abort()` has returned, the root's kernel
/// has stopped too — the output does not change any more — because the abort waits for the
/// group's other ranks, not only its own stream. Several tries at different moments.
#[test]
fn receiver_abort_mid_broadcast_waits_for_the_root() {
    let test = "receiver_abort_mid_broadcast_waits_for_the_root";
    let _dog = common::Watchdog::new(test, Duration::from_secs(120));
    // One channel with 32 MiB FIFO slots: the root copies a slice of up to 128 MiB between two
    // looks at its flag, long enough for the receiver's own kernel to see the abort first.
    let vars = [
        ("NCCL_PROTO", "Simple"),
        ("NCCL_MAX_NCHANNELS", "1"),
        ("NCCL_BUFFSIZE", "268435456"),
    ];
    let count = 192 << 20;
    let src_bytes = hash_bytes(11, count);
    let mut moved = 0usize;
    for (k, delay_us) in [2_000u64, 10_000, 30_000].into_iter().enumerate() {
        let y = init_ok(2, &vars);
        assert!(y[0].direct_pointer());
        let (d0, d1) = (Device::Cpu(0), Device::Cpu(1));
        let (s0, s1) = (d0.new_stream().unwrap(), d1.new_stream().unwrap());
        let src = d0.alloc(count).unwrap();
        src.write(0, &src_bytes).unwrap();
        let dst0 = d0.alloc(count).unwrap();
        let out1 = d1.alloc(count).unwrap();
        y[0].broadcast(Some(src.as_slice()), &dst0, count, DataType::U8, 0, &s0)
            .unwrap();
        y[1].broadcast(None, &out1, count, DataType::U8, 0, &s1).unwrap();
        std::thread::sleep(Duration::from_micros(delay_us));
        let t = Instant::now();
        y[1].abort().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "try {k}: abort took {:?}",
            t.elapsed()
        );
        s1.synchronize().unwrap();
        let before = out1.to_vec().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let after = out1.to_vec().unwrap();
        let late = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        assert_eq!(
            late, 0,
            "try {k} (abort after {delay_us} µs): {late} bytes of rank 1's output changed after its abort returned"
        );
        moved += after
            .iter()
            .zip(&src_bytes)
            .filter(|(a, b)| a == b && **a != 0)
            .count();
        let p = pending(s0);
        assert!(
            p.done_within(Duration::from_secs(10)).is_some(),
            "try {k}: rank 0's stream did not finish"
        );
    }
    // The tries did interrupt a Broadcast that was moving data (not all before it started).
    assert!(moved > 0, "no try saw any data arrive before the abort");
}

// ---------------------------------------------------------------------------------------------
// 5. NCCL_P2P_DIRECT_DISABLE.

/// A forced-Simple Broadcast, AllGather and AllReduce on 3 ranks at misaligned offsets, exact.
fn three_direct_collectives(comms: &[Comm], seed: u64) -> Vec<String> {
    let streams = streams(comms);
    let n = comms.len();
    let mut errs = Vec::new();
    for (k, in_place) in [false, true].into_iter().enumerate() {
        for c in [
            Call::new(Func::Broadcast, DataType::I32, 100_003, offsets(n, k)).root(2),
            Call::new(Func::AllGather, DataType::Bf16, 65_541, offsets(n, k + 1)),
            Call::new(Func::AllReduce, DataType::F32, 131_075, offsets(n, k + 2)),
        ] {
            errs.extend(run(
                comms,
                &streams,
                &c.in_place(in_place).seed(seed + k as u64),
                Some(Proto::Simple),
            ));
        }
    }
    errs
}

/// `NCCL_P2P_DIRECT_DISABLE`: `1` (also ` 1 `) turns direct writes off (`direct_pointer()` false
/// on every rank, the FIFO path exact), `0` keeps them on; `2`, `-1`, `yes` and `true` fail init
/// with InvalidArgument naming the variable, its value and the accepted range `0..=1`; the
/// `OXCCL_` spelling wins over the `NCCL_` one both ways (and a bad `NCCL_` value then does not
/// matter, a bad `OXCCL_` one is named).
#[test]
fn p2p_direct_disable_values() {
    let test = "p2p_direct_disable_values";
    let _dog = common::Watchdog::new(test, Duration::from_secs(60));
    let s = [("NCCL_PROTO", "Simple")];
    let with = |v: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        s.iter().chain(v).copied().collect()
    };
    let mut errs = Vec::new();
    for (vars, want) in [
        (vec![], true),
        (vec![("NCCL_P2P_DIRECT_DISABLE", "0")], true),
        (vec![("NCCL_P2P_DIRECT_DISABLE", "1")], false),
        (vec![("NCCL_P2P_DIRECT_DISABLE", " 1 ")], false),
        (
            vec![
                ("NCCL_P2P_DIRECT_DISABLE", "1"),
                ("OXCCL_P2P_DIRECT_DISABLE", "0"),
            ],
            true,
        ),
        (
            vec![
                ("NCCL_P2P_DIRECT_DISABLE", "0"),
                ("OXCCL_P2P_DIRECT_DISABLE", "1"),
            ],
            false,
        ),
        (
            vec![
                ("NCCL_P2P_DIRECT_DISABLE", "yes"),
                ("OXCCL_P2P_DIRECT_DISABLE", "1"),
            ],
            false,
        ),
    ] {
        let comms = init_ok(3, &with(&vars));
        for c in &comms {
            assert_eq!(c.direct_pointer(), want, "{vars:?}: rank {}", c.rank());
        }
        errs.extend(
            three_direct_collectives(&comms, 40)
                .into_iter()
                .map(|e| format!("{vars:?}: {e}")),
        );
    }
    for (key, val, other) in [
        ("NCCL_P2P_DIRECT_DISABLE", "2", None),
        ("NCCL_P2P_DIRECT_DISABLE", "-1", None),
        ("NCCL_P2P_DIRECT_DISABLE", "yes", None),
        ("NCCL_P2P_DIRECT_DISABLE", "true", None),
        (
            "OXCCL_P2P_DIRECT_DISABLE",
            "2",
            Some(("NCCL_P2P_DIRECT_DISABLE", "0")),
        ),
    ] {
        let mut vars = with(&[(key, val)]);
        vars.extend(other);
        match init(3, &vars) {
            Err(e @ Error::InvalidArgument(_)) => {
                let m = e.to_string();
                assert!(
                    m.contains(key) && m.contains(val.trim()) && m.contains("0..=1"),
                    "{key}={val}: the error does not name the variable, value and range: {m}"
                );
            }
            Err(e) => panic!("{key}={val}: wrong error kind: {e:?}"),
            Ok(_) => panic!("{key}={val}: init accepted it"),
        }
    }
    assert_no_errors(test, &errs);
}

// ---------------------------------------------------------------------------------------------
// 6. One rank, init_rank.

/// One rank (`init_all` of one CPU device): `direct_pointer()` is false (also with
/// `NCCL_P2P_DIRECT_DISABLE=0`), `choice_for` plans nothing, and all five collectives are exact
/// copies in and out of place at odd offsets, guards intact.
#[test]
fn one_rank_has_no_direct_pointer() {
    let test = "one_rank_has_no_direct_pointer";
    let _dog = common::Watchdog::new(test, Duration::from_secs(60));
    let mut errs = Vec::new();
    for vars in [
        vec![],
        vec![("NCCL_P2P_DIRECT_DISABLE", "0"), ("NCCL_PROTO", "Simple")],
    ] {
        let comms = init_ok(1, &vars);
        assert!(!comms[0].direct_pointer(), "{vars:?}");
        assert_eq!(
            comms[0]
                .choice_for(Func::Broadcast, 1 << 20, DataType::U8)
                .unwrap(),
            None
        );
        let streams = streams(&comms);
        for (k, func) in FUNCS.into_iter().enumerate() {
            for in_place in [false, true] {
                for count in [1usize, 4097, (1 << 20) + 5] {
                    let c = Call::new(func, DataType::I32, count, vec![[1, 3, 0][k % 3]])
                        .in_place(in_place)
                        .seed(k as u64);
                    let p = prepare(&comms, &c);
                    errs.extend(issue(&comms, &streams, &p, None, None));
                    sync_all(&streams, &p.what);
                    errs.extend(verify(&p));
                }
            }
        }
    }
    assert_no_errors(test, &errs);
}

/// `Comm::init_rank` (2 ranks as threads of this process, connected through /dev/shm): no direct
/// pointer (its ranks map each other's connection memory, not each other's user buffers), and a
/// forced-Simple Broadcast, AllGather and AllReduce stay exact.
#[test]
fn init_rank_has_no_direct_pointer() {
    let test = "init_rank_has_no_direct_pointer";
    let _dog = common::Watchdog::new(test, Duration::from_secs(60));
    let n = 2;
    let mut comms: Vec<Comm> = {
        let env = Env::clean(VARS);
        env.set(&[("NCCL_PROTO", "Simple"), ("NCCL_P2P_DIRECT_DISABLE", "0")]);
        let id = oxccl::bootstrap::get_unique_id().unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| s.spawn(move || Comm::init_rank(n, &id, r, Device::Cpu(r)).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    comms.sort_by_key(|c| c.rank());
    for c in &comms {
        assert!(!c.direct_pointer(), "rank {}", c.rank());
    }
    let streams = streams(&comms);
    let mut errs = Vec::new();
    for (k, c) in [
        Call::new(Func::Broadcast, DataType::I32, 100_003, offsets(n, 0)).root(1),
        Call::new(Func::AllGather, DataType::U8, 65_541, offsets(n, 1)).in_place(true),
        Call::new(Func::AllReduce, DataType::F32, 131_075, offsets(n, 2)),
    ]
    .into_iter()
    .enumerate()
    {
        errs.extend(run(&comms, &streams, &c.seed(k as u64), Some(Proto::Simple)));
    }
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || c.destroy().unwrap());
        }
    });
    assert_no_errors(test, &errs);
}
