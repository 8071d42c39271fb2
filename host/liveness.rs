//! Peer-process liveness of `init_rank` communicators: a process-wide thread checks, every
//! [`CHECK_EVERY`], that the processes of the other ranks of each watched communicator's host are
//! still alive, and when one has exited raises the abort flags of the ranks of this process and
//! of the host's other ranks (the shared abort page), naming the dead rank. Without it a rank
//! whose only link to a dead peer is host memory (SHM, or a ring neighbour waiting on it) spins
//! until the application polls `get_async_error` — and one blocked in a stream synchronize never
//! does. NCCL leaves this to `ncclCommGetAsyncError` polling; oxccl promises no hang. Peers on
//! other hosts are the NET proxy's to watch (a lost connection raises the flags of its host).
//!
//! The thread runs only while something is watched (it exits when the last [`Watched`] is
//! dropped), so communicator lifecycles return to their thread baseline.
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// How often watched peers are checked.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);

/// Abort-flag value meaning "another rank failed" (as the proxy and `Comm` use it).
const ABORTED_BY_PEER: u32 = crate::proxy::ABORTED_BY_PEER;
use crate::proxy::ABORT_LINE_WHO;

/// Start time of process `pid` (`/proc/<pid>/stat` field 22, clock ticks since boot) and whether
/// it is a zombie; `None` when there is no such process. A live peer is one whose pid still has
/// the start time it had at init (a reused pid has another).
pub fn proc_start(pid: u32) -> Option<(u64, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start with the state (field 3).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some((fields.get(19)?.parse().ok()?, fields.first() == Some(&"Z")))
}

/// Whether process `pid`, started at `start_time` (see [`proc_start`]), still runs.
pub fn process_alive(pid: u32, start_time: u64) -> bool {
    matches!(proc_start(pid), Some((t, false)) if t == start_time)
}

/// What to watch for one rank of one communicator.
#[derive(Clone, Debug)]
pub struct Watch {
    /// The watching rank (for messages).
    pub rank: usize,
    /// Address of the `u32` flag this rank's kernels and calls poll.
    pub own_flag: u64,
    /// Address of this rank's abort line (flag at +0, the raiser as rank + 1 at
    /// [`ABORT_LINE_WHO`]).
    pub own_line: u64,
    /// Abort lines of the host's other ranks (same layout).
    pub host_lines: Vec<u64>,
    /// The host's ranks in other processes: (rank, pid, start time).
    pub peers: Vec<(usize, u32, u64)>,
}

struct Registry {
    next_id: u64,
    entries: Vec<(u64, Watch)>,
    /// The checking thread runs.
    running: bool,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next_id: 0,
    entries: Vec::new(),
    running: false,
});

fn registry() -> MutexGuard<'static, Registry> {
    // A poisoned lock only means a thread panicked between whole updates of the list.
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// A watched rank; dropping it stops the watch.
#[derive(Debug)]
pub struct Watched {
    id: u64,
}

impl Drop for Watched {
    fn drop(&mut self) {
        registry().entries.retain(|(id, _)| *id != self.id);
    }
}

/// Starts watching `w.peers` (nothing to do when empty: `None`).
///
/// # Safety
/// Every address in `w` (the flags and lines, in the shared abort page) stays valid, and is only
/// accessed atomically, until the returned [`Watched`] is dropped.
pub unsafe fn watch(w: Watch) -> Option<Watched> {
    if w.peers.is_empty() {
        return None;
    }
    let mut reg = registry();
    let id = reg.next_id;
    reg.next_id += 1;
    reg.entries.push((id, w));
    if !reg.running {
        match std::thread::Builder::new()
            .name("oxccl-liveness".into())
            .stack_size(64 << 10)
            .spawn(run)
        {
            Ok(_) => reg.running = true,
            Err(e) => {
                tracing::warn!(target: "oxccl::init", "cannot start the peer-liveness thread ({e}): a dead peer process shows only through get_async_error");
            }
        }
    }
    Some(Watched { id })
}

/// Raises the `u32` at `flag` to [`ABORTED_BY_PEER`] and records `who` + 1 at `who_at` (0: none),
/// each only if not yet set.
///
/// # Safety
/// Both addresses are valid, 4-byte aligned and accessed atomically by everyone.
unsafe fn raise(flag: u64, who_at: u64, who: usize) {
    // SAFETY: caller's contract.
    unsafe {
        if who_at != 0 {
            let _ = AtomicU32::from_ptr(who_at as *mut u32).compare_exchange(
                0,
                who as u32 + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        let _ = AtomicU32::from_ptr(flag as *mut u32).compare_exchange(
            0,
            ABORTED_BY_PEER,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// The checking thread: every [`CHECK_EVERY`], each watched rank whose host peer process has
/// exited gets its flags raised (once: the entry is then dropped from the list); exits when
/// nothing is watched.
fn run() {
    loop {
        std::thread::sleep(CHECK_EVERY);
        let mut reg = registry();
        if reg.entries.is_empty() {
            reg.running = false;
            return;
        }
        reg.entries.retain(|(_, w)| {
            let Some(&(dead, pid, _)) = w.peers.iter().find(|&&(_, pid, t)| !process_alive(pid, t)) else {
                return true;
            };
            tracing::error!(target: "oxccl::init", rank = w.rank, "peer rank {dead} (process {pid}) has exited; aborting the communicator");
            // SAFETY: the entry is in the list, so its `Watched` lives and the addresses are
            // valid (`watch`'s contract); dropping a `Watched` takes this lock first.
            unsafe {
                raise(w.own_line, w.own_line + ABORT_LINE_WHO, dead);
                raise(w.own_flag, 0, dead);
                for &line in &w.host_lines {
                    raise(line, line + ABORT_LINE_WHO, dead);
                }
            }
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_changed_start_time_is_not() {
        let pid = std::process::id();
        let (t, zombie) = proc_start(pid).expect("own /proc entry");
        assert!(!zombie);
        assert!(process_alive(pid, t));
        assert!(!process_alive(pid, t + 1));
        assert!(proc_start(u32::MAX).is_none());
    }

    #[test]
    fn a_dead_peer_raises_own_and_host_lines_naming_it() {
        // A child that exits at once stands for the dead peer.
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        let start = proc_start(pid).map_or(1, |(t, _)| t);
        child.wait().expect("wait");
        // Two abort lines, own and a host peer's: [flag, stop, who, unused] each, plus a private
        // flag.
        let lines: [AtomicU32; 8] = std::array::from_fn(|_| AtomicU32::new(0));
        let private = AtomicU32::new(0);
        let addr = |a: &AtomicU32| a.as_ptr() as u64;
        let w = Watch {
            rank: 0,
            own_flag: addr(&private),
            own_line: addr(&lines[0]),
            host_lines: vec![addr(&lines[4])],
            peers: vec![(3, pid, start)],
        };
        // SAFETY: the atomics outlive the watch (dropped below before them).
        let watched = unsafe { watch(w) }.expect("a peer to watch");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while private.load(Ordering::Acquire) == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(watched);
        let got: Vec<u32> = lines.iter().map(|a| a.load(Ordering::Acquire)).collect();
        // Flags raised as "aborted by a peer", the raiser recorded as dead rank 3 + 1.
        assert_eq!(got, vec![ABORTED_BY_PEER, 0, 4, 0, ABORTED_BY_PEER, 0, 4, 0]);
        assert_eq!(private.load(Ordering::Acquire), ABORTED_BY_PEER);
        // Nothing to watch: no entry.
        let none = Watch {
            rank: 0,
            own_flag: 0,
            own_line: 0,
            host_lines: Vec::new(),
            peers: Vec::new(),
        };
        // SAFETY: no peer, nothing is registered or touched.
        assert!(unsafe { watch(none) }.is_none());
    }
}
