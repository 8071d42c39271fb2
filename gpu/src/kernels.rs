//! Kernel entry points of the PTX module (nvptx64 only): one per row of the kernel entry table
//! that gpu/build.rs generates (func × algo × protocol × element type × operator), named
//! `oxccl_<func>[_tree]_<proto>_<dtype>_<op>` after the ABI enums' names
//! ([`crate::abi::kernel_name_for`]).
//! Broadcast and AllGather only move bytes, so they have one entry per element size; Avg runs the
//! sum entry (its post-division is read at run time), and Prod, Max, Min and PreMulSum their
//! type's `any` entry (its operator is read at run time); each entry runs one protocol
//! ([`crate::dispatch::run_kernel`]). build.rs splits the linked PTX into one module per entry
//! point so that the driver JIT-compiles only the kernels a program uses.
use crate::abi::{Algo, DataType, Func, KernelArgs, KernelOp, Proto};
use crate::arch;
#[allow(unused_imports)] // a filtered table (OXCCL_ONLY_FUNCS) may use few of them
use crate::reduce::{FuncAny, FuncSum};
#[allow(unused_imports)]
use half::{bf16, f16};

/// One `extern "ptx-kernel"` entry point per row of the generated table (gpu/build.rs).
macro_rules! entries {
    ($($name:ident => $func:ident, $algo:ident, $proto:ident, $dt:ident, $t:ty, $opv:ident, $op:ty;)*) => {$(
        /// Collective kernel: grid = `args.work.nchannels` blocks, block = `NCCL_NTHREADS` threads.
        ///
        /// # Safety
        /// Launched by the host library with a valid [`KernelArgs`] for this entry (see
        /// [`crate::dispatch::run_kernel`]).
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: KernelArgs) {
            // The table's type and operator are the ABI's, checked at compile time.
            const _: () = assert!(DataType::$dt.size() == core::mem::size_of::<$t>());
            const _: KernelOp = KernelOp::$opv;
            // SAFETY: `kernel_shared_mem` is called once in this kernel; the rest is the launch
            // contract.
            unsafe {
                let smem = arch::kernel_shared_mem();
                crate::dispatch::run_kernel::<
                    $t,
                    $op,
                    { Func::$func as u8 },
                    { Algo::$algo as u8 },
                    { Proto::$proto as u8 },
                >(
                    &args,
                    arch::block_idx(),
                    arch::thread_idx(),
                    arch::block_dim(),
                    smem,
                );
            }
        }
    )*};
}

/// Point-to-point kernel ([`crate::abi::P2P_KERNEL_NAME`]): grid = `args.nworks` blocks, block =
/// `NCCL_NTHREADS` threads; block `b` runs `args.works[b]`.
///
/// # Safety
/// Launched by the host library with a valid [`crate::abi::P2pArgs`] (see
/// [`crate::coll::send_recv::run_p2p_block`]).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn oxccl_sendrecv_simple(args: crate::abi::P2pArgs) {
    // SAFETY: `kernel_shared_mem` is called once in this kernel; the rest is the launch contract.
    unsafe {
        let smem = arch::kernel_shared_mem();
        crate::coll::send_recv::run_p2p_block(&args, arch::block_idx(), arch::thread_idx(), arch::block_dim(), smem);
    }
}

include!(concat!(env!("OUT_DIR"), "/kernel_modules.rs"));

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::trap()
}
