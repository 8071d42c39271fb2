//! The flight recorder's sends and receives (`Comm::flight_record`, `oxccl trace`): every rank
//! records them with their peer, size, number per peer and group, next to its collectives, and
//! `flight_recorder::analyze` matches them per pair of ranks. CPU target, and the kernels' times
//! and outcomes on GPUs too. (Dumps written on a timeout or on `SIGUSR1`: `timeout.rs`.)
use crate::common;

use common::env::Env;
use oxccl::comm::flight_recorder::analyze;
use oxccl::{Comm, DataType, Device};
use serde_json::{Value, json};

/// Two CPU ranks with the flight recorder as by default and `OXCCL_TIMEOUT=limit` (so that a
/// call that should complete fails the test instead of hanging it).
fn init(limit: &str) -> Vec<Comm> {
    init_on(&Device::cpus(2), limit)
}

/// [`init`] on `devices`.
fn init_on(devices: &[Device], limit: &str) -> Vec<Comm> {
    let env = Env::clean(&["TIMEOUT", "FLIGHT_RECORDER_DUMP", "FLIGHT_RECORDER_SIZE", "PROTO", "ALGO"]);
    env.set(&[("OXCCL_TIMEOUT", limit)]);
    common::init_all(devices).unwrap()
}

/// Every rank's dump, named by its rank.
fn dumps(comms: &[Comm]) -> Vec<(String, String)> {
    comms.iter().map(|c| (format!("rank {}", c.rank()), c.flight_record())).collect()
}

/// The communicator id of a dump.
fn comm_id(dump: &(String, String)) -> String {
    let v: Value = serde_json::from_str(&dump.1).unwrap();
    v["comm"].as_str().unwrap().to_string()
}

/// A dump's calls without their issue, start and end times and outcome, and collectives without their algorithm, protocol
/// and channels (the tuning's choice; checked to be there).
fn calls(dump: &(String, String)) -> Vec<Value> {
    let v: Value = serde_json::from_str(&dump.1).unwrap();
    assert_eq!(v["dropped"], 0, "{}", dump.1);
    v["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let o = c.as_object_mut().unwrap();
            assert!(o.remove("issued_unix_ns").unwrap().is_u64(), "{}", dump.1);
            for k in ["started_unix_ns", "ended_unix_ns", "outcome"] {
                let v = o.remove(k).unwrap();
                // Sends and receives are not marked; collectives are (`the_kernels_of_...`).
                assert!(!o["seq"].is_null() || v.is_null(), "{k}: {}", dump.1);
            }
            if !o["seq"].is_null() {
                for k in ["algo", "proto", "nchannels"] {
                    assert!(!o.remove(k).unwrap().is_null(), "{k}: {}", dump.1);
                }
            }
            c
        })
        .collect()
}

/// A send or receive entry as recorded (see `flight_recorder`'s module docs).
fn p2p(func: &str, peer: usize, count: u64, p2p_seq: u64, group: u64) -> Value {
    json!({"seq": null, "func": func, "count": count, "dtype": "float", "op": null, "root": null,
           "algo": null, "proto": null, "nchannels": null, "peer": peer, "bytes": 4 * count,
           "p2p_seq": p2p_seq, "group": group})
}

/// Two groups of sends and receives (one thread drives both ranks) around an AllReduce: each
/// rank's dump holds them in issue order, numbered per peer and per group, and `analyze` finds
/// every send matched and the ranks in agreement.
#[test]
fn sends_and_receives_of_groups_are_recorded_and_matched() {
    let comms = init("20");
    let streams = common::streams(&comms);
    let count = 16;
    let bytes = count * 4;
    let sent = |r: usize| -> Vec<u8> { (0..bytes).map(|i| (i * 3 + 100 * r) as u8).collect() };
    let bufs: Vec<_> = comms
        .iter()
        .map(|c| {
            let b = c.device().alloc(2 * bytes).unwrap();
            b.write(0, &sent(c.rank())).unwrap();
            b
        })
        .collect();
    oxccl::group(|| -> oxccl::Result<()> {
        for (r, c) in comms.iter().enumerate() {
            c.send(bufs[r].slice(0, bytes)?, count, DataType::F32, 1 - r, &streams[r])?;
            c.recv(bufs[r].slice(bytes, bytes)?, count, DataType::F32, 1 - r, &streams[r])?;
        }
        Ok(())
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "the exchange");
    for (r, b) in bufs.iter().enumerate() {
        let mut got = vec![0u8; bytes];
        b.read(bytes, &mut got).unwrap();
        assert_eq!(got, sent(1 - r), "rank {r}");
    }
    common::all_reduce_f32(&comms, 7, false);
    oxccl::group(|| -> oxccl::Result<()> {
        comms[0].send(bufs[0].slice(0, 16)?, 4, DataType::F32, 1, &streams[0])?;
        comms[1].recv(bufs[1].slice(bytes, 16)?, 4, DataType::F32, 0, &streams[1])
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "the second group");
    let d = dumps(&comms);
    let allreduce = json!({"seq": 1, "func": "allreduce", "count": 7, "dtype": "float", "op": "sum", "root": 0});
    let count = count as u64;
    assert_eq!(
        calls(&d[0]),
        vec![p2p("send", 1, count, 1, 1), p2p("recv", 1, count, 1, 1), allreduce.clone(), p2p("send", 1, 4, 2, 2)]
    );
    assert_eq!(
        calls(&d[1]),
        vec![p2p("send", 0, count, 1, 1), p2p("recv", 0, count, 1, 1), allreduce, p2p("recv", 0, 4, 2, 2)]
    );
    assert_eq!(
        analyze(&d).unwrap(),
        format!(
            "communicator {}: 2 ranks, dumps from 2\n  \
             every rank issued 1 calls; they agree on every recorded call; 3 recorded sends match their receives\n",
            comm_id(&d[0])
        )
    );
    for c in &comms {
        assert!(c.get_async_error().is_ok(), "rank {}: {:?}", c.rank(), c.get_async_error());
    }
}

/// Rank 0 sends 64 bytes to rank 1, which never posts the receive: the send fits the peer
/// channel's FIFO, so it completes without its receive (as in NCCL), and `analyze` names it.
#[test]
fn trace_names_a_send_whose_receive_was_never_posted() {
    let comms = init("20");
    common::all_reduce_f32(&comms, 7, false);
    let stream = comms[0].device().new_stream().unwrap();
    let b = comms[0].device().alloc(64).unwrap();
    comms[0].send(&b, 16, DataType::F32, 1, &stream).unwrap();
    stream.synchronize().unwrap();
    assert!(comms[0].get_async_error().is_ok(), "{:?}", comms[0].get_async_error());
    let d = dumps(&comms);
    assert_eq!(
        analyze(&d).unwrap(),
        format!(
            "communicator {}: 2 ranks, dumps from 2\n  \
             rank 0's send #1 to rank 1 (16 × float = 64 bytes, no group) has no matching receive: rank 1 issued 0 receives from rank 0\n",
            comm_id(&d[0])
        )
    );
    for c in &comms {
        c.abort().unwrap();
    }
}

/// Each collective's kernel is marked started and ended with its outcome: two AllReduces on both
/// ranks complete (issued ≤ started ≤ ended); a third on rank 0 alone times out
/// (`OXCCL_TIMEOUT=0.5`) and is recorded so, ended at least the limit after it started.
#[test]
fn the_kernels_of_collectives_are_timed_with_their_outcome() {
    kernels_timed_with_their_outcome(&Device::cpus(2));
}

/// As the CPU test, on GPUs (2, or 2 ranks sharing one), where a call's start is not known
/// (null) and its end is when the rank's launch event is seen complete.
#[test]
fn the_kernels_of_collectives_are_timed_with_their_outcome_gpu() {
    let Some(devices) = common::two_ranks_or_skip("the_kernels_of_collectives_are_timed_with_their_outcome_gpu") else {
        return;
    };
    let _gpu = common::gpu_lock();
    kernels_timed_with_their_outcome(&devices);
}

fn kernels_timed_with_their_outcome(devices: &[Device]) {
    let gpu = devices[0].is_cuda();
    let comms = init_on(devices, "0.5");
    common::all_reduce_f32(&comms, 100, false);
    common::all_reduce_f32(&comms, 100, true);
    let streams = common::streams(&comms);
    let buf = comms[0].device().alloc(4 * 100).unwrap();
    comms[0].all_reduce(&buf, &buf, 100, DataType::F32, oxccl::RedOp::Sum, &streams[0]).unwrap();
    streams[0].synchronize().unwrap();
    assert!(comms[0].get_async_error().is_err(), "rank 1 never called");
    for (r, dump) in dumps(&comms).iter().enumerate() {
        let v: Value = serde_json::from_str(&dump.1).unwrap();
        let calls = v["calls"].as_array().unwrap();
        assert_eq!(calls.len(), if r == 0 { 3 } else { 2 }, "{}", dump.1);
        for (i, c) in calls.iter().enumerate() {
            let t = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("rank {r} call {i}: {k}: {c}"));
            let (issued, ended) = (t("issued_unix_ns"), t("ended_unix_ns"));
            // On a GPU the kernel's start is not recorded: the issue stands in for it.
            let started = if gpu {
                assert!(c["started_unix_ns"].is_null(), "rank {r} call {i}: {c}");
                issued
            } else {
                t("started_unix_ns")
            };
            assert!(issued <= started && started <= ended, "rank {r} call {i}: {c}");
            let timed_out = r == 0 && i == 2;
            assert_eq!(c["outcome"], if timed_out { "timed out" } else { "completed" }, "rank {r} call {i}: {c}");
            if timed_out {
                assert!(ended - started >= 500_000_000, "rank {r} call {i}: {c}");
            }
        }
    }
    for c in &comms {
        c.abort().unwrap();
    }
}
