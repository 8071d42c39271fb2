//! Calls captured into a graph ([`oxccl::Stream::begin_capture`]) and replayed, checked exactly
//! on every rank, on the CPU target and on GPUs alike: [`capture_and_replay`].
use super::pattern::{elem, sum_elem, u32_bytes};
use super::{BACK, FRONT, sentinel};
use oxccl::{CapturedGraph, Comm, DataType, Device, DeviceBuffer, RedOp, Stream};

/// How the calls are captured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Graphs {
    /// All of a rank's calls in one graph, replayed as a whole.
    One,
    /// One graph per call, each replayed and synchronized before the next on every rank (ranks
    /// sharing a GPU: a multi-kernel graph of one rank could hold back a peer's kernel on a
    /// hardware queue they share, see `host/comm/enqueue.rs`).
    PerCall,
}

/// The calls captured, in order; `salt` of call `i` in replay `k` is `k * 16 + i`.
const CALLS: [&str; 7] = [
    "all_reduce (out of place)",
    "all_reduce (in place)",
    "broadcast from rank 1",
    "reduce to the last rank",
    "all_gather",
    "reduce_scatter",
    "send to the next rank, receive from the previous",
];

/// A rank's buffers: each call's input (`None`: in place or unused) and guarded output.
struct Bufs {
    inputs: Vec<Option<DeviceBuffer>>,
    outputs: Vec<DeviceBuffer>,
    /// Bytes of each output's data (between the guards).
    out_bytes: Vec<usize>,
}

fn guarded(dev: Device, bytes: usize) -> DeviceBuffer {
    dev.alloc(FRONT + bytes + BACK).unwrap()
}

/// Rank `r`'s input of call `i` with `salt`, and the output it expects (of `n` ranks, `count`
/// elements per rank).
fn data(i: usize, r: usize, n: usize, count: usize, salt: u32) -> (Vec<u8>, Vec<u8>) {
    let own = |len: usize| u32_bytes((0..len).map(|j| elem(r, j, salt)));
    let root_bc = 1 % n;
    match i {
        0 | 1 => (own(count), u32_bytes((0..count).map(|j| sum_elem(n, j, salt)))),
        2 => (own(count), u32_bytes((0..count).map(|j| elem(root_bc, j, salt)))),
        3 => (own(count), u32_bytes((0..count).map(|j| sum_elem(n, j, salt)))),
        4 => (
            own(count),
            u32_bytes((0..n * count).map(|j| elem(j / count, j % count, salt))),
        ),
        5 => (
            own(n * count),
            u32_bytes((0..count).map(|j| sum_elem(n, r * count + j, salt))),
        ),
        _ => (
            own(count),
            u32_bytes((0..count).map(|j| elem((r + n - 1) % n, j, salt))),
        ),
    }
}

/// Issues call `i` of rank `r` on `stream` (a send and receive in a group for the last).
fn issue(c: &Comm, b: &Bufs, i: usize, count: usize, stream: &Stream) -> oxccl::Result<()> {
    let n = c.nranks();
    let out = b.outputs[i].slice(FRONT, b.out_bytes[i])?;
    let input = b.inputs[i].as_ref().map(|x| x.as_slice());
    let u = DataType::U32;
    match i {
        0 => c.all_reduce(input.unwrap(), out, count, u, RedOp::Sum, stream),
        1 => c.all_reduce(out, out, count, u, RedOp::Sum, stream),
        2 => c.broadcast(input, out, count, u, 1 % n, stream),
        3 => {
            let recv = (c.rank() == n - 1).then_some(out);
            c.reduce(input.unwrap(), recv, count, u, RedOp::Sum, n - 1, stream)
        }
        4 => c.all_gather(input.unwrap(), out, count, u, stream),
        5 => c.reduce_scatter(input.unwrap(), out, count, u, RedOp::Sum, stream),
        _ => oxccl::group(|| -> oxccl::Result<()> {
            c.send(input.unwrap(), count, u, (c.rank() + 1) % n, stream)?;
            c.recv(out, count, u, (c.rank() + n - 1) % n, stream)
        })?,
    }
}

/// Writes replay `k`'s inputs and poisons every output (the in-place AllReduce's data is its
/// input); returns the outputs each rank expects.
fn prepare(b: &Bufs, r: usize, n: usize, count: usize, k: u32) -> Vec<Vec<u8>> {
    (0..CALLS.len())
        .map(|i| {
            let (input, want) = data(i, r, n, count, k * 16 + i as u32);
            let out = &b.outputs[i];
            out.write(0, &sentinel(FRONT + b.out_bytes[i] + BACK, i as u8))
                .unwrap();
            match &b.inputs[i] {
                Some(x) => x.write(0, &input).unwrap(),
                None => out.write(FRONT, &input).unwrap(),
            }
            want
        })
        .collect()
}

/// Checks call `i`'s output (data `want`, or the untouched poison when `want` is `None`, e.g.
/// a Reduce's non-root output) and its guards; the message names `what`.
fn check(b: &Bufs, i: usize, want: Option<&[u8]>, what: &str) {
    let got = b.outputs[i].to_vec().unwrap();
    let mut expect = sentinel(FRONT + b.out_bytes[i] + BACK, i as u8);
    if let Some(w) = want {
        expect[FRONT..FRONT + w.len()].copy_from_slice(w);
    }
    let wrong: Vec<usize> = (0..got.len()).filter(|&j| got[j] != expect[j]).collect();
    assert!(
        wrong.is_empty(),
        "{what}: {}: {} wrong bytes, first at byte {} (data at {FRONT}..{})",
        CALLS[i],
        wrong.len(),
        wrong[0],
        FRONT + b.out_bytes[i]
    );
}

/// Every rank (a thread each, on a stream of its own) captures the seven [`CALLS`] of `count`
/// u32 elements per rank — AllReduce out of place and in place, Broadcast from rank 1, Reduce to
/// the last rank, AllGather, ReduceScatter (Sum), and a group of a send to the next rank with a
/// receive from the previous — into `graphs`; checks that the capture ran nothing (every
/// output still poisoned, the in-place one still its input); then replays them `replays` times,
/// each time with new inputs and poisoned outputs, and checks every rank's outputs and guards
/// exactly after each replay. Between replays each rank also runs an AllReduce outside the graph
/// on the same stream, checked too: captured and issued calls continue the same connections.
pub fn capture_and_replay(test: &str, comms: &[Comm], count: usize, replays: u32, graphs: Graphs) {
    let n = comms.len();
    let ready = std::sync::Barrier::new(n);
    super::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let what = |k: &str| format!("{test}: rank {r} of {n}, {count} elements, {k}");
        let out_bytes: Vec<usize> = (0..CALLS.len())
            .map(|i| if i == 4 { n * count * 4 } else { count * 4 })
            .collect();
        let b = Bufs {
            inputs: (0..CALLS.len())
                .map(|i| (i != 1).then(|| dev.alloc(if i == 5 { n * count * 4 } else { count * 4 }).unwrap()))
                .collect(),
            outputs: out_bytes.iter().map(|&bytes| guarded(dev, bytes)).collect(),
            out_bytes,
        };
        let stream = dev.new_stream().unwrap();
        let eager_in = dev.alloc(count * 4).unwrap();
        let eager_out = dev.alloc(count * 4).unwrap();
        // Replay 0's inputs and poisoned outputs, which the capture must leave as they are.
        prepare(&b, r, n, count, 0);
        ready.wait();
        // The capture: nothing runs.
        let captured: Vec<CapturedGraph> = match graphs {
            Graphs::One => {
                stream.begin_capture().unwrap();
                for i in 0..CALLS.len() {
                    issue(c, &b, i, count, &stream).unwrap_or_else(|e| panic!("{}: {e}", what(CALLS[i])));
                }
                vec![
                    stream
                        .end_capture()
                        .unwrap_or_else(|e| panic!("{}: {e}", what("end_capture"))),
                ]
            }
            Graphs::PerCall => (0..CALLS.len())
                .map(|i| {
                    stream.begin_capture().unwrap();
                    issue(c, &b, i, count, &stream).unwrap_or_else(|e| panic!("{}: {e}", what(CALLS[i])));
                    stream
                        .end_capture()
                        .unwrap_or_else(|e| panic!("{}: {e}", what("end_capture")))
                })
                .collect(),
        };
        stream.synchronize().unwrap();
        ready.wait();
        for i in 0..CALLS.len() {
            if i == 1 {
                let got = b.outputs[1].to_vec().unwrap();
                assert_eq!(
                    &got[FRONT..FRONT + count * 4],
                    &data(1, r, n, count, 1).0[..],
                    "{}: the capture ran the in-place AllReduce",
                    what(CALLS[1])
                );
            } else {
                check(&b, i, None, &what("after the capture, before any replay"));
            }
        }
        for k in 1..=replays {
            let want = prepare(&b, r, n, count, k);
            eager_in
                .write(0, &u32_bytes((0..count).map(|j| elem(r, j, 1000 + k))))
                .unwrap();
            ready.wait();
            match graphs {
                Graphs::One => {
                    // SAFETY: every buffer and communicator of the captured calls lives until
                    // the synchronize below.
                    unsafe { captured[0].launch(&stream) }.unwrap();
                    c.all_reduce(&eager_in, &eager_out, count, DataType::U32, RedOp::Sum, &stream)
                        .unwrap();
                    stream
                        .synchronize()
                        .unwrap_or_else(|e| panic!("{}: {e}", what(&format!("replay {k}"))));
                }
                Graphs::PerCall => {
                    for g in &captured {
                        // SAFETY: as above; each replay is synchronized before the next.
                        unsafe { g.launch(&stream) }.unwrap();
                        stream
                            .synchronize()
                            .unwrap_or_else(|e| panic!("{}: {e}", what(&format!("replay {k}"))));
                        ready.wait();
                    }
                    c.all_reduce(&eager_in, &eager_out, count, DataType::U32, RedOp::Sum, &stream)
                        .unwrap();
                    stream
                        .synchronize()
                        .unwrap_or_else(|e| panic!("{}: {e}", what(&format!("replay {k}"))));
                }
            }
            for i in 0..CALLS.len() {
                let expect = (i != 3 || r == n - 1).then_some(&want[i][..]);
                check(&b, i, expect, &what(&format!("replay {k}")));
            }
            assert_eq!(
                eager_out.to_vec().unwrap(),
                u32_bytes((0..count).map(|j| sum_elem(n, j, 1000 + k))),
                "{}",
                what(&format!("the AllReduce issued after replay {k}"))
            );
            ready.wait();
        }
    });
}

/// A buffer of `bytes` data bytes between guards ([`FRONT`] before, [`BACK`] after), every
/// byte of it poisoned with `salt`'s [`sentinel`].
pub fn poisoned(dev: Device, bytes: usize, salt: u8) -> DeviceBuffer {
    let b = guarded(dev, bytes);
    b.write(0, &sentinel(FRONT + bytes + BACK, salt)).unwrap();
    b
}

/// Checks that `b` (made by [`poisoned`] with `salt`) holds `want` at the start of its data and
/// the poison everywhere else, guards included; the message names `what`.
pub fn check_guarded(b: &DeviceBuffer, salt: u8, want: &[u8], what: &str) {
    let got = b.to_vec().unwrap();
    let mut expect = sentinel(got.len(), salt);
    expect[FRONT..FRONT + want.len()].copy_from_slice(want);
    let wrong: Vec<usize> = (0..got.len()).filter(|&i| got[i] != expect[i]).collect();
    assert!(
        wrong.is_empty(),
        "{what}: {} wrong bytes, first at byte {} (data at {FRONT}..{})",
        wrong.len(),
        wrong[0],
        FRONT + want.len()
    );
}

/// Launches `graph` on `stream` and synchronizes it, panicking with `what` on an error. The
/// captured calls' buffers and communicators must live until it returns (every caller keeps them).
pub fn replay(graph: &CapturedGraph, stream: &Stream, what: &str) {
    // SAFETY: the caller keeps the captured calls' buffers and communicators alive until the
    // synchronize here.
    unsafe { graph.launch(stream) }.unwrap_or_else(|e| panic!("{what}: launch: {e}"));
    stream
        .synchronize()
        .unwrap_or_else(|e| panic!("{what}: synchronize: {e}"));
}
