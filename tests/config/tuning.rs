//! Tuning: the cost model's choices and the settings that force them.
//!
//! - Case C13 on the CPU target: `NCCL_PROTO` / `NCCL_ALGO` forcing is honoured or refused
//!   explicitly — the plan of each call shows only allowed choices, a bogus value names the
//!   variable, and "nothing available" is an error naming the collective, never a silent fallback
//!   or a hang. These tests hold `common::env::Env` (the environment is process-global).
//! - The model per fabric (`Fabric::of_gpu_rings`, `Model::for_fabric`, `Model::nchannels`,
//!   `Selection::choose_sized`), with property tests: channel counts within their bounds, the
//!   fastest allowed protocol chosen, predictions finite and monotonic in size.
use crate::common;

use common::env::Env;
use oxccl::transport::TransportKind;
use oxccl::tuning::{Fabric, Model, Selection};
use oxccl::{Algo, Comm, DataType, Device, Error, Func, Proto, RedOp};

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
    fn choice_stays_in_its_channel_bounds_and_is_the_fastest_allowed(
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
    fn predictions_are_finite_and_monotonic_in_bytes(
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
    fn fabric_is_the_slowest_ring_transport_in_any_order(kinds in proptest::collection::vec(0u8..3, 0..40)) {
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
fn channel_counts_at_the_edges_of_sizes_and_bounds() {
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
