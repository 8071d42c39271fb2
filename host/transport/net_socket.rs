//! The socket network (NCCL's `transport/net_socket.cc` over `misc/socket.cc`): each NET
//! connection is a control socket plus `NCCL_SOCKET_NTHREADS` × `NCCL_NSOCKS_PERTHREAD` data
//! sockets (1 × 1 by default, NCCL's default off AWS), all non-blocking, so the proxy thread can
//! progress every connection without blocking on any.
//!
//! - **Messages:** each message's 4-byte little-endian size goes on the control socket, in posting
//!   order. A message of at most [`MIN_CHUNK_BYTES`] (64 KiB, NCCL's `MIN_CHUNKSIZE`) follows its
//!   size inline on the control socket (one write, the lowest latency); a larger one is split into
//!   chunks of [`chunk_bytes`] (an even share per data socket, at least 64 KiB) dealt round robin
//!   over the data sockets, continuing where the previous message stopped; both ends deal the
//!   same way, so each data socket carries its chunks in the same order on both. A request
//!   completes when its size, inline bytes and every chunk are through.
//! - **Threads:** as NCCL moves the chunks with helper threads, each data socket has a helper
//!   thread that moves its chunks in order with blocking I/O, so the copies of every connection
//!   run in parallel, off the proxy thread (one thread per socket: `NCCL_SOCKET_NTHREADS` ×
//!   `NCCL_NSOCKS_PERTHREAD` threads per connection). The proxy thread only drives the control
//!   socket and sees a chunked request done once its helpers counted its chunks down. Closing a
//!   connection shuts its sockets down and joins the helpers.
//! - **Interface:** `NCCL_SOCKET_IFNAME` (NCCL's syntax, see [`crate::bootstrap::IfFilter`]) picks
//!   the interface to listen on; without it the network listens on the address the bootstrap uses.
//! - **Handle:** magic, a random per-listener nonce and the listen address. A connection that does
//!   not open with both is dropped (logged), so stray connections never pass for a peer.
//! - **Failure detection:** end of stream, reset and broken pipe fail the connection at once;
//!   keepalive (idle 10 s, then 3 probes 5 s apart) and `TCP_USER_TIMEOUT` (30 s of unacknowledged
//!   data) turn a silent peer host into a timeout. Each is [`Error::Remote`] naming the peer.
use super::net::{
    ListenComm, NET_HANDLE_BYTES, Net, NetHandle, NetProperties, Opaque, RecvComm, Request, SendComm,
};
use crate::error::{Error, Result};
use crate::params::{MAX_SOCKETS, SocketStreams};
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// First bytes of every handle and of every connection's hello.
const MAGIC: u64 = 0x4f58_4343_4c4e_4554; // "OXCCLNET"
/// Bytes of the hello a connector sends on each socket: magic, the listener's nonce, a connection
/// id, the socket's index and the number of data sockets.
const HELLO_BYTES: usize = 32;
/// Messages above this many bytes are split over the data sockets, in chunks of at least this
/// size (NCCL's `MIN_CHUNKSIZE`, 64 KiB); smaller ones travel inline on the control socket.
pub const MIN_CHUNK_BYTES: usize = 64 << 10;
/// How long `accept` waits for the hello of a connection it accepted.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// How long one `connect` attempt may take before it answers "call again".
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);
/// Most requests queued on one connection (NCCL's `NCCL_NET_MAX_REQUESTS` is 32 for v8).
pub const MAX_REQUESTS: usize = 32;

/// The socket network over one interface (NCCL's `ncclNetSocket`).
#[derive(Clone, Debug)]
pub struct NetSocket {
    /// Interface name (for properties and messages).
    ifname: String,
    /// Address listeners bind to (port 0: any free port).
    addr: IpAddr,
    /// IPv6 scope id of `addr` (0 for IPv4).
    scope_id: u32,
    /// Data sockets per connection (`NCCL_SOCKET_NTHREADS` × `NCCL_NSOCKS_PERTHREAD`).
    streams: SocketStreams,
}

impl NetSocket {
    /// The socket network listening on `addr` (interface `ifname`, IPv6 scope `scope_id`), with
    /// one data socket per connection (NCCL's default; see [`NetSocket::with_streams`]).
    pub fn new(ifname: &str, addr: IpAddr, scope_id: u32) -> NetSocket {
        NetSocket {
            ifname: ifname.to_string(),
            addr,
            scope_id,
            streams: SocketStreams::default(),
        }
    }

    /// This network with `streams.nsocks()` data sockets per connection its listeners accept (a
    /// connector follows the listener's count, as NCCL's `ncclNetSocketConnect` does).
    pub fn with_streams(mut self, streams: SocketStreams) -> NetSocket {
        self.streams = streams;
        self
    }

    /// The parallel streams of this network's connections.
    pub fn streams(&self) -> SocketStreams {
        self.streams
    }

    /// The socket network from the environment: the interface `NCCL_SOCKET_IFNAME` (or
    /// `OXCCL_SOCKET_IFNAME`) selects, else the interface holding `fallback` (the bootstrap's
    /// address), else NCCL's default order; the parallel streams from `NCCL_SOCKET_NTHREADS` and
    /// `NCCL_NSOCKS_PERTHREAD` ([`crate::params::socket_streams`]).
    ///
    /// Errors: `InvalidUsage` naming the variable, its value and "no matching interface" when the
    /// filter matches no interface that is up; `InvalidArgument` naming the stream variable and
    /// its accepted range; `System` when interfaces cannot be listed.
    pub fn from_env(fallback: Option<IpAddr>) -> Result<NetSocket> {
        let streams = crate::params::socket_streams(crate::params::env_var)?;
        Ok(Self::from_env_interface(fallback)?.with_streams(streams))
    }

    fn from_env_interface(fallback: Option<IpAddr>) -> Result<NetSocket> {
        let ifs = crate::bootstrap::list_interfaces()?;
        let named = crate::params::env_var("SOCKET_IFNAME").filter(|(_, v)| !v.trim().is_empty());
        if named.is_none()
            && let Some(i) = fallback.and_then(|a| ifs.iter().find(|i| i.up && i.addr == a))
        {
            return Ok(NetSocket::new(&i.name, i.addr, i.scope_id));
        }
        let i = crate::bootstrap::select_interface(
            &ifs,
            named.as_ref().map(|(k, v)| (k.as_str(), v.as_str())),
            fallback,
        )?;
        tracing::info!(target: "oxccl::net", iface = %i.name, addr = %i.addr, "socket network interface");
        Ok(NetSocket::new(&i.name, i.addr, i.scope_id))
    }

    /// The address listeners bind to.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }
}

/// Encodes a listen address, nonce and data socket count into a handle.
fn encode_handle(addr: &SocketAddr, nonce: u64, nsocks: u32) -> NetHandle {
    let mut h = [0u8; NET_HANDLE_BYTES];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&nonce.to_le_bytes());
    match addr {
        SocketAddr::V4(a) => {
            h[16] = 4;
            h[17..21].copy_from_slice(&a.ip().octets());
        }
        SocketAddr::V6(a) => {
            h[16] = 6;
            h[17..33].copy_from_slice(&a.ip().octets());
            h[35..39].copy_from_slice(&a.scope_id().to_le_bytes());
        }
    }
    h[33..35].copy_from_slice(&addr.port().to_be_bytes());
    h[40..44].copy_from_slice(&nsocks.to_le_bytes());
    h
}

/// Decodes a handle into address, nonce and data socket count; `None` when it is not a socket
/// network handle or announces no data socket or more than [`MAX_SOCKETS`].
fn decode_handle(h: &NetHandle) -> Option<(SocketAddr, u64, u32)> {
    let word = |r: std::ops::Range<usize>| u64::from_le_bytes(h[r].try_into().unwrap_or([0; 8]));
    if word(0..8) != MAGIC {
        return None;
    }
    let port = u16::from_be_bytes([h[33], h[34]]);
    let addr = match h[16] {
        4 => SocketAddr::from((Ipv4Addr::new(h[17], h[18], h[19], h[20]), port)),
        6 => {
            let ip: [u8; 16] = h[17..33].try_into().ok()?;
            let scope = u32::from_le_bytes(h[35..39].try_into().ok()?);
            SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope))
        }
        _ => return None,
    };
    let nsocks = u32::from_le_bytes(h[40..44].try_into().ok()?);
    if nsocks == 0 || nsocks > MAX_SOCKETS {
        return None;
    }
    Some((addr, word(8..16), nsocks))
}

/// 64 random bits from the OS, or from std's randomly keyed hasher.
fn nonce() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// Sets an integer socket option; failures are logged (the connection still works without it).
fn set_opt(fd: i32, level: i32, name: i32, value: i32, what: &str) {
    // SAFETY: `fd` is an open socket owned by the caller; the option value is a valid c_int that
    // outlives the call, and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(target: "oxccl::net", "setsockopt {what}: {}", std::io::Error::last_os_error());
    }
}

/// Data-connection options: no Nagle delay, keepalive and a bound on unacknowledged data, then
/// non-blocking.
fn prepare(stream: &TcpStream, peer: &SocketAddr) -> Result<()> {
    let sys = |e: std::io::Error| Error::System(format!("socket network: connection with {peer}: {e}"));
    stream.set_nodelay(true).map_err(sys)?;
    let fd = stream.as_raw_fd();
    set_opt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1, "SO_KEEPALIVE");
    set_opt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10, "TCP_KEEPIDLE");
    set_opt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5, "TCP_KEEPINTVL");
    set_opt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3, "TCP_KEEPCNT");
    set_opt(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        30_000,
        "TCP_USER_TIMEOUT",
    );
    stream.set_nonblocking(true).map_err(sys)
}

/// A connection being accepted: the sockets of one connector that arrived so far.
struct Partial {
    /// The connector's random connection id (from its greetings).
    id: u64,
    peer: SocketAddr,
    ctrl: Option<TcpStream>,
    data: Vec<Option<TcpStream>>,
}

/// A listener, the nonce its connections must present, and the connections half accepted.
struct SockListen {
    listener: TcpListener,
    nonce: u64,
    addr: SocketAddr,
    /// Data sockets every connection to this listener opens (the handle announces it).
    nsocks: usize,
    partial: Vec<Partial>,
}

/// Completion state of one request, shared between the request and its connection.
#[derive(Default)]
struct Slot {
    done: AtomicBool,
    size: AtomicUsize,
}

/// One posted send or receive.
struct Req {
    slot: Arc<Slot>,
    send: bool,
    /// Address of the data (send) or of the posted buffer (receive).
    ptr: usize,
    /// Bytes to send, or bytes of the posted buffer.
    cap: usize,
    /// The 4-byte little-endian size on the control socket (written for sends, read for receives).
    hdr: [u8; 4],
    hdr_done: usize,
    /// Message bytes (sends: `cap`; receives: from the size).
    size: usize,
    /// Bytes moved inline on the control socket (messages of at most [`MIN_CHUNK_BYTES`]).
    inline_done: usize,
    /// Chunks of this message still moving on data sockets (counted down by their helper
    /// threads); `None` for a message carried inline.
    chunks_left: Option<Arc<AtomicUsize>>,
    done: bool,
}

impl Req {
    fn inline(&self) -> usize {
        if self.size <= MIN_CHUNK_BYTES {
            self.size
        } else {
            0
        }
    }
    fn finish(&mut self) {
        self.done = true;
        self.slot.size.store(self.size, Ordering::Relaxed);
        self.slot.done.store(true, Ordering::Release);
    }
}

/// A part of a message handed to one data socket's helper thread.
struct Chunk {
    /// Its request's count of chunks still moving.
    left: Arc<AtomicUsize>,
    send: bool,
    ptr: usize,
    len: usize,
}

/// One data socket of a connection and the helper thread that moves its chunks, in order, with
/// blocking I/O (NCCL's `persistentSocketThread`: the copies of every connection run in
/// parallel, off the proxy thread).
struct DataSock {
    /// The socket (the helper owns a clone): kept to shut it down, which ends a blocked helper.
    stream: TcpStream,
    jobs: Option<crossbeam_channel::Sender<Chunk>>,
    helper: Option<std::thread::JoinHandle<()>>,
    /// Bytes this socket has carried (statistics and tests).
    bytes: Arc<AtomicU64>,
}

/// The helper thread of one data socket: moves each chunk in turn; after a failure (recorded in
/// `failed`, which fails the connection) it touches no more memory.
fn helper(
    mut s: TcpStream,
    jobs: crossbeam_channel::Receiver<Chunk>,
    bytes: Arc<AtomicU64>,
    failed: Arc<Mutex<Option<String>>>,
    peer: SocketAddr,
) {
    let mut broken = false;
    for c in jobs.iter() {
        if broken {
            continue;
        }
        let r = if c.send {
            // SAFETY: the chunk lies inside a send's buffer, which `isend`'s contract keeps valid
            // and unchanged until the request is done; it is not done before this chunk counts
            // down, and a closing connection joins this thread first.
            s.write_all(unsafe { std::slice::from_raw_parts(c.ptr as *const u8, c.len) })
        } else {
            // SAFETY: the chunk lies inside the first `size <= cap` bytes of a receive's buffer,
            // which `irecv`'s contract keeps valid and ours until the request is done (as above).
            s.read_exact(unsafe { std::slice::from_raw_parts_mut(c.ptr as *mut u8, c.len) })
        };
        match r {
            Ok(()) => {
                bytes.fetch_add(c.len as u64, Ordering::Relaxed);
                c.left.fetch_sub(1, Ordering::AcqRel);
            }
            Err(e) => {
                broken = true;
                let mut f = failed.lock().unwrap_or_else(|p| p.into_inner());
                f.get_or_insert_with(|| lost(&peer, &e));
            }
        }
    }
}

/// One established connection: its control socket (sizes, and small messages inline), its data
/// sockets, and its requests, progressed without blocking.
struct Conn {
    ctrl: TcpStream,
    data: Vec<DataSock>,
    /// Data socket the next chunk goes to (round robin, the same sequence on both ends).
    next_sock: usize,
    /// Bytes carried inline on the control socket (statistics and tests).
    inline_bytes: u64,
    peer: SocketAddr,
    /// Posted requests not yet completed and retired, in posting order.
    reqs: VecDeque<Req>,
    /// Id of `reqs[0]`; ids count posted requests.
    base: u64,
    /// Index in `reqs` of the first request whose control part (size, inline data) is unfinished.
    ctrl_pos: usize,
    /// Set when the connection failed; every later request fails with it.
    failed: Option<String>,
    /// A data socket's failure, reported by its helper thread.
    data_failed: Arc<Mutex<Option<String>>>,
}

impl Drop for Conn {
    /// Shuts the sockets down (ending blocked helpers) and joins the helpers, so none touches a
    /// request's memory once the connection is closed.
    fn drop(&mut self) {
        let _ = self.ctrl.shutdown(std::net::Shutdown::Both);
        for d in &mut self.data {
            let _ = d.stream.shutdown(std::net::Shutdown::Both);
            d.jobs = None;
        }
        for d in &mut self.data {
            if let Some(h) = d.helper.take() {
                let _ = h.join();
            }
        }
    }
}

type Shared = Arc<Mutex<Conn>>;

fn lock(c: &Shared) -> MutexGuard<'_, Conn> {
    // Only the proxy thread drives a connection; a poisoned lock cannot leave a half-updated
    // queue that matters more than the failure that poisoned it.
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// The socket network's request: its connection and its completion slot.
struct SockRequest {
    conn: Shared,
    slot: Arc<Slot>,
}

/// What an I/O error on an established connection means.
fn lost(peer: &SocketAddr, e: &std::io::Error) -> String {
    let what = match e.kind() {
        ErrorKind::UnexpectedEof => "the peer closed the connection (end of stream)".to_string(),
        ErrorKind::ConnectionReset => "connection reset by the peer".to_string(),
        ErrorKind::BrokenPipe => "broken pipe (the peer closed the connection)".to_string(),
        ErrorKind::TimedOut => format!("timed out ({e})"),
        _ => e.to_string(),
    };
    format!("socket network: connection with {peer}: {what}")
}

/// Chunk size for a message of `size` bytes over `nsocks` data sockets: an even share, but at
/// least [`MIN_CHUNK_BYTES`] (NCCL's `max(MIN_CHUNKSIZE, DIVUP(size, nSocks))`).
pub fn chunk_bytes(size: usize, nsocks: usize) -> usize {
    MIN_CHUNK_BYTES.max(size.div_ceil(nsocks.max(1)))
}

impl Conn {
    /// The connection over `ctrl` and `data`, with a helper thread per data socket.
    ///
    /// Errors: `System` when a data socket cannot be made blocking or cloned, or a helper thread
    /// cannot be started.
    fn new(ctrl: TcpStream, data: Vec<TcpStream>, peer: SocketAddr) -> Result<Conn> {
        let data_failed = Arc::new(Mutex::new(None));
        let sys = |e: std::io::Error| Error::System(format!("socket network: connection with {peer}: {e}"));
        let mut socks = Vec::with_capacity(data.len());
        // Dropping `socks` on an error shuts down and joins the helpers started so far.
        let conn_socks = |socks: &mut Vec<DataSock>| -> Result<()> {
            for (i, stream) in data.into_iter().enumerate() {
                stream.set_nonblocking(false).map_err(sys)?;
                let own = stream.try_clone().map_err(sys)?;
                let (tx, rx) = crossbeam_channel::unbounded();
                let bytes = Arc::new(AtomicU64::new(0));
                let (b, f) = (bytes.clone(), data_failed.clone());
                let h = std::thread::Builder::new()
                    .name(format!("oxccl-sock{i}"))
                    .stack_size(64 << 10)
                    .spawn(move || helper(own, rx, b, f, peer))
                    .map_err(sys)?;
                socks.push(DataSock {
                    stream,
                    jobs: Some(tx),
                    helper: Some(h),
                    bytes,
                });
            }
            Ok(())
        };
        let made = conn_socks(&mut socks);
        let conn = Conn {
            ctrl,
            data: socks,
            next_sock: 0,
            inline_bytes: 0,
            peer,
            reqs: VecDeque::new(),
            base: 0,
            ctrl_pos: 0,
            failed: None,
            data_failed,
        };
        made.map(|()| conn)
    }

    /// Moves every request forward as far as the sockets allow without blocking.
    fn progress(&mut self) -> std::result::Result<(), String> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let r = self.progress_inner();
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            let _ = self.ctrl.shutdown(std::net::Shutdown::Both);
            for d in &self.data {
                let _ = d.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        r
    }

    fn progress_inner(&mut self) -> std::result::Result<(), String> {
        let peer = self.peer;
        let io_err = |e: std::io::Error| {
            if e.kind() == ErrorKind::InvalidData {
                format!("socket network: connection with {peer}: {e}")
            } else {
                lost(&peer, &e)
            }
        };
        // Control socket: sizes (and small messages) in posting order. Once a size is known, the
        // message's chunks go to the data sockets round robin; both ends compute the same split.
        while self.ctrl_pos < self.reqs.len() {
            let r = &mut self.reqs[self.ctrl_pos];
            let finished = if r.send {
                ctrl_send(&mut self.ctrl, r)
            } else {
                ctrl_recv(&mut self.ctrl, r)
            }
            .map_err(io_err)?;
            if !finished {
                break;
            }
            self.inline_bytes += r.inline() as u64;
            if r.size > MIN_CHUNK_BYTES {
                let n = self.data.len();
                let task = chunk_bytes(r.size, n);
                let left = Arc::new(AtomicUsize::new(r.size.div_ceil(task)));
                let mut off = 0;
                while off < r.size {
                    let len = task.min(r.size - off);
                    let c = Chunk {
                        left: left.clone(),
                        send: r.send,
                        ptr: r.ptr + off,
                        len,
                    };
                    let sent = self.data[self.next_sock].jobs.as_ref().map(|j| j.send(c));
                    if !matches!(sent, Some(Ok(()))) {
                        return Err(format!(
                            "socket network: connection with {peer}: a data socket's helper thread is gone"
                        ));
                    }
                    self.next_sock = (self.next_sock + 1) % n;
                    off += len;
                }
                r.chunks_left = Some(left);
            }
            self.ctrl_pos += 1;
        }
        // Data sockets: their helpers move the chunks; a request is done once its chunks are.
        if let Some(f) = self.data_failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(f);
        }
        for r in self.reqs.iter_mut().take(self.ctrl_pos) {
            if !r.done
                && r.chunks_left
                    .as_ref()
                    .is_none_or(|c| c.load(Ordering::Acquire) == 0)
            {
                r.finish();
            }
        }
        // Retire finished requests from the front (their slots stay with their requests).
        while self.reqs.front().is_some_and(|r| r.done) {
            self.reqs.pop_front();
            self.base += 1;
            self.ctrl_pos -= 1;
        }
        Ok(())
    }
}

/// Writes `r`'s size and, for a small message, its data on the control socket; `Ok(true)` once
/// all of it is written.
fn ctrl_send(s: &mut TcpStream, r: &mut Req) -> std::io::Result<bool> {
    let inline = r.inline();
    loop {
        if r.hdr_done == 4 && r.inline_done == inline {
            return Ok(true);
        }
        // SAFETY: `isend`'s contract keeps `ptr..ptr+size` valid and unchanged until done.
        let data = unsafe { std::slice::from_raw_parts(r.ptr as *const u8, inline) };
        let bufs = [
            IoSlice::new(&r.hdr[r.hdr_done..]),
            IoSlice::new(&data[r.inline_done..]),
        ];
        match s.write_vectored(&bufs) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(mut n) => {
                let h = n.min(4 - r.hdr_done);
                r.hdr_done += h;
                n -= h;
                r.inline_done += n;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Reads `r`'s size and, for a small message, its data from the control socket; `Ok(true)` once
/// all of it is in. A size above the posted buffer is `InvalidData`.
fn ctrl_recv(s: &mut TcpStream, r: &mut Req) -> std::io::Result<bool> {
    loop {
        let n = if r.hdr_done < 4 {
            s.read(&mut r.hdr[r.hdr_done..])
        } else if r.inline_done < r.inline() {
            // SAFETY: `irecv`'s contract keeps `ptr..ptr+cap` valid and ours until done, and
            // `size <= cap` was checked when the size arrived.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr as *mut u8, r.size) };
            s.read(&mut buf[r.inline_done..])
        } else {
            return Ok(true);
        };
        match n {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) if r.hdr_done < 4 => {
                r.hdr_done += n;
                if r.hdr_done == 4 {
                    r.size = u32::from_le_bytes(r.hdr) as usize;
                    if r.size > r.cap {
                        return Err(std::io::Error::new(
                            ErrorKind::InvalidData,
                            format!(
                                "a message of {} bytes arrived for a receive of at most {} bytes",
                                r.size, r.cap
                            ),
                        ));
                    }
                }
            }
            Ok(n) => r.inline_done += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn downcast<'a, T: 'static>(o: &'a mut Opaque, what: &str) -> Result<&'a mut T> {
    o.0.downcast_mut::<T>().ok_or_else(|| {
        Error::InvalidUsage(format!(
            "socket network: {what} was not created by the socket network"
        ))
    })
}

/// The greeting a connector sends on each of its sockets: magic, the listener's nonce, the
/// connection id, the socket's index (`nsocks` for the control socket) and `nsocks`.
fn hello(nonce: u64, id: u64, index: u32, nsocks: u32) -> [u8; HELLO_BYTES] {
    let mut h = [0u8; HELLO_BYTES];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&nonce.to_le_bytes());
    h[16..24].copy_from_slice(&id.to_le_bytes());
    h[24..28].copy_from_slice(&index.to_le_bytes());
    h[28..32].copy_from_slice(&nsocks.to_le_bytes());
    h
}

impl NetSocket {
    fn post(&self, conn: &Shared, send: bool, ptr: usize, cap: usize) -> Result<Option<Request>> {
        if cap > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "socket network: message of {cap} bytes exceeds the limit of {} bytes",
                u32::MAX
            )));
        }
        let mut c = lock(conn);
        if let Some(f) = &c.failed {
            return Err(Error::Remote(f.clone()));
        }
        if c.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let slot = Arc::new(Slot::default());
        c.reqs.push_back(Req {
            slot: slot.clone(),
            send,
            ptr,
            cap,
            hdr: if send { (cap as u32).to_le_bytes() } else { [0; 4] },
            hdr_done: 0,
            size: if send { cap } else { 0 },
            inline_done: 0,
            chunks_left: None,
            done: false,
        });
        drop(c);
        Ok(Some(Request(Opaque(Box::new(SockRequest {
            conn: conn.clone(),
            slot,
        })))))
    }

    /// Reads the greeting of an accepted socket and files it under its connection; `Ok(None)`
    /// when the socket was dropped (no or a foreign greeting).
    fn greet(l: &mut SockListen, mut stream: TcpStream, peer: SocketAddr) -> Result<Option<usize>> {
        let mut h = [0u8; HELLO_BYTES];
        let greeted = stream
            .set_nonblocking(false)
            .and_then(|_| stream.set_read_timeout(Some(HELLO_WAIT)))
            .and_then(|_| stream.read_exact(&mut h));
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(h[r].try_into().unwrap_or([0; 8]));
        let half = |r: std::ops::Range<usize>| u32::from_le_bytes(h[r].try_into().unwrap_or([0; 4])) as usize;
        let (id, index, nsocks) = (word(16..24), half(24..28), half(28..32));
        let ok = greeted.is_ok()
            && word(0..8) == MAGIC
            && word(8..16) == l.nonce
            && nsocks == l.nsocks
            && index <= nsocks;
        if !ok {
            tracing::warn!(target: "oxccl::net", %peer, listen = %l.addr,
                "socket network: dropped a connection without the expected greeting ({greeted:?}, \
                 {nsocks} data sockets announced, {} expected)", l.nsocks);
            return Ok(None);
        }
        stream
            .set_read_timeout(None)
            .map_err(|e| Error::System(format!("socket network: connection from {peer}: {e}")))?;
        prepare(&stream, &peer)?;
        let at = match l.partial.iter().position(|p| p.id == id) {
            Some(at) => at,
            None => {
                l.partial.push(Partial {
                    id,
                    peer,
                    ctrl: None,
                    data: (0..nsocks).map(|_| None).collect(),
                });
                l.partial.len() - 1
            }
        };
        let p = &mut l.partial[at];
        if index == nsocks {
            p.ctrl = Some(stream);
        } else {
            p.data[index] = Some(stream);
        }
        Ok(Some(at))
    }
}

impl Net for NetSocket {
    fn name(&self) -> &str {
        "Socket"
    }

    fn devices(&self) -> Result<usize> {
        Ok(1)
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        if dev != 0 {
            return Err(Error::invalid(format!(
                "socket network: device {dev} is out of range (accepted: 0..1)"
            )));
        }
        let speed = std::fs::read_to_string(format!("/sys/class/net/{}/speed", self.ifname))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|s| *s > 0)
            .unwrap_or(0) as u32;
        Ok(NetProperties {
            name: self.ifname.clone(),
            speed_mbps: speed,
            max_requests: MAX_REQUESTS,
        })
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, ListenComm)> {
        self.properties(dev)?;
        let bind = match self.addr {
            IpAddr::V4(a) => SocketAddr::from((a, 0)),
            IpAddr::V6(a) => SocketAddr::V6(SocketAddrV6::new(a, 0, 0, self.scope_id)),
        };
        let sys = |e: std::io::Error| {
            Error::System(format!(
                "socket network: cannot listen on {} ({}): {e}",
                self.addr, self.ifname
            ))
        };
        let listener = TcpListener::bind(bind).map_err(sys)?;
        listener.set_nonblocking(true).map_err(sys)?;
        let addr = listener.local_addr().map_err(sys)?;
        let nonce = nonce();
        let nsocks = self.streams.nsocks();
        tracing::trace!(target: "oxccl::net", %addr, nsocks, "socket network: listening");
        Ok((
            encode_handle(&addr, nonce, nsocks as u32),
            ListenComm(Opaque(Box::new(SockListen {
                listener,
                nonce,
                addr,
                nsocks,
                partial: Vec::new(),
            }))),
        ))
    }

    fn connect(&self, _dev: usize, handle: &NetHandle) -> Result<Option<SendComm>> {
        let (addr, nonce, nsocks) = decode_handle(handle).ok_or_else(|| {
            Error::InvalidUsage(
                "socket network: connect was given a handle the socket network did not make".into(),
            )
        })?;
        let nsocks = nsocks as usize;
        if nsocks != self.streams.nsocks() {
            // NCCL's ncclNetSocketConnect: the receiving side decides.
            tracing::warn!(target: "oxccl::net", peer = %addr,
                "socket network: the receiving side uses {nsocks} data sockets, this side {}; using {nsocks}",
                self.streams.nsocks());
        }
        let id = self::nonce();
        // Data sockets 0..nsocks, then the control socket (index nsocks), as NCCL connects them.
        let mut socks = Vec::with_capacity(nsocks + 1);
        for index in 0..=nsocks {
            let mut stream = match TcpStream::connect_timeout(&addr, CONNECT_ATTEMPT) {
                Ok(s) => s,
                Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                    return Ok(None);
                }
                Err(e) => {
                    return Err(Error::Remote(format!(
                        "socket network: connecting to {addr} (socket {index} of {}): {e}",
                        nsocks + 1
                    )));
                }
            };
            stream
                .write_all(&hello(nonce, id, index as u32, nsocks as u32))
                .map_err(|e| Error::Remote(format!("socket network: greeting {addr}: {e}")))?;
            prepare(&stream, &addr)?;
            socks.push(stream);
        }
        let ctrl = socks
            .pop()
            .ok_or_else(|| Error::Internal("socket network: no control socket".into()))?;
        Ok(Some(SendComm(Opaque(Box::new(Arc::new(Mutex::new(Conn::new(
            ctrl, socks, addr,
        )?)))))))
    }

    fn accept(&self, listen: &mut ListenComm) -> Result<Option<RecvComm>> {
        let l = downcast::<SockListen>(&mut listen.0, "the listener")?;
        loop {
            let (stream, peer) = match l.listener.accept() {
                Ok(x) => x,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    return Ok(None);
                }
                Err(e) => {
                    return Err(Error::System(format!(
                        "socket network: accepting on {}: {e}",
                        l.addr
                    )));
                }
            };
            let Some(at) = NetSocket::greet(l, stream, peer)? else {
                continue;
            };
            let p = &l.partial[at];
            if p.ctrl.is_none() || p.data.iter().any(Option::is_none) {
                continue;
            }
            let p = l.partial.swap_remove(at);
            let (Some(ctrl), data) = (p.ctrl, p.data.into_iter().flatten().collect::<Vec<_>>()) else {
                continue;
            };
            tracing::trace!(target: "oxccl::net", peer = %p.peer, nsocks = data.len(), "socket network: accepted");
            return Ok(Some(RecvComm(Opaque(Box::new(Arc::new(Mutex::new(Conn::new(
                ctrl, data, p.peer,
            )?)))))));
        }
    }

    unsafe fn isend(
        &self,
        comm: &mut SendComm,
        data: *const u8,
        size: usize,
        _tag: u32,
    ) -> Result<Option<Request>> {
        let conn = downcast::<Shared>(&mut comm.0, "the send connection")?.clone();
        self.post(&conn, true, data as usize, size)
    }

    unsafe fn irecv(
        &self,
        comm: &mut RecvComm,
        data: *mut u8,
        size: usize,
        _tag: u32,
    ) -> Result<Option<Request>> {
        let conn = downcast::<Shared>(&mut comm.0, "the receive connection")?.clone();
        self.post(&conn, false, data as usize, size)
    }

    fn test(&self, req: &mut Request) -> Result<Option<usize>> {
        let r = downcast::<SockRequest>(&mut req.0, "the request")?;
        if !r.slot.done.load(Ordering::Acquire) {
            lock(&r.conn).progress().map_err(Error::Remote)?;
        }
        Ok(r.slot
            .done
            .load(Ordering::Acquire)
            .then(|| r.slot.size.load(Ordering::Relaxed)))
    }

    /// The control socket of a send connection carries nothing back from the receiver, so a
    /// readable end of stream (or an error) on it means the receiving end is gone.
    fn check_send(&self, comm: &mut SendComm) -> Result<()> {
        let conn = downcast::<Shared>(&mut comm.0, "the send connection")?.clone();
        let c = lock(&conn);
        if let Some(f) = &c.failed {
            return Err(Error::Remote(f.clone()));
        }
        let mut b = [0u8; 1];
        match c.ctrl.peek(&mut b) {
            Ok(0) => Err(Error::Remote(format!(
                "socket network: connection with {}: closed by the receiving end",
                c.peer
            ))),
            Err(e) if e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::Interrupted => {
                Err(Error::Remote(lost(&c.peer, &e)))
            }
            _ => Ok(()),
        }
    }

    fn close_send(&self, mut comm: SendComm) -> Result<()> {
        if let Ok(c) = downcast::<Shared>(&mut comm.0, "the send connection") {
            log_traffic("send", &lock(c));
        }
        drop(comm);
        Ok(())
    }

    fn close_recv(&self, mut comm: RecvComm) -> Result<()> {
        if let Ok(c) = downcast::<Shared>(&mut comm.0, "the receive connection") {
            log_traffic("receive", &lock(c));
        }
        drop(comm);
        Ok(())
    }

    fn close_listen(&self, comm: ListenComm) -> Result<()> {
        drop(comm);
        Ok(())
    }
}

/// Logs what a closing connection carried on each of its sockets.
fn log_traffic(what: &str, c: &Conn) {
    tracing::debug!(target: "oxccl::net",
        "socket network: {what} connection with {} closed: {} bytes inline on the control socket, \
         data sockets {:?} bytes", c.peer, c.inline_bytes,
        c.data.iter().map(|d| d.bytes.load(Ordering::Relaxed)).collect::<Vec<_>>());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn pair(net: &NetSocket) -> (SendComm, RecvComm) {
        pair_with(net, net)
    }

    /// A connection from `from` to a listener of `to`.
    fn pair_with(from: &NetSocket, to: &NetSocket) -> (SendComm, RecvComm) {
        let net = to;
        let (h, mut l) = net.listen(0).unwrap();
        let s = from.connect(0, &h).unwrap().expect("connected");
        let t = Instant::now();
        loop {
            if let Some(r) = net.accept(&mut l).unwrap() {
                return (s, r);
            }
            assert!(t.elapsed() < Duration::from_secs(10), "accept");
        }
    }

    fn wait(net: &NetSocket, reqs: &mut [Request]) -> Vec<usize> {
        let t = Instant::now();
        let mut out = vec![None; reqs.len()];
        while out.iter().any(Option::is_none) {
            for (i, r) in reqs.iter_mut().enumerate() {
                if out[i].is_none() {
                    out[i] = net.test(r).unwrap();
                }
            }
            assert!(t.elapsed() < Duration::from_secs(20), "requests did not finish");
        }
        out.into_iter().map(Option::unwrap).collect()
    }

    #[test]
    fn handles_round_trip() {
        for a in ["10.77.1.2:4567", "[fe80::1%3]:80", "127.0.0.1:1"] {
            let addr: SocketAddr = a.parse().unwrap();
            for n in [1, 64] {
                assert_eq!(
                    decode_handle(&encode_handle(&addr, 0xfeed, n)),
                    Some((addr, 0xfeed, n))
                );
            }
            // 0 and 65 data sockets are not handles the socket network makes.
            for n in [0, 65] {
                assert_eq!(decode_handle(&encode_handle(&addr, 0xfeed, n)), None);
            }
        }
        assert_eq!(decode_handle(&[0u8; NET_HANDLE_BYTES]), None);
    }

    #[test]
    fn messages_arrive_in_order_with_their_sizes() {
        let net = NetSocket::new("lo", IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        let (mut s, mut r) = pair(&net);
        // Sizes: empty, odd, and 3 MiB (more than the socket buffers hold at once).
        let msgs: Vec<Vec<u8>> = [0usize, 13, 3 << 20]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 + n) as u8).collect())
            .collect();
        let mut bufs: Vec<Vec<u8>> = vec![vec![0xAA; 3 << 20]; 3];
        let mut reqs = Vec::new();
        for (m, b) in msgs.iter().zip(bufs.iter_mut()) {
            // SAFETY: the buffers outlive the requests, which finish in `wait`.
            unsafe {
                reqs.push(net.isend(&mut s, m.as_ptr(), m.len(), 0).unwrap().unwrap());
                reqs.push(net.irecv(&mut r, b.as_mut_ptr(), b.len(), 0).unwrap().unwrap());
            }
        }
        let sizes = wait(&net, &mut reqs);
        // Each (send, recv) pair reports the message's size on both ends.
        assert_eq!(sizes, vec![0, 0, 13, 13, 3 << 20, 3 << 20]);
        for (m, b) in msgs.iter().zip(&bufs) {
            assert_eq!(&b[..m.len()], &m[..]);
            assert!(
                b[m.len()..].iter().all(|&x| x == 0xAA),
                "bytes past the message untouched"
            );
        }
    }

    #[test]
    fn a_closed_peer_is_a_remote_error() {
        let net = NetSocket::new("lo", IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        let (s, mut r) = pair(&net);
        net.close_send(s).unwrap();
        let mut buf = [0u8; 8];
        // SAFETY: `buf` outlives the request.
        let mut req = unsafe { net.irecv(&mut r, buf.as_mut_ptr(), 8, 0) }
            .unwrap()
            .unwrap();
        let t = Instant::now();
        let e = loop {
            match net.test(&mut req) {
                Ok(None) => assert!(t.elapsed() < Duration::from_secs(10)),
                Ok(Some(n)) => panic!("received {n} bytes from a closed peer"),
                Err(e) => break e,
            }
        };
        assert!(matches!(e, Error::Remote(_)), "{e}");
        assert!(e.to_string().contains("end of stream"), "{e}");
        // The connection stays failed.
        // SAFETY: as above.
        assert!(unsafe { net.irecv(&mut r, buf.as_mut_ptr(), 8, 0) }.is_err());
    }

    #[test]
    fn oversized_message_and_foreign_greeting_are_refused() {
        let net = NetSocket::new("lo", IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        let (mut s, mut r) = pair(&net);
        let data = [7u8; 64];
        let mut small = [0u8; 16];
        // SAFETY: both buffers outlive the requests.
        let mut reqs = unsafe {
            vec![
                net.isend(&mut s, data.as_ptr(), 64, 0).unwrap().unwrap(),
                net.irecv(&mut r, small.as_mut_ptr(), 16, 0).unwrap().unwrap(),
            ]
        };
        let t = Instant::now();
        let mut sent = false;
        let e = loop {
            // Requests move only when tested: the send's too.
            if !sent {
                sent = net.test(&mut reqs[0]).unwrap().is_some();
            }
            match net.test(&mut reqs[1]) {
                Ok(None) => assert!(t.elapsed() < Duration::from_secs(10)),
                Ok(Some(n)) => panic!("a 64-byte message fit a 16-byte receive ({n})"),
                Err(e) => break e.to_string(),
            }
        };
        assert!(e.contains("64 bytes") && e.contains("at most 16 bytes"), "{e}");
        // A connection that does not greet with the handle's nonce is dropped.
        let (h, mut l) = net.listen(0).unwrap();
        let (addr, nonce, _) = decode_handle(&h).unwrap();
        let mut stray = TcpStream::connect(addr).unwrap();
        stray.write_all(&[0u8; HELLO_BYTES]).unwrap();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            assert!(net.accept(&mut l).unwrap().is_none());
        }
        // So is a complete connection whose greetings announce another data socket count (2
        // where the listener expects 1).
        let id = 77;
        let _socks: Vec<TcpStream> = (0..3u32)
            .map(|i| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(&hello(nonce, id, i, 2)).unwrap();
                s
            })
            .collect();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            assert!(net.accept(&mut l).unwrap().is_none());
        }
    }

    /// Bytes a connection carried: inline on the control socket, and per data socket.
    fn traffic(o: &mut Opaque) -> (u64, Vec<u64>) {
        let c = downcast::<Shared>(o, "conn").unwrap();
        let c = lock(c);
        (
            c.inline_bytes,
            c.data.iter().map(|d| d.bytes.load(Ordering::Relaxed)).collect(),
        )
    }

    fn streams(nthreads: u32, nsocks_per_thread: u32) -> NetSocket {
        NetSocket::new("lo", IpAddr::V4(Ipv4Addr::LOCALHOST), 0).with_streams(SocketStreams {
            nthreads,
            nsocks_per_thread,
        })
    }

    /// Sends every size of `sizes` (all posted at once, up to `MAX_REQUESTS`) and checks each
    /// arrives exactly, with its size reported on both ends.
    fn exchange(net: &NetSocket, s: &mut SendComm, r: &mut RecvComm, sizes: &[usize]) {
        for batch in sizes.chunks(MAX_REQUESTS / 2) {
            // Message k of size n: byte i = (i·131 + n + k) mod 251 (251 is prime, so a chunk
            // landing at the wrong offset or on the wrong message shows).
            let msgs: Vec<Vec<u8>> = batch
                .iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|i| ((i * 131 + n + k) % 251) as u8).collect())
                .collect();
            let mut bufs: Vec<Vec<u8>> = batch.iter().map(|&n| vec![0xEE; n + 8]).collect();
            let mut reqs = Vec::new();
            for (m, b) in msgs.iter().zip(bufs.iter_mut()) {
                // SAFETY: the buffers outlive the requests, which finish in `wait`.
                unsafe {
                    reqs.push(net.isend(s, m.as_ptr(), m.len(), 0).unwrap().unwrap());
                    reqs.push(net.irecv(r, b.as_mut_ptr(), b.len(), 0).unwrap().unwrap());
                }
            }
            let got = wait(net, &mut reqs);
            let want: Vec<usize> = batch.iter().flat_map(|&n| [n, n]).collect();
            assert_eq!(got, want, "sizes");
            for ((m, b), n) in msgs.iter().zip(&bufs).zip(batch) {
                assert!(b[..*n] == m[..], "{n}-byte message differs");
                assert_eq!(&b[*n..], &[0xEE; 8], "bytes past the {n}-byte message");
            }
        }
    }

    #[test]
    fn chunk_sizes_follow_nccl() {
        // max(64 KiB, ceil(size / nsocks)).
        assert_eq!(chunk_bytes(65537, 1), 65537);
        assert_eq!(chunk_bytes(65537, 4), 65536);
        assert_eq!(chunk_bytes(10 << 20, 64), 163840);
        assert_eq!(chunk_bytes((10 << 20) + 3, 64), 163841);
        assert_eq!(chunk_bytes(1 << 20, 64), 65536);
    }

    #[test]
    fn parallel_streams_carry_exact_data() {
        // Sizes: empty, 1 byte, around the 64 KiB chunk threshold, ones that split unevenly over
        // the data sockets, and 3 MiB + 7 (more than the socket buffers hold at once).
        let t = MIN_CHUNK_BYTES;
        let sizes = [
            0,
            1,
            13,
            t - 1,
            t,
            t + 1,
            2 * t - 1,
            2 * t + 1,
            200_003,
            4 * t + 5,
            (1 << 20) + 1,
            (3 << 20) + 7,
            0,
            1,
        ];
        for (nt, ns) in [(1, 1), (2, 2), (4, 16)] {
            let net = streams(nt, ns);
            let (mut s, mut r) = pair(&net);
            exchange(&net, &mut s, &mut r, &sizes);
            let (si, sd) = traffic(&mut s.0);
            let (ri, rd) = traffic(&mut r.0);
            assert_eq!(sd.len(), (nt * ns) as usize);
            assert_eq!((si, &sd), (ri, &rd), "both ends count the same bytes per socket");
            // Inline: the messages of at most 64 KiB: 0 + 1 + 13 + 65535 + 65536 + 0 + 1.
            assert_eq!(si, 131_086, "{nt}x{ns}");
            let big: usize = sizes.iter().filter(|&&n| n > t).sum();
            assert_eq!(sd.iter().sum::<u64>(), big as u64, "{nt}x{ns}");
            if nt * ns > 1 {
                assert!(
                    sd.iter().all(|&b| b > 0),
                    "{nt}x{ns}: an idle data socket: {sd:?}"
                );
            }
            net.close_send(s).unwrap();
            net.close_recv(r).unwrap();
        }
    }

    #[test]
    fn chunks_are_dealt_round_robin() {
        // 2 x 2 = 4 data sockets. 65537 bytes: chunks of max(65536, 16385) = 65536 → 65536 on
        // socket 0, 1 on socket 1. 200003 bytes: chunks of max(65536, 50001) = 65536 → sockets
        // 2, 3, 0 get 65536 each and socket 1 the last 3395. 100 bytes: inline.
        let net = streams(2, 2);
        let (mut s, mut r) = pair(&net);
        exchange(&net, &mut s, &mut r, &[65537, 100, 200_003]);
        assert_eq!(traffic(&mut r.0), (100, vec![131_072, 3396, 65536, 65536]));
        // 4 x 16 = 64 sockets, 10 MiB + 3 on a fresh connection: chunks of ceil(10485763 / 64) =
        // 163841; sockets 0..63 get one each, socket 63 the remaining 10485763 − 63·163841 =
        // 163780.
        let net = streams(4, 16);
        let (mut s, mut r) = pair(&net);
        exchange(&net, &mut s, &mut r, &[(10 << 20) + 3]);
        let mut want = vec![163_841u64; 64];
        want[63] = 163_780;
        assert_eq!(traffic(&mut s.0), (0, want));
    }

    #[test]
    fn the_connector_follows_the_listener_stream_count() {
        // NCCL's rule: the receiving (listening) side's socket count wins.
        let (one, four) = (streams(1, 1), streams(2, 2));
        let (mut s, mut r) = pair_with(&one, &four);
        assert_eq!(traffic(&mut s.0).1.len(), 4);
        assert_eq!(traffic(&mut r.0).1.len(), 4);
        exchange(&four, &mut s, &mut r, &[300_001, 5]);
        let (mut s, mut r) = pair_with(&four, &one);
        assert_eq!(traffic(&mut s.0).1.len(), 1);
        exchange(&one, &mut s, &mut r, &[300_001, 5]);
        assert_eq!(traffic(&mut r.0), (5, vec![300_001]));
    }

    #[test]
    fn closing_mid_message_stops_the_helpers() {
        // 32 MiB that no one receives: far more than the loopback socket buffers hold, so the
        // sender's helper thread is blocked writing when the receiving end closes.
        let n = 32 << 20;
        for (nt, ns) in [(1, 1), (2, 2)] {
            let net = streams(nt, ns);
            let (mut s, r) = pair(&net);
            let data = vec![5u8; n];
            // SAFETY: `data` outlives the connection, closed below (closing joins the helper
            // threads, so none touches it afterwards).
            let mut sr = unsafe { net.isend(&mut s, data.as_ptr(), n, 0) }
                .unwrap()
                .unwrap();
            // The size goes out and the chunks go to the helpers.
            assert_eq!(net.test(&mut sr).unwrap(), None);
            net.close_recv(r).unwrap();
            // The sender learns of it (reset or broken pipe), and closing it returns.
            let t = Instant::now();
            let e = loop {
                match net.test(&mut sr) {
                    Ok(None) => assert!(t.elapsed() < Duration::from_secs(10), "no failure"),
                    Ok(Some(got)) => panic!("{got} bytes went to a closed receiver"),
                    Err(e) => break e,
                }
            };
            assert!(matches!(e, Error::Remote(_)), "{nt}x{ns}: {e}");
            drop(sr);
            net.close_send(s).unwrap();
            assert!(t.elapsed() < Duration::from_secs(10));
        }
    }
}
