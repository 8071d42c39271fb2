//! `Comm::split` (NCCL's `ncclCommSplit`), CPU target: the ranks of one colour form a new
//! communicator ordered by key (ties by parent rank) that runs collectives and sends exactly; a
//! rank with `SPLIT_NOCOLOR` gets none; a split communicator splits again; a bad colour fails on
//! every rank naming it; parent and children are dropped in either order. `Comm::shrink`
//! (NCCL's `ncclCommShrink`): the ranks not excluded form a new communicator in parent order
//! without the excluded ones calling; the parent stays usable, or is aborted first on request.
//! `Comm::revoke` (NCCL's `ncclCommRevoke`): after a call timed out, the survivors revoke their
//! ranks and shrink away the one that never called, without tearing anything down.
use crate::common;

use oxccl::{Comm, DataType, Device, Error, SPLIT_NOCOLOR};

/// Splits `parent` (every rank on a thread of its own) with `color(r)` / `key(r)`; the new
/// communicators by parent rank.
fn split_all(parent: &[Comm], color: impl Fn(usize) -> i32 + Sync, key: impl Fn(usize) -> i32 + Sync) -> Vec<Option<Comm>> {
    common::on_threads(parent.len(), |r| parent[r].split(color(r), key(r)).unwrap_or_else(|e| panic!("rank {r}: {e}")))
}

#[test]
fn ranks_of_one_colour_form_a_communicator_ordered_by_key() {
    let parent = common::init_all(&Device::cpus(5)).unwrap();
    // Colours: even ranks 0, odd ranks 1, rank 4 none. Keys reverse the order in colour 0, and
    // tie in colour 1 (parent rank decides).
    let kids = split_all(&parent, |r| if r == 4 { SPLIT_NOCOLOR } else { (r % 2) as i32 }, |r| if r % 2 == 0 { -(r as i32) } else { 7 });
    assert!(kids[4].is_none(), "NOCOLOR gets no communicator");
    let want = [(0usize, 1usize, 2usize), (1, 0, 2), (2, 0, 2), (3, 1, 2)];
    for (r, (c, rank, n)) in want.iter().enumerate() {
        let k = kids[r].as_ref().unwrap_or_else(|| panic!("rank {r}: no communicator"));
        assert_eq!((k.rank(), k.nranks(), k.device()), (*rank, *n, Device::Cpu(r)), "parent rank {r} (colour {c})");
    }
    // Each new communicator runs collectives (exact AllReduce) and sends, by its own ranks.
    let mut kids: Vec<Option<Comm>> = kids;
    for colour in [0usize, 1] {
        let mut group: Vec<Comm> = (0..4).filter(|r| r % 2 == colour).map(|r| kids[r].take().unwrap()).collect();
        group.sort_by_key(Comm::rank);
        common::all_reduce_f32(&group, 1025, false);
        let streams = common::streams(&group);
        let bufs: Vec<_> = group.iter().map(|c| c.device().alloc(64).unwrap()).collect();
        bufs[0].write(0, &[colour as u8 + 1; 64]).unwrap();
        oxccl::group(|| {
            group[0].send(&bufs[0], 64, DataType::U8, 1, &streams[0]).unwrap();
            group[1].recv(&bufs[1], 64, DataType::U8, 0, &streams[1]).unwrap();
        })
        .unwrap();
        common::sync_all(&streams, "send in the split communicator");
        assert_eq!(bufs[1].to_vec().unwrap(), vec![colour as u8 + 1; 64]);
        // A split communicator splits again (every rank alone), and outlives its parent.
        let singles = split_all(&group, |r| r as i32, |_| 0);
        common::drop_on_threads(group);
        for s in singles.iter().map(|s| s.as_ref().unwrap()) {
            assert_eq!((s.rank(), s.nranks()), (0, 1));
            let (stream, b) = (s.device().new_stream().unwrap(), s.device().alloc(68).unwrap());
            b.write(0, &[3; 68]).unwrap();
            s.all_reduce(&b, &b, 17, DataType::F32, oxccl::RedOp::Sum, &stream).unwrap();
            stream.synchronize().unwrap();
            assert_eq!(b.to_vec().unwrap(), vec![3; 68], "one rank: the input");
        }
    }
    drop(parent);
}

#[test]
fn a_bad_colour_fails_the_split_on_every_rank_naming_it() {
    let parent = common::init_all(&Device::cpus(3)).unwrap();
    let errs = common::on_threads(3, |r| parent[r].split(if r == 1 { -5 } else { 0 }, 0).err());
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_ref().unwrap_or_else(|| panic!("rank {r}: the split succeeded"));
        assert!(matches!(e, Error::InvalidArgument(_)), "rank {r}: {e:?}");
        assert!(e.to_string().contains("color -5 of rank 1 is invalid"), "rank {r}: {e}");
    }
    // The parent is unharmed.
    common::all_reduce_f32(&parent, 33, false);
}

/// Ranks 0, 1 and 3 of 4 shrink away rank 2, which never calls: a 3-rank communicator in parent
/// order that reduces exactly, and the parent still runs collectives on all 4. Then ranks 0 and
/// 1 shrink away rank 3 (and 2) with the abort flag: the parent is aborted, the child works.
#[test]
fn shrink_forms_a_communicator_of_the_others_without_them() {
    let parent = common::init_all(&Device::cpus(4)).unwrap();
    let kids: Vec<Comm> = std::thread::scope(|s| {
        let hs: Vec<_> = [0usize, 1, 3].into_iter().map(|r| {
            let p = &parent[r];
            s.spawn(move || p.shrink(&[2], false).unwrap_or_else(|e| panic!("rank {r}: {e}")))
        }).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (k, parent_rank)) in kids.iter().zip([0usize, 1, 3]).enumerate() {
        assert_eq!((k.rank(), k.nranks(), k.device()), (i, 3, Device::Cpu(parent_rank)));
    }
    common::all_reduce_f32(&kids, 1000, false);
    common::drop_on_threads(kids);
    common::all_reduce_f32(&parent, 33, true);
    let kids: Vec<Comm> = common::on_threads(2, |r| parent[r].shrink(&[3, 2], true).unwrap_or_else(|e| panic!("rank {r}: {e}")));
    assert!(parent[0].is_aborted() && parent[1].is_aborted());
    common::all_reduce_f32(&kids, 10, true);
    common::drop_on_threads(kids);
    let e = parent[0].shrink(&[0], false).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("own exclude list"), "{e}");
}

/// Rank 2 of 3 never issues an AllReduce; ranks 0 and 1 time out (`OXCCL_TIMEOUT=0.5`), revoke
/// their ranks — which are then quiescent and refuse new calls — and shrink rank 2 away: the
/// new communicator reduces exactly.
#[test]
fn survivors_of_a_timed_out_call_revoke_and_shrink() {
    let parent = {
        let env = common::env::Env::clean(&["TIMEOUT"]);
        env.set(&[("OXCCL_TIMEOUT", "0.5")]);
        common::init_all(&Device::cpus(3)).unwrap()
    };
    let streams = common::streams(&parent);
    let bufs: Vec<_> = parent.iter().map(|c| c.device().alloc(1025 * 4).unwrap()).collect();
    for r in 0..2 {
        parent[r].all_reduce(&bufs[r], &bufs[r], 1025, DataType::F32, oxccl::RedOp::Sum, &streams[r]).unwrap();
    }
    for r in 0..2 {
        streams[r].synchronize().unwrap();
        let e = parent[r].get_async_error().unwrap_err();
        assert!(matches!(e, Error::Timeout(_)), "rank {r}: {e}");
        parent[r].revoke().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(parent[r].is_revoked() && !parent[r].is_aborted());
        parent[r].get_async_error().unwrap_or_else(|e| panic!("rank {r} after revoke: {e}"));
        let e = parent[r]
            .all_reduce(&bufs[r], &bufs[r], 1, DataType::F32, oxccl::RedOp::Sum, &streams[r])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "invalid usage: rank {r}: the communicator was revoked: allreduce is refused; split, shrink or destroy it"
            )
        );
        let again = parent[r].revoke().unwrap_err();
        assert_eq!(again.to_string(), format!("invalid usage: rank {r}: cannot revoke: the communicator was already revoked"));
    }
    let kids: Vec<Comm> = common::on_threads(2, |r| parent[r].shrink(&[2], false).unwrap_or_else(|e| panic!("rank {r}: {e}")));
    common::all_reduce_f32(&kids, 1000, false);
    common::drop_on_threads(kids);
    assert!(parent[2].revoke().is_ok(), "a healthy rank revokes at once");
}
