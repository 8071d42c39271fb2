//! The CPU target's runtime: host memory for buffers and FIFOs, and a CPU "stream" — one worker
//! thread that runs queued operations in order, like a CUDA stream runs kernels. A collective on
//! the CPU target runs each channel's block on its own host thread with the same
//! [`oxccl_gpu::dispatch::run_block`] the GPU kernel runs.
use crate::error::{Error, Result};
use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use std::alloc::Layout;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Zeroed host memory with a fixed address, freed on drop. Accessed only through raw pointers
/// (the CPU target's "device memory").
pub struct HostMem {
    ptr: *mut u8,
    layout: Layout,
}
// SAFETY: a plain heap allocation; concurrent access is coordinated by the FIFO protocol or by
// stream order, exactly as for device memory.
unsafe impl Send for HostMem {}
// SAFETY: as above.
unsafe impl Sync for HostMem {}

impl HostMem {
    /// Allocates `bytes` (at least 1) zeroed bytes aligned to 4096.
    pub fn zeroed(bytes: usize) -> Result<HostMem> {
        let layout = Layout::from_size_align(bytes.max(1), 4096)
            .map_err(|e| Error::invalid(format!("host allocation of {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::System(format!(
                "out of host memory allocating {bytes} bytes"
            )));
        }
        Ok(HostMem { ptr, layout })
    }
    /// Base address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    /// True when zero-sized (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

type Job = Box<dyn FnOnce() -> Result<()> + Send>;

/// A CPU stream: operations run in order on one worker thread. Errors are sticky until the next
/// [`CpuStream::synchronize`], which returns the first one.
pub struct CpuStream {
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    exited: Receiver<()>,
    error: Arc<Mutex<Option<Error>>>,
    pub(crate) device: usize,
}

impl CpuStream {
    /// Starts the worker thread of a stream on CPU device `device`.
    pub fn new(device: usize) -> Result<CpuStream> {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = unbounded();
        let error = Arc::new(Mutex::new(None));
        let err = error.clone();
        let (exit_tx, exited) = bounded(1);
        let worker = std::thread::Builder::new()
            .name(format!("oxccl-cpu-stream-{device}"))
            .spawn(move || {
                let _exit = ExitSignal(exit_tx);
                for job in rx {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                        .unwrap_or_else(|_| Err(Error::Internal("a CPU-target operation panicked".into())));
                    if let Err(e) = r {
                        if let Ok(mut slot) = err.lock() {
                            slot.get_or_insert(e);
                        }
                    }
                }
            })
            .map_err(|e| Error::System(format!("spawning a CPU stream thread: {e}")))?;
        Ok(CpuStream {
            tx: Some(tx),
            worker: Some(worker),
            exited,
            error,
            device,
        })
    }

    /// Queues `job` after everything queued before.
    pub fn enqueue(&self, job: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
        self.tx
            .as_ref()
            .ok_or_else(|| Error::InvalidUsage("CPU stream is shut down".into()))?
            .send(Box::new(job))
            .map_err(|_| Error::Internal("CPU stream worker is gone".into()))
    }

    /// Waits until every queued operation has run; returns the first error since the last call.
    pub fn synchronize(&self) -> Result<()> {
        let (done_tx, done_rx) = bounded(1);
        self.enqueue(move || {
            let _ = done_tx.send(());
            Ok(())
        })?;
        done_rx
            .recv()
            .map_err(|_| Error::Internal("CPU stream worker stopped".into()))?;
        match self.error.lock() {
            Ok(mut e) => e.take().map_or(Ok(()), Err),
            Err(_) => Err(Error::Internal("CPU stream error slot poisoned".into())),
        }
    }
}

/// Tells the stream's owner that the worker thread is exiting (sent when dropped, even on panic).
struct ExitSignal(Sender<()>);
impl Drop for ExitSignal {
    fn drop(&mut self) {
        let _ = self.0.try_send(());
    }
}

/// How long dropping a CPU stream waits for queued operations before detaching its worker.
const STREAM_DROP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl Drop for CpuStream {
    /// Lets queued operations finish (bounded), then joins the worker; a worker still stuck after
    /// the wait (an operation whose peers never came) is detached with a warning instead of
    /// hanging the caller.
    fn drop(&mut self) {
        self.tx.take();
        let Some(w) = self.worker.take() else { return };
        match self.exited.recv_timeout(STREAM_DROP_WAIT) {
            Ok(()) | Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                if w.join().is_err() {
                    tracing::warn!(target: "oxccl::init", "CPU stream worker panicked");
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                tracing::warn!(target: "oxccl::init", "CPU stream still busy after {STREAM_DROP_WAIT:?}; detaching its worker");
            }
        }
    }
}
