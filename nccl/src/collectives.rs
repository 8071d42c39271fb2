//! The collectives and point-to-point calls (NCCL's `collectives.cc`): AllReduce, Broadcast
//! (and the in-place `ncclBcast`), Reduce, AllGather and ReduceScatter through oxccl's
//! `Comm::collective_raw` (inside a group: checked at the call, queued in oxccl's group and
//! launched at its end); Send and Recv through `send_raw`/`recv_raw`; AlltoAll, Gather and
//! Scatter as a group of those (NCCL 2.28 builds them the same way). oxccl checks the buffers,
//! root, operator and stream of each call and names what is wrong; this layer checks the C
//! arguments (handle, type, operator value, negative ranks) first.
use crate::cuda::KeepCurrent;
use crate::handles::{self, CallLive, Live, PreMul, PreMulScalar};
use crate::types::{
    builtin_op, data_type, ncclComm_t, ncclDataType_t, ncclNumOps, ncclRedOp_t, non_negative, premul_index,
};
use oxccl::{DataType, DevSlice, Error, Func, RedOp, ReduceOp, Result};
use std::ffi::{c_int, c_void};

/// `cudaStream_t`: an opaque pointer (`CUstream`); NULL is the legacy default stream.
pub type cudaStream_t = *mut c_void;

/// The operator of value `op` on `live` for a call on `dtype`, for a value that is not a
/// built-in operator: one of `live`'s PreMulSum operators (`redop.rs`).
fn premul_op(live: &Live, op: ncclRedOp_t, dtype: DataType) -> Result<ReduceOp<'static>> {
    let entry = premul_index(op).and_then(|i| live.redops().get(i).copied().flatten());
    match entry {
        Some(PreMul { dtype: d, scalar: PreMulScalar::Host(s) }) if d == dtype => Ok(ReduceOp::PreMulSum(s)),
        Some(PreMul { dtype: d, scalar: PreMulScalar::Device(addr) }) if d == dtype => {
            // SAFETY: NCCL's contract for ncclScalarDevice: one element of the operator's type on
            // the rank's device, allocated until the work of every call using it has run.
            Ok(ReduceOp::PreMulSumDevice(unsafe { DevSlice::from_raw(addr, d.size(), live.comm.device()) }))
        }
        Some(p) => Err(Error::InvalidArgument(format!(
            "op {op} is a PreMulSum operator of {} but the call's datatype is {}",
            p.dtype.name(),
            dtype.name()
        ))),
        None => Err(Error::InvalidArgument(format!(
            "op {op} is neither a built-in operator (0..{ncclNumOps}) nor a PreMulSum operator of this communicator \
             (from ncclRedOpCreatePreMulSum, not destroyed)"
        ))),
    }
}

/// The communicator of a call ([`handles::live`]), refused once finalize was asked for.
#[inline(always)]
fn usable(comm: ncclComm_t) -> Result<handles::CallLive> {
    let live = handles::live(comm)?;
    live.check_not_finalizing()?;
    Ok(live)
}

/// Runs `f` on the communicator of a call, usable for new work ([`usable`]).
#[inline(always)]
fn with_live<R>(comm: ncclComm_t, f: impl FnOnce(&CallLive) -> Result<R>) -> Result<R> {
    let live = usable(comm)?;
    f(&live)
}

/// One collective on raw addresses (`op` is `None` for Broadcast and AllGather). No closure
/// between the entry point and oxccl's call: a closure's body called from several entry points
/// stays a function of its own, which packs the arguments and unpacks them again on every call.
///
/// # Safety
/// The buffers are valid for the sizes `func` needs with `count` on the rank's device until
/// the work has run; `stream` as [`CallLive::with_stream`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn collective(
    comm: ncclComm_t,
    func: Func,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: Option<ncclRedOp_t>,
    root: c_int,
    stream: cudaStream_t,
) -> Result<()> {
    // SAFETY: forwarded caller contract.
    let r = unsafe { collective_on(comm, func, send, recv, count, datatype, op, root, stream) };
    crate::group::noted(r)
}

/// [`collective`] before its refusal is noted: on the call's usable communicator ([`usable`]).
///
/// # Safety
/// As [`collective`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn collective_on(
    comm: ncclComm_t,
    func: Func,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: Option<ncclRedOp_t>,
    root: c_int,
    stream: cudaStream_t,
) -> Result<()> {
    let live = &usable(comm)?;
    let dtype = data_type(datatype)?;
    // A built-in operator goes to oxccl as the `RedOp` it is (as a Rust caller passes one: a
    // byte, not a `ReduceOp` assembled on the stack); a PreMulSum one as its `ReduceOp`.
    let builtin = op.map_or(Some(RedOp::Sum), builtin_op);
    let premul = match (op, builtin) {
        (Some(op), None) => Some(premul_op(live, op, dtype)?),
        _ => None,
    };
    let root = if matches!(func, Func::Broadcast | Func::Reduce) { non_negative("root", root)? } else { 0 };
    let (send, recv) = (send as u64, recv as u64);
    // Inside a group oxccl checks the call now and queues it until the group's outermost end
    // (NCCL launches a group's work at its end), which makes no driver call: the caller's
    // context is left alone without being noted (the end notes and restores it).
    let _keep = (oxccl::group::group_depth() == 0).then(KeepCurrent::new);
    match premul {
        // SAFETY: the caller's contract (NCCL's: valid device buffers of the documented sizes, a
        // stream of the rank's device).
        None => unsafe { launch(live, func, send, recv, count, dtype, builtin.unwrap_or(RedOp::Sum), root, stream) },
        // SAFETY: as above.
        Some(op) => unsafe { launch(live, func, send, recv, count, dtype, op, root, stream) },
    }
}

/// oxccl's `Comm::collective_raw` of `live` on the call's stream.
///
/// # Safety
/// As [`collective`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn launch<'a>(
    live: &CallLive,
    func: Func,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    op: impl Into<ReduceOp<'a>>,
    root: usize,
    stream: cudaStream_t,
) -> Result<()> {
    // A closure of values, not of references to them: built on the branch that needs it (a
    // CUDA rank's), not before the branch on every call.
    // SAFETY: the caller's contract.
    unsafe { live.with_stream(stream, move |s| live.comm.collective_raw(func, send, recv, count, dtype, op, root, s)) }
}

/// Runs `f` (sends and receives) as one group inside the caller's (if any): the first error of
/// `f` (then none of them runs) or of the group's end.
fn grouped(f: impl FnOnce() -> Result<()>) -> Result<()> {
    oxccl::group_start()?;
    let r = f();
    // A refused send or receive: the ones queued before it do not run either.
    let end = if r.is_ok() { oxccl::group_end() } else { oxccl::group::abandon_end() };
    r.and(end)
}

/// `count` elements of `dtype` in bytes, `InvalidArgument` on overflow.
fn bytes_of(count: usize, dtype: DataType) -> Result<u64> {
    (count as u64)
        .checked_mul(dtype.size() as u64)
        .ok_or_else(|| Error::InvalidArgument(format!("count {count} of {} overflows the byte size", dtype.name())))
}

/// `InvalidArgument` when `addr` is NULL though `bytes > 0`.
fn needed(name: &str, addr: u64, bytes: u64) -> Result<()> {
    if addr == 0 && bytes > 0 {
        return Err(Error::InvalidArgument(format!("{name} is NULL")));
    }
    Ok(())
}

/// The address of block `p` of `bytes` bytes from `base`.
fn block(base: u64, p: usize, bytes: u64) -> Result<u64> {
    (p as u64)
        .checked_mul(bytes)
        .and_then(|o| base.checked_add(o))
        .ok_or_else(|| {
            Error::InvalidArgument(format!("block {p} of {bytes} bytes from {base:#x} overflows the address space"))
        })
}

nccl_api! {
    /// Reduces `count` elements across the ranks; every rank gets the result in `recvbuff`
    /// (in place when `sendbuff == recvbuff`).
    fn ncclAllReduce / pncclAllReduce(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        // SAFETY: the caller's contract.
        unsafe { collective(comm, Func::AllReduce, sendbuff, recvbuff, count, datatype, Some(op), 0, stream) }
    }

    /// Copies `count` elements of the root's `sendbuff` into every rank's `recvbuff`
    /// (`sendbuff` is read on the root only).
    fn ncclBroadcast / pncclBroadcast(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        // SAFETY: the caller's contract.
        unsafe { collective(comm, Func::Broadcast, sendbuff, recvbuff, count, datatype, None, root, stream) }
    }

    /// In-place Broadcast (deprecated in NCCL): `buff` on every rank.
    fn ncclBcast / pncclBcast(
        buff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        // SAFETY: the caller's contract.
        unsafe { collective(comm, Func::Broadcast, buff, buff, count, datatype, None, root, stream) }
    }

    /// Reduces `count` elements across the ranks into the root's `recvbuff` (`recvbuff` may be
    /// NULL elsewhere).
    fn ncclReduce / pncclReduce(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        // SAFETY: the caller's contract.
        unsafe { collective(comm, Func::Reduce, sendbuff, recvbuff, count, datatype, Some(op), root, stream) }
    }

    /// Every rank's `sendcount` elements, gathered in rank order into every rank's `recvbuff`.
    fn ncclAllGather / pncclAllGather(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        sendcount: usize,
        datatype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        // SAFETY: the caller's contract.
        unsafe { collective(comm, Func::AllGather, sendbuff, recvbuff, sendcount, datatype, None, 0, stream) }
    }

    /// Reduces `nranks × recvcount` elements; rank `r` gets block `r` of the result.
    fn ncclReduceScatter / pncclReduceScatter(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        recvcount: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        // SAFETY: the caller's contract.
        unsafe { collective(comm, Func::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, Some(op), 0, stream) }
    }

    /// Sends `count` elements to rank `peer`, matched by its `ncclRecv` (inside a group:
    /// launched at the outermost `ncclGroupEnd`).
    fn ncclSend / pncclSend(
        sendbuff: *const c_void,
        count: usize,
        datatype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        crate::group::noting_refusal(|| with_live(comm, |live| {
            let dtype = data_type(datatype)?;
            let peer = non_negative("peer", peer)?;
            let _keep = KeepCurrent::new();
            // SAFETY: the caller's contract: `count` elements at `sendbuff` until the send has run, a
            // stream of the rank's device.
            unsafe { live.with_stream(stream, |s| live.comm.send_raw(sendbuff as u64, count, dtype, peer, s)) }
        }))
    }

    /// Receives `count` elements from rank `peer` (see `ncclSend`).
    fn ncclRecv / pncclRecv(
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        crate::group::noting_refusal(|| with_live(comm, |live| {
            let dtype = data_type(datatype)?;
            let peer = non_negative("peer", peer)?;
            let _keep = KeepCurrent::new();
            // SAFETY: the caller's contract: `count` elements at `recvbuff` until the receive has run, a
            // stream of the rank's device.
            unsafe { live.with_stream(stream, |s| live.comm.recv_raw(recvbuff as u64, count, dtype, peer, s)) }
        }))
    }

    /// Block `p` of `sendbuff` (`count` elements at element `p × count`) goes to rank `p`, whose
    /// block lands in block `r` of its `recvbuff`. The buffers must not overlap (no in-place
    /// form, as in NCCL).
    fn ncclAlltoAll / pncclAlltoAll(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        crate::group::noting_refusal(|| with_live(comm, |live| {
            let dtype = data_type(datatype)?;
            let n = live.comm.count();
            let bytes = bytes_of(count, dtype)?;
            let (send, recv) = (sendbuff as u64, recvbuff as u64);
            needed("sendbuff", send, bytes)?;
            needed("recvbuff", recv, bytes)?;
            let total = bytes.checked_mul(n as u64).ok_or_else(|| {
                Error::InvalidArgument(format!("count {count} × {n} ranks overflows the byte size"))
            })?;
            if total > 0 && send < recv.saturating_add(total) && recv < send.saturating_add(total) {
                return Err(Error::InvalidArgument(format!(
                    "sendbuff and recvbuff overlap ({total} bytes each): ncclAlltoAll has no in-place form"
                )));
            }
            let _keep = KeepCurrent::new();
            let run = |stream: &oxccl::Stream| {
                grouped(|| {
                    for p in 0..n {
                        // SAFETY: the caller's contract: `n × count` elements in each buffer.
                        unsafe {
                            live.comm.send_raw(block(send, p, bytes)?, count, dtype, p, stream)?;
                            live.comm.recv_raw(block(recv, p, bytes)?, count, dtype, p, stream)?;
                        }
                    }
                    Ok(())
                })
            };
            // SAFETY: the caller's contract (a stream of the rank's device).
            unsafe { live.with_stream(stream, run) }
        }))
    }

    /// Every rank's `count` elements go to rank `root`, into block `r` of its `recvbuff`
    /// (`recvbuff` is read on the root only; in place when `sendbuff == recvbuff + root × count`).
    fn ncclGather / pncclGather(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        crate::group::noting_refusal(|| with_live(comm, |live| {
            let dtype = data_type(datatype)?;
            let (n, me) = (live.comm.count(), live.comm.user_rank());
            let root = non_negative("root", root)?;
            if root >= n {
                return Err(Error::InvalidArgument(format!(
                    "root {root} is out of range for ncclGather (accepted: 0..{n})"
                )));
            }
            let bytes = bytes_of(count, dtype)?;
            let (send, recv) = (sendbuff as u64, recvbuff as u64);
            needed("sendbuff", send, bytes)?;
            if me == root {
                needed("recvbuff (on the root)", recv, bytes)?;
            }
            let _keep = KeepCurrent::new();
            let run = |stream: &oxccl::Stream| {
                grouped(|| {
                    // SAFETY: the caller's contract: `count` elements at `sendbuff`, `n × count` at the
                    // root's `recvbuff`.
                    unsafe {
                        live.comm.send_raw(send, count, dtype, root, stream)?;
                        if me == root {
                            for p in 0..n {
                                live.comm.recv_raw(block(recv, p, bytes)?, count, dtype, p, stream)?;
                            }
                        }
                    }
                    Ok(())
                })
            };
            // SAFETY: the caller's contract (a stream of the rank's device).
            unsafe { live.with_stream(stream, run) }
        }))
    }

    /// Block `p` of the root's `sendbuff` goes to rank `p`'s `recvbuff` (`sendbuff` is read on
    /// the root only; in place when `recvbuff == sendbuff + root × count`).
    fn ncclScatter / pncclScatter(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) {
        crate::group::noting_refusal(|| with_live(comm, |live| {
            let dtype = data_type(datatype)?;
            let (n, me) = (live.comm.count(), live.comm.user_rank());
            let root = non_negative("root", root)?;
            if root >= n {
                return Err(Error::InvalidArgument(format!(
                    "root {root} is out of range for ncclScatter (accepted: 0..{n})"
                )));
            }
            let bytes = bytes_of(count, dtype)?;
            let (send, recv) = (sendbuff as u64, recvbuff as u64);
            needed("recvbuff", recv, bytes)?;
            if me == root {
                needed("sendbuff (on the root)", send, bytes)?;
            }
            let _keep = KeepCurrent::new();
            let run = |stream: &oxccl::Stream| {
                grouped(|| {
                    // SAFETY: the caller's contract: `n × count` elements at the root's `sendbuff`,
                    // `count` at `recvbuff`.
                    unsafe {
                        if me == root {
                            for p in 0..n {
                                live.comm.send_raw(block(send, p, bytes)?, count, dtype, p, stream)?;
                            }
                        }
                        live.comm.recv_raw(recv, count, dtype, root, stream)?;
                    }
                    Ok(())
                })
            };
            // SAFETY: the caller's contract (a stream of the rank's device).
            unsafe { live.with_stream(stream, run) }
        }))
    }
}
