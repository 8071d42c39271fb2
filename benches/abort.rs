//! `cargo bench --bench abort`: issue 4's target "abort returns in ≤ 5 s in 100 of 100 tries"
//! (case C28), measured for every communicator kind the machine has.
//!
//! One try: create a 2-rank communicator, queue an AllReduce (f32, 1 Mi elements = 4 MiB, in
//! place) on rank 0's stream only — rank 1 never joins, so it can never finish — wait 20 ms so
//! the kernel (CPU target: the channel threads) is spinning on its peer, check that a marker queued
//! behind the collective has not run, then time `Comm::abort` on rank 0 from call to return. After
//! the return, the marker must run within 5 s (the aborted kernel exited and the stream drained)
//! and `synchronize` must return (Ok or an error: the results of an aborted operation are
//! undefined). Then the communicators and the stream are destroyed and the process's thread count
//! (`/proc/self/task`) must be back at its baseline within 2 s.
//!
//! Variants, 100 counted tries each after one warm-up try (not counted; the thread baseline is
//! taken after it, so what lives for the whole process — driver, JIT'd modules — is excluded):
//! - `cpu init_all`: `Comm::init_all(&Device::cpus(2))`, both ranks in this process.
//! - `cpu init_rank 2 procs`: `Comm::init_rank` with 2 processes: rank 0 here, rank 1 a child
//!   process (this bench binary again, marked by `OXCCL_BENCH_ABORT_CHILD=<unique id in hex>`)
//!   that initializes and then only polls `get_async_error` until rank 0's abort reaches it
//!   through the shared abort page; it must report exactly "remote error: rank 1 of communicator
//!   <id>: rank 0 of this communicator aborted; abort or destroy this rank too" (`<id>` its
//!   `comm_id`), destroy, and exit 0 within 10 s.
//! - `gpu init_all 2 GPUs`: `Comm::init_all` over CUDA devices 0 and 1 when at least 2 are visible
//!   (else `SKIPPED: ...`); the marker is a CUDA event recorded after the kernel.
//!
//! Output: one table row per variant — tries, tries whose abort returned in ≤ 5 s, median / p99 /
//! max abort time in ms (p99 by nearest rank: the 99th of 100 sorted times), the slowest drain
//! after the return, synchronize results, tries whose thread count came back — then a `FAIL:`
//! line per problem. Exits 1 when any try's abort took more than 5 s or failed, a stream did not
//! drain, threads stayed behind or the child misbehaved; 0 otherwise. A variant whose stream
//! never drained stops there (its resources are leaked, not waited for). About 10–20 s in all on
//! the CPU target; a watchdog ends the bench with exit status 3 after 120 s.
mod common;

use oxccl::bootstrap::{UniqueId, get_unique_id};
use oxccl::cuda;
use oxccl::{Comm, DataType, Device, DeviceBuffer, RedOp, Stream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const BENCH: &str = "abort";
/// Counted tries per variant (the target: all of them within [`ABORT_LIMIT`]).
const TRIES: usize = 100;
/// The target: abort returns within this.
const ABORT_LIMIT: Duration = Duration::from_secs(5);
/// How long the collective spins on its missing peer before the abort.
const SPIN: Duration = Duration::from_millis(20);
/// How long after abort's return the stream may take to drain.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// How long threads may take to leave `/proc/self/task` after the teardown.
const THREADS_LIMIT: Duration = Duration::from_secs(2);
/// How long the child process may take, from the abort, to see it, destroy and exit.
const CHILD_LIMIT: Duration = Duration::from_secs(10);
/// f32 elements of the AllReduce.
const COUNT: usize = 1 << 20;
/// Environment variable that turns this binary into the `init_rank` child (rank 1).
const CHILD_ENV: &str = "OXCCL_BENCH_ABORT_CHILD";
/// What the child must see: rank 0's abort, named (the text of `Comm::get_async_error`), on the
/// communicator of id `id` (`Comm::comm_id`, 8 hex digits).
fn child_expect(id: &str) -> String {
    format!(
        "remote error: rank 1 of communicator {id}: rank 0 of this communicator aborted; abort or \
         destroy this rank too"
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("{CHILD_ENV} has an odd length {}", s.len()));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("{CHILD_ENV}: {e}")))
        .collect()
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Waits up to [`THREADS_LIMIT`] for the thread count to come back to `baseline`; returns the
/// last count seen.
fn settle_threads(baseline: usize) -> usize {
    let deadline = Instant::now() + THREADS_LIMIT;
    loop {
        let n = threads();
        if n == baseline || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Something queued on a stream right after the collective; reached once the stream gets past it.
enum Marker {
    Cpu(Arc<AtomicBool>),
    Cuda(cuda::Event),
}

impl Marker {
    fn queue(stream: &Stream) -> oxccl::Result<Marker> {
        Ok(match stream {
            Stream::Cpu(s) => {
                let flag = Arc::new(AtomicBool::new(false));
                let f = flag.clone();
                s.enqueue(move || {
                    f.store(true, Ordering::Release);
                    Ok(())
                })?;
                Marker::Cpu(flag)
            }
            Stream::Cuda(s) => {
                let e = cuda::Event::new(&s.ctx_arc())?;
                e.record(s)?;
                Marker::Cuda(e)
            }
        })
    }

    /// True once the stream got past the marker; an error of the stream counts as reached (the
    /// stream stopped, it is not spinning).
    fn reached(&self) -> bool {
        match self {
            Marker::Cpu(f) => f.load(Ordering::Acquire),
            Marker::Cuda(e) => e.is_complete().unwrap_or(true),
        }
    }
}

/// What one try measured.
struct TryOut {
    /// From the call of `abort` to its return (also when it returned an error).
    abort: Duration,
    /// From abort's return until the marker was reached; `None`: not within [`DRAIN_LIMIT`].
    drain: Option<Duration>,
    /// `synchronize` after the drain (only called when the marker was reached).
    sync: Result<(), String>,
    /// Everything wrong with this try.
    problems: Vec<String>,
}

/// The measured part of a try: the collective on rank 0 that its peer never joins, the spin, the
/// timed abort, the drain and synchronize. `Err` when the collective could not even be queued.
fn abort_spinning(comm: &Comm, stream: &Stream, buf: &DeviceBuffer) -> Result<TryOut, String> {
    comm.all_reduce(buf, buf, COUNT, DataType::F32, RedOp::Sum, stream)
        .map_err(|e| format!("all_reduce on rank 0: {e}"))?;
    let marker = Marker::queue(stream).map_err(|e| format!("queuing the marker: {e}"))?;
    std::thread::sleep(SPIN);
    let mut problems = Vec::new();
    if marker.reached() {
        problems.push(format!(
            "the AllReduce was no longer running after {SPIN:?} although rank 1 never joined"
        ));
    }
    let t = Instant::now();
    let result = comm.abort();
    let abort = t.elapsed();
    if let Err(e) = result {
        problems.push(format!("abort returned an error after {:.3} ms: {e}", ms(abort)));
    }
    if abort > ABORT_LIMIT {
        problems.push(format!("abort took {:.3} ms (> {ABORT_LIMIT:?})", ms(abort)));
    }
    if !comm.is_aborted() {
        problems.push("is_aborted() is false after abort".into());
    }
    let t = Instant::now();
    let drain = loop {
        if marker.reached() {
            break Some(t.elapsed());
        }
        if t.elapsed() > DRAIN_LIMIT {
            break None;
        }
        std::thread::sleep(Duration::from_micros(100));
    };
    let sync = match drain {
        Some(_) => stream.synchronize().map_err(|e| e.to_string()),
        None => {
            problems.push(format!(
                "the stream did not get past the aborted AllReduce within {DRAIN_LIMIT:?} of abort's return"
            ));
            Err("not called (stream still busy)".into())
        }
    };
    Ok(TryOut {
        abort,
        drain,
        sync,
        problems,
    })
}

/// One table row's worth of results.
#[derive(Default)]
struct Row {
    name: String,
    skipped: Option<String>,
    abort: Vec<Duration>,
    drain_max: Duration,
    sync_ok: usize,
    sync_err: Vec<String>,
    threads_back: usize,
    baseline: usize,
    failures: Vec<String>,
    /// The variant stopped before its last try.
    stopped: bool,
}

/// Runs a variant: a warm-up try, the thread baseline, then [`TRIES`] counted tries. `one` runs a
/// whole try (setup, [`abort_spinning`], teardown) and returns `Err` for a failure that ends the
/// variant (the setup failed, or the stream never drained and the resources were leaked).
fn run_variant(name: &str, mut one: impl FnMut() -> Result<TryOut, String>) -> Row {
    let mut row = Row {
        name: name.into(),
        ..Row::default()
    };
    match one() {
        Ok(out) if out.problems.is_empty() => {}
        Ok(out) => {
            row.failures
                .extend(out.problems.into_iter().map(|p| format!("warm-up: {p}")));
        }
        Err(e) => {
            row.failures.push(format!("warm-up: {e}"));
            row.stopped = true;
            return row;
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    row.baseline = threads();
    for i in 0..TRIES {
        let out = match one() {
            Ok(out) => out,
            Err(e) => {
                row.failures.push(format!("try {i}: {e}"));
                row.stopped = true;
                break;
            }
        };
        row.abort.push(out.abort);
        row.drain_max = row.drain_max.max(out.drain.unwrap_or(DRAIN_LIMIT));
        match out.sync {
            Ok(()) => row.sync_ok += 1,
            Err(e) => row.sync_err.push(e),
        }
        row.failures
            .extend(out.problems.iter().map(|p| format!("try {i}: {p}")));
        if out.drain.is_none() {
            // The caller leaked the communicator and stream; the thread count means nothing now.
            row.stopped = true;
            break;
        }
        let n = settle_threads(row.baseline);
        if n == row.baseline {
            row.threads_back += 1;
        } else {
            row.failures.push(format!(
                "try {i}: {n} threads {THREADS_LIMIT:?} after teardown, baseline {}",
                row.baseline
            ));
        }
    }
    row
}

/// `cpu init_all`: both ranks in this process.
fn try_cpu_init_all(buf: &DeviceBuffer) -> Result<TryOut, String> {
    let comms = Comm::init_all(&Device::cpus(2)).map_err(|e| format!("init_all: {e}"))?;
    let stream = Device::Cpu(0)
        .new_stream()
        .map_err(|e| format!("new_stream: {e}"))?;
    let mut out = abort_spinning(&comms[0], &stream, buf)?;
    if out.drain.is_none() {
        std::mem::forget(stream);
        std::mem::forget(comms);
        return Ok(out);
    }
    for c in comms {
        if let Err(e) = c.destroy() {
            out.problems.push(format!("destroy after abort: {e}"));
        }
    }
    drop(stream);
    Ok(out)
}

/// Starts the child (rank 1) for `id`.
fn spawn_child(id: &UniqueId) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    Command::new(exe)
        .env(CHILD_ENV, hex(&id.to_bytes()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawning the rank 1 process: {e}"))
}

/// Waits up to `limit` for `child` (killing it after that); returns its problems, if any.
fn reap_child(mut child: Child, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(o) = child.stdout.as_mut() {
                    let _ = std::io::Read::read_to_string(o, &mut out);
                }
                // "ABORT-CHILD-OK <id> <message>": the message must name the id the child's
                // communicator has.
                let seen_ok = out.lines().any(|l| {
                    l.strip_prefix("ABORT-CHILD-OK ")
                        .and_then(|rest| rest.split_once(' '))
                        .is_some_and(|(id, msg)| msg == child_expect(id))
                });
                return if status.success() && seen_ok {
                    None
                } else {
                    Some(format!(
                        "rank 1 process (pid {}) ended with {status}, output {:?}",
                        child.id(),
                        out.trim()
                    ))
                };
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Some(format!(
                    "rank 1 process (pid {}) still running {limit:?} after the abort; killed",
                    child.id()
                ));
            }
            Err(e) => return Some(format!("waiting for the rank 1 process: {e}")),
        }
    }
}

/// `cpu init_rank 2 procs`: rank 0 here, rank 1 in a child process that never joins.
fn try_cpu_init_rank(buf: &DeviceBuffer) -> Result<TryOut, String> {
    let id = get_unique_id().map_err(|e| format!("get_unique_id: {e}"))?;
    let child = spawn_child(&id)?;
    let comm = match Comm::init_rank(2, &id, 0, Device::Cpu(0)) {
        Ok(c) => c,
        Err(e) => {
            let why = reap_child(child, CHILD_LIMIT).unwrap_or_default();
            return Err(format!("init_rank on rank 0: {e} {why}"));
        }
    };
    let stream = match Device::Cpu(0).new_stream() {
        Ok(s) => s,
        Err(e) => {
            let _ = comm.abort();
            let _ = reap_child(child, CHILD_LIMIT);
            return Err(format!("new_stream: {e}"));
        }
    };
    let mut out = match abort_spinning(&comm, &stream, buf) {
        Ok(out) => out,
        Err(e) => {
            let _ = comm.abort();
            let _ = reap_child(child, CHILD_LIMIT);
            return Err(e);
        }
    };
    if out.drain.is_none() {
        std::mem::forget(stream);
        std::mem::forget(comm);
        if let Some(p) = reap_child(child, CHILD_LIMIT) {
            out.problems.push(p);
        }
        return Ok(out);
    }
    let t = Instant::now();
    if let Err(e) = comm.destroy() {
        out.problems.push(format!("destroy after abort: {e}"));
    }
    if t.elapsed() > Duration::from_secs(2) {
        out.problems.push(format!(
            "destroy after abort took {:.0} ms (aborted: no teardown barrier expected)",
            ms(t.elapsed())
        ));
    }
    drop(stream);
    if let Some(p) = reap_child(child, CHILD_LIMIT) {
        out.problems.push(p);
    }
    Ok(out)
}

/// The child's whole life: rank 1 of the `init_rank` variant. Never calls the collective; waits
/// for rank 0's abort to show in `get_async_error`, prints it, destroys and exits.
fn child_main(id_hex: &str) -> ! {
    let run = || -> Result<String, String> {
        let id = UniqueId::from_bytes(&unhex(id_hex)?).map_err(|e| format!("{CHILD_ENV}: {e}"))?;
        let comm =
            Comm::init_rank(2, &id, 1, Device::Cpu(1)).map_err(|e| format!("init_rank on rank 1: {e}"))?;
        let t = Instant::now();
        loop {
            if let Err(e) = comm.get_async_error() {
                let id = format!("{:08x}", comm.comm_id());
                comm.destroy().map_err(|d| format!("destroy on rank 1: {d}"))?;
                return Ok(format!("{id} {e}"));
            }
            if t.elapsed() > CHILD_LIMIT * 2 {
                // Dropping would wait at the teardown barrier for rank 0: just leave.
                std::mem::forget(comm);
                return Err(format!("rank 0's abort did not show in {:?}", CHILD_LIMIT * 2));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    };
    match run() {
        Ok(seen) => {
            println!("ABORT-CHILD-OK {seen}");
            std::process::exit(0)
        }
        Err(e) => {
            println!("ABORT-CHILD-ERR {e}");
            std::process::exit(1)
        }
    }
}

/// `gpu init_all 2 GPUs`: CUDA devices 0 and 1 in this process.
fn try_gpu_init_all(buf: &DeviceBuffer) -> Result<TryOut, String> {
    let comms = Comm::init_all(&[Device::Cuda(0), Device::Cuda(1)]).map_err(|e| format!("init_all: {e}"))?;
    let stream = Device::Cuda(0)
        .new_stream()
        .map_err(|e| format!("new_stream: {e}"))?;
    let mut out = abort_spinning(&comms[0], &stream, buf)?;
    if out.drain.is_none() {
        std::mem::forget(stream);
        std::mem::forget(comms);
        return Ok(out);
    }
    for c in comms {
        if let Err(e) = c.destroy() {
            out.problems.push(format!("destroy after abort: {e}"));
        }
    }
    drop(stream);
    Ok(out)
}

/// Why the GPU variant cannot run here, if it cannot.
fn gpu_skip_reason() -> Option<String> {
    let n = Device::cuda_count();
    if n < 2 {
        let why = match cuda::driver_version() {
            Err(e) => e.to_string(),
            Ok(v) => format!("CUDA driver {v}"),
        };
        return Some(format!("{n} CUDA GPU(s) visible, 2 needed ({why})"));
    }
    if oxccl::kernels::PTX_MODULES.is_empty() {
        return Some("oxccl was built without its kernels (OXCCL_SKIP_PTX)".into());
    }
    None
}

fn print_row(row: &Row) {
    if let Some(why) = &row.skipped {
        println!("{:<22} SKIPPED: {why}", row.name);
        return;
    }
    let mut t: Vec<f64> = row.abort.iter().map(|&d| ms(d)).collect();
    t.sort_by(f64::total_cmp);
    let n = t.len();
    let within = row.abort.iter().filter(|&&d| d <= ABORT_LIMIT).count();
    // Nearest rank: the ceil(0.99 n)-th smallest.
    let p99 = if n == 0 {
        0.0
    } else {
        t[(n * 99).div_ceil(100) - 1]
    };
    let max = t.last().copied().unwrap_or(0.0);
    let mut all = t.clone();
    let med = common::median(&mut all);
    println!(
        "{:<22} {:>5} {:>13} {:>10.3} {:>10.3} {:>10.3} {:>13.3} {:>8}/{:<3} {:>9}/{}",
        row.name,
        n,
        within,
        med,
        p99,
        max,
        ms(row.drain_max),
        row.sync_ok,
        row.sync_err.len(),
        row.threads_back,
        n
    );
}

fn main() {
    if let Ok(id) = std::env::var(CHILD_ENV) {
        child_main(&id);
    }
    common::watchdog(BENCH, Duration::from_secs(120));
    let started = Instant::now();
    println!(
        "# abort: {TRIES} tries per variant (+1 warm-up); AllReduce f32 x {COUNT} queued on rank 0 \
         only (rank 1 never joins), abort on rank 0 after {SPIN:?} of spinning; times in ms; \
         target: abort returns in <= {ABORT_LIMIT:?} in {TRIES} of {TRIES}"
    );
    let mut rows = Vec::new();
    match Device::Cpu(0).alloc(COUNT * 4) {
        Ok(buf) => {
            rows.push(run_variant("cpu init_all", || try_cpu_init_all(&buf)));
            rows.push(run_variant("cpu init_rank 2 procs", || try_cpu_init_rank(&buf)));
        }
        Err(e) => rows.push(Row {
            name: "cpu".into(),
            failures: vec![format!("allocating the CPU buffer: {e}")],
            stopped: true,
            ..Row::default()
        }),
    }
    match gpu_skip_reason() {
        Some(why) => {
            println!("SKIPPED: {BENCH}: gpu init_all 2 GPUs: {why}");
            rows.push(Row {
                name: "gpu init_all 2 GPUs".into(),
                skipped: Some(why),
                ..Row::default()
            });
        }
        None => match Device::Cuda(0).alloc(COUNT * 4) {
            Ok(buf) => rows.push(run_variant("gpu init_all 2 GPUs", || try_gpu_init_all(&buf))),
            Err(e) => rows.push(Row {
                name: "gpu init_all 2 GPUs".into(),
                failures: vec![format!("allocating the GPU buffer: {e}")],
                stopped: true,
                ..Row::default()
            }),
        },
    }
    println!(
        "{:<22} {:>5} {:>13} {:>10} {:>10} {:>10} {:>13} {:>12} {:>13}",
        "variant",
        "tries",
        "returned<=5s",
        "median",
        "p99",
        "max",
        "drain max",
        "sync ok/err",
        "threads back"
    );
    for row in &rows {
        print_row(row);
    }
    let mut failed = false;
    for row in &rows {
        if row.skipped.is_none() {
            println!("# {}: thread baseline {}", row.name, row.baseline);
        }
        if let Some(e) = row.sync_err.first() {
            println!("# {}: first synchronize error: {e}", row.name);
        }
        if row.stopped {
            failed = true;
            println!(
                "FAIL: {}: stopped after {} of {TRIES} tries",
                row.name,
                row.abort.len()
            );
        }
        for f in &row.failures {
            failed = true;
            println!("FAIL: {}: {f}", row.name);
        }
    }
    println!("# total {:.1} s", started.elapsed().as_secs_f64());
    if failed {
        std::process::exit(1);
    }
}
