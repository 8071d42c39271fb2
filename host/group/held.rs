//! Memory held by a group's queued calls: a send or receive issued inside
//! [`super::group_start`]/[`super::group_end`] borrows its [`DeviceBuffer`] only for the call but
//! runs at the outermost end, so the buffer's range is held under the group's id until then.
//! A buffer dropped while any group holds part of it is not freed: it is parked under that
//! group and dropped (freed as every buffer is, after the work queued on it) when the group's
//! outermost end has queued its work, or dropped it. Addresses are unique in the process (host
//! memory on the CPU target, the unified address space of CUDA devices), so ranges are compared
//! without their device. NCCL has no counterpart: its C callers keep buffers alive themselves.
use crate::mem::DeviceBuffer;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One held range `lo..hi` of the group `group`.
struct Range {
    group: u64,
    lo: u64,
    hi: u64,
}

#[derive(Default)]
struct Held {
    ranges: Vec<Range>,
    /// Buffers dropped while held, with the group that held them.
    parked: Vec<(u64, DeviceBuffer)>,
}

static HELD: Mutex<Held> = Mutex::new(Held {
    ranges: Vec::new(),
    parked: Vec::new(),
});
/// `HELD.ranges.len()`, read without the lock by every buffer's drop.
static NRANGES: AtomicUsize = AtomicUsize::new(0);

fn held() -> std::sync::MutexGuard<'static, Held> {
    // A panic while the lock was held left the lists whole (every change is one push or
    // retain), so a poisoned lock is still usable.
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

/// Holds each range `(addr, bytes)` of `ranges` for `group` until [`release`] (nothing for a
/// NULL address or 0 bytes); one lock for all of them.
pub(crate) fn hold(group: u64, ranges: &[(u64, u64)]) {
    let mut held_ranges = ranges.iter().filter(|&&(addr, bytes)| addr != 0 && bytes != 0).peekable();
    if held_ranges.peek().is_none() {
        return;
    }
    let mut h = held();
    for &(addr, bytes) in held_ranges {
        h.ranges.push(Range {
            group,
            lo: addr,
            hi: addr.saturating_add(bytes),
        });
    }
    NRANGES.store(h.ranges.len(), Ordering::Release);
}

/// Called by a buffer's drop with the buffer spanning `addr..addr + bytes`: when a group holds
/// part of it, `take` makes the buffer to park (its allocation moved out of the one being
/// dropped) and `true` is returned; the caller then frees nothing.
pub(crate) fn park_if_held(addr: u64, bytes: u64, take: impl FnOnce() -> DeviceBuffer) -> bool {
    if NRANGES.load(Ordering::Acquire) == 0 {
        return false;
    }
    let hi = addr.saturating_add(bytes.max(1));
    let mut h = held();
    let Some(group) = h
        .ranges
        .iter()
        .find(|r| r.lo < hi && addr < r.hi)
        .map(|r| r.group)
    else {
        return false;
    };
    tracing::debug!(
        target: "oxccl::group",
        group,
        bytes,
        "a buffer dropped while a group holds calls on it is freed after the group's end"
    );
    h.parked.push((group, take()));
    true
}

/// Ends what `group` holds: its ranges, and drops the buffers parked under it (outside the
/// lock: a CPU-target buffer's drop waits for the work queued on its device).
pub(crate) fn release(group: u64) {
    // No range held anywhere: nothing of `group` to drop, nothing parked (a buffer is parked
    // only while a range of its group is held, and both go together here).
    if NRANGES.load(Ordering::Acquire) == 0 {
        return;
    }
    let parked: Vec<DeviceBuffer> = {
        let mut h = held();
        h.ranges.retain(|r| r.group != group);
        NRANGES.store(h.ranges.len(), Ordering::Release);
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut h.parked)
            .into_iter()
            .partition(|(g, _)| *g == group);
        h.parked = others;
        mine.into_iter().map(|(_, b)| b).collect()
    };
    drop(parked);
}

/// Releases its group when dropped: at the outermost end of a group, whatever way the end
/// leaves (launched, refused, dropped, unwound).
pub(crate) struct ReleaseOnDrop(pub(crate) Option<u64>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(g) = self.0 {
            release(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Device;

    #[test]
    fn a_buffer_is_parked_while_any_byte_of_it_is_held_and_freed_at_release() {
        // Group ids far from those of real groups (a process-wide counter from 1).
        let (g1, g2) = (u64::MAX - 1, u64::MAX - 2);
        let a = Device::Cpu(0).alloc(4096).unwrap();
        let b = Device::Cpu(0).alloc(4096).unwrap();
        let (a_addr, b_addr) = (a.slice(0, 1).unwrap().addr, b.slice(0, 1).unwrap().addr);
        // The last byte of `a` held by g1; nothing of `b` (a range ending at its start).
        hold(g1, &[(a_addr + 4095, 1)]);
        hold(g2, &[(b_addr - 16, 16)]);
        drop(b);
        drop(a);
        // Other tests' groups may hold and park meanwhile: only these two groups are looked at.
        let parked_groups = |h: &Held| {
            h.parked
                .iter()
                .map(|(g, _)| *g)
                .filter(|g| *g == g1 || *g == g2)
                .collect::<Vec<_>>()
        };
        assert_eq!(parked_groups(&held()), vec![g1], "only the held buffer is parked");
        release(g2);
        assert_eq!(
            parked_groups(&held()),
            vec![g1],
            "another group's release keeps it"
        );
        release(g1);
        let h = held();
        assert!(
            h.parked.iter().all(|(g, _)| *g != g1) && h.ranges.iter().all(|r| r.group != g1 && r.group != g2)
        );
    }
}
