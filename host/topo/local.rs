//! This machine's topology for one communicator init (NCCL's `ncclTopoGetSystem`, which
//! `initTransportsRank` runs once per communicator): the `NCCL_TOPO_FILE` document completed by
//! detection from NVML and sysfs, and the system graph built from it, made on first use and kept
//! for the rest of the init. `NCCL_P2P_LEVEL`'s path checks ([`crate::transport::p2p`]) and the
//! ring search (`comm/channel.rs`) share it, so an init detects the machine at most once and
//! builds its system at most once, however many GPU pairs it checks; an init that needs neither
//! builds nothing.
use super::{NodeType, PathOptions, PathType, System, Xml, detect};
use crate::error::Result;
use std::cell::OnceCell;

/// This machine's topology, detected and built at most once per init (see the module docs).
#[derive(Default)]
pub(crate) struct LocalTopo {
    /// The `NCCL_TOPO_FILE` document (or an empty system) completed by detection.
    xml: OnceCell<Xml>,
    /// The system of `xml` with its paths as `ncclTopoComputePaths` computes them before any
    /// P2P-level rerouting (path options with `p2p_level` = `SYS`).
    raw: OnceCell<System>,
}

impl LocalTopo {
    /// The topology document: the `NCCL_TOPO_FILE` document if set (else an empty system),
    /// completed by detection from NVML and sysfs. Errors: the file cannot be read (`System`,
    /// naming it) or is not valid XML (`InvalidArgument`).
    pub(crate) fn xml(&self) -> Result<&Xml> {
        if let Some(xml) = self.xml.get() {
            return Ok(xml);
        }
        let mut xml = Xml::from_env()?.unwrap_or_else(Xml::new_system);
        let nvml = detect::NvmlProbe::shared().map(|n| n as &dyn detect::NvmlSource);
        detect::detect_into(&mut xml, &detect::DetectOptions::from_env(), nvml, None);
        Ok(self.xml.get_or_init(|| xml))
    }

    /// The system of [`LocalTopo::xml`] with raw paths (no P2P-level rerouting). Errors: those of
    /// [`LocalTopo::xml`], and a document that is not a valid topology.
    fn raw_system(&self) -> Result<&System> {
        if let Some(sys) = self.raw.get() {
            return Ok(sys);
        }
        let raw = PathOptions {
            p2p_level: Some(PathType::Sys),
            ..Default::default()
        };
        let sys = System::from_xml_with(self.xml()?.clone(), raw)?;
        Ok(self.raw.get_or_init(|| sys))
    }

    /// A copy of this machine's system with its paths computed with the environment's options
    /// ([`PathOptions::from_env`], as [`System::from_xml`] does), for a caller that changes it
    /// (the ring search trims it to the communicator's GPUs). Errors: those of
    /// [`LocalTopo::xml`], a document that is not a valid topology, bad path variables.
    pub(crate) fn system(&self) -> Result<System> {
        let mut sys = self.raw_system()?.clone();
        sys.set_path_options(PathOptions::from_env()?)?;
        Ok(sys)
    }

    /// The type of the path between the GPUs at PCI bus ids `a` and `b` of this host as
    /// `NCCL_P2P_LEVEL` compares it: `LOC` for one GPU (same bus id, no topology needed);
    /// otherwise the path between them as `ncclTopoComputePaths` computes it before any
    /// P2P-level rerouting: NVLink (direct or through NVSwitches) gives `NVL`, PCI paths `PIX` /
    /// `PXB` / `PHB` / `SYS`. `None` when the topology lacks either GPU (no NVML and no file
    /// entry for it). Errors: those of [`LocalTopo::xml`], a document that is not a valid
    /// topology.
    pub(crate) fn gpu_path(&self, a: &str, b: &str) -> Result<Option<PathType>> {
        if a == b {
            return Ok(Some(PathType::Loc));
        }
        let path = gpu_path_in(self.raw_system()?, a, b);
        tracing::debug!(target: "oxccl::init", from = %a, to = %b, path = ?path.map(|p| p.as_str()), "GPU path type for NCCL_P2P_LEVEL");
        Ok(path)
    }
}

/// The path type from the GPU at `from` to the GPU at `to` (PCI bus ids) in `sys`; `None` when
/// either is not a GPU of `sys`.
pub(crate) fn gpu_path_in(sys: &System, from: &str, to: &str) -> Option<PathType> {
    let gpu = |bus: &str| sys.node_by_bus_id(NodeType::Gpu, bus);
    Some(sys.paths().kind(gpu(from)?, gpu(to)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(file: &str) -> System {
        let path = format!("{}/tests/topo/{file}", env!("CARGO_MANIFEST_DIR"));
        let raw = PathOptions {
            p2p_level: Some(PathType::Sys),
            ..Default::default()
        };
        System::from_xml_with(Xml::from_file(&path).unwrap(), raw).unwrap()
    }

    #[test]
    fn path_types_from_the_topology() {
        // The 2xH200 machine (NCCL's own dump): both GPUs on the NVSwitch -> NVL.
        let h200 = topo("h200x2-nccl-topo.xml");
        assert_eq!(
            gpu_path_in(&h200, "0000:00:06.0", "0000:00:07.0"),
            Some(PathType::Nvl)
        );
        assert_eq!(
            gpu_path_in(&h200, "0000:00:06.0", "0000:00:06.0"),
            Some(PathType::Loc)
        );
        assert_eq!(gpu_path_in(&h200, "0000:00:06.0", "0000:99:00.0"), None);
        // 8 PCIe GPUs, two per PCI switch, two switches per socket: GPUs 0 (11:00.0) and 1
        // (13:00.0) share switch 10:00.0 -> PIX; GPU 2 (31:00.0) is under another switch of the
        // same CPU -> PHB; GPU 4 (51:00.0) is on the other socket -> SYS.
        let pcie = topo("pcie-8gpu-2socket-topo.xml");
        assert_eq!(
            gpu_path_in(&pcie, "0000:11:00.0", "0000:13:00.0"),
            Some(PathType::Pix)
        );
        assert_eq!(
            gpu_path_in(&pcie, "0000:11:00.0", "0000:31:00.0"),
            Some(PathType::Phb)
        );
        assert_eq!(
            gpu_path_in(&pcie, "0000:11:00.0", "0000:51:00.0"),
            Some(PathType::Sys)
        );
    }
}
