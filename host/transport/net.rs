//! The network interface of the NET transport (NCCL's `ncclNet_t`, `src/include/net.h` and
//! `ext-net/…/net_v8.h`): a connection-oriented, non-blocking message layer the proxy thread
//! drives. oxccl's built-in implementation is the socket network ([`super::net_socket`]); an
//! NCCL network plugin can replace it through the same trait ([`super::plugin`]).
//!
//! The calls mirror NCCL's one for one:
//!
//! | oxccl | NCCL (`ncclNet_v8_t`) |
//! |---|---|
//! | [`Net::devices`], [`Net::properties`] | `devices`, `getProperties` |
//! | [`Net::listen`] → ([`NetHandle`], [`ListenComm`]) | `listen(dev, handle, &listenComm)` |
//! | [`Net::connect`] → [`SendComm`] | `connect(dev, handle, &sendComm, &sendDevComm)` |
//! | [`Net::accept`] → [`RecvComm`] | `accept(listenComm, &recvComm, &recvDevComm)` |
//! | [`Net::reg_mr_send`], [`Net::reg_mr_recv`] | `regMr(comm, data, size, NCCL_PTR_HOST, &mhandle)` |
//! | [`Net::isend`] / [`Net::irecv`] → [`Request`] | `isend` / `irecv` (one buffer, `n == 1`) |
//! | [`Net::test`] | `test(request, &done, &size)` |
//! | [`Net::close_send`], [`Net::close_recv`], [`Net::close_listen`] | `closeSend`, `closeRecv`, `closeListen` |
//!
//! Every call returns at once: `connect`, `accept`, `isend` and `irecv` may answer `Ok(None)`
//! ("not yet, call again"), and a request completes only through [`Net::test`]. Messages are
//! delivered in order per connection; a receive gets exactly one message, whose size may be
//! smaller than the posted buffer.
use crate::error::Result;
use std::any::Any;

/// Bytes of a connection handle (NCCL's `NCCL_NET_HANDLE_MAXSIZE`): what a listener publishes
/// through the bootstrap so that the peer can connect.
pub const NET_HANDLE_BYTES: usize = 128;

/// A listener's connection handle ([`NET_HANDLE_BYTES`] opaque bytes).
pub type NetHandle = [u8; NET_HANDLE_BYTES];

/// What a network device offers (a subset of NCCL's `ncclNetProperties_v8_t`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetProperties {
    /// Device name, e.g. the interface (`eth0`).
    pub name: String,
    /// Link speed in Mbit/s (0 when unknown).
    pub speed_mbps: u32,
    /// Most concurrent requests per connection the device accepts.
    pub max_requests: usize,
}

/// An opaque object of a network: the network creates it and is the only one to look inside.
pub struct Opaque(pub Box<dyn Any + Send>);

impl std::fmt::Debug for Opaque {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Opaque")
    }
}

/// A listening endpoint (NCCL's `listenComm`).
#[derive(Debug)]
pub struct ListenComm(pub Opaque);
/// The sending end of a connection (NCCL's `sendComm`).
#[derive(Debug)]
pub struct SendComm(pub Opaque);
/// The receiving end of a connection (NCCL's `recvComm`).
#[derive(Debug)]
pub struct RecvComm(pub Opaque);
/// An outstanding `isend`/`irecv` (NCCL's `request`). Dropping an unfinished request abandons it
/// only together with its connection (close the connection).
#[derive(Debug)]
pub struct Request(pub Opaque);

/// A network (NCCL's `ncclNet_t`). Implementations are `Send + Sync`; the proxy thread calls the
/// data-path methods (`isend`, `irecv`, `test`) of a connection from one thread at a time.
///
/// Errors are [`crate::Error::Remote`] for a lost peer (end of stream, reset, timeout) and
/// [`crate::Error::System`] for local failures; messages name the peer address where known.
pub trait Net: Send + Sync {
    /// The network's name (NCCL's `name`: `"Socket"`, `"IB"`, a plugin's name), as `NCCL_NET`
    /// selects it (case-insensitively).
    fn name(&self) -> &str;
    /// Number of devices (NICs) this network drives (NCCL's `devices`).
    fn devices(&self) -> Result<usize>;
    /// Properties of device `dev` (NCCL's `getProperties`).
    fn properties(&self, dev: usize) -> Result<NetProperties>;
    /// Starts listening on device `dev`; the handle goes to the peer that will connect (NCCL's
    /// `listen`).
    fn listen(&self, dev: usize) -> Result<(NetHandle, ListenComm)>;
    /// Connects to the listener behind `handle` from device `dev` (NCCL's `connect`); `Ok(None)`:
    /// call again.
    fn connect(&self, dev: usize, handle: &NetHandle) -> Result<Option<SendComm>>;
    /// Accepts the next connection of `listen` (NCCL's `accept`); `Ok(None)`: call again.
    fn accept(&self, listen: &mut ListenComm) -> Result<Option<RecvComm>>;
    /// Registers `size` bytes of host memory at `data` for the transfers of `comm` (NCCL's `regMr`
    /// with `NCCL_PTR_HOST`), until the connection is closed. Registering is optional for the
    /// caller: a network whose `isend` needs registered memory handles unregistered buffers
    /// itself, only more slowly. The default does nothing (the socket network needs no
    /// registration).
    ///
    /// Errors: the network's (e.g. a plugin's `regMr` failing).
    ///
    /// # Safety
    /// `data..data+size` stays valid until `comm` is closed.
    unsafe fn reg_mr_send(&self, comm: &mut SendComm, data: *const u8, size: usize) -> Result<()> {
        let _ = (comm, data, size);
        Ok(())
    }
    /// [`Net::reg_mr_send`] for a receiving end.
    ///
    /// # Safety
    /// `data..data+size` stays valid until `comm` is closed.
    unsafe fn reg_mr_recv(&self, comm: &mut RecvComm, data: *mut u8, size: usize) -> Result<()> {
        let _ = (comm, data, size);
        Ok(())
    }
    /// Posts a send of `size` bytes at `data` (NCCL's `isend`); `Ok(None)`: busy, post again later.
    ///
    /// # Safety
    /// `data..data+size` stays valid and unchanged until [`Net::test`] reports the request done
    /// or the connection is closed.
    unsafe fn isend(
        &self,
        comm: &mut SendComm,
        data: *const u8,
        size: usize,
        tag: u32,
    ) -> Result<Option<Request>>;
    /// Posts a receive of at most `size` bytes into `data` (NCCL's `irecv` with one buffer);
    /// `Ok(None)`: busy, post again later.
    ///
    /// # Safety
    /// `data..data+size` stays valid, and is neither read nor written by anyone else, until
    /// [`Net::test`] reports the request done or the connection is closed.
    unsafe fn irecv(
        &self,
        comm: &mut RecvComm,
        data: *mut u8,
        size: usize,
        tag: u32,
    ) -> Result<Option<Request>>;
    /// Progresses `req` (NCCL's `test`): `Ok(Some(bytes))` once done (bytes sent or received),
    /// `Ok(None)` while pending. A done request must not be tested again.
    fn test(&self, req: &mut Request) -> Result<Option<usize>>;
    /// Whether the receiving end of `comm` is still there, for a connection with nothing to
    /// send (not in NCCL's API: oxccl's proxy asks it of idle send connections, so that a rank
    /// that only sends to a peer that died or closed learns of it without posting data). `Err`
    /// ([`crate::Error::Remote`]) when the network knows the peer is gone; the default, for
    /// networks that cannot tell (plugins), is `Ok(())` — a lost peer then shows at the next
    /// `isend`.
    fn check_send(&self, comm: &mut SendComm) -> Result<()> {
        let _ = comm;
        Ok(())
    }
    /// Closes a sending end (NCCL's `closeSend`).
    fn close_send(&self, comm: SendComm) -> Result<()>;
    /// Closes a receiving end (NCCL's `closeRecv`).
    fn close_recv(&self, comm: RecvComm) -> Result<()>;
    /// Closes a listener (NCCL's `closeListen`).
    fn close_listen(&self, comm: ListenComm) -> Result<()>;
}
