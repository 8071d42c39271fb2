//! Test hooks of communicator setup, read only by tests and benchmarks that simulate what one
//! machine cannot have: `OXCCL_TEST_NODES` (an `init_all` group split into nodes, as if on several
//! hosts) and `OXCCL_TEST_TREE_PATTERN` (the tree pattern across those nodes). Both are oxccl
//! spellings only; NCCL has no such variables. (`OXCCL_TEST_INITIAL_STEP`, the step every
//! connection starts from, is read with the other parameters: `Params::initial_step`.)
use super::*;

/// The node count of a [`Comm::init_all`] communicator (CPU target or CUDA) from the test hook
/// `OXCCL_TEST_NODES=N` (oxccl spelling only): its ranks are split into `N` equal nodes of
/// consecutive ranks — node `n` holds ranks `n·k .. (n+1)·k` with `k = nranks / N` — as if they ran
/// on `N` hosts, for the trees only (`rank_trees::setup` takes these nodes instead of the hosts).
/// Rings and transports are unchanged; with `N ≥ 2` the double binary tree's connections are set up
/// too, so `NCCL_ALGO=tree` can run (and the tuning model may choose the tree for AllReduce).
/// `None` when unset or 1. Errors: `InvalidArgument` naming the variable unless `N` is a divisor
/// of `nranks` in `1..=nranks`.
pub(super) fn test_nodes(nranks: usize) -> Result<Option<usize>> {
    let Ok(v) = std::env::var("OXCCL_TEST_NODES") else {
        return Ok(None);
    };
    let bad = || {
        Error::invalid(format!(
            "OXCCL_TEST_NODES={v:?}: accepted a divisor of the rank count {nranks} in 1..={nranks} \
             (the ranks split into that many equal nodes)"
        ))
    };
    let n: usize = v.trim().parse().map_err(|_| bad())?;
    if n == 0 || n > nranks || !nranks.is_multiple_of(n) {
        return Err(bad());
    }
    Ok((n > 1).then_some(n))
}

/// The tree pattern of an `init_all` communicator split into test nodes, from the test hook
/// `OXCCL_TEST_TREE_PATTERN` (oxccl spelling only): `balanced` (the default, NCCL's
/// `NCCL_TOPO_PATTERN_BALANCED_TREE`), `split` or `tree` (`NCCL_TOPO_PATTERN_TREE`: both child
/// nodes hang from the node's first rank, which then has three children with its chain's next
/// rank). Errors: `InvalidArgument` naming the variable and the accepted values.
pub(super) fn test_tree_pattern() -> Result<crate::graph::Pattern> {
    use crate::graph::Pattern;
    match std::env::var("OXCCL_TEST_TREE_PATTERN").as_deref() {
        Err(_) | Ok("balanced") => Ok(Pattern::BalancedTree),
        Ok("split") => Ok(Pattern::SplitTree),
        Ok("tree") => Ok(Pattern::Tree),
        Ok(v) => Err(Error::invalid(format!(
            "OXCCL_TEST_TREE_PATTERN={v:?}: accepted balanced, split or tree"
        ))),
    }
}
