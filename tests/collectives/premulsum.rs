//! PreMulSum (NCCL's `ncclRedOpCreatePreMulSum`): the sum of every rank's input times that rank's
//! scalar, through `ReduceOp::PreMulSum` (host-immediate scalar) and `ReduceOp::PreMulSumDevice`
//! (device-resident), on the CPU target always and on GPUs when present (skipped with the reason
//! printed otherwise).
//!
//! - Case C07 (CASES.md): 2 ranks, bfloat16 / half / float / double, count 8, rank r's input r+1;
//!   host scalars 0.5, 2.0, 4.0 and a device-resident 5.0 give exactly 1.5, 6.0, 12.0 and 15.0 in
//!   every element on both ranks (AllReduce, Reduce to each root, ReduceScatter).
//! - The matrix: AllReduce (ring, and the tree on 2 nodes), Reduce (every root) and ReduceScatter
//!   × LL / LL128 / Simple (forced with `NCCL_PROTO`) × every dtype × counts from 0 to past one
//!   LL step × out of place (host scalar) and in place (device scalar), with a different scalar
//!   on every rank. Inputs are small integers and the scalars 0.5, 2, 1, 4 (floats) or r+2
//!   (integers, wrapping), so every sum is exact in every type and in any order: the expected
//!   value is computed exactly and compared bitwise. Outputs are poisoned, guard elements past
//!   the output and the parts of the buffers a rank must not write are checked unchanged.
//! - One rank: the kernel's one-rank path scales the input.
//! - Bad scalars: another type than the call's, a short or misaligned device scalar, a scalar on
//!   another device: InvalidArgument naming the scalar, on every rank, before anything is queued.
use crate::common;
use common::sync_all;

use half::{bf16, f16};
use oxccl::{Comm, DataType, Device, DeviceBuffer, Func, ReduceOp, ResultCode, Scalar, Stream};

/// Guard elements after every output range, poisoned like the output and checked unchanged.
const GUARD: usize = 16;
const POISON: u8 = 0xa5;

/// Counts of the matrix: empty, below one pack, odd, and (65536+3) past one LL step.
const COUNTS: &[usize] = &[0, 1, 7, 1001, 65539];

/// Rank `r`'s scalar: 0.5, 2, 1, 4, ... for the float types (1, 2, 1, 2, ... for fp8, whose
/// 3- or 4-bit significands hold only small sums exactly), r + 2 for the integer types.
fn scalar_value(dtype: DataType, r: usize) -> f64 {
    if dtype.is_fp8() {
        [1.0, 2.0][r % 2]
    } else if dtype.is_float() {
        [0.5, 2.0, 1.0, 4.0][r % 4]
    } else {
        (r + 2) as f64
    }
}

/// Rank `r`'s input element `i`: -5..=5 (0..=10 for the unsigned types; -1..=1 for fp8, so every
/// partial sum of up to 5 ranks is an integer of magnitude at most 8, exact in E5M2 and E4M3).
fn input_value(dtype: DataType, r: usize, i: usize) -> i64 {
    if dtype.is_fp8() {
        return ((i * 7 + r * 3 + 1) % 3) as i64 - 1;
    }
    let v = ((i * 7 + r * 3 + 1) % 11) as i64;
    if matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64) {
        v
    } else {
        v - 5
    }
}

/// The bytes of `v` as one element of `dtype` (integers wrap to the type's width).
fn encode(dtype: DataType, v: f64, int: i128) -> Vec<u8> {
    match dtype {
        DataType::I8 | DataType::U8 => vec![int as u8],
        DataType::I32 | DataType::U32 => (int as u32).to_le_bytes().to_vec(),
        DataType::I64 | DataType::U64 => (int as u64).to_le_bytes().to_vec(),
        DataType::F16 => f16::from_f64(v).to_bits().to_le_bytes().to_vec(),
        DataType::Bf16 => bf16::from_f64(v).to_bits().to_le_bytes().to_vec(),
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F64 => v.to_le_bytes().to_vec(),
        DataType::F8E4M3 => vec![oxccl::F8E4M3::from_f64(v).0],
        DataType::F8E5M2 => vec![oxccl::F8E5M2::from_f64(v).0],
    }
}

/// Rank `r`'s input of `n` elements.
fn input(dtype: DataType, r: usize, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let x = input_value(dtype, r, i);
            encode(dtype, x as f64, x as i128)
        })
        .collect()
}

/// Σ_r scalar_r × input_r(i) for i < n, exact (then rounded once to the type, which the small
/// values make exact too).
fn expected(dtype: DataType, nranks: usize, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let mut f = 0f64;
            let mut k = 0i128;
            for r in 0..nranks {
                let (s, x) = (scalar_value(dtype, r), input_value(dtype, r, i));
                f += s * x as f64;
                k += s as i128 * x as i128;
            }
            encode(dtype, f, k)
        })
        .collect()
}

/// The scalar operand of rank `r`: host-immediate, or written into `dev_scalar` (device-resident).
fn op_for<'a>(dtype: DataType, r: usize, dev_scalar: Option<&'a DeviceBuffer>) -> ReduceOp<'a> {
    let s = Scalar::from_f64(scalar_value(dtype, r), dtype);
    match dev_scalar {
        None => ReduceOp::PreMulSum(s),
        Some(b) => {
            let bits = s.to_bits().to_le_bytes();
            b.write(0, &bits[..dtype.size()])
                .expect("write the device scalar");
            ReduceOp::PreMulSumDevice(b.as_slice())
        }
    }
}

fn comms(devices: &[Device], proto: &str, tree: bool) -> Vec<Comm> {
    let env = common::env::Env::clean(&["PROTO", "ALGO", "TEST_NODES"]);
    let mut vars = vec![("NCCL_PROTO", proto)];
    if tree {
        vars.extend([("NCCL_ALGO", "tree"), ("OXCCL_TEST_NODES", "2")]);
    }
    env.set(&vars);
    common::init_all(devices)
        .unwrap_or_else(|e| panic!("init_all({devices:?}) NCCL_PROTO={proto} tree={tree}: {e}"))
}

/// Byte ranges of a buffer compared after a call: (offset, expected bytes).
type Want = Vec<(usize, Vec<u8>)>;

/// One call of `func` with PreMulSum on every rank, then the checks; returns the failures.
#[allow(clippy::too_many_arguments)]
fn run_case(
    comms: &[Comm],
    streams: &[Stream],
    scalars: &[DeviceBuffer],
    func: Func,
    dtype: DataType,
    count: usize,
    root: usize,
    in_place: bool,
    device_scalar: bool,
) -> Vec<String> {
    let n = comms.len();
    let es = dtype.size();
    let send_elems = if func == Func::ReduceScatter {
        n * count
    } else {
        count
    };
    let exp = expected(dtype, n, send_elems);
    let what = format!(
        "{func} dtype={dtype} count={count} root={root} nranks={n} {} {} scalar",
        if in_place { "in-place" } else { "out-of-place" },
        if device_scalar { "device" } else { "host" },
    );
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    let mut wants: Vec<(Want, Want)> = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let dev = c.device();
        let own = input(dtype, r, send_elems);
        let send = dev.alloc((send_elems + GUARD) * es).expect("alloc send");
        send.fill(POISON).expect("poison send");
        send.write(0, &own).expect("write send");
        let recv = dev.alloc((count + GUARD) * es).expect("alloc recv");
        recv.fill(POISON).expect("poison recv");
        let poison = |k: usize| vec![POISON; k * es];
        let block = |b: usize| exp[b * count * es..(b + 1) * count * es].to_vec();
        // (send buffer, recv buffer) contents after the call.
        let want = match (func, in_place) {
            (Func::AllReduce, false) => (
                vec![(0, own.clone())],
                vec![(0, exp.clone()), (count * es, poison(GUARD))],
            ),
            (Func::AllReduce, true) => (vec![(0, exp.clone()), (count * es, poison(GUARD))], vec![]),
            (Func::Reduce, false) if r == root => (
                vec![(0, own.clone())],
                vec![(0, exp.clone()), (count * es, poison(GUARD))],
            ),
            (Func::Reduce, false) => (vec![(0, own.clone())], vec![(0, poison(count + GUARD))]),
            (Func::Reduce, true) if r == root => {
                (vec![(0, exp.clone()), (count * es, poison(GUARD))], vec![])
            }
            (Func::Reduce, true) => (vec![(0, own.clone()), (count * es, poison(GUARD))], vec![]),
            (Func::ReduceScatter, false) => (
                vec![(0, own.clone())],
                vec![(0, block(r)), (count * es, poison(GUARD))],
            ),
            (Func::ReduceScatter, true) => {
                let mut w = own.clone();
                w[r * count * es..(r + 1) * count * es].copy_from_slice(&block(r));
                (vec![(0, w), (send_elems * es, poison(GUARD))], vec![])
            }
            _ => unreachable!("{func} takes no operator"),
        };
        sends.push(send);
        recvs.push(recv);
        wants.push(want);
    }
    // Every rank's scalar is written before any rank calls: on a GPU that two ranks share, a
    // synchronous write would wait for the kernel of a rank that already called.
    let ops: Vec<ReduceOp<'_>> = (0..n)
        .map(|r| op_for(dtype, r, device_scalar.then_some(&scalars[r])))
        .collect();
    for (r, c) in comms.iter().enumerate() {
        let op = ops[r];
        let (send, recv) = (&sends[r], &recvs[r]);
        let s = &streams[r];
        let res = match (func, in_place) {
            (Func::AllReduce, false) => c.all_reduce(send, recv, count, dtype, op, s),
            (Func::AllReduce, true) => c.all_reduce(send, send, count, dtype, op, s),
            (Func::Reduce, false) => {
                let rv = (r == root).then(|| recv.as_slice());
                c.reduce(send, rv, count, dtype, op, root, s)
            }
            (Func::Reduce, true) => c.reduce(send, Some(send.as_slice()), count, dtype, op, root, s),
            (Func::ReduceScatter, false) => c.reduce_scatter(send, recv, count, dtype, op, s),
            (Func::ReduceScatter, true) => {
                let rv = send.slice(r * count * es, count * es).expect("in-place block");
                c.reduce_scatter(send, rv, count, dtype, op, s)
            }
            _ => unreachable!(),
        };
        res.unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
    }
    sync_all(streams, &what);
    let mut errs = Vec::new();
    for r in 0..n {
        for (buf, want, name) in [(&sends[r], &wants[r].0, "send"), (&recvs[r], &wants[r].1, "recv")] {
            let got = buf.to_vec().expect("read back");
            for (off, w) in want {
                let g = &got[*off..*off + w.len()];
                let wrong = g.chunks(es).zip(w.chunks(es)).filter(|(a, b)| a != b).count();
                if wrong > 0 {
                    let at = g
                        .chunks(es)
                        .zip(w.chunks(es))
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    errs.push(format!(
                        "{what}: rank {r} {name}[{}..]: #wrong {wrong}, first at element {at}: got {:02x?} want {:02x?}",
                        off / es,
                        &g[at * es..(at + 1) * es],
                        &w[at * es..(at + 1) * es]
                    ));
                }
            }
        }
    }
    errs
}

/// The matrix over `devices` for `funcs` (see the module docs); `tree`: AllReduce on the tree of
/// 2 nodes instead of the ring.
fn matrix(test: &str, devices: &[Device], funcs: &[Func], tree: bool, counts: &[usize]) {
    let n = devices.len();
    let streams: Vec<Stream> = devices.iter().map(|d| d.new_stream().expect("stream")).collect();
    let scalars: Vec<DeviceBuffer> = devices.iter().map(|d| d.alloc(16).expect("scalar")).collect();
    let dog = common::Watchdog::new(test, std::time::Duration::from_secs(300));
    let mut errs = Vec::new();
    let mut runs = 0;
    for proto in common::protos() {
        let comms = comms(devices, proto, tree);
        for &func in funcs {
            let roots: Vec<usize> = if func == Func::Reduce {
                (0..n).collect()
            } else {
                vec![0]
            };
            for dtype in common::dtypes() {
                for &count in counts {
                    for &root in &roots {
                        for in_place in [false, true] {
                            dog.step(format!(
                                "{func} {proto} {dtype} count={count} root={root} in_place={in_place}"
                            ));
                            errs.extend(run_case(
                                &comms, &streams, &scalars, func, dtype, count, root, in_place, in_place,
                            ));
                            runs += 1;
                            if count > 0 {
                                let choice = comms[0].last_choice().expect("a plan");
                                assert_eq!(
                                    choice.proto.name(),
                                    proto,
                                    "{test}: NCCL_PROTO={proto} was not taken"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    drop(dog);
    eprintln!("{test}: {runs} calls on {n} ranks, {} failures", errs.len());
    assert!(
        errs.is_empty(),
        "{test}: {} failures:\n{}",
        errs.len(),
        errs[..errs.len().min(30)].join("\n")
    );
}

#[test]
fn matrix_cpu_3_ranks() {
    let funcs = [Func::AllReduce, Func::Reduce, Func::ReduceScatter];
    matrix("matrix_cpu_3_ranks", &Device::cpus(3), &funcs, false, COUNTS);
}

#[test]
fn matrix_cpu_tree_2_nodes() {
    matrix(
        "matrix_cpu_tree_2_nodes",
        &Device::cpus(4),
        &[Func::AllReduce],
        true,
        COUNTS,
    );
}

#[test]
fn matrix_gpu_2_ranks() {
    let Some(devices) = common::two_ranks_or_skip("matrix_gpu_2_ranks") else {
        return;
    };
    let _gpu = common::gpu_lock();
    let funcs = [Func::AllReduce, Func::Reduce, Func::ReduceScatter];
    matrix(
        "matrix_gpu_2_ranks",
        &devices,
        &funcs,
        false,
        &[0, 1, 7, 1001, 65539, (1 << 20) + 3],
    );
}

#[test]
fn matrix_gpu_tree_2_nodes() {
    let Some(devices) = common::gpus_or_skip("matrix_gpu_tree_2_nodes", 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    matrix(
        "matrix_gpu_tree_2_nodes",
        &devices,
        &[Func::AllReduce],
        true,
        COUNTS,
    );
}

/// Case C07 on `devices` (2 ranks).
fn c07(devices: &[Device]) {
    let streams: Vec<Stream> = devices.iter().map(|d| d.new_stream().expect("stream")).collect();
    let comms = common::init_all(devices).expect("init_all");
    let scalars: Vec<DeviceBuffer> = devices.iter().map(|d| d.alloc(16).expect("scalar")).collect();
    let count = 8;
    for dtype in [DataType::Bf16, DataType::F16, DataType::F32, DataType::F64] {
        let es = dtype.size();
        for (scalar, device, want) in [
            (0.5, false, 1.5),
            (2.0, false, 6.0),
            (4.0, false, 12.0),
            (5.0, true, 15.0),
        ] {
            for func in [Func::AllReduce, Func::Reduce, Func::ReduceScatter] {
                let roots = if func == Func::Reduce { vec![0, 1] } else { vec![0] };
                for root in roots {
                    let what = format!("C07 {func} {dtype} scalar {scalar} (device: {device}) root {root}");
                    let per_send = if func == Func::ReduceScatter {
                        2 * count
                    } else {
                        count
                    };
                    // Every buffer is written before any rank calls (a synchronous write would
                    // wait for the kernel of a rank that shares the GPU and already called).
                    let mut bufs = Vec::new();
                    let mut ops = Vec::new();
                    for (r, c) in comms.iter().enumerate() {
                        let s = Scalar::from_f64(scalar, dtype);
                        ops.push(if device {
                            let bits = s.to_bits().to_le_bytes();
                            scalars[r].write(0, &bits[..es]).expect("device scalar");
                            ReduceOp::PreMulSumDevice(scalars[r].as_slice())
                        } else {
                            ReduceOp::PreMulSum(s)
                        });
                        let send = c.device().alloc(per_send * es).expect("send");
                        send.write(0, &encode(dtype, (r + 1) as f64, 0).repeat(per_send))
                            .expect("fill");
                        let recv = c.device().alloc(count * es).expect("recv");
                        recv.fill(POISON).expect("poison");
                        bufs.push((send, recv));
                    }
                    for (r, c) in comms.iter().enumerate() {
                        let (send, recv) = &bufs[r];
                        let op = ops[r];
                        let st = &streams[r];
                        match func {
                            Func::AllReduce => c.all_reduce(send, recv, count, dtype, op, st),
                            Func::Reduce => c.reduce(send, Some(recv.as_slice()), count, dtype, op, root, st),
                            _ => c.reduce_scatter(send, recv, count, dtype, op, st),
                        }
                        .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
                    }
                    sync_all(&streams, &what);
                    let want = encode(dtype, want, 0).repeat(count);
                    for (r, (_, recv)) in bufs.iter().enumerate() {
                        let got = recv.to_vec().expect("read");
                        if func == Func::Reduce && r != root {
                            assert_eq!(
                                got,
                                vec![POISON; count * es],
                                "{what}: non-root rank {r} was written"
                            );
                        } else {
                            assert_eq!(got, want, "{what}: rank {r}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn c07_premulsum_scalar_width_cpu() {
    c07(&Device::cpus(2));
}

#[test]
fn c07_premulsum_scalar_width_gpu() {
    let Some(devices) = common::two_ranks_or_skip("c07_premulsum_scalar_width_gpu") else {
        return;
    };
    let _gpu = common::gpu_lock();
    c07(&devices);
}

/// One rank: the output is the input times the scalar, in place and out of place.
fn one_rank(dev: Device) {
    let comms = common::init_all(&[dev]).expect("init_all of one rank");
    let c = &comms[0];
    let st = dev.new_stream().expect("stream");
    let scalar = dev.alloc(16).expect("scalar");
    for dtype in common::dtypes() {
        let es = dtype.size();
        for count in [1usize, 7, 1001, 65539] {
            for (in_place, device) in [(false, false), (true, true)] {
                let what = format!("one rank {dtype} count {count} in_place {in_place}");
                let own = input(dtype, 0, count);
                let send = dev.alloc((count + GUARD) * es).expect("send");
                send.fill(POISON).expect("poison");
                send.write(0, &own).expect("fill");
                let recv = dev.alloc((count + GUARD) * es).expect("recv");
                recv.fill(POISON).expect("poison");
                let op = op_for(dtype, 0, device.then_some(&scalar));
                let out = if in_place { &send } else { &recv };
                c.all_reduce(&send, out, count, dtype, op, &st)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                st.synchronize().expect("sync");
                let mut want = expected(dtype, 1, count);
                want.extend(vec![POISON; GUARD * es]);
                assert_eq!(out.to_vec().expect("read"), want, "{what}");
                if !in_place {
                    assert_eq!(
                        &send.to_vec().expect("read")[..count * es],
                        &own[..],
                        "{what}: input changed"
                    );
                }
            }
        }
    }
}

#[test]
fn one_rank_cpu() {
    one_rank(Device::cpus(1)[0]);
}

#[test]
fn one_rank_gpu() {
    let Some(devices) = common::gpus_or_skip("one_rank_gpu", 1) else {
        return;
    };
    let _gpu = common::gpu_lock();
    one_rank(devices[0]);
}

/// Bad scalars fail on every rank before anything is queued, naming the scalar.
fn bad_scalars(devices: &[Device]) {
    let comms = common::init_all(devices).expect("init_all");
    let streams: Vec<Stream> = devices.iter().map(|d| d.new_stream().expect("stream")).collect();
    let count = 64;
    for (r, c) in comms.iter().enumerate() {
        let dev = c.device();
        let send = dev.alloc(count * 4).expect("send");
        let recv = dev.alloc(count * 4).expect("recv");
        let scalar = dev.alloc(16).expect("scalar");
        let cases: Vec<(&str, ReduceOp<'_>, &str)> = vec![
            (
                "bf16 scalar on float",
                ReduceOp::pre_mul_sum(bf16::from_f32(0.5)),
                "bfloat16",
            ),
            ("f64 scalar on float", ReduceOp::pre_mul_sum(0.5f64), "double"),
            (
                "2-byte device scalar",
                ReduceOp::PreMulSumDevice(scalar.slice(0, 2).expect("slice")),
                "one float",
            ),
            (
                "misaligned device scalar",
                ReduceOp::PreMulSumDevice(scalar.slice(2, 8).expect("slice")),
                "aligned",
            ),
        ];
        for (name, op, needle) in cases {
            for func in [Func::AllReduce, Func::Reduce, Func::ReduceScatter] {
                let res = match func {
                    Func::AllReduce => c.all_reduce(&send, &recv, count / 2, DataType::F32, op, &streams[r]),
                    Func::Reduce => c.reduce(
                        &send,
                        Some(recv.as_slice()),
                        count / 2,
                        DataType::F32,
                        op,
                        0,
                        &streams[r],
                    ),
                    _ => c.reduce_scatter(&send, &recv, count / 4, DataType::F32, op, &streams[r]),
                };
                let e = res.expect_err(&format!("{name} on {func} must fail on rank {r}"));
                assert_eq!(e.code(), ResultCode::InvalidArgument, "{name} {func}: {e}");
                let msg = e.to_string();
                assert!(
                    msg.contains("PreMulSum scalar") && msg.contains(needle),
                    "{name} {func}: {msg}"
                );
            }
        }
    }
    // Nothing was queued: the communicators still work.
    let bufs: Vec<DeviceBuffer> = devices.iter().map(|d| d.alloc(4 * 4).expect("buf")).collect();
    for b in &bufs {
        b.write(0, &1.0f32.to_le_bytes().repeat(4)).expect("fill");
    }
    for (r, c) in comms.iter().enumerate() {
        c.all_reduce(
            &bufs[r],
            &bufs[r],
            4,
            DataType::F32,
            ReduceOp::pre_mul_sum(0.5f32),
            &streams[r],
        )
        .expect("a good PreMulSum after the bad ones");
    }
    sync_all(&streams, "good call");
    for b in &bufs {
        let want = (0.5f32 * comms.len() as f32).to_le_bytes().repeat(4);
        assert_eq!(b.to_vec().expect("read"), want);
    }
}

#[test]
fn bad_scalars_cpu() {
    bad_scalars(&Device::cpus(2));
}

#[test]
fn bad_scalars_gpu() {
    let Some(devices) = common::two_ranks_or_skip("bad_scalars_gpu") else {
        return;
    };
    let _gpu = common::gpu_lock();
    bad_scalars(&devices);
}

#[test]
fn scalar_on_another_device_is_refused() {
    let devices = Device::cpus(2);
    let comms = common::init_all(&devices).expect("init_all");
    let other = Device::cpus(3)[2].alloc(16).expect("scalar elsewhere");
    let buf = devices[0].alloc(64).expect("buf");
    let st = devices[0].new_stream().expect("stream");
    let e = comms[0]
        .all_reduce(
            &buf,
            &buf,
            4,
            DataType::F32,
            ReduceOp::PreMulSumDevice(other.as_slice()),
            &st,
        )
        .expect_err("a scalar on another device");
    assert_eq!(e.code(), ResultCode::InvalidArgument);
    assert!(e.to_string().contains("PreMulSum scalar is on"), "{e}");
}
