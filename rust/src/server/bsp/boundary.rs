//! Cluster snapshots at a step boundary of a job (BSP or SSP): the holds a snapshot places on a
//! server's clock answers, and the `Snapshot` call that waits for its boundary.
//!
//! A part at boundary `c` holds every push of steps <= c and none of a later step. A worker
//! reports clock `c` to a server only after its pushes of steps <= c were acknowledged, and it
//! starts step c+1 only after every server answered that call. So a server that answers no
//! advance to a clock >= c while its hold stands, and writes its part once every live worker
//! reported c, writes exactly the steps <= c, whatever the other servers do; pushes are never
//! held or tagged, and a worker below c never waits for one the hold keeps. A boundary is
//! possible on a server while no worker was let go from a clock >= c there (`released`): a
//! client reserves a hold on every server, each answering the earliest boundary it can take,
//! and then asks every server for the largest of them, which every server can still take,
//! since a hold stops the answers at and above its step from the moment it is placed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};

use super::{Steps, DEFAULT_LEASE};
use crate::error::{invalid, Error, Result};
use crate::net::proto::{SnapshotRequest, SnapshotResponse};
use crate::net::status_of;
use crate::server::{code_name, on_blocking, write_part, Access, Busy, Service};
use crate::store::Store;

/// How long a reserved hold stands without its snapshot call when the request does not say.
const DEFAULT_RESERVE: Duration = Duration::from_secs(30);
/// The longest a reserved hold may stand without its snapshot call.
const MAX_RESERVE: Duration = Duration::from_secs(3600);
/// Holds one server keeps at once (each a cluster snapshot being taken).
const MAX_HOLDS: usize = 64;
/// The longest hold id.
const MAX_ID_BYTES: usize = 64;

/// The holds of a job's snapshots on one server.
#[derive(Default)]
pub(super) struct Holds {
    /// The largest clock this server let a worker go on from (answered an advance to).
    released: u64,
    by_id: HashMap<String, Hold>,
}

struct Hold {
    step: u64,
    /// A reserved hold's end; `None` while its snapshot call waits or writes.
    expires: Option<Instant>,
}

impl Holds {
    /// After a restart: any clock a worker reported may have been answered.
    pub(super) fn after_restart(clocks: &[u64]) -> Self {
        Self {
            released: clocks.iter().copied().max().unwrap_or(0),
            by_id: HashMap::new(),
        }
    }

    /// A job carried here (decision 0125): the workers may have been let go from any of
    /// `clocks` on the other servers.
    pub(super) fn carried(&mut self, clocks: &[u64]) {
        self.released = self.released.max(clocks.iter().copied().max().unwrap_or(0));
    }

    /// The lowest boundary held (expired reservations dropped).
    fn boundary(&mut self) -> Option<u64> {
        let now = Instant::now();
        self.by_id.retain(|_, h| h.expires.is_none_or(|t| t > now));
        self.by_id.values().map(|h| h.step).min()
    }

    /// Whether an advance to `clock` may be answered now; if so, it is recorded as let go.
    pub(super) fn pass(&mut self, clock: u64) -> bool {
        if self.boundary().is_some_and(|c| clock >= c) {
            return false;
        }
        self.released = self.released.max(clock);
        true
    }

    /// Places hold `id` at `step` (absent: the earliest boundary this server can take); a hold of
    /// the same id moves there. Refuses a step a worker was let go from already.
    fn place(
        &mut self,
        job: &str,
        id: &str,
        step: Option<u64>,
        expires: Option<Instant>,
    ) -> Result<u64> {
        let c = match step {
            None => self.released + 1,
            Some(c) if c > self.released => c,
            Some(c) => {
                return Err(invalid(format!(
                    "step {c} of job {job:?} has passed on this server: a worker went on from \
                     clock {} already; a snapshot at a step boundary takes a later step, or \
                     none (the next boundary)",
                    self.released
                )))
            }
        };
        self.boundary();
        if !self.by_id.contains_key(id) && self.by_id.len() >= MAX_HOLDS {
            return Err(invalid(format!(
                "{MAX_HOLDS} snapshots at a step boundary are pending on this server already"
            )));
        }
        self.by_id.insert(id.to_string(), Hold { step: c, expires });
        Ok(c)
    }
}

impl Steps {
    fn job_for<'a>(j: &'a mut Option<super::Job>, job: &str) -> Result<&'a mut super::Job> {
        let j = j.as_mut().ok_or_else(|| {
            invalid(
                "no job is running on this server: a snapshot at a step boundary needs a BSP or \
                 SSP job",
            )
        })?;
        if !job.is_empty() && j.id != job {
            return Err(invalid(format!(
                "job {job:?} is not running on this server (its job is {:?})",
                j.id
            )));
        }
        Ok(j)
    }

    /// Reserves hold `id` at `step` (absent: the earliest boundary) for `ttl`, in job `job`
    /// (empty: the current one); returns the job's id and the boundary held.
    pub(crate) fn reserve(
        &self,
        job: &str,
        id: &str,
        step: Option<u64>,
        ttl: Duration,
    ) -> Result<(String, u64)> {
        let out = {
            let mut g = self.lock();
            let j = Self::job_for(&mut g, job)?;
            let c = j.holds.place(&j.id, id, step, Some(Instant::now() + ttl))?;
            (j.id.clone(), c)
        };
        self.notify();
        Ok(out)
    }

    /// Drops hold `id` (of whichever job holds it); the clocks it kept waiting go on.
    pub(crate) fn release_hold(&self, id: &str) {
        if let Some(j) = self.lock().as_mut() {
            j.holds.by_id.remove(id);
        }
        self.notify();
    }

    /// For a freeze of slots holding a pending step's aggregate of job `job` (decision 0123):
    /// holds the job's clock answers on this server at its next step boundary, waits (at most
    /// `wait`) until every live worker reached it, and applies the steps complete. No worker
    /// starts a later step while the hold stands (it needs every server's answer), and every
    /// push of the steps before it is in the rows, so no aggregate is pending here until the
    /// hold is dropped: the caller freezes the slots before it drops the hold. `None` when no
    /// boundary came within `wait` or the job failed meanwhile. Runs on a blocking thread.
    pub(in crate::server) fn hold_for_freeze(
        self: &Arc<Self>,
        store: &Arc<Store>,
        job: &str,
        wait: Duration,
    ) -> Option<Unhold> {
        let id = format!("freeze-{:016x}", crate::server::repl::random_id());
        let (job, step) = self.reserve(job, &id, None, wait).ok()?;
        let unhold = Unhold(Arc::clone(self), id.clone());
        let t0 = Instant::now();
        let reached = tokio::runtime::Handle::current().block_on(tokio::time::timeout(
            wait,
            self.wait_boundary(store, &job, &id, step),
        ));
        if !matches!(reached, Ok(Ok(_))) {
            return None;
        }
        self.apply_ready(store).ok()?;
        eprintln!(
            "event=freeze_boundary job={job:?} step={step} waited_s={:.3}",
            t0.elapsed().as_secs_f64()
        );
        Some(unhold)
    }

    /// Holds an advance of worker `w` to `clock` that does not wait for other workers until no
    /// snapshot's hold keeps it (at once when none does); renews `w`'s lease meanwhile.
    pub(super) async fn pass_hold(&self, job: &str, w: u32, clock: u64) {
        let mut rx = self.tick.subscribe();
        loop {
            let lease = {
                let mut g = self.lock();
                let Some(j) = g.as_mut().filter(|j| j.id == job) else {
                    return;
                };
                if j.holds.pass(clock) {
                    return;
                }
                if let Some(s) = j.seen.get_mut(w as usize) {
                    *s = Instant::now();
                }
                j.opts.lease
            };
            let tick = (lease / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
            let _ = tokio::time::timeout(tick, rx.changed()).await;
        }
    }

    /// Places hold `id` at `step` and waits until every live worker's clock is at least `step`
    /// (a worker lost meanwhile fails the wait or is left out, as the job says); returns the
    /// job's id. The hold stays: the caller drops it once the part is written.
    async fn wait_boundary(
        self: &Arc<Self>,
        store: &Arc<Store>,
        job: &str,
        id: &str,
        step: u64,
    ) -> Result<String> {
        let job = {
            let mut g = self.lock();
            let j = Self::job_for(&mut g, job)?;
            j.holds.place(&j.id, id, Some(step), None)?;
            j.id.clone()
        };
        self.notify();
        let mut rx = self.tick.subscribe();
        loop {
            let (done, newly_lost) = self.check(&job, step, false, None)?;
            if done {
                return Ok(job);
            }
            let held = self
                .lock()
                .as_ref()
                .is_some_and(|j| j.holds.by_id.contains_key(id));
            if !held {
                return Err(invalid(format!(
                    "the snapshot at step {step} of job {job:?} was given up (its hold was \
                     released) while it waited"
                )));
            }
            if newly_lost {
                let (me, st) = (Arc::clone(self), Arc::clone(store));
                tokio::task::spawn_blocking(move || me.apply_ready(&st))
                    .await
                    .map_err(|e| Error::Internal(format!("applying a step: {e}")))??;
                continue;
            }
            let lease = self.lock().as_ref().map_or(DEFAULT_LEASE, |j| j.opts.lease);
            let tick = (lease / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
            let _ = tokio::time::timeout(tick, rx.changed()).await;
        }
    }
}

/// Drops a hold when it goes: when its part is written (or its freeze done), or when the call
/// is given up first.
pub(in crate::server) struct Unhold(Arc<Steps>, String);

impl Drop for Unhold {
    fn drop(&mut self) {
        self.0.release_hold(&self.1);
    }
}

impl Service {
    /// A `Snapshot` call with `step`, `reserve` or `release` (a snapshot at a step boundary).
    pub(in crate::server) async fn snapshot_at_step(
        &self,
        req: Request<SnapshotRequest>,
    ) -> std::result::Result<Response<SnapshotResponse>, Status> {
        let t0 = Instant::now();
        let _busy = Busy::new(&self.0.inflight);
        let out = async {
            self.check(&req, Access::Write)?;
            self.layout_check(&req)?;
            self.at_step(req.into_inner()).await
        }
        .await;
        let code = out.as_ref().err().map(|s: &Status| code_name(s.code()));
        self.0.metrics.observe("Snapshot", t0.elapsed(), code);
        out.map(Response::new)
    }

    async fn at_step(&self, r: SnapshotRequest) -> std::result::Result<SnapshotResponse, Status> {
        let inner = &self.0;
        let bad = |m: String| status_of(&invalid(m));
        if r.hold.is_empty() || r.hold.len() > MAX_ID_BYTES {
            return Err(bad(format!(
                "a snapshot at a step boundary needs a hold id of 1 to {MAX_ID_BYTES} bytes"
            )));
        }
        if r.release {
            inner.steps.release_hold(&r.hold);
            return Ok(SnapshotResponse::default());
        }
        if r.reserve {
            if !r.dir.is_empty() {
                return Err(bad("a reserve writes nothing: its dir must be empty".into()));
            }
            let ttl = match r.hold_seconds {
                0.0 => DEFAULT_RESERVE,
                s if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s).min(MAX_RESERVE),
                s => return Err(bad(format!("hold_seconds must be > 0, got {s}"))),
            };
            let (job, step) = inner
                .steps
                .reserve(&r.job, &r.hold, r.step, ttl)
                .map_err(|e| status_of(&e))?;
            return Ok(SnapshotResponse {
                step,
                job,
                ..Default::default()
            });
        }
        let Some(step) = r.step else {
            return Err(bad("a snapshot with a hold id needs its step".into()));
        };
        if r.dir.is_empty() {
            return Err(bad("snapshot needs a directory".into()));
        }
        // Dropped when the call is given up while it waits, else after the part is written.
        let t0 = Instant::now();
        let unhold = Unhold(Arc::clone(&inner.steps), r.hold.clone());
        let job = inner
            .steps
            .wait_boundary(&inner.store, &r.job, &r.hold, step)
            .await
            .map_err(|e| status_of(&e))?;
        eprintln!(
            "event=snapshot_boundary job={job:?} step={step} waited_s={:.3}",
            t0.elapsed().as_secs_f64()
        );
        let s = Arc::clone(inner);
        let mut out = on_blocking(move || {
            let _unhold = unhold;
            // A synchronous job's step `step` is complete: apply it before the part is taken.
            s.steps.apply_ready(&s.store)?;
            write_part(&s, r)
        })
        .await?;
        out.step = step;
        out.job = job;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::JobOptions;
    use super::*;

    fn opts() -> JobOptions {
        JobOptions {
            lease: Duration::from_secs(10),
            continue_on_loss: false,
            mean: false,
        }
    }

    #[test]
    fn a_hold_keeps_the_clocks_at_its_step_and_a_passed_step_is_refused() {
        let s = Steps::default();
        assert!(s.reserve("", "h", None, Duration::from_secs(5)).is_err());
        s.advance("j", 0, 2, 0, opts()).unwrap();
        s.advance("j", 1, 2, 0, opts()).unwrap();
        let pass = |k: u64| s.lock().as_mut().unwrap().holds.pass(k);
        assert!(pass(0) && pass(3));
        // The earliest boundary is the one after the largest clock let go.
        assert_eq!(
            s.reserve("", "a", None, Duration::from_secs(5)).unwrap(),
            ("j".to_string(), 4)
        );
        assert!(!pass(4) && !pass(5) && pass(2));
        let e = s.reserve("j", "b", Some(3), Duration::from_secs(5));
        assert!(matches!(e, Err(Error::InvalidArgument(m)) if m.contains("step 3 of job \"j\"")));
        assert!(s
            .reserve("other", "b", Some(9), Duration::from_secs(5))
            .is_err());
        // The hold moves up; released, the clock goes on.
        assert_eq!(
            s.reserve("j", "a", Some(6), Duration::from_secs(5))
                .unwrap()
                .1,
            6
        );
        assert!(pass(5) && !pass(6));
        s.release_hold("a");
        assert!(pass(6));
    }

    #[test]
    fn a_reserved_hold_expires() {
        let s = Steps::default();
        s.advance("j", 0, 1, 0, opts()).unwrap();
        s.reserve("j", "a", Some(2), Duration::from_millis(30))
            .unwrap();
        let pass = |k: u64| s.lock().as_mut().unwrap().holds.pass(k);
        assert!(!pass(2));
        std::thread::sleep(Duration::from_millis(60));
        assert!(pass(2));
    }

    #[test]
    fn a_restarted_server_counts_every_clock_as_let_go() {
        let mut h = Holds::after_restart(&[3, 7, 5]);
        assert!(h.place("j", "a", Some(7), None).is_err());
        assert_eq!(h.place("j", "a", None, None).unwrap(), 8);
    }
}
