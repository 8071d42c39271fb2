//! Joining every rank's graph into the communicator's rings: the per-rank graph information
//! NCCL all-gathers (`AllGather3` in `src/init.cc`: each rank's `graphInfo` and `topoRanks`), its
//! merge (the minimum channel count and speeds over ranks, the farthest path types), and the ring
//! of every channel built from each node's searched intra-node order (`ncclTopoPreset`,
//! `connectRings` and `ncclTopoPostset` in `src/graph/connect.cc`), with each rank's view of it
//! (`setupChannel` in `src/init.cc`: `prev`, `next`, `index` and the `userRanks` rotation).
//!
//! ```
//! use oxccl::graph::connect::{ChannelRings, global_rings};
//! // Two nodes of two ranks; node 0 searched the order 1, 0 and node 1 the order 2, 3.
//! let nodes = vec![vec![vec![1, 0]], vec![vec![2, 3]]];
//! let rings = global_rings(&nodes, 4, 1)?;
//! assert_eq!(rings[0], vec![1, 0, 2, 3]);
//! let ch = ChannelRings::new(rings, 4)?;
//! assert_eq!(ch.user_ranks(0, 0), vec![0, 2, 3, 1]);
//! assert_eq!((ch.prev(0, 0), ch.next(0, 0)), (1, 2));
//! # Ok::<(), oxccl::Error>(())
//! ```
use super::search::Pattern;
use crate::error::{Error, Result};
use crate::topo::PathType;

/// One graph's summary as every rank contributes it to the merge (NCCL's `graphInfo[a]` in
/// `struct allGatherInfo`): its pattern, channel count, speeds and path types.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphInfo {
    /// The graph's pattern (`pattern`).
    pub pattern: Pattern,
    /// Channels this rank's search found (`nChannels`).
    pub nchannels: usize,
    /// Per-channel bandwidth on GPU-to-GPU hops, GB/s (`bwIntra`).
    pub speed_intra: f64,
    /// Per-channel bandwidth on NET hops, GB/s (`bwInter`).
    pub speed_inter: f64,
    /// Farthest GPU-to-GPU path type (`typeIntra`).
    pub type_intra: PathType,
    /// Farthest GPU-to-NET path type (`typeInter`).
    pub type_inter: PathType,
    /// `crossNic` (0, 1 or 2).
    pub cross_nic: u32,
}

impl GraphInfo {
    /// The summary of a searched graph.
    pub fn of(graph: &super::Graph) -> GraphInfo {
        GraphInfo {
            pattern: graph.pattern,
            nchannels: graph.nchannels,
            speed_intra: graph.speed_intra,
            speed_inter: graph.speed_inter,
            type_intra: graph.type_intra,
            type_inter: graph.type_inter,
            cross_nic: graph.cross_nic,
        }
    }

    /// Merges the summaries of all ranks as NCCL does after `AllGather3`: the fewest channels,
    /// the lowest speeds, the farthest path types and the largest `crossNic`; the pattern is the
    /// first rank's (every rank searches with the same request). Errors: `InvalidArgument` for an
    /// empty list; `Internal` naming the rank whose pattern differs from rank 0's.
    pub fn merge(infos: &[GraphInfo]) -> Result<GraphInfo> {
        let Some(first) = infos.first() else {
            return Err(Error::invalid(
                "GraphInfo::merge: infos is empty (accepted: one per rank)",
            ));
        };
        let mut m = first.clone();
        for (r, g) in infos.iter().enumerate().skip(1) {
            if g.pattern != m.pattern {
                return Err(Error::Internal(format!(
                    "graph merge: rank {r} searched pattern {} but rank 0 searched {}",
                    g.pattern, m.pattern
                )));
            }
            m.nchannels = m.nchannels.min(g.nchannels);
            m.speed_intra = m.speed_intra.min(g.speed_intra);
            m.speed_inter = m.speed_inter.min(g.speed_inter);
            m.type_intra = m.type_intra.max(g.type_intra);
            m.type_inter = m.type_inter.max(g.type_inter);
            m.cross_nic = m.cross_nic.max(g.cross_nic);
        }
        Ok(m)
    }
}

/// What one rank contributes to the ring merge (NCCL's `allGather3Data`, ring part): the ring
/// graph's summary and its node's searched intra-node orders (global ranks, one list per
/// channel), from which NCCL's `ncclTopoPreset` derives the rank's `ringRecv`/`ringSend`/
/// `ringPrev`/`ringNext`.
#[derive(Clone, Debug, PartialEq)]
pub struct RankGraphInfo {
    /// Index of the rank's node (host) in the communicator, counted from the node of rank 0.
    pub node: usize,
    /// The ring graph's summary.
    pub ring: GraphInfo,
    /// Per channel, the node's ranks in ring order (`graph->intra`); `ring.nchannels` lists.
    pub intra: Vec<Vec<usize>>,
}

impl RankGraphInfo {
    /// A one-line text form for the bootstrap all-gather (parsed back by
    /// [`RankGraphInfo::decode`]).
    pub fn encode(&self) -> String {
        let g = &self.ring;
        let intra: Vec<String> = self
            .intra
            .iter()
            .map(|ch| ch.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(","))
            .collect();
        format!(
            "node={} pattern={} nch={} bwintra={} bwinter={} typeintra={} typeinter={} crossnic={} intra={}",
            self.node,
            g.pattern.id(),
            g.nchannels,
            g.speed_intra,
            g.speed_inter,
            g.type_intra.as_str(),
            g.type_inter.as_str(),
            g.cross_nic,
            intra.join(";")
        )
    }

    /// Parses [`RankGraphInfo::encode`]'s form. Errors: `Internal` naming the field of a
    /// malformed record.
    pub fn decode(text: &str) -> Result<RankGraphInfo> {
        let bad = |what: &str| Error::Internal(format!("graph info record {text:?}: bad or missing {what}"));
        let field = |k: &str| {
            text.split(' ')
                .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
                .ok_or_else(|| bad(k))
        };
        let num = |k: &str| field(k)?.parse::<usize>().map_err(|_| bad(k));
        let speed = |k: &str| field(k)?.parse::<f64>().map_err(|_| bad(k));
        let path = |k: &str| {
            let v = field(k)?;
            PathType::ALL
                .into_iter()
                .find(|p| p.as_str() == v)
                .ok_or_else(|| bad(k))
        };
        let pattern = match num("pattern")? {
            1 => Pattern::BalancedTree,
            2 => Pattern::SplitTree,
            3 => Pattern::Tree,
            4 => Pattern::Ring,
            _ => return Err(bad("pattern")),
        };
        let intra = field("intra")?
            .split(';')
            .filter(|s| !s.is_empty())
            .map(|ch| {
                ch.split(',')
                    .map(|r| r.parse::<usize>().map_err(|_| bad("intra")))
                    .collect()
            })
            .collect::<Result<Vec<Vec<usize>>>>()?;
        let nchannels = num("nch")?;
        if intra.len() != nchannels {
            return Err(bad("intra (one order per channel)"));
        }
        Ok(RankGraphInfo {
            node: num("node")?,
            ring: GraphInfo {
                pattern,
                nchannels,
                speed_intra: speed("bwintra")?,
                speed_inter: speed("bwinter")?,
                type_intra: path("typeintra")?,
                type_inter: path("typeinter")?,
                cross_nic: num("crossnic")? as u32,
            },
            intra,
        })
    }
}

/// The global ring of each of `nchannels` channels from each node's intra-node orders
/// (`node_intra[node][channel]`, global ranks; nodes in ring order), NCCL's `connectRings`: node
/// `k`'s last rank sends to node `k + 1`'s first, the last node's last to node 0's first. Each
/// ring starts at node 0's first rank. A node with fewer searched channels than `nchannels`
/// repeats its channels (`c % count`), as `ncclTopoPostset` duplicates them.
///
/// Errors: `InvalidArgument` when `nchannels` is 0 or a node has no channel; `Internal` naming
/// the channel when its ring does not hold each of the `nranks` ranks exactly once.
pub fn global_rings(
    node_intra: &[Vec<Vec<usize>>],
    nranks: usize,
    nchannels: usize,
) -> Result<Vec<Vec<usize>>> {
    if nchannels == 0 {
        return Err(Error::invalid("global_rings: nchannels must be at least 1"));
    }
    if let Some(n) = node_intra.iter().position(|n| n.is_empty()) {
        return Err(Error::invalid(format!(
            "global_rings: node {n} has no searched channel (accepted: at least 1)"
        )));
    }
    let rings: Vec<Vec<usize>> = (0..nchannels)
        .map(|c| {
            node_intra
                .iter()
                .flat_map(|n| n[c % n.len()].iter().copied())
                .collect()
        })
        .collect();
    for (c, ring) in rings.iter().enumerate() {
        check_ring(c, ring, nranks)?;
    }
    Ok(rings)
}

/// `Internal` naming channel `c` unless `ring` holds each of `0..nranks` exactly once.
fn check_ring(c: usize, ring: &[usize], nranks: usize) -> Result<()> {
    let mut seen = vec![false; nranks];
    for &r in ring {
        match seen.get_mut(r) {
            Some(s) if !*s => *s = true,
            Some(_) => {
                return Err(Error::Internal(format!(
                    "channel {c}: rank {r} appears twice in ring {ring:?}"
                )));
            }
            None => {
                return Err(Error::Internal(format!(
                    "channel {c}: ring {ring:?} holds rank {r}, outside 0..{nranks}"
                )));
            }
        }
    }
    if ring.len() != nranks {
        return Err(Error::Internal(format!(
            "channel {c}: ring {ring:?} holds {} of {nranks} ranks",
            ring.len()
        )));
    }
    Ok(())
}

/// Every channel's ring and each rank's view of it: NCCL's `ringPrev`/`ringNext` arrays after
/// `ncclTopoPostset` and `setupChannel`'s `ring.prev`, `ring.next`, `ring.index` and `userRanks`.
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelRings {
    nranks: usize,
    rings: Vec<Vec<usize>>,
    /// `[channel][rank]`: position of the rank in `rings[channel]`.
    pos: Vec<Vec<usize>>,
}

impl ChannelRings {
    /// The rings in rank order (0 → 1 → … → n−1 → 0) on each of `nchannels` channels.
    pub fn rank_order(nranks: usize, nchannels: usize) -> ChannelRings {
        let ring: Vec<usize> = (0..nranks).collect();
        ChannelRings {
            nranks,
            pos: vec![ring.clone(); nchannels],
            rings: vec![ring; nchannels],
        }
    }

    /// Takes one ring per channel (each a cycle over `0..nranks`). Errors: `InvalidArgument` for
    /// no channel; `Internal` naming the channel whose ring does not hold each rank once.
    pub fn new(rings: Vec<Vec<usize>>, nranks: usize) -> Result<ChannelRings> {
        if rings.is_empty() {
            return Err(Error::invalid(
                "ChannelRings::new: rings is empty (accepted: one per channel)",
            ));
        }
        let mut pos = Vec::with_capacity(rings.len());
        for (c, ring) in rings.iter().enumerate() {
            check_ring(c, ring, nranks)?;
            let mut p = vec![0; nranks];
            for (i, &r) in ring.iter().enumerate() {
                p[r] = i;
            }
            pos.push(p);
        }
        let out = ChannelRings { nranks, rings, pos };
        out.check_links()?;
        Ok(out)
    }

    /// The communicator's rings for `nchannels` channels from every rank's graph information
    /// (indexed by rank): the merged channel count `m` (fewest over ranks), each node's orders
    /// taken from its lowest rank, nodes ordered by index, channel `c` on searched channel
    /// `c % m` (NCCL's doubling and `copyChannels`). Errors: `InvalidArgument` for no rank or no
    /// channel, or node indices that are not `0..nnodes` with each node present; `Internal` for a
    /// rank missing from its node's orders, or a ring that is not a cycle over all ranks (naming
    /// the channel).
    pub fn from_infos(infos: &[RankGraphInfo], nchannels: usize) -> Result<ChannelRings> {
        let nranks = infos.len();
        let merged = GraphInfo::merge(&infos.iter().map(|i| i.ring.clone()).collect::<Vec<_>>())?;
        if merged.nchannels == 0 || nchannels == 0 {
            return Err(Error::invalid(format!(
                "ring channels: merged searched channels {} and communicator channels {nchannels} must be at least 1",
                merged.nchannels
            )));
        }
        let nnodes = infos.iter().map(|i| i.node + 1).max().unwrap_or(0);
        let mut node_intra: Vec<Vec<Vec<usize>>> = Vec::with_capacity(nnodes);
        for n in 0..nnodes {
            let Some((_, first)) = infos.iter().enumerate().find(|(_, i)| i.node == n) else {
                return Err(Error::invalid(format!(
                    "ring channels: no rank on node {n} (node indices must be 0..{nnodes}, each present)"
                )));
            };
            node_intra.push(first.intra[..merged.nchannels].to_vec());
        }
        for (r, info) in infos.iter().enumerate() {
            if !info.intra.iter().all(|ch| ch.contains(&r)) {
                return Err(Error::Internal(format!(
                    "rank {r} is missing from one of its own searched channel orders {:?}",
                    info.intra
                )));
            }
            if !node_intra[info.node].iter().all(|ch| ch.contains(&r)) {
                return Err(Error::Internal(format!(
                    "rank {r} is missing from node {}'s searched channel orders",
                    info.node
                )));
            }
        }
        ChannelRings::new(global_rings(&node_intra, nranks, nchannels)?, nranks)
    }

    /// `Internal` naming the channel unless, on every channel, `next(prev(r)) == r` for all ranks
    /// (the property NCCL checks when it connects rings).
    fn check_links(&self) -> Result<()> {
        for c in 0..self.rings.len() {
            for r in 0..self.nranks {
                if self.next(c, self.prev(c, r)) != r || self.prev(c, self.next(c, r)) != r {
                    return Err(Error::Internal(format!(
                        "channel {c}: prev/next of rank {r} are inconsistent in ring {:?}",
                        self.rings[c]
                    )));
                }
            }
        }
        Ok(())
    }

    /// These rings, unless they are rank order and the ranks of a host are not contiguous: then
    /// one ring through each host's ranks in rank order, the hosts in the order of their lowest
    /// rank, on every channel (NCCL's rings visit a node's GPUs together, so a ring crosses
    /// between hosts once per host rather than at every rank of interleaved hosts). `hosts[r]` is
    /// rank `r`'s host id. Rank order is what a communicator without topology information gets
    /// ([`ChannelRings::rank_order`]); searched rings are already grouped by node. Errors: as
    /// [`ChannelRings::new`] (`hosts` must name every rank).
    pub fn grouped_by_host(self, hosts: &[&str]) -> Result<ChannelRings> {
        let n = self.nranks();
        if !self.is_rank_order() || hosts.len() != n {
            return Ok(self);
        }
        let contiguous = (1..n).all(|r| hosts[r] == hosts[r - 1] || !hosts[..r - 1].contains(&hosts[r]));
        if contiguous {
            return Ok(self);
        }
        let mut order = Vec::with_capacity(n);
        for r in 0..n {
            if !order.contains(&r) {
                order.extend((r..n).filter(|&q| hosts[q] == hosts[r]));
            }
        }
        ChannelRings::new(vec![order; self.nchannels()], n)
    }

    /// Number of channels.
    pub fn nchannels(&self) -> usize {
        self.rings.len()
    }

    /// The first `nchannels` channels (all of them when there are fewer).
    pub fn first_channels(mut self, nchannels: usize) -> ChannelRings {
        self.rings.truncate(nchannels);
        self.pos.truncate(nchannels);
        self
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Channel `c`'s ring from its first rank.
    pub fn ring(&self, c: usize) -> &[usize] {
        &self.rings[c]
    }

    /// The rank `rank` receives from on channel `c` (`ring.prev`).
    pub fn prev(&self, c: usize, rank: usize) -> usize {
        let n = self.nranks;
        self.rings[c][(self.pos[c][rank] + n - 1) % n]
    }

    /// The rank `rank` sends to on channel `c` (`ring.next`).
    pub fn next(&self, c: usize, rank: usize) -> usize {
        self.rings[c][(self.pos[c][rank] + 1) % self.nranks]
    }

    /// `rank`'s ring distance from rank 0 on channel `c` (`ring.index`, `setupChannel`).
    pub fn index(&self, c: usize, rank: usize) -> usize {
        let n = self.nranks;
        (self.pos[c][rank] + n - self.pos[c][0]) % n
    }

    /// Channel `c`'s ring starting at `rank` (`ring.userRanks`, `setupChannel`'s rotation).
    pub fn user_ranks(&self, c: usize, rank: usize) -> Vec<usize> {
        let n = self.nranks;
        (0..n)
            .map(|i| self.rings[c][(self.pos[c][rank] + i) % n])
            .collect()
    }

    /// Whether every channel's ring is rank order (0 → 1 → … → n−1 → 0).
    pub fn is_rank_order(&self) -> bool {
        (0..self.rings.len()).all(|c| (0..self.nranks).all(|r| self.next(c, r) == (r + 1) % self.nranks))
    }

    /// Whether every channel has the same ring (as a cycle).
    pub fn single_ring(&self) -> bool {
        (1..self.rings.len()).all(|c| (0..self.nranks).all(|r| self.next(c, r) == self.next(0, r)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(nch: usize, intra: f64, inter: f64, ti: PathType, te: PathType, cross: u32) -> GraphInfo {
        GraphInfo {
            pattern: Pattern::Ring,
            nchannels: nch,
            speed_intra: intra,
            speed_inter: inter,
            type_intra: ti,
            type_inter: te,
            cross_nic: cross,
        }
    }

    #[test]
    fn rank_order_is_grouped_by_host_when_hosts_interleave() {
        // Hosts a b a b c b: one ring 0 2 1 3 5 4 on every channel (host a, then b, then c).
        let hosts = ["a", "b", "a", "b", "c", "b"];
        let g = ChannelRings::rank_order(6, 2).grouped_by_host(&hosts).unwrap();
        for c in 0..2 {
            assert_eq!(g.ring(c), [0, 2, 1, 3, 5, 4]);
        }
        assert_eq!((g.next(0, 2), g.prev(0, 0)), (1, 4));
        // Contiguous hosts, or rings not in rank order (searched, already grouped): unchanged.
        let same = ChannelRings::rank_order(4, 1)
            .grouped_by_host(&["a", "a", "b", "b"])
            .unwrap();
        assert!(same.is_rank_order());
        let searched = ChannelRings::new(vec![vec![0, 2, 1, 3]], 4).unwrap();
        let kept = searched.clone().grouped_by_host(&["a", "b", "b", "a"]).unwrap();
        assert_eq!(kept.ring(0), searched.ring(0));
    }

    #[test]
    fn merge_takes_minima_and_farthest_types() {
        // Three ranks: channel counts 12, 4, 8 -> 4; intra speeds 40, 20, 30 -> 20; inter 12, 24,
        // 6 -> 6; types NVL/PIX, PIX/SYS, NVL/PXB -> farthest PIX (4) and SYS (9); crossNic max 2.
        let m = GraphInfo::merge(&[
            info(12, 40.0, 12.0, PathType::Nvl, PathType::Pix, 0),
            info(4, 20.0, 24.0, PathType::Pix, PathType::Sys, 2),
            info(8, 30.0, 6.0, PathType::Nvl, PathType::Pxb, 1),
        ])
        .unwrap();
        assert_eq!(m, info(4, 20.0, 6.0, PathType::Pix, PathType::Sys, 2));
        assert!(GraphInfo::merge(&[]).is_err());
        let mut tree = info(4, 1.0, 1.0, PathType::Nvl, PathType::Pix, 0);
        tree.pattern = Pattern::Tree;
        let e = GraphInfo::merge(&[info(4, 1.0, 1.0, PathType::Nvl, PathType::Pix, 0), tree]).unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
    }

    #[test]
    fn encode_decode_round_trip() {
        let i = RankGraphInfo {
            node: 1,
            ring: info(2, 20.0, 12.5, PathType::Sys, PathType::Pix, 2),
            intra: vec![vec![4, 6, 5, 7], vec![4, 5, 7, 6]],
        };
        let text = i.encode();
        assert_eq!(
            text,
            "node=1 pattern=4 nch=2 bwintra=20 bwinter=12.5 typeintra=SYS typeinter=PIX crossnic=2 intra=4,6,5,7;4,5,7,6"
        );
        assert_eq!(RankGraphInfo::decode(&text).unwrap(), i);
        let e = RankGraphInfo::decode("node=1 pattern=4 nch=1 bwintra=20 intra=0,1").unwrap_err();
        assert!(e.to_string().contains("bwinter"), "{e}");
    }

    #[test]
    fn rings_across_nodes_and_user_ranks() {
        // Two nodes of 4 ranks, 2 searched channels on node 0 and 1 on node 1; 3 channels used:
        // channel c takes node 0's order c % 2 and node 1's order c % 1 (merged count is 1, so
        // via from_infos every channel takes channel 0; here global_rings directly).
        let nodes = vec![vec![vec![0, 2, 1, 3], vec![0, 1, 3, 2]], vec![vec![5, 4, 6, 7]]];
        let rings = global_rings(&nodes, 8, 3).unwrap();
        assert_eq!(
            rings,
            vec![
                vec![0, 2, 1, 3, 5, 4, 6, 7],
                vec![0, 1, 3, 2, 5, 4, 6, 7],
                vec![0, 2, 1, 3, 5, 4, 6, 7]
            ]
        );
        let ch = ChannelRings::new(rings, 8).unwrap();
        // Channel 0: 3 -> 5 crosses nodes; 7 -> 0 closes the ring.
        assert_eq!(
            (ch.prev(0, 5), ch.next(0, 3), ch.next(0, 7), ch.prev(0, 0)),
            (3, 5, 0, 7)
        );
        assert_eq!(ch.user_ranks(0, 4), vec![4, 6, 7, 0, 2, 1, 3, 5]);
        // index: distance from rank 0 along the ring (rank 4 is at position 5).
        assert_eq!(ch.index(0, 4), 5);
        assert_eq!(ch.index(0, 0), 0);
        assert!(!ch.is_rank_order());
        assert!(!ch.single_ring());
        let ro = ChannelRings::rank_order(5, 2);
        assert!(ro.is_rank_order() && ro.single_ring());
        assert_eq!(ro.user_ranks(1, 3), vec![3, 4, 0, 1, 2]);
        assert_eq!(ro.index(1, 3), 3);
    }

    #[test]
    fn from_infos_uses_merged_channel_count() {
        // Node 0 (ranks 0,1) found 2 channels, node 1 (ranks 2,3) found 1: merged 1, so all 4
        // communicator channels repeat channel 0 of each node.
        let g = |n| info(n, 20.0, 20.0, PathType::Pix, PathType::Pix, 2);
        let n0 = vec![vec![1, 0], vec![0, 1]];
        let n1 = vec![vec![3, 2]];
        let infos = vec![
            RankGraphInfo {
                node: 0,
                ring: g(2),
                intra: n0.clone(),
            },
            RankGraphInfo {
                node: 0,
                ring: g(2),
                intra: n0,
            },
            RankGraphInfo {
                node: 1,
                ring: g(1),
                intra: n1.clone(),
            },
            RankGraphInfo {
                node: 1,
                ring: g(1),
                intra: n1,
            },
        ];
        let ch = ChannelRings::from_infos(&infos, 4).unwrap();
        assert_eq!(ch.nchannels(), 4);
        for c in 0..4 {
            assert_eq!(ch.ring(c), &[1, 0, 3, 2]);
        }
        assert!(ch.single_ring());
    }

    #[test]
    fn bad_rings_name_the_channel() {
        let e = ChannelRings::new(vec![vec![0, 1, 2], vec![0, 1, 1]], 3).unwrap_err();
        assert!(
            matches!(e, Error::Internal(_)) && e.to_string().contains("channel 1"),
            "{e}"
        );
        let e = ChannelRings::new(vec![vec![0, 1]], 3).unwrap_err();
        assert!(
            e.to_string().contains("channel 0") && e.to_string().contains("2 of 3"),
            "{e}"
        );
        let e = global_rings(&[vec![vec![0, 5]]], 2, 1).unwrap_err();
        assert!(e.to_string().contains("outside 0..2"), "{e}");
    }
}
