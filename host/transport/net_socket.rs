//! The socket network (NCCL's `transport/net_socket.cc` over `misc/socket.cc`): one TCP
//! connection per NET connection, non-blocking, messages framed by a 4-byte length, so the proxy
//! thread can progress every connection without blocking on any.
//!
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
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// First bytes of every handle and of every connection's hello.
const MAGIC: u64 = 0x4f58_4343_4c4e_4554; // "OXCCLNET"
/// Bytes of the hello a connector sends: magic, then the listener's nonce.
const HELLO_BYTES: usize = 16;
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
}

impl NetSocket {
    /// The socket network listening on `addr` (interface `ifname`, IPv6 scope `scope_id`).
    pub fn new(ifname: &str, addr: IpAddr, scope_id: u32) -> NetSocket {
        NetSocket {
            ifname: ifname.to_string(),
            addr,
            scope_id,
        }
    }

    /// The socket network from the environment: the interface `NCCL_SOCKET_IFNAME` (or
    /// `OXCCL_SOCKET_IFNAME`) selects, else the interface holding `fallback` (the bootstrap's
    /// address), else NCCL's default order.
    ///
    /// Errors: `InvalidUsage` naming the variable, its value and "no matching interface" when the
    /// filter matches no interface that is up; `System` when interfaces cannot be listed.
    pub fn from_env(fallback: Option<IpAddr>) -> Result<NetSocket> {
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
        tracing::debug!(target: "oxccl::net", iface = %i.name, addr = %i.addr, "socket network interface");
        Ok(NetSocket::new(&i.name, i.addr, i.scope_id))
    }

    /// The address listeners bind to.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }
}

/// Encodes a listen address and nonce into a handle.
fn encode_handle(addr: &SocketAddr, nonce: u64) -> NetHandle {
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
    h
}

/// Decodes a handle; `None` when it is not a socket network handle.
fn decode_handle(h: &NetHandle) -> Option<(SocketAddr, u64)> {
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
    Some((addr, word(8..16)))
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

/// A listener and the nonce its connections must present.
struct SockListen {
    listener: TcpListener,
    nonce: u64,
    addr: SocketAddr,
}

/// Completion state of one request, shared between the request and its connection's queue.
#[derive(Default)]
struct Slot {
    done: AtomicBool,
    size: AtomicUsize,
}

/// One queued send or receive.
struct Pending {
    slot: Arc<Slot>,
    send: bool,
    /// Address of the data (send) or of the posted buffer (receive).
    ptr: usize,
    /// Bytes to send, or bytes of the posted buffer.
    cap: usize,
    /// The 4-byte little-endian length prefix (written for sends, read for receives).
    len: [u8; 4],
    len_done: usize,
    /// Message bytes (sends: `cap`; receives: from the prefix).
    size: usize,
    done: usize,
}

/// One established connection: its stream and its queue of requests, progressed in order.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    queue: VecDeque<Pending>,
    /// Set when the connection failed; every later request fails with it.
    failed: Option<String>,
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

impl Conn {
    /// Moves the queue forward as far as the socket allows without blocking.
    fn progress(&mut self) -> std::result::Result<(), String> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let r = self.progress_inner();
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        r
    }

    fn progress_inner(&mut self) -> std::result::Result<(), String> {
        let peer = self.peer;
        while let Some(p) = self.queue.front_mut() {
            let io = if p.send {
                send_some(&mut self.stream, p)
            } else {
                recv_some(&mut self.stream, p)
            };
            match io {
                Ok(true) => {
                    p.slot.size.store(p.size, Ordering::Relaxed);
                    p.slot.done.store(true, Ordering::Release);
                    self.queue.pop_front();
                }
                Ok(false) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::InvalidData => {
                    return Err(format!("socket network: connection with {peer}: {e}"));
                }
                Err(e) => return Err(lost(&peer, &e)),
            }
        }
        Ok(())
    }
}

/// Writes as much of `p` as the socket takes; `Ok(true)` once all of it is written.
fn send_some(s: &mut TcpStream, p: &mut Pending) -> std::io::Result<bool> {
    loop {
        if p.len_done == 4 && p.done == p.size {
            return Ok(true);
        }
        // SAFETY: `isend`'s contract keeps `ptr..ptr+size` valid and unchanged until done.
        let data = unsafe { std::slice::from_raw_parts(p.ptr as *const u8, p.size) };
        let bufs = [IoSlice::new(&p.len[p.len_done..]), IoSlice::new(&data[p.done..])];
        match s.write_vectored(&bufs) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(mut n) => {
                let h = n.min(4 - p.len_done);
                p.len_done += h;
                n -= h;
                p.done += n;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Reads as much of `p`'s message as has arrived; `Ok(true)` once all of it is in.
fn recv_some(s: &mut TcpStream, p: &mut Pending) -> std::io::Result<bool> {
    loop {
        let r = if p.len_done < 4 {
            s.read(&mut p.len[p.len_done..])
        } else if p.done < p.size {
            // SAFETY: `irecv`'s contract keeps `ptr..ptr+cap` valid and ours until done, and
            // `size <= cap` was checked when the prefix arrived.
            let buf = unsafe { std::slice::from_raw_parts_mut(p.ptr as *mut u8, p.size) };
            s.read(&mut buf[p.done..])
        } else {
            return Ok(true);
        };
        match r {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) if p.len_done < 4 => {
                p.len_done += n;
                if p.len_done == 4 {
                    p.size = u32::from_le_bytes(p.len) as usize;
                    if p.size > p.cap {
                        return Err(std::io::Error::new(
                            ErrorKind::InvalidData,
                            format!(
                                "a message of {} bytes arrived for a receive of at most {} bytes",
                                p.size, p.cap
                            ),
                        ));
                    }
                }
            }
            Ok(n) => p.done += n,
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
        if c.queue.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let slot = Arc::new(Slot::default());
        c.queue.push_back(Pending {
            slot: slot.clone(),
            send,
            ptr,
            cap,
            len: if send { (cap as u32).to_le_bytes() } else { [0; 4] },
            len_done: 0,
            size: if send { cap } else { 0 },
            done: 0,
        });
        drop(c);
        Ok(Some(Request(Opaque(Box::new(SockRequest {
            conn: conn.clone(),
            slot,
        })))))
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
        tracing::trace!(target: "oxccl::net", %addr, "socket network: listening");
        Ok((
            encode_handle(&addr, nonce),
            ListenComm(Opaque(Box::new(SockListen {
                listener,
                nonce,
                addr,
            }))),
        ))
    }

    fn connect(&self, _dev: usize, handle: &NetHandle) -> Result<Option<SendComm>> {
        let (addr, nonce) = decode_handle(handle).ok_or_else(|| {
            Error::InvalidUsage(
                "socket network: connect was given a handle the socket network did not make".into(),
            )
        })?;
        let mut stream = match TcpStream::connect_timeout(&addr, CONNECT_ATTEMPT) {
            Ok(s) => s,
            Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::Interrupted) => return Ok(None),
            Err(e) => {
                return Err(Error::Remote(format!(
                    "socket network: connecting to {addr}: {e}"
                )));
            }
        };
        let mut hello = [0u8; HELLO_BYTES];
        hello[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        hello[8..16].copy_from_slice(&nonce.to_le_bytes());
        stream
            .write_all(&hello)
            .map_err(|e| Error::Remote(format!("socket network: greeting {addr}: {e}")))?;
        prepare(&stream, &addr)?;
        Ok(Some(SendComm(Opaque(Box::new(Arc::new(Mutex::new(Conn {
            stream,
            peer: addr,
            queue: VecDeque::new(),
            failed: None,
        })))))))
    }

    fn accept(&self, listen: &mut ListenComm) -> Result<Option<RecvComm>> {
        let l = downcast::<SockListen>(&mut listen.0, "the listener")?;
        let (mut stream, peer) = match l.listener.accept() {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => return Ok(None),
            Err(e) => {
                return Err(Error::System(format!(
                    "socket network: accepting on {}: {e}",
                    l.addr
                )));
            }
        };
        let mut hello = [0u8; HELLO_BYTES];
        let greeted = stream
            .set_nonblocking(false)
            .and_then(|_| stream.set_read_timeout(Some(HELLO_WAIT)))
            .and_then(|_| stream.read_exact(&mut hello));
        let ok =
            greeted.is_ok() && hello[0..8] == MAGIC.to_le_bytes() && hello[8..16] == l.nonce.to_le_bytes();
        if !ok {
            tracing::warn!(target: "oxccl::net", %peer, listen = %l.addr,
                "socket network: dropped a connection without the expected greeting ({greeted:?})");
            return Ok(None);
        }
        stream
            .set_read_timeout(None)
            .map_err(|e| Error::System(format!("socket network: connection from {peer}: {e}")))?;
        prepare(&stream, &peer)?;
        Ok(Some(RecvComm(Opaque(Box::new(Arc::new(Mutex::new(Conn {
            stream,
            peer,
            queue: VecDeque::new(),
            failed: None,
        })))))))
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

    fn close_send(&self, comm: SendComm) -> Result<()> {
        drop(comm);
        Ok(())
    }

    fn close_recv(&self, comm: RecvComm) -> Result<()> {
        drop(comm);
        Ok(())
    }

    fn close_listen(&self, comm: ListenComm) -> Result<()> {
        drop(comm);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn pair(net: &NetSocket) -> (SendComm, RecvComm) {
        let (h, mut l) = net.listen(0).unwrap();
        let s = net.connect(0, &h).unwrap().expect("connected");
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
            assert_eq!(decode_handle(&encode_handle(&addr, 0xfeed)), Some((addr, 0xfeed)));
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
        let (addr, _) = decode_handle(&h).unwrap();
        let mut stray = TcpStream::connect(addr).unwrap();
        stray.write_all(&[0u8; HELLO_BYTES]).unwrap();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            assert!(net.accept(&mut l).unwrap().is_none());
        }
    }
}
