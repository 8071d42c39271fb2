//! Helpers shared by the integration tests: the correctness matrix of every collective
//! ([`run_collective`]: nccl-tests-style data and exact checking from `oxccl::perf::check`, guard
//! bytes around every buffer, in-place and out-of-place, each protocol forced through
//! `NCCL_PROTO`), GPU skip reporting, a stall watchdog so a hung collective fails the test
//! instead of blocking CI, the one lock over environment variables ([`env`]), child processes of
//! the test binary ([`child`]), loopback ports held for a test ([`port`]) and the topology
//! fixtures ([`topo`]).
//!
//! Each test binary is a directory `tests/<subject>/` whose `main.rs` declares
//! `#[macro_use] #[path = "../common/mod.rs"] mod common;` before its modules.
#![allow(dead_code, unused_macros)]

/// Prints past libtest's output capture, so every run shows why a test skipped.
macro_rules! skipped {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

#[macro_use]
pub mod child;
pub mod env;
pub mod pattern;
pub mod port;
pub mod topo;
pub mod capture;

use oxccl::perf::check;
use oxccl::{Comm, DataType, DevSlice, Device, DeviceBuffer, Func, RedOp, Stream};
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Element counts of the matrix: empty, tiny, odd sizes around 1024, and one large odd count.
pub const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 20) + 3];
/// Guard bytes before the data (the data starts at this byte offset of every buffer).
pub const FRONT: usize = 64;
/// Guard bytes after the data.
pub const BACK: usize = 256;

/// `s` with the communicator id of each rank a diagnostic names ("rank 0 of communicator
/// 00c0ffee", `Comm::comm_id` in 8 hex digits) written as `<id>`: for whole messages compared
/// where the id is not known (a child process's), or not the point.
pub fn without_comm_ids(s: &str) -> String {
    const AT: &str = " of communicator ";
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(AT) {
        let (head, tail) = rest.split_at(i + AT.len());
        out += head;
        let hex = tail.bytes().take_while(u8::is_ascii_hexdigit).count();
        if hex == 8 {
            out += "<id>";
            rest = &tail[8..];
        } else {
            rest = tail;
        }
    }
    out + rest
}

/// A position-dependent sentinel pattern (a shifted copy or a memset is caught, not only a write
/// of zeros). `salt` makes send and receive buffers' sentinels differ.
pub fn sentinel(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(167).wrapping_add(salt as u32 * 29 + 0x3B) as u8) ^ 0xA7)
        .collect()
}

/// Why no GPU is visible (the driver's own error, or a zero device count).
pub fn no_gpu_reason() -> String {
    match oxccl::cuda::driver_version() {
        Err(e) => e.to_string(),
        Ok(v) => format!(
            "the CUDA driver (version {v}) reports {} devices",
            Device::cuda_count()
        ),
    }
}

/// The first `n` CUDA devices, or `None` after printing why the test is skipped.
pub fn gpus_or_skip(test: &str, n: usize) -> Option<Vec<Device>> {
    let have = Device::cuda_count();
    if have == 0 {
        skipped!(
            "SKIPPED: {test}: no CUDA driver/GPU visible ({})",
            no_gpu_reason()
        );
        return None;
    }
    if have < n {
        skipped!("SKIPPED: {test}: needs {n} GPUs, {have} visible");
        return None;
    }
    Some((0..n).map(Device::Cuda).collect())
}

/// Two GPU ranks: GPUs 0 and 1, or GPU 0 twice (`OXCCL_ALLOW_SHARED_DEVICE=1` is then set for
/// the rest of the process) when it is the only one; `None` after printing why without a GPU.
pub fn two_ranks_or_skip(test: &str) -> Option<Vec<Device>> {
    gpus_or_skip(test, 1)?;
    if Device::cuda_count() >= 2 {
        return Some(vec![Device::Cuda(0), Device::Cuda(1)]);
    }
    // Set once and never removed, before any communicator of this binary reads it.
    env::set_for_the_process("OXCCL_ALLOW_SHARED_DEVICE", "1");
    Some(vec![Device::Cuda(0), Device::Cuda(0)])
}

/// Serializes GPU tests inside one test binary: every rank's kernel spins until its peers
/// arrive, so two communicators' kernels sharing GPUs must not compete for them.
pub fn gpu_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Exits the process with a message when one step of a test makes no progress for `limit`
/// (a hang in a collective would otherwise block the test run forever).
pub struct Watchdog {
    state: Arc<(Mutex<String>, AtomicU64, AtomicBool)>,
    /// The step each rank's thread is in ([`Watchdog::rank_step`]), printed with a timeout.
    ranks: Arc<Mutex<Vec<String>>>,
}

impl Watchdog {
    pub fn new(test: &str, limit: Duration) -> Watchdog {
        let limit = std::env::var("OXCCL_TEST_STALL_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_secs)
            .unwrap_or(limit);
        let state = Arc::new((
            Mutex::new(String::from("start")),
            AtomicU64::new(0),
            AtomicBool::new(false),
        ));
        let s = state.clone();
        let ranks: Arc<Mutex<Vec<String>>> = Arc::default();
        let rs = ranks.clone();
        let test = test.to_string();
        std::thread::spawn(move || {
            let mut seen = u64::MAX;
            let mut since = Instant::now();
            loop {
                std::thread::sleep(Duration::from_millis(200));
                if s.2.load(Ordering::Acquire) {
                    return;
                }
                let g = s.1.load(Ordering::Acquire);
                if g != seen {
                    seen = g;
                    since = Instant::now();
                } else if since.elapsed() > limit {
                    // Straight to the process's stderr: libtest captures `eprintln!` of the
                    // test's threads, and the capture is lost when the process exits here.
                    use std::io::Write as _;
                    let mut err = std::io::stderr().lock();
                    let what = s.0.lock().map(|g| g.clone()).unwrap_or_default();
                    let _ = writeln!(err, "TIMEOUT: {test}: no progress for {limit:?} at step: {what}");
                    for (r, step) in rs
                        .lock()
                        .map(|g| g.clone())
                        .unwrap_or_default()
                        .iter()
                        .enumerate()
                    {
                        if !step.is_empty() {
                            let _ = writeln!(err, "TIMEOUT: {test}: rank {r} was at: {step}");
                        }
                    }
                    std::process::exit(101);
                }
            }
        });
        Watchdog { state, ranks }
    }
    /// Records the step `rank`'s thread now runs (also counted as progress), so a timeout says
    /// where each rank stopped: inside a call, or waiting for its stream.
    pub fn rank_step(&self, rank: usize, what: impl Into<String>) {
        let what = what.into();
        if let Ok(mut g) = self.ranks.lock() {
            if g.len() <= rank {
                g.resize(rank + 1, String::new());
            }
            g[rank] = what.clone();
        }
        self.step(format!("rank {rank}: {what}"));
    }
    /// Records the step now running.
    pub fn step(&self, what: impl Into<String>) {
        if let Ok(mut g) = self.state.0.lock() {
            *g = what.into();
        }
        self.state.1.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.state.2.store(true, Ordering::Release);
    }
}

/// `front sentinel ++ data ++ back sentinel` into `out` (cleared first, so it keeps its
/// allocation from frame to frame).
fn frame_into(out: &mut Vec<u8>, data: &[u8], salt: u8) {
    out.clear();
    out.extend(sentinel(FRONT, salt));
    out.extend_from_slice(data);
    out.extend(sentinel(BACK, salt.wrapping_add(1)));
}

/// Where a framed region differs from what was written: the guard bytes before or after the data.
fn guard_damage(got: &[u8], data_len: usize, salt: u8) -> Option<String> {
    let front = sentinel(FRONT, salt);
    let back = sentinel(BACK, salt.wrapping_add(1));
    if got[..FRONT] == front[..] && got[FRONT + data_len..] == back[..] {
        return None;
    }
    if let Some(i) = (0..FRONT).find(|&i| got[i] != front[i]) {
        return Some(format!(
            "guard byte {} before the data was overwritten (0x{:02x} -> 0x{:02x})",
            FRONT - i,
            front[i],
            got[i]
        ));
    }
    let tail = &got[FRONT + data_len..];
    if let Some(i) = (0..BACK).find(|&i| tail[i] != back[i]) {
        return Some(format!(
            "guard byte {i} after the data (byte {} of the buffer) was overwritten (0x{:02x} -> 0x{:02x})",
            FRONT + data_len + i,
            back[i],
            tail[i]
        ));
    }
    None
}

/// Protocols the collective matrices force, one after the other, through `NCCL_PROTO` (NCCL's
/// spelling). Adding a protocol is one entry here; a protocol the library refuses with an
/// "implemented only as" InvalidArgument is reported `SKIPPED` for that collective.
pub const PROTOS: &[&str] = &["LL", "LL128", "Simple"];

/// Every `DataType`, or those named in the comma list `OXCCL_TEST_DTYPES` (NCCL's names, e.g.
/// `float,half`) to run part of a matrix (a GPU run with little device time left). Panics on a
/// name that is no dtype, so a typo cannot silently run nothing.
pub fn dtypes() -> Vec<DataType> {
    match std::env::var("OXCCL_TEST_DTYPES") {
        Ok(v) => v
            .split(',')
            .map(|w| {
                DataType::from_name(w.trim()).unwrap_or_else(|| {
                    panic!(
                        "OXCCL_TEST_DTYPES: {w:?} is no dtype (accepted: {:?})",
                        DataType::ALL
                    )
                })
            })
            .collect(),
        Err(_) => DataType::ALL.to_vec(),
    }
}

/// [`PROTOS`], or the comma list in `OXCCL_TEST_PROTOS` (e.g. `LL128`) to rerun one protocol.
pub fn protos() -> Vec<&'static str> {
    match std::env::var("OXCCL_TEST_PROTOS") {
        Ok(v) => PROTOS
            .iter()
            .copied()
            .filter(|p| v.split(',').any(|w| w.trim().eq_ignore_ascii_case(p)))
            .collect(),
        Err(_) => PROTOS.to_vec(),
    }
}

/// Communicators over `devices`. With `proto`, they are created with exactly `NCCL_PROTO=proto`
/// set (the `OXCCL_` spellings and `NCCL_ALGO` cleared) and the environment is restored
/// afterwards; without, under the environment as it is (held shared meanwhile).
pub fn init_comms(devices: &[Device], proto: Option<&str>) -> Vec<Comm> {
    let init = || {
        Comm::init_all(devices)
            .unwrap_or_else(|e| panic!("init_all({devices:?}) with NCCL_PROTO={proto:?}: {e}"))
    };
    match proto {
        None => {
            let _env = env::shared();
            init()
        }
        Some(p) => {
            let env = env::Env::clean(&["PROTO", "ALGO"]);
            env.set(&[("NCCL_PROTO", p)]);
            init()
        }
    }
}

/// `Comm::init_all(devices)` under the environment as it is (held shared meanwhile: see [`env`]).
pub fn init_all(devices: &[Device]) -> oxccl::Result<Vec<Comm>> {
    let _env = env::shared();
    Comm::init_all(devices)
}

/// A new stream per communicator, on its device.
pub fn streams(comms: &[Comm]) -> Vec<Stream> {
    comms.iter().map(|c| c.device().new_stream().unwrap()).collect()
}

/// Drops the ranks of an `init_rank` communicator on a thread each (they meet at a teardown
/// barrier, so one thread dropping them in turn would wait for itself).
pub fn drop_on_threads(comms: Vec<Comm>) {
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || drop(c));
        }
    });
}

/// Synchronizes every rank's stream, panicking with `what` and the rank on an error.
pub fn sync_all(streams: &[Stream], what: &str) {
    for (r, s) in streams.iter().enumerate() {
        s.synchronize()
            .unwrap_or_else(|e| panic!("{what}: rank {r}: synchronize: {e}"));
    }
}

/// Runs `f(rank)` on `n` scoped threads and returns the results by rank.
pub fn on_threads<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (0..n).map(|r| s.spawn(move || f(r))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// One collective's correctness matrix (see [`run_collective`]).
pub struct Matrix<'a> {
    pub func: Func,
    /// Element counts (`count` argument of the call) run for every dtype × op.
    pub counts: &'a [usize],
    /// Further counts run only for the (dtype, op) pairs of `extra_pairs` (for Broadcast and
    /// AllGather, which have no operator, for the dtypes of `extra_pairs`).
    pub extra_counts: &'a [usize],
    pub extra_pairs: &'a [(DataType, RedOp)],
    /// Protocols forced one after the other (see [`PROTOS`]); `None` forces nothing (the
    /// communicator's default choice). With one rank no protocol runs (the call is a copy), so
    /// the matrix runs once, unforced.
    pub protos: Option<&'a [&'a str]>,
    /// Only these (dtype, op) pairs (Broadcast and AllGather: only their dtypes), for tests
    /// whose subject is orthogonal to the type and operator (ring orders, block sizes); `None`
    /// runs every dtype ([`dtypes`]) × op.
    pub only: Option<&'a [(DataType, RedOp)]>,
}

/// Whether `func` takes a reduction operator.
pub fn has_op(func: Func) -> bool {
    matches!(func, Func::Reduce | Func::ReduceScatter | Func::AllReduce)
}

/// Whether `func` takes a root.
pub fn has_root(func: Func) -> bool {
    matches!(func, Func::Broadcast | Func::Reduce)
}

/// Elements of one rank's send (`.0`) and receive (`.1`) buffer for `func` with call count `count`.
pub fn buffer_elems(func: Func, nranks: usize, count: usize) -> (usize, usize) {
    match func {
        Func::AllGather => (count, nranks * count),
        Func::ReduceScatter => (nranks * count, count),
        _ => (count, count),
    }
}

/// The AllReduce matrix of the `all_reduce` / `gpu_all_reduce` tests: every dtype × op × `counts`
/// × out-of-place/in-place, unforced protocol (see [`run_collective`]).
pub fn run_matrix(test: &str, devices: &[Device], counts: &[usize]) {
    run_collective(
        test,
        devices,
        &Matrix {
            func: Func::AllReduce,
            counts,
            extra_counts: &[],
            extra_pairs: &[],
            protos: None,
            only: None,
        },
    );
}

/// Per-rank streams and buffers, shared by the communicators of every protocol (they run one call
/// at a time).
struct RankBufs {
    stream: Stream,
    send: DeviceBuffer,
    recv: DeviceBuffer,
}

/// Which of a rank's two buffers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Which {
    Send,
    Recv,
}

/// The data part (between the guards) of one buffer in one case: what is written before the call,
/// what it must hold after, and the byte range holding the collective's result (compared with
/// `check::count_wrong`, i.e. with the float-Avg tolerance; every other byte must be bitwise
/// unchanged).
struct Region<'a> {
    which: Which,
    init: Cow<'a, [u8]>,
    want: Cow<'a, [u8]>,
    result: std::ops::Range<usize>,
}

/// One rank's part of one case: the buffers written (the receive buffer is not used in place) and
/// the call's arguments as (buffer, byte offset into the data part, byte length).
struct RankCase<'a> {
    regions: Vec<Region<'a>>,
    send: Option<(Which, usize, usize)>,
    recv: Option<(Which, usize, usize)>,
}

/// A rank's regions and arguments for `func` (see [`run_collective`] for the in-place forms).
///
/// Expected values: AllReduce and Reduce expect `check::expected` (the reduction over the ranks'
/// `check::fill_input` inputs, element by element); ReduceScatter rank `r` expects block `r` of
/// the same reduction over `nranks × count` elements (element `i` of the reduction only depends
/// on element `i` of every input, so block `r` is the prefix's slice `[r·count, (r+1)·count)`);
/// Broadcast expects the root's input; AllGather the ranks' inputs concatenated in rank order.
///
/// `poison` holds `check::poison(dtype, k)` for some `k ≥ nranks × count` (the poison is one
/// byte value per type, so its prefixes are the poison of fewer elements).
#[allow(clippy::too_many_arguments)]
fn plan_rank<'a>(
    func: Func,
    nranks: usize,
    r: usize,
    root: usize,
    count: usize,
    dtype: DataType,
    in_place: bool,
    inputs: &'a [Vec<u8>],
    exp_all: &'a [u8],
    poison: &'a [u8],
) -> RankCase<'a> {
    use Which::{Recv, Send};
    let b = count * dtype.size();
    let nb = nranks * b;
    let poison = |elems: usize| Cow::Borrowed(&poison[..elems * dtype.size()]);
    let own = &inputs[r];
    let region = |which, init: Cow<'a, [u8]>, want: Cow<'a, [u8]>, result| Region {
        which,
        init,
        want,
        result,
    };
    let unchanged = |which, data: Cow<'a, [u8]>| region(which, data.clone(), data, 0..0);
    let gathered = || {
        Cow::Owned(
            inputs
                .iter()
                .flat_map(|v| v[..b].iter().copied())
                .collect::<Vec<u8>>(),
        )
    };
    let own_b = Cow::Borrowed(&own[..b]);
    // Only the reducing collectives have expected results (`exp_all` is empty for copies).
    let exp_b = || Cow::Borrowed(&exp_all[..b]);
    match (func, in_place) {
        (Func::AllReduce, false) => RankCase {
            regions: vec![unchanged(Send, own_b), region(Recv, poison(count), exp_b(), 0..b)],
            send: Some((Send, 0, b)),
            recv: Some((Recv, 0, b)),
        },
        (Func::AllReduce, true) => RankCase {
            regions: vec![region(Send, own_b, exp_b(), 0..b)],
            send: Some((Send, 0, b)),
            recv: Some((Send, 0, b)),
        },
        // Non-root ranks pass no receive buffer; theirs (poisoned) must stay untouched.
        (Func::Reduce, false) => RankCase {
            regions: vec![
                unchanged(Send, own_b),
                if r == root {
                    region(Recv, poison(count), exp_b(), 0..b)
                } else {
                    unchanged(Recv, poison(count))
                },
            ],
            send: Some((Send, 0, b)),
            recv: (r == root).then_some((Recv, 0, b)),
        },
        // Every rank passes recv == send; only the root's buffer may change.
        (Func::Reduce, true) => RankCase {
            regions: vec![if r == root {
                region(Send, own_b, exp_b(), 0..b)
            } else {
                unchanged(Send, own_b)
            }],
            send: Some((Send, 0, b)),
            recv: Some((Send, 0, b)),
        },
        // Non-root ranks pass no send buffer; theirs must stay untouched.
        (Func::Broadcast, false) => RankCase {
            regions: vec![
                unchanged(Send, own_b),
                region(Recv, poison(count), Cow::Borrowed(&inputs[root][..b]), 0..b),
            ],
            send: (r == root).then_some((Send, 0, b)),
            recv: Some((Recv, 0, b)),
        },
        // Every rank passes send == recv; the root's holds its input, the others' are poisoned.
        (Func::Broadcast, true) => RankCase {
            regions: vec![region(
                Send,
                if r == root { own_b } else { poison(count) },
                Cow::Borrowed(&inputs[root][..b]),
                0..b,
            )],
            send: Some((Send, 0, b)),
            recv: Some((Send, 0, b)),
        },
        (Func::AllGather, false) => RankCase {
            regions: vec![
                unchanged(Send, own_b),
                region(Recv, poison(nranks * count), gathered(), 0..nb),
            ],
            send: Some((Send, 0, b)),
            recv: Some((Recv, 0, nb)),
        },
        // In place: send = recv + rank × count elements, the rest of recv poisoned.
        (Func::AllGather, true) => {
            let mut init = poison(nranks * count).into_owned();
            init[r * b..(r + 1) * b].copy_from_slice(&own[..b]);
            RankCase {
                regions: vec![region(Send, Cow::Owned(init), gathered(), 0..nb)],
                send: Some((Send, r * b, b)),
                recv: Some((Send, 0, nb)),
            }
        }
        (Func::ReduceScatter, false) => RankCase {
            regions: vec![
                unchanged(Send, Cow::Borrowed(&own[..nb])),
                region(Recv, poison(count), Cow::Borrowed(&exp_all[r * b..(r + 1) * b]), 0..b),
            ],
            send: Some((Send, 0, nb)),
            recv: Some((Recv, 0, b)),
        },
        // In place: recv = send + rank × count elements; the other blocks must stay unchanged.
        (Func::ReduceScatter, true) => {
            let mut want = own[..nb].to_vec();
            want[r * b..(r + 1) * b].copy_from_slice(&exp_all[r * b..(r + 1) * b]);
            RankCase {
                regions: vec![region(
                    Send,
                    Cow::Borrowed(&own[..nb]),
                    Cow::Owned(want),
                    r * b..(r + 1) * b,
                )],
                send: Some((Send, 0, nb)),
                recv: Some((Send, r * b, b)),
            }
        }
    }
}

/// The AllReduce matrix ([`run_collective`]) over `counts` for every dtype × op, on
/// communicators created under the current environment (the matrix forces no protocol).
pub fn all_reduce_matrix(test: &str, devices: &[Device], counts: &[usize]) {
    run_collective(
        test,
        devices,
        &Matrix {
            func: Func::AllReduce,
            counts,
            extra_counts: &[],
            extra_pairs: &[],
            protos: None,
            only: None,
        },
    );
}

/// Runs `m.func`'s correctness matrix on communicators over `devices` and panics listing every
/// failure: every dtype × op (Reduce, ReduceScatter, AllReduce; Broadcast and AllGather have none)
/// × count × root (Broadcast, Reduce: every rank) × out-of-place/in-place × protocol.
///
/// In-place forms (NCCL's): AllReduce, Reduce, Broadcast `send == recv` on every rank; AllGather
/// `send = recv + rank × count` elements; ReduceScatter `recv = send + rank × count` elements.
/// Out of place, Broadcast's non-root ranks pass no send buffer and Reduce's no receive buffer.
///
/// Per case, every buffer a rank uses is written between guard sentinels: inputs from
/// `check::fill_input` (for Broadcast and AllGather, which only copy, random bytes — every bit
/// pattern, NaNs included, must arrive unchanged), outputs poisoned (`check::poison`). After the
/// call, on every rank: the result equals the expected value (derivation in [`plan_rank`]) by
/// `check::count_wrong` (bitwise; float Avg within 2 ulps), every other byte — guards, send
/// buffers, non-root outputs, the other blocks of an in-place ReduceScatter — is bitwise
/// unchanged, AllReduce results are bitwise identical to rank 0's, and each call's plan
/// (`Comm::last_choice`) shows the forced protocol.
///
/// Inputs and expected results depend only on (seed, rank, element index), so they are generated
/// once per (dtype, op) for the largest count and smaller counts use prefixes (data generation in
/// a debug build dominates the run time). A call or synchronize error panics at once (the ranks
/// would be out of step), except a refusal "implemented only as" on every rank, which marks the
/// protocol SKIPPED for this collective; wrong data is collected and reported at the end.
pub fn run_collective(test: &str, devices: &[Device], m: &Matrix) {
    let n = devices.len();
    let func = m.func;
    let protos: Vec<Option<&str>> = match m.protos {
        Some(p) if n > 1 => p.iter().map(|s| Some(*s)).collect(),
        _ => vec![None],
    };
    let max_count = m.counts.iter().chain(m.extra_counts).copied().max().unwrap_or(0);
    let (send_elems, recv_elems) = buffer_elems(func, n, max_count);
    let max_size = DataType::ALL.iter().map(|d| d.size()).max().unwrap();
    let bufs: Vec<RankBufs> = devices
        .iter()
        .map(|dev| {
            let alloc = |what, elems: usize| {
                dev.alloc(FRONT + elems * max_size + BACK)
                    .unwrap_or_else(|e| panic!("alloc {what} on {dev:?}: {e}"))
            };
            RankBufs {
                stream: dev
                    .new_stream()
                    .unwrap_or_else(|e| panic!("new_stream on {dev:?}: {e}")),
                // In place, AllGather's whole receive range lives in the send buffer.
                send: alloc("send", send_elems.max(recv_elems)),
                recv: alloc("recv", recv_elems),
            }
        })
        .collect();
    let comms: Vec<Vec<Comm>> = protos.iter().map(|p| init_comms(devices, *p)).collect();
    let mut refused: Vec<Option<String>> = vec![None; protos.len()];
    let dog = Watchdog::new(test, Duration::from_secs(300));
    let mut failures: Vec<String> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    let mut nfail = 0usize;
    let mut runs = vec![0usize; protos.len()];
    let t0 = Instant::now();
    let mut t_gen = Duration::ZERO;
    let mut t_call = Duration::ZERO;
    let ops: &[RedOp] = if has_op(func) { RedOp::ALL } else { &[RedOp::Sum] };
    let roots: Vec<usize> = if has_root(func) { (0..n).collect() } else { vec![0] };
    // Copies get random bytes (the U8 Max inputs are uniform over all 256 values), one set for
    // every dtype.
    let copy_inputs: Vec<Vec<u8>> = if has_op(func) {
        Vec::new()
    } else {
        dog.step(format!("{func} nranks={n}: generating data"));
        let tg = Instant::now();
        let v = (0..n)
            .map(|r| {
                check::fill_input(
                    Func::AllReduce,
                    DataType::U8,
                    RedOp::Max,
                    r,
                    n,
                    0x5eed_c0b1,
                    send_elems * max_size,
                )
                .unwrap()
            })
            .collect();
        t_gen += tg.elapsed();
        v
    };
    for dtype in dtypes() {
        if m.only.is_some_and(|only| !only.iter().any(|&(d, _)| d == dtype)) {
            continue;
        }
        let td = Instant::now();
        // Enough poison for the largest output (an AllGather's `n × count` elements).
        let poison = check::poison(dtype, n * max_count);
        for &op in ops {
            if has_op(func) && m.only.is_some_and(|only| !only.contains(&(dtype, op))) {
                continue;
            }
            let extra = m
                .extra_pairs
                .iter()
                .any(|&(d, o)| d == dtype && (o == op || !has_op(func)));
            let counts: Vec<usize> = m
                .counts
                .iter()
                .chain(if extra { m.extra_counts } else { &[] })
                .copied()
                .collect();
            let cmax = counts.iter().copied().max().unwrap_or(0);
            let in_elems = buffer_elems(func, n, cmax).0;
            let seed = 0x5eed_0000 + 0x100 * func as u64 + 16 * dtype as u64 + op as u64;
            let (owned, exp_all): (Vec<Vec<u8>>, Vec<u8>) = if has_op(func) {
                dog.step(format!("{func} {dtype} {op} nranks={n}: generating data"));
                let tg = Instant::now();
                let inputs: Vec<Vec<u8>> = (0..n)
                    .map(|r| check::fill_input(Func::AllReduce, dtype, op, r, n, seed, in_elems).unwrap())
                    .collect();
                // `check::expected` for these inputs (a lib test asserts the two agree), folded
                // from the inputs instead of generating them again.
                let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                let exp = check::reduce_reference(dtype, op, &refs).unwrap();
                t_gen += tg.elapsed();
                (inputs, exp)
            } else {
                (Vec::new(), Vec::new())
            };
            let inputs = if has_op(func) { &owned } else { &copy_inputs };
            let op_name = if has_op(func) { op.name() } else { "-" };
            for &count in &counts {
                for &root in &roots {
                    for in_place in [false, true] {
                        for (pi, proto) in protos.iter().enumerate() {
                            if refused[pi].is_some() {
                                continue;
                            }
                            let place = if in_place { "in-place" } else { "out-of-place" };
                            let root_s = if has_root(func) {
                                format!(" root={root}")
                            } else {
                                String::new()
                            };
                            let what = format!(
                                "{func} proto={} dtype={dtype} op={op_name} count={count}{root_s} nranks={n} {place}",
                                proto.unwrap_or("default")
                            );
                            dog.step(what.clone());
                            let case = Case {
                                func,
                                dtype,
                                op,
                                count,
                                root,
                                in_place,
                                proto: *proto,
                            };
                            match run_case(
                                &comms[pi],
                                &bufs,
                                &case,
                                inputs,
                                &exp_all,
                                &poison,
                                &mut scratch,
                                &what,
                            ) {
                                Outcome::Refused(e) => {
                                    skipped!(
                                        "SKIPPED: {test}: {func} on protocol {}: {e}",
                                        proto.unwrap_or("default")
                                    );
                                    refused[pi] = Some(e);
                                }
                                Outcome::Ran(errs, t) => {
                                    runs[pi] += 1;
                                    t_call += t;
                                    nfail += errs.len();
                                    for e in errs {
                                        if failures.len() < 40 {
                                            failures.push(e);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        eprintln!("{test}: {func} {dtype} done in {:.2?}", td.elapsed());
    }
    let per_proto: Vec<String> = protos
        .iter()
        .zip(&runs)
        .zip(&refused)
        .map(|((p, k), s)| match s {
            None => format!("{}: {k} runs", p.unwrap_or("default")),
            Some(_) => format!("{}: SKIPPED", p.unwrap_or("default")),
        })
        .collect();
    eprintln!(
        "{test}: {func} on {n} ranks ({}) in {:.2?} (generating inputs and expected results {:.2?}; \
         collective calls {:.2?}; the rest is writing and checking)",
        per_proto.join(", "),
        t0.elapsed(),
        t_gen,
        t_call
    );
    drop(dog);
    assert!(
        nfail == 0,
        "{test}: {nfail} failures (first {}):\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        runs.iter().any(|&k| k > 0),
        "{test}: no protocol ran {func} (every one was refused: {refused:?})"
    );
}

/// One cell of the matrix.
struct Case<'a> {
    func: Func,
    dtype: DataType,
    op: RedOp,
    count: usize,
    root: usize,
    in_place: bool,
    proto: Option<&'a str>,
}

enum Outcome {
    /// The failures found and the time from the first call to the last synchronize.
    Ran(Vec<String>, Duration),
    /// Every rank refused the protocol for this collective ("implemented only as ...").
    Refused(String),
}

/// Whether `e` is the library's refusal of a forced algorithm/protocol it does not implement for
/// the collective (`Selection::choose`).
pub fn is_not_implemented(e: &oxccl::Error) -> bool {
    matches!(e, oxccl::Error::InvalidArgument(_)) && e.to_string().contains("implemented only as")
}

/// Calls `func` on one rank with the safe entry point.
#[allow(clippy::too_many_arguments)]
fn call<'a>(
    comm: &Comm,
    func: Func,
    send: Option<DevSlice<'a>>,
    recv: Option<DevSlice<'a>>,
    count: usize,
    dtype: DataType,
    op: RedOp,
    root: usize,
    stream: &Stream,
) -> oxccl::Result<()> {
    let need = |s: Option<DevSlice<'a>>, what: &str| -> DevSlice<'a> {
        s.unwrap_or_else(|| panic!("{func} needs a {what} buffer"))
    };
    match func {
        Func::Broadcast => comm.broadcast(send, need(recv, "recv"), count, dtype, root, stream),
        Func::Reduce => comm.reduce(need(send, "send"), recv, count, dtype, op, root, stream),
        Func::AllGather => comm.all_gather(need(send, "send"), need(recv, "recv"), count, dtype, stream),
        Func::ReduceScatter => {
            comm.reduce_scatter(need(send, "send"), need(recv, "recv"), count, dtype, op, stream)
        }
        Func::AllReduce => comm.all_reduce(need(send, "send"), need(recv, "recv"), count, dtype, op, stream),
    }
}

/// One call on every rank, then the checks of [`run_collective`].
///
/// `data` holds the inputs, expected results and poison ([`plan_rank`]); `scratch` is a buffer
/// the frames are written and read through, kept from case to case.
#[allow(clippy::too_many_arguments)]
fn run_case(
    comms: &[Comm],
    bufs: &[RankBufs],
    c: &Case<'_>,
    inputs: &[Vec<u8>],
    exp_all: &[u8],
    poison: &[u8],
    scratch: &mut Vec<u8>,
    what: &str,
) -> Outcome {
    let n = comms.len();
    let size = c.dtype.size();
    let salt = |w: Which| if w == Which::Send { 1 } else { 7 };
    let plans: Vec<RankCase> = (0..n)
        .map(|r| {
            plan_rank(
                c.func, n, r, c.root, c.count, c.dtype, c.in_place, inputs, exp_all, poison,
            )
        })
        .collect();
    for (r, (rk, plan)) in bufs.iter().zip(&plans).enumerate() {
        for reg in &plan.regions {
            let buf = if reg.which == Which::Send {
                &rk.send
            } else {
                &rk.recv
            };
            frame_into(scratch, &reg.init, salt(reg.which));
            buf.write(0, scratch)
                .unwrap_or_else(|e| panic!("{what}: rank {r}: write {:?}: {e}", reg.which));
        }
    }
    let tc = Instant::now();
    for (r, ((comm, rk), plan)) in comms.iter().zip(bufs).zip(&plans).enumerate() {
        let slice = |a: Option<(Which, usize, usize)>| {
            a.map(|(w, off, len)| {
                let buf = if w == Which::Send { &rk.send } else { &rk.recv };
                buf.slice(FRONT + off, len).unwrap()
            })
        };
        let res = call(
            comm,
            c.func,
            slice(plan.send),
            slice(plan.recv),
            c.count,
            c.dtype,
            c.op,
            c.root,
            &rk.stream,
        );
        match res {
            Ok(()) => {}
            Err(e) if r == 0 && is_not_implemented(&e) => {
                // Nothing was queued on rank 0: the others must refuse too (none may wait for it).
                for (k, (comm, rk)) in comms.iter().zip(bufs).enumerate().skip(1) {
                    let p = &plans[k];
                    let slice = |a: Option<(Which, usize, usize)>| {
                        a.map(|(w, off, len)| {
                            let buf = if w == Which::Send { &rk.send } else { &rk.recv };
                            buf.slice(FRONT + off, len).unwrap()
                        })
                    };
                    let rk_res = call(
                        comm,
                        c.func,
                        slice(p.send),
                        slice(p.recv),
                        c.count,
                        c.dtype,
                        c.op,
                        c.root,
                        &rk.stream,
                    );
                    match rk_res {
                        Err(e2) if is_not_implemented(&e2) => {}
                        other => panic!("{what}: rank 0 refused ({e}) but rank {k} returned {other:?}"),
                    }
                }
                return Outcome::Refused(e.to_string());
            }
            Err(e) => panic!("{what}: rank {r}: {} returned {e}", c.func),
        }
    }
    let mut errs = Vec::new();
    if let Some(p) = c.proto.filter(|_| c.count > 0 && n > 1) {
        for (r, comm) in comms.iter().enumerate() {
            match comm.last_choice() {
                Some(ch) if ch.func == c.func && ch.proto.name().eq_ignore_ascii_case(p) => {}
                other => errs.push(format!(
                    "{what} rank={r}: NCCL_PROTO={p} did not take effect: last_choice() = {other:?}"
                )),
            }
        }
    }
    for (r, rk) in bufs.iter().enumerate() {
        rk.stream
            .synchronize()
            .unwrap_or_else(|e| panic!("{what}: rank {r}: synchronize returned {e}"));
    }
    let t_call = tc.elapsed();
    // Float Avg is accepted within 2 ulps; copies and every other op are bitwise.
    let op_chk = if has_op(c.func) { c.op } else { RedOp::Sum };
    let mut rank0_differs: Option<Vec<u8>> = None;
    for (r, (rk, plan)) in bufs.iter().zip(&plans).enumerate() {
        for reg in &plan.regions {
            let (buf, name) = match reg.which {
                Which::Send if c.in_place => (&rk.send, "in-place buffer"),
                Which::Send => (&rk.send, "send buffer"),
                Which::Recv => (&rk.recv, "recv buffer"),
            };
            let len = reg.init.len();
            scratch.resize(FRONT + len + BACK, 0);
            buf.read(0, scratch)
                .unwrap_or_else(|e| panic!("{what}: rank {r}: read {name}: {e}"));
            let got = &scratch[..];
            if let Some(g) = guard_damage(got, len, salt(reg.which)) {
                errs.push(format!("{what} rank={r}: {name}: {g}"));
            }
            let data = &got[FRONT..FRONT + len];
            let as_wanted = data == &reg.want[..];
            if as_wanted {
                // count_wrong accepts every bitwise-equal element: skip its per-element loop.
            } else {
                let res = reg.result.clone();
                let (g, w) = (&data[res.clone()], &reg.want[res.clone()]);
                let wrong = check::count_wrong(c.dtype, op_chk, g, w, n);
                if wrong > 0 {
                    let i = check::first_wrong(c.dtype, op_chk, g, w, n).unwrap_or(0);
                    let at = (i * size).min(g.len());
                    errs.push(format!(
                        "{what} rank={r}: {name}: {wrong} of {} result elements wrong; first at result index {i}: got {}, expected {}",
                        res.len() / size,
                        check::format_elem(c.dtype, &g[at..]),
                        check::format_elem(c.dtype, &w[at..]),
                    ));
                }
                let outside = (0..len).find(|&i| !res.contains(&i) && data[i] != reg.want[i]);
                if let Some(i) = outside {
                    let k = (0..len)
                        .filter(|&i| !res.contains(&i) && data[i] != reg.want[i])
                        .count();
                    errs.push(format!(
                        "{what} rank={r}: {name}: {k} bytes outside the result were modified, first at byte {i} \
                         (element {}): 0x{:02x} -> 0x{:02x}",
                        i / size,
                        reg.want[i],
                        data[i]
                    ));
                }
            }
            if c.func == Func::AllReduce && !reg.result.is_empty() {
                let d = &data[reg.result.clone()];
                // Rank 0's result, kept only where it differs from the expected bytes (else the
                // expected bytes are it).
                let d0 = rank0_differs.as_deref().unwrap_or(&reg.want[reg.result.clone()]);
                match r {
                    0 if !as_wanted => rank0_differs = Some(d.to_vec()),
                    0 => {}
                    _ if d0 != d => {
                        if let Some(i) = (0..d.len()).find(|&i| d0[i] != d[i]) {
                            let e = i / size * size;
                            errs.push(format!(
                                "{what}: rank {r}'s result differs bitwise from rank 0's at element {}: {} vs {}",
                                i / size,
                                check::format_elem(c.dtype, &d[e..]),
                                check::format_elem(c.dtype, &d0[e..]),
                            ));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    Outcome::Ran(errs, t_call)
}

/// AllReduce (sum) on every rank of `comms` of `count` f32 where rank `r`'s element `i` is
/// `i + 1000 r`, out of place into NaN-poisoned outputs or in place; checks every output element
/// bitwise against the sum over ranks (`n i + 1000 n(n-1)/2`, exact in f32 below 2^24) and returns
/// each rank's plan. Shared by the tree tests (CPU target and GPU).
pub fn all_reduce_f32(comms: &[Comm], count: usize, in_place: bool) -> Vec<oxccl::Choice> {
    let n = comms.len();
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    let mut streams = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let v: Vec<u8> = (0..count)
            .flat_map(|i| ((i + 1000 * r) as f32).to_ne_bytes())
            .collect();
        let s = c.device().alloc(count * 4).unwrap();
        s.write(0, &v).unwrap();
        sends.push(s);
        let out = c.device().alloc(count * 4).unwrap();
        // Poisoned: NaN bits everywhere, so an element the tree never writes fails.
        out.write(0, &[0xff; 4].repeat(count)).unwrap();
        recvs.push(out);
        streams.push(c.device().new_stream().unwrap());
    }
    for (r, c) in comms.iter().enumerate() {
        let recv = if in_place { &sends[r] } else { &recvs[r] };
        c.all_reduce(&sends[r], recv, count, DataType::F32, RedOp::Sum, &streams[r])
            .unwrap_or_else(|e| panic!("rank {r}: all_reduce of {count}: {e}"));
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    for r in 0..n {
        let out = if in_place { &sends[r] } else { &recvs[r] }.to_vec().unwrap();
        for (i, b) in out.chunks(4).enumerate() {
            let want = (n * i + 1000 * n * (n - 1) / 2) as f32;
            let got = f32::from_ne_bytes(b.try_into().unwrap());
            assert_eq!(got.to_bits(), want.to_bits(), "rank {r}, element {i} of {count}");
        }
    }
    comms.iter().map(|c| c.last_choice().unwrap()).collect()
}

/// The `oxccl` command-line binary of this package, without inherited `NCCL_*` / `OXCCL_*`
/// variables (the test sets the ones it wants). Panics naming the path when the binary is not
/// there: a test binary copied to another machine (the GPU machine) looks for it where cargo
/// built it.
pub fn oxccl_command() -> std::process::Command {
    let bin = env!("CARGO_BIN_EXE_oxccl");
    assert!(
        std::path::Path::new(bin).is_file(),
        "the oxccl binary {bin} is missing: this test runs the command line; build it there \
         (`cargo build --release --bin oxccl`) or copy it to that path"
    );
    let mut cmd = std::process::Command::new(bin);
    child::remove_nccl_env(&mut cmd);
    cmd
}

/// Whether this machine lets a test create network namespaces (root and iproute2); prints
/// `SKIPPED: <test>: ...` with the reason when not.
pub fn namespaces_allowed(test: &str) -> bool {
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let k = PROBES.fetch_add(1, Ordering::Relaxed);
    let name = format!("oxprobe{}x{k}", std::process::id());
    match std::process::Command::new("ip")
        .args(["netns", "add", &name])
        .output()
    {
        Ok(o) if o.status.success() => {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &name])
                .status();
            true
        }
        other => {
            skipped!("SKIPPED: {test}: cannot create a network namespace ({other:?})");
            false
        }
    }
}

/// A fresh bootstrap unique id (`get_unique_id`, which reads the bootstrap's variables), taken
/// holding the environment lock shared.
pub fn unique_id() -> oxccl::bootstrap::UniqueId {
    let _env = env::shared();
    oxccl::bootstrap::get_unique_id().expect("unique id")
}
