//! Calls captured into a graph ([`oxccl::Stream::begin_capture`], CUDA's stream capture; on the
//! CPU target the stream records its operations) and replayed, on the CPU target (every run):
//! every collective and a group of a send and a receive, exact on every rank over P2P and SHM on
//! each protocol, across the LL flag's wrap and with the call check on, with calls issued outside
//! the graph between replays; one graph per call; a call-check mismatch inside a graph reported
//! at its replay; a communicator with a NET connection refusing the capture on every rank; the
//! flight recorder keeping the captured calls, untimed; a capture invalidated by what cannot be
//! replayed. The GPU run is in `gpu_collectives`.
use crate::common;

use common::capture::{Graphs, capture_and_replay};
use common::env::Env;
use oxccl::{DataType, Device, Error, RedOp};
use std::time::Duration;

const VARS: &[&str] = &[
    "P2P_DISABLE",
    "SHM_DISABLE",
    "PROTO",
    "ALGO",
    "CHECK_CALLS",
    "TIMEOUT",
    "TEST_INITIAL_STEP",
    "FLIGHT_RECORDER_SIZE",
];

#[test]
fn captured_calls_replay_exactly_over_p2p_and_shm_on_every_protocol() {
    for (transport, vars) in [("P2P", &[][..]), ("SHM", &[("NCCL_P2P_DISABLE", "1")][..])] {
        for proto in ["LL", "LL128", "Simple"] {
            for (n, count) in [(2usize, 1031usize), (3, 4099)] {
                let env = Env::clean(VARS);
                env.set(vars);
                env.set(&[("NCCL_PROTO", proto)]);
                let comms = common::init_all(&Device::cpus(n)).unwrap();
                let test = format!("{transport}, {proto}");
                capture_and_replay(&test, &comms, count, 3, Graphs::One);
            }
        }
    }
}

/// LL connections whose steps start 6 below the flag's period (2^32), so the replays' steps
/// cross it; and every call checked (`OXCCL_CHECK_CALLS=1`: the check's gather is captured with
/// its call and compares the same signatures at every replay).
#[test]
fn captured_calls_replay_exactly_across_the_ll_flag_wrap_and_with_the_call_check() {
    let cases: [(&str, &[(&str, &str)]); 2] = [
        (
            "LL across the flag wrap",
            &[("NCCL_PROTO", "LL"), ("OXCCL_TEST_INITIAL_STEP", "4294967290")],
        ),
        (
            "call check on",
            &[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "60")],
        ),
    ];
    for (what, vars) in cases {
        let env = Env::clean(VARS);
        env.set(vars);
        let comms = common::init_all(&Device::cpus(3)).unwrap();
        capture_and_replay(what, &comms, 517, 4, Graphs::One);
    }
}

#[test]
fn one_graph_per_call_replays_exactly() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    capture_and_replay("one graph per call", &comms, 777, 2, Graphs::PerCall);
}

/// With the call check on, ranks that captured different calls (AllReduce of 64 and of 32
/// elements) are told so when the graphs replay: every rank's error names the calls, and no
/// buffer changed.
#[test]
fn a_call_check_mismatch_inside_a_graph_is_reported_at_its_replay() {
    let env = Env::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let errors = common::on_threads(2, |r| {
        let c = &comms[r];
        let dev = c.device();
        let pattern = common::sentinel(256, r as u8);
        let buf = dev.alloc(256).unwrap();
        buf.write(0, &pattern).unwrap();
        let stream = dev.new_stream().unwrap();
        stream.begin_capture().unwrap();
        let count = if r == 0 { 64 } else { 32 };
        c.all_reduce(&buf, &buf, count, DataType::U32, RedOp::Sum, &stream)
            .unwrap();
        let graph = stream.end_capture().unwrap();
        assert!(
            c.get_async_error().is_ok(),
            "rank {r}: the capture itself checked the call"
        );
        // SAFETY: the buffer and communicator live until the synchronize below.
        unsafe { graph.launch(&stream) }.unwrap();
        stream.synchronize().unwrap();
        assert!(
            buf.to_vec().unwrap() == pattern,
            "rank {r}: the mismatched call wrote its buffer"
        );
        c.get_async_error().unwrap_err()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(matches!(e, Error::InvalidUsage(_)), "rank {r}: {e}");
        let m = e.to_string();
        assert!(
            m.contains("the ranks issued different calls") && m.contains("count"),
            "rank {r}: {m}"
        );
        assert!(m.contains("64") && m.contains("32"), "rank {r}: {m}");
    }
    for c in &comms {
        c.abort().unwrap();
    }
}

/// Over NET (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`) the proxy thread posts each call's steps
/// from the host, which a graph's replay would not do: every rank refuses a collective and a
/// send on a capturing stream with `InvalidUsage` naming the NET connection, nothing is
/// captured, and the ranks then run collectives outside the capture exactly.
#[test]
fn a_communicator_with_a_net_connection_refuses_capture_on_every_rank() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")]);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    common::on_threads(3, |r| {
        let c = &comms[r];
        let dev = c.device();
        let buf = dev.alloc(4096).unwrap();
        let stream = dev.new_stream().unwrap();
        stream.begin_capture().unwrap();
        let ar = c.all_reduce(&buf, &buf, 1024, DataType::F32, RedOp::Sum, &stream);
        let send = c.send(&buf, 1024, DataType::F32, (r + 1) % 3, &stream);
        let graph = stream.end_capture().unwrap();
        for (what, res) in [("all_reduce", ar), ("send", send)] {
            let e = res.unwrap_err();
            assert!(matches!(e, Error::InvalidUsage(_)), "rank {r}: {what}: {e}");
            let m = e.to_string();
            assert!(
                m.contains("captured into a CUDA graph")
                    && m.contains("NET transport")
                    && m.contains("ranks 0 and 1"),
                "rank {r}: {what}: {m}"
            );
        }
        let oxccl::CapturedGraph::Cpu(g) = &graph else {
            panic!("rank {r}: a CPU stream gave a CUDA graph")
        };
        assert!(g.is_empty(), "rank {r}: {} operations were captured", g.len());
    });
    common::all_reduce_f32(&comms, 1024, false);
}

/// A captured call is in the flight recorder as issued, with outcome `"captured"`, numbered
/// among the collectives; `OXCCL_TIMEOUT` does not count the time its graph waits to be launched
/// (the watch times the calls that run, not the ones captured), and after a replay the ranks'
/// calls still run exactly.
#[test]
fn captured_calls_are_recorded_and_not_timed_while_their_graph_waits() {
    let env = Env::clean(VARS);
    env.set(&[("OXCCL_TIMEOUT", "1")]);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    common::all_reduce_f32(&comms, 256, false);
    common::on_threads(2, |r| {
        let c = &comms[r];
        let dev = c.device();
        let send = dev.alloc(1024).unwrap();
        send.write(0, &common::pattern::input(r, 256, 9)).unwrap();
        let recv = dev.alloc(1024).unwrap();
        let stream = dev.new_stream().unwrap();
        stream.begin_capture().unwrap();
        c.all_reduce(&send, &recv, 256, DataType::U32, RedOp::Sum, &stream)
            .unwrap();
        let graph = stream.end_capture().unwrap();
        std::thread::sleep(Duration::from_millis(2500));
        assert!(c.get_async_error().is_ok(), "rank {r}: {:?}", c.get_async_error());
        let dump: serde_json::Value = serde_json::from_str(&c.flight_record()).unwrap();
        let calls = dump["calls"].as_array().unwrap();
        let last = calls.last().unwrap();
        assert_eq!(
            (
                last["func"].as_str(),
                last["count"].as_u64(),
                last["outcome"].as_str(),
                last["seq"].as_u64()
            ),
            (Some("allreduce"), Some(256), Some("captured"), Some(2)),
            "rank {r}: {last}"
        );
        // SAFETY: the buffers and communicator live until the synchronize below.
        unsafe { graph.launch(&stream) }.unwrap();
        stream.synchronize().unwrap();
        assert_eq!(
            recv.to_vec().unwrap(),
            common::pattern::all_reduce_want(2, 256, 9),
            "rank {r}"
        );
        assert!(c.get_async_error().is_ok(), "rank {r}: {:?}", c.get_async_error());
    });
    common::all_reduce_f32(&comms, 256, true);
}

/// What cannot be replayed — a synchronize of the capturing stream — invalidates the capture
/// (as in CUDA): the synchronize fails, and so does the end of the capture, naming why; the
/// stream then works as before. A graph runs only on a stream of its own device.
#[test]
fn a_synchronize_during_a_capture_invalidates_it() {
    let dev = Device::Cpu(0);
    let stream = dev.new_stream().unwrap();
    stream.begin_capture().unwrap();
    assert!(stream.is_capturing().unwrap());
    assert!(
        stream.begin_capture().is_err(),
        "a second capture began on a capturing stream"
    );
    let e = stream.synchronize().unwrap_err();
    assert!(e.to_string().contains("capturing"), "{e}");
    let e = stream
        .end_capture()
        .err()
        .expect("an invalidated capture ended in a graph");
    assert!(
        matches!(e, Error::InvalidUsage(_)) && e.to_string().contains("invalidated"),
        "{e}"
    );
    assert!(!stream.is_capturing().unwrap());
    stream.synchronize().unwrap();
    stream.begin_capture().unwrap();
    let graph = stream.end_capture().unwrap();
    let other = Device::Cpu(1).new_stream().unwrap();
    // SAFETY: the graph is empty.
    let e = unsafe { graph.launch(&other) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("captured on cpu:0 but the stream is on cpu:1"),
        "{e}"
    );
    // SAFETY: as above.
    unsafe { graph.launch(&stream) }.unwrap();
    stream.synchronize().unwrap();
}
