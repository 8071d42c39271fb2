//! Reduction operators per element type (NCCL's `reduce_kernel.h`: `FuncSum`, `FuncProd`,
//! `FuncMinMax`, `FuncSumPostDiv` for Avg and `FuncPreMulSum`).
//!
//! Integer arithmetic wraps (NCCL does no overflow handling, case C08). Half and bfloat16 compute
//! in f32 and round once per operation; on the GPU, half sums and products of whole packs use the
//! packed `add.rn.f16x2` / `mul.rn.f16x2` (NCCL's `__hadd2` / `__hmul2`), which give the same bits
//! for finite results, and half conversions are the hardware `cvt` rather than bit twiddling;
//! bfloat16 widens by a shift and rounds with integer adds (sm_70 has no bf16 arithmetic), and both
//! work word by word on packs (two lanes per `u32`). Avg is Sum followed by a post-division by
//! `nranks` on the final value (integers truncate toward zero, floats round to nearest).
use crate::abi::DevRedOp;
use crate::arch::{self, Pack};
use crate::fp8::{self, F8E4M3, F8E5M2};
use crate::unroll;
use half::{bf16, f16};

/// The integer type of a step's line arithmetic in LL128 (`proto/ll128.rs`: line indices, byte
/// offsets), an element type's [`Elem::Line`]: 32 bits for 1- and 2-byte elements, 64 bits for the
/// others, each the faster on the H100 (docs/benchmarks.md). The
/// narrow types' reductions need the registers 64-bit line arithmetic takes: their kernels spilled
/// with it, and the 16-bit ones run 5–16 % faster without. The 4- and 8-byte kernels spill with
/// neither, and float AllReduce ran 4–6 % slower at 8–32 MiB with 32 bits.
pub trait LineIdx: Copy + PartialOrd + core::ops::Add<Output = Self> + core::ops::Mul<Output = Self> {
    fn of(x: u32) -> Self;
    /// `x`, which fits 32 bits (a step's lines and bytes: a slot is part of one buffer).
    fn of_u64(x: u64) -> Self;
    fn idx(self) -> usize;
    fn wide(self) -> u64;
    fn saturating_sub(self, o: Self) -> Self;
}

macro_rules! line_idx {
    ($($t:ty),*) => {$(
        impl LineIdx for $t {
            #[inline(always)]
            fn of(x: u32) -> Self { x as $t }
            #[inline(always)]
            fn of_u64(x: u64) -> Self { x as $t }
            #[inline(always)]
            fn idx(self) -> usize { self as usize }
            #[inline(always)]
            fn wide(self) -> u64 { self as u64 }
            #[inline(always)]
            fn saturating_sub(self, o: Self) -> Self { <$t>::saturating_sub(self, o) }
        }
    )*};
}
line_idx!(u32, u64);

/// An element size in bytes, to name [`Elem::Line`] by size (`Width<{ size_of::<T>() }>`).
pub struct Width<const N: usize>;

/// The [`LineIdx`] of the element size a [`Width`] names.
pub trait LineOfWidth {
    type Idx: LineIdx;
}
impl LineOfWidth for Width<1> {
    type Idx = u32;
}
impl LineOfWidth for Width<2> {
    type Idx = u32;
}
impl LineOfWidth for Width<4> {
    type Idx = u64;
}
impl LineOfWidth for Width<8> {
    type Idx = u64;
}

/// An element type the kernels can move and reduce.
pub trait Elem: Copy + 'static {
    /// The integer type of LL128's line arithmetic for this type ([`LineIdx`]).
    type Line: LineIdx;
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
    /// Lane-wise [`Self::min`] over two packs.
    #[inline(always)]
    fn min_pack(a: Pack, b: Pack) -> Pack {
        lanes::<Self>(a, b, Self::min)
    }
    /// Lane-wise [`Self::max`] over two packs.
    #[inline(always)]
    fn max_pack(a: Pack, b: Pack) -> Pack {
        lanes::<Self>(a, b, Self::max)
    }
    /// Lane-wise [`Self::div`] over a pack (Avg's post-operation).
    #[inline(always)]
    fn div_pack(a: Pack, n: u32) -> Pack {
        lanes::<Self>(a, a, |x, _| Self::div(x, n))
    }
    /// The operator `op` (a [`DevRedOp`] value; Avg and PreMulSum combine as Sum) over two
    /// packs, as [`FuncAny`] applies it: the per-operator pack functions. Types whose operators
    /// share most of their work override it (fp8 widens and narrows once for any operator).
    #[inline(always)]
    fn any_pack(op: u32, a: Pack, b: Pack) -> Pack {
        match op {
            OP_PROD => Self::prod_pack(a, b),
            OP_MAX => Self::max_pack(a, b),
            OP_MIN => Self::min_pack(a, b),
            _ => Self::sum_pack(a, b),
        }
    }
}

/// `f` applied lane by lane to the `T` elements of two packs.
#[inline(always)]
fn lanes<T: Elem>(a: Pack, b: Pack, f: impl Fn(T, T) -> T) -> Pack {
    let mut r = Pack::default();
    let pa = &a as *const Pack as *const T;
    let pb = &b as *const Pack as *const T;
    let pr = &mut r as *mut Pack as *mut T;
    unroll::each_lane::<T>(
        #[cfg_attr(target_arch = "nvptx64", inline(always))]
        |i| {
            // SAFETY: a Pack is 16 bytes, 16-aligned, and T::PER_PACK * size_of::<T>() == 16.
            unsafe { pr.add(i).write(f(pa.add(i).read(), pb.add(i).read())) }
        },
    );
    r
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            type Line = <Width<{ core::mem::size_of::<$t>() }> as LineOfWidth>::Idx;
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
            type Line = <Width<{ core::mem::size_of::<$t>() }> as LineOfWidth>::Idx;
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a + b }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a * b }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            #[inline(always)] fn div(a: Self, n: u32) -> Self { a / (n as $t) }
        }
    )*};
}
float_elem!(f32, f64);

/// A 16-bit float type reduced in f32: how one lane (16 bits of a `u32` word) widens and narrows.
/// The word-wise helpers below work on the two lanes of each word of a pack without going
/// through memory (the lane-by-lane default of [`Elem`] goes through a stack copy of the pack).
trait Half16: Elem {
    /// The lane's bits as f32, exactly.
    fn widen(bits: u32) -> f32;
    /// f32 rounded to nearest even, as the lane's bits (in the low 16 bits).
    fn narrow(x: f32) -> u32;

    /// `f` over both lanes of two words, each result rounded once.
    #[inline(always)]
    fn map2(a: u32, b: u32, f: impl Fn(f32, f32) -> f32) -> u32 {
        let lo = f(Self::widen(a & 0xffff), Self::widen(b & 0xffff));
        let hi = f(Self::widen(a >> 16), Self::widen(b >> 16));
        Self::narrow(lo) | Self::narrow(hi) << 16
    }

    /// Per lane, `b`'s bits where `take_b(a, b)` holds (compared in f32), else `a`'s.
    #[inline(always)]
    fn pick2(a: u32, b: u32, take_b: impl Fn(f32, f32) -> bool) -> u32 {
        let lo = if take_b(Self::widen(a & 0xffff), Self::widen(b & 0xffff)) {
            b
        } else {
            a
        };
        let hi = if take_b(Self::widen(a >> 16), Self::widen(b >> 16)) {
            b
        } else {
            a
        };
        (lo & 0xffff) | (hi & 0xffff_0000)
    }

    #[inline(always)]
    fn min_words(a: Pack, b: Pack) -> Pack {
        Pack(unroll::words4!(|i| {
            Self::pick2(a.0[i], b.0[i], |x, y| y < x)
        }))
    }
    #[inline(always)]
    fn max_words(a: Pack, b: Pack) -> Pack {
        Pack(unroll::words4!(|i| {
            Self::pick2(a.0[i], b.0[i], |x, y| y > x)
        }))
    }
    #[inline(always)]
    fn div_words(a: Pack, n: u32) -> Pack {
        let n = n as f32;
        Pack(unroll::words4!(|i| Self::map2(a.0[i], 0, |x, _| x / n)))
    }
}

impl Half16 for f16 {
    /// `cvt.f32.f16` on the GPU.
    #[inline(always)]
    fn widen(bits: u32) -> f32 {
        arch::f16_to_f32(bits as u16)
    }
    /// `cvt.rn.f16.f32` on the GPU.
    #[inline(always)]
    fn narrow(x: f32) -> u32 {
        arch::f32_to_f16(x) as u32
    }
}

impl Half16 for bf16 {
    /// A shift: bfloat16 is the top half of an f32.
    #[inline(always)]
    fn widen(bits: u32) -> f32 {
        f32::from_bits(bits << 16)
    }
    /// The bits of `bf16::from_f32` without its branches: add `0x7fff` plus the kept lowest bit
    /// and truncate (a NaN stays a NaN, its quiet bit set as `from_f32` does).
    #[inline(always)]
    fn narrow(x: f32) -> u32 {
        let u = x.to_bits();
        if u & 0x7fff_ffff > 0x7f80_0000 {
            (u >> 16) | 0x40
        } else {
            u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16
        }
    }
}

/// The scalar operations and the packed overrides of a [`Half16`] type; `$sum` / `$prod` are the
/// packed sum and product over two words. A scalar operation is the word-wise one on the low
/// lane (the element-wise tail of the kernels).
macro_rules! half_elem {
    ($t:ty, $sum:expr, $prod:expr) => {
        impl Elem for $t {
            type Line = <Width<{ core::mem::size_of::<$t>() }> as LineOfWidth>::Idx;
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                <$t>::from_bits(Self::map2(a.to_bits().into(), b.to_bits().into(), |x, y| x + y) as u16)
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                <$t>::from_bits(Self::map2(a.to_bits().into(), b.to_bits().into(), |x, y| x * y) as u16)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                <$t>::from_bits(Self::pick2(a.to_bits().into(), b.to_bits().into(), |x, y| y < x) as u16)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                <$t>::from_bits(Self::pick2(a.to_bits().into(), b.to_bits().into(), |x, y| y > x) as u16)
            }
            #[inline(always)]
            fn div(a: Self, n: u32) -> Self {
                <$t>::from_bits(Self::map2(a.to_bits().into(), 0, |x, _| x / n as f32) as u16)
            }
            #[inline(always)]
            fn sum_pack(a: Pack, b: Pack) -> Pack {
                Pack(unroll::words4!(|i| $sum(a.0[i], b.0[i])))
            }
            #[inline(always)]
            fn prod_pack(a: Pack, b: Pack) -> Pack {
                Pack(unroll::words4!(|i| $prod(a.0[i], b.0[i])))
            }
            #[inline(always)]
            fn min_pack(a: Pack, b: Pack) -> Pack {
                Self::min_words(a, b)
            }
            #[inline(always)]
            fn max_pack(a: Pack, b: Pack) -> Pack {
                Self::max_words(a, b)
            }
            #[inline(always)]
            fn div_pack(a: Pack, n: u32) -> Pack {
                Self::div_words(a, n)
            }
        }
    };
}

half_elem!(f16, arch::f16x2_add, arch::f16x2_mul);
half_elem!(bf16, |a, b| <bf16 as Half16>::map2(a, b, |x, y| x + y), |a, b| {
    <bf16 as Half16>::map2(a, b, |x, y| x * y)
});

/// `f` over the four fp8 lanes of two words, lanes paired into binary16x2 words.
#[inline(always)]
fn fp8_map4<T: fp8::Fp8>(a: u32, b: u32, f: impl Fn(u32, u32) -> u32) -> u32 {
    let (alo, ahi) = fp8::widen4::<T>(a);
    let (blo, bhi) = fp8::widen4::<T>(b);
    fp8::narrow4::<T>(f(alo, blo), f(ahi, bhi))
}

/// Per binary16 lane of two words, `b`'s lane where `take_b(a, b)` holds for their values,
/// else `a`'s; a NaN on either side keeps `a` (as the 16-bit types' f32 comparisons do).
/// Compared as integers (sign and magnitude to two's complement, so ±0 are equal).
#[inline(always)]
fn h16_pick2(a: u32, b: u32, take_b: impl Fn(i32, i32) -> bool) -> u32 {
    let nan = |h: u32| h & 0x7fff > 0x7c00;
    let key = |h: u32| {
        let m = (h & 0x7fff) as i32;
        if h & 0x8000 != 0 { -m } else { m }
    };
    let pick = |x: u32, y: u32| {
        if !nan(x) && !nan(y) && take_b(key(x), key(y)) { y } else { x }
    };
    pick(a & 0xffff, b & 0xffff) | pick(a >> 16, b >> 16) << 16
}

#[inline(always)]
fn h16_min2(a: u32, b: u32) -> u32 {
    h16_pick2(a, b, |x, y| y < x)
}

#[inline(always)]
fn h16_max2(a: u32, b: u32) -> u32 {
    h16_pick2(a, b, |x, y| y > x)
}

/// Each fp8 lane divided by `n`: in f32, rounded to binary16, then to fp8.
#[inline(always)]
fn fp8_div4<T: fp8::Fp8>(a: u32, n: u32) -> u32 {
    let n = n as f32;
    let d = |h: u32| {
        let lo = arch::f32_to_f16(arch::f16_to_f32(h as u16) / n) as u32;
        let hi = arch::f32_to_f16(arch::f16_to_f32((h >> 16) as u16) / n) as u32;
        lo | hi << 16
    };
    let (lo, hi) = fp8::widen4::<T>(a);
    fp8::narrow4::<T>(d(lo), d(hi))
}

/// The fp8 types (NCCL's reductions of `__nv_fp8_e4m3` / `__nv_fp8_e5m2`): each lane widens to
/// binary16, the operation rounds once in binary16 (packed `add.rn.f16x2` / `mul.rn.f16x2` on the
/// GPU, as `__hadd2` / `__hmul2`), and the result narrows back, nearest even and satfinite
/// ([`crate::fp8`]). Min and max pick one operand in binary16 (a NaN operand keeps the first, as
/// the 16-bit types' comparisons do) and narrow it back as NCCL's `__hmin`/`__hmax` results are:
/// a value is itself, E5M2's infinity saturates, a NaN becomes `0x7f`. Avg's division runs in f32
/// and rounds to binary16, then to fp8. [`FuncAny`]'s packs widen and narrow once whatever the
/// operator ([`Elem::any_pack`]).
macro_rules! fp8_elem {
    ($t:ty) => {
        impl Elem for $t {
            type Line = <Width<{ core::mem::size_of::<$t>() }> as LineOfWidth>::Idx;
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                Self(fp8_map4::<Self>(a.0.into(), b.0.into(), arch::f16x2_add) as u8)
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                Self(fp8_map4::<Self>(a.0.into(), b.0.into(), arch::f16x2_mul) as u8)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Self(fp8_map4::<Self>(a.0.into(), b.0.into(), h16_min2) as u8)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Self(fp8_map4::<Self>(a.0.into(), b.0.into(), h16_max2) as u8)
            }
            #[inline(always)]
            fn div(a: Self, n: u32) -> Self {
                Self(fp8_div4::<Self>(a.0.into(), n) as u8)
            }
            #[inline(always)]
            fn sum_pack(a: Pack, b: Pack) -> Pack {
                Pack(unroll::rolled4(a.0, b.0, |x, y| fp8_map4::<Self>(x, y, arch::f16x2_add)))
            }
            #[inline(always)]
            fn prod_pack(a: Pack, b: Pack) -> Pack {
                Pack(unroll::rolled4(a.0, b.0, |x, y| fp8_map4::<Self>(x, y, arch::f16x2_mul)))
            }
            #[inline(always)]
            fn min_pack(a: Pack, b: Pack) -> Pack {
                Pack(unroll::rolled4(a.0, b.0, |x, y| fp8_map4::<Self>(x, y, h16_min2)))
            }
            #[inline(always)]
            fn max_pack(a: Pack, b: Pack) -> Pack {
                Pack(unroll::rolled4(a.0, b.0, |x, y| fp8_map4::<Self>(x, y, h16_max2)))
            }
            #[inline(always)]
            fn div_pack(a: Pack, n: u32) -> Pack {
                Pack(unroll::rolled4(a.0, a.0, |x, _| fp8_div4::<Self>(x, n)))
            }
            #[inline(always)]
            fn any_pack(op: u32, a: Pack, b: Pack) -> Pack {
                Pack(unroll::rolled4(a.0, b.0, |a, b| {
                    fp8_map4::<Self>(a, b, |x, y| match op {
                        OP_PROD => arch::f16x2_mul(x, y),
                        OP_MAX => h16_max2(x, y),
                        OP_MIN => h16_min2(x, y),
                        _ => arch::f16x2_add(x, y),
                    })
                }))
            }
        }
    };
}

fp8_elem!(F8E4M3);
fp8_elem!(F8E5M2);

/// A binary reduction operator over `T`. Every method takes the call's operands ([`OpArgs`]):
/// the fixed operators ignore them (their code is a constant, so only it is compiled in), while
/// [`FuncAny`] reads the call's operator from them.
pub trait RedFn<T: Elem>: Copy {
    /// True for [`FuncAny`]: the operator is the call's, read at run time, so every operator's
    /// code is in the kernel.
    const RUNTIME_OP: bool = false;

    /// True for PreMulSum: this rank's input is multiplied by the call's scalar
    /// ([`OpArgs::scalar`]) before it is combined (NCCL's `applyPreOp` of `FuncPreMulSum`).
    const PRE_MUL: bool = false;

    /// Whether this rank's input is scaled before it is combined: [`Self::PRE_MUL`] for the
    /// fixed operators (a constant), the call's operator for [`FuncAny`].
    #[inline(always)]
    fn pre_mul(_args: &OpArgs) -> bool {
        Self::PRE_MUL
    }

    fn apply(args: &OpArgs, a: T, b: T) -> T;

    /// Lane-wise [`Self::apply`] over two packs.
    #[inline(always)]
    fn apply_pack(args: &OpArgs, a: Pack, b: Pack) -> Pack {
        lanes::<T>(a, b, |x, y| Self::apply(args, x, y))
    }
}

/// Lane-wise `x / n` over a pack (Avg's post-operation).
#[inline(always)]
pub fn div_pack<T: Elem>(a: Pack, n: u32) -> Pack {
    T::div_pack(a, n)
}

/// The per-call operands of a reduction (NCCL's `redOpArg`), carried by every protocol's
/// primitives: Avg's post-division and PreMulSum's scalar.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpArgs {
    /// Divide the final value by this (Avg: `nranks`); 0 means no post-division.
    pub postdiv: u32,
    /// The call's operator as a [`DevRedOp`] value (Avg as Sum: its division is
    /// [`Self::postdiv`]); only [`FuncAny`] reads it.
    pub op: u32,
    /// PreMulSum's scalar, replicated in every lane of the pack (unused by other operators).
    pub scalar: Pack,
}

impl OpArgs {
    /// Operands of operator `op` (Avg reduces as Sum) with a post-division by `postdiv` (0:
    /// none) and no scalar.
    pub const fn new(op: DevRedOp, postdiv: u32) -> Self {
        let op = match op {
            DevRedOp::Avg => DevRedOp::Sum,
            op => op,
        };
        OpArgs {
            postdiv,
            op: op as u32,
            scalar: Pack([0; 4]),
        }
    }

    /// The scalar from its raw bits (the low `size_of::<T>()` bytes of `bits`), replicated in
    /// every lane of [`Self::scalar`].
    #[inline(always)]
    pub fn with_scalar_bits<T: Elem>(mut self, bits: u64) -> Self {
        let (lo, hi) = match core::mem::size_of::<T>() {
            1 => (
                (bits as u32 & 0xff) * 0x0101_0101,
                (bits as u32 & 0xff) * 0x0101_0101,
            ),
            2 => (
                (bits as u32 & 0xffff) * 0x0001_0001,
                (bits as u32 & 0xffff) * 0x0001_0001,
            ),
            4 => (bits as u32, bits as u32),
            _ => (bits as u32, (bits >> 32) as u32),
        };
        self.scalar = Pack([lo, hi, lo, hi]);
        self
    }

    /// The scalar as one element.
    #[inline(always)]
    pub fn scalar_elem<T: Elem>(&self) -> T {
        // SAFETY: a Pack holds 16 bytes, 16-aligned, and every `T` is at most 8 bytes.
        unsafe { (&self.scalar as *const Pack as *const T).read() }
    }
}

/// This rank's input pack as it enters the reduction: times the scalar for PreMulSum, unchanged
/// for every other operator (the test is a constant, so it costs them nothing).
#[inline(always)]
pub fn pre_pack<T: Elem, Op: RedFn<T>>(x: Pack, args: &OpArgs) -> Pack {
    if Op::pre_mul(args) {
        T::prod_pack(x, args.scalar)
    } else {
        x
    }
}

/// [`pre_pack`] for one element.
#[inline(always)]
pub fn pre_elem<T: Elem, Op: RedFn<T>>(x: T, args: &OpArgs) -> T {
    if Op::pre_mul(args) {
        T::prod(x, args.scalar_elem::<T>())
    } else {
        x
    }
}

#[derive(Clone, Copy)]
pub struct FuncSum;
/// PreMulSum (NCCL's `ncclRedOpCreatePreMulSum`): the sum of every rank's input times its scalar.
#[derive(Clone, Copy)]
pub struct FuncPreMulSum;
#[derive(Clone, Copy)]
pub struct FuncProd;
#[derive(Clone, Copy)]
pub struct FuncMin;
#[derive(Clone, Copy)]
pub struct FuncMax;

impl<T: Elem> RedFn<T> for FuncSum {
    #[inline(always)]
    fn apply(_: &OpArgs, a: T, b: T) -> T {
        T::sum(a, b)
    }
    #[inline(always)]
    fn apply_pack(_: &OpArgs, a: Pack, b: Pack) -> Pack {
        T::sum_pack(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncPreMulSum {
    const PRE_MUL: bool = true;
    #[inline(always)]
    fn apply(_: &OpArgs, a: T, b: T) -> T {
        T::sum(a, b)
    }
    #[inline(always)]
    fn apply_pack(_: &OpArgs, a: Pack, b: Pack) -> Pack {
        T::sum_pack(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncProd {
    #[inline(always)]
    fn apply(_: &OpArgs, a: T, b: T) -> T {
        T::prod(a, b)
    }
    #[inline(always)]
    fn apply_pack(_: &OpArgs, a: Pack, b: Pack) -> Pack {
        T::prod_pack(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncMin {
    #[inline(always)]
    fn apply(_: &OpArgs, a: T, b: T) -> T {
        T::min(a, b)
    }
    #[inline(always)]
    fn apply_pack(_: &OpArgs, a: Pack, b: Pack) -> Pack {
        T::min_pack(a, b)
    }
}
impl<T: Elem> RedFn<T> for FuncMax {
    #[inline(always)]
    fn apply(_: &OpArgs, a: T, b: T) -> T {
        T::max(a, b)
    }
    #[inline(always)]
    fn apply_pack(_: &OpArgs, a: Pack, b: Pack) -> Pack {
        T::max_pack(a, b)
    }
}

/// The operator the call names at run time ([`OpArgs::op`]), applied with the same per-type
/// functions ([`Elem`]) the fixed operators use.
///
/// On the GPU, Sum (and Avg) has its own kernel per (collective, algorithm, protocol, type),
/// with the operator a constant; Prod, Min, Max and PreMulSum share one kernel of this operator,
/// which picks the call's operation per pack (a branch every thread of the block takes the same
/// way). That keeps the kernel build 2.4 times smaller than one kernel per operator. The host
/// runs every operator through this one, one entry body per (collective, algorithm, protocol,
/// type).
#[derive(Clone, Copy)]
pub struct FuncAny;

const OP_PROD: u32 = DevRedOp::Prod as u32;
const OP_MAX: u32 = DevRedOp::Max as u32;
const OP_MIN: u32 = DevRedOp::Min as u32;
const OP_PRE_MUL_SUM: u32 = DevRedOp::PreMulSum as u32;

impl<T: Elem> RedFn<T> for FuncAny {
    const RUNTIME_OP: bool = true;
    #[inline(always)]
    fn pre_mul(args: &OpArgs) -> bool {
        args.op == OP_PRE_MUL_SUM
    }
    #[inline(always)]
    fn apply(args: &OpArgs, a: T, b: T) -> T {
        match args.op {
            OP_PROD => T::prod(a, b),
            OP_MAX => T::max(a, b),
            OP_MIN => T::min(a, b),
            _ => T::sum(a, b),
        }
    }
    #[inline(always)]
    fn apply_pack(args: &OpArgs, a: Pack, b: Pack) -> Pack {
        T::any_pack(args.op, a, b)
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
        let args = OpArgs::new(DevRedOp::Sum, 0);
        assert_eq!(<FuncSum as RedFn<u32>>::apply_pack(&args, a, b), Pack([11, 22, 33, 44]));
        assert_eq!(<FuncMax as RedFn<u32>>::apply_pack(&args, a, b), b);
        let h = |x: f32| f16::from_f32(x).to_bits() as u32;
        let a = Pack([h(1.0) | h(2.0) << 16, 0, 0, 0]);
        let b = Pack([h(3.0) | h(4.0) << 16, 0, 0, 0]);
        assert_eq!(
            <FuncSum as RedFn<f16>>::apply_pack(&args, a, b).0[0],
            h(4.0) | h(6.0) << 16
        );
        assert_eq!(div_pack::<u32>(Pack([9, 8, 7, 6]), 2), Pack([4, 4, 3, 3]));
    }

    /// `FuncAny` with the call's operator gives the bits of that operator's fixed type, element
    /// by element and pack by pack, and scales the input only for PreMulSum.
    #[test]
    fn any_applies_the_calls_operator() {
        fn check<T: Elem + PartialEq + core::fmt::Debug>(a: T, b: T, pa: Pack, pb: Pack) {
            let cases: [(DevRedOp, fn(T, T) -> T, fn(Pack, Pack) -> Pack); 6] = [
                (DevRedOp::Sum, T::sum, T::sum_pack),
                (DevRedOp::Avg, T::sum, T::sum_pack),
                (DevRedOp::Prod, T::prod, T::prod_pack),
                (DevRedOp::Max, T::max, T::max_pack),
                (DevRedOp::Min, T::min, T::min_pack),
                (DevRedOp::PreMulSum, T::sum, T::sum_pack),
            ];
            for (op, f, fp) in cases {
                let args = OpArgs::new(op, 0);
                assert_eq!(<FuncAny as RedFn<T>>::apply(&args, a, b), f(a, b), "{op:?}");
                assert_eq!(<FuncAny as RedFn<T>>::apply_pack(&args, pa, pb), fp(pa, pb), "{op:?}");
                assert_eq!(<FuncAny as RedFn<T>>::pre_mul(&args), op == DevRedOp::PreMulSum, "{op:?}");
            }
        }
        let (pa, pb) = (Pack([7, 0x8000_0001, 3, 0xffff_fff0]), Pack([5, 2, 0x7fff_ffff, 9]));
        check::<i8>(-3, 5, pa, pb);
        check::<u8>(200, 100, pa, pb);
        check::<i32>(-7, 6, pa, pb);
        check::<u64>(u64::MAX, 3, pa, pb);
        check::<f32>(1.5, -2.25, Pack([1.5f32.to_bits(), 2.0f32.to_bits(), 0, 3.0f32.to_bits()]), pb);
        check::<f64>(0.5, 8.0, pa, pb);
        check::<f16>(f16::from_f32(1.5), f16::from_f32(-4.0), pa, pb);
        check::<bf16>(bf16::from_f32(3.0), bf16::from_f32(0.25), pa, pb);
        check::<F8E4M3>(F8E4M3(0x38), F8E4M3(0xc4), pa, pb);
        check::<F8E5M2>(F8E5M2(0x3c), F8E5M2(0x7c), pa, pb);
        // The fixed operators' PreMulSum flag is their constant.
        let args = OpArgs::new(DevRedOp::PreMulSum, 0);
        assert!(<FuncPreMulSum as RedFn<f32>>::pre_mul(&args));
        assert!(!<FuncSum as RedFn<f32>>::pre_mul(&args));
    }

    /// fp8 reductions as NCCL's: binary16 arithmetic, then nearest-even and satfinite rounding;
    /// a pack's lanes give each lane's scalar result.
    #[test]
    fn fp8_reduce_through_binary16_and_saturate() {
        let e4 = |x: f64| F8E4M3::from_f64(x);
        assert_eq!(F8E4M3::sum(e4(16.0), e4(1.0)), e4(16.0)); // 17: a tie, to even
        assert_eq!(F8E4M3::sum(e4(16.0), e4(3.0)), e4(20.0)); // 19 → 20
        assert_eq!(F8E4M3::sum(e4(448.0), e4(448.0)), F8E4M3(0x7e)); // satfinite
        assert_eq!(F8E4M3::sum(e4(-448.0), e4(-32.0)), F8E4M3(0xfe));
        assert_eq!(F8E4M3::sum(F8E4M3(0x7f), e4(1.0)), F8E4M3(0x7f)); // NaN stays NaN
        assert_eq!(F8E4M3::prod(e4(-3.0), e4(7.0)), e4(-20.0)); // -21: a tie, to even
        assert_eq!(F8E4M3::prod(e4(1.0 / 512.0), e4(0.25)), e4(0.0)); // underflow to +0
        assert_eq!(F8E4M3::max(e4(-2.0), e4(1.5)), e4(1.5));
        assert_eq!(F8E4M3::min(e4(-2.0), e4(1.5)), e4(-2.0));
        assert_eq!(F8E4M3::div(e4(7.0), 2), e4(3.5));
        let e5 = |x: f64| F8E5M2::from_f64(x);
        assert_eq!(F8E5M2::sum(e5(8.0), e5(1.0)), e5(8.0)); // 9: a tie, to even
        assert_eq!(F8E5M2::sum(e5(57344.0), e5(57344.0)), F8E5M2(0x7b)); // inf in binary16 → max
        assert_eq!(F8E5M2::prod(e5(3.0), e5(3.0)), e5(8.0)); // 9 → 8
        // Min and max narrow their pick as NCCL's `__hmax` results are: infinity saturates, a
        // NaN operand (kept when first) becomes 0x7f, -0 and +0 compare equal.
        assert_eq!(F8E5M2::max(F8E5M2(0x7c), e5(1.0)), F8E5M2(0x7b));
        assert_eq!(F8E5M2::min(F8E5M2(0xfc), e5(1.0)), F8E5M2(0xfb));
        assert_eq!(F8E4M3::max(F8E4M3(0xff), e4(1.0)), F8E4M3(0x7f));
        assert_eq!(F8E4M3::max(e4(1.0), F8E4M3(0x7f)), e4(1.0));
        assert_eq!(F8E4M3::min(F8E4M3(0x80), F8E4M3(0x00)), F8E4M3(0x80));
        // Pack ops are the scalar ops lane by lane.
        let bytes: [u8; 32] = core::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(11));
        let pack = |b: &[u8]| Pack(core::array::from_fn(|w| u32::from_le_bytes(b[4 * w..4 * w + 4].try_into().unwrap())));
        let (pa, pb) = (pack(&bytes[..16]), pack(&bytes[16..]));
        fn lanes_of<T: Elem + Copy>(p: Pack, f: impl Fn(u8) -> T, g: impl Fn(T) -> u8) -> [u8; 16] {
            let b: [u8; 16] = core::array::from_fn(|i| (p.0[i / 4] >> (8 * (i % 4))) as u8);
            b.map(|x| g(f(x)))
        }
        for (name, fp, fs) in [
            ("sum", F8E4M3::sum_pack as fn(Pack, Pack) -> Pack, F8E4M3::sum as fn(F8E4M3, F8E4M3) -> F8E4M3),
            ("prod", F8E4M3::prod_pack, F8E4M3::prod),
            ("min", F8E4M3::min_pack, F8E4M3::min),
            ("max", F8E4M3::max_pack, F8E4M3::max),
        ] {
            let got = lanes_of(fp(pa, pb), F8E4M3, |x| x.0);
            let a = lanes_of(pa, F8E4M3, |x| x.0);
            let b = lanes_of(pb, F8E4M3, |x| x.0);
            let want: [u8; 16] = core::array::from_fn(|i| fs(F8E4M3(a[i]), F8E4M3(b[i])).0);
            assert_eq!(got, want, "{name}");
        }
        let got = lanes_of(F8E5M2::sum_pack(pa, pb), F8E5M2, |x| x.0);
        let a = lanes_of(pa, F8E5M2, |x| x.0);
        let b = lanes_of(pb, F8E5M2, |x| x.0);
        assert_eq!(got, core::array::from_fn(|i| F8E5M2::sum(F8E5M2(a[i]), F8E5M2(b[i])).0));
        let got = lanes_of(F8E4M3::div_pack(pa, 3), F8E4M3, |x| x.0);
        assert_eq!(got, core::array::from_fn(|i| F8E4M3::div(F8E4M3(a[i]), 3).0));
    }
}
