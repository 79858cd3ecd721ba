//! Prometheus metrics of a store server, in the text exposition format, served over HTTP (or
//! HTTPS with the gRPC port's certificate, and optionally behind a token of its own) on
//! `--metrics-port` (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Upper bounds (seconds) of the latency histogram's buckets.
const BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

#[derive(Default)]
struct Method {
    requests: u64,
    errors: BTreeMap<&'static str, u64>,
    /// Counts per bucket (not cumulative); the last is +Inf.
    buckets: [u64; BUCKETS.len() + 1],
    seconds: f64,
}

/// Request counters and latency histograms by method.
#[derive(Default)]
pub struct Metrics {
    methods: Mutex<BTreeMap<&'static str, Method>>,
    /// Of those, the requests that came on the rows port, by method.
    rows_port: Mutex<BTreeMap<&'static str, u64>>,
    /// Of the rows port's pulls, those sent as their rows were looked up.
    streamed: std::sync::atomic::AtomicU64,
}

/// A table's numbers at scrape time.
pub struct TableSample {
    /// The table's name.
    pub name: String,
    /// `"sparse"` or `"dense"`.
    pub kind: &'static str,
    /// Rows stored.
    pub rows: u64,
    /// Bytes held by rows, state and index.
    pub bytes: u64,
    /// Push calls applied.
    pub pushes: u64,
    /// Pull calls answered.
    pub pulls: u64,
    /// Ids in applied pushes, duplicates included.
    pub ids_pushed: u64,
    /// Updates that left a non-finite weight.
    pub rows_nonfinite: u64,
    /// Ids in answered pulls, duplicates included.
    pub ids_pulled: u64,
    /// Staleness of the pushes that carried their pull's seq.
    pub staleness: super::state::Staleness,
}

/// The LMDB replica's numbers at scrape time (a durable server only).
pub struct ReplicaSample {
    /// Age of the oldest change that may not be on disk yet.
    pub lag: Duration,
    /// Cycles committed since the store opened.
    pub cycles: u64,
    /// The interval `async` mode uses now (0 in the other modes).
    pub interval: Duration,
    /// Whether the last cycle failed (a full disk, say): pushes are refused until one succeeds.
    pub failing: bool,
    /// Bytes of the replica's data files.
    pub file_bytes: u64,
    /// Whether background writes run at idle CPU priority.
    pub idle_writes: bool,
    /// How often an idle write was lifted back to normal priority.
    pub idle_lifts: u64,
    /// How many background writes gave way to a `flush()`.
    pub superseded_writes: u64,
}

/// The server-wide numbers at scrape time.
pub struct Sample {
    /// Every table.
    pub tables: Vec<TableSample>,
    /// The replica (a durable server only).
    pub replica: Option<ReplicaSample>,
    /// Time since the server started.
    pub uptime: Duration,
    /// The training clock each worker reported, by worker.
    pub clocks: Vec<u64>,
    /// Replication (a durable server only).
    pub replication: Option<ReplicationSample>,
}

/// A server's part in replication.
pub struct ReplicationSample {
    /// True on a follower.
    pub follower: bool,
    /// The newest log sequence number: committed (a primary), applied (a follower).
    pub lsn: u64,
    /// Entries behind: a follower's own lag, or a primary's most lagging connected follower.
    pub lag_entries: u64,
    /// A follower: seconds since it was last caught up (0 on a primary).
    pub lag_seconds: f64,
    /// A primary: followers connected, and those in the live set.
    pub followers: usize,
    /// As `followers`, those in the live set.
    pub live: usize,
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Counts one call of `method`; `error` is the gRPC code name of a failed one.
    pub fn observe(&self, method: &'static str, took: Duration, error: Option<&'static str>) {
        let secs = took.as_secs_f64();
        let mut m = self.methods.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.entry(method).or_default();
        e.requests += 1;
        e.seconds += secs;
        let b = BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(BUCKETS.len());
        e.buckets[b] += 1;
        if let Some(code) = error {
            *e.errors.entry(code).or_default() += 1;
        }
    }

    /// Counts one request of `method` that came on the rows port (it is observed as any
    /// other call too).
    pub fn rows_port_request(&self, method: &'static str) {
        let mut m = self.rows_port.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(method).or_default() += 1;
    }

    /// Counts one pull of the rows port sent as its rows were looked up (decision 0133).
    pub fn rows_port_streamed(&self) {
        self.streamed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The exposition text.
    pub fn render(&self, s: &Sample) -> String {
        let mut o = String::new();
        {
            let r = self.rows_port.lock().unwrap_or_else(|e| e.into_inner());
            o.push_str(
                "# HELP pstore_rows_port_requests_total Requests that came on the rows port, by \
                 method (counted in pstore_requests_total too).\n",
            );
            o.push_str("# TYPE pstore_rows_port_requests_total counter\n");
            for (k, n) in r.iter() {
                let _ = writeln!(o, "pstore_rows_port_requests_total{{method=\"{k}\"}} {n}");
            }
            o.push_str(
                "# HELP pstore_rows_port_streamed_pulls_total Pulls on the rows port sent as \
                 their rows were looked up (counted in pstore_rows_port_requests_total too).\n",
            );
            o.push_str("# TYPE pstore_rows_port_streamed_pulls_total counter\n");
            let n = self.streamed.load(std::sync::atomic::Ordering::Relaxed);
            let _ = writeln!(o, "pstore_rows_port_streamed_pulls_total {n}");
        }
        let m = self.methods.lock().unwrap_or_else(|e| e.into_inner());
        o.push_str("# HELP pstore_requests_total Requests answered, by method.\n");
        o.push_str("# TYPE pstore_requests_total counter\n");
        for (k, v) in m.iter() {
            let _ = writeln!(o, "pstore_requests_total{{method=\"{k}\"}} {}", v.requests);
        }
        o.push_str(
            "# HELP pstore_request_errors_total Requests that failed, by method and code.\n",
        );
        o.push_str("# TYPE pstore_request_errors_total counter\n");
        for (k, v) in m.iter() {
            for (code, n) in &v.errors {
                let _ = writeln!(
                    o,
                    "pstore_request_errors_total{{method=\"{k}\",code=\"{code}\"}} {n}"
                );
            }
        }
        o.push_str("# HELP pstore_request_seconds Latency of requests, by method.\n");
        o.push_str("# TYPE pstore_request_seconds histogram\n");
        for (k, v) in m.iter() {
            let mut cum = 0;
            for (i, &b) in BUCKETS.iter().enumerate() {
                cum += v.buckets[i];
                let _ = writeln!(
                    o,
                    "pstore_request_seconds_bucket{{method=\"{k}\",le=\"{b}\"}} {cum}"
                );
            }
            cum += v.buckets[BUCKETS.len()];
            let _ = writeln!(
                o,
                "pstore_request_seconds_bucket{{method=\"{k}\",le=\"+Inf\"}} {cum}"
            );
            let _ = writeln!(
                o,
                "pstore_request_seconds_sum{{method=\"{k}\"}} {}",
                v.seconds
            );
            let _ = writeln!(o, "pstore_request_seconds_count{{method=\"{k}\"}} {cum}");
        }
        drop(m);
        type Get = fn(&TableSample) -> f64;
        let gauges: [(&str, &str, &str, Get); 10] = [
            ("pstore_table_rows", "gauge", "Rows stored.", |t| {
                t.rows as f64
            }),
            (
                "pstore_table_bytes",
                "gauge",
                "Bytes of rows, state and index.",
                |t| t.bytes as f64,
            ),
            (
                "pstore_table_pushes_total",
                "counter",
                "Pushes applied.",
                |t| t.pushes as f64,
            ),
            (
                "pstore_table_pulls_total",
                "counter",
                "Pulls answered.",
                |t| t.pulls as f64,
            ),
            (
                "pstore_table_ids_pushed_total",
                "counter",
                "Ids pushed.",
                |t| t.ids_pushed as f64,
            ),
            (
                "pstore_table_ids_pulled_total",
                "counter",
                "Ids pulled.",
                |t| t.ids_pulled as f64,
            ),
            (
                "pstore_table_staleness_mean",
                "gauge",
                "Mean staleness (pushes applied between a pull and its push).",
                |t| {
                    let s = &t.staleness;
                    if s.pushes == 0 {
                        0.0
                    } else {
                        s.total as f64 / s.pushes as f64
                    }
                },
            ),
            (
                "pstore_table_staleness_max",
                "gauge",
                "Largest staleness seen.",
                |t| t.staleness.max as f64,
            ),
            (
                "pstore_table_rows_nonfinite_total",
                "counter",
                "Updates that left a NaN or infinite weight.",
                |t| t.rows_nonfinite as f64,
            ),
            (
                "pstore_table_stale_dropped_total",
                "counter",
                "Pushes dropped as too stale.",
                |t| t.staleness.dropped as f64,
            ),
        ];
        for (name, kind, help, get) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for t in &s.tables {
                let _ = writeln!(
                    o,
                    "{name}{{table=\"{}\",kind=\"{}\"}} {}",
                    escape(&t.name),
                    t.kind,
                    get(t)
                );
            }
        }
        staleness_histogram(&mut o, &s.tables);
        if let Some(r) = &s.replica {
            let mut one = |name: &str, kind: &str, help: &str, value: f64| {
                let _ = writeln!(
                    o,
                    "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
                );
            };
            let flag = |b: bool| f64::from(u8::from(b));
            one(
                "pstore_flush_lag_seconds",
                "gauge",
                "Age of the oldest change that may not be on disk yet.",
                r.lag.as_secs_f64(),
            );
            one(
                "pstore_flush_cycles_total",
                "counter",
                "Write cycles the LMDB replica committed since the store opened.",
                r.cycles as f64,
            );
            one(
                "pstore_flush_interval_seconds",
                "gauge",
                "Interval of async mode's cycles now (flush_interval, stretched while idle \
                 writes cannot keep up; 0 in sync and none modes).",
                r.interval.as_secs_f64(),
            );
            one(
                "pstore_flush_failing",
                "gauge",
                "1 while the last write cycle failed (pushes are refused until one succeeds).",
                flag(r.failing),
            );
            one(
                "pstore_replica_file_bytes",
                "gauge",
                "Size of the LMDB data file.",
                r.file_bytes as f64,
            );
            one(
                "pstore_idle_writes",
                "gauge",
                "1 when background writes run at idle CPU priority.",
                flag(r.idle_writes),
            );
            one(
                "pstore_idle_lifts_total",
                "counter",
                "Idle writes lifted back to normal priority (by a waiter or the watchdog).",
                r.idle_lifts as f64,
            );
            one(
                "pstore_superseded_writes_total",
                "counter",
                "Background writes that gave way to a flush() (their rows went to its cycle).",
                r.superseded_writes as f64,
            );
        }
        if let Some(r) = &s.replication {
            let mut one = |name: &str, help: &str, value: f64| {
                let _ = writeln!(
                    o,
                    "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
                );
            };
            one(
                "pstore_replication_follower",
                "1 on a follower (pstore serve --follow), 0 on a primary.",
                f64::from(u8::from(r.follower)),
            );
            one(
                "pstore_replication_lsn",
                "Newest log sequence number: committed on a primary, applied on a follower.",
                r.lsn as f64,
            );
            one(
                "pstore_replication_lag_entries",
                "Log entries behind: a follower's own, or a primary's most lagging follower.",
                r.lag_entries as f64,
            );
            one(
                "pstore_replication_lag_seconds",
                "A follower: seconds since it last held everything its primary had committed.",
                r.lag_seconds,
            );
            one(
                "pstore_replication_followers",
                "A primary: followers connected.",
                r.followers as f64,
            );
            one(
                "pstore_replication_followers_live",
                "A primary: followers in the live set (those ack=\"all\" waits for).",
                r.live as f64,
            );
        }
        o.push_str("# HELP pstore_worker_clock Training clock reported by each worker.\n");
        o.push_str("# TYPE pstore_worker_clock gauge\n");
        for (w, c) in s.clocks.iter().enumerate() {
            let _ = writeln!(o, "pstore_worker_clock{{worker=\"{w}\"}} {c}");
        }
        o.push_str("# HELP pstore_uptime_seconds Seconds since the server started.\n");
        o.push_str("# TYPE pstore_uptime_seconds gauge\n");
        let _ = writeln!(o, "pstore_uptime_seconds {}", s.uptime.as_secs_f64());
        o
    }
}

/// How the metrics port answers: who may scrape, over what.
pub struct Endpoint {
    /// Connection cap and handshake timeout.
    pub limits: super::conn::Limits,
    /// What the port counted.
    pub stats: Arc<super::conn::ConnStats>,
    /// Serve HTTPS with this acceptor (the gRPC port's certificate).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// A scrape must carry `Authorization: Bearer <token>`.
    pub token: Option<Vec<u8>>,
    /// The exposition.
    pub render: Arc<dyn Fn() -> String + Send + Sync>,
}

/// Answers `GET /metrics` (and `GET /`) with `render()` until the listener is dropped.
pub async fn serve(listener: TcpListener, e: Endpoint) {
    let mut incoming = super::conn::Incoming::new(listener, e.limits, Arc::clone(&e.stats));
    let e = Arc::new(e);
    loop {
        let conn = incoming.accept().await;
        let e = Arc::clone(&e);
        tokio::spawn(async move {
            // The handshake timeout of `conn` bounds the TLS handshake and the request's head.
            match &e.tls {
                Some(tls) => {
                    if let Ok(s) = tls.accept(conn).await {
                        answer(s, &e).await;
                    }
                }
                None => answer(conn, &e).await,
            }
        });
    }
}

/// Reads one request's head from `sock` and answers it.
async fn answer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut sock: S,
    e: &Endpoint,
) {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let head = loop {
        let read = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut chunk));
        match read.await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return,
        }
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break String::from_utf8_lossy(&buf[..end]).into_owned();
        }
        if buf.len() > 16 * 1024 {
            return;
        }
    };
    let mut lines = head.split("\r\n");
    let mut parts = lines.next().unwrap_or("").split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let authorized = match &e.token {
        None => true,
        Some(want) => {
            let given = lines
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
                .and_then(|(_, v)| v.trim().strip_prefix("Bearer "))
                .map(|v| v.trim().as_bytes());
            given.is_some_and(|g| crate::net::token_eq(g, want))
        }
    };
    let (status, ctype, body) = match (method, path) {
        _ if !authorized => (
            "401 Unauthorized\r\nWWW-Authenticate: Bearer",
            "text/plain",
            "this metrics endpoint needs a token: header `Authorization: Bearer <token>`\n"
                .to_string(),
        ),
        ("GET", "/metrics" | "/") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            (e.render)(),
        ),
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n".to_string(),
        ),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = sock.write_all(resp.as_bytes()).await;
    let _ = sock.shutdown().await;
}

/// The staleness histogram of every table (pushes counted once each, on the table's home
/// server; buckets of `super::versions::BUCKET_BOUNDS`, cumulative as Prometheus wants).
fn staleness_histogram(o: &mut String, tables: &[TableSample]) {
    let name = "pstore_table_staleness";
    let _ = writeln!(
        o,
        "# HELP {name} Staleness of pushes (pushes of the table received between a push's pull \
         and the push).\n# TYPE {name} histogram"
    );
    for t in tables {
        let labels = format!("table=\"{}\",kind=\"{}\"", escape(&t.name), t.kind);
        let st = &t.staleness;
        let mut cum = 0;
        for (k, n) in st.histogram.iter().enumerate() {
            cum += n;
            let le = super::versions::BUCKET_BOUNDS
                .get(k)
                .map_or_else(|| "+Inf".to_string(), u64::to_string);
            let _ = writeln!(o, "{name}_bucket{{{labels},le=\"{le}\"}} {cum}");
        }
        let _ = writeln!(o, "{name}_sum{{{labels}}} {}", st.total);
        let _ = writeln!(o, "{name}_count{{{labels}}} {}", st.pushes);
    }
}
