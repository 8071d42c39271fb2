//! Benchmark support in the style of nccl-tests: data generation and checking ([`check`]) and the
//! result table ([`table`]).
pub mod check;
pub mod table;
