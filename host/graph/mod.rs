//! Graphs of channels over a [`System`](crate::topo::System): the orders in which the GPUs of
//! one node pass data on each channel, the bandwidth each channel may count on, and the trees
//! that join nodes.
//!
//! | module | what | mirrors in NCCL |
//! |---|---|---|
//! | [`connect`] | every rank's ring graph merged into the communicator's rings, and each rank's view of them | `AllGather3` in `src/init.cc`, `ncclTopoPreset`/`connectRings`/`ncclTopoPostset` in `src/graph/connect.cc`, `setupChannel` |
//! | [`search`] | the channel search for rings and trees, on one node or through its NETs | `src/graph/search.cc` (`ncclTopoCompute`, `ncclTopoDupChannels`) |
//! | [`rings`] | intra-node ring graphs: per channel, a cycle over all GPUs | `ncclTopoCompute` for `NCCL_TOPO_PATTERN_RING` |
//! | [`trees`] | tree graphs (a chain per node and channel) and the double binary tree across nodes | `ncclTopoCompute` for `NCCL_TOPO_PATTERN_BALANCED_TREE`, `src/graph/trees.cc`, `connectTrees` in `src/graph/connect.cc` |
//!
//! ```no_run
//! let sys = oxccl::topo::System::from_xml_file("topo.xml")?;
//! let graph = oxccl::graph::search_rings(&sys, 32)?;
//! for ring in &graph.rings {
//!     println!("{ring:?} at {} GB/s over {}", graph.speed_intra, graph.type_intra);
//! }
//! let tree = oxccl::graph::search_trees(&sys, graph.nchannels, false)?;
//! // Two nodes running this tree graph: ranks 0-7 on node 0, 8-15 on node 1.
//! let chains: Vec<Vec<usize>> = (0..2)
//!     .map(|n| tree.intra[0].iter().map(|r| n * 8 + r).collect())
//!     .collect();
//! let [tree0, tree1] = oxccl::graph::double_binary_tree(&chains, tree.pattern)?;
//! println!("rank 8: up {} in tree 0, {} in tree 1", tree0[8].up, tree1[8].up);
//! # Ok::<(), oxccl::Error>(())
//! ```
pub mod connect;
pub mod rings;
pub mod search;
pub mod trees;

pub use connect::{ChannelRings, GraphInfo, RankGraphInfo, global_rings};
pub use rings::{RingGraph, search_rings};
pub use search::{Graph, GraphRequest, Pattern, search_graph, speed_array_inter, speed_array_intra};
pub use trees::{
    BtreeNode, MAX_TREE_ARITY, Tree, btree, double_binary_tree, dtree, dtree_roots, search_trees,
};
