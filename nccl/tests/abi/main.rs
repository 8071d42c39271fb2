//! libnccl.so.2 tested as C programs use it: loaded with `dlopen` (libloading) from where
//! `cargo test` built it, its functions called through their C signatures. Communicators are
//! oxccl CPU-target ranks (`OXCCL_NCCL_TARGET=cpu`), so everything runs without a GPU; the
//! GPU counterpart is the C program `tests/c/allreduce_sendrecv.c` (`tests/c/run.sh`).
//!
//! | module | what |
//! |---|---|
//! | `library` | SONAME, every function and its `pnccl` twin, version, error strings, unique id |
//! | `errors` | NULL arguments named, dead handles, group misuse, what is not supported yet |
//! | `config` | `ncclConfig_t`: size, magic, version, values, `blocking = 0` |
//! | `cpu` | every collective end to end, grouped inits, teardown from one thread, C and Rust ranks, `ncclCommInitAll`, abort, revoke, collectives in groups, `ncclGroupSimulateEnd` |
//! | `cudarc` | cudarc's `nccl` safe API on the library (GPU; a child process with the library first on `LD_LIBRARY_PATH`) |
//! | `c_program` | the C program `tests/c/cpu_target.c`, compiled with the system C compiler against `nccl.h` and linked with `-lnccl`: ranks as processes and as threads |
mod common;

mod c_program;
mod config;
mod cudarc;
mod cpu;
mod errors;
mod library;
