//! Ring AllGather (NCCL's `all_gather.h`): each rank's block travels the ring once; every rank
//! copies each block to its place (`rank × count`) in the output.
use super::{RingCtx, align_elems};
use crate::proto::Primitives;

/// This channel's share of an AllGather of `count` elements per rank. Input offsets are relative
/// to the rank's input, output offsets to the output of `nranks × count` elements; `in_place` when
/// the input is the output at `rank × count`.
#[inline(always)]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, chunk_elems: u64, esize: u64, in_place: bool) {
    let n = r.nranks;
    let loop_size = r.nchannels * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let real_chunk = align_elems(core::cmp::min(chunk_elems, (count - grid_off).div_ceil(r.nchannels)), esize);
        let chunk_off = grid_off + r.channel * real_chunk;
        let len = if chunk_off >= count { 0 } else { core::cmp::min(real_chunk, count - chunk_off) };
        let out = |owner: u64| chunk_off + owner * count;
        // Our own block: to the next rank, and into our output unless it is already there.
        if in_place {
            p.send(chunk_off, len);
        } else {
            p.copy_send(chunk_off, out(r.user_rank(0)), len);
        }
        for j in 1..n - 1 {
            p.recv_copy_send(out(r.user_rank(n - j)), len);
        }
        p.recv(out(r.user_rank(1)), len);
        if p.aborted() {
            return;
        }
        grid_off += loop_size;
    }
}
