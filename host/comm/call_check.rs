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
//! channels collects every rank's 32-byte [`CallSig`] and compares them, while the call's blocks
//! move its data and wait for the verdict only before their first write to a user buffer; so
//! the check adds no kernel. Ranks of one host write their signature at launch into a slot of
//! every rank's rows ([`RowsMem`], `/dev/shm` memory the kernels read), so a checking block
//! waits for no peer's kernel, and it publishes the next call's
//! agreement ahead when every host has launched it already: a host running ahead of the GPUs,
//! as a busy application's does, has its calls checked before their kernels start. Other ranks
//! gather the signatures on the LL protocol over a channel of the check's own, after the
//! point-to-point channels (no collective, send or receive uses it), over every transport. Every
//! rank gets the same signatures and the same verdict: on a mismatch each rank's kernels, this
//! call's and every later one's, exit before touching a buffer, and [`Comm::get_async_error`] and every later call return `InvalidUsage`
//! naming each group of ranks with the call it issued and the fields that differ. With the check
//! off the kernels skip it (their argument's `check` is 0). A call of count 0, which NCCL skips,
//! is still checked (by the check kernel alone), so a rank that issued it with count 0 while
//! others did not is caught too. A call captured into a CUDA graph has no number (its graph's
//! launches decide when it runs): at each launch the check kernel compares the rest of its
//! signature first, and the call's own kernel then honours that verdict
//! (`CHECK_VERDICT_ONLY`), so graphs captured in another order on each rank replay alike.
use super::*;
use oxccl_gpu::abi::{
    CALL_SIG_WORDS, CHECK_KERNEL_NAME, CHECK_ROW_SLOTS, CallSig, CheckArgs, CheckDesc, CheckReport, check_row_flag,
    check_row_line, check_row_offset, check_rows_bytes,
};
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

/// A rank's signature rows ([`CheckDesc::rows`]): a `/dev/shm` segment (on a GPU registered with
/// the driver, which maps it for the rank's kernels) that the hosts of every rank of the
/// communicator map and write into, in one process or several of one host.
pub(super) enum RowsMem {
    Cuda(crate::transport::shm::RegisteredShm),
    Cpu(crate::cpu::ShmSegment),
}

impl RowsMem {
    /// The rows a rank whose connection memory is `/dev/shm/<conn_name>` offers the other
    /// ranks of `peers` ([`RowsMem::create`]) when its settings turn the check on and every rank
    /// is on its host (NCCL's hostHash: equal host names; every rank decides from the same
    /// list), `None` otherwise (the check gathers); mapped once every rank has offered its own
    /// ([`Rows::map`]).
    pub(super) fn offer(
        params: &Params,
        ctx: Option<&Arc<cuda::Context>>,
        conn_name: &str,
        peers: &[crate::transport::PeerInfo],
    ) -> Result<Option<RowsMem>> {
        if !params.check_calls || peers.len() < 2 || !peers.iter().all(|p| p.host == peers[0].host) {
            return Ok(None);
        }
        RowsMem::create(ctx, &rows_name(conn_name), peers.len()).map(Some)
    }

    /// Creates rank rows `/dev/shm/<name>` for a communicator of `nranks` on `ctx` (the CPU
    /// target when `None`), zeroed: no slot holds a call's flag, the header says no call was
    /// checked. Errors: a `/dev/shm` without the room (`System`, naming the bytes and the path).
    fn create(ctx: Option<&Arc<cuda::Context>>, name: &str, nranks: usize) -> Result<RowsMem> {
        let bytes = check_rows_bytes(nranks as u64) as usize;
        Ok(match ctx {
            Some(ctx) => RowsMem::Cuda(crate::transport::shm::RegisteredShm::create_with(ctx, name, bytes, &[], 0)?),
            None => RowsMem::Cpu(crate::cpu::ShmSegment::create(name, crate::transport::shm::page_round(bytes))?),
        })
    }

    fn seg(&self) -> &crate::cpu::ShmSegment {
        match self {
            RowsMem::Cuda(m) => &m.seg,
            RowsMem::Cpu(m) => m,
        }
    }

    /// Removes the name (once every rank has mapped the rows).
    fn unlink(&self) -> Result<()> {
        self.seg().unlink()
    }

    /// The address the rank's kernels read ([`CheckDesc::rows`]).
    fn dev(&self) -> u64 {
        match self {
            RowsMem::Cuda(m) => m.dev_base(),
            RowsMem::Cpu(m) => m.addr(),
        }
    }
}

/// The rows a rank's host writes into: its own and every peer's, by rank (`crate::cpu::
/// ShmSegment::open` of the names `rows_name` gives), all of them in one host's `/dev/shm`.
pub(super) struct Rows {
    own: RowsMem,
    /// Every rank's rows' host address, by rank.
    hosts: Vec<usize>,
    /// The peers' rows mapped here (kept for `hosts`).
    _peers: Vec<crate::cpu::ShmSegment>,
    /// By rank: the last call that rank's kernels were found to have checked (its rows'
    /// header, read by [`Comm::await_row_slot`]). The GPU rewrites a header at every checked
    /// call, so a host read of it misses the cache: a writer reads it again only once a slot
    /// past what it last found is needed.
    checked: Vec<AtomicU64>,
}

impl Rows {
    /// Every rank's rows, this rank `rank` offering `own` (`None`: the check gathers), the ranks
    /// `peers`. Errors: as [`Rows::map`].
    pub(super) fn for_peers(own: Option<RowsMem>, rank: usize, peers: &[crate::transport::PeerInfo]) -> Result<Option<Rows>> {
        let Some(own) = own else {
            return Ok(None);
        };
        let names: Vec<String> = peers.iter().map(|p| rows_name(&p.shm_name)).collect();
        Rows::map(own, rank, &names).map(Some)
    }

    /// `own` (this rank's `rank`) with every peer's rows mapped: `names[p]` is rank `p`'s
    /// segment, `nranks` ranks. Errors: `InvalidUsage` for a peer's segment that cannot be
    /// mapped (a host name shared by ranks that do not share `/dev/shm`).
    fn map(own: RowsMem, rank: usize, names: &[String]) -> Result<Rows> {
        let bytes = crate::transport::shm::page_round(check_rows_bytes(names.len() as u64) as usize);
        let mut peers = Vec::new();
        let mut hosts = Vec::with_capacity(names.len());
        for (p, name) in names.iter().enumerate() {
            if p == rank {
                hosts.push(own.seg().addr() as usize);
            } else {
                let seg = crate::cpu::ShmSegment::open(name, bytes).map_err(|e| {
                    Error::InvalidUsage(format!(
                        "rank {rank}: rank {p}'s call check rows cannot be mapped ({e}): the ranks \
                         of one host (equal host names) must share its /dev/shm"
                    ))
                })?;
                hosts.push(seg.addr() as usize);
                peers.push(seg);
            }
        }
        let checked = (0..names.len()).map(|_| AtomicU64::new(0)).collect();
        Ok(Rows { own, hosts, _peers: peers, checked })
    }

    /// Removes this rank's name (once every rank has mapped the rows).
    pub(super) fn unlink(&self) -> Result<()> {
        self.own.unlink()
    }
}

/// A communicator's call check memory held by a queued CPU-target launch ([`CallCheck::held`]),
/// which may outlive the communicator's drop.
pub(super) struct CheckHeld {
    _mem: Arc<Mem>,
    _rows: Option<Arc<Rows>>,
}

/// The name of the rows of the rank whose connection memory's `/dev/shm` name is `conn_name`.
pub(super) fn rows_name(conn_name: &str) -> String {
    format!("{conn_name}-check")
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
    /// The rows of every rank when the ranks share one host (`None`: the check gathers); shared,
    /// as `mem` is, with queued CPU-target launches ([`CallCheck::held`]).
    rows: Option<Arc<Rows>>,
}

impl CallCheck {
    /// A rank's check when its settings turn it on and it has peers: its memory and, on GPUs,
    /// its kernel, loaded now (a load while a peer's kernel spins could wait for it; a kernel
    /// that cannot be loaded fails the init rather than the first call, where the peers would
    /// wait for this rank's gather).
    /// `rows`: every rank's rows when the ranks share one host ([`Rows::map`]), `None` to
    /// gather the signatures over LL FIFOs; `channel`: the check's own channel, which the
    /// gather runs over ([`super::PeerChannels::check_channel`]).
    pub(super) fn for_rank(
        params: &Params,
        nranks: usize,
        res: &Res,
        rows: Option<Rows>,
        channel: Option<u32>,
    ) -> Result<Option<CallCheck>> {
        if !params.check_calls || nranks < 2 {
            return Ok(None);
        }
        let Some(channel) = channel else {
            return Err(Error::Internal("a call check without its channel".into()));
        };
        let ctx = match res {
            Res::Cuda(r) => {
                r.ctx.kernel(CHECK_KERNEL_NAME)?;
                Some(&r.ctx)
            }
            Res::Cpu(_) => None,
        };
        CallCheck::new(ctx, nranks, rows.map(Arc::new), channel).map(Some)
    }

    /// The check's memory for a rank of `nranks` on `ctx` (the CPU target when `None`), its
    /// descriptor written; `rows`: every rank's rows, if the ranks share a host; `channel`: the
    /// channel its gather runs over.
    fn new(
        ctx: Option<&Arc<cuda::Context>>,
        nranks: usize,
        rows: Option<Arc<Rows>>,
        channel: u32,
    ) -> Result<CallCheck> {
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
            rows: rows.as_ref().map_or(0, |r| r.own.dev()),
            channel: channel as u64,
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
            rows,
        })
    }

    /// The descriptor, board, report and rows, held for a queued launch that uses them.
    pub(super) fn held(&self) -> CheckHeld {
        CheckHeld {
            _mem: self.mem.clone(),
            _rows: self.rows.clone(),
        }
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
pub(super) fn ranks_phrase(ranks: &[usize]) -> String {
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

/// The mismatch error's message on rank `me` (as [`super::rank_of`] names it), from every
/// rank's signature (`sigs`, by rank): each group of ranks that issued one call, in order of its
/// lowest rank, then the fields in which the groups differ from the first. The same on every
/// rank but the leading rank.
pub(super) fn mismatch_message(me: &str, sigs: &[CallSig]) -> String {
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
        "{me}: the ranks issued different calls (OXCCL_CHECK_CALLS): {}; they differ in {}; \
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
    ) -> Result<Option<CheckArgs>> {
        let Some(cc) = self.call_check.as_ref() else {
            return Ok(None);
        };
        let seq = if captured { 0 } else { cc.seq.fetch_add(1, Ordering::AcqRel) + 1 };
        let sig = encode(seq, func, count, dtype, op, root, choice);
        if seq != 0 {
            self.write_rows(cc, &sig)?;
        }
        Ok(Some(CheckArgs {
            comm: self.dev_comm,
            check: cc.desc_addr(),
            sig,
        }))
    }

    /// With rows: this rank's signature `sig` of call `sig[0]` (≥ 1) written into its
    /// slot in every rank's rows ([`CheckDesc::rows`]; its own too, where its kernels look ahead
    /// at it), so that no rank's checking block waits for this rank's kernel. A slot is reused
    /// [`CHECK_ROW_SLOTS`] calls later: first this waits until that rank's kernels have checked
    /// the call that used it last ([`Comm::await_row_slot`]). Nothing to do when the check
    /// gathers.
    fn write_rows(&self, cc: &CallCheck, sig: &CallSig) -> Result<()> {
        let Some(rows) = &cc.rows else {
            return Ok(());
        };
        let seq = sig[0];
        let flag = check_row_flag(seq);
        // Every slot free before any is written: a rank never holds a part of a call's
        // signatures. A call numbered but never launched would shift this rank's later calls
        // against its peers' kernels, which the rows cannot see: the communicator stops.
        for (reader, (&base, checked)) in rows.hosts.iter().zip(&rows.checked).enumerate() {
            if let Err(e) = self.await_row_slot(reader, base, checked, seq) {
                return Err(self.stop_checking(seq, e));
            }
        }
        for &base in &rows.hosts {
            let slot = base + check_row_offset(self.rank as u64, seq) as usize;
            for (k, &word) in sig.iter().enumerate() {
                for (h, half) in check_row_line(word, flag).into_iter().enumerate() {
                    // SAFETY: the slot lies inside one rank's rows (`check_rows_bytes`), which
                    // `rows` keeps mapped; each half is one aligned `u64`, stored whole for the
                    // kernel that polls it.
                    unsafe { AtomicU64::from_ptr((slot + 16 * k + 8 * h) as *mut u64).store(half, Ordering::Release) };
                }
            }
        }
        Ok(())
    }

    /// After checked call `seq` was numbered but could not be launched (`e`, returned): every
    /// later call of this rank returns `InvalidUsage` saying so (through
    /// [`Comm::call_mismatch`], as after a mismatch), since its numbers no longer pair with its
    /// peers' kernels; its peers' kernels of call `seq` wait for it until their timeout.
    pub(super) fn stop_checking(&self, seq: u64, e: Error) -> Error {
        if let Some(cc) = self.call_check.as_ref() {
            let stop = Error::InvalidUsage(format!(
                "{}: checked call #{seq} was numbered by the call check but not launched ({e}); \
                 the communicator's later calls cannot be checked against its peers': abort or \
                 destroy it",
                super::rank_of(self.rank, self.comm_id())
            ));
            tracing::error!(target: "oxccl::coll", rank = self.rank, "{stop}");
            let _ = cc.error.get_or_init(|| stop);
        }
        e
    }

    /// Waits until rank `reader`'s kernels (its rows at host address `base`) have checked call
    /// `seq − CHECK_ROW_SLOTS`, the last to use this rank's slot of call `seq` there (the rows'
    /// header: `look_ahead` in `oxccl_gpu::check`). `checked` is the last header value found
    /// ([`Rows::checked`]): the header is read only when that falls short. Only a host more than
    /// [`CHECK_ROW_SLOTS`] checked calls ahead of that rank's GPU waits, as it would for a full
    /// launch queue. Errors: this communicator aborted (the abort's error), or no progress for
    /// the call timeout (`NCCL_TIMEOUT`; 600 s when timeouts are off): `Timeout` naming the rank
    /// and the calls.
    fn await_row_slot(&self, reader: usize, base: usize, checked: &AtomicU64, seq: u64) -> Result<()> {
        if seq <= CHECK_ROW_SLOTS {
            return Ok(());
        }
        let need = seq - CHECK_ROW_SLOTS;
        // Acquire: what the read that found it ordered before this rank's slot writes.
        if checked.load(Ordering::Acquire) >= need {
            return Ok(());
        }
        // SAFETY: the header is the rows' first word (see `write_rows`).
        let header = unsafe { AtomicU64::from_ptr(base as *mut u64) };
        let limit = self.params.timeout.unwrap_or(std::time::Duration::from_secs(600));
        let mut seen = header.load(Ordering::Acquire);
        let mut since = std::time::Instant::now();
        let mut spins = 0u32;
        while seen < need {
            if let Some(e) = self.stopped_error() {
                return Err(e);
            }
            if since.elapsed() > limit {
                return Err(Error::Timeout(format!(
                    "{}: call check: launching checked call {seq} needs rank {reader}'s kernels to have \
                     checked call {need}, and they stayed at call {seen} for {limit:?}",
                    super::rank_of(self.rank, self.comm_id())
                )));
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
            let now = header.load(Ordering::Acquire);
            if now != seen {
                seen = now;
                since = std::time::Instant::now();
            }
        }
        checked.fetch_max(seen, Ordering::AcqRel);
        Ok(())
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
        let held = cc.held();
        self.cpu_blocks(res, 1, recorded.as_slice()).launch(
            s,
            &self.inflight,
            move |_, tid, smem| {
                let _check_memory = &held;
                // SAFETY: the comm block is kept by the launch's `group`, the descriptor, board,
                // report and rows by `held`; every rank of the communicator queues the check of
                // its call `seq` (the setting is the same on every rank).
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
                    mismatch_message(&super::rank_of(self.rank, self.comm_id()), &sigs)
                );
                return e;
            }
            let msg = mismatch_message(&super::rank_of(self.rank, self.comm_id()), &sigs);
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

    /// `n` CPU ranks of one process (one host) with the check on (and `timeout`, if any).
    fn checked_group(n: usize, timeout: Option<std::time::Duration>) -> Vec<Comm> {
        let mut config = CommConfig::default().with_check_calls(true);
        if let Some(t) = timeout {
            config = config.with_timeout(t);
        }
        Comm::init_all_config(&crate::mem::Device::cpus(n), &config).expect("CPU ranks")
    }

    /// A checked AllReduce of 8 floats by `c`, as a launch numbers and signs it.
    fn launch(c: &Comm) -> Result<Option<CheckArgs>> {
        c.check_args(Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, choice(Algo::Ring, Proto::Ll, 2), false)
    }

    /// Two checked ranks (with `timeout`, if any) whose rank 0 launched calls 1 ..=
    /// [`CHECK_ROW_SLOTS`]: its next call reuses call 1's slots.
    fn every_slot_used(timeout: Option<std::time::Duration>) -> Vec<Comm> {
        let comms = checked_group(2, timeout);
        for _ in 0..CHECK_ROW_SLOTS {
            launch(&comms[0]).expect("a free slot at every rank");
        }
        comms
    }

    /// Rank `reader`'s rows as rank 0's host sees them.
    fn rows_of(comms: &[Comm], reader: usize) -> usize {
        comms[0].call_check.as_ref().expect("the check is on").rows.as_ref().expect("rows").hosts[reader]
    }

    /// Writer `writer`'s signature in `reader`'s slot of call `seq`, if that slot holds the
    /// call's flag.
    fn read_slot(comms: &[Comm], reader: usize, writer: usize, seq: u64) -> Option<CallSig> {
        let at = rows_of(comms, reader) + check_row_offset(writer as u64, seq) as usize;
        let flag = check_row_flag(seq) as u64;
        let mut sig = [0u64; CALL_SIG_WORDS];
        for (k, w) in sig.iter_mut().enumerate() {
            // SAFETY: the slot lies inside the rows, which the group keeps; no kernel runs.
            let (a, b) = unsafe { (((at + 16 * k) as *const u64).read_volatile(), ((at + 16 * k + 8) as *const u64).read_volatile()) };
            if a >> 32 != flag || b >> 32 != flag {
                return None;
            }
            *w = (a & 0xffff_ffff) | (b & 0xffff_ffff) << 32;
        }
        Some(sig)
    }

    /// Stores `seq` in `reader`'s rows' header, as its kernels do once they checked that call.
    fn mark_checked(comms: &[Comm], reader: usize, seq: u64) {
        // SAFETY: the header is the rows' first word, kept by the group.
        unsafe { AtomicU64::from_ptr(rows_of(comms, reader) as *mut u64).store(seq, Ordering::Release) };
    }

    /// Ranks of one host: each rank's launch writes its signature into its slot of the call in
    /// every rank's rows, its own included, with the call's flag; a later call of the same slot
    /// index replaces it with the next flag.
    #[test]
    fn a_launch_writes_its_signature_into_every_ranks_rows() {
        let comms = checked_group(3, None);
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        let args: Vec<CheckArgs> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                c.check_args(Func::AllReduce, 100 + r, DataType::F32, DevRedOp::Sum, 0, ring, false)
                    .expect("no wait for call 1")
                    .expect("the check is on")
            })
            .collect();
        for (w, a) in args.iter().enumerate() {
            assert_eq!(a.sig[0], 1, "rank {w}'s first checked call is number 1");
            assert_eq!(a.sig, encode(1, Func::AllReduce, 100 + w, DataType::F32, DevRedOp::Sum, 0, ring));
            for reader in 0..3 {
                assert_eq!(read_slot(&comms, reader, w, 1), Some(a.sig), "rank {w}'s signature at rank {reader}");
                assert_eq!(read_slot(&comms, reader, w, 2), None, "no call 2 yet");
            }
        }
        // A captured call takes no number and writes nothing.
        let g = comms[1].check_args(Func::AllReduce, 1, DataType::F32, DevRedOp::Sum, 0, ring, true).unwrap().unwrap();
        assert_eq!(g.sig[0], 0);
        assert_eq!(read_slot(&comms, 0, 1, 2), None);
        // Calls 2 ..= CHECK_ROW_SLOTS + 1 of rank 1, its readers having checked call 1: the last
        // reuses call 1's slot with the next flag.
        for reader in 0..3 {
            mark_checked(&comms, reader, 1);
        }
        for _ in 2..=CHECK_ROW_SLOTS + 1 {
            comms[1].check_args(Func::AllGather, 7, DataType::F32, DevRedOp::Sum, 0, ring, false).unwrap();
        }
        let last = encode(CHECK_ROW_SLOTS + 1, Func::AllGather, 7, DataType::F32, DevRedOp::Sum, 0, ring);
        assert_eq!(read_slot(&comms, 2, 1, CHECK_ROW_SLOTS + 1), Some(last));
        assert_eq!(read_slot(&comms, 2, 1, 1), None, "call 1's flag is gone from the reused slot");
        assert_eq!(read_slot(&comms, 2, 0, 1), Some(args[0].sig), "rank 0's slot is untouched");
    }

    /// A host [`CHECK_ROW_SLOTS`] calls ahead of a rank's kernels waits for them before it
    /// reuses a slot, and goes on once they checked the call that last used it.
    #[test]
    fn a_host_too_far_ahead_waits_for_the_readers() {
        let comms = every_slot_used(None);
        // Call CHECK_ROW_SLOTS + 1 needs both ranks' kernels to have checked call 1.
        mark_checked(&comms, 1, 1);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let marker = s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(50));
                done.store(true, Ordering::Release);
                mark_checked(&comms, 0, 1);
            });
            let a = launch(&comms[0]);
            assert!(done.load(Ordering::Acquire), "the launch waited for rank 0's header");
            assert_eq!(a.expect("rank 0's kernels caught up").expect("on").sig[0], CHECK_ROW_SLOTS + 1);
            marker.join().unwrap();
        });
        assert!(comms[0].call_mismatch().is_none());
    }

    /// A writer reads a reader's rows' header only for a slot past the last call it found that
    /// reader's kernels had checked: with the header found at call 500, calls up to
    /// 500 + CHECK_ROW_SLOTS launch without reading it (here a header set back to 0 would make
    /// them wait), and the next one reads it again.
    #[test]
    fn a_writer_reads_a_readers_header_again_only_past_the_call_it_last_found_checked() {
        let comms = every_slot_used(Some(std::time::Duration::from_millis(200)));
        mark_checked(&comms, 0, 500);
        mark_checked(&comms, 1, 500);
        assert_eq!(launch(&comms[0]).expect("call 1025 needs call 1").expect("on").sig[0], CHECK_ROW_SLOTS + 1);
        mark_checked(&comms, 0, 0);
        mark_checked(&comms, 1, 0);
        for seq in CHECK_ROW_SLOTS + 2..=CHECK_ROW_SLOTS + 500 {
            assert_eq!(launch(&comms[0]).expect("found free at call 500: no wait").expect("on").sig[0], seq);
        }
        let e = launch(&comms[0]).expect_err("call 1525 needs call 501: the header is read again");
        assert_eq!(e.code(), crate::error::ResultCode::Timeout);
        assert!(e.to_string().contains("needs rank 0's kernels to have checked call 501"), "{e}");
    }

    /// A host whose readers make no progress for the call timeout fails that launch with
    /// `Timeout` naming the rank and both calls, having written no rank's slot, and stops the
    /// check: its later calls return `InvalidUsage` naming the call that took a number.
    #[test]
    fn a_host_too_far_ahead_of_a_stalled_rank_times_out_and_stops_checking() {
        let comms = every_slot_used(Some(std::time::Duration::from_millis(300)));
        // Rank 0's own kernels checked call 1, rank 1's did not: rank 0's slot is free, rank
        // 1's is not.
        mark_checked(&comms, 0, 1);
        let start = std::time::Instant::now();
        let e = launch(&comms[0]).expect_err("rank 1's kernels never checked call 1");
        assert!(start.elapsed() >= std::time::Duration::from_millis(300));
        assert_eq!(e.code(), crate::error::ResultCode::Timeout);
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("launching checked call {} needs rank 1's kernels to have checked call 1", CHECK_ROW_SLOTS + 1))
                && msg.contains("stayed at call 0"),
            "{msg}"
        );
        let seq = CHECK_ROW_SLOTS + 1;
        assert_eq!(read_slot(&comms, 0, 0, seq), None, "no slot written: not even the free one");
        let stop = comms[0].call_mismatch().expect("the check stopped").to_string();
        assert!(
            stop.starts_with(&format!(
                "invalid usage: rank 0 of communicator {:08x}: checked call #{seq} was numbered by the call check but not \
                 launched (timeout: ",
                comms[0].comm_id()
            ))
                && stop.ends_with("abort or destroy it"),
            "{stop}"
        );
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
        let msg = mismatch_message("rank 2", &[a, b, a, a]);
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
        let msg = mismatch_message("rank 0", &[a, g]);
        assert!(
            msg.contains("rank 1 issued allgather call #3 (1024 × float; ring/Simple on 1 channel)")
                && msg.ends_with("they differ in function, protocol, channels; no user buffer was written, abort or destroy the communicator"),
            "{msg}"
        );
        // Every rank naming itself Reduce's root; a rank whose call had count 0.
        let roots: Vec<CallSig> = (0..3)
            .map(|r| encode(1, Func::Reduce, 4, DataType::I32, DevRedOp::Max, r, ring))
            .collect();
        let msg = mismatch_message("rank 1", &roots);
        assert!(
            msg.contains("rank 0 issued reduce call #1 (4 × int32, op max, root 0;"),
            "{msg}"
        );
        assert!(msg.contains("they differ in root;"), "{msg}");
        let zero = encode(5, Func::AllReduce, 0, DataType::F32, DevRedOp::Sum, 0, None);
        let msg = mismatch_message("rank 0", &[a, zero]);
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
