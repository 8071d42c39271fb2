//! More of a group's collectives aggregated into launches, checked exactly on the CPU target
//! (every output byte, guard bytes, every rank; [`oxccl::Comm::kernel_launches`] against the
//! batching expected): Sum/Avg/Max/Min/Prod/PreMulSum (host and device scalars) mixed within the
//! batches of one type, for every dtype; AllGather, ReduceScatter, Broadcast and Reduce batches
//! with in-place forms and roots that differ within a batch; calls of count 0 between a batch's
//! calls; batches split at 32 works; tree batches over simulated nodes; batches over SHM and
//! NET; several communicators and a split in one scope issued by one thread; works of very
//! different channel counts; an abort while a batch waits for a rank that never launches; and
//! eager calls on a second stream of the rank ordered with a batch. Its call model (any
//! collective, operator and type; buffers, issue, exact check, [`run_scope`]) serves
//! `aggregation` too.
use crate::common;

use common::env::{Env, Staged};
use common::{BACK, FRONT, sentinel};
use oxccl::group::GroupScope;
use oxccl::{Comm, DataType, Device, DeviceBuffer, Func, RedOp, ReduceOp, Scalar, Stream};
use std::time::{Duration, Instant};

const VARS: &[&str] = &[
    "PROTO",
    "ALGO",
    "CHECK_CALLS",
    "TIMEOUT",
    "MAX_NCHANNELS",
    "MIN_NCHANNELS",
    "TEST_NODES",
    "P2P_DISABLE",
    "SHM_DISABLE",
];

/// A call's operator: a built-in one, PreMulSum with the host scalar `rank + 1`, or with the
/// device scalar `nranks - rank`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Op {
    B(RedOp),
    Pre,
    PreDev,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Call {
    func: Func,
    op: Op,
    dtype: DataType,
    count: usize,
    root: usize,
    in_place: bool,
}

/// Launches per rank that `calls` of one scope take on `proto` when on LL they take `batched`:
/// LL's calls share launches, while on LL128 and Simple every call with elements is a launch of
/// its own (`oxccl_gpu::abi::proto_batches`).
pub(super) fn launches_on(proto: &str, batched: u64, calls: &[Call]) -> u64 {
    if proto == "LL" {
        batched
    } else {
        calls.iter().filter(|c| c.count > 0).count() as u64
    }
}

pub(super) fn call(func: Func, op: Op, dtype: DataType, count: usize, root: usize, in_place: bool) -> Call {
    Call {
        func,
        op,
        dtype,
        count,
        root,
        in_place,
    }
}

pub(super) fn ar(op: Op, dtype: DataType, count: usize, in_place: bool) -> Call {
    call(Func::AllReduce, op, dtype, count, 0, in_place)
}

/// Rank `r`'s input element `j` of call `k`: small integers whose reductions over the ranks
/// are exact in every type (fp8 included).
fn val(c: &Call, k: usize, r: usize, j: usize) -> f64 {
    let top = match c.dtype {
        DataType::F8E4M3 | DataType::F8E5M2 => 2,
        DataType::I8 | DataType::U8 => 40,
        DataType::F16 | DataType::Bf16 => 60,
        _ => 1000,
    };
    match c.op {
        Op::B(RedOp::Prod) => (1 + (r + j + k) % 2) as f64,
        Op::Pre | Op::PreDev => ((r + j + k) % 2) as f64,
        _ => ((r * 37 + j * 11 + k * 5) % (top + 1)) as f64,
    }
}

fn enc(d: DataType, xs: impl IntoIterator<Item = f64>) -> Vec<u8> {
    let es = d.size();
    xs.into_iter()
        .flat_map(|x| Scalar::from_f64(x, d).to_bits().to_le_bytes()[..es].to_vec())
        .collect()
}

fn is_float(d: DataType) -> bool {
    matches!(
        d,
        DataType::F16 | DataType::F32 | DataType::F64 | DataType::Bf16 | DataType::F8E4M3 | DataType::F8E5M2
    )
}

/// The reduction of element `j` (of the reduced input) over `n` ranks.
fn red(c: &Call, k: usize, n: usize, j: usize) -> f64 {
    let v = |r| val(c, k, r, j);
    let sum: f64 = (0..n).map(v).sum();
    match c.op {
        Op::B(RedOp::Sum) => sum,
        Op::B(RedOp::Avg) if is_float(c.dtype) => sum / n as f64,
        Op::B(RedOp::Avg) => (sum / n as f64).floor(),
        Op::B(RedOp::Prod) => (0..n).map(v).product(),
        Op::B(RedOp::Max) => (0..n).map(v).fold(f64::MIN, f64::max),
        Op::B(RedOp::Min) => (0..n).map(v).fold(f64::MAX, f64::min),
        Op::Pre => (0..n).map(|r| (r + 1) as f64 * v(r)).sum(),
        Op::PreDev => (0..n).map(|r| (n - r) as f64 * v(r)).sum(),
    }
}

/// Elements of rank `r`'s input and of its output buffer.
fn sizes(c: &Call, n: usize) -> (usize, usize) {
    match c.func {
        Func::AllGather => (c.count, n * c.count),
        Func::ReduceScatter => (n * c.count, if c.in_place { n * c.count } else { c.count }),
        _ => (c.count, c.count),
    }
}

/// Where rank `r`'s input lies in its output buffer (elements) when in place.
fn in_place_at(c: &Call, r: usize) -> usize {
    if c.func == Func::AllGather { r * c.count } else { 0 }
}

/// Rank `r`'s output buffer expected after the call (`None`: a byte left unchecked).
fn want(c: &Call, k: usize, r: usize, n: usize, salt: u8) -> Vec<Option<u8>> {
    let (ni, no) = sizes(c, n);
    let es = c.dtype.size();
    let mut w: Vec<Option<u8>> = sentinel(FRONT + no * es + BACK, salt)
        .into_iter()
        .map(Some)
        .collect();
    let input: Vec<f64> = (0..ni).map(|j| val(c, k, r, j)).collect();
    let data: Option<Vec<f64>> = match c.func {
        Func::AllReduce => Some((0..c.count).map(|j| red(c, k, n, j)).collect()),
        Func::AllGather => Some(
            (0..no)
                .map(|j| val(c, k, j / c.count.max(1), j % c.count.max(1)))
                .collect(),
        ),
        Func::Broadcast => Some((0..c.count).map(|j| val(c, k, c.root, j)).collect()),
        Func::ReduceScatter if c.in_place => {
            // Only this rank's chunk is the output; the others hold the input, unchanged.
            let mut v = input.clone();
            for j in 0..c.count {
                v[r * c.count + j] = red(c, k, n, r * c.count + j);
            }
            Some(v)
        }
        Func::ReduceScatter => Some((0..c.count).map(|j| red(c, k, n, r * c.count + j)).collect()),
        Func::Reduce if r == c.root => Some((0..c.count).map(|j| red(c, k, n, j)).collect()),
        Func::Reduce if c.in_place => Some(input),
        _ => None,
    };
    if let Some(d) = data {
        for (i, b) in enc(c.dtype, d).into_iter().enumerate() {
            w[FRONT + i] = Some(b);
        }
    }
    w
}

pub(super) struct Bufs {
    pub(super) input: Option<DeviceBuffer>,
    pub(super) output: DeviceBuffer,
    scalar: DeviceBuffer,
}

fn salt(k: usize) -> u8 {
    (k * 7 + 3) as u8
}

pub(super) fn buffers(dev: Device, calls: &[Call], r: usize, n: usize) -> Vec<Bufs> {
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let es = c.dtype.size();
            let (ni, no) = sizes(c, n);
            let output = dev.alloc(FRONT + no * es + BACK).unwrap();
            output
                .write(0, &sentinel(FRONT + no * es + BACK, salt(k)))
                .unwrap();
            let data = enc(c.dtype, (0..ni).map(|j| val(c, k, r, j)));
            let input = if c.in_place {
                output.write(FRONT + in_place_at(c, r) * es, &data).unwrap();
                None
            } else {
                let b = dev.alloc((ni * es).max(8)).unwrap();
                b.write(0, &data).unwrap();
                Some(b)
            };
            let scalar = dev.alloc(8).unwrap();
            scalar.write(0, &enc(c.dtype, [(n - r) as f64])).unwrap();
            Bufs {
                input,
                output,
                scalar,
            }
        })
        .collect()
}

/// Issues call `c` of `comm`'s rank in scope `g`.
pub(super) fn issue<'s>(
    g: &GroupScope<'s>,
    comm: &'s Comm,
    c: &Call,
    b: &'s Bufs,
    s: &'s Stream,
) -> oxccl::Result<()> {
    let (r, n, es) = (comm.rank(), comm.nranks(), c.dtype.size());
    let (ni, no) = sizes(c, n);
    let out = b.output.slice(FRONT, no * es)?;
    let input = match &b.input {
        Some(i) => i.slice(0, ni * es)?,
        None => b.output.slice(FRONT + in_place_at(c, r) * es, ni * es)?,
    };
    let recv = if c.func == Func::ReduceScatter && c.in_place {
        b.output.slice(FRONT + r * c.count * es, c.count * es)?
    } else {
        out
    };
    let op: ReduceOp<'s> = match c.op {
        Op::B(o) => o.into(),
        Op::Pre => ReduceOp::PreMulSum(Scalar::from_f64((r + 1) as f64, c.dtype)),
        Op::PreDev => ReduceOp::PreMulSumDevice(b.scalar.slice(0, es)?),
    };
    let (d, cnt, root) = (c.dtype, c.count, c.root);
    match c.func {
        Func::AllReduce => g.all_reduce(comm, input, recv, cnt, d, op, s),
        Func::AllGather => g.all_gather(comm, input, recv, cnt, d, s),
        Func::ReduceScatter => g.reduce_scatter(comm, input, recv, cnt, d, op, s),
        Func::Broadcast => g.broadcast(comm, (r == root).then_some(input), recv, cnt, d, root, s),
        Func::Reduce => g.reduce(comm, input, (r == root).then_some(recv), cnt, d, op, root, s),
    }
}

pub(super) fn check(calls: &[Call], bufs: &[Bufs], r: usize, n: usize, what: &str) {
    for (k, (c, b)) in calls.iter().zip(bufs).enumerate() {
        let w = want(c, k, r, n, salt(k));
        let got = b.output.to_vec().unwrap();
        let bad: Vec<usize> = (0..w.len())
            .filter(|&i| w[i].is_some_and(|x| x != got[i]))
            .collect();
        assert!(
            bad.is_empty(),
            "{what}: rank {r}, call {k} {c:?}: {} wrong bytes, first at byte {} (data starts at {FRONT}): got {:#04x}, want {:#04x}",
            bad.len(),
            bad[0],
            got[bad[0]],
            w[bad[0]].unwrap()
        );
    }
}

/// Every rank (a thread each) issues `calls` in one scope on one stream; checks every output and
/// returns each rank's kernel launches for the scope.
pub(super) fn run_scope(comms: &[Comm], calls: &[Call], what: &str) -> Vec<u64> {
    let n = comms.len();
    let ready = std::sync::Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let bufs = buffers(c.device(), calls, r, n);
        let stream = c.device().new_stream().unwrap();
        ready.wait();
        let before = c.kernel_launches();
        oxccl::group::scope(|g| -> oxccl::Result<()> {
            for (call, b) in calls.iter().zip(&bufs) {
                issue(g, c, call, b, &stream)?;
            }
            Ok(())
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        let launches = c.kernel_launches() - before;
        stream
            .synchronize()
            .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        check(calls, &bufs, r, n, what);
        launches
    })
}

/// Per dtype on LL: Max, Min, Prod, PreMulSum (host scalar), PreMulSum (device scalar) and Max
/// in place share the `any` entry (one launch); Sum, Avg, Sum in place and Avg share the `Sum`
/// entry (one launch); a last Min is a third launch (fp8: Avg is PreMulSum by 1/nranks, on the
/// `any` entry, so five); on Simple each call is a launch. Exact on both ranks for every dtype.
#[test]
fn every_operator_of_a_type_mixes_within_its_entrys_batch_for_every_dtype() {
    for proto in ["Simple", "LL"] {
        let env = Env::clean(VARS);
        env.set(&[
            ("NCCL_PROTO", proto),
            ("NCCL_ALGO", "Ring"),
            ("NCCL_MAX_NCHANNELS", "2"),
        ]);
        let comms = common::init_all(&Device::cpus(2)).unwrap();
        for &d in DataType::ALL {
            let ops = [
                Op::B(RedOp::Max),
                Op::B(RedOp::Min),
                Op::B(RedOp::Prod),
                Op::Pre,
                Op::PreDev,
                Op::B(RedOp::Max),
                Op::B(RedOp::Sum),
                Op::B(RedOp::Avg),
                Op::B(RedOp::Sum),
                Op::B(RedOp::Avg),
                Op::B(RedOp::Min),
            ];
            let calls: Vec<Call> = ops
                .iter()
                .enumerate()
                .map(|(k, &op)| ar(op, d, [1, 1000, 37, 4099, 5, 300][k % 6] + k, k % 3 == 2))
                .collect();
            // fp8 Avg runs as PreMulSum by 1/nranks (the `any` entry): five launches there.
            let want = launches_on(proto, if d.is_fp8() { 5 } else { 3 }, &calls);
            let what = format!("{proto} {d:?}");
            assert_eq!(
                run_scope(&comms, &calls, &what),
                vec![want; 2],
                "{what}: launches"
            );
        }
    }
}

/// AllGather ×3 (one in place), ReduceScatter ×3 (Sum, Avg, Sum; one in place), Reduce ×3
/// (roots 0, 2, 1; one in place), Broadcast ×4 (roots 2, 0, 1, 1; of i32, f32 and u32, which
/// share the 4-byte entry; one in place at its root): four launches per rank, exact, and the
/// Reduce's non-roots' outputs untouched.
#[test]
fn gather_scatter_broadcast_and_reduce_batches_with_roots_differing_within_a_batch() {
    let env = Env::clean(VARS);
    env.set(&[
        ("NCCL_PROTO", "LL"),
        ("NCCL_ALGO", "Ring"),
        ("NCCL_MAX_NCHANNELS", "3"),
    ]);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    let (u, s) = (DataType::U32, Op::B(RedOp::Sum));
    let calls = vec![
        call(Func::AllGather, s, u, 100, 0, false),
        call(Func::AllGather, s, u, 7, 0, true),
        call(Func::AllGather, s, u, 5000, 0, false),
        call(Func::ReduceScatter, s, u, 333, 0, true),
        call(Func::ReduceScatter, Op::B(RedOp::Avg), u, 64, 0, false),
        call(Func::ReduceScatter, s, u, 4097, 0, false),
        call(Func::Reduce, s, u, 1000, 0, false),
        call(Func::Reduce, s, u, 17, 2, true),
        call(Func::Reduce, s, u, 2049, 1, false),
        call(Func::Broadcast, s, DataType::I32, 500, 2, false),
        call(Func::Broadcast, s, DataType::F32, 3, 0, false),
        call(Func::Broadcast, s, u, 9000, 1, true),
        call(Func::Broadcast, s, u, 1, 1, false),
    ];
    assert_eq!(run_scope(&comms, &calls, "mixed functions"), vec![4; 3]);
    // f16 and bf16 Broadcasts share the 2-byte entry, u8 and fp8 AllGathers the 1-byte one.
    let calls = vec![
        call(Func::Broadcast, s, DataType::F16, 77, 1, false),
        call(Func::Broadcast, s, DataType::Bf16, 1000, 2, true),
        call(Func::AllGather, s, DataType::U8, 301, 0, false),
        call(Func::AllGather, s, DataType::F8E4M3, 33, 0, true),
        call(Func::AllGather, s, DataType::F8E5M2, 2, 0, false),
    ];
    assert_eq!(run_scope(&comms, &calls, "narrow types"), vec![2; 3]);
}

/// Calls of count 0 between a batch's calls move nothing and every other call is exact; each
/// ends the batch before it (they are recorded in their place), so 4 + 0 + 5 + 0 + 0 + 3 calls
/// take three launches. 65 calls of one entry take three launches (32 + 32 + 1).
#[test]
fn empty_calls_inside_a_batch_and_batches_split_at_32_works() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL"), ("NCCL_ALGO", "Ring")]);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    let d = DataType::F32;
    let counts = [5, 100, 1, 2000, 0, 3, 9, 4096, 10, 11, 0, 0, 40, 1, 77];
    let calls: Vec<Call> = counts
        .iter()
        .enumerate()
        .map(|(k, &c)| ar(Op::B(RedOp::Sum), d, c, k % 2 == 0))
        .collect();
    assert_eq!(run_scope(&comms, &calls, "count 0 inside"), vec![3; 3]);
    let calls: Vec<Call> = (0..65)
        .map(|k| {
            ar(
                Op::B(if k % 4 == 3 { RedOp::Max } else { RedOp::Sum }),
                DataType::I32,
                1 + 13 * k,
                false,
            )
        })
        .collect();
    // Sum, Sum, Sum, Max, … alternate entries: one launch per run, 3 and 1 calls long.
    let runs = calls
        .iter()
        .enumerate()
        .filter(|(k, _)| k % 4 == 3 || k % 4 == 0)
        .count() as u64;
    assert_eq!(run_scope(&comms, &calls, "alternating"), vec![runs; 3]);
    let calls: Vec<Call> = (0..65)
        .map(|k| ar(Op::B(RedOp::Sum), DataType::I32, 1 + 13 * k, k % 5 == 1))
        .collect();
    assert_eq!(run_scope(&comms, &calls, "65 calls"), vec![3; 3]);
}

/// Tree AllReduces (4 ranks on 2 simulated nodes, `NCCL_ALGO=Tree`) of sizes from 1 to 64K
/// elements, Sum and Avg, share one launch per rank on LL (a launch each on LL128 and
/// Simple); exact on each protocol.
#[test]
fn tree_all_reduces_share_a_launch_exact() {
    for proto in ["Simple", "LL", "LL128"] {
        let env = Env::clean(VARS);
        env.set(&[
            ("NCCL_ALGO", "Tree"),
            ("NCCL_PROTO", proto),
            ("OXCCL_TEST_NODES", "2"),
            ("NCCL_MAX_NCHANNELS", "3"),
        ]);
        let comms = common::init_all(&Device::cpus(4)).unwrap();
        let calls: Vec<Call> = (0..10)
            .map(|k| {
                let op = if k % 3 == 1 { RedOp::Avg } else { RedOp::Sum };
                ar(
                    Op::B(op),
                    DataType::U32,
                    [1, 6000, 3, 1025, 7, 2000][k % 6] + k,
                    k % 2 == 0,
                )
            })
            .collect();
        assert_eq!(run_scope(&comms, &calls, proto), vec![launches_on(proto, 1, &calls); 4], "{proto}");
        let choice = comms[0].last_choice().unwrap();
        assert_eq!(choice.algo, oxccl::Algo::Tree, "{proto}: {choice:?}");
        let any: Vec<Call> = (0..6)
            .map(|k| {
                ar(
                    [Op::B(RedOp::Max), Op::Pre, Op::PreDev, Op::B(RedOp::Prod)][k % 4],
                    DataType::F32,
                    100 * k + 1,
                    false,
                )
            })
            .collect();
        assert_eq!(run_scope(&comms, &any, proto), vec![launches_on(proto, 1, &any); 4], "{proto}: any entry");
    }
}

/// Over NET (P2P and SHM off) and SHM (P2P off): AllReduce ×6 then AllGather ×3 then
/// ReduceScatter ×2 take three launches per rank on LL, one per call on LL128 and Simple;
/// exact on each protocol.
#[test]
fn batches_over_shm_and_net_are_exact() {
    for (transport, vars) in [
        ("NET", &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")][..]),
        ("SHM", &[("NCCL_P2P_DISABLE", "1")][..]),
    ] {
        for proto in ["Simple", "LL", "LL128"] {
            let env = Staged::clean(VARS);
            let mut all = vars.to_vec();
            all.extend([
                ("NCCL_PROTO", proto),
                ("NCCL_ALGO", "Ring"),
                ("NCCL_MAX_NCHANNELS", "2"),
            ]);
            env.set(&all);
            let comms = common::init_all(&Device::cpus(3)).unwrap();
            let (u, s) = (DataType::U32, Op::B(RedOp::Sum));
            let mut calls: Vec<Call> = (0..6)
                .map(|k| ar(s, u, [3, 9000, 1, 600, 20_000, 2][k], k % 2 == 1))
                .collect();
            calls.extend((0..3).map(|k| call(Func::AllGather, s, u, [5, 3000, 1][k], 0, k == 1)));
            calls.extend((0..2).map(|k| call(Func::ReduceScatter, s, u, [1000, 4][k], 0, k == 0)));
            let what = format!("{transport} {proto}");
            assert_eq!(run_scope(&comms, &calls, &what), vec![launches_on(proto, 3, &calls); 3], "{what}");
        }
    }
}

/// One thread issues, in one scope, the calls of two communicators of the same three devices
/// and of a split of the first (ranks 0 and 2; rank 1 alone), each rank's communicators sharing
/// one stream per device: every communicator's batches launch and interleave without a
/// deadlock, exact, with the launches expected of each.
#[test]
fn several_communicators_and_a_split_in_one_scope_from_one_thread() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL"), ("NCCL_ALGO", "Ring")]);
    let devs = Device::cpus(3);
    let a = common::init_all(&devs).unwrap();
    let b = common::init_all(&devs).unwrap();
    let split: Vec<Comm> = common::on_threads(3, |r| a[r].split((r % 2) as i32, 0).unwrap().unwrap());
    let streams: Vec<Stream> = devs.iter().map(|d| d.new_stream().unwrap()).collect();
    let (u, s) = (DataType::U32, Op::B(RedOp::Sum));
    let ca: Vec<Call> = (0..5)
        .map(|k| ar(if k < 3 { s } else { Op::B(RedOp::Max) }, u, 10 + 99 * k, false))
        .collect();
    let cb: Vec<Call> = (0..4)
        .map(|k| call(Func::AllGather, s, u, 1 + 77 * k, 0, k == 2))
        .collect();
    let cs: Vec<Call> = (0..3)
        .map(|k| ar(Op::B(RedOp::Avg), u, 5 + 30 * k, k == 1))
        .collect();
    let sets: Vec<(&[Comm], &[Call])> = vec![(&a, &ca), (&b, &cb), (&split, &cs)];
    let bufs: Vec<Vec<Vec<Bufs>>> = sets
        .iter()
        .map(|(comms, calls)| {
            comms
                .iter()
                .map(|c| buffers(c.device(), calls, c.rank(), c.nranks()))
                .collect()
        })
        .collect();
    let before: Vec<Vec<u64>> = sets
        .iter()
        .map(|(cs, _)| cs.iter().map(|c| c.kernel_launches()).collect())
        .collect();
    oxccl::group::scope(|g| -> oxccl::Result<()> {
        // Rank after rank, and within a rank communicator after communicator.
        for dev in 0..3 {
            for (set, (comms, calls)) in sets.iter().enumerate() {
                for (call, bf) in calls.iter().zip(&bufs[set][dev]) {
                    issue(g, &comms[dev], call, bf, &streams[dev])?;
                }
            }
        }
        Ok(())
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "several communicators");
    // The split's rank 1 is alone: its Avg is a copy, not a kernel.
    let want = [[2u64; 3], [1; 3], [1, 0, 1]];
    for (set, (comms, calls)) in sets.iter().enumerate() {
        for (i, c) in comms.iter().enumerate() {
            check(
                calls,
                &bufs[set][i],
                c.rank(),
                c.nranks(),
                &format!("communicator {set}, device {i}"),
            );
            assert_eq!(
                c.kernel_launches() - before[set][i],
                want[set][i],
                "communicator {set}, device {i}"
            );
        }
    }
    // A split's ranks meet at a teardown barrier: dropped on a thread each.
    drop(sets);
    common::drop_on_threads(split);
}

/// Works of 1 and 16 channels in one launch (`NCCL_MAX_NCHANNELS=16`): the blocks above a small
/// work's channel count skip it and meet the next; one launch per rank, exact.
#[test]
fn a_batch_of_works_of_1_to_16_channels_is_exact() {
    let env = Env::clean(VARS);
    env.set(&[
        ("NCCL_PROTO", "LL"),
        ("NCCL_ALGO", "Ring"),
        ("NCCL_MAX_NCHANNELS", "16"),
        ("NCCL_MIN_NCHANNELS", "1"),
    ]);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let counts = [1usize, 1 << 20, 2, 300_000, 5, 1 << 19, 1];
    let chans: Vec<u32> = counts
        .iter()
        .map(|&c| {
            comms[0]
                .choice_for(Func::AllReduce, c, DataType::F32)
                .unwrap()
                .unwrap()
                .nchannels
        })
        .collect();
    assert!(
        chans.iter().min() < chans.iter().max(),
        "channels per work: {chans:?}"
    );
    let calls: Vec<Call> = counts
        .iter()
        .enumerate()
        .map(|(k, &c)| ar(Op::B(RedOp::Sum), DataType::F32, c, k % 2 == 0))
        .collect();
    assert_eq!(
        run_scope(&comms, &calls, "channels"),
        vec![1; 2],
        "channels per work: {chans:?}"
    );
}

/// Ranks 0 and 1 of three launch a batch that waits for rank 2, which never calls; rank 0
/// aborts: both ranks' streams drain in bounded time.
#[test]
fn an_abort_releases_a_batch_waiting_for_a_rank_that_never_launches() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL"), ("NCCL_ALGO", "Ring")]);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    let calls: Vec<Call> = (0..6)
        .map(|k| ar(Op::B(RedOp::Sum), DataType::U32, 100 + 5000 * k, false))
        .collect();
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        for r in 0..2 {
            let (c, calls, tx) = (&comms[r], &calls, tx.clone());
            sc.spawn(move || {
                let bufs = buffers(c.device(), calls, r, 3);
                let stream = c.device().new_stream().unwrap();
                let before = c.kernel_launches();
                let _ = oxccl::group::scope(|g| -> oxccl::Result<()> {
                    for (call, b) in calls.iter().zip(&bufs) {
                        issue(g, c, call, b, &stream)?;
                    }
                    Ok(())
                });
                let launched = c.kernel_launches() - before;
                let _ = stream.synchronize();
                tx.send((r, launched)).unwrap();
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        comms[0].abort().unwrap();
        let mut done = Vec::new();
        for _ in 0..2 {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(x) => done.push(x),
                Err(_) => panic!(
                    "ranks still waiting {:?} after the abort: done {done:?}",
                    start.elapsed()
                ),
            }
        }
        done.sort();
        assert_eq!(done, vec![(0, 1), (1, 1)], "launches of the waiting batch");
    });
    drop(env);
}

/// Each rank's buffer of `count` u32 reduced in place by a chain of AllReduce Sums, `plan` a list
/// of segments: `(true, streams)` one scope whose calls go to those streams of the rank (each run
/// of one stream a launch on LL, each call one on the other protocols), `(false, streams)` eager
/// calls; `proto` is the run's `NCCL_PROTO`. Every result depends on the
/// previous one, so on the communicator's kernels running in the order issued across streams:
/// `n^(calls - 1)` times the first sum on every rank, with the launches expected.
fn in_place_chain(proto: &str, plan: &[(bool, &[usize])], count: usize) {
    let n = 3;
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let ready = std::sync::Barrier::new(n);
    let got = common::on_threads(n, |r| {
        let c = &comms[r];
        let streams = [c.device().new_stream().unwrap(), c.device().new_stream().unwrap()];
        let buf = c.device().alloc(4 * count).unwrap();
        buf.write(0, &common::pattern::input(r, count, 11)).unwrap();
        ready.wait();
        let before = c.kernel_launches();
        let x = buf.slice(0, 4 * count).unwrap();
        for &(scoped, on) in plan {
            let (u, sum) = (DataType::U32, RedOp::Sum);
            if scoped {
                oxccl::group::scope(|g| {
                    on.iter()
                        .try_for_each(|&s| g.all_reduce(c, x, x, count, u, sum, &streams[s]))
                })
                .unwrap()
                .unwrap();
            } else {
                on.iter()
                    .try_for_each(|&s| c.all_reduce(x, x, count, u, sum, &streams[s]))
                    .unwrap();
            }
        }
        let launches = c.kernel_launches() - before;
        streams.iter().for_each(|s| s.synchronize().unwrap());
        (launches, buf.to_vec().unwrap())
    });
    let calls: usize = plan.iter().map(|(_, on)| on.len()).sum();
    let launches: u64 = plan
        .iter()
        .map(|(scoped, on)| {
            (if *scoped && proto == "LL" { 1 + on.windows(2).filter(|w| w[0] != w[1]).count() } else { on.len() }) as u64
        })
        .sum();
    let factor = (n as u32).pow(calls as u32 - 1);
    let want = common::pattern::u32_bytes(
        (0..count).map(|i| common::pattern::sum_elem(n, i, 11).wrapping_mul(factor)),
    );
    for (r, (l, data)) in got.iter().enumerate() {
        assert_eq!(*l, launches, "rank {r}: launches of {plan:?}");
        assert!(*data == want, "rank {r}: result of {plan:?}");
    }
}

/// Eager calls on a second stream of each rank, issued right before and right after a scope's
/// batch on the first, run in the order issued, over and over (a race has chances to show).
#[test]
fn eager_calls_on_another_stream_run_in_order_with_a_batch() {
    let env = Env::clean(VARS);
    for proto in ["LL", "Simple"] {
        env.set(&[("NCCL_PROTO", proto), ("NCCL_ALGO", "Ring")]);
        let plan: &[(bool, &[usize])] = &[
            (false, &[1]),
            (true, &[0, 0, 0]),
            (false, &[1, 1]),
            (true, &[0; 4]),
        ];
        for _ in 0..4 {
            in_place_chain(proto, plan, 3001);
        }
    }
}

/// One scope whose calls alternate between two streams of each rank (s0 s0 s1 s1 s1 s0 s1):
/// each run of one stream is a launch (four), run in the order issued.
#[test]
fn a_scopes_calls_alternating_between_two_streams_run_in_the_order_issued() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL"), ("NCCL_ALGO", "Ring")]);
    in_place_chain("LL", &[(true, &[0, 0, 1, 1, 1, 0, 1])], 5000);
}
