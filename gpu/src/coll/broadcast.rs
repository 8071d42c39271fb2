//! Ring Broadcast (NCCL's `broadcast.h`): the data flows once around the ring starting at the
//! root; every rank but the last copies it into its output and forwards it.
use super::{RingCtx, align_elems};
use crate::proto::Primitives;

/// This channel's share of a Broadcast of `count` elements from user rank `root`; `in_place` when
/// the root's input and output are the same buffer.
#[inline(always)]
pub fn ring<P: Primitives>(p: &mut P, r: &RingCtx, count: u64, root: u64, chunk_elems: u64, esize: u64, in_place: bool) {
    let me = r.user_rank(0);
    let next = r.user_rank(1);
    let loop_size = r.nchannels * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let real_chunk = align_elems(core::cmp::min(chunk_elems, (count - grid_off).div_ceil(r.nchannels)), esize);
        let off = grid_off + r.channel * real_chunk;
        let len = if off >= count { 0 } else { core::cmp::min(real_chunk, count - off) };
        if me == root {
            if in_place {
                p.send(off, len);
            } else {
                p.copy_send(off, off, len);
            }
        } else if next == root {
            p.recv(off, len);
        } else {
            p.recv_copy_send(off, len);
        }
        if p.aborted() {
            return;
        }
        grid_off += loop_size;
    }
}
