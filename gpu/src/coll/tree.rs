//! Tree AllReduce (NCCL's `runTreeUpDown` in `all_reduce.h`): a reduce phase up the channel's tree
//! — each rank receives its children's partial results, adds its input and sends the sum to its
//! parent, and the root writes the final value (with Avg's post-division) — then a broadcast
//! phase down the same tree, in which the root sends the final value from its output and every
//! other rank copies it into its output and forwards it to its children.
//!
//! The vector is cut per loop into `nchannels` chunks of at most `chunk_elems` (the grid loop of
//! [`super::channel_chunks`]); channel `c` runs its chunks over tree `c % 2` of the double binary
//! tree (NCCL gives tree 0 and tree 1 their own channels too). Each final value is computed once,
//! at the root, so every rank ends up with identical bits. Every rank walks the same chunks in the
//! same order, so both ends of each tree connection see the same sequence of steps.
use crate::proto::Primitives;
use crate::proto::tree::SendFromOutput;

/// What the tree algorithm needs to know about its channel and tree.
#[derive(Clone, Copy)]
pub struct TreeCtx {
    /// Parent user rank, -1 at the root.
    pub up: i32,
    /// First child user rank, -1 for a leaf.
    pub down0: i32,
    /// This block's channel and the channel count of the operation.
    pub channel: u64,
    pub nchannels: u64,
    /// As [`super::RingCtx::gated`].
    pub gated: bool,
    /// As [`super::RingCtx::seen`].
    pub seen: u64,
}

impl TreeCtx {
    /// As [`super::RingCtx::gate`].
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn gate<P: Primitives>(&self, p: &mut P) -> bool {
        !self.gated || p.gate(self.seen)
    }

    /// Offset and length (elements, the length possibly 0) of this channel's chunk in the loop
    /// iteration that starts at `grid_off` ([`super::chunk_at`]; the grid loop of
    /// [`super::channel_chunks`] is written out in the tree's phases because a closure the
    /// compiler does not inline would keep the primitives in GPU local memory).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn chunk(&self, grid_off: u64, count: u64, chunk_elems: u64, esize: u64) -> (u64, u64) {
        super::chunk_at(self.channel, self.nchannels, grid_off, count, chunk_elems, esize)
    }
}

/// The reduce phase of this channel's share of an AllReduce of `count` elements (`esize` bytes
/// each), over primitives that receive from the children and send to the parent.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn all_reduce_up<P: Primitives>(p: &mut P, t: &TreeCtx, count: u64, chunk_elems: u64, esize: u64) {
    let loop_size = t.nchannels * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let (off, len) = t.chunk(grid_off, count, chunk_elems, esize);
        if t.up == -1 {
            // The phase's only write to a user buffer (the call check's gate first).
            t.gate(p);
            p.recv_reduce_copy(off, off, len, true);
        } else if t.down0 == -1 {
            p.send(off, len);
        } else {
            p.recv_reduce_send(off, len);
        }
        if p.aborted() {
            return;
        }
        grid_off += loop_size;
    }
}

/// The broadcast phase of this channel's share of an AllReduce, over primitives that receive from
/// the parent and send to the children; run after [`all_reduce_up`] (the root sends what that
/// phase wrote into its output).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn all_reduce_down<P: Primitives + SendFromOutput>(
    p: &mut P,
    t: &TreeCtx,
    count: u64,
    chunk_elems: u64,
    esize: u64,
) {
    let loop_size = t.nchannels * chunk_elems;
    let mut grid_off = 0u64;
    while grid_off < count {
        let (off, len) = t.chunk(grid_off, count, chunk_elems, esize);
        // Every rank but the root writes its output (the call check's gate first).
        t.gate(p);
        if t.up == -1 {
            p.send_from_output(off, len);
        } else if t.down0 == -1 {
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
