//! `libnccl-net-oxtest.so`: a minimal NCCL network plugin for oxccl's tests. It exports
//! `ncclNetPlugin_v8` (NCCL's `ext-net/example/nccl/net_v8.h`) and, with the default feature
//! `v9`, `ncclNetPlugin_v9` (`net_v9.h`: `size_t` sizes, larger properties), both named "OxTest",
//! over plain TCP on loopback, and checks how it is used, the way an RDMA plugin's hardware would:
//!
//! - every `isend`/`irecv` must carry a memory handle from `regMr` on the same connection that
//!   covers the whole buffer (else `ncclInvalidUsage`, and a WARN through NCCL's logger);
//! - `regMr` accepts only `NCCL_PTR_HOST`;
//! - at most [`MAX_REQUESTS`] requests per connection (NCCL's `NCCL_NET_MAX_REQUESTS`): more is
//!   an error, as in NCCL's IB plugin;
//! - closing a connection with memory still registered is reported (WARN).
//!
//! On close each connection reports its traffic, its `regMr` calls and which interface posted its
//! requests (INFO `NET/OxTest : send comm closed: N messages, B bytes, R registrations, v8 posts
//! P8, v9 posts P9`), so a test can tell that data went through
//! the plugin and how memory was registered. Messages are framed
//! by a 4-byte little-endian length; a receive longer than its buffer fails the connection.
//!
//! The plugin is a test fixture: it listens on 127.0.0.1 only and connects blocking (loopback
//! connects at once).
#![allow(non_upper_case_globals, non_camel_case_types)]

use std::collections::VecDeque;
use std::ffi::{CString, c_char, c_int, c_ulong, c_void};
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::Duration;

// ncclResult_t values.
const SUCCESS: c_int = 0;
const SYSTEM_ERROR: c_int = 2;
const INTERNAL_ERROR: c_int = 3;
const INVALID_ARGUMENT: c_int = 4;
const INVALID_USAGE: c_int = 5;
const REMOTE_ERROR: c_int = 6;

const PTR_HOST: c_int = 0x1;
const HANDLE_BYTES: usize = 128;
/// NCCL's `NCCL_NET_MAX_REQUESTS` (v8): requests per connection.
const MAX_REQUESTS: usize = 32;
const MAGIC: u64 = 0x4f58_5445_5354_4e45; // "OXTESTNE"

// ncclDebugLogLevel and the NCCL_NET subsystem flag.
const LOG_WARN: c_int = 2;
const LOG_INFO: c_int = 3;
const SUBSYS_NET: c_ulong = 16;

type DebugLogger = unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...);

#[repr(C)]
pub struct NetProperties {
    name: *const c_char,
    pci_path: *const c_char,
    guid: u64,
    ptr_support: c_int,
    reg_is_global: c_int,
    speed: c_int,
    port: c_int,
    latency: f32,
    max_comms: c_int,
    max_recvs: c_int,
    net_device_type: c_int,
    net_device_version: c_int,
}

/// `ncclNet_v8_t`: the function table NCCL (and oxccl) reads from `ncclNetPlugin_v8`.
#[repr(C)]
pub struct NetV8 {
    name: *const c_char,
    init: unsafe extern "C" fn(Option<DebugLogger>) -> c_int,
    devices: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_properties: unsafe extern "C" fn(c_int, *mut NetProperties) -> c_int,
    listen: unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> c_int,
    connect: unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void, *mut *mut c_void) -> c_int,
    accept: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> c_int,
    reg_mr_dma_buf: Option<unsafe extern "C" fn()>,
    dereg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    isend:
        unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, c_int, *mut c_void, *mut *mut c_void) -> c_int,
    irecv: unsafe extern "C" fn(
        *mut c_void,
        c_int,
        *mut *mut c_void,
        *mut c_int,
        *mut c_int,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int,
    iflush: Option<unsafe extern "C" fn()>,
    test: unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int,
    close_send: unsafe extern "C" fn(*mut c_void) -> c_int,
    close_recv: unsafe extern "C" fn(*mut c_void) -> c_int,
    close_listen: unsafe extern "C" fn(*mut c_void) -> c_int,
    get_device_mr: Option<unsafe extern "C" fn()>,
    irecv_consumed: Option<unsafe extern "C" fn()>,
}

/// The exported table (raw pointers in a static need `Sync`).
#[repr(transparent)]
pub struct Exported<T>(T);
// SAFETY: the table is immutable; its pointers are to 'static strings and functions.
unsafe impl<T> Sync for Exported<T> {}

/// `ncclNetProperties_v9_t`.
#[cfg(feature = "v9")]
#[repr(C)]
pub struct NetPropertiesV9 {
    name: *const c_char,
    pci_path: *const c_char,
    guid: u64,
    ptr_support: c_int,
    reg_is_global: c_int,
    force_flush: c_int,
    speed: c_int,
    port: c_int,
    latency: f32,
    max_comms: c_int,
    max_recvs: c_int,
    net_device_type: c_int,
    net_device_version: c_int,
    v_ndevs: c_int,
    v_devs: [c_int; 4],
    max_p2p_bytes: usize,
    max_coll_bytes: usize,
}

/// `ncclNet_v9_t`.
#[cfg(feature = "v9")]
#[repr(C)]
pub struct NetV9 {
    name: *const c_char,
    init: unsafe extern "C" fn(Option<DebugLogger>) -> c_int,
    devices: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_properties: unsafe extern "C" fn(c_int, *mut NetPropertiesV9) -> c_int,
    listen: unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> c_int,
    connect: unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void, *mut *mut c_void) -> c_int,
    accept: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> c_int,
    reg_mr_dma_buf: Option<unsafe extern "C" fn()>,
    dereg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    isend:
        unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut c_void, *mut *mut c_void) -> c_int,
    irecv: unsafe extern "C" fn(
        *mut c_void,
        c_int,
        *mut *mut c_void,
        *mut usize,
        *mut c_int,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int,
    iflush: Option<unsafe extern "C" fn()>,
    test: unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int,
    close_send: unsafe extern "C" fn(*mut c_void) -> c_int,
    close_recv: unsafe extern "C" fn(*mut c_void) -> c_int,
    close_listen: unsafe extern "C" fn(*mut c_void) -> c_int,
    get_device_mr: Option<unsafe extern "C" fn()>,
    irecv_consumed: Option<unsafe extern "C" fn()>,
    make_v_device: Option<unsafe extern "C" fn()>,
}

#[cfg(feature = "v9")]
#[unsafe(no_mangle)]
pub static ncclNetPlugin_v9: Exported<NetV9> = Exported(NetV9 {
    name: c"OxTest".as_ptr(),
    init,
    devices,
    get_properties: get_properties_v9,
    listen,
    connect,
    accept,
    reg_mr,
    reg_mr_dma_buf: None,
    dereg_mr,
    isend: isend_v9,
    irecv: irecv_v9,
    iflush: None,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: None,
    irecv_consumed: None,
    make_v_device: None,
});

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: Exported<NetV8> = Exported(NetV8 {
    name: c"OxTest".as_ptr(),
    init,
    devices,
    get_properties,
    listen,
    connect,
    accept,
    reg_mr,
    reg_mr_dma_buf: None,
    dereg_mr,
    isend,
    irecv,
    iflush: None,
    test,
    close_send,
    close_recv,
    close_listen,
    get_device_mr: None,
    irecv_consumed: None,
});

static LOGGER: Mutex<Option<DebugLogger>> = Mutex::new(None);

/// Logs `msg` through the logger `init` was given (the message is the format: it holds no '%').
fn log(level: c_int, line: u32, msg: &str) {
    let Some(f) = *LOGGER.lock().unwrap_or_else(|p| p.into_inner()) else {
        return;
    };
    let Ok(m) = CString::new(msg.replace('%', "percent")) else {
        return;
    };
    // SAFETY: NCCL's logger contract: level, subsystem flags, file, line, then a printf format
    // without conversions (so no variadic arguments).
    unsafe {
        f(
            level,
            SUBSYS_NET,
            c"net-plugin/lib.rs".as_ptr(),
            line as c_int,
            m.as_ptr(),
        )
    };
}

struct Listen {
    listener: TcpListener,
    nonce: u64,
}

/// A connection (send or receive side).
struct Comm {
    stream: TcpStream,
    send: bool,
    queue: VecDeque<*mut Req>,
    /// Every request not yet reported done (freed on close).
    live: Vec<*mut Req>,
    failed: bool,
    /// Memory registrations alive on this connection.
    mrs: usize,
    /// `regMr` calls on this connection.
    regs: u64,
    /// Requests posted through the v8 and the v9 `isend`/`irecv`.
    posts: [u64; 2],
    messages: u64,
    bytes: u64,
}

struct Req {
    comm: *mut Comm,
    send: bool,
    ptr: *mut u8,
    cap: usize,
    len: [u8; 4],
    len_done: usize,
    size: usize,
    done: usize,
    finished: bool,
}

/// A registration: the connection and the byte range.
struct Mr {
    comm: *mut c_void,
    start: usize,
    end: usize,
}

unsafe extern "C" fn init(logger: Option<DebugLogger>) -> c_int {
    *LOGGER.lock().unwrap_or_else(|p| p.into_inner()) = logger;
    log(LOG_INFO, line!(), "NET/OxTest : initialized (TCP on 127.0.0.1)");
    SUCCESS
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> c_int {
    // SAFETY: the caller passes a valid pointer (plugin contract).
    unsafe { *ndev = 1 };
    SUCCESS
}

unsafe extern "C" fn get_properties(dev: c_int, props: *mut NetProperties) -> c_int {
    if dev != 0 {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a valid, writable properties struct.
    unsafe {
        props.write(NetProperties {
            name: c"oxtest0".as_ptr(),
            pci_path: std::ptr::null(),
            guid: 0x0c7e_5700,
            ptr_support: PTR_HOST,
            reg_is_global: 0,
            speed: 10_000,
            port: 0,
            latency: 0.0,
            max_comms: 65_536,
            max_recvs: 1,
            net_device_type: 0,
            net_device_version: 0,
        })
    };
    SUCCESS
}

unsafe extern "C" fn listen(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> c_int {
    if dev != 0 {
        return INVALID_ARGUMENT;
    }
    let Ok(listener) = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)) else {
        return SYSTEM_ERROR;
    };
    let (Ok(()), Ok(SocketAddr::V4(addr))) = (listener.set_nonblocking(true), listener.local_addr()) else {
        return SYSTEM_ERROR;
    };
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64)
        ^ (std::process::id() as u64) << 32;
    let mut h = [0u8; HANDLE_BYTES];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&nonce.to_le_bytes());
    h[16..20].copy_from_slice(&addr.ip().octets());
    h[20..22].copy_from_slice(&addr.port().to_le_bytes());
    // SAFETY: `handle` has NCCL_NET_HANDLE_MAXSIZE bytes; `listen_comm` is writable.
    unsafe {
        std::ptr::copy_nonoverlapping(h.as_ptr(), handle.cast(), HANDLE_BYTES);
        *listen_comm = Box::into_raw(Box::new(Listen { listener, nonce })).cast();
    }
    SUCCESS
}

fn new_comm(stream: TcpStream, send: bool) -> Option<*mut c_void> {
    stream.set_nodelay(true).ok()?;
    stream.set_nonblocking(true).ok()?;
    Some(
        Box::into_raw(Box::new(Comm {
            stream,
            send,
            queue: VecDeque::new(),
            live: Vec::new(),
            failed: false,
            mrs: 0,
            regs: 0,
            posts: [0; 2],
            messages: 0,
            bytes: 0,
        }))
        .cast(),
    )
}

unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut c_void,
) -> c_int {
    if dev != 0 {
        return INVALID_ARGUMENT;
    }
    let mut h = [0u8; HANDLE_BYTES];
    // SAFETY: `handle` has NCCL_NET_HANDLE_MAXSIZE bytes.
    unsafe { std::ptr::copy_nonoverlapping(handle.cast::<u8>(), h.as_mut_ptr(), HANDLE_BYTES) };
    if h[0..8] != MAGIC.to_le_bytes() {
        log(LOG_WARN, line!(), "NET/OxTest : connect: not an OxTest handle");
        return INVALID_USAGE;
    }
    let ip = Ipv4Addr::new(h[16], h[17], h[18], h[19]);
    let port = u16::from_le_bytes([h[20], h[21]]);
    let Ok(mut stream) = TcpStream::connect((ip, port)) else {
        return REMOTE_ERROR;
    };
    if stream.write_all(&h[0..16]).is_err() {
        return REMOTE_ERROR;
    }
    match new_comm(stream, true) {
        // SAFETY: `send_comm` is writable.
        Some(c) => unsafe { *send_comm = c },
        None => return SYSTEM_ERROR,
    }
    SUCCESS
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _recv_dev_comm: *mut *mut c_void,
) -> c_int {
    // SAFETY: `listen_comm` came from `listen` and is not closed (plugin contract).
    let l = unsafe { &*listen_comm.cast::<Listen>() };
    // SAFETY: `recv_comm` is writable.
    unsafe { *recv_comm = std::ptr::null_mut() };
    let mut stream = match l.listener.accept() {
        Ok((s, _)) => s,
        Err(e) if e.kind() == ErrorKind::WouldBlock => return SUCCESS,
        Err(_) => return SYSTEM_ERROR,
    };
    let mut hello = [0u8; 16];
    let ok = stream.set_nonblocking(false).is_ok()
        && stream.set_read_timeout(Some(Duration::from_secs(5))).is_ok()
        && stream.read_exact(&mut hello).is_ok()
        && hello[0..8] == MAGIC.to_le_bytes()
        && hello[8..16] == l.nonce.to_le_bytes()
        && stream.set_read_timeout(None).is_ok();
    if !ok {
        log(
            LOG_WARN,
            line!(),
            "NET/OxTest : accept: dropped a connection without the greeting",
        );
        return SUCCESS;
    }
    match new_comm(stream, false) {
        // SAFETY: as above.
        Some(c) => unsafe { *recv_comm = c },
        None => return SYSTEM_ERROR,
    }
    SUCCESS
}

unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    mhandle: *mut *mut c_void,
) -> c_int {
    if ty != PTR_HOST {
        log(
            LOG_WARN,
            line!(),
            &format!("NET/OxTest : regMr: type {ty} is not NCCL_PTR_HOST"),
        );
        return INVALID_ARGUMENT;
    }
    // SAFETY: `comm` is an open send or receive comm of this plugin (plugin contract).
    unsafe {
        (*comm.cast::<Comm>()).mrs += 1;
        (*comm.cast::<Comm>()).regs += 1;
    }
    let mr = Mr {
        comm,
        start: data as usize,
        end: data as usize + size,
    };
    // SAFETY: `mhandle` is writable.
    unsafe { *mhandle = Box::into_raw(Box::new(mr)).cast() };
    SUCCESS
}

unsafe extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> c_int {
    if mhandle.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: `mhandle` came from `reg_mr` and is deregistered once (plugin contract).
    let mr = unsafe { Box::from_raw(mhandle.cast::<Mr>()) };
    if mr.comm != comm {
        log(
            LOG_WARN,
            line!(),
            "NET/OxTest : deregMr: the handle belongs to another comm",
        );
        return INVALID_USAGE;
    }
    // SAFETY: `comm` is open (plugin contract).
    unsafe { (*comm.cast::<Comm>()).mrs -= 1 };
    SUCCESS
}

/// Whether `mhandle` is a registration of `comm` covering `ptr..ptr+size`.
fn covered(comm: *mut c_void, mhandle: *mut c_void, ptr: usize, size: usize) -> bool {
    if mhandle.is_null() {
        return false;
    }
    // SAFETY: a non-null handle came from `reg_mr` (plugin contract); checked before use.
    let mr = unsafe { &*mhandle.cast::<Mr>() };
    mr.comm == comm && mr.start <= ptr && ptr + size <= mr.end
}

/// Queues a request on `comm`; the result code.
fn post(
    comm: *mut c_void,
    send: bool,
    ptr: *mut u8,
    size: usize,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
    v9: bool,
) -> c_int {
    // SAFETY: `request` is writable.
    unsafe { *request = std::ptr::null_mut() };
    if size > u32::MAX as usize {
        return INVALID_ARGUMENT;
    }
    if !covered(comm, mhandle, ptr as usize, size) {
        log(
            LOG_WARN,
            line!(),
            &format!(
                "NET/OxTest : {} of {size} bytes without a registration covering it",
                if send { "isend" } else { "irecv" }
            ),
        );
        return INVALID_USAGE;
    }
    // SAFETY: `comm` is an open comm of this plugin (plugin contract).
    let c = unsafe { &mut *comm.cast::<Comm>() };
    if c.send != send {
        return INVALID_USAGE;
    }
    if c.failed {
        return REMOTE_ERROR;
    }
    if c.queue.len() >= MAX_REQUESTS {
        log(
            LOG_WARN,
            line!(),
            "NET/OxTest : more than NCCL_NET_MAX_REQUESTS requests on one comm",
        );
        return INTERNAL_ERROR;
    }
    let r = Box::into_raw(Box::new(Req {
        comm: c,
        send,
        ptr,
        cap: size,
        len: if send { (size as u32).to_le_bytes() } else { [0; 4] },
        len_done: 0,
        size: if send { size } else { 0 },
        done: 0,
        finished: false,
    }));
    c.queue.push_back(r);
    c.live.push(r);
    c.posts[v9 as usize] += 1;
    // SAFETY: as above.
    unsafe { *request = r.cast() };
    SUCCESS
}

unsafe extern "C" fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> c_int {
    if size < 0 {
        return INVALID_ARGUMENT;
    }
    post(
        send_comm,
        true,
        data.cast(),
        size as usize,
        mhandle,
        request,
        false,
    )
}

unsafe extern "C" fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> c_int {
    if n != 1 {
        // maxRecvs is 1.
        return INVALID_ARGUMENT;
    }
    // SAFETY: the arrays hold `n` entries (plugin contract).
    let (d, s, m) = unsafe { (*data, *sizes, *mhandles) };
    if s < 0 {
        return INVALID_ARGUMENT;
    }
    post(recv_comm, false, d.cast(), s as usize, m, request, false)
}

/// v9's `isend`: as v8's with a `size_t` size.
#[cfg(feature = "v9")]
unsafe extern "C" fn isend_v9(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> c_int {
    post(send_comm, true, data.cast(), size, mhandle, request, true)
}

/// v9's `irecv`: as v8's with `size_t` sizes.
#[cfg(feature = "v9")]
unsafe extern "C" fn irecv_v9(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> c_int {
    if n != 1 {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the arrays hold `n` entries (plugin contract).
    let (d, s, m) = unsafe { (*data, *sizes, *mhandles) };
    post(recv_comm, false, d.cast(), s, m, request, true)
}

/// v9's `getProperties`: v8's fields plus `forceFlush`, the virtual-device list and the
/// transfer limits.
#[cfg(feature = "v9")]
unsafe extern "C" fn get_properties_v9(dev: c_int, props: *mut NetPropertiesV9) -> c_int {
    let mut p8 = std::mem::MaybeUninit::<NetProperties>::uninit();
    // SAFETY: `p8` is writable; get_properties fills all of it on success.
    let rc = unsafe { get_properties(dev, p8.as_mut_ptr()) };
    if rc != SUCCESS {
        return rc;
    }
    // SAFETY: initialized by the successful call above.
    let p = unsafe { p8.assume_init() };
    // SAFETY: the caller passes a valid, writable v9 properties struct.
    unsafe {
        props.write(NetPropertiesV9 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            force_flush: 0,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
            v_ndevs: 1,
            v_devs: [0; 4],
            max_p2p_bytes: u32::MAX as usize,
            max_coll_bytes: u32::MAX as usize,
        })
    };
    SUCCESS
}

/// Moves `r` forward as far as the socket allows; `Ok(true)` once finished.
fn step(s: &mut TcpStream, r: &mut Req) -> std::io::Result<bool> {
    loop {
        if r.len_done == 4 && r.done == r.size {
            return Ok(true);
        }
        let n = if r.send {
            // SAFETY: isend's contract keeps the buffer valid until the request is done.
            let data = unsafe { std::slice::from_raw_parts(r.ptr, r.size) };
            s.write_vectored(&[IoSlice::new(&r.len[r.len_done..]), IoSlice::new(&data[r.done..])])
        } else if r.len_done < 4 {
            s.read(&mut r.len[r.len_done..])
        } else {
            // SAFETY: irecv's contract keeps the buffer valid; size <= cap was checked.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr, r.size) };
            s.read(&mut buf[r.done..])
        };
        match n {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(mut n) => {
                let h = n.min(4 - r.len_done);
                r.len_done += h;
                n -= h;
                r.done += n;
                if !r.send && h > 0 && r.len_done == 4 {
                    r.size = u32::from_le_bytes(r.len) as usize;
                    if r.size > r.cap {
                        return Err(ErrorKind::InvalidData.into());
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, size: *mut c_int) -> c_int {
    let r = request.cast::<Req>();
    // SAFETY: `request` came from isend/irecv and was not reported done yet; its comm is open.
    let c = unsafe { &mut *(*r).comm };
    while !c.failed
        && let Some(&front) = c.queue.front()
    {
        // SAFETY: queued requests are live.
        let fr = unsafe { &mut *front };
        match step(&mut c.stream, fr) {
            Ok(true) => {
                fr.finished = true;
                c.messages += 1;
                c.bytes += fr.size as u64;
                c.queue.pop_front();
            }
            Ok(false) => break,
            Err(e) => {
                log(LOG_WARN, line!(), &format!("NET/OxTest : connection failed: {e}"));
                c.failed = true;
            }
        }
    }
    // SAFETY: as above.
    let rr = unsafe { &*r };
    if !rr.finished {
        if c.failed {
            return REMOTE_ERROR;
        }
        // SAFETY: `done` is writable.
        unsafe { *done = 0 };
        return SUCCESS;
    }
    // SAFETY: `done` is writable, `size` writable when not null.
    unsafe {
        *done = 1;
        if !size.is_null() {
            *size = rr.size as c_int;
        }
    }
    c.live.retain(|&x| x != r);
    // SAFETY: reported done: the request is freed here, once.
    drop(unsafe { Box::from_raw(r) });
    SUCCESS
}

fn close_comm(comm: *mut c_void) -> c_int {
    // SAFETY: `comm` came from connect/accept and is closed once (plugin contract).
    let c = unsafe { Box::from_raw(comm.cast::<Comm>()) };
    let side = if c.send { "send" } else { "recv" };
    if c.mrs != 0 {
        log(
            LOG_WARN,
            line!(),
            &format!(
                "NET/OxTest : {side} comm closed with {} registrations left",
                c.mrs
            ),
        );
    }
    log(
        LOG_INFO,
        line!(),
        &format!(
            "NET/OxTest : {side} comm closed: {} messages, {} bytes, {} registrations, v8 posts {}, v9 posts {}",
            c.messages, c.bytes, c.regs, c.posts[0], c.posts[1]
        ),
    );
    for r in c.live {
        // SAFETY: requests not reported done belong to the comm.
        drop(unsafe { Box::from_raw(r) });
    }
    SUCCESS
}

unsafe extern "C" fn close_send(send_comm: *mut c_void) -> c_int {
    close_comm(send_comm)
}

unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> c_int {
    close_comm(recv_comm)
}

unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> c_int {
    // SAFETY: `listen_comm` came from `listen` and is closed once.
    drop(unsafe { Box::from_raw(listen_comm.cast::<Listen>()) });
    SUCCESS
}
