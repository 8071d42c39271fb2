//! The ranks of one `Comm::init_all` run the per-rank setup of `Comm::init_rank` through an
//! in-process bootstrap, so only the transport decides what differs from ranks in separate
//! processes. CPU target (every run):
//! 1. by default every pair of ranks uses P2P (plain addresses in one process) and the ring
//!    connections exchange pointers (direct writes);
//! 2. `NCCL_P2P_DISABLE=1` gives SHM between every pair (no direct writes), and every collective
//!    stays exact under every protocol (`common::run_collective`: guards, poisoned outputs,
//!    in place and out of place);
//! 3. `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` gives NET (the proxy over sockets, inside one
//!    process), AllReduce exact under every protocol;
//! 4. the trees of `OXCCL_TEST_NODES` follow the same transports (P2P and SHM);
//! 5. a rank that cannot initialize fails every rank of the group at once, naming the cause;
//! 6. communicators of one group are dropped one by one from one thread (no teardown barrier).
//!
//! The same transports between CUDA ranks in one process are in `gpu_collectives`.
use crate::common;

use common::env::{Env, Staged};
use oxccl::transport::TransportKind;
use oxccl::{Algo, Comm, DataType, Device, Func, RedOp};
use std::time::{Duration, Instant};

/// Every variable a test here may set: cleared (both spellings) around each init.
const VARS: &[&str] = &[
    "P2P_DISABLE",
    "SHM_DISABLE",
    "P2P_DIRECT_DISABLE",
    "PROTO",
    "ALGO",
    "TEST_NODES",
    "BUFFSIZE",
    "MAX_NCHANNELS",
    "NET",
];

/// Counts of the matrices here: below one pack, across a power of two, several LL steps.
const COUNTS: &[usize] = &[0, 1, 3, 1025, (1 << 16) + 3];

/// Asserts that every rank of `comms` reaches every other through `want`, seen alike from both
/// ends.
fn assert_transports(comms: &[Comm], want: TransportKind, what: &str) {
    for a in comms {
        for b in comms {
            let (r, p) = (a.rank(), b.rank());
            let expect = if r == p { TransportKind::P2p } else { want };
            assert_eq!(a.transport_to(p), Some(expect), "{what}: rank {r} to rank {p}");
        }
        assert_eq!(a.transport_to(comms.len()), None, "{what}: a peer out of range");
    }
}

#[test]
fn init_all_ranks_use_p2p_and_direct_pointers_by_default() {
    let _env = Env::clean(VARS);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    assert_transports(&comms, TransportKind::P2p, "default");
    assert!(comms.iter().all(Comm::direct_pointer), "3 P2P ranks exchange pointers");
    for in_place in [false, true] {
        common::all_reduce_f32(&comms, 4097, in_place);
    }
}

#[test]
fn init_all_with_p2p_disabled_uses_shm_and_every_collective_stays_exact() {
    let env = Staged::clean(VARS);
    env.set(&[("NCCL_P2P_DISABLE", "1")]);
    let devices = Device::cpus(3);
    let comms = common::init_all(&devices).unwrap();
    assert_transports(&comms, TransportKind::Shm, "NCCL_P2P_DISABLE=1");
    assert!(!comms.iter().any(Comm::direct_pointer), "SHM rings exchange no pointers");
    drop(comms);
    let protos = common::protos();
    for func in [Func::Broadcast, Func::Reduce, Func::AllGather, Func::ReduceScatter, Func::AllReduce] {
        common::run_collective(
            &format!("init_all over SHM {func:?}"),
            &devices,
            &common::Matrix {
                func,
                counts: COUNTS,
                extra_counts: &[],
                extra_pairs: &[],
                protos: Some(&protos),
                only: None,
            },
        );
    }
}

#[test]
fn init_all_with_p2p_and_shm_disabled_uses_net_through_the_proxy() {
    let env = Staged::clean(VARS);
    for proto in common::protos() {
        env.set(&[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_PROTO", proto)]);
        let comms = common::init_all(&Device::cpus(2)).unwrap();
        assert_transports(&comms, TransportKind::Net, "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1");
        for count in [1, 1025, (1 << 16) + 3] {
            for in_place in [false, true] {
                for c in common::all_reduce_f32(&comms, count, in_place) {
                    assert_eq!(c.proto.name(), proto, "count {count}");
                }
            }
        }
    }
}

#[test]
fn test_node_trees_run_over_the_transport_of_each_pair() {
    let env = Staged::clean(VARS);
    for (p2p_disable, want) in [("0", TransportKind::P2p), ("1", TransportKind::Shm)] {
        env.set(&[
            ("OXCCL_TEST_NODES", "2"),
            ("NCCL_ALGO", "tree"),
            ("NCCL_P2P_DISABLE", p2p_disable),
        ]);
        let comms = common::init_all(&Device::cpus(4)).unwrap();
        assert_transports(&comms, want, "tree across 2 test nodes");
        for count in [1, 1025, (1 << 16) + 3] {
            for in_place in [false, true] {
                for c in common::all_reduce_f32(&comms, count, in_place) {
                    assert_eq!(c.algo, Algo::Tree, "count {count}");
                }
            }
        }
    }
}

#[test]
fn a_rank_that_cannot_initialize_fails_the_group_at_once_naming_the_cause() {
    let env = Env::clean(VARS);
    // Every rank reads the same bad value: each fails with its own error, which init_all returns.
    env.set(&[("NCCL_BUFFSIZE", "12")]);
    let t = Instant::now();
    let e = common::init_all(&Device::cpus(3)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    assert!(matches!(e, oxccl::Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("NCCL_BUFFSIZE"), "{e}");
    // A bad test-node count is read at the tree setup, after the connections: same.
    env.set(&[("OXCCL_TEST_NODES", "5")]);
    let e = common::init_all(&Device::cpus(4)).unwrap_err();
    assert!(matches!(e, oxccl::Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("OXCCL_TEST_NODES=\"5\""), "{e}");
    // The group is gone: a new one of the same size initializes and runs.
    env.set(&[]);
    let comms = common::init_all(&Device::cpus(4)).unwrap();
    common::all_reduce_f32(&comms, 7, false);
}

#[test]
fn ranks_of_one_group_are_dropped_one_by_one_from_one_thread() {
    let _env = Env::clean(VARS);
    let t = Instant::now();
    for _ in 0..3 {
        let mut comms = common::init_all(&Device::cpus(3)).unwrap();
        let streams = common::streams(&comms);
        let bufs: Vec<_> = comms.iter().map(|c| c.device().alloc(4 * 1025).unwrap()).collect();
        std::thread::scope(|s| {
            for r in 0..3 {
                let (c, st, b) = (&comms[r], &streams[r], &bufs[r]);
                s.spawn(move || {
                    c.all_reduce(b, b, 1025, DataType::F32, RedOp::Sum, st).unwrap();
                    st.synchronize().unwrap();
                });
            }
        });
        // Rank 1 first, then 0, then 2; each drop returns at once.
        drop(comms.remove(1));
        let last = comms.pop().unwrap();
        drop(comms);
        last.destroy().unwrap();
    }
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
}
