//! The two 8-bit float types of NCCL 2.24+ (`ncclFloat8e4m3` = 10, `ncclFloat8e5m2` = 11; CUDA's
//! `__nv_fp8_e4m3` and `__nv_fp8_e5m2`, the OCP 8-bit formats) and their conversions, the same
//! code on the GPU and on the CPU target.
//!
//! - [`F8E4M3`]: 1 sign, 4 exponent (bias 7) and 3 mantissa bits; no infinities, one NaN per sign
//!   (`S.1111.111`); largest finite 448, smallest subnormal 2^-9.
//! - [`F8E5M2`]: 1 sign, 5 exponent (bias 15) and 2 mantissa bits, IEEE-like (infinities, NaNs);
//!   the top byte of a binary16; largest finite 57344, smallest subnormal 2^-16.
//!
//! Arithmetic follows NCCL's reductions (`reduce_kernel.h`): both operands widen to binary16
//! (exact), the operation rounds once in binary16 (`__hadd`, `__hmul`), and the result narrows
//! back with CUDA's `__nv_fp8_e4m3(__half)` rule: round to nearest even, *satfinite* (a finite
//! result past the largest finite value, and ±infinity, become ±the largest finite value), NaN
//! stays NaN (`0x7f`). The kernels do the conversions with integer instructions, so they run on
//! every architecture; the host refuses reductions on GPUs before sm_90 as NCCL does.
use crate::arch;

/// An fp8 E4M3 value (NCCL's `ncclFloat8e4m3`) as its bits.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct F8E4M3(pub u8);

/// An fp8 E5M2 value (NCCL's `ncclFloat8e5m2`) as its bits.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct F8E5M2(pub u8);

/// How one fp8 format widens to and narrows from binary16 (bits in the low bits of a `u32`).
pub trait Fp8: Copy {
    /// The format's bits.
    fn to_bits(self) -> u8;
    /// The value of bits `b`.
    fn from_bits(b: u8) -> Self;
    /// The binary16 bits of the value of fp8 bits `b` (exact; a NaN becomes a binary16 NaN).
    fn widen(b: u32) -> u32;
    /// The fp8 bits nearest to binary16 bits `h` (ties to even, satfinite, NaN → `0x7f`).
    fn narrow(h: u32) -> u32;
    /// Largest finite value.
    const MAX: f64;
}

impl Fp8 for F8E4M3 {
    const MAX: f64 = 448.0;
    #[inline(always)]
    fn to_bits(self) -> u8 {
        self.0
    }
    #[inline(always)]
    fn from_bits(b: u8) -> Self {
        F8E4M3(b)
    }
    #[inline(always)]
    fn widen(b: u32) -> u32 {
        let sign = (b & 0x80) << 8;
        let mag = b & 0x7f;
        let h = if mag == 0x7f {
            0x7fff
        } else if mag >= 0x08 {
            // Normal: the exponent rebiases from 7 to 15 (+8 << 10), the mantissa moves up 7 bits.
            (mag << 7) + (8 << 10)
        } else {
            // Subnormal m × 2^-9 is a binary16 normal: its bits for m = 0..7, four per constant.
            let t: u64 = if mag < 4 {
                0x1e00_1c00_1800_0000
            } else {
                0x2300_2200_2100_2000
            };
            ((t >> ((mag & 3) * 16)) & 0xffff) as u32
        };
        sign | h
    }
    #[inline(always)]
    fn narrow(h: u32) -> u32 {
        let sign = (h >> 8) & 0x80;
        let a = h & 0x7fff;
        // Normal in E4M3 (≥ 2^-6, binary16 0x2400): keep 3 of the 10 mantissa bits rounded
        // (a carry moves into the exponent), rebias by -8 << 3, and saturate at 448 (0x7e;
        // infinity too).
        let normal = (rne(a, 7).wrapping_sub(8 << 3)).min(0x7e);
        // Below: a subnormal, the value in units of 2^-9 rounded to an integer (8 is the
        // smallest normal, 0x08): scaled exactly by 512 in f32 and rounded by adding 2^23, whose
        // low mantissa bits then hold the integer (nearest even).
        let sub = (arch::f16_to_f32(a as u16) * 512.0 + 8_388_608.0).to_bits() & 0x7f_ffff;
        let q = if a >= 0x2400 { normal } else { sub };
        if a > 0x7c00 { 0x7f } else { sign | q }
    }
}

impl Fp8 for F8E5M2 {
    const MAX: f64 = 57344.0;
    #[inline(always)]
    fn to_bits(self) -> u8 {
        self.0
    }
    #[inline(always)]
    fn from_bits(b: u8) -> Self {
        F8E5M2(b)
    }
    #[inline(always)]
    fn widen(b: u32) -> u32 {
        (b & 0xff) << 8
    }
    #[inline(always)]
    fn narrow(h: u32) -> u32 {
        let sign = (h >> 8) & 0x80;
        let a = h & 0x7fff;
        // The same exponent layout: drop 8 mantissa bits, rounded; saturate at 57344 (0x7b;
        // infinity too).
        let q = rne(a, 8).min(0x7b);
        if a > 0x7c00 { 0x7f } else { sign | q }
    }
}

/// `x >> shift` rounded to nearest, ties to even (`1 ≤ shift < 16`, `x < 2^31`): adding half
/// less one, plus the kept lowest bit, carries exactly when the dropped bits round up.
#[inline(always)]
fn rne(x: u32, shift: u32) -> u32 {
    (x + (1 << (shift - 1)) - 1 + ((x >> shift) & 1)) >> shift
}

/// The four fp8 lanes of word `w` as two binary16x2 words (lanes 0, 1 and lanes 2, 3).
#[inline(always)]
pub fn widen4<T: Fp8>(w: u32) -> (u32, u32) {
    (
        T::widen(w & 0xff) | T::widen((w >> 8) & 0xff) << 16,
        T::widen((w >> 16) & 0xff) | T::widen(w >> 24) << 16,
    )
}

/// [`widen4`]'s inverse: four binary16 lanes narrowed into one word of fp8 lanes.
#[inline(always)]
pub fn narrow4<T: Fp8>(lo: u32, hi: u32) -> u32 {
    T::narrow(lo & 0xffff)
        | T::narrow(lo >> 16) << 8
        | T::narrow(hi & 0xffff) << 16
        | T::narrow(hi >> 16) << 24
}

/// `x` rounded to the format (nearest, ties to even, satfinite; NaN → `0x7f`) in one rounding,
/// for host code (test data, PreMulSum scalars).
pub fn from_f64<T: Fp8>(x: f64, ebits: u32, mbits: u32) -> T {
    let bias = (1i32 << (ebits - 1)) - 1;
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return T::from_bits(0x7f);
    }
    let a = if x < 0.0 { -x } else { x };
    if a >= T::MAX {
        return T::from_bits(sign | T::narrow(0x7c00) as u8);
    }
    // The exponent of `a` (never below the smallest normal's), and `a` in units of the format's
    // quantum at that exponent: a power-of-two scaling, exact in f64.
    let emin = 1 - bias;
    let e = if a == 0.0 {
        emin
    } else {
        (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin)
    };
    let qexp = e - mbits as i32;
    let n = a * f64::from_bits(((1023 - qexp) as u64) << 52);
    let t = n as u64;
    let frac = n - t as f64;
    let mut m = t + u64::from(frac > 0.5 || (frac == 0.5 && t & 1 == 1));
    let mut e = e;
    if m == 2 << mbits {
        m = 1 << mbits;
        e += 1;
    }
    let code = if m < 1 << mbits {
        m as u32
    } else {
        (((e + bias) as u32) << mbits) | (m as u32 - (1 << mbits))
    };
    T::from_bits(sign | code as u8)
}

/// The value of `x`'s bits as f64 (exact), for host code.
pub fn to_f64<T: Fp8>(x: T) -> f64 {
    let h = T::widen(x.to_bits() as u32);
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = ((h >> 10) & 0x1f) as i32;
    let m = (h & 0x3ff) as f64;
    if e == 0x1f {
        return if m == 0.0 { sign * f64::INFINITY } else { f64::NAN };
    }
    let v = if e == 0 {
        m / 16_777_216.0
    } else {
        (1024.0 + m) * pow2(e - 25)
    };
    sign * v
}

fn pow2(e: i32) -> f64 {
    f64::from_bits(((1023 + e) as u64) << 52)
}

impl F8E4M3 {
    /// `x` rounded to E4M3 (nearest even, satfinite).
    pub fn from_f64(x: f64) -> Self {
        from_f64(x, 4, 3)
    }
    /// The value as f64 (exact).
    pub fn to_f64(self) -> f64 {
        to_f64(self)
    }
}

impl F8E5M2 {
    /// `x` rounded to E5M2 (nearest even, satfinite).
    pub fn from_f64(x: f64) -> Self {
        from_f64(x, 5, 2)
    }
    /// The value as f64 (exact).
    pub fn to_f64(self) -> f64 {
        to_f64(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn e4m3_values() {
        assert_eq!(F8E4M3(0x7e).to_f64(), 448.0);
        assert_eq!(F8E4M3(0x01).to_f64(), 1.0 / 512.0);
        assert_eq!(F8E4M3(0x07).to_f64(), 7.0 / 512.0);
        assert_eq!(F8E4M3(0x08).to_f64(), 1.0 / 64.0);
        assert_eq!(F8E4M3(0x38).to_f64(), 1.0);
        assert_eq!(F8E4M3(0xc0).to_f64(), -2.0);
        assert!(F8E4M3(0x7f).to_f64().is_nan());
        assert!(F8E4M3(0xff).to_f64().is_nan());
        assert_eq!(F8E4M3::from_f64(1.0e9), F8E4M3(0x7e));
        assert_eq!(F8E4M3::from_f64(-f64::INFINITY), F8E4M3(0xfe));
        assert_eq!(F8E4M3::from_f64(464.0), F8E4M3(0x7e));
        // 17 lies halfway between 16 (0x58) and 18 (0x59): ties to even.
        assert_eq!(F8E4M3::from_f64(17.0), F8E4M3(0x58));
        assert_eq!(F8E4M3::from_f64(19.0), F8E4M3(0x5a));
        assert_eq!(F8E4M3::from_f64(1.0 / 1024.0), F8E4M3(0x00));
        assert_eq!(F8E4M3::from_f64(3.0 / 1024.0), F8E4M3(0x02));
        assert_eq!(F8E4M3::from_f64(-0.0), F8E4M3(0x80));
        assert_eq!(F8E4M3::from_f64(f64::NAN), F8E4M3(0x7f));
    }

    #[test]
    fn e5m2_values() {
        assert_eq!(F8E5M2(0x7b).to_f64(), 57344.0);
        assert_eq!(F8E5M2(0x01).to_f64(), 1.0 / 65536.0);
        assert_eq!(F8E5M2(0x3c).to_f64(), 1.0);
        assert_eq!(F8E5M2(0x7c).to_f64(), f64::INFINITY);
        assert_eq!(F8E5M2::from_f64(f64::INFINITY), F8E5M2(0x7b));
        assert_eq!(F8E5M2::from_f64(-70000.0), F8E5M2(0xfb));
        assert_eq!(F8E5M2::from_f64(9.0), F8E5M2(0x48));
        assert_eq!(F8E5M2::from_f64(11.0), F8E5M2(0x4a));
        assert_eq!(F8E5M2::from_f64(f64::NAN), F8E5M2(0x7f));
    }

    /// Every fp8 value widens to the binary16 of the same value, and every binary16 narrows to
    /// the fp8 value that one correct rounding of its value gives.
    fn exhaustive<T: Fp8 + PartialEq + core::fmt::Debug>(ebits: u32, mbits: u32) {
        for b in 0..=255u8 {
            let h = f16::from_bits(T::widen(b as u32) as u16).to_f64();
            let v = to_f64(T::from_bits(b));
            assert!(h == v || (h.is_nan() && v.is_nan()), "widen {b:#04x}: {h} vs {v}");
            if !v.is_nan() {
                assert_eq!(
                    T::narrow(T::widen(b as u32)) as u8,
                    if v.is_infinite() {
                        (b & 0x80) | T::narrow(0x7c00) as u8
                    } else {
                        b
                    },
                    "{b:#04x}"
                );
            }
        }
        for h in 0..=0xffffu32 {
            let x = f16::from_bits(h as u16).to_f64();
            let want = from_f64::<T>(x, ebits, mbits);
            assert_eq!(T::from_bits(T::narrow(h) as u8), want, "narrow {h:#06x} ({x})");
        }
    }

    #[test]
    fn e4m3_conversions_are_exact_and_round_once() {
        exhaustive::<F8E4M3>(4, 3);
    }

    #[test]
    fn e5m2_conversions_are_exact_and_round_once() {
        exhaustive::<F8E5M2>(5, 2);
    }

    #[test]
    fn four_lanes_per_word() {
        let w = 0x38c0_5001u32; // E4M3 lanes 1/512, 8, -2, 1 from the low byte up
        let (lo, hi) = widen4::<F8E4M3>(w);
        assert_eq!(f16::from_bits(lo as u16).to_f64(), 1.0 / 512.0);
        assert_eq!(f16::from_bits((lo >> 16) as u16).to_f64(), 8.0);
        assert_eq!(f16::from_bits(hi as u16).to_f64(), -2.0);
        assert_eq!(f16::from_bits((hi >> 16) as u16).to_f64(), 1.0);
        assert_eq!(narrow4::<F8E4M3>(lo, hi), w);
    }
}
