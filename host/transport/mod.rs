//! Transports: how a rank's ring and tree connections reach its neighbours (NCCL's
//! `transport.cc`, `transport/{p2p,shm,net}.cc`).
//!
//! | file | what | NCCL |
//! |---|---|---|
//! | `mod.rs` | what ranks tell each other (`PeerInfo`), the transport interface (`Transport`, in NCCL's order `TRANSPORTS`) and the one selection per pair (`select_transport`), the NET setup of ring neighbours ([`connect_net`]) | `transport.h`, `transport.cc`, `net.cc` setup |
//! | `link.rs` | a rank's connection memory (`OwnConn`, `HostConns`) and its links to its neighbours' (`PeerLink`) | `transport.cc` (`ncclTransportP2pSetup`), the transports' `connect`/`free` |
//! | `p2p.rs` | P2P: can-connect rules, `NCCL_P2P_LEVEL` and its exchange, peer access, direct pointers and CUDA IPC | `transport/p2p.cc` |
//! | `shm.rs` | SHM: can-connect rule, `/dev/shm` segments registered with CUDA | `transport/shm.cc` |
//! | `net_transport.rs` | the NET transport's setup: staging FIFOs, NET blocks, proxy connections of ring and tree neighbours | `transport/net.cc`, `proxy.cc` connect |
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
pub(crate) mod link;
pub mod net;
pub mod net_socket;
mod net_transport;
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
pub(crate) use link::{HostConns, OwnConn, PeerLink, PeerMem};
pub use net_transport::*;
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
    /// Compute capability × 10 of the GPU (CUDA; 0 on the CPU target): the communicator's
    /// oldest decides which types it reduces (NCCL's `minCompCap`).
    pub(crate) cc: u32,
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
            cc: match ctx {
                Some(c) => c.compute_capability()?,
                None => 0,
            },
            host,
            pid,
            start_time: proc_start(pid).map_or(0, |(t, _)| t),
            p2p_disable: p2p::disabled_by_env(),
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
            self.cc.to_string(),
        ]
        .join("\n")
    }

    /// Parses rank `rank`'s [`PeerInfo::encode`]; `Remote` naming the rank when malformed.
    pub(crate) fn decode(rank: usize, b: &[u8]) -> Result<PeerInfo> {
        let bad = |what: &str| Error::Remote(format!("rank {rank} sent malformed peer information ({what})"));
        let text = std::str::from_utf8(b).map_err(|_| bad("not UTF-8"))?;
        let f: Vec<&str> = text.split('\n').collect();
        if f.len() != 16 {
            return Err(bad(&format!("{} fields, expected 16", f.len())));
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
            cc: num(15, "compute capability")? as u32,
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
    TRANSPORTS
        .iter()
        .find(|t| t.can_connect(pa, pb, denied))
        .map_or(TransportKind::Net, |t| t.kind())
}

/// A transport (NCCL's `ncclTransport`: `canConnect`, then per peer `setup`/`connect`/`free`):
/// whether it can connect two ranks, and how a rank opens a neighbour's connection memory over
/// it. The memory a rank offers is its [`OwnConn`] (plus, on CUDA, its [`HostConns`] for SHM and
/// NET neighbours), described to the peers in its [`PeerInfo`]; freeing is dropping the
/// [`PeerLink`] `connect` returned. NET connects every channel of a rank at once through the
/// proxy ([`connect_net`], [`connect_planned`]), so its per-peer `connect` is not used.
pub(crate) trait Transport: Sync {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;
    /// NCCL's `canConnect`, from both ranks' information (symmetric); `denied`: `NCCL_P2P_LEVEL`
    /// forbids P2P for the pair.
    fn can_connect(&self, a: &PeerInfo, b: &PeerInfo, denied: bool) -> bool;
    /// NCCL's `connect` of one neighbour: opens `to.target`, the memory `to.peer` offers.
    fn connect(&self, to: &ConnectTo<'_>) -> Result<PeerLink>;
}

/// What [`Transport::connect`] needs: rank `me` of `peers` connects to `peer`'s connection
/// memory `target`, with its CUDA context `ctx` (`None` on the CPU target), its `NCCL_P2P_LEVEL`
/// and this init's topology (for the P2P level).
pub(crate) struct ConnectTo<'a> {
    pub(crate) me: usize,
    pub(crate) peers: &'a [PeerInfo],
    pub(crate) peer: usize,
    pub(crate) ctx: Option<&'a Arc<cuda::Context>>,
    pub(crate) target: PeerMem<'a>,
    pub(crate) p2p_level: Option<crate::topo::PathType>,
    pub(crate) topo: &'a crate::topo::LocalTopo,
}

/// The transports in NCCL's order of preference: the first that can connect a pair is used.
pub(crate) const TRANSPORTS: [&dyn Transport; 3] = [&p2p::P2pTransport, &shm::ShmTransport, &NetTransport];

/// The transport of `kind`.
pub(crate) fn transport(kind: TransportKind) -> &'static dyn Transport {
    match kind {
        TransportKind::P2p => &p2p::P2pTransport,
        TransportKind::Shm => &shm::ShmTransport,
        TransportKind::Net => &NetTransport,
    }
}

/// The NET transport: always can connect (the last resort); its connections are made per rank
/// for all channels at once ([`connect_net`], [`connect_planned`]).
pub(crate) struct NetTransport;

impl Transport for NetTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Net
    }
    fn can_connect(&self, _: &PeerInfo, _: &PeerInfo, _: bool) -> bool {
        true
    }
    fn connect(&self, to: &ConnectTo<'_>) -> Result<PeerLink> {
        Err(Error::Internal(format!(
            "rank {}: the NET connection to rank {} is made by connect_net with the rank's others",
            to.me, to.peer
        )))
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
    fn transports_are_tried_in_nccls_order_and_found_by_kind() {
        use TransportKind::*;
        assert_eq!(TRANSPORTS.map(|t| t.kind()), [P2p, Shm, Net]);
        for k in [P2p, Shm, Net] {
            assert_eq!(transport(k).kind(), k);
        }
        // NET can always connect (the last resort); its per-peer connect is connect_net's.
        let (a, b) = (cuda_peer("0000:01:00.0", "h1", 1), cuda_peer("0000:02:00.0", "h2", 2));
        assert!(NetTransport.can_connect(&a, &b, true));
        assert!(!shm::ShmTransport.can_connect(&a, &b, false), "two hosts");
        assert!(!p2p::P2pTransport.can_connect(&a, &b, false), "two hosts");
        let peers = [a, b];
        let desc = ConnDesc::Shm(String::new());
        let to = ConnectTo {
            me: 0,
            peers: &peers,
            peer: 1,
            ctx: None,
            target: PeerMem {
                desc: &desc,
                shm_name: "",
                bytes: 0,
            },
            p2p_level: None,
            topo: &crate::topo::LocalTopo::default(),
        };
        let e = transport(Net).connect(&to).err().expect("NET connects through connect_net");
        assert!(matches!(e, Error::Internal(_)), "{e}");
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
            cc: 0,
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
            "remote error: rank 3 sent malformed peer information (2 fields, expected 16)"
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
                            abort_who: abort.addr() + crate::proxy::ABORT_LINE_WHO,
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
            cc: 0,
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
