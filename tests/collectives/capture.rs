//! Calls captured into a graph ([`oxccl::Stream::begin_capture`], CUDA's stream capture; on the
//! CPU target the stream records its operations) and replayed, on the CPU target (every run):
//! every collective and a group of a send and a receive, exact on every rank over P2P and SHM on
//! each protocol, across the LL flag's wrap and with the call check on, with calls issued outside
//! the graph between replays; one graph per call; a call-check mismatch inside a graph reported
//! at its replay, and one in a later call of a graph stopping every later replay; the same over
//! NET, whose proxy moves the replays' steps as any others; the flight recorder keeping the
//! captured calls, untimed; a capture invalidated by what cannot be replayed, after which the
//! ranks go on in step; a graph of small LL calls replayed 50 times (the FIFO wrapping); replays
//! and calls interleaved over two streams of each rank; an abort ending a replay whose peer never
//! replays; graphs dropped unlaunched or right after a launch. Groups, several communicators and
//! point-to-point calls in graphs are in `capture_groups`; the GPU run is in `gpu_collectives`.
use crate::common;

use common::capture::{Graphs, capture_and_replay, check_guarded, poisoned, replay};
use common::env::Staged;
use common::pattern::{all_reduce_want, input, sum_elem, u32_bytes};
use common::{BACK, FRONT, sentinel};
use oxccl::{Comm, DataType, DevSlice, Device, Error, RedOp, Stream};
use std::sync::Barrier;
use std::time::{Duration, Instant};

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
                let env = Staged::clean(VARS);
                let mut all = vars.to_vec();
                all.push(("NCCL_PROTO", proto));
                env.set(&all);
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
        let env = Staged::clean(VARS);
        env.set(vars);
        let comms = common::init_all(&Device::cpus(3)).unwrap();
        capture_and_replay(what, &comms, 517, 4, Graphs::One);
    }
}

#[test]
fn one_graph_per_call_replays_exactly() {
    let _env = Staged::clean(VARS);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    capture_and_replay("one graph per call", &comms, 777, 2, Graphs::PerCall);
}

/// With the call check on, ranks that captured different calls (AllReduce of 64 and of 32
/// elements) are told so when the graphs replay: every rank's error names the calls, and no
/// buffer changed.
#[test]
fn a_call_check_mismatch_inside_a_graph_is_reported_at_its_replay() {
    let env = Staged::clean(VARS);
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
        assert!(
            m.contains("allreduce call in a CUDA graph (64 × uint32"),
            "rank {r}: {m}"
        );
    }
    for c in &comms {
        c.abort().unwrap();
    }
}

/// Over NET (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`) every collective and a send/receive group
/// replay exactly on each protocol, as over P2P and SHM: the proxy thread moves every step it
/// finds in the FIFOs, with nothing posted per call, so a graph's launches need no host.
#[test]
fn captured_calls_replay_exactly_over_net_on_every_protocol() {
    let env = Staged::clean(VARS);
    for proto in ["LL", "LL128", "Simple"] {
        env.set(&[
            ("NCCL_P2P_DISABLE", "1"),
            ("NCCL_SHM_DISABLE", "1"),
            ("NCCL_PROTO", proto),
        ]);
        let comms = common::init_all(&Device::cpus(3)).unwrap();
        capture_and_replay(&format!("NET, {proto}"), &comms, 4099, 3, Graphs::One);
    }
}

/// A captured call is in the flight recorder as issued, with outcome `"captured"`, numbered
/// among the collectives; `OXCCL_TIMEOUT` does not count the time its graph waits to be launched
/// (the watch times the calls that run, not the ones captured), and after a replay the ranks'
/// calls still run exactly.
#[test]
fn captured_calls_are_recorded_and_not_timed_while_their_graph_waits() {
    let env = Staged::clean(VARS);
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

/// An AllReduce (Sum) of `count` u32 elements on `c`, issued on `s`.
fn sum_u32<'a>(
    c: &Comm,
    send: impl Into<DevSlice<'a>>,
    recv: impl Into<DevSlice<'a>>,
    count: usize,
    s: &Stream,
) {
    c.all_reduce(send, recv, count, DataType::U32, RedOp::Sum, s)
        .unwrap_or_else(|e| panic!("rank {}: all_reduce: {e}", c.rank()));
}

/// Small LL calls whose graph is replayed 50 times: every replay moves each connection's steps
/// on, so the FIFO's slots wrap many times over, and every replay's outputs are exact on every
/// rank (an AllReduce, an AllGather and a send/receive ring of 37 elements, new inputs each
/// time; the outputs poisoned before each replay, guards checked).
#[test]
fn a_graph_of_small_ll_calls_replays_exactly_fifty_times() {
    let env = Staged::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL")]);
    let (n, count, replays) = (3usize, 37usize, 50u32);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let ready = Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let src = dev.alloc(count * 4).unwrap();
        let outs = [count * 4, n * count * 4, count * 4].map(|bytes| poisoned(dev, bytes, r as u8));
        let data = |i: usize| outs[i].slice(FRONT, outs[i].len() - FRONT - BACK).unwrap();
        stream.begin_capture().unwrap();
        sum_u32(c, &src, data(0), count, &stream);
        c.all_gather(&src, data(1), count, DataType::U32, &stream)
            .unwrap();
        oxccl::group(|| -> oxccl::Result<()> {
            c.send(&src, count, DataType::U32, (r + 1) % n, &stream)?;
            c.recv(data(2), count, DataType::U32, (r + n - 1) % n, &stream)
        })
        .unwrap()
        .unwrap();
        let graph = stream.end_capture().unwrap();
        for k in 1..=replays {
            for o in &outs {
                o.write(0, &sentinel(o.len(), r as u8)).unwrap();
            }
            src.write(0, &input(r, count, k)).unwrap();
            ready.wait();
            replay(&graph, &stream, &format!("rank {r}: replay {k}"));
            let what = |call: &str| format!("rank {r}: replay {k}: {call}");
            let sum = all_reduce_want(n, count, k);
            check_guarded(&outs[0], r as u8, &sum, &what("all_reduce"));
            let gathered: Vec<u8> = (0..n).flat_map(|p| input(p, count, k)).collect();
            check_guarded(&outs[1], r as u8, &gathered, &what("all_gather"));
            let from = (r + n - 1) % n;
            check_guarded(&outs[2], r as u8, &input(from, count, k), &what("recv"));
            ready.wait();
        }
    });
}

/// Each rank has two streams and issues on them, in turn, replays of a graph captured on the
/// first (an in-place AllReduce) and AllReduces outside it, synchronizing each step's stream
/// before the next step; the ranks pick different streams for the same step, so a graph is
/// launched on a stream it was not captured on. Twice, the graph is launched twice in a row
/// before one synchronize: the second replay sums the first's result (n times the sum).
#[test]
fn replays_and_eager_calls_interleave_over_two_streams_of_each_rank() {
    let _env = Staged::clean(VARS);
    let (n, count) = (3usize, 300usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let ready = Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let streams = [dev.new_stream().unwrap(), dev.new_stream().unwrap()];
        let acc = dev.alloc(count * 4).unwrap();
        let (src, out) = (dev.alloc(count * 4).unwrap(), dev.alloc(count * 4).unwrap());
        streams[0].begin_capture().unwrap();
        sum_u32(c, &acc, &acc, count, &streams[0]);
        let graph = streams[0].end_capture().unwrap();
        let steps = [1, 0, 2, 0, 0, 1, 2, 1, 0];
        for (k, &replays) in steps.iter().enumerate() {
            let s = &streams[(r + k) % 2];
            let salt = k as u32 + 1;
            let what = format!("rank {r}: step {k} ({replays} replays)");
            if replays == 0 {
                src.write(0, &input(r, count, salt)).unwrap();
                out.fill(0xEE).unwrap();
            } else {
                acc.write(0, &input(r, count, salt)).unwrap();
            }
            ready.wait();
            if replays == 0 {
                sum_u32(c, &src, &out, count, s);
            }
            for _ in 0..replays {
                // SAFETY: the buffers and communicator live until the synchronize below.
                unsafe { graph.launch(s) }.unwrap();
            }
            s.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
            let (got, times) = match replays {
                0 => (out.to_vec().unwrap(), 1),
                1 => (acc.to_vec().unwrap(), 1),
                _ => (acc.to_vec().unwrap(), n as u32),
            };
            let want = u32_bytes((0..count).map(|j| sum_elem(n, j, salt).wrapping_mul(times)));
            assert!(got == want, "{what}: wrong result");
            ready.wait();
        }
    });
}

/// A capture invalidated after it recorded calls (a synchronize of the capturing stream, then
/// more calls) runs none of them, and the ranks go on in step: an AllReduce outside any capture
/// and then a new capture's replay are exact — also with the call check on, whose numbering
/// counted the calls of the invalidated capture on every rank alike.
#[test]
fn the_ranks_go_on_in_step_after_a_capture_invalidated_midway() {
    for check in ["0", "1"] {
        let env = Staged::clean(VARS);
        env.set(&[("OXCCL_CHECK_CALLS", check), ("OXCCL_TIMEOUT", "30")]);
        let (n, count) = (3usize, 1000usize);
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        let ready = Barrier::new(n);
        common::on_threads(n, |r| {
            let c = &comms[r];
            let what = format!("check {check}, rank {r}");
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let src = dev.alloc(count * 4).unwrap();
            src.write(0, &input(r, count, 1)).unwrap();
            let out = poisoned(dev, count * 4, 7);
            let data = out.slice(FRONT, count * 4).unwrap();
            stream.begin_capture().unwrap();
            sum_u32(c, &src, data, count, &stream);
            let e = stream.synchronize().unwrap_err();
            assert!(e.to_string().contains("capturing"), "{what}: {e}");
            let (one, all) = (src.slice(0, 4).unwrap(), out.slice(FRONT, 4 * n).unwrap());
            c.all_gather(one, all, 1, DataType::U32, &stream).unwrap();
            let e = stream
                .end_capture()
                .err()
                .expect("an invalidated capture ended in a graph");
            assert!(e.to_string().contains("invalidated"), "{what}: {e}");
            stream.synchronize().unwrap();
            ready.wait();
            check_guarded(&out, 7, &[], &format!("{what}: the invalidated capture wrote"));
            sum_u32(c, &src, data, count, &stream);
            stream.synchronize().unwrap();
            let want = |salt| all_reduce_want(n, count, salt);
            check_guarded(&out, 7, &want(1), &format!("{what}: after it"));
            stream.begin_capture().unwrap();
            sum_u32(c, &src, data, count, &stream);
            let graph = stream.end_capture().unwrap();
            ready.wait();
            src.write(0, &input(r, count, 2)).unwrap();
            ready.wait();
            replay(&graph, &stream, &what);
            check_guarded(&out, 7, &want(2), &format!("{what}: a new capture"));
            assert!(c.get_async_error().is_ok(), "{what}: {:?}", c.get_async_error());
        });
    }
}

/// A replay waiting for a peer that never replays its graph ends when the communicator is
/// aborted — the waiting rank itself from another thread, or the peer (whose abort raises the
/// waiting rank's flag): the stream's synchronize returns within seconds, the async error names
/// the abort, and a graph launched after the abort ends at once too.
#[test]
fn an_abort_ends_a_replay_waiting_for_a_peer_that_never_replays() {
    let _env = Staged::clean(VARS);
    let dog = common::Watchdog::new("abort of a waiting replay", Duration::from_secs(60));
    for aborter in [0usize, 1] {
        let comms = common::init_all(&Device::cpus(2)).unwrap();
        let captured = Barrier::new(2);
        let what = format!("rank {aborter} aborts");
        dog.step(what.clone());
        common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let buf = dev.alloc(4096).unwrap();
            stream.begin_capture().unwrap();
            sum_u32(c, &buf, &buf, 1024, &stream);
            let graph = stream.end_capture().unwrap();
            captured.wait();
            if r == 0 {
                // The abort comes 300 ms after the launch.
                let start = Instant::now();
                replay(&graph, &stream, &what);
                let took = start.elapsed().as_millis();
                assert!((250..8000).contains(&took), "{what}: the replay took {took} ms");
                let start = Instant::now();
                replay(&graph, &stream, &format!("{what}: a replay after the abort"));
                let took = start.elapsed();
                assert!(
                    took < Duration::from_secs(3),
                    "{what}: a replay after the abort took {took:?}"
                );
                let e = c.get_async_error().unwrap_err();
                assert!(e.to_string().contains("aborted"), "{what}: rank 0: {e}");
            } else {
                std::thread::sleep(Duration::from_millis(300));
                let idle = comms[0].wait_idle(Duration::ZERO).unwrap();
                assert!(!idle, "{what}: rank 0's replay is not running");
                comms[aborter].abort().unwrap();
            }
        });
        for c in &comms {
            let _ = c.abort();
        }
    }
}

/// `OXCCL_TIMEOUT` does not time a replay (README): a replay that waits 2.5 s for a peer that
/// launches its graph late, with a limit of 1 s, completes exactly on both ranks, without an
/// error.
#[test]
fn a_replay_waiting_past_the_timeout_for_a_late_peer_is_not_timed_out() {
    let env = Staged::clean(VARS);
    env.set(&[("OXCCL_TIMEOUT", "1")]);
    let count = 256;
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let captured = Barrier::new(2);
    common::on_threads(2, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let src = dev.alloc(count * 4).unwrap();
        src.write(0, &input(r, count, 3)).unwrap();
        let out = poisoned(dev, count * 4, 3);
        stream.begin_capture().unwrap();
        sum_u32(c, &src, out.slice(FRONT, count * 4).unwrap(), count, &stream);
        let graph = stream.end_capture().unwrap();
        captured.wait();
        if r == 1 {
            std::thread::sleep(Duration::from_millis(2500));
        }
        // SAFETY: the buffers and communicator live until the synchronize below.
        unsafe { graph.launch(&stream) }.unwrap();
        let synced = stream.synchronize();
        assert!(synced.is_ok(), "rank {r}: {synced:?}");
        assert!(c.get_async_error().is_ok(), "rank {r}: {:?}", c.get_async_error());
        check_guarded(&out, 3, &all_reduce_want(2, count, 3), &format!("rank {r}"));
    });
}

/// Graphs dropped before any replay, or right after a launch (before it ran), change nothing:
/// the launched replay runs exactly, and later calls, checked (`OXCCL_CHECK_CALLS=1`, whose
/// numbering counted the dropped graph's call on every rank), too. The communicators may also
/// be dropped before their graphs; replaying a graph after its communicator is gone breaks
/// [`oxccl::CapturedGraph::launch`]'s safety contract and is not tried.
#[test]
fn graphs_dropped_before_or_right_after_a_launch_leave_later_calls_exact() {
    let env = Staged::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "30")]);
    let (n, count) = (3usize, 777usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let ready = Barrier::new(n);
    let kept = common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let src = dev.alloc(count * 4).unwrap();
        let out = poisoned(dev, count * 4, 5);
        let data = out.slice(FRONT, count * 4).unwrap();
        let capture = || {
            stream.begin_capture().unwrap();
            sum_u32(c, &src, data, count, &stream);
            stream.end_capture().unwrap()
        };
        drop(capture());
        let graph = capture();
        src.write(0, &input(r, count, 1)).unwrap();
        ready.wait();
        // SAFETY: the buffers and communicator live until the synchronize below.
        unsafe { graph.launch(&stream) }.unwrap();
        drop(graph);
        stream.synchronize().unwrap();
        let want = |salt| all_reduce_want(n, count, salt);
        check_guarded(&out, 5, &want(1), &format!("rank {r}: the replay"));
        ready.wait();
        src.write(0, &input(r, count, 2)).unwrap();
        sum_u32(c, &src, data, count, &stream);
        stream.synchronize().unwrap();
        check_guarded(&out, 5, &want(2), &format!("rank {r}: after"));
        assert!(c.get_async_error().is_ok(), "rank {r}: {:?}", c.get_async_error());
        capture()
    });
    let start = Instant::now();
    drop(comms);
    drop(kept);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "dropping took {took:?}");
}

/// With the call check on, a graph of two AllReduces whose second differs between the ranks
/// (its operator: Sum on rank 0, Max on rank 1): at the replay the first is exact, the second
/// writes nothing and every rank's async error names the operator; a second replay moves no
/// data at all, and a later call is refused with the mismatch.
#[test]
fn a_call_check_mismatch_in_a_later_call_of_a_graph_stops_it_and_every_later_replay() {
    let env = Staged::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]);
    let count = 64;
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    common::on_threads(2, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let src = dev.alloc(count * 4).unwrap();
        src.write(0, &input(r, count, 4)).unwrap();
        let outs = [0u8, 1].map(|salt| poisoned(dev, count * 4, salt));
        let data = |i: usize| outs[i].slice(FRONT, count * 4).unwrap();
        let second = if r == 0 { RedOp::Sum } else { RedOp::Max };
        stream.begin_capture().unwrap();
        sum_u32(c, &src, data(0), count, &stream);
        c.all_reduce(&src, data(1), count, DataType::U32, second, &stream)
            .unwrap();
        let graph = stream.end_capture().unwrap();
        let what = format!("rank {r}");
        replay(&graph, &stream, &what);
        check_guarded(
            &outs[0],
            0,
            &all_reduce_want(2, count, 4),
            &format!("{what}: first call"),
        );
        check_guarded(&outs[1], 1, &[], &format!("{what}: the mismatched call"));
        let e = c.get_async_error().unwrap_err();
        let m = e.to_string();
        assert!(
            matches!(e, Error::InvalidUsage(_)) && m.contains("they differ in operator"),
            "rank {r}: {m}"
        );
        outs[0].write(0, &sentinel(outs[0].len(), 0)).unwrap();
        let what = format!("{what}: a replay after the mismatch");
        replay(&graph, &stream, &what);
        for (i, o) in outs.iter().enumerate() {
            check_guarded(o, i as u8, &[], &what);
        }
        let e = c.all_reduce(&src, data(0), count, DataType::U32, RedOp::Sum, &stream);
        let e = e.unwrap_err().to_string();
        assert!(e.contains("the ranks issued different calls"), "rank {r}: {e}");
    });
}

/// With the call check on, a graph whose call differs between the ranks, replayed between two
/// matching eager calls queued with no wait between them: the first eager call is exact; the
/// replay writes nothing; the eager call after it writes nothing either, or is refused at once,
/// even where the first call's kernel found its signatures already written and published its
/// agreement ahead (the replay's check stops the communicator after that). Several fresh pairs,
/// so that the hosts' launches and the kernels interleave differently.
#[test]
fn a_graph_mismatch_stops_an_eager_call_agreed_ahead() {
    let env = Staged::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]);
    let count = 64;
    for round in 0..6 {
        let comms = common::init_all(&Device::cpus(2)).unwrap();
        let barrier = Barrier::new(2);
        common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let src = dev.alloc(count * 4).unwrap();
            src.write(0, &input(r, count, 6)).unwrap();
            let outs = [0u8, 1, 2].map(|salt| poisoned(dev, count * 4, salt));
            let data = |i: usize| outs[i].slice(FRONT, count * 4).unwrap();
            let op = if r == 0 { RedOp::Sum } else { RedOp::Max };
            let capture = dev.new_stream().unwrap();
            capture.begin_capture().unwrap();
            c.all_reduce(&src, data(1), count, DataType::U32, op, &capture).unwrap();
            let graph = capture.end_capture().unwrap();
            barrier.wait();
            sum_u32(c, &src, data(0), count, &stream);
            // SAFETY: the buffers and communicator live until the synchronize below.
            unsafe { graph.launch(&stream) }.unwrap();
            let after = c.all_reduce(&src, data(2), count, DataType::U32, RedOp::Sum, &stream);
            stream.synchronize().unwrap();
            let what = format!("round {round}, rank {r}");
            check_guarded(&outs[0], 0, &all_reduce_want(2, count, 6), &format!("{what}: the first eager call"));
            check_guarded(&outs[1], 1, &[], &format!("{what}: the graph's call"));
            check_guarded(&outs[2], 2, &[], &format!("{what}: the eager call after the graph"));
            if let Err(e) = after {
                assert!(e.to_string().contains("the ranks issued different calls"), "{what}: {e}");
            }
            let m = c.get_async_error().unwrap_err().to_string();
            assert!(m.contains("they differ in operator"), "{what}: {m}");
        });
    }
}

/// With the call check on, graphs captured in another order on each rank — rank 0 captures
/// AllReduce A then B, rank 1 B then A — and replayed in the same order (A, then B) on both,
/// as the README allows (only the replays' order matters), run exactly without a mismatch.
#[test]
fn with_the_call_check_graphs_captured_in_another_order_on_each_rank_replay_exactly() {
    let env = Staged::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]);
    let count = 1000;
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    common::on_threads(2, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let src = dev.alloc(count * 4).unwrap();
        src.write(0, &input(r, count, 5)).unwrap();
        let outs = [0u8, 1].map(|salt| poisoned(dev, count * 4, salt));
        let capture = |i: usize| {
            stream.begin_capture().unwrap();
            let out = outs[i].slice(FRONT, count * 4).unwrap();
            sum_u32(c, &src, out, count, &stream);
            stream.end_capture().unwrap()
        };
        let graphs = if r == 0 {
            let a = capture(0);
            [a, capture(1)]
        } else {
            let b = capture(1);
            [capture(0), b]
        };
        for g in &graphs {
            // SAFETY: the buffers and communicator live until the synchronize below.
            unsafe { g.launch(&stream) }.unwrap();
        }
        stream.synchronize().unwrap();
        assert!(c.get_async_error().is_ok(), "rank {r}: {:?}", c.get_async_error());
        let want = all_reduce_want(2, count, 5);
        for (i, o) in outs.iter().enumerate() {
            check_guarded(o, i as u8, &want, &format!("rank {r}: graph {i}"));
        }
    });
}
