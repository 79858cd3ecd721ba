//! The embedded store: named tables sharing one thread pool and one ordered async applier.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::error::{invalid, Error, Result};
use crate::executor::Executor;
use crate::table::{
    validate_name, DenseTable, DenseTableConfig, SparseTable, SparseTableConfig, TableHandle,
};

/// How a store is built.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// Shards per sparse table (1..=65536).
    pub num_shards: usize,
    /// Threads of the store's pool (1..=1024).
    pub threads: usize,
    /// Bytes of queued asynchronous pushes before `push_async` blocks.
    pub max_inflight_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            num_shards: 64,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            max_inflight_bytes: 256 << 20,
        }
    }
}

impl StoreConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if !(1..=65536).contains(&self.num_shards) {
            return Err(invalid(format!(
                "num_shards must be in 1..=65536, got {}",
                self.num_shards
            )));
        }
        if !(1..=1024).contains(&self.threads) {
            return Err(invalid(format!(
                "threads must be in 1..=1024, got {}",
                self.threads
            )));
        }
        if self.max_inflight_bytes == 0 {
            return Err(invalid("max_inflight_bytes must be > 0"));
        }
        Ok(())
    }
}

/// A table of either kind.
#[derive(Clone)]
pub enum Table {
    /// A sparse embedding table.
    Sparse(Arc<SparseTable>),
    /// A dense tensor.
    Dense(Arc<DenseTable>),
}

/// An embedded store.
pub struct Store {
    config: StoreConfig,
    exec: Arc<Executor>,
    tables: RwLock<BTreeMap<String, Table>>,
}

impl Store {
    /// A new empty store.
    pub fn new(config: StoreConfig) -> Result<Self> {
        config.validate()?;
        let exec = Executor::new(config.threads, config.max_inflight_bytes)?;
        Ok(Self {
            config,
            exec,
            tables: RwLock::new(BTreeMap::new()),
        })
    }

    /// The store's configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    fn insert(&self, name: &str, make: impl FnOnce() -> Result<Table>) -> Result<Table> {
        validate_name(name)?;
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        if tables.contains_key(name) {
            return Err(Error::TableExists(name.to_string()));
        }
        let t = make()?;
        tables.insert(name.to_string(), t.clone());
        Ok(t)
    }

    /// Creates a sparse table.
    pub fn create_sparse_table(
        &self,
        name: &str,
        config: SparseTableConfig,
    ) -> Result<Arc<SparseTable>> {
        let t = self.insert(name, || {
            let t = SparseTable::new(
                name.to_string(),
                config,
                self.config.num_shards,
                Arc::clone(&self.exec),
            )?;
            Ok(Table::Sparse(Arc::new(t)))
        })?;
        match t {
            Table::Sparse(t) => Ok(t),
            Table::Dense(_) => Err(Error::Internal("created the wrong kind".into())),
        }
    }

    /// Creates a dense table.
    pub fn create_dense_table(
        &self,
        name: &str,
        config: DenseTableConfig,
    ) -> Result<Arc<DenseTable>> {
        let t = self.insert(name, || {
            let t = DenseTable::new(name.to_string(), config, Arc::clone(&self.exec))?;
            Ok(Table::Dense(Arc::new(t)))
        })?;
        match t {
            Table::Dense(t) => Ok(t),
            Table::Sparse(_) => Err(Error::Internal("created the wrong kind".into())),
        }
    }

    /// The table called `name`.
    pub fn table(&self, name: &str) -> Result<Table> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownTable(name.to_string()))
    }

    /// The sparse table called `name`.
    pub fn sparse(&self, name: &str) -> Result<Arc<SparseTable>> {
        match self.table(name)? {
            Table::Sparse(t) => Ok(t),
            Table::Dense(_) => Err(Error::WrongKind(format!(
                "table {name:?} is dense, not sparse"
            ))),
        }
    }

    /// The names of all tables, sorted.
    pub fn tables(&self) -> Vec<String> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.keys().cloned().collect()
    }

    /// Removes a table from the store. Handles still held refuse every later operation; pushes
    /// queued before the drop still apply to the detached table and are then discarded with it.
    pub fn drop_table(&self, name: &str) -> Result<()> {
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        match tables.remove(name) {
            Some(Table::Sparse(t)) => t.common().mark_dropped(),
            Some(Table::Dense(t)) => t.common().mark_dropped(),
            None => return Err(Error::UnknownTable(name.to_string())),
        }
        Ok(())
    }

    /// Waits up to `timeout` for every queued asynchronous push; true when none is left.
    pub fn flush_timeout(&self, timeout: Duration) -> bool {
        self.exec.flush_timeout(timeout)
    }

    /// Waits for every queued asynchronous push.
    pub fn flush(&self) {
        while !self.flush_timeout(Duration::from_secs(3600)) {}
    }

    /// Applies what is queued, then refuses further asynchronous pushes.
    pub fn close(&self) {
        self.exec.close();
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.exec.close();
    }
}
