//! Collectives inside a plain `group_start`/`group_end` pair, deferred to the outermost end as
//! NCCL defers them, checked exactly (out of place and in place, guards, every rank) with one
//! thread issuing every rank's calls: nothing runs before the outermost end (an inner end
//! launches nothing), every output is exact after it; the group's LL calls share launches; a
//! communicator, its buffers and streams dropped inside the group outlive its work; a call
//! refused inside the group returns its error at the call while the rest of the group runs; a
//! group whose sends cannot be launched runs none of its collectives either; a simulated end
//! drops them; finalize is refused while the group holds calls; calls made directly inside a
//! scope run in the order issued with the scope's and a refused one fails the scope; a rank's
//! copies (sends to itself, one-rank collectives) keep its launch order across streams; a rank
//! aborted inside a group of sends launches none of them; on GPUs the same group is exact.
use crate::common;

use super::group_scope::{data, floats, guarded, input, untouched};
use common::env::Env;
use oxccl::{Comm, DataType, Device, DeviceBuffer, Error, Func, RedOp, Stream};

const VARS: &[&str] = &["PROTO", "CHECK_CALLS", "NCHANNELS_PER_PEER", "P2P_DISABLE", "SHM_DISABLE"];

/// Rank `r`'s buffers of one group: AllReduce in and out, Broadcast in place (root 1), and a
/// ring receive.
struct Bufs {
    ar_in: DeviceBuffer,
    ar_out: DeviceBuffer,
    bc: DeviceBuffer,
    p2p_out: DeviceBuffer,
}

fn own(r: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| input(r, i)).collect()
}

fn bufs(dev: Device, r: usize, count: usize) -> Bufs {
    Bufs {
        ar_in: guarded(dev, count, 1, Some(&own(r, count))),
        ar_out: guarded(dev, count, 2, None),
        bc: guarded(dev, count, 3, (r == 1).then(|| own(7, count)).as_deref()),
        p2p_out: guarded(dev, count, 4, None),
    }
}

/// Issues rank `r`'s calls of the group: two AllReduce Sums (the second in place, on `ar_in`), the
/// Broadcast, a send to the next rank and a receive from the previous one.
fn issue(c: &Comm, b: &Bufs, count: usize, s: &Stream) -> oxccl::Result<()> {
    let (r, n, f) = (c.rank(), c.nranks(), DataType::F32);
    c.all_reduce(data(&b.ar_in, count), data(&b.ar_out, count), count, f, RedOp::Sum, s)?;
    c.all_reduce(data(&b.ar_in, count), data(&b.ar_in, count), count, f, RedOp::Sum, s)?;
    let root = (r == 1).then(|| data(&b.bc, count));
    c.broadcast(root, data(&b.bc, count), count, f, 1, s)?;
    c.send(data(&b.ar_out, count), count, f, (r + 1) % n, s)?;
    c.recv(data(&b.p2p_out, count), count, f, (r + n - 1) % n, s)
}

/// Whether none of rank `r`'s outputs was written (the in-place AllReduce's input included).
fn none_ran(b: &Bufs, r: usize, count: usize) -> bool {
    untouched(&b.ar_out, count, 2)
        && floats(&b.ar_in, count, 1, "AllReduce input") == own(r, count)
        && (r == 1 || untouched(&b.bc, count, 3))
        && untouched(&b.p2p_out, count, 4)
}

/// Every output of rank `r` of `n`: the sums (out of place and in place), the root's data, and
/// the previous rank's sums received (its AllReduce ran before its send, in the group's order).
fn check(b: &Bufs, r: usize, n: usize, count: usize, what: &str) {
    let sum: Vec<f32> = (0..count).map(|i| (0..n).map(|q| input(q, i)).sum()).collect();
    assert_eq!(floats(&b.ar_out, count, 2, what), sum, "{what}: rank {r}: AllReduce");
    assert_eq!(floats(&b.ar_in, count, 1, what), sum, "{what}: rank {r}: in-place AllReduce");
    assert_eq!(floats(&b.bc, count, 3, what), own(7, count), "{what}: rank {r}: Broadcast");
    assert_eq!(floats(&b.p2p_out, count, 4, what), sum, "{what}: rank {r}: receive");
}

/// One thread issues every rank's calls inside a nested group: after the inner end nothing has
/// run or launched, after the outer end every output is exact on every rank. On LL the two
/// AllReduces share a launch (3 per rank: AllReduces, Broadcast, sends and receives); on Simple
/// each is its own (4).
#[test]
fn collectives_in_a_group_launch_at_its_outermost_end_exact() {
    for (proto, launches) in [("LL", 3u64), ("Simple", 4)] {
        let env = Env::clean(VARS);
        env.set(&[("NCCL_PROTO", proto)]);
        let (n, count) = (3usize, 1000usize);
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        let streams = common::streams(&comms);
        let b: Vec<Bufs> = (0..n).map(|r| bufs(comms[r].device(), r, count)).collect();
        let before: Vec<u64> = comms.iter().map(|c| c.kernel_launches()).collect();
        oxccl::group_start().unwrap();
        oxccl::group_start().unwrap();
        for r in 0..n {
            issue(&comms[r], &b[r], count, &streams[r]).unwrap();
        }
        oxccl::group_end().unwrap();
        common::sync_all(&streams, "after the inner end");
        for r in 0..n {
            assert_eq!(comms[r].kernel_launches(), before[r], "{proto}: rank {r}: launched before the end");
            assert!(none_ran(&b[r], r, count), "{proto}: rank {r}: a call ran before the group's end");
        }
        oxccl::group_end().unwrap();
        assert_eq!(oxccl::group::group_depth(), 0);
        common::sync_all(&streams, "after the group");
        for r in 0..n {
            check(&b[r], r, n, count, proto);
            assert_eq!(comms[r].kernel_launches() - before[r], launches, "{proto}: rank {r}: launches");
        }
    }
}

/// The communicators, their streams and every input buffer are dropped before the group ends:
/// the group keeps them until its end has launched their work; every output is exact.
#[test]
fn communicators_streams_and_buffers_dropped_inside_a_group_outlive_its_collectives() {
    let _env = Env::clean(VARS);
    let (n, count) = (2usize, 4099usize);
    let devs = Device::cpus(n);
    let comms = common::init_all(&devs).unwrap();
    let streams = common::streams(&comms);
    let b: Vec<Bufs> = (0..n).map(|r| bufs(devs[r], r, count)).collect();
    let outs: Vec<DeviceBuffer> = (0..n).map(|r| guarded(devs[r], count, 5, None)).collect();
    oxccl::group_start().unwrap();
    for r in 0..n {
        issue(&comms[r], &b[r], count, &streams[r]).unwrap();
        let input = guarded(devs[r], count, 6, Some(&own(r + 10, count)));
        comms[r]
            .all_reduce(data(&input, count), data(&outs[r], count), count, DataType::F32, RedOp::Sum, &streams[r])
            .unwrap();
        drop(input);
    }
    drop(comms);
    drop(streams);
    oxccl::group_end().unwrap();
    // The group's end dropped the last handles: every rank's work has run (a communicator's
    // teardown waits for it), on streams destroyed after it.
    let want: Vec<f32> = (0..count).map(|i| (0..n).map(|r| input(r + 10, i)).sum()).collect();
    for r in 0..n {
        check(&b[r], r, n, count, "dropped inside the group");
        assert_eq!(floats(&outs[r], count, 5, "AllReduce of a dropped input"), want, "rank {r}");
    }
}

/// A Broadcast with a root out of range, issued inside a group, fails at the call naming the
/// root and the accepted range and is not queued; the rest of the group runs, exact.
#[test]
fn a_collective_refused_inside_a_group_fails_at_the_call_and_the_rest_runs() {
    let _env = Env::clean(VARS);
    let (n, count) = (3usize, 777usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let b: Vec<Bufs> = (0..n).map(|r| bufs(comms[r].device(), r, count)).collect();
    oxccl::group_start().unwrap();
    for r in 0..n {
        issue(&comms[r], &b[r], count, &streams[r]).unwrap();
        let e = comms[r]
            .broadcast(None, data(&b[r].ar_out, count), count, DataType::F32, n, &streams[r])
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains(&format!("root {n} is out of range for broadcast (accepted: 0..={})", n - 1)), "{e}");
    }
    oxccl::group_end().unwrap();
    common::sync_all(&streams, "after the group");
    for r in 0..n {
        check(&b[r], r, n, count, "a refused call in the group");
    }
}

/// A group whose sends and receives need more thread blocks than a launch holds fails at its
/// end naming the limit, and none of it runs: its AllReduces, queued before, leave their outputs
/// untouched. A simulated end drops a group's collectives the same way, and estimates their
/// time with the tuning model. The communicators stay usable.
#[test]
fn a_group_that_cannot_launch_or_is_simulated_runs_none_of_its_collectives() {
    let env = Env::clean(VARS);
    env.set(&[("NCCL_NCHANNELS_PER_PEER", "8")]);
    let (n, block) = (10usize, 16usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let ins: Vec<_> = (0..n)
        .map(|r| guarded(comms[r].device(), n * block, 1, Some(&vec![1.0; n * block])))
        .collect();
    let outs: Vec<_> = (0..n).map(|r| guarded(comms[r].device(), n * block, 2, None)).collect();
    let all_reduces = || {
        for (r, c) in comms.iter().enumerate() {
            let (i, o) = (data(&ins[r], block), data(&outs[r], block));
            c.all_reduce(i, o, block, DataType::F32, RedOp::Sum, &streams[r]).unwrap();
        }
    };
    oxccl::group_start().unwrap();
    all_reduces();
    for (r, c) in comms.iter().enumerate() {
        for p in 0..n {
            let at = common::FRONT + 4 * p * block;
            c.send(ins[r].slice(at, 4 * block).unwrap(), block, DataType::F32, p, &streams[r]).unwrap();
            c.recv(outs[r].slice(at, 4 * block).unwrap(), block, DataType::F32, p, &streams[r]).unwrap();
        }
    }
    let e = oxccl::group_end().unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("more than the 128") && m.contains("nothing was launched"), "{m}");
    oxccl::group_start().unwrap();
    all_reduces();
    // The estimate is the model's time of one rank's call: every rank issued one, and the
    // ranks of a group run at once.
    let one = comms[0].predict_us(Func::AllReduce, block, DataType::F32).unwrap();
    assert!(one > 0.0, "the model's time of an AllReduce of {block} floats: {one}");
    assert_eq!(oxccl::group::simulate_end().unwrap(), Some(one));
    // An inner end estimates nothing.
    oxccl::group_start().unwrap();
    oxccl::group_start().unwrap();
    all_reduces();
    assert_eq!(oxccl::group::simulate_end().unwrap(), None);
    let both = oxccl::group::simulate_end().unwrap();
    assert_eq!(both, Some(one), "the outer end estimates the calls of the inner level too");
    common::sync_all(&streams, "after the refused and the simulated group");
    for r in 0..n {
        assert!(untouched(&outs[r], n * block, 2), "rank {r}: a collective of the group ran");
    }
    // Still usable: the same AllReduces outside a group.
    all_reduces();
    common::sync_all(&streams, "after the group");
    for r in 0..n {
        assert_eq!(floats(&outs[r], n * block, 2, "AllReduce")[..block], vec![n as f32; block][..], "rank {r}");
    }
}

/// On GPUs (two ranks, sharing one when there is only one): one thread issues both ranks'
/// group, on LL and Simple; exact after the end, nothing run before it.
#[test]
fn gpu_collectives_in_a_group_launch_at_its_outermost_end_exact() {
    let test = "gpu_collectives_in_a_group_launch_at_its_outermost_end_exact";
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let _gpu = common::gpu_lock();
    for proto in ["LL", "Simple"] {
        let env = Env::clean(VARS);
        env.set(&[("NCCL_PROTO", proto)]);
        let comms = common::init_all(&devices).unwrap();
        drop(env);
        let (n, count) = (2usize, 100_003usize);
        let streams = common::streams(&comms);
        let b: Vec<Bufs> = (0..n).map(|r| bufs(devices[r], r, count)).collect();
        oxccl::group_start().unwrap();
        for r in 0..n {
            issue(&comms[r], &b[r], count, &streams[r]).unwrap();
        }
        common::sync_all(&streams, "inside the group");
        for r in 0..n {
            assert!(none_ran(&b[r], r, count), "{test}: {proto}: rank {r}: a call ran before the group's end");
        }
        oxccl::group_end().unwrap();
        common::sync_all(&streams, "after the group");
        for r in 0..n {
            check(&b[r], r, n, count, &format!("{test}: {proto}"));
        }
    }
}

/// `finalize` while the thread's group holds a collective or a send of the communicator is
/// `InvalidUsage` naming the group, and changes nothing: the group's end runs its calls, exact,
/// and finalize works after it.
#[test]
fn finalize_inside_a_group_holding_the_communicators_calls_is_refused() {
    let _env = Env::clean(VARS);
    let (n, count) = (2usize, 300usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let b: Vec<Bufs> = (0..n).map(|r| bufs(comms[r].device(), r, count)).collect();
    // Only a send and a receive queued first, then the rest of the calls.
    oxccl::group_start().unwrap();
    for r in 0..n {
        comms[r]
            .recv(data(&b[r].p2p_out, count), count, DataType::F32, (r + n - 1) % n, &streams[r])
            .unwrap();
    }
    for c in &comms {
        let e = c.finalize().unwrap_err();
        assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
        assert!(e.to_string().contains("finalize while an open group holds calls of this communicator"), "{e}");
    }
    for r in 0..n {
        let (c, s, f) = (&comms[r], &streams[r], DataType::F32);
        c.all_reduce(data(&b[r].ar_in, count), data(&b[r].ar_out, count), count, f, RedOp::Sum, s).unwrap();
        c.all_reduce(data(&b[r].ar_in, count), data(&b[r].ar_in, count), count, f, RedOp::Sum, s).unwrap();
        let root = (r == 1).then(|| data(&b[r].bc, count));
        c.broadcast(root, data(&b[r].bc, count), count, f, 1, s).unwrap();
        c.send(data(&b[r].ar_out, count), count, f, (r + 1) % n, s).unwrap();
        assert!(c.finalize().is_err(), "rank {r}: finalize with collectives queued");
    }
    oxccl::group_end().unwrap();
    common::sync_all(&streams, "after the group");
    for r in 0..n {
        check(&b[r], r, n, count, "finalize refused inside the group");
    }
    for c in &comms {
        c.finalize().unwrap();
    }
}

/// `count` f32 of `value` each, on `dev`.
fn filled(dev: Device, value: f32, count: usize) -> DeviceBuffer {
    let b = dev.alloc(4 * count).unwrap();
    b.write(0, &value.to_ne_bytes().repeat(count)).unwrap();
    b
}

/// The `count` f32 of `b`.
fn values(b: &DeviceBuffer, count: usize) -> Vec<f32> {
    b.to_vec().unwrap()[..4 * count]
        .chunks(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Calls through a scope and calls made on the communicators directly inside it run in the
/// order issued: in-place Sum (scope), Prod (direct), Sum (scope) of 1 and 2 give 18 (direct
/// calls first would give 8).
#[test]
fn direct_calls_inside_a_scope_run_in_the_order_issued_with_the_scopes() {
    let _env = Env::clean(VARS);
    let (n, count) = (2usize, 64usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let xs: Vec<DeviceBuffer> = (0..n).map(|r| filled(comms[r].device(), (r + 1) as f32, count)).collect();
    let f = DataType::F32;
    oxccl::group::scope(|g| {
        for r in 0..n {
            g.all_reduce(&comms[r], &xs[r], &xs[r], count, f, RedOp::Sum, &streams[r])?;
        }
        for r in 0..n {
            comms[r].all_reduce(&xs[r], &xs[r], count, f, RedOp::Prod, &streams[r])?;
        }
        for r in 0..n {
            g.all_reduce(&comms[r], &xs[r], &xs[r], count, f, RedOp::Sum, &streams[r])?;
        }
        Ok::<(), Error>(())
    })
    .unwrap()
    .unwrap();
    common::sync_all(&streams, "after the scope");
    for r in 0..n {
        assert_eq!(values(&xs[r], count), vec![18.0; count], "rank {r}: order of the calls");
    }
}

/// A call refused when made on a communicator directly inside a scope fails the scope as a
/// refused `g.*` call does: none of the group runs.
#[test]
fn a_direct_call_refused_inside_a_scope_fails_the_scope() {
    let _env = Env::clean(VARS);
    let (n, count) = (2usize, 64usize);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let streams = common::streams(&comms);
    let xs: Vec<DeviceBuffer> = (0..n).map(|r| filled(comms[r].device(), (r + 1) as f32, count)).collect();
    let short = comms[0].device().alloc(4).unwrap();
    let f = DataType::F32;
    let e = oxccl::group::scope(|g| {
        for r in 0..n {
            g.all_reduce(&comms[r], &xs[r], &xs[r], count, f, RedOp::Sum, &streams[r])?;
        }
        let refused = comms[0].all_reduce(&short, &xs[0], count, f, RedOp::Sum, &streams[0]);
        assert!(refused.is_err());
        Ok::<(), Error>(())
    })
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("sendbuff holds 4 bytes"), "{e}");
    common::sync_all(&streams, "after the refused scope");
    for r in 0..n {
        assert_eq!(values(&xs[r], count), vec![(r + 1) as f32; count], "rank {r}: the scope's AllReduce ran");
    }
}

/// A rank's copies run in its launch order across streams, as its kernels do: a send to itself
/// on stream B after an in-place AllReduce on stream A copies the AllReduce's result (4 Mi
/// elements, so a copy that does not wait reads it half done), and a one-rank communicator's
/// AllReduces (copies) on two streams chain in the order issued behind a long one.
#[test]
fn copies_run_in_the_ranks_launch_order_across_streams() {
    let _env = Env::clean(VARS);
    let (n, count) = (2usize, 4 << 20);
    let comms = common::init_all(&Device::cpus(n)).unwrap();
    let (sa, sb) = (common::streams(&comms), common::streams(&comms));
    let f = DataType::F32;
    let x: Vec<DeviceBuffer> = (0..n).map(|r| filled(comms[r].device(), (r + 1) as f32, count)).collect();
    let y: Vec<DeviceBuffer> = (0..n).map(|r| filled(comms[r].device(), 0.0, count)).collect();
    oxccl::group_start().unwrap();
    for r in 0..n {
        comms[r].all_reduce(&x[r], &x[r], count, f, RedOp::Sum, &sa[r]).unwrap();
        comms[r].send(&x[r], count, f, r, &sb[r]).unwrap();
        comms[r].recv(&y[r], count, f, r, &sb[r]).unwrap();
    }
    oxccl::group_end().unwrap();
    common::sync_all(&sa, "stream A");
    common::sync_all(&sb, "stream B");
    for r in 0..n {
        let wrong = values(&y[r], count).iter().filter(|v| **v != 3.0).count();
        assert_eq!(wrong, 0, "rank {r}: copied elements that are not the AllReduce's result");
    }
    let one = common::init_all(&Device::cpus(1)).unwrap();
    let (c, dev) = (&one[0], one[0].device());
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let (big, small) = (16 << 20, 1024);
    let (bi, bo) = (filled(dev, 1.0, big), filled(dev, 0.0, big));
    let a = dev.alloc(4 * small).unwrap();
    a.write(0, &(0..small).flat_map(|i| (i as f32).to_ne_bytes()).collect::<Vec<u8>>()).unwrap();
    let (b, z) = (filled(dev, 0.0, small), filled(dev, 0.0, small));
    oxccl::group_start().unwrap();
    c.all_reduce(&bi, &bo, big, f, RedOp::Sum, &s1).unwrap();
    c.all_reduce(&a, &b, small, f, RedOp::Sum, &s1).unwrap();
    c.all_reduce(&b, &z, small, f, RedOp::Sum, &s2).unwrap();
    oxccl::group_end().unwrap();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(values(&z, small), (0..small).map(|i| i as f32).collect::<Vec<_>>(), "one rank: the second stream's copy ran first");
}

/// A rank aborted while the group holds only its sends and receives launches none of them: the
/// group's end fails naming the abort, every stream drains in bounded time, and the other rank
/// learns of the abort.
#[test]
fn a_rank_aborted_inside_a_group_of_sends_launches_none_of_them() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _env = Env::clean(VARS);
        let (n, count) = (2usize, 1000usize);
        let comms = common::init_all(&Device::cpus(n)).unwrap();
        let streams = common::streams(&comms);
        let b: Vec<Bufs> = (0..n).map(|r| bufs(comms[r].device(), r, count)).collect();
        let f = DataType::F32;
        oxccl::group_start().unwrap();
        for r in 0..n {
            comms[r].send(data(&b[r].ar_in, count), count, f, 1 - r, &streams[r]).unwrap();
            comms[r].recv(data(&b[r].p2p_out, count), count, f, 1 - r, &streams[r]).unwrap();
        }
        comms[0].abort().unwrap();
        let e = oxccl::group_end().unwrap_err();
        let synced: Vec<bool> = streams.iter().map(|s| s.synchronize().is_ok()).collect();
        let peer = comms[1].get_async_error();
        tx.send((e, synced, peer, untouched(&b[0].p2p_out, count, 4))).unwrap();
    });
    let (e, synced, peer, rank0_untouched) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the group's end or a stream did not return within 60 s");
    assert!(matches!(e, Error::InvalidUsage(_)), "{e:?}");
    assert!(e.to_string().contains("rank 0: the communicator was aborted"), "{e}");
    assert_eq!(synced, vec![true, true], "streams");
    assert!(matches!(peer, Err(Error::Remote(_))), "rank 1: {peer:?}");
    assert!(rank0_untouched, "rank 0's receive ran");
}
