//! Benchmark support in the style of nccl-tests: data generation and checking ([`check`]), the
//! result table ([`table`]) and the sweep engine behind `oxccl perf` ([`run`]).
pub mod check;
pub mod run;
pub mod table;
