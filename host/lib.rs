//! # oxccl
//!
//! Collective communication for NVIDIA GPUs, written in Rust with its GPU kernels, on NCCL's
//! design: rings and trees over channels, FIFO connections with head/tail steps, the LL, LL128
//! and Simple protocols, P2P, SHM and NET transports with a proxy thread, and the same kernel code
//! running on a CPU target (blocks of host fibers with real barriers) for testing anywhere.
//!
//! | layer | host module | mirrors in NCCL |
//! |---|---|---|
//! | public API | [`Comm`], [`Device`], [`DeviceBuffer`], [`Stream`], [`CommHandle`] ([`handle`]) | `nccl.h` |
//! | communicator: type, resources, `Drop` | [`comm`] (`comm/mod.rs`) | `comm.h` |
//! | init: one per-rank setup for `init_rank` and `init_all` (a group of it, in-process bootstrap), peer info exchange, connecting the channels | `comm/init.rs`, `comm/peer_info.rs`, `transport/link.rs` (test hooks: `comm/test_hooks.rs`) | `init.cc` (`ncclCommInitRank`, `ncclCommInitAll`), `transport.cc` |
//! | channels, rings and trees on the device | `comm/channel.rs`, `comm/rank_trees.rs` | `channel.cc`, `devCommSetup` |
//! | the calls and their argument checks | `comm/collectives.rs` | `collectives.cc`, `argcheck.cc` |
//! | send, receive and what is built from them (all-to-all, gather, scatter, V-variants): checks, works over the peer channels, launch | `comm/send_recv.rs` (kernel: `gpu/src/coll/send_recv.rs`) | `collectives.cc`, `enqueue.cc`'s p2p scheduling, `sendrecv.h` |
//! | groups: a thread's queued collectives, then sends and receives, launched at the outermost end; [`group::scope`] with compile-checked borrows | [`group`](mod@group) | `group.cc` |
//! | plan and launch of a call | `comm/enqueue.rs` | `enqueue.cc` |
//! | abort, async errors, finalize, destroy; call timeouts and the flight recorder | `comm/abort.rs`, `liveness.rs` (peer processes), `comm/timeout.rs`, `comm/flight_recorder.rs` (`oxccl trace`) | `init.cc`'s abort path; NCCL 2.30's `ncclTimeout`; PyTorch's flight recorder |
//! | algorithm and protocol choice | [`tuning`] | `tuning.cc` |
//! | transport choice and connection | [`transport`] (P2P → SHM → NET per pair, peer info), `transport/{p2p,shm,net,net_socket}.rs`, `transport/plugin/` | `transport.cc`, `transport/{p2p,shm,net,net_socket}.cc`, `plugin/net.cc` |
//! | proxy thread (NET steps) | [`proxy`] | `proxy.cc`, `net.cc`'s progress |
//! | bootstrap network, unique id; the in-process bootstrap of `init_all` | [`bootstrap`] | `bootstrap.cc`, `misc/socket.cc` |
//! | topology: XML, detection, paths | [`topo`] | `graph/topo.cc`, `graph/xml.cc`, `graph/paths.cc` |
//! | rings and trees of a node and across nodes | [`graph`] | `graph/search.cc`, `graph/connect.cc`, `graph/trees.cc` |
//! | parameters (`NCCL_*` variables) | [`params`] | `NCCL_PARAM` |
//! | reduction operators, PreMulSum | [`redop`] | `ncclRedOpCreatePreMulSum` |
//! | errors | [`error`] | `ncclResult_t` |
//! | CUDA driver | [`cuda`] | `cudawrap.cc` |
//! | CPU target: host memory, streams | [`cpu`], [`mem`] | — |
//! | kernels (device code, built for nvptx and the host) | [`oxccl_gpu`], [`kernels`] (the embedded PTX) | `src/device/` |
//! | benchmarks, the system NCCL for comparison | [`perf`], [`nccl`] | nccl-tests |
//!
//! ## One `all_reduce`, from the call to the kernel
//!
//! 1. [`Comm::all_reduce`] (`comm/collectives.rs`) passes the buffers, count, type and operator to
//!    `safe_call`, which checks the root, buffer sizes (elements × type size, per rank), device,
//!    alignment and overlap (NCCL's `argcheck.cc`), then `collective_raw`: NULL buffers, the
//!    operator and its PreMulSum scalar (`check_op`), the stream's backend, the communicator's
//!    abort and finalize state. Count 0 returns here; one rank copies (or runs the one-rank
//!    PreMulSum kernel).
//! 2. `Comm::plan` (`comm/enqueue.rs`) asks [`tuning`]'s cost model, within `NCCL_ALGO` /
//!    `NCCL_PROTO` and the communicator's channels and trees, for (algorithm, protocol, channels)
//!    and sets the chunk and slice sizes; the result is a [`Choice`] (`Comm::last_choice`).
//! 3. `collective_raw` fills the work element (`oxccl_gpu::abi::WorkColl`, `#[repr(C)]`, shared
//!    with the kernels) and `Comm::launch` (`comm/enqueue.rs`) launches it with the device
//!    communicator block built at init (`comm/channel.rs`: per channel its ring, tree and
//!    connection FIFOs). On a GPU it names the kernel entry of (collective, algorithm, protocol,
//!    type, `sum` or `any` operator) ([`oxccl_gpu::abi::kernel_name_for`]), waits until the ranks
//!    sharing its GPU launched their previous call, loads the module on first use, launches one
//!    block per channel on the caller's stream and records an untimed completion marker. On the
//!    CPU target `launch_cpu` queues the same block function (`oxccl_gpu::dispatch::run_block`) on
//!    the CPU stream, one host thread of fibers per channel.
//! 4. In the kernel (`gpu/src/kernels.rs` → `gpu/src/dispatch.rs::run_kernel`) each block reads its
//!    channel's ring, the algorithm (`gpu/src/coll/all_reduce.rs`, `coll/tree.rs`) walks the
//!    chunks and calls the protocol's verbs (`gpu/src/proto/{ll,ll128,simple}.rs`), which move
//!    data through the FIFOs the transports connected: direct peer pointers (P2P), shared host
//!    memory (SHM) or proxy-driven network steps (NET, [`proxy`]).
//!
//! ```no_run
//! use oxccl::{Comm, DataType, Device, RedOp};
//! let devices = Device::all_cuda();
//! let comms = Comm::init_all(&devices)?;
//! for comm in &comms {
//!     let stream = comm.device().new_stream()?;
//!     let buf = comm.device().alloc(1024 * 4)?;
//!     comm.all_reduce(&buf, &buf, 1024, DataType::F32, RedOp::Sum, &stream)?;
//! }
//! # Ok::<(), oxccl::Error>(())
//! ```
//! (With several ranks in one thread, queue every rank's call before synchronizing any stream:
//! each rank's kernel waits for its peers'.)
#![deny(unsafe_op_in_unsafe_fn)]

pub mod bootstrap;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod graph;
pub mod group;
pub mod handle;
mod hash;
pub(crate) mod liveness;
pub mod mem;
pub mod nccl;
pub mod params;
pub mod perf;
pub mod proxy;
pub mod redop;
pub mod topo;
pub mod transport;
pub mod tuning;

pub use comm::{Choice, Comm, SPLIT_NOCOLOR};
pub use error::{Error, Result, ResultCode, error_string, error_string_of};
pub use params::CommConfig;
pub use group::{PendingComm, group, group_end, group_start};
pub use handle::CommHandle;
pub use mem::{CapturedGraph, DevSlice, Device, DeviceBuffer, Stream};
pub use oxccl_gpu::abi::{Algo, DataType, DevRedOp, Func, Proto, RedOp, kernel_name, kernel_name_for};
pub use redop::{ReduceOp, Scalar};
pub use oxccl_gpu::fp8::{F8E4M3, F8E5M2};

/// The embedded kernels: `PTX_MODULES` lists (kernel entry point, deflated PTX module) pairs, one
/// module per entry point, split by build.rs from the PTX built from `gpu/` (empty when built with
/// `OXCCL_SKIP_PTX`); `PTX_BYTES` is the size of the linked PTX before splitting.
pub mod kernels {
    include!(concat!(env!("OUT_DIR"), "/ptx_modules.rs"));

    /// The PTX text of the module holding kernel entry point `name`.
    pub fn module(name: &str) -> Option<String> {
        let (_, packed) = PTX_MODULES.iter().find(|(n, _)| *n == name)?;
        let bytes = miniz_oxide::inflate::decompress_to_vec(packed).ok()?;
        String::from_utf8(bytes).ok()
    }

    /// The error for a call whose kernel entry `name` this build does not have: the kernel
    /// entry table was filtered by `OXCCL_ONLY_FUNCS` when it was built (the message then gives
    /// the pattern that adds the entry), or the PTX was skipped (`OXCCL_SKIP_PTX`).
    pub fn not_built(name: &str) -> crate::Error {
        not_built_with(name, option_env!("OXCCL_ONLY_FUNCS").unwrap_or(""))
    }

    /// [`not_built`] for a build whose `OXCCL_ONLY_FUNCS` was `only`.
    fn not_built_with(name: &str, only: &str) -> crate::Error {
        let how = match filter_words(name) {
            Some(words) if !only.trim().is_empty() => format!(
                "it was built with OXCCL_ONLY_FUNCS={only:?}; add the pattern \"{words}\" to it \
                 (OXCCL_ONLY_FUNCS=\"{}|{words}\"), or rebuild without it for every kernel",
                only.trim()
            ),
            _ => "it was built with OXCCL_SKIP_PTX (no GPU kernels) or OXCCL_ONLY_FUNCS; rebuild \
                  without them for every kernel"
                .to_string(),
        };
        crate::Error::InvalidUsage(format!("kernel {name} is not in this build: {how}"))
    }

    /// The `OXCCL_ONLY_FUNCS` pattern that names the collective entry `name`
    /// (`oxccl_<func>[_tree]_<protocol>_<type>_<operator>[_checked]`, as `gpu/build.rs` names
    /// them): `"<func> ring|tree <protocol> <type> <operator>"`; `None` for the other kernels
    /// (the check and point-to-point kernels, which every build holds). For a byte-moving entry
    /// the pattern also names its twin (`_checked` or not): the same calls run either, by the
    /// call check and the call's size (`oxccl_gpu::abi::runs_checked_entry`).
    fn filter_words(name: &str) -> Option<String> {
        let parts: Vec<&str> = name.strip_prefix("oxccl_")?.split('_').collect();
        match parts.as_slice() {
            [func, "tree", proto, dtype, op] => Some(format!("{func} tree {proto} {dtype} {op}")),
            [func, proto, dtype, op, "checked"] => Some(format!("{func} ring {proto} {dtype} {op}")),
            [func, proto, dtype, op] => Some(format!("{func} ring {proto} {dtype} {op}")),
            _ => None,
        }
    }

    /// Every kernel entry point with its PTX text.
    pub fn all() -> Vec<(&'static str, String)> {
        PTX_MODULES
            .iter()
            .filter_map(|(n, _)| module(n).map(|m| (*n, m)))
            .collect()
    }

    #[cfg(test)]
    mod tests {
        use super::{filter_words, not_built_with};

        #[test]
        fn a_filtered_build_names_the_pattern_that_adds_the_missing_entry() {
            let e = not_built_with("oxccl_broadcast_ll_uint32_sum", " allreduce float sum ").to_string();
            assert!(e.contains("kernel oxccl_broadcast_ll_uint32_sum is not in this build"), "{e}");
            assert!(e.contains("add the pattern \"broadcast ring ll uint32 sum\""), "{e}");
            assert!(e.contains("OXCCL_ONLY_FUNCS=\"allreduce float sum|broadcast ring ll uint32 sum\""), "{e}");
            let e = not_built_with("oxccl_allreduce_tree_ll128_half_any", "float").to_string();
            assert!(e.contains("\"allreduce tree ll128 half any\""), "{e}");
            // A checked entry's pattern builds its twin too.
            let e = not_built_with("oxccl_allgather_ll128_uint32_sum_checked", "float").to_string();
            assert!(e.contains("add the pattern \"allgather ring ll128 uint32 sum\""), "{e}");
            // Not filtered (the PTX was skipped), or not a collective entry: no pattern.
            for (name, only) in [("oxccl_allreduce_ll_float_sum", ""), ("oxccl_check_call", "float")] {
                let e = not_built_with(name, only).to_string();
                assert!(e.contains("OXCCL_SKIP_PTX") && !e.contains("add the pattern"), "{e}");
            }
        }

        #[test]
        fn every_entry_of_the_table_has_its_pattern() {
            // The table as built (every entry in CI): each name's pattern spells the name (a
            // checked entry's, its plain twin's name).
            for e in oxccl_gpu::dispatch::ENTRIES {
                let words = filter_words(e.name).unwrap_or_else(|| panic!("{}: no pattern", e.name));
                let w: Vec<&str> = words.split(' ').collect();
                let tree = if w[1] == "tree" { "_tree" } else { "" };
                let checked = if e.checked { "_checked" } else { "" };
                assert_eq!(format!("oxccl_{}{tree}_{}_{}_{}{checked}", w[0], w[2], w[3], w[4]), e.name);
            }
        }
    }
}

#[cfg(test)]
#[path = "../build/ptx_split.rs"]
mod ptx_split;

/// oxccl's version as NCCL's `ncclGetVersion` encodes it: major × 10000 + minor × 100 + patch
/// (e.g. 100 for 0.1.0). [`version_string`] gives the text.
pub fn version() -> u32 {
    let p = |s: &str| s.parse::<u32>().unwrap_or(0);
    p(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + p(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + p(env!("CARGO_PKG_VERSION_PATCH"))
}

/// oxccl's version as text, e.g. "0.1.0" (the crate version; [`version`] is its integer code).
pub fn version_string() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[cfg(test)]
mod ptx_split_tests {
    use super::ptx_split::split_ptx;

    const PTX: &str = "//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 7.0\n.target sm_70\n.address_size 64\n\n\
.func helper_a\n(\n\t.param .b64 helper_a_param_0\n)\n;\n\
.func (.param .b32 func_retval0) helper_b\n(\n)\n;\n\
.global .align 1 .b8 table_x[3] = {0, 1, 2};\n\
.func helper_a(\n\t.param .b64 helper_a_param_0\n)\n{\n\tld.global.b8 %r1, [table_x];\n\tret;\n}\n\
.func (.param .b32 func_retval0) helper_b()\n{\n\tret;\n}\n\
\t// .globl\tk_one\n.visible .entry k_one(\n\t.param .b64 p\n)\n{\n\t{ // callseq 0\n\tcall.uni helper_a, (param0);\n\t}\n\tret;\n}\n\
\t// .globl\tk_two\n.visible .entry k_two()\n{\n\t{\n\tcall.uni (retval0), helper_b, ();\n\t}\n\tret;\n}\n";

    #[test]
    fn each_entry_gets_exactly_what_it_reaches() {
        let mods = split_ptx(PTX).unwrap();
        let names: Vec<&str> = mods.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["k_one", "k_two"]);
        let (one, two) = (&mods[0].1, &mods[1].1);
        for m in [one, two] {
            assert!(
                m.contains(".version 7.0") && m.contains(".target sm_70") && m.contains(".address_size 64")
            );
        }
        // k_one -> helper_a (declaration and body) -> table_x; nothing of k_two.
        assert_eq!(one.matches(".func helper_a").count(), 2);
        assert!(one.contains("table_x[3]"));
        assert!(!one.contains("helper_b") && !one.contains("k_two"));
        // k_two -> helper_b only.
        assert_eq!(two.matches("helper_b").count(), 3);
        assert!(!two.contains("helper_a") && !two.contains("table_x") && !two.contains(".entry k_one"));
    }

    /// A file linked in parts: each part has its own header and its own copy of a helper with
    /// the same name; each entry's module takes the helper of its own part, once.
    #[test]
    fn parts_are_split_each_on_its_own() {
        let part = |entry: &str, body: &str| {
            format!(
                ".version 7.0\n.target sm_70\n.address_size 64\n\n.func helper()\n{{\n\t{body};\n}}\n\
                 .visible .entry {entry}()\n{{\n\tcall.uni helper, ();\n\tret;\n}}\n"
            )
        };
        let ptx = format!(
            "{} 0 of 2\n{}{} 1 of 2\n{}",
            super::ptx_split::PART_MARKER,
            part("k_a", "membar.gl"),
            super::ptx_split::PART_MARKER,
            part("k_b", "membar.sys")
        );
        let mods = split_ptx(&ptx).unwrap();
        let names: Vec<&str> = mods.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["k_a", "k_b"]);
        let (a, b) = (&mods[0].1, &mods[1].1);
        assert_eq!(a.matches(".func helper").count(), 1);
        assert!(a.contains("membar.gl") && !a.contains("membar.sys") && !a.contains("k_b"));
        assert_eq!(b.matches(".func helper").count(), 1);
        assert!(b.contains("membar.sys") && !b.contains("membar.gl") && !b.contains("k_a"));
        assert_eq!(a.matches(".version 7.0").count(), 1);
    }

    #[test]
    fn unbalanced_input_is_an_error() {
        assert!(split_ptx(".version 7.0\n.visible .entry k()\n{\n\tret;\n").is_err());
    }
}
