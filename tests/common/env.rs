//! The process environment in tests. Variables are process-global and the library reads them
//! when it creates a communicator (and `get_unique_id`, the topology and bootstrap settings), so
//! every test binary has one lock over them:
//!
//! - a test that sets variables holds an [`Env`] (the lock, exclusively) while its variables are
//!   set: from [`Env::clean`] to its drop, which restores the old values;
//! - a test that creates communicators (or child processes, or unique ids) under the environment
//!   it found holds [`shared`] meanwhile, so no other test's variables leak into them;
//! - a test whose variables matter only while the helpers here create its communicators stages
//!   them ([`Staged`]) instead of holding an [`Env`]: each of its [`shared`] holds then takes the
//!   lock exclusively and sets the staged variables until it ends. Between those holds the lock
//!   is free, so the other tests' communicators are created (and their collectives run) while
//!   this test's collectives run.
//!
//! A thread that holds either guard may take [`shared`] or an [`Env`] again (helpers called
//! inside such a test do): the inner guard then only saves and restores variables. Taking an
//! [`Env`] while this thread holds only [`shared`] panics (the lock cannot be upgraded).
use std::cell::{Cell, RefCell};
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
    /// This thread's [`Staged`] variables: the names it clears and the values it sets.
    static STAGED: RefCell<Option<(Vec<String>, Vec<(String, String)>)>> = const { RefCell::new(None) };
}

/// The lock as an outermost guard took it.
enum Lock {
    Read(RwLockReadGuard<'static, ()>),
    /// Taken exclusively, with the staged variables set; their old values, restored on drop.
    Write(RwLockWriteGuard<'static, ()>, Vec<(String, Option<OsString>)>),
}

impl Drop for Lock {
    fn drop(&mut self) {
        if let Lock::Write(_, saved) = self {
            restore(saved);
        }
    }
}

/// Restores saved variables, last saved first, so a name saved twice gets its first value back
/// (the caller holds the lock exclusively).
fn restore(saved: &[(String, Option<OsString>)]) {
    for (k, v) in saved.iter().rev() {
        // SAFETY: the caller holds the environment lock exclusively.
        unsafe {
            match v {
                Some(v) => std::env::set_var(k, v),
                None => std::env::remove_var(k),
            }
        }
    }
}

/// The lock taken exclusively, with this thread's staged variables (if any) set.
fn write() -> Lock {
    // A test that panicked while holding the lock has restored its variables already.
    let guard = LOCK.write().unwrap_or_else(|p| p.into_inner());
    let staged = STAGED.with(|s| s.borrow().clone());
    let mut saved = Vec::new();
    if let Some((names, vars)) = staged {
        for k in names.iter().chain(vars.iter().map(|(k, _)| k)) {
            saved.push((k.clone(), std::env::var_os(k)));
            // SAFETY: this thread holds the environment lock exclusively.
            unsafe { std::env::remove_var(k) };
        }
        for (k, v) in &vars {
            // SAFETY: as above.
            unsafe { std::env::set_var(k, v) };
        }
    }
    Lock::Write(guard, saved)
}

/// The shared hold of the environment lock ([`shared`]).
pub struct Shared {
    _lock: Option<Lock>,
    before: Held,
}

/// Holds the environment lock shared until the guard drops: nothing changes the environment
/// meanwhile (see the module comment). On a thread with [`Staged`] variables the lock is taken
/// exclusively and they are set until the guard drops.
pub fn shared() -> Shared {
    let before = HELD.with(Cell::get);
    let lock = match before {
        Held::Nothing if STAGED.with(|s| s.borrow().is_some()) => {
            HELD.with(|h| h.set(Held::Exclusive));
            Some(write())
        }
        Held::Nothing => {
            HELD.with(|h| h.set(Held::Shared));
            Some(Lock::Read(LOCK.read().unwrap_or_else(|p| p.into_inner())))
        }
        Held::Shared | Held::Exclusive => None,
    };
    Shared { _lock: lock, before }
}

impl Drop for Shared {
    fn drop(&mut self) {
        HELD.with(|h| h.set(self.before));
    }
}

/// Variables staged for the communicators this thread creates through the helpers here (which
/// take [`shared`]): unlike an [`Env`], it holds no lock and changes nothing by itself. Only for
/// tests whose library calls that read the environment all run inside such a helper (no direct
/// `Comm::init_*`, `get_unique_id` or child process of their own, no thread of their own that
/// creates communicators). Drop it to stage nothing.
pub struct Staged(());

impl Staged {
    /// Stages the clearing of `NCCL_<name>` and `OXCCL_<name>` for every name.
    pub fn clean(names: &[&str]) -> Staged {
        assert_eq!(
            HELD.with(Cell::get),
            Held::Nothing,
            "common::env: stage variables before taking the environment lock"
        );
        let full: Vec<String> = names
            .iter()
            .flat_map(|v| ["NCCL_", "OXCCL_"].map(|p| format!("{p}{v}")))
            .collect();
        STAGED.with(|s| *s.borrow_mut() = Some((full, Vec::new())));
        Staged(())
    }

    /// Stages exactly `vars` (replacing what was staged before) on top of the clearing.
    pub fn set(&self, vars: &[(&str, &str)]) {
        STAGED.with(|s| {
            if let Some((_, staged)) = s.borrow_mut().as_mut() {
                *staged = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            }
        });
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        STAGED.with(|s| *s.borrow_mut() = None);
    }
}

/// Variables set for a test: clears the given ones on creation and restores their old values on
/// drop (also when the test fails), holding the environment lock exclusively meanwhile.
pub struct Env {
    saved: Vec<(String, Option<OsString>)>,
    _lock: Option<Lock>,
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
        let lock = match before {
            Held::Nothing => Some(write()),
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
            _lock: lock,
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
        // The lock is released after this (its staged variables restored then).
        restore(&self.saved);
        HELD.with(|h| h.set(self.before));
    }
}

/// Sets `key=value` for the rest of the process (not restored), under the lock held exclusively.
pub fn set_for_the_process(key: &str, value: &str) {
    let before = HELD.with(Cell::get);
    let _lock = match before {
        Held::Nothing => Some(write()),
        Held::Exclusive => None,
        Held::Shared => panic!("common::env: set_for_the_process({key}) under a shared hold of the lock"),
    };
    // SAFETY: this thread holds the environment lock exclusively.
    unsafe { std::env::set_var(key, value) };
}
