//! The phase timer of one communicator setup (`init.rs`), for debug logs.
use std::time::Instant;

/// Times the phases of one `init_rank` for debug logs (`OXCCL_LOG=oxccl::init=debug`): each
/// [`InitPhases::mark`] logs the milliseconds since the previous mark.
pub(super) struct InitPhases {
    pub(super) rank: usize,
    pub(super) start: Instant,
    pub(super) last: std::cell::Cell<Instant>,
}

impl InitPhases {
    pub(super) fn start(rank: usize) -> InitPhases {
        let now = Instant::now();
        InitPhases {
            rank,
            start: now,
            last: std::cell::Cell::new(now),
        }
    }

    pub(super) fn mark(&self, phase: &str) {
        let now = Instant::now();
        let ms = (now - self.last.get()).as_secs_f64() * 1e3;
        self.last.set(now);
        tracing::debug!(target: "oxccl::init", rank = self.rank, ms = format!("{ms:.2}"), "init_rank phase: {phase}");
    }

    pub(super) fn total_ms(&self) -> String {
        format!("{:.2}", self.start.elapsed().as_secs_f64() * 1e3)
    }
}
