//! Kernel entry points of the PTX module (nvptx64 only): one per (collective, element type,
//! reduction operator), named `oxccl_<func>_<dtype>_<op>` after the ABI enums' names
//! ([`crate::abi::kernel_name`]; Broadcast and AllGather only move bytes, so they have one entry
//! per element size); the algorithm and protocol are dispatched inside
//! ([`crate::dispatch::run_typed`]). build.rs splits the linked PTX into one module per entry
//! point so that the driver JIT-compiles only the kernels a program uses, when it first uses them.
use crate::abi::KernelArgs;
use crate::arch;
use crate::reduce::{FuncMax, FuncMin, FuncProd, FuncSum};
use half::{bf16, f16};

macro_rules! entries {
    ($($name:ident => $t:ty, $op:ty, $post:expr;)*) => {$(
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
                    &args, arch::block_idx(), arch::thread_idx(), arch::block_dim(), smem, $post,
                );
            }
        }
    )*};
}

entries! {
    oxccl_allreduce_int8_sum => i8, FuncSum, false;
    oxccl_allreduce_int8_prod => i8, FuncProd, false;
    oxccl_allreduce_int8_max => i8, FuncMax, false;
    oxccl_allreduce_int8_min => i8, FuncMin, false;
    oxccl_allreduce_int8_avg => i8, FuncSum, true;
    oxccl_allreduce_uint8_sum => u8, FuncSum, false;
    oxccl_allreduce_uint8_prod => u8, FuncProd, false;
    oxccl_allreduce_uint8_max => u8, FuncMax, false;
    oxccl_allreduce_uint8_min => u8, FuncMin, false;
    oxccl_allreduce_uint8_avg => u8, FuncSum, true;
    oxccl_allreduce_int32_sum => i32, FuncSum, false;
    oxccl_allreduce_int32_prod => i32, FuncProd, false;
    oxccl_allreduce_int32_max => i32, FuncMax, false;
    oxccl_allreduce_int32_min => i32, FuncMin, false;
    oxccl_allreduce_int32_avg => i32, FuncSum, true;
    oxccl_allreduce_uint32_sum => u32, FuncSum, false;
    oxccl_allreduce_uint32_prod => u32, FuncProd, false;
    oxccl_allreduce_uint32_max => u32, FuncMax, false;
    oxccl_allreduce_uint32_min => u32, FuncMin, false;
    oxccl_allreduce_uint32_avg => u32, FuncSum, true;
    oxccl_allreduce_int64_sum => i64, FuncSum, false;
    oxccl_allreduce_int64_prod => i64, FuncProd, false;
    oxccl_allreduce_int64_max => i64, FuncMax, false;
    oxccl_allreduce_int64_min => i64, FuncMin, false;
    oxccl_allreduce_int64_avg => i64, FuncSum, true;
    oxccl_allreduce_uint64_sum => u64, FuncSum, false;
    oxccl_allreduce_uint64_prod => u64, FuncProd, false;
    oxccl_allreduce_uint64_max => u64, FuncMax, false;
    oxccl_allreduce_uint64_min => u64, FuncMin, false;
    oxccl_allreduce_uint64_avg => u64, FuncSum, true;
    oxccl_allreduce_half_sum => f16, FuncSum, false;
    oxccl_allreduce_half_prod => f16, FuncProd, false;
    oxccl_allreduce_half_max => f16, FuncMax, false;
    oxccl_allreduce_half_min => f16, FuncMin, false;
    oxccl_allreduce_half_avg => f16, FuncSum, true;
    oxccl_allreduce_float_sum => f32, FuncSum, false;
    oxccl_allreduce_float_prod => f32, FuncProd, false;
    oxccl_allreduce_float_max => f32, FuncMax, false;
    oxccl_allreduce_float_min => f32, FuncMin, false;
    oxccl_allreduce_float_avg => f32, FuncSum, true;
    oxccl_allreduce_double_sum => f64, FuncSum, false;
    oxccl_allreduce_double_prod => f64, FuncProd, false;
    oxccl_allreduce_double_max => f64, FuncMax, false;
    oxccl_allreduce_double_min => f64, FuncMin, false;
    oxccl_allreduce_double_avg => f64, FuncSum, true;
    oxccl_allreduce_bfloat16_sum => bf16, FuncSum, false;
    oxccl_allreduce_bfloat16_prod => bf16, FuncProd, false;
    oxccl_allreduce_bfloat16_max => bf16, FuncMax, false;
    oxccl_allreduce_bfloat16_min => bf16, FuncMin, false;
    oxccl_allreduce_bfloat16_avg => bf16, FuncSum, true;
    oxccl_reduce_int8_sum => i8, FuncSum, false;
    oxccl_reduce_int8_prod => i8, FuncProd, false;
    oxccl_reduce_int8_max => i8, FuncMax, false;
    oxccl_reduce_int8_min => i8, FuncMin, false;
    oxccl_reduce_int8_avg => i8, FuncSum, true;
    oxccl_reduce_uint8_sum => u8, FuncSum, false;
    oxccl_reduce_uint8_prod => u8, FuncProd, false;
    oxccl_reduce_uint8_max => u8, FuncMax, false;
    oxccl_reduce_uint8_min => u8, FuncMin, false;
    oxccl_reduce_uint8_avg => u8, FuncSum, true;
    oxccl_reduce_int32_sum => i32, FuncSum, false;
    oxccl_reduce_int32_prod => i32, FuncProd, false;
    oxccl_reduce_int32_max => i32, FuncMax, false;
    oxccl_reduce_int32_min => i32, FuncMin, false;
    oxccl_reduce_int32_avg => i32, FuncSum, true;
    oxccl_reduce_uint32_sum => u32, FuncSum, false;
    oxccl_reduce_uint32_prod => u32, FuncProd, false;
    oxccl_reduce_uint32_max => u32, FuncMax, false;
    oxccl_reduce_uint32_min => u32, FuncMin, false;
    oxccl_reduce_uint32_avg => u32, FuncSum, true;
    oxccl_reduce_int64_sum => i64, FuncSum, false;
    oxccl_reduce_int64_prod => i64, FuncProd, false;
    oxccl_reduce_int64_max => i64, FuncMax, false;
    oxccl_reduce_int64_min => i64, FuncMin, false;
    oxccl_reduce_int64_avg => i64, FuncSum, true;
    oxccl_reduce_uint64_sum => u64, FuncSum, false;
    oxccl_reduce_uint64_prod => u64, FuncProd, false;
    oxccl_reduce_uint64_max => u64, FuncMax, false;
    oxccl_reduce_uint64_min => u64, FuncMin, false;
    oxccl_reduce_uint64_avg => u64, FuncSum, true;
    oxccl_reduce_half_sum => f16, FuncSum, false;
    oxccl_reduce_half_prod => f16, FuncProd, false;
    oxccl_reduce_half_max => f16, FuncMax, false;
    oxccl_reduce_half_min => f16, FuncMin, false;
    oxccl_reduce_half_avg => f16, FuncSum, true;
    oxccl_reduce_float_sum => f32, FuncSum, false;
    oxccl_reduce_float_prod => f32, FuncProd, false;
    oxccl_reduce_float_max => f32, FuncMax, false;
    oxccl_reduce_float_min => f32, FuncMin, false;
    oxccl_reduce_float_avg => f32, FuncSum, true;
    oxccl_reduce_double_sum => f64, FuncSum, false;
    oxccl_reduce_double_prod => f64, FuncProd, false;
    oxccl_reduce_double_max => f64, FuncMax, false;
    oxccl_reduce_double_min => f64, FuncMin, false;
    oxccl_reduce_double_avg => f64, FuncSum, true;
    oxccl_reduce_bfloat16_sum => bf16, FuncSum, false;
    oxccl_reduce_bfloat16_prod => bf16, FuncProd, false;
    oxccl_reduce_bfloat16_max => bf16, FuncMax, false;
    oxccl_reduce_bfloat16_min => bf16, FuncMin, false;
    oxccl_reduce_bfloat16_avg => bf16, FuncSum, true;
    oxccl_reducescatter_int8_sum => i8, FuncSum, false;
    oxccl_reducescatter_int8_prod => i8, FuncProd, false;
    oxccl_reducescatter_int8_max => i8, FuncMax, false;
    oxccl_reducescatter_int8_min => i8, FuncMin, false;
    oxccl_reducescatter_int8_avg => i8, FuncSum, true;
    oxccl_reducescatter_uint8_sum => u8, FuncSum, false;
    oxccl_reducescatter_uint8_prod => u8, FuncProd, false;
    oxccl_reducescatter_uint8_max => u8, FuncMax, false;
    oxccl_reducescatter_uint8_min => u8, FuncMin, false;
    oxccl_reducescatter_uint8_avg => u8, FuncSum, true;
    oxccl_reducescatter_int32_sum => i32, FuncSum, false;
    oxccl_reducescatter_int32_prod => i32, FuncProd, false;
    oxccl_reducescatter_int32_max => i32, FuncMax, false;
    oxccl_reducescatter_int32_min => i32, FuncMin, false;
    oxccl_reducescatter_int32_avg => i32, FuncSum, true;
    oxccl_reducescatter_uint32_sum => u32, FuncSum, false;
    oxccl_reducescatter_uint32_prod => u32, FuncProd, false;
    oxccl_reducescatter_uint32_max => u32, FuncMax, false;
    oxccl_reducescatter_uint32_min => u32, FuncMin, false;
    oxccl_reducescatter_uint32_avg => u32, FuncSum, true;
    oxccl_reducescatter_int64_sum => i64, FuncSum, false;
    oxccl_reducescatter_int64_prod => i64, FuncProd, false;
    oxccl_reducescatter_int64_max => i64, FuncMax, false;
    oxccl_reducescatter_int64_min => i64, FuncMin, false;
    oxccl_reducescatter_int64_avg => i64, FuncSum, true;
    oxccl_reducescatter_uint64_sum => u64, FuncSum, false;
    oxccl_reducescatter_uint64_prod => u64, FuncProd, false;
    oxccl_reducescatter_uint64_max => u64, FuncMax, false;
    oxccl_reducescatter_uint64_min => u64, FuncMin, false;
    oxccl_reducescatter_uint64_avg => u64, FuncSum, true;
    oxccl_reducescatter_half_sum => f16, FuncSum, false;
    oxccl_reducescatter_half_prod => f16, FuncProd, false;
    oxccl_reducescatter_half_max => f16, FuncMax, false;
    oxccl_reducescatter_half_min => f16, FuncMin, false;
    oxccl_reducescatter_half_avg => f16, FuncSum, true;
    oxccl_reducescatter_float_sum => f32, FuncSum, false;
    oxccl_reducescatter_float_prod => f32, FuncProd, false;
    oxccl_reducescatter_float_max => f32, FuncMax, false;
    oxccl_reducescatter_float_min => f32, FuncMin, false;
    oxccl_reducescatter_float_avg => f32, FuncSum, true;
    oxccl_reducescatter_double_sum => f64, FuncSum, false;
    oxccl_reducescatter_double_prod => f64, FuncProd, false;
    oxccl_reducescatter_double_max => f64, FuncMax, false;
    oxccl_reducescatter_double_min => f64, FuncMin, false;
    oxccl_reducescatter_double_avg => f64, FuncSum, true;
    oxccl_reducescatter_bfloat16_sum => bf16, FuncSum, false;
    oxccl_reducescatter_bfloat16_prod => bf16, FuncProd, false;
    oxccl_reducescatter_bfloat16_max => bf16, FuncMax, false;
    oxccl_reducescatter_bfloat16_min => bf16, FuncMin, false;
    oxccl_reducescatter_bfloat16_avg => bf16, FuncSum, true;
    oxccl_broadcast_uint8_sum => u8, FuncSum, false;
    oxccl_broadcast_half_sum => f16, FuncSum, false;
    oxccl_broadcast_uint32_sum => u32, FuncSum, false;
    oxccl_broadcast_uint64_sum => u64, FuncSum, false;
    oxccl_allgather_uint8_sum => u8, FuncSum, false;
    oxccl_allgather_half_sum => f16, FuncSum, false;
    oxccl_allgather_uint32_sum => u32, FuncSum, false;
    oxccl_allgather_uint64_sum => u64, FuncSum, false;
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::trap()
}
