//! Ring Reduce (NCCL's `reduce.h`): the data flows once around the ring ending at the root; each
//! rank reduces its input into it, and the root writes the final value (with Avg's division).
use super::{RingCtx, channel_chunks};
use crate::proto::Primitives;

/// This channel's share of a Reduce of `count` elements to user rank `root`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, root: u64, chunk_elems: u64, esize: u64) {
    let (me, prev) = (r.user_rank(0), r.user_rank(r.nranks - 1));
    channel_chunks(
        r,
        0,
        count,
        chunk_elems,
        esize,
        #[cfg_attr(target_arch = "nvptx64", inline(always))]
        |off, len| {
            if prev == root {
                p.send(off, len);
            } else if me == root {
                // The only write to a user buffer (the call check's gate first).
                r.gate(p);
                p.recv_reduce_copy(off, off, len, true);
            } else {
                p.recv_reduce_send(off, len);
            }
            !p.aborted()
        },
    );
}
