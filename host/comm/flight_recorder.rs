//! The flight recorder (beyond NCCL; what PyTorch's NCCL flight recorder does for its users):
//! each communicator keeps its last `OXCCL_FLIGHT_RECORDER_SIZE` calls ([`Params::flight_recorder_size`],
//! default 64; `0` keeps none) — collectives with their sequence number, collective, count,
//! type, operator, root, algorithm/protocol/channels; sends and receives with their peer, count,
//! type, size, number among the calls with that peer and group; when each was issued — and
//! dumps them as one JSON object per rank:
//! on request ([`Comm::flight_record`]) and, with `OXCCL_FLIGHT_RECORDER_DUMP=<prefix>`, when a
//! call times out and when the process receives `SIGUSR1` (to `<prefix>.<comm>.<rank>.json`,
//! written by the watch thread of `comm/timeout.rs` within 100 ms; the handler is installed only
//! when the variable is set). [`analyze`] (the CLI's
//! `oxccl trace DUMP...`) reads the dumps of a communicator's ranks and says which rank is
//! behind and at which call, which ranks disagree on a call, which sends miss their receive (or
//! receives their send) or differ in size from it, and where a timed-out call stopped.
//!
//! A dump: `{"comm": "<hex id>", "rank", "nranks", "issued": <collectives issued>, "error": <the
//! timeout's message or null>, "progress": [per ring channel of the launch a timeout names (or
//! would name now; none for sends and receives; every ring channel when no launch is watched:
//! none runs, or timeouts are off):
//! {"channel", "received_step", "from", "credited_step", "by"}], "dropped": <calls recorded but no longer kept>, "calls":
//! [oldest first: {"seq", "func", "count", "dtype", "op", "root", "algo", "proto", "nchannels",
//! "issued_unix_ns", "started_unix_ns", "ended_unix_ns", "outcome"}]}`. A collective's kernel
//! is marked started and ended when it starts and ends on the CPU target; on GPUs its start is
//! not known (null) and its end is the time the watch thread (or the dump) first saw its launch's
//! event (the one the launch records behind every kernel) complete — within the watch's tick, a
//! sixteenth of `OXCCL_TIMEOUT` up to 100 ms; after 64 later launches unseen, with a later one. `"outcome"`: `"completed"`, `"aborted"` (its rank's abort flag was raised: an abort,
//! or another rank's), `"timed out"`, `"call mismatch"` (the call-signature check found the ranks'
//! calls of its number different; it moved no data), `"captured"` (issued on a stream capturing
//! into a CUDA graph: it runs at the graph's launches, which are not recorded; its end is its
//! issue), `"not launched"` (its launch failed and the call returned the error), or null while
//! it has not ended. Calls of
//! count 0 are recorded too (numbered as the check numbers them), ended when issued unless
//! checked. A send or receive (`"func": "send"` or `"recv"`, recorded when issued,
//! in or outside a group) has the same fields, `seq`, `op`, `root`, `algo`, `proto` and
//! `nchannels` null (only collectives are numbered by `seq` and counted in `issued`: ranks issue
//! different sends and receives), and adds `"peer"`, `"bytes"`, `"p2p_seq"` (1 for the rank's
//! first send to that peer, or first receive from it: a rank's `n`th send to a peer matches the
//! peer's `n`th receive from it) and `"group"` (the communicator's group the call was issued in,
//! 1 for its first group with sends or receives — the calls of one group are launched together
//! at its outermost end — or null outside a group). Dumps without `dropped` (older ones) read as
//! 0.
use super::*;
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};

/// How many `SIGUSR1` the process has taken: the handler counts them, and the watch thread
/// dumps each communicator once for those taken since it was created ([`signals`]).
static SIGNALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

extern "C" fn on_sigusr1(_: libc::c_int) {
    // Async-signal-safe: one lock-free atomic add; the watch thread writes the dumps.
    SIGNALS.fetch_add(1, Ordering::AcqRel);
}

/// Installs the `SIGUSR1` handler that asks for every communicator's dump (once per process).
pub(super) fn dump_on_signal() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction with a handler that only stores to an atomic, and an empty
        // mask; SA_RESTART keeps interrupted system calls of the application going.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigusr1 as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            tracing::warn!(target: "oxccl::timeout", "cannot install the SIGUSR1 handler of the flight recorder: {}", std::io::Error::last_os_error());
        }
    });
}

/// How many `SIGUSR1` the process has taken since its handler was installed.
pub(super) fn signals() -> u64 {
    SIGNALS.load(Ordering::Acquire)
}

/// One send or receive as the recorder keeps it.
#[derive(Clone, Debug)]
pub(super) struct P2pCall {
    pub(super) send: bool,
    pub(super) peer: usize,
    pub(super) count: usize,
    pub(super) dtype: DataType,
    /// `count × dtype.size()`.
    pub(super) bytes: u64,
}

/// What a recorded entry is.
#[derive(Clone, Debug)]
enum Call {
    Coll(timeout::CallRecord),
    P2p {
        call: P2pCall,
        /// 1 for the communicator's first send to (or receive from) this peer.
        p2p_seq: u64,
        /// The communicator's group the call was issued in (1 for its first), `None` outside
        /// a group.
        group: Option<u64>,
    },
}

/// One recorded call.
#[derive(Clone, Debug)]
struct Entry {
    call: Call,
    /// The recorder's number of the entry (0 for its first), [`Recorder::push`]'s result.
    id: u64,
    issued_unix_ns: u128,
    /// When its kernel started (CPU target) — `None` on GPUs and before it started.
    started_unix_ns: Option<u128>,
    /// When its kernel was seen ended, and how ([`Outcome`]); `None` before.
    ended: Option<(u128, Outcome)>,
}

/// How a recorded collective's kernel ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    Completed,
    /// Its rank's abort flag was raised while it ran (an abort, or another rank's).
    Aborted,
    /// It made no progress for `OXCCL_TIMEOUT`.
    TimedOut,
    /// The call-signature check (`OXCCL_CHECK_CALLS`) found the ranks' calls of its number
    /// different: it moved no data.
    CallMismatch,
    /// It was issued on a stream capturing into a CUDA graph: its kernel runs at each launch
    /// of the graph, which the recorder does not see.
    Captured,
    /// Its launch failed (the call returned the error): no kernel of it ran.
    NotLaunched,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Aborted => "aborted",
            Outcome::TimedOut => "timed out",
            Outcome::CallMismatch => "call mismatch",
            Outcome::Captured => "captured",
            Outcome::NotLaunched => "not launched",
        }
    }
}

/// The time now, in nanoseconds since the Unix epoch (0 if the clock is before it).
pub(super) fn unix_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

impl Entry {
    fn to_json(&self) -> Value {
        let mut v = self.call_json();
        if let Value::Object(m) = &mut v {
            m.insert("started_unix_ns".into(), json!(self.started_unix_ns.map(|t| t as u64)));
            m.insert("ended_unix_ns".into(), json!(self.ended.map(|(t, _)| t as u64)));
            m.insert("outcome".into(), json!(self.ended.map(|(_, o)| o.name())));
        }
        v
    }

    fn call_json(&self) -> Value {
        match &self.call {
            Call::Coll(c) => json!({
                "seq": c.seq,
                "func": c.func.name(),
                "count": c.count,
                "dtype": c.dtype.name(),
                "op": c.op.name(),
                "root": c.root,
                "algo": c.choice.map(|x| x.algo.name()),
                "proto": c.choice.map(|x| x.proto.name()),
                "nchannels": c.choice.map(|x| x.nchannels),
                "issued_unix_ns": self.issued_unix_ns as u64,
            }),
            Call::P2p { call, p2p_seq, group } => json!({
                "seq": null,
                "func": if call.send { "send" } else { "recv" },
                "count": call.count,
                "dtype": call.dtype.name(),
                "op": null,
                "root": null,
                "algo": null,
                "proto": null,
                "nchannels": null,
                "issued_unix_ns": self.issued_unix_ns as u64,
                "peer": call.peer,
                "bytes": call.bytes,
                "p2p_seq": p2p_seq,
                "group": group,
            }),
        }
    }
}

/// The last calls of one communicator.
pub(super) struct Recorder {
    size: usize,
    entries: VecDeque<Entry>,
    /// Calls recorded but not kept: pushed out by newer ones, or every call when `size` is 0.
    dropped: u64,
    /// Sends and receives issued per (peer, send).
    p2p_issued: HashMap<(usize, bool), u64>,
    /// Groups with sends or receives of this communicator, and the last one's id
    /// ([`crate::group::current_group`]).
    groups: u64,
    last_group: Option<u64>,
    /// The next entry's number.
    next_id: u64,
}

impl Recorder {
    pub(super) fn new(size: usize) -> Recorder {
        Recorder {
            size,
            entries: VecDeque::with_capacity(size.min(1024)),
            dropped: 0,
            p2p_issued: HashMap::new(),
            groups: 0,
            last_group: None,
            next_id: 0,
        }
    }

    /// Records the collective `call`; returns its entry's number, by which its kernel's start
    /// and end are marked ([`Recorder::started`], [`Recorder::ended`]).
    pub(super) fn push(&mut self, call: &timeout::CallRecord) -> u64 {
        self.keep(Call::Coll(call.clone()))
    }

    /// Marks entry `id`'s kernel started now (nothing when the entry is no longer kept).
    pub(super) fn started(&mut self, id: u64) {
        if let Some(e) = self.entry(id) {
            e.started_unix_ns = Some(unix_ns());
        }
    }

    /// Marks entry `id`'s kernel ended at `at` (nanoseconds since the Unix epoch) with
    /// `outcome`, unless it was marked already.
    pub(super) fn ended(&mut self, id: u64, at: u128, outcome: Outcome) {
        if let Some(e) = self.entry(id)
            && e.ended.is_none()
        {
            e.ended = Some((at, outcome));
        }
    }

    /// Marks collective number `seq` (its `"seq"`) as the call the call-signature check found
    /// different on the ranks: ended now with that outcome if not ended yet, else its outcome
    /// replaced (its kernel ended having moved nothing).
    pub(super) fn call_mismatch(&mut self, seq: u64, at: u128) {
        if let Some(e) = self.entries.iter_mut().rev().find(|e| matches!(&e.call, Call::Coll(c) if c.seq == seq)) {
            let at = e.ended.map_or(at, |(t, _)| t);
            e.ended = Some((at, Outcome::CallMismatch));
        }
    }

    /// The collectives kept whose kernel is not marked ended, by entry number.
    pub(super) fn unended(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries
            .iter()
            .filter(|e| e.ended.is_none() && matches!(e.call, Call::Coll(_)))
            .map(|e| e.id)
    }

    fn entry(&mut self, id: u64) -> Option<&mut Entry> {
        // Entries are kept in the order of their numbers.
        let i = self.entries.binary_search_by_key(&id, |e| e.id).ok()?;
        self.entries.get_mut(i)
    }

    /// Records the send or receive `call`, issued in the thread's group `group` (its id,
    /// [`crate::group::current_group`]) or outside a group: numbers it among the calls with its
    /// peer in its direction, and numbers the group among this communicator's.
    pub(super) fn push_p2p(&mut self, call: &P2pCall, group: Option<u64>) {
        let n = self.p2p_issued.entry((call.peer, call.send)).or_insert(0);
        *n += 1;
        let p2p_seq = *n;
        let group = group.map(|id| {
            if self.last_group != Some(id) {
                self.last_group = Some(id);
                self.groups += 1;
            }
            self.groups
        });
        self.keep(Call::P2p {
            call: call.clone(),
            p2p_seq,
            group,
        });
    }

    /// A number for a launch that is not an entry (a point-to-point launch, whose sends and
    /// receives have entries of their own), in order with the entries' numbers.
    pub(super) fn reserve(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    fn keep(&mut self, call: Call) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        if self.size == 0 {
            self.dropped += 1;
            return id;
        }
        if self.entries.len() == self.size {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.entries.push_back(Entry {
            call,
            id,
            issued_unix_ns: unix_ns(),
            started_unix_ns: None,
            ended: None,
        });
        id
    }

    /// The dump (module docs) of rank `rank` of `nranks` of communicator `comm`.
    pub(super) fn dump(
        &self,
        comm: u64,
        rank: usize,
        nranks: usize,
        issued: u64,
        error: Option<&str>,
        progress: Vec<Value>,
    ) -> Value {
        json!({
            "comm": format!("{comm:08x}"),
            "rank": rank,
            "nranks": nranks,
            "issued": issued,
            "error": error,
            "progress": progress,
            "dropped": self.dropped,
            "calls": self.entries.iter().map(Entry::to_json).collect::<Vec<_>>(),
        })
    }
}

/// What one dump says, as [`analyze`] reads it.
struct RankDump {
    /// The dump's name (its file), for errors.
    name: String,
    comm: String,
    rank: usize,
    nranks: usize,
    issued: u64,
    error: Option<String>,
    progress: Vec<String>,
    /// Calls recorded but not in the dump (0 in dumps older than the field).
    dropped: u64,
    /// The collectives by seq (sorted, each once): the call's description and its signature
    /// (collective, count, type, op, root).
    calls: Vec<(u64, String, String)>,
    /// The sends and receives, in issue order.
    p2p: Vec<P2pEntry>,
    /// Where in `p2p` each (send, peer, seq) is, and the lowest and highest seq kept per
    /// (send, peer): lookups in constant time, so that a dump of a million calls reads in
    /// seconds.
    p2p_at: HashMap<(bool, usize, u64), usize>,
    p2p_span: HashMap<(bool, usize), (u64, u64)>,
}

/// A send or receive of a dump.
struct P2pEntry {
    send: bool,
    peer: usize,
    /// Its number among the rank's calls with `peer` in its direction (1 for the first).
    seq: u64,
    bytes: u64,
    /// "16 × float = 64 bytes".
    size: String,
    /// "group 2" or "no group".
    group: String,
}

impl RankDump {
    /// The sends to (`send`) or receives from `peer` this rank issued, as far as its dump
    /// tells: `None` when entries it dropped may hold the one numbered `seq` (the count is
    /// then unknown).
    fn p2p_issued(&self, send: bool, peer: usize, seq: u64) -> Option<u64> {
        let span = self.p2p_span.get(&(send, peer));
        let (lowest, highest) = (span.map(|s| s.0), span.map_or(0, |s| s.1));
        // With nothing dropped the dump holds every call; otherwise an older call of the same
        // peer and direction still kept means every later one is kept too.
        (self.dropped == 0 || lowest.is_some_and(|l| l < seq)).then_some(highest)
    }

    /// The matching entry of a send or receive: this rank's call `seq` in direction `send`
    /// with `peer`.
    fn p2p_of(&self, send: bool, peer: usize, seq: u64) -> Option<&P2pEntry> {
        self.p2p_at.get(&(send, peer, seq)).map(|&i| &self.p2p[i])
    }

    /// Collective `seq`, if recorded.
    fn call(&self, seq: u64) -> Option<&(u64, String, String)> {
        self.calls.binary_search_by_key(&seq, |c| c.0).ok().map(|i| &self.calls[i])
    }
}

fn parse(name: &str, v: &Value) -> Result<RankDump> {
    let bad = |what: &str| Error::invalid(format!("{name}: not a flight-recorder dump ({what})"));
    let num = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| bad(k));
    let calls = v.get("calls").and_then(Value::as_array).ok_or_else(|| bad("calls"))?;
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut p2p = Vec::new();
    for c in calls {
        let s = |k: &str| c.get(k).map_or(String::new(), |x| x.as_str().map_or(x.to_string(), str::to_string));
        let func = s("func");
        if matches!(func.as_str(), "send" | "recv") {
            let n = |k: &str| c.get(k).and_then(Value::as_u64).ok_or_else(|| bad(&format!("calls[].{k}")));
            let (bytes, group) = (n("bytes")?, c.get("group").and_then(Value::as_u64));
            let group = group.map_or_else(|| "no group".to_string(), |g| format!("group {g}"));
            p2p.push(P2pEntry {
                send: func == "send",
                peer: n("peer")? as usize,
                seq: n("p2p_seq")?,
                bytes,
                size: format!("{} × {} = {bytes} bytes", s("count"), s("dtype")),
                group,
            });
            continue;
        }
        let seq = c.get("seq").and_then(Value::as_u64).ok_or_else(|| bad("calls[].seq"))?;
        let rooted = matches!(func.as_str(), "broadcast" | "reduce");
        let reducing = matches!(func.as_str(), "reduce" | "reducescatter" | "allreduce");
        let mut sig = format!("{func} {} × {}", s("count"), s("dtype"));
        if reducing {
            sig += &format!(" op {}", s("op"));
        }
        if rooted {
            sig += &format!(" root {}", s("root"));
        }
        let desc = format!("{sig} ({}/{} on {} channels)", s("algo"), s("proto"), s("nchannels"));
        if !seen.insert(seq) {
            return Err(bad(&format!("call #{seq} recorded twice")));
        }
        out.push((seq, desc, sig));
    }
    out.sort_unstable_by_key(|c| c.0);
    let mut p2p_at = HashMap::with_capacity(p2p.len());
    let mut p2p_span: HashMap<(bool, usize), (u64, u64)> = HashMap::new();
    for (i, e) in p2p.iter().enumerate() {
        p2p_at.entry((e.send, e.peer, e.seq)).or_insert(i);
        let span = p2p_span.entry((e.send, e.peer)).or_insert((e.seq, e.seq));
        *span = (span.0.min(e.seq), span.1.max(e.seq));
    }
    let progress = v
        .get("progress")
        .and_then(Value::as_array)
        .map(|p| {
            p.iter()
                .map(|c| {
                    let n = |k: &str| c.get(k).and_then(Value::as_u64).unwrap_or(0);
                    format!(
                        "channel {} received step {} from rank {} and was credited step {} by rank {}",
                        n("channel"),
                        n("received_step"),
                        n("from"),
                        n("credited_step"),
                        n("by")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let (rank, nranks) = (num("rank")?, num("nranks")?);
    let max = crate::bootstrap::MAX_NRANKS as u64;
    if nranks == 0 || nranks > max || rank >= nranks {
        return Err(bad(&format!(
            "rank {rank} of nranks {nranks} is out of range (accepted: rank 0..nranks, nranks 1..={max})"
        )));
    }
    Ok(RankDump {
        name: name.to_string(),
        comm: v.get("comm").and_then(Value::as_str).ok_or_else(|| bad("comm"))?.to_string(),
        rank: rank as usize,
        nranks: nranks as usize,
        issued: num("issued")?,
        error: v.get("error").and_then(Value::as_str).map(str::to_string),
        progress,
        dropped: v.get("dropped").and_then(Value::as_u64).unwrap_or(0),
        calls: out,
        p2p,
        p2p_at,
        p2p_span,
    })
}

/// Matches the sends and receives of one communicator's dumps, per (sender, receiver) pair in
/// issue order (a rank's `n`th send to a peer with the peer's `n`th receive from it): appends a
/// line per call whose match is missing from a dump that would hold it, and per matched pair
/// of different sizes. Returns how many pairs matched with equal sizes.
fn match_p2p(rs: &[&RankDump], out: &mut String) -> usize {
    let mut matched = 0;
    for a in rs {
        for e in &a.p2p {
            // `rs` is sorted by rank.
            let Ok(b) = rs.binary_search_by_key(&e.peer, |r| r.rank).map(|i| rs[i]) else {
                continue; // no dump from the peer: said above
            };
            let other = b.p2p_of(!e.send, a.rank, e.seq);
            let (mine, theirs) = if e.send { ("send", "receive") } else { ("receive", "send") };
            let (to, from) = if e.send { ("to", "from") } else { ("from", "to") };
            match other {
                // Each pair once: from the sender's side.
                Some(o) if e.send => {
                    if o.bytes == e.bytes {
                        matched += 1;
                    } else {
                        *out += &format!(
                            "  size mismatch: rank {}'s send #{} to rank {} is {} ({}), rank {}'s receive #{} from rank {} is {} ({})\n",
                            a.rank, e.seq, b.rank, e.size, e.group, b.rank, o.seq, a.rank, o.size, o.group
                        );
                    }
                }
                Some(_) => {}
                None => {
                    if let Some(n) = b.p2p_issued(!e.send, a.rank, e.seq) {
                        *out += &format!(
                            "  rank {}'s {mine} #{} {to} rank {} ({}, {}) has no matching {theirs}: rank {} issued {n} {theirs}s {from} rank {}\n",
                            a.rank, e.seq, b.rank, e.size, e.group, b.rank, a.rank
                        );
                    }
                }
            }
        }
    }
    matched
}

/// Reads the dumps (`(name, JSON)`, e.g. file names and their contents) of one or more
/// communicators and reports, per communicator: the ranks without a dump, the ranks behind the
/// others (collectives issued, and the first collective they have not issued as the others
/// recorded it), the collectives on which ranks disagree (collective, count, type, operator or
/// root), the sends without their receive and the receives without their send (matched per
/// pair of ranks in issue order, as the ranks match them), the matched sends and receives of
/// different sizes, and each timed-out rank's message with its channels' progress. Errors:
/// `InvalidArgument` naming a dump that is not JSON or not a flight-recorder dump (its rank out
/// of range, or a call recorded twice), or the two dumps of one communicator that give the same
/// rank or different numbers of ranks.
pub fn analyze(dumps: &[(String, String)]) -> Result<String> {
    let mut ranks = Vec::new();
    for (name, text) in dumps {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("{name}: not a flight-recorder dump (not JSON: {e})")))?;
        ranks.push(parse(name, &v)?);
    }
    let mut comms: Vec<&str> = ranks.iter().map(|r| r.comm.as_str()).collect();
    comms.sort();
    comms.dedup();
    let mut out = String::new();
    for comm in comms {
        let mut rs: Vec<&RankDump> = ranks.iter().filter(|r| r.comm == comm).collect();
        rs.sort_by_key(|r| r.rank);
        for w in rs.windows(2) {
            if w[0].rank == w[1].rank {
                return Err(Error::invalid(format!(
                    "{} and {}: two dumps of rank {} of communicator {comm}",
                    w[0].name, w[1].name, w[0].rank
                )));
            }
        }
        if let Some(r) = rs.iter().find(|r| r.nranks != rs[0].nranks) {
            return Err(Error::invalid(format!(
                "{} and {}: communicator {comm} has {} ranks in one and {} in the other",
                rs[0].name, r.name, rs[0].nranks, r.nranks
            )));
        }
        let nranks = rs[0].nranks;
        out += &format!("communicator {comm}: {nranks} ranks, dumps from {}\n", rs.len());
        let header = out.len();
        let missing: Vec<usize> = (0..nranks).filter(|q| rs.binary_search_by_key(q, |r| r.rank).is_err()).collect();
        if !missing.is_empty() {
            out += &format!("  no dump from {}\n", super::call_check::ranks_phrase(&missing));
        }
        let most = rs.iter().map(|r| r.issued).max().unwrap_or(0);
        let ahead: Vec<&&RankDump> = rs.iter().filter(|r| r.issued == most).collect();
        for r in rs.iter().filter(|r| r.issued < most) {
            let next = r.issued + 1;
            let what = ahead
                .iter()
                .find_map(|a| a.call(next))
                .map_or_else(|| format!("call #{next}"), |c| format!("call #{next}: {}", c.1));
            out += &format!(
                "  rank {} is behind: it issued {} calls, rank {} issued {most}; it has not issued {what}\n",
                r.rank, r.issued, ahead[0].rank
            );
        }
        let mut seqs: Vec<u64> = rs.iter().flat_map(|r| r.calls.iter().map(|c| c.0)).collect();
        seqs.sort();
        seqs.dedup();
        for s in seqs {
            let sigs: Vec<(usize, &str)> = rs
                .iter()
                .filter_map(|r| r.call(s).map(|c| (r.rank, c.2.as_str())))
                .collect();
            if sigs.iter().any(|(_, g)| *g != sigs[0].1) {
                let list: Vec<String> = sigs.iter().map(|(q, g)| format!("rank {q} {g}")).collect();
                out += &format!("  call #{s}: ranks disagree: {}\n", list.join(", "));
            }
        }
        let matched = match_p2p(&rs, &mut out);
        for r in &rs {
            if let Some(e) = &r.error {
                out += &format!("  rank {} timed out: {e}\n", r.rank);
                for p in &r.progress {
                    out += &format!("    {p}\n");
                }
            }
        }
        if out.len() == header {
            out += &format!("  every rank issued {most} calls; they agree on every recorded call");
            if matched > 0 {
                out += &format!("; {matched} recorded sends match their receives");
            }
            out += "\n";
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(rank: usize, issued: u64, calls: &[(u64, &str, u64)], error: Option<&str>) -> (String, String) {
        let calls: Vec<Value> = calls
            .iter()
            .map(|&(seq, func, count)| {
                json!({"seq": seq, "func": func, "count": count, "dtype": "float", "op": "sum",
                       "root": 0, "algo": "ring", "proto": "LL", "nchannels": 1, "issued_unix_ns": 1})
            })
            .collect();
        let v = json!({"comm": "0000abcd", "rank": rank, "nranks": 3, "issued": issued, "error": error,
            "progress": [{"channel": 0, "received_step": 4, "from": 2, "credited_step": 6, "by": 1}],
            "calls": calls});
        (format!("r{rank}.json"), v.to_string())
    }

    #[test]
    fn names_the_rank_behind_the_disagreeing_call_and_the_timeout() {
        let dumps = [
            dump(0, 2, &[(1, "allreduce", 8), (2, "allreduce", 16)], Some("rank 0: allreduce call #2 made no progress")),
            dump(1, 2, &[(1, "allreduce", 8), (2, "allgather", 16)], None),
            dump(2, 1, &[(1, "allreduce", 8)], None),
        ];
        let r = analyze(&dumps).unwrap();
        assert_eq!(
            r,
            "communicator 0000abcd: 3 ranks, dumps from 3\n  \
             rank 2 is behind: it issued 1 calls, rank 0 issued 2; it has not issued call #2: allreduce 16 × float op sum (ring/LL on 1 channels)\n  \
             call #2: ranks disagree: rank 0 allreduce 16 × float op sum, rank 1 allgather 16 × float\n  \
             rank 0 timed out: rank 0: allreduce call #2 made no progress\n    \
             channel 0 received step 4 from rank 2 and was credited step 6 by rank 1\n"
        );
    }

    #[test]
    fn agreeing_ranks_and_a_missing_dump() {
        let all = [dump(0, 1, &[(1, "broadcast", 8)], None), dump(1, 1, &[(1, "broadcast", 8)], None)];
        let r = analyze(&all).unwrap();
        assert_eq!(
            r,
            "communicator 0000abcd: 3 ranks, dumps from 2\n  no dump from rank 2\n"
        );
        let e = analyze(&[("x.json".into(), "{}".into())]).unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: x.json: not a flight-recorder dump (calls)");
        let e = analyze(&[("y.json".into(), "not json".into())]).unwrap_err();
        assert!(e.to_string().starts_with("invalid argument: y.json: not a flight-recorder dump (not JSON: "), "{e}");
    }

    #[test]
    fn dumps_that_cannot_be_one_communicators_are_refused_by_name() {
        let mut twice = dump(1, 1, &[(1, "broadcast", 8)], None);
        twice.0 = "again.json".into();
        let e = analyze(&[dump(0, 1, &[], None), dump(1, 1, &[], None), twice]).unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: r1.json and again.json: two dumps of rank 1 of communicator 0000abcd");
        let with = |k: &str, x: Value| {
            let (name, text) = dump(1, 1, &[(1, "broadcast", 8)], None);
            let mut v: Value = serde_json::from_str(&text).unwrap();
            v[k] = x;
            (name, v.to_string())
        };
        let e = analyze(&[dump(0, 1, &[], None), with("nranks", json!(4))]).unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: r0.json and r1.json: communicator 0000abcd has 3 ranks in one and 4 in the other");
        for (k, x, shown) in [
            ("rank", json!(3), "rank 3 of nranks 3"),
            ("nranks", json!(100_000_000_000u64), "rank 1 of nranks 100000000000"),
            ("nranks", json!(0), "rank 1 of nranks 0"),
        ] {
            let e = analyze(&[with(k, x)]).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid argument: r1.json: not a flight-recorder dump ({shown} is out of range (accepted: rank 0..nranks, nranks 1..=1048576))"
                )
            );
        }
        let e = analyze(&[dump(0, 2, &[(1, "allreduce", 8), (1, "allreduce", 8)], None)]).unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: r0.json: not a flight-recorder dump (call #1 recorded twice)");
        // Every rank missing but one is named in runs.
        let r = analyze(&[with("nranks", json!(1 << 20))]).unwrap();
        assert!(r.contains("no dump from ranks 0, 2-1048575\n"), "{r}");
    }

    #[test]
    fn the_recorder_keeps_the_last_calls() {
        let mut rec = Recorder::new(2);
        for seq in 1..=3 {
            rec.push(&timeout::CallRecord::all_reduce_f32(seq, 4));
        }
        let d = rec.dump(0xab, 1, 2, 3, None, Vec::new());
        let seqs: Vec<u64> = d["calls"].as_array().unwrap().iter().map(|c| c["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, vec![2, 3]);
        assert_eq!(d["comm"], "000000ab");
        assert!(Recorder::new(0).dump(1, 0, 1, 0, None, Vec::new())["calls"].as_array().unwrap().is_empty());
    }

    /// A collective entry as a dump holds it.
    fn coll(seq: u64, count: u64) -> Value {
        json!({"seq": seq, "func": "allreduce", "count": count, "dtype": "float", "op": "sum",
               "root": 0, "algo": "ring", "proto": "LL", "nchannels": 1, "issued_unix_ns": 1})
    }

    /// A send (`"send"`) or receive (`"recv"`) entry as a dump holds it.
    fn p2p(func: &str, peer: usize, count: u64, p2p_seq: u64, group: Option<u64>) -> Value {
        json!({"seq": null, "func": func, "count": count, "dtype": "float", "op": null, "root": null,
               "algo": null, "proto": null, "nchannels": null, "issued_unix_ns": 1,
               "peer": peer, "bytes": 4 * count, "p2p_seq": p2p_seq, "group": group})
    }

    /// The dump of rank `rank` of 2 that issued `issued` collectives and dropped `dropped` calls.
    fn dump2(rank: usize, issued: u64, dropped: u64, calls: Vec<Value>) -> (String, String) {
        let v = json!({"comm": "0000abcd", "rank": rank, "nranks": 2, "issued": issued, "error": null,
            "progress": [], "dropped": dropped, "calls": calls});
        (format!("r{rank}.json"), v.to_string())
    }

    #[test]
    fn names_a_send_without_its_receive_and_a_receive_without_its_send() {
        let dumps = [
            dump2(0, 1, 0, vec![coll(1, 8), p2p("send", 1, 16, 1, Some(1))]),
            dump2(
                1,
                1,
                0,
                vec![coll(1, 8), p2p("recv", 0, 16, 1, None), p2p("recv", 0, 4, 2, Some(3))],
            ),
        ];
        assert_eq!(
            analyze(&dumps).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             rank 1's receive #2 from rank 0 (4 × float = 16 bytes, group 3) has no matching send: rank 0 issued 1 sends to rank 1\n"
        );
        let dumps = [
            dump2(0, 1, 0, vec![coll(1, 8), p2p("send", 1, 16, 1, Some(1))]),
            dump2(1, 1, 0, vec![coll(1, 8)]),
        ];
        assert_eq!(
            analyze(&dumps).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             rank 0's send #1 to rank 1 (16 × float = 64 bytes, group 1) has no matching receive: rank 1 issued 0 receives from rank 0\n"
        );
        // Rank 1 dropped calls: its receive may be among them, so nothing is said.
        let dumps = [
            dump2(0, 1, 0, vec![coll(1, 8), p2p("send", 1, 16, 1, Some(1))]),
            dump2(1, 1, 5, vec![coll(1, 8)]),
        ];
        assert_eq!(
            analyze(&dumps).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  every rank issued 1 calls; they agree on every recorded call\n"
        );
        // ... unless it kept an earlier receive from rank 0, after which it kept every call.
        let dumps = [
            dump2(0, 0, 0, vec![p2p("send", 1, 16, 1, None), p2p("send", 1, 16, 2, None)]),
            dump2(1, 0, 5, vec![p2p("recv", 0, 16, 1, None)]),
        ];
        assert_eq!(
            analyze(&dumps).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             rank 0's send #2 to rank 1 (16 × float = 64 bytes, no group) has no matching receive: rank 1 issued 1 receives from rank 0\n"
        );
        // A send or receive without its peer, size or number is not a dump's.
        let mut bad = p2p("send", 1, 16, 1, None);
        bad.as_object_mut().unwrap().remove("p2p_seq");
        let e = analyze(&[dump2(0, 0, 0, vec![bad])]).unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: r0.json: not a flight-recorder dump (calls[].p2p_seq)");
    }

    #[test]
    fn dumps_of_twenty_thousand_calls_each_are_matched_call_by_call() {
        const N: u64 = 20_000;
        // Rank 0: N collectives (listed newest first) and N sends to rank 1; rank 1: the same
        // collectives but call #7777's count, and one receive fewer.
        let rank0: Vec<Value> = (1..=N).rev().map(|q| coll(q, 8)).chain((1..=N).map(|q| p2p("send", 1, 2, q, None))).collect();
        let rank1: Vec<Value> = (1..=N)
            .map(|q| coll(q, if q == 7_777 { 9 } else { 8 }))
            .chain((1..N).map(|q| p2p("recv", 0, 2, q, None)))
            .collect();
        let report = analyze(&[dump2(0, N, 0, rank0), dump2(1, N, 0, rank1)]).unwrap();
        assert_eq!(
            report,
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             call #7777: ranks disagree: rank 0 allreduce 8 × float op sum, rank 1 allreduce 9 × float op sum\n  \
             rank 0's send #20000 to rank 1 (2 × float = 8 bytes, no group) has no matching receive: rank 1 issued 19999 receives from rank 0\n"
        );
    }

    #[test]
    fn names_both_ranks_and_sizes_of_a_size_mismatch() {
        let dumps = [
            dump2(0, 0, 0, vec![p2p("send", 1, 16, 1, Some(2))]),
            dump2(1, 0, 0, vec![p2p("recv", 0, 8, 1, Some(2))]),
        ];
        assert_eq!(
            analyze(&dumps).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             size mismatch: rank 0's send #1 to rank 1 is 16 × float = 64 bytes (group 2), \
             rank 1's receive #1 from rank 0 is 8 × float = 32 bytes (group 2)\n"
        );
    }

    /// Sends and receives between collectives, in another order on each rank (as a program may
    /// issue them), leave the collectives aligned by their sequence numbers.
    #[test]
    fn interleaved_collectives_and_sends_agree() {
        let dumps = [
            dump2(
                0,
                2,
                0,
                vec![
                    coll(1, 8),
                    p2p("send", 1, 16, 1, Some(1)),
                    p2p("recv", 1, 32, 1, Some(1)),
                    coll(2, 8),
                    p2p("send", 1, 4, 2, None),
                    p2p("send", 0, 2, 1, Some(2)),
                    p2p("recv", 0, 2, 1, Some(2)),
                ],
            ),
            dump2(
                1,
                2,
                0,
                vec![
                    p2p("send", 0, 32, 1, Some(1)),
                    coll(1, 8),
                    p2p("recv", 0, 16, 1, Some(1)),
                    p2p("recv", 0, 4, 2, Some(2)),
                    coll(2, 8),
                ],
            ),
        ];
        assert_eq!(
            analyze(&dumps).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             every rank issued 2 calls; they agree on every recorded call; 4 recorded sends match their receives\n"
        );
        // A collective that differs is still found among them.
        let mut other = dumps.clone();
        other[1] = dump2(
            1,
            2,
            0,
            vec![
                p2p("send", 0, 32, 1, Some(1)),
                coll(1, 8),
                p2p("recv", 0, 16, 1, Some(1)),
                p2p("recv", 0, 4, 2, None),
                coll(2, 9),
            ],
        );
        assert_eq!(
            analyze(&other).unwrap(),
            "communicator 0000abcd: 2 ranks, dumps from 2\n  \
             call #2: ranks disagree: rank 0 allreduce 8 × float op sum, rank 1 allreduce 9 × float op sum\n"
        );
    }

    #[test]
    fn the_recorder_numbers_sends_and_receives_per_peer_and_groups_per_communicator() {
        let mut rec = Recorder::new(4);
        let call = |send, peer| P2pCall {
            send,
            peer,
            count: 3,
            dtype: DataType::F32,
            bytes: 12,
        };
        rec.push_p2p(&call(true, 1), Some(40));
        rec.push_p2p(&call(false, 1), Some(40));
        rec.push_p2p(&call(true, 1), None);
        rec.push_p2p(&call(true, 2), Some(41));
        rec.push_p2p(&call(true, 1), Some(45));
        let d = rec.dump(0xab, 0, 3, 0, None, Vec::new());
        assert_eq!(d["dropped"], 1);
        let calls = d["calls"].as_array().unwrap();
        let got: Vec<(String, u64, u64, Value)> = calls
            .iter()
            .map(|c| {
                let n = |k: &str| c[k].as_u64().unwrap();
                (c["func"].as_str().unwrap().to_string(), n("peer"), n("p2p_seq"), c["group"].clone())
            })
            .collect();
        let want = |f: &str, peer, n, g: Value| (f.to_string(), peer, n, g);
        assert_eq!(
            got,
            vec![
                want("recv", 1, 1, json!(1)),
                want("send", 1, 2, Value::Null),
                want("send", 2, 1, json!(2)),
                want("send", 1, 3, json!(3)),
            ]
        );
        let mut first = calls[0].clone();
        first.as_object_mut().unwrap().remove("issued_unix_ns");
        assert_eq!(
            first,
            json!({"seq": null, "func": "recv", "count": 3, "dtype": "float", "op": null, "root": null,
                   "algo": null, "proto": null, "nchannels": null, "peer": 1, "bytes": 12, "p2p_seq": 1, "group": 1,
                   "started_unix_ns": null, "ended_unix_ns": null, "outcome": null})
        );
        // A collective's start and end are marked by its entry's number, once.
        let mut rec = Recorder::new(2);
        let coll = timeout::CallRecord {
            seq: 1,
            func: Func::AllReduce,
            count: 8,
            dtype: DataType::F32,
            op: DevRedOp::Sum,
            root: 0,
            choice: None,
        };
        let (a, b) = (rec.push(&coll), rec.push(&coll));
        assert_eq!((a, b), (0, 1));
        rec.started(b);
        rec.ended(b, 7, Outcome::TimedOut);
        rec.ended(b, 9, Outcome::Completed);
        assert_eq!(rec.unended().collect::<Vec<_>>(), vec![a]);
        let c = rec.push(&coll);
        rec.ended(a, 5, Outcome::Completed); // pushed out by `c`: nothing to mark
        let d = rec.dump(1, 0, 2, 0, None, Vec::new());
        let calls = d["calls"].as_array().unwrap();
        assert_eq!((calls[0]["ended_unix_ns"].clone(), calls[0]["outcome"].clone()), (json!(7), json!("timed out")));
        assert!(calls[0]["started_unix_ns"].as_u64().is_some_and(|t| t > 0));
        assert_eq!((calls[1]["started_unix_ns"].clone(), calls[1]["outcome"].clone()), (Value::Null, Value::Null));
        assert_eq!(rec.unended().collect::<Vec<_>>(), vec![c]);
        // Nothing kept: every call counts as dropped.
        let mut none = Recorder::new(0);
        none.push_p2p(&call(true, 1), None);
        assert_eq!(none.dump(1, 0, 1, 0, None, Vec::new())["dropped"], 1);
    }
}
