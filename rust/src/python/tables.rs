//! The table classes and the store methods every store has, over the traits of [`crate::api`]:
//! the same classes for the tables of the embedded store and of store servers.

use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArray1};
use numpy::{PyReadonlyArray2, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::ForkGuard;
use super::convert::{err, initializer_from, initializer_spec, optimizer_from, optimizer_spec};
use super::{pulled_rows, run, slice, wait_polling, PyPushHandle};
use crate::api::{AnyTable, DenseTableApi, PushPolicy, SparseTableApi, Stats, StoreApi};
use crate::client::ServerTable;
use crate::error::Error;
use crate::table::{DenseTableConfig, EvictPolicy, Lifecycle, SparseTableConfig};

/// The methods of every store: creating, finding and dropping tables, flushing, closing. The
/// embedded `Store` and the cluster `Client` extend it.
#[pyclass(subclass, frozen, module = "pstore._native", name = "StoreApi")]
pub(crate) struct PyStoreApi {
    inner: Arc<dyn StoreApi>,
    guard: ForkGuard,
}

impl PyStoreApi {
    pub(crate) fn new(inner: Arc<dyn StoreApi>, guard: ForkGuard) -> Self {
        Self { inner, guard }
    }

    fn sparse(&self, t: Arc<dyn SparseTableApi>) -> PySparseTable {
        PySparseTable {
            inner: t,
            guard: self.guard,
        }
    }

    fn dense(&self, t: Arc<dyn DenseTableApi>) -> PyDenseTable {
        PyDenseTable {
            inner: t,
            guard: self.guard,
        }
    }
}

/// The policy of a declaration; `None` for both: left unset (an existing table keeps its own).
fn policy(stale_policy: Option<&str>, max_staleness: Option<u64>) -> PyResult<PushPolicy> {
    Ok(PushPolicy {
        stale_policy: stale_policy.unwrap_or("apply").parse().map_err(err)?,
        max_staleness: max_staleness.unwrap_or(0),
        given: stale_policy.is_some() || max_staleness.is_some(),
    })
}

#[pymethods]
impl PyStoreApi {
    #[pyo3(signature = (
        name, dim, optimizer, initializer, seed, admit_after=0, max_rows=None, evict_policy="lru",
        stale_policy=None, max_staleness=None, refuse_nonfinite=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn create_sparse_table(
        &self,
        py: Python<'_>,
        name: &str,
        dim: usize,
        optimizer: &Bound<'_, PyDict>,
        initializer: &Bound<'_, PyAny>,
        seed: u64,
        admit_after: u32,
        max_rows: Option<u64>,
        evict_policy: &str,
        stale_policy: Option<&str>,
        max_staleness: Option<u64>,
        refuse_nonfinite: bool,
    ) -> PyResult<PySparseTable> {
        self.guard.check()?;
        let policy_ = match evict_policy {
            "lru" => EvictPolicy::Lru,
            "lfu" => EvictPolicy::Lfu,
            _ => {
                return Err(err(Error::InvalidArgument(format!(
                    "evict_policy must be \"lru\" or \"lfu\", got {evict_policy:?}"
                ))))
            }
        };
        let config = SparseTableConfig {
            dim,
            optimizer: optimizer_from(optimizer)?,
            initializer: initializer_from(initializer)?,
            seed,
            lifecycle: Lifecycle {
                admit_after,
                max_rows,
                policy: policy_,
            },
            refuse_nonfinite,
        };
        let p = policy(stale_policy, max_staleness)?;
        let s = &self.inner;
        let t = run(py, || s.create_sparse_table(name, config, p))?;
        Ok(self.sparse(t))
    }

    #[pyo3(signature = (
        name, shape, optimizer, initializer, seed, stale_policy=None, max_staleness=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn create_dense_table(
        &self,
        py: Python<'_>,
        name: &str,
        shape: Vec<usize>,
        optimizer: &Bound<'_, PyDict>,
        initializer: &Bound<'_, PyAny>,
        seed: u64,
        stale_policy: Option<&str>,
        max_staleness: Option<u64>,
    ) -> PyResult<PyDenseTable> {
        self.guard.check()?;
        let config = DenseTableConfig {
            shape,
            optimizer: optimizer_from(optimizer)?,
            initializer: initializer_from(initializer)?,
            seed,
        };
        let p = policy(stale_policy, max_staleness)?;
        let s = &self.inner;
        let t = run(py, || s.create_dense_table(name, config, p))?;
        Ok(self.dense(t))
    }

    /// The table called `name`, as a SparseTable or DenseTable.
    fn table(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        self.guard.check()?;
        let s = &self.inner;
        Ok(match run(py, || s.table(name))? {
            AnyTable::Sparse(t) => Py::new(py, self.sparse(t))?.into_any(),
            AnyTable::Dense(t) => Py::new(py, self.dense(t))?.into_any(),
        })
    }

    /// The names of all tables, sorted.
    fn tables(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let s = &self.inner;
        run(py, || s.tables())
    }

    fn drop_table(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let s = &self.inner;
        run(py, || s.drop_table(name))
    }

    /// Waits for every queued asynchronous push (Ctrl-C interrupts the wait); a durable store
    /// then commits everything to disk, store servers make themselves durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.guard.check()?;
        let s = &self.inner;
        wait_polling(py, None, |step| s.flush_timeout(step).then_some(Ok(())))?;
        run(py, || s.flush())
    }

    /// Applies (sends) what is queued; the embedded store then refuses further asynchronous
    /// pushes and a durable one releases its directory.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let s = &self.inner;
        run(py, || s.close())
    }
}

/// `name`, `seed`, the optimizer and initialiser, and the learning rate: the `#[pymethods]` of
/// both table classes, then the class's own.
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

            /// The learning rate in force.
            #[getter]
            fn lr(&self, py: Python<'_>) -> PyResult<f64> {
                self.run(py, || self.inner.lr())
            }

            fn set_lr(&self, py: Python<'_>, lr: f64) -> PyResult<()> {
                self.run(py, || self.inner.set_lr(lr))
            }

            fn optimizer_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                optimizer_spec(py, &self.inner.config().optimizer)
            }

            fn initializer_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                initializer_spec(py, &self.inner.config().initializer)
            }

            /// Counters and sizes; a table of store servers adds "staleness" and "servers".
            fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let s = self.run(py, || self.inner.stats())?;
                stats_dict(py, &s)
            }

            $($own)*
        }

        impl $ty {
            /// [`run`], in the process that made the store.
            fn run<T: Send>(
                &self,
                py: Python<'_>,
                f: impl FnOnce() -> crate::Result<T> + Send,
            ) -> PyResult<T> {
                self.guard.check()?;
                run(py, f)
            }
        }
    };
}

/// A sparse table, of the embedded store or of store servers.
#[pyclass(frozen, module = "pstore._native", name = "SparseTable")]
pub(crate) struct PySparseTable {
    inner: Arc<dyn SparseTableApi>,
    guard: ForkGuard,
}

table_methods!(PySparseTable {
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }

    /// Shards of an embedded table, servers of a remote one.
    #[getter]
    fn num_shards(&self) -> usize {
        self.inner.num_shards()
    }

    /// True when the table's work runs in this process.
    #[getter]
    fn in_process(&self) -> bool {
        self.inner.in_process()
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, || self.inner.len()).map(|n| n as usize)
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

    /// The rows and the table version they were read at (one int per server; empty for an
    /// embedded table).
    fn pull_versioned<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, Vec<u64>)> {
        self.guard.check()?;
        let ids_s = slice(&ids, "ids")?;
        let (n, dim, t) = (ids_s.len(), self.inner.dim(), &self.inner);
        let mut version = Vec::new();
        let rows = pulled_rows(py, n, dim, |out| {
            version = t.pull_versioned(ids_s, out)?;
            Ok(())
        })?;
        Ok((rows, version))
    }

    #[pyo3(signature = (ids, grads, version=None))]
    fn push(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        version: Option<Vec<u64>>,
    ) -> PyResult<()> {
        let (ids_s, grads_s) = (slice(&ids, "ids")?, slice(&grads, "grads")?);
        self.check_cols(&grads)?;
        self.run(py, || self.inner.push_versioned(ids_s, grads_s, version))
    }

    #[pyo3(signature = (ids, grads, version=None))]
    fn push_async(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        version: Option<Vec<u64>>,
    ) -> PyResult<PyPushHandle> {
        let (ids_s, grads_s) = (slice(&ids, "ids")?, slice(&grads, "grads")?);
        self.check_cols(&grads)?;
        let h = self.run(py, || {
            self.inner
                .push_async_versioned(ids_s.to_vec(), grads_s.to_vec(), version)
        })?;
        Ok(PyPushHandle { inner: h })
    }

    fn contains<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids_s = slice(&ids, "ids")?;
        Ok(self.run(py, || self.inner.contains(ids_s))?.into_pyarray(py))
    }

    fn remove(&self, py: Python<'_>, ids: PyReadonlyArray1<'_, u64>) -> PyResult<u64> {
        let ids_s = slice(&ids, "ids")?;
        self.run(py, || self.inner.remove(ids_s))
    }

    /// Removes the rows none of the last `steps` pushes updated, or not updated for `seconds`.
    #[pyo3(signature = (steps=None, seconds=None))]
    fn evict(&self, py: Python<'_>, steps: Option<u64>, seconds: Option<f64>) -> PyResult<u64> {
        self.run(py, || self.inner.evict(steps, seconds))
    }

    /// The update sequence number (summed over the servers of a remote table).
    #[getter]
    fn seq(&self, py: Python<'_>) -> PyResult<u64> {
        self.run(py, || self.inner.seq())
    }

    /// (admit_after, max_rows, evict_policy)
    #[getter]
    fn lifecycle(&self) -> (u32, Option<u64>, &'static str) {
        let l = &self.inner.config().lifecycle;
        let p = match l.policy {
            EvictPolicy::Lru => "lru",
            EvictPolicy::Lfu => "lfu",
        };
        (l.admit_after, l.max_rows, p)
    }

    /// Computed here: a row's initial value is a function of (seed, id) alone.
    fn initial_rows<'py>(
        &self,
        py: Python<'py>,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids_s = slice(&ids, "ids")?;
        let rows = run(py, || Ok(self.inner.initial_rows(ids_s)))?;
        rows.into_pyarray(py).reshape([ids_s.len(), self.inner.dim()])
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

/// A dense table, of the embedded store or of a store server.
#[pyclass(frozen, module = "pstore._native", name = "DenseTable")]
pub(crate) struct PyDenseTable {
    inner: Arc<dyn DenseTableApi>,
    guard: ForkGuard,
}

table_methods!(PyDenseTable {
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.inner.config().shape.clone()
    }

    /// Pushes applied (the home server's count for a remote table).
    #[getter]
    fn step(&self, py: Python<'_>) -> PyResult<u64> {
        self.run(py, || self.inner.step())
    }

    fn pull<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let v = self.run(py, || self.inner.pull())?;
        v.into_pyarray(py)
            .reshape(self.inner.config().shape.clone())
    }

    /// The value and the table version it was read at (one int for a remote table; empty for
    /// an embedded one).
    fn pull_versioned<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyArrayDyn<f32>>, Vec<u64>)> {
        let (v, version) = self.run(py, || self.inner.pull_versioned())?;
        let a = v
            .into_pyarray(py)
            .reshape(self.inner.config().shape.clone())?;
        Ok((a, version))
    }

    #[pyo3(signature = (grad, version=None))]
    fn push(
        &self,
        py: Python<'_>,
        grad: PyReadonlyArrayDyn<'_, f32>,
        version: Option<Vec<u64>>,
    ) -> PyResult<()> {
        self.check_shape(&grad)?;
        let g = slice(&grad, "grad")?;
        self.run(py, || self.inner.push_versioned(g, version))
    }

    #[pyo3(signature = (grad, version=None))]
    fn push_async(
        &self,
        py: Python<'_>,
        grad: PyReadonlyArrayDyn<'_, f32>,
        version: Option<Vec<u64>>,
    ) -> PyResult<PyPushHandle> {
        self.check_shape(&grad)?;
        let g = slice(&grad, "grad")?;
        let h = self.run(py, || self.inner.push_async_versioned(g.to_vec(), version))?;
        Ok(PyPushHandle { inner: h })
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

fn json<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

/// One server's view of a table, as a dict.
pub(crate) fn server_table_dict<'py>(
    py: Python<'py>,
    t: &ServerTable,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &t.name)?;
    d.set_item("kind", t.kind)?;
    d.set_item("rows", t.rows)?;
    d.set_item("seq", t.seq)?;
    d.set_item("lr", t.lr)?;
    d.set_item("stale_policy", t.stale_policy.as_str())?;
    d.set_item("max_staleness", t.max_staleness)?;
    d.set_item("config", json(py, &t.config_json)?)?;
    d.set_item("stats", json(py, &t.stats_json)?)?;
    Ok(d)
}

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let (d, t) = (PyDict::new(py), &s.table);
    d.set_item("rows", t.rows)?;
    d.set_item("bytes_used", t.bytes_used)?;
    d.set_item("huge_page_bytes", t.huge_page_bytes)?;
    d.set_item("pushes", t.pushes)?;
    d.set_item("pulls", t.pulls)?;
    d.set_item("ids_pushed", t.ids_pushed)?;
    d.set_item("ids_pulled", t.ids_pulled)?;
    d.set_item("rows_updated", t.rows_updated)?;
    d.set_item("rows_created", t.rows_created)?;
    d.set_item("rows_evicted", t.rows_evicted)?;
    d.set_item("rows_nonfinite", t.rows_nonfinite)?;
    d.set_item("rows_unloaded", t.rows_unloaded)?;
    d.set_item("seq", t.seq)?;
    d.set_item("lr", t.lr)?;
    if let Some(c) = &s.cluster {
        let st = PyDict::new(py);
        st.set_item("pushes", c.staleness.pushes)?;
        st.set_item("mean", c.staleness.mean)?;
        st.set_item("max", c.staleness.max)?;
        st.set_item("dropped", c.staleness.dropped)?;
        st.set_item("scaled", c.staleness.scaled)?;
        st.set_item("histogram", c.staleness.histogram.clone())?;
        st.set_item("buckets", c.staleness.buckets.clone())?;
        d.set_item("staleness", st)?;
        let per = PyList::empty(py);
        for t in &c.servers {
            let x = server_table_dict(py, t)?;
            x.set_item("server", &t.server)?;
            per.append(x)?;
        }
        d.set_item("servers", per)?;
    }
    Ok(d)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStoreApi>()?;
    m.add_class::<PySparseTable>()?;
    m.add_class::<PyDenseTable>()?;
    Ok(())
}
