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
use super::{Primitives, balanced_step};
use crate::abi::{ConnInfo, DevChannel, FIFO_STEPS, LlFifoLine, Proto, SPINS_BEFORE_CHECK_ABORT};
use crate::arch::{self, Pack};
use crate::reduce::{Elem, RedFn, div_pack};
use core::marker::PhantomData;

/// Flag values repeat with this period (in steps); flags run from 1 to `LL_FLAG_PERIOD`.
pub const LL_FLAG_PERIOD: u64 = (1 << 31) - 1;

/// The flag of the lines of step `step`: in `1..=LL_FLAG_PERIOD`, never 0.
#[inline(always)]
pub const fn ll_flag(step: u64) -> u32 {
    (step % LL_FLAG_PERIOD + 1) as u32
}

/// Whether step `step` cleans its whole slot: the last [`FIFO_STEPS`] steps of each flag period,
/// one per slot.
#[inline(always)]
pub const fn ll_clean(step: u64) -> bool {
    step % LL_FLAG_PERIOD >= LL_FLAG_PERIOD - FIFO_STEPS
}

struct Conn {
    info: *mut ConnInfo,
    buff: *mut LlFifoLine,
    head: *mut u64,
    /// Step sizes a proxy reads (`ConnInfo::sizes`); null when none are wanted.
    sizes: *mut u64,
    step: u64,
}

impl Conn {
    /// # Safety
    /// `info` points at a connection set up for the LL protocol.
    unsafe fn load(info: *mut ConnInfo) -> Self {
        // SAFETY: caller guarantees `info`.
        let c = unsafe { info.read() };
        Conn {
            info,
            buff: c.buffs[Proto::Ll as usize] as *mut LlFifoLine,
            head: c.head as *mut u64,
            sizes: c.sizes as *mut u64,
            step: c.step,
        }
    }
}

/// LL-protocol primitives for one channel of a ring.
pub struct Ll<T, Op> {
    tid: u32,
    nthreads: u32,
    input: *const T,
    output: *mut T,
    send: Conn,
    recv: Conn,
    /// Lines per step (slot).
    step_lines: u64,
    abort_flag: *const u32,
    smem: *mut u32,
    aborted: bool,
    postdiv: u32,
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
#[inline(always)]
pub(crate) unsafe fn load_partial(p: *const u8, nbytes: u64, esize: u64) -> u64 {
    if nbytes == 8 && (p as u64) % 8 == 0 {
        // SAFETY: caller guarantees 8 valid, aligned bytes.
        return unsafe { (p as *const u64).read() };
    }
    let mut v = 0u64;
    let mut i = 0;
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
#[inline(always)]
pub(crate) unsafe fn store_partial(p: *mut u8, v: u64, nbytes: u64, esize: u64) {
    if nbytes == 8 && (p as u64) % 8 == 0 {
        // SAFETY: caller guarantees 8 valid, aligned bytes.
        unsafe { (p as *mut u64).write(v) };
        return;
    }
    let mut i = 0;
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

impl<T: Elem, Op: RedFn<T>> Ll<T, Op> {
    /// Loads the channel's ring connections.
    ///
    /// # Safety
    /// As `Simple::new`, for a communicator whose LL buffers are `buff_size` bytes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        tid: u32,
        nthreads: u32,
        channel: *mut DevChannel,
        buff_size: u64,
        input: *const T,
        output: *mut T,
        abort_flag: u64,
        smem: *mut u32,
        postdiv: u32,
    ) -> Self {
        // SAFETY: caller guarantees `channel` and `smem`; every thread reaches the barrier.
        let (send, recv) = unsafe {
            if tid == 0 {
                smem.add(1).write_volatile(0); // the block's abort word of `generic_op`
            }
            arch::sync_threads();
            (
                Conn::load(&raw mut (*channel).send),
                Conn::load(&raw mut (*channel).recv),
            )
        };
        Ll {
            tid,
            nthreads,
            input,
            output,
            send,
            recv,
            step_lines: buff_size / FIFO_STEPS / core::mem::size_of::<LlFifoLine>() as u64,
            abort_flag: abort_flag as *const u32,
            smem,
            aborted: false,
            postdiv,
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
        // SAFETY: every thread reaches the barrier; then only thread 0 writes.
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                (*self.send.info).step = self.send.step;
                (*self.recv.info).step = self.recv.step;
            }
        }
    }

    #[inline(always)]
    fn check_abort(&self) -> bool {
        // SAFETY: `abort_flag` is 0 or valid (constructor contract).
        !self.abort_flag.is_null() && unsafe { arch::load_volatile_u32(self.abort_flag) } != 0
    }

    /// Spins until the line holds `flag` twice; `None` on abort.
    #[inline(always)]
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
                if self.check_abort() {
                    return None;
                }
            }
            arch::spin_pause();
        }
    }

    #[inline(always)]
    fn write_line(line: *mut LlFifoLine, v: u64, flag: u32) {
        // SAFETY: the line lies inside the peer's receive slot.
        unsafe { arch::store_volatile_v4(line as *mut Pack, Pack([v as u32, flag, (v >> 32) as u32, flag])) }
    }

    /// Thread 0 waits for a free send slot; then the block learns whether to abort.
    #[inline(always)]
    fn wait_send_credit(&mut self) -> bool {
        if self.tid == 0 {
            let (head, want) = (self.send.head, self.send.step + 1);
            let mut ok = true;
            let mut spins = 0u32;
            // SAFETY: `head` is this connection's counter.
            while unsafe { arch::load_volatile_u64(head) } + FIFO_STEPS < want {
                spins += 1;
                if spins == SPINS_BEFORE_CHECK_ABORT {
                    spins = 0;
                    if self.check_abort() {
                        ok = false;
                        break;
                    }
                }
                arch::spin_pause();
            }
            // SAFETY: smem is the kernel's shared memory.
            unsafe { self.smem.write_volatile(u32::from(!ok)) };
        }
        // SAFETY: all threads execute this with the same control flow.
        unsafe { arch::sync_threads() };
        // SAFETY: written by thread 0 before the barrier.
        self.aborted = unsafe { self.smem.read_volatile() } != 0;
        !self.aborted
    }

    /// The one engine behind every verb (NCCL's `LLGenericOp`).
    #[inline(always)]
    fn generic_op<const RECV: bool, const SEND: bool, const SRC: bool, const DST: bool>(
        &mut self,
        src: u64,
        dst: u64,
        n: u64,
        post: bool,
    ) {
        if self.aborted {
            return;
        }
        let esize = core::mem::size_of::<T>() as u64;
        // Equal steps: `n` over as few steps as fit, each the same size (up to one element), so
        // a verb never ends with a sliver of a step (sender and receiver compute the same split).
        let per_step = balanced_step(n, self.step_elems());
        let div = if post { self.postdiv } else { 0 };
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(per_step, n - done);
            if SEND && !self.wait_send_credit() {
                return;
            }
            let nbytes = len * esize;
            let nlines = nbytes.div_ceil(8);
            let clean_send = SEND && ll_clean(self.send.step);
            let clean_recv = RECV && ll_clean(self.recv.step);
            let total = if clean_send || clean_recv {
                self.step_lines
            } else {
                nlines
            };
            if SEND && self.tid == 0 {
                super::announce_step_lines(self.send.sizes, self.send.step, total);
            }
            let (fs, fr) = (ll_flag(self.send.step), ll_flag(self.recv.step));
            // SAFETY: slots lie inside the connection buffers.
            let (slot_s, slot_r) = unsafe {
                (
                    self.send
                        .buff
                        .add(((self.send.step % FIFO_STEPS) * self.step_lines) as usize),
                    self.recv
                        .buff
                        .add(((self.recv.step % FIFO_STEPS) * self.step_lines) as usize),
                )
            };
            let in_base = self.input.wrapping_add((src + done) as usize) as *const u8;
            let out_base = self.output.wrapping_add((dst + done) as usize) as *mut u8;
            let mut line = self.tid as u64;
            let mut aborted = false;
            while line < total {
                let k = line as usize;
                if line < nlines {
                    let valid = core::cmp::min(8, nbytes - line * 8);
                    // SAFETY: `valid` bytes at this offset are inside the caller's buffers.
                    let mut v = if SRC {
                        unsafe { load_partial(in_base.add(k * 8), valid, esize) }
                    } else {
                        0
                    };
                    if RECV {
                        // SAFETY: the line is inside the receive slot.
                        let Some(r) = self.read_line(unsafe { slot_r.add(k) }, fr) else {
                            aborted = true;
                            break;
                        };
                        v = if SRC { combine::<T, Op>(r, v) } else { r };
                    }
                    if div != 0 {
                        v = unpack(div_pack::<T>(pack(v), div));
                    }
                    if SEND {
                        // SAFETY: the line is inside the peer's slot.
                        Self::write_line(unsafe { slot_s.add(k) }, v, fs);
                    }
                    if DST {
                        // SAFETY: as for the load.
                        unsafe { store_partial(out_base.add(k * 8), v, valid, esize) };
                    }
                } else {
                    // Flag-wrap cleanup: every line of the slot carries the current flag.
                    if clean_recv {
                        // SAFETY: inside the receive slot.
                        if self.read_line(unsafe { slot_r.add(k) }, fr).is_none() {
                            aborted = true;
                            break;
                        }
                    }
                    if clean_send {
                        // SAFETY: inside the peer's slot.
                        Self::write_line(unsafe { slot_s.add(k) }, 0, fs);
                    }
                }
                line += self.nthreads as u64;
            }
            // Free the received slot once every thread has read its lines; share any abort.
            // SAFETY: every thread reaches the barriers; only thread 0 posts the credit.
            unsafe {
                if aborted {
                    self.smem.add(1).write_volatile(1);
                }
                arch::sync_threads();
                if self.smem.add(1).read_volatile() != 0 {
                    self.aborted = true;
                    return;
                }
                if RECV && self.tid == 0 {
                    arch::store_volatile_u64(self.recv.head, self.recv.step + 1);
                }
            }
            if SEND {
                self.send.step += 1;
            }
            if RECV {
                self.recv.step += 1;
            }
            done += len;
        }
    }
}

/// An 8-byte word in the low half of a pack (the upper half is zero and ignored).
#[inline(always)]
fn pack(v: u64) -> Pack {
    Pack([v as u32, (v >> 32) as u32, 0, 0])
}

/// The low 8 bytes of a pack.
#[inline(always)]
fn unpack(p: Pack) -> u64 {
    p.0[0] as u64 | (p.0[1] as u64) << 32
}

/// `op(a, b)` lane-wise over the elements packed in two 8-byte words.
#[inline(always)]
fn combine<T: Elem, Op: RedFn<T>>(a: u64, b: u64) -> u64 {
    unpack(Op::apply_pack(pack(a), pack(b)))
}

impl<T: Elem, Op: RedFn<T>> Primitives for Ll<T, Op> {
    fn send(&mut self, src: u64, n: u64) {
        self.generic_op::<false, true, true, false>(src, 0, n, false)
    }
    fn recv(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, false, false, true>(0, dst, n, false)
    }
    fn recv_reduce_send(&mut self, src: u64, n: u64) {
        self.generic_op::<true, true, true, false>(src, 0, n, false)
    }
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, false, true, true>(src, dst, n, post)
    }
    fn recv_copy_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, true>(0, dst, n, false)
    }
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, true>(src, dst, n, post)
    }
    fn copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, true>(src, dst, n, false)
    }
    fn aborted(&self) -> bool {
        self.aborted
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
