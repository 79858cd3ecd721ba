//! Cluster snapshots at a step boundary of a job (BSP or SSP), the client's side.
//!
//! [`Client::cluster_snapshot_at`] places a hold on every server (`Snapshot` with `reserve`):
//! each answers the earliest boundary it can still take (or refuses a requested step that a
//! worker went on from), and the boundary is the largest answer. Then, on a thread of its own,
//! it asks every server for its part at that boundary: each server answers no worker's advance
//! to the boundary or beyond until its part is written, and writes it once every live worker
//! reached the boundary (`server/bsp/boundary.rs`). The client writes `cluster.json` last, as
//! for any cluster snapshot. The call returns at once with a [`StepSnapshot`], so a worker of
//! the job can ask for a snapshot and go on training to the boundary itself.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::cluster::{Boundary, ClusterManifest};
use super::{futures_join_all, random_id, Client};
use crate::error::{invalid, Error, Result};
use crate::net::proto::{SnapshotRequest, SnapshotResponse};

/// A cluster snapshot at a step boundary being taken.
#[derive(Clone)]
pub struct StepSnapshot {
    job: String,
    step: u64,
    outcome: Arc<Outcome>,
}

#[derive(Default)]
struct Outcome {
    result: Mutex<Option<Result<ClusterManifest>>>,
    ready: Condvar,
}

impl StepSnapshot {
    /// The job the boundary belongs to.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The boundary: the snapshot holds every push of steps <= this and none of a later step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// True once the snapshot is written (or has failed).
    pub fn is_done(&self) -> bool {
        self.outcome
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Waits up to `timeout` for the snapshot: its cluster manifest or its error, `None` while
    /// it is still being taken.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<ClusterManifest>> {
        let deadline = Instant::now() + timeout;
        let mut g = self
            .outcome
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .outcome
                .ready
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Client {
    /// Starts one snapshot of the whole cluster into `dest` at a step boundary of the job the
    /// servers run (this worker's job, or the servers' current one): at `step`, or, with `None`,
    /// at the earliest boundary no worker has gone past. Returns once the boundary is fixed; the
    /// snapshot is written when every live worker has ended that step, and `timeout` bounds the
    /// wait. A step a worker went on from already is refused, as is a job that is not running.
    pub fn cluster_snapshot_at(
        self: &Arc<Self>,
        dest: &str,
        incremental: bool,
        step: Option<u64>,
        timeout: Duration,
    ) -> Result<StepSnapshot> {
        if timeout.is_zero() {
            return Err(invalid("timeout must be > 0 seconds"));
        }
        let (dir, tables) = self.cluster_begin(dest)?;
        let hold = format!("{:016x}", random_id());
        let reserve = SnapshotRequest {
            reserve: true,
            job: self.job_id().unwrap_or_default(),
            step,
            hold: hold.clone(),
            hold_seconds: self.config.timeout.as_secs_f64(),
            ..Default::default()
        };
        let answers = self.rt.block_on(async {
            let calls = (0..self.n()).map(|i| {
                self.call(
                    i,
                    reserve.clone(),
                    self.config.timeout,
                    true,
                    |mut c, r| async move { c.snapshot(r).await },
                )
            });
            futures_join_all(calls).await
        });
        let placed = self.boundary_of(answers);
        let (job, step) = match placed {
            Ok(p) => p,
            Err(e) => {
                self.release_hold(&hold);
                return Err(e);
            }
        };
        let outcome = Arc::new(Outcome::default());
        let handle = StepSnapshot {
            job: job.clone(),
            step,
            outcome: Arc::clone(&outcome),
        };
        let client = Arc::clone(self);
        let run = move || {
            let boundary = Boundary {
                job: job.clone(),
                step,
            };
            let r = client
                .parts_at(&dir.to_string(), incremental, &job, &hold, step, timeout)
                .and_then(|answers| {
                    client.cluster_finish(&dir, tables, &answers, incremental, Some(boundary))
                });
            if r.is_err() {
                client.release_hold(&hold);
            }
            *outcome.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            outcome.ready.notify_all();
        };
        std::thread::Builder::new()
            .name("pstore-snapshot".into())
            .spawn(run)
            .map_err(|e| Error::Internal(format!("starting the snapshot's thread: {e}")))?;
        Ok(handle)
    }

    /// The job and the boundary of the servers' reserve answers: one job, the largest step.
    fn boundary_of(&self, answers: Vec<Result<SnapshotResponse>>) -> Result<(String, u64)> {
        let mut placed: Vec<(String, u64)> = Vec::new();
        for (i, a) in answers.into_iter().enumerate() {
            let name = &self.name_of(i);
            match a {
                Ok(a) => placed.push((a.job, a.step)),
                // A server older than the reserve field takes it for a snapshot without a dir.
                Err(Error::InvalidArgument(m)) if m.contains("needs a directory") => {
                    return Err(invalid(format!(
                        "server {name} does not take snapshots at a step boundary (its pstore \
                         is older than this client's)"
                    )))
                }
                Err(Error::InvalidArgument(m)) => {
                    return Err(invalid(format!("server {name}: {m}")))
                }
                Err(e) => return Err(e),
            }
        }
        let (job, _) = placed
            .first()
            .cloned()
            .ok_or_else(|| invalid("a cluster snapshot needs a server"))?;
        if let Some(i) = placed.iter().position(|(j, _)| *j != job) {
            return Err(invalid(format!(
                "the servers run different jobs: {job:?} on {}, {:?} on {}; a snapshot at a \
                 step boundary needs one job on every server",
                self.name_of(0),
                placed[i].0,
                self.name_of(i)
            )));
        }
        Ok((job, placed.iter().map(|p| p.1).max().unwrap_or(0)))
    }

    /// Every server's part at boundary `step` (each waits for the slowest live worker).
    fn parts_at(
        &self,
        dir: &str,
        incremental: bool,
        job: &str,
        hold: &str,
        step: u64,
        timeout: Duration,
    ) -> Result<Vec<SnapshotResponse>> {
        self.rt.block_on(async {
            let calls = (0..self.n()).map(|i| {
                let m = SnapshotRequest {
                    dir: format!("{}/server-{i}", dir.trim_end_matches('/')),
                    incremental,
                    job: job.to_string(),
                    step: Some(step),
                    hold: hold.to_string(),
                    ..Default::default()
                };
                async move {
                    // Not sent again when late: the server may be writing the part.
                    let r = self
                        .call(i, m, timeout, false, |mut c, r| async move {
                            c.snapshot(r).await
                        })
                        .await;
                    if r.is_err() {
                        // The other servers stop waiting for the boundary.
                        self.release_on_all(hold).await;
                    }
                    r
                }
            });
            let mut out = Vec::new();
            for (i, r) in futures_join_all(calls).await.into_iter().enumerate() {
                out.push(r.map_err(|e| match e {
                    Error::InvalidArgument(m) => {
                        invalid(format!("server {}: {m}", self.name_of(i)))
                    }
                    Error::Remote {
                        server, code: 4, ..
                    } => Error::Remote {
                        server,
                        code: 4,
                        message: format!(
                            "the snapshot at step {step} of job {job:?} waited {:.1} s for the \
                             slowest worker to end the step",
                            timeout.as_secs_f64()
                        ),
                    },
                    e => e,
                })?);
            }
            Ok(out)
        })
    }

    /// Drops hold `hold` on every server that answers (a snapshot given up).
    fn release_hold(&self, hold: &str) {
        self.rt.block_on(self.release_on_all(hold));
    }

    async fn release_on_all(&self, hold: &str) {
        let m = SnapshotRequest {
            release: true,
            hold: hold.to_string(),
            ..Default::default()
        };
        let calls = (0..self.n()).map(|i| {
            self.call(
                i,
                m.clone(),
                self.config.timeout,
                true,
                |mut c, r| async move { c.snapshot(r).await },
            )
        });
        // A server that does not answer drops a reserved hold when the reservation ends, and a
        // waiting one when the call is given up.
        let _ = futures_join_all(calls).await;
    }
}
