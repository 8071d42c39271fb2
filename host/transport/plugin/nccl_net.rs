//! The C ABI of NCCL's network plugins, versions 8, 9 and 10: the properties structs, device
//! handle, communicator config and function tables a `libnccl-net*.so` exports
//! (`ext-net/example/nccl/net_v8.h`, `net_v9.h`, `net_v10.h`, and NCCL's `src/include/plugin/net/`).
//! Layouts are checked at compile time (sizes) and in the unit tests (offsets).
use std::ffi::{c_char, c_int, c_ulong, c_void};

/// NCCL's `NCCL_PTR_HOST`: a `regMr` of host memory, and the `ptrSupport` bit for it.
pub const NCCL_PTR_HOST: c_int = 0x1;
/// NCCL's `NCCL_NET_MAX_REQUESTS` for the v8 interface: most requests in flight per connection.
/// [`PluginNet`](super::PluginNet) answers "busy" beyond it (NCCL's IB plugin fails instead).
pub const MAX_REQUESTS: usize = 32;
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
    pub(super) fn to_v8(self) -> NetPropertiesV8 {
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

pub(super) type GetPropsV9 = unsafe extern "C" fn(c_int, *mut NetPropertiesV9) -> c_int;
pub(super) type ConnectV8 =
    unsafe extern "C" fn(c_int, *mut c_void, *mut *mut c_void, *mut *mut NetDeviceHandleV8) -> c_int;
pub(super) type ConnectV10 = unsafe extern "C" fn(
    c_int,
    *mut NetCommConfigV10,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut NetDeviceHandleV8,
) -> c_int;
pub(super) type IsendV8 =
    unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, c_int, *mut c_void, *mut *mut c_void) -> c_int;
pub(super) type IsendV9 =
    unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut c_void, *mut *mut c_void) -> c_int;
pub(super) type IsendV10 = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    usize,
    c_int,
    *mut c_void,
    *mut c_void,
    *mut *mut c_void,
) -> c_int;
pub(super) type IrecvV8 = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    *mut *mut c_void,
    *mut c_int,
    *mut c_int,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
pub(super) type IrecvV9 = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    *mut *mut c_void,
    *mut usize,
    *mut c_int,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
pub(super) type IrecvV10 = unsafe extern "C" fn(
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

#[cfg(test)]
mod tests {
    use super::*;

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
