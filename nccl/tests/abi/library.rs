//! The library file: its SONAME, its exported functions (each with its `pnccl` twin), the
//! version and the error strings.
use crate::common::*;
use std::ffi::{CStr, c_int};

/// The DT_SONAME of the ELF64 little-endian shared library `bytes`, read from its dynamic
/// section (found through the section headers) and the string table it names.
fn soname(bytes: &[u8]) -> Result<String, String> {
    let u16_at = |o: usize| bytes.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]])).ok_or("truncated");
    let u32_at = |o: usize| bytes.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).ok_or("truncated");
    let u64_at = |o: usize| bytes.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).ok_or("truncated");
    if bytes.get(0..4) != Some(b"\x7fELF") || bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err("not an ELF64 little-endian file".into());
    }
    let shoff = u64_at(0x28)? as usize;
    let shentsize = u16_at(0x3a)? as usize;
    let shnum = u16_at(0x3c)? as usize;
    let section = |i: usize| -> Result<(u32, u64, u64, u32), String> {
        let s = shoff + i * shentsize;
        // (type, offset, size, link)
        Ok((u32_at(s + 4)?, u64_at(s + 0x18)?, u64_at(s + 0x20)?, u32_at(s + 0x28)?))
    };
    const SHT_DYNAMIC: u32 = 6;
    const DT_SONAME: u64 = 14;
    for i in 0..shnum {
        let (ty, off, size, link) = section(i)?;
        if ty != SHT_DYNAMIC {
            continue;
        }
        let (_, stroff, _, _) = section(link as usize)?;
        for e in (off..off + size).step_by(16) {
            let (tag, val) = (u64_at(e as usize)?, u64_at(e as usize + 8)?);
            if tag == 0 {
                break;
            }
            if tag == DT_SONAME {
                let start = (stroff + val) as usize;
                let end = bytes[start..].iter().position(|&b| b == 0).ok_or("unterminated name")?;
                return Ok(String::from_utf8_lossy(&bytes[start..start + end]).into_owned());
            }
        }
        return Err("no DT_SONAME in the dynamic section".into());
    }
    Err("no dynamic section".into())
}

#[test]
fn soname_is_libnccl_so_2() {
    let path = lib_path();
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(soname(&bytes).unwrap(), "libnccl.so.2");
}

/// Every function of NCCL 2.28's host ABI that oxccl exports.
const FUNCTIONS: &[&str] = &[
    "GetVersion",
    "GetErrorString",
    "GetLastError",
    "ResetDebugInit",
    "GetUniqueId",
    "CommInitRank",
    "CommInitRankConfig",
    "CommInitRankScalable",
    "CommInitAll",
    "CommFinalize",
    "CommDestroy",
    "CommAbort",
    "CommRevoke",
    "CommSplit",
    "CommShrink",
    "CommGetAsyncError",
    "CommCount",
    "CommCuDevice",
    "CommUserRank",
    "CommRegister",
    "CommDeregister",
    "CommWindowRegister",
    "CommWindowDeregister",
    "MemAlloc",
    "MemFree",
    "RedOpCreatePreMulSum",
    "RedOpDestroy",
    "AllReduce",
    "Broadcast",
    "Bcast",
    "Reduce",
    "AllGather",
    "ReduceScatter",
    "AlltoAll",
    "Gather",
    "Scatter",
    "Send",
    "Recv",
    "GroupStart",
    "GroupEnd",
    "GroupSimulateEnd",
    "DevCommCreate",
    "DevCommDestroy",
    "LsaBarrierCreateRequirement",
    "GinBarrierCreateRequirement",
    "LLA2ACreateRequirement",
];

#[test]
fn every_function_resolves_under_both_names() {
    let lib = &nccl().lib;
    let mut missing = Vec::new();
    for f in FUNCTIONS {
        for name in [format!("nccl{f}"), format!("pnccl{f}")] {
            // SAFETY: only the address is looked up, never called.
            if unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err() {
                missing.push(name);
            }
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:?}");
}

#[test]
fn version_is_2_28_3() {
    let mut v: c_int = 0;
    // SAFETY: a writable int.
    expect(unsafe { (nccl().get_version)(&mut v) }, SUCCESS, &[]);
    assert_eq!(v, 22803);
}

#[test]
fn error_strings_are_nccls() {
    let text = |c: c_int| {
        // SAFETY: the library returns static NUL-terminated strings.
        unsafe { CStr::from_ptr((nccl().get_error_string)(c)) }.to_string_lossy().into_owned()
    };
    assert_eq!(text(0), "no error");
    assert_eq!(text(1), "unhandled cuda error (run with NCCL_DEBUG=INFO for details)");
    assert_eq!(text(2), "unhandled system error (run with NCCL_DEBUG=INFO for details)");
    assert!(text(3).starts_with("internal error - please report this issue to the "), "{}", text(3));
    assert_eq!(text(4), "invalid argument (run with NCCL_DEBUG=WARN for details)");
    assert_eq!(text(5), "invalid usage (run with NCCL_DEBUG=WARN for details)");
    assert_eq!(text(6), "remote process exited or there was a network error");
    assert_eq!(text(7), "NCCL operation in progress");
    assert_eq!(text(8), "operation timed out");
    for c in [9, 42, -1, c_int::MIN] {
        assert_eq!(text(c), "unknown result code");
    }
    // Twins return the same texts.
    // SAFETY: the symbol is ncclGetErrorString's twin.
    let p = unsafe { nccl().lib.get::<unsafe extern "C" fn(c_int) -> *const std::ffi::c_char>(b"pncclGetErrorString") }
        .unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { CStr::from_ptr(p(5)) }.to_string_lossy(), text(5));
    // SAFETY: a no-op.
    unsafe { (nccl().reset_debug_init)() };
}

#[test]
fn unique_id_is_128_bytes_the_rust_api_reads() {
    let id = unique_id();
    assert_eq!(std::mem::size_of_val(&id), 128);
    let parsed = oxccl::bootstrap::UniqueId::from_bytes(&id.internal).expect("oxccl reads the C unique id");
    assert_eq!(parsed.to_bytes(), id.internal);
    assert_ne!(unique_id().internal, id.internal, "each call gives a new id");
}
