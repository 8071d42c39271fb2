//! Point-to-point between rank processes (`Comm::init_rank`): send/recv around the ring and
//! all-to-all, exact, over SHM (ranks of one host), NET (every rank its own simulated host,
//! `OXCCL_HOSTID`) and a mix of both; ranks whose `NCCL_P2P_LL_THRESHOLD` differ.
use crate::script_ranks::{finish, mixed_env, show, start};
use std::time::Duration;

fn run(n: usize, per_host: usize, tag: &str) {
    let script = "p2p 0; p2p 1; p2p 4099; p2p 1000003; ar 1025; destroy";
    let scripts = vec![script; n];
    let mut ranks = start(&scripts, &mixed_env(n, per_host, tag));
    let outs = finish(&mut ranks, Duration::from_secs(120));
    let all = show(&outs);
    assert!(outs.iter().all(|(ok, _)| *ok), "{all}");
    for (r, (_, o)) in outs.iter().enumerate() {
        for step in ["p2p 0", "p2p 1", "p2p 4099", "p2p 1000003", "ar 1025", "destroy"] {
            assert!(o.contains(&format!("STEP {step} OK")), "rank {r}, {step}:\n{all}");
        }
    }
}

#[test]
fn send_recv_and_all_to_all_between_processes_over_shm() {
    run(3, 3, "p2p-shm");
}

#[test]
fn send_recv_and_all_to_all_between_processes_over_net() {
    run(3, 1, "p2p-net");
}

#[test]
fn send_recv_and_all_to_all_between_processes_over_shm_and_net() {
    run(4, 2, "p2p-mix");
}

/// Each rank process chooses LL or Simple for its sends by its own `NCCL_P2P_LL_THRESHOLD`
/// (0: every send on Simple; 16384; 1 MiB: every send here on LL), and its receives follow
/// whatever protocol the sender's header names: sizes just below, at and above 16 KiB and far
/// above, around the ring and in all-to-all, exact over SHM and over NET.
fn run_with_thresholds(n: usize, per_host: usize, tag: &str) {
    let thresholds = ["0", "1048576", "16384", "1"];
    let script = "p2p 1; p2p 12000; p2p 16384; p2p 16385; p2p 40000; p2p 1000003; ar 1025; destroy";
    let scripts = vec![script; n];
    let mut envs = mixed_env(n, per_host, tag);
    for (r, e) in envs.iter_mut().enumerate() {
        e.push(("NCCL_P2P_LL_THRESHOLD", thresholds[r % thresholds.len()].to_string()));
    }
    let mut ranks = start(&scripts, &envs);
    let outs = finish(&mut ranks, Duration::from_secs(120));
    let all = show(&outs);
    assert!(outs.iter().all(|(ok, _)| *ok), "{all}");
    for (r, (_, o)) in outs.iter().enumerate() {
        for step in script.split("; ") {
            assert!(o.contains(&format!("STEP {step} OK")), "rank {r}, {step}:\n{all}");
        }
    }
}

#[test]
fn ranks_with_different_ll_thresholds_exchange_exactly_over_shm() {
    run_with_thresholds(3, 3, "p2p-thr-shm");
}

#[test]
fn ranks_with_different_ll_thresholds_exchange_exactly_over_net() {
    run_with_thresholds(3, 1, "p2p-thr-net");
}
