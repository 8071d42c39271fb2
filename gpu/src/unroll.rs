//! Loops written out at compile time (CUDA's `#pragma unroll`).
//!
//! LLVM unrolls a loop only while its body is small; a loop it keeps indexes its arrays at run
//! time, and an array indexed at run time lives in GPU local memory (`ld.local`/`st.local`)
//! instead of registers. The kernels' short loops over a pack's words, a pack's lanes and a
//! batch's lines go through these helpers so that every index is a constant, whatever the size
//! of the body (the fp8 and 16-bit operators, the LL128 line batch). The closures they call are
//! marked `inline(always)` on the GPU, so nothing is outlined either. The collectives test
//! `kernels::kernels_keep_no_array_in_local_memory` fails when any kernel's PTX keeps one.

/// The most iterations [`each`] writes out.
pub const MAX: usize = 16;

/// `f(0)`, `f(1)`, …, `f(N - 1)`; `N` is at most [`MAX`]. On the GPU one call after another
/// with constant arguments. A const parameter, so the calls past `N` are dead in each instance
/// before LLVM inlines `f` into them (with a run-time count, `f` was inlined sixteen times
/// everywhere and pruned only after, which made the nvptx build 45 % slower).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn each<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= MAX, "unroll::each writes out at most MAX iterations") };
    macro_rules! calls {
        ($($i:literal)*) => { $( if $i < N { f($i); } )* };
    }
    calls!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
}

/// `f(0)`, `f(1)`, …, `f(N - 1)`; `N` is at most [`MAX`]. The host's arrays need no constant
/// indices, so the CPU target compiles a plain loop (and leaves unrolling to LLVM).
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
pub fn each<const N: usize>(f: impl FnMut(usize)) {
    const { assert!(N <= MAX, "unroll::each writes out at most MAX iterations") };
    (0..N).for_each(f)
}

/// [`each`] over the `16 / size_of::<T>()` lanes of a 16-byte pack of `T` (1, 2, 4 or 8 bytes).
#[inline(always)]
pub fn each_lane<T>(f: impl FnMut(usize)) {
    const { assert!(matches!(core::mem::size_of::<T>(), 1 | 2 | 4 | 8), "a pack holds lanes of 1, 2, 4 or 8 bytes") };
    match core::mem::size_of::<T>() {
        1 => each::<16>(f),
        2 => each::<8>(f),
        4 => each::<4>(f),
        _ => each::<2>(f),
    }
}

/// The four words of a [`crate::arch::Pack`]: `words4!(|i| expr)` is `[expr, expr, expr,
/// expr]` with `i` bound to 0, 1, 2 and 3 (`core::array::from_fn` is a loop, which LLVM keeps
/// for a large `expr`).
macro_rules! words4 {
    (|$i:ident| $e:expr) => {
        [
            {
                let $i = 0usize;
                $e
            },
            {
                let $i = 1usize;
                $e
            },
            {
                let $i = 2usize;
                $e
            },
            {
                let $i = 3usize;
                $e
            },
        ]
    };
}
pub(crate) use words4;

/// `[f(a[0], b[0]), f(a[1], b[1]), f(a[2], b[2]), f(a[3], b[3])]` as a loop that may stay
/// rolled without indexing an array at run time: each turn takes word 0 and rotates the words.
/// For an `f` too large to write out four times (the fp8 operators' software conversions);
/// the words stay in registers either way.
#[inline(always)]
pub fn rolled4(a: [u32; 4], b: [u32; 4], f: impl Fn(u32, u32) -> u32) -> [u32; 4] {
    let (mut a, mut b, mut r) = (a, b, [0u32; 4]);
    for _ in 0..4 {
        let x = f(a[0], b[0]);
        a = [a[1], a[2], a[3], a[0]];
        b = [b[1], b[2], b[3], b[0]];
        r = [r[1], r[2], r[3], x];
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_calls_every_index_once_in_order() {
        fn seen<const N: usize>() -> ([usize; MAX], usize) {
            let mut seen = [usize::MAX; MAX];
            let mut k = 0;
            each::<N>(|i| {
                seen[k] = i;
                k += 1;
            });
            (seen, k)
        }
        for (n, (s, k)) in [(0, seen::<0>()), (1, seen::<1>()), (2, seen::<2>()), (7, seen::<7>()), (16, seen::<16>())] {
            assert_eq!(k, n);
            assert!(s[..n].iter().enumerate().all(|(j, &i)| i == j), "n {n}: {s:?}");
        }
    }

    #[test]
    fn each_lane_visits_every_lane_of_a_pack() {
        fn lanes<T>() -> usize {
            let mut k = 0;
            each_lane::<T>(|i| {
                assert_eq!(i, k);
                k += 1;
            });
            k
        }
        assert_eq!([lanes::<u8>(), lanes::<u16>(), lanes::<f32>(), lanes::<f64>()], [16, 8, 4, 2]);
    }

    #[test]
    fn rolled4_pairs_word_i_with_word_i() {
        assert_eq!(rolled4([1, 2, 3, 4], [10, 20, 30, 40], |x, y| 100 * x + y), [110, 220, 330, 440]);
    }

    #[test]
    fn words4_puts_word_i_at_index_i() {
        let w: [u32; 4] = words4!(|i| 10 * i as u32 + 1);
        assert_eq!(w, [1, 11, 21, 31]);
    }
}
