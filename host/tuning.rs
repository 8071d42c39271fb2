//! Algorithm and protocol selection (NCCL's `tuning.cc` and the `NCCL_ALGO` / `NCCL_PROTO`
//! parsing of `enqueue.cc`).
//!
//! `NCCL_ALGO` and `NCCL_PROTO` (also `OXCCL_ALGO` / `OXCCL_PROTO`) are comma lists of names,
//! case-insensitive; a leading `^` turns the list into exclusions (`^LL,LL128`). A value naming
//! nothing valid is an `InvalidArgument` that names the variable and the accepted values (cases
//! C12, C13). The selection of each call is made among the algorithms and protocols that are both
//! allowed and implemented for the collective; when none is left, the call fails with an error
//! naming the collective and what was allowed — never a silent fallback to something forbidden.
use crate::error::{Error, Result};
use oxccl_gpu::abi::{Algo, Func, Proto};

/// A set of enum values, indexed by their ABI order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allowed<const N: usize>(pub [bool; N]);

/// The algorithms and protocols the environment allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    pub algos: Allowed<{ Algo::COUNT }>,
    pub protos: Allowed<{ Proto::COUNT }>,
}

impl Default for Selection {
    fn default() -> Self {
        Selection {
            algos: Allowed([true; Algo::COUNT]),
            protos: Allowed([true; Proto::COUNT]),
        }
    }
}

/// Parses one NCCL-style list for `var` over `all` (named by `name`).
fn parse_list<T: Copy, const N: usize>(
    var: &str,
    value: &str,
    all: &[T; N],
    name: impl Fn(T) -> &'static str,
) -> Result<Allowed<N>> {
    let accepted = || all.iter().map(|&v| name(v)).collect::<Vec<_>>().join(", ");
    let v = value.trim();
    let (exclude, list) = match v.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, v),
    };
    let mut named = [false; N];
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some(i) = all.iter().position(|&a| name(a).eq_ignore_ascii_case(item)) else {
            return Err(Error::invalid(format!(
                "{var}={value:?}: {item:?} is not a known name (accepted: {}; a leading ^ excludes)",
                accepted()
            )));
        };
        named[i] = true;
    }
    if !named.iter().any(|&b| b) {
        return Err(Error::invalid(format!(
            "{var}={value:?} names nothing (accepted: comma list of {}; a leading ^ excludes)",
            accepted()
        )));
    }
    let allowed = if exclude { named.map(|b| !b) } else { named };
    if !allowed.iter().any(|&b| b) {
        return Err(Error::invalid(format!(
            "{var}={value:?} excludes every value ({})",
            accepted()
        )));
    }
    Ok(Allowed(allowed))
}

impl Selection {
    /// Reads `NCCL_ALGO` / `NCCL_PROTO` (or the `OXCCL_` spellings) through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<(String, String)>) -> Result<Self> {
        let mut s = Selection::default();
        if let Some((var, v)) = get("ALGO") {
            let all: [Algo; Algo::COUNT] = [Algo::Tree, Algo::Ring];
            s.algos = parse_list(&var, &v, &all, Algo::name)?;
        }
        if let Some((var, v)) = get("PROTO") {
            let all: [Proto; Proto::COUNT] = [Proto::Ll, Proto::Ll128, Proto::Simple];
            s.protos = parse_list(&var, &v, &all, Proto::name)?;
        }
        Ok(s)
    }

    /// Reads the environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(crate::params::env_var)
    }

    /// The (algorithm, protocol) for `func`: the best allowed pair that oxccl implements. Today the
    /// ring on the Simple and LL protocols is implemented for every collective (LL128 and tree come
    /// later); a selection that allows none of the implemented pairs is an error naming `func`.
    pub fn choose(&self, func: Func) -> Result<(Algo, Proto)> {
        for &(algo, proto) in implemented(func) {
            if self.algos.0[algo as usize] && self.protos.0[proto as usize] {
                return Ok((algo, proto));
            }
        }
        let names = |v: &[bool], all: &[&str]| {
            all.iter()
                .zip(v)
                .filter(|(_, b)| **b)
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(",")
        };
        Err(Error::invalid(format!(
            "no algorithm/protocol available for {func}: NCCL_ALGO allows {{{}}} and NCCL_PROTO allows {{{}}}, \
             but {func} is implemented only as {}",
            names(&self.algos.0, &[Algo::Tree.name(), Algo::Ring.name()]),
            names(
                &self.protos.0,
                &[Proto::Ll.name(), Proto::Ll128.name(), Proto::Simple.name()]
            ),
            implemented(func)
                .iter()
                .map(|(a, p)| format!("{a}/{p}"))
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }
}

/// (algorithm, protocol) pairs implemented for `func`, in order of preference when the environment
/// allows several. LL runs only when forced (`NCCL_PROTO=LL`) until the size-based model picks it.
pub fn implemented(_func: Func) -> &'static [(Algo, Proto)] {
    &[(Algo::Ring, Proto::Simple), (Algo::Ring, Proto::Ll)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(algo: Option<&str>, proto: Option<&str>) -> Result<Selection> {
        Selection::from_lookup(|k| match k {
            "ALGO" => algo.map(|v| ("NCCL_ALGO".to_string(), v.to_string())),
            "PROTO" => proto.map(|v| ("NCCL_PROTO".to_string(), v.to_string())),
            _ => None,
        })
    }

    #[test]
    fn lists_and_exclusions() {
        let s = sel(None, Some("Simple")).unwrap();
        assert_eq!(s.protos.0, [false, false, true]);
        let s = sel(None, Some("^LL")).unwrap();
        assert_eq!(s.protos.0, [false, true, true]);
        let s = sel(Some("ring, TREE"), Some("ll,ll128")).unwrap();
        assert_eq!(s.algos.0, [true, true]);
        assert_eq!(s.protos.0, [true, true, false]);
        assert_eq!(
            sel(None, Some("Simple"))
                .unwrap()
                .choose(Func::AllReduce)
                .unwrap(),
            (Algo::Ring, Proto::Simple)
        );
    }

    #[test]
    fn bogus_values_name_the_variable_and_the_accepted_values() {
        for v in ["bogus", "", "^", "LL,bogus"] {
            let e = sel(None, Some(v)).unwrap_err();
            let m = e.to_string();
            assert!(matches!(e, Error::InvalidArgument(_)), "{m}");
            assert!(m.contains("NCCL_PROTO") && m.contains("LL, LL128, Simple"), "{m}");
        }
        let e = sel(Some("tree,bogus"), None).unwrap_err().to_string();
        assert!(
            e.contains("NCCL_ALGO") && e.contains("\"bogus\"") && e.contains("tree, ring"),
            "{e}"
        );
        let e = sel(None, Some("^LL,LL128,Simple")).unwrap_err().to_string();
        assert!(e.contains("excludes every value"), "{e}");
    }

    #[test]
    fn nothing_implemented_is_an_explicit_error_naming_the_op() {
        let e = sel(None, Some("LL128"))
            .unwrap()
            .choose(Func::Broadcast)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("broadcast") && e.contains("LL128") && e.contains("ring/Simple"),
            "{e}"
        );
        let e = sel(Some("Tree"), None)
            .unwrap()
            .choose(Func::AllReduce)
            .unwrap_err()
            .to_string();
        assert!(e.contains("allreduce") && e.contains("{tree}"), "{e}");
    }
}
