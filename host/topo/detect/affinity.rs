//! CPU affinity of GPUs for host threads (NCCL's `ncclTopoGetCpuAffinity` in
//! `src/graph/topo.cc`): CPU sets as Linux prints them, the CPUs local to a PCI device, and
//! binding the init thread and its helper threads near their GPU.
use super::{T, normalize_bus_id};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::fmt;
use std::path::{Path, PathBuf};

/// A set of CPU cores (logical CPU numbers), ascending, without duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuSet {
    cores: Vec<usize>,
}

impl CpuSet {
    /// The set of `cores` (sorted, duplicates dropped).
    pub fn from_cores(cores: impl IntoIterator<Item = usize>) -> CpuSet {
        let mut cores: Vec<usize> = cores.into_iter().collect();
        cores.sort_unstable();
        cores.dedup();
        CpuSet { cores }
    }

    /// Parses a Linux CPU list (`cpulist`, `local_cpulist`): comma-separated cores and
    /// inclusive ranges, e.g. `0-15,32-47`; an empty string (or only a newline) is the empty
    /// set. Errors: `InvalidArgument` naming the list and the bad part (not a number, or a
    /// range whose end is below its start).
    pub fn parse_list(list: &str) -> Result<CpuSet> {
        let mut cores = Vec::new();
        for part in list.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || {
                Error::invalid(format!(
                    "CPU list {list:?}: {part:?} is not a core or a range lo-hi with lo <= hi"
                ))
            };
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let lo: usize = lo.trim().parse().map_err(|_| bad())?;
                    let hi: usize = hi.trim().parse().map_err(|_| bad())?;
                    if hi < lo {
                        return Err(bad());
                    }
                    cores.extend(lo..=hi);
                }
                None => cores.push(part.parse().map_err(|_| bad())?),
            }
        }
        Ok(CpuSet::from_cores(cores))
    }

    /// Parses a Linux CPU mask (`cpumap`, `local_cpus`, NCCL's `affinity`): 32-bit hex words
    /// separated by commas, most significant first. Errors: `InvalidArgument` naming the mask.
    pub fn parse_mask(mask: &str) -> Result<CpuSet> {
        let mut cores = Vec::new();
        for (w, word) in mask.trim().rsplit(',').enumerate() {
            let bits = u32::from_str_radix(word.trim(), 16).map_err(|_| {
                Error::invalid(format!("CPU mask {mask:?}: {word:?} is not a 32-bit hex word"))
            })?;
            cores.extend((0..32).filter(|b| bits & (1 << b) != 0).map(|b| w * 32 + b));
        }
        Ok(CpuSet::from_cores(cores))
    }

    /// The cores, ascending.
    pub fn cores(&self) -> &[usize] {
        &self.cores
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.cores.is_empty()
    }

    /// The cores of both sets.
    pub fn intersect(&self, other: &CpuSet) -> CpuSet {
        CpuSet {
            cores: self
                .cores
                .iter()
                .copied()
                .filter(|c| other.cores.contains(c))
                .collect(),
        }
    }

    /// The set as a Linux CPU mask (as `cpumap` prints it): 32-bit words of 8 hex digits,
    /// most significant first, as many as the highest core needs (`"00000000"` when empty).
    pub fn to_mask(&self) -> String {
        let words = self.cores.last().map_or(1, |&c| c / 32 + 1);
        let mut w = vec![0u32; words];
        for &c in &self.cores {
            w[c / 32] |= 1 << (c % 32);
        }
        w.iter()
            .rev()
            .map(|x| format!("{x:08x}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The set as a Linux CPU list, e.g. `0-15,32-47`.
    pub fn to_list(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut i = 0;
        while i < self.cores.len() {
            let mut j = i;
            while j + 1 < self.cores.len() && self.cores[j + 1] == self.cores[j] + 1 {
                j += 1;
            }
            out.push(if i == j {
                self.cores[i].to_string()
            } else {
                format!("{}-{}", self.cores[i], self.cores[j])
            });
            i = j + 1;
        }
        out.join(",")
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_list())
    }
}

/// The CPUs local to the PCI device `bus_id` under sysfs root `sys_root`: its
/// `local_cpulist` (or `local_cpus` mask), else the `cpulist` of its `numa_node`. `None` when
/// sysfs says neither (a VM without NUMA information) or the bus id is malformed.
pub fn pci_local_cpus(sys_root: &Path, bus_id: &str) -> Option<CpuSet> {
    let b = normalize_bus_id(bus_id)?;
    let dir = sys_root.join("bus/pci/devices").join(&b);
    let read = |p: PathBuf| std::fs::read_to_string(p).ok().filter(|s| !s.trim().is_empty());
    if let Some(l) = read(dir.join("local_cpulist"))
        && let Ok(s) = CpuSet::parse_list(&l)
        && !s.is_empty()
    {
        return Some(s);
    }
    if let Some(m) = read(dir.join("local_cpus"))
        && let Ok(s) = CpuSet::parse_mask(&m)
        && !s.is_empty()
    {
        return Some(s);
    }
    let numa: i64 = read(dir.join("numa_node"))?.trim().parse().ok()?;
    if numa < 0 {
        return None;
    }
    let l = read(sys_root.join(format!("devices/system/node/node{numa}/cpulist")))?;
    CpuSet::parse_list(&l).ok().filter(|s| !s.is_empty())
}

/// The CPU set of the NUMA node of the CUDA device at `bus_id` on this machine (`/sys`), as
/// [`pci_local_cpus`]; `None` when unknown.
pub fn gpu_local_cpus(bus_id: &str) -> Option<CpuSet> {
    pci_local_cpus(Path::new("/sys"), bus_id)
}

/// The calling thread's CPU affinity (`sched_getaffinity`); `None` when it cannot be read.
pub fn thread_affinity() -> Option<CpuSet> {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a writable cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return None;
    }
    let max = libc::CPU_SETSIZE as usize;
    // SAFETY: `set` is initialised and every index is below CPU_SETSIZE.
    Some(CpuSet::from_cores(
        (0..max).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }),
    ))
}

/// Binds the calling thread to `cpus` (`sched_setaffinity`). Errors: `InvalidArgument` for an
/// empty set or cores beyond `CPU_SETSIZE` (1024); `System` with the OS error (e.g. none of
/// the cores is allowed in this cgroup).
pub fn bind_thread(cpus: &CpuSet) -> Result<()> {
    let max = libc::CPU_SETSIZE as usize;
    if cpus.is_empty() || cpus.cores.iter().any(|&c| c >= max) {
        return Err(Error::invalid(format!(
            "cpus {cpus}: binding needs a non-empty set of cores in 0..{max}"
        )));
    }
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in &cpus.cores {
        // SAFETY: c < CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(Error::System(format!(
            "sched_setaffinity to cpus {cpus}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// The CPUs a thread working for the GPU at `bus_id` should run on (NCCL's
/// `ncclTopoGetCpuAffinity`): the GPU's local CPUs ([`gpu_local_cpus`]) within the calling
/// thread's current affinity, or the GPU's alone with `NCCL_IGNORE_CPU_AFFINITY=1`. `None`
/// when the GPU's CPUs are unknown or the intersection is empty (the affinity is then left
/// as it is).
pub fn gpu_affinity(bus_id: &str) -> Option<CpuSet> {
    near_affinity(gpu_local_cpus(bus_id)?)
}

fn near_affinity(local: CpuSet) -> Option<CpuSet> {
    let ignore = crate::params::env_var("IGNORE_CPU_AFFINITY").is_some_and(|(_, v)| v.trim() == "1");
    let set = match (ignore, thread_affinity()) {
        (false, Some(cur)) => local.intersect(&cur),
        _ => local,
    };
    (!set.is_empty()).then_some(set)
}

/// Binds the calling thread near the GPU at `bus_id` ([`gpu_affinity`]); returns the set
/// bound, `None` when the affinity is not known or binding failed (both debug-logged, the
/// thread then keeps its affinity).
pub fn bind_near_gpu(bus_id: &str) -> Option<CpuSet> {
    let Some(set) = gpu_affinity(bus_id) else {
        tracing::debug!(target: T, bus_id, "CPU affinity of the GPU unknown: thread not bound");
        return None;
    };
    match bind_thread(&set) {
        Ok(()) => {
            tracing::debug!(target: T, bus_id, cpus = %set, "thread bound near its GPU");
            Some(set)
        }
        Err(e) => {
            tracing::debug!(target: T, bus_id, "thread not bound near its GPU: {e}");
            None
        }
    }
}

thread_local! {
    static NEAR: RefCell<Option<CpuSet>> = const { RefCell::new(None) };
}

/// The CPU set helper threads started now by the calling thread should bind to: the set of
/// the [`AffinityGuard`] active on this thread, if any. Capture it before spawning and hand it
/// to [`bind_helper_thread`] in the new thread.
pub fn helper_affinity() -> Option<CpuSet> {
    NEAR.with(|n| n.borrow().clone())
}

/// First call of a helper thread (bootstrap listener, proxy): binds the thread to `near`
/// (what [`helper_affinity`] returned in the thread that started it), so it runs near its
/// GPU as NCCL's threads do; does nothing for `None`. A failure is a debug message.
pub fn bind_helper_thread(near: Option<&CpuSet>) {
    if let Some(set) = near {
        match bind_thread(set) {
            Ok(()) => {
                tracing::debug!(target: T, cpus = %set, thread = ?std::thread::current().name(), "helper thread bound near its GPU")
            }
            Err(e) => tracing::debug!(target: T, "helper thread not bound: {e}"),
        }
    }
}

/// Binds the calling thread near a set of GPUs while it lives and restores the thread's
/// previous affinity when dropped (NCCL binds its init thread near the GPU during
/// `initTransportsRank` and restores it at the end). While it lives, [`helper_affinity`]
/// returns the set.
#[derive(Debug)]
pub struct AffinityGuard {
    saved: Option<CpuSet>,
    prev_hint: Option<CpuSet>,
    set: Option<CpuSet>,
}

impl AffinityGuard {
    /// Binds to the CPUs near the GPUs at `bus_ids` when they all have the same local CPUs
    /// (one NUMA node; [`gpu_affinity`]); otherwise, or when unknown, leaves the affinity as
    /// it is (the guard then does nothing).
    pub fn near_gpus(bus_ids: &[&str]) -> AffinityGuard {
        let sets: Vec<Option<CpuSet>> = bus_ids.iter().map(|b| gpu_local_cpus(b)).collect();
        let common = match sets.first() {
            Some(Some(first)) if sets.iter().all(|s| s.as_ref() == Some(first)) => {
                near_affinity(first.clone())
            }
            _ => None,
        };
        if common.is_none() && !bus_ids.is_empty() {
            tracing::debug!(target: T, ?bus_ids, "CPU affinity of the GPUs unknown or not shared: init thread not bound");
        }
        AffinityGuard::bind(common)
    }

    /// Binds the calling thread to `set` (nothing for `None`) until the guard drops.
    pub fn bind(set: Option<CpuSet>) -> AffinityGuard {
        let saved = thread_affinity();
        let set = set.filter(|s| match bind_thread(s) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(target: T, "init thread not bound: {e}");
                false
            }
        });
        let prev_hint = NEAR.with(|n| {
            let mut n = n.borrow_mut();
            let prev = n.clone();
            if set.is_some() {
                *n = set.clone();
            }
            prev
        });
        if let Some(s) = &set {
            tracing::debug!(target: T, cpus = %s, "init thread bound near its GPU");
        }
        AffinityGuard {
            saved,
            prev_hint,
            set,
        }
    }

    /// The set the thread is bound to, `None` when the guard did not bind.
    pub fn cpus(&self) -> Option<&CpuSet> {
        self.set.as_ref()
    }
}

impl Drop for AffinityGuard {
    fn drop(&mut self) {
        if self.set.is_none() {
            return;
        }
        NEAR.with(|n| *n.borrow_mut() = self.prev_hint.take());
        if let Some(s) = &self.saved
            && let Err(e) = bind_thread(s)
        {
            tracing::debug!(target: T, "cannot restore the thread's CPU affinity: {e}");
        }
    }
}
