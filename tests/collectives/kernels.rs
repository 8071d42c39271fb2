//! The embedded PTX modules (`oxccl::kernels`): one module per kernel entry point, each
//! self-contained (every function it calls or names is defined in it), none holding another
//! kernel, each smaller than the linked PTX it was split from. Pure text checks: no GPU needed.
use oxccl::kernels::PTX_BYTES;
use oxccl::{Algo, DataType, DevRedOp, Func, Proto};
use oxccl_gpu::abi::{kernel_name, kernel_name_for};
use std::collections::{BTreeMap, BTreeSet};

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$'
}

/// `ptx` without `//` line comments and `/* */` block comments (one linear pass).
fn strip_comments(ptx: &str) -> String {
    let b = ptx.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                i += 1;
            }
            i += 2;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("comments are removed at ASCII boundaries")
}

/// Identifier tokens of `text` (PTX identifiers: letters, digits, `_`, `$`; `%` registers and
/// `.` directives excluded).
fn tokens(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i] as char;
        if is_ident(c) {
            let start = i;
            while i < b.len() && is_ident(b[i] as char) {
                i += 1;
            }
            let prev = if start > 0 { b[start - 1] as char } else { ' ' };
            if prev != '%' && prev != '.' && !text[start..i].starts_with(|c: char| c.is_ascii_digit()) {
                out.push((start, &text[start..i]));
            }
        } else {
            i += 1;
        }
    }
    out.into_iter()
}

/// Position just after `kw` followed by an optional `(...)` return-parameter list: where the
/// symbol's name starts.
fn name_after(text: &str, pos: usize) -> Option<(usize, String)> {
    let mut rest = text[pos..].trim_start();
    if rest.starts_with('(') {
        rest = rest[rest.find(')')? + 1..].trim_start();
    }
    let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
    let at = text.len() - rest.len() + name.len();
    (!name.is_empty()).then_some((at, name))
}

/// The first of `{` or `;` after `pos` outside parentheses: true when a body follows.
fn has_body(text: &str, pos: usize) -> bool {
    let mut depth = 0i32;
    for c in text[pos..].chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            '{' if depth == 0 => return true,
            ';' if depth == 0 => return false,
            _ => {}
        }
    }
    false
}

struct Module {
    /// `.entry` names.
    entries: Vec<String>,
    /// Functions defined (`.func name(...) ... {`).
    defined: BTreeSet<String>,
    /// Functions declared without a body.
    declared: BTreeSet<String>,
    /// Call targets (`call`, `call.uni`).
    calls: BTreeSet<String>,
    /// Global/shared/const variables defined at the top level.
    vars: BTreeSet<String>,
    /// Every identifier in the code.
    idents: BTreeSet<String>,
}

fn parse(ptx: &str) -> Module {
    let code = strip_comments(ptx);
    let mut m = Module {
        entries: Vec::new(),
        defined: BTreeSet::new(),
        declared: BTreeSet::new(),
        calls: BTreeSet::new(),
        vars: BTreeSet::new(),
        idents: BTreeSet::new(),
    };
    let mut depth = 0i32;
    let mut line_start = 0;
    for line in code.split_inclusive('\n') {
        let t = line.trim();
        if depth == 0 {
            for kw in [".entry", ".func"] {
                if let Some(p) = t.find(kw).filter(|&p| {
                    let after = t[p + kw.len()..].chars().next();
                    after.is_none_or(|c| !is_ident(c) && c != '.')
                }) {
                    let abs = line_start + (line.len() - line.trim_start().len()) + p + kw.len();
                    if let Some((after, name)) = name_after(&code, abs) {
                        if kw == ".entry" {
                            m.entries.push(name.clone());
                        }
                        if has_body(&code, after) {
                            m.defined.insert(name);
                        } else {
                            m.declared.insert(name);
                        }
                    }
                }
            }
            if (t.starts_with(".global")
                || t.starts_with(".shared")
                || t.starts_with(".const")
                || t.starts_with(".visible .global")
                || t.starts_with(".weak .global"))
                && !t.contains(".func")
            {
                let decl = t.split(['[', '=', ';']).next().unwrap_or("");
                if let Some(name) = decl.split_whitespace().last() {
                    m.vars.insert(name.to_string());
                }
            }
        }
        depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
        line_start += line.len();
    }
    // Call targets: `call` or `call.<mod>`, optional `(retvals),`, then the callee.
    for (pos, tok) in tokens(&code) {
        m.idents.insert(tok.to_string());
        if tok == "call" {
            let mut p = pos + 4;
            while code[p..].starts_with('.') {
                p += 1 + code[p + 1..].chars().take_while(|&c| is_ident(c)).count();
            }
            let mut rest = code[p..].trim_start();
            if rest.starts_with('(') {
                let close = rest.find(')').expect("unclosed call return list");
                rest = rest[close + 1..]
                    .trim_start()
                    .trim_start_matches(',')
                    .trim_start();
            }
            let callee: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            assert!(
                !callee.is_empty(),
                "cannot read a call target near: {:.120}",
                &code[pos..]
            );
            m.calls.insert(callee);
        }
    }
    m
}

/// Every embedded kernel module's PTX; fails when none is embedded (a build with
/// `OXCCL_SKIP_PTX`) or one could not be read (`kernels::all` skips a module that does not
/// inflate), so the scans below never pass on nothing.
fn embedded_modules() -> Vec<(&'static str, String)> {
    let modules = oxccl::kernels::all();
    assert!(
        !modules.is_empty(),
        "no PTX modules embedded (built with OXCCL_SKIP_PTX?)"
    );
    assert_eq!(modules.len(), oxccl::kernels::PTX_MODULES.len(), "modules that could not be read");
    modules
}

#[test]
fn every_all_reduce_kernel_has_a_module() {
    let modules = embedded_modules();
    let names: BTreeSet<&str> = modules.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names.len(),
        modules.len(),
        "duplicate module names in PTX_MODULES"
    );
    // The modules are exactly the generated kernel entry table's entries, the point-to-point
    // kernel and the call-signature check's.
    let entries: BTreeSet<&str> = oxccl_gpu::dispatch::ENTRIES
        .iter()
        .map(|e| e.name)
        .chain([oxccl_gpu::abi::P2P_KERNEL_NAME, oxccl_gpu::abi::CHECK_KERNEL_NAME])
        .collect();
    assert_eq!(names, entries, "PTX modules and kernel entry table differ");
    let mut missing = Vec::new();
    for (&dt, &op, &proto) in DataType::ALL.iter().flat_map(|dt| {
        DevRedOp::ALL
            .iter()
            .flat_map(move |op| Proto::ALL.iter().map(move |p| (dt, op, p)))
    }) {
        {
            // The ring's entry point and the tree's (`oxccl_allreduce_tree_<proto>_<dtype>_<op>`),
            // and the other reducing collectives' (PreMulSum's included), on every protocol.
            for k in [
                kernel_name(Func::AllReduce, proto, dt, op),
                kernel_name_for(Func::AllReduce, Algo::Tree, proto, dt, op, false),
                kernel_name(Func::Reduce, proto, dt, op),
                kernel_name(Func::ReduceScatter, proto, dt, op),
            ] {
                if !names.contains(k.as_str()) {
                    missing.push(k.as_str().to_string());
                }
                assert_eq!(
                    oxccl::kernels::module(k.as_str()).is_some(),
                    names.contains(k.as_str())
                );
            }
        }
    }
    assert!(
        missing.is_empty(),
        "{} reducing kernels have no PTX module: {missing:?} (modules: {})",
        missing.len(),
        modules.len()
    );
}

#[test]
fn modules_are_self_contained_single_kernels() {
    let modules = embedded_modules();
    let all_names: BTreeSet<&str> = modules.iter().map(|(n, _)| *n).collect();
    let parsed: BTreeMap<&str, Module> = modules.iter().map(|(n, ptx)| (*n, parse(ptx))).collect();
    // Every function defined anywhere: a module naming one must define it itself.
    let all_funcs: BTreeSet<&str> = parsed
        .values()
        .flat_map(|m| m.defined.iter().map(|s| s.as_str()))
        .collect();
    let all_vars: BTreeSet<&str> = parsed
        .values()
        .flat_map(|m| m.vars.iter().map(|s| s.as_str()))
        .collect();
    let mut total = 0usize;
    let mut largest = (0usize, "");
    let mut problems = Vec::new();
    for (name, ptx) in &modules {
        let m = &parsed[name];
        total += ptx.len();
        if ptx.len() > largest.0 {
            largest = (ptx.len(), name);
        }
        let first = ptx
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with("//"));
        if !first.is_some_and(|l| l.starts_with(".version")) {
            problems.push(format!("{name}: the first directive is {first:?}, not .version"));
        }
        if !ptx.contains(".target") || !ptx.contains(".address_size 64") {
            problems.push(format!("{name}: no .target / .address_size 64 header"));
        }
        if m.entries != [name.to_string()] {
            problems.push(format!(
                "{name}: holds entry points {:?}, expected exactly [{name}]",
                m.entries
            ));
        }
        if !m.defined.contains(*name) {
            problems.push(format!("{name}: its .entry has no body"));
        }
        for other in all_names.iter().filter(|o| *o != name) {
            if m.idents.contains(*other) {
                problems.push(format!("{name}: names another kernel, {other}"));
            }
        }
        let n_entry = strip_comments(ptx).matches(".entry").count();
        if n_entry != 1 {
            problems.push(format!("{name}: {n_entry} .entry directives"));
        }
        for callee in &m.calls {
            if !m.defined.contains(callee) {
                problems.push(format!(
                    "{name}: calls {callee}, which the module does not define"
                ));
            }
        }
        for decl in &m.declared {
            if !m.defined.contains(decl) {
                problems.push(format!("{name}: declares {decl} without defining it"));
            }
        }
        for id in &m.idents {
            if all_funcs.contains(id.as_str()) && !m.defined.contains(id) {
                problems.push(format!(
                    "{name}: refers to function {id}, which it does not define"
                ));
            }
            if all_vars.contains(id.as_str()) && !m.vars.contains(id) {
                problems.push(format!(
                    "{name}: refers to variable {id}, which it does not define"
                ));
            }
        }
        if ptx.len() >= PTX_BYTES {
            problems.push(format!(
                "{name}: {} bytes, not smaller than the linked PTX ({PTX_BYTES} bytes)",
                ptx.len()
            ));
        }
    }
    let ncalls: usize = parsed.values().map(|m| m.calls.len()).sum();
    let nfuncs: usize = parsed.values().map(|m| m.defined.len()).sum();
    eprintln!(
        "kernels: {} modules, {total} bytes in all (largest {} bytes, {}); linked PTX {PTX_BYTES} bytes; \
         {nfuncs} functions defined and {ncalls} call targets over all modules (entries included)",
        modules.len(),
        largest.0,
        largest.1
    );
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The parser above must find what it checks for (a parser that finds nothing would pass).
#[test]
fn parser_finds_entries_calls_and_definitions() {
    let ptx = "//\n// header\n.version 7.0\n.target sm_70\n.address_size 64\n\
               .func (.param .b32 r) g\n(\n\t.param .b64 p\n)\n;\n\
               .global .align 4 .b8 tbl[4] = {1, 2, 3, 4};\n\
               .func (.param .b32 r) g(\n\t.param .b64 p\n)\n{\n\tret;\n}\n\
               .func h()\n.noreturn\n{\n\ttrap;\n}\n\
               .visible .entry k(\n\t.param .b64 a\n)\n{\n\t{ // callseq 0, 0\n\tcall.uni (retval0), \n\tg, \n\t(\n\tparam0\n\t);\n\
               \tcall h, ();\n\tmov.u64 %rd1, tbl;\n\t// call.uni nothere, ();\n\t}\n\tret;\n}\n";
    let m = parse(ptx);
    assert_eq!(m.entries, ["k"]);
    assert_eq!(m.defined, ["g", "h", "k"].iter().map(|s| s.to_string()).collect());
    assert_eq!(m.declared, ["g"].iter().map(|s| s.to_string()).collect());
    assert_eq!(m.calls, ["g", "h"].iter().map(|s| s.to_string()).collect());
    assert!(m.vars.contains("tbl"), "{:?}", m.vars);
    assert!(!m.idents.contains("nothere"), "comments must be ignored");
    // A call to an undefined function is seen as such.
    let bad = parse(".version 7.0\n.visible .entry k()\n{\n\tcall.uni missing, ();\n\tret;\n}\n");
    assert!(bad.calls.contains("missing") && !bad.defined.contains("missing"));
}

/// The opcode of each PTX instruction line of `ptx` (comments removed): its first word after an
/// optional `@p` guard, e.g. `bar.sync` or `barrier.sync.aligned`.
fn opcodes(ptx: &str) -> Vec<String> {
    strip_comments(ptx)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let first = w.next()?;
            let op = if first.starts_with('@') { w.next()? } else { first };
            Some(op.trim_end_matches(';').to_string())
        })
        .collect()
}

/// Is `op` a CTA barrier that requires every thread of a warp to execute the *same* instruction
/// (`bar.sync`/`bar.arrive`/`bar.red` are `barrier.*.aligned`)?
fn is_aligned_barrier(op: &str) -> bool {
    let parts: Vec<&str> = op.split('.').collect();
    match parts.first() {
        Some(&"bar") => parts
            .get(1)
            .is_some_and(|p| matches!(*p, "sync" | "arrive" | "red") || (*p == "cta" && parts.len() > 2)),
        Some(&"barrier") => parts.contains(&"aligned"),
        _ => false,
    }
}

/// No kernel uses an aligned CTA barrier. rustc does not mark inline assembly `convergent`, so
/// LLVM may duplicate a barrier into both arms of a branch on the thread index; with an aligned
/// barrier that is undefined behaviour, and on H200 it deadlocked every Simple kernel (thread 0
/// at its copy of `bar.sync`, the rest of its warp at a reconvergence point before theirs). The
/// non-aligned `barrier.sync` stays correct under any such duplication.
#[test]
fn kernels_use_only_non_aligned_barriers() {
    let modules = embedded_modules();
    let mut bad = Vec::new();
    let mut barriers = 0usize;
    for (name, ptx) in &modules {
        let ops = opcodes(ptx);
        barriers += ops.iter().filter(|o| o.starts_with("barrier.sync")).count();
        let aligned: Vec<&String> = ops.iter().filter(|o| is_aligned_barrier(o)).collect();
        if !aligned.is_empty() {
            bad.push(format!("{name}: {} x {}", aligned.len(), aligned[0]));
        }
    }
    assert!(
        bad.is_empty(),
        "{} kernels use aligned barriers (first: {:?})",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    assert!(
        barriers > 0,
        "no barrier.sync found in any kernel: the opcode scan is broken"
    );
}

#[test]
fn aligned_barrier_detection() {
    for op in [
        "bar.sync",
        "bar.arrive",
        "bar.red.popc.u32",
        "bar.cta.sync",
        "barrier.sync.aligned",
        "barrier.cta.arrive.aligned",
    ] {
        assert!(is_aligned_barrier(op), "{op}");
    }
    for op in [
        "barrier.sync",
        "barrier.cta.sync",
        "bar.warp.sync",
        "fence.acq_rel.sys",
        "ld.volatile.global.u64",
    ] {
        assert!(!is_aligned_barrier(op), "{op}");
    }
    assert_eq!(
        opcodes("\t@%p1 bar.sync 0;\n// bar.sync 1;\n\tbarrier.sync 0;\n"),
        vec!["bar.sync".to_string(), "barrier.sync".to_string()]
    );
}

/// Whether a module's PTX declares a local-memory frame (LLVM's NVPTX backend names every one
/// `__local_depot<N>`).
fn keeps_local_array(ptx: &str) -> bool {
    ptx.contains("__local_depot")
}

#[test]
fn local_array_detection() {
    assert!(keeps_local_array(".entry k()\n{\n\t.local .align 8 .b8 \t__local_depot0[16];\n\tmov.b64 %SPL, __local_depot0;\n}"));
    assert!(!keeps_local_array(".entry k()\n{\n\tld.param.b64 %rd1, [k_param_0];\n\tret;\n}"));
}

/// No kernel keeps an array in GPU local memory: LLVM puts an array there (a `__local_depot`
/// in the PTX) when it indexes it at run time or takes its address, e.g. a loop it did not
/// unroll or an array `==` (a `bcmp` of the kernel parameter's address, which copied the whole
/// parameter into local memory). Register spills, which `ptxas` adds later, are not in the PTX.
#[test]
fn kernels_keep_no_array_in_local_memory() {
    let modules = embedded_modules();
    let bad: Vec<String> = modules
        .iter()
        .filter(|(_, ptx)| keeps_local_array(ptx))
        .map(|(name, ptx)| {
            let decl = ptx
                .lines()
                .find(|l| l.contains(".local") && l.contains("__local_depot"))
                .unwrap_or("")
                .trim()
                .to_string();
            format!("{name}: {decl}")
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} kernels keep an array in local memory (first: {:?})",
        bad.len(),
        modules.len(),
        &bad[..bad.len().min(5)]
    );
}

/// No kernel calls a function of its own: the protocol verbs (`Primitives`) and the per-chunk
/// closures of the ring schedules are `#[inline(always)]`. Left to LLVM's inliner, the larger
/// instantiations (bfloat16, 1-byte types, LL128 fans, float ReduceScatter and Reduce) were
/// outlined into `.func`s whose protocol state lived in local memory: 496 bytes of local memory
/// per thread in `oxccl_reducescatter_float_sum` against 136 inlined, and on one H200 the LL128
/// Reduce and ReduceScatter at 4–16 MiB ran 1.24–1.36× faster once inlined (docs/benchmarks.md).
/// Only core's panic handlers (unreachable in practice) may be called.
#[test]
fn kernels_call_nothing_but_panic_handlers() {
    let modules = embedded_modules();
    let mut bad = Vec::new();
    let mut panics = 0usize;
    for (name, ptx) in &modules {
        let m = parse(ptx);
        for callee in &m.calls {
            if callee.contains("panicking") {
                panics += 1;
            } else {
                bad.push(format!("{name} calls {callee}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} calls to outlined functions (first: {:?})",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    // The scan itself: the kernels do call core's panic handlers (bounds and division checks).
    assert!(panics > 0, "no call found in any kernel: the call scan is broken");
}
