//! Ring ReduceScatter (NCCL's `reduce_scatter.h`): block `k` of every rank's input travels the ring
//! once, reduced at each hop, and ends at rank `k`, which writes it to its output.
use super::{RingCtx, channel_chunks};
use crate::proto::Primitives;

/// This channel's share of a ReduceScatter of `count` elements per rank: input offsets are
/// relative to the input of `nranks × count` elements, output offsets to the rank's `count`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, chunk_elems: u64, esize: u64) {
    let n = r.nranks;
    channel_chunks(
        r,
        0,
        count,
        chunk_elems,
        esize,
        #[cfg_attr(target_arch = "nvptx64", inline(always))]
        |chunk_off, len| {
            let inp = |owner: u64| chunk_off + owner * count;
            p.send(inp(r.user_rank(n - 1)), len);
            for j in 2..n {
                p.recv_reduce_send(inp(r.user_rank(n - j)), len);
            }
            // The only write to a user buffer (the call check's gate first).
            r.gate(p);
            p.recv_reduce_copy(inp(r.user_rank(0)), chunk_off, len, true);
            !p.aborted()
        },
    );
}
