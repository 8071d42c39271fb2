//! Trees: the tree graph of one node (NCCL's `ncclTopoCompute` for
//! `NCCL_TOPO_PATTERN_BALANCED_TREE`, a chain through the node's GPUs per channel) and the
//! double binary tree across nodes (`src/graph/trees.cc`: `ncclGetBtree`, `ncclGetDtree`),
//! joined per channel as NCCL's `ncclTopoPreset` + `connectTrees` (`src/graph/connect.cc`) do.
//!
//! Within a node each channel is a chain `c[0] → c[1] → … → c[k-1]`: `c[i]`'s parent is
//! `c[i-1]` and its first child `c[i+1]`. Across nodes, node `n`'s chain head `c[0]` connects to
//! the parent node, and the child nodes attach to `c[1]` and `c[0]` (balanced tree: child 0 on
//! the second GPU, child 1 on the first), both to `c[1]` (split tree) or both to `c[0]` (tree),
//! always to the child node's head. Tree 0 is [`btree`] over the nodes, tree 1 its mirror (even
//! node counts) or its shift by one (odd counts), so that with an even node count every node is
//! interior in exactly one tree and a leaf in the other; with an odd count node 0 is interior
//! in both and every other node in exactly one. NCCL runs tree 0 on channel `c` and tree 1 on
//! channel `c + nChannels`.
use super::search::{Graph, GraphRequest, Pattern, search_graph};
use crate::error::{Error, Result};
use crate::topo::System;

/// Most children of a rank in a tree: two nodes below plus one GPU of its own node
/// (`NCCL_MAX_TREE_ARITY`).
pub const MAX_TREE_ARITY: usize = 3;

/// One rank's place in one tree of one channel (NCCL's `ncclTree`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tree {
    /// Approximate depth of the tree: ranks per node − 1 + floor(log2(nodes)) (NCCL's
    /// `connectTrees` estimate).
    pub depth: i32,
    /// Parent rank, -1 at the root.
    pub up: i32,
    /// Child ranks, -1 for none; filled from index 0.
    pub down: [i32; MAX_TREE_ARITY],
}

impl Tree {
    /// The children, without the -1 slots.
    pub fn children(&self) -> impl Iterator<Item = usize> + '_ {
        self.down.iter().filter_map(|&d| usize::try_from(d).ok())
    }
}

/// One node's place in a binary tree over `nranks` nodes: parent, two children (-1 for none)
/// and whether it is its parent's child 0 or 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BtreeNode {
    /// Parent, -1 at the root.
    pub up: i32,
    /// First child (smaller index), -1 for none.
    pub down0: i32,
    /// Second child, -1 for none.
    pub down1: i32,
    /// 0 when this node is its parent's `down0`, 1 when `down1` (`parentChildType`).
    pub child_type: u8,
}

/// NCCL's `ncclGetBtree`: node `rank`'s place in the binary tree over `nranks` nodes rooted at
/// 0, which alternates leaves and interior nodes (odd ranks are leaves). Node 0 has one child:
/// the highest power of two below `nranks`.
///
/// A node's lowest set bit `b` decides: its parent is `(rank ^ b) | (b << 1)` (or `rank ^ b`
/// when that is out of range), its children `rank - b/2` and `rank + b/2` (the latter halved
/// towards `rank` until in range). Errors: `InvalidArgument` unless `rank < nranks`.
pub fn btree(nranks: usize, rank: usize) -> Result<BtreeNode> {
    if rank >= nranks {
        return Err(Error::invalid(format!(
            "btree: rank {rank} is not below nranks {nranks} (accepted 0..{nranks})"
        )));
    }
    let (n, r) = (nranks as i64, rank as i64);
    let mut bit = 1i64;
    while bit < n {
        if bit & r != 0 {
            break;
        }
        bit <<= 1;
    }
    if r == 0 {
        return Ok(BtreeNode {
            up: -1,
            down0: -1,
            down1: if n > 1 { (bit >> 1) as i32 } else { -1 },
            child_type: 0,
        });
    }
    let mut up = (r ^ bit) | (bit << 1);
    if up >= n {
        up = r ^ bit;
    }
    let child_type = u8::from(r >= up);
    let mut lowbit = bit >> 1;
    let down0 = if lowbit == 0 { -1 } else { r - lowbit };
    let mut down1 = if lowbit == 0 { -1 } else { r + lowbit };
    while down1 >= n {
        down1 = if lowbit == 0 { -1 } else { r + lowbit };
        lowbit >>= 1;
    }
    Ok(BtreeNode {
        up: up as i32,
        down0: down0 as i32,
        down1: down1 as i32,
        child_type,
    })
}

/// NCCL's `ncclGetDtree`: node `rank`'s place in the two trees of the double binary tree over
/// `nranks` nodes. Tree 0 is [`btree`]; tree 1 is its mirror (`nranks - 1 - x`) when `nranks`
/// is even, its shift by one (`x + 1 mod nranks`) when odd. Roots: 0, and `nranks - 1` (even)
/// or 1 (odd) — see [`dtree_roots`]. Errors: `InvalidArgument` unless `rank < nranks`.
pub fn dtree(nranks: usize, rank: usize) -> Result<[BtreeNode; 2]> {
    let t0 = btree(nranks, rank)?;
    let t1 = if nranks % 2 == 1 {
        let shifted = (rank + nranks - 1) % nranks;
        let b = btree(nranks, shifted)?;
        let map = |x: i32| if x == -1 { -1 } else { (x + 1) % nranks as i32 };
        BtreeNode {
            up: map(b.up),
            down0: map(b.down0),
            down1: map(b.down1),
            child_type: b.child_type,
        }
    } else {
        let b = btree(nranks, nranks - 1 - rank)?;
        let map = |x: i32| if x == -1 { -1 } else { nranks as i32 - 1 - x };
        BtreeNode {
            up: map(b.up),
            down0: map(b.down0),
            down1: map(b.down1),
            child_type: b.child_type,
        }
    };
    Ok([t0, t1])
}

/// NCCL's `ncclGetDtreeRoots`: the root nodes of tree 0 and tree 1.
pub fn dtree_roots(nranks: usize) -> [usize; 2] {
    let r1 = if nranks % 2 == 1 && nranks > 1 {
        1
    } else {
        nranks.saturating_sub(1)
    };
    [0, r1]
}

/// The trees of one channel for a communicator spanning `node_chains.len()` nodes: for every
/// rank, its [`Tree`] in tree 0 (NCCL's channel `c`) and tree 1 (channel `c + nChannels`),
/// indexed by rank. `node_chains[n]` is node `n`'s chain for this channel (its tree graph's
/// `intra` order, global ranks); `pattern` is the tree graph's pattern, which says where the
/// child nodes attach (NCCL's `ncclTopoPreset` `treeToChild0/1` and `connectTrees`).
///
/// A one-GPU chain attaches everything to its only GPU (NCCL's search makes such graphs plain
/// trees). Errors: `InvalidArgument` for no nodes, an empty chain, `Pattern::Ring`, or ranks
/// that are not exactly 0..nranks-1 once each.
pub fn double_binary_tree(node_chains: &[Vec<usize>], pattern: Pattern) -> Result<[Vec<Tree>; 2]> {
    let nnodes = node_chains.len();
    if nnodes == 0 {
        return Err(Error::invalid(
            "double_binary_tree: node_chains is empty (need at least 1 node)",
        ));
    }
    if pattern == Pattern::Ring {
        return Err(Error::invalid(
            "double_binary_tree: pattern is RING, accepted BALANCED_TREE, SPLIT_TREE or TREE",
        ));
    }
    if let Some(n) = node_chains.iter().position(|c| c.is_empty()) {
        return Err(Error::invalid(format!(
            "double_binary_tree: node {n}'s chain is empty"
        )));
    }
    let nranks: usize = node_chains.iter().map(Vec::len).sum();
    let mut seen = vec![false; nranks];
    for &r in node_chains.iter().flatten() {
        if r >= nranks || seen[r] {
            return Err(Error::invalid(format!(
                "double_binary_tree: rank {r} is out of 0..{nranks} or listed twice (each rank once)"
            )));
        }
        seen[r] = true;
    }
    let depth = (nranks / nnodes) as i32 - 1 + nnodes.ilog2() as i32;
    let empty = Tree {
        depth,
        up: -1,
        down: [-1; MAX_TREE_ARITY],
    };
    let mut trees = [vec![empty; nranks], vec![empty; nranks]];
    // Intra-node chains (ncclTopoPreset): the same in both trees.
    for chain in node_chains {
        for (i, &r) in chain.iter().enumerate() {
            for t in trees.iter_mut() {
                t[r].up = if i == 0 { -1 } else { chain[i - 1] as i32 };
                t[r].down[0] = chain.get(i + 1).map_or(-1, |&d| d as i32);
            }
        }
    }
    let (c0, c1) = match pattern {
        Pattern::BalancedTree => (1, 0),
        Pattern::SplitTree => (1, 1),
        _ => (0, 0),
    };
    let head = |n: usize| node_chains[n][0];
    let child0 = |n: usize| node_chains[n][c0.min(node_chains[n].len() - 1)];
    let child1 = |n: usize| node_chains[n][c1.min(node_chains[n].len() - 1)];
    for node in 0..nnodes {
        let dt = dtree(nnodes, node)?;
        for (t, b) in dt.iter().enumerate() {
            let tree = &mut trees[t];
            if b.up != -1 {
                let parent = b.up as usize;
                let up = if b.child_type == 0 {
                    child0(parent)
                } else {
                    child1(parent)
                };
                tree[head(node)].up = up as i32;
            }
            for (d, attach) in [(b.down0, child0(node)), (b.down1, child1(node))] {
                if d == -1 {
                    continue;
                }
                let slot = tree[attach].down.iter().position(|&x| x < 0).ok_or_else(|| {
                    Error::Internal(format!(
                        "double_binary_tree: rank {attach} already has {MAX_TREE_ARITY} children {:?}",
                        tree[attach].down
                    ))
                })?;
                tree[attach].down[slot] = head(d as usize) as i32;
            }
        }
    }
    Ok(trees)
}

/// Builds the tree graph of `system` as NCCL does after the ring graph: a balanced tree (on
/// sm90+ possibly ending as a plain tree) with exactly `ring_channels` channels
/// ([`GraphRequest::tree`]), through the system's NETs when `inter` (a communicator spanning
/// several nodes). Errors as [`search_graph`]; `ring_channels` must be 1..=64.
pub fn search_trees(system: &System, ring_channels: usize, inter: bool) -> Result<Graph> {
    search_graph(system, &GraphRequest::tree(ring_channels, inter))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn btree_of_fourteen_matches_nccls_drawing() {
        // trees.cc's illustration for 14 ranks: 0 -> 8; 8 -> 4, 12; 4 -> 2, 6; 12 -> 10, 13;
        // 2 -> 1, 3; 6 -> 5, 7; 10 -> 9, 11.
        let b = |r| btree(14, r).unwrap();
        assert_eq!((b(0).up, b(0).down0, b(0).down1), (-1, -1, 8));
        assert_eq!((b(8).up, b(8).down0, b(8).down1), (0, 4, 12));
        assert_eq!((b(12).up, b(12).down0, b(12).down1), (8, 10, 13));
        assert_eq!((b(13).up, b(13).down0, b(13).down1), (12, -1, -1));
        assert_eq!(b(13).child_type, 1);
        assert_eq!(b(10).child_type, 0);
        assert!(btree(3, 3).is_err());
    }
}
