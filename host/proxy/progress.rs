//! What the proxy thread does to one communicator's NET connections in a round (NCCL's
//! `sendProxyProgress` and `recvProxyProgress` in `src/transport/net.cc`): finding completed
//! steps and flag lines in the staging FIFOs and sending them with their headers, receiving
//! messages into the receive FIFOs once the kernel's credit allows, close messages, and failing
//! the communicator (abort flags raised) when a peer is lost. See the [module docs](super) for
//! the protocol.
use super::{ABORTED_BY_PEER, CHECK_SEND_EVERY, FifoSpec, ProxyComm};
use crate::transport::net::{Net, RecvComm, Request, SendComm};
use crossbeam_channel::Sender;
use oxccl_gpu::abi::FIFO_STEPS;
use oxccl_gpu::abi::lines_of_step_size;
use oxccl_gpu::proto::ll::ll_flag;

/// The flag of LL128 lines of step `step` (`proto/ll128.rs`'s `ll128_flag`).
const fn ll128_flag(step: u64) -> u64 {
    step.wrapping_add(1)
}
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Bytes of a message header.
const HDR_BYTES: usize = 32;
/// The failure of rank `rank`'s send connection `s` with error `e`: the message `fail` records
/// (naming the connection) and the peer it blames.
fn send_failure(rank: usize, s: &SendOp, e: impl std::fmt::Display) -> (String, usize) {
    (
        format!(
            "rank {rank}: NET send to rank {} (channel {}): {e}",
            s.spec.peer, s.spec.channel
        ),
        s.spec.peer,
    )
}

/// Message kinds on a NET connection.
const KIND_SIMPLE: u32 = 1;
const KIND_LL: u32 = 2;
const KIND_CLOSE: u32 = 3;
const KIND_LL128: u32 = 4;

/// The flag-line protocols, whose steps have no tail: each line carries its step's flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lines {
    /// 16-byte lines `{data1, flag1, data2, flag2}`, flag [`ll_flag`] (`proto/ll.rs`).
    Ll,
    /// 128-byte lines of 15 data words and a flag word `step + 1` (`proto/ll128.rs`).
    Ll128,
}

impl Lines {
    const ALL: [Lines; 2] = [Lines::Ll, Lines::Ll128];
    fn line_bytes(self) -> u64 {
        match self {
            Lines::Ll => 16,
            Lines::Ll128 => 128,
        }
    }
    fn kind(self) -> u32 {
        match self {
            Lines::Ll => KIND_LL,
            Lines::Ll128 => KIND_LL128,
        }
    }
    fn of_kind(kind: u32) -> Option<Lines> {
        match kind {
            KIND_LL => Some(Lines::Ll),
            KIND_LL128 => Some(Lines::Ll128),
            _ => None,
        }
    }
    /// (buffer address, lines per slot) of this protocol in `spec`; address 0: no buffer.
    fn buffer(self, spec: &FifoSpec) -> (u64, u64) {
        match self {
            Lines::Ll => (spec.ll, spec.step_lines),
            Lines::Ll128 => (spec.ll128, spec.ll128_lines),
        }
    }
    /// Address of line `line` of `step`'s slot.
    fn line_addr(self, spec: &FifoSpec, step: u64, line: u64) -> u64 {
        let (base, lines) = self.buffer(spec);
        base + ((step % FIFO_STEPS) * lines + line) * self.line_bytes()
    }
}

/// Where one end of a NET connection lives in this process. Addresses are host addresses (the CPU
/// target) of memory that stays valid until the communicator is unregistered.
///
/// For a send connection, `simple`, `ll` and `tail` are the staging FIFO the kernel writes and
/// Reads a `u64` counter.
///
/// # Safety
/// `addr` is a valid, 8-byte aligned counter ([`register`](super::register)'s contract).
unsafe fn load(addr: u64) -> u64 {
    // SAFETY: caller's contract; counters are only accessed atomically while shared.
    unsafe { AtomicU64::from_ptr(addr as *mut u64).load(Ordering::Acquire) }
}

/// Publishes a `u64` counter.
///
/// # Safety
/// As [`load`].
unsafe fn store(addr: u64, v: u64) {
    // SAFETY: caller's contract.
    unsafe { AtomicU64::from_ptr(addr as *mut u64).store(v, Ordering::Release) }
}

/// Whether line `line` of `step`'s slot of protocol `p` carries the step's flag.
///
/// # Safety
/// `p`'s buffer in `spec` is valid (non-zero) and `line` is below its lines per slot.
unsafe fn line_ready(spec: &FifoSpec, p: Lines, step: u64, line: u64) -> bool {
    let at = p.line_addr(spec, step, line);
    match p {
        Lines::Ll => {
            let flag = ll_flag(step) as u64;
            // SAFETY: inside the buffer (caller); lines are written as two release stores, low
            // then high half, so loading the high half first makes a matching low half the same
            // write's.
            let (hi, lo) = unsafe { (load(at + 8), load(at)) };
            hi >> 32 == flag && lo >> 32 == flag
        }
        // SAFETY: as above; the flag word is stored (release) after the data words.
        Lines::Ll128 => (unsafe { load(at + 120) }) == ll128_flag(step),
    }
}

/// The flag-line protocol whose line 0 of `step` carries the step's flag, if any.
fn step_lines_proto(spec: &FifoSpec, step: u64) -> Option<Lines> {
    Lines::ALL.into_iter().find(|&p| {
        let (base, lines) = p.buffer(spec);
        // SAFETY: the buffer exists and has at least one line ([`register`]'s contract).
        base != 0 && lines > 0 && unsafe { line_ready(spec, p, step, 0) }
    })
}

/// A message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hdr {
    kind: u32,
    nlines: u32,
    step: u64,
    first_line: u64,
    bytes: u64,
}

impl Hdr {
    fn encode(&self) -> Box<[u8; HDR_BYTES]> {
        let mut b = Box::new([0u8; HDR_BYTES]);
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.nlines.to_le_bytes());
        b[8..16].copy_from_slice(&self.step.to_le_bytes());
        b[16..24].copy_from_slice(&self.first_line.to_le_bytes());
        b[24..32].copy_from_slice(&self.bytes.to_le_bytes());
        b
    }
    fn decode(b: &[u8; HDR_BYTES]) -> Hdr {
        let w = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap_or([0; 8]));
        Hdr {
            kind: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            nlines: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            step: w(8..16),
            first_line: w(16..24),
            bytes: w(24..32),
        }
    }
}

/// One queued outgoing message (header, then payload), or a bare credit.
struct Out {
    hdr: Option<Box<[u8; HDR_BYTES]>>,
    /// Payload address and bytes (0 bytes: none).
    payload: (u64, u64),
    reqs: [Option<Request>; 2],
    /// Requests still to post (header, payload).
    to_post: u8,
    /// Head value to publish once this message has left.
    credit: Option<u64>,
}

struct SendOp {
    spec: FifoSpec,
    comm: Option<SendComm>,
    /// Next step to forward.
    cur: u64,
    /// Lines of `cur` already queued (LL, LL128).
    lines_done: u64,
    /// The flag-line protocol of `cur`, once its line 0 was seen.
    cur_lines: Option<Lines>,
    out: VecDeque<Out>,
}

struct RecvOp {
    spec: FifoSpec,
    comm: Option<RecvComm>,
    hdr: Box<[u8; HDR_BYTES]>,
    state: RState,
    bounce: Vec<u8>,
    /// Lowest step a message may still be about.
    next_step: u64,
    /// The peer sent its close message.
    closed: bool,
}

enum RState {
    Idle,
    Header(Request),
    Credit(Hdr),
    Payload(Hdr, Request),
}

impl SendOp {
    /// Finds newly completed steps and flag lines in the staging FIFO and queues them.
    fn discover(&mut self) -> bool {
        let s = self.spec;
        let mut found = false;
        for _ in 0..2 * FIFO_STEPS {
            // SAFETY: the spec's addresses are valid ([`register`]).
            let tail = unsafe { load(s.tail) };
            let cur = self.cur;
            if let Some(p) = self.cur_lines.or_else(|| step_lines_proto(&s, cur)) {
                self.cur_lines = Some(p);
                // How many lines the step has: the kernel's tagged entry in the step sizes. The
                // order in which its lines (and the next step's) become visible says nothing:
                // a GPU's stores to host memory may land in any order. Without step sizes (a
                // host-written FIFO, in order), the kernel moving on ends the step; read before
                // scanning, so lines written before it moved on are then seen.
                let (announced, moved_on) = if s.sizes == 0 {
                    (None, tail > cur || step_lines_proto(&s, cur + 1).is_some())
                } else {
                    // SAFETY: the sizes array holds FIFO_STEPS entries ([`register`]).
                    let v = unsafe { load(s.sizes + 8 * (cur % FIFO_STEPS)) };
                    (lines_of_step_size(v, cur), false)
                };
                let lines = announced.map_or(p.buffer(&s).1, |k| k.min(p.buffer(&s).1));
                let mut n = self.lines_done;
                // SAFETY: `n` stays below the slot's lines.
                while n < lines && unsafe { line_ready(&s, p, cur, n) } {
                    n += 1;
                }
                if n > self.lines_done {
                    let first = self.lines_done;
                    let bytes = (n - first) * p.line_bytes();
                    self.out.push_back(Out::new(
                        Hdr {
                            kind: p.kind(),
                            nlines: (n - first) as u32,
                            step: cur,
                            first_line: first,
                            bytes,
                        },
                        (p.line_addr(&s, cur, first), bytes),
                        None,
                    ));
                    self.lines_done = n;
                    found = true;
                }
                if !(moved_on || announced.is_some_and(|k| self.lines_done >= k)) {
                    break;
                }
                // Every line of `cur` has been queued: the slot can go back once they have left.
                self.out.push_back(Out::credit(cur + 1));
                self.cur += 1;
                self.lines_done = 0;
                self.cur_lines = None;
                found = true;
            } else if tail > cur {
                let bytes = if s.sizes == 0 {
                    s.slot_bytes
                } else {
                    // SAFETY: the sizes array holds FIFO_STEPS entries ([`register`]); the kernel
                    // stored this step's entry before the tail (loaded above with acquire).
                    unsafe { load(s.sizes + 8 * (cur % FIFO_STEPS)) }.min(s.slot_bytes)
                };
                self.out.push_back(Out::new(
                    Hdr {
                        kind: KIND_SIMPLE,
                        nlines: 0,
                        step: cur,
                        first_line: 0,
                        bytes,
                    },
                    (s.simple + (cur % FIFO_STEPS) * s.slot_bytes, bytes),
                    Some(cur + 1),
                ));
                self.cur += 1;
                found = true;
            } else {
                break;
            }
        }
        found
    }

    /// Posts queued messages and retires finished ones in order; publishes credits.
    fn progress(&mut self, net: &dyn Net) -> std::result::Result<bool, String> {
        let mut did = self.discover();
        let Some(comm) = self.comm.as_mut() else {
            return Ok(did);
        };
        for o in self.out.iter_mut() {
            if !o.post(net, comm)? {
                break;
            }
        }
        while let Some(o) = self.out.front_mut() {
            if o.to_post > 0 || !o.test(net)? {
                break;
            }
            if let Some(c) = o.credit {
                // SAFETY: the head counter is valid ([`register`]).
                unsafe { store(self.spec.head, c) };
            }
            self.out.pop_front();
            did = true;
        }
        Ok(did)
    }
}

impl Out {
    fn new(h: Hdr, payload: (u64, u64), credit: Option<u64>) -> Out {
        Out {
            hdr: Some(h.encode()),
            payload,
            reqs: [None, None],
            to_post: if payload.1 > 0 { 2 } else { 1 },
            credit,
        }
    }
    fn credit(c: u64) -> Out {
        Out {
            hdr: None,
            payload: (0, 0),
            reqs: [None, None],
            to_post: 0,
            credit: Some(c),
        }
    }
    /// Posts what is left to post; `Ok(true)` once everything is posted.
    fn post(&mut self, net: &dyn Net, comm: &mut SendComm) -> std::result::Result<bool, String> {
        while self.to_post > 0 {
            let total = if self.payload.1 > 0 { 2 } else { 1 };
            let k = total - self.to_post as usize;
            let (ptr, len) = match (k, &self.hdr) {
                (0, Some(h)) => (h.as_ptr(), HDR_BYTES),
                _ => (self.payload.0 as *const u8, self.payload.1 as usize),
            };
            // SAFETY: the header is boxed and lives in `self` until the request is done; the
            // payload is a staging slot (or lines) the kernel does not touch before the credit
            // this message carries (or a later one) is published.
            match unsafe { net.isend(comm, ptr, len, 0) } {
                Ok(Some(r)) => {
                    self.reqs[k] = Some(r);
                    self.to_post -= 1;
                }
                Ok(None) => return Ok(false),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(true)
    }
    /// Whether every request of this message has finished.
    fn test(&mut self, net: &dyn Net) -> std::result::Result<bool, String> {
        for slot in &mut self.reqs {
            if let Some(r) = slot {
                match net.test(r) {
                    Ok(Some(_)) => *slot = None,
                    Ok(None) => return Ok(false),
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
        Ok(true)
    }
}

impl RecvOp {
    fn progress(&mut self, net: &dyn Net) -> std::result::Result<bool, String> {
        let s = self.spec;
        let mut did = false;
        loop {
            if self.closed {
                return Ok(did);
            }
            let Some(comm) = self.comm.as_mut() else {
                return Ok(did);
            };
            match std::mem::replace(&mut self.state, RState::Idle) {
                RState::Idle => {
                    // SAFETY: the header buffer is boxed in `self` and outlives the request.
                    match unsafe { net.irecv(comm, self.hdr.as_mut_ptr(), HDR_BYTES, 0) } {
                        Ok(Some(r)) => self.state = RState::Header(r),
                        Ok(None) => return Ok(did),
                        Err(e) => return Err(e.to_string()),
                    }
                }
                RState::Header(mut r) => match net.test(&mut r).map_err(|e| e.to_string())? {
                    None => {
                        self.state = RState::Header(r);
                        return Ok(did);
                    }
                    Some(n) => {
                        did = true;
                        let h = Hdr::decode(&self.hdr);
                        if n != HDR_BYTES {
                            return Err(format!(
                                "rank {}: a {n}-byte message arrived for a header",
                                s.peer
                            ));
                        }
                        if h.kind == KIND_CLOSE {
                            self.closed = true;
                            return Ok(did);
                        }
                        self.check(&h)?;
                        self.state = RState::Credit(h);
                    }
                },
                RState::Credit(h) => {
                    // SAFETY: the head counter is valid ([`register`]).
                    if unsafe { load(s.head) } + FIFO_STEPS <= h.step {
                        self.state = RState::Credit(h);
                        return Ok(did);
                    }
                    if h.kind == KIND_SIMPLE && h.bytes == 0 {
                        // An empty step (skipped or past the slice's data) has no payload.
                        did = true;
                        // SAFETY: the tail counter is valid ([`register`]).
                        unsafe { store(s.tail, h.step + 1) };
                        self.next_step = h.step + 1;
                        continue;
                    }
                    let dst = if h.kind == KIND_SIMPLE {
                        (s.simple + (h.step % FIFO_STEPS) * s.slot_bytes) as *mut u8
                    } else {
                        self.bounce.as_mut_ptr()
                    };
                    // SAFETY: the kernel has freed this slot (credit checked above) and reads it
                    // only after the tail moves; the bounce buffer is ours. Both outlive the
                    // request.
                    match unsafe { net.irecv(comm, dst, h.bytes as usize, 0) } {
                        Ok(Some(r)) => self.state = RState::Payload(h, r),
                        Ok(None) => {
                            self.state = RState::Credit(h);
                            return Ok(did);
                        }
                        Err(e) => return Err(e.to_string()),
                    }
                }
                RState::Payload(h, mut r) => match net.test(&mut r).map_err(|e| e.to_string())? {
                    None => {
                        self.state = RState::Payload(h, r);
                        return Ok(did);
                    }
                    Some(n) => {
                        did = true;
                        if n as u64 != h.bytes {
                            return Err(format!(
                                "rank {}: step {}: {n} bytes arrived, the header announced {}",
                                s.peer, h.step, h.bytes
                            ));
                        }
                        match Lines::of_kind(h.kind) {
                            None => {
                                // SAFETY: the tail counter is valid ([`register`]).
                                unsafe { store(s.tail, h.step + 1) };
                                self.next_step = h.step + 1;
                            }
                            Some(p) => {
                                self.publish_lines(&h, p);
                                self.next_step = h.step;
                            }
                        }
                    }
                },
            }
        }
    }

    /// Refuses a header that does not fit this connection.
    fn check(&self, h: &Hdr) -> std::result::Result<(), String> {
        let s = &self.spec;
        let ok = h.step >= self.next_step
            && match (h.kind, Lines::of_kind(h.kind)) {
                (KIND_SIMPLE, _) => h.bytes <= s.slot_bytes,
                (_, Some(p)) => {
                    let (base, lines) = p.buffer(s);
                    base != 0
                        && h.nlines > 0
                        && h.first_line + h.nlines as u64 <= lines
                        && h.bytes == h.nlines as u64 * p.line_bytes()
                }
                _ => false,
            };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "rank {}: malformed message on channel {} ({h:?}, next step {}, slot {} bytes, {} LL lines, {} LL128 lines)",
                s.peer, s.channel, self.next_step, s.slot_bytes, s.step_lines, s.ll128_lines
            ))
        }
    }

    /// Writes received lines into their slot as the kernel's line stores do: LL lines as low
    /// half (data1, flag1) then high half (data2, flag2), both release; LL128 lines as the 15 data
    /// words, then the flag word with release.
    fn publish_lines(&self, h: &Hdr, p: Lines) {
        let s = &self.spec;
        let lb = p.line_bytes() as usize;
        for (i, line) in self.bounce[..h.bytes as usize].chunks_exact(lb).enumerate() {
            let at = p.line_addr(s, h.step, h.first_line + i as u64);
            let word = |k: usize| u64::from_ne_bytes(line[8 * k..8 * k + 8].try_into().unwrap_or([0; 8]));
            // SAFETY: inside the slot (checked in `check`); the kernel freed it (credit checked)
            // and reads a line's data only after its flag, which is stored last.
            unsafe {
                match p {
                    Lines::Ll => {
                        store(at, word(0));
                        store(at + 8, word(1));
                    }
                    Lines::Ll128 => {
                        std::ptr::copy_nonoverlapping(line.as_ptr(), at as *mut u8, 120);
                        store(at + 120, word(15));
                    }
                }
            }
        }
    }
}

/// One registered communicator in the proxy.
pub(super) struct CommOps {
    pub(super) id: u64,
    rank: usize,
    abort_flag: u64,
    abort_who: u64,
    host_abort_lines: Vec<u64>,
    net: Arc<dyn Net>,
    sends: Vec<SendOp>,
    recvs: Vec<RecvOp>,
    error: Arc<Mutex<Option<String>>>,
    /// Connections are closed (failure or abort): nothing is progressed any more.
    failed: bool,
    /// Unregistering: (deadline, ack, close messages queued).
    pub(super) closing: Option<(Instant, Sender<()>, bool)>,
    /// When idle send connections were last asked whether their receiver is still there.
    last_check: Instant,
}

impl CommOps {
    pub(super) fn new(id: u64, c: ProxyComm, error: Arc<Mutex<Option<String>>>) -> CommOps {
        let sends = c
            .sends
            .into_iter()
            .map(|(spec, comm)| SendOp {
                spec,
                comm: Some(comm),
                cur: spec.step,
                lines_done: 0,
                cur_lines: None,
                out: VecDeque::new(),
            })
            .collect();
        let recvs = c
            .recvs
            .into_iter()
            .map(|(spec, comm)| RecvOp {
                spec,
                comm: Some(comm),
                hdr: Box::new([0; HDR_BYTES]),
                state: RState::Idle,
                bounce: vec![0; (spec.step_lines * 16).max(spec.ll128_lines * 128) as usize],
                next_step: spec.step,
                closed: false,
            })
            .collect();
        tracing::debug!(target: "oxccl::proxy", rank = c.rank, net = c.net.name(), "communicator registered");
        CommOps {
            id,
            rank: c.rank,
            abort_flag: c.abort_flag,
            abort_who: c.abort_who,
            host_abort_lines: c.host_abort_lines,
            net: c.net,
            sends,
            recvs,
            error,
            failed: false,
            closing: None,
            last_check: Instant::now(),
        }
    }

    fn abort_flag(&self) -> &AtomicU32 {
        // SAFETY: the flag stays valid while registered ([`register`]); accessed atomically.
        unsafe { AtomicU32::from_ptr(self.abort_flag as *mut u32) }
    }

    /// Closes every connection (peers see the stream end without a close message).
    fn close_all(&mut self) {
        for s in &mut self.sends {
            s.out.clear();
            if let Some(c) = s.comm.take()
                && let Err(e) = self.net.close_send(c)
            {
                tracing::debug!(target: "oxccl::proxy", rank = self.rank, "close: {e}");
            }
        }
        for r in &mut self.recvs {
            r.state = RState::Idle;
            if let Some(c) = r.comm.take()
                && let Err(e) = self.net.close_recv(c)
            {
                tracing::debug!(target: "oxccl::proxy", rank = self.rank, "close: {e}");
            }
        }
        self.failed = true;
    }

    /// The connection with `peer` failed: record, raise the abort flag (naming `peer` as the
    /// cause) so kernels exit, close everything.
    fn fail(&mut self, what: String, peer: usize) {
        if self.closing.is_some() {
            tracing::debug!(target: "oxccl::proxy", rank = self.rank, "while closing: {what}");
        } else {
            tracing::error!(target: "oxccl::proxy", rank = self.rank, "{what}; aborting the communicator");
            self.error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(what);
            if self.abort_who != 0 {
                // SAFETY: valid while registered ([`register`]); accessed atomically.
                let who = unsafe { AtomicU32::from_ptr(self.abort_who as *mut u32) };
                let _ = who.compare_exchange(0, peer as u32 + 1, Ordering::AcqRel, Ordering::Acquire);
            }
            let _ =
                self.abort_flag()
                    .compare_exchange(0, ABORTED_BY_PEER, Ordering::AcqRel, Ordering::Acquire);
            for &line in &self.host_abort_lines {
                // SAFETY: the shared abort page outlives the registration (`register`'s contract
                // covers the whole page); its lines are only accessed atomically.
                unsafe {
                    let _ = AtomicU32::from_ptr((line + super::ABORT_LINE_WHO) as *mut u32).compare_exchange(
                        0,
                        self.rank as u32 + 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                    let _ = AtomicU32::from_ptr(line as *mut u32).compare_exchange(
                        0,
                        ABORTED_BY_PEER,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
            }
        }
        self.close_all();
    }

    /// Whether a connection has work in flight: queued outgoing messages, or a received header
    /// whose payload is awaited or waits for the kernel's credit.
    pub(super) fn busy(&self) -> bool {
        !self.failed
            && (self.sends.iter().any(|s| !s.out.is_empty())
                || self
                    .recvs
                    .iter()
                    .any(|r| matches!(r.state, RState::Credit(_) | RState::Payload(..))))
    }

    /// One round over every connection; whether anything moved.
    pub(super) fn progress(&mut self) -> bool {
        if self.failed {
            return false;
        }
        if self.closing.is_none() && self.abort_flag().load(Ordering::Acquire) != 0 {
            tracing::debug!(target: "oxccl::proxy", rank = self.rank, "abort flag raised: closing the connections");
            self.close_all();
            return true;
        }
        let mut did = false;
        let net = self.net.clone();
        let mut failure = None;
        for s in &mut self.sends {
            match s.progress(net.as_ref()) {
                Ok(d) => did |= d,
                Err(e) => {
                    failure = Some(send_failure(self.rank, s, e));
                    break;
                }
            }
        }
        // Receives go on while unregistering, to read the senders' close messages (an orderly
        // close of a receive end is only made after the sender's, see `finish_if_closed`).
        if failure.is_none() {
            for r in &mut self.recvs {
                match r.progress(net.as_ref()) {
                    Ok(d) => did |= d,
                    Err(e) => {
                        failure = Some((
                            format!(
                                "rank {}: NET receive from rank {} (channel {}): {e}",
                                self.rank, r.spec.peer, r.spec.channel
                            ),
                            r.spec.peer,
                        ));
                        break;
                    }
                }
            }
        }
        // A rank that only sends to a peer learns of its death at its next send, which may
        // never come (its kernel waits on another neighbour): idle send connections are asked
        // every CHECK_SEND_EVERY whether their receiver is still there.
        if failure.is_none()
            && !did
            && self.closing.is_none()
            && self.last_check.elapsed() >= CHECK_SEND_EVERY
        {
            self.last_check = Instant::now();
            for s in &mut self.sends {
                if !s.out.is_empty() {
                    continue;
                }
                let Some(comm) = s.comm.as_mut() else { continue };
                if let Err(e) = net.check_send(comm) {
                    failure = Some(send_failure(self.rank, s, e));
                    break;
                }
            }
        }
        if let Some((f, peer)) = failure {
            self.fail(f, peer);
            return true;
        }
        did
    }

    /// While unregistering: queues close messages once everything staged has left; returns
    /// `true` (and acknowledges) once the communicator can go.
    pub(super) fn finish_if_closed(&mut self) -> bool {
        let Some((deadline, _, queued)) = &mut self.closing else {
            return false;
        };
        let drained = self.sends.iter().all(|s| s.out.is_empty());
        // A receive end closes only once its sender said it closes too: a sender sees the end
        // of its connection as its peer's death (`Net::check_send`), so closing first would
        // fail a peer that is merely slower to destroy.
        let senders_closed = self.recvs.iter().all(|r| r.closed || r.comm.is_none());
        let done = self.failed || (drained && *queued && senders_closed) || Instant::now() > *deadline;
        if !done && drained && !*queued {
            *queued = true;
            for s in &mut self.sends {
                s.out.push_back(Out::new(
                    Hdr {
                        kind: KIND_CLOSE,
                        nlines: 0,
                        step: s.cur,
                        first_line: 0,
                        bytes: 0,
                    },
                    (0, 0),
                    None,
                ));
            }
            return false;
        }
        if !done {
            return false;
        }
        if !self.failed {
            self.close_all();
        }
        if let Some((_, ack, _)) = self.closing.take() {
            let _ = ack.send(());
        }
        tracing::debug!(target: "oxccl::proxy", rank = self.rank, "communicator unregistered");
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use crate::mem::Device;
    use crate::proxy::{ProxyHandle, register};
    use std::time::Duration;

    #[test]
    fn headers_round_trip() {
        let h = Hdr {
            kind: KIND_LL,
            nlines: 7,
            step: (1 << 40) + 3,
            first_line: 9,
            bytes: 112,
        };
        assert_eq!(Hdr::decode(&h.encode()), h);
    }

    use crate::transport::net::{ListenComm, NetHandle, NetProperties};
    use crate::transport::net_socket::NetSocket;
    use std::net::{IpAddr, Ipv4Addr};

    /// The socket network, counting the sends posted and their bytes.
    struct Counting {
        inner: NetSocket,
        sends: AtomicU64,
        bytes: AtomicU64,
    }

    impl Net for Counting {
        fn name(&self) -> &str {
            self.inner.name()
        }
        fn devices(&self) -> Result<usize> {
            self.inner.devices()
        }
        fn properties(&self, dev: usize) -> Result<NetProperties> {
            self.inner.properties(dev)
        }
        fn listen(&self, dev: usize) -> Result<(NetHandle, ListenComm)> {
            self.inner.listen(dev)
        }
        fn connect(&self, dev: usize, h: &NetHandle) -> Result<Option<SendComm>> {
            self.inner.connect(dev, h)
        }
        fn accept(&self, l: &mut ListenComm) -> Result<Option<RecvComm>> {
            self.inner.accept(l)
        }
        unsafe fn isend(&self, c: &mut SendComm, d: *const u8, n: usize, t: u32) -> Result<Option<Request>> {
            // SAFETY: forwarded with the caller's contract.
            let r = unsafe { self.inner.isend(c, d, n, t) }?;
            if r.is_some() {
                self.sends.fetch_add(1, Ordering::Relaxed);
                self.bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(r)
        }
        unsafe fn irecv(&self, c: &mut RecvComm, d: *mut u8, n: usize, t: u32) -> Result<Option<Request>> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.irecv(c, d, n, t) }
        }
        fn test(&self, r: &mut Request) -> Result<Option<usize>> {
            self.inner.test(r)
        }
        fn close_send(&self, c: SendComm) -> Result<()> {
            self.inner.close_send(c)
        }
        fn close_recv(&self, c: RecvComm) -> Result<()> {
            self.inner.close_recv(c)
        }
        fn close_listen(&self, l: ListenComm) -> Result<()> {
            self.inner.close_listen(l)
        }
    }

    /// Spins (yielding) until `ok()`, at most 60 s.
    fn wait_for(what: &str, ok: impl Fn() -> bool) {
        let t = Instant::now();
        while !ok() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}"
            );
            std::thread::yield_now();
        }
    }

    /// Byte `i` of step `step`'s data.
    fn pattern(step: u64, i: usize) -> u8 {
        ((i as u64 * 131 + step * 7) % 251) as u8
    }

    /// Two proxies (CPU devices `devs`) joined by one loopback socket connection: a sender
    /// whose staging FIFO and a receiver whose FIFO lie in blocks of their own — `fifo_bytes`,
    /// then the counters: head at +0, tail at +128, the 8 step sizes at +192, the abort flag at
    /// +320 — laid out by `spec(base, counters)`. Fields drop in order: the proxies before the
    /// memory they use.
    struct Pair {
        net: Arc<Counting>,
        ss: FifoSpec,
        rs: FifoSpec,
        hs: ProxyHandle,
        hr: ProxyHandle,
        _mem: [Vec<u64>; 2],
    }

    /// A spec of peer 1, channel 0 with no FIFO yet and [`Pair`]'s counters at `base + ctr`.
    fn counters_only(base: u64, ctr: u64) -> FifoSpec {
        FifoSpec {
            peer: 1,
            channel: 0,
            simple: 0,
            slot_bytes: 0,
            ll: 0,
            step_lines: 0,
            ll128: 0,
            ll128_lines: 0,
            head: base + ctr,
            tail: base + ctr + 128,
            sizes: base + ctr + 192,
            step: 0,
        }
    }

    impl Pair {
        fn new(fifo_bytes: u64, devs: (usize, usize), spec: impl Fn(u64, u64) -> FifoSpec) -> Pair {
            let net = Arc::new(Counting {
                inner: NetSocket::new("lo", IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
                sends: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
            });
            let (h, mut l) = net.listen(0).unwrap();
            let sc = net.connect(0, &h).unwrap().expect("connected");
            let t = Instant::now();
            let rc = loop {
                if let Some(r) = net.accept(&mut l).unwrap() {
                    break r;
                }
                assert!(t.elapsed() < Duration::from_secs(10), "accept");
            };
            let words = (fifo_bytes / 8 + 48) as usize;
            let mut mem = [vec![0u64; words], vec![0u64; words]];
            let (sb, rb) = (mem[0].as_mut_ptr() as u64, mem[1].as_mut_ptr() as u64);
            let (ss, rs) = (spec(sb, fifo_bytes), spec(rb, fifo_bytes));
            let comm = |base: u64, sends, recvs| ProxyComm {
                rank: 0,
                abort_flag: base + fifo_bytes + 320,
                abort_who: 0,
                host_abort_lines: Vec::new(),
                net: net.clone(),
                sends,
                recvs,
            };
            // SAFETY: both blocks live in the returned `Pair`, which drops the handles first;
            // only the proxies and the test's two "kernels" touch them, under the FIFO protocol.
            let (hs, hr) = unsafe {
                (
                    register(Device::Cpu(devs.0), comm(sb, vec![(ss, sc)], vec![])).unwrap(),
                    register(Device::Cpu(devs.1), comm(rb, vec![], vec![(rs, rc)])).unwrap(),
                )
            };
            Pair {
                net,
                ss,
                rs,
                hs,
                hr,
                _mem: mem,
            }
        }

        /// Checks that neither proxy failed, unregisters both (flushing the close messages) and
        /// returns the network's counters.
        fn finish(self) -> Arc<Counting> {
            assert!(self.hs.error().is_none(), "{:?}", self.hs.error());
            assert!(self.hr.error().is_none(), "{:?}", self.hr.error());
            let net = self.net.clone();
            drop(self);
            net
        }
    }

    /// A Simple step sends only the bytes the kernel filled (its `ConnInfo::sizes` entry), not
    /// its whole slot: over steps of every size (none, a few bytes, half a slot, a whole slot)
    /// the bytes posted to the network are exactly the filled bytes, and every byte arrives.
    /// (Sending whole slots made a 16 MiB GPU AllReduce over 64 channels move 256 MiB per rank,
    /// 32 KiB slices in 512 KiB slots.) Counting posted bytes, not timing, keeps the check
    /// independent of how loaded the machine is.
    #[test]
    fn simple_steps_send_only_their_filled_bytes() {
        let slot = 64u64 << 10;
        let nsteps = 40u64;
        // Bytes of step s, in turn: none (a step the kernel's slice alignment skipped, or past
        // a slice's data), 16·(s+1), half a slot + 16·s, the whole slot.
        let len = move |s: u64| match s % 4 {
            0 => 0,
            1 => 16 * (s + 1),
            2 => slot / 2 + 16 * s,
            _ => slot,
        };
        // Each end: a Simple FIFO of 8 slots, then the counters.
        let pair = Pair::new(FIFO_STEPS * slot, (9001, 9002), |base, ctr| FifoSpec {
            simple: base,
            slot_bytes: slot,
            ..counters_only(base, ctr)
        });
        let (ss, rs) = (pair.ss, pair.rs);
        // The receiving kernel: wait for each step's tail, check its bytes, free the slot.
        let receiver = std::thread::spawn(move || {
            for s in 0..nsteps {
                // SAFETY: the receive block is valid until the handles are dropped, after join.
                wait_for("a step", || unsafe { load(rs.tail) } > s);
                let at = rs.simple + (s % FIFO_STEPS) * slot;
                // SAFETY: as above; the proxy filled this slot before publishing the tail.
                let got = unsafe { std::slice::from_raw_parts(at as *const u8, len(s) as usize) };
                if let Some(i) = (0..got.len()).find(|&i| got[i] != pattern(s, i)) {
                    return Err(format!(
                        "step {s}: byte {i} is {} (want {})",
                        got[i],
                        pattern(s, i)
                    ));
                }
                // SAFETY: as above.
                unsafe { store(rs.head, s + 1) };
            }
            Ok(())
        });
        // The sending kernel: wait for a free slot, fill `len(s)` bytes, publish size then tail.
        for s in 0..nsteps {
            // SAFETY: the send block is valid until the handles are dropped.
            wait_for("a credit", || unsafe { load(ss.head) } + FIFO_STEPS > s);
            let at = ss.simple + (s % FIFO_STEPS) * slot;
            // SAFETY: as above; the proxy returned this slot (credit checked).
            let dst = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, slot as usize) };
            for (i, b) in dst.iter_mut().enumerate() {
                *b = pattern(s, i);
            }
            // SAFETY: as above.
            unsafe {
                store(ss.sizes + 8 * (s % FIFO_STEPS), len(s));
                store(ss.tail, s + 1);
            }
        }
        receiver.join().unwrap().unwrap();
        let net = pair.finish();
        // Filled: 10 empty steps; 16·(2+6+…+38) = 3200; 10·32768 + 16·(2+6+…+38) = 330880;
        // 10·65536 = 655360. Total 989440 bytes in 30 non-empty steps (whole slots: 2621440).
        let filled: u64 = (0..nsteps).map(len).sum();
        assert_eq!(filled, 989_440);
        // Posted: per step a 32-byte header, plus a payload for the 30 non-empty steps; then the
        // close message's header.
        assert_eq!(net.sends.load(Ordering::Relaxed), 40 + 30 + 1);
        assert_eq!(net.bytes.load(Ordering::Relaxed), 989_440 + 41 * HDR_BYTES as u64);
    }

    /// An LL step is sent whole even when the host sees the next step's line 0 before this
    /// step's last line (a GPU's stores to host memory land in any order; on 2×H200 the
    /// NET-only matrix hung at 4 MiB under LL when the proxy took "line 0 of step s + 1 is
    /// there" for "step s is done" and gave the slot back without its last line). Each step
    /// here is written out of order: its announced line count, all lines but the last, the next
    /// step's line 0, a pause, then the last line. Every line must arrive with its data.
    #[test]
    fn ll_step_waits_for_its_announced_lines() {
        let step_lines = 16u64;
        let nsteps = 24u64;
        let nlines = move |s: u64| 3 + s % 13;
        // Each end: the LL lines of 8 slots, then the counters.
        let pair = Pair::new(FIFO_STEPS * step_lines * 16, (9003, 9004), |base, ctr| FifoSpec {
            ll: base,
            step_lines,
            ..counters_only(base, ctr)
        });
        let (ss, rs) = (pair.ss, pair.rs);
        let data = |s: u64, i: u64| (s << 16 | i) as u32;
        // The receiving kernel: every line of each step, with its data, then the credit.
        let receiver = std::thread::spawn(move || {
            for s in 0..nsteps {
                for i in 0..nlines(s) {
                    let t = Instant::now();
                    // SAFETY: the receive block is valid until the handles are dropped, after join.
                    while !unsafe { line_ready(&rs, Lines::Ll, s, i) } {
                        if t.elapsed() > Duration::from_secs(10) {
                            return Err(format!("step {s}: line {i} of {} never came", nlines(s)));
                        }
                        std::thread::yield_now();
                    }
                    // SAFETY: as above.
                    let lo = unsafe { load(Lines::Ll.line_addr(&rs, s, i)) };
                    if lo as u32 != data(s, i) {
                        return Err(format!("step {s}: line {i} holds {:#x}", lo as u32));
                    }
                }
                // SAFETY: as above.
                unsafe { store(rs.head, s + 1) };
            }
            Ok(())
        });
        let write = |s: u64, i: u64| {
            let f = (ll_flag(s) as u64) << 32;
            let at = Lines::Ll.line_addr(&ss, s, i);
            // SAFETY: inside the send block's LL buffer; the slot's credit was checked.
            unsafe {
                store(at, f | data(s, i) as u64);
                store(at + 8, f);
            }
        };
        let credit = |s: u64| {
            // SAFETY: the send block is valid until the handles are dropped.
            wait_for("a credit", || unsafe { load(ss.head) } + FIFO_STEPS > s)
        };
        for s in 0..nsteps {
            credit(s);
            let n = nlines(s);
            let announce = oxccl_gpu::abi::lines_step_size(s, n);
            // SAFETY: the sizes entry of a slot whose credit was checked.
            unsafe { store(ss.sizes + 8 * (s % FIFO_STEPS), announce) };
            for i in (1..n - 1).rev().chain([0]) {
                write(s, i);
            }
            credit(s + 1);
            write(s + 1, 0);
            std::thread::sleep(Duration::from_millis(5));
            write(s, n - 1);
        }
        receiver.join().unwrap().unwrap();
        pair.finish();
    }
}
