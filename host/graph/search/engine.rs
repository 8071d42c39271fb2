//! The search of one channel (NCCL's `ncclTopoSearchRec`, `ncclTopoSearchTryGpu`,
//! `ncclTopoFollowPath` and `ncclTopoSearchNextGpuSort` in `src/graph/search.cc`): the hops
//! between the search's endpoints (GPUs, then NETs) with the bandwidth each takes per link, and
//! the bounded depth-first search that builds a channel at the candidate graph's speed and path
//! types. See the [module docs](super) for the order of tries.
use super::{EPS, Found, MAX_CHANNELS, MAX_STEPS, Params, Pattern};
use crate::topo::{NodeId, PathType};

/// One GPU- or NET-to-GPU/NET hop: its path type both ways, length and the link costs.
#[derive(Clone, Debug)]
pub(super) struct Hop {
    pub(super) kind: PathType,
    pub(super) rev_kind: PathType,
    pub(super) bw: f64,
    pub(super) nhops: usize,
    pub(super) costs: Vec<Cost>,
}

/// Bandwidth a hop takes on one link: `fw` × speed on (node, link), and `rev` × speed on the
/// reverse link where NCCL charges one.
#[derive(Clone, Debug)]
pub(super) struct Cost {
    pub(super) node: usize,
    pub(super) link: usize,
    pub(super) fw: f64,
    pub(super) rev: Option<(usize, usize, f64)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Forced {
    None,
    Pci,
    Replay,
}

pub(super) struct NetInfo {
    pub(super) dev: i32,
    /// (guid, port): NETs sharing both share their bandwidth.
    pub(super) asic_port: (u64, i32),
    pub(super) bw: f64,
}

pub(super) struct Engine<'a> {
    pub(super) ngpus: usize,
    /// CUDA device number of each GPU (NCCL's `gpu.dev`).
    pub(super) devs: Vec<usize>,
    /// Endpoint e < ngpus: the GPU of rank e; e >= ngpus: NET e - ngpus.
    pub(super) ids: Vec<NodeId>,
    pub(super) nets: Vec<NetInfo>,
    pub(super) has_nvs: bool,
    /// `hops[a][b]` between endpoints; `None` when unreachable or a == b.
    pub(super) hops: Vec<Vec<Option<Hop>>>,
    /// Per GPU, `gpuPciBw`: min of its PCI link up and down, GB/s (-1 without one).
    pub(super) gpu_pci_bw: Vec<i64>,
    pub(super) base: &'a [Vec<f64>],
    // Search state.
    pub(super) rem: Vec<Vec<f64>>,
    pub(super) net_rem: Vec<f64>,
    pub(super) p: Params,
    pub(super) steps: usize,
}

/// An endpoint list: the hops of an endpoint pair. GPUs are 0..ngpus, NETs after.
impl Engine<'_> {
    fn is_net(&self, e: usize) -> bool {
        e >= self.ngpus
    }

    fn intra(&self, a: usize, b: usize) -> bool {
        !self.is_net(a) && !self.is_net(b)
    }

    /// NCCL's `ncclTopoFollowPath` with mult 1: checks the type and takes the bandwidth on every
    /// link of the route; on failure takes nothing. `speed_scale` halves the NET speed of a
    /// balanced tree.
    fn follow(&mut self, a: usize, b: usize, speed_scale: f64) -> bool {
        if a == b {
            return true;
        }
        let intra = self.intra(a, b);
        let (speed, max_type) = if intra {
            (self.p.speed_intra, self.p.type_intra)
        } else {
            (self.p.speed_inter * speed_scale, self.p.type_inter)
        };
        let Some(h) = &self.hops[a][b] else {
            return false;
        };
        if h.kind > max_type || (self.p.pattern.is_tree() && h.rev_kind > max_type) {
            return false;
        }
        for c in &h.costs {
            if self.rem[c.node][c.link] + EPS < c.fw * speed {
                return false;
            }
            if let Some((n, l, f)) = c.rev
                && self.rem[n][l] + EPS < f * speed
            {
                return false;
            }
        }
        for c in &h.costs {
            self.rem[c.node][c.link] -= c.fw * speed;
            if let Some((n, l, f)) = c.rev {
                self.rem[n][l] -= f * speed;
            }
        }
        true
    }

    /// Gives back what `follow(a, b, speed_scale)` took.
    fn unfollow(&mut self, a: usize, b: usize, speed_scale: f64) {
        if a == b {
            return;
        }
        let speed = if self.intra(a, b) {
            self.p.speed_intra
        } else {
            self.p.speed_inter * speed_scale
        };
        if let Some(h) = &self.hops[a][b] {
            for c in &h.costs {
                self.rem[c.node][c.link] += c.fw * speed;
                if let Some((n, l, f)) = c.rev {
                    self.rem[n][l] += f * speed;
                }
            }
        }
    }

    fn nhops(&self, a: usize, b: usize) -> usize {
        self.hops[a][b].as_ref().map_or(0, |h| h.nhops)
    }

    /// NCCL's `ncclTopoGetLocal` from endpoint `from` to endpoints of `targets`: those of the
    /// highest path bandwidth, closest type among them.
    fn local(&self, from: usize, targets: std::ops::Range<usize>) -> Vec<usize> {
        let (mut max_bw, mut min_type) = (0.0f64, PathType::Dis);
        let mut out = Vec::new();
        for t in targets {
            let Some(h) = &self.hops[from][t] else {
                continue;
            };
            if h.bw > max_bw + EPS || ((h.bw - max_bw).abs() <= EPS && h.kind < min_type) {
                max_bw = h.bw;
                min_type = h.kind;
                out.clear();
            }
            if (h.bw - max_bw).abs() <= EPS && h.kind == min_type {
                out.push(t);
            }
        }
        out
    }

    /// NCCL's `ncclTopoGetLocalNet`: the NET endpoint GPU `g` uses on `channel`.
    fn local_net(&self, g: usize, channel: usize) -> Option<usize> {
        let nets = self.local(g, self.ngpus..self.ids.len());
        let first = *nets.first()?;
        let gpus = self.local(first, 0..self.ngpus).len().max(1);
        let mut net = self.devs[g];
        if nets.len().is_power_of_two() {
            net = mirror_bits(net, nets.len());
        }
        net += channel % nets.len().div_ceil(gpus);
        Some(nets[net % nets.len()])
    }

    /// NCCL's `ncclTopoSelectNets`: the NETs to try, nearest the GPUs (or GPU `gpu`) first.
    fn select_nets(&self, gpu: Option<usize>) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        let gpus: Vec<usize> = match gpu {
            Some(g) => vec![g],
            None => (0..self.ngpus).collect(),
        };
        for &g in &gpus {
            let mut local: Vec<usize> = Vec::new();
            for c in 0..MAX_CHANNELS {
                let Some(n) = self.local_net(g, c) else {
                    break;
                };
                if local.first() == Some(&n) {
                    break;
                }
                local.push(n);
            }
            for n in local {
                if !out.contains(&n) {
                    out.push(n);
                }
            }
        }
        for t in PathType::ALL {
            if t > self.p.type_inter {
                break;
            }
            for &g in &gpus {
                for n in self.ngpus..self.ids.len() {
                    if self.hops[g][n].as_ref().is_some_and(|h| h.kind == t) && !out.contains(&n) {
                        out.push(n);
                    }
                }
            }
        }
        out
    }

    /// NCCL's `ncclTopoSearchNextGpuSort`: the GPUs to try after `g`, best first. `sort_net`: 0
    /// ignores NETs, 1 prefers GPUs close to the channel's NET, -1 reverses equal candidates.
    fn next_gpus(&self, g: usize, used: &[bool], start_net: Option<usize>, sort_net: i32) -> Vec<usize> {
        let n = self.ngpus;
        // (inter bw, inter pci bw, inter hops, intra bw, intra hops, start index, gpu); ints as NCCL's.
        let mut scores: Vec<(i64, i64, usize, i64, usize, usize, usize)> = Vec::new();
        for i in 1..n {
            let c = (g + i) % n;
            let Some(h) = &self.hops[g][c] else {
                continue;
            };
            if used[c] {
                continue;
            }
            let (mut ibw, mut ipci, mut ihops) = (0i64, 0i64, 0usize);
            if sort_net != 0
                && let Some(net) = start_net
                && let Some(nh) = &self.hops[net][c]
            {
                ibw = nh.bw as i64;
                ipci = self.gpu_pci_bw[c];
                ihops = nh.nhops;
            }
            scores.push((ibw, ipci, ihops, h.bw as i64, h.nhops, i, c));
        }
        scores.sort_by(|a, b| {
            b.0.cmp(&a.0)
                .then(b.1.cmp(&a.1))
                .then(a.2.cmp(&b.2))
                .then(b.3.cmp(&a.3))
                .then(a.4.cmp(&b.4))
                .then(a.5.cmp(&b.5))
        });
        let mut next: Vec<usize> = scores.iter().map(|s| s.6).collect();
        if sort_net == -1
            && let Some(f) = scores.first()
            && scores.iter().all(|s| s.3 == f.3 && s.4 == f.4)
        {
            next.reverse();
        }
        if self.has_nvs {
            // NVSwitches prefer few peers: only the neighbours (by rank) are tried.
            let (prev, nxt) = ((g + n - 1) % n, (g + 1) % n);
            let mut first: Vec<usize> = match self.p.pattern {
                Pattern::Ring => vec![nxt, prev],
                Pattern::SplitTree | Pattern::BalancedTree => vec![prev, nxt],
                Pattern::Tree => vec![nxt],
            };
            if prev == nxt {
                first.truncate(1);
            }
            let mut real = 0;
            for f in first {
                if let Some(k) = next.iter().position(|&c| c == f) {
                    next.remove(k);
                    next.insert(0, f);
                    real += 1;
                }
            }
            next.truncate(real);
        }
        next
    }

    /// NCCL's `ncclTopoSearchTryGpu`: reach GPU `g` from endpoint `from` (None: start there).
    #[allow(clippy::too_many_arguments)]
    fn try_gpu(
        &mut self,
        ch: &mut Chan,
        from: Option<usize>,
        g: usize,
        step: usize,
        back_to_net: Option<usize>,
        back_to_first: Option<usize>,
        forced: Forced,
    ) -> bool {
        if let Some(f) = from
            && !self.follow(f, g, 1.0)
        {
            return false;
        }
        ch.used[g] = true;
        if self.rec_gpu(ch, g, step, back_to_net, back_to_first, forced) {
            if let Some(f) = from {
                ch.nhops += self.nhops(f, g);
            }
            return true;
        }
        ch.used[g] = false;
        if let Some(f) = from {
            self.unfollow(f, g, 1.0);
        }
        false
    }

    /// NCCL's `ncclTopoSearchRecGpu` for one channel: GPU `g` is at position `step`.
    fn rec_gpu(
        &mut self,
        ch: &mut Chan,
        g: usize,
        step: usize,
        back_to_net: Option<usize>,
        back_to_first: Option<usize>,
        forced: Forced,
    ) -> bool {
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return false;
        }
        let n = self.ngpus;
        if step == n {
            return true;
        }
        ch.intra[step] = g;
        if Some(step) == back_to_net {
            let Some(start) = ch.inter[0] else {
                return false;
            };
            for net in self.select_nets(Some(g)) {
                let pattern = self.p.pattern;
                if pattern == Pattern::Tree && net != start {
                    continue; // trees are symmetric
                }
                if pattern == Pattern::Ring && self.p.cross_nic == 2 {
                    if ch.index % 2 == 1 && Some(net) != ch.prev_start_net {
                        continue;
                    }
                } else if self.p.cross_nic == 0
                    && self.nets[net - n].asic_port != self.nets[start - n].asic_port
                {
                    continue;
                }
                let mut next_back = None;
                let mut scale = 1.0;
                if pattern == Pattern::BalancedTree {
                    if step == 0 {
                        next_back = Some(1);
                    } else if Some(net) != ch.inter[1] {
                        continue;
                    }
                    scale = 0.5;
                }
                if !self.follow(g, net, scale) {
                    continue;
                }
                let saved = ch.inter[1];
                ch.inter[1] = Some(net);
                if self.rec_gpu(ch, g, step, next_back, back_to_first, forced) {
                    ch.nhops += self.nhops(g, net);
                    return true;
                }
                ch.inter[1] = saved;
                self.unfollow(g, net, scale);
            }
            false
        } else if step + 1 < n {
            let next: Vec<usize> = match forced {
                Forced::Pci => vec![step + 1],
                Forced::Replay => match ch.replay.as_ref().and_then(|r| r.get(step + 1)) {
                    Some(&r) => vec![r],
                    None => return false,
                },
                Forced::None => {
                    let sort_net = match back_to_net {
                        None => 0,
                        Some(b) if b == step + 1 => 1,
                        Some(_) => -1,
                    };
                    self.next_gpus(g, &ch.used, ch.inter[0], sort_net)
                }
            };
            for c in next {
                if ch.used[c] {
                    continue;
                }
                if self.try_gpu(ch, Some(g), c, step + 1, back_to_net, back_to_first, forced) {
                    return true;
                }
            }
            false
        } else if Some(step) == back_to_first {
            let first = ch.intra[0];
            if !self.follow(g, first, 1.0) {
                return false;
            }
            if self.rec_gpu(ch, first, n, back_to_net, None, forced) {
                ch.nhops += self.nhops(g, first);
                return true;
            }
            self.unfollow(g, first, 1.0);
            false
        } else {
            self.rec_gpu(ch, g, n, None, None, forced)
        }
    }

    /// Searches one more channel (NCCL's `ncclTopoSearchRec` for channel `index`).
    fn one_channel(&mut self, found: &Found) -> Option<Chan> {
        let n = self.ngpus;
        let index = found.intra.len();
        let nets_present = self.ids.len() > n;
        let (back_to_net, back_to_first) = if nets_present {
            let b = match self.p.pattern {
                Pattern::Ring => n - 1,
                Pattern::SplitTree => 1.min(n - 1),
                _ => 0,
            };
            (Some(b), None)
        } else {
            (None, (self.p.pattern == Pattern::Ring).then_some(n - 1))
        };
        let mut ch = Chan {
            index,
            intra: vec![0; n],
            inter: [None, None],
            used: vec![false; n],
            replay: found.intra.last().cloned(),
            prev_start_net: found.inter.last().map(|i| i[0]),
            nhops: 0,
        };
        let attempt = |e: &mut Self, ch: &mut Chan, from: Option<usize>, g: usize, forced: Forced| {
            e.steps = 0;
            ch.used.iter_mut().for_each(|u| *u = false);
            e.try_gpu(ch, from, g, 0, back_to_net, back_to_first, forced)
        };
        if !nets_present {
            let ok = match &ch.replay {
                None => attempt(self, &mut ch, None, 0, Forced::Pci),
                Some(r) => {
                    let first = r[0];
                    attempt(self, &mut ch, None, first, Forced::Replay)
                }
            };
            if ok {
                return Some(ch);
            }
            if self.p.same_channels && index > 0 {
                return None;
            }
            // A ring is a cycle: any one found from another GPU is found from GPU 0 too.
            let starts = if self.p.pattern == Pattern::Ring { 1 } else { n };
            for g in 0..starts {
                if attempt(self, &mut ch, None, g, Forced::None) {
                    return Some(ch);
                }
            }
            return None;
        }
        // With NETs (ncclTopoSearchRecNet).
        let nets = self.select_nets(None);
        let bw = self.p.speed_inter.trunc();
        for i in 0..nets.len() {
            let net = nets[(index + i) % nets.len()];
            let k = net - n;
            if self.net_rem[k] + EPS < bw {
                continue;
            }
            if self.p.pattern == Pattern::Ring
                && self.p.cross_nic == 2
                && index % 2 == 1
                && found.inter.last().map(|x| x[1]) != Some(net)
            {
                continue;
            }
            ch.inter = [Some(net), None];
            let group = self.nets[k].asic_port;
            for (j, other) in self.nets.iter().enumerate() {
                if other.asic_port == group {
                    self.net_rem[j] -= bw;
                }
            }
            if let Some(r) = &ch.replay {
                let first = r[0];
                if attempt(self, &mut ch, Some(net), first, Forced::Replay) {
                    return Some(ch);
                }
            }
            if index == 0 || !self.p.same_channels {
                if index == 0 && !self.has_nvs && attempt(self, &mut ch, Some(net), 0, Forced::Pci) {
                    return Some(ch);
                }
                // Then the GPUs closest to this NET.
                let (mut max_bw, mut min_hops) = (0.0f64, usize::MAX);
                for g in 0..n {
                    if let Some(h) = &self.hops[net][g] {
                        if h.bw > max_bw + EPS {
                            max_bw = h.bw;
                            min_hops = h.nhops;
                        } else if (h.bw - max_bw).abs() <= EPS && h.nhops < min_hops {
                            min_hops = h.nhops;
                        }
                    }
                }
                if max_bw + EPS >= bw {
                    for j in 0..n {
                        let g = (index + j) % n;
                        let local = self.hops[net][g]
                            .as_ref()
                            .is_some_and(|h| (h.bw - max_bw).abs() <= EPS && h.nhops == min_hops);
                        if local && attempt(self, &mut ch, Some(net), g, Forced::None) {
                            return Some(ch);
                        }
                    }
                }
            }
            for (j, other) in self.nets.iter().enumerate() {
                if other.asic_port == group {
                    self.net_rem[j] += bw;
                }
            }
        }
        None
    }

    /// One `ncclTopoSearchRec` run at the current parameters: channels until none fits or
    /// `max_channels`.
    pub(super) fn run(&mut self, max_channels: usize) -> Found {
        self.rem = self.base.to_vec();
        self.net_rem = self.nets.iter().map(|n| n.bw).collect();
        let mut found = Found {
            params: self.p,
            intra: Vec::new(),
            inter: Vec::new(),
            nhops: 0,
        };
        while found.intra.len() < max_channels {
            let Some(ch) = self.one_channel(&found) else {
                break;
            };
            found.intra.push(ch.intra.clone());
            if let [Some(a), Some(b)] = ch.inter {
                found.inter.push([a, b]);
            }
            found.nhops += ch.nhops;
        }
        found
    }
}

/// The channel being built.
struct Chan {
    index: usize,
    intra: Vec<usize>,
    inter: [Option<usize>; 2],
    used: Vec<bool>,
    /// The previous channel's order (for replays).
    replay: Option<Vec<usize>>,
    /// The NET the previous channel started from.
    prev_start_net: Option<usize>,
    nhops: usize,
}

/// NCCL's `mirrorBits`: `val`'s low log2(`pow2`) bits reversed.
fn mirror_bits(val: usize, pow2: usize) -> usize {
    let mut mirror = 0;
    let (mut b, mut mb) = (1, pow2 >> 1);
    while b < pow2 {
        if val & b != 0 {
            mirror |= mb;
        }
        b <<= 1;
        mb >>= 1;
    }
    mirror
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_bits_reverses_low_bits() {
        // NCCL's mirrorBits(val, pow2): 1 of 8 (001) -> 100 = 4, 3 (011) -> 110 = 6, any of 1 -> 0.
        assert_eq!(mirror_bits(1, 8), 4);
        assert_eq!(mirror_bits(3, 8), 6);
        assert_eq!(mirror_bits(6, 8), 3);
        assert_eq!(mirror_bits(5, 1), 0);
        assert_eq!(mirror_bits(1, 2), 1);
    }
}
