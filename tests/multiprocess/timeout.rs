//! Call timeouts across processes (`OXCCL_TIMEOUT`): ranks as processes of one host (SHM
//! between them, `script_ranks`), one of which never calls. The caller's AllReduce drains after
//! the limit with an undefined result, and its async error is `Timeout` naming the call and the
//! rank that has not issued it (read from the host's shared abort page).
use crate::script_ranks::{finish, show, start};
use std::time::Duration;

#[test]
fn a_rank_process_that_never_calls_times_out_its_peer_naming_it() {
    let env = vec![("OXCCL_TIMEOUT", "1".to_string())];
    let mut ranks = start(&["ar 1025; async; abort", "sleep 4000; destroy"], &[env.clone(), env]);
    let outs = finish(&mut ranks, Duration::from_secs(60));
    let all = show(&outs);
    assert!(outs.iter().all(|(ok, _)| *ok), "{all}");
    let r0 = &crate::common::without_comm_ids(&outs[0].1);
    assert!(r0.contains("STEP ar 1025 WRONG result differs"), "{all}");
    let want = "STEP async ERR Timeout: timeout: rank 0 of communicator <id>: allreduce call #1 (1025 × int32, op sum; ring/";
    assert!(r0.contains(want), "{all}");
    assert!(
        r0.contains(
            "made no progress for 1.0 s (OXCCL_TIMEOUT): waiting for ranks that have not issued it \
             (rank 1 has issued 0 calls)"
        ),
        "{all}"
    );
    assert!(outs[1].1.contains("STEP destroy OK"), "{all}");
}

/// The same over NET (two simulated hosts, `OXCCL_HOSTID`): the hosts share no abort page, so
/// the timed-out rank names where its first channel stopped and the neighbours it waits for.
#[test]
fn a_call_over_net_times_out_naming_its_channel_and_neighbours() {
    let env = |h: &str| vec![("OXCCL_TIMEOUT", "1".to_string()), ("OXCCL_HOSTID", h.to_string())];
    let mut ranks = start(&["ar 1025; async; abort", "sleep 4000; destroy"], &[env("net-a"), env("net-b")]);
    let outs = finish(&mut ranks, Duration::from_secs(60));
    let all = show(&outs);
    assert!(outs.iter().all(|(ok, _)| *ok), "{all}");
    let r0 = &crate::common::without_comm_ids(&outs[0].1);
    assert!(r0.contains("STEP ar 1025 WRONG result differs"), "{all}");
    assert!(
        r0.contains("STEP async ERR Timeout: timeout: rank 0 of communicator <id>: allreduce call #1 (1025 × int32, op sum; ring/"),
        "{all}"
    );
    assert!(
        r0.contains("made no progress for 1.0 s (OXCCL_TIMEOUT): channel 0 received step 0 from rank 1 and was credited step "),
        "{all}"
    );
    assert!(r0.contains(" by rank 1"), "{all}");
    assert!(outs[1].1.contains("STEP destroy OK"), "{all}");
}
