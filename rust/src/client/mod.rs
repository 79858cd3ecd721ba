//! The distributed client: one object that talks to every store server of a cluster.
//!
//! Sparse ids are routed to servers through a table of hash slots ([`crate::net::routing`]); a
//! dense table lives whole on the owner of its name's slot. A call that spans several servers sends its
//! requests to all of them at once and returns when all have answered. Every request has a
//! deadline; calls that fail with UNAVAILABLE or DEADLINE_EXCEEDED are retried with exponential
//! backoff, writes with the same request id so the server applies them once.
//!
//! The methods block the calling thread; the binding layer calls them with the GIL released.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use crate::error::{invalid, shape, Error, Result};
use crate::executor::{Applier, PushHandle};
use crate::net::proto::p_store_client::PStoreClient;
use crate::net::proto::*;
use crate::net::routing::SlotTable;
use crate::net::splice::{RowChunks, Strip};
use crate::net::{error_of, wire, DEFAULT_MAX_MESSAGE};

mod boundary;
mod bsp;
pub mod cluster;
mod definitions;
mod group;
mod members;
mod moves;
pub use group::{promote, Promoted};
mod once;
mod ports;
mod reshard;
mod rows;
mod tables;
pub use boundary::StepSnapshot;
pub use bsp::JobConfig;
pub use cluster::{ClusterManifest, RestoreReport};
pub use moves::MoveReport;
pub use once::{REMEMBERED_BATCHES, REMEMBERED_FAILURES};
pub use tables::{
    ClusterStats, ClusterStore, RemoteDense, RemoteSparse, ServerStatus, ServerTable, Staleness,
};

/// The largest request or answer the client asks for in one message: bigger batches go as
/// several requests at once, which the server works on in parallel and whose answers are
/// decoded while the next arrive.
const CHUNK_BYTES: usize = 4 << 20;

/// How a client connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `host:port` of every server, the same list in the same order on every worker (the slot
    /// table names servers by their position in it).
    pub servers: Vec<String>,
    /// Which server owns each hash slot (None: the uniform table of `servers.len()` servers).
    pub slots: Option<SlotTable>,
    /// The token sent with every call.
    pub token: Option<String>,
    /// Deadline of each request.
    pub timeout: Duration,
    /// Retries after the first attempt of a failed call.
    pub retries: u32,
    /// Element type of rows and gradients on the wire.
    pub wire: Dtype,
    /// PEM of the CA that signed the servers' certificates: connect with TLS.
    pub tls_ca: Option<Vec<u8>>,
    /// The name the servers' certificates carry (default: the host of each address).
    pub tls_domain: Option<String>,
    /// The largest request sent; bigger batches are split.
    pub max_message: usize,
    /// Bytes of queued asynchronous pushes before `push_async` blocks.
    pub max_inflight_bytes: usize,
    /// Pushes return when every live follower of the servers holds them too (`ack="all"`), not
    /// only when the servers have them under their durability mode (`ack="primary"`).
    pub ack_all: bool,
    /// The other members of each position's replica group (the followers, then any member
    /// that may be promoted), by position; empty or shorter than `servers`: groups of one.
    pub replicas: Vec<Vec<String>>,
    /// Pulls go to a follower of each group (the one of least lag), falling back to the
    /// primary (`read_from="follower"`).
    pub read_from_follower: bool,
    /// How long a call looks for its group's primary after a failure before it fails.
    pub failover_timeout: Duration,
}

impl ClientConfig {
    /// The defaults for `servers`: no token, 30 s deadline, 3 retries, float32, no TLS.
    pub fn new(servers: Vec<String>) -> Self {
        Self {
            servers,
            slots: None,
            token: None,
            timeout: Duration::from_secs(30),
            retries: 3,
            wire: Dtype::Float32,
            tls_ca: None,
            tls_domain: None,
            max_message: DEFAULT_MAX_MESSAGE,
            max_inflight_bytes: 256 << 20,
            ack_all: false,
            replicas: Vec::new(),
            read_from_follower: false,
            failover_timeout: Duration::from_secs(30),
        }
    }

    /// Sets the wire type by name: `"float32"`, `"float16"` or `"bfloat16"`.
    pub fn set_wire_dtype(&mut self, name: &str) -> Result<()> {
        self.wire = match name {
            "float32" => Dtype::Float32,
            "float16" => Dtype::Float16,
            "bfloat16" => Dtype::Bfloat16,
            _ => {
                return Err(invalid(format!(
                    "wire_dtype must be \"float32\", \"float16\" or \"bfloat16\", got {name:?}"
                )))
            }
        };
        Ok(())
    }

    /// The name of the wire type.
    pub fn wire_dtype(&self) -> &'static str {
        match self.wire {
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
        }
    }
}

/// A server's stub: its channel, with pull answers' rows read past tonic's decode buffer
/// (`net/splice.rs`).
type Stub = PStoreClient<Strip<Channel>>;

struct Server {
    name: String,
    group: group::Group,
}

/// A lazily connected member: its channel opens on the first call.
fn member(
    rt: &tokio::runtime::Runtime,
    config: &ClientConfig,
    name: &str,
) -> Result<group::Member> {
    let scheme = if config.tls_ca.is_some() {
        "https"
    } else {
        "http"
    };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{name}"))
        .map_err(|e| invalid(format!("server address {name:?}: {e}")))?
        .connect_timeout(config.timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(crate::server::WINDOW)
        .initial_connection_window_size(crate::server::WINDOW * 4)
        // The largest DATA frame the server may send us (HTTP/2's default is 16 KiB: a 64k-id
        // pull's 16 MiB answer would be 1024 frames, one write and one read each).
        .max_frame_size(crate::server::MAX_FRAME)
        .http2_keep_alive_interval(Duration::from_secs(30));
    if let Some(ca) = &config.tls_ca {
        let host = name.rsplit_once(':').map_or(name, |(h, _)| h);
        let domain = config
            .tls_domain
            .clone()
            .unwrap_or_else(|| host.to_string());
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca))
            .domain_name(domain);
        ep = ep
            .tls_config(tls)
            .map_err(|e| invalid(format!("TLS settings for {name}: {e}")))?;
    }
    let channel = {
        let _g = rt.enter();
        ep.connect_lazy()
    };
    let stub = PStoreClient::new(Strip(channel.clone()))
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(config.max_message.saturating_mul(2));
    Ok(group::Member {
        name: name.to_string(),
        stub,
        channel,
    })
}

/// A connection to a cluster of store servers.
pub struct Client {
    rt: tokio::runtime::Runtime,
    /// The server list and the slot table this client routes by, with its layout hash
    /// (replaced when a server answers "moved", `reshard.rs`; the list itself changes when
    /// servers join or leave, `members.rs`).
    route: RwLock<Arc<reshard::Route>>,
    config: ClientConfig,
    /// Random per client: with `seq`, the ids of write requests.
    id: u64,
    seq: AtomicU64,
    /// The seq and version the home server answered the last pull of each dense table with
    /// (what a dense push without an explicit version carries; a sparse push carries the
    /// versions of its own batch's pull, see `once.rs`).
    pulled: Mutex<HashMap<String, (u64, u64)>>,
    /// Asynchronous pushes, sent in the order they were queued (the embedded store's applier).
    applier: Applier,
    /// The synchronous job this worker takes part in (BSP, SSP), if any.
    job: Mutex<Option<Arc<bsp::Job>>>,
    /// Versions of recent pulls and request ids of failed pushes (`once.rs`).
    memo: once::Memo,
    /// How many times the server list changed under this client (a version vector of a pull
    /// before a change does not fit the list after it).
    list_changes: AtomicU64,
    /// When this client last asked the other servers early about a position it could not
    /// reach, by the position's name (`reshard.rs`, [`Client::ask_early`]).
    asked: Mutex<HashMap<String, Instant>>,
    /// What this client knows of each server's rows port, by name (`ports.rs`).
    rows: Mutex<HashMap<String, ports::RowsPort>>,
}

fn is_retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
    ) && crate::net::tls_hint(s).is_none()
}

fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl Client {
    /// Connects to every server and checks that each speaks this protocol.
    pub fn connect(config: ClientConfig) -> Result<Arc<Self>> {
        if config.servers.is_empty() {
            return Err(invalid("connect needs at least one server address"));
        }
        let mut seen = std::collections::HashSet::new();
        for s in config
            .servers
            .iter()
            .chain(config.replicas.iter().flatten())
        {
            if !seen.insert(s) {
                return Err(invalid(format!("server {s} is listed twice")));
            }
        }
        if config.replicas.len() > config.servers.len() {
            return Err(invalid(format!(
                "{} replica lists for {} servers",
                config.replicas.len(),
                config.servers.len()
            )));
        }
        if config.timeout.is_zero() {
            return Err(invalid("timeout must be > 0"));
        }
        let router = match &config.slots {
            Some(t) if t.servers() != config.servers.len() => {
                return Err(invalid(format!(
                    "the slot table addresses {} servers, the list has {}",
                    t.servers(),
                    config.servers.len()
                )))
            }
            Some(t) => t.clone(),
            None => SlotTable::uniform(config.servers.len())?,
        };
        // A current-thread runtime: the calling thread itself sends, receives and decodes inside
        // `block_on`, with no hand-off to runtime threads and back (on 2 cores those hand-offs
        // cost more than a small pull). Threads calling at once take turns driving the
        // connections, and each one's requests still go to all servers concurrently.
        let rt = tokio::runtime::Builder::new_current_thread()
            .thread_name("pstore-client")
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("starting the client runtime: {e}")))?;
        let mut servers = Vec::new();
        let mut members = Vec::new();
        for name in config
            .servers
            .iter()
            .chain(config.replicas.iter().flatten())
        {
            members.push(member(&rt, &config, name)?);
        }
        let mut rest = members.split_off(config.servers.len()).into_iter();
        for (i, first) in members.into_iter().enumerate() {
            let n = config.replicas.get(i).map_or(0, Vec::len);
            let mut g = vec![first];
            g.extend(rest.by_ref().take(n));
            servers.push(Arc::new(Server {
                name: g[0].name.clone(),
                group: group::Group::new(g),
            }));
        }
        let applier = Applier::new(config.max_inflight_bytes, "pstore-client-push")?;
        let route = RwLock::new(Arc::new(reshard::Route::new(servers, router)?));
        let c = Arc::new(Self {
            rt,
            route,
            config,
            id: random_id(),
            seq: AtomicU64::new(0),
            pulled: Mutex::new(HashMap::new()),
            applier,
            job: Mutex::new(None),
            memo: once::Memo::default(),
            list_changes: AtomicU64::new(0),
            asked: Mutex::new(HashMap::new()),
            rows: Mutex::new(HashMap::new()),
        });
        let token = c.config.token.clone();
        let follow = c.config.read_from_follower;
        let list = c.list();
        c.rt.block_on(futures_join_all(
            list.iter().filter(|s| s.group.members.len() > 1).map(|s| {
                s.group
                    .refresh(token.as_deref(), Duration::from_secs(2), follow)
            }),
        ));
        let status = c.status()?;
        for (s, st) in list.iter().zip(&status) {
            if st.protocol != crate::net::PROTOCOL {
                return Err(invalid(format!(
                    "server {} speaks protocol {}, this client {}",
                    s.name,
                    st.protocol,
                    crate::net::PROTOCOL
                )));
            }
            let port = c.port_of_status(s, st);
            c.rows
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(s.name.clone(), ports::RowsPort::Known(port));
        }
        // The servers' routing over this list, when they hold one, is the cluster's table: it
        // replaces the one given (decision 0102). A routing over another list is not taken: the
        // first call on rows is answered "moved" and fails naming both lists.
        if let Some((list, table)) = c.held_routing()? {
            if reshard::names_of(&list) == c.names() {
                c.adopt(table)?;
            }
        }
        Ok(c)
    }

    /// The server addresses, in the order of the list this client routes by (the one given,
    /// until servers join or leave).
    pub fn servers(&self) -> Vec<String> {
        self.names()
    }

    fn names(&self) -> Vec<String> {
        self.list().iter().map(|s| s.name.clone()).collect()
    }

    /// The servers of the list this client routes by now.
    fn list(&self) -> Vec<Arc<Server>> {
        self.route().servers.clone()
    }

    /// How many servers the list has.
    fn n(&self) -> usize {
        self.route().servers.len()
    }

    /// The address of position `i` (a position the list no longer has: named as such).
    fn name_of(&self, i: usize) -> String {
        self.route()
            .servers
            .get(i)
            .map_or_else(|| format!("position {i}"), |s| s.name.clone())
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    fn next_id(&self) -> Option<RequestId> {
        Some(RequestId {
            client: self.id,
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
        })
    }

    fn request<T>(&self, msg: T, timeout: Duration) -> Request<T> {
        let mut r = Request::new(msg);
        r.set_timeout(timeout);
        let route = self.route();
        r.metadata_mut()
            .insert(crate::server::layout::LAYOUT_KEY, route.layout.clone());
        r.metadata_mut()
            .insert(crate::server::routing::EPOCH_KEY, route.epoch.clone());
        if let Some(t) = &self.config.token {
            if let Ok(v) = format!("Bearer {t}").parse() {
                r.metadata_mut().insert("authorization", v);
            }
        }
        r
    }

    /// One call to server `i`, retried with backoff while it fails with a retryable status.
    async fn call<M, R, F, Fut>(
        &self,
        i: usize,
        msg: M,
        timeout: Duration,
        retry_late: bool,
        f: F,
    ) -> Result<R>
    where
        M: Clone,
        F: Fn(Stub, Request<M>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        self.call_on(i, msg, timeout, retry_late, false, f).await
    }

    /// [`call`](Self::call); `read`: a read that may go to a follower (`read_from_follower`).
    /// In a replica group, a failure that means "not the primary" (or no answer) makes it look
    /// for the primary and send the same request there, for at most `failover_timeout`.
    async fn call_on<M, R, F, Fut>(
        &self,
        i: usize,
        msg: M,
        timeout: Duration,
        retry_late: bool,
        read: bool,
        f: F,
    ) -> Result<R>
    where
        M: Clone,
        F: Fn(Stub, Request<M>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        let before = self.generation();
        match self.call_status(i, msg, timeout, retry_late, read, f).await {
            Ok(r) => Ok(r),
            Err(s) => {
                // A server that no longer owns what it was sent: take the routing it holds, so
                // that the caller's retry (`reshard.rs`) splits by it. Not when this client
                // took another routing during the call (the call then says "moved" itself,
                // and the server it could not reach has nothing newer to tell).
                if reshard::is_moved(&s) && self.generation() == before {
                    self.refresh_routing(i).await?;
                }
                // A position this client cannot reach after its retries (a server stopped
                // after it left the list, a group whose known members have no primary): the
                // others may route by a newer list (`reshard.rs`, decision 0112).
                let name = self.name_of(i);
                let unreachable = (s.code() == Code::Unavailable && !reshard::is_moving(&s))
                    || s.message().starts_with(group::NO_PRIMARY);
                if unreachable && self.follow_the_others(i).await {
                    return Err(error_of(
                        &reshard::moved_status(format!(
                            "{name} could not be reached ({}); the other servers route by \
                             epoch {}",
                            s.message(),
                            self.route().table.epoch()
                        )),
                        &name,
                    ));
                }
                Err(error_of(&s, &name))
            }
        }
    }

    /// [`call_on`](Self::call_on), failing with the last status.
    async fn call_status<M, R, F, Fut>(
        &self,
        i: usize,
        msg: M,
        timeout: Duration,
        retry_late: bool,
        read: bool,
        f: F,
    ) -> std::result::Result<R, Status>
    where
        M: Clone,
        F: Fn(Stub, Request<M>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        // A position the list lost since the call was split (a server left): "moved", so the
        // operation splits again by the list it routes by now.
        let Some(server) = self.route().servers.get(i).cloned() else {
            return Err(reshard::moved_status(format!(
                "the server list changed under the call: it has no position {i} now"
            )));
        };
        self.call_server(&server, Some(i), msg, timeout, retry_late, read, f)
            .await
    }

    /// [`call_status`](Self::call_status) to `server`, wherever it is in the list (or not in
    /// it: a server joining or leaving). With its position `pos` in this client's list: when it
    /// cannot be reached (refused, or its group has no primary among the members
    /// this client knows), a few other servers are asked for their routing at once, not only
    /// after the retries or `failover_timeout` (decision 0112), and a newer routing found there
    /// fails the call "moved" so that the operation splits it again by that routing.
    #[allow(clippy::too_many_arguments)]
    async fn call_server<M, R, F, Fut>(
        &self,
        server: &Server,
        pos: Option<usize>,
        msg: M,
        timeout: Duration,
        retry_late: bool,
        read: bool,
        f: F,
    ) -> std::result::Result<R, Status>
    where
        M: Clone,
        F: Fn(Stub, Request<M>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        let g = &server.group;
        // Whether the others route by something newer for position `pos`: the call then fails
        // "moved". Only for a status that says the request was not applied (no DEADLINE:
        // a late part may have been; the retries decide for it).
        let ask = |s: &Status| {
            let s = s.clone();
            async move {
                let i = pos?;
                if s.code() == Code::DeadlineExceeded || !self.ask_early(i).await {
                    return None;
                }
                Some(reshard::moved_status(format!(
                    "{} could not be reached ({}); the other servers route by epoch {}",
                    server.name,
                    s.message(),
                    self.route().table.epoch()
                )))
            }
        };
        let read = read && self.config.read_from_follower;
        let mut delay = Duration::from_millis(50);
        let mut attempt = 0;
        let mut failover: Option<Instant> = None;
        let mut moving_wait = Duration::ZERO;
        let first = Instant::now();
        // A table this server lacks and another of the list holds is declared here once, then
        // the same request sent again (`definitions.rs`).
        let mut declared = false;
        loop {
            let k = g.pick(read);
            let mut req = self.request(msg.clone(), timeout);
            g.stamp(&mut req);
            let fut = f(g.members[k].stub.clone(), req);
            let started = std::time::Instant::now();
            let late = || {
                Status::deadline_exceeded(format!(
                    "no answer within {:.1} s",
                    timeout.as_secs_f64()
                ))
            };
            let out = match tokio::time::timeout(timeout + Duration::from_millis(200), fut).await {
                // tonic reports its own deadline as CANCELLED.
                Ok(Err(s)) if s.code() == Code::Cancelled && started.elapsed() >= timeout => {
                    Err(late())
                }
                Ok(r) => r,
                Err(_) => Err(late()),
            };
            match out {
                Ok(r) => return Ok(r.into_inner()),
                Err(_) if read && k != g.pick(false) => {
                    // A follower did not answer the read: the primary answers it.
                    g.reader_failed(k);
                }
                // A slot being moved: frozen for a moment, not a failure; retried for as long
                // as one call may take, without using up the retries: after 1, 2 and 4 ms, then
                // every 5 ms (most freezes end within a few ms: a fixed 5 ms kept a BSP job
                // during a move at 0.25x of its speed, this at 0.45x; benches/RESULTS.md).
                Err(s) if reshard::is_moving(&s) && first.elapsed() < timeout => {
                    moving_wait = (moving_wait * 2).clamp(MOVING_FIRST, MOVING_EVERY);
                    tokio::time::sleep(moving_wait).await;
                }
                Err(s)
                    if g.fails_over(&s)
                        && (retry_late || s.code() != Code::DeadlineExceeded)
                        && failover.is_none_or(|t| Instant::now() < t) =>
                {
                    let until = *failover
                        .get_or_insert_with(|| Instant::now() + self.config.failover_timeout);
                    // Looked for in slices: between two, the other servers may name members
                    // this client does not know (a replacement promoted since).
                    let found = loop {
                        let slice = match pos {
                            Some(_) => until.min(Instant::now() + reshard::EARLY_EVERY),
                            None => until,
                        };
                        match g
                            .find_primary(self.config.token.as_deref(), slice, read)
                            .await
                        {
                            Ok(()) => break Ok(()),
                            Err(m) => {
                                if let Some(moved) = ask(&s).await {
                                    return Err(moved);
                                }
                                if Instant::now() >= until {
                                    break Err(m);
                                }
                            }
                        }
                    };
                    if let Err(m) = found {
                        return Err(Status::new(
                            s.code(),
                            format!("{m} (the last call said: {})", s.message()),
                        ));
                    }
                    if g.pick(false) == k && s.code() != Code::FailedPrecondition {
                        // The same primary: back off as for any retry.
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                }
                Err(s) if !declared && definitions::unknown_table(&s).is_some() => {
                    declared = true;
                    let table = definitions::unknown_table(&s).unwrap_or_default();
                    if !self.declare_on(server, &table).await {
                        return Err(s);
                    }
                }
                Err(s)
                    if is_retryable(&s)
                        && (retry_late || s.code() != Code::DeadlineExceeded)
                        && attempt < self.config.retries =>
                {
                    if s.code() == Code::Unavailable {
                        if let Some(moved) = ask(&s).await {
                            return Err(moved);
                        }
                    }
                    attempt += 1;
                    // Jitter in [delay/2, delay).
                    let j = (random_id() % 1000) as f64 / 2000.0 + 0.5;
                    tokio::time::sleep(delay.mul_f64(j)).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(s) => return Err(s),
            }
        }
    }

    /// Runs one call per server in `targets` at once; the answers in the same order.
    fn fan_out<M, R, F, Fut>(&self, targets: Vec<(usize, M)>, f: F) -> Result<Vec<R>>
    where
        M: Clone,
        F: Fn(Stub, Request<M>) -> Fut + Clone,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        self.fan_out_on(targets, false, f)
    }

    /// [`fan_out`](Self::fan_out); `read`: reads that may go to followers.
    fn fan_out_on<M, R, F, Fut>(&self, targets: Vec<(usize, M)>, read: bool, f: F) -> Result<Vec<R>>
    where
        M: Clone,
        F: Fn(Stub, Request<M>) -> Fut + Clone,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        let t = self.config.timeout;
        self.rt.block_on(async {
            let calls = targets
                .into_iter()
                .map(|(i, m)| self.call_on(i, m, t, true, read, f.clone()));
            let mut out = Vec::new();
            for r in futures_join_all(calls).await {
                out.push(r?);
            }
            Ok(out)
        })
    }

    fn all<M: Clone>(&self, msg: M) -> Vec<(usize, M)> {
        (0..self.n()).map(|i| (i, msg.clone())).collect()
    }

    /// The server of a dense table: the owner of its name's slot.
    pub fn dense_home(&self, name: &str) -> usize {
        self.route().table.dense_home(name)
    }

    /// The slot table this client routes by now (a server's newer routing replaces it).
    pub fn slot_table(&self) -> SlotTable {
        self.route().table.clone()
    }

    /// Status of every server, in the order of the list.
    pub fn status(&self) -> Result<Vec<StatusResponse>> {
        // A position that cannot be reached may have left the list (a newer one is followed).
        self.rerouted(|| {
            self.fan_out(self.all(StatusRequest {}), |mut c, r| async move {
                c.status(r).await
            })
        })
    }

    /// Each position's replica group as JSON: its members with their role, group epoch and
    /// lag (or the error of one that did not answer), the primary calls go to, and with
    /// `read_from_follower` the member pulls go to. Asking refreshes the routing.
    pub fn groups_json(&self) -> String {
        let token = self.config.token.clone();
        let follow = self.config.read_from_follower;
        let groups = self.rt.block_on(async {
            let list = self.list();
            let asks = list.iter().map(|s| {
                let token = token.clone();
                async move {
                    let seen = s
                        .group
                        .refresh(token.as_deref(), Duration::from_secs(2), follow)
                        .await;
                    let members: Vec<serde_json::Value> = s
                        .group
                        .members
                        .iter()
                        .zip(seen)
                        .map(|(m, r)| match r {
                            Ok(x) => serde_json::json!({
                                "name": m.name, "role": x.role, "epoch": x.epoch,
                                "lag_entries": x.lag_entries, "lag_seconds": x.lag_seconds,
                            }),
                            Err(e) => serde_json::json!({"name": m.name, "error": e}),
                        })
                        .collect();
                    let reads = if follow {
                        s.group.members[s.group.pick(true)].name.clone()
                    } else {
                        s.group.primary().name.clone()
                    };
                    serde_json::json!({
                        "primary": s.group.primary().name,
                        "epoch": s.group.epoch(),
                        "reads_from": reads,
                        "members": members,
                    })
                }
            });
            futures_join_all(asks).await
        });
        serde_json::Value::Array(groups).to_string()
    }

    /// The standard gRPC health status of the `pstore.v1.PStore` service on every server
    /// (`"SERVING"`, `"NOT_SERVING"`, ...; the error text for a server that does not answer).
    pub fn health(&self) -> Vec<String> {
        use tonic_health::pb::health_client::HealthClient;
        use tonic_health::pb::HealthCheckRequest;
        let list = self.list();
        self.rt.block_on(async {
            let checks = list.iter().map(|s| async move {
                let mut c = HealthClient::new(s.group.primary().channel.clone());
                let req = self.request(
                    HealthCheckRequest {
                        service: "pstore.v1.PStore".to_string(),
                    },
                    self.config.timeout,
                );
                match c.check(req).await {
                    Ok(r) => r.into_inner().status().as_str_name().to_string(),
                    Err(e) => format!("{:?}: {}", e.code(), e.message()),
                }
            });
            futures_join_all(checks).await
        })
    }

    /// Creates a table on every server (or checks that the same one exists).
    pub fn create_table(&self, req: CreateTableRequest) -> Result<Vec<TableInfo>> {
        self.fan_out(
            self.all(req),
            |mut c, r| async move { c.create_table(r).await },
        )
    }

    /// The table's info from every server.
    pub fn get_table(&self, name: &str) -> Result<Vec<TableInfo>> {
        let m = GetTableRequest {
            name: name.to_string(),
        };
        self.rerouted(|| {
            self.fan_out(self.all(m.clone()), |mut c, r| async move {
                c.get_table(r).await
            })
        })
    }

    /// The names of the tables on the first server (every server has the same).
    pub fn list_tables(&self) -> Result<Vec<String>> {
        let r = self.fan_out(vec![(0, ListTablesRequest {})], |mut c, r| async move {
            c.list_tables(r).await
        })?;
        Ok(r.into_iter()
            .flat_map(|x| x.tables)
            .map(|t| t.name)
            .collect())
    }

    /// Drops a table on every server.
    pub fn drop_table(&self, name: &str) -> Result<bool> {
        let m = DropTableRequest {
            name: name.to_string(),
        };
        let r = self.fan_out(self.all(m), |mut c, r| async move { c.drop_table(r).await })?;
        Ok(r.iter().any(|x| x.dropped))
    }

    /// Sets a table's learning rate on every server.
    pub fn set_lr(&self, name: &str, lr: f64) -> Result<()> {
        let m = SetLrRequest {
            table: name.to_string(),
            lr,
        };
        self.rerouted(|| {
            self.fan_out(
                self.all(m.clone()),
                |mut c, r| async move { c.set_lr(r).await },
            )
        })?;
        Ok(())
    }

    /// Waits for queued pushes, then makes every server durable.
    pub fn flush(&self) -> Result<()> {
        self.drain();
        self.rerouted(|| {
            self.fan_out(self.all(FlushRequest {}), |mut c, r| async move {
                c.flush(r).await
            })
        })?;
        Ok(())
    }

    /// Each server writes a snapshot of its part into `dir/server-<i>` on its own machine
    /// (`i` is the server's position in the list).
    pub fn snapshot(&self, dir: &str, incremental: bool) -> Result<Vec<SnapshotResponse>> {
        self.drain();
        let targets = (0..self.n())
            .map(|i| {
                (
                    i,
                    SnapshotRequest {
                        dir: format!("{}/server-{i}", dir.trim_end_matches('/')),
                        incremental,
                        ..Default::default()
                    },
                )
            })
            .collect();
        self.fan_out(targets, |mut c, r| async move { c.snapshot(r).await })
    }

    /// Splits the positions of one server's ids into requests under the message limit.
    fn chunks(&self, pos: &[u32], bytes_per_id: usize) -> Vec<Vec<u32>> {
        let limit = (self.config.max_message * 7 / 8).min(CHUNK_BYTES);
        let per = (limit / bytes_per_id.max(1)).max(1);
        pos.chunks(per).map(<[u32]>::to_vec).collect()
    }

    /// The rows of `ids` (`dim` wide) as a vector.
    pub fn pull(&self, table: &str, dim: usize, ids: &[u64]) -> Result<Vec<f32>> {
        let n = ids.len() * dim;
        let mut out: Vec<f32> = Vec::with_capacity(n);
        self.pull_into(table, dim, ids, &mut out.spare_capacity_mut()[..n])?;
        // SAFETY: `pull_into` returned Ok, so it wrote all n elements.
        unsafe { out.set_len(n) };
        Ok(out)
    }

    /// Writes the rows of `ids` (`dim` wide) into `out`; on success every element is written
    /// (the servers' parts of the batch cover every position once). The table versions read
    /// are remembered for the push of the same ids.
    pub fn pull_into(
        &self,
        table: &str,
        dim: usize,
        ids: &[u64],
        out: &mut [std::mem::MaybeUninit<f32>],
    ) -> Result<()> {
        self.pull_versioned(table, dim, ids, out).map(drop)
    }

    /// [`pull_into`](Self::pull_into), returning the table version each server read the rows
    /// at (in the order of the list), which a push of gradients computed from them carries.
    pub fn pull_versioned(
        &self,
        table: &str,
        dim: usize,
        ids: &[u64],
        out: &mut [std::mem::MaybeUninit<f32>],
    ) -> Result<Vec<u64>> {
        if out.len() != ids.len() * dim {
            return Err(shape("pull_into: out must hold len(ids) x dim floats"));
        }
        self.rerouted(|| self.pull_routed(table, dim, ids, out))
    }

    /// One attempt of [`pull_versioned`](Self::pull_versioned) by the current table.
    fn pull_routed(
        &self,
        table: &str,
        dim: usize,
        ids: &[u64],
        out: &mut [std::mem::MaybeUninit<f32>],
    ) -> Result<Vec<u64>> {
        let d = self.config.wire;
        let mut targets = Vec::new();
        let mut parts = Vec::new();
        let route = self.route();
        // The servers' rows ports when they serve them, in requests of the size gRPC's would
        // be (`ports.rs`).
        {
            let limit = (self.config.max_message * 7 / 8).min(CHUNK_BYTES);
            let per = (limit / (8 + dim * wire::width(d))).max(1);
            if let Some(v) = self.pull_rows_ports(table, dim, &route, ids, out, per) {
                return v;
            }
        }
        for (i, pos) in route.table.split(ids).into_iter().enumerate() {
            let mut chunks = self.chunks(&pos, 8 + dim * wire::width(d));
            if chunks.is_empty() && route.owns_slots[i] {
                // Every server answers its version, so the push of this batch carries one for
                // each server it goes to (every server that owns slots: see `push_parts`).
                chunks.push(Vec::new());
            }
            for c in chunks {
                let m = PullRequest {
                    table: table.to_string(),
                    ids: wire::encode_ids_at(ids, &c),
                    dtype: d as i32,
                };
                targets.push((i, m));
                parts.push((i, c));
            }
        }
        // Each answer with the frames that carried its rows (`net/splice.rs`); pulls may go to
        // followers.
        let answers = self.fan_out_on(targets, true, |mut c, r| async move {
            let a = c.pull(r).await?;
            let rows = a.extensions().get::<RowChunks>().and_then(RowChunks::take);
            Ok(a.map(|m| (m, rows)))
        })?;
        let mut versions = vec![u64::MAX; route.servers.len()];
        for ((i, pos), (a, rows)) in parts.iter().zip(&answers) {
            let dt = wire::dtype(a.dtype)?;
            if a.dim as usize != dim {
                return Err(shape(format!(
                    "table {table:?} has dim {} on server {}, the client expected {dim}",
                    a.dim, route.servers[*i].name
                )));
            }
            match rows {
                Some(chunks) => wire::scatter_chunks(chunks, dt, pos, dim, out)?,
                None => wire::scatter_rows(&a.rows, dt, pos, dim, out)?,
            }
            versions[*i] = versions[*i].min(a.version);
        }
        self.remember_versions(table, ids, versions.clone());
        Ok(versions)
    }

    /// Remembers the seq server `i` answered a pull of `table` with.
    fn set_pulled(&self, table: &str, seq: u64, version: u64) {
        let mut p = self.pulled.lock().unwrap_or_else(|e| e.into_inner());
        p.insert(table.to_string(), (seq, version));
    }

    fn pulled_of(&self, table: &str) -> Option<(u64, u64)> {
        let p = self.pulled.lock().unwrap_or_else(|e| e.into_inner());
        p.get(table).copied()
    }

    /// Applies gradients now (after the queued asynchronous pushes). `version` is the one
    /// [`pull_versioned`](Self::pull_versioned) returned for the rows they were computed from
    /// (None: the one the last pull of the same ids read, if remembered).
    pub fn push(
        self: &Arc<Self>,
        table: &str,
        dim: usize,
        ids: &[u64],
        grads: &[f32],
        version: Option<Vec<u64>>,
    ) -> Result<()> {
        if grads.len() != ids.len() * dim {
            return Err(shape(format!(
                "table {table:?}: grads must hold len(ids) x dim = {} x {dim} values, got {}",
                ids.len(),
                grads.len()
            )));
        }
        if self.pending() > 0 {
            let h = self.push_async(table, dim, ids.to_vec(), grads.to_vec(), version)?;
            return h.wait();
        }
        self.push_parts(table, dim, ids, grads, version)
    }

    /// Refuses a gradient a server would refuse, before any server gets any part of it, so a
    /// push spread over several servers applies everywhere or nowhere: NaN or infinite values,
    /// and values that the 16-bit wire types cannot carry.
    fn check_grads(&self, table: &str, grads: &[f32], dim: usize) -> Result<()> {
        crate::table::check_finite_slice(table, grads, dim)?;
        // Every finite float32 fits float32: only the 16-bit wire types read the values again.
        let fits = match self.config.wire {
            Dtype::Float32 => return Ok(()),
            Dtype::Float16 => |x: f32| half::f16::from_f32(x).is_finite(),
            Dtype::Bfloat16 => |x: f32| half::bf16::from_f32(x).is_finite(),
        };
        if let Some(i) = grads.iter().position(|&g| !fits(g)) {
            return Err(Error::NonFinite(format!(
                "table {table:?}: gradient {} at row {}, column {} overflows {} on the wire; \
                 nothing was applied",
                grads[i],
                i / dim.max(1),
                i % dim.max(1),
                self.config.wire.as_str_name().to_ascii_lowercase()
            )));
        }
        Ok(())
    }

    /// Queues a push and returns at once (blocking while the queue holds too many bytes).
    /// `version` as in [`push`](Self::push); a remembered one is looked up when it is sent.
    pub fn push_async(
        self: &Arc<Self>,
        table: &str,
        dim: usize,
        ids: Vec<u64>,
        grads: Vec<f32>,
        version: Option<Vec<u64>>,
    ) -> Result<PushHandle> {
        if grads.len() != ids.len() * dim {
            return Err(shape(format!(
                "table {table:?}: grads must hold len(ids) x dim = {} x {dim} values, got {}",
                ids.len(),
                grads.len()
            )));
        }
        self.check_grads(table, &grads, dim)?;
        let bytes = (ids.len() * 8 + grads.len() * 4).max(1);
        let me = Arc::clone(self);
        let table = table.to_string();
        self.applier.submit(
            bytes,
            Box::new(move || me.push_parts(&table, dim, &ids, &grads, version)),
        )
    }

    fn pending(&self) -> usize {
        self.applier.pending()
    }

    /// Waits until every queued push has been sent and answered.
    pub fn drain(&self) {
        self.applier.flush();
    }

    /// Waits up to `timeout` for the queued pushes; true when none is left.
    pub fn drain_timeout(&self, timeout: Duration) -> bool {
        self.applier.flush_timeout(timeout)
    }

    /// Which ids have a row.
    pub fn contains(&self, table: &str, ids: &[u64]) -> Result<Vec<bool>> {
        self.rerouted(|| self.contains_routed(table, ids))
    }

    fn contains_routed(&self, table: &str, ids: &[u64]) -> Result<Vec<bool>> {
        let mut targets = Vec::new();
        let mut parts = Vec::new();
        for (i, pos) in self.route().table.split(ids).into_iter().enumerate() {
            for c in self.chunks(&pos, 9) {
                targets.push((
                    i,
                    ContainsRequest {
                        table: table.to_string(),
                        ids: wire::encode_ids_at(ids, &c),
                    },
                ));
                parts.push(c);
            }
        }
        let answers = self.fan_out(targets, |mut c, r| async move { c.contains(r).await })?;
        let mut out = vec![false; ids.len()];
        for (pos, a) in parts.iter().zip(&answers) {
            if a.mask.len() != pos.len() {
                return Err(Error::Internal("contains: mask of the wrong length".into()));
            }
            for (&p, &m) in pos.iter().zip(a.mask.iter()) {
                out[p as usize] = m != 0;
            }
        }
        Ok(out)
    }

    /// Removes rows; returns how many existed.
    pub fn remove(&self, table: &str, ids: &[u64]) -> Result<u64> {
        self.drain();
        self.rerouted(|| self.remove_routed(table, ids))
    }

    fn remove_routed(&self, table: &str, ids: &[u64]) -> Result<u64> {
        let mut targets = Vec::new();
        for (i, pos) in self.route().table.split(ids).into_iter().enumerate() {
            for c in self.chunks(&pos, 8) {
                targets.push((
                    i,
                    RemoveRequest {
                        table: table.to_string(),
                        ids: wire::encode_ids_at(ids, &c),
                        request_id: self.next_id(),
                    },
                ));
            }
        }
        let answers = self.fan_out(targets, |mut c, r| async move { c.remove(r).await })?;
        Ok(answers.iter().map(|a| a.removed).sum())
    }

    /// Evicts rows not updated lately on every server (steps count each server's pushes).
    pub fn evict(&self, table: &str, steps: u64, seconds: f64) -> Result<u64> {
        self.drain();
        let targets = (0..self.n())
            .map(|i| {
                (
                    i,
                    EvictRequest {
                        table: table.to_string(),
                        not_updated_for_steps: steps,
                        not_updated_for_seconds: seconds,
                        request_id: self.next_id(),
                    },
                )
            })
            .collect();
        let answers = self.fan_out(targets, |mut c, r| async move { c.evict(r).await })?;
        Ok(answers.iter().map(|a| a.removed).sum())
    }

    /// The value of a dense table.
    pub fn dense_pull(&self, table: &str, numel: usize) -> Result<Vec<f32>> {
        self.dense_pull_versioned(table, numel).map(|(v, _)| v)
    }

    /// The value of a dense table and the table version it was read at (a push computed from
    /// it carries that version, [`dense_push_versioned`](Self::dense_push_versioned)).
    pub fn dense_pull_versioned(&self, table: &str, numel: usize) -> Result<(Vec<f32>, u64)> {
        let m = DensePullRequest {
            table: table.to_string(),
            dtype: self.config.wire as i32,
        };
        let mut a = self.rerouted(|| {
            self.fan_out(
                vec![(self.dense_home(table), m.clone())],
                |mut c, r| async move { c.dense_pull(r).await },
            )
        })?;
        let a = a.pop().ok_or_else(|| Error::Internal("no answer".into()))?;
        let v = wire::values(&a.values, wire::dtype(a.dtype)?, numel, "values")?.into_owned();
        self.set_pulled(table, a.seq, a.version);
        Ok((v, a.version))
    }

    /// Applies one gradient of a dense table (after the queued asynchronous pushes).
    pub fn dense_push(self: &Arc<Self>, table: &str, grad: &[f32]) -> Result<()> {
        self.dense_push_versioned(table, grad, None)
    }

    /// [`dense_push`](Self::dense_push) of a gradient computed from the value read at
    /// `version` (None: the version of this client's last pull of the table).
    pub fn dense_push_versioned(
        self: &Arc<Self>,
        table: &str,
        grad: &[f32],
        version: Option<u64>,
    ) -> Result<()> {
        if self.pending() > 0 {
            let h = self.dense_push_async_versioned(table, grad.to_vec(), version)?;
            return h.wait();
        }
        self.dense_push_now(table, grad, version)
    }

    fn dense_push_now(&self, table: &str, grad: &[f32], version: Option<u64>) -> Result<()> {
        self.check_grads(table, grad, grad.len().max(1))?;
        let (job, worker, step) = self
            .step_tag()
            .map_or((String::new(), 0, None), |(j, w, s)| (j, w, Some(s)));
        let m = DensePushRequest {
            ack_all: self.config.ack_all,
            table: table.to_string(),
            grad: wire::encode_values(grad, self.config.wire),
            dtype: self.config.wire as i32,
            request_id: self.next_id(),
            pulled_seq: self
                .pulled_of(table)
                .map(|p| p.0)
                .filter(|_| version.is_none()),
            pulled_version: version.or(self.pulled_of(table).map(|p| p.1)),
            step,
            job,
            worker,
        };
        // Sent again with the same request id wherever the table's home moved.
        self.rerouted(|| {
            self.fan_out(
                vec![(self.dense_home(table), m.clone())],
                |mut c, r| async move { c.dense_push(r).await },
            )
        })?;
        Ok(())
    }

    /// Queues one dense gradient.
    pub fn dense_push_async(self: &Arc<Self>, table: &str, grad: Vec<f32>) -> Result<PushHandle> {
        self.dense_push_async_versioned(table, grad, None)
    }

    /// [`dense_push_async`](Self::dense_push_async) with a version, as
    /// [`dense_push_versioned`](Self::dense_push_versioned).
    pub fn dense_push_async_versioned(
        self: &Arc<Self>,
        table: &str,
        grad: Vec<f32>,
        version: Option<u64>,
    ) -> Result<PushHandle> {
        self.check_grads(table, &grad, grad.len().max(1))?;
        let me = Arc::clone(self);
        let table = table.to_string();
        self.applier.submit(
            grad.len() * 4,
            Box::new(move || me.dense_push_now(&table, &grad, version)),
        )
    }

    /// Reports this worker's clock to the coordinator (the first server in sorted order) and,
    /// with `wait`, waits until the slowest worker is within `staleness` clocks; `timeout`
    /// bounds the wait. Queued pushes are sent first.
    pub fn clock(
        &self,
        worker: u32,
        num_workers: u32,
        clock: u64,
        wait: Option<u64>,
        timeout: Duration,
    ) -> Result<ClockResponse> {
        self.drain();
        let coord = self.coordinator();
        let m = ClockRequest {
            worker,
            num_workers,
            clock,
            wait: wait.is_some(),
            staleness: wait.unwrap_or(0),
            advance: true,
            ..Default::default()
        };
        // A wait that ran out is not retried: the caller asked for at most `timeout`.
        let r = self
            .rt
            .block_on(self.call(coord, m, timeout, false, |mut c, r| async move {
                c.clock(r).await
            }));
        r.map_err(|e| {
            waited(
                e,
                format!(
                    "worker {worker} waited {:.1} s at clock {clock} for the slowest worker",
                    timeout.as_secs_f64()
                ),
            )
        })
    }
}

/// The first wait before a write refused "moving" (a frozen slot) is sent again; each later
/// wait doubles, up to [`MOVING_EVERY`].
const MOVING_FIRST: Duration = Duration::from_millis(1);

/// The longest wait between two sends of a write refused "moving".
const MOVING_EVERY: Duration = Duration::from_millis(5);

/// A clock wait's DEADLINE_EXCEEDED with `message` (who waited how long for what).
fn waited(e: Error, message: String) -> Error {
    match e {
        Error::Remote {
            server, code: 4, ..
        } => Error::Remote {
            server,
            code: 4,
            message,
        },
        e => e,
    }
}

/// Polls every future until all are done (a small join_all, to keep the dependency list short).
async fn futures_join_all<F: std::future::Future>(
    futs: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut futs: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..futs.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}
