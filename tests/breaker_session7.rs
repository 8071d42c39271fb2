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
//!    protocol and channel count, SHM disabled on some ranks, a rank killed;
//! 8. teardown and lifetime: two communicators at once, re-init, a peer exiting after finalize,
//!    a rank vanishing before teardown, a rank killed during the tree setup; C13 on trees; trees
//!    with every edge over NET (2..7 hosts, the pattern hooks).
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
                println!(
                    "SWEEP {} {:?}",
                    4usize << k,
                    c.map(|c| c.map(|c| (c.algo, c.proto, c.nchannels)))
                );
            }
            comm.destroy().expect("destroy");
        }
        "finalize" => {
            // One tree AllReduce, then finalize; the rank named by OXCCL_B7_LINGER stays 600 ms
            // after finalize (its host peers have exited by then), then asks for the async error
            // and destroys.
            let dev = comm.device();
            let stream = dev.new_stream().unwrap();
            let buf = dev.alloc(4096).unwrap();
            buf.write(0, &vec![1u8; 4096]).unwrap();
            let res = comm
                .all_reduce(&buf, &buf, 1024, DataType::I32, RedOp::Sum, &stream)
                .and_then(|_| stream.synchronize())
                .and_then(|_| comm.get_async_error());
            let want = (0x0101_0101i32.wrapping_mul(nranks as i32))
                .to_ne_bytes()
                .repeat(1024);
            // A call that completed without error (synchronize and the async error both Ok) must
            // have the exact result; one that reports an error may hold anything.
            match res {
                Ok(()) => {
                    let got = buf.to_vec().unwrap();
                    println!(
                        "AR {}",
                        if got == want {
                            "exact"
                        } else {
                            "WRONG (no error reported)"
                        }
                    );
                }
                Err(e) => println!("AR-ERR {:?}: {e}", e.code()),
            }
            if std::env::var("OXCCL_B7_VANISH").is_ok_and(|v| v == rank.to_string()) {
                // This rank's process ends without finalize or destroy (a crash after the last
                // collective).
                println!("VANISH rank {rank}");
                std::process::exit(0);
            }
            let t = Instant::now();
            let fin = comm.finalize().map_err(|e| e.to_string());
            println!("FINALIZE {fin:?} after {} ms", t.elapsed().as_millis());
            if std::env::var("OXCCL_B7_LINGER").is_ok_and(|v| v == rank.to_string()) {
                std::thread::sleep(Duration::from_millis(600));
            }
            println!("ASYNC {:?}", comm.get_async_error().map_err(|e| e.to_string()));
            let t = Instant::now();
            let d = comm.destroy().map_err(|e| e.to_string());
            println!("DESTROY {d:?} after {} ms", t.elapsed().as_millis());
        }
        "two" => child_two_comms(comm),
        "reinit" => {
            // Three communicators one after the other in the same processes (the proxy thread
            // and the tree segments of a destroyed one must not disturb the next).
            let mut comm = comm;
            for (k, var) in ["OXCCL_B7_ID2", "OXCCL_B7_ID3", ""].into_iter().enumerate() {
                let dev = comm.device();
                let stream = dev.new_stream().unwrap();
                let bad = queue_and_check(&comm, &stream, k as u64, &[1, 1001, 40000]);
                assert!(bad.is_empty(), "communicator {k}: {bad:?}");
                println!(
                    "REINIT {k} ok {:?}",
                    comm.last_choice().map(|c| (c.algo, c.proto))
                );
                comm.destroy().expect("destroy");
                if var.is_empty() {
                    break;
                }
                let id = UniqueId::from_bytes(&unhex(&env_var(var))).unwrap();
                comm = Comm::init_rank(nranks, &id, rank, Device::Cpu(rank)).expect("init_rank again");
            }
        }
        "c13" => {
            // NCCL_ALGO=tree: Broadcast has no tree; the call must be refused naming the op, and
            // the communicator stays in step (a tree AllReduce after it is exact).
            let dev = comm.device();
            let stream = dev.new_stream().unwrap();
            let buf = dev.alloc(4000).unwrap();
            match comm.broadcast(Some((&buf).into()), &buf, 1000, DataType::I32, 0, &stream) {
                Ok(()) => println!("C13-BCAST ok {:?}", comm.last_choice()),
                Err(e) => println!("C13-BCAST-ERR {:?}: {e}", e.code()),
            }
            let bad = queue_and_check(&comm, &stream, 99, &[1, 1001, 40000]);
            println!("C13-AR {bad:?} {:?}", comm.last_choice().map(|c| c.algo));
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
    let wnch: Option<u32> = std::env::var("OXCCL_B7_WANT_NCH")
        .ok()
        .map(|v| v.parse().unwrap());
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    let mut wrong = 0usize;
    let mut calls = 0usize;
    let mut used: Vec<(Algo, Proto)> = Vec::new();
    let max = *counts.iter().max().unwrap();
    // Extra byte offsets of the send and receive data past the front guard (element-aligned,
    // not 16-byte aligned: the kernels' unaligned paths).
    let soff: usize = std::env::var("OXCCL_B7_SOFF").map_or(0, |v| v.parse().unwrap());
    let roff: usize = std::env::var("OXCCL_B7_ROFF").map_or(0, |v| v.parse().unwrap());
    for _ in 0..reps {
        for &dtype in &dtypes {
            let size = dtype.size();
            let send = dev.alloc(max * size + 2 * GUARD + soff).unwrap();
            let recv = dev.alloc(max * size + 2 * GUARD + roff).unwrap();
            for &op in &ops {
                for &count in &counts {
                    let bytes = count * size;
                    let seed = (calls as u64) << 8 | 7;
                    let input =
                        check::fill_input(Func::AllReduce, dtype, op, rank, nranks, seed, count).unwrap();
                    let want = check::expected(Func::AllReduce, dtype, op, nranks, seed, count).unwrap();
                    for in_place in [false, true] {
                        let guard = vec![0xa5u8; GUARD];
                        let (sf, rf) = (GUARD + soff, GUARD + if in_place { soff } else { roff });
                        let mut s = vec![0xa5u8; sf];
                        s.extend_from_slice(&input);
                        s.extend_from_slice(&guard);
                        send.write(0, &s).unwrap();
                        let out = if in_place { &send } else { &recv };
                        if !in_place {
                            let mut r = vec![0xa5u8; rf];
                            r.extend_from_slice(&check::poison(dtype, count));
                            r.extend_from_slice(&guard);
                            recv.write(0, &r).unwrap();
                        }
                        let sv = send.slice(sf, bytes).unwrap();
                        let rv = out.slice(rf, bytes).unwrap();
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
                        let got = &all[rf..rf + bytes];
                        let n = check::count_wrong(dtype, op, got, &want, nranks);
                        let first = check::first_wrong(dtype, op, got, &want, nranks);
                        let guards_ok = all[..rf].iter().all(|&b| b == 0xa5)
                            && all[rf + bytes..rf + bytes + GUARD] == guard[..];
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

/// Queues an int32-sum AllReduce (out of place) per count of `counts` on `stream` without
/// synchronizing in between, then synchronizes and checks each exactly; the failures.
fn queue_and_check(comm: &Comm, stream: &oxccl::Stream, salt: u64, counts: &[usize]) -> Vec<String> {
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let mut pending = Vec::new();
    for (k, &count) in counts.iter().enumerate() {
        let seed = salt << 16 | k as u64;
        let input = check::fill_input(
            Func::AllReduce,
            DataType::I32,
            RedOp::Sum,
            rank,
            nranks,
            seed,
            count,
        )
        .unwrap();
        let want = check::expected(Func::AllReduce, DataType::I32, RedOp::Sum, nranks, seed, count).unwrap();
        let send = dev.alloc(count * 4).unwrap();
        let recv = dev.alloc(count * 4).unwrap();
        send.write(0, &input).unwrap();
        recv.write(0, &check::poison(DataType::I32, count)).unwrap();
        if let Err(e) = comm.all_reduce(&send, &recv, count, DataType::I32, RedOp::Sum, stream) {
            return vec![format!("rank {rank}: call {k}: {e}")];
        }
        pending.push((count, send, recv, want));
    }
    if let Err(e) = stream.synchronize() {
        return vec![format!("rank {rank}: synchronize: {e}")];
    }
    pending
        .iter()
        .filter_map(|(count, _, recv, want)| {
            let got = recv.to_vec().unwrap();
            let n = check::count_wrong(DataType::I32, RedOp::Sum, &got, want, nranks);
            (n > 0).then(|| format!("rank {rank}: salt {salt} count {count}: {n} wrong"))
        })
        .collect()
}

/// Two communicators of the same ranks (ids `OXCCL_B7_ID`, `OXCCL_B7_ID2`), each with its own
/// stream: AllReduces queued on both, alternating, before either is synchronized, then checked.
fn child_two_comms(a: Comm) {
    let (rank, nranks) = (a.rank(), a.nranks());
    let id2 = UniqueId::from_bytes(&unhex(&env_var("OXCCL_B7_ID2"))).unwrap();
    let b = Comm::init_rank(nranks, &id2, rank, Device::Cpu(rank)).expect("second init_rank");
    let (sa, sb) = (a.device().new_stream().unwrap(), b.device().new_stream().unwrap());
    let mut bad = Vec::new();
    for round in 0..4u64 {
        std::thread::scope(|s| {
            let ha = s.spawn(|| queue_and_check(&a, &sa, 2 * round, &[1, 1001, 40000, 3]));
            let hb = s.spawn(|| queue_and_check(&b, &sb, 2 * round + 1, &[40000, 7, 1001]));
            bad.extend(ha.join().unwrap());
            bad.extend(hb.join().unwrap());
        });
    }
    for b in &bad {
        println!("WRONG {b}");
    }
    println!(
        "TWO {:?} {:?}",
        a.last_choice().map(|c| (c.algo, c.proto)),
        b.last_choice().map(|c| (c.algo, c.proto))
    );
    b.destroy().expect("destroy b");
    a.destroy().expect("destroy a");
    assert!(bad.is_empty());
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
    let wnch: Option<u32> = std::env::var("OXCCL_B7_WANT_NCH")
        .ok()
        .map(|v| v.parse().unwrap());
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
        if wproto.is_some_and(|p| p != c.proto) || wnch.is_some_and(|n| n != c.nchannels) {
            bad.push(format!("rank {r}: {:?} ran {:?}", c.func, c));
        }
    };
    let cmp = |what: String, buf: &DeviceBuffer, want: Vec<u8>, bad: &mut Vec<String>| {
        let got = buf.to_vec().unwrap();
        let want = framed(&want);
        if got[..want.len()] != want[..] {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            bad.push(format!(
                "rank {r}: {what}: first wrong byte {first:?} (guard {GUARD})"
            ));
        }
    };
    for (k, &count) in counts.iter().enumerate() {
        let bytes = count * 4;
        // AllReduce in place.
        let buf = dev.alloc(bytes * n + 2 * GUARD).unwrap();
        let input: Vec<i32> = (0..count).map(|i| cval(r, i, k)).collect();
        buf.write(0, &framed(&to_bytes_i32(&input))).unwrap();
        let s = buf.slice(GUARD, bytes).unwrap();
        run(
            "allreduce",
            comm.all_reduce(s, s, count, DataType::I32, RedOp::Sum, &stream),
        );
        note(&comm, &mut bad);
        let want: Vec<i32> = (0..count).map(|i| (0..n).map(|q| cval(q, i, k)).sum()).collect();
        cmp(
            format!("AllReduce count {count}"),
            &buf,
            to_bytes_i32(&want),
            &mut bad,
        );
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
                comm.reduce(
                    s,
                    (r == root).then_some(s),
                    count,
                    DataType::I32,
                    RedOp::Sum,
                    root,
                    &stream,
                ),
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
        run(
            "allgather",
            comm.all_gather(blk, all, count, DataType::I32, &stream),
        );
        note(&comm, &mut bad);
        let want: Vec<i32> = (0..n * count)
            .map(|j| cval(j / count, j % count, k + 300))
            .collect();
        cmp(
            format!("AllGather count {count}"),
            &buf,
            to_bytes_i32(&want),
            &mut bad,
        );
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
            bad.push(format!(
                "rank {r}: ReduceScatter count {count}: first wrong byte {first:?}"
            ));
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
    let abort_ms: Option<u64> = std::env::var("OXCCL_B7_ABORT_MS")
        .ok()
        .map(|v| v.parse().unwrap());
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
    let (id2, id3) = (
        get_unique_id().expect("unique id"),
        get_unique_id().expect("unique id"),
    );
    (0..n)
        .map(|r| {
            let mut cmd = clean_child(&[], ENTRY, [("OXCCL_B7_ROLE", role)]);
            cmd.env("OXCCL_B7_RANK", r.to_string())
                .env("OXCCL_B7_NRANKS", n.to_string())
                .env("OXCCL_B7_ID", hex(&id.to_bytes()))
                .env("OXCCL_B7_ID2", hex(&id2.to_bytes()))
                .env("OXCCL_B7_ID3", hex(&id3.to_bytes()))
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

/// The number before a line's last word (`... 123 ms`), `u64::MAX` when there is none: how long a
/// child says a step took.
fn millis_before_unit(line: &str) -> u64 {
    line.rsplit(' ')
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX)
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
        // The largest start the hook accepts (i64::MAX / 2) and just below a multiple of the
        // flag period near it: no step arithmetic may overflow or lose the period.
        ("LL", (i64::MAX / 2) as u64 - 1200),
        ("LL128", (i64::MAX / 2) as u64 - 1200),
        ("Simple", (i64::MAX / 2) as u64 - 1200),
        ("LL", ((i64::MAX / 2) as u64 / p) * p - 40),
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
    // 600 000 u32 make the tuner pick LL, LL128 and Simple (and 1 or 2 channels) in turn on the
    // same tree connections while their steps cross the LL flag period and 2^32.
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
        // 3 000 000 (374 992-byte slots, halved for large calls to 187 488 / 93 744-byte chunks
        // while fewer than 8 chunks per channel and tree level) and the default 4 MiB, with a
        // call of 1 000 003 elements (several MB: the halving loop of plan()).
        (
            "Simple",
            kv(&[
                ("NCCL_BUFFSIZE", "3000000"),
                ("OXCCL_B7_COUNTS", "1,40000,1000003"),
            ]),
        ),
        (
            "Simple",
            kv(&[("NCCL_BUFFSIZE", "4194304"), ("OXCCL_B7_COUNTS", "1001,1000003")]),
        ),
        // Element-aligned but not 16-byte-aligned buffers (send 4 bytes in, receive 12 bytes in,
        // int32/float; in place at 4 bytes).
        ("LL", kv(&[("OXCCL_B7_SOFF", "4"), ("OXCCL_B7_ROFF", "12")])),
        ("LL128", kv(&[("OXCCL_B7_SOFF", "4"), ("OXCCL_B7_ROFF", "12")])),
        ("Simple", kv(&[("OXCCL_B7_SOFF", "4"), ("OXCCL_B7_ROFF", "12")])),
        // half at 2-byte offsets.
        (
            "Simple",
            kv(&[
                ("OXCCL_B7_SOFF", "2"),
                ("OXCCL_B7_ROFF", "6"),
                ("OXCCL_B7_DTYPES", "half,int8"),
            ]),
        ),
        (
            "LL",
            kv(&[
                ("OXCCL_B7_SOFF", "2"),
                ("OXCCL_B7_ROFF", "6"),
                ("OXCCL_B7_DTYPES", "half,int8"),
            ]),
        ),
        // NTHREADS is a GPU setting; odd values are rounded, results must not change.
        (
            "LL",
            kv(&[("NCCL_NTHREADS", "100"), ("NCCL_LL_BUFFSIZE", "8320")]),
        ),
        // Channel counts: every channel used (MIN = MAX), and MIN above MAX.
        // (OXCCL_B7_WANT_NCH: every call must run on exactly that many channels.)
        (
            "LL",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "1"),
                ("NCCL_MIN_NCHANNELS", "1"),
                ("OXCCL_B7_WANT_NCH", "1"),
            ]),
        ),
        (
            "Simple",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "3"),
                ("NCCL_MIN_NCHANNELS", "3"),
                ("OXCCL_B7_WANT_NCH", "3"),
            ]),
        ),
        (
            "LL128",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "5"),
                ("NCCL_MIN_NCHANNELS", "5"),
                ("OXCCL_B7_WANT_NCH", "5"),
            ]),
        ),
        (
            "LL",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "8"),
                ("NCCL_MIN_NCHANNELS", "8"),
                ("OXCCL_B7_WANT_NCH", "8"),
            ]),
        ),
        (
            "Simple",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "8"),
                ("NCCL_MIN_NCHANNELS", "8"),
                ("OXCCL_B7_WANT_NCH", "8"),
            ]),
        ),
        (
            "LL128",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "3"),
                ("NCCL_MIN_NCHANNELS", "8"),
                ("OXCCL_B7_WANT_NCH", "3"),
            ]),
        ),
        // The most channels (64: tree NET tags TREE_TAG + c and + 0x100 + c, 64 proxy
        // connections per direction and tree edge).
        (
            "LL",
            kv(&[
                ("NCCL_MAX_NCHANNELS", "64"),
                ("NCCL_MIN_NCHANNELS", "64"),
                ("OXCCL_B7_WANT_NCH", "64"),
                ("OXCCL_B7_COUNTS", "1,1001,300001"),
            ]),
        ),
        // Several data sockets per NET connection (2 threads × 3 sockets) with the default
        // 4 MiB FIFOs: tree Simple steps split across sockets, partial steps included.
        (
            "Simple",
            kv(&[
                ("NCCL_BUFFSIZE", "4194304"),
                ("NCCL_SOCKET_NTHREADS", "2"),
                ("NCCL_NSOCKS_PERTHREAD", "3"),
                ("OXCCL_B7_COUNTS", "1,1001,1000003,333333"),
            ]),
        ),
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
                l.starts_with(&format!("INIT-ERR rank {r} RemoteError: "))
                    && l.contains("rank 2")
                    && l.contains(msg),
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
        (
            "shm off on rank 1",
            shm_off(hosts(&["a", "a", "a", "b", "b"]), &[1]),
        ),
        (
            "shm off on host b",
            shm_off(hosts(&["a", "a", "b", "b", "b"]), &[2, 3, 4]),
        ),
    ];
    for (what, envs) in &layouts {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = tree_small(proto);
            common.push(("OXCCL_B7_COUNTS", "1,1001,40000".to_string()));
            let outs = must_pass(&format!("c15 {what} {proto}"), "ar", &common, envs, SECS(60));
            if *what == "abab" {
                // The ring visits each host's ranks together (0 2 1 3, as NCCL's rings visit a
                // node's GPUs together): 0 -> 2 and 1 -> 3 over SHM, 2 -> 1 and 3 -> 0 over NET;
                // the tree chains are 0-2 and 1-3.
                let want = [
                    "Trees [0] 2/1/-1->0->-1",
                    "Trees [0] 3/-1/-1->1->0",
                    "Trees [0] -1/-1/-1->2->0",
                    "Trees [0] -1/-1/-1->3->1",
                ];
                for (r, w) in want.iter().enumerate() {
                    assert!(outs[r].contains(w), "abab: rank {r}: no {w:?} in\n{}", outs[r]);
                    let (next, via) = [(2, "SHM"), (3, "SHM"), (1, "NET"), (0, "NET")][r];
                    let ring = format!("Channel 00 : {r} -> {next} via {via}");
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
        if t.elapsed() > SECS(60) || (0..envs.len()).any(|r| matches!(ranks[r].child.try_wait(), Ok(Some(_))))
        {
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
        let want = format!(
            "LOOPING rank {r} Tree {}",
            Proto::from_name(proto).map_or("?".into(), |p| format!("{p:?}"))
        );
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
        assert!(
            out.contains(&format!("CHILD-EXITED rank {r}")),
            "{what}: rank {r}: {out}"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("LATER-CALL ") && !l.contains(" ok")),
            "{what}: rank {r}: a call after the error succeeded:\n{out}"
        );
        let fin = out
            .lines()
            .find(|l| l.starts_with("FINAL-ABORT"))
            .unwrap_or_default();
        let ms = millis_before_unit(fin);
        assert!(
            fin.starts_with("FINAL-ABORT Ok(())") && ms <= 5000,
            "{what}: rank {r}: {fin}"
        );
    }
    slowest
}

#[test]
fn b7_c28_abort_from_another_thread_while_tree_loops_across_hosts() {
    // Hosts A {0, 1}, B {2, 3}, C {4}. (a) Only rank 3 (a chain leaf on host B) aborts from a
    // second thread 0, 5, 30 or 50 ms into the loop; (b) every rank aborts, at different times. Every abort
    // returns Ok within 5 s; every rank's loop ends with an error (its own abort: InvalidUsage;
    // a peer's: RemoteError) and the process exits within 30 s.
    let layout = ["a", "a", "b", "b", "c"];
    for (proto, delay) in [("LL", "0"), ("Simple", "5"), ("LL128", "30"), ("Simple", "50")] {
        // (a) one rank aborts.
        let mut envs = hosts(&layout);
        envs[3].push(("OXCCL_B7_ABORT_MS", delay.to_string()));
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
        let ab = out3
            .lines()
            .find(|l| l.starts_with("ABORT-RETURNED"))
            .unwrap_or_default();
        assert!(
            ab.starts_with("ABORT-RETURNED rank 3 Ok(())"),
            "c28 one {proto}: {ab}\n{out3}"
        );
        eprintln!("c28 one rank aborts after {delay} ms, {proto}: every rank out in {s:.1} s");
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
            let ab = out
                .lines()
                .find(|l| l.starts_with("ABORT-RETURNED"))
                .unwrap_or_default();
            let ms = millis_before_unit(ab);
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

// FAILED at 934c32e (passes since 6266d01, which fixed it): NCCL_LL128_BUFFSIZE differing on one rank is
// refused (good: InvalidUsage on every rank, no hang), but the message names "NCCL_MAX_NCHANNELS,
// NCCL_BUFFSIZE and NCCL_LL_BUFFSIZE" only, never the variable that differs (host/comm.rs check_peers:
// conn_bytes includes the LL128 FIFOs but the message's list omits NCCL_LL128_BUFFSIZE). The other three
// variables pass.
#[test]
fn b7_mismatched_buffer_sizes_fail_init_on_every_rank() {
    // Hosts A {0, 1}, B {2, 3}; rank 3 alone sets a different FIFO size (the tree edges to rank 3
    // are SHM from rank 2; its ring edge to rank 0 is NET): every rank must fail init, in bounded
    // time, naming the disagreement; none may run collectives on mismatched FIFOs.
    let mut misnamed = Vec::new();
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
                l.starts_with(&format!("INIT-ERR rank {r} "))
                    && (l.contains("InvalidUsage") || l.contains("RemoteError")),
                "{var}={val} on rank 3: rank {r}: {l}\nall: {lines:#?}"
            );
        }
        // The message must name the variable that differs.
        if !lines[0].contains(var) {
            misnamed.push(format!("{var}={val} on rank 3: {}", lines[0]));
        }
        eprintln!("{var}={val} on rank 3: {}", lines[0]);
    }
    assert!(
        misnamed.is_empty(),
        "messages not naming the variable:\n{}",
        misnamed.join("\n")
    );
}

// FAILED at 934c32e (passes since 6266d01, which fixed it): every case hangs on every rank (still running at
// the deadline, no error): NCCL_PROTO, NCCL_ALGO and NCCL_MIN_NCHANNELS are read per rank (Comm::init_rank's
// `local` closure: Selection::from_env, Params::from_env) and all-gathered only to report errors, never
// compared, so `Comm::plan` picks a different protocol / algorithm / channel count on one rank and the
// kernels wait for each other forever. Not specific to trees (a one-host ring with NCCL_PROTO=LL on one rank
// and Simple on the others hangs the same way).
#[test]
fn b7_mismatched_call_settings_fail_or_agree_never_hang() {
    // Settings read per rank that decide each call's plan: one rank alone sets a different
    // NCCL_PROTO, NCCL_MIN_NCHANNELS or NCCL_ALGO (tree wanted everywhere, so trees are set up).
    // The brief: fail clearly or agree, never hang. Each rank runs a few tree-size AllReduces;
    // within 12 s (a passing run takes well under 1 s) every rank must either pass exactly or
    // report an error.
    let cases: Vec<(&str, Env, Env)> = vec![
        (
            "NCCL_PROTO=LL on rank 0, Simple elsewhere",
            kv(&[("NCCL_ALGO", "tree")]),
            kv(&[("NCCL_PROTO", "LL")]),
        ),
        (
            "NCCL_MIN_NCHANNELS=2 on rank 0 only",
            kv(&[
                ("NCCL_ALGO", "tree"),
                ("NCCL_PROTO", "Simple"),
                ("NCCL_MAX_NCHANNELS", "2"),
            ]),
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
        if what.starts_with("NCCL_PROTO") {
            for e in envs.iter_mut().skip(1) {
                e.push(("NCCL_PROTO", "Simple".to_string()));
            }
        }
        envs[0].extend(rank0);
        let t = Instant::now();
        // Wait for every rank up to the deadline; which ranks are still running then is recorded
        // before any is killed (killing one makes the others fail with a remote error).
        let mut ranks = spawn_group("ar", &common, &envs);
        let deadline = t + SECS(12);
        while Instant::now() < deadline && ranks.iter_mut().any(|c| matches!(c.child.try_wait(), Ok(None))) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let running: Vec<bool> = ranks
            .iter_mut()
            .map(|c| matches!(c.child.try_wait(), Ok(None)))
            .collect();
        let outs: Vec<(bool, String)> = ranks.iter_mut().map(|c| c.wait(Instant::now())).collect();
        let verdict: Vec<String> = outs
            .iter()
            .enumerate()
            .map(|(r, (ok, out))| {
                let last_call = out.lines().filter(|l| l.contains("CALL-ERR")).last();
                if running[r] {
                    "HUNG (still running at the 12 s deadline)".to_string()
                } else if *ok && out.contains(&format!("B7-CHILD-OK rank {r}")) && !out.contains("WRONG") {
                    "pass".to_string()
                } else if let Some(l) = last_call.or_else(|| out.lines().find(|l| l.contains("INIT-ERR"))) {
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
    assert!(
        hung.is_empty(),
        "ranks neither agreed nor failed clearly:\n{}",
        hung.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Per-channel rings across hosts.

/// Channel `c`'s ring on two hosts of the mesh fixture: `MESH_RINGS[c % 6]` on host A, then the
/// same order on host B (ranks + 4).
fn mesh_ring(c: usize) -> Vec<usize> {
    let g = common::topo::MESH_RINGS[c % 6];
    g.iter().copied().chain(g.iter().map(|&x| x + 4)).collect()
}

fn mesh_envs(nch: u32) -> Vec<Env> {
    let topo = common::topo::fixture("nvlink-mesh-4gpu-topo.xml");
    (0..8)
        .map(|r| {
            vec![
                (
                    "OXCCL_HOSTID",
                    if r < 4 { "b7-mesh-a" } else { "b7-mesh-b" }.to_string(),
                ),
                ("NCCL_TOPO_FILE", topo.display().to_string()),
                ("NCCL_MAX_NCHANNELS", nch.to_string()),
                ("NCCL_MIN_NCHANNELS", nch.to_string()),
                ("OXCCL_B7_WANT_NCH", nch.to_string()),
                ("NCCL_BUFFSIZE", "65536".to_string()),
                ("NCCL_LL_BUFFSIZE", "16384".to_string()),
                ("NCCL_LL128_BUFFSIZE", "65536".to_string()),
            ]
        })
        .collect()
}

/// Every rank's channel lines agree with [`mesh_ring`] for every channel (NET between hosts and
/// to or from a rank of `shm_off`).
fn check_mesh_rings(what: &str, outs: &[String], nch: usize) {
    check_mesh_rings_off(what, outs, nch, &[])
}

fn check_mesh_rings_off(what: &str, outs: &[String], nch: usize, shm_off: &[usize]) {
    for (r, out) in outs.iter().enumerate() {
        for c in 0..nch {
            let g = mesh_ring(c);
            let i = g.iter().position(|&x| x == r).unwrap();
            let next = g[(i + 1) % 8];
            let same = (next < 4) == (r < 4) && !shm_off.contains(&r) && !shm_off.contains(&next);
            let via = if same { "SHM" } else { "NET/Socket/0" };
            let line = format!("Channel {c:02} : {r} -> {next} via {via}");
            assert!(out.contains(&line), "{what}: rank {r}: no {line:?} in\n{out}");
        }
    }
}

#[test]
fn b7_per_channel_rings_across_hosts_every_collective_in_place() {
    // Two hosts of four ranks on the NVLink-mesh fixture (rings differ per channel, so a rank's
    // NET peers differ per channel); 1, 3 and 8 channels (8: channels 6 and 7 repeat rings 0 and
    // 1), every call on exactly that many channels; AllReduce, Broadcast and Reduce from every
    // root, AllGather and ReduceScatter, all in place, int32, on each protocol.
    for nch in [1u32, 3, 8] {
        for proto in ["LL", "LL128", "Simple"] {
            let common = kv(&[
                ("NCCL_PROTO", proto),
                ("OXCCL_B7_WANT_PROTO", proto),
                ("OXCCL_B7_COUNTS", "1,1001,24577"),
            ]);
            let what = format!("mesh rings {nch} channels {proto}");
            let outs = must_pass(&what, "colls", &common, &mesh_envs(nch), SECS(90));
            check_mesh_rings(&what, &outs, nch as usize);
        }
    }
}

#[test]
fn b7_tree_on_per_channel_rings_across_hosts() {
    // The same communicators with the tree forced: each host's chain follows channel 0's ring;
    // tree AllReduce on each protocol with 2 and 8 channels, every dtype-op pair of the list,
    // in and out of place.
    for nch in [2u32, 8] {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = kv(&[
                ("NCCL_ALGO", "tree"),
                ("OXCCL_B7_WANT_ALGO", "tree"),
                ("NCCL_PROTO", proto),
                ("OXCCL_B7_WANT_PROTO", proto),
                ("OXCCL_B7_DTYPES", "int8,bfloat16,int64"),
                ("OXCCL_B7_OPS", "sum,prod,min,avg"),
                ("OXCCL_B7_COUNTS", "1,1001,40000"),
            ]);
            if nch == 8 {
                common.push(("OXCCL_B7_DTYPES", "float".to_string()));
            }
            let what = format!("tree on mesh rings {nch} channels {proto}");
            let outs = must_pass(&what, "ar", &common, &mesh_envs(nch), SECS(90));
            check_mesh_rings(&what, &outs, nch as usize);
            assert!(outs[0].contains("Trees [0]"), "{what}: no trees:\n{}", outs[0]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 8. Teardown.

// FAILED at 934c32e (passes since 6266d01, which fixed it): after every rank's finalize returned Ok, rank
// 0's get_async_error reports "remote error: rank 0: rank 1 of this communicator aborted" and the liveness
// watch logs "ERROR peer rank 1 (process …) has exited; aborting the communicator", because the watch
// (host/liveness.rs, registered as InitRankRes::_watched) stays armed after the teardown barrier of finalize
// / destroy (InitRankRes::sync_teardown) and a host peer exiting normally afterwards raises the host's abort
// flags. The same spurious ERROR line shows up at random in clean runs, while a rank's destroy is still
// closing its NET connections after the barrier.
#[test]
fn b7_peer_exiting_after_finalize_is_no_error() {
    // Hosts A {0, 1, 2}, B {3}; tree AllReduce, then every rank finalizes (the collective
    // teardown barrier) and ranks 1..3 exit at once, while rank 0 lingers 600 ms before it asks
    // for the async error and destroys. A peer leaving after a successful finalize is the normal
    // end of a job (NCCL: ncclCommFinalize, then each rank destroys and exits when it likes):
    // rank 0 must report no error and log no abort.
    let mut common = tree_small("LL");
    common.push(("OXCCL_B7_LINGER", "0".to_string()));
    let outs = run_group("finalize", &common, &hosts(&["a", "a", "a", "b"]), SECS(60));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(
            *ok && out.contains(&format!("B7-CHILD-OK rank {r}")),
            "rank {r}:\n{out}"
        );
        for want in [
            "AR exact",
            "FINALIZE Ok(()) after",
            "ASYNC Ok(())",
            "DESTROY Ok(()) after",
        ] {
            assert!(out.contains(want), "rank {r}: no {want:?} in\n{out}");
        }
        let aborts: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("has exited") || l.contains("aborting the communicator"))
            .collect();
        assert!(
            aborts.is_empty(),
            "rank {r}: abort after a clean finalize: {aborts:?}"
        );
    }
}

#[test]
fn b7_tree_shapes_all_over_net() {
    // Every rank its own host (every tree and ring edge over NET): 2 ranks (ring and tree
    // connect the same pair on every channel, on their own sockets), 7 ranks (a deeper double
    // binary tree, an odd node count), and 6 hosts with the pattern hooks "split" and "tree"
    // (a node with three children); AllReduce on each protocol, tree forced, then for 2 ranks
    // 4 hosts with the algorithm and protocol left to the tuner (ring and tree calls take turns
    // on the same connections).
    let cases: Vec<(&str, usize, Option<&str>, Option<&str>)> = vec![
        ("2 hosts", 2, None, Some("tree")),
        ("4 hosts, tuner", 4, None, None),
        ("7 hosts", 7, None, Some("tree")),
        ("6 hosts split", 6, Some("split"), Some("tree")),
        ("6 hosts tree", 6, Some("tree"), Some("tree")),
    ];
    for (what, n, pattern, algo) in cases {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = tree_small(proto);
            common.retain(|(k, _)| *k != "NCCL_ALGO" && *k != "OXCCL_B7_WANT_ALGO");
            if let Some(a) = algo {
                common.push(("NCCL_ALGO", a.to_string()));
                common.push(("OXCCL_B7_WANT_ALGO", a.to_string()));
            } else {
                if proto != "LL" {
                    continue;
                }
                common.retain(|(k, _)| *k != "NCCL_PROTO" && *k != "OXCCL_B7_WANT_PROTO");
                common.push(("NCCL_PROTO", "LL,LL128,Simple".to_string()));
                common.push(("OXCCL_B7_COUNTS", "1,1001,2048,8192,32768,300000".to_string()));
            }
            if let Some(p) = pattern {
                common.push(("OXCCL_TEST_TREE_PATTERN", p.to_string()));
            }
            let names: Vec<String> = (0..n).map(|r| format!("solo{r}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let what = if algo.is_some() {
                format!("{what} {proto}")
            } else {
                what.to_string()
            };
            let outs = must_pass(&what, "ar", &common, &hosts(&names), SECS(60));
            if algo.is_none() {
                let used = used_line(&outs[0]);
                assert!(used.contains("Tree") && used.contains("Ring"), "{what}: {used}");
            }
        }
    }
}

#[test]
fn b7_two_communicators_at_once_and_reinit_across_hosts() {
    // Hosts A {0, 1}, B {2}, C {3, 4}: two communicators of the same ranks whose tree NET
    // connections share each process's proxy thread, AllReduces queued on both from two threads
    // at once; then three communicators created and destroyed one after the other.
    for proto in ["LL", "Simple", "LL128"] {
        let common = tree_small(proto);
        let envs = hosts(&["a", "a", "b", "c", "c"]);
        let outs = must_pass(
            &format!("two communicators {proto}"),
            "two",
            &common,
            &envs,
            SECS(60),
        );
        let want = format!(
            "TWO Some((Tree, {:?})) Some((Tree, {:?}))",
            Proto::from_name(proto).unwrap(),
            Proto::from_name(proto).unwrap()
        );
        assert!(outs[0].contains(&want), "{proto}: no {want:?} in\n{}", outs[0]);
        let outs = must_pass(&format!("reinit {proto}"), "reinit", &common, &envs, SECS(60));
        for k in 0..3 {
            assert!(
                outs[4].contains(&format!("REINIT {k} ok Some((Tree, ")),
                "{proto}:\n{}",
                outs[4]
            );
        }
    }
}

#[test]
fn b7_per_channel_rings_with_shm_disabled_on_some_ranks() {
    // The mesh rings across two hosts with NCCL_SHM_DISABLE=1 on ranks 1 and 6: inside each
    // host some channels' edges now go over NET and others over SHM, so a rank mixes SHM and NET
    // neighbours differently per channel, on both hosts. Every collective in place, 6 channels.
    for proto in ["LL", "Simple"] {
        let mut envs = mesh_envs(6);
        for r in [1, 6] {
            envs[r].push(("NCCL_SHM_DISABLE", "1".to_string()));
        }
        let common = kv(&[
            ("NCCL_PROTO", proto),
            ("OXCCL_B7_WANT_PROTO", proto),
            ("OXCCL_B7_COUNTS", "1,1001,24577"),
        ]);
        let what = format!("mesh rings, SHM off on 1 and 6, {proto}");
        let outs = must_pass(&what, "colls", &common, &envs, SECS(90));
        check_mesh_rings_off(&what, &outs, 6, &[1, 6]);
    }
}

#[test]
fn b7_c29_kill_a_rank_on_per_channel_rings_across_hosts() {
    // The mesh rings across two hosts (ring forced, 6 channels: a rank's NET peers differ per
    // channel); rank 5 is killed while every rank loops AllReduce. Every survivor must get a
    // remote error and exit within 30 s.
    for proto in ["Simple", "LL"] {
        let envs = mesh_envs(6);
        let mut ranks = {
            let common = kv(&[
                ("NCCL_ALGO", "ring"),
                ("NCCL_PROTO", proto),
                ("OXCCL_B7_COUNT", "65536"),
            ]);
            let mut ranks = spawn_group("loop", &common, &envs);
            let t = Instant::now();
            while !(0..8).all(|r| ranks[r].has("LOOPING")) {
                assert!(t.elapsed() < SECS(60), "ranks never all looped");
                std::thread::sleep(Duration::from_millis(20));
            }
            ranks
        };
        for r in 0..8 {
            let want = format!("LOOPING rank {r} Ring {:?}", Proto::from_name(proto).unwrap());
            assert!(ranks[r].has(&want), "rank {r}: {}", ranks[r].text());
        }
        ranks[5].child.kill().unwrap();
        let _ = ranks[5].child.wait();
        let t = Instant::now();
        let s = survivors_exit(&format!("mesh kill 5 {proto}"), &mut ranks, Some(5), t, |_, l| {
            l.starts_with("GOT-ERROR RemoteError") && l.contains("aborted")
        });
        eprintln!("mesh rings, rank 5 killed, {proto}: survivors out in {s:.1} s");
    }
}

#[test]
fn b7_c13_tree_only_broadcast_is_refused_and_the_tree_stays_in_step() {
    // Case C13 on a communicator with trees across hosts: NCCL_ALGO=tree and NCCL_PROTO=LL; a
    // Broadcast (ring only) must be refused with an error naming the op on every rank, not fall
    // back to another algorithm or protocol, and the tree AllReduces after it must be exact.
    let common = kv(&[("NCCL_ALGO", "tree"), ("NCCL_PROTO", "LL")]);
    let outs = must_pass("c13", "c13", &common, &hosts(&["a", "b", "b"]), SECS(60));
    for (r, o) in outs.iter().enumerate() {
        let l = o.lines().find(|l| l.starts_with("C13-BCAST")).unwrap_or_default();
        assert!(
            l.starts_with("C13-BCAST-ERR InvalidArgument") && l.contains("broadcast"),
            "rank {r}: {l}"
        );
        assert!(o.contains("C13-AR [] Some(Tree)"), "rank {r}:\n{o}");
    }
}

#[test]
fn b7_rank_vanishing_before_teardown_leaves_no_one_stuck() {
    // Hosts A {0, 1}, B {2, 3}; after a tree AllReduce, rank 1 (host A, SHM to rank 0) or rank 3
    // (host B) exits without finalize or destroy. The others' finalize (the teardown barrier)
    // must return within the bootstrap timeout (5 s here) plus slack (an error, or Ok when the
    // vanished rank's death already aborted the communicator), and their destroy must return too;
    // no process may be left running. The AllReduce before must be exact, or (when the death
    // aborted it: liveness watch, proxies) report an error: never a wrong result reported as Ok.
    for victim in ["1", "3"] {
        let mut common = tree_small("Simple");
        common.push(("OXCCL_B7_VANISH", victim.to_string()));
        common.push(("OXCCL_BOOTSTRAP_TIMEOUT", "5".to_string()));
        let t = Instant::now();
        let outs = run_group("finalize", &common, &hosts(&["a", "a", "b", "b"]), SECS(30));
        for (r, (ok, out)) in outs.iter().enumerate() {
            if r.to_string() == victim {
                assert!(out.contains(&format!("VANISH rank {r}")), "rank {r}:\n{out}");
                continue;
            }
            assert!(
                out.contains("AR exact") || out.contains("AR-ERR RemoteError"),
                "victim {victim}: rank {r}: AllReduce neither exact nor reported as failed:\n{out}"
            );
            let fin = out
                .lines()
                .find(|l| l.starts_with("FINALIZE"))
                .unwrap_or_default();
            let ms = millis_before_unit(fin);
            assert!(
                *ok && fin.starts_with("FINALIZE ") && ms < 12_000 && out.contains("DESTROY "),
                "victim {victim}: rank {r}: {fin}\n{out}"
            );
            eprintln!("victim {victim}: rank {r}: {fin}");
        }
        eprintln!("victim {victim}: all out in {:.1} s", t.elapsed().as_secs_f64());
    }
}

#[test]
fn b7_rank_killed_during_tree_setup_bounded() {
    // Hosts A {0, 1}, B {2, 3}, C {4}; rank 3 is killed as soon as its ring connections are
    // logged (init goes on with the tree setup: tree memory all-gather, NET tree connections).
    // With a bootstrap timeout of 5 s every survivor must leave init (or the teardown after it)
    // and exit within 25 s of the kill, never hang.
    for victim in [3usize, 4] {
        let mut ranks = spawn_group(
            "init",
            &kv(&[("NCCL_ALGO", "tree"), ("OXCCL_BOOTSTRAP_TIMEOUT", "5")]),
            &hosts(&["a", "a", "b", "b", "c"]),
        );
        let t = Instant::now();
        while !ranks[victim].has("Channel 00") {
            assert!(t.elapsed() < SECS(30), "rank {victim} never connected its ring");
            std::thread::sleep(Duration::from_millis(1));
        }
        ranks[victim].child.kill().unwrap();
        let _ = ranks[victim].child.wait();
        let killed = Instant::now();
        for (r, rank) in ranks.iter_mut().enumerate() {
            if r == victim {
                continue;
            }
            let (_, out) = rank.wait(killed + SECS(25));
            assert!(
                !out.starts_with("did not exit in time"),
                "victim {victim}: rank {r} still running 25 s after the kill:\n{out}"
            );
            let l = out
                .lines()
                .find_map(|l| l.find("INIT-ERR").or_else(|| l.find("CHOICE")).map(|i| &l[i..]))
                .unwrap_or("(no INIT-ERR / CHOICE line)");
            eprintln!(
                "victim {victim}: rank {r} out after {:.1} s: {l}",
                killed.elapsed().as_secs_f64()
            );
        }
    }
}
