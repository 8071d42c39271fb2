//! The host↔device ABI: every struct the host writes and a kernel reads (or the reverse).
//!
//! Mirrors NCCL's `src/include/device.h` (`ncclConnInfo`, `ncclRing`, `ncclDevChannel`,
//! `ncclDevComm`, `ncclDevWorkColl`, `ncclDevKernelArgs`, `union ncclLLFifoLine`). Unlike NCCL, the
//! layout is checked at compile time: every struct is `#[repr(C)]` + [`bytemuck::Pod`] with explicit
//! padding, and its size and the offsets the device reads are asserted below. Device addresses are
//! plain `u64` (a `CUdeviceptr`, or a host address on the CPU target); there is no `usize`, `bool`
//! or pointer in the ABI.

mod enums;
pub use enums::*;

use bytemuck::{Pod, Zeroable};
use core::mem::{align_of, offset_of, size_of};

/// Slots in each connection FIFO (NCCL's `NCCL_STEPS`). Step `s` uses slot `s % FIFO_STEPS`.
pub const FIFO_STEPS: u64 = 8;
/// Upper bound on channels (one thread block each) of a communicator.
pub const MAX_CHANNELS: usize = 64;
/// Default size in bytes of a Simple-protocol connection buffer (`NCCL_BUFFSIZE`): 4 MiB, so each
/// of the [`FIFO_STEPS`] slots holds 512 KiB.
pub const DEFAULT_BUFFSIZE: u64 = 4 << 20;
/// Granularity in bytes of every data slot and chunk: one 16-byte vector (`ld/st.v4.u32`).
pub const PACK_BYTES: u64 = 16;
/// Default Simple-protocol chunk, in FIFO slots, per ring step (NCCL's `ALLREDUCE_CHUNKSTEPS`).
pub const DEFAULT_CHUNK_STEPS: u64 = 4;
/// Threads per block: NCCL's `NCCL_NTHREADS` default on recent GPUs; the accepted range is
/// [`MIN_NTHREADS`, `MAX_NTHREADS`] in multiples of [`WARP_SIZE`].
pub const DEFAULT_NTHREADS: u32 = 512;
pub const MIN_NTHREADS: u32 = 64;
pub const MAX_NTHREADS: u32 = 1024;
pub const WARP_SIZE: u32 = 32;
/// Bytes of kernel shared memory the kernel declares (see `arch::kernel_shared_mem`): the
/// primitives' words, then the call check's gate at [`SMEM_GATE`].
pub const KERNEL_SMEM_BYTES: usize = 160;
/// Byte offset in the kernel's shared memory of the call check's gate (`crate::check::Gate`:
/// three `u64`), which no primitive uses.
pub const SMEM_GATE: usize = 128;
const _: () = assert!(SMEM_GATE + 24 <= KERNEL_SMEM_BYTES);
/// `WorkColl::redop_flags` bit: PreMulSum's scalar is device-resident (NCCL's
/// `ncclScalarDevice`): `redop_arg` is its address, read by the kernel when it runs.
pub const REDOP_SCALAR_DEVICE: u8 = 1;
/// A spinning thread reads the abort flag once every this many polls (NCCL's
/// `NCCL_SPINS_BEFORE_CHECK_ABORT`).
#[cfg(target_arch = "nvptx64")]
pub const SPINS_BEFORE_CHECK_ABORT: u32 = 1 << 12;
/// CPU target: every poll already yields the core (`arch::spin_pause`), which on a loaded machine
/// costs a scheduler time slice, so 4096 polls could take tens of seconds: check on every poll.
#[cfg(not(target_arch = "nvptx64"))]
pub const SPINS_BEFORE_CHECK_ABORT: u32 = 1;
/// Name of the kernel entry point for a (collective, protocol, element type, operator) on the
/// ring, e.g. `oxccl_allreduce_simple_float_sum` (`_any` for the operators chosen at run time):
/// each is also the name of its own PTX module (see build.rs).
pub fn kernel_name(func: Func, proto: Proto, dtype: DataType, op: impl Into<DevRedOp>) -> KernelName {
    kernel_name_for(func, Algo::Ring, proto, dtype, op, false)
}

/// Whether `checked`, a launch's choice of its collective's checked entry, names an entry of
/// its own for `func` on `proto` with elements of `dtype`'s size: where the checked code sends
/// ahead of the call check's gate (`crate::coll::all_gather`, `crate::coll::broadcast`), so
/// that the unchecked entry keeps the code it has without the check. That is Broadcast on LL
/// and LL128, and AllGather there for elements of at least
/// [`crate::coll::AHEAD_MIN_ELEM_BYTES`]; a send ahead writes a FIFO, so nothing on Simple. Elsewhere the checked
/// code is the unchecked entry's, which serves both (it gates first). Which launches choose
/// it: [`runs_checked_entry`].
pub const fn checked_entry(func: Func, proto: Proto, dtype: DataType, checked: bool) -> bool {
    checked
        && !matches!(proto, Proto::Simple)
        && match func {
            Func::Broadcast => true,
            Func::AllGather => dtype.size() as u64 >= crate::coll::AHEAD_MIN_ELEM_BYTES,
            _ => false,
        }
}

/// Whether a launch of work `w` whose [`KernelArgs::check`] is `check` runs its collective's
/// checked entry ([`checked_entry`]): every Broadcast checked inside its kernel; an AllGather
/// so checked only when each channel moves its share in one loop (`count ≤ nchannels ×
/// chunk_elems`). A launch that only honours the check kernel's verdict
/// ([`CHECK_VERDICT_ONLY`]: a captured call) has no gate to send ahead of and runs the unchecked
/// entry, as does a checked AllGather of more loops, which gates before its loop: on an H100
/// the checked entry's later loops ran slower than the unchecked entry's (16 MiB: +8 µs, 32 MiB:
/// +13 µs, against +3.5 µs for gating first; docs/benchmarks.md), a cause not found. The host
/// launches by it, and the CPU target's bodies send ahead by it.
#[cfg(not(target_arch = "nvptx64"))]
pub fn runs_checked_entry(w: &WorkColl, check: u64) -> bool {
    check != 0
        && check & CHECK_VERDICT_ONLY == 0
        && match Func::from_u8(w.func) {
            Some(Func::Broadcast) => true,
            Some(Func::AllGather) => w.count <= w.nchannels as u64 * w.chunk_elems,
            _ => false,
        }
}

/// Name of the kernel entry point for a (collective, algorithm, protocol, element type,
/// operator) call, `checked` when its launch runs the checked entry ([`runs_checked_entry`]):
/// `oxccl_<func>[_tree]_<proto>_<dtype>_<op>`
/// (the tree, AllReduce only, has its own entries), with the type and operator of
/// [`kernel_variant`] — the kernel entry table's rules (gpu/build.rs), so a program JIT-compiles
/// only the protocols and algorithms it runs — and a `_checked` suffix where the call has a
/// checked entry of its own ([`checked_entry`]).
pub fn kernel_name_for(
    func: Func,
    algo: Algo,
    proto: Proto,
    dtype: DataType,
    op: impl Into<DevRedOp>,
    checked: bool,
) -> KernelName {
    let (dtype, op) = kernel_variant(func, dtype, op.into());
    let suffix = if checked_entry(func, proto, dtype, checked) { "_checked" } else { "" };
    let mut n = KernelName { buf: [0; 64], len: 0 };
    let tree = if algo == Algo::Tree { "_tree" } else { "" };
    let proto = match proto {
        Proto::Ll => "ll",
        Proto::Ll128 => "ll128",
        Proto::Simple => "simple",
    };
    for part in [
        "oxccl_",
        func.name(),
        tree,
        "_",
        proto,
        "_",
        dtype.name(),
        "_",
        op.name(),
        suffix,
    ] {
        for &b in part.as_bytes() {
            n.buf[n.len] = b;
            n.len += 1;
        }
    }
    n
}

/// The (type, operator) of the kernel entry that runs `func` on `dtype` with `op` (the rules of
/// the kernel entry table, gpu/build.rs): collectives that only move data (Broadcast, AllGather)
/// use one entry per element size (uint8, half, uint32, uint64) and no operator (`Sum`); Avg runs
/// the `Sum` entry, which reads the post-division from the work; Prod, Max, Min and PreMulSum
/// run their type's `Any` entry, which reads the operator from the work.
pub const fn kernel_variant(func: Func, dtype: DataType, op: DevRedOp) -> (DataType, KernelOp) {
    match func {
        Func::Broadcast | Func::AllGather => {
            let d = match dtype.size() {
                1 => DataType::U8,
                2 => DataType::F16,
                4 => DataType::U32,
                _ => DataType::U64,
            };
            (d, KernelOp::Sum)
        }
        _ => match op {
            DevRedOp::Sum | DevRedOp::Avg => (dtype, KernelOp::Sum),
            DevRedOp::Prod | DevRedOp::Max | DevRedOp::Min | DevRedOp::PreMulSum => (dtype, KernelOp::Any),
        },
    }
}

/// A kernel name built without allocation (usable on both sides).
#[derive(Clone, Copy)]
pub struct KernelName {
    buf: [u8; 64],
    len: usize,
}

impl KernelName {
    /// The name as text.
    pub fn as_str(&self) -> &str {
        // Only ASCII enum names and '_' are ever written.
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

/// One connection endpoint as the kernel sees it (NCCL's `ncclConnInfo`).
///
/// For a *send* connection, `buffs[p]` is the peer's receive buffer of protocol `p`, `tail` the
/// peer's tail counter (written here after data) and `head` our own head counter (written by the
/// peer when a slot is free). For a *recv* connection, `buffs` are our own buffers, `tail` is ours
/// and `head` is the sender's. Counters are `u64` step counts that only grow. `step` is the
/// connection's next step, loaded when a kernel starts and stored back when it ends, so that
/// consecutive collectives continue the same FIFO sequence.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct ConnInfo {
    /// Address of each protocol's buffer, indexed by [`Proto`] as `u8`; 0 when not set up.
    pub buffs: [u64; Proto::COUNT],
    /// Address of the `u64` head counter (in the sender's memory).
    pub head: u64,
    /// Address of the `u64` tail counter (in the receiver's memory).
    pub tail: u64,
    /// Next step of this connection (persisted across launches).
    pub step: u64,
    /// Address of [`FIFO_STEPS`] `u64` step sizes of a send connection driven by a proxy (NCCL's
    /// `connFifo[step % NCCL_STEPS].size`): before publishing the tail of a Simple slice, the
    /// kernel stores in entry `s % FIFO_STEPS` the bytes of step `s` it filled (0 for a step it
    /// skipped or left empty), so the proxy sends only those. A step of the LL or LL128 protocol
    /// stores its line count instead, tagged with the step ([`lines_step_size`]). 0: not written
    /// (P2P, SHM).
    pub sizes: u64,
    /// Address of the connection's pointer-exchange slot for direct writes (NCCL's
    /// `ptrExchange` of a "P2P/direct pointer" connection), 0 when the connection has none. Two
    /// `u64` in the *sender's* memory, [`PTR_EXCHANGE_OFFSET`] bytes past its head counter: the
    /// receiver's output address for the current kernel, then the number of kernels that
    /// published one. Set only when sender and receiver share an address space and each can
    /// address the other's user buffers (`Comm::init_all`, unless `NCCL_P2P_DIRECT_DISABLE=1`),
    /// on both ends of a ring connection or neither. The Simple protocol then writes the data of
    /// a `direct_*` send straight into the receiver's output instead of its FIFO.
    pub ptr_exchange: u64,
    /// Exchanges this end has done on the connection (persisted across launches like `step`):
    /// a receiver publishes count `exchanges + 1` with its output; a sender waits for the slot's
    /// count to reach its own `exchanges + 1` before it reads the address.
    pub exchanges: u64,
    pub _pad: u64,
}

/// Bytes from a connection's head counter to its pointer-exchange slot
/// ([`ConnInfo::ptr_exchange`]): in the head's 128-byte counter line, which only the receiver
/// writes (head, then this slot) and only the sender reads.
pub const PTR_EXCHANGE_OFFSET: u64 = 64;

/// The step-sizes entry (`ConnInfo::sizes`) of step `step` of a flag-line protocol (LL, LL128)
/// that writes `lines` lines: the step's tag `step mod (2^31 − 1) + 1` in the high 32 bits, the
/// line count in the low 32. The tag lets a proxy tell this step's entry from the slot's previous
/// one: over PCIe, the host may see a step's lines (and the next step's) before this store, so
/// the entry, not the order of the lines, says when a step is whole. A Simple entry (bytes, below
/// 2^32) never carries a tag.
#[inline(always)]
pub const fn lines_step_size(step: u64, lines: u64) -> u64 {
    lines_step_tag(step) << 32 | (lines & 0xffff_ffff)
}

/// The line count of step `step` in a step-sizes entry `v`, if `v` is that step's
/// ([`lines_step_size`]).
#[inline(always)]
pub const fn lines_of_step_size(v: u64, step: u64) -> Option<u64> {
    if v >> 32 == lines_step_tag(step) {
        Some(v & 0xffff_ffff)
    } else {
        None
    }
}

#[inline(always)]
const fn lines_step_tag(step: u64) -> u64 {
    step % ((1 << 31) - 1) + 1
}

/// A ring as seen from one rank of one channel (NCCL's `ncclRing`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct DevRing {
    /// User rank we receive from.
    pub prev: u32,
    /// User rank we send to.
    pub next: u32,
    /// Our position in the ring order.
    pub index: u32,
    pub _pad: u32,
    /// Device address of `nranks` u32 user ranks in ring order *starting with our own rank*
    /// (NCCL's `ring.userRanks`): entry `k` is the rank `k` hops downstream.
    pub user_ranks: u64,
}

/// Per-channel device state (NCCL's `ncclDevChannel`): the ring and its two connections.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct DevChannel {
    pub ring: DevRing,
    pub _pad: u64,
    /// Connection to `ring.next`.
    pub send: ConnInfo,
    /// Connection from `ring.prev`.
    pub recv: ConnInfo,
}

/// Per-communicator device state (NCCL's `ncclDevComm`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct DevComm {
    pub rank: u32,
    pub nranks: u32,
    pub nchannels: u32,
    /// Non-zero once the communicator was aborted, in the comm block itself (device memory on
    /// GPUs): written by `Comm::abort` (on a stream of its own, while kernels run) for the ranks
    /// of an `init_all` group whose connections write directly into user buffers. A kernel reads
    /// it before its first direct write: a cheap local load, where `abort_flag` is host memory
    /// that dozens of blocks reading at once wait for in turn.
    pub aborted: u32,
    /// Address of the rank's abort line in host-mapped memory (8-byte aligned, at least 8
    /// bytes): the abort flag (`u32` at +0, raised by the host: `Comm::abort`, a timeout, a
    /// failed peer) and the stop word (`u32` at [`ABORT_LINE_STOP`], raised by the rank's own
    /// call check on a mismatch). Every spin loop polls both with one load; either non-zero
    /// means stop.
    pub abort_flag: u64,
    /// Address of `nchannels` [`DevChannel`]s.
    pub channels: u64,
    /// Buffer size in bytes of each protocol's connection buffer, indexed by [`Proto`].
    pub buff_sizes: [u64; Proto::COUNT],
    /// Address of `nchannels` [`DevTree`]s, or 0 when the communicator has no tree connections
    /// (one node, or a transport that sets none up). Read by the tree AllReduce (GPU and CPU
    /// target) when the call's algorithm is the tree.
    pub trees: u64,
}

/// Most children of a rank in a tree: two nodes below plus one GPU of its own node (NCCL's
/// `NCCL_MAX_TREE_ARITY`).
pub const MAX_TREE_ARITY: usize = 3;

/// One channel's tree as seen from one rank (NCCL's `ncclTree` together with the tree peers'
/// connections of `ncclChannelPeer`): parent and children in user ranks, and a send and a receive
/// connection to each of them. `up == -1` at the root; `down` is filled from index 0, -1 for
/// none. The connections of an absent peer are zero. Each receive connection has its own FIFO per
/// protocol, of `buff_sizes[proto]` bytes, as a ring connection has.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct DevTree {
    /// Parent user rank, -1 at the root.
    pub up: i32,
    /// Child user ranks, -1 for none.
    pub down: [i32; MAX_TREE_ARITY],
    /// Approximate depth of the whole tree (NCCL's `tree.depth`).
    pub depth: i32,
    pub _pad: [u32; 3],
    /// Connection to `up` (child → parent, the reduce phase).
    pub send_up: ConnInfo,
    /// Connection from `up` (parent → child, the broadcast phase).
    pub recv_up: ConnInfo,
    /// Connections to `down[i]` (broadcast phase).
    pub send_down: [ConnInfo; MAX_TREE_ARITY],
    /// Connections from `down[i]` (reduce phase).
    pub recv_down: [ConnInfo; MAX_TREE_ARITY],
}

/// One collective operation (NCCL's `ncclDevWorkColl`). Counts are in elements of `dtype`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct WorkColl {
    /// Device address of the input (`sendbuff`).
    pub sendbuff: u64,
    /// Device address of the output (`recvbuff`).
    pub recvbuff: u64,
    /// Elements per rank of the operation (AllReduce: the whole vector).
    pub count: u64,
    /// PreMulSum's scalar: its raw bits (the low `dtype`-size bytes), or, when `redop_flags` has
    /// [`REDOP_SCALAR_DEVICE`], the device address of one element of `dtype`.
    pub redop_arg: u64,
    /// Elements per chunk per ring step, a multiple of one 16-byte pack.
    pub chunk_elems: u64,
    /// Elements per FIFO step (slice) of the protocol: a multiple of one pack, at most one slot.
    pub slice_elems: u64,
    /// Root rank for rooted collectives.
    pub root: u32,
    /// [`Func`] as u8.
    pub func: u8,
    /// [`DevRedOp`] as u8.
    pub redop: u8,
    /// [`DataType`] as u8.
    pub dtype: u8,
    /// [`Algo`] as u8.
    pub algo: u8,
    /// [`Proto`] as u8.
    pub proto: u8,
    /// [`REDOP_SCALAR_DEVICE`] or 0.
    pub redop_flags: u8,
    /// Channels (thread blocks) this operation uses; block `b` runs channel `b`.
    pub nchannels: u16,
    pub _pad1: u32,
}

impl WorkColl {
    /// The work's (collective, algorithm, protocol, type, operator), `None` when a field is out
    /// of its enum's range: the key of its kernel entry (with [`kernel_variant`]'s rules).
    pub fn entry_key(&self) -> Option<(Func, Algo, Proto, DataType, DevRedOp)> {
        Some((
            Func::from_u8(self.func)?,
            Algo::from_u8(self.algo)?,
            Proto::from_u8(self.proto)?,
            DataType::from_u8(self.dtype)?,
            DevRedOp::from_u8(self.redop)?,
        ))
    }
}

/// Most collective works one launch of a collective kernel runs ([`KernelArgs`]): a group's
/// consecutive collectives of one communicator and stream that share a kernel entry (NCCL's
/// work batch of one plan). 2,104 bytes of kernel parameter at most, below CUDA's 4 KiB.
/// Only LL entries run more than one ([`proto_batches`]).
pub const MAX_COLL_WORKS: usize = 32;

/// Whether launches of protocol `proto` may carry several works ([`MAX_COLL_WORKS`]): LL only.
/// LL carries the small calls, whose launch is most of their time; an LL128 or Simple call is
/// long enough that its own launch costs little, and their kernels have no registers to spare —
/// a loop over works read at run time from the parameter keeps a work's fields live through the
/// whole body (ptxas spills them at the 128-register limit), where one work's fields are
/// re-read from the parameter at constant offsets. Their kernels run the first work only; the
/// host never batches them.
pub const fn proto_batches(proto: Proto) -> bool {
    matches!(proto, Proto::Ll)
}

/// The one by-value argument of the collective kernel (NCCL's `ncclDevKernelArgs` with its work
/// batch): one work, or (LL entries only, [`proto_batches`]) up to [`MAX_COLL_WORKS`] of one
/// kernel entry, which every block runs in order, each on the blocks below its channel count.
/// A launch passes only the bytes of the works it holds ([`kernel_args_bytes`]), as NCCL does,
/// so a single call's parameter is 120 bytes; the rest of `more` is not read.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct KernelArgs {
    /// Address of the communicator's [`DevComm`].
    pub comm: u64,
    /// Address of the communicator's [`CheckDesc`] when the call-signature check is on
    /// (`OXCCL_CHECK_CALLS=1`), else 0: the kernel's last block checks the call while the
    /// others move its data ([`crate::check`]). Set only in a launch of one work.
    pub check: u64,
    /// The first work (the only one when `nworks` ≤ 1).
    pub work: WorkColl,
    /// This rank's signature of the call (when `check` is set).
    pub sig: CallSig,
    /// Works in the launch: `work`, then `more[..nworks - 1]`; 0 counts as 1.
    pub nworks: u32,
    pub _pad: u32,
    /// The works after the first, of the same kernel entry ([`kernel_variant`]).
    pub more: [WorkColl; MAX_COLL_WORKS - 1],
}

impl KernelArgs {
    /// Works in the launch, `1..=MAX_COLL_WORKS`.
    #[inline(always)]
    pub fn works(&self) -> u32 {
        if self.nworks == 0 {
            1
        } else if self.nworks as usize > MAX_COLL_WORKS {
            MAX_COLL_WORKS as u32
        } else {
            self.nworks
        }
    }
    /// Work `i` (`i < works()`): `work`, then `more[i - 1]`. Host side: a kernel reads `more`
    /// from its parameter space word by word instead (indexing it copies the parameter).
    pub fn work_at(&self, i: u32) -> WorkColl {
        match i.checked_sub(1) {
            None => self.work,
            Some(j) => self.more[(j as usize).min(MAX_COLL_WORKS - 2)],
        }
    }
}

/// Bytes of a [`KernelArgs`] that a launch of `nworks` works passes (the header and its works;
/// `1..=MAX_COLL_WORKS`, clamped).
pub const fn kernel_args_bytes(nworks: usize) -> usize {
    let n = if nworks == 0 {
        1
    } else if nworks > MAX_COLL_WORKS {
        MAX_COLL_WORKS
    } else {
        nworks
    };
    core::mem::offset_of!(KernelArgs, more) + (n - 1) * core::mem::size_of::<WorkColl>()
}

/// The kernel entry point (and PTX module) of the call-signature check alone
/// (`OXCCL_CHECK_CALLS=1`), for a call of count 0, which has no kernel of its own: one block
/// checks the call as a collective kernel's checking block does ([`crate::check`]).
pub const CHECK_KERNEL_NAME: &str = "oxccl_check_call";

/// Words of one call's signature ([`CallSig`]).
pub const CALL_SIG_WORDS: usize = 4;

/// What ranks must agree on for one collective call, as the check compares it: `[call number,
/// count, root << 32 | func << 24 | op << 16 | dtype << 8 | algo << 4 | proto, nchannels]` (the
/// host's `comm/call_check.rs` encodes and decodes it).
pub type CallSig = [u64; CALL_SIG_WORDS];

/// [`DevComm::aborted`] once a call-signature check found ranks disagreeing: every later kernel
/// of the communicator exits at once (as on an abort). Also the value of the abort line's stop
/// word then ([`ABORT_LINE_STOP`]), which ends the waits of the call's blocks.
pub const CALL_MISMATCH: u32 = 2;

/// Byte offset in a rank's abort line ([`DevComm::abort_flag`]) of the stop word: written only by
/// the rank's call check on a mismatch, so that its blocks waiting on a FIFO its peers stopped
/// feeding leave as on an abort. The host's abort logic never reads or writes it.
pub const ABORT_LINE_STOP: usize = 4;

/// A communicator's call-signature check in device memory, written by the host at init except
/// `done`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct CheckDesc {
    /// Device memory of `nranks` signatures (16-byte aligned), by rank: every rank's after the
    /// gather.
    pub board: u64,
    /// Host-visible [`CheckReport`] followed by `nranks` signatures: written only on a mismatch.
    pub report: u64,
    /// The verdict on the call number whose check this rank finished last: the number, with
    /// [`CHECK_HALTED`] set when that check stopped on an abort or found the communicator
    /// stopped by an earlier mismatch, and with [`CHECK_DIFFERENT`] set when the ranks' calls
    /// differ. Written by the checking block of a collective's kernel, which the kernel's other
    /// blocks read at their gate (`crate::check::gate`); a checking block that finds the next
    /// call's signatures in [`CheckDesc::rows`] already publishes that call's agreement.
    pub done: u64,
    /// This rank's signature rows, or 0 when the check gathers the signatures over LL FIFOs:
    /// host memory (mapped for this rank's kernels) that the host of every rank of the
    /// communicator writes its signature into when it launches a call, so that the checking
    /// block reads every peer's signature without waiting for the peer's kernel. A
    /// [`CHECK_ROWS_HEADER`]-byte header (word 0: the number of the last call whose check this
    /// rank's kernels finished, which the writers wait on before they reuse a slot), then per
    /// writer rank [`CHECK_ROW_SLOTS`] slots of one signature ([`check_row_offset`]).
    pub rows: u64,
    /// The index in [`DevComm::channels`] of the channel the gather runs over: the check's own,
    /// after the peer channels (its send connection goes to rank `rank + 1`, its receive
    /// connection comes from rank `rank − 1`), which no collective, send or receive uses, so a
    /// send still in its peer channel's FIFO never meets a signature.
    pub channel: u64,
}

/// Signature slots per writer in a rank's [`CheckDesc::rows`]: a rank's host launches at most
/// this many checked calls ahead of the calls every peer's kernels have checked.
pub const CHECK_ROW_SLOTS: u64 = 1024;
/// Bytes of one row slot: [`CALL_SIG_WORDS`] lines of 16 bytes, each two `u64` of one half of a
/// signature word and the slot's flag ([`check_row_line`]).
pub const CHECK_ROW_SLOT_BYTES: u64 = CALL_SIG_WORDS as u64 * 16;
/// Bytes before the first row of a [`CheckDesc::rows`] block.
pub const CHECK_ROWS_HEADER: u64 = 128;

/// Bytes of the [`CheckDesc::rows`] block of a communicator of `nranks` ranks.
pub const fn check_rows_bytes(nranks: u64) -> u64 {
    CHECK_ROWS_HEADER + nranks * CHECK_ROW_SLOTS * CHECK_ROW_SLOT_BYTES
}

/// Byte offset in a [`CheckDesc::rows`] block of the slot of call `seq` (≥ 1) written by rank
/// `writer`.
pub const fn check_row_offset(writer: u64, seq: u64) -> u64 {
    CHECK_ROWS_HEADER + (writer * CHECK_ROW_SLOTS + seq % CHECK_ROW_SLOTS) * CHECK_ROW_SLOT_BYTES
}

/// The flag of call `seq`'s lines in its row slot: never 0 (a slot's value before any write)
/// and never the flag of the slot's previous call (`seq − CHECK_ROW_SLOTS`).
pub const fn check_row_flag(seq: u64) -> u32 {
    (seq / CHECK_ROW_SLOTS) as u32 + 1
}

/// Line `k` of a row slot holding signature word `word` for a call of flag `flag`: two `u64`
/// (as `u32`s: low half, flag, high half, flag), each written whole, so a reader that finds the
/// flag in both has the word.
pub const fn check_row_line(word: u64, flag: u32) -> [u64; 2] {
    [(word & 0xffff_ffff) | (flag as u64) << 32, (word >> 32) | (flag as u64) << 32]
}

/// The bit of [`CheckDesc::done`] saying the check of that call stopped on an abort, or found
/// the communicator stopped (no verdict; the call's other blocks stop too).
pub const CHECK_HALTED: u64 = 1 << 63;
/// The bit of [`CheckDesc::done`] saying the ranks issued different calls (the call's other
/// blocks stop before they write a user buffer).
pub const CHECK_DIFFERENT: u64 = 1 << 62;

/// Blocks of a launch of `args`: one per channel of its widest work, plus the checking block of
/// a call checked inside its own kernel (the last block: [`KernelArgs::check`] set without
/// [`CHECK_VERDICT_ONLY`]), which gathers the signatures while the others move data. Host side
/// (a kernel reads its grid instead: indexing `more` would copy the parameter).
#[cfg(not(target_arch = "nvptx64"))]
pub fn launch_blocks(args: &KernelArgs) -> u32 {
    let mut grid = 1u32;
    for i in 0..args.works() {
        grid = grid.max(args.work_at(i).nchannels as u32);
    }
    grid + u32::from(args.check != 0 && args.check & CHECK_VERDICT_ONLY == 0)
}

/// Flag bit of [`KernelArgs::check`] (descriptor addresses are 8-byte aligned): the call was
/// checked by the check kernel just before it on its stream ([`CHECK_KERNEL_NAME`]), and the
/// kernel only honours that verdict (`DevComm::aborted`) before touching a buffer. A call
/// captured into a CUDA graph is checked so: its signature has no number (it runs at its
/// graph's launches), and a single-block check needs none to hand its verdict on.
pub const CHECK_VERDICT_ONLY: u64 = 1;

/// The by-value argument of the check kernel alone ([`CHECK_KERNEL_NAME`]), one block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct CheckArgs {
    /// Address of the communicator's [`DevComm`].
    pub comm: u64,
    /// Address of its [`CheckDesc`].
    pub check: u64,
    /// This rank's signature of the call.
    pub sig: CallSig,
}

/// Where the call-signature check reports a mismatch (host-visible memory of each rank),
/// followed by every rank's [`CallSig`] as gathered. `seq` is written last (after a fence):
/// non-zero once a check found ranks disagreeing, the number of this rank's call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct CheckReport {
    pub seq: u64,
    pub _pad: u64,
}

const _: () = assert!(
    core::mem::size_of::<CheckArgs>() == 48
        && core::mem::size_of::<CheckReport>() == 16
        && core::mem::size_of::<CheckDesc>() == 40
);

/// Most point-to-point works (one thread block each) of one launch: every send and receive of
/// a group that is in flight at once, times the channels each uses. Keeps [`P2pArgs`] within the
/// 4 KiB every CUDA driver accepts as a kernel parameter.
pub const MAX_P2P_WORKS: usize = 128;

/// The kernel entry point (and PTX module) of point-to-point work (NCCL's `SendRecv` kernel):
/// bytes, the header on LL, the data on LL or Simple.
pub const P2P_KERNEL_NAME: &str = "oxccl_sendrecv";

/// [`WorkP2p::kind`] of a send.
pub const P2P_SEND: u8 = 0;
/// [`WorkP2p::kind`] of a receive.
pub const P2P_RECV: u8 = 1;
/// Flag of [`WorkP2p::kind`]: the work runs on the thread block of the work before it in the
/// launch, after it. A block so runs every call of a group on its connection (a peer channel's
/// send or receive side), in the order issued, and a group needs one launch, not one per call
/// on a connection ([`p2p_block_works`]).
pub const P2P_AFTER_PREVIOUS: u8 = 0x80;

/// The works (`start..end` indices) that block `bid` of a point-to-point launch of `nworks`
/// works runs, given each work's [`WorkP2p::kind`] (`kind(i)`): the `bid`-th run of works that
/// starts with one without [`P2P_AFTER_PREVIOUS`]; `None` past the last block.
#[inline(always)]
pub fn p2p_block_works(nworks: usize, bid: u32, kind: impl Fn(usize) -> u8) -> Option<(usize, usize)> {
    let mut block = 0u32;
    let mut start = None;
    for i in 0..nworks {
        if kind(i) & P2P_AFTER_PREVIOUS == 0 {
            if let Some(s) = start {
                return Some((s, i));
            }
            if block == bid {
                start = Some(i);
            }
            block += 1;
        }
    }
    start.map(|s| (s, nworks))
}

/// One part of one send or receive (NCCL's `ncclDevWorkP2p` half), run by one thread block over
/// one peer channel. A send of `bytes` bytes is cut into `nparts` parts of whole 16-byte packs
/// ([`p2p_part`]), part `part` going over this work's channel; the receive of the peer cuts the
/// same way from the sender's size, which travels in a header step before the data, so the two
/// ends agree even when the user's counts differ. The header is one LL line (its own step); it
/// also says which protocol the data follows on ([`P2P_HEADER_LL`]), as the sender chose it
/// ([`WorkP2p::proto`]), so a receive never has to guess.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct WorkP2p {
    /// Device address of the user buffer: the input of a send, the output of a receive.
    pub buff: u64,
    /// A send: bytes sent (the whole operation, all parts). A receive: bytes the output holds.
    pub bytes: u64,
    /// Index of the peer channel in the communicator's [`DevChannel`] array: its send
    /// connection goes to the peer of a send, its receive connection comes from the peer of a
    /// receive.
    pub channel: u32,
    /// [`P2P_SEND`] or [`P2P_RECV`], with [`P2P_AFTER_PREVIOUS`] when it shares the previous
    /// work's block.
    pub kind: u8,
    /// This work's part of the operation, and the parts.
    pub part: u8,
    pub nparts: u8,
    /// A send: the protocol of its data, [`Proto::Ll`] or [`Proto::Simple`] as `u8` (the host
    /// chooses LL up to `NCCL_P2P_LL_THRESHOLD` bytes). A receive: unused (0); the header says.
    pub proto: u8,
}

/// The bit of a send's header word (its total bytes) saying its data follows on LL, not Simple.
pub const P2P_HEADER_LL: u64 = 1 << 63;

/// The by-value argument of the point-to-point kernel: block `b` runs its works
/// ([`p2p_block_works`]), one after the other.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct P2pArgs {
    /// Address of the communicator's [`DevComm`].
    pub comm: u64,
    /// Address of the [`P2pStatus`] records the receives report a size mismatch in, one per
    /// work ([`p2p_status_record`]; 0: none).
    pub status: u64,
    pub nworks: u32,
    pub _pad: u32,
    pub works: [WorkP2p; MAX_P2P_WORKS],
}

impl Default for P2pArgs {
    fn default() -> Self {
        Zeroable::zeroed()
    }
}

/// Where a receive reports that the peer sent another size than it expected (host-visible
/// memory of the receiving rank): [`MAX_P2P_WORKS`] records, one per work of a launch
/// ([`p2p_status_record`]), so two blocks never write the same record; the host reports the
/// first record flagged and clears the flags.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct P2pStatus {
    /// Non-zero once a receive saw a mismatch.
    pub flag: u64,
    /// The receive's peer channel.
    pub channel: u64,
    /// Bytes the peer sent.
    pub sent: u64,
    /// Bytes the receive expected.
    pub expected: u64,
}

/// The address of work `i`'s [`P2pStatus`] record in a launch whose records start at `status`
/// (0: none, and so 0).
#[inline(always)]
pub const fn p2p_status_record(status: u64, i: usize) -> u64 {
    if status == 0 { 0 } else { status + (i * core::mem::size_of::<P2pStatus>()) as u64 }
}

/// Byte offset and length of part `part` of `nparts` of a `bytes`-byte transfer: equal shares
/// of whole 16-byte packs, the last ones shorter or empty.
#[inline(always)]
pub const fn p2p_part(bytes: u64, part: u64, nparts: u64) -> (u64, u64) {
    let nparts = if nparts == 0 { 1 } else { nparts };
    let per = bytes.div_ceil(nparts).div_ceil(PACK_BYTES) * PACK_BYTES;
    let off = if part * per < bytes { part * per } else { bytes };
    let len = if bytes - off < per { bytes - off } else { per };
    (off, len)
}

/// An LL FIFO line (NCCL's `union ncclLLFifoLine`): two 4-byte data words each followed by its
/// flag; written with one 16-byte volatile store so a reader that sees both flags sees the data.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct LlFifoLine {
    pub data1: u32,
    pub flag1: u32,
    pub data2: u32,
    pub flag2: u32,
}

const _: () = {
    assert!(size_of::<ConnInfo>() == 80 && align_of::<ConnInfo>() == 8);
    assert!(offset_of!(ConnInfo, head) == 24);
    assert!(offset_of!(ConnInfo, tail) == 32);
    assert!(offset_of!(ConnInfo, step) == 40);
    assert!(offset_of!(ConnInfo, sizes) == 48);
    assert!(offset_of!(ConnInfo, ptr_exchange) == 56);
    assert!(offset_of!(ConnInfo, exchanges) == 64);
    assert!(size_of::<DevRing>() == 24);
    assert!(size_of::<DevChannel>() == 192);
    assert!(offset_of!(DevChannel, send) == 32);
    assert!(offset_of!(DevChannel, recv) == 112);
    assert!(size_of::<DevComm>() == 64);
    assert!(offset_of!(DevComm, abort_flag) == 16);
    assert!(offset_of!(DevComm, channels) == 24);
    assert!(offset_of!(DevComm, trees) == 56);
    assert!(size_of::<DevTree>() == 32 + 8 * 80 && align_of::<DevTree>() == 8);
    assert!(offset_of!(DevTree, send_up) == 32);
    assert!(offset_of!(DevTree, recv_up) == 112);
    assert!(offset_of!(DevTree, send_down) == 192);
    assert!(offset_of!(DevTree, recv_down) == 432);
    assert!(size_of::<WorkColl>() == 64);
    assert!(offset_of!(WorkColl, root) == 48);
    assert!(offset_of!(WorkColl, nchannels) == 58);
    assert!(offset_of!(KernelArgs, work) == 16);
    assert!(offset_of!(KernelArgs, nworks) == 112);
    assert!(offset_of!(KernelArgs, more) == 120);
    assert!(size_of::<KernelArgs>() == 120 + 64 * (MAX_COLL_WORKS - 1) && size_of::<KernelArgs>() <= 4096);
    assert!(kernel_args_bytes(1) == 120 && kernel_args_bytes(MAX_COLL_WORKS) == size_of::<KernelArgs>());
    assert!(size_of::<WorkP2p>() == 24);
    assert!(size_of::<P2pArgs>() == 24 + 24 * MAX_P2P_WORKS && size_of::<P2pArgs>() <= 4096);
    assert!(size_of::<P2pStatus>() == 32);
    assert!(size_of::<LlFifoLine>() == 16 && align_of::<LlFifoLine>() == 16);
    assert!(DEFAULT_BUFFSIZE % (FIFO_STEPS * PACK_BYTES) == 0);
};
