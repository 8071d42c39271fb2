//! Breaker tests of session 5's changes, CPU target only:
//! 1. freeing a CPU-target `DeviceBuffer` waits for the device's queued stream operations
//!    (`cpu::wait_device_idle`, `impl Drop for DeviceBuffer`);
//! 2. the NET proxy completes an LL/LL128 step once the lines the kernel announced in its tagged
//!    step-sizes entry have gone (odd counts, protocols mixed back to back on one communicator,
//!    the LL flag / step tag wrap through `OXCCL_TEST_INITIAL_STEP`);
//! 3. `oxccl perf --procs N` with a control bootstrap (ranks 1, 3, simulated hosts, bad flag
//!    combinations without GPUs, a rank killed mid-sweep);
//! 4. the tuning fabrics (`Fabric::of_gpu_rings`, `Model::for_fabric`, `Model::nchannels`).
//!
//! In-process tests use CPU device labels of their own (40 and up): freeing memory waits for every
//! operation queued on the device label, so tests sharing a label would delay each other.
mod common;

use common::child::{LineChild, clean_child, env_var, hex, log_to_stdout, unhex};
use oxccl::bootstrap::{UniqueId, get_unique_id};
use oxccl::transport::TransportKind;
use oxccl::tuning::{Fabric, Model, Selection};
use oxccl::{Comm, DataType, Device, DeviceBuffer, Func, Proto, RedOp, Stream};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Shared data patterns.

/// Rank `r`'s element `i` of an AllReduce input with `salt`: distinct per rank, element and call.
fn elem(r: usize, i: usize, salt: u32) -> u32 {
    ((r as u32 + 1).wrapping_mul(1_000_003))
        ^ (i as u32).wrapping_mul(2_654_435_761)
        ^ salt.wrapping_mul(40_503)
}

/// The u32 wrapping sum over `n` ranks of [`elem`] (what an AllReduce Sum of u32 gives: integer
/// addition modulo 2^32 is associative, so the ring order does not matter).
fn sum_elem(n: usize, i: usize, salt: u32) -> u32 {
    (0..n).fold(0u32, |a, r| a.wrapping_add(elem(r, i, salt)))
}

fn u32_bytes(v: impl IntoIterator<Item = u32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn input(r: usize, count: usize, salt: u32) -> Vec<u8> {
    u32_bytes((0..count).map(|i| elem(r, i, salt)))
}

fn all_reduce_want(n: usize, count: usize, salt: u32) -> Vec<u8> {
    u32_bytes((0..count).map(|i| sum_elem(n, i, salt)))
}

// ---------------------------------------------------------------------------------------------
// Attack 4: tuning fabrics, property tests.

const FABRICS: [Fabric; 4] = [Fabric::NvLink, Fabric::Host, Fabric::Shm, Fabric::Net];
const PROTOS: [Proto; 3] = [Proto::Ll, Proto::Ll128, Proto::Simple];
const FUNCS: [Func; 5] = [
    Func::AllReduce,
    Func::AllGather,
    Func::ReduceScatter,
    Func::Broadcast,
    Func::Reduce,
];

/// The `NCCL_PROTO` list of the protocols whose bit is set in `mask` (1..=7).
fn proto_list(mask: u8) -> String {
    PROTOS
        .iter()
        .enumerate()
        .filter(|(k, _)| mask & (1 << k) != 0)
        .map(|(_, p)| p.name())
        .collect::<Vec<_>>()
        .join(",")
}

fn selection(proto: &str) -> Selection {
    Selection::from_lookup(|k| (k == "PROTO").then(|| ("NCCL_PROTO".to_string(), proto.to_string())))
        .unwrap_or_else(|e| panic!("NCCL_PROTO={proto}: {e}"))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]

    /// For every fabric, protocol list, size, `NCCL_MIN_NCHANNELS` (`min`, 1..=64 as params
    /// accept) and communicator channel count (`max`): the call's channels lie in
    /// `[min(min, max), max]`; `min` is honoured whenever it fits under `max`, also above the
    /// fabric's `max_channels` (NET's 16); the choice never fails while a protocol is allowed,
    /// picks an allowed one, on exactly `Model::nchannels` channels, and no other allowed protocol
    /// is predicted faster (the argmin of `predict_us`).
    #[test]
    fn b5_tuning_choice_stays_in_its_channel_bounds(
        fab in 0usize..4,
        mask in 1u8..8,
        bytes in 1u64..(1u64 << 34),
        min in 1u32..=64,
        max in 1u32..=64,
        func in 0usize..5,
        nranks in 2usize..=72,
    ) {
        let fabric = FABRICS[fab];
        let func = FUNCS[func];
        let m = Model::for_fabric(fabric);
        let list = proto_list(mask);
        let sel = selection(&list);
        let (algo, proto, nch) = sel
            .choose_sized(&m, func, bytes, nranks, min, max)
            .unwrap_or_else(|e| panic!("{fabric:?} NCCL_PROTO={list} {bytes} B: {e}"));
        let ctx = format!("{fabric:?} {func} NCCL_PROTO={list} {bytes} B min {min} max {max} nranks {nranks}");
        proptest::prop_assert_eq!(algo, oxccl::Algo::Ring, "{}", ctx);
        proptest::prop_assert!(sel.protos.0[proto as usize], "{}: {:?} not allowed", ctx, proto);
        proptest::prop_assert!(nch >= min.min(max) && nch <= max, "{}: {} channels", ctx, nch);
        if min <= max {
            proptest::prop_assert!(nch >= min, "{}: {} channels below NCCL_MIN_NCHANNELS", ctx, nch);
        }
        proptest::prop_assert_eq!(nch, m.nchannels(proto, bytes, min, max), "{}", ctx);
        // Without a minimum above it, the fabric's cap holds.
        if min <= m.max_channels {
            proptest::prop_assert!(nch <= m.max_channels, "{}: {} over the fabric's {}", ctx, nch, m.max_channels);
        }
        let t = m.predict_us(func, proto, nranks, nch, bytes);
        proptest::prop_assert!(t.is_finite() && t > 0.0, "{}: {}", ctx, t);
        for p in PROTOS {
            if !sel.protos.0[p as usize] {
                continue;
            }
            let c = m.nchannels(p, bytes, min, max);
            let tp = m.predict_us(func, p, nranks, c, bytes);
            proptest::prop_assert!(tp.is_finite(), "{}: {:?} {}", ctx, p, tp);
            proptest::prop_assert!(t <= tp, "{}: chose {:?} ({} µs) over {:?} ({} µs)", ctx, proto, t, p, tp);
        }
    }

    /// Predictions are finite, positive and non-decreasing in bytes for a fixed protocol and
    /// channel count, on every fabric, collective and rank count (1..=72).
    #[test]
    fn b5_predictions_are_finite_and_monotonic_in_bytes(
        fab in 0usize..4,
        p in 0usize..3,
        nch in 1u32..=64,
        a in 0u64..(1u64 << 34),
        b in 0u64..(1u64 << 34),
        func in 0usize..5,
        nranks in 1usize..=72,
        depth in 1u32..=16,
    ) {
        let m = Model::for_fabric(FABRICS[fab]);
        let (lo, hi) = (a.min(b), a.max(b));
        let proto = PROTOS[p];
        let (tl, th) = (
            m.predict_us(FUNCS[func], proto, nranks, nch, lo),
            m.predict_us(FUNCS[func], proto, nranks, nch, hi),
        );
        proptest::prop_assert!(tl.is_finite() && th.is_finite() && tl > 0.0, "{} {}", tl, th);
        proptest::prop_assert!(tl <= th, "{:?} {:?} nch {}: {} B {} µs > {} B {} µs", FABRICS[fab], proto, nch, lo, tl, hi, th);
        let tree = oxccl::tuning::TreeShape { nnodes: 2, depth };
        let (ul, uh) = (m.predict_tree_us(proto, tree, nch, lo), m.predict_tree_us(proto, tree, nch, hi));
        proptest::prop_assert!(ul.is_finite() && uh.is_finite() && ul <= uh, "tree {} {}", ul, uh);
    }

    /// `Fabric::of_gpu_rings` is the slowest transport of the rings whatever their order:
    /// NET if any pair is NET, else SHM if any is SHM, else NvLink (also for no pairs).
    #[test]
    fn b5_fabric_is_the_slowest_ring_transport_in_any_order(kinds in proptest::collection::vec(0u8..3, 0..40)) {
        let ks: Vec<TransportKind> = kinds
            .iter()
            .map(|k| [TransportKind::P2p, TransportKind::Shm, TransportKind::Net][*k as usize])
            .collect();
        let want = if kinds.contains(&2) {
            Fabric::Net
        } else if kinds.contains(&1) {
            Fabric::Shm
        } else {
            Fabric::NvLink
        };
        proptest::prop_assert_eq!(Fabric::of_gpu_rings(ks.iter().copied()), want);
        proptest::prop_assert_eq!(Fabric::of_gpu_rings(ks.iter().rev().copied()), want);
    }
}

/// Edges the random search may miss: the smallest and largest sizes, min above the fabric cap
/// and above the communicator's count, on NET (cap 16) and the others (cap 64).
#[test]
fn b5_tuning_channel_edges() {
    let net = Model::for_fabric(Fabric::Net);
    // NET's cap is 16 channels; a 2^34-byte Simple call would want 2^34 / 4 MiB = 4096.
    assert_eq!(net.max_channels, 16);
    assert_eq!(net.nchannels(Proto::Simple, 1 << 34, 1, 64), 16);
    // NCCL_MIN_NCHANNELS=32 wins over the cap of 16 but not over the communicator's 24.
    assert_eq!(net.nchannels(Proto::Simple, 1, 32, 64), 32);
    assert_eq!(net.nchannels(Proto::Simple, 1, 32, 24), 24);
    // One byte: one channel per min_channel_bytes, rounded up: 1.
    for f in FABRICS {
        let m = Model::for_fabric(f);
        for p in PROTOS {
            assert_eq!(m.nchannels(p, 1, 1, 64), 1, "{f:?} {p:?}");
            assert_eq!(m.nchannels(p, 1, 1, 1), 1, "{f:?} {p:?}");
            assert_eq!(
                m.nchannels(p, u64::MAX, 1, 64),
                m.max_channels.min(64),
                "{f:?} {p:?}"
            );
            assert_eq!(m.nchannels(p, u64::MAX, 64, 64), 64, "{f:?} {p:?}");
        }
    }
    // Every single-protocol list is honoured on every fabric at both ends of the size range.
    for f in FABRICS {
        let m = Model::for_fabric(f);
        for p in PROTOS {
            let sel = selection(p.name());
            for bytes in [1u64, 1 << 34] {
                let (_, got, _) = sel.choose_sized(&m, Func::AllReduce, bytes, 2, 1, 64).unwrap();
                assert_eq!(got, p, "{f:?} NCCL_PROTO={} {bytes} B", p.name());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attack 1: freeing CPU-target buffers waits for the device's queued operations.

fn streams(devs: &[Device]) -> Vec<Stream> {
    devs.iter().map(|d| d.new_stream().unwrap()).collect()
}

/// Two communicators over the same two CPU devices (labels 40, 41), one stream each per rank:
/// rank 0 queues an AllReduce (comm A) and an AllGather (comm B), then another thread drops
/// rank 0's two inputs while rank 1 has queued nothing yet; rank 1 queues 300 ms later and a
/// thread drops its inputs right away too. Each dropping thread reads its rank's outputs as soon
/// as its drops return: the drops waited for the collectives (≥ 250 ms on rank 0), so the
/// outputs are already complete and exact (AllReduce: u32 wrapping sums of `elem`; AllGather:
/// the ranks' inputs concatenated).
#[test]
fn b5_dropped_inputs_wait_for_collectives_on_two_streams() {
    let devs = [Device::Cpu(40), Device::Cpu(41)];
    let (a, b) = (Comm::init_all(&devs).unwrap(), Comm::init_all(&devs).unwrap());
    let (sa, sb) = (streams(&devs), streams(&devs));
    let n = 2;
    for &count in &[7usize, 65_539, 1_048_583] {
        let salt = count as u32;
        let mut sends_a: Vec<Option<DeviceBuffer>> = Vec::new();
        let mut sends_b: Vec<Option<DeviceBuffer>> = Vec::new();
        let mut recvs_a = Vec::new();
        let mut recvs_b = Vec::new();
        for (r, d) in devs.iter().enumerate() {
            let s = d.alloc(count * 4).unwrap();
            s.write(0, &input(r, count, salt)).unwrap();
            sends_a.push(Some(s));
            let s = d.alloc(count * 4).unwrap();
            s.write(0, &input(r, count, salt ^ 0xabc)).unwrap();
            sends_b.push(Some(s));
            recvs_a.push(Arc::new(d.alloc(count * 4).unwrap()));
            recvs_b.push(Arc::new(d.alloc(count * 4 * n).unwrap()));
        }
        let want_a = all_reduce_want(n, count, salt);
        let want_b: Vec<u8> = (0..n).flat_map(|r| input(r, count, salt ^ 0xabc)).collect();
        let mut droppers = Vec::new();
        for r in 0..n {
            if r == 1 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let (send_a, send_b) = (sends_a[r].take().unwrap(), sends_b[r].take().unwrap());
            a[r].all_reduce(&send_a, &*recvs_a[r], count, DataType::U32, RedOp::Sum, &sa[r])
                .unwrap();
            b[r].all_gather(&send_b, &*recvs_b[r], count, DataType::U32, &sb[r])
                .unwrap();
            let (ra, rb) = (recvs_a[r].clone(), recvs_b[r].clone());
            let (wa, wb) = (want_a.clone(), want_b.clone());
            droppers.push(std::thread::spawn(move || {
                let t = Instant::now();
                drop(send_a);
                drop(send_b);
                let took = t.elapsed();
                (took, ra.to_vec().unwrap() == wa, rb.to_vec().unwrap() == wb)
            }));
        }
        for s in sa.iter().chain(&sb) {
            s.synchronize().unwrap();
        }
        for (r, h) in droppers.into_iter().enumerate() {
            let (took, ok_a, ok_b) = h.join().unwrap();
            assert!(
                ok_a && ok_b,
                "count {count} rank {r}: outputs read right after the drops differ (AllReduce ok {ok_a}, AllGather ok {ok_b}; drops took {took:?})"
            );
            if r == 0 {
                assert!(
                    took >= Duration::from_millis(250),
                    "count {count}: rank 0's drops returned after {took:?}, before rank 1 had queued its half"
                );
            }
        }
        for r in 0..n {
            assert_eq!(recvs_a[r].to_vec().unwrap(), want_a, "count {count} rank {r}");
            assert_eq!(recvs_b[r].to_vec().unwrap(), want_b, "count {count} rank {r}");
        }
    }
}

/// Rank 0 (device 42) queues an AllReduce whose peer (device 43) has queued nothing: freeing
/// memory on the peer's idle device and on an unrelated device (44) is not delayed (< 1 s, not
/// the 30 s HOST_FREE_WAIT), `wait_device_idle` says device 42 is busy; once rank 1 queues its
/// half, both complete exactly and device 42 goes idle.
#[test]
fn b5_a_stuck_device_delays_no_other_device() {
    let devs = [Device::Cpu(42), Device::Cpu(43)];
    let comms = Comm::init_all(&devs).unwrap();
    let ss = streams(&devs);
    let count = 4099;
    let bufs: Vec<DeviceBuffer> = devs
        .iter()
        .enumerate()
        .map(|(r, d)| {
            let b = d.alloc(count * 4).unwrap();
            b.write(0, &input(r, count, 9)).unwrap();
            b
        })
        .collect();
    comms[0]
        .all_reduce(&bufs[0], &bufs[0], count, DataType::U32, RedOp::Sum, &ss[0])
        .unwrap();
    for d in [Device::Cpu(43), Device::Cpu(44)] {
        let buf = d.alloc(1 << 20).unwrap();
        let t = Instant::now();
        drop(buf);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "freeing on {d:?} took {:?} while device 42 was stuck",
            t.elapsed()
        );
    }
    assert!(
        !oxccl::cpu::wait_device_idle(42, Duration::from_millis(200)),
        "device 42 idle with its AllReduce waiting for rank 1"
    );
    assert!(oxccl::cpu::wait_device_idle(43, Duration::ZERO));
    comms[1]
        .all_reduce(&bufs[1], &bufs[1], count, DataType::U32, RedOp::Sum, &ss[1])
        .unwrap();
    for s in &ss {
        s.synchronize().unwrap();
    }
    assert!(oxccl::cpu::wait_device_idle(42, Duration::from_secs(5)));
    for b in &bufs {
        assert_eq!(b.to_vec().unwrap(), all_reduce_want(2, count, 9));
    }
}

/// Each rank on its own thread (devices 45, 46): a temporary buffer gets an in-place AllReduce,
/// then an out-of-place AllReduce from it into a kept buffer, and is dropped right after queueing
/// (no synchronize). 30 rounds of odd counts; each kept buffer holds n × the sum of the inputs
/// (the second AllReduce sums n copies of the first's result).
#[test]
fn b5_in_place_temporaries_dropped_before_synchronize() {
    let devs = [Device::Cpu(45), Device::Cpu(46)];
    let comms = Comm::init_all(&devs).unwrap();
    let n = devs.len();
    let counts = [1usize, 3, 7, 1023, 4097, 65_537];
    let rounds = 30;
    let kept: Vec<Vec<DeviceBuffer>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                sc.spawn(move || {
                    let d = c.device();
                    let s = d.new_stream().unwrap();
                    let mut kept = Vec::new();
                    for k in 0..rounds {
                        let count = counts[k % counts.len()];
                        let tmp = d.alloc(count * 4).unwrap();
                        tmp.write(0, &input(r, count, k as u32)).unwrap();
                        let out = d.alloc(count * 4).unwrap();
                        c.all_reduce(&tmp, &tmp, count, DataType::U32, RedOp::Sum, &s)
                            .unwrap();
                        c.all_reduce(&tmp, &out, count, DataType::U32, RedOp::Sum, &s)
                            .unwrap();
                        drop(tmp);
                        kept.push(out);
                    }
                    s.synchronize().unwrap();
                    kept
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, ks) in kept.iter().enumerate() {
        for (k, b) in ks.iter().enumerate() {
            let count = counts[k % counts.len()];
            let want = u32_bytes((0..count).map(|i| sum_elem(n, i, k as u32).wrapping_mul(n as u32)));
            assert_eq!(b.to_vec().unwrap(), want, "rank {r} round {k} count {count}");
        }
    }
}

/// Rank 0 (device 47) queues three AllReduces that its peer (device 48) never joins; another
/// thread aborts rank 0 after 200 ms. Dropping rank 0's buffer waits for the aborted operations
/// to leave, not for HOST_FREE_WAIT: it returns within 6 s (abort waits at most 5 s), after which
/// device 47 is idle; rank 1 sees the remote abort.
#[test]
fn b5_abort_with_queued_work_releases_the_free() {
    let devs = [Device::Cpu(47), Device::Cpu(48)];
    let comms = Comm::init_all(&devs).unwrap();
    let s0 = devs[0].new_stream().unwrap();
    let buf = devs[0].alloc(1 << 16).unwrap();
    for _ in 0..3 {
        comms[0]
            .all_reduce(&buf, &buf, 1 << 14, DataType::U32, RedOp::Sum, &s0)
            .unwrap();
    }
    let t = Instant::now();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            comms[0].abort().unwrap();
        });
        drop(buf);
    });
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_secs(6),
        "drop took {took:?}"
    );
    assert!(oxccl::cpu::wait_device_idle(47, Duration::ZERO));
    let _ = s0.synchronize();
    let e = comms[1].get_async_error().unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
}

/// Rank 0 (device 49) queues an AllReduce and destroys its communicator at once; rank 1 (device
/// 50) queues its half 300 ms later from another thread. Destroy waits for the operation (≥ 250
/// ms) and succeeds; the buffers, dropped after destroy without synchronize, held the exact sum.
#[test]
fn b5_destroy_with_queued_work_then_drop() {
    let devs = [Device::Cpu(49), Device::Cpu(50)];
    let mut comms = Comm::init_all(&devs).unwrap();
    let ss = streams(&devs);
    let count = 12_289;
    let bufs: Vec<Arc<DeviceBuffer>> = devs
        .iter()
        .enumerate()
        .map(|(r, d)| {
            let b = d.alloc(count * 4).unwrap();
            b.write(0, &input(r, count, 77)).unwrap();
            Arc::new(b)
        })
        .collect();
    let c1 = comms.pop().unwrap();
    let c0 = comms.pop().unwrap();
    c0.all_reduce(&*bufs[0], &*bufs[0], count, DataType::U32, RedOp::Sum, &ss[0])
        .unwrap();
    let t = Instant::now();
    std::thread::scope(|sc| {
        let (b1, s1) = (bufs[1].clone(), &ss[1]);
        sc.spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            c1.all_reduce(&*b1, &*b1, count, DataType::U32, RedOp::Sum, s1)
                .unwrap();
            c1.destroy().unwrap();
        });
        c0.destroy().unwrap();
    });
    assert!(t.elapsed() >= Duration::from_millis(250), "{:?}", t.elapsed());
    let want = all_reduce_want(2, count, 77);
    for (r, b) in bufs.into_iter().enumerate() {
        let b = Arc::into_inner(b).unwrap();
        assert_eq!(b.to_vec().unwrap(), want, "rank {r}");
        drop(b);
    }
}

/// Two ranks (devices 51, 52) each pipeline AllReduces of 256 KiB on their stream for 3 s (rank
/// 0 then fixes the last call for both, fewer than its own calls plus `DEPTH` + 2 so neither rank
/// has gone past it): a rank queues call k + 4 before waiting for call k (a marker job after each
/// call says when it ran), so its device never runs dry. 300 ms in, the main thread frees a
/// buffer on device 51 that no call uses. As `cuMemFree` waits for the work queued before it,
/// the free must return once the calls queued before it are done (well under 1 s), not when the
/// pipeline stops seconds later. The last calls' outputs are exact.
#[test]
#[ignore = "BUG: a CPU-target free waits for the device to run dry, so work queued after it (a pipelined loop on another thread) stalls it until the loop stops or HOST_FREE_WAIT (30 s), then leaks"]
fn b5_free_is_not_starved_by_work_queued_after_it() {
    let devs = [Device::Cpu(51), Device::Cpu(52)];
    let comms = Comm::init_all(&devs).unwrap();
    let n = devs.len();
    let count = 1 << 16;
    let run_for = Duration::from_secs(3);
    let stop_at = std::sync::atomic::AtomicU64::new(u64::MAX);
    // Calls queued ahead of the one a rank waits for.
    const DEPTH: u64 = 32;
    let (took, free_at, ends) = std::thread::scope(|sc| {
        let start = Instant::now();
        let stop_at = &stop_at;
        let feeders: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                sc.spawn(move || {
                    let d = c.device();
                    let s = d.new_stream().unwrap();
                    let Stream::Cpu(cs) = &s else { unreachable!() };
                    let src = d.alloc(count * 4).unwrap();
                    src.write(0, &input(r, count, 5)).unwrap();
                    let outs: Vec<DeviceBuffer> = (0..=DEPTH).map(|_| d.alloc(count * 4).unwrap()).collect();
                    let (tx, rx) = std::sync::mpsc::channel::<u64>();
                    let mut k = 0u64;
                    while k < stop_at.load(std::sync::atomic::Ordering::Acquire) {
                        if r == 0 && start.elapsed() > run_for {
                            let _ = stop_at.compare_exchange(
                                u64::MAX,
                                k + DEPTH + 2,
                                std::sync::atomic::Ordering::AcqRel,
                                std::sync::atomic::Ordering::Acquire,
                            );
                        }
                        let out = &outs[(k % (DEPTH + 1)) as usize];
                        c.all_reduce(&src, out, count, DataType::U32, RedOp::Sum, &s)
                            .unwrap();
                        let tx = tx.clone();
                        cs.enqueue(move || {
                            let _ = tx.send(k);
                            Ok(())
                        })
                        .unwrap();
                        if k >= DEPTH {
                            assert_eq!(rx.recv().unwrap(), k - DEPTH);
                        }
                        k += 1;
                    }
                    s.synchronize().unwrap();
                    let end = start.elapsed();
                    let want = all_reduce_want(n, count, 5);
                    let bad: Vec<usize> = (0..outs.len())
                        .filter(|&j| outs[j].to_vec().unwrap() != want)
                        .collect();
                    assert!(
                        bad.is_empty(),
                        "rank {r}: the last calls into outputs {bad:?} differ"
                    );
                    (end, k)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let unused = devs[0].alloc(1 << 20).unwrap();
        let free_at = start.elapsed();
        drop(unused);
        let took = start.elapsed() - free_at;
        let ends: Vec<(Duration, u64)> = feeders.into_iter().map(|h| h.join().unwrap()).collect();
        (took, free_at, ends)
    });
    eprintln!("free at {free_at:?} took {took:?}; pipelines (end, calls) {ends:?}");
    assert!(
        took < Duration::from_secs(1),
        "freeing an unused buffer on device 51 at {free_at:?} took {took:?}; the pipelines (end, calls) were {ends:?}"
    );
}
