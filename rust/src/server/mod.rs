//! The store server: a store (in memory or durable) behind the gRPC service of
//! `proto/pstore/v1/pstore.proto`, with the standard health service, token authentication,
//! optional TLS, and Prometheus metrics.
//!
//! Each call is checked (token, then the request), then its work runs on tokio's blocking pool,
//! where the store's own thread pool spreads it over the cores; async clock waits stay on the
//! runtime. A request that fails changes nothing, and nothing a client sends can stop the server:
//! decoding errors, wrong lengths, NaN gradients, unknown tables all become error statuses.

pub mod bsp;
mod bulk;
pub mod conn;
pub mod fence;
mod follow_log;
mod held;
pub mod layout;
mod load;
pub mod metrics;
pub mod model;
mod moves;
pub mod repl;
pub mod routing;
pub mod rows;
pub mod state;
pub mod versions;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::error::{invalid, Error, Result};
use crate::net::proto::p_store_server::{PStore, PStoreServer};
use crate::net::proto::*;
use crate::net::{splice, status_of, token_eq, wire, DEFAULT_MAX_MESSAGE, PROTOCOL};
use crate::store::{Store, Table};
use crate::table::{DenseTableConfig, SparseTableConfig, TableStats};
use metrics::{Metrics, ReplicaSample, Sample, TableSample};
use state::{Clocks, Decision, Dedup, Policies, Policy};

/// Who may call what.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// May call everything.
    pub write: Option<Vec<u8>>,
    /// May call the read methods only.
    pub read: Option<Vec<u8>>,
}

/// How a server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The gRPC address (port 0: any free port).
    pub addr: SocketAddr,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// A token every scrape of the metrics must carry (`Authorization: Bearer`); none: open.
    pub metrics_token: Option<Vec<u8>>,
    /// Serve the metrics over HTTPS with the certificate of `tls` (which must be set).
    pub metrics_tls: bool,
    /// Tokens; with none set, every call is allowed.
    pub tokens: Tokens,
    /// PEM certificate chain and private key: serve TLS.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    /// The largest message accepted or sent.
    pub max_message: usize,
    /// Connection cap and handshake timeout of each port.
    pub limits: conn::Limits,
    /// Replication: a primary's log bounds, or the primary a follower follows.
    pub replication: repl::ReplConfig,
    /// A model server's rows port (`rows.rs`, port 0: any free port); store servers have none.
    pub rows_addr: Option<SocketAddr>,
}

impl ServerConfig {
    /// Serves on `addr` with no auth, no TLS and no metrics.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            metrics_addr: None,
            metrics_token: None,
            metrics_tls: false,
            tokens: Tokens::default(),
            tls: None,
            max_message: DEFAULT_MAX_MESSAGE,
            limits: conn::Limits::default(),
            replication: repl::ReplConfig::default(),
            rows_addr: None,
        }
    }
}

/// The HTTP/2 stream flow-control window of servers and clients.
pub const WINDOW: u32 = 64 << 20;

/// The largest HTTP/2 DATA frame a server or client accepts (each side's peer sends frames up
/// to it): big answers and pushes go in few frames, one write and one read each.
pub const MAX_FRAME: u32 = 1 << 20;

/// Where a call's work runs: the store's pool (short table work, in-memory stores) or tokio's
/// blocking pool (anything that may wait: snapshots, flushes, table creation, durable stores).
#[derive(Clone, Copy, PartialEq)]
enum On {
    Pool,
    /// On the runtime thread that received the call, for an in-memory store (no hand-off to
    /// the pool and back): short work that takes no lock a flusher holds. Else as `Pool`.
    Here,
    Blocking,
}

/// Pulls of up to this many ids are gathered on the runtime thread that received them, in an
/// in-memory store (the table gathers them on one thread anyway: see `PARALLEL_MIN_IDS` in
/// `table/sparse`).
const INLINE_PULL_IDS: usize = 1024;

#[derive(Clone, Copy, PartialEq)]
enum Access {
    Read,
    Write,
}

/// What the handlers share.
struct Inner {
    store: Arc<Store>,
    tokens: Tokens,
    metrics: Metrics,
    pushes: Dedup<PushResponse>,
    removes: Dedup<RemoveResponse>,
    clocks: Clocks,
    /// The synchronous steps of the current job (clocks, leases, pending aggregates).
    steps: Arc<bsp::Steps>,
    policies: Policies,
    started: Instant,
    max_message: usize,
    /// No replica: calls may run on the store's pool (see `run`).
    in_memory: bool,
    /// Calls being answered (a graceful stop waits for them).
    inflight: Arc<std::sync::atomic::AtomicUsize>,
    /// The server list this server's tables belong to.
    layout: layout::Layout,
    /// A durable server's role in its replica group: its log and followers, or its link to
    /// its primary.
    group: Option<Arc<fence::Group>>,
    /// The cluster's routing as this server holds it (`routing.rs`).
    routing: routing::Routes,
    /// Slots being moved away: their writes wait (`moves.rs`).
    frozen: moves::Frozen,
    /// The request ids moves copied here (`held.rs`).
    copied: held::Copied,
    /// The longest a freeze waits for a BSP job's step boundary ([`FREEZE_WAIT_ENV`]).
    freeze_wait: Duration,
    /// The rows port, 0 if none (`rows.rs`, decision 0128).
    rows_port: u32,
}

impl Inner {
    fn primary(&self) -> Option<Arc<repl::Primary>> {
        self.group.as_ref().and_then(|g| g.primary())
    }

    fn follower(&self) -> Option<Arc<repl::Follower>> {
        self.group.as_ref().and_then(|g| g.follower())
    }

    /// A write with `ack_all`: waits until every live follower holds it (`tagged`: a push
    /// counted in a job's step, whose record goes into the next entry of the log: that entry
    /// is committed first).
    fn ack_all(&self, tagged: bool) -> Result<()> {
        match &self.primary() {
            Some(p) => {
                if tagged {
                    if let Some(f) = self.store.flusher() {
                        f.flush()?;
                    }
                }
                p.wait_all()
            }
            None => Err(invalid(
                "ack_all needs a durable store server (one with a path and one environment)",
            )),
        }
    }

    fn replication_sample(&self) -> Option<metrics::ReplicationSample> {
        match (&self.primary(), &self.follower()) {
            (_, Some(f)) => {
                let (entries, seconds) = f.lag();
                Some(metrics::ReplicationSample {
                    follower: true,
                    lsn: f.lsn(),
                    lag_entries: entries,
                    lag_seconds: if seconds.is_finite() { seconds } else { -1.0 },
                    followers: 0,
                    live: 0,
                })
            }
            (Some(p), None) => {
                let (lag, live, connected, lsn) = p.sample();
                Some(metrics::ReplicationSample {
                    follower: false,
                    lsn,
                    lag_entries: lag,
                    lag_seconds: 0.0,
                    followers: connected,
                    live,
                })
            }
            (None, None) => None,
        }
    }

    fn replication_json(&self) -> String {
        let v = match (&self.primary(), &self.follower()) {
            (_, Some(f)) => f.status_json(),
            (Some(p), None) => p.status_json(),
            (None, None) => return String::new(),
        };
        match &self.group {
            Some(g) => g.status_json(v).to_string(),
            None => v.to_string(),
        }
    }

    fn sample(&self) -> Sample {
        let mut tables = Vec::new();
        for name in self.store.tables() {
            if let Ok(t) = self.store.table(&name) {
                let (kind, s) = stats_of(&t);
                tables.push(TableSample {
                    staleness: self.policies.stats(&name),
                    name,
                    kind,
                    rows: s.rows,
                    bytes: s.bytes_used,
                    pushes: versions::counted(t.handle()),
                    rows_nonfinite: s.rows_nonfinite,
                    pulls: s.pulls,
                    ids_pushed: s.ids_pushed,
                    ids_pulled: s.ids_pulled,
                });
            }
        }
        Sample {
            tables,
            replica: self.store.flusher().map(|f| ReplicaSample {
                lag: f.lag(),
                cycles: f.done_cycle(),
                interval: if f.mode() == crate::durable::Durability::Async {
                    f.current_interval()
                } else {
                    Duration::ZERO
                },
                failing: f.last_error().is_some(),
                file_bytes: f.storage().file_size(),
                idle_writes: f.idle_writes(),
                idle_lifts: f.idle_lifts(),
                superseded_writes: f.superseded_writes(),
            }),
            uptime: self.started.elapsed(),
            clocks: self.clocks().clocks,
            replication: self.replication_sample(),
        }
    }

    fn info(&self, name: &str, t: &Table) -> Result<TableInfo> {
        let (kind, s) = stats_of(t);
        let p = self.policies.get(name);
        let st = self.policies.stats(name);
        let stats = serde_json::json!({
            "rows": s.rows, "bytes_used": s.bytes_used, "huge_page_bytes": s.huge_page_bytes,
            "pushes": s.pushes, "pulls": s.pulls,
            "ids_pushed": s.ids_pushed, "ids_pulled": s.ids_pulled,
            "rows_updated": s.rows_updated, "rows_created": s.rows_created,
            "rows_evicted": s.rows_evicted, "rows_unloaded": s.rows_unloaded, "seq": s.seq,
            "rows_nonfinite": s.rows_nonfinite,
            "lr": s.lr, "staleness": st,
            "version": versions::get(t.handle()),
            "pushes_counted": versions::counted(t.handle()),
            "staleness_buckets": versions::BUCKET_BOUNDS,
        });
        let (config, dim, shape) = match t {
            Table::Sparse(t) => (
                serde_json::to_string(t.config()),
                t.dim() as u32,
                Vec::new(),
            ),
            Table::Dense(t) => (
                serde_json::to_string(t.config()),
                0,
                t.config().shape.iter().map(|&x| x as u64).collect(),
            ),
        };
        Ok(TableInfo {
            name: name.to_string(),
            kind: if kind == "sparse" {
                TableKind::Sparse
            } else {
                TableKind::Dense
            } as i32,
            config_json: config.map_err(|e| Error::Internal(e.to_string()))?,
            dim,
            shape,
            lr: s.lr,
            rows: s.rows,
            seq: s.seq,
            stale_policy: p.policy as i32,
            max_staleness: p.max_staleness,
            stats_json: stats.to_string(),
        })
    }

    /// Refuses an answer of `bytes` that would not fit in a message (with room for the rest of
    /// the message), before any work is done.
    fn fits(&self, bytes: usize, what: &str) -> Result<()> {
        fits(self.max_message, bytes, what)
    }

    /// The info of every table (a table dropped meanwhile is left out).
    fn infos(&self) -> Result<Vec<TableInfo>> {
        let mut tables = Vec::new();
        for name in self.store.tables() {
            if let Ok(t) = self.store.table(&name) {
                tables.push(self.info(&name, &t)?);
            }
        }
        Ok(tables)
    }

    fn clocks(&self) -> ClockResponse {
        let v = self.steps.view();
        if !v.job.is_empty() {
            return bsp::job_clocks(v);
        }
        let c = self.clocks.get();
        ClockResponse {
            min_clock: c.iter().min().copied().unwrap_or(0),
            max_clock: c.iter().max().copied().unwrap_or(0),
            clocks: c,
            ..Default::default()
        }
    }
}

/// Refuses a config whose JSON has keys the config does not know (a typo would otherwise fall
/// back to a default silently): every key of the given JSON must be in the config's own.
fn no_unknown_keys<C: serde::Serialize>(given: &str, parsed: &C) -> Result<()> {
    fn walk(g: &serde_json::Value, c: &serde_json::Value, path: &str, out: &mut Vec<String>) {
        if let (Some(g), Some(c)) = (g.as_object(), c.as_object()) {
            for (k, v) in g {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match c.get(k) {
                    Some(cv) => walk(v, cv, &p, out),
                    None => out.push(p),
                }
            }
        }
    }
    let g: serde_json::Value =
        serde_json::from_str(given).map_err(|e| invalid(format!("config_json: {e}")))?;
    let c = serde_json::to_value(parsed).map_err(|e| Error::Internal(e.to_string()))?;
    let mut unknown = Vec::new();
    walk(&g, &c, "", &mut unknown);
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(invalid(format!("config_json: unknown keys {unknown:?}")))
    }
}

fn stats_of(t: &Table) -> (&'static str, TableStats) {
    match t {
        Table::Sparse(t) => ("sparse", t.stats()),
        Table::Dense(t) => ("dense", t.stats()),
    }
}

fn request_id(r: &Option<RequestId>) -> Option<(u64, u64)> {
    r.as_ref().map(|r| (r.client, r.seq))
}

/// Refuses an answer of `bytes` that would not fit in a message of `max_message` bytes (with
/// room for the rest of the message), before any work is done.
fn fits(max_message: usize, bytes: usize, what: &str) -> Result<()> {
    let limit = max_message.saturating_sub(1024);
    if bytes > limit {
        return Err(invalid(format!(
            "the {what} answer would be {bytes} bytes, over this server's message limit of \
             {max_message} bytes: split the batch"
        )));
    }
    Ok(())
}

/// Moves a pull answer's rows out of the message, to be sent from their own buffer rather
/// than copied into tonic's (`net/splice.rs`).
fn splice_rows(mut resp: Response<PullResponse>) -> Response<PullResponse> {
    let rows = std::mem::take(&mut resp.get_mut().rows);
    resp.extensions_mut().insert(splice::SplicedRows(rows));
    resp
}

/// Runs a call's work on tokio's blocking pool.
async fn on_blocking<R: Send + 'static>(
    f: impl FnOnce() -> Result<R> + Send + 'static,
) -> std::result::Result<R, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(|e| status_of(&e)),
        Err(e) => Err(Status::internal(format!("the request's task failed: {e}"))),
    }
}

/// The longest a freeze waits for a BSP job's step boundary (under a client's call timeout),
/// unless [`FREEZE_WAIT_ENV`] says otherwise.
const FREEZE_WAIT: Duration = Duration::from_secs(20);

/// The environment variable that sets the longest a freeze waits for a step boundary, in
/// seconds (decision 0125): a shorter bound gives the moves of a job with long steps up sooner,
/// a longer one (at most [`MAX_FREEZE_WAIT`]) waits for them.
pub const FREEZE_WAIT_ENV: &str = "PSTORE_FREEZE_WAIT_SECONDS";

/// The longest bound [`FREEZE_WAIT_ENV`] may set: under the client's default call timeout (30 s)
/// with room for the freeze's own work.
const MAX_FREEZE_WAIT: Duration = Duration::from_secs(25);

/// The freeze's bound as `value` (of [`FREEZE_WAIT_ENV`], when set) gives it.
fn freeze_wait_of(value: Option<&str>) -> Result<Duration> {
    let Some(v) = value else {
        return Ok(FREEZE_WAIT);
    };
    let bad = || {
        invalid(format!(
            "{FREEZE_WAIT_ENV}={v:?}: give the seconds a slot freeze waits for a BSP step \
             boundary, a number above 0 and at most {} (default {})",
            MAX_FREEZE_WAIT.as_secs(),
            FREEZE_WAIT.as_secs()
        ))
    };
    let s: f64 = v.trim().parse().map_err(|_| bad())?;
    if !(s > 0.0 && s <= MAX_FREEZE_WAIT.as_secs_f64()) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(s))
}

/// Refuses a routing that gives away a slot whose move a promotion of this server
/// interrupted (decision 0125): the move's copy on the new owner may lack the writes this
/// server took since it thawed the slot; a move of the slot runs again instead.
fn refuse_interrupted(s: &Inner, r: &SetRoutingRequest) -> Result<()> {
    let gone = s.frozen.interrupted();
    let Some(routing) = r.routing.as_ref().filter(|_| !gone.is_empty()) else {
        return Ok(());
    };
    let Some(slots) = &routing.slots else {
        return Ok(());
    };
    let table = crate::net::routing::SlotTable::from_proto(slots)?;
    match gone
        .iter()
        .find(|&&k| table.owner_of_slot(k) != routing.index as usize)
    {
        Some(k) => Err(invalid(format!(
            "routing epoch {}: slot {k} (of {} slots) was frozen for a move when this server \
             was promoted to primary; it took writes since, which the move's copy lacks, so it \
             stays this server's at this routing: move the slots again (move_slots)",
            table.epoch(),
            gone.len()
        ))),
        None => Ok(()),
    }
}

/// Wakes a job's waiters when dropped (after a routing change).
struct Wake<'a>(&'a bsp::Steps);

impl Drop for Wake<'_> {
    fn drop(&mut self) {
        self.0.notify();
    }
}

/// The service.
#[derive(Clone)]
struct Service(Arc<Inner>);

/// What a request's token allows: `None` when the server has no tokens.
fn authenticate<T>(t: &Tokens, req: &Request<T>) -> std::result::Result<Option<Access>, Status> {
    if t.write.is_none() && t.read.is_none() {
        return Ok(None);
    }
    let given = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::as_bytes);
    check_token(t, given)
}

/// What `given` (a request's token, if it has one) allows: `None` when the server has no
/// tokens.
fn check_token(t: &Tokens, given: Option<&[u8]>) -> std::result::Result<Option<Access>, Status> {
    if t.write.is_none() && t.read.is_none() {
        return Ok(None);
    }
    let Some(given) = given else {
        return Err(Status::unauthenticated(
            "this server needs a token: metadata `authorization: Bearer <token>`",
        ));
    };
    // Both comparisons run whatever the first one says.
    let w = t.write.as_deref().is_some_and(|w| token_eq(given, w));
    let r = t.read.as_deref().is_some_and(|r| token_eq(given, r));
    match (w, r) {
        (true, _) => Ok(Some(Access::Write)),
        (false, true) => Ok(Some(Access::Read)),
        (false, false) => Err(Status::unauthenticated("wrong token")),
    }
}

impl Service {
    /// A follower refuses what would change its tables: they change only by its primary's log;
    /// a primary admits a write under its group epoch and write lease (`fence.rs`).
    async fn primary_only<T>(
        &self,
        method: &str,
        req: &Request<T>,
    ) -> std::result::Result<(), Status> {
        const WRITES: &[&str] = &[
            "CreateTable",
            "DropTable",
            "Push",
            "Remove",
            "Evict",
            "DensePush",
            "SetLr",
            "BulkLoad",
            "LoadSnapshot",
            "SetRouting",
            "FreezeSlots",
            "DropSlots",
            // A job's clock (`clock` asks only for those): it changes the job's state.
            "Clock",
        ];
        let Some(g) = &self.0.group else {
            return Ok(());
        };
        if !WRITES.contains(&method) {
            return Ok(());
        }
        let known = req
            .metadata()
            .get(fence::EPOCH_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        match g.check_write(method, known)? {
            fence::Admit::Now => Ok(()),
            fence::Admit::Wait => {
                let g = Arc::clone(g);
                let method = method.to_string();
                tokio::task::spawn_blocking(move || g.wait_write(&method, known))
                    .await
                    .map_err(|_| Status::internal("the write admission task failed"))?
            }
        }
    }

    /// The layout check, unless the per-id routing check replaces it (`routing.rs`).
    fn layout_check<T>(&self, req: &Request<T>) -> std::result::Result<(), Status> {
        if self.0.routing.replaces_layout(req) {
            return Ok(());
        }
        if self.0.follower().is_some() {
            // A follower holds its primary's layout (`held.rs`) and enforces it once promoted;
            // it changes nothing, so it answers reads for any list.
            return Ok(());
        }
        if self.0.layout.check(&self.0.store, req)? {
            // Taken just now: a primary's followers get it with the next entry.
            held::ship(&self.0, None, false).map_err(|e| status_of(&e))?;
        }
        Ok(())
    }

    fn check<T>(&self, req: &Request<T>, access: Access) -> std::result::Result<(), Status> {
        match (authenticate(&self.0.tokens, req)?, access) {
            (None | Some(Access::Write), _) | (Some(Access::Read), Access::Read) => Ok(()),
            (Some(Access::Read), Access::Write) => Err(Status::permission_denied(
                "a read-only token cannot change the store",
            )),
        }
    }

    /// The checks a call passes before its work runs: its token, the layout, the primary (a
    /// follower refuses what only a primary does), the routing.
    async fn admit<T: routing::Routed>(
        &self,
        method: &'static str,
        access: Access,
        req: &Request<T>,
    ) -> std::result::Result<(), Status> {
        self.check(req, access)?;
        if !matches!(method, "Status" | "GetRouting" | "SetRouting") {
            self.layout_check(req)?;
        }
        self.primary_only(method, req).await?;
        self.0.routing.check(req)
    }

    /// Whether a pull of `req` creates the rows it does not find: not for a read-only
    /// principal (unknown ids read as their initial value), nor on a follower (its rows are
    /// its primary's).
    fn pull_creates<T>(&self, req: &Request<T>) -> bool {
        !matches!(authenticate(&self.0.tokens, req), Ok(Some(Access::Read)))
            && self.0.follower().is_none()
    }

    /// Checks the call ([`admit`](Self::admit)), runs `f` where `on` says, and counts the
    /// call.
    async fn run<T, R>(
        &self,
        method: &'static str,
        access: Access,
        on: On,
        req: Request<T>,
        f: impl FnOnce(&Inner, T) -> Result<R> + Send + 'static,
    ) -> std::result::Result<Response<R>, Status>
    where
        T: routing::Routed + Send + 'static,
        R: Send + 'static,
    {
        let t0 = Instant::now();
        let _busy = Busy::new(&self.0.inflight);
        let out = match self.admit(method, access, &req).await {
            Err(s) => Err(s),
            Ok(()) => {
                let inner = Arc::clone(&self.0);
                let msg = req.into_inner();
                if on == On::Here && self.0.in_memory {
                    guarded(|| f(&inner, msg))
                } else if on != On::Blocking && self.0.in_memory {
                    // Straight onto the store's pool: one hand-off instead of two (runtime ->
                    // blocking thread -> pool). Only for an in-memory store: a durable store's
                    // flusher holds a table's change lock while it runs work on the same pool,
                    // so pool threads must never wait for that lock.
                    let (tx, rx) = oneshot::channel();
                    let store = Arc::clone(&self.0.store);
                    store.spawn(move || {
                        let _ = tx.send(guarded(|| f(&inner, msg)));
                    });
                    rx.await
                        .unwrap_or_else(|_| Err(Status::internal("the request's work was dropped")))
                } else {
                    on_blocking(move || f(&inner, msg)).await
                }
            }
        };
        let code = out.as_ref().err().map(|s| code_name(s.code()));
        self.0.metrics.observe(method, t0.elapsed(), code);
        out.map(Response::new)
    }
}

/// A pull's work, after its checks: its rows in the answer's own buffer, or, with `stream`
/// (a float32 pull on the rows port, decision 0133), into the stream's buffer a slice of
/// about the given bytes at a time, each slice a pull of its own, the answer's rows then left
/// empty. `create`: rows not found are created (else they read as their initial value).
fn pull_work(
    s: &Inner,
    r: PullRequest,
    create: bool,
    stream: Option<(&rows::Streamed, usize)>,
) -> Result<PullResponse> {
    let t = sparse(&s.store, &r.table)?;
    let d = wire::dtype(r.dtype)?;
    let ids = wire::ids(&r.ids)?;
    let dim = t.dim();
    // Refused before any row is created.
    s.fits(ids.len() * dim * wire::width(d), "pull")?;
    // Rows are created only on a slot this server still owns (see `moves`).
    let _pass = if create {
        Some(s.frozen.pass_owned(&r.table, &ids, &s.routing)?)
    } else {
        None
    };
    let seq = t.seq();
    let version = versions::get(&*t);
    let pull = |ids: &[u64], out: &mut [std::mem::MaybeUninit<f32>]| {
        if create {
            t.pull_into(ids, out)
        } else {
            t.pull_existing_into(ids, out)
        }
    };
    let rows = match (d, stream) {
        (Dtype::Float32, Some((st, slice_bytes))) => {
            let per = (slice_bytes / (dim * 4).max(1)).max(1);
            let out = st.begin(d as i32, dim as u32, version, ids.len() * dim);
            for (k, part) in ids.chunks(per).enumerate() {
                let at = k * per * dim;
                // SAFETY: `begin` made room for ids.len() * dim floats at `out`; this slice's
                // rows lie inside them, and nothing else reads or writes them until `advance`
                // passes them.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        out.add(at).cast::<std::mem::MaybeUninit<f32>>(),
                        part.len() * dim,
                    )
                };
                pull(part, dst)?;
                st.advance((at + part.len() * dim) * 4);
            }
            bytes::Bytes::new()
        }
        // Rows are written straight into the answer's buffer.
        (Dtype::Float32, _) => wire::fill_f32(ids.len() * dim, |out| pull(&ids, out))?,
        (_, _) if create => wire::encode_values(&t.pull(&ids)?, d),
        (_, _) => wire::encode_values(&t.pull_existing(&ids)?, d),
    };
    Ok(PullResponse {
        rows,
        dtype: d as i32,
        dim: dim as u32,
        seq,
        version,
    })
}

/// Runs a request's work here, its error or a panic as the call's status.
fn guarded<R>(f: impl FnOnce() -> Result<R>) -> std::result::Result<R, Status> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| status_of(&e)),
        Err(_) => Err(Status::internal("the request's work panicked")),
    }
}

/// Counts a call in flight while it lives.
struct Busy<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Busy<'a> {
    fn new(n: &'a std::sync::atomic::AtomicUsize) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(n)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

fn sparse(store: &Store, name: &str) -> Result<Arc<crate::SparseTable>> {
    store.sparse(name)
}

fn dense(store: &Store, name: &str) -> Result<Arc<crate::DenseTable>> {
    match store.table(name)? {
        Table::Dense(d) => Ok(d),
        Table::Sparse(_) => Err(Error::WrongKind(format!(
            "table {name:?} is sparse, not dense"
        ))),
    }
}

/// Writes this server's snapshot (a cluster snapshot's part) into `r.dir` now.
fn write_part(s: &Inner, r: SnapshotRequest) -> Result<SnapshotResponse> {
    if r.dir.is_empty() {
        return Err(invalid("snapshot needs a directory"));
    }
    // At a step boundary: no step is half applied, and pending steps are not in the rows.
    let info = s.steps.at_boundary(|| {
        // A directory on this server, or an object-store prefix it writes to itself.
        s.store
            .snapshot_to(&r.dir, r.incremental, &std::sync::atomic::AtomicU64::new(0))
    })?;
    let manifest_json =
        serde_json::to_string_pretty(&info.manifest).map_err(|e| Error::Internal(e.to_string()))?;
    Ok(SnapshotResponse {
        dir: r.dir,
        rows: info.manifest.tables.iter().map(|t| t.rows).sum(),
        manifest_json,
        ..Default::default()
    })
}

/// The answer to a push added to a pending step's aggregate.
fn bsp_accepted(seq: u64, version: u64) -> PushResponse {
    PushResponse {
        applied: true,
        staleness: 0,
        seq,
        version,
    }
}

fn staleness(seq_now: u64, pulled: Option<u64>) -> Option<u64> {
    pulled.map(|p| seq_now.saturating_sub(p))
}

/// What the table's replica says of a write's request id: `None` when it was applied in every
/// environment (answer it, apply nothing); otherwise which ids still have to be applied: all of
/// them, or (`Some(Some(keep))`) after a crash between the commits of several environments,
/// those of the environments that did not commit it.
#[allow(clippy::type_complexity)]
fn still_to_apply(
    store: &Store,
    done: Vec<bool>,
) -> Option<Option<Box<dyn Fn(u64) -> bool + Send + Sync>>> {
    if done.iter().all(|&d| d) {
        return None;
    }
    if !done.iter().any(|&d| d) {
        return Some(None);
    }
    // Sets that disagree come from a replica of several environments.
    match store.flusher() {
        Some(f) => {
            let st = Arc::clone(f.storage());
            Some(Some(Box::new(move |id| !done[st.environment_of(id)])))
        }
        None => Some(None),
    }
}

/// `ids` and their gradient rows (of `dim` values) for which `keep` holds.
fn keep_rows(
    ids: &[u64],
    grads: &[f32],
    dim: usize,
    keep: &dyn Fn(u64) -> bool,
) -> (Vec<u64>, Vec<f32>) {
    let (mut i, mut g) = (Vec::new(), Vec::new());
    for (k, &id) in ids.iter().enumerate() {
        if keep(id) {
            i.push(id);
            g.extend_from_slice(&grads[k * dim..(k + 1) * dim]);
        }
    }
    (i, g)
}

/// Sets the policy of a table just created, or checks a declaration of an existing table
/// against its policy (never changing it): `unset` keeps the existing one.
fn declare_policy(s: &Inner, name: &str, p: Policy, existed: bool, unset: bool) -> Result<()> {
    if !existed {
        return s.policies.set(name, p);
    }
    let have = s.policies.get(name);
    if unset || have == p {
        return Ok(());
    }
    let (field, a, b) = if have.policy != p.policy {
        (
            "stale_policy",
            format!("{:?}", have.policy.as_str_name().to_ascii_lowercase()),
            format!("{:?}", p.policy.as_str_name().to_ascii_lowercase()),
        )
    } else {
        (
            "max_staleness",
            have.max_staleness.to_string(),
            p.max_staleness.to_string(),
        )
    };
    Err(Error::TableMismatch(
        format!(
            "table {name:?} exists with {field} = {a}, this declaration gives {b}; declaring an \
         existing table never changes it (leave the policy unset to take the table's)"
        ),
        name.to_string(),
    ))
}

/// The error of a declaration whose config differs from the existing table's, naming the first
/// field that differs.
fn mismatch<C: serde::Serialize>(name: &str, have: &C, given: &C) -> Error {
    fn first_diff(a: &serde_json::Value, b: &serde_json::Value, path: &str) -> Option<String> {
        match (a.as_object(), b.as_object()) {
            (Some(x), Some(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                keys.into_iter().find_map(|k| {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    let n = serde_json::Value::Null;
                    first_diff(x.get(k).unwrap_or(&n), y.get(k).unwrap_or(&n), &p)
                })
            }
            _ if a != b => Some(format!("{path} = {a}, this declaration gives {b}")),
            _ => None,
        }
    }
    let a = serde_json::to_value(have).unwrap_or_default();
    let b = serde_json::to_value(given).unwrap_or_default();
    let what = first_diff(&a, &b, "").unwrap_or_else(|| "another config".to_string());
    Error::TableMismatch(
        format!("table {name:?} exists with {what}; declaring an existing table never changes it"),
        name.to_string(),
    )
}

fn policy_of(policy: i32, max_staleness: u64) -> Result<Policy> {
    let policy = StalePolicy::try_from(policy)
        .map_err(|_| invalid(format!("unknown stale policy {policy}")))?;
    Ok(Policy {
        policy,
        max_staleness,
    })
}

#[tonic::async_trait]
impl PStore for Service {
    async fn create_table(
        &self,
        req: Request<CreateTableRequest>,
    ) -> std::result::Result<Response<TableInfo>, Status> {
        self.run("CreateTable", Access::Write, On::Blocking, req, |s, r| {
            let policy = policy_of(r.stale_policy, r.max_staleness)?;
            let existed = s.store.table(&r.name).is_ok();
            let bad = |e: serde_json::Error| invalid(format!("config_json: {e}"));
            let t = match TableKind::try_from(r.kind) {
                Ok(TableKind::Sparse) => {
                    let c: SparseTableConfig = serde_json::from_str(&r.config_json).map_err(bad)?;
                    no_unknown_keys(&r.config_json, &c)?;
                    match s.store.create_sparse_table(&r.name, c.clone()) {
                        Ok(t) => Table::Sparse(t),
                        Err(Error::TableExists(_)) => match s.store.table(&r.name)? {
                            Table::Sparse(t) if *t.config() == c => Table::Sparse(t),
                            Table::Sparse(t) => return Err(mismatch(&r.name, t.config(), &c)),
                            _ => return Err(Error::TableExists(r.name)),
                        },
                        Err(e) => return Err(e),
                    }
                }
                Ok(TableKind::Dense) => {
                    let c: DenseTableConfig = serde_json::from_str(&r.config_json).map_err(bad)?;
                    no_unknown_keys(&r.config_json, &c)?;
                    c.validate()?;
                    s.fits(c.numel() * 4, "dense table's pull")?;
                    match s.store.create_dense_table(&r.name, c.clone()) {
                        Ok(t) => Table::Dense(t),
                        Err(Error::TableExists(_)) => match s.store.table(&r.name)? {
                            Table::Dense(t) if *t.config() == c => Table::Dense(t),
                            Table::Dense(t) => return Err(mismatch(&r.name, t.config(), &c)),
                            _ => return Err(Error::TableExists(r.name)),
                        },
                        Err(e) => return Err(e),
                    }
                }
                Err(_) => return Err(invalid(format!("unknown table kind {}", r.kind))),
            };
            declare_policy(s, &r.name, policy, existed, r.policy_unset)?;
            s.info(&r.name, &t)
        })
        .await
    }

    async fn get_table(
        &self,
        req: Request<GetTableRequest>,
    ) -> std::result::Result<Response<TableInfo>, Status> {
        self.run("GetTable", Access::Read, On::Pool, req, |s, r| {
            let t = s.store.table(&r.name)?;
            s.info(&r.name, &t)
        })
        .await
    }

    async fn list_tables(
        &self,
        req: Request<ListTablesRequest>,
    ) -> std::result::Result<Response<ListTablesResponse>, Status> {
        self.run("ListTables", Access::Read, On::Pool, req, |s, _| {
            Ok(ListTablesResponse { tables: s.infos()? })
        })
        .await
    }

    async fn drop_table(
        &self,
        req: Request<DropTableRequest>,
    ) -> std::result::Result<Response<DropTableResponse>, Status> {
        self.run("DropTable", Access::Write, On::Blocking, req, |s, r| {
            match s.store.drop_table(&r.name) {
                Ok(()) => {}
                // Dropping twice (a retry) is not an error.
                Err(Error::UnknownTable(_)) => return Ok(DropTableResponse { dropped: false }),
                Err(e) => return Err(e),
            }
            s.policies.remove(&r.name)?;
            Ok(DropTableResponse { dropped: true })
        })
        .await
    }

    async fn pull(
        &self,
        req: Request<PullRequest>,
    ) -> std::result::Result<Response<PullResponse>, Status> {
        let create = self.pull_creates(&req);
        let on = if req.get_ref().ids.len() <= INLINE_PULL_IDS * 8 {
            On::Here
        } else {
            On::Pool
        };
        self.run("Pull", Access::Read, on, req, move |s, r| {
            pull_work(s, r, create, None)
        })
        .await
        .map(splice_rows)
    }

    async fn push(
        &self,
        mut req: Request<PushRequest>,
    ) -> std::result::Result<Response<PushResponse>, Status> {
        // The gradients as the frames carried them, past tonic's buffer (`net/splice.rs`).
        if let Some(g) = req
            .extensions()
            .get::<splice::RowChunks>()
            .and_then(|c| c.take())
        {
            req.get_mut().grads = wire::join(g);
        }
        self.run("Push", Access::Write, On::Pool, req, |s, r| {
            let t = sparse(&s.store, &r.table)?;
            let d = wire::dtype(r.dtype)?;
            let ids = wire::ids(&r.ids)?;
            let grads = wire::values(&r.grads, d, ids.len() * t.dim(), "grads")?;
            t.validate_push(&ids, &grads)?;
            let rid = request_id(&r.request_id);
            let ack_all = r.ack_all;
            let _pass = s.frozen.pass_ids(&r.table, &ids, &s.routing)?;
            // Split from a part applied here, or on the server its rows moved from.
            if let Some(a) = r
                .split_from
                .iter()
                .find_map(|p| s.pushes.answered((p.client, p.seq)))
            {
                return Ok(a);
            }
            // Split from a part this server applied without answering it: a follower promoted
            // since got it from its old primary's log (the client, which could not reach the
            // group, split the part again by a routing that names this member; decision 0112).
            if r.step.is_none() {
                for p in &r.split_from {
                    let done = t.was_applied(p.client, p.seq)?;
                    if !done.is_empty() && still_to_apply(&s.store, done).is_none() {
                        return Ok(PushResponse {
                            applied: true,
                            staleness: 0,
                            seq: t.seq(),
                            version: versions::get(&*t),
                        });
                    }
                }
            }
            let out = s.pushes.once(rid, || {
                let mut part = None;
                if let Some((client, seq)) = rid {
                    // Applied before a restart: the replica kept its id with its rows.
                    match still_to_apply(&s.store, t.was_applied(client, seq)?) {
                        None => {
                            return Ok(PushResponse {
                                applied: true,
                                staleness: 0,
                                seq: t.seq(),
                                version: versions::get(&*t),
                            })
                        }
                        Some(keep) => part = keep,
                    }
                }
                let kept;
                let (ids, grads): (&[u64], &[f32]) = match &part {
                    None => (&ids, &grads),
                    Some(keep) => {
                        kept = keep_rows(&ids, &grads, t.dim(), keep.as_ref());
                        (&kept.0, &kept.1)
                    }
                };
                if let Some(step) = r.step {
                    s.steps
                        .add(&r.job, r.worker, rid, step, &r.table, t.dim(), ids, grads)?;
                    if !r.uncounted {
                        versions::count(&*t);
                    }
                    return Ok(bsp_accepted(t.seq(), versions::get(&*t)));
                }
                let (by_version, version) = versions::arrive(&*t, r.pulled_version, r.continued);
                let stale = match r.pulled_version {
                    Some(_) => by_version,
                    None => staleness(t.seq(), r.pulled_seq),
                };
                let decision = s.policies.decide(&r.table, stale);
                let applied = match decision {
                    Decision::Drop => false,
                    // A part with no ids (the batch has none on this server) only counts.
                    Decision::Apply(_) if r.version_only && ids.is_empty() => true,
                    Decision::Apply(scale) => {
                        t.push_validated_as(ids, grads, scale, rid)?;
                        true
                    }
                };
                if !r.uncounted {
                    s.policies.record(&r.table, stale, decision);
                    if applied {
                        versions::count(&*t);
                    }
                }
                Ok(PushResponse {
                    applied,
                    staleness: stale.unwrap_or(0),
                    seq: t.seq(),
                    version,
                })
            })?;
            if ack_all {
                s.ack_all(r.step.is_some())?;
            }
            Ok(out)
        })
        .await
    }

    async fn contains(
        &self,
        req: Request<ContainsRequest>,
    ) -> std::result::Result<Response<ContainsResponse>, Status> {
        self.run("Contains", Access::Read, On::Pool, req, |s, r| {
            let t = sparse(&s.store, &r.table)?;
            let ids = wire::ids(&r.ids)?;
            let mask = t.contains(&ids)?;
            Ok(ContainsResponse {
                mask: mask.into_iter().map(u8::from).collect::<Vec<u8>>().into(),
            })
        })
        .await
    }

    async fn remove(
        &self,
        req: Request<RemoveRequest>,
    ) -> std::result::Result<Response<RemoveResponse>, Status> {
        self.run("Remove", Access::Write, On::Pool, req, |s, r| {
            let t = sparse(&s.store, &r.table)?;
            let ids = wire::ids(&r.ids)?;
            let rid = request_id(&r.request_id);
            let _pass = s.frozen.pass_ids(&r.table, &ids, &s.routing)?;
            s.removes.once(rid, || {
                let mut part = None;
                if let Some((client, seq)) = rid {
                    match still_to_apply(&s.store, t.was_applied(client, seq)?) {
                        // Removed before a restart (how many is not kept).
                        None => return Ok(RemoveResponse { removed: 0 }),
                        Some(keep) => part = keep,
                    }
                }
                let kept: Vec<u64>;
                let ids: &[u64] = match &part {
                    None => &ids,
                    Some(keep) => {
                        kept = ids.iter().copied().filter(|&id| keep(id)).collect();
                        &kept
                    }
                };
                Ok(RemoveResponse {
                    removed: t.remove_as(ids, rid)? as u64,
                })
            })
        })
        .await
    }

    async fn evict(
        &self,
        req: Request<EvictRequest>,
    ) -> std::result::Result<Response<RemoveResponse>, Status> {
        self.run("Evict", Access::Write, On::Blocking, req, |s, r| {
            let t = sparse(&s.store, &r.table)?;
            let secs = r.not_updated_for_seconds;
            if !(secs.is_finite() && secs >= 0.0) {
                return Err(invalid(format!(
                    "not_updated_for_seconds must be >= 0, got {secs}"
                )));
            }
            if r.not_updated_for_steps == 0 && secs == 0.0 {
                return Err(invalid(
                    "evict needs not_updated_for_steps or not_updated_for_seconds",
                ));
            }
            let rid = request_id(&r.request_id);
            s.removes.once(rid, || {
                let mut part = None;
                if let Some((client, seq)) = rid {
                    match still_to_apply(&s.store, t.was_applied(client, seq)?) {
                        None => return Ok(RemoveResponse { removed: 0 }),
                        Some(keep) => part = keep,
                    }
                }
                let before_seq = (r.not_updated_for_steps > 0)
                    .then(|| (t.seq() + 1).saturating_sub(r.not_updated_for_steps));
                let before_secs = (secs > 0.0).then(|| {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    (now - secs).max(0.0) as u32
                });
                // Rows of frozen slots or slots not owned are kept; those removed from slots
                // being copied are recorded for the move's delta (`moves.rs`).
                let removed = s.frozen.evict(&r.table, &s.routing, |may| {
                    t.evict_as(before_seq, before_secs, rid, &|id| {
                        part.as_ref().is_none_or(|keep| keep(id)) && may(id)
                    })
                })?;
                Ok(RemoveResponse {
                    removed: removed as u64,
                })
            })
        })
        .await
    }

    async fn dense_pull(
        &self,
        req: Request<DensePullRequest>,
    ) -> std::result::Result<Response<DensePullResponse>, Status> {
        self.run("DensePull", Access::Read, On::Pool, req, |s, r| {
            let t = dense(&s.store, &r.table)?;
            let d = wire::dtype(r.dtype)?;
            s.fits(t.config().numel() * wire::width(d), "dense pull")?;
            let seq = t.step() as u64;
            let version = versions::get(&*t);
            let v = t.pull()?;
            Ok(DensePullResponse {
                values: wire::encode_values(&v, d),
                dtype: d as i32,
                shape: t.config().shape.iter().map(|&x| x as u64).collect(),
                seq,
                version,
            })
        })
        .await
    }

    async fn dense_push(
        &self,
        req: Request<DensePushRequest>,
    ) -> std::result::Result<Response<PushResponse>, Status> {
        self.run("DensePush", Access::Write, On::Pool, req, |s, r| {
            let t = dense(&s.store, &r.table)?;
            let d = wire::dtype(r.dtype)?;
            let grad = wire::values(&r.grad, d, t.config().numel(), "grad")?;
            t.validate_push(&grad)?;
            let rid = request_id(&r.request_id);
            let ack_all = r.ack_all;
            let _pass = s.frozen.pass_name(&r.table, &s.routing)?;
            let out = s.pushes.once(rid, || {
                if let Some((client, seq)) = rid {
                    // Applied before a restart: the replica kept its id with the value.
                    if t.was_applied(client, seq)?.iter().all(|&d| d) {
                        return Ok(PushResponse {
                            applied: true,
                            staleness: 0,
                            seq: t.step() as u64,
                            version: versions::get(&*t),
                        });
                    }
                }
                if let Some(step) = r.step {
                    s.steps
                        .add(&r.job, r.worker, rid, step, &r.table, 0, &[], &grad)?;
                    versions::count(&*t);
                    return Ok(bsp_accepted(t.step() as u64, versions::get(&*t)));
                }
                let (by_version, version) = versions::arrive(&*t, r.pulled_version, false);
                let stale = match r.pulled_version {
                    Some(_) => by_version,
                    None => staleness(t.step() as u64, r.pulled_seq),
                };
                let decision = s.policies.decide(&r.table, stale);
                let applied = match decision {
                    Decision::Drop => false,
                    Decision::Apply(scale) => {
                        t.push_validated_as(&grad, scale, rid)?;
                        true
                    }
                };
                s.policies.record(&r.table, stale, decision);
                if applied {
                    versions::count(&*t);
                }
                Ok(PushResponse {
                    applied,
                    staleness: stale.unwrap_or(0),
                    seq: t.step() as u64,
                    version,
                })
            })?;
            if ack_all {
                s.ack_all(r.step.is_some())?;
            }
            Ok(out)
        })
        .await
    }

    async fn set_lr(
        &self,
        req: Request<SetLrRequest>,
    ) -> std::result::Result<Response<TableInfo>, Status> {
        self.run("SetLr", Access::Write, On::Blocking, req, |s, r| {
            let t = s.store.table(&r.table)?;
            t.handle().set_lr(r.lr)?;
            s.info(&r.table, &t)
        })
        .await
    }

    async fn flush(
        &self,
        req: Request<FlushRequest>,
    ) -> std::result::Result<Response<FlushResponse>, Status> {
        self.run("Flush", Access::Write, On::Blocking, req, |s, _| {
            s.store.flush()?;
            Ok(FlushResponse {
                durable: s.store.path().is_some(),
            })
        })
        .await
    }

    async fn snapshot(
        &self,
        req: Request<SnapshotRequest>,
    ) -> std::result::Result<Response<SnapshotResponse>, Status> {
        let r = req.get_ref();
        if r.step.is_some() || r.reserve || r.release {
            // A cluster snapshot at a step boundary of a job (bsp/boundary.rs).
            return self.snapshot_at_step(req).await;
        }
        self.run("Snapshot", Access::Write, On::Blocking, req, |s, r| {
            write_part(s, r)
        })
        .await
    }

    async fn bulk_load(
        &self,
        req: Request<BulkLoadRequest>,
    ) -> std::result::Result<Response<BulkLoadResponse>, Status> {
        self.run("BulkLoad", Access::Write, On::Blocking, req, |s, r| {
            // Request ids of pushes applied to rows moved here: answered, never applied again.
            let known = moves::request_ids(&r.applied_request_ids)?;
            if r.table.is_empty() && !known.is_empty() {
                // Kept, and on every live follower, before the routing gives the slots here.
                s.copied.add(&s.store, &known)?;
                for id in known {
                    s.pushes.remember(id, bsp_accepted(0, 0));
                }
                held::ship(s, None, true)?;
                return Ok(BulkLoadResponse::default());
            }
            if !known.is_empty() {
                return Err(invalid(
                    "bulk load: applied_request_ids go in a request of their own (no table)",
                ));
            }
            bulk::bulk_load(&s.store, r)
        })
        .await
    }

    async fn freeze_slots(
        &self,
        req: Request<FreezeSlotsRequest>,
    ) -> std::result::Result<Response<FreezeSlotsResponse>, Status> {
        self.run("FreezeSlots", Access::Write, On::Blocking, req, |s, r| {
            let set = moves::slots_of(r.slots.as_ref())?;
            if !r.thaw {
                if let Some(s) =
                    (0..set.len()).find(|&k| set[k] && s.routing.owns_slot(k) == Some(false))
                {
                    return Err(invalid(format!(
                        "freeze: slot {s} is not this server's at its routing; only an owner's \
                         slots are moved"
                    )));
                }
            }
            if r.copy && !r.thaw {
                // Writes go on; nothing changes that a follower must hold.
                s.frozen.copy(&set);
                // A step's pushes admitted before the mark are applied later, outside any
                // writer's pass: their rows go again with the delta (decision 0123).
                s.frozen.note_pending(s.steps.pending_rows_in(&set));
                return Ok(FreezeSlotsResponse {
                    frozen: s.frozen.slots().iter().filter(|&&f| f).count() as u32,
                });
            }
            let mut frozen = s.frozen.set(&set, !r.thaw) as u32;
            // Dropped once the freeze is on every follower: the job's workers go on then.
            let mut _hold = None;
            if !r.thaw {
                // Frozen: no tagged push of these slots is on its way into an aggregate now.
                let mut pending = s.steps.pending_in(&set);
                if let Some((job, _, _)) = &pending {
                    // Frozen at the job's next step boundary instead (decision 0123): thawed
                    // meanwhile, so that the step's pushes arrive; then no aggregate is
                    // pending until the hold is dropped.
                    s.frozen.unfreeze(&set);
                    _hold = s.steps.hold_for_freeze(&s.store, job, s.freeze_wait);
                    frozen = s.frozen.set(&set, true) as u32;
                    pending = s.steps.pending_in(&set);
                }
                if let Some((job, step, table)) = pending {
                    s.frozen.set(&set, false);
                    return Err(invalid(format!(
                        "freeze: job {job:?} has a pending step {step} with rows of table \
                         {table:?} in these slots, and no step boundary came within {}s (a \
                         step's aggregate is not moved with its slots: the freeze waits for \
                         the step to be applied); nothing was frozen",
                        s.freeze_wait.as_secs_f64()
                    )));
                }
            }
            // On every live follower before the rows are copied (a follower promoted during
            // the move refuses writes to them too).
            held::ship(s, None, true)?;
            Ok(FreezeSlotsResponse { frozen })
        })
        .await
    }

    async fn export_slots(
        &self,
        req: Request<ExportSlotsRequest>,
    ) -> std::result::Result<Response<ExportSlotsResponse>, Status> {
        self.run("ExportSlots", Access::Write, On::Blocking, req, |s, r| {
            if r.table.is_empty() {
                moves::slots_of(r.slots.as_ref())?;
                return Ok(ExportSlotsResponse {
                    request_ids: moves::encode_request_ids(
                        &s.pushes.recent(moves::EXPORTED_REQUEST_IDS),
                    ),
                    ..Default::default()
                });
            }
            if r.dirty {
                return moves::export_dirty(&s.store, &s.frozen, &r);
            }
            moves::export(&s.store, &r)
        })
        .await
    }

    async fn drop_slots(
        &self,
        req: Request<DropSlotsRequest>,
    ) -> std::result::Result<Response<DropSlotsResponse>, Status> {
        self.run("DropSlots", Access::Write, On::Blocking, req, |s, r| {
            let set = moves::slots_of(r.slots.as_ref())?;
            for (k, _) in set.iter().enumerate().filter(|(_, &x)| x) {
                match s.routing.owns_slot(k) {
                    None => {
                        return Err(invalid(
                            "drop slots: this server holds no routing, so every slot is its own",
                        ))
                    }
                    Some(true) => {
                        return Err(invalid(format!(
                            "drop slots: slot {k} is this server's at its routing; only slots \
                             moved away are dropped"
                        )))
                    }
                    Some(false) => {}
                }
            }
            moves::drop_slots(&s.store, &set)
        })
        .await
    }

    async fn load_snapshot(
        &self,
        req: Request<LoadSnapshotRequest>,
    ) -> std::result::Result<Response<LoadSnapshotResponse>, Status> {
        self.run("LoadSnapshot", Access::Write, On::Blocking, req, |s, r| {
            load::load_snapshot(&s.store, r)
        })
        .await
    }

    async fn clock(
        &self,
        req: Request<ClockRequest>,
    ) -> std::result::Result<Response<ClockResponse>, Status> {
        let t0 = Instant::now();
        let _busy = Busy::new(&self.0.inflight);
        let access = if req.get_ref().advance || req.get_ref().carry {
            Access::Write
        } else {
            Access::Read
        };
        let out = async {
            self.check(&req, access)?;
            self.layout_check(&req)?;
            if !req.get_ref().job.is_empty() {
                // A job runs on the primary of a group (its followers keep its records).
                self.primary_only("Clock", &req).await?;
            }
            let epoch = routing::epoch_of(&req);
            let r = req.into_inner();
            if !r.job.is_empty() {
                return self.job_clock(r, epoch).await;
            }
            if r.carry {
                return Err(status_of(&invalid(
                    "a carried job (carry) needs its id (job)",
                )));
            }
            if r.advance {
                self.0
                    .clocks
                    .advance(r.worker, r.num_workers, r.clock)
                    .map_err(|e| status_of(&e))?;
            }
            if r.wait {
                // Cancelled with the call when the client's deadline passes or it goes away.
                self.0
                    .clocks
                    .wait_min(r.clock.saturating_sub(r.staleness))
                    .await;
            }
            Ok(self.0.clocks())
        }
        .await;
        let code = out.as_ref().err().map(|s: &Status| code_name(s.code()));
        self.0.metrics.observe("Clock", t0.elapsed(), code);
        out.map(Response::new)
    }

    type ReplicateStream =
        tokio_stream::wrappers::ReceiverStream<std::result::Result<ReplicateMessage, Status>>;

    async fn replicate(
        &self,
        req: Request<ReplicateRequest>,
    ) -> std::result::Result<Response<Self::ReplicateStream>, Status> {
        self.check(&req, Access::Write)?;
        let t0 = Instant::now();
        let out = match (&self.0.primary(), &self.0.follower()) {
            (_, Some(f)) => Err(Status::failed_precondition(format!(
                "this server is a follower of {}: followers replicate from the primary",
                f.primary
            ))),
            (None, None) => Err(Status::failed_precondition(
                "this server keeps no replication log: only a durable store server is a primary",
            )),
            (Some(p), None) => p
                .serve(req.into_inner())
                .map(|rx| Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
                .map_err(|e| status_of(&e)),
        };
        let code = out.as_ref().err().map(|s| code_name(s.code()));
        self.0.metrics.observe("Replicate", t0.elapsed(), code);
        out
    }

    async fn replica_ack(
        &self,
        req: Request<ReplicaAckRequest>,
    ) -> std::result::Result<Response<ReplicaAckResponse>, Status> {
        self.run("ReplicaAck", Access::Write, On::Pool, req, |s, r| {
            match &s.primary() {
                Some(p) => p.ack(&r.follower, r.replication_id, r.lsn)?,
                None => return Err(invalid("this server is not a replication primary")),
            }
            Ok(ReplicaAckResponse {})
        })
        .await
    }

    async fn promote(
        &self,
        req: Request<PromoteRequest>,
    ) -> std::result::Result<Response<PromoteResponse>, Status> {
        self.check(&req, Access::Write)?;
        let t0 = Instant::now();
        let out = match &self.0.group {
            None => Err(Status::failed_precondition(
                "this server is in no replica group: only a durable store server (with a path) \
                 is",
            )),
            Some(g) => {
                let g = Arc::clone(g);
                let r = req.into_inner();
                tokio::task::spawn_blocking(move || g.promote(&r))
                    .await
                    .unwrap_or_else(|_| Err(Status::internal("the promotion task failed")))
                    .map(Response::new)
            }
        };
        let code = out.as_ref().err().map(|s| code_name(s.code()));
        self.0.metrics.observe("Promote", t0.elapsed(), code);
        out
    }

    async fn get_routing(
        &self,
        req: Request<GetRoutingRequest>,
    ) -> std::result::Result<Response<Routing>, Status> {
        self.run("GetRouting", Access::Read, On::Pool, req, |s, _| {
            Ok(s.routing.get())
        })
        .await
    }

    async fn set_routing(
        &self,
        req: Request<SetRoutingRequest>,
    ) -> std::result::Result<Response<Routing>, Status> {
        self.run("SetRouting", Access::Write, On::Blocking, req, |s, r| {
            // A job's clock calls waiting here look again: one routed over an older list is
            // answered "moved" (decision 0125).
            let _wake = Wake(&s.steps);
            refuse_interrupted(s, &r)?;
            // With writes held off; frozen slots given to another owner are "moved" from now on.
            s.frozen.publish(
                || {
                    s.routing
                        .set(&s.store, r, |hash| s.layout.pin(&s.store, hash))
                },
                |k| s.routing.owns_slot(k) == Some(false),
                // On every live follower before any write goes on under the new routing.
                |frozen| held::ship(s, Some(frozen), true),
            )
        })
        .await
    }

    async fn status(
        &self,
        req: Request<StatusRequest>,
    ) -> std::result::Result<Response<StatusResponse>, Status> {
        self.run("Status", Access::Read, On::Pool, req, |s, _| {
            let tables = s.infos()?;
            let f = s.store.flusher();
            Ok(StatusResponse {
                version: env!("CARGO_PKG_VERSION").to_string(),
                protocol: PROTOCOL,
                path: s
                    .store
                    .path()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                durability: f
                    .as_ref()
                    .map(|f| f.mode().as_str().to_string())
                    .unwrap_or_else(|| "memory".to_string()),
                uptime_seconds: s.started.elapsed().as_secs_f64(),
                max_message_bytes: s.max_message as u64,
                tables,
                clocks: Some(s.clocks()),
                flush_lag_seconds: f.map(|f| f.lag().as_secs_f64()).unwrap_or(0.0),
                role: "store".to_string(),
                model_json: String::new(),
                replication_json: s.replication_json(),
                rows_port: s.rows_port,
            })
        })
        .await
    }
}

/// A running server. Dropping it stops it (as [`ServerHandle::stop`] with no grace).
pub struct ServerHandle {
    rt: Option<tokio::runtime::Runtime>,
    stop: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<std::result::Result<(), tonic::transport::Error>>>,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    /// Calls being answered (a graceful stop waits for them).
    inflight: Arc<std::sync::atomic::AtomicUsize>,
    /// The store served, flushed by `stop` (model servers have none).
    store: Option<Arc<Store>>,
    /// A durable server's group (a follower's thread), stopped by `stop`.
    group: Option<Arc<fence::Group>>,
    /// The rows port (`rows.rs`), closed by `stop`.
    rows: Option<rows::RowsPort>,
}

/// Starts serving `store`; returns once the ports are bound.
pub fn start(store: Arc<Store>, config: ServerConfig) -> Result<ServerHandle> {
    config.replication.validate()?;
    let rows_listener = rows::listen(&config)?;
    let freeze_wait = freeze_wait_of(std::env::var(FREEZE_WAIT_ENV).ok().as_deref())?;
    let mut repl = config.replication.clone();
    repl.lease = repl.lease.min(repl.ack_timeout / 2);
    if repl.token.is_none() {
        repl.token = config
            .tokens
            .write
            .as_ref()
            .map(|t| String::from_utf8_lossy(t).into_owned());
    }
    let group = match &repl.follow {
        Some(_) => {
            if config.tls.is_some() {
                return Err(invalid(
                    "a follower reaches its primary over plain TCP: replication with TLS is not \
                     supported (run followers and primaries on a private network)",
                ));
            }
            if store.path().is_none() {
                return Err(invalid("a follower needs a durable store: give it a path"));
            }
            Some(fence::Group::open(Arc::clone(&store), repl)?)
        }
        None if store.path().is_some() => Some(fence::Group::open(Arc::clone(&store), repl)?),
        None => None,
    };
    let policies = Policies::load(store.path().map(|p| p.join("stale_policies.json")))?;
    let in_memory = store.path().is_none();
    let inner = Arc::new(Inner {
        store: Arc::clone(&store),
        tokens: config.tokens.clone(),
        metrics: Metrics::default(),
        pushes: Dedup::new(state::DEDUP_CAPACITY),
        removes: Dedup::new(state::DEDUP_CAPACITY),
        clocks: Clocks::default(),
        steps: Arc::new(bsp::Steps::load(
            &store,
            group.as_ref().is_some_and(|g| g.follower().is_some()),
        )?),
        policies,
        started: Instant::now(),
        max_message: config.max_message,
        in_memory,
        inflight: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        layout: layout::Layout::load(&store)?,
        group: group.clone(),
        routing: routing::Routes::load(&store)?,
        frozen: moves::Frozen::default(),
        copied: held::Copied::load(&store)?,
        freeze_wait,
        rows_port: rows_listener.as_ref().map_or(Ok(0), rows::port_of)?,
    });
    for id in inner.copied.ids() {
        inner.pushes.remember(id, bsp_accepted(0, 0));
    }
    if let Some(g) = &group {
        g.attach(Arc::new(held::Link(Arc::downgrade(&inner))));
    }
    // The tables' `max_rows` budgets spare what a move carries as it is (decision 0122).
    store.set_budget_guard(Some(Arc::new(moves::Guard(Arc::downgrade(&inner)))));
    let m = Arc::clone(&inner);
    let mut h = launch(
        Service(Arc::clone(&inner)),
        &config,
        Arc::new(move || m.metrics.render(&m.sample())),
        Arc::clone(&inner.inflight),
        Some(store),
    );
    if let (Ok(h), Some(l)) = (&mut h, rows_listener) {
        let (svc, rt) = (Service(Arc::clone(&inner)), h.runtime()?);
        let (svc2, rt2) = (Service(Arc::clone(&inner)), rt.clone());
        let handlers = rows::Handlers {
            pull: Arc::new(move |c, _, out| rows_pull(&svc, &rt, c, out)),
            call: Some(Arc::new(move |c| rows_call(&svc2, &rt2, c))),
        };
        h.rows = Some(rows::serve(l, config.limits, config.max_message, handlers)?);
    }
    if let (Ok(h), Some(g)) = (&mut h, group) {
        g.spawn(&h.addr().to_string())?;
        h.group = Some(g);
    }
    h
}

/// A rows-port pull of this many bytes of float32 rows is sent as its rows are looked up
/// (decision 0133). Not a larger one: the client sends the parts of a large pull one ahead
/// (`client/rows.rs`), so the pool looks the next part up while this one is sent, with all
/// its threads, where a slice at a time looks up on one.
const STREAM_BYTES: std::ops::RangeInclusive<usize> = (512 << 10)..=(2 << 20);
/// The rows of such a pull are looked up in slices of about this many bytes, each sent once
/// it is done.
const STREAM_SLICE_BYTES: usize = 128 << 10;

/// A pull on the rows port (decision 0128): the request as a gRPC `Pull` with the metadata and
/// token the rows request carries, answered by the same handler on the calling thread; the
/// rows go to the socket from the answer's own buffer. A large float32 pull is sent by
/// [`rows_pull_streamed`] instead.
fn rows_pull(
    svc: &Service,
    rt: &tokio::runtime::Handle,
    c: &rows::Call<'_>,
    out: &mut rows::Out<'_>,
) -> std::result::Result<rows::Rows, Status> {
    let req = rows_request(
        PullRequest {
            table: c.table.to_string(),
            ids: wire::encode_ids(c.ids),
            dtype: c.dtype,
        },
        c.meta,
        c.token,
    )?;
    svc.0.metrics.rows_port_request("Pull");
    let dim = sparse(&svc.0.store, c.table).map_or(0, |t| t.dim());
    if c.dtype == Dtype::Float32 as i32
        && cfg!(target_endian = "little")
        && STREAM_BYTES.contains(&(c.ids.len() * dim * 4))
    {
        return rows_pull_streamed(svc, rt, req, c.ids.len(), out);
    }
    let mut answer = rt.block_on(PStore::pull(svc, req))?;
    let rows = match answer.extensions_mut().remove::<splice::SplicedRows>() {
        Some(r) => r.0,
        None => std::mem::take(&mut answer.get_mut().rows),
    };
    let a = answer.into_inner();
    Ok(rows::Rows {
        dtype: a.dtype,
        dim: a.dim,
        generation: a.version,
        bytes: rows.len(),
        own: Some(rows),
    })
}

/// Ends a streamed pull whose work was dropped before it ran (a pool stopping).
struct EndsStream(Arc<rows::Streamed>);

impl Drop for EndsStream {
    fn drop(&mut self) {
        self.0
            .finish(Err(Status::unavailable("the server is stopping")));
    }
}

/// A float32 pull of `n` ids on the rows port, sent as its rows are looked up: the same
/// checks as a gRPC `Pull`, then the lookup runs on the store's pool a slice at a time while
/// this thread sends the slices done (the head with the first). A failure before the first
/// row is answered as any refusal; after it, the connection is closed (the client pulls over
/// gRPC, which answers the failure).
fn rows_pull_streamed(
    svc: &Service,
    rt: &tokio::runtime::Handle,
    req: Request<PullRequest>,
    n: usize,
    out: &mut rows::Out<'_>,
) -> std::result::Result<rows::Rows, Status> {
    let t0 = Instant::now();
    let _busy = Busy::new(&svc.0.inflight);
    let create = svc.pull_creates(&req);
    let st = Arc::new(rows::Streamed::default());
    let r = rt
        .block_on(svc.admit("Pull", Access::Read, &req))
        .map(|()| {
            let (inner, ends, msg) = (
                Arc::clone(&svc.0),
                EndsStream(Arc::clone(&st)),
                req.into_inner(),
            );
            let work = move || {
                let r =
                    guarded(|| pull_work(&inner, msg, create, Some((&ends.0, STREAM_SLICE_BYTES))));
                ends.0.finish(r.map(drop));
            };
            svc.0.metrics.rows_port_streamed();
            // As `run` places a pull's work: on the pool only for an in-memory store.
            if svc.0.in_memory {
                svc.0.store.spawn(work);
            } else {
                drop(rt.spawn_blocking(work));
            }
        });
    let r = r.and_then(|()| send_streamed(&st, n, out));
    let code = r.as_ref().err().map(|s| code_name(s.code()));
    svc.0.metrics.observe("Pull", t0.elapsed(), code);
    r
}

/// Sends the rows of `st` (`n` ids) as they are done: the answer, or the pull's failure.
fn send_streamed(
    st: &rows::Streamed,
    n: usize,
    out: &mut rows::Out<'_>,
) -> std::result::Result<rows::Rows, Status> {
    let mut sent = 0;
    loop {
        let p = st.wait(sent);
        let Some((dtype, dim, generation)) = p.head else {
            return Err(match p.end {
                Some(Err(s)) => s,
                _ => Status::internal("a streamed pull ended without rows"),
            });
        };
        if let (0, Some(Err(s))) = (p.rows.len(), &p.end) {
            // Failed before its first row: an answer like any refusal.
            return Err(s.clone());
        }
        let answer = rows::Rows {
            dtype,
            dim,
            generation,
            bytes: n * dim as usize * 4,
            own: None,
        };
        let new = &p.rows[sent..];
        let ok = if sent == 0 {
            out.send(&[&answer.head(), new])
        } else {
            out.send(&[new])
        };
        if !ok {
            return Err(Status::unavailable("the connection failed"));
        }
        sent = p.rows.len();
        match p.end {
            Some(Ok(())) if sent == answer.bytes => return Ok(answer),
            Some(Ok(())) => return Err(Status::internal("a streamed pull ended short")),
            Some(Err(s)) => return Err(s),
            None => {}
        }
    }
}

/// `msg` as a gRPC request with the metadata and token a rows request carries.
fn rows_request<T>(
    msg: T,
    meta: &[(&str, &str)],
    token: Option<&[u8]>,
) -> std::result::Result<Request<T>, Status> {
    let mut req = Request::new(msg);
    let bad = |what: &str| Status::invalid_argument(format!("rows port: {what}"));
    for &(k, v) in meta {
        let key = tonic::metadata::AsciiMetadataKey::from_bytes(k.as_bytes())
            .map_err(|_| bad(&format!("{k:?} is not a metadata key")))?;
        let value = tonic::metadata::AsciiMetadataValue::try_from(v)
            .map_err(|_| bad(&format!("the value of {k:?} is not a metadata value")))?;
        req.metadata_mut().insert(key, value);
    }
    if let Some(t) = token {
        let v = std::str::from_utf8(t)
            .ok()
            .and_then(|t| format!("Bearer {t}").parse().ok())
            .ok_or_else(|| Status::unauthenticated("the token is not ASCII"))?;
        req.metadata_mut().insert("authorization", v);
    }
    Ok(req)
}

/// A call on the rows port (decision 0129): a push, decoded from the port's buffer (its
/// gradients are not copied) and answered by the gRPC handler on the calling thread.
fn rows_call(
    svc: &Service,
    rt: &tokio::runtime::Handle,
    c: &rows::UnaryCall<'_>,
) -> std::result::Result<Vec<u8>, Status> {
    use prost::Message;
    if c.method != crate::net::rows::METHOD_PUSH {
        return Err(Status::unimplemented(format!(
            "rows port: no method {} (1: Push)",
            c.method
        )));
    }
    let msg = PushRequest::decode(c.body.clone())
        .map_err(|e| Status::invalid_argument(format!("rows port: a malformed push: {e}")))?;
    let req = rows_request(msg, c.meta, c.token)?;
    svc.0.metrics.rows_port_request("Push");
    Ok(rt
        .block_on(PStore::push(svc, req))?
        .into_inner()
        .encode_to_vec())
}

/// A TLS acceptor for the metrics port from the gRPC port's PEM certificate chain and key.
fn metrics_tls_acceptor(cert: &[u8], key: &[u8]) -> Result<tokio_rustls::TlsAcceptor> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |e: &dyn std::fmt::Display| invalid(format!("TLS certificate or key: {e}"));
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(&e))?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad(&e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(&e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| bad(&e))?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(tls)))
}

/// Runs `service` as the `pstore.v1.PStore` service of a server on `config`'s ports, with the
/// health service, token check before decoding, TLS and metrics (`render` answers a scrape).
pub(crate) fn launch<S: PStore>(
    service: S,
    config: &ServerConfig,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    inflight: Arc<std::sync::atomic::AtomicUsize>,
    store: Option<Arc<Store>>,
) -> Result<ServerHandle> {
    if config.max_message < 1024 {
        return Err(invalid("max_message must be at least 1024 bytes"));
    }
    config.limits.validate()?;
    if config.metrics_token.as_deref() == Some(b"") {
        return Err(invalid("the metrics token must not be empty"));
    }
    let metrics_tls =
        match (&config.tls, config.metrics_tls) {
            (Some((cert, key)), true) => Some(metrics_tls_acceptor(cert, key)?),
            (None, true) => return Err(invalid(
                "metrics over TLS use the server's certificate: give the TLS certificate and key",
            )),
            (_, false) => None,
        };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pstore-server")
        .enable_all()
        .build()
        .map_err(|e| Error::Internal(format!("starting the server runtime: {e}")))?;
    let bind = |a: SocketAddr, what: &str| {
        let l = std::net::TcpListener::bind(a)
            .map_err(|e| invalid(format!("cannot listen on {a} ({what}): {e}")))?;
        l.set_nonblocking(true)
            .map_err(|e| Error::Internal(e.to_string()))?;
        Ok::<_, Error>(l)
    };
    let grpc = bind(config.addr, "gRPC")?;
    let addr = grpc
        .local_addr()
        .map_err(|e| Error::Internal(e.to_string()))?;
    let metrics_listener = config
        .metrics_addr
        .map(|a| bind(a, "metrics"))
        .transpose()?;
    let metrics_addr = metrics_listener
        .as_ref()
        .map(|l| l.local_addr().map_err(|e| Error::Internal(e.to_string())))
        .transpose()?;
    let svc = PStoreServer::new(service)
        .max_decoding_message_size(config.max_message)
        .max_encoding_message_size(config.max_message);
    // The token is checked before the request is decoded (the handlers then check the access
    // level of their method).
    let tokens = config.tokens.clone();
    let svc = tonic::service::interceptor::InterceptedService::new(svc, move |req: Request<()>| {
        authenticate(&tokens, &req)?;
        Ok(req)
    });
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let tls = config.tls.as_ref().map(|(cert, key)| {
        tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert, key))
    });
    let done = {
        let _g = rt.enter();
        let listener =
            tokio::net::TcpListener::from_std(grpc).map_err(|e| Error::Internal(e.to_string()))?;
        let grpc_conns = Arc::new(conn::ConnStats::default());
        let metrics_conns = Arc::new(conn::ConnStats::default());
        if let Some(l) = metrics_listener {
            let l =
                tokio::net::TcpListener::from_std(l).map_err(|e| Error::Internal(e.to_string()))?;
            let (g, m) = (Arc::clone(&grpc_conns), Arc::clone(&metrics_conns));
            let render = Arc::new(move || {
                let mut text = render();
                conn::render(&mut text, &[("grpc", &g), ("metrics", &m)]);
                text
            });
            rt.spawn(metrics::serve(
                l,
                metrics::Endpoint {
                    limits: config.limits,
                    stats: metrics_conns,
                    tls: metrics_tls,
                    token: config.metrics_token.clone(),
                    render,
                },
            ));
        }
        let (reporter, health) = tonic_health::server::health_reporter();
        // Large windows: a 64k-id pull answers 16 MiB, which the default 64 KiB stream window
        // would send in hundreds of round trips.
        let mut builder = tonic::transport::Server::builder()
            .initial_stream_window_size(WINDOW)
            .initial_connection_window_size(WINDOW * 4)
            .max_frame_size(MAX_FRAME)
            .http2_keepalive_interval(Some(Duration::from_secs(30)));
        if let Some(tls) = tls {
            builder = builder
                .tls_config(tls)
                .map_err(|e| invalid(format!("TLS certificate or key: {e}")))?;
        }
        // Any request (health checks too) lifts its connection's handshake timeout.
        let served = tower::util::MapRequestLayer::new(
            |req: tonic::codegen::http::Request<tonic::body::Body>| {
                if let Some(c) = req.extensions().get::<conn::ConnInfo>() {
                    c.served();
                }
                req
            },
        );
        // A pull answer's rows go on the wire from their own buffer, a push's gradients are
        // read from the frames that carried them (`net/splice.rs`).
        let splice = tower::util::MapResponseLayer::new(splice::splice_response);
        let max_message = config.max_message;
        let strip = tower::util::MapRequestLayer::new(
            move |req: tonic::codegen::http::Request<tonic::body::Body>| {
                splice::strip_push(req, max_message)
            },
        );
        let router = builder
            .layer(served)
            .layer(splice)
            .layer(strip)
            .add_service(health)
            .add_service(svc);
        // Our own accept loop: the connection cap, the pause after a failed accept, the
        // handshake timeout, TCP_NODELAY (`conn.rs`).
        let incoming = conn::Incoming::new(listener, config.limits, grpc_conns);
        rt.spawn(async move {
            reporter.set_serving::<PStoreServer<S>>().await;
            router
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stop_rx.await;
                    reporter.set_not_serving::<PStoreServer<S>>().await;
                })
                .await
        })
    };
    Ok(ServerHandle {
        rt: Some(rt),
        stop: Some(stop_tx),
        done: Some(done),
        addr,
        metrics_addr,
        inflight,
        store,
        group: None,
        rows: None,
    })
}

impl ServerHandle {
    /// The gRPC address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metrics address, if it serves metrics.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// A handle of the server's runtime (for the rows port's threads).
    fn runtime(&self) -> Result<tokio::runtime::Handle> {
        self.rt
            .as_ref()
            .map(|r| r.handle().clone())
            .ok_or_else(|| Error::Internal("the server's runtime is gone".into()))
    }

    /// The rows port's address, if it serves one (`rows.rs`).
    pub fn rows_addr(&self) -> Option<SocketAddr> {
        self.rows.as_ref().map(rows::RowsPort::addr)
    }

    /// The store it serves (`None` for a model server).
    pub fn store(&self) -> Option<&Arc<Store>> {
        self.store.as_ref()
    }

    /// True once the server has stopped (after [`stop`](Self::stop) or a fatal transport error).
    pub fn is_finished(&self) -> bool {
        self.done.as_ref().is_none_or(|d| d.is_finished())
    }

    /// Stops accepting calls, lets the calls in flight finish (waiting at most `grace`), then
    /// flushes the store. Returns the flush's error, if any.
    pub fn stop(&mut self, grace: Duration) -> Result<()> {
        if let Some(mut r) = self.rows.take() {
            r.stop();
        }
        if let Some(g) = self.group.take() {
            g.stop();
        }
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let (Some(rt), Some(mut done)) = (self.rt.as_ref(), self.done.take()) {
            // Until the transport has closed every connection, or no call is in flight any
            // more (an idle client may keep its connection open; its next call reconnects and
            // gets UNAVAILABLE, which it retries), or the grace period is over.
            let inflight = Arc::clone(&self.inflight);
            let _ = rt.block_on(async move {
                let idle = async {
                    loop {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        if inflight.load(std::sync::atomic::Ordering::Acquire) == 0 {
                            break;
                        }
                    }
                };
                tokio::time::timeout(grace, async {
                    tokio::select! {
                        _ = &mut done => {}
                        _ = idle => {}
                    }
                })
                .await
            });
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_millis(100));
        }
        match &self.store {
            Some(s) => s.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if self.rt.is_some() {
            let _ = self.stop(Duration::ZERO);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_freeze_wait_is_20_s_unless_the_environment_gives_a_good_bound() {
        assert_eq!(freeze_wait_of(None).unwrap(), Duration::from_secs(20));
        assert_eq!(freeze_wait_of(Some("2")).unwrap(), Duration::from_secs(2));
        assert_eq!(
            freeze_wait_of(Some(" 0.5 ")).unwrap(),
            Duration::from_millis(500)
        );
        for bad in ["", "x", "0", "-1", "26", "nan", "inf"] {
            let e = freeze_wait_of(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(FREEZE_WAIT_ENV) && e.contains("at most 25"),
                "{e}"
            );
        }
    }
}
