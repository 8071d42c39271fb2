//! Ranks in processes of their own: each test runs this binary again as child ranks (an ignored
//! `child_*` entry, `common::child`), bootstrapped through one unique id, on one host or on
//! simulated hosts (`OXCCL_HOSTID`, network namespaces). `Comm::init_rank` and `from_env`
//! (`init_rank`); the NET transport and its proxy with SHM beside it (`net_transport`), on the LL
//! protocols (`net_protocols`), through an NCCL net plugin (`net_plugin`), and its failures and
//! teardown (`net_failures`, scripted ranks of `script_ranks`); trees across hosts (`rank_trees`,
//! and with `host_ranks`' ranks: `host_trees`, `host_rings`, `host_failures`); CUDA ranks in
//! processes (`gpu_multiprocess`, `gpu_transports`: skipped with the reason printed without
//! GPUs); a call that times out naming the rank process that never called (`timeout`); the call
//! check across hosts beside a send waiting for its receive (`call_check`).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod call_check;
mod gpu_multiprocess;
mod gpu_transports;
mod host_failures;
mod host_ranks;
mod host_rings;
mod host_trees;
mod init_rank;
mod net_failures;
mod net_plugin;
mod net_protocols;
mod net_transport;
mod rank_trees;
mod script_ranks;
mod send_recv;
mod timeout;
