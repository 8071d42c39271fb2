//! `oxccl perf send-recv|all-to-all|gather|scatter|all-to-all-v|all-gather-v` on the CPU target, as nccl-tests'
//! `sendrecv_perf`, `alltoall_perf`, `gather_perf` and `scatter_perf` print them (and the uneven
//! AlltoAllV and AllGatherV, which nccl-tests does not have, in the same form): every row
//! exact, sizes and counts as nccl-tests computes them, busbw = algbw × the operation's bus
//! factor (SendRecv 1, the others (n−1)/n) in the printed columns and, at full precision, in
//! `--json`; AlltoAll's in-place columns and in-place SendRecv's `#wrong` are `N/A`.
use crate::common::oxccl_command as oxccl;
use std::time::{Duration, Instant};

/// Runs `oxccl perf <op>` on 3 CPU-target ranks over 8 B .. 64 KiB by 8 (5 sizes) with one check
/// per size, writing JSON to a file of its own; (stdout, the JSON document).
fn perf_3_ranks(op: &str) -> (String, serde_json::Value) {
    let json = std::env::temp_dir().join(format!("oxccl-perf-{op}-{}.json", std::process::id()));
    let t = Instant::now();
    let out = oxccl()
        .args(["perf", op, "--backend", "cpu", "--ranks", "3", "-b", "8", "-e", "64K", "-f", "8", "-c", "1"])
        .args(["-n", "4", "-w", "1", "--json"])
        .arg(&json)
        .env("NO_COLOR", "1")
        .output()
        .expect("run oxccl");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "perf {op}:\n{stdout}\n{stderr}");
    assert!(t.elapsed() < Duration::from_secs(120), "perf {op} took {:?}", t.elapsed());
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}", json.display()));
    let _ = std::fs::remove_file(&json);
    (stdout, serde_json::from_str(&text).expect("valid JSON"))
}

/// The data rows of the table: whitespace-separated columns.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// What the in-place columns of an operation hold.
#[derive(Clone, Copy, PartialEq)]
enum InPlace {
    /// Timed and checked (0 wrong).
    Checked,
    /// Timed, `#wrong` N/A: in-place SendRecv's receive may overwrite data not yet sent.
    Unchecked,
    /// No in-place form (AlltoAll): every column N/A.
    Absent,
}

/// The sweep sizes of every operation but SendRecv on 3 float ranks: 3 blocks of size / 4 / 3
/// elements rounded down to 4 (16 bytes), and those block counts.
const BLOCKED_SIZES: [u64; 5] = [0, 48, 480, 4080, 32736];
const BLOCKED_COUNTS: [u64; 5] = [0, 4, 40, 340, 2728];

/// Checks the printed rows and the JSON results of one operation on 3 ranks: sizes, counts and
/// root, 0 wrong, the in-place columns, and busbw = `factor` × algbw.
fn check_sweep(
    op: &str,
    name: &str,
    factor: f64,
    sizes: &[u64],
    counts: &[u64],
    root: &str,
    in_place: InPlace,
) {
    let (stdout, doc) = perf_3_ranks(op);
    assert!(stdout.contains(&format!("#\n# {name}\n")), "{stdout}");
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");
    let rows = rows(&stdout);
    let col = |k: usize| rows.iter().map(|w| w[k].clone()).collect::<Vec<_>>();
    assert_eq!(col(0), sizes.iter().map(u64::to_string).collect::<Vec<_>>(), "{stdout}");
    assert_eq!(col(1), counts.iter().map(u64::to_string).collect::<Vec<_>>(), "{stdout}");
    for w in &rows {
        assert_eq!(w.len(), 13, "{stdout}");
        let redop = if name == "reducescatterv" { "sum" } else { "none" };
        assert_eq!(&w[2..5], ["float", redop, root], "{stdout}");
        assert_eq!(w[8], "0", "out-of-place values wrong at {} B:\n{stdout}", w[0]);
        // Printed algbw and busbw (2 decimals each) agree with the factor up to their rounding.
        let num = |k: usize| -> f64 { w[k].parse().unwrap_or_else(|_| panic!("column {k} of {w:?}")) };
        let (algbw, busbw) = (num(6), num(7));
        assert!((busbw - factor * algbw).abs() <= 0.01, "{op}: busbw {busbw} vs algbw {algbw} × {factor}");
        match in_place {
            InPlace::Absent => assert_eq!(&w[9..13], ["N/A", "N/A", "N/A", "N/A"], "{stdout}"),
            InPlace::Checked | InPlace::Unchecked => {
                assert!((num(11) - factor * num(10)).abs() <= 0.01, "{op}: in place {w:?}");
                let want = if in_place == InPlace::Checked { "0" } else { "N/A" };
                assert_eq!(w[12], want, "in-place #wrong at {} B:\n{stdout}", w[0]);
            }
        }
    }
    // At full precision in the JSON: busbw / algbw is the factor on every row that moved data.
    let results = doc["results"].as_array().expect("results");
    assert_eq!(results.len(), sizes.len(), "{doc}");
    let mut moved = 0;
    for r in results {
        assert_eq!(r["collective"], name, "{r}");
        assert_eq!(r["out_of_place"]["wrong"], 0, "{r}");
        assert_eq!(r["in_place"].is_null(), in_place == InPlace::Absent, "{r}");
        let (alg, bus) = (
            r["out_of_place"]["algbw_gbs"].as_f64().unwrap(),
            r["out_of_place"]["busbw_gbs"].as_f64().unwrap(),
        );
        if r["size_bytes"].as_u64().unwrap() > 0 {
            assert!(alg > 0.0, "{r}");
            let got = bus / alg;
            assert!((got - factor).abs() < 1e-12, "{op}: busbw / algbw = {got} (want {factor}): {r}");
            moved += 1;
        }
    }
    assert!(moved >= sizes.len() - 1, "{doc}");
}

/// SendRecv: S = count × 4 bytes for every sweep size, busbw = algbw, exact out of place.
#[test]
fn perf_send_recv_is_exact_with_bus_factor_1() {
    check_sweep(
        "send-recv",
        "sendrecv",
        1.0,
        &[8, 64, 512, 4096, 32768],
        &[2, 16, 128, 1024, 8192],
        "-1",
        InPlace::Unchecked,
    );
}

/// AlltoAll on 3 ranks: the per-rank block is size / 4 / 3 rounded down to 4 elements (16
/// bytes), S = 3 blocks, busbw = algbw × 2/3, exact out of place, in-place columns N/A.
#[test]
fn perf_all_to_all_is_exact_with_bus_factor_2_3() {
    check_sweep(
        "all-to-all",
        "alltoall",
        2.0 / 3.0,
        &BLOCKED_SIZES,
        &BLOCKED_COUNTS,
        "-1",
        InPlace::Absent,
    );
}

/// Gather and Scatter to and from rank 0 on 3 ranks: S = the root's 3 blocks, busbw = algbw ×
/// 2/3, exact out of place and in place.
#[test]
fn perf_gather_and_scatter_are_exact_with_bus_factor_2_3() {
    for (op, name) in [("gather", "gather"), ("scatter", "scatter")] {
        check_sweep(op, name, 2.0 / 3.0, &BLOCKED_SIZES, &BLOCKED_COUNTS, "0", InPlace::Checked);
    }
}

/// AlltoAllV on 3 ranks: the average block as AlltoAll's, S = one rank's uneven blocks
/// (`perf::p2p::v_count`: ½, 1 and 1½ times the average, 16-byte aligned), busbw = algbw × 2/3,
/// exact, no in-place form.
#[test]
fn perf_all_to_all_v_is_exact_with_uneven_blocks() {
    use oxccl::perf::p2p::{P2pFunc, v_count};
    let sizes: Vec<u64> = BLOCKED_COUNTS
        .iter()
        .map(|&c| (0..3).map(|p| v_count(c as usize, oxccl::DataType::F32, 3, 0, p) as u64 * 4).sum())
        .collect();
    assert_eq!(sizes, [0, 32, 480, 4064, 32736]);
    assert_eq!(P2pFunc::AllToAllV.data_bytes(340, oxccl::DataType::F32, 3), 4064);
    check_sweep("all-to-all-v", "alltoallv", 2.0 / 3.0, &sizes, &BLOCKED_COUNTS, "-1", InPlace::Absent);
}

/// AllGatherV on 3 ranks: rank p contributes `v_count(count, p, 0)` (½, 1 and 1½ times the
/// average), S = every contribution, busbw = algbw × 2/3, exact, no in-place form.
#[test]
fn perf_all_gather_v_is_exact_with_uneven_contributions() {
    use oxccl::perf::p2p::{P2pFunc, v_count};
    let sizes: Vec<u64> = BLOCKED_COUNTS
        .iter()
        .map(|&c| (0..3).map(|p| v_count(c as usize, oxccl::DataType::F32, 3, p, 0) as u64 * 4).sum())
        .collect();
    assert_eq!(sizes, [0, 32, 480, 4064, 32736]);
    assert_eq!(P2pFunc::AllGatherV.data_bytes(340, oxccl::DataType::F32, 3), 4064);
    check_sweep("all-gather-v", "allgatherv", 2.0 / 3.0, &sizes, &BLOCKED_COUNTS, "-1", InPlace::Absent);
}

/// ReduceScatterV on 3 ranks: the sum of every rank's input, rank p's block of
/// `v_count(count, p, 0)` elements to rank p; S = the whole input, exact, no in-place form.
#[test]
fn perf_reduce_scatter_v_is_exact_with_uneven_blocks() {
    check_sweep("reduce-scatter-v", "reducescatterv", 2.0 / 3.0, &[0, 32, 480, 4064, 32736], &BLOCKED_COUNTS, "-1", InPlace::Absent);
}

/// `--compare nccl` on the CPU target is refused at once, naming why, for the point-to-point
/// operations as for the collectives.
#[test]
fn perf_p2p_compare_nccl_needs_gpus() {
    for op in ["send-recv", "all-to-all", "gather", "scatter", "all-to-all-v", "all-gather-v", "reduce-scatter-v"] {
        let out = oxccl()
            .args(["perf", op, "--backend", "cpu", "--ranks", "2", "--compare", "nccl"])
            .output()
            .expect("run oxccl");
        assert_eq!(out.status.code(), Some(2), "{op}");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr).trim(),
            "oxccl: --compare nccl needs GPUs (NCCL does not run on the CPU target)",
            "{op}"
        );
    }
}
