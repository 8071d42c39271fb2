//! Failures: NULL arguments (each named by `ncclGetLastError`), handles that name nothing,
//! group misuse, and what oxccl does not support yet (`ncclInvalidUsage`, never a silent
//! success).
use crate::common::*;
use std::ffi::{c_int, c_void};
use std::ptr::{null, null_mut};

#[test]
fn null_arguments_are_invalid_and_named() {
    let n = nccl();
    let c = one_rank();
    let mut x: c_int = 0;
    let mut buf = [0f32; 4];
    // SAFETY (every call below): NULL where the test says, valid pointers elsewhere.
    unsafe {
        expect((n.get_version)(null_mut()), INVALID_ARGUMENT, &["ncclGetVersion", "version is NULL"]);
        expect((n.get_unique_id)(null_mut()), INVALID_ARGUMENT, &["ncclGetUniqueId", "uniqueId is NULL"]);
        expect((n.init_rank)(null_mut(), 1, unique_id(), 0), INVALID_ARGUMENT, &["ncclCommInitRank", "comm is NULL"]);
        expect((n.init_all)(null_mut(), 1, null()), INVALID_ARGUMENT, &["ncclCommInitAll", "comm is NULL"]);
        let mut id = unique_id();
        expect(
            (n.init_rank_scalable)(null_mut(), 1, 0, 1, &mut id, null_mut()),
            INVALID_ARGUMENT,
            &["ncclCommInitRankScalable", "newcomm is NULL"],
        );
        let mut out: Comm = null_mut();
        expect(
            (n.init_rank_scalable)(&mut out, 1, 0, 1, null_mut(), null_mut()),
            INVALID_ARGUMENT,
            &["commIds is NULL"],
        );
        expect((n.count)(null_mut(), &mut x), INVALID_ARGUMENT, &["ncclCommCount", "comm is NULL"]);
        expect((n.count)(c, null_mut()), INVALID_ARGUMENT, &["ncclCommCount", "count is NULL"]);
        expect((n.user_rank)(c, null_mut()), INVALID_ARGUMENT, &["ncclCommUserRank", "rank is NULL"]);
        expect((n.cu_device)(c, null_mut()), INVALID_ARGUMENT, &["ncclCommCuDevice", "device is NULL"]);
        expect((n.get_async_error)(c, null_mut()), INVALID_ARGUMENT, &["ncclCommGetAsyncError", "asyncError is NULL"]);
        expect((n.finalize)(null_mut()), INVALID_ARGUMENT, &["ncclCommFinalize", "comm is NULL"]);
        expect(
            (n.all_reduce)(ptr(&buf), mptr(&mut buf), 4, FLOAT, SUM, null_mut(), null_mut()),
            INVALID_ARGUMENT,
            &["ncclAllReduce", "comm is NULL"],
        );
        expect(
            (n.all_reduce)(null(), mptr(&mut buf), 4, FLOAT, SUM, c, null_mut()),
            INVALID_ARGUMENT,
            &["ncclAllReduce", "sendbuff is NULL"],
        );
        expect((n.send)(null(), 4, FLOAT, 0, c, null_mut()), INVALID_ARGUMENT, &["ncclSend", "sendbuff is NULL"]);
        expect((n.recv)(null_mut(), 4, FLOAT, 0, c, null_mut()), INVALID_ARGUMENT, &["ncclRecv", "recvbuff is NULL"]);
        expect(
            (n.all_to_all)(ptr(&buf), null_mut(), 4, FLOAT, c, null_mut()),
            INVALID_ARGUMENT,
            &["ncclAlltoAll", "recvbuff is NULL"],
        );
        expect(
            (n.gather)(ptr(&buf), null_mut(), 4, FLOAT, 0, c, null_mut()),
            INVALID_ARGUMENT,
            &["ncclGather", "recvbuff (on the root) is NULL"],
        );
        let mut scalar = 1.0f32;
        expect(
            (n.redop_create)(null_mut(), (&raw mut scalar).cast(), FLOAT, 1, c),
            INVALID_ARGUMENT,
            &["ncclRedOpCreatePreMulSum", "op is NULL"],
        );
        let mut op: c_int = 0;
        expect(
            (n.redop_create)(&mut op, null_mut(), FLOAT, 1, c),
            INVALID_ARGUMENT,
            &["ncclRedOpCreatePreMulSum", "scalar is NULL"],
        );
        expect((n.mem_alloc)(null_mut(), 64), INVALID_ARGUMENT, &["ncclMemAlloc", "ptr is NULL"]);
        expect((n.mem_free)(null_mut()), INVALID_ARGUMENT, &["ncclMemFree", "ptr is NULL"]);
        let mut h: *mut c_void = null_mut();
        expect((n.register)(c, null_mut(), 64, &mut h), INVALID_ARGUMENT, &["ncclCommRegister", "buff is NULL"]);
        expect((n.register)(c, mptr(&mut buf), 16, null_mut()), INVALID_ARGUMENT, &["ncclCommRegister", "handle is NULL"]);
        expect((n.deregister)(c, null_mut()), INVALID_ARGUMENT, &["ncclCommDeregister", "handle is NULL"]);
        expect((n.group_simulate_end)(null_mut()), INVALID_ARGUMENT, &["ncclGroupSimulateEnd", "simInfo is NULL"]);
        // NCCL's exceptions: destroying or aborting NULL is a no-op.
        expect((n.destroy)(null_mut()), SUCCESS, &[]);
        expect((n.abort)(null_mut()), SUCCESS, &[]);
    }
    destroy(c);
}

#[test]
fn dead_and_foreign_handles_are_refused() {
    let n = nccl();
    let c = one_rank();
    destroy(c);
    let mut x: c_int = 0;
    // SAFETY: handles are checked before any use.
    unsafe {
        expect((n.destroy)(c), INVALID_ARGUMENT, &["ncclCommDestroy", "already destroyed"]);
        expect((n.count)(c, &mut x), INVALID_ARGUMENT, &["ncclCommCount", "already destroyed"]);
        let foreign: Comm = std::ptr::without_provenance_mut(0x1234_5678);
        expect((n.count)(foreign, &mut x), INVALID_ARGUMENT, &["not a communicator of this process"]);
        expect((n.abort)(foreign), INVALID_ARGUMENT, &["ncclCommAbort", "not a communicator"]);
    }
}

#[test]
fn group_end_without_start_and_nesting() {
    let n = nccl();
    // SAFETY: no arguments.
    unsafe {
        expect((n.group_end)(), INVALID_USAGE, &["ncclGroupEnd", "without a matching ncclGroupStart"]);
        expect((n.group_start)(), SUCCESS, &[]);
        expect((n.group_start)(), SUCCESS, &[]);
        expect((n.group_end)(), SUCCESS, &[]);
        expect((n.group_end)(), SUCCESS, &[]);
        expect((n.group_end)(), INVALID_USAGE, &["ncclGroupEnd"]);
    }
}

#[test]
fn group_simulate_end_checks_its_argument() {
    let n = nccl();
    let mut sim = SimInfo::initializer();
    sim.magic = 0x1111;
    // SAFETY: a valid SimInfo.
    unsafe {
        expect((n.group_start)(), SUCCESS, &[]);
        expect((n.group_simulate_end)(&mut sim), INVALID_ARGUMENT, &["simInfo->magic"]);
        assert_eq!(sim.estimated_time, -1.0, "left alone on an error");
        // The group stayed open; an empty group's estimate is 0.
        sim.magic = 0x7468_5283;
        expect((n.group_simulate_end)(&mut sim), SUCCESS, &[]);
        assert_eq!(sim.estimated_time, 0.0);
        // It ended the group.
        expect((n.group_end)(), INVALID_USAGE, &["without a matching ncclGroupStart"]);
        expect((n.group_simulate_end)(&mut sim), INVALID_USAGE, &["ncclGroupSimulateEnd without a matching ncclGroupStart"]);
        // At an inner level it only ends that level.
        sim.estimated_time = 5.0;
        expect((n.group_start)(), SUCCESS, &[]);
        expect((n.group_start)(), SUCCESS, &[]);
        expect((n.group_simulate_end)(&mut sim), SUCCESS, &[]);
        assert_eq!(sim.estimated_time, 5.0);
        expect((n.group_end)(), SUCCESS, &[]);
    }
}

#[test]
fn unsupported_calls_say_so() {
    let n = nccl();
    let c = one_rank();
    let mut out: Comm = std::ptr::without_provenance_mut(0xdead);
    let mut buf = [0u8; 64];
    // SAFETY: valid pointers.
    unsafe {
        let mut excl = [0 as c_int];
        expect(
            (n.shrink)(c, excl.as_mut_ptr(), 1, &mut out, null_mut(), 0),
            INVALID_ARGUMENT,
            &["ncclCommShrink", "rank 0 is in its own exclude list"],
        );
        assert!(out.is_null());
        out = std::ptr::without_provenance_mut(0xdead);
        expect(
            (n.shrink)(c, excl.as_mut_ptr(), 0, &mut out, null_mut(), 2),
            INVALID_ARGUMENT,
            &["shrinkFlags 2", "NCCL_SHRINK_ABORT"],
        );
        assert!(out.is_null());
        expect((n.shrink)(c, null_mut(), 1, &mut out, null_mut(), 0), INVALID_ARGUMENT, &["excludeRanksList"]);
        // Windows, as registrations, are accepted (oxccl has no symmetric kernels), their flags
        // checked, and checked on deregistration.
        let mut win: *mut c_void = null_mut();
        expect((n.window_register)(c, mptr(&mut buf), 64, &mut win, 2), INVALID_ARGUMENT, &["winFlags 0x2"]);
        assert!(win.is_null());
        expect((n.window_register)(c, mptr(&mut buf), 64, &mut win, 1), SUCCESS, &[]);
        assert!(!win.is_null());
        expect((n.window_deregister)(c, win), SUCCESS, &[]);
        expect((n.window_deregister)(c, win), INVALID_ARGUMENT, &["not a window of this communicator"]);
        expect((n.dev_comm_create)(c, null(), null_mut()), INVALID_USAGE, &["ncclDevCommCreate", "not support"]);
        // Registration is accepted (oxccl needs none) and checked on deregistration.
        let mut h: *mut c_void = null_mut();
        expect((n.register)(c, mptr(&mut buf), 64, &mut h), SUCCESS, &[]);
        assert!(!h.is_null());
        expect((n.deregister)(c, h), SUCCESS, &[]);
        expect((n.deregister)(c, h), INVALID_ARGUMENT, &["not a registration"]);
    }
    destroy(c);
}

#[test]
fn mem_alloc_without_a_gpu_is_a_system_error() {
    let n = nccl();
    let mut p: *mut c_void = null_mut();
    // SAFETY: a writable pointer.
    let code = unsafe { (n.mem_alloc)(&mut p, 1 << 20) };
    if oxccl::Device::cuda_count() > 0 {
        expect(code, SUCCESS, &[]);
        // SAFETY: ncclMemAlloc's pointer, freed once.
        unsafe {
            expect((n.mem_free)(p), SUCCESS, &[]);
            expect((n.mem_free)(p), INVALID_ARGUMENT, &["not allocated by ncclMemAlloc"]);
        }
    } else {
        // No driver: ncclSystemError; a driver without devices: device 0 does not exist.
        let msg = last_error();
        assert!(code == SYSTEM_ERROR || code == INVALID_ARGUMENT, "{code}: {msg}");
        assert!(msg.contains("ncclMemAlloc") && msg.contains("CUDA"), "{msg}");
        assert!(p.is_null());
    }
}
