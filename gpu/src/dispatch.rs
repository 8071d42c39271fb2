//! From a [`KernelArgs`] to the monomorphised algorithm (NCCL's `ncclDevFuncTable` +
//! `RunWorkColl`), shared by the GPU kernel entry point and the CPU target's block threads: one
//! kernel entry point, a `match` inside on (func, algo, proto, dtype, op).
use crate::abi::{Algo, DataType, DevChannel, DevComm, Func, KernelArgs, Proto, RedOp};
use crate::coll::{self, RingCtx};
use crate::proto::simple::Simple;
use crate::reduce::{Elem, FuncMax, FuncMin, FuncProd, FuncSum, RedFn};
use half::{bf16, f16};

/// Runs block `bid` (one channel) of the operation described by `args`.
///
/// # Safety
/// `args.comm` points at a set-up [`DevComm`] whose channel `bid` exists; the work's buffers are
/// valid for its count; `smem` is the kernel's shared memory; every thread of the block calls
/// this with the same `args` and `bid`, `tid` in `0..nthreads`.
pub unsafe fn run_block(args: &KernelArgs, bid: u32, tid: u32, nthreads: u32, smem: *mut u32) {
    let w = &args.work;
    let (Some(func), Some(algo), Some(proto), Some(dtype), Some(op)) = (
        Func::from_u8(w.func),
        Algo::from_u8(w.algo),
        Proto::from_u8(w.proto),
        DataType::from_u8(w.dtype),
        RedOp::from_u8(w.redop),
    ) else {
        crate::arch::trap()
    };
    let b = Block { args, bid, tid, nthreads, smem };
    // SAFETY: forwarded caller contract.
    unsafe {
        match (func, algo, proto) {
            (Func::AllReduce, Algo::Ring, Proto::Simple) => match dtype {
                DataType::I8 => b.by_op::<i8>(op),
                DataType::U8 => b.by_op::<u8>(op),
                DataType::I32 => b.by_op::<i32>(op),
                DataType::U32 => b.by_op::<u32>(op),
                DataType::I64 => b.by_op::<i64>(op),
                DataType::U64 => b.by_op::<u64>(op),
                DataType::F16 => b.by_op::<f16>(op),
                DataType::F32 => b.by_op::<f32>(op),
                DataType::F64 => b.by_op::<f64>(op),
                DataType::Bf16 => b.by_op::<bf16>(op),
            },
            _ => crate::arch::trap(),
        }
    }
}

struct Block<'a> {
    args: &'a KernelArgs,
    bid: u32,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
}

impl Block<'_> {
    unsafe fn by_op<T: Elem>(&self, op: RedOp) {
        // SAFETY: forwarded caller contract.
        unsafe {
            match op {
                RedOp::Sum => self.ring_all_reduce::<T, FuncSum>(0),
                RedOp::Prod => self.ring_all_reduce::<T, FuncProd>(0),
                RedOp::Max => self.ring_all_reduce::<T, FuncMax>(0),
                RedOp::Min => self.ring_all_reduce::<T, FuncMin>(0),
                RedOp::Avg => {
                    let comm = &*(self.args.comm as *const DevComm);
                    self.ring_all_reduce::<T, FuncSum>(comm.nranks)
                }
            }
        }
    }

    unsafe fn ring_all_reduce<T: Elem, Op: RedFn<T>>(&self, postdiv: u32) {
        let w = &self.args.work;
        // SAFETY: caller contract of `run_block`.
        unsafe {
            let comm = &*(self.args.comm as *const DevComm);
            let channel = (comm.channels as *mut DevChannel).add(self.bid as usize);
            let ring = RingCtx {
                nranks: comm.nranks as u64,
                user_ranks: (*channel).ring.user_ranks as *const u32,
                channel: self.bid as u64,
                nchannels: w.nchannels as u64,
            };
            let mut p = Simple::<T, Op>::new(
                self.tid,
                self.nthreads,
                channel,
                comm.buff_sizes[Proto::Simple as usize],
                w.sendbuff as *const T,
                w.recvbuff as *mut T,
                comm.abort_flag,
                self.smem,
                postdiv,
                w.slice_elems,
            );
            coll::all_reduce::ring(&mut p, &ring, w.count, w.chunk_elems, core::mem::size_of::<T>() as u64);
            p.finish();
        }
    }
}
