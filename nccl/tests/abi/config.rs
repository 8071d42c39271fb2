//! `ncclCommInitRankConfig`'s config, read as NCCL reads it: `size` bytes copied (at most 80), the
//! magic checked, fields newer than `version` reset, each value checked; `blocking = 0`: the
//! init returns `ncclInProgress` and completes in the background.
use crate::common::*;
use std::ffi::c_int;
use std::ptr::null_mut;

/// `ncclCommInitRankConfig` of a one-rank communicator with `cfg` (NULL when `None`); the
/// result, destroying the communicator on success.
fn init_with(cfg: Option<&mut Config>) -> c_int {
    let n = nccl();
    let mut c: Comm = std::ptr::without_provenance_mut(0xdead);
    let p = cfg.map_or(null_mut(), |c| c as *mut Config);
    // SAFETY: a writable handle and a valid (or NULL) config.
    let code = unsafe { (n.init_rank_config)(&mut c, 1, unique_id(), 0, p) };
    if code == SUCCESS {
        let mut e: c_int = -1;
        // SAFETY: a live handle.
        expect(unsafe { (n.get_async_error)(c, &mut e) }, SUCCESS, &[]);
        assert_eq!(e, SUCCESS);
        destroy(c);
    } else {
        assert!(c.is_null(), "a failed init leaves *comm NULL");
    }
    code
}

#[test]
fn default_and_null_configs_are_accepted() {
    assert_eq!(std::mem::size_of::<Config>(), 80);
    expect(init_with(None), SUCCESS, &[]);
    expect(init_with(Some(&mut Config::initializer())), SUCCESS, &[]);
}

/// Two ranks with `blocking = 0`, from one thread (a blocking init would wait for the other
/// rank forever): each init returns `ncclInProgress` with its handle set; polling
/// `ncclCommGetAsyncError` sees `ncclInProgress` until both are up, then `ncclSuccess`; the
/// communicator then reduces exactly.
#[test]
fn non_blocking_inits_complete_in_the_background() {
    let n = nccl();
    let id = unique_id();
    let mut cfg = Config::initializer();
    cfg.blocking = 0;
    let mut comms: Vec<Comm> = vec![std::ptr::without_provenance_mut(0xdead); 2];
    for (r, c) in comms.iter_mut().enumerate() {
        // SAFETY: a writable handle and a valid config.
        expect(unsafe { (n.init_rank_config)(c, 2, id, r as c_int, &mut cfg) }, IN_PROGRESS, &[]);
        assert!(!c.is_null(), "rank {r}: the handle is set at once");
    }
    let start = std::time::Instant::now();
    for (r, &c) in comms.iter().enumerate() {
        loop {
            let mut e: c_int = -1;
            // SAFETY: a live (pending) handle.
            expect(unsafe { (n.get_async_error)(c, &mut e) }, SUCCESS, &[]);
            if e == SUCCESS {
                break;
            }
            assert_eq!(e, IN_PROGRESS, "rank {r}");
            assert!(start.elapsed() < std::time::Duration::from_secs(60), "rank {r}: still in progress");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    let send: Vec<Vec<f32>> = (0..2).map(|r| (0..8).map(|i| (i * (r + 1)) as f32).collect()).collect();
    let mut recv = vec![vec![0f32; 8]; 2];
    // SAFETY: host buffers (CPU target) alive until the finalize below.
    unsafe {
        for r in 0..2 {
            expect((n.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 8, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        for &c in &comms {
            expect((n.finalize)(c), SUCCESS, &[]);
        }
    }
    for &c in &comms {
        destroy(c);
    }
    for r in 0..2 {
        assert_eq!(recv[r], (0..8).map(|i| (3 * i) as f32).collect::<Vec<_>>(), "rank {r}");
    }
}

#[test]
fn magic_is_checked() {
    let mut c = Config::initializer();
    c.magic = 0x1234_5678;
    expect(init_with(Some(&mut c)), INVALID_ARGUMENT, &["ncclCommInitRankConfig", "magic", "NCCL_CONFIG_INITIALIZER"]);
    // A size too small to hold the magic reads none.
    let mut c = Config::initializer();
    c.size = 8;
    expect(init_with(Some(&mut c)), INVALID_ARGUMENT, &["magic"]);
}

#[test]
fn values_are_checked_and_named() {
    for (set, name) in [
        (&(|c: &mut Config| c.blocking = 2) as &dyn Fn(&mut Config), "blocking"),
        (&|c: &mut Config| c.min_ctas = 0, "minCTAs"),
        (&|c: &mut Config| (c.min_ctas, c.max_ctas) = (8, 2), "minCTAs"),
        (&|c: &mut Config| c.cta_policy = 3, "CTAPolicy"),
        (&|c: &mut Config| c.n_channels_per_net_peer = 65, "nChannelsPerNetPeer"),
        (&|c: &mut Config| c.nvlink_centric_sched = 2, "nvlinkCentricSched"),
    ] {
        let mut c = Config::initializer();
        set(&mut c);
        expect(init_with(Some(&mut c)), INVALID_ARGUMENT, &[&format!("config->{name}")]);
    }
}

#[test]
fn fields_beyond_size_are_not_read() {
    // A 2.27 program's config is 72 bytes: the two 2.28 fields are not its own.
    let mut c = Config::initializer();
    c.nvlink_centric_sched = 9;
    expect(init_with(Some(&mut c)), INVALID_ARGUMENT, &["nvlinkCentricSched"]);
    c.size = 72;
    expect(init_with(Some(&mut c)), SUCCESS, &[]);
}

#[test]
fn fields_newer_than_version_are_reset() {
    let mut c = Config::initializer();
    c.n_channels_per_net_peer = -3;
    expect(init_with(Some(&mut c)), INVALID_ARGUMENT, &["nChannelsPerNetPeer"]);
    c.version = 22700;
    expect(init_with(Some(&mut c)), SUCCESS, &[]);
    // blocking predates 2.14.
    let mut c = Config::initializer();
    c.blocking = 5;
    c.version = 21300;
    expect(init_with(Some(&mut c)), SUCCESS, &[]);
}

#[test]
fn ranks_are_checked() {
    let n = nccl();
    let mut c: Comm = null_mut();
    // SAFETY: a writable handle.
    unsafe {
        expect((n.init_rank)(&mut c, 2, unique_id(), 2), INVALID_ARGUMENT, &["rank 2 of nranks 2"]);
        expect((n.init_rank)(&mut c, 0, unique_id(), 0), INVALID_ARGUMENT, &["nranks 0"]);
        expect((n.init_rank)(&mut c, 2, unique_id(), -1), INVALID_ARGUMENT, &["rank -1"]);
        let mut junk = UniqueId { internal: [7; 128] };
        expect((n.init_rank)(&mut c, 1, junk, 0), INVALID_ARGUMENT, &["unique id"]);
        expect((n.init_rank_scalable)(&mut c, 2, 0, 3, &mut junk, null_mut()), INVALID_ARGUMENT, &["nId is 3"]);
    }
}
