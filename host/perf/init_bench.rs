//! `oxccl init-bench`: how long communicator creation takes, one rank per process, as an
//! application sees it (the target: 2 ranks in 2 processes on 2×H200, no slower than NCCL).
//!
//! The command starts N processes of the running binary ([`super::procs::spawn`], as `oxccl perf
//! --procs N` does), each told its rank and a *control* unique id through environment variables ([`ENV_RANK`],
//! [`ENV_NRANKS`], [`ENV_ID`], [`ENV_GPU`]). The ranks join the control bootstrap once; then for
//! every iteration rank 0 makes a fresh id (oxccl's [`get_unique_id`] or NCCL's
//! `ncclGetUniqueId`), ships its 128 bytes to the others over the control bootstrap, and every
//! rank times, from a control barrier, the communicator init ([`Comm::init_rank`] or
//! `ncclCommInitRank`) followed by a second control barrier (so the time is the slowest rank's),
//! then destroys the communicator. Making the id is not timed (as nccl-tests does not time
//! `ncclGetUniqueId`); the CUDA context is created before any timing. With `--compare nccl` the
//! oxccl and NCCL iterations alternate, so drift on the machine affects both alike.
pub use super::procs::{ChildRank, ENV_GPU, ENV_ID, ENV_NRANKS, ENV_RANK, from_hex, share_id, to_hex};
use crate::bootstrap::{Bootstrap, UniqueId, get_unique_id};
use crate::error::{Error, Result};
use crate::{Comm, Device};
use std::time::Instant;

/// Most iterations accepted.
pub const MAX_ITERS: usize = 10_000;
/// Most CPU-target ranks accepted (as `oxccl perf --procs`).
pub const MAX_CPU_PROCS: usize = 64;

/// Where the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// CUDA when a GPU is visible, else the CPU target.
    Auto,
    /// CUDA devices (error without one).
    Cuda,
    /// oxccl's CPU target.
    Cpu,
}

/// What `oxccl init-bench` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitBenchConfig {
    /// Ranks, one process each.
    pub procs: usize,
    /// Timed communicator inits per backend.
    pub iters: usize,
    /// Also time NCCL's `ncclCommInitRank` (CUDA only).
    pub compare_nccl: bool,
    pub target: Target,
}

impl InitBenchConfig {
    /// Checks the configuration against `ngpu` visible CUDA devices and returns whether the ranks
    /// run on CUDA. Errors (`InvalidArgument`, naming the option and the accepted range):
    /// `--procs` outside 1..=ngpu on CUDA (one GPU per process) or 1..=64 on the CPU target,
    /// `--iters` outside 1..=10000, CUDA asked for without a GPU, `--compare nccl` without GPUs.
    pub fn validate(&self, ngpu: usize) -> Result<bool> {
        let gpu = match self.target {
            Target::Cuda if ngpu == 0 => {
                return Err(Error::invalid(
                    "--backend cuda: no CUDA GPU is visible (no driver or no device); use --backend cpu",
                ));
            }
            Target::Cuda => true,
            Target::Auto => ngpu > 0,
            Target::Cpu => false,
        };
        if self.compare_nccl && !gpu {
            return Err(Error::invalid(
                "--compare nccl needs GPUs: NCCL does not run on the CPU target, and no CUDA GPU is in use \
                 (none visible, or --backend cpu)",
            ));
        }
        let (limit, what) = if gpu {
            (ngpu, "one process per visible GPU")
        } else {
            (MAX_CPU_PROCS, "CPU-target ranks")
        };
        if self.procs == 0 || self.procs > limit {
            return Err(Error::invalid(format!(
                "--procs {} is out of range (accepted: 1..={limit}, {what})",
                self.procs
            )));
        }
        if self.iters == 0 || self.iters > MAX_ITERS {
            return Err(Error::invalid(format!(
                "--iters {} is out of range (accepted: 1..={MAX_ITERS})",
                self.iters
            )));
        }
        Ok(gpu)
    }
}

/// Median, minimum and maximum of some samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// The middle sample, or the mean of the two middle ones for an even count.
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Statistics of `samples`; `None` when empty or when one is NaN.
pub fn stats(samples: &[f64]) -> Option<Stats> {
    if samples.is_empty() || samples.iter().any(|s| s.is_nan()) {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    Some(Stats {
        median,
        min: s[0],
        max: s[n - 1],
    })
}

/// What rank 0 reports: init times per iteration in milliseconds (each the slowest rank's).
#[derive(Clone, Debug, PartialEq)]
pub struct InitBenchResult {
    pub nranks: usize,
    /// The devices, as the table header names them (e.g. `2 x NVIDIA H200`, `CPU target`).
    pub devices: String,
    /// oxccl's `Comm::init_rank`, ms per iteration, in order.
    pub oxccl_ms: Vec<f64>,
    /// NCCL's `ncclCommInitRank`, ms per iteration, when compared.
    pub nccl_ms: Option<Vec<f64>>,
    /// NCCL's version string, when compared.
    pub nccl_version: Option<String>,
}

/// Which communicator one timed iteration creates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lib {
    Oxccl,
    Nccl,
}

/// One timed iteration: a fresh id from rank 0, a control barrier, the init, a control barrier
/// (the time, in ms, ends here), then the destroy and a last barrier.
fn time_one(ctl: &Bootstrap, me: &ChildRank, lib: Lib) -> Result<f64> {
    match lib {
        Lib::Oxccl => {
            let id = share_id(ctl, || Ok(get_unique_id()?.to_bytes()))?;
            let id = UniqueId::from_bytes(&id)?;
            ctl.barrier()?;
            let t = Instant::now();
            let comm = Comm::init_rank(me.nranks, &id, me.rank, me.device)?;
            ctl.barrier()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            comm.destroy()?;
            ctl.barrier()?;
            Ok(ms)
        }
        Lib::Nccl => {
            let Device::Cuda(ordinal) = me.device else {
                return Err(Error::invalid("NCCL needs a CUDA device"));
            };
            let id = share_id(ctl, crate::nccl::unique_id)?;
            ctl.barrier()?;
            let t = Instant::now();
            let comm = crate::nccl::NcclComms::init_rank(me.nranks, &id, me.rank, ordinal)?;
            ctl.barrier()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            drop(comm);
            ctl.barrier()?;
            Ok(ms)
        }
    }
}

/// Per iteration, the largest of every rank's samples (`per_rank[r][i]`): `Remote` when ranks
/// report different counts.
fn slowest(per_rank: &[Vec<f64>]) -> Result<Vec<f64>> {
    let n = per_rank.first().map_or(0, Vec::len);
    if let Some((r, v)) = per_rank.iter().enumerate().find(|(_, v)| v.len() != n) {
        return Err(Error::Remote(format!(
            "rank {r} reported {} samples, rank 0 {n}",
            v.len()
        )));
    }
    Ok((0..n)
        .map(|i| per_rank.iter().map(|v| v[i]).fold(f64::MIN, f64::max))
        .collect())
}

fn encode(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn decode(rank: usize, b: &[u8]) -> Result<Vec<f64>> {
    if !b.len().is_multiple_of(8) {
        return Err(Error::Remote(format!(
            "rank {rank} sent {} bytes of samples",
            b.len()
        )));
    }
    Ok(b.chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect())
}

/// Runs this rank's part of the benchmark: joins the control bootstrap, creates (and makes
/// current) the CUDA context, then `cfg.iters` timed inits of oxccl (alternating with NCCL's when
/// `cfg.compare_nccl`). Returns the result on rank 0, `None` on the others.
///
/// Errors: `InvalidArgument` for `--compare nccl` on a CPU-target rank; NCCL missing or failing
/// (`System`); any error of [`Comm::init_rank`] / destroy or of the control bootstrap.
pub fn run_rank(me: &ChildRank, cfg: &InitBenchConfig) -> Result<Option<InitBenchResult>> {
    if cfg.compare_nccl && !me.device.is_cuda() {
        return Err(Error::invalid(
            "--compare nccl needs GPUs: NCCL does not run on the CPU target",
        ));
    }
    let nccl_version = if cfg.compare_nccl {
        Some(crate::nccl::version_string(crate::nccl::version()?))
    } else {
        None
    };
    let ctl = Bootstrap::init(&me.id, me.rank, me.nranks)?;
    let device_name = match me.device {
        Device::Cuda(o) => {
            let ctx = crate::cuda::Context::get(o)?;
            ctx.bind()?;
            ctx.name()?
        }
        Device::Cpu(_) => "CPU-target device".to_string(),
    };
    let libs: &[Lib] = if cfg.compare_nccl {
        &[Lib::Oxccl, Lib::Nccl]
    } else {
        &[Lib::Oxccl]
    };
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(cfg.iters); libs.len()];
    for i in 0..cfg.iters {
        for (k, &lib) in libs.iter().enumerate() {
            let ms = time_one(&ctl, me, lib)?;
            tracing::debug!(target: "oxccl::perf", rank = me.rank, iter = i, ?lib, ms, "communicator init");
            samples[k].push(ms);
        }
    }
    let mut combined = Vec::with_capacity(libs.len());
    for s in &samples {
        let all = ctl.allgather(&encode(s))?;
        let per_rank = all
            .iter()
            .enumerate()
            .map(|(r, b)| decode(r, b))
            .collect::<Result<Vec<_>>>()?;
        combined.push(slowest(&per_rank)?);
    }
    ctl.barrier()?;
    if me.rank != 0 {
        return Ok(None);
    }
    let mut combined = combined.into_iter();
    Ok(Some(InitBenchResult {
        nranks: me.nranks,
        devices: format!("{} x {device_name}", me.nranks),
        oxccl_ms: combined.next().unwrap_or_default(),
        nccl_ms: combined.next(),
        nccl_version,
    }))
}

/// The table rank 0 prints: a header, one row per backend (`backend iters median_ms min_ms
/// max_ms first_ms` then every sample in ms), and with NCCL the ratio of the medians.
pub fn format_table(r: &InitBenchResult) -> String {
    let mut out = format!(
        "# oxccl init-bench (oxccl {}): communicator init, {} ranks in {} processes on {}\n",
        env!("CARGO_PKG_VERSION"),
        r.nranks,
        r.nranks,
        r.devices
    );
    if let Some(v) = &r.nccl_version {
        out += &format!("# NCCL {v}\n");
    }
    out +=
        "# time per init: from a barrier before the call to a barrier after it returns on every rank (ms)\n";
    out += &format!(
        "# {:<8} {:>6} {:>10} {:>10} {:>10} {:>10}  samples\n",
        "backend", "iters", "median_ms", "min_ms", "max_ms", "first_ms"
    );
    let row = |name: &str, ms: &[f64]| -> String {
        let Some(s) = stats(ms) else {
            return format!("  {name:<8} {:>6} {:>10}\n", ms.len(), "N/A");
        };
        let all: Vec<String> = ms.iter().map(|x| format!("{x:.3}")).collect();
        format!(
            "  {name:<8} {:>6} {:>10.3} {:>10.3} {:>10.3} {:>10.3}  {}\n",
            ms.len(),
            s.median,
            s.min,
            s.max,
            ms[0],
            all.join(" ")
        )
    };
    out += &row("oxccl", &r.oxccl_ms);
    if let Some(n) = &r.nccl_ms {
        out += &row("nccl", n);
        if let (Some(o), Some(n)) = (stats(&r.oxccl_ms), stats(n))
            && n.median > 0.0
        {
            let ratio = o.median / n.median;
            out += &format!(
                "# ratio oxccl/nccl of the medians: {ratio:.3} ({})\n",
                if ratio <= 1.0 {
                    "oxccl is no slower"
                } else {
                    "oxccl is slower"
                }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(procs: usize, iters: usize, compare_nccl: bool, target: Target) -> InitBenchConfig {
        InitBenchConfig {
            procs,
            iters,
            compare_nccl,
            target,
        }
    }

    #[test]
    fn validate_picks_the_device_kind_and_names_bad_options() {
        // Auto: CPU target without GPUs, CUDA with; Cpu: CPU target even with GPUs.
        assert!(!cfg(2, 10, false, Target::Auto).validate(0).unwrap());
        assert!(cfg(2, 10, true, Target::Auto).validate(2).unwrap());
        assert!(!cfg(2, 10, false, Target::Cpu).validate(2).unwrap());
        let e = |c: InitBenchConfig, ngpu| c.validate(ngpu).unwrap_err().to_string();
        assert!(e(cfg(2, 10, true, Target::Auto), 0).contains("--compare nccl needs GPUs"));
        assert!(e(cfg(2, 10, true, Target::Cpu), 2).contains("--compare nccl needs GPUs"));
        assert!(e(cfg(2, 10, false, Target::Cuda), 0).contains("no CUDA GPU is visible"));
        assert_eq!(
            e(cfg(3, 10, false, Target::Cuda), 2),
            "invalid argument: --procs 3 is out of range (accepted: 1..=2, one process per visible GPU)"
        );
        assert_eq!(
            e(cfg(65, 10, false, Target::Cpu), 0),
            "invalid argument: --procs 65 is out of range (accepted: 1..=64, CPU-target ranks)"
        );
        assert_eq!(
            e(cfg(2, 0, false, Target::Cpu), 0),
            "invalid argument: --iters 0 is out of range (accepted: 1..=10000)"
        );
    }

    #[test]
    fn stats_median_min_max() {
        // Odd count: the middle of the sorted samples {1, 2, 9} is 2.
        assert_eq!(
            stats(&[9.0, 1.0, 2.0]),
            Some(Stats {
                median: 2.0,
                min: 1.0,
                max: 9.0
            })
        );
        // Even count: mean of the two middle values of {1, 2, 4, 8}: (2 + 4) / 2 = 3.
        assert_eq!(stats(&[8.0, 4.0, 2.0, 1.0]).unwrap().median, 3.0);
        assert_eq!(stats(&[]), None);
        assert_eq!(stats(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn slowest_rank_per_iteration() {
        assert_eq!(
            slowest(&[vec![1.0, 5.0], vec![2.0, 3.0]]).unwrap(),
            vec![2.0, 5.0]
        );
        assert!(slowest(&[vec![1.0], vec![]]).is_err());
        assert_eq!(decode(0, &encode(&[1.5, -2.0])).unwrap(), vec![1.5, -2.0]);
        assert!(decode(1, &[0; 7]).is_err());
    }

    #[test]
    fn child_env_round_trip_and_errors() {
        let id = UniqueId::from_comm_id("127.0.0.1:29500").unwrap();
        let hex = to_hex(&id.to_bytes());
        let env = |vars: Vec<(&'static str, String)>| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        let ok = ChildRank::from_lookup(env(vec![
            (ENV_RANK, "1".into()),
            (ENV_NRANKS, "2".into()),
            (ENV_ID, hex.clone()),
            (ENV_GPU, "0".into()),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((ok.rank, ok.nranks, ok.id, ok.device), (1, 2, id, Device::Cpu(1)));
        assert!(ChildRank::from_lookup(env(vec![])).unwrap().is_none());
        let e = ChildRank::from_lookup(env(vec![
            (ENV_RANK, "2".into()),
            (ENV_NRANKS, "2".into()),
            (ENV_ID, hex.clone()),
            (ENV_GPU, "0".into()),
        ]))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument: OXCCL_PROC_RANK=2 is out of range for OXCCL_PROC_NRANKS=2 (accepted: 0..2)"
        );
        let e = ChildRank::from_lookup(env(vec![
            (ENV_RANK, "0".into()),
            (ENV_NRANKS, "2".into()),
            (ENV_ID, "zz".into()),
            (ENV_GPU, "0".into()),
        ]))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument: OXCCL_PROC_ID=\"zz\" is not hex bytes"
        );
    }

    #[test]
    fn table_rows_and_ratio() {
        let r = InitBenchResult {
            nranks: 2,
            devices: "2 x GPU".into(),
            oxccl_ms: vec![30.0, 10.0, 20.0],
            nccl_ms: Some(vec![40.0, 40.0, 40.0]),
            nccl_version: Some("2.28.9".into()),
        };
        let t = format_table(&r);
        let rows: Vec<&str> = t.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            rows,
            [
                "  oxccl         3     20.000     10.000     30.000     30.000  30.000 10.000 20.000",
                "  nccl          3     40.000     40.000     40.000     40.000  40.000 40.000 40.000",
            ]
        );
        // 20 / 40 = 0.5.
        assert!(
            t.ends_with("# ratio oxccl/nccl of the medians: 0.500 (oxccl is no slower)\n"),
            "{t}"
        );
        assert!(t.contains("# NCCL 2.28.9\n"), "{t}");
    }
}
