//! Transports: how a rank's ring and tree connections reach its neighbours (NCCL's
//! `transport.cc`, `transport/{p2p,shm,net}.cc`).
//!
//! | file | what | NCCL |
//! |---|---|---|
//! | `mod.rs` | what ranks tell each other (`PeerInfo`), the one selection per pair (`select_transport`), the NET setup of ring neighbours ([`connect_net`]) | `transport.h`, `transport.cc`, `net.cc` setup |
//! | `p2p.rs` | P2P: can-connect rules, `NCCL_P2P_LEVEL` and its exchange, peer access, direct pointers and CUDA IPC | `transport/p2p.cc` |
//! | `shm.rs` | SHM: can-connect rule, `/dev/shm` segments registered with CUDA | `transport/shm.cc` |
//! | `net.rs`, `net_socket.rs`, `plugin/` | the network interface, the socket network, NCCL net plugins | `net.h`, `transport/net_socket.cc`, `plugin/net/` |
//!
//! For every ring neighbour the first transport that can connect the pair is used, in NCCL's order
//! (`select_transport`):
//!
//! | transport | can connect when | the kernel's pointers point at |
//! |---|---|---|
//! | P2P (`p2p::can_connect`) | both ranks are CUDA devices of one host, `NCCL_P2P_DISABLE` unset on both | the peer's device memory |
//! | SHM (`shm::can_connect`) | both ranks are on one host, `NCCL_SHM_DISABLE` unset on both | the peer's `/dev/shm` segment (on CUDA registered with the driver: its device mapping) |
//! | NET | always | a local staging FIFO that the proxy thread ([`crate::proxy`]) sends over the network (on CUDA pinned, device-mapped host memory) |
//!
//! "One host" means equal host ids: the host name, or `OXCCL_HOSTID` when set (so tests can make
//! "hosts" inside one machine). `NCCL_P2P_LEVEL` forbidding P2P for a pair of GPUs counts as P2P
//! disabled for that pair. The choice is made once per pair of ranks, from both ranks' information
//! (which the ranks all-gather first, so the two ends always agree), by `Comm::init_rank`; the
//! ring's and the trees' connections and the NET setup ([`connect_net`]) all follow that one
//! decision. The network is the one `NCCL_NET` names
//! (case-insensitively; default: the first available: an NCCL network plugin when
//! `NCCL_NET_PLUGIN`'s lookup finds a usable one ([`plugin`]), else the socket network
//! [`net_socket`]); an unknown name is an error listing the available ones (NCCL's `initNet`).
//! Connection handles are exchanged through the bootstrap (NCCL's `ncclTransportP2pSetup`).
pub mod net;
pub mod net_socket;
pub(crate) mod p2p;
pub mod plugin;
pub(crate) mod shm;

use crate::bootstrap::Bootstrap;
use crate::cpu::HostMem;
use crate::error::{Error, Result};
use crate::cuda;
use crate::liveness::proc_start;
use crate::mem::Device;
use crate::proxy::{FifoSpec, ProxyComm, ProxyHandle};
use net::{NET_HANDLE_BYTES, Net, NetHandle};
use oxccl_gpu::abi::{FIFO_STEPS, PACK_BYTES};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A transport (NCCL's `ncclTransport`: `p2pTransport`, `shmTransport`, `netTransport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Direct device memory access between GPUs of one host.
    P2p,
    /// Host shared memory between processes of one host.
    Shm,
    /// The network, driven by the proxy thread.
    Net,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::P2p => "P2P",
            TransportKind::Shm => "SHM",
            TransportKind::Net => "NET",
        })
    }
}

/// What one rank tells the others at init (NCCL's `ncclPeerInfo` of `transport.h`, filled by
/// `fillInfo` and gathered by AllGather1 in `init.cc`): what transport selection decides on
/// (host, process, device, the `NCCL_P2P_DISABLE` / `NCCL_SHM_DISABLE` / `NCCL_P2P_LEVEL`
/// settings), how to reach its connection memory, and what init checks agree.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PeerInfo {
    pub(crate) cuda: bool,
    /// CUDA ordinal in the rank's own process, or CPU-target device index.
    pub(crate) dev: usize,
    /// PCI bus id of the GPU (CUDA); empty on the CPU target.
    pub(crate) bus_id: String,
    /// Multiprocessors of the GPU (CUDA; 0 on the CPU target): ranks sharing a GPU split them.
    pub(crate) sms: u32,
    /// Host name (or `OXCCL_HOSTID`): ranks with equal names are on one host (NCCL's hostHash).
    pub(crate) host: String,
    pub(crate) pid: u32,
    /// Process start time (`/proc/<pid>/stat` field 22, clock ticks): tells a live peer from a
    /// reused pid.
    pub(crate) start_time: u64,
    /// `NCCL_P2P_DISABLE=1` in the rank's environment.
    pub(crate) p2p_disable: bool,
    /// `NCCL_SHM_DISABLE=1` in the rank's environment.
    pub(crate) shm_disable: bool,
    /// `NCCL_P2P_LEVEL` in the rank's environment (`None`: unset).
    pub(crate) p2p_level: Option<crate::topo::PathType>,
    /// Ranks of this rank's host with which `NCCL_P2P_LEVEL` (either side's) forbids P2P, so
    /// their pair uses SHM (or NET) as NCCL's `p2pCanConnect` refusal does; filled after the
    /// peer all-gather by [`p2p::exchange_p2p_denied`], not part of [`PeerInfo::encode`].
    pub(crate) p2p_denied: Vec<usize>,
    /// Name of the `/dev/shm` segment of its SHM connection memory (CUDA ranks create it only
    /// when a ring neighbour uses SHM; CPU-target ranks always, as [`ConnDesc::Shm`]).
    pub(crate) shm_name: String,
    /// Channels and connection-memory bytes per rank: every rank must agree.
    pub(crate) nch: u32,
    pub(crate) conn_bytes: u64,
    pub(crate) conn: ConnDesc,
    /// Name of the shared abort page this rank offers (the ranks of a host use their lowest
    /// rank's).
    pub(crate) abort_page: String,
}

/// How peers reach a rank's connection memory.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ConnDesc {
    /// CPU target: a `/dev/shm` segment name.
    Shm(String),
    /// CPU target, ranks of one in-process bootstrap (`Comm::init_all`): the address of the
    /// owner's memory, valid in this process only.
    Local(u64),
    /// CUDA: the device pointer in the owner's process and its IPC handle.
    Ipc {
        ptr: u64,
        handle: [u8; cuda::IPC_HANDLE_BYTES],
    },
}

impl ConnDesc {
    /// `shm NAME`, `local ADDR` or `ipc PTR HANDLE` (hex), one line.
    pub(crate) fn encode(&self) -> String {
        match self {
            ConnDesc::Shm(name) => format!("shm {name}"),
            ConnDesc::Local(addr) => format!("local {addr:x}"),
            ConnDesc::Ipc { ptr, handle } => format!(
                "ipc {ptr:x} {}",
                handle.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
        }
    }

    /// Parses [`ConnDesc::encode`]; `None` when malformed.
    pub(crate) fn decode(s: &str) -> Option<ConnDesc> {
        match s.split(' ').collect::<Vec<_>>()[..] {
            ["shm", name] => Some(ConnDesc::Shm(name.to_string())),
            ["local", addr] => Some(ConnDesc::Local(u64::from_str_radix(addr, 16).ok()?)),
            ["ipc", ptr, hex] if hex.len() == 2 * cuda::IPC_HANDLE_BYTES => {
                let mut handle = [0u8; cuda::IPC_HANDLE_BYTES];
                for (i, h) in handle.iter_mut().enumerate() {
                    *h = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
                }
                Some(ConnDesc::Ipc {
                    ptr: u64::from_str_radix(ptr, 16).ok()?,
                    handle,
                })
            }
            _ => None,
        }
    }
}


impl PeerInfo {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn local(
        device: Device,
        ctx: Option<&cuda::Context>,
        nch: u32,
        conn_bytes: u64,
        conn: ConnDesc,
        shm_name: String,
        abort_page: String,
        p2p_level: Option<crate::topo::PathType>,
    ) -> Result<PeerInfo> {
        let host = crate::topo::detect::local_host_name();
        let pid = std::process::id();
        let (cuda, dev) = match device {
            Device::Cuda(o) => (true, o),
            Device::Cpu(i) => (false, i),
        };
        Ok(PeerInfo {
            cuda,
            dev,
            bus_id: match ctx {
                Some(c) => c.bus_id()?,
                None => String::new(),
            },
            sms: match ctx {
                Some(c) => c.multiprocessor_count()?,
                None => 0,
            },
            host,
            pid,
            start_time: proc_start(pid).map_or(0, |(t, _)| t),
            p2p_disable: crate::params::env_var("P2P_DISABLE").is_some_and(|(_, v)| v.trim() == "1"),
            // Read leniently here: a bad value fails every rank alike in `connect_net`.
            shm_disable: crate::params::env_var("SHM_DISABLE").is_some_and(|(_, v)| v.trim() == "1"),
            p2p_level,
            p2p_denied: Vec::new(),
            shm_name,
            nch,
            conn_bytes,
            conn,
            abort_page,
        })
    }

    pub(crate) fn kind(&self) -> &'static str {
        if self.cuda { "cuda" } else { "cpu" }
    }

    /// One line per field; byte strings in hex.
    pub(crate) fn encode(&self) -> String {
        let conn = self.conn.encode();
        [
            self.kind().to_string(),
            self.dev.to_string(),
            self.bus_id.clone(),
            self.host.clone(),
            self.pid.to_string(),
            self.start_time.to_string(),
            u8::from(self.p2p_disable).to_string(),
            self.nch.to_string(),
            self.conn_bytes.to_string(),
            conn,
            self.abort_page.clone(),
            u8::from(self.shm_disable).to_string(),
            self.shm_name.clone(),
            self.p2p_level.map_or("-", |l| l.as_str()).to_string(),
            self.sms.to_string(),
        ]
        .join("\n")
    }

    /// Parses rank `rank`'s [`PeerInfo::encode`]; `Remote` naming the rank when malformed.
    pub(crate) fn decode(rank: usize, b: &[u8]) -> Result<PeerInfo> {
        let bad = |what: &str| Error::Remote(format!("rank {rank} sent malformed peer information ({what})"));
        let text = std::str::from_utf8(b).map_err(|_| bad("not UTF-8"))?;
        let f: Vec<&str> = text.split('\n').collect();
        if f.len() != 15 {
            return Err(bad(&format!("{} fields, expected 15", f.len())));
        }
        let num = |i: usize, what: &str| f[i].parse::<u64>().map_err(|_| bad(what));
        let conn = ConnDesc::decode(f[9]).ok_or_else(|| bad("connection descriptor"))?;
        Ok(PeerInfo {
            cuda: match f[0] {
                "cuda" => true,
                "cpu" => false,
                _ => return Err(bad("device kind")),
            },
            dev: num(1, "device")? as usize,
            bus_id: f[2].to_string(),
            host: f[3].to_string(),
            pid: num(4, "pid")? as u32,
            start_time: num(5, "start time")?,
            p2p_disable: num(6, "P2P flag")? != 0,
            nch: num(7, "channels")? as u32,
            conn_bytes: num(8, "connection bytes")?,
            conn,
            abort_page: f[10].to_string(),
            shm_disable: num(11, "SHM flag")? != 0,
            shm_name: f[12].to_string(),
            p2p_level: match f[13] {
                "-" => None,
                v => Some(crate::params::parse_p2p_level("NCCL_P2P_LEVEL", v).map_err(|_| bad("P2P level"))?),
            },
            p2p_denied: Vec::new(),
            sms: num(14, "multiprocessors")? as u32,
        })
    }

    /// Name of the `/dev/shm` segment of the rank's tree connection memory for SHM tree peers.
    pub(crate) fn tree_shm_name(&self) -> String {
        format!("{}-tree", self.shm_name)
    }

    /// The device as messages name it: `cpu device 1`, `cuda device 0 (bus id 0000:18:00.0)`.
    pub(crate) fn describe_device(&self) -> String {
        if self.cuda {
            format!("cuda device {} (bus id {})", self.dev, self.bus_id)
        } else {
            format!("cpu device {}", self.dev)
        }
    }
}

/// Reads a 0/1 switch `OXCCL_<name>` / `NCCL_<name>` (unset: off). Errors name the variable and
/// the accepted values.
pub fn env_switch(name: &str) -> Result<bool> {
    match crate::params::env_var(name) {
        None => Ok(false),
        Some((key, v)) => match v.trim() {
            "0" | "" => Ok(false),
            "1" => Ok(true),
            _ => Err(Error::invalid(format!(
                "{key}={v:?} is not 0 or 1 (accepted: 0, 1)"
            ))),
        },
    }
}

/// What one rank contributes to [`connect_net`]'s all-gather: that its checks passed and, when
/// opening its network failed, why (that matters only if one of its ring neighbours uses NET); or,
/// when its local checks failed, only why.
#[derive(Clone, Debug, PartialEq, Eq)]
enum SetupRecord {
    Ready(Option<String>),
    Failed(String),
}

impl SetupRecord {
    /// `I` and the network error (empty: none); or `F` and the error.
    fn encode(&self) -> Vec<u8> {
        match self {
            SetupRecord::Ready(net_error) => [b"I".as_slice(), net_error.as_deref().unwrap_or("").as_bytes()].concat(),
            SetupRecord::Failed(why) => [b"F".as_slice(), why.as_bytes()].concat(),
        }
    }

    fn decode(b: &[u8]) -> Option<SetupRecord> {
        match b.split_first()? {
            (b'I', e) => Some(SetupRecord::Ready(
                (!e.is_empty()).then(|| String::from_utf8_lossy(e).into_owned()),
            )),
            (b'F', why) => Some(SetupRecord::Failed(String::from_utf8_lossy(why).into_owned())),
            _ => None,
        }
    }
}

/// This rank's transport settings as [`connect_net`] checks them before its all-gather: the
/// switches `NCCL_P2P_DISABLE` and `NCCL_SHM_DISABLE` (0 or 1) and the network `NCCL_NET` names.
fn check_settings() -> Result<()> {
    env_switch("P2P_DISABLE")?;
    env_switch("SHM_DISABLE")?;
    wanted_net()?;
    Ok(())
}

/// The transport between ranks `a` of `peers` and `b` (NCCL's `selectTransport`): the first of
/// P2P ([`p2p::can_connect`]), SHM ([`shm::can_connect`]), NET that can connect them, decided
/// from both ranks' information so the two ends agree (symmetric in `a` and `b`). This is the one
/// choice per pair of an `init_rank` communicator: its ring connections, its trees, the NET setup
/// ([`connect_net`]) and the LL128 and tuning decisions all follow it. A rank is its own
/// neighbour only in a 1-rank communicator, which uses its own memory (reported as P2P).
pub(crate) fn select_transport(peers: &[PeerInfo], a: usize, b: usize) -> TransportKind {
    if a == b {
        return TransportKind::P2p;
    }
    let (pa, pb) = (&peers[a], &peers[b]);
    // NCCL_P2P_LEVEL forbidding P2P for the pair counts as P2P disabled for it.
    let denied = pa.p2p_denied.contains(&b) || pb.p2p_denied.contains(&a);
    if p2p::can_connect(pa, pb, denied) {
        TransportKind::P2p
    } else if shm::can_connect(pa, pb) {
        TransportKind::Shm
    } else {
        TransportKind::Net
    }
}

/// Names of the networks this process can use, in order of preference (NCCL's `ncclNets`): the
/// network plugin `NCCL_NET_PLUGIN` selects when one is loaded ([`plugin::from_env`]), then the
/// socket network.
pub fn available_nets() -> Vec<String> {
    let mut nets: Vec<String> = plugin::from_env()
        .map(|p| p.name().to_string())
        .into_iter()
        .collect();
    nets.push("Socket".to_string());
    nets
}

/// The network `NCCL_NET` (or `OXCCL_NET`) asks for, checked against [`available_nets`]
/// (case-insensitively, as NCCL's `initNet`); `None` when unset.
///
/// Errors: `InvalidArgument` for an unknown name, listing the available networks.
pub fn wanted_net() -> Result<Option<String>> {
    let Some((key, v)) = crate::params::env_var("NET").filter(|(_, v)| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let avail = available_nets();
    match avail.iter().find(|n| n.eq_ignore_ascii_case(v.trim())) {
        Some(n) => Ok(Some(n.clone())),
        None => Err(Error::invalid(format!(
            "{key}={v:?}: no network of that name (available: {})",
            avail.join(", ")
        ))),
    }
}

/// The network to use: [`wanted_net`], else the first available one. The socket network listens
/// on the `NCCL_SOCKET_IFNAME` interface, else on `near`'s interface (the bootstrap's).
///
/// Errors: those of [`wanted_net`] and of [`net_socket::NetSocket::from_env`].
pub fn net_from_env(near: Option<std::net::IpAddr>) -> Result<Arc<dyn Net>> {
    let name = wanted_net()?;
    if let Some(p) = plugin::from_env()
        && name.as_deref().is_none_or(|n| n == p.name())
    {
        return Ok(Arc::new(p));
    }
    Ok(Arc::new(net_socket::NetSocket::from_env(near)?))
}

/// Addresses of one channel's connection memory inside a rank's connection block (what
/// `ConnLayout` in `comm/channel.rs` computes): Simple buffer, LL buffer, head and tail counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FifoAddrs {
    /// Simple buffer ([`FIFO_STEPS`] slots).
    pub simple: u64,
    /// LL buffer (16-byte lines).
    pub ll: u64,
    /// LL128 buffer (128-byte lines).
    pub ll128: u64,
    /// `u64` head counter (the send connection's credit).
    pub head: u64,
    /// `u64` tail counter (the receive connection's Simple progress).
    pub tail: u64,
}

/// Where a NET send connection's [`FIFO_STEPS`] `u64` step sizes live: this many bytes past its
/// staging tail, in the tail's 128-byte counter line (`ConnInfo::sizes`, NCCL's
/// `connFifo[].size`); the kernel writes them, the proxy reads them.
pub const STEP_SIZES_OFFSET: u64 = 64;

/// What [`connect_net`] needs from `Comm::init_rank`.
pub struct RingSetup<'a> {
    /// The communicator's bootstrap (all-gather, handle exchange, timeout).
    pub bootstrap: &'a Bootstrap,
    /// This rank and the number of ranks.
    pub rank: usize,
    pub nranks: usize,
    /// The ring neighbours `(next, prev)` of rank `q` on channel `c`: `ring(c, q)` (every
    /// channel's ring, as `Comm::init_rank` connects them; they may differ per channel).
    pub ring: &'a dyn Fn(u32, usize) -> (usize, usize),
    /// The transport between ranks `a` and `b`: `transport(a, b)`, the one choice per pair that
    /// `Comm::init_rank` makes (the same on every rank and in both orders); the neighbours it
    /// gives NET are connected here.
    pub transport: &'a dyn Fn(usize, usize) -> TransportKind,
    /// This rank's device (its proxy thread is the device's).
    pub device: Device,
    /// The CUDA context of `device` (`None` on the CPU target): staging FIFOs are then pinned,
    /// device-mapped host memory, so the kernel writes them and the proxy reads them.
    pub ctx: Option<&'a crate::cuda::Context>,
    /// Channels: one network connection per channel and direction.
    pub nch: u32,
    /// Bytes of one rank's connection block.
    pub block_bytes: usize,
    /// The addresses of channel `c` in the block at `base`.
    pub fifo: &'a dyn Fn(u64, u64) -> FifoAddrs,
    /// Simple buffer bytes per connection (`NCCL_BUFFSIZE`).
    pub buffsize: u64,
    /// LL buffer bytes per connection (0: none).
    pub ll_buffsize: u64,
    /// LL128 buffer bytes per connection (0: none).
    pub ll128_buffsize: u64,
    /// First step of every connection.
    pub initial_step: u64,
    /// Address of this rank's `u32` abort flag.
    pub abort_flag: u64,
    /// Address of the `u32` naming who raised it (rank + 1); 0 when there is none.
    pub abort_who: u64,
    /// The abort lines (flag at +0, who at +4) of the other ranks of this host, which a failed
    /// NET connection raises too (see [`crate::proxy::ProxyComm::host_abort_lines`]).
    pub host_abort_lines: Vec<u64>,
}

/// A staging block of NET connections: plain host memory on the CPU target; on CUDA pinned host
/// memory mapped into the device (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`), as NCCL's net
/// transport keeps its host-memory FIFOs.
enum Staging {
    Host(HostMem),
    Mapped(crate::cuda::HostMapped),
}

impl Staging {
    /// Allocates `bytes` zeroed bytes: device-mapped when `ctx` is given.
    fn alloc(ctx: Option<&crate::cuda::Context>, bytes: usize) -> Result<Staging> {
        Ok(match ctx {
            None => Staging::Host(HostMem::zeroed(bytes)?),
            Some(ctx) => Staging::Mapped(crate::cuda::HostMapped::zeroed(ctx, bytes)?),
        })
    }
    /// The address the proxy uses.
    fn host(&self) -> u64 {
        match self {
            Staging::Host(m) => m.addr(),
            Staging::Mapped(m) => m.host_ptr() as u64,
        }
    }
    /// The address the kernel uses.
    fn kernel(&self) -> u64 {
        match self {
            Staging::Host(m) => m.addr(),
            Staging::Mapped(m) => m.dev_ptr(),
        }
    }
}

/// Resources of a rank's NET connections: the proxy registration and the local staging blocks.
/// Dropping it first unregisters from the proxy (flushing staged steps), then frees the blocks.
pub struct NetResources {
    handle: ProxyHandle,
    /// (ring peer, its staging block).
    blocks: Vec<(usize, Staging)>,
}

impl NetResources {
    /// The first failure of a NET connection ([`ProxyHandle::error`]).
    pub fn error(&self) -> Option<Error> {
        self.handle.error()
    }

    /// The address the kernel uses for ring neighbour `peer`'s connection block (its staging
    /// FIFOs and the head counters of the receive side, laid out as `RingSetup::fifo` says): the
    /// device mapping on CUDA, the host address on the CPU target (where `connect_net` also put it
    /// in `conn_base[peer]`). `None` when `peer` does not use NET.
    pub fn kernel_base(&self, peer: usize) -> Option<u64> {
        self.blocks
            .iter()
            .find(|(p, _)| *p == peer)
            .map(|(_, b)| b.kernel())
    }
}

/// Bootstrap tag of the handle of channel `c` (NET connection setup).
const HANDLE_TAG: u32 = 0x4e45_5400;
/// Pause between `connect`/`accept` polls during setup.
const SETUP_POLL: Duration = Duration::from_millis(1);

/// Connects this rank's ring neighbours that need the NET transport (part of `Comm::init_rank`'s
/// per-neighbour setup, NCCL's `ncclTransportP2pSetup` for `netTransport`): for each neighbour
/// that `setup.transport` gives NET (the caller's one selection per pair) it sets
/// `conn_base[peer]` to a local block (the staging FIFOs of the send connection, the head
/// counters of the receive connection), connects one network connection per channel and
/// direction, and hands them to the proxy thread. Other neighbours are left alone
/// (`conn_base[peer]` untouched) for `init_rank`'s SHM/P2P setup. Returns `None` when no neighbour
/// uses NET. Every rank must call it at the same point of init (it all-gathers through the
/// bootstrap).
///
/// `conn_base` holds host addresses (what the proxy reads and writes). On CUDA (`setup.ctx`) the
/// staging blocks are pinned, device-mapped host memory and `conn_base[setup.rank]` must be too
/// (the block whose receive FIFOs the proxy fills and whose head counters it advances); the
/// kernel's addresses of the staging blocks are [`NetResources::kernel_base`]. The kernel then
/// reaches every NET FIFO and counter through host memory, and its FIFO protocol needs nothing
/// else: Simple posts its tail and head after `fence.acq_rel.sys` and LL lines carry their flags
/// in each 8-byte word (LL128 is not safe through host memory, see `Comm::init_rank`).
///
/// Errors: bad `NCCL_P2P_DISABLE` / `NCCL_SHM_DISABLE` / `NCCL_NET` values (`InvalidArgument`),
/// and a network that cannot be opened on a rank that needs it (`NetSocket::from_env`'s errors),
/// on the rank concerned; every other rank then gets `Remote` naming that rank and its error
/// (these checks are all-gathered before any rank goes on, so all ranks fail at the same point;
/// the network is opened only on ranks with a NET neighbour).
/// Bootstrap failures, a peer that does not connect within the bootstrap timeout (`Timeout`).
///
/// # Safety
/// `conn_base[setup.rank]` is this rank's connection block (`setup.block_bytes` bytes, laid out as
/// `setup.fifo` says) and `setup.abort_flag` its abort flag; both stay valid until the returned
/// resources are dropped.
pub unsafe fn connect_net(setup: &RingSetup<'_>, conn_base: &mut [u64]) -> Result<Option<NetResources>> {
    let s = setup;
    let (rank, nranks) = (s.rank, s.nranks);
    if nranks == 1 {
        return Ok(None);
    }
    // The local checks and the opening of the network go into the all-gather, so a rank that
    // cannot set up its transports still takes part and every rank fails naming it and its cause,
    // rather than finding its memory already gone or waiting for it until the bootstrap timeout.
    let near = s.bootstrap.addrs().get(rank).map(|a| a.ip());
    let local = check_settings();
    // The distinct ring neighbours of rank `q` over every channel.
    let neighbours = |q: usize| -> Vec<usize> {
        let mut out = Vec::new();
        for c in 0..s.nch {
            let (n, p) = (s.ring)(c, q);
            for x in [n, p] {
                if x != q && !out.contains(&x) {
                    out.push(x);
                }
            }
        }
        out
    };
    let needs_net = |q: usize| {
        neighbours(q)
            .iter()
            .any(|&p| (s.transport)(q, p) == TransportKind::Net)
    };
    let mine = neighbours(rank);
    // The network is opened only where a neighbour uses NET, so SHM-only and P2P-only ranks
    // never load it.
    let mut opened = match &local {
        Ok(()) if needs_net(rank) => Some(net_from_env(near)),
        _ => None,
    };
    let record = match (&local, &opened) {
        (Err(e), _) => SetupRecord::Failed(e.to_string()),
        (Ok(()), Some(Err(e))) => SetupRecord::Ready(Some(e.to_string())),
        (Ok(()), _) => SetupRecord::Ready(None),
    };
    let gathered = s.bootstrap.allgather(&record.encode())?;
    local?;
    let mut net_errors = Vec::with_capacity(nranks);
    for (r, b) in gathered.iter().enumerate() {
        match SetupRecord::decode(b) {
            Some(SetupRecord::Ready(net_error)) => net_errors.push(net_error),
            Some(SetupRecord::Failed(why)) => {
                return Err(Error::Remote(format!(
                    "rank {rank}: rank {r} cannot set up its transports: {why}"
                )));
            }
            None => {
                return Err(Error::Remote(format!(
                    "rank {r} sent malformed transport information"
                )));
            }
        }
    }
    // A rank that needs the network but could not open it fails every rank (the lowest such).
    for (q, net_error) in net_errors.iter().enumerate() {
        if let Some(why) = net_error {
            return match opened.take() {
                Some(Err(e)) if q == rank => Err(e),
                _ => Err(Error::Remote(format!(
                    "rank {rank}: rank {q} cannot open its network for the NET transport: {why}"
                ))),
            };
        }
    }
    let mut blocks = Vec::new();
    let mut kinds = vec![None; nranks];
    for &peer in &mine {
        let kind = (s.transport)(rank, peer);
        kinds[peer] = Some(kind);
        match kind {
            TransportKind::P2p | TransportKind::Shm => {}
            TransportKind::Net => {
                let blk = Staging::alloc(s.ctx, s.block_bytes)?;
                for c in 0..s.nch as u64 {
                    let f = (s.fifo)(blk.host(), c);
                    for at in [f.head, f.tail] {
                        // SAFETY: the counters lie inside the fresh block; no one else uses it.
                        unsafe { (at as *mut u64).write(s.initial_step) };
                    }
                }
                conn_base[peer] = blk.host();
                blocks.push((peer, blk));
            }
        }
    }
    let is_net = |p: usize| kinds[p] == Some(TransportKind::Net);
    // Opened above exactly when a neighbour uses NET; an error there was all-gathered and
    // returned.
    let net = opened.transpose()?;
    for c in 0..s.nch {
        let (next, prev) = (s.ring)(c, rank);
        for (dir, peer) in [("->", next), ("<-", prev)] {
            let via = match (kinds[peer], &net) {
                (Some(TransportKind::Net), Some(n)) => format!("NET/{}/0", n.name()),
                (Some(k), _) => k.to_string(),
                (None, _) => continue,
            };
            tracing::info!(target: "oxccl::transport", "Channel {c:02} : {rank} {dir} {peer} via {via}");
        }
    }
    let Some(net) = net else {
        return Ok(None);
    };
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for c in 0..s.nch {
        let (next, prev) = (s.ring)(c, rank);
        if is_net(next) {
            let f_stage = (s.fifo)(conn_base[next], c as u64);
            let f_own = (s.fifo)(conn_base[rank], c as u64);
            let mut sp = spec(s, next, c, f_stage, f_own.head, f_stage.tail);
            sp.sizes = f_stage.tail + STEP_SIZES_OFFSET;
            // The staging block the proxy sends from (NCCL's regMr of the send buffers).
            sends.push(NetConnPlan {
                tag: HANDLE_TAG + c,
                spec: sp,
                region: (conn_base[next], s.block_bytes),
            });
        }
        if is_net(prev) {
            let f_own = (s.fifo)(conn_base[rank], c as u64);
            let f_sink = (s.fifo)(conn_base[prev], c as u64);
            // This rank's block, which the proxy receives into.
            recvs.push(NetConnPlan {
                tag: HANDLE_TAG + c,
                spec: spec(s, prev, c, f_own, f_sink.head, f_own.tail),
                region: (conn_base[rank], s.block_bytes),
            });
        }
    }
    let abort = ProxyAbort {
        flag: s.abort_flag,
        who: s.abort_who,
        host_lines: s.host_abort_lines.clone(),
    };
    // SAFETY: the staging blocks are in `blocks`, kept by the returned resources; this rank's
    // block outlives them (caller's contract).
    let handle = unsafe { connect_planned(s.bootstrap, rank, s.device, net, sends, recvs, abort)? };
    Ok(Some(NetResources { handle, blocks }))
}

/// One direction of a NET connection to make ([`connect_planned`]): the peer and channel in
/// `spec`, the bootstrap tag on which the receiver sends its listen handle to the sender, and
/// the memory region the network reads (send) or writes (receive), registered with it.
pub struct NetConnPlan {
    /// Bootstrap tag of the handle; unique per pair of ranks and connection.
    pub tag: u32,
    /// The connection as the proxy sees it.
    pub spec: FifoSpec,
    /// (address, bytes) of the region holding the connection's FIFOs (host addresses).
    pub region: (u64, usize),
}

/// Where the proxy raises a failure ([`ProxyComm`]'s `abort_flag`, `abort_who` and
/// `host_abort_lines`).
#[derive(Clone, Debug)]
pub struct ProxyAbort {
    /// Address of this rank's `u32` abort flag.
    pub flag: u64,
    /// Address of the `u32` naming who raised it (rank + 1); 0 when there is none.
    pub who: u64,
    /// The abort lines of the other ranks of this host.
    pub host_lines: Vec<u64>,
}

/// Makes the NET connections `sends` and `recvs` of this rank and hands them to the proxy thread
/// of `device` (NCCL's `ncclTransportP2pSetup` for `netTransport`, connect and accept): listens
/// for every receive connection and sends the handle to its peer (tag [`NetConnPlan::tag`]), then
/// connects every send connection to the handle its peer sent, then accepts every receive
/// connection, registering each one's region with the network. The peers must make the matching
/// plans at the same point of their init (a send here is a receive there, same tag).
///
/// Errors: bootstrap and network failures; a malformed handle (`Remote`); a peer that does not
/// connect or listen within the bootstrap timeout (`Timeout`, naming the peer and channel).
///
/// # Safety
/// Every plan's region and the FIFO and counter addresses of its spec, and `abort`'s addresses,
/// stay valid until the returned handle is dropped.
pub unsafe fn connect_planned(
    bootstrap: &Bootstrap,
    rank: usize,
    device: Device,
    net: Arc<dyn Net>,
    sends: Vec<NetConnPlan>,
    recvs: Vec<NetConnPlan>,
    abort: ProxyAbort,
) -> Result<ProxyHandle> {
    let timeout = bootstrap.timeout();
    let mut listens = Vec::with_capacity(recvs.len());
    for p in &recvs {
        let (h, l) = net.listen(0)?;
        bootstrap.send(p.spec.peer, p.tag, &h)?;
        listens.push(l);
    }
    let mut send_comms = Vec::with_capacity(sends.len());
    for p in sends {
        let (peer, c) = (p.spec.peer, p.spec.channel);
        let got = bootstrap.recv(peer, p.tag)?;
        let h: NetHandle = got.as_slice().try_into().map_err(|_| {
            Error::Remote(format!(
                "rank {peer} sent a {}-byte NET handle for channel {c} (expected {NET_HANDLE_BYTES})",
                got.len()
            ))
        })?;
        let mut comm = poll_setup(
            timeout,
            || net.connect(0, &h),
            || {
                format!(
                    "rank {rank}: NET/{}: connecting channel {c} to rank {peer} took more than {:.1} s",
                    net.name(),
                    timeout.as_secs_f64()
                )
            },
        )?;
        // SAFETY: the region stays valid until the proxy closed the connection (contract).
        unsafe { net.reg_mr_send(&mut comm, p.region.0 as *const u8, p.region.1)? };
        send_comms.push((p.spec, comm));
    }
    let mut recv_comms = Vec::with_capacity(recvs.len());
    for (p, mut l) in recvs.into_iter().zip(listens) {
        let (peer, c) = (p.spec.peer, p.spec.channel);
        let mut comm = poll_setup(
            timeout,
            || net.accept(&mut l),
            || {
                format!(
                    "rank {rank}: NET/{}: rank {peer} did not connect channel {c} within {:.1} s",
                    net.name(),
                    timeout.as_secs_f64()
                )
            },
        )?;
        net.close_listen(l)?;
        // SAFETY: as above, for the region the proxy receives into.
        unsafe { net.reg_mr_recv(&mut comm, p.region.0 as *mut u8, p.region.1)? };
        recv_comms.push((p.spec, comm));
    }
    tracing::debug!(target: "oxccl::transport", rank, net = net.name(), sends = send_comms.len(),
        recvs = recv_comms.len(), "NET connections ready");
    let comm = ProxyComm {
        rank,
        abort_flag: abort.flag,
        abort_who: abort.who,
        host_abort_lines: abort.host_lines,
        net,
        sends: send_comms,
        recvs: recv_comms,
    };
    // SAFETY: the FIFOs, counters and abort addresses stay valid until the handle is dropped
    // (caller's contract).
    unsafe { crate::proxy::register(device, comm) }
}

/// Calls `attempt` every [`SETUP_POLL`] until it gives a value, for at most `timeout`; then
/// `Timeout` with the message `late()` (a connect or accept that never completes). Errors of
/// `attempt` return at once.
fn poll_setup<T>(
    timeout: Duration,
    mut attempt: impl FnMut() -> Result<Option<T>>,
    late: impl FnOnce() -> String,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = attempt()? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout(late()));
        }
        std::thread::sleep(SETUP_POLL);
    }
}

impl NetResources {
    /// Resources of NET connections whose staging memory the caller keeps (the trees').
    pub fn from_handle(handle: ProxyHandle) -> NetResources {
        NetResources {
            handle,
            blocks: Vec::new(),
        }
    }
}

/// The proxy's view of one ring connection: data and tail from `fifo`, the other counter `head`.
fn spec(s: &RingSetup<'_>, peer: usize, channel: u32, fifo: FifoAddrs, head: u64, tail: u64) -> FifoSpec {
    let sizes = FifoSizes {
        buffsize: s.buffsize,
        ll_buffsize: s.ll_buffsize,
        ll128_buffsize: s.ll128_buffsize,
    };
    fifo_spec(peer, channel, fifo, head, tail, sizes, s.initial_step)
}

/// Bytes of one connection's FIFO of each protocol (`NCCL_BUFFSIZE`, `NCCL_LL_BUFFSIZE`,
/// `NCCL_LL128_BUFFSIZE`; 0 for LL or LL128: none).
#[derive(Clone, Copy, Debug)]
pub struct FifoSizes {
    pub buffsize: u64,
    pub ll_buffsize: u64,
    pub ll128_buffsize: u64,
}

/// The proxy's view of one connection to or from `peer` on `channel`: the FIFOs in `fifo`
/// (`fifo.head` and `fifo.tail` unused), the counters `head` and `tail`, no step sizes (set
/// [`FifoSpec::sizes`] on a send connection whose kernel writes them), starting at `step`.
pub fn fifo_spec(
    peer: usize,
    channel: u32,
    fifo: FifoAddrs,
    head: u64,
    tail: u64,
    sizes: FifoSizes,
    step: u64,
) -> FifoSpec {
    FifoSpec {
        peer,
        channel,
        simple: fifo.simple,
        slot_bytes: sizes.buffsize / FIFO_STEPS / PACK_BYTES * PACK_BYTES,
        ll: if sizes.ll_buffsize > 0 { fifo.ll } else { 0 },
        step_lines: sizes.ll_buffsize / FIFO_STEPS / 16,
        ll128: if sizes.ll128_buffsize > 0 { fifo.ll128 } else { 0 },
        ll128_lines: sizes.ll128_buffsize / FIFO_STEPS / 128,
        head,
        tail,
        sizes: 0,
        step,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_peers::{cuda_peer, four_peers};

    fn info(cuda: bool, host: &str, p2p_disable: bool, shm_disable: bool) -> PeerInfo {
        PeerInfo {
            cuda,
            p2p_disable,
            shm_disable,
            ..test_peers::cuda_peer("0000:01:00.0", host, 1)
        }
    }

    #[test]
    fn selection_follows_p2p_shm_net_and_is_symmetric() {
        use TransportKind::*;
        let cases = [
            // (a, b, expected)
            (
                info(true, "h1", false, false),
                info(true, "h1", false, false),
                P2p,
            ),
            (info(true, "h1", true, false), info(true, "h1", false, false), Shm),
            (info(true, "h1", true, false), info(true, "h1", false, true), Net),
            (
                info(false, "h1", false, false),
                info(false, "h1", false, false),
                Shm,
            ),
            (
                info(false, "h1", false, true),
                info(false, "h1", false, false),
                Net,
            ),
            (
                info(false, "h1", false, false),
                info(false, "h2", false, false),
                Net,
            ),
            (
                info(true, "h1", false, false),
                info(true, "h2", false, false),
                Net,
            ),
        ];
        for (a, b, want) in cases {
            let pair = [a, b];
            assert_eq!(select_transport(&pair, 0, 1), want, "{pair:?}");
            assert_eq!(select_transport(&pair, 1, 0), want, "{pair:?}");
        }
    }

    #[test]
    fn cpu_ranks_of_one_process_use_p2p_only_with_in_process_memory() {
        use TransportKind::*;
        let cpu = |pid: u32, conn: ConnDesc, p2p_disable: bool| PeerInfo {
            cuda: false,
            bus_id: String::new(),
            conn,
            p2p_disable,
            ..cuda_peer("", "h", pid)
        };
        let local = |a| ConnDesc::Local(a);
        let shm = |n: &str| ConnDesc::Shm(n.into());
        let cases = [
            (cpu(7, local(0x1000), false), cpu(7, local(0x2000), false), P2p),
            // init_rank ranks of one process (segments), other processes, P2P disabled: SHM.
            (cpu(7, shm("a"), false), cpu(7, shm("b"), false), Shm),
            (cpu(7, local(0x1000), false), cpu(8, local(0x2000), false), Shm),
            (cpu(7, local(0x1000), true), cpu(7, local(0x2000), false), Shm),
        ];
        for (a, b, want) in cases {
            let pair = [a, b];
            assert_eq!(select_transport(&pair, 0, 1), want, "{:?} / {:?}", pair[0].conn, pair[1].conn);
            assert_eq!(select_transport(&pair, 1, 0), want);
        }
    }

    #[test]
    fn peer_info_round_trips() {
        let mut p = cuda_peer("0000:18:00.0", "node a", 4242);
        p.abort_page = "oxccl-1-2-abort".into();
        p.shm_disable = true;
        p.p2p_level = Some(crate::topo::PathType::Pxb);
        p.sms = 132;
        assert_eq!(PeerInfo::decode(0, p.encode().as_bytes()).unwrap(), p);
        let q = PeerInfo {
            cuda: false,
            bus_id: String::new(),
            sms: 0,
            conn: ConnDesc::Shm("oxccl-1-2-r1".into()),
            p2p_level: None,
            ..p.clone()
        };
        assert_eq!(PeerInfo::decode(1, q.encode().as_bytes()).unwrap(), q);
        let l = PeerInfo {
            conn: ConnDesc::Local(0x7f00_1234_5000),
            ..q
        };
        assert_eq!(PeerInfo::decode(2, l.encode().as_bytes()).unwrap(), l);
        let e = PeerInfo::decode(3, b"cuda\n0").unwrap_err();
        assert_eq!(
            e.to_string(),
            "remote error: rank 3 sent malformed peer information (2 fields, expected 15)"
        );
    }

    #[test]
    fn ring_transports_follow_p2p_shm_net() {
        use TransportKind::{Net, P2p, Shm};
        // Ranks 0-2 on host h, rank 3 on host k; rank 1 has NCCL_P2P_DISABLE=1, rank 2
        // NCCL_SHM_DISABLE=1. Pairs: 0-1 SHM (P2P off on 1), 1-2 NET (P2P off on 1, SHM off on 2),
        // 2-3 and 3-0 NET (other host); 0-0 (a 1-rank ring) its own memory, reported as P2P.
        let mut p = four_peers();
        assert_eq!(select_transport(&p, 0, 1), P2p);
        p[1].p2p_disable = true;
        p[2].shm_disable = true;
        let want = [
            (0, 1, Shm),
            (1, 2, Net),
            (2, 3, Net),
            (3, 0, Net),
            (0, 2, P2p),
            (0, 0, P2p),
        ];
        for (a, b, k) in want {
            assert_eq!(
                (select_transport(&p, a, b), select_transport(&p, b, a)),
                (k, k),
                "{a}-{b}"
            );
        }
        // CPU-target ranks never use P2P: SHM on one host (0-2 also with P2P allowed on both),
        // still NET where one side disabled SHM.
        for q in &mut p {
            q.cuda = false;
        }
        assert_eq!((select_transport(&p, 0, 1), select_transport(&p, 1, 2)), (Shm, Net));
        p[2].shm_disable = false;
        assert_eq!(select_transport(&p, 0, 2), Shm);
    }

    #[test]
    fn setup_records_round_trip() {
        for r in [
            SetupRecord::Ready(None),
            SetupRecord::Ready(Some("invalid usage: no\nmatch".into())),
            SetupRecord::Failed("invalid argument: NCCL_NET=\"IB\"".into()),
            SetupRecord::Failed(String::new()),
        ] {
            assert_eq!(SetupRecord::decode(&r.encode()), Some(r.clone()), "{r:?}");
        }
        // An unknown tag, nothing at all.
        assert_eq!(SetupRecord::decode(b"X0\n0\n0\nh"), None);
        assert_eq!(SetupRecord::decode(b""), None);
    }

    /// Two CPU-target ranks of one host, with SHM allowed in this process's environment: told
    /// NET for their pair (as `Comm::init_rank` decides for two GPUs that `NCCL_P2P_LEVEL` keeps
    /// off P2P when `NCCL_SHM_DISABLE=1`), `connect_net` connects them over the network; told SHM,
    /// it leaves them alone. It used to choose again from its own all-gathered peer info, which
    /// knew nothing of `NCCL_P2P_LEVEL`, and so could disagree with the rest of init.
    #[test]
    fn net_setup_follows_the_transport_it_is_given() {
        use TransportKind::{Net, Shm};
        let fifo = |b: u64, c: u64| FifoAddrs {
            simple: b + c * 4096,
            ll: b + c * 4096 + 1024,
            ll128: b + c * 4096 + 2048,
            head: b + c * 4096 + 3072,
            tail: b + c * 4096 + 3584,
        };
        for kind in [Net, Shm] {
            let id = crate::bootstrap::get_unique_id().unwrap();
            std::thread::scope(|scope| {
                for rank in 0..2 {
                    let id = &id;
                    scope.spawn(move || {
                        let bootstrap = Bootstrap::init(id, rank, 2).unwrap();
                        let block = HostMem::zeroed(2 * 4096).unwrap();
                        let abort = HostMem::zeroed(64).unwrap();
                        let mut conn_base = [0u64; 2];
                        conn_base[rank] = block.addr();
                        let setup = RingSetup {
                            bootstrap: &bootstrap,
                            rank,
                            nranks: 2,
                            ring: &|_, q| (1 - q, 1 - q),
                            transport: &|_, _| kind,
                            device: Device::Cpu(rank),
                            ctx: None,
                            nch: 2,
                            block_bytes: 2 * 4096,
                            fifo: &fifo,
                            buffsize: 1024,
                            ll_buffsize: 0,
                            ll128_buffsize: 0,
                            initial_step: 0,
                            abort_flag: abort.addr(),
                            abort_who: abort.addr() + 4,
                            host_abort_lines: Vec::new(),
                        };
                        // SAFETY: `block` and `abort` outlive `net`, dropped first.
                        let net = unsafe { connect_net(&setup, &mut conn_base) }.unwrap();
                        let peer = 1 - rank;
                        match kind {
                            Net => {
                                let net = net.as_ref().expect("NET resources");
                                assert_ne!(conn_base[peer], 0, "rank {rank}");
                                assert_eq!(net.kernel_base(peer), Some(conn_base[peer]));
                            }
                            _ => assert!(net.is_none() && conn_base[peer] == 0, "rank {rank}"),
                        }
                        // Both ranks connected before either closes its connections.
                        bootstrap.barrier().unwrap();
                        drop(net);
                    });
                }
            });
        }
    }
}

/// Peer information for tests: CUDA ranks on made-up hosts and GPUs.
#[cfg(test)]
pub(crate) mod test_peers {
    use super::*;

    pub(crate) fn cuda_peer(bus: &str, host: &str, pid: u32) -> PeerInfo {
        PeerInfo {
            cuda: true,
            dev: 0,
            bus_id: bus.into(),
            host: host.into(),
            pid,
            start_time: 77,
            p2p_disable: false,
            shm_disable: false,
            p2p_level: None,
            p2p_denied: Vec::new(),
            sms: 0,
            shm_name: format!("oxccl-1-{pid}-r0"),
            nch: 4,
            conn_bytes: 1 << 20,
            conn: ConnDesc::Ipc {
                ptr: 0x7f00_0000_0000,
                handle: std::array::from_fn(|i| i as u8 * 3),
            },
            abort_page: String::new(),
        }
    }

    /// CUDA ranks 0-2 on host h (bus ids 0000:0r:00.0), rank 3 on host k.
    pub(crate) fn four_peers() -> Vec<PeerInfo> {
        (0..4)
            .map(|r| {
                cuda_peer(
                    &format!("0000:{r:02x}:00.0"),
                    if r == 3 { "k" } else { "h" },
                    r as u32,
                )
            })
            .collect()
    }
}
