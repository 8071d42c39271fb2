//! # oxccl
//!
//! Collective communication for NVIDIA GPUs, written in Rust with its GPU kernels, on NCCL's
//! design: rings over channels, FIFO connections with head/tail steps, the Simple protocol (LL and
//! LL128 to come), P2P transport between GPUs, and the same collective code running on a CPU
//! target for testing anywhere.
//!
//! | layer | host module | mirrors in NCCL |
//! |---|---|---|
//! | public API | [`Comm`], [`Device`], [`DeviceBuffer`], [`Stream`] | `nccl.h` |
//! | collectives, planning, launch | [`comm`] | `enqueue.cc`, `init.cc`, `channel.cc` |
//! | parameters | [`params`] | `NCCL_PARAM` |
//! | CUDA driver | [`cuda`] | `cudawrap.cc` |
//! | CPU target | [`cpu`] | — |
//! | kernels (device code) | [`oxccl_gpu`] | `src/device/` |
//! | benchmarks | [`perf`], [`nccl`] | nccl-tests |
//!
//! ```no_run
//! use oxccl::{Comm, DataType, Device, RedOp};
//! let devices = Device::all_cuda();
//! let comms = Comm::init_all(&devices)?;
//! for comm in &comms {
//!     let stream = comm.device().new_stream()?;
//!     let buf = comm.device().alloc(1024 * 4)?;
//!     comm.all_reduce(&buf, &buf, 1024, DataType::F32, RedOp::Sum, &stream)?;
//! }
//! # Ok::<(), oxccl::Error>(())
//! ```
//! (With several ranks in one thread, queue every rank's call before synchronizing any stream:
//! each rank's kernel waits for its peers'.)
#![deny(unsafe_op_in_unsafe_fn)]

pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod mem;
pub mod nccl;
pub mod params;
pub mod perf;

pub use comm::{Choice, Comm};
pub use error::{Error, Result, ResultCode, error_string};
pub use mem::{DevSlice, Device, DeviceBuffer, Stream};
pub use oxccl_gpu::abi::{Algo, DataType, Func, Proto, RedOp, kernel_name};

/// The embedded kernels: `PTX_MODULES` lists (kernel entry point, PTX module) pairs, one module
/// per entry point, split by build.rs from the PTX built from `gpu/` (empty when built with
/// `OXCCL_SKIP_PTX`); `PTX_BYTES` is the size of the module before splitting.
pub mod kernels {
    include!(concat!(env!("OUT_DIR"), "/ptx_modules.rs"));

    /// The PTX module holding kernel entry point `name`.
    pub fn module(name: &str) -> Option<&'static str> {
        PTX_MODULES.iter().find(|(n, _)| *n == name).map(|(_, ptx)| *ptx)
    }
}

#[cfg(test)]
#[path = "../build/ptx_split.rs"]
mod ptx_split;

/// oxccl's version, as NCCL encodes it (major × 10000 + minor × 100 + patch).
pub fn version() -> u32 {
    let p = |s: &str| s.parse::<u32>().unwrap_or(0);
    p(env!("CARGO_PKG_VERSION_MAJOR")) * 10000 + p(env!("CARGO_PKG_VERSION_MINOR")) * 100 + p(env!("CARGO_PKG_VERSION_PATCH"))
}
