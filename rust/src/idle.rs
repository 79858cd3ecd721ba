//! Idle priority for the background writes of an `async` store's flusher.
//!
//! Training fills both cores of a small machine; the flusher's LMDB writes compete with the pool
//! threads for them. At normal priority the scheduler lets the flusher finish its time slice
//! when a pool thread wakes, so pushes and pulls wait behind it. At `SCHED_IDLE` a waking
//! thread of normal priority takes the core at once, and the flusher runs in the gaps that
//! training leaves. (Why: docs/decisions/0013-idle-priority-flusher-writes.md.)
//!
//! Only the transaction (LMDB's writes and the commit) runs at idle priority: the take, which
//! holds pushes off, and the bookkeeping after the commit, which takes shard locks, run at
//! normal priority. An idle thread can still be starved (another process filling the cores)
//! or hold something a normal thread waits for (the LMDB writer lock), so:
//!
//! - whoever waits for the flusher (`flush()`, a `sync` push, a snapshot, a table creation, a
//!   full load of a lazy table) lifts it back to normal priority first;
//! - a watchdog thread lifts it when its write has been idle for longer than the allowance
//!   (twice the flusher's current interval), which bounds the loss window whatever the load.
//!
//! The flusher learns from each background cycle ([`IdleWrites::outcome`]): one the watchdog
//! had to lift stretches its interval, one that finished at idle priority shrinks it back (see
//! `Flusher::run`).
//!
//! A thread may leave `SCHED_IDLE` again only with `CAP_SYS_NICE` or an `RLIMIT_NICE` that allows
//! nice 0, so the flusher goes idle only when a probe shows the process can lift it; otherwise
//! every write runs at normal priority, as before.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Sets the scheduling policy of thread `tid` (0: the calling thread) at priority 0.
#[cfg(target_os = "linux")]
fn set_policy(tid: i32, policy: libc::c_int) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid `sched_param`; the call only reads it.
    unsafe { libc::sched_setscheduler(tid, policy, &param) == 0 }
}

#[cfg(target_os = "linux")]
const IDLE: libc::c_int = libc::SCHED_IDLE;
#[cfg(target_os = "linux")]
const NORMAL: libc::c_int = libc::SCHED_OTHER;

#[cfg(not(target_os = "linux"))]
fn set_policy(_tid: i32, _policy: i32) -> bool {
    false
}
#[cfg(not(target_os = "linux"))]
const IDLE: i32 = 0;
#[cfg(not(target_os = "linux"))]
const NORMAL: i32 = 0;

/// The calling thread's kernel id.
fn current_tid() -> i32 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid takes no arguments and cannot fail.
        unsafe { libc::syscall(libc::SYS_gettid) as i32 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}

/// Whether this process can put a thread at idle priority and lift it back (probed once, on a
/// thread of its own).
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        std::thread::Builder::new()
            .name("pstore-probe".into())
            .spawn(|| set_policy(0, IDLE) && set_policy(0, NORMAL))
            .ok()
            .and_then(|h| h.join().ok())
            .unwrap_or(false)
    })
}

struct State {
    /// Writes may go idle: asked for, the process can lift them, and the watchdog runs.
    on: bool,
    /// The threads writing at idle priority now (a cycle may write several LMDB environments
    /// at once, a thread each).
    tids: Vec<i32>,
    /// Since when the running write has been at idle priority (its first thread).
    since: Option<Instant>,
    /// The running cycle stays at normal priority (it was lifted, or somebody waits for it).
    lifted: bool,
    /// Lifts over the store's life (by waiters and by the watchdog).
    lifts: u64,
    /// How long a write may stay idle before the watchdog lifts it.
    allowance: Duration,
    /// The running cycle wrote at idle priority at some point.
    went_idle: bool,
    /// The watchdog lifted the running cycle.
    starved: bool,
    /// Threads in [`IdleWrites::wait_for`]: while there are any, cycles start lifted.
    waiters: usize,
    stop: bool,
}

/// The idle-priority switch of one flusher, and its watchdog.
pub struct IdleWrites {
    state: Mutex<State>,
    cv: Condvar,
    watchdog: Mutex<Option<JoinHandle<()>>>,
}

/// What a cycle's writes went through (see [`IdleWrites::outcome`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Some write of the cycle ran at idle priority.
    pub went_idle: bool,
    /// ... and the cycle was never lifted back to normal priority.
    pub stayed_idle: bool,
    /// The watchdog lifted it: it could not finish idle within the allowance.
    pub starved: bool,
}

/// Restores normal priority when a write ends (or fails): the thread's id while it is idle.
pub struct Writing<'a>(&'a IdleWrites, Option<i32>);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        let Some(tid) = self.1 else {
            return;
        };
        let mut st = self.0.lock();
        // Gone from the list when a lift has put it back already.
        if let Some(at) = st.tids.iter().position(|&t| t == tid) {
            st.tids.swap_remove(at);
            set_policy(0, NORMAL);
            if st.tids.is_empty() {
                st.since = None;
            }
        }
    }
}

impl IdleWrites {
    /// Idle writes when `on` (and the process can lift them), lifted after `allowance` at the
    /// latest; starts the watchdog.
    pub fn start(on: bool, allowance: Duration) -> Arc<Self> {
        let me = Arc::new(Self {
            state: Mutex::new(State {
                on: false,
                tids: Vec::new(),
                since: None,
                lifted: true,
                lifts: 0,
                allowance,
                went_idle: false,
                starved: false,
                waiters: 0,
                stop: false,
            }),
            cv: Condvar::new(),
            watchdog: Mutex::new(None),
        });
        if on && usable() {
            let w = Arc::clone(&me);
            if let Ok(h) = std::thread::Builder::new()
                .name("pstore-watchdog".into())
                .spawn(move || w.watch())
            {
                *me.watchdog.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
                me.lock().on = true;
            }
        }
        me
    }

    /// Whether writes may go idle at all.
    pub fn enabled(&self) -> bool {
        self.lock().on
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cycle starts on the calling thread; `background`: nobody waits for it.
    pub fn begin(&self, background: bool) {
        let mut st = self.lock();
        st.lifted = !(background && st.on && st.waiters == 0);
        st.went_idle = false;
        st.starved = false;
    }

    /// How the cycle begun last went so far: it wrote at idle priority, and it ended at idle
    /// priority (nobody lifted it), or the watchdog had to lift it.
    pub fn outcome(&self) -> Outcome {
        let st = self.lock();
        Outcome {
            went_idle: st.went_idle,
            stayed_idle: st.went_idle && !st.lifted,
            starved: st.starved,
        }
    }

    /// Sets how long a write may stay idle before the watchdog lifts it.
    pub fn set_allowance(&self, allowance: Duration) {
        self.lock().allowance = allowance;
        self.cv.notify_all();
    }

    /// Runs the caller's write at idle priority until the guard drops, unless the cycle was
    /// lifted. Several threads may write at once (each LMDB environment has its own writer).
    pub fn writing(&self) -> Writing<'_> {
        let mut st = self.lock();
        let tid = current_tid();
        if st.lifted || st.tids.contains(&tid) || !set_policy(0, IDLE) {
            return Writing(self, None);
        }
        st.tids.push(tid);
        st.since.get_or_insert_with(Instant::now);
        st.went_idle = true;
        self.cv.notify_all();
        Writing(self, Some(tid))
    }

    fn lift_locked(&self, st: &mut State) {
        st.lifted = true;
        if st.since.take().is_some() {
            for tid in st.tids.drain(..) {
                set_policy(tid, NORMAL);
            }
            st.lifts += 1;
        }
    }

    /// Puts the running cycle back at normal priority for the rest of it: called by whoever is
    /// about to wait for it.
    pub fn lift(&self) {
        let mut st = self.lock();
        self.lift_locked(&mut st);
    }

    /// Runs `f`, which waits for the flusher, with the running cycle and every cycle that
    /// starts meanwhile at normal priority.
    pub fn wait_for<R>(&self, f: impl FnOnce() -> R) -> R {
        {
            let mut st = self.lock();
            st.waiters += 1;
            self.lift_locked(&mut st);
        }
        let r = f();
        self.lock().waiters -= 1;
        r
    }

    /// How often a write was lifted.
    pub fn lifts(&self) -> u64 {
        self.lock().lifts
    }

    fn watch(&self) {
        let mut st = self.lock();
        loop {
            if st.stop {
                return;
            }
            st = match st.since {
                None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let due = t + st.allowance;
                    let now = Instant::now();
                    if now >= due {
                        self.lift_locked(&mut st);
                        st.starved = true;
                        st
                    } else {
                        self.cv
                            .wait_timeout(st, due - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                }
            };
        }
    }

    /// Stops the watchdog.
    pub fn stop(&self) {
        {
            let mut st = self.lock();
            st.stop = true;
            st.on = false;
        }
        self.cv.notify_all();
        if let Some(h) = self
            .watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheduling policy of thread `tid` of this process, from `/proc`.
    #[cfg(target_os = "linux")]
    fn policy_of(tid: i32) -> i64 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        // Field 41 of stat; `rest` starts at field 3.
        rest.split(' ').nth(41 - 3).unwrap().parse().unwrap()
    }

    /// Whether this process can lift idle threads (root always can).
    #[cfg(target_os = "linux")]
    fn can_test() -> bool {
        if usable() {
            return true;
        }
        // SAFETY: geteuid only returns a value.
        let euid = unsafe { libc::geteuid() };
        assert_ne!(euid, 0, "root can always lift a thread");
        eprintln!("this process cannot lift a thread out of SCHED_IDLE; nothing to check");
        false
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn background_writes_go_idle_and_waiters_lift_them() {
        if !can_test() {
            return;
        }
        let w = IdleWrites::start(true, Duration::from_secs(60));
        assert!(w.enabled());
        let me = current_tid();
        w.begin(true);
        {
            let _g = w.writing();
            assert_eq!(policy_of(me), IDLE as i64);
        }
        assert_eq!(policy_of(me), NORMAL as i64);
        {
            let _g = w.writing();
            assert_eq!(policy_of(me), IDLE as i64);
            // Another thread, about to wait for this cycle, lifts it.
            let w2 = Arc::clone(&w);
            std::thread::spawn(move || w2.lift()).join().unwrap();
            assert_eq!(policy_of(me), NORMAL as i64);
            assert_eq!(w.lifts(), 1);
        }
        // While a thread waits for the flusher, background cycles start lifted.
        let w2 = Arc::clone(&w);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tx2, rx2) = std::sync::mpsc::channel::<()>();
        let waiter = std::thread::spawn(move || {
            w2.wait_for(|| {
                tx.send(()).unwrap();
                rx2.recv().unwrap();
            })
        });
        rx.recv().unwrap();
        w.begin(true);
        drop(w.writing());
        assert_eq!(policy_of(me), NORMAL as i64);
        tx2.send(()).unwrap();
        waiter.join().unwrap();
        // A lifted cycle stays at normal priority; the next background one goes idle again.
        drop(w.writing());
        assert_eq!(policy_of(me), NORMAL as i64);
        w.begin(true);
        {
            let _g = w.writing();
            assert_eq!(policy_of(me), IDLE as i64);
        }
        w.begin(false);
        {
            let _g = w.writing();
            assert_eq!(
                policy_of(me),
                NORMAL as i64,
                "a cycle somebody waits for stays normal"
            );
        }
        w.stop();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_lift_reaches_every_thread_writing() {
        if !can_test() {
            return;
        }
        let w = IdleWrites::start(true, Duration::from_secs(60));
        w.begin(true);
        let mine = w.writing();
        let me = current_tid();
        let (tx, rx) = std::sync::mpsc::channel::<i32>();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let w2 = Arc::clone(&w);
        let other = std::thread::spawn(move || {
            let g = w2.writing();
            tx.send(current_tid()).unwrap();
            wait.recv().unwrap();
            drop(g);
            policy_of(current_tid())
        });
        let tid = rx.recv().unwrap();
        assert_eq!(policy_of(me), IDLE as i64);
        assert_eq!(policy_of(tid), IDLE as i64);
        w.lift();
        assert_eq!(policy_of(me), NORMAL as i64);
        assert_eq!(policy_of(tid), NORMAL as i64);
        assert_eq!(w.lifts(), 1);
        go.send(()).unwrap();
        assert_eq!(other.join().unwrap(), NORMAL as i64);
        drop(mine);
        // The first thread's write ending leaves the second one idle, with its start.
        w.begin(true);
        let first = w.writing();
        let w3 = Arc::clone(&w);
        let (tx, rx) = std::sync::mpsc::channel::<i32>();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let second = std::thread::spawn(move || {
            let _g = w3.writing();
            tx.send(current_tid()).unwrap();
            wait.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        drop(first);
        assert_eq!(policy_of(me), NORMAL as i64);
        assert_eq!(policy_of(tid), IDLE as i64);
        assert!(w.lock().since.is_some());
        go.send(()).unwrap();
        second.join().unwrap();
        assert!(w.lock().since.is_none());
        assert_eq!(w.outcome(), outcome(true, true, false));
        w.stop();
    }

    #[cfg(target_os = "linux")]
    fn outcome(went_idle: bool, stayed_idle: bool, starved: bool) -> Outcome {
        Outcome {
            went_idle,
            stayed_idle,
            starved,
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_watchdog_lifts_a_write_idle_past_the_allowance() {
        if !can_test() {
            return;
        }
        // The writing thread runs at idle priority, so on a loaded machine it may not run again until
        // the watchdog lifts it: a thread at normal priority watches its policy instead.
        let allowance = Duration::from_millis(300);
        let w = IdleWrites::start(true, allowance);
        let me = current_tid();
        let t0 = Instant::now();
        let watcher = std::thread::spawn(move || {
            let mut seen_idle = false;
            loop {
                let p = policy_of(me);
                if p == IDLE as i64 {
                    seen_idle = true;
                } else if seen_idle {
                    return t0.elapsed();
                }
                assert!(t0.elapsed() < Duration::from_secs(20), "never lifted");
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        w.begin(true);
        let g = w.writing();
        let lifted_after = watcher.join().unwrap();
        // The clock started before the write began, so the lift came at least an allowance in.
        assert!(lifted_after >= allowance, "lifted after {lifted_after:?}");
        assert_eq!(policy_of(me), NORMAL as i64);
        assert_eq!(w.lifts(), 1);
        drop(g);
        assert_eq!(w.outcome(), outcome(true, false, true));
        // A longer allowance: the next background write stays idle past the old one.
        w.set_allowance(Duration::from_secs(30));
        w.begin(true);
        let g = w.writing();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(policy_of(me), IDLE as i64);
        drop(g);
        assert_eq!(w.outcome(), outcome(true, true, false));
        assert_eq!(w.lifts(), 1);
        // A lift by a waiter is not starvation.
        w.begin(true);
        let g = w.writing();
        w.lift();
        drop(g);
        assert_eq!(w.outcome(), outcome(true, false, false));
        w.stop();
    }

    #[test]
    fn off_never_goes_idle() {
        let w = IdleWrites::start(false, Duration::from_millis(1));
        assert!(!w.enabled());
        w.begin(true);
        let g = w.writing();
        assert!(w.lock().since.is_none());
        drop(g);
        w.stop();
    }
}
