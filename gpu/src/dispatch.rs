//! From a [`KernelArgs`] to the monomorphised algorithm (NCCL's `ncclDevFuncTable` +
//! `RunWorkColl`), shared by the GPU kernel entry point and the CPU target's block threads: one
//! kernel entry point, a `match` inside on (func, algo, proto, dtype, op).
use crate::abi::{
    Algo, DataType, DevChannel, DevComm, DevRedOp, Func, KernelArgs, Proto, REDOP_SCALAR_DEVICE, WorkColl,
};
use crate::coll::{self, RingCtx};
use crate::proto::Primitives;
use crate::proto::fan::Peers;
use crate::proto::ll::Ll;
use crate::proto::ll128::Ll128;
use crate::proto::simple::Simple;
use crate::reduce::{Elem, FuncMax, FuncMin, FuncPreMulSum, FuncProd, FuncSum, OpArgs, RedFn};
use half::{bf16, f16};

/// Runs block `bid` (one channel) of the operation described by `args`, dispatching on every
/// field at run time (the CPU target's entry point).
///
/// # Safety
/// `args.comm` points at a set-up [`DevComm`] whose channel `bid` exists; the work's buffers are
/// valid for its count; `smem` is the kernel's shared memory; every thread of the block calls
/// this with the same `args` and `bid`, `tid` in `0..nthreads`.
pub unsafe fn run_block(args: &KernelArgs, bid: u32, tid: u32, nthreads: u32, smem: *mut u32) {
    let (Some(dtype), Some(op)) = (
        DataType::from_u8(args.work.dtype),
        DevRedOp::from_u8(args.work.redop),
    ) else {
        crate::arch::trap()
    };
    // SAFETY: forwarded caller contract.
    unsafe {
        match dtype {
            DataType::I8 => by_op::<i8>(args, bid, tid, nthreads, smem, op),
            DataType::U8 => by_op::<u8>(args, bid, tid, nthreads, smem, op),
            DataType::I32 => by_op::<i32>(args, bid, tid, nthreads, smem, op),
            DataType::U32 => by_op::<u32>(args, bid, tid, nthreads, smem, op),
            DataType::I64 => by_op::<i64>(args, bid, tid, nthreads, smem, op),
            DataType::U64 => by_op::<u64>(args, bid, tid, nthreads, smem, op),
            DataType::F16 => by_op::<f16>(args, bid, tid, nthreads, smem, op),
            DataType::F32 => by_op::<f32>(args, bid, tid, nthreads, smem, op),
            DataType::F64 => by_op::<f64>(args, bid, tid, nthreads, smem, op),
            DataType::Bf16 => by_op::<bf16>(args, bid, tid, nthreads, smem, op),
        }
    }
}

/// # Safety
/// As [`run_block`].
unsafe fn by_op<T: Elem>(args: &KernelArgs, bid: u32, tid: u32, nthreads: u32, smem: *mut u32, op: DevRedOp) {
    // SAFETY: forwarded caller contract.
    unsafe {
        match op {
            DevRedOp::Sum => run_typed::<T, FuncSum>(args, bid, tid, nthreads, smem, false, None),
            DevRedOp::Prod => run_typed::<T, FuncProd>(args, bid, tid, nthreads, smem, false, None),
            DevRedOp::Max => run_typed::<T, FuncMax>(args, bid, tid, nthreads, smem, false, None),
            DevRedOp::Min => run_typed::<T, FuncMin>(args, bid, tid, nthreads, smem, false, None),
            DevRedOp::Avg => run_typed::<T, FuncSum>(args, bid, tid, nthreads, smem, true, None),
            DevRedOp::PreMulSum => run_typed::<T, FuncPreMulSum>(args, bid, tid, nthreads, smem, false, None),
        }
    }
}

/// Runs block `bid` of `args` for element type `T` and operator `Op` (`avg`: divide the final
/// value by `nranks`), dispatching on (func, algo, proto): the body of each GPU kernel entry point.
///
/// # Safety
/// As [`run_block`], and `args.work.dtype`/`redop` match `T`/`Op`.
#[inline(always)]
pub unsafe fn run_typed<T: Elem, Op: RedFn<T>>(
    args: &KernelArgs,
    bid: u32,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
    avg: bool,
    only: Option<Func>,
) {
    let w = &args.work;
    // SAFETY: caller contract.
    let comm = unsafe { &*(args.comm as *const DevComm) };
    // SAFETY: the host checked a device-resident scalar's address (launch contract).
    let op_args = unsafe { op_args::<T, Op>(comm, w, avg) };
    if Op::PRE_MUL && comm.nranks == 1 {
        // SAFETY: forwarded caller contract.
        unsafe { one_rank::<T, Op>(w, bid, tid, nthreads, &op_args) };
        return;
    }
    // The CPU target's entry point dispatches trees here; on the GPU the tree has its own entry
    // points (`run_tree_kernel`), so the ring entry points' code stays ring-only.
    #[cfg(not(target_arch = "nvptx64"))]
    if w.algo == Algo::Tree as u8 {
        // SAFETY: forwarded caller contract.
        unsafe { run_tree::<T, Op>(comm, w, bid, tid, nthreads, smem, op_args, only) };
        return;
    }
    // A kernel entry point passes its collective as a constant, so only that one is compiled in.
    let (Some(func), Some(Algo::Ring), Some(proto)) = (
        only.or(Func::from_u8(w.func)),
        Algo::from_u8(w.algo),
        Proto::from_u8(w.proto),
    ) else {
        crate::arch::trap()
    };
    // SAFETY: caller contract.
    unsafe {
        let channel = (comm.channels as *mut DevChannel).add(bid as usize);
        let ring = RingCtx {
            nranks: comm.nranks as u64,
            user_ranks: (*channel).ring.user_ranks as *const u32,
            channel: bid as u64,
            nchannels: w.nchannels as u64,
        };
        let (input, output) = (w.sendbuff as *const T, w.recvbuff as *mut T);
        match proto {
            Proto::Simple => {
                let mut p = Simple::<T, Op>::new(
                    tid,
                    nthreads,
                    channel,
                    comm.buff_sizes[Proto::Simple as usize],
                    input,
                    output,
                    comm.abort_flag,
                    &raw const comm.aborted,
                    smem,
                    op_args,
                    w.slice_elems,
                );
                run_ring::<T, _>(&mut p, &ring, comm, w, func);
                p.finish();
            }
            Proto::Ll => {
                let mut p = Ll::<T, Op>::new(
                    tid,
                    nthreads,
                    Peers::Ring(channel),
                    comm.buff_sizes[Proto::Ll as usize],
                    input,
                    output,
                    comm.abort_flag,
                    smem,
                    op_args,
                );
                run_ring::<T, _>(&mut p, &ring, comm, w, func);
                p.finish();
            }
            Proto::Ll128 => {
                let mut p = Ll128::<T, Op>::new(
                    tid,
                    nthreads,
                    Peers::Ring(channel),
                    comm.buff_sizes[Proto::Ll128 as usize],
                    input,
                    output,
                    comm.abort_flag,
                    smem,
                    op_args,
                );
                run_ring::<T, _>(&mut p, &ring, comm, w, func);
                p.finish();
            }
        }
    }
}

/// The body of the tree AllReduce entry points ([`run_tree`]), for element type `T` and operator
/// `Op` (`avg`: divide the final value by `nranks`).
///
/// # Safety
/// As [`run_typed`], `args.work` is a tree AllReduce and the communicator has trees.
#[inline(always)]
pub unsafe fn run_tree_kernel<T: Elem, Op: RedFn<T>>(
    args: &KernelArgs,
    bid: u32,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
    avg: bool,
) {
    // SAFETY: forwarded caller contract.
    unsafe {
        let comm = &*(args.comm as *const DevComm);
        let op_args = op_args::<T, Op>(comm, &args.work, avg);
        run_tree::<T, Op>(
            comm,
            &args.work,
            bid,
            tid,
            nthreads,
            smem,
            op_args,
            Some(Func::AllReduce),
        );
    }
}

/// The operands of `w`'s reduction (NCCL's `redOpArg`): Avg's post-division by `nranks`
/// (`avg`), and PreMulSum's scalar, from its bits or, when it is device-resident, read from
/// device memory now.
///
/// # Safety
/// A device-resident scalar's address holds one element of `T` readable by this kernel.
#[inline(always)]
unsafe fn op_args<T: Elem, Op: RedFn<T>>(comm: &DevComm, w: &WorkColl, avg: bool) -> OpArgs {
    let args = OpArgs::div(if avg { comm.nranks } else { 0 });
    if !Op::PRE_MUL {
        return args;
    }
    let bits = if w.redop_flags & REDOP_SCALAR_DEVICE != 0 {
        let p = w.redop_arg;
        // SAFETY: caller contract; volatile, as another stream may have written it just before.
        unsafe {
            match core::mem::size_of::<T>() {
                1 => (p as *const u8).read_volatile() as u64,
                2 => (p as *const u16).read_volatile() as u64,
                4 => (p as *const u32).read_volatile() as u64,
                _ => (p as *const u64).read_volatile(),
            }
        }
    } else {
        w.redop_arg
    };
    args.with_scalar_bits::<T>(bits)
}

/// A reducing collective of one rank (NCCL's `ncclLaunchOneRank`): the output is the input after
/// the pre-operation (PreMulSum's scaling), `w.count` elements split into whole packs over the
/// `w.nchannels` blocks.
///
/// # Safety
/// `w`'s buffers hold `w.count` elements of `T` and are equal or disjoint.
#[inline(always)]
unsafe fn one_rank<T: Elem, Op: RedFn<T>>(w: &WorkColl, bid: u32, tid: u32, nthreads: u32, args: &OpArgs) {
    use crate::proto::simple::{PreOn, reduce_copy};
    let esize = core::mem::size_of::<T>() as u64;
    let per_pack = crate::abi::PACK_BYTES / esize;
    let nch = (w.nchannels as u64).max(1);
    let per_block = w.count.div_ceil(nch).div_ceil(per_pack) * per_pack;
    let start = (bid as u64 * per_block).min(w.count);
    let n = per_block.min(w.count - start);
    let off = (start * esize) as usize;
    // SAFETY: `start + n <= w.count` elements of both buffers (caller contract).
    unsafe {
        reduce_copy::<T, Op, false, false>(
            tid,
            nthreads,
            (w.sendbuff as *const u8).wrapping_add(off),
            core::ptr::null(),
            (w.recvbuff as *mut u8).wrapping_add(off),
            core::ptr::null_mut(),
            n,
            0,
            PreOn::S0,
            args,
        )
    }
}

/// The ring schedule of `func`, over any protocol's primitives.
#[inline(always)]
fn run_ring<T, P: Primitives>(p: &mut P, ring: &RingCtx, comm: &DevComm, w: &WorkColl, func: Func) {
    let esize = core::mem::size_of::<T>() as u64;
    let (count, chunk, root) = (w.count, w.chunk_elems, w.root as u64);
    match func {
        Func::AllReduce => coll::all_reduce::ring(p, ring, count, chunk, esize),
        Func::Broadcast => {
            coll::broadcast::ring(p, ring, count, root, chunk, esize, w.sendbuff == w.recvbuff)
        }
        Func::Reduce => coll::reduce::ring(p, ring, count, root, chunk, esize),
        Func::AllGather => {
            let in_place = w.sendbuff == w.recvbuff + comm.rank as u64 * count * esize;
            coll::all_gather::ring(p, ring, count, chunk, esize, in_place)
        }
        Func::ReduceScatter => coll::reduce_scatter::ring(p, ring, count, chunk, esize),
    }
}

/// Runs block `bid` of a tree operation (NCCL's `RunWorkColl` for `NCCL_ALGO_TREE`): AllReduce on
/// the Simple, LL or LL128 protocol over the channel's [`crate::abi::DevTree`], reduce phase then
/// broadcast phase. Anything else (another collective, a communicator without trees) traps.
///
/// # Safety
/// As [`run_typed`]; `comm.trees` is 0 or the address of `comm.nchannels` set-up trees whose
/// connections have buffers of `comm.buff_sizes` for every protocol.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn run_tree<T: Elem, Op: RedFn<T>>(
    comm: &DevComm,
    w: &WorkColl,
    bid: u32,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
    op_args: OpArgs,
    only: Option<Func>,
) {
    use crate::abi::DevTree;
    use crate::coll::tree::{TreeCtx, all_reduce_down, all_reduce_up};
    use crate::proto::ll::{TreeLlDown, TreeLlUp};
    use crate::proto::ll128::{TreeLl128Down, TreeLl128Up};
    use crate::proto::tree::{TreeDown, TreeUp};
    let (Some(Func::AllReduce), Some(proto)) = (only.or(Func::from_u8(w.func)), Proto::from_u8(w.proto))
    else {
        crate::arch::trap()
    };
    if comm.trees == 0 || bid >= comm.nchannels {
        crate::arch::trap()
    }
    let esize = core::mem::size_of::<T>() as u64;
    let (input, output) = (w.sendbuff as *const T, w.recvbuff as *mut T);
    let buff = comm.buff_sizes[proto as usize];
    let (abort, count, chunk) = (comm.abort_flag, w.count, w.chunk_elems);
    // SAFETY: caller contract: channel `bid` has a set-up tree.
    unsafe {
        let tree = (comm.trees as *mut DevTree).add(bid as usize);
        let t = TreeCtx {
            up: (*tree).up,
            down0: (*tree).down[0],
            channel: bid as u64,
            nchannels: w.nchannels as u64,
        };
        // Each phase loads its connections, runs, and stores their steps back; the broadcast
        // phase starts only when the reduce phase was not aborted.
        macro_rules! phases {
            ($up:expr, $down:expr) => {{
                let mut p = $up;
                all_reduce_up(&mut p, &t, count, chunk, esize);
                let aborted = p.aborted();
                p.finish();
                if !aborted {
                    let mut p = $down;
                    all_reduce_down(&mut p, &t, count, chunk, esize);
                    p.finish();
                }
            }};
        }
        macro_rules! line_phases {
            ($up:ident, $down:ident) => {{
                let peers = |up| Peers::Tree(tree, up);
                phases!(
                    $up::<T, Op>::new(
                        tid,
                        nthreads,
                        peers(true),
                        buff,
                        input,
                        output,
                        abort,
                        smem,
                        op_args
                    ),
                    $down::<T, Op>::new(
                        tid,
                        nthreads,
                        peers(false),
                        buff,
                        input,
                        output,
                        abort,
                        smem,
                        op_args
                    )
                )
            }};
        }
        match proto {
            Proto::Simple => {
                let slice = w.slice_elems;
                phases!(
                    TreeUp::<T, Op>::new(
                        tid, nthreads, tree, buff, input, output, abort, smem, op_args, slice
                    ),
                    TreeDown::<T, Op>::new(
                        tid, nthreads, tree, buff, input, output, abort, smem, op_args, slice
                    )
                )
            }
            // The flag-line protocols take the same arguments: `$up` / `$down` are the types.
            Proto::Ll => line_phases!(TreeLlUp, TreeLlDown),
            Proto::Ll128 => line_phases!(TreeLl128Up, TreeLl128Down),
        }
    }
}
