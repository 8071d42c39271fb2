//! The SHM transport (NCCL's `transport/shm.cc` with `ncclShmOpen`): when it can connect two
//! ranks ([`can_connect`]), and its memory, a `/dev/shm` segment mapped in each process of a
//! host, on CUDA registered with the driver so kernels reach it through its device mapping.
use super::PeerInfo;
use crate::cuda;
use crate::error::Result;

/// Whether the SHM transport can connect ranks `a` and `b` (NCCL's `shmCanConnect`): both on one
/// host, `NCCL_SHM_DISABLE` unset on both.
pub(crate) fn can_connect(a: &PeerInfo, b: &PeerInfo) -> bool {
    a.host == b.host && !a.shm_disable && !b.shm_disable
}

/// The SHM transport ([`super::Transport`]): [`can_connect`], then a neighbour's `/dev/shm`
/// segment mapped here (on CUDA registered with the driver; the segment must exist).
pub(crate) struct ShmTransport;

impl super::Transport for ShmTransport {
    fn kind(&self) -> super::TransportKind {
        super::TransportKind::Shm
    }
    fn can_connect(&self, a: &PeerInfo, b: &PeerInfo, _denied: bool) -> bool {
        can_connect(a, b)
    }
    fn connect(&self, to: &super::ConnectTo<'_>) -> Result<super::PeerLink> {
        let t = &to.target;
        match (to.ctx, t.desc) {
            (Some(ctx), _) => {
                let m = RegisteredShm::open(ctx, t.shm_name, t.bytes)?;
                tracing::debug!(target: "oxccl::init", rank = to.me, peer = to.peer, "SHM (registered with CUDA)");
                Ok(super::PeerLink::ShmMapped(m))
            }
            (None, super::ConnDesc::Shm(name)) => {
                Ok(super::PeerLink::Shm(crate::cpu::ShmSegment::open(name, t.bytes)?))
            }
            (None, _) => Err(crate::error::Error::Internal(format!(
                "rank {}'s connection descriptor does not match rank {}'s device kind",
                to.peer, to.me
            ))),
        }
    }
}

/// Rounds `bytes` up to whole pages (what `cuMemHostRegister` registers).
pub(crate) fn page_round(bytes: usize) -> usize {
    // SAFETY: sysconf has no memory effects.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as usize } else { 4096 };
    bytes.div_ceil(page) * page
}

/// A `/dev/shm` segment mapped here and registered with CUDA (NCCL's SHM transport:
/// `ncclShmOpen`, then `cudaHostRegister` with `DEVICEMAP | PORTABLE` and
/// `cudaHostGetDevicePointer`): the host mapping for this process, the device mapping for its
/// kernels. Dropping it unregisters, then unmaps (field order); the name is unlinked separately
/// ([`ShmSegment::unlink`](crate::cpu::ShmSegment::unlink)) once every peer has mapped it.
pub(crate) struct RegisteredShm {
    pub(crate) reg: cuda::HostRegistration,
    pub(crate) seg: crate::cpu::ShmSegment,
}

impl RegisteredShm {
    /// Creates `/dev/shm/<name>` of `bytes` (rounded up to whole pages), sets the `u64` counters
    /// at the offsets `counters` to `initial_step` and registers it. Errors: a `/dev/shm`
    /// without the room (`System` naming the bytes needed and the path), driver failures.
    pub(crate) fn create_with(
        ctx: &cuda::Context,
        name: &str,
        bytes: usize,
        counters: &[u64],
        initial_step: u64,
    ) -> Result<RegisteredShm> {
        let bytes = page_round(bytes);
        let seg = crate::cpu::ShmSegment::create(name, bytes)?;
        for &off in counters {
            // SAFETY: the counters lie inside our fresh segment; no peer maps it yet.
            unsafe { ((seg.addr() + off) as *mut u64).write(initial_step) };
        }
        Self::register(ctx, seg, bytes)
    }

    /// Maps and registers a peer's segment `name` of `bytes` (rounded up to whole pages).
    pub(crate) fn open(ctx: &cuda::Context, name: &str, bytes: usize) -> Result<RegisteredShm> {
        let bytes = page_round(bytes);
        Self::register(ctx, crate::cpu::ShmSegment::open(name, bytes)?, bytes)
    }

    pub(crate) fn register(ctx: &cuda::Context, seg: crate::cpu::ShmSegment, bytes: usize) -> Result<RegisteredShm> {
        // SAFETY: the mapping is page-aligned, `bytes` long, and outlives the registration (field
        // order of `RegisteredShm`).
        let reg = unsafe { cuda::HostRegistration::new(ctx, seg.addr() as *mut u8, bytes)? };
        Ok(RegisteredShm { reg, seg })
    }

    /// The address kernels use.
    pub(crate) fn dev_base(&self) -> u64 {
        self.reg.dev_ptr()
    }
}
