//! The system NCCL (`libnccl.so.2`, loaded at run time through cudarc's `nccl` module), driven in
//! the same process as oxccl so `oxccl perf --compare nccl` measures both on the same GPUs in the
//! same run. Only what the benchmarks need: `ncclCommInitAll`, the collectives, groups.
use crate::cuda;
use crate::error::{Error, Result};
use cudarc::nccl::{result, sys};
use oxccl_gpu::abi::{DataType, Func, RedOp};
use std::ffi::c_void;

/// Whether `libnccl.so.2` can be loaded.
pub fn available() -> bool {
    // SAFETY: only probes for the shared library.
    unsafe { sys::is_culib_present() }
}

fn nccl_err(call: &str, e: result::NcclError) -> Error {
    Error::System(format!("NCCL {call} failed with ncclResult_t {:?}", e.0))
}

/// NCCL's version code (e.g. 22803 for 2.28.3).
pub fn version() -> Result<i32> {
    if !available() {
        return Err(Error::System(
            "libnccl.so.2 (the system NCCL) was not found".into(),
        ));
    }
    result::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))
}

/// "2.28.3" from a version code.
pub fn version_string(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

fn dtype(d: DataType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match d {
        DataType::I8 => T::ncclInt8,
        DataType::U8 => T::ncclUint8,
        DataType::I32 => T::ncclInt32,
        DataType::U32 => T::ncclUint32,
        DataType::I64 => T::ncclInt64,
        DataType::U64 => T::ncclUint64,
        DataType::F16 => T::ncclFloat16,
        DataType::F32 => T::ncclFloat32,
        DataType::F64 => T::ncclFloat64,
        DataType::Bf16 => T::ncclBfloat16,
    }
}

fn redop(o: RedOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t as O;
    match o {
        RedOp::Sum => O::ncclSum,
        RedOp::Prod => O::ncclProd,
        RedOp::Max => O::ncclMax,
        RedOp::Min => O::ncclMin,
        RedOp::Avg => O::ncclAvg,
    }
}

/// A fresh `ncclGetUniqueId`: the 128 bytes every rank of one `ncclCommInitRank` needs (this
/// process serves NCCL's bootstrap root for them).
pub fn unique_id() -> Result<[u8; crate::bootstrap::UNIQUE_ID_BYTES]> {
    version()?;
    let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// The NCCL communicators of this process's GPUs: one per GPU from `ncclCommInitAll`, or this
/// process's one rank from `ncclCommInitRank` ([`NcclComms::init_rank`]).
pub struct NcclComms {
    comms: Vec<sys::ncclComm_t>,
}

impl NcclComms {
    /// `ncclCommInitAll` over CUDA devices `ordinals` (rank i on `ordinals[i]`).
    pub fn init_all(ordinals: &[usize]) -> Result<NcclComms> {
        version()?;
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        // SAFETY: `comms` and `devs` hold `ordinals.len()` entries.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
            .map_err(|e| nccl_err("ncclCommInitAll", e))?;
        Ok(NcclComms { comms })
    }

    /// `ncclCommInitRank`: rank `rank` of `nranks` on CUDA device `ordinal` (made current on
    /// this thread first), joined through `id`, the 128 bytes of rank 0's [`unique_id`]. The
    /// communicator is local slot 0 of the returned set.
    ///
    /// Errors: `InvalidArgument` for an id that is not 128 bytes; `System` when NCCL is missing or
    /// the init fails; CUDA errors of making the device current.
    pub fn init_rank(nranks: usize, id: &[u8], rank: usize, ordinal: usize) -> Result<NcclComms> {
        version()?;
        if id.len() != crate::bootstrap::UNIQUE_ID_BYTES {
            return Err(Error::invalid(format!(
                "an NCCL unique id is {} bytes, not {}",
                crate::bootstrap::UNIQUE_ID_BYTES,
                id.len()
            )));
        }
        cuda::Context::get(ordinal)?.bind()?;
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id holds the 128 bytes of a ncclGetUniqueId.
        unsafe { result::comm_init_rank(&mut comm, nranks as i32, uid, rank as i32) }
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(NcclComms { comms: vec![comm] })
    }

    /// Number of local communicators (GPUs of this process).
    pub fn local_ranks(&self) -> usize {
        self.comms.len()
    }

    /// `ncclGroupStart`.
    pub fn group_start() -> Result<()> {
        result::group_start()
            .map(|_| ())
            .map_err(|e| nccl_err("ncclGroupStart", e))
    }

    /// `ncclGroupEnd`.
    pub fn group_end() -> Result<()> {
        result::group_end()
            .map(|_| ())
            .map_err(|e| nccl_err("ncclGroupEnd", e))
    }

    /// Any collective for `rank` on `stream`, with oxccl's buffer conventions (see
    /// `Comm::collective_raw`): `count` is per rank for AllGather/ReduceScatter.
    ///
    /// # Safety
    /// `send`/`recv` are device addresses on the rank's GPU, valid for the sizes `func` needs until
    /// the operation completes; `stream` is on the rank's GPU.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn collective(
        &self,
        rank: usize,
        func: Func,
        send: u64,
        recv: u64,
        count: usize,
        dt: DataType,
        op: RedOp,
        root: usize,
        stream: &cuda::Stream,
    ) -> Result<()> {
        let comm = *self
            .comms
            .get(rank)
            .ok_or_else(|| Error::invalid(format!("rank {rank} out of range")))?;
        let (s, r) = (send as *const c_void, recv as *mut c_void);
        let st = stream.raw as sys::cudaStream_t;
        let (d, o, root) = (dtype(dt), redop(op), root as i32);
        // SAFETY: forwarded caller contract; the communicator is live.
        let res = unsafe {
            match func {
                Func::AllReduce => result::all_reduce(s, r, count, d, o, comm, st),
                Func::Broadcast => result::broadcast(s, r, count, d, root, comm, st),
                Func::Reduce => result::reduce(s, r, count, d, o, root, comm, st),
                Func::AllGather => result::all_gather(s, r, count, d, comm, st),
                Func::ReduceScatter => result::reduce_scatter(s, r, count, d, o, comm, st),
            }
        };
        res.map(|_| ()).map_err(|e| nccl_err(func.name(), e))
    }
}

impl Drop for NcclComms {
    fn drop(&mut self) {
        for c in self.comms.drain(..) {
            // SAFETY: each communicator came from ncclCommInitAll or ncclCommInitRank and is
            // destroyed once.
            if let Err(e) = unsafe { result::comm_destroy(c) } {
                tracing::warn!(target: "oxccl::perf", "ncclCommDestroy failed: {:?}", e.0);
            }
        }
    }
}
