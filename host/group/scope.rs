//! A group with its borrows checked by the compiler (NCCL's `ncclGroupStart` … `ncclGroupEnd` as
//! a C program sees it): [`scope`] runs a closure inside a group and hands it a [`GroupScope`],
//! whose calls are checked at the call and queued in the thread's group — with any call made on
//! a communicator directly inside the closure, in the order issued — and launched when the
//! closure returns: the group's sends and receives planned first, then its collectives launched,
//! each communicator's in the order issued, consecutive LL ones of one kernel entry sharing a
//! launch ([`super::launch_collectives`]), then the sends and receives (NCCL schedules a group's
//! collectives before its point-to-point work). So a group that cannot be launched (more blocks
//! than a launch holds) runs none of its work, collectives included, and a call refused inside
//! the group — through the scope or directly — fails the whole group, as in NCCL.
//!
//! Deferring a call past its return needs its communicator, buffers and stream to stay alive
//! until the group's end: the scope borrows them for its whole length (`'s`), as
//! `std::thread::scope` does for the data of its threads, so the compiler checks it. The plain
//! [`group_start`](super::group_start)/[`group_end`](super::group_end) pair keeps them alive at
//! run time instead (a handle on the communicator, the stream's handle, the buffers' ranges
//! held: `held.rs`), and raw addresses stay the caller's to keep valid.
use super::{abandon_end, group_start};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mem::{DevSlice, Stream};
use crate::redop::ReduceOp;
use oxccl_gpu::abi::{DataType, Func, RedOp};
use std::cell::RefCell;
use std::marker::PhantomData;

/// The calls of one [`scope`]: collectives (deferred to its end) and sends and receives and the
/// calls built from them — all-to-all, gather, scatter and their V-forms — (queued in the
/// thread's group), each borrowing its communicator, buffers and stream for `'s`.
/// (`Comm::reduce_scatter_v`, built from one Reduce per rank, is not offered.)
pub struct GroupScope<'s> {
    /// The first call refused in the scope: the group then runs none of its work.
    refused: RefCell<Option<crate::Error>>,
    /// Invariant in `'s`, so the closure cannot hand the scope shorter-lived borrows.
    _borrows: PhantomData<&'s mut &'s ()>,
}

/// Runs `f` inside a group in which collectives are deferred as NCCL defers them (module docs)
/// and ends the group when `f` returns.
///
/// ```
/// # use oxccl::{Comm, DataType, Device, RedOp};
/// let comms = Comm::init_all(&Device::cpus(2))?;
/// let streams = [comms[0].device().new_stream()?, comms[1].device().new_stream()?];
/// let bufs = [comms[0].device().alloc(64)?, comms[1].device().alloc(64)?];
/// // One thread issues both ranks' calls; they launch together when the closure returns.
/// oxccl::group::scope(|g| {
///     for r in 0..2 {
///         g.all_reduce(&comms[r], &bufs[r], &bufs[r], 16, DataType::F32, RedOp::Sum, &streams[r])?;
///     }
///     Ok::<(), oxccl::Error>(())
/// })??;
/// # Ok::<(), oxccl::Error>(())
/// ```
///
/// A buffer that would not outlive the group's end is refused by the compiler:
///
/// ```compile_fail,E0597
/// # use oxccl::{Comm, DataType, Device, RedOp};
/// # let comms = Comm::init_all(&Device::cpus(1))?;
/// # let s = comms[0].device().new_stream()?;
/// oxccl::group::scope(|g| {
///     let buf = comms[0].device().alloc(64)?; // dropped before the scope's end
///     g.all_reduce(&comms[0], &buf, &buf, 16, DataType::F32, RedOp::Sum, &s)
/// })?;
/// # Ok::<(), oxccl::Error>(())
/// ```
///
/// Details: `f`'s result when the group's end succeeds. Errors: the first call refused inside
/// the scope (nothing of the group runs then), else the group end's
/// ([`group_end`](super::group_end): too many blocks for a launch, a send to itself without its
/// receive…; nothing runs) or the first launch error. `InvalidUsage` when this thread already
/// has a group open (its end would launch the scope's sends and receives after the scope's
/// borrows end), and when `f` leaves `group_start`/`group_end` calls of its own unbalanced
/// (the scope's collectives and whatever is still queued do not run then). A panic in `f` ends
/// the group with nothing of it run.
pub fn scope<'s, R>(f: impl FnOnce(&GroupScope<'s>) -> R) -> Result<R> {
    let depth = super::group_depth();
    if depth > 0 {
        return Err(Error::InvalidUsage(format!(
            "oxccl::group::scope inside an open group (group depth {depth} on this thread): the group's end \
             would launch the scope's sends and receives after its borrows end; end the group first"
        )));
    }
    let s = GroupScope {
        refused: RefCell::new(None),
        _borrows: PhantomData,
    };
    group_start()?;
    // Ends the group, nothing of it run, even when `f` unwinds.
    struct Open(bool);
    impl Drop for Open {
        fn drop(&mut self) {
            if self.0 {
                abandon_all();
            }
        }
    }
    let mut open = Open(true);
    let r = f(&s);
    open.0 = false;
    let depth = super::group_depth();
    if depth != 1 {
        abandon_all();
        return Err(Error::InvalidUsage(format!(
            "group_start and group_end inside oxccl::group::scope must be balanced (the scope's group was at \
             depth {depth} when its closure returned, not 1): the scope's collectives and what was still \
             queued did not run"
        )));
    }
    // A call refused through the scope, or one made on a communicator directly inside it.
    if let Some(e) = s.refused.take().or_else(super::take_refused) {
        abandon_end()?;
        return Err(e);
    }
    super::group_end().map(|()| r)
}

/// Ends every open group level of this thread with nothing of its work run.
fn abandon_all() {
    while super::group_depth() > 0 {
        if abandon_end().is_err() {
            break;
        }
    }
}


impl<'s> GroupScope<'s> {
    /// Checks a collective now and defers its launch: `func` on `comm` with the safe entry
    /// points' buffers (`None` where a rank may omit one).
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        comm: &'s Comm,
        func: Func,
        send: Option<DevSlice<'s>>,
        recv: Option<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        op: ReduceOp<'s>,
        root: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        // Inside the scope's group: checked now and queued in the thread's group with the calls
        // made on the communicators directly, in the order issued.
        self.noting(comm.safe_call(func, send, recv, count, dtype, op, root, stream))
    }

    /// `r`, its error also the scope's when it is the first refused call.
    fn noting<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.refused.borrow_mut().get_or_insert_with(|| e.clone());
        }
        r
    }

    /// [`Comm::all_reduce`], launched at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'s>>,
        stream: &'s Stream,
    ) -> Result<()> {
        let (send, recv) = (Some(send.into()), Some(recv.into()));
        self.collective(
            comm,
            Func::AllReduce,
            send,
            recv,
            count,
            dtype,
            op.into(),
            0,
            stream,
        )
    }

    /// [`Comm::broadcast`], launched at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn broadcast(
        &self,
        comm: &'s Comm,
        send: Option<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        let op = ReduceOp::from(RedOp::Sum);
        self.collective(
            comm,
            Func::Broadcast,
            send,
            Some(recv.into()),
            count,
            dtype,
            op,
            root,
            stream,
        )
    }

    /// [`Comm::reduce`], launched at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: Option<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'s>>,
        root: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        let send = Some(send.into());
        self.collective(
            comm,
            Func::Reduce,
            send,
            recv,
            count,
            dtype,
            op.into(),
            root,
            stream,
        )
    }

    /// [`Comm::all_gather`] (`count` elements per rank), launched at the scope's end.
    pub fn all_gather(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        stream: &'s Stream,
    ) -> Result<()> {
        let (send, recv) = (Some(send.into()), Some(recv.into()));
        let op = ReduceOp::from(RedOp::Sum);
        self.collective(comm, Func::AllGather, send, recv, count, dtype, op, 0, stream)
    }

    /// [`Comm::reduce_scatter`] (`count` elements per rank's output), launched at the scope's
    /// end.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        op: impl Into<ReduceOp<'s>>,
        stream: &'s Stream,
    ) -> Result<()> {
        let (send, recv) = (Some(send.into()), Some(recv.into()));
        self.collective(
            comm,
            Func::ReduceScatter,
            send,
            recv,
            count,
            dtype,
            op.into(),
            0,
            stream,
        )
    }

    /// [`Comm::send`], launched with the group's other sends and receives at the scope's end.
    pub fn send(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.send(send, count, dtype, peer, stream))
    }

    /// [`Comm::recv`], launched with the group's other sends and receives at the scope's end.
    pub fn recv(
        &self,
        comm: &'s Comm,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.recv(recv, count, dtype, peer, stream))
    }

    /// [`Comm::all_to_all`] (`count` elements to and from each rank), its sends and receives
    /// launched with the group's others at the scope's end.
    pub fn all_to_all(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.all_to_all(send, recv, count, dtype, stream))
    }

    /// [`Comm::all_to_all_v`] (per-peer counts and displacements, in elements), its sends and
    /// receives launched with the group's others at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all_v(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        send_counts: &[usize],
        send_displs: &[usize],
        recv: impl Into<DevSlice<'s>>,
        recv_counts: &[usize],
        recv_displs: &[usize],
        dtype: DataType,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.all_to_all_v(
            send,
            send_counts,
            send_displs,
            recv,
            recv_counts,
            recv_displs,
            dtype,
            stream,
        ))
    }

    /// [`Comm::all_gather_v`] (per-rank counts and displacements, in elements), its sends and
    /// receives launched with the group's others at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn all_gather_v(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        counts: &[usize],
        displs: &[usize],
        dtype: DataType,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.all_gather_v(send, recv, counts, displs, dtype, stream))
    }

    /// [`Comm::gather`] (`count` elements from each rank to `root`), its sends and receives
    /// launched with the group's others at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        &self,
        comm: &'s Comm,
        send: impl Into<DevSlice<'s>>,
        recv: Option<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.gather(send, recv, count, dtype, root, stream))
    }

    /// [`Comm::scatter`] (`count` elements from `root` to each rank), its sends and receives
    /// launched with the group's others at the scope's end.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter(
        &self,
        comm: &'s Comm,
        send: Option<DevSlice<'s>>,
        recv: impl Into<DevSlice<'s>>,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &'s Stream,
    ) -> Result<()> {
        self.noting(comm.scatter(send, recv, count, dtype, root, stream))
    }
}
