//! Splitting and shrinking a communicator (NCCL's `ncclCommSplit` and `ncclCommShrink`, in
//! `init.cc`). Split: every rank names a colour and a key; the ranks of one colour form a new
//! communicator, ordered by key (ties by their rank in the parent), and a rank with no colour
//! gets none. Shrink: the ranks not excluded form a new communicator, in their parent order,
//! without the excluded ones taking part (they may have failed).
//!
//! The ranks exchange their colour and key over the parent's bootstrap; the first rank of each
//! new communicator makes its unique id (a bootstrap root of its own, in its process) and sends
//! it in a second exchange; then each rank runs [`Comm::init_rank`] with it on its own device.
//! So a split communicator is an `init_rank` communicator, whatever its parent was, and is
//! independent of it (either may be dropped first).
use super::*;

/// The colour of a rank that takes part in a split but joins no new communicator (NCCL's
/// `NCCL_SPLIT_NOCOLOR`).
pub const SPLIT_NOCOLOR: i32 = -1;

impl Comm {
    /// Splits this communicator (NCCL's `ncclCommSplit`): a collective call of every rank of
    /// it, each naming `color` (≥ 0, or [`SPLIT_NOCOLOR`]) and `key`. The ranks of one colour
    /// form a new communicator in which they are ordered by `key`, ties by their rank here; it
    /// has this rank's device, and the environment's settings (read again, as for
    /// [`Comm::init_rank`]). Returns `None` for [`SPLIT_NOCOLOR`]. Blocks until every rank of
    /// its colour has joined. Errors: a colour below −1 (InvalidArgument, on every rank: each
    /// learns of it in the exchange), a finalized or aborted communicator, bootstrap and init
    /// errors.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Comm>> {
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was finalized; only destroy is allowed after finalize",
                self.rank
            )));
        }
        if self.flag_state() != 0 && !self.is_revoked() {
            return self.get_async_error().map(|_| None);
        }
        let mp = self.init_rank_res();
        let bad = (color < SPLIT_NOCOLOR).then(|| {
            format!("color {color} of rank {} is invalid (accepted: ≥ 0, or NOCOLOR = -1)", self.rank)
        });
        let mine = match &bad {
            Some(why) => format!("E{why}"),
            None => format!("{color} {key}"),
        };
        let all = mp.bootstrap.allgather(mine.as_bytes())?;
        let mut entries: Vec<(i32, i32, usize)> = Vec::with_capacity(self.nranks);
        for (r, b) in all.iter().enumerate() {
            let s = String::from_utf8_lossy(b);
            if let Some(why) = s.strip_prefix('E') {
                return Err(Error::invalid(format!("split on rank {}: {why}", self.rank)));
            }
            let mut it = s.split(' ').map(str::parse::<i32>);
            match (it.next(), it.next()) {
                (Some(Ok(c)), Some(Ok(k))) => entries.push((c, k, r)),
                _ => return Err(Error::Internal(format!("split: rank {r} sent {s:?}"))),
            }
        }
        let members = split_members(&entries, color);
        let me = members.iter().position(|&r| r == self.rank);
        // The first member of each colour makes the new communicator's id.
        let id = match (color, me) {
            (c, Some(0)) if c >= 0 => {
                let mut cfg = crate::bootstrap::BootstrapConfig::from_env()?;
                // A fixed root address (NCCL_COMM_ID) would be shared by every colour.
                cfg.comm_id = None;
                Some(crate::bootstrap::get_unique_id_with(&cfg)?)
            }
            _ => None,
        };
        let ids = mp
            .bootstrap
            .allgather(&id.as_ref().map_or_else(Vec::new, |i| i.to_bytes().to_vec()))?;
        let (Some(me), Some(&first)) = (me, members.first()) else {
            return Ok(None);
        };
        let id = crate::bootstrap::UniqueId::from_bytes(&ids[first])?;
        tracing::debug!(target: "oxccl::init", rank = self.rank, color, key, new_rank = me, nranks = members.len(), "split");
        Comm::init_rank_config(members.len(), &id, me, self.device, &self.config).map(Some)
    }
}

/// Bootstrap tag of the unique id a shrink's first surviving rank sends to the others.
const SHRINK_TAG: u32 = 0x5348_0000;

impl Comm {
    /// Shrinks this communicator (NCCL's `ncclCommShrink`): a collective call of every rank
    /// *not* in `exclude` (parent ranks, each in `0..nranks`, no duplicates), which form a new
    /// communicator in their order here (new rank = position among them) on this rank's device,
    /// with the environment's settings. The excluded ranks take no part: they may have failed.
    /// With `abort_first` (NCCL's `NCCL_SHRINK_ABORT`) this rank's operations still waiting
    /// on the parent are aborted first ([`Comm::abort`]; the parent is unusable afterwards);
    /// otherwise (`NCCL_SHRINK_DEFAULT`) the parent stays usable. Blocks until every surviving
    /// rank has joined. Errors: InvalidArgument for an excluded rank out of range, a duplicate,
    /// or this rank itself among them; InvalidUsage on a finalized (or, without `abort_first`,
    /// aborted) parent; bootstrap and init errors.
    pub fn shrink(&self, exclude: &[usize], abort_first: bool) -> Result<Comm> {
        let survivors = shrink_survivors(self.nranks, exclude, self.rank)?;
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the communicator was finalized; only destroy is allowed after finalize",
                self.rank
            )));
        }
        if abort_first && !self.is_revoked() {
            self.abort()?;
        } else if self.flag_state() != 0 && !self.is_revoked() {
            self.get_async_error()?;
        }
        let me = survivors.iter().position(|&r| r == self.rank).unwrap_or(0);
        let first = survivors[0];
        let mp = self.init_rank_res();
        let id = if me == 0 {
            let mut cfg = crate::bootstrap::BootstrapConfig::from_env()?;
            // A fixed root address (NCCL_COMM_ID) may be the parent's.
            cfg.comm_id = None;
            let id = crate::bootstrap::get_unique_id_with(&cfg)?;
            for &peer in &survivors[1..] {
                mp.bootstrap.send(peer, SHRINK_TAG, &id.to_bytes())?;
            }
            id
        } else {
            crate::bootstrap::UniqueId::from_bytes(&mp.bootstrap.recv(first, SHRINK_TAG)?)?
        };
        tracing::debug!(target: "oxccl::init", rank = self.rank, ?exclude, new_rank = me, nranks = survivors.len(), "shrink");
        Comm::init_rank_config(survivors.len(), &id, me, self.device, &self.config)
    }
}

/// The parent ranks that remain after excluding `exclude` from `0..nranks`, checked: every
/// excluded rank in range, none twice, and not `me` (the caller takes part).
fn shrink_survivors(nranks: usize, exclude: &[usize], me: usize) -> Result<Vec<usize>> {
    let mut out = vec![true; nranks];
    for (i, &r) in exclude.iter().enumerate() {
        if r >= nranks {
            return Err(Error::invalid(format!(
                "excluded rank {r} (entry {i}) is out of range (accepted: 0..{nranks})"
            )));
        }
        if !std::mem::replace(&mut out[r], false) {
            return Err(Error::invalid(format!("excluded rank {r} is listed twice")));
        }
    }
    if !out[me] {
        return Err(Error::invalid(format!(
            "rank {me} is in its own exclude list: only the surviving ranks call shrink"
        )));
    }
    Ok((0..nranks).filter(|&r| out[r]).collect())
}

/// The parent ranks of colour `color` in their new order (by key, then parent rank), from every
/// rank's (colour, key, parent rank); empty for [`SPLIT_NOCOLOR`].
fn split_members(entries: &[(i32, i32, usize)], color: i32) -> Vec<usize> {
    if color < 0 {
        return Vec::new();
    }
    let mut m: Vec<(i32, usize)> = entries
        .iter()
        .filter(|(c, _, _)| *c == color)
        .map(|&(_, k, r)| (k, r))
        .collect();
    m.sort();
    m.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_ordered_by_key_then_parent_rank() {
        let e = [(1, 5, 0), (0, 0, 1), (1, 2, 2), (-1, 0, 3), (1, 2, 4), (0, -3, 5)];
        assert_eq!(split_members(&e, 1), [2, 4, 0]);
        assert_eq!(split_members(&e, 0), [5, 1]);
        assert!(split_members(&e, SPLIT_NOCOLOR).is_empty());
        assert!(split_members(&e, 7).is_empty());
    }

    #[test]
    fn shrink_keeps_the_others_in_order_and_checks_the_list() {
        assert_eq!(shrink_survivors(5, &[3, 1], 0).unwrap(), [0, 2, 4]);
        assert_eq!(shrink_survivors(2, &[], 1).unwrap(), [0, 1]);
        let e = shrink_survivors(4, &[4], 0).unwrap_err().to_string();
        assert!(e.contains("excluded rank 4 (entry 0) is out of range (accepted: 0..4)"), "{e}");
        let e = shrink_survivors(4, &[2, 2], 0).unwrap_err().to_string();
        assert!(e.contains("excluded rank 2 is listed twice"), "{e}");
        let e = shrink_survivors(4, &[1], 1).unwrap_err().to_string();
        assert!(e.contains("rank 1 is in its own exclude list"), "{e}");
    }
}
