//! The store's workers: helper threads that join a caller on one batch's tasks, a rayon pool for
//! the rest (server calls, snapshots, flushes), and one applier thread that applies asynchronous
//! pushes in the order they were queued, with a bounded in-flight budget.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A queued job.
pub type Job = Box<dyn FnOnce() -> Result<()> + Send>;

struct Queued {
    job: Job,
    bytes: usize,
    done: Arc<Completion>,
}

#[derive(Default)]
struct Inflight {
    bytes: usize,
    count: usize,
}

struct Budget {
    max_bytes: usize,
    state: Mutex<Inflight>,
    changed: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain counters behind, still meaningful.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The outcome of one asynchronous push, waited on through [`PushHandle`].
#[derive(Default)]
pub struct Completion {
    result: Mutex<Option<Result<()>>>,
    ready: Condvar,
}

impl Completion {
    fn finish(&self, r: Result<()>) {
        *lock(&self.result) = Some(r);
        self.ready.notify_all();
    }
}

/// A handle on an asynchronous push.
#[derive(Clone)]
pub struct PushHandle(Arc<Completion>);

impl PushHandle {
    /// A handle that is done already with the given outcome.
    pub fn ready(r: Result<()>) -> Self {
        let c = Completion::default();
        c.finish(r);
        Self(Arc::new(c))
    }

    /// True once the push has been applied (or has failed).
    pub fn is_done(&self) -> bool {
        lock(&self.0.result).is_some()
    }

    /// Waits up to `timeout` for the push; `Ok(None)` means it is still pending.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.0.result);
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .0
                .ready
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for the push and returns its outcome.
    pub fn wait(&self) -> Result<()> {
        loop {
            if let Some(r) = self.wait_timeout(Duration::from_secs(3600)) {
                return r;
            }
        }
    }
}

/// A thread that runs queued jobs one after the other, in the order they were queued, with a
/// bound on the bytes queued: the store's asynchronous pushes, and a remote client's.
pub struct Applier {
    budget: Arc<Budget>,
    sender: Mutex<Option<Sender<Queued>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    closed: AtomicBool,
}

impl Applier {
    /// An applier thread called `name`, allowing `max_inflight_bytes` of queued jobs.
    pub fn new(max_inflight_bytes: usize, name: &str) -> Result<Self> {
        let budget = Arc::new(Budget {
            max_bytes: max_inflight_bytes,
            state: Mutex::new(Inflight::default()),
            changed: Condvar::new(),
        });
        let (tx, rx) = channel::<Queued>();
        let b = Arc::clone(&budget);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for q in rx {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(q.job))
                        .unwrap_or_else(|_| Err(Error::Internal("a push panicked".into())));
                    q.done.finish(r);
                    let mut s = lock(&b.state);
                    s.bytes -= q.bytes;
                    s.count -= 1;
                    b.changed.notify_all();
                }
            })
            .map_err(|e| Error::Internal(format!("cannot start the applier thread: {e}")))?;
        Ok(Self {
            budget,
            sender: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            closed: AtomicBool::new(false),
        })
    }

    /// How many jobs are queued or running.
    pub fn pending(&self) -> usize {
        lock(&self.budget.state).count
    }

    /// Queues `job`, blocking while the in-flight budget is used up (backpressure). A job larger
    /// than the whole budget is admitted alone, once nothing else is in flight.
    pub fn submit(&self, bytes: usize, job: Job) -> Result<PushHandle> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument("the store is closed".into()));
        }
        {
            let mut s = lock(&self.budget.state);
            while s.count > 0 && s.bytes + bytes > self.budget.max_bytes {
                s = self
                    .budget
                    .changed
                    .wait(s)
                    .unwrap_or_else(|e| e.into_inner());
            }
            s.bytes += bytes;
            s.count += 1;
        }
        let done = Arc::new(Completion::default());
        let q = Queued {
            job,
            bytes,
            done: Arc::clone(&done),
        };
        let sent = lock(&self.sender).as_ref().map(|tx| tx.send(q));
        match sent {
            Some(Ok(())) => Ok(PushHandle(done)),
            _ => {
                let mut s = lock(&self.budget.state);
                s.bytes -= bytes;
                s.count -= 1;
                self.budget.changed.notify_all();
                Err(Error::InvalidArgument("the store is closed".into()))
            }
        }
    }

    /// Waits up to `timeout` until nothing is in flight; returns true when that is so.
    pub fn flush_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = lock(&self.budget.state);
        while s.count > 0 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = self
                .budget
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Waits until nothing is in flight.
    pub fn flush(&self) {
        let mut s = lock(&self.budget.state);
        while s.count > 0 {
            s = self
                .budget
                .changed
                .wait(s)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Runs everything queued, then stops the thread; later submissions fail.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        drop(lock(&self.sender).take());
        let handle = lock(&self.thread).take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Applier {
    fn drop(&mut self) {
        self.close();
    }
}

/// The thread pool and the ordered applier shared by every table of a store.
pub struct Executor {
    pool: rayon::ThreadPool,
    /// Where [`Executor::run_shared`] offers a batch to the `threads - 1` helper threads.
    offers: Arc<Offers>,
    helpers: Vec<JoinHandle<()>>,
    threads: usize,
    applier: Applier,
}

/// How long a helper that has just finished a batch watches for the next one before it sleeps,
/// when the gap before that batch was shorter than this (batches following each other).
const WATCH: Duration = Duration::from_micros(100);
/// How long it watches otherwise: long enough for the next phase of the same call (a pull's
/// shard tasks after its grouping), short enough to cost nothing a training step would notice.
const WATCH_SHORT: Duration = Duration::from_micros(10);

/// The newest batch of [`Executor::run_shared`] on offer to the helper threads, with a counter
/// that each offer bumps.
///
/// A helper that finished its part of a batch watches the counter (a spin loop) before it
/// sleeps on `wake`, so that a batch that follows at once finds it awake: a sleeping thread
/// takes 15 to 76 µs to wake on this VM, a third of a 4096-id pull (see
/// docs/decisions/0006-caller-works-beside-watching-helpers.md). A helper that slept through an
/// offer it was not woken for simply misses that batch; the caller runs every task a helper
/// does not take.
struct Offers {
    generation: AtomicU64,
    slot: Mutex<Offer>,
    wake: Condvar,
    stop: AtomicBool,
}

#[derive(Default)]
struct Offer {
    batch: Option<Arc<Batch>>,
    sleepers: usize,
}

impl Offers {
    /// Offers `batch` to up to `n` helpers.
    fn offer(&self, batch: &Arc<Batch>, n: usize) {
        let mut o = lock(&self.slot);
        o.batch = Some(Arc::clone(batch));
        self.generation.fetch_add(1, Ordering::Release);
        for _ in 0..n.min(o.sleepers) {
            self.wake.notify_one();
        }
    }

    /// Takes `batch` off offer, if it is still the one offered.
    fn withdraw(&self, batch: &Arc<Batch>) {
        let mut o = lock(&self.slot);
        if o.batch.as_ref().is_some_and(|b| Arc::ptr_eq(b, batch)) {
            o.batch = None;
        }
    }

    /// A helper thread's life: join each batch offered, until the executor is dropped. A helper
    /// that may not `watch` sleeps as soon as it is idle.
    fn serve(&self, watch_at_all: bool) {
        // Every offer counts, even one made before this thread first ran.
        let mut seen = 0;
        let mut watch = if watch_at_all { WATCH } else { Duration::ZERO };
        loop {
            let idle_since = Instant::now();
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == seen {
                if self.stop.load(Ordering::Relaxed) {
                    return;
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && idle_since.elapsed() >= watch {
                    let mut o = lock(&self.slot);
                    o.sleepers += 1;
                    while self.generation.load(Ordering::Acquire) == seen
                        && !self.stop.load(Ordering::Relaxed)
                    {
                        o = self.wake.wait(o).unwrap_or_else(|e| e.into_inner());
                    }
                    o.sleepers -= 1;
                    break;
                }
                std::hint::spin_loop();
            }
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            watch = if !watch_at_all {
                Duration::ZERO
            } else if idle_since.elapsed() < WATCH {
                WATCH
            } else {
                WATCH_SHORT
            };
            let batch = {
                let o = lock(&self.slot);
                seen = self.generation.load(Ordering::Acquire);
                o.batch.clone()
            };
            if let Some(b) = batch {
                b.help();
            }
        }
    }

    /// Stops the helper threads `helpers` that serve these offers and waits for them.
    fn shut_down(&self, helpers: &mut Vec<JoinHandle<()>>) {
        {
            let _o = lock(&self.slot);
            self.stop.store(true, Ordering::Relaxed);
            self.wake.notify_all();
        }
        for h in helpers.drain(..) {
            // A helper never joins itself (were the executor dropped on one): it stops on its
            // own once its current task returns.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.offers.shut_down(&mut self.helpers);
    }
}

/// Tasks `f(0) .. f(tasks - 1)` handed out one at a time, from a shared counter, to every thread
/// that calls [`Tasks::drain`]: the caller's helpers here, an OpenMP team in `openmp.rs`. A
/// panicking task is caught on the thread that ran it, the other tasks still run, and
/// [`Tasks::rethrow`] raises the first panic again on the caller.
pub(crate) struct Tasks {
    f: *const (dyn Fn(usize) + Sync + 'static),
    tasks: usize,
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

// SAFETY: `f` points to a `Sync` closure that `Tasks::new`'s caller keeps alive for every
// `drain`; everything else is atomics and a lock.
unsafe impl Send for Tasks {}
// SAFETY: as above.
unsafe impl Sync for Tasks {}

impl Tasks {
    /// # Safety
    /// `f` must stay alive for every call of [`Tasks::drain`] (the lifetime is erased so that
    /// the tasks can be handed to threads that need `'static` jobs).
    pub(crate) unsafe fn new(tasks: usize, f: &(dyn Fn(usize) + Sync)) -> Self {
        // SAFETY: only the lifetime is erased; the caller's contract above keeps `f` alive.
        let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
        Self {
            f,
            tasks,
            next: AtomicUsize::new(0),
            panic: Mutex::new(None),
        }
    }

    /// Runs tasks until none is left.
    pub(crate) fn drain(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            // SAFETY: `Tasks::new`'s contract: `f` is alive during every `drain`.
            let f = unsafe { &*self.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                lock(&self.panic).get_or_insert(p);
            }
        }
    }

    /// Raises the first panic of a task again, if one panicked. Call it once every `drain` has
    /// returned.
    pub(crate) fn rethrow(&self) {
        let panic = lock(&self.panic).take();
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

/// One batch of [`Executor::run_shared`], shared with the helper threads it was offered to.
///
/// The task closure borrows from the caller's stack, so a helper may run tasks only while the
/// caller is still inside `run_shared`: a helper first counts itself in `active`, then reads
/// `closed`; the caller sets `closed` when the tasks are handed out and then waits for `active`
/// to drop to zero. With both orders sequentially consistent, either the helper sees `closed`
/// (and leaves without touching the closure) or the caller sees the helper counted and waits
/// for it.
struct Batch {
    tasks: Tasks,
    active: AtomicUsize,
    closed: AtomicBool,
    done: Mutex<()>,
    idle: Condvar,
}

impl Batch {
    /// A helper's visit: join the batch if it is still open.
    fn help(&self) {
        self.active.fetch_add(1, Ordering::SeqCst);
        if !self.closed.load(Ordering::SeqCst) {
            self.tasks.drain();
        }
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _g = lock(&self.done);
            self.idle.notify_all();
        }
    }
}

impl Executor {
    /// A pool of `threads` workers and an applier allowing `max_inflight_bytes` of queued pushes.
    pub fn new(threads: usize, max_inflight_bytes: usize) -> Result<Arc<Self>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pstore-worker-{i}"))
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the thread pool: {e}")))?;
        let applier = Applier::new(max_inflight_bytes, "pstore-applier")?;
        let offers = Arc::new(Offers {
            generation: AtomicU64::new(0),
            slot: Mutex::new(Offer::default()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        // Helpers beyond the cores this process may use would spin on a core the caller needs:
        // those sleep as soon as they are idle.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut helpers = Vec::new();
        for i in 1..threads {
            let o = Arc::clone(&offers);
            let watch = i < cores;
            let spawned = std::thread::Builder::new()
                .name(format!("pstore-helper-{i}"))
                .spawn(move || o.serve(watch));
            match spawned {
                Ok(h) => helpers.push(h),
                Err(e) => {
                    offers.shut_down(&mut helpers);
                    return Err(Error::Internal(format!(
                        "cannot start a helper thread: {e}"
                    )));
                }
            }
        }
        Ok(Arc::new(Self {
            pool,
            offers,
            helpers,
            threads,
            applier,
        }))
    }

    /// The number of pool threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on a pool thread and returns at once (a store server's short calls: the work's
    /// own parallel iterators then run on the same pool without another hand-off). `f` must
    /// not panic: a panic in a spawned pool job aborts the process.
    pub fn spawn(&self, f: impl FnOnce() + Send + 'static) {
        self.pool.spawn(f)
    }

    /// Runs `f` inside the pool (so rayon's parallel iterators use it).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f(0) .. f(tasks - 1)` on the calling thread and up to `threads - 1` helper threads,
    /// which take tasks one at a time from a shared counter. Returns once every task has run; a
    /// panic in a task is raised again here.
    ///
    /// The caller starts on the tasks at once instead of handing the batch over and sleeping
    /// until it is done, so the two thread wake-ups of a hand-off (a pool thread's, then the
    /// caller's) are off the batch's critical path: a helper that wakes late finds fewer tasks
    /// left, and one that wakes after the last task was taken leaves without being waited for.
    /// (Why: docs/decisions/0006-caller-works-beside-watching-helpers.md.)
    pub fn run_shared(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let n = (self.threads - 1).min(tasks.saturating_sub(1));
        if n == 0 {
            return (0..tasks).for_each(f);
        }
        let batch = Arc::new(Batch {
            // SAFETY: `Batch`'s protocol keeps every `drain` inside this function (the wait
            // below), while `f` is alive.
            tasks: unsafe { Tasks::new(tasks, f) },
            active: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            done: Mutex::new(()),
            idle: Condvar::new(),
        });
        self.offers.offer(&batch, n);
        batch.tasks.drain();
        batch.closed.store(true, Ordering::SeqCst);
        self.offers.withdraw(&batch);
        // Helpers still running hold tasks taken before the counter ran out: wait for them.
        let mut g = lock(&batch.done);
        while batch.active.load(Ordering::SeqCst) > 0 {
            g = batch
                .idle
                .wait_timeout(g, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(g);
        batch.tasks.rethrow();
    }

    /// `[f(0), .., f(tasks - 1)]`, computed as [`Executor::run_shared`] runs them.
    pub fn map_shared<T: Send>(&self, tasks: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        let out: Vec<Mutex<Option<T>>> = (0..tasks).map(|_| Mutex::new(None)).collect();
        self.run_shared(tasks, &|i| *lock(&out[i]) = Some(f(i)));
        out.into_iter()
            .map(|m| {
                m.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .expect("run_shared runs every task")
            })
            .collect()
    }

    /// How many asynchronous pushes are queued or being applied.
    pub fn pending(&self) -> usize {
        self.applier.pending()
    }

    /// Queues an asynchronous push (see [`Applier::submit`]).
    pub fn submit(&self, bytes: usize, job: Job) -> Result<PushHandle> {
        self.applier.submit(bytes, job)
    }

    /// Waits up to `timeout` until nothing is in flight; returns true when that is so.
    pub fn flush_timeout(&self, timeout: Duration) -> bool {
        self.applier.flush_timeout(timeout)
    }

    /// Applies everything queued, then stops the applier; later submissions fail.
    pub fn close(&self) {
        self.applier.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn run_shared_runs_every_task_once() {
        for threads in [1, 2, 4] {
            let ex = Executor::new(threads, 1 << 20).unwrap();
            for tasks in [0, 1, 2, 3, 64, 1000] {
                let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                ex.run_shared(tasks, &|i| {
                    runs[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                    "{threads} threads, {tasks} tasks"
                );
            }
            let squares = ex.map_shared(100, |i| i * i);
            assert_eq!(squares, (0..100).map(|i| i * i).collect::<Vec<_>>());
        }
    }

    #[test]
    fn run_shared_returns_after_the_helpers_tasks_finished() {
        let ex = Executor::new(2, 1 << 20).unwrap();
        for _ in 0..5 {
            let done: Vec<AtomicUsize> = (0..9).map(|_| AtomicUsize::new(0)).collect();
            let caller = std::thread::current().id();
            let elsewhere = AtomicUsize::new(0);
            ex.run_shared(done.len(), &|i| {
                // A helper's tasks take longest, so the caller runs out of tasks first.
                let helper = std::thread::current().id() != caller;
                std::thread::sleep(Duration::from_millis(if helper { 5 } else { 1 }));
                if helper {
                    elsewhere.fetch_add(1, Ordering::Relaxed);
                }
                done[i].store(1, Ordering::Relaxed);
            });
            assert!(done.iter().all(|d| d.load(Ordering::Relaxed) == 1));
            assert!(elsewhere.into_inner() > 0, "a helper took part");
        }
    }

    #[test]
    fn a_helper_that_went_to_sleep_joins_the_next_batch() {
        let ex = Executor::new(2, 1 << 20).unwrap();
        for round in 0..3 {
            // Long past the watch: the helper sleeps on its condition variable.
            std::thread::sleep(Duration::from_millis(20));
            let caller = std::thread::current().id();
            let (started, seen_elsewhere) = (AtomicUsize::new(0), AtomicBool::new(false));
            ex.run_shared(2, &|_| {
                if std::thread::current().id() != caller {
                    seen_elsewhere.store(true, Ordering::SeqCst);
                }
                // Each task waits for the other to start: only a helper can run the second
                // while the caller is inside the first.
                started.fetch_add(1, Ordering::SeqCst);
                let t = Instant::now();
                while started.load(Ordering::SeqCst) < 2 && t.elapsed() < Duration::from_secs(10) {
                    std::thread::yield_now();
                }
            });
            assert_eq!(started.into_inner(), 2);
            assert!(
                seen_elsewhere.into_inner(),
                "round {round}: no helper woke for the batch"
            );
        }
    }

    #[test]
    fn dropping_an_executor_ends_its_helper_threads() {
        let threads_now = || {
            std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| {
                    let line = s.lines().find(|l| l.starts_with("Threads:"))?;
                    line[8..].trim().parse::<usize>().ok()
                })
        };
        let Some(before) = threads_now() else {
            return; // no /proc here: nothing to count
        };
        for _ in 0..100 {
            let ex = Executor::new(5, 1 << 20).unwrap();
            ex.run_shared(8, &|_| {});
        }
        // 100 executors of 4 helpers, 5 pool threads and an applier: a leak would leave
        // about a thousand threads; other tests running beside this one start a few dozen.
        let after = threads_now().unwrap();
        assert!(
            after < before + 200,
            "{before} threads before, {after} after"
        );
    }

    #[test]
    fn run_shared_raises_a_tasks_panic_after_the_other_tasks_ran() {
        let ex = Executor::new(2, 1 << 20).unwrap();
        let runs: Vec<AtomicUsize> = (0..50).map(|_| AtomicUsize::new(0)).collect();
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            ex.run_shared(50, &|i| {
                runs[i].fetch_add(1, Ordering::Relaxed);
                assert!(i != 7, "task 7 fails");
            })
        }));
        assert!(r.is_err(), "the panic reaches the caller");
        assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
        // The executor still works afterwards.
        let total = AtomicUsize::new(0);
        ex.run_shared(10, &|i| {
            total.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(total.into_inner(), 45);
    }

    #[test]
    fn run_shared_from_many_threads_nested_and_short() {
        // Many short batches from several threads at once (helpers often arrive after the last
        // task was taken, and must then leave without touching the finished batch), some
        // batches nested inside another's task. Every batch's data lives on its caller's stack.
        let ex = Executor::new(3, 1 << 20).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let ex = &ex;
                s.spawn(move || {
                    for round in 0..2000u64 {
                        let values: Vec<u64> =
                            (0..3).map(|i| t * 1_000_000 + round * 10 + i).collect();
                        let sum = AtomicUsize::new(0);
                        ex.run_shared(values.len(), &|i| {
                            let mut v = values[i] as usize;
                            if round % 100 == 0 {
                                let inner = AtomicUsize::new(0);
                                ex.run_shared(4, &|j| {
                                    inner.fetch_add(j, Ordering::Relaxed);
                                });
                                v += inner.into_inner() - 6;
                            }
                            sum.fetch_add(v, Ordering::Relaxed);
                        });
                        let want: u64 = values.iter().sum();
                        assert_eq!(sum.into_inner() as u64, want, "thread {t}, round {round}");
                    }
                });
            }
        });
    }

    #[test]
    fn jobs_run_in_order_and_flush_waits() {
        let ex = Executor::new(2, 1 << 20).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        for i in 0..100 {
            let log = Arc::clone(&log);
            handles.push(
                ex.submit(
                    10,
                    Box::new(move || {
                        log.lock().unwrap().push(i);
                        Ok(())
                    }),
                )
                .unwrap(),
            );
        }
        assert!(ex.flush_timeout(Duration::from_secs(10)));
        assert_eq!(*log.lock().unwrap(), (0..100).collect::<Vec<_>>());
        assert!(handles.iter().all(|h| h.is_done() && h.wait().is_ok()));
    }

    #[test]
    fn budget_bounds_inflight_bytes() {
        let ex = Executor::new(1, 100);
        let ex = ex.unwrap();
        let peak = Arc::new(AtomicUsize::new(0));
        for _ in 0..50 {
            let p = Arc::clone(&peak);
            let b = Arc::clone(&ex.applier.budget);
            ex.submit(
                40,
                Box::new(move || {
                    p.fetch_max(lock(&b.state).bytes, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(())
                }),
            )
            .unwrap();
        }
        ex.close();
        assert!(peak.load(Ordering::Relaxed) <= 100);
    }

    #[test]
    fn errors_reach_the_handle() {
        let ex = Executor::new(1, 100).unwrap();
        let h = ex
            .submit(1, Box::new(|| Err(Error::Internal("boom".into()))))
            .unwrap();
        assert!(matches!(h.wait(), Err(Error::Internal(_))));
        ex.close();
        assert!(ex.submit(1, Box::new(|| Ok(()))).is_err());
    }
}
