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
//!
//! | file | what | mirrors in NCCL |
//! |---|---|---|
//! | `plugin/mod.rs` | finding, opening and initializing the library; the loaded plugin | `src/plugin/net.cc`, `src/plugin/plugin_open.cc` |
//! | `plugin/nccl_net.rs` | the C ABI: properties structs and function tables of v8, v9 and v10 | `ext-net/example/nccl/net_v8.h` … `net_v10.h` |
//! | `plugin/adapter.rs` | the plugin behind the [`Net`] trait: connections, requests, memory registration | `src/plugin/net/net_v8.cc` … `net_v10.cc` |
use super::net::Net;
use crate::error::{Error, Result, ResultCode};
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use std::ffi::{CStr, c_char, c_int, c_ulong, c_void};
use std::sync::{Arc, OnceLock};

mod adapter;
mod nccl_net;

pub use adapter::COPY_SLOT_BYTES;
pub use nccl_net::{
    DebugLogger, MAX_REQUESTS, NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_PTR_HOST, NetCommConfigV10, NetDeviceHandleV8,
    NetPropertiesV8, NetPropertiesV9, NetV8, NetV9, NetV10, NetVDeviceProps, SYMBOL_V8, SYMBOL_V9,
    SYMBOL_V10,
};
use nccl_net::{ConnectV8, ConnectV10, GetPropsV9, IrecvV8, IrecvV9, IrecvV10, IsendV8, IsendV9, IsendV10};

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
}
