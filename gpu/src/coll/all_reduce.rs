//! Ring AllReduce (NCCL's `runRing` in `all_reduce.h`): a reduce-scatter phase, in which each
//! chunk travels the ring once and is reduced at every hop until its owner holds the final value,
//! then an all-gather phase, in which the final chunk travels the ring once more and is copied.
//!
//! The vector is cut per loop into `nchannels × nranks` chunks of at most `chunk_elems`; channel
//! `b` handles chunks `b·nranks .. (b+1)·nranks`; chunk `k` of a channel is owned by user rank `k`.
//! Each final value is computed once, at its owner, so every rank ends up with identical bits.
use super::{RingCtx, loop_chunk};
use crate::proto::Primitives;

/// Runs this channel's share of an AllReduce of `count` elements (`esize` bytes each).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, chunk_elems: u64, esize: u64) {
    let n = r.nranks;
    let loop_size = r.nchannels * n * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let real_chunk = loop_chunk(chunk_elems, count - grid_off, r.nchannels * n, esize);
        let base = grid_off + r.channel * n * real_chunk;
        // Offset and length of the chunk owned by user rank `owner` in this loop iteration.
        let chunk = |owner: u64| -> (u64, u64) {
            let off = base + owner * real_chunk;
            (
                off,
                if off >= count {
                    0
                } else {
                    core::cmp::min(real_chunk, count - off)
                },
            )
        };

        // Reduce-scatter: send the chunk of the rank just upstream of us (it ends at its owner).
        let (off, len) = chunk(r.user_rank(n - 1));
        p.send(off, len);
        for j in 2..n {
            let (off, len) = chunk(r.user_rank(n - j));
            p.recv_reduce_send(off, len);
        }
        // Our own chunk: the last reduction yields the final value; write it and pass it on.
        // From here on every hop ends in the receiver's output: direct sends, after the call
        // check's gate.
        r.gate(p);
        let (off, len) = chunk(r.user_rank(0));
        p.recv_reduce_copy_direct_send(off, off, len, true);
        // All-gather: forward each final chunk, copying it into the output.
        for j in 1..n - 1 {
            let (off, len) = chunk(r.user_rank(n - j));
            p.direct_recv_copy_direct_send(off, len);
        }
        let (off, len) = chunk(r.user_rank(1));
        p.direct_recv(off, len);

        if p.aborted() {
            return;
        }
        grid_off += loop_size;
    }
}
