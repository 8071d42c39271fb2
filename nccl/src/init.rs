//! Communicator lifetime (NCCL's `init.cc`): version, unique id, the inits and their config,
//! finalize, destroy, abort, the asynchronous error and the queries, over oxccl's
//! [`Comm::init_rank`], [`Comm::init_all`], `finalize`, `destroy`, `abort`, `get_async_error`.
use crate::cuda::{self, KeepCurrent};
use crate::errors::{non_null, set_last_error};
use crate::handles::{self, Clique, Live, NotReady, Target, Teardown};
use crate::types::*;
use oxccl::bootstrap::UniqueId;
use oxccl::{Comm, Device, Error, Result};
use std::ffi::c_int;
use std::mem::size_of;

/// Whether new ranks go to oxccl's CPU target instead of CUDA devices (the test hook
/// `OXCCL_NCCL_TARGET=cpu`, crate docs). Errors: `InvalidArgument` for a value other than
/// `cuda` or `cpu`.
pub(crate) fn cpu_target() -> Result<bool> {
    match std::env::var("OXCCL_NCCL_TARGET") {
        Err(_) => Ok(false),
        Ok(v) if v.eq_ignore_ascii_case("cuda") || v.is_empty() => Ok(false),
        Ok(v) if v.eq_ignore_ascii_case("cpu") => Ok(true),
        Ok(v) => Err(Error::InvalidArgument(format!(
            "OXCCL_NCCL_TARGET={v:?} (accepted: cuda, the default, or cpu, a test hook)"
        ))),
    }
}

/// The device of new rank `rank`: the calling thread's current CUDA device (NCCL's
/// `cudaGetDevice`), or CPU-target device `rank` under the test hook.
pub(crate) fn device_for(rank: usize) -> Result<Device> {
    Ok(if cpu_target()? { Device::Cpu(rank) } else { Device::Cuda(cuda::current_device()?) })
}

/// What oxccl takes from an `ncclConfig_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    /// `blocking` (1 when undefined). 0: the init returns `ncclInProgress` and completes in the
    /// background; the calls still return once their work is queued, never `ncclInProgress`.
    pub(crate) blocking: bool,
}

/// Reads `config` as NCCL's `parseCommConfig` does: NULL gives the defaults; otherwise its
/// leading `size` says how many bytes to copy (at most oxccl's 80), a magic other than
/// `0xcafebeef` is `InvalidArgument`, fields newer than its `version` are reset to undefined,
/// and each defined value is checked as NCCL checks it (`InvalidArgument` naming the field).
///
/// # Safety
/// `config` is NULL or points to at least `config->size` readable bytes (a config of some NCCL
/// version, initialized with its `NCCL_CONFIG_INITIALIZER`).
pub(crate) unsafe fn read_config(config: *const ncclConfig_t) -> Result<Config> {
    if config.is_null() {
        return Ok(Config { blocking: true });
    }
    // SAFETY: every config begins with its size (NCCL reads it the same way).
    let size = unsafe { config.cast::<usize>().read_unaligned() };
    let mut c = ncclConfig_t::initializer();
    c.magic = 0;
    let n = size.min(size_of::<ncclConfig_t>());
    // SAFETY: the caller's config holds `size` ≥ `n` bytes; `c` holds 80 ≥ `n`; distinct objects.
    unsafe { std::ptr::copy_nonoverlapping(config.cast::<u8>(), (&raw mut c).cast::<u8>(), n) };
    if c.magic != NCCL_CONFIG_MAGIC {
        return Err(Error::InvalidArgument(format!(
            "config->magic is {:#x}, not 0xcafebeef ({size} bytes copied): initialize the config with NCCL_CONFIG_INITIALIZER",
            c.magic
        )));
    }
    let d = ncclConfig_t::initializer();
    let v = c.version as c_int;
    if v < nccl_version(2, 14, 0) {
        c.blocking = d.blocking;
    }
    if v < nccl_version(2, 17, 0) {
        (c.cga_cluster_size, c.min_ctas, c.max_ctas, c.net_name) =
            (d.cga_cluster_size, d.min_ctas, d.max_ctas, d.net_name);
    }
    if v < nccl_version(2, 25, 0) {
        c.traffic_class = d.traffic_class;
    }
    if v < nccl_version(2, 27, 0) {
        (c.collnet_enable, c.cta_policy, c.shrink_share, c.nvls_ctas) =
            (d.collnet_enable, d.cta_policy, d.shrink_share, d.nvls_ctas);
    }
    if v < nccl_version(2, 28, 0) {
        (c.n_channels_per_net_peer, c.nvlink_centric_sched) = (d.n_channels_per_net_peer, d.nvlink_centric_sched);
    }
    const U: c_int = NCCL_CONFIG_UNDEF_INT;
    let check = |name: &str, value: c_int, ok: bool, accepted: &str| -> Result<()> {
        if value == U || ok {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "config->{name} is {value} (accepted: {accepted}, or NCCL_CONFIG_UNDEF_INT)"
        )))
    };
    let bool_like = |x: c_int| x == 0 || x == 1;
    check("blocking", c.blocking, bool_like(c.blocking), "0 or 1")?;
    check("cgaClusterSize", c.cga_cluster_size, c.cga_cluster_size >= 0, "0 or more")?;
    check("minCTAs", c.min_ctas, c.min_ctas > 0, "1 or more")?;
    check("maxCTAs", c.max_ctas, c.max_ctas > 0, "1 or more")?;
    if c.min_ctas != U && c.max_ctas != U && c.min_ctas > c.max_ctas {
        return Err(Error::InvalidArgument(format!(
            "config->minCTAs ({}) is larger than config->maxCTAs ({})",
            c.min_ctas, c.max_ctas
        )));
    }
    check("splitShare", c.split_share, bool_like(c.split_share), "0 or 1")?;
    check("collnetEnable", c.collnet_enable, bool_like(c.collnet_enable), "0 or 1")?;
    check("CTAPolicy", c.cta_policy, (0..=NCCL_CTA_POLICY_ZERO).contains(&c.cta_policy), "0..=2")?;
    check("shrinkShare", c.shrink_share, bool_like(c.shrink_share), "0 or 1")?;
    check("nvlsCTAs", c.nvls_ctas, c.nvls_ctas > 0, "1 or more")?;
    check(
        "nChannelsPerNetPeer",
        c.n_channels_per_net_peer,
        (1..=MAXCHANNELS).contains(&c.n_channels_per_net_peer),
        "1..=64",
    )?;
    check("nvlinkCentricSched", c.nvlink_centric_sched, bool_like(c.nvlink_centric_sched), "0 or 1")?;
    let blocking = c.blocking != 0;
    if !blocking {
        tracing::debug!(
            target: "oxccl::nccl",
            "config->blocking = 0: the init completes in the background (ncclInProgress); calls return once queued"
        );
    }
    Ok(Config { blocking })
}

/// `nranks` and `rank` as indices: `InvalidArgument` unless `1 ≤ nranks` and `0 ≤ rank < nranks`.
pub(crate) fn check_ranks(nranks: c_int, rank: c_int) -> Result<(usize, usize)> {
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} of nranks {nranks}: nranks must be 1 or more and rank in 0..nranks"
        )));
    }
    Ok((nranks as usize, rank as usize))
}

/// Creates rank `rank` of unique id `id` now, on `device`; its handle.
pub(crate) fn init_rank_now(nranks: usize, id: [u8; 128], rank: usize, device: Device) -> Result<u64> {
    let uid = UniqueId::from_bytes(&id)?;
    let target = Target::of(device)?;
    let comm = Comm::init_rank(nranks, &uid, rank, device)?;
    let handle = handles::reserve();
    handles::publish(Live::new(handle, comm, target, Some(Clique::of(&id))));
    Ok(handle)
}

/// The common path of `ncclCommInitRank`, `ncclCommInitRankConfig` and
/// `ncclCommInitRankScalable`: `*comm` is NULL on failure (as in NCCL).
///
/// # Safety
/// `comm` is NULL or writable; `config` as [`read_config`].
unsafe fn init_rank_config(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    config: *const ncclConfig_t,
) -> Result<bool> {
    non_null("comm", comm)?;
    // SAFETY: non-NULL, and NCCL's contract: a writable ncclComm_t.
    unsafe { comm.write(std::ptr::null_mut()) };
    // SAFETY: the caller's contract.
    let config = unsafe { read_config(config) }?;
    let (nranks, rank) = check_ranks(nranks, rank)?;
    let bytes = id.bytes();
    UniqueId::from_bytes(&bytes)?;
    let _keep = KeepCurrent::new();
    let device = device_for(rank)?;
    let (handle, in_progress) = if oxccl::group::group_depth() > 0 {
        let handle = handles::new_pending();
        if let Err(e) = crate::group::defer_init(handle, nranks, rank, bytes, device) {
            handles::fail_pending(handle, &e);
            return Err(e);
        }
        (handle, !config.blocking)
    } else if !config.blocking {
        (init_rank_in_background(nranks, bytes, rank, device)?, true)
    } else {
        (init_rank_now(nranks, bytes, rank, device)?, false)
    };
    // SAFETY: as above.
    unsafe { comm.write(handles::to_comm(handle)) };
    Ok(in_progress)
}

/// A non-blocking init (`config->blocking = 0`, NCCL's `ncclInProgress` path): the handle at
/// once, pending until a thread of its own has run [`init_rank_now`]'s work (its
/// `ncclCommGetAsyncError` says `ncclInProgress` meanwhile, then `ncclSuccess` or the init's
/// error).
fn init_rank_in_background(nranks: usize, id: [u8; 128], rank: usize, device: Device) -> Result<u64> {
    let handle = handles::new_pending();
    std::thread::Builder::new()
        .name(format!("oxccl-init-r{rank}"))
        .spawn(move || {
            let made = UniqueId::from_bytes(&id).and_then(|uid| {
                let target = Target::of(device)?;
                Ok((Comm::init_rank(nranks, &uid, rank, device)?, target))
            });
            match made {
                Ok((comm, target)) => handles::publish(Live::new(handle, comm, target, Some(Clique::of(&id)))),
                Err(e) => handles::fail_pending(handle, &e),
            }
        })
        .map_err(|e| Error::System(format!("cannot start the thread of a non-blocking init: {e}")))?;
    Ok(handle)
}

/// Names `handle` (reserved or pending) with `child`, a communicator made by a split or a
/// shrink. The ranks
/// of the new communicator in this process tear down together (as the ranks of one unique id
/// do): its id, the same on all of them, keys the clique.
pub(crate) fn publish_derived(handle: u64, child: Comm) -> Result<()> {
    let target = Target::of(child.device())?;
    let mut key_bytes = [0u8; 128];
    key_bytes[..8].copy_from_slice(&child.comm_id().to_le_bytes());
    key_bytes[8..16].copy_from_slice(b"oxsplit\0");
    handles::publish(Live::new(handle, child, target, Some(Clique::of(&key_bytes))));
    Ok(())
}

/// The result code of an init that `init_rank_config` ran as `f`: `ncclInProgress` when it
/// completes in the background (a non-blocking config), else `ncclSuccess` or the error.
fn init_code(name: &str, f: impl FnOnce() -> Result<bool>) -> ncclResult_t {
    let mut in_progress = false;
    let code = crate::errors::call(name, || {
        in_progress = f()?;
        Ok(())
    });
    if code == ncclSuccess && in_progress { ncclInProgress } else { code }
}

nccl_api! {
    /// The version of the ABI this library implements: 22803 (NCCL 2.28.3).
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) {
        non_null("version", version)?;
        // SAFETY: non-NULL; NCCL's contract: a writable int.
        unsafe { version.write(NCCL_VERSION_CODE) };
        Ok(())
    }

    /// A new unique id: oxccl's bootstrap root starts listening in this process (or, with
    /// `NCCL_COMM_ID`, rank 0's init starts it), and the 128 bytes say where.
    fn ncclGetUniqueId / pncclGetUniqueId(unique_id: *mut ncclUniqueId) {
        non_null("uniqueId", unique_id)?;
        let id = oxccl::bootstrap::get_unique_id()?;
        let bytes = id.to_bytes().map(|b| b as std::ffi::c_char);
        // SAFETY: non-NULL; NCCL's contract: a writable ncclUniqueId.
        unsafe { unique_id.write(ncclUniqueId { internal: bytes }) };
        Ok(())
    }

    /// Rank `rank` of `nranks` on the current CUDA device, with the default config (see
    /// `ncclCommInitRankConfig`).
    fn ncclCommInitRank / pncclCommInitRank(
        comm: *mut ncclComm_t,
        nranks: c_int,
        comm_id: ncclUniqueId,
        rank: c_int,
    ) {
        // SAFETY: the caller's contract; no config (blocking).
        unsafe { init_rank_config(comm, nranks, &comm_id, rank, std::ptr::null()) }.map(|_| ())
    }

    /// Rank `rank` of `nranks` on the current CUDA device. Outside a group a blocking config
    /// (NULL, or `blocking` = 1) returns once every rank has joined; a non-blocking one
    /// (`blocking = 0`) returns `ncclInProgress` with `*comm` set at once, the init running on
    /// a thread of its own until `ncclCommGetAsyncError(*comm)` says `ncclSuccess` (or the
    /// init's error). Inside a group `*comm` is set at once and the communicator created at the
    /// outermost `ncclGroupEnd` (`group.rs`; `ncclInProgress` for a non-blocking config). The
    /// config is read and checked as NCCL does ([`read_config`]). The calls of a communicator
    /// return once their work is queued, never `ncclInProgress`. On failure `*comm` is NULL.
    fn ncclCommInitRankConfig / pncclCommInitRankConfig(
        comm: *mut ncclComm_t,
        nranks: c_int,
        comm_id: ncclUniqueId,
        rank: c_int,
        config: *mut ncclConfig_t,
    ) -> ncclResult_t [panic: ncclInternalError] {
        // SAFETY: the caller's contract.
        init_code("ncclCommInitRankConfig", || unsafe { init_rank_config(comm, nranks, &comm_id, rank, config) })
    }

    /// As `ncclCommInitRankConfig` with the first of the `n_id` ids (every rank passes the same
    /// list): oxccl's bootstrap has one root, which serves any number of ranks.
    fn ncclCommInitRankScalable / pncclCommInitRankScalable(
        newcomm: *mut ncclComm_t,
        nranks: c_int,
        myrank: c_int,
        n_id: c_int,
        comm_ids: *mut ncclUniqueId,
        config: *mut ncclConfig_t,
    ) -> ncclResult_t [panic: ncclInternalError] {
        init_code("ncclCommInitRankScalable", || {
            non_null("newcomm", newcomm)?;
            // SAFETY: non-NULL; NCCL's contract.
            unsafe { newcomm.write(std::ptr::null_mut()) };
            non_null("commIds", comm_ids)?;
            if n_id < 1 || n_id > nranks.max(1) {
                return Err(Error::InvalidArgument(format!("nId is {n_id}; it must be in 1..=nranks ({nranks})")));
            }
            // SAFETY: non-NULL; NCCL's contract: `n_id` ids, and `n_id` ≥ 1.
            let id = unsafe { comm_ids.read_unaligned() };
            // SAFETY: the caller's contract.
            unsafe { init_rank_config(newcomm, nranks, &id, myrank, config) }
        })
    }

    /// One communicator of `ndev` ranks in this process, rank `i` on `devlist[i]` (devices
    /// `0..ndev` when `devlist` is NULL): oxccl's `Comm::init_all`. Runs at once, inside a group
    /// too. On failure every `comm[i]` is NULL.
    fn ncclCommInitAll / pncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) {
        non_null("comm", comm)?;
        let n = non_negative("ndev", ndev)?;
        for i in 0..n {
            // SAFETY: NCCL's contract: `comm` holds `ndev` writable handles.
            unsafe { comm.add(i).write(std::ptr::null_mut()) };
        }
        if n == 0 {
            return Ok(());
        }
        let cpu = cpu_target()?;
        let devices = (0..n)
            .map(|i| {
                let d = if devlist.is_null() {
                    i
                } else {
                    // SAFETY: NCCL's contract: `devlist` holds `ndev` ints.
                    non_negative(&format!("devlist[{i}]"), unsafe { devlist.add(i).read() })?
                };
                Ok(if cpu { Device::Cpu(d) } else { Device::Cuda(d) })
            })
            .collect::<Result<Vec<_>>>()?;
        let _keep = KeepCurrent::new();
        let targets = devices.iter().map(|d| Target::of(*d)).collect::<Result<Vec<_>>>()?;
        let comms = Comm::init_all(&devices)?;
        for (i, (c, target)) in comms.into_iter().zip(targets).enumerate() {
            let handle = handles::reserve();
            handles::publish(Live::new(handle, c, target, None));
            // SAFETY: as above.
            unsafe { comm.add(i).write(handles::to_comm(handle)) };
        }
        Ok(())
    }

    /// Waits for the communicator's queued work and, for ranks that met through a unique id,
    /// for every rank's finalize (oxccl's `Comm::finalize`); later collectives are refused.
    /// When this process holds several ranks of the communicator, it is carried out once each
    /// of them has asked (`handles.rs`). Inside a group it is carried out at the group's
    /// outermost end, after the group's work (`group.rs`).
    fn ncclCommFinalize / pncclCommFinalize(comm: ncclComm_t) {
        let live = handles::get(comm)?;
        if oxccl::group::group_depth() > 0 {
            // Carried out at the group's end, after the group's work (NCCL runs a finalize
            // issued in a group as a job of its end); calls on it are refused from now.
            if !live.finalizing.swap(true, std::sync::atomic::Ordering::AcqRel) {
                crate::group::defer_teardown(live, Teardown::Finalize);
            }
            return Ok(());
        }
        let _keep = KeepCurrent::new();
        handles::teardown(live, Teardown::Finalize)
    }

    /// Frees the communicator after its queued work (oxccl's `Comm::destroy`; for ranks sharing
    /// this process see `ncclCommFinalize`). A NULL `comm` is a no-op, as in NCCL; a handle whose
    /// init failed is released. Afterwards the handle is invalid. Inside a group the
    /// communicator is freed at the group's outermost end, after the group's work (`group.rs`).
    fn ncclCommDestroy / pncclCommDestroy(comm: ncclComm_t) {
        if comm.is_null() {
            return Ok(());
        }
        let _keep = KeepCurrent::new();
        match handles::remove(comm)? {
            // Inside a group: the handle is invalid now, the communicator freed at the group's
            // end, after the group's work (as a finalize issued there).
            Some(live) if oxccl::group::group_depth() > 0 => {
                crate::group::defer_teardown(live, Teardown::Destroy);
                Ok(())
            }
            Some(live) => handles::teardown(live, Teardown::Destroy),
            None => Ok(()),
        }
    }

    /// Stops the communicator's operations (oxccl's `Comm::abort`: every kernel waiting for a
    /// peer exits) and frees it. A NULL `comm` is a no-op, as in NCCL.
    fn ncclCommAbort / pncclCommAbort(comm: ncclComm_t) {
        if comm.is_null() {
            return Ok(());
        }
        let _keep = KeepCurrent::new();
        match handles::remove(comm)? {
            Some(live) => handles::abort(live),
            None => Ok(()),
        }
    }

    /// Revokes `comm` (oxccl's `Comm::revoke`, NCCL 2.28.9's call): stops its in-flight
    /// operations (their outputs are undefined), returns once none is left; afterwards only
    /// `ncclCommSplit`, `ncclCommShrink`, `ncclCommDestroy` and `ncclCommAbort` are accepted
    /// (collectives, sends, receives and `ncclCommFinalize` are `ncclInvalidUsage`).
    /// `revokeFlags` must be `NCCL_REVOKE_DEFAULT` (0): `ncclInvalidArgument` otherwise.
    /// `ncclInvalidUsage` when already revoked, finalized or aborted. Also on non-blocking
    /// communicators the call completes before it returns.
    fn ncclCommRevoke / pncclCommRevoke(comm: ncclComm_t, revoke_flags: c_int) {
        let live = handles::get(comm)?;
        if revoke_flags != NCCL_REVOKE_DEFAULT {
            return Err(Error::InvalidArgument(format!(
                "revokeFlags is {revoke_flags}; the only value accepted is NCCL_REVOKE_DEFAULT (0)"
            )));
        }
        live.check_not_finalizing()?;
        let _keep = KeepCurrent::new();
        live.comm.revoke()
    }

    /// Splits `comm` (oxccl's `Comm::split`): every rank of it calls this, from a thread of its
    /// own, or inside a group (the handle is pending until the group's end, which runs the
    /// group's splits together; NULL at once for `NCCL_SPLIT_NOCOLOR`); the ranks of one
    /// `color` form `*newcomm`, ordered by `key`; `NCCL_SPLIT_NOCOLOR` gives NULL. `config` may
    /// be NULL; it is read and checked as for `ncclCommInitRankConfig`. The new communicator is
    /// on the same device as `comm` and independent of it.
    fn ncclCommSplit / pncclCommSplit(
        comm: ncclComm_t,
        color: c_int,
        key: c_int,
        newcomm: *mut ncclComm_t,
        config: *mut ncclConfig_t,
    ) {
        non_null("newcomm", newcomm)?;
        // SAFETY: non-NULL; NCCL's contract.
        unsafe { newcomm.write(std::ptr::null_mut()) };
        let live = handles::get(comm)?;
        // SAFETY: the caller's contract.
        let _config = unsafe { read_config(config) }?;
        if oxccl::group::group_depth() > 0 {
            // Carried out at the group's end, with the group's other splits (group.rs);
            // `NCCL_SPLIT_NOCOLOR` takes part in the exchange there but gets no communicator.
            let handle = (color != oxccl::SPLIT_NOCOLOR).then(handles::new_pending);
            crate::group::defer_split(handle, live, crate::group::Derive::Split { color, key });
            if let Some(handle) = handle {
                // SAFETY: non-NULL (checked above).
                unsafe { newcomm.write(handles::to_comm(handle)) };
            }
            return Ok(());
        }
        let _keep = KeepCurrent::new();
        let Some(child) = live.comm.split(color, key)? else {
            return Ok(());
        };
        let handle = handles::reserve();
        publish_derived(handle, child)?;
        // SAFETY: non-NULL (checked above).
        unsafe { newcomm.write(handles::to_comm(handle)) };
        Ok(())
    }

    /// A communicator of the ranks of `comm` not in `excludeRanksList` (`excludeRanksCount`
    /// entries), in their order (oxccl's `Comm::shrink`): called by every surviving rank, from a
    /// thread each; the excluded ranks take no part. `shrinkFlags`: `NCCL_SHRINK_DEFAULT` (0,
    /// the parent stays usable) or `NCCL_SHRINK_ABORT` (1, the parent's pending operations are
    /// aborted first). Inside a group the handle is pending until the group's end, which runs the
    /// group's shrinks and splits together. `*newcomm` is NULL on failure.
    fn ncclCommShrink / pncclCommShrink(
        comm: ncclComm_t,
        exclude_ranks_list: *mut c_int,
        exclude_ranks_count: c_int,
        newcomm: *mut ncclComm_t,
        config: *mut ncclConfig_t,
        shrink_flags: c_int,
    ) {
        non_null("newcomm", newcomm)?;
        // SAFETY: non-NULL; NCCL's contract.
        unsafe { newcomm.write(std::ptr::null_mut()) };
        let live = handles::get(comm)?;
        // SAFETY: the caller's contract.
        let _config = unsafe { read_config(config) }?;
        let count = non_negative("excludeRanksCount", exclude_ranks_count)?;
        if count > 0 {
            non_null("excludeRanksList", exclude_ranks_list)?;
        }
        let abort_first = match shrink_flags {
            NCCL_SHRINK_DEFAULT => false,
            NCCL_SHRINK_ABORT => true,
            f => {
                return Err(Error::InvalidArgument(format!(
                    "shrinkFlags {f} is not a shrink flag (accepted: 0 NCCL_SHRINK_DEFAULT, 1 NCCL_SHRINK_ABORT)"
                )));
            }
        };
        let exclude = (0..count)
            .map(|i| {
                // SAFETY: non-NULL (checked above); NCCL's contract: `excludeRanksCount` ints.
                let r = unsafe { exclude_ranks_list.add(i).read() };
                non_negative("excludeRanksList entry", r)
            })
            .collect::<Result<Vec<usize>>>()?;
        if oxccl::group::group_depth() > 0 {
            // Carried out at the group's end, with the group's other splits and shrinks.
            let handle = handles::new_pending();
            crate::group::defer_split(Some(handle), live, crate::group::Derive::Shrink { exclude, abort_first });
            // SAFETY: non-NULL (checked above).
            unsafe { newcomm.write(handles::to_comm(handle)) };
            return Ok(());
        }
        let _keep = KeepCurrent::new();
        let child = live.comm.shrink(&exclude, abort_first)?;
        let handle = handles::reserve();
        publish_derived(handle, child)?;
        // SAFETY: non-NULL (checked above).
        unsafe { newcomm.write(handles::to_comm(handle)) };
        Ok(())
    }

    /// `*async_error`: `ncclSuccess` while healthy, `ncclInProgress` while the communicator's
    /// init waits for its group's end, the init's error if it failed there, else oxccl's
    /// `Comm::get_async_error` (a peer's abort, a timeout, a kernel failure; its message goes to
    /// `ncclGetLastError`).
    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) {
        non_null("asyncError", async_error)?;
        let code = match handles::lookup(comm) {
            Ok(live) => {
                let deferred = live.deferred_error.lock().unwrap_or_else(|p| p.into_inner()).clone();
                match deferred {
                    Some((code, msg)) => {
                        set_last_error(&format!("ncclCommGetAsyncError: {msg}"));
                        code
                    }
                    None => match live.comm.get_async_error() {
                        Ok(()) => ncclSuccess,
                        Err(e) => {
                            set_last_error(&format!("ncclCommGetAsyncError: {e}"));
                            e.code() as ncclResult_t
                        }
                    },
                }
            }
            Err(Ok(NotReady::Pending)) => ncclInProgress,
            Err(Ok(NotReady::Failed(code, msg))) => {
                set_last_error(&format!("ncclCommGetAsyncError: init failed: {msg}"));
                code
            }
            Err(Err(e)) => return Err(e),
        };
        // SAFETY: non-NULL; NCCL's contract.
        unsafe { async_error.write(code) };
        Ok(())
    }

    /// The number of ranks.
    fn ncclCommCount / pncclCommCount(comm: ncclComm_t, count: *mut c_int) {
        non_null("count", count)?;
        let live = handles::get(comm)?;
        // SAFETY: non-NULL; NCCL's contract.
        unsafe { count.write(live.comm.count() as c_int) };
        Ok(())
    }

    /// The rank's CUDA device (`ncclInvalidUsage` for a CPU-target rank).
    fn ncclCommCuDevice / pncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) {
        non_null("device", device)?;
        let live = handles::get(comm)?;
        let d = live.comm.cu_device()?;
        // SAFETY: non-NULL; NCCL's contract.
        unsafe { device.write(d as c_int) };
        Ok(())
    }

    /// The rank.
    fn ncclCommUserRank / pncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) {
        non_null("rank", rank)?;
        let live = handles::get(comm)?;
        // SAFETY: non-NULL; NCCL's contract.
        unsafe { rank.write(live.comm.user_rank() as c_int) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::c_uint;

    fn read(c: &ncclConfig_t) -> Result<Config> {
        // SAFETY: a whole config.
        unsafe { read_config(c) }
    }

    #[test]
    fn config_is_read_as_nccl_reads_it() {
        let mut c = ncclConfig_t::initializer();
        assert_eq!(read(&c).unwrap(), Config { blocking: true });
        c.blocking = 0;
        assert_eq!(read(&c).unwrap(), Config { blocking: false });
        c.blocking = 2;
        assert!(read(&c).unwrap_err().to_string().contains("config->blocking is 2"));
        // A config older than 2.14 has no blocking field: reset to the default.
        c.version = nccl_version(2, 13, 0) as c_uint;
        assert_eq!(read(&c).unwrap(), Config { blocking: true });
        // Fields beyond `size` are not read.
        let mut c = ncclConfig_t::initializer();
        c.nvlink_centric_sched = 7;
        assert!(read(&c).unwrap_err().to_string().contains("nvlinkCentricSched"));
        c.size = 72;
        assert!(read(&c).is_ok());
        // Fields newer than `version` are reset.
        let mut c = ncclConfig_t::initializer();
        c.n_channels_per_net_peer = -5;
        assert!(read(&c).unwrap_err().to_string().contains("nChannelsPerNetPeer"));
        c.version = nccl_version(2, 27, 0) as c_uint;
        assert!(read(&c).is_ok());
        let mut c = ncclConfig_t::initializer();
        c.magic = 0x1234;
        assert!(read(&c).unwrap_err().to_string().contains("magic"));
        let mut c = ncclConfig_t::initializer();
        (c.min_ctas, c.max_ctas) = (8, 4);
        assert!(read(&c).unwrap_err().to_string().contains("minCTAs"));
        c.max_ctas = NCCL_CONFIG_UNDEF_INT;
        assert!(read(&c).is_ok(), "minCTAs alone is accepted");
        assert_eq!(
            // SAFETY: NULL is allowed.
            unsafe { read_config(std::ptr::null()) }.unwrap(),
            Config { blocking: true }
        );
    }
}
