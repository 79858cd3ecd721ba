//! A worker's side of a synchronous job (BSP or SSP): joining the job on every server, tagging
//! pushes with their step, ending a step on every server, and a heartbeat that keeps the
//! worker's lease while it computes.
//!
//! Every server keeps the job's clocks and aggregates the step's gradients of its own rows; a
//! worker reports the end of a step to every server once its pushes of the step were
//! acknowledged, which tells each server that this worker's part of the step is complete.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::{futures_join_all, random_id, Client};
use crate::error::{invalid, Error, Result};
use crate::net::proto::{ClockRequest, ClockResponse};

/// How a worker takes part in a job.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// The job's id; `None`: worker 0 makes one and the others take it from the coordinator.
    pub job: Option<String>,
    /// This worker's rank.
    pub worker: u32,
    /// Workers of the job.
    pub num_workers: u32,
    /// BSP: pushes are tagged with their step and aggregated (false: SSP, applied at once).
    pub synced: bool,
    /// Silence after which a worker is lost.
    pub lease: Duration,
    /// Waiters go on without a lost worker (false: they fail with `WorkerLost`).
    pub continue_on_loss: bool,
    /// Apply the mean of the workers' gradients (false: the sum).
    pub mean: bool,
}

/// The job a client takes part in.
pub(super) struct Job {
    config: JobConfig,
    id: String,
    /// Steps this worker finished.
    clock: AtomicU64,
    /// Stops the heartbeat.
    stop: AtomicBool,
}

impl Drop for Job {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Job {
    fn request(&self, clock: u64, advance: bool, wait: Option<u64>) -> ClockRequest {
        let c = &self.config;
        ClockRequest {
            worker: c.worker,
            num_workers: c.num_workers,
            clock,
            wait: wait.is_some(),
            staleness: wait.unwrap_or(0),
            advance,
            job: self.id.clone(),
            lease_seconds: c.lease.as_secs_f64(),
            continue_on_worker_loss: c.continue_on_loss,
            mean: c.mean,
            ..Default::default()
        }
    }
}

/// The job the servers of a list run, as one carry request (decision 0125): the job most of
/// them hold; every worker's clock as the furthest any of them holds it; a worker lost where
/// every one of them holding the job lost it; a worker joined where any saw it; the steps
/// applied everywhere. `None` when none runs a job.
fn carried(views: &[ClockResponse]) -> Option<ClockRequest> {
    let mut ids: Vec<&str> = views
        .iter()
        .map(|v| v.job.as_str())
        .filter(|j| !j.is_empty())
        .collect();
    ids.sort_unstable();
    let job = ids
        .chunk_by(|a, b| a == b)
        .max_by_key(|run| run.len())?
        .first()
        .copied()?;
    let first = views.iter().find(|v| v.job == job)?;
    let n = first.clocks.len();
    let same: Vec<&ClockResponse> = views
        .iter()
        .filter(|v| v.job == job && v.clocks.len() == n)
        .collect();
    let mut clocks = vec![0u64; n];
    let mut joined = Vec::new();
    for v in &same {
        for (c, &k) in clocks.iter_mut().zip(&v.clocks) {
            *c = (*c).max(k);
        }
        joined.extend(v.joined.iter().copied());
    }
    joined.sort_unstable();
    joined.dedup();
    let lost = (0..n as u32)
        .filter(|w| same.iter().all(|v| v.lost.contains(w)))
        .collect();
    Some(ClockRequest {
        job: job.to_string(),
        num_workers: n as u32,
        lease_seconds: first.lease_seconds,
        continue_on_worker_loss: first.continue_on_worker_loss,
        mean: first.mean,
        carry: true,
        carried_clocks: clocks,
        carried_lost: lost,
        carried_joined: joined,
        carried_applied: same.iter().map(|v| v.applied).min().unwrap_or(0),
        ..Default::default()
    })
}

impl Client {
    /// The coordinator: the first server in sorted order of the addresses.
    pub(super) fn coordinator(&self) -> usize {
        self.list()
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.name.cmp(&b.1.name))
            .map(|(i, _)| i)
            .unwrap_or(0)
    }

    /// Sends one clock request to every server at once; `timeout` bounds each.
    fn clock_all(&self, m: ClockRequest, timeout: Duration) -> Result<Vec<ClockResponse>> {
        self.rt.block_on(async {
            let calls = (0..self.n()).map(|i| {
                self.call(i, m.clone(), timeout, false, |mut c, r| async move {
                    c.clock(r).await
                })
            });
            futures_join_all(calls).await.into_iter().collect()
        })
    }

    /// Finds the job worker 0 started and this worker has not joined yet.
    fn find_job(&self, cfg: &JobConfig, timeout: Duration) -> Result<String> {
        let coord = self.coordinator();
        let until = Instant::now() + timeout;
        let read = ClockRequest {
            worker: cfg.worker,
            num_workers: cfg.num_workers,
            ..Default::default()
        };
        loop {
            let v = self.rt.block_on(self.call(
                coord,
                read.clone(),
                self.config.timeout,
                true,
                |mut c, r| async move { c.clock(r).await },
            ))?;
            if !v.job.is_empty()
                && v.clocks.len() == cfg.num_workers as usize
                && !v.joined.contains(&cfg.worker)
            {
                return Ok(v.job);
            }
            if Instant::now() >= until {
                return Err(Error::Remote {
                    server: self.name_of(coord),
                    code: 4,
                    message: format!(
                        "worker {} found no new job started by worker 0 within {:.1} s; a \
                         restarted worker rejoins a running job with the job's id (job=)",
                        cfg.worker,
                        timeout.as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Joins a job on every server; returns the job's id and the clock this worker starts at
    /// (0 in a new job; the job's applied step when it rejoins a running one). Starts the
    /// heartbeat that keeps the lease.
    pub fn join_job(self: &Arc<Self>, cfg: JobConfig, timeout: Duration) -> Result<(String, u64)> {
        if cfg.num_workers == 0 || cfg.worker >= cfg.num_workers {
            return Err(invalid(format!(
                "worker must be in 0..num_workers = 0..{}, got {}",
                cfg.num_workers, cfg.worker
            )));
        }
        if cfg.lease.is_zero() {
            return Err(invalid("lease must be > 0 seconds"));
        }
        let id = match (&cfg.job, cfg.worker) {
            (Some(j), _) if j.is_empty() => return Err(invalid("job must not be empty")),
            (Some(j), _) => j.clone(),
            (None, 0) => format!("{:016x}", random_id()),
            (None, _) => self.find_job(&cfg, timeout)?,
        };
        let job = Arc::new(Job {
            config: cfg,
            id: id.clone(),
            clock: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        // A call routed over an older server list is answered "moved": sent again to the list
        // the servers hold (decision 0125).
        let answers =
            self.rerouted(|| self.clock_all(job.request(0, true, None), self.config.timeout))?;
        let w = job.config.worker as usize;
        let clock = answers
            .iter()
            .map(|a| a.clocks.get(w).copied().unwrap_or(0).max(a.applied))
            .max()
            .unwrap_or(0);
        job.clock.store(clock, Ordering::Release);
        // Every server at the same clock: one that had lost the worker moved it to its applied
        // step, the others learn it here.
        if clock > 0 {
            self.rerouted(|| self.clock_all(job.request(clock, true, None), self.config.timeout))?;
        }
        let old = self
            .job
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(Arc::clone(&job));
        drop(old);
        heartbeat(Arc::downgrade(self), Arc::downgrade(&job));
        Ok((id, clock))
    }

    /// The id of the job this client takes part in.
    pub(super) fn job_id(&self) -> Option<String> {
        let g = self.job.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().map(|j| j.id.clone())
    }

    /// The job's step tag of a push now: (job, worker, step) in a BSP job.
    pub(super) fn step_tag(&self) -> Option<(String, u32, u64)> {
        let g = self.job.lock().unwrap_or_else(|e| e.into_inner());
        let j = g.as_ref()?;
        j.config.synced.then(|| {
            (
                j.id.clone(),
                j.config.worker,
                j.clock.load(Ordering::Acquire) + 1,
            )
        })
    }

    /// Ends this worker's step: sends the queued pushes, reports the new clock to every server
    /// and waits until every live worker is within `staleness` steps (BSP: 0, and the step is
    /// applied on every server). Returns the new clock.
    pub fn end_job_step(&self, staleness: u64, timeout: Duration) -> Result<u64> {
        let job = self
            .job
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| invalid("this client has not joined a job"))?;
        self.drain();
        let wait = if job.config.synced { 0 } else { staleness };
        let clock = job.clock.load(Ordering::Acquire) + 1;
        // On an error the clock stays: calling again reports the same clock (clocks only move
        // forward) and waits again, and pushes in between still belong to this step.
        // Reported again to the new list when a server answers that its list changed: a server
        // that joined takes part in the step, one that left keeps nobody waiting (0125).
        self.rerouted(|| self.clock_all(job.request(clock, true, Some(wait)), timeout))
            .map_err(|e| {
                super::waited(
                    e,
                    format!(
                        "worker {} of job {:?} waited {:.1} s at clock {clock} for the slowest \
                         worker",
                        job.config.worker,
                        job.id,
                        timeout.as_secs_f64()
                    ),
                )
            })?;
        job.clock.store(clock, Ordering::Release);
        Ok(clock)
    }
}

impl Client {
    /// Gives server `to` (joining the list) the job the servers of the list run, as they hold
    /// it now (decision 0125); nothing when they run none. `add_server` calls it before and
    /// again after the publish of the list that names `to`: the second carry raises its clocks
    /// to every report the old list took before the publish, and every later report reaches it
    /// (a clock call routed over the old list is answered "moved" after the publish).
    pub(super) fn carry_job(&self, to: &super::Server, timeout: Duration) -> Result<()> {
        let read = ClockRequest::default();
        let views = self.rt.block_on(async {
            let calls = (0..self.n()).map(|i| {
                self.call(i, read.clone(), timeout, true, |mut c, r| async move {
                    c.clock(r).await
                })
            });
            futures_join_all(calls).await
        });
        let views = views.into_iter().collect::<Result<Vec<_>>>()?;
        let Some(carry) = carried(&views) else {
            return Ok(());
        };
        let rt = &self.rt;
        rt.block_on(self.call_server(
            to,
            None,
            carry,
            timeout,
            true,
            false,
            |mut c, r| async move { c.clock(r).await },
        ))
        .map_err(|e| crate::net::error_of(&e, &to.name))?;
        Ok(())
    }
}

/// Renews the worker's lease on every server every quarter lease until the client or the job
/// is gone.
fn heartbeat(client: Weak<Client>, job: Weak<Job>) {
    let spawned = std::thread::Builder::new()
        .name("pstore-lease".into())
        .spawn(move || loop {
            let Some(j) = job.upgrade() else { return };
            let every = (j.config.lease / 4).max(Duration::from_millis(20));
            drop(j);
            let t0 = Instant::now();
            while t0.elapsed() < every {
                std::thread::sleep(Duration::from_millis(20).min(every));
                match job.upgrade() {
                    Some(j) if !j.stop.load(Ordering::Acquire) => {}
                    _ => return,
                }
            }
            let (Some(c), Some(j)) = (client.upgrade(), job.upgrade()) else {
                return;
            };
            let m = j.request(j.clock.load(Ordering::Acquire), false, None);
            // A missed beat is retried at the next one; one answered "moved" (the list
            // changed) at once, to the new list (a joining server keeps the lease too).
            let _ = c.rerouted(|| c.clock_all(m.clone(), j.config.lease));
        });
    // Without the thread the worker still renews its lease with every call it makes.
    drop(spawned);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(
        job: &str,
        clocks: Vec<u64>,
        lost: Vec<u32>,
        joined: Vec<u32>,
        applied: u64,
    ) -> ClockResponse {
        ClockResponse {
            job: job.into(),
            clocks,
            lost,
            joined,
            applied,
            lease_seconds: 7.0,
            mean: true,
            ..Default::default()
        }
    }

    #[test]
    fn a_carry_takes_the_job_most_servers_run_at_its_furthest_clocks() {
        assert!(carried(&[ClockResponse::default()]).is_none());
        let c = carried(&[
            view("j", vec![3, 2, 2], vec![1, 2], vec![0, 1], 2),
            view("j", vec![2, 4, 2], vec![1], vec![2], 3),
            view("other", vec![9], vec![], vec![0], 9),
            ClockResponse::default(),
        ])
        .unwrap();
        assert_eq!((c.job.as_str(), c.num_workers, c.carry), ("j", 3, true));
        assert_eq!(c.carried_clocks, vec![3, 4, 2]);
        // Lost where every server lost it; joined where any saw it; applied everywhere.
        assert_eq!(c.carried_lost, vec![1]);
        assert_eq!(c.carried_joined, vec![0, 1, 2]);
        assert_eq!(c.carried_applied, 2);
        assert!(c.mean && c.lease_seconds == 7.0 && !c.advance && !c.wait);
    }
}
