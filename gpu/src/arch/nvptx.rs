//! NVPTX implementations. Every function is `unsafe`: pointers must be valid, aligned device (or
//! peer / host-mapped) addresses for the access, and barriers must be reached by the thread
//! counts they name, or the kernel hangs.
use super::Pack;
use core::arch::asm;

/// `%tid.x`: thread index within the block.
#[inline(always)]
pub fn thread_idx() -> u32 {
    // SAFETY: reading a special register has no preconditions.
    unsafe { core::arch::nvptx::_thread_idx_x() as u32 }
}
/// `%ctaid.x`: block index within the grid (the channel).
#[inline(always)]
pub fn block_idx() -> u32 {
    // SAFETY: reading a special register has no preconditions.
    unsafe { core::arch::nvptx::_block_idx_x() as u32 }
}
/// `%nctaid.x`: blocks in the grid.
#[inline(always)]
pub fn grid_dim() -> u32 {
    // SAFETY: reading a special register has no preconditions.
    unsafe { core::arch::nvptx::_grid_dim_x() as u32 }
}
/// `%ntid.x`: threads per block.
#[inline(always)]
pub fn block_dim() -> u32 {
    // SAFETY: reading a special register has no preconditions.
    unsafe { core::arch::nvptx::_block_dim_x() as u32 }
}

/// `barrier.sync 0`: CTA-wide barrier; orders memory at CTA scope.
///
/// Why not `bar.sync` (= `barrier.sync.aligned`): rustc does not mark inline assembly
/// `convergent` (clang does, for CUDA), so LLVM may tail-duplicate a barrier into both arms of a
/// branch on the thread index — e.g. thread 0's "publish the step sizes, then post" path and the
/// other threads' "post" path each got their own copy. An *aligned* barrier reached through
/// different instructions by the threads of one warp is undefined behaviour, and on H200 it hung
/// every Simple kernel (ptxas's reconvergence point waited for thread 0, which waited at its copy
/// of the barrier). The non-aligned form counts each arriving thread at whichever copy it
/// reaches, so any such duplication stays correct.
///
/// # Safety
/// Every thread of the block must reach it.
#[inline(always)]
pub unsafe fn sync_threads() {
    // SAFETY: caller guarantees all threads arrive.
    unsafe { asm!("barrier.sync 0;", options(nostack)) }
}

/// `barrier.sync id, n`: named barrier among `n` threads (a multiple of 32); non-aligned for the
/// reason given at [`sync_threads`].
///
/// # Safety
/// Exactly `n` threads must reach barrier `id`.
#[inline(always)]
pub unsafe fn named_barrier(id: u32, n: u32) {
    // SAFETY: caller guarantees the participant count.
    unsafe { asm!("barrier.sync {id}, {n};", id = in(reg32) id, n = in(reg32) n, options(nostack)) }
}

/// `fence.acq_rel.sys`: orders this thread's (and, cumulatively, what it has observed) earlier
/// memory operations before its later ones, for every observer in the system (peer GPUs, host).
///
/// # Safety
/// None beyond being on the device; `unsafe` for uniformity.
#[inline(always)]
pub unsafe fn fence_acq_rel_sys() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.sys;", options(nostack)) }
}

/// `fence.acq_rel.gpu`: as [`fence_acq_rel_sys`] for the observers on this GPU only (its
/// other blocks); far cheaper than the system-scope fence, which waits for the thread's writes
/// to reach host memory and peer GPUs.
///
/// # Safety
/// None beyond being on the device.
#[inline(always)]
pub unsafe fn fence_acq_rel_gpu() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) }
}

/// `nanosleep.u32`: suspends the thread for about `ns` nanoseconds (sm_70+), so a polling
/// thread leaves the memory system to the threads doing the work.
#[inline(always)]
pub fn nanosleep(ns: u32) {
    // SAFETY: no memory operands; suspends only this thread.
    unsafe { asm!("nanosleep.u32 {ns};", ns = in(reg32) ns, options(nostack)) }
}

/// `fence.sc.sys`: sequentially consistent fence at system scope.
///
/// # Safety
/// None beyond being on the device.
#[inline(always)]
pub unsafe fn fence_sc_sys() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.sc.sys;", options(nostack)) }
}

/// `ld.acquire.sys.global.u64`: acquire load at system scope.
///
/// # Safety
/// `p` is a valid, 8-byte aligned global address.
#[inline(always)]
pub unsafe fn load_acquire_sys_u64(p: *const u64) -> u64 {
    let v: u64;
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("ld.acquire.sys.global.u64 {v}, [{p}];", v = out(reg64) v, p = in(reg64) p, options(nostack))
    }
    v
}

/// `st.release.sys.global.u64`: release store at system scope.
///
/// # Safety
/// `p` is a valid, 8-byte aligned global address.
#[inline(always)]
pub unsafe fn store_release_sys_u64(p: *mut u64, v: u64) {
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("st.release.sys.global.u64 [{p}], {v};", p = in(reg64) p, v = in(reg64) v, options(nostack))
    }
}

/// `ld.volatile.global.u64`: a load that is never cached or merged (relaxed; the flag poll).
///
/// # Safety
/// `p` is a valid, 8-byte aligned global address.
#[inline(always)]
pub unsafe fn load_volatile_u64(p: *const u64) -> u64 {
    let v: u64;
    // SAFETY: caller guarantees `p`.
    unsafe { asm!("ld.volatile.global.u64 {v}, [{p}];", v = out(reg64) v, p = in(reg64) p, options(nostack)) }
    v
}

/// `st.volatile.global.u64`.
///
/// # Safety
/// `p` is a valid, 8-byte aligned global address.
#[inline(always)]
pub unsafe fn store_volatile_u64(p: *mut u64, v: u64) {
    // SAFETY: caller guarantees `p`.
    unsafe { asm!("st.volatile.global.u64 [{p}], {v};", p = in(reg64) p, v = in(reg64) v, options(nostack)) }
}

/// `ld.volatile.global.u32` (the abort-flag poll; the flag may live in host-mapped memory).
///
/// # Safety
/// `p` is a valid, 4-byte aligned global address.
#[inline(always)]
pub unsafe fn load_volatile_u32(p: *const u32) -> u32 {
    let v: u32;
    // SAFETY: caller guarantees `p`.
    unsafe { asm!("ld.volatile.global.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg64) p, options(nostack)) }
    v
}

/// `st.volatile.global.u32`.
///
/// # Safety
/// `p` is a valid, 4-byte aligned global address.
#[inline(always)]
pub unsafe fn store_volatile_u32(p: *mut u32, v: u32) {
    // SAFETY: caller guarantees `p`.
    unsafe { asm!("st.volatile.global.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) }
}

/// `ld.volatile.global.v4.u32`: one 16-byte volatile load (LL line reads).
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn load_volatile_v4(p: *const Pack) -> Pack {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("ld.volatile.global.v4.u32 {{{a},{b},{c},{d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(nostack))
    }
    Pack([a, b, c, d])
}

/// `ld.volatile.global.v4.u32` for copy loops: never served from a stale L1 line (NCCL's
/// `ld_volatile_global` in `reduceCopy`); declared as only reading memory, so the compiler keeps
/// it in order with stores but may schedule it freely among other loads.
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn load_volatile_v4_data(p: *const Pack) -> Pack {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("ld.volatile.global.v4.u32 {{{a},{b},{c},{d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(nostack, readonly))
    }
    Pack([a, b, c, d])
}

/// `st.volatile.global.v4.u32`: one 16-byte volatile store (LL line writes).
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn store_volatile_v4(p: *mut Pack, v: Pack) {
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("st.volatile.global.v4.u32 [{p}], {{{a},{b},{c},{d}}};", p = in(reg64) p,
             a = in(reg32) v.0[0], b = in(reg32) v.0[1], c = in(reg32) v.0[2], d = in(reg32) v.0[3],
             options(nostack))
    }
}

/// `ld.global.v4.u32`: a plain (weak) 16-byte load of data already ordered by a flag + fence.
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn load_v4(p: *const Pack) -> Pack {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("ld.global.v4.u32 {{{a},{b},{c},{d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(nostack, readonly, pure))
    }
    Pack([a, b, c, d])
}

/// `st.global.v4.u32`: a plain (weak) 16-byte store; published later by a fence + flag store.
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address (local or a peer's, through peer access).
#[inline(always)]
pub unsafe fn store_v4(p: *mut Pack, v: Pack) {
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a},{b},{c},{d}}};", p = in(reg64) p,
             a = in(reg32) v.0[0], b = in(reg32) v.0[1], c = in(reg32) v.0[2], d = in(reg32) v.0[3],
             options(nostack))
    }
}

/// `shfl.sync.bfly.b32 v, v, lane_mask, 0x1f, 0xffffffff`: butterfly exchange across the warp.
///
/// # Safety
/// All 32 lanes of the warp must execute it.
#[inline(always)]
pub unsafe fn shfl_xor(v: u32, lane_mask: u32) -> u32 {
    let r: u32;
    // SAFETY: caller guarantees full-warp convergence.
    unsafe {
        asm!("shfl.sync.bfly.b32 {r}, {v}, {m}, 0x1f, 0xffffffff;", r = out(reg32) r, v = in(reg32) v,
             m = in(reg32) lane_mask, options(nostack))
    }
    r
}

/// `ld.volatile.global.v2.u64`: one 16-byte volatile load (an LL128 thread's part of a line).
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn load_volatile_v2_u64(p: *const u64) -> (u64, u64) {
    let (a, b): (u64, u64);
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("ld.volatile.global.v2.u64 {{{a},{b}}}, [{p}];", a = out(reg64) a, b = out(reg64) b,
             p = in(reg64) p, options(nostack))
    }
    (a, b)
}

/// `st.volatile.global.v2.u64`: one 16-byte volatile store (an LL128 thread's part of a line;
/// the 8 threads of a line store together, so the 128-byte line travels as one unit).
///
/// # Safety
/// `p` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn store_volatile_v2_u64(p: *mut u64, a: u64, b: u64) {
    // SAFETY: caller guarantees `p`.
    unsafe {
        asm!("st.volatile.global.v2.u64 [{p}], {{{a},{b}}};", p = in(reg64) p, a = in(reg64) a,
             b = in(reg64) b, options(nostack))
    }
}

/// `vote.sync.any.pred` over the whole warp: true if `pred` holds on any lane.
///
/// # Safety
/// All 32 lanes of the warp must execute it.
#[inline(always)]
pub unsafe fn vote_any(pred: bool) -> bool {
    let r: u32;
    // SAFETY: caller guarantees full-warp convergence.
    unsafe {
        asm!("{{ .reg .pred p, q; setp.ne.u32 p, {v}, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 {r}, 1, 0, q; }}",
             v = in(reg32) pred as u32, r = out(reg32) r, options(nostack, nomem))
    }
    r != 0
}

/// The kernel's shared memory: `KERNEL_SMEM_BYTES` bytes declared `.shared .align 16` and turned
/// into a generic address with `cvta.shared.u64`.
///
/// # Safety
/// Call it exactly once per kernel (a second inlined copy would declare the symbol twice) and pass
/// the pointer down.
#[inline(always)]
pub unsafe fn kernel_shared_mem() -> *mut u32 {
    let p: u64;
    // SAFETY: declares a kernel-scope shared array; the caller calls this once per kernel.
    unsafe {
        asm!("{{ .shared .align 16 .b8 oxccl_smem[{n}]; cvta.shared.u64 {p}, oxccl_smem; }}",
             n = const crate::abi::KERNEL_SMEM_BYTES, p = out(reg64) p, options(nostack, nomem))
    }
    p as *mut u32
}

/// Hint to the scheduler inside a spin loop (`nanosleep` would need sm_70 PTX 6.3: kept simple).
#[inline(always)]
pub fn spin_pause() {}

/// `trap`: abort the kernel.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` has no preconditions.
    unsafe { core::arch::nvptx::trap() }
}

/// Publishes the pair `(a, b)` in one 16-byte `st.volatile.global.v2.u64`, so that
/// [`load_pair_u64`] sees both new values or neither (the unit the LL protocols' data-plus-flag
/// lines rely on, also across NVLink). No fence: the pair orders nothing else.
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn store_pair_u64(p: *mut u64, a: u64, b: u64) {
    // SAFETY: forwarded caller contract.
    unsafe { store_volatile_v2_u64(p, a, b) }
}

/// Reads a pair written by [`store_pair_u64`] with one 16-byte `ld.volatile.global.v2.u64`.
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_pair_u64(p: *const u64) -> (u64, u64) {
    // SAFETY: forwarded caller contract.
    unsafe { load_volatile_v2_u64(p) }
}

/// `add.rn.f16x2`: lane-wise IEEE binary16 sum of two packed pairs (low half = element 0),
/// rounded to nearest even — NCCL's `__hadd2`. Bit-identical to adding in f32 and rounding once
/// (f32 has at least 2·11+2 bits, so the double rounding is innocuous for + and ×).
#[inline(always)]
pub fn f16x2_add(a: u32, b: u32) -> u32 {
    let r: u32;
    // SAFETY: register-only arithmetic (sm_53+, PTX 4.2+; we target sm_70 / PTX 7.0).
    unsafe {
        asm!("add.rn.f16x2 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b,
             options(pure, nomem, nostack))
    }
    r
}

/// `mul.rn.f16x2`: lane-wise IEEE binary16 product, as [`f16x2_add`] (NCCL's `__hmul2`).
#[inline(always)]
pub fn f16x2_mul(a: u32, b: u32) -> u32 {
    let r: u32;
    // SAFETY: register-only arithmetic (sm_53+, PTX 4.2+).
    unsafe {
        asm!("mul.rn.f16x2 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b,
             options(pure, nomem, nostack))
    }
    r
}

/// `cvt.f32.f16`: widens one binary16 value (its bits) to f32 exactly.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let f: f32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.f32.f16 {f}, {h};", f = out(reg32) f, h = in(reg16) h,
             options(pure, nomem, nostack))
    }
    f
}

/// `cvt.rn.f16.f32`: rounds an f32 to binary16 (nearest even; overflow to ±inf), as bits.
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    let h: u16;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.f16.f32 {h}, {f};", h = out(reg16) h, f = in(reg32) f,
             options(pure, nomem, nostack))
    }
    h
}

/// `x`, hidden from the optimizer (a `mov`, no cost): what is known of it — a small upper
/// bound, say — no longer drives unrolling, so a loop over it stays a loop.
#[inline(always)]
pub fn opaque_u64(x: u64) -> u64 {
    let r: u64;
    // SAFETY: a register move.
    unsafe { asm!("mov.u64 {r}, {x};", r = out(reg64) r, x = in(reg64) x, options(pure, nomem, nostack)) }
    r
}
