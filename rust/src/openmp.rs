//! Running a batch's shard tasks on the caller's OpenMP team instead of the store's own pool.
//!
//! A training thread of PyTorch on CPU is the master of an OpenMP team (torch's intra-op
//! parallelism). After each parallel region, libgomp's workers spin for a while before they sleep.
//! A store call made from that thread between two of torch's regions then meets a worker spinning
//! on the other core, and the store's own pool threads fight it for the cores (see
//! docs/decisions/0022-store-work-on-torchs-openmp-team.md). A thread that has *joined* the
//! runtime runs its batches as OpenMP parallel regions of that same runtime: the spinning
//! workers take the shard tasks, and nothing is oversubscribed.
//!
//! The runtime is one already loaded in the process (torch's libgomp), found by path and bound with
//! `dlopen(RTLD_NOLOAD)`: pstore never loads an OpenMP library of its own. Only `GOMP_parallel`
//! (GCC's ABI since GCC 4.9, also provided by LLVM's and Intel's runtimes) and
//! `omp_get_max_threads` are used.

use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void, CString};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::executor::Tasks;

type ParallelFn = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type MaxThreadsFn = unsafe extern "C" fn() -> c_int;

/// The entry points of a loaded OpenMP runtime.
struct Runtime {
    path: String,
    parallel: ParallelFn,
    max_threads: MaxThreadsFn,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread's batches run on its OpenMP team.
    static JOINED: Cell<bool> = const { Cell::new(false) };
    /// True inside one of our parallel regions (a nested batch then runs inline).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

fn symbol(handle: *mut c_void, name: &str) -> Result<*mut c_void> {
    let c = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: `handle` came from dlopen and `c` is a NUL-terminated string.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if p.is_null() {
        return Err(Error::InvalidArgument(format!(
            "the OpenMP runtime has no symbol {name}"
        )));
    }
    Ok(p)
}

/// Binds the OpenMP runtime at `path`, which must already be loaded in this process. Once bound,
/// the process keeps that runtime; binding another path fails.
pub fn bind(path: &str) -> Result<()> {
    let _g = LOADING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = RUNTIME.get() {
        if rt.path == path {
            return Ok(());
        }
        return Err(Error::InvalidArgument(format!(
            "the OpenMP runtime {} is bound already, not {path}",
            rt.path
        )));
    }
    let c = CString::new(path)
        .map_err(|_| Error::InvalidArgument("an OpenMP runtime path has a NUL byte".into()))?;
    // SAFETY: a plain dlopen with RTLD_NOLOAD: it only returns a handle on a library that is
    // loaded already and runs no initialiser.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return Err(Error::InvalidArgument(format!(
            "no OpenMP runtime {path} is loaded in this process"
        )));
    }
    let parallel = symbol(handle, "GOMP_parallel")?;
    let max_threads = symbol(handle, "omp_get_max_threads")?;
    // SAFETY: the symbols have these C signatures in every runtime that exports them; the handle
    // is never closed, so they stay valid for the life of the process.
    let rt = unsafe {
        Runtime {
            path: path.to_string(),
            parallel: std::mem::transmute::<*mut c_void, ParallelFn>(parallel),
            max_threads: std::mem::transmute::<*mut c_void, MaxThreadsFn>(max_threads),
        }
    };
    let _ = RUNTIME.set(rt);
    Ok(())
}

/// The path of the bound runtime, if any.
pub fn bound() -> Option<&'static str> {
    RUNTIME.get().map(|r| r.path.as_str())
}

/// Makes this thread's batches run on its OpenMP team (`true`) or on the store's pool (`false`).
/// Joining needs a bound runtime.
pub fn join(on: bool) -> Result<()> {
    if on && RUNTIME.get().is_none() {
        return Err(Error::InvalidArgument(
            "no OpenMP runtime is bound: bind one first".into(),
        ));
    }
    JOINED.with(|j| j.set(on));
    Ok(())
}

/// Whether this thread has joined its OpenMP team.
pub fn joined() -> bool {
    JOINED.with(|j| j.get())
}

extern "C" fn region(data: *mut c_void) {
    // SAFETY: `data` is the `Tasks` that `run` keeps alive until GOMP_parallel has returned,
    // which is after every thread of the team has left this function.
    let work = unsafe { &*(data as *const Tasks) };
    INSIDE.with(|i| i.set(true));
    work.drain();
    INSIDE.with(|i| i.set(false));
}

/// Runs `f(0) .. f(tasks - 1)` on this thread's OpenMP team of at most `threads` threads, and
/// returns true; returns false (running nothing) when this thread has not joined a team or its
/// team has one thread, so that the caller uses its own pool. Tasks are handed out one at a time
/// from a shared counter.
pub fn run(tasks: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
    if INSIDE.with(|i| i.get()) {
        // A batch inside a task of ours (on any thread of the team) runs inline.
        (0..tasks).for_each(f);
        return true;
    }
    if !joined() {
        return false;
    }
    let Some(rt) = RUNTIME.get() else {
        return false;
    };
    // SAFETY: a plain query of the calling thread's OpenMP settings.
    let team = unsafe { (rt.max_threads)() }.max(1) as usize;
    if team <= 1 {
        // The caller runs torch on one thread: the other cores are the store pool's.
        return false;
    }
    let n = threads.min(team).min(tasks);
    if n <= 1 {
        (0..tasks).for_each(f);
        return true;
    }
    // SAFETY: every `drain` runs inside GOMP_parallel below, while `f` is borrowed.
    let work = unsafe { Tasks::new(tasks, f) };
    // SAFETY: `region` only reads `work` through the pointer, and GOMP_parallel returns once the
    // whole team has finished the region, so `work` outlives every use.
    unsafe { (rt.parallel)(region, &work as *const Tasks as *mut c_void, n as c_uint, 0) };
    work.rethrow();
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::panic::catch_unwind;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// One test, because the bound runtime is the process's: loads the system's libgomp (as torch
    /// would have), binds it, and runs batches on a team of two.
    #[test]
    fn batches_run_on_the_bound_team() {
        assert!(bind("no-such-libgomp.so.1").is_err());
        assert!(
            !run(4, 2, &|_| {}),
            "not joined: the caller's own pool runs it"
        );
        let name = CString::new("libgomp.so.1").unwrap();
        // SAFETY: loading a system library, as torch's import does.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        assert!(
            !h.is_null(),
            "libgomp.so.1 (Debian's libgomp1) must be installed"
        );
        bind("libgomp.so.1").unwrap();
        bind("libgomp.so.1").unwrap(); // the same again is fine
        assert!(bind("other-libgomp.so.1").is_err());
        assert_eq!(bound(), Some("libgomp.so.1"));
        let set = symbol(h, "omp_set_num_threads").unwrap();
        // SAFETY: omp_set_num_threads(int) of the runtime just bound.
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(set)(2) };

        join(true).unwrap();
        assert!(joined());
        let seen: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        let threads = Mutex::new(HashSet::new());
        assert!(run(seen.len(), 8, &|t| {
            seen[t].fetch_add(1, Ordering::Relaxed);
            threads.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(std::time::Duration::from_micros(20));
        }));
        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        assert_eq!(
            threads.lock().unwrap().len(),
            2,
            "a team of two ran the tasks"
        );

        // A batch inside a task runs inline; a panic reaches the caller; the team still works.
        let inner = AtomicUsize::new(0);
        assert!(run(3, 2, &|_| {
            assert!(run(5, 2, &|_| {
                inner.fetch_add(1, Ordering::Relaxed);
            }));
        }));
        assert_eq!(inner.load(Ordering::Relaxed), 15);
        let r = catch_unwind(|| run(10, 2, &|t| assert!(t != 3, "task 3 fails")));
        assert!(r.is_err());
        assert!(run(2, 2, &|_| {}));

        join(false).unwrap();
        assert!(!run(4, 2, &|_| {}));
    }
}
