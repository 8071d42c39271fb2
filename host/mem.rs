//! Devices, buffers and streams: what callers pass to collectives. A [`Device`] is a CUDA GPU or a
//! CPU-target device; its [`DeviceBuffer`]s and [`Stream`]s work with communicators on it.
use crate::cpu::{CpuStream, HostMem};
use crate::cuda;
use crate::error::{Error, Result};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Where a communicator's rank runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// CUDA device ordinal.
    Cuda(usize),
    /// CPU-target device index (a label: every CPU device is host memory and host threads).
    Cpu(usize),
}

impl Device {
    /// Number of visible CUDA devices (0 without a driver).
    pub fn cuda_count() -> usize {
        cuda::device_count()
    }
    /// Every visible CUDA device.
    pub fn all_cuda() -> Vec<Device> {
        (0..Self::cuda_count()).map(Device::Cuda).collect()
    }
    /// `n` CPU-target devices.
    pub fn cpus(n: usize) -> Vec<Device> {
        (0..n).map(Device::Cpu).collect()
    }
    /// True for a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
    /// Allocates `bytes` of zeroed memory on this device (CUDA: `cuMemAlloc`).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let alloc = match *self {
            Device::Cuda(o) => Alloc::Cuda(cuda::DevAlloc::zeroed(&cuda::Context::get(o)?, bytes)?),
            Device::Cpu(_) => Alloc::Host(ManuallyDrop::new(HostMem::zeroed(bytes)?)),
        };
        Ok(DeviceBuffer {
            device: *self,
            bytes,
            alloc: ManuallyDrop::new(alloc),
        })
    }
    /// Creates a stream on this device.
    pub fn new_stream(&self) -> Result<Stream> {
        Ok(match *self {
            Device::Cuda(o) => Stream::Cuda(cuda::Stream::new(&cuda::Context::get(o)?)?),
            Device::Cpu(i) => Stream::Cpu(Arc::new(CpuStream::new(i)?)),
        })
    }
}

enum Alloc {
    Cuda(cuda::DevAlloc),
    /// Freed by [`DeviceBuffer`]'s drop once the device's queued work is done.
    Host(ManuallyDrop<HostMem>),
}

/// How long freeing a CPU-target buffer waits for the device's queued operations before leaking
/// the memory instead (an operation whose peers never came may never finish).
const HOST_FREE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Memory on one device. Collectives take [`DevSlice`]s of it; its length bounds every access.
pub struct DeviceBuffer {
    device: Device,
    bytes: usize,
    /// Dropped (or moved out, when a group still holds the buffer) by [`DeviceBuffer`]'s drop.
    alloc: ManuallyDrop<Alloc>,
}

impl DeviceBuffer {
    /// The device holding this buffer.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }
    /// True when zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    /// Base address (a `CUdeviceptr` on CUDA, a host address on the CPU target).
    pub fn addr(&self) -> u64 {
        match &*self.alloc {
            Alloc::Cuda(a) => a.ptr,
            Alloc::Host(h) => h.addr(),
        }
    }
    /// The whole buffer as a slice.
    pub fn as_slice(&self) -> DevSlice<'_> {
        DevSlice {
            addr: self.addr(),
            bytes: self.bytes,
            device: self.device,
            _buf: PhantomData,
        }
    }
    /// `len` bytes from byte offset `off`; errors if that leaves the buffer.
    pub fn slice(&self, off: usize, len: usize) -> Result<DevSlice<'_>> {
        if off.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(Error::invalid(format!(
                "slice {off}..{} is outside a buffer of {} bytes",
                off.saturating_add(len),
                self.bytes
            )));
        }
        Ok(DevSlice {
            addr: self.addr() + off as u64,
            bytes: len,
            device: self.device,
            _buf: PhantomData,
        })
    }
    /// Copies `data` to byte offset `off`, synchronously. Synchronize streams that use the buffer
    /// first.
    pub fn write(&self, off: usize, data: &[u8]) -> Result<()> {
        self.slice(off, data.len())?;
        match &*self.alloc {
            Alloc::Cuda(a) => a.write(off, data),
            Alloc::Host(h) => {
                // SAFETY: bounds checked above; the caller synchronized users of the buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), (h.addr() as *mut u8).add(off), data.len())
                };
                Ok(())
            }
        }
    }
    /// Copies bytes from offset `off` into `out`, synchronously (after synchronizing streams).
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<()> {
        self.slice(off, out.len())?;
        match &*self.alloc {
            Alloc::Cuda(a) => {
                let ctx = cuda::Context::get(match self.device {
                    Device::Cuda(o) => o,
                    Device::Cpu(_) => return Err(Error::Internal("CUDA allocation on a CPU device".into())),
                })?;
                cuda::copy_dtoh(&ctx, out, a.ptr + off as u64)
            }
            Alloc::Host(h) => {
                // SAFETY: bounds checked above; the caller synchronized users of the buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (h.addr() as *const u8).add(off),
                        out.as_mut_ptr(),
                        out.len(),
                    )
                };
                Ok(())
            }
        }
    }
    /// The whole buffer copied to the host.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.bytes];
        self.read(0, &mut v)?;
        Ok(v)
    }
    /// Fills the whole buffer with `byte`, synchronously.
    pub fn fill(&self, byte: u8) -> Result<()> {
        match (&*self.alloc, self.device) {
            (Alloc::Cuda(a), Device::Cuda(o)) => {
                cuda::memset(&*cuda::Context::get(o)?, a.ptr, byte, self.bytes)
            }
            _ => self.write(0, &vec![byte; self.bytes]),
        }
    }
}

impl Drop for DeviceBuffer {
    /// CUDA memory is freed by `cuMemFree`, which waits for the GPU's work. CPU-target memory
    /// waits the same way for every operation queued on the device's streams before the drop (a
    /// collective queued on a buffer that is dropped before `synchronize` still reads live
    /// memory; work queued later is not waited for); if those are not done within
    /// `HOST_FREE_WAIT` (30 s) the memory is leaked with a warning rather than freed under a running
    /// operation. A buffer that a group's queued sends or receives still name (issued inside
    /// [`crate::group_start`], not yet run) is freed only after the group's outermost end has
    /// queued them (`group/held.rs`).
    fn drop(&mut self) {
        let (addr, device, bytes) = (self.addr(), self.device, self.bytes);
        let alloc = &mut self.alloc;
        let parked = crate::group::held::park_if_held(addr, bytes as u64, || DeviceBuffer {
            device,
            bytes,
            // SAFETY: taken once; `park_if_held` returns true after taking it, and then this
            // drop touches `self.alloc` no more.
            alloc: ManuallyDrop::new(unsafe { ManuallyDrop::take(alloc) }),
        });
        if parked {
            return;
        }
        let device = match (&mut *self.alloc, self.device) {
            (Alloc::Host(_), Device::Cpu(i)) => i,
            _ => {
                // SAFETY: dropped once, here; `self.alloc` is not used after drop.
                unsafe { ManuallyDrop::drop(&mut self.alloc) };
                return;
            }
        };
        if crate::cpu::wait_queued_work(device, HOST_FREE_WAIT) {
            // SAFETY: dropped once, here; `self.alloc` is not used after drop. (The host memory
            // inside is freed by dropping it: `Alloc::Host` holds it in a `ManuallyDrop`.)
            unsafe {
                if let Alloc::Host(h) = &mut *self.alloc {
                    ManuallyDrop::drop(h);
                }
            }
        } else {
            tracing::warn!(
                target: "oxccl::alloc",
                "CPU device {device} still has queued operations after {HOST_FREE_WAIT:?}; leaking a buffer of {} bytes instead of freeing it under them",
                self.bytes
            );
        }
    }
}

/// A borrowed byte range of a [`DeviceBuffer`].
#[derive(Clone, Copy, Debug)]
pub struct DevSlice<'a> {
    pub(crate) addr: u64,
    pub(crate) bytes: usize,
    pub(crate) device: Device,
    _buf: PhantomData<&'a DeviceBuffer>,
}

impl<'a> DevSlice<'a> {
    /// A range of `bytes` bytes at `addr` on `device` that no [`DeviceBuffer`] of this library
    /// owns (memory the caller allocated: a C caller's `cudaMalloc`, a framework's tensor).
    ///
    /// # Safety
    /// `addr..addr + bytes` is memory of `device` (CPU target: host memory) that stays valid,
    /// and is not freed, while the slice and any work queued with it are in use.
    pub unsafe fn from_raw(addr: u64, bytes: usize, device: Device) -> DevSlice<'a> {
        DevSlice {
            addr,
            bytes,
            device,
            _buf: PhantomData,
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    /// The device holding it.
    pub fn device(&self) -> Device {
        self.device
    }
}

impl<'a> From<&'a DeviceBuffer> for DevSlice<'a> {
    fn from(b: &'a DeviceBuffer) -> Self {
        b.as_slice()
    }
}

/// An ordered queue of operations on one device: a CUDA stream, or a CPU-target worker.
pub enum Stream {
    Cuda(cuda::Stream),
    Cpu(Arc<CpuStream>),
}

impl Stream {
    /// Another handle to this stream that keeps it alive (a queued point-to-point call keeps
    /// one until its group ends, so a stream dropped inside the group is destroyed after that).
    pub(crate) fn handle(&self) -> Stream {
        match self {
            Stream::Cuda(s) => Stream::Cuda(s.share()),
            Stream::Cpu(s) => Stream::Cpu(s.clone()),
        }
    }

    /// Whether `other` is this stream (or a handle to it).
    pub(crate) fn same(&self, other: &Stream) -> bool {
        match (self, other) {
            (Stream::Cuda(a), Stream::Cuda(b)) => a.raw == b.raw && a.ctx.ordinal == b.ctx.ordinal,
            (Stream::Cpu(a), Stream::Cpu(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Starts capturing the work queued on this stream into a graph instead of running it
    /// (CUDA's stream capture, `cuStreamBeginCapture` in relaxed mode; on the CPU target the
    /// stream records its operations), until [`Stream::end_capture`]. oxccl's collectives and
    /// point-to-point calls issued on a capturing stream become part of the graph, as NCCL's do,
    /// and every [`CapturedGraph::launch`] replays them, over every transport. Errors: the
    /// driver's, or a capture already in progress (CPU target).
    ///
    /// ```
    /// # use oxccl::{Comm, DataType, Device, RedOp};
    /// let comms = Comm::init_all(&Device::cpus(1))?;
    /// let (c, s) = (&comms[0], comms[0].device().new_stream()?);
    /// let (send, recv) = (c.device().alloc(4096)?, c.device().alloc(4096)?);
    /// send.write(0, &[7u8; 4096])?;
    /// s.begin_capture()?;
    /// c.all_reduce(&send, &recv, 1024, DataType::F32, RedOp::Sum, &s)?; // captured, not run
    /// let graph = s.end_capture()?;
    /// s.synchronize()?;
    /// assert_eq!(recv.to_vec()?, vec![0u8; 4096]);
    /// // SAFETY: `send`, `recv` and `c` outlive the replay (synchronized below).
    /// unsafe { graph.launch(&s)? };
    /// s.synchronize()?;
    /// assert_eq!(recv.to_vec()?, vec![7u8; 4096]);
    /// # Ok::<(), oxccl::Error>(())
    /// ```
    pub fn begin_capture(&self) -> Result<()> {
        match self {
            Stream::Cuda(s) => s.begin_capture(),
            Stream::Cpu(s) => s.begin_capture(),
        }
    }

    /// Ends the capture [`Stream::begin_capture`] started and returns its graph, ready to launch.
    /// Errors: no capture in progress; a capture invalidated by an operation that could not be
    /// captured (e.g. a [`Stream::synchronize`] during it).
    pub fn end_capture(&self) -> Result<CapturedGraph> {
        match self {
            Stream::Cuda(s) => s.end_capture().map(CapturedGraph::Cuda),
            Stream::Cpu(s) => s.end_capture().map(CapturedGraph::Cpu),
        }
    }

    /// Whether work queued on this stream now is captured into a graph rather than run
    /// ([`Stream::begin_capture`]; `cuStreamIsCapturing`). Errors: the driver's.
    pub fn is_capturing(&self) -> Result<bool> {
        match self {
            Stream::Cuda(s) => s.is_capturing(),
            Stream::Cpu(s) => Ok(s.is_capturing()),
        }
    }

    /// The device this stream runs on.
    pub fn device(&self) -> Device {
        match self {
            Stream::Cuda(s) => Device::Cuda(s.ctx.ordinal),
            Stream::Cpu(s) => Device::Cpu(s.device),
        }
    }
    /// Waits for everything queued; returns the first error of queued operations.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Stream::Cuda(s) => s.synchronize(),
            Stream::Cpu(s) => s.synchronize(),
        }
    }
}

/// The work a stream captured ([`Stream::end_capture`]): a CUDA graph, instantiated, or the CPU
/// target's recorded operations. Each [`CapturedGraph::launch`] replays all of it on a stream.
pub enum CapturedGraph {
    Cuda(cuda::Graph),
    Cpu(crate::cpu::CpuGraph),
}

impl CapturedGraph {
    /// Queues one replay of the captured work on `stream` (`cuGraphLaunch`), after what the
    /// stream holds. Collectives in it run as the calls they were captured from, with the same
    /// buffers, counts and operators; their data is what the buffers hold when the replay runs.
    /// Every rank of a communicator must replay its graph the same number of times, in the same
    /// order relative to its other calls on that communicator, as with any collective call.
    /// Errors: `stream` is of another backend or device; the driver's.
    ///
    /// # Safety
    /// Every buffer the captured calls read or write is valid until the replay has run, and
    /// every communicator they were issued on is alive (not destroyed or dropped) until then.
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        match (self, stream) {
            (CapturedGraph::Cuda(g), Stream::Cuda(s)) => {
                if g.device() != s.ctx.ordinal {
                    return Err(Error::invalid(format!(
                        "the graph was captured on cuda:{} but the stream is on cuda:{}",
                        g.device(),
                        s.ctx.ordinal
                    )));
                }
                // SAFETY: forwarded caller contract.
                unsafe { g.launch(s) }
            }
            (CapturedGraph::Cpu(g), Stream::Cpu(s)) => {
                if g.device() != s.device {
                    return Err(Error::invalid(format!(
                        "the graph was captured on cpu:{} but the stream is on cpu:{}",
                        g.device(),
                        s.device
                    )));
                }
                // SAFETY: forwarded caller contract.
                unsafe { g.launch(s) }
            }
            _ => Err(Error::invalid("the graph and the stream are of different backends (CUDA and CPU target)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Dropping a CPU-target buffer while an operation queued on it has not run yet waits for that
    /// operation (as `cuMemFree` waits for the GPU), so the operation reads live memory.
    #[test]
    fn cpu_buffer_drop_waits_for_queued_work() {
        let dev = Device::Cpu(7);
        let Stream::Cpu(stream) = dev.new_stream().unwrap() else {
            panic!("a CPU device gave a CUDA stream")
        };
        let buf = dev.alloc(64 << 20).unwrap();
        buf.write(0, &0xC0FFEEu32.to_ne_bytes()).unwrap();
        let addr = buf.addr();
        let seen = Arc::new(AtomicU32::new(0));
        let s = seen.clone();
        stream
            .enqueue(move || {
                std::thread::sleep(std::time::Duration::from_millis(300));
                // SAFETY: what the test checks: the buffer is still allocated here.
                s.store(unsafe { (addr as *const u32).read_volatile() }, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        let t = std::time::Instant::now();
        drop(buf);
        assert!(
            t.elapsed() >= std::time::Duration::from_millis(250),
            "drop returned in {:?}",
            t.elapsed()
        );
        assert_eq!(seen.load(Ordering::SeqCst), 0xC0FFEE);
        // Idle device: freeing does not wait.
        let t = std::time::Instant::now();
        drop(dev.alloc(4096).unwrap());
        assert!(t.elapsed() < std::time::Duration::from_millis(250));
        stream.synchronize().unwrap();
        // An operation that frees memory of its own device does not wait for itself.
        let buf = dev.alloc(4096).unwrap();
        let t = std::time::Instant::now();
        stream
            .enqueue(move || {
                drop(buf);
                Ok(())
            })
            .unwrap();
        stream.synchronize().unwrap();
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
    }
}
