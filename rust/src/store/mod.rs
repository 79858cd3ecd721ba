//! The embedded store: named tables sharing one thread pool and one ordered async applier, and,
//! when it has a path, an LMDB replica kept by a background flusher.
//!
//! The top of the core's layers: it composes the tables (`table`), their durability (`durable`,
//! `storage`) and snapshots (`snapshot`); none of those names the store (tests/layers.rs).
//! `snapshot.rs` holds the store's snapshot and restore methods.

mod snapshot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use crate::durable::{
    dense_key, restore_counters, table_key, Durability, Flusher, TableRecord, CYCLE_KEY,
};
use crate::error::{corrupt, invalid, storage, Error, Result};
use crate::executor::Executor;
use crate::storage::{words_into, Db, Storage, DEFAULT_MAP_SIZE};
pub use crate::table::Table;
use crate::table::{
    validate_name, Backing, BudgetGuard, ChangeHook, Common, DenseTable, DenseTableConfig,
    GuardCell, RowSource, SparseTable, SparseTableConfig,
};

/// Where and how a durable store keeps its replica.
#[derive(Debug, Clone, PartialEq)]
pub struct DurableConfig {
    /// The store directory.
    pub path: PathBuf,
    /// When pushes are durable.
    pub durability: Durability,
    /// How often the flusher commits in `async` mode.
    pub flush_interval: Duration,
    /// The LMDB map to start with, per environment (it doubles when full).
    pub map_size: usize,
    /// LMDB environments of a new store, each written by a thread of its own (an existing store
    /// keeps the number it was created with). See docs/FORMAT.md.
    pub environments: usize,
}

impl DurableConfig {
    /// A durable store at `path` with the defaults: `async`, every second.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            durability: Durability::Async,
            flush_interval: Duration::from_secs(1),
            map_size: DEFAULT_MAP_SIZE,
            environments: 1,
        }
    }
}

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

/// An embedded store.
pub struct Store {
    config: StoreConfig,
    exec: Arc<Executor>,
    tables: Arc<RwLock<BTreeMap<String, Table>>>,
    /// The flusher of a durable store, until it is closed.
    flusher: Mutex<Option<Arc<Flusher>>>,
    path: Option<PathBuf>,
    /// Snapshots of an in-memory store: the id of the last one (the parent of an increment).
    pub(crate) last_snapshot: Mutex<Option<crate::snapshot::Parent>>,
    /// What the `max_rows` budgets of its tables may evict, set by the server serving it.
    guard: GuardCell,
}

impl Store {
    /// A new empty in-memory store.
    pub fn new(config: StoreConfig) -> Result<Self> {
        config.validate()?;
        let exec = Executor::new(config.threads, config.max_inflight_bytes)?;
        Ok(Self {
            config,
            exec,
            tables: Arc::new(RwLock::new(BTreeMap::new())),
            flusher: Mutex::new(None),
            path: None,
            last_snapshot: Mutex::new(None),
            guard: GuardCell::default(),
        })
    }

    /// Opens the durable store at `durable.path`, creating it if it does not exist; tables,
    /// configs, counters and rows are those it held. Rows are not read now: each is loaded from
    /// the replica when first touched (LMDB maps the file), so opening takes the same time for
    /// any table size.
    pub fn open(config: StoreConfig, durable: DurableConfig) -> Result<Self> {
        config.validate()?;
        if durable.flush_interval.is_zero() {
            return Err(invalid("flush_interval must be > 0"));
        }
        let (st, _created) =
            Storage::open(&durable.path, true, durable.map_size, durable.environments)?;
        let st = Arc::new(st);
        let (records, cycle) = st.read(|r| {
            // The last cycle any environment committed (with several, a crash between their
            // commits can leave one ahead of `meta`): cycles go on from there.
            let mut cycle = r
                .meta(CYCLE_KEY)?
                .map(|v| crate::storage::cycle_of(&v))
                .unwrap_or(0);
            for k in 1..st.environments() {
                let c = r.part_meta(k, CYCLE_KEY)?;
                cycle = cycle.max(c.map_or(0, |v| crate::storage::cycle_of(&v)));
            }
            let mut out = Vec::new();
            for (k, v) in r.meta_prefix("table/")? {
                let name = k["table/".len()..].to_string();
                let rec: TableRecord = serde_json::from_slice(&v).map_err(|e| {
                    corrupt(format!(
                        "{}: the record of table {name:?} is not readable: {e}",
                        durable.path.display()
                    ))
                })?;
                let key = crate::durable::applied_key(&name);
                let mut applied = vec![r.meta(&key)?];
                let dense = match rec {
                    TableRecord::Dense { .. } => r.meta(&dense_key(&name))?,
                    TableRecord::Sparse { .. } => {
                        // Each environment keeps the ids of the writes whose rows it holds.
                        for k in 1..st.environments() {
                            applied.push(r.part_meta(k, &key)?);
                        }
                        None
                    }
                };
                out.push((name, rec, dense, applied));
            }
            Ok((out, cycle))
        })?;
        let exec = Executor::new(config.threads, config.max_inflight_bytes)?;
        let tables = Arc::new(RwLock::new(BTreeMap::new()));
        let flusher = Flusher::start(
            Arc::clone(&st),
            durable.durability,
            durable.flush_interval,
            Arc::clone(&tables),
            cycle,
        )?;
        let store = Self {
            config,
            exec,
            tables,
            flusher: Mutex::new(Some(Arc::clone(&flusher))),
            path: Some(durable.path.clone()),
            last_snapshot: Mutex::new(None),
            guard: GuardCell::default(),
        };
        for (name, rec, dense, applied) in records {
            let t = flusher.exclusive(|| store.build(&name, &rec, dense.as_deref(), &flusher))?;
            let what = format!("{}: applied/{name}", durable.path.display());
            t.handle().common().applied.load(&applied, &what)?;
            flusher.record_loaded(&name, rec.to_json());
            store
                .tables
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name, t);
        }
        Ok(store)
    }

    /// Builds a table of a durable store from its record (and a dense table's stored value).
    fn build(
        &self,
        name: &str,
        rec: &TableRecord,
        dense: Option<&[u8]>,
        flusher: &Arc<Flusher>,
    ) -> Result<Table> {
        let st = flusher.storage();
        let mut common = Common::new(name.to_string(), 0.01, Arc::clone(&self.exec));
        common.durable = Some(hook(flusher));
        common.guard = Arc::clone(&self.guard);
        common.applied.set_environments(st.environments());
        let table = match rec {
            TableRecord::Sparse { config, seq, .. } => {
                st.ensure_table(name)?;
                let rows = st.read(|r| r.len(Db::Rows, name))?;
                let backing = Backing::new(source(st), rows);
                common.lr = crate::table::Lr::new(config.optimizer.lr);
                let t = SparseTable::new(
                    common,
                    config.clone(),
                    self.config.num_shards,
                    Some(backing),
                )?;
                // Row versions go on past the newest row of every environment.
                let seq = st.read(|r| {
                    let mut seq = *seq;
                    for k in 1..st.environments() {
                        let s = r.part_meta(k, &crate::durable::seq_key(name))?;
                        seq = seq.max(s.map_or(0, |v| crate::storage::cycle_of(&v)));
                    }
                    Ok(seq)
                })?;
                t.set_seq(seq);
                Table::Sparse(Arc::new(t))
            }
            TableRecord::Dense { config, .. } => {
                common.lr = crate::table::Lr::new(config.optimizer.lr);
                let t = DenseTable::new(common, config.clone())?;
                if let Some(v) = dense {
                    let mut w = Vec::new();
                    words_into(v, &mut w);
                    t.set_words(&w)?;
                }
                t.mark_clean();
                Table::Dense(Arc::new(t))
            }
        };
        let lr = match rec {
            TableRecord::Sparse { lr, .. } | TableRecord::Dense { lr, .. } => *lr,
        };
        table.handle().common().lr.set(lr)?;
        table.handle().common().set_uid(rec.uid());
        restore_counters(table.handle(), rec.counters());
        Ok(table)
    }

    /// Runs `f` on the store's thread pool.
    pub(crate) fn pool_install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.exec.install(f)
    }

    /// Runs `f` on the store's pool and returns at once; `f` must not panic (see
    /// [`Executor::spawn`]).
    pub fn spawn(&self, f: impl FnOnce() + Send + 'static) {
        self.exec.spawn(f)
    }

    /// The store directory of a durable store.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The flusher of an open durable store.
    pub fn flusher(&self) -> Option<Arc<Flusher>> {
        self.flusher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The durable store's flusher, or the error saying why there is none.
    fn durable(&self) -> Result<Option<Arc<Flusher>>> {
        match (self.flusher(), &self.path) {
            (Some(f), _) => Ok(Some(f)),
            (None, Some(p)) => Err(storage(format!("the store at {} is closed", p.display()))),
            (None, None) => Ok(None),
        }
    }

    /// A table's common part, tied to this store.
    fn common(&self, name: &str, lr: f64, flusher: &Option<Arc<Flusher>>) -> Common {
        let mut c = Common::new(name.to_string(), lr, Arc::clone(&self.exec));
        c.durable = flusher.as_ref().map(hook);
        c.guard = Arc::clone(&self.guard);
        if let Some(f) = flusher {
            c.applied.set_environments(f.storage().environments());
        }
        c
    }

    /// Sets (or, with `None`, clears) what the `max_rows` budgets of every table of this store
    /// may evict (a server moving slots, `server/moves.rs`).
    pub(crate) fn set_budget_guard(&self, guard: Option<Arc<dyn BudgetGuard>>) {
        *self.guard.write().unwrap_or_else(|e| e.into_inner()) = guard;
    }

    /// The store's configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    fn insert(&self, name: &str, make: impl FnOnce() -> Result<Table>) -> Result<Table> {
        validate_name(name)?;
        let flusher = self.durable()?;
        let add = || {
            let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
            if tables.contains_key(name) {
                return Err(Error::TableExists(name.to_string()));
            }
            let t = make()?;
            if let Some(f) = &flusher {
                // The table exists on disk before anyone can push to it.
                let rec = TableRecord::of(&t).to_json();
                let st = f.storage();
                st.ensure_table(name)?;
                st.write(|w| {
                    w.put_meta(&table_key(name), &rec)?;
                    if let Table::Dense(d) = &t {
                        w.put_meta(&dense_key(name), crate::storage::bytes_of(&d.words()))?;
                    }
                    Ok(())
                })?;
                let dense = match &t {
                    Table::Dense(d) => Some(d.words()),
                    Table::Sparse(_) => None,
                };
                f.table_created(name, rec.clone(), dense);
                f.record_loaded(name, rec);
            }
            tables.insert(name.to_string(), t.clone());
            Ok(t)
        };
        match &flusher {
            Some(f) => f.exclusive(add),
            None => add(),
        }
    }

    /// Creates a sparse table.
    pub fn create_sparse_table(
        &self,
        name: &str,
        config: SparseTableConfig,
    ) -> Result<Arc<SparseTable>> {
        let t = self.insert(name, || {
            let flusher = self.durable()?;
            let backing = flusher
                .as_ref()
                .map(|f| Backing::new(source(f.storage()), 0));
            let common = self.common(name, config.optimizer.lr, &flusher);
            let t = SparseTable::new(common, config, self.config.num_shards, backing)?;
            if flusher.is_none()
                && self
                    .last_snapshot
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some()
            {
                // An increment on the last snapshot must carry this table's rows.
                t.set_tracking(true);
            }
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
            let common = self.common(name, config.optimizer.lr, &self.durable()?);
            let t = DenseTable::new(common, config)?;
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
    /// A durable store deletes the table's records and rows from its replica too.
    pub fn drop_table(&self, name: &str) -> Result<()> {
        let flusher = self.durable()?;
        let drop = || {
            let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
            if !tables.contains_key(name) {
                return Err(Error::UnknownTable(name.to_string()));
            }
            if let Some(f) = &flusher {
                // The records go first: with several environments the two writes commit
                // apart, and a crash between them leaves databases without a record, which
                // the next open empties (never a record whose rows are half gone).
                f.storage().write(|w| {
                    w.delete_meta(&table_key(name))?;
                    w.delete_meta(&crate::durable::applied_key(name))?;
                    w.delete_meta(&dense_key(name))
                })?;
                f.record_dropped(name);
                f.table_dropped(name);
                let st = f.storage();
                st.write(|w| {
                    for db in [Db::Rows, Db::Changed, Db::Removed] {
                        w.clear(db, name)?;
                    }
                    for k in 1..st.environments() {
                        w.delete_part_meta(k, &crate::durable::seq_key(name))?;
                        w.delete_part_meta(k, &crate::durable::applied_key(name))?;
                    }
                    Ok(())
                })?;
            }
            if let Some(t) = tables.remove(name) {
                t.handle().common().mark_dropped();
            }
            Ok(())
        };
        match &flusher {
            Some(f) => f.exclusive(drop),
            None => drop(),
        }
    }

    /// Waits up to `timeout` for every queued asynchronous push; true when none is left.
    pub fn flush_timeout(&self, timeout: Duration) -> bool {
        self.exec.flush_timeout(timeout)
    }

    /// Waits for every queued asynchronous push; a durable store then commits everything to
    /// disk.
    pub fn flush(&self) -> Result<()> {
        while !self.flush_timeout(Duration::from_secs(3600)) {}
        match self.durable()? {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }

    /// Applies what is queued, then refuses further asynchronous pushes; a durable store writes
    /// everything and releases its directory (another `Store` may open it then). Idempotent.
    pub fn close(&self) -> Result<()> {
        self.exec.close();
        let f = self
            .flusher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match f {
            Some(f) => f.shutdown(),
            None => Ok(()),
        }
    }
}

/// The flusher as the hook its tables call around their changes.
fn hook(flusher: &Arc<Flusher>) -> Weak<dyn ChangeHook> {
    let weak: Weak<Flusher> = Arc::downgrade(flusher);
    weak
}

/// The replica as the source a table loads its rows from.
fn source(storage: &Arc<Storage>) -> Weak<dyn RowSource> {
    let weak: Weak<Storage> = Arc::downgrade(storage);
    weak
}

impl Drop for Store {
    fn drop(&mut self) {
        // Errors cannot be reported from a drop; `close` reports them.
        let _ = self.close();
    }
}
