//! System topology: NCCL's topology XML, the system graph of GPUs, PCI switches, NVSwitches,
//! CPUs and NICs with typed, bandwidth-annotated links, and the paths between them.
//!
//! | module | what | mirrors in NCCL |
//! |---|---|---|
//! | [`xml`] | read / write the `<system version="1">` XML (`NCCL_TOPO_FILE`, `NCCL_TOPO_DUMP_FILE`), detection merge points | `src/graph/xml.cc` |
pub mod xml;

pub use xml::{GpuFill, NetFill, NvLinkFill, Xml, XmlNode};
