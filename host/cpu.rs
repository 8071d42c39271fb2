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

/// An operation a captured graph runs at each of its launches ([`CpuStream::enqueue_replayable`]).
pub type ReplayJob = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// A capture in progress on a CPU stream ([`CpuStream::begin_capture`]): what it recorded, and
/// why it can no longer end in a graph (an operation that cannot be replayed was queued).
#[derive(Default)]
struct Capture {
    jobs: Vec<ReplayJob>,
    invalid: Option<String>,
}

/// The operations a CPU stream's capture recorded ([`CpuStream::end_capture`]), the CPU
/// target's CUDA graph: [`CpuGraph::launch`] queues them all again, in order, on a stream.
pub struct CpuGraph {
    jobs: Vec<ReplayJob>,
    device: usize,
}

impl CpuGraph {
    /// The CPU-target device of the stream it was captured on.
    pub fn device(&self) -> usize {
        self.device
    }
    /// Operations recorded.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }
    /// Whether the capture recorded nothing.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }
    /// Queues every recorded operation on `stream`, in the order they were captured, after
    /// what `stream` already holds (`cuGraphLaunch`). Errors: the stream is capturing itself,
    /// or is shut down.
    ///
    /// # Safety
    /// Every buffer the captured operations read or write is still valid (and every
    /// communicator they belong to still alive) until they have run.
    pub unsafe fn launch(&self, stream: &CpuStream) -> Result<()> {
        if stream.is_capturing() {
            return Err(Error::InvalidUsage(
                "launching a captured graph on a CPU stream that is capturing (not supported)".into(),
            ));
        }
        for job in &self.jobs {
            let job = job.clone();
            stream.push(Box::new(move || job()))?;
        }
        Ok(())
    }
}

/// How far one CPU stream has got: operations queued and operations finished, in order.
#[derive(Default)]
struct Progress {
    /// (queued, finished) operation counts since the stream started.
    counts: Mutex<(u64, u64)>,
    finished: std::sync::Condvar,
    /// The worker thread: an operation freeing memory does not wait for itself.
    worker: std::sync::OnceLock<std::thread::ThreadId>,
}

impl Progress {
    fn queued(&self) -> u64 {
        self.counts.lock().map_or(0, |c| c.0)
    }
    fn add_queued(&self, delta: i64) {
        if let Ok(mut c) = self.counts.lock() {
            c.0 = c.0.saturating_add_signed(delta);
        }
    }
    fn add_finished(&self) {
        if let Ok(mut c) = self.counts.lock() {
            c.1 += 1;
            self.finished.notify_all();
        }
    }
    /// Waits until `target` operations have finished, until `deadline`; whether they did.
    fn wait_finished(&self, target: u64, deadline: std::time::Instant) -> bool {
        let Ok(mut c) = self.counts.lock() else {
            return false;
        };
        while c.1 < target {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            c = match self.finished.wait_timeout(c, left) {
                Ok((c, _)) => c,
                Err(_) => return false,
            };
        }
        true
    }
}

/// The live CPU streams of each CPU-target device label: what freeing a buffer waits for (see
/// [`wait_queued_work`]).
static STREAMS: Mutex<Vec<(usize, std::sync::Weak<Progress>)>> = Mutex::new(Vec::new());

/// Waits until every operation queued so far on the CPU streams of `device` has finished, for at
/// most `limit`; `true` when they did. Work queued later (or on other devices) is not waited
/// for, nor is the calling stream's own queue when an operation frees memory (everything queued
/// before it there has run). Freeing CPU-target memory calls it first, as `cuMemFree` waits for the GPU's work: a
/// buffer dropped right after a collective was queued on it stays mapped until that collective
/// is done.
pub fn wait_queued_work(device: usize, limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let targets: Vec<(Arc<Progress>, u64)> = match STREAMS.lock() {
        Ok(mut streams) => {
            streams.retain(|(_, w)| w.strong_count() > 0);
            streams
                .iter()
                .filter(|(d, _)| *d == device)
                .filter_map(|(_, w)| w.upgrade())
                .filter(|p| p.worker.get() != Some(&std::thread::current().id()))
                .map(|p| {
                    let q = p.queued();
                    (p, q)
                })
                .collect()
        }
        Err(_) => return false,
    };
    targets.iter().all(|(p, q)| p.wait_finished(*q, deadline))
}

/// A CPU stream: operations run in order on one worker thread. Errors are sticky until the next
/// [`CpuStream::synchronize`], which returns the first one.
pub struct CpuStream {
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    exited: Receiver<()>,
    error: Arc<Mutex<Option<Error>>>,
    progress: Arc<Progress>,
    pub(crate) device: usize,
    /// The capture in progress, if any (CUDA's stream capture, for the CPU target).
    capture: Mutex<Option<Capture>>,
}

impl CpuStream {
    /// Starts the worker thread of a stream on CPU device `device`.
    pub fn new(device: usize) -> Result<CpuStream> {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = unbounded();
        let error = Arc::new(Mutex::new(None));
        let err = error.clone();
        let progress = Arc::new(Progress::default());
        let done = progress.clone();
        let (exit_tx, exited) = bounded(1);
        let worker = std::thread::Builder::new()
            .name(format!("oxccl-cpu-stream-{device}"))
            .spawn(move || {
                let _exit = ExitSignal(exit_tx);
                let _ = done.worker.set(std::thread::current().id());
                for job in rx {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                        .unwrap_or_else(|_| Err(Error::Internal("a CPU-target operation panicked".into())));
                    done.add_finished();
                    if let Err(e) = r
                        && let Ok(mut slot) = err.lock()
                    {
                        slot.get_or_insert(e);
                    }
                }
            })
            .map_err(|e| Error::System(format!("spawning a CPU stream thread: {e}")))?;
        if let Ok(mut streams) = STREAMS.lock() {
            streams.retain(|(_, w)| w.strong_count() > 0);
            streams.push((device, Arc::downgrade(&progress)));
        }
        Ok(CpuStream {
            tx: Some(tx),
            worker: Some(worker),
            exited,
            error,
            progress,
            device,
            capture: Mutex::new(None),
        })
    }

    /// Queues `job` after everything queued before. Errors: the stream is capturing (`job`
    /// runs once and cannot be part of a graph: the capture is invalidated, as CUDA invalidates
    /// a capture on an operation it cannot capture), or is shut down.
    pub fn enqueue(&self, job: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
        if let Ok(mut c) = self.capture.lock()
            && let Some(c) = c.as_mut()
        {
            let why = "an operation that cannot be replayed was queued on the CPU stream while it was capturing";
            c.invalid.get_or_insert_with(|| why.into());
            return Err(Error::InvalidUsage(format!("{why}; the capture is invalidated")));
        }
        self.push(Box::new(job))
    }

    /// Queues `job` after everything queued before, or, while the stream is capturing, records
    /// it in the capture: then it runs at each launch of the captured graph instead
    /// ([`CpuGraph::launch`]), never now.
    pub fn enqueue_replayable(&self, job: impl Fn() -> Result<()> + Send + Sync + 'static) -> Result<()> {
        if let Ok(mut c) = self.capture.lock()
            && let Some(c) = c.as_mut()
        {
            c.jobs.push(Arc::new(job));
            return Ok(());
        }
        self.push(Box::new(job))
    }

    /// Starts recording what is queued on the stream into a graph instead of running it (CUDA's
    /// `cuStreamBeginCapture`), until [`CpuStream::end_capture`]. Errors: a capture is already
    /// in progress.
    pub fn begin_capture(&self) -> Result<()> {
        let mut c = self
            .capture
            .lock()
            .map_err(|_| Error::Internal("CPU stream capture state poisoned".into()))?;
        if c.is_some() {
            return Err(Error::InvalidUsage("the CPU stream is already capturing".into()));
        }
        *c = Some(Capture::default());
        Ok(())
    }

    /// Whether operations queued now are captured ([`CpuStream::begin_capture`]; an invalidated
    /// capture counts until it ends, as `cuStreamIsCapturing` says).
    pub fn is_capturing(&self) -> bool {
        self.capture.lock().is_ok_and(|c| c.is_some())
    }

    /// Ends the capture and returns the graph of what it recorded (`cuStreamEndCapture`).
    /// Errors: no capture is in progress, or it was invalidated (an operation that cannot be
    /// replayed was queued during it; the error says so).
    pub fn end_capture(&self) -> Result<CpuGraph> {
        let c = self
            .capture
            .lock()
            .map_err(|_| Error::Internal("CPU stream capture state poisoned".into()))?
            .take()
            .ok_or_else(|| Error::InvalidUsage("the CPU stream is not capturing".into()))?;
        match c.invalid {
            Some(why) => Err(Error::InvalidUsage(format!("the capture was invalidated: {why}"))),
            None => Ok(CpuGraph {
                jobs: c.jobs,
                device: self.device,
            }),
        }
    }

    fn push(&self, job: Job) -> Result<()> {
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| Error::InvalidUsage("CPU stream is shut down".into()))?;
        self.progress.add_queued(1);
        tx.send(job).map_err(|_| {
            self.progress.add_queued(-1);
            Error::Internal("CPU stream worker is gone".into())
        })
    }

    /// Waits until every queued operation has run; returns the first error since the last call.
    /// Errors: the stream is capturing (it invalidates the capture, as in CUDA).
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

/// A POSIX shared-memory segment (`/dev/shm/<name>`) mapped into this process: the CPU target's
/// connection memory when ranks live in different processes (the seed's SHM path, `shmutils.cc`).
/// The creator sizes it; peers open it by name. Unmapped on drop.
pub struct ShmSegment {
    ptr: *mut u8,
    bytes: usize,
    path: std::path::PathBuf,
}
// SAFETY: shared memory accessed through raw pointers under the FIFO protocol, like HostMem.
unsafe impl Send for ShmSegment {}
// SAFETY: as above.
unsafe impl Sync for ShmSegment {}

fn os_err(what: String) -> Error {
    Error::System(format!("{what}: {}", std::io::Error::last_os_error()))
}

impl ShmSegment {
    /// Creates `/dev/shm/<name>` of `bytes` zeroed bytes and maps it. Space is reserved up front, so
    /// a `/dev/shm` that is too small is an error saying how much was needed, not a later SIGBUS.
    pub fn create(name: &str, bytes: usize) -> Result<ShmSegment> {
        let path = std::path::Path::new("/dev/shm").join(name);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::invalid(format!("shared-memory name {name:?} contains NUL")))?;
        // SAFETY: valid C string; flags create a new file exclusively.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) };
        if fd < 0 {
            return Err(os_err(format!("creating {}", path.display())));
        }
        // SAFETY: `fd` is an open file we own.
        let r = unsafe { libc::posix_fallocate(fd, 0, bytes as libc::off_t) };
        if r != 0 {
            // SAFETY: closing and unlinking our own file.
            unsafe {
                libc::close(fd);
                libc::unlink(c.as_ptr());
            }
            return Err(Error::System(format!(
                "/dev/shm has too little space: {bytes} bytes were needed for {} ({}); enlarge /dev/shm \
                 (e.g. docker --shm-size) or lower NCCL_BUFFSIZE / NCCL_MAX_NCHANNELS / NCCL_NCHANNELS_PER_PEER",
                path.display(),
                std::io::Error::from_raw_os_error(r)
            )));
        }
        Self::map(fd, path, bytes)
    }

    /// Maps the existing segment `name` of `bytes` bytes (created by a peer).
    pub fn open(name: &str, bytes: usize) -> Result<ShmSegment> {
        let path = std::path::Path::new("/dev/shm").join(name);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::invalid(format!("shared-memory name {name:?} contains NUL")))?;
        // SAFETY: valid C string.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR) };
        if fd < 0 {
            return Err(os_err(format!("opening a peer's {}", path.display())));
        }
        Self::map(fd, path, bytes)
    }

    fn map(fd: libc::c_int, path: std::path::PathBuf, bytes: usize) -> Result<ShmSegment> {
        // SAFETY: mapping `bytes` of an open file we own; the fd is closed right after.
        let p = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                bytes.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            p
        };
        if p == libc::MAP_FAILED {
            return Err(os_err(format!("mapping {}", path.display())));
        }
        Ok(ShmSegment {
            ptr: p as *mut u8,
            bytes,
            path,
        })
    }

    /// Base address in this process.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Removes the name from `/dev/shm` (the mappings stay valid).
    pub fn unlink(&self) -> Result<()> {
        let c = std::ffi::CString::new(self.path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::Internal("shm path with NUL".into()))?;
        // SAFETY: valid C string.
        if unsafe { libc::unlink(c.as_ptr()) } != 0 {
            return Err(os_err(format!("unlinking {}", self.path.display())));
        }
        Ok(())
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        if unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.bytes.max(1)) } != 0 {
            tracing::warn!(target: "oxccl::init", "munmap {}: {}", self.path.display(), std::io::Error::last_os_error());
        }
    }
}
