//! Topology and graphs, host logic only: NCCL's topology XML on the fixtures of tests/topo/
//! (parsing, the system graph and its paths: `topo`), detection on fake sysfs/procfs trees and
//! NVML data (`topo_detect`), and the ring and tree search (`graph`).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod graph;
mod topo;
mod topo_detect;
