//! The proxy thread (NCCL's `proxy.cc` with `transport/net.cc`'s `sendProxyProgress` and
//! `recvProxyProgress`): it moves the NET transport's FIFO steps between this process's memory
//! and the network, so the kernels keep using the same FIFO protocol as for P2P and SHM.
//!
//! **Send side.** The kernel's send connection points at a *staging FIFO* in local memory with the
//! layout of a receive FIFO (Simple slots + tail, LL lines) and at a local head counter. The proxy
//! watches it and sends each completed step to the peer's proxy, then returns the slot to the
//! kernel by advancing the head (the credit):
//! - a Simple step `s` is complete once the staging tail passes `s`; the whole slot is sent;
//! - an LL or LL128 step has no tail: its lines are forwarded as soon as a line carries the
//!   step's flag (both flag words for LL, the last word for LL128), prefix by prefix, and the step
//!   is complete once as many lines have gone as the kernel announced in the step's tagged
//!   step-sizes entry (`oxccl_gpu::abi::lines_step_size`, NCCL's LL `connFifo[].size`). The
//!   order in which lines become visible proves nothing: a GPU's stores to host memory may land
//!   out of order, so the next step's line 0 can show before this step's last line.
//!
//! A Simple step sends only the bytes the kernel filled: before its tail, the kernel stores them
//! in the connection's step sizes ([`FifoSpec::sizes`], NCCL's `connFifo[].size`); an empty step
//! (skipped by a slice's alignment, or past a slice's data) sends its header alone. Without step
//! sizes, a step sends its whole slot.
//!
//! **Receive side.** Each message is a 32-byte header (kind, step, lines) then its payload. The
//! proxy waits for the kernel's credit (`head + FIFO_STEPS > step`) before it takes the payload
//! into the real receive FIFO, so TCP's own flow control holds the sender back; then it publishes
//! the step: the tail for Simple, the lines themselves (flag words last) for LL and LL128.
//!
//! **Polling.** The thread spins, then yields, between rounds that moved nothing; it sleeps
//! (at most `IDLE_SLEEP`, 200 µs) only after 2048 such rounds and only while no connection has work in
//! flight (a message leaving, a payload arriving, a step waiting for a slot).
//!
//! **Threads and failures.** One proxy thread per device per process, fed by a crossbeam channel
//! ([`register`]); it progresses every connection of every communicator in turn and never blocks on
//! one. A lost peer (end of stream, reset, timeout) fails the communicator: the error is logged
//! (target `oxccl::proxy`) and kept ([`ProxyHandle::error`]), the communicator's abort flag is
//! raised so waiting kernels exit, and its other connections are closed so that their peers learn
//! of it too. A communicator whose abort flag is raised by its owner is closed the same way.
//! Unregistering (when the communicator is freed) first flushes staged steps and tells each peer
//! with a close message, so an orderly shutdown is never taken for a failure.
//!
//! | file | what | mirrors in NCCL |
//! |---|---|---|
//! | `proxy/mod.rs` | registration, the thread and its loop | `ncclProxyCreate`, `ncclProxyProgress` in `src/proxy.cc` |
//! | `proxy/progress.rs` | one round over a communicator's connections: messages, steps, credits, failures | `sendProxyProgress`, `recvProxyProgress` in `src/transport/net.cc` |
use crate::error::{Error, Result};
use crate::mem::Device;
use crate::transport::net::{Net, RecvComm, SendComm};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, bounded, unbounded};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod progress;

use progress::CommOps;

/// Abort-flag value the proxy raises: "another rank failed" (the value `Comm` reports as a remote
/// abort, see `comm/abort.rs`).
pub const ABORTED_BY_PEER: u32 = 2;
/// Byte offset in a rank's abort line of the `u32` naming who raised its flag (rank + 1): after
/// the flag (+0) and the call check's stop word (+4, `oxccl_gpu::abi::ABORT_LINE_STOP`), which
/// kernels poll together with the flag in one 8-byte load.
pub const ABORT_LINE_WHO: u64 = 8;
/// How long unregistering waits for staged steps and close messages to leave.
const FLUSH_WAIT: Duration = Duration::from_secs(5);

/// How often an idle communicator's send connections are checked for a vanished receiver
/// ([`Net::check_send`]).
const CHECK_SEND_EVERY: Duration = Duration::from_millis(100);

/// Longest sleep of an idle proxy (it wakes at once for (un)registrations).
const IDLE_SLEEP: Duration = Duration::from_micros(200);

/// `head` the counter the proxy advances (the kernel's credit). For a receive connection, they are
/// the real receive FIFO and tail the proxy fills, and `head` the counter the kernel advances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FifoSpec {
    /// Ring peer of this connection (for messages).
    pub peer: usize,
    /// Channel of this connection.
    pub channel: u32,
    /// Simple buffer: [`FIFO_STEPS`](oxccl_gpu::abi::FIFO_STEPS) slots of `slot_bytes` bytes.
    pub simple: u64,
    /// Bytes of one Simple slot (`NCCL_BUFFSIZE / FIFO_STEPS`, rounded down to 16 bytes).
    pub slot_bytes: u64,
    /// LL buffer: [`FIFO_STEPS`](oxccl_gpu::abi::FIFO_STEPS) slots of `step_lines` 16-byte lines; 0 when
    /// there is none.
    pub ll: u64,
    /// Lines of one LL slot.
    pub step_lines: u64,
    /// LL128 buffer: [`FIFO_STEPS`](oxccl_gpu::abi::FIFO_STEPS) slots of `ll128_lines` 128-byte lines; 0
    /// when there is none.
    pub ll128: u64,
    /// Lines of one LL128 slot.
    pub ll128_lines: u64,
    /// Address of the `u64` head counter.
    pub head: u64,
    /// Address of the `u64` tail counter.
    pub tail: u64,
    /// Send connections: address of the [`FIFO_STEPS`](oxccl_gpu::abi::FIFO_STEPS) `u64` step sizes the
    /// kernel writes (`ConnInfo::sizes`, NCCL's `connFifo[].size`), so a Simple step sends only
    /// the bytes it filled; 0: every Simple step sends its whole slot. Unused on receive
    /// connections.
    pub sizes: u64,
    /// The connection's first step (`OXCCL_TEST_INITIAL_STEP`, else 0).
    pub step: u64,
}

/// One communicator's NET connections, handed to the proxy by [`register`].
pub struct ProxyComm {
    /// This rank (for messages).
    pub rank: usize,
    /// Address of the communicator's `u32` abort flag.
    pub abort_flag: u64,
    /// Address of a `u32` where a raised flag names its cause as rank + 1 (`init_rank`'s shared
    /// abort line); 0 when there is none.
    pub abort_who: u64,
    /// The abort lines of the other ranks of this host (`init_rank`'s shared abort page: a `u32`
    /// flag at the address, a `u32` naming the raiser as rank + 1 [`ABORT_LINE_WHO`] bytes on). A
    /// failed connection raises them too, naming this rank: a host neighbour reached only by SHM
    /// would otherwise wait forever for a rank whose kernel has left (e.g. ring 0 -SHM-> 1 -NET-> 2
    /// on two hosts: when 2 dies, 1's proxy notices, and 0 must stop waiting for 1's credits).
    pub host_abort_lines: Vec<u64>,
    /// The network the connections belong to.
    pub net: Arc<dyn Net>,
    /// Send connections with their staging FIFOs.
    pub sends: Vec<(FifoSpec, SendComm)>,
    /// Receive connections with their receive FIFOs.
    pub recvs: Vec<(FifoSpec, RecvComm)>,
}

enum Msg {
    Add(u64, Box<ProxyComm>, Arc<Mutex<Option<String>>>),
    Remove(u64, Sender<()>),
}

/// A registration with a proxy thread: dropping it flushes and closes the communicator's
/// connections, and returns only once the proxy no longer touches its memory.
pub struct ProxyHandle {
    id: u64,
    tx: Sender<Msg>,
    error: Arc<Mutex<Option<String>>>,
}

impl ProxyHandle {
    /// The first failure the proxy met on this communicator's connections (NCCL's async error),
    /// as [`Error::Remote`]; `None` while all is well.
    pub fn error(&self) -> Option<Error> {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .map(Error::Remote)
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        let (ack_tx, ack_rx) = bounded(1);
        if self.tx.send(Msg::Remove(self.id, ack_tx)).is_ok() {
            // The proxy answers within FLUSH_WAIT plus one round; it never blocks. Waiting
            // without a bound is what keeps the proxy from touching freed memory.
            let _ = ack_rx.recv();
        }
    }
}

type Registry = Mutex<HashMap<Device, Sender<Msg>>>;

fn registry() -> &'static Registry {
    static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Hands `comm`'s connections to the proxy thread of `device` (started on first use: one per
/// device per process, NCCL's `ncclProxyCreate`).
///
/// # Safety
/// Every address in `comm` (FIFOs, counters, the abort flag, the host abort lines) stays valid until the returned
/// handle is dropped; no one but the proxy writes the receive FIFOs and tails, and the staging
/// FIFOs are written only by the kernel under the FIFO protocol.
///
/// Errors: `System` when the thread cannot be started.
pub unsafe fn register(device: Device, comm: ProxyComm) -> Result<ProxyHandle> {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let error = Arc::new(Mutex::new(None));
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    let mut msg = Msg::Add(id, Box::new(comm), error.clone());
    if let Some(tx) = reg.get(&device) {
        match tx.send(msg) {
            Ok(()) => {
                return Ok(ProxyHandle {
                    id,
                    tx: tx.clone(),
                    error,
                });
            }
            // The thread is gone (it never exits while registered; be safe anyway): restart.
            Err(e) => msg = e.into_inner(),
        }
    }
    let (tx, rx) = unbounded();
    let name = match device {
        Device::Cuda(o) => format!("oxccl-proxy-cuda{o}"),
        Device::Cpu(i) => format!("oxccl-proxy-cpu{i}"),
    };
    std::thread::Builder::new()
        .name(name)
        .spawn(move || run(rx))
        .map_err(|e| Error::System(format!("starting the proxy thread of {device:?}: {e}")))?;
    tx.send(msg)
        .map_err(|_| Error::Internal("the new proxy thread exited at once".into()))?;
    reg.insert(device, tx.clone());
    Ok(ProxyHandle { id, tx, error })
}

/// The proxy thread's loop (NCCL's `ncclProxyProgress`).
fn run(rx: Receiver<Msg>) {
    let mut comms: Vec<CommOps> = Vec::new();
    let mut idle = 0u32;
    loop {
        let msg = if comms.is_empty() {
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return,
            }
        } else if idle > 2048 {
            let wait = IDLE_SLEEP.min(Duration::from_micros(10 * (idle as u64 - 2048) + 10));
            match rx.recv_timeout(wait) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return,
            }
        };
        match msg {
            Some(Msg::Add(id, c, error)) => {
                comms.push(CommOps::new(id, *c, error));
                idle = 0;
            }
            Some(Msg::Remove(id, ack)) => {
                match comms.iter_mut().find(|c| c.id == id) {
                    Some(c) => c.closing = Some((Instant::now() + FLUSH_WAIT, ack, false)),
                    None => {
                        let _ = ack.send(());
                    }
                }
                idle = 0;
            }
            None => {}
        }
        let mut progressed = false;
        let mut busy = false;
        for c in &mut comms {
            progressed |= c.progress();
            busy |= c.busy();
        }
        comms.retain_mut(|c| !c.finish_if_closed());
        if progressed {
            idle = 0;
        } else if busy {
            // Work in flight (messages leaving, payloads arriving or waiting for a slot): keep
            // polling, yielding the core between rounds, but never sleep.
            idle = idle.saturating_add(1).min(2048);
            if idle < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        } else {
            idle = idle.saturating_add(1);
            if idle < 64 {
                std::hint::spin_loop();
            } else if idle <= 2048 {
                std::thread::yield_now();
            }
        }
    }
}

