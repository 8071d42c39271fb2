//! u32 data whose AllReduce Sum is exact in any order: distinct per rank, element and call
//! (`salt`), summed with wrapping (integer addition modulo 2^32 is associative).

/// Rank `r`'s element `i` of an AllReduce input with `salt`: distinct per rank, element and call.
pub fn elem(r: usize, i: usize, salt: u32) -> u32 {
    ((r as u32 + 1).wrapping_mul(1_000_003))
        ^ (i as u32).wrapping_mul(2_654_435_761)
        ^ salt.wrapping_mul(40_503)
}

/// The u32 wrapping sum over `n` ranks of [`elem`] (what an AllReduce Sum of u32 gives: integer
/// addition modulo 2^32 is associative, so the ring order does not matter).
pub fn sum_elem(n: usize, i: usize, salt: u32) -> u32 {
    (0..n).fold(0u32, |a, r| a.wrapping_add(elem(r, i, salt)))
}

/// The native-endian bytes of `v`.
pub fn u32_bytes(v: impl IntoIterator<Item = u32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Rank `r`'s AllReduce input of `count` elements ([`elem`]).
pub fn input(r: usize, count: usize, salt: u32) -> Vec<u8> {
    u32_bytes((0..count).map(|i| elem(r, i, salt)))
}

/// The AllReduce Sum of [`input`] over `n` ranks.
pub fn all_reduce_want(n: usize, count: usize, salt: u32) -> Vec<u8> {
    u32_bytes((0..count).map(|i| sum_elem(n, i, salt)))
}
