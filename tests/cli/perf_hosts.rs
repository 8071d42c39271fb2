//! `oxccl perf --procs N --hosts H` on the CPU target: H simulated hosts (network namespaces
//! joined by veths on a bridge), N/H ranks each, the sweep exact over SHM within a host and the
//! socket network between hosts; the namespaces are gone afterwards, also when the ranks fail;
//! setup failures (no `ip`, not root) are errors naming the command that failed.
use crate::common::{namespaces_allowed, oxccl_command as oxccl_cli};
use oxccl::perf::procs::host_of;
use std::process::{Command, Output};

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");

/// The command `oxccl` with `args`, without inherited NCCL_/OXCCL_ variables, plus `env`.
fn oxccl_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = oxccl_cli();
    cmd.args(args).envs(env.iter().copied());
    cmd
}

/// Runs `oxccl` with `args`, without inherited NCCL_/OXCCL_ variables, plus `env`.
fn oxccl(args: &[&str], env: &[(&str, &str)]) -> Output {
    oxccl_command(args, env).output().expect("run oxccl")
}

/// Namespaces a run of process `pid` would have left (`oxh<pid>s`, `oxh<pid>h<k>`).
pub(crate) fn leftover_namespaces(pid: u32) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| {
            n.strip_prefix(&format!("oxh{pid}"))
                .is_some_and(|t| t == "s" || t.starts_with('h'))
        })
        .map(String::from)
        .collect()
}

/// Runs `oxccl` with `args` as a child whose pid we know, returning its pid and output.
fn oxccl_pid(args: &[&str], env: &[(&str, &str)]) -> (u32, Output) {
    let child = oxccl_command(args, env)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn oxccl");
    let pid = child.id();
    (pid, child.wait_with_output().expect("wait oxccl"))
}

#[test]
fn ranks_are_dealt_to_hosts_in_blocks() {
    // rank · hosts / nranks: 4 ranks on 2 hosts → [0, 0, 1, 1]; 5 on 2 → [0, 0, 0, 1, 1];
    // 4 on 4 → one each.
    let map = |n: usize, h: usize| (0..n).map(|r| host_of(r, n, h)).collect::<Vec<_>>();
    assert_eq!(map(4, 2), [0, 0, 1, 1]);
    assert_eq!(map(5, 2), [0, 0, 0, 1, 1]);
    assert_eq!(map(4, 4), [0, 1, 2, 3]);
    assert_eq!(map(6, 3), [0, 0, 1, 1, 2, 2]);
}

#[test]
fn all_reduce_sweep_over_two_simulated_hosts() {
    if !namespaces_allowed("all_reduce_sweep_over_two_simulated_hosts") {
        return;
    }
    let (pid, out) = oxccl_pid(
        &[
            "perf",
            "all-reduce",
            "--procs",
            "4",
            "--hosts",
            "2",
            "-b",
            "8",
            "-e",
            "1M",
            "--backend",
            "cpu",
            "-n",
            "3",
            "-w",
            "1",
        ],
        &[("NCCL_DEBUG", "INFO"), ("NO_COLOR", "1")],
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    assert!(
        stdout.contains("# 2 simulated hosts") && stdout.contains("ranks per host [2, 2]"),
        "{stdout}"
    );
    // 8 B .. 1 MiB by factor 2: 18 sizes, each row with 0 wrong both out of and in place.
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 18, "{stdout}");
    for (k, row) in rows.iter().enumerate() {
        assert_eq!(row[0], (8u64 << k).to_string(), "{stdout}");
        assert_eq!(
            (row[8], row[12]),
            ("0", "0"),
            "wrong values at {} B:\n{stdout}",
            row[0]
        );
    }
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");
    // Ranks 0, 1 on host 0 and 2, 3 on host 1: SHM inside a host, the socket network between
    // hosts, each host on its own veth.
    let plain: String = strip_ansi(&stderr);
    for line in [
        "Channel 00 : 0 -> 1 via SHM",
        "Channel 00 : 1 -> 2 via NET/Socket/0",
        "Channel 00 : 2 -> 3 via SHM",
        "Channel 00 : 3 -> 0 via NET/Socket/0",
        "iface=oxeth0",
        "iface=oxeth1",
    ] {
        assert!(plain.contains(line), "no {line:?} in\n{plain}");
    }
    assert_eq!(leftover_namespaces(pid), Vec::<String>::new());
}

/// `s` without ANSI colour sequences (ESC [ ... m).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn failing_ranks_still_remove_the_namespaces() {
    if !namespaces_allowed("failing_ranks_still_remove_the_namespaces") {
        return;
    }
    // An unknown protocol in the environment fails every rank's communicator (the `--proto`
    // flag is refused by the parent before anything starts); the parent reports the failed rank
    // and deletes the namespaces all the same.
    let (pid, out) = oxccl_pid(
        &[
            "perf",
            "all-reduce",
            "--procs",
            "2",
            "--hosts",
            "2",
            "-b",
            "8",
            "-e",
            "8",
            "--backend",
            "cpu",
        ],
        &[("NCCL_PROTO", "Bogus")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("of 2 failed"), "{stderr}");
    assert_eq!(leftover_namespaces(pid), Vec::<String>::new());
}

#[test]
fn setup_errors_name_what_failed() {
    // Bad counts: rejected before anything is created.
    let out = oxccl(
        &[
            "perf",
            "all-reduce",
            "--procs",
            "2",
            "--hosts",
            "3",
            "--backend",
            "cpu",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "oxccl: --hosts 3 is out of range for --procs 2 (accepted: 1..=2, at least one rank per host)"
    );
    let out = oxccl(&["perf", "all-reduce", "--hosts", "2", "--backend", "cpu"], &[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--procs"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // No `ip` on the PATH: the error names the command and iproute2.
    let empty = std::env::temp_dir().join(format!("oxccl-no-ip-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = oxccl(
        &[
            "perf",
            "all-reduce",
            "--procs",
            "2",
            "--hosts",
            "2",
            "--backend",
            "cpu",
        ],
        &[("PATH", empty.to_str().unwrap())],
    );
    let _ = std::fs::remove_dir(&empty);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "--hosts 2: setting up the simulated hosts (network namespaces) failed: `ip netns add oxh"
        ) && stderr.contains("could not run")
            && stderr.contains("iproute2's `ip`"),
        "{stderr}"
    );
    // Not root (when we are, and setpriv can drop it): `ip netns add` itself fails, named with
    // its own message.
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let setpriv = Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !(root && setpriv) {
        eprintln!("SKIPPED: setup_errors_name_what_failed (not root): needs root and setpriv");
        return;
    }
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", OXCCL])
        .args([
            "perf",
            "all-reduce",
            "--procs",
            "2",
            "--hosts",
            "2",
            "--backend",
            "cpu",
        ])
        .output()
        .expect("setpriv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("Permission denied") && !stderr.contains("ip netns") {
        eprintln!("SKIPPED: setup_errors_name_what_failed (not root): nobody cannot run {OXCCL}: {stderr}");
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "--hosts 2: setting up the simulated hosts (network namespaces) failed: `ip netns add oxh"
        ) && stderr.contains("failed (exit status"),
        "{stderr}"
    );
}
