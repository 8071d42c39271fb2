//! FNV-1a, 64 bits: the hash of host names in peer info and topology (NCCL's `getHostHash`
//! hashes the host name too) and the checksum of a unique id.

/// FNV-1a (64-bit offset basis and prime) of `bytes`.
pub(crate) fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::fnv1a_64;

    #[test]
    fn matches_the_published_fnv1a_64_vectors() {
        // Test vectors of the FNV reference (Fowler, Noll, Vo): "", "a", "foobar".
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
