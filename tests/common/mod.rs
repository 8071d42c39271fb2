//! Helpers shared by the integration tests: the AllReduce correctness matrix (nccl-tests-style
//! data and exact checking from `oxccl::perf::check`, with guard bytes around every buffer), GPU
//! skip reporting, and a stall watchdog so a hung collective fails the test instead of blocking CI.
#![allow(dead_code)]

pub mod env;
pub mod topo;

/// Prints past libtest's output capture, so every run shows why a test skipped.
macro_rules! skipped {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

use oxccl::perf::check;
use oxccl::{Comm, DataType, Device, DeviceBuffer, Func, RedOp, Stream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Element counts of the matrix: empty, tiny, odd sizes around 1024, and one large odd count.
pub const COUNTS: &[usize] = &[0, 1, 2, 3, 7, 1023, 1025, (1 << 20) + 3];
/// Guard bytes before the data (the data starts at this byte offset of every buffer).
pub const FRONT: usize = 64;
/// Guard bytes after the data.
pub const BACK: usize = 256;

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
                    let what = s.0.lock().map(|g| g.clone()).unwrap_or_default();
                    eprintln!("TIMEOUT: {test}: no progress for {limit:?} at step: {what}");
                    std::process::exit(101);
                }
            }
        });
        Watchdog { state }
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

/// One rank's resources for the matrix.
pub struct Rank {
    pub comm: Comm,
    pub stream: Stream,
    pub send: DeviceBuffer,
    pub recv: DeviceBuffer,
}

/// Creates communicators over `devices` and per rank a stream and send/recv buffers of
/// `FRONT + max_bytes + BACK` bytes.
pub fn setup(devices: &[Device], max_bytes: usize) -> Vec<Rank> {
    let comms = Comm::init_all(devices).unwrap_or_else(|e| panic!("init_all({devices:?}): {e}"));
    comms
        .into_iter()
        .map(|comm| {
            let dev = comm.device();
            let stream = dev
                .new_stream()
                .unwrap_or_else(|e| panic!("new_stream on {dev:?}: {e}"));
            let alloc = |what| {
                dev.alloc(FRONT + max_bytes + BACK)
                    .unwrap_or_else(|e| panic!("alloc {what} on {dev:?}: {e}"))
            };
            let (send, recv) = (alloc("send"), alloc("recv"));
            Rank {
                comm,
                stream,
                send,
                recv,
            }
        })
        .collect()
}

/// `front sentinel ++ data ++ back sentinel`.
fn framed(data: &[u8], salt: u8) -> Vec<u8> {
    let mut v = sentinel(FRONT, salt);
    v.extend_from_slice(data);
    v.extend(sentinel(BACK, salt.wrapping_add(1)));
    v
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

/// Runs the whole AllReduce matrix (every dtype × op × [`COUNTS`] × out-of-place/in-place) on one
/// set of communicators over `devices` and panics listing every failure.
///
/// Per run: every rank's input from `check::fill_input`, written between sentinels; out of place,
/// the receive range is poisoned (`check::poison`) between other sentinels. After the run, on
/// every rank: the data equals `check::expected` (`check::count_wrong` == 0), the sentinels are
/// intact, out of place the send buffer is unchanged, and the result is bitwise identical to rank
/// 0's.
///
/// Inputs and expected results depend only on (seed, rank, element index), so they are generated
/// once per (dtype, op) for the largest count and every smaller count uses their prefix (data
/// generation in a debug build dominates the run time). A call or synchronize error panics at
/// once (the ranks would be out of step); wrong data is collected and reported at the end.
pub fn run_matrix(test: &str, devices: &[Device], counts: &[usize]) {
    let n = devices.len();
    let max_count = counts.iter().copied().max().unwrap_or(0);
    let max_bytes = max_count * DataType::ALL.iter().map(|d| d.size()).max().unwrap();
    let ranks = setup(devices, max_bytes);
    let dog = Watchdog::new(test, Duration::from_secs(300));
    let mut failures: Vec<String> = Vec::new();
    let mut nfail = 0usize;
    let mut runs = 0usize;
    let t0 = Instant::now();
    let mut t_gen = Duration::ZERO;
    let mut t_run = [Duration::ZERO; 2];
    for &dtype in DataType::ALL {
        let td = Instant::now();
        for &op in RedOp::ALL {
            let seed = 0x5eed_0000 + 16 * dtype as u64 + op as u64;
            dog.step(format!("{dtype} {op} nranks={n}: generating data"));
            let tg = Instant::now();
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| check::fill_input(Func::AllReduce, dtype, op, r, n, seed, max_count).unwrap())
                .collect();
            let exp_all = check::expected(Func::AllReduce, dtype, op, n, seed, max_count).unwrap();
            t_gen += tg.elapsed();
            for &count in counts {
                for in_place in [false, true] {
                    let place = if in_place { "in-place" } else { "out-of-place" };
                    let what = format!("dtype={dtype} op={op} count={count} nranks={n} {place}");
                    dog.step(what.clone());
                    runs += 1;
                    let (errs, t_call) =
                        run_one(&ranks, dtype, op, count, in_place, &inputs, &exp_all, &what);
                    t_run[(count == max_count) as usize] += t_call;
                    nfail += errs.len();
                    for e in errs {
                        if failures.len() < 40 {
                            failures.push(e);
                        }
                    }
                }
            }
        }
        eprintln!(
            "{test}: {dtype}: {} ops × {} counts × 2 placements in {:.2?}",
            RedOp::ALL.len(),
            counts.len(),
            td.elapsed()
        );
    }
    eprintln!(
        "{test}: {runs} runs on {n} ranks in {:.2?} (generating inputs and expected results {:.2?}; \
         collective calls: count {max_count} {:.2?}, other counts {:.2?}; the rest is writing and checking)",
        t0.elapsed(),
        t_gen,
        t_run[1],
        t_run[0]
    );
    drop(dog);
    assert!(
        nfail == 0,
        "{test}: {nfail} failures (first {}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// One call on every rank; returns the failures and the time from the first call to the last
/// synchronize (a call or synchronize error panics at once: the ranks would be out of step
/// afterwards).
#[allow(clippy::too_many_arguments)]
fn run_one(
    ranks: &[Rank],
    dtype: DataType,
    op: RedOp,
    count: usize,
    in_place: bool,
    inputs: &[Vec<u8>],
    exp_all: &[u8],
    what: &str,
) -> (Vec<String>, Duration) {
    let n = ranks.len();
    let bytes = count * dtype.size();
    let expected = &exp_all[..bytes];
    let poison = check::poison(dtype, count);
    for (r, rk) in ranks.iter().enumerate() {
        rk.send
            .write(0, &framed(&inputs[r][..bytes], 1))
            .unwrap_or_else(|e| panic!("{what}: write send: {e}"));
        if !in_place {
            rk.recv
                .write(0, &framed(&poison, 7))
                .unwrap_or_else(|e| panic!("{what}: write recv: {e}"));
        }
    }
    let tc = Instant::now();
    for (r, rk) in ranks.iter().enumerate() {
        let send = rk.send.slice(FRONT, bytes).unwrap();
        let recv = if in_place {
            send
        } else {
            rk.recv.slice(FRONT, bytes).unwrap()
        };
        rk.comm
            .all_reduce(send, recv, count, dtype, op, &rk.stream)
            .unwrap_or_else(|e| panic!("{what}: rank {r}: all_reduce returned {e}"));
    }
    for (r, rk) in ranks.iter().enumerate() {
        rk.stream
            .synchronize()
            .unwrap_or_else(|e| panic!("{what}: rank {r}: synchronize returned {e}"));
    }
    let t_call = tc.elapsed();
    let mut errs = Vec::new();
    let mut rank0: Option<Vec<u8>> = None;
    for (r, rk) in ranks.iter().enumerate() {
        let (out_buf, salt) = if in_place { (&rk.send, 1) } else { (&rk.recv, 7) };
        let mut got = vec![0u8; FRONT + bytes + BACK];
        out_buf
            .read(0, &mut got)
            .unwrap_or_else(|e| panic!("{what}: rank {r}: read result: {e}"));
        let data = &got[FRONT..FRONT + bytes];
        // count_wrong accepts every bitwise-equal element, so a bitwise-equal buffer has 0 wrong:
        // the memcmp only skips its per-element loop (slow in debug builds) when it cannot fail.
        let wrong = if data == expected {
            0
        } else {
            check::count_wrong(dtype, op, data, expected, n)
        };
        if wrong > 0 {
            let i = check::first_wrong(dtype, op, data, expected, n).unwrap_or(0);
            let s = dtype.size();
            errs.push(format!(
                "{what} rank={r}: {wrong} of {count} elements wrong; first at index {i}: got {}, expected {}",
                check::format_elem(dtype, &data[(i * s).min(data.len())..]),
                check::format_elem(dtype, &expected[(i * s).min(expected.len())..]),
            ));
        }
        if let Some(g) = guard_damage(&got, bytes, salt) {
            errs.push(format!("{what} rank={r}: output buffer: {g}"));
        }
        if !in_place {
            let mut sent = vec![0u8; FRONT + bytes + BACK];
            rk.send
                .read(0, &mut sent)
                .unwrap_or_else(|e| panic!("{what}: rank {r}: read send: {e}"));
            if let Some(g) = guard_damage(&sent, bytes, 1) {
                errs.push(format!("{what} rank={r}: send buffer: {g}"));
            }
            let sent = &sent[FRONT..FRONT + bytes];
            if sent != &inputs[r][..bytes] {
                let i = (0..bytes).find(|&i| sent[i] != inputs[r][i]).unwrap_or(0);
                errs.push(format!(
                    "{what} rank={r}: the send buffer was modified (first at byte {i})"
                ));
            }
        }
        match &rank0 {
            None => rank0 = Some(data.to_vec()),
            Some(d0) if d0.as_slice() != data => {
                if let Some(i) = (0..bytes).find(|&i| d0[i] != data[i]) {
                    let e = i / dtype.size() * dtype.size();
                    errs.push(format!(
                        "{what}: rank {r}'s result differs bitwise from rank 0's at element {}: {} vs {}",
                        i / dtype.size(),
                        check::format_elem(dtype, &data[e..]),
                        check::format_elem(dtype, &d0[e..]),
                    ));
                }
            }
            Some(_) => {}
        }
    }
    (errs, t_call)
}
