//! The store's workers: a rayon pool that spreads one batch over the cores, and one applier thread
//! that applies asynchronous pushes in the order they were queued, with a bounded in-flight budget.

use std::sync::atomic::{AtomicBool, Ordering};
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
    threads: usize,
    applier: Applier,
}

impl Executor {
    /// A pool of `threads` workers and an applier allowing `max_inflight_bytes` of queued pushes.
    pub fn new(threads: usize, max_inflight_bytes: usize) -> Result<Arc<Self>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pstore-worker-{i}"))
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the thread pool: {e}")))?;
        Ok(Arc::new(Self {
            pool,
            threads,
            applier: Applier::new(max_inflight_bytes, "pstore-applier")?,
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
