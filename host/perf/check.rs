//! nccl-tests-style input generation and exact result checking.
//!
//! Every rank's input is a pure function of `(seed, rank, element index)` (a splitmix64 hash), so a
//! wrong offset, a swapped chunk or a rank's data landing in the wrong place changes the result. The
//! values are chosen per operator so that the reduction is exact in **any** order and any
//! association (ring, tree, pairwise), for up to 64 ranks; the check is therefore bitwise, except
//! float `Avg`, where 2 ulps are accepted (the pre-multiply or post-divide precision is
//! unspecified, as in nccl-tests' `verifiable`).
//!
//! | op | integers | floats |
//! |---|---|---|
//! | Sum | 8-bit: small values; 32/64-bit: all bits random (wrapping is order-independent) | signed integers with `nranks × max ≤` the type's exact-integer limit (bf16 256, f16 2048) |
//! | Prod | odd values (wrapping product stays odd, never collapses to 0) | ±1 and ±2, with at most 15 factors of 2 per element for f16 |
//! | Max, Min | all bits random | multiples of 1/8 in [-125, 125] |
//! | Avg | values whose sum cannot overflow, then truncating division | only two ranks per element contribute (non-negative); the others give 0 |
//!
//! Only [`Func::AllReduce`] is implemented; [`fill_input`] and [`expected`] return `None` for the
//! other collectives (see [`supports`]), so they can be added without changing the signatures.
//! All buffers are little-endian arrays of the element type's native layout (f16/bf16 as IEEE half
//! and bfloat16 bit patterns).

use half::{bf16, f16};
use oxccl_gpu::abi::{DataType, Func, RedOp};
use oxccl_gpu::fp8::{F8E4M3, F8E5M2};

/// Whether [`fill_input`] and [`expected`] implement `func` (only [`Func::AllReduce`] for now).
pub const fn supports(func: Func) -> bool {
    matches!(func, Func::AllReduce)
}

/// Input bytes for one rank: `count` elements of `dtype` (so `count × dtype.size()` bytes), the
/// per-rank send buffer of `func` with `count` its per-rank element count (for AllReduce the send
/// and receive buffers both hold `count` elements).
///
/// Values depend on `(seed, rank, index)` and on `op` and `nranks` (see the module table) so that the
/// reduction over ranks `0..nranks` is exact in any order for `nranks ≤ 64`. Returns `None` when
/// `func` is not [supported](supports), `nranks == 0` or `rank >= nranks`.
pub fn fill_input(
    func: Func,
    dtype: DataType,
    op: RedOp,
    rank: usize,
    nranks: usize,
    seed: u64,
    count: usize,
) -> Option<Vec<u8>> {
    if !supports(func) || nranks == 0 || rank >= nranks {
        return None;
    }
    let key = rank_key(seed, rank);
    Some(elems(dtype, count, |i| gen_bits(dtype, op, rank, nranks, i, key)))
}

/// The exact expected output of `func` over the inputs [`fill_input`] gives ranks `0..nranks` with
/// the same `seed`: `count` elements (`count × dtype.size()` bytes). For AllReduce this is what every
/// rank's receive buffer must hold.
///
/// Integers fold with wrapping arithmetic; `Avg` divides the (non-overflowing) sum by `nranks`,
/// truncating toward zero. Floats are folded in f64 (exact for these inputs) and rounded to
/// `dtype` once; `Avg` rounds `sum / nranks` to nearest. Returns `None` when `func` is not
/// [supported](supports) or `nranks == 0`.
pub fn expected(
    func: Func,
    dtype: DataType,
    op: RedOp,
    nranks: usize,
    seed: u64,
    count: usize,
) -> Option<Vec<u8>> {
    if !supports(func) || nranks == 0 {
        return None;
    }
    let keys: Vec<u64> = (0..nranks).map(|r| rank_key(seed, r)).collect();
    Some(elems(dtype, count, |i| {
        let vals = keys
            .iter()
            .enumerate()
            .map(|(r, &key)| gen_bits(dtype, op, r, nranks, i, key));
        fold_bits(dtype, op, nranks, vals)
    }))
}

/// Reference element-wise reduction of arbitrary per-rank buffers, with the same arithmetic as
/// [`expected`] (wrapping integers, f64 for floats, `Avg` divides by `inputs.len()`). Each input
/// holds the same number of whole elements; the result has that many elements. Exact for inputs
/// built like [`fill_input`]'s; for arbitrary floats it is a correctly-rounded-per-step f64 fold.
/// Returns `None` when `inputs` is empty or the lengths differ or are not a multiple of
/// `dtype.size()`.
pub fn reduce_reference(dtype: DataType, op: RedOp, inputs: &[&[u8]]) -> Option<Vec<u8>> {
    let size = dtype.size();
    let len = inputs.first()?.len();
    if len % size != 0 || inputs.iter().any(|b| b.len() != len) {
        return None;
    }
    Some(elems(dtype, len / size, |i| {
        let vals = inputs.iter().map(|b| read_bits(&b[i * size..(i + 1) * size]));
        fold_bits(dtype, op, inputs.len(), vals)
    }))
}

/// Number of mismatching elements between `got` and `expected` (both byte buffers of `dtype`).
///
/// Elements compare bitwise, except float `Avg` with `nranks > 1`, where a difference of up to 2
/// ulps (distance between the bit patterns read as ordered integers) is accepted; a NaN or
/// infinity never matches anything but the identical bit pattern. If the lengths differ, every
/// element present in only one buffer counts as wrong (a trailing partial element counts as one).
pub fn count_wrong(dtype: DataType, op: RedOp, got: &[u8], expected: &[u8], nranks: usize) -> usize {
    let size = dtype.size();
    let common = got.len().min(expected.len()) / size;
    let total = got.len().max(expected.len()).div_ceil(size);
    let tol = tolerance_ulps(dtype, op, nranks);
    let mut wrong = total - common;
    for i in 0..common {
        let range = i * size..(i + 1) * size;
        if !elem_matches(
            dtype,
            read_bits(&got[range.clone()]),
            read_bits(&expected[range]),
            tol,
        ) {
            wrong += 1;
        }
    }
    wrong
}

/// Index (in elements) of the first element [`count_wrong`] would count, or `None` if all match.
pub fn first_wrong(dtype: DataType, op: RedOp, got: &[u8], expected: &[u8], nranks: usize) -> Option<usize> {
    let size = dtype.size();
    let common = got.len().min(expected.len()) / size;
    let tol = tolerance_ulps(dtype, op, nranks);
    let hit = (0..common).find(|&i| {
        let range = i * size..(i + 1) * size;
        !elem_matches(
            dtype,
            read_bits(&got[range.clone()]),
            read_bits(&expected[range]),
            tol,
        )
    });
    match hit {
        Some(i) => Some(i),
        None if got.len() != expected.len() => Some(common),
        None => None,
    }
}

/// Human-readable value of the first element of `bytes` (at least `dtype.size()` bytes), for
/// mismatch reports; `"<short>"` when `bytes` is shorter than one element.
pub fn format_elem(dtype: DataType, bytes: &[u8]) -> String {
    let size = dtype.size();
    if bytes.len() < size {
        return "<short>".to_string();
    }
    let b = read_bits(&bytes[..size]);
    match dtype {
        DataType::I8 => (b as u8 as i8).to_string(),
        DataType::U8 => (b as u8).to_string(),
        DataType::I32 => (b as u32 as i32).to_string(),
        DataType::U32 => (b as u32).to_string(),
        DataType::I64 => (b as i64).to_string(),
        DataType::U64 => b.to_string(),
        DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64 | DataType::F8E4M3 | DataType::F8E5M2 => {
            format!("{} (0x{:0w$x})", float_from_bits(dtype, b), b, w = 2 * size)
        }
    }
}

/// Poison pattern for `count` elements of `dtype` (`count × dtype.size()` bytes), to write into output
/// buffers before a run so unwritten elements are caught: all-ones bytes for floats (a NaN in every
/// float type, which [`count_wrong`] never accepts), `0xA5` bytes for integers.
pub fn poison(dtype: DataType, count: usize) -> Vec<u8> {
    let byte = if dtype.is_float() { 0xFF } else { 0xA5 };
    vec![byte; count.saturating_mul(dtype.size())]
}

// ---------------------------------------------------------------------------------------------
// Value generation.

/// splitmix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn rank_key(seed: u64, rank: usize) -> u64 {
    mix(mix(seed) ^ rank as u64)
}

fn elem_hash(key: u64, i: usize) -> u64 {
    mix(key ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// Largest `L` such that every integer in `[-L, L]` is exact in the float type.
const fn exact_int_limit(dtype: DataType) -> u64 {
    match dtype {
        DataType::F8E5M2 => 1 << 3,
        DataType::F8E4M3 => 1 << 4,
        DataType::Bf16 => 1 << 8,
        DataType::F16 => 1 << 11,
        DataType::F32 => 1 << 24,
        _ => 1 << 53,
    }
}

/// Most factors of 2 a product may hold without overflowing the float type.
const fn max_doublings(dtype: DataType) -> usize {
    match dtype {
        DataType::F8E4M3 => 8,
        DataType::F16 | DataType::F8E5M2 => 15,
        DataType::Bf16 | DataType::F32 => 127,
        _ => 1023,
    }
}

/// Uniform-ish integer in `[-a, a]`, for `a < 2^63` (so `2a + 1` fits in a `u64`): `v − a` for
/// `v = h mod (2a + 1)` in `[0, 2a]`, computed modulo 2^64 (the result fits in an `i64`).
fn signed_in(h: u64, a: u64) -> i64 {
    (h % (2 * a + 1)).wrapping_sub(a) as i64
}

/// The bits (zero-extended `u64`, low `dtype.size()` bytes significant) of element `i` of `rank`.
fn gen_bits(dtype: DataType, op: RedOp, rank: usize, nranks: usize, i: usize, key: u64) -> u64 {
    let h = elem_hash(key, i);
    if dtype.is_float() {
        float_to_bits(dtype, gen_float(dtype, op, rank, nranks, i, h))
    } else {
        gen_int(dtype, op, nranks, h)
    }
}

fn gen_int(dtype: DataType, op: RedOp, nranks: usize, h: u64) -> u64 {
    let signed = matches!(dtype, DataType::I8 | DataType::I32 | DataType::I64);
    let narrow = dtype.size() == 1;
    match op {
        RedOp::Sum if narrow && signed => ((h % 64) as i64 - 32) as u64,
        RedOp::Sum if narrow => h % 64,
        RedOp::Sum | RedOp::Max | RedOp::Min => h,
        RedOp::Prod if narrow => {
            let v = (h % 8) * 2 + 1;
            if signed && (h >> 32) & 1 == 1 {
                (v as i64).wrapping_neg() as u64
            } else {
                v
            }
        }
        RedOp::Prod => h | 1,
        RedOp::Avg => {
            // No overflow: nranks × |value| ≤ the type's max.
            let bits = 8 * dtype.size() as u32;
            let max = if signed {
                u64::MAX >> (65 - bits)
            } else {
                u64::MAX >> (64 - bits)
            };
            let a = max / nranks as u64;
            if signed {
                signed_in(h, a) as u64
            } else {
                // `a + 1` overflows only for a 64-bit type on one rank: every value is allowed.
                a.checked_add(1).map_or(h, |m| h % m)
            }
        }
    }
}

fn gen_float(dtype: DataType, op: RedOp, rank: usize, nranks: usize, i: usize, h: u64) -> f64 {
    match op {
        RedOp::Sum => signed_in(h, sum_bound(dtype, nranks)) as f64,
        RedOp::Avg => {
            let (r1, r2) = avg_contributors(i, nranks);
            if rank == r1 || rank == r2 {
                (h % (exact_int_limit(dtype) / 2 + 1)) as f64
            } else {
                0.0
            }
        }
        RedOp::Prod => {
            let mag = if may_double(dtype, rank, nranks, i) && h & 1 == 1 {
                2.0
            } else {
                1.0
            };
            if (h >> 1) & 1 == 1 { -mag } else { mag }
        }
        RedOp::Max | RedOp::Min => ((h % 2001) as f64 - 1000.0) / 8.0,
    }
}

/// Largest magnitude of a float Sum input: every partial sum satisfies |s| ≤ nranks × bound ≤ the
/// exact-integer limit, in any order.
fn sum_bound(dtype: DataType, nranks: usize) -> u64 {
    exact_int_limit(dtype) / nranks.max(1) as u64
}

/// The two ranks whose float Avg inputs are non-zero at element `i` (nccl-tests' scheme; both
/// non-negative, so a pre-multiplied sum stays within 2 ulps): `i mod n` and a different rank
/// rotating with `i / n` (the same rank twice only when `nranks == 1`).
fn avg_contributors(i: usize, nranks: usize) -> (usize, usize) {
    let n = nranks.max(1);
    let r1 = i % n;
    let r2 = if n > 1 {
        (r1 + 1 + (i / n) % (n - 1)) % n
    } else {
        r1
    };
    (r1, r2)
}

/// Whether `rank` may give ±2 (rather than ±1) to a float Prod at element `i`: only when
/// `(rank + i) % stride == 0`, so at most `ceil(n / stride) ≤ max_doublings` ranks per element.
fn may_double(dtype: DataType, rank: usize, nranks: usize, i: usize) -> bool {
    let stride = nranks.div_ceil(max_doublings(dtype)).max(1);
    (rank + i).is_multiple_of(stride)
}

// ---------------------------------------------------------------------------------------------
// Element encoding and folding.

fn read_bits(b: &[u8]) -> u64 {
    let mut le = [0u8; 8];
    le[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(le)
}

/// `count` elements of `dtype` (`count × dtype.size()` bytes), element `i` the low bytes of
/// `bits(i)`.
fn elems(dtype: DataType, count: usize, bits: impl Fn(usize) -> u64) -> Vec<u8> {
    let mut out = vec![0u8; count.saturating_mul(dtype.size())];
    match dtype.size() {
        1 => out.iter_mut().enumerate().for_each(|(i, e)| *e = bits(i) as u8),
        2 => put::<2>(&mut out, bits),
        4 => put::<4>(&mut out, bits),
        _ => put::<8>(&mut out, bits),
    }
    out
}

fn put<const N: usize>(out: &mut [u8], bits: impl Fn(usize) -> u64) {
    for (i, e) in out.chunks_exact_mut(N).enumerate() {
        e.copy_from_slice(&bits(i).to_le_bytes()[..N]);
    }
}

fn float_from_bits(dtype: DataType, b: u64) -> f64 {
    match dtype {
        DataType::F16 => f16::from_bits(b as u16).to_f64(),
        DataType::Bf16 => bf16::from_bits(b as u16).to_f64(),
        DataType::F8E4M3 => F8E4M3(b as u8).to_f64(),
        DataType::F8E5M2 => F8E5M2(b as u8).to_f64(),
        DataType::F32 => f32::from_bits(b as u32) as f64,
        _ => f64::from_bits(b),
    }
}

/// Rounds `x` to nearest in `dtype` and returns its bits.
fn float_to_bits(dtype: DataType, x: f64) -> u64 {
    match dtype {
        DataType::F16 => f16::from_f64(x).to_bits() as u64,
        DataType::Bf16 => bf16::from_f64(x).to_bits() as u64,
        DataType::F8E4M3 => F8E4M3::from_f64(x).0 as u64,
        DataType::F8E5M2 => F8E5M2::from_f64(x).0 as u64,
        DataType::F32 => (x as f32).to_bits() as u64,
        _ => x.to_bits(),
    }
}

/// An integer element type, folded with wrapping arithmetic.
trait Int: Copy + Ord {
    fn from_bits(b: u64) -> Self;
    fn to_bits(self) -> u64;
    fn wadd(self, o: Self) -> Self;
    fn wmul(self, o: Self) -> Self;
    /// Division by `n`, truncating toward zero.
    fn div_n(self, n: usize) -> Self;
}

macro_rules! impl_int {
    ($($t:ty => $u:ty),*) => {$(
        impl Int for $t {
            fn from_bits(b: u64) -> Self { b as $u as $t }
            fn to_bits(self) -> u64 { self as $u as u64 }
            fn wadd(self, o: Self) -> Self { self.wrapping_add(o) }
            fn wmul(self, o: Self) -> Self { self.wrapping_mul(o) }
            fn div_n(self, n: usize) -> Self { (self as i128 / n.max(1) as i128) as $t }
        }
    )*};
}
impl_int!(i8 => u8, u8 => u8, i32 => u32, u32 => u32, i64 => u64, u64 => u64);

fn fold_int<T: Int>(op: RedOp, n: usize, vals: impl Iterator<Item = u64>) -> u64 {
    let mut acc: Option<T> = None;
    for b in vals {
        let v = T::from_bits(b);
        acc = Some(match acc {
            None => v,
            Some(a) => match op {
                RedOp::Sum | RedOp::Avg => a.wadd(v),
                RedOp::Prod => a.wmul(v),
                RedOp::Max => a.max(v),
                RedOp::Min => a.min(v),
            },
        });
    }
    match acc {
        Some(a) if op == RedOp::Avg => a.div_n(n).to_bits(),
        Some(a) => a.to_bits(),
        None => 0,
    }
}

fn fold_float(dtype: DataType, op: RedOp, n: usize, vals: impl Iterator<Item = u64>) -> u64 {
    if dtype.is_fp8() && op == RedOp::Avg {
        return fold_fp8_avg(dtype, n, vals);
    }
    let mut acc: Option<f64> = None;
    for b in vals {
        let v = float_from_bits(dtype, b);
        acc = Some(match acc {
            None => v,
            Some(a) => match op {
                RedOp::Sum | RedOp::Avg => a + v,
                RedOp::Prod => a * v,
                RedOp::Max => a.max(v),
                RedOp::Min => a.min(v),
            },
        });
    }
    let r = match acc {
        Some(a) if op == RedOp::Avg => a / n.max(1) as f64,
        Some(a) => a,
        None => 0.0,
    };
    float_to_bits(dtype, r)
}

/// fp8 Avg as oxccl (and NCCL) run it: PreMulSum by `1/n` in the type, each product rounded to
/// binary16 then to the type, each partial sum likewise (exact here: the inputs' sums are).
fn fold_fp8_avg(dtype: DataType, n: usize, vals: impl Iterator<Item = u64>) -> u64 {
    let s = float_from_bits(dtype, float_to_bits(dtype, 1.0 / n.max(1) as f64));
    let round = |x: f64| float_from_bits(dtype, float_to_bits(dtype, f16::from_f64(x).to_f64()));
    let acc = vals.map(|b| round(float_from_bits(dtype, b) * s)).reduce(|a, t| round(a + t));
    float_to_bits(dtype, acc.unwrap_or(0.0))
}

/// Reduces the element bit patterns `vals` (one per rank) with `op`; `n` is the divisor for `Avg`.
fn fold_bits(dtype: DataType, op: RedOp, n: usize, vals: impl Iterator<Item = u64>) -> u64 {
    match dtype {
        DataType::I8 => fold_int::<i8>(op, n, vals),
        DataType::U8 => fold_int::<u8>(op, n, vals),
        DataType::I32 => fold_int::<i32>(op, n, vals),
        DataType::U32 => fold_int::<u32>(op, n, vals),
        DataType::I64 => fold_int::<i64>(op, n, vals),
        DataType::U64 => fold_int::<u64>(op, n, vals),
        DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64 | DataType::F8E4M3 | DataType::F8E5M2 => {
            fold_float(dtype, op, n, vals)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Comparison.

fn tolerance_ulps(dtype: DataType, op: RedOp, nranks: usize) -> u64 {
    if dtype.is_float() && op == RedOp::Avg && nranks > 1 {
        2
    } else {
        0
    }
}

/// A float type's non-finite mask (its bits are all set in NaNs and infinities only: the exponent
/// field, or E4M3's NaN pattern) and width in bits.
const fn float_layout(dtype: DataType) -> (u64, u32) {
    match dtype {
        DataType::F16 => (0x7C00, 16),
        DataType::Bf16 => (0x7F80, 16),
        DataType::F8E4M3 => (0x7F, 8),
        DataType::F8E5M2 => (0x7C, 8),
        DataType::F32 => (0x7F80_0000, 32),
        _ => (0x7FF0_0000_0000_0000, 64),
    }
}

/// The bit pattern as an integer ordered like the float values (±0 both map to 0).
fn ordered(b: u64, bits: u32) -> i128 {
    let sign = 1u64 << (bits - 1);
    let mag = (b & (sign - 1)) as i128;
    if b & sign != 0 { -mag } else { mag }
}

fn elem_matches(dtype: DataType, got: u64, want: u64, tol: u64) -> bool {
    if got == want {
        return true;
    }
    if tol == 0 {
        return false;
    }
    let (exp_mask, bits) = float_layout(dtype);
    if got & exp_mask == exp_mask || want & exp_mask == exp_mask {
        return false;
    }
    (ordered(got, bits) - ordered(want, bits)).unsigned_abs() <= tol as u128
}

#[cfg(test)]
mod tests {
    use super::*;

    const AR: Func = Func::AllReduce;

    fn inputs(dtype: DataType, op: RedOp, n: usize, seed: u64, count: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|r| fill_input(AR, dtype, op, r, n, seed, count).unwrap())
            .collect()
    }

    fn i32s(b: &[u8]) -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn i8_sum_wraps() {
        let a = [120i8 as u8];
        let b = [100i8 as u8];
        let r = reduce_reference(DataType::I8, RedOp::Sum, &[&a, &b]).unwrap();
        assert_eq!(r[0] as i8, -36);
        let r = reduce_reference(DataType::U8, RedOp::Sum, &[&[200], &[100]]).unwrap();
        assert_eq!(r, vec![44]);
        // Through expected(): 8 ranks of u8 values in 0..64 must wrap somewhere, and match a u32
        // reference mod 256.
        let n = 8;
        let ins = inputs(DataType::U8, RedOp::Sum, n, 3, 1000);
        let exp = expected(AR, DataType::U8, RedOp::Sum, n, 3, 1000).unwrap();
        let mut wrapped = 0;
        for i in 0..1000 {
            let s: u32 = ins.iter().map(|b| b[i] as u32).sum();
            assert_eq!(exp[i], (s % 256) as u8, "element {i}");
            wrapped += (s > 255) as usize;
        }
        assert!(wrapped > 0);
        // i8 through expected() with 64 ranks against an i64 reference.
        let ins = inputs(DataType::I8, RedOp::Sum, 64, 9, 500);
        let exp = expected(AR, DataType::I8, RedOp::Sum, 64, 9, 500).unwrap();
        let mut wrapped = 0;
        for i in 0..500 {
            let s: i64 = ins.iter().map(|b| b[i] as i8 as i64).sum();
            assert_eq!(exp[i] as i8, s as i8);
            wrapped += !(-128..=127).contains(&s) as usize;
        }
        assert!(wrapped > 0);
    }

    #[test]
    fn i32_avg_truncates_toward_zero() {
        let t = |a: i32, b: i32| {
            let r =
                reduce_reference(DataType::I32, RedOp::Avg, &[&a.to_le_bytes(), &b.to_le_bytes()]).unwrap();
            i32s(&r)[0]
        };
        assert_eq!(t(7, 8), 7);
        assert_eq!(t(-7, -8), -7);
        assert_eq!(t(-7, 8), 0);
        assert_eq!(t(i32::MAX, i32::MAX - 1), -1); // the sum wraps to -3, then -3 / 2 = -1.
        // expected(): 3 ranks, no overflow, truncation toward zero of the exact sum.
        let ins = inputs(DataType::I32, RedOp::Avg, 3, 5, 300);
        let exp = i32s(&expected(AR, DataType::I32, RedOp::Avg, 3, 5, 300).unwrap());
        let mut neg_inexact = 0;
        let ins: Vec<Vec<i32>> = ins.iter().map(|b| i32s(b)).collect();
        for (i, &e) in exp.iter().enumerate() {
            let s: i64 = ins.iter().map(|b| b[i] as i64).sum();
            assert!(s >= i32::MIN as i64 && s <= i32::MAX as i64);
            assert_eq!(e as i64, s / 3);
            neg_inexact += (s < 0 && s % 3 != 0) as usize;
        }
        assert!(neg_inexact > 0);
    }

    #[test]
    fn signed_and_unsigned_max_min() {
        let r = reduce_reference(DataType::I8, RedOp::Max, &[&[0xFF], &[1]]).unwrap();
        assert_eq!(r, vec![1]);
        let r = reduce_reference(DataType::U8, RedOp::Max, &[&[0xFF], &[1]]).unwrap();
        assert_eq!(r, vec![0xFF]);
        let r = reduce_reference(
            DataType::I64,
            RedOp::Min,
            &[&(-5i64).to_le_bytes(), &3i64.to_le_bytes()],
        );
        assert_eq!(r.unwrap(), (-5i64).to_le_bytes().to_vec());
    }

    /// Sums `vals` with `dtype` arithmetic (round after every add) in the given order.
    fn half_sum(dtype: DataType, vals: &[u64], order: &[usize]) -> u64 {
        let mut acc = float_from_bits(dtype, vals[order[0]]);
        for &r in &order[1..] {
            let s = acc as f32 + float_from_bits(dtype, vals[r]) as f32; // exact in f32
            acc = float_from_bits(dtype, float_to_bits(dtype, s as f64));
        }
        float_to_bits(dtype, acc)
    }

    #[test]
    fn half_sums_exact_for_64_ranks_in_any_order() {
        let n = 64;
        for dtype in [DataType::Bf16, DataType::F16] {
            let count = 2000;
            let ins = inputs(dtype, RedOp::Sum, n, 11, count);
            let exp = expected(AR, dtype, RedOp::Sum, n, 11, count).unwrap();
            let fwd: Vec<usize> = (0..n).collect();
            let rev: Vec<usize> = (0..n).rev().collect();
            let inter: Vec<usize> = (0..n).map(|k| (k * 37) % n).collect(); // a permutation (gcd 1)
            let mut nonint = 0;
            for i in 0..count {
                let vals: Vec<u64> = ins.iter().map(|b| read_bits(&b[2 * i..2 * i + 2])).collect();
                let want = read_bits(&exp[2 * i..2 * i + 2]);
                for order in [&fwd, &rev, &inter] {
                    assert_eq!(half_sum(dtype, &vals, order), want, "{dtype} element {i}");
                }
                // Pairwise tree.
                let mut level: Vec<f64> = vals.iter().map(|&b| float_from_bits(dtype, b)).collect();
                while level.len() > 1 {
                    level = level
                        .chunks(2)
                        .map(|c| {
                            let s = c.iter().sum::<f64>();
                            float_from_bits(dtype, float_to_bits(dtype, s))
                        })
                        .collect();
                }
                assert_eq!(float_to_bits(dtype, level[0]), want);
                nonint += (float_from_bits(dtype, want) != 0.0) as usize;
            }
            assert!(nonint > count / 2, "sums should mostly be non-zero");
        }
    }

    #[test]
    fn f16_prod_exact_and_finite_for_64_ranks() {
        let n = 64;
        let dtype = DataType::F16;
        let ins = inputs(dtype, RedOp::Prod, n, 2, 1000);
        let exp = expected(AR, dtype, RedOp::Prod, n, 2, 1000).unwrap();
        let mut big = 0;
        for i in 0..1000 {
            let mut acc = f16::from_f32(1.0);
            for b in ins.iter().rev() {
                acc = f16::from_f32(
                    acc.to_f32() * f16::from_bits(read_bits(&b[2 * i..2 * i + 2]) as u16).to_f32(),
                );
            }
            let want = f16::from_bits(read_bits(&exp[2 * i..2 * i + 2]) as u16);
            assert!(want.is_finite() && want.to_f32().abs() >= 1.0);
            assert_eq!(acc.to_bits(), want.to_bits());
            big += (want.to_f32().abs() >= 16.0) as usize;
        }
        assert!(big > 0);
    }

    #[test]
    fn signed_inputs_reach_both_ends_of_their_range_for_the_widest_type() {
        // One rank's I64 Avg input range is all of [-(2^63 − 1), 2^63 − 1].
        let a = i64::MAX as u64;
        assert_eq!(signed_in(0, a), -i64::MAX);
        assert_eq!(signed_in(2 * a, a), i64::MAX);
        assert_eq!(signed_in(a, a), 0);
        assert_eq!(signed_in(u64::MAX, a), -i64::MAX, "2^64 − 1 wraps to the bottom");
        assert_eq!(signed_in(7, 3), -3, "7 mod 7 = 0, less 3");
        assert_eq!(signed_in(13, 3), 3);
    }

    #[test]
    fn inputs_depend_on_rank_seed_and_index() {
        let a = fill_input(AR, DataType::F32, RedOp::Sum, 0, 4, 1, 64).unwrap();
        let b = fill_input(AR, DataType::F32, RedOp::Sum, 1, 4, 1, 64).unwrap();
        let c = fill_input(AR, DataType::F32, RedOp::Sum, 0, 4, 2, 64).unwrap();
        assert_eq!(a.len(), 256);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_ne!(a[..128], a[128..]);
        assert_eq!(a, fill_input(AR, DataType::F32, RedOp::Sum, 0, 4, 1, 64).unwrap());
        assert!(fill_input(AR, DataType::F32, RedOp::Sum, 4, 4, 1, 64).is_none());
        assert!(fill_input(Func::AllGather, DataType::F32, RedOp::Sum, 0, 4, 1, 64).is_none());
        assert!(expected(Func::Broadcast, DataType::F32, RedOp::Sum, 4, 1, 64).is_none());
        assert!(expected(AR, DataType::F32, RedOp::Sum, 0, 1, 64).is_none());
    }

    #[test]
    fn expected_matches_reference_for_every_type_and_op() {
        for &dtype in DataType::ALL {
            for &op in RedOp::ALL {
                for n in [1, 3, 8] {
                    let ins = inputs(dtype, op, n, 7, 97);
                    let refs: Vec<&[u8]> = ins.iter().map(|v| v.as_slice()).collect();
                    let exp = expected(AR, dtype, op, n, 7, 97).unwrap();
                    assert_eq!(exp.len(), 97 * dtype.size());
                    assert_eq!(
                        reduce_reference(dtype, op, &refs).unwrap(),
                        exp,
                        "{dtype} {op} n={n}"
                    );
                    assert_eq!(count_wrong(dtype, op, &exp, &exp, n), 0);
                    if n == 1 {
                        assert_eq!(exp, ins[0], "{dtype} {op}: one rank is the identity");
                    }
                }
            }
        }
    }

    #[test]
    fn float_avg_two_contributors() {
        // 3 ranks: inexact division; the result is exact sum / 3 rounded.
        let n = 3;
        let ins = inputs(DataType::F32, RedOp::Avg, n, 4, 200);
        let exp = expected(AR, DataType::F32, RedOp::Avg, n, 4, 200).unwrap();
        for i in 0..200 {
            let vals: Vec<f32> = ins
                .iter()
                .map(|b| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()))
                .collect();
            assert!(vals.iter().filter(|&&v| v != 0.0).count() <= 2);
            assert!(vals.iter().all(|&v| v >= 0.0));
            let sum: f64 = vals.iter().map(|&v| v as f64).sum();
            let want = f32::from_le_bytes(exp[4 * i..4 * i + 4].try_into().unwrap());
            assert_eq!(want, (sum / 3.0) as f32);
            // A pre-multiplied device result stays within tolerance.
            let s = 1.0f32 / 3.0;
            let pre: f32 = vals.iter().map(|&v| v * s).sum();
            assert!(elem_matches(
                DataType::F32,
                pre.to_bits() as u64,
                want.to_bits() as u64,
                2
            ));
        }
    }

    #[test]
    fn count_wrong_detects_flips_and_tolerates_avg_ulps() {
        let exp = expected(AR, DataType::I32, RedOp::Sum, 4, 0, 100).unwrap();
        let mut got = exp.clone();
        got[4 * 37 + 2] ^= 0x10;
        assert_eq!(count_wrong(DataType::I32, RedOp::Sum, &got, &exp, 4), 1);
        assert_eq!(first_wrong(DataType::I32, RedOp::Sum, &got, &exp, 4), Some(37));
        assert_eq!(count_wrong(DataType::I32, RedOp::Sum, &got[..396], &exp, 4), 2);
        assert_eq!(
            count_wrong(DataType::I32, RedOp::Sum, &poison(DataType::I32, 100), &exp, 4),
            100
        );

        let exp = expected(AR, DataType::F32, RedOp::Avg, 3, 0, 100).unwrap();
        let bump = |ulps: i32, i: usize| {
            let mut g = exp.clone();
            let b = u32::from_le_bytes(g[4 * i..4 * i + 4].try_into().unwrap());
            g[4 * i..4 * i + 4].copy_from_slice(&(b as i64 + ulps as i64).to_le_bytes()[..4]);
            g
        };
        let nz = (0..100).find(|&i| exp[4 * i..4 * i + 4] != [0; 4]).unwrap();
        assert_eq!(count_wrong(DataType::F32, RedOp::Avg, &bump(1, nz), &exp, 3), 0);
        assert_eq!(count_wrong(DataType::F32, RedOp::Avg, &bump(-2, nz), &exp, 3), 0);
        assert_eq!(count_wrong(DataType::F32, RedOp::Avg, &bump(3, nz), &exp, 3), 1);
        assert_eq!(count_wrong(DataType::F32, RedOp::Sum, &bump(1, nz), &exp, 3), 1);
        assert_eq!(
            count_wrong(DataType::F32, RedOp::Avg, &poison(DataType::F32, 100), &exp, 3),
            100
        );
        // -0 vs +0 and ulps across zero.
        let z = 0f32.to_bits() as u64;
        assert!(elem_matches(DataType::F32, (-0f32).to_bits() as u64, z, 2));
        assert!(elem_matches(
            DataType::F32,
            (-f32::from_bits(1)).to_bits() as u64,
            f32::from_bits(1).to_bits() as u64,
            2
        ));
        assert!(!elem_matches(
            DataType::F32,
            (-f32::from_bits(2)).to_bits() as u64,
            f32::from_bits(1).to_bits() as u64,
            2
        ));
    }

    #[test]
    fn worst_case_bounds_hold_up_to_64_ranks() {
        // Float Sum: every input's magnitude × nranks within the exact-integer limit of the type.
        for (dtype, limit) in [
            (DataType::Bf16, 256),
            (DataType::F16, 2048),
            (DataType::F32, 1 << 24),
        ] {
            for n in 1..=64 {
                let a = sum_bound(dtype, n);
                assert!(a >= 1 && a * n as u64 <= limit, "{dtype} n={n}");
            }
            // The generated values never exceed ±bound, and reach it when it is small.
            let ins = inputs(dtype, RedOp::Sum, 64, 1, 500);
            let vals: Vec<f64> = ins
                .iter()
                .flat_map(|b| {
                    b.chunks_exact(dtype.size())
                        .map(|c| float_from_bits(dtype, read_bits(c)))
                })
                .collect();
            let a = sum_bound(dtype, 64) as f64;
            assert!(vals.iter().all(|v| v.abs() <= a && v.fract() == 0.0));
            assert!(a > 64.0 || (vals.contains(&a) && vals.contains(&-a)), "{dtype}");
        }
        // f16 Prod: at most 15 ranks may double at any element (2^15 ≤ 65504), and the rule
        // still lets many double.
        for n in 1..=64 {
            let most = (0..256)
                .map(|i| (0..n).filter(|&r| may_double(DataType::F16, r, n, i)).count())
                .max()
                .unwrap();
            assert!(most <= 15, "n={n}: {most} doublings");
            assert!(most >= n.min(8), "n={n}: only {most} doublings");
        }
        // Float Avg: two distinct contributors, every rank contributes somewhere.
        for n in 2..=64 {
            let mut seen = vec![false; n];
            for i in 0..4 * n {
                let (a, b) = avg_contributors(i, n);
                assert!(a != b && a < n && b < n);
                seen[a] = true;
                seen[b] = true;
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn poison_is_nan_or_a5() {
        for &dtype in DataType::ALL {
            let p = poison(dtype, 3);
            assert_eq!(p.len(), 3 * dtype.size());
            if dtype.is_float() {
                assert!(
                    float_from_bits(dtype, read_bits(&p[..dtype.size()])).is_nan(),
                    "{dtype}"
                );
            } else {
                assert!(p.iter().all(|&b| b == 0xA5));
            }
        }
        assert_eq!(format_elem(DataType::I8, &[0xFF]), "-1");
        assert_eq!(
            format_elem(DataType::F32, &1.5f32.to_le_bytes()),
            "1.5 (0x3fc00000)"
        );
    }
}
