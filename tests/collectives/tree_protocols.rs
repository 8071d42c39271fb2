//! Tree AllReduce on the LL and LL128 protocols (`LlFan` / `Ll128Fan` fans of 3/1 and 1/3 peers,
//! tree connections with LL and LL128 FIFOs, tree LL/LL128 chunking in `plan()`, the model letting
//! them compete), CPU target only:
//! 1. odd, tiny and large counts for int8/half/float/double/bfloat16 × every operator, in place
//!    and out of place, at aligned and misaligned buffer offsets, with guard bytes;
//! 2. the smallest accepted LL / LL128 FIFOs (many steps per chunk), and FIFOs of an odd number of
//!    lines per step (a chunk that is not a whole number of 16-byte packs);
//! 3. channel counts 1, 2, 3, 5, 8 on 2..8 ranks split into 2..8 test nodes, chains included;
//! 4. tree LL, tree LL128, tree Simple and ring calls interleaved on the same communicator, back
//!    to back without synchronizing in between;
//! 5. connection steps starting just below the LL flag period and 2^32 on trees whose protocol
//!    changes from call to call;
//! 6. abort of a tree LL/LL128 call that waits for the tree's root.
//!
//! Inputs are small integers chosen per operator so that every reduction is exact in any order
//! (see [`value`]); every rank's output must equal the expected bytes bit for bit (so the ranks
//! agree bitwise too). The environment is process-global: every test stages its variables
//! (`common::env::Staged`), set only while the helpers create its communicators; each test also
//! runs under a stall watchdog.
use crate::common;

use common::env::Staged;
use half::{bf16, f16};
use oxccl::graph::{Pattern, Tree, double_binary_tree};
use oxccl::{Algo, Choice, Comm, DataType, Device, DeviceBuffer, Func, Proto, RedOp, Stream};
use std::time::{Duration, Instant};

/// Variables these tests set (all cleared while a test runs, restored after).
const VARS: &[&str] = &[
    "ALGO",
    "PROTO",
    "TEST_NODES",
    "MIN_NCHANNELS",
    "MAX_NCHANNELS",
    "LL_BUFFSIZE",
    "LL128_BUFFSIZE",
    "BUFFSIZE",
    "TEST_INITIAL_STEP",
];

/// The dtypes of the brief: 1-, 2-, 4- and 8-byte elements, integer and float.
const DTYPES: [DataType; 5] = [
    DataType::I8,
    DataType::F16,
    DataType::F32,
    DataType::F64,
    DataType::Bf16,
];

/// Guard bytes before and after the data of every buffer.
const GUARD: usize = 64;

// ---------------------------------------------------------------------------------------------
// Inputs and expected values.

/// Rank `r`'s element `i` (of `n` ranks) for `op`, a small integer so every reduction is exact in
/// any order and association, for every dtype:
/// - Sum (and integer Avg): `(7i + 3r) mod 9 − 4` in [-4, 4]: |sum| ≤ 32 over 8 ranks, exact in
///   bfloat16 (integers to 256) and in int8;
/// - Prod: one of {1, −1, 2, 1, −2, 1, 1}: |product| ≤ 2^8, a power of two, exact in every float
///   type (int8 wraps, and wrapping multiplication is associative and commutative);
/// - Max / Min: `(13i + 29r) mod 17 − 8` in [-8, 8];
/// - float Avg: `w_i + d_r` with `w_i = i mod 11 − 5` and `d_r` = +1 for even r, −1 for odd r
///   (0 for the last rank of an odd count), so the sum is exactly `n·w_i` and the average `w_i`.
fn value(dtype: DataType, op: RedOp, n: usize, r: usize, i: usize) -> i64 {
    let (i, r64) = (i as i64, r as i64);
    match op {
        RedOp::Sum => (7 * i + 3 * r64) % 9 - 4,
        RedOp::Avg if !dtype.is_float() => (7 * i + 3 * r64) % 9 - 4,
        RedOp::Prod => [1, -1, 2, 1, -2, 1, 1][((5 * i + 3 * r64) % 7) as usize],
        RedOp::Max | RedOp::Min => (13 * i + 29 * r64) % 17 - 8,
        RedOp::Avg => {
            let d = if n % 2 == 1 && r == n - 1 {
                0
            } else if r % 2 == 0 {
                1
            } else {
                -1
            };
            i % 11 - 5 + d
        }
    }
}

/// The bytes of `v` (a small integer) as one element of `dtype`.
fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    match dtype {
        DataType::I8 => vec![v as i64 as i8 as u8],
        DataType::U8 => vec![v as i64 as u8],
        DataType::I32 => (v as i64 as i32).to_le_bytes().to_vec(),
        DataType::U32 => (v as i64 as u32).to_le_bytes().to_vec(),
        DataType::I64 => (v as i64).to_le_bytes().to_vec(),
        DataType::U64 => (v as i64 as u64).to_le_bytes().to_vec(),
        DataType::F16 => f16::from_f64(v).to_bits().to_le_bytes().to_vec(),
        DataType::Bf16 => bf16::from_f64(v).to_bits().to_le_bytes().to_vec(),
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F64 => v.to_le_bytes().to_vec(),
        DataType::F8E4M3 => vec![oxccl::F8E4M3::from_f64(v).0],
        DataType::F8E5M2 => vec![oxccl::F8E5M2::from_f64(v).0],
    }
}

/// Rank `r`'s input of `count` elements.
fn input(dtype: DataType, op: RedOp, n: usize, r: usize, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|i| encode(dtype, value(dtype, op, n, r, i) as f64))
        .collect()
}

/// The expected AllReduce output: the reduction over ranks of [`value`]. int8 folds in i8 with
/// wrapping (Sum, Prod) and Avg divides the wrapped sum by n truncating toward zero (the kernel's
/// `wrapping_div`); floats fold exactly in f64 (the values are small integers) and are rounded to
/// `dtype` once (every result is representable, so the rounding is exact).
fn expected(dtype: DataType, op: RedOp, n: usize, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|i| {
            let vals: Vec<i64> = (0..n).map(|r| value(dtype, op, n, r, i)).collect();
            if dtype.is_float() {
                let v: Vec<f64> = vals.iter().map(|&x| x as f64).collect();
                let out = match op {
                    RedOp::Sum => v.iter().sum(),
                    RedOp::Prod => v.iter().product(),
                    RedOp::Max => v.iter().copied().fold(f64::MIN, f64::max),
                    RedOp::Min => v.iter().copied().fold(f64::MAX, f64::min),
                    RedOp::Avg => v.iter().sum::<f64>() / n as f64,
                };
                encode(dtype, out)
            } else {
                assert_eq!(dtype, DataType::I8, "integer expectations are written for int8");
                let v: Vec<i8> = vals.iter().map(|&x| x as i8).collect();
                let out = match op {
                    RedOp::Sum => v.iter().fold(0i8, |a, &b| a.wrapping_add(b)),
                    RedOp::Prod => v.iter().fold(1i8, |a, &b| a.wrapping_mul(b)),
                    RedOp::Max => *v.iter().max().unwrap(),
                    RedOp::Min => *v.iter().min().unwrap(),
                    RedOp::Avg => v
                        .iter()
                        .fold(0i8, |a, &b| a.wrapping_add(b))
                        .wrapping_div(n as i8),
                };
                vec![out as u8]
            }
        })
        .collect()
}

/// A position-dependent guard pattern (a shifted copy or a memset is caught).
fn guard(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(151).wrapping_add(salt.wrapping_mul(37)) ^ 0x5C)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Running AllReduces.

/// Communicators of one configuration with a stream per rank.
struct Ranks {
    comms: Vec<Comm>,
    streams: Vec<Stream>,
}

impl Ranks {
    fn new(n: usize) -> Ranks {
        let comms = common::init_all(&Device::cpus(n)).expect("init_all");
        let streams = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
        Ranks { comms, streams }
    }
    fn n(&self) -> usize {
        self.comms.len()
    }
    fn sync(&self) {
        for s in &self.streams {
            s.synchronize().expect("synchronize");
        }
    }
}

/// One queued AllReduce: its buffers (kept alive until checked) and what must come out.
struct Pending {
    what: String,
    dtype: DataType,
    op: RedOp,
    count: usize,
    in_place: bool,
    /// Byte offset of the data inside each buffer (after the guard).
    at: usize,
    sends: Vec<DeviceBuffer>,
    recvs: Vec<DeviceBuffer>,
    /// Rank 0's plan (`None` for count 0, which runs nothing).
    choice: Option<Choice>,
}

/// Queues an AllReduce of `count` elements on every rank (data at `GUARD + skew × esize` bytes, so
/// `skew` misaligns it), without synchronizing; asserts that every rank planned the same thing
/// and, with `want`, that it is that algorithm and protocol.
fn queue(
    rk: &Ranks,
    what: &str,
    dtype: DataType,
    op: RedOp,
    count: usize,
    in_place: bool,
    skew: usize,
    want: Option<(Algo, Proto)>,
) -> Pending {
    let n = rk.n();
    let esize = dtype.size();
    let at = GUARD + skew * esize;
    let bytes = count * esize;
    let total = at + bytes + GUARD;
    let what = format!("{what}: {dtype} {op} count {count} in_place {in_place} skew {skew}");
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for (r, c) in rk.comms.iter().enumerate() {
        let s = c.device().alloc(total).unwrap();
        let mut img = guard(total, r as u8);
        img[at..at + bytes].copy_from_slice(&input(dtype, op, n, r, count));
        s.write(0, &img).unwrap();
        let o = c.device().alloc(total).unwrap();
        let mut img = guard(total, 100 + r as u8);
        img[at..at + bytes].fill(0xFF); // poison: NaN in every float type, -1 in int8
        o.write(0, &img).unwrap();
        sends.push(s);
        recvs.push(o);
    }
    let mut choices = Vec::new();
    for (r, c) in rk.comms.iter().enumerate() {
        let s = sends[r].slice(at, bytes).unwrap();
        let o = if in_place {
            s
        } else {
            recvs[r].slice(at, bytes).unwrap()
        };
        let planned = c.choice_for(Func::AllReduce, count, dtype).unwrap();
        c.all_reduce(s, o, count, dtype, op, &rk.streams[r])
            .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        let last = c.last_choice();
        if count > 0 {
            assert_eq!(planned, last, "{what}: rank {r}: choice_for vs last_choice");
        }
        choices.push(last);
    }
    let choice = (count > 0).then(|| choices[0].unwrap_or_else(|| panic!("{what}: no plan recorded")));
    if let Some(choice) = choice {
        for (r, c) in choices.iter().enumerate() {
            assert_eq!(c.as_ref(), Some(&choice), "{what}: rank {r} planned differently");
        }
        if let Some((algo, proto)) = want {
            assert_eq!((choice.algo, choice.proto), (algo, proto), "{what}: {choice:?}");
        }
    }
    Pending {
        what,
        dtype,
        op,
        count,
        in_place,
        at,
        sends,
        recvs,
        choice,
    }
}

/// Checks a queued AllReduce once the streams are synchronized: every rank's output is exactly
/// [`expected`], the guards are intact, and an out-of-place send buffer is unchanged.
fn check(rk: &Ranks, p: &Pending) {
    let n = rk.n();
    let bytes = p.count * p.dtype.size();
    let want = expected(p.dtype, p.op, n, p.count);
    for r in 0..n {
        let total = p.at + bytes + GUARD;
        let send = p.sends[r].to_vec().unwrap();
        let out = if p.in_place {
            send.clone()
        } else {
            p.recvs[r].to_vec().unwrap()
        };
        let got = &out[p.at..p.at + bytes];
        if got != want.as_slice() {
            let esize = p.dtype.size();
            let k = (0..p.count)
                .find(|&k| got[k * esize..(k + 1) * esize] != want[k * esize..(k + 1) * esize])
                .unwrap();
            let wrong = (0..p.count)
                .filter(|&k| got[k * esize..(k + 1) * esize] != want[k * esize..(k + 1) * esize])
                .count();
            panic!(
                "{} ({:?}): rank {r}: {wrong} wrong elements, first {k}: got {}, want {}",
                p.what,
                p.choice,
                oxccl::perf::check::format_elem(p.dtype, &got[k * esize..]),
                oxccl::perf::check::format_elem(p.dtype, &want[k * esize..]),
            );
        }
        let salt = if p.in_place { r as u8 } else { 100 + r as u8 };
        let g = guard(total, salt);
        assert!(
            out[..p.at] == g[..p.at] && out[p.at + bytes..] == g[p.at + bytes..],
            "{}: rank {r}: guard bytes of the output changed",
            p.what
        );
        if !p.in_place {
            let mut img = guard(total, r as u8);
            img[p.at..p.at + bytes].copy_from_slice(&input(p.dtype, p.op, n, r, p.count));
            assert!(send == img, "{}: rank {r}: the send buffer changed", p.what);
        }
    }
}

/// Queues, synchronizes and checks one AllReduce; returns its plan (`None` for count 0).
fn run(
    rk: &Ranks,
    what: &str,
    dtype: DataType,
    op: RedOp,
    count: usize,
    in_place: bool,
    skew: usize,
    want: Option<(Algo, Proto)>,
) -> Option<Choice> {
    let p = queue(rk, what, dtype, op, count, in_place, skew, want);
    rk.sync();
    check(rk, &p);
    p.choice
}

/// Sets the tree environment: `NCCL_ALGO=tree`, `NCCL_PROTO=proto` (unless `None`), `nodes` test
/// nodes, `nch` channels (min = max) unless 0, plus `extra`.
fn tree_env(env: &Staged, proto: Option<&str>, nodes: usize, nch: u32, extra: &[(&str, &str)]) {
    let (nodes, ch) = (nodes.to_string(), nch.to_string());
    let mut vars = vec![("NCCL_ALGO", "tree"), ("OXCCL_TEST_NODES", nodes.as_str())];
    if let Some(p) = proto {
        vars.push(("NCCL_PROTO", p));
    }
    if nch > 0 {
        vars.push(("NCCL_MIN_NCHANNELS", ch.as_str()));
        vars.push(("NCCL_MAX_NCHANNELS", ch.as_str()));
    }
    vars.extend_from_slice(extra);
    env.set(&vars);
}

fn proto_of(name: &str) -> Proto {
    Proto::ALL.iter().copied().find(|p| p.name() == name).unwrap()
}

fn watchdog(test: &str) -> common::Watchdog {
    common::Watchdog::new(test, Duration::from_secs(60))
}

// ---------------------------------------------------------------------------------------------
// 1. Counts × dtypes × operators.

/// Counts around one and two packs (15, 16, 17 int8 / 7, 8, 9 half...), around one LL128 line of
/// int8 (119, 120, 121), around a power of two, and below one element per rank.
const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 15, 16, 17, 119, 120, 121, 1023];

#[test]
fn every_dtype_op_and_odd_count() {
    let env = Staged::clean(VARS);
    let wd = watchdog("every_dtype_op_and_odd_count");
    // 4 ranks as 2 nodes of 2, 2 channels: each tree has a root with two children (its chain's
    // second rank and the other node's head) and a chain of depth 2 below the other head.
    for proto in ["LL", "LL128"] {
        tree_env(&env, Some(proto), 2, 2, &[]);
        let rk = Ranks::new(4);
        let want = Some((Algo::Tree, proto_of(proto)));
        for &dtype in &DTYPES {
            for &op in RedOp::ALL {
                for &count in COUNTS {
                    for in_place in [false, true] {
                        // Misaligned by one element on odd counts (the LL/LL128 partial loads
                        // and stores take their element-sized path).
                        let skew = count % 2;
                        wd.step(format!("{proto} {dtype} {op} {count} {in_place}"));
                        run(&rk, proto, dtype, op, count, in_place, skew, want);
                    }
                }
            }
        }
        // Large odd counts: several chunks per channel for every element size (LL: 32 KiB of
        // data per step, LL128: 120 KiB), the last one partial.
        for (dtype, op, count) in [
            (DataType::F32, RedOp::Sum, 65539),
            (DataType::I8, RedOp::Max, 65539),
            (DataType::F16, RedOp::Avg, 65539),
            (DataType::Bf16, RedOp::Prod, 65539),
            (DataType::F64, RedOp::Min, 65539),
            (DataType::F32, RedOp::Avg, (1 << 20) + 3),
            (DataType::I8, RedOp::Sum, (1 << 20) + 3),
        ] {
            for in_place in [false, true] {
                wd.step(format!("{proto} {dtype} {op} {count} {in_place}"));
                run(&rk, proto, dtype, op, count, in_place, 1, want);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Small FIFOs.

#[test]
fn smallest_fifos_one_step_per_chunk() {
    let env = Staged::clean(VARS);
    let wd = watchdog("smallest_fifos_one_step_per_chunk");
    // The smallest accepted sizes (host/params.rs): NCCL_LL_BUFFSIZE ≥ 64 × FIFO_STEPS × 16 =
    // 8192 bytes (8 slots of 64 lines: 512 data bytes per step), NCCL_LL128_BUFFSIZE ≥ 8 ×
    // FIFO_STEPS × 128 = 8192 bytes (8 slots of 8 lines: 960 data bytes per step). One chunk is
    // one step, so 65539 floats make 512 (LL) / 274 (LL128) chunks over 3 channels; 6 ranks as
    // 3 nodes of 2 give trees of depth 3 (node chains under inter-node parents).
    let small = [("NCCL_LL_BUFFSIZE", "8192"), ("NCCL_LL128_BUFFSIZE", "8192")];
    for (proto, chunk_bytes) in [("LL", 512u64), ("LL128", 960)] {
        tree_env(&env, Some(proto), 3, 3, &small);
        let rk = Ranks::new(6);
        let want = Some((Algo::Tree, proto_of(proto)));
        for (dtype, op) in [
            (DataType::F32, RedOp::Sum),
            (DataType::I8, RedOp::Sum),
            (DataType::F64, RedOp::Max),
            (DataType::F16, RedOp::Avg),
        ] {
            for count in [1, 63, 64, 65, 120, 255, 256, 257, 4099, 65539] {
                for in_place in [false, true] {
                    wd.step(format!("{proto} {dtype} {op} {count} {in_place}"));
                    let c = run(&rk, proto, dtype, op, count, in_place, 0, want).unwrap();
                    assert_eq!(
                        c.chunk_elems,
                        chunk_bytes / dtype.size() as u64,
                        "{proto} {dtype}: one step of data per chunk"
                    );
                }
            }
        }
    }
}

/// Guards against overlapping chunks: a FIFO of an odd number of lines per step (accepted:
/// `NCCL_LL_BUFFSIZE` is any multiple of FIFO_STEPS × 16 = 128 bytes from 8192;
/// `NCCL_LL128_BUFFSIZE` any multiple of 1024 from 8192) gave a chunk that is no whole number of
/// 16-byte packs: LL 8320 bytes = 65 lines × 8 data bytes = 520 bytes = 130 floats per chunk; LL128
/// 9216 bytes = 9 lines × 120 = 1080 bytes = 270 floats. The grid loops (`TreeCtx::chunk`,
/// `channel_chunks`, the ring AllReduce) rounded each channel's chunk UP to whole packs (132 / 272
/// floats) but advance by `nchannels × chunk_elems`, so consecutive chunks overlapped and the
/// overlapping elements were reduced twice; in place the second pass read inputs that the first had
/// already overwritten. Observed before the fix (2 ranks, 1 channel, in-place float Sum of 2000
/// elements, rank r's element i = (7i + 3r) mod 9 − 4): tree LL 26 wrong (element 131: got 0, want
/// 2), ring LL 26 wrong, tree LL128 14 wrong, ring LL128 9 wrong.
///
/// Fixed twice over: `plan()` makes LL/LL128 chunks whole packs (128 / 268 floats here), and the
/// loops never let a rounded chunk exceed `chunk_elems` (`coll::loop_chunk`).
#[test]
fn odd_line_fifo_in_place_is_exact_on_tree_and_ring() {
    let env = Staged::clean(VARS);
    let wd = watchdog("odd_line_fifo_in_place_is_exact_on_tree_and_ring");
    let mut faults = Vec::new();
    for (proto, var, size) in [
        ("LL", "NCCL_LL_BUFFSIZE", "8320"),
        ("LL128", "NCCL_LL128_BUFFSIZE", "9216"),
    ] {
        // The tree (2 nodes of 1 rank) and the ring, one channel.
        for tree in [true, false] {
            if tree {
                tree_env(&env, Some(proto), 2, 1, &[(var, size)]);
            } else {
                env.set(&[
                    ("NCCL_ALGO", "ring"),
                    ("NCCL_PROTO", proto),
                    ("NCCL_MIN_NCHANNELS", "1"),
                    ("NCCL_MAX_NCHANNELS", "1"),
                    (var, size),
                ]);
            }
            let rk = Ranks::new(2);
            let algo = if tree { Algo::Tree } else { Algo::Ring };
            wd.step(format!("{proto} tree {tree}"));
            let what = format!("{} {proto} {var}={size}", algo.name());
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(
                    &rk,
                    &what,
                    DataType::F32,
                    RedOp::Sum,
                    2000,
                    true,
                    0,
                    Some((algo, proto_of(proto))),
                )
            }));
            if let Err(e) = got {
                let m = e
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "(panic)".into());
                faults.push(m);
            }
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

#[test]
fn odd_line_fifo_out_of_place_is_exact() {
    let env = Staged::clean(VARS);
    let wd = watchdog("odd_line_fifo_out_of_place_is_exact");
    // The FIFOs of the fault above (65 LL lines, 9 LL128 lines per step), out of place, where the
    // overlapping chunks recompute the same values: exact on the tree over 4 ranks in 2 nodes,
    // 1 and 3 channels, for 1-, 2-, 4- and 8-byte elements.
    for (proto, var, size) in [
        ("LL", "NCCL_LL_BUFFSIZE", "8320"),
        ("LL128", "NCCL_LL128_BUFFSIZE", "9216"),
    ] {
        for nch in [1, 3] {
            tree_env(&env, Some(proto), 2, nch, &[(var, size)]);
            let rk = Ranks::new(4);
            for (dtype, op) in [
                (DataType::F32, RedOp::Sum),
                (DataType::I8, RedOp::Sum),
                (DataType::F16, RedOp::Max),
                (DataType::F64, RedOp::Avg),
            ] {
                for count in [2000, 4099] {
                    wd.step(format!("{proto} {nch} {dtype} {count}"));
                    let what = format!("{var}={size}, {nch} channels");
                    let want = Some((Algo::Tree, proto_of(proto)));
                    run(&rk, &what, dtype, op, count, false, 1, want);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Channel counts and node shapes.

/// Most children of any rank in either tree for `nranks` ranks in `nnodes` test nodes of
/// consecutive ranks (the balanced-tree attachment `OXCCL_TEST_NODES` uses).
fn max_arity(nranks: usize, nnodes: usize) -> usize {
    let k = nranks / nnodes;
    let chains: Vec<Vec<usize>> = (0..nnodes).map(|n| (n * k..(n + 1) * k).collect()).collect();
    let trees = double_binary_tree(&chains, Pattern::BalancedTree).unwrap();
    trees
        .iter()
        .flat_map(|t| t.iter().map(|x: &Tree| x.children().count()))
        .max()
        .unwrap()
}

#[test]
fn channel_counts_and_node_shapes() {
    let env = Staged::clean(VARS);
    let wd = watchdog("channel_counts_and_node_shapes");
    // (ranks, nodes): one rank per node (binary trees only), chains of 2, 3 and 4 ranks.
    // (ranks, nodes, most children of any rank): one rank per node (binary trees only), chains of
    // 2, 3 and 4 ranks. With the balanced-tree attachment no rank has more than 2 children: a
    // chain's first rank takes the chain's next rank and child node 1, its second rank child
    // node 0 (NCCL's BALANCED_TREE); a one-rank node takes both child nodes. 2 nodes: the root
    // node has one child node; 3 nodes: btree 0 → 2 → 1 and its shift are chains, so 1. The
    // fan's third receive peer (MAX_TREE_ARITY = 3) is therefore never used by `init_all` trees.
    let shapes = [
        (2, 2, 1),
        (3, 3, 1),
        (4, 2, 2),
        (4, 4, 2),
        (5, 5, 2),
        (6, 2, 2),
        (6, 3, 2),
        (6, 6, 2),
        (8, 2, 2),
        (8, 4, 2),
        (8, 8, 2),
    ];
    for &(n, nodes, arity) in &shapes {
        assert_eq!(max_arity(n, nodes), arity, "{n} ranks in {nodes} nodes");
    }
    // Small FIFOs so that a few thousand elements make several chunks on every channel:
    // NCCL_LL_BUFFSIZE=16384 is 128 lines (1024 data bytes, 256 floats) per step,
    // NCCL_LL128_BUFFSIZE=16384 is 16 lines (1920 data bytes, 480 floats) per step.
    let small = [("NCCL_LL_BUFFSIZE", "16384"), ("NCCL_LL128_BUFFSIZE", "16384")];
    for &(n, nodes, _) in &shapes {
        for nch in [1u32, 2, 3, 5, 8] {
            for proto in ["LL", "LL128"] {
                tree_env(&env, Some(proto), nodes, nch, &small);
                let rk = Ranks::new(n);
                let want = Some((Algo::Tree, proto_of(proto)));
                // Fewer elements than channels (idle channels), about one pack per channel, and
                // 7717 floats: over 8 channels × 480 floats, so 2+ chunks on every channel.
                for (k, count) in [1usize, 5, 37, 8 * 4 * 3 + 1, 7717].into_iter().enumerate() {
                    let dtype = [
                        DataType::F32,
                        DataType::I8,
                        DataType::Bf16,
                        DataType::F64,
                        DataType::F32,
                    ][k];
                    let op = [RedOp::Sum, RedOp::Max, RedOp::Prod, RedOp::Avg, RedOp::Sum][k];
                    let in_place = k % 2 == 1;
                    wd.step(format!("{n}/{nodes} nch {nch} {proto} {count}"));
                    let c = run(
                        &rk,
                        &format!("{n} ranks in {nodes} nodes, {nch} channels, {proto}"),
                        dtype,
                        op,
                        count,
                        in_place,
                        0,
                        want,
                    )
                    .unwrap();
                    assert_eq!(c.nchannels, nch, "{n}/{nodes} {proto} count {count}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Protocols and algorithms interleaved on one communicator.

/// For each wanted (algo, proto), the smallest float count in a doubling scan from 1 to 2^24 that
/// the communicator plans that way (`Comm::choice_for`).
fn counts_for(c: &Comm, wanted: &[(Algo, Proto)]) -> Vec<Option<usize>> {
    wanted
        .iter()
        .map(|&w| {
            (0..=24)
                .flat_map(|b| [1usize << b, (1 << b) + (1 << b) / 2 + 1])
                .find(|&count| {
                    let ch = c
                        .choice_for(Func::AllReduce, count, DataType::F32)
                        .unwrap()
                        .unwrap();
                    (ch.algo, ch.proto) == w
                })
        })
        .collect()
}

#[test]
fn tree_and_ring_protocols_interleave_back_to_back() {
    let env = Staged::clean(VARS);
    let wd = watchdog("tree_and_ring_protocols_interleave_back_to_back");
    // 8 ranks in 4 nodes of 2. With NCCL_ALGO=tree the model picks among tree LL, LL128 and
    // Simple by size; with nothing forced, among the ring and the tree. Each communicator runs its
    // sizes in rounds, every call queued right after the previous one on the same streams (no
    // synchronization until the round's end), so each tree connection carries steps of several
    // protocols in a row.
    let all = [
        (Algo::Tree, Proto::Ll),
        (Algo::Tree, Proto::Ll128),
        (Algo::Tree, Proto::Simple),
        (Algo::Ring, Proto::Ll),
        (Algo::Ring, Proto::Ll128),
        (Algo::Ring, Proto::Simple),
    ];
    for force_tree in [true, false] {
        if force_tree {
            tree_env(&env, None, 4, 0, &[]);
        } else {
            env.set(&[("OXCCL_TEST_NODES", "4")]);
        }
        let rk = Ranks::new(8);
        let found = counts_for(&rk.comms[0], &all);
        let plan: Vec<((Algo, Proto), usize)> = all
            .iter()
            .zip(&found)
            .filter_map(|(&w, c)| c.map(|c| (w, c)))
            .collect();
        let kinds: Vec<_> = plan.iter().map(|p| p.0).collect();
        if force_tree {
            // Every tree protocol is reachable by size alone (NCCL_PROTO unset).
            assert_eq!(
                kinds,
                vec![
                    (Algo::Tree, Proto::Ll),
                    (Algo::Tree, Proto::Ll128),
                    (Algo::Tree, Proto::Simple)
                ],
                "NCCL_ALGO=tree: {plan:?}"
            );
        } else {
            assert!(
                kinds.contains(&(Algo::Tree, Proto::Ll)) && kinds.contains(&(Algo::Ring, Proto::Simple)),
                "unforced: {plan:?}"
            );
        }
        for round in 0..3 {
            let mut pending = Vec::new();
            // Forward, then backward: each protocol follows every other one on the same streams.
            let order: Vec<_> = if round % 2 == 0 {
                plan.clone()
            } else {
                plan.iter().rev().cloned().collect()
            };
            for (k, &(w, count)) in order.iter().enumerate() {
                // The odd variants of each size (count + 3) plan the same way or nearby; only the
                // exact scan sizes are asserted.
                let (dtype, op) = [(DataType::F32, RedOp::Sum), (DataType::F32, RedOp::Max)][k % 2];
                let in_place = (round + k) % 2 == 0;
                wd.step(format!("tree {force_tree} round {round} {w:?} {count}"));
                pending.push(queue(
                    &rk,
                    &format!("force_tree {force_tree} round {round}"),
                    dtype,
                    op,
                    count,
                    in_place,
                    k % 2,
                    Some(w),
                ));
            }
            rk.sync();
            for p in &pending {
                check(&rk, p);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 5. LL flag wrap on trees with changing protocols.

#[test]
fn ll_flag_wrap_with_changing_protocols() {
    let env = Staged::clean(VARS);
    let wd = watchdog("ll_flag_wrap_with_changing_protocols");
    // Connections start a few steps below the LL flag period (2^31 − 1: flags wrap to 1 and the
    // last 8 steps of the period clean their slots), below 2^32 and below the second period.
    // Counts cycle through 1 element (one LL step on channel 0 only, the other channels idle, so
    // channels' steps diverge), mid sizes that the model puts on tree LL128 or Simple (their
    // steps advance the same connections' counters past the LL cleaning steps) and sizes of
    // several LL steps per channel. 6 ranks in 3 nodes of 2, 3 channels.
    let wrap = (1u64 << 31) - 1;
    for start in [wrap - 5, (1u64 << 32) - 5, 2 * wrap - 3] {
        for proto in [Some("LL"), None] {
            let s = start.to_string();
            tree_env(&env, proto, 3, 3, &[("OXCCL_TEST_INITIAL_STEP", s.as_str())]);
            let rk = Ranks::new(6);
            let mut seen = Vec::new();
            for it in 0..60usize {
                let count = [1usize, 3, 4099, 300, 70001, 2, 20000][it % 7];
                let dtype = [DataType::F32, DataType::I8, DataType::F16][it % 3];
                wd.step(format!("start {start} {proto:?} it {it}"));
                let c = run(
                    &rk,
                    &format!("start {start}, NCCL_PROTO={proto:?}, iteration {it}"),
                    dtype,
                    RedOp::Sum,
                    count,
                    it % 2 == 0,
                    0,
                    proto.map(|p| (Algo::Tree, proto_of(p))),
                )
                .unwrap();
                assert_eq!(c.algo, Algo::Tree);
                if !seen.contains(&c.proto) {
                    seen.push(c.proto);
                }
            }
            if proto.is_none() {
                // The model's choice changes with the size: at least LL and one other protocol
                // ran on the same tree connections.
                assert!(
                    seen.contains(&Proto::Ll) && seen.len() >= 2,
                    "start {start}: {seen:?}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Abort.

#[test]
fn abort_releases_calls_waiting_for_the_root() {
    let env = Staged::clean(VARS);
    let wd = watchdog("abort_releases_calls_waiting_for_the_root");
    // 6 ranks in 3 nodes of 2, 3 channels: rank 0 heads node 0, the root of tree 0 and interior
    // in tree 1 (odd node count); it never calls. A one-element call: its children wait to send
    // their single LL/LL128 step up (credit is free, so they send) and then spin on the broadcast
    // step from rank 0 that never comes; a large call fills the FIFOs and waits for credit.
    for proto in ["LL", "LL128"] {
        for count in [1usize, 1 << 18] {
            tree_env(&env, Some(proto), 3, 3, &[]);
            let rk = Ranks::new(6);
            let bufs: Vec<_> = rk
                .comms
                .iter()
                .map(|c| c.device().alloc(count * 4).unwrap())
                .collect();
            for r in 1..6 {
                rk.comms[r]
                    .all_reduce(
                        &bufs[r],
                        &bufs[r],
                        count,
                        DataType::F32,
                        RedOp::Sum,
                        &rk.streams[r],
                    )
                    .unwrap();
                let c = rk.comms[r].last_choice().unwrap();
                assert_eq!((c.algo, c.proto), (Algo::Tree, proto_of(proto)), "rank {r}");
            }
            wd.step(format!("{proto} {count}: abort"));
            std::thread::sleep(Duration::from_millis(50));
            let t = Instant::now();
            for (r, c) in rk.comms.iter().enumerate() {
                c.abort()
                    .unwrap_or_else(|e| panic!("{proto} {count}: rank {r}: abort: {e}"));
            }
            // The queued kernels leave their spin loops: every stream drains.
            for s in &rk.streams {
                let _ = s.synchronize();
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{proto} {count}: abort and drain took {:?}",
                t.elapsed()
            );
            wd.step(format!("{proto} {count}: after abort"));
            for (r, c) in rk.comms.iter().enumerate() {
                assert!(c.is_aborted(), "{proto} {count}: rank {r}");
                let e = c
                    .all_reduce(&bufs[r], &bufs[r], 1, DataType::F32, RedOp::Sum, &rk.streams[r])
                    .unwrap_err();
                assert!(
                    e.to_string().contains("aborted"),
                    "{proto} {count}: rank {r}: {e}"
                );
            }
        }
    }
}
