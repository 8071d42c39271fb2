//! The call-signature check (beyond NCCL; `OXCCL_CHECK_CALLS=1` on the host), inside a checked
//! collective's kernel: one block more than the call's channels, the last, collects every
//! rank's [`CallSig`] of the call and compares them. Ranks of one host find the
//! signatures in their rows ([`CheckDesc::rows`]), which every rank's host wrote when it
//! launched the call, so no rank waits for a peer's kernel to start; once a call agrees, the
//! checking block also looks at the next call's rows and, when every rank's host has launched
//! it alike, publishes its agreement ahead ([`look_ahead`]): the next kernel's blocks then wait
//! for nothing. Other ranks gather the signatures over the check's own channel on the LL protocol
//! (a ring AllGather of 32 bytes per rank, a step of four LL lines per hop, over FIFOs no
//! collective, send or receive uses, so it runs over every transport, beside the call's data, and
//! never meets a send still waiting in a FIFO for its receive). Meanwhile the call's blocks
//! move its data; each waits for the verdict ([`CheckDesc::done`]) at its [`gate`], before its
//! first write to a user buffer — its output, or a peer's through a direct send — so the check
//! overlaps the call's first hops. Every rank holds the same signatures and reaches the same
//! verdict: on a mismatch each writes them to its host-visible [`CheckReport`] and sets
//! [`DevComm::aborted`] and its abort line's stop word to [`CALL_MISMATCH`]; the gated blocks
//! stop at their gate, the blocks waiting on a FIFO see the stop word in their abort polls, and
//! no block of this call — nor of any later kernel — writes a user buffer. A call of count 0
//! runs the check alone (`oxccl_check_call`). The host side is `comm/call_check.rs`.
use crate::abi::{
    ABORT_LINE_STOP, CALL_MISMATCH, CALL_SIG_WORDS, CHECK_DIFFERENT, CHECK_HALTED, CallSig, CheckDesc,
    CheckReport, DevChannel, DevComm, DevRedOp, Proto, SMEM_GATE, SPINS_BEFORE_CHECK_ABORT, WARP_SIZE,
    check_row_flag, check_row_offset,
};
use crate::arch::Pack;
use crate::arch;
use crate::proto::Primitives;
use crate::proto::fan::Peers;
use crate::proto::ll::Ll;
use crate::reduce::{FuncSum, OpArgs};

/// Block `bid` of a checked call's kernel of `nblocks` blocks: the last block checks the call
/// ([`check_call`]) and has no share of its data; every other block arms its [`gate`] and goes
/// on to move data, waiting for the verdict only before its first write to a user buffer. With
/// [`crate::abi::CHECK_VERDICT_ONLY`] in `desc`, every block only honours the verdict of the
/// check kernel that ran before. Returns `None` when the block stops (in every thread of the
/// block alike), else what its gate needs ([`gate`]): thread 0's look at the verdict word
/// ([`CheckDesc::done`]), taken as it armed the gate so that the load's time passes while the
/// block sets up (0 in every other thread and where the block has no gate). The gates rely on
/// the checking block running meanwhile, as every oxccl kernel relies on its blocks and its peers' being resident together
/// (a grid of at most one block per channel and the checking block, fewer than the GPU's
/// multiprocessors).
///
/// # Safety
/// As [`check_call`] for the last block; every thread of the block calls this.
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
) -> Option<u64> {
    // SAFETY: forwarded caller contract.
    unsafe {
        if desc & crate::abi::CHECK_VERDICT_ONLY != 0 {
            // Checked by the check kernel before this one: every block honours its verdict.
            let comm = &*(comm as *const DevComm);
            (!block_bool(tid == 0 && !same_verdict(comm), tid, smem)).then_some(0)
        } else if nblocks < 2 {
            // No block to spare (a launch the host does not make): check, then move the data
            // past a gate armed open.
            arm_gate(comm, 0, 0, tid, smem);
            check_call(comm, desc, sig, false, tid, nthreads, smem).then_some(0)
        } else if bid == nblocks - 1 {
            check_call(comm, desc, sig, true, tid, nthreads, smem);
            None
        } else {
            arm_gate(comm, desc, sig[0], tid, smem);
            // The verdict is most often published before the kernel starts (by the kernel
            // before: `look_ahead`); loaded here and first used at the gate, the load costs the
            // gate nothing.
            Some(if tid == 0 { arch::load_volatile_u64(&raw const (*(desc as *const CheckDesc)).done) } else { 0 })
        }
    }
}

/// Arms the block's gate for the check of call `seq` (its words at [`SMEM_GATE`] in shared
/// memory: the descriptor, the number, the comm block), visible to every thread after the
/// barrier. A gate armed with descriptor 0 stays open.
///
/// # Safety
/// Every thread of the block calls it; `smem` is the kernel's shared memory.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn arm_gate(comm: u64, desc: u64, seq: u64, tid: u32, smem: *mut u32) {
    // SAFETY: caller contract: the gate's three words lie inside the kernel's shared memory,
    // 8-byte aligned, used by nothing else.
    unsafe {
        let g = smem.byte_add(SMEM_GATE) as *mut u64;
        if tid == 0 {
            g.write_volatile(desc);
            g.add(1).write_volatile(seq);
            g.add(2).write_volatile(comm);
        }
        arch::sync_threads();
    }
}

/// The gate's word once the verdict said stop (descriptor addresses are 8-byte aligned).
const GATE_SHUT: u64 = u64::MAX;

/// The gate before a block's first write to a user buffer (its own output, or a peer's through
/// a direct send) in a checked call's kernel: whether the block may write. The first pass takes
/// the verdict from `seen` (thread 0's look at the verdict word when the block armed the gate,
/// as [`checked`] returned it) when that look found it, else waits for the checking block's;
/// later passes cost a shared-memory load. Every thread of the block calls it at the same point
/// of the algorithm (`RingCtx::gate`, which skips it in an unchecked kernel, whose shared memory
/// holds no gate).
///
/// # Safety
/// Every thread of the block calls it; `smem` is the kernel's shared memory, whose gate words
/// this block armed ([`checked`]).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub unsafe fn gate(tid: u32, smem: *mut u32, seen: u64) -> bool {
    // SAFETY: caller contract (as `arm_gate`); the gate's word changes only between the two
    // barriers below, which every thread reaches.
    unsafe {
        let g = smem.byte_add(SMEM_GATE) as *mut u64;
        let desc = g.read_volatile();
        if desc == 0 {
            return true;
        }
        if desc == GATE_SHUT {
            return false;
        }
        // Every thread has read the word before thread 0 rewrites it.
        arch::sync_threads();
        if tid == 0 {
            let seq = g.add(1).read_volatile();
            let go = match verdict(seen, seq) {
                Some(go) => go,
                None => await_verdict(&*(g.add(2).read_volatile() as *const DevComm), desc as *const CheckDesc, seq),
            };
            g.write_volatile(if go { 0 } else { GATE_SHUT });
        }
        arch::sync_threads();
        g.read_volatile() == 0
    }
}

/// `value` of thread 0 made every thread's: through shared memory, between barriers (the
/// block's later users of shared memory find it as before).
///
/// # Safety
/// Every thread of the block calls it; `smem` is the kernel's shared memory.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn block_bool(value: bool, tid: u32, smem: *mut u32) -> bool {
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
            || crate::proto::fan::abort_raised(comm.abort_flag as *const u32)
    }
}

/// Whether no call check of the communicator found a mismatch (`DevComm::aborted`, device
/// memory): what a launch that honours the check kernel's verdict reads, and what the gates poll
/// while they wait.
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
/// other blocks of the launch wait for the verdict (`waiters`), publishes it in `desc.done`
/// (after `DevComm::aborted`). The gather is a ring AllGather over the check's own channel
/// ([`CheckDesc::channel`]: its send connection goes to rank `rank + 1`, its receive connection
/// comes from `rank − 1`), which no collective, send or receive uses, so it runs beside the
/// call's own channels. Returns whether the call may go on (the same answer for every thread of
/// the block).
///
/// # Safety
/// `comm` is a set-up [`DevComm`] of at least two ranks, whose channel
/// [`CheckDesc::channel`] has LL buffers; `desc` its [`CheckDesc`]; `smem` is the kernel's shared
/// memory; every thread of the block calls this; every rank of the communicator runs the check
/// of its call of the same number.
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
    // The verdict for the launch's gated blocks, which act on its flags alone: an agreement is
    // stored at once (nothing before it needs ordering, and a fence here would wait for the
    // gather's stores into the peer's FIFO); a stop after `DevComm::aborted`, at GPU scope.
    // A mismatch is stored even with no waiters (a graph's check kernel, a call of count 0):
    // a later kernel's gates and checking block must not act on an agreement published ahead.
    let publish = |flags: u64| {
        if tid == 0 && (waiters || flags & CHECK_DIFFERENT != 0) {
            // SAFETY: the descriptor is this rank's (caller contract).
            unsafe {
                if flags != 0 {
                    arch::fence_acq_rel_gpu();
                }
                arch::store_volatile_u64(&raw mut (*d).done, sig[0] | flags);
            }
        }
    };
    // What the gather needs of the comm block and the descriptor, loaded before the look at
    // `DevComm::aborted` below so that the loads travel together: the first send waits for one
    // round trip to memory fewer.
    let n = comm.nranks as u64;
    let me = comm.rank as u64;
    let ll_bytes = comm.buff_sizes[Proto::Ll as usize];
    let abort_flag = comm.abort_flag;
    // SAFETY: the descriptor is valid (caller contract); the host wrote these fields at init.
    let (board, report, rows, channel) =
        unsafe { ((*d).board as *mut u64, (*d).report as *mut u64, (*d).rows, (*d).channel) };
    // SAFETY: caller contract: the check's channel exists.
    let channel = unsafe { (comm.channels as *mut DevChannel).add(channel as usize) };
    if rows != 0 && sig[0] != 0 {
        // The hosts wrote the signatures into the rows (a graph's calls, of number 0, gather).
        // SAFETY: caller contract; `rows` is the descriptor's block.
        let (aborted, same) = unsafe {
            if block_bool(tid == 0 && published_ahead(comm, d, sig[0]), tid, smem) {
                // The kernel before found this call's signatures and published the agreement.
                look_ahead(d, rows, sig[0], n, me, tid);
                arch::sync_threads();
                return true;
            }
            match read_rows(comm, rows, sig, board, tid, smem) {
                Some(v) => v,
                None => {
                    publish(CHECK_HALTED);
                    return false;
                }
            }
        };
        if !aborted && same {
            publish(0);
        }
        if !aborted {
            // SAFETY: as above.
            unsafe { look_ahead(if same { d } else { core::ptr::null_mut() }, rows, sig[0], n, me, tid) };
        }
        // SAFETY: caller contract: the report, board and comm block.
        return unsafe { conclude(comm_ptr, report, board, sig, aborted, same, tid, publish) };
    }
    // After a mismatch every rank skips its later checks alike, so no rank waits for a gather
    // its peers never start. (Device memory only: a host-mapped read here would put a PCIe round
    // trip before every checked call; an abort stops the gather's waits instead.)
    // SAFETY: caller contract.
    if unsafe { block_bool(tid == 0 && arch::load_volatile_u32(&raw const comm.aborted) != 0, tid, smem) } {
        publish(CHECK_HALTED);
        return false;
    }
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
    // SAFETY: caller contract: the check's channel exists with LL connections.
    let aborted = unsafe {
        let mut p = Ll::<u64, FuncSum>::new(
            tid,
            nthreads,
            Peers::Ring(channel),
            ll_bytes,
            board,
            board,
            abort_flag,
            smem,
            OpArgs::new(DevRedOp::Sum, 0),
        );
        // A ring AllGather of one signature per rank, a step of four LL lines per hop: at hop
        // `j` this rank passes on the signature of rank `me − (j − 1)` (its own first) and
        // receives that of rank `me − j` from rank `me − 1`.
        let mut cur = *sig;
        put(me, &cur);
        for j in 1..n {
            p.send_words(&cur);
            let Some(got) = p.recv_words::<CALL_SIG_WORDS>() else {
                break;
            };
            put((me + n - j) % n, &got);
            // Word by word (an array `==` is a `bcmp` of the parameter's address, which puts
            // the whole kernel parameter in local memory).
            for k in 0..CALL_SIG_WORDS {
                same &= got[k] == sig[k];
            }
            cur = got;
        }
        let aborted = p.aborted();
        if !aborted && same {
            // The gated blocks go on as soon as the last signature is in.
            publish(0);
        }
        p.finish();
        aborted
    };
    // SAFETY: caller contract: the report, board and comm block.
    unsafe { conclude(comm_ptr, report, board, sig, aborted, same, tid, publish) }
}

/// The end of a check whose signatures are on the board: on a mismatch (`same` false) thread 0
/// copies them to the report and stops the communicator; the verdict for the gated blocks
/// (`publish`) when the check stopped on an abort or found a mismatch. Returns whether the call
/// may go on.
///
/// # Safety
/// As [`check_call`], `report` and `board` the descriptor's; every thread of the block calls
/// it with the same `aborted` and `same`.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
#[allow(clippy::too_many_arguments)]
unsafe fn conclude(
    comm_ptr: *mut DevComm,
    report: *mut u64,
    board: *mut u64,
    sig: &CallSig,
    aborted: bool,
    same: bool,
    tid: u32,
    publish: impl Fn(u64),
) -> bool {
    // SAFETY: caller contract.
    let comm = unsafe { &*comm_ptr };
    let n = comm.nranks as u64;
    // `aborted` is the block's (an abort seen by any thread reaches all through the LL
    // primitives' shared word, or the rows' vote): after one, the board may be partial and no
    // verdict is given.
    if aborted {
        publish(CHECK_HALTED);
    } else {
        if tid == 0 && !same {
            let header = core::mem::size_of::<CheckReport>() / 8;
            // SAFETY: the report holds its header and `n` signatures (caller contract); the
            // board rows were written by this thread during the gather; the comm block is this
            // rank's, which its kernels may write (through the raw address, not `comm`).
            unsafe {
                for i in 0..n as usize * CALL_SIG_WORDS {
                    arch::store_volatile_u64(report.add(header + i), board.add(i).read_volatile());
                }
                arch::store_volatile_u32(&raw mut (*comm_ptr).aborted, CALL_MISMATCH);
                // The call's blocks waiting on FIFOs that the peers' gated blocks stop feeding
                // leave at their next look at the abort line.
                if comm.abort_flag != 0 {
                    let stop = (comm.abort_flag as usize + ABORT_LINE_STOP) as *mut u32;
                    arch::store_volatile_u32(stop, CALL_MISMATCH);
                }
                arch::fence_acq_rel_sys();
                // The report's header says it is written: the call's number, or 1 for a call of a
                // graph (number 0).
                arch::store_release_sys_u64(report, if sig[0] == 0 { 1 } else { sig[0] });
            }
        }
        if !same {
            publish(CHECK_DIFFERENT);
        }
    }
    // The block's shared memory is the collective's from here: every thread is past the
    // gather's last use of it.
    // SAFETY: every thread of the block calls this.
    unsafe { arch::sync_threads() };
    !aborted && same
}

/// Whether the kernel before published call `seq`'s agreement ahead ([`look_ahead`]) and no
/// check stopped the communicator since.
///
/// # Safety
/// `comm` and `d` are the rank's comm block and descriptor.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn published_ahead(comm: &DevComm, d: *const CheckDesc, seq: u64) -> bool {
    // SAFETY: caller contract (two loads in flight together).
    let (done, aborted) =
        unsafe { (arch::load_volatile_u64(&raw const (*d).done), arch::load_volatile_u32(&raw const comm.aborted)) };
    aborted == 0 && done & (CHECK_HALTED | CHECK_DIFFERENT) == 0 && done >= seq
}

/// Word `k` of `sig`, picked with constant indices (a register array, never local memory).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn sig_word(sig: &CallSig, k: u64) -> u64 {
    let mut x = 0;
    for (i, w) in sig.iter().enumerate() {
        if k == i as u64 {
            x = *w;
        }
    }
    x
}

/// The row line at `line` once it holds `flag` twice: its word, or `None` on abort (the abort
/// line at `abort_flag`, polled as the primitives do).
///
/// # Safety
/// `line` is a 16-byte aligned line of a rows block.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn poll_row_line(line: *const Pack, flag: u32, abort_flag: *const u32) -> Option<u64> {
    let mut spins = 0u32;
    loop {
        // SAFETY: caller contract.
        let Pack([lo, f1, hi, f2]) = unsafe { arch::load_volatile_v4(line) };
        if f1 == flag && f2 == flag {
            return Some(lo as u64 | (hi as u64) << 32);
        }
        spins += 1;
        if spins == SPINS_BEFORE_CHECK_ABORT {
            spins = 0;
            if crate::proto::fan::abort_raised(abort_flag) {
                return None;
            }
        }
        arch::spin_pause();
    }
}

/// The peers' signatures of call `sig[0]` from this rank's rows ([`CheckDesc::rows`], written
/// by the peers' hosts): the block's first warp waits for each line (lane `l` of a pass reads
/// line `l % 4` of writer `l / 4`), compares it with this rank's word and keeps it on the board
/// by rank. `None` when the communicator was stopped by an earlier mismatch (as every rank
/// finds); else whether the wait stopped on an abort and whether every signature is this
/// rank's, the same for every thread of the block. Word 0 of `smem` carries the answer past a
/// barrier: the caller's next barrier must come before shared memory is used again.
///
/// # Safety
/// As [`check_call`], `rows` the descriptor's block, `board` its board; every thread of the
/// block calls it.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn read_rows(
    comm: &DevComm,
    rows: u64,
    sig: &CallSig,
    board: *mut u64,
    tid: u32,
    smem: *mut u32,
) -> Option<(bool, bool)> {
    let (n, me, seq) = (comm.nranks as u64, comm.rank as u64, sig[0]);
    let abort_flag = comm.abort_flag as *const u32;
    let flag = check_row_flag(seq);
    let words = CALL_SIG_WORDS as u64;
    if tid < WARP_SIZE {
        // SAFETY: caller contract: the comm block, the rows block of `n` writers and the board
        // of `n` signatures.
        unsafe {
            // One answer for the warp: an abort stopping the communicator meanwhile must not
            // leave a lane's line uncompared.
            let halted = arch::vote_any(arch::load_volatile_u32(&raw const comm.aborted) != 0);
            let (mut aborted, mut differs) = (false, false);
            if !halted {
                let mut base = 0;
                while base < n * words {
                    let line = base + tid as u64;
                    let (writer, k) = (line / words, line % words);
                    if line < n * words && writer != me && !aborted {
                        let at = (rows + check_row_offset(writer, seq)) as *const Pack;
                        match poll_row_line(at.add(k as usize), flag, abort_flag) {
                            Some(v) => {
                                differs |= v != sig_word(sig, k);
                                board.add(line as usize).write_volatile(v);
                            }
                            None => aborted = true,
                        }
                    }
                    base += WARP_SIZE as u64;
                }
                if tid == 0 {
                    for (k, v) in sig.iter().enumerate() {
                        board.add(me as usize * CALL_SIG_WORDS + k).write_volatile(*v);
                    }
                }
            }
            let aborted = arch::vote_any(aborted);
            let differs = arch::vote_any(differs);
            if tid == 0 {
                smem.write_volatile(halted as u32 | (aborted as u32) << 1 | (differs as u32) << 2);
            }
        }
    }
    // SAFETY: every thread of the block reaches the barrier; word 0 was written before it.
    let v = unsafe {
        arch::sync_threads();
        smem.read_volatile()
    };
    if v & 1 != 0 { None } else { Some((v & 2 != 0, v & 4 == 0)) }
}

/// After this rank's check of call `seq` agreed: the block's first warp looks once at every
/// rank's row slot of call `seq + 1` (this rank's own included, which its host wrote when it
/// launched that call); when all are in and equal, thread 0 publishes that call's agreement in
/// `d` (unless null), so the next kernel's gated blocks find their verdict at once and its
/// checking block waits for no row. Then thread 0 stores `seq` in the rows' header: every slot
/// of a call up to `seq + 1` has been read for the last time by this rank.
///
/// # Safety
/// `rows` is a rows block of `n` writers, this rank `me`; `d` this rank's descriptor or null;
/// the block's first warp calls it together.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn look_ahead(d: *mut CheckDesc, rows: u64, seq: u64, n: u64, me: u64, tid: u32) {
    if tid >= WARP_SIZE {
        return;
    }
    let next = seq + 1;
    let flag = check_row_flag(next);
    let words = CALL_SIG_WORDS as u64;
    let mut apart = false;
    let mut base = 0;
    while base < n * words {
        let line = base + tid as u64;
        if line < n * words {
            let (writer, k) = (line / words, line % words);
            // SAFETY: caller contract: every writer's slot lies inside the block.
            unsafe {
                let at = (rows + check_row_offset(writer, next)) as *const Pack;
                let own = (rows + check_row_offset(me, next)) as *const Pack;
                let Pack([lo, f1, hi, f2]) = arch::load_volatile_v4(at.add(k as usize));
                let Pack([olo, g1, ohi, g2]) = arch::load_volatile_v4(own.add(k as usize));
                apart |= f1 != flag || f2 != flag || g1 != flag || g2 != flag || lo != olo || hi != ohi;
            }
        }
        base += WARP_SIZE as u64;
    }
    // SAFETY: every lane of the first warp votes.
    let apart = unsafe { arch::vote_any(apart) };
    if tid == 0 {
        // SAFETY: caller contract: the descriptor and the rows' header are this rank's.
        unsafe {
            if !apart && !d.is_null() {
                arch::store_volatile_u64(&raw mut (*d).done, next);
            }
            // The slots' loads are done before a writer may reuse them.
            arch::fence_acq_rel_sys();
            arch::store_volatile_u64(rows as *mut u64, seq);
        }
    }
}

/// Thread 0 of a gated block: waits until the checking block has published the verdict of
/// call `seq` — the calls agree, differ, or the check stopped on an abort — or until
/// `DevComm::aborted` says the communicator stopped; whether the call may go on. Device memory
/// is polled, the host's abort flag only every 65,536th look (a safety net: an abort reaches
/// the verdict through the checking block's gather, which watches the flag as every primitive
/// does).
///
/// # Safety
/// `desc` is the communicator's descriptor.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
unsafe fn await_verdict(comm: &DevComm, desc: *const CheckDesc, seq: u64) -> bool {
    let mut spins = 0u32;
    loop {
        // SAFETY: valid descriptor and flags (caller contract).
        unsafe {
            // The gate orders the block's writes after this load.
            if let Some(go) = verdict(arch::load_volatile_u64(&raw const (*desc).done), seq) {
                return go;
            }
            if spins % 64 == 63 && !same_verdict(comm) {
                return false;
            }
            if spins % 65_536 == 65_535 && stopped(comm) {
                return false;
            }
        }
        spins = spins.wrapping_add(1);
        // Up to a channel's worth of blocks poll one word while the checking block gathers:
        // each pauses between looks, so their reads do not crowd the gather's.
        arch::nanosleep(if spins < 1024 { 32 } else { 256 });
    }
}

/// The verdict of call `seq` in the verdict word `done` ([`CheckDesc::done`]), once given:
/// whether the call may go on. The word's flags say it all: a stop is published after
/// `DevComm::aborted`, and an agreement stays true once found (a mismatch of a call between
/// two kernels, a graph's, rewrites the word before the later kernel starts).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
fn verdict(done: u64, seq: u64) -> Option<bool> {
    let flags = CHECK_HALTED | CHECK_DIFFERENT;
    (done & !flags >= seq).then_some(done & flags == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_word_gives_call_seqs_verdict_only_once_it_reaches_that_call() {
        // Not yet given: the word holds an earlier call's agreement or stop.
        assert_eq!(verdict(0, 7), None);
        assert_eq!(verdict(6, 7), None);
        assert_eq!(verdict(6 | CHECK_DIFFERENT, 7), None);
        assert_eq!(verdict(6 | CHECK_HALTED, 7), None);
        // A graph's mismatch (number 0) before an eager call agreed ahead.
        assert_eq!(verdict(CHECK_DIFFERENT, 7), None);
        // Given for this call, or agreed ahead for the next one.
        assert_eq!(verdict(7, 7), Some(true));
        assert_eq!(verdict(8, 7), Some(true));
        assert_eq!(verdict(7 | CHECK_DIFFERENT, 7), Some(false));
        assert_eq!(verdict(7 | CHECK_HALTED, 7), Some(false));
    }
}
