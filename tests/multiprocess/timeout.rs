//! Call timeouts across processes (`OXCCL_TIMEOUT`): ranks as processes of one host (SHM
//! between them, `script_ranks`), one of which never calls. The caller's AllReduce drains after
//! the limit with an undefined result, and its async error is `Timeout` naming the call and the
//! rank that has not issued it (read from the host's shared abort page).
use crate::common::child;
use crate::script_ranks::{finish, show, start, start_alone};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

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

/// Whether process `pid` catches SIGUSR1 (its `SigCgt` mask in `/proc/<pid>/status`).
fn catches_sigusr1(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (libc::SIGUSR1 - 1)) != 0)
}

/// SIGUSR1, which asks every rank with `OXCCL_FLIGHT_RECORDER_DUMP` set for a dump, sent to a
/// rank still in init (waiting in the bootstrap for a rank that never starts, as a job with a
/// missing rank does) does not end it: init ends on the bootstrap's timeout, as without the
/// signal.
#[test]
fn sigusr1_to_a_rank_waiting_in_init_does_not_end_it() {
    let dir = std::env::temp_dir().join(format!("oxccl-sigusr1-init-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("fr").to_string_lossy().into_owned();
    let mut kid = start_alone(0, 2, "3", &[("OXCCL_FLIGHT_RECORDER_DUMP", prefix)]);
    let t = Instant::now();
    // The handler is in once init has read its settings, before the bootstrap's wait.
    while !catches_sigusr1(kid.id()) {
        let ended = kid.try_wait().unwrap();
        assert!(ended.is_none() && t.elapsed() < Duration::from_secs(20), "SIGUSR1 not caught during init ({ended:?})");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) of the child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(kid.id() as libc::pid_t, libc::SIGUSR1) }, 0);
    let (status, out, err) = child::wait_output(kid, Instant::now() + Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&dir);
    let status = status.unwrap_or_else(|| panic!("still running after 30 s: {out}{err}"));
    assert_eq!(status.signal(), None, "ended by a signal: {out}{err}");
    assert!(out.contains("STEP init ERR"), "{out}{err}");
}
