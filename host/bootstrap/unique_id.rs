//! The unique id (NCCL's `ncclUniqueId` holding an `ncclBootstrapHandle`): 128 opaque bytes that
//! tell every rank where the bootstrap root listens and which secret its connections must carry.
use super::socket::{ADDR_BYTES, decode_addr, encode_addr};
use crate::error::{Error, Result};
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};

/// Size of a [`UniqueId`] in bytes (NCCL's `NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// Magic at the start of every id.
const ID_MAGIC: [u8; 4] = *b"OXID";
/// Layout version of the id.
const ID_VERSION: u16 = 1;
/// Flag: the root is not running yet; rank 0's `Bootstrap::init` starts it (NCCL_COMM_ID).
const FLAG_ROOT_ON_RANK0: u16 = 1;
/// Secret of ids made from `NCCL_COMM_ID`: every process derives the id on its own, so it
/// cannot be random (NCCL's `NCCL_MAGIC`).
pub(crate) const COMM_ID_SECRET: u64 = 0x0280_0280_0280_0280;

const OFF_FLAGS: usize = 6;
const OFF_SECRET: usize = 8;
const OFF_ADDR: usize = 16;
const OFF_SUM: usize = OFF_ADDR + ADDR_BYTES;
const USED: usize = OFF_SUM + 8;

/// 128 opaque bytes identifying one bootstrap (NCCL's `ncclUniqueId`): made once by
/// [`get_unique_id`](super::get_unique_id) (or from `NCCL_COMM_ID`), shipped to every rank by
/// the application (MPI, a file, an environment variable: see [`UniqueId::to_bytes`]) and passed
/// to [`Bootstrap::init`](super::Bootstrap::init).
///
/// Layout (little-endian): `b"OXID"`, version u16, flags u16, a random 64-bit secret, the root's
/// socket address (28 bytes: family, port, IPv4/IPv6 address, scope id, flow info), an FNV-1a
/// checksum of the preceding bytes, zeros.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    internal: [u8; UNIQUE_ID_BYTES],
}

const _: () = assert!(std::mem::size_of::<UniqueId>() == UNIQUE_ID_BYTES);
const _: () = assert!(USED <= UNIQUE_ID_BYTES);

impl UniqueId {
    pub(crate) fn new(root: SocketAddr, secret: u64, root_on_rank0: bool) -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(&ID_MAGIC);
        b[4..6].copy_from_slice(&ID_VERSION.to_le_bytes());
        let flags = if root_on_rank0 { FLAG_ROOT_ON_RANK0 } else { 0 };
        b[OFF_FLAGS..OFF_FLAGS + 2].copy_from_slice(&flags.to_le_bytes());
        b[OFF_SECRET..OFF_SECRET + 8].copy_from_slice(&secret.to_le_bytes());
        b[OFF_ADDR..OFF_SUM].copy_from_slice(&encode_addr(&root));
        let sum = crate::hash::fnv1a_64(&b[..OFF_SUM]);
        b[OFF_SUM..USED].copy_from_slice(&sum.to_le_bytes());
        UniqueId { internal: b }
    }

    /// An id for a root at `host:port` that rank 0's init will start (NCCL_COMM_ID's format:
    /// `<ipv4>:<port>`, `[<ipv6>]:<port>` or `<hostname>:<port>`). Every process can compute the
    /// same id on its own; the secret is then a fixed constant, as NCCL's `NCCL_MAGIC`.
    pub fn from_comm_id(comm_id: &str) -> Result<UniqueId> {
        let addr = parse_comm_id("comm id", comm_id)?;
        Ok(UniqueId::new(addr, COMM_ID_SECRET, true))
    }

    /// The 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.internal
    }

    /// Reads an id made by [`UniqueId::to_bytes`]. A wrong length, magic, version, flag,
    /// address, checksum or non-zero padding gives [`Error::InvalidArgument`] naming "unique id".
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bad = |why: &str| Err(Error::InvalidArgument(format!("invalid unique id: {why}")));
        if bytes.len() != UNIQUE_ID_BYTES {
            return bad(&format!("{} bytes (expected {UNIQUE_ID_BYTES})", bytes.len()));
        }
        if bytes[0..4] != ID_MAGIC {
            return bad("unknown magic (not an oxccl unique id)");
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != ID_VERSION {
            return bad(&format!(
                "version {version} (this oxccl reads version {ID_VERSION})"
            ));
        }
        let stored = u64::from_le_bytes(bytes[OFF_SUM..USED].try_into().unwrap_or([0; 8]));
        if stored != crate::hash::fnv1a_64(&bytes[..OFF_SUM]) || bytes[USED..].iter().any(|&b| b != 0) {
            return bad("checksum mismatch (corrupted in transit?)");
        }
        let flags = u16::from_le_bytes([bytes[OFF_FLAGS], bytes[OFF_FLAGS + 1]]);
        if flags & !FLAG_ROOT_ON_RANK0 != 0 {
            return bad(&format!("unknown flags {flags:#x}"));
        }
        if decode_addr(&bytes[OFF_ADDR..OFF_SUM]).is_none() {
            return bad("no valid root address");
        }
        let mut internal = [0u8; UNIQUE_ID_BYTES];
        internal.copy_from_slice(bytes);
        Ok(UniqueId { internal })
    }

    /// Re-checks the bytes (an id is plain data and may have been built by other means).
    pub(crate) fn validate(&self) -> Result<()> {
        UniqueId::from_bytes(&self.internal).map(|_| ())
    }

    /// Where the root listens.
    pub fn root_addr(&self) -> SocketAddr {
        decode_addr(&self.internal[OFF_ADDR..OFF_SUM]).unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// The secret every bootstrap connection of this id presents (NCCL's `magic`).
    pub fn secret(&self) -> u64 {
        u64::from_le_bytes(
            self.internal[OFF_SECRET..OFF_SECRET + 8]
                .try_into()
                .unwrap_or([0; 8]),
        )
    }

    /// True when the root does not run yet and rank 0's init starts it (ids from
    /// `NCCL_COMM_ID` / [`UniqueId::from_comm_id`]).
    pub fn root_on_rank0(&self) -> bool {
        u16::from_le_bytes([self.internal[OFF_FLAGS], self.internal[OFF_FLAGS + 1]]) & FLAG_ROOT_ON_RANK0 != 0
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("root", &self.root_addr())
            .field("root_on_rank0", &self.root_on_rank0())
            .finish_non_exhaustive()
    }
}

/// Parses `host:port` (`[v6]:port` for IPv6; host names are resolved, the first address wins).
/// Errors name `what` (the variable) and the accepted formats.
pub(crate) fn parse_comm_id(what: &str, s: &str) -> Result<SocketAddr> {
    let formats = "accepted: <ipv4>:<port>, [<ipv6>]:<port> or <hostname>:<port>";
    let s = s.trim();
    if let Ok(a) = s.parse::<SocketAddr>() {
        if a.port() == 0 {
            return Err(Error::invalid(format!(
                "{what}={s:?}: port 0 is not allowed ({formats})"
            )));
        }
        return Ok(a);
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(Error::invalid(format!("{what}={s:?} has no port ({formats})")));
    };
    match port.parse::<u16>() {
        Ok(p) if p != 0 && !host.is_empty() => {}
        _ => {
            return Err(Error::invalid(format!(
                "{what}={s:?}: bad host or port ({formats})"
            )));
        }
    }
    let mut addrs = s
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("{what}={s:?}: cannot resolve: {e} ({formats})")))?;
    addrs
        .next()
        .ok_or_else(|| Error::invalid(format!("{what}={s:?}: resolves to no address ({formats})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        for addr in ["127.0.0.1:4567", "[fd00::2]:80", "[fe80::1%3]:9"] {
            let a: SocketAddr = addr.parse().unwrap();
            let id = UniqueId::new(a, 0xdead_beef_1234_5678, false);
            let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
            assert_eq!(back, id);
            assert_eq!(back.root_addr(), a);
            assert_eq!(back.secret(), 0xdead_beef_1234_5678);
            assert!(!back.root_on_rank0());
            for i in 0..UNIQUE_ID_BYTES {
                let mut b = id.to_bytes();
                b[i] ^= 0x10;
                let e = UniqueId::from_bytes(&b).unwrap_err();
                assert!(e.to_string().contains("unique id"), "byte {i}: {e}");
            }
        }
        assert!(UniqueId::from_bytes(&[0u8; 127]).is_err());
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
    }

    #[test]
    fn comm_id_formats() {
        let id = UniqueId::from_comm_id("127.0.0.1:29500").unwrap();
        assert!(id.root_on_rank0());
        assert_eq!(id.secret(), COMM_ID_SECRET);
        assert_eq!(id.root_addr(), "127.0.0.1:29500".parse::<SocketAddr>().unwrap());
        assert_eq!(UniqueId::from_comm_id("[::1]:7").unwrap().root_addr().port(), 7);
        assert_eq!(
            UniqueId::from_comm_id("localhost:29500")
                .unwrap()
                .root_addr()
                .port(),
            29500
        );
        for bad in [
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:99999",
            ":80",
            "",
            "host:port",
        ] {
            let e = UniqueId::from_comm_id(bad).unwrap_err();
            assert_eq!(e.code(), crate::ResultCode::InvalidArgument, "{bad}: {e}");
        }
    }
}
