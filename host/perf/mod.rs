//! Benchmark support in the style of nccl-tests: data generation and checking ([`check`]), the
//! result table ([`table`]), the sweep engines behind `oxccl perf` ([`run`] for the collectives,
//! [`p2p`] for SendRecv, AlltoAll, Gather and Scatter) and their JSON/SVG reports ([`report`]);
//! `oxccl init-bench`'s communicator-init timing ([`init_bench`]); one rank per process for both
//! ([`procs`]).
pub mod check;
pub mod init_bench;
pub mod p2p;
pub mod procs;
pub mod report;
pub mod run;
pub mod table;
