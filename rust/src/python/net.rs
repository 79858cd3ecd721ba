//! The binding of the store server and the distributed client.
//!
//! The remote table classes have the methods of the embedded ones (`pull`, `push`, `push_async`,
//! ...), so the Python `SparseTable` and `DenseTable` classes wrap either.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArray1};
use numpy::{PyReadonlyArray2, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::{err, initializer_from, initializer_spec, optimizer_from, optimizer_spec};
use super::{lifecycle_tuple, pulled_rows, slice, sparse_config, PyPushHandle, PyStore};
use crate::client::{Client, ClientConfig};
use crate::error::Error;
use crate::net::proto::{CreateTableRequest, Dtype, StalePolicy, TableInfo, TableKind};
use crate::server::{ServerConfig, ServerHandle, Tokens};
use crate::table::{DenseTableConfig, SparseTableConfig};

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
}

impl PyServer {
    pub(super) fn of(h: ServerHandle) -> Self {
        Self {
            port: h.addr().port(),
            metrics_port: h.metrics_addr().map(|a| a.port()),
            inner: Mutex::new(Some(h)),
        }
    }
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
) -> PyResult<ServerConfig> {
    let mut cfg = ServerConfig::new(addr(host, port, "server")?);
    cfg.metrics_addr = metrics_port.map(|p| addr(host, p, "metrics")).transpose()?;
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
        tls_cert=None, tls_key=None, max_message=None
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
        )?;
        let store = Arc::clone(&store.inner);
        let h = py
            .detach(move || crate::server::start(store, cfg))
            .map_err(err)?;
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
            Some(mut h) => py
                .detach(move || h.stop(Duration::from_secs_f64(grace)))
                .map_err(err),
            None => Ok(()),
        }
    }
}

fn dtype_of(name: &str) -> PyResult<Dtype> {
    match name {
        "float32" => Ok(Dtype::Float32),
        "float16" => Ok(Dtype::Float16),
        "bfloat16" => Ok(Dtype::Bfloat16),
        _ => Err(bad(format!(
            "wire_dtype must be \"float32\", \"float16\" or \"bfloat16\", got {name:?}"
        ))),
    }
}

fn policy_of(name: &str) -> PyResult<StalePolicy> {
    match name {
        "apply" => Ok(StalePolicy::Apply),
        "drop" => Ok(StalePolicy::Drop),
        "scale" => Ok(StalePolicy::Scale),
        _ => Err(bad(format!(
            "stale_policy must be \"apply\", \"drop\" or \"scale\", got {name:?}"
        ))),
    }
}

fn policy_name(p: i32) -> &'static str {
    match StalePolicy::try_from(p) {
        Ok(StalePolicy::Drop) => "drop",
        Ok(StalePolicy::Scale) => "scale",
        _ => "apply",
    }
}

fn json<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

fn info_dict<'py>(py: Python<'py>, t: &TableInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &t.name)?;
    d.set_item(
        "kind",
        if t.kind == TableKind::Dense as i32 {
            "dense"
        } else {
            "sparse"
        },
    )?;
    d.set_item("rows", t.rows)?;
    d.set_item("seq", t.seq)?;
    d.set_item("lr", t.lr)?;
    d.set_item("stale_policy", policy_name(t.stale_policy))?;
    d.set_item("max_staleness", t.max_staleness)?;
    d.set_item("config", json(py, &t.config_json)?)?;
    d.set_item("stats", json(py, &t.stats_json)?)?;
    Ok(d)
}

/// Sums the stats of a table's servers; per-server dicts under "servers".
fn merged_stats<'py>(
    py: Python<'py>,
    infos: &[TableInfo],
    servers: &[String],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let mut sums = serde_json::Map::new();
    let mut stale = [0u64; 5];
    for t in infos {
        let v: serde_json::Value = serde_json::from_str(&t.stats_json)
            .map_err(|e| err(Error::Internal(format!("stats from a server: {e}"))))?;
        if let Some(o) = v.as_object() {
            for (k, x) in o {
                if let Some(n) = x.as_u64() {
                    let e = sums.entry(k.clone()).or_insert(serde_json::json!(0u64));
                    *e = serde_json::json!(e.as_u64().unwrap_or(0) + n);
                }
            }
            if let Some(s) = o.get("staleness") {
                let g = |k: &str| s.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                stale[0] += g("pushes");
                stale[1] += g("total");
                stale[2] = stale[2].max(g("max"));
                stale[3] += g("dropped");
                stale[4] += g("scaled");
            }
        }
    }
    for (k, v) in sums {
        d.set_item(k, v.as_u64())?;
    }
    d.set_item("lr", infos.first().map_or(0.0, |t| t.lr))?;
    let s = PyDict::new(py);
    s.set_item("pushes", stale[0])?;
    s.set_item(
        "mean",
        if stale[0] == 0 {
            0.0
        } else {
            stale[1] as f64 / stale[0] as f64
        },
    )?;
    s.set_item("max", stale[2])?;
    s.set_item("dropped", stale[3])?;
    s.set_item("scaled", stale[4])?;
    d.set_item("staleness", s)?;
    let per = PyList::empty(py);
    for (t, name) in infos.iter().zip(servers) {
        let x = info_dict(py, t)?;
        x.set_item("server", name)?;
        per.append(x)?;
    }
    d.set_item("servers", per)?;
    Ok(d)
}

/// A connection to store servers.
#[pyclass(frozen, module = "pstore._native", name = "Client")]
struct PyClient {
    inner: Arc<Client>,
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (
        servers, token=None, timeout=30.0, retries=3, wire_dtype="float32", tls_ca=None,
        tls_domain=None, max_message=None, max_inflight_bytes=None
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
    ) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(bad(format!("timeout must be > 0 seconds, got {timeout}")));
        }
        let mut c = ClientConfig::new(servers);
        c.token = token;
        c.timeout = Duration::from_secs_f64(timeout);
        c.retries = retries;
        c.wire = dtype_of(wire_dtype)?;
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
        let inner = py.detach(move || Client::connect(c)).map_err(err)?;
        Ok(Self { inner })
    }

    #[getter]
    fn servers(&self) -> Vec<String> {
        self.inner.servers()
    }

    #[getter]
    fn wire_dtype(&self) -> &'static str {
        match self.inner.config().wire {
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
        }
    }

    /// The gRPC health status of every server.
    fn health(&self, py: Python<'_>) -> Vec<String> {
        let c = &self.inner;
        py.detach(|| c.health())
    }

    /// The status of every server, as dicts.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let c = &self.inner;
        let all = py.detach(|| c.status()).map_err(err)?;
        let out = PyList::empty(py);
        for (s, name) in all.iter().zip(c.servers()) {
            let d = PyDict::new(py);
            d.set_item("server", name)?;
            d.set_item("version", &s.version)?;
            d.set_item("protocol", s.protocol)?;
            d.set_item("path", (!s.path.is_empty()).then_some(&s.path))?;
            d.set_item("durability", &s.durability)?;
            d.set_item("uptime_seconds", s.uptime_seconds)?;
            d.set_item("max_message_bytes", s.max_message_bytes)?;
            d.set_item("flush_lag_seconds", s.flush_lag_seconds)?;
            d.set_item("role", if s.role.is_empty() { "store" } else { &s.role })?;
            d.set_item(
                "model_json",
                (!s.model_json.is_empty()).then_some(&s.model_json),
            )?;
            let tables = PyList::empty(py);
            for t in &s.tables {
                tables.append(info_dict(py, t)?)?;
            }
            d.set_item("tables", tables)?;
            let clocks = s.clocks.clone().unwrap_or_default();
            d.set_item("clocks", clocks.clocks)?;
            out.append(d)?;
        }
        Ok(out)
    }

    #[pyo3(signature = (
        name, dim, optimizer, initializer, seed, admit_after, max_rows, evict_policy,
        stale_policy="apply", max_staleness=0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn create_sparse_table(
        &self,
        py: Python<'_>,
        name: &str,
        dim: usize,
        optimizer: &Bound<'_, PyDict>,
        initializer: &Bound<'_, PyDict>,
        seed: u64,
        admit_after: u32,
        max_rows: Option<u64>,
        evict_policy: &str,
        stale_policy: &str,
        max_staleness: u64,
    ) -> PyResult<PyRemoteSparse> {
        let config = sparse_config(
            dim,
            optimizer,
            initializer,
            seed,
            admit_after,
            max_rows,
            evict_policy,
        )?;
        config.validate().map_err(err)?;
        let req = CreateTableRequest {
            name: name.to_string(),
            kind: TableKind::Sparse as i32,
            config_json: serde_json::to_string(&config)
                .map_err(|e| err(Error::Internal(e.to_string())))?,
            stale_policy: policy_of(stale_policy)? as i32,
            max_staleness,
        };
        crate::table::validate_name(name).map_err(err)?;
        let c = &self.inner;
        py.detach(|| c.create_table(req)).map_err(err)?;
        Ok(PyRemoteSparse {
            client: Arc::clone(&self.inner),
            name: name.to_string(),
            config,
        })
    }

    #[pyo3(signature = (name, shape, optimizer, initializer, seed, stale_policy="apply", max_staleness=0))]
    #[allow(clippy::too_many_arguments)]
    fn create_dense_table(
        &self,
        py: Python<'_>,
        name: &str,
        shape: Vec<usize>,
        optimizer: &Bound<'_, PyDict>,
        initializer: &Bound<'_, PyDict>,
        seed: u64,
        stale_policy: &str,
        max_staleness: u64,
    ) -> PyResult<PyRemoteDense> {
        let config = DenseTableConfig {
            shape,
            optimizer: optimizer_from(optimizer)?,
            initializer: initializer_from(initializer)?,
            seed,
        };
        config.validate().map_err(err)?;
        crate::table::validate_name(name).map_err(err)?;
        let req = CreateTableRequest {
            name: name.to_string(),
            kind: TableKind::Dense as i32,
            config_json: serde_json::to_string(&config)
                .map_err(|e| err(Error::Internal(e.to_string())))?,
            stale_policy: policy_of(stale_policy)? as i32,
            max_staleness,
        };
        let c = &self.inner;
        py.detach(|| c.create_table(req)).map_err(err)?;
        Ok(PyRemoteDense {
            client: Arc::clone(&self.inner),
            name: name.to_string(),
            config,
        })
    }

    /// The table called `name`, as a RemoteSparseTable or RemoteDenseTable.
    fn table(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let c = &self.inner;
        let infos = py.detach(|| c.get_table(name)).map_err(err)?;
        let info = infos
            .first()
            .ok_or_else(|| err(Error::UnknownTable(name.to_string())))?;
        let bad_config = |e: serde_json::Error| {
            err(Error::Internal(format!(
                "table {name:?}: the server sent a config this client cannot read: {e}"
            )))
        };
        Ok(if info.kind == TableKind::Dense as i32 {
            let config: DenseTableConfig =
                serde_json::from_str(&info.config_json).map_err(bad_config)?;
            Py::new(
                py,
                PyRemoteDense {
                    client: Arc::clone(&self.inner),
                    name: name.to_string(),
                    config,
                },
            )?
            .into_any()
        } else {
            let config: SparseTableConfig =
                serde_json::from_str(&info.config_json).map_err(bad_config)?;
            Py::new(
                py,
                PyRemoteSparse {
                    client: Arc::clone(&self.inner),
                    name: name.to_string(),
                    config,
                },
            )?
            .into_any()
        })
    }

    fn tables(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let c = &self.inner;
        py.detach(|| c.list_tables()).map_err(err)
    }

    fn drop_table(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        let c = &self.inner;
        py.detach(|| c.drop_table(name)).map_err(err)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let c = &self.inner;
        py.detach(|| c.flush()).map_err(err)
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
        let r = py.detach(|| c.snapshot(dir, incremental)).map_err(err)?;
        Ok(r.into_iter().map(|s| (s.dir, s.rows)).collect())
    }

    /// Waits until every queued asynchronous push has been answered.
    fn drain(&self, py: Python<'_>) {
        let c = &self.inner;
        py.detach(|| c.drain());
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
        let r = py
            .detach(|| c.clock(worker, num_workers, clock, staleness, t))
            .map_err(err)?;
        Ok(r.clocks)
    }
}

/// The methods both remote table kinds share.
macro_rules! remote_methods {
    ($ty:ident { $($own:tt)* }) => {
        #[pymethods]
        impl $ty {
            #[getter]
            fn name(&self) -> &str {
                &self.name
            }

            #[getter]
            fn seed(&self) -> u64 {
                self.config.seed
            }

            #[getter]
            fn optimizer_name(&self) -> &'static str {
                self.config.optimizer.name()
            }

            /// The learning rate in force on the servers.
            #[getter]
            fn lr(&self, py: Python<'_>) -> PyResult<f64> {
                let (c, n) = (&self.client, &self.name);
                let infos = py.detach(|| c.get_table(n)).map_err(err)?;
                Ok(infos.first().map_or(self.config.optimizer.lr, |t| t.lr))
            }

            fn set_lr(&self, py: Python<'_>, lr: f64) -> PyResult<()> {
                let (c, n) = (&self.client, &self.name);
                py.detach(|| c.set_lr(n, lr)).map_err(err)
            }

            fn optimizer_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                optimizer_spec(py, &self.config.optimizer)
            }

            fn initializer_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                initializer_spec(py, &self.config.initializer)
            }

            /// The servers' counters summed (per server under "servers"), with staleness.
            fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let (c, n) = (&self.client, &self.name);
                let infos = py.detach(|| c.get_table(n)).map_err(err)?;
                merged_stats(py, &infos, &self.client.servers())
            }

            /// The addresses of the servers.
            #[getter]
            fn servers(&self) -> Vec<String> {
                self.client.servers()
            }

            $($own)*
        }
    };
}

/// A sparse table on store servers.
#[pyclass(frozen, module = "pstore._native", name = "RemoteSparseTable")]
struct PyRemoteSparse {
    client: Arc<Client>,
    name: String,
    config: SparseTableConfig,
}

impl PyRemoteSparse {
    fn check_cols(&self, grads: &PyReadonlyArray2<'_, f32>) -> PyResult<()> {
        let cols = grads.shape()[1];
        if cols != self.config.dim {
            return Err(err(Error::Shape(format!(
                "table {:?} has dim {}, but grads have {} columns",
                self.name, self.config.dim, cols
            ))));
        }
        Ok(())
    }
}

remote_methods!(PyRemoteSparse {
    #[getter]
    fn dim(&self) -> usize {
        self.config.dim
    }

    /// The number of servers the rows are spread over.
    #[getter]
    fn num_shards(&self) -> usize {
        self.client.servers().len()
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        let (c, n) = (&self.client, &self.name);
        let infos = py.detach(|| c.get_table(n)).map_err(err)?;
        Ok(infos.iter().map(|t| t.rows as usize).sum())
    }

    fn pull<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids_s = slice(&ids, "ids")?;
        let (n, dim) = (ids_s.len(), self.config.dim);
        let (c, name) = (&self.client, &self.name);
        pulled_rows(py, n, dim, |out| c.pull_into(name, dim, ids_s, out))
    }

    fn push(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let (ids_s, grads_s) = (slice(&ids, "ids")?, slice(&grads, "grads")?);
        self.check_cols(&grads)?;
        let (c, name, dim) = (&self.client, &self.name, self.config.dim);
        py.detach(|| c.push(name, dim, ids_s, grads_s)).map_err(err)
    }

    fn push_async(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<PyPushHandle> {
        let (ids_s, grads_s) = (slice(&ids, "ids")?, slice(&grads, "grads")?);
        self.check_cols(&grads)?;
        let (c, name, dim) = (&self.client, &self.name, self.config.dim);
        let h = py
            .detach(|| c.push_async(name, dim, ids_s.to_vec(), grads_s.to_vec()))
            .map_err(err)?;
        Ok(PyPushHandle { inner: h })
    }

    fn contains<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids_s = slice(&ids, "ids")?;
        let (c, name) = (&self.client, &self.name);
        Ok(py
            .detach(|| c.contains(name, ids_s))
            .map_err(err)?
            .into_pyarray(py))
    }

    fn remove(&self, py: Python<'_>, ids: PyReadonlyArray1<'_, u64>) -> PyResult<u64> {
        let ids_s = slice(&ids, "ids")?;
        let (c, name) = (&self.client, &self.name);
        py.detach(|| c.remove(name, ids_s)).map_err(err)
    }

    /// Removes rows that none of each server's last `steps` pushes updated, or not updated for
    /// `seconds` (0: not by that measure).
    #[pyo3(signature = (steps=0, seconds=0.0))]
    fn evict_remote(&self, py: Python<'_>, steps: u64, seconds: f64) -> PyResult<u64> {
        let (c, name) = (&self.client, &self.name);
        py.detach(|| c.evict(name, steps, seconds)).map_err(err)
    }

    /// The servers' update sequence numbers summed.
    #[getter]
    fn seq(&self, py: Python<'_>) -> PyResult<u64> {
        let (c, n) = (&self.client, &self.name);
        let infos = py.detach(|| c.get_table(n)).map_err(err)?;
        Ok(infos.iter().map(|t| t.seq).sum())
    }

    #[getter]
    fn lifecycle(&self) -> (u32, Option<u64>, &'static str) {
        lifecycle_tuple(&self.config.lifecycle)
    }

    /// Computed here: a row's initial value is a function of (seed, id) alone.
    fn initial_rows<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids_s = slice(&ids, "ids")?;
        let rows = self.config.initial_rows(ids_s);
        rows.into_pyarray(py).reshape([ids_s.len(), self.config.dim])
    }
});

/// A dense table on the store server its name routes to.
#[pyclass(frozen, module = "pstore._native", name = "RemoteDenseTable")]
struct PyRemoteDense {
    client: Arc<Client>,
    name: String,
    config: DenseTableConfig,
}

remote_methods!(PyRemoteDense {
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.config.shape.clone()
    }

    /// Pushes applied (the home server's count).
    #[getter]
    fn step(&self, py: Python<'_>) -> PyResult<u64> {
        let (c, n) = (&self.client, &self.name);
        let infos = py.detach(|| c.get_table(n)).map_err(err)?;
        Ok(infos
            .get(self.client.dense_home(n))
            .map_or(0, |t| t.seq))
    }

    fn pull<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let (c, n, numel) = (&self.client, &self.name, self.config.numel());
        let v = py.detach(|| c.dense_pull(n, numel)).map_err(err)?;
        v.into_pyarray(py).reshape(self.config.shape.clone())
    }

    fn push(&self, py: Python<'_>, grad: PyReadonlyArrayDyn<'_, f32>) -> PyResult<()> {
        self.check_shape(&grad)?;
        let g = slice(&grad, "grad")?;
        let (c, n) = (&self.client, &self.name);
        py.detach(|| c.dense_push(n, g)).map_err(err)
    }

    fn push_async(&self, py: Python<'_>, grad: PyReadonlyArrayDyn<'_, f32>) -> PyResult<PyPushHandle> {
        self.check_shape(&grad)?;
        let g = slice(&grad, "grad")?;
        let (c, n) = (&self.client, &self.name);
        let h = py
            .detach(|| c.dense_push_async(n, g.to_vec()))
            .map_err(err)?;
        Ok(PyPushHandle { inner: h })
    }
});

impl PyRemoteDense {
    fn check_shape(&self, grad: &PyReadonlyArrayDyn<'_, f32>) -> PyResult<()> {
        if grad.shape() != self.config.shape.as_slice() {
            return Err(err(Error::Shape(format!(
                "table {:?}: gradient must have shape {:?}, got {:?}",
                self.name,
                self.config.shape,
                grad.shape()
            ))));
        }
        Ok(())
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyServer>()?;
    m.add_class::<PyClient>()?;
    m.add_class::<PyRemoteSparse>()?;
    m.add_class::<PyRemoteDense>()?;
    Ok(())
}
