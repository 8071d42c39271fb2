//! The bootstrap root (NCCL's `bootstrapRoot` / `bootstrapCreateRoot`): a thread that collects
//! every rank's listen address and tells each rank where its ring successor listens.
//!
//! Each rank connects, sends a [`Kind::Register`] message (secret, rank, nranks, its listen
//! address) and keeps the connection open; as soon as both a rank and its successor have
//! registered, the root answers that rank with a [`Kind::RootNext`] message carrying the
//! successor's address (NCCL answers as early, over a connection to a second listener of the
//! rank). Once every rank has its answer, the thread exits. A disagreement (ranks with different
//! nranks, a rank registered twice) fails the whole bootstrap: every waiting rank, and any that
//! registers later, gets a [`Kind::RootError`] answer naming the problem. Connections without the
//! id's secret, with junk or with an oversized length are dropped by the [`Server`] and logged.
//! The root gives up when no rank registers for `timeout`.
use super::MAX_NRANKS;
use super::socket::{
    ADDR_BYTES, CONTROL_MAX_BYTES, Event, Header, Incoming, Kind, Server, decode_addr, encode_addr,
    write_message,
};
use crate::error::{Error, Result, ResultCode};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Binds the root listener on `addr` (port 0 picks a free port) and starts the root thread.
/// Returns the address it listens on.
pub(crate) fn spawn(addr: SocketAddr, secret: u64, timeout: Duration) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| Error::System(format!("bootstrap: cannot listen for the root on {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::System(format!("bootstrap: root listener address: {e}")))?;
    let allowed = Box::new(|h: &Header| {
        if h.kind != Kind::Register {
            return Err(format!("unexpected message kind {:?} at the root", h.kind));
        }
        if h.len != ADDR_BYTES as u64 {
            return Err(format!("registration of {} bytes (expected {ADDR_BYTES})", h.len));
        }
        Ok(())
    });
    let server = Server::new(
        listener,
        secret,
        timeout,
        format!("bootstrap root {local}"),
        allowed,
    )?;
    // Near the GPU of the communicator being created, when its affinity is known.
    let near = crate::topo::detect::helper_affinity();
    std::thread::Builder::new()
        .name("oxccl-bs-root".into())
        .spawn(move || {
            crate::topo::detect::bind_helper_thread(near.as_ref());
            Root::new(secret, timeout, local).run(server)
        })
        .map_err(|e| Error::System(format!("bootstrap: cannot start the root thread: {e}")))?;
    tracing::info!(target: "oxccl::bootstrap", %local, "bootstrap root listening");
    Ok(local)
}

struct Slot {
    /// The rank's registration connection, until it is answered.
    stream: Option<TcpStream>,
    listen: SocketAddr,
}

struct Root {
    secret: u64,
    timeout: Duration,
    local: SocketAddr,
    nranks: usize,
    slots: Vec<Option<Slot>>,
    answered: usize,
    failed: Option<(ResultCode, String)>,
}

impl Root {
    fn new(secret: u64, timeout: Duration, local: SocketAddr) -> Root {
        Root {
            secret,
            timeout,
            local,
            nranks: 0,
            slots: Vec::new(),
            answered: 0,
            failed: None,
        }
    }

    fn run(mut self, mut server: Server) {
        let mut deadline = Instant::now() + self.timeout;
        loop {
            if self.nranks > 0 && self.answered == self.nranks {
                tracing::debug!(target: "oxccl::bootstrap", root = %self.local, nranks = self.nranks, "bootstrap root done");
                return;
            }
            if Instant::now() >= deadline {
                let got = self.slots.iter().filter(|s| s.is_some()).count();
                tracing::warn!(target: "oxccl::bootstrap", root = %self.local,
                    "bootstrap root: no rank registered for {:.1} s ({got} of {} registered); giving up",
                    self.timeout.as_secs_f64(), self.nranks);
                return;
            }
            match server.poll(deadline, None) {
                Ok(Event::Messages(msgs)) => {
                    for m in msgs {
                        deadline = Instant::now() + self.timeout;
                        self.register(m);
                    }
                }
                Ok(Event::Woken) => return,
                Err(e) => {
                    tracing::warn!(target: "oxccl::bootstrap", root = %self.local, "bootstrap root stops: {e}");
                    return;
                }
            }
        }
    }

    fn register(&mut self, m: Incoming) {
        let Incoming {
            header: h,
            payload,
            mut stream,
            peer,
        } = m;
        let (rank, nranks) = (h.rank as usize, h.nranks as usize);
        let Some(listen) = decode_addr(&payload) else {
            tracing::warn!(target: "oxccl::bootstrap", %peer, "bootstrap root: dropped a registration with a bad address");
            return;
        };
        if let Some((code, msg)) = &self.failed {
            self.reply_error(&mut stream, *code, msg);
            self.answered += 1;
            return;
        }
        if nranks == 0 || nranks > MAX_NRANKS || rank >= nranks {
            let msg = format!(
                "rank {rank} of nranks {nranks} is out of range (accepted: 0..{nranks}, nranks 1..={MAX_NRANKS})"
            );
            self.reply_error(&mut stream, ResultCode::InvalidArgument, &msg);
            return;
        }
        if self.nranks == 0 {
            self.nranks = nranks;
            self.slots = (0..nranks).map(|_| None).collect();
        }
        if nranks != self.nranks {
            let msg = format!(
                "nranks mismatch: rank {rank} (from {peer}) says nranks {nranks}, earlier ranks said {}",
                self.nranks
            );
            self.fail(ResultCode::InvalidUsage, msg, &mut stream);
            return;
        }
        if self.slots[rank].is_some() {
            let msg = format!("rank {rank} of {nranks} registered twice (second time from {peer})");
            self.fail(ResultCode::InvalidUsage, msg, &mut stream);
            return;
        }
        tracing::trace!(target: "oxccl::bootstrap", rank, nranks, %listen, "bootstrap root: registration");
        self.slots[rank] = Some(Slot {
            stream: Some(stream),
            listen,
        });
        let n = self.nranks;
        // Answer this rank if its successor is known, and its predecessor if it was waiting for us.
        for r in [rank, (rank + n - 1) % n] {
            let next = (r + 1) % n;
            let Some(next_addr) = self.slots[next].as_ref().map(|s| s.listen) else {
                continue;
            };
            let Some(stream) = self.slots[r].as_mut().and_then(|s| s.stream.take()) else {
                continue;
            };
            self.answer(r, next, next_addr, stream);
        }
    }

    fn answer(&mut self, rank: usize, next: usize, next_addr: SocketAddr, mut stream: TcpStream) {
        self.answered += 1;
        let h = Header {
            kind: Kind::RootNext,
            secret: self.secret,
            rank: next as u32,
            nranks: self.nranks as u32,
            tag: 0,
            len: ADDR_BYTES as u64,
        };
        let deadline = Instant::now() + self.timeout;
        if let Err(e) = write_message(
            &mut stream,
            &h,
            &encode_addr(&next_addr),
            deadline,
            &format!("root reply to rank {rank}"),
        ) {
            tracing::warn!(target: "oxccl::bootstrap", rank, "bootstrap root: {e}");
        }
    }

    fn reply_error(&self, stream: &mut TcpStream, code: ResultCode, msg: &str) {
        tracing::warn!(target: "oxccl::bootstrap", root = %self.local, "bootstrap root: {msg}");
        let text = msg.as_bytes();
        let text = &text[..text.len().min(CONTROL_MAX_BYTES as usize)];
        let h = Header {
            kind: Kind::RootError,
            secret: self.secret,
            rank: 0,
            nranks: self.nranks as u32,
            tag: code as i32 as u32,
            len: text.len() as u64,
        };
        let deadline = Instant::now() + Duration::from_secs(5).min(self.timeout);
        let _ = write_message(stream, &h, text, deadline, "root error reply");
    }

    /// Fails the whole bootstrap: answers `stream` and every waiting rank with the error.
    fn fail(&mut self, code: ResultCode, msg: String, stream: &mut TcpStream) {
        self.reply_error(stream, code, &msg);
        self.answered += 1;
        let mut waiting: Vec<TcpStream> = Vec::new();
        for s in self.slots.iter_mut().flatten() {
            if let Some(st) = s.stream.take() {
                waiting.push(st);
            }
        }
        for mut st in waiting {
            self.reply_error(&mut st, code, &msg);
            self.answered += 1;
        }
        self.failed = Some((code, msg));
    }
}
