//! Failures and teardown across simulated hosts (`OXCCL_HOSTID`), ranks as processes running
//! scripts (`script_ranks`): NET failure propagation to every rank of a host (a rank killed
//! anywhere on a mixed SHM+NET ring, one rank's abort reaching idle ranks on other hosts), idle
//! send checks that take no slow or idle peer for dead, and orderly close waits (a rank that
//! destroys its communicator seconds after the others).
use crate::script_ranks::{finish, host_env, mixed_env, run_quiet, show, start, steps};
use std::time::{Duration, Instant};

/// `n` ranks, `per_host` to a host (ring 0 -SHM-> 1 -NET-> 2 ... with 2 a host), loop exact
/// AllReduce (Simple, `NCCL_PROTO`); `victim` is SIGKILLed once every rank looped; every other
/// rank's output by the deadline of 30 s after the kill.
fn kill_run(
    n: usize,
    per_host: usize,
    victim: usize,
    env_extra: &[(&'static str, &str)],
) -> Vec<(bool, String)> {
    let mut envs = mixed_env(n, per_host, &format!("kill{victim}"));
    for e in &mut envs {
        for (k, v) in env_extra {
            e.push((k, v.to_string()));
        }
    }
    let mut ranks = start(&vec!["loop;destroy"; n], &envs);
    let t = Instant::now();
    while !(0..n).all(|r| ranks[r].has("LOOPING")) {
        assert!(t.elapsed() < Duration::from_secs(60), "never all looped");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    ranks[victim].child.kill().unwrap();
    let _ = ranks[victim].child.wait();
    let killed = Instant::now();
    let outs: Vec<(bool, String)> = ranks
        .iter_mut()
        .map(|r| r.wait(killed + Duration::from_secs(30)))
        .collect();
    eprintln!(
        "kill {victim} of {n} ({per_host}/host): survivors done {:?} after the kill",
        killed.elapsed()
    );
    outs
}

/// Every rank of a communicator on `hosts` (rank r on host `hosts[r]`) runs an exact AllReduce,
/// then destroys it; rank `late` sleeps `delay` first and checks get_async_error. Nothing failed,
/// so every step of every rank must succeed, within `delay` plus 10 s.
fn late_destroy(hosts: &[usize], late: usize, delay: Duration, tag: &str) {
    let n = hosts.len();
    let slow = format!("ar 4099;sleep {};async;destroy", delay.as_millis());
    let scripts: Vec<&str> = (0..n)
        .map(|r| {
            if r == late {
                slow.as_str()
            } else {
                "ar 4099;destroy"
            }
        })
        .collect();
    let envs: Vec<_> = hosts.iter().map(|h| host_env(format!("{tag}-h{h}"))).collect();
    let t = Instant::now();
    let mut ranks = start(&scripts, &envs);
    let outs = finish(&mut ranks, delay + Duration::from_secs(40));
    let took = t.elapsed();
    for (r, (ok, out)) in outs.iter().enumerate() {
        let want: Vec<String> = if r == late {
            vec![
                "init OK".into(),
                "ar 4099 OK".into(),
                format!("sleep {} OK", delay.as_millis()),
                "async OK".into(),
                "destroy OK".into(),
            ]
        } else {
            vec!["init OK".into(), "ar 4099 OK".into(), "destroy OK".into()]
        };
        assert!(
            *ok && out.contains(&format!("CHILD-DONE rank {r}")),
            "rank {r}:\n{}",
            show(&outs)
        );
        assert_eq!(
            steps(out),
            want,
            "rank {r} (late rank {late}, {delay:?}):\n{}",
            show(&outs)
        );
    }
    assert!(
        took < delay + Duration::from_secs(10),
        "{took:?} for a {delay:?} delay:\n{}",
        show(&outs)
    );
}

/// A rank that destroys its communicator 3 s after the others (below the 5 s the proxy waits
/// for a sender's close message) is not taken for dead: every step succeeds on every rank, over
/// NET (two hosts) and on a mixed SHM+NET ring (2 hosts × 2 ranks).
#[test]
fn slower_destroy_within_the_flush_wait_is_no_failure() {
    late_destroy(&[0, 1], 1, Duration::from_secs(3), "ld3a");
    late_destroy(&[0, 0, 1, 1], 3, Duration::from_secs(3), "ld3b");
}

/// A rank that destroys its communicator 7 s after the others, with no failure anywhere. Seen
/// (2 ranks on 2 hosts): rank 0's proxy unregisters after waiting FLUSH_WAIT (5 s) for rank 1's
/// close message and closes its receive end; rank 1's idle send check (`Net::check_send`) reads
/// the end of stream and fails the communicator ("NET send to rank 0 (channel 0): ... closed by
/// the receiving end; aborting the communicator"), so rank 1's get_async_error returns
/// "RemoteError: rank 0 of this communicator aborted" although rank 0 only destroyed; rank 1's
/// destroy then skips the teardown barrier (its flag is raised) and rank 0's destroy, waiting at
/// that barrier, returns "RemoteError: bootstrap: allgather step 0: receiving from rank 1:
/// connection closed by the peer" after 7 s. A healthy teardown gives errors on both ranks.
#[test]
fn slower_destroy_beyond_the_flush_wait_is_no_failure() {
    late_destroy(&[0, 1], 1, Duration::from_secs(7), "ld7a");
    late_destroy(&[0, 0, 1, 1], 3, Duration::from_secs(7), "ld7b");
}

/// The rank killed on a mixed SHM+NET ring may be any rank, on 2 hosts × 2 ranks and on 3 hosts
/// × 2 ranks (the `net_transport` tests kill rank 2 of 4 only): every survivor's loop ends with a remote
/// error naming an aborted rank (`get_async_error`'s message), then destroys without error, all
/// within 30 s of the kill. A wrong AllReduce result counts only when get_async_error already
/// reports the failure (an interrupted collective's result is undefined, as in NCCL).
#[test]
fn killed_rank_anywhere_on_mixed_rings_stops_every_survivor() {
    for (n, per_host, victim) in [(4, 2, 0), (4, 2, 1), (4, 2, 3), (6, 2, 0), (6, 2, 3), (6, 2, 4)] {
        let t = Instant::now();
        let outs = kill_run(n, per_host, victim, &[("NCCL_PROTO", "Simple")]);
        for (r, (ok, out)) in outs.iter().enumerate() {
            if r == victim {
                continue;
            }
            let st = steps(out);
            let what = format!("{n} ranks, {per_host} a host, rank {victim} killed: rank {r}");
            assert!(
                *ok && out.contains(&format!("CHILD-DONE rank {r}")),
                "{what}:\n{out}"
            );
            assert_eq!(st.len(), 3, "{what}: {st:?}");
            let prefix = format!("loop ERR RemoteError: remote error: rank {r} of communicator <id>: rank ");
            assert!(
                crate::common::without_comm_ids(&st[1]).starts_with(&prefix)
                    && st[1].contains(" of this communicator aborted; abort or destroy this rank too"),
                "{what}: {st:?}"
            );
            assert_eq!(st[2], "destroy OK", "{what}: {st:?}");
        }
        eprintln!("kill: {n} ranks, rank {victim}: {:?}", t.elapsed());
    }
}

/// One rank aborts while the others are idle (4 ranks on 2 hosts, SHM+NET ring): within 5 s
/// every other rank's get_async_error is a remote error (its host neighbour through the shared
/// abort line, the other host through the NET connections the aborted host closes), and every
/// destroy returns Ok at once (no teardown barrier after an abort).
#[test]
fn abort_of_one_rank_reaches_idle_ranks_on_other_hosts() {
    let a = "ar 4099;sleep 500;abort;destroy";
    let o = "ar 4099;sleep 5000;async;destroy";
    let t = Instant::now();
    let outs = run_quiet(&[o, a, o, o], &mixed_env(4, 2, "ab"), Duration::from_secs(60));
    for (r, (ok, out)) in outs.iter().enumerate() {
        let st = steps(out);
        assert!(
            *ok && out.contains(&format!("CHILD-DONE rank {r}")),
            "rank {r}:\n{}",
            show(&outs)
        );
        if r == 1 {
            assert_eq!(
                st,
                ["init OK", "ar 4099 OK", "sleep 500 OK", "abort OK", "destroy OK"]
            );
            continue;
        }
        assert_eq!(st.len(), 5, "rank {r}: {st:?}");
        assert_eq!(st[..3], ["init OK", "ar 4099 OK", "sleep 5000 OK"], "rank {r}");
        assert!(
            crate::common::without_comm_ids(&st[3])
                .starts_with(&format!("async ERR RemoteError: remote error: rank {r} of communicator <id>: rank "))
                && st[3].contains(" of this communicator aborted"),
            "rank {r}: {st:?}"
        );
        assert_eq!(st[4], "destroy OK", "rank {r}: {st:?}");
    }
    // Rank 0 shares rank 1's host: its line names rank 1 itself.
    assert!(crate::common::without_comm_ids(&steps(&outs[0].1)[3]).contains("rank 0 of communicator <id>: rank 1 of this communicator aborted"));
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}

/// Communicators idle for 12 s (past the socket keepalive's 10 s and many idle send checks) on a
/// mixed SHM+NET ring raise no "receiver gone": get_async_error stays Ok and the next
/// collectives are exact; so is a destroy right after init (no collective) on 3 hosts × 2 ranks.
#[test]
fn idle_communicators_and_destroy_after_init_stay_healthy() {
    let s = "ar 4099;sleep 12000;async;ar 4099;coll 513;destroy";
    let outs = run_quiet(&[s; 4], &mixed_env(4, 2, "idle"), Duration::from_secs(60));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(*ok, "rank {r}:\n{}", show(&outs));
        assert_eq!(
            steps(out),
            [
                "init OK",
                "ar 4099 OK",
                "sleep 12000 OK",
                "async OK",
                "ar 4099 OK",
                "coll 513 OK",
                "destroy OK"
            ],
            "rank {r}:\n{out}"
        );
    }
    let outs = run_quiet(&["destroy"; 6], &mixed_env(6, 2, "dai"), Duration::from_secs(60));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(*ok, "rank {r}:\n{}", show(&outs));
        assert_eq!(steps(out), ["init OK", "destroy OK"], "rank {r}:\n{out}");
    }
}
