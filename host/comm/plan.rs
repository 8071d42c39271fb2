//! A collective's kernel work, planned but not launched, and the launch of one or several of
//! them as one kernel (NCCL's `ncclKernelPlan` and its work batch, `scheduleCollTasksToPlan`):
//! a group's consecutive collectives of one communicator and stream that run on the same kernel
//! entry share a launch, every block running their works in order
//! ([`oxccl_gpu::dispatch::run_kernel`]), so a group of many small collectives costs one
//! launch instead of one each.
use super::*;

/// A collective checked and planned, waiting for its launch (NCCL's scheduled task).
pub(crate) struct PlannedColl {
    work: WorkColl,
    /// The call as the flight recorder keeps it.
    record: timeout::CallRecord,
}

/// A call of count 0 (unchecked): it moves nothing and is only recorded, in its place among
/// the calls ([`Comm::record_empty`]).
pub(crate) struct EmptyCall(timeout::CallRecord);

/// A collective call of a batching communicator ([`Comm::batches_collectives`]) once checked.
pub(crate) enum Planned {
    Empty(EmptyCall),
    /// A kernel work to launch ([`Comm::launch_batch`]).
    Work(PlannedColl),
}

impl PlannedColl {
    /// Whether `other` may share a launch with this one: both run on the same kernel entry
    /// (collective, algorithm, protocol and the entry's type and operator,
    /// [`oxccl_gpu::abi::kernel_variant`]) and its protocol's launches carry several works
    /// ([`oxccl_gpu::abi::proto_batches`]: LL only).
    pub(crate) fn shares_launch_with(&self, other: &PlannedColl) -> bool {
        let entry = |w: &WorkColl| {
            w.entry_key()
                .map(|(f, a, p, d, o)| (f, a, p, oxccl_gpu::abi::kernel_variant(f, d, o)))
        };
        let mine = entry(&self.work);
        mine.is_some_and(|(_, _, proto, _)| oxccl_gpu::abi::proto_batches(proto)) && mine == entry(&other.work)
    }
}

impl Comm {
    /// Whether this communicator's collectives may share launches: more than one rank (one
    /// rank's calls are copies) and the call check off (a checked launch checks one call).
    pub(crate) fn batches_collectives(&self) -> bool {
        self.nranks > 1 && self.call_check.is_none()
    }

    /// Checks a collective as [`Comm::collective_raw`] does and plans its work, queuing nothing:
    /// for a group's end, which launches the works of a communicator's consecutive calls
    /// together ([`Comm::launch_batch`]). Only for a communicator that
    /// [batches collectives](Comm::batches_collectives). Returns also whether `stream` is
    /// capturing (a batch is of one kind).
    ///
    /// # Safety
    /// As [`Comm::collective_raw`], until the work is launched and has run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn plan_collective(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: &ReduceOp<'_>,
        root: usize,
        stream: &Stream,
    ) -> Result<(Planned, bool)> {
        if !self.batches_collectives() {
            return Err(Error::Internal(
                "planning a collective of a communicator that does not batch".into(),
            ));
        }
        let (dev_op, redop_arg, redop_flags, recv_bytes, captured) =
            self.checked_call(func, send, recv, count, dtype, op, root, stream, collectives::Capture::Now)?;
        if count == 0 {
            let record = timeout::CallRecord {
                seq: 0,
                func,
                count,
                dtype,
                op: dev_op,
                root,
                choice: None,
            };
            return Ok((Planned::Empty(EmptyCall(record)), captured));
        }
        let planned = self.plan_work(
            func,
            send,
            recv,
            count,
            dtype,
            (dev_op, redop_arg, redop_flags),
            root,
            recv_bytes,
        )?;
        Ok((Planned::Work(planned), captured))
    }

    /// The work of a checked call of more than one rank and a count above 0: its plan
    /// ([`Comm::plan`]: algorithm, protocol, channels, chunk and slice) and buffers; `op` is the
    /// kernel's operator, its scalar operand and flags ([`Comm::check_op`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn plan_work(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: (DevRedOp, u64, u8),
        root: usize,
        recv_bytes: u64,
    ) -> Result<PlannedColl> {
        let (dev_op, redop_arg, redop_flags) = op;
        let esize = dtype.size() as u64;
        let choice = self.plan(func, self.call_bytes(func, count, recv_bytes, esize), esize)?;
        let work = WorkColl {
            sendbuff: send,
            recvbuff: recv,
            count: count as u64,
            chunk_elems: choice.chunk_elems,
            slice_elems: choice.slice_elems,
            root: root as u32,
            func: func as u8,
            redop: dev_op as u8,
            redop_arg,
            redop_flags,
            dtype: dtype as u8,
            algo: choice.algo as u8,
            proto: choice.proto as u8,
            nchannels: choice.nchannels as u16,
            ..WorkColl::zeroed()
        };
        tracing::debug!(target: "oxccl::coll", rank = self.rank, %func, count, %dtype, op = dev_op.name(), root, ?choice, "enqueue");
        if let Ok(mut last) = self.last.lock() {
            *last = Some(choice);
        }
        Ok(PlannedColl {
            work,
            record: timeout::CallRecord {
                seq: 0,
                func,
                count,
                dtype,
                op: dev_op,
                root,
                choice: Some(choice),
            },
        })
    }

    /// The flight recorder's entry of a call about to be launched (the watch names it while it
    /// runs); a call captured into a CUDA graph is recorded as such and not watched (its graph's
    /// launches run it, later and as often as they are launched): `None`.
    pub(super) fn begin_call(&self, record: timeout::CallRecord, captured: bool) -> Option<u64> {
        if captured {
            self.watch.captured(record);
            None
        } else {
            Some(self.watch.begin(record))
        }
    }

    /// Records a call of count 0 that launches nothing (unchecked), in its place among the
    /// calls.
    pub(super) fn record_empty_call(&self, record: timeout::CallRecord) {
        self.watch.record_empty(record);
    }

    /// [`Comm::record_empty_call`] of a planned call.
    pub(crate) fn record_empty(&self, call: EmptyCall) {
        self.record_empty_call(call.0);
    }

    /// Launches one planned call on `stream` (`captured`: the stream is capturing), checked by
    /// the call check when it is on.
    pub(super) fn launch_one(&self, p: PlannedColl, captured: bool, stream: &Stream) -> Result<()> {
        let r = &p.record;
        let mut check = self.check_args(r.func, r.count, r.dtype, r.op, r.root, r.choice, captured)?;
        let recorded = self.begin_call(p.record, captured);
        let seq = check.map_or(0, |c| c.sig[0]);
        let launched = (|| {
            if captured && let Some(c) = check.take() {
                // A captured call has no number (its graph's launches run it): the check kernel
                // alone checks it, and the call's kernel honours that verdict.
                self.launch_check(c, stream, true, None)?;
                check = Some(oxccl_gpu::abi::CheckArgs {
                    check: c.check | oxccl_gpu::abi::CHECK_VERDICT_ONLY,
                    sig: [0; 4],
                    ..c
                });
            }
            self.launch(
                KernelArgs {
                    comm: self.dev_comm,
                    check: check.map_or(0, |c| c.check),
                    work: p.work,
                    sig: check.map_or([0; 4], |c| c.sig),
                    nworks: 1,
                    ..KernelArgs::zeroed()
                },
                stream,
                captured,
                recorded.as_slice(),
            )
        })();
        self.watch
            .queued(recorded.as_slice(), launched)
            .map_err(|e| if seq != 0 { self.stop_checking(seq, e) } else { e })
    }

    /// Launches `batch` — planned calls of this communicator for `stream`, in the order issued,
    /// each sharing a launch with the first ([`PlannedColl::shares_launch_with`]), at most
    /// [`oxccl_gpu::abi::MAX_COLL_WORKS`] — as one kernel whose blocks run their works in
    /// order; each call is recorded in the flight recorder as issued. `captured`: the stream is
    /// capturing. Errors: a batch of another shape (`Internal`), the launch's.
    pub(crate) fn launch_batch(
        &self,
        mut batch: Vec<PlannedColl>,
        captured: bool,
        stream: &Stream,
    ) -> Result<()> {
        if batch.len() == 1
            && let Some(p) = batch.pop()
        {
            return self.launch_one(p, captured, stream);
        }
        if batch.is_empty() {
            return Ok(());
        }
        if batch.len() > oxccl_gpu::abi::MAX_COLL_WORKS
            || batch.iter().any(|p| !p.shares_launch_with(&batch[0]))
            || (batch.len() > 1 && !self.batches_collectives())
        {
            return Err(Error::Internal(format!(
                "a batch of {} collectives that cannot share a launch",
                batch.len()
            )));
        }
        let mut args = KernelArgs {
            comm: self.dev_comm,
            nworks: batch.len() as u32,
            ..KernelArgs::zeroed()
        };
        let mut recorded = Vec::with_capacity(batch.len());
        for (i, p) in batch.into_iter().enumerate() {
            match i.checked_sub(1) {
                None => args.work = p.work,
                Some(j) => args.more[j] = p.work,
            }
            recorded.extend(self.begin_call(p.record, captured));
        }
        self.watch.queued(&recorded, self.launch(args, stream, captured, &recorded))
    }
}
