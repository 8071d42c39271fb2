//! The LL (low-latency) protocol (NCCL's `prims_ll.h`): every 8 bytes of data travel in a 16-byte
//! [`LlFifoLine`] `{data1, flag1, data2, flag2}` written with one 16-byte volatile store, so the
//! reader knows the data is there when it sees both flags — no fence and no tail counter, which is
//! what makes it fast for small messages (at half the link bandwidth).
//!
//! A connection's LL buffer (`buff_sizes[Ll]` bytes) holds [`FIFO_STEPS`] slots of lines. The
//! lines of step `s` carry the flag `s mod (2^31 − 1) + 1` ([`ll_flag`]): never 0, so a line of
//! the zero-filled buffer that was never written can't pass for data. The sender waits for a free
//! slot (`head + FIFO_STEPS ≥ s + 1`, the receiver's credit), writes its lines; each receiving
//! thread spins on its own lines until both flags match, and after the block is done the receiver
//! returns the slot (`head = s + 1`). Flags wrap: in the 8 steps before the flag value wraps
//! ([`ll_clean`]) every line of the slot is written and read, so no line keeps a flag old enough
//! to be mistaken for a new one (NCCL's `NCCL_LL_CLEAN_MASK` cleanup).
use super::fan::{Fan, Peers, abort_raised};
use super::{Primitives, balanced_step, each_peer};
use crate::abi::{FIFO_STEPS, LlFifoLine, MAX_TREE_ARITY, Proto, SPINS_BEFORE_CHECK_ABORT};
use crate::arch::{self, Pack};
use crate::reduce::{Elem, OpArgs, RedFn, div_pack, pre_pack};
use core::marker::PhantomData;

/// Flag values repeat with this period (in steps); flags run from 1 to `LL_FLAG_PERIOD`.
pub const LL_FLAG_PERIOD: u64 = (1 << 31) - 1;

/// The flag of the lines of step `step`: in `1..=LL_FLAG_PERIOD`, never 0.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub const fn ll_flag(step: u64) -> u32 {
    (step % LL_FLAG_PERIOD + 1) as u32
}

/// Whether step `step` cleans its whole slot: the last [`FIFO_STEPS`] steps of each flag period,
/// one per slot.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub const fn ll_clean(step: u64) -> bool {
    step % LL_FLAG_PERIOD >= LL_FLAG_PERIOD - FIFO_STEPS
}

/// LL-protocol primitives over a fan of up to `NR` receive and `NS` send connections (NCCL's
/// `Primitives<T, RedOp, FanAsymmetric<NR, NS>, …, ProtoLL>`): a receiving verb combines the
/// lines of every receive peer (and the input, for the reducing verbs), a sending verb writes
/// the same lines to every send peer. [`Ll`] is the ring's fan of one and one; the tree's phases
/// are [`TreeLlUp`] and [`TreeLlDown`].
pub struct LlFan<T, Op, const NR: usize, const NS: usize> {
    tid: u32,
    nthreads: u32,
    input: *const T,
    output: *mut T,
    conns: Fan<LlFifoLine, NR, NS>,
    /// Lines per step (slot).
    step_lines: u64,
    /// The communicator's abort line, which the spin loops poll ([`super::fan::abort_raised`]).
    abort_flag: *const u32,
    smem: *mut u32,
    aborted: bool,
    /// Avg's post-division and PreMulSum's scalar.
    op_args: OpArgs,
    /// False while the source is the output, which PreMulSum must not scale again
    /// ([`super::tree::SendFromOutput`]).
    pre_input: bool,
    _op: PhantomData<Op>,
}

// `load_partial` / `store_partial` place the byte at offset `i` in bits `8i..`: little-endian.
#[cfg(not(target_endian = "little"))]
compile_error!("oxccl's LL packing assumes a little-endian target");

/// Reads an 8-byte value of `nbytes` valid bytes (elements of `esize` bytes) at `p`; bytes past
/// `nbytes` read as 0. Element-sized loads, no stack buffer (so GPU code keeps it in registers).
///
/// # Safety
/// `p` is valid for `nbytes` bytes and aligned to `esize`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn load_partial(p: *const u8, nbytes: u64, esize: u64) -> u64 {
    if nbytes == 8 && (p as u64) % 8 == 0 {
        // SAFETY: caller guarantees 8 valid, aligned bytes.
        return unsafe { (p as *const u64).read() };
    }
    let mut v = 0u64;
    let mut i = 0;
    // A loop, not written out: its temporaries would hold registers the hot loops around need.
    #[cfg(target_arch = "nvptx64")]
    let nbytes = crate::arch::opaque_u64(nbytes);
    while i < nbytes {
        // SAFETY: element-sized, element-aligned loads inside the caller's range.
        let e = unsafe {
            let q = p.add(i as usize);
            match esize {
                1 => q.read() as u64,
                2 => (q as *const u16).read() as u64,
                4 => (q as *const u32).read() as u64,
                _ => (q as *const u64).read(),
            }
        };
        v |= e << (8 * i);
        i += esize;
    }
    v
}

/// Writes the first `nbytes` bytes of `v` at `p` (see [`load_partial`]).
///
/// # Safety
/// `p` is valid for `nbytes` bytes and aligned to `esize`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn store_partial(p: *mut u8, v: u64, nbytes: u64, esize: u64) {
    if nbytes == 8 && (p as u64) % 8 == 0 {
        // SAFETY: caller guarantees 8 valid, aligned bytes.
        unsafe { (p as *mut u64).write(v) };
        return;
    }
    let mut i = 0;
    // As in `load_partial`.
    #[cfg(target_arch = "nvptx64")]
    let nbytes = crate::arch::opaque_u64(nbytes);
    while i < nbytes {
        let e = v >> (8 * i);
        // SAFETY: element-sized, element-aligned stores inside the caller's range.
        unsafe {
            let q = p.add(i as usize);
            match esize {
                1 => q.write(e as u8),
                2 => (q as *mut u16).write(e as u16),
                4 => (q as *mut u32).write(e as u32),
                _ => (q as *mut u64).write(e),
            }
        }
        i += esize;
    }
}

/// LL-protocol primitives for one channel of a ring: one receive peer (prev), one send peer (next).
pub type Ll<T, Op> = LlFan<T, Op, 1, 1>;
/// The reduce phase of a channel's tree on LL: children → parent.
pub type TreeLlUp<T, Op> = LlFan<T, Op, MAX_TREE_ARITY, 1>;
/// The broadcast phase of a channel's tree on LL: parent → children.
pub type TreeLlDown<T, Op> = LlFan<T, Op, 1, MAX_TREE_ARITY>;

impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> LlFan<T, Op, NR, NS> {
    /// Loads the connections of `peers` (a ring channel, or one phase of a channel's tree).
    ///
    /// # Safety
    /// As `Simple::new`, for connections whose LL buffers are `buff_size` bytes. All threads of
    /// the block call it.
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn new(
        tid: u32,
        nthreads: u32,
        peers: Peers,
        buff_size: u64,
        input: *const T,
        output: *mut T,
        abort_flag: u64,
        smem: *mut u32,
        op_args: OpArgs,
    ) -> Self {
        LlFan {
            tid,
            nthreads,
            input,
            output,
            // SAFETY: forwarded caller contract.
            conns: unsafe { Fan::load(tid, smem, peers, Proto::Ll) },
            step_lines: buff_size / FIFO_STEPS / core::mem::size_of::<LlFifoLine>() as u64,
            abort_flag: abort_flag as *const u32,
            smem,
            aborted: false,
            op_args,
            pre_input: true,
            _op: PhantomData,
        }
    }

    /// Elements of `T` one step carries (8 data bytes per line).
    pub fn step_elems(&self) -> u64 {
        self.step_lines * 8 / core::mem::size_of::<T>() as u64
    }

    /// Stores the connection steps back for the next kernel.
    ///
    /// # Safety
    /// All threads of the block call it, once, after the last verb.
    pub unsafe fn finish(self) {
        // SAFETY: forwarded caller contract.
        unsafe { self.conns.finish(self.tid) }
    }

    /// Spins until the line holds `flag` twice; `None` on abort.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn read_line(&self, line: *const LlFifoLine, flag: u32) -> Option<u64> {
        let mut spins = 0u32;
        loop {
            // SAFETY: the line lies inside the receive slot.
            let Pack([d1, f1, d2, f2]) = unsafe { arch::load_volatile_v4(line as *const Pack) };
            if f1 == flag && f2 == flag {
                return Some(d1 as u64 | (d2 as u64) << 32);
            }
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                if abort_raised(self.abort_flag) {
                    return None;
                }
            }
            arch::spin_pause();
        }
    }

    /// Spins until the `W` lines from `first` on all hold `flag` twice; their words, and false
    /// on abort. Each look loads every line, so once they are all there one round trip to
    /// memory sees them, not one per line.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn read_lines<const W: usize>(&self, first: *const LlFifoLine, flag: u32) -> ([u64; W], bool) {
        let mut v = [0u64; W];
        let mut spins = 0u32;
        loop {
            let mut all = true;
            for (k, w) in v.iter_mut().enumerate() {
                // SAFETY: the `W` lines lie inside the receive slot (caller contract).
                let Pack([d1, f1, d2, f2]) =
                    unsafe { arch::load_volatile_v4(first.wrapping_add(k) as *const Pack) };
                if f1 == flag && f2 == flag {
                    *w = d1 as u64 | (d2 as u64) << 32;
                } else {
                    all = false;
                }
            }
            if all {
                return (v, true);
            }
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                if abort_raised(self.abort_flag) {
                    return (v, false);
                }
            }
            arch::spin_pause();
        }
    }

    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn write_line(line: *mut LlFifoLine, v: u64, flag: u32) {
        // SAFETY: the line lies inside the peer's receive slot.
        unsafe { arch::store_volatile_v4(line as *mut Pack, Pack([v as u32, flag, (v >> 32) as u32, flag])) }
    }

    /// Thread 0 waits for a free slot on every send peer; then the block learns whether to abort.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn wait_send_credit(&mut self) -> bool {
        self.aborted = !self.conns.wait_send_credit(self.tid, self.smem, self.abort_flag);
        !self.aborted
    }

    /// `v` (the input's word, `SRC`) combined with line `k` of every present receive peer's slot
    /// (`slots`, `flags`; the first `nrecv`), peer 0 first; `None` on abort. Written out per peer
    /// (present peers are the leading ones) so no flag lives in GPU local memory.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn fold_recv<const SRC: bool>(
        &self,
        slots: &[*mut LlFifoLine; NR],
        flags: &[u32; NR],
        nrecv: usize,
        k: usize,
        mut v: u64,
    ) -> Option<u64> {
        if NR > 0 && nrecv > 0 {
            let r = self.read_line(slots[0].wrapping_add(k), flags[0])?;
            v = if SRC { combine::<T, Op>(&self.op_args, r, v) } else { r };
        }
        if NR > 1 && nrecv > 1 {
            v = combine::<T, Op>(&self.op_args, self.read_line(slots[1].wrapping_add(k), flags[1])?, v);
        }
        if NR > 2 && nrecv > 2 {
            v = combine::<T, Op>(&self.op_args, self.read_line(slots[2].wrapping_add(k), flags[2])?, v);
        }
        Some(v)
    }

    /// Reads (and drops) line `k` of every present receive peer whose step cleans its slot; false
    /// on abort.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn drain_clean(
        &self,
        slots: &[*mut LlFifoLine; NR],
        flags: &[u32; NR],
        clean: &[bool; NR],
        nrecv: usize,
        k: usize,
    ) -> bool {
        let mut ok = true;
        each_peer::<NR>(|i| {
            ok = ok
                && (i >= nrecv || !clean[i] || self.read_line(slots[i].wrapping_add(k), flags[i]).is_some());
        });
        ok
    }

    /// The one engine behind every verb (NCCL's `LLGenericOp`): per step, every thread takes
    /// its lines; for each, the input (`SRC`) combined with the line of every receive peer
    /// (`RECV`), written to every send peer (`SEND`) and the output (`DST`) — of the output only
    /// the first `keep_bytes` bytes from `dst` (`u64::MAX`: all; a point-to-point receive
    /// shorter than its send consumes every line but writes only what its output holds).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn generic_op<const RECV: bool, const SEND: bool, const SRC: bool, const DST: bool>(
        &mut self,
        src: u64,
        dst: u64,
        n: u64,
        post: bool,
        keep_bytes: u64,
    ) {
        if self.aborted {
            return;
        }
        let esize = core::mem::size_of::<T>() as u64;
        // Equal steps: `n` over as few steps as fit, each the same size (up to one element), so
        // a verb never ends with a sliver of a step (sender and receiver compute the same split).
        let per_step = balanced_step(n, self.step_elems());
        let div = if post { self.op_args.postdiv } else { 0 };
        let (nrecv, nsend) = self.conns.counts::<RECV, SEND>();
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(per_step, n - done);
            if SEND && !self.wait_send_credit() {
                return;
            }
            let nbytes = len * esize;
            let nlines = nbytes.div_ceil(8);
            // Per peer: this step's flag, slot, and whether it cleans the whole slot; a step
            // covers every line of the slot when any of its peers cleans.
            let mut fr = [0u32; NR];
            let mut slot_r = [core::ptr::null_mut::<LlFifoLine>(); NR];
            let mut clean_r = [false; NR];
            let mut fs = [0u32; NS];
            let mut slot_s = [core::ptr::null_mut::<LlFifoLine>(); NS];
            let mut clean_s = [false; NS];
            let mut total = nlines;
            each_peer::<NR>(|i| {
                if i < nrecv {
                    let c = &self.conns.recv[i];
                    fr[i] = ll_flag(c.step);
                    slot_r[i] = c
                        .buff
                        .wrapping_add(((c.step % FIFO_STEPS) * self.step_lines) as usize);
                    clean_r[i] = ll_clean(c.step);
                    if clean_r[i] {
                        total = self.step_lines;
                    }
                }
            });
            each_peer::<NS>(|i| {
                if i < nsend {
                    let c = &self.conns.send[i];
                    fs[i] = ll_flag(c.step);
                    slot_s[i] = c
                        .buff
                        .wrapping_add(((c.step % FIFO_STEPS) * self.step_lines) as usize);
                    clean_s[i] = ll_clean(c.step);
                    if clean_s[i] {
                        total = self.step_lines;
                    }
                    if self.tid == 0 {
                        // What this peer receives: the data lines, or the whole slot if it cleans.
                        let lines = if clean_s[i] { self.step_lines } else { nlines };
                        super::announce_step_lines(c.sizes, c.step, lines);
                    }
                }
            });
            let in_base = self.input.wrapping_add((src + done) as usize) as *const u8;
            let out_base = self.output.wrapping_add((dst + done) as usize) as *mut u8;
            // A step's lines and bytes fit 32 bits (a slot is a part of the connection's buffer).
            let (total32, nlines32, nbytes32) = (total as u32, nlines as u32, nbytes as u32);
            let mut line = self.tid;
            let mut aborted = false;
            while line < total32 {
                let k = line as usize;
                if line < nlines32 {
                    let valid = core::cmp::min(8, nbytes32 - line * 8) as u64;
                    // SAFETY: `valid` bytes at this offset are inside the caller's buffers.
                    let mut v = if SRC {
                        let x = unsafe { load_partial(in_base.add(k * 8), valid, esize) };
                        // PreMulSum scales this rank's input before it is combined.
                        if Op::pre_mul(&self.op_args) && self.pre_input {
                            unpack(pre_pack::<T, Op>(pack(x), &self.op_args))
                        } else {
                            x
                        }
                    } else {
                        0
                    };
                    let Some(folded) = self.fold_recv::<SRC>(&slot_r, &fr, nrecv, k, v) else {
                        aborted = true;
                        break;
                    };
                    v = folded;
                    if div != 0 {
                        v = unpack(div_pack::<T>(pack(v), div));
                    }
                    each_peer::<NS>(|i| {
                        if i < nsend {
                            // The line lies inside peer i's slot.
                            Self::write_line(slot_s[i].wrapping_add(k), v, fs[i]);
                        }
                    });
                    if DST {
                        let out = if keep_bytes == u64::MAX {
                            valid
                        } else {
                            core::cmp::min(valid, keep_bytes.saturating_sub(done * esize + line as u64 * 8))
                        };
                        if out > 0 {
                            // SAFETY: as for the load; `out` ≤ `valid` bytes, a whole number of
                            // elements (every term is).
                            unsafe { store_partial(out_base.add(k * 8), v, out, esize) };
                        }
                    }
                } else {
                    // Flag-wrap cleanup: every line of a cleaning peer's slot carries its flag.
                    if !self.drain_clean(&slot_r, &fr, &clean_r, nrecv, k) {
                        aborted = true;
                        break;
                    }
                    each_peer::<NS>(|i| {
                        if i < nsend && clean_s[i] {
                            Self::write_line(slot_s[i].wrapping_add(k), 0, fs[i]);
                        }
                    });
                }
                line += self.nthreads;
            }
            // Free the received slots once every thread has read its lines; share any abort.
            // SAFETY: every thread reaches the barriers; only thread 0 posts the credits.
            unsafe {
                if aborted {
                    self.smem.add(1).write_volatile(1);
                }
                arch::sync_threads();
                if self.smem.add(1).read_volatile() != 0 {
                    self.aborted = true;
                    return;
                }
                self.conns.end_step(self.tid, nrecv, nsend);
            }
            done += len;
        }
    }
}

/// Steps of a few words (a point-to-point header, the call check's signatures), over the
/// first send or receive peer of any fan.
impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> LlFan<T, Op, NR, NS> {
    /// Sends the `W` words `v` to the first send peer as a step of their own: `W` lines, or the
    /// whole slot when the step cleans it. Nothing on abort, or without a send peer (`NS = 0`).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn send_words<const W: usize>(&mut self, v: &[u64; W]) {
        if NS == 0 || self.aborted || !self.wait_send_credit() {
            return;
        }
        let c = &self.conns.send[0];
        let flag = ll_flag(c.step);
        let slot = c.buff.wrapping_add(((c.step % FIFO_STEPS) * self.step_lines) as usize);
        let total = if ll_clean(c.step) { self.step_lines } else { W as u64 };
        if self.tid == 0 {
            super::announce_step_lines(c.sizes, c.step, total);
        }
        let mut line = self.tid as u64;
        while line < total {
            // Word `line` picked with constant indices (a register array, never local memory).
            let mut x = 0;
            for (k, w) in v.iter().enumerate() {
                if line == k as u64 {
                    x = *w;
                }
            }
            Self::write_line(slot.wrapping_add(line as usize), x, flag);
            line += self.nthreads as u64;
        }
        // SAFETY: a send frees no slot; every thread advances its send step only.
        unsafe { self.conns.end_step(self.tid, 0, 1) };
    }

    /// Receives `W` words sent by [`LlFan::send_words`] from the first receive peer, in every
    /// thread; `None` on abort, or without a receive peer (`NR = 0`).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn recv_words<const W: usize>(&mut self) -> Option<[u64; W]> {
        if NR == 0 || self.aborted {
            return None;
        }
        let c = &self.conns.recv[0];
        let flag = ll_flag(c.step);
        let slot = c.buff.wrapping_add(((c.step % FIFO_STEPS) * self.step_lines) as usize);
        let total = if ll_clean(c.step) { self.step_lines } else { W as u64 };
        // Every thread reads the `W` lines (the warp's loads of one line coalesce); a cleaning
        // step's other lines are drained by the threads they fall to.
        let (v, mut ok) = self.read_lines::<W>(slot, flag);
        let mut line = self.tid as u64;
        while ok && line < total {
            if line >= W as u64 {
                ok = self.read_line(slot.wrapping_add(line as usize), flag).is_some();
            }
            line += self.nthreads as u64;
        }
        // Free the slot once every thread has read it; share any abort (as `generic_op`).
        // SAFETY: every thread reaches the barrier; only thread 0 posts the credit.
        unsafe {
            if !ok {
                self.smem.add(1).write_volatile(1);
            }
            arch::sync_threads();
            if self.smem.add(1).read_volatile() != 0 {
                self.aborted = true;
                return None;
            }
            self.conns.end_step(self.tid, 1, 0);
        }
        Some(v)
    }

    /// Receives `n` elements sent by one `send(_, n)` into output[dst..], writing only the first
    /// `keep` (≤ `n`) of them: every line is consumed, so the sender finishes, and nothing lands
    /// past an output shorter than what was sent (Simple's `recv_upto`).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn recv_upto(&mut self, dst: u64, n: u64, keep: u64) {
        let keep_bytes = core::cmp::min(keep, n) * core::mem::size_of::<T>() as u64;
        self.generic_op::<true, false, false, true>(0, dst, n, false, keep_bytes)
    }
}

/// An 8-byte word in the low half of a pack (the upper half is zero and ignored).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn pack(v: u64) -> Pack {
    Pack([v as u32, (v >> 32) as u32, 0, 0])
}

/// The low 8 bytes of a pack.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn unpack(p: Pack) -> u64 {
    p.0[0] as u64 | (p.0[1] as u64) << 32
}

/// `op(a, b)` lane-wise over the elements packed in two 8-byte words.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn combine<T: Elem, Op: RedFn<T>>(args: &OpArgs, a: u64, b: u64) -> u64 {
    unpack(Op::apply_pack(args, pack(a), pack(b)))
}

impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> Primitives for LlFan<T, Op, NR, NS> {
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn gate(&mut self, seen: u64) -> bool {
        super::pass_gate(&mut self.aborted, self.tid, self.smem, seen)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn copy(&mut self, src: u64, dst: u64, n: u64) {
        if !self.aborted {
            // SAFETY: the algorithm passes offsets inside both buffers, which are disjoint
            // where it copies (an out-of-place call); every thread runs the verb.
            unsafe {
                super::local_copy::<T, Op>(
                    self.tid,
                    self.nthreads,
                    self.input,
                    self.output,
                    src,
                    dst,
                    n,
                    &self.op_args,
                )
            }
        }
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn sends_to_fifo(&self) -> bool {
        true
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn send(&mut self, src: u64, n: u64) {
        self.generic_op::<false, true, true, false>(src, 0, n, false, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, false, false, true>(0, dst, n, false, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_send(&mut self, src: u64, n: u64) {
        self.generic_op::<true, true, true, false>(src, 0, n, false, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, false, true, true>(src, dst, n, post, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_copy_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, true>(0, dst, n, false, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, true>(src, dst, n, post, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, true>(src, dst, n, false, u64::MAX)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn aborted(&self) -> bool {
        self.aborted
    }
}

impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> super::tree::SendFromOutput
    for LlFan<T, Op, NR, NS>
{
    /// output[src..src+n] → every send peer: [`Primitives::send`] with the output as its source.
    fn send_from_output(&mut self, src: u64, n: u64) {
        let input = self.input;
        self.input = self.output as *const T;
        self.pre_input = false;
        self.send(src, n);
        self.pre_input = true;
        self.input = input;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    #[test]
    fn flags_are_never_zero_and_each_slot_is_cleaned_once_per_period() {
        assert_eq!(ll_flag(0), 1);
        assert_eq!(ll_flag(LL_FLAG_PERIOD - 1), LL_FLAG_PERIOD as u32);
        assert_eq!(ll_flag(LL_FLAG_PERIOD), 1);
        assert_eq!(
            ll_flag(u64::MAX / 2 + 17),
            ((u64::MAX / 2 + 17) % LL_FLAG_PERIOD + 1) as u32
        );
        for period in [0u64, 1, 5] {
            let base = period * LL_FLAG_PERIOD;
            let cleaned: Vec<u64> = (base..base + LL_FLAG_PERIOD)
                .rev()
                .take(64)
                .filter(|&s| ll_clean(s))
                .collect();
            assert_eq!(cleaned.len() as u64, FIFO_STEPS);
            let mut slots: Vec<u64> = cleaned.iter().map(|s| s % FIFO_STEPS).collect();
            slots.sort_unstable();
            assert_eq!(
                slots,
                (0..FIFO_STEPS).collect::<Vec<_>>(),
                "period {period}: every slot once"
            );
        }
        assert!(!ll_clean(0) && !ll_clean(LL_FLAG_PERIOD));
    }
}
