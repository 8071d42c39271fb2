//! The NET proxy between CPU-target ranks in separate processes (`NCCL_P2P_DISABLE=1`,
//! `NCCL_SHM_DISABLE=1`) on the LL and LL128 protocols: it completes a step once the lines the
//! kernel announced in its tagged step-sizes entry have gone, for odd counts that are no whole
//! number of lines, with the protocols mixed back to back on one communicator (the step-sizes
//! entries are shared by the protocols), across the LL flag / step tag wrap
//! (`OXCCL_TEST_INITIAL_STEP`) and with the smallest FIFOs. Every result exact.
use crate::common::child::{self, LineChild, log_to_stdout};
use crate::common::pattern::{all_reduce_want, input, sum_elem, u32_bytes};
use crate::common::unique_id;
use oxccl::{Comm, DataType, Device, DeviceBuffer, Func, Proto, RedOp, Stream};
use std::time::{Duration, Instant};

/// Out-of-place AllReduce u32 Sum of `count` elements (salt `salt`) on `stream`, queued only.
fn queue_all_reduce(
    comm: &Comm,
    stream: &Stream,
    count: usize,
    salt: u32,
) -> oxccl::Result<(DeviceBuffer, DeviceBuffer)> {
    let dev = comm.device();
    let send = dev.alloc(count * 4)?;
    send.write(0, &input(comm.rank(), count, salt))?;
    let recv = dev.alloc(count * 4)?;
    recv.write(0, &vec![0x5a; count * 4])?;
    comm.all_reduce(&send, &recv, count, DataType::U32, RedOp::Sum, stream)?;
    Ok((send, recv))
}

/// Whether a finished [`queue_all_reduce`] left the sum in `recv` and `send` unchanged.
fn all_reduce_ok(
    comm: &Comm,
    bufs: &(DeviceBuffer, DeviceBuffer),
    count: usize,
    salt: u32,
) -> oxccl::Result<bool> {
    Ok(bufs.1.to_vec()? == all_reduce_want(comm.nranks(), count, salt)
        && bufs.0.to_vec()? == input(comm.rank(), count, salt))
}

/// AllGather u32, ReduceScatter u32 Sum, Broadcast u8 and Reduce u32 Sum from every root, each of
/// `count` elements per rank, exact (expected values from [`elem`] / [`sum_elem`]: AllGather's
/// out is the ranks' inputs in rank order; ReduceScatter's rank r gets elements r·count.. of the
/// sum; Broadcast's (31 i + root) mod 256; Reduce's root the sum). The wrong ones by name.
fn other_collectives(comm: &Comm, count: usize) -> oxccl::Result<Vec<String>> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let s = dev.new_stream()?;
    let mut bad = Vec::new();
    let salt = 0x5000 + count as u32;
    let send = dev.alloc(count * 4)?;
    send.write(0, &input(r, count, salt))?;
    let recv = dev.alloc(count * 4 * n)?;
    comm.all_gather(&send, &recv, count, DataType::U32, &s)?;
    s.synchronize()?;
    if recv.to_vec()? != (0..n).flat_map(|q| input(q, count, salt)).collect::<Vec<u8>>() {
        bad.push(format!("AllGather {count}"));
    }
    let send = dev.alloc(count * n * 4)?;
    send.write(0, &input(r, count * n, salt))?;
    let recv = dev.alloc(count * 4)?;
    comm.reduce_scatter(&send, &recv, count, DataType::U32, RedOp::Sum, &s)?;
    s.synchronize()?;
    if recv.to_vec()? != u32_bytes((0..count).map(|i| sum_elem(n, r * count + i, salt))) {
        bad.push(format!("ReduceScatter {count}"));
    }
    for root in 0..n {
        let want: Vec<u8> = (0..count).map(|i| (i * 31 + root) as u8).collect();
        let out = dev.alloc(count)?;
        let src = dev.alloc(count)?;
        src.write(0, &want)?;
        comm.broadcast(
            (r == root).then(|| (&src).into()),
            &out,
            count,
            DataType::U8,
            root,
            &s,
        )?;
        s.synchronize()?;
        if out.to_vec()? != want {
            bad.push(format!("Broadcast {count} root {root}"));
        }
        let send = dev.alloc(count * 4)?;
        send.write(0, &input(r, count, salt + root as u32))?;
        let recv = dev.alloc(count * 4)?;
        recv.write(0, &vec![0x5a; count * 4])?;
        comm.reduce(
            &send,
            (r == root).then(|| (&recv).into()),
            count,
            DataType::U32,
            RedOp::Sum,
            root,
            &s,
        )?;
        s.synchronize()?;
        let want = if r == root {
            all_reduce_want(n, count, salt + root as u32)
        } else {
            vec![0x5a; count * 4]
        };
        if recv.to_vec()? != want {
            bad.push(format!("Reduce {count} root {root}"));
        }
    }
    Ok(bad)
}

/// For each protocol, the first of a list of AllReduce u32 counts (odd ones, not multiples of an
/// LL or LL128 line) that the communicator runs on it.
fn counts_by_proto(comm: &Comm) -> oxccl::Result<Vec<(Proto, usize)>> {
    let mut found: Vec<(Proto, usize)> = Vec::new();
    for count in [
        1usize, 3, 7, 61, 253, 509, 1021, 1531, 2047, 3001, 4093, 8191, 16_381, 65_521, 262_139,
    ] {
        let Some(c) = comm.choice_for(Func::AllReduce, count, DataType::U32)? else {
            continue;
        };
        if !found.iter().any(|(p, _)| *p == c.proto) {
            found.push((c.proto, count));
        }
    }
    Ok(found)
}

/// Every NET child rank. `OXCCL_CHILD_SCRIPT` is a `;` list of steps: `ar COUNT` (exact
/// out-of-place AllReduce), `coll COUNT` (the other collectives, exact), `mix ROUNDS` (AllReduces
/// whose sizes pick LL, Simple, LL128, LL, LL128, Simple in turn, ROUNDS times, all queued back to
/// back on one stream before one synchronize, each exact), `wrap CALLS` (CALLS AllReduces cycling
/// over 1, 3, 7 elements and the counts that pick each protocol, each synchronized and exact).
/// Prints `STEP <step> OK`, `STEP <step> WRONG ...` or `STEP <step> ERR ...`, and `PROTOS
/// <proto>=<count> ...` (what the sizes pick).
#[test]
#[ignore = "child process of the tests of this module"]
fn child_net_script() {
    child::enter();
    let script = child::env_var("OXCCL_CHILD_SCRIPT");
    log_to_stdout("oxccl::transport=info,oxccl::proxy=warn,oxccl::init=warn");
    let (rank, nranks, id) = child::rank();
    let comm = match Comm::init_rank(nranks, &id, rank, Device::Cpu(rank)) {
        Ok(c) => c,
        Err(e) => {
            println!("STEP init ERR {:?}: {e}", e.code());
            return;
        }
    };
    println!("STEP init OK nch {}", comm.nchannels());
    let stream = comm.device().new_stream().unwrap();
    let protos = counts_by_proto(&comm).unwrap();
    println!(
        "PROTOS {}",
        protos
            .iter()
            .map(|(p, c)| format!("{}={c}", p.name()))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let count_of = |p: Proto| protos.iter().find(|(q, _)| *q == p).map(|(_, c)| *c);
    for step in script.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (cmd, arg) = step.split_once(' ').unwrap_or((step, ""));
        let arg: usize = arg.parse().unwrap();
        let res: oxccl::Result<Option<String>> = (|| match cmd {
            "ar" => {
                let b = queue_all_reduce(&comm, &stream, arg, arg as u32)?;
                stream.synchronize()?;
                Ok((!all_reduce_ok(&comm, &b, arg, arg as u32)?).then(|| "result differs".into()))
            }
            "coll" => other_collectives(&comm, arg).map(|b| (!b.is_empty()).then(|| b.join(", "))),
            "mix" => {
                let order = [
                    Proto::Ll,
                    Proto::Simple,
                    Proto::Ll128,
                    Proto::Ll,
                    Proto::Ll128,
                    Proto::Simple,
                ];
                let counts: Vec<usize> = order.iter().filter_map(|&p| count_of(p)).collect();
                let mut queued = Vec::new();
                for k in 0..arg * counts.len() {
                    let count = counts[k % counts.len()];
                    let salt = 7 * k as u32 + 1;
                    queued.push((queue_all_reduce(&comm, &stream, count, salt)?, count, salt));
                }
                stream.synchronize()?;
                let bad: Vec<String> = queued
                    .iter()
                    .enumerate()
                    .filter(|(_, (b, count, salt))| !all_reduce_ok(&comm, b, *count, *salt).unwrap_or(false))
                    .map(|(k, (_, count, _))| format!("call {k} ({count} elements)"))
                    .collect();
                Ok((!bad.is_empty()).then(|| bad.join(", ")))
            }
            "wrap" => {
                let mut counts = vec![1usize, 3, 7];
                counts.extend(protos.iter().map(|(_, c)| *c));
                let mut bad = Vec::new();
                for k in 0..arg {
                    let count = counts[k % counts.len()];
                    let salt = 11 * k as u32 + 3;
                    let b = queue_all_reduce(&comm, &stream, count, salt)?;
                    stream.synchronize()?;
                    if !all_reduce_ok(&comm, &b, count, salt)? {
                        bad.push(format!("call {k} ({count} elements)"));
                    }
                }
                Ok((!bad.is_empty()).then(|| bad.join(", ")))
            }
            other => panic!("unknown step {other}"),
        })();
        match res {
            Ok(None) => println!("STEP {step} OK"),
            Ok(Some(w)) => println!("STEP {step} WRONG {w}"),
            Err(e) => println!("STEP {step} ERR {:?}: {e}", e.code()),
        }
    }
    drop(stream);
    match comm.destroy() {
        Ok(()) => println!("STEP destroy OK"),
        Err(e) => println!("STEP destroy ERR {:?}: {e}", e.code()),
    }
}

/// Runs `n` NET-only ranks (NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1) of the script `script` with
/// `env`, each killed after `limit`; asserts every rank printed `STEP <s> OK` for every step
/// (init and destroy included) and that its rings go over NET; returns the outputs.
fn net_run(n: usize, script: &str, env: &[(&str, &str)], limit: Duration) -> Vec<String> {
    let id = unique_id();
    let mut ranks: Vec<LineChild> = (0..n)
        .map(|r| {
            let mut cmd =
                child::command_with(&child_entry!(child_net_script), [("OXCCL_CHILD_SCRIPT", script)]);
            child::rank_env(&mut cmd, r, n, &id)
                .env("OXCCL_BOOTSTRAP_TIMEOUT", "30")
                .env("NCCL_P2P_DISABLE", "1")
                .env("NCCL_SHM_DISABLE", "1")
                .envs(env.iter().copied());
            LineChild::start(&mut cmd)
        })
        .collect();
    let deadline = Instant::now() + limit;
    let outs: Vec<(bool, String)> = ranks.iter_mut().map(|r| r.wait(deadline)).collect();
    let all = outs
        .iter()
        .enumerate()
        .map(|(r, (ok, o))| format!("--- rank {r} (ok {ok}):\n{o}"))
        .collect::<Vec<_>>()
        .join("\n");
    let ctx = format!("{n} ranks, env {env:?}, script {script:?}");
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(*ok, "{ctx}: rank {r} failed:\n{all}");
        assert!(out.contains("via NET"), "{ctx}: rank {r} has no NET ring:\n{all}");
        for step in ["init".to_string(), "destroy".to_string()].into_iter().chain(
            script
                .split(';')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
        ) {
            let ok_line = if step == "init" {
                "STEP init OK".to_string()
            } else {
                format!("STEP {step} OK")
            };
            assert!(
                out.lines()
                    .any(|l| l == ok_line || (step == "init" && l.starts_with("STEP init OK"))),
                "{ctx}: rank {r}: step {step:?} did not succeed:\n{all}"
            );
        }
    }
    if std::env::var("OXCCL_TEST_SHOW").is_ok() {
        eprintln!("{all}");
    }
    outs.into_iter().map(|(_, o)| o).collect()
}

/// The `PROTOS` line of a child's output, as (protocol name, count) pairs.
fn protos_line(out: &str) -> Vec<(String, usize)> {
    let line = out.lines().find_map(|l| l.strip_prefix("PROTOS ")).unwrap_or("");
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(p, c)| (p.to_string(), c.parse().unwrap()))
        .collect()
}

/// LL and LL128 forced over NET, 2 and 3 ranks: AllReduce of 1, 3, 7, 13 and larger odd counts
/// (not multiples of an LL line's 2 u32 or an LL128 line's 30), and the other collectives at odd
/// counts, all exact.
#[test]
fn ll_and_ll128_odd_counts_over_net_are_exact() {
    let script = "ar 1;ar 3;ar 7;ar 13;ar 1001;ar 4099;ar 65539;ar 1048573;coll 1;coll 3;coll 7;coll 1001";
    for (n, proto) in [(2, "LL"), (2, "LL128"), (3, "LL128"), (3, "LL")] {
        let outs = net_run(n, script, &[("NCCL_PROTO", proto)], Duration::from_secs(60));
        assert_eq!(
            protos_line(&outs[0])
                .iter()
                .map(|(p, _)| p.as_str())
                .collect::<Vec<_>>(),
            [proto],
            "NCCL_PROTO={proto}: {}",
            outs[0]
        );
    }
}

/// Protocols mixed on the same NET connections: with every protocol allowed, sizes that pick LL,
/// Simple, LL128, LL, LL128, Simple in turn, queued back to back 10 times before one synchronize
/// (the step-sizes entries are shared by the protocols: Simple stores bytes, LL and LL128 tagged
/// line counts), then the same sizes synchronized one by one. 2 and 3 ranks; all exact.
#[test]
fn protocols_mixed_back_to_back_over_net_are_exact() {
    for n in [2, 3] {
        let outs = net_run(n, "mix 10;wrap 24;mix 3", &[], Duration::from_secs(60));
        let ps: Vec<String> = protos_line(&outs[0]).into_iter().map(|(p, _)| p).collect();
        for p in ["LL", "LL128", "Simple"] {
            assert!(ps.iter().any(|q| q == p), "{n} ranks: no size picks {p}: {ps:?}");
        }
    }
}

/// Case C11 (B) over NET: connections start 40 steps below the LL flag period 2^31 − 1 (where the
/// proxy's step tag `step mod (2^31 − 1) + 1` wraps too), below 2^32 and below twice the period;
/// 160 AllReduces each exact, protocols mixed (and LL, LL128 forced at the first start).
#[test]
fn ll_flag_and_step_tag_wrap_over_net() {
    let period = (1u64 << 31) - 1;
    let runs: [(u64, Option<&str>); 5] = [
        (period - 40, None),
        (period - 40, Some("LL")),
        (period - 40, Some("LL128")),
        ((1 << 32) - 40, None),
        (2 * period - 40, None),
    ];
    for (start, proto) in runs {
        let start_s = start.to_string();
        let mut env = vec![("OXCCL_TEST_INITIAL_STEP", start_s.as_str())];
        env.extend(proto.map(|p| ("NCCL_PROTO", p)));
        net_run(2, "wrap 160;mix 2", &env, Duration::from_secs(60));
    }
}

/// The smallest LL and LL128 FIFOs params accept (8 KiB: 64 LL lines, 8 LL128 lines a step) on
/// 2 channels at least, so one call is thousands of steps: connections start 300 steps below the
/// LL flag period and a 1 M-element call crosses the wrap (and its cleaning steps, which write
/// whole slots) mid-call; then mixed and synchronized calls. LL, LL128 forced and mixed (3 ranks
/// too); all exact.
#[test]
fn smallest_fifos_many_steps_across_the_wrap_over_net() {
    let start = ((1u64 << 31) - 1 - 300).to_string();
    let base = [
        ("OXCCL_TEST_INITIAL_STEP", start.as_str()),
        ("NCCL_LL_BUFFSIZE", "8200"),
        ("NCCL_LL128_BUFFSIZE", "8192"),
        ("NCCL_MIN_NCHANNELS", "2"),
    ];
    for (n, proto) in [(2, Some("LL")), (2, Some("LL128")), (3, None)] {
        let mut env = base.to_vec();
        env.extend(proto.map(|p| ("NCCL_PROTO", p)));
        net_run(
            n,
            "ar 1048573;ar 65539;mix 3;wrap 40;coll 1001",
            &env,
            Duration::from_secs(60),
        );
    }
}
