//! A thin safe layer over the CUDA driver API, loaded at run time through `cudarc::driver::sys`.
//!
//! Only this module calls the driver. Every call goes through `check`, which turns a `CUresult`
//! into [`Error::Cuda`] naming the call. Buffers that peers map are plain `cuMemAlloc` memory, never
//! the stream-ordered pool (peer writes into pool memory faulted on the GPU machine; see
//! DESIGN.md §5). cudarc panics when `libcuda.so.1` is missing, so [`driver`] asks first and
//! answers [`Error::NoCuda`] instead.
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::sync::{Arc, Mutex, OnceLock};

mod current;
pub mod ptx;
pub use current::KeepCurrent;

/// Calls a driver function and maps its result.
macro_rules! cu {
    ($call:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: the caller of the macro upholds the driver call's pointer contracts.
        check(unsafe { sys::$call($($arg),*) }, stringify!($call))
    }};
}

/// Maps a `CUresult` to `Ok` or [`Error::Cuda`] naming `call`.
pub(crate) fn check(r: CUresult, call: &'static str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (mut name, mut msg): (*const std::ffi::c_char, *const std::ffi::c_char) =
        (std::ptr::null(), std::ptr::null());
    // SAFETY: out-pointers are valid; the driver returns static strings or leaves them null.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut msg);
    }
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::from("?")
        } else {
            // SAFETY: non-null strings from the driver are NUL-terminated and static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    Err(Error::Cuda {
        call,
        code: r as u32,
        name: text(name),
        msg: text(msg),
    })
}

/// The driver, initialised once. Errors with [`Error::NoCuda`] when `libcuda.so.1` is absent.
pub fn driver() -> Result<()> {
    driver_state().clone().map_err(Error::NoCuda)
}

/// Whether the CUDA driver is loaded and initialized ([`driver`] without building its error:
/// for the checks of every call).
pub fn has_driver() -> bool {
    driver_state().is_ok()
}

/// The driver's load and `cuInit`, once per process: its error's text when it failed.
fn driver_state() -> &'static std::result::Result<(), String> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes for the shared library.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so.1) was not found".into());
        }
        cu!(cuInit(0)).map_err(|e| e.to_string())
    })
}

/// Number of visible CUDA devices; 0 when there is no driver.
pub fn device_count() -> usize {
    if !has_driver() {
        return 0;
    }
    let mut n = 0i32;
    match cu!(cuDeviceGetCount(&mut n)) {
        Ok(()) => n.max(0) as usize,
        Err(_) => 0,
    }
}

/// Driver version as the driver reports it (e.g. 13000 for CUDA 13.0).
pub fn driver_version() -> Result<i32> {
    driver()?;
    let mut v = 0;
    cu!(cuDriverGetVersion(&mut v))?;
    Ok(v)
}

/// A device's primary context, retained for the life of the process (one per ordinal).
pub struct Context {
    pub(crate) ordinal: usize,
    pub(crate) dev: sys::CUdevice,
    ctx: sys::CUcontext,
    modules: Mutex<HashMap<String, Arc<Module>>>,
}

// SAFETY: CUDA contexts may be used from any thread once made current there; `bind` does that.
unsafe impl Send for Context {}
// SAFETY: as above; the driver serialises internally.
unsafe impl Sync for Context {}

impl Context {
    /// The primary context of device `ordinal` (shared, created on first use).
    pub fn get(ordinal: usize) -> Result<Arc<Context>> {
        static CTXS: Mutex<Vec<Option<Arc<Context>>>> = Mutex::new(Vec::new());
        driver()?;
        let n = device_count();
        if ordinal >= n {
            return Err(Error::invalid(format!(
                "CUDA device {ordinal} does not exist (visible devices: 0..{n})"
            )));
        }
        let mut ctxs = CTXS
            .lock()
            .map_err(|_| Error::Internal("context registry poisoned".into()))?;
        if ctxs.len() < n {
            ctxs.resize(n, None);
        }
        if let Some(c) = &ctxs[ordinal] {
            return Ok(c.clone());
        }
        let mut dev = 0;
        cu!(cuDeviceGet(&mut dev, ordinal as i32))?;
        let mut ctx = std::ptr::null_mut();
        cu!(cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
        let c = Arc::new(Context {
            ordinal,
            dev,
            ctx,
            modules: Mutex::new(HashMap::new()),
        });
        ctxs[ordinal] = Some(c.clone());
        Ok(c)
    }

    /// Makes this context current on the calling thread (inside a [`KeepCurrent`] scope, lazily:
    /// `current.rs`).
    pub fn bind(&self) -> Result<()> {
        current::make_current(self.ctx)
    }

    /// Device name (e.g. "NVIDIA H200").
    pub fn name(&self) -> Result<String> {
        let mut buf = [0i8; 256];
        cu!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.dev))?;
        // SAFETY: the driver NUL-terminates within the buffer.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// PCI bus id, e.g. "0000:18:00.0".
    pub fn bus_id(&self) -> Result<String> {
        let mut buf = [0i8; 64];
        cu!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.dev))?;
        // SAFETY: the driver NUL-terminates within the buffer.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Number of streaming multiprocessors (`CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`).
    pub fn multiprocessor_count(&self) -> Result<u32> {
        let mut v = 0;
        cu!(cuDeviceGetAttribute(
            &mut v,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            self.dev
        ))?;
        Ok(v.max(1) as u32)
    }

    /// Compute capability × 10 (`CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` / `_MINOR`):
    /// 90 for an H100 or H200.
    pub fn compute_capability(&self) -> Result<u32> {
        let (mut major, mut minor) = (0, 0);
        cu!(cuDeviceGetAttribute(
            &mut major,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            self.dev
        ))?;
        cu!(cuDeviceGetAttribute(
            &mut minor,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            self.dev
        ))?;
        Ok((major.max(0) * 10 + minor.max(0)) as u32)
    }

    /// Whether this device can map `peer`'s memory.
    pub fn can_access_peer(&self, peer: &Context) -> Result<bool> {
        let mut v = 0;
        cu!(cuDeviceCanAccessPeer(&mut v, self.dev, peer.dev))?;
        Ok(v != 0)
    }

    /// Lets kernels in this context access `peer`'s memory (idempotent).
    pub fn enable_peer_access(&self, peer: &Context) -> Result<()> {
        self.bind()?;
        // SAFETY: both contexts are valid.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) };
        if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(r, "cuCtxEnablePeerAccess")
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0, 0);
        cu!(cuMemGetInfo_v2(&mut free, &mut total))?;
        Ok((free, total))
    }

    /// Waits for all work in this context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        cu!(cuCtxSynchronize())
    }

    /// The module of kernel entry point `name` if this context has loaded it already.
    pub fn loaded_kernel(&self, name: &str) -> Option<Arc<Module>> {
        self.modules.lock().ok()?.get(name).cloned()
    }

    /// The PTX module of kernel entry point `name` in this context, JIT-compiled from the embedded
    /// PTX on first use (see [`crate::kernels`]). Loading a module may wait for every kernel
    /// running in the context (CUDA's module loading can synchronise the context), so a caller
    /// whose peers' kernels might be spinning on it must load first (see `Comm::launch`).
    pub fn kernel(&self, name: &str) -> Result<Arc<Module>> {
        let mut mods = self
            .modules
            .lock()
            .map_err(|_| Error::Internal("module cache poisoned".into()))?;
        if let Some(m) = mods.get(name) {
            return Ok(m.clone());
        }
        let ptx = crate::kernels::module(name).ok_or_else(|| crate::kernels::not_built(name))?;
        let m = Arc::new(Module::load(self, name, &ptx)?);
        mods.insert(name.to_string(), m.clone());
        Ok(m)
    }
}

/// Block size the JIT register cap is computed for (NCCL's default `NCCL_NTHREADS`): the most
/// threads per block the kernels launch with.
pub const MAX_JIT_THREADS: u32 = 512;

/// A loaded PTX module and its collective kernel.
pub struct Module {
    _module: sys::CUmodule,
    pub(crate) kernel: sys::CUfunction,
    /// Wall time of `cuModuleLoadDataEx` (the JIT), in seconds.
    pub load_seconds: f64,
    /// Registers per thread of the collective kernel.
    pub num_regs: i32,
    /// Bytes of local (stack/spill) memory per thread.
    pub local_bytes: i32,
    /// Bytes of static shared memory per block (the kernel's own, plus the registers the JIT
    /// spilled there: [`ptx::with_smem_spilling`]).
    pub shared_bytes: i32,
    /// Whether the JIT was allowed to spill registers to shared memory ([`ptx`]).
    pub smem_spilling: bool,
    /// Most threads per block the kernel can be launched with.
    pub max_threads: u32,
}
// SAFETY: module and function handles are context-wide and thread-safe.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    fn load(ctx: &Context, name: &str, ptx: &str) -> Result<Module> {
        ctx.bind()?;
        let env = std::env::var("OXCCL_SMEM_SPILLING").ok();
        let (driver, cc) = (driver_version()?, ctx.compute_capability()?);
        let rewritten = if ptx::smem_spilling_applies(driver, cc, env.as_deref())? {
            ptx::with_smem_spilling(ptx, MAX_JIT_THREADS)
        } else {
            None
        };
        let smem_spilling = rewritten.is_some();
        let image = CString::new(rewritten.as_deref().unwrap_or(ptx))
            .map_err(|_| Error::Internal("PTX contains a NUL byte".into()))?;
        let t = std::time::Instant::now();
        let mut module = std::ptr::null_mut();
        // Cap registers so that blocks of MAX_JIT_THREADS threads fit one SM's 64K registers.
        let mut opts = [sys::CUjit_option::CU_JIT_MAX_REGISTERS];
        let mut vals = [(65536 / MAX_JIT_THREADS) as usize as *mut c_void];
        cu!(cuModuleLoadDataEx(
            &mut module,
            image.as_ptr() as *const c_void,
            opts.len() as u32,
            opts.as_mut_ptr(),
            vals.as_mut_ptr()
        ))?;
        let load_seconds = t.elapsed().as_secs_f64();
        let cname = CString::new(name).map_err(|_| Error::Internal("kernel name".into()))?;
        let mut kernel = std::ptr::null_mut();
        cu!(cuModuleGetFunction(&mut kernel, module, cname.as_ptr()))?;
        let attr = |a| -> Result<i32> {
            let mut v = 0;
            cu!(cuFuncGetAttribute(&mut v, a, kernel))?;
            Ok(v)
        };
        use sys::CUfunction_attribute as A;
        let num_regs = attr(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?;
        let local_bytes = attr(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?;
        let shared_bytes = attr(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
        let max_threads = attr(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?.max(32) as u32;
        tracing::debug!(target: "oxccl::init", device = ctx.ordinal, kernel = name, load_seconds, num_regs, local_bytes, shared_bytes, smem_spilling, max_threads, "PTX module loaded");
        Ok(Module {
            _module: module,
            kernel,
            load_seconds,
            num_regs,
            local_bytes,
            shared_bytes,
            smem_spilling,
            max_threads,
        })
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
pub struct DevAlloc {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    ctx: Arc<Context>,
}

impl DevAlloc {
    /// Allocates `bytes` (at least 1) on `ctx`'s device, zero-filled.
    pub fn zeroed(ctx: &Arc<Context>, bytes: usize) -> Result<DevAlloc> {
        ctx.bind()?;
        let mut ptr = 0;
        cu!(cuMemAlloc_v2(&mut ptr, bytes.max(1)))?;
        let a = DevAlloc {
            ptr,
            bytes,
            ctx: ctx.clone(),
        };
        cu!(cuMemsetD8_v2(ptr, 0, bytes.max(1)))?;
        // cuMemsetD8 may still be running: streams created non-blocking do not wait for it.
        cu!(cuCtxSynchronize())?;
        Ok(a)
    }
    /// [`copy_htod_beside`] at byte offset `off`: lands while kernels of the context run.
    pub fn write_beside(&self, off: usize, data: &[u8]) -> Result<()> {
        copy_htod_beside(&self.ctx, self.at(off, data.len())?, data)
    }
    /// Synchronous host→device copy at byte offset `off`.
    pub fn write(&self, off: usize, data: &[u8]) -> Result<()> {
        copy_htod(&self.ctx, self.at(off, data.len())?, data)
    }
    /// The device address of `len` bytes at `off`; `Internal` when they run past the end.
    fn at(&self, off: usize, len: usize) -> Result<u64> {
        if off + len > self.bytes {
            return Err(Error::Internal(format!(
                "device write of {len} bytes at {off} past {}",
                self.bytes
            )));
        }
        Ok(self.ptr + off as u64)
    }
}

impl Drop for DevAlloc {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok()
            && let Err(e) = cu!(cuMemFree_v2(self.ptr))
        {
            tracing::warn!(target: "oxccl::alloc", "freeing device memory: {e}");
        }
    }
}

/// Synchronous host→device copy. `dst` must be device memory of `ctx` valid for `src.len()` bytes.
///
/// From pageable memory the driver may return before the DMA has landed, and non-blocking streams
/// are not ordered after it: the copy is followed by a context synchronize, so work queued
/// afterwards on any stream sees the data.
pub fn copy_htod(ctx: &Context, dst: u64, src: &[u8]) -> Result<()> {
    ctx.bind()?;
    cu!(cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()))?;
    cu!(cuCtxSynchronize())
}

/// Host→device copy of a few control bytes on a stream of its own, returning once they have
/// landed. Unlike [`copy_htod`] (whose context synchronize waits for every kernel of the context)
/// it does not wait for work queued on other streams: the stream is non-blocking and the copy
/// runs on a copy engine, so it lands while kernels run (used by `Comm::abort`). `dst` must be
/// device memory of `ctx` valid for `src.len()` bytes.
pub fn copy_htod_beside(ctx: &Arc<Context>, dst: u64, src: &[u8]) -> Result<()> {
    let s = Stream::new(ctx)?;
    cu!(cuMemcpyHtoDAsync_v2(
        dst,
        src.as_ptr() as *const c_void,
        src.len(),
        s.raw
    ))?;
    s.synchronize()
}

/// Device→host copy of a few control bytes on `s`, a non-blocking stream of [`Stream::new`] the
/// caller keeps, returning once they have arrived: like [`copy_htod_beside`], it does not wait
/// for work queued on other streams (used by the timeout watch to read step counters while
/// kernels spin). `src` must be an address of the stream's context (device memory, or
/// device-mapped host memory) valid for `dst.len()` bytes.
pub fn copy_dtoh_on(s: &Stream, dst: &mut [u8], src: u64) -> Result<()> {
    s.ctx.bind()?;
    cu!(cuMemcpyDtoHAsync_v2(
        dst.as_mut_ptr() as *mut c_void,
        src,
        dst.len(),
        s.raw
    ))?;
    s.synchronize()
}

/// Synchronous device→host copy. `src` must be device memory of `ctx` valid for `dst.len()` bytes.
pub fn copy_dtoh(ctx: &Context, dst: &mut [u8], src: u64) -> Result<()> {
    ctx.bind()?;
    cu!(cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()))
}

/// Synchronous byte fill of device memory.
///
/// `cuMemsetD8` may be asynchronous: it is followed by a context synchronize, as [`copy_htod`].
pub fn memset(ctx: &Context, dst: u64, byte: u8, bytes: usize) -> Result<()> {
    ctx.bind()?;
    cu!(cuMemsetD8_v2(dst, byte, bytes))?;
    cu!(cuCtxSynchronize())
}

/// Page-locked host memory mapped into every device's address space (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`), e.g. for the abort flag the kernels poll.
pub struct HostMapped {
    host: *mut c_void,
    pub(crate) dev_ptr: u64,
    bytes: usize,
    /// Bound when freeing (the dropping thread may have no current context).
    ctx: Option<Arc<Context>>,
}
// SAFETY: the allocation is process-wide pinned memory; access goes through atomics.
unsafe impl Send for HostMapped {}
// SAFETY: as above.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    /// Allocates `bytes` of zeroed mapped host memory (needs a current context: `ctx`).
    pub fn zeroed(ctx: &Context, bytes: usize) -> Result<HostMapped> {
        ctx.bind()?;
        let mut host = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        cu!(cuMemHostAlloc(&mut host, bytes, flags))?;
        // SAFETY: `host` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        // Owned from here on: an error below frees it through Drop.
        let mut m = HostMapped {
            host,
            dev_ptr: 0,
            bytes,
            ctx: Context::get(ctx.ordinal).ok(),
        };
        cu!(cuMemHostGetDevicePointer_v2(&mut m.dev_ptr, host, 0))?;
        Ok(m)
    }
    /// The host address.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host as *mut u8
    }
    /// The device address of the first byte (what kernels use; `cuMemHostGetDevicePointer`).
    pub fn dev_ptr(&self) -> u64 {
        self.dev_ptr
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        if let Some(ctx) = &self.ctx {
            let _ = ctx.bind();
        }
        if let Err(e) = cu!(cuMemFreeHost(self.host)) {
            tracing::warn!(target: "oxccl::alloc", "freeing mapped host memory: {e}");
        }
    }
}

/// A CUDA stream (non-blocking with respect to the legacy default stream).
pub struct Stream {
    pub(crate) raw: sys::CUstream,
    pub(crate) ctx: Arc<Context>,
    /// For a stream this library created: destroys it when the last [`Stream`] sharing it
    /// ([`Stream::share`]) is dropped. `None` for a stream created elsewhere.
    owner: Option<Arc<DestroyStream>>,
}

/// Destroys its stream when dropped.
struct DestroyStream {
    raw: sys::CUstream,
    ctx: Arc<Context>,
}
// SAFETY: a stream handle may be destroyed from any thread with its context bound.
unsafe impl Send for DestroyStream {}
// SAFETY: as above; it is only read.
unsafe impl Sync for DestroyStream {}

impl Drop for DestroyStream {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok()
            && let Err(e) = cu!(cuStreamDestroy_v2(self.raw))
        {
            tracing::warn!(target: "oxccl::init", "destroying a stream: {e}");
        }
    }
}
// SAFETY: streams may be used from any thread with their context bound.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream on `ctx`'s device.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        cu!(cuStreamCreate(
            &mut raw,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
        ))?;
        Ok(Stream {
            raw,
            ctx: ctx.clone(),
            owner: Some(Arc::new(DestroyStream { raw, ctx: ctx.clone() })),
        })
    }
    /// Another handle to this stream that keeps it alive (a stream this library created is
    /// destroyed when its last handle is dropped): what a call queued past its return (a
    /// group's send or receive) keeps. A stream created elsewhere stays the caller's to keep.
    pub fn share(&self) -> Stream {
        Stream {
            raw: self.raw,
            ctx: self.ctx.clone(),
            owner: self.owner.clone(),
        }
    }
    /// Wraps a stream created elsewhere (not destroyed on drop).
    ///
    /// # Safety
    /// `raw` is a valid stream of device `ctx` that outlives the returned value.
    pub unsafe fn from_raw(ctx: &Arc<Context>, raw: sys::CUstream) -> Stream {
        Stream {
            raw,
            ctx: ctx.clone(),
            owner: None,
        }
    }
    /// The context (device) of this stream.
    pub fn ctx_arc(&self) -> Arc<Context> {
        self.ctx.clone()
    }
    /// Waits for all work queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuStreamSynchronize(self.raw))
    }
    /// Starts capturing the stream's work into a CUDA graph (`cuStreamBeginCapture`, relaxed
    /// mode: other threads' driver calls stay allowed during the capture); [`Stream::end_capture`]
    /// ends it.
    pub fn begin_capture(&self) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuStreamBeginCapture_v2(self.raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED))
    }
    /// Ends the stream's capture ([`Stream::begin_capture`]) and instantiates the graph it made
    /// (`cuStreamEndCapture`, `cuGraphInstantiateWithFlags`). Errors: the driver's (no capture
    /// in progress; a capture invalidated by an operation it could not capture).
    pub fn end_capture(&self) -> Result<Graph> {
        self.ctx.bind()?;
        let mut graph = std::ptr::null_mut();
        cu!(cuStreamEndCapture(self.raw, &mut graph))?;
        let mut g = Graph {
            graph,
            exec: std::ptr::null_mut(),
            ctx: self.ctx.clone(),
        };
        if !graph.is_null() {
            cu!(cuGraphInstantiateWithFlags(&mut g.exec, graph, 0))?;
        }
        Ok(g)
    }
    /// Whether work queued on the stream now would be captured into a CUDA graph
    /// (`cuStreamIsCapturing`: a capture in progress, or one invalidated and not yet ended).
    /// Errors: the driver's (e.g. the legacy default stream while another stream captures in
    /// global mode, where queuing work is not allowed at all).
    pub fn is_capturing(&self) -> Result<bool> {
        self.ctx.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        cu!(cuStreamIsCapturing(self.raw, &mut status))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }
    /// Queues a device→device copy.
    pub fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuMemcpyDtoDAsync_v2(dst, src, bytes, self.raw))
    }
    /// Queues a fill of `bytes` bytes at device address `dst` with `byte` (`cuMemsetD8Async`),
    /// e.g. as the launch-latency floor of the benchmarks. `dst` must be device memory of this
    /// stream's context valid for `bytes` bytes until the fill has run. Errors: [`Error::Cuda`]
    /// naming `cuMemsetD8Async` (an invalid address or range).
    pub fn memset_d8(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuMemsetD8Async(dst, byte, bytes, self.raw))
    }
    /// Queues a launch of the collective kernel.
    pub fn launch<A: bytemuck::Pod>(
        &self,
        module: &Module,
        grid: u32,
        block: u32,
        args: &A,
    ) -> Result<()> {
        self.ctx.bind()?;
        if block > module.max_threads {
            return Err(Error::invalid(format!(
                "NCCL_NTHREADS={block} exceeds what the kernel can launch with on this GPU ({})",
                module.max_threads
            )));
        }
        let mut params = [args as *const A as *mut c_void];
        cu!(cuLaunchKernel(
            module.kernel,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            self.raw,
            params.as_mut_ptr(),
            std::ptr::null_mut()
        ))
    }

    /// [`Stream::launch`] passing only the first `bytes` bytes of `args` as the kernel's
    /// parameter (`CU_LAUNCH_PARAM_BUFFER_POINTER`/`_SIZE`, as NCCL launches its kernels): for a
    /// parameter whose tail the kernel reads only as far as its header says (a batch of
    /// works). Errors: `bytes` beyond `args`, as [`Stream::launch`] otherwise.
    pub fn launch_prefix<A: bytemuck::Pod>(
        &self,
        module: &Module,
        grid: u32,
        block: u32,
        args: &A,
        bytes: usize,
    ) -> Result<()> {
        if bytes > std::mem::size_of::<A>() {
            return Err(Error::Internal(format!(
                "a kernel parameter of {bytes} bytes from an argument of {}",
                std::mem::size_of::<A>()
            )));
        }
        self.ctx.bind()?;
        if block > module.max_threads {
            return Err(Error::invalid(format!(
                "NCCL_NTHREADS={block} exceeds what the kernel can launch with on this GPU ({})",
                module.max_threads
            )));
        }
        let mut size = bytes;
        let mut extra = [
            sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT as usize as *mut c_void,
            args as *const A as *mut c_void,
            sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT as usize as *mut c_void,
            &mut size as *mut usize as *mut c_void,
            sys::CU_LAUNCH_PARAM_END_AS_INT as usize as *mut c_void,
        ];
        cu!(cuLaunchKernel(
            module.kernel,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            self.raw,
            std::ptr::null_mut(),
            extra.as_mut_ptr()
        ))
    }
}

/// A CUDA graph captured from a stream and instantiated ([`Stream::end_capture`]): what
/// `cudaGraphLaunch` replays. Destroyed on drop.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<Context>,
}
// SAFETY: graph handles may be used from any thread with their context bound.
unsafe impl Send for Graph {}
// SAFETY: as above; launches are serialized by the driver.
unsafe impl Sync for Graph {}

impl Graph {
    /// The ordinal of the device it was captured on.
    pub fn device(&self) -> usize {
        self.ctx.ordinal
    }
    /// Queues one replay of the graph on `stream` (`cuGraphLaunch`). An empty capture launches
    /// nothing.
    ///
    /// # Safety
    /// Every buffer the captured work reads or writes is still valid (and every communicator it
    /// belongs to still alive) until the replay has run.
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        if self.exec.is_null() {
            return Ok(());
        }
        self.ctx.bind()?;
        cu!(cuGraphLaunch(self.exec, stream.raw))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        if !self.exec.is_null()
            && let Err(e) = cu!(cuGraphExecDestroy(self.exec))
        {
            tracing::warn!(target: "oxccl::init", "destroying a CUDA graph's instance: {e}");
        }
        if !self.graph.is_null()
            && let Err(e) = cu!(cuGraphDestroy(self.graph))
        {
            tracing::warn!(target: "oxccl::init", "destroying a CUDA graph: {e}");
        }
    }
}

/// A CUDA event: a completion marker ([`Event::new`]) or a timestamp ([`Event::new_timed`]).
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<Context>,
}
// SAFETY: events are context-wide handles.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// Creates a completion marker on `ctx` (`CU_EVENT_DISABLE_TIMING`).
    ///
    /// Streams share the GPU's hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default), and
    /// a timing event recorded behind a kernel holds back everything queued after it on that
    /// hardware queue until the kernel ends, other streams' kernels included. Ranks sharing a GPU
    /// spin until each other's kernel runs, so a timed marker behind one rank's kernel could keep
    /// its peer's kernel from starting: measured on an H200, 10 of 10 waits deadlocked with a
    /// timed marker and 0 of 10 with an untimed one (docs/benchmarks.md). Use this one for
    /// anything recorded behind a collective.
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_flags(ctx, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }
    /// Creates a timing event on `ctx`, for [`Event::elapsed_ms_since`]. Record one behind a
    /// collective only once every rank sharing its GPU has queued that collective (see
    /// [`Event::new`]).
    pub fn new_timed(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_flags(ctx, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
    }
    fn with_flags(ctx: &Arc<Context>, flags: u32) -> Result<Event> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        cu!(cuEventCreate(&mut raw, flags))?;
        Ok(Event {
            raw,
            ctx: ctx.clone(),
        })
    }
    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuEventRecord(self.raw, stream.raw))
    }
    /// Makes the work queued on `stream` from now on wait for this event's work
    /// (`cuStreamWaitEvent`), without blocking the host.
    pub fn make_wait(&self, stream: &Stream) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuStreamWaitEvent(stream.raw, self.raw, 0))
    }
    /// Waits for the event.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        cu!(cuEventSynchronize(self.raw))
    }
    /// True when the work before the event has completed.
    pub fn is_complete(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: valid event.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery").map(|_| true)
    }
    /// Milliseconds from `start` to `self` (both recorded and complete).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        let mut ms = 0f32;
        cu!(cuEventElapsedTime_v2(&mut ms, start.raw, self.raw))?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok()
            && let Err(e) = cu!(cuEventDestroy_v2(self.raw))
        {
            tracing::warn!(target: "oxccl::init", "destroying an event: {e}");
        }
    }
}

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

impl DevAlloc {
    /// The device address of the allocation (a `CUdeviceptr`).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Exports this allocation to other processes (`cuIpcGetMemHandle`, as NCCL's P2P transport
    /// does for its buffers): the handle's bytes, which a peer process opens with
    /// [`IpcMapping::open`]. The allocation must stay alive while any peer has it open.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_BYTES]> {
        self.ctx.bind()?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        cu!(cuIpcGetMemHandle(&mut h, self.ptr))?;
        Ok(h.reserved.map(|b| b as u8))
    }
}

/// Device memory of another process opened in this one (`cuIpcOpenMemHandle` with
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`), closed with `cuIpcCloseMemHandle` on drop. The
/// exporting process must keep the memory allocated until every mapping of it is closed.
pub struct IpcMapping {
    ptr: u64,
    ctx: Arc<Context>,
}
// SAFETY: a device address valid in `ctx`, which is usable from any thread.
unsafe impl Send for IpcMapping {}
// SAFETY: as above; the mapping itself is never mutated.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens the memory behind `handle` (from [`DevAlloc::ipc_handle`] in another process) in
    /// `ctx`. Errors: [`Error::Cuda`] naming `cuIpcOpenMemHandle_v2` (a handle from this same
    /// process, a device this one cannot reach, or a freed allocation).
    pub fn open(ctx: &Arc<Context>, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<IpcMapping> {
        ctx.bind()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        cu!(cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32
        ))?;
        Ok(IpcMapping {
            ptr,
            ctx: ctx.clone(),
        })
    }

    /// The peer's memory as a device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok()
            && let Err(e) = cu!(cuIpcCloseMemHandle(self.ptr))
        {
            tracing::warn!(target: "oxccl::alloc", "closing a CUDA IPC mapping: {e}");
        }
    }
}

/// Host memory allocated elsewhere (e.g. a `/dev/shm` mapping shared with other processes),
/// page-locked and mapped into every device's address space (`cuMemHostRegister` with
/// `DEVICEMAP | PORTABLE`, as NCCL's `ncclShmOpen` registers its segments); unregistered on drop.
pub struct HostRegistration {
    host: *mut c_void,
    dev_ptr: u64,
    /// Bound when unregistering (the dropping thread may have no current context).
    ctx: Option<Arc<Context>>,
}
// SAFETY: registration of process-wide memory; this value only holds addresses.
unsafe impl Send for HostRegistration {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `bytes` bytes at `host` with the driver (needs a current context: `ctx`).
    ///
    /// # Safety
    /// `host` is page-aligned and valid for `bytes` bytes until the registration is dropped.
    pub unsafe fn new(ctx: &Context, host: *mut u8, bytes: usize) -> Result<HostRegistration> {
        ctx.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        cu!(cuMemHostRegister_v2(host as *mut c_void, bytes, flags))?;
        // Owned from here on: an error below unregisters through Drop.
        let mut r = HostRegistration {
            host: host as *mut c_void,
            dev_ptr: 0,
            ctx: Context::get(ctx.ordinal).ok(),
        };
        cu!(cuMemHostGetDevicePointer_v2(&mut r.dev_ptr, r.host, 0))?;
        Ok(r)
    }

    /// The device address of the registered memory's first byte.
    pub fn dev_ptr(&self) -> u64 {
        self.dev_ptr
    }
}

impl Drop for HostRegistration {
    /// Unregisters; a failure is logged, never raised (the memory itself is its owner's to free).
    fn drop(&mut self) {
        if let Some(ctx) = &self.ctx {
            let _ = ctx.bind();
        }
        if let Err(e) = cu!(cuMemHostUnregister(self.host)) {
            tracing::warn!(target: "oxccl::alloc", "unregistering host memory: {e}");
        }
    }
}

/// The ordinal, in this process, of the GPU with PCI bus id `bus_id` (e.g. "0000:18:00.0"), or
/// `None` when it is not visible here (`cuDeviceGetByPCIBusId`; other processes may see another
/// subset of GPUs through `CUDA_VISIBLE_DEVICES`).
pub fn device_by_bus_id(bus_id: &str) -> Result<Option<usize>> {
    driver()?;
    let c = CString::new(bus_id).map_err(|_| Error::invalid(format!("bus id {bus_id:?} contains NUL")))?;
    let mut dev = 0;
    // SAFETY: valid C string and out-pointer.
    let r = unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, c.as_ptr()) };
    if r == CUresult::CUDA_ERROR_INVALID_DEVICE || r == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    check(r, "cuDeviceGetByPCIBusId")?;
    // Driver-API device handles are the ordinals of the visible devices.
    Ok(Some(dev.max(0) as usize))
}
