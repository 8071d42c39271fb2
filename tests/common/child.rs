//! Child processes of a test binary: a test that needs ranks in separate processes runs its own
//! binary again, limited to one `#[test]` entry (a no-op unless its environment variables are
//! set), passes the bootstrap [`UniqueId`](oxccl::bootstrap::UniqueId) as hex, and waits for
//! each child with a deadline.
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// `b` as lowercase hex, two digits a byte (a unique id's bytes in an environment variable).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of a [`hex`] string (panics on a string that is not one).
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The arguments that run only the test `entry` of a test binary, its output not captured.
pub fn entry_args(entry: &str) -> [&str; 4] {
    ["--exact", entry, "--nocapture", "--test-threads=1"]
}

/// This test binary running only its test `entry`, with this process's environment.
pub fn test_entry(entry: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(entry_args(entry));
    cmd
}

/// Removes every inherited `NCCL_*` and `OXCCL_*` variable from `cmd`'s environment, so only
/// the ones the test sets afterwards apply.
pub fn remove_nccl_env(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if name.starts_with("NCCL_") || name.starts_with("OXCCL_") {
            cmd.env_remove(&k);
        }
    }
    cmd
}

/// A child rank: this test binary running only `entry`, run by the command `wrap` when it is not
/// empty (which must end by executing the program and arguments it is given), without inherited
/// `NCCL_*` / `OXCCL_*` variables ([`remove_nccl_env`]), plus `env`; stdout and stderr piped.
pub fn clean_child<K, V>(wrap: &[&str], entry: &str, env: impl IntoIterator<Item = (K, V)>) -> Command
where
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match wrap.split_first() {
        Some((prog, args)) => {
            let mut c = Command::new(prog);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(entry_args(entry));
    remove_nccl_env(&mut cmd)
        .envs(env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Polls `child` (every 20 ms) until it exits, or kills and reaps it once `deadline` has passed;
/// its exit status, `None` when it was killed.
pub fn wait_or_kill(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` until `deadline` ([`wait_or_kill`]); returns whether it exited successfully
/// and its piped output (stdout, then stderr where that is piped too). When it did not succeed,
/// the output ends with a line naming its exit status, or saying it was killed at the deadline.
/// The pipes are read once the child has gone: one that writes more than a pipe holds (64 KiB on
/// Linux) blocks until the deadline; [`LineChild`] reads as the child writes.
pub fn wait_with_deadline(mut child: Child, deadline: Instant) -> (bool, String) {
    let status = wait_or_kill(&mut child, deadline);
    let mut out = String::new();
    if let Some(mut p) = child.stdout.take() {
        let _ = p.read_to_string(&mut out);
    }
    if let Some(mut p) = child.stderr.take() {
        let _ = p.read_to_string(&mut out);
    }
    let ok = status.is_some_and(|s| s.success());
    if !ok {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        match status {
            Some(s) => out.push_str(&format!("[child {s}]")),
            None => out.push_str("[child killed: still running at the deadline]"),
        }
    }
    (ok, out)
}

/// Waits for every child of a group until one shared `deadline` ([`wait_with_deadline`]), so
/// none outlives the test even when an early one failed; their outcomes by rank.
pub fn wait_all(children: Vec<Child>, deadline: Instant) -> Vec<(bool, String)> {
    children
        .into_iter()
        .map(|c| wait_with_deadline(c, deadline))
        .collect()
}

/// In a child: the environment variable `k`, which its parent sets (panics naming it when unset).
pub fn env_var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"))
}

/// The (rank, rank count, unique id) a child process was started with: `<prefix>_RANK`,
/// `<prefix>_NRANKS` and `<prefix>_ID` (hex of the id's bytes); panics naming what is missing.
#[allow(dead_code)]
pub fn child_rank(prefix: &str) -> (usize, usize, oxccl::bootstrap::UniqueId) {
    let num = |k: String| {
        env_var(&k)
            .parse::<usize>()
            .unwrap_or_else(|e| panic!("{k}: {e}"))
    };
    let id = oxccl::bootstrap::UniqueId::from_bytes(&unhex(&env_var(&format!("{prefix}_ID")))).unwrap();
    (num(format!("{prefix}_RANK")), num(format!("{prefix}_NRANKS")), id)
}

/// In a child: log events passing `filter` (an `EnvFilter` directive) to stdout, without colour,
/// where the parent reads them.
pub fn log_to_stdout(filter: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout)
        .with_ansi(false)
        .try_init();
}

/// A child whose output is read as it comes, line by line on threads, for tests that watch a
/// running rank (wait for a marker in its output, kill it); killed and reaped on drop.
pub struct LineChild {
    pub child: Child,
    lines: Receiver<String>,
    out: Vec<String>,
}

impl LineChild {
    /// Spawns `cmd`, whose stdout and stderr must be piped (as [`clean_child`] makes them).
    pub fn start(cmd: &mut Command) -> LineChild {
        let mut child = cmd.spawn().expect("spawn child rank");
        let lines = line_reader(&mut child);
        LineChild {
            child,
            lines,
            out: Vec::new(),
        }
    }

    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.out.push(l);
        }
    }

    /// Whether a line read so far contains `marker`.
    pub fn has(&mut self, marker: &str) -> bool {
        self.drain();
        self.out.iter().any(|l| l.contains(marker))
    }

    /// The lines read so far (stderr last, as one `STDERR: ` line, once it has closed).
    pub fn text(&mut self) -> String {
        self.drain();
        self.out.join("\n")
    }

    /// Waits until the process exits (by `deadline`, else kills it; [`wait_or_kill`]); its
    /// success and output, after a first line with its exit status or
    /// `did not exit in time (killed)`.
    pub fn wait(&mut self, deadline: Instant) -> (bool, String) {
        let status = wait_or_kill(&mut self.child, deadline);
        // Let the reader threads finish.
        std::thread::sleep(Duration::from_millis(50));
        match status {
            Some(s) => (s.success(), format!("{s}\n{}", self.text())),
            None => (false, format!("did not exit in time (killed)\n{}", self.text())),
        }
    }
}

impl Drop for LineChild {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Reads `child`'s piped output on two threads: every stdout line, then (once stderr closes)
/// all of stderr as one message `STDERR: <text>`.
fn line_reader(child: &mut Child) -> Receiver<String> {
    let (tx, lines) = std::sync::mpsc::channel();
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(err).read_to_string(&mut s);
        let _ = tx2.send(format!("STDERR: {s}"));
    });
    lines
}
