//! What NVML says about a GPU, for topology detection: its NVML index, compute capability,
//! the remote ends of its NVLinks and its C2C links (the NVML queries of NCCL's
//! `ncclTopoGetXmlFromGpu` in `src/graph/xml.cc`).
//!
//! [`NvmlSource`] is the interface detection reads; [`NvmlProbe`] is NVML itself
//! (`libnvidia-ml.so.1` loaded at run time with `nvml-wrapper`), a list of [`NvmlGpu`] a fake
//! in tests.
use super::T;
use crate::topo::xml::bus_id_to_int;
use std::fmt;
use std::sync::OnceLock;

/// What NVML says about one GPU: what `ncclTopoGetXmlFromGpu` asks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML device index (`nvmlDeviceGetIndex`; NCCL's `dev`).
    pub index: u32,
    /// The GPU's PCI bus id as NVML gives it (`0000:07:00.0`, any case).
    pub bus_id: String,
    /// Compute capability × 10 (`nvmlDeviceGetCudaComputeCapability`), when known.
    pub sm: Option<u32>,
    /// For every NVLink that supports P2P and is up, the PCI bus id of its remote end
    /// (`nvmlDeviceGetNvLinkRemotePciInfo`), one entry per link.
    pub nvlinks: Vec<String>,
    /// Chip-to-chip links to the CPU (Grace Hopper), when NVML reports any that are up.
    pub c2c: Option<C2cLinks>,
}

/// C2C links of a GPU to its CPU (`<c2c bw count>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct C2cLinks {
    /// Links that are up.
    pub count: u32,
    /// Bandwidth of one link in MB/s (`NVML_FI_DEV_C2C_LINK_GET_MAX_BW`).
    pub bw_mbps: u32,
}

/// A source of NVML data: [`NvmlProbe`] on a real machine, a list of [`NvmlGpu`] in tests.
pub trait NvmlSource {
    /// Every GPU NVML knows, by NVML index: `(index, bus id)`.
    fn devices(&self) -> Vec<(u32, String)>;
    /// What NVML says about the GPU at `bus_id` (compared as a number); `None` when NVML does
    /// not know it.
    fn probe(&self, bus_id: &str) -> Option<NvmlGpu>;
}

impl NvmlSource for [NvmlGpu] {
    fn devices(&self) -> Vec<(u32, String)> {
        self.iter().map(|g| (g.index, g.bus_id.clone())).collect()
    }

    fn probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        let want = bus_id_to_int(bus_id)?;
        self.iter()
            .find(|g| bus_id_to_int(&g.bus_id) == Some(want))
            .cloned()
    }
}

impl NvmlSource for Vec<NvmlGpu> {
    fn devices(&self) -> Vec<(u32, String)> {
        self.as_slice().devices()
    }

    fn probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        self.as_slice().probe(bus_id)
    }
}

/// NVML loaded at run time (`libnvidia-ml.so.1` through `nvml-wrapper`).
///
/// Answers are remembered for the life of the probe: a GPU's NVLinks, C2C links and compute
/// capability do not change while a process runs, and querying them (one NVML call per link and
/// field, 18 links per H200) cost tens of milliseconds at every communicator init, which
/// detects the topology twice (the affinity hook, then the init's `LocalTopo` for
/// `NCCL_P2P_LEVEL` paths and the ring search).
pub struct NvmlProbe {
    nvml: nvml_wrapper::Nvml,
    /// [`NvmlSource::devices`], once asked.
    devices: OnceLock<Vec<(u32, String)>>,
    /// [`NvmlSource::probe`] answers by bus id (as a number).
    probes: std::sync::Mutex<std::collections::HashMap<i64, Option<NvmlGpu>>>,
}

impl fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NvmlProbe")
    }
}

impl NvmlProbe {
    /// Loads and initialises NVML (`nvmlInit_v2`); `None`, with a debug message, when the
    /// library is missing or the driver does not answer.
    pub fn load() -> Option<NvmlProbe> {
        match nvml_wrapper::Nvml::init() {
            Ok(nvml) => Some(NvmlProbe {
                nvml,
                devices: OnceLock::new(),
                probes: std::sync::Mutex::new(std::collections::HashMap::new()),
            }),
            Err(e) => {
                tracing::debug!(target: T, "NVML not available ({e}): topology detection continues without NVLink information");
                None
            }
        }
    }

    /// The process-wide NVML, loaded on first use (`None` when it cannot be loaded).
    pub fn shared() -> Option<&'static NvmlProbe> {
        static NVML: OnceLock<Option<NvmlProbe>> = OnceLock::new();
        NVML.get_or_init(NvmlProbe::load).as_ref()
    }

    /// A device field value of scope `scope` (`nvmlDeviceGetFieldValues` with a scope id, which
    /// `nvml-wrapper` does not expose), as an unsigned integer.
    fn field_u32(&self, dev: &nvml_wrapper::Device<'_>, field: u32, scope: u32) -> Option<u32> {
        use nvml_wrapper_sys::bindings::{nvmlFieldValue_t, nvmlReturn_enum_NVML_SUCCESS};
        let get = self.nvml.lib().nvmlDeviceGetFieldValues.as_ref().ok()?;
        // SAFETY: nvmlFieldValue_t is a plain C struct (integers and a union of numbers): all
        // zeroes is a valid value.
        let mut v: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
        v.fieldId = field;
        v.scopeId = scope;
        // SAFETY: `dev` is a live handle of this NVML instance and `v` one writable value.
        let r = unsafe { get(dev.handle(), 1, &mut v) };
        if r != nvmlReturn_enum_NVML_SUCCESS || v.nvmlReturn != nvmlReturn_enum_NVML_SUCCESS {
            return None;
        }
        // SAFETY: the field ids read here (NVLink state, C2C count/status/bandwidth) are
        // unsigned-int values.
        Some(unsafe { v.value.uiVal })
    }
}

impl NvmlSource for NvmlProbe {
    fn devices(&self) -> Vec<(u32, String)> {
        self.devices.get_or_init(|| self.query_devices()).clone()
    }

    fn probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        let Some(key) = bus_id_to_int(bus_id) else {
            return self.query_probe(bus_id);
        };
        // A poisoned lock only means another thread panicked mid-insert of a complete value.
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        probes
            .entry(key)
            .or_insert_with(|| self.query_probe(bus_id))
            .clone()
    }
}

impl NvmlProbe {
    /// Every GPU NVML knows (uncached [`NvmlSource::devices`]).
    fn query_devices(&self) -> Vec<(u32, String)> {
        let n = match self.nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(target: T, "NVML: cannot count devices: {e}");
                return Vec::new();
            }
        };
        (0..n)
            .filter_map(|i| {
                let d = self.nvml.device_by_index(i).ok()?;
                Some((i, d.pci_info().ok()?.bus_id))
            })
            .collect()
    }

    /// What NVML says about the GPU at `bus_id` (uncached [`NvmlSource::probe`]).
    fn query_probe(&self, bus_id: &str) -> Option<NvmlGpu> {
        use nvml_wrapper::enum_wrappers::nv_link::Capability;
        use nvml_wrapper::sys_exports::field_id::{
            NVML_FI_DEV_C2C_LINK_COUNT, NVML_FI_DEV_C2C_LINK_GET_MAX_BW, NVML_FI_DEV_C2C_LINK_GET_STATUS,
            NVML_FI_DEV_NVLINK_GET_STATE,
        };
        let dev = match self.nvml.device_by_pci_bus_id(bus_id) {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(target: T, bus_id, "NVML: no device at this bus id ({e})");
                return None;
            }
        };
        let index = dev.index().ok()?;
        let sm = dev
            .cuda_compute_capability()
            .ok()
            .map(|c| (c.major * 10 + c.minor) as u32);
        let mut nvlinks = Vec::new();
        let max_links = sm.map_or(0, max_nvlinks);
        for l in 0..max_links {
            let link = dev.link_wrapper_for(l);
            if !link.has_capability(Capability::P2p).unwrap_or(false) {
                continue;
            }
            // Hopper and later: the link state through a field value, as NCCL does.
            let up = match sm {
                Some(s) if s >= 90 => self
                    .field_u32(&dev, NVML_FI_DEV_NVLINK_GET_STATE, l)
                    .map(|v| v == 1)
                    .or_else(|| link.is_active().ok()),
                _ => link.is_active().ok(),
            };
            if up != Some(true) {
                continue;
            }
            match link.remote_pci_info() {
                Ok(p) => nvlinks.push(p.bus_id.to_lowercase()),
                Err(e) => tracing::debug!(target: T, bus_id, link = l, "NVML: NVLink remote unknown ({e})"),
            }
        }
        let mut c2c = None;
        if sm.is_some_and(|s| s >= 90)
            && let Some(n) = self.field_u32(&dev, NVML_FI_DEV_C2C_LINK_COUNT, 0)
        {
            let (mut count, mut bw) = (0, 0);
            for l in 0..n {
                if self.field_u32(&dev, NVML_FI_DEV_C2C_LINK_GET_STATUS, l) == Some(1)
                    && let Some(b) = self.field_u32(&dev, NVML_FI_DEV_C2C_LINK_GET_MAX_BW, l)
                {
                    bw = b;
                    count += 1;
                }
            }
            if count > 0 {
                c2c = Some(C2cLinks { count, bw_mbps: bw });
            }
        }
        let bus = dev
            .pci_info()
            .map(|p| p.bus_id)
            .unwrap_or_else(|_| bus_id.to_string());
        Some(NvmlGpu {
            index,
            bus_id: bus,
            sm,
            nvlinks,
            c2c,
        })
    }
}

/// NVLinks NCCL probes for a GPU of compute capability `sm` (× 10).
fn max_nvlinks(sm: u32) -> u32 {
    match sm {
        ..60 => 0,
        60..70 => 4,
        70..80 => 6,
        80..90 => 12,
        _ => 18,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvlinks_per_compute_capability() {
        assert_eq!(max_nvlinks(90), 18);
        assert_eq!(max_nvlinks(80), 12);
        assert_eq!(max_nvlinks(70), 6);
        assert_eq!(max_nvlinks(52), 0);
    }
}
