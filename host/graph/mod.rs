//! Graphs of channels over a [`System`](crate::topo::System): the orders in which the GPUs of
//! one node pass data on each channel, and the bandwidth each channel may count on.
//!
//! | module | what | mirrors in NCCL |
//! |---|---|---|
//! | [`rings`] | intra-node ring graphs: per channel, a cycle over all GPUs | `src/graph/search.cc` (`ncclTopoCompute`, ring pattern) |
//!
//! ```no_run
//! let sys = oxccl::topo::System::from_xml_file("topo.xml")?;
//! let graph = oxccl::graph::search_rings(&sys, 32)?;
//! for ring in &graph.rings {
//!     println!("{ring:?} at {} GB/s over {}", graph.speed_intra, graph.type_intra);
//! }
//! # Ok::<(), oxccl::Error>(())
//! ```
pub mod rings;

pub use rings::{RingGraph, search_rings, speed_array_intra};
