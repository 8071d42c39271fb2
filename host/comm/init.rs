//! Communicator creation (NCCL's `init.cc`): one setup per rank (`init_rank_with`), reached by
//! [`Comm::init_rank`] for one rank of a communicator that meets through a TCP bootstrap, by
//! [`Comm::init_all`] for the devices of one process (a thread per rank, an in-process
//! bootstrap: NCCL's `ncclCommInitAll` as a group of `ncclCommInitRank`), and by
//! [`Comm::from_env`] for launchers; and the timing of the setup's phases. What the ranks
//! exchange on the way is [`crate::transport::PeerInfo`], checked in `peer_info.rs` with the
//! settings every rank must share; the channels and the communicator block are in `channel.rs`;
//! the links to each neighbour through the pair's transport ([`crate::transport`]).
use super::*;
use super::init_phases::InitPhases;

pub(super) fn check_devices(devices: &[Device]) -> Result<()> {
    if devices.is_empty() {
        return Err(Error::invalid(
            "devices is empty: a communicator needs at least one rank (Device::all_cuda() is empty when no GPU is visible; Device::cpus(n) gives CPU-target ranks)",
        ));
    }
    let cuda = devices[0].is_cuda();
    if devices.iter().any(|d| d.is_cuda() != cuda) {
        return Err(Error::invalid("devices mixes CUDA and CPU-target devices"));
    }
    let shared_ok = crate::params::env_var("ALLOW_SHARED_DEVICE").is_some_and(|(_, v)| v == "1");
    for (i, a) in devices.iter().enumerate() {
        if let Some(j) = devices[..i].iter().position(|b| b == a)
            && !shared_ok
        {
            return Err(Error::InvalidUsage(format!(
                "ranks {j} and {i} are both on device {a:?}; one GPU per rank is required \
                     (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)"
            )));
        }
    }
    Ok(())
}

impl Comm {
    /// Creates one communicator per device, rank `i` on `devices[i]`, all in this process (NCCL's
    /// `ncclCommInitAll`, a group of `ncclCommInitRank`). Devices must all be CUDA or all
    /// CPU-target, each used once (unless `OXCCL_ALLOW_SHARED_DEVICE=1`).
    ///
    /// Every rank runs the setup of [`Comm::init_rank`] on a thread of its own; the ranks meet
    /// through an in-process bootstrap instead of TCP, so they differ from ranks in separate
    /// processes only in what the transport decides for each pair: P2P by device pointer over
    /// peer access (CUDA) or by plain address (CPU target) where `NCCL_P2P_DISABLE` /
    /// `NCCL_P2P_LEVEL` allow it, else SHM, else NET — NCCL's order. When every ring pair uses
    /// P2P, ring connections also exchange pointers ([`Comm::direct_pointer`]). The ranks of one
    /// `init_all` form a process group: their memory lives until the last of them is dropped, so
    /// they may be dropped one by one from one thread (no teardown barrier), and an abort of one
    /// reaches every rank's kernels.
    ///
    /// Rings: on CUDA, each channel's ring is the ring graph searched on this machine's topology
    /// (`NCCL_TOPO_FILE` completed by detection) over the ranks' GPUs, channel `c` on searched
    /// channel `c % count` ([`Comm::ring`] shows it); rank order (0 → 1 → … → 0) when a GPU is
    /// missing from the topology, two ranks share a GPU, or the search fails (debug log). Test
    /// hook: on the CPU target, `NCCL_TOPO_FILE` naming a topology with exactly as many GPUs as
    /// ranks gives CPU rank `r` the file's GPU of rank `r`, so CPU ranks run that machine's rings;
    /// otherwise CPU rings are in rank order.
    ///
    /// Test hook: `OXCCL_TEST_NODES=N` (a divisor of the rank count) splits the ranks into `N`
    /// equal nodes of consecutive ranks, as if on `N` hosts, and sets up the double binary tree
    /// across them (a chain inside each node; channel `c` on tree `c % 2`), so AllReduce may run
    /// (or, with `NCCL_ALGO=tree`, must run) as a tree. Rings and transports are unchanged.
    ///
    /// Ranks sharing a GPU (`OXCCL_ALLOW_SHARED_DEVICE=1`, for testing on one GPU) get at most
    /// SMs / ranks-per-GPU channels each (their spinning blocks must all be resident at once).
    /// Each rank's kernel spins until the others' kernels of the same call run, on one GPU whose
    /// hardware queues their streams share. A rank therefore launches call `n + 1` only once every
    /// rank on its GPU has launched call `n`; issue the calls from a thread per rank, or call `n`
    /// on every rank before call `n + 1` on any (NCCL's rule for one thread driving several
    /// devices). Until every rank on the GPU has issued a call, queue nothing else behind it on
    /// any of their streams, and do not allocate, free or copy synchronously on the device: a
    /// context-wide synchronization (which [`DeviceBuffer`](crate::DeviceBuffer)'s allocation and
    /// writes do) waits for the kernel that is waiting for this thread.
    ///
    /// Errors: `InvalidArgument` for an empty or mixed list or a bad environment value
    /// (`NCCL_BUFFSIZE`, `NCCL_NTHREADS`, `NCCL_MAX_NCHANNELS`, `OXCCL_TEST_NODES`, ...),
    /// `InvalidUsage` for a repeated device, `NoCuda`/`Cuda` for driver failures, `System` when
    /// no transport can connect two ranks; otherwise those of [`Comm::init_rank`], the error of
    /// the rank where setup failed first (the others' `Remote` errors name it).
    pub fn init_all(devices: &[Device]) -> Result<Vec<Comm>> {
        Self::init_all_config(devices, &CommConfig::default())
    }

    /// [`Comm::init_all`] with `config`'s settings instead of their environment variables
    /// (NCCL's `ncclCommInitAll` has none; this is `ncclCommInitRankConfig` for each rank).
    /// Errors: as `init_all`, and `InvalidArgument` for a config value out of its range.
    pub fn init_all_config(devices: &[Device], config: &CommConfig) -> Result<Vec<Comm>> {
        check_devices(devices)?;
        let nranks = devices.len();
        let timeout = crate::bootstrap::BootstrapConfig::from_env()?.timeout;
        let bootstraps = crate::bootstrap::Bootstrap::in_process(nranks, timeout)?;
        let process = Arc::new(ProcessGroup::new(nranks));
        let tag = local_tag();
        let _span = tracing::debug_span!(target: "oxccl::init", "init_all", nranks).entered();
        let results: Vec<Result<Comm>> = std::thread::scope(|s| {
            let handles: Vec<_> = bootstraps
                .into_iter()
                .enumerate()
                .map(|(r, bootstrap)| {
                    let process = process.clone();
                    let device = devices[r];
                    std::thread::Builder::new()
                        .name(format!("oxccl-init-{r}"))
                        .spawn_scoped(s, move || {
                            Comm::init_rank_with(nranks, Join::InProcess { bootstrap, process, tag }, r, device, config)
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(Error::Internal(format!("init_all: rank {r}'s init thread panicked")))),
                    Err(e) => Err(Error::System(format!("init_all: cannot start rank {r}'s init thread: {e}"))),
                })
                .collect()
        });
        if results.iter().all(|r| r.is_ok()) {
            return results.into_iter().collect();
        }
        // The cause: the first rank's own error (the others report it as Remote).
        let cause = Error::first_cause(results.into_iter().filter_map(|r| r.err()));
        Err(cause.unwrap_or_else(|| Error::Internal("init_all: a rank failed without an error".into())))
    }

    /// Creates this process's rank `rank` of an `nranks`-rank communicator whose ranks meet through
    /// the bootstrap of `id` (NCCL's `ncclCommInitRank`; every rank calls it with the same `id`,
    /// usually in its own process, with the same `NCCL_BUFFSIZE`/`NCCL_MAX_NCHANNELS`).
    ///
    /// Peer information (rank, device, PCI bus id, host, process, connection memory) is exchanged
    /// in one bootstrap allgather like the seed's `fillInfo` + AllGather1, then each rank connects
    /// to its two ring neighbours with the transport chosen per peer, P2P then SHM then NET
    /// (`select_transport`, honouring `NCCL_P2P_DISABLE` / `NCCL_SHM_DISABLE`): P2P between CUDA
    /// devices of one host — the neighbour's pointer over peer access when it lives in this
    /// process, CUDA IPC (`cuIpcOpenMemHandle`) when it lives in another process; SHM on one host
    /// — the receiver's `/dev/shm` segment, on CUDA registered with the driver in both processes
    /// (`cuMemHostRegister`) so kernels use its device mapping; NET otherwise — staging FIFOs in
    /// local memory (pinned, device-mapped on CUDA) that the proxy thread sends over the network.
    /// LL128 is left out on CUDA communicators with SHM or NET connections unless `NCCL_PROTO`
    /// names it (as NCCL's tuning). The abort flags of the ranks of one host share one
    /// `/dev/shm` page, so an [`abort`](Comm::abort) on any rank reaches the kernels of every rank
    /// of its host; ranks on other hosts learn of it through their NET connections (the proxy).
    ///
    /// Errors, the same on every rank in bounded time (the bootstrap timeout): `InvalidArgument`
    /// for `rank` outside `0..nranks` or a corrupt id; `InvalidUsage` for two ranks on the same
    /// device of one host (case C26, naming both ranks and the device / bus id;
    /// `OXCCL_ALLOW_SHARED_DEVICE=1` allows it), for a mix of CUDA and CPU-target devices, or for
    /// ranks that disagree on the channel count or buffer sizes; `System` naming both ranks when
    /// P2P is chosen but refused (no peer access, `NCCL_P2P_LEVEL`), or naming the bytes needed
    /// and the path when `/dev/shm` is too small for SHM connection memory (the other ranks get
    /// `Remote` naming that rank); the network's errors for NET; `Remote`/`Timeout` from the
    /// bootstrap.
    ///
    /// Teardown is collective: destroying or dropping the communicator waits at a bootstrap
    /// barrier (bounded by the bootstrap timeout) until every rank is done with the others'
    /// memory, so ranks in one thread must be created and destroyed from separate threads.
    pub fn init_rank(
        nranks: usize,
        id: &crate::bootstrap::UniqueId,
        rank: usize,
        device: Device,
    ) -> Result<Comm> {
        Self::init_rank_with(nranks, Join::Id(id), rank, device, &CommConfig::default())
    }

    /// [`Comm::init_rank`] with `config`'s settings instead of their environment variables
    /// (NCCL's `ncclCommInitRankConfig`). Errors: as `init_rank`, and `InvalidArgument` for a
    /// config value out of its range (on every rank: it fails the first exchange).
    pub fn init_rank_config(
        nranks: usize,
        id: &crate::bootstrap::UniqueId,
        rank: usize,
        device: Device,
        config: &CommConfig,
    ) -> Result<Comm> {
        Self::init_rank_with(nranks, Join::Id(id), rank, device, config)
    }

    /// The setup of every rank ([`Comm::init_rank`], and each rank of [`Comm::init_all`]):
    /// `join` says how the ranks meet. On failure the `/dev/shm` names this rank created and had
    /// not unlinked yet are removed.
    pub(super) fn init_rank_with(
        nranks: usize,
        join: Join<'_>,
        rank: usize,
        device: Device,
        config: &CommConfig,
    ) -> Result<Comm> {
        let tag = match &join {
            Join::Id(id) => id_tag(id),
            Join::InProcess { tag, .. } => *tag,
        };
        let result = Self::init_rank_inner(nranks, join, tag, rank, device, config);
        if result.is_err() {
            // Names this rank created and had not unlinked yet (absent ones are fine).
            let prefix = format!("/dev/shm/oxccl-{tag:08x}-{}", std::process::id());
            let _ = std::fs::remove_file(format!("{prefix}-r{rank}"));
            let _ = std::fs::remove_file(format!("{prefix}-r{rank}-abort"));
            let _ = std::fs::remove_file(format!("{prefix}-r{rank}-tree"));
            let _ = std::fs::remove_file(call_check::rows_name(&format!("{prefix}-r{rank}")));
        }
        result
    }

    fn init_rank_inner(
        nranks: usize,
        join: Join<'_>,
        tag: u64,
        rank: usize,
        device: Device,
        config: &CommConfig,
    ) -> Result<Comm> {
        if nranks == 0 || rank >= nranks {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for nranks {nranks} (accepted: 0..{nranks})"
            )));
        }
        let is_cuda = device.is_cuda();
        let phases = InitPhases::start(rank);
        // The rank's own settings and device. A failure here still joins the bootstrap and
        // sends its error in the first all-gather, so every rank fails at once naming this rank
        // (a rank leaving before the bootstrap left the others waiting out its timeout, with an
        // error about the bootstrap ring rather than the cause).
        let local = (|| -> Result<_> {
            let mut params = config.apply(Params::from_env()?)?;
            if params.flight_recorder_dump.is_some() {
                // Before the bootstrap: a rank waiting there for a missing peer is what a user
                // sends SIGUSR1 to, and the signal's default action would end the process.
                super::flight_recorder::dump_on_signal();
            }
            if is_cuda && params.nthreads > cuda::MAX_JIT_THREADS {
                tracing::warn!(target: "oxccl::init", "NCCL_NTHREADS={} rounded down to {} (the most threads per block the kernels are built for)", params.nthreads, cuda::MAX_JIT_THREADS);
                params.nthreads = cuda::MAX_JIT_THREADS;
            }
            let selection = Selection::from_env()?;
            let ctx = match device {
                Device::Cuda(o) => Some(cuda::Context::get(o)?),
                Device::Cpu(_) => None,
            };
            // NCCL_TOPO_DUMP_FILE, and this thread (so the helper threads it starts) near the GPU.
            let near = crate::topo::detect::on_cuda_init(rank, ctx.as_slice())?;
            Ok((params, selection, ctx, near))
        })();
        phases.mark("settings, device context and topology hook");
        let (bootstrap, process) = match join {
            Join::Id(id) => (crate::bootstrap::Bootstrap::init(id, rank, nranks)?, None),
            Join::InProcess { bootstrap, process, .. } => (bootstrap, Some(process)),
        };
        let in_process = process.is_some();
        phases.mark("bootstrap ring");
        let ((params, mut selection, ctx, _near), all) = bootstrap.allgather_checked(
            local,
            |(p, s, _, _)| plan_settings(p, s),
            "cannot initialize (its settings or device)",
        )?;
        check_plan_settings(rank, &all)?;
        let default_nch = if is_cuda {
            CUDA_DEFAULT_NCHANNELS
        } else {
            CPU_DEFAULT_NCHANNELS
        };
        let nch = params
            .max_nchannels
            .unwrap_or(default_nch)
            .clamp(1, MAX_CHANNELS as u32);
        // Point-to-point: `per_peer` peer channels for each distance to another rank, after the
        // ring channels (`PeerChannels`); the connection memory holds them after the most ring
        // channels a call could use.
        let per_peer = params
            .p2p_nchannels_per_peer
            .unwrap_or(if is_cuda { PeerChannels::default_per_peer(nranks) } else { 1 });
        // With the call check, one channel more: its own (`PeerChannels::check_channel`).
        let check_channel = params.check_calls && nranks > 1;
        let layout = ConnLayout::new(&params, nch + per_peer * (nranks as u32 - 1) + u32::from(check_channel));
        let _span = tracing::debug_span!(target: "oxccl::init", "init_rank", rank, nranks, nch).entered();
        // Names after the id (or the process group) and the creating process: unique among live
        // processes.
        let prefix = format!("oxccl-{tag:08x}-{}", std::process::id());
        let own_name = format!("{prefix}-r{rank}");
        let own = OwnConn::alloc(
            ctx.as_ref(),
            layout.bytes() as usize,
            &layout.counter_offsets(),
            &own_name,
            params.initial_step,
            in_process,
        )?;
        // The shared abort page is per host (a rank cannot map another host's /dev/shm): every
        // rank offers one, and the ranks of a host use that of its lowest rank (the others drop
        // theirs once the peers are known).
        let page_bytes = abort_page_bytes(nranks);
        let page_name = format!("{own_name}-abort");
        let created_page = crate::cpu::ShmSegment::create(&page_name, page_bytes)?;
        let me = PeerInfo::local(
            device,
            ctx.as_deref(),
            nch,
            layout.bytes(),
            own.desc(&own_name)?,
            own_name.clone(),
            page_name,
            params.p2p_level,
        )?;
        let mut peers: Vec<PeerInfo> = bootstrap
            .allgather(me.encode().as_bytes())?
            .iter()
            .enumerate()
            .map(|(r, b)| PeerInfo::decode(r, b))
            .collect::<Result<_>>()?;
        check_peers(rank, &peers)?;
        // The call check's rows when the ranks share this host (`call_check.rs`): created before
        // the ring graphs' all-gather below, mapped by the peers after it.
        let check_rows = call_check::RowsMem::offer(&params, ctx.as_ref(), &own_name, &peers)?;
        // This machine's topology, built once for this init on first use (NCCL_P2P_LEVEL when a
        // level applies, the ring search on CUDA).
        let topo = LocalTopo::default();
        p2p::exchange_p2p_denied(rank, &mut peers, &bootstrap, |a, b| p2p::path_between(&topo, a, b))?;
        phases.mark("connection memory and peer all-gather");
        // The rings (NCCL's AllGather3 + connectRings): each rank's node graph travels in a second
        // all-gather. A rank connects to the next and previous rank of every channel's ring, each
        // over its own transport (rings that differ per channel may mix P2P, SHM and NET).
        let rings = {
            let hosts: Vec<&str> = {
                let mut h: Vec<&str> = Vec::new();
                for p in &peers {
                    if !h.contains(&p.host.as_str()) {
                        h.push(p.host.as_str());
                    }
                }
                h
            };
            let node = hosts.iter().position(|h| *h == peers[rank].host).unwrap_or(0);
            let node_ranks: Vec<usize> = (0..nranks)
                .filter(|&r| peers[r].host == peers[rank].host)
                .collect();
            let bus: Vec<String> = node_ranks.iter().map(|&r| peers[r].bus_id.clone()).collect();
            // A rank whose topology file fails sends its error instead, so every rank fails
            // naming it (rather than waiting in this all-gather for the bootstrap timeout).
            let (_, all) = bootstrap.allgather_checked(
                node_ring_graph(&node_ranks, is_cuda.then_some(bus.as_slice()), node, &topo),
                |m| m.as_ref().map_or(String::new(), |i| i.encode()),
                "cannot build its ring graph from its topology",
            )?;
            let infos: Vec<Option<RankGraphInfo>> = all
                .iter()
                .map(|b| {
                    (!b.is_empty())
                        .then(|| RankGraphInfo::decode(&String::from_utf8_lossy(b)))
                        .transpose()
                })
                .collect::<Result<_>>()?;
            let hosts: Vec<&str> = peers.iter().map(|p| p.host.as_str()).collect();
            comm_rings(&infos, nranks, nch)?.grouped_by_host(&hosts)?
        };
        // The tuning model's fabric, from every ring pair of every channel (so all ranks agree).
        let fabric = if is_cuda {
            crate::tuning::Fabric::of_gpu_rings(
                (0..rings.nchannels())
                    .flat_map(|c| (0..nranks).map(move |a| (c, a)))
                    .map(|(c, a)| select_transport(&peers, a, rings.next(c, a))),
            )
        } else {
            crate::tuning::Fabric::Host
        };
        // Channels no call would use are not connected (over NET each costs two proxied socket
        // connections with their threads). The connection memory keeps its layout of
        // `layout.nch` channels; only the first `nch` are set up and used.
        let mut nch = crate::tuning::Model::for_fabric(fabric).connected_channels(nch, params.min_nchannels);
        // Ranks sharing a GPU (OXCCL_ALLOW_SHARED_DEVICE=1) spin in kernels that must all be
        // resident at once: at most SMs / ranks-per-GPU blocks per rank — one per channel, and
        // with the call check on one more, its checking block — or blocks waiting for an SM
        // would wait forever for peers that cannot finish. Decided from every rank's
        // information (the check's setting is the same on every rank), so all agree.
        let same_gpu = |a: &PeerInfo, b: &PeerInfo| a.cuda && b.cuda && a.host == b.host && a.bus_id == b.bus_id;
        let per_gpu = peers
            .iter()
            .map(|a| peers.iter().filter(|b| same_gpu(a, b)).count())
            .max()
            .unwrap_or(1);
        if per_gpu > 1 {
            let sms = peers.iter().filter(|p| p.cuda).map(|p| p.sms).min().unwrap_or(1);
            let cap = (sms / per_gpu as u32).saturating_sub(u32::from(params.check_calls)).max(1);
            if nch > cap {
                tracing::info!(target: "oxccl::init", rank, "{per_gpu} ranks share a GPU: {nch} channels capped to {cap} (SMs per rank)");
                nch = cap;
            }
        }
        let rings = Arc::new(rings.first_channels(nch as usize));
        // The ring channels, then the peer channels: channel `c`'s (next, prev) of rank `q`.
        let peer_ch = PeerChannels {
            first: nch,
            per_peer,
            nranks: nranks as u32,
            check: check_channel,
        };
        let nch_all = peer_ch.total() as usize;
        let link = |c: usize, q: usize| -> (usize, usize) {
            if c < nch as usize {
                (rings.next(c, q), rings.prev(c, q))
            } else {
                peer_ch.neighbours(c as u32, q)
            }
        };
        phases.mark("ring search and all-gather");
        let leader = peers
            .iter()
            .position(|p| p.host == peers[rank].host)
            .unwrap_or(rank);
        let page = if leader == rank {
            created_page
        } else {
            if let Err(e) = created_page.unlink() {
                tracing::warn!(target: "oxccl::init", "{e}");
            }
            drop(created_page);
            let name = &peers[leader].abort_page;
            // Gone: the leader failed or exited after the all-gather (on its own error, which
            // names the cause) before this rank got here; say so rather than "no such file".
            crate::cpu::ShmSegment::open(name, page_bytes).map_err(|e| {
                if std::path::Path::new("/dev/shm").join(name).exists() {
                    e
                } else {
                    Error::Remote(format!(
                        "rank {rank}: rank {leader} left init before this rank mapped its abort page \
                         (rank {leader}'s own error names the cause): {e}"
                    ))
                }
            })?
        };
        use crate::transport::TransportKind;
        // Per channel, the transports of the send (next) and receive (prev) neighbours (the rings
        // may differ per channel, and so the transports), and every transport in use here.
        let chan_kinds: Vec<[TransportKind; 2]> = (0..nch_all)
            .map(|c| {
                let (next, prev) = link(c, rank);
                [
                    select_transport(&peers, rank, next),
                    select_transport(&peers, rank, prev),
                ]
            })
            .collect();
        let kinds: Vec<TransportKind> = chan_kinds.iter().flatten().copied().collect();
        // CUDA: the connection memory a SHM or NET neighbour (or its proxy) writes is host memory
        // that the kernels reach through its device mapping. The NET block is made here (the
        // proxy fills it), the SHM segment after connect_net.
        let mut host_conns = HostConns::default();
        if let Some(ctx) = &ctx
            && kinds.contains(&TransportKind::Net)
        {
            let m = cuda::HostMapped::zeroed(ctx, layout.bytes() as usize)?;
            for c in 0..layout.nch {
                let base = m.host_ptr() as u64;
                for at in [layout.head(base, c), layout.tail(base, c)] {
                    // SAFETY: the counters lie inside the fresh block; no one else uses it yet.
                    unsafe { (at as *mut u64).write(params.initial_step) };
                }
            }
            host_conns.net = Some(m);
        }
        // Connection memory as the kernels address it (`conn_base`) and as the proxy does
        // (`conn_host`, host addresses); the same on the CPU target.
        let mut conn_base = vec![0u64; nranks];
        conn_base[rank] = own.base();
        let mut conn_host = vec![0u64; nranks];
        conn_host[rank] = host_conns
            .net
            .as_ref()
            .map_or(own.base(), |m| m.host_ptr() as u64);
        let mut links = Vec::new();
        // Where a proxy raises a failed NET connection: this rank's line of the host's abort page
        // (flag, then who raised it) and the host's other ranks' lines.
        let proxy_abort = crate::transport::ProxyAbort {
            flag: page.addr() + (rank * ABORT_LINE_BYTES) as u64,
            who: page.addr() + (rank * ABORT_LINE_BYTES) as u64 + crate::proxy::ABORT_LINE_WHO,
            host_lines: (0..nranks)
                .filter(|&r| r != rank && peers[r].host == peers[rank].host)
                .map(|r| page.addr() + (r * ABORT_LINE_BYTES) as u64)
                .collect(),
        };
        // NET neighbours (other hosts, or NCCL_SHM_DISABLE=1): local staging FIFOs and the proxy.
        // SAFETY: our connection memory and abort line outlive `links`, which holds the NET
        // resources and is dropped first at teardown (and on every error return).
        if let Some(net) = unsafe {
            crate::transport::connect_net(
                &crate::transport::RingSetup {
                    bootstrap: &bootstrap,
                    rank,
                    nranks,
                    ring: &|c, q| link(c as usize, q),
                    transport: &|a, b| select_transport(&peers, a, b),
                    device,
                    ctx: ctx.as_deref(),
                    nch: nch_all as u32,
                    block_bytes: layout.bytes() as usize,
                    fifo: &|b, c| crate::transport::FifoAddrs {
                        simple: layout.buff(b, c),
                        ll: layout.ll(b, c),
                        ll128: layout.ll128(b, c),
                        head: layout.head(b, c),
                        tail: layout.tail(b, c),
                    },
                    buffsize: params.buffsize,
                    ll_buffsize: layout.ll_buffsize,
                    ll128_buffsize: layout.ll128_buffsize,
                    initial_step: params.initial_step,
                    abort_flag: proxy_abort.flag,
                    abort_who: proxy_abort.who,
                    host_abort_lines: proxy_abort.host_lines.clone(),
                },
                &mut conn_host,
            )?
        } {
            for peer in (0..nranks).filter(|&p| p != rank) {
                if let Some(b) = net.kernel_base(peer) {
                    conn_base[peer] = b;
                }
            }
            links.push(PeerLink::Net { _held: net });
        }
        let ring_pairs = (0..nch_all)
            .flat_map(|c| {
                let (next, prev) = link(c, rank);
                [next, prev]
            })
            .zip(kinds.iter().copied());
        for (peer, kind) in ring_pairs {
            if peer != rank && (kind == TransportKind::Net) != (conn_base[peer] != 0) {
                return Err(Error::Internal(format!(
                    "rank {rank}: init chose {kind} for ring neighbour {peer} but the NET setup disagrees"
                )));
            }
        }
        // CUDA SHM: each rank whose neighbour uses SHM creates its segment, and every rank learns
        // whether all of them exist before any maps one (so all fail alike, naming the rank).
        if (0..nranks).any(|a| {
            peers[a].cuda
                && (0..nch_all).any(|c| select_transport(&peers, a, link(c, a).0) == TransportKind::Shm)
        }) {
            let made = match &ctx {
                Some(ctx) if kinds.contains(&TransportKind::Shm) => {
                    RegisteredShm::create_with(
                        ctx,
                        &own_name,
                        layout.bytes() as usize,
                        &layout.counter_offsets(),
                        params.initial_step,
                    )
                    .map(Some)
                }
                _ => Ok(None),
            };
            let status = made.as_ref().err().map_or(String::new(), |e| e.to_string());
            let all = bootstrap.allgather(status.as_bytes())?;
            host_conns.shm = made?;
            if let Some((r, why)) = all.iter().enumerate().find(|(_, b)| !b.is_empty()) {
                return Err(Error::Remote(format!(
                    "rank {rank}: rank {r} cannot create its SHM connection memory: {}",
                    String::from_utf8_lossy(why)
                )));
            }
        }
        // Every ring neighbour of every channel (one next and one prev unless the rings differ
        // per channel, in which case all use one transport, see above).
        let mut neighbours: Vec<(usize, TransportKind)> = Vec::new();
        for c in 0..nch_all {
            let (next, prev) = link(c, rank);
            for peer in [next, prev] {
                if !neighbours.iter().any(|&(p, _)| p == peer) {
                    neighbours.push((peer, select_transport(&peers, rank, peer)));
                }
            }
        }
        for (peer, kind) in neighbours {
            if conn_base[peer] == 0 {
                let target = PeerMem {
                    desc: &peers[peer].conn,
                    shm_name: &peers[peer].shm_name,
                    bytes: layout.bytes() as usize,
                };
                let link = crate::transport::transport(kind).connect(&ConnectTo {
                    me: rank,
                    peers: &peers,
                    peer,
                    ctx: ctx.as_ref(),
                    target,
                    p2p_level: params.p2p_level,
                    topo: &topo,
                })?;
                conn_base[peer] = link.base();
                links.push(link);
            }
        }
        // The trees, on communicators spanning hosts (every rank takes part, or none).
        let trees = rank_trees::setup(&rank_trees::TreeSetup {
            bootstrap: &bootstrap,
            rank,
            peers: &peers,
            rings: &rings,
            nch,
            params: &params,
            ctx: ctx.as_ref(),
            device,
            wanted: selection.algos.0[Algo::Tree as usize],
            test_nodes: if in_process { test_nodes(nranks)? } else { None },
            shm_name: peers[rank].tree_shm_name(),
            abort: proxy_abort,
            topo: &topo,
        })?;
        let (tree_mem, comm_trees, tree_array, tree_host_path, tree_counters) = match trees {
            Some(mut t) => {
                links.append(&mut t.links);
                let ct = CommTrees {
                    shape: t.shape,
                    bytes: t.bytes,
                };
                (t.mem, Some(ct), t.array, t.host_path, t.counters)
            }
            None => (Vec::new(), None, 0, false, Vec::new()),
        };
        // This rank's own connection memory as its kernels address it, per direction (send: the
        // head counters next writes; receive: the FIFOs prev writes).
        let mut own_split = vec![[0u64; 2]; nch_all];
        for (split, ck) in own_split.iter_mut().zip(&chan_kinds) {
            for (at, &kind) in split.iter_mut().zip(ck) {
                *at = match (&own, kind) {
                    (OwnConn::Shm(_) | OwnConn::Host(_), _) => own.base(),
                    (OwnConn::Dev(m), TransportKind::P2p) => m.ptr,
                    (OwnConn::Dev(_), TransportKind::Shm) => {
                        host_conns.shm.as_ref().map_or(0, |m| m.dev_base())
                    }
                    (OwnConn::Dev(_), TransportKind::Net) => {
                        host_conns.net.as_ref().map_or(0, |m| m.dev_ptr())
                    }
                };
                if *at == 0 {
                    return Err(Error::Internal(format!(
                        "rank {rank}: no connection memory for its {kind} neighbour"
                    )));
                }
            }
        }
        // LL128 trusts a 128-byte line to arrive whole, which NVLink gives and host memory (SHM,
        // NET without GPUDirect) does not: a GPU's line can land in two halves, the flag's first
        // (seen on H200: tree LL128 over NET, 64 bytes of a line wrong). So on GPUs whose ring or
        // tree connections go through host memory LL128 is off, also when NCCL_PROTO names it
        // (NCCL then runs it at the risk of silent corruption; oxccl does not). Decided from
        // every pair, and NCCL_PROTO agrees on every rank, so all ranks agree.
        let host_path = tree_host_path
            || (0..nranks).any(|a| {
                peers[a].cuda
                    && (0..nch as usize)
                        .any(|c| select_transport(&peers, a, rings.next(c, a)) != TransportKind::P2p)
            });
        if host_path && selection.protos.0[Proto::Ll128 as usize] {
            let mut protos = selection.protos.0;
            protos[Proto::Ll128 as usize] = false;
            let (var, value) =
                crate::params::env_var("PROTO").unwrap_or(("NCCL_PROTO".into(), String::new()));
            if !protos.iter().any(|&b| b) {
                return Err(Error::invalid(format!(
                    "{var}={value:?}: LL128 cannot run on this communicator: its GPU connections go \
                     through host memory (SHM or NET), where 128-byte lines can arrive torn \
                     (accepted here: LL, Simple)"
                )));
            }
            selection.protos.0 = protos;
            if ll128_forced() {
                tracing::warn!(target: "oxccl::init", rank, "{var}={value:?} names LL128, which is off on this communicator: its GPU connections go through host memory (SHM/NET), where 128-byte lines can arrive torn");
            } else {
                tracing::info!(target: "oxccl::init", rank, "LL128 off: GPU connections through host memory (SHM/NET)");
            }
        }
        phases.mark("connections (P2P/SHM/NET)");
        // The call check's rows: every rank's mapped when all ranks share this host (every
        // rank decides from the same peer list), else dropped (the check gathers).
        let check_rows = call_check::Rows::for_peers(check_rows, rank, &peers)?;
        // Every rank has mapped what it needs: the names can go (the mappings stay).
        bootstrap.barrier()?;
        let unlinked = match &own {
            OwnConn::Shm(s) => s.unlink(),
            OwnConn::Host(_) | OwnConn::Dev(_) => Ok(()),
        }
        .and(host_conns.shm.as_ref().map_or(Ok(()), |m| m.seg.unlink()))
        .and(check_rows.as_ref().map_or(Ok(()), |r| r.unlink()))
        .and(rank_trees::unlink(&tree_mem));
        if let Err(e) = unlinked.and(if rank == leader { page.unlink() } else { Ok(()) }) {
            tracing::warn!(target: "oxccl::init", "{e}");
        }
        let abort = SharedAbort::new(page, rank, nranks, ctx.as_ref())?;
        let abort_dev = abort.dev_flag;
        // What the timeout watch samples (comm/timeout.rs): every distinct block of this rank's
        // ring counters (by direction: P2P, SHM and NET neighbours' blocks may differ), then its
        // tree counters; and the host's issued-call counters.
        let mut regions: Vec<timeout::Region> = Vec::new();
        let region_at = |base: u64, regions: &mut Vec<timeout::Region>| -> usize {
            let addr = layout.head(base, 0);
            let mut at = 0;
            for r in regions.iter() {
                if r.addr == addr {
                    return at;
                }
                at += r.bytes;
            }
            regions.push(timeout::Region {
                addr,
                bytes: nch_all * COUNTERS_BYTES as usize,
            });
            at
        };
        let ring_counters: Vec<timeout::RingCounters> = (0..nch as usize)
            .map(|c| timeout::RingCounters {
                channel: c,
                head_at: region_at(own_split[c][0], &mut regions) + c * COUNTERS_BYTES as usize,
                tail_at: region_at(own_split[c][1], &mut regions) + c * COUNTERS_BYTES as usize + 128,
                next: rings.next(c, rank),
                prev: rings.prev(c, rank),
            })
            .collect();
        // The peer channels' counters too (in the same blocks, after the ring channels'), so
        // sends and receives that progress are seen as progress.
        for own in &own_split[nch as usize..] {
            region_at(own[0], &mut regions);
            region_at(own[1], &mut regions);
        }
        regions.extend(tree_counters.into_iter().map(|(addr, bytes)| timeout::Region { addr, bytes }));
        let issued: Vec<(usize, u64)> = (0..nranks)
            .filter(|&r| peers[r].host == peers[rank].host)
            .map(|r| (r, abort.issued(r)))
            .collect();
        let watch_flag = abort.own_flag();
        let uses_dev = kinds.contains(&TransportKind::P2p);
        // Per channel, the kernel's address of the NET staging block its send connection writes.
        let net_staging: Vec<Option<u64>> = (0..nch_all)
            .map(|c| (chan_kinds[c][0] == TransportKind::Net).then(|| conn_base[link(c, rank).0]))
            .collect();
        // The host's ranks in other processes: their death raises this host's flags.
        let me = &peers[rank];
        let host_ranks = (0..nranks).filter(|&r| r != rank && peers[r].host == me.host);
        let watch = crate::liveness::Watch {
            rank,
            own_flag: abort.own_flag(),
            own_line: abort.line(rank),
            host_lines: host_ranks.clone().map(|r| abort.line(r)).collect(),
            peers: host_ranks
                .filter(|&r| peers[r].pid != me.pid && peers[r].start_time != 0)
                .map(|r| (r, peers[r].pid, peers[r].start_time))
                .collect(),
        };
        // SAFETY: the flags and lines are in `abort`'s page (or its private flag), which
        // `InitRankRes` keeps until after the watch (field order).
        let watched = unsafe { crate::liveness::watch(watch) };
        let mp = InitRankRes {
            rank,
            peers,
            links: Mutex::new(links),
            _host_conns: host_conns,
            _tree_mem: tree_mem,
            watched: Mutex::new(watched),
            abort,
            synced: std::sync::atomic::AtomicBool::new(false),
            bootstrap,
        };
        // Direct pointers (NCCL's P2P/direct): the ranks of a process group share one address
        // space; when every ring pair is P2P, a Simple step goes straight into the receiver's
        // output. Decided from every pair, so both ends of each connection agree.
        let direct = in_process
            && nranks > 1
            && params.p2p_direct
            && (0..nranks).all(|a| {
                (0..nch as usize).all(|c| select_transport(&mp.peers, a, rings.next(c, a)) == TransportKind::P2p)
            });
        // The ranks of this process group on this rank's GPU (their launches go in step).
        let sharing: Vec<usize> = match &process {
            Some(_) if is_cuda => (0..nranks)
                .filter(|&p| p != rank && mp.peers[p].pid == mp.peers[rank].pid && mp.peers[p].dev == device_index(device))
                .collect(),
            _ => Vec::new(),
        };
        let block_bytes = comm_block_bytes(nch as usize, nranks, peer_ch);
        let inflight = Arc::new(AtomicUsize::new(0));
        let (dev_comm, res, member) = match (own, ctx) {
            (own @ (OwnConn::Shm(_) | OwnConn::Host(_)), None) => {
                let comm_mem = HostMem::zeroed(block_bytes)?;
                let mut bytes = build_comm_block(
                    rank,
                    nranks,
                    nch,
                    &layout,
                    &conn_base,
                    comm_mem.addr(),
                    abort_dev,
                    &params,
                    &rings,
                    peer_ch,
                );
                net_step_sizes(&mut bytes, &layout, &net_staging);
                set_trees(&mut bytes, tree_array);
                if direct {
                    bytes = direct_pointers(bytes, nch, nranks, &params);
                }
                // SAFETY: the block was allocated with exactly this size; nothing else uses it yet.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), comm_mem.addr() as *mut u8, bytes.len())
                };
                let dev_comm = comm_mem.addr();
                let group = Arc::new(CpuGroup {
                    comm_mem,
                    running: AtomicUsize::new(0),
                    replaying: Arc::new(AtomicUsize::new(0)),
                    last_launch: Mutex::new(None),
                    _own: own,
                    mp,
                });
                let member = Member::Cpu {
                    group: group.clone(),
                    inflight: inflight.clone(),
                };
                (dev_comm, Res::Cpu(CpuRes { group }), member)
            }
            (OwnConn::Dev(mem), Some(ctx)) => {
                let block = cuda::DevAlloc::zeroed(&ctx, block_bytes)?;
                let mut bytes = build_comm_block_split(
                    rank, nranks, nch, &layout, &conn_base, &own_split, block.ptr, abort_dev, &params, &rings, peer_ch,
                );
                net_step_sizes(&mut bytes, &layout, &net_staging);
                set_trees(&mut bytes, tree_array);
                if direct {
                    bytes = direct_pointers(bytes, nch, nranks, &params);
                }
                block.write(0, &bytes)?;
                let dev_comm = block.ptr;
                let launch = LaunchState::new(&ctx)?;
                let group = Arc::new(CudaGroup {
                    _comm_mem: block,
                    // Without a P2P neighbour no one maps the device block: freed now.
                    _conn_mem: if uses_dev { vec![mem] } else { Vec::new() },
                    mp,
                });
                let member = Member::Cuda {
                    group: group.clone(),
                    launch: launch.clone(),
                };
                let res = Res::Cuda(CudaRes {
                    ctx,
                    group,
                    launch,
                    sharing,
                });
                (dev_comm, res, member)
            }
            _ => return Err(Error::Internal("connection memory of the wrong kind".into())),
        };
        // Point-to-point: the status record of its receives, and on GPUs its kernel, loaded now:
        // loading it later, while a peer's kernel spins for this rank, could wait for that
        // kernel.
        let p2p_status = Arc::new(send_recv::StatusMem::new(match &res {
            Res::Cuda(r) => Some(&r.ctx),
            Res::Cpu(_) => None,
        })?);
        let call_check = call_check::CallCheck::for_rank(&params, nranks, &res, check_rows, peer_ch.check_channel())?;
        let p2p_module = match &res {
            Res::Cuda(r) if nranks > 1 => match r.ctx.kernel(oxccl_gpu::abi::P2P_KERNEL_NAME) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::debug!(target: "oxccl::init", rank, "no point-to-point kernel: {e}");
                    None
                }
            },
            _ => None,
        };
        let busy = match &res {
            Res::Cuda(r) => timeout::Busy::Cuda(r.launch.clone(), r.ctx.clone()),
            Res::Cpu(r) => timeout::Busy::Cpu(inflight.clone(), r.group.replaying.clone()),
        };
        // SAFETY: the regions, the flag and the issued-call counters lie in memory that `res`
        // owns (this rank's connection and tree memory, the host's abort page it maps), which
        // lives until after `Comm`'s drop has retired the watch.
        let watch = unsafe {
            timeout::Watch::new(timeout::WatchSetup {
                rank,
                nranks,
                comm: tag,
                limit: params.timeout,
                busy,
                regions,
                ring: ring_counters,
                flag: watch_flag,
                issued,
                recorder_size: params.flight_recorder_size,
                dump_prefix: params.flight_recorder_dump.clone(),
            })
        };
        // A process group: every rank is registered before any returns (so an abort or a
        // launch sees them all).
        if let Some(process) = &process {
            if process.members[rank].set(member).is_err() {
                return Err(Error::Internal(format!("rank {rank} registered twice in its process group")));
            }
            let bootstrap = match &res {
                Res::Cuda(r) => &r.group.mp.bootstrap,
                Res::Cpu(r) => &r.group.mp.bootstrap,
            };
            bootstrap.barrier()?;
        }
        phases.mark("barrier and device block");
        tracing::debug!(target: "oxccl::init", rank, nranks, nch, cuda = is_cuda, in_process, direct, total_ms = phases.total_ms(), "communicator ready");
        Ok(Comm::from_state(CommState {
            rank,
            nranks,
            device,
            params,
            selection,
            nchannels: nch,
            comm_tag: tag,
            peer_channels: peer_ch,
            p2p_module,
            p2p_status,
            call_check,
            dev_comm,
            res,
            inflight,
            launches: Arc::new(AtomicU64::new(0)),
            last: Mutex::new(None),
            trees: comm_trees,
            rings,
            finalized: std::sync::atomic::AtomicBool::new(false),
            revoked: std::sync::atomic::AtomicBool::new(false),
            config: config.clone(),
            fabric,
            conn_bytes: layout.bytes(),
            direct,
            process,
            watch,
        }))
    }
}

/// A short tag of a unique id, so segment names of different communicators never collide.
pub(super) fn id_tag(id: &crate::bootstrap::UniqueId) -> u64 {
    crate::hash::fnv1a_64(&id.to_bytes()) & 0xffff_ffff
}

/// How the ranks of a communicator meet: through the bootstrap of a unique id (TCP,
/// [`Comm::init_rank`]) or through an in-process bootstrap with the other ranks of one
/// [`Comm::init_all`] (`tag` names their `/dev/shm` segments).
pub(super) enum Join<'a> {
    Id(&'a crate::bootstrap::UniqueId),
    InProcess {
        bootstrap: crate::bootstrap::Bootstrap,
        process: Arc<ProcessGroup>,
        tag: u64,
    },
}

/// A tag for one `init_all`: its `/dev/shm` names (which also carry the process id) and its
/// communicator id in flight-recorder dumps. From the process id, its start time and a counter,
/// so groups of different processes get different ids.
fn local_tag() -> u64 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let pid = std::process::id();
    let start = crate::liveness::proc_start(pid).map_or(0, |(t, _)| t);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
    let bytes: Vec<u8> = [u64::from(pid), start, n].iter().flat_map(|v| v.to_le_bytes()).collect();
    crate::hash::fnv1a_64(&bytes) & 0xffff_ffff
}

/// The device index of `device` (CUDA ordinal or CPU-target index), as [`PeerInfo::dev`].
fn device_index(device: Device) -> usize {
    match device {
        Device::Cuda(o) | Device::Cpu(o) => o,
    }
}
