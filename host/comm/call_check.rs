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
//! every rank's rows ([`RowsMem`], `/dev/shm` memory the kernels read). A host that finds there
//! every rank's signature of the call and of every call before it, all equal, launches the
//! call's kernel without the check ([`Comm::agreed_on_host`]): hosts that launch their calls
//! together, ahead of their GPUs, as a busy application's do, have them checked at no GPU time.
//! A group's end signs every call it holds before it launches any
//! ([`Comm::presign_collective`]), so one thread ending a group of every rank's calls has them
//! all found agreed.
//! Otherwise the checking block reads the signatures there, so it waits for no peer's kernel,
//! and it publishes the next call's agreement ahead when every host has launched it already.
//! Other ranks
//! gather the signatures over the first peer channel (which no collective uses) on the LL
//! protocol, over every transport. Every rank gets the same signatures and the same
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
use oxccl_gpu::abi::{
    CALL_SIG_WORDS, CHECK_AGREED, CHECK_KERNEL_NAME, CHECK_ROW_SLOTS, CHECK_ROWS_CHECKED, CHECK_ROWS_HOST_WORD, CallSig, CheckArgs, CheckDesc, CheckReport, check_row_flag,
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
    /// By rank: the last call whose slots this rank's host found free in that rank's rows
    /// ([`Rows::slot_free`]).
    free: Vec<AtomicU64>,
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
        let free = (0..names.len()).map(|_| AtomicU64::new(0)).collect();
        Ok(Rows {
            own,
            hosts,
            _peers: peers,
            free,
        })
    }

    /// Removes this rank's name (once every rank has mapped the rows).
    pub(super) fn unlink(&self) -> Result<()> {
        self.own.unlink()
    }

    /// [`row_slot_free`] of call `need` in rank `reader`'s rows, from the last call whose slots
    /// were found free there; the words it read, or `need` twice when that call's slots were
    /// known free.
    fn slot_free(&self, reader: usize, need: u64) -> (bool, u64, u64) {
        let known = self.free[reader].load(Ordering::Acquire);
        if need <= known {
            return (true, need, need);
        }
        let found = row_slot_free(self.hosts[reader], need, known);
        if found.0 {
            self.free[reader].fetch_max(need, Ordering::AcqRel);
        }
        found
    }
}

/// A communicator's call check memory held by a queued CPU-target launch ([`CallCheck::held`]),
/// which may outlive the communicator's drop.
pub(super) struct CheckHeld {
    _mem: Arc<Mem>,
    _rows: Option<Arc<Rows>>,
}

/// Whether every rank's signature of call `seq` (≥ 1) is in the rows at host address `base` of
/// a communicator of `nranks`, all equal (`Some(true)`), some differ (`Some(false)`), or some
/// rank's is not in yet (`None`).
fn slots_agree(base: usize, nranks: usize, seq: u64) -> Option<bool> {
    let flag = check_row_flag(seq);
    let mut first = None;
    let mut same = true;
    for writer in 0..nranks {
        let slot = base + check_row_offset(writer as u64, seq) as usize;
        let mut sig = [0u64; CALL_SIG_WORDS];
        for (k, word) in sig.iter_mut().enumerate() {
            // SAFETY: the slot lies inside the rows (`check_rows_bytes`), which the caller keeps
            // mapped; each half is one aligned `u64`, stored whole by its writer (`write_rows`).
            let [lo, hi] = unsafe {
                [0, 8].map(|h| AtomicU64::from_ptr((slot + 16 * k + h) as *mut u64).load(Ordering::Acquire))
            };
            if (lo >> 32) as u32 != flag || (hi >> 32) as u32 != flag {
                return None;
            }
            *word = (lo & 0xffff_ffff) | (hi & 0xffff_ffff) << 32;
        }
        same &= *first.get_or_insert(sig) == sig;
    }
    Some(same)
}

/// The entry for call `seq` of the table, in the rows at host address `base`, of the calls their
/// host launched with their kernel's check ([`CHECK_ROWS_CHECKED`]).
///
/// # Safety
/// `base` is a rows block ([`check_rows_bytes`]) that stays mapped while the entry is used.
unsafe fn checked_entry<'a>(base: usize, seq: u64) -> &'a AtomicU64 {
    // SAFETY: the table's `CHECK_ROW_SLOTS` aligned words lie in the rows' header (caller
    // contract).
    unsafe { AtomicU64::from_ptr((base + CHECK_ROWS_CHECKED + 8 * (seq % CHECK_ROW_SLOTS) as usize) as *mut u64) }
}

/// What the header of the rows at host address `base` says of their slots of call `need` (≥ 1):
/// whether no kernel of their rank reads them again, so that a writer may reuse them for call
/// `need + CHECK_ROW_SLOTS`; and the last call the rank's host launched and the last its kernels
/// checked. Its kernels read the slots of a call their host launched with the check
/// (`read_rows` in `oxccl_gpu::check`); its host's reads ([`slots_agree`]) and the kernels'
/// look at the next call's slots (`look_ahead`) check each word's flag, so a slot reused reads
/// as not yet written. The slots are free once the host launched `need` and none of the calls
/// after the last its kernels checked, up to `need`, was launched with the check. Only the last
/// [`CHECK_ROW_SLOTS`] calls up to `need` are looked at: the host launched call
/// `c + CHECK_ROW_SLOTS` only once its own slots of `c` were free, and a table entry that holds a
/// later number than its call says the same. Nor are those up to `known`, a call whose slots were
/// found free before: slots once free stay free, and so do every earlier call's (a call is
/// entered in the table before its host word says it was launched), so a writer that keeps what
/// it found looks at about one entry per call ([`Rows::slot_free`]).
fn row_slot_free(base: usize, need: u64, known: u64) -> (bool, u64, u64) {
    // SAFETY: the header's words lie at the start of the rows, which the caller keeps mapped.
    let (kernels, host) = unsafe {
        (AtomicU64::from_ptr(base as *mut u64), AtomicU64::from_ptr((base + CHECK_ROWS_HOST_WORD) as *mut u64))
    };
    // The host word first: the table's entries of the calls up to it are stored before it.
    let launched = host.load(Ordering::Acquire);
    let checked = kernels.load(Ordering::Acquire);
    let free = launched >= need
        && (checked >= need
            || (checked.max(known).max(need.saturating_sub(CHECK_ROW_SLOTS)) + 1..=need)
                // SAFETY: the table lies in the rows' header, which the caller keeps mapped.
                .all(|c| unsafe { checked_entry(base, c) }.load(Ordering::Acquire) != c));
    (free, launched, checked)
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
    /// What this rank's host found agreed in its rows ([`Comm::agreed_on_host`]).
    agreement: Mutex<HostAgreement>,
    /// A checked call was captured into a graph: its mismatch shows only on the GPU, at a
    /// launch of the graph the host does not see, so from then on every numbered call runs its
    /// kernel's check (the host finds none agreed).
    captured: std::sync::atomic::AtomicBool,
    /// Calls numbered and signed ahead of their launch, in order ([`Comm::presign_collective`]):
    /// their launch takes the number and the signature instead of numbering the call.
    presigned: Mutex<std::collections::VecDeque<CallSig>>,
}

/// How long a host that launches a call before some peer's host did waits for that peer's
/// signature, to find the call agreed and launch its kernel unchecked
/// ([`Comm::agreed_on_host`]); the ranks of a busy application launch each call within
/// microseconds of each other, far ahead of their GPUs. On a GPU the host waits only while its
/// GPU still holds two of its launches or more ([`LaunchState::busy`]), so the wait never leaves
/// the GPU idle, and up to [`AGREE_WAIT_BUSY`].
const AGREE_WAIT: Duration = Duration::from_micros(50);
/// The longest wait for a late peer's signature of a host whose GPU is busy ([`AGREE_WAIT`]).
const AGREE_WAIT_BUSY: Duration = Duration::from_micros(200);
/// Launches for which a host whose wait for a late peer timed out does not wait again, doubled
/// after each further wait that times out up to [`AGREE_WAIT_PAUSE_MAX`], and back to this after
/// a wait that finds the peer's signature: a peer always late (as when one thread launches every
/// rank's calls in turn) costs its leader one wait in thousands of calls.
const AGREE_WAIT_PAUSE: u32 = 64;
/// The longest pause between two waits for a late peer ([`AGREE_WAIT_PAUSE`]).
const AGREE_WAIT_PAUSE_MAX: u32 = 4096;

/// What a rank's host found of its calls in its rows (one host).
#[derive(Default)]
struct HostAgreement {
    /// Every call up to this number has every rank's signature in the rows, all equal.
    agreed: u64,
    /// Calls this host launched, and of those the ones it found agreed (launched unchecked).
    launched: u64,
    found: u64,
    /// Launches left before this host waits for a late peer again, and the pause after its next
    /// wait that times out (0: [`AGREE_WAIT_PAUSE`]).
    no_wait: u32,
    pause: u32,
}

impl CallCheck {
    /// A rank's check when its settings turn it on and it has peers: its memory and, on GPUs,
    /// its kernel, loaded now (a load while a peer's kernel spins could wait for it; a kernel
    /// that cannot be loaded fails the init rather than the first call, where the peers would
    /// wait for this rank's gather).
    /// `rows`: every rank's rows when the ranks share one host ([`Rows::map`]), `None` to
    /// gather the signatures over LL FIFOs.
    pub(super) fn for_rank(params: &Params, nranks: usize, res: &Res, rows: Option<Rows>) -> Result<Option<CallCheck>> {
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
        CallCheck::new(ctx, nranks, rows.map(Arc::new)).map(Some)
    }

    /// The check's memory for a rank of `nranks` on `ctx` (the CPU target when `None`), its
    /// descriptor written; `rows`: every rank's rows, if the ranks share a host.
    fn new(ctx: Option<&Arc<cuda::Context>>, nranks: usize, rows: Option<Arc<Rows>>) -> Result<CallCheck> {
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
            agreement: Mutex::new(HostAgreement::default()),
            captured: std::sync::atomic::AtomicBool::new(false),
            presigned: Mutex::new(std::collections::VecDeque::new()),
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
    /// kernel's alone, [`Comm::launch_check`]); `None` with the check off. `check` holds
    /// [`CHECK_AGREED`] when this rank's host found the call, and every call before it, agreed
    /// by every rank ([`Comm::agreed_on_host`]): its kernel then checks nothing
    /// ([`oxccl_gpu::abi::agreed_launch_check`]), and a call of count 0 launches nothing. A call `captured`
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
        if captured {
            cc.captured.store(true, Ordering::Release);
        }
        let ahead = if captured { None } else { cc.presigned.lock().ok().and_then(|mut q| q.pop_front()) };
        let sig = match ahead {
            Some(sig) => {
                let now = encode(sig[0], func, count, dtype, op, root, choice);
                if now != sig {
                    return Err(self.stop_checking(
                        sig[0],
                        Error::Internal(format!(
                            "rank {}: the call launched as checked call #{} ({}) is not the call signed for it ({})",
                            self.rank,
                            sig[0],
                            describe(&now),
                            describe(&sig)
                        )),
                    ));
                }
                sig
            }
            None => {
                let seq = if captured { 0 } else { cc.seq.fetch_add(1, Ordering::AcqRel) + 1 };
                let sig = encode(seq, func, count, dtype, op, root, choice);
                if seq != 0 {
                    self.write_rows(cc, &sig)?;
                }
                sig
            }
        };
        let mut check = cc.desc_addr();
        if sig[0] != 0 {
            if self.agreed_on_host(cc, &sig) {
                check |= CHECK_AGREED;
            }
        }
        Ok(Some(CheckArgs {
            comm: self.dev_comm,
            check,
            sig,
        }))
    }

    /// For a group's end (`group/collectives.rs`): with the check on and the ranks' rows shared,
    /// numbers this rank's next collective (`func` on `count` elements of `dtype` with `op` and
    /// `root`, on `stream`, as [`Comm::collective_raw`] takes it) and writes its signature into
    /// every rank's rows now, before the group launches any of its calls; the call's launch takes
    /// that number ([`Comm::check_args`]). So when one thread ends a group holding every rank's
    /// calls, each rank's host finds its peers' signatures in its rows at its launch, and the
    /// calls run without their kernels' check, as those of ranks launched from threads or
    /// processes of their own do. Returns whether the call was signed: `false` (nothing done)
    /// with the check off or gathering, for a call the launch will refuse or that a capture takes
    /// (it has no number), and where a slot of the call is still in use
    /// ([`row_slot_free`]; signing never waits). The caller stops signing a rank's calls at the
    /// first `false`, so numbers keep the calls' order. Nothing is queued, nor any buffer read.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn presign_collective(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: &crate::redop::ReduceOp<'_>,
        root: usize,
        stream: &Stream,
    ) -> bool {
        let Some(cc) = self.call_check.as_ref() else {
            return false;
        };
        let Some(rows) = &cc.rows else {
            return false;
        };
        let Ok((dev_op, _, _, recv_bytes, captured)) =
            self.checked_call(func, send, recv, count, dtype, op, root, stream, collectives::Capture::Now)
        else {
            return false;
        };
        if captured || cc.error.get().is_some() {
            return false;
        }
        let choice = if count == 0 {
            None
        } else {
            let esize = dtype.size() as u64;
            match self.plan(func, self.call_bytes(func, count, recv_bytes, esize), esize) {
                Ok(c) => Some(c),
                Err(_) => return false,
            }
        };
        let Ok(mut ahead) = cc.presigned.lock() else {
            return false;
        };
        let seq = cc.seq.load(Ordering::Acquire) + 1;
        if seq > CHECK_ROW_SLOTS && !(0..cc.nranks).all(|reader| rows.slot_free(reader, seq - CHECK_ROW_SLOTS).0) {
            return false;
        }
        cc.seq.store(seq, Ordering::Release);
        let sig = encode(seq, func, count, dtype, dev_op, root, choice);
        // The slots are free (above): this returns at once.
        if let Err(e) = self.write_rows(cc, &sig) {
            self.stop_checking(seq, e);
            return false;
        }
        ahead.push_back(sig);
        true
    }

    /// After a group's launches: calls signed ahead ([`Comm::presign_collective`]) that were
    /// never launched (their launch failed before it reached the check) hold numbers this rank's
    /// later calls cannot take, so the check stops, as after a numbered call that was not
    /// launched ([`Comm::stop_checking`]).
    pub(crate) fn drop_presigned(&self) {
        let Some(cc) = self.call_check.as_ref() else {
            return;
        };
        let left = cc.presigned.lock().ok().and_then(|mut q| {
            let first = q.front().map(|s| s[0]);
            q.clear();
            first
        });
        if let Some(seq) = left {
            self.stop_checking(seq, Error::Internal(format!("rank {}: checked call #{seq} was signed at its group's end but not launched", self.rank)));
        }
    }

    /// With rows, once this rank wrote its signature `sig` of call `seq` (`sig[0]`, ≥ 1):
    /// whether every rank's signature of every call up to `seq` is in this rank's rows, all
    /// equal. Then no GPU needs to check the call: its kernel runs unchecked, so a host ahead of
    /// its GPU, as a busy application's is, gives its calls the check at no GPU time. A peer
    /// whose signature of `seq` is not in yet is waited for up to [`AGREE_WAIT`] (on a GPU only
    /// while it is busy, up to [`AGREE_WAIT_BUSY`]; not again for [`AGREE_WAIT_PAUSE`] launches
    /// or more after a wait that timed out). Otherwise the call's kernel
    /// checks it as before, and so does every later call's once a call differs (the host never
    /// finds one agreed past it), so a mismatch still stops every rank's kernels of that call and
    /// of every later one before they write a user buffer. Also tells the writers which of this
    /// rank's slots its kernels read: a call launched with the check goes into the rows' table
    /// ([`CHECK_ROWS_CHECKED`]) before the host word says it was launched ([`row_slot_free`]).
    fn agreed_on_host(&self, cc: &CallCheck, sig: &CallSig) -> bool {
        let Some(rows) = &cc.rows else {
            return false;
        };
        let Ok(mut a) = cc.agreement.lock() else {
            return false;
        };
        let seq = sig[0];
        let own = rows.hosts[self.rank];
        let found = !cc.captured.load(Ordering::Acquire) && {
            // The calls whose kernels check them, or that were not all in at their launch.
            while a.agreed + 1 < seq && slots_agree(own, cc.nranks, a.agreed + 1) == Some(true) {
                a.agreed += 1;
            }
            a.agreed + 1 == seq && {
                let mut now = slots_agree(own, cc.nranks, seq);
                // On a GPU: whether waiting now leaves the GPU with work (a wait that would not
                // is skipped, and does not lengthen the pause), and for how long.
                let busy = || match &self.res {
                    Res::Cuda(r) => r.launch.busy(),
                    Res::Cpu(_) => true,
                };
                let limit = match &self.res {
                    Res::Cuda(_) => AGREE_WAIT_BUSY,
                    Res::Cpu(_) => AGREE_WAIT,
                };
                if now.is_none() && a.no_wait == 0 && busy() {
                    let start = Instant::now();
                    while now.is_none() && start.elapsed() < limit && busy() {
                        std::hint::spin_loop();
                        now = slots_agree(own, cc.nranks, seq);
                    }
                    if now.is_none() {
                        a.no_wait = a.pause.max(AGREE_WAIT_PAUSE);
                        a.pause = (a.no_wait * 2).min(AGREE_WAIT_PAUSE_MAX);
                    } else {
                        a.pause = AGREE_WAIT_PAUSE;
                    }
                } else {
                    a.no_wait = a.no_wait.saturating_sub(1);
                }
                now == Some(true)
            }
        };
        a.launched += 1;
        if found {
            a.agreed = seq;
            a.found += 1;
        } else {
            // SAFETY: the table lies in the rows' header, kept mapped by `rows`.
            unsafe { checked_entry(own, seq) }.store(seq, Ordering::Release);
        }
        // SAFETY: the host word lies in the rows' header, kept mapped by `rows`. A rank's calls
        // are launched one at a time (as NCCL's), so `seq` only grows here.
        unsafe { AtomicU64::from_ptr((own + CHECK_ROWS_HOST_WORD) as *mut u64) }.fetch_max(seq, Ordering::AcqRel);
        found
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
        for reader in 0..rows.hosts.len() {
            if let Err(e) = self.await_row_slot(rows, reader, seq) {
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
                "rank {}: checked call #{seq} was numbered by the call check but not launched ({e}); \
                 the communicator's later calls cannot be checked against its peers': abort or \
                 destroy it",
                self.rank
            ));
            tracing::error!(target: "oxccl::coll", rank = self.rank, "{stop}");
            let _ = cc.error.get_or_init(|| stop);
        }
        e
    }

    /// Waits until no kernel of rank `reader` (its rows in `rows`) reads its slots
    /// of call `seq − CHECK_ROW_SLOTS` again, the last to use this rank's slot of call `seq`
    /// there ([`row_slot_free`]): that rank's host launched that call, and its kernels checked
    /// every call up to it that it launched with the check. Only a host more than
    /// [`CHECK_ROW_SLOTS`] calls ahead of that rank's host, or of its GPU's checks, waits, as it
    /// would for a full launch queue. Errors: this communicator aborted (the abort's error), or no
    /// progress for the call timeout (`NCCL_TIMEOUT`; 600 s when timeouts are off): `Timeout`
    /// naming the rank and the calls.
    fn await_row_slot(&self, rows: &Rows, reader: usize, seq: u64) -> Result<()> {
        if seq <= CHECK_ROW_SLOTS {
            return Ok(());
        }
        let need = seq - CHECK_ROW_SLOTS;
        let limit = self.params.timeout.unwrap_or(std::time::Duration::from_secs(600));
        let (mut free, mut launched, mut checked) = rows.slot_free(reader, need);
        let mut since = std::time::Instant::now();
        let mut spins = 0u32;
        while !free {
            if let Some(e) = self.stopped_error() {
                return Err(e);
            }
            if since.elapsed() > limit {
                return Err(Error::Timeout(format!(
                    "rank {}: call check: launching checked call {seq} needs rank {reader}'s host to have \
                     launched call {need} and its kernels to have checked the calls it launched checked up to \
                     it; they stayed at calls {launched} and {checked} for {limit:?}",
                    self.rank
                )));
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
            let now = rows.slot_free(reader, need);
            if (now.1, now.2) != (launched, checked) {
                since = std::time::Instant::now();
            }
            (free, launched, checked) = now;
        }
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

    /// With the call-signature check on and the ranks on one host (their signatures in shared
    /// rows): how many numbered calls this rank's host has launched, and how many of those it
    /// found agreed by every rank before their launch, so that their kernels ran without the
    /// check. `None` with the check off, or when the check gathers the signatures on the GPUs
    /// (ranks on several hosts), where every call's kernel checks it.
    pub fn calls_found_agreed(&self) -> Option<(u64, u64)> {
        let cc = self.call_check.as_ref()?;
        cc.rows.as_ref()?;
        let a = cc.agreement.lock().ok()?;
        Some((a.launched, a.found))
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

    /// `n` CPU ranks of one process (one host) with the check on (and `timeout`, if any).
    fn checked_group(n: usize, timeout: Option<std::time::Duration>) -> Vec<Comm> {
        let mut config = CommConfig::default().with_check_calls(true);
        if let Some(t) = timeout {
            config = config.with_timeout(t);
        }
        Comm::init_all_config(&crate::mem::Device::cpus(n), &config).expect("CPU ranks")
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

    /// Stores `seq` in `reader`'s rows' header, as its kernels do once they checked that call
    /// (and as its host did when it launched the call).
    fn mark_checked(comms: &[Comm], reader: usize, seq: u64) {
        let base = rows_of(comms, reader);
        // SAFETY: the header's words lie at the start of the rows, kept by the group.
        unsafe {
            AtomicU64::from_ptr((base + CHECK_ROWS_HOST_WORD) as *mut u64).fetch_max(seq, Ordering::AcqRel);
            AtomicU64::from_ptr(base as *mut u64).store(seq, Ordering::Release);
        }
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

    /// Rank `r`'s host word of its rows' header ([`CHECK_ROWS_HOST_WORD`]).
    fn host_word(comms: &[Comm], r: usize) -> u64 {
        // SAFETY: the word lies in the rows' header, kept by the group.
        unsafe { AtomicU64::from_ptr((rows_of(comms, r) + CHECK_ROWS_HOST_WORD) as *mut u64).load(Ordering::Acquire) }
    }

    /// Whether rank `r`'s host launched call `seq` with its kernel's check, by the rows' table
    /// ([`CHECK_ROWS_CHECKED`]).
    fn launched_checked(comms: &[Comm], r: usize, seq: u64) -> bool {
        // SAFETY: the table lies in the rows' header, kept by the group.
        unsafe { checked_entry(rows_of(comms, r), seq) }.load(Ordering::Acquire) == seq
    }

    /// Ranks of one host: a call whose signatures the launching host finds in its rows from
    /// every rank, all equal, with every call before it, is marked agreed ([`CHECK_AGREED`]);
    /// a call a peer has not launched yet, or one that differs, is checked by its kernel and
    /// goes into the rows' table, and so is every call after one that differs; a call of a
    /// communicator that captured a checked call into a graph too. The host word says which
    /// call the host launched last.
    #[test]
    fn a_call_every_rank_launched_alike_runs_unchecked() {
        let comms = checked_group(2, None);
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        let launch = |r: usize, count: usize| {
            comms[r].check_args(Func::AllReduce, count, DataType::F32, DevRedOp::Sum, 0, ring, false).unwrap().unwrap()
        };
        let desc = |r: usize| comms[r].call_check.as_ref().unwrap().desc_addr();
        // Call 1: rank 0 launches first and waits for rank 1's signature in vain (nothing else
        // runs), so its kernel checks the call; rank 1 then finds the call agreed.
        let start = Instant::now();
        assert_eq!(launch(0, 8).check, desc(0), "rank 1's signature is not in yet");
        assert!(start.elapsed() >= AGREE_WAIT, "rank 0 waited for rank 1's signature");
        let one = launch(1, 8);
        assert_eq!((one.check, one.sig[0]), (desc(1) | CHECK_AGREED, 1), "rank 1's kernel of call 1 checks nothing");
        assert_eq!((host_word(&comms, 0), host_word(&comms, 1)), (1, 1), "both hosts launched call 1");
        assert!(launched_checked(&comms, 0, 1) && !launched_checked(&comms, 1, 1));
        assert!(!row_slot_free(rows_of(&comms, 0), 1, 0).0, "rank 0's kernel still reads call 1's slots");
        assert_eq!(row_slot_free(rows_of(&comms, 1), 1, 0), (true, 1, 0), "no kernel of rank 1 reads them");
        // Call 2 differs (count 8 against 9): both kernels check it, rank 0's without a wait.
        let start = Instant::now();
        assert_eq!(launch(0, 8).check, desc(0));
        assert!(start.elapsed() < AGREE_WAIT, "no wait again right after one timed out");
        assert_eq!(launch(1, 9).check, desc(1), "the ranks' calls 2 differ");
        assert!(launched_checked(&comms, 0, 2) && launched_checked(&comms, 1, 2));
        // Rank 0's kernels checked call 1: its slots of call 1 are free, those of call 2 not.
        mark_checked(&comms, 0, 1);
        assert_eq!(row_slot_free(rows_of(&comms, 0), 1, 0), (true, 2, 1));
        assert!(!row_slot_free(rows_of(&comms, 0), 2, 0).0);
        // Call 3 is alike, but after a call that differs every call is checked by its kernel.
        assert_eq!(launch(1, 8).check, desc(1));
        assert_eq!(launch(0, 8).check, desc(0));
        assert!(launched_checked(&comms, 0, 3) && launched_checked(&comms, 1, 3));
        assert_eq!((host_word(&comms, 0), host_word(&comms, 1)), (3, 3));
        assert_eq!((comms[0].calls_found_agreed(), comms[1].calls_found_agreed()), (Some((3, 0)), Some((3, 1))));

        // A count of 0 found agreed launches nothing; after a captured call, none is found agreed.
        let comms = checked_group(2, None);
        let desc = |r: usize| comms[r].call_check.as_ref().unwrap().desc_addr();
        let zero = |r: usize| comms[r].check_args(Func::Broadcast, 0, DataType::F32, DevRedOp::Sum, 1, None, false).unwrap().unwrap();
        assert_eq!(zero(0).check, desc(0));
        assert_eq!(zero(1).check, desc(1) | CHECK_AGREED, "rank 1's call 1 of count 0 found agreed");
        for c in &comms {
            c.check_args(Func::AllReduce, 4, DataType::F32, DevRedOp::Sum, 0, ring, true).unwrap();
        }
        assert_eq!(zero(0).check, desc(0));
        assert_eq!(zero(1).check, desc(1), "a graph's mismatch shows only on the GPU");
    }

    /// A call launched in place of the call signed ahead for it ([`Comm::presign_collective`])
    /// is refused naming both, and the check stops (its numbers no longer pair with the
    /// peers'); a call signed ahead but never launched stops it too.
    #[test]
    fn a_launch_that_is_not_the_call_signed_ahead_stops_the_check() {
        let comms = checked_group(2, None);
        let ring = choice(Algo::Ring, Proto::Ll, 1);
        let signed = encode(1, Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring);
        let cc = comms[0].call_check.as_ref().unwrap();
        cc.presigned.lock().unwrap().push_back(signed);
        cc.seq.store(1, Ordering::Release);
        let e = comms[0].check_args(Func::AllReduce, 9, DataType::F32, DevRedOp::Sum, 0, ring, false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "internal error: rank 0: the call launched as checked call #1 (allreduce call #1 (9 × float, op sum; ring/LL on \
             1 channel)) is not the call signed for it (allreduce call #1 (8 × float, op sum; ring/LL on 1 channel))"
        );
        let later = comms[0].call_mismatch().expect("the check stopped");
        assert!(later.to_string().contains("checked call #1 was numbered by the call check but not launched"), "{later}");

        let cc = comms[1].call_check.as_ref().unwrap();
        cc.presigned.lock().unwrap().push_back(encode(1, Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring));
        assert!(comms[1].call_mismatch().is_none());
        comms[1].drop_presigned();
        assert!(cc.presigned.lock().unwrap().is_empty());
        let later = comms[1].call_mismatch().expect("the check stopped");
        assert!(later.to_string().contains("signed at its group's end but not launched"), "{later}");
    }

    /// A host whose peer is always late waits for it less and less often: after each wait that
    /// times out it launches twice as many calls without one (from [`AGREE_WAIT_PAUSE`] up to
    /// [`AGREE_WAIT_PAUSE_MAX`]).
    #[test]
    fn a_host_waits_for_an_always_late_peer_ever_more_rarely() {
        let comms = checked_group(2, None);
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        let launch = |r: usize| comms[r].check_args(Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring, false).unwrap();
        let state = || {
            let a = comms[0].call_check.as_ref().unwrap().agreement.lock().unwrap();
            (a.no_wait, a.pause)
        };
        // Rank 0 launches each call before rank 1 (their kernels keep up): its waits come at
        // calls 1, 66, 195, ... and their pauses double.
        let mut waits = Vec::new();
        for seq in 1..=5000u64 {
            let before = state().0;
            launch(0);
            if before == 0 {
                waits.push((seq, state()));
            }
            launch(1);
            mark_checked(&comms, 0, seq);
            mark_checked(&comms, 1, seq);
        }
        let expect: Vec<(u64, (u32, u32))> = [(1, 64), (66, 128), (195, 256), (452, 512), (965, 1024), (1990, 2048), (4039, 4096)]
            .into_iter()
            .map(|(seq, pause)| (seq, (pause, (2 * pause).min(AGREE_WAIT_PAUSE_MAX))))
            .collect();
        assert_eq!(waits, expect);
    }

    /// A host [`CHECK_ROW_SLOTS`] calls ahead of a rank's kernels waits for them before it
    /// reuses a slot, and goes on once they checked the call that last used it.
    #[test]
    fn a_host_too_far_ahead_waits_for_the_readers() {
        let comms = checked_group(2, None);
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        for _ in 0..CHECK_ROW_SLOTS {
            comms[0].check_args(Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring, false).expect("a free slot");
        }
        // Call CHECK_ROW_SLOTS + 1 needs both ranks' kernels to have checked call 1.
        mark_checked(&comms, 1, 1);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let marker = s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(50));
                done.store(true, Ordering::Release);
                mark_checked(&comms, 0, 1);
            });
            let a = comms[0].check_args(Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring, false);
            assert!(done.load(Ordering::Acquire), "the launch waited for rank 0's header");
            assert_eq!(a.expect("rank 0's kernels caught up").expect("on").sig[0], CHECK_ROW_SLOTS + 1);
            marker.join().unwrap();
        });
        assert!(comms[0].call_mismatch().is_none());
    }

    /// A rank whose host found calls agreed frees their slots without launching again: once its
    /// kernels checked the last call it launched with the check, a peer far ahead reuses the
    /// slots of every call it launched, though that host launches nothing more (as on a GPU
    /// shared by the ranks, where it waits for the peer's next launch). Slots of a call it has
    /// not launched stay taken.
    #[test]
    fn slots_of_calls_found_agreed_are_free_once_the_kernels_checked_the_calls_before() {
        let comms = checked_group(2, Some(std::time::Duration::from_millis(300)));
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        let launch = |r: usize| comms[r].check_args(Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring, false);
        let desc = |r: usize| comms[r].call_check.as_ref().unwrap().desc_addr();
        // Call 1: rank 0 launches first, so its kernel checks the call. Calls 2 ..=
        // CHECK_ROW_SLOTS: rank 1 launches first, and rank 0 finds each agreed.
        assert_eq!(launch(0).unwrap().unwrap().check, desc(0));
        launch(1).unwrap();
        for seq in 2..=CHECK_ROW_SLOTS {
            launch(1).unwrap();
            let a = launch(0).unwrap().unwrap();
            assert_eq!((a.sig[0], a.check), (seq, desc(0) | CHECK_AGREED));
        }
        // Rank 1's kernels checked its calls; rank 0's GPU checks call 1 after its host's last
        // launch. Until then rank 0's slots of call 1 stay taken.
        mark_checked(&comms, 1, CHECK_ROW_SLOTS);
        assert!(!row_slot_free(rows_of(&comms, 0), 1, 0).0);
        mark_checked(&comms, 0, 1);
        let start = Instant::now();
        for seq in CHECK_ROW_SLOTS + 1..=2 * CHECK_ROW_SLOTS {
            assert_eq!(launch(1).expect("a free slot at rank 0").expect("on").sig[0], seq);
        }
        assert!(start.elapsed() < std::time::Duration::from_millis(300), "no launch waited for its timeout");
        // Rank 1's host keeps what it found: the last call whose slots are free in rank 0's rows,
        // so it does not look at the table's entries of the calls up to it again.
        let rows = comms[1].call_check.as_ref().unwrap().rows.clone().unwrap();
        assert_eq!(rows.free[0].load(Ordering::Acquire), CHECK_ROW_SLOTS);
        // SAFETY: the table lies in rank 0's rows, which the group keeps; no kernel runs.
        unsafe { checked_entry(rows_of(&comms, 0), 2) }.store(2, Ordering::Release);
        assert!(!row_slot_free(rows_of(&comms, 0), 2, 1).0, "an entry of call 2 looked at says it is read");
        assert!(row_slot_free(rows_of(&comms, 0), 2, 2).0, "but not once call 2's slots were found free");
        assert!(rows.slot_free(0, 2).0);
        // Rank 0's host never launched call CHECK_ROW_SLOTS + 1.
        let e = launch(1).expect_err("rank 0's slots of its next call are not free");
        assert_eq!(e.code(), crate::error::ResultCode::Timeout);
        let need = CHECK_ROW_SLOTS + 1;
        assert!(
            e.to_string().contains(&format!(
                "needs rank 0's host to have launched call {need} and its kernels to have checked the calls it \
                 launched checked up to it; they stayed at calls {CHECK_ROW_SLOTS} and 1 for 300ms"
            )),
            "{e}"
        );
    }

    /// A host whose readers make no progress for the call timeout fails that launch with
    /// `Timeout` naming the rank and both calls, having written no rank's slot, and stops the
    /// check: its later calls return `InvalidUsage` naming the call that took a number.
    #[test]
    fn a_host_too_far_ahead_of_a_stalled_rank_times_out_and_stops_checking() {
        let comms = checked_group(2, Some(std::time::Duration::from_millis(300)));
        let ring = choice(Algo::Ring, Proto::Ll, 2);
        let launch = |c: &Comm| c.check_args(Func::AllReduce, 8, DataType::F32, DevRedOp::Sum, 0, ring, false);
        for _ in 0..CHECK_ROW_SLOTS {
            launch(&comms[0]).expect("a free slot at every rank");
        }
        // Rank 0's own kernels checked call 1, rank 1's did not: rank 0's slot is free, rank
        // 1's is not.
        mark_checked(&comms, 0, 1);
        let start = std::time::Instant::now();
        let e = launch(&comms[0]).expect_err("rank 1's kernels never checked call 1");
        assert!(start.elapsed() >= std::time::Duration::from_millis(300));
        assert_eq!(e.code(), crate::error::ResultCode::Timeout);
        let msg = e.to_string();
        assert!(
            msg.contains(&format!(
                "launching checked call {} needs rank 1's host to have launched call 1 and its kernels to have checked",
                CHECK_ROW_SLOTS + 1
            )) && msg.contains("they stayed at calls 0 and 0 for 300ms"),
            "{msg}"
        );
        let seq = CHECK_ROW_SLOTS + 1;
        assert_eq!(read_slot(&comms, 0, 0, seq), None, "no slot written: not even the free one");
        let stop = comms[0].call_mismatch().expect("the check stopped").to_string();
        assert!(
            stop.starts_with(&format!("invalid usage: rank 0: checked call #{seq} was numbered by the call check but not launched (timeout: "))
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
