//! The binding of the store server and the distributed client.
//!
//! The client's tables are the embedded store's classes (`SparseTable`, `DenseTable`, over the
//! traits of `crate::api`); here are only what a cluster has besides: status, health, clocks.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::{err, ForkGuard};
use super::tables::{server_table_dict, PyStoreApi};
use super::{run, PyStore};
use crate::client::{Client, ClientConfig, ClusterStore, StepSnapshot};
use crate::error::Error;
use crate::server::{ServerConfig, ServerHandle, Tokens};

fn bad(msg: impl Into<String>) -> PyErr {
    err(Error::InvalidArgument(msg.into()))
}

fn addr(host: &str, port: u16, what: &str) -> PyResult<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(format!("{what} address {host}:{port}: {e}")))?
        .next()
        .ok_or_else(|| bad(format!("{what} address {host}:{port} resolves to nothing")))
}

/// A running store server or model server.
#[pyclass(frozen, module = "pstore._native", name = "Server")]
pub(super) struct PyServer {
    pub(super) inner: Mutex<Option<ServerHandle>>,
    pub(super) port: u16,
    pub(super) metrics_port: Option<u16>,
    pub(super) rows_port: Option<u16>,
}

impl PyServer {
    pub(super) fn of(h: ServerHandle) -> Self {
        Self {
            port: h.addr().port(),
            metrics_port: h.metrics_addr().map(|a| a.port()),
            rows_port: h.rows_addr().map(|a| a.port()),
            inner: Mutex::new(Some(h)),
        }
    }
}

/// The transport settings of a server beyond its address, tokens and TLS files (the JSON the
/// Python `Server` classes pass as `net`).
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Net {
    /// Where the metrics port listens (default: the gRPC host).
    metrics_host: Option<String>,
    metrics_token: Option<String>,
    #[serde(default)]
    metrics_tls: bool,
    max_connections: Option<u64>,
    handshake_timeout: Option<f64>,
    /// Replication: the primary to follow (`host:port`).
    follow: Option<String>,
    /// The name a follower gives its primary (default: its own address).
    replica_name: Option<String>,
    replication_log_bytes: Option<u64>,
    replication_log_age: Option<f64>,
    ack_timeout: Option<f64>,
    /// The group's other members (`pstore serve --member`).
    #[serde(default)]
    members: Vec<String>,
    /// The rows port on the gRPC host (0: any free port; `server/rows.rs`).
    rows_port: Option<u16>,
}

/// The configuration of a server from the arguments both kinds of server take.
#[allow(clippy::too_many_arguments)]
pub(super) fn server_config(
    host: &str,
    port: u16,
    metrics_port: Option<u16>,
    token: Option<String>,
    read_token: Option<String>,
    tls_cert: Option<Vec<u8>>,
    tls_key: Option<Vec<u8>>,
    max_message: Option<usize>,
    net: Option<&str>,
) -> PyResult<ServerConfig> {
    let net: Net = match net {
        Some(j) => serde_json::from_str(j).map_err(|e| bad(format!("server settings: {e}")))?,
        None => Net::default(),
    };
    let mut cfg = ServerConfig::new(addr(host, port, "server")?);
    let metrics_host = net.metrics_host.as_deref().unwrap_or(host);
    cfg.metrics_addr = metrics_port
        .map(|p| addr(metrics_host, p, "metrics"))
        .transpose()?;
    cfg.metrics_token = net.metrics_token.map(String::into_bytes);
    cfg.metrics_tls = net.metrics_tls;
    if let Some(m) = net.max_connections {
        cfg.limits.max_connections = m;
    }
    if let Some(t) = net.handshake_timeout {
        cfg.limits.handshake_timeout = t;
    }
    cfg.limits.validate().map_err(err)?;
    cfg.rows_addr = net.rows_port.map(|p| addr(host, p, "rows")).transpose()?;
    cfg.replication.follow = net.follow;
    cfg.replication.members = net.members;
    if let Some(n) = net.replica_name {
        cfg.replication.name = n;
    }
    if let Some(b) = net.replication_log_bytes {
        cfg.replication.log_bytes = usize::try_from(b).unwrap_or(usize::MAX);
    }
    let secs = |x: f64, what: &str| {
        if x.is_finite() && x > 0.0 && x < 1e9 {
            Ok(Duration::from_secs_f64(x))
        } else {
            Err(bad(format!("{what} must be > 0 seconds, got {x}")))
        }
    };
    if let Some(a) = net.replication_log_age {
        cfg.replication.log_age = secs(a, "replication_log_age")?;
    }
    if let Some(a) = net.ack_timeout {
        cfg.replication.ack_timeout = secs(a, "ack_timeout")?;
    }
    if token.as_deref() == Some("") || read_token.as_deref() == Some("") {
        return Err(bad("a token must not be empty"));
    }
    if read_token.is_some() && token.is_none() {
        return Err(bad(
            "a read-only token needs a read-write token too (else writes would be open)",
        ));
    }
    cfg.tokens = Tokens {
        write: token.map(String::into_bytes),
        read: read_token.map(String::into_bytes),
    };
    cfg.tls = match (tls_cert, tls_key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err(bad("TLS needs both a certificate and its key")),
    };
    if let Some(m) = max_message {
        cfg.max_message = m;
    }
    Ok(cfg)
}

#[pymethods]
impl PyServer {
    #[new]
    #[pyo3(signature = (
        store, host="127.0.0.1", port=0, metrics_port=None, token=None, read_token=None,
        tls_cert=None, tls_key=None, max_message=None, net=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        store: &PyStore,
        host: &str,
        port: u16,
        metrics_port: Option<u16>,
        token: Option<String>,
        read_token: Option<String>,
        tls_cert: Option<Vec<u8>>,
        tls_key: Option<Vec<u8>>,
        max_message: Option<usize>,
        net: Option<&str>,
    ) -> PyResult<Self> {
        store.guard.check()?;
        let cfg = server_config(
            host,
            port,
            metrics_port,
            token,
            read_token,
            tls_cert,
            tls_key,
            max_message,
            net,
        )?;
        let store = Arc::clone(&store.inner);
        let h = run(py, move || crate::server::start(store, cfg))?;
        Ok(Self::of(h))
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    #[getter]
    fn metrics_port(&self) -> Option<u16> {
        self.metrics_port
    }

    #[getter]
    fn rows_port(&self) -> Option<u16> {
        self.rows_port
    }

    /// True until stopped (or until the transport failed).
    #[getter]
    fn running(&self) -> bool {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Stops taking calls, lets calls in flight finish (at most `grace` seconds), flushes the
    /// store.
    #[pyo3(signature = (grace=10.0))]
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        if !(grace.is_finite() && grace >= 0.0) {
            return Err(bad(format!("grace must be >= 0 seconds, got {grace}")));
        }
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        match h {
            Some(mut h) => run(py, move || h.stop(Duration::from_secs_f64(grace))),
            None => Ok(()),
        }
    }
}

/// A connection to store servers: the tables of [`PyStoreApi`], and the cluster's own calls.
#[pyclass(extends = PyStoreApi, frozen, module = "pstore._native", name = "Client")]
struct PyClient {
    inner: Arc<Client>,
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (
        servers, token=None, timeout=30.0, retries=3, wire_dtype="float32", tls_ca=None,
        tls_domain=None, max_message=None, max_inflight_bytes=None, slots=None, ack="primary",
        replicas=None, read_from="primary", failover_timeout=30.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        servers: Vec<String>,
        token: Option<String>,
        timeout: f64,
        retries: u32,
        wire_dtype: &str,
        tls_ca: Option<Vec<u8>>,
        tls_domain: Option<String>,
        max_message: Option<usize>,
        max_inflight_bytes: Option<usize>,
        slots: Option<&str>,
        ack: &str,
        replicas: Option<Vec<Vec<String>>>,
        read_from: &str,
        failover_timeout: f64,
    ) -> PyResult<PyClassInitializer<Self>> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
        }
        let mut c = ClientConfig::new(servers);
        c.ack_all = match ack {
            "primary" => false,
            "all" => true,
            _ => {
                return Err(bad(format!(
                    "ack must be \"primary\" or \"all\", got {ack:?}"
                )))
            }
        };
        c.read_from_follower = match read_from {
            "primary" => false,
            "follower" => true,
            _ => {
                return Err(bad(format!(
                    "read_from must be \"primary\" or \"follower\", got {read_from:?}"
                )))
            }
        };
        if !(failover_timeout.is_finite() && failover_timeout > 0.0) {
            return Err(bad(format!(
                "failover_timeout must be > 0 seconds, got {failover_timeout}"
            )));
        }
        c.failover_timeout = Duration::from_secs_f64(failover_timeout);
        c.replicas = replicas.unwrap_or_default();
        c.token = token;
        c.timeout = Duration::from_secs_f64(timeout);
        c.retries = retries;
        c.set_wire_dtype(wire_dtype).map_err(err)?;
        c.tls_ca = tls_ca;
        c.tls_domain = tls_domain;
        if let Some(m) = max_message {
            if m < 1024 {
                return Err(bad("max_message must be at least 1024 bytes"));
            }
            c.max_message = m;
        }
        if let Some(b) = max_inflight_bytes {
            if b == 0 {
                return Err(bad("max_inflight_bytes must be > 0"));
            }
            c.max_inflight_bytes = b;
        }
        if let Some(j) = slots {
            c.slots = Some(crate::net::routing::SlotTable::from_json(j).map_err(err)?);
        }
        let inner = run(py, move || Client::connect(c))?;
        let api = ClusterStore(Arc::clone(&inner));
        Ok(
            PyClassInitializer::from(PyStoreApi::new(Arc::new(api), ForkGuard::none()))
                .add_subclass(Self { inner }),
        )
    }

    #[getter]
    fn servers(&self) -> Vec<String> {
        self.inner.servers()
    }

    /// The slot table this client routes by, as JSON.
    #[getter]
    fn slots(&self) -> String {
        self.inner.slot_table().to_json()
    }

    #[getter]
    fn wire_dtype(&self) -> &'static str {
        self.inner.config().wire_dtype()
    }

    /// Each position's replica group, as JSON.
    fn groups(&self, py: Python<'_>) -> PyResult<String> {
        let c = &self.inner;
        run(py, || Ok(c.groups_json()))
    }

    /// Moves every slot whose owner differs in `slots` (JSON) to its new owner while workers
    /// train; returns what moved.
    #[pyo3(signature = (slots, max_rows_per_second=None))]
    fn move_slots<'py>(
        &self,
        py: Python<'py>,
        slots: &str,
        max_rows_per_second: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let table = crate::net::routing::SlotTable::from_json(slots).map_err(super::err)?;
        let c = &self.inner;
        let r = run(py, || c.move_slots(&table, max_rows_per_second))?;
        move_report(py, r)
    }

    /// Adds a server, or a replica group (its primary first), to the list while workers train;
    /// returns what moved to it.
    #[pyo3(signature = (members, max_rows_per_second=None))]
    fn add_server<'py>(
        &self,
        py: Python<'py>,
        members: Vec<String>,
        max_rows_per_second: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let r = run(py, || c.add_server(&members, max_rows_per_second))?;
        move_report(py, r)
    }

    /// Removes a server or replica group (named by any member's address or its position) from
    /// the list while workers train; returns what moved from it.
    #[pyo3(signature = (which, max_rows_per_second=None))]
    fn remove_server<'py>(
        &self,
        py: Python<'py>,
        which: &str,
        max_rows_per_second: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let r = run(py, || c.remove_server(which, max_rows_per_second))?;
        move_report(py, r)
    }

    /// Publishes replica groups' current members in the routing the servers hold (the next
    /// epoch, the same slots); the epoch published, or None when nothing changed or the servers
    /// hold no routing.
    fn publish_members(&self, py: Python<'_>, groups: Vec<Vec<String>>) -> PyResult<Option<u64>> {
        let c = &self.inner;
        run(py, || c.publish_members(&groups))
    }

    /// Publishes a slot table (JSON) as the cluster's routing on every server.
    fn publish_routing(&self, py: Python<'_>, slots: &str) -> PyResult<()> {
        let table = crate::net::routing::SlotTable::from_json(slots).map_err(super::err)?;
        let c = &self.inner;
        run(py, || c.publish_routing(table))
    }

    /// The gRPC health status of every server.
    fn health(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let c = &self.inner;
        run(py, || Ok(c.health()))
    }

    /// The status of every server, as dicts.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let c = &self.inner;
        let out = PyList::empty(py);
        for s in run(py, || c.server_status())? {
            let d = PyDict::new(py);
            d.set_item("server", &s.server)?;
            d.set_item("version", &s.version)?;
            d.set_item("protocol", s.protocol)?;
            d.set_item("path", &s.path)?;
            d.set_item("durability", &s.durability)?;
            d.set_item("uptime_seconds", s.uptime_seconds)?;
            d.set_item("max_message_bytes", s.max_message_bytes)?;
            d.set_item("flush_lag_seconds", s.flush_lag_seconds)?;
            d.set_item("role", &s.role)?;
            d.set_item("model_json", &s.model_json)?;
            d.set_item("replication_json", &s.replication_json)?;
            let tables = PyList::empty(py);
            for t in &s.tables {
                tables.append(server_table_dict(py, t)?)?;
            }
            d.set_item("tables", tables)?;
            d.set_item("clocks", &s.clocks)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Each server writes `dir/server-<i>`; returns [(dir, rows)].
    #[pyo3(signature = (dir, incremental=false))]
    fn snapshot(
        &self,
        py: Python<'_>,
        dir: &str,
        incremental: bool,
    ) -> PyResult<Vec<(String, u64)>> {
        let c = &self.inner;
        let r = run(py, || c.snapshot(dir, incremental))?;
        Ok(r.into_iter().map(|s| (s.dir, s.rows)).collect())
    }

    /// Writes one snapshot of the whole cluster into `dest`; returns `cluster.json` as JSON.
    #[pyo3(signature = (dest, incremental=false))]
    fn cluster_snapshot(&self, py: Python<'_>, dest: &str, incremental: bool) -> PyResult<String> {
        let c = &self.inner;
        let m = run(py, || c.cluster_snapshot(dest, incremental))?;
        serde_json::to_string(&m).map_err(|e| bad(e.to_string()))
    }

    /// Starts a cluster snapshot into `dest` at a step boundary of the servers' job (`step`, or
    /// None: the earliest one no worker went past); returns its handle once the boundary is
    /// fixed. `timeout` bounds the wait for the slowest worker.
    #[pyo3(signature = (dest, step=None, incremental=false, timeout=300.0))]
    fn snapshot_at_step(
        &self,
        py: Python<'_>,
        dest: &str,
        step: Option<u64>,
        incremental: bool,
        timeout: f64,
    ) -> PyResult<PyStepSnapshot> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
        }
        let c = &self.inner;
        let t = Duration::from_secs_f64(timeout);
        let inner = run(py, || c.cluster_snapshot_at(dest, incremental, step, t))?;
        Ok(PyStepSnapshot { inner })
    }

    /// Loads a cluster snapshot, routing its rows by this client's servers, `via` "servers"
    /// (each reads the parts) or "client" (rows sent with BulkLoad); returns
    /// (rows, tables, parts).
    #[pyo3(signature = (snapshot, via = "servers"))]
    fn restore_cluster(
        &self,
        py: Python<'_>,
        snapshot: &str,
        via: &str,
    ) -> PyResult<(u64, usize, usize)> {
        let c = &self.inner;
        let via: crate::client::cluster::Via = via.parse().map_err(super::err)?;
        let r = run(py, || c.restore_cluster(snapshot, via))?;
        Ok((r.rows, r.tables, r.parts))
    }

    /// Waits until every queued asynchronous push has been answered.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        let c = &self.inner;
        run(py, || {
            c.drain();
            Ok(())
        })
    }

    /// Reports `clock` for `worker`; with `staleness` given, waits (at most `timeout` seconds)
    /// until every worker's clock is >= clock - staleness. Returns the clocks.
    #[pyo3(signature = (worker, num_workers, clock, staleness=None, timeout=300.0))]
    fn clock(
        &self,
        py: Python<'_>,
        worker: u32,
        num_workers: u32,
        clock: u64,
        staleness: Option<u64>,
        timeout: f64,
    ) -> PyResult<Vec<u64>> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
        }
        let c = &self.inner;
        let t = Duration::from_secs_f64(timeout);
        let r = run(py, || c.clock(worker, num_workers, clock, staleness, t))?;
        Ok(r.clocks)
    }

    /// Joins a synchronous job on every server (`job` None: worker 0 starts one, the others
    /// find it); returns the job's id and the clock this worker starts at.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (job, worker, num_workers, synced, lease, continue_on_loss, mean, timeout))]
    fn join_job(
        &self,
        py: Python<'_>,
        job: Option<String>,
        worker: u32,
        num_workers: u32,
        synced: bool,
        lease: f64,
        continue_on_loss: bool,
        mean: bool,
        timeout: f64,
    ) -> PyResult<(String, u64)> {
        if !(lease.is_finite() && lease > 0.0) {
            return Err(bad(format!("lease must be > 0 seconds, got {lease}")));
        }
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
        }
        let cfg = crate::client::JobConfig {
            job,
            worker,
            num_workers,
            synced,
            lease: Duration::from_secs_f64(lease),
            continue_on_loss,
            mean,
        };
        let c = &self.inner;
        run(py, || c.join_job(cfg, Duration::from_secs_f64(timeout)))
    }

    /// Ends this worker's step of its job on every server (waits as the job's mode says);
    /// returns the new clock.
    #[pyo3(signature = (staleness, timeout))]
    fn end_job_step(&self, py: Python<'_>, staleness: u64, timeout: f64) -> PyResult<u64> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
        }
        let c = &self.inner;
        run(py, || {
            c.end_job_step(staleness, Duration::from_secs_f64(timeout))
        })
    }
}

/// A cluster snapshot at a step boundary being taken.
#[pyclass(frozen, module = "pstore._native", name = "StepSnapshot")]
struct PyStepSnapshot {
    inner: StepSnapshot,
}

#[pymethods]
impl PyStepSnapshot {
    #[getter]
    fn job(&self) -> &str {
        self.inner.job()
    }

    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    fn done(&self) -> bool {
        self.inner.is_done()
    }

    /// Waits for the snapshot, at most `timeout` seconds; True once it is written, False on
    /// timeout. Raises the snapshot's error if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        super::wait_polling(py, timeout, |step| {
            self.inner.wait_timeout(step).map(|r| r.map(|_| ()))
        })
    }

    /// `cluster.json` of the written snapshot, as JSON; raises its error if it failed, and
    /// InvalidArgumentError while it is still being taken.
    fn result(&self) -> PyResult<String> {
        match self.inner.wait_timeout(Duration::ZERO) {
            None => Err(bad("the snapshot is still being taken (wait for it first)")),
            Some(r) => serde_json::to_string(&r.map_err(err)?).map_err(|e| bad(e.to_string())),
        }
    }
}

/// Makes the follower at `address` the primary of its replica group; returns the new epoch,
/// what it was promoted from, and the seconds until its first write.
#[pyfunction]
#[pyo3(signature = (address, token=None, expected_primary=None, force=false, timeout=30.0))]
fn promote<'py>(
    py: Python<'py>,
    address: String,
    token: Option<String>,
    expected_primary: Option<String>,
    force: bool,
    timeout: f64,
) -> PyResult<Bound<'py, PyDict>> {
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
    }
    let p = run(py, || {
        crate::client::promote(
            &address,
            token.as_deref(),
            expected_primary.as_deref().unwrap_or(""),
            force,
            Duration::from_secs_f64(timeout),
        )
    })?;
    let d = PyDict::new(py);
    d.set_item("server", &address)?;
    d.set_item("epoch", p.epoch)?;
    d.set_item(
        "from_replication_id",
        format!("{:016x}", p.from_replication_id),
    )?;
    d.set_item("from_lsn", p.from_lsn)?;
    d.set_item("writes_in_seconds", p.writes_in_seconds)?;
    Ok(d)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyServer>()?;
    m.add_function(wrap_pyfunction!(promote, m)?)?;
    m.add_class::<PyStepSnapshot>()?;
    m.add_class::<PyClient>()?;
    Ok(())
}

/// A move's report as a dict.
fn move_report(py: Python<'_>, r: crate::client::MoveReport) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("slots", r.slots)?;
    d.set_item("rows", r.rows)?;
    d.set_item("batches", r.batches)?;
    d.set_item("epoch", r.epoch)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("max_frozen_seconds", r.max_frozen_seconds)?;
    d.set_item("delta_rows", r.delta_rows)?;
    Ok(d)
}
