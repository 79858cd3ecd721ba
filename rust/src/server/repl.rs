//! Replication of a durable store server to followers (docs/CLUSTER.md, Replication).
//!
//! **Primary.** Every durable server with one LMDB environment keeps a bounded in-memory log of
//! its commits ([`crate::durable::CommitSink`]): each entry is one flush cycle's committed
//! changes under the cycle's number, its log sequence number (LSN). The log is kept while a
//! follower is connected (and for `log_age` after the last one left), bounded by `log_bytes` and
//! `log_age`. A follower pulls it with the server-streaming `Replicate(from_lsn)`: the entries
//! after `from_lsn` when the log holds them all, otherwise a full resync (every table read from
//! one LMDB read transaction at a known LSN, then the entries after it); never a gap. Followers
//! report the LSN they hold durably with `ReplicaAck`; a push with `ack_all` returns when the
//! primary has committed it and every *live* follower has acked a later LSN.
//!
//! **Live followers.** A follower is live while its stream is open and its acks keep up: one
//! that leaves, or that does not ack a commit a push waits for within `ack_timeout`, is dropped
//! from the live set (a push then stops waiting for it, and the status says so); it is live again
//! once it has acked everything the primary had committed when it last acked.
//!
//! **Follower.** A server started with `follow` applies the entries, rows as they are, to its
//! own store, commits them, records `(primary's replication id, LSN)` in its replica, and acks.
//! Applying an entry twice changes nothing (entries carry whole states), so a crash between a
//! commit and the record of its LSN is harmless. A follower refuses writes
//! (FAILED_PRECONDITION, naming its primary) and answers pulls without creating rows.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use super::follow_log::{self, FollowLog};
use crate::durable::{CommitEntry, CommitSink, TableRecord};
use crate::error::{invalid, storage, Error, Result};
use crate::net::proto::p_store_client::PStoreClient;
use crate::net::proto::{
    HeldState, ReplicaAckRequest, ReplicateMessage, ReplicateRequest, ReplicatedTable,
};
use crate::net::wire;
use crate::storage::Db;
use crate::store::{Store, Table};
use crate::table::TableHandle;

/// The meta key of a server's own replication id (as a primary).
pub const ID_KEY: &str = "replication/id";
/// The meta key of what a follower's copy follows: `{"primary_id": .., "lsn": ..}`.
pub const FOLLOW_KEY: &str = "replication/follow";
/// A follower commits the rows of its log to LMDB at least this often (0126).
const CHECKPOINT_AGE: Duration = Duration::from_secs(1);
/// ... or once its log holds this many bytes.
const CHECKPOINT_BYTES: u64 = 64 << 20;

/// Replication settings of a server.
#[derive(Debug, Clone)]
pub struct ReplConfig {
    /// Follow the primary at this `host:port` (a follower); `None`: a primary.
    pub follow: Option<String>,
    /// The name this server gives its primary (its address as others reach it).
    pub name: String,
    /// The most bytes of entries the primary's log keeps.
    pub log_bytes: usize,
    /// The oldest entry the primary's log keeps.
    pub log_age: Duration,
    /// How long a push with `ack_all` waits for a follower's ack before the follower is dropped
    /// from the live set.
    pub ack_timeout: Duration,
    /// The token a follower sends its primary.
    pub token: Option<String>,
    /// A primary's write lease: it accepts a write only while every live follower acked within
    /// this time (docs/decisions/0100); a promoted follower waits it out before its first write.
    /// At most half the ack timeout is used.
    pub lease: Duration,
    /// The group's other members as the cluster file names them (`pstore serve --member`): a
    /// server starting as primary asks each of them, as it asks the members it recorded,
    /// before it writes, and follows one that is primary of a newer epoch.
    pub members: Vec<String>,
}

impl Default for ReplConfig {
    fn default() -> Self {
        Self {
            follow: None,
            name: String::new(),
            log_bytes: 256 << 20,
            log_age: Duration::from_secs(600),
            ack_timeout: Duration::from_secs(5),
            token: None,
            lease: Duration::from_secs(2),
            members: Vec::new(),
        }
    }
}

impl ReplConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        if self.ack_timeout.is_zero() {
            return Err(invalid("the replication ack timeout must be > 0"));
        }
        if self.lease.is_zero() {
            return Err(invalid("the replication lease must be > 0"));
        }
        if self.log_age.is_zero() {
            return Err(invalid("the replication log age must be > 0"));
        }
        Ok(())
    }
}

/// What a server holds beside its tables that decides what it accepts (its routing, layout
/// hash, frozen slots, copied request ids; decision 0101): read for a resync on a primary,
/// installed on a follower.
pub trait Held: Send + Sync {
    /// The state as it is now.
    fn state(&self) -> HeldState;
    /// Replaces what this server holds with `state` (kept first by a durable store).
    fn install(&self, state: HeldState) -> Result<()>;
    /// The whole state of the server's synchronous job, as records (`bsp/mirror.rs`): sent
    /// with a resync.
    fn job_state(&self) -> Result<Vec<Vec<u8>>> {
        Ok(Vec::new())
    }
    /// Keeps the primary's job records, in order (a follower; kept durably before it acks).
    fn install_job(&self, _records: &[Vec<u8>]) -> Result<()> {
        Ok(())
    }
    /// This server follows a primary from now on: it runs no job logic and holds no job in
    /// memory (what it keeps on disk is replaced by its primary's).
    fn following(&self) {}
    /// This server was promoted: it loads the job it holds (before it accepts a write).
    fn promoted(&self) -> Result<()> {
        Ok(())
    }
}

/// Where a primary or follower finds its server's [`Held`] (set once the server is built).
#[derive(Default)]
pub(super) struct HeldLink(Mutex<Option<Arc<dyn Held>>>);

impl HeldLink {
    pub(super) fn set(&self, h: Arc<dyn Held>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
    }

    fn get(&self) -> Option<Arc<dyn Held>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A follower as its primary sees it.
#[derive(Debug, Clone)]
struct FollowerState {
    /// The LSN it holds durably.
    acked: u64,
    /// Open streams.
    streams: usize,
    /// In the live set (`ack_all` waits for it).
    live: bool,
    /// When its ack last advanced, or it connected.
    progress: Instant,
    /// Why it left the live set.
    dropped: Option<String>,
    /// When it last acked (renews the primary's write lease).
    heard: Instant,
}

struct LogState {
    /// `(lsn, message, bytes, when, committed)`: the newest may be on its way to the disk
    /// still (handed on before its commit, decision 0116).
    entries: VecDeque<(u64, Arc<ReplicateMessage>, usize, Instant, bool)>,
    bytes: usize,
    /// Every entry after this LSN is in `entries`.
    covered_from: u64,
    /// The newest LSN committed.
    last: u64,
    followers: HashMap<String, FollowerState>,
    /// Entries are kept until then although no follower is connected.
    keep_until: Option<Instant>,
    /// Resyncs served.
    resyncs: u64,
    /// Followers that left the live set (or were members before a restart) and may have been
    /// promoted since: writes wait until the group asked them (`fence.rs`).
    suspects: Vec<String>,
    /// Set when a newer epoch has another primary: every write is refused with this message.
    fenced: Option<String>,
    /// Entries handed on before their commit whose commit failed (numbers above
    /// `covered_from`): a stream that began before one is cut, and a follower that would
    /// resume from before one resyncs.
    retracted: Vec<u64>,
    /// How many entries were retracted (a stream is cut when this changes while it runs).
    retractions: u64,
    /// The disk's last commit when this run started: a follower's position read back from its
    /// disk is never resumed from here (see [`LogState::resumable`]).
    started_at: u64,
}

impl LogState {
    /// Whether a follower holding exactly what this primary committed up to `lsn` may
    /// resume from it: `lsn` is the log's start (a commit on disk) or an entry this run
    /// committed (never one that may have left uncommitted: a retracted one, or one a run
    /// before a crash handed on), and no entry after it was retracted.
    fn resumable(&self, lsn: u64, exact: bool) -> bool {
        // A position read back from the follower's disk may understate its rows by entries
        // that a run of this primary before a restart handed on and never committed: never
        // resumed from the point this run started at (`ReplicateRequest.exact`).
        if !exact && lsn == self.started_at {
            return false;
        }
        (lsn == self.covered_from
            || self
                .entries
                .iter()
                .any(|(l, .., committed)| *l == lsn && *committed))
            && !self.retracted.iter().any(|&r| r > lsn)
    }
}

/// A primary's log and followers.
pub struct Primary {
    /// This server's replication id.
    pub id: u64,
    /// The group epoch this server is primary of.
    pub epoch: u64,
    store: Arc<Store>,
    config: ReplConfig,
    state: Mutex<LogState>,
    acked: Condvar,
    newest: watch::Sender<u64>,
    /// The server's held state, sent with a resync.
    pub(super) held: HeldLink,
}

/// A random id, never 0 (a log's id, a job's nonce).
pub(in crate::server) fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish().max(1)
}

fn u64_of(v: &[u8]) -> Option<u64> {
    v.get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
}

/// The message of a commit entry.
fn message_of(id: u64, epoch: u64, e: CommitEntry) -> ReplicateMessage {
    ReplicateMessage {
        epoch,
        replication_id: id,
        lsn: e.lsn,
        resync_start: false,
        resync_done: false,
        dropped: e.dropped,
        tables: e
            .tables
            .into_iter()
            .map(|t| ReplicatedTable {
                name: t.name,
                record_json: t.record.map(Bytes::from).unwrap_or_default(),
                ids: wire::encode_ids(&t.ids),
                words: words_bytes(&t.words),
                gone: wire::encode_ids(&t.gone),
                dense: t.dense.as_deref().map(words_bytes).unwrap_or_default(),
                applied: t.applied.map(Bytes::from).unwrap_or_default(),
            })
            .collect(),
        primary_lsn: e.lsn,
        held: e.held.and_then(|b| {
            use prost::Message;
            HeldState::decode(b.as_slice())
                .map_err(|err| eprintln!("pstore: the held state of entry {}: {err}", e.lsn))
                .ok()
        }),
        members: Vec::new(),
        job: e.job.into_iter().map(Bytes::from).collect(),
    }
}

fn words_bytes(w: &[u32]) -> Bytes {
    Bytes::copy_from_slice(crate::storage::bytes_of(w))
}

impl Primary {
    /// Keeps the log of `store` (durable, one environment) from now on.
    pub fn start(store: Arc<Store>, config: ReplConfig, epoch: u64) -> Result<Arc<Self>> {
        let f = store
            .flusher()
            .ok_or_else(|| invalid("replication needs a durable store"))?;
        let st = f.storage();
        if st.read(|r| r.meta(FOLLOW_KEY))?.is_some() {
            // A former follower, a primary now: its rows may change from here on, so what it
            // followed no longer says what it holds (a later --follow resyncs).
            st.write(|w| w.delete_meta(FOLLOW_KEY))?;
        }
        let id = match st.read(|r| r.meta(ID_KEY))?.as_deref().and_then(u64_of) {
            Some(id) => id,
            None => {
                let id = random_id();
                st.write(|w| w.put_meta(ID_KEY, &id.to_le_bytes()))?;
                id
            }
        };
        let p = Arc::new(Self {
            id,
            epoch,
            store,
            config,
            state: Mutex::new(LogState {
                entries: VecDeque::new(),
                bytes: 0,
                covered_from: 0,
                last: 0,
                followers: HashMap::new(),
                keep_until: None,
                resyncs: 0,
                suspects: Vec::new(),
                fenced: None,
                retracted: Vec::new(),
                retractions: 0,
                started_at: 0,
            }),
            acked: Condvar::new(),
            newest: watch::channel(0).0,
            held: HeldLink::default(),
        });
        if st.environments() > 1 {
            // Its cycles commit per environment: not one entry each. Replicate refuses.
            return Ok(p);
        }
        // A run before a crash may have handed on the entry of the cycle after the last one on
        // disk without committing it: that number is never used again (decision 0116), and
        // nothing but the disk's last commit is a point to resume from.
        let on_disk = f.skip_cycle_number()?;
        f.set_commit_sink(Some(Arc::clone(&p) as Arc<dyn CommitSink>));
        // Cycles committed before the sink was set are not in the log.
        let done = f.done_cycle();
        let done = if done == on_disk + 1 { on_disk } else { done };
        let mut s = p.lock();
        s.covered_from = s.covered_from.max(done);
        s.last = s.last.max(done);
        s.started_at = on_disk;
        drop(s);
        Ok(p)
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops entries past the log's bounds.
    fn trim(&self, s: &mut LogState) {
        let now = Instant::now();
        while let Some((lsn, _, bytes, at, committed)) = s.entries.front() {
            if !committed
                || (s.bytes <= self.config.log_bytes
                    && now.duration_since(*at) <= self.config.log_age)
            {
                break;
            }
            s.covered_from = *lsn;
            s.bytes -= bytes;
            s.entries.pop_front();
        }
        let from = s.covered_from;
        s.retracted.retain(|&r| r > from);
    }

    /// The status of replication as JSON.
    pub fn status_json(&self) -> serde_json::Value {
        let s = self.lock();
        let followers: Vec<serde_json::Value> = s
            .followers
            .iter()
            .map(|(name, f)| {
                serde_json::json!({
                    "name": name,
                    "acked_lsn": f.acked,
                    "lag_entries": s.last.saturating_sub(f.acked),
                    "connected": f.streams > 0,
                    "live": f.live,
                    "dropped": f.dropped,
                })
            })
            .collect();
        serde_json::json!({
            "role": "primary",
            "replication_id": format!("{:016x}", self.id),
            "lsn": s.last,
            "log_first_lsn": s.covered_from + 1,
            "log_entries": s.entries.len(),
            "log_bytes": s.bytes,
            "resyncs": s.resyncs,
            "followers": followers,
        })
    }

    /// The largest lag in entries of a connected follower, the followers live and connected,
    /// and the newest LSN.
    pub fn sample(&self) -> (u64, usize, usize, u64) {
        let s = self.lock();
        let lag = s
            .followers
            .values()
            .filter(|f| f.streams > 0)
            .map(|f| s.last.saturating_sub(f.acked))
            .max()
            .unwrap_or(0);
        let live = s.followers.values().filter(|f| f.live).count();
        let connected = s.followers.values().filter(|f| f.streams > 0).count();
        (lag, live, connected, s.last)
    }

    /// Whether a write may go now: `Ok(true)` yes, `Ok(false)` not yet (a live follower's lease
    /// ran out, or a follower that left may have been promoted: wait for it), `Err` never (a
    /// newer epoch has another primary). A live follower silent for the ack timeout leaves the
    /// live set here too, and becomes a suspect.
    pub fn admit(&self) -> std::result::Result<bool, String> {
        let mut s = self.lock();
        if let Some(m) = &s.fenced {
            return Err(m.clone());
        }
        let mut ok = s.suspects.is_empty();
        let mut gone = Vec::new();
        for (name, f) in s.followers.iter_mut() {
            if !f.live {
                continue;
            }
            let quiet = f.heard.elapsed();
            if quiet >= self.config.ack_timeout {
                f.live = false;
                let why = format!("no ack for {:.1} s", quiet.as_secs_f64());
                eprintln!("pstore: follower {name} left the live set: {why}");
                f.dropped = Some(why);
                gone.push(name.clone());
                ok = false;
            } else if quiet >= self.config.lease {
                ok = false;
            }
        }
        for n in gone {
            if !s.suspects.contains(&n) {
                s.suspects.push(n);
            }
        }
        Ok(ok)
    }

    /// Waits (at most the ack timeout and the lease again) until a write may go.
    pub fn wait_admit(&self) -> std::result::Result<(), String> {
        let until = Instant::now() + self.config.ack_timeout + self.config.lease * 2;
        loop {
            if self.admit()? {
                return Ok(());
            }
            if Instant::now() >= until {
                let s = self.lock();
                return Err(format!(
                    "no write lease: followers {:?} are being asked whether a newer primary \
                     exists, or a live follower has not acked within {:.1} s",
                    s.suspects,
                    self.config.lease.as_secs_f64()
                ));
            }
            let s = self.lock();
            drop(
                self.acked
                    .wait_timeout(s, Duration::from_millis(20))
                    .unwrap_or_else(|e| e.into_inner()),
            );
        }
    }

    /// Followers to ask whether they were promoted.
    pub fn suspects(&self) -> Vec<String> {
        self.lock().suspects.clone()
    }

    /// Adds followers to ask (the members recorded before a restart).
    pub fn suspect(&self, names: &[String]) {
        let mut s = self.lock();
        for n in names {
            if !s.suspects.contains(n) {
                s.suspects.push(n.clone());
            }
        }
    }

    /// A suspect answered as no primary of a newer epoch (or cannot be reached: it is down).
    pub fn clear_suspect(&self, name: &str) {
        let mut s = self.lock();
        s.suspects.retain(|n| n != name);
        drop(s);
        self.acked.notify_all();
    }

    /// Refuses every write from now on with `why`; stops the log.
    pub fn fence(&self, why: String) {
        self.lock().fenced = Some(why);
        if let Some(f) = self.store.flusher() {
            f.set_commit_sink(None);
        }
        self.acked.notify_all();
    }

    /// Followers that have been live (the group's members as this primary knows them).
    pub fn live_names(&self) -> Vec<String> {
        let s = self.lock();
        s.followers
            .iter()
            .filter(|(_, f)| f.live)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The newest LSN committed.
    pub fn last_lsn(&self) -> u64 {
        self.lock().last
    }

    /// A follower acked `lsn`.
    pub fn ack(&self, follower: &str, id: u64, lsn: u64) -> Result<()> {
        if id != self.id {
            return Err(invalid(format!(
                "ack for replication id {id:016x}; this primary's is {:016x}",
                self.id
            )));
        }
        let mut s = self.lock();
        let last = s.last;
        // An entry retracted after it left does not count (its follower resyncs).
        let retracted = s.retracted.contains(&lsn);
        let f = s
            .followers
            .get_mut(follower)
            .ok_or_else(|| invalid(format!("no follower {follower:?} is connected")))?;
        f.heard = Instant::now();
        if lsn > f.acked && !retracted {
            f.acked = lsn;
            f.progress = Instant::now();
        }
        if !f.live && f.streams > 0 && f.acked >= last {
            f.live = true;
            f.dropped = None;
        }
        drop(s);
        self.acked.notify_all();
        Ok(())
    }

    /// Waits until every live follower holds what this primary has committed so far (the
    /// caller's write is committed: a `sync` store's push, or after a flush).
    pub fn wait_all(&self) -> Result<()> {
        let f = self
            .store
            .flusher()
            .ok_or_else(|| invalid("ack_all needs a durable store server"))?;
        if f.mode() != crate::durable::Durability::Sync {
            f.flush()?;
        }
        let started = Instant::now();
        let mut s = self.lock();
        // The newest commit (not a cycle number whose entry was retracted).
        let want = s.last;
        loop {
            let now = Instant::now();
            let timeout = self.config.ack_timeout;
            let mut waiting = false;
            let mut suspects = Vec::new();
            for (name, fl) in s.followers.iter_mut() {
                if !fl.live || fl.acked >= want {
                    continue;
                }
                // A follower has the whole timeout from this wait's start, and again from each
                // ack that advanced.
                if now.duration_since(fl.progress.max(started)) > timeout {
                    fl.live = false;
                    let why = format!(
                        "no ack for {:.1} s (acked LSN {}, LSN {want} waited for)",
                        timeout.as_secs_f64(),
                        fl.acked
                    );
                    eprintln!("pstore: follower {name} left the live set: {why}");
                    fl.dropped = Some(why);
                    suspects.push(name.clone());
                    continue;
                }
                waiting = true;
            }
            for n in suspects {
                if !s.suspects.contains(&n) {
                    s.suspects.push(n);
                }
            }
            if !waiting {
                return Ok(());
            }
            s = self
                .acked
                .wait_timeout(s, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn connect(&self, follower: &str) {
        let mut s = self.lock();
        let f = s
            .followers
            .entry(follower.to_string())
            .or_insert(FollowerState {
                acked: 0,
                streams: 0,
                live: false,
                progress: Instant::now(),
                dropped: None,
                heard: Instant::now(),
            });
        f.streams += 1;
        f.progress = Instant::now();
        s.keep_until = None;
    }

    fn disconnect(&self, follower: &str) {
        let mut s = self.lock();
        if let Some(f) = s.followers.get_mut(follower) {
            f.streams = f.streams.saturating_sub(1);
            if f.streams == 0 && f.live {
                f.live = false;
                f.dropped = Some("its stream closed".into());
                eprintln!("pstore: follower {follower} left the live set: its stream closed");
                if !s.suspects.iter().any(|n| n == follower) {
                    s.suspects.push(follower.to_string());
                }
            }
        }
        if s.followers.values().all(|f| f.streams == 0) {
            s.keep_until = Some(Instant::now() + self.config.log_age);
        }
        drop(s);
        self.acked.notify_all();
    }

    /// Serves a follower's stream: the entries after `from`, or a resync and then the entries.
    pub fn serve(
        self: &Arc<Self>,
        r: ReplicateRequest,
    ) -> Result<mpsc::Receiver<std::result::Result<ReplicateMessage, Status>>> {
        let f = self
            .store
            .flusher()
            .ok_or_else(|| invalid("replication needs a durable store server"))?;
        if f.storage().environments() > 1 {
            return Err(storage(
                "this server's store has several LMDB environments, which commit apart: it \
                 cannot be a replication primary (use one environment)",
            ));
        }
        if r.follower.is_empty() {
            return Err(invalid("Replicate: the follower must name itself"));
        }
        let (tx, rx) = mpsc::channel(4);
        // Registered first: cycles from now on are collected in the log.
        self.connect(&r.follower);
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let name = r.follower.clone();
            let out = me.stream(r, &tx).await;
            if let Err(e) = out {
                let _ = tx.send(Err(crate::net::status_of(&e))).await;
            }
            me.disconnect(&name);
        });
        Ok(rx)
    }

    async fn stream(
        self: &Arc<Self>,
        r: ReplicateRequest,
        tx: &mpsc::Sender<std::result::Result<ReplicateMessage, Status>>,
    ) -> Result<()> {
        let gone = |_| storage("the follower went away");
        let mut newest = self.newest.subscribe();
        let (resume, retractions) = {
            let s = self.lock();
            (
                r.replication_id == self.id && s.resumable(r.from_lsn, r.exact),
                s.retractions,
            )
        };
        let mut sent = if resume {
            r.from_lsn
        } else {
            let me = Arc::clone(self);
            let txb = tx.clone();
            let lsn = tokio::task::spawn_blocking(move || me.resync(&txb))
                .await
                .map_err(|e| Error::Internal(format!("the resync task failed: {e}")))??;
            self.lock().resyncs += 1;
            lsn
        };
        loop {
            let batch: Vec<Arc<ReplicateMessage>> = {
                let s = self.lock();
                if s.retractions != retractions {
                    // It may have carried the entry, or lacks the changes beside the rows that
                    // the entry carried: the follower comes back and resyncs.
                    return Err(storage(format!(
                        "entry {} was retracted (its commit failed on the primary after it \
                         left): the follower resyncs",
                        s.retracted.last().copied().unwrap_or_default()
                    )));
                }
                if sent < s.covered_from {
                    return Err(storage(format!(
                        "the follower fell behind the log (at LSN {sent}, the log starts after \
                         {}): it resyncs",
                        s.covered_from
                    )));
                }
                s.entries
                    .iter()
                    .filter(|(lsn, ..)| *lsn > sent)
                    .map(|(_, m, ..)| Arc::clone(m))
                    .collect()
            };
            for m in batch {
                sent = m.lsn;
                tx.send(Ok((*m).clone())).await.map_err(gone)?;
            }
            // A heartbeat each second keeps the follower's view of the primary's LSN fresh.
            let _ = tokio::time::timeout(Duration::from_secs(1), newest.changed()).await;
            if tx.is_closed() {
                return Ok(());
            }
            let last = self.lock().last;
            if last == sent {
                let beat = ReplicateMessage {
                    epoch: self.epoch,
                    replication_id: self.id,
                    primary_lsn: last,
                    members: self.lock().followers.keys().cloned().collect(),
                    ..ReplicateMessage::default()
                };
                tx.send(Ok(beat)).await.map_err(gone)?;
            }
        }
    }

    /// A full resync into `tx`: every table as one read transaction holds it, at the LSN of the
    /// last cycle before it (cycles are held off until the transaction is open).
    fn resync(
        &self,
        tx: &mpsc::Sender<std::result::Result<ReplicateMessage, Status>>,
    ) -> Result<u64> {
        let f = self
            .store
            .flusher()
            .ok_or_else(|| invalid("replication needs a durable store server"))?;
        let st = Arc::clone(f.storage());
        let send = |m: ReplicateMessage| {
            tx.blocking_send(Ok(m))
                .map_err(|_| storage("the follower went away"))
        };
        let held = f.hold_cycles();
        // The newest commit (the disk holds it: no cycle runs), not a skipped number.
        let lsn = self.lock().last;
        let id = self.id;
        send(ReplicateMessage {
            replication_id: id,
            resync_start: true,
            primary_lsn: lsn,
            ..ReplicateMessage::default()
        })?;
        const CHUNK: usize = 4 << 20;
        st.read(move |r| {
            // The transaction is open: commits may go on; it keeps seeing the state at `lsn`.
            drop(held);
            for (key, rec) in r.meta_prefix("table/")? {
                let name = key["table/".len()..].to_string();
                let parsed: TableRecord = serde_json::from_slice(&rec)
                    .map_err(|e| Error::Corrupt(format!("the record of table {name:?}: {e}")))?;
                let applied = r
                    .meta(&crate::durable::applied_key(&name))?
                    .map(Bytes::from)
                    .unwrap_or_default();
                let mut first = ReplicatedTable {
                    name: name.clone(),
                    record_json: Bytes::from(rec),
                    ..ReplicatedTable::default()
                };
                match parsed {
                    TableRecord::Dense { .. } => {
                        first.dense = r
                            .meta(&crate::durable::dense_key(&name))?
                            .map(Bytes::from)
                            .unwrap_or_default();
                        first.applied = applied;
                        send(ReplicateMessage {
                            replication_id: id,
                            tables: vec![first],
                            primary_lsn: lsn,
                            ..ReplicateMessage::default()
                        })?;
                    }
                    TableRecord::Sparse { .. } => {
                        send(ReplicateMessage {
                            replication_id: id,
                            tables: vec![first],
                            primary_lsn: lsn,
                            ..ReplicateMessage::default()
                        })?;
                        let (mut ids, mut words) = (Vec::<u64>::new(), Vec::<u8>::new());
                        let flush = |ids: &mut Vec<u64>, words: &mut Vec<u8>| {
                            if ids.is_empty() {
                                return Ok(());
                            }
                            let m = ReplicateMessage {
                                replication_id: id,
                                tables: vec![ReplicatedTable {
                                    name: name.clone(),
                                    ids: wire::encode_ids(ids),
                                    words: Bytes::from(std::mem::take(words)),
                                    ..ReplicatedTable::default()
                                }],
                                primary_lsn: lsn,
                                ..ReplicateMessage::default()
                            };
                            ids.clear();
                            send(m)
                        };
                        r.scan(Db::Rows, &name, |rid, payload| {
                            ids.push(rid);
                            words.extend_from_slice(payload);
                            if words.len() >= CHUNK {
                                flush(&mut ids, &mut words)?;
                            }
                            Ok(())
                        })?;
                        flush(&mut ids, &mut words)?;
                        // The applied ids last: with the rows they belong to.
                        send(ReplicateMessage {
                            replication_id: id,
                            tables: vec![ReplicatedTable {
                                name: name.clone(),
                                applied,
                                ..ReplicatedTable::default()
                            }],
                            primary_lsn: lsn,
                            ..ReplicateMessage::default()
                        })?;
                    }
                }
            }
            Ok(())
        })?;
        // What the server holds now (as new as the rows or newer; the entries after `lsn`
        // that carry an older one are followed by those carrying this one).
        send(ReplicateMessage {
            replication_id: id,
            lsn,
            resync_done: true,
            primary_lsn: lsn,
            held: Some(self.held.get().map(|h| h.state()).unwrap_or_default()),
            // The job as the server holds it now (newer than the rows or as new; the records of
            // the entries after `lsn` that it holds already are skipped by the follower).
            job: match self.held.get() {
                Some(h) => h.job_state()?.into_iter().map(Bytes::from).collect(),
                None => Vec::new(),
            },
            ..ReplicateMessage::default()
        })?;
        Ok(lsn)
    }
}

impl Primary {
    /// Adds `entry` to the log and wakes the streams; a `committed` one is the newest commit
    /// (one handed on before its commit waits for `settled`).
    fn append(&self, entry: CommitEntry, committed: bool) {
        let bytes = entry.bytes();
        let lsn = entry.lsn;
        let m = Arc::new(message_of(self.id, self.epoch, entry));
        let mut s = self.lock();
        s.entries
            .push_back((lsn, m, bytes, Instant::now(), committed));
        s.bytes += bytes;
        if committed {
            s.last = lsn;
            self.trim(&mut s);
        }
        drop(s);
        self.newest.send_replace(lsn);
    }
}

impl CommitSink for Primary {
    fn wanted(&self) -> bool {
        let s = self.lock();
        s.followers.values().any(|f| f.streams > 0)
            || s.keep_until.is_some_and(|t| Instant::now() < t)
    }

    fn committed(&self, entry: CommitEntry) {
        self.append(entry, true);
    }

    fn early(&self) -> bool {
        true
    }

    fn shipped(&self, entry: CommitEntry) {
        self.append(entry, false);
    }

    fn settled(&self, lsn: u64, ok: bool) {
        let mut s = self.lock();
        if ok {
            if let Some(e) = s.entries.iter_mut().rev().find(|e| e.0 == lsn) {
                e.4 = true;
            }
            s.last = lsn;
            self.trim(&mut s);
            return;
        }
        // Retracted: the rows it carried were not committed (a `sync` store goes back to its
        // last commit). Streams that began before it are cut; acks of it stop counting.
        if let Some(i) = s.entries.iter().position(|e| e.0 == lsn) {
            if let Some(e) = s.entries.remove(i) {
                s.bytes -= e.2;
            }
        }
        s.retracted.push(lsn);
        s.retractions += 1;
        let last = s.last;
        for f in s.followers.values_mut() {
            f.acked = f.acked.min(last);
        }
        eprintln!(
            "pstore: entry {lsn} was retracted (its commit failed after it was sent): the \
             followers resync"
        );
        drop(s);
        self.newest.send_replace(lsn);
        self.acked.notify_all();
    }

    fn skipped(&self, lsn: u64) {
        let mut s = self.lock();
        s.entries.clear();
        s.bytes = 0;
        s.covered_from = lsn;
        s.last = lsn;
        s.retracted.clear();
        drop(s);
        self.newest.send_replace(lsn);
    }
}

/// What a follower knows of its primary.
#[derive(Debug, Clone, Default)]
struct FollowState {
    /// The primary's replication id its copy follows (0: none yet).
    primary_id: u64,
    /// The last entry applied and committed.
    lsn: u64,
    /// `lsn` is what this process applied, not what its disk recorded lazily (which the rows
    /// may be ahead of): `ReplicateRequest.exact`.
    exact: bool,
    /// The primary's newest LSN, as last heard.
    primary_lsn: u64,
    /// When the primary was last heard from.
    heard: Option<Instant>,
    /// When this follower was last as far as the primary said it was.
    caught_up: Option<Instant>,
    connected: bool,
    resyncing: bool,
    resyncs: u64,
    last_error: Option<String>,
    /// What the replica's `replication/follow` says, and when it was written.
    recorded: (u64, u64),
    recorded_at: Option<Instant>,
    /// The primary's group epoch, as last heard.
    primary_epoch: u64,
    /// When the last ack to the primary ended (answered or failed): the primary's write lease
    /// from this follower ends at most `lease` after it.
    last_ack_end: Option<Instant>,
    /// The primary's other followers, as it last named them.
    siblings: Vec<String>,
}

/// A follower: the thread that pulls its primary's log and applies it.
pub struct Follower {
    /// The primary's address.
    pub primary: String,
    store: Arc<Store>,
    config: ReplConfig,
    state: Mutex<FollowState>,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The name it gives its primary.
    name: Mutex<String>,
    /// Wakes the thread out of its wait for the primary's next message.
    wake: tokio::sync::Notify,
    started: Instant,
    /// The server's held state, replaced by what the primary sends.
    pub(super) held: HeldLink,
    /// The entries acked since the rows were last committed to LMDB (0126), once opened.
    log: Mutex<Option<FollowLog>>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Followed {
    primary_id: u64,
    lsn: u64,
}

impl Follower {
    /// A follower of `config.follow` into `store` (durable); it starts pulling at
    /// [`Follower::spawn`].
    pub fn new(store: Arc<Store>, config: ReplConfig) -> Result<Arc<Self>> {
        let primary = config
            .follow
            .clone()
            .ok_or_else(|| invalid("no primary to follow"))?;
        let f = store
            .flusher()
            .ok_or_else(|| invalid("a follower needs a durable store (give it a path)"))?;
        settle_follow_log(&store)?;
        let followed: Option<Followed> = f
            .storage()
            .read(|r| r.meta(FOLLOW_KEY))?
            .and_then(|v| serde_json::from_slice(&v).ok());
        let (primary_id, lsn) = followed.map_or((0, 0), |x| (x.primary_id, x.lsn));
        let me = Arc::new(Self {
            primary,
            store,
            config,
            state: Mutex::new(FollowState {
                primary_id,
                lsn,
                recorded: (primary_id, lsn),
                ..FollowState::default()
            }),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            name: Mutex::new(String::new()),
            wake: tokio::sync::Notify::new(),
            started: Instant::now(),
            held: HeldLink::default(),
            log: Mutex::new(None),
        });
        Ok(me)
    }

    /// Starts pulling; `addr` names this follower to its primary unless the config names it.
    pub fn spawn(self: &Arc<Self>, addr: &str) -> Result<()> {
        let name = if self.config.name.is_empty() {
            addr.to_string()
        } else {
            self.config.name.clone()
        };
        *self.name.lock().unwrap_or_else(|e| e.into_inner()) = name;
        let run = Arc::clone(self);
        let h = std::thread::Builder::new()
            .name("pstore-follower".into())
            .spawn(move || run.run())
            .map_err(|e| Error::Internal(format!("starting the follower thread: {e}")))?;
        *self.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(())
    }

    fn name(&self) -> String {
        self.name.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn lock(&self) -> MutexGuard<'_, FollowState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the thread.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify_one();
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
            // What it applied goes to LMDB, and its log is removed (a log left behind, on an
            // error, is settled when a follower or a server starts on this store again).
            let (id, lsn) = {
                let s = self.lock();
                (s.primary_id, s.lsn)
            };
            if id != 0 {
                let done = self.checkpoint(id, lsn).and_then(|()| {
                    let log = self.log_lock().take();
                    log.map_or(Ok(()), FollowLog::remove)
                });
                if let Err(e) = done {
                    eprintln!("pstore: committing the follower's log to its replica: {e}");
                }
            }
        }
    }

    fn log_lock(&self) -> MutexGuard<'_, Option<FollowLog>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends entries to the follower's log and syncs it, opening the log first if needed.
    fn log_append(&self, batch: &[ReplicateMessage]) -> Result<()> {
        let mut log = self.log_lock();
        if log.is_none() {
            let dir = self
                .store
                .path()
                .ok_or_else(|| storage("the follower's store has no directory"))?;
            *log = Some(FollowLog::create(dir)?);
        }
        match log.as_mut() {
            Some(l) => l.append(batch),
            None => Err(Error::Internal("the follower's log is not open".into())),
        }
    }

    /// Whether the rows of the log are due in LMDB (and the log holds any).
    fn checkpoint_due(&self) -> bool {
        self.log_lock().as_ref().is_some_and(|l| {
            l.bytes() > 0 && (l.age() >= CHECKPOINT_AGE || l.bytes() >= CHECKPOINT_BYTES)
        })
    }

    /// Commits every row applied to LMDB, records `(primary_id, lsn)`, and empties the log.
    fn checkpoint(&self, primary_id: u64, lsn: u64) -> Result<()> {
        self.store.flush()?;
        self.record(primary_id, lsn)?;
        self.reset_log()
    }

    /// Empties the log: LMDB holds everything it held.
    fn reset_log(&self) -> Result<()> {
        match self.log_lock().as_mut() {
            Some(l) => l.reset(),
            None => Ok(()),
        }
    }

    /// What a promotion of this follower starts from: the primary's replication id and the
    /// LSN of its log held here, the primary's epoch as last heard, and when the primary's
    /// write lease from this follower ends at the latest. Refused while it resyncs or before it
    /// ever held a whole copy; `force` also promotes one that is not caught up.
    pub fn promotable(&self, force: bool) -> std::result::Result<(u64, u64, u64, Instant), String> {
        let s = self.lock();
        if s.resyncing || s.primary_id == 0 {
            return Err(format!(
                "this follower holds no whole copy of its primary {} yet (it is resyncing or \
                 never synced): promoting it would lose rows",
                self.primary
            ));
        }
        if !force && s.caught_up.is_none() {
            return Err(format!(
                "this follower was never caught up with its primary {} (LSN {} of {}): \
                 promote with force to accept losing what it lacks",
                self.primary, s.lsn, s.primary_lsn
            ));
        }
        // The primary's lease is at most the default (or its own setting, never above it).
        let lease = self.config.lease.max(ReplConfig::default().lease);
        let end = s.last_ack_end.unwrap_or(self.started).max(self.started) + lease;
        Ok((s.primary_id, s.lsn, s.primary_epoch, end))
    }

    /// The primary's other followers, as it last named them.
    pub fn siblings(&self) -> Vec<String> {
        self.lock().siblings.clone()
    }

    /// How long the primary has been silent (since this follower started, if never heard).
    pub fn silent_for(&self) -> Duration {
        self.lock().heard.unwrap_or(self.started).elapsed()
    }

    /// The primary's group epoch, as last heard.
    pub fn primary_epoch(&self) -> u64 {
        self.lock().primary_epoch
    }

    /// The last entry applied and committed.
    pub fn lsn(&self) -> u64 {
        self.lock().lsn
    }

    /// How far behind the primary it is: entries, and seconds since it was last caught up
    /// (infinite before it ever was).
    pub fn lag(&self) -> (u64, f64) {
        let s = self.lock();
        let entries = s.primary_lsn.saturating_sub(s.lsn);
        let seconds = if entries == 0 && s.connected {
            0.0
        } else {
            s.caught_up
                .map_or(f64::INFINITY, |t| t.elapsed().as_secs_f64())
        };
        (entries, seconds)
    }

    /// The status of replication as JSON.
    pub fn status_json(&self) -> serde_json::Value {
        let (entries, seconds) = self.lag();
        let s = self.lock();
        serde_json::json!({
            "role": "follower",
            "primary": self.primary,
            "primary_id": format!("{:016x}", s.primary_id),
            "lsn": s.lsn,
            "primary_lsn": s.primary_lsn,
            "lag_entries": entries,
            "lag_seconds": if seconds.is_finite() { serde_json::json!(seconds) } else { serde_json::Value::Null },
            "connected": s.connected,
            "resyncing": s.resyncing,
            "resyncs": s.resyncs,
            "last_error": s.last_error,
            "primary_epoch": s.primary_epoch,
            "siblings": s.siblings,
            "log_bytes": self.log_lock().as_ref().map_or(0, FollowLog::bytes),
        })
    }

    fn run(self: Arc<Self>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("pstore: the follower cannot start its runtime: {e}");
                return;
            }
        };
        let mut backoff = Duration::from_millis(50);
        while !self.stop.load(Ordering::Acquire) {
            match self.session(&rt) {
                Ok(()) => backoff = Duration::from_millis(50),
                Err(e) => {
                    let msg = e.to_string();
                    let mut s = self.lock();
                    if s.last_error.as_deref() != Some(msg.as_str()) {
                        eprintln!("pstore: following {}: {msg}", self.primary);
                    }
                    s.last_error = Some(msg);
                    s.connected = false;
                }
            }
            let until = Instant::now() + backoff;
            while Instant::now() < until && !self.stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    fn request<T>(&self, m: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        if let Some(t) = &self.config.token {
            if let Ok(v) = format!("Bearer {t}").parse() {
                r.metadata_mut().insert("authorization", v);
            }
        }
        r
    }

    /// One stream from the primary, until it ends or fails.
    fn session(&self, rt: &tokio::runtime::Runtime) -> Result<()> {
        let remote = |e: Status| Error::Remote {
            server: self.primary.clone(),
            code: e.code() as i32,
            message: format!("the primary {}: {}", self.primary, e.message()),
        };
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{}", self.primary))
            .map_err(|e| invalid(format!("primary address {:?}: {e}", self.primary)))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .initial_stream_window_size(super::WINDOW)
            .initial_connection_window_size(super::WINDOW * 4);
        let channel = rt
            .block_on(ep.connect())
            .map_err(|e| storage(format!("connecting to the primary {}: {e}", self.primary)))?;
        let mut stub = PStoreClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        let (primary_id, from, exact) = {
            let s = self.lock();
            (s.primary_id, s.lsn, s.exact)
        };
        let req = self.request(ReplicateRequest {
            follower: self.name(),
            replication_id: primary_id,
            from_lsn: from,
            exact,
        });
        let mut stream = rt
            .block_on(stub.replicate(req))
            .map_err(remote)?
            .into_inner();
        {
            let mut s = self.lock();
            s.connected = true;
            s.last_error = None;
        }
        let mut to_ack: Option<(u64, u64)> = None;
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if let Some((id, lsn)) = to_ack.take() {
                let ack = self.request(ReplicaAckRequest {
                    follower: self.name(),
                    replication_id: id,
                    lsn,
                });
                let out = rt.block_on(stub.replica_ack(ack));
                self.lock().last_ack_end = Some(Instant::now());
                out.map_err(remote)?;
            }
            let next = rt.block_on(async {
                tokio::select! {
                    m = tokio::time::timeout(Duration::from_secs(5), stream.message()) => Some(m),
                    () = self.wake.notified() => None,
                }
            });
            let Some(next) = next else {
                return Ok(());
            };
            let m = match next {
                Err(_) => {
                    return Err(storage(format!(
                        "the primary {} sent nothing for 5 s",
                        self.primary
                    )))
                }
                Ok(Err(e)) => return Err(remote(e)),
                Ok(Ok(None)) => return Err(storage("the primary closed the stream")),
                Ok(Ok(Some(m))) => m,
            };
            let mut batch = vec![m];
            // What else has arrived goes into the same commit.
            while batch.len() < 64 {
                use futures::FutureExt;
                match stream.message().now_or_never() {
                    Some(Ok(Some(m))) => batch.push(m),
                    Some(Err(e)) => return Err(remote(e)),
                    _ => break,
                }
            }
            to_ack = self.apply(batch)?;
        }
    }

    /// Applies messages in order; commits what they changed and records the LSN reached.
    /// What to ack (the primary's id and the LSN held): after entries, and after a heartbeat
    /// (so that a follower that is caught up while nothing commits is known to be).
    ///
    /// Entries of rows (no resync, no held or job state) are made durable in the follower's
    /// log before they are applied, and reach LMDB at the next checkpoint (0126); any other
    /// batch is committed to LMDB at once, with what the log held.
    fn apply(&self, batch: Vec<ReplicateMessage>) -> Result<Option<(u64, u64)>> {
        let logged = !self.lock().resyncing
            && batch
                .iter()
                .all(|m| !m.resync_start && !m.resync_done && m.held.is_none() && m.job.is_empty());
        if logged
            && batch
                .iter()
                .any(|m| !m.tables.is_empty() || !m.dropped.is_empty())
        {
            self.log_append(&batch)?;
        }
        let mut reached = None;
        let mut beat = false;
        for m in batch {
            {
                let mut s = self.lock();
                s.heard = Some(Instant::now());
                s.primary_lsn = s.primary_lsn.max(m.primary_lsn);
                s.primary_epoch = s.primary_epoch.max(m.epoch);
                if !m.members.is_empty() {
                    let me = self.name();
                    s.siblings = m.members.iter().filter(|n| **n != me).cloned().collect();
                }
            }
            if m.resync_start {
                self.record(0, 0)?;
                // The log's entries are of the copy the resync replaces.
                self.reset_log()?;
                {
                    let mut s = self.lock();
                    s.resyncing = true;
                    s.primary_id = 0;
                    s.lsn = 0;
                    s.resyncs += 1;
                }
                for name in self.store.tables() {
                    drop_quietly(&self.store, &name)?;
                }
            }
            for name in &m.dropped {
                drop_quietly(&self.store, name)?;
            }
            for t in &m.tables {
                apply_table(&self.store, t)?;
            }
            if let Some(h) = m.held {
                match self.held.get() {
                    Some(link) => link.install(h)?,
                    None => return Err(Error::Internal("the follower has no held state".into())),
                }
            }
            if !m.job.is_empty() {
                let records: Vec<Vec<u8>> = m.job.iter().map(|b| b.to_vec()).collect();
                match self.held.get() {
                    Some(link) => link.install_job(&records)?,
                    None => return Err(Error::Internal("the follower has no job state".into())),
                }
            }
            if m.resync_done || m.lsn > 0 {
                reached = Some((m.replication_id, m.lsn));
                if m.resync_done {
                    self.lock().resyncing = false;
                }
            } else if !m.resync_start
                && m.tables.is_empty()
                && m.dropped.is_empty()
                && m.job.is_empty()
            {
                beat = true;
            }
        }
        let Some((id, lsn)) = reached else {
            let mut s = self.lock();
            if s.resyncing || s.primary_id == 0 {
                return Ok(None);
            }
            if s.lsn >= s.primary_lsn {
                s.caught_up = Some(Instant::now());
            }
            let (id, lsn) = (s.primary_id, s.lsn);
            drop(s);
            if beat {
                // Idle: what the log holds goes to LMDB now.
                if self.log_lock().as_ref().is_some_and(|l| l.bytes() > 0) {
                    self.checkpoint(id, lsn)?;
                } else {
                    self.record_if_due(id, lsn, true)?;
                }
            }
            return Ok(beat.then_some((id, lsn)));
        };
        if logged {
            // The entries are in the synced log: the ack may go. Their rows reach LMDB at the
            // next checkpoint.
            if self.checkpoint_due() {
                self.checkpoint(id, lsn)?;
            }
        } else {
            self.store.flush()?;
            // The rows are committed: the ack may go. The LSN is recorded at most once a
            // second (and at once after a resync, and when idle or stopping): a restart from
            // an older record applies some entries again, which changes nothing. LMDB now
            // holds what the log held.
            self.record_if_due(id, lsn, false)?;
            self.reset_log()?;
        }
        let mut s = self.lock();
        s.primary_id = id;
        s.lsn = lsn;
        s.exact = true;
        if s.lsn >= s.primary_lsn {
            s.caught_up = Some(Instant::now());
        }
        Ok(Some((id, lsn)))
    }

    /// Records `(primary_id, lsn)` unless it is recorded, or was recorded within a second
    /// for the same primary (`now`: whenever it differs).
    fn record_if_due(&self, primary_id: u64, lsn: u64, now: bool) -> Result<()> {
        let due = {
            let s = self.lock();
            s.recorded != (primary_id, lsn)
                && (now
                    || s.recorded.0 != primary_id
                    || s.recorded_at
                        .is_none_or(|t| t.elapsed() >= Duration::from_secs(1)))
        };
        if due {
            self.record(primary_id, lsn)?;
        }
        Ok(())
    }

    /// Records in the replica what the copy follows.
    fn record(&self, primary_id: u64, lsn: u64) -> Result<()> {
        write_followed(&self.store, primary_id, lsn)?;
        let mut s = self.lock();
        s.recorded = (primary_id, lsn);
        s.recorded_at = Some(Instant::now());
        Ok(())
    }
}

/// Applies what a follower's log left in `store`'s directory (a follower that crashed, or
/// failed to commit it when it stopped), commits it to LMDB with the position it reached, and
/// removes the log (0126). Called before a follower or a server starts on the store.
pub fn settle_follow_log(store: &Store) -> Result<()> {
    let Some(dir) = store.path() else {
        return Ok(());
    };
    let path = follow_log::path_in(dir);
    if !path.exists() {
        return Ok(());
    }
    let (entries, torn) = follow_log::read(&path)?;
    let mut last = None;
    let n = entries.len();
    for m in &entries {
        for name in &m.dropped {
            drop_quietly(store, name)?;
        }
        for t in &m.tables {
            apply_table(store, t)?;
        }
        if m.lsn > 0 {
            last = Some((m.replication_id, m.lsn));
        }
    }
    store.flush()?;
    if let Some((primary_id, lsn)) = last {
        write_followed(store, primary_id, lsn)?;
        eprintln!(
            "pstore: applied the {n} entries of the follower's log left in {} (to LSN {lsn}{})",
            dir.display(),
            if torn > 0 {
                format!("; {torn} bytes of an entry never acknowledged dropped")
            } else {
                String::new()
            }
        );
    }
    std::fs::remove_file(&path).map_err(|e| {
        storage(format!(
            "removing the follower's log {}: {e}",
            path.display()
        ))
    })
}

/// Records in `store`'s replica what its copy follows: the primary's id and the LSN reached.
fn write_followed(store: &Store, primary_id: u64, lsn: u64) -> Result<()> {
    let f = store
        .flusher()
        .ok_or_else(|| storage("the follower's store is closed"))?;
    let v = serde_json::to_vec(&Followed { primary_id, lsn })
        .map_err(|e| Error::Internal(e.to_string()))?;
    f.storage().write(|w| w.put_meta(FOLLOW_KEY, &v))
}

fn drop_quietly(store: &Store, name: &str) -> Result<()> {
    match store.drop_table(name) {
        Ok(()) | Err(Error::UnknownTable(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Applies one table's part of an entry to `store`: rows as they are.
fn apply_table(store: &Store, t: &ReplicatedTable) -> Result<()> {
    if !t.record_json.is_empty() {
        let rec: TableRecord = serde_json::from_slice(&t.record_json)
            .map_err(|e| invalid(format!("the primary's record of table {:?}: {e}", t.name)))?;
        let same = match (store.table(&t.name), &rec) {
            (Ok(Table::Sparse(s)), TableRecord::Sparse { config, uid, .. }) => {
                s.config() == config && s.common().uid() == *uid
            }
            (Ok(Table::Dense(d)), TableRecord::Dense { config, uid, .. }) => {
                d.config() == config && d.common().uid() == *uid
            }
            (Err(Error::UnknownTable(_)), _) => {
                create(store, &t.name, &rec)?;
                true
            }
            (Err(e), _) => return Err(e),
            _ => false,
        };
        if !same {
            drop_quietly(store, &t.name)?;
            create(store, &t.name, &rec)?;
        }
        let table = store.table(&t.name)?;
        let h = table.handle();
        let (lr, seq) = match &rec {
            TableRecord::Sparse { lr, seq, .. } | TableRecord::Dense { lr, seq, .. } => (*lr, *seq),
        };
        h.common().lr.set(lr)?;
        h.common().set_uid(rec.uid());
        crate::durable::restore_counters(h, rec.counters());
        if let Table::Sparse(s) = &table {
            s.set_seq(s.seq().max(seq));
        }
    }
    let table = store.table(&t.name)?;
    match &table {
        Table::Sparse(s) => {
            if !t.ids.is_empty() {
                let ids = wire::ids(&t.ids)?;
                let words = wire::words(&t.words)?;
                s.put_rows(&ids, &words)?;
            }
            if !t.gone.is_empty() {
                let gone = wire::ids(&t.gone)?;
                s.remove(&gone)?;
            }
        }
        Table::Dense(d) => {
            if !t.dense.is_empty() {
                let words = wire::words(&t.dense)?;
                d.set_words(&words)?;
            }
        }
    }
    if !t.applied.is_empty() {
        let a = &table.handle().common().applied;
        let n = store.flusher().map_or(1, |f| f.storage().environments());
        a.load(
            &vec![Some(t.applied.to_vec()); n],
            "the primary's applied request ids",
        )?;
        a.untake();
    }
    Ok(())
}

fn create(store: &Store, name: &str, rec: &TableRecord) -> Result<()> {
    match rec {
        TableRecord::Sparse { config, .. } => {
            store.create_sparse_table(name, config.clone()).map(|_| ())
        }
        TableRecord::Dense { config, .. } => {
            store.create_dense_table(name, config.clone()).map(|_| ())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::Durability;
    use crate::store::{DurableConfig, StoreConfig};
    use crate::table::SparseTableConfig;

    /// A sink that keeps every entry.
    #[derive(Default)]
    struct Keep(Mutex<Vec<CommitEntry>>, Mutex<Vec<u64>>);

    impl CommitSink for Keep {
        fn wanted(&self) -> bool {
            true
        }
        fn committed(&self, entry: CommitEntry) {
            self.0.lock().unwrap().push(entry);
        }
        fn skipped(&self, lsn: u64) {
            self.1.lock().unwrap().push(lsn);
        }
    }

    fn durable(dir: &std::path::Path) -> Arc<Store> {
        let mut d = DurableConfig::new(dir);
        d.durability = Durability::Sync;
        Arc::new(Store::open(StoreConfig::default(), d).unwrap())
    }

    fn config() -> SparseTableConfig {
        SparseTableConfig {
            dim: 4,
            optimizer: crate::OptimizerConfig {
                lr: 0.1,
                kind: crate::OptimizerKind::Adagrad {
                    initial_accumulator_value: 0.1,
                    eps: 1e-10,
                    weight_decay: 0.0,
                },
                ..Default::default()
            },
            initializer: crate::init::Initializer::Zeros,
            seed: 1,
            lifecycle: Default::default(),
            refuse_nonfinite: false,
        }
    }

    #[test]
    fn writes_need_the_lease_of_every_live_follower_and_wait_for_suspects() {
        let root = std::env::temp_dir().join(format!("pstore-lease-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = durable(&root);
        let config = ReplConfig {
            lease: Duration::from_millis(100),
            ack_timeout: Duration::from_millis(300),
            ..ReplConfig::default()
        };
        let p = Primary::start(Arc::clone(&store), config, 1).unwrap();
        // No follower: a group of one writes freely.
        assert_eq!(p.admit(), Ok(true));
        p.connect("f");
        // Connected, not live yet (it has not acked the newest entry): not in the lease.
        assert_eq!(p.admit(), Ok(true));
        p.ack("f", p.id, 0).unwrap();
        assert_eq!(p.live_names(), vec!["f".to_string()]);
        assert_eq!(p.admit(), Ok(true));
        // Silent past the lease: writes wait; an ack renews it.
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(p.admit(), Ok(false));
        p.ack("f", p.id, 0).unwrap();
        assert_eq!(p.admit(), Ok(true));
        // Silent past the ack timeout: it leaves the live set as a suspect; writes wait until
        // the group asked it.
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(p.admit(), Ok(false));
        assert_eq!(p.suspects(), vec!["f".to_string()]);
        assert!(p.live_names().is_empty());
        p.clear_suspect("f");
        assert_eq!(p.admit(), Ok(true));
        // Members recorded before a restart are suspects too; a newer epoch fences for good.
        p.suspect(&["g".to_string()]);
        assert_eq!(p.admit(), Ok(false));
        p.fence("epoch 2 has another primary".into());
        assert_eq!(p.admit(), Err("epoch 2 has another primary".into()));
        assert!(p.wait_admit().is_err());
        drop((p, store));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn entries_applied_in_order_give_the_same_rows_and_applying_twice_changes_nothing() {
        let root = std::env::temp_dir().join(format!("pstore-repl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let a = durable(&root.join("a"));
        let keep = Arc::new(Keep::default());
        a.flusher()
            .unwrap()
            .set_commit_sink(Some(Arc::clone(&keep) as Arc<dyn CommitSink>));
        let t = a.create_sparse_table("t", config()).unwrap();
        let ids: Vec<u64> = (0..300).collect();
        for step in 0..5u64 {
            let grads: Vec<f32> = (0..ids.len() * 4)
                .map(|i| ((i as u64 * 7 + step) % 13) as f32 - 6.0)
                .collect();
            t.push_validated_as(
                &ids[..100 + 40 * step as usize],
                &grads[..(100 + 40 * step as usize) * 4],
                1.0,
                Some((9, step + 1)),
            )
            .unwrap();
        }
        t.remove(&[3, 4, 5]).unwrap();
        a.flush().unwrap();
        let entries = keep.0.lock().unwrap().clone();
        assert!(keep.1.lock().unwrap().is_empty());
        // In cycle order, each number once, the first one carrying the table's creation.
        assert!(entries.windows(2).all(|w| w[0].lsn < w[1].lsn));
        assert!(entries[0].tables[0].record.is_some());
        let b = durable(&root.join("b"));
        for round in 0..2 {
            for e in &entries {
                let m = message_of(1, 1, e.clone());
                for name in &m.dropped {
                    drop_quietly(&b, name).unwrap();
                }
                for tc in &m.tables {
                    apply_table(&b, tc).unwrap();
                }
            }
            b.flush().unwrap();
            let u = b.sparse("t").unwrap();
            assert_eq!(u.len(), t.len(), "round {round}");
            assert_eq!(u.seq(), t.seq());
            let all: Vec<u64> = (0..300).collect();
            let (x, y) = (
                t.pull_existing(&all).unwrap(),
                u.pull_existing(&all).unwrap(),
            );
            assert_eq!(
                x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            assert!(!u.contains(&[3, 4, 5]).unwrap().iter().any(|&c| c));
            // The applied request ids came with the rows: a retry would be answered.
            assert!(u.was_applied(9, 5).unwrap().iter().all(|&d| d));
        }
        drop((a, b));
        let _ = std::fs::remove_dir_all(&root);
    }

    /// The held state of a test server: nothing.
    struct NoHeld;

    impl Held for NoHeld {
        fn state(&self) -> HeldState {
            HeldState::default()
        }
        fn install(&self, _state: HeldState) -> Result<()> {
            Ok(())
        }
    }

    type Rx = mpsc::Receiver<std::result::Result<ReplicateMessage, Status>>;

    fn follower(dir: &std::path::Path) -> Arc<Follower> {
        let config = ReplConfig {
            follow: Some("127.0.0.1:1".into()),
            ..ReplConfig::default()
        };
        let f = Follower::new(durable(dir), config).unwrap();
        f.held.set(Arc::new(NoHeld));
        f
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// The stream the primary serves `f` from its LSN (the follower's request).
    fn open(rt: &tokio::runtime::Runtime, p: &Arc<Primary>, f: &Follower) -> Rx {
        let (id, lsn, exact) = {
            let s = f.lock();
            (s.primary_id, s.lsn, s.exact)
        };
        let r = ReplicateRequest {
            follower: "f".into(),
            replication_id: id,
            from_lsn: lsn,
            exact,
        };
        let _in = rt.enter();
        p.serve(r).unwrap()
    }

    /// The next entry that arrives (heartbeats skipped).
    fn entry(rx: &mut Rx) -> ReplicateMessage {
        loop {
            let m = rx.blocking_recv().unwrap().unwrap();
            if m.lsn > 0 {
                return m;
            }
        }
    }

    /// Applies what arrives until the follower holds `lsn`; whether a resync began.
    fn pump(rx: &mut Rx, f: &Follower, lsn: u64) -> bool {
        let mut resynced = false;
        while f.lsn() != lsn || f.lock().resyncing {
            let m = rx.blocking_recv().unwrap().unwrap();
            resynced |= m.resync_start;
            f.apply(vec![m]).unwrap();
        }
        resynced
    }

    fn push(t: &Arc<crate::table::SparseTable>, ids: std::ops::Range<u64>, seq: u64) -> Result<()> {
        let ids: Vec<u64> = ids.collect();
        let grads: Vec<f32> = (0..ids.len() * 4).map(|i| (i % 7) as f32 - 3.0).collect();
        t.push_validated_as(&ids, &grads, 1.0, Some((9, seq)))
    }

    /// The follower's copy of `t` is the primary's, bit for bit.
    fn same(p: &Store, f: &Follower) {
        let (t, u) = (p.sparse("t").unwrap(), f.store.sparse("t").unwrap());
        assert_eq!(u.len(), t.len());
        let all: Vec<u64> = (0..400).collect();
        assert_eq!(t.contains(&all).unwrap(), u.contains(&all).unwrap());
        let have: Vec<u64> = all
            .iter()
            .copied()
            .filter(|&i| t.contains(&[i]).unwrap()[0])
            .collect();
        let (x, y) = (
            t.pull_existing(&have).unwrap(),
            u.pull_existing(&have).unwrap(),
        );
        assert_eq!(
            x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// A primary with a follower that holds its table at the newest LSN; the table.
    fn caught_up(
        rt: &tokio::runtime::Runtime,
        a: &Arc<Store>,
        f: &Follower,
    ) -> (Arc<Primary>, Arc<crate::table::SparseTable>, Rx) {
        let p = Primary::start(Arc::clone(a), ReplConfig::default(), 1).unwrap();
        let t = a.create_sparse_table("t", config()).unwrap();
        push(&t, 0..100, 1).unwrap();
        let mut rx = open(rt, &p, f);
        assert!(pump(&mut rx, f, p.last_lsn()));
        push(&t, 0..150, 2).unwrap();
        assert!(!pump(&mut rx, f, p.last_lsn()));
        p.ack("f", p.id, f.lsn()).unwrap();
        same(a, f);
        (p, t, rx)
    }

    #[test]
    fn an_entry_sent_before_a_commit_that_failed_is_retracted_and_its_follower_resyncs() {
        let root = std::env::temp_dir().join(format!("pstore-retract-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let rt = runtime();
        let a = durable(&root.join("a"));
        let f = follower(&root.join("b"));
        let (p, t, mut rx) = caught_up(&rt, &a, &f);
        let held = p.last_lsn();
        // The next commit fails ("the disk is full"), after the cycle's entry left and the
        // follower applied and acked it.
        let (go, wait) = std::sync::mpsc::channel();
        *a.flusher().unwrap().fail_next.lock().unwrap() = Some(wait);
        let pushing = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || push(&t, 100..300, 3))
        };
        let m = entry(&mut rx);
        let retracted = m.lsn;
        assert_eq!(retracted, held + 1);
        f.apply(vec![m]).unwrap();
        assert_eq!(f.store.sparse("t").unwrap().len(), 300);
        p.ack("f", p.id, retracted).unwrap();
        assert_eq!(p.lock().followers["f"].acked, retracted);
        go.send(()).unwrap();
        // The push fails; the primary's rows go back to its last commit; the ack stops
        // counting, and a late one too.
        assert!(pushing.join().unwrap().is_err());
        assert_eq!(t.len(), 150);
        assert_eq!(p.last_lsn(), held);
        assert_eq!(p.lock().followers["f"].acked, held);
        p.ack("f", p.id, retracted).unwrap();
        assert_eq!(p.lock().followers["f"].acked, held);
        // Its stream is cut; it comes back from the retracted LSN and resyncs (and would from
        // the LSN before it: that stream missed whatever else the entry carried).
        let cut = rx.blocking_recv().unwrap().unwrap_err();
        assert!(cut.message().contains("retracted"), "{cut:?}");
        assert!(!p.lock().resumable(retracted, true) && !p.lock().resumable(held, true));
        let mut rx = open(&rt, &p, &f);
        assert!(pump(&mut rx, &f, held));
        same(&a, &f);
        assert!(!f.store.sparse("t").unwrap().was_applied(9, 3).unwrap()[0]);
        // The failed cycle's number is not used again; the retry applies once, everywhere.
        push(&t, 100..300, 3).unwrap();
        assert!(p.last_lsn() > retracted);
        assert!(!pump(&mut rx, &f, p.last_lsn()));
        same(&a, &f);
        assert!(f.store.sparse("t").unwrap().was_applied(9, 3).unwrap()[0]);
        drop(rx);
        a.flusher().unwrap().set_commit_sink(None);
        rt.shutdown_background();
        drop((p, t, a, f));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_primary_restarted_numbers_past_an_entry_it_sent_and_never_committed() {
        lost_entry_then_restarts(false);
    }

    /// The follower restarts too (a power cut of both): its position comes back from its disk,
    /// recorded lazily at the primary's last commit, while its rows hold the lost entry. A
    /// resume from there would keep rows no push was acknowledged for: it resyncs.
    #[test]
    fn a_follower_restarted_on_a_lazily_recorded_position_resyncs_from_a_restarted_primary() {
        lost_entry_then_restarts(true);
    }

    fn lost_entry_then_restarts(follower_restarts: bool) {
        let root = std::env::temp_dir().join(format!(
            "pstore-renumber-{}-{follower_restarts}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let rt = runtime();
        let a = durable(&root.join("a"));
        let f = follower(&root.join("b"));
        let (p, t, mut rx) = caught_up(&rt, &a, &f);
        let (id, on_disk) = (p.id, p.last_lsn());
        // The cycle's entry leaves; its commit never happens (the process dies: here the commit
        // fails and the primary is gone before it could tell the follower).
        let (go, wait) = std::sync::mpsc::channel();
        *a.flusher().unwrap().fail_next.lock().unwrap() = Some(wait);
        let pushing = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || push(&t, 100..300, 3))
        };
        let lost = entry(&mut rx);
        assert_eq!(lost.lsn, on_disk + 1);
        f.apply(vec![lost]).unwrap();
        go.send(()).unwrap();
        assert!(pushing.join().unwrap().is_err());
        drop(rx);
        let f = if follower_restarts {
            // What its disk says: the primary's last commit (recorded at most once a second).
            f.record(id, on_disk).unwrap();
            let store = Arc::clone(&f.store);
            drop(f);
            let _ = store.close();
            drop(store);
            let f = follower(&root.join("b"));
            // Its log (0126) held the lost entry, which it had applied: it starts there, and
            // the position is not exact (read back from disk).
            assert_eq!((f.lsn(), f.lock().exact), (on_disk + 1, false));
            f
        } else {
            f
        };
        let fl = a.flusher().unwrap();
        fl.set_commit_sink(None);
        rt.shutdown_background();
        drop((p, t));
        // The process dies: nothing more is committed (the closing cycle fails too).
        let (go, wait) = std::sync::mpsc::channel::<()>();
        drop(go);
        *fl.fail_next.lock().unwrap() = Some(wait);
        drop(fl);
        let _ = a.close();
        drop(a);
        // The primary restarts on its disk.
        let rt = runtime();
        let a = durable(&root.join("a"));
        let p = Primary::start(Arc::clone(&a), ReplConfig::default(), 1).unwrap();
        assert_eq!((p.id, p.last_lsn()), (id, on_disk));
        let t = a.sparse("t").unwrap();
        assert_eq!(t.len(), 150);
        let rx = if follower_restarts {
            // It comes back at once, before the primary commits anything: its position, read
            // back from its disk, is the primary's last commit, which an exact position could
            // resume from; this one resyncs, and then follows the new push.
            assert!(!p.lock().resumable(on_disk, false));
            assert!(p.lock().resumable(on_disk, true));
            let mut rx = open(&rt, &p, &f);
            // The first message begins a resync (a resumed stream would send a heartbeat).
            let first = rx.blocking_recv().unwrap().unwrap();
            assert!(
                first.resync_start,
                "resumed from a position read back from disk"
            );
            f.apply(vec![first]).unwrap();
            while f.lock().resyncing {
                f.apply(vec![rx.blocking_recv().unwrap().unwrap()]).unwrap();
            }
            push(&t, 0..10, 4).unwrap();
            assert!(!pump(&mut rx, &f, p.last_lsn()));
            rx
        } else {
            // It commits a different push before the follower comes back: under another number
            // than the lost entry's. The follower, holding the lost entry, asks to resume from
            // its LSN: it resyncs.
            push(&t, 0..10, 4).unwrap();
            assert!(p.last_lsn() > on_disk + 1);
            assert_eq!(f.lsn(), on_disk + 1);
            assert!(!p.lock().resumable(on_disk + 1, true));
            let mut rx = open(&rt, &p, &f);
            assert!(pump(&mut rx, &f, p.last_lsn()));
            rx
        };
        same(&a, &f);
        assert!(!f.store.sparse("t").unwrap().was_applied(9, 3).unwrap()[0]);
        drop(rx);
        a.flusher().unwrap().set_commit_sink(None);
        rt.shutdown_background();
        drop((p, t, a, f));
        let _ = std::fs::remove_dir_all(&root);
    }
}
