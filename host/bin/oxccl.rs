//! `oxccl`: the command-line front end. `oxccl perf <operation>` runs nccl-tests-style sweeps of a
//! collective or a point-to-point operation on oxccl (GPU or CPU target), on the system NCCL, or
//! both side by side; `oxccl info` describes the machine.
use clap::{Parser, Subcommand, ValueEnum};
use oxccl::nccl::{self, NcclComms};
use oxccl::perf::p2p::{self, P2pConfig, P2pFunc};
use oxccl::perf::run::{Backend, Bench, PerfConfig, sweep};
use oxccl::perf::{report, table};
use oxccl::{Comm, DataType, Device, Func, RedOp};
use std::process::ExitCode;

#[path = "oxccl/info.rs"]
mod info;
#[path = "oxccl/topo.rs"]
mod topo;
#[path = "oxccl/trace.rs"]
mod trace;
use info::{InfoArgs, info};
use topo::{TopoArgs, topo};
use trace::{TraceArgs, trace};

#[derive(Parser)]
#[command(
    name = "oxccl",
    version,
    about = "oxccl: collective communication for NVIDIA GPUs, in Rust"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmark a collective or a point-to-point operation like nccl-tests (size, time, algbw,
    /// busbw, #wrong).
    Perf(PerfArgs),
    /// Print the version, the devices and the kernel module.
    Info(InfoArgs),
    /// Print a topology: its nodes and links, the GPU path matrix, path bandwidths and the rings
    /// the graph search builds.
    Topo(TopoArgs),
    /// Time communicator creation (Comm::init_rank, and NCCL's ncclCommInitRank with --compare
    /// nccl), one rank per process: median/min/max over the iterations.
    InitBench(InitBenchArgs),
    /// Read flight-recorder dumps (OXCCL_FLIGHT_RECORDER_DUMP on a timeout, Comm::flight_record)
    /// of a communicator's ranks: which rank is behind and at which call, which ranks disagree on
    /// a call, which sends and receives miss their match or differ in size from it, where a
    /// timed-out call stopped.
    Trace(TraceArgs),
}

#[derive(clap::Args)]
struct InitBenchArgs {
    /// Number of ranks, one process each (rank r on GPU r, or on CPU-target device r).
    #[arg(long, value_name = "N", default_value_t = 2)]
    procs: usize,
    /// Timed inits per library.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Also time NCCL's ncclCommInitRank (GPUs only), alternating with oxccl's inits.
    #[arg(long, value_enum)]
    compare: Option<CompareArg>,
    /// Where to run: auto (GPUs when visible), cuda or cpu (for NCCL, add --compare nccl).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Collective {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    /// Every rank sends to rank + 1 and receives from rank − 1 in one group (busbw = algbw).
    SendRecv,
    /// Every rank sends a block to each rank (no in-place form: those columns print N/A).
    AllToAll,
    /// Every rank's block to rank 0.
    Gather,
    /// Rank 0's blocks, one to each rank.
    Scatter,
    /// Every rank sends uneven blocks (½ to nearly 2× the average) to each rank: oxccl's
    /// all_to_all_v; with --compare nccl, NCCL runs the same group of sends and receives.
    AllToAllV,
    /// Every rank contributes an uneven block (½ to nearly 2× the average) that every rank
    /// receives: oxccl's all_gather_v; with --compare nccl, the same group of sends and receives.
    AllGatherV,
    /// The sum of every rank's input, scattered in uneven blocks (½ to nearly 2× the average):
    /// oxccl's reduce_scatter_v; with --compare nccl, the same group of ncclReduce calls.
    ReduceScatterV,
    /// The five collectives, one after the other (not the point-to-point operations).
    All,
}

/// One sweep of `oxccl perf`: a collective or a point-to-point operation.
#[derive(Clone, Copy)]
enum Op {
    Coll(Func),
    P2p(P2pFunc),
}

impl Op {
    /// The name nccl-tests' benchmark has (`allreduce`, `sendrecv`).
    fn name(self) -> &'static str {
        match self {
            Op::Coll(f) => f.name(),
            Op::P2p(f) => f.name(),
        }
    }
}

impl Collective {
    fn ops(self) -> Vec<Op> {
        match self {
            Collective::AllReduce => vec![Op::Coll(Func::AllReduce)],
            Collective::Broadcast => vec![Op::Coll(Func::Broadcast)],
            Collective::Reduce => vec![Op::Coll(Func::Reduce)],
            Collective::AllGather => vec![Op::Coll(Func::AllGather)],
            Collective::ReduceScatter => vec![Op::Coll(Func::ReduceScatter)],
            Collective::SendRecv => vec![Op::P2p(P2pFunc::SendRecv)],
            Collective::AllToAll => vec![Op::P2p(P2pFunc::AllToAll)],
            Collective::Gather => vec![Op::P2p(P2pFunc::Gather)],
            Collective::Scatter => vec![Op::P2p(P2pFunc::Scatter)],
            Collective::AllToAllV => vec![Op::P2p(P2pFunc::AllToAllV)],
            Collective::AllGatherV => vec![Op::P2p(P2pFunc::AllGatherV)],
            Collective::ReduceScatterV => vec![Op::P2p(P2pFunc::ReduceScatterV)],
            Collective::All => [
                Func::AllReduce,
                Func::AllGather,
                Func::ReduceScatter,
                Func::Broadcast,
                Func::Reduce,
            ]
            .into_iter()
            .map(Op::Coll)
            .collect(),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// Every visible GPU; the CPU target when there is none (`perf`: 4 ranks unless --ranks or
    /// --procs say otherwise).
    Auto,
    /// oxccl on every visible GPU (error without one).
    Cuda,
    /// oxccl's CPU target.
    Cpu,
    /// The system NCCL (libnccl.so.2) on every visible GPU.
    Nccl,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CompareArg {
    /// NCCL on the same GPUs in the same process (GPUs only).
    Nccl,
    /// oxccl itself with the call-signature check on (`OXCCL_CHECK_CALLS=1`; the main run has
    /// it off): what the check costs, in the same run.
    Checked,
    /// oxccl itself again: a second set of communicators with the main run's settings, timed
    /// as any reference is (after the main run, size by size). What the comparison itself adds
    /// (an A/A run), to read `--compare checked` against.
    #[value(name = "self")]
    Itself,
}

impl CompareArg {
    /// The reference's name in the table's column heads and footer.
    fn labels(self) -> (&'static str, &'static str) {
        match self {
            CompareArg::Nccl => ("nccl", "NCCL"),
            CompareArg::Checked => ("checked", "checked"),
            CompareArg::Itself => ("self", "self"),
        }
    }
}

#[derive(clap::Args)]
struct PerfArgs {
    /// Collective or point-to-point operation to run.
    collective: Collective,
    /// Smallest message size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = size_arg)]
    min_bytes: u64,
    /// Largest message size.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = size_arg)]
    max_bytes: u64,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: u64,
    /// Fixed increment between sizes (instead of -f).
    #[arg(short = 'i', long = "stepbytes", value_parser = size_arg)]
    step: Option<u64>,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warmup iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results this many times per size (0 disables; nccl-tests' -c).
    #[arg(short = 'c', long = "check", default_value_t = 1, num_args = 0..=1, default_missing_value = "1")]
    check: usize,
    /// Element type (float, half, bfloat16, double, int8, uint8, int32, uint32, int64, uint64; also f32, f16, bf16, ...).
    #[arg(short = 'd', long = "dtype", default_value = "float", value_parser = dtype_arg)]
    dtype: DataType,
    /// Reduction operator (sum, prod, min, max, avg; ignored by the point-to-point operations).
    #[arg(short = 'o', long = "op", default_value = "sum", value_parser = op_arg)]
    op: RedOp,
    /// Number of ranks (CPU target; on GPUs at most the visible count, default all).
    #[arg(long)]
    ranks: Option<usize>,
    /// Run N ranks as N processes of this binary (rank r on GPU r, or on CPU-target device r),
    /// bootstrapped through one unique id (Comm::init_rank); rank 0 prints the results.
    #[arg(long, value_name = "N")]
    procs: Option<usize>,
    /// With --procs N: run the ranks on H simulated hosts (N/H each, in blocks), network
    /// namespaces joined by veth pairs, so ranks of different hosts talk over the socket network.
    /// Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2's `ip`; the namespaces are
    /// deleted afterwards.
    #[arg(long, value_name = "H", requires = "procs")]
    hosts: Option<usize>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Also run a reference in the same process and print its columns and the busbw ratio:
    /// NCCL on the same GPUs, or oxccl with the call-signature check on.
    #[arg(long, value_enum)]
    compare: Option<CompareArg>,
    /// Write every result (and NCCL's, when compared) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
    /// Write an SVG plot of busbw against size (oxccl and NCCL curves) to this file.
    #[arg(long, value_name = "FILE")]
    plot: Option<std::path::PathBuf>,
    /// Force oxccl's protocol(s): an NCCL_PROTO-style list (`LL`, `LL128`, `Simple`, `^LL`).
    /// Sets OXCCL_PROTO, so a compared NCCL keeps its own choice unless NCCL_PROTO is set.
    #[arg(long, value_name = "LIST")]
    proto: Option<String>,
    /// Force oxccl's algorithm(s): an NCCL_ALGO-style list (`ring`, `tree`). Sets OXCCL_ALGO.
    #[arg(long, value_name = "LIST")]
    algo: Option<String>,
    /// Issue each iteration's collectives of this process's ranks as one group (oxccl's
    /// `group_start`, the calls, `group_end`), as the NCCL backend always does with
    /// ncclGroupStart/ncclGroupEnd: with `--compare nccl` and oxccl's libnccl.so.2, the two
    /// sides then differ only by the C entry points. Point-to-point operations are always
    /// issued as one group.
    #[arg(long)]
    group: bool,
    /// Issue each local rank's timed collectives from a thread of its own, as a process per
    /// rank would (oxccl, `--ranks` of two or more; not with `--group`, whose calls one thread
    /// issues). The `#wrong` checks still run from one thread.
    #[arg(long, conflicts_with = "group")]
    threads: bool,
}

fn size_arg(s: &str) -> Result<u64, String> {
    table::parse_size(s)
}

fn dtype_arg(s: &str) -> Result<DataType, String> {
    let alias = match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" => "float",
        "f16" | "float16" | "fp16" => "half",
        "bf16" => "bfloat16",
        "f64" | "float64" => "double",
        "i8" => "int8",
        "u8" => "uint8",
        "i32" | "int" => "int32",
        "u32" => "uint32",
        "i64" => "int64",
        "u64" => "uint64",
        "e4m3" | "fp8e4m3" | "float8e4m3" => "f8e4m3",
        "e5m2" | "fp8e5m2" | "float8e5m2" => "f8e5m2",
        other => return DataType::from_name(other).ok_or_else(|| bad_value("dtype", s, DataType::ALL)),
    };
    DataType::from_name(alias).ok_or_else(|| bad_value("dtype", s, DataType::ALL))
}

fn op_arg(s: &str) -> Result<RedOp, String> {
    RedOp::from_name(s).ok_or_else(|| bad_value("op", s, RedOp::ALL))
}

fn bad_value<T: std::fmt::Display>(what: &str, s: &str, all: &[T]) -> String {
    let names: Vec<String> = all.iter().map(|v| v.to_string()).collect();
    format!("unknown {what} {s:?}; accepted: {}", names.join(", "))
}

fn main() -> ExitCode {
    // Like other command-line tools, end quietly when the reader of stdout goes away
    // (`oxccl perf ... | head`): Rust ignores SIGPIPE, which turned that into a panic in
    // `println!` (and, under --procs, a rank stuck at teardown for two minutes).
    // SAFETY: called first in main, before any thread exists; SIG_DFL is a valid disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let filter = match std::env::var("NCCL_DEBUG")
        .unwrap_or_default()
        .to_ascii_uppercase()
        .as_str()
    {
        "TRACE" => "oxccl=trace",
        "INFO" => "oxccl=info",
        "WARN" => "oxccl=warn",
        _ => "oxccl=warn",
    };
    let env = tracing_subscriber::EnvFilter::try_from_env("OXCCL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(env)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Perf(a) => perf(a),
        Cmd::Info(a) => info(a),
        Cmd::Topo(t) => topo(t),
        Cmd::InitBench(a) => init_bench(a),
        Cmd::Trace(a) => trace(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("oxccl: {e}");
            ExitCode::from(2)
        }
    }
}

/// `oxccl perf --procs N`: starts N processes of this binary with the same arguments, one rank
/// each, bootstrapped through a fresh unique id; rank 0's output is this command's. Returns the
/// first failing rank's exit status (the other ranks are then stopped, as they could only wait).
fn perf_spawn(a: &PerfArgs, n: usize) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if a.ranks.is_some() {
        return Err("--procs N sets the number of ranks: drop --ranks".into());
    }
    let ngpu = Device::cuda_count();
    let gpu = match a.backend {
        BackendArg::Cuda if ngpu == 0 => {
            return Err("no CUDA GPU is visible (no driver or no device); use --backend cpu".into());
        }
        BackendArg::Cuda => true,
        BackendArg::Auto => ngpu > 0,
        BackendArg::Nccl if ngpu == 0 => {
            return Err("--backend nccl needs GPUs: no CUDA GPU is visible (no driver or no device)".into());
        }
        BackendArg::Nccl => true,
        BackendArg::Cpu => false,
    };
    if a.compare == Some(CompareArg::Nccl) && !gpu {
        return Err("--compare nccl needs GPUs (NCCL does not run on the CPU target)".into());
    }
    if !gpu && a.backend == BackendArg::Auto {
        println!("# no CUDA GPU visible: running on oxccl's CPU target");
    }
    let limit = if gpu { ngpu } else { 64 };
    if n == 0 || n > limit {
        return Err(format!(
            "--procs {n} is out of range (accepted: 1..={limit}, {})",
            if gpu {
                "one process per visible GPU"
            } else {
                "CPU-target ranks"
            }
        )
        .into());
    }
    let failed = match a.hosts {
        Some(h) if h > 1 => {
            if h > n {
                return Err(format!(
                    "--hosts {h} is out of range for --procs {n} (accepted: 1..={n}, at least one rank per host)"
                )
                .into());
            }
            use oxccl::perf::procs::{Hosts, host_of, spawn_ranks};
            let hosts = Hosts::create(h)?;
            let per: Vec<usize> = (0..h)
                .map(|k| (0..n).filter(|&r| host_of(r, n, h) == k).count())
                .collect();
            println!(
                "# {h} simulated hosts: network namespaces {} (veths on a bridge), ranks per host {per:?}",
                hosts.namespaces().join(", ")
            );
            // `hosts` is dropped (the namespaces deleted) whatever the ranks do.
            spawn_ranks(n, gpu, &hosts.unique_id()?, |r| hosts.launch(host_of(r, n, h)))?
        }
        Some(0) => return Err(format!("--hosts 0 is out of range (accepted: 1..={n})").into()),
        _ => oxccl::perf::procs::spawn(n, gpu)?,
    };
    match failed {
        None => Ok(ExitCode::SUCCESS),
        Some((r, status)) => {
            eprintln!("oxccl: rank {r} of {n} failed ({status}); stopped the others");
            Ok(ExitCode::from(status.code().map_or(1, |c| c.clamp(1, 255) as u8)))
        }
    }
}

fn devices_for(a: &PerfArgs) -> Result<(Vec<Device>, bool), String> {
    let ngpu = Device::cuda_count();
    let gpu_list = |n: usize| -> Result<Vec<Device>, String> {
        let want = a.ranks.unwrap_or(n);
        // OXCCL_ALLOW_SHARED_DEVICE=1 lets several ranks share a GPU for testing: rank r on GPU
        // r·n/want, contiguous blocks. NCCL itself refuses a shared device (its own error is
        // reported), unless the libnccl.so.2 it loads is oxccl's C library.
        let shared = oxccl::params::env_var("ALLOW_SHARED_DEVICE").is_some_and(|(_, v)| v == "1");
        let most = if shared { 64 } else { n };
        if want == 0 || want > most {
            return Err(format!(
                "--ranks {want} is out of range: {n} GPUs are visible (accepted: 1..={most}{})",
                if shared {
                    ""
                } else {
                    "; OXCCL_ALLOW_SHARED_DEVICE=1 allows up to 64 sharing them"
                }
            ));
        }
        Ok((0..want).map(|r| Device::Cuda(r * n / want)).collect())
    };
    match a.backend {
        BackendArg::Cuda if ngpu == 0 => {
            Err("no CUDA GPU is visible (no driver or no device); use --backend cpu".into())
        }
        BackendArg::Nccl if ngpu == 0 => {
            Err("--backend nccl needs GPUs: no CUDA GPU is visible (no driver or no device)".into())
        }
        BackendArg::Cuda => Ok((gpu_list(ngpu)?, false)),
        BackendArg::Nccl => Ok((gpu_list(ngpu)?, true)),
        BackendArg::Auto if ngpu > 0 => Ok((gpu_list(ngpu)?, false)),
        BackendArg::Auto | BackendArg::Cpu => {
            let n = a.ranks.unwrap_or(4);
            if a.backend == BackendArg::Auto {
                println!("# no CUDA GPU visible: running on oxccl's CPU target");
            }
            if n == 0 || n > 64 {
                return Err(format!(
                    "--ranks {n} is out of range for the CPU target (accepted: 1..=64)"
                ));
            }
            Ok((Device::cpus(n), false))
        }
    }
}

fn perf(a: PerfArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    // Checked under the flags' names first (they reach the communicators as OXCCL_PROTO/ALGO).
    oxccl::tuning::Selection::from_lookup(|k| match k {
        "PROTO" => a.proto.clone().map(|v| ("--proto".to_string(), v)),
        "ALGO" => a.algo.clone().map(|v| ("--algo".to_string(), v)),
        _ => None,
    })?;
    for (var, value) in [("OXCCL_PROTO", &a.proto), ("OXCCL_ALGO", &a.algo)] {
        if let Some(v) = value {
            // SAFETY: called before this process starts any thread (communicators, NCCL, streams
            // are all created below), so nothing reads the environment concurrently.
            unsafe { std::env::set_var(var, v) };
        }
    }
    // This process's rank when `oxccl perf --procs` started it (see `perf_spawn`).
    let proc_rank = oxccl::perf::procs::ChildRank::from_env()?;
    if let (Some(n), None) = (a.procs, &proc_rank) {
        return perf_spawn(&a, n);
    }
    let (devices, nccl_main) = match &proc_rank {
        Some(p) => (vec![p.device], a.backend == BackendArg::Nccl),
        None => devices_for(&a)?,
    };
    if nccl_main && let Some(c @ (CompareArg::Checked | CompareArg::Itself)) = a.compare {
        return Err(format!(
            "--compare {} compares oxccl with itself; with --backend nccl use --compare nccl or none",
            c.labels().0
        )
        .into());
    }
    let (ranks, nranks): (Vec<usize>, usize) = match &proc_rank {
        Some(p) => (vec![p.rank], p.nranks),
        None => ((0..devices.len()).collect(), devices.len()),
    };
    let compare = a.compare.is_some();
    let compare_nccl = a.compare == Some(CompareArg::Nccl);
    if compare_nccl && !devices[0].is_cuda() {
        return Err("--compare nccl needs GPUs (NCCL does not run on the CPU target)".into());
    }
    let (ref_label, ref_name) = a.compare.map_or(("nccl", "NCCL"), CompareArg::labels);
    // With --compare checked, the main run has the check off and the reference has it on.
    let config = match a.compare {
        Some(CompareArg::Checked) => oxccl::CommConfig::default().with_check_calls(false),
        _ => oxccl::CommConfig::default(),
    };
    if a.min_bytes > a.max_bytes {
        return Err(format!("-b {} is larger than -e {}", a.min_bytes, a.max_bytes).into());
    }
    if a.step.is_none() && a.factor < 2 && a.min_bytes < a.max_bytes {
        return Err(format!(
            "-f {} is out of range (accepted: 2 or more; or a fixed step with -i BYTES)",
            a.factor
        )
        .into());
    }
    if a.step == Some(0) && a.min_bytes < a.max_bytes {
        return Err("-i 0 is out of range (accepted: 1 byte or more)".into());
    }
    let sizes = table::sizes(a.min_bytes, a.max_bytes, a.factor, a.step);
    let ordinals: Vec<usize> = devices
        .iter()
        .filter_map(|d| if let Device::Cuda(o) = d { Some(*o) } else { None })
        .collect();
    // A process of `--procs` joins the other processes through a control bootstrap on the id its
    // parent gave it, then each communicator (oxccl's, NCCL's) through a fresh id of rank 0's.
    let ctl = match &proc_rank {
        Some(p) => Some(oxccl::bootstrap::Bootstrap::init(&p.id, p.rank, p.nranks)?),
        None => None,
    };
    let nccl_comms = |what: &str| -> Result<Backend, Box<dyn std::error::Error>> {
        let comms = match (&proc_rank, &ctl, ordinals.first()) {
            (Some(p), Some(ctl), Some(&o)) => oxccl::perf::procs::share_id(ctl, nccl::unique_id)
                .and_then(|id| NcclComms::init_rank(p.nranks, &id, p.rank, o)),
            _ => NcclComms::init_all(&ordinals),
        };
        comms
            .map(Backend::Nccl)
            .map_err(|e| format!("{what}: {e}").into())
    };
    // Free memory of the first GPU at each stage, to report what each library allocates (contexts
    // first, so neither is charged for the CUDA context).
    let first_ctx = match devices.first() {
        Some(Device::Cuda(o)) if proc_rank.is_none() => Some(oxccl::cuda::Context::get(*o)?),
        _ => None,
    };
    for d in &devices {
        if let Device::Cuda(o) = d {
            oxccl::cuda::Context::get(*o)?;
        }
    }
    let free = || {
        first_ctx
            .as_ref()
            .and_then(|c| c.mem_info().ok())
            .map(|(f, _)| f as i64)
    };
    let free_start = free();
    let t0 = std::time::Instant::now();
    let oxccl_comms = |config: &oxccl::CommConfig| -> Result<Backend, Box<dyn std::error::Error>> {
        Ok(if let (Some(p), Some(ctl)) = (&proc_rank, &ctl) {
            let id = oxccl::perf::procs::share_id(ctl, || Ok(oxccl::bootstrap::get_unique_id()?.to_bytes()))?;
            let id = oxccl::bootstrap::UniqueId::from_bytes(&id)?;
            Backend::Oxccl(vec![Comm::init_rank_config(p.nranks, &id, p.rank, p.device, config)?])
        } else {
            Backend::Oxccl(Comm::init_all_config(&devices, config)?)
        })
    };
    let main = if nccl_main { nccl_comms("--backend nccl")? } else { oxccl_comms(&config)? };
    let init_s = t0.elapsed().as_secs_f64();
    let free_main = free();
    let reference = match a.compare {
        Some(CompareArg::Nccl) => Some(nccl_comms("--compare nccl")?),
        Some(CompareArg::Checked) => Some(oxccl_comms(&oxccl::CommConfig::default().with_check_calls(true))?),
        Some(CompareArg::Itself) => Some(oxccl_comms(&config)?),
        None => None,
    };
    let free_ref = free();
    let max_bytes = sizes.iter().copied().max().unwrap_or(0).max(16);
    let bench = Bench::with_ranks(&devices, &ranks, nranks, max_bytes)?;
    let free_bench = free();

    let name = if nccl_main { "nccl" } else { "oxccl" };
    println!("# {name} perf (oxccl {})", env!("CARGO_PKG_VERSION"));
    println!(
        "# nranks {}{}  minBytes {}  maxBytes {}  step: {}  warmup iters: {}  iters: {}  validation: {}",
        nranks,
        if proc_rank.is_some() {
            format!(" ({nranks} processes; rank 0's devices shown)")
        } else {
            String::new()
        },
        a.min_bytes,
        a.max_bytes,
        a.step
            .map_or(format!("{}(factor)", a.factor), |s| format!("{s}(bytes)")),
        a.warmup,
        a.iters,
        a.check
    );
    if a.group && !nccl_main {
        println!("# oxccl: each iteration's calls of this process's ranks issued as one group");
    }
    if a.threads && !nccl_main && ranks.len() > 1 {
        println!("# oxccl: each of this process's ranks issues its timed calls from a thread of its own");
    }
    for (d, r) in devices.iter().zip(&ranks) {
        match d {
            Device::Cuda(o) => {
                let ctx = oxccl::cuda::Context::get(*o)?;
                println!("#  Rank {r:2} device {o} [{}] {}", ctx.bus_id()?, ctx.name()?);
            }
            Device::Cpu(i) => println!("#  Rank {r:2} CPU target device {i}"),
        }
    }
    if devices[0].is_cuda() {
        println!("# CUDA driver {}", oxccl::cuda::driver_version()?);
        if let Ok(v) = nccl::version()
            && (nccl_main || compare_nccl)
        {
            match nccl::loaded_from() {
                Some(path) => println!("# NCCL {} ({path})", nccl::version_string(v)),
                None => println!("# NCCL {}", nccl::version_string(v)),
            }
        }
    }
    if let Backend::Oxccl(comms) = &main {
        println!(
            "# oxccl init {:.1} ms; channels {}, NCCL_BUFFSIZE {}, NCCL_NTHREADS {}, connection memory per rank {:.1} MiB",
            init_s * 1e3,
            comms[0].nchannels(),
            comms[0].params().buffsize,
            comms[0].params().nthreads,
            comms[0].device_memory_bytes() as f64 / (1 << 20) as f64
        );
    }
    let mut wrong = 0;
    let mut all_rows: Vec<(Op, Vec<table::Row>)> = Vec::new();
    let ops = a.collective.ops();
    for op in ops.iter().copied() {
        println!("#\n# {}", op.name());
        print!("{}", table::header_for(compare.then_some(ref_label)));
        let print_row = |row: &table::Row| println!("{}", table::format_row(row));
        let rows = match op {
            Op::Coll(func) => {
                let cfg = PerfConfig {
                    func,
                    dtype: a.dtype,
                    op: a.op,
                    sizes: sizes.clone(),
                    warmup: a.warmup,
                    iters: a.iters,
                    check: a.check,
                    group: a.group,
                    threads: a.threads,
                };
                sweep(&bench, &main, reference.as_ref(), &cfg, print_row)?
            }
            Op::P2p(func) => {
                let cfg = P2pConfig {
                    func,
                    dtype: a.dtype,
                    sizes: sizes.clone(),
                    warmup: a.warmup,
                    iters: a.iters,
                    check: a.check,
                };
                p2p::sweep(&bench, &main, reference.as_ref(), &cfg, print_row)?
            }
        };
        print!("{}", table::footer_for(&rows, ref_name));
        if let Some(line) = table::choices_line(&rows) {
            print!("{line}");
        }
        wrong += table::total_wrong(&rows);
        if let (Backend::Oxccl(_), Some(Device::Cuda(o))) = (&main, devices.first()) {
            // The kernel module of each (algorithm, protocol) a collective's sweep ran — its
            // plain entry, its checked one (Broadcast and AllGather with the call check on), or
            // both, whichever the sweep loaded; the point-to-point kernel (loaded at init when
            // there are peers) for the others.
            let ctx = oxccl::cuda::Context::get(*o)?;
            let names: Vec<String> = match op {
                Op::Coll(func) => rows
                    .iter()
                    .filter_map(|r| r.choice.map(|c| (c.algo, c.proto)))
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .flat_map(|(algo, proto)| {
                        [false, true].map(|checked| oxccl::kernel_name_for(func, algo, proto, a.dtype, a.op, checked))
                    })
                    .map(|n| n.as_str().to_string())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .filter(|n| ctx.loaded_kernel(n).is_some())
                    .collect(),
                Op::P2p(_) if nranks > 1 => vec![oxccl_gpu::abi::P2P_KERNEL_NAME.to_string()],
                Op::P2p(_) => Vec::new(),
            };
            for name in names {
                let m = ctx.kernel(&name)?;
                println!(
                    "# kernel {name}: PTX {} bytes, JIT {:.1} ms, {} registers, {} bytes local memory per thread, \
                     {} bytes shared memory per block{}",
                    oxccl::kernels::module(&name).map_or(0, |m| m.len()),
                    m.load_seconds * 1e3,
                    m.num_regs,
                    m.local_bytes,
                    m.shared_bytes,
                    if m.smem_spilling { " (spills to shared memory allowed)" } else { "" }
                );
            }
        }
        all_rows.push((op, rows));
    }
    if let (Some(a0), Some(a1), Some(a2), Some(a3), Some(a4)) =
        (free_start, free_main, free_ref, free_bench, free())
    {
        let mib = |b: i64| b as f64 / (1 << 20) as f64;
        println!(
            "# device memory of GPU {} (cuMemGetInfo): {name} init {:.1} MiB{}; allocated during the sweeps {:.1} MiB \
             (NCCL's lazily connected buffers and every loaded kernel module)",
            ordinals.first().copied().unwrap_or(0),
            mib(a0 - a1),
            if compare {
                format!(", {ref_name} init {:.1} MiB", mib(a1 - a2))
            } else {
                String::new()
            },
            mib(a3 - a4)
        );
    }
    let sweeps: Vec<report::Sweep<'_>> = all_rows
        .iter()
        .map(|(op, r)| report::Sweep {
            name: op.name(),
            rows: r,
        })
        .collect();
    let describe = format!(
        "{name}{} on {} x {}, {}{}",
        match a.compare {
            Some(CompareArg::Nccl) => " vs NCCL",
            Some(CompareArg::Checked) => " vs itself with OXCCL_CHECK_CALLS=1",
            Some(CompareArg::Itself) => " vs itself",
            None => "",
        },
        nranks,
        match devices[0] {
            Device::Cuda(o) => oxccl::cuda::Context::get(o)?.name()?,
            Device::Cpu(_) => "CPU-target rank".into(),
        },
        a.dtype,
        // The operator only where a collective reduces.
        if ops.iter().any(|o| matches!(o, Op::Coll(_))) {
            format!(" {}", a.op)
        } else {
            String::new()
        }
    );
    if let Some(path) = &a.json {
        let meta = serde_json::json!({
            "oxccl_version": env!("CARGO_PKG_VERSION"),
            "backend": name,
            "compare": if compare { Some(ref_label) } else { None },
            "nccl_version": if compare_nccl || nccl_main { nccl::version().ok().map(nccl::version_string) } else { None },
            "nranks": nranks,
            "devices": devices.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>(),
            "description": describe,
            "warmup": a.warmup, "iters": a.iters, "check": a.check,
        });
        std::fs::write(path, report::to_json(meta, &sweeps))
            .map_err(|e| format!("--json {}: {e}", path.display()))?;
        println!("# wrote {}", path.display());
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, report::svg_plot(&describe, &sweeps, ref_name))
            .map_err(|e| format!("--plot {}: {e}", path.display()))?;
        println!("# wrote {}", path.display());
    }
    Ok(if wrong > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// `oxccl init-bench`: the parent validates and starts the ranks (oxccl::perf::init_bench::spawn);
/// each child times its inits; rank 0 prints the table.
fn init_bench(a: InitBenchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    use oxccl::perf::init_bench::{self as ib, InitBenchConfig, Target};
    if matches!(a.compare, Some(CompareArg::Checked | CompareArg::Itself)) {
        return Err("init-bench: --compare checked and --compare self time calls, not inits; use --compare nccl".into());
    }
    let cfg = InitBenchConfig {
        procs: a.procs,
        iters: a.iters,
        compare_nccl: a.compare.is_some(),
        target: match a.backend {
            BackendArg::Auto => Target::Auto,
            BackendArg::Cuda => Target::Cuda,
            BackendArg::Cpu => Target::Cpu,
            BackendArg::Nccl => {
                return Err("init-bench: use --compare nccl to time NCCL next to oxccl".into());
            }
        },
    };
    if let Some(me) = ib::ChildRank::from_env()? {
        if let Some(result) = ib::run_rank(&me, &cfg)? {
            print!("{}", ib::format_table(&result));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let gpu = cfg.validate(Device::cuda_count())?;
    match oxccl::perf::procs::spawn(cfg.procs, gpu)? {
        None => Ok(ExitCode::SUCCESS),
        Some((r, status)) => {
            eprintln!(
                "oxccl: init-bench rank {r} of {} failed ({status}); stopped the others",
                cfg.procs
            );
            Ok(ExitCode::from(status.code().map_or(1, |c| c.clamp(1, 255) as u8)))
        }
    }
}
