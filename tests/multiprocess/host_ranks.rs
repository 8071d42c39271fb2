//! Ranks as processes of this binary on simulated hosts (`OXCCL_HOSTID`), each running a role
//! (`child_host_rank`, picked by `OXCCL_CHILD_ROLE`) after `Comm::init_rank` on
//! `Device::Cpu(rank)`: tree and ring AllReduce over dtype × op × count lists in and out of place,
//! LL-flag-wrap loops, every collective in place, two communicators at once, re-init, finalize,
//! loops until an error (with an abort from another thread), and the parent side: groups of such
//! ranks under a deadline, their outputs checked. Used by the `host_trees`, `host_rings` and
//! `host_failures` tests: trees across hosts (edges over SHM inside a host, NET through the proxy
//! between hosts) and per-channel rings across hosts (mixed transports per channel).
//!
//! Every result is compared bit for bit with the expected bytes (`oxccl::perf::check` for
//! AllReduce, closed forms for the others), guards around outputs included; every group of child
//! ranks runs under a deadline (killed past it, which fails the test).
use crate::common::child::{self, LineChild, log_to_stdout};
use crate::common::topo::{MESH_RINGS, fixture};
use crate::common::unique_id;
use oxccl::perf::check;
use oxccl::{Algo, Comm, DataType, Device, DeviceBuffer, Func, Proto, RedOp};
use std::time::{Duration, Instant};

/// Guard bytes before and after each output.
const GUARD: usize = 64;

fn list(var: &str, default: &str) -> Vec<String> {
    std::env::var(var)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// Every child rank: `OXCCL_CHILD_ROLE` picks what it runs after `init_rank` on
/// `Device::Cpu(rank)`.
#[test]
#[ignore = "child process of the host_* tests"]
fn child_host_rank() {
    child::enter();
    let role = child::env_var("OXCCL_CHILD_ROLE");
    log_to_stdout("oxccl::init=info,oxccl::transport=info,oxccl::proxy=error");
    let (rank, nranks, id) = child::rank();
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
            // One tree AllReduce, then finalize; the rank named by OXCCL_CHILD_LINGER stays 600 ms
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
            if std::env::var("OXCCL_CHILD_VANISH").is_ok_and(|v| v == rank.to_string()) {
                // This rank's process ends without finalize or destroy (a crash after the last
                // collective).
                println!("VANISH rank {rank}");
                std::process::exit(0);
            }
            let t = Instant::now();
            let fin = comm.finalize().map_err(|e| e.to_string());
            println!("FINALIZE {fin:?} after {} ms", t.elapsed().as_millis());
            if std::env::var("OXCCL_CHILD_LINGER").is_ok_and(|v| v == rank.to_string()) {
                std::thread::sleep(Duration::from_millis(600));
            }
            println!("ASYNC {:?}", comm.get_async_error().map_err(|e| e.to_string()));
            let t = Instant::now();
            let d = comm.destroy().map_err(|e| e.to_string());
            println!("DESTROY {d:?} after {} ms", t.elapsed().as_millis());
        }
        "two" => role_two_comms(comm),
        "reinit" => {
            // Three communicators one after the other in the same processes (the proxy thread
            // and the tree segments of a destroyed one must not disturb the next).
            let mut comm = comm;
            for (k, var) in ["OXCCL_CHILD_ID2", "OXCCL_CHILD_ID3", ""].into_iter().enumerate() {
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
                let id = child::env_id(var);
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
        "diverge" => {
            // One AllReduce of OXCCL_CHILD_COUNT floats (ranks may differ), out of place, both
            // buffers filled with 0xa5; then whether it failed, and whether any byte changed;
            // then a second call's outcome.
            let count: usize = child::env_var("OXCCL_CHILD_COUNT").parse().unwrap();
            let dev = comm.device();
            let stream = dev.new_stream().unwrap();
            let (send, recv) = (dev.alloc(4 << 12).unwrap(), dev.alloc(4 << 12).unwrap());
            send.fill(0xa5).unwrap();
            recv.fill(0xa5).unwrap();
            let res = comm
                .all_reduce(&send, &recv, count, DataType::F32, RedOp::Sum, &stream)
                .and_then(|_| stream.synchronize())
                .and_then(|_| comm.get_async_error());
            let untouched = [&send, &recv].iter().all(|b| b.to_vec().unwrap().iter().all(|&x| x == 0xa5));
            match res {
                Ok(()) => println!("DIVERGE-OK untouched {untouched}"),
                Err(e) => println!("DIVERGE-ERR {:?} untouched {untouched}: {e}", e.code()),
            }
            let again = comm.all_reduce(&send, &recv, count, DataType::F32, RedOp::Sum, &stream);
            println!("AGAIN {:?}", again.map_err(|e| e.to_string()));
            // Destroy, not abort: an abort would raise the other ranks' flags, and one still
            // gathering the signatures would report that abort instead of the mismatch.
            comm.destroy().expect("destroy");
        }
        "revoke" => {
            // Rank OXCCL_CHILD_SKIP never calls; the others' AllReduce times out
            // (OXCCL_TIMEOUT), they revoke their ranks and shrink it away, and the new
            // communicator's AllReduce is checked.
            let skip: usize = child::env_var("OXCCL_CHILD_SKIP").parse().unwrap();
            if rank == skip {
                std::thread::sleep(Duration::from_secs(3));
                comm.abort().expect("abort");
            } else {
                let dev = comm.device();
                let stream = dev.new_stream().unwrap();
                let buf = dev.alloc(1025 * 4).unwrap();
                let res = comm
                    .all_reduce(&buf, &buf, 1025, DataType::F32, RedOp::Sum, &stream)
                    .and_then(|_| stream.synchronize())
                    .and_then(|_| comm.get_async_error());
                println!("STUCK {:?}", res.map_err(|e| e.code()));
                println!("REVOKE {:?}", comm.revoke().map_err(|e| e.to_string()));
                let kid = comm.shrink(&[skip], false).expect("shrink");
                let (r, n) = (kid.rank(), kid.nranks());
                buf.write(0, &(r as f32 + 1.0).to_ne_bytes().repeat(1025)).unwrap();
                kid.all_reduce(&buf, &buf, 1025, DataType::F32, RedOp::Sum, &stream).unwrap();
                stream.synchronize().unwrap();
                let want = ((n * (n + 1) / 2) as f32).to_ne_bytes().repeat(1025);
                println!("SHRUNK rank {r} of {n}: {}", if buf.to_vec().unwrap() == want { "exact" } else { "WRONG" });
                kid.destroy().expect("destroy the shrunk communicator");
                drop(comm);
            }
        }
        "ar" => role_all_reduce(comm),
        "wrap" => role_wrap(comm),
        "colls" => role_collectives(comm),
        "loop" => {
            role_loop(comm, rank);
        }
        r => panic!("unknown role {r}"),
    }
    println!("HOST-CHILD-OK rank {rank}");
}

fn want_algo() -> Option<Algo> {
    std::env::var("OXCCL_CHILD_WANT_ALGO")
        .ok()
        .map(|a| Algo::from_name(&a).unwrap_or_else(|| panic!("algo {a}")))
}

fn want_proto() -> Option<Proto> {
    std::env::var("OXCCL_CHILD_WANT_PROTO")
        .ok()
        .map(|a| Proto::from_name(&a).unwrap_or_else(|| panic!("proto {a}")))
}

/// AllReduce over `OXCCL_CHILD_DTYPES` × `OXCCL_CHILD_OPS` × `OXCCL_CHILD_COUNTS` × out-of-place and in
/// place, each checked exactly with guards; prints `WRONG` per failure, `USED` (the distinct
/// algorithm/protocol pairs) and a `DIGEST` of every result.
fn role_all_reduce(comm: Comm) {
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let dtypes: Vec<DataType> = list("OXCCL_CHILD_DTYPES", "int32,float")
        .iter()
        .map(|d| DataType::from_name(d).unwrap_or_else(|| panic!("dtype {d}")))
        .collect();
    let ops: Vec<RedOp> = list("OXCCL_CHILD_OPS", "sum")
        .iter()
        .map(|d| RedOp::from_name(d).unwrap_or_else(|| panic!("op {d}")))
        .collect();
    let counts: Vec<usize> = list("OXCCL_CHILD_COUNTS", "1,1001,40000")
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let reps: usize = std::env::var("OXCCL_CHILD_REPS").map_or(1, |v| v.parse().unwrap());
    let (walgo, wproto) = (want_algo(), want_proto());
    let wnch: Option<u32> = std::env::var("OXCCL_CHILD_WANT_NCH")
        .ok()
        .map(|v| v.parse().unwrap());
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    let mut wrong = 0usize;
    let mut calls = 0usize;
    let mut used: Vec<(Algo, Proto)> = Vec::new();
    let max = *counts.iter().max().unwrap();
    // Extra byte offsets of the send and receive data past the front guard (element-aligned,
    // not 16-byte aligned: the kernels' unaligned paths).
    let soff: usize = std::env::var("OXCCL_CHILD_SOFF").map_or(0, |v| v.parse().unwrap());
    let roff: usize = std::env::var("OXCCL_CHILD_ROFF").map_or(0, |v| v.parse().unwrap());
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

/// Two communicators of the same ranks (ids `OXCCL_CHILD_ID`, `OXCCL_CHILD_ID2`), each with its own
/// stream: AllReduces queued on both, alternating, before either is synchronized, then checked.
fn role_two_comms(a: Comm) {
    let (rank, nranks) = (a.rank(), a.nranks());
    let id2 = child::env_id("OXCCL_CHILD_ID2");
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

/// C11 (B): `OXCCL_CHILD_ITERS` AllReduces of u32 sum, the counts of `OXCCL_CHILD_COUNTS` in turn,
/// alternately in place and out of place, each checked exactly (wrapping sums).
fn role_wrap(comm: Comm) {
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let iters: u32 = std::env::var("OXCCL_CHILD_ITERS").map_or(1000, |v| v.parse().unwrap());
    let counts: Vec<usize> = list("OXCCL_CHILD_COUNTS", "4,700,3001")
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
/// rank, AllGather, ReduceScatter sum), int32, for the counts of `OXCCL_CHILD_COUNTS`, each checked
/// exactly; guards around every buffer.
fn role_collectives(comm: Comm) {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let counts: Vec<usize> = list("OXCCL_CHILD_COUNTS", "1,1001,40000")
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let wproto = want_proto();
    let wnch: Option<u32> = std::env::var("OXCCL_CHILD_WANT_NCH")
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

/// Loops AllReduce (f32 sum, `OXCCL_CHILD_COUNT` elements, in place) until an error arrives; with
/// `OXCCL_CHILD_ABORT_MS` set, a second thread aborts this rank after that many ms from its second
/// finished call (which needs every rank's second call, so every rank has finished its first and
/// printed `LOOPING` by then: an abort right after this rank's first call could cut a slower
/// rank's first call short). Prints `LOOPING`, `GOT-ERROR <code>`, `ABORT-RETURNED`,
/// `CHILD-EXITED`.
fn role_loop(comm: Comm, rank: usize) {
    let count: usize = std::env::var("OXCCL_CHILD_COUNT").map_or(1 << 16, |v| v.parse().unwrap());
    let abort_ms: Option<u64> = std::env::var("OXCCL_CHILD_ABORT_MS")
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
            } else if iters == 1 {
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

pub type Env = Vec<(&'static str, String)>;

pub fn kv(pairs: &[(&'static str, &str)]) -> Env {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// Starts one child rank per entry of `envs` (role `role`, `common` then `envs[r]`) on one id.
pub fn spawn_group(role: &str, common: &Env, envs: &[Env]) -> Vec<LineChild> {
    let n = envs.len();
    let (id, id2, id3) = (unique_id(), unique_id(), unique_id());
    (0..n)
        .map(|r| {
            let mut cmd = child::command_with(&child_entry!(child_host_rank), [("OXCCL_CHILD_ROLE", role)]);
            child::rank_env(&mut cmd, r, n, &id)
                .env("OXCCL_CHILD_ID2", child::hex(&id2.to_bytes()))
                .env("OXCCL_CHILD_ID3", child::hex(&id3.to_bytes()))
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "20");
            for (k, v) in common.iter().chain(&envs[r]) {
                cmd.env(k, v);
            }
            LineChild::start(&mut cmd)
        })
        .collect()
}

/// Runs a group to its end (deadline `limit` from now): each rank's (success, output).
pub fn run_group(role: &str, common: &Env, envs: &[Env], limit: Duration) -> Vec<(bool, String)> {
    let mut ranks = spawn_group(role, common, envs);
    let deadline = Instant::now() + limit;
    ranks.iter_mut().map(|c| c.wait(deadline)).collect()
}

/// A group that must pass: every rank exits successfully with `HOST-CHILD-OK`, prints no `WRONG`,
/// and every rank's `DIGEST` (when printed) is rank 0's. Returns the outputs.
pub fn must_pass(what: &str, role: &str, common: &Env, envs: &[Env], limit: Duration) -> Vec<String> {
    let t = Instant::now();
    let outs = run_group(role, common, envs, limit);
    let mut failures = Vec::new();
    for (r, (ok, out)) in outs.iter().enumerate() {
        if !ok || !out.contains(&format!("HOST-CHILD-OK rank {r}")) || out.contains("WRONG") {
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
    if std::env::var("OXCCL_TEST_SHOW").is_ok() {
        for (r, (_, o)) in outs.iter().enumerate() {
            eprintln!("---- rank {r}\n{o}");
        }
    }
    eprintln!("{what}: ok in {:.1} s", t.elapsed().as_secs_f64());
    outs.into_iter().map(|(_, o)| o).collect()
}

/// The number before a line's last word (`... 123 ms`), `u64::MAX` when there is none: how long a
/// child says a step took.
pub fn millis_before_unit(line: &str) -> u64 {
    line.rsplit(' ')
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX)
}

pub fn hosts(names: &[&str]) -> Vec<Env> {
    names
        .iter()
        .map(|h| vec![("OXCCL_HOSTID", format!("host-{h}"))])
        .collect()
}

/// Small FIFOs (many steps per call) and the protocol `proto` forced on the tree.
pub fn tree_small(proto: &str) -> Env {
    kv(&[
        ("NCCL_ALGO", "tree"),
        ("NCCL_PROTO", proto),
        ("OXCCL_CHILD_WANT_ALGO", "tree"),
        ("OXCCL_CHILD_WANT_PROTO", proto),
        ("NCCL_BUFFSIZE", "65536"),
        ("NCCL_LL_BUFFSIZE", "16384"),
        ("NCCL_LL128_BUFFSIZE", "65536"),
        ("NCCL_MAX_NCHANNELS", "2"),
    ])
}

pub fn used_line(out: &str) -> String {
    out.lines()
        .find(|l| l.starts_with("USED"))
        .unwrap_or("")
        .to_string()
}

pub const SECS: fn(u64) -> Duration = Duration::from_secs;

/// Runs `init` children (`envs[r]` for rank r) and returns each rank's `INIT-`/`CHOICE` line;
/// every child must exit within 40 s.
pub fn init_lines(common: &Env, envs: &[Env]) -> Vec<String> {
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

/// Starts a `loop` group (tree forced, `proto`) and waits until every rank has finished one call.
pub fn looping(proto: &str, envs: &[Env], extra: &[(&'static str, &str)]) -> Vec<LineChild> {
    let mut common = kv(&[
        ("NCCL_ALGO", "tree"),
        ("NCCL_PROTO", proto),
        ("NCCL_BUFFSIZE", "65536"),
        ("NCCL_LL_BUFFSIZE", "16384"),
        ("NCCL_LL128_BUFFSIZE", "65536"),
        ("NCCL_MAX_NCHANNELS", "2"),
        ("OXCCL_CHILD_COUNT", "65536"),
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
pub fn survivors_exit(
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

/// Channel `c`'s ring on two hosts of the mesh fixture: `MESH_RINGS[c % 6]` on host A, then the
/// same order on host B (ranks + 4).
pub fn mesh_ring(c: usize) -> Vec<usize> {
    let g = MESH_RINGS[c % 6];
    g.iter().copied().chain(g.iter().map(|&x| x + 4)).collect()
}

pub fn mesh_envs(nch: u32) -> Vec<Env> {
    let topo = fixture("nvlink-mesh-4gpu-topo.xml");
    (0..8)
        .map(|r| {
            vec![
                (
                    "OXCCL_HOSTID",
                    if r < 4 { "mesh-a" } else { "mesh-b" }.to_string(),
                ),
                ("NCCL_TOPO_FILE", topo.display().to_string()),
                ("NCCL_MAX_NCHANNELS", nch.to_string()),
                ("NCCL_MIN_NCHANNELS", nch.to_string()),
                ("OXCCL_CHILD_WANT_NCH", nch.to_string()),
                ("NCCL_BUFFSIZE", "65536".to_string()),
                ("NCCL_LL_BUFFSIZE", "16384".to_string()),
                ("NCCL_LL128_BUFFSIZE", "65536".to_string()),
            ]
        })
        .collect()
}

/// Every rank's channel lines agree with [`mesh_ring`] for every channel (NET between hosts and
/// to or from a rank of `shm_off`).
pub fn check_mesh_rings(what: &str, outs: &[String], nch: usize) {
    check_mesh_rings_off(what, outs, nch, &[])
}

pub fn check_mesh_rings_off(what: &str, outs: &[String], nch: usize, shm_off: &[usize]) {
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
