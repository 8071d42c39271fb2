//! A rank's connection memory and its links to its peers' (NCCL's per-peer half of
//! `ncclTransportP2pSetup` and the transports' `connect`/`free`): [`OwnConn`] (what a rank
//! offers its neighbours), [`HostConns`] (a CUDA rank's host-memory blocks for SHM and NET
//! neighbours), [`PeerLink`] (what one rank holds of a neighbour's memory, made by the pair's
//! [`Transport`](super::Transport); dropping it is the transport's `free`).
use super::p2p;
use super::shm::RegisteredShm;
use super::ConnDesc;
use crate::cpu::HostMem;
use crate::cuda;
use crate::error::Result;
use std::sync::Arc;

/// A CUDA rank's connection memory for its SHM and NET neighbours (its P2P neighbours use
/// [`OwnConn::Dev`]): one block each, laid out as [`ConnLayout`], in host memory that both the
/// kernels (through the device mapping) and the other side reach.
#[derive(Default)]
pub(crate) struct HostConns {
    /// SHM: a `/dev/shm` segment that SHM neighbours map and register too.
    pub(crate) shm: Option<RegisteredShm>,
    /// NET: pinned, device-mapped host memory whose receive FIFOs and head counters the proxy
    /// thread writes.
    pub(crate) net: Option<cuda::HostMapped>,
}

/// This rank's connection memory (receive buffers and counters, [`ConnLayout`]).
pub(crate) enum OwnConn {
    /// CPU target: a `/dev/shm` segment its neighbours map.
    Shm(crate::cpu::ShmSegment),
    /// CPU target, ranks of one in-process bootstrap with P2P allowed: private host memory its
    /// neighbours (threads of this process) write directly.
    Host(HostMem),
    /// CUDA: `cuMemAlloc` memory its neighbours open through CUDA IPC (or use directly).
    Dev(cuda::DevAlloc),
}

impl OwnConn {
    /// Allocates `bytes` of it: on CUDA device memory; on the CPU target host memory when
    /// `in_process` (the ranks of `Comm::init_all`) and `NCCL_P2P_DISABLE` is not set, else the
    /// `/dev/shm` segment `name`. The `u64` step counters at the offsets `counters` start at
    /// `initial_step`.
    pub(crate) fn alloc(
        ctx: Option<&Arc<cuda::Context>>,
        bytes: usize,
        counters: &[u64],
        name: &str,
        initial_step: u64,
        in_process: bool,
    ) -> Result<OwnConn> {
        let p2p_disabled = p2p::disabled_by_env();
        let seed = |base: u64| {
            for &off in counters {
                // SAFETY: the counters lie inside the fresh block (the caller's layout); no peer
                // knows it yet.
                unsafe { ((base + off) as *mut u64).write(initial_step) };
            }
        };
        Ok(match ctx {
            None if in_process && !p2p_disabled => {
                let mem = HostMem::zeroed(bytes)?;
                seed(mem.addr());
                OwnConn::Host(mem)
            }
            None => {
                let seg = crate::cpu::ShmSegment::create(name, bytes)?;
                seed(seg.addr());
                OwnConn::Shm(seg)
            }
            Some(ctx) => {
                let mem = cuda::DevAlloc::zeroed(ctx, bytes)?;
                if initial_step != 0 {
                    for &off in counters {
                        mem.write(off as usize, &initial_step.to_ne_bytes())?;
                    }
                }
                OwnConn::Dev(mem)
            }
        })
    }

    pub(crate) fn base(&self) -> u64 {
        match self {
            OwnConn::Shm(s) => s.addr(),
            OwnConn::Host(m) => m.addr(),
            OwnConn::Dev(m) => m.ptr,
        }
    }

    pub(crate) fn desc(&self, name: &str) -> Result<ConnDesc> {
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

/// A peer's connection memory as a transport's [`connect`](super::Transport::connect) opens it: its descriptor (CPU target: the
/// `/dev/shm` name; CUDA: the IPC handle of its device memory, for P2P), on CUDA the name of its
/// `/dev/shm` segment (for SHM), and its size in bytes.
#[derive(Clone, Copy)]
pub(crate) struct PeerMem<'a> {
    pub(crate) desc: &'a ConnDesc,
    pub(crate) shm_name: &'a str,
    pub(crate) bytes: usize,
}

/// How this rank reaches one ring or tree neighbour's connection memory: the transport chosen for
/// that peer.
pub(crate) enum PeerLink {
    /// NET (every neighbour that uses it): staging FIFOs and the proxy registration
    /// ([`connect_net`](super::connect_net)); dropping it flushes and closes the network
    /// connections.
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
    pub(crate) fn base(&self) -> u64 {
        match self {
            PeerLink::Shm(s) => s.addr(),
            PeerLink::Local(a) => *a,
            PeerLink::ShmMapped(m) => m.dev_base(),
            PeerLink::P2p(c) => c.base(),
            PeerLink::Net { .. } => 0,
        }
    }
}
