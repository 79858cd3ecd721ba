//! The benchmarks' reference kernels (`crate::reference`) for Python: `ReferenceRows`.

use std::sync::Mutex;

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::{run, slice};
use crate::error::Error;
use crate::reference::DenseRows;

/// Rows at fixed positions, 64-byte aligned, for the dense-gather and read-modify-write limits
/// that the benchmarks report pstore against (not a table: no ids, no locks).
#[pyclass(frozen, module = "pstore._native", name = "ReferenceRows")]
pub(crate) struct PyReferenceRows {
    rows: Mutex<DenseRows>,
}

#[pymethods]
impl PyReferenceRows {
    /// Rows of `words` float32, each starting with a row of `init` (n x dim), the rest `fill`.
    #[new]
    fn new(
        py: Python<'_>,
        init: PyReadonlyArray2<'_, f32>,
        words: usize,
        fill: f32,
    ) -> PyResult<Self> {
        let (n, dim) = (init.shape()[0], init.shape()[1]);
        let init_s = slice(&init, "init")?;
        let rows = run(py, || DenseRows::new(n, words, dim, init_s, fill))?;
        Ok(Self {
            rows: Mutex::new(rows),
        })
    }

    /// Whether the kernel took `MADV_HUGEPAGE` for the rows.
    #[getter]
    fn huge_pages(&self) -> bool {
        self.lock().huge_pages()
    }

    /// `out[i] = rows[positions[i]][:dim]` (out is n x dim, C-contiguous float32).
    #[pyo3(signature = (positions, out, threads=1, prefetch=true))]
    fn gather(
        &self,
        py: Python<'_>,
        positions: PyReadonlyArray1<'_, u64>,
        mut out: PyReadwriteArray2<'_, f32>,
        threads: usize,
        prefetch: bool,
    ) -> PyResult<()> {
        let dim = out.shape()[1];
        let pos = slice(&positions, "positions")?;
        let out_s = out
            .as_slice_mut()
            .map_err(|_| super::err(Error::Shape("out must be C-contiguous".into())))?;
        let guard = self.lock();
        let rows: &DenseRows = &guard;
        run(py, || rows.gather(pos, dim, out_s, threads, prefetch))
    }

    /// Indexes the rows by id (row i gets ids[i], all distinct) for `lookup`; returns whether
    /// the index is on huge pages.
    fn index(&self, py: Python<'_>, ids: PyReadonlyArray1<'_, u64>) -> PyResult<bool> {
        let ids = slice(&ids, "ids")?;
        let mut guard = self.lock();
        let rows: &mut DenseRows = &mut guard;
        run(py, || rows.index(ids))
    }

    /// `out[i] = rows[row of ids[i]][:dim]` through the index, zeros for an id without a row;
    /// returns how many had none (the hashed-lookup limit).
    #[pyo3(signature = (ids, out, threads=1, prefetch=true))]
    fn lookup(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, u64>,
        mut out: PyReadwriteArray2<'_, f32>,
        threads: usize,
        prefetch: bool,
    ) -> PyResult<usize> {
        let dim = out.shape()[1];
        let ids = slice(&ids, "ids")?;
        let out_s = out
            .as_slice_mut()
            .map_err(|_| super::err(Error::Shape("out must be C-contiguous".into())))?;
        let guard = self.lock();
        let rows: &DenseRows = &guard;
        run(py, || rows.lookup(ids, dim, out_s, threads, prefetch))
    }

    /// One Adagrad step per position (weights in words 0..dim, accumulators in dim..2*dim).
    #[pyo3(signature = (positions, grads, lr, threads=1, prefetch=true))]
    fn adagrad(
        &self,
        py: Python<'_>,
        positions: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        lr: f32,
        threads: usize,
        prefetch: bool,
    ) -> PyResult<()> {
        self.update(py, positions, grads, |rows, pos, dim, g| {
            rows.adagrad(pos, dim, g, lr, threads, prefetch)
        })
    }

    /// One Adam step per position (weights in words 0..dim, first moments in dim..2*dim,
    /// second moments in 2*dim..3*dim), bias-corrected by `step` (from 1, one count for all
    /// rows).
    #[pyo3(signature = (positions, grads, lr, beta1, beta2, eps, step, threads=1, prefetch=true))]
    #[allow(clippy::too_many_arguments)]
    fn adam(
        &self,
        py: Python<'_>,
        positions: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        step: u32,
        threads: usize,
        prefetch: bool,
    ) -> PyResult<()> {
        self.update(py, positions, grads, |rows, pos, dim, g| {
            let betas = (beta1, beta2, eps);
            rows.adam(pos, dim, g, lr, betas, step, threads, prefetch)
        })
    }
}

impl PyReferenceRows {
    fn lock(&self) -> std::sync::MutexGuard<'_, DenseRows> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs an optimizer step `step(rows, positions, dim, grads)` with the GIL released, `dim`
    /// read off the gradients' shape.
    fn update(
        &self,
        py: Python<'_>,
        positions: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        step: impl FnOnce(&mut DenseRows, &[u64], usize, &[f32]) -> crate::error::Result<()> + Send,
    ) -> PyResult<()> {
        let dim = grads.shape()[1];
        let (pos, g) = (slice(&positions, "positions")?, slice(&grads, "grads")?);
        let mut guard = self.lock();
        let rows: &mut DenseRows = &mut guard;
        run(py, || step(rows, pos, dim, g))
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyReferenceRows>()
}
