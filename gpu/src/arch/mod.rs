//! Raw memory and thread operations: the only module with `asm!`.
//!
//! `nvptx.rs` implements each function with one PTX instruction (named in its doc comment, with
//! its scope and ordering); `host.rs` implements the same signatures on `core::sync::atomic` for
//! the CPU target, where a "block" is one host thread. Everything above this module (protocols,
//! collectives) is written once against these functions. Mirrors NCCL's `op128.h` and the inline
//! PTX scattered over `primitives.h` / `prims_*.h`.

#[cfg(target_arch = "nvptx64")]
mod nvptx;
#[cfg(target_arch = "nvptx64")]
pub use nvptx::*;

#[cfg(not(target_arch = "nvptx64"))]
mod host;
#[cfg(not(target_arch = "nvptx64"))]
pub use host::*;

/// A 16-byte vector: the unit of every data load and store of the protocols.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pack(pub [u32; 4]);
