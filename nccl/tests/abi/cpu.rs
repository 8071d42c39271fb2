//! The C ABI end to end on oxccl's CPU target (`OXCCL_NCCL_TARGET=cpu`: ranks on host threads,
//! buffers in host memory, each rank's work on a stream of its own; `ncclCommFinalize` waits for
//! it): every collective with exact results, grouped inits, ranks created in threads and torn
//! down from one thread, a C rank meeting a Rust rank, `ncclCommInitAll`, abort, `ncclCommSplit`.
use crate::common::*;
use std::ffi::c_int;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

/// `n` ranks of one id, initialized inside one group by this thread; checks the pending
/// handles before the group's end.
fn group_init(n: usize) -> Vec<Comm> {
    let api = nccl();
    let id = unique_id();
    let mut comms = vec![null_mut(); n];
    let mut x: c_int = 0;
    // SAFETY: writable handles; the pending ones are only queried.
    unsafe {
        expect((api.group_start)(), SUCCESS, &[]);
        for (r, c) in comms.iter_mut().enumerate() {
            expect((api.init_rank)(c, n as c_int, id, r as c_int), SUCCESS, &[]);
            assert!(!c.is_null(), "the handle is handed out inside the group");
        }
        expect((api.count)(comms[0], &mut x), INVALID_USAGE, &["ncclCommCount", "ncclGroupEnd"]);
        expect((api.get_async_error)(comms[0], &mut x), SUCCESS, &[]);
        assert_eq!(x, IN_PROGRESS);
        expect((api.group_end)(), SUCCESS, &[]);
    }
    comms
}

fn finalize(c: Comm) {
    // SAFETY: a live handle.
    expect(unsafe { (nccl().finalize)(c) }, SUCCESS, &[]);
}

fn seq(n: usize, f: impl Fn(usize) -> f32) -> Vec<f32> {
    (0..n).map(f).collect()
}

#[test]
fn a_grouped_init_runs_every_collective_exactly() {
    let api = nccl();
    let comms = group_init(2);
    let (c0, c1) = (comms[0], comms[1]);
    let ranks = [0usize, 1];
    let null = std::ptr::null::<std::ffi::c_void>();
    // Inputs and outputs per rank (host memory: the CPU target's device memory).
    let ar_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(8, |i| ((r + 1) * i) as f32)).collect();
    let mut ar_recv = vec![vec![-1f32; 8]; 2];
    let mut ar_inplace: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(8, |i| (r + i) as f32)).collect();
    let bc_send = seq(8, |i| (100 + i) as f32);
    let mut bc_recv = vec![vec![-1f32; 8]; 2];
    let mut bcast: Vec<Vec<f32>> = vec![seq(8, |i| (7 * i) as f32), vec![-1.0; 8]];
    let red_send: Vec<Vec<f32>> = vec![seq(8, |i| i as f32), seq(8, |i| (8 - i) as f32)];
    let mut red_recv = vec![-1f32; 8];
    let ag_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(4, |i| (10 * r + i) as f32)).collect();
    let mut ag_recv = vec![vec![-1f32; 8]; 2];
    let rs_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(8, |j| (r + j) as f32)).collect();
    let mut rs_recv = vec![vec![-1f32; 4]; 2];
    let p2p_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(4, |i| (1000 * (r + 1) + i) as f32)).collect();
    let mut p2p_recv = vec![vec![-1f32; 4]; 2];
    let a2a_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(8, |j| (100 * r + 10 * (j / 4) + j % 4) as f32)).collect();
    let mut a2a_recv = vec![vec![-1f32; 8]; 2];
    let ga_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(4, |i| (50 * r + i) as f32)).collect();
    let mut ga_recv = vec![-1f32; 8];
    let sc_send = seq(8, |j| (60 + j) as f32);
    let mut sc_recv = vec![vec![-1f32; 4]; 2];
    let pm_send: Vec<Vec<f32>> = ranks.iter().map(|&r| seq(8, |i| (i + r) as f32)).collect();
    let mut pm_recv = vec![vec![-1f32; 8]; 2];
    // Device-resident PreMulSum scalars (CPU-target device memory is host memory), written after
    // the operators are created: the kernels read them when they run.
    let mut dev_scalars = [0f32; 2];
    let mut pmd_recv = vec![vec![-1f32; 8]; 2];
    let mut dev_ops = [0 as c_int; 2];
    let f8_send: Vec<Vec<u8>> = ranks.iter().map(|&r| (0..4).map(|i| (16 * r + i) as u8).collect()).collect();
    let mut f8_recv = vec![vec![0u8; 8]; 2];
    // fp8 E4M3 AllReduce: 1.5, 18, 0 and 448 + 448, which saturates to 448.
    let e4m3 = |v: &[f64]| v.iter().map(|&x| oxccl::F8E4M3::from_f64(x).0).collect::<Vec<u8>>();
    let f8r_send = [e4m3(&[1.0, 2.0, 3.0, 448.0]), e4m3(&[0.5, 16.0, -3.0, 448.0])];
    let mut f8r_recv = vec![vec![0xffu8; 4]; 2];
    let mut ops = [0 as c_int; 2];
    // SAFETY (every call): host buffers of the sizes each call needs, alive until the
    // communicators are finalized below; NULL streams (ignored on the CPU target).
    unsafe {
        for r in 0..2 {
            let c = comms[r];
            expect((api.all_reduce)(ptr(&ar_send[r]), mptr(&mut ar_recv[r]), 8, FLOAT, SUM, c, null_mut()), SUCCESS, &[]);
        }
        for r in 0..2 {
            let p = mptr(&mut ar_inplace[r]);
            expect((api.all_reduce)(p, p, 8, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        for r in 0..2 {
            let send = if r == 1 { ptr(&bc_send) } else { null };
            expect((api.broadcast)(send, mptr(&mut bc_recv[r]), 8, FLOAT, 1, comms[r], null_mut()), SUCCESS, &[]);
        }
        for r in 0..2 {
            expect((api.bcast)(mptr(&mut bcast[r]), 8, FLOAT, 0, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.reduce)(ptr(&red_send[0]), mptr(&mut red_recv), 8, FLOAT, MAX, 0, c0, null_mut()), SUCCESS, &[]);
        expect((api.reduce)(ptr(&red_send[1]), null_mut(), 8, FLOAT, MAX, 0, c1, null_mut()), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_gather)(ptr(&ag_send[r]), mptr(&mut ag_recv[r]), 4, FLOAT, comms[r], null_mut()), SUCCESS, &[]);
        }
        for r in 0..2 {
            let (s, d) = (ptr(&rs_send[r]), mptr(&mut rs_recv[r]));
            expect((api.reduce_scatter)(s, d, 4, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..2 {
            let peer = 1 - r as c_int;
            expect((api.send)(ptr(&p2p_send[r]), 4, FLOAT, peer, comms[r], null_mut()), SUCCESS, &[]);
            expect((api.recv)(mptr(&mut p2p_recv[r]), 4, FLOAT, peer, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.group_end)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_to_all)(ptr(&a2a_send[r]), mptr(&mut a2a_recv[r]), 4, FLOAT, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.gather)(ptr(&ga_send[0]), null_mut(), 4, FLOAT, 1, c0, null_mut()), SUCCESS, &[]);
        expect((api.gather)(ptr(&ga_send[1]), mptr(&mut ga_recv), 4, FLOAT, 1, c1, null_mut()), SUCCESS, &[]);
        expect((api.scatter)(ptr(&sc_send), mptr(&mut sc_recv[0]), 4, FLOAT, 0, c0, null_mut()), SUCCESS, &[]);
        expect((api.scatter)(null, mptr(&mut sc_recv[1]), 4, FLOAT, 0, c1, null_mut()), SUCCESS, &[]);
        for r in 0..2 {
            let mut scalar = (r + 2) as f32;
            expect((api.redop_create)(&mut ops[r], (&raw mut scalar).cast(), FLOAT, 1, comms[r]), SUCCESS, &[]);
            assert!(ops[r] >= 5, "PreMulSum operators follow the built-in ones: {}", ops[r]);
        }
        for r in 0..2 {
            let (s, d) = (ptr(&pm_send[r]), mptr(&mut pm_recv[r]));
            expect((api.all_reduce)(s, d, 8, FLOAT, ops[r], comms[r], null_mut()), SUCCESS, &[]);
        }
        let dev_at: [*mut f32; 2] = [&raw mut dev_scalars[0], &raw mut dev_scalars[1]];
        for r in 0..2 {
            expect((api.redop_create)(&mut dev_ops[r], dev_at[r].cast(), FLOAT, 0, comms[r]), SUCCESS, &[]);
        }
        dev_at[0].write(2.0);
        dev_at[1].write(3.0);
        for r in 0..2 {
            let (s, d) = (ptr(&pm_send[r]), mptr(&mut pmd_recv[r]));
            expect((api.all_reduce)(s, d, 8, FLOAT, dev_ops[r], comms[r], null_mut()), SUCCESS, &[]);
        }
        // The operator may be destroyed once the calls using it have returned.
        for r in 0..2 {
            expect((api.redop_destroy)(ops[r], comms[r]), SUCCESS, &[]);
            expect((api.redop_destroy)(dev_ops[r], comms[r]), SUCCESS, &[]);
        }
        let (s, d) = (ptr(&pm_send[0]), mptr(&mut pm_recv[0]));
        expect((api.all_reduce)(s, d, 8, FLOAT, ops[0], c0, null_mut()), INVALID_ARGUMENT, &["PreMulSum", "not destroyed"]);
        expect((api.redop_destroy)(SUM, c0), INVALID_ARGUMENT, &["built-in"]);
        // 8-bit floats reduce (the CPU target has no compute capability to refuse) and move.
        for r in 0..2 {
            let (s, d) = (ptr(&f8r_send[r]), mptr(&mut f8r_recv[r]));
            expect((api.all_reduce)(s, d, 4, FLOAT8E4M3, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        for r in 0..2 {
            let (s, d) = (ptr(&f8_send[r]), mptr(&mut f8_recv[r]));
            expect((api.all_gather)(s, d, 4, FLOAT8E4M3, comms[r], null_mut()), SUCCESS, &[]);
        }
        let (s, d) = (ptr(&f8_send[0]), mptr(&mut f8_recv[0]));
        expect((api.all_reduce)(s, d, 4, 12, SUM, c0, null_mut()), INVALID_ARGUMENT, &["datatype 12"]);
        expect((api.all_reduce)(s, d, 4, INT8, 99, c0, null_mut()), INVALID_ARGUMENT, &["op 99"]);
        expect((api.broadcast)(s, d, 4, INT8, -1, c0, null_mut()), INVALID_ARGUMENT, &["root is -1"]);
        expect((api.broadcast)(s, d, 4, INT8, 2, c0, null_mut()), INVALID_ARGUMENT, &["root 2"]);
        let mut x: c_int = -1;
        for r in 0..2 {
            expect((api.count)(comms[r], &mut x), SUCCESS, &[]);
            assert_eq!(x, 2);
            expect((api.user_rank)(comms[r], &mut x), SUCCESS, &[]);
            assert_eq!(x, r as c_int);
            expect((api.get_async_error)(comms[r], &mut x), SUCCESS, &[]);
            assert_eq!(x, SUCCESS);
        }
        expect((api.cu_device)(c0, &mut x), INVALID_USAGE, &["ncclCommCuDevice", "CPU-target"]);
    }
    for &c in &comms {
        finalize(c);
    }
    for r in 0..2 {
        assert_eq!(ar_recv[r], seq(8, |i| (3 * i) as f32), "AllReduce, rank {r}");
        assert_eq!(ar_inplace[r], seq(8, |i| (1 + 2 * i) as f32), "in-place AllReduce, rank {r}");
        assert_eq!(bc_recv[r], bc_send, "Broadcast, rank {r}");
        assert_eq!(bcast[r], seq(8, |i| (7 * i) as f32), "Bcast, rank {r}");
        assert_eq!(ag_recv[r], [0., 1., 2., 3., 10., 11., 12., 13.], "AllGather, rank {r}");
        assert_eq!(rs_recv[r], seq(4, |i| (1 + 2 * (4 * r + i)) as f32), "ReduceScatter, rank {r}");
        assert_eq!(p2p_recv[r], p2p_send[1 - r], "Send/Recv, rank {r}");
        assert_eq!(a2a_recv[r], seq(8, |j| (100 * (j / 4) + 10 * r + j % 4) as f32), "AlltoAll, rank {r}");
        assert_eq!(sc_recv[r], seq(4, |i| (60 + 4 * r + i) as f32), "Scatter, rank {r}");
        assert_eq!(pm_recv[r], seq(8, |i| (5 * i + 3) as f32), "PreMulSum AllReduce, rank {r}");
        assert_eq!(pmd_recv[r], seq(8, |i| (5 * i + 3) as f32), "PreMulSum AllReduce with device scalars, rank {r}");
        assert_eq!(f8_recv[r], [0, 1, 2, 3, 16, 17, 18, 19], "8-bit float AllGather, rank {r}");
        assert_eq!(f8r_recv[r], e4m3(&[1.5, 18.0, 0.0, 448.0]), "fp8 E4M3 AllReduce, rank {r}");
    }
    assert_eq!(red_recv, seq(8, |i| i.max(8 - i) as f32), "Reduce (max) on the root");
    assert_eq!(ga_recv, [0., 1., 2., 3., 50., 51., 52., 53.], "Gather on the root");
    let mut buf = [0f32; 4];
    // SAFETY: a finalized handle, refused before any buffer is used.
    unsafe {
        let p = mptr(&mut buf);
        expect((api.all_reduce)(p, p, 4, FLOAT, SUM, c0, null_mut()), INVALID_USAGE, &["ncclCommFinalize"]);
    }
    for c in comms {
        destroy(c);
    }
}

/// `ncclCommFinalize` and `ncclCommDestroy` inside a group return at once and are carried out at
/// the group's end, after the group's work: the AllReduce queued before them runs exactly; then
/// the finalized rank refuses calls and the destroyed handle is invalid.
#[test]
fn a_finalize_and_a_destroy_inside_a_group_run_after_its_work() {
    let api = nccl();
    let comms = group_init(2);
    let (c0, c1) = (comms[0], comms[1]);
    let send: Vec<Vec<f32>> = (0..2).map(|r| seq(64, |i| ((r + 1) * i) as f32)).collect();
    let mut recv = vec![vec![-1f32; 64]; 2];
    let mut buf = [0f32; 4];
    // SAFETY: host buffers of 64 floats, alive until the teardowns (which wait for the work).
    unsafe {
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 64, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.finalize)(c0), SUCCESS, &[]);
        expect((api.destroy)(c1), SUCCESS, &[]);
        expect((api.group_end)(), SUCCESS, &[]);
        let p = mptr(&mut buf);
        expect((api.all_reduce)(p, p, 4, FLOAT, SUM, c0, null_mut()), INVALID_USAGE, &["ncclCommFinalize"]);
        expect((api.all_reduce)(p, p, 4, FLOAT, SUM, c1, null_mut()), INVALID_ARGUMENT, &["already destroyed"]);
    }
    for r in 0..2 {
        assert_eq!(recv[r], seq(64, |i| (3 * i) as f32), "the group's AllReduce, rank {r}");
    }
    destroy(c0);
}

/// A finalize from another thread while this thread's open group holds the communicator's
/// calls is refused ("end the group first") and has no effect: after the group's end its
/// AllReduce is exact, the communicator takes later calls, and the finalize then goes through.
#[test]
fn a_finalize_refused_while_a_group_holds_calls_leaves_the_communicator_usable() {
    let api = nccl();
    let comms = group_init(2);
    let send: Vec<Vec<f32>> = (0..2).map(|r| seq(64, |i| ((r + 1) * i) as f32)).collect();
    let mut recv = vec![vec![-1f32; 64]; 2];
    // SAFETY: host buffers of 64 floats, alive until the ranks are finalized below.
    unsafe {
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 64, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
    }
    let c0 = comms[0] as usize;
    std::thread::spawn(move || {
        // SAFETY: a live handle.
        expect(unsafe { (nccl().finalize)(c0 as Comm) }, INVALID_USAGE, &["ncclCommFinalize", "end the group first"]);
    })
    .join()
    .unwrap();
    let mut after = vec![vec![-1f32; 64]; 2];
    // SAFETY: the group opened above; host buffers as above.
    unsafe {
        expect((api.group_end)(), SUCCESS, &[]);
        // The refused finalize left the communicator taking calls.
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut after[r]), 64, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.group_end)(), SUCCESS, &[]);
    }
    for &c in &comms {
        finalize(c);
    }
    for r in 0..2 {
        assert_eq!(recv[r], seq(64, |i| (3 * i) as f32), "the group's AllReduce, rank {r}");
        assert_eq!(after[r], seq(64, |i| (3 * i) as f32), "the AllReduce after the refused finalize, rank {r}");
    }
    for c in comms {
        destroy(c);
    }
}

/// Ranks created by a thread each, then used and torn down from one thread: each rank's
/// finalize or destroy waits for the others of this process (as NCCL's), instead of blocking
/// at the teardown barrier.
#[test]
fn ranks_from_threads_are_torn_down_from_one_thread() {
    let api = nccl();
    for finalize_first in [true, false] {
        let id = unique_id();
        let comms: Vec<Comm> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    let mut c: Comm = null_mut();
                    // SAFETY: a writable handle.
                    expect(unsafe { (nccl().init_rank)(&mut c, 2, id, r) }, SUCCESS, &[]);
                    Handle::of(c)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap().comm())
            .collect();
        let send: Vec<Vec<f32>> = (0..2).map(|r| seq(16, |i| (i * (r + 1)) as f32)).collect();
        let mut recv = vec![vec![0f32; 16]; 2];
        // SAFETY: host buffers alive until the teardown below.
        unsafe {
            for r in 0..2 {
                expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 16, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
            }
        }
        let start = Instant::now();
        if finalize_first {
            finalize(comms[0]);
            finalize(comms[1]);
        }
        destroy(comms[0]);
        destroy(comms[1]);
        assert!(start.elapsed() < Duration::from_secs(20), "teardown took {:?}", start.elapsed());
        for r in 0..2 {
            assert_eq!(recv[r], seq(16, |i| (3 * i) as f32), "rank {r} (finalize first: {finalize_first})");
        }
    }
}

/// A group holding some ranks of an id inits them through the bootstrap, meeting a rank
/// created outside any group in another thread.
#[test]
fn a_group_with_some_of_the_ranks_meets_the_others() {
    let id = unique_id();
    let grouped = std::thread::spawn(move || {
        let api = nccl();
        let mut c: Comm = null_mut();
        // SAFETY: a writable handle.
        unsafe {
            expect((api.group_start)(), SUCCESS, &[]);
            expect((api.init_rank)(&mut c, 2, id, 0), SUCCESS, &[]);
            expect((api.group_end)(), SUCCESS, &[]);
        }
        Handle::of(c)
    });
    let alone = std::thread::spawn(move || {
        let mut c: Comm = null_mut();
        // SAFETY: a writable handle.
        expect(unsafe { (nccl().init_rank)(&mut c, 2, id, 1) }, SUCCESS, &[]);
        Handle::of(c)
    });
    let comms = [grouped.join().unwrap().comm(), alone.join().unwrap().comm()];
    let mut bufs: Vec<Vec<i32>> = (0..2).map(|r| vec![r as i32 + 1; 5]).collect();
    // SAFETY: host buffers alive until finalize.
    unsafe {
        for r in 0..2 {
            let p = mptr(&mut bufs[r]);
            expect((nccl().all_reduce)(p, p, 5, INT32, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
    }
    finalize(comms[0]);
    finalize(comms[1]);
    assert_eq!(bufs, [[3; 5], [3; 5]]);
    destroy(comms[1]);
    destroy(comms[0]);
}

/// A rank created through the C ABI and one through oxccl's Rust API meet with the C unique id.
#[test]
fn a_c_rank_and_a_rust_rank_share_a_communicator() {
    let id = unique_id();
    let rust = std::thread::spawn(move || {
        let uid = oxccl::bootstrap::UniqueId::from_bytes(&id.internal).unwrap();
        let comm = oxccl::Comm::init_rank(2, &uid, 1, oxccl::Device::Cpu(1)).unwrap();
        let stream = oxccl::Device::Cpu(1).new_stream().unwrap();
        let buf = vec![10f32; 6];
        // SAFETY: a host buffer alive until the stream is synchronized.
        unsafe {
            let p = buf.as_ptr() as u64;
            comm.all_reduce_raw(p, p, 6, oxccl::DataType::F32, oxccl::RedOp::Sum, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        comm.destroy().unwrap();
        buf
    });
    let c = {
        let mut c: Comm = null_mut();
        // SAFETY: a writable handle.
        expect(unsafe { (nccl().init_rank)(&mut c, 2, id, 0) }, SUCCESS, &[]);
        c
    };
    let mut buf = vec![1f32; 6];
    // SAFETY: a host buffer alive until finalize.
    unsafe {
        let p = mptr(&mut buf);
        expect((nccl().all_reduce)(p, p, 6, FLOAT, SUM, c, null_mut()), SUCCESS, &[]);
    }
    finalize(c);
    destroy(c);
    assert_eq!(buf, [11.0; 6]);
    assert_eq!(rust.join().unwrap(), [11.0; 6]);
}

#[test]
fn init_all_and_abort() {
    let api = nccl();
    let mut comms = [null_mut(); 3];
    // SAFETY: writable handles; devlist NULL.
    unsafe {
        expect((api.init_all)(comms.as_mut_ptr(), -1, std::ptr::null()), INVALID_ARGUMENT, &["ndev is -1"]);
        expect((api.init_all)(comms.as_mut_ptr(), 3, std::ptr::null()), SUCCESS, &[]);
    }
    let mut bufs: Vec<Vec<i32>> = (0..3).map(|r| vec![1 << r; 3]).collect();
    // SAFETY: host buffers alive until finalize.
    unsafe {
        for r in 0..3 {
            let p = mptr(&mut bufs[r]);
            expect((api.all_reduce)(p, p, 3, INT32, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
    }
    for &c in &comms {
        finalize(c);
    }
    assert_eq!(bufs, [[7; 3], [7; 3], [7; 3]]);
    for c in comms {
        destroy(c);
    }
    // Abort: the rank is freed, the others learn of it.
    let mut comms = [null_mut(); 2];
    let devs = [0 as c_int, 1];
    let mut e: c_int = -1;
    // SAFETY: writable handles and a devlist of two.
    unsafe {
        expect((api.init_all)(comms.as_mut_ptr(), 2, devs.as_ptr()), SUCCESS, &[]);
        expect((api.abort)(comms[0]), SUCCESS, &[]);
        expect((api.count)(comms[0], &mut e), INVALID_ARGUMENT, &["already destroyed"]);
        expect((api.get_async_error)(comms[1], &mut e), SUCCESS, &[]);
        assert_eq!(e, 6, "the other rank sees ncclRemoteError: {}", last_error());
        expect((api.abort)(comms[1]), SUCCESS, &[]);
    }
}

/// `ncclCommShrink` from a thread per surviving rank: ranks 0 and 2 of 3 exclude rank 1 (which
/// never calls) and get a 2-rank communicator in parent order that reduces exactly.
#[test]
fn shrink_from_the_surviving_ranks() {
    let api = nccl();
    let parents = group_init(3);
    let handles: Vec<Handle> = parents.iter().map(|&c| Handle::of(c)).collect();
    let kids: Vec<Handle> = [0usize, 2]
        .into_iter()
        .map(|r| {
            let h = handles[r];
            std::thread::spawn(move || {
                let mut out: Comm = null_mut();
                let mut excl = [1 as c_int];
                // SAFETY: a live handle, a list of one rank and a writable output.
                let rc = unsafe { (nccl().shrink)(h.comm(), excl.as_mut_ptr(), 1, &mut out, null_mut(), 0) };
                expect(rc, SUCCESS, &[]);
                Handle::of(out)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let send: Vec<Vec<f32>> = (0..2).map(|r| seq(8, |i| (i + 10 * r) as f32)).collect();
    let mut recv = vec![vec![0f32; 8]; 2];
    for (i, k) in kids.iter().enumerate() {
        let (mut rank, mut count) = (0, 0);
        // SAFETY: live handles, host buffers alive until the teardown below.
        unsafe {
            expect((api.user_rank)(k.comm(), &mut rank), SUCCESS, &[]);
            expect((api.count)(k.comm(), &mut count), SUCCESS, &[]);
            expect((api.all_reduce)(ptr(&send[i]), mptr(&mut recv[i]), 8, FLOAT, SUM, k.comm(), null_mut()), SUCCESS, &[]);
        }
        assert_eq!((rank, count), (i as c_int, 2));
    }
    for k in &kids {
        finalize(k.comm());
    }
    for k in &kids {
        destroy(k.comm());
    }
    for r in recv {
        assert_eq!(r, seq(8, |i| (2 * i + 10) as f32));
    }
    for &c in &parents {
        finalize(c);
    }
    for &c in &parents {
        destroy(c);
    }
}

/// Two splits of one parent inside one group, from one thread (rows and columns of a 2 × 2
/// grid): each rank's splits meet the other ranks' in the order issued.
#[test]
fn two_splits_of_one_parent_inside_a_group() {
    let api = nccl();
    let parents = group_init(4);
    let mut rows: [Comm; 4] = [null_mut(); 4];
    let mut cols: [Comm; 4] = [null_mut(); 4];
    // SAFETY: live handles and writable outputs.
    unsafe {
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..4 {
            expect((api.split)(parents[r], (r / 2) as c_int, r as c_int, &mut rows[r], null_mut()), SUCCESS, &[]);
            expect((api.split)(parents[r], (r % 2) as c_int, r as c_int, &mut cols[r], null_mut()), SUCCESS, &[]);
        }
        expect((api.group_end)(), SUCCESS, &[]);
    }
    for r in 0..4 {
        for (k, want) in [(rows[r], r % 2), (cols[r], r / 2)] {
            let (mut rank, mut count) = (0, 0);
            // SAFETY: live handles and writable ints.
            unsafe {
                expect((api.user_rank)(k, &mut rank), SUCCESS, &[]);
                expect((api.count)(k, &mut count), SUCCESS, &[]);
            }
            assert_eq!((rank, count), (want as c_int, 2), "parent rank {r}");
        }
    }
    for &k in rows.iter().chain(&cols) {
        finalize(k);
    }
    for &k in rows.iter().chain(&cols) {
        destroy(k);
    }
    for &c in &parents {
        finalize(c);
    }
    for &c in &parents {
        destroy(c);
    }
}

/// `ncclCommShrink` inside a group from one thread: ranks 0, 1 and 3 of 4 exclude rank 2; the
/// handles are pending until the group's end, then a 3-rank communicator that reduces exactly.
#[test]
fn shrink_inside_a_group_from_one_thread() {
    let api = nccl();
    let parents = group_init(4);
    let survivors = [0usize, 1, 3];
    let mut kids: [Comm; 3] = [null_mut(); 3];
    let mut x: c_int = 0;
    let mut excl = [2 as c_int];
    // SAFETY: live handles, a list of one rank and writable outputs.
    unsafe {
        expect((api.group_start)(), SUCCESS, &[]);
        for (k, &r) in kids.iter_mut().zip(&survivors) {
            expect((api.shrink)(parents[r], excl.as_mut_ptr(), 1, k, null_mut(), 0), SUCCESS, &[]);
        }
        expect((api.get_async_error)(kids[0], &mut x), SUCCESS, &[]);
        assert_eq!(x, IN_PROGRESS, "pending until the group's end");
        expect((api.group_end)(), SUCCESS, &[]);
    }
    let send: Vec<Vec<f32>> = (0..3).map(|i| seq(8, |j| (j + 100 * i) as f32)).collect();
    let mut recv = vec![vec![0f32; 8]; 3];
    for (i, &k) in kids.iter().enumerate() {
        let (mut rank, mut count) = (0, 0);
        // SAFETY: live handles, host buffers alive until the teardown below.
        unsafe {
            expect((api.user_rank)(k, &mut rank), SUCCESS, &[]);
            expect((api.count)(k, &mut count), SUCCESS, &[]);
            expect((api.all_reduce)(ptr(&send[i]), mptr(&mut recv[i]), 8, FLOAT, SUM, k, null_mut()), SUCCESS, &[]);
        }
        assert_eq!((rank, count), (i as c_int, 3));
    }
    for &k in &kids {
        finalize(k);
    }
    for &k in &kids {
        destroy(k);
    }
    for r in recv {
        assert_eq!(r, seq(8, |j| (3 * j + 300) as f32));
    }
    for &c in &parents {
        finalize(c);
    }
    for &c in &parents {
        destroy(c);
    }
}

/// `ncclCommSplit` inside a group, from one thread (as XLA splits its local GPUs'
/// communicators): pending handles until the group's end (NULL at once for
/// `NCCL_SPLIT_NOCOLOR`), then two communicators that reduce exactly.
#[test]
fn split_inside_a_group_from_one_thread() {
    let api = nccl();
    let parents = group_init(4);
    let mut kids: [Comm; 4] = [std::ptr::without_provenance_mut(0xdead); 4];
    let mut x: c_int = 0;
    // SAFETY: live handles and writable outputs.
    unsafe {
        expect((api.group_start)(), SUCCESS, &[]);
        for (r, k) in kids.iter_mut().enumerate() {
            let color = if r == 3 { -1 } else { (r % 2) as c_int };
            expect((api.split)(parents[r], color, r as c_int, k, null_mut()), SUCCESS, &[]);
        }
        assert!(kids[3].is_null(), "NOCOLOR: NULL at once");
        expect((api.get_async_error)(kids[0], &mut x), SUCCESS, &[]);
        assert_eq!(x, IN_PROGRESS, "pending until the group's end");
        expect((api.group_end)(), SUCCESS, &[]);
    }
    let want_ranks = [(0, 2), (0, 1), (1, 2)];
    for (r, &(rank, count)) in want_ranks.iter().enumerate() {
        let (mut got_rank, mut got_count) = (0, 0);
        // SAFETY: live handles and writable ints.
        unsafe {
            expect((api.user_rank)(kids[r], &mut got_rank), SUCCESS, &[]);
            expect((api.count)(kids[r], &mut got_count), SUCCESS, &[]);
        }
        assert_eq!((got_rank, got_count), (rank, count), "parent rank {r}");
    }
    let send: Vec<Vec<f32>> = (0..3).map(|r| seq(16, |i| (i * (r + 1)) as f32)).collect();
    let mut recv = vec![vec![0f32; 16]; 3];
    // SAFETY: host buffers alive until the teardown below.
    unsafe {
        for r in 0..3 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 16, FLOAT, SUM, kids[r], null_mut()), SUCCESS, &[]);
        }
    }
    for &k in &kids[..3] {
        finalize(k);
    }
    for &k in &kids[..3] {
        destroy(k);
    }
    // Colour 0: parent ranks 0 and 2, (1 + 3) i; colour 1: parent rank 1 alone, 2 i.
    assert_eq!(recv[0], seq(16, |i| (4 * i) as f32));
    assert_eq!(recv[2], seq(16, |i| (4 * i) as f32));
    assert_eq!(recv[1], seq(16, |i| (2 * i) as f32));
    for &c in &parents {
        finalize(c);
    }
    for &c in &parents {
        destroy(c);
    }
}

/// `ncclCommSplit` from a thread per rank: even ranks and odd ranks form two communicators
/// ordered by descending key; `NCCL_SPLIT_NOCOLOR` gives NULL; the new communicators reduce
/// exactly and are torn down from one thread, before their parent.
#[test]
fn split_by_colour_and_key() {
    let api = nccl();
    let parents = group_init(5);
    let handles: Vec<Handle> = parents.iter().map(|&c| Handle::of(c)).collect();
    let kids: Vec<Handle> = handles
        .iter()
        .enumerate()
        .map(|(r, &h)| {
            std::thread::spawn(move || {
                let mut out: Comm = std::ptr::without_provenance_mut(0xdead);
                let color = if r == 4 { -1 } else { (r % 2) as c_int };
                // SAFETY: a live handle and a writable output.
                expect(unsafe { (nccl().split)(h.comm(), color, -(r as c_int), &mut out, null_mut()) }, SUCCESS, &[]);
                Handle::of(out)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(kids[4].comm().is_null(), "NOCOLOR: NULL");
    let (mut rank, mut count): (c_int, c_int) = (0, 0);
    for (r, want) in [(0, 1), (1, 1), (2, 0), (3, 0)] {
        // SAFETY: live handles and writable ints.
        unsafe {
            expect((api.user_rank)(kids[r].comm(), &mut rank), SUCCESS, &[]);
            expect((api.count)(kids[r].comm(), &mut count), SUCCESS, &[]);
        }
        assert_eq!((rank, count), (want, 2), "parent rank {r}");
    }
    let send: Vec<Vec<f32>> = (0..4).map(|r| seq(16, |i| (i * (r + 1)) as f32)).collect();
    let mut recv = vec![vec![0f32; 16]; 4];
    // SAFETY: host buffers alive until the teardown below.
    unsafe {
        for r in 0..4 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 16, FLOAT, SUM, kids[r].comm(), null_mut()), SUCCESS, &[]);
        }
    }
    for k in &kids[..4] {
        finalize(k.comm());
    }
    for k in &kids[..4] {
        destroy(k.comm());
    }
    for r in 0..4 {
        // Even ranks 0 and 2 sum (1 + 3) i; odd ranks 1 and 3 sum (2 + 4) i.
        let f = if r % 2 == 0 { 4 } else { 6 };
        assert_eq!(recv[r], seq(16, |i| (f * i) as f32), "parent rank {r}");
    }
    for &c in &parents {
        finalize(c);
    }
    for &c in &parents {
        destroy(c);
    }
}

/// Collectives inside a group are checked at the call and launched at the group's end;
/// `ncclGroupSimulateEnd` runs nothing of its group and reports the model's time of its
/// collectives, which grows with the size and adds up over the group; the ranks stay in step.
#[test]
fn collectives_wait_for_the_group_end_and_a_simulated_group_runs_nothing() {
    let api = nccl();
    let comms = group_init(2);
    let big = 1 << 20;
    let send: Vec<Vec<f32>> = (0..2).map(|r| seq(big, |i| ((r + 1) * (i % 7)) as f32)).collect();
    let mut recv = vec![vec![-1f32; big]; 2];
    let p2p_send: Vec<Vec<f32>> = (0..2).map(|r| seq(4, |i| (10 * r + i) as f32)).collect();
    let mut p2p_recv = vec![vec![-1f32; 4]; 2];
    // The estimate of a group of `calls` AllReduces of `count` floats on every rank, plus a send
    // and receive between the ranks; nothing may run.
    let mut simulate = |count: usize, calls: usize| -> f32 {
        let mut sim = SimInfo::initializer();
        // SAFETY: host buffers of `big` floats (count <= big), alive until the end of the test.
        unsafe {
            expect((api.group_start)(), SUCCESS, &[]);
            for _ in 0..calls {
                for r in 0..2 {
                    let c = comms[r];
                    expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), count, FLOAT, SUM, c, null_mut()), SUCCESS, &[]);
                }
            }
            for r in 0..2 {
                let peer = 1 - r as c_int;
                expect((api.send)(ptr(&p2p_send[r]), 4, FLOAT, peer, comms[r], null_mut()), SUCCESS, &[]);
                expect((api.recv)(mptr(&mut p2p_recv[r]), 4, FLOAT, peer, comms[r], null_mut()), SUCCESS, &[]);
            }
            expect((api.group_simulate_end)(&mut sim), SUCCESS, &[]);
        }
        sim.estimated_time
    };
    let small = simulate(8, 1);
    let large = simulate(big, 1);
    let two = simulate(8, 2);
    assert!(small > 0.0 && small.is_finite(), "{small}");
    assert!(large > small, "1 Mi floats: {large} µs, 8 floats: {small} µs");
    // Per communicator the calls add up; the ranks run in parallel (the slowest one counts).
    assert!((two - 2.0 * small).abs() <= 1e-3 * two, "{two} vs 2 × {small}");
    std::thread::sleep(Duration::from_millis(100));
    assert!(recv.iter().all(|v| v.iter().all(|&x| x == -1.0)), "a simulated collective ran");
    assert!(p2p_recv.iter().all(|v| v.iter().all(|&x| x == -1.0)), "a simulated receive ran");
    // SAFETY: as above.
    unsafe {
        // A group with a refused call runs none of its work: the refused call's error comes
        // back at the call and again from ncclGroupEnd, as in NCCL; the ranks stay in step.
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), big, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
            let peer = 1 - r as c_int;
            expect((api.send)(ptr(&p2p_send[r]), 4, FLOAT, peer, comms[r], null_mut()), SUCCESS, &[]);
            expect((api.recv)(mptr(&mut p2p_recv[r]), 4, FLOAT, peer, comms[r], null_mut()), SUCCESS, &[]);
        }
        expect(
            (api.send)(ptr(&p2p_send[0]), 4, FLOAT, 2, comms[0], null_mut()),
            INVALID_ARGUMENT,
            &["ncclSend", "peer"],
        );
        expect((api.group_end)(), INVALID_ARGUMENT, &["ncclGroupEnd", "peer"]);
        std::thread::sleep(Duration::from_millis(100));
        assert!(recv.iter().all(|v| v.iter().all(|&x| x == -1.0)), "a collective of a refused group ran");
        assert!(p2p_recv.iter().all(|v| v.iter().all(|&x| x == -1.0)), "a receive of a refused group ran");

        expect((api.group_start)(), SUCCESS, &[]);
        // An argument error is returned at the call, inside the group.
        expect(
            (api.all_reduce)(std::ptr::null(), mptr(&mut recv[0]), 8, FLOAT, SUM, comms[0], null_mut()),
            INVALID_ARGUMENT,
            &["ncclAllReduce", "sendbuff is NULL"],
        );
        expect((api.group_end)(), INVALID_ARGUMENT, &["ncclGroupEnd", "sendbuff is NULL"]);
        // The error belonged to that group: the next one runs.
        expect((api.group_start)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), big, FLOAT, SUM, comms[r], null_mut()), SUCCESS, &[]);
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(recv.iter().all(|v| v[0] == -1.0 && v[big - 1] == -1.0), "a collective ran before its group ended");
        expect((api.group_end)(), SUCCESS, &[]);
    }
    for c in &comms {
        finalize(*c);
    }
    for r in 0..2 {
        assert_eq!(recv[r], seq(big, |i| (3 * (i % 7)) as f32), "rank {r}");
    }
    for c in comms {
        destroy(c);
    }
}

/// `ncclCommRevoke` stops a call whose peer never issued it, within seconds; the revoked
/// communicator refuses collectives, sends and finalize but still splits, and the new
/// communicator reduces exactly; then everything is torn down.
#[test]
fn revoke_stops_a_stuck_call_and_the_communicator_still_splits() {
    let api = nccl();
    let parents = group_init(2);
    let send: Vec<Vec<f32>> = (0..2).map(|r| seq(1024, |i| ((r + 1) * i) as f32)).collect();
    let mut stuck = vec![-1f32; 1024];
    let mut recv = vec![vec![-1f32; 1024]; 2];
    let mut kids: [Comm; 2] = [std::ptr::without_provenance_mut(0xdead); 2];
    let mut x: c_int = -1;
    // SAFETY: live handles, host buffers alive until the teardown below.
    unsafe {
        // Rank 0 alone: its AllReduce waits for rank 1, which never calls.
        let c0 = parents[0];
        expect((api.all_reduce)(ptr(&send[0]), mptr(&mut stuck), 1024, FLOAT, SUM, c0, null_mut()), SUCCESS, &[]);
        std::thread::sleep(Duration::from_millis(50));
        expect((api.revoke)(c0, 1), INVALID_ARGUMENT, &["ncclCommRevoke", "revokeFlags is 1", "NCCL_REVOKE_DEFAULT"]);
        let t = Instant::now();
        expect((api.revoke)(c0, 0), SUCCESS, &[]);
        assert!(t.elapsed() < Duration::from_secs(5), "revoke took {:?}", t.elapsed());
        expect((api.revoke)(parents[1], 0), SUCCESS, &[]);
        expect((api.revoke)(c0, 0), INVALID_USAGE, &["cannot revoke", "already revoked"]);
        expect((api.get_async_error)(c0, &mut x), SUCCESS, &[]);
        assert_eq!(x, SUCCESS, "quiescent after revoke");
        let c1 = parents[1];
        expect(
            (api.all_reduce)(ptr(&send[1]), mptr(&mut recv[1]), 1024, FLOAT, SUM, c1, null_mut()),
            INVALID_USAGE,
            &["ncclAllReduce", "rank 1: the communicator was revoked: allreduce is refused"],
        );
        expect((api.send)(ptr(&send[0]), 4, FLOAT, 1, c0, null_mut()), INVALID_USAGE, &["revoked: send is refused"]);
        expect((api.finalize)(c1), INVALID_USAGE, &["revoked: finalize is refused"]);
        // The revoked communicator is still a parent: one split of both ranks from this thread.
        expect((api.group_start)(), SUCCESS, &[]);
        for (r, k) in kids.iter_mut().enumerate() {
            expect((api.split)(parents[r], 0, r as c_int, k, null_mut()), SUCCESS, &[]);
        }
        expect((api.group_end)(), SUCCESS, &[]);
        for r in 0..2 {
            expect((api.all_reduce)(ptr(&send[r]), mptr(&mut recv[r]), 1024, FLOAT, SUM, kids[r], null_mut()), SUCCESS, &[]);
        }
    }
    for &k in &kids {
        finalize(k);
    }
    for r in 0..2 {
        assert_eq!(recv[r], seq(1024, |i| (3 * i) as f32), "rank {r} of the split");
    }
    for k in kids {
        destroy(k);
    }
    for c in parents {
        destroy(c);
    }
}

/// A destroy while another thread keeps calling the communicator (each call borrowing it from
/// its thread's recent handles): every call either runs or is refused as destroyed, the destroy
/// succeeds, and nothing is used after it was freed.
#[test]
fn a_destroy_while_another_thread_calls() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let api = nccl();
    for round in 0..20 {
        let mut comm = null_mut();
        // SAFETY: one writable handle; devlist NULL.
        unsafe { expect((api.init_all)(&mut comm, 1, std::ptr::null()), SUCCESS, &[]) };
        let calls = AtomicUsize::new(0);
        let handle = comm as usize;
        std::thread::scope(|s| {
            let caller = s.spawn(|| {
                let mut buf = [0f32; 1];
                loop {
                    let p = mptr(&mut buf);
                    // SAFETY: count 0 on a one-element host buffer; the handle may be destroyed.
                    let r = unsafe { (api.all_reduce)(p, p, 0, FLOAT, SUM, handle as Comm, null_mut()) };
                    if r != SUCCESS {
                        expect(r, INVALID_ARGUMENT, &["ncclAllReduce", "already destroyed"]);
                        return;
                    }
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            });
            let start = Instant::now();
            while calls.load(Ordering::Relaxed) < 100 * (round + 1) && start.elapsed() < Duration::from_secs(10) {
                std::thread::yield_now();
            }
            // SAFETY: a live handle, destroyed once.
            expect(unsafe { (api.destroy)(comm) }, SUCCESS, &[]);
            caller.join().unwrap();
        });
    }
}
