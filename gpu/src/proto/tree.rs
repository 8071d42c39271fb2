//! The Simple protocol over a tree's several peers (NCCL's `Primitives<…, FanAsymmetric<3, 1>>`
//! and `FanAsymmetric<1, 3>` over `prims_simple.h`): one block receives from up to
//! [`MAX_TREE_ARITY`] peers and sends to up to as many, one FIFO per peer and direction.
//!
//! The FIFO discipline is [`super::simple`]'s with one slot per step (a slice is at most one
//! slot): to send step `s` on a connection, wait for its `head + FIFO_STEPS > s`, write the slot,
//! publish `tail = s + 1`; to receive it, wait for `tail > s`, read the slot, free it with
//! `head = s + 1`. A verb waits for *every* peer of each side before it copies, then posts on
//! every peer, so the receivers of one step are all fed from the same combined value.
//!
//! Compiled for the CPU target only so far (the GPU kernels do not run trees yet); the code is
//! written for a block of `nthreads` threads all the same (one thread polls and posts, all copy).
use super::Primitives;
use crate::abi::{
    ConnInfo, DevTree, FIFO_STEPS, MAX_TREE_ARITY, PACK_BYTES, Proto, SPINS_BEFORE_CHECK_ABORT,
};
use crate::arch::{self, Pack};
use crate::reduce::{Elem, RedFn, div_pack};
use core::marker::PhantomData;

/// Device-side state of one tree connection for the duration of a kernel.
#[derive(Clone, Copy)]
struct Conn {
    info: *mut ConnInfo,
    buff: *mut u8,
    head: *mut u64,
    tail: *mut u64,
    step: u64,
}

impl Conn {
    const NONE: Conn = Conn {
        info: core::ptr::null_mut(),
        buff: core::ptr::null_mut(),
        head: core::ptr::null_mut(),
        tail: core::ptr::null_mut(),
        step: 0,
    };

    /// # Safety
    /// `info` points at a connection set up for the Simple protocol.
    unsafe fn load(info: *mut ConnInfo) -> Self {
        // SAFETY: caller guarantees `info`.
        let c = unsafe { info.read() };
        Conn {
            info,
            buff: c.buffs[Proto::Simple as usize] as *mut u8,
            head: c.head as *mut u64,
            tail: c.tail as *mut u64,
            step: c.step,
        }
    }
}

/// Which half of NCCL's `runTreeUpDown` a [`TreeSimple`] serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Phase {
    /// Reduce: receive from the children (`down`), send to the parent (`up`).
    Up,
    /// Broadcast: receive from the parent, send to the children.
    Down,
}

/// Simple-protocol primitives for one phase of one channel's tree, for element type `T` and
/// operator `Op`. "recv" reduces the data of every receive peer (and the input, for the reducing
/// verbs); "send" writes the same value to every send peer.
pub struct TreeSimple<T, Op> {
    tid: u32,
    nthreads: u32,
    input: *const T,
    output: *mut T,
    recv: [Conn; MAX_TREE_ARITY],
    nrecv: usize,
    send: [Conn; MAX_TREE_ARITY],
    nsend: usize,
    slot_bytes: u64,
    slice_elems: u64,
    abort_flag: *const u32,
    smem: *mut u32,
    aborted: bool,
    postdiv: u32,
    _op: PhantomData<Op>,
}

/// Verbs of the broadcast phase's root beyond [`Primitives`].
pub trait SendFromOutput {
    /// output[src..src+n] → every send peer (NCCL's `directSendFromOutput`): the tree root
    /// forwards the final value its reduce phase wrote.
    fn send_from_output(&mut self, src: u64, n: u64);
}

impl<T: Elem, Op: RedFn<T>> TreeSimple<T, Op> {
    /// Loads the connections of `phase` from `tree` (NCCL's Primitives constructor with
    /// `tree->down` / `&tree->up` as receive and send peers, or the reverse). `slice_elems` is
    /// clamped to one FIFO slot of `buff_size / FIFO_STEPS` bytes.
    ///
    /// # Safety
    /// `tree` is a set-up [`DevTree`] whose connections to each present peer have Simple buffers
    /// of `buff_size` bytes; `input`/`output` are valid for every offset the algorithm passes;
    /// `smem` points at kernel shared memory; `abort_flag` is 0 or a valid flag address. All
    /// threads of the block call it.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        phase: Phase,
        tid: u32,
        nthreads: u32,
        tree: *mut DevTree,
        buff_size: u64,
        input: *const T,
        output: *mut T,
        abort_flag: u64,
        smem: *mut u32,
        postdiv: u32,
        slice_elems: u64,
    ) -> Self {
        let mut downs = [Conn::NONE; MAX_TREE_ARITY];
        let mut ndown = 0;
        let mut up = [Conn::NONE; MAX_TREE_ARITY];
        let mut nup = 0;
        // SAFETY: caller guarantees `tree`; the fields are plain data.
        unsafe {
            let t = tree;
            for i in 0..MAX_TREE_ARITY {
                if (*t).down[i] >= 0 {
                    downs[ndown] = match phase {
                        Phase::Up => Conn::load(&raw mut (*t).recv_down[i]),
                        Phase::Down => Conn::load(&raw mut (*t).send_down[i]),
                    };
                    ndown += 1;
                }
            }
            if (*t).up >= 0 {
                up[0] = match phase {
                    Phase::Up => Conn::load(&raw mut (*t).send_up),
                    Phase::Down => Conn::load(&raw mut (*t).recv_up),
                };
                nup = 1;
            }
        }
        let (recv, nrecv, send, nsend) = match phase {
            Phase::Up => (downs, ndown, up, nup),
            Phase::Down => (up, nup, downs, ndown),
        };
        let slot_bytes = buff_size / FIFO_STEPS / PACK_BYTES * PACK_BYTES;
        let slot_elems = slot_bytes / core::mem::size_of::<T>() as u64;
        let slice_elems = if slice_elems == 0 || slice_elems > slot_elems {
            slot_elems
        } else {
            slice_elems
        };
        TreeSimple {
            tid,
            nthreads,
            input,
            output,
            recv,
            nrecv,
            send,
            nsend,
            slot_bytes,
            slice_elems,
            abort_flag: abort_flag as *const u32,
            smem,
            aborted: false,
            postdiv,
            _op: PhantomData,
        }
    }

    /// Stores the connection steps back for the next kernel (NCCL's Primitives destructor).
    ///
    /// # Safety
    /// All threads of the block call it, once, after the last verb.
    pub unsafe fn finish(self) {
        // SAFETY: every thread reaches this barrier; then only thread 0 writes the connections
        // this phase loaded (valid by the constructor's contract).
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                for c in self.recv[..self.nrecv].iter().chain(&self.send[..self.nsend]) {
                    (*c.info).step = c.step;
                }
            }
        }
    }

    /// Spins until `ready()`; polls the abort flag every `SPINS_BEFORE_CHECK_ABORT` tries.
    #[inline(always)]
    fn spin(&self, ready: impl Fn() -> bool) -> bool {
        let mut spins = 0u32;
        while !ready() {
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                // SAFETY: `abort_flag` is 0 or valid (constructor contract).
                if !self.abort_flag.is_null() && unsafe { arch::load_volatile_u32(self.abort_flag) } != 0 {
                    return false;
                }
            }
            arch::spin_pause();
        }
        true
    }

    /// Thread 0 waits until every receive peer (`RECV`) has published the next step and every
    /// send peer (`SEND`) has freed its slot; then the block learns whether to abort.
    #[inline(always)]
    fn wait<const RECV: bool, const SEND: bool>(&mut self) -> bool {
        if self.tid == 0 {
            let mut ok = true;
            if RECV {
                for c in &self.recv[..self.nrecv] {
                    let (tail, want) = (c.tail, c.step + 1);
                    // SAFETY: `tail` is this connection's counter (constructor contract).
                    ok = ok && self.spin(|| unsafe { arch::load_volatile_u64(tail) } >= want);
                }
            }
            if SEND {
                for c in &self.send[..self.nsend] {
                    let (head, want) = (c.head, c.step + 1);
                    // SAFETY: as above, for the send connection's head.
                    ok = ok && self.spin(|| unsafe { arch::load_volatile_u64(head) } + FIFO_STEPS >= want);
                }
            }
            // SAFETY: fence has no operands; smem is valid kernel shared memory.
            unsafe {
                arch::fence_acq_rel_sys();
                self.smem.write_volatile(if ok { 0 } else { 1 });
            }
        }
        // SAFETY: all threads of the block execute `wait` with the same control flow.
        unsafe { arch::sync_threads() };
        // SAFETY: written by thread 0 before the barrier.
        self.aborted = unsafe { self.smem.read_volatile() } != 0;
        !self.aborted
    }

    /// After the block's copy: publish the sent step to every send peer, free the received step
    /// of every receive peer.
    #[inline(always)]
    fn post<const RECV: bool, const SEND: bool>(&mut self) {
        // SAFETY: all threads reach this barrier; only thread 0 stores the counters.
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                arch::fence_acq_rel_sys();
                if SEND {
                    for c in &self.send[..self.nsend] {
                        arch::store_volatile_u64(c.tail, c.step + 1);
                    }
                }
                if RECV {
                    for c in &self.recv[..self.nrecv] {
                        arch::store_volatile_u64(c.head, c.step + 1);
                    }
                }
            }
        }
        if SEND {
            for c in &mut self.send[..self.nsend] {
                c.step += 1;
            }
        }
        if RECV {
            for c in &mut self.recv[..self.nrecv] {
                c.step += 1;
            }
        }
    }

    #[inline(always)]
    fn slot(&self, c: &Conn) -> *mut u8 {
        // SAFETY: the slot lies inside the connection buffer.
        unsafe { c.buff.add(((c.step % FIFO_STEPS) * self.slot_bytes) as usize) }
    }

    /// The engine behind every verb (NCCL's `genericOp` with several peers): per FIFO step, wait
    /// for every peer, reduce the sources — the input (`SRC`) or the output (`SRC_OUT`), and the
    /// slot of every receive peer (`RECV`) — into the destinations — the output (`DST`) and the
    /// slot of every send peer (`SEND`) — then post.
    #[inline(always)]
    fn generic_op<
        const RECV: bool,
        const SEND: bool,
        const SRC: bool,
        const SRC_OUT: bool,
        const DST: bool,
    >(
        &mut self,
        src: u64,
        dst: u64,
        n: u64,
        post: bool,
    ) {
        if self.aborted {
            return;
        }
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(self.slice_elems, n - done);
            if !self.wait::<RECV, SEND>() {
                return;
            }
            let null_src = core::ptr::null::<u8>();
            let mut srcs = [null_src; MAX_TREE_ARITY + 1];
            let mut nsrc = 0;
            if SRC {
                srcs[0] = self.input.wrapping_add((src + done) as usize) as *const u8;
                nsrc = 1;
            } else if SRC_OUT {
                srcs[0] = self.output.wrapping_add((src + done) as usize) as *const u8;
                nsrc = 1;
            }
            if RECV {
                for i in 0..self.nrecv {
                    srcs[nsrc] = self.slot(&self.recv[i]);
                    nsrc += 1;
                }
            }
            let mut dsts = [core::ptr::null_mut::<u8>(); MAX_TREE_ARITY + 1];
            let mut ndst = 0;
            if DST {
                dsts[0] = self.output.wrapping_add((dst + done) as usize) as *mut u8;
                ndst = 1;
            }
            if SEND {
                for i in 0..self.nsend {
                    dsts[ndst] = self.slot(&self.send[i]);
                    ndst += 1;
                }
            }
            let div = if post { self.postdiv } else { 0 };
            // SAFETY: the pointers cover `len` elements (algorithm and FIFO geometry contracts);
            // a destination equals a source only in place (output over input, exactly).
            unsafe {
                reduce_copy_multi::<T, Op>(self.tid, self.nthreads, &srcs[..nsrc], &dsts[..ndst], len, div)
            };
            self.post::<RECV, SEND>();
            done += len;
        }
    }
}

/// `d = s[0] ⊕ s[1] ⊕ … (/ div)` into every `d` of `dsts`, over `n` elements spread over
/// `nthreads` threads: 16-byte packs when every pointer is 16-byte aligned, then element by
/// element (NCCL's `reduceCopy` with several sources and destinations). `div == 0` means no
/// post-division. Nothing happens without a source or a destination.
///
/// # Safety
/// Every pointer is valid for `n` elements of `T`; a destination overlaps no source except
/// exactly (in place).
#[inline(always)]
unsafe fn reduce_copy_multi<T: Elem, Op: RedFn<T>>(
    tid: u32,
    nthreads: u32,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: u64,
    div: u32,
) {
    if srcs.is_empty() || dsts.is_empty() {
        return;
    }
    let esize = core::mem::size_of::<T>() as u64;
    let addrs = srcs.iter().fold(0u64, |a, &p| a | p as u64) | dsts.iter().fold(0u64, |a, &p| a | p as u64);
    let npacks = if addrs % PACK_BYTES == 0 {
        n * esize / PACK_BYTES
    } else {
        0
    };
    let stride = nthreads as u64;
    let mut i = tid as u64;
    // SAFETY (whole block): indices stay below `npacks` (packs) or `n` (elements), inside the
    // caller's ranges; every source is read before any destination of the same index is written.
    unsafe {
        while i < npacks {
            let k = i as usize;
            let mut v = arch::load_v4((srcs[0] as *const Pack).add(k));
            for &s in &srcs[1..] {
                v = Op::apply_pack(v, arch::load_v4((s as *const Pack).add(k)));
            }
            if div != 0 {
                v = div_pack::<T>(v, div);
            }
            for &d in dsts {
                arch::store_v4((d as *mut Pack).add(k), v);
            }
            i += stride;
        }
        let mut e = npacks * PACK_BYTES / esize + tid as u64;
        while e < n {
            let k = e as usize;
            let mut r = (srcs[0] as *const T).add(k).read();
            for &s in &srcs[1..] {
                r = Op::apply(r, (s as *const T).add(k).read());
            }
            if div != 0 {
                r = T::div(r, div);
            }
            for &d in dsts {
                (d as *mut T).add(k).write(r);
            }
            e += stride;
        }
    }
}

impl<T: Elem, Op: RedFn<T>> Primitives for TreeSimple<T, Op> {
    fn send(&mut self, src: u64, n: u64) {
        self.generic_op::<false, true, true, false, false>(src, 0, n, false)
    }
    fn recv(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, false, false, false, true>(0, dst, n, false)
    }
    fn recv_reduce_send(&mut self, src: u64, n: u64) {
        self.generic_op::<true, true, true, false, false>(src, 0, n, false)
    }
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, false, true, false, true>(src, dst, n, post)
    }
    fn recv_copy_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, false, true>(0, dst, n, false)
    }
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, false, true>(src, dst, n, post)
    }
    fn copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, false, true>(src, dst, n, false)
    }
    fn aborted(&self) -> bool {
        self.aborted
    }
}

impl<T: Elem, Op: RedFn<T>> SendFromOutput for TreeSimple<T, Op> {
    fn send_from_output(&mut self, src: u64, n: u64) {
        self.generic_op::<false, true, false, true, false>(src, 0, n, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::FuncSum;
    use std::vec;
    use std::vec::Vec;

    #[test]
    fn reduce_copy_multi_folds_every_source_into_every_destination() {
        // Four u32 sources (three children and the input) into two destinations (output and the
        // parent's slot), 16-byte aligned (pack path) and shifted by one element (element path).
        // Source s holds 10 i + s at element i, so the sum is 40 i + 6, and 10 i + 1 after a
        // post-division by 4 (truncating).
        let n = 37usize;
        let buf = |fill: &dyn Fn(usize) -> u32| {
            let mut v = vec![Pack::default(); n.div_ceil(4) + 1];
            let p = v.as_mut_ptr() as *mut u32;
            for i in 0..4 * v.len() {
                // SAFETY: inside the vector.
                unsafe { p.add(i).write(fill(i)) };
            }
            v
        };
        for shift in [0usize, 1] {
            for div in [0u32, 4] {
                let srcs: Vec<Vec<Pack>> = (0..4).map(|s| buf(&|i| (10 * i + s) as u32)).collect();
                let mut dsts: Vec<Vec<Pack>> = (0..2).map(|_| buf(&|_| 0xdead_beef)).collect();
                let sp: Vec<*const u8> = srcs
                    .iter()
                    .map(|v| (v.as_ptr() as *const u32).wrapping_add(shift) as *const u8)
                    .collect();
                let dp: Vec<*mut u8> = dsts
                    .iter_mut()
                    .map(|v| (v.as_mut_ptr() as *mut u32).wrapping_add(shift) as *mut u8)
                    .collect();
                // SAFETY: every pointer covers `n` elements after the shift.
                unsafe { reduce_copy_multi::<u32, FuncSum>(0, 1, &sp, &dp, n as u64, div) };
                for d in &dsts {
                    let p = d.as_ptr() as *const u32;
                    for k in 0..4 * d.len() {
                        // SAFETY: inside the vector.
                        let got = unsafe { p.add(k).read() };
                        let want = if k < shift || k >= shift + n {
                            0xdead_beef
                        } else if div == 0 {
                            (40 * k + 6) as u32
                        } else {
                            ((40 * k + 6) / 4) as u32
                        };
                        assert_eq!(got, want, "shift {shift}, div {div}, element {k}");
                    }
                }
            }
        }
    }
}
