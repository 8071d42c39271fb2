//! Child processes of a test binary. A test that needs ranks (or settings) in processes of their
//! own runs its own binary again, limited to one child entry: an `#[ignore]`d test function named
//! `child_*` (so a normal run lists it as ignored, never as passed), run as
//! `<this binary> --ignored --exact <module>::child_<name>` ([`command`], naming the entry with
//! [`child_entry!`]). The child gets no inherited `NCCL_*` / `OXCCL_*` variables, only
//! `OXCCL_CHILD_ENTRY` (which [`enter`] checks) and what the parent sets: by convention
//! `OXCCL_CHILD_*` variables for the child's own parameters ([`rank_env`] / [`rank`] for a rank,
//! its rank count and the bootstrap [`UniqueId`](oxccl::bootstrap::UniqueId) as hex) and the
//! library's variables for the settings under test. Every child is waited for with a deadline and
//! killed past it; one counts as successful only when it exited with status 0 having run its one
//! entry (libtest's `1 passed`), so a misspelt entry cannot pass by running nothing.
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// The libtest name (`module::child_x`) of the child entry `$f` of the calling module, which
/// must be a function there.
macro_rules! child_entry {
    ($f:ident) => {{
        let _: fn() = $f;
        $crate::common::child::entry_name(module_path!(), stringify!($f))
    }};
}

/// The variable naming the entry a child process runs (set by [`command`], checked by [`enter`]).
pub const ENTRY_VAR: &str = "OXCCL_CHILD_ENTRY";

/// The libtest name of function `f` of module `module_path` (`module_path!()`, which starts with
/// the crate's name, which libtest leaves out).
pub fn entry_name(module_path: &str, f: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{f}"),
        None => f.to_string(),
    }
}

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

/// Removes every inherited `NCCL_*` and `OXCCL_*` variable from `cmd`'s environment, so only
/// the ones the test sets afterwards apply.
pub fn remove_nccl_env(cmd: &mut Command) -> &mut Command {
    let _env = super::env::shared();
    for (k, _) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if name.starts_with("NCCL_") || name.starts_with("OXCCL_") {
            cmd.env_remove(&k);
        }
    }
    cmd
}

/// A child: this test binary running only the ignored test `entry` ([`child_entry!`]), its output
/// not captured by libtest and piped to the parent, without inherited `NCCL_*` / `OXCCL_*`
/// variables ([`remove_nccl_env`]), with `OXCCL_CHILD_ENTRY=entry`.
pub fn command(entry: &str) -> Command {
    wrapped(&[], entry)
}

/// [`command`] run by the command `wrap` when it is not empty (which must end by executing the
/// program and arguments it is given: `unshare ...`, `ip netns exec NAME`).
pub fn wrapped(wrap: &[&str], entry: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match wrap.split_first() {
        Some((prog, args)) => {
            let mut c = Command::new(prog);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(["--ignored", "--exact", entry, "--nocapture", "--test-threads=1"]);
    remove_nccl_env(&mut cmd)
        .env(ENTRY_VAR, entry)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// [`command`] with the variables `env` set too.
pub fn command_with<K, V>(entry: &str, env: impl IntoIterator<Item = (K, V)>) -> Command
where
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    let mut cmd = command(entry);
    cmd.envs(env);
    cmd
}

/// Sets a child rank's `OXCCL_CHILD_RANK`, `OXCCL_CHILD_NRANKS` and `OXCCL_CHILD_ID` (hex of the
/// id's bytes), which [`rank`] reads.
pub fn rank_env<'a>(
    cmd: &'a mut Command,
    rank: usize,
    nranks: usize,
    id: &oxccl::bootstrap::UniqueId,
) -> &'a mut Command {
    cmd.env("OXCCL_CHILD_RANK", rank.to_string())
        .env("OXCCL_CHILD_NRANKS", nranks.to_string())
        .env("OXCCL_CHILD_ID", hex(&id.to_bytes()))
}

/// First call of every child entry: panics unless this process was started by a parent test
/// ([`command`]); a child entry run on its own (`--ignored`) fails rather than passing vacuously.
pub fn enter() {
    if std::env::var_os(ENTRY_VAR).is_none() {
        panic!("a child entry: its parent test runs it in a child process ({ENTRY_VAR} is not set)");
    }
}

/// In a child: the environment variable `k`, which its parent sets (panics naming it when unset).
pub fn env_var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"))
}

/// In a child: `k` parsed (panics naming it when unset or unparsable).
pub fn env_parse<T: std::str::FromStr>(k: &str) -> T
where
    T::Err: std::fmt::Display,
{
    env_var(k).parse().unwrap_or_else(|e| panic!("{k}: {e}"))
}

/// In a child: the unique id in the variable `k` ([`hex`]).
pub fn env_id(k: &str) -> oxccl::bootstrap::UniqueId {
    oxccl::bootstrap::UniqueId::from_bytes(&unhex(&env_var(k))).unwrap()
}

/// In a child: the (rank, rank count, unique id) of [`rank_env`].
pub fn rank() -> (usize, usize, oxccl::bootstrap::UniqueId) {
    (
        env_parse("OXCCL_CHILD_RANK"),
        env_parse("OXCCL_CHILD_NRANKS"),
        env_id("OXCCL_CHILD_ID"),
    )
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

/// Spawns `cmd` (a [`command`]), holding the environment lock shared meanwhile.
pub fn spawn(cmd: &mut Command) -> Child {
    let _env = super::env::shared();
    cmd.spawn().expect("spawn a child process of the test binary")
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

/// Whether a child exited successfully after libtest ran its one entry (`stdout` holds libtest's
/// summary `test result: ok. 1 passed`).
fn ran_its_entry(status: Option<ExitStatus>, stdout: &str) -> bool {
    status.is_some_and(|s| s.success()) && stdout.contains("test result: ok. 1 passed")
}

/// The line a failed child's output ends with: its exit status, that it was killed at the
/// deadline, or that it ran no test.
fn failure_line(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) if s.success() => {
            "[child exited 0 without running its entry: no `1 passed` from libtest]".into()
        }
        Some(s) => format!("[child {s}]"),
        None => "[child killed: still running at the deadline]".into(),
    }
}

/// Waits for `child` until `deadline` ([`wait_or_kill`]); its exit status (`None`: killed at
/// the deadline) and piped output (stdout, then stderr where that is piped too). The pipes are
/// read once the child has gone: one that writes more than a pipe holds (64 KiB on Linux) blocks
/// until the deadline; [`LineChild`] reads as the child writes.
pub fn wait_output(mut child: Child, deadline: Instant) -> (Option<ExitStatus>, String, String) {
    let status = wait_or_kill(&mut child, deadline);
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut p) = child.stdout.take() {
        let _ = p.read_to_string(&mut out);
    }
    if let Some(mut p) = child.stderr.take() {
        let _ = p.read_to_string(&mut err);
    }
    (status, out, err)
}

/// [`wait_output`], then whether the child succeeded (exit status 0 after running its entry) and
/// its output (stdout, then stderr). When it did not succeed, the output ends with a line naming
/// its exit status, or saying it was killed at the deadline or ran no test.
pub fn wait_with_deadline(child: Child, deadline: Instant) -> (bool, String) {
    let (status, mut out, err) = wait_output(child, deadline);
    let ok = ran_its_entry(status, &out);
    out.push_str(&err);
    if !ok {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&failure_line(status));
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

/// Runs `cmd` to its end (killed at `limit` from now): [`wait_with_deadline`]'s outcome.
pub fn run(cmd: &mut Command, limit: Duration) -> (bool, String) {
    wait_with_deadline(spawn(cmd), Instant::now() + limit)
}

/// A child whose output is read as it comes, line by line on threads, for tests that watch a
/// running rank (wait for a marker in its output, kill it); killed and reaped on drop.
pub struct LineChild {
    pub child: Child,
    lines: Receiver<Line>,
    out: Vec<String>,
    /// Pipes read to their end (stdout, stderr).
    closed: usize,
    ran_entry: bool,
}

enum Line {
    Out(String),
    /// All of stderr, once it has closed.
    Err(String),
    /// A pipe reached its end.
    End,
}

impl LineChild {
    /// Spawns `cmd`, whose stdout and stderr must be piped (as [`command`] makes them).
    pub fn start(cmd: &mut Command) -> LineChild {
        let mut child = spawn(cmd);
        let lines = line_reader(&mut child);
        LineChild {
            child,
            lines,
            out: Vec::new(),
            closed: 0,
            ran_entry: false,
        }
    }

    fn take(&mut self, l: Line) {
        match l {
            Line::Out(l) => {
                self.ran_entry |= l.contains("test result: ok. 1 passed");
                self.out.push(l);
            }
            Line::Err(s) => self.out.push(format!("STDERR: {s}")),
            Line::End => self.closed += 1,
        }
    }

    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.take(l);
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

    /// Waits until the process exits (by `deadline`, else kills it; [`wait_or_kill`]) and its
    /// output is read to the end (at most 5 s more); its success (exit status 0 after running its
    /// entry) and output, after a first line with its exit status or `did not exit in time
    /// (killed)` (and, for a child that exited 0 without running its entry, a line saying so).
    pub fn wait(&mut self, deadline: Instant) -> (bool, String) {
        let status = wait_or_kill(&mut self.child, deadline);
        let until = Instant::now() + Duration::from_secs(5);
        while self.closed < 2 {
            match self
                .lines
                .recv_timeout(until.saturating_duration_since(Instant::now()))
            {
                Ok(l) => self.take(l),
                Err(_) => break,
            }
        }
        let text = self.text();
        match status {
            Some(s) if s.success() && !self.ran_entry => {
                (false, format!("{s}\n{text}\n{}", failure_line(status)))
            }
            Some(s) => (s.success(), format!("{s}\n{text}")),
            None => (false, format!("did not exit in time (killed)\n{text}")),
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
/// all of stderr as one message, each pipe's end marked.
fn line_reader(child: &mut Child) -> Receiver<Line> {
    let (tx, lines) = std::sync::mpsc::channel();
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(Line::Out(l));
        }
        let _ = tx.send(Line::End);
    });
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(err).read_to_string(&mut s);
        let _ = tx2.send(Line::Err(s));
        let _ = tx2.send(Line::End);
    });
    lines
}
