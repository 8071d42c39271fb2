//! Collective algorithms: ring and tree schedules over chunks, written only in terms of
//! the [`crate::proto::Primitives`] verbs. Mirrors NCCL's `all_reduce.h`, `broadcast.h`, ...

use crate::proto::Primitives;

pub mod all_gather;
pub mod all_reduce;
pub mod broadcast;
pub mod reduce;
pub mod reduce_scatter;
pub mod send_recv;
pub mod tree;

/// What an algorithm needs to know about its ring and channel.
#[derive(Clone, Copy)]
pub struct RingCtx {
    pub nranks: u64,
    /// Ring order starting with our own rank (`user_ranks[k]` is `k` hops downstream).
    pub user_ranks: *const u32,
    /// This block's channel and the channel count of the operation.
    pub channel: u64,
    pub nchannels: u64,
    /// Whether the kernel is a checked call's whose checking block runs beside this one (or, in
    /// a one-block checked launch, checked the call first and armed the gate open): the block
    /// passes its gate before its first write to a user buffer ([`RingCtx::gate`]).
    pub gated: bool,
    /// What the gate's first pass needs: thread 0's look at the verdict word as the block armed
    /// its gate (`crate::check::checked`).
    pub seen: u64,
    /// Whether a gated block may send ahead of its gate where its collective does (Broadcast's
    /// root and AllGather's ranks on LL and LL128): only in the checked entries of those
    /// collectives ([`crate::abi::checked_entry`]; on the CPU target in every body, where the GPU
    /// would run the checked entry: `crate::abi::runs_checked_entry`), so the entries of
    /// unchecked calls keep the code they have without the check.
    pub ahead: bool,
}

impl RingCtx {
    /// The call check's gate ([`Primitives::gate`]) where the kernel has one, else open: every
    /// algorithm calls it before its first verb that writes a user buffer. False when the call
    /// must stop.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn gate<P: Primitives>(&self, p: &mut P) -> bool {
        !self.gated || p.gate(self.seen)
    }

    /// User rank `k` hops downstream of us.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn user_rank(&self, k: u64) -> u64 {
        // SAFETY: `user_ranks` holds `nranks` entries (host contract); `k % nranks` is in range.
        unsafe { *self.user_ranks.add((k % self.nranks) as usize) as u64 }
    }
}

/// Elements rounded up to a whole number of 16-byte packs of `esize`-byte elements.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub const fn align_elems(n: u64, esize: u64) -> u64 {
    let per = crate::abi::PACK_BYTES / esize;
    n.div_ceil(per) * per
}

/// The chunk of each of `parts` owners in a loop iteration with `remaining` elements left and
/// chunks of at most `chunk_elems` (NCCL's `realChunkSize`): an even share rounded up to whole
/// packs, but never more than `chunk_elems` — the loop advances by `parts × chunk_elems`, so a
/// larger chunk would overlap the next iteration's (an in-place call would then reduce elements
/// twice).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn loop_chunk(chunk_elems: u64, remaining: u64, parts: u64, esize: u64) -> u64 {
    core::cmp::min(
        align_elems(core::cmp::min(chunk_elems, remaining.div_ceil(parts)), esize),
        chunk_elems,
    )
}

/// The smallest chunk a checked call's sender sends before the call check's gate: below it the
/// local copy after the gate costs more than the overlap gains (the check's cost there is below
/// 1 µs without it).
pub const AHEAD_MIN_BYTES: u64 = 8 << 10;

/// The largest chunk an AllGather rank sends whole before the gate; of a larger one it sends
/// half (measured on an H100: whole chunks up to 64 KiB, halves of 120 KiB chunks).
pub const AHEAD_WHOLE_MAX_BYTES: u64 = 64 << 10;

/// The smallest element for which AllGather's checked entries send before the gate. The 1- and
/// 2-byte entries gate first: sending ahead made LL128's 16-bit kernel spill 208 bytes instead
/// of 64 (ptxas), and it was measured faster at 2–8 MiB only in a filtered build, whose PTX is
/// not the full build's (docs/benchmarks.md).
pub const AHEAD_MIN_ELEM_BYTES: u64 = 4;

/// How many leading elements of a checked AllGather's first chunk of `n` elements of `esize`
/// bytes its sender sends before the call check's gate, so that the check overlaps the first
/// hop: 0 unless the primitives send to a FIFO ([`Primitives::sends_to_fifo`]) and the chunk
/// holds [`AHEAD_MIN_BYTES`]; the whole chunk up to [`AHEAD_WHOLE_MAX_BYTES`], else half of it
/// in whole 16-byte packs. Every rank computes the same number from `n`, and splits every verb
/// on that chunk there alike.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ahead_elems<P: Primitives>(p: &P, n: u64, esize: u64) -> u64 {
    let bytes = n * esize;
    if !p.sends_to_fifo() || bytes < AHEAD_MIN_BYTES {
        0
    } else if bytes <= AHEAD_WHOLE_MAX_BYTES {
        n
    } else {
        let per = crate::abi::PACK_BYTES / esize;
        n / 2 / per * per
    }
}

/// Channel `channel`'s chunk (of `nchannels`) of the loop at grid offset `grid_off` (a multiple
/// of `nchannels × chunk_elems` below `count`): its offset and length in elements, the length
/// possibly 0 on the last loop. Rings and trees cut their loops alike.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn chunk_at(
    channel: u64,
    nchannels: u64,
    grid_off: u64,
    count: u64,
    chunk_elems: u64,
    esize: u64,
) -> (u64, u64) {
    let real_chunk = loop_chunk(chunk_elems, count - grid_off, nchannels, esize);
    let off = grid_off + channel * real_chunk;
    let len = if off >= count {
        0
    } else {
        core::cmp::min(real_chunk, count - off)
    };
    (off, len)
}

/// Walks this channel's chunks of a `count`-element vector cut per loop into `nchannels` chunks of
/// at most `chunk_elems` (NCCL's grid loop of the one-block-per-rank collectives): calls
/// `step(offset, len)` once per loop ([`chunk_at`]) from grid offset `from` (0, or past loops
/// the caller ran itself); stops when it returns `false` (abort).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn channel_chunks(
    r: &RingCtx,
    from: u64,
    count: u64,
    chunk_elems: u64,
    esize: u64,
    mut step: impl FnMut(u64, u64) -> bool,
) {
    let loop_size = r.nchannels * chunk_elems;
    let mut grid_off = from;
    while grid_off < count {
        let (off, len) = chunk_at(r.channel, r.nchannels, grid_off, count, chunk_elems, esize);
        if !step(off, len) {
            return;
        }
        grid_off += loop_size;
    }
}

#[cfg(test)]
mod tests {
    use super::loop_chunk;

    #[test]
    fn a_rounded_chunk_never_exceeds_the_chunk() {
        // 130 floats (an LL step of 65 lines): an even share of a large remainder is the chunk
        // itself, not its round-up to 132 (which would overlap the next loop's chunk).
        assert_eq!(loop_chunk(130, 1 << 20, 1, 4), 130);
        assert_eq!(loop_chunk(270, 1 << 20, 4, 4), 270);
        // Shares below the chunk round up to whole packs (4 floats) and stay within it.
        assert_eq!(loop_chunk(130, 2000 - 1040, 8, 4), 120);
        assert_eq!(loop_chunk(130, 257, 2, 4), 130);
        assert_eq!(loop_chunk(128, 257, 2, 4), 128);
        assert_eq!(loop_chunk(128, 10, 2, 4), 8);
        // For every shape the loop's parts cover the remainder without overlap.
        for chunk in [1u64, 7, 16, 130, 270, 4096] {
            for esize in [1u64, 2, 4, 8] {
                for parts in [1u64, 2, 3, 8] {
                    for rem in [1u64, 5, 129, 1000, 1 << 16] {
                        let c = loop_chunk(chunk, rem, parts, esize);
                        assert!(
                            c <= chunk && c * parts >= rem.min(chunk * parts),
                            "{chunk} {esize} {parts} {rem}: {c}"
                        );
                    }
                }
            }
        }
    }
}
