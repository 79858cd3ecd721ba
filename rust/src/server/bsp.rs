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
//!
//! Replica groups (`bsp/mirror.rs`, decision 0115): a durable primary hands every change of its
//! job files to its followers through the replication log, in commit order with the rows; a
//! follower keeps them and runs no job; promoted, it loads the job as a restarted server does.
//! A step is applied under the request id `(job nonce, step)`, kept with the rows, so a step
//! interrupted by a crash or a failover is finished on exactly the tables that lack it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tonic::Status;

use std::io::Write;

use serde::{Deserialize, Serialize};

use crate::error::{invalid, storage, Error, Result};
use crate::net::proto::{ClockRequest, ClockResponse};
use crate::net::status_of;
use crate::store::{Store, Table};

mod boundary;
mod mirror;

use mirror::Record;

/// The lease when a job does not give one.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// Hashes an id with the splitmix64 finaliser: the default SipHash is built against chosen
/// collisions, which a step's ids (already hashed into the tables the same way) do not need.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = crate::hash::mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = crate::hash::mix64(x);
    }
}

type IdMap = HashMap<u64, usize, std::hash::BuildHasherDefault<IdHasher>>;

/// One table's part of a step: the float64 sum of the gradients per row.
enum Agg {
    Sparse {
        dim: usize,
        index: IdMap,
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
    /// The request ids counted in each pending step.
    rids: BTreeMap<u64, HashSet<(u64, u64)>>,
    /// The step being applied and each table's seq before it (kept on disk by a durable
    /// server, so that a crash in the middle applies the rest once).
    marker: Option<(u64, BTreeMap<String, u64>)>,
    /// A worker lost under the `fail` option: the error every waiter gets.
    failed: Option<String>,
    /// Random, made when the job starts: the client id of its steps' applies (a step `s` is
    /// applied as the write request `(nonce, s)`, kept with the rows it changed), and how a
    /// follower tells a new job from the one it holds.
    nonce: u64,
    /// The records in each pending step's log (a pushed record's index there).
    logged: BTreeMap<u64, u64>,
    pending: BTreeMap<u64, BTreeMap<String, Agg>>,
    /// Cluster snapshots at a step boundary: their holds on clock answers (`boundary.rs`).
    holds: boundary::Holds,
}

impl Job {
    /// Job `id` of `n` workers starting now: every clock at 0, nothing applied or pending.
    fn start(id: &str, opts: JobOptions, n: usize, now: Instant) -> Self {
        Self {
            id: id.to_string(),
            opts,
            clocks: vec![0; n],
            seen: vec![now; n],
            joined: vec![false; n],
            lost: vec![false; n],
            applied: 0,
            failed: None,
            nonce: super::repl::random_id(),
            logged: BTreeMap::new(),
            pending: BTreeMap::new(),
            rids: BTreeMap::new(),
            marker: None,
            holds: boundary::Holds::default(),
        }
    }

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
    /// The job's options (the defaults when the server has no job).
    pub opts: Option<JobOptions>,
}

/// The synchronous-step state of a server.
pub struct Steps {
    job: Mutex<Option<Job>>,
    /// Held while a step is applied and while a snapshot is written.
    applying: Mutex<()>,
    /// Ticks on every change, for waiters.
    tick: watch::Sender<u64>,
    /// A durable server's copy of the job state.
    persist: Option<Persist>,
    /// The server follows a primary: it keeps its primary's job records (`mirror.rs`) and runs
    /// no job.
    following: AtomicBool,
    /// A follower's view of the records it keeps (read from its files at the first record).
    mirror: Mutex<Option<mirror::Mirror>>,
}

impl Default for Steps {
    fn default() -> Self {
        Self {
            job: Mutex::new(None),
            applying: Mutex::new(()),
            tick: watch::channel(0).0,
            persist: None,
            following: AtomicBool::new(false),
            mirror: Mutex::new(None),
        }
    }
}

/// The job state on disk, in `bsp/` of a durable server's directory: `job.json` (clocks, lost
/// workers, applied steps, and the step being applied with each table's seq before it), written
/// to a temporary file and renamed over the old one, and one append-only log per pending step of
/// the pushes counted in it. A file rather than LMDB: the state is a few hundred bytes rewritten
/// whole a few times per step, and the logs are written once and deleted when their step is
/// applied, neither of which needs the store's transactions; the step's seqs make applying it
/// idempotent across a crash (a table whose seq moved past the one recorded has the step).
struct Persist {
    dir: PathBuf,
    /// fsync every write (the store's durability is `sync`).
    sync: bool,
    /// The store's flusher: every change is also a record of the next entry of its commit log
    /// when the server is a primary with followers (`mirror.rs`; nothing otherwise).
    ship: Option<Arc<crate::durable::Flusher>>,
}

#[derive(Serialize, Deserialize)]
struct Saved {
    id: String,
    lease_s: f64,
    continue_on_loss: bool,
    mean: bool,
    clocks: Vec<u64>,
    lost: Vec<bool>,
    applied: u64,
    /// The step being applied and each table's seq before it.
    applying: Option<(u64, BTreeMap<String, u64>)>,
    /// The job's nonce (0 in the files of older versions: their steps are applied without a
    /// request id, and a crash in the middle of one is told by the tables' seqs).
    #[serde(default)]
    nonce: u64,
}

/// One push of a step's log: its head, ids and values.
type LogRecord = (LogHead, Vec<u64>, Vec<f32>);

#[derive(Serialize, Deserialize)]
struct LogHead {
    rid: Option<(u64, u64)>,
    table: String,
    /// 0: a dense table.
    dim: usize,
}

fn io_err(path: &std::path::Path, e: std::io::Error) -> Error {
    storage(format!("{}: {e}", path.display()))
}

impl Persist {
    fn step_log(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step}.log"))
    }

    /// Writes `job.json` (`reset`: the job just started) and hands it on.
    fn save(&self, j: &Job, applying: Option<(u64, BTreeMap<String, u64>)>) -> Result<()> {
        self.save_as(j, applying, false)
    }

    fn save_as(
        &self,
        j: &Job,
        applying: Option<(u64, BTreeMap<String, u64>)>,
        reset: bool,
    ) -> Result<()> {
        let body = header_of(j, applying);
        self.write_header(&body)?;
        self.hand_on(mirror::Record::Header { reset, saved: body });
        Ok(())
    }

    fn hand_on(&self, r: mirror::Record) {
        if let Some(f) = &self.ship {
            f.ship_job(r.encode());
        }
    }

    /// Writes `job.json` as `body` (a temporary file renamed over the old one).
    fn write_header(&self, body: &[u8]) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| io_err(&self.dir, e))?;
        let f = self.dir.join("job.json");
        let tmp = self.dir.join("job.json.tmp");
        let write = || -> std::io::Result<()> {
            let mut h = std::fs::File::create(&tmp)?;
            h.write_all(body)?;
            if self.sync {
                h.sync_all()?;
            }
            std::fs::rename(&tmp, &f)?;
            if self.sync {
                std::fs::File::open(&self.dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| io_err(&f, e))
    }

    /// Appends a push to step `step`'s log, as its `index`-th record, and hands it on.
    fn log(&self, step: u64, index: u64, head: &LogHead, ids: &[u64], vals: &[f32]) -> Result<()> {
        let rec = encode_log(head, ids, vals);
        self.append(step, &rec)?;
        self.hand_on(mirror::Record::Push {
            step,
            index,
            body: rec,
        });
        Ok(())
    }

    /// The records of a step's log as written (a torn last one left out).
    fn read_raw(&self, step: u64) -> Result<Vec<Vec<u8>>> {
        let f = self.step_log(step);
        match std::fs::read(&f) {
            Ok(b) => Ok(split_log(&b).into_iter().map(<[u8]>::to_vec).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(io_err(&f, e)),
        }
    }

    /// The steps that have a log, in order.
    fn steps(&self) -> Result<Vec<u64>> {
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&self.dir, e)),
        };
        let mut steps: Vec<u64> = rd
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_prefix("step-")
                    .and_then(|x| x.strip_suffix(".log"))
                    .and_then(|x| x.parse::<u64>().ok())
            })
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// The records of a step's log; a torn last record (a crash while it was written, before
    /// its push was answered) is left out.
    fn read_log(&self, step: u64) -> Result<Vec<LogRecord>> {
        let f = self.step_log(step);
        self.read_raw(step)?
            .iter()
            .map(|r| {
                parse_log(r).map_err(|e| crate::error::corrupt(format!("{}: {e}", f.display())))
            })
            .collect()
    }

    /// Deletes the logs of steps <= `applied` (and, with `all`, every log); makes the
    /// directory if it is missing.
    fn prune(&self, applied: u64, all: bool) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| io_err(&self.dir, e))?;
        let rd = std::fs::read_dir(&self.dir).map_err(|e| io_err(&self.dir, e))?;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name
                .strip_prefix("step-")
                .and_then(|x| x.strip_suffix(".log"))
                .and_then(|x| x.parse::<u64>().ok());
            if let Some(st) = step {
                if all || st <= applied {
                    std::fs::remove_file(e.path()).map_err(|err| io_err(&e.path(), err))?;
                }
            }
        }
        if !all {
            self.hand_on(mirror::Record::Prune { applied });
        }
        Ok(())
    }
}

/// The `job.json` of a job (`applying`: the step being applied and each table's seq before it).
fn header_of(j: &Job, applying: Option<(u64, BTreeMap<String, u64>)>) -> Vec<u8> {
    let saved = Saved {
        id: j.id.clone(),
        lease_s: j.opts.lease.as_secs_f64(),
        continue_on_loss: j.opts.continue_on_loss,
        mean: j.opts.mean,
        clocks: j.clocks.clone(),
        lost: j.lost.clone(),
        applied: j.applied,
        applying,
        nonce: j.nonce,
    };
    serde_json::to_vec(&saved).expect("job state serializes")
}

/// One record of a step's log: the head's length (u32), the head (JSON), the ids (a u64 count
/// and the ids) and the values (a u64 count and the f32 values), little-endian.
fn encode_log(head: &LogHead, ids: &[u64], vals: &[f32]) -> Vec<u8> {
    let head = serde_json::to_vec(head).expect("log head serializes");
    let mut rec = Vec::with_capacity(20 + head.len() + ids.len() * 8 + vals.len() * 4);
    rec.extend_from_slice(&(head.len() as u32).to_le_bytes());
    rec.extend_from_slice(&head);
    rec.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    ids.iter()
        .for_each(|x| rec.extend_from_slice(&x.to_le_bytes()));
    rec.extend_from_slice(&(vals.len() as u64).to_le_bytes());
    vals.iter()
        .for_each(|x| rec.extend_from_slice(&x.to_le_bytes()));
    rec
}

/// The whole records of a log's bytes (a torn last one, cut by a crash while it was written
/// and before its push was answered, is left out).
fn split_log(b: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> Option<()> {
        b.get(*at..at.checked_add(n)?)?;
        *at += n;
        Some(())
    };
    let count = |at: &mut usize| -> Option<usize> {
        let n = u64::from_le_bytes(b.get(*at..*at + 8)?.try_into().ok()?);
        *at += 8;
        usize::try_from(n).ok()
    };
    loop {
        let start = at;
        let whole = (|| -> Option<()> {
            let hl = u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?) as usize;
            at += 4;
            take(&mut at, hl)?;
            let n = count(&mut at)?;
            take(&mut at, n.checked_mul(8)?)?;
            let n = count(&mut at)?;
            take(&mut at, n.checked_mul(4)?)
        })();
        if whole.is_none() {
            break;
        }
        out.push(&b[start..at]);
    }
    out
}

/// A whole record of a step's log (see [`encode_log`]).
fn parse_log(r: &[u8]) -> std::result::Result<LogRecord, String> {
    let hl = u32::from_le_bytes(r[..4].try_into().expect("4 bytes")) as usize;
    let head: LogHead = serde_json::from_slice(&r[4..4 + hl]).map_err(|e| e.to_string())?;
    let mut at = 4 + hl;
    let n = u64::from_le_bytes(r[at..at + 8].try_into().expect("8 bytes")) as usize;
    at += 8;
    let ids = r[at..at + n * 8]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    at += n * 8;
    let m = u64::from_le_bytes(r[at..at + 8].try_into().expect("8 bytes")) as usize;
    at += 8;
    let vals = r[at..at + m * 4]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Ok((head, ids, vals))
}

fn seq_of(store: &Store, table: &str) -> Option<u64> {
    match store.table(table).ok()? {
        Table::Sparse(t) => Some(t.seq()),
        Table::Dense(t) => Some(t.step() as u64),
    }
}

fn lost_message(job: &str, w: usize, lease: Duration) -> String {
    format!(
        "worker {w} of job {job:?} is lost: no call from it for {:.1} s (its lease)",
        lease.as_secs_f64()
    )
}

impl Steps {
    /// The state of a server of `store`: a durable store's job state is read back from its
    /// directory (a step a crash interrupted is finished, the pending steps' pushes counted
    /// again); an in-memory store's starts empty.
    /// `following`: the server follows a primary: it keeps the files, loads no job and runs
    /// none (it loads it when promoted, [`Steps::take_over`]).
    pub fn load(store: &Store, following: bool) -> Result<Self> {
        let Some(path) = store.path() else {
            return Ok(Self::default());
        };
        // Made when the first job starts.
        let dir = path.join("bsp");
        let sync = store
            .flusher()
            .is_some_and(|f| f.mode() == crate::durable::Durability::Sync);
        let p = Persist {
            dir,
            sync,
            ship: store.flusher(),
        };
        let job = if following {
            None
        } else {
            Self::read_job(&p, store)?
        };
        Ok(Self {
            job: Mutex::new(job),
            applying: Mutex::new(()),
            tick: watch::channel(0).0,
            persist: Some(p),
            following: AtomicBool::new(following),
            mirror: Mutex::new(None),
        })
    }

    /// The job the files of `p` hold (a step a crash interrupted is finished).
    fn read_job(p: &Persist, store: &Store) -> Result<Option<Job>> {
        let f = p.dir.join("job.json");
        match std::fs::read(&f) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&f, e)),
            Ok(b) => {
                let saved: Saved = serde_json::from_slice(&b)
                    .map_err(|e| crate::error::corrupt(format!("{}: {e}", f.display())))?;
                Ok(Some(Self::restore(p, store, saved)?))
            }
        }
    }

    /// This server follows a primary from now on: the job it ran (if it was a primary) is
    /// dropped from memory, and its files are replaced by what its primary sends.
    pub fn follow(&self) {
        self.following.store(true, Ordering::Release);
        *self.lock() = None;
        *self.mirror.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.notify();
    }

    /// Keeps the records of the primary's job (a follower): written as a durable primary
    /// writes its own, before the entry is acked.
    pub fn install(&self, records: &[Vec<u8>]) -> Result<()> {
        let Some(p) = &self.persist else {
            return Err(invalid(
                "a follower keeps its primary's job on disk: it needs a durable store",
            ));
        };
        let mut g = self.mirror.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(mirror::Mirror::read(p)?);
        }
        let m = g.as_mut().expect("read above");
        for r in records {
            let r = Record::decode(r)?;
            if let Err(e) = m.install(p, r) {
                // What the files hold is read again at the next record.
                *g = None;
                return Err(e);
            }
        }
        Ok(())
    }

    /// The whole job state as records, for a resync: "no job", then the header and every
    /// pending step's pushes in the order of their logs.
    pub fn records(&self) -> Result<Vec<Vec<u8>>> {
        let mut out = vec![Record::Clear.encode()];
        let Some(p) = &self.persist else {
            return Ok(out);
        };
        let g = self.lock();
        let Some(j) = g.as_ref() else {
            return Ok(out);
        };
        out.push(
            Record::Header {
                reset: true,
                saved: header_of(j, j.marker.clone()),
            }
            .encode(),
        );
        for step in p.steps()? {
            if step <= j.applied && j.marker.as_ref().is_none_or(|m| m.0 != step) {
                continue;
            }
            for (index, body) in p.read_raw(step)?.into_iter().enumerate() {
                out.push(
                    Record::Push {
                        step,
                        index: index as u64,
                        body,
                    }
                    .encode(),
                );
            }
        }
        Ok(out)
    }

    /// This follower was promoted: it loads the job it kept of its primary's, as a restarted
    /// primary does (a step its primary was applying is finished: the tables that do not hold
    /// its request id get it), and runs it from now on.
    pub fn take_over(&self, store: &Store) -> Result<()> {
        let _a = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        *self.mirror.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let job = match &self.persist {
            Some(p) => Self::read_job(p, store)?,
            None => None,
        };
        if let Some(j) = &job {
            eprintln!(
                "event=job_taken_over job={:?} applied={} pending={:?}",
                j.id,
                j.applied,
                j.pending.keys().collect::<Vec<_>>()
            );
        }
        *self.lock() = job;
        self.following.store(false, Ordering::Release);
        self.notify();
        Ok(())
    }

    fn refuse_following(&self) -> Result<()> {
        if self.following.load(Ordering::Acquire) {
            return Err(Error::Remote {
                server: String::new(),
                code: tonic::Code::FailedPrecondition as i32,
                message: "this server follows a primary: it runs no job (its primary does)".into(),
            });
        }
        Ok(())
    }

    fn restore(p: &Persist, store: &Store, saved: Saved) -> Result<Job> {
        let n = saved.clocks.len();
        let now = Instant::now();
        let holds = boundary::Holds::after_restart(&saved.clocks);
        let mut j = Job {
            id: saved.id,
            opts: JobOptions {
                lease: Duration::try_from_secs_f64(saved.lease_s).unwrap_or(DEFAULT_LEASE),
                continue_on_loss: saved.continue_on_loss,
                mean: saved.mean,
            },
            clocks: saved.clocks,
            seen: vec![now; n],
            joined: vec![true; n],
            lost: saved.lost,
            applied: saved.applied,
            failed: None,
            nonce: saved.nonce,
            logged: BTreeMap::new(),
            pending: BTreeMap::new(),
            rids: BTreeMap::new(),
            marker: None,
            holds,
        };
        if j.lost.len() != n {
            j.lost = vec![false; n];
        }
        let replay = |j: &mut Job, step: u64| -> Result<()> {
            let records = p.read_log(step)?;
            j.logged.insert(step, records.len() as u64);
            for (h, ids, vals) in records {
                if let Some(r) = h.rid {
                    if !j.rids.entry(step).or_default().insert(r) {
                        continue;
                    }
                }
                add_to(j, step, &h.table, h.dim, &ids, &vals)?;
            }
            Ok(())
        };
        if let Some((step, seqs)) = saved.applying {
            // Finish the step the crash interrupted: the tables that do not have it (they do
            // not hold its request id; in files of older versions, their seq has not moved).
            replay(&mut j, step)?;
            let live = j.lost.iter().filter(|&&l| !l).count().max(1);
            let divisor = if j.opts.mean { live as f64 } else { 1.0 };
            let rid = (j.nonce != 0).then_some((j.nonce, step));
            for (name, agg) in j.pending.remove(&step).unwrap_or_default() {
                if rid.is_some() {
                    apply_one(store, &name, agg, divisor, rid)?;
                } else if seqs
                    .get(&name)
                    .is_some_and(|&s| seq_of(store, &name) == Some(s))
                {
                    apply_one(store, &name, agg, divisor, None)?;
                }
            }
            j.applied = j.applied.max(step);
            j.rids.clear();
            j.logged.clear();
        }
        let applied = j.applied;
        for st in p.steps()?.into_iter().filter(|&st| st > applied) {
            replay(&mut j, st)?;
        }
        p.save(&j, None)?;
        p.prune(j.applied, false)?;
        Ok(j)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Job>> {
        self.job.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiter to look again (a change of the job, or of the routing its clock
    /// calls are checked against).
    pub(super) fn notify(&self) {
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
            opts: Some(j.opts),
        }
    }

    /// Takes job `job` of `n` workers as the other servers of the list hold it, for a server
    /// that joins the list while the job runs (decision 0125): `clocks`, the workers `lost` and
    /// `joined`, and the steps `applied`. A job of another id is replaced (a joining server
    /// holds no rows, so it has no step of it to apply); the same job has its clocks raised to
    /// these (never lowered: they are what every worker reported elsewhere, and a report here
    /// is as new), its lost workers replaced, and its applied steps raised when no step of its
    /// own is pending up to them. Every clock is counted as let go (a snapshot's hold here
    /// takes a later step). A carry to a follower is refused like a write.
    #[allow(clippy::too_many_arguments)]
    pub fn carry(
        &self,
        job: &str,
        n: u32,
        opts: JobOptions,
        clocks: &[u64],
        lost: &[u32],
        joined: &[u32],
        applied: u64,
    ) -> Result<()> {
        if job.is_empty() {
            return Err(invalid("a carried job needs its id"));
        }
        if n == 0 || n > super::state::MAX_WORKERS || clocks.len() != n as usize {
            return Err(invalid(format!(
                "a carried job of {n} workers (at most {}) needs one clock per worker, got {}",
                super::state::MAX_WORKERS,
                clocks.len()
            )));
        }
        if let Some(&w) = lost.iter().chain(joined).find(|&&w| w >= n) {
            return Err(invalid(format!(
                "a carried job names worker {w}, not in 0..num_workers = 0..{n}"
            )));
        }
        self.refuse_following()?;
        let mut g = self.lock();
        let now = Instant::now();
        let same = g
            .as_ref()
            .is_some_and(|j| j.id == job && j.clocks.len() == n as usize);
        let reset = !same;
        if reset {
            *g = Some(Job::start(job, opts, n as usize, now));
            if let Some(p) = &self.persist {
                p.prune(0, true)?;
            }
        }
        let j = g.as_mut().expect("job set above");
        for (c, &k) in j.clocks.iter_mut().zip(clocks) {
            *c = (*c).max(k);
        }
        for (w, l) in j.lost.iter_mut().enumerate() {
            *l = lost.contains(&(w as u32));
        }
        for &w in joined {
            j.joined[w as usize] = true;
        }
        if j.pending.keys().next().is_none_or(|&s| s > applied) && j.marker.is_none() {
            j.applied = j.applied.max(applied);
        }
        j.seen.iter_mut().for_each(|s| *s = now);
        j.holds.carried(&j.clocks);
        if let Some(p) = &self.persist {
            p.save_as(j, j.marker.clone(), reset)?;
        }
        eprintln!(
            "event=job_carried job={job:?} clocks={:?} applied={} new={reset}",
            j.clocks, j.applied
        );
        drop(g);
        self.notify();
        Ok(())
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
        self.refuse_following()?;
        let mut g = self.lock();
        let mut reset = false;
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
            *g = Some(Job::start(job, opts, n as usize, now));
            reset = true;
            if let Some(p) = &self.persist {
                p.prune(0, true)?;
            }
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
        let before = j.clocks[w];
        j.clocks[w] = j.clocks[w].max(clock);
        if let Some(p) = &self.persist {
            if j.clocks[w] != before || clock == 0 {
                p.save_as(j, j.marker.clone(), reset)?;
            }
        }
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

    /// A pending step's aggregate with a row (or, of a dense table, its home) in the slots
    /// `set`: the job, the step and the table. Such an aggregate is not moved with the slots.
    pub fn pending_in(&self, set: &[bool]) -> Option<(String, u64, String)> {
        use crate::net::routing::{key, slot_of};
        let in_set = |slot: usize| set.get(slot).copied().unwrap_or(false);
        // A step being applied has left `pending` and may not be in the rows yet: wait for it.
        let _a = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        let g = self.lock();
        let j = g.as_ref()?;
        for (step, tables) in &j.pending {
            for (name, agg) in tables {
                let hit = match agg {
                    Agg::Sparse { ids, .. } => ids.iter().any(|&id| in_set(slot_of(id))),
                    Agg::Dense(_) => in_set(slot_of(key(name))),
                };
                if hit {
                    return Some((j.id.clone(), *step, name.clone()));
                }
            }
        }
        None
    }

    /// The rows of the pending steps' aggregates in the slots `set`, by table: a sparse
    /// table's ids there, or (`None`) a dense table whose home is there. Waits for a step being
    /// applied first, as [`pending_in`](Self::pending_in) does. A slot move marking `set` as
    /// copying records them: they are applied later, outside any writer's pass (decision 0123).
    pub fn pending_rows_in(&self, set: &[bool]) -> Vec<(String, Option<Vec<u64>>)> {
        use crate::net::routing::{key, slot_of};
        let in_set = |slot: usize| set.get(slot).copied().unwrap_or(false);
        let _a = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        let g = self.lock();
        let Some(j) = g.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for tables in j.pending.values() {
            for (name, agg) in tables {
                match agg {
                    Agg::Sparse { ids, .. } => {
                        let here: Vec<u64> = ids
                            .iter()
                            .copied()
                            .filter(|&id| in_set(slot_of(id)))
                            .collect();
                        if !here.is_empty() {
                            out.push((name.clone(), Some(here)));
                        }
                    }
                    Agg::Dense(_) if in_set(slot_of(key(name))) => out.push((name.clone(), None)),
                    Agg::Dense(_) => {}
                }
            }
        }
        out
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

    /// Adds a push of worker `w` (request id `rid`) to step `step`'s aggregate of `table`; a
    /// request id counted in the step already counts once. A durable server logs the push
    /// before it is counted.
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &self,
        job: &str,
        w: u32,
        rid: Option<(u64, u64)>,
        step: u64,
        table: &str,
        dim: usize,
        ids: &[u64],
        grads: &[f32],
    ) -> Result<()> {
        self.refuse_following()?;
        let mut g = self.lock();
        let j = g
            .as_mut()
            .ok_or_else(|| invalid(format!("job {job:?} has not started on this server")))?;
        Self::check_push(j, job, step)?;
        if let Some(s) = j.seen.get_mut(w as usize) {
            *s = Instant::now();
        }
        if let Some(r) = rid {
            if j.rids.get(&step).is_some_and(|x| x.contains(&r)) {
                return Ok(());
            }
        }
        if let Some(p) = &self.persist {
            let index = j.logged.get(&step).copied().unwrap_or(0);
            p.log(
                step,
                index,
                &LogHead {
                    rid,
                    table: table.to_string(),
                    dim,
                },
                ids,
                grads,
            )?;
            j.logged.insert(step, index + 1);
        }
        add_to(j, step, table, dim, ids, grads)?;
        if let Some(r) = rid {
            j.rids.entry(step).or_default().insert(r);
        }
        Ok(())
    }

    /// Applies every complete step (each live worker's clock is at least the step), in order.
    /// Blocking: runs the optimizer over the aggregates.
    pub fn apply_ready(&self, store: &Store) -> Result<()> {
        let _a = self.applying.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let (step, tables, divisor, rid) = {
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
                let rid = (j.nonce != 0).then_some((j.nonce, step));
                if let Some(p) = &self.persist {
                    let seqs = tables
                        .keys()
                        .filter_map(|t| Some((t.clone(), seq_of(store, t)?)))
                        .collect();
                    j.marker = Some((step, seqs));
                    if let Err(e) = p.save(j, j.marker.clone()) {
                        j.marker = None;
                        j.pending.insert(step, tables);
                        return Err(e);
                    }
                }
                (step, tables, divisor, rid)
            };
            let mut first_err = None;
            for (name, agg) in tables {
                if let Err(e) = apply_one(store, &name, agg, divisor, rid) {
                    first_err.get_or_insert(e);
                }
            }
            {
                let mut g = self.lock();
                if let Some(j) = g.as_mut() {
                    j.applied = j.applied.max(step);
                    j.marker = None;
                    j.rids = j.rids.split_off(&(step + 1));
                    j.logged = j.logged.split_off(&(step + 1));
                    if let Some(p) = &self.persist {
                        if let Err(e) = p.save(j, None).and_then(|_| p.prune(step, false)) {
                            first_err.get_or_insert(e);
                        }
                    }
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
    /// (returns `needs_apply` then). `clock`: the clock a worker's call advanced to, which a
    /// snapshot's hold may keep waiting (and which is recorded as let go when it is done).
    fn check(
        &self,
        job: &str,
        target: u64,
        synced: bool,
        clock: Option<u64>,
    ) -> Result<(bool, bool)> {
        // A primary that stepped down while a worker waited: the worker goes to the new one.
        self.refuse_following()?;
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
                    if let Some(p) = &self.persist {
                        p.save(j, j.marker.clone())?;
                    }
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
        let done = done && clock.is_none_or(|k| j.holds.pass(k));
        Ok((done, newly_lost))
    }

    /// Waits until every live worker's clock is at least `target` and, with `synced`, step
    /// `target` is applied, and no snapshot's hold keeps `clock` (the clock `w` advanced to)
    /// waiting. Renews `w`'s lease while it waits.
    /// `moved`: whether the server list changed since the call was routed; the wait then ends
    /// with an error (the caller answers "moved": the worker reports to the new list).
    #[allow(clippy::too_many_arguments)]
    pub async fn wait(
        self: &Arc<Self>,
        store: &Arc<Store>,
        job: &str,
        w: u32,
        target: u64,
        synced: bool,
        clock: Option<u64>,
        moved: &(dyn Fn() -> bool + Sync),
    ) -> Result<()> {
        let mut rx = self.tick.subscribe();
        loop {
            if moved() {
                return Err(invalid(
                    "the server list changed while the clock call waited",
                ));
            }
            let (done, newly_lost) = self.check(job, target, synced, clock)?;
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

/// Adds gradients to a step's aggregate: `ids` empty and `dim` 0 for a dense table.
fn add_to(
    j: &mut Job,
    step: u64,
    table: &str,
    dim: usize,
    ids: &[u64],
    grads: &[f32],
) -> Result<()> {
    let tables = j.pending.entry(step).or_default();
    if dim == 0 {
        let agg = tables
            .entry(table.to_string())
            .or_insert_with(|| Agg::Dense(vec![0.0; grads.len()]));
        return match agg {
            Agg::Dense(sums) if sums.len() == grads.len() => {
                for (a, &b) in sums.iter_mut().zip(grads) {
                    *a += f64::from(b);
                }
                Ok(())
            }
            _ => Err(invalid(format!(
                "table {table:?}: not a dense table of this size"
            ))),
        };
    }
    let agg = tables
        .entry(table.to_string())
        .or_insert_with(|| Agg::Sparse {
            dim,
            index: IdMap::default(),
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

/// Applies a step's aggregate of one table as the write request `rid` (the job's nonce and the
/// step), kept with the rows it changes: a table that holds it already has the step (a crash or
/// a failover in the middle of the step), and the rows of an environment that holds it are left.
fn apply_one(
    store: &Store,
    name: &str,
    agg: Agg,
    divisor: f64,
    rid: Option<(u64, u64)>,
) -> Result<()> {
    let table = match store.table(name) {
        Ok(t) => t,
        // Dropped while its step was pending: nothing to apply.
        Err(Error::UnknownTable(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    match (table, agg) {
        (Table::Sparse(t), Agg::Sparse { ids, sums, dim, .. }) => {
            let grads: Vec<f32> = sums.iter().map(|&x| (x / divisor) as f32).collect();
            t.validate_push(&ids, &grads)?;
            let Some((client, seq)) = rid else {
                return t.push_validated(&ids, &grads, 1.0);
            };
            match super::still_to_apply(store, t.was_applied(client, seq)?) {
                None => Ok(()),
                Some(None) => t.push_validated_as(&ids, &grads, 1.0, rid),
                Some(Some(keep)) => {
                    let (ids, grads) = super::keep_rows(&ids, &grads, dim, keep.as_ref());
                    t.push_validated_as(&ids, &grads, 1.0, rid)
                }
            }
        }
        (Table::Dense(t), Agg::Dense(sums)) => {
            let grad: Vec<f32> = sums.iter().map(|&x| (x / divisor) as f32).collect();
            t.validate_push(&grad)?;
            if let Some((client, seq)) = rid {
                if t.was_applied(client, seq)?.iter().all(|&d| d) {
                    return Ok(());
                }
            }
            t.push_validated_as(&grad, 1.0, rid)
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
        lease_seconds: v.opts.map_or(0.0, |o| o.lease.as_secs_f64()),
        continue_on_worker_loss: v.opts.is_some_and(|o| o.continue_on_loss),
        mean: v.opts.is_some_and(|o| o.mean),
    }
}

/// A job's options as a clock call gives them.
fn options_of(r: &ClockRequest) -> Result<JobOptions> {
    let lease = if r.lease_seconds > 0.0 && r.lease_seconds.is_finite() {
        Duration::try_from_secs_f64(r.lease_seconds)
            .map_err(|e| invalid(format!("lease_seconds {}: {e}", r.lease_seconds)))?
    } else if r.lease_seconds == 0.0 {
        DEFAULT_LEASE
    } else {
        return Err(invalid(format!(
            "lease_seconds must be > 0, got {}",
            r.lease_seconds
        )));
    };
    Ok(JobOptions {
        lease,
        continue_on_loss: r.continue_on_worker_loss,
        mean: r.mean,
    })
}

impl super::Service {
    /// A clock call of a job: reports the clock, applies the steps it completed, and waits.
    /// `epoch`: the routing epoch the call was routed by, if it carries one: a call routed
    /// over an older server list than the held one is answered "moved" after its clock was
    /// taken, and so is one waiting here when the list changes (decision 0125).
    pub(super) async fn job_clock(
        &self,
        r: ClockRequest,
        epoch: Option<u64>,
    ) -> std::result::Result<ClockResponse, Status> {
        let inner = &self.0;
        if r.carry {
            if r.advance || r.wait {
                return Err(status_of(&invalid(
                    "a carried job (carry) neither reports a clock nor waits: advance and wait \
                     must be false",
                )));
            }
            let opts = options_of(&r).map_err(|e| status_of(&e))?;
            inner
                .steps
                .carry(
                    &r.job,
                    r.num_workers,
                    opts,
                    &r.carried_clocks,
                    &r.carried_lost,
                    &r.carried_joined,
                    r.carried_applied,
                )
                .map_err(|e| status_of(&e))?;
            return Ok(job_clocks(inner.steps.view()));
        }
        if r.advance {
            let opts = options_of(&r).map_err(|e| status_of(&e))?;
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
        if let Some(st) = inner.routing.list_moved(epoch) {
            // Taken (the same clock is reported again to the new list, and a heartbeat's next
            // renewal reaches every server of it: a joining server's lease of a worker
            // computing a long step must not run out), not waited for here.
            return Err(st);
        }
        let clock = r.advance.then_some(r.clock);
        if r.wait {
            let target = r.clock.saturating_sub(r.staleness);
            let moved = || inner.routing.list_moved(epoch).is_some();
            let waited = inner
                .steps
                .wait(
                    &inner.store,
                    &r.job,
                    r.worker,
                    target,
                    r.staleness == 0,
                    clock,
                    &moved,
                )
                .await;
            if let Err(e) = waited {
                return Err(inner
                    .routing
                    .list_moved(epoch)
                    .unwrap_or_else(|| status_of(&e)));
            }
        } else if r.advance {
            // Answered at once, unless a snapshot holds this clock.
            inner.steps.pass_hold(&r.job, r.worker, r.clock).await;
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
    fn a_carried_job_raises_clocks_and_a_bad_carry_changes_nothing() {
        let s = Steps::default();
        assert!(s.carry("", 2, opts(), &[1, 1], &[], &[], 0).is_err());
        assert!(s.carry("j", 2, opts(), &[1], &[], &[], 0).is_err());
        assert!(s.carry("j", 2, opts(), &[1, 1], &[2], &[], 0).is_err());
        assert!(s.view().job.is_empty());
        // A joining server takes the job where the others are, and clock calls above 0.
        s.carry("j", 2, opts(), &[3, 2], &[], &[0, 1], 2).unwrap();
        let v = s.view();
        assert_eq!((v.clocks, v.joined, v.applied), (vec![3, 2], vec![0, 1], 2));
        s.advance("j", 1, 2, 3, opts()).unwrap();
        // Again: clocks are only raised, lost workers replaced.
        s.carry("j", 2, opts(), &[2, 4], &[0], &[0, 1], 2).unwrap();
        let v = s.view();
        assert_eq!((v.clocks, v.lost), (vec![3, 4], vec![0]));
        // A pending step is not skipped by a carried applied count.
        s.add("j", 1, Some((1, 1)), 4, "t", 1, &[1], &[1.0])
            .unwrap();
        s.carry("j", 2, opts(), &[4, 4], &[], &[0, 1], 5).unwrap();
        assert_eq!(s.view().applied, 2);
        // Every carried clock counts as let go: a boundary hold takes a later step.
        assert_eq!(
            s.reserve("j", "h", None, Duration::from_secs(5)).unwrap().1,
            5
        );
        // Another job is replaced.
        s.carry("k", 3, opts(), &[1, 1, 1], &[], &[], 1).unwrap();
        assert_eq!(s.view().job, "k");
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
        assert!(s.add("a", 0, None, 1, "t", 1, &[1], &[1.0]).is_err());
        assert!(s.advance("a", 1, 2, 4, opts()).is_err());
        assert!(s.advance("b", 2, 2, 0, opts()).is_err());
        assert!(s.advance("b", 0, 3, 0, opts()).is_err());
    }
}
