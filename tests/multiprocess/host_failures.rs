//! Failures of `Comm::init_rank` communicators across simulated hosts, ranks as processes
//! (`host_ranks`), every one bounded in time:
//! - settings outside their ranges, or differing across ranks where they must agree: every rank
//!   fails init naming the variable, or the ranks agree; never a hang;
//! - cases C28 / C29: an abort from another thread, or a rank killed, while every rank loops tree
//!   AllReduce (or ring AllReduce on per-channel rings) across hosts: every survivor gets an
//!   error, its abort returns, it exits;
//! - teardown: a peer exiting after finalize is no error; a rank vanishing before teardown or
//!   killed during the tree setup leaves no one stuck.
use crate::host_ranks::{
    Env, SECS, hosts, init_lines, kv, looping, mesh_envs, millis_before_unit, run_group, spawn_group,
    survivors_exit, tree_small,
};
use oxccl::Proto;
use std::time::{Duration, Instant};

#[test]
fn values_outside_the_ranges_fail_every_rank_in_bounded_time() {
    // One rank of three hosts has a value outside its accepted range: it fails with an
    // InvalidArgument naming the variable and the range, every other rank with a remote error
    // naming that rank and the same message.
    for (var, val, range) in [
        ("NCCL_BUFFSIZE", "8191", "8192..=1073741824"),
        ("NCCL_BUFFSIZE", "-1", "8192..=1073741824"),
        ("NCCL_LL_BUFFSIZE", "0", "8192..=1073741824"),
        ("NCCL_LL128_BUFFSIZE", "8191", "8192..=1073741824"),
        ("NCCL_MAX_NCHANNELS", "0", "1..=64"),
        ("NCCL_NTHREADS", "abc", "64..=1024"),
    ] {
        let mut envs = hosts(&["a", "b", "b", "c"]);
        envs[2].push((var, val.to_string()));
        let lines = init_lines(&kv(&[("NCCL_ALGO", "tree")]), &envs);
        let own = &lines[2];
        assert!(
            own.starts_with("INIT-ERR rank 2 InvalidArgument: ") && own.contains(var) && own.contains(range),
            "{var}={val}: rank 2: {own}"
        );
        let msg = own.split_once(": ").unwrap().1;
        for (r, l) in lines.iter().enumerate().filter(|(r, _)| *r != 2) {
            assert!(
                l.starts_with(&format!("INIT-ERR rank {r} RemoteError: "))
                    && l.contains("rank 2")
                    && l.contains(msg),
                "{var}={val}: rank {r}: {l}"
            );
        }
        eprintln!("{var}={val}: {own}");
    }
}

/// Guards against a refusal that does not name its cause: `NCCL_LL128_BUFFSIZE` differing on one
/// rank was refused on every rank (InvalidUsage, no hang), but the message named
/// `NCCL_MAX_NCHANNELS`, `NCCL_BUFFSIZE` and `NCCL_LL_BUFFSIZE` only (the peers' check counts the
/// LL128 FIFOs in the connection bytes; its message's list left them out).
#[test]
fn mismatched_buffer_sizes_fail_init_on_every_rank_naming_the_variable() {
    // Hosts A {0, 1}, B {2, 3}; rank 3 alone sets a different FIFO size (the tree edges to rank 3
    // are SHM from rank 2; its ring edge to rank 0 is NET): every rank must fail init, in bounded
    // time, naming the disagreement; none may run collectives on mismatched FIFOs.
    let mut misnamed = Vec::new();
    for (var, val) in [
        ("NCCL_BUFFSIZE", "131072"),
        ("NCCL_LL_BUFFSIZE", "32768"),
        ("NCCL_LL128_BUFFSIZE", "131072"),
        ("NCCL_MAX_NCHANNELS", "3"),
    ] {
        let mut envs = hosts(&["a", "a", "b", "b"]);
        envs[3].push((var, val.to_string()));
        let lines = init_lines(&tree_small("LL"), &envs);
        for (r, l) in lines.iter().enumerate() {
            assert!(
                l.starts_with(&format!("INIT-ERR rank {r} "))
                    && (l.contains("InvalidUsage") || l.contains("RemoteError")),
                "{var}={val} on rank 3: rank {r}: {l}\nall: {lines:#?}"
            );
        }
        // The message must name the variable that differs.
        if !lines[0].contains(var) {
            misnamed.push(format!("{var}={val} on rank 3: {}", lines[0]));
        }
        eprintln!("{var}={val} on rank 3: {}", lines[0]);
    }
    assert!(
        misnamed.is_empty(),
        "messages not naming the variable:\n{}",
        misnamed.join("\n")
    );
}

/// Guards against a hang: `NCCL_PROTO`, `NCCL_ALGO` and `NCCL_MIN_NCHANNELS` are read per rank;
/// all-gathered only to report errors and never compared, they let one rank plan another
/// protocol, algorithm or channel count than its peers, whose kernels then waited for each other
/// forever (on trees across hosts and on a one-host ring alike).
#[test]
fn mismatched_call_settings_fail_or_agree_never_hang() {
    // Settings read per rank that decide each call's plan: one rank alone sets a different
    // NCCL_PROTO, NCCL_MIN_NCHANNELS or NCCL_ALGO (tree wanted everywhere, so trees are set up).
    // The brief: fail clearly or agree, never hang. Each rank runs a few tree-size AllReduces;
    // within 12 s (a passing run takes well under 1 s) every rank must either pass exactly or
    // report an error.
    let cases: Vec<(&str, Env, Env)> = vec![
        (
            "NCCL_PROTO=LL on rank 0, Simple elsewhere",
            kv(&[("NCCL_ALGO", "tree")]),
            kv(&[("NCCL_PROTO", "LL")]),
        ),
        (
            "NCCL_MIN_NCHANNELS=2 on rank 0 only",
            kv(&[
                ("NCCL_ALGO", "tree"),
                ("NCCL_PROTO", "Simple"),
                ("NCCL_MAX_NCHANNELS", "2"),
            ]),
            kv(&[("NCCL_MIN_NCHANNELS", "2")]),
        ),
        (
            "NCCL_ALGO=tree on rank 0, unset elsewhere",
            kv(&[("NCCL_PROTO", "Simple")]),
            kv(&[("NCCL_ALGO", "tree")]),
        ),
    ];
    let mut hung = Vec::new();
    for (what, common, rank0) in cases {
        let mut envs = hosts(&["a", "a", "b", "b"]);
        let mut common = common;
        common.extend(kv(&[
            ("OXCCL_CHILD_COUNTS", "1000,65536"),
            ("OXCCL_CHILD_DTYPES", "float"),
        ]));
        if what.starts_with("NCCL_PROTO") {
            for e in envs.iter_mut().skip(1) {
                e.push(("NCCL_PROTO", "Simple".to_string()));
            }
        }
        envs[0].extend(rank0);
        let t = Instant::now();
        // Wait for every rank up to the deadline; which ranks are still running then is recorded
        // before any is killed (killing one makes the others fail with a remote error).
        let mut ranks = spawn_group("ar", &common, &envs);
        let deadline = t + SECS(12);
        while Instant::now() < deadline && ranks.iter_mut().any(|c| matches!(c.child.try_wait(), Ok(None))) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let running: Vec<bool> = ranks
            .iter_mut()
            .map(|c| matches!(c.child.try_wait(), Ok(None)))
            .collect();
        let outs: Vec<(bool, String)> = ranks.iter_mut().map(|c| c.wait(Instant::now())).collect();
        let verdict: Vec<String> = outs
            .iter()
            .enumerate()
            .map(|(r, (ok, out))| {
                let last_call = out.lines().filter(|l| l.contains("CALL-ERR")).last();
                if running[r] {
                    "HUNG (still running at the 12 s deadline)".to_string()
                } else if *ok && out.contains(&format!("HOST-CHILD-OK rank {r}")) && !out.contains("WRONG") {
                    "pass".to_string()
                } else if let Some(l) = last_call.or_else(|| out.lines().find(|l| l.contains("INIT-ERR"))) {
                    format!("error: {l}")
                } else if let Some(l) = out.lines().find(|l| l.contains("WRONG")) {
                    format!("WRONG RESULT: {l}")
                } else {
                    format!("failed: {}", out.lines().last().unwrap_or_default())
                }
            })
            .collect();
        eprintln!("{what} ({:.1} s): {verdict:#?}", t.elapsed().as_secs_f64());
        let agree = verdict.iter().all(|v| v == "pass");
        let all_fail_clearly = verdict.iter().all(|v| v.starts_with("error: "));
        if !agree && !all_fail_clearly {
            hung.push(format!("{what}: {verdict:?}"));
        }
    }
    assert!(
        hung.is_empty(),
        "ranks neither agreed nor failed clearly:\n{}",
        hung.join("\n")
    );
}

#[test]
fn diverged_calls_fail_every_rank_with_the_call_check_on() {
    // OXCCL_CHECK_CALLS=1, three ranks as processes on two simulated hosts (SHM inside host a,
    // NET to host b: the check gathers the signatures over LL FIFOs); rank 2 issues another
    // count. Every rank fails the call with InvalidUsage naming both groups and the count, in
    // bounded time, with no byte of its buffers changed, and its next call returns the same
    // error.
    diverged_calls_fail_every_rank(&["a", "a", "b"]);
}

#[test]
fn diverged_calls_of_one_hosts_processes_fail_every_rank_with_the_call_check_on() {
    // As above with the three processes on one host: each rank's host writes its signature into
    // every rank's `/dev/shm` rows at launch, which the checking blocks read.
    diverged_calls_fail_every_rank(&["a", "a", "a"]);
}

/// Three rank processes on `layout`'s simulated hosts, the check on, rank 2 issuing another
/// count: every rank's error and its next call's, in bounded time, buffers untouched.
fn diverged_calls_fail_every_rank(layout: &[&str]) {
    let mut envs = hosts(layout);
    for (r, count) in ["1024", "1024", "1000"].iter().enumerate() {
        envs[r].push(("OXCCL_CHILD_COUNT", count.to_string()));
    }
    let t = Instant::now();
    let outs = run_group("diverge", &kv(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]), &envs, SECS(60));
    assert!(t.elapsed() < SECS(30), "{:?}", t.elapsed());
    for (r, (ok, out)) in outs.iter().enumerate() {
        let line = out.lines().find(|l| l.starts_with("DIVERGE-")).unwrap_or_else(|| panic!("rank {r}: {out}"));
        let want = format!("DIVERGE-ERR InvalidUsage untouched true: invalid usage: rank {r} of communicator <id>: the ranks issued different calls (OXCCL_CHECK_CALLS): ranks 0, 1 issued allreduce call #1 (1024 × float, op sum; ");
        assert!(crate::common::without_comm_ids(line).starts_with(&want), "rank {r}: {line}");
        assert!(
            line.contains("rank 2 issued allreduce call #1 (1000 × float, op sum; ")
                && line.contains("; they differ in count"),
            "rank {r}: {line}"
        );
        let msg = line.split_once(": ").unwrap().1;
        let again = out.lines().find(|l| l.starts_with("AGAIN ")).unwrap_or_else(|| panic!("rank {r}: {out}"));
        assert_eq!(again, format!("AGAIN Err({msg:?})"), "rank {r}");
        assert!(*ok && out.contains(&format!("HOST-CHILD-OK rank {r}")), "rank {r}: {out}");
    }
}

#[test]
fn survivors_across_hosts_revoke_and_shrink_away_a_rank_that_never_called() {
    // Rank 2 (host b) never calls; ranks 0 (host a) and 1 (host b), joined over NET, time out,
    // revoke (the timed-out rank's proxy has closed its NET connections, so its peer sees an
    // abort: revoke accepts that) and shrink rank 2 away; their new communicator is exact.
    let envs = hosts(&["a", "b", "b"]);
    let t = Instant::now();
    let outs = run_group("revoke", &kv(&[("OXCCL_TIMEOUT", "1"), ("OXCCL_CHILD_SKIP", "2")]), &envs, SECS(60));
    assert!(t.elapsed() < SECS(40), "{:?}", t.elapsed());
    for (r, (ok, out)) in outs.iter().enumerate().take(2) {
        assert!(*ok && out.contains(&format!("HOST-CHILD-OK rank {r}")), "rank {r}: {out}");
        let stuck = out.lines().find(|l| l.starts_with("STUCK ")).unwrap_or_else(|| panic!("rank {r}: {out}"));
        assert!(stuck.starts_with("STUCK Err("), "rank {r}: {stuck}");
        assert!(out.contains("REVOKE Ok(())"), "rank {r}: {out}");
        assert!(out.contains(&format!("SHRUNK rank {r} of 2: exact")), "rank {r}: {out}");
    }
}

#[test]
fn abort_from_another_thread_while_trees_loop_across_hosts() {
    // Hosts A {0, 1}, B {2, 3}, C {4}. (a) Only rank 3 (a chain leaf on host B) aborts from a
    // second thread 0, 5, 30 or 50 ms into the loop; (b) every rank aborts, at different times. Every abort
    // returns Ok within 5 s; every rank's loop ends with an error (its own abort: InvalidUsage;
    // a peer's: RemoteError) and the process exits within 30 s.
    let layout = ["a", "a", "b", "b", "c"];
    for (proto, delay) in [("LL", "0"), ("Simple", "5"), ("LL128", "30"), ("Simple", "50")] {
        // (a) one rank aborts.
        let mut envs = hosts(&layout);
        envs[3].push(("OXCCL_CHILD_ABORT_MS", delay.to_string()));
        let mut ranks = looping(proto, &envs, &[]);
        let t = Instant::now();
        let s = survivors_exit(&format!("c28 one {proto}"), &mut ranks, None, t, |r, l| {
            if r == 3 {
                l.starts_with("GOT-ERROR InvalidUsage")
            } else {
                l.starts_with("GOT-ERROR RemoteError") || l.starts_with("GOT-ERROR InvalidUsage")
            }
        });
        let out3 = ranks[3].text();
        let ab = out3
            .lines()
            .find(|l| l.starts_with("ABORT-RETURNED"))
            .unwrap_or_default();
        assert!(
            ab.starts_with("ABORT-RETURNED rank 3 Ok(())"),
            "c28 one {proto}: {ab}\n{out3}"
        );
        eprintln!("c28 one rank aborts after {delay} ms, {proto}: every rank out in {s:.1} s");
        // (b) every rank aborts (after 10 + 7 r ms).
        let mut envs = hosts(&layout);
        for (r, e) in envs.iter_mut().enumerate() {
            e.push(("OXCCL_CHILD_ABORT_MS", (10 + 7 * r).to_string()));
        }
        let mut ranks = looping(proto, &envs, &[]);
        let t = Instant::now();
        let s = survivors_exit(&format!("c28 all {proto}"), &mut ranks, None, t, |_, l| {
            l.starts_with("GOT-ERROR RemoteError") || l.starts_with("GOT-ERROR InvalidUsage")
        });
        for (r, rank) in ranks.iter_mut().enumerate() {
            let out = rank.text();
            let ab = out
                .lines()
                .find(|l| l.starts_with("ABORT-RETURNED"))
                .unwrap_or_default();
            let ms = millis_before_unit(ab);
            assert!(
                ab.starts_with(&format!("ABORT-RETURNED rank {r} Ok(())")) && ms <= 5000,
                "c28 all {proto}: rank {r}: {ab}\n{out}"
            );
        }
        eprintln!("c28 every rank aborts, {proto}: every rank out in {s:.1} s");
    }
}

#[test]
fn killed_rank_while_trees_loop_across_hosts_stops_every_survivor() {
    // Hosts A {0, 1}, B {2, 3}, C {4, 5}. Killed (SIGKILL) while every rank loops tree
    // AllReduce: rank 1 (a leaf of host A's chain: only SHM edges), rank 2 (host B's chain head:
    // the NET edges of the trees), rank 4 (host C's head). The survivors never poll anything
    // but their own calls: each must get a remote error and exit within 30 s of the kill.
    for (proto, victim) in [("Simple", 1), ("LL", 2), ("LL128", 4), ("Simple", 2)] {
        let envs = hosts(&["a", "a", "b", "b", "c", "c"]);
        let mut ranks = looping(proto, &envs, &[]);
        ranks[victim].child.kill().unwrap();
        let _ = ranks[victim].child.wait();
        let t = Instant::now();
        let s = survivors_exit(
            &format!("c29 kill {victim} {proto}"),
            &mut ranks,
            Some(victim),
            t,
            |_, l| l.starts_with("GOT-ERROR RemoteError") && l.contains("aborted"),
        );
        eprintln!("c29 kill rank {victim}, {proto}: survivors out in {s:.1} s");
    }
}

#[test]
fn killed_rank_on_per_channel_rings_across_hosts_stops_every_survivor() {
    // The mesh rings across two hosts (ring forced, 6 channels: a rank's NET peers differ per
    // channel); rank 5 is killed while every rank loops AllReduce. Every survivor must get a
    // remote error and exit within 30 s.
    for proto in ["Simple", "LL"] {
        let envs = mesh_envs(6);
        let mut ranks = {
            let common = kv(&[
                ("NCCL_ALGO", "ring"),
                ("NCCL_PROTO", proto),
                ("OXCCL_CHILD_COUNT", "65536"),
            ]);
            let mut ranks = spawn_group("loop", &common, &envs);
            let t = Instant::now();
            while !(0..8).all(|r| ranks[r].has("LOOPING")) {
                assert!(t.elapsed() < SECS(60), "ranks never all looped");
                std::thread::sleep(Duration::from_millis(20));
            }
            ranks
        };
        for r in 0..8 {
            let want = format!("LOOPING rank {r} Ring {:?}", Proto::from_name(proto).unwrap());
            assert!(ranks[r].has(&want), "rank {r}: {}", ranks[r].text());
        }
        ranks[5].child.kill().unwrap();
        let _ = ranks[5].child.wait();
        let t = Instant::now();
        let s = survivors_exit(&format!("mesh kill 5 {proto}"), &mut ranks, Some(5), t, |_, l| {
            l.starts_with("GOT-ERROR RemoteError") && l.contains("aborted")
        });
        eprintln!("mesh rings, rank 5 killed, {proto}: survivors out in {s:.1} s");
    }
}

/// Guards against a spurious abort after a clean teardown: with the liveness watch still armed
/// after the teardown barrier of finalize / destroy, a host peer exiting normally afterwards
/// raised the host's abort flags, so rank 0's `get_async_error` reported "remote error: rank 0:
/// rank 1 of this communicator aborted" and the watch logged "ERROR peer rank 1 (process …) has
/// exited; aborting the communicator".
#[test]
fn peer_exiting_after_finalize_is_no_error() {
    // Hosts A {0, 1, 2}, B {3}; tree AllReduce, then every rank finalizes (the collective
    // teardown barrier) and ranks 1..3 exit at once, while rank 0 lingers 600 ms before it asks
    // for the async error and destroys. A peer leaving after a successful finalize is the normal
    // end of a job (NCCL: ncclCommFinalize, then each rank destroys and exits when it likes):
    // rank 0 must report no error and log no abort.
    let mut common = tree_small("LL");
    common.push(("OXCCL_CHILD_LINGER", "0".to_string()));
    let outs = run_group("finalize", &common, &hosts(&["a", "a", "a", "b"]), SECS(60));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(
            *ok && out.contains(&format!("HOST-CHILD-OK rank {r}")),
            "rank {r}:\n{out}"
        );
        for want in [
            "AR exact",
            "FINALIZE Ok(()) after",
            "ASYNC Ok(())",
            "DESTROY Ok(()) after",
        ] {
            assert!(out.contains(want), "rank {r}: no {want:?} in\n{out}");
        }
        let aborts: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("has exited") || l.contains("aborting the communicator"))
            .collect();
        assert!(
            aborts.is_empty(),
            "rank {r}: abort after a clean finalize: {aborts:?}"
        );
    }
}

#[test]
fn rank_vanishing_before_teardown_leaves_no_one_stuck() {
    // Hosts A {0, 1}, B {2, 3}; after a tree AllReduce, rank 1 (host A, SHM to rank 0) or rank 3
    // (host B) exits without finalize or destroy. The others' finalize (the teardown barrier)
    // must return within the bootstrap timeout (5 s here) plus slack (an error, or Ok when the
    // vanished rank's death already aborted the communicator), and their destroy must return too;
    // no process may be left running. The AllReduce before must be exact, or (when the death
    // aborted it: liveness watch, proxies) report an error: never a wrong result reported as Ok.
    for victim in ["1", "3"] {
        let mut common = tree_small("Simple");
        common.push(("OXCCL_CHILD_VANISH", victim.to_string()));
        common.push(("OXCCL_BOOTSTRAP_TIMEOUT", "5".to_string()));
        let t = Instant::now();
        let outs = run_group("finalize", &common, &hosts(&["a", "a", "b", "b"]), SECS(30));
        for (r, (ok, out)) in outs.iter().enumerate() {
            if r.to_string() == victim {
                assert!(out.contains(&format!("VANISH rank {r}")), "rank {r}:\n{out}");
                continue;
            }
            assert!(
                out.contains("AR exact") || out.contains("AR-ERR RemoteError"),
                "victim {victim}: rank {r}: AllReduce neither exact nor reported as failed:\n{out}"
            );
            let fin = out
                .lines()
                .find(|l| l.starts_with("FINALIZE"))
                .unwrap_or_default();
            let ms = millis_before_unit(fin);
            assert!(
                *ok && fin.starts_with("FINALIZE ") && ms < 12_000 && out.contains("DESTROY "),
                "victim {victim}: rank {r}: {fin}\n{out}"
            );
            eprintln!("victim {victim}: rank {r}: {fin}");
        }
        eprintln!("victim {victim}: all out in {:.1} s", t.elapsed().as_secs_f64());
    }
}

#[test]
fn rank_killed_during_tree_setup_leaves_no_one_stuck() {
    // Hosts A {0, 1}, B {2, 3}, C {4}; rank 3 is killed as soon as its ring connections are
    // logged (init goes on with the tree setup: tree memory all-gather, NET tree connections).
    // With a bootstrap timeout of 5 s every survivor must leave init (or the teardown after it)
    // and exit within 25 s of the kill, never hang.
    for victim in [3usize, 4] {
        let mut ranks = spawn_group(
            "init",
            &kv(&[("NCCL_ALGO", "tree"), ("OXCCL_BOOTSTRAP_TIMEOUT", "5")]),
            &hosts(&["a", "a", "b", "b", "c"]),
        );
        let t = Instant::now();
        while !ranks[victim].has("Channel 00") {
            assert!(t.elapsed() < SECS(30), "rank {victim} never connected its ring");
            std::thread::sleep(Duration::from_millis(1));
        }
        ranks[victim].child.kill().unwrap();
        let _ = ranks[victim].child.wait();
        let killed = Instant::now();
        for (r, rank) in ranks.iter_mut().enumerate() {
            if r == victim {
                continue;
            }
            let (_, out) = rank.wait(killed + SECS(25));
            assert!(
                !out.starts_with("did not exit in time"),
                "victim {victim}: rank {r} still running 25 s after the kill:\n{out}"
            );
            let l = out
                .lines()
                .find_map(|l| l.find("INIT-ERR").or_else(|| l.find("CHOICE")).map(|i| &l[i..]))
                .unwrap_or("(no INIT-ERR / CHOICE line)");
            eprintln!(
                "victim {victim}: rank {r} out after {:.1} s: {l}",
                killed.elapsed().as_secs_f64()
            );
        }
    }
}
