//! Kernel entry points of the PTX module (nvptx64 only): one per row of the kernel entry table
//! that gpu/build.rs generates (func × algo × protocol × element type × operator), named
//! `oxccl_<func>[_tree]_<proto>_<dtype>_<op>` after the ABI enums' names
//! ([`crate::abi::kernel_name_for`]).
//! Broadcast and AllGather only move bytes, so they have one entry per element size, and a
//! second one (`_checked`) for calls with the call check on, which sends ahead of the check's
//! gate ([`crate::abi::checked_entry`]); Avg runs the
//! sum entry (its post-division is read at run time), and Prod, Max, Min and PreMulSum their
//! type's `any` entry (its operator is read at run time); each entry runs one protocol
//! ([`crate::dispatch::run_kernel`]). build.rs splits the linked PTX into one module per entry
//! point so that the driver JIT-compiles only the kernels a program uses.
use crate::abi::{Algo, DataType, Func, KernelArgs, KernelOp, Proto};
use crate::arch;
#[allow(unused_imports)] // a filtered table (OXCCL_ONLY_FUNCS) may use few of them
use crate::reduce::{FuncAny, FuncSum};
#[allow(unused_imports)]
use crate::fp8::{F8E4M3, F8E5M2};
#[allow(unused_imports)]
use half::{bf16, f16};

/// One `extern "ptx-kernel"` entry point per row of the generated table (gpu/build.rs).
macro_rules! entries {
    ($($name:ident => $func:ident, $algo:ident, $proto:ident, $dt:ident, $t:ty, $opv:ident, $op:ty, $checked:literal;)*) => {$(
        /// Collective kernel: grid = the largest `nchannels` of the launch's works, block =
        /// `NCCL_NTHREADS` threads.
        ///
        /// # Safety
        /// Launched by the host library with a valid [`KernelArgs`] for this entry (see
        /// [`crate::dispatch::run_kernel`]), holding at least its header and `nworks` works.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(args: KernelArgs) {
            // The table's type and operator are the ABI's, checked at compile time.
            const _: () = assert!(DataType::$dt.size() == core::mem::size_of::<$t>());
            const _: KernelOp = KernelOp::$opv;
            // Work `i` of the launch: the first at its constant offset, the others a word at a
            // time from the parameter space (indexing `args.more` would copy all of it into
            // local memory).
            let work = |i: u32| -> crate::abi::WorkColl {
                match i.checked_sub(1) {
                    None => args.work,
                    Some(j) => {
                        let mut words = [0u64; 8];
                        let base = core::mem::offset_of!(KernelArgs, more) as u64
                            + j as u64 * core::mem::size_of::<crate::abi::WorkColl>() as u64;
                        for (k, word) in words.iter_mut().enumerate() {
                            let off = base + 8 * k as u64;
                            // SAFETY: `j < nworks - 1 ≤ MAX_COLL_WORKS - 1`: the load lies in
                            // this kernel's parameter, in the bytes the launch passed.
                            unsafe {
                                core::arch::asm!(
                                    "{{",
                                    ".reg .u64 %coll_at;",
                                    concat!("mov.u64 %coll_at, ", stringify!($name), "_param_0;"),
                                    "add.u64 %coll_at, %coll_at, {off};",
                                    "ld.param.u64 {v}, [%coll_at];",
                                    "}}",
                                    off = in(reg64) off,
                                    v = out(reg64) *word,
                                    options(nostack, readonly, pure)
                                );
                            }
                        }
                        bytemuck::cast(words)
                    }
                }
            };
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
                    $checked,
                >(
                    &args,
                    work,
                    arch::block_idx(),
                    arch::thread_idx(),
                    arch::block_dim(),
                    smem,
                );
            }
        }
    )*};
}

/// The call-signature check alone ([`crate::abi::CHECK_KERNEL_NAME`]), for a checked call of
/// count 0: one block of `NCCL_NTHREADS` threads.
///
/// # Safety
/// Launched by the host library with a valid [`crate::abi::CheckArgs`] (see
/// [`crate::check::check_call`]).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn oxccl_check_call(args: crate::abi::CheckArgs) {
    // SAFETY: `kernel_shared_mem` is called once in this kernel; the rest is the launch contract.
    unsafe {
        let smem = arch::kernel_shared_mem();
        crate::check::check_call(args.comm, args.check, &args.sig, false, arch::thread_idx(), arch::block_dim(), smem);
    }
}

/// Point-to-point kernel ([`crate::abi::P2P_KERNEL_NAME`]): grid = the launch's blocks, block =
/// `NCCL_NTHREADS` threads; block `b` runs its works of `args.works` one after the other
/// ([`crate::abi::p2p_block_works`]).
///
/// # Safety
/// Launched by the host library with a valid [`crate::abi::P2pArgs`] (see
/// [`crate::coll::send_recv::run_p2p_block`]).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn oxccl_sendrecv(args: crate::abi::P2pArgs) {
    let bid = arch::block_idx();
    // Constant offsets: read from the parameter space as they are.
    let (comm, status, nworks) = (args.comm, args.status, args.nworks);
    let nworks = core::cmp::min(nworks as usize, crate::abi::MAX_P2P_WORKS);
    // SAFETY: every index the scan reads is below `nworks` ≤ MAX_P2P_WORKS.
    let kind = |i: usize| unsafe { p2p_param_kind(i as u32) };
    let Some((start, end)) = crate::abi::p2p_block_works(nworks, bid, kind) else {
        return;
    };
    // SAFETY: `start..end` lie below `nworks` ≤ MAX_P2P_WORKS: each work lies in this kernel's
    // parameter; `kernel_shared_mem` is called once in this kernel; the rest is the launch
    // contract.
    unsafe {
        let smem = arch::kernel_shared_mem();
        if crate::coll::send_recv::stopped(comm, arch::thread_idx(), smem) {
            return;
        }
        for i in start..end {
            let w = p2p_param_work(i as u32);
            let status = crate::abi::p2p_status_record(status, i);
            crate::coll::send_recv::run_p2p_work(comm, status, w, arch::thread_idx(), arch::block_dim(), smem);
        }
    }
}

/// The `kind` byte of work `i` of [`oxccl_sendrecv`]'s parameter (see [`p2p_param_work`]).
///
/// # Safety
/// As [`p2p_param_work`].
#[inline(always)]
unsafe fn p2p_param_kind(i: u32) -> u8 {
    // SAFETY: forwarded caller contract; `kind` is byte 4 of the work's third word.
    (unsafe { p2p_param_word(i, 2) } >> 32) as u8
}

/// Work `i` of [`oxccl_sendrecv`]'s parameter, a word at a time ([`p2p_param_word`]).
///
/// # Safety
/// Only in [`oxccl_sendrecv`], with `i < MAX_P2P_WORKS`.
#[inline(always)]
unsafe fn p2p_param_work(i: u32) -> crate::abi::WorkP2p {
    use crate::abi::WorkP2p;
    use core::mem::offset_of;
    const _: () = assert!(
        offset_of!(WorkP2p, bytes) == 8
            && offset_of!(WorkP2p, channel) == 16
            && offset_of!(WorkP2p, kind) == 20
            && offset_of!(WorkP2p, part) == 21
            && offset_of!(WorkP2p, nparts) == 22
            && offset_of!(WorkP2p, proto) == 23
            && core::mem::size_of::<WorkP2p>() == 24
    );
    // SAFETY: forwarded caller contract.
    let (buff, bytes, rest) = unsafe { (p2p_param_word(i, 0), p2p_param_word(i, 1), p2p_param_word(i, 2)) };
    WorkP2p {
        buff,
        bytes,
        channel: rest as u32,
        kind: (rest >> 32) as u8,
        part: (rest >> 40) as u8,
        nparts: (rest >> 48) as u8,
        proto: (rest >> 56) as u8,
    }
}

/// Word `w` (8 bytes) of work `i` of [`oxccl_sendrecv`]'s parameter, read with `ld.param` at a
/// computed offset of the parameter's address (PTX lets a kernel take its parameters'
/// addresses with `mov`). Indexing the parameter in Rust instead makes LLVM copy all 3 KiB of
/// it into every thread's local memory first.
///
/// # Safety
/// Only in [`oxccl_sendrecv`] (the asm names its parameter), with `i < MAX_P2P_WORKS` and
/// `w < 3`.
#[inline(always)]
unsafe fn p2p_param_word(i: u32, w: u32) -> u64 {
    use crate::abi::{P2pArgs, WorkP2p};
    let off = core::mem::offset_of!(P2pArgs, works) as u64
        + i as u64 * core::mem::size_of::<WorkP2p>() as u64
        + w as u64 * 8;
    let v: u64;
    // SAFETY: the load lies inside the kernel's parameter (caller contract); registers only.
    unsafe {
        core::arch::asm!(
            "{{",
            ".reg .u64 %p2p_at;",
            "mov.u64 %p2p_at, oxccl_sendrecv_param_0;",
            "add.u64 %p2p_at, %p2p_at, {off};",
            "ld.param.u64 {v}, [%p2p_at];",
            "}}",
            off = in(reg64) off,
            v = out(reg64) v,
            options(nostack, readonly, pure)
        );
    }
    v
}

include!(concat!(env!("OUT_DIR"), "/kernel_modules.rs"));

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::trap()
}
