//! `Comm::init_rank` on the CPU target: ranks as threads and as processes meet through the
//! bootstrap of one unique id and run collectives over shared memory (`/dev/shm`) with exact
//! results; two ranks on one device get `InvalidUsage` naming both (case C26).
use crate::common::topo::MESH_RINGS;
use crate::common::{self, child, unique_id};
use crate::script_ranks::{host_env, rings_line, run_quiet, steps, topo_path};
use oxccl::bootstrap::UniqueId;
use oxccl::{Comm, DataType, Device, Error, RedOp};
use std::time::{Duration, Instant};

/// AllReduce (sum of rank+1) and AllGather on one rank; returns the number of wrong elements.
fn run_rank(id: &UniqueId, rank: usize, nranks: usize) -> Result<usize, Error> {
    let comm = Comm::init_rank(nranks, id, rank, Device::Cpu(rank))?;
    let dev = comm.device();
    let stream = dev.new_stream()?;
    let count = 100_003;
    let buf = dev.alloc(count * 4)?;
    buf.write(0, &((rank + 1) as f32).to_ne_bytes().repeat(count))?;
    comm.all_reduce(&buf, &buf, count, DataType::F32, RedOp::Sum, &stream)?;
    let per = 1001;
    let send = dev.alloc(per * 4)?;
    let recv = dev.alloc(per * 4 * nranks)?;
    let mine: Vec<u8> = (0..per)
        .flat_map(|i| ((rank * 10_000 + i) as u32).to_ne_bytes())
        .collect();
    send.write(0, &mine)?;
    comm.all_gather(&send, &recv, per, DataType::U32, &stream)?;
    stream.synchronize()?;
    let want = (nranks * (nranks + 1) / 2) as f32;
    let sum = buf.to_vec()?;
    let mut wrong = sum
        .chunks(4)
        .filter(|c| f32::from_ne_bytes((*c).try_into().unwrap()) != want)
        .count();
    let all = recv.to_vec()?;
    for (k, c) in all.chunks(4).enumerate() {
        let (owner, i) = (k / per, k % per);
        wrong += usize::from(u32::from_ne_bytes(c.try_into().unwrap()) != (owner * 10_000 + i) as u32);
    }
    Ok(wrong)
}

#[test]
fn ranks_as_threads() {
    let _env = common::env::shared();
    for nranks in [1usize, 2, 4] {
        let id = unique_id();
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..nranks)
                .map(|r| s.spawn(move || run_rank(&id, r, nranks)))
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        for (r, res) in results.into_iter().enumerate() {
            assert_eq!(
                res.unwrap_or_else(|e| panic!("nranks {nranks} rank {r}: {e}")),
                0,
                "rank {r} wrong elements"
            );
        }
    }
}

/// A child process of `ranks_as_processes`.
#[test]
#[ignore = "child process of ranks_as_processes"]
fn child_rank() {
    child::enter();
    let (rank, nranks, id) = child::rank();
    let wrong = run_rank(&id, rank, nranks).expect("child rank");
    assert_eq!(wrong, 0);
    println!("CHILD-RANK-OK");
}

/// Waits (at most 120 s) for every child rank; each must exit successfully and print `marker`.
/// Every child is waited for (or killed) before any assertion, so none outlives the test.
fn wait_children(children: Vec<std::process::Child>, marker: &str) {
    let outs = child::wait_all(children, Instant::now() + Duration::from_secs(120));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(
            *ok && out.contains(marker),
            "child rank {r} (limit 120 s):\n{out}"
        );
    }
}

#[test]
fn ranks_as_processes() {
    let nranks = 3;
    let id = unique_id();
    let children: Vec<_> = (0..nranks)
        .map(|r| {
            let mut cmd = child::command(&child_entry!(child_rank));
            child::rank_env(&mut cmd, r, nranks, &id);
            child::spawn(&mut cmd)
        })
        .collect();
    wait_children(children, "CHILD-RANK-OK");
}

#[test]
fn two_ranks_on_one_device_c26() {
    let _env = common::env::shared();
    let id = unique_id();
    let errs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| s.spawn(move || Comm::init_rank(2, &id, r, Device::Cpu(0)).err()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, e) in errs.into_iter().enumerate() {
        let e = e.unwrap_or_else(|| panic!("rank {r}: init_rank on a shared device must fail"));
        assert!(matches!(e, Error::InvalidUsage(_)), "rank {r}: {e}");
        let m = e.to_string();
        assert!(
            m.contains("ranks 0 and 1") && m.contains("cpu device 0"),
            "rank {r}: {m}"
        );
    }
    assert!(
        Comm::init_rank(2, &id, 2, Device::Cpu(0))
            .is_err_and(|e| e.to_string().contains("rank 2 is out of range"))
    );
}

/// A child process of `from_env_as_a_launcher_would`.
#[test]
#[ignore = "child process of from_env_as_a_launcher_would"]
fn child_from_env() {
    child::enter();
    let comm = Comm::from_env().expect("Comm::from_env");
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let stream = comm.device().new_stream().unwrap();
    let buf = comm.device().alloc(4 * 1000).unwrap();
    buf.write(0, &((rank + 1) as u32).to_ne_bytes().repeat(1000))
        .unwrap();
    comm.all_reduce(&buf, &buf, 1000, DataType::U32, RedOp::Sum, &stream)
        .unwrap();
    stream.synchronize().unwrap();
    let want = ((nranks * (nranks + 1) / 2) as u32).to_ne_bytes().repeat(1000);
    assert_eq!(buf.to_vec().unwrap(), want);
    println!("CHILD-FROM-ENV-OK");
}

#[test]
fn from_env_as_a_launcher_would() {
    // One rank per GPU where GPUs are visible (from_env puts LOCAL_RANK on GPU LOCAL_RANK, and
    // two ranks on one GPU are refused), else 3 CPU-target ranks.
    let world = match oxccl::Device::cuda_count() {
        0 => 3,
        n => n.min(3),
    };
    // Held until the children end; rank 0's root binds it (SO_REUSEADDR), no other root can.
    let reserved = crate::common::port::ReservedPort::new();
    let port = reserved.port();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut cmd = child::command(&child_entry!(child_from_env));
            cmd.env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string());
            child::spawn(&mut cmd)
        })
        .collect();
    wait_children(children, "CHILD-FROM-ENV-OK");
}

#[test]
fn from_env_names_missing_or_bad_variables() {
    let env = common::env::Env::clean_exact(&["RANK", "WORLD_SIZE"]);
    env.set(&[("RANK", "0")]);
    let e = Comm::from_env().unwrap_err().to_string();
    assert!(e.contains("WORLD_SIZE is not set"), "{e}");
    env.set(&[("RANK", "0"), ("WORLD_SIZE", "two")]);
    let e = Comm::from_env().unwrap_err().to_string();
    assert!(e.contains("WORLD_SIZE=\"two\""), "{e}");
    env.set(&[("WORLD_SIZE", "2"), ("RANK", "2")]);
    let e = Comm::from_env().unwrap_err().to_string();
    assert!(e.contains("RANK=2 is out of range for WORLD_SIZE=2"), "{e}");
}

/// `oxccl perf --procs 3` on the CPU target: three processes, one rank each, bootstrapped through
/// one unique id; rank 0 prints one row per size with zero wrong elements.
#[test]
fn perf_procs_runs_ranks_as_processes() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args([
            "perf",
            "all-reduce",
            "--backend",
            "cpu",
            "--procs",
            "3",
            "-b",
            "4K",
            "-e",
            "256K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
        ])
        .output()
        .expect("run oxccl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("# nranks 3 (3 processes"), "{text}");
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .collect();
    // Sizes 4K, 32K, 256K (factor 8); float elements = bytes / 4; #wrong (columns 8 and 12) 0.
    let sizes: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(sizes, ["4096", "32768", "262144"], "{text}");
    for r in &rows {
        assert_eq!(r[1], (r[0].parse::<usize>().unwrap() / 4).to_string());
        assert_eq!((r[8], r[12]), ("0", "0"), "{text}");
    }
}

/// The mesh's per-channel rings with ranks as separate processes (the `ring_order` tests use threads),
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
