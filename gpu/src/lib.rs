//! oxccl's device code, compiled twice: for `nvptx64-nvidia-cuda` into the PTX module the host
//! library embeds (build.rs), and for the host as the CPU target, where each channel is a block of
//! `OXCCL_CPU_NTHREADS` threads (fibers of one host thread, or host threads: `OXCCL_CPU_TEAM`)
//! running the very same schedules and protocols.
//!
//! | layer | module | knows about |
//! |---|---|---|
//! | kernel entry, dispatch | `kernels`, [`dispatch`] | (func, algo, proto, dtype, op) → monomorphised algorithm |
//! | algorithms | [`coll`] | ring schedules over chunks; only Primitives verbs |
//! | protocols | [`proto`] | FIFO slots, head/tail steps, flags |
//! | reductions | [`reduce`] | per-type operators |
//! | raw memory and threads | [`arch`] | PTX instructions (or host atomics) |
//! | shared ABI | [`abi`] | `#[repr(C)]` structs and enums used by both sides |
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch)
)]
// `inline(always)` on the closures the kernels' loops call (a closure LLVM outlines keeps its
// operands in local memory).
#![feature(stmt_expr_attributes)]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

pub mod abi;
pub mod arch;
pub mod check;
pub mod coll;
pub mod dispatch;
pub mod fp8;
pub mod proto;
pub mod reduce;
pub mod unroll;

#[cfg(target_arch = "nvptx64")]
mod kernels;

// The kernel entry table's generator (`OXCCL_ONLY_FUNCS` filter included), whose unit tests run
// with this crate's.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../build.rs"]
mod build_script;
