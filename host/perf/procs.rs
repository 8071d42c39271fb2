//! One rank per process for the CLI's multi-process modes (`oxccl perf --procs N`, `oxccl
//! init-bench`): the parent starts N copies of the running binary with its own arguments and
//! tells each its rank, the rank count, the device kind and a unique id to bootstrap through, in
//! environment variables; a child finds its rank with [`ChildRank::from_env`].
//!
//! `oxccl perf --procs N --hosts H` runs the ranks on H simulated hosts ([`Hosts`]): network
//! namespaces joined by veth pairs to a bridge, so ranks of different hosts talk over the socket
//! network (NET) with addresses of their own, and ranks of one host over SHM.
use crate::Device;
use crate::bootstrap::{Bootstrap, UNIQUE_ID_BYTES, UniqueId, get_unique_id};
use crate::error::{Error, Result};

/// Environment variable telling a child process its rank.
pub const ENV_RANK: &str = "OXCCL_PROC_RANK";
/// Environment variable telling a child process the number of ranks (= processes).
pub const ENV_NRANKS: &str = "OXCCL_PROC_NRANKS";
/// Environment variable holding the unique id to bootstrap through, as 256 hex digits.
pub const ENV_ID: &str = "OXCCL_PROC_ID";
/// Environment variable selecting the device kind: `1` = rank r on CUDA device r, `0` = CPU-target
/// device r.
pub const ENV_GPU: &str = "OXCCL_PROC_GPU";

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of hex text `s` (`what` names it in errors): `InvalidArgument` when `s` has an odd
/// length or a non-hex digit.
pub fn from_hex(what: &str, s: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::invalid(format!("{what}={s:?} is not hex bytes")));
    }
    (0..s.len() / 2)
        .map(|i| {
            u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| Error::invalid(format!("{what} is not hex")))
        })
        .collect()
}

/// The unique-id bytes `make` returns on rank 0, on every rank of the control bootstrap `ctl`:
/// an allgather to which only rank 0 contributes (every rank calls it in lockstep). How a child
/// joins a communicator of its own (oxccl's or NCCL's) after the control bootstrap.
///
/// Errors: `make`'s on rank 0; the bootstrap's; `Remote` when rank 0 sent no id of
/// [`UNIQUE_ID_BYTES`].
pub fn share_id(ctl: &Bootstrap, make: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES]>) -> Result<Vec<u8>> {
    let mine = if ctl.rank() == 0 {
        make()?.to_vec()
    } else {
        Vec::new()
    };
    let mut all = ctl.allgather(&mine)?;
    let id = all.first_mut().map(std::mem::take).unwrap_or_default();
    if id.len() != UNIQUE_ID_BYTES {
        return Err(Error::Remote(format!(
            "rank 0 sent a {}-byte unique id (expected {UNIQUE_ID_BYTES})",
            id.len()
        )));
    }
    Ok(id)
}

/// Starts `n` processes of this binary with its own arguments, rank r with the
/// environment of [`ChildRank::from_env`] (device r of the kind `gpu` says), and waits for them;
/// rank 0's standard output is this process's, the other ranks' is discarded. When a rank fails,
/// the others are killed (they could only wait for it) and `Some((rank, status))` names the first
/// failure; `None` when all succeed. Errors: a process that cannot start (`System`), or no root
/// for the control bootstrap (see [`get_unique_id`]).
pub fn spawn(n: usize, gpu: bool) -> Result<Option<(usize, std::process::ExitStatus)>> {
    let id = get_unique_id()?;
    spawn_ranks(n, gpu, &id, |_| Launch::default())
}

/// How one rank's process starts: through a wrapping command (empty: directly; else a command
/// that ends by executing the program and arguments it is given, e.g. `ip netns exec NAME`),
/// with extra environment variables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launch {
    pub wrap: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// As [`spawn`], bootstrapped through `id`, rank r started as `launch(r)` says.
pub fn spawn_ranks(
    n: usize,
    gpu: bool,
    id: &UniqueId,
    launch: impl Fn(usize) -> Launch,
) -> Result<Option<(usize, std::process::ExitStatus)>> {
    let hex = to_hex(&id.to_bytes());
    let exe = std::env::current_exe().map_err(|e| Error::System(format!("locating this program: {e}")))?;
    let mut children = Vec::with_capacity(n);
    for r in 0..n {
        let how = launch(r);
        let mut cmd = match how.wrap.split_first() {
            Some((prog, args)) => {
                let mut c = std::process::Command::new(prog);
                c.args(args).arg(&exe);
                c
            }
            None => std::process::Command::new(&exe),
        };
        cmd.envs(how.env.iter().map(|(k, v)| (k, v)));
        let child = cmd
            .args(std::env::args_os().skip(1))
            .env(ENV_RANK, r.to_string())
            .env(ENV_NRANKS, n.to_string())
            .env(ENV_ID, &hex)
            .env(ENV_GPU, if gpu { "1" } else { "0" })
            .stdout(if r == 0 {
                std::process::Stdio::inherit()
            } else {
                std::process::Stdio::null()
            })
            .spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(Error::System(format!(
                    "starting rank {r} ({}{}): {e}",
                    how.wrap.iter().map(|w| format!("{w} ")).collect::<String>(),
                    exe.display()
                )));
            }
        }
    }
    // Failed ranks in the order they were seen. A rank's death makes its peers fail within
    // milliseconds, so after the first failure the others get FAILURE_GRACE to exit on their own
    // before they are stopped, and a rank ended by a signal (killed from outside, or crashed) is
    // named before ranks that exited with an error of their own.
    let mut failed: Vec<(usize, std::process::ExitStatus)> = Vec::new();
    let mut first_failure: Option<std::time::Instant> = None;
    while children.iter().any(Option::is_some) {
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            let done = c
                .try_wait()
                .map_err(|e| Error::System(format!("waiting for rank {r}: {e}")))?;
            if let Some(status) = done {
                *slot = None;
                if !status.success() {
                    failed.push((r, status));
                    first_failure.get_or_insert_with(std::time::Instant::now);
                }
            }
        }
        if first_failure.is_some_and(|t| t.elapsed() >= FAILURE_GRACE) {
            for c in children.iter_mut().flatten() {
                let _ = c.kill();
                let _ = c.wait();
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(blame(&failed))
}

/// How long [`spawn_ranks`] lets the other ranks exit on their own after the first failure.
const FAILURE_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

/// The failure to report among `failed` (in the order seen): the first rank ended by a signal,
/// else the first seen.
fn blame(failed: &[(usize, std::process::ExitStatus)]) -> Option<(usize, std::process::ExitStatus)> {
    use std::os::unix::process::ExitStatusExt;
    failed
        .iter()
        .find(|(_, s)| s.signal().is_some())
        .or(failed.first())
        .copied()
}

#[cfg(test)]
mod blame_tests {
    use super::blame;
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    #[test]
    fn a_rank_ended_by_a_signal_is_named_before_ranks_that_exited_with_errors() {
        // Wait statuses: exit code 2 is 2 << 8; SIGKILL is signal 9 in the low bits.
        let code2 = ExitStatus::from_raw(2 << 8);
        let killed = ExitStatus::from_raw(9);
        assert_eq!(blame(&[]), None);
        assert_eq!(blame(&[(0, code2), (2, killed), (1, code2)]), Some((2, killed)));
        assert_eq!(blame(&[(1, code2), (0, code2)]), Some((1, code2)));
    }
}

/// Most simulated hosts of [`Hosts`] (one /24 subnet, one bridge).
pub const MAX_HOSTS: usize = 64;

/// Port of the bootstrap root in host 0's namespace (the namespaces are private to one run, so a
/// fixed port cannot collide).
const ROOT_PORT: u16 = 29400;

/// Prefix of every namespace [`Hosts`] creates: `oxh<pid>s` (the switch), `oxh<pid>h<k>` (host k).
const NS_PREFIX: &str = "oxh";

/// The host (0..hosts) of rank `rank` of `nranks`: contiguous blocks, `rank · hosts / nranks`,
/// so each host runs `nranks / hosts` ranks when that divides (else the counts differ by one).
pub fn host_of(rank: usize, nranks: usize, hosts: usize) -> usize {
    rank * hosts / nranks.max(1)
}

/// Runs iproute2's `ip` with `args`. Errors name the command line and say why it failed: `ip`
/// missing, or its own message (e.g. "Operation not permitted" when not root).
fn ip(args: &[&str]) -> std::result::Result<(), String> {
    let line = format!("ip {}", args.join(" "));
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| {
            format!("`{line}` could not run: {e} (simulated hosts need iproute2's `ip` on the PATH)")
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "`{line}` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

/// Simulated hosts on one machine: `hosts` network namespaces (`oxh<pid>h<k>`), each with a veth
/// `oxeth<k>` at 10.78.0.<k+1>/24 whose peer is on a bridge in a switch namespace (`oxh<pid>s`),
/// plus loopback. Nothing is added to the caller's own namespace, and only these addresses are
/// used. Dropping it deletes every namespace (and with them the veths and the bridge).
#[derive(Debug)]
pub struct Hosts {
    /// Host namespaces, host k at index k.
    hosts: Vec<String>,
    /// The switch namespace, once created.
    switch: Option<String>,
}

impl Hosts {
    /// Creates `hosts` (2..=[`MAX_HOSTS`]) simulated hosts, after deleting namespaces that earlier
    /// runs left behind (their process is gone, e.g. killed by a signal). Errors: `InvalidArgument`
    /// for a count out of range; `System` naming the `ip` command that failed and why (network
    /// namespaces need root, or CAP_SYS_ADMIN and CAP_NET_ADMIN, and iproute2); what was created
    /// before the failure is deleted.
    pub fn create(hosts: usize) -> Result<Hosts> {
        if !(2..=MAX_HOSTS).contains(&hosts) {
            return Err(Error::invalid(format!(
                "--hosts {hosts} is out of range for simulated hosts (accepted: 2..={MAX_HOSTS})"
            )));
        }
        remove_stale_namespaces();
        let pid = std::process::id();
        let mut h = Hosts {
            hosts: Vec::new(),
            switch: None,
        };
        let why = |e: String| {
            Error::System(format!(
                "--hosts {hosts}: setting up the simulated hosts (network namespaces) failed: {e}"
            ))
        };
        let sw = format!("{NS_PREFIX}{pid}s");
        ip(&["netns", "add", &sw]).map_err(why)?;
        h.switch = Some(sw.clone());
        for args in [
            vec!["-n", &sw, "link", "add", "oxbr", "type", "bridge"],
            vec!["-n", &sw, "link", "set", "oxbr", "up"],
        ] {
            ip(&args).map_err(why)?;
        }
        for k in 0..hosts {
            let ns = format!("{NS_PREFIX}{pid}h{k}");
            ip(&["netns", "add", &ns]).map_err(why)?;
            h.hosts.push(ns.clone());
            let (port, eth, cidr) = (
                format!("oxsw{k}"),
                format!("oxeth{k}"),
                format!("{}/24", host_addr(k)),
            );
            for args in [
                vec![
                    "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", &eth, "netns", &ns,
                ],
                vec!["-n", &sw, "link", "set", &port, "master", "oxbr"],
                vec!["-n", &sw, "link", "set", &port, "up"],
                vec!["-n", &ns, "addr", "add", &cidr, "dev", &eth],
                vec!["-n", &ns, "link", "set", &eth, "up"],
                vec!["-n", &ns, "link", "set", "lo", "up"],
            ] {
                ip(&args).map_err(why)?;
            }
        }
        ip(&["netns", "exec", &h.hosts[0], "true"]).map_err(why)?;
        tracing::debug!(target: "oxccl::perf", hosts = ?h.hosts, switch = %sw, "simulated hosts up");
        Ok(h)
    }

    /// Names of the host namespaces, host k at index k.
    pub fn namespaces(&self) -> &[String] {
        &self.hosts
    }

    /// The interface of host `k` (its veth).
    pub fn ifname(k: usize) -> String {
        format!("oxeth{k}")
    }

    /// The unique id every rank bootstraps through: a root that rank 0 (on host 0) starts at host
    /// 0's address (NCCL_COMM_ID style), reachable from every host.
    pub fn unique_id(&self) -> Result<UniqueId> {
        UniqueId::from_comm_id(&format!("{}:{ROOT_PORT}", host_addr(0)))
    }

    /// How a rank on host `k` starts: inside the host's namespace (`ip netns exec`), with its own
    /// host name (`OXCCL_HOSTID`, so ranks of other hosts are on other hosts) and the host's veth
    /// as the interface for the bootstrap and the socket network (`OXCCL_SOCKET_IFNAME`).
    pub fn launch(&self, k: usize) -> Launch {
        let ns = self.hosts.get(k).cloned().unwrap_or_default();
        Launch {
            wrap: vec!["ip".into(), "netns".into(), "exec".into(), ns.clone()],
            env: vec![
                ("OXCCL_HOSTID".into(), ns),
                ("OXCCL_SOCKET_IFNAME".into(), format!("={}", Hosts::ifname(k))),
            ],
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain(&self.switch) {
            if let Err(e) = ip(&["netns", "del", ns]) {
                tracing::warn!(target: "oxccl::perf", "removing simulated host namespace {ns}: {e}");
            }
        }
    }
}

/// Address of simulated host `k`.
fn host_addr(k: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(10, 78, 0, k as u8 + 1)
}

/// Deletes namespaces named by [`Hosts`] whose creating process no longer runs.
fn remove_stale_namespaces() {
    let Ok(out) = std::process::Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let tail = &rest[digits.len()..];
        let ours = tail == "s"
            || tail
                .strip_prefix('h')
                .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()));
        if ours
            && let Ok(pid) = digits.parse::<u32>()
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            tracing::info!(target: "oxccl::perf", "removing namespace {name} left by process {pid}");
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// This process's rank, as [`spawn`] started it.
#[derive(Clone, Debug)]
pub struct ChildRank {
    pub rank: usize,
    pub nranks: usize,
    /// The control bootstrap's id.
    pub id: UniqueId,
    pub device: Device,
}

impl ChildRank {
    /// The rank [`spawn`] gave this process, or `None` when [`ENV_RANK`] is unset (the parent).
    /// Errors: `InvalidArgument` naming the variable when one is missing or malformed.
    pub fn from_env() -> Result<Option<ChildRank>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`ChildRank::from_env`], with the variables given by `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<ChildRank>> {
        let Some(rank) = get(ENV_RANK) else {
            return Ok(None);
        };
        let var = |k: &str| get(k).ok_or_else(|| Error::invalid(format!("{k} is not set ({ENV_RANK} is)")));
        let num = |k: &str, v: &str| {
            v.parse::<usize>()
                .map_err(|_| Error::invalid(format!("{k}={v:?} is not a number")))
        };
        let rank = num(ENV_RANK, &rank)?;
        let nranks = num(ENV_NRANKS, &var(ENV_NRANKS)?)?;
        if rank >= nranks {
            return Err(Error::invalid(format!(
                "{ENV_RANK}={rank} is out of range for {ENV_NRANKS}={nranks} (accepted: 0..{nranks})"
            )));
        }
        let id = UniqueId::from_bytes(&from_hex(ENV_ID, &var(ENV_ID)?)?)?;
        let device = match var(ENV_GPU)?.as_str() {
            "1" => Device::Cuda(rank),
            "0" => Device::Cpu(rank),
            other => return Err(Error::invalid(format!("{ENV_GPU}={other:?} is not 0 or 1"))),
        };
        Ok(Some(ChildRank {
            rank,
            nranks,
            id,
            device,
        }))
    }
}
