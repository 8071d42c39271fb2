//! The process environment in tests. Variables are process-global and the library reads them
//! when it creates a communicator (and `get_unique_id`, the topology and bootstrap settings), so
//! every test binary has one lock over them:
//!
//! - a test that sets variables holds an [`Env`] (the lock, exclusively) while its variables are
//!   set: from [`Env::clean`] to its drop, which restores the old values;
//! - a test that creates communicators (or child processes, or unique ids) under the environment
//!   it found holds [`shared`] meanwhile, so no other test's variables leak into them.
//!
//! A thread that holds either guard may take [`shared`] or an [`Env`] again (helpers called
//! inside such a test do): the inner guard then only saves and restores variables. Taking an
//! [`Env`] while this thread holds only [`shared`] panics (the lock cannot be upgraded).
use std::cell::Cell;
use std::ffi::OsString;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static LOCK: RwLock<()> = RwLock::new(());

/// What the current thread holds of [`LOCK`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Held {
    Nothing,
    Shared,
    Exclusive,
}

thread_local! {
    static HELD: Cell<Held> = const { Cell::new(Held::Nothing) };
}

/// The shared hold of the environment lock ([`shared`]).
pub struct Shared {
    _guard: Option<RwLockReadGuard<'static, ()>>,
    before: Held,
}

/// Holds the environment lock shared until the guard drops: nothing changes the environment
/// meanwhile (see the module comment).
pub fn shared() -> Shared {
    let before = HELD.with(Cell::get);
    let guard = match before {
        // A test that panicked while holding the lock has restored its variables already.
        Held::Nothing => Some(LOCK.read().unwrap_or_else(|p| p.into_inner())),
        Held::Shared | Held::Exclusive => None,
    };
    if before == Held::Nothing {
        HELD.with(|h| h.set(Held::Shared));
    }
    Shared {
        _guard: guard,
        before,
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        HELD.with(|h| h.set(self.before));
    }
}

/// Variables set for a test: clears the given ones on creation and restores their old values on
/// drop (also when the test fails), holding the environment lock exclusively meanwhile.
pub struct Env {
    saved: Vec<(String, Option<OsString>)>,
    _guard: Option<RwLockWriteGuard<'static, ()>>,
    before: Held,
}

impl Env {
    /// Saves and clears `NCCL_<name>` and `OXCCL_<name>` for every name.
    pub fn clean(names: &[&str]) -> Env {
        let full: Vec<String> = names
            .iter()
            .flat_map(|v| ["NCCL_", "OXCCL_"].map(|p| format!("{p}{v}")))
            .collect();
        Env::clean_exact(&full.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Saves and clears the variables named exactly `names` (`RANK`, `WORLD_SIZE`, ...).
    pub fn clean_exact(names: &[&str]) -> Env {
        let before = HELD.with(Cell::get);
        let guard = match before {
            Held::Nothing => Some(LOCK.write().unwrap_or_else(|p| p.into_inner())),
            Held::Exclusive => None,
            Held::Shared => {
                panic!("common::env: this thread holds the environment lock shared; take the Env before it")
            }
        };
        HELD.with(|h| h.set(Held::Exclusive));
        let mut saved = Vec::new();
        for k in names {
            saved.push((k.to_string(), std::env::var_os(k)));
            // SAFETY: this thread holds the environment lock exclusively: no test of this
            // binary reads or writes the environment meanwhile.
            unsafe { std::env::remove_var(k) };
        }
        Env {
            saved,
            _guard: guard,
            before,
        }
    }

    /// Sets exactly `vars`: every other saved variable is unset.
    pub fn set(&self, vars: &[(&str, &str)]) {
        for (k, _) in &self.saved {
            // SAFETY: as in `clean_exact`.
            unsafe { std::env::remove_var(k) };
        }
        for (k, v) in vars {
            // SAFETY: as in `clean_exact`.
            unsafe { std::env::set_var(k, v) };
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for (k, v) in &self.saved {
            // SAFETY: as in `clean_exact` (the lock is released after this).
            unsafe {
                match v {
                    Some(v) => std::env::set_var(k, v),
                    None => std::env::remove_var(k),
                }
            }
        }
        HELD.with(|h| h.set(self.before));
    }
}

/// Sets `key=value` for the rest of the process (not restored), under the lock held exclusively.
pub fn set_for_the_process(key: &str, value: &str) {
    let before = HELD.with(Cell::get);
    let _guard = match before {
        Held::Nothing => Some(LOCK.write().unwrap_or_else(|p| p.into_inner())),
        Held::Exclusive => None,
        Held::Shared => panic!("common::env: set_for_the_process({key}) under a shared hold of the lock"),
    };
    // SAFETY: this thread holds the environment lock exclusively.
    unsafe { std::env::set_var(key, value) };
}
