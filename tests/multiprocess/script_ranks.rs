//! Ranks as processes of this binary that run a script of steps (`child_script`): init_rank on
//! `Device::Cpu(rank)`, then exact collectives, sleeps, async-error checks, abort, destroy, ring
//! reports and collectives looped until an error, one `STEP` line each, which the parent reads.
//! Every child is killed at a deadline. Used by the `net_failures` and `init_rank` tests.
use crate::common::child::{self, LineChild, log_to_stdout};
use crate::common::topo::rotate;
use crate::common::{self, unique_id};
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

/// The byte `i` rank `from` sends rank `to` in the point-to-point steps.
fn p2p_byte(from: usize, to: usize, i: usize) -> u8 {
    ((i as u32).wrapping_mul(131) ^ (from as u32 * 37 + to as u32 * 11)) as u8
}

/// Point-to-point, exact: a send to rank + 1 and a receive from rank − 1 of `count` bytes in
/// one group, then an all-to-all of `count` bytes per peer. `Ok(list of wrong results)`.
fn p2p_exact(comm: &Comm, count: usize) -> oxccl::Result<Vec<String>> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let mut bad = Vec::new();
    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    let send = dev.alloc(count.max(1) * n)?;
    send.write(0, &(0..count).map(|i| p2p_byte(r, to, i)).collect::<Vec<_>>())?;
    let recv = dev.alloc(count.max(1) * n)?;
    recv.fill(0x5a)?;
    oxccl::group_start()?;
    comm.send(send.slice(0, count)?, count, DataType::U8, to, &stream)?;
    comm.recv(recv.slice(0, count)?, count, DataType::U8, from, &stream)?;
    oxccl::group_end()?;
    stream.synchronize()?;
    if recv.to_vec()?[..count] != (0..count).map(|i| p2p_byte(from, r, i)).collect::<Vec<_>>()[..] {
        bad.push(format!("send/recv {count}"));
    }
    send.write(0, &(0..n).flat_map(|p| (0..count).map(move |i| p2p_byte(r, p, i))).collect::<Vec<_>>())?;
    recv.fill(0x5a)?;
    comm.all_to_all(send.slice(0, n * count)?, recv.slice(0, n * count)?, count, DataType::U8, &stream)?;
    stream.synchronize()?;
    let want: Vec<u8> = (0..n).flat_map(|p| (0..count).map(move |i| p2p_byte(p, r, i))).collect();
    if recv.to_vec()?[..n * count] != want[..] {
        bad.push(format!("all_to_all {count}"));
    }
    Ok(bad)
}

/// A send of `count` bytes to rank + 1 ([`p2p_byte`]s), queued on a stream of its own and not
/// waited for: the stream and the buffer, which must outlive it.
fn queue_send(comm: &Comm, count: usize) -> oxccl::Result<(oxccl::Stream, oxccl::DeviceBuffer)> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let send = dev.alloc(count)?;
    send.write(0, &(0..count).map(|i| p2p_byte(r, (r + 1) % n, i)).collect::<Vec<_>>())?;
    comm.send(&send, count, DataType::U8, (r + 1) % n, &stream)?;
    Ok((stream, send))
}

/// A receive of `count` bytes from rank − 1, waited for: `Ok(true)` when they are the bytes
/// [`queue_send`] sent.
fn recv_exact(comm: &Comm, count: usize) -> oxccl::Result<bool> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let recv = dev.alloc(count)?;
    recv.fill(0x5a)?;
    let from = (r + n - 1) % n;
    comm.recv(&recv, count, DataType::U8, from, &stream)?;
    stream.synchronize()?;
    Ok(recv.to_vec()? == (0..count).map(|i| p2p_byte(from, r, i)).collect::<Vec<_>>())
}

/// Every child rank. `OXCCL_CHILD_SCRIPT` is a `;` list of steps: `ar COUNT` (exact AllReduce),
/// `coll COUNT` (AllGather, ReduceScatter, Broadcast and Reduce from every root, exact), `p2p
/// COUNT` (send/recv around the ring and all-to-all, exact), `send COUNT` (a send of COUNT bytes
/// to rank + 1, queued and not waited for), `recv COUNT` (a receive of COUNT bytes from rank − 1,
/// waited for, exact), `sleep
/// MS`, `async` (get_async_error), `abort`, `destroy`, `rings` (prints every channel's ring),
/// `loop` (AllReduce until an error). Prints `STEP <step> OK`, `STEP <step> ERR <code>: <error>` or
/// `STEP <step> WRONG ...`, each with the milliseconds it took.
#[test]
#[ignore = "child process of the tests of net_failures and init_rank"]
fn child_script() {
    child::enter();
    let script = child::env_var("OXCCL_CHILD_SCRIPT");
    log_to_stdout("oxccl::transport=info,oxccl::proxy=debug,oxccl::init=warn");
    let (rank, nranks, id) = child::rank();
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
    // The streams and buffers of queued sends, kept until the child ends.
    let mut queued = Vec::new();
    for step in script.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (cmd, arg) = step.split_once(' ').unwrap_or((step, ""));
        let t = Instant::now();
        let c = comm.as_ref().expect("a step after destroy");
        let res: Result<Option<String>, oxccl::Error> = match cmd {
            "ar" => all_reduce_exact(c, arg.parse().unwrap())
                .map(|ok| (!ok).then(|| "result differs".to_string())),
            "coll" => other_collectives_exact(c, arg.parse().unwrap())
                .map(|b| (!b.is_empty()).then(|| b.join(", "))),
            "p2p" => p2p_exact(c, arg.parse().unwrap()).map(|b| (!b.is_empty()).then(|| b.join(", "))),
            "send" => queue_send(c, arg.parse().unwrap()).map(|q| {
                queued.push(q);
                None
            }),
            "recv" => recv_exact(c, arg.parse().unwrap()).map(|ok| (!ok).then(|| "received bytes differ".to_string())),
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
pub fn start(scripts: &[&str], envs: &[Vec<(&str, String)>]) -> Vec<LineChild> {
    let id = unique_id();
    let n = scripts.len();
    (0..n)
        .map(|r| {
            let mut cmd =
                child::command_with(&child_entry!(child_script), [("OXCCL_CHILD_SCRIPT", scripts[r])]);
            child::rank_env(&mut cmd, r, n, &id).env("OXCCL_BOOTSTRAP_TIMEOUT", "30");
            for (k, v) in &envs[r] {
                cmd.env(k, v);
            }
            LineChild::start(&mut cmd)
        })
        .collect()
}

/// Rank `rank` of an `nranks`-rank communicator whose other ranks never start, with an empty
/// script and the extra environment `env`: it waits in the bootstrap until
/// `OXCCL_BOOTSTRAP_TIMEOUT` (`bootstrap_timeout` seconds), then prints `STEP init ERR ...`.
pub fn start_alone(rank: usize, nranks: usize, bootstrap_timeout: &str, env: &[(&str, String)]) -> std::process::Child {
    let id = unique_id();
    let mut cmd = child::command_with(&child_entry!(child_script), [("OXCCL_CHILD_SCRIPT", "")]);
    child::rank_env(&mut cmd, rank, nranks, &id).env("OXCCL_BOOTSTRAP_TIMEOUT", bootstrap_timeout);
    for (k, v) in env {
        cmd.env(k, v);
    }
    child::spawn(&mut cmd)
}

/// Waits for every rank until `limit` from now; each rank's (success, output).
pub fn finish(ranks: &mut [LineChild], limit: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + limit;
    ranks.iter_mut().map(|r| r.wait(deadline)).collect()
}

/// The `STEP` lines of `out`, without their timings.
pub fn steps(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.find("STEP ").map(|i| &l[i + 5..]))
        .map(|l| match l.rfind(" OK ") {
            Some(i) if l.ends_with(" ms") => l[..i + 3].to_string(),
            _ => l.to_string(),
        })
        .collect()
}

pub fn host_env(host: String) -> Vec<(&'static str, String)> {
    vec![("OXCCL_HOSTID", host)]
}

pub fn show(outs: &[(bool, String)]) -> String {
    outs.iter()
        .enumerate()
        .map(|(r, (ok, o))| format!("--- rank {r} (ok {ok}):\n{o}"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn mixed_env(n: usize, per_host: usize, tag: &str) -> Vec<Vec<(&'static str, String)>> {
    (0..n)
        .map(|r| host_env(format!("{tag}-h{}", r / per_host)))
        .collect()
}

pub fn topo_path(f: &str) -> String {
    common::topo::fixture(f).to_string_lossy().into_owned()
}

/// Runs `scripts` with envs; returns outputs, asserting nothing.
pub fn run_quiet(
    scripts: &[&str],
    envs: &[Vec<(&'static str, String)>],
    limit: Duration,
) -> Vec<(bool, String)> {
    let mut ranks = start(scripts, envs);
    finish(&mut ranks, limit)
}

/// The `RINGS` line a rank prints for `rings` ([`child_script`]'s `rings` step).
pub fn rings_line(rank: usize, rings: &[Vec<usize>]) -> String {
    let r: Vec<String> = rings.iter().map(|x| format!("{:?}", rotate(x, rank))).collect();
    format!("RINGS rank {rank} nch {} {}", rings.len(), r.join(" "))
}
