//! The SHM and NET transports between CUDA ranks: 2 processes × 1 GPU
//! each, bootstrapped through one unique id, with `NCCL_P2P_DISABLE=1` (the ranks connect through
//! SHM: FIFOs in a `/dev/shm` segment registered with CUDA in both processes) or with
//! `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` (NET: pinned, device-mapped staging FIFOs driven by the
//! proxy thread over loopback sockets). Every collective — AllReduce, Broadcast, AllGather,
//! ReduceScatter, Reduce — in place and out of place, into poisoned outputs, with exact results;
//! under the default protocol choice (which must not pick LL128 through host memory) and forced
//! LL and Simple; then a send/recv pair and an all-to-all; then an AllReduce and a send/recv
//! group captured into a graph and replayed. The GPU tests print `SKIPPED` without 2 GPUs.
//!
//! A too-small `/dev/shm` (a private tmpfs of 1 MiB in a mount namespace shared by both ranks) is
//! an error naming the bytes needed and the path, on the CPU target (every run) and for CUDA SHM.
use crate::common::child::{self, log_to_stdout, wait_all, wait_with_deadline};
use crate::common::unique_id;
use oxccl::bootstrap::UniqueId;
use oxccl::{Comm, DataType, Device, Proto, RedOp, Stream};
use std::process::Command;
use std::time::{Duration, Instant};

const NRANKS: usize = 2;
const ENV_RANK: &str = "OXCCL_CHILD_RANK";
const ENV_ID: &str = "OXCCL_CHILD_ID";
const ENV_CPU: &str = "OXCCL_CHILD_CPU";
/// How long one group of child ranks may take (JIT, 64-channel setup, the whole matrix), unless
/// `OXCCL_TEST_GROUP_LIMIT_S` says otherwise (a short limit shows where a slow run is: the
/// children's output, printed when they are killed, ends at the call they were in).
fn group_limit() -> Duration {
    let s = std::env::var("OXCCL_TEST_GROUP_LIMIT_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    Duration::from_secs(s)
}
/// Bytes every output buffer is filled with before a call (0xA5A5A5A5 as f32 is about -2.9e-16,
/// never one of the expected values, which are all non-negative integers).
const POISON: u8 = 0xA5;

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Rank `r`'s value at index `i`: (r + 1) × (i mod 1000), an integer below 2^24, so the sum over
/// 2 ranks, 3 × (i mod 1000), is exact in f32.
fn val(r: usize, i: usize) -> f32 {
    ((r + 1) * (i % 1000)) as f32
}

/// The sum over all ranks of [`val`] at `i`: (1 + 2) × (i mod 1000) for 2 ranks.
fn sum(i: usize) -> f32 {
    (NRANKS * (NRANKS + 1) / 2 * (i % 1000)) as f32
}

/// The broadcast data: distinct per index, exact in f32.
fn bval(i: usize) -> f32 {
    (i % 4099) as f32 + 7.0
}

/// Element counts: one element, below a line, odd sizes, several chunks of every protocol.
const COUNTS: &[usize] = &[1, 17, 1023, 65_537, (1 << 20) + 3, (4 << 20) + 1];

/// Compares `want.len()` f32 elements of `dev` from element `off` with `want`; a failure line
/// naming `what` when they differ.
fn check(bad: &mut Vec<String>, what: String, dev: &oxccl::DeviceBuffer, off: usize, want: &[f32]) {
    let mut got = vec![0u8; want.len() * 4];
    dev.read(off * 4, &mut got).unwrap();
    let got = to_f32s(&got);
    let wrong: Vec<usize> = (0..want.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if let Some(&first) = wrong.first() {
        bad.push(format!(
            "{what}: {} of {} elements wrong, first at {first}: got {} want {}",
            wrong.len(),
            want.len(),
            got[first],
            want[first]
        ));
    }
}

/// Runs every collective at every count, out of place and in place, and returns the failures
/// (empty: all exact). Prints each call's protocol as `CHOICE <func> <count> <proto>`.
fn run_matrix(comm: &Comm, stream: &Stream) -> Vec<String> {
    let (r, n) = (comm.rank(), comm.nranks());
    let dev = comm.device();
    let mut bad = Vec::new();
    let choice = |what: &str, count: usize| {
        let c = comm.last_choice().expect("a choice after a call");
        println!("CHOICE {what} {count} {:?}", c.proto);
    };
    for &count in COUNTS {
        let input: Vec<f32> = (0..count).map(|i| val(r, i)).collect();
        let sums: Vec<f32> = (0..count).map(sum).collect();
        // AllReduce: every rank gets the sums.
        let send = dev.alloc(count * 4).unwrap();
        let recv = dev.alloc(count * 4).unwrap();
        send.write(0, &to_bytes(&input)).unwrap();
        recv.fill(POISON).unwrap();
        comm.all_reduce(&send, &recv, count, DataType::F32, RedOp::Sum, stream)
            .unwrap();
        stream.synchronize().unwrap();
        choice("AllReduce", count);
        check(
            &mut bad,
            format!("rank {r} AllReduce {count} out-of-place"),
            &recv,
            0,
            &sums,
        );
        comm.all_reduce(&send, &send, count, DataType::F32, RedOp::Sum, stream)
            .unwrap();
        stream.synchronize().unwrap();
        check(
            &mut bad,
            format!("rank {r} AllReduce {count} in-place"),
            &send,
            0,
            &sums,
        );

        // Broadcast from rank 1 (the last): every rank gets bval.
        let root = n - 1;
        let bdata: Vec<f32> = (0..count).map(bval).collect();
        let src = dev.alloc(count * 4).unwrap();
        src.write(0, &to_bytes(&bdata)).unwrap();
        recv.fill(POISON).unwrap();
        let s = (r == root).then(|| (&src).into());
        comm.broadcast(s, &recv, count, DataType::F32, root, stream)
            .unwrap();
        stream.synchronize().unwrap();
        choice("Broadcast", count);
        check(
            &mut bad,
            format!("rank {r} Broadcast {count} out-of-place"),
            &recv,
            0,
            &bdata,
        );
        // In place: the root's buffer holds the data, the others' are poisoned.
        let inplace = dev.alloc(count * 4).unwrap();
        if r == root {
            inplace.write(0, &to_bytes(&bdata)).unwrap();
        } else {
            inplace.fill(POISON).unwrap();
        }
        let s = (r == root).then(|| (&inplace).into());
        comm.broadcast(s, &inplace, count, DataType::F32, root, stream)
            .unwrap();
        stream.synchronize().unwrap();
        check(
            &mut bad,
            format!("rank {r} Broadcast {count} in-place"),
            &inplace,
            0,
            &bdata,
        );

        // AllGather: block q holds rank q's input.
        let gathered: Vec<f32> = (0..n * count).map(|k| val(k / count, k % count)).collect();
        let all = dev.alloc(n * count * 4).unwrap();
        all.fill(POISON).unwrap();
        comm.all_gather(&send_of(&dev, &input), &all, count, DataType::F32, stream)
            .unwrap();
        stream.synchronize().unwrap();
        choice("AllGather", count);
        check(
            &mut bad,
            format!("rank {r} AllGather {count} out-of-place"),
            &all,
            0,
            &gathered,
        );
        // In place: this rank's block of the output is the input; the others are poisoned.
        all.fill(POISON).unwrap();
        all.write(r * count * 4, &to_bytes(&input)).unwrap();
        let own = all.slice(r * count * 4, count * 4).unwrap();
        comm.all_gather(own, &all, count, DataType::F32, stream).unwrap();
        stream.synchronize().unwrap();
        check(
            &mut bad,
            format!("rank {r} AllGather {count} in-place"),
            &all,
            0,
            &gathered,
        );

        // ReduceScatter: rank r gets block r of the sums over n × count elements.
        let big: Vec<f32> = (0..n * count).map(|j| val(r, j)).collect();
        let block: Vec<f32> = (0..count).map(|i| sum(r * count + i)).collect();
        let bigbuf = dev.alloc(n * count * 4).unwrap();
        bigbuf.write(0, &to_bytes(&big)).unwrap();
        recv.fill(POISON).unwrap();
        comm.reduce_scatter(&bigbuf, &recv, count, DataType::F32, RedOp::Sum, stream)
            .unwrap();
        stream.synchronize().unwrap();
        choice("ReduceScatter", count);
        check(
            &mut bad,
            format!("rank {r} ReduceScatter {count} out-of-place"),
            &recv,
            0,
            &block,
        );
        // In place: the output is this rank's block of the input.
        let own = bigbuf.slice(r * count * 4, count * 4).unwrap();
        comm.reduce_scatter(&bigbuf, own, count, DataType::F32, RedOp::Sum, stream)
            .unwrap();
        stream.synchronize().unwrap();
        check(
            &mut bad,
            format!("rank {r} ReduceScatter {count} in-place"),
            &bigbuf,
            r * count,
            &block,
        );

        // Reduce to rank 0: the root gets the sums; the others' poisoned outputs stay untouched.
        let send = send_of(&dev, &input);
        recv.fill(POISON).unwrap();
        let out = (r == 0).then(|| (&recv).into());
        comm.reduce(&send, out, count, DataType::F32, RedOp::Sum, 0, stream)
            .unwrap();
        stream.synchronize().unwrap();
        choice("Reduce", count);
        let poison = vec![f32::from_ne_bytes([POISON; 4]); count];
        let want = if r == 0 { &sums } else { &poison };
        check(
            &mut bad,
            format!("rank {r} Reduce {count} out-of-place"),
            &recv,
            0,
            want,
        );
        // In place on the root.
        let out = (r == 0).then(|| (&send).into());
        comm.reduce(&send, out, count, DataType::F32, RedOp::Sum, 0, stream)
            .unwrap();
        stream.synchronize().unwrap();
        let want = if r == 0 { &sums } else { &input };
        check(
            &mut bad,
            format!("rank {r} Reduce {count} in-place"),
            &send,
            0,
            want,
        );
        // Point-to-point: a send to the other rank and a receive from it in one group, then an
        // all-to-all of `count` elements per rank (every rank's own block is a copy).
        let peer = 1 - r;
        let send = send_of(&dev, &input);
        let recv = dev.alloc(count * 4).unwrap();
        recv.fill(POISON).unwrap();
        oxccl::group(|| -> oxccl::Result<()> {
            comm.send(&send, count, DataType::F32, peer, stream)?;
            comm.recv(&recv, count, DataType::F32, peer, stream)
        })
        .unwrap()
        .unwrap();
        stream.synchronize().unwrap();
        let theirs: Vec<f32> = (0..count).map(|i| val(peer, i)).collect();
        check(&mut bad, format!("rank {r} send/recv {count}"), &recv, 0, &theirs);
        let blocks: Vec<f32> = (0..n * count).map(|k| val(r, k) + (k / count) as f32).collect();
        let send = send_of(&dev, &blocks);
        let recv = dev.alloc(n * count * 4).unwrap();
        recv.fill(POISON).unwrap();
        comm.all_to_all(&send, &recv, count, DataType::F32, stream).unwrap();
        stream.synchronize().unwrap();
        let want: Vec<f32> = (0..n * count)
            .map(|k| {
                let (p, i) = (k / count, k % count);
                val(p, r * count + i) + r as f32
            })
            .collect();
        check(&mut bad, format!("rank {r} all_to_all {count}"), &recv, 0, &want);
        if let Err(e) = comm.get_async_error() {
            bad.push(format!("rank {r} count {count}: async error {e}"));
        }
    }
    bad.extend(run_captured(comm, stream));
    bad
}

/// An AllReduce and a group of a send to the other rank and a receive from it, captured into a
/// graph on `stream` (CUDA's stream capture; a CPU-target stream records them) and replayed
/// twice with new inputs: nothing runs at the capture, every replay is exact. Returns the
/// failures.
fn run_captured(comm: &Comm, stream: &Stream) -> Vec<String> {
    let (r, dev, count) = (comm.rank(), comm.device(), 4099);
    let peer = 1 - r;
    let mut bad = Vec::new();
    let input = dev.alloc(count * 4).unwrap();
    let (out, recv) = (dev.alloc(count * 4).unwrap(), dev.alloc(count * 4).unwrap());
    out.fill(POISON).unwrap();
    recv.fill(POISON).unwrap();
    stream.begin_capture().unwrap();
    comm.all_reduce(&input, &out, count, DataType::F32, RedOp::Sum, stream).unwrap();
    oxccl::group(|| -> oxccl::Result<()> {
        comm.send(&input, count, DataType::F32, peer, stream)?;
        comm.recv(&recv, count, DataType::F32, peer, stream)
    })
    .unwrap()
    .unwrap();
    let graph = stream.end_capture().unwrap();
    stream.synchronize().unwrap();
    let poison = vec![f32::from_ne_bytes([POISON; 4]); count];
    check(&mut bad, format!("rank {r} captured AllReduce before a replay"), &out, 0, &poison);
    for k in 1..=2 {
        let scaled = |q: usize| (0..count).map(|i| val(q, i) * k as f32).collect::<Vec<f32>>();
        input.write(0, &to_bytes(&scaled(r))).unwrap();
        out.fill(POISON).unwrap();
        recv.fill(POISON).unwrap();
        // SAFETY: the buffers and the communicator live until the synchronize below.
        unsafe { graph.launch(stream) }.unwrap();
        stream.synchronize().unwrap();
        let sums: Vec<f32> = (0..count).map(|i| sum(i) * k as f32).collect();
        check(&mut bad, format!("rank {r} captured AllReduce, replay {k}"), &out, 0, &sums);
        check(&mut bad, format!("rank {r} captured send/recv, replay {k}"), &recv, 0, &scaled(peer));
    }
    bad
}

/// A fresh device buffer holding `data`.
fn send_of(dev: &Device, data: &[f32]) -> oxccl::DeviceBuffer {
    let b = dev.alloc(data.len() * 4).unwrap();
    b.write(0, &to_bytes(data)).unwrap();
    b
}

/// One child rank: init on GPU `rank` (or CPU-target device `rank` with `OXCCL_CHILD_CPU=1`),
/// then the matrix; `init` errors are printed as `INIT-ERR rank <r>: <error>`.
#[test]
#[ignore = "child process of the tests of this module"]
fn child_rank() {
    child::enter();
    log_to_stdout("oxccl::transport=info,oxccl::init=info");
    let rank: usize = child::env_parse(ENV_RANK);
    let id = child::env_id(ENV_ID);
    let device = if std::env::var(ENV_CPU).is_ok_and(|v| v == "1") {
        Device::Cpu(rank)
    } else {
        Device::Cuda(rank)
    };
    let t = Instant::now();
    let comm = match Comm::init_rank(NRANKS, &id, rank, device) {
        Ok(c) => c,
        Err(e) => {
            println!("INIT-ERR rank {rank}: {e}");
            return;
        }
    };
    println!("rank {rank}: init {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let stream = comm.device().new_stream().unwrap();
    let t = Instant::now();
    let bad = run_matrix(&comm, &stream);
    println!("rank {rank}: matrix {:.1} s", t.elapsed().as_secs_f64());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    comm.destroy().unwrap();
    println!("GPU-TR-RANK-OK {rank}");
}

/// True (after printing why) when fewer than 2 GPUs are visible.
fn skip_without_gpus(test: &str) -> bool {
    let ngpu = Device::cuda_count();
    if ngpu < NRANKS {
        skipped!("SKIPPED: {test}: needs {NRANKS} GPUs, {ngpu} visible");
        return true;
    }
    false
}

/// The command of a child of the group on `id`, run by `wrap` when not empty
/// ([`child::wrapped`]): [`child_rank`] with `env` on top of this process's environment minus
/// its NCCL_/OXCCL_ settings (so only the test's apply); output piped.
fn group_command(wrap: &[&str], id: &UniqueId, env: &[(&str, &str)]) -> Command {
    let mut cmd = child::wrapped(wrap, &child_entry!(child_rank));
    cmd.env(ENV_ID, child::hex(&id.to_bytes()));
    cmd.env("NCCL_NVLS_ENABLE", "0").envs(env.iter().copied());
    cmd
}

/// The child command for rank `rank` of a group on `id` with `env` ([`group_command`]).
fn rank_command(id: &UniqueId, rank: usize, env: &[(&str, &str)]) -> Command {
    let mut cmd = group_command(&[], id, env);
    cmd.env(ENV_RANK, rank.to_string());
    cmd
}

/// Runs the matrix on 2 ranks in 2 processes with `env` (GPU ranks, or CPU-target ranks when
/// `cpu`); each rank must pass and log its channel 0 connection `via` its ring neighbour (e.g.
/// "SHM"). Without `NCCL_PROTO`, no GPU call may have chosen LL128 (off through host memory; on
/// the CPU target every buffer is host memory and LL128 stays on).
fn run_pair(test: &str, env: &[(&str, &str)], via: &str, cpu: bool) {
    let id = unique_id();
    let deadline = Instant::now() + group_limit();
    let children: Vec<_> = (0..NRANKS)
        .map(|r| {
            let mut c = rank_command(&id, r, env);
            if cpu {
                c.env(ENV_CPU, "1");
            }
            child::spawn(&mut c)
        })
        .collect();
    let outs = wait_all(children, deadline);
    for (r, (ok, out)) in outs.iter().enumerate() {
        print!("{out}");
        assert!(
            *ok && out.contains(&format!("GPU-TR-RANK-OK {r}")),
            "{test}: child rank {r} ({env:?}) failed or timed out:\n{out}"
        );
        let line = format!("Channel 00 : {r} -> {} via {via}", 1 - r);
        assert!(out.contains(&line), "{test}: rank {r}: no {line:?} in\n{out}");
        let forced = env.iter().find(|(k, _)| *k == "NCCL_PROTO").map(|(_, v)| *v);
        let protos: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("CHOICE "))
            .filter_map(|l| l.rsplit(' ').next())
            .collect();
        assert!(!protos.is_empty(), "{test}: rank {r}: no CHOICE lines");
        match forced {
            None if cpu => {}
            None => assert!(
                !protos.contains(&format!("{:?}", Proto::Ll128).as_str()),
                "{test}: rank {r}: LL128 chosen through host memory: {protos:?}"
            ),
            Some(p) => assert!(
                protos.iter().all(|q| q.eq_ignore_ascii_case(p)),
                "{test}: rank {r}: NCCL_PROTO={p} but chose {protos:?}"
            ),
        }
    }
}

#[test]
fn shm_only_collectives_two_processes() {
    if skip_without_gpus("shm_only_collectives_two_processes") {
        return;
    }
    for proto in [None, Some("LL"), Some("Simple")] {
        let mut env = vec![("NCCL_P2P_DISABLE", "1")];
        env.extend(proto.map(|p| ("NCCL_PROTO", p)));
        run_pair("shm_only_collectives_two_processes", &env, "SHM", false);
    }
}

#[test]
fn net_only_collectives_two_processes() {
    if skip_without_gpus("net_only_collectives_two_processes") {
        return;
    }
    for proto in [None, Some("LL"), Some("Simple")] {
        let mut env = vec![("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];
        env.extend(proto.map(|p| ("NCCL_PROTO", p)));
        run_pair("net_only_collectives_two_processes", &env, "NET/Socket/0", false);
    }
}

/// The same matrix between CPU-target ranks in 2 processes, through SHM and through NET, under
/// every protocol. Every run: it holds the host side of both transports to exact results, and
/// the matrix drops each AllGather input right after queueing the call (before `synchronize`),
/// which must not free memory the queued collective still reads (it did: a SIGSEGV at 16 MiB).
#[test]
fn cpu_shm_and_net_collectives_two_processes() {
    let test = "cpu_shm_and_net_collectives_two_processes";
    for (transport, via) in [("NCCL_P2P_DISABLE", "SHM"), ("NCCL_SHM_DISABLE", "NET/Socket/0")] {
        for proto in [None, Some("LL"), Some("LL128"), Some("Simple")] {
            let mut env = vec![("NCCL_P2P_DISABLE", "1"), (transport, "1")];
            env.extend(proto.map(|p| ("NCCL_PROTO", p)));
            run_pair(test, &env, via, true);
        }
    }
}

/// Runs both ranks (CPU-target devices when `cpu`) inside one private mount namespace whose
/// `/dev/shm` is a 1 MiB tmpfs, and returns their output; `None` (after printing SKIPPED) when
/// such a namespace cannot be made here.
fn run_pair_with_tiny_dev_shm(test: &str, cpu: bool, env: &[(&str, &str)]) -> Option<String> {
    let mount = "mount -t tmpfs -o size=1m oxccl-tiny /dev/shm";
    let probe = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!("{mount} && test -w /dev/shm"))
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        skipped!("SKIPPED: {test}: cannot mount a private /dev/shm ({probe:?})");
        return None;
    }
    let id = unique_id();
    // One namespace for both ranks (they are on one host): the shell starts both and waits.
    let script = format!("{mount} && {{ {ENV_RANK}=0 \"$0\" \"$@\" & {ENV_RANK}=1 \"$0\" \"$@\"; wait; }}");
    let unshare = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
    ];
    let mut wrapped = group_command(&unshare, &id, env);
    if cpu {
        wrapped.env(ENV_CPU, "1");
    }
    let (_, out) = wait_with_deadline(child::spawn(&mut wrapped), Instant::now() + group_limit());
    Some(out)
}

/// The bytes one rank's connection memory needs with default buffers (4 MiB Simple, 512 KiB LL,
/// 1 MiB LL128 per channel, plus 256 bytes of counters per channel) for `nch` channels.
fn conn_bytes(nch: usize) -> usize {
    nch * ((4 << 20) + (512 << 10) + (1 << 20) + 256)
}

/// Each rank's `INIT-ERR` line must say that /dev/shm is too small, how many bytes it needed and
/// for which path.
fn assert_too_small(test: &str, out: &str, bytes: usize) {
    for r in 0..NRANKS {
        let line = out
            .lines()
            .find_map(|l| l.find(&format!("INIT-ERR rank {r}: ")).map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("{test}: rank {r}: no INIT-ERR line in\n{out}"));
        let want = format!(
            "system error: /dev/shm has too little space: {bytes} bytes were needed for /dev/shm/oxccl-"
        );
        assert!(line.contains(&want), "{test}: rank {r}: {line:?} lacks {want:?}");
        assert!(
            line.contains(&format!("-r{r} (")),
            "{test}: rank {r}: {line:?} does not name its own segment"
        );
    }
}

#[test]
fn too_small_dev_shm_names_bytes_and_path_cpu() {
    let test = "too_small_dev_shm_names_bytes_and_path_cpu";
    // CPU target, default 2 ring channels and 1 peer channel (1 per peer, 1 peer): 3 ×
    // 5,767,424 = 17,302,272 bytes of connection memory, more than the 1 MiB tmpfs holds.
    if let Some(out) = run_pair_with_tiny_dev_shm(test, true, &[]) {
        assert_too_small(test, &out, conn_bytes(3));
    }
}

#[test]
fn too_small_dev_shm_names_bytes_and_path_gpu_shm() {
    let test = "too_small_dev_shm_names_bytes_and_path_gpu_shm";
    if skip_without_gpus(test) {
        return;
    }
    // CUDA through SHM, 4 ring channels and 8 peer channels (8 per peer for 2 GPU ranks):
    // 12 × 5,767,424 = 69,209,088 bytes (a whole number of pages).
    if let Some(out) = run_pair_with_tiny_dev_shm(
        test,
        false,
        &[("NCCL_P2P_DISABLE", "1"), ("NCCL_MAX_NCHANNELS", "4")],
    ) {
        assert_too_small(test, &out, conn_bytes(12));
    }
}
