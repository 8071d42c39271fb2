//! Generates the kernel entry table (NCCL's `generate.py`): one row per kernel entry point,
//! func × algo × protocol × element type × operator, written to `$OUT_DIR/entries.rs` as one `entries!`
//! invocation. Both the nvptx kernels (`src/kernels.rs`, one `extern "ptx-kernel"` fn per row) and
//! the CPU target's dispatch (`src/dispatch.rs`, one match arm per row) expand it, so the two
//! targets run exactly the same variants.
//!
//! The table (the rules are [`crate::abi::kernel_variant`]'s, checked by a unit test there):
//! - AllReduce (ring and tree), Reduce, ReduceScatter: every type × two operator entries: `sum`,
//!   with the operator compiled in (Avg runs it too, with a post-division by `nranks` read at run
//!   time), and `any`, which applies the call's operator (prod, max, min, premulsum) read at run
//!   time (`reduce::FuncAny`).
//! - Broadcast, AllGather: they only move bytes, so one entry per element size (uint8, half,
//!   uint32, uint64) with the sum operator; and, where the checked code sends ahead of the call
//!   check's gate (LL and LL128; AllGather from 4-byte elements), a second, `_checked`, that
//!   calls with the check on run, so that the unchecked entry keeps the code it has without
//!   the check (`crate::abi::checked_entry`).
//! - Each of those for each protocol (LL, LL128, Simple), so a module holds one protocol's code
//!   and a program JIT-compiles only the protocols its calls use.
//!
//! `OXCCL_ONLY_FUNCS` (like NCCL's `ONLY_FUNCS`) keeps only the rows that match, for a fast local
//! edit loop: a `|`- or `,`-separated list of patterns, each a list of space-separated words that
//! must all name one of the row's fields (collective, `ring`/`tree`, `ll`/`ll128`/`simple`, type,
//! operator, `checked`; case-insensitive; `f32`-style type names work too; for Broadcast and AllGather any
//! call type of the entry's element size, `broadcast int32` naming the `uint32` entry). E.g.
//! `OXCCL_ONLY_FUNCS="allreduce float sum"` builds the ring and tree float-sum AllReduce only, on
//! every protocol. A call whose entry is not built fails with an
//! error naming the entry and the variable. Unset or empty: everything (what CI builds).
use std::fmt::Write as _;
// Included by the no_std crate for its unit tests (`src/lib.rs`): std's prelude by name there.
#[cfg(test)]
use std::{format, println, string::String, string::ToString, vec, vec::Vec};

/// (ABI variant, NCCL name, Rust type, short name, bytes per element).
type Dtype = (&'static str, &'static str, &'static str, &'static str, usize);
const DTYPES: [Dtype; 12] = [
    ("I8", "int8", "i8", "i8", 1),
    ("U8", "uint8", "u8", "u8", 1),
    ("I32", "int32", "i32", "i32", 4),
    ("U32", "uint32", "u32", "u32", 4),
    ("I64", "int64", "i64", "i64", 8),
    ("U64", "uint64", "u64", "u64", 8),
    ("F16", "half", "f16", "f16", 2),
    ("F32", "float", "f32", "f32", 4),
    ("F64", "double", "f64", "f64", 8),
    ("Bf16", "bfloat16", "bf16", "bf16", 2),
    ("F8E4M3", "f8e4m3", "F8E4M3", "e4m3", 1),
    ("F8E5M2", "f8e5m2", "F8E5M2", "e5m2", 1),
];

/// (`KernelOp` variant, name, operator type, the call operators the entry runs).
const OPS: [(&str, &str, &str, &[&str]); 2] = [
    ("Sum", "sum", "FuncSum", &["sum", "avg"]),
    ("Any", "any", "FuncAny", &["prod", "max", "min", "premulsum"]),
];

/// (ABI variant, name suffix).
const PROTOS: [(&str, &str); 3] = [("Ll", "ll"), ("Ll128", "ll128"), ("Simple", "simple")];

struct Row {
    name: String,
    func: &'static str,
    algo: &'static str,
    proto: (&'static str, &'static str),
    dtype: Dtype,
    op: (&'static str, &'static str, &'static str, &'static [&'static str]),
    /// The entry of checked launches ([`crate::abi::checked_entry`]).
    checked: bool,
}

impl Row {
    /// The words a pattern of `OXCCL_ONLY_FUNCS` may name: the row's fields, the call
    /// operators its entry runs (`max` names the `any` entries) and, for the collectives that
    /// only move bytes (Broadcast, AllGather: one entry per element size), every call type of
    /// that size (`broadcast int32` names the `uint32` entry a Broadcast of int32 runs).
    fn fields(&self) -> Vec<String> {
        let mut f = vec![
            self.func.to_ascii_lowercase(),
            self.algo.to_ascii_lowercase(),
            self.proto.1.to_string(),
            self.dtype.1.to_string(),
            self.dtype.3.to_string(),
            self.op.1.to_string(),
        ];
        f.extend(self.op.3.iter().map(|o| o.to_string()));
        if self.checked {
            f.push("checked".to_string());
        }
        if matches!(self.func, "Broadcast" | "AllGather") {
            for d in DTYPES.iter().filter(|d| d.4 == self.dtype.4) {
                f.extend([d.1.to_string(), d.3.to_string()]);
            }
        }
        f
    }
}

fn rows() -> Vec<Row> {
    let mut rows = Vec::new();
    for proto in PROTOS {
        for (func, algo) in [
            ("AllReduce", "Ring"),
            ("Reduce", "Ring"),
            ("ReduceScatter", "Ring"),
            ("AllReduce", "Tree"),
        ] {
            for dtype in DTYPES {
                for op in OPS {
                    let tree = if algo == "Tree" { "_tree" } else { "" };
                    rows.push(Row {
                        name: format!(
                            "oxccl_{}{tree}_{}_{}_{}",
                            func.to_ascii_lowercase(),
                            proto.1,
                            dtype.1,
                            op.1
                        ),
                        func,
                        algo,
                        proto,
                        dtype,
                        op,
                        checked: false,
                    });
                }
            }
        }
        for func in ["Broadcast", "AllGather"] {
            for dtype in DTYPES
                .into_iter()
                .filter(|d| ["U8", "F16", "U32", "U64"].contains(&d.0))
            {
                for (checked, suffix) in [(false, ""), (true, "_checked")] {
                    // A checked entry of its own only where the checked code sends ahead of the
                    // gate (`crate::abi::checked_entry`): not on Simple, and for AllGather not
                    // below 4-byte elements (`crate::coll::AHEAD_MIN_ELEM_BYTES`); elsewhere it
                    // would be its unchecked twin's code.
                    if checked && (proto.0 == "Simple" || func == "AllGather" && ["U8", "F16"].contains(&dtype.0)) {
                        continue;
                    }
                    rows.push(Row {
                        name: format!("oxccl_{}_{}_{}_sum{suffix}", func.to_ascii_lowercase(), proto.1, dtype.1),
                        func,
                        algo: "Ring",
                        proto,
                        dtype,
                        op: OPS[0],
                        checked,
                    });
                }
            }
        }
    }
    rows
}

/// Whether `row` matches the filter `only` (see the module docs); `None` keeps everything.
fn keep(row: &Row, only: Option<&str>) -> bool {
    let Some(only) = only.map(str::trim).filter(|s| !s.is_empty()) else {
        return true;
    };
    let fields = row.fields();
    only.split(['|', ','])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|pattern| {
            pattern
                .split_whitespace()
                .all(|w| fields.iter().any(|f| f.eq_ignore_ascii_case(w)))
        })
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=OXCCL_ONLY_FUNCS");
    let only = std::env::var("OXCCL_ONLY_FUNCS").ok();
    let all = rows();
    let kept: Vec<&Row> = all.iter().filter(|r| keep(r, only.as_deref())).collect();
    if kept.is_empty() {
        panic!(
            "OXCCL_ONLY_FUNCS={:?} matches no kernel entry: name a collective (allreduce, reduce, \
             reducescatter, broadcast, allgather), ring/tree, ll/ll128/simple, a type (float, f32, ...), an operator \
             (sum, avg, prod, max, min, premulsum, any) or checked",
            only.unwrap_or_default()
        );
    }
    if kept.len() < all.len() {
        println!(
            "cargo:warning=OXCCL_ONLY_FUNCS: building {} of {} kernel entries",
            kept.len(),
            all.len()
        );
    }
    let mut s = String::from(
        "// Generated by gpu/build.rs: the kernel entry table.\n// name => func, algo, protocol, dtype variant, element type, operator variant, operator type, checked;\nentries! {\n",
    );
    for r in &kept {
        let _ = writeln!(
            s,
            "    {} => {}, {}, {}, {}, {}, {}, {}, {};",
            r.name, r.func, r.algo, r.proto.0, r.dtype.0, r.dtype.2, r.op.0, r.op.2, r.checked
        );
    }
    s.push_str("}\n");
    // The same rows for the nvptx kernels, one module per (collective, algorithm, protocol,
    // type): rustc cuts codegen units along modules, so the kernels compile in parallel.
    let mut k = String::from(
        "// Generated by gpu/build.rs: the kernel entry table, one module per (func, algo, protocol, dtype).\n",
    );
    let mut i = 0;
    while i < kept.len() {
        let r = kept[i];
        let same = |o: &Row| (o.func, o.algo, o.proto.1, o.dtype.1) == (r.func, r.algo, r.proto.1, r.dtype.1);
        let _ = writeln!(
            k,
            "mod {}_{}_{}_{} {{\n    use super::*;\n    entries! {{",
            r.func.to_ascii_lowercase(),
            r.algo.to_ascii_lowercase(),
            r.proto.1,
            r.dtype.1
        );
        while i < kept.len() && same(kept[i]) {
            let r = kept[i];
            let _ = writeln!(
                k,
                "        {} => {}, {}, {}, {}, {}, {}, {}, {};",
                r.name, r.func, r.algo, r.proto.0, r.dtype.0, r.dtype.2, r.op.0, r.op.2, r.checked
            );
            i += 1;
        }
        k.push_str("    }\n}\n");
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    for (file, text) in [("entries.rs", s), ("kernel_modules.rs", k)] {
        let path = out.join(file);
        // Rewrite only on change, so an unrelated rerun leaves the crate fresh.
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            std::fs::write(&path, text).expect("write the kernel entry table");
        }
    }
}

// Run as `oxccl-gpu`'s unit tests (`src/lib.rs` includes this file under `cfg(test)`).
#[cfg(test)]
mod tests {
    use super::*;

    /// The names of the entries `only` keeps.
    fn kept(only: &str) -> Vec<String> {
        rows().into_iter().filter(|r| keep(r, Some(only))).map(|r| r.name).collect()
    }

    #[test]
    fn a_call_type_names_the_byte_moving_entry_of_its_size() {
        assert_eq!(
            kept("broadcast int32"),
            [
                "oxccl_broadcast_ll_uint32_sum",
                "oxccl_broadcast_ll_uint32_sum_checked",
                "oxccl_broadcast_ll128_uint32_sum",
                "oxccl_broadcast_ll128_uint32_sum_checked",
                "oxccl_broadcast_simple_uint32_sum"
            ]
        );
        assert_eq!(kept("allgather ll float"), ["oxccl_allgather_ll_uint32_sum", "oxccl_allgather_ll_uint32_sum_checked"]);
        assert_eq!(kept("broadcast ll128 f64 checked"), ["oxccl_broadcast_ll128_uint64_sum_checked"]);
        // Checked entries only where the checked code sends ahead of the gate: not on Simple,
        // and AllGather's 1- and 2-byte kernels gate first in their unchecked entry.
        assert_eq!(kept("allgather ll bfloat16"), ["oxccl_allgather_ll_half_sum"]);
        assert_eq!(kept("allgather ll128 f8e4m3"), ["oxccl_allgather_ll128_uint8_sum"]);
        assert!(kept("simple checked").is_empty());
        assert_eq!(kept("checked").len(), 12);
        // Only the byte-moving collectives have checked entries.
        assert!(kept("allreduce checked").is_empty());
    }

    #[test]
    fn reducing_entries_keep_their_own_types_and_operators() {
        // A reduction of int32 runs its own entry, never uint32's.
        assert_eq!(kept("allreduce ring simple int32 sum"), ["oxccl_allreduce_simple_int32_sum"]);
        assert_eq!(kept("reduce ll float max"), ["oxccl_reduce_ll_float_any"]);
        assert_eq!(kept("reducescatter ll128 half avg"), ["oxccl_reducescatter_ll128_half_sum"]);
        // Several patterns: the union, in table order.
        assert_eq!(
            kept("broadcast ll int64 | allreduce tree ll uint32 sum"),
            [
                "oxccl_allreduce_tree_ll_uint32_sum",
                "oxccl_broadcast_ll_uint64_sum",
                "oxccl_broadcast_ll_uint64_sum_checked"
            ]
        );
        assert!(kept("allreduce nosuchtype").is_empty());
    }
}
