//! Benchmark support in the style of nccl-tests: data generation and checking ([`check`]), the
//! result table ([`table`]), the sweep engine behind `oxccl perf` ([`run`]) and its JSON/SVG
//! reports ([`report`]); `oxccl init-bench`'s communicator-init timing ([`init_bench`]); one rank per process for both
//! ([`procs`]).
pub mod check;
pub mod init_bench;
pub mod procs;
pub mod report;
pub mod run;
pub mod table;
