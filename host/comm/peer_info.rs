//! What the ranks tell each other at init and how a pair of ranks connects (NCCL's peer info in
//! `init.cc` and the P2P checks of `transport/p2p.cc`): each rank's [`PeerInfo`] (host, process,
//! device, bus id, connection memory), the checks that the ranks' infos agree, the transport a
//! ring edge takes, and `NCCL_P2P_LEVEL` / `NCCL_P2P_DISABLE` against the topology's path type.
use super::*;

/// What one rank tells the others at init (the seed's `ncclPeerInfo`, gathered by AllGather1),
/// including how to reach its connection memory.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct PeerInfo {
    pub(super) cuda: bool,
    /// CUDA ordinal in the rank's own process, or CPU-target device index.
    pub(super) dev: usize,
    /// PCI bus id of the GPU (CUDA); empty on the CPU target.
    pub(super) bus_id: String,
    /// Host name (or `OXCCL_HOSTID`), and a hash of it (NCCL's hostHash).
    pub(super) host: String,
    pub(super) host_hash: u64,
    pub(super) pid: u32,
    /// Process start time (`/proc/<pid>/stat` field 22, clock ticks): tells a live peer from a
    /// reused pid.
    pub(super) start_time: u64,
    /// `NCCL_P2P_DISABLE=1` in the rank's environment.
    pub(super) p2p_disable: bool,
    /// `NCCL_SHM_DISABLE=1` in the rank's environment.
    pub(super) shm_disable: bool,
    /// `NCCL_P2P_LEVEL` in the rank's environment (`None`: unset).
    pub(super) p2p_level: Option<crate::topo::PathType>,
    /// Ranks of this rank's host with which `NCCL_P2P_LEVEL` (either side's) forbids P2P, so
    /// their pair uses SHM (or NET) as NCCL's `p2pCanConnect` refusal does; filled after the
    /// peer all-gather by [`exchange_p2p_denied`], not part of [`PeerInfo::encode`].
    pub(super) p2p_denied: Vec<usize>,
    /// Name of the `/dev/shm` segment of its SHM connection memory (CUDA ranks create it only
    /// when a ring neighbour uses SHM; CPU-target ranks always, as [`ConnDesc::Shm`]).
    pub(super) shm_name: String,
    /// Channels and connection-memory bytes per rank: every rank must agree.
    pub(super) nch: u32,
    pub(super) conn_bytes: u64,
    pub(super) conn: ConnDesc,
    /// Name of the shared abort page this rank offers (the ranks of a host use their lowest
    /// rank's).
    pub(super) abort_page: String,
}

/// How peers reach a rank's connection memory.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum ConnDesc {
    /// CPU target: a `/dev/shm` segment name.
    Shm(String),
    /// CUDA: the device pointer in the owner's process and its IPC handle.
    Ipc {
        ptr: u64,
        handle: [u8; cuda::IPC_HANDLE_BYTES],
    },
}

impl ConnDesc {
    /// `shm NAME` or `ipc PTR HANDLE` (hex), one line.
    pub(super) fn encode(&self) -> String {
        match self {
            ConnDesc::Shm(name) => format!("shm {name}"),
            ConnDesc::Ipc { ptr, handle } => format!(
                "ipc {ptr:x} {}",
                handle.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
        }
    }

    /// Parses [`ConnDesc::encode`]; `None` when malformed.
    pub(super) fn decode(s: &str) -> Option<ConnDesc> {
        match s.split(' ').collect::<Vec<_>>()[..] {
            ["shm", name] => Some(ConnDesc::Shm(name.to_string())),
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

use crate::liveness::proc_start;

impl PeerInfo {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn local(
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
            host_hash: crate::hash::fnv1a_64(host.as_bytes()),
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

    pub(super) fn kind(&self) -> &'static str {
        if self.cuda { "cuda" } else { "cpu" }
    }

    /// One line per field; byte strings in hex.
    pub(super) fn encode(&self) -> String {
        let conn = self.conn.encode();
        [
            self.kind().to_string(),
            self.dev.to_string(),
            self.bus_id.clone(),
            self.host.clone(),
            format!("{:x}", self.host_hash),
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
        ]
        .join("\n")
    }

    /// Parses rank `rank`'s [`PeerInfo::encode`]; `Remote` naming the rank when malformed.
    pub(super) fn decode(rank: usize, b: &[u8]) -> Result<PeerInfo> {
        let bad = |what: &str| Error::Remote(format!("rank {rank} sent malformed peer information ({what})"));
        let text = std::str::from_utf8(b).map_err(|_| bad("not UTF-8"))?;
        let f: Vec<&str> = text.split('\n').collect();
        if f.len() != 15 {
            return Err(bad(&format!("{} fields, expected 15", f.len())));
        }
        let num = |i: usize, what: &str| f[i].parse::<u64>().map_err(|_| bad(what));
        let conn = ConnDesc::decode(f[10]).ok_or_else(|| bad("connection descriptor"))?;
        Ok(PeerInfo {
            cuda: match f[0] {
                "cuda" => true,
                "cpu" => false,
                _ => return Err(bad("device kind")),
            },
            dev: num(1, "device")? as usize,
            bus_id: f[2].to_string(),
            host: f[3].to_string(),
            host_hash: u64::from_str_radix(f[4], 16).map_err(|_| bad("host hash"))?,
            pid: num(5, "pid")? as u32,
            start_time: num(6, "start time")?,
            p2p_disable: num(7, "P2P flag")? != 0,
            nch: num(8, "channels")? as u32,
            conn_bytes: num(9, "connection bytes")?,
            conn,
            abort_page: f[11].to_string(),
            shm_disable: num(12, "SHM flag")? != 0,
            shm_name: f[13].to_string(),
            p2p_level: match f[14] {
                "-" => None,
                v => Some(crate::params::parse_p2p_level("NCCL_P2P_LEVEL", v).map_err(|_| bad("P2P level"))?),
            },
            p2p_denied: Vec::new(),
        })
    }

    /// Name of the `/dev/shm` segment of the rank's tree connection memory for SHM tree peers.
    pub(super) fn tree_shm_name(&self) -> String {
        format!("{}-tree", self.shm_name)
    }

    /// The device as messages name it: `cpu device 1`, `cuda device 0 (bus id 0000:18:00.0)`.
    pub(super) fn describe_device(&self) -> String {
        if self.cuda {
            format!("cuda device {} (bus id {})", self.dev, self.bus_id)
        } else {
            format!("cpu device {}", self.dev)
        }
    }
}

/// Checks the gathered peer information, identically on every rank so every rank fails alike:
/// one device kind, one device per rank per host (C26), the same channels and buffer sizes. (Every
/// pair of ring neighbours has a transport: NET connects any two ranks, see [`ring_transport`].)
pub(super) fn check_peers(rank: usize, peers: &[PeerInfo]) -> Result<()> {
    let me = &peers[rank];
    let shared_ok = crate::params::env_var("ALLOW_SHARED_DEVICE").is_some_and(|(_, v)| v == "1");
    for (a, pa) in peers.iter().enumerate() {
        if pa.cuda != me.cuda {
            return Err(Error::InvalidUsage(format!(
                "rank {a} is on a {} device but rank {rank} is on a {} device: a communicator is all CUDA or all CPU-target",
                pa.kind(),
                me.kind()
            )));
        }
        if (pa.nch, pa.conn_bytes) != (me.nch, me.conn_bytes) {
            return Err(Error::InvalidUsage(format!(
                "rank {a} set up {} channels with {} bytes of connection memory but rank {rank} {} channels with {} bytes: \
                 NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE and NCCL_LL128_BUFFSIZE must be the same on every rank",
                pa.nch, pa.conn_bytes, me.nch, me.conn_bytes
            )));
        }
        for (b, pb) in peers.iter().enumerate().skip(a + 1) {
            let same_dev = if pa.cuda {
                pa.bus_id == pb.bus_id
            } else {
                pa.dev == pb.dev
            };
            if same_dev && pa.host == pb.host && !shared_ok {
                return Err(Error::InvalidUsage(format!(
                    "ranks {a} and {b} are both on {} of host {:?}; one device per rank is required \
                     (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)",
                    pa.describe_device(),
                    pa.host
                )));
            }
        }
    }
    Ok(())
}

/// The transport between ranks `a` and `b` (NCCL's `selectTransport`: the first of P2P, SHM, NET
/// that can connect them, [`crate::transport::select_transport`]), decided from both ranks'
/// information so the two ends agree. A rank is its own neighbour only in a 1-rank communicator,
/// which uses its own memory (reported as P2P).
pub(super) fn ring_transport(peers: &[PeerInfo], a: usize, b: usize) -> crate::transport::TransportKind {
    if a == b {
        return crate::transport::TransportKind::P2p;
    }
    // NCCL_P2P_LEVEL forbidding P2P for the pair counts as P2P disabled for it.
    let denied = peers[a].p2p_denied.contains(&b) || peers[b].p2p_denied.contains(&a);
    let info = |p: &PeerInfo| crate::transport::PeerInfo {
        cuda: p.cuda,
        host: p.host.clone(),
        p2p_disable: p.p2p_disable || denied,
        shm_disable: p.shm_disable,
    };
    crate::transport::select_transport(&info(&peers[a]), &info(&peers[b]))
}

/// `NCCL_P2P_LEVEL` between the CUDA ranks of each host (NCCL's `p2pCanConnect` refusing P2P
/// after `ncclTopoCheckP2p`): when any rank set a level, each CUDA rank finds the ranks of its
/// host whose GPU path (`path_of`, e.g. [`p2p_path_type`]) exceeds its own level or theirs, and
/// the lists are all-gathered into every [`PeerInfo::p2p_denied`], so that every rank's
/// [`ring_transport`] agrees (a rank cannot compute another host's paths). Such a pair then uses
/// SHM, or NET with SHM disabled, as in NCCL. Nothing is exchanged when no rank set a level
/// (every rank sees that alike in the gathered peer information). A path of unknown type allows
/// P2P, with a warning (see [`check_p2p_level`]).
///
/// Errors: a rank whose topology cannot be built sends its error instead, so every rank fails
/// naming it (`Remote`); bootstrap errors.
pub(super) fn exchange_p2p_denied(
    rank: usize,
    peers: &mut [PeerInfo],
    bootstrap: &crate::bootstrap::Bootstrap,
    path_of: impl Fn(&PeerInfo, &PeerInfo) -> Result<Option<crate::topo::PathType>>,
) -> Result<()> {
    if !peers.iter().any(|p| p.cuda && p.p2p_level.is_some()) {
        return Ok(());
    }
    let (_, all) = allgather_checked(
        bootstrap,
        rank,
        p2p_denied_by_level(rank, peers, path_of),
        |d| d.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(","),
        "cannot apply NCCL_P2P_LEVEL (its topology)",
    )?;
    for (a, b) in all.iter().enumerate() {
        let text = String::from_utf8_lossy(b);
        peers[a].p2p_denied = text
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<usize>()
                    .ok()
                    .filter(|&r| r < peers.len())
                    .ok_or_else(|| {
                        Error::Remote(format!("rank {a} sent a malformed P2P-level list: {text:?}"))
                    })
            })
            .collect::<Result<_>>()?;
    }
    Ok(())
}

/// The ranks of rank `rank`'s host with which `NCCL_P2P_LEVEL` (its own or theirs) forbids P2P:
/// their GPU path (`path_of`) is farther than the level (see [`exchange_p2p_denied`]). Errors:
/// those of `path_of`.
pub(super) fn p2p_denied_by_level(
    rank: usize,
    peers: &[PeerInfo],
    path_of: impl Fn(&PeerInfo, &PeerInfo) -> Result<Option<crate::topo::PathType>>,
) -> Result<Vec<usize>> {
    let me = &peers[rank];
    let mut denied = Vec::new();
    for (b, pb) in peers.iter().enumerate() {
        if b == rank || !me.cuda || !pb.cuda || pb.host != me.host {
            continue;
        }
        if me.p2p_level.is_none() && pb.p2p_level.is_none() {
            continue;
        }
        let path = path_of(me, pb)?;
        for lvl in [me.p2p_level, pb.p2p_level].into_iter().flatten() {
            if crate::params::p2p_allowed(Some(lvl), path) == Some(false) {
                tracing::info!(target: "oxccl::init", rank, peer = b, "NCCL_P2P_LEVEL={lvl} forbids P2P between rank {rank} ({}) and rank {b} ({}), {} apart: SHM or NET instead", me.describe_device(), pb.describe_device(), path.map_or("?", |p| p.as_str()));
                denied.push(b);
                break;
            }
        }
    }
    Ok(denied)
}

/// The type of the path between the GPUs of `a` and `b`, two CUDA ranks of one host, as
/// `NCCL_P2P_LEVEL` compares it: `LOC` for one GPU (same bus id); otherwise the path between their
/// bus ids in this machine's topology, built as NCCL's `ncclTopoGetSystem` does (the
/// `NCCL_TOPO_FILE` document if set, completed by detection from NVML and sysfs) and computed
/// as `ncclTopoComputePaths` does before any P2P-level rerouting: NVLink (direct or through
/// NVSwitches) gives `NVL`, PCI paths `PIX` / `PXB` / `PHB` / `SYS`. `None` when the topology
/// lacks either GPU (no NVML and no file entry for it). Errors: an unreadable or malformed
/// topology file, bad path variables.
pub(super) fn p2p_path_type(a: &PeerInfo, b: &PeerInfo) -> Result<Option<crate::topo::PathType>> {
    gpu_path_type(&a.bus_id, &b.bus_id)
}

/// [`p2p_path_type`] between the GPUs at PCI bus ids `a` and `b` of this host.
pub(super) fn gpu_path_type(a: &str, b: &str) -> Result<Option<crate::topo::PathType>> {
    use crate::topo::detect;
    if a == b {
        return Ok(Some(crate::topo::PathType::Loc));
    }
    let mut xml = crate::topo::Xml::from_env()?.unwrap_or_else(crate::topo::Xml::new_system);
    let nvml = detect::NvmlProbe::shared().map(|n| n as &dyn detect::NvmlSource);
    detect::detect_into(&mut xml, &detect::DetectOptions::from_env(), nvml, None);
    let raw = crate::topo::PathOptions {
        p2p_level: Some(crate::topo::PathType::Sys),
        ..Default::default()
    };
    let sys = crate::topo::System::from_xml_with(xml, raw)?;
    let path = topo_gpu_path(&sys, a, b);
    tracing::debug!(target: "oxccl::init", from = %a, to = %b, path = ?path.map(|p| p.as_str()), "GPU path type for NCCL_P2P_LEVEL");
    Ok(path)
}

/// The path type from the GPU at `from` to the GPU at `to` (PCI bus ids) in `sys`; `None` when
/// either is not a GPU of `sys`.
pub(super) fn topo_gpu_path(sys: &crate::topo::System, from: &str, to: &str) -> Option<crate::topo::PathType> {
    let gpu = |bus: &str| sys.node_by_bus_id(crate::topo::NodeType::Gpu, bus);
    Some(sys.paths().kind(gpu(from)?, gpu(to)?))
}

/// Applies `NCCL_P2P_LEVEL` (`level`) to CUDA ranks `me` and `peer` (NCCL's `ncclTopoCheckP2p`
/// within `p2pCanConnect`): P2P only when their path type (`path_of`, e.g. [`p2p_path_type`]) is at
/// most the level, by [`crate::params::p2p_allowed`]. When the path type is unknown (a GPU that
/// neither NVML nor `NCCL_TOPO_FILE` describes), only `LOC` refuses (two distinct GPUs); other
/// levels are not applied and a warning says so. `Ok` when P2P may be used; `System` naming both ranks, the level and the path type when it
/// may not (oxccl does not fall back to SHM/NET then, as NCCL would: `NCCL_P2P_DISABLE=1` selects them).
pub(super) fn check_p2p_level(
    me: usize,
    mi: &PeerInfo,
    peer: usize,
    pi: &PeerInfo,
    level: Option<crate::topo::PathType>,
    path_of: impl Fn(&PeerInfo, &PeerInfo) -> Result<Option<crate::topo::PathType>>,
) -> Result<()> {
    let Some(lvl) = level else {
        return Ok(());
    };
    let path = path_of(mi, pi)?;
    match crate::params::p2p_allowed(level, path) {
        Some(true) => {
            tracing::debug!(target: "oxccl::init", rank = me, peer, level = %lvl, path = ?path.map(|p| p.as_str()), "NCCL_P2P_LEVEL allows P2P");
            Ok(())
        }
        Some(false) => Err(Error::System(format!(
            "rank {me} ({}) cannot use P2P with rank {peer} ({}): NCCL_P2P_LEVEL={lvl} allows P2P up to {lvl} \
             paths but their path is {}",
            mi.describe_device(),
            pi.describe_device(),
            path.map_or("at least NVL (two distinct GPUs)", |p| p.as_str()),
        ))),
        None => {
            tracing::warn!(target: "oxccl::init", rank = me, peer, "NCCL_P2P_LEVEL={lvl} not applied between rank {me} ({}) and rank {peer} ({}): their path type is unknown (NVML does not describe both GPUs; NCCL_TOPO_FILE can)", mi.describe_device(), pi.describe_device());
            Ok(())
        }
    }
}

#[cfg(test)]
mod p2p_level_tests {
    use super::*;
    use crate::topo::PathType;

    fn gpu(rank: usize, bus_id: &str) -> PeerInfo {
        PeerInfo {
            cuda: true,
            dev: rank,
            bus_id: bus_id.into(),
            host: "h".into(),
            host_hash: crate::hash::fnv1a_64(b"h"),
            pid: 100 + rank as u32,
            start_time: 1,
            p2p_disable: false,
            shm_disable: false,
            p2p_level: None,
            p2p_denied: Vec::new(),
            shm_name: String::new(),
            nch: 1,
            conn_bytes: 64,
            conn: ConnDesc::Ipc {
                ptr: 0,
                handle: [0; cuda::IPC_HANDLE_BYTES],
            },
            abort_page: String::new(),
        }
    }

    fn topo(file: &str) -> crate::topo::System {
        let path = format!("{}/tests/topo/{file}", env!("CARGO_MANIFEST_DIR"));
        let raw = crate::topo::PathOptions {
            p2p_level: Some(PathType::Sys),
            ..Default::default()
        };
        crate::topo::System::from_xml_with(crate::topo::Xml::from_file(&path).unwrap(), raw).unwrap()
    }

    #[test]
    fn path_types_from_the_topology() {
        // The 2xH200 machine (NCCL's own dump): both GPUs on the NVSwitch -> NVL.
        let h200 = topo("h200x2-nccl-topo.xml");
        assert_eq!(
            topo_gpu_path(&h200, "0000:00:06.0", "0000:00:07.0"),
            Some(PathType::Nvl)
        );
        assert_eq!(
            topo_gpu_path(&h200, "0000:00:06.0", "0000:00:06.0"),
            Some(PathType::Loc)
        );
        assert_eq!(topo_gpu_path(&h200, "0000:00:06.0", "0000:99:00.0"), None);
        // 8 PCIe GPUs, two per PCI switch, two switches per socket: GPUs 0 (11:00.0) and 1
        // (13:00.0) share switch 10:00.0 -> PIX; GPU 2 (31:00.0) is under another switch of the
        // same CPU -> PHB; GPU 4 (51:00.0) is on the other socket -> SYS.
        let pcie = topo("pcie-8gpu-2socket-topo.xml");
        assert_eq!(
            topo_gpu_path(&pcie, "0000:11:00.0", "0000:13:00.0"),
            Some(PathType::Pix)
        );
        assert_eq!(
            topo_gpu_path(&pcie, "0000:11:00.0", "0000:31:00.0"),
            Some(PathType::Phb)
        );
        assert_eq!(
            topo_gpu_path(&pcie, "0000:11:00.0", "0000:51:00.0"),
            Some(PathType::Sys)
        );
    }

    #[test]
    fn level_rule_at_connect() {
        let (a, b) = (gpu(0, "0000:11:00.0"), gpu(1, "0000:13:00.0"));
        let pix = |_: &PeerInfo, _: &PeerInfo| Ok(Some(PathType::Pix));
        let unknown = |_: &PeerInfo, _: &PeerInfo| Ok(None);
        // Unset, or a level at or beyond the path: P2P.
        for level in [
            None,
            Some(PathType::Pix),
            Some(PathType::Pxb),
            Some(PathType::Sys),
        ] {
            check_p2p_level(0, &a, 1, &b, level, pix).unwrap();
        }
        // NVL below a PIX path: refused, naming both ranks, the level and the path.
        let e = check_p2p_level(0, &a, 1, &b, Some(PathType::Nvl), pix).unwrap_err();
        assert_eq!(
            e.to_string(),
            "system error: rank 0 (cuda device 0 (bus id 0000:11:00.0)) cannot use P2P with rank 1 (cuda device 1 \
             (bus id 0000:13:00.0)): NCCL_P2P_LEVEL=NVL allows P2P up to NVL paths but their path is PIX"
        );
        // Unknown path: LOC still refuses two distinct GPUs; other levels are not applied.
        let e = check_p2p_level(1, &b, 0, &a, Some(PathType::Loc), unknown).unwrap_err();
        assert!(
            e.to_string()
                .contains("NCCL_P2P_LEVEL=LOC allows P2P up to LOC paths but their path is at least NVL (two distinct GPUs)"),
            "{e}"
        );
        check_p2p_level(0, &a, 1, &b, Some(PathType::Nvl), unknown).unwrap();
        // Bus ids that no machine has: neither NVML nor sysfs describes them, so the path type
        // is unknown (the lib tests never set NCCL_TOPO_FILE).
        let (x, y) = (gpu(0, "00ff:fe:00.0"), gpu(1, "00ff:fe:01.0"));
        assert_eq!(p2p_path_type(&x, &y).unwrap(), None);
        // One GPU shared by two ranks: LOC, allowed even at level LOC (no topology needed).
        let shared = gpu(1, "0000:11:00.0");
        assert_eq!(p2p_path_type(&a, &shared).unwrap(), Some(PathType::Loc));
        check_p2p_level(0, &a, 1, &shared, Some(PathType::Loc), p2p_path_type).unwrap();
        // A failing path lookup (e.g. a malformed NCCL_TOPO_FILE) is returned as is.
        let broken = |_: &PeerInfo, _: &PeerInfo| Err(Error::invalid("NCCL_TOPO_FILE: bad"));
        assert!(check_p2p_level(0, &a, 1, &b, Some(PathType::Nvl), broken).is_err());
        check_p2p_level(0, &a, 1, &b, None, broken).unwrap();
    }
}
