//! Ring Broadcast (NCCL's `broadcast.h`): the data flows once around the ring starting at the
//! root; every rank but the last copies it into its output and forwards it. Every hop ends in
//! the receiver's output, so every send is direct (NCCL's `directSend`/`directRecv`).
use super::{AHEAD_MIN_BYTES, RingCtx, channel_chunks, chunk_at};
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
    // Every verb writes an output: the call check's gate comes first, outside the loop. In a
    // checked call's entry (`r.ahead`), where a send writes only the next rank's FIFO, the root
    // sends its first chunk before it, so the check overlaps the first hop, and copies that chunk
    // into its output after it.
    let mut from = 0;
    if r.ahead && me == root && count > 0 && p.sends_to_fifo() {
        let (off, len) = chunk_at(r.channel, r.nchannels, 0, count, chunk_elems, esize);
        if len * esize >= AHEAD_MIN_BYTES {
            p.send(off, len);
            if !r.gate(p) {
                return;
            }
            if !in_place {
                p.copy(off, off, len);
            }
            from = r.nchannels * chunk_elems;
        }
    }
    if !r.gate(p) {
        return;
    }
    channel_chunks(
        r,
        from,
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
