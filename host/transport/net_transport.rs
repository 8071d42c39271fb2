//! The NET transport's setup (NCCL's `transport/net.cc` with the proxy connect of `proxy.cc`):
//! which network ([`net_from_env`]), the staging FIFOs a rank's kernels write and the NET blocks
//! its proxy fills, the connections of a rank's ring neighbours ([`connect_net`]) and of any
//! planned set of NET edges ([`connect_planned`], the trees'), their handles exchanged through
//! the bootstrap. The network interface itself is in `net.rs`, the proxy thread in
//! [`crate::proxy`].
use super::*;

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
    /// The abort lines (flag at +0, who at [`crate::proxy::ABORT_LINE_WHO`]) of the other ranks of this host, which a failed
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
