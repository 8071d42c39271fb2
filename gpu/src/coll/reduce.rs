//! Ring Reduce (NCCL's `reduce.h`): the data flows once around the ring ending at the root; each
//! rank reduces its input into it, and the root writes the final value (with Avg's division).
use super::{RingCtx, align_elems};
use crate::proto::Primitives;

/// This channel's share of a Reduce of `count` elements to user rank `root`.
#[inline(always)]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, root: u64, chunk_elems: u64, esize: u64) {
    let me = r.user_rank(0);
    let prev = r.user_rank(r.nranks - 1);
    let loop_size = r.nchannels * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let real_chunk = align_elems(core::cmp::min(chunk_elems, (count - grid_off).div_ceil(r.nchannels)), esize);
        let off = grid_off + r.channel * real_chunk;
        let len = if off >= count { 0 } else { core::cmp::min(real_chunk, count - off) };
        if prev == root {
            p.send(off, len);
        } else if me == root {
            p.recv_reduce_copy(off, off, len, true);
        } else {
            p.recv_reduce_send(off, len);
        }
        if p.aborted() {
            return;
        }
        grid_off += loop_size;
    }
}
