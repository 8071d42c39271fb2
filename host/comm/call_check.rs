//! The call-signature check (beyond NCCL, opt-in: `OXCCL_CHECK_CALLS=1` or
//! [`CommConfig::check_calls`], the same on every rank): before a collective
//! writes any user buffer, its ranks agree that they issued the same call — function, count, type,
//! operator, root, and the algorithm, protocol and channels they planned, with the call's number
//! among the communicator's checked collectives (count 0 included; the flight recorder numbers
//! only the calls that move data). Ranks whose host programs diverged (called another
//! collective, another count, type, operator or root) otherwise wait for each other forever or
//! return wrong results without an error. A rank that skipped a call is caught at the first
//! later call that differs from its peers'; when every later call is the same, the ranks wait
//! for the missing one, which `OXCCL_TIMEOUT` then names.
//!
//! How: inside the call's own kernel ([`oxccl_gpu::check`]), one block more than the call's
//! channels gathers every rank's 32-byte [`CallSig`] over the first peer channel (which no
//! collective uses) on the LL protocol and compares them, while the call's blocks move its data
//! and wait for the verdict only before their first write to a user buffer; so the check's
//! small AllGather overlaps the call's first hops, adds no kernel, and runs over every
//! transport. Every rank gets the same signatures and the same
//! verdict: on a mismatch each rank's kernels, this call's and every later one's, exit before
//! touching a buffer, and [`Comm::get_async_error`] and every later call return `InvalidUsage`
//! naming each group of ranks with the call it issued and the fields that differ. With the check
//! off the kernels skip it (their argument's `check` is 0). A call of count 0, which NCCL skips,
//! is still checked (by the check kernel alone), so a rank that issued it with count 0 while
//! others did not is caught too. A call captured into a CUDA graph has no number (its graph's
//! launches decide when it runs): at each launch the check kernel compares the rest of its
//! signature first, and the call's own kernel then honours that verdict
//! (`CHECK_VERDICT_ONLY`), so graphs captured in another order on each rank replay alike.
use super::*;
use oxccl_gpu::abi::{CALL_SIG_WORDS, CHECK_KERNEL_NAME, CallSig, CheckArgs, CheckDesc, CheckReport};
use std::sync::OnceLock;

/// Bytes of one signature.
const SIG_BYTES: usize = CALL_SIG_WORDS * 8;

/// Where the check works and reports: its descriptor followed by the gather's board (`nranks`
/// signatures; device memory the kernels only touch) and the host-visible report.
enum Mem {
    Cuda {
        board: cuda::DevAlloc,
        report: cuda::HostMapped,
    },
    Cpu {
        board: HostMem,
        report: HostMem,
    },
}

/// A communicator's call-signature check (present when `OXCCL_CHECK_CALLS=1` and it has more
/// than one rank).
pub(super) struct CallCheck {
    nranks: usize,
    /// Shared with queued CPU-target launches, which may outlive the communicator's drop.
    mem: Arc<Mem>,
    /// Checked calls so far: the next one's sequence number is this + 1.
    seq: AtomicU64,
    /// The mismatch, once the host has seen the report (every later call returns it).
    error: OnceLock<Error>,
}

impl CallCheck {
    /// A rank's check when its settings turn it on and it has peers: its memory and, on GPUs,
    /// its kernel, loaded now (a load while a peer's kernel spins could wait for it; a kernel
    /// that cannot be loaded fails the init rather than the first call, where the peers would
    /// wait for this rank's gather).
    pub(super) fn for_rank(params: &Params, nranks: usize, res: &Res) -> Result<Option<CallCheck>> {
        if !params.check_calls || nranks < 2 {
            return Ok(None);
        }
        let ctx = match res {
            Res::Cuda(r) => {
                r.ctx.kernel(CHECK_KERNEL_NAME)?;
                Some(&r.ctx)
            }
            Res::Cpu(_) => None,
        };
        CallCheck::new(ctx, nranks).map(Some)
    }

    /// The check's memory for a rank of `nranks` on `ctx` (the CPU target when `None`), its
    /// descriptor written.
    fn new(ctx: Option<&Arc<cuda::Context>>, nranks: usize) -> Result<CallCheck> {
        // The board starts a 128-byte line after the descriptor: the blocks waiting on `done`
        // do not poll the line the gather writes.
        let desc = 128;
        const _: () = assert!(size_of::<CheckDesc>() <= 128);
        let board = desc + nranks * SIG_BYTES;
        let report = size_of::<CheckReport>() + nranks * SIG_BYTES;
        let mem = match ctx {
            Some(ctx) => Mem::Cuda {
                board: cuda::DevAlloc::zeroed(ctx, board)?,
                report: cuda::HostMapped::zeroed(ctx, report)?,
            },
            None => Mem::Cpu {
                board: HostMem::zeroed(board)?,
                report: HostMem::zeroed(report)?,
            },
        };
        let (base, report_addr) = match &mem {
            Mem::Cuda { board, report } => (board.ptr(), report.dev_ptr()),
            Mem::Cpu { board, report } => (board.addr(), report.addr()),
        };
        let d = CheckDesc {
            board: base + desc as u64,
            report: report_addr,
            done: 0,
        };
        match &mem {
            Mem::Cuda { board, .. } => board.write(0, bytemuck::bytes_of(&d))?,
            // SAFETY: the allocation holds the descriptor at its start (16-aligned host memory
            // no kernel uses yet).
            Mem::Cpu { board, .. } => unsafe { (board.addr() as *mut CheckDesc).write(d) },
        }
        Ok(CallCheck {
            nranks,
            mem: Arc::new(mem),
            seq: AtomicU64::new(0),
            error: OnceLock::new(),
        })
    }

    /// The descriptor's address as kernels see it ([`KernelArgs::check`]).
    fn desc_addr(&self) -> u64 {
        match &*self.mem {
            Mem::Cuda { board, .. } => board.ptr(),
            Mem::Cpu { board, .. } => board.addr(),
        }
    }

    /// The report as the host reads it.
    fn report_host(&self) -> *const u64 {
        match &*self.mem {
            Mem::Cuda { report, .. } => report.host_ptr() as *const u64,
            Mem::Cpu { report, .. } => report.addr() as *const u64,
        }
    }

    /// Every rank's signature of the call a check found them disagreeing on, once one did.
    fn reported(&self) -> Option<Vec<CallSig>> {
        let p = self.report_host();
        // SAFETY: the report holds a `CheckReport` and `nranks` signatures and lives as long as
        // `self`; the kernel writes the signatures, then (after a fence) the header's `seq`.
        unsafe {
            if AtomicU64::from_ptr(p as *mut u64).load(Ordering::Acquire) == 0 {
                return None;
            }
            let sigs = p.add(size_of::<CheckReport>() / 8);
            Some(
                (0..self.nranks)
                    .map(|r| std::array::from_fn(|k| sigs.add(r * CALL_SIG_WORDS + k).read_volatile()))
                    .collect(),
            )
        }
    }
}

/// What the ranks compare: `func`'s call number `seq` of `count` elements of `dtype` with `op`
/// and `root` (the operator only where `func` reduces, the root only where it has one; NCCL
/// ignores them elsewhere), planned as `choice` (`None`: a call of count 0, planned as nothing).
#[allow(clippy::too_many_arguments)]
pub(super) fn encode(
    seq: u64,
    func: Func,
    count: usize,
    dtype: DataType,
    op: DevRedOp,
    root: usize,
    choice: Option<Choice>,
) -> CallSig {
    let op = if reduces(func) { op as u64 } else { 0 };
    let root = if rooted(func) { root as u64 } else { 0 };
    let (algo, proto, nch) = choice.map_or((0xf, 0xf, 0), |c| {
        (c.algo as u64, c.proto as u64, c.nchannels as u64)
    });
    [
        seq,
        count as u64,
        root << 32 | (func as u64) << 24 | op << 16 | (dtype as u64) << 8 | algo << 4 | proto,
        nch,
    ]
}

fn reduces(func: Func) -> bool {
    matches!(func, Func::AllReduce | Func::Reduce | Func::ReduceScatter)
}

fn rooted(func: Func) -> bool {
    matches!(func, Func::Broadcast | Func::Reduce)
}

/// A signature as the call it describes ("allreduce call #3 (1024 × float, op sum; ring/LL on 2
/// channels)"; number 0: "allreduce call in a CUDA graph (…)"), or its raw words when a field
/// is out of range.
fn describe(sig: &CallSig) -> String {
    let w = sig[2];
    let field = |shift: u32, bits: u32| ((w >> shift) & ((1 << bits) - 1)) as u8;
    let (Some(func), Some(dtype), Some(op)) = (
        Func::from_u8(field(24, 8)),
        DataType::from_u8(field(8, 8)),
        DevRedOp::from_u8(field(16, 8)),
    ) else {
        return format!("an unknown call {sig:x?}");
    };
    let choice = match (Algo::from_u8(field(4, 4)), Proto::from_u8(field(0, 4))) {
        (Some(algo), Some(proto)) => Some(Choice {
            func,
            algo,
            proto,
            nchannels: sig[3] as u32,
            chunk_elems: 0,
            slice_elems: 0,
        }),
        _ => None,
    };
    let call = timeout::CallRecord {
        seq: sig[0],
        func,
        count: sig[1] as usize,
        dtype,
        op,
        root: (w >> 32) as usize,
        choice,
    };
    let text = call.to_string();
    if sig[0] == 0 {
        text.replacen(&format!("{func} call #0"), &format!("{func} call in a CUDA graph"), 1)
    } else {
        text
    }
}

/// The names of the fields in which `a` and `b` differ, in signature order.
fn differing(a: &CallSig, b: &CallSig) -> Vec<&'static str> {
    let field = |s: &CallSig, shift: u32, bits: u32| (s[2] >> shift) & ((1u64 << bits) - 1);
    let mut out = Vec::new();
    let mut note = |differs: bool, name: &'static str| {
        if differs {
            out.push(name);
        }
    };
    note(a[0] != b[0], "sequence number");
    note(field(a, 24, 8) != field(b, 24, 8), "function");
    note(a[1] != b[1], "count");
    note(field(a, 8, 8) != field(b, 8, 8), "type");
    note(field(a, 16, 8) != field(b, 16, 8), "operator");
    note(field(a, 32, 32) != field(b, 32, 32), "root");
    note(field(a, 4, 4) != field(b, 4, 4), "algorithm");
    note(field(a, 0, 4) != field(b, 0, 4), "protocol");
    note(a[3] != b[3], "channels");
    out
}

/// "rank 3", "ranks 0, 2" or "ranks 0-5, 7": ascending ranks with runs shortened.
fn ranks_phrase(ranks: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, hi)) if *hi + 1 == r => *hi = r,
            _ => runs.push((r, r)),
        }
    }
    let list: Vec<String> = runs
        .iter()
        .map(|&(lo, hi)| match hi - lo {
            0 => lo.to_string(),
            1 => format!("{lo}, {hi}"),
            _ => format!("{lo}-{hi}"),
        })
        .collect();
    format!(
        "{} {}",
        if ranks.len() == 1 { "rank" } else { "ranks" },
        list.join(", ")
    )
}

/// The mismatch error's message on rank `me`, from every rank's signature (`sigs`, by rank):
/// each group of ranks that issued one call, in order of its lowest rank, then the fields in
/// which the groups differ from the first. The same on every rank but the leading rank.
pub(super) fn mismatch_message(me: usize, sigs: &[CallSig]) -> String {
    let mut groups: Vec<(CallSig, Vec<usize>)> = Vec::new();
    for (r, s) in sigs.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| g == s) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((*s, vec![r])),
        }
    }
    let calls: Vec<String> = groups
        .iter()
        .map(|(s, ranks)| format!("{} issued {}", ranks_phrase(ranks), describe(s)))
        .collect();
    let mut fields: Vec<&str> = Vec::new();
    for (s, _) in groups.iter().skip(1) {
        for f in differing(&groups[0].0, s) {
            if !fields.contains(&f) {
                fields.push(f);
            }
        }
    }
    format!(
        "rank {me}: the ranks issued different calls (OXCCL_CHECK_CALLS): {}; they differ in {}; \
         no user buffer was written, abort or destroy the communicator",
        calls.join("; "),
        fields.join(", ")
    )
}

impl Comm {
    /// With the check on: this rank's next call numbered and signed, as its kernel's
    /// [`KernelArgs::check`] and [`KernelArgs::sig`] (or, for a call of count 0, the check
    /// kernel's alone, [`Comm::launch_check`]); `None` with the check off. A call `captured`
    /// into a CUDA graph is signed with number 0 and takes no number: its graph's launches run
    /// it in an order the capture does not know, so the ranks compare the call, not when it was
    /// captured (graphs captured in another order on each rank replay alike).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_args(
        &self,
        func: Func,
        count: usize,
        dtype: DataType,
        op: DevRedOp,
        root: usize,
        choice: Option<Choice>,
        captured: bool,
    ) -> Option<CheckArgs> {
        let cc = self.call_check.as_ref()?;
        let seq = if captured { 0 } else { cc.seq.fetch_add(1, Ordering::AcqRel) + 1 };
        Some(CheckArgs {
            comm: self.dev_comm,
            check: cc.desc_addr(),
            sig: encode(seq, func, count, dtype, op, root, choice),
        })
    }

    /// Queues the check `args` alone (a call of count 0): on a GPU as one call of the launch
    /// ordering (`enqueue.rs`); `recorded`: the call's flight-recorder entry, ended with the
    /// check; `captured`: the stream is capturing.
    pub(super) fn launch_check(&self, args: CheckArgs, stream: &Stream, captured: bool, recorded: Option<u64>) -> Result<()> {
        self.launches.fetch_add(1, Ordering::AcqRel);
        match (&self.res, stream) {
            (Res::Cuda(res), Stream::Cuda(s)) => {
                let n = self.launch_cuda(res, s, captured, &[CHECK_KERNEL_NAME], |m| s.launch(&m[0], 1, self.params.nthreads, &args))?;
                if let (Some(id), Some(n)) = (recorded, n) {
                    self.watch.launched(id, n);
                }
                Ok(())
            }
            (Res::Cpu(res), Stream::Cpu(s)) => self.launch_check_cpu(res, s, args, recorded),
            _ => Err(Error::invalid("stream and communicator are of different backends")),
        }
    }

    /// Queues the check `args` alone on the CPU target's stream `s`: one block.
    fn launch_check_cpu(&self, res: &CpuRes, s: &CpuStream, args: CheckArgs, recorded: Option<u64>) -> Result<()> {
        let Some(cc) = &self.call_check else {
            return Err(Error::Internal("a call check without its memory".into()));
        };
        let nthreads = self.params.cpu_nthreads;
        let mem = cc.mem.clone();
        self.cpu_blocks(res, 1, recorded.as_slice()).launch(
            s,
            &self.inflight,
            move |_, tid, smem| {
                let _board_and_report = &mem;
                // SAFETY: the comm block is kept by the launch's `group`, the descriptor, board
                // and report by `mem`; every rank of the communicator queues the check of its
                // call `seq` (the setting is the same on every rank).
                unsafe { oxccl_gpu::check::check_call(args.comm, args.check, &args.sig, false, tid, nthreads, smem) };
                true
            },
            || Ok(()),
        )
    }

    /// The error of a call-signature mismatch once a check reported one (and from then on).
    pub(super) fn call_mismatch(&self) -> Option<Error> {
        let cc = self.call_check.as_ref()?;
        if let Some(e) = cc.error.get() {
            return Some(e.clone());
        }
        let sigs = cc.reported()?;
        let e = cc.error.get_or_init(|| {
            if self.flag_state() == ABORTED_BY_PEER {
                // A peer aborted before this rank read the report: the kernels queued on the
                // peer's stream before its abort still run their checks, and one cut short
                // there can send a later call's signature into a gather still waiting for an
                // earlier one. What looks like diverged calls is the abort's doing.
                let e = self.aborted_by_peer();
                tracing::warn!(
                    target: "oxccl::coll",
                    rank = self.rank,
                    "{e} (the call check's report of different calls, read after the abort, is set aside: {})",
                    mismatch_message(self.rank, &sigs)
                );
                return e;
            }
            let msg = mismatch_message(self.rank, &sigs);
            tracing::error!(target: "oxccl::coll", rank = self.rank, "{msg}");
            if let Some(own) = sigs.get(self.rank) {
                self.watch.call_mismatch(own[0]);
            }
            Error::InvalidUsage(msg)
        });
        Some(e.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(algo: Algo, proto: Proto, nchannels: u32) -> Option<Choice> {
        Some(Choice {
            func: Func::AllReduce,
            algo,
            proto,
            nchannels,
            chunk_elems: 0,
            slice_elems: 0,
        })
    }

    #[test]
    fn signatures_ignore_what_nccl_ignores() {
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        // AllGather reduces nothing and has no root; Broadcast has a root but no operator.
        assert_eq!(
            encode(1, Func::AllGather, 8, DataType::F32, DevRedOp::Sum, 0, ring),
            encode(1, Func::AllGather, 8, DataType::F32, DevRedOp::Max, 3, ring)
        );
        assert_eq!(
            encode(1, Func::Broadcast, 8, DataType::F32, DevRedOp::Sum, 1, ring),
            encode(1, Func::Broadcast, 8, DataType::F32, DevRedOp::Prod, 1, ring)
        );
        assert_ne!(
            encode(1, Func::Broadcast, 8, DataType::F32, DevRedOp::Sum, 1, ring),
            encode(1, Func::Broadcast, 8, DataType::F32, DevRedOp::Sum, 0, ring)
        );
    }

    #[test]
    fn the_message_names_each_group_of_ranks_and_the_fields() {
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        let a = encode(3, Func::AllReduce, 1024, DataType::F32, DevRedOp::Sum, 0, ring);
        let b = encode(3, Func::AllReduce, 1000, DataType::F32, DevRedOp::Sum, 0, ring);
        let msg = mismatch_message(2, &[a, b, a, a]);
        assert_eq!(
            msg,
            "rank 2: the ranks issued different calls (OXCCL_CHECK_CALLS): ranks 0, 2, 3 issued allreduce call #3 \
             (1024 × float, op sum; ring/LL on 2 channels); rank 1 issued allreduce call #3 (1000 × float, op sum; \
             ring/LL on 2 channels); they differ in count; no user buffer was written, abort or destroy the communicator"
        );
        let g = encode(
            3,
            Func::AllGather,
            1024,
            DataType::F32,
            DevRedOp::Sum,
            0,
            choice(Algo::Ring, Proto::Simple, 1),
        );
        let msg = mismatch_message(0, &[a, g]);
        assert!(
            msg.contains("rank 1 issued allgather call #3 (1024 × float; ring/Simple on 1 channel)")
                && msg.ends_with("they differ in function, protocol, channels; no user buffer was written, abort or destroy the communicator"),
            "{msg}"
        );
        // Every rank naming itself Reduce's root; a rank whose call had count 0.
        let roots: Vec<CallSig> = (0..3)
            .map(|r| encode(1, Func::Reduce, 4, DataType::I32, DevRedOp::Max, r, ring))
            .collect();
        let msg = mismatch_message(1, &roots);
        assert!(
            msg.contains("rank 0 issued reduce call #1 (4 × int32, op max, root 0;"),
            "{msg}"
        );
        assert!(msg.contains("they differ in root;"), "{msg}");
        let zero = encode(5, Func::AllReduce, 0, DataType::F32, DevRedOp::Sum, 0, None);
        let msg = mismatch_message(0, &[a, zero]);
        assert!(
            msg.contains("rank 1 issued allreduce call #5 (0 × float, op sum)"),
            "{msg}"
        );
        assert!(
            msg.contains("they differ in sequence number, count, algorithm, protocol, channels"),
            "{msg}"
        );
    }

    #[test]
    fn rank_lists_shorten_runs() {
        assert_eq!(ranks_phrase(&[3]), "rank 3");
        assert_eq!(ranks_phrase(&[0, 2]), "ranks 0, 2");
        assert_eq!(ranks_phrase(&[0, 1, 2, 3, 4, 5, 7]), "ranks 0-5, 7");
        assert_eq!(ranks_phrase(&[0, 1, 4, 5, 6]), "ranks 0, 1, 4-6");
    }
}
