//! One interface for the tables of a store, wherever they live.
//!
//! [`StoreApi`], [`SparseTableApi`] and [`DenseTableApi`] are implemented here for the embedded
//! store (on the public methods of [`Store`], [`SparseTable`] and [`DenseTable`]) and in
//! [`crate::client`] for the tables of store servers. Code written against the traits (the
//! Python binding, for one) works with both. What only one side has stays on its concrete type:
//! snapshots, durability and the lifecycle of the embedded store; clocks, status and health of a
//! cluster.

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

use crate::client::ClusterStats;
use crate::error::{invalid, Error, Result};
use crate::executor::PushHandle;
use crate::store::{Store, Table};
use crate::table::{
    DenseTable, DenseTableConfig, SparseTable, SparseTableConfig, TableHandle, TableStats,
};

/// What a store server does with a push made from rows pulled before other pushes changed the
/// table (its staleness: pushes applied between this worker's last pull and the push).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StalePolicy {
    /// Apply it (the default).
    #[default]
    Apply,
    /// Drop pushes staler than the table's `max_staleness`.
    Drop,
    /// Divide the learning rate by the staleness.
    Scale,
}

impl StalePolicy {
    /// `"apply"`, `"drop"` or `"scale"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Apply => "apply",
            Self::Drop => "drop",
            Self::Scale => "scale",
        }
    }
}

impl std::str::FromStr for StalePolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "apply" => Ok(Self::Apply),
            "drop" => Ok(Self::Drop),
            "scale" => Ok(Self::Scale),
            _ => Err(invalid(format!(
                "stale_policy must be \"apply\", \"drop\" or \"scale\", got {s:?}"
            ))),
        }
    }
}

/// How a table treats stale pushes: only store servers know staleness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PushPolicy {
    /// What a stale push does.
    pub stale_policy: StalePolicy,
    /// Pushes staler than this are dropped (with [`StalePolicy::Drop`]).
    pub max_staleness: u64,
    /// False when the caller left the policy unset: an existing table keeps its own (a new one
    /// gets the fields above). When true, declaring an existing table with another policy
    /// fails naming the field; a declaration never changes a table.
    pub given: bool,
}

/// A table's counters: the store's own, and for a table on store servers each server's.
#[derive(Debug, Clone)]
pub struct Stats {
    /// The counters (summed over the servers of a remote table; `lr` is the first server's).
    pub table: TableStats,
    /// Staleness and per-server details of a table on store servers.
    pub cluster: Option<ClusterStats>,
}

impl From<TableStats> for Stats {
    fn from(table: TableStats) -> Self {
        Self {
            table,
            cluster: None,
        }
    }
}

/// A sparse table: u64 id -> float32 row of `dim` values.
pub trait SparseTableApi: Send + Sync {
    /// The table's name.
    fn name(&self) -> &str;
    /// The configuration it was created with.
    fn config(&self) -> &SparseTableConfig;
    /// The row width.
    fn dim(&self) -> usize {
        self.config().dim
    }
    /// Shards of an embedded table; servers of a remote one.
    fn num_shards(&self) -> usize;
    /// True when the table's work runs in this process (on the store's threads).
    fn in_process(&self) -> bool;
    /// Rows stored.
    fn len(&self) -> Result<u64>;
    /// True when no row is stored.
    fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
    /// The update sequence number (summed over servers).
    fn seq(&self) -> Result<u64>;
    /// The learning rate in force.
    fn lr(&self) -> Result<f64>;
    /// Changes the learning rate for every later push.
    fn set_lr(&self, lr: f64) -> Result<()>;
    /// Writes the rows of `ids` into `out` (`ids.len() * dim` values, every one written on
    /// success).
    fn pull_into(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<()>;
    /// Applies gradients (`ids.len() * dim` values) after the queued asynchronous pushes.
    fn push(&self, ids: &[u64], grads: &[f32]) -> Result<()>;
    /// Queues a push and returns at once.
    fn push_async(&self, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle>;
    /// [`pull_into`](Self::pull_into), returning the table version the rows were read at: one
    /// per server of a remote table, none for an embedded one (which has no stale pushes).
    fn pull_versioned(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<Vec<u64>> {
        self.pull_into(ids, out).map(|()| Vec::new())
    }
    /// [`push`](Self::push) of gradients computed from rows read at `version` (what
    /// [`pull_versioned`](Self::pull_versioned) returned; None: a remote table uses the
    /// version its last pull of the same ids read).
    fn push_versioned(&self, ids: &[u64], grads: &[f32], version: Option<Vec<u64>>) -> Result<()> {
        let _ = version;
        self.push(ids, grads)
    }
    /// [`push_async`](Self::push_async) with a version, as [`push_versioned`](Self::push_versioned).
    fn push_async_versioned(
        &self,
        ids: Vec<u64>,
        grads: Vec<f32>,
        version: Option<Vec<u64>>,
    ) -> Result<PushHandle> {
        let _ = version;
        self.push_async(ids, grads)
    }
    /// Which ids have a row.
    fn contains(&self, ids: &[u64]) -> Result<Vec<bool>>;
    /// Removes rows; returns how many existed.
    fn remove(&self, ids: &[u64]) -> Result<u64>;
    /// Removes the rows that none of the last `steps` pushes updated, or not updated for
    /// `seconds` (either measure may be left out); returns how many. A remote table counts
    /// each server's own pushes.
    fn evict(&self, steps: Option<u64>, seconds: Option<f64>) -> Result<u64>;
    /// The values the rows of `ids` have before any update (a function of seed and id).
    fn initial_rows(&self, ids: &[u64]) -> Vec<f32> {
        self.config().initial_rows(ids)
    }
    /// Counters and sizes.
    fn stats(&self) -> Result<Stats>;
}

/// A dense float32 tensor with its own optimizer.
pub trait DenseTableApi: Send + Sync {
    /// The table's name.
    fn name(&self) -> &str;
    /// The configuration it was created with.
    fn config(&self) -> &DenseTableConfig;
    /// Pushes applied (those of the server that holds a remote table).
    fn step(&self) -> Result<u64>;
    /// The learning rate in force.
    fn lr(&self) -> Result<f64>;
    /// Changes the learning rate for every later push.
    fn set_lr(&self, lr: f64) -> Result<()>;
    /// A copy of the tensor.
    fn pull(&self) -> Result<Vec<f32>>;
    /// Applies one gradient of the whole tensor after the queued asynchronous pushes.
    fn push(&self, grad: &[f32]) -> Result<()>;
    /// Queues one gradient and returns at once.
    fn push_async(&self, grad: Vec<f32>) -> Result<PushHandle>;
    /// [`pull`](Self::pull), with the table version the value was read at: one for a remote
    /// table (its server's), none for an embedded one (which has no stale pushes).
    fn pull_versioned(&self) -> Result<(Vec<f32>, Vec<u64>)> {
        self.pull().map(|v| (v, Vec::new()))
    }
    /// [`push`](Self::push) of a gradient computed from the value read at `version` (what
    /// [`pull_versioned`](Self::pull_versioned) returned; None: a remote table uses the version
    /// of its last pull).
    fn push_versioned(&self, grad: &[f32], version: Option<Vec<u64>>) -> Result<()> {
        let _ = version;
        self.push(grad)
    }
    /// [`push_async`](Self::push_async) with a version, as [`push_versioned`](Self::push_versioned).
    fn push_async_versioned(
        &self,
        grad: Vec<f32>,
        version: Option<Vec<u64>>,
    ) -> Result<PushHandle> {
        let _ = version;
        self.push_async(grad)
    }
    /// Counters and sizes.
    fn stats(&self) -> Result<Stats>;
}

/// A table of either kind.
#[derive(Clone)]
pub enum AnyTable {
    /// A sparse table.
    Sparse(Arc<dyn SparseTableApi>),
    /// A dense table.
    Dense(Arc<dyn DenseTableApi>),
}

/// A store: the embedded one, or a client of store servers.
pub trait StoreApi: Send + Sync {
    /// Creates a sparse table (a remote store returns the existing one if it has the same
    /// config, so every worker may call it).
    fn create_sparse_table(
        &self,
        name: &str,
        config: SparseTableConfig,
        policy: PushPolicy,
    ) -> Result<Arc<dyn SparseTableApi>>;
    /// Creates a dense table.
    fn create_dense_table(
        &self,
        name: &str,
        config: DenseTableConfig,
        policy: PushPolicy,
    ) -> Result<Arc<dyn DenseTableApi>>;
    /// The table called `name`.
    fn table(&self, name: &str) -> Result<AnyTable>;
    /// The names of all tables, sorted.
    fn tables(&self) -> Result<Vec<String>>;
    /// Removes a table.
    fn drop_table(&self, name: &str) -> Result<()>;
    /// Waits up to `timeout` for this process's queued asynchronous pushes; true when none is
    /// left.
    fn flush_timeout(&self, timeout: Duration) -> bool;
    /// Waits for the queued asynchronous pushes, then makes the store durable (where it is).
    fn flush(&self) -> Result<()>;
    /// Applies (sends) what is queued; an embedded store then refuses further asynchronous
    /// pushes and releases its directory.
    fn close(&self) -> Result<()>;
}

/// The sparse table of an embedded store.
pub struct LocalSparse(pub Arc<SparseTable>);

/// The dense table of an embedded store.
pub struct LocalDense(pub Arc<DenseTable>);

/// Refuses a stale-push policy on an embedded store, which applies every push when it is made.
fn local_policy(policy: PushPolicy) -> Result<()> {
    if policy.stale_policy == StalePolicy::Apply && policy.max_staleness == 0 {
        Ok(())
    } else {
        Err(invalid(
            "stale_policy and max_staleness are for tables on store servers: an embedded store \
             applies every push when it is made",
        ))
    }
}

impl SparseTableApi for LocalSparse {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn config(&self) -> &SparseTableConfig {
        self.0.config()
    }
    fn dim(&self) -> usize {
        self.0.dim()
    }
    fn num_shards(&self) -> usize {
        self.0.num_shards()
    }
    fn in_process(&self) -> bool {
        true
    }
    fn len(&self) -> Result<u64> {
        Ok(self.0.len() as u64)
    }
    fn seq(&self) -> Result<u64> {
        Ok(self.0.seq())
    }
    fn lr(&self) -> Result<f64> {
        Ok(self.0.lr())
    }
    fn set_lr(&self, lr: f64) -> Result<()> {
        self.0.set_lr(lr)
    }
    fn pull_into(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<()> {
        self.0.pull_into(ids, out)
    }
    fn push(&self, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.0.push(ids, grads)
    }
    fn push_async(&self, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle> {
        self.0.push_async(ids, grads)
    }
    fn contains(&self, ids: &[u64]) -> Result<Vec<bool>> {
        self.0.contains(ids)
    }
    fn remove(&self, ids: &[u64]) -> Result<u64> {
        self.0.remove(ids).map(|n| n as u64)
    }
    fn evict(&self, steps: Option<u64>, seconds: Option<f64>) -> Result<u64> {
        // Rows whose version is at most seq - steps; rows last updated before now - seconds.
        let before_seq = steps.map(|n| (self.0.seq() + 1).saturating_sub(n));
        let before_secs = match seconds {
            Some(s) if s.is_nan() || s < 0.0 => {
                return Err(invalid(format!(
                    "not_updated_for_seconds must be >= 0, got {s}"
                )))
            }
            Some(s) => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                Some((now - s).max(0.0) as u32)
            }
            None => None,
        };
        self.0.evict(before_seq, before_secs).map(|n| n as u64)
    }
    fn initial_rows(&self, ids: &[u64]) -> Vec<f32> {
        self.0.initial_rows(ids)
    }
    fn stats(&self) -> Result<Stats> {
        Ok(self.0.stats().into())
    }
}

impl DenseTableApi for LocalDense {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn config(&self) -> &DenseTableConfig {
        self.0.config()
    }
    fn step(&self) -> Result<u64> {
        Ok(self.0.step().into())
    }
    fn lr(&self) -> Result<f64> {
        Ok(self.0.lr())
    }
    fn set_lr(&self, lr: f64) -> Result<()> {
        self.0.set_lr(lr)
    }
    fn pull(&self) -> Result<Vec<f32>> {
        self.0.pull()
    }
    fn push(&self, grad: &[f32]) -> Result<()> {
        self.0.push(grad)
    }
    fn push_async(&self, grad: Vec<f32>) -> Result<PushHandle> {
        self.0.push_async(grad)
    }
    fn stats(&self) -> Result<Stats> {
        Ok(self.0.stats().into())
    }
}

impl From<Table> for AnyTable {
    fn from(t: Table) -> Self {
        match t {
            Table::Sparse(t) => Self::Sparse(Arc::new(LocalSparse(t))),
            Table::Dense(t) => Self::Dense(Arc::new(LocalDense(t))),
        }
    }
}

impl StoreApi for Store {
    fn create_sparse_table(
        &self,
        name: &str,
        config: SparseTableConfig,
        policy: PushPolicy,
    ) -> Result<Arc<dyn SparseTableApi>> {
        local_policy(policy)?;
        Ok(Arc::new(LocalSparse(Store::create_sparse_table(
            self, name, config,
        )?)))
    }

    fn create_dense_table(
        &self,
        name: &str,
        config: DenseTableConfig,
        policy: PushPolicy,
    ) -> Result<Arc<dyn DenseTableApi>> {
        local_policy(policy)?;
        Ok(Arc::new(LocalDense(Store::create_dense_table(
            self, name, config,
        )?)))
    }

    fn table(&self, name: &str) -> Result<AnyTable> {
        Store::table(self, name).map(AnyTable::from)
    }

    fn tables(&self) -> Result<Vec<String>> {
        Ok(Store::tables(self))
    }

    fn drop_table(&self, name: &str) -> Result<()> {
        Store::drop_table(self, name)
    }

    fn flush_timeout(&self, timeout: Duration) -> bool {
        Store::flush_timeout(self, timeout)
    }

    fn flush(&self) -> Result<()> {
        Store::flush(self)
    }

    fn close(&self) -> Result<()> {
        Store::close(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    fn sparse(dim: usize) -> SparseTableConfig {
        SparseTableConfig {
            dim,
            optimizer: crate::optimizer::OptimizerConfig {
                kind: crate::optimizer::OptimizerKind::Sgd {
                    momentum: 0.0,
                    weight_decay: 0.0,
                    nesterov: false,
                },
                lr: 0.5,
                clip_value: None,
                clip_norm: None,
            },
            initializer: crate::init::Initializer::Zeros,
            seed: 1,
            lifecycle: Default::default(),
            refuse_nonfinite: false,
        }
    }

    #[test]
    fn the_embedded_store_through_the_traits() {
        let store: Arc<dyn StoreApi> = Arc::new(Store::new(StoreConfig::default()).unwrap());
        let t = store
            .create_sparse_table("t", sparse(2), PushPolicy::default())
            .unwrap();
        t.push(&[1, 2], &[1.0; 4]).unwrap();
        t.push_async(vec![1], vec![1.0; 2]).unwrap().wait().unwrap();
        let mut out = vec![MaybeUninit::uninit(); 4];
        t.pull_into(&[1, 2], &mut out).unwrap();
        // SAFETY: pull_into succeeded, so every element is written.
        let rows: Vec<f32> = out.iter().map(|x| unsafe { x.assume_init() }).collect();
        assert_eq!(rows, [-1.0, -1.0, -0.5, -0.5]);
        assert_eq!((t.len().unwrap(), t.seq().unwrap()), (2, 2));
        assert_eq!(t.stats().unwrap().table.pushes, 2);
        // Row 2 was last updated by push 1, so it is the one not updated by the last push.
        assert_eq!(t.evict(Some(1), None).unwrap(), 1);
        assert_eq!(t.contains(&[1, 2]).unwrap(), [true, false]);
        assert!(matches!(store.table("t").unwrap(), AnyTable::Sparse(_)));
        let scale = PushPolicy {
            stale_policy: StalePolicy::Scale,
            max_staleness: 0,
            given: true,
        };
        assert!(store.create_sparse_table("u", sparse(2), scale).is_err());
        assert_eq!(store.tables().unwrap(), ["t"]);
        store.drop_table("t").unwrap();
        store.flush().unwrap();
    }
}
