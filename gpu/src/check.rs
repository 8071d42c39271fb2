//! The call-signature check (beyond NCCL; `OXCCL_CHECK_CALLS=1` on the host): before a
//! collective's own kernel, one block gathers every rank's [`CallSig`] of the call over ring
//! channel 0 on the LL protocol (an AllGather of 32 bytes per rank through the same primitives
//! the collectives use, so it runs over every transport) and compares them. Every rank then
//! holds the same signatures and reaches the same verdict: on a mismatch each writes them to its
//! host-visible [`CheckReport`] and sets [`DevComm::aborted`] to [`CALL_MISMATCH`], so the
//! call's kernel (flagged [`crate::abi::WORK_CALL_CHECKED`]) and every later one exit before they
//! touch a buffer. The host side is `comm/call_check.rs`.
use crate::abi::{
    CALL_MISMATCH, CALL_SIG_WORDS, CallSig, CheckArgs, CheckReport, DevChannel, DevComm, DevRedOp, Proto,
};
use crate::arch;
use crate::coll::RingCtx;
use crate::proto::Primitives;
use crate::proto::fan::Peers;
use crate::proto::ll::Ll;
use crate::reduce::{FuncSum, OpArgs};

/// Runs the check of one call: every thread of the one block calls it.
///
/// # Safety
/// `args.comm` is a set-up [`DevComm`] with at least one ring channel whose connections have LL
/// buffers; `args.board` holds `nranks + 1` signatures of device memory (16-byte aligned);
/// `args.report` is a [`CheckReport`] followed by `nranks` signatures; `args.work` is the
/// gather described at [`CheckArgs::work`]; `smem` is the kernel's shared memory; every rank of
/// the communicator runs the check of its call of the same sequence number.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub unsafe fn run_check(args: &CheckArgs, tid: u32, nthreads: u32, smem: *mut u32) {
    // SAFETY: caller contract.
    let comm = unsafe { &*(args.comm as *const DevComm) };
    // After a mismatch (or an abort) every rank skips its later checks alike, so no rank waits
    // for a gather its peers never start.
    // SAFETY: the comm block is valid (caller contract).
    if unsafe { arch::load_volatile_u32(&raw const comm.aborted) } != 0 {
        return;
    }
    let n = comm.nranks as usize;
    let board = args.board as *mut u64;
    // SAFETY: the board holds `n + 1` signatures (caller contract).
    let own = unsafe { board.add(n * CALL_SIG_WORDS) };
    let sig: CallSig = args.sig;
    if tid == 0 {
        for (k, v) in sig.iter().enumerate() {
            // SAFETY: inside the board's last row.
            unsafe { own.add(k).write_volatile(*v) };
        }
    }
    // SAFETY: every thread of the block calls this.
    unsafe { arch::sync_threads() };
    let w = &args.work;
    // SAFETY: caller contract: channel 0 exists with its ring and LL connections.
    let aborted = unsafe {
        let channel = comm.channels as *mut DevChannel;
        let ring = RingCtx {
            nranks: n as u64,
            user_ranks: (*channel).ring.user_ranks as *const u32,
            channel: 0,
            nchannels: 1,
        };
        let mut p = Ll::<u64, FuncSum>::new(
            tid,
            nthreads,
            Peers::Ring(channel),
            comm.buff_sizes[Proto::Ll as usize],
            own as *const u64,
            board,
            comm.abort_flag,
            smem,
            OpArgs::new(DevRedOp::Sum, 0),
        );
        crate::coll::all_gather::ring(&mut p, &ring, w.count, w.chunk_elems, 8, false);
        let aborted = p.aborted();
        p.finish();
        aborted
    };
    // SAFETY: as above.
    unsafe { arch::sync_threads() };
    if tid != 0 || aborted {
        return;
    }
    // An abort seen by another thread of the block left the board partial: no verdict.
    // SAFETY: the abort flag is a valid host-mapped u32 (caller contract).
    if comm.abort_flag != 0 && unsafe { arch::load_volatile_u32(comm.abort_flag as *const u32) } != 0 {
        return;
    }
    let mut same = true;
    for r in 0..n {
        for (k, v) in sig.iter().enumerate() {
            // SAFETY: row `r` < `n` of the board, written by the gather (the barrier above).
            same &= unsafe { board.add(r * CALL_SIG_WORDS + k).read_volatile() } == *v;
        }
    }
    if same {
        return;
    }
    let report = args.report as *mut u64;
    let header = core::mem::size_of::<CheckReport>() / 8;
    // SAFETY: the report holds its header and `n` signatures (caller contract); the comm block
    // is this rank's, which its kernels may write (through the raw address, not `comm`).
    unsafe {
        for i in 0..n * CALL_SIG_WORDS {
            arch::store_volatile_u64(report.add(header + i), board.add(i).read_volatile());
        }
        arch::store_volatile_u32(&raw mut (*(args.comm as *mut DevComm)).aborted, CALL_MISMATCH);
        arch::fence_acq_rel_sys();
        arch::store_release_sys_u64(report, sig[0]);
    }
}
