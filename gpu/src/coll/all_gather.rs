//! Ring AllGather (NCCL's `all_gather.h`): each rank's block travels the ring once; every rank
//! copies each block to its place (`rank × count`) in the output.
use super::{RingCtx, channel_chunks};
use crate::proto::Primitives;

/// This channel's share of an AllGather of `count` elements per rank. Input offsets are relative
/// to the rank's input, output offsets to the output of `nranks × count` elements; `in_place` when
/// the input is the output at `rank × count`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, chunk_elems: u64, esize: u64, in_place: bool) {
    let n = r.nranks;
    // Every verb writes an output: the call check's gate comes first, outside the loop.
    if !r.gate(p) {
        return;
    }
    channel_chunks(
        r,
        count,
        chunk_elems,
        esize,
        #[cfg_attr(target_arch = "nvptx64", inline(always))]
        |chunk_off, len| {
            let out = |owner: u64| chunk_off + owner * count;
            // Our own block: to the next rank, and into our output unless it is already there.
            // Every hop ends in the receiver's output at the block's place: direct sends.
            if in_place {
                p.direct_send(chunk_off, out(r.user_rank(0)), len);
            } else {
                p.direct_copy_send(chunk_off, out(r.user_rank(0)), len);
            }
            for j in 1..n - 1 {
                p.direct_recv_copy_direct_send(out(r.user_rank(n - j)), len);
            }
            p.direct_recv(out(r.user_rank(1)), len);
            !p.aborted()
        },
    );
}
