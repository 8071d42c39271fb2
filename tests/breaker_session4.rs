//! Breaker tests of session 4's multi-process changes (NET failure propagation to a host's
//! ranks, idle send checks, orderly close waits; per-channel searched rings kept by `init_rank`;
//! `NCCL_P2P_LEVEL` on CPU ranks). Every rank is a child process of this test binary
//! (`b4_child_entry`) that runs a small script given in `OXCCL_B4_SCRIPT` and prints one line per
//! step, which the parent reads. Every child is killed at a deadline.
mod common;

use common::child::{LineChild, child_rank, clean_child, hex, log_to_stdout};
use oxccl::bootstrap::get_unique_id;
use oxccl::{Comm, DataType, Device, RedOp};
use std::time::{Duration, Instant};

fn ne_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// AllReduce i32 sum of `count` elements where rank r's element i is (r+1)·1000 + i mod 977, so
/// every rank's element i is 1000·n(n+1)/2 + n·(i mod 977); in place. `Ok(true)` when exact.
fn all_reduce_exact(comm: &Comm, count: usize) -> oxccl::Result<bool> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let input: Vec<i32> = (0..count)
        .map(|i| (r as i32 + 1) * 1000 + (i % 977) as i32)
        .collect();
    let want: Vec<i32> = (0..count)
        .map(|i| 1000 * (n * (n + 1) / 2) as i32 + n as i32 * (i % 977) as i32)
        .collect();
    let buf = dev.alloc(count * 4)?;
    buf.write(0, &ne_i32(&input))?;
    comm.all_reduce(&buf, &buf, count, DataType::I32, RedOp::Sum, &stream)?;
    stream.synchronize()?;
    Ok(buf.to_vec()? == ne_i32(&want))
}

/// AllGather u32 (rank q contributes q·1_000_003 + i: out[k] = (k / count)·1_000_003 + k mod
/// count), ReduceScatter i32 sum (rank q's in[j] = j + q: rank r's out[i] = n(r·count+i) +
/// n(n-1)/2), Broadcast u8 from every root ((31 i + root) mod 256) and Reduce i32 sum to every
/// root (in[i] = i + q: root's out[i] = n i + n(n-1)/2). `Ok(list of wrong results)`.
fn other_collectives_exact(comm: &Comm, count: usize) -> oxccl::Result<Vec<String>> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let mut bad = Vec::new();
    let send = dev.alloc(count * 4)?;
    send.write(
        0,
        &(0..count)
            .flat_map(|i| ((r * 1_000_003 + i) as u32).to_ne_bytes())
            .collect::<Vec<_>>(),
    )?;
    let recv = dev.alloc(count * 4 * n)?;
    comm.all_gather(&send, &recv, count, DataType::U32, &stream)?;
    stream.synchronize()?;
    let want: Vec<u8> = (0..count * n)
        .flat_map(|k| (((k / count) * 1_000_003 + k % count) as u32).to_ne_bytes())
        .collect();
    if recv.to_vec()? != want {
        bad.push(format!("AllGather {count}"));
    }
    let send = dev.alloc(count * n * 4)?;
    send.write(
        0,
        &ne_i32(&(0..count * n).map(|j| (j + r) as i32).collect::<Vec<_>>()),
    )?;
    let recv = dev.alloc(count * 4)?;
    comm.reduce_scatter(&send, &recv, count, DataType::I32, RedOp::Sum, &stream)?;
    stream.synchronize()?;
    let want: Vec<i32> = (0..count)
        .map(|i| (n * (r * count + i) + n * (n - 1) / 2) as i32)
        .collect();
    if recv.to_vec()? != ne_i32(&want) {
        bad.push(format!("ReduceScatter {count}"));
    }
    for root in 0..n {
        let want: Vec<u8> = (0..count).map(|i| (i * 31 + root) as u8).collect();
        let out = dev.alloc(count)?;
        let src = dev.alloc(count)?;
        src.write(0, &want)?;
        let s = (r == root).then(|| (&src).into());
        comm.broadcast(s, &out, count, DataType::U8, root, &stream)?;
        stream.synchronize()?;
        if out.to_vec()? != want {
            bad.push(format!("Broadcast {count} root {root}"));
        }
        let send = dev.alloc(count * 4)?;
        send.write(
            0,
            &ne_i32(&(0..count).map(|i| (i + r) as i32).collect::<Vec<_>>()),
        )?;
        let recv = dev.alloc(count * 4)?;
        recv.write(0, &vec![0x5a; count * 4])?;
        comm.reduce(
            &send,
            (r == root).then(|| (&recv).into()),
            count,
            DataType::I32,
            RedOp::Sum,
            root,
            &stream,
        )?;
        stream.synchronize()?;
        let want = if r == root {
            ne_i32(
                &(0..count)
                    .map(|i| (n * i + n * (n - 1) / 2) as i32)
                    .collect::<Vec<_>>(),
            )
        } else {
            vec![0x5a; count * 4]
        };
        if recv.to_vec()? != want {
            bad.push(format!("Reduce {count} root {root}"));
        }
    }
    Ok(bad)
}

/// The body of every child rank (a no-op in a normal test run). `OXCCL_B4_SCRIPT` is a `;` list
/// of steps: `ar COUNT` (exact AllReduce), `coll COUNT` (AllGather, ReduceScatter, Broadcast and
/// Reduce from every root, exact), `sleep MS`, `async` (get_async_error), `abort`, `destroy`,
/// `rings` (prints every channel's ring), `loop` (AllReduce until an error). Prints
/// `STEP <step> OK`, `STEP <step> ERR <code>: <error>` or `STEP <step> WRONG ...`, each with the
/// milliseconds it took.
#[test]
fn b4_child_entry() {
    let Ok(script) = std::env::var("OXCCL_B4_SCRIPT") else {
        return;
    };
    log_to_stdout("oxccl::transport=info,oxccl::proxy=debug,oxccl::init=warn");
    let (rank, nranks, id) = child_rank("OXCCL_B4");
    let t = Instant::now();
    let comm = match Comm::init_rank(nranks, &id, rank, Device::Cpu(rank)) {
        Ok(c) => {
            println!("STEP init OK {} ms", t.elapsed().as_millis());
            c
        }
        Err(e) => {
            println!("STEP init ERR {:?}: {e}", e.code());
            return;
        }
    };
    let mut comm = Some(comm);
    for step in script.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (cmd, arg) = step.split_once(' ').unwrap_or((step, ""));
        let t = Instant::now();
        let c = comm.as_ref().expect("a step after destroy");
        let res: Result<Option<String>, oxccl::Error> = match cmd {
            "ar" => all_reduce_exact(c, arg.parse().unwrap())
                .map(|ok| (!ok).then(|| "result differs".to_string())),
            "coll" => other_collectives_exact(c, arg.parse().unwrap())
                .map(|b| (!b.is_empty()).then(|| b.join(", "))),
            "sleep" => {
                std::thread::sleep(Duration::from_millis(arg.parse().unwrap()));
                Ok(None)
            }
            "async" => c.get_async_error().map(|_| None),
            "abort" => c.abort().map(|_| None),
            "rings" => {
                let rings: Vec<String> = (0..c.nchannels() as usize)
                    .map(|ch| format!("{:?}", c.ring(ch).unwrap()))
                    .collect();
                println!("RINGS rank {rank} nch {} {}", c.nchannels(), rings.join(" "));
                Ok(None)
            }
            "loop" => {
                let mut it = 0u64;
                let e = loop {
                    match all_reduce_exact(c, 1 << 16) {
                        Ok(true) => {}
                        // An interrupted collective's result is undefined once the
                        // communicator reports an error (NCCL's async error); only a wrong
                        // result while it is healthy is silent corruption.
                        Ok(false) => match c.get_async_error() {
                            Ok(()) => break None,
                            Err(e) => break Some(e),
                        },
                        Err(e) => break Some(e),
                    }
                    it += 1;
                    if it == 1 {
                        println!("LOOPING rank {rank}");
                    }
                };
                match e {
                    Some(e) => Err(e),
                    None => Ok(Some(format!("wrong result at iteration {it}"))),
                }
            }
            "destroy" => comm.take().unwrap().destroy().map(|_| None),
            other => panic!("unknown step {other}"),
        };
        let ms = t.elapsed().as_millis();
        match res {
            Ok(None) => println!("STEP {step} OK {ms} ms"),
            Ok(Some(w)) => println!("STEP {step} WRONG {w} {ms} ms"),
            Err(e) => println!("STEP {step} ERR {:?}: {e} ({ms} ms)", e.code()),
        }
    }
    drop(comm);
    println!("CHILD-DONE rank {rank}");
}

/// Starts `envs.len()` ranks of one communicator, rank r with script `scripts[r]` and the extra
/// environment `envs[r]`.
fn start(scripts: &[&str], envs: &[Vec<(&str, String)>]) -> Vec<LineChild> {
    let id = get_unique_id().expect("unique id");
    let n = scripts.len();
    (0..n)
        .map(|r| {
            let mut cmd = clean_child(&[], "b4_child_entry", [("OXCCL_B4_SCRIPT", scripts[r])]);
            cmd.env("OXCCL_B4_RANK", r.to_string())
                .env("OXCCL_B4_NRANKS", n.to_string())
                .env("OXCCL_B4_ID", hex(&id.to_bytes()))
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "30");
            for (k, v) in &envs[r] {
                cmd.env(k, v);
            }
            LineChild::start(&mut cmd)
        })
        .collect()
}

/// Waits for every rank until `limit` from now; each rank's (success, output).
fn finish(ranks: &mut [LineChild], limit: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + limit;
    ranks.iter_mut().map(|r| r.wait(deadline)).collect()
}

/// The `STEP` lines of `out`, without their timings.
fn steps(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.find("STEP ").map(|i| &l[i + 5..]))
        .map(|l| match l.rfind(" OK ") {
            Some(i) if l.ends_with(" ms") => l[..i + 3].to_string(),
            _ => l.to_string(),
        })
        .collect()
}

fn host_env(host: String) -> Vec<(&'static str, String)> {
    vec![("OXCCL_HOSTID", host)]
}

fn show(outs: &[(bool, String)]) -> String {
    outs.iter()
        .enumerate()
        .map(|(r, (ok, o))| format!("--- rank {r} (ok {ok}):\n{o}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn mixed_env(n: usize, per_host: usize, tag: &str) -> Vec<Vec<(&'static str, String)>> {
    (0..n)
        .map(|r| host_env(format!("{tag}-h{}", r / per_host)))
        .collect()
}

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

fn topo_path(f: &str) -> String {
    common::topo::fixture(f).to_string_lossy().into_owned()
}

/// Runs `scripts` with envs; returns outputs, asserting nothing.
fn run_quiet(scripts: &[&str], envs: &[Vec<(&'static str, String)>], limit: Duration) -> Vec<(bool, String)> {
    let mut ranks = start(scripts, envs);
    finish(&mut ranks, limit)
}

/// The rank killed on a mixed SHM+NET ring may be any rank, on 2 hosts × 2 ranks and on 3 hosts
/// × 2 ranks (net_transport.rs kills rank 2 of 4 only): every survivor's loop ends with a remote
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
            let prefix = format!("loop ERR RemoteError: remote error: rank {r}: rank ");
            assert!(
                st[1].starts_with(&prefix)
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
            st[3].starts_with(&format!("async ERR RemoteError: remote error: rank {r}: rank "))
                && st[3].contains(" of this communicator aborted"),
            "rank {r}: {st:?}"
        );
        assert_eq!(st[4], "destroy OK", "rank {r}: {st:?}");
    }
    // Rank 0 shares rank 1's host: its line names rank 1 itself.
    assert!(steps(&outs[0].1)[3].contains("rank 0: rank 1 of this communicator aborted"));
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

use common::topo::MESH_RINGS;

/// `ring` rotated to start at `rank` (NCCL's `userRanks` of `rank`).
fn rotate(ring: &[usize], rank: usize) -> Vec<usize> {
    let i = ring.iter().position(|&r| r == rank).unwrap();
    ring[i..].iter().chain(&ring[..i]).copied().collect()
}

/// The `RINGS` line a rank prints for `rings` ([`b4_child_entry`]'s `rings` step).
fn rings_line(rank: usize, rings: &[Vec<usize>]) -> String {
    let r: Vec<String> = rings.iter().map(|x| format!("{:?}", rotate(x, rank))).collect();
    format!("RINGS rank {rank} nch {} {}", rings.len(), r.join(" "))
}

/// The mesh's per-channel rings with ranks as separate processes (ring_order.rs uses threads),
/// for NCCL_MAX_NCHANNELS 1, 5, 8 and 16 (channels past 6 repeat the searched ones) and each
/// protocol: every rank reports the searched rings, and AllReduce, AllGather, ReduceScatter,
/// Broadcast and Reduce (every root) are exact. With the ranks on two hosts of two (the 4-GPU
/// file fits no node of 2), or with one rank given another topology file, every rank keeps rank
/// order — host-grouped (0 2 1 3) when the hosts interleave — and stays exact.
#[test]
fn mesh_rings_per_channel_with_ranks_as_processes() {
    let script = "rings;ar 1;ar 200003;coll 1;coll 70001;destroy";
    let want_steps = [
        "init OK",
        "rings OK",
        "ar 1 OK",
        "ar 200003 OK",
        "coll 1 OK",
        "coll 70001 OK",
        "destroy OK",
    ];
    let run = |nch: usize, proto: &str, hosts: [usize; 4], files: [&str; 4], want: &[Vec<usize>]| {
        let envs: Vec<_> = (0..4)
            .map(|r| {
                let mut e = host_env(format!("mesh-h{}", hosts[r]));
                e.push(("NCCL_TOPO_FILE", topo_path(files[r])));
                e.push(("NCCL_MAX_NCHANNELS", nch.to_string()));
                e.push(("NCCL_PROTO", proto.to_string()));
                e
            })
            .collect();
        let outs = run_quiet(&[script; 4], &envs, Duration::from_secs(120));
        for (r, (ok, out)) in outs.iter().enumerate() {
            let what = format!("nch {nch} {proto} hosts {hosts:?} files {files:?} rank {r}");
            assert!(*ok, "{what}:\n{out}");
            assert_eq!(steps(out), want_steps, "{what}:\n{out}");
            let line = rings_line(r, want);
            assert!(out.contains(&line), "{what}: no {line:?} in\n{out}");
        }
    };
    let mesh = "nvlink-mesh-4gpu-topo.xml";
    for proto in ["Simple", "LL", "LL128"] {
        for nch in [1, 5, 8, 16] {
            let want: Vec<Vec<usize>> = (0..nch).map(|c| MESH_RINGS[c % 6].to_vec()).collect();
            run(nch, proto, [0; 4], [mesh; 4], &want);
        }
    }
    let order = vec![vec![0, 1, 2, 3]; 8];
    run(8, "Simple", [0, 0, 1, 1], [mesh; 4], &order);
    // Interleaved hosts without a fitting topology: the ring visits each host's ranks together.
    run(8, "LL", [0, 1, 0, 1], [mesh; 4], &vec![vec![0, 2, 1, 3]; 8]);
    run(
        8,
        "Simple",
        [0; 4],
        [mesh, "pcie-8gpu-interleaved-topo.xml", mesh, mesh],
        &order,
    );
}

/// NCCL_P2P_LEVEL on CPU ranks (only CUDA ranks apply it): a value that is not a level, on one
/// rank, fails that rank's init with InvalidArgument naming the variable and the accepted
/// values, and every other rank's with a remote error naming that rank and the same message (on
/// one host and on two); valid levels, different on each rank, change nothing (exact results).
#[test]
fn p2p_level_on_cpu_ranks() {
    let accepted = "(accepted: LOC, NVL, NVB, C2C, PIX, PXB, PXN, P2C, PHB, SYS, or a legacy integer 0-5)";
    let script = "ar 4099;coll 1025;destroy";
    for hosts in [[0, 0, 0, 0], [0, 0, 1, 1]] {
        for (bad_rank, bad) in [(1, "sys"), (3, "NET"), (0, "-1")] {
            let envs: Vec<_> = (0..4)
                .map(|r| {
                    let mut e = host_env(format!("p2p-h{}", hosts[r]));
                    if r == bad_rank {
                        e.push(("NCCL_P2P_LEVEL", bad.to_string()));
                    }
                    e
                })
                .collect();
            let t = Instant::now();
            let outs = run_quiet(&[script; 4], &envs, Duration::from_secs(60));
            let msg = format!("invalid argument: NCCL_P2P_LEVEL=\"{bad}\" is not a P2P level {accepted}");
            for (r, (ok, out)) in outs.iter().enumerate() {
                let want = if r == bad_rank {
                    format!("init ERR InvalidArgument: {msg}")
                } else {
                    format!(
                        "init ERR RemoteError: remote error: rank {r}: rank {bad_rank} cannot initialize (its \
                         settings or device): {msg}"
                    )
                };
                assert!(*ok, "rank {r}:\n{out}");
                assert_eq!(steps(out), [want], "hosts {hosts:?} rank {r}");
            }
            assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
        }
        let levels = ["LOC", "99", " PHB ", "PXN"];
        let envs: Vec<_> = (0..4)
            .map(|r| {
                let mut e = host_env(format!("p2p-h{}", hosts[r]));
                e.push(("NCCL_P2P_LEVEL", levels[r].to_string()));
                e
            })
            .collect();
        let outs = run_quiet(&[script; 4], &envs, Duration::from_secs(60));
        for (r, (ok, out)) in outs.iter().enumerate() {
            assert!(*ok, "rank {r}:\n{out}");
            assert_eq!(
                steps(out),
                ["init OK", "ar 4099 OK", "coll 1025 OK", "destroy OK"],
                "hosts {hosts:?} rank {r}:\n{out}"
            );
        }
    }
}
