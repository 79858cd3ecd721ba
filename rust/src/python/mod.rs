//! The PyO3 binding: the only module that names pyo3 or numpy.
//!
//! Arguments are converted while the GIL is held; all table work then runs detached from the
//! interpreter, so other Python threads keep running. The Python package (`pstore/`) wraps these
//! classes, checks dtypes and carries the documentation.

mod convert;
mod net;
mod serving;

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use numpy::PyUntypedArrayMethods;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArray1};
use numpy::{PyReadonlyArray2, PyReadonlyArrayDyn};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::durable::Durability;
use crate::error::Error;
use crate::executor::PushHandle;
use crate::store::{DurableConfig, Store, StoreConfig, Table};
use crate::table::{
    DenseTable, DenseTableConfig, EvictPolicy, Lifecycle, SparseTable, SparseTableConfig,
    TableHandle, TableStats,
};
use convert::{err, initializer_from, initializer_spec, optimizer_from, optimizer_spec, ForkGuard};

/// How long a blocking wait sleeps between checks for Ctrl-C.
const POLL: Duration = Duration::from_millis(100);

/// The data pointer of a freshly allocated numpy array, carried into a detached closure.
#[derive(Clone, Copy)]
struct OutData(*mut f32);
// SAFETY: the array it points into is owned by the calling function, unreachable from any other
// thread until that function returns, and outlives the detached closure that writes it.
unsafe impl Send for OutData {}

impl OutData {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Outputs of at least this many bytes start on a 64-byte boundary (see [`pulled_rows`]).
const ALIGN_MIN_BYTES: usize = 64 << 10;

/// A new `(n, dim)` float32 array, every element written by `fill` with the GIL released (an
/// error from `fill` drops the array unread).
///
/// A large output starts on a cache line: it is a view into a slightly longer array, at the
/// first 64-byte boundary. numpy aligns only to 16 bytes, so a row of 64 floats would otherwise
/// straddle five lines, and the pool's tasks, which write the rows of different shards, would
/// share the lines between neighbouring rows (measurements in ARCHITECTURE.md, "Executing a
/// batch").
pub(crate) fn pulled_rows<'py>(
    py: Python<'py>,
    n: usize,
    dim: usize,
    fill: impl FnOnce(&mut [MaybeUninit<f32>]) -> crate::Result<()> + Send,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let len = n * dim;
    let write = |data: OutData| {
        py.detach(move || {
            // SAFETY: `data` points to `len` elements of a new array that no other code can
            // reach until the caller returns it; MaybeUninit makes no claim on their values.
            let out = unsafe {
                std::slice::from_raw_parts_mut(data.get().cast::<MaybeUninit<f32>>(), len)
            };
            fill(out)
        })
        .map_err(err)
    };
    if len * 4 < ALIGN_MIN_BYTES {
        // SAFETY: a new C-ordered array of n x dim float32: `write` fills it before it is
        // returned, and on an error it is dropped without being read.
        let out = unsafe { PyArray2::<f32>::new(py, [n, dim], false) };
        write(OutData(out.data()))?;
        return Ok(out);
    }
    // SAFETY: as above; of its `len + 15` elements, the `len` from the first 64-byte boundary on
    // are written and returned, the others never read.
    let full = unsafe { PyArray1::<f32>::new(py, [len + 15], false) };
    let off = (64 - full.data() as usize % 64) % 64 / 4;
    write(OutData(full.data().wrapping_add(off)))?;
    let part = pyo3::types::PySlice::new(py, off as isize, (off + len) as isize, 1);
    Ok(full
        .as_any()
        .get_item(part)?
        .call_method1("reshape", ((n, dim),))?
        .cast_into::<PyArray2<f32>>()?)
}

fn stats_dict<'py>(py: Python<'py>, s: &TableStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rows", s.rows)?;
    d.set_item("bytes_used", s.bytes_used)?;
    d.set_item("pushes", s.pushes)?;
    d.set_item("pulls", s.pulls)?;
    d.set_item("ids_pushed", s.ids_pushed)?;
    d.set_item("ids_pulled", s.ids_pulled)?;
    d.set_item("rows_updated", s.rows_updated)?;
    d.set_item("rows_created", s.rows_created)?;
    d.set_item("rows_evicted", s.rows_evicted)?;
    d.set_item("rows_unloaded", s.rows_unloaded)?;
    d.set_item("seq", s.seq)?;
    d.set_item("lr", s.lr)?;
    Ok(d)
}

fn slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| err(Error::Shape(format!("{what} must be C-contiguous"))))
}

/// The `#[pymethods]` block of a table class: the methods every table shares (from
/// `TableHandle` and the config), then the class's own.
macro_rules! table_methods {
    ($ty:ident { $($own:tt)* }) => {
        #[pymethods]
        impl $ty {
            #[getter]
            fn name(&self) -> &str {
                self.inner.name()
            }

            #[getter]
            fn seed(&self) -> u64 {
                self.inner.config().seed
            }

            #[getter]
            fn optimizer_name(&self) -> &'static str {
                self.inner.config().optimizer.name()
            }

            #[getter]
            fn lr(&self) -> f64 {
                self.inner.lr()
            }

            fn set_lr(&self, lr: f64) -> PyResult<()> {
                self.inner.set_lr(lr).map_err(err)
            }

            fn optimizer_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                optimizer_spec(py, &self.inner.config().optimizer)
            }

            fn initializer_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                initializer_spec(py, &self.inner.config().initializer)
            }

            $($own)*
        }
    };
}

/// The native store.
#[pyclass(frozen, module = "pstore._native", name = "Store")]
struct PyStore {
    inner: Arc<Store>,
    guard: ForkGuard,
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (
        num_shards=None, threads=None, max_inflight_bytes=None, path=None,
        durability="async", flush_interval=1.0, map_size=None, environments=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_shards: Option<usize>,
        threads: Option<usize>,
        max_inflight_bytes: Option<usize>,
        path: Option<std::path::PathBuf>,
        durability: &str,
        flush_interval: f64,
        map_size: Option<usize>,
        environments: Option<usize>,
    ) -> PyResult<Self> {
        let (config, dc) = configs(
            num_shards,
            threads,
            max_inflight_bytes,
            path,
            durability,
            flush_interval,
            map_size,
            environments,
        )?;
        let store = match dc {
            None => Store::new(config),
            Some(dc) => py.detach(move || Store::open(config, dc)),
        };
        Ok(Self {
            inner: Arc::new(store.map_err(err)?),
            guard: ForkGuard::new(),
        })
    }

    /// Rebuilds a store from a snapshot and its chain of increments.
    #[staticmethod]
    #[pyo3(signature = (
        snapshot, num_shards=None, threads=None, max_inflight_bytes=None, path=None,
        durability="async", flush_interval=1.0, map_size=None, environments=None, counter=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn restore(
        py: Python<'_>,
        snapshot: std::path::PathBuf,
        num_shards: Option<usize>,
        threads: Option<usize>,
        max_inflight_bytes: Option<usize>,
        path: Option<std::path::PathBuf>,
        durability: &str,
        flush_interval: f64,
        map_size: Option<usize>,
        environments: Option<usize>,
        counter: Option<&PyCounter>,
    ) -> PyResult<Self> {
        let (config, dc) = configs(
            num_shards,
            threads,
            max_inflight_bytes,
            path,
            durability,
            flush_interval,
            map_size,
            environments,
        )?;
        let c = counter.map_or_else(|| Arc::new(AtomicU64::new(0)), |c| Arc::clone(&c.0));
        let store = py
            .detach(move || Store::restore_counted(&snapshot, config, dc, &c))
            .map_err(err)?;
        Ok(Self {
            inner: Arc::new(store),
            guard: ForkGuard::new(),
        })
    }

    /// Writes a snapshot into the new directory `dir`; returns (manifest JSON, bytes written).
    /// Rows written are added to `counter` as they go.
    #[pyo3(signature = (dir, incremental=false, counter=None))]
    fn snapshot(
        &self,
        py: Python<'_>,
        dir: std::path::PathBuf,
        incremental: bool,
        counter: Option<&PyCounter>,
    ) -> PyResult<(String, u64)> {
        self.guard.check()?;
        let store = &self.inner;
        let c = counter.map_or_else(|| Arc::new(AtomicU64::new(0)), |c| Arc::clone(&c.0));
        let info = py
            .detach(|| store.snapshot_counted(&dir, incremental, &c))
            .map_err(err)?;
        let json = serde_json::to_string(&info.manifest)
            .map_err(|e| err(Error::Internal(e.to_string())))?;
        Ok((json, info.bytes))
    }

    /// The store directory of a durable store.
    #[getter]
    fn path(&self) -> Option<std::path::PathBuf> {
        self.inner.path().map(|p| p.to_path_buf())
    }

    /// The durability mode of an open durable store ("sync", "async", "none"), else None.
    #[getter]
    fn durability(&self) -> Option<&'static str> {
        self.inner.flusher().map(|f| f.mode().as_str())
    }

    /// The replica of an open durable store: cycle, file and map bytes, last error, flush lag,
    /// idle-priority writes.
    fn storage_info<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(f) = self.inner.flusher() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("path", f.storage().path())?;
        d.set_item("cycle", f.done_cycle())?;
        d.set_item("file_bytes", f.storage().file_size())?;
        d.set_item("map_bytes", f.storage().map_size())?;
        d.set_item("environments", f.storage().environments())?;
        d.set_item("flush_interval", f.interval().as_secs_f64())?;
        d.set_item("current_flush_interval", f.current_interval().as_secs_f64())?;
        d.set_item("last_error", f.last_error().map(|e| e.to_string()))?;
        d.set_item("flush_lag", f.lag().as_secs_f64())?;
        d.set_item("idle_writes", f.idle_writes())?;
        d.set_item("idle_lifts", f.idle_lifts())?;
        d.set_item("superseded_writes", f.superseded_writes())?;
        Ok(Some(d))
    }

    #[getter]
    fn num_shards(&self) -> usize {
        self.inner.config().num_shards
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.config().threads
    }

    #[getter]
    fn max_inflight_bytes(&self) -> usize {
        self.inner.config().max_inflight_bytes
    }

    #[pyo3(signature = (
        name, dim, optimizer, initializer, seed, admit_after=0, max_rows=None, evict_policy="lru"
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
    ) -> PyResult<PySparseTable> {
        self.guard.check()?;
        let config = sparse_config(
            dim,
            optimizer,
            initializer,
            seed,
            admit_after,
            max_rows,
            evict_policy,
        )?;
        let store = &self.inner;
        let t = py
            .detach(|| store.create_sparse_table(name, config))
            .map_err(err)?;
        Ok(PySparseTable {
            inner: t,
            guard: self.guard,
        })
    }

    #[pyo3(signature = (name, shape, optimizer, initializer, seed))]
    fn create_dense_table(
        &self,
        py: Python<'_>,
        name: &str,
        shape: Vec<usize>,
        optimizer: &Bound<'_, PyDict>,
        initializer: &Bound<'_, PyDict>,
        seed: u64,
    ) -> PyResult<PyDenseTable> {
        self.guard.check()?;
        let config = DenseTableConfig {
            shape,
            optimizer: optimizer_from(optimizer)?,
            initializer: initializer_from(initializer)?,
            seed,
        };
        let store = &self.inner;
        let t = py
            .detach(|| store.create_dense_table(name, config))
            .map_err(err)?;
        Ok(PyDenseTable {
            inner: t,
            guard: self.guard,
        })
    }

    /// The table called `name`, as a SparseTable or DenseTable.
    fn table(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        self.guard.check()?;
        Ok(match self.inner.table(name).map_err(err)? {
            Table::Sparse(t) => Py::new(
                py,
                PySparseTable {
                    inner: t,
                    guard: self.guard,
                },
            )?
            .into_any(),
            Table::Dense(t) => Py::new(
                py,
                PyDenseTable {
                    inner: t,
                    guard: self.guard,
                },
            )?
            .into_any(),
        })
    }

    fn tables(&self) -> Vec<String> {
        self.inner.tables()
    }

    fn drop_table(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let store = &self.inner;
        py.detach(|| store.drop_table(name)).map_err(err)
    }

    /// Waits for every queued asynchronous push (Ctrl-C interrupts the wait); a durable store
    /// then commits everything to disk.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.guard.check()?;
        loop {
            let store = Arc::clone(&self.inner);
            if py.detach(move || store.flush_timeout(POLL)) {
                break;
            }
            py.check_signals()?;
        }
        let store = &self.inner;
        py.detach(|| store.flush()).map_err(err)
    }

    /// Applies what is queued and refuses further asynchronous pushes; a durable store writes
    /// everything and releases its directory.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let store = Arc::clone(&self.inner);
        py.detach(move || store.close()).map_err(err)
    }
}

/// `(admit_after, max_rows, evict_policy)` of a table.
fn lifecycle_tuple(l: &Lifecycle) -> (u32, Option<u64>, &'static str) {
    let p = match l.policy {
        EvictPolicy::Lru => "lru",
        EvictPolicy::Lfu => "lfu",
    };
    (l.admit_after, l.max_rows, p)
}

/// A sparse table's configuration from `create_sparse_table`'s arguments.
fn sparse_config(
    dim: usize,
    optimizer: &Bound<'_, PyDict>,
    initializer: &Bound<'_, PyDict>,
    seed: u64,
    admit_after: u32,
    max_rows: Option<u64>,
    evict_policy: &str,
) -> PyResult<SparseTableConfig> {
    let policy = match evict_policy {
        "lru" => EvictPolicy::Lru,
        "lfu" => EvictPolicy::Lfu,
        _ => {
            return Err(err(Error::InvalidArgument(format!(
                "evict_policy must be \"lru\" or \"lfu\", got {evict_policy:?}"
            ))))
        }
    };
    Ok(SparseTableConfig {
        dim,
        optimizer: optimizer_from(optimizer)?,
        initializer: initializer_from(initializer)?,
        seed,
        lifecycle: Lifecycle {
            admit_after,
            max_rows,
            policy,
        },
    })
}

/// The store and durable configurations from the constructor's arguments.
#[allow(clippy::too_many_arguments)]
fn configs(
    num_shards: Option<usize>,
    threads: Option<usize>,
    max_inflight_bytes: Option<usize>,
    path: Option<std::path::PathBuf>,
    durability: &str,
    flush_interval: f64,
    map_size: Option<usize>,
    environments: Option<usize>,
) -> PyResult<(StoreConfig, Option<DurableConfig>)> {
    let d = StoreConfig::default();
    let config = StoreConfig {
        num_shards: num_shards.unwrap_or(d.num_shards),
        threads: threads.unwrap_or(d.threads),
        max_inflight_bytes: max_inflight_bytes.unwrap_or(d.max_inflight_bytes),
    };
    let durability: Durability = durability.parse().map_err(err)?;
    let Some(path) = path else {
        return Ok((config, None));
    };
    if !(flush_interval.is_finite() && flush_interval > 0.0 && flush_interval < 1e6) {
        return Err(err(Error::InvalidArgument(format!(
            "flush_interval must be a positive number of seconds, got {flush_interval}"
        ))));
    }
    let mut dc = DurableConfig::new(path);
    dc.durability = durability;
    dc.flush_interval = Duration::from_secs_f64(flush_interval);
    if let Some(m) = map_size {
        dc.map_size = m;
    }
    if let Some(n) = environments {
        dc.environments = n;
    }
    Ok((config, Some(dc)))
}

/// Distinct ids and, per position, the index of its id among them.
type UniqueInverse<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<i64>>);

/// The distinct ids of `ids` (first appearance order) and each id's index among them.
#[pyfunction]
fn unique_inverse<'py>(
    py: Python<'py>,
    ids: PyReadonlyArray1<'py, u64>,
) -> PyResult<UniqueInverse<'py>> {
    let ids_s = slice(&ids, "ids")?;
    let (unique, inverse) = py
        .detach(|| {
            let mut inverse = vec![0i64; ids_s.len()];
            crate::ops::unique_inverse(ids_s, &mut inverse).map(|u| (u, inverse))
        })
        .map_err(err)?;
    Ok((unique.into_pyarray(py), inverse.into_pyarray(py)))
}

/// `rows` x dim: row `index[i]` gets row `i` of `src` added (the backward pass of a gather).
#[pyfunction]
fn sum_rows<'py>(
    py: Python<'py>,
    src: PyReadonlyArray2<'py, f32>,
    index: PyReadonlyArray1<'py, i64>,
    rows: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let dim = src.shape()[1];
    let (src_s, index_s) = (slice(&src, "src")?, slice(&index, "index")?);
    let out = py
        .detach(|| crate::ops::sum_rows(src_s, index_s, dim, rows))
        .map_err(err)?;
    out.into_pyarray(py).reshape([rows, dim])
}

/// Binds the OpenMP runtime loaded at `path` (see `crate::openmp`).
#[pyfunction]
fn openmp_bind(path: &str) -> PyResult<()> {
    crate::openmp::bind(path).map_err(err)
}

/// The path of the bound OpenMP runtime, or None.
#[pyfunction]
fn openmp_bound() -> Option<&'static str> {
    crate::openmp::bound()
}

/// Makes the calling thread's batches run on its OpenMP team (True) or on the store's pool.
#[pyfunction]
fn openmp_join(on: bool) -> PyResult<()> {
    crate::openmp::join(on).map_err(err)
}

/// Whether the calling thread's batches run on its OpenMP team.
#[pyfunction]
fn openmp_joined() -> bool {
    crate::openmp::joined()
}

/// The manifests of a snapshot's chain, base first, as JSON.
#[pyfunction]
fn snapshot_chain(py: Python<'_>, dir: std::path::PathBuf) -> PyResult<Vec<(String, String)>> {
    let chain = py
        .detach(|| crate::snapshot::Manifest::chain(&dir))
        .map_err(err)?;
    chain
        .into_iter()
        .map(|(p, m)| {
            let j = serde_json::to_string(&m).map_err(|e| err(Error::Internal(e.to_string())))?;
            Ok((p.to_string_lossy().into_owned(), j))
        })
        .collect()
}

/// Checks every file of a snapshot's chain (sizes and checksums); the first damaged one fails.
#[pyfunction]
fn verify_snapshot(py: Python<'_>, dir: std::path::PathBuf) -> PyResult<u64> {
    py.detach(|| crate::snapshot::verify(&dir)).map_err(err)
}

/// What a store directory holds, read without opening it for writing.
#[pyfunction]
fn inspect_store<'py>(py: Python<'py>, path: std::path::PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let s = py.detach(|| crate::storage::inspect(&path)).map_err(err)?;
    let d = PyDict::new(py);
    d.set_item("format", &s.format.format)?;
    d.set_item("version", s.format.version)?;
    d.set_item("environments", s.format.environments)?;
    d.set_item("cycle", s.cycle)?;
    d.set_item("file_bytes", s.file_bytes)?;
    d.set_item("snapshot", s.snapshot)?;
    let tables = pyo3::types::PyList::empty(py);
    for (name, rec, rows, changed, removed) in s.tables {
        let t = PyDict::new(py);
        t.set_item("name", name)?;
        t.set_item("record", rec)?;
        t.set_item("rows", rows)?;
        t.set_item("changed_since_snapshot", changed)?;
        t.set_item("removed_since_snapshot", removed)?;
        tables.append(t)?;
    }
    d.set_item("tables", tables)?;
    Ok(d)
}

/// A count that long native calls raise as they go (rows written or loaded), read by another
/// thread to draw progress.
#[pyclass(frozen, module = "pstore._native", name = "Counter")]
struct PyCounter(pub(crate) Arc<AtomicU64>);

#[pymethods]
impl PyCounter {
    #[new]
    fn new() -> Self {
        Self(Arc::new(AtomicU64::new(0)))
    }

    #[getter]
    fn value(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The native handle on an asynchronous push.
#[pyclass(frozen, module = "pstore._native", name = "PushHandle")]
struct PyPushHandle {
    inner: PushHandle,
}

#[pymethods]
impl PyPushHandle {
    /// Waits for the push, at most `timeout` seconds; True once it has applied, False on timeout.
    /// Raises the push's error if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        wait_polling(py, timeout, |step| self.inner.clone().wait_timeout(step))
    }

    fn done(&self) -> bool {
        self.inner.is_done()
    }
}

/// Waits for `poll` to give a result, at most `timeout` seconds (forever with None), polling in
/// steps so Ctrl-C is seen; True once done, False on timeout, the error if it failed.
fn wait_polling(
    py: Python<'_>,
    timeout: Option<f64>,
    poll: impl Fn(Duration) -> Option<Result<(), Error>> + Sync,
) -> PyResult<bool> {
    let deadline = match timeout {
        Some(t) if !(t.is_finite() && t >= 0.0) => {
            return Err(err(Error::InvalidArgument(format!(
                "timeout must be a finite number >= 0, got {t}"
            ))))
        }
        Some(t) => Some(std::time::Instant::now() + Duration::from_secs_f64(t)),
        None => None,
    };
    loop {
        let step = match deadline {
            Some(d) => d
                .saturating_duration_since(std::time::Instant::now())
                .min(POLL),
            None => POLL,
        };
        if let Some(r) = py.detach(|| poll(step)) {
            return r.map(|()| true).map_err(err);
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Ok(false);
        }
        py.check_signals()?;
    }
}

/// The native sparse table.
#[pyclass(frozen, module = "pstore._native", name = "SparseTable")]
struct PySparseTable {
    inner: Arc<SparseTable>,
    guard: ForkGuard,
}

table_methods!(PySparseTable {
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }

    #[getter]
    fn num_shards(&self) -> usize {
        self.inner.num_shards()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn pull<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        self.guard.check()?;
        let ids_s = slice(&ids, "ids")?;
        let (n, dim, t) = (ids_s.len(), self.inner.dim(), &self.inner);
        // numpy allocates the result (with its own huge-page advice for large arrays); the rows
        // are written straight into it.
        pulled_rows(py, n, dim, |out| t.pull_into(ids_s, out))
    }

    fn push(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        self.guard.check()?;
        let (ids_s, grads_s) = (slice(&ids, "ids")?, slice(&grads, "grads")?);
        self.check_cols(&grads)?;
        let t = &self.inner;
        py.detach(|| t.push(ids_s, grads_s)).map_err(err)
    }

    fn push_async(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<PyPushHandle> {
        self.guard.check()?;
        let (ids_s, grads_s) = (slice(&ids, "ids")?, slice(&grads, "grads")?);
        self.check_cols(&grads)?;
        let t = &self.inner;
        let h = py
            .detach(|| t.push_async(ids_s.to_vec(), grads_s.to_vec()))
            .map_err(err)?;
        Ok(PyPushHandle { inner: h })
    }

    fn contains<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids_s = slice(&ids, "ids")?;
        let t = &self.inner;
        Ok(py
            .detach(|| t.contains(ids_s))
            .map_err(err)?
            .into_pyarray(py))
    }

    fn remove(&self, py: Python<'_>, ids: PyReadonlyArray1<'_, u64>) -> PyResult<usize> {
        self.guard.check()?;
        let ids_s = slice(&ids, "ids")?;
        let t = &self.inner;
        py.detach(|| t.remove(ids_s)).map_err(err)
    }

    /// Removes rows last updated before version `before_seq` or unix second `before_secs`.
    #[pyo3(signature = (before_seq=None, before_secs=None))]
    fn evict(&self, py: Python<'_>, before_seq: Option<u64>, before_secs: Option<u32>) -> PyResult<usize> {
        self.guard.check()?;
        let t = &self.inner;
        py.detach(|| t.evict(before_seq, before_secs)).map_err(err)
    }

    /// The update sequence number (pushes applied over the table's life).
    #[getter]
    fn seq(&self) -> u64 {
        self.inner.seq()
    }

    /// (admit_after, max_rows, evict_policy)
    #[getter]
    fn lifecycle(&self) -> (u32, Option<u64>, &'static str) {
        lifecycle_tuple(&self.inner.config().lifecycle)
    }

    fn initial_rows<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids_s = slice(&ids, "ids")?;
        let (n, dim) = (ids_s.len(), self.inner.dim());
        let t = &self.inner;
        let rows = py.detach(|| t.initial_rows(ids_s));
        rows.into_pyarray(py).reshape([n, dim])
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.inner;
        let s = py.detach(|| t.stats());
        stats_dict(py, &s)
    }
});

impl PySparseTable {
    fn check_cols(&self, grads: &PyReadonlyArray2<'_, f32>) -> PyResult<()> {
        let cols = grads.shape()[1];
        if cols != self.inner.dim() {
            return Err(err(Error::Shape(format!(
                "table {:?} has dim {}, but grads have {} columns",
                self.inner.name(),
                self.inner.dim(),
                cols
            ))));
        }
        Ok(())
    }
}

/// The native dense table.
#[pyclass(frozen, module = "pstore._native", name = "DenseTable")]
struct PyDenseTable {
    inner: Arc<DenseTable>,
    guard: ForkGuard,
}

table_methods!(PyDenseTable {
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.inner.config().shape.clone()
    }

    #[getter]
    fn step(&self) -> u32 {
        self.inner.step()
    }

    fn pull<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        self.guard.check()?;
        let t = &self.inner;
        let v = py.detach(|| t.pull()).map_err(err)?;
        v.into_pyarray(py)
            .reshape(self.inner.config().shape.clone())
    }

    fn push(&self, py: Python<'_>, grad: PyReadonlyArrayDyn<'_, f32>) -> PyResult<()> {
        self.guard.check()?;
        self.check_shape(&grad)?;
        let g = slice(&grad, "grad")?;
        let t = &self.inner;
        py.detach(|| t.push(g)).map_err(err)
    }

    fn push_async(
        &self,
        py: Python<'_>,
        grad: PyReadonlyArrayDyn<'_, f32>,
    ) -> PyResult<PyPushHandle> {
        self.guard.check()?;
        self.check_shape(&grad)?;
        let g = slice(&grad, "grad")?;
        let t = &self.inner;
        let h = py.detach(|| t.push_async(g.to_vec())).map_err(err)?;
        Ok(PyPushHandle { inner: h })
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }
});

impl PyDenseTable {
    fn check_shape(&self, grad: &PyReadonlyArrayDyn<'_, f32>) -> PyResult<()> {
        let want = &self.inner.config().shape;
        if grad.shape() != want.as_slice() {
            return Err(err(Error::Shape(format!(
                "table {:?}: gradient must have shape {:?}, got {:?}",
                self.inner.name(),
                want,
                grad.shape()
            ))));
        }
        Ok(())
    }
}

/// The native module `pstore._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStore>()?;
    m.add_class::<PySparseTable>()?;
    m.add_class::<PyDenseTable>()?;
    m.add_class::<PyPushHandle>()?;
    m.add_class::<PyCounter>()?;
    net::register(m)?;
    serving::register(m)?;
    m.add_function(wrap_pyfunction!(snapshot_chain, m)?)?;
    m.add_function(wrap_pyfunction!(unique_inverse, m)?)?;
    m.add_function(wrap_pyfunction!(sum_rows, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_bind, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_bound, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_join, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_joined, m)?)?;
    m.add_function(wrap_pyfunction!(verify_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_store, m)?)?;
    m.add("MAX_DIM", crate::table::MAX_DIM)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
