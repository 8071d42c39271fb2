//! `oxccl init-bench`: communicator init timed over processes. On the CPU target it times oxccl
//! only; on GPUs the lead runs the NCCL comparison (see the GPU test).
use std::process::Command;

/// Rows of the table (lines not starting with '#'), split on whitespace.
fn rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// Checks one row: `name iters median min max first s1 .. sN` with N = `iters` samples, and the
/// statistics recomputed from the samples (median of sorted samples; for an even count the mean
/// of the two middle ones), to the 3 decimals printed.
fn check_row(row: &[String], name: &str, iters: usize) {
    assert_eq!(row[0], name, "{row:?}");
    assert_eq!(row[1], iters.to_string(), "{row:?}");
    assert_eq!(row.len(), 6 + iters, "{row:?}");
    let num = |s: &String| s.parse::<f64>().unwrap();
    let samples: Vec<f64> = row[6..].iter().map(num).collect();
    assert!(samples.iter().all(|&s| s > 0.0), "{row:?}");
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 0.0015;
    assert!(close(num(&row[2]), median), "median {row:?}");
    assert!(close(num(&row[3]), sorted[0]), "min {row:?}");
    assert!(close(num(&row[4]), sorted[n - 1]), "max {row:?}");
    assert_eq!(row[5], row[6], "first sample {row:?}");
}

fn oxccl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("init-bench")
        .args(args)
        .output()
        .expect("run oxccl")
}

/// Two CPU-target ranks in two processes, three iterations: rank 0 prints one oxccl row with
/// three samples.
#[test]
fn cpu_target_two_processes_three_iterations() {
    let out = oxccl(&["--backend", "cpu", "--procs", "2", "--iters", "3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with("# oxccl init-bench (oxccl 0.1.0): communicator init, 2 ranks in 2 processes on 2 x CPU-target device\n"),
        "{text}"
    );
    let rows = rows(&text);
    assert_eq!(rows.len(), 1, "{text}");
    check_row(&rows[0], "oxccl", 3);
    assert!(!text.contains("ratio"), "{text}");
}

/// Four ranks, an even number of iterations (median = mean of the two middle samples).
#[test]
fn cpu_target_four_processes_even_iterations() {
    let out = oxccl(&["--backend", "cpu", "--procs", "4", "--iters", "4"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&text);
    assert_eq!(rows.len(), 1, "{text}");
    check_row(&rows[0], "oxccl", 4);
}

/// NCCL does not run on the CPU target: a clear error, exit status 2, before any process starts.
#[test]
fn compare_nccl_without_gpus_is_an_error() {
    let out = oxccl(&[
        "--backend",
        "cpu",
        "--procs",
        "2",
        "--iters",
        "3",
        "--compare",
        "nccl",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        "oxccl: invalid argument: --compare nccl needs GPUs: NCCL does not run on the CPU target, and no CUDA GPU \
         is in use (none visible, or --backend cpu)"
    );
    let out = oxccl(&["--backend", "cpu", "--procs", "2", "--iters", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        "oxccl: invalid argument: --iters 0 is out of range (accepted: 1..=10000)"
    );
}

/// On GPUs (the 2xH200 machine): oxccl and NCCL, 2 ranks in 2 processes, 3 iterations each.
#[test]
fn gpu_compare_nccl() {
    if oxccl::Device::cuda_count() < 2 {
        skipped!("SKIPPED: needs 2 CUDA GPUs");
        return;
    }
    if !oxccl::nccl::available() {
        skipped!("SKIPPED: libnccl.so.2 not found");
        return;
    }
    let out = oxccl(&["--procs", "2", "--iters", "3", "--compare", "nccl"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&text);
    assert_eq!(rows.len(), 2, "{text}");
    check_row(&rows[0], "oxccl", 3);
    check_row(&rows[1], "nccl", 3);
    assert!(text.contains("# ratio oxccl/nccl of the medians: "), "{text}");
    println!("{text}");
}

fn oxccl_env(var: (&str, &str), args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("init-bench")
        .args(args)
        .env(var.0, var.1)
        .output()
        .expect("run oxccl")
}

/// NCCL_P2P_LEVEL is read by every rank's init: a bad value fails the init with an
/// InvalidArgument naming the variable and the accepted values; a good one does not concern the
/// CPU target's SHM transport (P2P levels apply between GPUs only).
#[test]
fn p2p_level_at_init_on_the_cpu_target() {
    let out = oxccl_env(
        ("NCCL_P2P_LEVEL", "FAR"),
        &["--backend", "cpu", "--procs", "2", "--iters", "1"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "invalid argument: NCCL_P2P_LEVEL=\"FAR\" is not a P2P level (accepted: LOC, NVL, NVB, C2C, PIX, PXB, \
             PXN, P2C, PHB, SYS, or a legacy integer 0-5)"
        ),
        "{err}"
    );
    let out = oxccl_env(
        ("NCCL_P2P_LEVEL", "LOC"),
        &["--backend", "cpu", "--procs", "2", "--iters", "1"],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    check_row(&rows(&String::from_utf8_lossy(&out.stdout))[0], "oxccl", 1);
}

/// On 2 GPUs in 2 processes: NCCL_P2P_LEVEL=LOC forbids P2P between two distinct GPUs (their
/// path is at least NVL whatever the topology), so, as in NCCL, the pair connects through SHM
/// instead and init succeeds (each rank logs the refusal at info level; children's logs reach
/// this process's stderr); SYS allows every path between GPUs of one host.
#[test]
fn gpu_p2p_level_loc_falls_back_to_shm_and_sys_allows_p2p() {
    if oxccl::Device::cuda_count() < 2 {
        skipped!("SKIPPED: needs 2 CUDA GPUs");
        return;
    }
    let args = ["--backend", "cuda", "--procs", "2", "--iters", "1"];
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("init-bench")
        .args(args)
        .env("NCCL_P2P_LEVEL", "LOC")
        .env("OXCCL_LOG", "oxccl::init=info")
        .output()
        .expect("run oxccl");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for (r, b) in [(0, 1), (1, 0)] {
        let line = format!("NCCL_P2P_LEVEL=LOC forbids P2P between rank {r} (cuda device");
        assert!(
            err.contains(&line) && err.contains(&format!("and rank {b} (cuda device")),
            "{err}"
        );
    }
    let out = oxccl_env(("NCCL_P2P_LEVEL", "SYS"), &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
