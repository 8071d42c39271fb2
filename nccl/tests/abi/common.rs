//! Loading libnccl.so as a C program does, and the C types the tests pass through it (written
//! here again from the ABI, independently of the library's own definitions).
use libloading::Library;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

pub type Comm = *mut c_void;
pub type Stream = *mut c_void;

pub const SUCCESS: c_int = 0;
pub const SYSTEM_ERROR: c_int = 2;
pub const INVALID_ARGUMENT: c_int = 4;
pub const INVALID_USAGE: c_int = 5;
pub const IN_PROGRESS: c_int = 7;

pub const INT8: c_int = 0;
pub const INT32: c_int = 2;
pub const FLOAT: c_int = 7;
pub const FLOAT8E4M3: c_int = 10;
pub const SUM: c_int = 0;
pub const MAX: c_int = 2;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

pub const UNDEF: c_int = c_int::MIN;

/// `ncclConfig_t` of NCCL 2.28 (80 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Config {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
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

impl Config {
    /// `NCCL_CONFIG_INITIALIZER`.
    pub fn initializer() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 22803,
            blocking: UNDEF,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
            traffic_class: UNDEF,
            comm_name: std::ptr::null(),
            collnet_enable: UNDEF,
            cta_policy: UNDEF,
            shrink_share: UNDEF,
            nvls_ctas: UNDEF,
            n_channels_per_net_peer: UNDEF,
            nvlink_centric_sched: UNDEF,
        }
    }
}

#[repr(C)]
pub struct SimInfo {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub estimated_time: f32,
}

impl SimInfo {
    /// `NCCL_SIM_INFO_INITIALIZER` (`estimatedTime` is NCCL's undefined float, -1).
    pub fn initializer() -> SimInfo {
        SimInfo {
            size: std::mem::size_of::<SimInfo>(),
            magic: 0x7468_5283,
            version: 22803,
            estimated_time: -1.0,
        }
    }
}

/// The library this test run built: `cargo test` builds it (as a dependency of the tests) into
/// `target/<profile>/deps/`, beside the test executable; `cargo build` leaves it one level up.
pub fn lib_path() -> PathBuf {
    if let Some(p) = option_env!("CARGO_CDYLIB_FILE_NCCL") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    let beside = deps.join("libnccl.so");
    match deps.parent() {
        Some(profile) if !beside.exists() => profile.join("libnccl.so"),
        _ => beside,
    }
}

macro_rules! api {
    ($($field:ident = $sym:literal : fn($($a:ty),*) $(-> $r:ty)?;)*) => {
        /// The library's functions, by their `nccl` names.
        pub struct Nccl {
            pub lib: Library,
            $(pub $field: unsafe extern "C" fn($($a),*) $(-> $r)?,)*
        }
        impl Nccl {
            fn load(lib: Library) -> Nccl {
                $(
                    // SAFETY: the symbol is the function of this type that nccl.h declares.
                    let $field = *unsafe { lib.get::<unsafe extern "C" fn($($a),*) $(-> $r)?>($sym) }
                        .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy($sym)));
                )*
                Nccl { lib, $($field,)* }
            }
        }
    };
}

api! {
    get_version = b"ncclGetVersion": fn(*mut c_int) -> c_int;
    get_error_string = b"ncclGetErrorString": fn(c_int) -> *const c_char;
    get_last_error = b"ncclGetLastError": fn(Comm) -> *const c_char;
    reset_debug_init = b"ncclResetDebugInit": fn();
    get_unique_id = b"ncclGetUniqueId": fn(*mut UniqueId) -> c_int;
    init_rank = b"ncclCommInitRank": fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
    init_rank_config = b"ncclCommInitRankConfig": fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> c_int;
    init_rank_scalable = b"ncclCommInitRankScalable": fn(*mut Comm, c_int, c_int, c_int, *mut UniqueId, *mut Config) -> c_int;
    init_all = b"ncclCommInitAll": fn(*mut Comm, c_int, *const c_int) -> c_int;
    finalize = b"ncclCommFinalize": fn(Comm) -> c_int;
    destroy = b"ncclCommDestroy": fn(Comm) -> c_int;
    abort = b"ncclCommAbort": fn(Comm) -> c_int;
    revoke = b"ncclCommRevoke": fn(Comm, c_int) -> c_int;
    split = b"ncclCommSplit": fn(Comm, c_int, c_int, *mut Comm, *mut Config) -> c_int;
    shrink = b"ncclCommShrink": fn(Comm, *mut c_int, c_int, *mut Comm, *mut Config, c_int) -> c_int;
    get_async_error = b"ncclCommGetAsyncError": fn(Comm, *mut c_int) -> c_int;
    count = b"ncclCommCount": fn(Comm, *mut c_int) -> c_int;
    cu_device = b"ncclCommCuDevice": fn(Comm, *mut c_int) -> c_int;
    user_rank = b"ncclCommUserRank": fn(Comm, *mut c_int) -> c_int;
    register = b"ncclCommRegister": fn(Comm, *mut c_void, usize, *mut *mut c_void) -> c_int;
    deregister = b"ncclCommDeregister": fn(Comm, *mut c_void) -> c_int;
    window_register = b"ncclCommWindowRegister": fn(Comm, *mut c_void, usize, *mut *mut c_void, c_int) -> c_int;
    window_deregister = b"ncclCommWindowDeregister": fn(Comm, *mut c_void) -> c_int;
    mem_alloc = b"ncclMemAlloc": fn(*mut *mut c_void, usize) -> c_int;
    mem_free = b"ncclMemFree": fn(*mut c_void) -> c_int;
    redop_create = b"ncclRedOpCreatePreMulSum": fn(*mut c_int, *mut c_void, c_int, c_int, Comm) -> c_int;
    redop_destroy = b"ncclRedOpDestroy": fn(c_int, Comm) -> c_int;
    all_reduce = b"ncclAllReduce": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    broadcast = b"ncclBroadcast": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    bcast = b"ncclBcast": fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    reduce = b"ncclReduce": fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, Comm, Stream) -> c_int;
    all_gather = b"ncclAllGather": fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int;
    reduce_scatter = b"ncclReduceScatter": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    all_to_all = b"ncclAlltoAll": fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int;
    gather = b"ncclGather": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    scatter = b"ncclScatter": fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    send = b"ncclSend": fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    recv = b"ncclRecv": fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;
    group_start = b"ncclGroupStart": fn() -> c_int;
    group_end = b"ncclGroupEnd": fn() -> c_int;
    group_simulate_end = b"ncclGroupSimulateEnd": fn(*mut SimInfo) -> c_int;
    dev_comm_create = b"ncclDevCommCreate": fn(Comm, *const c_void, *mut c_void) -> c_int;
}

/// The library, loaded once. Communicators it creates are CPU-target ranks
/// (`OXCCL_NCCL_TARGET=cpu`, set before the library is loaded), so everything runs without a
/// GPU; buffers are host memory.
pub fn nccl() -> &'static Nccl {
    static NCCL: OnceLock<Nccl> = OnceLock::new();
    NCCL.get_or_init(|| {
        // SAFETY: set once, before the library (the only reader) is loaded; the harness's other
        // threads touch the environment through std only, which serializes access.
        unsafe { std::env::set_var("OXCCL_NCCL_TARGET", "cpu") };
        let path = lib_path();
        assert!(
            path.exists(),
            "{} is missing: `cargo test -p oxccl-nccl` builds it (or run `cargo build -p oxccl-nccl`)",
            path.display()
        );
        // SAFETY: loading our own library runs no foreign initializers beyond Rust's std.
        let lib = unsafe { Library::new(&path) }.unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        Nccl::load(lib)
    })
}

/// `ncclGetLastError(NULL)`.
pub fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated string valid until this thread's next failure.
    unsafe { CStr::from_ptr((nccl().get_last_error)(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts that a call returned `want` and, for a failure, that `ncclGetLastError` names each of
/// `words`.
#[track_caller]
pub fn expect(code: c_int, want: c_int, words: &[&str]) {
    let msg = if code == SUCCESS { String::new() } else { last_error() };
    assert_eq!(code, want, "result {code} (wanted {want}); last error: {msg}");
    for w in words {
        assert!(msg.contains(w), "the last error should name {w:?}: {msg:?}");
    }
}

/// `ncclGetUniqueId`.
pub fn unique_id() -> UniqueId {
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: a writable id.
    expect(unsafe { (nccl().get_unique_id)(&mut id) }, SUCCESS, &[]);
    id
}

/// A communicator handle as a `Send` value (to move it between threads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle(pub usize);

impl Handle {
    pub fn comm(self) -> Comm {
        std::ptr::without_provenance_mut(self.0)
    }
    pub fn of(c: Comm) -> Handle {
        Handle(c.addr())
    }
}

/// Address of a host buffer, as the C ABI's device pointer on the CPU target.
pub fn ptr<T>(v: &[T]) -> *const c_void {
    v.as_ptr().cast()
}

pub fn mptr<T>(v: &mut [T]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

/// A one-rank communicator (`ncclCommInitRank` with `nranks = 1`).
pub fn one_rank() -> Comm {
    let mut c: Comm = std::ptr::null_mut();
    // SAFETY: a writable handle.
    expect(unsafe { (nccl().init_rank)(&mut c, 1, unique_id(), 0) }, SUCCESS, &[]);
    assert!(!c.is_null());
    c
}

/// `ncclCommDestroy`, expecting success.
pub fn destroy(c: Comm) {
    // SAFETY: a handle of ours.
    expect(unsafe { (nccl().destroy)(c) }, SUCCESS, &[]);
}
