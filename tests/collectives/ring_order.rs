//! Communicator rings that follow the topology (NCCL's `AllGather3` merge, `connectRings` and
//! `setupChannel`, `oxccl::graph::connect`): CPU-target ranks given a topology through the test
//! hook `NCCL_TOPO_FILE` (CPU rank `r` takes the file's GPU of rank `r`) get the searched ring
//! order on every channel (`Comm::ring`, NCCL's `ring.userRanks`), and every collective stays
//! exact on those rings; random node and channel orders always give valid rings.
//!
//! Expected rings come from `oxccl topo --topo-file tests/topo/<file>` (the graph search of
//! tests/topology/graph.rs) and are checked by hand against the PCI / NVLink layout stated at each
//! test.
use crate::common;

use common::env::{Env, Staged};
use common::topo::rotate;
use oxccl::bootstrap::get_unique_id;
use oxccl::graph::{ChannelRings, global_rings};
use oxccl::{Comm, DataType, Device, Func, RedOp};

/// `NCCL_TOPO_FILE` set to the fixture `file` and `NCCL_MAX_NCHANNELS` to `nch` (their `OXCCL_`
/// spellings unset) while the guard lives.
fn set_topo(file: &str, nch: u32) -> Env {
    let env = Env::clean(TOPO_VARS);
    let (path, nch) = topo_values(file, nch);
    env.set(&[("NCCL_TOPO_FILE", &path), ("NCCL_MAX_NCHANNELS", &nch)]);
    env
}

/// [`set_topo`]'s variables staged for the communicators the helpers create (tests that create
/// theirs only through `common::init_all` and the matrix).
fn stage_topo(file: &str, nch: u32) -> Staged {
    let env = Staged::clean(TOPO_VARS);
    let (path, nch) = topo_values(file, nch);
    env.set(&[("NCCL_TOPO_FILE", &path), ("NCCL_MAX_NCHANNELS", &nch)]);
    env
}

const TOPO_VARS: &[&str] = &["TOPO_FILE", "MAX_NCHANNELS"];

/// The values of `NCCL_TOPO_FILE` (the fixture `file`) and `NCCL_MAX_NCHANNELS`.
fn topo_values(file: &str, nch: u32) -> (String, String) {
    let path = common::topo::fixture(file);
    (path.to_str().unwrap().to_string(), nch.to_string())
}

/// 8 PCIe GPUs over two sockets, two per PCI switch, with ranks interleaved across the switches
/// (`pcie-8gpu-interleaved-topo.xml`, the two-socket fixture with GPU ranks renumbered): switch
/// 0x10 holds ranks 0 and 2, 0x30 ranks 4 and 6 (socket 0), 0x50 ranks 1 and 3, 0x70 ranks 5 and
/// 7 (socket 1). The search gives one channel 0 2 4 6 7 5 1 3 (`oxccl topo`): the switch pairs
/// stay adjacent and the ring crosses sockets twice (6 -> 7, 3 -> 0), where rank order would
/// cross 7 times. Every one of the 4 channels (NCCL_MAX_NCHANNELS=4) repeats it.
const PCIE_RING: [usize; 8] = [0, 2, 4, 6, 7, 5, 1, 3];

use common::topo::MESH_RINGS;

fn check_comm_rings(comms: &[Comm], rings: &[Vec<usize>]) {
    for comm in comms {
        assert_eq!(comm.nchannels() as usize, rings.len());
        for (c, ring) in rings.iter().enumerate() {
            assert_eq!(
                comm.ring(c),
                Some(rotate(ring, comm.rank())),
                "rank {} channel {c}",
                comm.rank()
            );
        }
        assert_eq!(comm.ring(rings.len()), None);
    }
}

#[test]
fn init_all_follows_pcie_ring_and_collectives_stay_exact() {
    let _env = stage_topo("pcie-8gpu-interleaved-topo.xml", 4);
    let devices = Device::cpus(8);
    let comms = common::init_all(&devices).unwrap();
    check_comm_rings(&comms, &vec![PCIE_RING.to_vec(); 4]);
    drop(comms);
    run_all_funcs("init_all_follows_pcie_ring", &devices);
}

#[test]
fn init_all_per_channel_mesh_rings_and_collectives_stay_exact() {
    // 8 channels: channels 6 and 7 repeat searched channels 0 and 1 (NCCL's duplication).
    let _env = stage_topo("nvlink-mesh-4gpu-topo.xml", 8);
    let devices = Device::cpus(4);
    let comms = common::init_all(&devices).unwrap();
    let want: Vec<Vec<usize>> = (0..8).map(|c| MESH_RINGS[c % 6].to_vec()).collect();
    check_comm_rings(&comms, &want);
    // Rank 1 on channel 3 (ring 0 3 2 1): receives from 2, sends to 0.
    assert_eq!(comms[1].ring(3), Some(vec![1, 0, 3, 2]));
    drop(comms);
    run_all_funcs("init_all_per_channel_mesh_rings", &devices);
}

/// A topology whose GPU count differs from the rank count leaves rank order (the hook applies
/// only to as many CPU ranks as the file has GPUs).
#[test]
fn other_rank_count_keeps_rank_order() {
    let _env = stage_topo("pcie-8gpu-interleaved-topo.xml", 2);
    let comms = common::init_all(&Device::cpus(3)).unwrap();
    check_comm_rings(&comms, &vec![vec![0, 1, 2]; 2]);
}

/// The (dtype, op) pairs of the ring-order runs: every element size and every operator once
/// (which ring a rank sends along does not depend on them; the matrix tests run every pair on
/// rank-order rings).
const RING_PAIRS: &[(DataType, RedOp)] = &[
    (DataType::I8, RedOp::Sum),
    (DataType::F8E4M3, RedOp::Max),
    (DataType::Bf16, RedOp::Sum),
    (DataType::F16, RedOp::Min),
    (DataType::F32, RedOp::Avg),
    (DataType::U32, RedOp::Prod),
    (DataType::F64, RedOp::Sum),
    (DataType::I64, RedOp::Max),
];

/// Every collective, every protocol, a few counts (one below the rank count, one straddling a
/// power of two, one spanning several LL steps and Simple slices), on CPU ranks, for
/// [`RING_PAIRS`].
fn run_all_funcs(test: &str, devices: &[Device]) {
    let protos = common::protos();
    for func in [
        Func::AllReduce,
        Func::AllGather,
        Func::ReduceScatter,
        Func::Broadcast,
        Func::Reduce,
    ] {
        common::run_collective(
            &format!("{test}/{func:?}"),
            devices,
            &common::Matrix {
                func,
                counts: &[3, 1025, 65539],
                extra_counts: &[],
                extra_pairs: &[],
                protos: Some(&protos),
                only: Some(RING_PAIRS),
            },
        );
    }
}

/// `Comm::init_rank` (ranks as threads, one host): each rank's node graph travels in the
/// bootstrap all-gather and all ranks connect along the searched ring (one ring, no NET).
#[test]
fn init_rank_follows_pcie_ring() {
    let _env = set_topo("pcie-8gpu-interleaved-topo.xml", 2);
    let id = get_unique_id().unwrap();
    let n = 8;
    // Per rank: its user ranks on both channels and its AllReduce result.
    type RankResult = (Vec<Option<Vec<usize>>>, Vec<f32>);
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let comm = Comm::init_rank(n, &id, r, Device::Cpu(r)).unwrap();
                    let rings = (0..2).map(|c| comm.ring(c)).collect();
                    let dev = comm.device();
                    let stream = dev.new_stream().unwrap();
                    let count = 10_007;
                    let buf = dev.alloc(count * 4).unwrap();
                    buf.write(0, &((r + 1) as f32).to_ne_bytes().repeat(count))
                        .unwrap();
                    comm.all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream)
                        .unwrap();
                    stream.synchronize().unwrap();
                    let out = buf
                        .to_vec()
                        .unwrap()
                        .chunks(4)
                        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                        .collect();
                    comm.destroy().unwrap();
                    (rings, out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (rings, out)) in results.into_iter().enumerate() {
        for ring in rings {
            assert_eq!(ring, Some(rotate(&PCIE_RING, r)), "rank {r}");
        }
        // 1 + 2 + ... + 8 = 36, exact in f32.
        assert!(out.iter().all(|&v| v == 36.0), "rank {r}: AllReduce wrong");
    }
}

/// `Comm::init_rank` (ranks as threads, one host) on the NVLink-mesh fixture, whose searched rings
/// differ per channel: every ring pair is SHM on the CPU target (one transport for all), so each
/// rank connects to all its neighbours of all channels and keeps the searched rings (before:
/// rank order on every channel); AllReduce stays exact, bitwise equal on every rank, out of place
/// and in place, over counts that fill one and several Simple slices per channel.
#[test]
fn init_rank_per_channel_mesh_rings() {
    let _env = set_topo("nvlink-mesh-4gpu-topo.xml", 8);
    let id = get_unique_id().unwrap();
    let n = 4;
    let mut comms: Vec<Comm> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| s.spawn(move || Comm::init_rank(n, &id, r, Device::Cpu(r)).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    comms.sort_by_key(|c| c.rank());
    let want: Vec<Vec<usize>> = (0..8).map(|c| MESH_RINGS[c % 6].to_vec()).collect();
    check_comm_rings(&comms, &want);
    for count in [7, 4099, 300_007] {
        for in_place in [false, true] {
            common::all_reduce_f32(&comms, count, in_place);
        }
    }
    // destroy is collective (a bootstrap barrier): every rank at once.
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || c.destroy().unwrap());
        }
    });
}

/// A random ring order (a permutation of `0..n`) from a seed.
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

    /// Random nodes (1-6, 1-8 ranks each, nodes in a random order), each with 1-4 searched
    /// channels of random intra-node orders, over 1-16 communicator channels: every channel's
    /// ring holds each rank once, next(prev(r)) = prev(next(r)) = r, each node's ranks are
    /// consecutive in its channel order, and user ranks start at the rank and follow next.
    #[test]
    fn random_node_and_channel_orders_give_valid_rings(
        sizes in proptest::collection::vec(1usize..=8, 1..=6),
        nsearched in proptest::collection::vec(1usize..=4, 6),
        nch in 1usize..=16,
        seed in proptest::prelude::any::<u64>(),
    ) {
        let nranks: usize = sizes.iter().sum();
        // Ranks dealt to nodes by a random permutation, nodes in ring order as listed.
        let deal = permutation(nranks, seed);
        let mut at = 0;
        let node_intra: Vec<Vec<Vec<usize>>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &len)| {
                let mine = &deal[at..at + len];
                at += len;
                (0..nsearched[k])
                    .map(|c| permutation(len, seed ^ ((k * 31 + c) as u64 + 1)).iter().map(|&i| mine[i]).collect())
                    .collect()
            })
            .collect();
        let rings = global_rings(&node_intra, nranks, nch).unwrap();
        let ch = ChannelRings::new(rings.clone(), nranks).unwrap();
        proptest::prop_assert_eq!(ch.nchannels(), nch);
        for c in 0..nch {
            let mut seen = rings[c].clone();
            seen.sort_unstable();
            proptest::prop_assert_eq!(seen, (0..nranks).collect::<Vec<_>>());
            // Node k's part of the ring is its order of channel c % its channel count.
            let mut off = 0;
            for node in &node_intra {
                let order = &node[c % node.len()];
                proptest::prop_assert_eq!(&rings[c][off..off + order.len()], &order[..]);
                off += order.len();
            }
            for r in 0..nranks {
                proptest::prop_assert_eq!(ch.next(c, ch.prev(c, r)), r);
                proptest::prop_assert_eq!(ch.prev(c, ch.next(c, r)), r);
                let u = ch.user_ranks(c, r);
                proptest::prop_assert_eq!(u[0], r);
                for k in 1..nranks {
                    proptest::prop_assert_eq!(u[k], ch.next(c, u[k - 1]));
                }
            }
        }
    }
}
