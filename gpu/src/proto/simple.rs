//! The Simple protocol (NCCL's `prims_simple.h`): large FIFO slots, synchronised by step counters.
//!
//! Each connection has a buffer of `buff_sizes[Simple]` bytes cut into [`FIFO_STEPS`] slots; a
//! slice of data occupies `k` = 1, 2 or 4 consecutive slots (steps), starting at a step that is a
//! multiple of `k`. To send the slice at step `s`, the block waits until the receiver has freed its
//! slots (`head + FIFO_STEPS ≥ s + k`), writes them, then publishes `tail = s + k`. To receive it,
//! it waits for `tail ≥ s + k`, reads the slots, then frees them with `head = s + k`. One thread polls and posts;
//! the whole block copies, 16-byte vectors at a time. Ordering: data stores, `barrier.sync`,
//! `fence.acq_rel.sys`, flag store on the writer; flag load (`ld.volatile`), `barrier.sync`, data
//! loads with `ld.volatile` (never a stale L1 line) on the reader, whose freeing of a slot needs no
//! fence — NCCL's `prims_simple.h` ordering; the build knob [`VOLATILE_SYNC`] restores a
//! `fence.acq_rel.sys` after the flag load (the CPU target always has it).
use super::Primitives;
use crate::abi::{ConnInfo, DevChannel, FIFO_STEPS, PACK_BYTES, SPINS_BEFORE_CHECK_ABORT};
use crate::arch::{self, Pack};
use crate::reduce::{Elem, OpArgs, RedFn, div_pack, pre_elem, pre_pack};
use core::marker::PhantomData;

/// What every thread of the block keeps of one connection for the duration of a kernel: the
/// FIFO buffer and the step. The connection's counters and exchange slot are thread 0's alone
/// and live in the block's shared memory ([`Ctl`]), so they hold no registers in the copy loops.
struct Conn {
    buff: *mut u8,
    step: u64,
}

/// Thread 0's part of the two connections and the abort flags, in the kernel's shared memory
/// from byte [`SMEM_CTL`] on. Only thread 0 writes and reads it (volatile, so the values are
/// not kept in registers across the verbs).
#[repr(C)]
struct Ctl {
    send_info: u64,
    send_head: u64,
    send_tail: u64,
    /// Step sizes for a proxy (`ConnInfo::sizes`); 0 when none are wanted.
    send_sizes: u64,
    /// Pointer-exchange slot (`ConnInfo::ptr_exchange`): `[output address, count]`; 0 when the
    /// connection has no direct writes.
    send_exchange: u64,
    send_exchanges: u64,
    recv_info: u64,
    recv_head: u64,
    recv_tail: u64,
    abort_flag: u64,
    /// The communicator's `DevComm::aborted` (read before the first direct write); 0 when none.
    comm_aborted: u64,
}

/// Byte offset of [`Ctl`] in the kernel's shared memory (after the abort word and the peer
/// output address).
const SMEM_CTL: usize = 16;
const _: () = assert!(SMEM_CTL + core::mem::size_of::<Ctl>() <= crate::abi::KERNEL_SMEM_BYTES);

macro_rules! ctl_get {
    ($self:ident . $f:ident) => {{
        // Some callers are inside an `unsafe` block already.
        #[allow(unused_unsafe)]
        // SAFETY: `ctl` points into this kernel's shared memory (constructor contract), 8-byte
        // aligned; only thread 0 accesses it.
        let v = unsafe { (&raw const (*$self.ctl()).$f).read_volatile() };
        v
    }};
}

/// Simple-protocol primitives for one channel of a ring, for element type `T` and operator `Op`.
pub struct Simple<T, Op> {
    tid: u32,
    nthreads: u32,
    input: *const T,
    output: *mut T,
    send: Conn,
    recv: Conn,
    /// Whether the send connection writes into the next rank's output (it has a pointer
    /// exchange), and whether the receive connection's data arrives in our output.
    send_direct: bool,
    recv_direct: bool,
    /// Bytes per FIFO slot and elements per slice (32-bit: a buffer is at most 1 GiB).
    slot_bytes: u32,
    slice_elems: u32,
    /// FIFO steps (slots) each slice occupies: 1, 2 or 4 (NCCL's `StepPerSlice`).
    steps_per_slice: u32,
    smem: *mut u32,
    aborted: bool,
    /// Avg's post-division and PreMulSum's scalar.
    op_args: OpArgs,
    /// The next rank's output for this kernel, once a direct send fetched it from the pointer
    /// exchange (null before).
    peer_output: *mut u8,
    _op: PhantomData<Op>,
}

/// `u32` index in the kernel's shared memory where thread 0 leaves the fetched peer output
/// address for the block (8-byte aligned: the shared array is 16-byte aligned).
const SMEM_PEER_OUTPUT: usize = 2;

impl<T: Elem, Op: RedFn<T>> Simple<T, Op> {
    /// Loads the channel's ring connections (NCCL's Primitives constructor).
    ///
    /// # Safety
    /// `channel` is a set-up channel of a communicator whose Simple buffers are `buff_size` bytes;
    /// `input`/`output` are valid for every offset the algorithm passes; `smem` points at kernel
    /// shared memory; `abort_flag` is 0 or a valid flag address; `comm_aborted` is the
    /// communicator's `DevComm::aborted` (or null). All threads of the block call it.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        tid: u32,
        nthreads: u32,
        channel: *mut DevChannel,
        buff_size: u64,
        input: *const T,
        output: *mut T,
        abort_flag: u64,
        comm_aborted: *const u32,
        smem: *mut u32,
        op_args: OpArgs,
        slice_elems: u64,
    ) -> Self {
        // SAFETY: caller guarantees `channel` is valid; fields are plain data.
        let (send_info, recv_info) = unsafe { (&raw mut (*channel).send, &raw mut (*channel).recv) };
        // SAFETY: as above.
        let (sc, rc) = unsafe { (send_info.read(), recv_info.read()) };
        // Pointer exchange (NCCL's `ptrExchange` of a direct connection): the receiving end
        // publishes this kernel's output in every Simple kernel; the sending end counts the same
        // kernels and reads the address only when it first sends directly (`wait`). Both ends
        // run the same kernels on a channel (same collective, protocol and channel count on
        // every rank), so their counts agree.
        let (send_direct, recv_direct) = (sc.ptr_exchange != 0, rc.ptr_exchange != 0);
        if tid == 0 {
            // SAFETY: `smem` is this kernel's shared memory of KERNEL_SMEM_BYTES, 16-byte
            // aligned (caller contract); only thread 0 touches the `Ctl` part.
            unsafe {
                let ctl = (smem as *mut u8).add(SMEM_CTL) as *mut Ctl;
                // Field by field: a volatile store of the whole struct would build it in local
                // memory first.
                macro_rules! put {
                    ($($f:ident = $v:expr),*) => {$( (&raw mut (*ctl).$f).write_volatile($v); )*};
                }
                put!(
                    send_info = send_info as u64,
                    send_head = sc.head,
                    send_tail = sc.tail,
                    send_sizes = sc.sizes,
                    send_exchange = sc.ptr_exchange,
                    send_exchanges = sc.exchanges + u64::from(send_direct),
                    recv_info = recv_info as u64,
                    recv_head = rc.head,
                    recv_tail = rc.tail,
                    abort_flag = abort_flag,
                    comm_aborted = comm_aborted as u64
                );
                if recv_direct {
                    // SAFETY: a non-null slot is two 16-byte aligned `u64` in the sender's
                    // memory, which this rank addresses (ConnInfo contract); the pair is one
                    // store, so the sender never sees the new count with an old address. The
                    // new count is stored back at once: only this block's next kernel reads it.
                    arch::store_pair_u64(rc.ptr_exchange as *mut u64, output as u64, rc.exchanges + 1);
                    (*recv_info).exchanges = rc.exchanges + 1;
                }
            }
        }
        let send = Conn {
            buff: sc.buffs[crate::abi::Proto::Simple as usize] as *mut u8,
            step: sc.step,
        };
        let recv = Conn {
            buff: rc.buffs[crate::abi::Proto::Simple as usize] as *mut u8,
            step: rc.step,
        };
        let slot_bytes = buff_size / FIFO_STEPS / PACK_BYTES * PACK_BYTES;
        let esize = core::mem::size_of::<T>() as u64;
        let slot_elems = slot_bytes / esize;
        // A slice spans 1, 2 or 4 contiguous slots, so at least two slices are always in flight.
        let max_slice = slot_elems * (FIFO_STEPS / 2);
        let slice_elems = if slice_elems == 0 || slice_elems > max_slice {
            slot_elems
        } else {
            slice_elems
        };
        let steps_per_slice = slice_elems.div_ceil(slot_elems).next_power_of_two();
        Simple {
            tid,
            nthreads,
            input,
            output,
            send,
            recv,
            send_direct,
            recv_direct,
            slot_bytes: slot_bytes as u32,
            slice_elems: slice_elems as u32,
            steps_per_slice: steps_per_slice as u32,
            smem,
            aborted: false,
            op_args,
            peer_output: core::ptr::null_mut(),
            _op: PhantomData,
        }
    }

    /// Stores the connection steps back for the next kernel (NCCL's Primitives destructor).
    ///
    /// # Safety
    /// All threads of the block call it, once, after the last verb.
    pub unsafe fn finish(self) {
        // SAFETY: every thread reaches this barrier; then only thread 0 writes.
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                let (si, ri) = (ctl_get!(self.send_info) as *mut ConnInfo, ctl_get!(self.recv_info) as *mut ConnInfo);
                (*si).step = self.send.step;
                (*ri).step = self.recv.step;
                (*si).exchanges = ctl_get!(self.send_exchanges);
            }
        }
    }

    /// [`Self::finish`] for a block that used only one of the channel's two connections (a
    /// point-to-point send, `send`, or receive): only that connection's step is stored back, as
    /// another block of the same launch may be using the other one.
    ///
    /// # Safety
    /// As [`Self::finish`].
    pub unsafe fn finish_one(self, send: bool) {
        // SAFETY: every thread reaches this barrier; then only thread 0 writes.
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                if send {
                    (*(ctl_get!(self.send_info) as *mut ConnInfo)).step = self.send.step;
                } else {
                    (*(ctl_get!(self.recv_info) as *mut ConnInfo)).step = self.recv.step;
                }
            }
        }
    }

    /// Point-to-point: receives `n` elements sent by one `send(_, n)` into output[dst..], but
    /// writes only the first `keep` (≤ `n`) of them: every step is consumed, so the sender
    /// finishes, and nothing lands past an output shorter than what was sent.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn recv_upto(&mut self, dst: u64, n: u64, keep: u64) {
        if self.aborted {
            return;
        }
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(u64::from(self.slice_elems), n - done);
            self.recv.step = self.recv.step.next_multiple_of(u64::from(self.steps_per_slice));
            if !self.wait::<true, false>(false) {
                return;
            }
            let copy = core::cmp::min(len, keep.saturating_sub(done));
            if copy > 0 {
                let out_ptr = self.output.wrapping_add((dst + done) as usize) as *mut u8;
                // SAFETY: the slot holds `len` ≥ `copy` received elements; the output holds
                // `keep` elements from `dst` (caller contract).
                unsafe {
                    reduce_copy::<T, Op, false, false>(
                        self.tid,
                        self.nthreads,
                        self.slot(&self.recv),
                        core::ptr::null(),
                        out_ptr,
                        core::ptr::null_mut(),
                        copy,
                        0,
                        PreOn::None,
                        &self.op_args,
                    )
                };
            }
            self.post::<true, false>();
            done += len;
        }
    }

    /// Thread 0's connection state in shared memory.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn ctl(&self) -> *mut Ctl {
        self.smem.wrapping_byte_add(SMEM_CTL) as *mut Ctl
    }

    /// Spins until `ready()`; polls the abort flag every `SPINS_BEFORE_CHECK_ABORT` tries.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn spin(&self, mut ready: impl FnMut() -> bool) -> bool {
        let mut spins = 0u32;
        while !ready() {
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                if super::fan::abort_raised(ctl_get!(self.abort_flag) as *const u32) {
                    return false;
                }
            }
            arch::spin_pause();
        }
        true
    }

    /// Thread 0 waits for the FIFO slots this step needs (and, with `fetch`, for the next rank's
    /// output address), then the block learns whether to abort (and the address).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn wait<const RECV: bool, const SEND: bool>(&mut self, fetch: bool) -> bool {
        if self.tid == 0 {
            let mut ok = true;
            if SEND && fetch {
                let (slot, want) = (ctl_get!(self.send_exchange) as *mut u64, ctl_get!(self.send_exchanges));
                // Before the first write into memory that is not the communicator's: a kernel
                // that starts after an abort (queued behind other work) must not write a
                // receiver's output, which its owner may free once its own abort returned.
                // `spin` only polls the flag when it has to wait. This is the device-side copy
                // of the flag: the host-mapped one costs a PCIe round trip per block, and the
                // blocks' reads of it queue behind each other (≈ 1 µs per channel on H200).
                // Loaded before the slot, so the two loads overlap; a value from before the
                // wait is enough: an abort that comes later waits for this kernel to end.
                // SAFETY: `comm_aborted` is null or valid (constructor contract).
                let comm_aborted = ctl_get!(self.comm_aborted) as *const u32;
                let mirror = if comm_aborted.is_null() {
                    0
                } else {
                    unsafe { arch::load_volatile_u32(comm_aborted) }
                };
                let mut peer = 0u64;
                // SAFETY: `fetch` is only set on a connection with an exchange slot: two 16-byte
                // aligned `u64` in our own memory, written as one pair. The receiver cannot
                // publish its next kernel's address before it has received this send, so the
                // address stays this kernel's.
                ok = self.spin(|| {
                    let (p, count) = unsafe { arch::load_pair_u64(slot) };
                    peer = p;
                    count >= want
                });
                // SAFETY: smem is valid kernel shared memory, 8-byte aligned at this index.
                unsafe { (self.smem.add(SMEM_PEER_OUTPUT) as *mut u64).write_volatile(peer) };
                if mirror != 0 {
                    ok = false;
                }
            }
            if RECV && ok {
                let (tail, want) = (ctl_get!(self.recv_tail) as *const u64, self.recv.step + u64::from(self.steps_per_slice));
                // SAFETY: `tail` is this connection's counter (constructor contract).
                ok = self.spin(|| unsafe { arch::load_volatile_u64(tail) } >= want);
            }
            if SEND && ok {
                let (head, want) = (ctl_get!(self.send_head) as *const u64, self.send.step + u64::from(self.steps_per_slice));
                // SAFETY: as above, for the send connection's head.
                ok = self.spin(|| unsafe { arch::load_volatile_u64(head) } + FIFO_STEPS >= want);
            }
            // SAFETY: fence has no operands; smem is valid kernel shared memory.
            unsafe {
                if !VOLATILE_SYNC {
                    arch::fence_acq_rel_sys();
                }
                self.smem.write_volatile(if ok { 0 } else { 1 });
            }
        }
        // SAFETY: all threads of the block execute `wait` with the same control flow.
        unsafe { arch::sync_threads() };
        // SAFETY: written by thread 0 before the barrier.
        self.aborted = unsafe { self.smem.read_volatile() } != 0;
        if SEND && fetch {
            // SAFETY: written by thread 0 before the barrier, 8-byte aligned.
            self.peer_output =
                unsafe { (self.smem.add(SMEM_PEER_OUTPUT) as *const u64).read_volatile() } as *mut u8;
        }
        !self.aborted
    }

    /// After the block's copy: publish the sent slot and free the received one.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn post<const RECV: bool, const SEND: bool>(&mut self) {
        // SAFETY: all threads reach this barrier; only thread 0 stores the counters.
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                if SEND || !VOLATILE_SYNC {
                    arch::fence_acq_rel_sys();
                }
                if SEND {
                    arch::store_volatile_u64(ctl_get!(self.send_tail) as *mut u64, self.send.step + u64::from(self.steps_per_slice));
                }
                if RECV {
                    arch::store_volatile_u64(ctl_get!(self.recv_head) as *mut u64, self.recv.step + u64::from(self.steps_per_slice));
                }
            }
        }
        if SEND {
            self.send.step += u64::from(self.steps_per_slice);
        }
        if RECV {
            self.recv.step += u64::from(self.steps_per_slice);
        }
    }

    /// Thread 0 stores the bytes of each send step from `from` to the end of the current slice
    /// (`bytes` spread over its slots; 0 for the steps the slice's alignment skipped) where the
    /// proxy reads them (NCCL's `connFifo[].size`), before [`Self::post`] publishes the tail.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn publish_sizes(&self, from: u64, bytes: u64) {
        if self.tid != 0 {
            return;
        }
        let sizes = ctl_get!(self.send_sizes) as *mut u64;
        if sizes.is_null() {
            return;
        }
        let first = self.send.step;
        let mut st = from;
        while st < first + u64::from(self.steps_per_slice) {
            let v = if st < first {
                0
            } else {
                core::cmp::min(
                    u64::from(self.slot_bytes),
                    bytes.saturating_sub((st - first) * u64::from(self.slot_bytes)),
                )
            };
            // SAFETY: `sizes` holds FIFO_STEPS entries (ConnInfo contract); `wait` saw the proxy
            // free these slots, so it no longer reads their entries.
            unsafe { arch::store_volatile_u64(sizes.add((st % FIFO_STEPS) as usize), v) };
            st += 1;
        }
    }

    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn slot(&self, c: &Conn) -> *mut u8 {
        // SAFETY: the slot lies inside the connection buffer.
        unsafe { c.buff.add(((c.step % FIFO_STEPS) * u64::from(self.slot_bytes)) as usize) }
    }

    /// The one engine behind every verb (NCCL's `genericOp`): per FIFO step, wait, combine up to
    /// two sources (input `SRC`, FIFO `RECV`) into up to two destinations (output `DST`, FIFO
    /// `SEND`), post.
    ///
    /// `DIRECT` verbs (the `direct_*` ones): on a connection with a pointer exchange, the sent
    /// data goes to the next rank's output at `dst` instead of its FIFO, and a pure receive
    /// (`RECV` without `SRC`) finds its data already in our output at `dst`: `recv` then copies
    /// nothing, `recv_copy_send` forwards from the output. The steps, waits and posts are those
    /// of the FIFO path, so the two ends stay in step whichever path a connection takes.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn generic_op<
        const RECV: bool,
        const SEND: bool,
        const SRC: bool,
        const DST: bool,
        const DIRECT: bool,
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
        let direct_send = DIRECT && SEND && self.send_direct;
        let direct_recv = DIRECT && RECV && !SRC && self.recv_direct;
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(u64::from(self.slice_elems), n - done);
            let from = self.send.step;
            // A slice starts on a multiple of its step count so its slots are contiguous. Both ends
            // of a connection see the same slices, so they align their steps identically.
            if RECV {
                self.recv.step = self.recv.step.next_multiple_of(u64::from(self.steps_per_slice));
            }
            if SEND {
                self.send.step = self.send.step.next_multiple_of(u64::from(self.steps_per_slice));
            }
            if !self.wait::<RECV, SEND>(direct_send && self.peer_output.is_null()) {
                return;
            }
            let in_ptr = self.input.wrapping_add((src + done) as usize) as *const u8;
            let out_ptr = self.output.wrapping_add((dst + done) as usize) as *mut u8;
            let recv_ptr = if RECV {
                self.slot(&self.recv)
            } else {
                core::ptr::null_mut()
            };
            let send_ptr = if direct_send {
                self.peer_output
                    .wrapping_add(((dst + done) * core::mem::size_of::<T>() as u64) as usize)
            } else if SEND {
                self.slot(&self.send)
            } else {
                core::ptr::null_mut()
            };
            if direct_recv {
                // The data is already in our output; forward it if this verb sends.
                if SEND {
                    // SAFETY: our output and the destination cover `len` elements (algorithm
                    // and FIFO geometry contracts, the receiver's output for a direct send).
                    unsafe {
                        reduce_copy::<T, Op, false, false>(
                            self.tid,
                            self.nthreads,
                            out_ptr,
                            core::ptr::null(),
                            send_ptr,
                            core::ptr::null_mut(),
                            len,
                            0,
                            PreOn::None,
                            &self.op_args,
                        )
                    };
                    self.publish_sizes(from, len * core::mem::size_of::<T>() as u64);
                }
                self.post::<RECV, SEND>();
                done += len;
                continue;
            }
            let (s0, s1): (*const u8, *const u8) = match (SRC, RECV) {
                (true, true) => (recv_ptr, in_ptr),
                (true, false) => (in_ptr, core::ptr::null()),
                _ => (recv_ptr, core::ptr::null()),
            };
            let (d0, d1) = match (DST, SEND) {
                (true, true) => (out_ptr, send_ptr),
                (true, false) => (out_ptr, core::ptr::null_mut()),
                _ => (send_ptr, core::ptr::null_mut()),
            };
            let div = if post { self.op_args.postdiv } else { 0 };
            // The input is the second source when the FIFO is the first (PreMulSum scales it).
            let pre = match (SRC, RECV) {
                (true, true) => PreOn::S1,
                (true, false) => PreOn::S0,
                _ => PreOn::None,
            };
            let a = &self.op_args;
            // One monomorphised copy per (two sources, two destinations).
            macro_rules! copy {
                ($two_src:literal, $two_dst:literal) => {
                    reduce_copy::<T, Op, $two_src, $two_dst>(
                        self.tid,
                        self.nthreads,
                        s0,
                        s1,
                        d0,
                        d1,
                        len,
                        div,
                        pre,
                        a,
                    )
                };
            }
            // SAFETY: the pointers cover `len` elements (algorithm and FIFO geometry contracts).
            unsafe {
                match (SRC && RECV, DST && SEND) {
                    (true, true) => copy!(true, true),
                    (true, false) => copy!(true, false),
                    (false, true) => copy!(false, true),
                    (false, false) => copy!(false, false),
                }
            }
            if SEND {
                self.publish_sizes(from, len * core::mem::size_of::<T>() as u64);
            }
            self.post::<RECV, SEND>();
            done += len;
        }
    }
}

/// 16-byte loads per source each thread keeps in flight in the copy loop. A build-time knob for
/// kernel tuning: `OXCCL_BUILD_UNROLL=N cargo build` (1..=16; default 4).
const UNROLL: usize = match option_env!("OXCCL_BUILD_UNROLL") {
    Some(s) => parse_unroll(s.as_bytes()),
    None => 4,
};

/// How the Simple protocol's receiving side synchronises on the GPU, a build-time knob
/// (`OXCCL_BUILD_SIMPLE_SYNC=fence|volatile cargo build`; default `volatile`, measured 2–5 %
/// faster at ≥ 64 MiB and 14 % at 8 B on 2×H200, docs/benchmarks.md, the 2026-11-30 tree AllReduce entry):
/// - `fence`: thread 0 fences (`fence.acq_rel.sys`) after it sees the peer's counter, and before
///   every post; data loads are plain `ld.global`.
/// - `volatile`: NCCL's way (`prims_simple.h`: "volatile is faster than acquire"): no fence after
///   the counter, the copy loads with `ld.volatile` so no stale L1 line is read, and a post that
///   only frees received slots stores the head without a fence (the block's loads completed before
///   the barrier). A post that publishes sent data still fences first.
///
/// The CPU target always fences (its atomics need the acquire).
pub(crate) const VOLATILE_SYNC: bool = cfg!(target_arch = "nvptx64")
    && match option_env!("OXCCL_BUILD_SIMPLE_SYNC") {
        Some(s) => parse_sync(s.as_bytes()),
        None => true,
    };

/// `volatile` → true, `fence` → false; anything else fails the build.
const fn parse_sync(s: &[u8]) -> bool {
    match s {
        b"volatile" => true,
        b"fence" => false,
        _ => panic!("OXCCL_BUILD_SIMPLE_SYNC must be `fence` or `volatile`"),
    }
}

/// A 16-byte source load of the Simple copy loops (see [`VOLATILE_SYNC`]).
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn load_src(p: *const Pack) -> Pack {
    // SAFETY: caller guarantees `p`.
    unsafe {
        if VOLATILE_SYNC {
            arch::load_volatile_v4_data(p)
        } else {
            arch::load_v4(p)
        }
    }
}

/// An element source load of the Simple copy loops (see [`VOLATILE_SYNC`]).
///
/// # Safety
/// `p` is valid and aligned for `T`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn read_src<T>(p: *const T) -> T {
    // SAFETY: caller guarantees `p`.
    unsafe {
        if VOLATILE_SYNC {
            p.read_volatile()
        } else {
            p.read()
        }
    }
}

pub(crate) const fn parse_unroll(s: &[u8]) -> usize {
    let mut n = 0usize;
    let mut i = 0;
    while i < s.len() {
        assert!(s[i].is_ascii_digit(), "OXCCL_BUILD_*UNROLL must be a number");
        n = n * 10 + (s[i] - b'0') as usize;
        i += 1;
    }
    assert!(n >= 1 && n <= 16, "OXCCL_BUILD_*UNROLL must be in 1..=16");
    n
}

/// Which source of [`reduce_copy`] is this rank's input, which PreMulSum scales first.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreOn {
    None,
    S0,
    S1,
}

/// `d0 (, d1) = s0 (⊕ s1) (/ div)` over `n` elements, spread over `nthreads` threads: 16-byte
/// packs when every pointer is 16-byte aligned, then element by element for the rest (NCCL's
/// `reduceCopy`). `div == 0` means no post-division; the source `pre` names is first scaled by
/// `args.scalar` when `Op` is PreMulSum.
///
/// # Safety
/// The pointers in use are valid for `n` elements of `T`; the destinations overlap no source
/// except exactly (in place).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn reduce_copy<T: Elem, Op: RedFn<T>, const TWO_SRC: bool, const TWO_DST: bool>(
    tid: u32,
    nthreads: u32,
    s0: *const u8,
    s1: *const u8,
    d0: *mut u8,
    d1: *mut u8,
    n: u64,
    div: u32,
    pre: PreOn,
    args: &OpArgs,
) {
    // Indices are 32-bit (fewer registers in the unrolled loops): a call copies at most one
    // slice, which fits a FIFO buffer (`NCCL_BUFFSIZE` ≤ 1 GiB, checked by the host).
    let n = n as u32;
    let esize = core::mem::size_of::<T>() as u32;
    let mut addrs = s0 as u64 | d0 as u64;
    if TWO_SRC {
        addrs |= s1 as u64;
    }
    if TWO_DST {
        addrs |= d1 as u64;
    }
    let npacks = if addrs % PACK_BYTES == 0 {
        n * esize / PACK_BYTES as u32
    } else {
        0
    };
    // On the host a thread's packs are contiguous (see below).
    #[cfg(target_arch = "nvptx64")]
    let stride = nthreads;
    #[cfg(not(target_arch = "nvptx64"))]
    let stride = 1u32;
    let op = #[cfg_attr(target_arch = "nvptx64", inline(always))]
    |a: Pack, b: Pack| -> Pack {
        let a = if pre == PreOn::S0 {
            pre_pack::<T, Op>(a, args)
        } else {
            a
        };
        let b = if pre == PreOn::S1 {
            pre_pack::<T, Op>(b, args)
        } else {
            b
        };
        let v = if TWO_SRC { Op::apply_pack(args, a, b) } else { a };
        if div != 0 { div_pack::<T>(v, div) } else { v }
    };
    let (ps0, ps1) = (s0 as *const Pack, s1 as *const Pack);
    let (pd0, pd1) = (d0 as *mut Pack, d1 as *mut Pack);
    // Which packs this thread takes: on the GPU every `nthreads`-th from `tid` (a warp's loads
    // coalesce); on the host a contiguous share ([`host_share`]), because a block's fibers run
    // one after the other and a strided walk would stream every cache line of the slice once
    // per fiber.
    #[cfg(target_arch = "nvptx64")]
    let (mut i, end) = (tid, npacks);
    #[cfg(not(target_arch = "nvptx64"))]
    let (mut i, end) = host_share(tid, nthreads, 0, npacks);
    // SAFETY (whole block): indices stay below `end` ≤ `npacks`, inside the caller's ranges.
    unsafe {
        i = if narrow_runtime_op::<T, Op>() {
            pack_rounds::<TWO_SRC, TWO_DST, 2>(i, end, stride, [ps0, ps1], [pd0, pd1], &op)
        } else {
            pack_rounds::<TWO_SRC, TWO_DST, UNROLL>(i, end, stride, [ps0, ps1], [pd0, pd1], &op)
        };
        while i < end {
            let a = load_src(ps0.add(i as usize));
            let b = if TWO_SRC {
                load_src(ps1.add(i as usize))
            } else {
                Pack::default()
            };
            let r = op(a, b);
            arch::store_v4(pd0.add(i as usize), r);
            if TWO_DST {
                arch::store_v4(pd1.add(i as usize), r);
            }
            i += stride;
        }
        // Remaining elements (or all of them when a pointer is misaligned).
        let (es0, es1) = (s0 as *const T, s1 as *const T);
        let (ed0, ed1) = (d0 as *mut T, d1 as *mut T);
        #[cfg(target_arch = "nvptx64")]
        let (mut e, eend) = (npacks * PACK_BYTES as u32 / esize + tid, n);
        #[cfg(not(target_arch = "nvptx64"))]
        let (mut e, eend) = host_share(tid, nthreads, npacks * PACK_BYTES as u32 / esize, n);
        while e < eend {
            let k = e as usize;
            let mut r = read_src(es0.add(k));
            if pre == PreOn::S0 {
                r = pre_elem::<T, Op>(r, args);
            }
            if TWO_SRC {
                let mut b = read_src(es1.add(k));
                if pre == PreOn::S1 {
                    b = pre_elem::<T, Op>(b, args);
                }
                r = Op::apply(args, r, b);
            }
            if div != 0 {
                r = T::div(r, div);
            }
            ed0.add(k).write(r);
            if TWO_DST {
                ed1.add(k).write(r);
            }
            e += stride;
        }
    }
}

/// Whether [`reduce_copy`] keeps 2 loads per source in flight instead of [`UNROLL`]: a 1-byte type
/// under the call's operator read at run time ([`RedFn::RUNTIME_OP`]). Its 16 lanes a pack, for
/// each operator, need the registers that 4 loads in flight would take; with 2 the AllReduce
/// kernel's spills fit the shared memory the JIT may spill to (host `cuda/ptx.rs`).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
const fn narrow_runtime_op<T: Elem, Op: RedFn<T>>() -> bool {
    Op::RUNTIME_OP && core::mem::size_of::<T>() == 1 && UNROLL > 2
}

/// [`reduce_copy`]'s unrolled rounds: from pack `i`, while `U` packs `stride` apart remain below
/// `end`, loads `U` packs of each source, then stores `op` of them to each destination. Returns
/// the first pack not done.
///
/// # Safety
/// As [`reduce_copy`]: every pack index below `end` is valid in each pointer in use.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn pack_rounds<const TWO_SRC: bool, const TWO_DST: bool, const U: usize>(
    mut i: u32,
    end: u32,
    stride: u32,
    src: [*const Pack; 2],
    dst: [*mut Pack; 2],
    op: &impl Fn(Pack, Pack) -> Pack,
) -> u32 {
    let ([ps0, ps1], [pd0, pd1]) = (src, dst);
    // SAFETY (whole block): indices stay below `end`, inside the caller's ranges.
    unsafe {
        while i + (U as u32 - 1) * stride < end {
            let mut v = [Pack::default(); U];
            let mut w = [Pack::default(); U];
            crate::unroll::each::<U>(|u| v[u] = load_src(ps0.add((i + u as u32 * stride) as usize)));
            if TWO_SRC {
                crate::unroll::each::<U>(|u| w[u] = load_src(ps1.add((i + u as u32 * stride) as usize)));
            }
            crate::unroll::each::<U>(
                #[cfg_attr(target_arch = "nvptx64", inline(always))]
                |u| {
                    let r = op(v[u], w[u]);
                    let k = (i + u as u32 * stride) as usize;
                    arch::store_v4(pd0.add(k), r);
                    if TWO_DST {
                        arch::store_v4(pd1.add(k), r);
                    }
                },
            );
            i += U as u32 * stride;
        }
    }
    i
}

/// The indices in `from..to` thread `tid` of a block of `nthreads` handles on the host, as the
/// run `first..end`: the range split into `nthreads` contiguous shares that cover it (the GPU
/// takes every `nthreads`-th index from `from + tid` instead; see [`reduce_copy`]).
#[cfg(not(target_arch = "nvptx64"))]
fn host_share(tid: u32, nthreads: u32, from: u32, to: u32) -> (u32, u32) {
    let chunk = to.saturating_sub(from).div_ceil(nthreads);
    let first = core::cmp::min(from.saturating_add(tid.saturating_mul(chunk)), to);
    (first, core::cmp::min(first + chunk, to))
}

impl<T: Elem, Op: RedFn<T>> Primitives for Simple<T, Op> {
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
    fn send(&mut self, src: u64, n: u64) {
        self.generic_op::<false, true, true, false, false>(src, 0, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, false, false, true, false>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_send(&mut self, src: u64, n: u64) {
        self.generic_op::<true, true, true, false, false>(src, 0, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, false, true, true, false>(src, dst, n, post)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_copy_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, true, false>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, true, false>(src, dst, n, post)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, true, false>(src, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn aborted(&self) -> bool {
        self.aborted
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, false, true>(src, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, true, true>(src, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_recv(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, false, false, true, true>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_recv_copy_direct_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, true, true>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy_direct_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, true, true>(src, dst, n, post)
    }
}

#[cfg(all(test, not(target_arch = "nvptx64")))]
mod tests {
    use super::host_share;

    /// Every index of `from..to` goes to exactly one thread, for block sizes that do and do not
    /// divide the range, empty ranges and ranges shorter than the block.
    #[test]
    fn thread_shares_are_disjoint_and_cover_the_range() {
        for nthreads in [1u32, 2, 31, 32, 64, 512] {
            for (from, to) in [(0u32, 0u32), (0, 1), (5, 5), (3, 17), (0, 64), (7, 4099), (100, 100_003)] {
                let mut hits = std::vec![0u32; (to - from) as usize];
                for tid in 0..nthreads {
                    let (first, end) = host_share(tid, nthreads, from, to);
                    assert!(end <= to && first >= from.min(to), "tid {tid}/{nthreads} of {from}..{to}");
                    for i in first..end {
                        hits[(i - from) as usize] += 1;
                    }
                }
                let bad: std::vec::Vec<_> = hits.iter().enumerate().filter(|(_, h)| **h != 1).collect();
                assert!(bad.is_empty(), "{nthreads} threads over {from}..{to}: {} indices not covered once, first {:?}", bad.len(), bad.first());
            }
        }
    }
}
