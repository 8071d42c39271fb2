//! What the ranks tell each other at init and how a pair of ranks connects (NCCL's peer info in
//! `init.cc` and the P2P checks of `transport/p2p.cc`): each rank's [`PeerInfo`] (host, process,
//! device, bus id, connection memory), the checks that the ranks' infos agree, the transport a
//! ring edge takes, and `NCCL_P2P_LEVEL` / `NCCL_P2P_DISABLE` against the topology's path type;
//! the settings every rank must share ([`plan_settings`]) and the all-gather that fails every rank
//! alike when one fails ([`allgather_checked`]).
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
    /// Host name (or `OXCCL_HOSTID`): ranks with equal names are on one host (NCCL's hostHash).
    pub(super) host: String,
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
        if f.len() != 14 {
            return Err(bad(&format!("{} fields, expected 14", f.len())));
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
/// pair of ring neighbours has a transport: NET connects any two ranks, see [`transport_between`].)
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
/// information so the two ends agree. This is the one choice per pair of an `init_rank`
/// communicator: its ring connections, its trees ([`rank_trees`]), the NET setup
/// ([`crate::transport::connect_net`]) and the LL128 and tuning decisions all follow it. A rank
/// is its own neighbour only in a 1-rank communicator, which uses its own memory (reported as
/// P2P).
pub(super) fn transport_between(peers: &[PeerInfo], a: usize, b: usize) -> crate::transport::TransportKind {
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
/// host whose GPU path (`path_of`, e.g. [`GpuPaths::of_peers`]) exceeds its own level or theirs, and
/// the lists are all-gathered into every [`PeerInfo::p2p_denied`], so that every rank's
/// [`transport_between`] agrees (a rank cannot compute another host's paths). Such a pair then uses
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

/// The types of the paths between this host's GPUs as `NCCL_P2P_LEVEL` compares them, from one
/// topology per init, built on first use (NCCL builds its system once per communicator,
/// `ncclTopoGetSystem`): an init that applies no level never builds it, and one that does builds
/// it once however many pairs it checks.
#[derive(Default)]
pub(super) struct GpuPaths {
    sys: std::cell::OnceCell<crate::topo::System>,
}

impl GpuPaths {
    /// The type of the path between the GPUs at PCI bus ids `a` and `b` of this host: `LOC` for
    /// one GPU (same bus id); otherwise the path between them in this machine's topology, built
    /// as NCCL's `ncclTopoGetSystem` does (the `NCCL_TOPO_FILE` document if set, completed by
    /// detection from NVML and sysfs) and computed as `ncclTopoComputePaths` does before any
    /// P2P-level rerouting: NVLink (direct or through NVSwitches) gives `NVL`, PCI paths `PIX` /
    /// `PXB` / `PHB` / `SYS`. `None` when the topology lacks either GPU (no NVML and no file
    /// entry for it). Errors: an unreadable or malformed topology file, bad path variables.
    pub(super) fn between(&self, a: &str, b: &str) -> Result<Option<crate::topo::PathType>> {
        if a == b {
            return Ok(Some(crate::topo::PathType::Loc));
        }
        if self.sys.get().is_none() {
            let _ = self.sys.set(Self::build()?);
        }
        let Some(sys) = self.sys.get() else {
            return Err(Error::Internal("the GPU topology was built but is not there".into()));
        };
        let path = topo_gpu_path(sys, a, b);
        tracing::debug!(target: "oxccl::init", from = %a, to = %b, path = ?path.map(|p| p.as_str()), "GPU path type for NCCL_P2P_LEVEL");
        Ok(path)
    }

    /// [`GpuPaths::between`] the GPUs of CUDA ranks `a` and `b`.
    pub(super) fn of_peers(&self, a: &PeerInfo, b: &PeerInfo) -> Result<Option<crate::topo::PathType>> {
        self.between(&a.bus_id, &b.bus_id)
    }

    fn build() -> Result<crate::topo::System> {
        use crate::topo::detect;
        let mut xml = crate::topo::Xml::from_env()?.unwrap_or_else(crate::topo::Xml::new_system);
        let nvml = detect::NvmlProbe::shared().map(|n| n as &dyn detect::NvmlSource);
        detect::detect_into(&mut xml, &detect::DetectOptions::from_env(), nvml, None);
        let raw = crate::topo::PathOptions {
            p2p_level: Some(crate::topo::PathType::Sys),
            ..Default::default()
        };
        crate::topo::System::from_xml_with(xml, raw)
    }
}

/// The path type from the GPU at `from` to the GPU at `to` (PCI bus ids) in `sys`; `None` when
/// either is not a GPU of `sys`.
pub(super) fn topo_gpu_path(sys: &crate::topo::System, from: &str, to: &str) -> Option<crate::topo::PathType> {
    let gpu = |bus: &str| sys.node_by_bus_id(crate::topo::NodeType::Gpu, bus);
    Some(sys.paths().kind(gpu(from)?, gpu(to)?))
}

/// Applies `NCCL_P2P_LEVEL` (`level`) to CUDA ranks `me` and `peer` (NCCL's `ncclTopoCheckP2p`
/// within `p2pCanConnect`): P2P only when their path type (`path_of`, e.g. [`GpuPaths::of_peers`]) is at
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

/// The settings that decide how each call runs and must therefore be the same on every rank
/// (NCCL requires it; a rank planning another protocol, algorithm or channel count than its peers
/// waits for them forever): one `NAME=value` line each, in a fixed order, from the parsed values
/// (so `LL,Simple` and `Simple,LL` agree).
pub(super) fn plan_settings(p: &Params, s: &Selection) -> String {
    let names = |v: &[bool], all: &[&str]| -> String {
        let on: Vec<&str> = all.iter().zip(v).filter(|(_, b)| **b).map(|(n, _)| *n).collect();
        format!("{{{}}}", on.join(","))
    };
    let opt = |v: Option<u32>| v.map_or("unset".to_string(), |v| v.to_string());
    [
        (
            "NCCL_PROTO",
            names(
                &s.protos.0,
                &[Proto::Ll.name(), Proto::Ll128.name(), Proto::Simple.name()],
            ),
        ),
        (
            "NCCL_ALGO",
            names(&s.algos.0, &[Algo::Tree.name(), Algo::Ring.name()]),
        ),
        ("NCCL_MIN_NCHANNELS", opt(p.min_nchannels)),
        ("NCCL_MAX_NCHANNELS", opt(p.max_nchannels)),
        ("NCCL_NTHREADS", p.nthreads.to_string()),
        ("NCCL_BUFFSIZE", p.buffsize.to_string()),
        ("NCCL_LL_BUFFSIZE", p.ll_buffsize.to_string()),
        ("NCCL_LL128_BUFFSIZE", p.ll128_buffsize.to_string()),
        ("OXCCL_TEST_INITIAL_STEP", p.initial_step.to_string()),
    ]
    .iter()
    .map(|(k, v)| format!("{k}={v}"))
    .collect::<Vec<_>>()
    .join("\n")
}

/// Compares every rank's [`plan_settings`] record (`all`, by rank) with this rank's: the first
/// setting that differs fails init on every rank alike with `InvalidUsage` naming the variable,
/// the lowest rank whose value differs from rank 0's, and both values.
pub(super) fn check_plan_settings(rank: usize, all: &[Vec<u8>]) -> Result<()> {
    let lines =
        |b: &[u8]| -> Vec<String> { String::from_utf8_lossy(b).lines().map(str::to_string).collect() };
    let Some(first) = all.first().map(|b| lines(b)) else {
        return Ok(());
    };
    for (r, b) in all.iter().enumerate().skip(1) {
        let other = lines(b);
        if let Some((a, o)) = first.iter().zip(&other).find(|(a, o)| a != o) {
            let (name, v0) = a.split_once('=').unwrap_or((a.as_str(), ""));
            let v = o.split_once('=').map_or(o.as_str(), |(_, v)| v);
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: {name} differs across ranks: rank 0 has {v0}, rank {r} has {v} \
                 (also spelled OXCCL_{}; every rank must set the same value)",
                name.trim_start_matches("NCCL_").trim_start_matches("OXCCL_")
            )));
        }
    }
    Ok(())
}

/// Prefix of a rank's record in an `init_rank` all-gather when that rank failed (its error follows).
pub(super) const INIT_ERR_PREFIX: &str = "ERR ";

/// An `init_rank` all-gather after a step that may fail on some ranks: each rank sends
/// `record(&value)` of its result `mine`, or its error, so every rank learns of a failure at the
/// same step and fails at once, naming the rank (rather than one rank leaving and the others
/// waiting out the bootstrap timeout). Returns this rank's value and every rank's record.
///
/// Errors: this rank's own error as it is; else `Remote` "rank {rank}: rank {r} {what}: {error}"
/// for the first rank `r` that failed; bootstrap errors.
pub(super) fn allgather_checked<T>(
    bootstrap: &crate::bootstrap::Bootstrap,
    rank: usize,
    mine: Result<T>,
    record: impl FnOnce(&T) -> String,
    what: &str,
) -> Result<(T, Vec<Vec<u8>>)> {
    let sent = match &mine {
        Ok(v) => record(v),
        Err(e) => format!("{INIT_ERR_PREFIX}{e}"),
    };
    let all = bootstrap.allgather(sent.as_bytes())?;
    let value = mine?;
    if let Some((r, e)) = all.iter().enumerate().find_map(|(r, b)| {
        String::from_utf8_lossy(b)
            .strip_prefix(INIT_ERR_PREFIX)
            .map(|e| (r, e.to_string()))
    }) {
        return Err(Error::Remote(format!("rank {rank}: rank {r} {what}: {e}")));
    }
    Ok((value, all))
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
        let paths = GpuPaths::default();
        assert_eq!(paths.of_peers(&x, &y).unwrap(), None);
        // One GPU shared by two ranks: LOC, allowed even at level LOC (no topology needed).
        let shared = gpu(1, "0000:11:00.0");
        assert_eq!(paths.of_peers(&a, &shared).unwrap(), Some(PathType::Loc));
        check_p2p_level(0, &a, 1, &shared, Some(PathType::Loc), |a, b| paths.of_peers(a, b)).unwrap();
        // A failing path lookup (e.g. a malformed NCCL_TOPO_FILE) is returned as is.
        let broken = |_: &PeerInfo, _: &PeerInfo| Err(Error::invalid("NCCL_TOPO_FILE: bad"));
        assert!(check_p2p_level(0, &a, 1, &b, Some(PathType::Nvl), broken).is_err());
        check_p2p_level(0, &a, 1, &b, None, broken).unwrap();
    }
}

#[cfg(test)]
pub(super) mod peer_tests {
    use super::*;
    use crate::liveness::proc_start;

    pub(in crate::comm) fn cuda_peer(bus: &str, host: &str, pid: u32) -> PeerInfo {
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
    fn four_peers() -> Vec<PeerInfo> {
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

    #[test]
    fn p2p_level_denies_far_pairs_which_then_use_shm() {
        use crate::topo::PathType;
        use crate::transport::TransportKind::{Net, P2p, Shm};
        // Host h: ranks 0, 1, 2; host k: rank 3. Paths on h (fake, by bus id pair): 0-1 NVL,
        // 0-2 and 1-2 SYS. Rank 2 sets NCCL_P2P_LEVEL=PHB, rank 0 NVL, rank 1 nothing.
        let mut p = four_peers();
        p[0].p2p_level = Some(PathType::Nvl);
        p[2].p2p_level = Some(PathType::Phb);
        let path = |a: &PeerInfo, b: &PeerInfo| -> Result<Option<PathType>> {
            let far = a.bus_id.ends_with("02:00.0") || b.bus_id.ends_with("02:00.0");
            Ok(Some(if far { PathType::Sys } else { PathType::Nvl }))
        };
        // Rank 0 (NVL): 1 is NVL (allowed), 2 is SYS (denied by both levels); 3 is another host.
        assert_eq!(p2p_denied_by_level(0, &p, path).unwrap(), vec![2]);
        // Rank 1 (no level): only rank 2's PHB applies to 1-2 (SYS > PHB): denied; 0-1 NVL ok.
        assert_eq!(p2p_denied_by_level(1, &p, path).unwrap(), vec![2]);
        assert_eq!(p2p_denied_by_level(2, &p, path).unwrap(), vec![0, 1]);
        assert_eq!(p2p_denied_by_level(3, &p, path).unwrap(), Vec::<usize>::new());
        // What the all-gather hands every rank; denied pairs fall back to SHM, or NET with SHM
        // off, seen alike from both ends.
        for r in 0..4 {
            p[r].p2p_denied = p2p_denied_by_level(r, &p, path).unwrap();
        }
        for (a, b, k) in [(0, 1, P2p), (1, 2, Shm), (2, 0, Shm), (2, 3, Net)] {
            assert_eq!(
                (transport_between(&p, a, b), transport_between(&p, b, a)),
                (k, k),
                "{a}-{b}"
            );
        }
        p[1].shm_disable = true;
        assert_eq!(transport_between(&p, 1, 2), Net);
        // A path error is the caller's error.
        let broken =
            |_: &PeerInfo, _: &PeerInfo| -> Result<Option<PathType>> { Err(Error::invalid("bad topology")) };
        assert!(p2p_denied_by_level(0, &p, broken).is_err());
    }

    #[test]
    fn peer_info_round_trips() {
        let mut p = cuda_peer("0000:18:00.0", "node a", 4242);
        p.abort_page = "oxccl-1-2-abort".into();
        p.shm_disable = true;
        p.p2p_level = Some(crate::topo::PathType::Pxb);
        assert_eq!(PeerInfo::decode(0, p.encode().as_bytes()).unwrap(), p);
        let q = PeerInfo {
            cuda: false,
            bus_id: String::new(),
            conn: ConnDesc::Shm("oxccl-1-2-r1".into()),
            p2p_level: None,
            ..p
        };
        assert_eq!(PeerInfo::decode(1, q.encode().as_bytes()).unwrap(), q);
        let e = PeerInfo::decode(3, b"cuda\n0").unwrap_err();
        assert_eq!(
            e.to_string(),
            "remote error: rank 3 sent malformed peer information (2 fields, expected 14)"
        );
    }

    #[test]
    fn cuda_rules_name_both_ranks() {
        // Two processes whose CUDA ordinal is 0 but on different GPUs (CUDA_VISIBLE_DEVICES): fine.
        let (a, b) = (
            cuda_peer("0000:18:00.0", "h", 1),
            cuda_peer("0000:2a:00.0", "h", 2),
        );
        check_peers(0, &[a.clone(), b.clone()]).unwrap();
        // The same bus id twice: C26, naming both ranks and the bus id.
        let e = check_peers(1, &[a.clone(), a.clone()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid usage: ranks 0 and 1 are both on cuda device 0 (bus id 0000:18:00.0) of host \"h\"; one device \
             per rank is required (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)"
        );
        // NCCL_P2P_DISABLE=1 on either side, or different hosts: fine (SHM or NET connects them).
        let mut c = b.clone();
        c.p2p_disable = true;
        check_peers(0, &[a.clone(), c]).unwrap();
        let d = cuda_peer("0000:2a:00.0", "other", 2);
        check_peers(0, &[a.clone(), d]).unwrap();
        // A CPU-target rank among CUDA ranks.
        let mut cpu = b;
        cpu.cuda = false;
        let e = check_peers(0, &[a, cpu]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid usage: rank 1 is on a cpu device but rank 0 is on a cuda device: a communicator is all CUDA or \
             all CPU-target"
        );
    }

    #[test]
    fn ring_transports_follow_p2p_shm_net() {
        use crate::transport::TransportKind::{Net, P2p, Shm};
        // Ranks 0-2 on host h, rank 3 on host k; rank 1 has NCCL_P2P_DISABLE=1, rank 2
        // NCCL_SHM_DISABLE=1. Pairs: 0-1 SHM (P2P off on 1), 1-2 NET (P2P off on 1, SHM off on 2),
        // 2-3 and 3-0 NET (other host); 0-0 (a 1-rank ring) its own memory, reported as P2P.
        let mut p = four_peers();
        assert_eq!(transport_between(&p, 0, 1), P2p);
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
                (transport_between(&p, a, b), transport_between(&p, b, a)),
                (k, k),
                "{a}-{b}"
            );
        }
        // CPU-target ranks never use P2P: SHM on one host (0-2 also with P2P allowed on both),
        // still NET where one side disabled SHM.
        for q in &mut p {
            q.cuda = false;
        }
        assert_eq!((transport_between(&p, 0, 1), transport_between(&p, 1, 2)), (Shm, Net));
        p[2].shm_disable = false;
        assert_eq!(transport_between(&p, 0, 2), Shm);
    }

    #[test]
    fn proc_start_of_this_process() {
        let (t, zombie) = proc_start(std::process::id()).unwrap();
        assert!(t > 0 && !zombie);
        // Pids above the kernel's maximum (4194304) never exist.
        assert_eq!(proc_start(u32::MAX), None);
    }
}
