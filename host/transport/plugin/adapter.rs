//! A loaded plugin behind oxccl's [`Net`] trait ([`PluginNet`]): its connections, listeners and
//! requests, dispatched to the v8, v9 or v10 calls (what NCCL's `src/plugin/net/net_v8.cc` …
//! `net_v10.cc` adapt to its current interface), and the memory registration every
//! `isend`/`irecv` needs (registered FIFOs, a copy buffer for small messages, registrations for
//! one request).
use super::super::net::{
    ListenComm, NET_HANDLE_BYTES, Net, NetHandle, NetProperties, Opaque, RecvComm, Request, SendComm,
};
use super::{
    MAX_REQUESTS, NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_PTR_HOST, NetCommConfigV10, Plugin, PluginNet, Versioned,
};
use crate::error::{Error, Result};
use std::ffi::{CStr, c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};

/// Largest message, in bytes, that [`PluginNet`] sends or receives through a connection's
/// registered copy buffer when its memory is not registered (the proxy's headers are 32 bytes).
pub const COPY_SLOT_BYTES: usize = 256;

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
