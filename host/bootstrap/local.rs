//! The in-process bootstrap: the ranks of one process (NCCL's `ncclCommInitAll`, a group of
//! `ncclCommInitRank` calls) meet through shared memory instead of TCP. The same
//! [`Bootstrap`] calls work — all-gather, barrier, send/recv by tag — so `Comm::init_all` runs
//! exactly the per-rank setup of `Comm::init_rank`; only the transport decides what differs
//! between peers in this process and peers elsewhere.
//!
//! Every rank has a mailbox (messages filed by source rank and tag, as the TCP listener files
//! them). An all-gather is one message to every rank under a tag of its own (the top bit set,
//! which no point-to-point tag uses) carrying the call's sequence number. A rank whose
//! `Bootstrap` is dropped has left: a peer waiting for a message it never sent fails at once
//! with `Remote` naming it instead of waiting out the timeout.
use super::{Bootstrap, Mailbox};
use crate::error::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// Tags of in-process all-gathers: `ALLGATHER_TAG | (sequence & 0x7fff_ffff)`.
const ALLGATHER_TAG: u32 = 0x8000_0000;

/// What the ranks of one in-process bootstrap share.
pub(super) struct LocalHub {
    pub(super) mailboxes: Vec<Arc<Mailbox>>,
    /// Set when a rank's `Bootstrap` is dropped.
    pub(super) left: Vec<AtomicBool>,
}

impl LocalHub {
    /// Marks `rank` as gone and wakes every rank waiting for a message.
    pub(super) fn leave(&self, rank: usize) {
        self.left[rank].store(true, Ordering::Release);
        for m in &self.mailboxes {
            // Taking the lock orders the store before a waiter's next check.
            drop(m.lock());
            m.cond.notify_all();
        }
    }
}

/// One rank's part of an in-process bootstrap.
pub(super) struct LocalLink {
    pub(super) hub: Arc<LocalHub>,
    /// All-gathers so far (every rank makes the same sequence of calls).
    seq: AtomicU32,
}

impl LocalLink {
    /// Every rank's blob, by rank: `mine` goes to every rank's mailbox, then one blob is taken
    /// from every rank's (bounded by the bootstrap timeout; `Remote` when a rank left first).
    pub(super) fn allgather(&self, b: &Bootstrap, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        let tag = ALLGATHER_TAG | (seq & !ALLGATHER_TAG);
        for (r, m) in self.hub.mailboxes.iter().enumerate() {
            if r != b.rank {
                m.push(b.rank, tag, mine.to_vec());
            }
        }
        let mut out = vec![Vec::new(); b.nranks];
        for (r, slot) in out.iter_mut().enumerate() {
            *slot = if r == b.rank { mine.to_vec() } else { b.recv(r, tag)? };
        }
        Ok(out)
    }
}

impl Bootstrap {
    /// The bootstraps of `nranks` ranks of this process, rank `r` at index `r`, meeting through
    /// shared memory (each to be moved to the thread that initializes its rank). Waits are
    /// bounded by `timeout`. Errors: `nranks` outside `1..=MAX_NRANKS` (`InvalidArgument`).
    pub fn in_process(nranks: usize, timeout: Duration) -> Result<Vec<Bootstrap>> {
        if nranks == 0 || nranks > super::MAX_NRANKS {
            return Err(Error::invalid(format!(
                "nranks {nranks} is out of range (accepted: 1..={})",
                super::MAX_NRANKS
            )));
        }
        let hub = Arc::new(LocalHub {
            mailboxes: (0..nranks).map(|_| Arc::new(Mailbox::default())).collect(),
            left: (0..nranks).map(|_| AtomicBool::new(false)).collect(),
        });
        Ok((0..nranks)
            .map(|rank| Bootstrap {
                rank,
                nranks,
                secret: 0,
                timeout,
                addrs: Vec::new(),
                ring: None,
                mailbox: hub.mailboxes[rank].clone(),
                local: Some(LocalLink {
                    hub: hub.clone(),
                    seq: AtomicU32::new(0),
                }),
                wake: None,
                listener: None,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allgather_send_recv_and_barrier_between_threads() {
        let boots = Bootstrap::in_process(3, Duration::from_secs(5)).unwrap();
        std::thread::scope(|s| {
            for b in boots {
                s.spawn(move || {
                    let r = b.rank() as u8;
                    let all = b.allgather(&[r, r]).unwrap();
                    assert_eq!(all, vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
                    let next = (b.rank() + 1) % 3;
                    b.send(next, 7, &[r]).unwrap();
                    let prev = (b.rank() + 2) % 3;
                    assert_eq!(b.recv(prev, 7).unwrap(), vec![prev as u8]);
                    b.barrier().unwrap();
                    let again = b.allgather(&[10 + r]).unwrap();
                    assert_eq!(again, vec![vec![10], vec![11], vec![12]]);
                    assert!(b.is_in_process());
                });
            }
        });
    }

    #[test]
    fn a_rank_that_left_fails_its_peers_at_once() {
        let mut boots = Bootstrap::in_process(2, Duration::from_secs(60)).unwrap();
        let b1 = boots.pop().unwrap();
        let b0 = boots.pop().unwrap();
        drop(b1);
        let t = std::time::Instant::now();
        let e = b0.allgather(&[1]).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(matches!(e, Error::Remote(_)), "{e}");
        assert!(e.to_string().contains("rank 1 has left"), "{e}");
    }

    #[test]
    fn nothing_arriving_times_out() {
        let boots = Bootstrap::in_process(2, Duration::from_millis(100)).unwrap();
        let e = boots[0].recv(1, 3).unwrap_err();
        assert!(matches!(e, Error::Timeout(_)), "{e}");
    }
}
