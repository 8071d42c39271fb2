//! A group's collectives aggregated into launches (NCCL's work batches), checked exactly on the
//! CPU target, which runs the kernels' own loop over a launch's works: a scope's consecutive
//! collectives of one communicator, stream and LL kernel entry share one launch
//! ([`oxccl::Comm::kernel_launches`]), up to 32 works a launch, of different channel counts,
//! sizes, in-place and out-of-place forms, Sum and Avg together; LL128 and Simple calls launch
//! one by one; another entry, another stream or the call check start another launch; every
//! protocol, across the LL flag's wrap; one thread issuing every rank's calls rank after rank; a
//! batch captured into a graph and replayed.
use crate::common;

use super::aggregation_more::{Bufs, Call, Op, ar, buffers, call, check, issue, launches_on, run_scope};
use common::env::Env;
use oxccl::{DataType, Device, Func, RedOp, Stream};

const VARS: &[&str] = &[
    "PROTO",
    "ALGO",
    "CHECK_CALLS",
    "TIMEOUT",
    "TEST_INITIAL_STEP",
    "MAX_NCHANNELS",
    "MIN_NCHANNELS",
];

/// AllReduces of u32 of `counts` elements: Sum, Sum, Avg, … in turn, out of place and in place
/// in turn.
fn all_reduces(counts: &[usize]) -> Vec<Call> {
    counts
        .iter()
        .enumerate()
        .map(|(k, &count)| {
            let op = if k % 3 == 2 { RedOp::Avg } else { RedOp::Sum };
            ar(Op::B(op), DataType::U32, count, k % 2 == 1)
        })
        .collect()
}

/// Twenty AllReduces of sizes from 1 to 64K elements on one protocol (Sum and Avg, in place
/// and out of place, so works of different channel counts: the blocks above a work's channels
/// skip it) take one launch per rank on LL, exact; forty take two (32 + 8); on LL128 and Simple
/// each call is its own launch, exact too.
#[test]
fn a_scopes_all_reduces_of_one_entry_share_a_launch_exact() {
    let counts: Vec<usize> = (0..20)
        .map(|k| [1usize, 3, 17, 1000, 4099, 65_536][k % 6] + k)
        .collect();
    for proto in ["Simple", "LL", "LL128"] {
        let env = Env::clean(VARS);
        env.set(&[
            ("NCCL_PROTO", proto),
            ("NCCL_ALGO", "Ring"),
            ("NCCL_MAX_NCHANNELS", "4"),
        ]);
        let comms = common::init_all(&Device::cpus(3)).unwrap();
        let channels: std::collections::BTreeSet<u32> = counts
            .iter()
            .map(|&c| {
                comms[0]
                    .choice_for(Func::AllReduce, c, DataType::U32)
                    .unwrap()
                    .unwrap()
                    .nchannels
            })
            .collect();
        assert!(
            channels.len() > 1,
            "{proto}: every size planned on {channels:?} channels"
        );
        let calls = all_reduces(&counts);
        let launches = run_scope(&comms, &calls, proto);
        assert_eq!(
            launches,
            vec![launches_on(proto, 1, &calls); 3],
            "{proto}: launches per rank for 20 AllReduces"
        );
        let forty = all_reduces(&(0..40).map(|k| 5 + 3 * k).collect::<Vec<_>>());
        let launches = run_scope(&comms, &forty, proto);
        assert_eq!(
            launches,
            vec![launches_on(proto, 2, &forty); 3],
            "{proto}: launches per rank for 40 AllReduces"
        );
    }
}

/// Works from 6 steps below the LL flag's period (2^32) onward: one launch's works continue each
/// connection's steps across the wrap, on every protocol.
#[test]
fn a_launchs_works_continue_their_connections_across_the_ll_flag_wrap() {
    for proto in ["LL", "LL128", "Simple"] {
        let env = Env::clean(VARS);
        env.set(&[("NCCL_PROTO", proto), ("OXCCL_TEST_INITIAL_STEP", "4294967290")]);
        let comms = common::init_all(&Device::cpus(2)).unwrap();
        let counts: Vec<usize> = (0..12).map(|k| 100 + 517 * k).collect();
        let calls = all_reduces(&counts);
        let launches = run_scope(&comms, &calls, proto);
        assert_eq!(launches, vec![launches_on(proto, 1, &calls); 2], "{proto}");
    }
}

/// A change of kernel entry starts a new launch and the order is kept: AllReduce ×3,
/// Broadcast ×2, AllReduce ×2 take three launches; exact.
#[test]
fn another_kernel_entry_starts_another_launch() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL")]);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    let mut calls = all_reduces(&[100, 2000, 30]);
    let bcast = |count, in_place| {
        call(
            Func::Broadcast,
            Op::B(RedOp::Sum),
            DataType::U32,
            count,
            1,
            in_place,
        )
    };
    calls.extend([bcast(500, false), bcast(7, true)]);
    calls.extend(all_reduces(&[9, 4096]));
    assert_eq!(run_scope(&comms, &calls, "mixed"), vec![3; 3]);
}

/// With the call check on, each call is its own launch (a launch checks one call), exact.
#[test]
fn with_the_call_check_on_every_call_is_its_own_launch() {
    let env = Env::clean(VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "60")]);
    let comms = common::init_all(&Device::cpus(2)).unwrap();
    assert_eq!(
        run_scope(&comms, &all_reduces(&[10, 20, 30, 40, 50]), "checked"),
        vec![5; 2]
    );
}

/// One thread issues every rank's calls rank after rank (all of rank 0's, then rank 1's, …) in
/// one scope, on the LL protocol: each rank's calls share a launch, the ranks' launches are
/// interleaved, and every output is exact.
#[test]
fn one_thread_issuing_every_ranks_calls_rank_after_rank_gets_one_launch_per_rank() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL")]);
    let n = 3;
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let calls = all_reduces(&[64, 1000, 3, 777, 50_000, 12]);
    let bufs: Vec<Vec<Bufs>> = (0..n).map(|r| buffers(comms[r].device(), &calls, r, n)).collect();
    let streams: Vec<Stream> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    let before: Vec<u64> = comms.iter().map(|c| c.kernel_launches()).collect();
    oxccl::group::scope(|g| -> oxccl::Result<()> {
        for r in 0..n {
            for (call, b) in calls.iter().zip(&bufs[r]) {
                issue(g, &comms[r], call, b, &streams[r])?;
            }
        }
        Ok(())
    })
    .unwrap()
    .unwrap();
    for r in 0..n {
        streams[r].synchronize().unwrap();
        check(&calls, &bufs[r], r, n, "rank after rank");
    }
    let launches: Vec<u64> = comms
        .iter()
        .zip(&before)
        .map(|(c, b)| c.kernel_launches() - b)
        .collect();
    assert_eq!(launches, vec![1; n]);
}

/// A scope's batch issued on capturing streams is captured as one launch and replays exactly,
/// twice, reading the inputs written before each replay.
#[test]
fn a_captured_batch_replays_exactly() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_PROTO", "LL")]);
    let n = 2;
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let calls = all_reduces(&[33, 1025, 4, 300]);
    let ready = std::sync::Barrier::new(n);
    common::on_threads(n, |r| {
        let c = &comms[r];
        let dev = c.device();
        let bufs = buffers(dev, &calls, r, n);
        let stream = dev.new_stream().unwrap();
        ready.wait();
        let before = c.kernel_launches();
        stream.begin_capture().unwrap();
        oxccl::group::scope(|g| -> oxccl::Result<()> {
            for (call, b) in calls.iter().zip(&bufs) {
                issue(g, c, call, b, &stream)?;
            }
            Ok(())
        })
        .unwrap()
        .unwrap();
        let graph = stream.end_capture().unwrap();
        assert_eq!(c.kernel_launches() - before, 1, "rank {r}");
        let oxccl::CapturedGraph::Cpu(cpu) = &graph else {
            panic!("a CPU stream gave a CUDA graph")
        };
        assert_eq!(cpu.len(), 1, "rank {r}: operations captured");
        for replay in 0..2 {
            // Fresh inputs and poisoned outputs before each replay (in-place ones: the input).
            let fresh = buffers(dev, &calls, r, n);
            for (b, f) in bufs.iter().zip(&fresh) {
                b.output.write(0, &f.output.to_vec().unwrap()).unwrap();
                if let (Some(i), Some(fi)) = (&b.input, &f.input) {
                    i.write(0, &fi.to_vec().unwrap()).unwrap();
                }
            }
            ready.wait();
            // SAFETY: the buffers and communicator live until the synchronize below.
            unsafe { graph.launch(&stream) }.unwrap();
            stream.synchronize().unwrap();
            check(&calls, &bufs, r, n, &format!("replay {replay}"));
            ready.wait();
        }
    });
}

/// On GPUs (two ranks, sharing one when there is only one): twenty AllReduces of one scope take
/// one launch per rank on LL — the kernel reads its works after the first from its parameter,
/// which the launch passes only as far as its works go — and one each on LL128 and Simple;
/// every output is exact.
#[test]
fn gpu_a_scopes_all_reduces_share_a_launch_exact() {
    let test = "gpu_a_scopes_all_reduces_share_a_launch_exact";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let counts: Vec<usize> = (0..20)
        .map(|k| [1usize, 3, 17, 1000, 4099, 262_147][k % 6] + k)
        .collect();
    for proto in ["Simple", "LL", "LL128"] {
        // The CPU tests' clean environment (a call check set for the run would keep every call
        // in a launch of its own).
        let env = Env::clean(VARS);
        env.set(&[("NCCL_PROTO", proto)]);
        let comms = common::init_all(&devices).unwrap();
        drop(env);
        let calls = all_reduces(&counts);
        let launches = run_scope(&comms, &calls, &format!("{test}: {proto}"));
        assert_eq!(launches, vec![launches_on(proto, 1, &calls); 2], "{test}: {proto}");
        let forty = all_reduces(&(0..40).map(|k| 5 + 3001 * k).collect::<Vec<_>>());
        let launches = run_scope(&comms, &forty, proto);
        assert_eq!(launches, vec![launches_on(proto, 2, &forty); 2], "{test}: {proto}, 40 AllReduces");
    }
}
