//! What the ranks check in each other's information at init (NCCL's checks in `init.cc` after
//! AllGather1): every rank's [`PeerInfo`] (in [`crate::transport`]) agrees on the device kind,
//! one device per rank and the connection sizes ([`check_peers`]), and the settings every rank
//! must share ([`plan_settings`], [`check_plan_settings`]).
use super::*;

/// Checks the gathered peer information, identically on every rank so every rank fails alike:
/// one device kind, one device per rank per host (C26), the same channels and buffer sizes. (Every
/// pair of ring neighbours has a transport: NET connects any two ranks, see [`select_transport`].)
pub(super) fn check_peers(rank: usize, peers: &[PeerInfo]) -> Result<()> {
    let me = &peers[rank];
    let shared_ok = crate::params::env_var("ALLOW_SHARED_DEVICE").is_some_and(|(_, v)| v == "1");
    for (a, pa) in peers.iter().enumerate() {
        if pa.cuda != me.cuda {
            return Err(Error::InvalidUsage(format!(
                "rank {a} is on a {} device but rank {rank} is on a {} device: a communicator is all CUDA or all CPU-target",
                pa.kind(),
                me.kind()
            )));
        }
        if (pa.nch, pa.conn_bytes) != (me.nch, me.conn_bytes) {
            return Err(Error::InvalidUsage(format!(
                "rank {a} set up {} channels with {} bytes of connection memory but rank {rank} {} channels with {} bytes: \
                 NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE and NCCL_LL128_BUFFSIZE must be the same on every rank",
                pa.nch, pa.conn_bytes, me.nch, me.conn_bytes
            )));
        }
        for (b, pb) in peers.iter().enumerate().skip(a + 1) {
            let same_dev = if pa.cuda {
                pa.bus_id == pb.bus_id
            } else {
                pa.dev == pb.dev
            };
            if same_dev && pa.host == pb.host && !shared_ok {
                return Err(Error::InvalidUsage(format!(
                    "ranks {a} and {b} are both on {} of host {:?}; one device per rank is required \
                     (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)",
                    pa.describe_device(),
                    pa.host
                )));
            }
        }
    }
    Ok(())
}

/// The settings that decide how each call runs and must therefore be the same on every rank
/// (NCCL requires it; a rank planning another protocol, algorithm or channel count than its peers
/// waits for them forever): one `NAME=value` line each, in a fixed order, from the parsed values
/// (so `LL,Simple` and `Simple,LL` agree).
pub(super) fn plan_settings(p: &Params, s: &Selection) -> String {
    let names = |v: &[bool], all: &[&str]| -> String {
        let on: Vec<&str> = all.iter().zip(v).filter(|(_, b)| **b).map(|(n, _)| *n).collect();
        format!("{{{}}}", on.join(","))
    };
    let opt = |v: Option<u32>| v.map_or("unset".to_string(), |v| v.to_string());
    [
        (
            "NCCL_PROTO",
            names(
                &s.protos.0,
                &[Proto::Ll.name(), Proto::Ll128.name(), Proto::Simple.name()],
            ),
        ),
        (
            "NCCL_ALGO",
            names(&s.algos.0, &[Algo::Tree.name(), Algo::Ring.name()]),
        ),
        ("NCCL_MIN_NCHANNELS", opt(p.min_nchannels)),
        ("NCCL_MAX_NCHANNELS", opt(p.max_nchannels)),
        ("NCCL_NTHREADS", p.nthreads.to_string()),
        ("NCCL_NCHANNELS_PER_PEER", opt(p.p2p_nchannels_per_peer)),
        ("NCCL_BUFFSIZE", p.buffsize.to_string()),
        ("NCCL_LL_BUFFSIZE", p.ll_buffsize.to_string()),
        ("NCCL_LL128_BUFFSIZE", p.ll128_buffsize.to_string()),
        ("OXCCL_TEST_INITIAL_STEP", p.initial_step.to_string()),
        ("OXCCL_CHECK_CALLS", u8::from(p.check_calls).to_string()),
    ]
    .iter()
    .map(|(k, v)| format!("{k}={v}"))
    .collect::<Vec<_>>()
    .join("\n")
}

/// Compares every rank's [`plan_settings`] record (`all`, by rank) with this rank's: the first
/// setting that differs fails init on every rank alike with `InvalidUsage` naming the variable,
/// the lowest rank whose value differs from rank 0's, and both values.
pub(super) fn check_plan_settings(rank: usize, all: &[Vec<u8>]) -> Result<()> {
    let lines =
        |b: &[u8]| -> Vec<String> { String::from_utf8_lossy(b).lines().map(str::to_string).collect() };
    let Some(first) = all.first().map(|b| lines(b)) else {
        return Ok(());
    };
    for (r, b) in all.iter().enumerate().skip(1) {
        let other = lines(b);
        if let Some((a, o)) = first.iter().zip(&other).find(|(a, o)| a != o) {
            let (name, v0) = a.split_once('=').unwrap_or((a.as_str(), ""));
            let v = o.split_once('=').map_or(o.as_str(), |(_, v)| v);
            let spelling = match name.strip_prefix("NCCL_") {
                Some(rest) => format!("also spelled OXCCL_{rest}; every rank"),
                None => "every rank".to_string(),
            };
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: {name} differs across ranks: rank 0 has {v0}, rank {r} has {v} \
                 ({spelling} must set the same value)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::proc_start;
    use crate::transport::test_peers::cuda_peer;

    #[test]
    fn cuda_rules_name_both_ranks() {
        // Two processes whose CUDA ordinal is 0 but on different GPUs (CUDA_VISIBLE_DEVICES): fine.
        let (a, b) = (
            cuda_peer("0000:18:00.0", "h", 1),
            cuda_peer("0000:2a:00.0", "h", 2),
        );
        check_peers(0, &[a.clone(), b.clone()]).unwrap();
        // The same bus id twice: C26, naming both ranks and the bus id.
        let e = check_peers(1, &[a.clone(), a.clone()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid usage: ranks 0 and 1 are both on cuda device 0 (bus id 0000:18:00.0) of host \"h\"; one device \
             per rank is required (set OXCCL_ALLOW_SHARED_DEVICE=1 to share a device for testing)"
        );
        // NCCL_P2P_DISABLE=1 on either side, or different hosts: fine (SHM or NET connects them).
        let mut c = b.clone();
        c.p2p_disable = true;
        check_peers(0, &[a.clone(), c]).unwrap();
        let d = cuda_peer("0000:2a:00.0", "other", 2);
        check_peers(0, &[a.clone(), d]).unwrap();
        // A CPU-target rank among CUDA ranks.
        let mut cpu = b;
        cpu.cuda = false;
        let e = check_peers(0, &[a, cpu]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid usage: rank 1 is on a cpu device but rank 0 is on a cuda device: a communicator is all CUDA or \
             all CPU-target"
        );
    }

    #[test]
    fn proc_start_of_this_process() {
        let (t, zombie) = proc_start(std::process::id()).unwrap();
        assert!(t > 0 && !zombie);
        // Pids above the kernel's maximum (4194304) never exist.
        assert_eq!(proc_start(u32::MAX), None);
    }
}
