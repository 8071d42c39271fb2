//! How a rank reaches each ring or tree neighbour's connection memory once the transport of the
//! pair is chosen (NCCL's per-peer `ncclTransportP2pSetup` in `transport.cc`): its own connection
//! memory ([`OwnConn`], [`HostConns`]) and its links to the peers' ([`PeerLink`]: P2P through
//! [`crate::transport::p2p`], SHM by `/dev/shm`, NET through `transport::connect_net`).
use super::*;
use crate::transport::shm::RegisteredShm;

/// A CUDA rank's connection memory for its SHM and NET neighbours (its P2P neighbours use
/// [`OwnConn::Dev`]): one block each, laid out as [`ConnLayout`], in host memory that both the
/// kernels (through the device mapping) and the other side reach.
#[derive(Default)]
pub(super) struct HostConns {
    /// SHM: a `/dev/shm` segment that SHM neighbours map and register too.
    pub(super) shm: Option<RegisteredShm>,
    /// NET: pinned, device-mapped host memory whose receive FIFOs and head counters the proxy
    /// thread writes.
    pub(super) net: Option<cuda::HostMapped>,
}

/// This rank's connection memory (receive buffers and counters, [`ConnLayout`]).
pub(super) enum OwnConn {
    /// CPU target: a `/dev/shm` segment its neighbours map.
    Shm(crate::cpu::ShmSegment),
    /// CPU target, ranks of one in-process bootstrap with P2P allowed: private host memory its
    /// neighbours (threads of this process) write directly.
    Host(HostMem),
    /// CUDA: `cuMemAlloc` memory its neighbours open through CUDA IPC (or use directly).
    Dev(cuda::DevAlloc),
}

impl OwnConn {
    /// Allocates it: on CUDA device memory; on the CPU target host memory when `in_process`
    /// (the ranks of `Comm::init_all`) and `NCCL_P2P_DISABLE` is not set, else the `/dev/shm`
    /// segment `name`. Every step counter starts at `initial_step`.
    pub(super) fn alloc(
        ctx: Option<&Arc<cuda::Context>>,
        layout: &ConnLayout,
        name: &str,
        initial_step: u64,
        in_process: bool,
    ) -> Result<OwnConn> {
        let bytes = layout.bytes() as usize;
        let p2p_disabled = crate::params::env_var("P2P_DISABLE").is_some_and(|(_, v)| v.trim() == "1");
        Ok(match ctx {
            None if in_process && !p2p_disabled => {
                let mem = HostMem::zeroed(bytes)?;
                for c in 0..layout.nch {
                    for at in [layout.head(mem.addr(), c), layout.tail(mem.addr(), c)] {
                        // SAFETY: the counters lie inside the fresh block; no peer knows it yet.
                        unsafe { (at as *mut u64).write(initial_step) };
                    }
                }
                OwnConn::Host(mem)
            }
            None => {
                let seg = crate::cpu::ShmSegment::create(name, bytes)?;
                for c in 0..layout.nch {
                    for at in [layout.head(seg.addr(), c), layout.tail(seg.addr(), c)] {
                        // SAFETY: the counters lie inside our fresh segment; no peer maps it yet.
                        unsafe { (at as *mut u64).write(initial_step) };
                    }
                }
                OwnConn::Shm(seg)
            }
            Some(ctx) => {
                let mem = cuda::DevAlloc::zeroed(ctx, bytes)?;
                if initial_step != 0 {
                    for c in 0..layout.nch {
                        for at in [layout.head(mem.ptr, c), layout.tail(mem.ptr, c)] {
                            mem.write((at - mem.ptr) as usize, &initial_step.to_ne_bytes())?;
                        }
                    }
                }
                OwnConn::Dev(mem)
            }
        })
    }

    pub(super) fn base(&self) -> u64 {
        match self {
            OwnConn::Shm(s) => s.addr(),
            OwnConn::Host(m) => m.addr(),
            OwnConn::Dev(m) => m.ptr,
        }
    }

    pub(super) fn desc(&self, name: &str) -> Result<ConnDesc> {
        Ok(match self {
            OwnConn::Shm(_) => ConnDesc::Shm(name.to_string()),
            OwnConn::Host(m) => ConnDesc::Local(m.addr()),
            OwnConn::Dev(m) => ConnDesc::Ipc {
                ptr: m.ptr,
                handle: m.ipc_handle()?,
            },
        })
    }
}

/// A peer's connection memory as [`PeerLink::connect`] opens it: its descriptor (CPU target: the
/// `/dev/shm` name; CUDA: the IPC handle of its device memory, for P2P), on CUDA the name of its
/// `/dev/shm` segment (for SHM), and its size in bytes.
#[derive(Clone, Copy)]
pub(super) struct PeerMem<'a> {
    pub(super) desc: &'a ConnDesc,
    pub(super) shm_name: &'a str,
    pub(super) bytes: usize,
}

/// How this rank reaches one ring or tree neighbour's connection memory: the transport chosen for
/// that peer.
pub(super) enum PeerLink {
    /// CPU target, NET (both neighbours that use it): staging FIFOs and the proxy registration
    /// (`transport::connect_net`); dropping it flushes and closes the network connections.
    Net { _held: crate::transport::NetResources },
    /// CPU target: the neighbour's `/dev/shm` segment, mapped here (the seed's SHM transport).
    Shm(crate::cpu::ShmSegment),
    /// CPU target, neighbour in this process reached through P2P: the address of its memory
    /// (kept alive by the process group, `Comm::init_all`).
    Local(u64),
    /// CUDA, neighbour of this host reached through SHM: its `/dev/shm` segment, mapped here and
    /// registered with CUDA (unregistered and unmapped before this rank's teardown barrier).
    ShmMapped(RegisteredShm),
    /// CUDA, neighbour of this host reached through P2P: its device pointer (same process) or
    /// its memory opened through CUDA IPC (closed before this rank's teardown barrier).
    P2p(p2p::P2pConn),
}

impl PeerLink {
    /// Connects rank `me` to ring or tree neighbour `peer` over `kind`, the transport
    /// [`select_transport`] chose for the pair (P2P or SHM; NET connections are made by
    /// `transport::connect_net`): P2P by [`p2p::connect`] (which applies `p2p_level`,
    /// `NCCL_P2P_LEVEL`, on this init's topology `topo`); CUDA SHM maps the peer's segment
    /// ([`PeerMem::shm_name`]), which must exist; CPU SHM maps its [`ConnDesc::Shm`] segment.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn connect(
        me: usize,
        peers: &[PeerInfo],
        peer: usize,
        kind: crate::transport::TransportKind,
        ctx: Option<&Arc<cuda::Context>>,
        target: PeerMem<'_>,
        p2p_level: Option<crate::topo::PathType>,
        topo: &LocalTopo,
    ) -> Result<PeerLink> {
        use crate::transport::TransportKind;
        match (kind, ctx) {
            (TransportKind::Net, _) => Err(Error::Internal(format!(
                "rank {me}: the NET connection to rank {peer} was not made by connect_net"
            ))),
            (TransportKind::Shm, Some(ctx)) => {
                let m = RegisteredShm::open(ctx, target.shm_name, target.bytes)?;
                tracing::debug!(target: "oxccl::init", rank = me, peer, "SHM (registered with CUDA)");
                Ok(PeerLink::ShmMapped(m))
            }
            (TransportKind::Shm, None) => match target.desc {
                ConnDesc::Shm(name) => Ok(PeerLink::Shm(crate::cpu::ShmSegment::open(name, target.bytes)?)),
                _ => Err(Error::Internal(format!(
                    "rank {peer}'s connection descriptor does not match rank {me}'s device kind"
                ))),
            },
            (TransportKind::P2p, None) => match target.desc {
                ConnDesc::Local(addr) if peers[peer].pid == peers[me].pid => {
                    tracing::debug!(target: "oxccl::init", rank = me, peer, "P2P (same process, host memory)");
                    Ok(PeerLink::Local(*addr))
                }
                _ => Err(Error::Internal(format!(
                    "rank {me}: P2P chosen for CPU-target rank {peer}, whose memory is not in this process"
                ))),
            },
            (TransportKind::P2p, Some(ctx)) => Ok(PeerLink::P2p(p2p::connect(
                me,
                peers,
                peer,
                ctx,
                target.desc,
                p2p_level,
                topo,
            )?)),
        }
    }

    pub(super) fn base(&self) -> u64 {
        match self {
            PeerLink::Shm(s) => s.addr(),
            PeerLink::Local(a) => *a,
            PeerLink::ShmMapped(m) => m.dev_base(),
            PeerLink::P2p(c) => c.base(),
            PeerLink::Net { .. } => 0,
        }
    }
}

/// Creates `/dev/shm/<name>` for one rank's connection memory (`layout`, rounded up to whole
/// pages), sets its step counters to `initial_step` and registers it. Errors: a `/dev/shm`
/// without the room (`System` naming the bytes needed and the path), driver failures.
pub(super) fn create_shm_conn(
    ctx: &cuda::Context,
    name: &str,
    layout: &ConnLayout,
    initial_step: u64,
) -> Result<RegisteredShm> {
    let counters: Vec<u64> = (0..layout.nch)
        .flat_map(|c| [layout.head(0, c), layout.tail(0, c)])
        .collect();
    RegisteredShm::create_with(ctx, name, layout.bytes() as usize, &counters, initial_step)
}
