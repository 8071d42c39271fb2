//! Intra-node ring graphs: NCCL's `ncclTopoCompute` (`src/graph/search.cc`) for the ring
//! pattern (`NCCL_TOPO_PATTERN_RING`) on one node, as a single-node communicator runs it (NET
//! nodes trimmed). The search itself is [`search_graph`], described in
//! [`search`](super::search); with NETs (several nodes) use it directly with
//! [`GraphRequest::ring(true)`](super::GraphRequest::ring).
use super::search::{GraphRequest, Pattern, search_graph};
use crate::error::{Error, Result};
use crate::topo::{PathType, System};

pub use super::search::speed_array_intra;

/// A ring graph: `nchannels` rings, each visiting every GPU of the node once.
#[derive(Clone, Debug, PartialEq)]
pub struct RingGraph {
    /// Number of channels (`graph->nChannels`), equal to `rings.len()`.
    pub nchannels: usize,
    /// Bandwidth each channel may use on its hops, GB/s (`graph->bwIntra`, the XML
    /// `speedintra`).
    pub speed_intra: f64,
    /// Farthest path type allowed between consecutive GPUs (`graph->typeIntra`).
    pub type_intra: PathType,
    /// Per channel, the GPU ranks in ring order; the last one sends back to the first
    /// (`graph->intra`).
    pub rings: Vec<Vec<usize>>,
}

/// Builds the intra-node ring graph of `system` with at most `max_channels` channels (NCCL
/// asks for `MAXCHANNELS / 2` = 32): NCCL's `ncclTopoCompute` for `NCCL_TOPO_PATTERN_RING`
/// followed by `ncclTopoDupChannels`, as described in [`search`](super::search). NET nodes are
/// ignored.
///
/// When no ring fits at any speed, NCCL's fallback is returned: one channel in rank order at
/// 0.1 GB/s over `SYS`. Errors: `InvalidArgument` for `max_channels` outside 1..=64, a system
/// without GPUs, or two GPUs with one rank; `Internal` for a path whose route does not follow
/// the system's links.
pub fn search_rings(system: &System, max_channels: usize) -> Result<RingGraph> {
    if max_channels == 0 {
        return Err(Error::invalid(
            "search_rings: max_channels must be at least 1 (accepted 1..=64)",
        ));
    }
    let req = GraphRequest {
        max_channels,
        ..GraphRequest::ring(false)
    };
    let g = search_graph(system, &req)?;
    debug_assert_eq!(g.pattern, Pattern::Ring);
    Ok(RingGraph {
        nchannels: g.nchannels,
        speed_intra: g.speed_intra,
        type_intra: g.type_intra,
        rings: g.intra,
    })
}
