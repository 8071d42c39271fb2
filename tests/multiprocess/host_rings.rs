//! Per-channel rings across simulated hosts (the NVLink-mesh fixture's rings differ per channel,
//! so a rank's NET peers differ per channel), ranks as processes (`host_ranks`): every collective
//! in place on every protocol and channel count, trees on those rings, and SHM disabled on some
//! ranks (a rank then mixes SHM and NET neighbours differently per channel).
use crate::host_ranks::{SECS, check_mesh_rings, check_mesh_rings_off, kv, mesh_envs, must_pass};

#[test]
fn per_channel_rings_across_hosts_every_collective_in_place() {
    // Two hosts of four ranks on the NVLink-mesh fixture (rings differ per channel, so a rank's
    // NET peers differ per channel); 1, 3 and 8 channels (8: channels 6 and 7 repeat rings 0 and
    // 1), every call on exactly that many channels; AllReduce, Broadcast and Reduce from every
    // root, AllGather and ReduceScatter, all in place, int32, on each protocol.
    for nch in [1u32, 3, 8] {
        for proto in ["LL", "LL128", "Simple"] {
            let common = kv(&[
                ("NCCL_PROTO", proto),
                ("OXCCL_CHILD_WANT_PROTO", proto),
                ("OXCCL_CHILD_COUNTS", "1,1001,24577"),
            ]);
            let what = format!("mesh rings {nch} channels {proto}");
            let outs = must_pass(&what, "colls", &common, &mesh_envs(nch), SECS(90));
            check_mesh_rings(&what, &outs, nch as usize);
        }
    }
}

#[test]
fn trees_on_per_channel_rings_across_hosts() {
    // The same communicators with the tree forced: each host's chain follows channel 0's ring;
    // tree AllReduce on each protocol with 2 and 8 channels, every dtype-op pair of the list,
    // in and out of place.
    for nch in [2u32, 8] {
        for proto in ["LL", "LL128", "Simple"] {
            let mut common = kv(&[
                ("NCCL_ALGO", "tree"),
                ("OXCCL_CHILD_WANT_ALGO", "tree"),
                ("NCCL_PROTO", proto),
                ("OXCCL_CHILD_WANT_PROTO", proto),
                ("OXCCL_CHILD_DTYPES", "int8,bfloat16,int64"),
                ("OXCCL_CHILD_OPS", "sum,prod,min,avg"),
                ("OXCCL_CHILD_COUNTS", "1,1001,40000"),
            ]);
            if nch == 8 {
                common.push(("OXCCL_CHILD_DTYPES", "float".to_string()));
            }
            let what = format!("tree on mesh rings {nch} channels {proto}");
            let outs = must_pass(&what, "ar", &common, &mesh_envs(nch), SECS(90));
            check_mesh_rings(&what, &outs, nch as usize);
            assert!(outs[0].contains("Trees [0]"), "{what}: no trees:\n{}", outs[0]);
        }
    }
}

#[test]
fn per_channel_rings_with_shm_disabled_on_some_ranks() {
    // The mesh rings across two hosts with NCCL_SHM_DISABLE=1 on ranks 1 and 6: inside each
    // host some channels' edges now go over NET and others over SHM, so a rank mixes SHM and NET
    // neighbours differently per channel, on both hosts. Every collective in place, 6 channels.
    for proto in ["LL", "Simple"] {
        let mut envs = mesh_envs(6);
        for r in [1, 6] {
            envs[r].push(("NCCL_SHM_DISABLE", "1".to_string()));
        }
        let common = kv(&[
            ("NCCL_PROTO", proto),
            ("OXCCL_CHILD_WANT_PROTO", proto),
            ("OXCCL_CHILD_COUNTS", "1,1001,24577"),
        ]);
        let what = format!("mesh rings, SHM off on 1 and 6, {proto}");
        let outs = must_pass(&what, "colls", &common, &envs, SECS(90));
        check_mesh_rings_off(&what, &outs, 6, &[1, 6]);
    }
}
