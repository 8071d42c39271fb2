//! Kernel entry points of the PTX module (nvptx64 only). One entry point for every collective:
//! dispatch happens inside [`crate::dispatch::run_block`].
use crate::abi::KernelArgs;
use crate::arch;

/// The collective kernel: grid = `args.work.nchannels` blocks, block = `NCCL_NTHREADS` threads.
///
/// # Safety
/// Launched by the host library with a valid [`KernelArgs`] (see `run_block`).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn oxccl_coll_kernel(args: KernelArgs) {
    // SAFETY: called once in this kernel; the rest is the launch contract.
    unsafe {
        let smem = arch::kernel_shared_mem();
        crate::dispatch::run_block(&args, arch::block_idx(), arch::thread_idx(), arch::block_dim(), smem);
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::trap()
}
