//! The call-signature check (beyond NCCL; `OXCCL_CHECK_CALLS=1` on the host), at the start of a
//! checked collective's kernel: block 0 gathers every rank's [`CallSig`] of the call over ring
//! channel 0 on the LL protocol (a ring AllGather of 32 bytes per rank, a step of four LL lines
//! per hop, over the FIFOs the collectives use, so it runs over every transport) and compares
//! them, while the other blocks wait for its verdict ([`CheckDesc::done`]). Every rank holds the
//! same signatures and reaches the same verdict: on a mismatch each writes them to its
//! host-visible [`CheckReport`] and sets [`DevComm::aborted`] to [`CALL_MISMATCH`], so no block
//! of this call — nor of any later kernel — touches a buffer. A call of count 0 runs the check
//! alone (`oxccl_check_call`). The host side is `comm/call_check.rs`.
use crate::abi::{
    CALL_MISMATCH, CALL_SIG_WORDS, CHECK_HALTED, CallSig, CheckDesc, CheckReport, DevChannel, DevComm, DevRedOp, Proto,
};
use crate::arch;
use crate::coll::RingCtx;
use crate::proto::Primitives;
use crate::proto::fan::Peers;
use crate::proto::ll::Ll;
use crate::reduce::{FuncSum, OpArgs};

/// Block `bid` of a checked call's kernel: block 0 checks the call ([`check_call`]), the others
/// wait for its verdict; with [`crate::abi::CHECK_VERDICT_ONLY`] in `desc`, every block only
/// honours the verdict of the check kernel that ran before. Returns whether the call may go on (the same answer for every thread of
/// the block). The waiting blocks rely on block 0 running meanwhile, as every oxccl kernel
/// relies on its blocks and its peers' being resident together (a grid of at most one block per
/// channel, fewer than the GPU's multiprocessors).
///
/// # Safety
/// As [`check_call`] for block 0; every thread of the block calls this.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub unsafe fn checked(
    comm: u64,
    desc: u64,
    sig: &CallSig,
    bid: u32,
    nblocks: u32,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
) -> bool {
    // SAFETY: forwarded caller contract.
    unsafe {
        if desc & crate::abi::CHECK_VERDICT_ONLY != 0 {
            // Checked by the check kernel before this one: every block honours its verdict.
            let comm = &*(comm as *const DevComm);
            !block_bool(tid == 0 && !same_verdict(comm), tid, smem)
        } else if bid == 0 {
            check_call(comm, desc, sig, nblocks > 1, tid, nthreads, smem)
        } else {
            await_verdict(comm, desc, sig[0], tid, smem)
        }
    }
}

/// `value` of thread 0 made every thread's: through shared memory, between barriers (the
/// block's later users of shared memory find it as before).
///
/// # Safety
/// Every thread of the block calls it; `smem` is the kernel's shared memory.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn block_bool(value: bool, tid: u32, smem: *mut u32) -> bool {
    // SAFETY: caller contract; word 0 of the block's shared memory, read by every thread only
    // after the first barrier and before the second.
    unsafe {
        if tid == 0 {
            smem.write_volatile(value as u32);
        }
        arch::sync_threads();
        let v = smem.read_volatile() != 0;
        arch::sync_threads();
        v
    }
}

/// Whether this rank's abort flag (host-mapped) or `DevComm::aborted` is raised.
///
/// # Safety
/// `comm` is a valid comm block.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn stopped(comm: &DevComm) -> bool {
    // SAFETY: valid flag addresses (caller contract).
    unsafe {
        arch::load_volatile_u32(&raw const comm.aborted) != 0
            || (comm.abort_flag != 0 && arch::load_volatile_u32(comm.abort_flag as *const u32) != 0)
    }
}

/// Whether block 0's verdict lets the call go on: no mismatch (`DevComm::aborted`, device
/// memory, written before the verdict). An abort after the verdict is the collective's to see.
///
/// # Safety
/// `comm` is a valid comm block.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn same_verdict(comm: &DevComm) -> bool {
    // SAFETY: caller contract.
    unsafe { arch::load_volatile_u32(&raw const comm.aborted) == 0 }
}

/// Checks the call of signature `sig` on this block: gathers every rank's signature, compares
/// (every thread, as the signatures arrive), sets `DevComm::aborted` on a mismatch and, when
/// other blocks of the launch wait for the verdict (`waiters`), publishes it (`desc.done =
/// sig[0]`, after `DevComm::aborted`). Returns whether the call may go on (the same answer for
/// every thread of the block).
///
/// # Safety
/// `comm` is a set-up [`DevComm`] with at least one ring channel whose connections have LL
/// buffers; `desc` its [`CheckDesc`]; `smem` is the kernel's shared memory; every thread of the
/// block calls this; every rank of the communicator runs the check of its call of the same
/// number.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub unsafe fn check_call(
    comm: u64,
    desc: u64,
    sig: &CallSig,
    waiters: bool,
    tid: u32,
    nthreads: u32,
    smem: *mut u32,
) -> bool {
    let comm_ptr = comm as *mut DevComm;
    // SAFETY: caller contract.
    let comm = unsafe { &*comm_ptr };
    let d = desc as *mut CheckDesc;
    // After a mismatch every rank skips its later checks alike, so no rank waits for a gather
    // its peers never start. (Device memory only: a host-mapped read here would put a PCIe round
    // trip before every checked call; an abort stops the gather's waits instead.)
    // SAFETY: caller contract.
    if unsafe { block_bool(tid == 0 && arch::load_volatile_u32(&raw const comm.aborted) != 0, tid, smem) } {
        return false;
    }
    let n = comm.nranks as usize;
    // SAFETY: the descriptor is valid (caller contract); the host wrote these fields at init.
    let (board, report) = unsafe { ((*d).board as *mut u64, (*d).report as *mut u64) };
    // Thread 0 keeps rank `r`'s signature in row `r` of the board.
    let put = |r: u64, words: &CallSig| {
        if tid == 0 {
            for (k, v) in words.iter().enumerate() {
                // SAFETY: row `r` < `n` of the board, which holds `n` signatures (caller
                // contract).
                unsafe { board.add(r as usize * CALL_SIG_WORDS + k).write_volatile(*v) };
            }
        }
    };
    // Every thread receives every signature (`recv_words`), so every thread compares them as
    // they arrive and reaches the same verdict without reading the board back.
    let mut same = true;
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
            board,
            board,
            comm.abort_flag,
            smem,
            OpArgs::new(DevRedOp::Sum, 0),
        );
        // A ring AllGather of one signature per rank, a step of four LL lines per hop: at hop
        // `j` this rank passes on the signature of the rank `j - 1` hops upstream (its own
        // first) and receives that of the rank `j` hops upstream from its previous rank.
        let mut cur = *sig;
        put(ring.user_rank(0), &cur);
        for j in 1..n as u64 {
            p.send_words(&cur);
            let Some(got) = p.recv_words::<CALL_SIG_WORDS>() else {
                break;
            };
            put(ring.user_rank(n as u64 - j), &got);
            // Word by word (an array `==` is a `bcmp` of the parameter's address, which puts
            // the whole kernel parameter in local memory).
            for k in 0..CALL_SIG_WORDS {
                same &= got[k] == sig[k];
            }
            cur = got;
        }
        let aborted = p.aborted();
        p.finish();
        aborted
    };
    // `aborted` is the block's (an abort seen by any thread reaches all through the LL
    // primitives' shared word): after one, the board may be partial and no verdict is given;
    // the call's other blocks learn it from here (they do not read the host's abort flag).
    if tid == 0 && aborted && waiters {
        // SAFETY: the descriptor is this rank's (caller contract).
        unsafe {
            arch::fence_acq_rel_gpu();
            arch::store_volatile_u64(&raw mut (*d).done, sig[0] | CHECK_HALTED);
        }
    }
    if tid == 0 && !aborted {
        let header = core::mem::size_of::<CheckReport>() / 8;
        // SAFETY: the report holds its header and `n` signatures (caller contract); the board
        // rows were written by this thread during the gather; the comm block and the
        // descriptor are this rank's, which its kernels may write (through the raw addresses,
        // not `comm`).
        unsafe {
            if !same {
                for i in 0..n * CALL_SIG_WORDS {
                    arch::store_volatile_u64(report.add(header + i), board.add(i).read_volatile());
                }
                arch::store_volatile_u32(&raw mut (*comm_ptr).aborted, CALL_MISMATCH);
                arch::fence_acq_rel_sys();
                // The report's header says it is written: the call's number, or 1 for a call of a
                // graph (number 0).
                arch::store_release_sys_u64(report, if sig[0] == 0 { 1 } else { sig[0] });
            }
            if waiters {
                // The verdict for the call's other blocks, all on this GPU: `aborted` (set above
                // or not) before it, at GPU scope.
                arch::fence_acq_rel_gpu();
                arch::store_volatile_u64(&raw mut (*d).done, sig[0]);
            }
        }
    }
    // The block's shared memory is the collective's from here: every thread is past the
    // gather's last use of it.
    // SAFETY: every thread of the block calls this.
    unsafe { arch::sync_threads() };
    !aborted && same
}

/// A block other than the checking one: waits until block 0 has published the verdict of call
/// `seq` — a verdict, or that its check stopped on an abort — or until `DevComm::aborted` says a
/// mismatch stopped the communicator (block 0 then skips the check); whether the call may go on.
/// Only device memory is polled: an abort reaches these blocks through block 0, whose gather
/// watches the host's abort flag as every primitive does (the flag itself is looked at only
/// every 65,536th look, a safety net).
///
/// # Safety
/// As [`check_call`].
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn await_verdict(comm: u64, desc: u64, seq: u64, tid: u32, smem: *mut u32) -> bool {
    // SAFETY: caller contract.
    let comm = unsafe { &*(comm as *const DevComm) };
    let d = desc as *const CheckDesc;
    let mut go = false;
    if tid == 0 {
        let mut spins = 0u32;
        loop {
            // SAFETY: valid descriptor and flags (caller contract).
            unsafe {
                let done = arch::load_volatile_u64(&raw const (*d).done);
                if done & !CHECK_HALTED >= seq {
                    arch::fence_acq_rel_gpu();
                    go = done & CHECK_HALTED == 0 && same_verdict(comm);
                    break;
                }
                if spins % 64 == 63 && !same_verdict(comm) {
                    break;
                }
                if spins % 65_536 == 65_535 && stopped(comm) {
                    break;
                }
            }
            spins = spins.wrapping_add(1);
            // Up to a channel's worth of blocks poll one word while block 0 gathers: each
            // pauses between looks, so their reads do not crowd the gather's.
            arch::nanosleep(if spins < 16 { 32 } else { 256 });
        }
    }
    // SAFETY: every thread of the block calls it.
    unsafe { block_bool(go, tid, smem) }
}
