//! Launch ordering across the ranks of one process (a piece of NCCL's `enqueue.cc`).
//!
//! A rank's kernel spins until its peers' kernels of the same call run, so the ranks of one
//! process must never queue work that waits for one of their kernels ahead of a peer's kernel
//! that this kernel needs. Two places can:
//!
//! - **A kernel module load** may wait for every kernel running in the context (CUDA's "lazy
//!   loading" caveat): before a rank loads one, every rank of its `init_all` group must have
//!   launched its earlier calls.
//! - **A GPU's hardware queues.** Streams share the GPU's hardware queues
//!   (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default; fresh streams often land on the queue of a
//!   live one). A rank's next kernel waits in its stream for its previous one to end, and on a
//!   shared hardware queue it then holds back everything queued after it, a peer's kernel
//!   included. So a rank sharing its GPU with other ranks of its group launches its call `n + 1`
//!   only once each of them has launched its call `n` ([`wait_launches`] before every launch).
//!   Ranks on separate GPUs have queues of their own and never wait here.
//!
//! The slowest rank never waits, so the group cannot wait on itself as long as every rank issues
//! its calls: from threads of their own, or from one thread that issues call `n` on every rank
//! before call `n + 1` on any (NCCL's rule for one thread driving several devices).
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a rank waits for its peers before it says so in the log (it keeps waiting: the
/// peers' calls are the user's, and `abort` ends the wait).
const LAUNCH_WAIT_WARN: Duration = Duration::from_secs(10);

/// Waits until every peer's count of launched kernels (`peers`: rank and counter) is at least
/// `issued` (the kernels this rank launched before its next one), or until `abort` is raised
/// (an error naming the ranks behind). `why` ends the log and error messages ("before loading
/// kernel ..."). Returns at once when no peer is behind.
pub(super) fn wait_launches(
    peers: &[(usize, &AtomicU64)],
    issued: u64,
    abort: &AtomicU32,
    rank: usize,
    why: &dyn Fn() -> String,
) -> Result<()> {
    let behind = || -> Vec<usize> {
        peers
            .iter()
            .filter(|(_, l)| l.load(Ordering::Acquire) < issued)
            .map(|(r, _)| *r)
            .collect()
    };
    if behind().is_empty() {
        return Ok(());
    }
    let start = Instant::now();
    let mut warned = false;
    let mut spins = 0u32;
    loop {
        let late = behind();
        if late.is_empty() {
            return Ok(());
        }
        if abort.load(Ordering::Acquire) != 0 {
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: the communicator was aborted while waiting for ranks {late:?} to launch their first {issued} calls {}",
                why()
            )));
        }
        if !warned && start.elapsed() > LAUNCH_WAIT_WARN {
            warned = true;
            tracing::warn!(target: "oxccl::enqueue", "rank {rank}: waiting {:?} for ranks {late:?} to launch their first {issued} calls {} (did they skip a call, or does one thread issue several calls of one rank in a row?)", start.elapsed(), why());
        }
        // A peer on another thread is usually a few microseconds behind: yield first, then sleep.
        if spins < 200 {
            spins += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn returns_at_once_when_no_peer_is_behind() {
        let (a, b) = (AtomicU64::new(3), AtomicU64::new(5));
        let abort = AtomicU32::new(0);
        let t = Instant::now();
        wait_launches(&[(1, &a), (2, &b)], 3, &abort, 0, &|| "x".into()).unwrap();
        assert!(t.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn waits_until_the_slowest_peer_launches() {
        let late = Arc::new(AtomicU64::new(1));
        let ahead = AtomicU64::new(9);
        let abort = AtomicU32::new(0);
        let l = late.clone();
        let bump = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            l.store(2, Ordering::Release);
        });
        let t = Instant::now();
        wait_launches(&[(1, &ahead), (2, &late)], 2, &abort, 0, &|| "x".into()).unwrap();
        let waited = t.elapsed();
        bump.join().unwrap();
        assert!(
            waited >= Duration::from_millis(140),
            "returned after {waited:?}, before the peer launched"
        );
        assert_eq!(late.load(Ordering::Acquire), 2);
    }

    #[test]
    fn an_abort_ends_the_wait_naming_the_ranks_behind() {
        let late = AtomicU64::new(0);
        let abort = Arc::new(AtomicU32::new(0));
        let a = abort.clone();
        let raise = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            a.store(1, Ordering::Release);
        });
        let e = wait_launches(&[(3, &late)], 1, &abort, 2, &|| "before loading kernel k".into()).unwrap_err();
        raise.join().unwrap();
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
        assert!(
            msg.contains("rank 2")
                && msg.contains("[3]")
                && msg.contains("first 1 calls before loading kernel k"),
            "{msg}"
        );
    }
}
