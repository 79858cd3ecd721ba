//! Synchronous steps of one job on one server: the job's clocks and worker leases, and each
//! step's aggregate of the workers' gradients, applied once per row when the step is complete.
//!
//! A push tagged with step `s` of job `j` is added (in float64, per row) to the aggregate of
//! `(s, table)` instead of being applied. When every live worker's clock is at least `s` (each
//! worker reports its clock to every server after its pushes of the step were acknowledged), the
//! aggregate is applied with the table's optimizer in one push: one optimizer step per row per
//! step, whatever the number of workers. Snapshots and applies exclude each other, so a
//! snapshot holds the steps applied so far and nothing of a later one.
//!
//! Leases: every call of a worker (clock, tagged push, heartbeat) renews its lease; a waiter that
//! finds a worker silent for longer than the lease either fails with [`Error::WorkerLost`] or,
//! with `continue`, marks it lost and goes on without it. A lost worker that calls again rejoins
//! at the step the job is at.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tonic::Status;

use crate::error::{invalid, Error, Result};
use crate::net::proto::{ClockRequest, ClockResponse};
use crate::net::status_of;
use crate::store::{Store, Table};

/// The lease when a job does not give one.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// One table's part of a step: the float64 sum of the gradients per row.
enum Agg {
    Sparse {
        dim: usize,
        index: HashMap<u64, usize>,
        ids: Vec<u64>,
        sums: Vec<f64>,
    },
    Dense(Vec<f64>),
}

/// How a job was started (fixed by the first call of the job).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobOptions {
    /// Seconds without a call after which a worker is lost.
    pub lease: Duration,
    /// Waiters go on without a lost worker (false: they fail).
    pub continue_on_loss: bool,
    /// Apply the mean of the workers' gradients (false: the sum).
    pub mean: bool,
}

/// The state of the current job.
struct Job {
    id: String,
    opts: JobOptions,
    clocks: Vec<u64>,
    seen: Vec<Instant>,
    joined: Vec<bool>,
    lost: Vec<bool>,
    /// Steps applied (every step <= applied is in the rows).
    applied: u64,
    /// A worker lost under the `fail` option: the error every waiter gets.
    failed: Option<String>,
    pending: BTreeMap<u64, BTreeMap<String, Agg>>,
}

impl Job {
    fn min_live(&self) -> Option<u64> {
        self.clocks
            .iter()
            .zip(&self.lost)
            .filter(|(_, &l)| !l)
            .map(|(&c, _)| c)
            .min()
    }
}

/// What a clock call's answer reports of the job.
#[derive(Debug, Clone, Default)]
pub struct JobView {
    /// The job's id ("" when the server has none).
    pub job: String,
    /// Every worker's clock.
    pub clocks: Vec<u64>,
    /// Workers that called since the job started.
    pub joined: Vec<u32>,
    /// Workers lost (and not back).
    pub lost: Vec<u32>,
    /// Steps applied.
    pub applied: u64,
}

/// The synchronous-step state of a server.
pub struct Steps {
    job: Mutex<Option<Job>>,
    /// Held while a step is applied and while a snapshot is written.
    applying: Mutex<()>,
    /// Ticks on every change, for waiters.
    tick: watch::Sender<u64>,
}

impl Default for Steps {
    fn default() -> Self {
        Self {
            job: Mutex::new(None),
            applying: Mutex::new(()),
            tick: watch::channel(0).0,
        }
    }
}

fn lost_message(job: &str, w: usize, lease: Duration) -> String {
    format!(
        "worker {w} of job {job:?} is lost: no call from it for {:.1} s (its lease)",
        lease.as_secs_f64()
    )
}

impl Steps {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Job>> {
        self.job.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.tick.send_modify(|t| *t = t.wrapping_add(1));
    }

    /// The job's state as a clock answer reports it.
    pub fn view(&self) -> JobView {
        let g = self.lock();
        let Some(j) = g.as_ref() else {
            return JobView::default();
        };
        let list = |v: &[bool]| {
            v.iter()
                .enumerate()
                .filter(|(_, &b)| b)
                .map(|(i, _)| i as u32)
                .collect()
        };
        JobView {
            job: j.id.clone(),
            clocks: j.clocks.clone(),
            joined: list(&j.joined),
            lost: list(&j.lost),
            applied: j.applied,
        }
    }

    /// Worker `w` of job `job` reports clock `clock` (clocks only move forward). A job other
    /// than the current one starts afresh; a lost worker rejoins at the job's applied step.
    pub fn advance(&self, job: &str, w: u32, n: u32, clock: u64, opts: JobOptions) -> Result<()> {
        if n == 0 || n > super::state::MAX_WORKERS || w >= n {
            return Err(invalid(format!(
                "worker {w} is not in 0..num_workers = 0..{n} (at most {})",
                super::state::MAX_WORKERS
            )));
        }
        let mut g = self.lock();
        if g.as_ref().is_none_or(|j| j.id != job) {
            if clock > 0 {
                // Only a worker joining at clock 0 starts a job: a late call of an ended job
                // must not replace the job that followed it.
                return Err(invalid(format!(
                    "job {job:?} is not running on this server (its job is {:?}); a worker \
                     joins a job at clock 0",
                    g.as_ref().map_or("", |j| j.id.as_str())
                )));
            }
            let now = Instant::now();
            *g = Some(Job {
                id: job.to_string(),
                opts,
                clocks: vec![0; n as usize],
                seen: vec![now; n as usize],
                joined: vec![false; n as usize],
                lost: vec![false; n as usize],
                applied: 0,
                failed: None,
                pending: BTreeMap::new(),
            });
        }
        let j = g.as_mut().expect("job set above");
        if j.clocks.len() != n as usize {
            return Err(invalid(format!(
                "job {job:?} has {} workers, worker {w} says {n}",
                j.clocks.len()
            )));
        }
        let w = w as usize;
        if j.lost[w] {
            j.lost[w] = false;
            j.clocks[w] = j.clocks[w].max(j.applied);
        }
        if j.failed.is_some() && !j.lost.iter().any(|&l| l) {
            // The lost worker is back under `fail`: the job may go on.
            j.failed = None;
        }
        j.joined[w] = true;
        j.seen[w] = Instant::now();
        j.clocks[w] = j.clocks[w].max(clock);
        drop(g);
        self.notify();
        Ok(())
    }

    fn check_push(j: &Job, job: &str, step: u64) -> Result<()> {
        if j.id != job {
            return Err(invalid(format!(
                "a push of job {job:?} reached a server whose job is {:?}",
                j.id
            )));
        }
        if step <= j.applied {
            return Err(invalid(format!(
                "job {job:?}: a push for step {step} arrived after the step was applied \
                 ({} steps applied)",
                j.applied
            )));
        }
        Ok(())
    }

    /// Renews worker `w`'s lease in job `job` (a heartbeat); false when that is not the job.
    pub fn renew(&self, job: &str, w: u32) -> bool {
        let mut g = self.lock();
        match g.as_mut() {
            Some(j) if j.id == job && (w as usize) < j.seen.len() => {
                j.seen[w as usize] = Instant::now();
                true
            }
            _ => false,
        }
    }

    /// Adds a sparse push of worker `w` to step `step`'s aggregate of `table`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_sparse(
        &self,
        job: &str,
        w: u32,
        step: u64,
        table: &str,
        dim: usize,
        ids: &[u64],
        grads: &[f32],
    ) -> Result<()> {
        let mut g = self.lock();
        let j = g
            .as_mut()
            .ok_or_else(|| invalid(format!("job {job:?} has not started on this server")))?;
        Self::check_push(j, job, step)?;
        if let Some(s) = j.seen.get_mut(w as usize) {
            *s = Instant::now();
        }
        let agg = j
            .pending
            .entry(step)
            .or_default()
            .entry(table.to_string())
            .or_insert_with(|| Agg::Sparse {
                dim,
                index: HashMap::new(),
                ids: Vec::new(),
                sums: Vec::new(),
            });
        let Agg::Sparse {
            dim: d,
            index,
            ids: have,
            sums,
        } = agg
        else {
            return Err(invalid(format!("table {table:?} is not sparse")));
        };
        if *d != dim {
            return Err(invalid(format!("table {table:?}: dim {dim}, expected {d}")));
        }
        for (k, &id) in ids.iter().enumerate() {
            let r = *index.entry(id).or_insert_with(|| {
                have.push(id);
                sums.resize(sums.len() + dim, 0.0);
                have.len() - 1
            });
            let dst = &mut sums[r * dim..(r + 1) * dim];
            for (a, &b) in dst.iter_mut().zip(&grads[k * dim..(k + 1) * dim]) {
                *a += f64::from(b);
            }
        }
        Ok(())
    }

    /// Adds a dense push of worker `w` to step `step`'s aggregate of `table`.
    pub fn add_dense(&self, job: &str, w: u32, step: u64, table: &str, grad: &[f32]) -> Result<()> {
        let mut g = self.lock();
        let j = g
            .as_mut()
            .ok_or_else(|| invalid(format!("job {job:?} has not started on this server")))?;
        Self::check_push(j, job, step)?;
        if let Some(s) = j.seen.get_mut(w as usize) {
            *s = Instant::now();
        }
        let agg = j
            .pending
            .entry(step)
            .or_default()
            .entry(table.to_string())
            .or_insert_with(|| Agg::Dense(vec![0.0; grad.len()]));
        match agg {
            Agg::Dense(sums) if sums.len() == grad.len() => {
                for (a, &b) in sums.iter_mut().zip(grad) {
                    *a += f64::from(b);
                }
                Ok(())
            }
            _ => Err(invalid(format!(
                "table {table:?}: not a dense table of this size"
            ))),
        }
    }

    /// Applies every complete step (each live worker's clock is at least the step), in order.
    /// Blocking: runs the optimizer over the aggregates.
    pub fn apply_ready(&self, store: &Store) -> Result<()> {
        let _a = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let (step, tables, divisor) = {
                let mut g = self.lock();
                let Some(j) = g.as_mut() else { return Ok(()) };
                let Some(min) = j.min_live() else {
                    return Ok(());
                };
                if min <= j.applied {
                    return Ok(());
                }
                let step = j.applied + 1;
                let tables = j.pending.remove(&step).unwrap_or_default();
                let live = j.lost.iter().filter(|&&l| !l).count().max(1);
                let divisor = if j.opts.mean { live as f64 } else { 1.0 };
                (step, tables, divisor)
            };
            let mut first_err = None;
            for (name, agg) in tables {
                if let Err(e) = apply_one(store, &name, agg, divisor) {
                    first_err.get_or_insert(e);
                }
            }
            {
                let mut g = self.lock();
                if let Some(j) = g.as_mut() {
                    j.applied = j.applied.max(step);
                }
            }
            self.notify();
            if let Some(e) = first_err {
                return Err(e);
            }
        }
    }

    /// Runs `f` while no step is being applied (a snapshot at a step boundary).
    pub fn at_boundary<R>(&self, f: impl FnOnce() -> R) -> R {
        let _a = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        f()
    }

    /// What a waiter sees now: Ok(true) when done, Ok(false) to wait on, an error when the job
    /// failed, ended, or a worker is lost under `fail`. Marks workers lost under `continue`
    /// (returns `needs_apply` then).
    fn check(&self, job: &str, target: u64, synced: bool) -> Result<(bool, bool)> {
        let mut g = self.lock();
        let Some(j) = g.as_mut() else {
            return Err(invalid(format!(
                "job {job:?} has not started on this server"
            )));
        };
        if j.id != job {
            return Err(invalid(format!(
                "job {job:?} ended: this server's job is now {:?}",
                j.id
            )));
        }
        if let Some(m) = &j.failed {
            return Err(Error::WorkerLost(m.clone()));
        }
        let now = Instant::now();
        let mut newly_lost = false;
        for w in 0..j.clocks.len() {
            if j.lost[w] || j.clocks[w] >= target {
                continue;
            }
            if now.duration_since(j.seen[w]) > j.opts.lease {
                let m = lost_message(&j.id, w, j.opts.lease);
                if j.opts.continue_on_loss {
                    j.lost[w] = true;
                    newly_lost = true;
                    eprintln!(
                        "event=worker_lost job={:?} worker={w} action=continue",
                        j.id
                    );
                } else {
                    eprintln!("event=worker_lost job={:?} worker={w} action=fail", j.id);
                    j.failed = Some(m.clone());
                    drop(g);
                    self.notify();
                    return Err(Error::WorkerLost(m));
                }
            }
        }
        let min = j.min_live().unwrap_or(u64::MAX);
        let done = min >= target && (!synced || j.applied >= target);
        Ok((done, newly_lost))
    }

    /// Waits until every live worker's clock is at least `target` and, with `synced`, step
    /// `target` is applied. Renews `w`'s lease while it waits.
    pub async fn wait(
        self: &Arc<Self>,
        store: &Arc<Store>,
        job: &str,
        w: u32,
        target: u64,
        synced: bool,
    ) -> Result<()> {
        let mut rx = self.tick.subscribe();
        loop {
            let (done, newly_lost) = self.check(job, target, synced)?;
            if done {
                return Ok(());
            }
            if newly_lost {
                let (me, st) = (Arc::clone(self), Arc::clone(store));
                tokio::task::spawn_blocking(move || me.apply_ready(&st))
                    .await
                    .map_err(|e| Error::Internal(format!("applying a step: {e}")))??;
                continue;
            }
            let lease = {
                let mut g = self.lock();
                match g.as_mut() {
                    Some(j) => {
                        // A waiting worker is alive: its call is open.
                        if let Some(s) = j.seen.get_mut(w as usize) {
                            *s = Instant::now();
                        }
                        j.opts.lease
                    }
                    None => DEFAULT_LEASE,
                }
            };
            let tick = (lease / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
            let _ = tokio::time::timeout(tick, rx.changed()).await;
        }
    }
}

fn apply_one(store: &Store, name: &str, agg: Agg, divisor: f64) -> Result<()> {
    let table = match store.table(name) {
        Ok(t) => t,
        // Dropped while its step was pending: nothing to apply.
        Err(Error::UnknownTable(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    match (table, agg) {
        (Table::Sparse(t), Agg::Sparse { ids, sums, .. }) => {
            let grads: Vec<f32> = sums.iter().map(|&x| (x / divisor) as f32).collect();
            t.validate_push(&ids, &grads)?;
            t.push_validated(&ids, &grads, 1.0)
        }
        (Table::Dense(t), Agg::Dense(sums)) => {
            let grad: Vec<f32> = sums.iter().map(|&x| (x / divisor) as f32).collect();
            t.validate_push(&grad)?;
            t.push_validated(&grad, 1.0)
        }
        _ => Err(invalid(format!(
            "table {name:?} changed kind while a step was pending"
        ))),
    }
}

/// A clock answer of a job.
pub(super) fn job_clocks(v: JobView) -> ClockResponse {
    ClockResponse {
        min_clock: v.clocks.iter().min().copied().unwrap_or(0),
        max_clock: v.clocks.iter().max().copied().unwrap_or(0),
        clocks: v.clocks,
        job: v.job,
        joined: v.joined,
        lost: v.lost,
        applied: v.applied,
    }
}

impl super::Service {
    /// A clock call of a job: reports the clock, applies the steps it completed, and waits.
    pub(super) async fn job_clock(
        &self,
        r: ClockRequest,
    ) -> std::result::Result<ClockResponse, Status> {
        let inner = &self.0;
        if r.advance {
            let lease = if r.lease_seconds > 0.0 && r.lease_seconds.is_finite() {
                Duration::from_secs_f64(r.lease_seconds)
            } else if r.lease_seconds == 0.0 {
                DEFAULT_LEASE
            } else {
                return Err(status_of(&invalid(format!(
                    "lease_seconds must be > 0, got {}",
                    r.lease_seconds
                ))));
            };
            let opts = JobOptions {
                lease,
                continue_on_loss: r.continue_on_worker_loss,
                mean: r.mean,
            };
            inner
                .steps
                .advance(&r.job, r.worker, r.num_workers, r.clock, opts)
                .map_err(|e| status_of(&e))?;
            let (steps, store) = (Arc::clone(&inner.steps), Arc::clone(&inner.store));
            tokio::task::spawn_blocking(move || steps.apply_ready(&store))
                .await
                .map_err(|e| Status::internal(format!("applying a step: {e}")))?
                .map_err(|e| status_of(&e))?;
        }
        if !r.advance {
            inner.steps.renew(&r.job, r.worker);
        }
        if r.wait {
            let target = r.clock.saturating_sub(r.staleness);
            inner
                .steps
                .wait(&inner.store, &r.job, r.worker, target, r.staleness == 0)
                .await
                .map_err(|e| status_of(&e))?;
        }
        Ok(job_clocks(inner.steps.view()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> JobOptions {
        JobOptions {
            lease: Duration::from_secs(10),
            continue_on_loss: false,
            mean: false,
        }
    }

    #[test]
    fn a_new_job_resets_the_clocks_and_a_stale_push_is_refused() {
        let s = Steps::default();
        assert!(s.advance("a", 0, 2, 3, opts()).is_err());
        s.advance("a", 0, 2, 0, opts()).unwrap();
        s.advance("a", 0, 2, 3, opts()).unwrap();
        s.advance("a", 1, 2, 3, opts()).unwrap();
        assert_eq!(s.view().clocks, vec![3, 3]);
        s.advance("b", 0, 2, 0, opts()).unwrap();
        let v = s.view();
        assert_eq!(
            (v.job.as_str(), v.clocks, v.joined),
            ("b", vec![0, 0], vec![0])
        );
        assert!(s.add_sparse("a", 0, 1, "t", 1, &[1], &[1.0]).is_err());
        assert!(s.advance("a", 1, 2, 4, opts()).is_err());
        assert!(s.advance("b", 2, 2, 0, opts()).is_err());
        assert!(s.advance("b", 0, 3, 0, opts()).is_err());
    }
}
