//! The background check of opened row files (decision 0119): one low-priority thread per
//! process verifies each queued file once, whole and in file order, so lookups of a file found
//! sound check nothing per row. It runs while files are queued and ends when the queue is
//! empty; a file closed meanwhile (its last other holder gone) is left or stopped.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::rowfile::RowFile;

/// The queue of files to verify, and whether a thread of this process (`pid`) works on it.
struct Queue {
    files: VecDeque<Weak<RowFile>>,
    running: bool,
    pid: u32,
}

fn queue() -> &'static Mutex<Queue> {
    static Q: OnceLock<Mutex<Queue>> = OnceLock::new();
    Q.get_or_init(|| {
        Mutex::new(Queue {
            files: VecDeque::new(),
            running: false,
            pid: std::process::id(),
        })
    })
}

/// Queues `file` for the background check (once: a file queued before, or of layout 1, is
/// not queued again), starting the thread if none runs.
pub(super) fn schedule(file: &Arc<RowFile>) {
    if !file.queue_scan() {
        return;
    }
    let mut q = queue().lock().unwrap_or_else(|e| e.into_inner());
    if q.pid != std::process::id() {
        // A forked child: the parent's thread is not here.
        q.pid = std::process::id();
        q.running = false;
    }
    q.files.push_back(Arc::downgrade(file));
    if q.running {
        return;
    }
    let started = std::thread::Builder::new()
        .name("pstore-rowcheck".into())
        .spawn(work);
    if started.is_ok() {
        q.running = true;
    } else {
        // No thread: lookups keep checking rows on their first read.
        for f in q.files.drain(..).filter_map(|w| w.upgrade()) {
            f.unqueue_scan();
        }
    }
}

fn work() {
    lower_priority();
    loop {
        let next = {
            let mut q = queue().lock().unwrap_or_else(|e| e.into_inner());
            match q.files.pop_front() {
                Some(w) => w,
                None => {
                    q.running = false;
                    return;
                }
            }
        };
        // A file whose store closed before its turn is dropped already.
        if let Some(f) = next.upgrade() {
            // Only this thread holds it: the store closed, stop and let it unmap.
            f.verify_all(&|| Arc::strong_count(&f) == 1);
        }
    }
}

/// The thread yields to every other of the process and machine (nice 19).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority on this thread's own id (Linux: a thread is a scheduling entity);
    // failure leaves the priority as it was.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}
