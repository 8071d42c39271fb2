//! `oxccl info`: the version, the devices, the kernel modules (PTX bytes, JIT time, registers,
//! local memory) and the first call's cold time.
use super::*;

#[derive(clap::Args)]
pub(super) struct InfoArgs {
    /// Also list the kernel modules: PTX bytes each, and on GPU 0 (when there is one) the JIT
    /// time, registers per thread, local memory per thread and shared memory per block of each
    /// (with the registers the JIT spilled there, OXCCL_SMEM_SPILLING), loaded now. An optional
    /// substring keeps only the modules whose name contains it (e.g. `--kernels allreduce_float`).
    #[arg(long, value_name = "FILTER", num_args = 0..=1, default_missing_value = "")]
    kernels: Option<String>,
    /// Time a cold start in this process instead: communicator creation and the first 8-byte
    /// float-sum AllReduce (its kernel module loaded, JIT-compiled on an empty JIT cache), for
    /// `oxccl` (2 GPUs, or 2 ranks sharing GPU 0 with OXCCL_ALLOW_SHARED_DEVICE=1) or `nccl` (2
    /// GPUs, or 1 rank: NCCL refuses two ranks on one GPU). Run each in a fresh process.
    #[arg(long, value_name = "LIBRARY", value_parser = ["oxccl", "nccl"])]
    first_call: Option<String>,
}

pub(super) fn info(args: InfoArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if let Some(lib) = args.first_call {
        first_call(&lib)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "oxccl {} (ncclGetVersion-style code {}: major × 10000 + minor × 100 + patch)",
        env!("CARGO_PKG_VERSION"),
        oxccl::version()
    );
    println!(
        "PTX: {} bytes linked, split into {} kernel modules, target {}",
        oxccl::kernels::PTX_BYTES,
        oxccl::kernels::PTX_MODULES.len(),
        ptx_target()
    );
    match oxccl::cuda::driver() {
        Err(e) => println!("CUDA: {e}; the CPU target runs every collective (--backend cpu)"),
        Ok(()) => {
            println!("CUDA driver {}", oxccl::cuda::driver_version()?);
            for d in Device::all_cuda() {
                if let Device::Cuda(o) = d {
                    let ctx = oxccl::cuda::Context::get(o)?;
                    let (free, total) = ctx.mem_info()?;
                    println!(
                        "  GPU {o}: {} [{}], {:.1} of {:.1} GiB free",
                        ctx.name()?,
                        ctx.bus_id()?,
                        free as f64 / (1u64 << 30) as f64,
                        total as f64 / (1u64 << 30) as f64
                    );
                }
            }
        }
    }
    match nccl::version() {
        Ok(v) => println!("NCCL {} (system libnccl.so.2)", nccl::version_string(v)),
        Err(e) => println!("NCCL: {e}"),
    }
    if let Some(filter) = args.kernels {
        kernel_table(&filter)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `oxccl info --first-call LIB`: wall times of driver load + context creation, communicator
/// creation, and the first AllReduce (launch to completion), in this process.
pub(super) fn first_call(lib: &str) -> Result<(), Box<dyn std::error::Error>> {
    let t0 = std::time::Instant::now();
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    oxccl::cuda::driver()?;
    let ngpus = Device::all_cuda().len();
    if ngpus == 0 {
        return Err("--first-call needs a GPU".into());
    }
    let ctx = oxccl::cuda::Context::get(0)?;
    ctx.bind()?;
    let t_ctx = ms(t0);
    let t1 = std::time::Instant::now();
    let (init, call, ranks) = if lib == "nccl" {
        let ordinals: Vec<usize> = (0..ngpus.min(2)).collect();
        let comms = nccl::NcclComms::init_all(&ordinals)?;
        let init = ms(t1);
        let bufs: Vec<_> = ordinals
            .iter()
            .map(|&o| Device::Cuda(o).alloc(8))
            .collect::<Result<_, _>>()?;
        let streams: Vec<_> = ordinals
            .iter()
            .map(|&o| oxccl::cuda::Stream::new(&oxccl::cuda::Context::get(o)?))
            .collect::<Result<_, _>>()?;
        let t2 = std::time::Instant::now();
        nccl::NcclComms::group_start()?;
        for (r, (b, st)) in bufs.iter().zip(&streams).enumerate() {
            let a = b.as_slice().addr();
            // SAFETY: `a` is an 8-byte allocation of rank r's GPU, alive until the sync below.
            unsafe {
                comms.collective(
                    r,
                    oxccl::Func::AllReduce,
                    a,
                    a,
                    2,
                    oxccl::DataType::F32,
                    oxccl::RedOp::Sum,
                    0,
                    st,
                )?
            };
        }
        nccl::NcclComms::group_end()?;
        for st in &streams {
            st.synchronize()?;
        }
        (init, ms(t2), ordinals.len())
    } else {
        let devices = if ngpus >= 2 {
            vec![Device::Cuda(0), Device::Cuda(1)]
        } else {
            vec![Device::Cuda(0), Device::Cuda(0)]
        };
        let comms = oxccl::Comm::init_all(&devices)?;
        let init = ms(t1);
        let bufs: Vec<_> = devices.iter().map(|d| d.alloc(8)).collect::<Result<_, _>>()?;
        let streams: Vec<_> = devices.iter().map(|d| d.new_stream()).collect::<Result<_, _>>()?;
        let t2 = std::time::Instant::now();
        for ((c, b), st) in comms.iter().zip(&bufs).zip(&streams) {
            c.all_reduce(b, b, 2, oxccl::DataType::F32, oxccl::RedOp::Sum, st)?;
        }
        for st in &streams {
            st.synchronize()?;
        }
        (init, ms(t2), devices.len())
    };
    println!(
        "first-call {lib}: {ranks} ranks on {} GPU(s): driver + context {t_ctx:.1} ms, init {init:.1} ms, \
         first AllReduce {call:.1} ms, total {:.1} ms",
        ngpus.min(2),
        ms(t0)
    );
    Ok(())
}

/// `oxccl info --kernels`: one line per module whose name contains `filter`: PTX bytes, and on
/// GPU 0 the cold-or-cached JIT time, registers and local memory per thread, shared memory per
/// block.
pub(super) fn kernel_table(filter: &str) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = match oxccl::cuda::driver() {
        Ok(()) if !Device::all_cuda().is_empty() => Some(oxccl::cuda::Context::get(0)?),
        _ => None,
    };
    println!(
        "\n# {:<44} {:>10} {:>10} {:>6} {:>8} {:>8}",
        "kernel module", "PTX bytes", "JIT ms", "regs", "local B", "smem B"
    );
    let (mut n, mut bytes, mut jit, mut local) = (0usize, 0usize, 0.0f64, 0usize);
    for (name, _) in oxccl::kernels::PTX_MODULES
        .iter()
        .filter(|(n, _)| n.contains(filter))
    {
        let ptx = oxccl::kernels::module(name).map_or(0, |m| m.len());
        n += 1;
        bytes += ptx;
        match &ctx {
            Some(ctx) => {
                let m = ctx.kernel(name)?;
                jit += m.load_seconds;
                local += usize::from(m.local_bytes > 0);
                println!(
                    "  {name:<44} {ptx:>10} {:>10.1} {:>6} {:>8} {:>8}",
                    m.load_seconds * 1e3,
                    m.num_regs,
                    m.local_bytes,
                    m.shared_bytes
                );
            }
            None => println!("  {name:<44} {ptx:>10} {:>10} {:>6} {:>8} {:>8}", "-", "-", "-", "-"),
        }
    }
    println!(
        "# {n} modules, {bytes} PTX bytes{}",
        if ctx.is_some() {
            format!(
                ", {:.2} s JIT in all (GPU 0; the driver's JIT cache makes a second run fast), \
                 {local} with local memory",
                jit
            )
        } else {
            " (no GPU: JIT time, registers and local memory need one)".into()
        }
    );
    Ok(())
}

pub(super) fn ptx_target() -> String {
    let first = oxccl::kernels::PTX_MODULES
        .first()
        .and_then(|(n, _)| oxccl::kernels::module(n));
    first
        .and_then(|ptx| {
            ptx.lines()
                .find(|l| l.starts_with(".target"))
                .map(|l| l.trim_start_matches(".target").trim().to_string())
        })
        .unwrap_or_else(|| "none".into())
}
