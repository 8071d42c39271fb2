//! Host implementations of the `arch` functions, for the CPU target. A block is a team of fibers
//! of one host thread, or of host threads ([`run_block_threads`]): `sync_threads` is a real barrier of the team, warp shuffles
//! and votes exchange values between the (up to 32) threads of a warp, flag loads and stores are
//! `core` atomics with the same ordering the PTX versions give; data loads and stores are plain
//! memory accesses.
use super::Pack;
use core::cell::Cell;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Condvar, Mutex};
use std::vec::Vec;

/// Threads per warp, as on the GPU.
const WARP: u32 = 32;

std::thread_local! {
    static BLOCK_IDX: Cell<u32> = const { Cell::new(0) };
    /// The calling thread's index in its block and its block's team (null outside a team).
    static THREAD: Cell<(u32, *const Team)> = const { Cell::new((0, core::ptr::null())) };
}

/// A barrier of `n` threads of one team that a trapping member breaks: the others then trap too
/// instead of waiting forever (a GPU trap ends the whole kernel). An exited thread no longer
/// holds the barrier back (as on the GPU, where `bar.sync` does not wait for exited threads).
struct Barrier {
    n: u32,
    /// Whether the members are fibers of one host thread (else host threads of their own).
    fibers: bool,
    /// Host-thread teams: (threads arrived, generation, broken, threads exited).
    state: Mutex<(u32, u64, bool, u32)>,
    cv: Condvar,
    /// Fiber teams: the same state, touched by one host thread only (relaxed loads and stores,
    /// no lock), and read by its fiber scheduler to leave a fiber that waits here parked until
    /// the generation changes or the barrier breaks.
    arrived: AtomicU32,
    exited: AtomicU32,
    generation: AtomicU64,
    broken: AtomicBool,
}

impl Barrier {
    fn new(n: u32, fibers: bool) -> Self {
        Barrier {
            n,
            fibers,
            state: Mutex::new((0, 0, false, 0)),
            cv: Condvar::new(),
            arrived: AtomicU32::new(0),
            exited: AtomicU32::new(0),
            generation: AtomicU64::new(0),
            broken: AtomicBool::new(false),
        }
    }

    /// Waits until all `n` threads have arrived; every thread's earlier memory operations are
    /// ordered before every thread's later ones (as `bar.sync` does for a block): by the mutex
    /// for host threads, by running on one host thread for fibers.
    fn wait(&self) {
        if self.fibers {
            return self.wait_fiber();
        }
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.2 {
            drop(g);
            trap();
        }
        let generation = g.1;
        g.0 += 1;
        if g.0 + g.3 >= self.n {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return;
        }
        while g.1 == generation && !g.2 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.1 == generation {
            drop(g);
            trap();
        }
    }

    /// [`wait`](Self::wait) of a fiber team: the teammates are fibers of this host thread, so
    /// the state needs no lock; the waiting fiber is parked until the last one arrives.
    fn wait_fiber(&self) {
        if self.broken.load(Ordering::Relaxed) {
            trap();
        }
        let generation = self.generation.load(Ordering::Relaxed);
        let arrived = self.arrived.load(Ordering::Relaxed) + 1;
        if arrived + self.exited.load(Ordering::Relaxed) >= self.n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.store(generation + 1, Ordering::Relaxed);
            return;
        }
        self.arrived.store(arrived, Ordering::Relaxed);
        while self.generation.load(Ordering::Relaxed) == generation && !self.broken.load(Ordering::Relaxed) {
            fiber::park(self, generation);
        }
        if self.generation.load(Ordering::Relaxed) == generation {
            trap();
        }
    }

    fn break_all(&self) {
        if self.fibers {
            self.broken.store(true, Ordering::Relaxed);
            return;
        }
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.2 = true;
        self.cv.notify_all();
    }

    /// A member's body returned: the others no longer wait for it.
    fn exit(&self) {
        if self.fibers {
            let exited = self.exited.load(Ordering::Relaxed) + 1;
            self.exited.store(exited, Ordering::Relaxed);
            let arrived = self.arrived.load(Ordering::Relaxed);
            if arrived > 0 && arrived + exited >= self.n {
                self.arrived.store(0, Ordering::Relaxed);
                let generation = self.generation.load(Ordering::Relaxed);
                self.generation.store(generation + 1, Ordering::Relaxed);
            }
            return;
        }
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.3 += 1;
        if g.0 > 0 && g.0 + g.3 >= self.n {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
        }
    }
}

/// One warp of a team: its lanes' barrier and exchange slots.
struct Warp {
    barrier: Barrier,
    lanes: u32,
    /// Two sets of slots, used by alternate exchanges (`turn`), so that one barrier per exchange
    /// suffices: a lane writes a set again only two exchanges later, after the barrier of the
    /// exchange between, which every lane reaches after reading.
    slots: [[AtomicU32; WARP as usize]; 2],
    /// Each lane's next set (a lane touches only its own).
    turn: [AtomicU32; WARP as usize],
}

/// The host threads of one CPU-target block.
struct Team {
    nthreads: u32,
    block: Barrier,
    warps: Vec<Warp>,
}

impl Team {
    /// Breaks every barrier of the team (a thread trapped).
    fn break_all(&self) {
        self.block.break_all();
        for w in &self.warps {
            w.barrier.break_all();
        }
    }

    /// Thread `tid`'s body returned: its barriers stop waiting for it.
    fn exit(&self, tid: u32) {
        self.block.exit();
        self.warps[(tid / WARP) as usize].barrier.exit();
    }

    /// A team of `nthreads` threads; `fibers`: fibers of one host thread (see [`TeamKind`]).
    fn new(nthreads: u32, fibers: bool) -> Self {
        Team {
            nthreads,
            block: Barrier::new(nthreads, fibers),
            warps: (0..nthreads.div_ceil(WARP))
                .map(|w| {
                    let lanes = (nthreads - w * WARP).min(WARP);
                    Warp {
                        barrier: Barrier::new(lanes, fibers),
                        lanes,
                        slots: core::array::from_fn(|_| core::array::from_fn(|_| AtomicU32::new(0))),
                        turn: core::array::from_fn(|_| AtomicU32::new(0)),
                    }
                })
                .collect(),
        }
    }
}

/// Counts a team's pooled threads down to zero (their bodies have returned or trapped).
struct Latch {
    left: Mutex<(u32, bool)>,
    cv: Condvar,
}

impl Latch {
    fn done(&self, ok: bool) {
        let mut g = self.left.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= 1;
        g.1 &= ok;
        if g.0 == 0 {
            self.cv.notify_all();
        }
    }

    /// Waits for every pooled thread; true when all of them succeeded.
    fn wait(&self) -> bool {
        let mut g = self.left.lock().unwrap_or_else(|e| e.into_inner());
        while g.0 > 0 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.1
    }
}

/// How a CPU-target block runs its threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TeamKind {
    /// Every thread of the block is a fiber (a stackful coroutine) of one host thread, which
    /// switches between them at barriers, warp shuffles and votes, and spin-waits: cheap on few
    /// cores, and each thread still has its own stack, index and warp lane.
    Fibers,
    /// Every thread of the block is a host thread of its own (from [`pool`]): preemptive, truly
    /// parallel, and costly when there are more of them than cores.
    Threads,
}

/// Runs block `bid` as a team of `nthreads` threads (the CPU target's kernel block), fibers of
/// the calling host thread or host threads of their own (`kind`): thread `tid` runs `body(tid)`
/// with [`thread_idx`], [`block_dim`] and [`block_idx`] set and the team's barriers behind
/// [`sync_threads`], [`shfl_xor`] and [`vote_any`]. True when every thread's `body` returned
/// true; a thread that traps (panics) breaks the team's barriers, so its teammates trap at their
/// next barrier, and counts as false. A block whose fiber stacks cannot be had (mmap failed)
/// is false too, and runs nothing.
pub fn run_block_threads(bid: u32, nthreads: u32, kind: TeamKind, body: impl Fn(u32) -> bool + Sync) -> bool {
    let nthreads = nthreads.max(1);
    let fibers = kind == TeamKind::Fibers && nthreads > 1;
    let team = Team::new(nthreads, fibers);
    // A fiber team runs on this host thread; a team of one thread needs no switching and runs
    // directly below (it still sees its team).
    if fibers {
        BLOCK_IDX.with(|b| b.set(bid));
        return fiber::run_team(&team, &body);
    }
    let run = |tid: u32| -> bool {
        BLOCK_IDX.with(|b| b.set(bid));
        THREAD.with(|t| t.set((tid, &team as *const Team)));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(tid)));
        THREAD.with(|t| t.set((0, core::ptr::null())));
        team.exit(tid);
        // A trap: no teammate may wait for this thread at a barrier.
        r.unwrap_or_else(|_| {
            team.break_all();
            false
        })
    };
    let latch = Latch {
        left: Mutex::new((nthreads - 1, true)),
        cv: Condvar::new(),
    };
    for tid in 1..nthreads {
        let (run, latch) = (&run, &latch);
        let job: std::boxed::Box<dyn FnOnce() + Send + '_> = std::boxed::Box::new(move || latch.done(run(tid)));
        // SAFETY: the job borrows `run` and `latch` (and through them `team` and `body`), which
        // live until this function returns; it returns only after `latch.wait()` saw every job
        // finish, and a job touches nothing borrowed after `latch.done`. `run` catches a trap,
        // so every job reaches `done`.
        let job: pool::Job = unsafe { core::mem::transmute(job) };
        pool::run(job);
    }
    let first = run(0);
    latch.wait() && first
}

/// The fibers of [`TeamKind::Fibers`] teams: one host thread resumes its block's fibers in
/// turn; a fiber runs until it waits (a barrier, a warp exchange, a spin-wait), then the next
/// one runs, and a fiber waiting at a barrier is skipped until that barrier moves. Once a round
/// of the block saw a fiber spin-wait (for memory another host thread writes), the host thread
/// yields its core; after a few rounds in which every fiber only spin-waited, it sleeps briefly
/// while the working blocks fill the cores.
mod fiber {
    use super::{Barrier, THREAD, Team};
    use core::cell::Cell;
    use core::sync::atomic::{AtomicU32, Ordering};
    use corosensei::stack::DefaultStack;
    use corosensei::{Coroutine, CoroutineResult, Yielder};
    use std::sync::Mutex;
    use std::vec::Vec;

    /// Bytes of each fiber's stack (mapped lazily; a guard page below it).
    const STACK_BYTES: usize = 256 * 1024;
    /// Stacks kept for reuse by later blocks.
    const POOLED_STACKS: usize = 4096;
    /// Rounds in a row in which every resumed fiber only spin-waited (for memory another host
    /// thread writes), after which a block counts as idle. An idle block's host thread sleeps for
    /// [`IDLE_SLEEP`] between rounds instead of yielding while at least as many blocks as the
    /// machine has cores are working ([`WORKING`]): a yielding thread stays runnable, so with
    /// more blocks than cores (the test suite's ranks) the idle ones kept taking turns with the
    /// ones that had work; with fewer, a sleep only delays the block's reply. Measured on the
    /// 2-core machine: the `collectives` test binary 243 s with yields only, 195 s sleeping at
    /// every idle round, 196 s sleeping only while the working blocks fill the cores; `perf
    /// all-reduce --backend cpu --ranks 2` at 8 bytes 70-110 µs with yields only, 150-180 µs
    /// sleeping at every idle round, 51-57 µs sleeping only while the cores are full.
    const IDLE_ROUNDS_BEFORE_SLEEP: u32 = 4;
    /// The sleep of an idle block's host thread (Linux's default timer slack makes it about 70 µs).
    const IDLE_SLEEP: std::time::Duration = std::time::Duration::from_micros(20);
    /// Fiber blocks of this process that are running and not idle.
    static WORKING: AtomicU32 = AtomicU32::new(0);

    /// The cores this process may run on.
    fn cores() -> u32 {
        static CORES: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
    }

    /// A fiber stack between uses.
    struct Pooled(DefaultStack);
    // SAFETY: a pooled stack is a mapping no fiber runs on; any thread may run the next fiber
    // on it.
    unsafe impl Send for Pooled {}

    static STACKS: Mutex<Vec<Pooled>> = Mutex::new(Vec::new());

    std::thread_local! {
        /// The running fiber's yielder (null outside a fiber).
        static YIELDER: Cell<*const Yielder<(), ()>> = const { Cell::new(core::ptr::null()) };
        /// How many times a fiber spin-waited since the scheduler last looked.
        static SPUN: Cell<u32> = const { Cell::new(0) };
        /// The barrier (and its generation) the fiber that just suspended waits on, if any.
        static PARKED: Cell<Option<(*const Barrier, u64)>> = const { Cell::new(None) };
    }

    /// Suspends the calling fiber until `barrier` has left `generation` (or broke): the
    /// scheduler does not resume it before, so a block whose other threads wait at a barrier
    /// costs nothing per round while one of them spin-waits. Outside a fiber it does nothing.
    pub fn park(barrier: &Barrier, generation: u64) {
        if !active() {
            return;
        }
        PARKED.with(|p| p.set(Some((barrier as *const Barrier, generation))));
        suspend(false);
    }

    /// Whether a fiber parked at `(barrier, generation)` must stay suspended.
    fn still_parked(parked: Option<(*const Barrier, u64)>) -> bool {
        parked.is_some_and(|(b, generation)| {
            // SAFETY: the barrier belongs to the team, which outlives its fibers and the
            // scheduler's loop over them.
            let b = unsafe { &*b };
            b.generation.load(core::sync::atomic::Ordering::Relaxed) == generation
                && !b.broken.load(core::sync::atomic::Ordering::Relaxed)
        })
    }

    /// Whether the caller is a fiber of a team.
    pub fn active() -> bool {
        !YIELDER.with(|y| y.get()).is_null()
    }

    /// Gives the host thread to the block's next fiber; `spin` marks a spin-wait. Returns when
    /// the scheduler resumes this fiber. Outside a fiber it does nothing.
    pub fn suspend(spin: bool) {
        let y = YIELDER.with(|c| c.get());
        if y.is_null() {
            return;
        }
        let me = THREAD.with(|t| t.get());
        if spin {
            SPUN.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: `y` is the yielder of the fiber running this code (set at its start and
        // restored after each switch), valid while the fiber runs.
        unsafe { (*y).suspend(()) };
        YIELDER.with(|c| c.set(y));
        THREAD.with(|t| t.set(me));
    }

    fn take_stack() -> Option<DefaultStack> {
        let pooled = STACKS.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match pooled {
            Some(Pooled(s)) => Some(s),
            None => DefaultStack::new(STACK_BYTES).ok(),
        }
    }

    fn give_stack(s: DefaultStack) {
        let mut pool = STACKS.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOLED_STACKS {
            pool.push(Pooled(s));
        }
    }

    /// Runs every thread of `team` as a fiber of the calling host thread; true when every
    /// `body` returned true.
    pub fn run_team(team: &Team, body: &(impl Fn(u32) -> bool + Sync)) -> bool {
        let team_ptr = team as *const Team;
        let mut fibers = Vec::with_capacity(team.nthreads as usize);
        for tid in 0..team.nthreads {
            let Some(stack) = take_stack() else {
                for mut f in fibers.drain(..).flatten() {
                    let f: &mut Coroutine<(), (), bool, DefaultStack> = &mut f;
                    // Not started: this only drops its closure.
                    f.force_unwind();
                }
                return false;
            };
            let f = move |y: &Yielder<(), ()>, ()| -> bool {
                YIELDER.with(|c| c.set(y as *const _));
                THREAD.with(|t| t.set((tid, team_ptr)));
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(tid)));
                // SAFETY: the team outlives its fibers (run_team returns after all ended).
                unsafe { (*team_ptr).exit(tid) };
                r.unwrap_or_else(|_| {
                    // A trap: no teammate may wait for this thread at a barrier.
                    // SAFETY: the team outlives its fibers (run_team returns after all ended).
                    unsafe { (*team_ptr).break_all() };
                    false
                })
            };
            // SAFETY: the fiber borrows `team` and `body`, which outlive it: every fiber is run
            // to its end below before this function returns (a trapping body is caught inside
            // its fiber, so each one ends by returning).
            fibers.push(Some(unsafe { Coroutine::with_stack_unchecked(stack, f) }));
        }
        let mut ok = true;
        let mut live = fibers.len();
        let mut parked: Vec<Option<(*const Barrier, u64)>> = std::vec![None; fibers.len()];
        // A round that resumed no fiber (every live one parked: the block cannot go on, as on
        // a GPU) resumes all of them in the next, as if none were parked.
        let mut force = false;
        // Rounds in a row in which every resumed fiber spin-waited, and whether that made the
        // block idle (it then no longer counts in `WORKING`).
        let mut idle_rounds = 0u32;
        let mut idle = false;
        WORKING.fetch_add(1, Ordering::Relaxed);
        while live > 0 {
            SPUN.with(|c| c.set(0));
            let mut resumed = 0u32;
            for (slot, park) in fibers.iter_mut().zip(parked.iter_mut()) {
                let Some(f) = slot else { continue };
                if !force && still_parked(*park) {
                    continue;
                }
                resumed += 1;
                // `PARKED` is empty here (taken after every resume): only a `park` fills it.
                let step = f.resume(());
                *park = PARKED.with(|p| p.take());
                match step {
                    CoroutineResult::Yield(()) => {}
                    CoroutineResult::Return(r) => {
                        ok &= r;
                        live -= 1;
                        if let Some(f) = slot.take() {
                            give_stack(f.into_stack());
                        }
                    }
                }
            }
            force = resumed == 0;
            let spins = SPUN.with(|c| c.get());
            if resumed > 0 && spins == resumed {
                idle_rounds += 1;
            } else {
                idle_rounds = 0;
            }
            if idle_rounds >= IDLE_ROUNDS_BEFORE_SLEEP && !idle {
                idle = true;
                WORKING.fetch_sub(1, Ordering::Relaxed);
            } else if idle_rounds == 0 && idle {
                idle = false;
                WORKING.fetch_add(1, Ordering::Relaxed);
            }
            if idle && WORKING.load(Ordering::Relaxed) >= cores() {
                std::thread::sleep(IDLE_SLEEP);
            } else if spins > 0 || force {
                std::thread::yield_now();
            }
        }
        if !idle {
            WORKING.fetch_sub(1, Ordering::Relaxed);
        }
        YIELDER.with(|c| c.set(core::ptr::null()));
        THREAD.with(|t| t.set((0, core::ptr::null())));
        ok
    }
}

/// A process-wide pool of idle host threads for the CPU target's block teams: a job goes to an
/// idle thread if there is one, else to a new thread, which joins the pool when its job ends and
/// leaves it after [`IDLE_EXIT`] without work.
mod pool {
    use std::boxed::Box;
    use std::sync::Mutex;
    use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
    use std::vec::Vec;

    pub type Job = Box<dyn FnOnce() + Send + 'static>;

    /// How long an idle pooled thread waits for a job before it exits.
    const IDLE_EXIT: std::time::Duration = std::time::Duration::from_secs(10);

    /// Idle threads, each by its id and the sender of its job channel.
    static IDLE: Mutex<Vec<(u64, Sender<Job>)>> = Mutex::new(Vec::new());

    fn idle() -> std::sync::MutexGuard<'static, Vec<(u64, Sender<Job>)>> {
        IDLE.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `job` on an idle pooled thread, or on a new one.
    pub fn run(mut job: Job) {
        loop {
            let Some((_, tx)) = idle().pop() else {
                break;
            };
            match tx.send(job) {
                Ok(()) => return,
                // That thread has exited; try the next.
                Err(e) => job = e.0,
            }
        }
        start(job);
    }

    fn start(job: Job) {
        static NEXT_ID: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = channel::<Job>();
        std::thread::spawn(move || worker(id, tx, rx, job));
    }

    fn worker(id: u64, tx: Sender<Job>, rx: Receiver<Job>, first: Job) {
        let mut job = first;
        loop {
            job();
            idle().push((id, tx.clone()));
            job = match rx.recv_timeout(IDLE_EXIT) {
                Ok(j) => j,
                Err(RecvTimeoutError::Timeout) => {
                    let mut list = idle();
                    if let Some(i) = list.iter().position(|(k, _)| *k == id) {
                        list.swap_remove(i);
                        return;
                    }
                    drop(list);
                    // Taken from the list just now: its sender sends the job next.
                    match rx.recv() {
                        Ok(j) => j,
                        Err(_) => return,
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
        }
    }
}

/// The calling thread's team, if it runs inside [`run_block_threads`].
fn team() -> Option<(u32, &'static Team)> {
    let (tid, team) = THREAD.with(|t| t.get());
    // SAFETY: set by run_block_threads to a team that outlives the body it runs on this thread,
    // and cleared before the team is dropped.
    unsafe { team.as_ref() }.map(|t| (tid, t))
}

/// Thread index within the block (0 outside a team).
#[inline(always)]
pub fn thread_idx() -> u32 {
    THREAD.with(|t| t.get().0)
}
/// Block index of the calling host thread, as set by [`run_block_threads`] or [`set_block_idx`].
#[inline(always)]
pub fn block_idx() -> u32 {
    BLOCK_IDX.with(|b| b.get())
}
/// Threads per block (1 outside a team).
#[inline(always)]
pub fn block_dim() -> u32 {
    team().map_or(1, |(_, t)| t.nthreads)
}
/// Sets the block index the calling host thread reports.
pub fn set_block_idx(b: u32) {
    BLOCK_IDX.with(|c| c.set(b));
}

/// Block barrier (`bar.sync 0`): waits for every thread of the team; a no-op outside one.
///
/// # Safety
/// Every thread of the block reaches it (as on the GPU); otherwise the team waits forever.
#[inline(always)]
pub unsafe fn sync_threads() {
    if let Some((_, t)) = team() {
        if t.nthreads > 1 {
            t.block.wait();
        }
    }
}

/// Named barrier (`bar.sync id, n`) of `n` threads: the CPU target runs the block barrier, so
/// every thread of the block must take part (the kernels use none with fewer).
///
/// # Safety
/// As [`sync_threads`].
#[inline(always)]
pub unsafe fn named_barrier(_id: u32, _n: u32) {
    // SAFETY: forwarded caller contract.
    unsafe { sync_threads() }
}

/// The calling thread's warp and lane, if it runs in a team.
fn warp_lane() -> Option<(&'static Warp, u32)> {
    team().map(|(tid, t)| (&t.warps[(tid / WARP) as usize], tid % WARP))
}

/// Every lane of the calling thread's warp publishes `v`; `f` reads the warp's values (the
/// exchange's set of slots).
fn warp_exchange<R>(v: u32, f: impl FnOnce(&[AtomicU32; WARP as usize], &Warp, u32) -> R) -> Option<R> {
    let (w, lane) = warp_lane()?;
    let turn = w.turn[lane as usize].load(Ordering::Relaxed);
    w.turn[lane as usize].store(turn ^ 1, Ordering::Relaxed);
    let slots = &w.slots[turn as usize];
    slots[lane as usize].store(v, Ordering::Relaxed);
    w.barrier.wait();
    Some(f(slots, w, lane))
}

/// Warp barrier (`bar.warp.sync` of the full warp): what every lane of the calling thread's warp
/// wrote before it is seen by every lane after it; a no-op outside a team.
///
/// # Safety
/// Every lane of the warp calls it together (as [`shfl_xor`]).
pub unsafe fn sync_warp() {
    if let Some((w, _)) = warp_lane() {
        w.barrier.wait();
    }
}

/// Two 8-byte acquire loads at `p` (the GPU's `ld.volatile.v2.u64` of an LL128 line part).
///
/// # Safety
/// `p` is valid and 16-byte aligned, and only accessed atomically while shared.
#[inline(always)]
pub unsafe fn load_volatile_v2_u64(p: *const u64) -> (u64, u64) {
    let q = p as *mut u64;
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        (
            AtomicU64::from_ptr(q).load(Ordering::Acquire),
            AtomicU64::from_ptr(q.add(1)).load(Ordering::Acquire),
        )
    }
}

/// Acquire-release fence.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn fence_acq_rel_sys() {
    fence(Ordering::AcqRel)
}

/// Acquire-release fence (the device's GPU-scope fence; on the host the same as
/// [`fence_acq_rel_sys`]).
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn fence_acq_rel_gpu() {
    fence(Ordering::AcqRel)
}

/// The device's `nanosleep` while polling: on the host a [`spin_pause`].
#[inline(always)]
pub fn nanosleep(_ns: u32) {
    spin_pause()
}

/// Sequentially consistent fence.
///
/// # Safety
/// None on the host.
#[inline(always)]
pub unsafe fn fence_sc_sys() {
    fence(Ordering::SeqCst)
}

/// Acquire load.
///
/// # Safety
/// `p` is valid and 8-byte aligned, and only accessed atomically while shared.
#[inline(always)]
pub unsafe fn load_acquire_sys_u64(p: *const u64) -> u64 {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p as *mut u64).load(Ordering::Acquire) }
}

/// Release store.
///
/// # Safety
/// As [`load_acquire_sys_u64`].
#[inline(always)]
pub unsafe fn store_release_sys_u64(p: *mut u64, v: u64) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p).store(v, Ordering::Release) }
}

/// Relaxed-but-fresh load (the PTX `ld.volatile`); acquire on the host so the CPU target never
/// depends on a separate fence for correctness.
///
/// # Safety
/// As [`load_acquire_sys_u64`].
#[inline(always)]
pub unsafe fn load_volatile_u64(p: *const u64) -> u64 {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p as *mut u64).load(Ordering::Acquire) }
}

/// Store counterpart of [`load_volatile_u64`] (release on the host).
///
/// # Safety
/// As [`load_acquire_sys_u64`].
#[inline(always)]
pub unsafe fn store_volatile_u64(p: *mut u64, v: u64) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU64::from_ptr(p).store(v, Ordering::Release) }
}

/// Fresh load of a `u32` flag.
///
/// # Safety
/// `p` is valid and 4-byte aligned.
#[inline(always)]
pub unsafe fn load_volatile_u32(p: *const u32) -> u32 {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU32::from_ptr(p as *mut u32).load(Ordering::Acquire) }
}

/// Store of a `u32` flag.
///
/// # Safety
/// `p` is valid and 4-byte aligned.
#[inline(always)]
pub unsafe fn store_volatile_u32(p: *mut u32, v: u32) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe { AtomicU32::from_ptr(p).store(v, Ordering::Release) }
}

/// 16-byte load as two 8-byte acquire loads (an LL line's halves are each one atomic on the host).
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_volatile_v4(p: *const Pack) -> Pack {
    let q = p as *mut u64;
    // SAFETY: caller guarantees validity and alignment.
    let (lo, hi) = unsafe {
        (
            AtomicU64::from_ptr(q).load(Ordering::Acquire),
            AtomicU64::from_ptr(q.add(1)).load(Ordering::Acquire),
        )
    };
    Pack([lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32])
}

/// A copy loop's 16-byte load ([`load_volatile_v4`] on the host).
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_volatile_v4_data(p: *const Pack) -> Pack {
    // SAFETY: forwarded caller contract.
    unsafe { load_volatile_v4(p) }
}

/// 16-byte store as two 8-byte release stores.
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn store_volatile_v4(p: *mut Pack, v: Pack) {
    let q = p as *mut u64;
    let lo = v.0[0] as u64 | (v.0[1] as u64) << 32;
    let hi = v.0[2] as u64 | (v.0[3] as u64) << 32;
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        AtomicU64::from_ptr(q).store(lo, Ordering::Release);
        AtomicU64::from_ptr(q.add(1)).store(hi, Ordering::Release);
    }
}

/// Plain 16-byte load.
///
/// # Safety
/// `p` is valid and 16-byte aligned, and not concurrently written.
#[inline(always)]
pub unsafe fn load_v4(p: *const Pack) -> Pack {
    // SAFETY: caller guarantees validity, alignment and no concurrent writer.
    unsafe { p.read() }
}

/// Plain 16-byte store.
///
/// # Safety
/// `p` is valid and 16-byte aligned, and not concurrently accessed.
#[inline(always)]
pub unsafe fn store_v4(p: *mut Pack, v: Pack) {
    // SAFETY: caller guarantees validity, alignment and exclusive access.
    unsafe { p.write(v) }
}

/// Butterfly warp shuffle (`shfl.sync.bfly`): lane `l` gets lane `l ^ lane_mask`'s `v` (its own
/// where that lane does not exist, as for a partial warp on the GPU).
///
/// # Safety
/// Every lane of the warp calls it together (full-warp convergence, as on the GPU).
#[inline(always)]
pub unsafe fn shfl_xor(v: u32, lane_mask: u32) -> u32 {
    warp_exchange(v, |slots, w, lane| {
        let src = lane ^ (lane_mask & (WARP - 1));
        if src < w.lanes {
            slots[src as usize].load(Ordering::Relaxed)
        } else {
            v
        }
    })
    .unwrap_or(v)
}

/// Warp vote (`vote.sync.any`): true when `pred` holds on any lane of the calling warp.
///
/// # Safety
/// As [`shfl_xor`].
#[inline(always)]
pub unsafe fn vote_any(pred: bool) -> bool {
    warp_exchange(pred as u32, |slots, w, _| {
        slots[..w.lanes as usize].iter().any(|s| s.load(Ordering::Relaxed) != 0)
    })
    .unwrap_or(pred)
}

/// Spin-loop hint. On the CPU target many ranks' blocks share few cores, so a waiting thread
/// gives its core away instead of burning it.
#[inline(always)]
pub fn spin_pause() {
    if fiber::active() {
        fiber::suspend(true);
    } else {
        std::thread::yield_now();
    }
}

/// Abort the "kernel": on the host this is a panic of the channel thread, which the CPU launcher
/// turns into an error.
pub fn trap() -> ! {
    panic!("oxccl kernel trap")
}

/// Publishes the pair `(a, b)`: `a`, then `b` with release, so that [`load_pair_u64`], which
/// reads `b` with acquire first, sees an `a` at least as new as the `b` it saw (the GPU's single
/// 16-byte store gives the same to a reader that checks `b`).
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn store_pair_u64(p: *mut u64, a: u64, b: u64) {
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        AtomicU64::from_ptr(p).store(a, Ordering::Relaxed);
        AtomicU64::from_ptr(p.add(1)).store(b, Ordering::Release);
    }
}

/// Reads a pair written by [`store_pair_u64`]: `b` with acquire, then `a`.
///
/// # Safety
/// `p` is valid and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_pair_u64(p: *const u64) -> (u64, u64) {
    let q = p as *mut u64;
    // SAFETY: caller guarantees validity and alignment.
    unsafe {
        let b = AtomicU64::from_ptr(q.add(1)).load(Ordering::Acquire);
        (AtomicU64::from_ptr(q).load(Ordering::Relaxed), b)
    }
}

/// Lane-wise binary16 sum of two packed pairs (low half = element 0), rounded to nearest even:
/// the CPU-target twin of the GPU's `add.rn.f16x2` (computed in f32 and rounded once, which gives
/// the same bits for finite results).
#[inline(always)]
pub fn f16x2_add(a: u32, b: u32) -> u32 {
    f16x2_lanes(a, b, |x, y| x + y)
}

/// Lane-wise binary16 product, as [`f16x2_add`] (`mul.rn.f16x2` on the GPU).
#[inline(always)]
pub fn f16x2_mul(a: u32, b: u32) -> u32 {
    f16x2_lanes(a, b, |x, y| x * y)
}

#[inline(always)]
fn f16x2_lanes(a: u32, b: u32, f: impl Fn(f32, f32) -> f32) -> u32 {
    let lane = |s: u32| {
        let (x, y) = (f16_to_f32((a >> s) as u16), f16_to_f32((b >> s) as u16));
        (f32_to_f16(f(x, y)) as u32) << s
    };
    lane(0) | lane(16)
}

/// Widens one binary16 value (its bits) to f32 exactly (`cvt.f32.f16` on the GPU).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// Rounds an f32 to binary16 bits, nearest even (`cvt.rn.f16.f32` on the GPU).
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    half::f16::from_f32(f).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::sync::atomic::AtomicUsize;

    const KINDS: [TeamKind; 2] = [TeamKind::Fibers, TeamKind::Threads];

    /// Each thread sees its own index, the team size and the block; every shuffle partner's
    /// value arrives, in full warps and in the partial last warp (40 threads: 32 + 8).
    #[test]
    fn shuffles_exchange_between_the_lanes_of_each_warp() {
        for kind in KINDS {
            for n in [1u32, 8, 40, 64] {
                let wrong = AtomicUsize::new(0);
                let ok = run_block_threads(5, n, kind, |tid| {
                    if (thread_idx(), block_dim(), block_idx()) != (tid, n, 5) {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                    let lanes = (n - tid / WARP * WARP).min(WARP);
                    for mask in [1u32, 2, 4, 8, 16] {
                        // SAFETY: every thread of the team runs the same shuffles.
                        let got = unsafe { shfl_xor(1000 + tid, mask) };
                        let lane = tid % WARP;
                        let want = if (lane ^ mask) < lanes { 1000 + (tid / WARP * WARP + (lane ^ mask)) } else { 1000 + tid };
                        if got != want {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    true
                });
                assert!(ok, "n = {n}");
                assert_eq!(wrong.load(Ordering::Relaxed), 0, "n = {n}: wrong indices or shuffles");
            }
        }
    }

    /// Back-to-back exchanges, each with new values, never read a value of another exchange
    /// (the two sets of slots alternate; host-thread lanes race each other here).
    #[test]
    fn back_to_back_shuffles_and_votes_see_only_their_own_round() {
        for kind in KINDS {
            let wrong = AtomicUsize::new(0);
            let ok = run_block_threads(0, 64, kind, |tid| {
                let lane = tid % WARP;
                for round in 0..300u32 {
                    let mask = 1 << (round % 5);
                    // SAFETY: every thread of the team runs the same exchanges.
                    let got = unsafe { shfl_xor(round * 1000 + tid, mask) };
                    if got != round * 1000 + (tid - lane + (lane ^ mask)) {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                    // Only lane `round % 32` of warp `round % 2` votes true.
                    // SAFETY: as above.
                    let any = unsafe { vote_any(lane == round % WARP && tid / WARP == round % 2) };
                    if any != (tid / WARP == round % 2) {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                }
                true
            });
            assert!(ok, "{kind:?}");
            assert_eq!(wrong.load(Ordering::Relaxed), 0, "{kind:?}");
        }
    }

    /// A vote is true on every lane of a warp exactly when one of its lanes voted true, and
    /// never sees the other warp's votes.
    #[test]
    fn votes_are_per_warp() {
        for kind in KINDS {
            let wrong = AtomicUsize::new(0);
            let ok = run_block_threads(0, 64, kind, |tid| {
                // Warp 0: only lane 31 votes true; warp 1: nobody.
                // SAFETY: every thread of the team votes the same number of times.
                let (a, b) = unsafe { (vote_any(tid == 31), vote_any(false)) };
                if a != (tid < 32) || b {
                    wrong.fetch_add(1, Ordering::Relaxed);
                }
                true
            });
            assert!(ok);
            assert_eq!(wrong.load(Ordering::Relaxed), 0);
        }
    }

    /// What a thread wrote before `sync_threads` is seen by every thread after it, in every
    /// round (the barrier orders memory as `bar.sync` does).
    #[test]
    fn the_block_barrier_orders_every_round() {
        for kind in KINDS {
            let n = 64u32;
            let cells: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            let wrong = AtomicUsize::new(0);
            let ok = run_block_threads(0, n, kind, |tid| {
                for round in 1..=50u32 {
                    cells[tid as usize].store(round, Ordering::Relaxed);
                    // SAFETY: every thread reaches both barriers of each round.
                    unsafe { sync_threads() };
                    let peer = (tid + round) % n;
                    if cells[peer as usize].load(Ordering::Relaxed) != round {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                    // SAFETY: as above.
                    unsafe { sync_threads() };
                }
                true
            });
            assert!(ok);
            assert_eq!(wrong.load(Ordering::Relaxed), 0);
        }
    }

    /// A thread that traps breaks the barriers: its teammates waiting at one trap too, and the
    /// block reports failure instead of hanging; a body returning false is a failure as well.
    #[test]
    fn a_trapping_thread_fails_the_block_without_a_hang() {
        for kind in KINDS {
            let ok = run_block_threads(0, 64, kind, |tid| {
                if tid == 17 {
                    trap();
                }
                // SAFETY: the barrier is broken by the trap, so nobody waits forever.
                unsafe { sync_threads() };
                true
            });
            assert!(!ok);
            assert!(!run_block_threads(0, 4, kind, |tid| tid != 2));
            assert!(run_block_threads(0, 4, kind, |_| true));
        }
    }

    /// A thread spin-waiting for a teammate's store (no barrier between them) lets that
    /// teammate run: the lowest thread waits for the highest one, which runs after it.
    #[test]
    fn a_spin_waiting_thread_lets_its_teammates_run() {
        for kind in KINDS {
            let flag = AtomicU32::new(0);
            let ok = run_block_threads(0, 64, kind, |tid| {
                if tid == 0 {
                    while flag.load(Ordering::Acquire) != 63 {
                        spin_pause();
                    }
                } else if tid == 63 {
                    flag.store(63, Ordering::Release);
                }
                true
            });
            assert!(ok && flag.load(Ordering::Relaxed) == 63);
        }
    }

    /// A thread that returned early does not hold its teammates' barriers back (a GPU's
    /// `bar.sync` does not wait for exited threads): thread 0 leaves, the others meet twice.
    #[test]
    fn an_exited_thread_does_not_hold_a_barrier() {
        for kind in KINDS {
            let ok = run_block_threads(0, 64, kind, |tid| {
                if tid == 0 {
                    return true;
                }
                // SAFETY: every thread but the exited one reaches both barriers.
                unsafe {
                    sync_threads();
                    sync_warp();
                    sync_threads();
                }
                true
            });
            assert!(ok);
        }
    }

    /// Threads already waiting at a barrier (parked, for fibers) go on when the last missing
    /// thread returns instead of arriving: thread 63 spins until the 63 others are about to
    /// wait, then exits; every one of them passes the barrier once.
    #[test]
    fn threads_waiting_at_a_barrier_go_on_when_the_last_one_exits() {
        for kind in KINDS {
            let before = AtomicU32::new(0);
            let after = AtomicU32::new(0);
            let ok = run_block_threads(0, 64, kind, |tid| {
                if tid == 63 {
                    while before.load(Ordering::Acquire) != 63 {
                        spin_pause();
                    }
                    return true;
                }
                before.fetch_add(1, Ordering::AcqRel);
                // SAFETY: every thread but 63, which exits, reaches the barrier.
                unsafe { sync_threads() };
                after.fetch_add(1, Ordering::AcqRel);
                true
            });
            assert!(ok, "{kind:?}");
            assert_eq!(after.load(Ordering::Relaxed), 63, "{kind:?}");
        }
    }
}
