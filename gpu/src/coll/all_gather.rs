//! Ring AllGather (NCCL's `all_gather.h`): each rank's block travels the ring once; every rank
//! copies each block to its place (`rank × count`) in the output.
use super::{AHEAD_MIN_ELEM_BYTES, RingCtx, ahead_elems, channel_chunks, chunk_at};
use crate::proto::Primitives;

/// This channel's share of an AllGather of `count` elements per rank. Input offsets are relative
/// to the rank's input, output offsets to the output of `nranks × count` elements; `in_place` when
/// the input is the output at `rank × count`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, chunk_elems: u64, esize: u64, in_place: bool) {
    if r.ahead && count > 0 && esize >= AHEAD_MIN_ELEM_BYTES && p.sends_to_fifo() {
        ring_sending_ahead(p, r, count, chunk_elems, esize, in_place);
        return;
    }
    let n = r.nranks;
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

/// [`ring`] in a checked call's kernel (`r.ahead`, `count` > 0) of elements of at least
/// [`AHEAD_MIN_ELEM_BYTES`] on a FIFO protocol ([`Primitives::sends_to_fifo`]): the first
/// chunk, or its head ([`ahead_elems`]), goes to the next rank before the call check's gate,
/// every verb on that chunk split there on every rank (nothing goes before the gate when
/// `ahead_elems` is 0: a chunk under 8 KiB). Only the checked entries hold it (`r.ahead`): the
/// unchecked entries keep the loop above as it is without the check.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn ring_sending_ahead<P: Primitives>(
    p: &mut P,
    r: &RingCtx,
    count: u64,
    chunk_elems: u64,
    esize: u64,
    in_place: bool,
) {
    let n = r.nranks;
    let me = r.user_rank(0);
    // One loop's chunks. Every verb on a chunk is split at `ahead` alike on every rank (0 but in
    // a checked call's first loop), and the chunk's sender moved the part before it already.
    let step = #[cfg_attr(target_arch = "nvptx64", inline(always))]
    |p: &mut P, chunk_off: u64, len: u64, ahead: u64| {
        let out = |owner: u64| chunk_off + owner * count;
        let rest = len - ahead;
        // Our own block: to the next rank, and into our output unless it is already there.
        // Every hop ends in the receiver's output at the block's place: direct sends.
        if in_place {
            p.direct_send(chunk_off + ahead, out(me) + ahead, rest);
        } else {
            p.direct_copy_send(chunk_off + ahead, out(me) + ahead, rest);
        }
        for j in 1..n - 1 {
            let o = out(r.user_rank(n - j));
            if ahead > 0 {
                p.direct_recv_copy_direct_send(o, ahead);
            }
            p.direct_recv_copy_direct_send(o + ahead, rest);
        }
        let o = out(r.user_rank(1));
        if ahead > 0 {
            p.direct_recv(o, ahead);
        }
        p.direct_recv(o + ahead, rest);
        if ahead > 0 && !in_place {
            // Last: the hops above wait for no local copy.
            p.copy(chunk_off, out(me), ahead);
        }
        !p.aborted()
    };
    // The call check's gate comes before the first write to a user buffer. Our first chunk,
    // or its head, goes to the next rank's FIFO before it (where a send writes no user buffer),
    // so the check overlaps the first hop; its copy into our output comes after.
    let (chunk_off, len) = chunk_at(r.channel, r.nchannels, 0, count, chunk_elems, esize);
    let ahead = ahead_elems(p, len, esize);
    p.send(chunk_off, ahead);
    if !r.gate(p) || !step(p, chunk_off, len, ahead) {
        return;
    }
    let from = r.nchannels * chunk_elems;
    channel_chunks(r, from, count, chunk_elems, esize, |chunk_off, len| step(p, chunk_off, len, 0));
}
