//! The `oxccl` command line as a user meets it, on the CPU target (GPU parts skip with the reason
//! printed): output piped into a reader that stops early and bad flags (`flags_and_output`),
//! `perf --procs` with ranks as processes (`perf_procs`), on simulated hosts in network
//! namespaces (`perf_hosts`), the point-to-point sweeps (`perf_p2p`), and `init-bench`
//! (`init_bench`).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod flags_and_output;
mod init_bench;
mod perf_hosts;
mod perf_p2p;
mod perf_procs;
