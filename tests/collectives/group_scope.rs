//! `oxccl::group::scope`, the group whose collectives are deferred to its end as NCCL defers them,
//! checked exactly on the CPU target with one thread issuing every rank's calls: nothing is
//! launched before the scope's end and everything is exact after it (collectives, sends and
//! receives together); a call refused inside the scope runs none of the group; a group too large
//! for one launch runs none of it, its collectives included.
use crate::common;

use common::env::Env;
use common::{BACK, FRONT, sentinel};
use oxccl::{DataType, DevSlice, Device, DeviceBuffer, Error, RedOp};

/// A buffer of `n` f32 between guards: `data` written, or every byte `salt`'s sentinel.
fn guarded(dev: Device, n: usize, salt: u8, data: Option<&[f32]>) -> DeviceBuffer {
    let b = dev.alloc(FRONT + 4 * n + BACK).unwrap();
    b.write(0, &sentinel(FRONT + 4 * n + BACK, salt)).unwrap();
    if let Some(d) = data {
        let bytes: Vec<u8> = d.iter().flat_map(|v| v.to_ne_bytes()).collect();
        b.write(FRONT, &bytes).unwrap();
    }
    b
}

/// The `n` floats of `b` between its guards, whose bytes must still be `salt`'s sentinel.
fn floats(b: &DeviceBuffer, n: usize, salt: u8, what: &str) -> Vec<f32> {
    let got = b.to_vec().unwrap();
    let poison = sentinel(FRONT + 4 * n + BACK, salt);
    assert!(
        got[..FRONT] == poison[..FRONT] && got[FRONT + 4 * n..] == poison[FRONT + 4 * n..],
        "{what}: guards"
    );
    got[FRONT..FRONT + 4 * n]
        .chunks(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Whether every byte of `b` (data and guards) is still `salt`'s sentinel.
fn untouched(b: &DeviceBuffer, n: usize, salt: u8) -> bool {
    b.to_vec().unwrap() == sentinel(FRONT + 4 * n + BACK, salt)
}

fn data(b: &DeviceBuffer, n: usize) -> DevSlice<'_> {
    b.slice(FRONT, 4 * n).unwrap()
}

/// Rank `r`'s input element `i` (small integers: every sum is exact in f32).
fn input(r: usize, i: usize) -> f32 {
    (r * 1000 + i % 997) as f32
}

/// One thread issues every rank's AllReduce, Broadcast (in place, root 1), AllGather,
/// ReduceScatter and a ring of sends and receives inside one scope: with the scope still open
/// every stream is idle and every output untouched; after it, every output is exact.
#[test]
fn a_scope_launches_its_collectives_and_sends_at_its_end_exact() {
    let _env = Env::clean(&["NCHANNELS_PER_PEER", "P2P_DISABLE", "SHM_DISABLE"]);
    let (n, count) = (3usize, 1000usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let own = |r: usize| (0..count).map(|i| input(r, i)).collect::<Vec<f32>>();
    let all: Vec<f32> = (0..n).flat_map(own).collect();
    let ar_in: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 1, Some(&own(r)))).collect();
    let ar_out: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let bc: Vec<_> = (0..n)
        .map(|r| guarded(dev(r), count, 3, (r == 1).then(|| own(7)).as_deref()))
        .collect();
    let ag_out: Vec<_> = (0..n).map(|r| guarded(dev(r), n * count, 4, None)).collect();
    // ReduceScatter's inputs: every rank's `all`, plus its rank (the maximum: the last rank's).
    let rs_in: Vec<_> = (0..n)
        .map(|r| {
            guarded(
                dev(r),
                n * count,
                5,
                Some(&all.iter().map(|v| v + r as f32).collect::<Vec<_>>()),
            )
        })
        .collect();
    let rs_out: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 6, None)).collect();
    let p2p_out: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 7, None)).collect();
    oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let s = &streams[r];
            g.all_reduce(
                c,
                data(&ar_in[r], count),
                data(&ar_out[r], count),
                count,
                DataType::F32,
                RedOp::Sum,
                s,
            )?;
            let root_send = (r == 1).then(|| data(&bc[r], count));
            g.broadcast(c, root_send, data(&bc[r], count), count, DataType::F32, 1, s)?;
            g.all_gather(
                c,
                data(&ar_in[r], count),
                data(&ag_out[r], n * count),
                count,
                DataType::F32,
                s,
            )?;
            g.reduce_scatter(
                c,
                data(&rs_in[r], n * count),
                data(&rs_out[r], count),
                count,
                DataType::F32,
                RedOp::Max,
                s,
            )?;
            g.send(c, data(&ar_in[r], count), count, DataType::F32, (r + 1) % n, s)?;
            g.recv(
                c,
                data(&p2p_out[r], count),
                count,
                DataType::F32,
                (r + n - 1) % n,
                s,
            )?;
        }
        // Nothing is launched before the scope's end.
        common::sync_all(&streams, "inside the scope");
        for r in 0..n {
            assert!(
                untouched(&ar_out[r], count, 2),
                "rank {r}: AllReduce ran inside the scope"
            );
            assert!(
                untouched(&ag_out[r], n * count, 4),
                "rank {r}: AllGather ran inside the scope"
            );
            assert!(
                untouched(&rs_out[r], count, 6),
                "rank {r}: ReduceScatter ran inside the scope"
            );
            assert!(
                untouched(&p2p_out[r], count, 7),
                "rank {r}: the receive ran inside the scope"
            );
            if r != 1 {
                assert!(
                    untouched(&bc[r], count, 3),
                    "rank {r}: Broadcast ran inside the scope"
                );
            }
        }
        Ok::<(), Error>(())
    })
    .unwrap()
    .unwrap();
    assert_eq!(oxccl::group::group_depth(), 0);
    common::sync_all(&streams, "after the scope");
    let sum: Vec<f32> = (0..count).map(|i| (0..n).map(|r| input(r, i)).sum()).collect();
    let max = |r: usize| own(r).iter().map(|v| v + (n - 1) as f32).collect::<Vec<f32>>();
    for r in 0..n {
        assert_eq!(
            floats(&ar_out[r], count, 2, "AllReduce"),
            sum,
            "rank {r}: AllReduce"
        );
        assert_eq!(
            floats(&bc[r], count, 3, "Broadcast"),
            own(7),
            "rank {r}: Broadcast"
        );
        assert_eq!(
            floats(&ag_out[r], n * count, 4, "AllGather"),
            all,
            "rank {r}: AllGather"
        );
        assert_eq!(
            floats(&rs_out[r], count, 6, "ReduceScatter"),
            max(r),
            "rank {r}: ReduceScatter"
        );
        assert_eq!(
            floats(&p2p_out[r], count, 7, "receive"),
            own((r + n - 1) % n),
            "rank {r}: receive"
        );
    }
}

/// A call refused inside a scope (a send to a rank that does not exist) returns its error at
/// the call and is the scope's error; none of the group runs — the valid AllReduces issued
/// before it leave their outputs untouched — and the communicators stay usable.
#[test]
fn a_call_refused_inside_a_scope_runs_none_of_the_group() {
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (n, count) = (2usize, 256usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let ins: Vec<_> = (0..n)
        .map(|r| guarded(comms[r].device(), count, 1, Some(&vec![r as f32 + 1.0; count])))
        .collect();
    let outs: Vec<_> = (0..n)
        .map(|r| guarded(comms[r].device(), count, 2, None))
        .collect();
    let e = oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let s = &streams[r];
            g.all_reduce(
                c,
                data(&ins[r], count),
                data(&outs[r], count),
                count,
                DataType::F32,
                RedOp::Sum,
                s,
            )?;
        }
        let refused = g
            .send(
                &comms[0],
                data(&ins[0], count),
                count,
                DataType::F32,
                5,
                &streams[0],
            )
            .unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("peer 5 of send is out of range on rank 0 (accepted: 0..=1)"),
            "{refused}"
        );
        Ok::<(), Error>(())
    })
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("peer 5"), "{e}");
    assert_eq!(oxccl::group::group_depth(), 0);
    common::sync_all(&streams, "a refused scope");
    for r in 0..n {
        assert!(
            untouched(&outs[r], count, 2),
            "rank {r}: the refused group's AllReduce ran"
        );
    }
    // The communicators go on: the same AllReduces outside a scope.
    for (r, c) in comms.iter().enumerate() {
        c.all_reduce(
            data(&ins[r], count),
            data(&outs[r], count),
            count,
            DataType::F32,
            RedOp::Sum,
            &streams[r],
        )
        .unwrap();
    }
    common::sync_all(&streams, "after a refused scope");
    for r in 0..n {
        assert_eq!(
            floats(&outs[r], count, 2, "AllReduce"),
            vec![3.0; count],
            "rank {r}"
        );
    }
}

/// A scope whose sends and receives need more blocks than one launch holds (10 ranks, 8 peer
/// channels per peer: 144 > 128) fails at its end naming the limit, and its collectives, issued
/// before the sends, do not run either.
#[test]
fn a_scope_too_large_for_one_launch_runs_none_of_its_collectives() {
    let env = Env::clean(&["NCHANNELS_PER_PEER"]);
    env.set(&[("NCCL_NCHANNELS_PER_PEER", "8")]);
    let (n, block) = (10usize, 16usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let ins: Vec<_> = (0..n)
        .map(|r| guarded(comms[r].device(), n * block, 1, Some(&vec![1.0; n * block])))
        .collect();
    let outs: Vec<_> = (0..n)
        .map(|r| guarded(comms[r].device(), n * block, 2, None))
        .collect();
    let e = oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let s = &streams[r];
            g.all_reduce(
                c,
                data(&ins[r], block),
                data(&outs[r], block),
                block,
                DataType::F32,
                RedOp::Sum,
                s,
            )?;
        }
        for (r, c) in comms.iter().enumerate() {
            for p in 0..n {
                let (at, s) = (FRONT + 4 * p * block, &streams[r]);
                g.send(
                    c,
                    ins[r].slice(at, 4 * block).unwrap(),
                    block,
                    DataType::F32,
                    p,
                    s,
                )?;
                g.recv(
                    c,
                    outs[r].slice(at, 4 * block).unwrap(),
                    block,
                    DataType::F32,
                    p,
                    s,
                )?;
            }
        }
        Ok::<(), Error>(())
    })
    .unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
    let m = e.to_string();
    assert!(
        m.contains("need 144 thread blocks in one launch, more than the 128")
            && m.contains("nothing was launched"),
        "{m}"
    );
    assert_eq!(oxccl::group::group_depth(), 0);
    common::sync_all(&streams, "a scope too large");
    for r in 0..n {
        assert!(
            untouched(&outs[r], n * block, 2),
            "rank {r}: the scope's AllReduce or a receive ran"
        );
    }
}

/// All-to-all, gather (root 0) and scatter (root 2), built from sends and receives, issued for
/// every rank inside one scope: none has run when the scope's closure ends, all are exact after.
#[test]
fn a_scopes_all_to_all_gather_and_scatter_run_at_its_end_exact() {
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (n, count) = (3usize, 500usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    // Rank r's block for rank p: input(r, p * count + i).
    let blocks = |r: usize| (0..n * count).map(|j| input(r, j)).collect::<Vec<f32>>();
    let ins: Vec<_> = (0..n)
        .map(|r| guarded(dev(r), n * count, 1, Some(&blocks(r))))
        .collect();
    let a2a: Vec<_> = (0..n).map(|r| guarded(dev(r), n * count, 2, None)).collect();
    let gathered: Vec<_> = (0..n).map(|r| guarded(dev(r), n * count, 3, None)).collect();
    let scattered: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 4, None)).collect();
    oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let s = &streams[r];
            g.all_to_all(
                c,
                data(&ins[r], n * count),
                data(&a2a[r], n * count),
                count,
                DataType::F32,
                s,
            )?;
            let root_recv = (r == 0).then(|| data(&gathered[r], n * count));
            g.gather(c, data(&ins[r], count), root_recv, count, DataType::F32, 0, s)?;
            let root_send = (r == 2).then(|| data(&ins[r], n * count));
            g.scatter(
                c,
                root_send,
                data(&scattered[r], count),
                count,
                DataType::F32,
                2,
                s,
            )?;
        }
        common::sync_all(&streams, "inside the scope");
        for r in 0..n {
            assert!(
                untouched(&a2a[r], n * count, 2),
                "rank {r}: the all-to-all ran inside the scope"
            );
            assert!(
                untouched(&scattered[r], count, 4),
                "rank {r}: the scatter ran inside the scope"
            );
        }
        assert!(
            untouched(&gathered[0], n * count, 3),
            "the gather ran inside the scope"
        );
        Ok::<(), Error>(())
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "after the scope");
    let block = |r: usize, p: usize| blocks(r)[p * count..(p + 1) * count].to_vec();
    for r in 0..n {
        let want: Vec<f32> = (0..n).flat_map(|p| block(p, r)).collect();
        assert_eq!(
            floats(&a2a[r], n * count, 2, "all-to-all"),
            want,
            "rank {r}: all-to-all"
        );
        assert_eq!(
            floats(&scattered[r], count, 4, "scatter"),
            block(2, r),
            "rank {r}: scatter"
        );
    }
    let want: Vec<f32> = (0..n).flat_map(|p| block(p, 0)).collect();
    assert_eq!(
        floats(&gathered[0], n * count, 3, "gather"),
        want,
        "gather at root 0"
    );
}
