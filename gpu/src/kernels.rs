//! Kernel entry points of the PTX module (nvptx64 only): one per (collective, element type,
//! reduction operator), named `oxccl_<func>_<dtype>_<op>` after the ABI enums' names
//! ([`crate::abi::kernel_name`]; Broadcast and AllGather only move bytes, so they have one entry
//! per element size); the algorithm and protocol are dispatched inside
//! ([`crate::dispatch::run_typed`], the ring); the tree AllReduce has its own entries,
//! `oxccl_allreduce_tree_<dtype>_<op>` ([`crate::dispatch::run_tree_kernel`]). build.rs splits the
//! linked PTX into one module per entry point so that the driver JIT-compiles only the kernels a
//! program uses, when it first uses them.
use crate::abi::{Func, KernelArgs};
use crate::arch;
use crate::reduce::{FuncMax, FuncMin, FuncPreMulSum, FuncProd, FuncSum};
use half::{bf16, f16};

macro_rules! entries {
    ($($name:ident => $func:ident, $t:ty, $op:ty, $post:expr;)*) => {$(
        entry!($name, $func, $t, $op, $post);
    )*};
}

macro_rules! entry {
    // The tree AllReduce has its own entry points (`run_tree_kernel`).
    ($name:ident, AllReduceTree, $t:ty, $op:ty, $post:expr) => {
        /// Tree AllReduce kernel: grid = `args.work.nchannels` blocks, block = `NCCL_NTHREADS`
        /// threads.
        ///
        /// # Safety
        /// Launched by the host library with a valid [`KernelArgs`] (see `run_tree_kernel`).
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: KernelArgs) {
            // SAFETY: called once in this kernel; the rest is the launch contract.
            unsafe {
                let smem = arch::kernel_shared_mem();
                crate::dispatch::run_tree_kernel::<$t, $op>(
                    &args,
                    arch::block_idx(),
                    arch::thread_idx(),
                    arch::block_dim(),
                    smem,
                    $post,
                );
            }
        }
    };
    ($name:ident, $func:ident, $t:ty, $op:ty, $post:expr) => {
        /// Collective kernel: grid = `args.work.nchannels` blocks, block = `NCCL_NTHREADS` threads.
        ///
        /// # Safety
        /// Launched by the host library with a valid [`KernelArgs`] (see `run_typed`).
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: KernelArgs) {
            // SAFETY: called once in this kernel; the rest is the launch contract.
            unsafe {
                let smem = arch::kernel_shared_mem();
                crate::dispatch::run_typed::<$t, $op>(
                    &args,
                    arch::block_idx(),
                    arch::thread_idx(),
                    arch::block_dim(),
                    smem,
                    $post,
                    Some(Func::$func),
                );
            }
        }
    };
}

entries! {
    oxccl_allreduce_int8_sum => AllReduce, i8, FuncSum, false;
    oxccl_allreduce_int8_prod => AllReduce, i8, FuncProd, false;
    oxccl_allreduce_int8_max => AllReduce, i8, FuncMax, false;
    oxccl_allreduce_int8_min => AllReduce, i8, FuncMin, false;
    oxccl_allreduce_int8_avg => AllReduce, i8, FuncSum, true;
    oxccl_allreduce_uint8_sum => AllReduce, u8, FuncSum, false;
    oxccl_allreduce_uint8_prod => AllReduce, u8, FuncProd, false;
    oxccl_allreduce_uint8_max => AllReduce, u8, FuncMax, false;
    oxccl_allreduce_uint8_min => AllReduce, u8, FuncMin, false;
    oxccl_allreduce_uint8_avg => AllReduce, u8, FuncSum, true;
    oxccl_allreduce_int32_sum => AllReduce, i32, FuncSum, false;
    oxccl_allreduce_int32_prod => AllReduce, i32, FuncProd, false;
    oxccl_allreduce_int32_max => AllReduce, i32, FuncMax, false;
    oxccl_allreduce_int32_min => AllReduce, i32, FuncMin, false;
    oxccl_allreduce_int32_avg => AllReduce, i32, FuncSum, true;
    oxccl_allreduce_uint32_sum => AllReduce, u32, FuncSum, false;
    oxccl_allreduce_uint32_prod => AllReduce, u32, FuncProd, false;
    oxccl_allreduce_uint32_max => AllReduce, u32, FuncMax, false;
    oxccl_allreduce_uint32_min => AllReduce, u32, FuncMin, false;
    oxccl_allreduce_uint32_avg => AllReduce, u32, FuncSum, true;
    oxccl_allreduce_int64_sum => AllReduce, i64, FuncSum, false;
    oxccl_allreduce_int64_prod => AllReduce, i64, FuncProd, false;
    oxccl_allreduce_int64_max => AllReduce, i64, FuncMax, false;
    oxccl_allreduce_int64_min => AllReduce, i64, FuncMin, false;
    oxccl_allreduce_int64_avg => AllReduce, i64, FuncSum, true;
    oxccl_allreduce_uint64_sum => AllReduce, u64, FuncSum, false;
    oxccl_allreduce_uint64_prod => AllReduce, u64, FuncProd, false;
    oxccl_allreduce_uint64_max => AllReduce, u64, FuncMax, false;
    oxccl_allreduce_uint64_min => AllReduce, u64, FuncMin, false;
    oxccl_allreduce_uint64_avg => AllReduce, u64, FuncSum, true;
    oxccl_allreduce_half_sum => AllReduce, f16, FuncSum, false;
    oxccl_allreduce_half_prod => AllReduce, f16, FuncProd, false;
    oxccl_allreduce_half_max => AllReduce, f16, FuncMax, false;
    oxccl_allreduce_half_min => AllReduce, f16, FuncMin, false;
    oxccl_allreduce_half_avg => AllReduce, f16, FuncSum, true;
    oxccl_allreduce_float_sum => AllReduce, f32, FuncSum, false;
    oxccl_allreduce_float_prod => AllReduce, f32, FuncProd, false;
    oxccl_allreduce_float_max => AllReduce, f32, FuncMax, false;
    oxccl_allreduce_float_min => AllReduce, f32, FuncMin, false;
    oxccl_allreduce_float_avg => AllReduce, f32, FuncSum, true;
    oxccl_allreduce_double_sum => AllReduce, f64, FuncSum, false;
    oxccl_allreduce_double_prod => AllReduce, f64, FuncProd, false;
    oxccl_allreduce_double_max => AllReduce, f64, FuncMax, false;
    oxccl_allreduce_double_min => AllReduce, f64, FuncMin, false;
    oxccl_allreduce_double_avg => AllReduce, f64, FuncSum, true;
    oxccl_allreduce_bfloat16_sum => AllReduce, bf16, FuncSum, false;
    oxccl_allreduce_bfloat16_prod => AllReduce, bf16, FuncProd, false;
    oxccl_allreduce_bfloat16_max => AllReduce, bf16, FuncMax, false;
    oxccl_allreduce_bfloat16_min => AllReduce, bf16, FuncMin, false;
    oxccl_allreduce_bfloat16_avg => AllReduce, bf16, FuncSum, true;
    oxccl_reduce_int8_sum => Reduce, i8, FuncSum, false;
    oxccl_reduce_int8_prod => Reduce, i8, FuncProd, false;
    oxccl_reduce_int8_max => Reduce, i8, FuncMax, false;
    oxccl_reduce_int8_min => Reduce, i8, FuncMin, false;
    oxccl_reduce_int8_avg => Reduce, i8, FuncSum, true;
    oxccl_reduce_uint8_sum => Reduce, u8, FuncSum, false;
    oxccl_reduce_uint8_prod => Reduce, u8, FuncProd, false;
    oxccl_reduce_uint8_max => Reduce, u8, FuncMax, false;
    oxccl_reduce_uint8_min => Reduce, u8, FuncMin, false;
    oxccl_reduce_uint8_avg => Reduce, u8, FuncSum, true;
    oxccl_reduce_int32_sum => Reduce, i32, FuncSum, false;
    oxccl_reduce_int32_prod => Reduce, i32, FuncProd, false;
    oxccl_reduce_int32_max => Reduce, i32, FuncMax, false;
    oxccl_reduce_int32_min => Reduce, i32, FuncMin, false;
    oxccl_reduce_int32_avg => Reduce, i32, FuncSum, true;
    oxccl_reduce_uint32_sum => Reduce, u32, FuncSum, false;
    oxccl_reduce_uint32_prod => Reduce, u32, FuncProd, false;
    oxccl_reduce_uint32_max => Reduce, u32, FuncMax, false;
    oxccl_reduce_uint32_min => Reduce, u32, FuncMin, false;
    oxccl_reduce_uint32_avg => Reduce, u32, FuncSum, true;
    oxccl_reduce_int64_sum => Reduce, i64, FuncSum, false;
    oxccl_reduce_int64_prod => Reduce, i64, FuncProd, false;
    oxccl_reduce_int64_max => Reduce, i64, FuncMax, false;
    oxccl_reduce_int64_min => Reduce, i64, FuncMin, false;
    oxccl_reduce_int64_avg => Reduce, i64, FuncSum, true;
    oxccl_reduce_uint64_sum => Reduce, u64, FuncSum, false;
    oxccl_reduce_uint64_prod => Reduce, u64, FuncProd, false;
    oxccl_reduce_uint64_max => Reduce, u64, FuncMax, false;
    oxccl_reduce_uint64_min => Reduce, u64, FuncMin, false;
    oxccl_reduce_uint64_avg => Reduce, u64, FuncSum, true;
    oxccl_reduce_half_sum => Reduce, f16, FuncSum, false;
    oxccl_reduce_half_prod => Reduce, f16, FuncProd, false;
    oxccl_reduce_half_max => Reduce, f16, FuncMax, false;
    oxccl_reduce_half_min => Reduce, f16, FuncMin, false;
    oxccl_reduce_half_avg => Reduce, f16, FuncSum, true;
    oxccl_reduce_float_sum => Reduce, f32, FuncSum, false;
    oxccl_reduce_float_prod => Reduce, f32, FuncProd, false;
    oxccl_reduce_float_max => Reduce, f32, FuncMax, false;
    oxccl_reduce_float_min => Reduce, f32, FuncMin, false;
    oxccl_reduce_float_avg => Reduce, f32, FuncSum, true;
    oxccl_reduce_double_sum => Reduce, f64, FuncSum, false;
    oxccl_reduce_double_prod => Reduce, f64, FuncProd, false;
    oxccl_reduce_double_max => Reduce, f64, FuncMax, false;
    oxccl_reduce_double_min => Reduce, f64, FuncMin, false;
    oxccl_reduce_double_avg => Reduce, f64, FuncSum, true;
    oxccl_reduce_bfloat16_sum => Reduce, bf16, FuncSum, false;
    oxccl_reduce_bfloat16_prod => Reduce, bf16, FuncProd, false;
    oxccl_reduce_bfloat16_max => Reduce, bf16, FuncMax, false;
    oxccl_reduce_bfloat16_min => Reduce, bf16, FuncMin, false;
    oxccl_reduce_bfloat16_avg => Reduce, bf16, FuncSum, true;
    oxccl_reducescatter_int8_sum => ReduceScatter, i8, FuncSum, false;
    oxccl_reducescatter_int8_prod => ReduceScatter, i8, FuncProd, false;
    oxccl_reducescatter_int8_max => ReduceScatter, i8, FuncMax, false;
    oxccl_reducescatter_int8_min => ReduceScatter, i8, FuncMin, false;
    oxccl_reducescatter_int8_avg => ReduceScatter, i8, FuncSum, true;
    oxccl_reducescatter_uint8_sum => ReduceScatter, u8, FuncSum, false;
    oxccl_reducescatter_uint8_prod => ReduceScatter, u8, FuncProd, false;
    oxccl_reducescatter_uint8_max => ReduceScatter, u8, FuncMax, false;
    oxccl_reducescatter_uint8_min => ReduceScatter, u8, FuncMin, false;
    oxccl_reducescatter_uint8_avg => ReduceScatter, u8, FuncSum, true;
    oxccl_reducescatter_int32_sum => ReduceScatter, i32, FuncSum, false;
    oxccl_reducescatter_int32_prod => ReduceScatter, i32, FuncProd, false;
    oxccl_reducescatter_int32_max => ReduceScatter, i32, FuncMax, false;
    oxccl_reducescatter_int32_min => ReduceScatter, i32, FuncMin, false;
    oxccl_reducescatter_int32_avg => ReduceScatter, i32, FuncSum, true;
    oxccl_reducescatter_uint32_sum => ReduceScatter, u32, FuncSum, false;
    oxccl_reducescatter_uint32_prod => ReduceScatter, u32, FuncProd, false;
    oxccl_reducescatter_uint32_max => ReduceScatter, u32, FuncMax, false;
    oxccl_reducescatter_uint32_min => ReduceScatter, u32, FuncMin, false;
    oxccl_reducescatter_uint32_avg => ReduceScatter, u32, FuncSum, true;
    oxccl_reducescatter_int64_sum => ReduceScatter, i64, FuncSum, false;
    oxccl_reducescatter_int64_prod => ReduceScatter, i64, FuncProd, false;
    oxccl_reducescatter_int64_max => ReduceScatter, i64, FuncMax, false;
    oxccl_reducescatter_int64_min => ReduceScatter, i64, FuncMin, false;
    oxccl_reducescatter_int64_avg => ReduceScatter, i64, FuncSum, true;
    oxccl_reducescatter_uint64_sum => ReduceScatter, u64, FuncSum, false;
    oxccl_reducescatter_uint64_prod => ReduceScatter, u64, FuncProd, false;
    oxccl_reducescatter_uint64_max => ReduceScatter, u64, FuncMax, false;
    oxccl_reducescatter_uint64_min => ReduceScatter, u64, FuncMin, false;
    oxccl_reducescatter_uint64_avg => ReduceScatter, u64, FuncSum, true;
    oxccl_reducescatter_half_sum => ReduceScatter, f16, FuncSum, false;
    oxccl_reducescatter_half_prod => ReduceScatter, f16, FuncProd, false;
    oxccl_reducescatter_half_max => ReduceScatter, f16, FuncMax, false;
    oxccl_reducescatter_half_min => ReduceScatter, f16, FuncMin, false;
    oxccl_reducescatter_half_avg => ReduceScatter, f16, FuncSum, true;
    oxccl_reducescatter_float_sum => ReduceScatter, f32, FuncSum, false;
    oxccl_reducescatter_float_prod => ReduceScatter, f32, FuncProd, false;
    oxccl_reducescatter_float_max => ReduceScatter, f32, FuncMax, false;
    oxccl_reducescatter_float_min => ReduceScatter, f32, FuncMin, false;
    oxccl_reducescatter_float_avg => ReduceScatter, f32, FuncSum, true;
    oxccl_reducescatter_double_sum => ReduceScatter, f64, FuncSum, false;
    oxccl_reducescatter_double_prod => ReduceScatter, f64, FuncProd, false;
    oxccl_reducescatter_double_max => ReduceScatter, f64, FuncMax, false;
    oxccl_reducescatter_double_min => ReduceScatter, f64, FuncMin, false;
    oxccl_reducescatter_double_avg => ReduceScatter, f64, FuncSum, true;
    oxccl_reducescatter_bfloat16_sum => ReduceScatter, bf16, FuncSum, false;
    oxccl_reducescatter_bfloat16_prod => ReduceScatter, bf16, FuncProd, false;
    oxccl_reducescatter_bfloat16_max => ReduceScatter, bf16, FuncMax, false;
    oxccl_reducescatter_bfloat16_min => ReduceScatter, bf16, FuncMin, false;
    oxccl_reducescatter_bfloat16_avg => ReduceScatter, bf16, FuncSum, true;
    oxccl_broadcast_uint8_sum => Broadcast, u8, FuncSum, false;
    oxccl_broadcast_half_sum => Broadcast, f16, FuncSum, false;
    oxccl_broadcast_uint32_sum => Broadcast, u32, FuncSum, false;
    oxccl_broadcast_uint64_sum => Broadcast, u64, FuncSum, false;
    oxccl_allgather_uint8_sum => AllGather, u8, FuncSum, false;
    oxccl_allgather_half_sum => AllGather, f16, FuncSum, false;
    oxccl_allgather_uint32_sum => AllGather, u32, FuncSum, false;
    oxccl_allgather_uint64_sum => AllGather, u64, FuncSum, false;
    oxccl_allreduce_tree_int8_sum => AllReduceTree, i8, FuncSum, false;
    oxccl_allreduce_tree_int8_prod => AllReduceTree, i8, FuncProd, false;
    oxccl_allreduce_tree_int8_max => AllReduceTree, i8, FuncMax, false;
    oxccl_allreduce_tree_int8_min => AllReduceTree, i8, FuncMin, false;
    oxccl_allreduce_tree_int8_avg => AllReduceTree, i8, FuncSum, true;
    oxccl_allreduce_tree_uint8_sum => AllReduceTree, u8, FuncSum, false;
    oxccl_allreduce_tree_uint8_prod => AllReduceTree, u8, FuncProd, false;
    oxccl_allreduce_tree_uint8_max => AllReduceTree, u8, FuncMax, false;
    oxccl_allreduce_tree_uint8_min => AllReduceTree, u8, FuncMin, false;
    oxccl_allreduce_tree_uint8_avg => AllReduceTree, u8, FuncSum, true;
    oxccl_allreduce_tree_int32_sum => AllReduceTree, i32, FuncSum, false;
    oxccl_allreduce_tree_int32_prod => AllReduceTree, i32, FuncProd, false;
    oxccl_allreduce_tree_int32_max => AllReduceTree, i32, FuncMax, false;
    oxccl_allreduce_tree_int32_min => AllReduceTree, i32, FuncMin, false;
    oxccl_allreduce_tree_int32_avg => AllReduceTree, i32, FuncSum, true;
    oxccl_allreduce_tree_uint32_sum => AllReduceTree, u32, FuncSum, false;
    oxccl_allreduce_tree_uint32_prod => AllReduceTree, u32, FuncProd, false;
    oxccl_allreduce_tree_uint32_max => AllReduceTree, u32, FuncMax, false;
    oxccl_allreduce_tree_uint32_min => AllReduceTree, u32, FuncMin, false;
    oxccl_allreduce_tree_uint32_avg => AllReduceTree, u32, FuncSum, true;
    oxccl_allreduce_tree_int64_sum => AllReduceTree, i64, FuncSum, false;
    oxccl_allreduce_tree_int64_prod => AllReduceTree, i64, FuncProd, false;
    oxccl_allreduce_tree_int64_max => AllReduceTree, i64, FuncMax, false;
    oxccl_allreduce_tree_int64_min => AllReduceTree, i64, FuncMin, false;
    oxccl_allreduce_tree_int64_avg => AllReduceTree, i64, FuncSum, true;
    oxccl_allreduce_tree_uint64_sum => AllReduceTree, u64, FuncSum, false;
    oxccl_allreduce_tree_uint64_prod => AllReduceTree, u64, FuncProd, false;
    oxccl_allreduce_tree_uint64_max => AllReduceTree, u64, FuncMax, false;
    oxccl_allreduce_tree_uint64_min => AllReduceTree, u64, FuncMin, false;
    oxccl_allreduce_tree_uint64_avg => AllReduceTree, u64, FuncSum, true;
    oxccl_allreduce_tree_half_sum => AllReduceTree, f16, FuncSum, false;
    oxccl_allreduce_tree_half_prod => AllReduceTree, f16, FuncProd, false;
    oxccl_allreduce_tree_half_max => AllReduceTree, f16, FuncMax, false;
    oxccl_allreduce_tree_half_min => AllReduceTree, f16, FuncMin, false;
    oxccl_allreduce_tree_half_avg => AllReduceTree, f16, FuncSum, true;
    oxccl_allreduce_tree_float_sum => AllReduceTree, f32, FuncSum, false;
    oxccl_allreduce_tree_float_prod => AllReduceTree, f32, FuncProd, false;
    oxccl_allreduce_tree_float_max => AllReduceTree, f32, FuncMax, false;
    oxccl_allreduce_tree_float_min => AllReduceTree, f32, FuncMin, false;
    oxccl_allreduce_tree_float_avg => AllReduceTree, f32, FuncSum, true;
    oxccl_allreduce_tree_double_sum => AllReduceTree, f64, FuncSum, false;
    oxccl_allreduce_tree_double_prod => AllReduceTree, f64, FuncProd, false;
    oxccl_allreduce_tree_double_max => AllReduceTree, f64, FuncMax, false;
    oxccl_allreduce_tree_double_min => AllReduceTree, f64, FuncMin, false;
    oxccl_allreduce_tree_double_avg => AllReduceTree, f64, FuncSum, true;
    oxccl_allreduce_tree_bfloat16_sum => AllReduceTree, bf16, FuncSum, false;
    oxccl_allreduce_tree_bfloat16_prod => AllReduceTree, bf16, FuncProd, false;
    oxccl_allreduce_tree_bfloat16_max => AllReduceTree, bf16, FuncMax, false;
    oxccl_allreduce_tree_bfloat16_min => AllReduceTree, bf16, FuncMin, false;
    oxccl_allreduce_tree_bfloat16_avg => AllReduceTree, bf16, FuncSum, true;
    oxccl_allreduce_int8_premulsum => AllReduce, i8, FuncPreMulSum, false;
    oxccl_allreduce_uint8_premulsum => AllReduce, u8, FuncPreMulSum, false;
    oxccl_allreduce_int32_premulsum => AllReduce, i32, FuncPreMulSum, false;
    oxccl_allreduce_uint32_premulsum => AllReduce, u32, FuncPreMulSum, false;
    oxccl_allreduce_int64_premulsum => AllReduce, i64, FuncPreMulSum, false;
    oxccl_allreduce_uint64_premulsum => AllReduce, u64, FuncPreMulSum, false;
    oxccl_allreduce_half_premulsum => AllReduce, f16, FuncPreMulSum, false;
    oxccl_allreduce_float_premulsum => AllReduce, f32, FuncPreMulSum, false;
    oxccl_allreduce_double_premulsum => AllReduce, f64, FuncPreMulSum, false;
    oxccl_allreduce_bfloat16_premulsum => AllReduce, bf16, FuncPreMulSum, false;
    oxccl_reduce_int8_premulsum => Reduce, i8, FuncPreMulSum, false;
    oxccl_reduce_uint8_premulsum => Reduce, u8, FuncPreMulSum, false;
    oxccl_reduce_int32_premulsum => Reduce, i32, FuncPreMulSum, false;
    oxccl_reduce_uint32_premulsum => Reduce, u32, FuncPreMulSum, false;
    oxccl_reduce_int64_premulsum => Reduce, i64, FuncPreMulSum, false;
    oxccl_reduce_uint64_premulsum => Reduce, u64, FuncPreMulSum, false;
    oxccl_reduce_half_premulsum => Reduce, f16, FuncPreMulSum, false;
    oxccl_reduce_float_premulsum => Reduce, f32, FuncPreMulSum, false;
    oxccl_reduce_double_premulsum => Reduce, f64, FuncPreMulSum, false;
    oxccl_reduce_bfloat16_premulsum => Reduce, bf16, FuncPreMulSum, false;
    oxccl_reducescatter_int8_premulsum => ReduceScatter, i8, FuncPreMulSum, false;
    oxccl_reducescatter_uint8_premulsum => ReduceScatter, u8, FuncPreMulSum, false;
    oxccl_reducescatter_int32_premulsum => ReduceScatter, i32, FuncPreMulSum, false;
    oxccl_reducescatter_uint32_premulsum => ReduceScatter, u32, FuncPreMulSum, false;
    oxccl_reducescatter_int64_premulsum => ReduceScatter, i64, FuncPreMulSum, false;
    oxccl_reducescatter_uint64_premulsum => ReduceScatter, u64, FuncPreMulSum, false;
    oxccl_reducescatter_half_premulsum => ReduceScatter, f16, FuncPreMulSum, false;
    oxccl_reducescatter_float_premulsum => ReduceScatter, f32, FuncPreMulSum, false;
    oxccl_reducescatter_double_premulsum => ReduceScatter, f64, FuncPreMulSum, false;
    oxccl_reducescatter_bfloat16_premulsum => ReduceScatter, bf16, FuncPreMulSum, false;
    oxccl_allreduce_tree_int8_premulsum => AllReduceTree, i8, FuncPreMulSum, false;
    oxccl_allreduce_tree_uint8_premulsum => AllReduceTree, u8, FuncPreMulSum, false;
    oxccl_allreduce_tree_int32_premulsum => AllReduceTree, i32, FuncPreMulSum, false;
    oxccl_allreduce_tree_uint32_premulsum => AllReduceTree, u32, FuncPreMulSum, false;
    oxccl_allreduce_tree_int64_premulsum => AllReduceTree, i64, FuncPreMulSum, false;
    oxccl_allreduce_tree_uint64_premulsum => AllReduceTree, u64, FuncPreMulSum, false;
    oxccl_allreduce_tree_half_premulsum => AllReduceTree, f16, FuncPreMulSum, false;
    oxccl_allreduce_tree_float_premulsum => AllReduceTree, f32, FuncPreMulSum, false;
    oxccl_allreduce_tree_double_premulsum => AllReduceTree, f64, FuncPreMulSum, false;
    oxccl_allreduce_tree_bfloat16_premulsum => AllReduceTree, bf16, FuncPreMulSum, false;
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::trap()
}
