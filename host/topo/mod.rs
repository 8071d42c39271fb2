//! System topology: NCCL's topology XML, the system graph of GPUs, PCI switches, NVSwitches,
//! CPUs and NICs with typed, bandwidth-annotated links, and the paths between them.
//!
//! | module | what | mirrors in NCCL |
//! |---|---|---|
//! | [`xml`] | read / write the `<system version="1">` XML (`NCCL_TOPO_FILE`, `NCCL_TOPO_DUMP_FILE`), detection merge points | `src/graph/xml.cc` |
//! | [`system`] | the system graph: nodes, links, bandwidths (GB/s) | `src/graph/topo.cc` |
//! | [`paths`] | path type and bottleneck bandwidth between GPUs, NICs, CPUs | `src/graph/paths.cc` |
//! | `local.rs` | this machine's topology, detected and built once per communicator init | `ncclTopoGetSystem` in `src/graph/topo.cc` |
//! | [`detect`] | the XML of the real machine from NVML and sysfs (GPUs, NVLinks, PCI tree, CPUs, NICs); GPU CPU affinity and thread binding | `ncclTopoGetSystem` in `src/graph/topo.cc`, `ncclTopoFill*` / `ncclTopoGetXmlFrom*` in `src/graph/xml.cc` |
//!
//! ```no_run
//! let sys = oxccl::topo::System::from_xml_file("topo.xml")?;
//! print!("{}", sys.describe()); // nodes, then the nvidia-smi-style GPU/NIC path matrix
//! # Ok::<(), oxccl::Error>(())
//! ```
mod describe;
pub mod detect;
pub(crate) mod local;
pub mod paths;
pub mod system;
pub mod xml;

pub(crate) use local::LocalTopo;
pub use paths::{Path, PathOptions, PathType, Paths};
pub use system::{
    Cpu, CpuArch, CpuModel, CpuVendor, Gpu, Link, LinkType, Net, Node, NodeId, NodeKind, NodeType, PciInfo,
    System, nvlink_bw,
};
pub use xml::{GpuFill, NetFill, NvLinkFill, Xml, XmlNode};
