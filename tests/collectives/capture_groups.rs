//! Groups and point-to-point calls captured into graphs ([`oxccl::Stream::begin_capture`]) and
//! replayed on the CPU target: collectives and sends of an `oxccl::group::scope` and of a
//! `group_start`/`group_end` pair, issued by a thread per rank and by one thread driving every
//! rank; all-to-all, gather, scatter and all-to-all-v; a send and receive of different sizes
//! (reported at each replay, nothing written past the output); a group of a communicator with a
//! NET connection whose capture began after its sends were queued (refused at the group's end,
//! nothing captured); calls of a communicator and of its split in one graph; a replay and a call
//! on two streams of a rank unsynchronized; graphs outliving a split communicator. Every output
//! checked exactly on every rank, guards included.
use crate::common;

use common::capture::{check_guarded, poisoned, replay};
use common::env::{Env, Staged};
use common::pattern::{all_reduce_want, elem, input, sum_elem, u32_bytes};
use common::{BACK, FRONT, sentinel};
use oxccl::{CapturedGraph, Comm, DataType, Device, DeviceBuffer, Error, RedOp, Stream};
use std::sync::Barrier;
use std::time::{Duration, Instant};

const VARS: &[&str] = &[
    "P2P_DISABLE",
    "SHM_DISABLE",
    "PROTO",
    "ALGO",
    "CHECK_CALLS",
    "TIMEOUT",
];
const U: DataType = DataType::U32;

/// Rank `from`'s element `j` for rank `to` with `salt`.
fn val(from: usize, to: usize, j: usize, salt: u32) -> u32 {
    elem(from * 16 + to, j, salt)
}

/// One rank's buffers for [`issue_mixed`]: the input and the outputs of two AllReduces, a
/// Broadcast from the last rank, and a receive from the previous rank.
struct Mixed {
    input: DeviceBuffer,
    outs: [DeviceBuffer; 4],
}

impl Mixed {
    fn new(dev: Device, count: usize) -> Mixed {
        Mixed {
            input: dev.alloc(count * 4).unwrap(),
            outs: [0u8, 1, 2, 3].map(|salt| poisoned(dev, count * 4, salt)),
        }
    }
    /// Writes rank `r`'s inputs of `salt` and poisons the outputs.
    fn prepare(&self, r: usize, count: usize, salt: u32) {
        self.input
            .write(0, &u32_bytes((0..count).map(|j| elem(r, j, salt))))
            .unwrap();
        for (i, o) in self.outs.iter().enumerate() {
            o.write(0, &sentinel(o.len(), i as u8)).unwrap();
        }
    }
    /// Checks rank `r`'s outputs (of `n` ranks) of `salt`.
    fn check(&self, r: usize, n: usize, count: usize, salt: u32, what: &str) {
        let sum = u32_bytes((0..count).map(|j| sum_elem(n, j, salt)));
        check_guarded(&self.outs[0], 0, &sum, &format!("{what}: rank {r}: all_reduce"));
        check_guarded(
            &self.outs[1],
            1,
            &sum,
            &format!("{what}: rank {r}: second all_reduce"),
        );
        let root = u32_bytes((0..count).map(|j| elem(n - 1, j, salt)));
        check_guarded(&self.outs[2], 2, &root, &format!("{what}: rank {r}: broadcast"));
        let prev = u32_bytes((0..count).map(|j| elem((r + n - 1) % n, j, salt)));
        check_guarded(&self.outs[3], 3, &prev, &format!("{what}: rank {r}: recv"));
    }
}

/// Rank `c`'s calls of [`Mixed`] through the plain group calls: the collectives launch when
/// called, the send and receive at the end of the caller's group.
fn issue_mixed(c: &Comm, b: &Mixed, count: usize, s: &Stream) -> oxccl::Result<()> {
    let (n, r) = (c.nranks(), c.rank());
    let out = |i: usize| b.outs[i].slice(FRONT, count * 4).unwrap();
    c.all_reduce(&b.input, out(0), count, U, RedOp::Sum, s)?;
    c.all_reduce(&b.input, out(1), count, U, RedOp::Sum, s)?;
    let root = (r == n - 1).then(|| b.input.as_slice());
    c.broadcast(root, out(2), count, U, n - 1, s)?;
    c.send(&b.input, count, U, (r + 1) % n, s)?;
    c.recv(out(3), count, U, (r + n - 1) % n, s)
}

/// The calls of [`issue_mixed`] in a scope, the collectives deferred to its end (the two
/// AllReduces share a launch when the communicator batches).
fn scope_mixed<'s>(
    g: &oxccl::group::GroupScope<'s>,
    c: &'s Comm,
    b: &'s Mixed,
    count: usize,
    s: &'s Stream,
) -> oxccl::Result<()> {
    let (n, r) = (c.nranks(), c.rank());
    let out = |i: usize| b.outs[i].slice(FRONT, count * 4).unwrap();
    g.all_reduce(c, &b.input, out(0), count, U, RedOp::Sum, s)?;
    g.all_reduce(c, &b.input, out(1), count, U, RedOp::Sum, s)?;
    let root = (r == n - 1).then(|| b.input.as_slice());
    g.broadcast(c, root, out(2), count, U, n - 1, s)?;
    g.send(c, &b.input, count, U, (r + 1) % n, s)?;
    g.recv(c, out(3), count, U, (r + n - 1) % n, s)
}

/// A thread per rank captures two AllReduces, a Broadcast and a send/receive ring inside a
/// group — an `oxccl::group::scope` or a `group_start`/`group_end` pair, both deferring the
/// collectives to the group's end, where the two AllReduces (LL) share one kernel unless the
/// call check is on — and replays the graph three times, exact each time. The
/// capture counts its kernels once ([`Comm::kernel_launches`]; with the call check on, a
/// collective's check kernel too), the replays add none.
#[test]
fn groups_of_collectives_and_sends_captured_by_each_rank_replay_exactly() {
    let (n, count) = (3usize, 1500usize);
    let ready = Barrier::new(n);
    // With the call check on, a captured collective is two kernels: the check kernel, then its
    // own kernel honouring the verdict.
    for (scoped, check, kernels) in [(true, "0", 3), (true, "1", 7), (false, "0", 3), (false, "1", 7)] {
        let env = Env::clean(VARS);
        env.set(&[("OXCCL_CHECK_CALLS", check), ("NCCL_PROTO", "LL")]);
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        let how = if scoped { "scope" } else { "group_start/group_end" };
        let how = format!("{how}, call check {check}");
        common::on_threads(n, |r| {
            let c = &comms[r];
            let stream = c.device().new_stream().unwrap();
            let b = Mixed::new(c.device(), count);
            b.prepare(r, count, 0);
            let before = c.kernel_launches();
            stream.begin_capture().unwrap();
            if scoped {
                oxccl::group::scope(|g| scope_mixed(g, c, &b, count, &stream))
                    .unwrap()
                    .unwrap();
            } else {
                oxccl::group_start().unwrap();
                issue_mixed(c, &b, count, &stream).unwrap();
                oxccl::group_end().unwrap();
            }
            let graph = stream.end_capture().unwrap();
            stream.synchronize().unwrap();
            let what = format!("{how}: rank {r}");
            let launched = c.kernel_launches() - before;
            assert_eq!(launched, kernels, "{what}: kernels of the capture");
            for (i, o) in b.outs.iter().enumerate() {
                check_guarded(o, i as u8, &[], &format!("{what}: the capture ran a call"));
            }
            for salt in 1..=3 {
                b.prepare(r, count, salt);
                ready.wait();
                replay(&graph, &stream, &what);
                b.check(r, n, count, salt, &format!("{how}: replay {salt}"));
                ready.wait();
            }
            assert_eq!(
                c.kernel_launches() - before,
                kernels,
                "{what}: kernels after the replays"
            );
        });
    }
}

/// One thread drives every rank (NCCL's one thread per process): it begins a capture on every
/// rank's stream, issues every rank's AllReduces, Broadcast and send/receive inside one group (a
/// scope, or a `group_start`/`group_end` pair), ends the captures, and then launches every
/// rank's graph before synchronizing any, three times, exact each time.
#[test]
fn one_thread_capturing_every_rank_inside_one_group_replays_exactly() {
    let _env = Env::clean(VARS);
    let (n, count) = (3usize, 1025usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let bufs: Vec<Mixed> = comms.iter().map(|c| Mixed::new(c.device(), count)).collect();
    for scoped in [true, false] {
        let how = if scoped { "scope" } else { "group_start/group_end" };
        for s in &streams {
            s.begin_capture().unwrap();
        }
        if scoped {
            oxccl::group::scope(|g| {
                (0..n).try_for_each(|r| scope_mixed(g, &comms[r], &bufs[r], count, &streams[r]))
            })
            .unwrap()
            .unwrap();
        } else {
            oxccl::group_start().unwrap();
            for r in 0..n {
                issue_mixed(&comms[r], &bufs[r], count, &streams[r]).unwrap();
            }
            oxccl::group_end().unwrap();
        }
        let graphs: Vec<CapturedGraph> = streams.iter().map(|s| s.end_capture().unwrap()).collect();
        for salt in 1..=3 {
            for (r, b) in bufs.iter().enumerate() {
                b.prepare(r, count, salt);
            }
            for (g, s) in graphs.iter().zip(&streams) {
                // SAFETY: the buffers and communicators live until the synchronizes below.
                unsafe { g.launch(s) }.unwrap();
            }
            common::sync_all(&streams, how);
            for (r, b) in bufs.iter().enumerate() {
                b.check(r, n, count, salt, &format!("{how}: replay {salt}"));
            }
        }
    }
}

/// The calls built from sends and receives — all-to-all, gather (to rank 1), scatter (from rank
/// 0) and all-to-all-v (sizes differing per pair, slices with gaps between them, one pair
/// empty) — captured by every rank and replayed three times with new inputs, exact each time
/// with every byte outside the received slices untouched.
#[test]
fn all_to_all_gather_scatter_and_all_to_all_v_replay_exactly() {
    let _env = Env::clean(VARS);
    let (n, count) = (3usize, 301usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let ready = Barrier::new(n);
    // All-to-all-v: elements from rank `f` to rank `t` (none from 2 to 0), and where their
    // slices start: each after the previous one and a gap of one element.
    let cnt = |f: usize, t: usize| {
        if (f, t) == (2, 0) {
            0
        } else {
            1 + (f * 3 + t * 5) % 7 * 40
        }
    };
    let displs = |counts: Vec<usize>| -> Vec<usize> {
        counts
            .iter()
            .scan(0, |at, &c| Some(std::mem::replace(at, *at + c + 1)))
            .collect()
    };
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let (sc, rc): (Vec<usize>, Vec<usize>) = (0..n).map(|p| (cnt(r, p), cnt(p, r))).unzip();
        let (sd, rd) = (displs(sc.clone()), displs(rc.clone()));
        let (v_send, v_recv) = (sd[n - 1] + sc[n - 1], rd[n - 1] + rc[n - 1]);
        let a2a_in = dev.alloc(n * count * 4).unwrap();
        let gather_in = dev.alloc(count * 4).unwrap();
        let scatter_in = dev.alloc(n * count * 4).unwrap();
        let v_in = dev.alloc(v_send * 4).unwrap();
        let outs =
            [(n * count, 0u8), (n * count, 1), (count, 2), (v_recv, 3)].map(|(e, s)| poisoned(dev, e * 4, s));
        let out = |i: usize, elems: usize| outs[i].slice(FRONT, elems * 4).unwrap();
        stream.begin_capture().unwrap();
        c.all_to_all(&a2a_in, out(0, n * count), count, U, &stream)
            .unwrap();
        c.gather(
            &gather_in,
            (r == 1).then(|| out(1, n * count)),
            count,
            U,
            1,
            &stream,
        )
        .unwrap();
        c.scatter(
            (r == 0).then(|| scatter_in.as_slice()),
            out(2, count),
            count,
            U,
            0,
            &stream,
        )
        .unwrap();
        c.all_to_all_v(&v_in, &sc, &sd, out(3, v_recv), &rc, &rd, U, &stream)
            .unwrap();
        let graph = stream.end_capture().unwrap();
        for salt in 1..=3u32 {
            let blocks = |f: usize, ts: &mut dyn Iterator<Item = usize>, len: usize| -> Vec<u8> {
                u32_bytes(ts.flat_map(|t| (0..len).map(move |j| val(f, t, j, salt))))
            };
            a2a_in.write(0, &blocks(r, &mut (0..n), count)).unwrap();
            gather_in.write(0, &blocks(r, &mut (1..2), count)).unwrap();
            scatter_in.write(0, &blocks(r, &mut (0..n), count)).unwrap();
            let mut v = vec![0u32; v_send];
            for p in 0..n {
                for j in 0..sc[p] {
                    v[sd[p] + j] = val(r, p, j, salt + 100);
                }
            }
            v_in.write(0, &u32_bytes(v)).unwrap();
            for (i, o) in outs.iter().enumerate() {
                o.write(0, &sentinel(o.len(), i as u8)).unwrap();
            }
            ready.wait();
            replay(&graph, &stream, &format!("rank {r}: replay {salt}"));
            let what = |call: &str| format!("rank {r}: replay {salt}: {call}");
            let from_each = |to: usize, len: usize| -> Vec<u8> {
                u32_bytes((0..n).flat_map(|f| (0..len).map(move |j| val(f, to, j, salt))))
            };
            check_guarded(&outs[0], 0, &from_each(r, count), &what("all_to_all"));
            let gathered = if r == 1 { from_each(1, count) } else { Vec::new() };
            check_guarded(&outs[1], 1, &gathered, &what("gather"));
            check_guarded(
                &outs[2],
                2,
                &u32_bytes((0..count).map(|j| val(0, r, j, salt))),
                &what("scatter"),
            );
            let mut want = sentinel(FRONT + v_recv * 4 + BACK, 3)[FRONT..FRONT + v_recv * 4].to_vec();
            for p in 0..n {
                for j in 0..rc[p] {
                    let at = (rd[p] + j) * 4;
                    want[at..at + 4].copy_from_slice(&val(p, r, j, salt + 100).to_ne_bytes());
                }
            }
            check_guarded(&outs[3], 3, &want, &what("all_to_all_v"));
            ready.wait();
        }
    });
}

/// A send and a receive of different sizes captured in a graph: the capture reports nothing;
/// each replay's synchronize on the receiver names both sizes (`InvalidArgument`), the sender's
/// is clean, the receive holds the first bytes of the send up to its own size and nothing past
/// it — on LL and Simple sends, larger and smaller than the receive — and the pair then
/// exchanges exactly outside the graph.
#[test]
fn a_size_mismatch_inside_a_graph_is_reported_at_each_replay_and_writes_nothing_past_the_output() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    let ready = Barrier::new(2);
    for (sent, expected) in [(250usize, 150usize), (150, 250), (5000, 150), (150, 5000)] {
        common::on_threads(2, |r| {
            let c = &comms[r];
            let dev = c.device();
            let stream = dev.new_stream().unwrap();
            let what = format!("sent {sent}, expected {expected} elements: rank {r}");
            let input = dev.alloc(sent * 4).unwrap();
            let out = poisoned(dev, expected * 4, 9);
            stream.begin_capture().unwrap();
            match r {
                0 => c.send(&input, sent, U, 1, &stream).unwrap(),
                _ => c
                    .recv(out.slice(FRONT, expected * 4).unwrap(), expected, U, 0, &stream)
                    .unwrap(),
            }
            let graph = stream.end_capture().unwrap();
            for salt in 1..=2u32 {
                input
                    .write(0, &u32_bytes((0..sent).map(|j| elem(0, j, salt))))
                    .unwrap();
                out.write(0, &sentinel(out.len(), 9)).unwrap();
                ready.wait();
                // SAFETY: the buffers and communicator live until the synchronize below.
                unsafe { graph.launch(&stream) }.unwrap();
                let synced = stream.synchronize();
                if r == 0 {
                    assert!(synced.is_ok(), "{what}: replay {salt}: {synced:?}");
                    continue;
                }
                let e = synced
                    .err()
                    .unwrap_or_else(|| panic!("{what}: replay {salt}: no error"));
                let m = e.to_string();
                assert!(
                    matches!(e, Error::InvalidArgument(_))
                        && m.contains(&format!("expected {} bytes", expected * 4))
                        && m.contains(&format!("sent {} bytes", sent * 4)),
                    "{what}: replay {salt}: {m}"
                );
                let got = u32_bytes((0..sent.min(expected)).map(|j| elem(0, j, salt)));
                check_guarded(&out, 9, &got, &format!("{what}: replay {salt}"));
            }
            ready.wait();
            let (to, from) = (1 - r, 1 - r);
            input
                .write(0, &u32_bytes((0..sent.min(expected)).map(|j| elem(r, j, 7))))
                .unwrap();
            out.write(0, &sentinel(out.len(), 9)).unwrap();
            ready.wait();
            oxccl::group(|| -> oxccl::Result<()> {
                c.send(
                    input.slice(0, sent.min(expected) * 4).unwrap(),
                    sent.min(expected),
                    U,
                    to,
                    &stream,
                )?;
                c.recv(
                    out.slice(FRONT, expected * 4).unwrap(),
                    sent.min(expected),
                    U,
                    from,
                    &stream,
                )
            })
            .unwrap()
            .unwrap();
            stream
                .synchronize()
                .unwrap_or_else(|e| panic!("{what}: after the graph: {e}"));
            let want = u32_bytes((0..sent.min(expected)).map(|j| elem(1 - r, j, 7)));
            check_guarded(&out, 9, &want, &format!("{what}: after the graph"));
        });
    }
}

/// Over NET (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`: the proxy thread moves every step, with
/// nothing posted per call), a group's sends and receives queued before the stream began
/// capturing are captured at the group's end — nothing runs then — and each replay exchanges
/// exactly, with new data each time.
#[test]
fn a_net_group_whose_capture_began_after_its_sends_replays_exactly() {
    net_group_captured_at_its_end(false);
}

/// As above, the group also holding a send to the rank itself and its receive (a copy, captured
/// with the group).
#[test]
fn a_net_group_with_a_send_to_itself_captured_at_its_end_replays_exactly() {
    net_group_captured_at_its_end(true);
}

fn net_group_captured_at_its_end(with_self: bool) {
    let env = Staged::clean(VARS);
    env.set(&[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")]);
    let (n, count) = (2usize, 100usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let ready = Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let what = format!("with a send to itself: {with_self}: rank {r}");
        let send = dev.alloc(count * 4).unwrap();
        let outs = [0u8, 1].map(|salt| poisoned(dev, count * 4, salt));
        oxccl::group_start().unwrap();
        c.send(&send, count, U, 1 - r, &stream).unwrap();
        c.recv(outs[0].slice(FRONT, count * 4).unwrap(), count, U, 1 - r, &stream)
            .unwrap();
        if with_self {
            c.send(&send, count, U, r, &stream).unwrap();
            c.recv(outs[1].slice(FRONT, count * 4).unwrap(), count, U, r, &stream)
                .unwrap();
        }
        stream.begin_capture().unwrap();
        oxccl::group_end().unwrap_or_else(|e| panic!("{what}: group_end: {e}"));
        let graph = stream.end_capture().unwrap();
        stream.synchronize().unwrap();
        for (i, o) in outs.iter().enumerate() {
            check_guarded(o, i as u8, &[], &format!("{what}: the capture ran the group"));
        }
        for salt in 1..=2 {
            send.write(0, &input(r, count, salt)).unwrap();
            ready.wait();
            replay(&graph, &stream, &what);
            check_guarded(
                &outs[0],
                0,
                &input(1 - r, count, salt),
                &format!("{what}: replay {salt}"),
            );
            if with_self {
                check_guarded(
                    &outs[1],
                    1,
                    &input(r, count, salt),
                    &format!("{what}: replay {salt}, from itself"),
                );
            }
            ready.wait();
        }
    });
}

/// One graph per rank holds calls of two communicators: an AllReduce of the parent (4 ranks),
/// and an AllReduce and a send/receive of its split (even and odd parent ranks); every replay
/// is exact on every rank for both.
#[test]
fn calls_of_a_communicator_and_of_its_split_replay_from_one_graph() {
    let _env = Env::clean(VARS);
    let (n, count) = (4usize, 513usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let kids: Vec<Comm> =
        common::on_threads(n, |r| comms[r].split((r % 2) as i32, r as i32).unwrap().unwrap());
    let ready = Barrier::new(n);
    common::on_threads(n, |r| {
        let (c, k) = (&comms[r], &kids[r]);
        assert_eq!((k.rank(), k.nranks()), (r / 2, 2), "parent rank {r}");
        let dev = c.device();
        let stream = dev.new_stream().unwrap();
        let send = dev.alloc(count * 4).unwrap();
        let outs = [0u8, 1, 2].map(|salt| poisoned(dev, count * 4, salt));
        let data = |i: usize| outs[i].slice(FRONT, count * 4).unwrap();
        stream.begin_capture().unwrap();
        c.all_reduce(&send, data(0), count, DataType::U32, RedOp::Sum, &stream)
            .unwrap();
        k.all_reduce(&send, data(1), count, DataType::U32, RedOp::Sum, &stream)
            .unwrap();
        oxccl::group(|| -> oxccl::Result<()> {
            k.send(&send, count, DataType::U32, 1 - k.rank(), &stream)?;
            k.recv(data(2), count, DataType::U32, 1 - k.rank(), &stream)
        })
        .unwrap()
        .unwrap();
        let graph = stream.end_capture().unwrap();
        let partner = r ^ 2;
        for salt in 1..=3u32 {
            send.write(0, &input(r, count, salt)).unwrap();
            ready.wait();
            replay(&graph, &stream, &format!("rank {r}"));
            let what = |call: &str| format!("rank {r}: replay {salt}: {call}");
            check_guarded(
                &outs[0],
                0,
                &all_reduce_want(n, count, salt),
                &what("parent all_reduce"),
            );
            let pair = u32_bytes((0..count).map(|j| elem(r, j, salt).wrapping_add(elem(partner, j, salt))));
            check_guarded(&outs[1], 1, &pair, &what("split all_reduce"));
            check_guarded(&outs[2], 2, &input(partner, count, salt), &what("split recv"));
            ready.wait();
        }
    });
    common::drop_on_threads(kids);
}

/// Two AllReduces of a rank issued on two of its streams with no synchronize between them (the
/// same on every rank) complete exactly: a communicator's kernels run in the order they were
/// issued, whatever their streams, as NCCL's do. A graph's launch is ordered by its own stream
/// only, so the replay that follows on the first stream comes after the second stream is
/// synchronized, and the call after it on the second stream after the replay is.
#[test]
fn calls_on_two_streams_of_a_rank_run_in_the_order_issued() {
    let _env = Env::clean(VARS);
    let (n, count) = (2usize, 100_000usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let streams = [dev.new_stream().unwrap(), dev.new_stream().unwrap()];
        let (a, b) = (dev.alloc(count * 4).unwrap(), dev.alloc(count * 4).unwrap());
        streams[0].begin_capture().unwrap();
        c.all_reduce(&a, &a, count, DataType::U32, RedOp::Sum, &streams[0])
            .unwrap();
        let graph = streams[0].end_capture().unwrap();
        a.write(0, &input(r, count, 1)).unwrap();
        b.write(0, &input(r, count, 2)).unwrap();
        // Eager calls first: on stream 0, then on stream 1, unsynchronized.
        let (e0, e1) = (dev.alloc(count * 4).unwrap(), dev.alloc(count * 4).unwrap());
        e0.write(0, &input(r, count, 3)).unwrap();
        e1.write(0, &input(r, count, 4)).unwrap();
        c.all_reduce(&e0, &e0, count, DataType::U32, RedOp::Sum, &streams[0])
            .unwrap();
        c.all_reduce(&e1, &e1, count, DataType::U32, RedOp::Sum, &streams[1])
            .unwrap();
        streams[1].synchronize().unwrap();
        // SAFETY: the buffers and communicator live until the synchronizes below.
        unsafe { graph.launch(&streams[0]) }.unwrap();
        streams[0].synchronize().unwrap();
        c.all_reduce(&b, &b, count, DataType::U32, RedOp::Sum, &streams[1])
            .unwrap();
        // Bounded: the two kernels may also wait for each other forever.
        let synced = std::thread::scope(|s| {
            let h = s.spawn(|| streams.iter().try_for_each(|st| st.synchronize()));
            let start = Instant::now();
            while !h.is_finished() && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let hung = !h.is_finished();
            if hung {
                let _ = c.abort();
            }
            (hung, h.join().unwrap())
        });
        assert!(!synced.0, "rank {r}: the streams did not finish in 10 s");
        synced.1.unwrap();
        assert!(
            a.to_vec().unwrap() == all_reduce_want(n, count, 1),
            "rank {r}: the replay"
        );
        assert!(
            b.to_vec().unwrap() == all_reduce_want(n, count, 2),
            "rank {r}: the call"
        );
        assert!(
            e0.to_vec().unwrap() == all_reduce_want(n, count, 3),
            "rank {r}: the call on stream 0"
        );
        assert!(
            e1.to_vec().unwrap() == all_reduce_want(n, count, 4),
            "rank {r}: the call on stream 1"
        );
    });
}

/// The graphs of a split communicator (whose teardown has a barrier of its ranks), kept after
/// the communicator was dropped on a thread per rank, are dropped one after the other from one
/// thread at once (a CUDA graph holds nothing of its communicator).
#[test]
fn graphs_that_outlive_a_split_communicator_drop_at_once_from_one_thread() {
    let env = Env::clean(&["BOOTSTRAP_TIMEOUT"]);
    env.set(&[("OXCCL_BOOTSTRAP_TIMEOUT", "5")]);
    let n = 2;
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let kids: Vec<Comm> = common::on_threads(n, |r| comms[r].split(0, r as i32).unwrap().unwrap());
    let graphs = common::on_threads(n, |r| {
        let k = &kids[r];
        let stream = k.device().new_stream().unwrap();
        let buf = k.device().alloc(64).unwrap();
        buf.write(0, &input(r, 16, 6)).unwrap();
        stream.begin_capture().unwrap();
        k.all_reduce(&buf, &buf, 16, DataType::U32, RedOp::Sum, &stream)
            .unwrap();
        let graph = stream.end_capture().unwrap();
        replay(&graph, &stream, &format!("rank {r}"));
        assert!(buf.to_vec().unwrap() == all_reduce_want(n, 16, 6), "rank {r}");
        graph
    });
    common::drop_on_threads(kids);
    let start = Instant::now();
    drop(graphs);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "dropping the graphs took {:?}",
        start.elapsed()
    );
}
