//! The bootstrap layer (host/bootstrap): unique ids, the root, the ring, allgather, barrier and
//! point-to-point messages, with ranks as threads and (once) as child processes (`exchange`),
//! and what it refuses: junk connections, mismatched or out-of-range ranks, a refused root,
//! interfaces that match nothing, corrupt ids (`errors`). CPU only, loopback only (interfaces
//! chosen through `BootstrapConfig`, never the environment, except in the child processes, which
//! get their own environment); every test is bounded by the bootstrap timeout. CASES.md C31 (no
//! matching interface) and C33 (refused root) are here too; their environment-variable spellings
//! are in tests/config/bootstrap_env.rs.
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod errors;
mod exchange;

use oxccl::bootstrap::{Bootstrap, BootstrapConfig, UniqueId};
use std::sync::Arc;
use std::time::Duration;

/// Loopback only, 30 s bound on every step (a hang fails the test instead of blocking CI).
/// Also installs a log subscriber (`OXCCL_LOG=oxccl::bootstrap=debug` shows the bootstrap's
/// log lines with `--nocapture`).
pub fn lo() -> BootstrapConfig {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OXCCL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    BootstrapConfig {
        timeout: Duration::from_secs(30),
        ifname: Some("=lo".into()),
        ..Default::default()
    }
}

/// Runs `f(rank's bootstrap)` on `n` threads after init; returns the results by rank.
pub fn run<T: Send + 'static>(
    id: UniqueId,
    n: usize,
    cfg: &BootstrapConfig,
    f: impl Fn(Bootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let (f, cfg) = (f.clone(), cfg.clone());
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    let bs = Bootstrap::init_with(&id, r, n, &cfg)
                        .unwrap_or_else(|e| panic!("rank {r}: init: {e}"));
                    assert_eq!((bs.rank(), bs.nranks(), bs.addrs().len()), (r, n, n));
                    f(bs)
                })
                .unwrap()
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect()
}

/// Rank r's blob in call `call`: distinct per rank and call, lengths differ per rank.
pub fn blob(r: usize, n: usize, call: usize) -> Vec<u8> {
    let len = (r * 7 + call) % 23;
    let mut v = format!("call {call} rank {r} of {n}:").into_bytes();
    v.extend((0..len).map(|i| (r * 31 + i * 3 + call) as u8));
    v
}
