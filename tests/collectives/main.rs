//! The collectives, checked exactly on the CPU target (every run) and on GPUs (skipped with the
//! reason printed without them): the correctness matrix of every collective × protocol × dtype ×
//! op (`matrix`, `all_reduce`, `block_threads`), the tree AllReduce (`tree`, and on LL and LL128:
//! `tree_protocols`), the LL protocol's flag wrap (`ll_protocol`), PreMulSum (`premulsum`), rings
//! that follow the topology (`ring_order`), direct writes into peers' outputs (`direct`), the transports between the ranks of
//! one `init_all` (`in_process`), the
//! field cases of CASES.md (`cases`), half and bfloat16 arithmetic (`half_math`), the embedded PTX
//! (`kernels`), groups whose collectives are deferred (`group_scope`) and share launches (`aggregation`), calls captured into a graph
//! and replayed (`capture`; groups, several communicators and point-to-point calls: `capture_groups`), and the GPU runs
//! (`gpu_all_reduce`, `gpu_collectives`, `gpu_direct`, `gpu_tree`).
//!
//! Tests that set environment variables hold `common::env::Env`; the others create their
//! communicators holding the environment lock shared (`common::init_all`, `common::init_comms`).
//! GPU tests take `common::gpu_lock` before the environment lock.
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod aggregation;
mod aggregation_more;
mod all_reduce;
mod block_threads;
mod capture;
mod capture_groups;
mod cases;
mod direct;
mod gpu_all_reduce;
mod gpu_collectives;
mod gpu_direct;
mod gpu_tree;
mod fp8_math;
mod group_buffers;
mod group_collectives;
mod group_scope;
mod half_math;
mod in_process;
mod kernels;
mod ll_protocol;
mod matrix;
mod premulsum;
mod ring_order;
mod send_recv;
mod tree;
mod tree_protocols;
