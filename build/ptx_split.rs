//! Splits one PTX module into one module per kernel entry point, each holding only the global
//! variables and functions that entry point reaches. Used by build.rs so that the CUDA driver JITs
//! only the kernels a program launches (JIT time grows with module size), and tested in the host
//! crate. The input is LLVM's NVPTX output: a header (`.version`, `.target`, `.address_size`),
//! then top-level items, each a declaration or global ending in `;` at brace depth 0 or a function
//! body ending in a `}` line.
use std::collections::{BTreeMap, BTreeSet, HashMap};

struct Item {
    name: String,
    text: String,
    entry: bool,
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$'
}

/// The symbol an item defines or declares: the identifier after `.entry`/`.func` (skipping a
/// `(.param ...)` return list), or for a variable the identifier before `[`, `=` or `;`.
fn item_name(text: &str) -> Option<(String, bool)> {
    let head: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join(" ");
    for kw in [".entry", ".func"] {
        if let Some(p) = head.find(kw) {
            let mut rest = head[p + kw.len()..].trim_start();
            if rest.starts_with('(') {
                let close = rest.find(')')?;
                rest = rest[close + 1..].trim_start();
            }
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            return (!name.is_empty()).then_some((name, kw == ".entry"));
        }
    }
    let decl = head.split(['[', '=', ';']).next()?;
    let name = decl.split_whitespace().last()?;
    (!name.is_empty() && name.chars().all(is_ident)).then(|| (name.to_string(), false))
}

/// The line before each part of a PTX file that `tools/ptx-link.sh` compiled in parts (each
/// part a whole PTX module of its own, with its own header and helper functions).
pub const PART_MARKER: &str = "// oxccl-ptx-part";

/// Splits `ptx` into `(entry name, module text)` pairs, one per `.entry`, in file order. A file
/// of several parts ([`PART_MARKER`]) is split part by part: a module holds what its entry
/// reaches in its own part.
pub fn split_ptx(ptx: &str) -> Result<Vec<(String, String)>, String> {
    let mut parts: Vec<String> = vec![String::new()];
    for line in ptx.lines() {
        if line.starts_with(PART_MARKER) {
            parts.push(String::new());
        } else if let Some(last) = parts.last_mut() {
            last.push_str(line);
            last.push('\n');
        }
    }
    let mut modules = Vec::new();
    for part in parts.iter().filter(|p| !p.trim().is_empty()) {
        modules.extend(split_module(part)?);
    }
    Ok(modules)
}

/// [`split_ptx`] of one PTX module.
fn split_module(ptx: &str) -> Result<Vec<(String, String)>, String> {
    let mut header = String::new();
    let mut items: Vec<Item> = Vec::new();
    let mut cur = String::new();
    let mut depth: i64 = 0;
    let mut in_header = true;
    for line in ptx.lines() {
        let t = line.trim();
        if in_header {
            if t.is_empty()
                || t.starts_with("//")
                || t.starts_with(".version")
                || t.starts_with(".target")
                || t.starts_with(".address_size")
            {
                header.push_str(line);
                header.push('\n');
                continue;
            }
            in_header = false;
        }
        cur.push_str(line);
        cur.push('\n');
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        let ends = depth == 0 && (t == "}" || (t.ends_with(';') && !t.starts_with("//")));
        if ends {
            let text = std::mem::take(&mut cur);
            let (name, entry) =
                item_name(&text).ok_or_else(|| format!("cannot name PTX item: {text:.200}"))?;
            items.push(Item { name, text, entry });
        }
    }
    if depth != 0 {
        return Err("unbalanced braces in PTX".into());
    }
    // Name -> indices of the items that declare or define it.
    let mut by_name: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, it) in items.iter().enumerate() {
        by_name.entry(it.name.as_str()).or_default().push(i);
    }
    // References of each item: identifiers in its text naming another item.
    let refs: Vec<BTreeSet<usize>> = items
        .iter()
        .map(|it| {
            let mut out = BTreeSet::new();
            for tok in it.text.split(|c: char| !is_ident(c)) {
                if tok != it.name
                    && let Some(ix) = by_name.get(tok)
                {
                    out.extend(ix.iter().copied());
                }
            }
            out
        })
        .collect();
    let mut modules = Vec::new();
    for (i, it) in items.iter().enumerate().filter(|(_, it)| it.entry) {
        let mut keep: BTreeMap<usize, ()> = BTreeMap::new();
        let mut todo = vec![i];
        while let Some(j) = todo.pop() {
            if keep.insert(j, ()).is_none() {
                todo.extend(refs[j].iter().copied());
                // A function's declaration and definition travel together.
                todo.extend(by_name[items[j].name.as_str()].iter().copied());
            }
        }
        let mut text = header.clone();
        for &j in keep.keys() {
            text.push_str(&items[j].text);
        }
        modules.push((it.name.clone(), text));
    }
    Ok(modules)
}
