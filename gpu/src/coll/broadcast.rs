//! Ring Broadcast (NCCL's `broadcast.h`): the data flows once around the ring starting at the
//! root; every rank but the last copies it into its output and forwards it. Every hop ends in
//! the receiver's output, so every send is direct (NCCL's `directSend`/`directRecv`).
use super::{RingCtx, channel_chunks};
use crate::proto::Primitives;

/// This channel's share of a Broadcast of `count` elements from user rank `root`; `in_place` when
/// the root's input and output are the same buffer.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ring<P: Primitives>(
    p: &mut P,
    r: &RingCtx,
    count: u64,
    root: u64,
    chunk_elems: u64,
    esize: u64,
    in_place: bool,
) {
    let (me, next) = (r.user_rank(0), r.user_rank(1));
    // Every verb writes an output: the call check's gate comes first, outside the loop.
    if !r.gate(p) {
        return;
    }
    channel_chunks(
        r,
        0,
        count,
        chunk_elems,
        esize,
        #[cfg_attr(target_arch = "nvptx64", inline(always))]
        |off, len| {
            if me == root {
                if in_place {
                    p.direct_send(off, off, len);
                } else {
                    p.direct_copy_send(off, off, len);
                }
            } else if next == root {
                p.direct_recv(off, len);
            } else {
                p.direct_recv_copy_direct_send(off, len);
            }
            !p.aborted()
        },
    );
}
