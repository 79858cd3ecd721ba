//! The PyO3 binding: the only module that names pyo3 or numpy.
//!
//! Arguments are converted while the GIL is held; all work of the core then runs in [`run`],
//! detached from the interpreter, so other Python threads keep running. The Python package
//! (`pstore/`) wraps these classes, checks dtypes and carries the documentation.
//!
//! - `tables`: the table classes and the store methods every store has, over `crate::api`;
//! - this module: the embedded `Store`'s own methods, push handles, helpers, free functions;
//! - `net`: the store server and the cluster `Client`'s own methods;
//! - `serving`: serving artifacts and the model server.

mod convert;
mod net;
mod reference;
mod serving;
mod tables;

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use numpy::PyReadonlyArray2;
use numpy::PyUntypedArrayMethods;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::durable::Durability;
use crate::error::Error;
use crate::executor::PushHandle;
use crate::store::{DurableConfig, Store, StoreConfig};
use convert::{err, ForkGuard};
use tables::PyStoreApi;

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
        run(py, move || {
            // SAFETY: `data` points to `len` elements of a new array that no other code can
            // reach until the caller returns it; MaybeUninit makes no claim on their values.
            let out = unsafe {
                std::slice::from_raw_parts_mut(data.get().cast::<MaybeUninit<f32>>(), len)
            };
            fill(out)
        })
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

fn slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| err(Error::Shape(format!("{what} must be C-contiguous"))))
}

/// The embedded store: the tables of [`PyStoreApi`], and snapshots, restore and durability.
#[pyclass(extends = PyStoreApi, frozen, module = "pstore._native", name = "Store")]
pub(crate) struct PyStore {
    pub(crate) inner: Arc<Store>,
    pub(crate) guard: ForkGuard,
}

impl PyStore {
    fn init(store: Store) -> PyClassInitializer<Self> {
        let (inner, guard) = (Arc::new(store), ForkGuard::new());
        PyClassInitializer::from(PyStoreApi::new(Arc::clone(&inner) as _, guard))
            .add_subclass(Self { inner, guard })
    }
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
    ) -> PyResult<PyClassInitializer<Self>> {
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
            None => Store::new(config).map_err(err)?,
            Some(dc) => run(py, move || {
                let store = Store::open(config, dc)?;
                // A follower's directory may hold acknowledged entries not committed to the
                // replica yet (0126): whoever opens it sees them.
                crate::server::repl::settle_follow_log(&store)?;
                Ok(store)
            })?,
        };
        Ok(Self::init(store))
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
        snapshot: String,
        num_shards: Option<usize>,
        threads: Option<usize>,
        max_inflight_bytes: Option<usize>,
        path: Option<std::path::PathBuf>,
        durability: &str,
        flush_interval: f64,
        map_size: Option<usize>,
        environments: Option<usize>,
        counter: Option<&PyCounter>,
    ) -> PyResult<Py<Self>> {
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
        let store = run(py, move || Store::restore_from(&snapshot, config, dc, &c))?;
        Py::new(py, Self::init(store))
    }

    /// Writes a snapshot into the new directory (or object-store prefix) `dir`; returns
    /// (manifest JSON, bytes written). Rows written are added to `counter` as they go.
    #[pyo3(signature = (dir, incremental=false, counter=None))]
    fn snapshot(
        &self,
        py: Python<'_>,
        dir: String,
        incremental: bool,
        counter: Option<&PyCounter>,
    ) -> PyResult<(String, u64)> {
        self.guard.check()?;
        let store = &self.inner;
        let c = counter.map_or_else(|| Arc::new(AtomicU64::new(0)), |c| Arc::clone(&c.0));
        let info = run(py, || store.snapshot_to(&dir, incremental, &c))?;
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
    let (unique, inverse) = run(py, || {
        let mut inverse = vec![0i64; ids_s.len()];
        crate::ops::unique_inverse(ids_s, &mut inverse).map(|u| (u, inverse))
    })?;
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
    let out = run(py, || crate::ops::sum_rows(src_s, index_s, dim, rows))?;
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

/// The manifests of a snapshot's chain, base first, as JSON: a directory or an object-store
/// prefix (its manifests are read without downloading the files).
#[pyfunction]
fn snapshot_chain(py: Python<'_>, dir: String) -> PyResult<Vec<(String, String)>> {
    let chain = run(py, || crate::snapshot::location::manifest_chain(&dir))?;
    chain
        .into_iter()
        .map(|(p, m)| {
            let j = serde_json::to_string(&m).map_err(|e| err(Error::Internal(e.to_string())))?;
            Ok((p, j))
        })
        .collect()
}

/// Checks every file of a snapshot's chain (sizes and checksums); the first damaged one fails.
/// An object-store snapshot is downloaded into a staging directory and checked there.
#[pyfunction]
fn verify_snapshot(py: Python<'_>, dir: String) -> PyResult<u64> {
    run(py, || {
        let staged = crate::snapshot::location::stage(&dir)?;
        crate::snapshot::verify(staged.dir()).map_err(|e| staged.explain(e))
    })
}

/// What a store directory holds, read without opening it for writing.
#[pyfunction]
fn inspect_store<'py>(py: Python<'py>, path: std::path::PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let s = run(py, || crate::storage::inspect(&path))?;
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

/// Runs `f`, work of the core, with the GIL released (other Python threads run meanwhile) and
/// maps its error to the Python exception. Every call into the core that may take time goes
/// through here; the arguments are converted before and the results after, with the GIL held.
pub(crate) fn run<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    py.detach(f).map_err(err)
}

/// Waits for `poll` to give a result, at most `timeout` seconds (forever with None), polling in
/// steps of [`run`] so Ctrl-C is seen; True once done, False on timeout, the error if it failed.
pub(crate) fn wait_polling(
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
        if let Some(r) = run(py, || Ok(poll(step)))? {
            return r.map(|()| true).map_err(err);
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Ok(false);
        }
        py.check_signals()?;
    }
}
/// The native module `pstore._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    tables::register(m)?;
    m.add_class::<PyStore>()?;
    m.add_class::<PyPushHandle>()?;
    m.add_class::<PyCounter>()?;
    net::register(m)?;
    serving::register(m)?;
    m.add_function(wrap_pyfunction!(convert::config_schema, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot_chain, m)?)?;
    m.add_function(wrap_pyfunction!(unique_inverse, m)?)?;
    m.add_function(wrap_pyfunction!(sum_rows, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_bind, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_bound, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_join, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_joined, m)?)?;
    m.add_function(wrap_pyfunction!(verify_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_store, m)?)?;
    reference::register(m)?;
    m.add("MAX_DIM", crate::table::MAX_DIM)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
