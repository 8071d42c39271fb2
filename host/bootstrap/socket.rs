//! TCP plumbing of the bootstrap: the wire header every bootstrap connection starts with, socket
//! addresses in a fixed 28-byte form, connect with retries, reads and writes bounded by a deadline,
//! and a `poll(2)`-driven accept loop that reads and checks the first message of every incoming
//! connection without letting a slow or hostile peer stall the others.
//!
//! Mirrors `src/misc/socket.cc` (`ncclSocketConnect` retrying on refusal, `ncclSocketAccept`
//! checking the connecting side's magic) and the length-prefixed `socketSend`/`socketRecv` of
//! `src/bootstrap.cc`.
//!
//! # Wire header (40 bytes, little-endian)
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0..4 | magic | `b"OXBS"` |
//! | 4..6 | kind | [`Kind`] |
//! | 6..8 | version | [`WIRE_VERSION`] |
//! | 8..16 | secret | the unique id's secret (NCCL's `magic`) |
//! | 16..20 | rank | sender's rank (or, in a root reply, the successor's rank) |
//! | 20..24 | nranks | sender's rank count |
//! | 24..28 | tag | point-to-point tag; result code in a root error reply |
//! | 28..32 | reserved | zero |
//! | 32..40 | len | payload bytes that follow |
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// First four bytes of every bootstrap connection.
pub(crate) const WIRE_MAGIC: [u8; 4] = *b"OXBS";
/// Version of the wire format.
pub(crate) const WIRE_VERSION: u16 = 1;
/// Size of [`Header`] on the wire, in bytes.
pub(crate) const HEADER_BYTES: usize = 40;
/// Size of an encoded socket address, in bytes.
pub(crate) const ADDR_BYTES: usize = 28;
/// Largest control message (root replies, error texts), in bytes.
pub(crate) const CONTROL_MAX_BYTES: u64 = 4096;
/// Byte a receiver sends back once a point-to-point message is in its mailbox.
pub(crate) const ACK: u8 = 0x06;

/// What a bootstrap connection carries.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Rank → root: "I am `rank` of `nranks`, my listener is at <payload>" (NCCL's `extInfo`).
    Register = 1,
    /// Root → rank: the listen address of the rank's ring successor (NCCL's `rootSend`).
    RootNext = 2,
    /// Root → rank: registration refused; `tag` holds the result code, the payload the reason.
    RootError = 3,
    /// Rank → its ring successor: opens the ring connection (NCCL's `socketRingConnect`).
    Ring = 4,
    /// Rank → rank: one point-to-point message (NCCL's `bootstrapSend`).
    P2p = 5,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Register,
            2 => Kind::RootNext,
            3 => Kind::RootError,
            4 => Kind::Ring,
            5 => Kind::P2p,
            _ => return None,
        })
    }
}

/// The fixed header at the start of every bootstrap connection (layout in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub secret: u64,
    pub rank: u32,
    pub nranks: u32,
    pub tag: u32,
    pub len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&WIRE_MAGIC);
        b[4..6].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[6..8].copy_from_slice(&WIRE_VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.secret.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.nranks.to_le_bytes());
        b[24..28].copy_from_slice(&self.tag.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses and checks magic, version, secret and kind; the error says what was wrong (for the
    /// log line of a dropped connection).
    pub fn decode(b: &[u8; HEADER_BYTES], secret: u64) -> std::result::Result<Header, String> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            u64::from_le_bytes([
                b[i],
                b[i + 1],
                b[i + 2],
                b[i + 3],
                b[i + 4],
                b[i + 5],
                b[i + 6],
                b[i + 7],
            ])
        };
        if b[0..4] != WIRE_MAGIC {
            return Err(format!("bad magic {:02x?}", &b[0..4]));
        }
        if u16_at(6) != WIRE_VERSION {
            return Err(format!("wire version {} (expected {WIRE_VERSION})", u16_at(6)));
        }
        if u64_at(8) != secret {
            return Err("wrong secret (not this unique id)".into());
        }
        let kind = Kind::from_u16(u16_at(4)).ok_or_else(|| format!("unknown message kind {}", u16_at(4)))?;
        Ok(Header {
            kind,
            secret,
            rank: u32_at(16),
            nranks: u32_at(20),
            tag: u32_at(24),
            len: u64_at(32),
        })
    }
}

/// Encodes a socket address as family (4 or 6) u16, port u16, 16 address bytes (IPv4 in the
/// first 4), scope id u32, flow info u32; all little-endian except the address bytes.
pub(crate) fn encode_addr(addr: &SocketAddr) -> [u8; ADDR_BYTES] {
    let mut b = [0u8; ADDR_BYTES];
    b[2..4].copy_from_slice(&addr.port().to_le_bytes());
    match addr {
        SocketAddr::V4(a) => {
            b[0..2].copy_from_slice(&4u16.to_le_bytes());
            b[4..8].copy_from_slice(&a.ip().octets());
        }
        SocketAddr::V6(a) => {
            b[0..2].copy_from_slice(&6u16.to_le_bytes());
            b[4..20].copy_from_slice(&a.ip().octets());
            b[20..24].copy_from_slice(&a.scope_id().to_le_bytes());
            b[24..28].copy_from_slice(&a.flowinfo().to_le_bytes());
        }
    }
    b
}

/// Inverse of [`encode_addr`]; `None` for an unknown family, port 0 or unused bytes not zero.
pub(crate) fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    if b.len() != ADDR_BYTES {
        return None;
    }
    let family = u16::from_le_bytes([b[0], b[1]]);
    let port = u16::from_le_bytes([b[2], b[3]]);
    if port == 0 {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    match family {
        4 => {
            if b[8..].iter().any(|&x| x != 0) {
                return None;
            }
            let ip = Ipv4Addr::new(b[4], b[5], b[6], b[7]);
            Some(SocketAddr::V4(SocketAddrV4::new(ip, port)))
        }
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[4..20]);
            let ip = Ipv6Addr::from(o);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                port,
                u32_at(24),
                u32_at(20),
            )))
        }
        _ => None,
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Whether a failed `connect` is worth retrying: nobody listens yet (the peer has not started
/// its listener, as in NCCL_COMM_ID launches) or the SYN went unanswered.
fn retryable(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::WouldBlock
    )
}

/// Connects to `addr`, retrying refused or timed-out attempts until `deadline` (NCCL's
/// `ncclSocketConnect` retry loop). The error names `what`, the address, how long it tried and
/// the OS reason of the last attempt.
pub(crate) fn connect(addr: SocketAddr, deadline: Instant, what: &str) -> Result<TcpStream> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(5);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = remaining(deadline).max(Duration::from_millis(1));
        let err = match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                if attempts > 1 {
                    tracing::debug!(target: "oxccl::bootstrap", %addr, attempts, "connected to {what} after retries");
                }
                return Ok(s);
            }
            Err(e) => e,
        };
        let left = remaining(deadline);
        if !retryable(&err) || left.is_zero() {
            let msg = format!(
                "bootstrap: cannot connect to {what} at {addr} ({attempts} attempts in {}): {err}",
                secs(start.elapsed())
            );
            tracing::warn!(target: "oxccl::bootstrap", "{msg}");
            return Err(if retryable(&err) {
                Error::Remote(msg)
            } else {
                Error::System(msg)
            });
        }
        if attempts == 1 {
            tracing::debug!(target: "oxccl::bootstrap", %addr, "{what} not reachable yet ({err}); retrying for up to {}", secs(left));
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Fills `buf` from `s` before `deadline`. Errors: [`Error::Timeout`] when the deadline passes,
/// [`Error::Remote`] when the peer closes or resets the connection.
pub(crate) fn read_exact_until(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(Error::Timeout(format!(
                "bootstrap: {what}: received {done} of {} bytes before the timeout",
                buf.len()
            )));
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| Error::System(format!("bootstrap: {what}: set timeout: {e}")))?;
        match s.read(&mut buf[done..]) {
            Ok(0) => {
                return Err(Error::Remote(format!(
                    "bootstrap: {what}: connection closed by the peer after {done} of {} bytes",
                    buf.len()
                )));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => {}
            Err(e) => return Err(Error::Remote(format!("bootstrap: {what}: receive failed: {e}"))),
        }
    }
    Ok(())
}

/// Writes all of `buf` to `s` before `deadline`. Errors as [`read_exact_until`].
pub(crate) fn write_all_until(s: &mut TcpStream, buf: &[u8], deadline: Instant, what: &str) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(Error::Timeout(format!(
                "bootstrap: {what}: sent {done} of {} bytes before the timeout",
                buf.len()
            )));
        }
        s.set_write_timeout(Some(left))
            .map_err(|e| Error::System(format!("bootstrap: {what}: set timeout: {e}")))?;
        match s.write(&buf[done..]) {
            Ok(0) => {
                return Err(Error::Remote(format!(
                    "bootstrap: {what}: connection closed while sending"
                )));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => {}
            Err(e) => return Err(Error::Remote(format!("bootstrap: {what}: send failed: {e}"))),
        }
    }
    Ok(())
}

/// Reads one header + payload (at most `max_len` bytes) from `s` and checks it against `secret`.
pub(crate) fn read_message(
    s: &mut TcpStream,
    secret: u64,
    max_len: u64,
    deadline: Instant,
    what: &str,
) -> Result<(Header, Vec<u8>)> {
    let mut hb = [0u8; HEADER_BYTES];
    read_exact_until(s, &mut hb, deadline, what)?;
    let h = Header::decode(&hb, secret).map_err(|e| Error::Remote(format!("bootstrap: {what}: {e}")))?;
    if h.len > max_len {
        return Err(Error::Remote(format!(
            "bootstrap: {what}: message of {} bytes exceeds the limit of {max_len} bytes",
            h.len
        )));
    }
    let mut payload = vec![0u8; h.len as usize];
    read_exact_until(s, &mut payload, deadline, what)?;
    Ok((h, payload))
}

/// Writes one header + payload.
pub(crate) fn write_message(
    s: &mut TcpStream,
    h: &Header,
    payload: &[u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len().min(1 << 16));
    buf.extend_from_slice(&h.encode());
    if payload.len() <= 1 << 16 {
        buf.extend_from_slice(payload);
        write_all_until(s, &buf, deadline, what)
    } else {
        write_all_until(s, &buf, deadline, what)?;
        write_all_until(s, payload, deadline, what)
    }
}

/// One complete, authenticated first message of an incoming connection.
pub(crate) struct Incoming {
    pub header: Header,
    pub payload: Vec<u8>,
    /// The connection, back in blocking mode.
    pub stream: TcpStream,
    pub peer: SocketAddr,
}

/// What [`Server::poll`] saw.
pub(crate) enum Event {
    /// Zero or more complete messages (empty when the wait ended without one).
    Messages(Vec<Incoming>),
    /// The wake descriptor became readable or hung up: the owner asks the loop to stop.
    Woken,
}

struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    head: [u8; HEADER_BYTES],
    head_len: usize,
    header: Option<Header>,
    payload: Vec<u8>,
    filled: usize,
    last: Instant,
}

enum Progress {
    Waiting,
    Done,
    Drop(String),
}

impl Pending {
    /// Reads whatever is available without blocking.
    fn advance(
        &mut self,
        secret: u64,
        allowed: &dyn Fn(&Header) -> std::result::Result<(), String>,
    ) -> Progress {
        loop {
            let res = if self.header.is_none() {
                self.stream.read(&mut self.head[self.head_len..])
            } else if self.filled < self.payload.len() {
                self.stream.read(&mut self.payload[self.filled..])
            } else {
                return Progress::Done;
            };
            match res {
                Ok(0) => return Progress::Drop("closed before a complete message".into()),
                Ok(n) => {
                    self.last = Instant::now();
                    if self.header.is_none() {
                        self.head_len += n;
                        if self.head_len == HEADER_BYTES {
                            let h = match Header::decode(&self.head, secret) {
                                Ok(h) => h,
                                Err(e) => return Progress::Drop(e),
                            };
                            if let Err(e) = allowed(&h) {
                                return Progress::Drop(e);
                            }
                            // `allowed` bounded the length; the allocation is at most that bound.
                            self.payload = vec![0u8; h.len as usize];
                            self.header = Some(h);
                        }
                    } else {
                        self.filled += n;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Progress::Waiting,
                Err(e) => return Progress::Drop(format!("receive failed: {e}")),
            }
        }
    }
}

/// An accept loop over one listener (NCCL's `ncclSocketAccept` plus the magic check), driven by
/// `poll(2)`: every accepted connection must deliver a valid header (right magic, version and
/// secret, a kind and length that `allowed` accepts) and its payload; connections that send junk,
/// close early or stay silent longer than `idle` are dropped and logged. Nothing here blocks on
/// one peer.
pub(crate) struct Server {
    listener: TcpListener,
    secret: u64,
    idle: Duration,
    name: String,
    allowed: Box<dyn Fn(&Header) -> std::result::Result<(), String> + Send>,
    pending: Vec<Pending>,
}

impl Server {
    /// `name` is for log lines ("root", "rank 3"); `idle` is how long a half-received connection
    /// may stay silent.
    pub fn new(
        listener: TcpListener,
        secret: u64,
        idle: Duration,
        name: String,
        allowed: Box<dyn Fn(&Header) -> std::result::Result<(), String> + Send>,
    ) -> Result<Server> {
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::System(format!("bootstrap: {name}: listener set_nonblocking: {e}")))?;
        Ok(Server {
            listener,
            secret,
            idle,
            name,
            allowed,
            pending: Vec::new(),
        })
    }

    /// Waits until `until` (or until something completes, or `wake` is readable), then accepts
    /// and reads what is available. Returns [`Event::Messages`] (maybe empty) or [`Event::Woken`].
    pub fn poll(&mut self, until: Instant, wake: Option<RawFd>) -> Result<Event> {
        let now = Instant::now();
        // Wake up in time to expire the oldest idle connection.
        let mut wait = until.saturating_duration_since(now);
        for p in &self.pending {
            wait = wait.min((p.last + self.idle).saturating_duration_since(now));
        }
        let mut fds = Vec::with_capacity(self.pending.len() + 2);
        fds.push(libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        if let Some(w) = wake {
            fds.push(libc::pollfd {
                fd: w,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        for p in &self.pending {
            fds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // Round up so a wait of 0.3 ms is not a busy zero-timeout poll.
        let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` initialized pollfd
        // structs, and every descriptor in it stays open for the duration of the call (owned by
        // `self.listener`, `self.pending` and the caller's wake socket).
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(Error::System(format!("bootstrap: {}: poll: {e}", self.name)));
            }
        }
        if wake.is_some() && fds[1].revents != 0 {
            return Ok(Event::Woken);
        }
        if fds[0].revents != 0 {
            self.accept_all();
        }
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            match self.pending[i].advance(self.secret, &*self.allowed) {
                Progress::Waiting => {
                    if self.pending[i].last.elapsed() >= self.idle {
                        let p = self.pending.swap_remove(i);
                        tracing::warn!(target: "oxccl::bootstrap", peer = %p.peer, "{}: dropped a connection silent for {}", self.name, secs(self.idle));
                    } else {
                        i += 1;
                    }
                }
                Progress::Drop(why) => {
                    let p = self.pending.swap_remove(i);
                    tracing::warn!(target: "oxccl::bootstrap", peer = %p.peer, "{}: dropped an incoming connection: {why}", self.name);
                }
                Progress::Done => {
                    let p = self.pending.swap_remove(i);
                    let Some(header) = p.header else { continue };
                    if let Err(e) = p.stream.set_nonblocking(false) {
                        tracing::warn!(target: "oxccl::bootstrap", peer = %p.peer, "{}: dropped a connection: set_nonblocking: {e}", self.name);
                        continue;
                    }
                    done.push(Incoming {
                        header,
                        payload: p.payload,
                        stream: p.stream,
                        peer: p.peer,
                    });
                }
            }
        }
        Ok(Event::Messages(done))
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!(target: "oxccl::bootstrap", %peer, "{}: dropped a connection: set_nonblocking: {e}", self.name);
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.pending.push(Pending {
                        stream,
                        peer,
                        head: [0; HEADER_BYTES],
                        head_len: 0,
                        header: None,
                        payload: Vec::new(),
                        filled: 0,
                        last: Instant::now(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted) => {}
                Err(e) => {
                    // Out of descriptors and the like: leave the rest queued for the next round.
                    tracing::warn!(target: "oxccl::bootstrap", "{}: accept failed: {e}", self.name);
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejections() {
        let h = Header {
            kind: Kind::P2p,
            secret: 0x1234_5678_9abc_def0,
            rank: 3,
            nranks: 8,
            tag: 77,
            len: 1 << 20,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b, h.secret), Ok(h));
        assert!(Header::decode(&b, h.secret ^ 1).unwrap_err().contains("secret"));
        let mut bad = b;
        bad[0] = b'X';
        assert!(Header::decode(&bad, h.secret).unwrap_err().contains("magic"));
        let mut bad = b;
        bad[6] = 9;
        assert!(Header::decode(&bad, h.secret).unwrap_err().contains("version"));
        let mut bad = b;
        bad[4] = 42;
        assert!(Header::decode(&bad, h.secret).unwrap_err().contains("kind"));
    }

    #[test]
    fn addr_round_trip() {
        for a in ["127.0.0.1:1", "192.0.2.2:65535", "[fd00::2]:80", "[fe80::1%7]:9"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(decode_addr(&encode_addr(&a)), Some(a));
        }
        let mut b = encode_addr(&"127.0.0.1:5".parse().unwrap());
        b[2] = 0;
        assert_eq!(decode_addr(&b), None, "port 0");
        let mut b = encode_addr(&"127.0.0.1:5".parse().unwrap());
        b[0] = 5;
        assert_eq!(decode_addr(&b), None, "family 5");
        assert_eq!(decode_addr(&[0u8; 27]), None);
    }

    #[test]
    fn connect_gives_up_at_the_deadline() {
        // Port 1 lies below every ephemeral range, so no test running beside this one can be given
        // it for a listener (a port freed after binding port 0 could be).
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let t = Instant::now();
        let e = connect(addr, t + Duration::from_millis(300), "nobody").unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(290) && t.elapsed() < Duration::from_secs(2));
        let m = e.to_string();
        assert!(
            m.contains(&addr.to_string()) && m.contains("refused") && m.contains("nobody"),
            "{m}"
        );
    }
}
