//! The collective calls and their argument checks (NCCL's `collectives.cc` and `argcheck.cc`):
//! AllReduce, Broadcast, Reduce, AllGather and ReduceScatter on checked buffers or raw
//! addresses, and the plan a call would get ([`Comm::choice_for`], [`Comm::last_choice`]).
//! Planning and launching are in `enqueue.rs`.
use super::*;

impl Comm {
    /// The plan of the most recent collective call on this communicator.
    pub fn last_choice(&self) -> Option<Choice> {
        self.last.lock().ok().and_then(|g| *g)
    }

    /// The plan a call of `func` over `count` elements of `dtype` (the count argument of that
    /// call: per rank for AllGather/ReduceScatter) would get now, without running it: algorithm,
    /// protocol, channels, chunk and slice as [`Comm::last_choice`] reports after the call. `None`
    /// when no protocol would run (`count == 0`, or one rank, where every collective is a copy).
    /// Errors: as the call's own checks of `count` and of `NCCL_PROTO`/`NCCL_ALGO`.
    pub fn choice_for(&self, func: Func, count: usize, dtype: DataType) -> Result<Option<Choice>> {
        let (_, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        if count == 0 || self.nranks == 1 {
            return Ok(None);
        }
        let esize = dtype.size() as u64;
        self.plan(func, self.call_bytes(func, count, recv_bytes, esize), esize)
            .map(Some)
    }

    /// The tuning model's time of a call of `func` over `count` elements of `dtype` as
    /// [`Comm::choice_for`] plans it, in microseconds (NCCL's estimate of a call, reported by
    /// `ncclGroupSimulateEnd` as `estimatedTime`). 0 when no protocol would run (`count == 0`, or
    /// one rank). A model, not a measurement: `oxccl perf` measures. Errors: as
    /// [`Comm::choice_for`].
    pub fn predict_us(&self, func: Func, count: usize, dtype: DataType) -> Result<f64> {
        let Some(c) = self.choice_for(func, count, dtype)? else {
            return Ok(0.0);
        };
        let (_, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        let bytes = self.call_bytes(func, count, recv_bytes, dtype.size() as u64);
        let model = crate::tuning::Model::for_fabric(self.fabric);
        Ok(match (c.algo, self.trees) {
            (Algo::Tree, Some(t)) => model.predict_tree_us(c.proto, t.shape, c.nchannels, bytes),
            _ => model.predict_us(func, c.proto, self.nranks, c.nchannels, bytes),
        })
    }

    /// The size the tuning model sees for a call (nccl-tests' size: the larger of the per-rank
    /// send and receive buffers, times the rank count for AllGather/ReduceScatter), bytes.
    pub(super) fn call_bytes(&self, func: Func, count: usize, recv_bytes: u64, esize: u64) -> u64 {
        let per_rank = recv_bytes.max(count as u64 * esize);
        match func {
            Func::AllGather | Func::ReduceScatter => per_rank * self.nranks as u64,
            _ => per_rank,
        }
    }

    /// Reduces (`op`) `count` elements of `dtype` across all ranks; every rank gets the result in
    /// `recv` (NCCL's `ncclAllReduce`). `send` and `recv` hold at least `count × dtype.size()` bytes
    /// on this rank's device and may be the same range (in place) but must not partly overlap.
    /// Queued on `stream` (on this rank's device); returns at once. Results are bitwise identical on
    /// every rank. `count == 0` is a no-op. `op` is a [`RedOp`] or a [`ReduceOp`] (PreMulSum, whose
    /// scalar must have `dtype`'s type: otherwise InvalidArgument). Buffers must be aligned to the
    /// element size.
    pub fn all_reduce<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::AllReduce,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            op.into(),
            0,
            stream,
        )
    }

    /// Copies `count` elements of `dtype` from `send` on rank `root` to `recv` on every rank
    /// (NCCL's `ncclBroadcast`). `send` is read on the root only (others may pass `None`); on the
    /// root it may equal `recv` (in place). Errors: `root` outside `0..nranks`, `None` on the root,
    /// buffers shorter than `count` elements.
    pub fn broadcast<'a>(
        &self,
        send: Option<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::Broadcast,
            send,
            Some(recv.into()),
            count,
            dtype,
            RedOp::Sum.into(),
            root,
            stream,
        )
    }

    /// Reduces (`op`) `count` elements of `dtype` across all ranks into `recv` on rank `root`
    /// (NCCL's `ncclReduce`). `recv` is written on the root only (others may pass `None` and are
    /// never written). Errors as for [`Comm::broadcast`]; `op` as for [`Comm::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: Option<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::Reduce,
            Some(send.into()),
            recv,
            count,
            dtype,
            op.into(),
            root,
            stream,
        )
    }

    /// Gathers `count` elements from every rank into `recv` (`nranks × count` elements, rank `r`'s
    /// block at `r × count`) on every rank (NCCL's `ncclAllGather`). In place when `send` is exactly
    /// `recv`'s block of this rank; any other overlap is an error.
    pub fn all_gather<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::AllGather,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            RedOp::Sum.into(),
            0,
            stream,
        )
    }

    /// Reduces (`op`) `nranks × count` elements of `dtype` across ranks and leaves block `r` (the
    /// `count` elements at `r × count`) in `recv` on rank `r` (NCCL's `ncclReduceScatter`). In place
    /// when `recv` is exactly this rank's block of `send`; any other overlap is an error. `op` as for
    /// [`Comm::all_reduce`].
    pub fn reduce_scatter<'a>(
        &self,
        send: impl Into<DevSlice<'a>>,
        recv: impl Into<DevSlice<'a>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        stream: &Stream,
    ) -> Result<()> {
        self.safe_call(
            Func::ReduceScatter,
            Some(send.into()),
            Some(recv.into()),
            count,
            dtype,
            op.into(),
            0,
            stream,
        )
    }

    /// Byte sizes (send, recv) a rank's buffers need for `func` with per-call `count`.
    pub(super) fn buffer_bytes(&self, func: Func, count: usize, dtype: DataType) -> Result<(u64, u64)> {
        let b = self.check_bytes(count, dtype)?;
        let all = b
            .checked_mul(self.nranks as u64)
            .ok_or_else(|| Error::invalid(format!("count {count} × {} ranks overflows", self.nranks)))?;
        Ok(match func {
            Func::AllGather => (b, all),
            Func::ReduceScatter => (all, b),
            _ => (b, b),
        })
    }

    /// Argument checks shared by the safe entry points, then [`Comm::collective_raw`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn safe_call(
        &self,
        func: Func,
        send: Option<DevSlice<'_>>,
        recv: Option<DevSlice<'_>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp<'_>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (sa, ra) = crate::group::noted(self.checked_buffers(func, send, recv, count, dtype, root))?;
        // SAFETY: every range used was checked against its buffer.
        unsafe { self.collective_raw(func, sa, ra, count, dtype, op, root, stream) }
    }

    /// The buffer checks of the safe entry points (root, device, alignment, sizes, overlap):
    /// the addresses of `send` and `recv` as [`Comm::collective_raw`] takes them (0 for a
    /// buffer the rank does not use).
    pub(crate) fn checked_buffers(
        &self,
        func: Func,
        send: Option<DevSlice<'_>>,
        recv: Option<DevSlice<'_>>,
        count: usize,
        dtype: DataType,
        root: usize,
    ) -> Result<(u64, u64)> {
        self.check_root(func, root)?;
        let (send_bytes, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        let is_root = self.rank == root;
        let send_needed = !(func == Func::Broadcast && !is_root);
        let recv_needed = !(func == Func::Reduce && !is_root);
        for (name, s, need, bytes) in [
            ("sendbuff", &send, send_needed, send_bytes),
            ("recvbuff", &recv, recv_needed, recv_bytes),
        ] {
            match s {
                None if need && count > 0 => {
                    return Err(Error::invalid(format!(
                        "{name} is missing on rank {} ({} needs it{})",
                        self.rank,
                        func,
                        if func == Func::Broadcast || func == Func::Reduce {
                            " on the root"
                        } else {
                            ""
                        }
                    )));
                }
                None => {}
                Some(s) => {
                    if s.device() != self.device {
                        return Err(Error::invalid(format!(
                            "{name} is on {:?} but rank {} is on {:?}",
                            s.device(),
                            self.rank,
                            self.device
                        )));
                    }
                    if need && s.addr() % dtype.size() as u64 != 0 {
                        return Err(Error::invalid(format!(
                            "{name} at {:#x} on rank {} is not aligned to the {}-byte size of {}",
                            s.addr(),
                            self.rank,
                            dtype.size(),
                            dtype.name()
                        )));
                    }
                    if need && (s.len() as u64) < bytes {
                        return Err(Error::invalid(format!(
                            "{name} holds {} bytes but {} of count {count} × {} ({} bytes each) needs {bytes} on rank {}",
                            s.len(),
                            func,
                            dtype.name(),
                            dtype.size(),
                            self.rank
                        )));
                    }
                }
            }
        }
        let sa = send.filter(|_| send_needed).map_or(0, |s| s.addr());
        let ra = recv.filter(|_| recv_needed).map_or(0, |s| s.addr());
        if sa != 0 && ra != 0 && count > 0 {
            let in_place_at = match func {
                Func::AllGather => (sa == ra + self.rank as u64 * send_bytes).then_some(()),
                Func::ReduceScatter => (ra == sa + self.rank as u64 * recv_bytes).then_some(()),
                _ => (sa == ra).then_some(()),
            };
            let overlap = sa < ra + recv_bytes && ra < sa + send_bytes;
            if overlap && in_place_at.is_none() {
                // Not NCCL's in-place form (e.g. a ReduceScatter with recvbuff == sendbuff on a
                // rank other than 0): the output would overwrite input still to be read. Refused
                // (case C05). Staging the input in a copy instead would need a stream-ordered
                // allocation, which can wait for the device while a peer's kernel on the same GPU
                // spins for this rank.
                return Err(Error::invalid(format!(
                    "sendbuff and recvbuff of {func} partly overlap on rank {}: in place means {}; otherwise they must be disjoint",
                    self.rank,
                    match func {
                        Func::AllGather => "sendbuff == recvbuff + rank × count elements",
                        Func::ReduceScatter => "recvbuff == sendbuff + rank × count elements",
                        _ => "sendbuff == recvbuff",
                    }
                )));
            }
        }
        Ok((sa, ra))
    }

    pub(super) fn check_root(&self, func: Func, root: usize) -> Result<()> {
        if matches!(func, Func::Broadcast | Func::Reduce) && root >= self.nranks {
            return Err(Error::invalid(format!(
                "root {root} is out of range for {func} (accepted: 0..={})",
                self.nranks - 1
            )));
        }
        Ok(())
    }

    /// [`Comm::all_reduce`] on raw addresses (a `CUdeviceptr`, or a host address on the CPU
    /// target), for interoperability with other CUDA code.
    ///
    /// # Safety
    /// `send` and `recv` are valid for `count × dtype.size()` bytes on this rank's device until the
    /// operation completes on `stream`, and are equal or disjoint.
    pub unsafe fn all_reduce_raw<'a>(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        stream: &Stream,
    ) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.collective_raw(Func::AllReduce, send, recv, count, dtype, op, 0, stream) }
    }

    /// Any collective on raw addresses: `func`'s buffers as in the safe entry points, 0 for a buffer
    /// NCCL lets a rank omit (Broadcast's non-root send, Reduce's non-root recv).
    ///
    /// # Safety
    /// The buffers are valid on this rank's device for the sizes `func` needs with `count` until
    /// the operation completes on `stream`, and overlap only as the in-place forms allow.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn collective_raw<'a>(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'a>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let op = op.into();
        if crate::group::group_depth() > 0 {
            // Inside a group: checked now, queued until its outermost end (where it is planned,
            // and the stream's capture looked at), holding its buffers.
            let (_, _, _, recv_bytes, _) = crate::group::noted(self.checked_call(
                func,
                send,
                recv,
                count,
                dtype,
                &op,
                root,
                stream,
                Capture::AtLaunch,
            ))?;
            let (send_bytes, _) = self.buffer_bytes(func, count, dtype)?;
            // The buffers, and a device-resident PreMulSum scalar (none: NULL, not held).
            let mut ranges = [(send, send_bytes), (recv, recv_bytes), (0, 0)];
            let op = match op {
                ReduceOp::PreMulSumDevice(s) => {
                    ranges[2] = (s.addr(), dtype.size() as u64);
                    // SAFETY: checked by `checked_call` (this device, one element); the group
                    // holds it until its end has queued the call, the caller's contract after.
                    ReduceOp::PreMulSumDevice(unsafe { DevSlice::from_raw(s.addr(), s.len(), s.device()) })
                }
                ReduceOp::Builtin(b) => ReduceOp::Builtin(b),
                ReduceOp::PreMulSum(x) => ReduceOp::PreMulSum(x),
            };
            let queued = crate::group::QueuedColl {
                comm: self.handle(),
                func,
                send,
                recv,
                count,
                dtype,
                op,
                root,
                stream: stream.handle(),
            };
            let Some(_) = crate::group::defer_collective(queued, &ranges) else {
                tracing::debug!(target: "oxccl::coll", rank = self.rank, %func, count, %dtype, "queued in the group");
                return Ok(());
            };
        }
        let (dev_op, redop_arg, redop_flags, recv_bytes, captured) =
            self.checked_call(func, send, recv, count, dtype, &op, root, stream, Capture::Now)?;
        // The call as the flight recorder keeps it (numbered by `Watch::begin`).
        let record = |choice: Option<Choice>| timeout::CallRecord {
            seq: 0,
            func,
            count,
            dtype,
            op: dev_op,
            root,
            choice,
        };
        if count == 0 {
            // Nothing moves; with the call-signature check on, the ranks still compare the call.
            // The flight recorder numbers it as the check does (every collective call).
            if self.nranks == 1 {
                return Ok(());
            }
            let call = record(None);
            return match self.check_args(func, 0, dtype, dev_op, root, None, captured)? {
                Some(check) => {
                    let recorded = self.begin_call(call, captured);
                    let seq = check.sig[0];
                    let launched = self.launch_check(check, stream, captured, recorded);
                    self.watch
                        .queued(recorded.as_slice(), launched)
                        .map_err(|e| if seq != 0 { self.stop_checking(seq, e) } else { e })
                }
                None => {
                    self.record_empty_call(call);
                    Ok(())
                }
            };
        }
        if self.nranks == 1 && dev_op == DevRedOp::PreMulSum {
            // One rank's PreMulSum scales the input: the kernel's one-rank path (NCCL's
            // `ncclLaunchOneRank`), on every channel.
            let work = WorkColl {
                sendbuff: send,
                recvbuff: recv,
                count: count as u64,
                redop_arg,
                func: func as u8,
                redop: dev_op as u8,
                redop_flags,
                dtype: dtype as u8,
                algo: Algo::Ring as u8,
                proto: Proto::Simple as u8,
                nchannels: self.nchannels.clamp(1, u16::MAX as u32) as u16,
                ..WorkColl::zeroed()
            };
            tracing::debug!(target: "oxccl::coll", rank = self.rank, %func, count, %dtype, %op, "enqueue (one rank)");
            return self.launch(
                KernelArgs {
                    comm: self.dev_comm,
                    work,
                    nworks: 1,
                    ..KernelArgs::zeroed()
                },
                stream,
                captured,
                &[],
            );
        }
        if self.nranks == 1 {
            // One rank: every collective is a copy of the input (Sum, Prod, Min, Max and Avg of one
            // value are that value).
            return if send == recv {
                Ok(())
            } else {
                self.copy(recv, send, recv_bytes as usize, stream)
            };
        }
        let planned = self.plan_work(func, send, recv, count, dtype, (dev_op, redop_arg, redop_flags), root, recv_bytes)?;
        self.launch_one(planned, captured, stream)
    }

    /// The checks [`Comm::collective_raw`] makes before it queues anything — arguments, stream,
    /// the communicator's state; with [`Capture::AtLaunch`] (a call queued in a group) all but
    /// the stream's capture state, which the launch reads (as NCCL's group end does). Returns
    /// the kernel's operator, its scalar operand and flags
    /// ([`Comm::check_op`]), the receive buffer's bytes and whether the stream is capturing
    /// (with [`Capture::Now`]; `false` with [`Capture::AtLaunch`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn checked_call(
        &self,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: &ReduceOp<'_>,
        root: usize,
        stream: &Stream,
        capture: Capture,
    ) -> Result<(DevRedOp, u64, u8, u64, bool)> {
        self.check_root(func, root)?;
        let (_, recv_bytes) = self.buffer_bytes(func, count, dtype)?;
        if count > 0 {
            // The buffers NCCL lets a rank omit are Broadcast's send and Reduce's receive buffer
            // on non-root ranks; any other NULL would be dereferenced by the kernel.
            let is_root = self.rank == root;
            for (name, addr, optional) in [
                ("sendbuff", send, func == Func::Broadcast && !is_root),
                ("recvbuff", recv, func == Func::Reduce && !is_root),
            ] {
                if addr == 0 && !optional {
                    return Err(Error::invalid(format!(
                        "{name} is NULL on rank {} ({func} of {count} elements needs it{})",
                        self.rank,
                        if matches!(func, Func::Broadcast | Func::Reduce) {
                            " on the root"
                        } else {
                            ""
                        }
                    )));
                }
            }
        }
        let (dev_op, redop_arg, redop_flags) = self.check_op(func, op, dtype)?;
        let captured = match capture {
            Capture::Now => self.check_stream(stream)?,
            Capture::AtLaunch => {
                self.check_stream_device(stream)?;
                false
            }
        };
        self.check_not_revoked(func.name())?;
        if let Some(e) = self.stopped_error() {
            return Err(e);
        }
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was finalized; only destroy is allowed after finalize",
                self.rank
            )));
        }
        Ok((dev_op, redop_arg, redop_flags, recv_bytes, captured))
    }

    /// The kernel's operator and scalar operand (`WorkColl::redop_arg`, `redop_flags`) for `op` on
    /// a `func` call of `dtype`; Broadcast and AllGather reduce nothing and ignore `op`. A
    /// PreMulSum scalar must have the call's type (case C07); a device-resident one must lie on
    /// this rank's device, hold one element and be aligned to its size.
    pub(super) fn check_op(&self, func: Func, op: &ReduceOp<'_>, dtype: DataType) -> Result<(DevRedOp, u64, u8)> {
        if matches!(func, Func::Broadcast | Func::AllGather) {
            return Ok((DevRedOp::Sum, 0, 0));
        }
        check_fp8_reduction(func, dtype, self.min_compute_capability())?;
        match op {
            // NCCL runs a float Avg as PreMulSum by 1/nranks; for fp8 the sum followed by one
            // division would saturate at the type's largest value on the way (8 ranks of 100 in
            // E4M3 sum past 448), so each input is scaled first, by 1/nranks in the call's type.
            ReduceOp::Builtin(RedOp::Avg) if dtype.is_fp8() => {
                let s = crate::redop::Scalar::from_f64(1.0 / self.nranks as f64, dtype);
                Ok((DevRedOp::PreMulSum, s.to_bits(), 0))
            }
            ReduceOp::Builtin(o) => Ok(((*o).into(), 0, 0)),
            ReduceOp::PreMulSum(s) => {
                if s.dtype() != dtype {
                    return Err(Error::invalid(format!(
                        "the PreMulSum scalar is {} but {func} runs on {}: the scalar must have the call's dtype",
                        s.dtype().name(),
                        dtype.name()
                    )));
                }
                Ok((DevRedOp::PreMulSum, s.to_bits(), 0))
            }
            ReduceOp::PreMulSumDevice(s) => {
                if s.device() != self.device {
                    return Err(Error::invalid(format!(
                        "the PreMulSum scalar is on {:?} but rank {} is on {:?}",
                        s.device(),
                        self.rank,
                        self.device
                    )));
                }
                let size = dtype.size();
                if s.len() < size || s.addr() % size as u64 != 0 {
                    return Err(Error::invalid(format!(
                        "the device-resident PreMulSum scalar ({} bytes at {:#x}) must hold one {} ({size} bytes) aligned to {size} bytes",
                        s.len(),
                        s.addr(),
                        dtype.name()
                    )));
                }
                Ok((DevRedOp::PreMulSum, s.addr(), REDOP_SCALAR_DEVICE))
            }
        }
    }

    /// The oldest compute capability (× 10) among the communicator's GPUs (NCCL's
    /// `minCompCap`); `None` on the CPU target.
    pub(super) fn min_compute_capability(&self) -> Option<u32> {
        let peers = &self.init_rank_res().peers;
        peers.iter().all(|p| p.cuda).then(|| peers.iter().map(|p| p.cc).min().unwrap_or(0))
    }

    pub(super) fn check_bytes(&self, count: usize, dtype: DataType) -> Result<u64> {
        (count as u64)
            .checked_mul(dtype.size() as u64)
            .filter(|b| *b <= i64::MAX as u64)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "count {count} of {} overflows the byte size",
                    dtype.name()
                ))
            })
    }

    /// The stream is on this rank's device; returns whether it is capturing into a CUDA graph
    /// ([`Stream::begin_capture`]). A call on a capturing stream becomes part of the graph: its
    /// kernel, with the call's arguments, runs at each launch of the graph, continuing its
    /// connections' FIFO steps from where the previous kernel left them, as every kernel does
    /// (over NET the proxy thread moves whatever steps it finds, nothing is posted per call).
    pub(super) fn check_stream(&self, stream: &Stream) -> Result<bool> {
        self.check_stream_device(stream)?;
        stream.is_capturing()
    }

    /// That `stream` is on this rank's device.
    fn check_stream_device(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device {
            return Err(Error::invalid(format!(
                "stream is on {:?} but rank {} is on {:?}",
                stream.device(),
                self.rank,
                self.device
            )));
        }
        Ok(())
    }
}

/// When [`Comm::checked_call`] reads the stream's capture state (a driver call on GPUs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Capture {
    /// Now: the call is launched next.
    Now,
    /// Not now: the call is checked for a later launch (a group's end), which reads it.
    AtLaunch,
}

/// NCCL's rule for the fp8 types: a reduction (AllReduce, Reduce, ReduceScatter) of
/// [`DataType::F8E4M3`] or [`DataType::F8E5M2`] needs every GPU of the communicator at compute
/// capability 9.0 or newer (`min_cc`, × 10; `None`, the CPU target, reduces them everywhere).
/// The same answer on every rank, so every rank fails alike.
pub(super) fn check_fp8_reduction(func: Func, dtype: DataType, min_cc: Option<u32>) -> Result<()> {
    match min_cc {
        Some(cc) if dtype.is_fp8() && cc < 90 => Err(Error::invalid(format!(
            "{func} of {} needs compute capability 9.0 or newer for fp8 reductions (as NCCL), but this \
             communicator's oldest GPU is sm_{cc}; Broadcast, AllGather and point-to-point move fp8 on any GPU",
            dtype.name()
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_reductions_need_sm90_as_in_nccl() {
        let e = check_fp8_reduction(Func::AllReduce, DataType::F8E4M3, Some(80)).unwrap_err();
        assert_eq!(e.code(), crate::ResultCode::InvalidArgument);
        let msg = e.to_string();
        assert!(msg.contains("AllReduce of f8e4m3") || msg.contains("allreduce of f8e4m3"), "{msg}");
        assert!(msg.contains("compute capability 9.0") && msg.contains("sm_80"), "{msg}");
        assert!(check_fp8_reduction(Func::ReduceScatter, DataType::F8E5M2, Some(89)).is_err());
        assert!(check_fp8_reduction(Func::Reduce, DataType::F8E5M2, Some(90)).is_ok());
        assert!(check_fp8_reduction(Func::AllReduce, DataType::F8E4M3, None).is_ok());
        assert!(check_fp8_reduction(Func::AllReduce, DataType::Bf16, Some(70)).is_ok());
    }
}
