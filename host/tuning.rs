//! Algorithm and protocol selection (NCCL's `tuning.cc` and the `NCCL_ALGO` / `NCCL_PROTO`
//! parsing of `enqueue.cc`).
//!
//! `NCCL_ALGO` and `NCCL_PROTO` (also `OXCCL_ALGO` / `OXCCL_PROTO`) are comma lists of names,
//! case-insensitive; a leading `^` turns the list into exclusions (`^LL,LL128`). A value naming
//! nothing valid is an `InvalidArgument` that names the variable and the accepted values (cases
//! C12, C13). The selection of each call is made among the algorithms and protocols that are both
//! allowed and implemented for the collective; when none is left, the call fails with an error
//! naming the collective and what was allowed — never a silent fallback to something forbidden.
use crate::error::{Error, Result};
use oxccl_gpu::abi::{Algo, Func, Proto};

/// A set of enum values, indexed by their ABI order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allowed<const N: usize>(pub [bool; N]);

/// The algorithms and protocols the environment allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    pub algos: Allowed<{ Algo::COUNT }>,
    pub protos: Allowed<{ Proto::COUNT }>,
}

impl Default for Selection {
    fn default() -> Self {
        Selection {
            algos: Allowed([true; Algo::COUNT]),
            protos: Allowed([true; Proto::COUNT]),
        }
    }
}

/// Parses one NCCL-style list for `var` over `all` (named by `name`).
fn parse_list<T: Copy, const N: usize>(
    var: &str,
    value: &str,
    all: &[T; N],
    name: impl Fn(T) -> &'static str,
) -> Result<Allowed<N>> {
    let accepted = || all.iter().map(|&v| name(v)).collect::<Vec<_>>().join(", ");
    let v = value.trim();
    let (exclude, list) = match v.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, v),
    };
    let mut named = [false; N];
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some(i) = all.iter().position(|&a| name(a).eq_ignore_ascii_case(item)) else {
            return Err(Error::invalid(format!(
                "{var}={value:?}: {item:?} is not a known name (accepted: {}; a leading ^ excludes)",
                accepted()
            )));
        };
        named[i] = true;
    }
    if !named.iter().any(|&b| b) {
        return Err(Error::invalid(format!(
            "{var}={value:?} names nothing (accepted: comma list of {}; a leading ^ excludes)",
            accepted()
        )));
    }
    let allowed = if exclude { named.map(|b| !b) } else { named };
    if !allowed.iter().any(|&b| b) {
        return Err(Error::invalid(format!(
            "{var}={value:?} excludes every value ({})",
            accepted()
        )));
    }
    Ok(Allowed(allowed))
}

impl Selection {
    /// Reads `NCCL_ALGO` / `NCCL_PROTO` (or the `OXCCL_` spellings) through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<(String, String)>) -> Result<Self> {
        let mut s = Selection::default();
        if let Some((var, v)) = get("ALGO") {
            let all: [Algo; Algo::COUNT] = [Algo::Tree, Algo::Ring];
            s.algos = parse_list(&var, &v, &all, Algo::name)?;
        }
        if let Some((var, v)) = get("PROTO") {
            let all: [Proto; Proto::COUNT] = [Proto::Ll, Proto::Ll128, Proto::Simple];
            s.protos = parse_list(&var, &v, &all, Proto::name)?;
        }
        Ok(s)
    }

    /// Reads the environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(crate::params::env_var)
    }

    /// The (algorithm, protocol) for `func` on a communicator without trees: the best allowed pair
    /// that oxccl implements (see [`Selection::choose_with`]).
    pub fn choose(&self, func: Func) -> Result<(Algo, Proto)> {
        self.choose_with(func, None)
    }

    /// The (algorithm, protocol) for `func` on a communicator whose trees are `trees` (`None`: no
    /// tree connections): the first allowed pair of [`implemented_with`]. The ring on the Simple,
    /// LL and LL128 protocols is implemented for every collective, the tree on the same three for
    /// AllReduce when the communicator has trees. A selection that allows none of the implemented
    /// pairs is an `InvalidArgument` naming `func`, what the environment allows and what is
    /// implemented (and, for a tree AllReduce without trees, why there are none).
    pub fn choose_with(&self, func: Func, trees: Option<TreeShape>) -> Result<(Algo, Proto)> {
        let implemented = |f| implemented_with(f, trees.is_some());
        for &(algo, proto) in implemented(func) {
            if self.algos.0[algo as usize] && self.protos.0[proto as usize] {
                return Ok((algo, proto));
            }
        }
        let names = |v: &[bool], all: &[&str]| {
            all.iter()
                .zip(v)
                .filter(|(_, b)| **b)
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(",")
        };
        Err(Error::invalid(format!(
            "no algorithm/protocol available for {func}: NCCL_ALGO allows {{{}}} and NCCL_PROTO allows {{{}}}, \
             but {func} is implemented only as {}{}",
            names(&self.algos.0, &[Algo::Tree.name(), Algo::Ring.name()]),
            names(
                &self.protos.0,
                &[Proto::Ll.name(), Proto::Ll128.name(), Proto::Simple.name()]
            ),
            implemented(func)
                .iter()
                .map(|(a, p)| format!("{a}/{p}"))
                .collect::<Vec<_>>()
                .join(", "),
            if func == Func::AllReduce && trees.is_none() && self.algos.0[Algo::Tree as usize] {
                " (tree needs a communicator spanning several nodes with tree connections: \
                 Comm::init_rank ranks on two or more hosts, none of which excludes the tree in \
                 NCCL_ALGO, or Comm::init_all split by OXCCL_TEST_NODES)"
            } else {
                ""
            }
        )))
    }
}

/// The trees a communicator has set up, as the choice sees them: present only when it spans
/// several nodes and its transport connected the tree peers (NCCL's `comm->nNodes > 1` and the
/// tree channels of `connectTrees`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeShape {
    /// Nodes the communicator spans (at least 2).
    pub nnodes: usize,
    /// Depth of the trees: ranks per node − 1 + floor(log2(nnodes)) (NCCL's `tree.depth`).
    pub depth: u32,
}

/// What the ring's links are, for the cost model's constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fabric {
    /// GPUs connected by NVLink (directly or through NVSwitch): CUDA P2P.
    NvLink,
    /// CPU-target ranks: host threads writing into host memory.
    Host,
    /// GPUs whose rings go through host shared memory (SHM, no NET): every step crosses PCIe
    /// twice.
    Shm,
    /// GPUs whose rings cross the network (NET, driven by the proxy thread).
    Net,
}

impl Fabric {
    /// The fabric of a communicator of GPU ranks whose ring pairs use `kinds`: its slowest
    /// transport (NET over SHM over P2P/NVLink). Every rank derives it from the same ring view,
    /// so all agree on each call's plan.
    pub fn of_gpu_rings(kinds: impl IntoIterator<Item = crate::transport::TransportKind>) -> Fabric {
        use crate::transport::TransportKind::{Net, P2p, Shm};
        kinds.into_iter().fold(Fabric::NvLink, |f, k| match (f, k) {
            (Fabric::Net, _) | (_, Net) => Fabric::Net,
            (Fabric::Shm, _) | (_, Shm) => Fabric::Shm,
            (f, P2p) => f,
        })
    }
}

/// The latency + bandwidth cost model of one fabric (NCCL's `ncclTopoTuneModel`: a base latency
/// per protocol, a latency per ring hop, a bandwidth per channel and a bus ceiling), in µs and
/// GB/s of bus bandwidth (nccl-tests' busbw). Protocol arrays are indexed by [`Proto`]'s ABI
/// order (LL, LL128, Simple).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Model {
    /// Launch and first-step latency of a call, µs.
    pub base_lat_us: [f64; Proto::COUNT],
    /// Latency added per ring step (hop), µs.
    pub hop_lat_us: [f64; Proto::COUNT],
    /// Extra time for the ring pipeline to fill (chunks of several steps), µs.
    pub fill_us: [f64; Proto::COUNT],
    /// Bus bandwidth one channel (one block) sustains, GB/s.
    pub channel_bw: [f64; Proto::COUNT],
    /// Bus bandwidth ceiling of the protocol on this fabric, GB/s (LL moves 8 data bytes per
    /// 16-byte line, LL128 120 per 128, Simple the payload only).
    pub bus_cap: [f64; Proto::COUNT],
    /// Bytes per channel below which a call uses fewer channels.
    pub min_channel_bytes: [u64; Proto::COUNT],
    /// Fraction of the protocol's bandwidth a ReduceScatter reaches (its one reduce-and-store
    /// pass per step has no second ring phase to overlap with).
    pub reduce_scatter_scale: [f64; Proto::COUNT],
    /// Most channels a call uses on this fabric (unless `NCCL_MIN_NCHANNELS` asks for more).
    pub max_channels: u32,
}

impl Model {
    /// The constants of `fabric`. NVLink: fitted to `oxccl perf all-reduce --proto P` on 2×H200
    /// (NVSwitch, 18 NVLink-4 links per GPU, 2026-11-29): ≤ 32 KiB calls take ≈ 11 µs on LL and
    /// LL128 and ≈ 17 µs on Simple (base = that minus two hops); LL saturates near 150 GB/s busbw,
    /// LL128 near 300 GB/s (289 at 128 MiB); Simple reaches 336 GB/s at 512 MiB but only 240 at
    /// 32 MiB — its 4-step chunks need ≈ 20 µs of pipeline fill (`fill_us`). So LL128 wins from
    /// ≈ 64 KiB to ≈ 60 MiB and Simple above. Per-hop latencies are NCCL's NVLink ring values
    /// (0.6, 1.9, 3.4 µs). The host fabric only orders the protocols sensibly for the CPU target.
    pub fn for_fabric(fabric: Fabric) -> Model {
        match fabric {
            Fabric::NvLink => Model {
                base_lat_us: [9.5, 9.5, 14.5],
                hop_lat_us: [0.6, 1.9, 3.4],
                fill_us: [0.0, 0.0, 20.0],
                channel_bw: [4.0, 9.0, 12.0],
                bus_cap: [150.0, 300.0, 345.0],
                min_channel_bytes: [16 << 10, 64 << 10, 128 << 10],
                // 2×H200, 64 channels: ReduceScatter on LL128 reached 188 / 226 GB/s busbw at
                // 32 / 64 MiB where AllReduce of the same bus bytes reached 262 / 283; Simple
                // 191 / 240 (2026-11-29), so LL128 counts at 0.77 of its AllReduce figure.
                reduce_scatter_scale: [1.0, 0.77, 1.0],
                max_channels: 64,
            },
            Fabric::Host => Model {
                base_lat_us: [20.0, 25.0, 30.0],
                hop_lat_us: [2.0, 3.0, 4.0],
                fill_us: [0.0, 0.0, 0.0],
                channel_bw: [0.5, 1.0, 2.0],
                bus_cap: [1.0, 2.0, 4.0],
                min_channel_bytes: [16 << 10, 64 << 10, 128 << 10],
                reduce_scatter_scale: [1.0; Proto::COUNT],
                max_channels: 64,
            },
            // 2 processes × 1 H200, NCCL_P2P_DISABLE=1, `perf all-reduce --procs 2` with
            // NCCL_PROTO and NCCL_MAX_NCHANNELS fixed (2026-11-30): LL takes 20 µs up to 64 KiB and
            // saturates near 15–17 GB/s (32 channels), Simple starts at 25 µs and reaches 28 GB/s
            // at 16 MiB, 31–32 at 64–256 MiB. LL wins to ≈ 512 KiB, Simple above. LL128 is off
            // through host memory (only NCCL_PROTO=LL128 brings it back): LL's figures.
            Fabric::Shm => Model {
                base_lat_us: [19.0, 19.0, 24.0],
                hop_lat_us: [0.5, 0.5, 1.0],
                fill_us: [0.0, 0.0, 10.0],
                channel_bw: [4.0, 4.0, 12.0],
                bus_cap: [16.0, 16.0, 32.0],
                min_channel_bytes: [16 << 10, 16 << 10, 128 << 10],
                reduce_scatter_scale: [1.0; Proto::COUNT],
                max_channels: 64,
            },
            // 2 processes × 1 H200, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 over loopback sockets
            // (2026-11-30): Simple on 1 channel takes 53–64 µs up to 16 KiB and gives 3.4 GB/s at
            // 1 MiB, 4.7 at 4 MiB; 4 channels 13 GB/s at 16 MiB; 16 channels 21 GB/s at 256 MiB;
            // more channels are slower (64: 12 ms for 16 MiB, the proxy's rounds over 128
            // connections). LL never beats Simple through the proxy (0.6 GB/s, 58 µs at 16 KiB):
            // it counts as slow so only NCCL_PROTO=LL picks it.
            Fabric::Net => Model {
                base_lat_us: [55.0, 55.0, 50.0],
                hop_lat_us: [1.0, 1.0, 1.0],
                fill_us: [0.0; Proto::COUNT],
                channel_bw: [0.6, 0.6, 4.5],
                bus_cap: [0.9, 0.9, 21.0],
                min_channel_bytes: [1 << 20, 1 << 20, 4 << 20],
                reduce_scatter_scale: [1.0; Proto::COUNT],
                max_channels: 16,
            },
        }
    }

    /// Channels a call of `bytes` uses on `proto`: one per `min_channel_bytes`, at most
    /// `max_channels`, within `min..=max` (`NCCL_MIN_NCHANNELS` / the communicator's channel
    /// count; `min` wins over `max_channels`).
    pub fn nchannels(&self, proto: Proto, bytes: u64, min: u32, max: u32) -> u32 {
        let want = bytes.div_ceil(self.min_channel_bytes[proto as usize].max(1));
        let lo = min.min(max);
        let hi = max.min(self.max_channels).max(lo);
        (want.min(u32::MAX as u64) as u32).clamp(lo, hi)
    }

    /// Channels worth connecting on a communicator of `nch` channels: the most any call uses
    /// ([`Model::nchannels`]: `max_channels`, or `NCCL_MIN_NCHANNELS` when that is larger).
    pub fn connected_channels(&self, nch: u32, min_nchannels: Option<u32>) -> u32 {
        nch.min(self.max_channels.max(min_nchannels.unwrap_or(1)))
    }

    /// Predicted time in µs of a ring `func` of `bytes` (nccl-tests' size: the larger of the
    /// per-rank send and receive buffers) over `nranks` ranks and `nch` channels on `proto`.
    pub fn predict_us(&self, func: Func, proto: Proto, nranks: usize, nch: u32, bytes: u64) -> f64 {
        let p = proto as usize;
        let n = nranks.max(1) as f64;
        // Ring steps (hops) and bus bytes per nccl-tests' busbw convention.
        let (steps, bus_factor) = match func {
            Func::AllReduce => (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n),
            Func::AllGather | Func::ReduceScatter => (n - 1.0, (n - 1.0) / n),
            Func::Broadcast | Func::Reduce => (n - 1.0, 1.0),
        };
        let mut bw = (self.channel_bw[p] * nch as f64).min(self.bus_cap[p]);
        if func == Func::ReduceScatter {
            bw *= self.reduce_scatter_scale[p];
        }
        // GB/s = 1e3 bytes per µs.
        self.base_lat_us[p]
            + self.fill_us[p]
            + steps * self.hop_lat_us[p]
            + bytes as f64 * bus_factor / (bw * 1e3)
    }

    /// Predicted time in µs of a tree AllReduce of `bytes` over `tree` on `nch` channels on
    /// `proto` (NCCL's tree model): `2 × depth` hops of latency (up, then down), and every byte
    /// crosses the tree twice at 92 % of the bus bandwidth (NCCL's algorithm bandwidth of a tree is
    /// half its bus bandwidth, which it caps at 0.92 of the ring's).
    pub fn predict_tree_us(&self, proto: Proto, tree: TreeShape, nch: u32, bytes: u64) -> f64 {
        let p = proto as usize;
        let bw = (self.channel_bw[p] * nch as f64).min(self.bus_cap[p]) * 0.92;
        self.base_lat_us[p]
            + self.fill_us[p]
            + 2.0 * tree.depth as f64 * self.hop_lat_us[p]
            + 2.0 * bytes as f64 / (bw * 1e3)
    }
}

impl Selection {
    /// The (algorithm, protocol, channels) with the lowest predicted time for a `bytes`-byte
    /// `func` on `nranks` ranks of at most `max_nch` channels (at least `min_nch`), among those
    /// both allowed by `NCCL_ALGO`/`NCCL_PROTO` and implemented (NCCL's `topoGetAlgoInfo`).
    /// Errors as [`Selection::choose`] when nothing is left.
    pub fn choose_sized(
        &self,
        model: &Model,
        func: Func,
        bytes: u64,
        nranks: usize,
        min_nch: u32,
        max_nch: u32,
    ) -> Result<(Algo, Proto, u32)> {
        self.choose_sized_with(model, func, bytes, nranks, min_nch, max_nch, None)
    }

    /// [`Selection::choose_sized`] on a communicator whose trees are `trees` (`None`: none): the
    /// tree pairs of [`implemented_with`] compete too, timed by [`Model::predict_tree_us`].
    /// Errors as [`Selection::choose_with`] when nothing is left.
    #[allow(clippy::too_many_arguments)]
    pub fn choose_sized_with(
        &self,
        model: &Model,
        func: Func,
        bytes: u64,
        nranks: usize,
        min_nch: u32,
        max_nch: u32,
        trees: Option<TreeShape>,
    ) -> Result<(Algo, Proto, u32)> {
        let mut best: Option<(f64, Algo, Proto, u32)> = None;
        for &(algo, proto) in implemented_with(func, trees.is_some()) {
            if !(self.algos.0[algo as usize] && self.protos.0[proto as usize]) {
                continue;
            }
            let nch = model.nchannels(proto, bytes, min_nch, max_nch);
            let t = match (algo, trees) {
                (Algo::Tree, Some(tree)) => model.predict_tree_us(proto, tree, nch, bytes),
                _ => model.predict_us(func, proto, nranks, nch, bytes),
            };
            if best.is_none_or(|b| t < b.0) {
                best = Some((t, algo, proto, nch));
            }
        }
        match best {
            Some((_, algo, proto, nch)) => Ok((algo, proto, nch)),
            None => self.choose_with(func, trees).map(|(a, p)| (a, p, 1)),
        }
    }
}

/// (algorithm, protocol) pairs implemented for `func` on every communicator, in order of
/// preference when the environment allows several (the size-based choice is
/// [`Selection::choose_sized`]): the ring on every protocol.
pub fn implemented(func: Func) -> &'static [(Algo, Proto)] {
    implemented_with(func, false)
}

/// (algorithm, protocol) pairs implemented for `func` on a communicator with (`trees`) or without
/// tree connections: [`implemented`], plus the tree on Simple, LL and LL128 for AllReduce when it
/// has trees (as NCCL, whose tree algorithm runs AllReduce only).
pub fn implemented_with(func: Func, trees: bool) -> &'static [(Algo, Proto)] {
    const RING: &[(Algo, Proto)] = &[
        (Algo::Ring, Proto::Simple),
        (Algo::Ring, Proto::Ll),
        (Algo::Ring, Proto::Ll128),
    ];
    const RING_TREE: &[(Algo, Proto)] = &[
        (Algo::Ring, Proto::Simple),
        (Algo::Ring, Proto::Ll),
        (Algo::Ring, Proto::Ll128),
        (Algo::Tree, Proto::Simple),
        (Algo::Tree, Proto::Ll),
        (Algo::Tree, Proto::Ll128),
    ];
    if trees && func == Func::AllReduce {
        RING_TREE
    } else {
        RING
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(algo: Option<&str>, proto: Option<&str>) -> Result<Selection> {
        Selection::from_lookup(|k| match k {
            "ALGO" => algo.map(|v| ("NCCL_ALGO".to_string(), v.to_string())),
            "PROTO" => proto.map(|v| ("NCCL_PROTO".to_string(), v.to_string())),
            _ => None,
        })
    }

    #[test]
    fn lists_and_exclusions() {
        let s = sel(None, Some("Simple")).unwrap();
        assert_eq!(s.protos.0, [false, false, true]);
        let s = sel(None, Some("^LL")).unwrap();
        assert_eq!(s.protos.0, [false, true, true]);
        let s = sel(Some("ring, TREE"), Some("ll,ll128")).unwrap();
        assert_eq!(s.algos.0, [true, true]);
        assert_eq!(s.protos.0, [true, true, false]);
        assert_eq!(
            sel(None, Some("Simple"))
                .unwrap()
                .choose(Func::AllReduce)
                .unwrap(),
            (Algo::Ring, Proto::Simple)
        );
    }

    #[test]
    fn model_picks_ll_for_small_and_simple_for_large_calls_on_nvlink() {
        let m = Model::for_fabric(Fabric::NvLink);
        let all = sel(None, None).unwrap();
        // 8 B: LL's latency (9.5 + 2 × 0.6 µs) is the lowest; 512 MiB: Simple's 345 GB/s ceiling
        // wins; 8 MiB: LL128 (300 GB/s ceiling, no pipeline fill).
        let (a, p, nch) = all.choose_sized(&m, Func::AllReduce, 8, 2, 1, 64).unwrap();
        assert_eq!((a, p, nch), (Algo::Ring, Proto::Ll, 1));
        let (_, p, nch) = all
            .choose_sized(&m, Func::AllReduce, 512 << 20, 2, 1, 64)
            .unwrap();
        assert_eq!((p, nch), (Proto::Simple, 64));
        let (_, p, nch) = all.choose_sized(&m, Func::AllReduce, 8 << 20, 2, 1, 64).unwrap();
        assert_eq!((p, nch), (Proto::Ll128, 64));
        let (_, p, _) = all.choose_sized(&m, Func::AllReduce, 32 << 20, 2, 1, 64).unwrap();
        assert_eq!(p, Proto::Ll128);
        // ReduceScatter of 64 MiB (32 MiB of bus bytes on 2 ranks): LL128 at 0.77 × 300 GB/s
        // takes 11.4 + 33554432 / 231e3 = 156.7 µs, Simple 37.9 + 33554432 / 345e3 = 135.2 µs;
        // at 16 MiB LL128 (47.7 µs) still beats Simple (62.2 µs). (AllReduce is unscaled: at 64 MiB
        // its 64 MiB of bus bytes take 237.0 µs on LL128 and 235.8 on Simple.)
        let rs = |bytes| {
            all.choose_sized(&m, Func::ReduceScatter, bytes, 2, 1, 64)
                .unwrap()
                .1
        };
        assert_eq!(rs(64 << 20), Proto::Simple);
        assert_eq!(rs(16 << 20), Proto::Ll128);
        // LL uses one channel per 16 KiB: 128 KiB → 8 channels.
        assert_eq!(m.nchannels(Proto::Ll, 128 << 10, 1, 64), 8);
        assert_eq!(m.nchannels(Proto::Simple, 128 << 10, 1, 64), 1);
        // NCCL_MIN_NCHANNELS above the communicator's count is clamped to it.
        assert_eq!(m.nchannels(Proto::Simple, 8, 80, 64), 64);
        // Forcing wins over the model at every size.
        let simple = sel(None, Some("Simple")).unwrap();
        let (_, p, _) = simple.choose_sized(&m, Func::AllReduce, 8, 2, 1, 64).unwrap();
        assert_eq!(p, Proto::Simple);
        let ll = sel(None, Some("LL")).unwrap();
        let (_, p, nch) = ll.choose_sized(&m, Func::Broadcast, 1 << 30, 2, 1, 64).unwrap();
        assert_eq!((p, nch), (Proto::Ll, 64));
        // Predictions: 8 B AllReduce on 2 ranks = base + 2 hops on LL.
        let t = m.predict_us(Func::AllReduce, Proto::Ll, 2, 1, 8);
        assert!((t - (9.5 + 2.0 * 0.6 + 8.0 / 4e3)).abs() < 1e-9, "{t}");
    }

    /// The SHM and NET models pick what measured fastest on 2×H200 (2026-11-30, see
    /// `Model::for_fabric`), with LL128 off as `init_rank` leaves it through host memory.
    #[test]
    fn shm_and_net_models_follow_the_measured_best() {
        let no_ll128 = sel(None, Some("^LL128")).unwrap();
        let pick = |f: Fabric, bytes: u64| {
            let m = Model::for_fabric(f);
            let (_, p, nch) = no_ll128
                .choose_sized(&m, Func::AllReduce, bytes, 2, 1, 64)
                .unwrap();
            (p, nch)
        };
        // SHM: LL to 256 KiB (20 µs at 16 KiB; 30 µs on 16+ channels at 256 KiB, Simple 48),
        // Simple from 1 MiB (75 µs on 8 channels; LL 77 on 32), on one channel per 128 KiB.
        assert_eq!(pick(Fabric::Shm, 16 << 10), (Proto::Ll, 1));
        assert_eq!(pick(Fabric::Shm, 256 << 10), (Proto::Ll, 16));
        assert_eq!(pick(Fabric::Shm, 1 << 20), (Proto::Simple, 8));
        assert_eq!(pick(Fabric::Shm, 4 << 20), (Proto::Simple, 32));
        assert_eq!(pick(Fabric::Shm, 256 << 20), (Proto::Simple, 64));
        // NET: Simple at every size, one channel per 4 MiB, at most 16 (the 64-channel setup took
        // 4.2 ms for 1 MiB on LL and 12 ms for 16 MiB on Simple; 1 and 4 channels 0.3 and 1.3).
        assert_eq!(pick(Fabric::Net, 8), (Proto::Simple, 1));
        assert_eq!(pick(Fabric::Net, 1 << 20), (Proto::Simple, 1));
        assert_eq!(pick(Fabric::Net, 16 << 20), (Proto::Simple, 4));
        assert_eq!(pick(Fabric::Net, 1 << 30), (Proto::Simple, 16));
        // NCCL_MIN_NCHANNELS above the fabric's cap still wins.
        let net = Model::for_fabric(Fabric::Net);
        assert_eq!(net.nchannels(Proto::Simple, 8, 32, 64), 32);
        // A NET communicator connects only the 16 channels a call can use, unless
        // NCCL_MIN_NCHANNELS asks for more; on NVLink all 64.
        assert_eq!(net.connected_channels(64, None), 16);
        assert_eq!(net.connected_channels(8, None), 8);
        assert_eq!(net.connected_channels(64, Some(32)), 32);
        assert_eq!(Model::for_fabric(Fabric::NvLink).connected_channels(64, None), 64);
        // Forcing LL over NET is honoured.
        let ll = sel(None, Some("LL")).unwrap();
        let (_, p, nch) = ll.choose_sized(&net, Func::AllReduce, 1 << 20, 2, 1, 64).unwrap();
        assert_eq!((p, nch), (Proto::Ll, 1));
    }

    #[test]
    fn a_communicators_fabric_is_its_slowest_ring_transport() {
        use crate::transport::TransportKind::{Net, P2p, Shm};
        assert_eq!(Fabric::of_gpu_rings([P2p, P2p]), Fabric::NvLink);
        assert_eq!(Fabric::of_gpu_rings([]), Fabric::NvLink);
        assert_eq!(Fabric::of_gpu_rings([P2p, Shm, P2p]), Fabric::Shm);
        assert_eq!(Fabric::of_gpu_rings([Shm, Net, P2p]), Fabric::Net);
        assert_eq!(Fabric::of_gpu_rings([Net, Shm]), Fabric::Net);
    }

    #[test]
    fn bogus_values_name_the_variable_and_the_accepted_values() {
        for v in ["bogus", "", "^", "LL,bogus"] {
            let e = sel(None, Some(v)).unwrap_err();
            let m = e.to_string();
            assert!(matches!(e, Error::InvalidArgument(_)), "{m}");
            assert!(m.contains("NCCL_PROTO") && m.contains("LL, LL128, Simple"), "{m}");
        }
        let e = sel(Some("tree,bogus"), None).unwrap_err().to_string();
        assert!(
            e.contains("NCCL_ALGO") && e.contains("\"bogus\"") && e.contains("tree, ring"),
            "{e}"
        );
        let e = sel(None, Some("^LL,LL128,Simple")).unwrap_err().to_string();
        assert!(e.contains("excludes every value"), "{e}");
    }

    #[test]
    fn tree_competes_for_all_reduce_on_communicators_with_trees() {
        let m = Model::for_fabric(Fabric::Host);
        let all = sel(None, None).unwrap();
        // 8 ranks in 4 nodes of 2: depth 2 - 1 + log2(4) = 3. A communicator of 2 channels.
        let shape = TreeShape { nnodes: 4, depth: 3 };
        let tree = Some(shape);
        // Tree on Simple: base 30 µs + 2 × 3 hops of 4 µs, bytes twice at 0.92 × 2 GB/s (1 channel).
        let t = m.predict_tree_us(Proto::Simple, shape, 1, 65536);
        assert!(
            (t - (30.0 + 24.0 + 2.0 * 65536.0 / (0.92 * 2e3))).abs() < 1e-9,
            "{t}"
        );
        // 8 B: the tree on LL, 20 + 2 × 3 hops of 2 µs = 32.03 µs, beats ring LL's 20 + 14 × 2 = 48
        // (and the tree on Simple's 54); 64 KiB: the tree on Simple's 125.2 µs beats ring Simple's
        // 86 + 65536 × 1.75 / 2000 = 143.3 and the tree on LL (2 channels capped at 1 GB/s: 32 +
        // 2 × 65536 / 920 = 174.5); 4 MiB: ring Simple on 2 channels (86 + 1835 = 1921 µs) beats
        // the tree on Simple (54 + 2279 = 2333).
        let choose = |s: &Selection, f, bytes, t| s.choose_sized_with(&m, f, bytes, 8, 1, 2, t).unwrap();
        assert_eq!(choose(&all, Func::AllReduce, 8, tree), (Algo::Tree, Proto::Ll, 1));
        assert_eq!(choose(&all, Func::AllReduce, 8, None), (Algo::Ring, Proto::Ll, 1));
        assert_eq!(
            choose(&all, Func::AllReduce, 64 << 10, tree),
            (Algo::Tree, Proto::Simple, 1)
        );
        assert_eq!(
            choose(&all, Func::AllReduce, 4 << 20, tree),
            (Algo::Ring, Proto::Simple, 2)
        );
        // Without trees, or for another collective, the tree never competes.
        assert_eq!(choose(&all, Func::AllReduce, 64 << 10, None).0, Algo::Ring);
        assert_eq!(choose(&all, Func::Broadcast, 64 << 10, tree).0, Algo::Ring);
        // NCCL_ALGO=tree forces it at every size.
        let forced = sel(Some("tree"), None).unwrap();
        assert_eq!(
            choose(&forced, Func::AllReduce, 4 << 20, tree),
            (Algo::Tree, Proto::Simple, 2)
        );
        assert_eq!(
            forced.choose_with(Func::AllReduce, tree).unwrap(),
            (Algo::Tree, Proto::Simple)
        );
        // The tree runs LL and LL128 too: forcing one of them gets it.
        for proto in [Proto::Ll, Proto::Ll128] {
            let s = sel(Some("tree"), Some(proto.name())).unwrap();
            assert_eq!(choose(&s, Func::AllReduce, 8, tree).0, Algo::Tree, "{proto}");
            assert_eq!(choose(&s, Func::AllReduce, 8, tree).1, proto);
        }
        // A tree Broadcast is not implemented: the error lists what is, without the node hint.
        let e = forced
            .choose_sized_with(&m, Func::Broadcast, 8, 8, 1, 2, tree)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("broadcast is implemented only as ring/Simple, ring/LL, ring/LL128")
                && !e.contains("several nodes"),
            "{e}"
        );
        // Without trees the error says why the tree is missing.
        let e = forced.choose(Func::AllReduce).unwrap_err().to_string();
        assert!(
            e.contains(
                "only as ring/Simple, ring/LL, ring/LL128 (tree needs a communicator spanning several nodes"
            ),
            "{e}"
        );
        assert_eq!(
            implemented(Func::AllReduce),
            implemented_with(Func::AllReduce, false)
        );
        assert_eq!(implemented_with(Func::Reduce, true), implemented(Func::Reduce));
    }

    #[test]
    fn nothing_implemented_is_an_explicit_error_naming_the_op() {
        let e = sel(Some("tree"), Some("LL128"))
            .unwrap()
            .choose(Func::Broadcast)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("broadcast") && e.contains("LL128") && e.contains("ring/Simple"),
            "{e}"
        );
        let e = sel(Some("Tree"), None)
            .unwrap()
            .choose(Func::AllReduce)
            .unwrap_err()
            .to_string();
        assert!(e.contains("allreduce") && e.contains("{tree}"), "{e}");
    }
}
