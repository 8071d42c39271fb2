//! The library file: its SONAME, its exported functions (each with its `pnccl` twin), the
//! version and the error strings.
use crate::common::*;
use std::ffi::{CStr, c_int};

/// The sections of the ELF64 little-endian file `bytes`: (type, offset, size, link).
fn sections(bytes: &[u8]) -> Result<Vec<(u32, usize, usize, usize)>, String> {
    if bytes.get(0..4) != Some(b"\x7fELF") || bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err("not an ELF64 little-endian file".into());
    }
    let shoff = u64_at(bytes, 0x28)? as usize;
    let shentsize = u16_at(bytes, 0x3a)? as usize;
    let shnum = u16_at(bytes, 0x3c)? as usize;
    (0..shnum)
        .map(|i| {
            let s = shoff + i * shentsize;
            Ok((
                u32_at(bytes, s + 4)?,
                u64_at(bytes, s + 0x18)? as usize,
                u64_at(bytes, s + 0x20)? as usize,
                u32_at(bytes, s + 0x28)? as usize,
            ))
        })
        .collect()
}

fn u16_at(b: &[u8], o: usize) -> Result<u16, String> {
    b.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]])).ok_or_else(|| "truncated".into())
}

fn u32_at(b: &[u8], o: usize) -> Result<u32, String> {
    b.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).ok_or_else(|| "truncated".into())
}

fn u64_at(b: &[u8], o: usize) -> Result<u64, String> {
    b.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).ok_or_else(|| "truncated".into())
}

/// The NUL-terminated string at `at` of `bytes`.
fn c_str(bytes: &[u8], at: usize) -> Result<String, String> {
    let tail = bytes.get(at..).ok_or("string past the end")?;
    let end = tail.iter().position(|&b| b == 0).ok_or("unterminated string")?;
    Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
}

/// The DT_SONAME of the shared library `bytes`, from its dynamic section and the string table
/// that section links to.
fn soname(bytes: &[u8]) -> Result<String, String> {
    const SHT_DYNAMIC: u32 = 6;
    const DT_SONAME: u64 = 14;
    let secs = sections(bytes)?;
    let &(_, off, size, link) = secs.iter().find(|s| s.0 == SHT_DYNAMIC).ok_or("no dynamic section")?;
    let strtab = secs.get(link).ok_or("bad string table link")?.1;
    for e in (off..off + size).step_by(16) {
        match (u64_at(bytes, e)?, u64_at(bytes, e + 8)?) {
            (0, _) => break,
            (DT_SONAME, val) => return c_str(bytes, strtab + val as usize),
            _ => {}
        }
    }
    Err("no DT_SONAME in the dynamic section".into())
}

/// The names of the functions and objects the shared library `bytes` defines and exports
/// (`.dynsym` entries with a section, global or weak binding).
fn exported(bytes: &[u8]) -> Result<Vec<String>, String> {
    const SHT_DYNSYM: u32 = 11;
    let secs = sections(bytes)?;
    let &(_, off, size, link) = secs.iter().find(|s| s.0 == SHT_DYNSYM).ok_or("no .dynsym")?;
    let strtab = secs.get(link).ok_or("bad string table link")?.1;
    let mut names = Vec::new();
    for e in (off..off + size).step_by(24) {
        let (name, info, shndx) = (u32_at(bytes, e)?, bytes[e + 4], u16_at(bytes, e + 6)?);
        let binding = info >> 4; // 1 global, 2 weak
        if shndx != 0 && (binding == 1 || binding == 2) {
            names.push(c_str(bytes, strtab + name as usize)?);
        }
    }
    Ok(names)
}

fn library_bytes() -> Vec<u8> {
    let path = lib_path();
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn soname_is_libnccl_so_2() {
    assert_eq!(soname(&library_bytes()).unwrap(), "libnccl.so.2");
}

/// Only NCCL's names leave the library (NCCL's version script: `nccl*` and `pnccl*`), so
/// nothing of Rust's or oxccl's can clash with the program's own symbols.
#[test]
fn only_nccl_names_are_exported() {
    let names = exported(&library_bytes()).unwrap();
    let foreign: Vec<&String> = names.iter().filter(|n| !n.starts_with("nccl") && !n.starts_with("pnccl")).collect();
    assert!(foreign.is_empty(), "exported besides nccl*/pnccl*: {foreign:?}");
    for f in FUNCTIONS {
        assert!(names.contains(&format!("nccl{f}")) && names.contains(&format!("pnccl{f}")), "{f}");
    }
    assert_eq!(names.len(), 2 * FUNCTIONS.len(), "exactly the listed functions, each twice");
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
