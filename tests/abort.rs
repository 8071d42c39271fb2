//! Case C28 on the CPU target: while every rank loops AllReduce (f32, 1 M elements), another thread
//! aborts every communicator after a pseudo-random 0–50 ms. Each `abort` returns within 5 s, the
//! in-flight operations exit so the rank threads drain, and later calls fail with `InvalidUsage`.
//! Run for both protocols and 2 and 4 ranks.
mod common;

use common::env::Env;
use oxccl::{Comm, DataType, Device, Error, RedOp};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const REPS: u64 = 10;

#[test]
fn abort_while_all_reduce_loops_c28() {
    let env = Env::clean(&["PROTO"]);
    // A hang is the failure this test exists for: fail loudly instead of blocking CI.
    let finished = std::sync::Arc::new(AtomicBool::new(false));
    let f = finished.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(240));
        if !f.load(Ordering::Acquire) {
            eprintln!("TIMEOUT: abort_while_all_reduce_loops_c28 did not finish in 240 s");
            std::process::exit(101);
        }
    });
    let count = 1 << 20;
    for proto in ["Simple", "LL"] {
        env.set(&[("NCCL_PROTO", proto)]);
        for nranks in [2usize, 4] {
            for rep in 0..REPS {
                let comms = Comm::init_all(&Device::cpus(nranks)).unwrap();
                let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
                let bufs: Vec<_> = comms
                    .iter()
                    .map(|c| c.device().alloc(count * 4).unwrap())
                    .collect();
                let delay_ms = (rep * 2_654_435_761 + nranks as u64 * 40_503) % 51;
                std::thread::scope(|s| {
                    for r in 0..nranks {
                        let (c, st, b) = (&comms[r], &streams[r], &bufs[r]);
                        s.spawn(move || {
                            for _ in 0..100_000 {
                                if let Err(e) = c.all_reduce(b, b, count, DataType::F32, RedOp::Sum, st) {
                                    // Aborted here, or told that another rank aborted first.
                                    assert!(
                                        matches!(e, Error::InvalidUsage(_) | Error::Remote(_)),
                                        "rank {r}: {e}"
                                    );
                                    break;
                                }
                                let _ = st.synchronize();
                            }
                        });
                    }
                    s.spawn(|| {
                        std::thread::sleep(Duration::from_millis(delay_ms));
                        for c in &comms {
                            let t = Instant::now();
                            c.abort()
                                .unwrap_or_else(|e| panic!("{proto} nranks {nranks} rep {rep}: {e}"));
                            assert!(
                                t.elapsed() < Duration::from_secs(5),
                                "abort took {:?}",
                                t.elapsed()
                            );
                            assert!(c.is_aborted());
                        }
                    });
                });
                // Everything drained: a later call is refused, and streams synchronize.
                for (r, c) in comms.iter().enumerate() {
                    streams[r].synchronize().unwrap();
                    let e = c
                        .all_reduce(&bufs[r], &bufs[r], 4, DataType::F32, RedOp::Sum, &streams[r])
                        .unwrap_err();
                    assert!(e.to_string().contains("aborted"), "{e}");
                }
            }
        }
    }
    finished.store(true, Ordering::Release);
}

#[test]
fn destroy_waits_for_queued_work_and_returns_ok() {
    let comms = Comm::init_all(&Device::cpus(2)).unwrap();
    let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    let bufs: Vec<_> = comms.iter().map(|c| c.device().alloc(4 << 20).unwrap()).collect();
    for (r, c) in comms.iter().enumerate() {
        bufs[r]
            .write(0, &((r + 1) as f32).to_ne_bytes().repeat(1 << 20))
            .unwrap();
        c.all_reduce(
            &bufs[r],
            &bufs[r],
            1 << 20,
            DataType::F32,
            RedOp::Sum,
            &streams[r],
        )
        .unwrap();
    }
    // No synchronize: destroy itself waits for the queued AllReduce of each rank.
    for c in comms {
        c.destroy().unwrap();
    }
    for (s, b) in streams.iter().zip(&bufs) {
        s.synchronize().unwrap();
        assert!(
            b.to_vec()
                .unwrap()
                .chunks(4)
                .all(|x| f32::from_ne_bytes(x.try_into().unwrap()) == 3.0)
        );
    }
}

/// C28, variant: only rank 0 aborts. The other ranks' in-flight operations exit, their next call
/// reports `Remote` naming the cause within a bounded time, and their own abort then returns.
#[test]
fn one_rank_aborts_the_others_see_remote_error_c28() {
    let count = 1 << 20;
    for nranks in [2usize, 4] {
        let comms = Comm::init_all(&Device::cpus(nranks)).unwrap();
        let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
        let bufs: Vec<_> = comms
            .iter()
            .map(|c| c.device().alloc(count * 4).unwrap())
            .collect();
        std::thread::scope(|s| {
            for r in 0..nranks {
                let (c, st, b) = (&comms[r], &streams[r], &bufs[r]);
                s.spawn(move || {
                    let t = Instant::now();
                    loop {
                        match c.all_reduce(b, b, count, DataType::F32, RedOp::Sum, st) {
                            Ok(()) => {
                                let _ = st.synchronize();
                            }
                            Err(e) => {
                                if r != 0 {
                                    assert!(matches!(e, Error::Remote(_)), "rank {r}: {e}");
                                    assert!(e.to_string().contains("another rank"), "{e}");
                                    let a = Instant::now();
                                    c.abort().unwrap();
                                    assert!(a.elapsed() < Duration::from_secs(5));
                                }
                                break;
                            }
                        }
                        assert!(
                            t.elapsed() < Duration::from_secs(30),
                            "rank {r} never saw the abort"
                        );
                    }
                });
            }
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                comms[0].abort().unwrap();
            });
        });
    }
}
