//! Launch ordering across the ranks of one process (a piece of NCCL's `enqueue.cc`): before a
//! rank loads a kernel module, every rank of its `init_all` group must have launched its earlier
//! calls.
use super::LaunchState;
use crate::error::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// How long a rank waits for its `init_all` group before it says so in the log (it keeps
/// waiting: the peers' calls are the user's, and `abort` ends the wait).
const GROUP_LAUNCH_WARN: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits until every rank of an `init_all` group (`launches`; empty for `init_rank`, whose ranks
/// have contexts of their own) has launched at least `issued` kernels, i.e. everything before
/// this rank's next one, or until `abort` is raised (an error). Called before a rank loads a
/// kernel module: CUDA's module load may wait for every kernel running in the context (CUDA's
/// "lazy loading" caveat), and a peer's kernel that waits for this rank's next kernel would then
/// never finish. Once every earlier call of every rank is launched, each running kernel can
/// finish, so the load does; the slowest rank never waits, so the group cannot wait on itself.
pub(super) fn wait_group_launches(
    launches: &[Arc<LaunchState>],
    issued: u64,
    abort: &AtomicU32,
    rank: usize,
    kernel: &str,
) -> Result<()> {
    let start = std::time::Instant::now();
    let mut warned = false;
    loop {
        let behind: Vec<usize> = launches
            .iter()
            .enumerate()
            .filter(|(_, l)| l.issued.load(Ordering::Acquire) < issued)
            .map(|(r, _)| r)
            .collect();
        if behind.is_empty() {
            return Ok(());
        }
        if abort.load(Ordering::Acquire) != 0 {
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: the communicator was aborted while waiting for ranks {behind:?} to launch their call {issued} before loading {kernel}"
            )));
        }
        if !warned && start.elapsed() > GROUP_LAUNCH_WARN {
            warned = true;
            tracing::warn!(target: "oxccl::enqueue", "rank {rank}: waiting {:?} for ranks {behind:?} to launch their call {issued} before loading kernel {kernel} (did they skip a call?)", start.elapsed());
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}
