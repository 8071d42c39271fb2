//! `oxccl::group::scope`, the group whose collectives are deferred to its end as NCCL defers them,
//! checked exactly on the CPU target with one thread issuing every rank's calls: nothing is
//! launched before the scope's end and everything is exact after it (collectives, sends and
//! receives together); a call refused inside the scope runs none of the group; a group too large
//! for one launch runs none of it, its collectives included; a panic inside the closure ends the
//! group with nothing launched; a scope nested in `group_start` … `group_end` runs its
//! collectives at its end and its sends at the enclosing end; many AllReduces (count 0 included)
//! and sends in one scope, from one thread or a scope per rank thread; PreMulSum; the
//! call-signature check on deferred collectives; refused collectives naming their argument.
use crate::common;

use common::env::Env;
use common::{BACK, FRONT, sentinel};
use oxccl::group::GroupScope;
use oxccl::{Comm, DataType, DevSlice, Device, DeviceBuffer, Error, RedOp, Stream};

/// A buffer of `n` f32 between guards: `data` written, or every byte `salt`'s sentinel.
pub(super) fn guarded(dev: Device, n: usize, salt: u8, data: Option<&[f32]>) -> DeviceBuffer {
    let b = dev.alloc(FRONT + 4 * n + BACK).unwrap();
    b.write(0, &sentinel(FRONT + 4 * n + BACK, salt)).unwrap();
    if let Some(d) = data {
        let bytes: Vec<u8> = d.iter().flat_map(|v| v.to_ne_bytes()).collect();
        b.write(FRONT, &bytes).unwrap();
    }
    b
}

/// The `n` floats of `b` between its guards, whose bytes must still be `salt`'s sentinel.
pub(super) fn floats(b: &DeviceBuffer, n: usize, salt: u8, what: &str) -> Vec<f32> {
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
pub(super) fn untouched(b: &DeviceBuffer, n: usize, salt: u8) -> bool {
    b.to_vec().unwrap() == sentinel(FRONT + 4 * n + BACK, salt)
}

pub(super) fn data(b: &DeviceBuffer, n: usize) -> DevSlice<'_> {
    b.slice(FRONT, 4 * n).unwrap()
}

/// Rank `r`'s input element `i` (small integers: every sum is exact in f32).
pub(super) fn input(r: usize, i: usize) -> f32 {
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
        }
        ring(g, &comms, &streams, &ar_in, &p2p_out, count)?;
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
    all_reduce_outside(&comms, &streams, &ins, &outs, count);
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

/// In scope `g`, every rank `r` sends `count` floats of `ins[r]` to the next rank and receives
/// the previous rank's into `outs[r]`.
fn ring<'s>(
    g: &GroupScope<'s>,
    comms: &'s [Comm],
    streams: &'s [Stream],
    ins: &'s [DeviceBuffer],
    outs: &'s [DeviceBuffer],
    count: usize,
) -> oxccl::Result<()> {
    let n = comms.len();
    for (r, c) in comms.iter().enumerate() {
        let s = &streams[r];
        g.send(c, data(&ins[r], count), count, DataType::F32, (r + 1) % n, s)?;
        g.recv(c, data(&outs[r], count), count, DataType::F32, (r + n - 1) % n, s)?;
    }
    Ok(())
}

/// AllReduces (in `ins[r]`, out `outs[r]`) of `count` floats on every rank, outside any group.
fn all_reduce_outside(
    comms: &[Comm],
    streams: &[Stream],
    ins: &[DeviceBuffer],
    outs: &[DeviceBuffer],
    count: usize,
) {
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
}

/// A panic inside a scope's closure, after every rank's AllReduce and a ring of sends and
/// receives were issued, unwinds out of `scope` with the thread's group ended (depth 0) and
/// nothing launched (every output untouched after the streams drain); the communicators then
/// run an AllReduce, a send ring and another scope exactly.
#[test]
fn a_panic_inside_a_scope_launches_nothing_and_leaves_the_communicators_usable() {
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (n, count) = (3usize, 300usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let own = |r: usize| (0..count).map(|i| input(r, i)).collect::<Vec<f32>>();
    let ins: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 1, Some(&own(r)))).collect();
    let outs: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let p2p: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 3, None)).collect();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        oxccl::group::scope(|g| {
            for (r, c) in comms.iter().enumerate() {
                let (i, o) = (data(&ins[r], count), data(&outs[r], count));
                g.all_reduce(c, i, o, count, DataType::F32, RedOp::Sum, &streams[r])
                    .unwrap();
            }
            ring(g, &comms, &streams, &ins, &p2p, count).unwrap();
            panic!("the closure panics");
        })
    }));
    let payload = caught.unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the closure panics"));
    assert_eq!(oxccl::group::group_depth(), 0);
    common::sync_all(&streams, "after the panic");
    for r in 0..n {
        assert!(untouched(&outs[r], count, 2), "rank {r}: the AllReduce ran");
        assert!(untouched(&p2p[r], count, 3), "rank {r}: the receive ran");
    }
    // The communicators go on: outside a group, then in a scope.
    all_reduce_outside(&comms, &streams, &ins, &outs, count);
    for (r, c) in comms.iter().enumerate() {
        c.send(
            data(&ins[r], count),
            count,
            DataType::F32,
            (r + 1) % n,
            &streams[r],
        )
        .unwrap();
        c.recv(
            data(&p2p[r], count),
            count,
            DataType::F32,
            (r + n - 1) % n,
            &streams[r],
        )
        .unwrap();
    }
    common::sync_all(&streams, "after the panic, outside a group");
    let sum: Vec<f32> = (0..count).map(|i| (0..n).map(|r| input(r, i)).sum()).collect();
    for r in 0..n {
        assert_eq!(floats(&outs[r], count, 2, "AllReduce"), sum, "rank {r}");
        assert_eq!(
            floats(&p2p[r], count, 3, "receive"),
            own((r + n - 1) % n),
            "rank {r}"
        );
    }
    let max: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 4, None)).collect();
    oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let (i, o) = (data(&ins[r], count), data(&max[r], count));
            g.all_reduce(c, i, o, count, DataType::F32, RedOp::Max, &streams[r])?;
        }
        ring(g, &comms, &streams, &ins, &p2p, count)
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "a scope after the panic");
    for r in 0..n {
        assert_eq!(floats(&max[r], count, 4, "AllReduce max"), own(n - 1), "rank {r}");
        assert_eq!(
            floats(&p2p[r], count, 3, "receive"),
            own((r + n - 1) % n),
            "rank {r}"
        );
    }
}

/// A scope is refused inside an open `group_start` (the enclosing end would launch the scope's
/// sends and receives after its borrows end): its closure never runs, the enclosing group goes
/// on and its ring is exact at its end. A scope whose closure leaves a `group_start` of its own
/// open is refused at its end, with nothing of its group run and no group left open.
#[test]
fn a_scope_inside_an_open_group_or_leaving_one_open_is_refused_with_nothing_run() {
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (n, count) = (3usize, 400usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let own = |r: usize| (0..count).map(|i| input(r, i)).collect::<Vec<f32>>();
    let ins: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 1, Some(&own(r)))).collect();
    let outs: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let (next, prev) = (|r: usize| (r + 1) % n, |r: usize| (r + n - 1) % n);
    oxccl::group_start().unwrap();
    for (r, c) in comms.iter().enumerate() {
        let s = &streams[r];
        c.send(data(&ins[r], count), count, DataType::F32, next(r), s)
            .unwrap();
        c.recv(data(&outs[r], count), count, DataType::F32, prev(r), s)
            .unwrap();
    }
    let mut ran = false;
    let e = oxccl::group::scope(|_| ran = true).unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("oxccl::group::scope inside an open group (group depth 1 on this thread)"),
        "{e}"
    );
    assert!(!ran, "the closure of a refused scope ran");
    assert_eq!(oxccl::group::group_depth(), 1);
    oxccl::group_end().unwrap();
    common::sync_all(&streams, "the enclosing group");
    for r in 0..n {
        assert_eq!(
            floats(&outs[r], count, 2, "ring"),
            own(prev(r)),
            "rank {r}: the enclosing group's ring"
        );
    }
    // A closure that leaves a group of its own open: nothing of the scope's group runs.
    let ar: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 3, None)).collect();
    let e = oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let (i, o) = (data(&ins[r], count), data(&ar[r], count));
            g.all_reduce(c, i, o, count, DataType::F32, RedOp::Sum, &streams[r])?;
        }
        oxccl::group_start()
    })
    .unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
    assert!(
        e.to_string().contains("must be balanced")
            && e.to_string()
                .contains("collectives and what was still queued did not run"),
        "{e}"
    );
    assert_eq!(oxccl::group::group_depth(), 0);
    common::sync_all(&streams, "an unbalanced scope");
    for r in 0..n {
        assert!(
            untouched(&ar[r], count, 3),
            "rank {r}: an unbalanced scope's AllReduce ran"
        );
    }
}

/// The operator and count of the `k`-th AllReduce of [`many_all_reduces_and_a_ring`]: Sum,
/// Max, Min, Prod in turn; counts from 0 to 1199, 0 every tenth call.
fn kth(k: usize) -> (RedOp, usize) {
    let op = [RedOp::Sum, RedOp::Max, RedOp::Min, RedOp::Prod][k % 4];
    (op, if k % 10 == 0 { 0 } else { (k * 397) % 1200 })
}

/// Rank `r`'s element `i` of the `k`-th AllReduce (1 to 3 for Prod: every product exact).
fn kth_input(k: usize, r: usize, i: usize) -> f32 {
    match kth(k).0 {
        RedOp::Prod => ((r + i + k) % 3 + 1) as f32,
        _ => input(r, i) + k as f32,
    }
}

/// Rank `r`'s part of [`many_all_reduces_and_a_ring`]: its AllReduces, then a send to the next
/// rank and a receive from the previous one.
#[allow(clippy::too_many_arguments)]
fn issue_many<'s>(
    g: &GroupScope<'s>,
    r: usize,
    comms: &'s [Comm],
    streams: &'s [Stream],
    ins: &'s [Vec<DeviceBuffer>],
    outs: &'s [Vec<DeviceBuffer>],
    p2p: &'s [DeviceBuffer],
    ring_count: usize,
) -> oxccl::Result<()> {
    let (n, c, s) = (comms.len(), &comms[r], &streams[r]);
    for k in 0..ins.len() {
        let (op, count) = kth(k);
        let (i, o) = (data(&ins[k][r], count), data(&outs[k][r], count));
        g.all_reduce(c, i, o, count, DataType::F32, op, s)?;
    }
    let last = ins.len() - 1;
    g.send(
        c,
        data(&ins[last][r], ring_count),
        ring_count,
        DataType::F32,
        (r + 1) % n,
        s,
    )?;
    g.recv(
        c,
        data(&p2p[r], ring_count),
        ring_count,
        DataType::F32,
        (r + n - 1) % n,
        s,
    )?;
    Ok(())
}

/// 50 AllReduces (Sum, Max, Min, Prod; counts 0 to 1199, several 0) and a ring of sends on
/// `n` ranks inside one scope — one thread issuing every rank's calls, or (`threaded`) each
/// rank's thread in its own scope: every output exact, the count-0 calls' outputs untouched.
fn many_all_reduces_and_a_ring(n: usize, threaded: bool) {
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (calls, ring_count) = (50usize, 700usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let ins: Vec<Vec<_>> = (0..calls)
        .map(|k| {
            let count = kth(k).1.max(ring_count);
            (0..n)
                .map(|r| {
                    let v: Vec<f32> = (0..count).map(|i| kth_input(k, r, i)).collect();
                    guarded(dev(r), count, 1, Some(&v))
                })
                .collect()
        })
        .collect();
    let outs: Vec<Vec<_>> = (0..calls)
        .map(|k| (0..n).map(|r| guarded(dev(r), kth(k).1, 2, None)).collect())
        .collect();
    let p2p: Vec<_> = (0..n).map(|r| guarded(dev(r), ring_count, 3, None)).collect();
    let (c, s, i, o, p) = (&comms[..], &streams[..], &ins[..], &outs[..], &p2p[..]);
    if threaded {
        common::on_threads(n, |r| {
            oxccl::group::scope(|g| issue_many(g, r, c, s, i, o, p, ring_count))
                .unwrap()
                .unwrap();
            assert_eq!(oxccl::group::group_depth(), 0);
        });
    } else {
        oxccl::group::scope(|g| (0..n).try_for_each(|r| issue_many(g, r, c, s, i, o, p, ring_count)))
            .unwrap()
            .unwrap();
    }
    common::sync_all(&streams, "after the scope");
    for k in 0..calls {
        let (op, count) = kth(k);
        let want: Vec<f32> = (0..count)
            .map(|i| {
                let xs = (0..n).map(|r| kth_input(k, r, i));
                match op {
                    RedOp::Sum => xs.sum(),
                    RedOp::Prod => xs.product(),
                    RedOp::Max => xs.fold(f32::MIN, f32::max),
                    _ => xs.fold(f32::MAX, f32::min),
                }
            })
            .collect();
        for r in 0..n {
            let what = format!("rank {r}: AllReduce #{k} ({op:?}, count {count})");
            assert_eq!(floats(&outs[k][r], count, 2, &what), want, "{what}");
            if count == 0 {
                assert!(untouched(&outs[k][r], 0, 2), "{what}");
            }
        }
    }
    for r in 0..n {
        let from = (r + n - 1) % n;
        let want: Vec<f32> = (0..ring_count).map(|i| kth_input(calls - 1, from, i)).collect();
        assert_eq!(
            floats(&p2p[r], ring_count, 3, "receive"),
            want,
            "rank {r}: receive"
        );
    }
}

/// [`many_all_reduces_and_a_ring`] on 2 and 4 ranks, one thread issuing every rank's calls.
#[test]
fn many_all_reduces_and_sends_in_one_scope_of_one_thread_exact() {
    many_all_reduces_and_a_ring(2, false);
    many_all_reduces_and_a_ring(4, false);
}

/// [`many_all_reduces_and_a_ring`] on 2 and 4 ranks, each rank's thread in its own scope.
#[test]
fn many_all_reduces_and_sends_in_a_scope_per_rank_thread_exact() {
    many_all_reduces_and_a_ring(2, true);
    many_all_reduces_and_a_ring(4, true);
}

/// PreMulSum deferred in a scope, one thread issuing every rank's calls: on 3 ranks an
/// AllReduce with each rank's host scalar (0.5, 2, 4) and a ReduceScatter with each rank's
/// device-resident scalar (r + 2, in a buffer the scope borrows); on 1 rank an AllReduce by 3
/// (the one-rank kernel path). Inputs are small integers: every output is exact.
#[test]
fn premulsum_deferred_in_a_scope_exact() {
    use oxccl::{ReduceOp, Scalar};
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (n, count) = (3usize, 600usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let host_scalar = |r: usize| [0.5f32, 2.0, 4.0][r];
    let own = |r: usize, len: usize| (0..len).map(|i| input(r, i)).collect::<Vec<f32>>();
    let ar_in: Vec<_> = (0..n)
        .map(|r| guarded(dev(r), count, 1, Some(&own(r, count))))
        .collect();
    let ar_out: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let rs_in: Vec<_> = (0..n)
        .map(|r| guarded(dev(r), n * count, 3, Some(&own(r, n * count))))
        .collect();
    let rs_out: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 4, None)).collect();
    let scalars: Vec<_> = (0..n)
        .map(|r| {
            let b = dev(r).alloc(4).unwrap();
            b.write(0, &(r as f32 + 2.0).to_ne_bytes()).unwrap();
            b
        })
        .collect();
    let one = common::init_all(&Device::cpus(1)).unwrap();
    let one_stream = one[0].device().new_stream().unwrap();
    let one_in = guarded(one[0].device(), count, 5, Some(&own(7, count)));
    let one_out = guarded(one[0].device(), count, 6, None);
    oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let s = &streams[r];
            let op = ReduceOp::PreMulSum(Scalar::from_f64(host_scalar(r) as f64, DataType::F32));
            let (i, o) = (data(&ar_in[r], count), data(&ar_out[r], count));
            g.all_reduce(c, i, o, count, DataType::F32, op, s)?;
            let op = ReduceOp::PreMulSumDevice(scalars[r].as_slice());
            let (i, o) = (data(&rs_in[r], n * count), data(&rs_out[r], count));
            g.reduce_scatter(c, i, o, count, DataType::F32, op, s)?;
        }
        let op = ReduceOp::PreMulSum(Scalar::from_f64(3.0, DataType::F32));
        let (i, o) = (data(&one_in, count), data(&one_out, count));
        g.all_reduce(&one[0], i, o, count, DataType::F32, op, &one_stream)
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "after the scope");
    one_stream.synchronize().unwrap();
    let ar_want: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|r| host_scalar(r) * input(r, i)).sum())
        .collect();
    for r in 0..n {
        assert_eq!(
            floats(&ar_out[r], count, 2, "AllReduce"),
            ar_want,
            "rank {r}: AllReduce"
        );
        let rs_want: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|q| (q as f32 + 2.0) * input(q, r * count + i)).sum())
            .collect();
        assert_eq!(
            floats(&rs_out[r], count, 4, "ReduceScatter"),
            rs_want,
            "rank {r}: ReduceScatter"
        );
    }
    let one_want: Vec<f32> = own(7, count).iter().map(|v| 3.0 * v).collect();
    assert_eq!(
        floats(&one_out, count, 6, "one rank"),
        one_want,
        "one rank's AllReduce"
    );
}

/// The variables the call-signature tests set: cleared (both spellings) around them.
const CHECK_VARS: &[&str] = &["CHECK_CALLS", "TIMEOUT", "PROTO", "ALGO", "NCHANNELS_PER_PEER"];

/// With the call-signature check on (`OXCCL_CHECK_CALLS=1`), a scope's deferred AllReduce and
/// Broadcast and its ring of sends on 3 ranks run exactly; then, on new communicators, a scope
/// in which rank 2's AllReduce has another count (1000 against 1024) returns Ok at its end, and
/// every rank's stream reports the check's error naming both calls (numbered #1: the check at
/// the call counts nothing) with no output byte written.
#[test]
fn the_call_check_compares_a_scopes_deferred_collectives() {
    let env = Env::clean(CHECK_VARS);
    env.set(&[("OXCCL_CHECK_CALLS", "1"), ("OXCCL_TIMEOUT", "20")]);
    let (n, count) = (3usize, 1024usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let own = |r: usize| (0..count).map(|i| input(r, i)).collect::<Vec<f32>>();
    let ins: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 1, Some(&own(r)))).collect();
    let outs: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let bc: Vec<_> = (0..n)
        .map(|r| guarded(dev(r), count, 3, (r == 0).then(|| own(5)).as_deref()))
        .collect();
    let p2p: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 4, None)).collect();
    oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let s = &streams[r];
            let (i, o) = (data(&ins[r], count), data(&outs[r], count));
            g.all_reduce(c, i, o, count, DataType::F32, RedOp::Sum, s)?;
            let root_send = (r == 0).then(|| data(&bc[r], count));
            g.broadcast(c, root_send, data(&bc[r], count), count, DataType::F32, 0, s)?;
        }
        ring(g, &comms, &streams, &ins, &p2p, count)
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "matching calls");
    let sum: Vec<f32> = (0..count).map(|i| (0..n).map(|r| input(r, i)).sum()).collect();
    for r in 0..n {
        comms[r].get_async_error().unwrap();
        assert_eq!(
            floats(&outs[r], count, 2, "AllReduce"),
            sum,
            "rank {r}: AllReduce"
        );
        assert_eq!(
            floats(&bc[r], count, 3, "Broadcast"),
            own(5),
            "rank {r}: Broadcast"
        );
        assert_eq!(
            floats(&p2p[r], count, 4, "receive"),
            own((r + n - 1) % n),
            "rank {r}"
        );
    }

    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let ins: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 1, Some(&own(r)))).collect();
    let outs: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let t = std::time::Instant::now();
    oxccl::group::scope(|g| {
        for (r, c) in comms.iter().enumerate() {
            let k = if r == 2 { 1000 } else { count };
            let (i, o) = (data(&ins[r], k), data(&outs[r], k));
            g.all_reduce(c, i, o, k, DataType::F32, RedOp::Sum, &streams[r])?;
        }
        Ok::<(), Error>(())
    })
    .unwrap()
    .unwrap();
    let want = "the ranks issued different calls (OXCCL_CHECK_CALLS): ranks 0, 1 issued allreduce call #1 \
                (1024 × float, op sum; ring/LL on 1 channel); rank 2 issued allreduce call #1 (1000 × float, \
                op sum; ring/LL on 1 channel); they differ in count; no user buffer was written, abort or destroy the \
                communicator";
    for r in 0..n {
        streams[r].synchronize().unwrap();
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "rank {r}: {:?}",
            t.elapsed()
        );
        let e = comms[r].get_async_error().unwrap_err();
        assert!(matches!(e, Error::InvalidUsage(_)), "rank {r}: {e}");
        assert_eq!(
            e.to_string(),
            format!("invalid usage: rank {r} of communicator {:08x}: {want}", comms[r].comm_id()),
            "rank {r}"
        );
        assert!(
            untouched(&outs[r], count, 2),
            "rank {r}: the mismatched AllReduce wrote"
        );
    }
    for c in &comms {
        c.abort().unwrap();
    }
}

/// Collectives refused inside a scope, each after valid AllReduces and sends of every rank:
/// a Broadcast with root 2 of 2 ranks and an AllGather whose output is one element short. Each
/// returns InvalidArgument at the call naming the argument, the scope returns that error, and
/// nothing of the group ran.
#[test]
fn a_collective_refused_inside_a_scope_names_its_argument_and_runs_none_of_the_group() {
    let _env = Env::clean(&["NCHANNELS_PER_PEER"]);
    let (n, count) = (2usize, 128usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let ins: Vec<_> = (0..n)
        .map(|r| guarded(dev(r), n * count, 1, Some(&vec![r as f32 + 1.0; n * count])))
        .collect();
    let outs: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let p2p: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 3, None)).collect();
    let gathered: Vec<_> = (0..n).map(|r| guarded(dev(r), n * count, 4, None)).collect();
    // `bad`: 0, the Broadcast; 1, the AllGather.
    let refused = |bad: usize| -> (String, Error) {
        let mut at_call = String::new();
        let e = oxccl::group::scope(|g| {
            for (r, c) in comms.iter().enumerate() {
                let (i, o) = (data(&ins[r], count), data(&outs[r], count));
                g.all_reduce(c, i, o, count, DataType::F32, RedOp::Sum, &streams[r])?;
            }
            ring(g, &comms, &streams, &ins, &p2p, count)?;
            let (c, s) = (&comms[bad], &streams[bad]);
            let call = if bad == 0 {
                let (i, o) = (Some(data(&ins[0], count)), data(&outs[0], count));
                g.broadcast(c, i, o, count, DataType::F32, 2, s)
            } else {
                let (i, o) = (data(&ins[1], count), data(&gathered[1], n * count - 1));
                g.all_gather(c, i, o, count, DataType::F32, s)
            };
            at_call = call.unwrap_err().to_string();
            Ok::<(), Error>(())
        })
        .unwrap_err();
        (at_call, e)
    };
    let check = |what: &str| {
        assert_eq!(oxccl::group::group_depth(), 0, "{what}");
        common::sync_all(&streams, what);
        for r in 0..n {
            assert!(untouched(&outs[r], count, 2), "{what}: rank {r}'s AllReduce ran");
            assert!(untouched(&p2p[r], count, 3), "{what}: rank {r}'s receive ran");
            assert!(
                untouched(&gathered[r], n * count, 4),
                "{what}: rank {r}'s output written"
            );
        }
    };
    let (at_call, e) = refused(0);
    let want = "invalid argument: root 2 is out of range for broadcast (accepted: 0..=1)";
    assert_eq!(at_call, want);
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert_eq!(e.to_string(), want);
    check("a Broadcast with a bad root");
    let (at_call, e) = refused(1);
    let want = "invalid argument: recvbuff holds 1020 bytes but allgather of count 128 × float (4 bytes \
                each) needs 1024 on rank 1";
    assert_eq!(at_call, want);
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert_eq!(e.to_string(), want);
    check("an AllGather with a short output");
}

/// On GPUs (two, or one shared by two ranks, one thread issuing both ranks' calls in turn):
/// AllReduce, AllGather and a ring of sends and receives in one scope; with the scope open
/// every stream is idle and every output untouched, after it every output is exact.
#[test]
fn gpu_a_scope_launches_its_collectives_and_sends_at_its_end_exact() {
    let test = "gpu_a_scope_launches_its_collectives_and_sends_at_its_end_exact";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    let dog = common::Watchdog::new(test, std::time::Duration::from_secs(60));
    let (n, count) = (2usize, 100_000usize);
    let comms = common::init_all(&devices).unwrap();
    let streams = common::streams(&comms);
    let dev = |r: usize| comms[r].device();
    let own = |r: usize| (0..count).map(|i| input(r, i)).collect::<Vec<f32>>();
    let ins: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 1, Some(&own(r)))).collect();
    let ar: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 2, None)).collect();
    let ag: Vec<_> = (0..n).map(|r| guarded(dev(r), n * count, 3, None)).collect();
    let p2p: Vec<_> = (0..n).map(|r| guarded(dev(r), count, 4, None)).collect();
    dog.step("the scope".to_string());
    oxccl::group::scope(|g| {
        // Call by call across the ranks (ranks sharing a GPU launch call n + 1 only once every
        // rank launched call n).
        for (r, c) in comms.iter().enumerate() {
            let (i, o) = (data(&ins[r], count), data(&ar[r], count));
            g.all_reduce(c, i, o, count, DataType::F32, RedOp::Sum, &streams[r])?;
        }
        for (r, c) in comms.iter().enumerate() {
            let (i, o) = (data(&ins[r], count), data(&ag[r], n * count));
            g.all_gather(c, i, o, count, DataType::F32, &streams[r])?;
        }
        ring(g, &comms, &streams, &ins, &p2p, count)?;
        common::sync_all(&streams, "inside the scope");
        for r in 0..n {
            assert!(
                untouched(&ar[r], count, 2),
                "rank {r}: AllReduce ran inside the scope"
            );
            assert!(
                untouched(&ag[r], n * count, 3),
                "rank {r}: AllGather ran inside the scope"
            );
            assert!(
                untouched(&p2p[r], count, 4),
                "rank {r}: the receive ran inside the scope"
            );
        }
        Ok::<(), Error>(())
    })
    .unwrap()
    .unwrap();
    dog.step("after the scope".to_string());
    common::sync_all(&streams, "after the scope");
    let sum: Vec<f32> = (0..count).map(|i| (0..n).map(|r| input(r, i)).sum()).collect();
    let all: Vec<f32> = (0..n).flat_map(own).collect();
    for r in 0..n {
        assert_eq!(floats(&ar[r], count, 2, "AllReduce"), sum, "rank {r}: AllReduce");
        assert_eq!(
            floats(&ag[r], n * count, 3, "AllGather"),
            all,
            "rank {r}: AllGather"
        );
        assert_eq!(
            floats(&p2p[r], count, 4, "receive"),
            own((r + 1) % n),
            "rank {r}: receive"
        );
    }
    drop(dog);
}
