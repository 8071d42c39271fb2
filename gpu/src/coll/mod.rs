//! Collective algorithms: ring and tree schedules over chunks, written only in terms of
//! the [`crate::proto::Primitives`] verbs. Mirrors NCCL's `all_reduce.h`, `broadcast.h`, ...

pub mod all_gather;
pub mod all_reduce;
pub mod broadcast;
pub mod reduce;
pub mod reduce_scatter;
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
}

impl RingCtx {
    /// User rank `k` hops downstream of us.
    #[inline(always)]
    pub fn user_rank(&self, k: u64) -> u64 {
        // SAFETY: `user_ranks` holds `nranks` entries (host contract); `k % nranks` is in range.
        unsafe { *self.user_ranks.add((k % self.nranks) as usize) as u64 }
    }
}

/// Elements rounded up to a whole number of 16-byte packs of `esize`-byte elements.
#[inline(always)]
pub const fn align_elems(n: u64, esize: u64) -> u64 {
    let per = crate::abi::PACK_BYTES / esize;
    n.div_ceil(per) * per
}

/// Walks this channel's chunks of a `count`-element vector cut per loop into `nchannels` chunks of
/// at most `chunk_elems` (NCCL's grid loop of the one-block-per-rank collectives): calls
/// `step(offset, len)` once per loop, `len` possibly 0 on the last loop; stops when it returns
/// `false` (abort).
#[inline(always)]
pub fn channel_chunks(
    r: &RingCtx,
    count: u64,
    chunk_elems: u64,
    esize: u64,
    mut step: impl FnMut(u64, u64) -> bool,
) {
    let loop_size = r.nchannels * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let real_chunk = align_elems(
            core::cmp::min(chunk_elems, (count - grid_off).div_ceil(r.nchannels)),
            esize,
        );
        let off = grid_off + r.channel * real_chunk;
        let len = if off >= count {
            0
        } else {
            core::cmp::min(real_chunk, count - off)
        };
        if !step(off, len) {
            return;
        }
        grid_off += loop_size;
    }
}
