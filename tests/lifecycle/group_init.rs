//! Communicators created inside a group (`oxccl::group::init_rank`, NCCL's `ncclCommInitRank`
//! between `ncclGroupStart` and `ncclGroupEnd`): one thread creates every rank; a group holding
//! only some ranks of an id meets the others through the bootstrap; a pending communicator is
//! taken after the group's end only, once; a failing init fails the group's end and every
//! pending communicator of it with the same error; bad ranks are refused at once.
use crate::common;
use common::env::Env;
use oxccl::group::{self, PendingComm};
use oxccl::{Device, ResultCode};

/// Every rank of one id, created by one thread inside one group: one process group (as
/// `init_all`), an exact AllReduce on all of them.
#[test]
fn one_thread_creates_every_rank_inside_a_group() {
    let _env = Env::clean(&["PROTO"]);
    let n = 3;
    let id = common::unique_id();
    oxccl::group_start().unwrap();
    let pending: Vec<PendingComm> = (0..n)
        .map(|r| group::init_rank(n, &id, r, Device::Cpu(r)).unwrap())
        .collect();
    let e = pending[0].take().unwrap_err();
    assert_eq!(e.code(), ResultCode::InvalidUsage);
    assert!(e.to_string().contains("call take() after group_end"), "{e}");
    oxccl::group_end().unwrap();
    let comms: Vec<oxccl::Comm> = pending.iter().map(|p| p.take().unwrap()).collect();
    for (r, c) in comms.iter().enumerate() {
        assert_eq!((c.rank(), c.nranks(), c.device()), (r, n, Device::Cpu(r)));
        assert!(
            c.in_process_group(),
            "rank {r}: every rank of the id in one group is one process group"
        );
    }
    let e = pending[1].take().unwrap_err();
    assert!(e.to_string().contains("taken already"), "{e}");
    common::all_reduce_f32(&comms, 1001, false);
}

/// A group holding ranks 0 and 1 of a 3-rank id on one thread, rank 2 created on another
/// thread without a group: the group's inits meet rank 2 through the bootstrap.
#[test]
fn a_group_with_some_ranks_meets_the_others() {
    let _env = Env::clean(&["PROTO"]);
    let n = 3;
    let id = common::unique_id();
    let comms = std::thread::scope(|s| {
        let last = s.spawn(|| {
            group::init_rank(n, &id, 2, Device::Cpu(2))
                .unwrap()
                .take()
                .unwrap()
        });
        let firsts = oxccl::group(|| {
            (0..2)
                .map(|r| group::init_rank(n, &id, r, Device::Cpu(r)).unwrap())
                .collect::<Vec<_>>()
        })
        .unwrap();
        let mut comms: Vec<oxccl::Comm> = firsts.iter().map(|p| p.take().unwrap()).collect();
        comms.push(last.join().unwrap());
        comms
    });
    assert!(comms.iter().all(|c| !c.in_process_group()));
    common::all_reduce_f32(&comms, 257, true);
    common::drop_on_threads(comms);
}

/// An init that fails (a bad `NCCL_PROTO`) fails the group's end and every pending
/// communicator of the group with the same error, which names the variable.
#[test]
fn a_failing_init_fails_the_group_end_and_each_pending_communicator() {
    let env = Env::clean(&["PROTO"]);
    env.set(&[("NCCL_PROTO", "Fastest")]);
    let id = common::unique_id();
    oxccl::group_start().unwrap();
    let pending: Vec<PendingComm> = (0..2)
        .map(|r| group::init_rank(2, &id, r, Device::Cpu(r)).unwrap())
        .collect();
    let e = oxccl::group_end().unwrap_err();
    assert_eq!(e.code(), ResultCode::InvalidArgument, "{e}");
    assert!(e.to_string().contains("NCCL_PROTO"), "{e}");
    for p in &pending {
        let pe = p.take().unwrap_err();
        assert_eq!(pe.to_string(), e.to_string());
    }
    assert_eq!(oxccl::group::group_depth(), 0);
}

#[test]
fn bad_ranks_are_refused_at_once() {
    let id = common::unique_id();
    oxccl::group_start().unwrap();
    for (n, r) in [(0, 0), (2, 2)] {
        let e = group::init_rank(n, &id, r, Device::Cpu(0)).unwrap_err();
        assert_eq!(e.code(), ResultCode::InvalidArgument);
        assert!(e.to_string().contains(&format!("rank {r} of nranks {n}")), "{e}");
    }
    oxccl::group_end().unwrap();
}
