//! Environment variables for tests that set them. They are process-global: a binary that uses
//! this runs its environment-dependent checks in one test, serially.
use std::ffi::OsString;

/// Clears the `NCCL_` and `OXCCL_` spellings of the given names on creation and restores their old
/// values on drop (also when the test fails).
pub struct Env {
    saved: Vec<(String, Option<OsString>)>,
    /// Held for the guard's life: tests of one binary that set variables run one at a time.
    _lock: std::sync::MutexGuard<'static, ()>,
}

static ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Env {
    /// Saves and clears `NCCL_<name>` and `OXCCL_<name>` for every name.
    pub fn clean(names: &[&str]) -> Env {
        // A test that panicked while holding the lock has restored its variables in Drop already.
        let lock = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let mut saved = Vec::new();
        for v in names {
            for p in ["NCCL_", "OXCCL_"] {
                let k = format!("{p}{v}");
                saved.push((k.clone(), std::env::var_os(&k)));
                // SAFETY: the binary's environment tests run serially; nothing else reads it.
                unsafe { std::env::remove_var(&k) };
            }
        }
        Env { saved, _lock: lock }
    }

    /// Sets exactly `vars`: every other saved variable is unset.
    pub fn set(&self, vars: &[(&str, &str)]) {
        for (k, _) in &self.saved {
            // SAFETY: as in `clean`.
            unsafe { std::env::remove_var(k) };
        }
        for (k, v) in vars {
            // SAFETY: as in `clean`.
            unsafe { std::env::set_var(k, v) };
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for (k, v) in &self.saved {
            // SAFETY: as in `clean`.
            unsafe {
                match v {
                    Some(v) => std::env::set_var(k, v),
                    None => std::env::remove_var(k),
                }
            }
        }
    }
}
