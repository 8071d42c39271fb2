//! Settings: environment parameters and their bounds (`env_params`), the tuning model and the
//! variables that force its choices (`tuning`), the bootstrap's variables (`bootstrap_env`) and
//! topology files that cannot be used (`topo_file_errors`). Tests that set variables hold
//! `common::env::Env`, so they run one at a time; the others hold the environment shared.
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod bootstrap_env;
mod env_params;
mod topo_file_errors;
mod tuning;
