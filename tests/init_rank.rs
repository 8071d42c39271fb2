//! `Comm::init_rank` on the CPU target: ranks as threads and as processes meet through the
//! bootstrap of one unique id and run collectives over shared memory (`/dev/shm`) with exact
//! results; two ranks on one device get `InvalidUsage` naming both (case C26).
mod common;

use common::child::{hex, test_entry, unhex, wait_all};
use oxccl::bootstrap::{UniqueId, get_unique_id};
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
    for nranks in [1usize, 2, 4] {
        let id = get_unique_id().expect("unique id");
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

/// The body of a child process of `ranks_as_processes` (a no-op in a normal test run).
#[test]
fn child_rank_entry() {
    let (Ok(rank), Ok(id)) = (
        std::env::var("OXCCL_TEST_CHILD_RANK"),
        std::env::var("OXCCL_TEST_CHILD_ID"),
    ) else {
        return;
    };
    let id = UniqueId::from_bytes(&unhex(&id)).expect("id");
    let nranks: usize = std::env::var("OXCCL_TEST_CHILD_NRANKS").unwrap().parse().unwrap();
    let wrong = run_rank(&id, rank.parse().unwrap(), nranks).expect("child rank");
    assert_eq!(wrong, 0);
    println!("CHILD-RANK-OK");
}

/// Waits (at most 120 s) for every child rank; each must exit successfully and print `marker`.
/// Every child is waited for (or killed) before any assertion, so none outlives the test.
fn wait_children(children: Vec<std::process::Child>, marker: &str) {
    let outs = wait_all(children, Instant::now() + Duration::from_secs(120));
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
    let id = get_unique_id().expect("unique id");
    let children: Vec<_> = (0..nranks)
        .map(|r| {
            test_entry("child_rank_entry")
                .env("OXCCL_TEST_CHILD_RANK", r.to_string())
                .env("OXCCL_TEST_CHILD_NRANKS", nranks.to_string())
                .env("OXCCL_TEST_CHILD_ID", hex(&id.to_bytes()))
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn child rank")
        })
        .collect();
    wait_children(children, "CHILD-RANK-OK");
}

#[test]
fn two_ranks_on_one_device_c26() {
    let id = get_unique_id().expect("unique id");
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

/// The body of a child process of `from_env_as_a_launcher_would` (a no-op in a normal test run).
#[test]
fn child_from_env_entry() {
    if std::env::var("OXCCL_TEST_FROM_ENV").is_err() {
        return;
    }
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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..world)
        .map(|r| {
            test_entry("child_from_env_entry")
                .env("OXCCL_TEST_FROM_ENV", "1")
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("NCCL_COMM_ID")
                .env_remove("OXCCL_COMM_ID")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn child rank")
        })
        .collect();
    wait_children(children, "CHILD-FROM-ENV-OK");
}

#[test]
fn from_env_names_missing_or_bad_variables() {
    // SAFETY: no other test of this binary reads these variables in this process (children get
    // their own environment).
    unsafe {
        std::env::set_var("RANK", "0");
        std::env::remove_var("WORLD_SIZE");
    }
    let e = Comm::from_env().unwrap_err().to_string();
    assert!(e.contains("WORLD_SIZE is not set"), "{e}");
    // SAFETY: as above.
    unsafe {
        std::env::set_var("WORLD_SIZE", "two");
    }
    let e = Comm::from_env().unwrap_err().to_string();
    assert!(e.contains("WORLD_SIZE=\"two\""), "{e}");
    // SAFETY: as above.
    unsafe {
        std::env::set_var("WORLD_SIZE", "2");
        std::env::set_var("RANK", "2");
    }
    let e = Comm::from_env().unwrap_err().to_string();
    assert!(e.contains("RANK=2 is out of range for WORLD_SIZE=2"), "{e}");
    // SAFETY: as above.
    unsafe {
        std::env::remove_var("RANK");
        std::env::remove_var("WORLD_SIZE");
    }
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
