//! Field failure cases from CASES.md (C01, C03, C05, C08, C25) and argument-error checks, each
//! written once over a list of devices and run on the CPU target (always) and on GPUs (skipped
//! with the reason printed when too few are visible).
//!
//! C01 covers every collective that exists with count 0: AllReduce (also with NULL pointers
//! through the raw call), Broadcast, Reduce (every root, with and without the optional buffers
//! of non-roots), AllGather, ReduceScatter, and Send/Recv with count 0 and NULL buffers inside
//! a group on both sides (every rank sends to and receives from every rank, itself included;
//! the kind of each call is what it was called as, never inferred from a NULL pointer). C03 covers avg, sum and max (PreMulSum on one rank: the `premulsum` tests). The
//! matrices and C08 are AllReduce only. C05: in-place offsets and refused overlaps; C25: rooted
//! collectives with the buffers non-roots may omit, NULL root buffers, roots out of range. C07
//! (PreMulSum's scalar width) is in the `premulsum` tests.

use crate::common;
use common::sync_all;

use oxccl::{Comm, DataType, DevSlice, Device, DeviceBuffer, Error, Func, RedOp, ResultCode, Stream};

/// Communicators over `devices` and one stream per rank.
fn group(devices: &[Device]) -> (Vec<Comm>, Vec<Stream>) {
    let comms = common::init_all(devices).unwrap_or_else(|e| panic!("init_all({devices:?}): {e}"));
    let streams = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    (comms, streams)
}

fn alloc(dev: Device, bytes: usize) -> DeviceBuffer {
    dev.alloc(bytes)
        .unwrap_or_else(|e| panic!("alloc({bytes}) on {dev:?}: {e}"))
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// splitmix64 stream, for arbitrary (non-NaN) test data.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The follow-up of C01 (and the "still in step" check of other tests): AllReduce int32 sum of
/// count 4, rank r contributing r+1 in every element, gives n(n+1)/2 on every rank; the 4-byte
/// guards on each side of the result stay intact.
fn check_in_step(comms: &[Comm], streams: &[Stream], what: &str) {
    let n = comms.len() as i32;
    let bufs: Vec<(DeviceBuffer, DeviceBuffer)> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let s = alloc(c.device(), 16);
            s.write(0, &i32_bytes(&[r as i32 + 1; 4])).unwrap();
            let d = alloc(c.device(), 24);
            d.write(0, &i32_bytes(&[-1, -2, -3, -4, -5, -6])).unwrap();
            (s, d)
        })
        .collect();
    for (r, c) in comms.iter().enumerate() {
        let recv = bufs[r].1.slice(4, 16).unwrap();
        c.all_reduce(&bufs[r].0, recv, 4, DataType::I32, RedOp::Sum, &streams[r])
            .unwrap_or_else(|e| panic!("{what}: rank {r}: follow-up all_reduce: {e}"));
    }
    sync_all(streams, what);
    for (r, (_, d)) in bufs.iter().enumerate() {
        let got = i32s(&d.to_vec().unwrap());
        let s = n * (n + 1) / 2;
        assert_eq!(
            got,
            vec![-1, s, s, s, s, -6],
            "{what}: rank {r}: AllReduce int32 sum of r+1 over {n} ranks (with guards)"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// C01: zero-count calls succeed, do nothing, and leave the communicator in step.

fn c01_zero_count(devices: &[Device]) {
    let (comms, streams) = group(devices);
    let n = devices.len();
    const LEN: usize = 64;
    let bufs: Vec<[DeviceBuffer; 4]> = devices
        .iter()
        .map(|&d| {
            let b = [alloc(d, LEN), alloc(d, LEN), alloc(d, 0), alloc(d, 0)];
            b[0].write(0, &common::sentinel(LEN, 11)).unwrap();
            b[1].write(0, &common::sentinel(LEN, 12)).unwrap();
            b
        })
        .collect();
    for &dtype in DataType::ALL {
        for &op in RedOp::ALL {
            // (description, send, recv) per rank.
            let variants: [(&str, fn(&[DeviceBuffer; 4]) -> (DevSlice<'_>, DevSlice<'_>)); 6] = [
                ("valid buffers, out of place", |b| {
                    (b[0].as_slice(), b[1].as_slice())
                }),
                ("valid buffer, in place", |b| (b[0].as_slice(), b[0].as_slice())),
                ("zero-length slices at the start", |b| {
                    (b[0].slice(0, 0).unwrap(), b[1].slice(0, 0).unwrap())
                }),
                ("zero-length slices at the end", |b| {
                    (b[0].slice(LEN, 0).unwrap(), b[1].slice(LEN, 0).unwrap())
                }),
                ("zero-length in-place slice", |b| {
                    (b[0].slice(8, 0).unwrap(), b[0].slice(8, 0).unwrap())
                }),
                ("zero-byte allocations", |b| (b[2].as_slice(), b[3].as_slice())),
            ];
            for (desc, pick) in variants {
                for (r, c) in comms.iter().enumerate() {
                    let (s, d) = pick(&bufs[r]);
                    let what =
                        |call: &str| format!("C01 nranks={n} {dtype} {op} {call} count=0 ({desc}): rank {r}");
                    c.all_reduce(s, d, 0, dtype, op, &streams[r])
                        .unwrap_or_else(|e| panic!("{}: {e}", what("AllReduce")));
                    c.reduce_scatter(s, d, 0, dtype, op, &streams[r])
                        .unwrap_or_else(|e| panic!("{}: {e}", what("ReduceScatter")));
                    // Every rank issues the same calls (so the call check, when a run turns it
                    // on, sees no divergence): twice per root, the second time without a
                    // receive buffer on the non-roots, which may pass none.
                    for root in 0..n {
                        c.reduce(s, Some(d), 0, dtype, op, root, &streams[r])
                            .unwrap_or_else(|e| panic!("{}: {e}", what(&format!("Reduce root {root}"))));
                        let recv = (r == root).then_some(d);
                        c.reduce(s, recv, 0, dtype, op, root, &streams[r]).unwrap_or_else(|e| {
                            panic!("{}: {e}", what(&format!("Reduce root {root}, recv None off the root")))
                        });
                    }
                    if op == RedOp::Sum {
                        c.all_gather(s, d, 0, dtype, &streams[r])
                            .unwrap_or_else(|e| panic!("{}: {e}", what("AllGather")));
                        // As Reduce: twice per root, the second time without a send buffer on
                        // the non-roots.
                        for root in 0..n {
                            c.broadcast(Some(s), d, 0, dtype, root, &streams[r])
                                .unwrap_or_else(|e| {
                                    panic!("{}: {e}", what(&format!("Broadcast root {root}")))
                                });
                            let send = (r == root).then_some(s);
                            c.broadcast(send, d, 0, dtype, root, &streams[r]).unwrap_or_else(|e| {
                                panic!("{}: {e}", what(&format!("Broadcast root {root}, send None off the root")))
                            });
                        }
                    }
                }
                sync_all(&streams, &format!("C01 {dtype} {op} ({desc})"));
            }
            // NULL pointers with count 0 (NCCL allows NULL buffers for empty calls).
            for (r, c) in comms.iter().enumerate() {
                // SAFETY: zero bytes are accessed through the null pointers.
                unsafe { c.all_reduce_raw(0, 0, 0, dtype, op, &streams[r]) }.unwrap_or_else(|e| {
                    panic!("C01 nranks={n} {dtype} {op} count=0 (NULL buffers): rank {r}: {e}")
                });
            }
            sync_all(&streams, &format!("C01 {dtype} {op} (NULL)"));
        }
        // Send/Recv of 0 elements with NULL buffers, in one group with every peer (one thread
        // issues every rank's calls, as one process driving its ranks does).
        oxccl::group(|| {
            for (r, c) in comms.iter().enumerate() {
                for peer in 0..n {
                    // SAFETY: zero bytes are accessed through the null pointers.
                    unsafe {
                        c.recv_raw(0, 0, dtype, peer, &streams[r])
                            .unwrap_or_else(|e| panic!("C01 nranks={n} {dtype} recv count=0 NULL from {peer}: rank {r}: {e}"));
                        c.send_raw(0, 0, dtype, peer, &streams[r])
                            .unwrap_or_else(|e| panic!("C01 nranks={n} {dtype} send count=0 NULL to {peer}: rank {r}: {e}"));
                    }
                }
            }
        })
        .unwrap_or_else(|e| panic!("C01 nranks={n} {dtype}: the group of count-0 sends and receives: {e}"));
        sync_all(&streams, &format!("C01 {dtype} send/recv (NULL)"));
    }
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(
            b[0].to_vec().unwrap(),
            common::sentinel(LEN, 11),
            "C01 nranks={n}: rank {r}: send buffer changed by count-0 calls"
        );
        assert_eq!(
            b[1].to_vec().unwrap(),
            common::sentinel(LEN, 12),
            "C01 nranks={n}: rank {r}: recv buffer changed by count-0 calls"
        );
    }
    check_in_step(&comms, &streams, &format!("C01 nranks={n}"));
}

#[test]
fn c01_zero_count_cpu_2_ranks() {
    c01_zero_count(&Device::cpus(2));
}

#[test]
fn c01_zero_count_cpu_4_ranks() {
    c01_zero_count(&Device::cpus(4));
}

#[test]
fn c01_zero_count_gpu_2_ranks() {
    let Some(d) = common::gpus_or_skip("c01_zero_count_gpu_2_ranks", 2) else {
        return;
    };
    let _g = common::gpu_lock();
    c01_zero_count(&d);
}

#[test]
fn c01_zero_count_gpu_4_ranks() {
    let Some(d) = common::gpus_or_skip("c01_zero_count_gpu_4_ranks", 4) else {
        return;
    };
    let _g = common::gpu_lock();
    c01_zero_count(&d);
}

// ---------------------------------------------------------------------------------------------
// C03: one rank, reductions are the identity, every element written (no floor(count/blocks)).

const C03_COUNTS: &[usize] = &[1, 31, 33, 1023, 1025, 1_000_003];

/// Random bits of `count` elements of `dtype` with NaN/infinity patterns turned finite (a NaN
/// has no required bit pattern through arithmetic, and the case asks for bitwise equality).
fn finite_random(dtype: DataType, count: usize, seed: u64) -> Vec<u8> {
    let mut st = seed;
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let h = splitmix(&mut st);
        match dtype {
            DataType::Bf16 => {
                let mut b = h as u16;
                if b & 0x7F80 == 0x7F80 {
                    b &= !0x0080;
                }
                out.extend_from_slice(&b.to_le_bytes());
            }
            DataType::F32 => {
                let mut b = h as u32;
                if b & 0x7F80_0000 == 0x7F80_0000 {
                    b &= !0x0080_0000;
                }
                out.extend_from_slice(&b.to_le_bytes());
            }
            _ => unreachable!("C03 uses bf16 and f32"),
        }
    }
    out
}

fn c03_single_rank(dev: Device) {
    let (comms, streams) = group(&[dev]);
    let (c, st) = (&comms[0], &streams[0]);
    let max = *C03_COUNTS.iter().max().unwrap() * 4;
    let (f, b) = (common::FRONT, common::BACK);
    let send = alloc(dev, f + max + b);
    let recv = alloc(dev, f + max + b);
    for dtype in [DataType::Bf16, DataType::F32] {
        for op in [RedOp::Avg, RedOp::Sum, RedOp::Max] {
            for &count in C03_COUNTS {
                let data = finite_random(dtype, count, 0xC03 + count as u64 * 16 + dtype as u64);
                let bytes = data.len();
                let frame = |salt: u8, body: &[u8]| {
                    let mut v = common::sentinel(f, salt);
                    v.extend_from_slice(body);
                    v.extend(common::sentinel(b, salt + 1));
                    v
                };
                for in_place in [false, true] {
                    let what = format!(
                        "C03 {dev:?} {dtype} {op} count={count} {}",
                        if in_place { "in-place" } else { "out-of-place" }
                    );
                    send.write(0, &frame(1, &data)).unwrap();
                    recv.write(0, &frame(5, &vec![0xFF; bytes])).unwrap();
                    let s = send.slice(f, bytes).unwrap();
                    let d = if in_place {
                        s
                    } else {
                        recv.slice(f, bytes).unwrap()
                    };
                    c.all_reduce(s, d, count, dtype, op, st)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    st.synchronize()
                        .unwrap_or_else(|e| panic!("{what}: synchronize: {e}"));
                    let mut got_send = vec![0; f + bytes + b];
                    send.read(0, &mut got_send).unwrap();
                    let expect_send = frame(1, &data);
                    if in_place {
                        if got_send != expect_send {
                            let i = (0..got_send.len())
                                .find(|&i| got_send[i] != expect_send[i])
                                .unwrap();
                            panic!(
                                "{what}: buffer differs from the input at byte {} of the data (guards included: {i})",
                                i as isize - f as isize
                            );
                        }
                    } else {
                        assert!(
                            got_send == expect_send,
                            "{what}: send buffer (or its guards) changed"
                        );
                        let mut got = vec![0; f + bytes + b];
                        recv.read(0, &mut got).unwrap();
                        let expect = frame(5, &data);
                        if got != expect {
                            let i = (0..got.len()).find(|&i| got[i] != expect[i]).unwrap();
                            let unwritten = got[f..f + bytes]
                                .chunks(dtype.size())
                                .filter(|e| e.iter().all(|&x| x == 0xFF))
                                .count();
                            panic!(
                                "{what}: recv differs from send at byte {} of the data (negative/beyond {bytes}: a guard byte); {unwritten} elements left unwritten",
                                i as isize - f as isize
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn c03_single_rank_identity_cpu() {
    c03_single_rank(Device::Cpu(0));
}

#[test]
fn c03_single_rank_identity_gpu() {
    let Some(d) = common::gpus_or_skip("c03_single_rank_identity_gpu", 1) else {
        return;
    };
    let _g = common::gpu_lock();
    c03_single_rank(d[0]);
}

// ---------------------------------------------------------------------------------------------
// C08: integer overflow wraps; integer Avg truncates toward zero; limits are exact.

/// AllReduce over 2 ranks of `inputs[r]` (little-endian element bytes); returns each rank's
/// result, after checking both are identical and equal to `expected`. Run out of place and in
/// place.
fn c08_run(
    comms: &[Comm],
    streams: &[Stream],
    dtype: DataType,
    op: RedOp,
    inputs: [Vec<u8>; 2],
    expected: Vec<u8>,
    what: &str,
) {
    let bytes = expected.len();
    let count = bytes / dtype.size();
    for in_place in [false, true] {
        let bufs: Vec<(DeviceBuffer, DeviceBuffer)> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let s = alloc(c.device(), bytes);
                s.write(0, &inputs[r]).unwrap();
                let d = alloc(c.device(), bytes + 8);
                d.fill(0x5A).unwrap();
                (s, d)
            })
            .collect();
        for (r, c) in comms.iter().enumerate() {
            let (s, d) = (&bufs[r].0, &bufs[r].1);
            let res = if in_place {
                c.all_reduce(s, s, count, dtype, op, &streams[r])
            } else {
                c.all_reduce(s, d.slice(0, bytes).unwrap(), count, dtype, op, &streams[r])
            };
            res.unwrap_or_else(|e| panic!("C08 {what}: rank {r}: {e}"));
        }
        sync_all(streams, what);
        let place = if in_place { "in-place" } else { "out-of-place" };
        let mut results = Vec::new();
        for (r, (s, d)) in bufs.iter().enumerate() {
            let got = if in_place {
                s.to_vec().unwrap()
            } else {
                d.to_vec().unwrap()
            };
            let (data, guard) = got.split_at(bytes);
            let shown: Vec<String> = data
                .chunks(dtype.size())
                .map(|e| oxccl::perf::check::format_elem(dtype, e))
                .collect();
            let want: Vec<String> = expected
                .chunks(dtype.size())
                .map(|e| oxccl::perf::check::format_elem(dtype, e))
                .collect();
            assert_eq!(shown, want, "C08 {what} ({place}): rank {r}");
            assert_eq!(data, &expected[..], "C08 {what} ({place}): rank {r} (bitwise)");
            if !in_place {
                assert!(
                    guard.iter().all(|&x| x == 0x5A),
                    "C08 {what} ({place}): rank {r}: bytes after the result were written"
                );
            }
            results.push(data.to_vec());
        }
        assert_eq!(results[0], results[1], "C08 {what} ({place}): ranks differ");
    }
}

fn c08_integer_overflow(devices: &[Device]) {
    assert_eq!(devices.len(), 2);
    let (c, s) = group(devices);
    let b = |v: &[i64], size: usize| -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()[..size].to_vec()).collect()
    };
    // int8 120 + 100 = -36 (wraps); also -128 + -1 = 127.
    c08_run(
        &c,
        &s,
        DataType::I8,
        RedOp::Sum,
        [b(&[120, -128, 5], 1), b(&[100, -1, -5], 1)],
        b(&[-36, 127, 0], 1),
        "int8 sum 120+100",
    );
    // uint8 200 + 100 = 44.
    c08_run(
        &c,
        &s,
        DataType::U8,
        RedOp::Sum,
        [vec![200, 255, 0], vec![100, 1, 255]],
        vec![44, 0, 255],
        "uint8 sum 200+100",
    );
    // int32 INT_MAX + 1 = INT_MIN.
    let i32b = |v: &[i32]| i32_bytes(v);
    c08_run(
        &c,
        &s,
        DataType::I32,
        RedOp::Sum,
        [i32b(&[i32::MAX, i32::MIN]), i32b(&[1, -1])],
        i32b(&[i32::MIN, i32::MAX]),
        "int32 sum INT_MAX+1",
    );
    // uint64 MAX + 1 = 0.
    let u64b = |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    c08_run(
        &c,
        &s,
        DataType::U64,
        RedOp::Sum,
        [u64b(&[u64::MAX, u64::MAX]), u64b(&[1, u64::MAX])],
        u64b(&[0, u64::MAX - 1]),
        "uint64 sum MAX+1",
    );
    // int8 prod 16 · 16 = 0 (256 wraps to 0); also -128 · -1 = -128.
    c08_run(
        &c,
        &s,
        DataType::I8,
        RedOp::Prod,
        [b(&[16, -128, 3], 1), b(&[16, -1, -43], 1)],
        b(&[0, -128, 127], 1),
        "int8 prod 16*16",
    );
    // int64 min/max at the limits, exactly.
    let (lo, hi) = (i64::MIN, i64::MAX);
    c08_run(
        &c,
        &s,
        DataType::I64,
        RedOp::Max,
        [b(&[lo, hi, lo, -1], 8), b(&[hi, lo, lo + 1, 0], 8)],
        b(&[hi, hi, lo + 1, 0], 8),
        "int64 max at the limits",
    );
    c08_run(
        &c,
        &s,
        DataType::I64,
        RedOp::Min,
        [b(&[lo, hi, hi, -1], 8), b(&[hi, lo, hi - 1, 0], 8)],
        b(&[lo, lo, hi - 1, -1], 8),
        "int64 min at the limits",
    );
    // uint64 max/min compare unsigned (a signed compare would pick MAX as -1).
    c08_run(
        &c,
        &s,
        DataType::U64,
        RedOp::Max,
        [u64b(&[u64::MAX, 0]), u64b(&[1, 1 << 63])],
        u64b(&[u64::MAX, 1 << 63]),
        "uint64 max",
    );
    c08_run(
        &c,
        &s,
        DataType::U64,
        RedOp::Min,
        [u64b(&[u64::MAX, 0]), u64b(&[1, 1 << 63])],
        u64b(&[1, 0]),
        "uint64 min",
    );
    // int32 avg truncates toward zero: {7, 8} -> 7, {-7, -8} -> -7, {-7, 8} -> 0.
    c08_run(
        &c,
        &s,
        DataType::I32,
        RedOp::Avg,
        [i32b(&[7, -7, -7]), i32b(&[8, -8, 8])],
        i32b(&[7, -7, 0]),
        "int32 avg {7,8} {-7,-8}",
    );
    check_in_step(&c, &s, "C08");
}

#[test]
fn c08_integer_overflow_cpu() {
    c08_integer_overflow(&Device::cpus(2));
}

#[test]
fn c08_integer_overflow_gpu() {
    let Some(d) = common::gpus_or_skip("c08_integer_overflow_gpu", 2) else {
        return;
    };
    let _g = common::gpu_lock();
    c08_integer_overflow(&d);
}

// ---------------------------------------------------------------------------------------------
// Argument errors.

fn expect_err(r: oxccl::Result<()>, code: ResultCode, needles: &[&str], what: &str) -> String {
    match r {
        Ok(()) => panic!("{what}: succeeded; expected {code:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert_eq!(e.code(), code, "{what}: {msg}");
            for n in needles {
                assert!(msg.contains(n), "{what}: message {msg:?} does not mention {n:?}");
            }
            msg
        }
    }
}

/// Calls that must be refused on rank 0 of a communicator over `devices`, with buffers and a
/// stream on `other` (a device that is not rank 0's). Afterwards the communicator still works.
fn argument_errors(devices: &[Device], other: Device) {
    let (comms, streams) = group(devices);
    let (c, st, dev) = (&comms[0], &streams[0], devices[0]);
    let count = 16usize;
    let bytes = count * 4;
    let good = alloc(dev, bytes);
    let good2 = alloc(dev, bytes);
    let ar = |s: DevSlice<'_>, d: DevSlice<'_>, st: &Stream| {
        c.all_reduce(s, d, count, DataType::F32, RedOp::Sum, st)
    };
    let inv = ResultCode::InvalidArgument;

    // Receive (or send) buffer too small, as a short allocation and as a short slice.
    let short = alloc(dev, bytes - 1);
    expect_err(
        ar(good.as_slice(), short.as_slice(), st),
        inv,
        &["recvbuff"],
        "recv buffer one byte short",
    );
    expect_err(
        ar(good.as_slice(), good2.slice(0, bytes - 4).unwrap(), st),
        inv,
        &["recvbuff"],
        "recv slice one element short",
    );
    expect_err(
        ar(short.as_slice(), good.as_slice(), st),
        inv,
        &["sendbuff"],
        "send buffer one byte short",
    );
    let e = c.all_reduce(&good, &good2, count, DataType::F64, RedOp::Sum, st);
    expect_err(e, inv, &["sendbuff"], "count 16 of f64 in 64-byte buffers");
    // Byte-size overflow.
    let e = c.all_reduce(&good, &good2, usize::MAX, DataType::I32, RedOp::Sum, st);
    expect_err(e, inv, &["count"], "count usize::MAX");

    // Partial overlap by one element (either order), and buffers not aligned to the element size
    // (here also overlapping).
    let big = alloc(dev, 2 * bytes);
    for (so, ro, name) in [
        (0, 4, "overlap"),
        (4, 0, "overlap"),
        (0, bytes - 1, "recvbuff"),
        (bytes - 1, 0, "sendbuff"),
        (1, 0, "sendbuff"),
    ] {
        let r = ar(big.slice(so, bytes).unwrap(), big.slice(ro, bytes).unwrap(), st);
        expect_err(
            r,
            inv,
            &[name, if name == "overlap" { "in place" } else { "aligned" }],
            &format!("send at byte {so}, recv at byte {ro} of one buffer"),
        );
    }

    // Buffers and stream on another device.
    let far = alloc(other, bytes);
    expect_err(
        ar(far.as_slice(), good.as_slice(), st),
        inv,
        &["sendbuff"],
        &format!("send buffer on {other:?}"),
    );
    expect_err(
        ar(good.as_slice(), far.as_slice(), st),
        inv,
        &["recvbuff"],
        &format!("recv buffer on {other:?}"),
    );
    let far_stream = other.new_stream().unwrap();
    expect_err(
        ar(good.as_slice(), good2.as_slice(), &far_stream),
        inv,
        &["stream"],
        &format!("stream on {other:?}"),
    );
    // SAFETY: the raw call is refused before any access (stream on another device).
    let r = unsafe {
        c.all_reduce_raw(
            good.addr(),
            good2.addr(),
            count,
            DataType::F32,
            RedOp::Sum,
            &far_stream,
        )
    };
    expect_err(
        r,
        inv,
        &["stream"],
        &format!("raw call with a stream on {other:?}"),
    );

    // Nothing was queued by the refused calls: the communicator is still in step.
    sync_all(&streams, "after refused calls");
    check_in_step(&comms, &streams, &format!("argument errors on {devices:?}"));

    // Disjoint but adjacent ranges are legal (out of place), and give the exact result.
    let adj: Vec<DeviceBuffer> = comms.iter().map(|c| alloc(c.device(), 2 * bytes)).collect();
    for (r, buf) in adj.iter().enumerate() {
        let v: Vec<u8> = (0..count)
            .flat_map(|i| ((r * 100 + i) as f32).to_le_bytes())
            .collect();
        buf.write(0, &v).unwrap();
        buf.write(bytes, &vec![0xFF; bytes]).unwrap();
    }
    for (r, c) in comms.iter().enumerate() {
        c.all_reduce(
            adj[r].slice(0, bytes).unwrap(),
            adj[r].slice(bytes, bytes).unwrap(),
            count,
            DataType::F32,
            RedOp::Sum,
            &streams[r],
        )
        .unwrap_or_else(|e| panic!("adjacent send/recv ranges: rank {r}: {e}"));
    }
    sync_all(&streams, "adjacent ranges");
    let n = comms.len();
    let want: Vec<u8> = (0..count)
        .flat_map(|i| ((0..n).map(|r| (r * 100 + i) as f32).sum::<f32>()).to_le_bytes())
        .collect();
    for (r, buf) in adj.iter().enumerate() {
        let mut got = vec![0; bytes];
        buf.read(bytes, &mut got).unwrap();
        assert_eq!(got, want, "adjacent send/recv ranges: rank {r}");
    }
}

#[test]
fn argument_errors_cpu() {
    argument_errors(&Device::cpus(2), Device::Cpu(9));
    argument_errors(&Device::cpus(1), Device::Cpu(1));
}

#[test]
fn argument_errors_gpu() {
    let Some(d) = common::gpus_or_skip("argument_errors_gpu", 1) else {
        return;
    };
    let _g = common::gpu_lock();
    // A CPU-target buffer and stream are "another device" for a CUDA rank.
    argument_errors(&d, Device::Cpu(0));
    if Device::cuda_count() >= 2 {
        argument_errors(&[Device::Cuda(0)], Device::Cuda(1));
        argument_errors(&Device::all_cuda()[..2], Device::Cuda(1));
    } else {
        skipped!("SKIPPED: argument_errors_gpu (buffer on another GPU): needs 2 GPUs, 1 visible");
    }
}

#[test]
fn init_all_empty_is_invalid_argument() {
    let e = common::init_all(&[]).err().expect("init_all(&[]) succeeded");
    assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
}

/// Rank numbers a duplicate-device message must name: "ranks A and B" or "rank A ... rank B".
fn names_ranks(msg: &str, a: usize, b: usize) -> bool {
    msg.contains(&format!("ranks {a} and {b}"))
        || (msg.contains(&format!("rank {a}")) && msg.contains(&format!("rank {b}")))
}

#[test]
fn duplicate_device_is_invalid_usage_cpu() {
    // Another test of this binary may have allowed shared devices (`two_ranks_or_skip`).
    let _env = common::env::Env::clean(&["ALLOW_SHARED_DEVICE"]);
    let e = common::init_all(&[Device::Cpu(0), Device::Cpu(0)])
        .err()
        .expect("init_all with Cpu(0) twice succeeded");
    let msg = e.to_string();
    assert_eq!(e.code(), ResultCode::InvalidUsage, "{msg}");
    assert!(
        names_ranks(&msg, 0, 1),
        "message does not name ranks 0 and 1: {msg}"
    );
    assert!(msg.contains("Cpu(0)"), "message does not name the device: {msg}");
    // Further apart, among distinct devices.
    let e = common::init_all(&[Device::Cpu(5), Device::Cpu(6), Device::Cpu(7), Device::Cpu(6)])
        .err()
        .expect("duplicate Cpu(6) accepted");
    let msg = e.to_string();
    assert_eq!(e.code(), ResultCode::InvalidUsage, "{msg}");
    assert!(
        names_ranks(&msg, 1, 3),
        "message does not name ranks 1 and 3: {msg}"
    );
    assert!(msg.contains("Cpu(6)"), "message does not name the device: {msg}");
}

#[test]
fn duplicate_device_is_invalid_usage_gpu() {
    let Some(_) = common::gpus_or_skip("duplicate_device_is_invalid_usage_gpu", 1) else {
        return;
    };
    let _g = common::gpu_lock();
    let _env = common::env::Env::clean(&["ALLOW_SHARED_DEVICE"]);
    let e = common::init_all(&[Device::Cuda(0), Device::Cuda(0)])
        .err()
        .expect("init_all with Cuda(0) twice succeeded");
    let msg = e.to_string();
    assert_eq!(e.code(), ResultCode::InvalidUsage, "{msg}");
    assert!(
        names_ranks(&msg, 0, 1),
        "message does not name ranks 0 and 1: {msg}"
    );
    assert!(msg.contains("Cuda(0)"), "message does not name the device: {msg}");
    // CUDA and CPU-target devices cannot be mixed.
    let e = common::init_all(&[Device::Cuda(0), Device::Cpu(0)])
        .err()
        .expect("mixed CUDA/CPU devices accepted");
    assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
}

// ---------------------------------------------------------------------------------------------
// C05: in place means the rank's block of the big buffer, not send == recv; any other overlap
// is refused.

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &DeviceBuffer) -> Vec<f32> {
    b.to_vec()
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Case C05 on `devices` (f32, per-rank count 1001): AllGather with `send = data + r·1001`,
/// `recv = data`; ReduceScatter with `send = data`, `recv = data + r·1001`; AllReduce, Broadcast
/// and Reduce with send == recv; then overlaps outside the in-place forms — ReduceScatter and
/// AllGather with recv == send (in place on rank 0 only), AllReduce with recv one element past
/// send — which are InvalidArgument naming the overlap, before anything is queued, on every rank
/// where they are not the in-place form.
fn c05_in_place_offsets(devices: &[Device]) {
    const COUNT: usize = 1001;
    let n = devices.len();
    let (comms, streams) = group(devices);
    let bufs: Vec<DeviceBuffer> = devices.iter().map(|d| alloc(*d, (n * COUNT + 1) * 4)).collect();
    let tri = (n * (n - 1) / 2) as f32;

    // AllGather in place: rank r's block at r·1001 holds r·10000 + i, the rest -1.
    for (r, b) in bufs.iter().enumerate() {
        let mut v = vec![-1.0f32; n * COUNT + 1];
        for i in 0..COUNT {
            v[r * COUNT + i] = (r * 10000 + i) as f32;
        }
        b.write(0, &f32_bytes(&v)).unwrap();
    }
    for (r, c) in comms.iter().enumerate() {
        let send = bufs[r].slice(r * COUNT * 4, COUNT * 4).unwrap();
        let recv = bufs[r].slice(0, n * COUNT * 4).unwrap();
        c.all_gather(send, recv, COUNT, DataType::F32, &streams[r])
            .unwrap_or_else(|e| panic!("C05 AllGather in place: rank {r}: {e}"));
    }
    sync_all(&streams, "C05 AllGather in place");
    for (r, b) in bufs.iter().enumerate() {
        let got = f32s(b);
        for k in 0..n {
            for i in 0..COUNT {
                assert_eq!(
                    got[k * COUNT + i],
                    (k * 10000 + i) as f32,
                    "C05 AllGather in place: rank {r} data[{k}·1001+{i}]"
                );
            }
        }
        assert_eq!(
            got[n * COUNT],
            -1.0,
            "C05 AllGather in place: rank {r}: the element past the buffer was written"
        );
    }

    // ReduceScatter in place: data[j] = r + j; recv = data + r·1001.
    let fill = |b: &DeviceBuffer, r: usize| {
        let v: Vec<f32> = (0..n * COUNT + 1).map(|j| (r + j) as f32).collect();
        b.write(0, &f32_bytes(&v)).unwrap();
    };
    for (r, b) in bufs.iter().enumerate() {
        fill(b, r);
    }
    for (r, c) in comms.iter().enumerate() {
        let send = bufs[r].slice(0, n * COUNT * 4).unwrap();
        let recv = bufs[r].slice(r * COUNT * 4, COUNT * 4).unwrap();
        c.reduce_scatter(send, recv, COUNT, DataType::F32, RedOp::Sum, &streams[r])
            .unwrap_or_else(|e| panic!("C05 ReduceScatter in place: rank {r}: {e}"));
    }
    sync_all(&streams, "C05 ReduceScatter in place");
    for (r, b) in bufs.iter().enumerate() {
        let got = f32s(b);
        for (j, &g) in got.iter().enumerate() {
            let want = if j / COUNT == r && j < n * COUNT {
                (n * j) as f32 + tri
            } else {
                (r + j) as f32
            };
            assert_eq!(
                g, want,
                "C05 ReduceScatter in place: rank {r} data[{j}] (4·(r·1001+i)+6 on 4 ranks)"
            );
        }
    }

    // send == recv: AllReduce, Broadcast (root 0), Reduce (root n-1).
    for (r, b) in bufs.iter().enumerate() {
        fill(b, r);
    }
    // One collective on every rank, then a synchronize, then the next: a rank that queued a
    // second collective whose kernel module is not loaded yet, while its first kernel waits for
    // the other ranks, deadlocks in the module load when the ranks share a GPU (seen on one
    // H200; the loading is lazy, per kernel).
    let d = |r: usize| bufs[r].slice(0, COUNT * 4).unwrap();
    for (r, c) in comms.iter().enumerate() {
        c.all_reduce(d(r), d(r), COUNT, DataType::F32, RedOp::Sum, &streams[r])
            .unwrap();
    }
    sync_all(&streams, "C05 AllReduce send == recv");
    for (r, c) in comms.iter().enumerate() {
        c.broadcast(Some(d(r)), d(r), COUNT, DataType::F32, 0, &streams[r])
            .unwrap();
    }
    sync_all(&streams, "C05 Broadcast send == recv");
    for (r, c) in comms.iter().enumerate() {
        c.reduce(
            d(r),
            Some(d(r)),
            COUNT,
            DataType::F32,
            RedOp::Sum,
            n - 1,
            &streams[r],
        )
        .unwrap();
    }
    sync_all(&streams, "C05 send == recv");
    for (r, b) in bufs.iter().enumerate() {
        let got = f32s(b);
        for i in 0..COUNT {
            // AllReduce: n·i + tri on every rank; Broadcast copies rank 0's; Reduce sums again on
            // rank n-1 only.
            let ar = (n * i) as f32 + tri;
            let want = if r == n - 1 { n as f32 * ar } else { ar };
            assert_eq!(
                got[i], want,
                "C05 AllReduce+Broadcast+Reduce in place: rank {r} data[{i}]"
            );
        }
        assert_eq!(
            got[COUNT],
            (r + COUNT) as f32,
            "C05 in place: rank {r}: data[1001] was written"
        );
    }

    // Outside the in-place forms: recv == send for ReduceScatter and AllGather is the in-place
    // form on rank 0 only; every other rank refuses it, naming the overlap and the form (rank 0
    // is not called: its legal call would wait for the others).
    for r in 1..n {
        let c = &comms[r];
        let all = bufs[r].slice(0, n * COUNT * 4).unwrap();
        let first = bufs[r].slice(0, COUNT * 4).unwrap();
        let e = c.reduce_scatter(all, first, COUNT, DataType::F32, RedOp::Sum, &streams[r]);
        expect_err(
            e,
            ResultCode::InvalidArgument,
            &["overlap", "recvbuff == sendbuff + rank × count"],
            "C05 ReduceScatter recv == send",
        );
        let e = c.all_gather(first, all, COUNT, DataType::F32, &streams[r]);
        expect_err(
            e,
            ResultCode::InvalidArgument,
            &["overlap", "sendbuff == recvbuff + rank × count"],
            "C05 AllGather send == recv",
        );
    }
    // A partial overlap (AllReduce with recv one element past send) is refused on every rank.
    for (r, c) in comms.iter().enumerate() {
        let send = bufs[r].slice(0, COUNT * 4).unwrap();
        let recv = bufs[r].slice(4, COUNT * 4).unwrap();
        let e = c.all_reduce(send, recv, COUNT, DataType::F32, RedOp::Sum, &streams[r]);
        expect_err(
            e,
            ResultCode::InvalidArgument,
            &["overlap"],
            "C05 AllReduce recv = send + 1",
        );
    }
    check_in_step(&comms, &streams, "C05");
}

#[test]
fn c05_in_place_offsets_cpu_4_ranks() {
    c05_in_place_offsets(&Device::cpus(4));
}

#[test]
fn c05_in_place_offsets_gpu() {
    let Some(devices) = common::two_ranks_or_skip("c05_in_place_offsets_gpu") else {
        return;
    };
    let _gpu = common::gpu_lock();
    c05_in_place_offsets(&devices);
}

// ---------------------------------------------------------------------------------------------
// C25: rooted collectives with the buffers NCCL lets non-roots omit, and bad roots.

/// Case C25 on `devices` with root `root`: Reduce f32 sum of 1024 with rank r's value r+1 and
/// no receive buffer on non-roots gives n(n+1)/2 (10.0 on 4 ranks) everywhere on the root and
/// writes nothing else; Broadcast with no send buffer on non-roots works; a root without its
/// send buffer (safe and raw entry points) and a root of n or -1 are InvalidArgument naming the
/// argument (and for the root, the range 0..=n-1) on every rank.
fn c25_rooted_nulls(devices: &[Device], root: usize) {
    const COUNT: usize = 1024;
    let n = devices.len();
    let (comms, streams) = group(devices);
    let sends: Vec<DeviceBuffer> = devices.iter().map(|d| alloc(*d, COUNT * 4)).collect();
    let recvs: Vec<DeviceBuffer> = devices.iter().map(|d| alloc(*d, COUNT * 4 + 64)).collect();
    for r in 0..n {
        sends[r].write(0, &f32_bytes(&[(r + 1) as f32; COUNT])).unwrap();
        recvs[r].fill(0xa5).unwrap();
    }
    for (r, c) in comms.iter().enumerate() {
        let recv = (r == root).then(|| recvs[r].slice(0, COUNT * 4).unwrap());
        c.reduce(
            &sends[r],
            recv,
            COUNT,
            DataType::F32,
            RedOp::Sum,
            root,
            &streams[r],
        )
        .unwrap_or_else(|e| panic!("C25 Reduce: rank {r}: {e}"));
    }
    sync_all(&streams, "C25 Reduce");
    let total = (n * (n + 1) / 2) as f32;
    for (r, b) in recvs.iter().enumerate() {
        let got = b.to_vec().unwrap();
        if r == root {
            assert_eq!(f32s(b)[..COUNT], vec![total; COUNT][..], "C25 Reduce: root {r}");
            assert_eq!(
                got[COUNT * 4..],
                vec![0xa5; 64][..],
                "C25 Reduce: root {r}: past the output"
            );
        } else {
            assert_eq!(
                got,
                vec![0xa5; COUNT * 4 + 64],
                "C25 Reduce: non-root {r} was written"
            );
        }
    }
    for (r, c) in comms.iter().enumerate() {
        let send = (r == root).then(|| sends[r].as_slice());
        c.broadcast(send, &recvs[r], COUNT, DataType::F32, root, &streams[r])
            .unwrap_or_else(|e| panic!("C25 Broadcast: rank {r}: {e}"));
    }
    sync_all(&streams, "C25 Broadcast");
    for (r, b) in recvs.iter().enumerate() {
        assert_eq!(
            f32s(b)[..COUNT],
            vec![(root + 1) as f32; COUNT][..],
            "C25 Broadcast: rank {r}"
        );
    }
    // The root without its send buffer: refused on the root before anything is queued.
    let c = &comms[root];
    let e = c
        .broadcast(None, &recvs[root], COUNT, DataType::F32, root, &streams[root])
        .expect_err("Broadcast without the root's sendbuff");
    assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
    assert!(e.to_string().contains("sendbuff"), "{e}");
    // SAFETY: the NULL send is refused before any access; the receive buffer is valid.
    let e = unsafe {
        c.collective_raw(
            Func::Reduce,
            0,
            recvs[root].addr(),
            COUNT,
            DataType::F32,
            RedOp::Sum,
            root,
            &streams[root],
        )
    }
    .expect_err("Reduce with a NULL sendbuff on the root");
    assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
    assert!(e.to_string().contains("sendbuff is NULL"), "{e}");
    // Roots out of range, on every rank (-1 as the C API would pass it).
    let range = format!("0..={}", n - 1);
    for bad in [n, usize::MAX] {
        for (r, c) in comms.iter().enumerate() {
            let e = c
                .reduce(
                    &sends[r],
                    Some(recvs[r].as_slice()),
                    COUNT,
                    DataType::F32,
                    RedOp::Sum,
                    bad,
                    &streams[r],
                )
                .expect_err("Reduce with a bad root");
            assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
            assert!(
                e.to_string().contains("root") && e.to_string().contains(&range),
                "rank {r} root {bad}: {e}"
            );
            let e = c
                .broadcast(
                    Some(sends[r].as_slice()),
                    &recvs[r],
                    COUNT,
                    DataType::F32,
                    bad,
                    &streams[r],
                )
                .expect_err("Broadcast with a bad root");
            assert!(
                e.to_string().contains("root") && e.to_string().contains(&range),
                "rank {r} root {bad}: {e}"
            );
        }
    }
    check_in_step(&comms, &streams, "C25");
}

#[test]
fn c25_rooted_nulls_cpu_4_ranks() {
    c25_rooted_nulls(&Device::cpus(4), 2);
}

#[test]
fn c25_rooted_nulls_gpu() {
    let Some(devices) = common::two_ranks_or_skip("c25_rooted_nulls_gpu") else {
        return;
    };
    let _gpu = common::gpu_lock();
    c25_rooted_nulls(&devices, 1);
}
