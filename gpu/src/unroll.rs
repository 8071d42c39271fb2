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

/// `f(0)`, `f(1)`, …, `f(n - 1)`, one call after another with constant arguments. `n` is a
/// constant at every call site (a type's lanes per pack, a build-time batch size) and at most
/// [`MAX`]; the calls past it fold away.
#[inline(always)]
pub fn each(n: usize, mut f: impl FnMut(usize)) {
    debug_assert!(
        n <= MAX,
        "unroll::each: {n} iterations, at most {MAX} are written out"
    );
    macro_rules! calls {
        ($($i:literal)*) => { $( if $i < n { f($i); } )* };
    }
    calls!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
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
        for n in 0..=MAX {
            let mut seen = [usize::MAX; MAX];
            let mut k = 0;
            each(n, |i| {
                seen[k] = i;
                k += 1;
            });
            assert_eq!(k, n);
            assert!(
                seen[..n].iter().enumerate().all(|(j, &i)| i == j),
                "n {n}: {seen:?}"
            );
        }
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
