//! Loopback ports that stay a test's own while it runs.
//!
//! Binding port 0 and dropping the listener frees the port at once: a test running beside it in
//! the same binary (or another process) can be given the same port for its bootstrap root, and a
//! connection meant for a closed port then reaches that root. [`ReservedPort`] keeps a TCP socket
//! bound to the port and never listens on it, which
//! - refuses every connection to the port (no listener: the kernel answers with a reset), and
//! - keeps the port out of every automatic choice (binding port 0, an outgoing connection's
//!   local port) while it lives,
//! - yet lets a listener that asks for exactly this port bind it: the socket has `SO_REUSEADDR`,
//!   as Rust's `TcpListener::bind` (which oxccl's bootstrap root uses) does, and Linux lets two
//!   such sockets share an address when neither listens yet.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A 127.0.0.1 TCP port held (bound, not listening) until this value drops.
pub struct ReservedPort {
    /// Held only to keep the port bound.
    _fd: OwnedFd,
    port: u16,
}

impl ReservedPort {
    /// Binds 127.0.0.1:0 with `SO_REUSEADDR` and keeps the socket.
    pub fn new() -> ReservedPort {
        // SAFETY: plain socket creation; the result is checked before use.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(raw >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let one: libc::c_int = 1;
        // SAFETY: the option value points at a live c_int of the given size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_REUSEADDR: {}", std::io::Error::last_os_error());
        // SAFETY: sockaddr_in is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        addr.sin_port = 0;
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: `addr` is a sockaddr_in and `len` its size; bind only reads it.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_in).cast(),
                len,
            )
        };
        assert_eq!(rc, 0, "bind 127.0.0.1:0: {}", std::io::Error::last_os_error());
        // SAFETY: getsockname writes at most `len` bytes into `addr` and updates `len`.
        let rc = unsafe {
            libc::getsockname(
                fd.as_raw_fd(),
                (&mut addr as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
        ReservedPort {
            _fd: fd,
            port: u16::from_be(addr.sin_port),
        }
    }

    /// The port number.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}
