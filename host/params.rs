//! Environment parameters, read once into an immutable [`Params`] snapshot when communicators are
//! created (NCCL's `NCCL_PARAM`). Every variable is accepted under its NCCL name and, where noted,
//! under an `OXCCL_` spelling, which wins when both are set. Bad values are errors that name the
//! variable and the accepted range, or are rounded with a warning; never silently used.
use oxccl_gpu::arch::TeamKind;
use crate::error::{Error, Result};
use crate::topo::PathType;
use oxccl_gpu::abi::{
    DEFAULT_BUFFSIZE, DEFAULT_NTHREADS, FIFO_STEPS, MAX_CHANNELS, MAX_NTHREADS, MIN_NTHREADS, PACK_BYTES,
    WARP_SIZE,
};

/// Default LL buffer per connection: NCCL's `DEFAULT_LL_BUFFSIZE` (8 lines per thread × 512 threads
/// × 8 steps × 16-byte lines = 512 KiB).
pub const DEFAULT_LL_BUFFSIZE: u64 = 8 * 512 * FIFO_STEPS * 16;

/// Default LL128 buffer per connection: 8 steps of 1024 lines of 128 bytes (120 KiB of data per
/// step) = 1 MiB. NCCL's default is 4.7 MB for 640 threads × 120 elements × 8 steps; oxccl keeps
/// it smaller because it runs up to 64 channels (`NCCL_LL128_BUFFSIZE` overrides).
pub const DEFAULT_LL128_BUFFSIZE: u64 = FIFO_STEPS * 1024 * 128;

/// Smallest Simple buffer accepted: one 16-byte pack... times 64 per slot, so a slot is never tiny.
pub const MIN_BUFFSIZE: u64 = FIFO_STEPS * PACK_BYTES * 64;
/// Largest Simple buffer accepted (per connection).
pub const MAX_BUFFSIZE: u64 = 1 << 30;

/// The parameters of one communicator, from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    /// Simple-protocol connection buffer in bytes (`NCCL_BUFFSIZE` / `OXCCL_BUFFSIZE`), a multiple
    /// of `FIFO_STEPS * 16`.
    pub buffsize: u64,
    /// Threads per block on the GPU (`NCCL_NTHREADS` / `OXCCL_NTHREADS`), a multiple of 32 in
    /// [64, 1024].
    pub nthreads: u32,
    /// Maximum channels (`NCCL_MAX_NCHANNELS` / `OXCCL_MAX_NCHANNELS`), in [1, 64]; `None` = the
    /// backend's default.
    pub max_nchannels: Option<u32>,
    /// Minimum channels of a call (`NCCL_MIN_NCHANNELS` / `OXCCL_MIN_NCHANNELS`).
    pub min_nchannels: Option<u32>,
    /// LL-protocol connection buffer in bytes (`NCCL_LL_BUFFSIZE` / `OXCCL_LL_BUFFSIZE`), a multiple
    /// of `FIFO_STEPS` × 16-byte lines.
    pub ll_buffsize: u64,
    /// LL128-protocol connection buffer in bytes (`NCCL_LL128_BUFFSIZE` / `OXCCL_LL128_BUFFSIZE`),
    /// a whole number of 128-byte lines per step: a multiple of `FIFO_STEPS` × 128.
    pub ll128_buffsize: u64,
    /// Test hook (`OXCCL_TEST_INITIAL_STEP`, oxccl spelling only): the step every connection starts
    /// at, e.g. near 2^31 to exercise the LL flag wrap (case C11) without 10^9 operations.
    pub initial_step: u64,
    /// Farthest path type between two GPUs over which P2P is used (`NCCL_P2P_LEVEL` /
    /// `OXCCL_P2P_LEVEL`, see [`parse_p2p_level`] and [`p2p_allowed`]); `None` when unset.
    pub p2p_level: Option<PathType>,
    /// Whether same-process P2P ring connections write straight into the receiver's output
    /// (NCCL's "P2P/direct pointer"); `NCCL_P2P_DIRECT_DISABLE=1` / `OXCCL_P2P_DIRECT_DISABLE=1`
    /// turns it off (0 or 1 accepted). Only `Comm::init_all` has such connections (when every ring
    /// pair uses P2P).
    pub p2p_direct: bool,
    /// Threads per block on the CPU target (`OXCCL_CPU_NTHREADS`, oxccl spelling only): whole
    /// warps, a multiple of 32 in [32, 1024]; default [`DEFAULT_CPU_NTHREADS`]. A block's
    /// threads split each step as the GPU's do, meet at real barriers, and exchange values by
    /// warp shuffles and votes; LL128's lanes write and read lines as on the GPU.
    pub cpu_nthreads: u32,
    /// How a CPU-target block runs its threads (`OXCCL_CPU_TEAM`, oxccl spelling only): `fibers`
    /// of one host thread (the default: cheap on few cores) or `threads`, a host thread each
    /// (preemptive and parallel, so timing-dependent bugs of a block's threads can show).
    pub cpu_team: TeamKind,
    /// How long a call may make no progress before it times out (`OXCCL_TIMEOUT` /
    /// `NCCL_TIMEOUT`, seconds, fractions allowed: 0, or [`MIN_TIMEOUT`] to 10^6 s; `0` turns
    /// timeouts off), see `comm/timeout.rs`; default 600 s.
    pub timeout: Option<std::time::Duration>,
    /// Calls the flight recorder keeps per communicator (`OXCCL_FLIGHT_RECORDER_SIZE`, 0 to
    /// 1000000; 0 keeps none), see `comm/flight_recorder.rs`; default 64.
    pub flight_recorder_size: usize,
    /// Where a rank whose call timed out dumps its flight recorder
    /// (`OXCCL_FLIGHT_RECORDER_DUMP`, a path prefix: `<prefix>.<comm>.<rank>.json`, in a
    /// directory that exists and this process may write into); `None`: no dump.
    pub flight_recorder_dump: Option<String>,
    /// Channels (thread blocks, each with its own connection to the peer) a send or receive to
    /// one peer uses (`NCCL_NCHANNELS_PER_PEER` / `OXCCL_NCHANNELS_PER_PEER`, 1 to
    /// [`MAX_P2P_NCHANNELS_PER_PEER`]); `None` = the backend's default (on GPUs 8 channels split
    /// over the peers: 8 for 2 ranks, 4 for 3, 2 for 4 or 5, then 1; 1 on the CPU target). Each is
    /// one more connection per peer, set up at init.
    pub p2p_nchannels_per_peer: Option<u32>,
    /// Largest send, in bytes (the whole send, all its channels), whose data goes over the LL
    /// protocol instead of Simple (`NCCL_P2P_LL_THRESHOLD` / `OXCCL_P2P_LL_THRESHOLD`, 0 to
    /// [`MAX_P2P_LL_THRESHOLD`]; 0: every send on Simple); default 16384, NCCL's. LL needs no
    /// fence and no tail counter, so a small message arrives sooner, at half the bandwidth. The
    /// sender decides and tells the receiver in the send's header, so ranks may set it apart.
    pub p2p_ll_threshold: u64,
    /// Whether ranks check that they issued the same collective call before any data moves
    /// (`OXCCL_CHECK_CALLS`, oxccl spelling only, 0 or 1; default 0), see `comm/call_check.rs`.
    /// Every rank must set the same value.
    pub check_calls: bool,
}

/// Settings given to one communicator at its creation (NCCL's `ncclConfig_t`), each one, when
/// set, instead of its environment variable: [`Comm::init_rank_config`](crate::Comm::init_rank_config),
/// [`Comm::init_all_config`](crate::Comm::init_all_config). Communicators split or shrunk from
/// it inherit its config. Start from `CommConfig::default()` (nothing set: the environment
/// decides everything).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommConfig {
    /// How long a call may make no progress before it times out (`OXCCL_TIMEOUT`; see
    /// [`Params::timeout`]): [`MIN_TIMEOUT`] to 10^6 s; `Duration::ZERO` turns timeouts off.
    pub timeout: Option<std::time::Duration>,
    /// The call-signature check ([`Params::check_calls`], `OXCCL_CHECK_CALLS`); every rank must
    /// choose the same.
    pub check_calls: Option<bool>,
}

impl CommConfig {
    /// Sets the call timeout ([`CommConfig::timeout`]).
    pub fn with_timeout(mut self, limit: std::time::Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// Turns the call-signature check on or off ([`CommConfig::check_calls`]).
    pub fn with_check_calls(mut self, on: bool) -> Self {
        self.check_calls = Some(on);
        self
    }

    /// `params` with this config's settings applied. Errors: `InvalidArgument` naming the field
    /// and its range.
    pub fn apply(&self, mut params: Params) -> Result<Params> {
        if let Some(t) = self.timeout {
            if t > std::time::Duration::from_secs(1_000_000) || (!t.is_zero() && t < MIN_TIMEOUT) {
                return Err(Error::invalid(format!(
                    "CommConfig::timeout {t:?} is out of range (accepted: 0, or 0.1 to 1000000 s; 0 turns call timeouts off)"
                )));
            }
            params.timeout = (!t.is_zero()).then_some(t);
        }
        if let Some(on) = self.check_calls {
            params.check_calls = on;
        }
        Ok(params)
    }
}

/// Default of [`Params::p2p_ll_threshold`] (NCCL's `NCCL_P2P_LL_THRESHOLD`).
pub const DEFAULT_P2P_LL_THRESHOLD: u64 = 16384;
/// Largest accepted [`Params::p2p_ll_threshold`].
pub const MAX_P2P_LL_THRESHOLD: u64 = 1 << 30;

/// Most channels per peer of a send or receive ([`Params::p2p_nchannels_per_peer`]).
pub const MAX_P2P_NCHANNELS_PER_PEER: u32 = 8;

/// Default of [`Params::timeout`]: a call that makes no progress for 10 minutes times out (a
/// progressing call never does, however long it takes).
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Shortest call timeout but 0 (off): 0.1 s. A shorter limit comes near the interval at which
/// the watch samples the progress counters (10 ms at the least, `comm/timeout.rs`), so calls that
/// progress could time out; one below 1 ns would be zero.
pub const MIN_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(100);

/// Default threads per CPU-target block: two warps, as fibers of one host thread.
pub const DEFAULT_CPU_NTHREADS: u32 = 64;

impl Default for Params {
    fn default() -> Self {
        Params {
            buffsize: DEFAULT_BUFFSIZE,
            nthreads: DEFAULT_NTHREADS,
            max_nchannels: None,
            min_nchannels: None,
            ll_buffsize: DEFAULT_LL_BUFFSIZE,
            ll128_buffsize: DEFAULT_LL128_BUFFSIZE,
            initial_step: 0,
            p2p_level: None,
            p2p_direct: true,
            cpu_nthreads: DEFAULT_CPU_NTHREADS,
            cpu_team: TeamKind::Fibers,
            timeout: Some(DEFAULT_TIMEOUT),
            flight_recorder_size: 64,
            flight_recorder_dump: None,
            p2p_nchannels_per_peer: None,
            p2p_ll_threshold: DEFAULT_P2P_LL_THRESHOLD,
            check_calls: false,
        }
    }
}

/// Reads `OXCCL_<name>` or else `NCCL_<name>`; returns the variable's full name and value.
pub fn env_var(name: &str) -> Option<(String, String)> {
    for prefix in ["OXCCL_", "NCCL_"] {
        let key = format!("{prefix}{name}");
        if let Ok(v) = std::env::var(&key) {
            return Some((key, v));
        }
    }
    None
}

fn parse_int(key: &str, v: &str, lo: i64, hi: i64) -> Result<i64> {
    let n: i64 = v
        .trim()
        .parse()
        .map_err(|_| Error::invalid(format!("{key}={v:?} is not an integer (accepted: {lo}..={hi})")))?;
    if n < lo || n > hi {
        return Err(Error::invalid(format!(
            "{key}={n} is out of range (accepted: {lo}..={hi})"
        )));
    }
    Ok(n)
}

/// Checks that the directory of the dump prefix `prefix` (variable `key`) exists and this process
/// may write files into it, so that a dump on a timeout or a signal is not lost to a typo.
fn dump_dir_writable(key: &str, prefix: &str) -> Result<()> {
    // The directory of a file the prefix names (`/tmp/fr/` names files inside `/tmp/fr`).
    let file = format!("{prefix}.json");
    let dir = match std::path::Path::new(&file).parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let refuse = |why: &str| {
        Err(Error::invalid(format!(
            "{key}={prefix:?}: the dumps' directory {} {why} (dumps are written as <prefix>.<comm>.<rank>.json \
             into an existing writable directory)",
            dir.display()
        )))
    };
    if !dir.is_dir() {
        return refuse("is not a directory");
    }
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return refuse("is not a path");
    };
    // SAFETY: access(2) reads the NUL-terminated path only.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return refuse("is not writable");
    }
    Ok(())
}

impl Params {
    /// Reads the environment. Errors name the variable and the accepted range.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(env_var)
    }

    /// As [`Params::from_env`], with the variables given by `get` (tests use this).
    pub fn from_lookup(get: impl Fn(&str) -> Option<(String, String)>) -> Result<Self> {
        let mut p = Params::default();
        if let Some((key, v)) = get("TIMEOUT") {
            let text = v.trim();
            let s: f64 = text
                .parse()
                .ok()
                .filter(|s: &f64| {
                    // A 0 written as 0 (`1e-400` also parses to 0, and is refused as below 0.1).
                    let mantissa = text.split(['e', 'E']).next().unwrap_or("");
                    let zero = *s == 0.0 && !mantissa.contains(|c: char| ('1'..='9').contains(&c));
                    s.is_finite() && (zero || (MIN_TIMEOUT.as_secs_f64()..=1e6).contains(s))
                })
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "{key}={v:?} is not a number of seconds (accepted: 0, or 0.1 to 1000000; 0 turns call timeouts off)"
                    ))
                })?;
            p.timeout = (s > 0.0).then(|| std::time::Duration::from_secs_f64(s));
        }
        if let Some((key, v)) = get("FLIGHT_RECORDER_SIZE") {
            p.flight_recorder_size = parse_int(&key, &v, 0, 1_000_000)? as usize;
        }
        if let Some((key, v)) = get("FLIGHT_RECORDER_DUMP") {
            let prefix = v.trim();
            if !prefix.is_empty() {
                dump_dir_writable(&key, prefix)?;
                p.flight_recorder_dump = Some(prefix.to_string());
            }
        }
        if let Some((key, v)) = get("BUFFSIZE") {
            let n = parse_int(&key, &v, MIN_BUFFSIZE as i64, MAX_BUFFSIZE as i64)? as u64;
            let unit = FIFO_STEPS * PACK_BYTES;
            let rounded = n / unit * unit;
            if rounded != n {
                tracing::warn!(target: "oxccl::init", "{key}={n} rounded down to {rounded} (a multiple of {unit} bytes: {FIFO_STEPS} slots of 16-byte packs)");
            }
            p.buffsize = rounded;
        }
        if let Some((key, v)) = get("NTHREADS") {
            let n = parse_int(&key, &v, MIN_NTHREADS as i64, MAX_NTHREADS as i64)? as u32;
            let rounded = n / WARP_SIZE * WARP_SIZE;
            if rounded != n {
                tracing::warn!(target: "oxccl::init", "{key}={n} rounded down to {rounded} (a multiple of the warp size {WARP_SIZE})");
            }
            p.nthreads = rounded;
        }
        if let Some((key, v)) = get("MAX_NCHANNELS") {
            p.max_nchannels = Some(parse_int(&key, &v, 1, MAX_CHANNELS as i64)? as u32);
        }
        if let Some((key, v)) = get("LL_BUFFSIZE") {
            let unit = FIFO_STEPS * 16;
            let n = parse_int(&key, &v, (unit * 64) as i64, MAX_BUFFSIZE as i64)? as u64;
            let rounded = n / unit * unit;
            if rounded != n {
                tracing::warn!(target: "oxccl::init", "{key}={n} rounded down to {rounded} (a multiple of {unit} bytes: {FIFO_STEPS} slots of 16-byte lines)");
            }
            p.ll_buffsize = rounded;
        }
        if let Some((key, v)) = get("LL128_BUFFSIZE") {
            let unit = FIFO_STEPS * 128;
            let n = parse_int(&key, &v, (unit * 8) as i64, MAX_BUFFSIZE as i64)? as u64;
            let rounded = n / unit * unit;
            if rounded != n {
                tracing::warn!(target: "oxccl::init", "{key}={n} rounded down to {rounded} (a multiple of {unit} bytes: {FIFO_STEPS} slots of 128-byte lines)");
            }
            p.ll128_buffsize = rounded;
        }
        if let Some((key, v)) = get("TEST_INITIAL_STEP").filter(|(k, _)| k.starts_with("OXCCL_")) {
            p.initial_step = parse_int(&key, &v, 0, i64::MAX / 2)? as u64;
        }
        if let Some((key, v)) = get("MIN_NCHANNELS") {
            let min = parse_int(&key, &v, 1, MAX_CHANNELS as i64)? as u32;
            if let Some(max) = p.max_nchannels.filter(|&max| max < min) {
                tracing::warn!(target: "oxccl::init", "{key}={min} is above the maximum of {max} channels (NCCL_MAX_NCHANNELS or OXCCL_MAX_NCHANNELS): calls use {max}");
            }
            p.min_nchannels = Some(min);
        }
        if let Some((key, v)) = get("P2P_LEVEL") {
            p.p2p_level = Some(parse_p2p_level(&key, &v)?);
        }
        if let Some((key, v)) = get("NCHANNELS_PER_PEER") {
            p.p2p_nchannels_per_peer = Some(parse_int(&key, &v, 1, MAX_P2P_NCHANNELS_PER_PEER as i64)? as u32);
        }
        if let Some((key, v)) = get("P2P_LL_THRESHOLD") {
            p.p2p_ll_threshold = parse_int(&key, &v, 0, MAX_P2P_LL_THRESHOLD as i64)? as u64;
        }
        if let Some((key, v)) = get("CHECK_CALLS").filter(|(k, _)| k.starts_with("OXCCL_")) {
            p.check_calls = parse_int(&key, &v, 0, 1)? == 1;
        }
        if let Some((key, v)) = get("P2P_DIRECT_DISABLE") {
            p.p2p_direct = parse_int(&key, &v, 0, 1)? == 0;
        }
        if let Some((key, v)) = get("CPU_NTHREADS").filter(|(k, _)| k.starts_with("OXCCL_")) {
            let n = parse_int(&key, &v, WARP_SIZE as i64, MAX_NTHREADS as i64)? as u32;
            if n % WARP_SIZE != 0 {
                return Err(Error::invalid(format!(
                    "{key}={n} is not a whole number of warps (accepted: a multiple of {WARP_SIZE} in {WARP_SIZE}..={MAX_NTHREADS})"
                )));
            }
            p.cpu_nthreads = n;
        }
        if let Some((key, v)) = get("CPU_TEAM").filter(|(k, _)| k.starts_with("OXCCL_")) {
            p.cpu_team = match v.trim().to_ascii_lowercase().as_str() {
                "fibers" => TeamKind::Fibers,
                "threads" => TeamKind::Threads,
                _ => {
                    return Err(Error::invalid(format!(
                        "{key}={v:?} is not a CPU team kind (accepted: fibers, threads)"
                    )));
                }
            };
        }
        tracing::debug!(target: "oxccl::init", params = ?p, "parameters");
        Ok(p)
    }
}

/// Most data sockets of one socket-network connection (NCCL's `MAX_SOCKETS`).
pub const MAX_SOCKETS: u32 = 64;
/// Largest `NCCL_SOCKET_NTHREADS` (NCCL's `MAX_THREADS`).
pub const MAX_SOCKET_THREADS: u32 = 16;

/// Parallel streams of the socket network (NCCL's `ncclNetSocketGetNsockNthread`): each connection
/// opens `nthreads × nsocks_per_thread` data sockets besides its control socket. NCCL's default
/// is 1 × 1 except on AWS NICs (2 × 8); oxccl uses 1 × 1 everywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketStreams {
    /// `NCCL_SOCKET_NTHREADS` / `OXCCL_SOCKET_NTHREADS`, in 1..=16.
    pub nthreads: u32,
    /// `NCCL_NSOCKS_PERTHREAD` / `OXCCL_NSOCKS_PERTHREAD`, in 1..=64.
    pub nsocks_per_thread: u32,
}

impl Default for SocketStreams {
    fn default() -> Self {
        SocketStreams {
            nthreads: 1,
            nsocks_per_thread: 1,
        }
    }
}

impl SocketStreams {
    /// Data sockets per connection: `nthreads × nsocks_per_thread` (at most [`MAX_SOCKETS`]).
    pub fn nsocks(&self) -> usize {
        (self.nthreads * self.nsocks_per_thread) as usize
    }
}

/// Reads `SOCKET_NTHREADS` and `NSOCKS_PERTHREAD` through `get` (e.g. [`env_var`]). Errors:
/// `InvalidArgument` naming the variable and its accepted range (1..=16, 1..=64), or both
/// variables when their product exceeds [`MAX_SOCKETS`] (NCCL clamps it with a warning instead).
pub fn socket_streams(get: impl Fn(&str) -> Option<(String, String)>) -> Result<SocketStreams> {
    let mut s = SocketStreams::default();
    let nt = get("SOCKET_NTHREADS");
    let ns = get("NSOCKS_PERTHREAD");
    if let Some((key, v)) = &nt {
        s.nthreads = parse_int(key, v, 1, MAX_SOCKET_THREADS as i64)? as u32;
    }
    if let Some((key, v)) = &ns {
        s.nsocks_per_thread = parse_int(key, v, 1, MAX_SOCKETS as i64)? as u32;
    }
    if s.nsocks() > MAX_SOCKETS as usize {
        let name =
            |x: &Option<(String, String)>, d: &str| x.as_ref().map_or(d.to_string(), |(k, _)| k.clone());
        return Err(Error::invalid(format!(
            "{}={} × {}={} = {} data sockets per connection is too many (accepted: a product of at most {MAX_SOCKETS})",
            name(&nt, "NCCL_SOCKET_NTHREADS"),
            s.nthreads,
            name(&ns, "NCCL_NSOCKS_PERTHREAD"),
            s.nsocks_per_thread,
            s.nsocks()
        )));
    }
    Ok(s)
}

/// Path types `NCCL_P2P_LEVEL` accepts by name: NCCL's names of every path type up to `SYS`
/// (NCCL's `ncclGetLevel` compares against `topoPathTypeStr[0..=PATH_SYS]`).
pub const P2P_LEVEL_NAMES: [&str; 10] = [
    "LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "PXN", "P2C", "PHB", "SYS",
];

/// NCCL's legacy numeric `NCCL_P2P_LEVEL` values 0..=5 (`levelsOldToNew` in NCCL's `paths.cc`).
const P2P_LEVEL_NUMBERS: [PathType; 6] = [
    PathType::Loc,
    PathType::Pix,
    PathType::Pxb,
    PathType::Phb,
    PathType::Sys,
    PathType::Sys,
];

/// Parses an `NCCL_P2P_LEVEL` value (variable `key`): a path type name (`LOC`, `NVL`, `NVB`,
/// `C2C`, `PIX`, `PXB`, `PXN`, `P2C`, `PHB`, `SYS`; case-sensitive as in NCCL), or a legacy integer
/// 0-5 (0 `LOC`, 1 `PIX`, 2 `PXB`, 3 `PHB`, 4 and 5 `SYS`). Larger integers mean `SYS`, as NCCL
/// clamps them, with a warning. Anything else is an `InvalidArgument` naming `key` and the
/// accepted values.
pub fn parse_p2p_level(key: &str, v: &str) -> Result<PathType> {
    let t = v.trim();
    if let Some(p) = PathType::from_name(t).filter(|p| *p <= PathType::Sys) {
        return Ok(p);
    }
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        let n: u64 = t.parse().unwrap_or(u64::MAX);
        let last = P2P_LEVEL_NUMBERS.len() - 1;
        if n > last as u64 {
            tracing::warn!(target: "oxccl::init", "{key}={t} is above the largest legacy level {last}: using SYS, as NCCL does");
            return Ok(PathType::Sys);
        }
        return Ok(P2P_LEVEL_NUMBERS[n as usize]);
    }
    Err(Error::invalid(format!(
        "{key}={v:?} is not a P2P level (accepted: {}, or a legacy integer 0-5)",
        P2P_LEVEL_NAMES.join(", ")
    )))
}

/// NCCL's P2P level rule (`ncclTopoCheckP2p`): two GPUs use P2P only when the type of the path
/// between them is at most `level` (`NCCL_P2P_LEVEL`). `path` is that type where known (`LOC` for
/// one GPU shared by two ranks). Returns `Some(true)` / `Some(false)` when the rule decides, and
/// `None` when it cannot: `level` set but `path` unknown. Two distinct GPUs are at least `NVL`
/// apart, so `LOC` refuses them even then. With `level` unset there is no restriction
/// (`Some(true)`): NCCL's default level (`PXB`) only picks between P2P and SHM, and oxccl has no
/// SHM transport between CUDA devices yet, so refusing P2P would only fail the init.
pub fn p2p_allowed(level: Option<PathType>, path: Option<PathType>) -> Option<bool> {
    match (level, path) {
        (None, _) => Some(true),
        (Some(level), Some(path)) => Some(path <= level),
        (Some(PathType::Loc), None) => Some(false),
        (Some(_), None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Params> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Params::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| k.ends_with(name) && k.len() - name.len() <= 6)
                .map(|(k, v)| (k.clone(), v.clone()))
        })
    }

    #[test]
    fn defaults() {
        let p = with(&[]).unwrap();
        assert_eq!(p.buffsize, 4 << 20);
        assert_eq!(p.nthreads, 512);
    }

    #[test]
    fn a_timeout_is_zero_only_when_written_as_zero() {
        for zero in ["0", "0.0", " 0 ", "0e5", "-0", "0.000E-3"] {
            assert_eq!(with(&[("OXCCL_TIMEOUT", zero)]).unwrap().timeout, None, "{zero:?}");
        }
        assert_eq!(with(&[("OXCCL_TIMEOUT", "0.25")]).unwrap().timeout, Some(std::time::Duration::from_millis(250)));
        // Values that parse to 0 but are not 0: below the 0.1 s a limit needs.
        for tiny in ["1e-400", "0.1e-330", "5E-999"] {
            let e = with(&[("OXCCL_TIMEOUT", tiny)]).unwrap_err().to_string();
            assert!(e.contains(&format!("OXCCL_TIMEOUT={tiny:?}")) && e.contains("0, or 0.1 to 1000000"), "{e}");
        }
    }

    #[test]
    fn buffsize_is_rounded_or_rejected() {
        assert_eq!(with(&[("NCCL_BUFFSIZE", "1000000")]).unwrap().buffsize, 999_936);
        for bad in ["0", "-1", "abc", "1"] {
            let e = with(&[("NCCL_BUFFSIZE", bad)]).unwrap_err().to_string();
            assert!(e.contains("NCCL_BUFFSIZE"), "{e}");
            assert!(e.contains("8192..=1073741824"), "{e}");
        }
    }

    #[test]
    fn nthreads_is_rounded_to_warps_or_rejected() {
        assert_eq!(with(&[("NCCL_NTHREADS", "480")]).unwrap().nthreads, 480);
        assert_eq!(with(&[("NCCL_NTHREADS", "100")]).unwrap().nthreads, 96);
        assert_eq!(with(&[("NCCL_NTHREADS", "64")]).unwrap().nthreads, 64);
        let e = with(&[("NCCL_NTHREADS", "abc")]).unwrap_err().to_string();
        assert!(e.contains("NCCL_NTHREADS") && e.contains("64..=1024"), "{e}");
        assert!(with(&[("NCCL_NTHREADS", "2048")]).is_err());
    }

    #[test]
    fn cpu_block_threads_are_read_or_rejected() {
        assert_eq!(with(&[]).unwrap().cpu_nthreads, 64);
        assert_eq!(with(&[]).unwrap().cpu_team, TeamKind::Fibers);
        assert_eq!(with(&[("OXCCL_CPU_NTHREADS", "32")]).unwrap().cpu_nthreads, 32);
        assert_eq!(with(&[("OXCCL_CPU_NTHREADS", "1024")]).unwrap().cpu_nthreads, 1024);
        // oxccl-only variables: NCCL has no CPU target.
        assert_eq!(with(&[("NCCL_CPU_NTHREADS", "128")]).unwrap().cpu_nthreads, 64);
        assert_eq!(with(&[("NCCL_CPU_TEAM", "threads")]).unwrap().cpu_team, TeamKind::Fibers);
        for bad in ["0", "1", "31", "1025", "abc"] {
            let e = with(&[("OXCCL_CPU_NTHREADS", bad)]).unwrap_err().to_string();
            assert!(e.contains("OXCCL_CPU_NTHREADS") && e.contains("32..=1024"), "{bad}: {e}");
        }
        let e = with(&[("OXCCL_CPU_NTHREADS", "48")]).unwrap_err().to_string();
        assert!(e.contains("OXCCL_CPU_NTHREADS=48") && e.contains("multiple of 32"), "{e}");
        assert_eq!(with(&[("OXCCL_CPU_TEAM", "Threads")]).unwrap().cpu_team, TeamKind::Threads);
        assert_eq!(with(&[("OXCCL_CPU_TEAM", "fibers")]).unwrap().cpu_team, TeamKind::Fibers);
        let e = with(&[("OXCCL_CPU_TEAM", "green")]).unwrap_err().to_string();
        assert!(e.contains("OXCCL_CPU_TEAM") && e.contains("fibers, threads"), "{e}");
    }

    #[test]
    fn channel_limits() {
        assert_eq!(
            with(&[("OXCCL_MAX_NCHANNELS", "4")]).unwrap().max_nchannels,
            Some(4)
        );
        let e = with(&[("NCCL_MAX_NCHANNELS", "65")]).unwrap_err().to_string();
        assert!(e.contains("NCCL_MAX_NCHANNELS") && e.contains("1..=64"), "{e}");
    }

    #[test]
    fn p2p_level_names_and_legacy_numbers() {
        // Names map to NCCL's PATH_* of the same name; numbers follow NCCL's levelsOldToNew
        // table {LOC, PIX, PXB, PHB, SYS, SYS}, and numbers above 5 clamp to SYS.
        for (v, want) in [
            ("LOC", PathType::Loc),
            ("NVL", PathType::Nvl),
            ("PIX", PathType::Pix),
            ("PXB", PathType::Pxb),
            ("PHB", PathType::Phb),
            ("SYS", PathType::Sys),
            (" NVB ", PathType::Nvb),
            ("0", PathType::Loc),
            ("1", PathType::Pix),
            ("2", PathType::Pxb),
            ("3", PathType::Phb),
            ("4", PathType::Sys),
            ("5", PathType::Sys),
            ("9", PathType::Sys),
            ("99999999999999999999999", PathType::Sys),
        ] {
            assert_eq!(
                with(&[("NCCL_P2P_LEVEL", v)]).unwrap().p2p_level,
                Some(want),
                "{v:?}"
            );
        }
        assert_eq!(with(&[]).unwrap().p2p_level, None);
        assert_eq!(
            with(&[("OXCCL_P2P_LEVEL", "NVL")]).unwrap().p2p_level,
            Some(PathType::Nvl)
        );
    }

    #[test]
    fn bad_p2p_level_names_the_variable_and_the_accepted_values() {
        // NET and DIS are path types but not levels (NCCL only matches names up to SYS).
        for bad in ["nvl", "NET", "DIS", "-1", "", "2.5", "FAR"] {
            let e = with(&[("NCCL_P2P_LEVEL", bad)]).unwrap_err();
            assert_eq!(e.code(), crate::ResultCode::InvalidArgument, "{bad:?}");
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid argument: NCCL_P2P_LEVEL={bad:?} is not a P2P level (accepted: LOC, NVL, NVB, C2C, PIX, \
                     PXB, PXN, P2C, PHB, SYS, or a legacy integer 0-5)"
                )
            );
        }
    }

    #[test]
    fn socket_streams_ranges() {
        let get = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> =
                vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            socket_streams(move |name| {
                vars.iter()
                    .find(|(k, _)| k.ends_with(name) && k.len() - name.len() <= 6)
                    .map(|(k, v)| (k.clone(), v.clone()))
            })
        };
        // NCCL's default (off AWS): 1 thread × 1 socket.
        assert_eq!(get(&[]).unwrap().nsocks(), 1);
        let s = get(&[("NCCL_SOCKET_NTHREADS", "4"), ("NCCL_NSOCKS_PERTHREAD", "16")]).unwrap();
        assert_eq!((s.nthreads, s.nsocks_per_thread, s.nsocks()), (4, 16, 64));
        assert_eq!(get(&[("OXCCL_NSOCKS_PERTHREAD", "64")]).unwrap().nsocks(), 64);
        for (var, bad, range) in [
            ("NCCL_SOCKET_NTHREADS", "0", "1..=16"),
            ("NCCL_SOCKET_NTHREADS", "17", "1..=16"),
            ("NCCL_SOCKET_NTHREADS", "two", "1..=16"),
            ("NCCL_NSOCKS_PERTHREAD", "0", "1..=64"),
            ("NCCL_NSOCKS_PERTHREAD", "65", "1..=64"),
            ("OXCCL_NSOCKS_PERTHREAD", "-1", "1..=64"),
        ] {
            let e = get(&[(var, bad)]).unwrap_err();
            assert_eq!(e.code(), crate::ResultCode::InvalidArgument, "{var}={bad}");
            let m = e.to_string();
            assert!(m.contains(var) && m.contains(range), "{m}");
        }
        // Each in range, but 16 × 8 = 128 sockets > 64.
        let e = get(&[("NCCL_SOCKET_NTHREADS", "16"), ("NCCL_NSOCKS_PERTHREAD", "8")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument: NCCL_SOCKET_NTHREADS=16 × NCCL_NSOCKS_PERTHREAD=8 = 128 data sockets per \
             connection is too many (accepted: a product of at most 64)"
        );
    }

    #[test]
    fn p2p_level_rule() {
        use PathType::*;
        // Unset: no restriction, whatever the path.
        for path in [None, Some(Loc), Some(Nvl), Some(Sys)] {
            assert_eq!(p2p_allowed(None, path), Some(true));
        }
        // Known path: P2P iff path <= level, in NCCL's PATH_* order LOC < NVL < NVB < C2C < PIX <
        // PXB < PXN < P2C < PHB < SYS.
        assert_eq!(p2p_allowed(Some(Nvl), Some(Nvl)), Some(true));
        assert_eq!(p2p_allowed(Some(Nvl), Some(Pix)), Some(false));
        assert_eq!(p2p_allowed(Some(Pix), Some(Nvl)), Some(true));
        assert_eq!(p2p_allowed(Some(Pix), Some(Nvb)), Some(true));
        assert_eq!(p2p_allowed(Some(Pxb), Some(Phb)), Some(false));
        assert_eq!(p2p_allowed(Some(Phb), Some(Phb)), Some(true));
        assert_eq!(p2p_allowed(Some(Phb), Some(Sys)), Some(false));
        assert_eq!(p2p_allowed(Some(Sys), Some(Sys)), Some(true));
        // LOC: one shared GPU only.
        assert_eq!(p2p_allowed(Some(Loc), Some(Loc)), Some(true));
        assert_eq!(p2p_allowed(Some(Loc), Some(Nvl)), Some(false));
        // Unknown path: only LOC decides (distinct GPUs are at least NVL apart).
        assert_eq!(p2p_allowed(Some(Loc), None), Some(false));
        for level in [Nvl, Pix, Pxb, Phb, Sys] {
            assert_eq!(p2p_allowed(Some(level), None), None, "{level}");
        }
    }
}
