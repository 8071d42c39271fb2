//! The calling thread's current CUDA device, as a C program sets it with `cudaSetDevice`: the
//! device of `ncclCommInitRank` and `ncclMemAlloc` (NCCL's `cudaGetDevice`), and kept across
//! every call that may make another context current (oxccl binds each rank's context on the
//! calling thread), as NCCL restores the device it found.
//!
//! oxccl's `cuda` module is the one driver layer of the library; the two queries it does not
//! offer (the current context and its device) are made here, on the same run-time-loaded driver
//! and only once oxccl has found it ([`oxccl::cuda::driver`]), since the loader panics without
//! one.
use cudarc::driver::sys::{self, CUresult};
use oxccl::{Error, Result};

/// The device of the calling thread's current context, or 0 when none is current (what
/// `cudaGetDevice` answers before any `cudaSetDevice`). Errors: `NoCuda` (ncclSystemError)
/// without a driver.
pub(crate) fn current_device() -> Result<usize> {
    oxccl::cuda::driver()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the driver is loaded (above); the out-pointer is valid.
    let r = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
    if r != CUresult::CUDA_SUCCESS || ctx.is_null() {
        return Ok(0);
    }
    let mut dev = 0;
    // SAFETY: as above; a context is current on this thread.
    let r = unsafe { sys::cuCtxGetDevice(&mut dev) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(Error::Cuda {
            call: "cuCtxGetDevice",
            code: r as u32,
            name: format!("{r:?}"),
            msg: "the current context's device".into(),
        });
    }
    Ok(dev.max(0) as usize)
}

/// Keeps the calling thread's current context across a call: oxccl's scope
/// ([`oxccl::cuda::KeepCurrent`]), whose binds note the caller's context lazily and whose end
/// restores it if a bind replaced it. Does nothing without a driver.
pub(crate) use oxccl::cuda::KeepCurrent;
