//! A server's role in its replica group: the group epoch, promotion and fencing
//! (docs/CLUSTER.md, Failover; why this shape: docs/decisions/0100).
//!
//! **Epoch and role.** A durable server keeps `{epoch, role, primary, members, ...}` under the
//! meta key [`GROUP_KEY`]. A primary of epoch `e` stamps `e` on its log; its followers learn it.
//! `Promote` on a follower stops its pull, takes epoch `e + 1` (above anything it heard),
//! records it, and starts a primary's log under a fresh replication id.
//!
//! **Lease.** A primary accepts a write only while every live follower acked within the lease
//! (`ReplConfig::lease`, 2 s); a promoted follower accepts its first write only once the lease
//! it last renewed for its old primary has run out. A follower that leaves the old primary's
//! live set (its stream closed, or it stopped acking for the ack timeout), and every member
//! recorded before a restart, is a *suspect*: writes wait until this server asked it with
//! `Status`. One that answers as primary of a newer epoch fences this server: every write is
//! refused (FAILED_PRECONDITION, metadata `pstore-epoch` and `pstore-primary`), and the server
//! follows the new primary, whose full resync discards the commits it did not have (counted
//! and logged). One that cannot be reached is taken as down, and asked again every second
//! while it is not following this server.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tonic::Status;

use super::repl::{Follower, Primary, ReplConfig, ID_KEY};
use crate::error::{Error, Result};
use crate::net::proto::p_store_client::PStoreClient;
use crate::net::proto::{PromoteRequest, PromoteResponse, StatusRequest};
use crate::store::Store;

/// The meta key of a server's role in its replica group.
pub const GROUP_KEY: &str = "replication/group";
/// The metadata key of the group epoch a client knows (requests) or the server's (errors).
pub const EPOCH_KEY: &str = "pstore-epoch";
/// The metadata key naming the group's primary in a refusal.
pub const PRIMARY_KEY: &str = "pstore-primary";

/// What the replica keeps of the group.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct Record {
    epoch: u64,
    /// `"primary"` or `"follower"`.
    role: String,
    /// A follower's primary.
    #[serde(default)]
    primary: Option<String>,
    /// A primary's followers that have been live under this epoch; a follower's fellow
    /// followers, as its primary named them.
    #[serde(default)]
    members: Vec<String>,
    /// A promoted primary: what it was promoted from.
    #[serde(default)]
    promoted_from: Option<From>,
    /// A former primary that rejoined: the commits of its log the new primary did not have.
    #[serde(default)]
    dropped_commits: Option<u64>,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct From {
    primary: String,
    replication_id: String,
    lsn: u64,
}

struct State {
    record: Record,
    primary: Option<Arc<Primary>>,
    follower: Option<Arc<Follower>>,
    /// A promoted primary accepts writes from then on.
    writes_from: Option<Instant>,
}

/// A durable server's place in its replica group.
pub struct Group {
    store: Arc<Store>,
    config: ReplConfig,
    state: Mutex<State>,
    addr: Mutex<String>,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The server's held state (routing, ...), given to each primary and follower it runs.
    held: Mutex<Option<Arc<dyn super::repl::Held>>>,
    /// When the other members were last asked (a follower whose primary is silent asks its
    /// fellow followers; a primary asks the recorded members that are not following it).
    asked: Mutex<Option<Instant>>,
}

fn storage_of(store: &Store) -> Result<Arc<crate::storage::Storage>> {
    store
        .flusher()
        .map(|f| Arc::clone(f.storage()))
        .ok_or_else(|| crate::error::invalid("replication needs a durable store"))
}

/// A refusal naming the group's epoch and primary.
fn refusal(code: &'static str, message: String, epoch: u64, primary: Option<&str>) -> Status {
    let mut st = Status::failed_precondition(message);
    let md = st.metadata_mut();
    if let Ok(v) = epoch.to_string().parse() {
        md.insert(EPOCH_KEY, v);
    }
    if let Some(p) = primary.and_then(|p| p.parse().ok()) {
        md.insert(PRIMARY_KEY, p);
    }
    if let Ok(v) = code.parse() {
        md.insert(crate::net::ERROR_KIND, v);
    }
    st
}

/// What a write must do before it runs.
pub enum Admit {
    /// Go.
    Now,
    /// Wait on a blocking thread ([`Group::wait_write`]).
    Wait,
}

/// What a member answered.
enum Probe {
    /// A primary of a newer epoch, with what it was promoted from.
    Newer(u64, Option<From>),
    /// Reachable and no primary of a newer epoch.
    NotNewer,
    /// Not reachable: taken as down.
    Down,
}

impl Group {
    /// The role `store` (durable) takes: a follower of `config.follow`, a follower of the
    /// primary it rejoined, or a primary whose recorded members are suspects until asked.
    pub fn open(store: Arc<Store>, config: ReplConfig) -> Result<Arc<Self>> {
        let st = storage_of(&store)?;
        // Entries a follower acked and had not committed to LMDB when it ended, whatever role
        // the store takes now.
        super::repl::settle_follow_log(&store)?;
        let mut record: Record = st
            .read(|r| r.meta(GROUP_KEY))?
            .and_then(|v| serde_json::from_slice(&v).ok())
            .unwrap_or_default();
        record.epoch = record.epoch.max(1);
        // A server promoted once (primary of an epoch past the first) keeps that role when it
        // is started again with the `--follow` it was first started with (a StatefulSet's
        // fixed arguments): the primary it names becomes a suspect, asked before any write,
        // and this server follows it only if it answers as primary of a newer epoch.
        let keeps_primary = record.role == "primary" && record.epoch > 1;
        if keeps_primary {
            if let Some(p) = &config.follow {
                eprintln!(
                    "pstore: this server is the primary of group epoch {} (promoted): it stays \
                     primary and asks {p} (--follow) before it writes; it follows {p} only if \
                     that is the primary of a newer epoch",
                    record.epoch
                );
                if !record.members.contains(p) {
                    record.members.push(p.clone());
                }
            }
        }
        let follow = if keeps_primary {
            None
        } else {
            config
                .follow
                .clone()
                .or_else(|| (record.role == "follower").then(|| record.primary.clone())?)
        };
        let (primary, follower) = match follow {
            Some(p) => {
                if config.follow.is_none() {
                    eprintln!(
                        "pstore: this server rejoined its group as a follower of {p} (epoch {}): \
                         it follows it again (start it with --follow to name another)",
                        record.epoch
                    );
                }
                let mut c = config.clone();
                c.follow = Some(p.clone());
                record.role = "follower".into();
                record.primary = Some(p);
                (None, Some(Follower::new(Arc::clone(&store), c)?))
            }
            None => {
                // The members the cluster file names are asked too: a primary killed before it
                // recorded a follower still learns, after a restart, that it was promoted.
                for m in &config.members {
                    if *m != config.name && !record.members.contains(m) {
                        record.members.push(m.clone());
                    }
                }
                record.role = "primary".into();
                record.primary = None;
                let p = Primary::start(Arc::clone(&store), config.clone(), record.epoch)?;
                p.suspect(&record.members);
                (Some(p), None)
            }
        };
        let g = Arc::new(Self {
            store,
            config,
            state: Mutex::new(State {
                record,
                primary,
                follower,
                writes_from: None,
            }),
            addr: Mutex::new(String::new()),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            held: Mutex::new(None),
            asked: Mutex::new(None),
        });
        g.save()?;
        Ok(g)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save(&self) -> Result<()> {
        let v =
            serde_json::to_vec(&self.lock().record).map_err(|e| Error::Internal(e.to_string()))?;
        storage_of(&self.store)?.write(|w| w.put_meta(GROUP_KEY, &v))
    }

    /// Gives the server's held state to the primary or follower it runs, now and after a
    /// promotion or a step down (before [`Group::spawn`]).
    pub fn attach(&self, h: Arc<dyn super::repl::Held>) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&h));
        let s = self.lock();
        if let Some(p) = &s.primary {
            p.held.set(Arc::clone(&h));
        }
        if let Some(f) = &s.follower {
            h.following();
            f.held.set(h);
        }
    }

    fn attach_held(&self, p: Option<&Primary>, f: Option<&Follower>) {
        if let Some(h) = self.held.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            if let Some(p) = p {
                p.held.set(Arc::clone(&h));
            }
            if let Some(f) = f {
                h.following();
                f.held.set(h);
            }
        }
    }

    /// Tells the server's held state that this server was promoted (it loads its job).
    fn promoted(&self) -> Result<()> {
        let h = self.held.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match h {
            Some(h) => h.promoted(),
            None => Ok(()),
        }
    }

    /// The primary's log, while this server is primary.
    pub fn primary(&self) -> Option<Arc<Primary>> {
        self.lock().primary.clone()
    }

    /// The link to the primary, while this server is a follower.
    pub fn follower(&self) -> Option<Arc<Follower>> {
        self.lock().follower.clone()
    }

    /// The group epoch this server knows.
    pub fn epoch(&self) -> u64 {
        let s = self.lock();
        let heard = s.follower.as_ref().map_or(0, |f| f.primary_epoch());
        s.record.epoch.max(heard)
    }

    /// Starts the follower's pull (if a follower) and the thread that asks suspects; `addr`
    /// is this server's address.
    pub fn spawn(self: &Arc<Self>, addr: &str) -> Result<()> {
        *self.addr.lock().unwrap_or_else(|e| e.into_inner()) = addr.to_string();
        if let Some(f) = self.follower() {
            f.spawn(addr)?;
        }
        let me = Arc::clone(self);
        let h = std::thread::Builder::new()
            .name("pstore-group".into())
            .spawn(move || me.run())
            .map_err(|e| Error::Internal(format!("starting the group thread: {e}")))?;
        *self.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(())
    }

    /// Stops the threads (the follower's pull first).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(f) = self.follower() {
            f.stop();
        }
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// Checks a write (`method`) from a client that knows group epoch `known` (0: none).
    pub fn check_write(&self, method: &str, known: u64) -> std::result::Result<Admit, Status> {
        let s = self.lock();
        let epoch = s.record.epoch;
        if let Some(f) = &s.follower {
            let e = epoch.max(f.primary_epoch());
            return Err(refusal(
                "not_primary",
                format!(
                    "this server is a follower of {} (group epoch {e}): {method} goes to the \
                     primary",
                    f.primary
                ),
                e,
                Some(&f.primary),
            ));
        }
        let Some(p) = &s.primary else {
            return Ok(Admit::Now);
        };
        if known > epoch {
            return Err(refusal(
                "stale_epoch",
                format!(
                    "this server is primary of group epoch {epoch}, the client knows epoch \
                     {known}: another server is primary now"
                ),
                epoch,
                None,
            ));
        }
        if s.writes_from.is_some_and(|t| Instant::now() < t) {
            return Ok(Admit::Wait);
        }
        match p.admit() {
            Ok(true) => Ok(Admit::Now),
            Ok(false) => Ok(Admit::Wait),
            Err(m) => Err(refusal(
                "stale_epoch",
                m,
                epoch,
                s.record.primary.as_deref(),
            )),
        }
    }

    /// Waits (blocking) until a write may go, or refuses it.
    pub fn wait_write(&self, method: &str, known: u64) -> std::result::Result<(), Status> {
        let (from, p) = {
            let s = self.lock();
            (s.writes_from, s.primary.clone())
        };
        if let Some(t) = from {
            let now = Instant::now();
            if now < t {
                std::thread::sleep(t - now);
            }
        }
        if let Some(p) = p {
            if let Err(m) = p.wait_admit() {
                // Fenced meanwhile, or still no lease: the state says which.
                self.check_write(method, known)?;
                return Err(Status::unavailable(m));
            }
        }
        match self.check_write(method, known)? {
            Admit::Now => Ok(()),
            Admit::Wait => Err(Status::unavailable(
                "this primary has no write lease yet: retry",
            )),
        }
    }

    /// Makes this follower the primary of its group under the next epoch.
    pub fn promote(&self, r: &PromoteRequest) -> std::result::Result<PromoteResponse, Status> {
        let f = {
            let s = self.lock();
            match (&s.follower, &s.primary) {
                (Some(f), _) => Arc::clone(f),
                (None, Some(_)) => {
                    return Err(refusal(
                        "already_primary",
                        format!(
                            "this server is already the primary of its group (epoch {}): \
                             promote one of its followers",
                            s.record.epoch
                        ),
                        s.record.epoch,
                        None,
                    ))
                }
                (None, None) => {
                    return Err(Status::failed_precondition(
                        "this server is in no replica group (an in-memory server)",
                    ))
                }
            }
        };
        if !r.expected_primary.is_empty() && r.expected_primary != f.primary {
            return Err(refusal(
                "other_group",
                format!(
                    "this server follows {}, not {}: it is a follower of another group",
                    f.primary, r.expected_primary
                ),
                self.epoch(),
                Some(&f.primary),
            ));
        }
        let (id, lsn, heard, lease_end) = f
            .promotable(r.force)
            .map_err(|m| refusal("not_in_sync", m, self.epoch(), Some(&f.primary)))?;
        f.stop();
        let old = f.primary.clone();
        let start = || -> Result<(u64, Arc<Primary>)> {
            let st = storage_of(&self.store)?;
            // What the follower's log held is in LMDB before it writes as primary.
            super::repl::settle_follow_log(&self.store)?;
            let epoch = self.lock().record.epoch.max(heard) + 1;
            // A fresh replication id: no follower resumes from this server's log of before.
            st.write(|w| w.delete_meta(ID_KEY))?;
            {
                let mut s = self.lock();
                s.record = Record {
                    epoch,
                    role: "primary".into(),
                    primary: None,
                    members: vec![old.clone()],
                    promoted_from: Some(From {
                        primary: old.clone(),
                        replication_id: format!("{id:016x}"),
                        lsn,
                    }),
                    dropped_commits: None,
                };
            }
            self.save()?;
            let p = Primary::start(Arc::clone(&self.store), self.config.clone(), epoch)?;
            self.attach_held(Some(&p), None);
            // The job this follower kept of its primary's, loaded before any write is admitted.
            self.promoted()?;
            Ok((epoch, p))
        };
        let (epoch, p) = start().map_err(|e| crate::net::status_of(&e))?;
        {
            let mut s = self.lock();
            s.follower = None;
            s.primary = Some(p);
            s.writes_from = Some(lease_end);
        }
        let wait = lease_end.saturating_duration_since(Instant::now());
        eprintln!(
            "pstore: promoted to primary of group epoch {epoch} (was following {old} at its LSN \
             {lsn}); writes are accepted in {:.2} s",
            wait.as_secs_f64()
        );
        Ok(PromoteResponse {
            epoch,
            from_replication_id: id,
            from_lsn: lsn,
            writes_in_seconds: wait.as_secs_f64(),
        })
    }

    /// The group fields of the status (`epoch`, and what a promotion or rejoin left).
    pub fn status_json(&self, role: serde_json::Value) -> serde_json::Value {
        let mut v = role;
        let s = self.lock();
        let heard = s.follower.as_ref().map_or(0, |f| f.primary_epoch());
        if let Some(o) = v.as_object_mut() {
            o.insert("epoch".into(), s.record.epoch.max(heard).into());
            if let Some(p) = &s.record.promoted_from {
                o.insert(
                    "promoted_from".into(),
                    serde_json::json!({"primary": p.primary, "replication_id": p.replication_id, "lsn": p.lsn}),
                );
            }
            if let Some(n) = s.record.dropped_commits {
                o.insert("dropped_commits".into(), n.into());
            }
            if let Some(p) = &s.primary {
                o.insert("suspects".into(), p.suspects().into());
                let wait = s.writes_from.map_or(0.0, |t| {
                    t.saturating_duration_since(Instant::now()).as_secs_f64()
                });
                o.insert("writes_in_seconds".into(), wait.into());
            }
        }
        v
    }

    fn run(self: Arc<Self>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("pstore: the group thread cannot start its runtime: {e}");
                return;
            }
        };
        while !self.stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(50));
            if let Err(e) = self.tick(&rt) {
                eprintln!("pstore: replica group: {e}");
            }
        }
    }

    /// Records new members, keeps a follower's epoch, asks suspects.
    fn tick(&self, rt: &tokio::runtime::Runtime) -> Result<()> {
        let (p, f) = {
            let s = self.lock();
            (s.primary.clone(), s.follower.clone())
        };
        if let Some(f) = f {
            let heard = f.primary_epoch();
            let siblings = f.siblings();
            let (changed, members) = {
                let mut s = self.lock();
                let mut c = heard > s.record.epoch;
                if c {
                    s.record.epoch = heard;
                }
                if !siblings.is_empty() && siblings != s.record.members {
                    s.record.members = siblings;
                    c = true;
                }
                (c, s.record.members.clone())
            };
            if changed {
                self.save()?;
            }
            // The primary is silent: was one of the other followers promoted? Then follow it
            // (a third member of a group does not stay with a dead primary).
            if f.silent_for() >= self.config.ack_timeout && !members.is_empty() && self.due() {
                for name in members {
                    if let Probe::Newer(epoch, _) = self.probe(rt, &name) {
                        return self.follow_newer(&f, &name, epoch);
                    }
                }
            }
            return Ok(());
        }
        let Some(p) = p else { return Ok(()) };
        let live = p.live_names();
        let added = {
            let mut s = self.lock();
            let mut added = false;
            for n in live {
                if !s.record.members.contains(&n) {
                    s.record.members.push(n);
                    added = true;
                }
            }
            added
        };
        if added {
            self.save()?;
        }
        let suspects = p.suspects();
        for name in &suspects {
            match self.probe(rt, name) {
                Probe::Newer(epoch, from) => {
                    self.step_down(&p, name, epoch, from)?;
                    return Ok(());
                }
                Probe::NotNewer | Probe::Down => p.clear_suspect(name),
            }
        }
        // A recorded member that is not following this server (down when asked, or gone
        // since) is asked again every second: one that was slow to answer, or comes back as
        // the primary of a newer epoch, fences this server then instead of never.
        let absent: Vec<String> = {
            let live = p.live_names();
            let s = self.lock();
            s.record
                .members
                .iter()
                .filter(|m| !live.contains(m) && !suspects.contains(m))
                .cloned()
                .collect()
        };
        if !absent.is_empty() && self.due() {
            for name in &absent {
                if let Probe::Newer(epoch, from) = self.probe(rt, name) {
                    return self.step_down(&p, name, epoch, from);
                }
            }
        }
        Ok(())
    }

    /// Whether a second passed since the members were last asked (and marks them asked).
    fn due(&self) -> bool {
        let mut a = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        let due = a.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due {
            *a = Some(Instant::now());
        }
        due
    }

    /// Asks `name` for its role and epoch.
    fn probe(&self, rt: &tokio::runtime::Runtime, name: &str) -> Probe {
        let ask = async {
            let ep = tonic::transport::Endpoint::from_shared(format!("http://{name}"))
                .ok()?
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(1));
            let ch = ep.connect().await.ok()?;
            let mut req = tonic::Request::new(StatusRequest {});
            if let Some(t) = &self.config.token {
                if let Ok(v) = format!("Bearer {t}").parse() {
                    req.metadata_mut().insert("authorization", v);
                }
            }
            PStoreClient::new(ch)
                .status(req)
                .await
                .ok()
                .map(|r| r.into_inner())
        };
        let answer = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), ask)
                .await
                .ok()
                .flatten()
        });
        let Some(st) = answer else {
            return Probe::Down;
        };
        let mine = self.lock().record.epoch;
        let v: serde_json::Value =
            serde_json::from_str(&st.replication_json).unwrap_or(serde_json::Value::Null);
        let epoch = v["epoch"].as_u64().unwrap_or(0);
        if v["role"] == "primary" && epoch > mine {
            let from = serde_json::from_value(v["promoted_from"].clone()).ok();
            Probe::Newer(epoch, from)
        } else {
            Probe::NotNewer
        }
    }

    /// This follower's primary is silent and `primary` is the primary of the newer group
    /// `epoch`: follow it (a full resync: its log has another replication id).
    fn follow_newer(&self, f: &Arc<Follower>, primary: &str, epoch: u64) -> Result<()> {
        eprintln!(
            "pstore: {} is silent and {primary} is primary of group epoch {epoch}: this follower \
             follows it now (a full resync)",
            f.primary
        );
        f.stop();
        let mut c = self.config.clone();
        c.follow = Some(primary.to_string());
        let nf = Follower::new(Arc::clone(&self.store), c)?;
        self.attach_held(None, Some(&nf));
        {
            let mut s = self.lock();
            s.record.epoch = epoch;
            s.record.role = "follower".into();
            s.record.primary = Some(primary.to_string());
            s.record.members.retain(|m| m != primary);
            s.follower = Some(Arc::clone(&nf));
        }
        self.save()?;
        let addr = self.addr.lock().unwrap_or_else(|e| e.into_inner()).clone();
        nf.spawn(&addr)
    }

    /// A newer epoch has `primary`: refuse writes from now on, and follow it.
    fn step_down(
        &self,
        p: &Arc<Primary>,
        primary: &str,
        epoch: u64,
        from: Option<From>,
    ) -> Result<()> {
        p.fence(format!(
            "group epoch {epoch} has another primary, {primary}: this server (epoch {}) \
             accepts no write and follows it",
            p.epoch
        ));
        let last = p.last_lsn();
        let dropped = from
            .as_ref()
            .filter(|f| f.replication_id == format!("{:016x}", p.id))
            .map(|f| last.saturating_sub(f.lsn));
        match dropped {
            Some(n) => eprintln!(
                "pstore: stepping down: {primary} is primary of group epoch {epoch}; this server \
                 drops the {n} commit(s) of its log after LSN {} that it did not have, and \
                 follows it",
                from.as_ref().map_or(0, |f| f.lsn)
            ),
            None => eprintln!(
                "pstore: stepping down: {primary} is primary of group epoch {epoch}; this server \
                 follows it (a full resync replaces its rows)"
            ),
        }
        let mut c = self.config.clone();
        c.follow = Some(primary.to_string());
        let f = Follower::new(Arc::clone(&self.store), c)?;
        self.attach_held(None, Some(&f));
        {
            let mut s = self.lock();
            s.record = Record {
                epoch,
                role: "follower".into(),
                primary: Some(primary.to_string()),
                members: Vec::new(),
                promoted_from: None,
                dropped_commits: dropped,
            };
            s.primary = None;
            s.follower = Some(Arc::clone(&f));
            s.writes_from = None;
        }
        self.save()?;
        let addr = self.addr.lock().unwrap_or_else(|e| e.into_inner()).clone();
        f.spawn(&addr)
    }
}
