//! Benchmark support in the style of nccl-tests: data generation and checking ([`check`]), the
//! result table ([`table`]), the sweep engine behind `oxccl perf` ([`run`]) and its JSON/SVG
//! reports ([`report`]).
pub mod check;
pub mod report;
pub mod run;
pub mod table;
