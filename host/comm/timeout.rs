//! Call timeouts (beyond NCCL, whose 2.30 `ncclTimeout` result this returns): a rank whose
//! collective makes no progress for `OXCCL_TIMEOUT` seconds ([`Params::timeout`], default
//! [`crate::params::DEFAULT_TIMEOUT`], 10 minutes; `0`: never) stops waiting — its kernels exit as on an abort — and reports `Timeout`
//! from [`Comm::get_async_error`] and from every later call, naming the call and who it waits for.
//!
//! Progress is read where the kernels already publish it, at no cost to them: the step counters
//! of this rank's connections (the heads its ring and tree neighbours advance when they free a
//! slot, the tails they advance when they fill one, the pointer-exchange slots), sampled by one
//! watch thread per process while a call of the communicator is queued or running. A call whose
//! counters did not change for the limit has timed out. So does a call queued behind other work
//! on its stream that long (a stream blocked by another kernel for the whole limit).
//!
//! Who it waits for: every rank records how many calls it has issued in the host's shared abort
//! page (a line of its own, away from the abort flags the kernels poll), so a rank that times out names the ranks of its host that have not issued
//! the call (the usual cause: a rank skipped a call or stopped); otherwise it names the channel,
//! the steps reached and the ring neighbours the channel exchanges data and credits with.
use super::*;
use std::collections::VecDeque;
use std::sync::Weak;

/// Abort-flag value of a rank whose call timed out (its kernels exit as on an abort).
pub(super) const TIMED_OUT: u32 = 3;

/// One call of a communicator as the watch describes it.
#[derive(Clone, Debug)]
pub(super) struct CallRecord {
    /// 1 for the communicator's first call.
    pub(super) seq: u64,
    pub(super) func: Func,
    pub(super) count: usize,
    pub(super) dtype: DataType,
    pub(super) op: DevRedOp,
    pub(super) root: usize,
    pub(super) choice: Option<Choice>,
}

#[cfg(test)]
impl CallRecord {
    /// An AllReduce of `count` floats (sum, no plan), call number `seq`: what unit tests record.
    pub(super) fn all_reduce_f32(seq: u64, count: usize) -> CallRecord {
        CallRecord {
            seq,
            func: Func::AllReduce,
            count,
            dtype: DataType::F32,
            op: DevRedOp::Sum,
            root: 0,
            choice: None,
        }
    }
}

impl std::fmt::Display for CallRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} call #{} ({} × {}", self.func, self.seq, self.count, self.dtype)?;
        if matches!(self.func, Func::Reduce | Func::ReduceScatter | Func::AllReduce) {
            write!(f, ", op {}", self.op.name())?;
        }
        if matches!(self.func, Func::Broadcast | Func::Reduce) {
            write!(f, ", root {}", self.root)?;
        }
        if let Some(c) = &self.choice {
            let s = if c.nchannels == 1 { "" } else { "s" };
            write!(f, "; {}/{} on {} channel{s}", c.algo.name(), c.proto.name(), c.nchannels)?;
        }
        write!(f, ")")
    }
}

impl State {
    /// A live watch's state with nothing watched yet, its flight recorder keeping `recorder_size`
    /// calls.
    fn new(recorder_size: usize) -> State {
        State {
            alive: true,
            pending: VecDeque::new(),
            sample: Vec::new(),
            last_change: Instant::now(),
            last_sample: None,
            error: None,
            error_channels: 0,
            recorder: flight_recorder::Recorder::new(recorder_size),
            reader: Reader(None),
        }
    }

    /// Watches launch `id` (`what`) from now: its progress counts from its queuing.
    fn watch(&mut self, id: u64, what: Watched) {
        if self.pending.len() == MAX_PENDING {
            self.pending.pop_back();
        }
        self.pending.push_back(Pending { id, launch: id, what });
        self.last_change = Instant::now();
        self.last_sample = None;
    }

    /// Launches `ids` were not queued ([`Watch::queued`]).
    fn not_launched(&mut self, ids: &[u64]) {
        self.pending.retain(|p| !ids.contains(&p.id));
        let now = flight_recorder::unix_ns();
        for &id in ids {
            self.recorder.ended(id, now, flight_recorder::Outcome::NotLaunched);
        }
    }

    /// Launch `id` ended, so did every launch before it.
    fn launches_ended(&mut self, id: u64) {
        while self.pending.front().is_some_and(|p| p.id <= id) {
            self.pending.pop_front();
        }
    }
}

/// Memory holding step counters, as this rank's kernels address it.
pub(super) struct Region {
    pub(super) addr: u64,
    pub(super) bytes: usize,
}

/// What queued or running work of the rank looks like.
pub(super) enum Busy {
    Cuda(Arc<LaunchState>, Arc<cuda::Context>),
    /// The rank's queued or running operations, and how many of them are launches of captured
    /// graphs: those are not watched (as on GPUs, where their launches have no event).
    Cpu(Arc<AtomicUsize>, Arc<AtomicUsize>),
}

/// A ring channel's counters inside the sampled bytes: its send connection's head (credits from
/// `next`) and its receive connection's tail (data from `prev`).
pub(super) struct RingCounters {
    pub(super) channel: usize,
    pub(super) head_at: usize,
    pub(super) tail_at: usize,
    pub(super) next: usize,
    pub(super) prev: usize,
}

/// What a [`Watch`] is made of (see [`Watch::new`]).
pub(super) struct WatchSetup {
    pub(super) rank: usize,
    pub(super) nranks: usize,
    /// The communicator's id in dumps and their file names.
    pub(super) comm: u64,
    pub(super) limit: Option<Duration>,
    pub(super) busy: Busy,
    pub(super) regions: Vec<Region>,
    pub(super) ring: Vec<RingCounters>,
    pub(super) flag: u64,
    pub(super) issued: Vec<(usize, u64)>,
    /// Calls the flight recorder keeps, and where it dumps them on a timeout.
    pub(super) recorder_size: usize,
    pub(super) dump_prefix: Option<String>,
}

/// The watch over one communicator: registered with the process's watch thread, retired by the
/// communicator's drop before its memory goes.
pub(super) struct Watch {
    rank: usize,
    nranks: usize,
    comm: u64,
    dump_prefix: Option<String>,
    /// `None`: timeouts off (the watch still records calls and counts them).
    limit: Option<Duration>,
    busy: Busy,
    regions: Vec<Region>,
    ring: Vec<RingCounters>,
    /// Addresses in the host's shared abort page: this rank's flag, and each rank of the host's
    /// issued-calls counter (rank, address).
    flag: u64,
    issued: Vec<(usize, u64)>,
    state: Mutex<State>,
    /// CUDA: the watched launch (a recorded collective, or a point-to-point launch) of each
    /// launch event slot (launch `n` in slot `n % LAUNCH_EVENTS`) as `(entry id, n)`
    /// ([`Watch::launched`]). A call's end is the
    /// completion of its launch's event, which the launch records behind every kernel anyway
    /// ([`super::enqueue::LaunchState::record`]): no event of its own per call (recording one
    /// behind every kernel cost each call about 2 µs on the GPU, docs/benchmarks.md).
    launches: Mutex<Vec<Option<(u64, u64)>>>,
    /// The process's SIGUSR1 count this watch has dumped for ([`flight_recorder::signals`]):
    /// from its creation, so a signal taken before asks it for nothing.
    signals_seen: AtomicU64,
}

/// The stream a CUDA watch reads its counters on, made on first use and kept.
struct Reader(Option<cuda::Stream>);

/// A watched launch not seen ended yet.
struct Pending {
    /// Its number among the flight recorder's entries ([`flight_recorder::Recorder::reserve`]
    /// for a point-to-point launch).
    id: u64,
    /// The number of the first call of its launch (its own, unless calls of a group were
    /// launched together: [`Watch::queued`]).
    launch: u64,
    what: Watched,
}

/// What a watched launch runs.
enum Watched {
    Coll(CallRecord),
    /// A point-to-point launch: its sends and receives and their peers.
    P2p(String),
}

/// The oldest watched launch not seen ended ([`Watch::stuck`]).
struct Stuck<'a> {
    /// Its calls in issue order: several collectives when a group's were launched together.
    calls: Vec<&'a Watched>,
    /// The first of its collectives that ranks of this host have not issued, and those ranks
    /// ("rank R has issued N calls").
    behind: Option<(&'a CallRecord, Vec<String>)>,
}

impl Stuck<'_> {
    /// The channels its step counters speak of: the most any of its collectives runs on (at
    /// least 1); none for sends and receives, which run on channels of their own.
    fn channels(&self) -> usize {
        self.calls
            .iter()
            .map(|w| match w {
                Watched::Coll(c) => c.choice.map_or(1, |c| c.nchannels as usize).max(1),
                Watched::P2p(_) => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// Most watched launches kept waiting to be seen ended. Past it the newest takes the place of
/// the one before it: the oldest (a stuck one) and the newest are always kept.
const MAX_PENDING: usize = 4096;

struct State {
    /// False once the communicator is dropped: nothing is read any more.
    alive: bool,
    /// The watched launches queued or running, oldest first: a timeout names the first, which
    /// the others wait behind (a rank's kernels run in the order issued).
    pending: VecDeque<Pending>,
    sample: Vec<u8>,
    last_change: Instant,
    last_sample: Option<Instant>,
    /// The timeout's message, once one happened.
    error: Option<String>,
    /// How many ring channels' counters speak of the launch the timeout named
    /// ([`Watch::progress_channels`] then).
    error_channels: usize,
    recorder: flight_recorder::Recorder,
    reader: Reader,
}

impl Watch {
    /// A watch over rank `rank`'s calls with `limit` (polled by the process's watch thread unless
    /// `None`); `regions` hold its connections' counters (kernel addresses: device memory or
    /// device-mapped host memory on CUDA, host memory on the CPU target), `ring` where channels'
    /// counters lie in their concatenation, `flag` its abort flag and `issued` the issued-call
    /// counters of its host's ranks.
    ///
    /// # Safety
    /// Every address stays valid until [`Watch::retire`] returns.
    pub(super) unsafe fn new(s: WatchSetup) -> Arc<Watch> {
        let limit = s.limit;
        let w = Arc::new(Watch {
            rank: s.rank,
            nranks: s.nranks,
            comm: s.comm,
            dump_prefix: s.dump_prefix,
            limit,
            busy: s.busy,
            regions: s.regions,
            ring: s.ring,
            flag: s.flag,
            issued: s.issued,
            state: Mutex::new(State::new(s.recorder_size)),
            launches: Mutex::new(vec![None; super::enqueue::LAUNCH_EVENTS]),
            signals_seen: AtomicU64::new(flight_recorder::signals()),
        });
        if limit.is_some() || w.dump_prefix.is_some() {
            if w.dump_prefix.is_some() {
                flight_recorder::dump_on_signal();
            }
            register(&w);
        }
        w
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the flight recorder's dump to `<prefix>.<comm>.<rank>.json` when a dump prefix is
    /// set (on a timeout, or on `SIGUSR1`); errors are logged.
    fn write_dump(&self, st: &State) {
        let Some(prefix) = &self.dump_prefix else { return };
        let path = format!("{prefix}.{:08x}.{}.json", self.comm, self.rank);
        match std::fs::write(&path, self.dump_of(st).to_string()) {
            Ok(()) => tracing::warn!(target: "oxccl::timeout", rank = self.rank, "flight recorder dumped to {path}"),
            Err(e) => tracing::warn!(target: "oxccl::timeout", rank = self.rank, "writing the flight recorder dump {path}: {e}"),
        }
    }

    /// Stops reading the communicator's memory (its drop calls this first).
    pub(super) fn retire(&self) {
        self.state().alive = false;
    }

    /// Records the call about to be launched and counts it in this rank's issued-calls counter;
    /// returns its flight-recorder entry's number, by which its kernel's start and end are
    /// marked ([`Watch::started`], [`Watch::ended`], [`Watch::launched`]).
    pub(super) fn begin(&self, call: CallRecord) -> u64 {
        self.record(call, true)
    }

    /// [`Watch::begin`] for a call captured into a CUDA graph: recorded and counted, ended at
    /// once as [`flight_recorder::Outcome::Captured`], and not the call a timeout names (its
    /// kernel runs at the graph's launches).
    pub(super) fn captured(&self, call: CallRecord) {
        let id = self.record(call, false);
        self.state().recorder.ended(id, flight_recorder::unix_ns(), flight_recorder::Outcome::Captured);
    }

    /// [`Watch::begin`] for a call that launches nothing (count 0, unchecked): recorded,
    /// counted and ended at once, but not the call a timeout names (an earlier call may still
    /// be running).
    pub(super) fn record_empty(&self, call: CallRecord) {
        let id = self.record(call, false);
        let outcome = self.outcome();
        self.state().recorder.ended(id, flight_recorder::unix_ns(), outcome);
    }

    fn record(&self, mut call: CallRecord, watched: bool) -> u64 {
        let issued = self.counter(self.rank);
        let mut st = self.state();
        if let Some(n) = issued {
            call.seq = n.fetch_add(1, Ordering::AcqRel) + 1;
        }
        let id = st.recorder.push(&call);
        // Only a timeout reads the pending launches (with timeouts off nothing would end them
        // on GPUs: the watch thread does not look).
        if watched && self.limit.is_some() {
            st.watch(id, Watched::Coll(call));
        }
        id
    }

    /// The result of queuing the launch watched as `ids` ([`Watch::begin`],
    /// [`Watch::begin_p2p`]), passed on. On an error (the call returns it) the launch is no
    /// longer pending and its recorded collectives end as not launched, so that a timeout never
    /// names a call that never ran; on success, several ids are marked as one launch, which a
    /// timeout names together.
    pub(super) fn queued(&self, ids: &[u64], launched: Result<()>) -> Result<()> {
        if launched.is_err() {
            self.state().not_launched(ids);
        } else if let [first, _, ..] = ids {
            // One launch runs them in turn: a timeout names them together. They are the newest
            // pending.
            for p in self.state().pending.iter_mut().rev().take_while(|p| p.id >= *first) {
                if ids.contains(&p.id) {
                    p.launch = *first;
                }
            }
        }
        launched
    }

    /// Marks collective number `seq` as the one the call-signature check found different on the
    /// ranks ([`flight_recorder::Outcome::CallMismatch`]).
    pub(super) fn call_mismatch(&self, seq: u64) {
        self.state().recorder.call_mismatch(seq, flight_recorder::unix_ns());
    }

    /// How a kernel of this rank ends now: as its abort flag says.
    fn outcome(&self) -> flight_recorder::Outcome {
        match self.flag().load(Ordering::Acquire) {
            0 => flight_recorder::Outcome::Completed,
            TIMED_OUT => flight_recorder::Outcome::TimedOut,
            _ => flight_recorder::Outcome::Aborted,
        }
    }

    /// Marks watched launch `id`'s kernel started now (CPU target; only a recorded collective
    /// keeps the time).
    pub(super) fn started(&self, id: u64) {
        self.state().recorder.started(id);
    }

    /// Marks watched launch `id`'s kernel ended now (CPU target), with the outcome its abort
    /// flag tells: its recorded collective, and it and every launch before it no longer
    /// pending (a rank's kernels run in the order issued).
    pub(super) fn ended(&self, id: u64) {
        let outcome = self.outcome();
        let mut st = self.state();
        st.recorder.ended(id, flight_recorder::unix_ns(), outcome);
        st.launches_ended(id);
    }

    /// Notes that watched launch `id`'s kernel is queued (CUDA) as launch `n`
    /// ([`super::enqueue::LaunchState::record`]): [`Watch::refresh_ends`] marks it ended once
    /// that launch's event completes. No driver call.
    pub(super) fn launched(&self, id: u64, n: u64) {
        let mut l = self.launches.lock().unwrap_or_else(|p| p.into_inner());
        let k = n as usize % l.len();
        l[k] = Some((id, n));
    }

    /// Marks ended (now) every recorded collective whose launch event has completed (CUDA), with
    /// the outcome the abort flag tells now, and every one before it (a rank's kernels run in
    /// order; a call whose slot a later launch took before any look ends with that launch).
    /// Takes the launches' lock, then the state's.
    fn refresh_ends(&self) {
        let Busy::Cuda(launch, _) = &self.busy else { return };
        // The driver's queries outside the lock, which a launch takes ([`Watch::launched`]).
        let pending: Vec<(u64, u64)> = self.launches.lock().unwrap_or_else(|p| p.into_inner()).iter().flatten().copied().collect();
        let Some(upto) = pending.iter().filter(|&&(_, n)| launch.completed(n).unwrap_or(false)).map(|&(id, _)| id).max() else {
            return;
        };
        let (outcome, now) = (self.outcome(), flight_recorder::unix_ns());
        {
            let mut st = self.state();
            let ended: Vec<u64> = st.recorder.unended().filter(|&id| id <= upto).collect();
            for id in ended {
                st.recorder.ended(id, now, outcome);
            }
            st.launches_ended(upto);
        }
        // Ended launches are not looked at again.
        for slot in self.launches.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            if slot.is_some_and(|(id, _)| id <= upto) {
                *slot = None;
            }
        }
    }

    /// Records a send or receive in the flight recorder as it is issued (`group`: the id of
    /// the thread's group, [`crate::group::current_group`]). Not counted as an issued call (see
    /// [`Watch::begin_p2p`]).
    pub(super) fn record_p2p(&self, call: &flight_recorder::P2pCall, group: Option<u64>) {
        self.state().recorder.push_p2p(call, group);
    }

    /// Records a point-to-point launch about to be queued (`what` names its sends and receives
    /// and their peers, made only with timeouts on); returns its number, by which its end is marked as a collective's is
    /// ([`Watch::launched`], [`Watch::ended`]). Not counted as an issued call: ranks issue
    /// different sends and receives, so counts say nothing about who is behind.
    pub(super) fn begin_p2p(&self, what: impl FnOnce() -> String) -> u64 {
        let mut st = self.state();
        let id = st.recorder.reserve();
        if self.limit.is_some() {
            st.watch(id, Watched::P2p(what()));
        }
        id
    }

    /// The message of the timeout, once one happened.
    pub(super) fn error(&self) -> Option<String> {
        self.state().error.clone()
    }

    fn counter(&self, r: usize) -> Option<&AtomicU64> {
        let &(_, at) = self.issued.iter().find(|(q, _)| *q == r)?;
        // SAFETY: the counter lies in the shared abort page (8-aligned, past the flag and the
        // rank that raised it), valid until `retire` (`new`'s contract); accessed atomically.
        Some(unsafe { AtomicU64::from_ptr(at as *mut u64) })
    }

    /// How often the watch thread looks at this watch: a sixteenth of the limit, within
    /// [1 ms, 100 ms] (the counters are sampled every eighth, within [10 ms, 1 s]).
    fn tick(&self) -> Duration {
        self.limit
            .map_or(Duration::from_millis(100), |l| l / 16)
            .clamp(Duration::from_millis(1), Duration::from_millis(100))
    }

    fn flag(&self) -> &AtomicU32 {
        // SAFETY: as in `counter`.
        unsafe { AtomicU32::from_ptr(self.flag as *mut u32) }
    }

    fn busy(&self) -> bool {
        match &self.busy {
            Busy::Cuda(l, _) => !l.idle().unwrap_or(true),
            Busy::Cpu(n, replays) => n.load(Ordering::Acquire) > replays.load(Ordering::Acquire),
        }
    }

    /// Every region's bytes now (on CUDA through `reader`'s stream).
    fn read(&self, reader: &mut Reader) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.regions.iter().map(|r| r.bytes).sum());
        for r in &self.regions {
            let at = out.len();
            out.resize(at + r.bytes, 0);
            match &self.busy {
                Busy::Cuda(_, ctx) => {
                    if reader.0.is_none() {
                        reader.0 = Some(cuda::Stream::new(ctx)?);
                    }
                    if let Some(s) = &reader.0 {
                        cuda::copy_dtoh_on(s, &mut out[at..], r.addr)?;
                    }
                }
                Busy::Cpu(..) => {
                    for (i, b) in out[at..].chunks_exact_mut(8).enumerate() {
                        // SAFETY: the region is host memory valid until `retire` (`new`'s
                        // contract), 8-aligned counters that peers write atomically.
                        let v = unsafe { AtomicU64::from_ptr((r.addr + 8 * i as u64) as *mut u64) }
                            .load(Ordering::Acquire);
                        b.copy_from_slice(&v.to_ne_bytes());
                    }
                }
            }
        }
        Ok(out)
    }

    /// One look: samples the counters when due; on `limit` without a change while busy, times
    /// the call out. Returns whether the watch is still alive.
    fn poll(&self, now: Instant, signals: u64) -> bool {
        if !self.state().alive {
            return false;
        }
        self.refresh_ends();
        let mut st = self.state();
        if !st.alive {
            return false;
        }
        if signals > self.signals_seen.fetch_max(signals, Ordering::AcqRel) {
            self.write_dump(&st);
        }
        let Some(limit) = self.limit else {
            return true;
        };
        if st.error.is_some() || self.flag().load(Ordering::Acquire) != 0 {
            return true;
        }
        if !self.busy() {
            st.last_change = now;
            st.last_sample = None;
            return true;
        }
        let every = (limit / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        if st.last_sample.is_some_and(|t| now - t < every) {
            return true;
        }
        st.last_sample = Some(now);
        let st = &mut *st;
        match self.read(&mut st.reader) {
            Ok(sample) if sample != st.sample => {
                st.sample = sample;
                st.last_change = now;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(target: "oxccl::timeout", rank = self.rank, "reading progress counters: {e}");
                return true;
            }
        }
        if now - st.last_change >= limit {
            // One look at the ranks' counters for the message and the dump alike.
            let (msg, nch) = {
                let stuck = self.stuck(st);
                (self.describe(st, limit, stuck.as_ref()), self.progress_channels(stuck.as_ref()))
            };
            tracing::error!(target: "oxccl::timeout", rank = self.rank, "{msg}");
            st.error = Some(msg);
            st.error_channels = nch;
            let _ = self.flag().compare_exchange(0, TIMED_OUT, Ordering::AcqRel, Ordering::Acquire);
            self.write_dump(&st);
        }
        true
    }

    /// The flight recorder's dump ([`flight_recorder`]): the calls, the issued count, the
    /// timeout's message and the counters of the named launch's ring channels as last sampled
    /// (read now when no call is being watched; [`Watch::progress_channels`]).
    pub(super) fn dump(&self) -> serde_json::Value {
        if self.state().alive {
            self.refresh_ends();
        }
        let mut st = self.state();
        if st.alive && st.sample.is_empty() && !self.regions.is_empty() {
            let st = &mut *st;
            if let Ok(s) = self.read(&mut st.reader) {
                st.sample = s;
            }
        }
        self.dump_of(&st)
    }

    fn dump_of(&self, st: &State) -> serde_json::Value {
        let issued = self.counter(self.rank).map_or(0, |n| n.load(Ordering::Acquire));
        let nch = if st.error.is_some() { st.error_channels } else { self.progress_channels(self.stuck(st).as_ref()) };
        let progress = self
            .ring
            .iter()
            .take(nch)
            .map(|c| {
                serde_json::json!({
                    "channel": c.channel,
                    "received_step": word(&st.sample, c.tail_at),
                    "from": c.prev,
                    "credited_step": word(&st.sample, c.head_at),
                    "by": c.next,
                })
            })
            .collect();
        st.recorder.dump(self.comm, self.rank, self.nranks, issued, st.error.as_deref(), progress)
    }

    /// The timeout's message: the oldest launch not seen ended ([`Watch::stuck`]), a call or
    /// calls launched together; then, for collectives, the first that ranks of this host have
    /// not issued and those ranks, or else where the launch's first channels stopped.
    fn describe(&self, st: &State, limit: Duration, stuck: Option<&Stuck<'_>>) -> String {
        let me = super::rank_of(self.rank, self.comm);
        let secs = limit.as_secs_f64();
        let colls: Vec<&CallRecord> = stuck
            .map(|s| s.calls.iter().filter_map(|w| if let Watched::Coll(c) = w { Some(c) } else { None }).collect())
            .unwrap_or_default();
        let mut msg = match stuck.map(|s| (s.calls.as_slice(), colls.as_slice())) {
            Some(([Watched::P2p(p2p), ..], _)) => {
                return format!(
                    "{me}: {p2p} made no progress for {secs:.1} s (OXCCL_TIMEOUT): waiting for those peers to post \
                     the matching receives and sends"
                );
            }
            Some((calls, [first, .., last])) if calls.len() == colls.len() => format!(
                "{me}: the {} calls #{} to #{} launched together made no progress for {secs:.1} s (OXCCL_TIMEOUT), {}",
                colls.len(),
                first.seq,
                last.seq,
                match stuck.and_then(|s| s.behind.as_ref()) {
                    Some((c, _)) => format!("among them {c}"),
                    None => format!("the first {first}"),
                }
            ),
            Some((_, [first])) => format!("{me}: {first} made no progress for {secs:.1} s (OXCCL_TIMEOUT)"),
            _ => format!("{me}: a call made no progress for {secs:.1} s (OXCCL_TIMEOUT)"),
        };
        if let Some((_, ranks)) = stuck.and_then(|s| s.behind.as_ref()) {
            msg += &format!(": waiting for ranks that have not issued it ({})", ranks.join(", "));
            return msg;
        }
        let nch = stuck.map_or(1, Stuck::channels);
        let word = |at: usize| word(&st.sample, at);
        let chans: Vec<String> = self
            .ring
            .iter()
            .take(nch.clamp(1, 2))
            .map(|c| {
                format!(
                    "channel {} received step {} from rank {} and was credited step {} by rank {}",
                    c.channel,
                    word(c.tail_at),
                    c.prev,
                    word(c.head_at),
                    c.next
                )
            })
            .collect();
        if !chans.is_empty() {
            msg += &format!(": {}", chans.join("; "));
        }
        msg
    }

    /// The oldest launch not seen ended, which a timeout names (later launches wait behind it):
    /// its watched calls, and the first of its collectives that ranks of this host have not
    /// issued. `None` when nothing is pending (or timeouts are off: nothing is kept).
    fn stuck<'a>(&self, st: &'a State) -> Option<Stuck<'a>> {
        let front = st.pending.front()?;
        let calls: Vec<&Watched> = st.pending.iter().take_while(|p| p.launch == front.launch).map(|p| &p.what).collect();
        let behind = calls.iter().find_map(|w| match w {
            Watched::Coll(c) => {
                let ranks = self.behind(c.seq);
                (!ranks.is_empty()).then_some((c, ranks))
            }
            Watched::P2p(_) => None,
        });
        Some(Stuck { calls, behind })
    }

    /// How many ring channels' counters a dump gives: those of the launch a timeout names
    /// ([`Stuck::channels`]), or every ring channel when no launch is watched.
    fn progress_channels(&self, stuck: Option<&Stuck<'_>>) -> usize {
        stuck.map_or(self.ring.len(), Stuck::channels)
    }

    /// "rank R has issued N calls" for each rank of this host that has issued fewer than `seq`
    /// calls.
    fn behind(&self, seq: u64) -> Vec<String> {
        self.issued
            .iter()
            .filter(|(r, _)| *r != self.rank)
            .filter_map(|&(r, _)| {
                let n = self.counter(r)?.load(Ordering::Acquire);
                (n < seq).then(|| format!("rank {r} has issued {n} calls"))
            })
            .collect()
    }
}

/// The `u64` at byte `at` of a sample (0 past its end).
fn word(sample: &[u8], at: usize) -> u64 {
    sample
        .get(at..at + 8)
        .map_or(0, |b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
}

/// The watches of this process and the thread that polls them.
struct Registry {
    watches: Vec<Weak<Watch>>,
    running: bool,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REG: Mutex<Registry> = Mutex::new(Registry {
        watches: Vec::new(),
        running: false,
    });
    REG.lock().unwrap_or_else(|p| p.into_inner())
}

fn register(w: &Arc<Watch>) {
    let mut reg = registry();
    reg.watches.push(Arc::downgrade(w));
    if !reg.running {
        match std::thread::Builder::new()
            .name("oxccl-timeout".into())
            .stack_size(256 << 10)
            .spawn(run)
        {
            Ok(_) => reg.running = true,
            Err(e) => {
                tracing::warn!(target: "oxccl::timeout", "cannot start the timeout thread ({e}): calls will not time out");
            }
        }
    }
}

/// The watch thread: polls each live watch at the shortest of their ticks; exits when none is
/// left.
fn run() {
    let mut tick = Duration::from_millis(1);
    loop {
        std::thread::sleep(tick);
        let watches: Vec<Arc<Watch>> = {
            let mut reg = registry();
            reg.watches.retain(|w| w.strong_count() > 0);
            if reg.watches.is_empty() {
                reg.running = false;
                return;
            }
            reg.watches.iter().filter_map(Weak::upgrade).collect()
        };
        let now = Instant::now();
        tick = watches.iter().map(|w| w.tick()).min().unwrap_or(Duration::from_millis(100));
        let signals = flight_recorder::signals();
        for w in watches {
            w.poll(now, signals);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> State {
        State::new(0)
    }

    fn ids(st: &State) -> Vec<u64> {
        st.pending.iter().map(|p| p.id).collect()
    }

    #[test]
    fn a_full_queue_keeps_the_oldest_and_the_newest_launch() {
        let mut st = state();
        for id in 0..MAX_PENDING as u64 + 2 {
            st.watch(id, Watched::P2p(format!("launch {id}")));
        }
        let kept = ids(&st);
        assert_eq!(kept.len(), MAX_PENDING);
        assert_eq!(kept[..2], [0, 1]);
        assert_eq!(kept[MAX_PENDING - 2..], [MAX_PENDING as u64 - 2, MAX_PENDING as u64 + 1]);
    }

    #[test]
    fn an_ended_launch_ends_every_launch_before_it() {
        let mut st = state();
        for id in [3, 5, 8] {
            st.watch(id, Watched::P2p(String::new()));
        }
        st.launches_ended(4);
        assert_eq!(ids(&st), [5, 8]);
        st.launches_ended(5);
        assert_eq!(ids(&st), [8]);
        st.launches_ended(9);
        assert!(ids(&st).is_empty());
    }

    #[test]
    fn a_launch_that_failed_is_not_the_one_a_timeout_names() {
        let mut st = State::new(4);
        for seq in 1..=2 {
            let id = st.recorder.push(&CallRecord::all_reduce_f32(seq, 4));
            st.watch(id, Watched::Coll(CallRecord::all_reduce_f32(seq, 4)));
        }
        // Call 1's launch failed; call 2 is the one queued.
        st.not_launched(&[0]);
        assert_eq!(ids(&st), [1]);
        let d = st.recorder.dump(1, 0, 2, 2, None, Vec::new());
        let outcomes: Vec<_> = d["calls"].as_array().unwrap().iter().map(|c| c["outcome"].clone()).collect();
        assert_eq!(outcomes, [serde_json::json!("not launched"), serde_json::Value::Null]);
    }
}
