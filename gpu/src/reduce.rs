//! Reduction operators per element type (NCCL's `reduce_kernel.h`: `FuncSum`, `FuncProd`,
//! `FuncMinMax`, and `FuncSumPostDiv` for Avg).
//!
//! Integer arithmetic wraps (NCCL does no overflow handling, case C08). Half and bfloat16 compute
//! in f32 and round once per operation. Avg is Sum followed by a post-division by `nranks` on the
//! final value (integers truncate toward zero, floats round to nearest).
use crate::arch::Pack;
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

macro_rules! half_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { <$t>::from_f32(a.to_f32() + b.to_f32()) }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { <$t>::from_f32(a.to_f32() * b.to_f32()) }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if b.to_f32() < a.to_f32() { b } else { a } }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if b.to_f32() > a.to_f32() { b } else { a } }
            #[inline(always)] fn div(a: Self, n: u32) -> Self { <$t>::from_f32(a.to_f32() / n as f32) }
        }
    )*};
}
half_elem!(f16, bf16);

/// A binary reduction operator over `T`.
pub trait RedFn<T: Elem>: Copy {
    fn apply(a: T, b: T) -> T;

    /// Lane-wise [`Self::apply`] over two packs.
    #[inline(always)]
    fn apply_pack(a: Pack, b: Pack) -> Pack {
        let mut r = Pack::default();
        let pa = &a as *const Pack as *const T;
        let pb = &b as *const Pack as *const T;
        let pr = &mut r as *mut Pack as *mut T;
        for i in 0..T::PER_PACK {
            // SAFETY: a Pack is 16 bytes, 16-aligned, and T::PER_PACK * size_of::<T>() == 16.
            unsafe { pr.add(i).write(Self::apply(pa.add(i).read(), pb.add(i).read())) }
        }
        r
    }
}

/// Lane-wise `x / n` over a pack (Avg's post-operation).
#[inline(always)]
pub fn div_pack<T: Elem>(a: Pack, n: u32) -> Pack {
    let mut r = Pack::default();
    let pa = &a as *const Pack as *const T;
    let pr = &mut r as *mut Pack as *mut T;
    for i in 0..T::PER_PACK {
        // SAFETY: as in `apply_pack`.
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
}
impl<T: Elem> RedFn<T> for FuncProd {
    #[inline(always)]
    fn apply(a: T, b: T) -> T {
        T::prod(a, b)
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
