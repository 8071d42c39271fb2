//! NCCL network plugins (NCCL's `src/plugin/net.cc`, `plugin_open.cc` and `net/net_v8.cc`): an
//! existing `libnccl-net*.so` (InfiniBand, EFA, …) drives oxccl's NET transport through the
//! [`Net`] trait, in place of the built-in socket network.
//!
//! **Which library.** As NCCL does it ([`candidates`]): `NCCL_NET_PLUGIN` unset → `libnccl-net.so`;
//! `none` → no plugin; any other value → that name as given (a path or a file name for the dynamic
//! loader), then, for a bare name that is not itself `lib….so`, `libnccl-net-<name>.so`. Libraries
//! are opened with `RTLD_NOW | RTLD_LOCAL`.
//!
//! **Which interface.** The library must export `ncclNetPlugin_v10`, `ncclNetPlugin_v9` or
//! `ncclNetPlugin_v8` (NCCL's `ncclNet_v10_t`, `ncclNet_v9_t`, `ncclNet_v8_t`, mirrored by
//! [`NetV10`], [`NetV9`], [`NetV8`]); as NCCL does, the newest one present is used. v9 differs from
//! v8 by `size_t` message sizes in `isend`/`irecv`, a larger properties struct
//! ([`NetPropertiesV9`]: `forceFlush`, virtual devices, transfer limits) and `makeVDevice`; v10
//! adds a profiler callback to `init`, a communicator config (traffic class) to `connect` and
//! profiler handles to `isend`/`irecv`, which oxccl passes as "none" (null handles,
//! `NCCL_NET_TRAFFIC_CLASS_UNDEF`). oxccl then calls the plugin's `init`, requires at least one
//! device whose properties say it can use host memory (`NCCL_PTR_HOST`) without device offload, and
//! uses device 0.
//!
//! **When there is none.** No library found → an info message (target `oxccl::net`: `NET/Plugin:
//! Could not find: …`) and the socket network; a library found but unusable (none of the three
//! symbols, a missing required function, `init` failing, no usable device) → a warning naming the
//! library and the reason, and the socket network. Either way communicator setup goes on.
//!
//! **Memory registration.** Every `isend`/`irecv` of a plugin carries a memory handle from its
//! `regMr`. The NET transport registers the staging and receive FIFOs of each connection once
//! ([`Net::reg_mr_send`] / [`Net::reg_mr_recv`], `NCCL_PTR_HOST`); for other buffers (the proxy's
//! 32-byte message headers, its LL bounce buffer) [`PluginNet`] takes care of it: messages up to
//! [`COPY_SLOT_BYTES`] go through a registered copy buffer of the connection, larger ones are
//! registered for the request alone and deregistered when it completes. Everything is deregistered
//! before the connection is closed.
//!
//! **Plugin logging.** The plugin gets a logger that forwards to `tracing` (target
//! `oxccl::net::plugin`, NCCL's WARN → warn, INFO → info, TRACE → trace). Rust cannot define a C
//! variadic function on stable, so the logger reads the fixed parameters only and logs the format
//! string as is (conversions such as `%s` are not expanded).
use super::net::{
    ListenComm, NET_HANDLE_BYTES, Net, NetHandle, NetProperties, Opaque, RecvComm, Request, SendComm,
};
use crate::error::{Error, Result, ResultCode};
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use std::ffi::{CStr, c_char, c_int, c_ulong, c_void};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// NCCL's `NCCL_PTR_HOST`: a `regMr` of host memory, and the `ptrSupport` bit for it.
pub const NCCL_PTR_HOST: c_int = 0x1;
/// NCCL's `NCCL_NET_MAX_REQUESTS` for the v8 interface: most requests in flight per connection.
/// [`PluginNet`] answers "busy" beyond it (NCCL's IB plugin fails instead).
pub const MAX_REQUESTS: usize = 32;
/// Largest message, in bytes, that [`PluginNet`] sends or receives through a connection's
/// registered copy buffer when its memory is not registered (the proxy's headers are 32 bytes).
pub const COPY_SLOT_BYTES: usize = 256;
/// Name of the v8 function table a plugin exports.
pub const SYMBOL_V8: &str = "ncclNetPlugin_v8";
/// Name of the v9 function table a plugin exports.
pub const SYMBOL_V9: &str = "ncclNetPlugin_v9";
/// Name of the v10 function table a plugin exports.
pub const SYMBOL_V10: &str = "ncclNetPlugin_v10";
/// NCCL's `NCCL_NET_TRAFFIC_CLASS_UNDEF`: no traffic class requested (v10's `connect` config).
pub const NCCL_NET_TRAFFIC_CLASS_UNDEF: c_int = -1;

/// NCCL's `ncclDebugLogger_t`: `(level, subsystem flags, file, line, printf format, ...)`.
pub type DebugLogger = unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...);

/// NCCL's `ncclNetProperties_v8_t` (`ext-net/example/nccl/net_v8.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetPropertiesV8 {
    /// Device name (for logs).
    pub name: *mut c_char,
    /// Path of the PCI device in `/sys` (may be null).
    pub pci_path: *mut c_char,
    /// Unique id of the NIC chip.
    pub guid: u64,
    /// `NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF` bits.
    pub ptr_support: c_int,
    /// Whether `regMr` is not tied to one connection.
    pub reg_is_global: c_int,
    /// Port speed in Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency (microseconds).
    pub latency: f32,
    /// Most connections the device supports.
    pub max_comms: c_int,
    /// Most receives grouped in one `irecv`.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`: 0 = host (`NCCL_NET_DEVICE_HOST`), else a device-offload kind.
    pub net_device_type: c_int,
    /// Version of the device-offload interface.
    pub net_device_version: c_int,
}

/// NCCL's `ncclNetDeviceHandle_v8_t` (device offload; oxccl never asks for it).
#[repr(C)]
#[derive(Debug)]
pub struct NetDeviceHandleV8 {
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Version of the device-offload interface.
    pub net_device_version: c_int,
    /// The plugin's device handle.
    pub handle: *mut c_void,
    /// Bytes of `handle`.
    pub size: usize,
    /// Whether the proxy must still progress the connection.
    pub needs_proxy_progress: c_int,
}

/// NCCL's `ncclNet_v8_t`: the table of functions behind the `ncclNetPlugin_v8` symbol, in
/// declaration order. Every function returns an `ncclResult_t`; any of them may be null in a
/// broken or partial plugin.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetV8 {
    /// Name of the network (`NCCL_NET` selects it by this name).
    pub name: *const c_char,
    /// `init(logFunction)`.
    pub init: Option<unsafe extern "C" fn(Option<DebugLogger>) -> c_int>,
    /// `devices(&ndev)`.
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> c_int>,
    /// `getProperties(dev, &props)`.
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut NetPropertiesV8) -> c_int>,
    /// `listen(dev, handle, &listenComm)`.
    pub listen: Option<unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> c_int>,
    /// `connect(dev, handle, &sendComm, &sendDevComm)`.
    pub connect: Option<
        unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int,
    >,
    /// `accept(listenComm, &recvComm, &recvDevComm)`.
    pub accept:
        Option<unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int>,
    /// `regMr(comm, data, size, type, &mhandle)`.
    pub reg_mr:
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> c_int>,
    /// `regMrDmaBuf(comm, data, size, type, offset, fd, &mhandle)` (unused by oxccl).
    pub reg_mr_dma_buf: Option<
        unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, u64, c_int, *mut *mut c_void) -> c_int,
    >,
    /// `deregMr(comm, mhandle)`.
    pub dereg_mr: Option<unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int>,
    /// `isend(sendComm, data, size, tag, mhandle, &request)`; sizes are `int` in v8.
    pub isend: Option<
        unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, c_int, *mut c_void, *mut *mut c_void) -> c_int,
    >,
    /// `irecv(recvComm, n, data[], sizes[], tags[], mhandles[], &request)`.
    pub irecv: Option<
        unsafe extern "C" fn(
            *mut c_void,
            c_int,
            *mut *mut c_void,
            *mut c_int,
            *mut c_int,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> c_int,
    >,
    /// `iflush(recvComm, n, data[], sizes[], mhandles[], &request)` (GPU memory only; unused).
    pub iflush: Option<
        unsafe extern "C" fn(
            *mut c_void,
            c_int,
            *mut *mut c_void,
            *mut c_int,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> c_int,
    >,
    /// `test(request, &done, sizes[])`.
    pub test: Option<unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int>,
    /// `closeSend(sendComm)`.
    pub close_send: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `closeRecv(recvComm)`.
    pub close_recv: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `closeListen(listenComm)`.
    pub close_listen: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `getDeviceMr(comm, mhandle, &dptr_mhandle)` (device offload; unused).
    pub get_device_mr: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *mut c_void) -> c_int>,
    /// `irecvConsumed(recvComm, n, request)` (device offload; unused).
    pub irecv_consumed: Option<unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> c_int>,
}

const _: () = assert!(size_of::<NetPropertiesV8>() == 64);
const _: () = assert!(size_of::<NetV8>() == 19 * 8);

/// NCCL's `ncclNetVDeviceProps_v9_t` (also v10's): the physical devices behind a virtual NIC.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetVDeviceProps {
    /// Number of devices in `devs`.
    pub ndevs: c_int,
    /// Device indices (`NCCL_NET_MAX_DEVS_PER_NIC` = 4).
    pub devs: [c_int; 4],
}

/// NCCL's `ncclNetProperties_v9_t`, identical to `ncclNetProperties_v10_t`
/// (`ext-net/example/nccl/net_v9.h`, `net_v10.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetPropertiesV9 {
    /// Device name (for logs).
    pub name: *mut c_char,
    /// Path of the PCI device in `/sys` (may be null).
    pub pci_path: *mut c_char,
    /// Unique id of the NIC chip.
    pub guid: u64,
    /// `NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF` bits.
    pub ptr_support: c_int,
    /// Whether `regMr` is not tied to one connection.
    pub reg_is_global: c_int,
    /// Whether receives must be flushed (GPU memory; unused by oxccl).
    pub force_flush: c_int,
    /// Port speed in Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency (microseconds).
    pub latency: f32,
    /// Most connections the device supports.
    pub max_comms: c_int,
    /// Most receives grouped in one `irecv`.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`: 0 = host, else a device-offload kind.
    pub net_device_type: c_int,
    /// Version of the device-offload interface.
    pub net_device_version: c_int,
    /// The physical devices of a virtual NIC.
    pub v_props: NetVDeviceProps,
    /// Largest point-to-point transfer, bytes.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer, bytes.
    pub max_coll_bytes: usize,
}

impl NetPropertiesV9 {
    /// The fields v8 also has.
    fn to_v8(self) -> NetPropertiesV8 {
        NetPropertiesV8 {
            name: self.name,
            pci_path: self.pci_path,
            guid: self.guid,
            ptr_support: self.ptr_support,
            reg_is_global: self.reg_is_global,
            speed: self.speed,
            port: self.port,
            latency: self.latency,
            max_comms: self.max_comms,
            max_recvs: self.max_recvs,
            net_device_type: self.net_device_type,
            net_device_version: self.net_device_version,
        }
    }
}

/// NCCL's `ncclNetCommConfig_v10_t`: per-connection options of v10's `connect`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetCommConfigV10 {
    /// Plugin-specific traffic class, or [`NCCL_NET_TRAFFIC_CLASS_UNDEF`].
    pub traffic_class: c_int,
}

type GetPropsV9 = unsafe extern "C" fn(c_int, *mut NetPropertiesV9) -> c_int;
type ConnectV8 =
    unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int;
type ConnectV10 = unsafe extern "C" fn(
    c_int,
    *mut NetCommConfigV10,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut NetDeviceHandleV8,
) -> c_int;
type IsendV8 =
    unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, c_int, *mut c_void, *mut *mut c_void) -> c_int;
type IsendV9 =
    unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut c_void, *mut *mut c_void) -> c_int;
type IsendV10 = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    usize,
    c_int,
    *mut c_void,
    *mut c_void,
    *mut *mut c_void,
) -> c_int;
type IrecvV8 = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    *mut *mut c_void,
    *mut c_int,
    *mut c_int,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type IrecvV9 = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    *mut *mut c_void,
    *mut usize,
    *mut c_int,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type IrecvV10 = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    *mut *mut c_void,
    *mut usize,
    *mut c_int,
    *mut *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type Fn0 = Option<unsafe extern "C" fn()>;

/// NCCL's `ncclNet_v9_t`: v8's table with `size_t` sizes in `isend`/`irecv`, v9 properties and
/// `makeVDevice` at the end. Functions oxccl does not call are typed loosely (`Fn0`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetV9 {
    /// Name of the network.
    pub name: *const c_char,
    /// `init(logFunction)`.
    pub init: Option<unsafe extern "C" fn(Option<DebugLogger>) -> c_int>,
    /// `devices(&ndev)`.
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> c_int>,
    /// `getProperties(dev, &props)` (v9 properties).
    pub get_properties: Option<GetPropsV9>,
    /// `listen(dev, handle, &listenComm)`.
    pub listen: Option<unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> c_int>,
    /// `connect(dev, handle, &sendComm, &sendDevComm)`.
    pub connect: Option<ConnectV8>,
    /// `accept(listenComm, &recvComm, &recvDevComm)`.
    pub accept:
        Option<unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int>,
    /// `regMr(comm, data, size, type, &mhandle)`.
    pub reg_mr:
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> c_int>,
    /// `regMrDmaBuf` (unused).
    pub reg_mr_dma_buf: Fn0,
    /// `deregMr(comm, mhandle)`.
    pub dereg_mr: Option<unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int>,
    /// `isend(sendComm, data, size_t size, tag, mhandle, &request)`.
    pub isend: Option<IsendV9>,
    /// `irecv(recvComm, n, data[], size_t sizes[], tags[], mhandles[], &request)`.
    pub irecv: Option<IrecvV9>,
    /// `iflush` (unused).
    pub iflush: Fn0,
    /// `test(request, &done, int sizes[])`.
    pub test: Option<unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int>,
    /// `closeSend(sendComm)`.
    pub close_send: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `closeRecv(recvComm)`.
    pub close_recv: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `closeListen(listenComm)`.
    pub close_listen: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `getDeviceMr` (unused).
    pub get_device_mr: Fn0,
    /// `irecvConsumed` (unused).
    pub irecv_consumed: Fn0,
    /// `makeVDevice(&d, &props)` (unused).
    pub make_v_device: Fn0,
}

/// NCCL's `ncclNet_v10_t`: v9's table with a profiler callback in `init`, a connection config
/// in `connect` and profiler handles in `isend`/`irecv`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetV10 {
    /// Name of the network.
    pub name: *const c_char,
    /// `init(logFunction, profFunction)`; oxccl passes no profiler callback (null).
    pub init: Option<unsafe extern "C" fn(Option<DebugLogger>, *mut c_void) -> c_int>,
    /// `devices(&ndev)`.
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> c_int>,
    /// `getProperties(dev, &props)` (same properties as v9).
    pub get_properties: Option<GetPropsV9>,
    /// `listen(dev, handle, &listenComm)`.
    pub listen: Option<unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> c_int>,
    /// `connect(dev, config, handle, &sendComm, &sendDevComm)`.
    pub connect: Option<ConnectV10>,
    /// `accept(listenComm, &recvComm, &recvDevComm)`.
    pub accept:
        Option<unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int>,
    /// `regMr(comm, data, size, type, &mhandle)`.
    pub reg_mr:
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> c_int>,
    /// `regMrDmaBuf` (unused).
    pub reg_mr_dma_buf: Fn0,
    /// `deregMr(comm, mhandle)`.
    pub dereg_mr: Option<unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int>,
    /// `isend(sendComm, data, size_t size, tag, mhandle, phandle, &request)`.
    pub isend: Option<IsendV10>,
    /// `irecv(recvComm, n, data[], size_t sizes[], tags[], mhandles[], phandles[], &request)`.
    pub irecv: Option<IrecvV10>,
    /// `iflush` (unused).
    pub iflush: Fn0,
    /// `test(request, &done, int sizes[])`.
    pub test: Option<unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int>,
    /// `closeSend(sendComm)`.
    pub close_send: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `closeRecv(recvComm)`.
    pub close_recv: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `closeListen(listenComm)`.
    pub close_listen: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    /// `getDeviceMr` (unused).
    pub get_device_mr: Fn0,
    /// `irecvConsumed` (unused).
    pub irecv_consumed: Fn0,
    /// `makeVDevice(&d, &props)` (unused).
    pub make_v_device: Fn0,
}

const _: () = assert!(size_of::<NetPropertiesV9>() == 104);
const _: () = assert!(size_of::<NetV9>() == 20 * 8);
const _: () = assert!(size_of::<NetV10>() == 20 * 8);

/// The calls whose signatures differ between interface versions.
#[derive(Clone, Copy)]
enum Versioned {
    V8 {
        get_properties: unsafe extern "C" fn(c_int, *mut NetPropertiesV8) -> c_int,
        connect: ConnectV8,
        isend: IsendV8,
        irecv: IrecvV8,
    },
    V9 {
        get_properties: GetPropsV9,
        connect: ConnectV8,
        isend: IsendV9,
        irecv: IrecvV9,
    },
    V10 {
        get_properties: GetPropsV9,
        connect: ConnectV10,
        isend: IsendV10,
        irecv: IrecvV10,
    },
}

/// The functions oxccl calls, all present (checked when the plugin is loaded).
#[derive(Clone, Copy)]
struct Api {
    devices: unsafe extern "C" fn(*mut c_int) -> c_int,
    listen: unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void) -> c_int,
    accept: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> c_int,
    dereg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    test: unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int,
    close_send: unsafe extern "C" fn(*mut c_void) -> c_int,
    close_recv: unsafe extern "C" fn(*mut c_void) -> c_int,
    close_listen: unsafe extern "C" fn(*mut c_void) -> c_int,
    v: Versioned,
}

/// The required functions of a table, or the name of the first missing one (the tables of every
/// version name them alike).
macro_rules! api_of {
    ($t:expr, $ver:ident) => {{
        let t = $t;
        (|| -> std::result::Result<Api, &'static str> {
            Ok(Api {
                devices: t.devices.ok_or("devices")?,
                listen: t.listen.ok_or("listen")?,
                accept: t.accept.ok_or("accept")?,
                reg_mr: t.reg_mr.ok_or("regMr")?,
                dereg_mr: t.dereg_mr.ok_or("deregMr")?,
                test: t.test.ok_or("test")?,
                close_send: t.close_send.ok_or("closeSend")?,
                close_recv: t.close_recv.ok_or("closeRecv")?,
                close_listen: t.close_listen.ok_or("closeListen")?,
                v: Versioned::$ver {
                    get_properties: t.get_properties.ok_or("getProperties")?,
                    connect: t.connect.ok_or("connect")?,
                    isend: t.isend.ok_or("isend")?,
                    irecv: t.irecv.ok_or("irecv")?,
                },
            })
        })()
    }};
}

/// A loaded, initialized plugin. Connections hold it, so the library stays loaded while any of
/// them is open.
struct Plugin {
    api: Api,
    /// Interface version in use: 8, 9 or 10.
    version: u32,
    /// The plugin's network name (`ncclNet_v8_t::name`).
    name: String,
    /// The library as it was opened (name or path).
    library: String,
    _lib: Library,
}

impl Plugin {
    /// `rc` as a `Result`; errors name the network and `what` was called.
    fn check(&self, rc: c_int, what: &str) -> Result<()> {
        let msg = || {
            format!(
                "NET/{}: {what} returned {rc} ({})",
                self.name,
                crate::error::error_string_of(rc)
            )
        };
        match ResultCode::from_i32(rc) {
            Some(ResultCode::Success) => Ok(()),
            Some(ResultCode::RemoteError) => Err(Error::Remote(msg())),
            Some(ResultCode::SystemError | ResultCode::UnhandledCudaError) => Err(Error::System(msg())),
            Some(ResultCode::InvalidArgument) => Err(Error::InvalidArgument(msg())),
            Some(ResultCode::InvalidUsage) => Err(Error::InvalidUsage(msg())),
            Some(ResultCode::Timeout) => Err(Error::Timeout(msg())),
            Some(ResultCode::InternalError | ResultCode::InProgress) | None => Err(Error::Internal(msg())),
        }
    }
}

/// The plugin's logger (NCCL's `ncclDebugLog`), declared with the fixed parameters of
/// [`DebugLogger`] only: on the C calling conventions of x86-64 and AArch64 Linux the fixed
/// arguments of a variadic call arrive exactly where a non-variadic function reads them, and the
/// variadic ones are simply not read.
unsafe extern "C" fn plugin_log(
    level: c_int,
    _flags: c_ulong,
    file: *const c_char,
    line: c_int,
    fmt: *const c_char,
) {
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: the plugin passes NUL-terminated strings (NCCL's logger contract).
            unsafe { CStr::from_ptr(p) }
                .to_string_lossy()
                .trim_end()
                .to_string()
        }
    };
    let (msg, file) = (text(fmt), text(file));
    // ncclDebugLogLevel: NONE 0, VERSION 1, WARN 2, INFO 3, ABORT 4, TRACE 5.
    match level {
        2 => tracing::warn!(target: "oxccl::net::plugin", %file, line, "{msg}"),
        1 | 3 => tracing::info!(target: "oxccl::net::plugin", %file, line, "{msg}"),
        4 => tracing::error!(target: "oxccl::net::plugin", %file, line, "{msg}"),
        5 => tracing::trace!(target: "oxccl::net::plugin", %file, line, "{msg}"),
        _ => tracing::debug!(target: "oxccl::net::plugin", %file, line, level, "{msg}"),
    }
}

/// [`plugin_log`] as NCCL's logger type.
fn logger() -> DebugLogger {
    type Fixed = unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char);
    // SAFETY: both are C function pointers of the same size; calls through the variadic type
    // pass the fixed arguments where `plugin_log` reads them (see `plugin_log`).
    unsafe { std::mem::transmute::<Fixed, DebugLogger>(plugin_log) }
}

/// The libraries to try for an `NCCL_NET_PLUGIN` value, in order (NCCL's `openPluginLib`); `None`
/// when the value is `none` (no plugin). Unset or empty: `libnccl-net.so`. A value is tried as
/// given, then, unless it holds a `/` or is itself a `lib….so` name, as `libnccl-net-<value>.so`.
pub fn candidates(spec: Option<&str>) -> Option<Vec<String>> {
    let spec = spec.map(str::trim).filter(|s| !s.is_empty());
    match spec {
        None => Some(vec!["libnccl-net.so".to_string()]),
        Some(s) if s.eq_ignore_ascii_case("none") => None,
        Some(s) => {
            let mut v = vec![s.to_string()];
            if !s.contains('/') && !(s.starts_with("lib") && s.ends_with(".so")) {
                v.push(format!("libnccl-net-{s}.so"));
            }
            Some(v)
        }
    }
}

/// What [`load`] found.
pub enum PluginLoad {
    /// `NCCL_NET_PLUGIN=none`.
    Disabled,
    /// None of these libraries exists (for the dynamic loader).
    NotFound(Vec<String>),
    /// A library was opened (or exists) but cannot be used: the library and why.
    Unusable {
        /// The library as given to the loader.
        library: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A usable plugin.
    Loaded(PluginNet),
}

impl std::fmt::Debug for PluginLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PluginLoad::Disabled => f.write_str("Disabled"),
            PluginLoad::NotFound(v) => write!(f, "NotFound({v:?})"),
            PluginLoad::Unusable { library, reason } => write!(f, "Unusable({library}: {reason})"),
            PluginLoad::Loaded(p) => write!(f, "Loaded({} from {})", p.0.name, p.0.library),
        }
    }
}

/// Opens and initializes the plugin an `NCCL_NET_PLUGIN` value `spec` names ([`candidates`]),
/// logging the outcome as NCCL does: loaded (info), disabled (info), not found (info), unusable
/// (warning). The caller falls back to the socket network unless it gets [`PluginLoad::Loaded`].
pub fn load(spec: Option<&str>) -> PluginLoad {
    let r = load_quiet(spec);
    match &r {
        PluginLoad::Loaded(p) => tracing::info!(target: "oxccl::net",
            "NET/Plugin: Loaded net plugin {} (v{}) from {}", p.0.name, p.0.version, p.0.library),
        PluginLoad::Disabled => tracing::info!(target: "oxccl::net",
            "NET/Plugin: disabled by NCCL_NET_PLUGIN=none; using the internal socket network"),
        PluginLoad::NotFound(names) => tracing::info!(target: "oxccl::net",
            "NET/Plugin: Could not find: {}; using the internal socket network", names.join(" ")),
        PluginLoad::Unusable { library, reason } => tracing::warn!(target: "oxccl::net",
            "NET/Plugin: {library}: {reason}; using the internal socket network"),
    }
    r
}

fn load_quiet(spec: Option<&str>) -> PluginLoad {
    let Some(names) = candidates(spec) else {
        return PluginLoad::Disabled;
    };
    let mut failed = None;
    for name in &names {
        // SAFETY: loading a library runs its initializers; an NCCL plugin is meant to be loaded
        // into a communicating process (as NCCL does), so that is what its user asked for.
        match unsafe { Library::open(Some(name.as_str()), RTLD_NOW | RTLD_LOCAL) } {
            Ok(lib) => return init(name, lib),
            Err(e) => {
                let e = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
                tracing::debug!(target: "oxccl::net", "NET/Plugin: {name}: {e}");
                if !(e.contains(name.as_str()) && e.contains("No such file or directory")) {
                    failed.get_or_insert((name.clone(), e));
                }
            }
        }
    }
    match failed {
        Some((library, reason)) => PluginLoad::Unusable { library, reason },
        None => PluginLoad::NotFound(names),
    }
}

/// The name of a plugin's table (null: "plugin").
fn table_name(p: *const c_char) -> String {
    if p.is_null() {
        "plugin".to_string()
    } else {
        // SAFETY: the plugin's name is a NUL-terminated string inside the loaded library.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Reads the table behind `symbol` of `lib`: `Ok(None)` when the library does not export it.
///
/// # Safety
/// `T` is the table type the plugin ABI defines for `symbol`.
unsafe fn table<T: Copy>(lib: &Library, symbol: &str) -> std::result::Result<Option<T>, String> {
    // SAFETY: only the symbol's address is taken here.
    let Ok(sym) = (unsafe { lib.get::<*const T>(symbol) }) else {
        return Ok(None);
    };
    let p = *sym;
    if p.is_null() {
        return Err(format!("{symbol} is null"));
    }
    // SAFETY: a non-null table symbol points at the plugin's table of type `T` (the caller's
    // contract), valid while the library is loaded; it is copied out here.
    Ok(Some(unsafe { p.read() }))
}

/// Looks up the newest function table an opened library exports (v10, v9, then v8, as NCCL's
/// `ncclNetPluginLoad` tries them), checks it and initializes the plugin.
fn init(library: &str, lib: Library) -> PluginLoad {
    let unusable = |reason: String| PluginLoad::Unusable {
        library: library.to_string(),
        reason,
    };
    let logger = Some(logger());
    // (version, symbol, name, api or the missing function, init's result)
    type Found = (
        u32,
        &'static str,
        String,
        std::result::Result<Api, &'static str>,
        Option<c_int>,
    );
    let found: std::result::Result<Option<Found>, String> = (|| {
        // SAFETY: each symbol is read as the table type of its version (the plugin ABI); `init`
        // is called once, with NCCL's logger (and no profiler), before any other call.
        unsafe {
            if let Some(t) = table::<NetV10>(&lib, SYMBOL_V10)? {
                let rc = t.init.map(|f| f(logger, std::ptr::null_mut()));
                return Ok(Some((10, SYMBOL_V10, table_name(t.name), api_of!(t, V10), rc)));
            }
            if let Some(t) = table::<NetV9>(&lib, SYMBOL_V9)? {
                let rc = t.init.map(|f| f(logger));
                return Ok(Some((9, SYMBOL_V9, table_name(t.name), api_of!(t, V9), rc)));
            }
            if let Some(t) = table::<NetV8>(&lib, SYMBOL_V8)? {
                let rc = t.init.map(|f| f(logger));
                return Ok(Some((8, SYMBOL_V8, table_name(t.name), api_of!(t, V8), rc)));
            }
        }
        Ok(None)
    })();
    let (version, symbol, name, api, rc) = match found {
        Err(reason) => return unusable(reason),
        Ok(None) => {
            // SAFETY: only the lookup's error message is used.
            let e = match unsafe { lib.get::<*const c_void>(SYMBOL_V8) } {
                Err(e) => std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string()),
                Ok(_) => String::new(),
            };
            return unusable(format!(
                "no {SYMBOL_V10}, {SYMBOL_V9} or {SYMBOL_V8} symbol (oxccl needs the v8, v9 or v10 net \
                 plugin interface): {e}"
            ));
        }
        Ok(Some(f)) => f,
    };
    let api = match api {
        Ok(a) => a,
        Err(missing) => return unusable(format!("{symbol} ({name}) has no {missing} function")),
    };
    let Some(rc) = rc else {
        return unusable(format!("{symbol} ({name}) has no init function"));
    };
    let plugin = Plugin {
        api,
        version,
        name,
        library: library.to_string(),
        _lib: lib,
    };
    if let Err(e) = plugin.check(rc, "init") {
        return unusable(e.to_string());
    }
    let net = PluginNet(Arc::new(plugin));
    match net.usable() {
        Ok(()) => PluginLoad::Loaded(net),
        Err(reason) => unusable(reason),
    }
}

/// The plugin `NCCL_NET_PLUGIN` (or `OXCCL_NET_PLUGIN`) selects, loaded once per process (NCCL's
/// `ncclNetPluginLoad`); `None` when there is none or it is unusable ([`load`] logged why).
pub fn from_env() -> Option<PluginNet> {
    static PLUGIN: OnceLock<Option<PluginNet>> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            let spec = crate::params::env_var("NET_PLUGIN").map(|(_, v)| v);
            match load(spec.as_deref()) {
                PluginLoad::Loaded(p) => Some(p),
                _ => None,
            }
        })
        .clone()
}

/// A network plugin behind the [`Net`] trait (NCCL's `ncclNet` when a plugin is loaded). Cheap to
/// clone; every clone drives the same plugin.
#[derive(Clone)]
pub struct PluginNet(Arc<Plugin>);

impl std::fmt::Debug for PluginNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PluginNet({} from {})", self.0.name, self.0.library)
    }
}

impl PluginNet {
    /// The library the plugin was loaded from (as given to the loader).
    pub fn library(&self) -> &str {
        &self.0.library
    }

    /// The net plugin interface version in use (8, 9 or 10).
    pub fn version(&self) -> u32 {
        self.0.version
    }

    /// Properties of device `dev` as the plugin reports them (NCCL's `getProperties`), as v8's
    /// struct (a v9/v10 plugin's extra fields left out).
    ///
    /// Errors: `InvalidArgument` for `dev` beyond `i32::MAX`; the plugin's error otherwise.
    pub fn properties_v8(&self, dev: usize) -> Result<NetPropertiesV8> {
        let d = c_int::try_from(dev)
            .map_err(|_| Error::invalid(format!("NET/{}: device {dev} is out of range", self.0.name)))?;
        let rc;
        let p = match self.0.api.v {
            Versioned::V8 { get_properties, .. } => {
                // SAFETY: plain data; the plugin fills it.
                let mut p: NetPropertiesV8 = unsafe { std::mem::zeroed() };
                // SAFETY: the plugin ABI; `p` is a valid v8 properties struct.
                rc = unsafe { get_properties(d, &mut p) };
                p
            }
            Versioned::V9 { get_properties, .. } | Versioned::V10 { get_properties, .. } => {
                // SAFETY: plain data; the plugin fills it.
                let mut p: NetPropertiesV9 = unsafe { std::mem::zeroed() };
                // SAFETY: the plugin ABI; `p` is a valid v9/v10 properties struct.
                rc = unsafe { get_properties(d, &mut p) };
                p.to_v8()
            }
        };
        self.0.check(rc, "getProperties")?;
        Ok(p)
    }

    /// Whether oxccl can use the plugin: a device 0 that takes host memory without offload.
    fn usable(&self) -> std::result::Result<(), String> {
        let n = self.devices().map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("NET/{} reports no devices", self.0.name));
        }
        let p = self.properties_v8(0).map_err(|e| e.to_string())?;
        if p.ptr_support & NCCL_PTR_HOST == 0 {
            return Err(format!(
                "NET/{} device 0 cannot use host memory (ptrSupport {:#x} lacks NCCL_PTR_HOST)",
                self.0.name, p.ptr_support
            ));
        }
        if p.net_device_type != 0 {
            return Err(format!(
                "NET/{} device 0 needs device offload (netDeviceType {}), which oxccl does not support",
                self.0.name, p.net_device_type
            ));
        }
        Ok(())
    }
}

/// A registered memory region of a connection.
struct Mr {
    start: usize,
    end: usize,
    mhandle: *mut c_void,
}

/// A registered copy buffer: [`MAX_REQUESTS`] slots of [`COPY_SLOT_BYTES`].
struct CopyPool {
    base: *mut u8,
    mhandle: *mut c_void,
    free: Vec<usize>,
}

const POOL_BYTES: usize = MAX_REQUESTS * COPY_SLOT_BYTES;

impl Drop for CopyPool {
    fn drop(&mut self) {
        // SAFETY: `base` came from `Box::into_raw` of a `POOL_BYTES` slice (`CommState::pool`)
        // and is freed once, after the plugin's connection was closed (the pool lives in it).
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.base, POOL_BYTES)) });
    }
}

/// What a request holds besides the plugin's request.
enum Extra {
    None,
    /// A copy-buffer slot; for a receive, where the message goes on completion.
    Slot(usize, Option<(*mut u8, usize)>),
    /// A registration for this request alone.
    Temp(*mut c_void),
}

/// One plugin connection (send or receive side) and oxccl's registrations on it.
struct CommState {
    plugin: Arc<Plugin>,
    /// The plugin's comm; null once closed.
    ptr: *mut c_void,
    send: bool,
    mrs: Vec<Mr>,
    pool: Option<CopyPool>,
    /// Registrations of single requests not yet deregistered.
    temps: Vec<*mut c_void>,
    /// Requests posted and not yet completed.
    outstanding: usize,
}

// SAFETY: the raw pointers are the plugin's comm and handles and oxccl's own copy buffer; NCCL's
// plugin contract lets any thread use a comm, one at a time, which the mutex around it ensures.
unsafe impl Send for CommState {}

type Shared = Arc<Mutex<CommState>>;

fn lock(c: &Shared) -> MutexGuard<'_, CommState> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

impl CommState {
    fn new(plugin: &Arc<Plugin>, ptr: *mut c_void, send: bool) -> Shared {
        Arc::new(Mutex::new(CommState {
            plugin: plugin.clone(),
            ptr,
            send,
            mrs: Vec::new(),
            pool: None,
            temps: Vec::new(),
            outstanding: 0,
        }))
    }

    fn open(&self) -> Result<*mut c_void> {
        if self.ptr.is_null() {
            return Err(Error::InvalidUsage(format!(
                "NET/{}: the connection is closed",
                self.plugin.name
            )));
        }
        Ok(self.ptr)
    }

    /// Registers host memory with the plugin (`regMr`, `NCCL_PTR_HOST`).
    fn reg(&self, data: *mut c_void, size: usize) -> Result<*mut c_void> {
        let comm = self.open()?;
        let mut mh = std::ptr::null_mut();
        // SAFETY: the plugin ABI on an open comm; the caller keeps the memory valid until it is
        // deregistered.
        let rc = unsafe { (self.plugin.api.reg_mr)(comm, data, size, NCCL_PTR_HOST, &mut mh) };
        self.plugin.check(rc, "regMr")?;
        Ok(mh)
    }

    fn dereg(&self, mh: *mut c_void) -> Result<()> {
        let comm = self.open()?;
        // SAFETY: `mh` came from `regMr` on this comm and is deregistered once.
        let rc = unsafe { (self.plugin.api.dereg_mr)(comm, mh) };
        self.plugin.check(rc, "deregMr")
    }

    /// The buffer and memory handle to hand the plugin for `size` bytes at `data`: inside a
    /// registered region as is; small messages through a copy slot (a send is copied in now);
    /// otherwise registered for this request. `Ok(None)`: no copy slot free.
    fn prepare(&mut self, data: *mut u8, size: usize) -> Result<Option<(*mut u8, *mut c_void, Extra)>> {
        let (a, b) = (data as usize, data as usize + size);
        if let Some(m) = self.mrs.iter().find(|m| m.start <= a && b <= m.end) {
            return Ok(Some((data, m.mhandle, Extra::None)));
        }
        if size <= COPY_SLOT_BYTES {
            if self.pool.is_none() {
                let base = Box::into_raw(vec![0u8; POOL_BYTES].into_boxed_slice()).cast::<u8>();
                // Owned by the pool from here on, so it is freed on every path.
                let mut pool = CopyPool {
                    base,
                    mhandle: std::ptr::null_mut(),
                    free: (0..MAX_REQUESTS).rev().collect(),
                };
                pool.mhandle = self.reg(base.cast(), POOL_BYTES)?;
                self.pool = Some(pool);
            }
            let Some(pool) = self.pool.as_mut() else {
                return Err(Error::Internal("NET plugin: copy buffer missing".into()));
            };
            let Some(slot) = pool.free.pop() else {
                return Ok(None);
            };
            // SAFETY: the slot lies inside the pool's allocation.
            let at = unsafe { pool.base.add(slot * COPY_SLOT_BYTES) };
            let copy_back = if self.send {
                // SAFETY: `data..data+size` is readable (isend's contract); the slot is free and
                // holds COPY_SLOT_BYTES >= size bytes.
                unsafe { std::ptr::copy_nonoverlapping(data, at, size) };
                None
            } else {
                Some((data, size))
            };
            return Ok(Some((at, pool.mhandle, Extra::Slot(slot, copy_back))));
        }
        let mh = self.reg(data.cast(), size)?;
        self.temps.push(mh);
        Ok(Some((data, mh, Extra::Temp(mh))))
    }

    /// Releases what `prepare` took; for a completed receive through a copy slot, first copies
    /// the `n` bytes that arrived to their destination.
    fn release(&mut self, extra: Extra, n: Option<usize>) -> Result<()> {
        match extra {
            Extra::None => Ok(()),
            Extra::Slot(slot, back) => {
                let Some(pool) = self.pool.as_mut() else {
                    return Ok(());
                };
                if let (Some((dst, cap)), Some(n)) = (back, n) {
                    // SAFETY: the plugin finished writing the slot; `dst..dst+cap` is the
                    // receive buffer, valid until the request is reported done (irecv's
                    // contract); at most `cap` bytes are copied.
                    unsafe {
                        std::ptr::copy_nonoverlapping(pool.base.add(slot * COPY_SLOT_BYTES), dst, n.min(cap))
                    };
                }
                pool.free.push(slot);
                Ok(())
            }
            Extra::Temp(mh) => {
                self.temps.retain(|&t| t != mh);
                self.dereg(mh)
            }
        }
    }

    /// Deregisters everything, then closes the plugin's comm (NCCL's order); the first error.
    fn close(&mut self) -> Result<()> {
        let Ok(comm) = self.open() else {
            return Ok(());
        };
        let mut handles: Vec<*mut c_void> = self.mrs.drain(..).map(|m| m.mhandle).collect();
        handles.append(&mut self.temps);
        handles.extend(self.pool.as_ref().map(|p| p.mhandle));
        let mut first = Ok(());
        for mh in handles {
            let r = self.dereg(mh);
            if first.is_ok() {
                first = r;
            }
        }
        let (f, what) = if self.send {
            (self.plugin.api.close_send, "closeSend")
        } else {
            (self.plugin.api.close_recv, "closeRecv")
        };
        // SAFETY: the plugin ABI: an open comm, closed once (`ptr` is cleared below).
        let rc = unsafe { f(comm) };
        self.ptr = std::ptr::null_mut();
        self.plugin.check(rc, what).and(first)
    }
}

impl Drop for CommState {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::debug!(target: "oxccl::net", "NET/{}: closing a dropped connection: {e}", self.plugin.name);
        }
    }
}

/// A plugin listener.
struct ListenState {
    plugin: Arc<Plugin>,
    ptr: *mut c_void,
}

// SAFETY: the plugin's listen comm may be used from any thread, one at a time (`&mut` access).
unsafe impl Send for ListenState {}

impl ListenState {
    fn close(&mut self) -> Result<()> {
        if self.ptr.is_null() {
            return Ok(());
        }
        // SAFETY: the plugin ABI: an open listen comm, closed once.
        let rc = unsafe { (self.plugin.api.close_listen)(self.ptr) };
        self.ptr = std::ptr::null_mut();
        self.plugin.check(rc, "closeListen")
    }
}

impl Drop for ListenState {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::debug!(target: "oxccl::net", "NET/{}: closing a dropped listener: {e}", self.plugin.name);
        }
    }
}

/// A request: the plugin's request, its connection, and what to release when it completes.
struct PluginRequest {
    req: *mut c_void,
    comm: Shared,
    extra: Option<Extra>,
    done: bool,
}

// SAFETY: the plugin's request is tested under its connection's mutex; the copy destination is
// the caller's buffer, which `irecv`'s contract keeps valid.
unsafe impl Send for PluginRequest {}

fn downcast<'a, T: 'static>(o: &'a mut Opaque, name: &str, what: &str) -> Result<&'a mut T> {
    o.0.downcast_mut::<T>()
        .ok_or_else(|| Error::InvalidUsage(format!("NET/{name}: {what} was not created by this network")))
}

fn dev_int(name: &str, dev: usize) -> Result<c_int> {
    c_int::try_from(dev).map_err(|_| Error::invalid(format!("NET/{name}: device {dev} is out of range")))
}

impl PluginNet {
    fn post(&self, comm: &Shared, data: *mut u8, size: usize, tag: u32) -> Result<Option<Request>> {
        let p = &self.0;
        // Sizes are `int` in v8, `size_t` since v9; `test` reports an `int` in every version.
        let isize = c_int::try_from(size).map_err(|_| {
            Error::invalid(format!(
                "NET/{}: message of {size} bytes exceeds the v{} interface's limit of {} bytes",
                p.name,
                p.version,
                c_int::MAX
            ))
        })?;
        let mut st = lock(comm);
        let ptr = st.open()?;
        if st.outstanding >= MAX_REQUESTS {
            return Ok(None);
        }
        let Some((buf, mh, extra)) = st.prepare(data, size)? else {
            return Ok(None);
        };
        let mut req = std::ptr::null_mut();
        let (b, t, null) = (buf.cast::<c_void>(), tag as c_int, std::ptr::null_mut());
        let (mut d, mut tt, mut m, mut ph) = (b, t, mh, null);
        let (mut s32, mut s64) = (isize, size);
        // SAFETY (every call below): the plugin ABI on an open comm of the right side;
        // `buf..buf+size` stays valid and registered (`mh`) until the request completes (the
        // isend/irecv contract, or our copy slot); a receive posts one buffer (n = 1) through
        // arrays that outlive the call; v10's profiler handles are null (no profiler).
        let (rc, what) = match (st.send, p.api.v) {
            (true, Versioned::V8 { isend, .. }) => {
                (unsafe { isend(ptr, b, isize, t, mh, &mut req) }, "isend")
            }
            (true, Versioned::V9 { isend, .. }) => (unsafe { isend(ptr, b, size, t, mh, &mut req) }, "isend"),
            (true, Versioned::V10 { isend, .. }) => {
                (unsafe { isend(ptr, b, size, t, mh, null, &mut req) }, "isend")
            }
            (false, Versioned::V8 { irecv, .. }) => (
                unsafe { irecv(ptr, 1, &mut d, &mut s32, &mut tt, &mut m, &mut req) },
                "irecv",
            ),
            (false, Versioned::V9 { irecv, .. }) => (
                unsafe { irecv(ptr, 1, &mut d, &mut s64, &mut tt, &mut m, &mut req) },
                "irecv",
            ),
            (false, Versioned::V10 { irecv, .. }) => (
                unsafe { irecv(ptr, 1, &mut d, &mut s64, &mut tt, &mut m, &mut ph, &mut req) },
                "irecv",
            ),
        };
        if let Err(e) = p.check(rc, what) {
            let _ = st.release(extra, None);
            return Err(e);
        }
        if req.is_null() {
            st.release(extra, None)?;
            return Ok(None);
        }
        st.outstanding += 1;
        drop(st);
        Ok(Some(Request(Opaque(Box::new(PluginRequest {
            req,
            comm: comm.clone(),
            extra: Some(extra),
            done: false,
        })))))
    }

    fn reg_shared(&self, comm: &Shared, data: *mut u8, size: usize) -> Result<()> {
        let mut st = lock(comm);
        let mh = st.reg(data.cast(), size)?;
        st.mrs.push(Mr {
            start: data as usize,
            end: data as usize + size,
            mhandle: mh,
        });
        Ok(())
    }
}

impl Net for PluginNet {
    fn name(&self) -> &str {
        &self.0.name
    }

    fn devices(&self) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: the plugin ABI.
        let rc = unsafe { (self.0.api.devices)(&mut n) };
        self.0.check(rc, "devices")?;
        Ok(n.max(0) as usize)
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        let p = self.properties_v8(dev)?;
        let name = if p.name.is_null() {
            format!("{}{dev}", self.0.name)
        } else {
            // SAFETY: the plugin's device name is a NUL-terminated string it keeps.
            unsafe { CStr::from_ptr(p.name) }.to_string_lossy().into_owned()
        };
        Ok(NetProperties {
            name,
            speed_mbps: p.speed.max(0) as u32,
            max_requests: MAX_REQUESTS,
        })
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, ListenComm)> {
        let d = dev_int(&self.0.name, dev)?;
        let mut h = [0u8; NET_HANDLE_BYTES];
        let mut l = std::ptr::null_mut();
        // SAFETY: the plugin ABI; the handle has NCCL_NET_HANDLE_MAXSIZE bytes.
        let rc = unsafe { (self.0.api.listen)(d, h.as_mut_ptr().cast(), &mut l) };
        self.0.check(rc, "listen")?;
        if l.is_null() {
            return Err(Error::Internal(format!(
                "NET/{}: listen gave no listener",
                self.0.name
            )));
        }
        let state = ListenState {
            plugin: self.0.clone(),
            ptr: l,
        };
        Ok((h, ListenComm(Opaque(Box::new(state)))))
    }

    fn connect(&self, dev: usize, handle: &NetHandle) -> Result<Option<SendComm>> {
        let d = dev_int(&self.0.name, dev)?;
        let mut h = *handle;
        let (mut c, mut dev_comm) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut config = NetCommConfigV10 {
            traffic_class: NCCL_NET_TRAFFIC_CLASS_UNDEF,
        };
        // SAFETY: the plugin ABI; a null device handle asks for no device offload (as NCCL does
        // for host networks); v10's config asks for no traffic class.
        let rc = match self.0.api.v {
            Versioned::V8 { connect, .. } | Versioned::V9 { connect, .. } => unsafe {
                connect(d, h.as_mut_ptr().cast(), &mut c, &mut dev_comm)
            },
            Versioned::V10 { connect, .. } => unsafe {
                connect(d, &mut config, h.as_mut_ptr().cast(), &mut c, &mut dev_comm)
            },
        };
        self.0.check(rc, "connect")?;
        Ok((!c.is_null()).then(|| SendComm(Opaque(Box::new(CommState::new(&self.0, c, true))))))
    }

    fn accept(&self, listen: &mut ListenComm) -> Result<Option<RecvComm>> {
        let l = downcast::<ListenState>(&mut listen.0, &self.0.name, "the listener")?;
        if l.ptr.is_null() {
            return Err(Error::InvalidUsage(format!(
                "NET/{}: the listener is closed",
                self.0.name
            )));
        }
        let (mut c, mut dev_comm) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the plugin ABI on an open listener.
        let rc = unsafe { (self.0.api.accept)(l.ptr, &mut c, &mut dev_comm) };
        self.0.check(rc, "accept")?;
        Ok((!c.is_null()).then(|| RecvComm(Opaque(Box::new(CommState::new(&self.0, c, false))))))
    }

    unsafe fn reg_mr_send(&self, comm: &mut SendComm, data: *const u8, size: usize) -> Result<()> {
        let c = downcast::<Shared>(&mut comm.0, &self.0.name, "the send connection")?.clone();
        self.reg_shared(&c, data.cast_mut(), size)
    }

    unsafe fn reg_mr_recv(&self, comm: &mut RecvComm, data: *mut u8, size: usize) -> Result<()> {
        let c = downcast::<Shared>(&mut comm.0, &self.0.name, "the receive connection")?.clone();
        self.reg_shared(&c, data, size)
    }

    unsafe fn isend(
        &self,
        comm: &mut SendComm,
        data: *const u8,
        size: usize,
        tag: u32,
    ) -> Result<Option<Request>> {
        let c = downcast::<Shared>(&mut comm.0, &self.0.name, "the send connection")?.clone();
        self.post(&c, data.cast_mut(), size, tag)
    }

    unsafe fn irecv(
        &self,
        comm: &mut RecvComm,
        data: *mut u8,
        size: usize,
        tag: u32,
    ) -> Result<Option<Request>> {
        let c = downcast::<Shared>(&mut comm.0, &self.0.name, "the receive connection")?.clone();
        self.post(&c, data, size, tag)
    }

    fn test(&self, req: &mut Request) -> Result<Option<usize>> {
        let r = downcast::<PluginRequest>(&mut req.0, &self.0.name, "the request")?;
        if r.done {
            return Err(Error::InvalidUsage(format!(
                "NET/{}: a request was tested after it completed",
                self.0.name
            )));
        }
        let mut st = lock(&r.comm);
        st.open()?;
        let (mut done, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: the plugin ABI: a request of this open comm, not yet reported done.
        let rc = unsafe { (self.0.api.test)(r.req, &mut done, &mut size) };
        self.0.check(rc, "test")?;
        if done == 0 {
            return Ok(None);
        }
        r.done = true;
        st.outstanding -= 1;
        let n = size.max(0) as usize;
        if let Some(extra) = r.extra.take() {
            st.release(extra, Some(n))?;
        }
        Ok(Some(n))
    }

    fn close_send(&self, comm: SendComm) -> Result<()> {
        let mut comm = comm;
        let c = downcast::<Shared>(&mut comm.0, &self.0.name, "the send connection")?;
        lock(c).close()
    }

    fn close_recv(&self, comm: RecvComm) -> Result<()> {
        let mut comm = comm;
        let c = downcast::<Shared>(&mut comm.0, &self.0.name, "the receive connection")?;
        lock(c).close()
    }

    fn close_listen(&self, comm: ListenComm) -> Result<()> {
        let mut comm = comm;
        downcast::<ListenState>(&mut comm.0, &self.0.name, "the listener")?.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_nccl() {
        // NCCL's openPluginLib: unset → libnccl-net.so; a bare name → as given, then
        // libnccl-net-<name>.so; a path or a lib….so name → only as given; "none" → no plugin.
        let v = |s: &[&str]| Some(s.iter().map(|x| x.to_string()).collect::<Vec<_>>());
        assert_eq!(candidates(None), v(&["libnccl-net.so"]));
        assert_eq!(candidates(Some(" ")), v(&["libnccl-net.so"]));
        assert_eq!(candidates(Some("ofi")), v(&["ofi", "libnccl-net-ofi.so"]));
        assert_eq!(
            candidates(Some("/opt/x/libnccl-net-ofi.so")),
            v(&["/opt/x/libnccl-net-ofi.so"])
        );
        assert_eq!(candidates(Some("libnccl-net-ofi.so")), v(&["libnccl-net-ofi.so"]));
        assert_eq!(
            candidates(Some("libm.so.6")),
            v(&["libm.so.6", "libnccl-net-libm.so.6.so"])
        );
        assert_eq!(candidates(Some("none")), None);
        assert_eq!(candidates(Some("NONE")), None);
    }

    #[test]
    fn missing_library_is_not_found_and_symbol_less_library_is_unusable() {
        match load(Some("oxccl-doesnotexist")) {
            PluginLoad::NotFound(names) => {
                assert_eq!(names, ["oxccl-doesnotexist", "libnccl-net-oxccl-doesnotexist.so"])
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
        // libm is on every glibc system and exports no ncclNetPlugin_v8.
        match load(Some("libm.so.6")) {
            PluginLoad::Unusable { library, reason } => {
                assert_eq!(library, "libm.so.6");
                assert!(
                    reason.contains("no ncclNetPlugin_v10, ncclNetPlugin_v9 or ncclNetPlugin_v8 symbol"),
                    "{reason}"
                );
            }
            other => panic!("expected Unusable, got {other:?}"),
        }
        // A file that exists but is no library: found, so unusable (a warning), not "not found".
        let dir = std::env::temp_dir().join(format!("oxccl-plugin-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bogus = dir.join("libnccl-net-bogus.so");
        std::fs::write(&bogus, b"not an ELF file").unwrap();
        let path = bogus.to_str().unwrap().to_string();
        match load(Some(&path)) {
            PluginLoad::Unusable { library, .. } => assert_eq!(library, path),
            other => panic!("expected Unusable, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(load(Some("none")), PluginLoad::Disabled));
    }

    #[test]
    fn abi_layout_matches_net_v8_h() {
        // Offsets from ncclNetProperties_v8_t: three 8-byte fields, then nine 4-byte ones.
        assert_eq!(std::mem::offset_of!(NetPropertiesV8, ptr_support), 24);
        assert_eq!(std::mem::offset_of!(NetPropertiesV8, latency), 40);
        assert_eq!(std::mem::offset_of!(NetPropertiesV8, net_device_version), 56);
        // ncclNet_v8_t: name, then 18 function pointers; isend is the 11th field (index 10).
        assert_eq!(std::mem::offset_of!(NetV8, isend), 10 * 8);
        assert_eq!(std::mem::offset_of!(NetV8, irecv_consumed), 18 * 8);
        assert_eq!(std::mem::offset_of!(NetDeviceHandleV8, needs_proxy_progress), 24);
    }

    #[test]
    fn abi_layout_matches_net_v9_h_and_net_v10_h() {
        // ncclNetProperties_v9_t (= _v10_t): v8's fields with forceFlush after regIsGlobal, then
        // vProps (5 ints: 20 bytes at 64, padded to 88) and two size_t limits.
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, ptr_support), 24);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, force_flush), 32);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, speed), 36);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, latency), 44);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, net_device_type), 56);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, v_props), 64);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, max_p2p_bytes), 88);
        assert_eq!(std::mem::offset_of!(NetPropertiesV9, max_coll_bytes), 96);
        // ncclNet_v9_t / _v10_t: name + 19 function pointers, in v8's order, makeVDevice last.
        for (isend, test, close_listen, make_v_device) in [
            (
                std::mem::offset_of!(NetV9, isend),
                std::mem::offset_of!(NetV9, test),
                std::mem::offset_of!(NetV9, close_listen),
                std::mem::offset_of!(NetV9, make_v_device),
            ),
            (
                std::mem::offset_of!(NetV10, isend),
                std::mem::offset_of!(NetV10, test),
                std::mem::offset_of!(NetV10, close_listen),
                std::mem::offset_of!(NetV10, make_v_device),
            ),
        ] {
            assert_eq!((isend, test, close_listen, make_v_device), (80, 104, 128, 152));
        }
        assert_eq!(size_of::<NetCommConfigV10>(), 4);
    }
}
