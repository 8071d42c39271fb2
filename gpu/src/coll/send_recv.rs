//! Point-to-point send and receive (NCCL's `sendrecv.h`, `runSend`/`runRecv`): one thread block
//! per part of an operation, over a peer channel of its own; the data on LL up to
//! `NCCL_P2P_LL_THRESHOLD` bytes (NCCL's choice for small messages), on Simple above.
//!
//! Each part starts with a header step — one LL line, so no fence and no tail counter — carrying
//! the sender's total size and the protocol its data follows on ([`P2P_HEADER_LL`]). The
//! receiver so takes the sender's protocol, cuts the transfer into the same parts
//! ([`p2p_part`]) and consumes exactly the steps the sender sends even when the user's counts
//! differ: it writes at most its own output's size and reports the mismatch ([`P2pStatus`])
//! instead of hanging or writing past the output. LL and Simple steps share the connection's
//! step counter, as consecutive collectives of different protocols do.
use crate::abi::{
    DevChannel, DevComm, P2P_AFTER_PREVIOUS, P2P_HEADER_LL, P2P_SEND, P2pArgs, P2pStatus, Proto, WorkP2p,
    p2p_block_works, p2p_part, p2p_status_record,
};
use crate::arch;
use crate::proto::Primitives;
use crate::proto::fan::Peers;
use crate::proto::ll::LlFan;
use crate::proto::simple::Simple;
use crate::reduce::{FuncSum, OpArgs};

/// Runs block `bid` of a point-to-point launch: its works of `args.works` one after the other
/// ([`p2p_block_works`]; nothing past the last block). The CPU target's entry; the GPU kernel
/// reads its works straight from its parameter space and calls [`run_p2p_work`].
///
/// # Safety
/// As [`run_p2p_work`] for every work of `args`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
#[cfg_attr(not(target_arch = "nvptx64"), inline(never))]
pub unsafe fn run_p2p_block(args: &P2pArgs, bid: u32, tid: u32, nthreads: u32, smem: *mut u32) {
    let nworks = core::cmp::min(args.nworks as usize, args.works.len());
    let Some((start, end)) = p2p_block_works(nworks, bid, |i| args.works[i].kind) else {
        return;
    };
    // SAFETY: forwarded caller contract.
    if unsafe { stopped(args.comm, tid, smem) } {
        return;
    }
    for (i, w) in args.works.iter().enumerate().take(end).skip(start) {
        let status = p2p_status_record(args.status, i);
        // SAFETY: forwarded caller contract.
        unsafe { run_p2p_work(args.comm, status, *w, tid, nthreads, smem) }
    }
}

/// Whether the block must leave its works undone, at its start: after a call-signature mismatch
/// no later kernel of the communicator moves data (a receive would write what its peer sent
/// before it learned of the mismatch; a send would feed a FIFO no receive drains). The
/// mismatch's kernel set `DevComm::aborted` (device memory: a cheap load) before this kernel
/// started. Thread 0's look decides for the whole block, which a concurrent abort could
/// otherwise split at the primitives' barriers (an abort's own polls end their waits).
///
/// # Safety
/// `comm` points at a set-up [`DevComm`]; every thread of the block calls it before any uses
/// the kernel's shared memory `smem`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub unsafe fn stopped(comm: u64, tid: u32, smem: *mut u32) -> bool {
    // SAFETY: caller contract.
    unsafe {
        let comm = &*(comm as *const DevComm);
        crate::check::block_bool(tid == 0 && arch::load_volatile_u32(&raw const comm.aborted) != 0, tid, smem)
    }
}

/// Runs one work of a point-to-point launch on this block.
///
/// # Safety
/// `comm` points at a set-up [`DevComm`] whose channel array holds the work's channel; the
/// work's buffer holds its `bytes`; `status` is 0 or this work's own [`P2pStatus`] record; `smem` is the
/// kernel's shared memory; every thread of the block calls this with the same arguments, `tid`
/// in `0..nthreads`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub unsafe fn run_p2p_work(comm: u64, status: u64, w: WorkP2p, tid: u32, nthreads: u32, smem: *mut u32) {
    // SAFETY: caller contract.
    let comm = unsafe { &*(comm as *const DevComm) };
    // SAFETY: caller contract: the channel exists.
    let channel = unsafe { (comm.channels as *mut DevChannel).add(w.channel as usize) };
    let (part, nparts) = (w.part as u64, w.nparts as u64);
    let buff = w.buff as *mut u8;
    if w.kind & !P2P_AFTER_PREVIOUS == P2P_SEND {
        let on_ll = w.proto == Proto::Ll as u8;
        // SAFETY: caller contract; this block uses only the channel's send connection.
        let mut ll = unsafe { ll::<0, 1>(comm, channel, buff, tid, nthreads, smem) };
        ll.send_words(&[w.bytes | if on_ll { P2P_HEADER_LL } else { 0 }]);
        let (off, len) = p2p_part(w.bytes, part, nparts);
        if on_ll {
            ll.send(off, len);
        }
        let go_on = !on_ll && !ll.aborted();
        // SAFETY: every thread calls it once, after its last LL verb.
        unsafe { ll.finish() };
        if go_on {
            // SAFETY: as above; the Simple steps follow the header's on the same connection.
            let mut p = unsafe { simple(comm, channel, buff, tid, nthreads, smem) };
            p.send(off, len);
            // SAFETY: every thread calls it once, after the last verb.
            unsafe { p.finish_one(true) };
        }
        return;
    }
    // SAFETY: as for a send; this block uses only the channel's receive connection.
    let mut ll = unsafe { ll::<1, 0>(comm, channel, buff, tid, nthreads, smem) };
    let Some([header]) = ll.recv_words::<1>() else {
        // SAFETY: every thread calls it once.
        unsafe { ll.finish() };
        return;
    };
    let (sent, on_ll) = (header & !P2P_HEADER_LL, header & P2P_HEADER_LL != 0);
    let (off, len) = p2p_part(sent, part, nparts);
    let keep = core::cmp::min(off + len, w.bytes).saturating_sub(off);
    let mut completed = !ll.aborted();
    if on_ll {
        ll.recv_upto(off, len, keep);
        completed = !ll.aborted();
    }
    // SAFETY: every thread calls it once, after its last LL verb.
    unsafe { ll.finish() };
    if !on_ll {
        // SAFETY: as above; the Simple steps follow the header's on the same connection.
        let mut p = unsafe { simple(comm, channel, buff, tid, nthreads, smem) };
        p.recv_upto(off, len, keep);
        completed = !p.aborted();
        // SAFETY: every thread calls it once, after the last verb.
        unsafe { p.finish_one(false) };
    }
    if completed && sent != w.bytes && tid == 0 && status != 0 {
        let st = status as *mut P2pStatus;
        // SAFETY: a valid status record (caller contract); the flag is stored last, after a
        // fence, so a host that sees it sees the sizes.
        unsafe {
            arch::store_volatile_u64(&raw mut (*st).channel, w.channel as u64);
            arch::store_volatile_u64(&raw mut (*st).sent, sent);
            arch::store_volatile_u64(&raw mut (*st).expected, w.bytes);
            arch::fence_acq_rel_sys();
            arch::store_volatile_u64(&raw mut (*st).flag, 1);
        }
    }
}

/// LL primitives of bytes over one connection of a peer channel: `Ll<1, 0>` receives, `Ll<0, 1>`
/// sends.
type Ll<const NR: usize, const NS: usize> = LlFan<u8, FuncSum, NR, NS>;

/// LL primitives over `channel`'s receive (`NR = 1`) or send (`NS = 1`) connection, input and
/// output at `buff`.
///
/// # Safety
/// As [`run_p2p_work`]; every thread of the block calls it.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn ll<const NR: usize, const NS: usize>(
    comm: &DevComm,
    channel: *mut DevChannel,
    buff: *mut u8,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
) -> Ll<NR, NS> {
    let size = comm.buff_sizes[Proto::Ll as usize];
    // SAFETY: caller contract; the channel's LL buffers are `size` bytes.
    unsafe {
        Ll::new(
            tid,
            nthreads,
            Peers::Ring(channel),
            size,
            buff,
            buff,
            comm.abort_flag,
            smem,
            copy_args(),
        )
    }
}

/// The operator arguments of a copy (no reduction happens).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn copy_args() -> OpArgs {
    OpArgs::new(crate::abi::DevRedOp::Sum, 0)
}

/// Simple primitives over `channel`'s connections, one FIFO slot per step (the slice size does
/// not depend on the size, which the receiver learns only from the header). Loaded after the
/// LL header's step was stored back (`LlFan::finish`): the barrier here makes thread 0's store
/// visible to the block before every thread reads the connection.
///
/// # Safety
/// As [`run_p2p_work`]; every thread of the block calls it.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn simple(
    comm: &DevComm,
    channel: *mut DevChannel,
    buff: *mut u8,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
) -> Simple<u8, FuncSum> {
    // SAFETY: caller contract; the Simple buffers of the channel are `buff_sizes[Simple]` bytes.
    unsafe {
        arch::sync_threads();
        Simple::<u8, FuncSum>::new(
            tid,
            nthreads,
            channel,
            comm.buff_sizes[Proto::Simple as usize],
            buff,
            buff,
            comm.abort_flag,
            &raw const comm.aborted,
            smem,
            copy_args(),
            0,
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::abi::p2p_part;

    #[test]
    fn each_block_runs_the_works_flagged_to_follow_its_first() {
        use crate::abi::{P2P_AFTER_PREVIOUS as AFTER, P2P_RECV as R, P2P_SEND as S, p2p_block_works};
        let kinds = [S, S | AFTER, S | AFTER, R, S, R | AFTER];
        let kind = |i: usize| kinds[i];
        assert_eq!(p2p_block_works(6, 0, kind), Some((0, 3)));
        assert_eq!(p2p_block_works(6, 1, kind), Some((3, 4)));
        assert_eq!(p2p_block_works(6, 2, kind), Some((4, 6)));
        assert_eq!(p2p_block_works(6, 3, kind), None);
        // Only the first `nworks` count; none at all, no block.
        assert_eq!(p2p_block_works(5, 2, kind), Some((4, 5)));
        assert_eq!(p2p_block_works(0, 0, kind), None);
        let alone = [R, S, R];
        for b in 0..3 {
            assert_eq!(
                p2p_block_works(3, b, |i| alone[i]),
                Some((b as usize, b as usize + 1))
            );
        }
    }

    #[test]
    fn parts_are_whole_packs_that_cover_the_transfer_once() {
        assert_eq!(p2p_part(0, 0, 1), (0, 0));
        assert_eq!(p2p_part(100, 0, 1), (0, 100));
        assert_eq!(p2p_part(100, 0, 2), (0, 64));
        assert_eq!(p2p_part(100, 1, 2), (64, 36));
        assert_eq!(p2p_part(16, 1, 4), (16, 0));
        for bytes in [0u64, 1, 15, 16, 17, 1000, 1 << 20, (1 << 20) + 3] {
            for nparts in 1..=8u64 {
                let mut next = 0;
                for part in 0..nparts {
                    let (off, len) = p2p_part(bytes, part, nparts);
                    assert_eq!(off, next, "{bytes} {part}/{nparts}");
                    assert!(off % 16 == 0 || len == 0, "{bytes} {part}/{nparts}");
                    next = off + len;
                }
                assert_eq!(next, bytes, "{bytes} over {nparts}");
            }
        }
    }
}
