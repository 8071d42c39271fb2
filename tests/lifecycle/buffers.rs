//! CPU-target device memory: freeing a `DeviceBuffer` waits for the work queued on its device
//! before the free (`cpu::wait_queued_work`, as `cuMemFree` waits for the GPU), and only that
//! work: dropped inputs and in-place temporaries still give exact results; a device whose work
//! waits for a peer delays no free on another device; abort and destroy release a waiting free;
//! work queued after the free does not starve it; and any device label the API takes works or
//! fails with an error, never aborts the process.
//!
//! The in-process tests use CPU device labels of their own (40 and up): freeing memory waits for
//! every operation queued on the device label, so tests sharing a label would delay each other.
//! They create their communicators holding the environment lock shared.
use crate::common::child;
use crate::common::env;
use crate::common::pattern::{all_reduce_want, input, sum_elem, u32_bytes};
use oxccl::{Comm, DataType, Device, DeviceBuffer, RedOp, Stream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `Comm::init_all` over `devs` under the environment as it is (held shared meanwhile).
fn init_all(devs: &[Device]) -> Vec<Comm> {
    let _env = env::shared();
    Comm::init_all(devs).unwrap()
}

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
fn dropped_inputs_wait_for_collectives_on_two_streams() {
    let devs = [Device::Cpu(40), Device::Cpu(41)];
    let (a, b) = (init_all(&devs), init_all(&devs));
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
fn a_stuck_device_delays_no_free_on_another_device() {
    let devs = [Device::Cpu(42), Device::Cpu(43)];
    let comms = init_all(&devs);
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
        !oxccl::cpu::wait_queued_work(42, Duration::from_millis(200)),
        "device 42 idle with its AllReduce waiting for rank 1"
    );
    assert!(oxccl::cpu::wait_queued_work(43, Duration::ZERO));
    comms[1]
        .all_reduce(&bufs[1], &bufs[1], count, DataType::U32, RedOp::Sum, &ss[1])
        .unwrap();
    for s in &ss {
        s.synchronize().unwrap();
    }
    assert!(oxccl::cpu::wait_queued_work(42, Duration::from_secs(5)));
    for b in &bufs {
        assert_eq!(b.to_vec().unwrap(), all_reduce_want(2, count, 9));
    }
}

/// Each rank on its own thread (devices 45, 46): a temporary buffer gets an in-place AllReduce,
/// then an out-of-place AllReduce from it into a kept buffer, and is dropped right after queueing
/// (no synchronize). 30 rounds of odd counts; each kept buffer holds n × the sum of the inputs
/// (the second AllReduce sums n copies of the first's result).
#[test]
fn in_place_temporaries_dropped_before_synchronize_hold_exact_results() {
    let devs = [Device::Cpu(45), Device::Cpu(46)];
    let comms = init_all(&devs);
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
fn abort_with_queued_work_releases_the_free() {
    let devs = [Device::Cpu(47), Device::Cpu(48)];
    let comms = init_all(&devs);
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
    assert!(oxccl::cpu::wait_queued_work(47, Duration::ZERO));
    let _ = s0.synchronize();
    let e = comms[1].get_async_error().unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
}

/// Rank 0 (device 49) queues an AllReduce and destroys its communicator at once; rank 1 (device
/// 50) queues its half 300 ms later from another thread. Destroy waits for the operation (≥ 250
/// ms) and succeeds; the buffers, dropped after destroy without synchronize, held the exact sum.
#[test]
fn destroy_waits_for_queued_work_then_buffers_drop_exact() {
    let devs = [Device::Cpu(49), Device::Cpu(50)];
    let mut comms = init_all(&devs);
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
fn free_is_not_starved_by_work_queued_after_it() {
    let devs = [Device::Cpu(51), Device::Cpu(52)];
    let comms = init_all(&devs);
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

/// The child process of `large_cpu_device_labels_do_not_abort`: with `OXCCL_CHILD_LABEL=N`, runs
/// one operation on a stream of `Device::Cpu(N)`, allocates and frees a buffer there, and prints
/// `LABEL-OK` or `LABEL-ERR <error>`.
#[test]
#[ignore = "child process of large_cpu_device_labels_do_not_abort"]
fn child_label() {
    child::enter();
    let d = Device::Cpu(child::env_parse("OXCCL_CHILD_LABEL"));
    let r = (|| -> oxccl::Result<()> {
        let s = d.new_stream()?;
        let b = d.alloc(64)?;
        s.synchronize()?;
        drop(b);
        Ok(())
    })();
    match r {
        Ok(()) => println!("LABEL-OK"),
        Err(e) => println!("LABEL-ERR {e}"),
    }
}

/// A CPU-target device is a label (`Device::Cpu(usize)`), any value of which the API takes: a
/// stream operation on a large label must work or fail with an error, not abort the process.
/// Seen: `in_flight_add` grows its per-label vector to `label + 1` entries, so label 2^40
/// asks for 8 TiB ("memory allocation of 8796093022216 bytes failed", SIGABRT) and
/// `usize::MAX` overflows `device + 1` (a panic inside the stream's bookkeeping).
#[test]
fn large_cpu_device_labels_do_not_abort() {
    for label in [1usize << 20, 1 << 40, usize::MAX] {
        let mut cmd = child::command_with(
            &child_entry!(child_label),
            [("OXCCL_CHILD_LABEL", label.to_string())],
        );
        let (ok, out) = child::run(&mut cmd, Duration::from_secs(30));
        assert!(
            ok && (out.contains("LABEL-OK") || out.contains("LABEL-ERR")),
            "Device::Cpu({label}):\n{out}"
        );
    }
}
