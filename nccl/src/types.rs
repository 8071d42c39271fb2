//! The C types of `nccl.h` (NCCL 2.28, LP64) and their conversion to oxccl's: result codes, data
//! types, reduction operators, `ncclUniqueId`, `ncclConfig_t` and `ncclSimInfo_t`, with their
//! sizes and field offsets checked at compile time.
use oxccl::{DataType, Error, RedOp, Result};
use std::ffi::{c_char, c_int, c_uint};
use std::mem::{offset_of, size_of};

/// `ncclResult_t` (a C enum: an `int`).
pub type ncclResult_t = c_int;
/// `ncclDataType_t`.
pub type ncclDataType_t = c_int;
/// `ncclRedOp_t`.
pub type ncclRedOp_t = c_int;
/// `ncclScalarResidence_t`.
pub type ncclScalarResidence_t = c_int;

pub const ncclSuccess: ncclResult_t = 0;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclInProgress: ncclResult_t = 7;

/// `ncclNumOps`: the built-in operators are `0..ncclNumOps`; PreMulSum operators start here.
pub const ncclNumOps: ncclRedOp_t = 5;
/// `ncclMaxRedOp` for a 4-byte enum.
pub const ncclMaxRedOp: ncclRedOp_t = 0x7fff_ffff;
pub const ncclFloat8e4m3: ncclDataType_t = 10;
pub const ncclFloat8e5m2: ncclDataType_t = 11;
/// `ncclNumTypes`.
pub const ncclNumTypes: ncclDataType_t = 12;
pub const ncclScalarDevice: ncclScalarResidence_t = 0;
/// `ncclCommShrink` flags.
pub const NCCL_SHRINK_DEFAULT: c_int = 0;
pub const NCCL_SHRINK_ABORT: c_int = 1;
/// `ncclCommRevoke`'s only flag value.
pub const NCCL_REVOKE_DEFAULT: c_int = 0;
pub const ncclScalarHostImmediate: ncclScalarResidence_t = 1;

/// `NCCL_VERSION_CODE` of the ABI this library implements (2.28.3).
pub const NCCL_VERSION_CODE: c_int = 22803;

/// NCCL's `NCCL_VERSION(X, Y, Z)`.
pub const fn nccl_version(x: c_int, y: c_int, z: c_int) -> c_int {
    if x <= 2 && y <= 8 { x * 1000 + y * 100 + z } else { x * 10000 + y * 100 + z }
}

/// The opaque communicator struct behind `ncclComm_t`; oxccl's handles are not addresses of
/// anything (`handles.rs`).
#[repr(C)]
pub struct ncclComm {
    _private: [u8; 0],
}
/// `ncclComm_t`.
pub type ncclComm_t = *mut ncclComm;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; 128],
}
const _: () = assert!(size_of::<ncclUniqueId>() == 128);

impl ncclUniqueId {
    /// The bytes, as oxccl's `UniqueId::from_bytes` reads them.
    pub fn bytes(&self) -> [u8; 128] {
        self.internal.map(|c| c as u8)
    }
}

/// `NCCL_CONFIG_UNDEF_INT`.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t`'s magic (`NCCL_API_MAGIC`).
pub const NCCL_CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_SPLIT_NOCOLOR`.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_CTA_POLICY_ZERO`, the largest CTA policy 2.28 accepts.
pub const NCCL_CTA_POLICY_ZERO: c_int = 2;
/// NCCL's `MAXCHANNELS` (the bound of `nChannelsPerNetPeer`).
pub const MAXCHANNELS: c_int = 64;

/// `ncclConfig_t` as NCCL 2.28 lays it out (80 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
    pub collnet_enable: c_int,
    pub cta_policy: c_int,
    pub shrink_share: c_int,
    pub nvls_ctas: c_int,
    pub n_channels_per_net_peer: c_int,
    pub nvlink_centric_sched: c_int,
}
const _: () = {
    assert!(size_of::<ncclConfig_t>() == 80);
    assert!(offset_of!(ncclConfig_t, magic) == 8);
    assert!(offset_of!(ncclConfig_t, version) == 12);
    assert!(offset_of!(ncclConfig_t, blocking) == 16);
    assert!(offset_of!(ncclConfig_t, max_ctas) == 28);
    assert!(offset_of!(ncclConfig_t, net_name) == 32);
    assert!(offset_of!(ncclConfig_t, split_share) == 40);
    assert!(offset_of!(ncclConfig_t, comm_name) == 48);
    assert!(offset_of!(ncclConfig_t, collnet_enable) == 56);
    assert!(offset_of!(ncclConfig_t, nvls_ctas) == 68);
    assert!(offset_of!(ncclConfig_t, n_channels_per_net_peer) == 72);
    assert!(offset_of!(ncclConfig_t, nvlink_centric_sched) == 76);
};

impl ncclConfig_t {
    /// `NCCL_CONFIG_INITIALIZER`.
    pub const fn initializer() -> ncclConfig_t {
        const U: c_int = NCCL_CONFIG_UNDEF_INT;
        ncclConfig_t {
            size: size_of::<ncclConfig_t>(),
            magic: NCCL_CONFIG_MAGIC,
            version: nccl_version(2, 28, 3) as c_uint,
            blocking: U,
            cga_cluster_size: U,
            min_ctas: U,
            max_ctas: U,
            net_name: std::ptr::null(),
            split_share: U,
            traffic_class: U,
            comm_name: std::ptr::null(),
            collnet_enable: U,
            cta_policy: U,
            shrink_share: U,
            nvls_ctas: U,
            n_channels_per_net_peer: U,
            nvlink_centric_sched: U,
        }
    }
}

/// `ncclSimInfo_t` (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclSimInfo_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimated_time: f32,
}
const _: () = assert!(size_of::<ncclSimInfo_t>() == 24 && offset_of!(ncclSimInfo_t, estimated_time) == 16);
/// `ncclSimInfo_t`'s magic.
pub const NCCL_SIM_INFO_MAGIC: c_uint = 0x7468_5283;

/// The oxccl type of `ncclDataType_t` `d` (every type of NCCL 2.28, the fp8 ones included);
/// any other value is `InvalidArgument` naming the accepted range.
pub fn data_type(d: ncclDataType_t) -> Result<DataType> {
    u8::try_from(d)
        .ok()
        .and_then(DataType::from_u8)
        .ok_or_else(|| {
            Error::InvalidArgument(format!("datatype {d} is not an ncclDataType_t (accepted: 0..{ncclNumTypes})"))
        })
}

/// The built-in operator `op` (`0..ncclNumOps`), or `None` for a PreMulSum handle value.
pub fn builtin_op(op: ncclRedOp_t) -> Option<RedOp> {
    u8::try_from(op).ok().and_then(RedOp::from_u8)
}

/// The table index of PreMulSum operator value `op` (`ncclNumOps + i`), or `None` below that.
pub fn premul_index(op: ncclRedOp_t) -> Option<usize> {
    op.checked_sub(ncclNumOps).and_then(|i| usize::try_from(i).ok())
}

/// The rank or count argument `v` of an `int` parameter `name` as an index; negative values are
/// `InvalidArgument` naming it.
pub fn non_negative(name: &str, v: c_int) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{name} is {v}; it must not be negative")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_types_and_ops_follow_nccl_numbering() {
        for (d, want) in [(0, DataType::I8), (1, DataType::U8), (7, DataType::F32), (9, DataType::Bf16), (10, DataType::F8E4M3)] {
            assert_eq!(data_type(d).unwrap(), want);
        }
        assert_eq!(data_type(ncclFloat8e4m3).unwrap(), DataType::F8E4M3);
        assert_eq!(data_type(ncclFloat8e5m2).unwrap(), DataType::F8E5M2);
        assert!(matches!(data_type(12), Err(Error::InvalidArgument(_))));
        assert!(matches!(data_type(-1), Err(Error::InvalidArgument(_))));
        assert_eq!(builtin_op(4), Some(RedOp::Avg));
        assert_eq!(builtin_op(5), None);
        assert_eq!(nccl_version(2, 28, 3), NCCL_VERSION_CODE);
        assert_eq!(nccl_version(2, 8, 4), 2804);
    }
}
