//! The LL128 protocol (NCCL's `prims_ll128.h`): data travels in 128-byte lines of 15 data words
//! and one flag word (120 data bytes per 128), so it keeps LL's "no fence, no tail" latency at
//! nearly Simple's bandwidth.
//!
//! On the GPU a line is written warp-cooperatively: the 8 threads of a line group each store 16
//! bytes (`st.volatile.v2.u64`) in one warp instruction, the last thread's second word being the
//! flag, and NVLink delivers the 128-byte line as one unit; the reader's 8 threads load the line
//! the same way and the warp retries until every flag thread of the warp saw its flag (a warp
//! vote). The CPU target runs the same lanes and votes (its blocks are whole warps), ordering
//! what one 16-byte store gives the GPU explicitly: a writer's lanes store their data parts, meet
//! at the warp barrier, then each flag lane stores its flags with release; a reader's flag lanes
//! load the flags with acquire, the warp votes, then every lane loads its data parts.
//!
//! A connection's LL128 buffer (`buff_sizes[Ll128]` bytes) holds [`FIFO_STEPS`] slots of lines.
//! Lines of step `s` carry the flag `s + 1` as a full 64-bit word: it never wraps in practice
//! (2^64 steps), so unlike LL no cleanup pass exists, and a slot's previous flag (`s − 7`) never
//! equals the current one. Credits work as in LL: the sender waits for `head + FIFO_STEPS ≥ s + 1`,
//! the receiver sets `head = s + 1` once the whole block has read the slot.
use super::fan::{Fan, Peers, abort_raised};
use super::ll::{load_partial, store_partial};
use super::{Primitives, balanced_step, each_peer};
use crate::abi::{FIFO_STEPS, MAX_TREE_ARITY, Proto, SPINS_BEFORE_CHECK_ABORT};
use crate::arch::{self, Pack};
use crate::reduce::{Elem, LineIdx, OpArgs, RedFn, div_pack, pre_pack};
use crate::unroll;
use core::marker::PhantomData;

/// Bytes per LL128 line.
pub const LL128_LINE_BYTES: u64 = 128;
/// Data bytes per line (15 of the 16 words; the last word is the flag).
pub const LL128_DATA_BYTES: u64 = 120;
/// Threads (16-byte parts) per line on the GPU.
pub const LL128_LINE_PARTS: u64 = 8;

/// Line parts (16-byte pieces) one thread handles: one, the 8 threads of a line group together
/// writing or reading the whole line.
const PARTS: usize = 1;

/// Lines a thread works on per loop iteration: their loads are all in flight at once. A
/// build-time knob for kernel tuning: `OXCCL_BUILD_LL128_UNROLL=N cargo build` (1..=16; default 2).
const UNROLL: usize = match option_env!("OXCCL_BUILD_LL128_UNROLL") {
    Some(s) => super::simple::parse_unroll(s.as_bytes()),
    None => 2,
};

/// The flag of the lines of step `step`: never 0, never repeated within a connection's lifetime.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub const fn ll128_flag(step: u64) -> u64 {
    step.wrapping_add(1)
}

/// This thread's place in the line layout of a block.
#[derive(Clone, Copy)]
struct Lanes {
    /// First line this thread works on; then every `stride` lines.
    group: u32,
    stride: u32,
    /// First part (16-byte piece) of the line this thread owns; it owns [`PARTS`] of them.
    part0: u32,
    /// First line of this thread's warp: loop bounds use it so a warp stays converged.
    warp_group: u32,
}

impl Lanes {
    fn new(tid: u32, nthreads: u32) -> Self {
        let parts = LL128_LINE_PARTS as u32;
        Lanes {
            group: tid / parts,
            stride: nthreads / parts,
            part0: tid % parts,
            warp_group: tid / 32 * (32 / parts),
        }
    }
}

/// LL128-protocol primitives over a fan of up to `NR` receive and `NS` send connections (NCCL's
/// `Primitives<…, FanAsymmetric<NR, NS>, …, ProtoLL128>`): a receiving verb combines the lines of
/// every receive peer (and the input, for the reducing verbs), a sending verb writes the same
/// lines to every send peer. [`Ll128`] is the ring's fan of one and one; the tree's phases are
/// [`TreeLl128Up`] and [`TreeLl128Down`].
pub struct Ll128Fan<T, Op, const NR: usize, const NS: usize> {
    tid: u32,
    nthreads: u32,
    lanes: Lanes,
    input: *const T,
    output: *mut T,
    conns: Fan<u64, NR, NS>,
    /// Lines per step (slot).
    step_lines: u32,
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

/// LL128-protocol primitives for one channel of a ring: one receive peer (prev), one send peer
/// (next).
pub type Ll128<T, Op> = Ll128Fan<T, Op, 1, 1>;
/// The reduce phase of a channel's tree on LL128: children → parent.
pub type TreeLl128Up<T, Op> = Ll128Fan<T, Op, MAX_TREE_ARITY, 1>;
/// The broadcast phase of a channel's tree on LL128: parent → children.
pub type TreeLl128Down<T, Op> = Ll128Fan<T, Op, 1, MAX_TREE_ARITY>;

impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> Ll128Fan<T, Op, NR, NS> {
    /// Loads the connections of `peers` (a ring channel, or one phase of a channel's tree).
    ///
    /// # Safety
    /// As `Simple::new`, for connections whose LL128 buffers are `buff_size` bytes (a multiple
    /// of `FIFO_STEPS × 128`), with `nthreads` a multiple of 32 on the GPU. All threads of the
    /// block call it.
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
        Ll128Fan {
            tid,
            nthreads,
            lanes: Lanes::new(tid, nthreads),
            input,
            output,
            // SAFETY: forwarded caller contract.
            conns: unsafe { Fan::load(tid, smem, peers, Proto::Ll128) },
            step_lines: (buff_size / FIFO_STEPS / LL128_LINE_BYTES) as u32,
            abort_flag: abort_flag as *const u32,
            smem,
            aborted: false,
            op_args,
            pre_input: true,
            _op: PhantomData,
        }
    }

    /// Elements of `T` one step carries (120 data bytes per line).
    pub fn step_elems(&self) -> u64 {
        self.step_lines as u64 * LL128_DATA_BYTES / core::mem::size_of::<T>() as u64
    }

    /// Stores the connection steps back for the next kernel.
    ///
    /// # Safety
    /// All threads of the block call it, once, after the last verb.
    pub unsafe fn finish(self) {
        // SAFETY: forwarded caller contract.
        unsafe { self.conns.finish(self.tid) }
    }

    /// Waits until this thread's parts of the [`UNROLL`] lines at `lines[u]` carry `flag` and
    /// writes them to `w`; false on abort. Every load of the batch is issued before any flag is
    /// checked (memory-level parallelism); when any flag thread of the warp saw a stale flag, the
    /// warp reloads the whole batch (NCCL's `needReload`). Every lane of the warp calls it
    /// together (`active[u]` false for lines past the end, which are not read).
    #[cfg(target_arch = "nvptx64")]
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn read_batch(
        &self,
        lines: &[*const u64; UNROLL],
        flag: u64,
        active: &[bool; UNROLL],
        w: &mut [[u64; 2 * PARTS]; UNROLL],
    ) -> bool {
        let mut spins = 0u32;
        let p = self.lanes.part0;
        let flag_part = p as u64 == LL128_LINE_PARTS - 1;
        loop {
            let mut stale = false;
            unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                if active[u] {
                    // SAFETY: the part lies inside the receive slot, 16-byte aligned.
                    let (a, b) = unsafe { arch::load_volatile_v2_u64(lines[u].add(2 * p as usize)) };
                    w[u][0] = a;
                    w[u][1] = b;
                    stale |= flag_part && b != flag;
                }
            });
            // SAFETY: the caller keeps the warp converged.
            if !unsafe { arch::vote_any(stale) } {
                return true;
            }
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                // SAFETY: as above; every lane takes the same branch.
                if unsafe { arch::vote_any(abort_raised(self.abort_flag)) } {
                    return false;
                }
            }
        }
    }

    /// CPU target: the GPU's batch read with the ordering its 16-byte loads give made explicit:
    /// the flag lanes load their flags with acquire, the warp votes (its barrier orders those
    /// loads before every lane's next ones), then each lane loads its data part. A warp that saw
    /// a stale flag gives its core away before it retries.
    #[cfg(not(target_arch = "nvptx64"))]
    fn read_batch(
        &self,
        lines: &[*const u64; UNROLL],
        flag: u64,
        active: &[bool; UNROLL],
        w: &mut [[u64; 2 * PARTS]; UNROLL],
    ) -> bool {
        let mut spins = 0u32;
        let p = self.lanes.part0;
        let flag_part = p as u64 == LL128_LINE_PARTS - 1;
        loop {
            let mut stale = false;
            for u in 0..UNROLL {
                if active[u] && flag_part {
                    // SAFETY: the flag word lies inside the receive slot, 8-byte aligned, and
                    // is only accessed atomically.
                    stale |= unsafe { arch::load_acquire_sys_u64(lines[u].add(15)) } != flag;
                }
            }
            // SAFETY: the caller keeps the warp converged.
            if !unsafe { arch::vote_any(stale) } {
                for u in 0..UNROLL {
                    if active[u] {
                        // SAFETY: the part lies inside the receive slot, 16-byte aligned; its
                        // words are only accessed atomically while shared.
                        let (a, b) = unsafe { arch::load_volatile_v2_u64(lines[u].add(2 * p as usize)) };
                        w[u][0] = a;
                        w[u][1] = b;
                    }
                }
                return true;
            }
            arch::spin_pause();
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                // SAFETY: as above; every lane takes the same branch.
                if unsafe { arch::vote_any(abort_raised(self.abort_flag)) } {
                    return false;
                }
            }
        }
    }

    /// Writes this thread's parts of `line` with `flag` in the last word (GPU: one 16-byte store
    /// per lane, the 8 lanes of a line in the same instruction).
    #[cfg(target_arch = "nvptx64")]
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn write_parts(&self, line: *mut u64, w: [u64; 2 * PARTS], flag: u64) {
        let p = self.lanes.part0;
        let hi = if p as u64 == LL128_LINE_PARTS - 1 { flag } else { w[1] };
        // SAFETY: the part lies inside the peer's slot, 16-byte aligned.
        unsafe { arch::store_volatile_v2_u64(line.add(2 * p as usize), w[0], hi) }
    }

    /// CPU target: the lane's data words only; the flag lane's flag follows in
    /// [`Self::publish_flags`], after the warp barrier, so a reader that sees the flag sees the
    /// whole line (what one 16-byte store per lane gives the GPU).
    #[cfg(not(target_arch = "nvptx64"))]
    fn write_parts(&self, line: *mut u64, w: [u64; 2 * PARTS], _flag: u64) {
        let p = self.lanes.part0 as usize;
        // SAFETY: the part lies inside the peer's slot, 16-byte aligned; its words are only
        // accessed atomically while shared.
        unsafe {
            arch::store_volatile_u64(line.add(2 * p), w[0]);
            if p != LL128_LINE_PARTS as usize - 1 {
                arch::store_volatile_u64(line.add(2 * p + 1), w[1]);
            }
        }
    }

    /// CPU target: after every lane of the warp wrote its parts of a batch's lines, the flag
    /// lanes store the flags (`flags[u][i]` for line `u` and send peer `i`) with release. Every
    /// lane of the warp calls it together.
    #[cfg(not(target_arch = "nvptx64"))]
    fn publish_flags(&self, lines: &[[*mut u64; NS]; UNROLL], flags: &[u64; NS], active: &[bool; UNROLL], nsend: usize) {
        // SAFETY: the caller keeps the warp converged.
        unsafe { arch::sync_warp() };
        if self.lanes.part0 as u64 != LL128_LINE_PARTS - 1 {
            return;
        }
        for u in 0..UNROLL {
            if active[u] {
                for i in 0..nsend {
                    // SAFETY: the flag word lies inside peer i's slot, 8-byte aligned.
                    unsafe { arch::store_release_sys_u64(lines[u][i].add(15), flags[i]) };
                }
            }
        }
    }

    /// Thread 0 waits for a free slot on every send peer; then the block learns whether to abort.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn wait_send_credit(&mut self) -> bool {
        self.aborted = !self.conns.wait_send_credit(self.tid, self.smem, self.abort_flag);
        !self.aborted
    }

    /// This thread's parts of lines `line` (where `active`) of every present receive peer's slot
    /// (`slots`, `flags`; the first `nrecv`), combined into `w`, peer 0 first; false on abort.
    /// Written out per peer (present peers are the leading ones) so nothing lands in GPU local
    /// memory. Every lane of the warp calls it together.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn fold_recv<I: LineIdx>(
        &self,
        slots: &[*mut u64; NR],
        flags: &[u64; NR],
        nrecv: usize,
        line: &[I; UNROLL],
        active: &[bool; UNROLL],
        w: &mut [[u64; 2 * PARTS]; UNROLL],
    ) -> bool {
        let line_words = (LL128_LINE_BYTES / 8) as usize;
        // Active lines lie inside the receive slot (inactive ones are not read).
        let at = |slot: *mut u64| {
            let mut a = [core::ptr::null::<u64>(); UNROLL];
            unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                a[u] = slot.wrapping_add(line[u].idx() * line_words);
            });
            a
        };
        if NR > 0 && nrecv > 0 && !self.read_batch(&at(slots[0]), flags[0], active, w) {
            return false;
        }
        let mut more = #[cfg_attr(target_arch = "nvptx64", inline(always))]
        |i: usize| {
            let mut w2 = [[0u64; 2 * PARTS]; UNROLL];
            if !self.read_batch(&at(slots[i]), flags[i], active, &mut w2) {
                return false;
            }
            unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                for q in 0..PARTS {
                    let v = Op::apply_pack(&self.op_args, words_pack(&w[u], q), words_pack(&w2[u], q));
                    pack_words(&mut w[u], q, v);
                }
            });
            true
        };
        if NR > 1 && nrecv > 1 && !more(1) {
            return false;
        }
        if NR > 2 && nrecv > 2 && !more(2) {
            return false;
        }
        true
    }

    /// The one engine behind every verb (NCCL's `GenericOp` of `prims_ll128.h`): per step, each
    /// line group takes its lines; for each, the lines of every receive peer (`RECV`) combined
    /// with the input (`SRC`), written to every send peer (`SEND`) and the output (`DST`).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn generic_op<const RECV: bool, const SEND: bool, const SRC: bool, const DST: bool>(
        &mut self,
        src: u64,
        dst: u64,
        n: u64,
        post: bool,
    ) {
        self.generic_op_with::<T::Line, RECV, SEND, SRC, DST>(src, dst, n, post)
    }

    /// [`Self::generic_op`] with a step's line arithmetic in `I` (the element type's
    /// [`Elem::Line`](crate::reduce::Elem::Line)).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn generic_op_with<I: LineIdx, const RECV: bool, const SEND: bool, const SRC: bool, const DST: bool>(
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
        let div = if post { self.op_args.postdiv } else { 0 };
        let (nrecv, nsend) = self.conns.counts::<RECV, SEND>();
        let lanes = self.lanes;
        let (group, stride, part0, warp_group) =
            (I::of(lanes.group), I::of(lanes.stride), I::of(lanes.part0), I::of(lanes.warp_group));
        let line_words = (LL128_LINE_BYTES / 8) as usize;
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(per_step, n - done);
            if SEND && !self.wait_send_credit() {
                return;
            }
            let nbytes = len * esize;
            let nlines = nbytes.div_ceil(LL128_DATA_BYTES);
            // A step's lines and bytes fit 32 bits (a slot is a part of the connection's buffer).
            let (nlines_i, nbytes_i) = (I::of_u64(nlines), I::of_u64(nbytes));
            // Per peer: this step's flag and slot.
            let mut fr = [0u64; NR];
            let mut slot_r = [core::ptr::null_mut::<u64>(); NR];
            let mut fs = [0u64; NS];
            let mut slot_s = [core::ptr::null_mut::<u64>(); NS];
            let step_words = self.step_lines as usize * line_words;
            each_peer::<NR>(|i| {
                if i < nrecv {
                    let c = &self.conns.recv[i];
                    fr[i] = ll128_flag(c.step);
                    slot_r[i] = c.buff.wrapping_add((c.step % FIFO_STEPS) as usize * step_words);
                }
            });
            each_peer::<NS>(|i| {
                if i < nsend {
                    let c = &self.conns.send[i];
                    fs[i] = ll128_flag(c.step);
                    slot_s[i] = c.buff.wrapping_add((c.step % FIFO_STEPS) as usize * step_words);
                    if self.tid == 0 {
                        super::announce_step_lines(c.sizes, c.step, nlines);
                    }
                }
            });
            let in_base = self.input.wrapping_add((src + done) as usize) as *const u8;
            let out_base = self.output.wrapping_add((dst + done) as usize) as *mut u8;
            let mut aborted = false;
            let mut j = I::of(0);
            // Bounded by the warp's first line so every lane of a warp runs the same iterations.
            while warp_group + j * stride < nlines_i {
                let mut line = [I::of(0); UNROLL];
                let mut active = [false; UNROLL];
                let mut src_w = [[0u64; 2 * PARTS]; UNROLL];
                unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                    line[u] = group + (j + I::of(u as u32)) * stride;
                    active[u] = line[u] < nlines_i;
                    if SRC && active[u] {
                        for i in 0..PARTS {
                            let (off, lo_b, hi_b) = part_bytes(line[u], part0 + I::of(i as u32), nbytes_i);
                            // SAFETY: `lo_b + hi_b` bytes at `off` lie inside the caller's input.
                            unsafe {
                                src_w[u][2 * i] = load_partial(in_base.add(off.idx()), lo_b, esize);
                                src_w[u][2 * i + 1] =
                                    load_partial(in_base.add(off.idx() + 8), hi_b, esize);
                            }
                        }
                    }
                });
                j = j + I::of(UNROLL as u32);
                // The receive peers' lines folded into `w`.
                let mut w = [[0u64; 2 * PARTS]; UNROLL];
                if !self.fold_recv(&slot_r, &fr, nrecv, &line, &active, &mut w) {
                    aborted = true;
                }
                if aborted {
                    break;
                }
                unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                    if active[u] {
                        for i in 0..PARTS {
                            let (off, lo_b, hi_b) = part_bytes(line[u], part0 + I::of(i as u32), nbytes_i);
                            let mut v = words_pack(&w[u], i);
                            if SRC {
                                // PreMulSum scales this rank's input before it is combined.
                                let s = words_pack(&src_w[u], i);
                                let s = if self.pre_input {
                                    pre_pack::<T, Op>(s, &self.op_args)
                                } else {
                                    s
                                };
                                v = if nrecv > 0 { Op::apply_pack(&self.op_args, v, s) } else { s };
                            }
                            if div != 0 {
                                v = div_pack::<T>(v, div);
                            }
                            pack_words(&mut w[u], i, v);
                            if DST {
                                // SAFETY: `lo_b + hi_b` bytes at `off` lie inside the caller's output.
                                unsafe {
                                    store_partial(out_base.add(off.idx()), w[u][2 * i], lo_b, esize);
                                    store_partial(
                                        out_base.add(off.idx() + 8),
                                        w[u][2 * i + 1],
                                        hi_b,
                                        esize,
                                    );
                                }
                            }
                        }
                        each_peer::<NS>(|i| {
                            if i < nsend {
                                // The line lies inside peer i's slot.
                                self.write_parts(
                                    slot_s[i].wrapping_add(line[u].idx() * line_words),
                                    w[u],
                                    fs[i],
                                );
                            }
                        });
                    }
                });
                #[cfg(not(target_arch = "nvptx64"))]
                if SEND {
                    let mut at = [[core::ptr::null_mut::<u64>(); NS]; UNROLL];
                    for u in 0..UNROLL {
                        for i in 0..nsend {
                            at[u][i] = slot_s[i].wrapping_add(line[u].idx() * line_words);
                        }
                    }
                    self.publish_flags(&at, &fs, &active, nsend);
                }
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

/// Part `q` (two words) of a line's words as a pack.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn words_pack(w: &[u64; 2 * PARTS], q: usize) -> Pack {
    let (a, b) = (w[2 * q], w[2 * q + 1]);
    Pack([a as u32, (a >> 32) as u32, b as u32, (b >> 32) as u32])
}

/// Stores a pack as part `q` (two words) of a line's words.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn pack_words(w: &mut [u64; 2 * PARTS], q: usize, v: Pack) {
    w[2 * q] = v.0[0] as u64 | (v.0[1] as u64) << 32;
    w[2 * q + 1] = v.0[2] as u64 | (v.0[3] as u64) << 32;
}

/// Where part `part` of line `line` lies in a step's data: its byte offset, and how many of its
/// bytes are data in its low and high word, given the step's `nbytes` (the last part of a line
/// carries 8 data bytes, the others 16).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn part_bytes<I: LineIdx>(line: I, part: I, nbytes: I) -> (I, u64, u64) {
    let off = line * I::of(LL128_DATA_BYTES as u32) + part * I::of(16);
    let cap = if part == I::of(LL128_LINE_PARTS as u32 - 1) { 8 } else { 16 };
    let valid = core::cmp::min(cap, nbytes.saturating_sub(off).wide());
    (off, core::cmp::min(8, valid), valid.saturating_sub(8))
}

impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> Primitives for Ll128Fan<T, Op, NR, NS> {
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
        self.generic_op::<false, true, true, false>(src, 0, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, false, false, true>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_send(&mut self, src: u64, n: u64) {
        self.generic_op::<true, true, true, false>(src, 0, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, false, true, true>(src, dst, n, post)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_copy_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, true>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, true>(src, dst, n, post)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, true>(src, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn aborted(&self) -> bool {
        self.aborted
    }
}

impl<T: Elem, Op: RedFn<T>, const NR: usize, const NS: usize> super::tree::SendFromOutput
    for Ll128Fan<T, Op, NR, NS>
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

    #[test]
    fn flags_never_zero_and_slots_never_see_their_previous_flag() {
        assert_eq!(ll128_flag(0), 1);
        for s in [7u64, 1 << 31, (1 << 32) - 1, 1 << 40] {
            // The slot of step s last held step s − FIFO_STEPS.
            assert_ne!(ll128_flag(s), ll128_flag(s - FIFO_STEPS));
            assert_ne!(ll128_flag(s), 0);
        }
        // 15 data words + 1 flag word per line.
        assert_eq!(LL128_DATA_BYTES + 8, LL128_LINE_BYTES);
        assert_eq!(LL128_LINE_PARTS * 16, LL128_LINE_BYTES);
    }
}
