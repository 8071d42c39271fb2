//! Host implementations of the `arch` functions, for the CPU target. A block is one host thread
//! (`block_dim() == 1`), so barriers are no-ops; flag loads and stores are `core` atomics with the
//! same ordering the PTX versions give; data loads and stores are plain memory accesses.
use super::Pack;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

std::thread_local! {
    static BLOCK_IDX: core::cell::Cell<u32> = const { core::cell::Cell::new(0) };
}

/// Thread index within the block: always 0 (one thread per block on the CPU target).
#[inline(always)]
pub fn thread_idx() -> u32 {
    0
}
/// Block index of the calling host thread, as set by [`set_block_idx`].
#[inline(always)]
pub fn block_idx() -> u32 {
    BLOCK_IDX.with(|b| b.get())
}
/// Threads per block: 1.
#[inline(always)]
pub fn block_dim() -> u32 {
    1
}
/// Sets the block index the calling host thread reports (the CPU launcher calls it).
pub fn set_block_idx(b: u32) {
    BLOCK_IDX.with(|c| c.set(b));
}

/// Block barrier: a no-op for one thread per block.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn sync_threads() {}

/// Named barrier: a no-op for one thread per block.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn named_barrier(_id: u32, _n: u32) {}

/// Acquire-release fence.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn fence_acq_rel_sys() {
    fence(Ordering::AcqRel)
}

/// Sequentially consistent fence.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn fence_sc_sys() {
    fence(Ordering::SeqCst)
}

/// Acquire load.
///
/// # Safety
/// `p` is valid and 8-byte aligned, and only accessed atomically while shared.
#[inline(always)]
pub unsafe fn load_acquire_sys_u64(p: *const u64) -> u64 {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p as *mut u64).load(Ordering::Acquire) }
}

/// Release store.
///
/// # Safety
/// As [`load_acquire_sys_u64`].
#[inline(always)]
pub unsafe fn store_release_sys_u64(p: *mut u64, v: u64) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p).store(v, Ordering::Release) }
}

/// Relaxed-but-fresh load (the PTX `ld.volatile`); acquire on the host so the CPU target never
/// depends on a separate fence for correctness.
///
/// # Safety
/// As [`load_acquire_sys_u64`].
#[inline(always)]
pub unsafe fn load_volatile_u64(p: *const u64) -> u64 {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p as *mut u64).load(Ordering::Acquire) }
}

/// Store counterpart of [`load_volatile_u64`] (release on the host).
///
/// # Safety
/// As [`load_acquire_sys_u64`].
#[inline(always)]
pub unsafe fn store_volatile_u64(p: *mut u64, v: u64) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p).store(v, Ordering::Release) }
}

/// Fresh load of a `u32` flag.
///
/// # Safety
/// `p` is valid and 4-byte aligned.
#[inline(always)]
pub unsafe fn load_volatile_u32(p: *const u32) -> u32 {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU32::from_ptr(p as *mut u32).load(Ordering::Acquire) }
}

/// 16-byte load as two 8-byte acquire loads (an LL line's halves are each one atomic on the host).
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_volatile_v4(p: *const Pack) -> Pack {
    let q = p as *mut u64;
    // SAFETY: caller guarantees validity and alignment.
    let (lo, hi) = unsafe {
        (
            AtomicU64::from_ptr(q).load(Ordering::Acquire),
            AtomicU64::from_ptr(q.add(1)).load(Ordering::Acquire),
        )
    };
    Pack([lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32])
}

/// A copy loop's 16-byte load ([`load_volatile_v4`] on the host).
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_volatile_v4_data(p: *const Pack) -> Pack {
    // SAFETY: forwarded caller contract.
    unsafe { load_volatile_v4(p) }
}

/// 16-byte store as two 8-byte release stores.
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn store_volatile_v4(p: *mut Pack, v: Pack) {
    let q = p as *mut u64;
    let lo = v.0[0] as u64 | (v.0[1] as u64) << 32;
    let hi = v.0[2] as u64 | (v.0[3] as u64) << 32;
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        AtomicU64::from_ptr(q).store(lo, Ordering::Release);
        AtomicU64::from_ptr(q.add(1)).store(hi, Ordering::Release);
    }
}

/// Plain 16-byte load.
///
/// # Safety
/// `p` is valid and 16-byte aligned, and not concurrently written.
#[inline(always)]
pub unsafe fn load_v4(p: *const Pack) -> Pack {
    // SAFETY: caller guarantees validity, alignment and no concurrent writer.
    unsafe { p.read() }
}

/// Plain 16-byte store.
///
/// # Safety
/// `p` is valid and 16-byte aligned, and not concurrently accessed.
#[inline(always)]
pub unsafe fn store_v4(p: *mut Pack, v: Pack) {
    // SAFETY: caller guarantees validity, alignment and exclusive access.
    unsafe { p.write(v) }
}

/// Warp shuffle: with one thread per block there is no other lane; returns `v`.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn shfl_xor(v: u32, _lane_mask: u32) -> u32 {
    v
}

/// Spin-loop hint. On the CPU target many ranks' channels share few cores, so a waiting thread
/// gives its core away instead of burning it.
#[inline(always)]
pub fn spin_pause() {
    std::thread::yield_now();
}

/// Abort the "kernel": on the host this is a panic of the channel thread, which the CPU launcher
/// turns into an error.
pub fn trap() -> ! {
    panic!("oxccl kernel trap")
}

/// Publishes the pair `(a, b)`: `a`, then `b` with release, so that [`load_pair_u64`], which
/// reads `b` with acquire first, sees an `a` at least as new as the `b` it saw (the GPU's single
/// 16-byte store gives the same to a reader that checks `b`).
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn store_pair_u64(p: *mut u64, a: u64, b: u64) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        AtomicU64::from_ptr(p).store(a, Ordering::Relaxed);
        AtomicU64::from_ptr(p.add(1)).store(b, Ordering::Release);
    }
}

/// Reads a pair written by [`store_pair_u64`]: `b` with acquire, then `a`.
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_pair_u64(p: *const u64) -> (u64, u64) {
    let q = p as *mut u64;
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        let b = AtomicU64::from_ptr(q.add(1)).load(Ordering::Acquire);
        (AtomicU64::from_ptr(q).load(Ordering::Relaxed), b)
    }
}

/// Lane-wise binary16 sum of two packed pairs (low half = element 0), rounded to nearest even:
/// the CPU-target twin of the GPU's `add.rn.f16x2` (computed in f32 and rounded once, which gives
/// the same bits for finite results).
#[inline(always)]
pub fn f16x2_add(a: u32, b: u32) -> u32 {
    f16x2_lanes(a, b, |x, y| x + y)
}

/// Lane-wise binary16 product, as [`f16x2_add`] (`mul.rn.f16x2` on the GPU).
#[inline(always)]
pub fn f16x2_mul(a: u32, b: u32) -> u32 {
    f16x2_lanes(a, b, |x, y| x * y)
}

#[inline(always)]
fn f16x2_lanes(a: u32, b: u32, f: impl Fn(f32, f32) -> f32) -> u32 {
    let lane = |s: u32| {
        let (x, y) = (f16_to_f32((a >> s) as u16), f16_to_f32((b >> s) as u16));
        (f32_to_f16(f(x, y)) as u32) << s
    };
    lane(0) | lane(16)
}

/// Widens one binary16 value (its bits) to f32 exactly (`cvt.f32.f16` on the GPU).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// Rounds an f32 to binary16 bits, nearest even (`cvt.rn.f16.f32` on the GPU).
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    half::f16::from_f32(f).to_bits()
}
