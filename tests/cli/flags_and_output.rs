//! The `oxccl` command line as a user meets it, on the CPU target: output piped into a reader
//! that stops early (`oxccl perf ... | head`), flags with bad values named as flags, size
//! steps that would loop forever or do nothing refused, and `--compare checked` (the
//! call-signature check's cost in the same run).
use crate::common::oxccl_command as oxccl;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Runs `args` with the reader of stdout gone after its first line (`| head -1`); returns the
/// exit status, stderr and how long the command took. Killed after 30 s.
fn head_1(args: &[&str]) -> (std::process::ExitStatus, String, Duration) {
    let t = Instant::now();
    let mut child = oxccl()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run oxccl");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is dropped here: stdout's pipe has no reader any more.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!first.is_empty(), "no first line");
    (status, err, t.elapsed())
}

/// `oxccl perf ... | head -1` ends at once like other tools (SIGPIPE), without a panic — also
/// with one process per rank, where the panicking rank 0 used to leave rank 1 waiting for two
/// minutes at teardown.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    for args in [
        &["perf", "all-reduce", "--backend", "cpu", "-b", "1K", "-e", "64M"][..],
        &[
            "perf",
            "all-reduce",
            "--backend",
            "cpu",
            "--procs",
            "2",
            "-b",
            "1K",
            "-e",
            "64M",
        ][..],
        &["info"][..],
    ] {
        let (status, err, took) = head_1(args);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(took < Duration::from_secs(20), "{args:?} took {took:?}");
        // Single process: killed by SIGPIPE (or done, when it wrote everything before the
        // reader left); with --procs the parent names rank 0's SIGPIPE.
        if args.contains(&"--procs") {
            assert!(
                err.contains("SIGPIPE") || status.success(),
                "{args:?}: {status}: {err}"
            );
        } else {
            assert!(
                status.signal() == Some(libc::SIGPIPE) || status.success(),
                "{args:?}: {status}: {err}"
            );
        }
    }
}

/// A bad `--proto` / `--algo` is named as the flag (not as the variable it is passed on in), and
/// `-f` below 2 (a sweep that would never grow) or `-i 0` is refused, all with exit code 2.
#[test]
fn bad_flags_are_named_as_flags() {
    for (args, want) in [
        (
            &["perf", "all-reduce", "--proto", "bogus"][..],
            "oxccl: invalid argument: --proto=\"bogus\": \"bogus\" is not a known name (accepted: LL, LL128, Simple; a leading ^ excludes)",
        ),
        (
            &["perf", "all-reduce", "--algo", "ring,bogus"][..],
            "oxccl: invalid argument: --algo=\"ring,bogus\": \"bogus\" is not a known name (accepted: tree, ring; a leading ^ excludes)",
        ),
        (
            &["perf", "all-reduce", "-b", "1K", "-e", "1M", "-f", "1"][..],
            "oxccl: -f 1 is out of range (accepted: 2 or more; or a fixed step with -i BYTES)",
        ),
        (
            &["perf", "all-reduce", "-b", "1K", "-e", "1M", "-i", "0"][..],
            "oxccl: -i 0 is out of range (accepted: 1 byte or more)",
        ),
    ] {
        let out = oxccl().args(args).output().expect("run oxccl");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), want, "{args:?}");
    }
}

/// The output `text` of `oxccl perf all`: five collectives, each with its "0 OK" line, and rows
/// of 0 wrong out of place and in place.
fn assert_all_exact(text: &str) {
    assert_eq!(text.matches("# Out of bounds values : 0 OK").count(), 5, "{text}");
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(rows.len() >= 10, "{text}");
    for r in &rows {
        assert_eq!((r[8], r[12]), ("0", "0"), "{r:?}");
    }
}

/// `--group` issues each iteration's calls of the process's ranks as one group (what a C
/// caller's ncclGroupStart/ncclGroupEnd does) and says so; every collective stays exact on 3
/// ranks, out of place and in place.
#[test]
fn group_issues_the_ranks_calls_as_one_group_and_stays_exact() {
    let out = oxccl()
        .args(["perf", "all", "--backend", "cpu", "--ranks", "3", "-b", "8", "-e", "64K", "-f", "32", "--group"])
        .output()
        .expect("run oxccl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("# oxccl: each iteration's calls of this process's ranks issued as one group"), "{text}");
    assert_all_exact(&text);
}

/// `--threads` issues each rank's timed calls from a thread of its own and says so; every
/// collective stays exact on 3 ranks, out of place and in place, and the call check's
/// reference too. It cannot be combined with `--group`, whose calls one thread issues.
#[test]
fn threads_issue_each_ranks_calls_from_its_own_thread_and_stay_exact() {
    let out = oxccl()
        .args(["perf", "all", "--backend", "cpu", "--ranks", "3", "-b", "8", "-e", "64K", "-f", "32", "--threads"])
        .args(["--compare", "checked"])
        .output()
        .expect("run oxccl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("# oxccl: each of this process's ranks issues its timed calls from a thread of its own"), "{text}");
    assert_all_exact(&text);
    let out = oxccl().args(["perf", "all-reduce", "--backend", "cpu", "--ranks", "2", "--threads", "--group"]).output().expect("run oxccl");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'--threads' cannot be used with '--group'"), "{err}");
}

/// The output of `oxccl perf` run with `args` and a reference labelled `label` (`--compare`):
/// a success, the reference's columns and footer line, and `rows` rows (sizes, summed over the
/// collectives), each with the reference's two times and the ratio (18 fields).
fn compared(args: &[&str], label: &str, rows: usize) -> String {
    let out = oxccl().args(args).args(["--compare", label]).output().expect("run oxccl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(&format!("{label} out-of-place")) && text.contains(&format!("{label} in-place")), "{text}");
    assert!(text.contains(&format!("# Avg {label} bandwidth")), "{text}");
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), rows, "{text}");
    for l in lines {
        assert_eq!(l.split_whitespace().count(), 18, "{l}");
    }
    text
}

/// `--compare self` times every collective and size twice, on two sets of communicators with
/// the same settings (the reference columns named "self"), both exact: the comparison's own spread, to
/// read `--compare checked` against. `init-bench` refuses it, naming the flag.
#[test]
fn compare_self_times_a_second_set_of_communicators_in_the_same_run() {
    // Five collectives of sizes 8, 64, 512 and 4096 B.
    let text = compared(&["perf", "all", "--backend", "cpu", "--ranks", "2", "-b", "8", "-e", "4K", "-f", "8"], "self", 20);
    assert!(text.contains("# Avg self bandwidth   : "), "{text}");
    assert_all_exact(&text);
    let out = oxccl().args(["init-bench", "--compare", "self"]).output().expect("run oxccl");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--compare checked and --compare self time calls, not inits"), "{err}");
}

/// `--compare checked` times every size with the call-signature check off (the main columns)
/// and on (the reference columns, named "checked"), both exact; `--compare nccl` still needs
/// GPUs.
#[test]
fn compare_checked_times_the_call_check_in_the_same_run() {
    // Sizes 8, 64, 512 and 4096 B.
    let text = compared(&["perf", "all-reduce", "--backend", "cpu", "--ranks", "2", "-b", "8", "-e", "4K", "-f", "8"], "checked", 4);
    assert!(text.contains("# Out of bounds values : 0 OK") && text.contains("# Avg checked bandwidth: "), "{text}");
    let out = oxccl()
        .args(["perf", "all-reduce", "--backend", "cpu", "--compare", "nccl"])
        .output()
        .expect("run oxccl");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--compare nccl needs GPUs"));
}
