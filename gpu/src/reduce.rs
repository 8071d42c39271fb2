//! Reduction operators per element type (NCCL's `reduce_kernel.h`: `FuncSum`, `FuncProd`,
//! `FuncMinMax`, and `FuncSumPostDiv` for Avg).
//!
//! Integer arithmetic wraps (NCCL does no overflow handling, case C08). Half and bfloat16 compute
//! in f32 and round once per operation; on the GPU, half sums and products of whole packs use the
//! packed `add.rn.f16x2` / `mul.rn.f16x2` (NCCL's `__hadd2` / `__hmul2`), which give the same bits
//! for finite results, and half conversions are the hardware `cvt` rather than bit twiddling;
//! bfloat16 packs widen by shifts and round with integer adds (sm_70 has no bf16 arithmetic). Avg is Sum followed by a post-division by `nranks` on the
//! final value (integers truncate toward zero, floats round to nearest).
use crate::arch::{self, Pack};
use half::{bf16, f16};

/// An element type the kernels can move and reduce.
pub trait Elem: Copy + 'static {
    /// Elements in one 16-byte [`Pack`].
    const PER_PACK: usize = 16 / core::mem::size_of::<Self>();
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    /// `a / n` (Avg's post-operation).
    fn div(a: Self, n: u32) -> Self;

    /// Lane-wise [`Self::sum`] over two packs; types with a packed instruction override it.
    #[inline(always)]
    fn sum_pack(a: Pack, b: Pack) -> Pack {
        lanes::<Self>(a, b, Self::sum)
    }
    /// Lane-wise [`Self::prod`] over two packs; types with a packed instruction override it.
    #[inline(always)]
    fn prod_pack(a: Pack, b: Pack) -> Pack {
        lanes::<Self>(a, b, Self::prod)
    }
}

/// `f` applied lane by lane to the `T` elements of two packs.
#[inline(always)]
fn lanes<T: Elem>(a: Pack, b: Pack, f: impl Fn(T, T) -> T) -> Pack {
    let mut r = Pack::default();
    let pa = &a as *const Pack as *const T;
    let pb = &b as *const Pack as *const T;
    let pr = &mut r as *mut Pack as *mut T;
    for i in 0..T::PER_PACK {
        // SAFETY: a Pack is 16 bytes, 16-aligned, and T::PER_PACK * size_of::<T>() == 16.
        unsafe { pr.add(i).write(f(pa.add(i).read(), pb.add(i).read())) }
    }
    r
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            #[inline(always)] fn div(a: Self, n: u32) -> Self { a.wrapping_div(n as $t) }
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a + b }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a * b }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            #[inline(always)] fn div(a: Self, n: u32) -> Self { a / (n as $t) }
        }
    )*};
}
float_elem!(f32, f64);

impl Elem for f16 {
    #[inline(always)]
    fn sum(a: Self, b: Self) -> Self {
        h(arch::f32_to_f16(f(a) + f(b)))
    }
    #[inline(always)]
    fn prod(a: Self, b: Self) -> Self {
        h(arch::f32_to_f16(f(a) * f(b)))
    }
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        if f(b) < f(a) { b } else { a }
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        if f(b) > f(a) { b } else { a }
    }
    #[inline(always)]
    fn div(a: Self, n: u32) -> Self {
        h(arch::f32_to_f16(f(a) / n as f32))
    }
    #[inline(always)]
    fn sum_pack(a: Pack, b: Pack) -> Pack {
        Pack(core::array::from_fn(|i| arch::f16x2_add(a.0[i], b.0[i])))
    }
    #[inline(always)]
    fn prod_pack(a: Pack, b: Pack) -> Pack {
        Pack(core::array::from_fn(|i| arch::f16x2_mul(a.0[i], b.0[i])))
    }
}

/// A half as f32, through the hardware conversion on the GPU.
#[inline(always)]
fn f(x: f16) -> f32 {
    arch::f16_to_f32(x.to_bits())
}

#[inline(always)]
fn h(bits: u16) -> f16 {
    f16::from_bits(bits)
}

impl Elem for bf16 {
    #[inline(always)]
    fn sum(a: Self, b: Self) -> Self {
        bf16::from_f32(a.to_f32() + b.to_f32())
    }
    #[inline(always)]
    fn prod(a: Self, b: Self) -> Self {
        bf16::from_f32(a.to_f32() * b.to_f32())
    }
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        if b.to_f32() < a.to_f32() { b } else { a }
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        if b.to_f32() > a.to_f32() { b } else { a }
    }
    #[inline(always)]
    fn div(a: Self, n: u32) -> Self {
        bf16::from_f32(a.to_f32() / n as f32)
    }
    #[inline(always)]
    fn sum_pack(a: Pack, b: Pack) -> Pack {
        Pack(core::array::from_fn(|i| bf16x2(a.0[i], b.0[i], |x, y| x + y)))
    }
    #[inline(always)]
    fn prod_pack(a: Pack, b: Pack) -> Pack {
        Pack(core::array::from_fn(|i| bf16x2(a.0[i], b.0[i], |x, y| x * y)))
    }
}

/// `f` over the two bfloat16 lanes of `a` and `b` (low half = element 0) in f32, each result
/// rounded to nearest even — the bits of `bf16::from_f32(f(x.to_f32(), y.to_f32()))` without its
/// branches: widening a bfloat16 is a shift, and rounding adds `0x7fff` plus the kept lowest bit
/// (a NaN stays a NaN, its quiet bit set as `from_f32` does).
#[inline(always)]
fn bf16x2(a: u32, b: u32, f: impl Fn(f32, f32) -> f32) -> u32 {
    let lo = f(f32::from_bits(a << 16), f32::from_bits(b << 16));
    let hi = f(f32::from_bits(a & 0xffff_0000), f32::from_bits(b & 0xffff_0000));
    bf16_round(lo) | bf16_round(hi) << 16
}

/// f32 to bfloat16 bits (in the low 16 bits of the result), nearest even.
#[inline(always)]
fn bf16_round(x: f32) -> u32 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        (u >> 16) | 0x40
    } else {
        u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16
    }
}

/// A binary reduction operator over `T`.
pub trait RedFn<T: Elem>: Copy {
    fn apply(a: T, b: T) -> T;

    /// Lane-wise [`Self::apply`] over two packs.
    #[inline(always)]
    fn apply_pack(a: Pack, b: Pack) -> Pack {
        lanes::<T>(a, b, Self::apply)
    }
}

/// Lane-wise `x / n` over a pack (Avg's post-operation).
#[inline(always)]
pub fn div_pack<T: Elem>(a: Pack, n: u32) -> Pack {
    let mut r = Pack::default();
    let pa = &a as *const Pack as *const T;
    let pr = &mut r as *mut Pack as *mut T;
    for i in 0..T::PER_PACK {
        // SAFETY: as in `lanes`.
        unsafe { pr.add(i).write(T::div(pa.add(i).read(), n)) }
    }
    r
}

#[derive(Clone, Copy)]
pub struct FuncSum;
#[derive(Clone, Copy)]
pub struct FuncProd;
#[derive(Clone, Copy)]
pub struct FuncMin;
#[derive(Clone, Copy)]
pub struct FuncMax;

impl<T: Elem> RedFn<T> for FuncSum {
    #[inline(always)]
    fn apply(a: T, b: T) -> T {
        T::sum(a, b)
    }
    #[inline(always)]
    fn apply_pack(a: Pack, b: Pack) -> Pack {
        T::sum_pack(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncProd {
    #[inline(always)]
    fn apply(a: T, b: T) -> T {
        T::prod(a, b)
    }
    #[inline(always)]
    fn apply_pack(a: Pack, b: Pack) -> Pack {
        T::prod_pack(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncMin {
    #[inline(always)]
    fn apply(a: T, b: T) -> T {
        T::min(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncMax {
    #[inline(always)]
    fn apply(a: T, b: T) -> T {
        T::max(a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_ops_wrap_like_nccl() {
        assert_eq!(<i8 as Elem>::sum(120, 100), -36);
        assert_eq!(<u8 as Elem>::sum(200, 100), 44);
        assert_eq!(<i32 as Elem>::sum(i32::MAX, 1), i32::MIN);
        assert_eq!(<u64 as Elem>::sum(u64::MAX, 1), 0);
        assert_eq!(<i8 as Elem>::prod(16, 16), 0);
        assert_eq!(<i32 as Elem>::div(15, 2), 7);
        assert_eq!(<i32 as Elem>::div(-15, 2), -7);
    }

    #[test]
    fn pack_ops_are_lane_wise() {
        let a = Pack([1, 2, 3, 4]);
        let b = Pack([10, 20, 30, 40]);
        assert_eq!(<FuncSum as RedFn<u32>>::apply_pack(a, b), Pack([11, 22, 33, 44]));
        assert_eq!(<FuncMax as RedFn<u32>>::apply_pack(a, b), b);
        let h = |x: f32| f16::from_f32(x).to_bits() as u32;
        let a = Pack([h(1.0) | h(2.0) << 16, 0, 0, 0]);
        let b = Pack([h(3.0) | h(4.0) << 16, 0, 0, 0]);
        assert_eq!(
            <FuncSum as RedFn<f16>>::apply_pack(a, b).0[0],
            h(4.0) | h(6.0) << 16
        );
        assert_eq!(div_pack::<u32>(Pack([9, 8, 7, 6]), 2), Pack([4, 4, 3, 3]));
    }
}
