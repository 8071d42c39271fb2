//! The bootstrap network (NCCL's `src/bootstrap.cc` over `src/misc/socket.cc`): a unique id,
//! a root that introduces the ranks to each other, a ring of TCP connections between ranks, and
//! the small collectives and point-to-point messages the rest of init needs before any GPU
//! transport exists.
//!
//! 1. One process calls [`get_unique_id`]: it picks an interface, starts the root thread
//!    listening there (NCCL's `bootstrapRoot`) and returns a [`UniqueId`] holding the root's
//!    address and a random secret. With `NCCL_COMM_ID=host:port` (or `OXCCL_COMM_ID`) every
//!    process computes the id from the variable instead, and rank 0's [`Bootstrap::init`] starts
//!    the root on that address (as NCCL's `ncclCommInitRank` does).
//! 2. Every rank calls [`Bootstrap::init`]: it opens its own listener, registers (secret, rank,
//!    nranks, listen address) with the root, learns its ring successor's address, connects to the
//!    successor and accepts its predecessor, then all-gathers every rank's listen address over
//!    the ring.
//! 3. Afterwards: [`Bootstrap::allgather`] and [`Bootstrap::barrier`] run over the ring;
//!    [`Bootstrap::send`] / [`Bootstrap::recv`] connect on demand to the peer's listener, whose
//!    background thread files incoming messages by (source rank, tag).
//!
//! Every connect (with its retries), accept and receive is bounded by the bootstrap timeout
//! ([`BootstrapConfig::timeout`], `OXCCL_BOOTSTRAP_TIMEOUT` seconds, default 120). Every
//! connection must open with the id's secret; junk, foreign secrets and oversized lengths are
//! dropped and logged (target `oxccl::bootstrap`) without disturbing the others. Lengths are
//! checked against [`MAX_MESSAGE_BYTES`] before anything is allocated.
mod ifaces;
mod local;
mod root;
mod socket;
mod unique_id;

use local::LocalLink;
pub use ifaces::{IfFilter, Interface, list_interfaces, select as select_interface};
pub use unique_id::{UNIQUE_ID_BYTES, UniqueId};

use crate::error::{Error, Result, ResultCode};
use crate::params::env_var;
use crossbeam_channel::Sender;
use socket::{ACK, ADDR_BYTES, CONTROL_MAX_BYTES, Event, Header, Incoming, Kind, Server};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest blob of one rank in [`Bootstrap::allgather`] and largest [`Bootstrap::send`]
/// message, in bytes (1 GiB). Incoming lengths above it are refused before allocating.
pub const MAX_MESSAGE_BYTES: u64 = 1 << 30;
/// Largest nranks the bootstrap accepts (2^20 ranks).
pub const MAX_NRANKS: usize = 1 << 20;
/// Prefix of a rank's record in [`Bootstrap::allgather_checked`] when that rank failed (its
/// error follows).
const FAILED_PREFIX: &str = "ERR ";
/// Default of [`BootstrapConfig::timeout`]: 120 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest accepted `OXCCL_BOOTSTRAP_TIMEOUT`, in seconds (about 11.6 days).
pub const MAX_TIMEOUT_SECS: f64 = 1e6;

/// Bootstrap settings, normally from the environment ([`BootstrapConfig::from_env`]); tests and
/// embedders can fill one in directly.
#[derive(Clone, Debug, PartialEq)]
pub struct BootstrapConfig {
    /// Bound on every connect (retries included), accept and receive of the bootstrap
    /// (`OXCCL_BOOTSTRAP_TIMEOUT` / `NCCL_BOOTSTRAP_TIMEOUT`, in seconds; default 120 s).
    pub timeout: Duration,
    /// Interfaces to listen on, NCCL syntax (`NCCL_SOCKET_IFNAME` / `OXCCL_SOCKET_IFNAME`; see
    /// [`IfFilter`]). `None`: NCCL's default order (see [`select_interface`]).
    pub ifname: Option<String>,
    /// The variable `ifname` came from, for error messages (default `NCCL_SOCKET_IFNAME`).
    pub ifname_var: String,
    /// Fixed root address (`NCCL_COMM_ID` / `OXCCL_COMM_ID`, `host:port`): ids are computed
    /// from it and rank 0 starts the root. `None`: [`get_unique_id`] starts the root.
    pub comm_id: Option<SocketAddr>,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            timeout: DEFAULT_TIMEOUT,
            ifname: None,
            ifname_var: "NCCL_SOCKET_IFNAME".into(),
            comm_id: None,
        }
    }
}

impl BootstrapConfig {
    /// Reads `BOOTSTRAP_TIMEOUT`, `SOCKET_IFNAME` and `COMM_ID` under their `OXCCL_` or `NCCL_`
    /// names. Bad values give [`Error::InvalidArgument`] naming the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(env_var)
    }

    /// As [`BootstrapConfig::from_env`], with the variables given by `get` (name without prefix
    /// → (full name, value)).
    pub fn from_lookup(get: impl Fn(&str) -> Option<(String, String)>) -> Result<Self> {
        let mut c = BootstrapConfig::default();
        if let Some((key, v)) = get("BOOTSTRAP_TIMEOUT") {
            let accepted = format!("accepted: seconds, > 0 and <= {MAX_TIMEOUT_SECS}");
            let s: f64 = v.trim().parse().map_err(|_| {
                Error::invalid(format!("{key}={v:?} is not a number of seconds ({accepted})"))
            })?;
            if !(s > 0.0 && s <= MAX_TIMEOUT_SECS) {
                return Err(Error::invalid(format!(
                    "{key}={v:?} is out of range ({accepted})"
                )));
            }
            c.timeout = Duration::from_secs_f64(s);
        }
        if let Some((key, v)) = get("SOCKET_IFNAME")
            && !v.trim().is_empty()
        {
            c.ifname = Some(v);
            c.ifname_var = key;
        }
        if let Some((key, v)) = get("COMM_ID") {
            c.comm_id = Some(unique_id::parse_comm_id(&key, &v)?);
        }
        tracing::debug!(target: "oxccl::bootstrap", config = ?c, "bootstrap configuration");
        Ok(c)
    }

    /// The interface to listen on; `near` is the root's address when known.
    fn interface(&self, near: Option<IpAddr>) -> Result<Interface> {
        let ifs = list_interfaces()?;
        ifaces::select(
            &ifs,
            self.ifname.as_deref().map(|v| (self.ifname_var.as_str(), v)),
            near,
        )
    }
}

/// 64 random bits for an id's secret, from the OS (`/dev/urandom`), else from std's randomly
/// keyed hasher mixed with the time and process id.
fn random_secret() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Makes a unique id under the environment's settings (NCCL's `ncclGetUniqueId`): see
/// [`get_unique_id_with`].
pub fn get_unique_id() -> Result<UniqueId> {
    get_unique_id_with(&BootstrapConfig::from_env()?)
}

/// Makes a unique id (NCCL's `bootstrapGetUniqueId`). With `cfg.comm_id` set, the id is computed
/// from that address and no root starts here (rank 0's init starts it). Otherwise a root thread
/// starts listening on the chosen interface, on a free port; it serves one bootstrap and exits
/// (or gives up after `cfg.timeout` without a registration).
pub fn get_unique_id_with(cfg: &BootstrapConfig) -> Result<UniqueId> {
    if let Some(addr) = cfg.comm_id {
        tracing::info!(target: "oxccl::bootstrap", %addr, "unique id from NCCL_COMM_ID; rank 0 will start the root");
        return Ok(UniqueId::new(addr, unique_id::COMM_ID_SECRET, true));
    }
    let iface = cfg.interface(None)?;
    let secret = random_secret();
    let root = root::spawn(iface.socket_addr(0), secret, cfg.timeout)?;
    Ok(UniqueId::new(root, secret, false))
}

/// Messages received by a rank's listener thread, by (source rank, tag), in arrival order.
#[derive(Default)]
struct Mailbox {
    state: Mutex<MailboxState>,
    cond: Condvar,
}

#[derive(Default)]
struct MailboxState {
    queues: HashMap<(usize, u32), VecDeque<Vec<u8>>>,
    /// Set when the listener thread stopped on an error.
    failed: Option<String>,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, MailboxState> {
        // A panic while holding the lock cannot leave the queues half-updated; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, src: usize, tag: u32, data: Vec<u8>) {
        self.lock().queues.entry((src, tag)).or_default().push_back(data);
        self.cond.notify_all();
    }

    fn fail(&self, why: String) {
        self.lock().failed = Some(why);
        self.cond.notify_all();
    }
}

/// The ring connections: to the successor (`next`) and from the predecessor (`prev`).
struct Ring {
    next: TcpStream,
    prev: TcpStream,
    /// Number of ring collectives so far; both sides check it, so mismatched calls are caught.
    seq: u32,
}

/// Bytes of a ring frame header: sequence u32, blob's rank u32, length u64.
const FRAME_BYTES: usize = 16;
/// Frames up to this size are written before reading (they fit in the socket buffers); larger
/// ones are written from a second thread so that no rank blocks with a full send buffer.
const INLINE_FRAME_BYTES: usize = 4096;

/// One rank's bootstrap state (NCCL's `bootstrapState`): the ring, every rank's listen address,
/// and the listener thread that receives point-to-point messages. Dropping it stops the thread
/// and closes every connection.
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    secret: u64,
    timeout: Duration,
    /// Every rank's listen address, by rank (empty for an in-process bootstrap).
    addrs: Vec<SocketAddr>,
    /// The TCP ring (`None` for an in-process bootstrap).
    ring: Option<Mutex<Ring>>,
    /// Where this rank's point-to-point messages are filed.
    mailbox: Arc<Mailbox>,
    /// The ranks of an in-process bootstrap ([`Bootstrap::in_process`]).
    local: Option<LocalLink>,
    /// Dropping this wakes the listener thread, which then exits.
    wake: Option<UnixStream>,
    listener: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("addrs", &self.addrs)
            .finish_non_exhaustive()
    }
}

fn check_rank(what: &str, rank: usize, nranks: usize) -> Result<()> {
    if rank >= nranks {
        return Err(Error::invalid(format!(
            "{what} {rank} is out of range (accepted: 0..{nranks}, i.e. 0..={} for nranks {nranks})",
            nranks.saturating_sub(1)
        )));
    }
    Ok(())
}

fn check_len(what: &str, len: usize) -> Result<()> {
    if len as u64 > MAX_MESSAGE_BYTES {
        return Err(Error::invalid(format!(
            "{what} of {len} bytes exceeds the bootstrap limit of {MAX_MESSAGE_BYTES} bytes"
        )));
    }
    Ok(())
}

impl Bootstrap {
    /// Joins the bootstrap of `id` as `rank` of `nranks`, with settings from the environment
    /// (NCCL's `bootstrapInit`): see [`Bootstrap::init_with`].
    pub fn init(id: &UniqueId, rank: usize, nranks: usize) -> Result<Bootstrap> {
        Bootstrap::init_with(id, rank, nranks, &BootstrapConfig::from_env()?)
    }

    /// Joins the bootstrap of `id` as `rank` of `nranks` (NCCL's `bootstrapInit`): opens a
    /// listener, registers with the root (started here when `id` says rank 0 does it), connects
    /// the ring and all-gathers the listen addresses. Every step is bounded by `cfg.timeout`.
    ///
    /// Errors: `nranks` outside 1..=[`MAX_NRANKS`] or `rank` outside 0..nranks, or a corrupt id:
    /// [`Error::InvalidArgument`]; an unreachable root: [`Error::Remote`] naming its address and
    /// the OS reason; no answer in time: [`Error::Timeout`]; a disagreement among ranks reported
    /// by the root (nranks mismatch, duplicate rank): [`Error::InvalidUsage`].
    pub fn init_with(id: &UniqueId, rank: usize, nranks: usize, cfg: &BootstrapConfig) -> Result<Bootstrap> {
        if nranks == 0 || nranks > MAX_NRANKS {
            return Err(Error::invalid(format!(
                "nranks {nranks} is out of range (accepted: 1..={MAX_NRANKS})"
            )));
        }
        check_rank("rank", rank, nranks)?;
        id.validate()?;
        let t0 = Instant::now();
        let timeout = cfg.timeout;
        let secret = id.secret();
        let root_addr = id.root_addr();
        let span = tracing::debug_span!(target: "oxccl::bootstrap", "bootstrap_init", rank, nranks);
        let _enter = span.enter();

        // My listener, on the interface that reaches the root (or the one the user named).
        let iface = cfg.interface(Some(root_addr.ip()))?;
        if id.root_on_rank0() && rank == 0 {
            root::spawn(root_addr, secret, timeout)?;
        }
        let listener = TcpListener::bind(iface.socket_addr(0)).map_err(|e| {
            Error::System(format!(
                "bootstrap: rank {rank}: cannot listen on {} ({}): {e}",
                iface.addr, iface.name
            ))
        })?;
        let my_addr = listener
            .local_addr()
            .map_err(|e| Error::System(format!("bootstrap: rank {rank}: listener address: {e}")))?;
        let (wake, wake_rx) = UnixStream::pair()
            .map_err(|e| Error::System(format!("bootstrap: rank {rank}: socketpair: {e}")))?;
        let (ring_tx, ring_rx) = crossbeam_channel::bounded::<(usize, TcpStream)>(4);
        let mailbox = Arc::new(Mailbox::default());
        let listener = spawn_listener(
            listener,
            wake_rx,
            secret,
            rank,
            nranks,
            timeout,
            ring_tx,
            mailbox.clone(),
        )?;
        let mut partial = Partial {
            wake: Some(wake),
            listener: Some(listener),
        };

        // Register with the root; its answer is my successor's address.
        let deadline = Instant::now() + timeout;
        let mut root = socket::connect(root_addr, deadline, "the bootstrap root")?;
        let reg = Header {
            kind: Kind::Register,
            secret,
            rank: rank as u32,
            nranks: nranks as u32,
            tag: 0,
            len: ADDR_BYTES as u64,
        };
        socket::write_message(
            &mut root,
            &reg,
            &socket::encode_addr(&my_addr),
            deadline,
            "registering with the root",
        )?;
        let deadline = Instant::now() + timeout;
        let what = format!("waiting for the root ({root_addr}) to introduce rank {rank}'s ring successor");
        let (h, payload) = socket::read_message(&mut root, secret, CONTROL_MAX_BYTES, deadline, &what)?;
        drop(root);
        let next = (rank + 1) % nranks;
        let prev = (rank + nranks - 1) % nranks;
        let next_addr = match h.kind {
            Kind::RootNext if h.rank as usize == next => socket::decode_addr(&payload).ok_or_else(|| {
                Error::Remote(format!("bootstrap: rank {rank}: the root sent a bad address"))
            })?,
            Kind::RootError => {
                let msg = format!(
                    "bootstrap root at {root_addr}: {}",
                    String::from_utf8_lossy(&payload)
                );
                return Err(match h.tag {
                    t if t == ResultCode::InvalidArgument as u32 => Error::InvalidArgument(msg),
                    t if t == ResultCode::InvalidUsage as u32 => Error::InvalidUsage(msg),
                    _ => Error::Remote(msg),
                });
            }
            k => {
                return Err(Error::Remote(format!(
                    "bootstrap: rank {rank}: unexpected answer from the root ({k:?} about rank {})",
                    h.rank
                )));
            }
        };

        // The ring: connect to my successor, accept my predecessor (through the listener thread).
        let deadline = Instant::now() + timeout;
        let mut next_s = socket::connect(next_addr, deadline, &format!("rank {next} (ring successor)"))?;
        let ring_hello = Header {
            kind: Kind::Ring,
            secret,
            rank: rank as u32,
            nranks: nranks as u32,
            tag: 0,
            len: 0,
        };
        socket::write_message(
            &mut next_s,
            &ring_hello,
            &[],
            deadline,
            &format!("ring connect to rank {next}"),
        )?;
        let prev_s = match ring_rx.recv_deadline(Instant::now() + timeout) {
            Ok((r, s)) if r == prev => s,
            Ok((r, _)) => {
                return Err(Error::Internal(format!(
                    "bootstrap: rank {rank}: ring connection from rank {r}, expected rank {prev}"
                )));
            }
            Err(_) => {
                return Err(Error::Timeout(format!(
                    "bootstrap: rank {rank}: ring predecessor rank {prev} did not connect within {:.1} s",
                    timeout.as_secs_f64()
                )));
            }
        };
        drop(ring_rx);

        let mut bs = Bootstrap {
            rank,
            nranks,
            secret,
            timeout,
            addrs: Vec::new(),
            ring: Some(Mutex::new(Ring {
                next: next_s,
                prev: prev_s,
                seq: 0,
            })),
            mailbox,
            local: None,
            wake: partial.wake.take(),
            listener: partial.listener.take(),
        };
        // Every rank's listen address, for point-to-point messages (NCCL's ringAllInfo).
        let all = bs.allgather(&socket::encode_addr(&my_addr))?;
        for (r, a) in all.iter().enumerate() {
            let addr = socket::decode_addr(a).ok_or_else(|| {
                Error::Remote(format!(
                    "bootstrap: rank {rank}: rank {r} sent a bad listen address"
                ))
            })?;
            bs.addrs.push(addr);
        }
        tracing::info!(target: "oxccl::bootstrap", rank, nranks, listen = %my_addr, iface = %iface.name,
            "bootstrap ready in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
        Ok(bs)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Every rank's bootstrap listen address, by rank.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The bootstrap timeout this rank uses.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// True for the ranks of [`Bootstrap::in_process`].
    pub fn is_in_process(&self) -> bool {
        self.local.is_some()
    }

    /// Ring all-gather (NCCL's `bootstrapAllGather`): every rank contributes `mine` (any length
    /// up to [`MAX_MESSAGE_BYTES`]; ranks may differ) and gets every rank's blob, indexed by rank.
    /// nranks − 1 steps; in step s a rank forwards the blob of rank (rank − s) to its successor
    /// and receives the blob of rank (rank − s − 1) from its predecessor. Every rank must make
    /// the same sequence of `allgather`/`barrier` calls.
    pub fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        check_len("allgather contribution", mine.len())?;
        let (rank, n) = (self.rank, self.nranks);
        let ring = match (&self.ring, &self.local) {
            (_, Some(l)) => return l.allgather(self, mine),
            (Some(r), None) => r,
            (None, None) => return Err(Error::Internal("bootstrap without a ring".into())),
        };
        // The ring is only ever advanced frame by frame; a panic elsewhere cannot corrupt it.
        let mut ring = ring.lock().unwrap_or_else(|p| p.into_inner());
        let seq = ring.seq;
        ring.seq = ring.seq.wrapping_add(1);
        let mut out: Vec<Vec<u8>> = vec![Vec::new(); n];
        out[rank] = mine.to_vec();
        let Ring { next, prev, .. } = &mut *ring;
        let (next_rank, prev_rank) = ((rank + 1) % n, (rank + n - 1) % n);
        for step in 0..n - 1 {
            let send_idx = (rank + n - step) % n;
            let recv_idx = (rank + 2 * n - step - 1) % n;
            let blob = &out[send_idx];
            let mut frame = [0u8; FRAME_BYTES];
            frame[0..4].copy_from_slice(&seq.to_le_bytes());
            frame[4..8].copy_from_slice(&(send_idx as u32).to_le_bytes());
            frame[8..16].copy_from_slice(&(blob.len() as u64).to_le_bytes());
            let deadline = Instant::now() + self.timeout;
            let send_what = format!("allgather step {step}: sending to rank {next_rank}");
            let recv_what = format!("allgather step {step}: receiving from rank {prev_rank}");
            let send = |next: &mut TcpStream| -> Result<()> {
                socket::write_all_until(next, &frame, deadline, &send_what)?;
                socket::write_all_until(next, blob, deadline, &send_what)
            };
            let recv = |prev: &mut TcpStream| -> Result<Vec<u8>> {
                let mut f = [0u8; FRAME_BYTES];
                socket::read_exact_until(prev, &mut f, deadline, &recv_what)?;
                let got_seq = u32::from_le_bytes([f[0], f[1], f[2], f[3]]);
                let got_idx = u32::from_le_bytes([f[4], f[5], f[6], f[7]]) as usize;
                let len = u64::from_le_bytes([f[8], f[9], f[10], f[11], f[12], f[13], f[14], f[15]]);
                if got_seq != seq || got_idx != recv_idx {
                    return Err(Error::InvalidUsage(format!(
                        "bootstrap: {recv_what}: got call {got_seq} rank {got_idx}'s blob, expected call {seq} rank \
                         {recv_idx}'s (ranks made different sequences of allgather/barrier calls?)"
                    )));
                }
                if len > MAX_MESSAGE_BYTES {
                    return Err(Error::Remote(format!(
                        "bootstrap: {recv_what}: blob of {len} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes"
                    )));
                }
                let mut data = vec![0u8; len as usize];
                socket::read_exact_until(prev, &mut data, deadline, &recv_what)?;
                Ok(data)
            };
            let got = if FRAME_BYTES + blob.len() <= INLINE_FRAME_BYTES {
                send(next)?;
                recv(prev)?
            } else {
                std::thread::scope(|s| {
                    let sender = s.spawn(|| send(next));
                    let got = recv(prev);
                    let sent = sender.join().unwrap_or_else(|_| {
                        Err(Error::Internal(
                            "bootstrap: allgather sender thread panicked".into(),
                        ))
                    });
                    sent.and(got)
                })?
            };
            out[recv_idx] = got;
        }
        Ok(out)
    }

    /// An [`allgather`](Bootstrap::allgather) after a step that may fail on some ranks: each rank
    /// sends `record(&value)` of its result `mine`, or its error, so every rank learns of a
    /// failure at the same step and fails at once, naming the rank (rather than one rank leaving
    /// and the others waiting out the bootstrap timeout). Returns this rank's value and every
    /// rank's record.
    ///
    /// Errors: this rank's own error as it is; else `Remote` "rank {rank}: rank {r} {what}:
    /// {error}" for the first rank `r` that failed; bootstrap errors.
    pub(crate) fn allgather_checked<T>(
        &self,
        mine: Result<T>,
        record: impl FnOnce(&T) -> String,
        what: &str,
    ) -> Result<(T, Vec<Vec<u8>>)> {
        let sent = match &mine {
            Ok(v) => record(v),
            Err(e) => format!("{FAILED_PREFIX}{e}"),
        };
        let all = self.allgather(sent.as_bytes())?;
        let value = mine?;
        if let Some((r, e)) = all.iter().enumerate().find_map(|(r, b)| {
            String::from_utf8_lossy(b)
                .strip_prefix(FAILED_PREFIX)
                .map(|e| (r, e.to_string()))
        }) {
            return Err(Error::Remote(format!("rank {}: rank {r} {what}: {e}", self.rank)));
        }
        Ok((value, all))
    }

    /// Returns once every rank has called `barrier` (NCCL's `bootstrapBarrier`): an
    /// [`allgather`](Bootstrap::allgather) of nothing, which cannot complete on any rank before
    /// every rank has contributed.
    pub fn barrier(&self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }

    /// Sends `data` (up to [`MAX_MESSAGE_BYTES`]) to `peer` under `tag` (NCCL's
    /// `bootstrapSend`): connects to the peer's listener, sends (secret, rank, tag, length,
    /// data) and waits until the peer's listener has filed the message, so messages from one
    /// thread to one peer arrive in order. Sending to oneself is allowed.
    pub fn send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        check_rank("peer", peer, self.nranks)?;
        check_len("send", data.len())?;
        if peer == self.rank {
            self.mailbox.push(peer, tag, data.to_vec());
            return Ok(());
        }
        if let Some(l) = &self.local {
            l.hub.mailboxes[peer].push(self.rank, tag, data.to_vec());
            return Ok(());
        }
        let addr = self.addrs[peer];
        let deadline = Instant::now() + self.timeout;
        let what = format!("rank {} sending tag {tag} to rank {peer} ({addr})", self.rank);
        let mut s = socket::connect(addr, deadline, &format!("rank {peer}"))?;
        let h = Header {
            kind: Kind::P2p,
            secret: self.secret,
            rank: self.rank as u32,
            nranks: self.nranks as u32,
            tag,
            len: data.len() as u64,
        };
        socket::write_message(&mut s, &h, data, deadline, &what)?;
        let mut ack = [0u8; 1];
        socket::read_exact_until(&mut s, &mut ack, deadline, &what)?;
        if ack[0] != ACK {
            return Err(Error::Remote(format!(
                "bootstrap: {what}: bad acknowledgement {:#x}",
                ack[0]
            )));
        }
        Ok(())
    }

    /// Receives the oldest message from `peer` with `tag` (NCCL's `bootstrapRecv`), waiting up
    /// to the bootstrap timeout ([`Error::Timeout`] then).
    pub fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        check_rank("peer", peer, self.nranks)?;
        let deadline = Instant::now() + self.timeout;
        let mut st = self.mailbox.lock();
        loop {
            if let Some(q) = st.queues.get_mut(&(peer, tag))
                && let Some(m) = q.pop_front()
            {
                if q.is_empty() {
                    st.queues.remove(&(peer, tag));
                }
                return Ok(m);
            }
            if let Some(why) = &st.failed {
                return Err(Error::System(format!(
                    "bootstrap: rank {}: listener stopped: {why}",
                    self.rank
                )));
            }
            if let Some(l) = &self.local
                && l.hub.left[peer].load(std::sync::atomic::Ordering::Acquire)
            {
                return Err(Error::Remote(format!(
                    "bootstrap: rank {} receiving tag {tag} from rank {peer}: rank {peer} has left \
                     (its init failed, naming the cause, or it was destroyed)",
                    self.rank
                )));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(format!(
                    "bootstrap: rank {} receiving tag {tag} from rank {peer}: nothing arrived within {:.1} s",
                    self.rank,
                    self.timeout.as_secs_f64()
                )));
            }
            st = self
                .mailbox
                .cond
                .wait_timeout(st, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// Stops the listener thread of a rank whose init failed half-way.
struct Partial {
    wake: Option<UnixStream>,
    listener: Option<JoinHandle<()>>,
}

fn stop_listener(wake: &mut Option<UnixStream>, listener: &mut Option<JoinHandle<()>>) {
    if let Some(mut w) = wake.take() {
        // Closing the socket alone wakes the thread; the byte is a second nudge.
        let _ = w.write_all(&[1]);
        drop(w);
        if let Some(h) = listener.take()
            && h.join().is_err()
        {
            tracing::warn!(target: "oxccl::bootstrap", "bootstrap listener thread panicked");
        }
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        stop_listener(&mut self.wake, &mut self.listener);
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        stop_listener(&mut self.wake, &mut self.listener);
        if let Some(l) = &self.local {
            l.hub.leave(self.rank);
        }
    }
}

/// Starts a rank's listener thread: accepts ring and point-to-point connections, files
/// point-to-point messages in `mailbox` (acknowledging each), hands ring connections to init
/// through `ring_tx`, and exits when `wake` becomes readable or is closed.
#[allow(clippy::too_many_arguments)]
fn spawn_listener(
    listener: TcpListener,
    wake: UnixStream,
    secret: u64,
    rank: usize,
    nranks: usize,
    timeout: Duration,
    ring_tx: Sender<(usize, TcpStream)>,
    mailbox: Arc<Mailbox>,
) -> Result<JoinHandle<()>> {
    let allowed = Box::new(move |h: &Header| {
        if h.nranks as usize != nranks || h.rank as usize >= nranks {
            return Err(format!(
                "rank {} of nranks {} does not belong to this bootstrap of {nranks}",
                h.rank, h.nranks
            ));
        }
        match h.kind {
            Kind::Ring if h.len == 0 => Ok(()),
            Kind::P2p if h.len <= MAX_MESSAGE_BYTES => Ok(()),
            Kind::P2p => Err(format!(
                "message of {} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes",
                h.len
            )),
            k => Err(format!("unexpected message kind {k:?} ({} bytes)", h.len)),
        }
    });
    let server = Server::new(
        listener,
        secret,
        timeout,
        format!("bootstrap rank {rank}"),
        allowed,
    )?;
    // Near the GPU of the communicator being created, when its affinity is known.
    let near = crate::topo::detect::helper_affinity();
    std::thread::Builder::new()
        .name(format!("oxccl-bs-{rank}"))
        .spawn(move || {
            crate::topo::detect::bind_helper_thread(near.as_ref());
            listen_loop(server, wake, ring_tx, mailbox)
        })
        .map_err(|e| {
            Error::System(format!(
                "bootstrap: rank {rank}: cannot start the listener thread: {e}"
            ))
        })
}

fn listen_loop(
    mut server: Server,
    wake: UnixStream,
    ring_tx: Sender<(usize, TcpStream)>,
    mailbox: Arc<Mailbox>,
) {
    let mut ring_tx = Some(ring_tx);
    loop {
        // Wake every few seconds even when idle; nothing else is time-driven here.
        let until = Instant::now() + Duration::from_secs(5);
        match server.poll(until, Some(wake.as_raw_fd())) {
            Ok(Event::Woken) => return,
            Ok(Event::Messages(msgs)) => {
                for Incoming {
                    header: h,
                    payload,
                    mut stream,
                    peer,
                } in msgs
                {
                    match h.kind {
                        Kind::Ring => {
                            // Only one ring connection is expected; later ones are dropped.
                            match ring_tx.take().map(|tx| tx.try_send((h.rank as usize, stream))) {
                                Some(Ok(())) => {}
                                _ => {
                                    tracing::warn!(target: "oxccl::bootstrap", %peer, rank = h.rank, "dropped an unexpected ring connection");
                                }
                            }
                        }
                        Kind::P2p => {
                            mailbox.push(h.rank as usize, h.tag, payload);
                            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                            if let Err(e) = stream.write_all(&[ACK]) {
                                tracing::debug!(target: "oxccl::bootstrap", %peer, "acknowledgement not delivered: {e}");
                            }
                        }
                        _ => {}
                    }
                }
            }
            Err(e) => {
                tracing::warn!(target: "oxccl::bootstrap", "{e}");
                mailbox.fail(e.to_string());
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<BootstrapConfig> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        BootstrapConfig::from_lookup(|name| {
            ["OXCCL_", "NCCL_"].iter().find_map(|p| {
                let key = format!("{p}{name}");
                vars.iter().find(|(k, _)| *k == key).cloned()
            })
        })
    }

    #[test]
    fn config_from_variables() {
        assert_eq!(with(&[]).unwrap(), BootstrapConfig::default());
        let c = with(&[
            ("NCCL_BOOTSTRAP_TIMEOUT", " 5 "),
            ("OXCCL_SOCKET_IFNAME", "^docker"),
            ("NCCL_COMM_ID", "127.0.0.1:9"),
        ])
        .unwrap();
        assert_eq!(c.timeout, Duration::from_secs(5));
        assert_eq!(
            (c.ifname.as_deref(), c.ifname_var.as_str()),
            (Some("^docker"), "OXCCL_SOCKET_IFNAME")
        );
        assert_eq!(c.comm_id, Some("127.0.0.1:9".parse().unwrap()));
        assert_eq!(with(&[("NCCL_SOCKET_IFNAME", " ")]).unwrap().ifname, None);
        for bad in ["x", "0", "-1", "inf", "1000001"] {
            let e = with(&[("OXCCL_BOOTSTRAP_TIMEOUT", bad)]).unwrap_err();
            assert_eq!(e.code(), ResultCode::InvalidArgument);
            assert!(e.to_string().contains("OXCCL_BOOTSTRAP_TIMEOUT"), "{e}");
        }
        let e = with(&[("NCCL_COMM_ID", "nonsense")]).unwrap_err();
        assert!(e.to_string().contains("NCCL_COMM_ID"), "{e}");
    }

    #[test]
    fn bootstrap_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Bootstrap>();
        check::<UniqueId>();
    }
}
