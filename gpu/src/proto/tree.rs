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
//! The block structure and memory ordering are the ring Simple protocol's
//! ([`super::simple::VOLATILE_SYNC`]): thread 0 polls every peer's counter (`ld.volatile`), tells
//! the block through shared memory and `barrier.sync`; the whole block copies with 16-byte
//! `ld.volatile` loads; after a `barrier.sync`, thread 0 fences (`fence.acq_rel.sys`) when it
//! publishes sent data, and stores the counters (`st.volatile`). The same code runs on the CPU
//! target, where a block is one thread (and fences after the poll too).
//!
//! GPU constraints kept here: no array is ever indexed by a value only known at run time (the
//! peers are visited by `each_peer` with constant indices, and the reduction is monomorphised on
//! its source and destination counts), so nothing lands in local memory (`__local_depot`).
use super::simple::{VOLATILE_SYNC, load_src, parse_unroll, read_src};
use super::{Primitives, each_peer, tree_conns};
use crate::abi::{
    ConnInfo, DevTree, FIFO_STEPS, MAX_TREE_ARITY, PACK_BYTES, Proto, SPINS_BEFORE_CHECK_ABORT,
};
use crate::arch::{self, Pack};
use crate::reduce::{Elem, OpArgs, RedFn, div_pack, pre_elem, pre_pack};
use core::marker::PhantomData;

/// 16-byte loads per source each thread keeps in flight in the copy loop: the ring Simple
/// protocol's build-time knob (`OXCCL_BUILD_UNROLL=N`, 1..=16; default 4).
const UNROLL: usize = match option_env!("OXCCL_BUILD_UNROLL") {
    Some(s) => parse_unroll(s.as_bytes()),
    None => 4,
};

// The pointer lists below spell out three peers.
const _: () = assert!(MAX_TREE_ARITY == 3);

/// Device-side state of one tree connection for the duration of a kernel.
#[derive(Clone, Copy)]
struct Conn {
    info: *mut ConnInfo,
    buff: *mut u8,
    head: *mut u64,
    tail: *mut u64,
    /// Step sizes for a proxy (`ConnInfo::sizes`, NET send connections); null when none are
    /// wanted.
    sizes: *mut u64,
    step: u64,
}

impl Conn {
    const NONE: Conn = Conn {
        info: core::ptr::null_mut(),
        buff: core::ptr::null_mut(),
        head: core::ptr::null_mut(),
        tail: core::ptr::null_mut(),
        sizes: core::ptr::null_mut(),
        step: 0,
    };

    /// # Safety
    /// `info` points at a connection set up for the Simple protocol.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    unsafe fn load(info: *mut ConnInfo) -> Self {
        // SAFETY: caller guarantees `info`.
        let c = unsafe { info.read() };
        Conn {
            info,
            buff: c.buffs[Proto::Simple as usize] as *mut u8,
            head: c.head as *mut u64,
            tail: c.tail as *mut u64,
            sizes: c.sizes as *mut u64,
            step: c.step,
        }
    }
}

/// Simple-protocol primitives for one phase of one channel's tree (NCCL's `runTreeUpDown` builds
/// one per phase), for element type `T` and operator `Op`. `UP`: the reduce phase, receiving from
/// the children and sending to the parent; otherwise the broadcast phase, receiving from the
/// parent and sending to the children. "recv" reduces the data of every receive peer (and the
/// input, for the reducing verbs); "send" writes the same value to every send peer.
pub struct TreeSimple<T, Op, const UP: bool> {
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
    /// The communicator's abort line, which the spin loops poll ([`super::fan::abort_raised`]).
    abort_flag: *const u32,
    smem: *mut u32,
    aborted: bool,
    /// Avg's post-division and PreMulSum's scalar.
    op_args: OpArgs,
    _op: PhantomData<Op>,
}

/// The reduce phase: children → parent.
pub type TreeUp<T, Op> = TreeSimple<T, Op, true>;
/// The broadcast phase: parent → children.
pub type TreeDown<T, Op> = TreeSimple<T, Op, false>;

/// Verbs of the broadcast phase's root beyond [`Primitives`].
pub trait SendFromOutput {
    /// output[src..src+n] → every send peer (NCCL's `directSendFromOutput`): the tree root
    /// forwards the final value its reduce phase wrote.
    fn send_from_output(&mut self, src: u64, n: u64);
}

impl<T: Elem, Op: RedFn<T>, const UP: bool> TreeSimple<T, Op, UP> {
    /// Most receive peers of the phase: the children going up, the parent going down.
    const MAX_RECV: usize = if UP { MAX_TREE_ARITY } else { 1 };
    /// Most send peers of the phase: the parent going up, the children going down.
    const MAX_SEND: usize = if UP { 1 } else { MAX_TREE_ARITY };

    /// Loads the connections of the phase from `tree` (NCCL's Primitives constructor with
    /// `tree->down` / `&tree->up` as receive and send peers, or the reverse). `slice_elems` is
    /// clamped to one FIFO slot of `buff_size / FIFO_STEPS` bytes.
    ///
    /// # Safety
    /// `tree` is a set-up [`DevTree`] whose connections to each present peer have Simple buffers
    /// of `buff_size` bytes; `input`/`output` are valid for every offset the algorithm passes;
    /// `smem` points at kernel shared memory; `abort_flag` is 0 or the address of the
    /// communicator's abort line (`DevComm::abort_flag`). All
    /// threads of the block call it.
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn new(
        tid: u32,
        nthreads: u32,
        tree: *mut DevTree,
        buff_size: u64,
        input: *const T,
        output: *mut T,
        abort_flag: u64,
        smem: *mut u32,
        op_args: OpArgs,
        slice_elems: u64,
    ) -> Self {
        // SAFETY: caller guarantees `tree`; present connections are set up for Simple.
        let (recv, nrecv, send, nsend) = unsafe {
            let (rp, nrecv, sp, nsend) = tree_conns(tree, UP);
            let (mut recv, mut send) = ([Conn::NONE; MAX_TREE_ARITY], [Conn::NONE; MAX_TREE_ARITY]);
            each_peer::<MAX_TREE_ARITY>(|i| {
                if i < nrecv {
                    recv[i] = Conn::load(rp[i]);
                }
                if i < nsend {
                    send[i] = Conn::load(sp[i]);
                }
            });
            (recv, nrecv, send, nsend)
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
            nrecv: nrecv.min(Self::MAX_RECV),
            send,
            nsend: nsend.min(Self::MAX_SEND),
            slot_bytes,
            slice_elems,
            abort_flag: abort_flag as *const u32,
            smem,
            aborted: false,
            op_args,
            _op: PhantomData,
        }
    }

    /// Stores the connection steps back for the next kernel (NCCL's Primitives destructor).
    ///
    /// # Safety
    /// All threads of the block call it, once, after the last verb.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn finish(self) {
        // SAFETY: every thread reaches this barrier; then only thread 0 writes the connections
        // this phase loaded (valid by the constructor's contract).
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                each_peer::<MAX_TREE_ARITY>(|i| {
                    if i < self.nrecv {
                        (*self.recv[i].info).step = self.recv[i].step;
                    }
                    if i < self.nsend {
                        (*self.send[i].info).step = self.send[i].step;
                    }
                });
            }
        }
    }

    /// Spins until `ready()`; polls the abort flag every `SPINS_BEFORE_CHECK_ABORT` tries.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn spin(&self, ready: impl Fn() -> bool) -> bool {
        let mut spins = 0u32;
        while !ready() {
            spins += 1;
            if spins == SPINS_BEFORE_CHECK_ABORT {
                spins = 0;
                if super::fan::abort_raised(self.abort_flag) {
                    return false;
                }
            }
            arch::spin_pause();
        }
        true
    }

    /// Thread 0 waits until every receive peer (`RECV`) has published the next step and every
    /// send peer (`SEND`) has freed its slot; then the block learns whether to abort.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn wait<const RECV: bool, const SEND: bool>(&mut self) -> bool {
        if self.tid == 0 {
            let mut ok = true;
            each_peer::<MAX_TREE_ARITY>(|i| {
                if RECV && i < self.nrecv && ok {
                    let (tail, want) = (self.recv[i].tail, self.recv[i].step + 1);
                    // SAFETY: `tail` is this connection's counter (constructor contract).
                    ok = self.spin(|| unsafe { arch::load_volatile_u64(tail) } >= want);
                }
            });
            each_peer::<MAX_TREE_ARITY>(|i| {
                if SEND && i < self.nsend && ok {
                    let (head, want) = (self.send[i].head, self.send[i].step + 1);
                    // SAFETY: as above, for the send connection's head.
                    ok = self.spin(|| unsafe { arch::load_volatile_u64(head) } + FIFO_STEPS >= want);
                }
            });
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
        !self.aborted
    }

    /// After the block's copy: publish the sent step (`bytes` filled) to every send peer, free the
    /// received step of every receive peer. A send peer behind a proxy (NET) first gets the
    /// step's byte count in its step sizes (NCCL's `connFifo[].size`), so the proxy sends only
    /// those bytes.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn post<const RECV: bool, const SEND: bool>(&mut self, bytes: u64) {
        // SAFETY: all threads reach this barrier; only thread 0 stores the counters and step
        // sizes (a non-null `sizes` holds FIFO_STEPS entries, the ConnInfo contract).
        unsafe {
            arch::sync_threads();
            if self.tid == 0 {
                each_peer::<MAX_TREE_ARITY>(|i| {
                    let c = &self.send[i];
                    if SEND && i < self.nsend && !c.sizes.is_null() {
                        // `wait` saw the proxy free this slot, so it no longer reads its entry;
                        // the fence below orders the entry before the tail.
                        arch::store_volatile_u64(c.sizes.add((c.step % FIFO_STEPS) as usize), bytes);
                    }
                });
                if SEND || !VOLATILE_SYNC {
                    arch::fence_acq_rel_sys();
                }
                each_peer::<MAX_TREE_ARITY>(|i| {
                    if SEND && i < self.nsend {
                        arch::store_volatile_u64(self.send[i].tail, self.send[i].step + 1);
                    }
                });
                each_peer::<MAX_TREE_ARITY>(|i| {
                    if RECV && i < self.nrecv {
                        arch::store_volatile_u64(self.recv[i].head, self.recv[i].step + 1);
                    }
                });
            }
        }
        each_peer::<MAX_TREE_ARITY>(|i| {
            if SEND && i < self.nsend {
                self.send[i].step += 1;
            }
            if RECV && i < self.nrecv {
                self.recv[i].step += 1;
            }
        });
    }

    /// The FIFO slot of `c`'s current step (meaningless, and unused, for an absent peer).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn slot(&self, c: &Conn) -> *mut u8 {
        c.buff
            .wrapping_add(((c.step % FIFO_STEPS) * self.slot_bytes) as usize)
    }

    /// The engine behind every verb (NCCL's `genericOp` with several peers): per FIFO step, wait
    /// for every peer, reduce the sources — the input (`SRC`) or the output (`SRC_OUT`), and the
    /// slot of every receive peer (`RECV`) — into the destinations — the output (`DST`) and the
    /// slot of every send peer (`SEND`) — then post.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
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
        let nrecv = if RECV { self.nrecv.min(Self::MAX_RECV) } else { 0 };
        let nsend = if SEND { self.nsend.min(Self::MAX_SEND) } else { 0 };
        let mut done = 0u64;
        while done < n {
            let len = core::cmp::min(self.slice_elems, n - done);
            if !self.wait::<RECV, SEND>() {
                return;
            }
            let r = [
                self.slot(&self.recv[0]) as *const u8,
                self.slot(&self.recv[1]) as *const u8,
                self.slot(&self.recv[2]) as *const u8,
            ];
            let s = [
                self.slot(&self.send[0]),
                self.slot(&self.send[1]),
                self.slot(&self.send[2]),
            ];
            let x = if SRC {
                self.input.wrapping_add((src + done) as usize) as *const u8
            } else {
                self.output.wrapping_add((src + done) as usize) as *const u8
            };
            let (srcs, nsrc) = if SRC || SRC_OUT {
                ([x, r[0], r[1], r[2]], 1 + nrecv)
            } else {
                ([r[0], r[1], r[2], core::ptr::null()], nrecv)
            };
            let out = self.output.wrapping_add((dst + done) as usize) as *mut u8;
            let (dsts, ndst) = if DST {
                ([out, s[0], s[1], s[2]], 1 + nsend)
            } else {
                ([s[0], s[1], s[2], core::ptr::null_mut()], nsend)
            };
            let div = if post { self.op_args.postdiv } else { 0 };
            // SAFETY: the first `nsrc` / `ndst` pointers cover `len` elements (algorithm and FIFO
            // geometry contracts); a destination equals a source only in place (output over
            // input, exactly).
            unsafe {
                reduce_copy_fan::<T, Op>(
                    self.tid,
                    self.nthreads,
                    srcs,
                    nsrc,
                    dsts,
                    ndst,
                    len,
                    div,
                    SRC,
                    &self.op_args,
                )
            };
            self.post::<RECV, SEND>(len * core::mem::size_of::<T>() as u64);
            done += len;
        }
    }
}

/// Folds `p`'s packs `i + u·stride` (u < UNROLL) into `v` with `Op`.
///
/// # Safety
/// `p` is valid and 16-byte aligned at every one of those packs.
// Indexed loops: `u` addresses both the pack arrays and the memory offsets.
#[allow(clippy::needless_range_loop)]
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn fold_packs<T: Elem, Op: RedFn<T>>(
    args: &OpArgs,
    v: &mut [Pack; UNROLL],
    p: *const u8,
    i: u64,
    stride: u64,
) {
    let p = p as *const Pack;
    let mut w = [Pack::default(); UNROLL];
    crate::unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
        // SAFETY: caller contract.
        w[u] = unsafe { load_src(p.add((i + u as u64 * stride) as usize)) };
    });
    crate::unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
        v[u] = Op::apply_pack(args, v[u], w[u]);
    });
}

/// `d = s[0] ⊕ s[1] ⊕ … (/ div)` into each of the first `nd` destinations of `d`, from the first
/// `ns` sources of `s` (1 to 4 each; nothing happens for other counts), over `n` elements spread
/// over `nthreads` threads: 16-byte packs (`UNROLL` in flight per thread) when every pointer in
/// use is 16-byte aligned, then element by element (NCCL's `reduceCopy` with several sources and
/// destinations). `div == 0` means no post-division; `pre0`: the first source is this rank's
/// input, which PreMulSum scales by `args.scalar` first.
///
/// The counts are run-time values, tested once per group of packs (the same for every thread):
/// one copy of the loops serves every fan, where a copy per (sources, destinations) pair made
/// the tree's Simple kernels of the software-converted types (fp8) take half a minute each to
/// compile.
///
/// # Safety
/// The first `ns` sources and `nd` destinations are valid for `n` elements of `T`; a destination
/// overlaps no source except exactly (in place).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn reduce_copy_fan<T: Elem, Op: RedFn<T>>(
    tid: u32,
    nthreads: u32,
    s: [*const u8; 4],
    ns: usize,
    d: [*mut u8; 4],
    nd: usize,
    n: u64,
    div: u32,
    pre0: bool,
    args: &OpArgs,
) {
    if !(1..=4).contains(&ns) || !(1..=4).contains(&nd) {
        return;
    }
    let esize = core::mem::size_of::<T>() as u64;
    let mut addrs = s[0] as u64 | d[0] as u64;
    if ns > 1 {
        addrs |= s[1] as u64;
    }
    if ns > 2 {
        addrs |= s[2] as u64;
    }
    if ns > 3 {
        addrs |= s[3] as u64;
    }
    if nd > 1 {
        addrs |= d[1] as u64;
    }
    if nd > 2 {
        addrs |= d[2] as u64;
    }
    if nd > 3 {
        addrs |= d[3] as u64;
    }
    let npacks = if addrs.is_multiple_of(PACK_BYTES) {
        n * esize / PACK_BYTES
    } else {
        0
    };
    let stride = nthreads as u64;
    let mut i = tid as u64;
    // SAFETY (whole block): indices stay below `npacks` (packs) or `n` (elements), inside the
    // caller's ranges; every source is read before any destination of the same index is written.
    unsafe {
        let store = |k: usize, v: Pack| {
            arch::store_v4((d[0] as *mut Pack).add(k), v);
            if nd > 1 {
                arch::store_v4((d[1] as *mut Pack).add(k), v);
            }
            if nd > 2 {
                arch::store_v4((d[2] as *mut Pack).add(k), v);
            }
            if nd > 3 {
                arch::store_v4((d[3] as *mut Pack).add(k), v);
            }
        };
        while i + (UNROLL as u64 - 1) * stride < npacks {
            let mut v = [Pack::default(); UNROLL];
            crate::unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                v[u] = load_src((s[0] as *const Pack).add((i + u as u64 * stride) as usize));
                if pre0 {
                    v[u] = pre_pack::<T, Op>(v[u], args);
                }
            });
            if ns > 1 {
                fold_packs::<T, Op>(args, &mut v, s[1], i, stride);
            }
            if ns > 2 {
                fold_packs::<T, Op>(args, &mut v, s[2], i, stride);
            }
            if ns > 3 {
                fold_packs::<T, Op>(args, &mut v, s[3], i, stride);
            }
            crate::unroll::each::<UNROLL>(#[cfg_attr(target_arch = "nvptx64", inline(always))] |u| {
                let r = if div != 0 { div_pack::<T>(v[u], div) } else { v[u] };
                store((i + u as u64 * stride) as usize, r);
            });
            i += UNROLL as u64 * stride;
        }
        while i < npacks {
            let k = i as usize;
            let mut v = load_src((s[0] as *const Pack).add(k));
            if pre0 {
                v = pre_pack::<T, Op>(v, args);
            }
            if ns > 1 {
                v = Op::apply_pack(args, v, load_src((s[1] as *const Pack).add(k)));
            }
            if ns > 2 {
                v = Op::apply_pack(args, v, load_src((s[2] as *const Pack).add(k)));
            }
            if ns > 3 {
                v = Op::apply_pack(args, v, load_src((s[3] as *const Pack).add(k)));
            }
            if div != 0 {
                v = div_pack::<T>(v, div);
            }
            store(k, v);
            i += stride;
        }
        let mut e = npacks * PACK_BYTES / esize + tid as u64;
        while e < n {
            let k = e as usize;
            let mut r = read_src((s[0] as *const T).add(k));
            if pre0 {
                r = pre_elem::<T, Op>(r, args);
            }
            if ns > 1 {
                r = Op::apply(args, r, read_src((s[1] as *const T).add(k)));
            }
            if ns > 2 {
                r = Op::apply(args, r, read_src((s[2] as *const T).add(k)));
            }
            if ns > 3 {
                r = Op::apply(args, r, read_src((s[3] as *const T).add(k)));
            }
            if div != 0 {
                r = T::div(r, div);
            }
            (d[0] as *mut T).add(k).write(r);
            if nd > 1 {
                (d[1] as *mut T).add(k).write(r);
            }
            if nd > 2 {
                (d[2] as *mut T).add(k).write(r);
            }
            if nd > 3 {
                (d[3] as *mut T).add(k).write(r);
            }
            e += stride;
        }
    }
}

impl<T: Elem, Op: RedFn<T>, const UP: bool> Primitives for TreeSimple<T, Op, UP> {
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
        self.generic_op::<true, false, false, false, true>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_send(&mut self, src: u64, n: u64) {
        self.generic_op::<true, true, true, false, false>(src, 0, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, false, true, false, true>(src, dst, n, post)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_copy_send(&mut self, dst: u64, n: u64) {
        self.generic_op::<true, true, false, false, true>(0, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.generic_op::<true, true, true, false, true>(src, dst, n, post)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.generic_op::<false, true, true, false, true>(src, dst, n, false)
    }
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn aborted(&self) -> bool {
        self.aborted
    }
}

impl<T: Elem, Op: RedFn<T>, const UP: bool> SendFromOutput for TreeSimple<T, Op, UP> {
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
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
    fn reduce_copy_fan_folds_every_source_into_every_destination() {
        // Every (sources, destinations) count from (1, 1) to (4, 4) over u32, 16-byte aligned
        // (pack path) and shifted by one element (element path only), with and without a
        // post-division by 4, on blocks of 1, 3 and 32 threads (each thread's share run in turn,
        // as the threads of a GPU block split it): 37 elements (9 packs and 1 element) and 1003
        // (250 packs: one UNROLL round of 32 threads, then the remainder loop, then 3 elements).
        // Source s holds 10 i + s at buffer index i, so the first `ns` sources sum to
        // 10 ns i + ns (ns - 1) / 2 (truncated after a division); destinations past `nd` and
        // every guard element keep their 0xdeadbeef.
        for n in [37usize, 1003] {
            let buf = |fill: &dyn Fn(usize) -> u32| {
                let mut v = vec![Pack::default(); n.div_ceil(4) + 1];
                let p = v.as_mut_ptr() as *mut u32;
                for i in 0..4 * v.len() {
                    // SAFETY: inside the vector.
                    unsafe { p.add(i).write(fill(i)) };
                }
                v
            };
            for nthreads in [1u32, 3, 32] {
                for ns in 1..=4usize {
                    for nd in 1..=4usize {
                        for shift in [0usize, 1] {
                            for div in [0u32, 4] {
                                let srcs: Vec<Vec<Pack>> =
                                    (0..4).map(|s| buf(&|i| (10 * i + s) as u32)).collect();
                                let mut dsts: Vec<Vec<Pack>> =
                                    (0..4).map(|_| buf(&|_| 0xdead_beef)).collect();
                                let sp: Vec<*const u8> = srcs
                                    .iter()
                                    .map(|v| (v.as_ptr() as *const u32).wrapping_add(shift) as *const u8)
                                    .collect();
                                let dp: Vec<*mut u8> = dsts
                                    .iter_mut()
                                    .map(|v| (v.as_mut_ptr() as *mut u32).wrapping_add(shift) as *mut u8)
                                    .collect();
                                let (sa, da) = ([sp[0], sp[1], sp[2], sp[3]], [dp[0], dp[1], dp[2], dp[3]]);
                                for tid in 0..nthreads {
                                    // SAFETY: every pointer covers `n` elements after the shift.
                                    unsafe {
                                        reduce_copy_fan::<u32, FuncSum>(
                                            tid,
                                            nthreads,
                                            sa,
                                            ns,
                                            da,
                                            nd,
                                            n as u64,
                                            div,
                                            false,
                                            &OpArgs::default(),
                                        )
                                    };
                                }
                                for (j, d) in dsts.iter().enumerate() {
                                    let p = d.as_ptr() as *const u32;
                                    for k in 0..4 * d.len() {
                                        // SAFETY: inside the vector.
                                        let got = unsafe { p.add(k).read() };
                                        let sum = 10 * ns * k + ns * (ns - 1) / 2;
                                        let want = if j >= nd || k < shift || k >= shift + n {
                                            0xdead_beef
                                        } else if div == 0 {
                                            sum as u32
                                        } else {
                                            (sum / 4) as u32
                                        };
                                        assert_eq!(
                                            got, want,
                                            "n {n}, {nthreads} threads, {ns} sources, {nd} destinations, shift \
                                             {shift}, div {div}, destination {j}, element {k}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
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
        // No source or no destination: nothing is written.
        let src = buf(&|i| i as u32);
        let mut dst = buf(&|_| 7);
        let (s, d) = (src.as_ptr() as *const u8, dst.as_mut_ptr() as *mut u8);
        let null = core::ptr::null_mut::<u8>();
        // SAFETY: the pointers in use cover `n` elements.
        unsafe {
            reduce_copy_fan::<u32, FuncSum>(
                0,
                1,
                [s; 4],
                0,
                [d, null, null, null],
                1,
                n as u64,
                0,
                false,
                &OpArgs::default(),
            );
            reduce_copy_fan::<u32, FuncSum>(
                0,
                1,
                [s; 4],
                1,
                [d, null, null, null],
                0,
                n as u64,
                0,
                false,
                &OpArgs::default(),
            );
        }
        assert!(dst.iter().all(|p| p.0 == [7; 4]));
    }
}
