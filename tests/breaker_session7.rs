//! Breaker tests of session 7's `Comm::init_rank` trees across hosts (tree edges over SHM inside a
//! host, NET through the proxy between hosts) and per-channel rings across hosts (mixed
//! transports per channel), CPU target, every rank a process of this test binary on a simulated
//! host (`OXCCL_HOSTID`):
//! 1. C11 (B): connection steps starting just below the LL flag period, 2^32 and the second
//!    period, then 1000 tree AllReduces across two hosts on LL, LL128 and Simple, each checked;
//! 2. C12: odd line counts and the smallest accepted FIFOs, channel counts 1..8 (with
//!    NCCL_MIN_NCHANNELS), values outside the accepted ranges;
//! 3. the tuner switching protocols back to back on the same tree connections;
//! 4. C15: unequal hosts, three hosts, hosts whose ranks are not contiguous, NCCL_SHM_DISABLE on
//!    some ranks;
//! 5. C28 / C29: abort from another thread, kill -9 of a rank, while every rank loops tree
//!    AllReduce across hosts;
//! 6. settings that differ across ranks;
//! 7. per-channel rings (NVLink-mesh fixture) across two hosts: every collective in place on every
//!    protocol and channel count.
//!
//! Every result is compared bit for bit with the expected bytes (`oxccl::perf::check` for
//! AllReduce, closed forms for the others), guards around outputs included; every group of child
//! ranks runs under a deadline (killed past it, which fails the test).
mod common;

use common::child::{LineChild, clean_child, env_var, hex, log_to_stdout, unhex};
use oxccl::bootstrap::{UniqueId, get_unique_id};
use oxccl::perf::check;
use oxccl::{Algo, Comm, DataType, Device, DeviceBuffer, Func, Proto, RedOp};
use std::time::{Duration, Instant};

const ENTRY: &str = "b7_child_entry";
/// Guard bytes before and after each output.
const GUARD: usize = 64;

// ---------------------------------------------------------------------------------------------
// Child side.

fn list(var: &str, default: &str) -> Vec<String> {
    std::env::var(var)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The body of every child rank (a no-op in a normal test run): `OXCCL_B7_ROLE` picks what it
/// runs after `init_rank` on `Device::Cpu(rank)`.
#[test]
fn b7_child_entry() {
    let Ok(role) = std::env::var("OXCCL_B7_ROLE") else {
        return;
    };
    log_to_stdout("oxccl::init=info,oxccl::transport=info,oxccl::proxy=error");
    let rank: usize = env_var("OXCCL_B7_RANK").parse().unwrap();
    let nranks: usize = env_var("OXCCL_B7_NRANKS").parse().unwrap();
    let id = UniqueId::from_bytes(&unhex(&env_var("OXCCL_B7_ID"))).unwrap();
    let comm = match Comm::init_rank(nranks, &id, rank, Device::Cpu(rank)) {
        Ok(c) => c,
        Err(e) => {
            println!("INIT-ERR rank {rank} {:?}: {e}", e.code());
            return;
        }
    };
    println!("INIT-OK rank {rank}");
    match role.as_str() {
        "init" => {
            match comm.choice_for(Func::AllReduce, 1 << 16, DataType::F32) {
                Ok(c) => println!("CHOICE {:?}", c.map(|c| (c.algo, c.proto))),
                Err(e) => println!("CHOICE-ERR {e}"),
            }
            comm.destroy().expect("destroy");
        }
        "sweep" => {
            for k in 0..26 {
                let c = comm.choice_for(Func::AllReduce, 1 << k, DataType::U32);
                println!("SWEEP {} {:?}", 4usize << k, c.map(|c| c.map(|c| (c.algo, c.proto, c.nchannels))));
            }
            comm.destroy().expect("destroy");
        }
        "ar" => child_all_reduce(comm),
        "wrap" => child_wrap(comm),
        "colls" => child_collectives(comm),
        "loop" => {
            child_loop(comm, rank);
        }
        r => panic!("unknown role {r}"),
    }
    println!("B7-CHILD-OK rank {rank}");
}

fn want_algo() -> Option<Algo> {
    std::env::var("OXCCL_B7_WANT_ALGO")
        .ok()
        .map(|a| Algo::from_name(&a).unwrap_or_else(|| panic!("algo {a}")))
}

fn want_proto() -> Option<Proto> {
    std::env::var("OXCCL_B7_WANT_PROTO")
        .ok()
        .map(|a| Proto::from_name(&a).unwrap_or_else(|| panic!("proto {a}")))
}

/// AllReduce over `OXCCL_B7_DTYPES` × `OXCCL_B7_OPS` × `OXCCL_B7_COUNTS` × out-of-place and in
/// place, each checked exactly with guards; prints `WRONG` per failure, `USED` (the distinct
/// algorithm/protocol pairs) and a `DIGEST` of every result.
fn child_all_reduce(comm: Comm) {
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let dtypes: Vec<DataType> = list("OXCCL_B7_DTYPES", "int32,float")
        .iter()
        .map(|d| DataType::from_name(d).unwrap_or_else(|| panic!("dtype {d}")))
        .collect();
    let ops: Vec<RedOp> = list("OXCCL_B7_OPS", "sum")
        .iter()
        .map(|d| RedOp::from_name(d).unwrap_or_else(|| panic!("op {d}")))
        .collect();
    let counts: Vec<usize> = list("OXCCL_B7_COUNTS", "1,1001,40000")
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let reps: usize = std::env::var("OXCCL_B7_REPS").map_or(1, |v| v.parse().unwrap());
    let (walgo, wproto) = (want_algo(), want_proto());
    let wnch: Option<u32> = std::env::var("OXCCL_B7_WANT_NCH").ok().map(|v| v.parse().unwrap());
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    let mut wrong = 0usize;
    let mut calls = 0usize;
    let mut used: Vec<(Algo, Proto)> = Vec::new();
    let max = *counts.iter().max().unwrap();
    for _ in 0..reps {
        for &dtype in &dtypes {
            let size = dtype.size();
            let send = dev.alloc(max * size + 2 * GUARD).unwrap();
            let recv = dev.alloc(max * size + 2 * GUARD).unwrap();
            for &op in &ops {
                for &count in &counts {
                    let bytes = count * size;
                    let seed = (calls as u64) << 8 | 7;
                    let input = check::fill_input(Func::AllReduce, dtype, op, rank, nranks, seed, count).unwrap();
                    let want = check::expected(Func::AllReduce, dtype, op, nranks, seed, count).unwrap();
                    for in_place in [false, true] {
                        let guard = vec![0xa5u8; GUARD];
                        let mut s = guard.clone();
                        s.extend_from_slice(&input);
                        s.extend_from_slice(&guard);
                        send.write(0, &s).unwrap();
                        let out = if in_place { &send } else { &recv };
                        if !in_place {
                            let mut r = guard.clone();
                            r.extend_from_slice(&check::poison(dtype, count));
                            r.extend_from_slice(&guard);
                            recv.write(0, &r).unwrap();
                        }
                        let sv = send.slice(GUARD, bytes).unwrap();
                        let rv = out.slice(GUARD, bytes).unwrap();
                        if let Err(e) = comm
                            .all_reduce(sv, rv, count, dtype, op, &stream)
                            .and_then(|_| stream.synchronize())
                        {
                            println!("CALL-ERR rank {rank} {dtype:?} {op:?} count {count}: {e}");
                            std::process::exit(3);
                        }
                        calls += 1;
                        let choice = comm.last_choice().expect("choice");
                        if !used.contains(&(choice.algo, choice.proto)) {
                            used.push((choice.algo, choice.proto));
                        }
                        let all = out.to_vec().unwrap();
                        let got = &all[GUARD..GUARD + bytes];
                        let n = check::count_wrong(dtype, op, got, &want, nranks);
                        let first = check::first_wrong(dtype, op, got, &want, nranks);
                        let guards_ok =
                            all[..GUARD] == guard[..] && all[GUARD + bytes..GUARD + bytes + GUARD] == guard[..];
                        let plan_ok = walgo.is_none_or(|a| a == choice.algo)
                            && wproto.is_none_or(|p| p == choice.proto)
                            && wnch.is_none_or(|c| c == choice.nchannels);
                        if n > 0 || !guards_ok || !plan_ok {
                            wrong += 1;
                            println!(
                                "WRONG rank {rank} {dtype:?} {op:?} count {count} in_place {in_place}: {n} wrong \
                                 (first at {first:?}), guards ok {guards_ok}, plan {choice:?}"
                            );
                        }
                        digest = got
                            .iter()
                            .fold(digest, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
                    }
                }
            }
        }
    }
    used.sort();
    println!("USED {used:?}");
    println!("DIGEST {digest:016x} calls {calls}");
    comm.destroy().expect("destroy");
    assert_eq!(wrong, 0, "rank {rank}: {wrong} wrong calls");
}

/// C11 (B): `OXCCL_B7_ITERS` AllReduces of u32 sum, the counts of `OXCCL_B7_COUNTS` in turn,
/// alternately in place and out of place, each checked exactly (wrapping sums).
fn child_wrap(comm: Comm) {
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let iters: u32 = std::env::var("OXCCL_B7_ITERS").map_or(1000, |v| v.parse().unwrap());
    let counts: Vec<usize> = list("OXCCL_B7_COUNTS", "4,700,3001")
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let max = *counts.iter().max().unwrap();
    let send = dev.alloc(max * 4 + 2 * GUARD).unwrap();
    let recv = dev.alloc(max * 4 + 2 * GUARD).unwrap();
    let (walgo, wproto) = (want_algo(), want_proto());
    let val = |r: u32, it: u32, i: u32| {
        (r.wrapping_mul(0x9e37_79b9))
            .wrapping_add(it.wrapping_mul(2_654_435_761))
            .wrapping_add(i.wrapping_mul(40_503))
    };
    let mut wrong = 0;
    let mut used: Vec<(Algo, Proto)> = Vec::new();
    for it in 0..iters {
        let count = counts[it as usize % counts.len()];
        let bytes = count * 4;
        let in_place = it % 2 == 0;
        let guard = vec![0x3cu8; GUARD];
        let mut s = guard.clone();
        s.extend((0..count as u32).flat_map(|i| val(rank as u32, it, i).to_ne_bytes()));
        s.extend_from_slice(&guard);
        send.write(0, &s).unwrap();
        if !in_place {
            let mut r = guard.clone();
            r.extend(vec![0xa5u8; bytes]);
            r.extend_from_slice(&guard);
            recv.write(0, &r).unwrap();
        }
        let out = if in_place { &send } else { &recv };
        let sv = send.slice(GUARD, bytes).unwrap();
        let rv = out.slice(GUARD, bytes).unwrap();
        if let Err(e) = comm
            .all_reduce(sv, rv, count, DataType::U32, RedOp::Sum, &stream)
            .and_then(|_| stream.synchronize())
        {
            println!("CALL-ERR rank {rank} iteration {it}: {e}");
            std::process::exit(3);
        }
        let choice = comm.last_choice().unwrap();
        if !used.contains(&(choice.algo, choice.proto)) {
            used.push((choice.algo, choice.proto));
        }
        let all = out.to_vec().unwrap();
        let mut want = guard.clone();
        want.extend((0..count as u32).flat_map(|i| {
            (0..nranks as u32)
                .fold(0u32, |a, r| a.wrapping_add(val(r, it, i)))
                .to_ne_bytes()
        }));
        want.extend_from_slice(&guard);
        let plan_ok = walgo.is_none_or(|a| a == choice.algo) && wproto.is_none_or(|p| p == choice.proto);
        if all[..2 * GUARD + bytes] != want[..] || !plan_ok {
            wrong += 1;
            let first = all.iter().zip(&want).position(|(a, b)| a != b);
            if wrong < 10 {
                println!(
                    "WRONG rank {rank} iteration {it} count {count} in_place {in_place}: first wrong byte {first:?} \
                     plan {choice:?}"
                );
            }
        }
    }
    used.sort();
    println!("USED {used:?}");
    println!("WRAP-DONE rank {rank} iters {iters} wrong {wrong}");
    comm.destroy().expect("destroy");
    assert_eq!(wrong, 0, "rank {rank}: {wrong} wrong iterations");
}

fn to_bytes_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Rank `r`'s element `i` for the collectives: a small integer, so sums over 8 ranks are exact.
fn cval(r: usize, i: usize, salt: usize) -> i32 {
    ((i * 7 + r * 13 + salt * 31) % 1000) as i32 - 500
}

/// Every collective in place (AllReduce sum, Broadcast and Reduce with the root cycling over every
/// rank, AllGather, ReduceScatter sum), int32, for the counts of `OXCCL_B7_COUNTS`, each checked
/// exactly; guards around every buffer.
fn child_collectives(comm: Comm) {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let counts: Vec<usize> = list("OXCCL_B7_COUNTS", "1,1001,40000")
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let wproto = want_proto();
    let mut bad: Vec<String> = Vec::new();
    let mut used: Vec<(Func, Algo, Proto)> = Vec::new();
    let guard = vec![0x5au8; GUARD];
    let framed = |data: &[u8]| {
        let mut v = guard.clone();
        v.extend_from_slice(data);
        v.extend_from_slice(&guard);
        v
    };
    let run = |what: &str, res: oxccl::Result<()>| {
        if let Err(e) = res.and_then(|_| stream.synchronize()) {
            println!("CALL-ERR rank {r} {what}: {e}");
            std::process::exit(3);
        }
    };
    let mut note = |comm: &Comm, bad: &mut Vec<String>| {
        let c = comm.last_choice().unwrap();
        if !used.contains(&(c.func, c.algo, c.proto)) {
            used.push((c.func, c.algo, c.proto));
        }
        if wproto.is_some_and(|p| p != c.proto) {
            bad.push(format!("rank {r}: {:?} ran {:?}", c.func, c));
        }
    };
    let cmp = |what: String, buf: &DeviceBuffer, want: Vec<u8>, bad: &mut Vec<String>| {
        let got = buf.to_vec().unwrap();
        let want = framed(&want);
        if got[..want.len()] != want[..] {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            bad.push(format!("rank {r}: {what}: first wrong byte {first:?} (guard {GUARD})"));
        }
    };
    for (k, &count) in counts.iter().enumerate() {
        let bytes = count * 4;
        // AllReduce in place.
        let buf = dev.alloc(bytes * n + 2 * GUARD).unwrap();
        let input: Vec<i32> = (0..count).map(|i| cval(r, i, k)).collect();
        buf.write(0, &framed(&to_bytes_i32(&input))).unwrap();
        let s = buf.slice(GUARD, bytes).unwrap();
        run("allreduce", comm.all_reduce(s, s, count, DataType::I32, RedOp::Sum, &stream));
        note(&comm, &mut bad);
        let want: Vec<i32> = (0..count).map(|i| (0..n).map(|q| cval(q, i, k)).sum()).collect();
        cmp(format!("AllReduce count {count}"), &buf, to_bytes_i32(&want), &mut bad);
        // Broadcast in place, every root.
        for root in 0..n {
            let pattern: Vec<i32> = (0..count).map(|i| cval(root, i, k + 100)).collect();
            let data = if r == root {
                to_bytes_i32(&pattern)
            } else {
                vec![0xeeu8; bytes]
            };
            buf.write(0, &framed(&data)).unwrap();
            let s = buf.slice(GUARD, bytes).unwrap();
            run(
                "broadcast",
                comm.broadcast((r == root).then_some(s), s, count, DataType::I32, root, &stream),
            );
            note(&comm, &mut bad);
            cmp(
                format!("Broadcast count {count} root {root}"),
                &buf,
                to_bytes_i32(&pattern),
                &mut bad,
            );
        }
        // Reduce in place (root: send == recv), every root; non-roots' buffers stay as they were.
        for root in 0..n {
            let input: Vec<i32> = (0..count).map(|i| cval(r, i, k + 200 + root)).collect();
            buf.write(0, &framed(&to_bytes_i32(&input))).unwrap();
            let s = buf.slice(GUARD, bytes).unwrap();
            run(
                "reduce",
                comm.reduce(s, (r == root).then_some(s), count, DataType::I32, RedOp::Sum, root, &stream),
            );
            note(&comm, &mut bad);
            let want: Vec<i32> = if r == root {
                (0..count)
                    .map(|i| (0..n).map(|q| cval(q, i, k + 200 + root)).sum())
                    .collect()
            } else {
                input
            };
            cmp(
                format!("Reduce count {count} root {root}"),
                &buf,
                to_bytes_i32(&want),
                &mut bad,
            );
        }
        // AllGather in place: this rank's block at r·count of the output.
        let mut data = vec![0xeeu8; bytes * n];
        let mine: Vec<i32> = (0..count).map(|i| cval(r, i, k + 300)).collect();
        data[r * bytes..(r + 1) * bytes].copy_from_slice(&to_bytes_i32(&mine));
        buf.write(0, &framed(&data)).unwrap();
        let all = buf.slice(GUARD, bytes * n).unwrap();
        let blk = buf.slice(GUARD + r * bytes, bytes).unwrap();
        run("allgather", comm.all_gather(blk, all, count, DataType::I32, &stream));
        note(&comm, &mut bad);
        let want: Vec<i32> = (0..n * count).map(|j| cval(j / count, j % count, k + 300)).collect();
        cmp(format!("AllGather count {count}"), &buf, to_bytes_i32(&want), &mut bad);
        // ReduceScatter in place: the result in this rank's block of the input.
        let input: Vec<i32> = (0..n * count).map(|j| cval(r, j, k + 400)).collect();
        buf.write(0, &framed(&to_bytes_i32(&input))).unwrap();
        let all = buf.slice(GUARD, bytes * n).unwrap();
        let blk = buf.slice(GUARD + r * bytes, bytes).unwrap();
        run(
            "reducescatter",
            comm.reduce_scatter(all, blk, count, DataType::I32, RedOp::Sum, &stream),
        );
        note(&comm, &mut bad);
        let got = buf.to_vec().unwrap();
        let want: Vec<i32> = (0..count)
            .map(|i| (0..n).map(|q| cval(q, r * count + i, k + 400)).sum())
            .collect();
        let at = GUARD + r * bytes;
        if got[at..at + bytes] != to_bytes_i32(&want)[..]
            || got[..GUARD] != guard[..]
            || got[GUARD + n * bytes..2 * GUARD + n * bytes] != guard[..]
        {
            let first = got[at..at + bytes]
                .iter()
                .zip(to_bytes_i32(&want))
                .position(|(a, b)| *a != b);
            bad.push(format!("rank {r}: ReduceScatter count {count}: first wrong byte {first:?}"));
        }
    }
    used.sort();
    println!("USED {used:?}");
    for b in &bad {
        println!("WRONG {b}");
    }
    comm.destroy().expect("destroy");
    assert!(bad.is_empty(), "{} wrong", bad.len());
}

/// Loops AllReduce (f32 sum, `OXCCL_B7_COUNT` elements, in place) until an error arrives; with
/// `OXCCL_B7_ABORT_MS` set, a second thread aborts this rank after that many ms (from the first
/// finished call). Prints `LOOPING`, `GOT-ERROR <code>`, `ABORT-RETURNED`, `CHILD-EXITED`.
fn child_loop(comm: Comm, rank: usize) {
    let count: usize = std::env::var("OXCCL_B7_COUNT").map_or(1 << 16, |v| v.parse().unwrap());
    let abort_ms: Option<u64> = std::env::var("OXCCL_B7_ABORT_MS").ok().map(|v| v.parse().unwrap());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let buf = dev.alloc(count * 4).unwrap();
    let started = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        if let Some(ms) = abort_ms {
            let (comm, started) = (&comm, &started);
            s.spawn(move || {
                while !started.load(std::sync::atomic::Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(ms));
                let t = Instant::now();
                let res = comm.abort();
                println!(
                    "ABORT-RETURNED rank {rank} {:?} after {} ms",
                    res.as_ref().map_err(|e| e.code()),
                    t.elapsed().as_millis()
                );
            });
        }
        let mut iters = 0u64;
        let err = loop {
            if let Err(e) = comm
                .all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream)
                .and_then(|_| stream.synchronize())
            {
                break e;
            }
            if iters == 0 {
                let c = comm.last_choice().unwrap();
                println!("LOOPING rank {rank} {:?} {:?}", c.algo, c.proto);
                started.store(true, std::sync::atomic::Ordering::Release);
            }
            iters += 1;
        };
        started.store(true, std::sync::atomic::Ordering::Release);
        println!("GOT-ERROR {:?} after {iters} iterations: {err}", err.code());
    });
    // A later call fails too.
    match comm.all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream) {
        Ok(()) => println!("LATER-CALL ok"),
        Err(e) => println!("LATER-CALL {:?}", e.code()),
    }
    let t = Instant::now();
    let res = comm.abort();
    println!(
        "FINAL-ABORT {:?} after {} ms",
        res.as_ref().map_err(|e| e.code()),
        t.elapsed().as_millis()
    );
    drop(comm);
    println!("CHILD-EXITED rank {rank}");
}

// ---------------------------------------------------------------------------------------------
// Parent side.

type Env = Vec<(&'static str, String)>;

fn kv(pairs: &[(&'static str, &str)]) -> Env {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// Starts one child rank per entry of `envs` (role `role`, `common` then `envs[r]`) on one id.
fn spawn_group(role: &str, common: &Env, envs: &[Env]) -> Vec<LineChild> {
    let n = envs.len();
    let id = get_unique_id().expect("unique id");
    (0..n)
        .map(|r| {
            let mut cmd = clean_child(&[], ENTRY, [("OXCCL_B7_ROLE", role)]);
            cmd.env("OXCCL_B7_RANK", r.to_string())
                .env("OXCCL_B7_NRANKS", n.to_string())
                .env("OXCCL_B7_ID", hex(&id.to_bytes()))
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "20");
            for (k, v) in common.iter().chain(&envs[r]) {
                cmd.env(k, v);
            }
            LineChild::start(&mut cmd)
        })
        .collect()
}

/// Runs a group to its end (deadline `limit` from now): each rank's (success, output).
fn run_group(role: &str, common: &Env, envs: &[Env], limit: Duration) -> Vec<(bool, String)> {
    let mut ranks = spawn_group(role, common, envs);
    let deadline = Instant::now() + limit;
    ranks.iter_mut().map(|c| c.wait(deadline)).collect()
}

/// A group that must pass: every rank exits successfully with `B7-CHILD-OK`, prints no `WRONG`,
/// and every rank's `DIGEST` (when printed) is rank 0's. Returns the outputs.
fn must_pass(what: &str, role: &str, common: &Env, envs: &[Env], limit: Duration) -> Vec<String> {
    let t = Instant::now();
    let outs = run_group(role, common, envs, limit);
    let mut failures = Vec::new();
    for (r, (ok, out)) in outs.iter().enumerate() {
        if !ok || !out.contains(&format!("B7-CHILD-OK rank {r}")) || out.contains("WRONG") {
            let lines: Vec<&str> = out
                .lines()
                .filter(|l| {
                    l.contains("WRONG")
                        || l.contains("ERR")
                        || l.contains("panicked")
                        || l.contains("exit")
                        || l.contains("killed")
                        || l.starts_with("STDERR")
                })
                .take(12)
                .collect();
            failures.push(format!("rank {r} ({:?}):\n  {}", envs[r], lines.join("\n  ")));
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: {} of {} ranks failed (common {common:?}):\n{}",
        failures.len(),
        outs.len(),
        failures.join("\n")
    );
    let digest = |o: &String| o.lines().find(|l| l.starts_with("DIGEST")).map(str::to_string);
    let d0 = digest(&outs[0].1);
    for (r, (_, o)) in outs.iter().enumerate() {
        assert_eq!(digest(o), d0, "{what}: rank {r}'s results differ from rank 0's");
    }
    if std::env::var("OXCCL_B7_SHOW").is_ok() {
        for (r, (_, o)) in outs.iter().enumerate() {
            eprintln!("---- rank {r}\n{o}");
        }
    }
    eprintln!("{what}: ok in {:.1} s", t.elapsed().as_secs_f64());
    outs.into_iter().map(|(_, o)| o).collect()
}

fn hosts(names: &[&str]) -> Vec<Env> {
    names
        .iter()
        .map(|h| vec![("OXCCL_HOSTID", format!("b7-{h}"))])
        .collect()
}

/// Small FIFOs (many steps per call) and the protocol `proto` forced on the tree.
fn tree_small(proto: &str) -> Env {
    kv(&[
        ("NCCL_ALGO", "tree"),
        ("NCCL_PROTO", proto),
        ("OXCCL_B7_WANT_ALGO", "tree"),
        ("OXCCL_B7_WANT_PROTO", proto),
        ("NCCL_BUFFSIZE", "65536"),
        ("NCCL_LL_BUFFSIZE", "16384"),
        ("NCCL_LL128_BUFFSIZE", "65536"),
        ("NCCL_MAX_NCHANNELS", "2"),
    ])
}

fn used_line(out: &str) -> String {
    out.lines()
        .find(|l| l.starts_with("USED"))
        .unwrap_or("")
        .to_string()
}

const SECS: fn(u64) -> Duration = Duration::from_secs;

// ---------------------------------------------------------------------------------------------
// 1. C11 (B): LL flag wrap on trees across hosts.

#[test]
fn b7_c11_flag_wrap_tree_across_two_hosts() {
    // Hosts A {0, 1} and B {2, 3}: chains over SHM, 0 and 2 joined over NET (proxy). The
    // connections start 40 steps below the LL flag period (2^31 − 1), below 2^32 and below the
    // second period; 1000 tree AllReduces (counts 4, 700, 3001 u32 in turn: 1 to several FIFO
    // steps each) must be exact on every protocol.
    let p = (1u64 << 31) - 1;
    for (proto, start) in [
        ("LL", p - 40),
        ("LL", (1 << 32) - 40),
        ("LL", 2 * p - 40),
        ("LL128", p - 40),
        ("LL128", (1 << 32) - 40),
        ("Simple", p - 40),
        ("Simple", (1 << 32) - 40),
    ] {
        let mut common = tree_small(proto);
        common.push(("OXCCL_TEST_INITIAL_STEP", start.to_string()));
        common.push(("OXCCL_B7_ITERS", "1000".to_string()));
        must_pass(
            &format!("flag wrap {proto} from {start}"),
            "wrap",
            &common,
            &hosts(&["a", "a", "b", "b"]),
            SECS(90),
        );
    }
}

#[test]
fn b7_c11_flag_wrap_with_the_tuner_switching_protocols() {
    // NCCL_PROTO lists every protocol (which enables LL128 over host memory too): counts 2 ..
    // 600 000 u32 make the tuner pick LL, LL128 and Simple (and 1 or 2 channels) in turn on the same tree connections
    // while their steps cross the LL flag period and 2^32.
    let p = (1u64 << 31) - 1;
    for start in [p - 30, (1u64 << 32) - 30] {
        let common = kv(&[
            ("NCCL_ALGO", "tree"),
            ("NCCL_PROTO", "LL,LL128,Simple"),
            ("OXCCL_B7_WANT_ALGO", "tree"),
            ("NCCL_MAX_NCHANNELS", "2"),
            ("OXCCL_B7_ITERS", "240"),
            ("OXCCL_B7_COUNTS", "2,2048,9000,32768,600000,1,2050,333"),
            ("OXCCL_TEST_INITIAL_STEP", &start.to_string()),
        ]);
        let outs = must_pass(
            &format!("flag wrap, auto protocol, from {start}"),
            "wrap",
            &common,
            &hosts(&["a", "a", "b", "b"]),
            SECS(90),
        );
        let used = used_line(&outs[0]);
        assert_eq!(
            used, "USED [(Tree, Ll), (Tree, Ll128), (Tree, Simple)]",
            "the protocols did not all take turns"
        );
    }
}

#[test]
fn b7_probe_sweep() {
    if std::env::var("OXCCL_B7_PROBE").is_err() {
        return;
    }
    let common = kv(&[("NCCL_PROTO", "LL,LL128,Simple"), ("NCCL_MAX_NCHANNELS", "2"), ("NCCL_ALGO", "tree")]);
    let outs = run_group("sweep", &common, &hosts(&["a", "a", "b", "b"]), SECS(30));
    eprintln!("{}", outs[0].1);
}

// ---------------------------------------------------------------------------------------------
// 2. C12: FIFO geometry and channel counts on trees over NET.

#[test]
fn b7_c12_odd_and_smallest_fifos_and_channel_counts_on_trees_over_net() {
    // Hosts A {0, 1}, B {2, 3}, C {4}: two NET levels of the double binary tree. Each variant
    // forces the tree and one protocol; int32 and float sum over 1, 1001 and 40 000 elements, in
    // and out of place, exact.
    let variants: Vec<(&str, Env)> = vec![
        // 65 LL lines per step (an odd line count: 520 data bytes, not a whole 16-byte pack).
        ("LL", kv(&[("NCCL_LL_BUFFSIZE", "8320")])),
        // The smallest LL FIFO: 64 lines per step.
        ("LL", kv(&[("NCCL_LL_BUFFSIZE", "8192")])),
        // 9 LL128 lines per step (odd), and the smallest (8 lines).
        ("LL128", kv(&[("NCCL_LL128_BUFFSIZE", "9216")])),
        ("LL128", kv(&[("NCCL_LL128_BUFFSIZE", "8192")])),
        // 131074 rounds down to 131072 (with a warning).
        ("LL128", kv(&[("NCCL_LL128_BUFFSIZE", "131074")])),
        // The smallest Simple FIFO (1 KiB slots), an odd pack count per slot (1040-byte slots),
        // and 1 000 000 (rounded down to 999 936: 124 992-byte slots).
        ("Simple", kv(&[("NCCL_BUFFSIZE", "8192")])),
        ("Simple", kv(&[("NCCL_BUFFSIZE", "8320")])),
        ("Simple", kv(&[("NCCL_BUFFSIZE", "1000000")])),
        // NTHREADS is a GPU setting; odd values are rounded, results must not change.
        ("LL", kv(&[("NCCL_NTHREADS", "100"), ("NCCL_LL_BUFFSIZE", "8320")])),
        // Channel counts: every channel used (MIN = MAX), and MIN above MAX.
        // (OXCCL_B7_WANT_NCH: every call must run on exactly that many channels.)
        ("LL", kv(&[("NCCL_MAX_NCHANNELS", "1"), ("NCCL_MIN_NCHANNELS", "1"), ("OXCCL_B7_WANT_NCH", "1")])),
        ("Simple", kv(&[("NCCL_MAX_NCHANNELS", "3"), ("NCCL_MIN_NCHANNELS", "3"), ("OXCCL_B7_WANT_NCH", "3")])),
        ("LL128", kv(&[("NCCL_MAX_NCHANNELS", "5"), ("NCCL_MIN_NCHANNELS", "5"), ("OXCCL_B7_WANT_NCH", "5")])),
        ("LL", kv(&[("NCCL_MAX_NCHANNELS", "8"), ("NCCL_MIN_NCHANNELS", "8"), ("OXCCL_B7_WANT_NCH", "8")])),
        ("Simple", kv(&[("NCCL_MAX_NCHANNELS", "8"), ("NCCL_MIN_NCHANNELS", "8"), ("OXCCL_B7_WANT_NCH", "8")])),
        ("LL128", kv(&[("NCCL_MAX_NCHANNELS", "3"), ("NCCL_MIN_NCHANNELS", "8"), ("OXCCL_B7_WANT_NCH", "3")])),
    ];
    for (proto, extra) in variants {
        let mut common = tree_small(proto);
        for (k, v) in extra.iter() {
            common.retain(|(x, _)| x != k);
            common.push((k, v.clone()));
        }
        must_pass(
            &format!("c12 {proto} {extra:?}"),
            "ar",
            &common,
            &hosts(&["a", "a", "b", "b", "c"]),
            SECS(60),
        );
    }
}

/// Runs `init` children (`envs[r]` for rank r) and returns each rank's `INIT-`/`CHOICE` line;
/// every child must exit within 40 s.
fn init_lines(common: &Env, envs: &[Env]) -> Vec<String> {
    let outs = run_group("init", common, envs, SECS(40));
    outs.iter()
        .enumerate()
        .map(|(r, (ok, out))| {
            assert!(ok, "rank {r} ({:?}): {out}", envs[r]);
            let l = out
                .lines()
                .find_map(|l| l.find("INIT-ERR").or_else(|| l.find("CHOICE")).map(|i| &l[i..]))
                .unwrap_or_else(|| panic!("rank {r}: no INIT-ERR/CHOICE line in\n{out}"));
            l.to_string()
        })
        .collect()
}

#[test]
fn b7_c12_values_outside_the_ranges_fail_every_rank_in_bounded_time() {
    // One rank of three hosts has a value outside its accepted range: it fails with an
    // InvalidArgument naming the variable and the range, every other rank with a remote error
    // naming that rank and the same message.
    for (var, val, range) in [
        ("NCCL_BUFFSIZE", "8191", "8192..=1073741824"),
        ("NCCL_BUFFSIZE", "-1", "8192..=1073741824"),
        ("NCCL_LL_BUFFSIZE", "0", "8192..=1073741824"),
        ("NCCL_LL128_BUFFSIZE", "8191", "8192..=1073741824"),
        ("NCCL_MAX_NCHANNELS", "0", "1..=64"),
        ("NCCL_NTHREADS", "abc", "64..=1024"),
    ] {
        let mut envs = hosts(&["a", "b", "b", "c"]);
        envs[2].push((var, val.to_string()));
        let lines = init_lines(&kv(&[("NCCL_ALGO", "tree")]), &envs);
        let own = &lines[2];
        assert!(
            own.starts_with("INIT-ERR rank 2 InvalidArgument: ") && own.contains(var) && own.contains(range),
            "{var}={val}: rank 2: {own}"
        );
        let msg = own.split_once(": ").unwrap().1;
        for (r, l) in lines.iter().enumerate().filter(|(r, _)| *r != 2) {
            assert!(
                l.starts_with(&format!("INIT-ERR rank {r} RemoteError: ")) && l.contains("rank 2") && l.contains(msg),
                "{var}={val}: rank {r}: {l}"
            );
        }
        eprintln!("{var}={val}: {own}");
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Protocols (and algorithms) taking turns back to back on the same connections.

#[test]
fn b7_tuner_switches_protocols_and_algorithms_back_to_back() {
    // No NCCL_ALGO; NCCL_PROTO lists all three (LL128 on over host memory): sizes from 1 element
    // to 4 MiB make the tuner pick tree LL, tree LL128, tree Simple, ring LL, ring LL128 and
    // ring Simple, one call after the other on the same connections, in and out of place; two
    // and three hosts; int32 and half, sum and max.
    let counts = "1,7,1024,2048,2050,4096,8192,30000,32768,70001,262144,1048576";
    for layout in [&["a", "a", "b", "b"][..], &["a", "b", "b", "c", "c", "c"][..]] {
        let common = kv(&[
            ("NCCL_PROTO", "LL,LL128,Simple"),
            ("NCCL_MAX_NCHANNELS", "2"),
            ("OXCCL_B7_DTYPES", "int32,half"),
            ("OXCCL_B7_OPS", "sum,max"),
            ("OXCCL_B7_COUNTS", counts),
        ]);
        let outs = must_pass(
            &format!("auto protocols {layout:?}"),
            "ar",
            &common,
            &hosts(layout),
            SECS(120),
        );
        let used = used_line(&outs[0]);
        for want in ["(Tree, Ll)", "(Tree, Ll128)", "(Tree, Simple)", "(Ring, Simple)"] {
            assert!(used.contains(want), "{layout:?}: {want} never chosen: {used}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. C15: host layouts.

#[test]
fn b7_c15_unequal_non_contiguous_hosts_and_shm_disable() {
    // Tree forced on every protocol for: 1 + 3 ranks; 3 + 1 + 2; hosts a, b, a, b (every ring
    // edge crosses hosts, the chains are 0-2 and 1-3); a, b, b, a, c; NCCL_SHM_DISABLE=1 on one
    // rank of a host only (its chain edge goes over NET); SHM disabled on one whole host.
    let shm_off = |mut e: Vec<Env>, ranks: &[usize]| {
        for &r in ranks {
            e[r].push(("NCCL_SHM_DISABLE", "1".to_string()));
        }
        e
    };
    let layouts: Vec<(&str, Vec<Env>)> = vec![
        ("1+3", hosts(&["a", "b", "b", "b"])),
        ("3+1+2", hosts(&["a", "a", "a", "b", "c", "c"])),
        ("abab", hosts(&["a", "b", "a", "b"])),
        ("abbac", hosts(&["a", "b", "b", "a", "c"])),
        ("shm off on rank 1", shm_off(hosts(&["a", "a", "a", "b", "b"]), &[1])),
        ("shm off on host b", shm_off(hosts(&["a", "a", "b", "b", "b"]), &[2, 3, 4])),
    ];
    for (what, envs) in &layouts {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = tree_small(proto);
            common.push(("OXCCL_B7_COUNTS", "1,1001,40000".to_string()));
            let outs = must_pass(&format!("c15 {what} {proto}"), "ar", &common, envs, SECS(60));
            if *what == "abab" {
                // Every ring edge crosses hosts (NET); the tree chains 0-2 and 1-3 are SHM edges
                // between ranks that are no ring neighbours.
                let want = [
                    "Trees [0] 2/1/-1->0->-1",
                    "Trees [0] 3/-1/-1->1->0",
                    "Trees [0] -1/-1/-1->2->0",
                    "Trees [0] -1/-1/-1->3->1",
                ];
                for (r, w) in want.iter().enumerate() {
                    assert!(outs[r].contains(w), "abab: rank {r}: no {w:?} in\n{}", outs[r]);
                    let ring = format!("Channel 00 : {r} -> {} via NET", (r + 1) % 4);
                    assert!(outs[r].contains(&ring), "abab: rank {r}: no {ring:?}");
                }
            }
        }
    }
}


// ---------------------------------------------------------------------------------------------
// 5. C28 / C29: abort and kill while every rank loops tree AllReduce across hosts.

/// Starts a `loop` group (tree forced, `proto`) and waits until every rank has finished one call.
fn looping(proto: &str, envs: &[Env], extra: &[(&'static str, &str)]) -> Vec<LineChild> {
    let mut common = kv(&[
        ("NCCL_ALGO", "tree"),
        ("NCCL_PROTO", proto),
        ("NCCL_BUFFSIZE", "65536"),
        ("NCCL_LL_BUFFSIZE", "16384"),
        ("NCCL_LL128_BUFFSIZE", "65536"),
        ("NCCL_MAX_NCHANNELS", "2"),
        ("OXCCL_B7_COUNT", "65536"),
    ]);
    common.extend(kv(extra));
    let mut ranks = spawn_group("loop", &common, envs);
    let t = Instant::now();
    while !(0..envs.len()).all(|r| ranks[r].has("LOOPING")) {
        if t.elapsed() > SECS(60) || (0..envs.len()).any(|r| matches!(ranks[r].child.try_wait(), Ok(Some(_)))) {
            panic!(
                "ranks never all looped:\n{}",
                (0..envs.len())
                    .map(|r| ranks[r].text())
                    .collect::<Vec<_>>()
                    .join("\n---\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in 0..envs.len() {
        let want = format!("LOOPING rank {r} Tree {}", Proto::from_name(proto).map_or("?".into(), |p| format!("{p:?}")));
        assert!(ranks[r].has(&want), "rank {r}: no {want:?}:\n{}", ranks[r].text());
    }
    ranks
}

/// Waits (30 s from `from`) for every rank of `ranks` but `skip` to exit successfully after a
/// `GOT-ERROR` line accepted by `ok_err`, with `CHILD-EXITED`, a later call refused and a final
/// abort that returned Ok within 5 s. Returns the slowest exit, seconds after `from`.
fn survivors_exit(
    what: &str,
    ranks: &mut [LineChild],
    skip: Option<usize>,
    from: Instant,
    ok_err: impl Fn(usize, &str) -> bool,
) -> f64 {
    let mut slowest = 0.0f64;
    for (r, rank) in ranks.iter_mut().enumerate() {
        if Some(r) == skip {
            continue;
        }
        let (ok, out) = rank.wait(from + SECS(30));
        let at = from.elapsed().as_secs_f64();
        slowest = slowest.max(at);
        assert!(ok, "{what}: rank {r} did not exit cleanly within 30 s:\n{out}");
        let line = out
            .lines()
            .find_map(|l| l.find("GOT-ERROR").map(|i| &l[i..]))
            .unwrap_or_default();
        assert!(ok_err(r, line), "{what}: rank {r}: {line}\n{out}");
        assert!(out.contains(&format!("CHILD-EXITED rank {r}")), "{what}: rank {r}: {out}");
        assert!(
            out.lines().any(|l| l.starts_with("LATER-CALL ") && !l.contains(" ok")),
            "{what}: rank {r}: a call after the error succeeded:\n{out}"
        );
        let fin = out.lines().find(|l| l.starts_with("FINAL-ABORT")).unwrap_or_default();
        let ms: u64 = fin.rsplit(' ').nth(1).and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
        assert!(fin.starts_with("FINAL-ABORT Ok(())") && ms <= 5000, "{what}: rank {r}: {fin}");
    }
    slowest
}

#[test]
fn b7_c28_abort_from_another_thread_while_tree_loops_across_hosts() {
    // Hosts A {0, 1}, B {2, 3}, C {4}. (a) Only rank 3 (a chain leaf on host B) aborts from a
    // second thread 30 ms into the loop; (b) every rank aborts, at different times. Every abort
    // returns Ok within 5 s; every rank's loop ends with an error (its own abort: InvalidUsage;
    // a peer's: RemoteError) and the process exits within 30 s.
    let layout = ["a", "a", "b", "b", "c"];
    for proto in ["LL", "Simple", "LL128"] {
        // (a) one rank aborts.
        let mut envs = hosts(&layout);
        envs[3].push(("OXCCL_B7_ABORT_MS", "30".to_string()));
        let mut ranks = looping(proto, &envs, &[]);
        let t = Instant::now();
        let s = survivors_exit(&format!("c28 one {proto}"), &mut ranks, None, t, |r, l| {
            if r == 3 {
                l.starts_with("GOT-ERROR InvalidUsage")
            } else {
                l.starts_with("GOT-ERROR RemoteError") || l.starts_with("GOT-ERROR InvalidUsage")
            }
        });
        let out3 = ranks[3].text();
        let ab = out3.lines().find(|l| l.starts_with("ABORT-RETURNED")).unwrap_or_default();
        assert!(ab.starts_with("ABORT-RETURNED rank 3 Ok(())"), "c28 one {proto}: {ab}\n{out3}");
        eprintln!("c28 one rank aborts, {proto}: every rank out in {s:.1} s");
        // (b) every rank aborts (after 10 + 7 r ms).
        let mut envs = hosts(&layout);
        for (r, e) in envs.iter_mut().enumerate() {
            e.push(("OXCCL_B7_ABORT_MS", (10 + 7 * r).to_string()));
        }
        let mut ranks = looping(proto, &envs, &[]);
        let t = Instant::now();
        let s = survivors_exit(&format!("c28 all {proto}"), &mut ranks, None, t, |_, l| {
            l.starts_with("GOT-ERROR RemoteError") || l.starts_with("GOT-ERROR InvalidUsage")
        });
        for (r, rank) in ranks.iter_mut().enumerate() {
            let out = rank.text();
            let ab = out.lines().find(|l| l.starts_with("ABORT-RETURNED")).unwrap_or_default();
            let ms: u64 = ab.rsplit(' ').nth(1).and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
            assert!(
                ab.starts_with(&format!("ABORT-RETURNED rank {r} Ok(())")) && ms <= 5000,
                "c28 all {proto}: rank {r}: {ab}\n{out}"
            );
        }
        eprintln!("c28 every rank aborts, {proto}: every rank out in {s:.1} s");
    }
}

#[test]
fn b7_c29_kill_a_rank_while_tree_loops_across_hosts() {
    // Hosts A {0, 1}, B {2, 3}, C {4, 5}. Killed (SIGKILL) while every rank loops tree
    // AllReduce: rank 1 (a leaf of host A's chain: only SHM edges), rank 2 (host B's chain head:
    // the NET edges of the trees), rank 4 (host C's head). The survivors never poll anything
    // but their own calls: each must get a remote error and exit within 30 s of the kill.
    for (proto, victim) in [("Simple", 1), ("LL", 2), ("LL128", 4), ("Simple", 2)] {
        let envs = hosts(&["a", "a", "b", "b", "c", "c"]);
        let mut ranks = looping(proto, &envs, &[]);
        ranks[victim].child.kill().unwrap();
        let _ = ranks[victim].child.wait();
        let t = Instant::now();
        let s = survivors_exit(
            &format!("c29 kill {victim} {proto}"),
            &mut ranks,
            Some(victim),
            t,
            |_, l| l.starts_with("GOT-ERROR RemoteError") && l.contains("aborted"),
        );
        eprintln!("c29 kill rank {victim}, {proto}: survivors out in {s:.1} s");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Settings that differ across ranks.

#[test]
fn b7_mismatched_buffer_sizes_fail_init_on_every_rank() {
    // Hosts A {0, 1}, B {2, 3}; rank 3 alone sets a different FIFO size (the tree edges to rank 3
    // are SHM from rank 2; its ring edge to rank 0 is NET): every rank must fail init, in bounded
    // time, naming the disagreement; none may run collectives on mismatched FIFOs.
    for (var, val) in [
        ("NCCL_BUFFSIZE", "131072"),
        ("NCCL_LL_BUFFSIZE", "32768"),
        ("NCCL_LL128_BUFFSIZE", "131072"),
        ("NCCL_MAX_NCHANNELS", "3"),
    ] {
        let mut envs = hosts(&["a", "a", "b", "b"]);
        envs[3].push((var, val.to_string()));
        let lines = init_lines(&tree_small("LL"), &envs);
        for (r, l) in lines.iter().enumerate() {
            assert!(
                l.starts_with(&format!("INIT-ERR rank {r} ")) && (l.contains("InvalidUsage") || l.contains("RemoteError")),
                "{var}={val} on rank 3: rank {r}: {l}\nall: {lines:#?}"
            );
        }
        eprintln!("{var}={val} on rank 3: {}", lines[0]);
    }
}

#[test]
fn b7_mismatched_call_settings_fail_or_agree_never_hang() {
    // Settings read per rank that decide each call's plan: one rank alone sets a different
    // NCCL_PROTO, NCCL_MIN_NCHANNELS or NCCL_ALGO (tree wanted everywhere, so trees are set up).
    // The brief: fail clearly or agree, never hang. Each rank runs a few tree-size AllReduces;
    // within 30 s every rank must either pass exactly or report an error.
    let cases: Vec<(&str, Env, Env)> = vec![
        (
            "NCCL_PROTO=LL on rank 0, Simple elsewhere",
            kv(&[("NCCL_ALGO", "tree")]),
            kv(&[("NCCL_PROTO", "LL")]),
        ),
        (
            "NCCL_MIN_NCHANNELS=2 on rank 0 only",
            kv(&[("NCCL_ALGO", "tree"), ("NCCL_PROTO", "Simple"), ("NCCL_MAX_NCHANNELS", "2")]),
            kv(&[("NCCL_MIN_NCHANNELS", "2")]),
        ),
        (
            "NCCL_ALGO=tree on rank 0, unset elsewhere",
            kv(&[("NCCL_PROTO", "Simple")]),
            kv(&[("NCCL_ALGO", "tree")]),
        ),
    ];
    let mut hung = Vec::new();
    for (what, common, rank0) in cases {
        let mut envs = hosts(&["a", "a", "b", "b"]);
        let mut common = common;
        common.extend(kv(&[
            ("OXCCL_B7_COUNTS", "1000,65536"),
            ("OXCCL_B7_DTYPES", "float"),
        ]));
        if !rank0.iter().any(|(k, _)| *k == "NCCL_PROTO") && !common.iter().any(|(k, _)| *k == "NCCL_PROTO") {
            unreachable!();
        }
        if what.starts_with("NCCL_PROTO") {
            for e in envs.iter_mut().skip(1) {
                e.push(("NCCL_PROTO", "Simple".to_string()));
            }
        }
        envs[0].extend(rank0);
        let t = Instant::now();
        let outs = run_group("ar", &common, &envs, SECS(30));
        let verdict: Vec<String> = outs
            .iter()
            .enumerate()
            .map(|(r, (ok, out))| {
                if *ok && out.contains(&format!("B7-CHILD-OK rank {r}")) && !out.contains("WRONG") {
                    "pass".to_string()
                } else if out.contains("did not exit in time") {
                    "HUNG (killed at the 30 s deadline)".to_string()
                } else if let Some(l) = out.lines().find(|l| l.contains("CALL-ERR") || l.contains("INIT-ERR")) {
                    format!("error: {l}")
                } else if let Some(l) = out.lines().find(|l| l.contains("WRONG")) {
                    format!("WRONG RESULT: {l}")
                } else {
                    format!("failed: {}", out.lines().last().unwrap_or_default())
                }
            })
            .collect();
        eprintln!("{what} ({:.1} s): {verdict:#?}", t.elapsed().as_secs_f64());
        let agree = verdict.iter().all(|v| v == "pass");
        let all_fail_clearly = verdict.iter().all(|v| v.starts_with("error: "));
        if !agree && !all_fail_clearly {
            hung.push(format!("{what}: {verdict:?}"));
        }
    }
    assert!(hung.is_empty(), "ranks neither agreed nor failed clearly:\n{}", hung.join("\n"));
}
