//! The flight recorder (beyond NCCL; what PyTorch's NCCL flight recorder does for its users):
//! each communicator keeps its last `OXCCL_FLIGHT_RECORDER_SIZE` calls ([`Params::flight_recorder_size`],
//! default 64; `0` keeps none) — sequence number, collective, count, type, operator, root,
//! algorithm/protocol/channels, when it was issued — and dumps them as one JSON object per rank:
//! on request ([`Comm::flight_record`]) and, with `OXCCL_FLIGHT_RECORDER_DUMP=<prefix>`, when a
//! call times out and when the process receives `SIGUSR1` (to `<prefix>.<comm>.<rank>.json`,
//! written by the watch thread of `comm/timeout.rs` within 100 ms; the handler is installed only
//! when the variable is set). [`analyze`] (the CLI's
//! `oxccl trace DUMP...`) reads the dumps of a communicator's ranks and says which rank is
//! behind and at which call, which ranks disagree on a call, and where a timed-out call stopped.
//!
//! A dump: `{"comm": "<hex id>", "rank", "nranks", "issued": <calls issued>, "error": <the
//! timeout's message or null>, "progress": [per ring channel: {"channel", "received_step",
//! "from", "credited_step", "by"}], "calls": [oldest first: {"seq", "func", "count", "dtype",
//! "op", "root", "algo", "proto", "nchannels", "issued_unix_ns"}]}`.
use super::*;
use serde_json::{Value, json};
use std::collections::VecDeque;

/// Set by the `SIGUSR1` handler, taken by the watch thread ([`dump_requested`]).
static DUMP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    // Async-signal-safe: one atomic store; the watch thread writes the dumps.
    DUMP_REQUESTED.store(true, Ordering::Release);
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

/// Whether a dump was asked for since the last call (and clears the request).
pub(super) fn dump_requested() -> bool {
    DUMP_REQUESTED.swap(false, Ordering::AcqRel)
}

/// One recorded call.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) call: timeout::CallRecord,
    pub(super) issued_unix_ns: u128,
}

impl Entry {
    fn to_json(&self) -> Value {
        let c = &self.call;
        json!({
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
        })
    }
}

/// The last calls of one communicator.
pub(super) struct Recorder {
    size: usize,
    entries: VecDeque<Entry>,
}

impl Recorder {
    pub(super) fn new(size: usize) -> Recorder {
        Recorder {
            size,
            entries: VecDeque::with_capacity(size.min(1024)),
        }
    }

    pub(super) fn push(&mut self, call: &timeout::CallRecord) {
        if self.size == 0 {
            return;
        }
        if self.entries.len() == self.size {
            self.entries.pop_front();
        }
        let issued_unix_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        self.entries.push_back(Entry {
            call: call.clone(),
            issued_unix_ns,
        });
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
            "calls": self.entries.iter().map(Entry::to_json).collect::<Vec<_>>(),
        })
    }
}

/// What one dump says, as [`analyze`] reads it.
struct RankDump {
    comm: String,
    rank: usize,
    nranks: usize,
    issued: u64,
    error: Option<String>,
    progress: Vec<String>,
    /// seq → the call's description and its signature (collective, count, type, op, root).
    calls: Vec<(u64, String, String)>,
}

fn parse(name: &str, v: &Value) -> Result<RankDump> {
    let bad = |what: &str| Error::invalid(format!("{name}: not a flight-recorder dump ({what})"));
    let num = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| bad(k));
    let calls = v.get("calls").and_then(Value::as_array).ok_or_else(|| bad("calls"))?;
    let mut out = Vec::new();
    for c in calls {
        let s = |k: &str| c.get(k).map_or(String::new(), |x| x.as_str().map_or(x.to_string(), str::to_string));
        let seq = c.get("seq").and_then(Value::as_u64).ok_or_else(|| bad("calls[].seq"))?;
        let func = s("func");
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
        out.push((seq, desc, sig));
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
    Ok(RankDump {
        comm: v.get("comm").and_then(Value::as_str).ok_or_else(|| bad("comm"))?.to_string(),
        rank: num("rank")? as usize,
        nranks: num("nranks")? as usize,
        issued: num("issued")?,
        error: v.get("error").and_then(Value::as_str).map(str::to_string),
        progress,
        calls: out,
    })
}

/// Reads the dumps (`(name, JSON)`, e.g. file names and their contents) of one or more
/// communicators and reports, per communicator: the ranks without a dump, the ranks behind the
/// others (calls issued, and the first call they have not issued as the others recorded it), the
/// calls on which ranks disagree (collective, count, type, operator or root), and each timed-out
/// rank's message with its channels' progress. Errors: `InvalidArgument` naming a dump that is
/// not JSON or not a flight-recorder dump.
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
        let nranks = rs.iter().map(|r| r.nranks).max().unwrap_or(0);
        out += &format!("communicator {comm}: {nranks} ranks, dumps from {}\n", rs.len());
        let missing: Vec<String> = (0..nranks)
            .filter(|q| !rs.iter().any(|r| r.rank == *q))
            .map(|q| q.to_string())
            .collect();
        if !missing.is_empty() {
            out += &format!("  no dump from rank(s) {}\n", missing.join(", "));
        }
        let most = rs.iter().map(|r| r.issued).max().unwrap_or(0);
        let ahead: Vec<&&RankDump> = rs.iter().filter(|r| r.issued == most).collect();
        for r in rs.iter().filter(|r| r.issued < most) {
            let next = r.issued + 1;
            let what = ahead
                .iter()
                .find_map(|a| a.calls.iter().find(|c| c.0 == next))
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
                .filter_map(|r| r.calls.iter().find(|c| c.0 == s).map(|c| (r.rank, c.2.as_str())))
                .collect();
            if sigs.iter().any(|(_, g)| *g != sigs[0].1) {
                let list: Vec<String> = sigs.iter().map(|(q, g)| format!("rank {q} {g}")).collect();
                out += &format!("  call #{s}: ranks disagree: {}\n", list.join(", "));
            }
        }
        for r in &rs {
            if let Some(e) = &r.error {
                out += &format!("  rank {} timed out: {e}\n", r.rank);
                for p in &r.progress {
                    out += &format!("    {p}\n");
                }
            }
        }
        if missing.is_empty() && rs.iter().all(|r| r.issued == most && r.error.is_none()) && !out.contains("disagree") {
            out += &format!("  every rank issued {most} calls; they agree on every recorded call\n");
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
            "communicator 0000abcd: 3 ranks, dumps from 2\n  no dump from rank(s) 2\n"
        );
        let e = analyze(&[("x.json".into(), "{}".into())]).unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: x.json: not a flight-recorder dump (calls)");
        let e = analyze(&[("y.json".into(), "not json".into())]).unwrap_err();
        assert!(e.to_string().starts_with("invalid argument: y.json: not a flight-recorder dump (not JSON: "), "{e}");
    }

    #[test]
    fn the_recorder_keeps_the_last_calls() {
        let mut rec = Recorder::new(2);
        for seq in 1..=3 {
            rec.push(&timeout::CallRecord {
                seq,
                func: Func::AllReduce,
                count: 4,
                dtype: DataType::F32,
                op: DevRedOp::Sum,
                root: 0,
                choice: None,
            });
        }
        let d = rec.dump(0xab, 1, 2, 3, None, Vec::new());
        let seqs: Vec<u64> = d["calls"].as_array().unwrap().iter().map(|c| c["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, vec![2, 3]);
        assert_eq!(d["comm"], "000000ab");
        assert!(Recorder::new(0).dump(1, 0, 1, 0, None, Vec::new())["calls"].as_array().unwrap().is_empty());
    }
}
