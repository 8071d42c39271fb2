//! The call-signature check (`OXCCL_CHECK_CALLS=1`): ranks whose host programs diverged — another
//! count, another collective, another root, a call of count 0 against a real one — fail that call
//! on every rank in bounded time with `InvalidUsage` naming each group of ranks, its call and the
//! fields that differ, with no byte of any buffer written; later calls return the same error.
//! Matching calls run exactly as without the check (every collective × protocol, exact values,
//! guards). CPU target on every run (ranks as threads; as processes across simulated hosts in the
//! multiprocess tests), 2 ranks on GPUs when present (2 GPUs, or 2 ranks sharing GPU 0).
use crate::common;

use common::env::Env;
use oxccl::{Comm, CommConfig, DataType, Device, DeviceBuffer, Error, Func, RedOp};
use std::time::{Duration, Instant};

/// Every variable a test here may set, and those that size the chunks the tests' calls cut:
/// cleared (both spellings) around each init.
const VARS: &[&str] = &[
    "CHECK_CALLS",
    "TIMEOUT",
    "PROTO",
    "ALGO",
    "MIN_NCHANNELS",
    "MAX_NCHANNELS",
    "BUFFSIZE",
    "LL_BUFFSIZE",
    "LL128_BUFFSIZE",
];

/// Communicators over `devices` with the check on (and a timeout, so that a check that failed to
/// stop a diverged call ends the test with an error instead of a hang), and `extra` variables.
fn init(devices: &[Device], extra: &[(&str, &str)]) -> Vec<Comm> {
    let env = Env::clean(VARS);
    let mut vars = vec![("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")];
    vars.extend_from_slice(extra);
    env.set(&vars);
    common::init_all(devices).unwrap()
}

/// One rank's call: collective, count, root, operator.
#[derive(Clone, Copy)]
struct Call(Func, usize, usize, RedOp);

/// Bytes every buffer of [`diverged`] holds at least (more for a larger call): enough for any
/// call of up to 4096 floats on up to 4 ranks.
const BYTES: usize = 4 * 4096 * 4;

/// Each rank `r` issues `calls[r]` (float) from one thread, out of place, with both buffers
/// filled with a pattern; then every stream drains within seconds and every rank's error is
/// `InvalidUsage` whose message, after `rank r: `, is `want`; no byte of any buffer changed; a
/// later call returns the same error at once; abort and drop work. `extra`: variables for the
/// communicators.
fn diverged(devices: &[Device], extra: &[(&str, &str)], calls: &[Call], want: &str) {
    let comms = init(devices, extra);
    let n = comms.len();
    let streams = common::streams(&comms);
    let bytes = BYTES.max(4 * n * calls.iter().map(|c| c.1).max().unwrap_or(0));
    let fill = |r: usize, salt: u8| -> (DeviceBuffer, Vec<u8>) {
        let b = comms[r].device().alloc(bytes).unwrap();
        let pattern = common::sentinel(bytes, salt + r as u8);
        b.write(0, &pattern).unwrap();
        (b, pattern)
    };
    let sends: Vec<_> = (0..n).map(|r| fill(r, 1)).collect();
    let recvs: Vec<_> = (0..n).map(|r| fill(r, 101)).collect();
    let t = Instant::now();
    for (r, &Call(func, count, root, op)) in calls.iter().enumerate() {
        // SAFETY: both buffers hold `bytes`, as much as any call here needs, and are disjoint.
        unsafe {
            comms[r]
                .collective_raw(
                    func,
                    sends[r].0.addr(),
                    recvs[r].0.addr(),
                    count,
                    DataType::F32,
                    op,
                    root,
                    &streams[r],
                )
                .unwrap_or_else(|e| panic!("rank {r}: the call itself was refused: {e}"));
        }
    }
    for r in 0..n {
        streams[r].synchronize().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "rank {r}: {:?}",
            t.elapsed()
        );
        let e = comms[r].get_async_error().unwrap_err();
        assert!(matches!(e, Error::InvalidUsage(_)), "rank {r}: {e}");
        assert_eq!(
            e.to_string(),
            format!("invalid usage: rank {r} of communicator {:08x}: {want}", comms[r].comm_id()),
            "rank {r}"
        );
        for (what, (buf, pattern)) in [("send", &sends[r]), ("recv", &recvs[r])] {
            assert!(
                buf.to_vec().unwrap() == *pattern,
                "rank {r}: its {what} buffer was written"
            );
        }
        // Every later call returns the same error at once.
        let again = comms[r]
            .all_reduce(
                &recvs[r].0,
                &recvs[r].0,
                1,
                DataType::F32,
                RedOp::Sum,
                &streams[r],
            )
            .unwrap_err();
        assert_eq!(again.to_string(), e.to_string(), "rank {r}");
    }
    for c in &comms {
        c.abort().unwrap();
    }
    drop(comms);
}

/// The text of a mismatch error after `rank r of communicator <id>: `.
fn message(calls: &str, fields: &str) -> String {
    format!(
        "the ranks issued different calls (OXCCL_CHECK_CALLS): {calls}; they differ in {fields}; no user buffer \
         was written, abort or destroy the communicator"
    )
}

#[test]
fn ranks_that_issued_different_calls_fail_every_rank_naming_them() {
    let cpus = Device::cpus;
    // Another count on one rank of three (the plan is the same: both are small, LL on one channel).
    let ar = |count| Call(Func::AllReduce, count, 0, RedOp::Sum);
    diverged(
        &cpus(3),
        &[],
        &[ar(1024), ar(1024), ar(1000)],
        &message(
            "ranks 0, 1 issued allreduce call #1 (1024 × float, op sum; ring/LL on 1 channel); rank 2 issued \
             allreduce call #1 (1000 × float, op sum; ring/LL on 1 channel)",
            "count",
        ),
    );
    // Another collective: AllReduce against AllGather of the same count.
    diverged(
        &cpus(2),
        &[],
        &[ar(256), Call(Func::AllGather, 256, 0, RedOp::Sum)],
        &message(
            "rank 0 issued allreduce call #1 (256 × float, op sum; ring/LL on 1 channel); rank 1 issued \
             allgather call #1 (256 × float; ring/LL on 1 channel)",
            "function",
        ),
    );
    // Every rank names itself Reduce's root.
    let reduce = |root| Call(Func::Reduce, 64, root, RedOp::Sum);
    diverged(
        &cpus(3),
        &[],
        &[reduce(0), reduce(1), reduce(2)],
        &message(
            "rank 0 issued reduce call #1 (64 × float, op sum, root 0; ring/LL on 1 channel); rank 1 issued \
             reduce call #1 (64 × float, op sum, root 1; ring/LL on 1 channel); rank 2 issued reduce call #1 \
             (64 × float, op sum, root 2; ring/LL on 1 channel)",
            "root",
        ),
    );
    // Another operator on a call of two channels: both of each rank's data blocks wait at their
    // gate for the checking block's verdict and write nothing.
    let big = 1 << 18;
    let reduce_op = |op: &str| -> String {
        format!("allreduce call #1 ({big} × float, op {op}; ring/Simple on 2 channels)")
    };
    diverged(
        &cpus(2),
        &[],
        &[Call(Func::AllReduce, big, 0, RedOp::Sum), Call(Func::AllReduce, big, 0, RedOp::Max)],
        &message(
            &format!("rank 0 issued {}; rank 1 issued {}", reduce_op("sum"), reduce_op("max")),
            "operator",
        ),
    );
    // Reduce on four ranks over two channels, one rank with another count. Only the root writes
    // a user buffer, so only it waits for the verdict; the others keep passing data on until
    // their peers stop feeding their FIFOs, and leave at the mismatch (the abort line's stop
    // word).
    let red = |count: usize| Call(Func::Reduce, count, 0, RedOp::Sum);
    let red_text =
        |count: usize| format!("reduce call #1 ({count} × float, op sum, root 0; ring/Simple on 2 channels)");
    diverged(
        &cpus(4),
        &[],
        &[red(big), red(big), red(big), red(big - 4096)],
        &message(
            &format!("ranks 0-2 issued {}; rank 3 issued {}", red_text(big), red_text(big - 4096)),
            "count",
        ),
    );
    // A call of count 0 (a no-op in NCCL, still checked) against a real one, on four ranks.
    diverged(
        &cpus(4),
        &[],
        &[ar(0), ar(4096), ar(4096), ar(4096)],
        &message(
            "rank 0 issued allreduce call #1 (0 × float, op sum); ranks 1-3 issued allreduce call #1 (4096 × \
             float, op sum; ring/Simple on 1 channel)",
            "count, algorithm, protocol, channels",
        ),
    );
    // AllGather on LL128 on three ranks, one with another count: every rank sends its first
    // chunk's head before the gate (`coll::ahead_elems`; each at its own split), and no rank
    // takes it in.
    let ag = |count: usize| Call(Func::AllGather, count, 0, RedOp::Sum);
    let ag_text = |count: usize| format!("allgather call #1 ({count} × float; ring/LL128 on 2 channels)");
    diverged(
        &cpus(3),
        &[("NCCL_PROTO", "LL128")],
        &[ag(40_003), ag(40_003), ag(36_000)],
        &message(
            &format!("ranks 0, 1 issued {}; rank 2 issued {}", ag_text(40_003), ag_text(36_000)),
            "count",
        ),
    );
    // Broadcast on LL128 on three ranks, one with another count: the root sends its first chunk
    // before the gate, and no rank takes it in.
    let bc = |count: usize| Call(Func::Broadcast, count, 0, RedOp::Sum);
    let bc_text = |count: usize| format!("broadcast call #1 ({count} × float, root 0; ring/LL128 on 2 channels)");
    diverged(
        &cpus(3),
        &[("NCCL_PROTO", "LL128")],
        &[bc(40_003), bc(40_003), bc(36_000)],
        &message(
            &format!("ranks 0, 1 issued {}; rank 2 issued {}", bc_text(40_003), bc_text(36_000)),
            "count",
        ),
    );
}

#[test]
fn ranks_that_issued_different_calls_fail_every_rank_naming_them_gpu() {
    let Some(devices) =
        common::two_ranks_or_skip("ranks_that_issued_different_calls_fail_every_rank_naming_them_gpu")
    else {
        return;
    };
    let _gpu = common::gpu_lock();
    let comms = init(&devices, &[]);
    let plan = comms[0]
        .choice_for(Func::AllReduce, 1024, DataType::F32)
        .unwrap()
        .unwrap();
    let other = comms[0]
        .choice_for(Func::AllReduce, 1000, DataType::F32)
        .unwrap()
        .unwrap();
    drop(comms);
    let on = |c: oxccl::Choice| {
        let s = if c.nchannels == 1 { "" } else { "s" };
        format!(
            "{}/{} on {} channel{s}",
            c.algo.name(),
            c.proto.name(),
            c.nchannels
        )
    };
    let mut fields = vec!["count"];
    if plan.nchannels != other.nchannels {
        fields.push("channels");
    }
    diverged(
        &devices,
        &[],
        &[Call(Func::AllReduce, 1024, 0, RedOp::Sum), Call(Func::AllReduce, 1000, 0, RedOp::Sum)],
        &message(
            &format!(
                "rank 0 issued allreduce call #1 (1024 × float, op sum; {}); rank 1 issued allreduce call #1 \
                 (1000 × float, op sum; {})",
                on(plan),
                on(other)
            ),
            &fields.join(", "),
        ),
    );
}

/// A mismatch found after earlier calls (a call of count 0 among them) names the call's sequence
/// number; the calls before it completed exactly; the flight recorder numbers the calls alike
/// and records the mismatched one with its outcome.
#[test]
fn the_sequence_number_counts_the_calls_before() {
    let comms = init(&Device::cpus(2), &[]);
    let streams = common::streams(&comms);
    let bufs: Vec<_> = comms.iter().map(|c| c.device().alloc(64 * 4).unwrap()).collect();
    for (r, b) in bufs.iter().enumerate() {
        b.write(0, &(r as u32 + 1).to_ne_bytes().repeat(64)).unwrap();
    }
    for _ in 0..3 {
        for r in 0..2 {
            comms[r]
                .all_reduce(&bufs[r], &bufs[r], 64, DataType::U32, RedOp::Sum, &streams[r])
                .unwrap();
        }
    }
    for r in 0..2 {
        comms[r]
            .all_reduce(&bufs[r], &bufs[r], 0, DataType::U32, RedOp::Sum, &streams[r])
            .unwrap();
    }
    common::sync_all(&streams, "three matching calls and one of count 0");
    for (r, b) in bufs.iter().enumerate() {
        // 1 + 2 = 3, then 6, then 12.
        assert_eq!(b.to_vec().unwrap(), 12u32.to_ne_bytes().repeat(64), "rank {r}");
        assert!(comms[r].get_async_error().is_ok());
    }
    comms[0]
        .all_reduce(&bufs[0], &bufs[0], 64, DataType::U32, RedOp::Max, &streams[0])
        .unwrap();
    comms[1]
        .all_reduce(&bufs[1], &bufs[1], 64, DataType::U32, RedOp::Sum, &streams[1])
        .unwrap();
    common::sync_all(&streams, "the fourth call");
    for (r, b) in bufs.iter().enumerate() {
        let m = comms[r].get_async_error().unwrap_err().to_string();
        assert!(
            m.contains(
                "rank 0 issued allreduce call #5 (64 × uint32, op max; ring/LL on 1 channel); rank 1 issued \
                 allreduce call #5 (64 × uint32, op sum; ring/LL on 1 channel); they differ in operator;"
            ),
            "rank {r}: {m}"
        );
        assert_eq!(
            b.to_vec().unwrap(),
            12u32.to_ne_bytes().repeat(64),
            "rank {r}: written after the mismatch"
        );
        let dump: serde_json::Value = serde_json::from_str(&comms[r].flight_record()).unwrap();
        let calls = dump["calls"].as_array().unwrap();
        let seen: Vec<(u64, u64, &str)> = calls
            .iter()
            .map(|c| (c["seq"].as_u64().unwrap(), c["count"].as_u64().unwrap(), c["outcome"].as_str().unwrap_or("-")))
            .collect();
        assert_eq!(
            seen,
            [(1, 64, "completed"), (2, 64, "completed"), (3, 64, "completed"), (4, 0, "completed"), (5, 64, "call mismatch")],
            "rank {r}: {dump}"
        );
    }
    for c in &comms {
        c.abort().unwrap();
    }
}

/// Calls queued with no wait between them, a mismatch among them: the calls before it complete
/// exactly, whether their kernels found the next calls' signatures already written (and
/// published their agreement ahead) or not; the diverged call and every call queued after it
/// write nothing, on every rank, and all report the mismatch. Several rounds, so that the
/// hosts' launches and the kernels interleave differently.
#[test]
fn a_mismatch_among_queued_calls_stops_it_and_every_later_call() {
    for round in 0..4 {
        // A fresh pair each round: the communicator stops at its mismatch.
        let comms = init(&Device::cpus(2), &[]);
        let streams = common::streams(&comms);
        let bufs: Vec<_> = comms.iter().map(|c| c.device().alloc(64 * 4).unwrap()).collect();
        let later: Vec<_> = comms.iter().map(|c| c.device().alloc(64 * 4).unwrap()).collect();
        for (r, (b, l)) in bufs.iter().zip(&later).enumerate() {
            b.write(0, &(r as u32 + 1).to_ne_bytes().repeat(64)).unwrap();
            l.write(0, &7u32.to_ne_bytes().repeat(64)).unwrap();
        }
        for r in 0..2 {
            for _ in 0..3 {
                comms[r].all_reduce(&bufs[r], &bufs[r], 64, DataType::U32, RedOp::Sum, &streams[r]).unwrap();
            }
            // Call 4 differs in count on rank 1; call 5 matches again.
            let n = if r == 1 { 60 } else { 64 };
            comms[r].all_reduce(&later[r], &later[r], n, DataType::U32, RedOp::Sum, &streams[r]).unwrap();
            if let Err(e) = comms[r].all_reduce(&later[r], &later[r], 64, DataType::U32, RedOp::Sum, &streams[r]) {
                // The host read the mismatch's report first: the call is refused at once.
                assert!(e.to_string().contains("call #4"), "round {round}, rank {r}: {e}");
            }
        }
        common::sync_all(&streams, "four queued calls, the fourth diverged");
        for r in 0..2 {
            // 1 + 2 = 3, then 6, then 12.
            assert_eq!(bufs[r].to_vec().unwrap(), 12u32.to_ne_bytes().repeat(64), "round {round}, rank {r}");
            assert_eq!(
                later[r].to_vec().unwrap(),
                7u32.to_ne_bytes().repeat(64),
                "round {round}, rank {r}: written at or after the mismatch"
            );
            let m = comms[r].get_async_error().unwrap_err().to_string();
            assert!(m.contains("allreduce call #4") && m.contains("they differ in count"), "round {round}, rank {r}: {m}");
        }
        for c in &comms {
            c.abort().unwrap();
        }
    }
}

/// Sends and receives queued after a diverged call (in a group of their own, or after it in its
/// group: `same_group`), before the host read the mismatch: their kernels start after the
/// mismatch's and move nothing, so no receive
/// buffer is written on any rank (a receive used to copy what its peer had already sent). The
/// ranks exchange 256 floats both ways, small enough for the sends to complete without their
/// receives. Several rounds, so that the ranks' kernels interleave differently.
fn sends_and_receives_after_a_mismatch(devices: &[Device], same_group: bool) {
    for round in 0..4 {
        let comms = init(devices, &[]);
        let streams = common::streams(&comms);
        let fill = |r: usize, bytes: usize, salt: u8| {
            let b = comms[r].device().alloc(bytes).unwrap();
            let pattern = common::sentinel(bytes, salt + r as u8);
            b.write(0, &pattern).unwrap();
            (b, pattern)
        };
        let colls: Vec<_> = (0..2).map(|r| fill(r, 68 * 4, 1)).collect();
        let sends: Vec<_> = (0..2).map(|r| fill(r, 256 * 4, 11)).collect();
        let recvs: Vec<_> = (0..2).map(|r| fill(r, 256 * 4, 21)).collect();
        let diverge = || {
            for r in 0..2 {
                let n = if r == 1 { 68 } else { 64 };
                comms[r].all_reduce(&colls[r].0, &colls[r].0, n, DataType::F32, RedOp::Sum, &streams[r]).unwrap();
            }
        };
        if !same_group {
            diverge();
        }
        let queued = oxccl::group(|| {
            if same_group {
                diverge();
            }
            for r in 0..2 {
                comms[r].send(&sends[r].0, 256, DataType::F32, 1 - r, &streams[r])?;
                comms[r].recv(&recvs[r].0, 256, DataType::F32, 1 - r, &streams[r])?;
            }
            Ok::<(), Error>(())
        });
        // The host may have read the mismatch's report first: then the group is refused.
        match queued {
            Ok(Ok(())) => {}
            Ok(Err(e)) | Err(e) => assert!(e.to_string().contains("call #1"), "round {round}: {e}"),
        }
        common::sync_all(&streams, "a diverged AllReduce, then sends and receives");
        for r in 0..2 {
            let m = comms[r].get_async_error().unwrap_err().to_string();
            assert!(m.contains("allreduce call #1") && m.contains("they differ in count"), "round {round}, rank {r}: {m}");
            for (what, (b, pattern)) in [("collective", &colls[r]), ("send", &sends[r]), ("receive", &recvs[r])] {
                assert!(b.to_vec().unwrap() == *pattern, "round {round}, rank {r}: {what} buffer written");
            }
        }
        for c in &comms {
            c.abort().unwrap();
        }
    }
}

#[test]
fn sends_and_receives_queued_after_a_mismatch_write_nothing() {
    sends_and_receives_after_a_mismatch(&Device::cpus(2), false);
    sends_and_receives_after_a_mismatch(&Device::cpus(2), true);
}

#[test]
fn sends_and_receives_queued_after_a_mismatch_write_nothing_gpu() {
    let Some(devices) = common::two_ranks_or_skip("sends_and_receives_queued_after_a_mismatch_write_nothing_gpu") else {
        return;
    };
    let _gpu = common::gpu_lock();
    sends_and_receives_after_a_mismatch(&devices, false);
    sends_and_receives_after_a_mismatch(&devices, true);
}

/// With the check on, matching calls of every collective on every protocol give exact results,
/// in place and out of place, guards intact (the collective matrix on a few pairs and counts,
/// count 0 included). On the CPU target (1 or 2 channels), 12,000 elements make a first chunk
/// of 24–48 KB, which Broadcast's root sends before the gate on LL and LL128 and AllGather's
/// ranks whole; 40,003 a chunk of 80 KB on LL128, whose head AllGather's ranks send (every rank
/// splitting that chunk's verbs there alike: `coll::ahead_elems` in the kernels' checked
/// entries) and more than one loop on LL, where a checked AllGather runs its plain entry
/// (`abi::runs_checked_entry`). Float; the int8 kernels gate first.
#[test]
fn matching_calls_run_exactly_with_the_check_on() {
    let env = Env::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]);
    // The matrix's communicators are made under this environment: the check is on in them.
    assert!(common::init_all(&Device::cpus(3)).unwrap().iter().all(|c| c.params().check_calls));
    for func in [
        Func::AllReduce,
        Func::Broadcast,
        Func::Reduce,
        Func::AllGather,
        Func::ReduceScatter,
    ] {
        common::run_collective(
            "matching_calls_run_exactly_with_the_check_on",
            &Device::cpus(3),
            &common::Matrix {
                func,
                counts: &[0, 1, 1023, 12_000, 40_003],
                extra_counts: &[],
                extra_pairs: &[],
                protos: Some(common::PROTOS),
                only: Some(&[(DataType::F32, RedOp::Sum), (DataType::I8, RedOp::Max)]),
            },
        );
    }
}

/// `CommConfig` instead of the environment: the check on and a 0.3 s timeout for one
/// communicator (nothing set in the environment); a split of it inherits both; a timeout out of
/// range is refused naming the field.
#[test]
fn a_config_turns_the_check_on_and_sets_the_timeout() {
    let _env = Env::clean(VARS);
    let config = CommConfig::default()
        .with_check_calls(true)
        .with_timeout(Duration::from_millis(300));
    let comms = Comm::init_all_config(&Device::cpus(2), &config).unwrap();
    let streams = common::streams(&comms);
    let bufs: Vec<_> = comms.iter().map(|c| c.device().alloc(64 * 4).unwrap()).collect();
    for (r, count) in [(0, 64), (1, 60)] {
        comms[r].all_reduce(&bufs[r], &bufs[r], count, DataType::F32, RedOp::Sum, &streams[r]).unwrap();
    }
    common::sync_all(&streams, "counts 64 and 60");
    for (r, c) in comms.iter().enumerate() {
        let e = c.get_async_error().unwrap_err();
        assert!(e.to_string().contains("OXCCL_CHECK_CALLS") && e.to_string().contains("they differ in count"), "rank {r}: {e}");
    }
    // The split inherits the config: a call of one of its ranks alone times out after 0.3 s.
    let kids: Vec<Comm> = {
        let fresh = Comm::init_all_config(&Device::cpus(2), &config).unwrap();
        let kids = common::on_threads(2, |r| fresh[r].split(0, r as i32).unwrap().unwrap());
        drop(fresh);
        kids
    };
    assert!(kids.iter().all(|k| k.params().check_calls), "the split inherits the check");
    let s0 = kids[0].device().new_stream().unwrap();
    let b0 = kids[0].device().alloc(1025 * 4).unwrap();
    let t = Instant::now();
    kids[0].all_reduce(&b0, &b0, 1025, DataType::F32, RedOp::Sum, &s0).unwrap();
    s0.synchronize().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let e = kids[0].get_async_error().unwrap_err();
    assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("made no progress for 0.3 s"), "{e}");
    for c in comms.iter().chain(&kids) {
        c.abort().unwrap();
    }
    for (bad, shown) in [(Duration::from_secs(2_000_000), "2000000s"), (Duration::from_nanos(1), "1ns")] {
        let e = Comm::init_all_config(&Device::cpus(2), &CommConfig::default().with_timeout(bad)).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "invalid argument: CommConfig::timeout {shown} is out of range (accepted: 0, or 0.1 to 1000000 s; 0 turns call timeouts off)"
            )
        );
    }
}

/// The check on one rank only (`CommConfig::check_calls`, which every rank must set alike):
/// init fails on both ranks in bounded time, naming the setting and each rank's value, before
/// any rank maps its peers' call check rows.
#[test]
fn the_check_on_one_rank_only_fails_init_naming_the_setting() {
    let _env = Env::clean(VARS);
    let id = common::unique_id();
    let t = Instant::now();
    let results = common::on_threads(2, |r| {
        let config = CommConfig::default().with_check_calls(r == 0);
        Comm::init_rank_config(2, &id, r, Device::Cpu(r), &config).map(|_| ())
    });
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    for (r, res) in results.iter().enumerate() {
        let e = res.as_ref().expect_err("the ranks disagree on the check");
        assert!(matches!(e, Error::InvalidUsage(_)), "rank {r}: {e:?}");
        assert_eq!(
            e.to_string(),
            format!("invalid usage: rank {r}: OXCCL_CHECK_CALLS differs across ranks: rank 0 has 1, rank 1 has 0 (every rank must set the same value)"),
            "rank {r}"
        );
    }
}

/// A checked call on 4 channels whose peer never calls: the checking block's gather and the 4
/// data blocks (waiting on a FIFO or at their gate) see the timeout's abort, so the call times
/// out in bounded time with every block gone and the buffer untouched.
#[test]
fn a_checked_call_whose_peer_never_calls_times_out_with_its_waiting_blocks() {
    let env = Env::clean(&["CHECK_CALLS", "TIMEOUT", "PROTO", "ALGO", "MIN_NCHANNELS", "MAX_NCHANNELS"]);
    env.set(&[("NCCL_MIN_NCHANNELS", "4"), ("NCCL_MAX_NCHANNELS", "4")]);
    let config = CommConfig::default()
        .with_check_calls(true)
        .with_timeout(Duration::from_millis(300));
    let comms = Comm::init_all_config(&Device::cpus(2), &config).unwrap();
    let count = 1 << 16;
    let plan = comms[0].choice_for(Func::AllReduce, count, DataType::F32).unwrap().unwrap();
    assert_eq!(plan.nchannels, 4, "{plan:?}");
    let s0 = comms[0].device().new_stream().unwrap();
    let b0 = comms[0].device().alloc(count * 4).unwrap();
    let pattern = common::sentinel(count * 4, 7);
    b0.write(0, &pattern).unwrap();
    let t = Instant::now();
    comms[0].all_reduce(&b0, &b0, count, DataType::F32, RedOp::Sum, &s0).unwrap();
    s0.synchronize().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let e = comms[0].get_async_error().unwrap_err();
    assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("made no progress for 0.3 s"), "{e}");
    assert!(b0.to_vec().unwrap() == pattern, "the timed-out call wrote its buffer");
    for c in &comms {
        c.abort().unwrap();
    }
}
