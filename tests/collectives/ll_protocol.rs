//! Case C11: (A) Broadcast of arange(count), in place, every root, on each implemented protocol;
//! (B) the LL flag wrap — connections start just below the flag period (2^31 − 1 steps), below
//! 2^32 and below the second period through the `OXCCL_TEST_INITIAL_STEP` hook, then 1000
//! AllReduces must be exact and must not hang; LL128 (64-bit flags) runs the same starts, and both
//! run them on the tree too (each rank its own test node, `NCCL_ALGO=tree`). On the
//! CPU target always, and on 2 GPUs when visible (else it prints why it skipped). Environment
//! variables are process-global: one serial test per device kind.
use crate::common;

use common::env::Staged;
use oxccl::{Algo, Comm, DataType, Device, DeviceBuffer, Proto, RedOp, Stream};

struct Ranks {
    comms: Vec<Comm>,
    streams: Vec<Stream>,
    bufs: Vec<DeviceBuffer>,
}

fn ranks(devices: &[Device], bytes: usize) -> Ranks {
    let comms = common::init_all(devices).expect("init_all");
    let streams = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    let bufs = comms.iter().map(|c| c.device().alloc(bytes).unwrap()).collect();
    Ranks { comms, streams, bufs }
}

fn sync(r: &Ranks) {
    for s in &r.streams {
        s.synchronize().expect("synchronize");
    }
}

/// C11 (A): in-place Broadcast of arange(count) as int32 and int64, root cycling over every rank.
fn broadcast_arange(env: &Staged, devices: &[Device], proto: &str) {
    env.set(&[("NCCL_PROTO", proto)]);
    let n = devices.len();
    let r = ranks(devices, 7809 * 8);
    for dtype in [DataType::I32, DataType::I64] {
        for count in [1000usize, 2076, 4096, 6114, 7809] {
            for root in 0..n {
                let bytes = count * dtype.size();
                let arange: Vec<u8> = (0..count as i64)
                    .flat_map(|i| {
                        if dtype == DataType::I32 {
                            (i as i32).to_ne_bytes().to_vec()
                        } else {
                            i.to_ne_bytes().to_vec()
                        }
                    })
                    .collect();
                for (k, b) in r.bufs.iter().enumerate() {
                    b.write(
                        0,
                        &if k == root {
                            arange.clone()
                        } else {
                            vec![0xA5; bytes]
                        },
                    )
                    .unwrap();
                }
                for (k, c) in r.comms.iter().enumerate() {
                    let s = r.bufs[k].slice(0, bytes).unwrap();
                    c.broadcast(Some(s), s, count, dtype, root, &r.streams[k])
                        .unwrap();
                    assert_eq!(c.last_choice().unwrap().proto.name(), proto);
                }
                sync(&r);
                for (k, b) in r.bufs.iter().enumerate() {
                    let mut got = vec![0u8; bytes];
                    b.read(0, &mut got).unwrap();
                    assert!(
                        got == arange,
                        "{proto} {dtype} count {count} root {root}: rank {k} differs"
                    );
                }
            }
        }
    }
}

/// C11 (B): 1000 small AllReduces from `start` on, each checked; with `tree_nodes`, on the tree
/// over that many test nodes (`OXCCL_TEST_NODES`, `NCCL_ALGO=tree`), whose connections start at
/// the same step.
fn all_reduces_across(env: &Staged, devices: &[Device], proto: Proto, start: u64, tree_nodes: Option<usize>) {
    let n = devices.len();
    let (start_s, nodes) = (start.to_string(), tree_nodes.map(|t| t.to_string()));
    let mut vars = vec![
        ("OXCCL_TEST_INITIAL_STEP", start_s.as_str()),
        ("NCCL_PROTO", proto.name()),
    ];
    if let Some(nodes) = &nodes {
        vars.extend([("NCCL_ALGO", "tree"), ("OXCCL_TEST_NODES", nodes.as_str())]);
    }
    env.set(&vars);
    let r = ranks(devices, 4 * 4);
    for it in 0..1000u32 {
        for (k, b) in r.bufs.iter().enumerate() {
            let v: Vec<u8> = (0..4u32)
                .flat_map(|i| (k as u32 + 1 + it + i).to_ne_bytes())
                .collect();
            b.write(0, &v).unwrap();
        }
        for (k, c) in r.comms.iter().enumerate() {
            c.all_reduce(
                &r.bufs[k],
                &r.bufs[k],
                4,
                DataType::U32,
                RedOp::Sum,
                &r.streams[k],
            )
            .unwrap();
        }
        sync(&r);
        let want: Vec<u8> = (0..4u32)
            .flat_map(|i| ((1..=n as u32).map(|k| k + it + i).sum::<u32>()).to_ne_bytes())
            .collect();
        for (k, b) in r.bufs.iter().enumerate() {
            assert_eq!(
                b.to_vec().unwrap(),
                want,
                "start {start}, nranks {n}, iteration {it}, rank {k}"
            );
        }
        let c = r.comms[0].last_choice().unwrap();
        assert_eq!((c.proto, c.algo == Algo::Tree), (proto, tree_nodes.is_some()));
    }
}

/// Both parts of C11 on `devices`.
fn c11(devices: &[Device], ranks_b: &[usize]) {
    let env = Staged::clean(&["PROTO", "TEST_INITIAL_STEP", "ALGO", "TEST_NODES"]);
    for proto in ["LL", "LL128", "Simple"] {
        broadcast_arange(&env, devices, proto);
    }
    for start in [(1u64 << 31) - 64, (1u64 << 32) - 64, 2 * ((1u64 << 31) - 1) - 64] {
        for &n in ranks_b {
            for proto in [Proto::Ll, Proto::Ll128] {
                all_reduces_across(&env, &devices[..n], proto, start, None);
            }
        }
    }
}

/// C11 (B) on the tree: every rank its own test node (with 4 ranks, the double binary tree has a
/// rank with two children, so the reduce phase combines two receive peers per line).
fn c11_tree(devices: &[Device]) {
    let env = Staged::clean(&["PROTO", "TEST_INITIAL_STEP", "ALGO", "TEST_NODES"]);
    for start in [(1u64 << 31) - 64, (1u64 << 32) - 64, 2 * ((1u64 << 31) - 1) - 64] {
        for proto in [Proto::Ll, Proto::Ll128] {
            all_reduces_across(&env, devices, proto, start, Some(devices.len()));
        }
    }
}

#[test]
fn c11_broadcast_arange_and_ll_flag_wrap() {
    c11(&Device::cpus(4), &[2, 4]);
}

#[test]
fn c11_broadcast_arange_and_ll_flag_wrap_gpu() {
    let Some(devices) = common::gpus_or_skip("c11_broadcast_arange_and_ll_flag_wrap_gpu", 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    c11(&devices, &[2]);
}

#[test]
fn c11_ll_flag_wrap_on_the_tree() {
    c11_tree(&Device::cpus(4));
}

#[test]
fn c11_ll_flag_wrap_on_the_tree_gpu() {
    let Some(devices) = common::gpus_or_skip("c11_ll_flag_wrap_on_the_tree_gpu", 2) else {
        return;
    };
    let _gpu = common::gpu_lock();
    c11_tree(&devices[..2]);
}
