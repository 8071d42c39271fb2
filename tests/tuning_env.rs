//! Case C13 on the CPU target: `NCCL_PROTO` / `NCCL_ALGO` forcing is honoured or refused
//! explicitly — the plan of each call shows only allowed choices, a bogus value names the variable,
//! and "nothing available" is an error naming the collective, never a silent fallback or a hang.
//! Environment variables are process-global, so everything runs in one serial test.
mod common;

use common::env::Env;
use oxccl::{Algo, Comm, DataType, Device, Error, Proto, RedOp};

/// AllReduce of rank+1 over 3 CPU ranks; returns the error of the first failing call.
fn run_all_reduce() -> Result<Vec<Option<oxccl::Choice>>, Error> {
    let comms = Comm::init_all(&Device::cpus(3))?;
    let count = 1000;
    let mut streams = Vec::new();
    let mut bufs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let b = c.device().alloc(count * 4)?;
        b.write(0, &((r + 1) as f32).to_ne_bytes().repeat(count))?;
        bufs.push(b);
        streams.push(c.device().new_stream()?);
    }
    for (r, c) in comms.iter().enumerate() {
        c.all_reduce(&bufs[r], &bufs[r], count, DataType::F32, RedOp::Sum, &streams[r])?;
    }
    for s in &streams {
        s.synchronize()?;
    }
    for b in &bufs {
        let out = b.to_vec()?;
        assert!(
            out.chunks(4)
                .all(|c| f32::from_ne_bytes(c.try_into().unwrap()) == 6.0)
        );
    }
    Ok(comms.iter().map(|c| c.last_choice()).collect())
}

#[test]
fn proto_and_algo_forcing_c13() {
    let env = Env::clean(&["PROTO", "ALGO"]);

    // Each forcing: every call's plan uses an allowed protocol (4000-byte calls: the model's pick
    // among the allowed ones), and forcing a single protocol gives exactly that one.
    for (value, allowed) in [
        ("Simple", &[Proto::Simple][..]),
        ("LL", &[Proto::Ll]),
        ("LL128", &[Proto::Ll128]),
        ("^LL", &[Proto::Ll128, Proto::Simple]),
        ("^LL,LL128", &[Proto::Simple]),
        ("simple,LL", &[Proto::Simple, Proto::Ll]),
    ] {
        env.set(&[("NCCL_PROTO", value)]);
        let choices = run_all_reduce().unwrap_or_else(|e| panic!("NCCL_PROTO={value}: {e}"));
        for c in choices {
            let c = c.expect("a plan is recorded");
            assert_eq!(c.algo, Algo::Ring, "NCCL_PROTO={value}");
            assert!(
                allowed.contains(&c.proto),
                "NCCL_PROTO={value}: chose {}",
                c.proto
            );
        }
    }

    // Allowed but not implemented yet: tree. An explicit error naming the collective, on every rank.
    env.set(&[("NCCL_ALGO", "Tree")]);
    let e = run_all_reduce().unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(
        e.to_string().contains("allreduce") && e.to_string().contains("{tree}"),
        "{e}"
    );
    env.set(&[]);

    // A bogus value fails init and names the variable (OXCCL_ spelling wins over NCCL_).
    env.set(&[("NCCL_PROTO", "bogus")]);
    let e = Comm::init_all(&Device::cpus(2))
        .err()
        .expect("bogus NCCL_PROTO must fail");
    assert!(
        e.to_string().contains("NCCL_PROTO") && e.to_string().contains("bogus"),
        "{e}"
    );
    env.set(&[("NCCL_PROTO", "bogus"), ("OXCCL_PROTO", "Simple")]);
    run_all_reduce().expect("OXCCL_PROTO=Simple overrides the bogus NCCL_PROTO");

    // NCCL_ALGO=Tree with Broadcast must not fall back to ring silently.
    env.set(&[("NCCL_ALGO", "Tree")]);
    let comms = Comm::init_all(&Device::cpus(2)).unwrap();
    let s = comms[0].device().new_stream().unwrap();
    let b = comms[0].device().alloc(64).unwrap();
    let e = comms[0]
        .broadcast(Some(b.as_slice()), &b, 16, DataType::F32, 0, &s)
        .unwrap_err();
    assert!(
        e.to_string().contains("broadcast") && e.to_string().contains("{tree}"),
        "{e}"
    );
}

/// `Comm::choice_for` predicts exactly the plan the call then records in `last_choice` (what
/// `oxccl perf` prints as `# oxccl choice`, also for `--procs` runs whose last call is the
/// combining AllReduce), for AllReduce and AllGather (whose model size is nranks × count) at
/// sizes on either side of the protocol switches; `None` for count 0.
#[test]
fn choice_for_matches_the_recorded_plan() {
    let _env = Env::clean(&["PROTO", "ALGO"]);
    let comms = Comm::init_all(&Device::cpus(2)).unwrap();
    let max = 1 << 18;
    let bufs: Vec<_> = comms
        .iter()
        .map(|c| {
            (
                c.device().alloc(max * 4).unwrap(),
                c.device().alloc(2 * max * 4).unwrap(),
            )
        })
        .collect();
    let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    for count in [1, 3000, 40_000, max] {
        for func in [oxccl::Func::AllReduce, oxccl::Func::AllGather] {
            let predicted: Vec<_> = comms
                .iter()
                .map(|c| c.choice_for(func, count, DataType::F32).unwrap())
                .collect();
            std::thread::scope(|s| {
                for (r, c) in comms.iter().enumerate() {
                    let (send, recv) = (&bufs[r].0, &bufs[r].1);
                    let stream = &streams[r];
                    s.spawn(move || {
                        match func {
                            oxccl::Func::AllReduce => {
                                c.all_reduce(send, recv, count, DataType::F32, RedOp::Sum, stream)
                            }
                            _ => c.all_gather(send, recv, count, DataType::F32, stream),
                        }
                        .unwrap();
                        stream.synchronize().unwrap();
                    });
                }
            });
            for (r, c) in comms.iter().enumerate() {
                assert!(predicted[r].is_some(), "{func} count {count}");
                assert_eq!(predicted[r], c.last_choice(), "{func} count {count} rank {r}");
            }
        }
    }
    // Different sizes do get different plans (the check above is not comparing constants).
    let small = comms[0]
        .choice_for(oxccl::Func::AllReduce, 1, DataType::F32)
        .unwrap()
        .unwrap();
    let large = comms[0]
        .choice_for(oxccl::Func::AllReduce, max, DataType::F32)
        .unwrap()
        .unwrap();
    assert_ne!(small, large);
    assert_eq!(
        comms[0]
            .choice_for(oxccl::Func::AllReduce, 0, DataType::F32)
            .unwrap(),
        None
    );
}
