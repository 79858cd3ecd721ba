//! The tables of store servers behind the interface of [`crate::api`]: what the requests of
//! [`Client`] mean as tables, and the servers' answers merged into one.

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

use super::Client;
use crate::api::{
    AnyTable, DenseTableApi, PushPolicy, SparseTableApi, StalePolicy, Stats, StoreApi,
};
use crate::error::{Error, Result};
use crate::executor::PushHandle;
use crate::net::proto::{self, CreateTableRequest, TableInfo, TableKind};
use crate::table::{DenseTableConfig, SparseTableConfig, TableStats};

/// A table as one server reports it.
#[derive(Debug, Clone)]
pub struct ServerTable {
    /// The server's address.
    pub server: String,
    /// The table's name.
    pub name: String,
    /// `"sparse"` or `"dense"`.
    pub kind: &'static str,
    /// Rows on that server.
    pub rows: u64,
    /// That server's update sequence number.
    pub seq: u64,
    /// Its learning rate.
    pub lr: f64,
    /// Its stale-push policy.
    pub stale_policy: StalePolicy,
    /// Its staleness bound.
    pub max_staleness: u64,
    /// The table's config, as JSON.
    pub config_json: String,
    /// The server's counters, as JSON.
    pub stats_json: String,
}

impl ServerTable {
    /// The table of `info`, as server `server` sent it.
    pub fn of(server: &str, info: &TableInfo) -> Self {
        Self {
            server: server.to_string(),
            name: info.name.clone(),
            kind: if info.kind == TableKind::Dense as i32 {
                "dense"
            } else {
                "sparse"
            },
            rows: info.rows,
            seq: info.seq,
            lr: info.lr,
            stale_policy: match proto::StalePolicy::try_from(info.stale_policy) {
                Ok(proto::StalePolicy::Drop) => StalePolicy::Drop,
                Ok(proto::StalePolicy::Scale) => StalePolicy::Scale,
                _ => StalePolicy::Apply,
            },
            max_staleness: info.max_staleness,
            config_json: info.config_json.clone(),
            stats_json: info.stats_json.clone(),
        }
    }
}

/// What one server reports about itself.
#[derive(Debug, Clone)]
pub struct ServerStatus {
    /// The server's address.
    pub server: String,
    /// Its pstore version.
    pub version: String,
    /// The protocol version it speaks.
    pub protocol: u32,
    /// Its store directory, if durable.
    pub path: Option<String>,
    /// Its durability mode.
    pub durability: String,
    /// Seconds since it started.
    pub uptime_seconds: f64,
    /// The largest message it accepts.
    pub max_message_bytes: u64,
    /// Seconds since its replica last committed everything applied.
    pub flush_lag_seconds: f64,
    /// `"store"` or `"model"`.
    pub role: String,
    /// A model server's artifact state, as JSON.
    pub model_json: Option<String>,
    /// Replication: the server's role in its replica group and its log or lag, as JSON
    /// (`None` for a server that keeps no replication log).
    pub replication_json: Option<String>,
    /// Its tables.
    pub tables: Vec<ServerTable>,
    /// The training clocks of the workers it coordinates.
    pub clocks: Vec<u64>,
}

/// The staleness of the pushes a table's servers received.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Staleness {
    /// Pushes whose staleness was measured.
    pub pushes: u64,
    /// Their mean staleness.
    pub mean: f64,
    /// The largest.
    pub max: u64,
    /// Pushes dropped as too stale.
    pub dropped: u64,
    /// Pushes applied with a scaled learning rate.
    pub scaled: u64,
    /// Pushes per staleness bucket; bucket `k` holds staleness up to `buckets[k]`, the last one
    /// (one longer than `buckets`) the rest.
    pub histogram: Vec<u64>,
    /// The upper bounds of the histogram's buckets.
    pub buckets: Vec<u64>,
}

/// What only a table on store servers reports.
#[derive(Debug, Clone)]
pub struct ClusterStats {
    /// Over every server.
    pub staleness: Staleness,
    /// Each server's view, in the order of the client's list.
    pub servers: Vec<ServerTable>,
}

fn stale_proto(p: StalePolicy) -> proto::StalePolicy {
    match p {
        StalePolicy::Apply => proto::StalePolicy::Apply,
        StalePolicy::Drop => proto::StalePolicy::Drop,
        StalePolicy::Scale => proto::StalePolicy::Scale,
    }
}

/// Sums the servers' counters of one table.
fn merge(infos: &[TableInfo], servers: &[String]) -> Result<Stats> {
    let mut t = TableStats {
        rows: 0,
        bytes_used: 0,
        huge_page_bytes: 0,
        pushes: 0,
        pulls: 0,
        ids_pushed: 0,
        ids_pulled: 0,
        rows_updated: 0,
        rows_created: 0,
        rows_evicted: 0,
        rows_nonfinite: 0,
        seq: 0,
        rows_unloaded: 0,
        lr: infos.first().map_or(0.0, |i| i.lr),
    };
    let (mut st, mut total) = (Staleness::default(), 0u64);
    for info in infos {
        let v: serde_json::Value = serde_json::from_str(&info.stats_json)
            .map_err(|e| Error::Internal(format!("stats from a server: {e}")))?;
        let g = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
        t.rows += g(&v, "rows");
        t.bytes_used += g(&v, "bytes_used");
        t.huge_page_bytes += g(&v, "huge_page_bytes");
        // One per push over all servers (servers of this version count each push once, on
        // the request without `uncounted`); each server's own applies are under "servers".
        t.pushes += match v.get("pushes_counted") {
            Some(_) => g(&v, "pushes_counted"),
            None => g(&v, "pushes"),
        };
        t.pulls += g(&v, "pulls");
        t.ids_pushed += g(&v, "ids_pushed");
        t.ids_pulled += g(&v, "ids_pulled");
        t.rows_updated += g(&v, "rows_updated");
        t.rows_created += g(&v, "rows_created");
        t.rows_evicted += g(&v, "rows_evicted");
        t.rows_nonfinite += g(&v, "rows_nonfinite");
        t.seq += g(&v, "seq");
        t.rows_unloaded += g(&v, "rows_unloaded");
        if let Some(s) = v.get("staleness") {
            st.pushes += g(s, "pushes");
            total += g(s, "total");
            st.max = st.max.max(g(s, "max"));
            st.dropped += g(s, "dropped");
            st.scaled += g(s, "scaled");
            if let Some(h) = s.get("histogram").and_then(|h| h.as_array()) {
                st.histogram.resize(st.histogram.len().max(h.len()), 0);
                for (a, b) in st.histogram.iter_mut().zip(h) {
                    *a += b.as_u64().unwrap_or(0);
                }
            }
            if let Some(b) = v.get("staleness_buckets").and_then(|b| b.as_array()) {
                st.buckets = b.iter().filter_map(|x| x.as_u64()).collect();
            }
        }
    }
    if st.pushes > 0 {
        st.mean = total as f64 / st.pushes as f64;
    }
    Ok(Stats {
        table: t,
        cluster: Some(ClusterStats {
            staleness: st,
            servers: infos
                .iter()
                .zip(servers)
                .map(|(i, s)| ServerTable::of(s, i))
                .collect(),
        }),
    })
}

impl Client {
    /// Creates a table on every server (or checks that the same one exists).
    fn create<C: serde::Serialize>(
        &self,
        name: &str,
        kind: TableKind,
        config: &C,
        policy: PushPolicy,
    ) -> Result<()> {
        crate::table::validate_name(name)?;
        let req = CreateTableRequest {
            name: name.to_string(),
            kind: kind as i32,
            config_json: serde_json::to_string(config)
                .map_err(|e| Error::Internal(e.to_string()))?,
            stale_policy: stale_proto(policy.stale_policy) as i32,
            max_staleness: policy.max_staleness,
            policy_unset: !policy.given,
        };
        // The list the servers hold now: this client's may be older (a server that left since
        // may be stopped). Not asked: a server lacking the table gets it when it first refuses
        // it (`definitions.rs`).
        let _ = self.follow_held_of(true);
        let before = self.servers();
        self.create_table(req.clone())?;
        // A server joined meanwhile (`add_server` may have copied the definitions before this
        // create reached the others): create over the list the servers hold now, which is
        // accepted where the table exists (decision 0110).
        if self.follow_held_of(true).is_ok() && self.servers() != before {
            self.create_table(req)?;
        }
        Ok(())
    }

    /// Creates a sparse table on every server (or checks that the same one exists).
    pub fn create_sparse_table(
        self: &Arc<Self>,
        name: &str,
        config: SparseTableConfig,
        policy: PushPolicy,
    ) -> Result<RemoteSparse> {
        config.validate()?;
        self.create(name, TableKind::Sparse, &config, policy)?;
        Ok(RemoteSparse {
            client: Arc::clone(self),
            name: name.to_string(),
            config,
        })
    }

    /// Creates a dense table on every server (or checks that the same one exists).
    pub fn create_dense_table(
        self: &Arc<Self>,
        name: &str,
        config: DenseTableConfig,
        policy: PushPolicy,
    ) -> Result<RemoteDense> {
        config.validate()?;
        self.create(name, TableKind::Dense, &config, policy)?;
        Ok(RemoteDense {
            client: Arc::clone(self),
            name: name.to_string(),
            config,
        })
    }

    /// The table called `name`, with the config the servers hold.
    pub fn open_table(self: &Arc<Self>, name: &str) -> Result<AnyTable> {
        let infos = self.get_table(name)?;
        let info = infos
            .first()
            .ok_or_else(|| Error::UnknownTable(name.to_string()))?;
        let bad = |e: serde_json::Error| {
            Error::Internal(format!(
                "table {name:?}: the server sent a config this client cannot read: {e}"
            ))
        };
        let (client, name) = (Arc::clone(self), name.to_string());
        Ok(if info.kind == TableKind::Dense as i32 {
            let config = serde_json::from_str(&info.config_json).map_err(bad)?;
            AnyTable::Dense(Arc::new(RemoteDense {
                client,
                name,
                config,
            }))
        } else {
            let config = serde_json::from_str(&info.config_json).map_err(bad)?;
            AnyTable::Sparse(Arc::new(RemoteSparse {
                client,
                name,
                config,
            }))
        })
    }

    /// A table's counters summed over the servers, with staleness and each server's view.
    pub fn stats(&self, name: &str) -> Result<Stats> {
        merge(&self.get_table(name)?, &self.servers())
    }

    /// The status of every server, in the order of the list.
    pub fn server_status(&self) -> Result<Vec<ServerStatus>> {
        let all = self.status()?;
        Ok(all
            .into_iter()
            .zip(self.servers())
            .map(|(s, server)| ServerStatus {
                tables: s
                    .tables
                    .iter()
                    .map(|t| ServerTable::of(&server, t))
                    .collect(),
                server,
                version: s.version,
                protocol: s.protocol,
                path: (!s.path.is_empty()).then_some(s.path),
                durability: s.durability,
                uptime_seconds: s.uptime_seconds,
                max_message_bytes: s.max_message_bytes,
                flush_lag_seconds: s.flush_lag_seconds,
                role: if s.role.is_empty() {
                    "store".to_string()
                } else {
                    s.role
                },
                model_json: (!s.model_json.is_empty()).then_some(s.model_json),
                replication_json: (!s.replication_json.is_empty()).then_some(s.replication_json),
                clocks: s.clocks.unwrap_or_default().clocks,
            })
            .collect())
    }
}

/// A sparse table spread over store servers by id.
pub struct RemoteSparse {
    client: Arc<Client>,
    name: String,
    config: SparseTableConfig,
}

/// A dense table held whole by the server its name routes to.
pub struct RemoteDense {
    client: Arc<Client>,
    name: String,
    config: DenseTableConfig,
}

impl SparseTableApi for RemoteSparse {
    fn name(&self) -> &str {
        &self.name
    }
    fn config(&self) -> &SparseTableConfig {
        &self.config
    }
    fn num_shards(&self) -> usize {
        self.client.n()
    }
    fn in_process(&self) -> bool {
        false
    }
    fn len(&self) -> Result<u64> {
        Ok(self
            .client
            .get_table(&self.name)?
            .iter()
            .map(|t| t.rows)
            .sum())
    }
    fn seq(&self) -> Result<u64> {
        Ok(self
            .client
            .get_table(&self.name)?
            .iter()
            .map(|t| t.seq)
            .sum())
    }
    fn lr(&self) -> Result<f64> {
        let infos = self.client.get_table(&self.name)?;
        Ok(infos.first().map_or(self.config.optimizer.lr, |t| t.lr))
    }
    fn set_lr(&self, lr: f64) -> Result<()> {
        self.client.set_lr(&self.name, lr)
    }
    fn pull_into(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<()> {
        self.client.pull_into(&self.name, self.config.dim, ids, out)
    }
    fn push(&self, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.client
            .push(&self.name, self.config.dim, ids, grads, None)
    }
    fn push_async(&self, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle> {
        self.client
            .push_async(&self.name, self.config.dim, ids, grads, None)
    }
    fn pull_versioned(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<Vec<u64>> {
        self.client
            .pull_versioned(&self.name, self.config.dim, ids, out)
    }
    fn push_versioned(&self, ids: &[u64], grads: &[f32], version: Option<Vec<u64>>) -> Result<()> {
        self.client
            .push(&self.name, self.config.dim, ids, grads, version)
    }
    fn push_async_versioned(
        &self,
        ids: Vec<u64>,
        grads: Vec<f32>,
        version: Option<Vec<u64>>,
    ) -> Result<PushHandle> {
        self.client
            .push_async(&self.name, self.config.dim, ids, grads, version)
    }
    fn contains(&self, ids: &[u64]) -> Result<Vec<bool>> {
        self.client.contains(&self.name, ids)
    }
    fn remove(&self, ids: &[u64]) -> Result<u64> {
        self.client.remove(&self.name, ids)
    }
    fn evict(&self, steps: Option<u64>, seconds: Option<f64>) -> Result<u64> {
        // 0 leaves a measure out on the servers.
        self.client
            .evict(&self.name, steps.unwrap_or(0), seconds.unwrap_or(0.0))
    }
    fn stats(&self) -> Result<Stats> {
        self.client.stats(&self.name)
    }
}

impl DenseTableApi for RemoteDense {
    fn name(&self) -> &str {
        &self.name
    }
    fn config(&self) -> &DenseTableConfig {
        &self.config
    }
    fn step(&self) -> Result<u64> {
        let infos = self.client.get_table(&self.name)?;
        Ok(infos
            .get(self.client.dense_home(&self.name))
            .map_or(0, |t| t.seq))
    }
    fn lr(&self) -> Result<f64> {
        let infos = self.client.get_table(&self.name)?;
        Ok(infos.first().map_or(self.config.optimizer.lr, |t| t.lr))
    }
    fn set_lr(&self, lr: f64) -> Result<()> {
        self.client.set_lr(&self.name, lr)
    }
    fn pull(&self) -> Result<Vec<f32>> {
        self.client.dense_pull(&self.name, self.config.numel())
    }
    fn push(&self, grad: &[f32]) -> Result<()> {
        self.client.dense_push(&self.name, grad)
    }
    fn push_async(&self, grad: Vec<f32>) -> Result<PushHandle> {
        self.client.dense_push_async(&self.name, grad)
    }
    fn pull_versioned(&self) -> Result<(Vec<f32>, Vec<u64>)> {
        let (v, version) = self
            .client
            .dense_pull_versioned(&self.name, self.config.numel())?;
        Ok((v, vec![version]))
    }
    fn push_versioned(&self, grad: &[f32], version: Option<Vec<u64>>) -> Result<()> {
        let v = one_version(version)?;
        self.client.dense_push_versioned(&self.name, grad, v)
    }
    fn push_async_versioned(
        &self,
        grad: Vec<f32>,
        version: Option<Vec<u64>>,
    ) -> Result<PushHandle> {
        let v = one_version(version)?;
        self.client.dense_push_async_versioned(&self.name, grad, v)
    }
    fn stats(&self) -> Result<Stats> {
        self.client.stats(&self.name)
    }
}

/// The version of a dense table's pull: one number (its server's).
fn one_version(version: Option<Vec<u64>>) -> Result<Option<u64>> {
    match version.as_deref() {
        None => Ok(None),
        Some([v]) => Ok(Some(*v)),
        Some(v) => Err(crate::error::invalid(format!(
            "a dense table's version is one number (what pull(return_version=True) returned), \
             got {} numbers",
            v.len()
        ))),
    }
}

/// A client's servers as one store.
pub struct ClusterStore(pub Arc<Client>);

impl StoreApi for ClusterStore {
    fn create_sparse_table(
        &self,
        name: &str,
        config: SparseTableConfig,
        policy: PushPolicy,
    ) -> Result<Arc<dyn SparseTableApi>> {
        Ok(Arc::new(self.0.create_sparse_table(name, config, policy)?))
    }

    fn create_dense_table(
        &self,
        name: &str,
        config: DenseTableConfig,
        policy: PushPolicy,
    ) -> Result<Arc<dyn DenseTableApi>> {
        Ok(Arc::new(self.0.create_dense_table(name, config, policy)?))
    }

    fn table(&self, name: &str) -> Result<AnyTable> {
        self.0.open_table(name)
    }

    fn tables(&self) -> Result<Vec<String>> {
        let mut t = self.0.list_tables()?;
        t.sort();
        Ok(t)
    }

    fn drop_table(&self, name: &str) -> Result<()> {
        self.0.drop_table(name).map(drop)
    }

    fn flush_timeout(&self, timeout: Duration) -> bool {
        self.0.drain_timeout(timeout)
    }

    fn flush(&self) -> Result<()> {
        Client::flush(&self.0)
    }

    fn close(&self) -> Result<()> {
        self.0.drain();
        Ok(())
    }
}
