//! The P2P transport (NCCL's `transport/p2p.cc`): GPUs of one host write into each other's
//! device memory.
//!
//! - Can connect ([`can_connect`], NCCL's `p2pCanConnect`): both ranks are CUDA devices of one
//!   host (or CPU-target ranks of one in-process bootstrap, whose memory is plain host memory of
//!   one address space), neither set `NCCL_P2P_DISABLE=1`, and `NCCL_P2P_LEVEL` (either rank's) allows the
//!   path between their GPUs. The level is applied with every rank's view: each rank finds the
//!   pairs of its host that its level or theirs forbids, and the lists are all-gathered
//!   ([`exchange_p2p_denied`]) so both ends of a pair decide alike.
//! - Connect ([`connect`], NCCL's `p2pSendConnect` / `p2pRecvConnect`): a peer in this process
//!   is reached by its device pointer over peer access ([`enable_peer_access`], the one place
//!   that enables it: ring and tree neighbours, `init_all` and `init_rank`); a peer in another
//!   process through CUDA IPC (`cuIpcOpenMemHandle` on the handle its [`ConnDesc::Ipc`] carries).
use super::{ConnDesc, PeerInfo};
use crate::cuda;
use crate::error::{Error, Result};
use crate::topo::{LocalTopo, PathType};

/// Whether the P2P transport can connect ranks `a` and `b` (NCCL's `p2pCanConnect`): CUDA
/// devices of one host — or CPU-target ranks of one process whose connection memory is in that
/// process ([`ConnDesc::Local`], the ranks of `Comm::init_all`) —, `NCCL_P2P_DISABLE` unset on
/// both, and `denied` false (`NCCL_P2P_LEVEL` forbids P2P for the pair, see
/// [`exchange_p2p_denied`]).
pub(crate) fn can_connect(a: &PeerInfo, b: &PeerInfo, denied: bool) -> bool {
    let devices = (a.cuda && b.cuda)
        || (!a.cuda
            && !b.cuda
            && a.pid == b.pid
            && matches!(a.conn, ConnDesc::Local(_))
            && matches!(b.conn, ConnDesc::Local(_)));
    a.host == b.host && devices && !a.p2p_disable && !b.p2p_disable && !denied
}

/// `NCCL_P2P_DISABLE=1` (or `OXCCL_`) in this process's environment, read leniently (a bad
/// value fails every rank alike in the NET setup's settings check).
pub(crate) fn disabled_by_env() -> bool {
    crate::params::env_var("P2P_DISABLE").is_some_and(|(_, v)| v.trim() == "1")
}

/// The P2P transport ([`super::Transport`]): [`can_connect`], then [`connect`] between CUDA
/// ranks, a plain address between CPU-target ranks of one process.
pub(crate) struct P2pTransport;

impl super::Transport for P2pTransport {
    fn kind(&self) -> super::TransportKind {
        super::TransportKind::P2p
    }
    fn can_connect(&self, a: &PeerInfo, b: &PeerInfo, denied: bool) -> bool {
        can_connect(a, b, denied)
    }
    fn connect(&self, to: &super::ConnectTo<'_>) -> Result<super::PeerLink> {
        let (me, peer) = (to.me, to.peer);
        match (to.ctx, to.target.desc) {
            (Some(ctx), desc) => Ok(super::PeerLink::P2p(connect(
                me, to.peers, peer, ctx, desc, to.p2p_level, to.topo,
            )?)),
            (None, ConnDesc::Local(addr)) if to.peers[peer].pid == to.peers[me].pid => {
                tracing::debug!(target: "oxccl::init", rank = me, peer, "P2P (same process, host memory)");
                Ok(super::PeerLink::Local(*addr))
            }
            (None, _) => Err(Error::Internal(format!(
                "rank {me}: P2P chosen for CPU-target rank {peer}, whose memory is not in this process"
            ))),
        }
    }
}

/// Fails with `System` "no transport can connect {pair}: peer access is not supported between
/// them" when kernels in `ctx` cannot access the memory of `peer`'s device
/// (`cuDeviceCanAccessPeer`); `pair` names the two ranks.
pub(crate) fn check_peer_access(
    ctx: &cuda::Context,
    peer: &cuda::Context,
    pair: impl FnOnce() -> String,
) -> Result<()> {
    if !ctx.can_access_peer(peer)? {
        return Err(Error::System(format!(
            "no transport can connect {}: peer access is not supported between them",
            pair()
        )));
    }
    Ok(())
}

/// Lets kernels in `ctx` write into memory of `peer`'s device (NCCL's P2P transport, same-process
/// path: `cudaDeviceEnablePeerAccess`); nothing to do when both are one device. Errors: those of
/// [`check_peer_access`] (`pair` names the two ranks), driver failures.
pub(crate) fn enable_peer_access(
    ctx: &cuda::Context,
    peer: &cuda::Context,
    pair: impl FnOnce() -> String,
) -> Result<()> {
    if ctx.ordinal == peer.ordinal {
        return Ok(());
    }
    check_peer_access(ctx, peer, pair)?;
    ctx.enable_peer_access(peer)
}

/// This rank's P2P link to a peer's connection memory.
pub(crate) enum P2pConn {
    /// The peer is in this process: its device pointer, used over peer access.
    Direct(u64),
    /// The peer is in another process of this host: its memory opened through CUDA IPC, closed
    /// before this rank's teardown barrier.
    Ipc(cuda::IpcMapping),
}

impl P2pConn {
    /// The address this rank's kernels use for the peer's connection memory.
    pub(crate) fn base(&self) -> u64 {
        match self {
            P2pConn::Direct(p) => *p,
            P2pConn::Ipc(m) => m.ptr(),
        }
    }
}

/// Connects CUDA rank `me` (on `ctx`) to rank `peer`'s connection memory `desc` over P2P: its
/// pointer when the peer lives in this process (enabling peer access between two devices), else
/// its memory opened through CUDA IPC. `p2p_level` (`NCCL_P2P_LEVEL`) is checked again on this
/// init's topology `topo` ([`check_p2p_level`]): a guard, since [`exchange_p2p_denied`] already made
/// pairs that either side's level forbids use SHM or NET.
///
/// Errors: `System` naming both ranks when the level or the devices refuse P2P; `Internal` for
/// a descriptor without device memory or of the wrong kind; driver failures, naming both ranks.
pub(crate) fn connect(
    me: usize,
    peers: &[PeerInfo],
    peer: usize,
    ctx: &std::sync::Arc<cuda::Context>,
    desc: &ConnDesc,
    p2p_level: Option<crate::topo::PathType>,
    topo: &LocalTopo,
) -> Result<P2pConn> {
    let (mi, pi) = (&peers[me], &peers[peer]);
    check_p2p_level(me, mi, peer, pi, p2p_level, |a, b| path_between(topo, a, b))?;
    let pair = || {
        format!(
            "rank {me} ({}) and rank {peer} ({})",
            mi.describe_device(),
            pi.describe_device()
        )
    };
    match desc {
        ConnDesc::Ipc { ptr: 0, .. } => Err(Error::Internal(format!(
            "rank {peer} offers no device memory for rank {me}'s P2P connection"
        ))),
        ConnDesc::Ipc { ptr, handle } => {
            if pi.pid == mi.pid && pi.host == mi.host {
                if pi.dev != mi.dev {
                    enable_peer_access(ctx, &*cuda::Context::get(pi.dev)?, pair)?;
                }
                tracing::debug!(target: "oxccl::init", rank = me, peer, "P2P (same process)");
                return Ok(P2pConn::Direct(*ptr));
            }
            if pi.bus_id != mi.bus_id
                && let Some(o) = cuda::device_by_bus_id(&pi.bus_id)?
            {
                check_peer_access(ctx, &*cuda::Context::get(o)?, pair)?;
            }
            let m = cuda::IpcMapping::open(ctx, handle).map_err(|e| match e {
                Error::Cuda {
                    call,
                    code,
                    name,
                    msg,
                } => Error::Cuda {
                    call,
                    code,
                    name,
                    msg: format!("{msg} (rank {me} connecting to rank {peer}'s connection memory)"),
                },
                e => e,
            })?;
            tracing::debug!(target: "oxccl::init", rank = me, peer, "P2P/IPC");
            Ok(P2pConn::Ipc(m))
        }
        ConnDesc::Shm(_) | ConnDesc::Local(_) => Err(Error::Internal(format!(
            "rank {peer}'s connection descriptor does not match rank {me}'s device kind"
        ))),
    }
}

/// `NCCL_P2P_LEVEL` between the CUDA ranks of each host (NCCL's `p2pCanConnect` refusing P2P
/// after `ncclTopoCheckP2p`): when any rank set a level, each CUDA rank finds the ranks of its
/// host whose GPU path (`path_of`, e.g. [`path_between`]) exceeds its own level or theirs, and
/// the lists are all-gathered into every [`PeerInfo::p2p_denied`], so that every rank's
/// [`super::select_transport`] agrees (a rank cannot compute another host's paths). Such a pair then uses
/// SHM, or NET with SHM disabled, as in NCCL. Nothing is exchanged when no rank set a level
/// (every rank sees that alike in the gathered peer information). A path of unknown type allows
/// P2P, with a warning (see [`check_p2p_level`]).
///
/// Errors: a rank whose topology cannot be built sends its error instead, so every rank fails
/// naming it (`Remote`); bootstrap errors.
pub(crate) fn exchange_p2p_denied(
    rank: usize,
    peers: &mut [PeerInfo],
    bootstrap: &crate::bootstrap::Bootstrap,
    path_of: impl Fn(&PeerInfo, &PeerInfo) -> Result<Option<crate::topo::PathType>>,
) -> Result<()> {
    if !peers.iter().any(|p| p.cuda && p.p2p_level.is_some()) {
        return Ok(());
    }
    let (_, all) = bootstrap.allgather_checked(
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
pub(crate) fn p2p_denied_by_level(
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

/// The type of the path between the GPUs of CUDA ranks `a` and `b` as `NCCL_P2P_LEVEL` compares
/// it: [`LocalTopo::gpu_path`] of their bus ids, on this init's topology `topo`.
pub(crate) fn path_between(topo: &LocalTopo, a: &PeerInfo, b: &PeerInfo) -> Result<Option<PathType>> {
    topo.gpu_path(&a.bus_id, &b.bus_id)
}

/// Applies `NCCL_P2P_LEVEL` (`level`) to CUDA ranks `me` and `peer` (NCCL's `ncclTopoCheckP2p`
/// within `p2pCanConnect`): P2P only when their path type (`path_of`, e.g. [`path_between`]) is at
/// most the level, by [`crate::params::p2p_allowed`]. When the path type is unknown (a GPU that
/// neither NVML nor `NCCL_TOPO_FILE` describes), only `LOC` refuses (two distinct GPUs); other
/// levels are not applied and a warning says so. `Ok` when P2P may be used; `System` naming both ranks, the level and the path type when it
/// may not (oxccl does not fall back to SHM/NET then, as NCCL would: `NCCL_P2P_DISABLE=1` selects them).
pub(crate) fn check_p2p_level(
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
mod tests {
    use super::*;
    use crate::transport::select_transport;
    use crate::transport::test_peers::four_peers;
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
            sms: 0,
            cc: 0,
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
        let topo = LocalTopo::default();
        assert_eq!(path_between(&topo, &x, &y).unwrap(), None);
        // One GPU shared by two ranks: LOC, allowed even at level LOC (no topology needed).
        let shared = gpu(1, "0000:11:00.0");
        assert_eq!(path_between(&topo, &a, &shared).unwrap(), Some(PathType::Loc));
        check_p2p_level(0, &a, 1, &shared, Some(PathType::Loc), |a, b| path_between(&topo, a, b)).unwrap();
        // A failing path lookup (e.g. a malformed NCCL_TOPO_FILE) is returned as is.
        let broken = |_: &PeerInfo, _: &PeerInfo| Err(Error::invalid("NCCL_TOPO_FILE: bad"));
        assert!(check_p2p_level(0, &a, 1, &b, Some(PathType::Nvl), broken).is_err());
        check_p2p_level(0, &a, 1, &b, None, broken).unwrap();
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
                (select_transport(&p, a, b), select_transport(&p, b, a)),
                (k, k),
                "{a}-{b}"
            );
        }
        p[1].shm_disable = true;
        assert_eq!(select_transport(&p, 1, 2), Net);
        // A path error is the caller's error.
        let broken =
            |_: &PeerInfo, _: &PeerInfo| -> Result<Option<PathType>> { Err(Error::invalid("bad topology")) };
        assert!(p2p_denied_by_level(0, &p, broken).is_err());
    }
}
