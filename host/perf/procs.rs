//! One rank per process for the CLI's multi-process modes (`oxccl perf --procs N`, `oxccl
//! init-bench`): the parent starts N copies of the running binary with its own arguments and
//! tells each its rank, the rank count, the device kind and a unique id to bootstrap through, in
//! environment variables; a child finds its rank with [`ChildRank::from_env`].
use crate::Device;
use crate::bootstrap::{UniqueId, get_unique_id};
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

/// Starts `n` processes of this binary with its own arguments, rank r with the
/// environment of [`ChildRank::from_env`] (device r of the kind `gpu` says), and waits for them;
/// rank 0's standard output is this process's, the other ranks' is discarded. When a rank fails,
/// the others are killed (they could only wait for it) and `Some((rank, status))` names the first
/// failure; `None` when all succeed. Errors: a process that cannot start (`System`), or no root
/// for the control bootstrap (see [`get_unique_id`]).
pub fn spawn(n: usize, gpu: bool) -> Result<Option<(usize, std::process::ExitStatus)>> {
    let id = get_unique_id()?;
    let hex = to_hex(&id.to_bytes());
    let exe = std::env::current_exe().map_err(|e| Error::System(format!("locating this program: {e}")))?;
    let mut children = Vec::with_capacity(n);
    for r in 0..n {
        let child = std::process::Command::new(&exe)
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
                    "starting rank {r} ({}): {e}",
                    exe.display()
                )));
            }
        }
    }
    let mut failed = None;
    while children.iter().any(Option::is_some) {
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            let done = c
                .try_wait()
                .map_err(|e| Error::System(format!("waiting for rank {r}: {e}")))?;
            if let Some(status) = done {
                *slot = None;
                if !status.success() && failed.is_none() {
                    failed = Some((r, status));
                }
            }
        }
        if failed.is_some() {
            for c in children.iter_mut().flatten() {
                let _ = c.kill();
                let _ = c.wait();
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(failed)
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
