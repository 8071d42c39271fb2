//! The system NCCL (`libnccl.so.2`, loaded at run time through cudarc's `nccl` module), driven in
//! the same process as oxccl so `oxccl perf --compare nccl` measures both on the same GPUs in the
//! same run. Only what the benchmarks need: `ncclCommInitAll`, the collectives, groups, and the
//! point-to-point calls (`ncclSend`/`ncclRecv`; `ncclAlltoAll`, `ncclGather` and `ncclScatter`
//! where the loaded library exports them, NCCL 2.28 and later, else the grouped sends and
//! receives nccl-tests issues for them). Symbols newer than the collectives are looked up when
//! first used, so an older `libnccl.so.2` loads and runs what it has.
use crate::cuda;
use crate::error::{Error, Result};
use cudarc::nccl::{result, sys};
use oxccl_gpu::abi::{DataType, Func, RedOp};
use std::ffi::c_void;
use std::sync::OnceLock;

/// An NCCL entry point that older releases lack, looked up once.
struct Optional {
    symbol: &'static str,
    since: &'static str,
    found: OnceLock<bool>,
}

impl Optional {
    const fn new(symbol: &'static str, since: &'static str) -> Optional {
        Optional {
            symbol,
            since,
            found: OnceLock::new(),
        }
    }

    /// Whether the loaded NCCL exports the symbol (false when there is no NCCL).
    fn present(&self) -> bool {
        *self.found.get_or_init(|| {
            if !available() {
                return false;
            }
            // SAFETY: the library loads (checked above), so `culib` returns it rather than
            // panicking; looking a symbol up runs none of its code.
            unsafe { sys::culib().get::<unsafe extern "C" fn()>(self.symbol.as_bytes()).is_ok() }
        })
    }

    /// `Ok` when present, else a `System` error naming the symbol and the release that added it.
    fn require(&self) -> Result<()> {
        if self.present() {
            return Ok(());
        }
        Err(Error::System(format!(
            "the loaded NCCL{} has no {} (added in NCCL {})",
            version().map(|v| format!(" {}", version_string(v))).unwrap_or_default(),
            self.symbol,
            self.since
        )))
    }
}

static SEND: Optional = Optional::new("ncclSend", "2.7");
static RECV: Optional = Optional::new("ncclRecv", "2.7");
static ALL_TO_ALL: Optional = Optional::new("ncclAlltoAll", "2.28");
static GATHER: Optional = Optional::new("ncclGather", "2.28");
static SCATTER: Optional = Optional::new("ncclScatter", "2.28");

/// Whether the loaded NCCL has its own `ncclAlltoAll`, `ncclGather` and `ncclScatter` (2.28 and
/// later); without them [`NcclComms::all_to_all`], [`NcclComms::gather`] and
/// [`NcclComms::scatter`] issue grouped `ncclSend`/`ncclRecv` calls, as nccl-tests does.
pub fn has_native_all_to_all() -> bool {
    ALL_TO_ALL.present() && GATHER.present() && SCATTER.present()
}

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

/// The file the loaded NCCL was mapped from (`/proc/self/maps`), when one is: which library
/// `--compare nccl` measured — the system's, PyTorch's, or oxccl's own `libnccl.so.2` found
/// first on `LD_LIBRARY_PATH` (its C entry points against the Rust API in the same run).
pub fn loaded_from() -> Option<String> {
    if !available() {
        return None;
    }
    libnccl_in_maps(&std::fs::read_to_string("/proc/self/maps").ok()?)
}

/// The path of the first `libnccl` file mapped in `maps` (the text of `/proc/<pid>/maps`).
fn libnccl_in_maps(maps: &str) -> Option<String> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.rsplit('/').next().is_some_and(|f| f.starts_with("libnccl")))
        .map(str::to_string)
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
        DataType::F8E4M3 => T::ncclFloat8e4m3,
        DataType::F8E5M2 => T::ncclFloat8e5m2,
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

    /// The communicator of local slot `rank`.
    fn comm(&self, rank: usize) -> Result<sys::ncclComm_t> {
        self.comms
            .get(rank)
            .copied()
            .ok_or_else(|| Error::invalid(format!("rank {rank} out of range")))
    }

    /// (this rank, ranks) of the communicator of local slot `rank` (`ncclCommUserRank`,
    /// `ncclCommCount`).
    fn rank_and_size(&self, rank: usize) -> Result<(usize, usize)> {
        let comm = self.comm(rank)?;
        // SAFETY: both only read the live communicator.
        let me = unsafe { result::comm_user_rank(comm) }.map_err(|e| nccl_err("ncclCommUserRank", e))?;
        // SAFETY: as above.
        let n = unsafe { result::comm_count(comm) }.map_err(|e| nccl_err("ncclCommCount", e))?;
        Ok((me as usize, n as usize))
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

    /// `ncclSend`: `count` elements of `dt` from `send` to rank `peer`, for local slot `rank` on
    /// `stream`. `System` error when the loaded NCCL lacks it.
    ///
    /// # Safety
    /// `send` is a device address on the rank's GPU valid for `count` elements until the
    /// operation completes; `stream` is on the rank's GPU.
    pub unsafe fn send(
        &self,
        rank: usize,
        send: u64,
        count: usize,
        dt: DataType,
        peer: usize,
        stream: &cuda::Stream,
    ) -> Result<()> {
        SEND.require()?;
        let (comm, st) = (self.comm(rank)?, stream.raw as sys::cudaStream_t);
        // SAFETY: forwarded caller contract; the communicator is live and the symbol exists.
        let r = unsafe { sys::ncclSend(send as *const c_void, count, dtype(dt), peer as i32, comm, st) };
        checked("ncclSend", r)
    }

    /// `ncclRecv`: `count` elements of `dt` from rank `peer` into `recv`; see [`NcclComms::send`].
    ///
    /// # Safety
    /// As [`NcclComms::send`], for `recv`.
    pub unsafe fn recv(
        &self,
        rank: usize,
        recv: u64,
        count: usize,
        dt: DataType,
        peer: usize,
        stream: &cuda::Stream,
    ) -> Result<()> {
        RECV.require()?;
        let (comm, st) = (self.comm(rank)?, stream.raw as sys::cudaStream_t);
        // SAFETY: forwarded caller contract; the communicator is live and the symbol exists.
        let r = unsafe { sys::ncclRecv(recv as *mut c_void, count, dtype(dt), peer as i32, comm, st) };
        checked("ncclRecv", r)
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`: `f`'s error, else the end's.
    fn grouped(f: impl FnOnce() -> Result<()>) -> Result<()> {
        NcclComms::group_start()?;
        let r = f();
        let end = NcclComms::group_end();
        r.and(end)
    }

    /// `ncclAlltoAll` for local slot `rank`: block `p` (`count` elements of `dt`) of `send` to
    /// rank `p`, rank `p`'s block into block `p` of `recv`; both hold `nranks × count` elements.
    /// Without `ncclAlltoAll` (NCCL before 2.28) a group of `ncclSend`/`ncclRecv` per peer.
    ///
    /// # Safety
    /// `send` and `recv` are device addresses on the rank's GPU, each valid for `nranks × count`
    /// elements until the operation completes; `stream` is on the rank's GPU.
    pub unsafe fn all_to_all(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        count: usize,
        dt: DataType,
        stream: &cuda::Stream,
    ) -> Result<()> {
        let (comm, st) = (self.comm(rank)?, stream.raw as sys::cudaStream_t);
        let (s, r) = (send as *const c_void, recv as *mut c_void);
        if ALL_TO_ALL.present() {
            // SAFETY: forwarded caller contract; the communicator is live and the symbol exists.
            return checked("ncclAlltoAll", unsafe { sys::ncclAlltoAll(s, r, count, dtype(dt), comm, st) });
        }
        let block = (count * dt.size()) as u64;
        let (_, n) = self.rank_and_size(rank)?;
        NcclComms::grouped(|| {
            for p in 0..n {
                let off = p as u64 * block;
                // SAFETY: block p of each buffer lies in its nranks × count elements.
                unsafe {
                    self.send(rank, send + off, count, dt, p, stream)?;
                    self.recv(rank, recv + off, count, dt, p, stream)?;
                }
            }
            Ok(())
        })
    }

    /// `ncclGather` for local slot `rank`: `count` elements of `send` to rank `root`, which
    /// stores rank `p`'s at element `p × count` of `recv` (`nranks × count` elements, read on the
    /// root only). Without `ncclGather` (NCCL before 2.28) a group of `ncclSend`/`ncclRecv`.
    ///
    /// # Safety
    /// `send` is valid for `count` elements and, on the root, `recv` for `nranks × count`, on the
    /// rank's GPU until the operation completes; `stream` is on the rank's GPU.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        count: usize,
        dt: DataType,
        root: usize,
        stream: &cuda::Stream,
    ) -> Result<()> {
        let (comm, st) = (self.comm(rank)?, stream.raw as sys::cudaStream_t);
        let (s, r) = (send as *const c_void, recv as *mut c_void);
        if GATHER.present() {
            // SAFETY: forwarded caller contract; the communicator is live and the symbol exists.
            let res = unsafe { sys::ncclGather(s, r, count, dtype(dt), root as i32, comm, st) };
            return checked("ncclGather", res);
        }
        let block = (count * dt.size()) as u64;
        let (me, n) = self.rank_and_size(rank)?;
        NcclComms::grouped(|| {
            // SAFETY: forwarded caller contract; block p of `recv` lies in its nranks × count
            // elements on the root.
            unsafe {
                if me == root {
                    for p in 0..n {
                        self.recv(rank, recv + p as u64 * block, count, dt, p, stream)?;
                    }
                }
                self.send(rank, send, count, dt, root, stream)
            }
        })
    }

    /// `ncclScatter` for local slot `rank`: rank `root` sends elements `p × count ..` of `send`
    /// (`nranks × count` elements, read on the root only) to rank `p`, which receives `count`
    /// elements into `recv`. Without `ncclScatter` (NCCL before 2.28) a group of
    /// `ncclSend`/`ncclRecv`.
    ///
    /// # Safety
    /// `recv` is valid for `count` elements and, on the root, `send` for `nranks × count`, on the
    /// rank's GPU until the operation completes; `stream` is on the rank's GPU.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scatter(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        count: usize,
        dt: DataType,
        root: usize,
        stream: &cuda::Stream,
    ) -> Result<()> {
        let (comm, st) = (self.comm(rank)?, stream.raw as sys::cudaStream_t);
        let (s, r) = (send as *const c_void, recv as *mut c_void);
        if SCATTER.present() {
            // SAFETY: forwarded caller contract; the communicator is live and the symbol exists.
            let res = unsafe { sys::ncclScatter(s, r, count, dtype(dt), root as i32, comm, st) };
            return checked("ncclScatter", res);
        }
        let block = (count * dt.size()) as u64;
        let (me, n) = self.rank_and_size(rank)?;
        NcclComms::grouped(|| {
            // SAFETY: forwarded caller contract; block p of `send` lies in its nranks × count
            // elements on the root.
            unsafe {
                if me == root {
                    for p in 0..n {
                        self.send(rank, send + p as u64 * block, count, dt, p, stream)?;
                    }
                }
                self.recv(rank, recv, count, dt, root, stream)
            }
        })
    }
}

/// `Ok` for NCCL's success codes, else a `System` error naming `call`.
fn checked(call: &str, r: sys::ncclResult_t) -> Result<()> {
    r.result().map(|_| ()).map_err(|e| nccl_err(call, e))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mapped_libnccl_is_found_in_maps() {
        let maps = "7f00-7f10 r--p 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n\
                    7f10-7f20 r-xp 00001000 08:01 34 /opt/oxccl/target/release/libnccl.so\n\
                    7f20-7f30 rw-p 00000000 00:00 0 \n";
        assert_eq!(libnccl_in_maps(maps).as_deref(), Some("/opt/oxccl/target/release/libnccl.so"));
        assert_eq!(libnccl_in_maps("7f00-7f10 r--p 0 08:01 12 /usr/lib/libcudart.so.13\n7f20-7f30 rw-p 0 00:00 0\n"), None);
    }
}
