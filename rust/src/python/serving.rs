//! The binding of serving artifacts (export, lookups, live increments) and the model server.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use super::convert::err;
use super::net::{server_config, PyServer};
use super::{run, slice, PyCounter};
use crate::error::Error;
use crate::serving::{Artifact, Dtype, Fallback, Verify};

fn fallback(default: &str, row: Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Fallback> {
    match (default, row) {
        ("zeros", None) => Ok(Fallback::Zeros),
        ("initial", None) => Ok(Fallback::Initial),
        ("row", Some(r)) => Ok(Fallback::Row(slice(&r, "default row")?.to_vec())),
        (d, _) => Err(err(Error::InvalidArgument(format!(
            "default must be \"zeros\", \"initial\" or a row, got {d:?}"
        )))),
    }
}

fn json<T: serde::Serialize>(v: &T) -> PyResult<String> {
    serde_json::to_string(v).map_err(|e| err(Error::Internal(e.to_string())))
}

/// An open serving artifact.
#[pyclass(frozen, module = "pstore._native", name = "Artifact")]
pub(super) struct PyArtifact {
    inner: Arc<Artifact>,
    /// Opened for writing by this object (another object of the process may share a writable
    /// opening while this one stays read-only).
    writable: bool,
}

impl PyArtifact {
    fn check_writable(&self) -> PyResult<()> {
        if self.writable {
            Ok(())
        } else {
            Err(err(Error::InvalidArgument(format!(
                "the artifact at {} is open read-only; open it writable to apply snapshots",
                self.inner.path().display()
            ))))
        }
    }
}

#[pymethods]
impl PyArtifact {
    #[new]
    #[pyo3(signature = (path, writable=false, verify=None))]
    fn new(py: Python<'_>, path: PathBuf, writable: bool, verify: Option<&str>) -> PyResult<Self> {
        let verify = verify.map(Verify::parse).transpose().map_err(err)?;
        let inner = run(py, || Artifact::open_with(&path, writable, verify))?;
        Ok(Self { inner, writable })
    }

    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    #[getter]
    fn file_bytes(&self) -> u64 {
        self.inner.file_bytes()
    }

    /// The state record as JSON.
    fn state_json(&self, py: Python<'_>) -> PyResult<String> {
        let s = run(py, || self.inner.state())?;
        json(&s)
    }

    /// (rows, found mask or None, generation).
    #[pyo3(signature = (table, ids, default="zeros", row=None, mask=false))]
    #[allow(clippy::type_complexity)]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: PyReadonlyArray1<'py, u64>,
        default: &str,
        row: Option<PyReadonlyArray1<'py, f32>>,
        mask: bool,
    ) -> PyResult<(
        Bound<'py, PyArray2<f32>>,
        Option<Bound<'py, PyArray1<bool>>>,
        u64,
    )> {
        let fb = fallback(default, row)?;
        let ids_s = slice(&ids, "ids")?;
        let a = &self.inner;
        let r = run(py, || a.lookup_owned(table, ids_s, &fb))?;
        // The vectors become the arrays without a copy.
        let rows = r.rows.into_pyarray(py).reshape([ids_s.len(), r.dim])?;
        let found = mask.then(|| r.found.into_pyarray(py));
        Ok((rows, found, r.generation))
    }

    fn contains<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids_s = slice(&ids, "ids")?;
        let a = &self.inner;
        let m = run(py, || a.contains(table, ids_s))?;
        Ok(m.into_pyarray(py))
    }

    /// (rows verified in this process, rows, bitmap bytes, background check's state) of a
    /// sparse table's row file.
    #[allow(clippy::type_complexity)]
    fn verified(
        &self,
        py: Python<'_>,
        table: &str,
    ) -> PyResult<Option<(u64, u64, usize, &'static str)>> {
        let a = &self.inner;
        let v = run(py, || a.verified(table))?;
        Ok(v.map(|v| (v.rows_verified, v.rows, v.bitmap_bytes, v.scan.as_str())))
    }

    fn dense<'py>(&self, py: Python<'py>, table: &str) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let a = &self.inner;
        let (shape, v) = run(py, || a.dense(table))?;
        v.into_pyarray(py).reshape(shape)
    }

    /// (ids, stored bytes as uint8, dim, dtype name) of every row, in id order.
    #[allow(clippy::type_complexity)]
    fn scan<'py>(
        &self,
        py: Python<'py>,
        table: &str,
    ) -> PyResult<(
        Bound<'py, PyArray1<u64>>,
        Bound<'py, PyArray1<u8>>,
        usize,
        &'static str,
    )> {
        let a = &self.inner;
        let (ids, bytes, dim, dtype) = run(py, || a.scan(table))?;
        Ok((
            ids.into_pyarray(py),
            bytes.into_pyarray(py),
            dim,
            dtype.as_str(),
        ))
    }

    /// Applies a snapshot; JSON of what it did, or None when the artifact is at it already.
    fn apply(&self, py: Python<'_>, dir: PathBuf) -> PyResult<Option<String>> {
        self.check_writable()?;
        let a = &self.inner;
        let r = run(py, || a.apply(&dir))?;
        r.as_ref().map(json).transpose()
    }

    /// Applies the snapshots under `root` that are newer; JSON list of what was applied.
    fn follow(&self, py: Python<'_>, root: PathBuf) -> PyResult<String> {
        self.check_writable()?;
        let a = &self.inner;
        let r = run(py, || a.follow(&root))?;
        json(&r)
    }

    /// The snapshot directories under `root` that `follow` would apply, in order.
    fn pending(&self, py: Python<'_>, root: PathBuf) -> PyResult<Vec<String>> {
        let a = &self.inner;
        let r = run(py, || a.pending(&root))?;
        Ok(r.iter().map(|p| p.display().to_string()).collect())
    }

    /// Serves the artifact read-only over gRPC.
    #[pyo3(signature = (
        default="initial", row=None, host="127.0.0.1", port=0, metrics_port=None, token=None,
        read_token=None, tls_cert=None, tls_key=None, max_message=None, net=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        py: Python<'_>,
        default: &str,
        row: Option<PyReadonlyArray1<'_, f32>>,
        host: &str,
        port: u16,
        metrics_port: Option<u16>,
        token: Option<String>,
        read_token: Option<String>,
        tls_cert: Option<Vec<u8>>,
        tls_key: Option<Vec<u8>>,
        max_message: Option<usize>,
        net: Option<&str>,
    ) -> PyResult<PyServer> {
        let fb = fallback(default, row)?;
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
        let a = Arc::clone(&self.inner);
        let h = run(py, move || crate::server::model::start(a, fb, cfg))?;
        Ok(PyServer::of(h))
    }
}

/// Builds an artifact from a snapshot chain; JSON of what it wrote.
#[pyfunction]
#[pyo3(signature = (snapshot, out, tables=None, dtype="float32", progress=None))]
fn export_artifact(
    py: Python<'_>,
    snapshot: PathBuf,
    out: PathBuf,
    tables: Option<Vec<String>>,
    dtype: &str,
    progress: Option<&PyCounter>,
) -> PyResult<String> {
    let d = Dtype::parse(dtype).map_err(err)?;
    let local = Arc::new(AtomicU64::new(0));
    let done = progress.map_or(local, |c| Arc::clone(&c.0));
    let r = run(py, || {
        crate::serving::export(&snapshot, &out, tables, d, &done)
    })?;
    json(&r)
}

/// Adds the classes and functions to the module.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyArtifact>()?;
    m.add_function(wrap_pyfunction!(export_artifact, m)?)?;
    m.add_function(wrap_pyfunction!(newest_snapshot, m)?)?;
    Ok(())
}

/// The newest snapshot directory under `root`, or None.
#[pyfunction]
fn newest_snapshot(py: Python<'_>, root: PathBuf) -> PyResult<Option<String>> {
    let r = run(py, || crate::serving::newest_snapshot(&root))?;
    Ok(r.map(|p| p.display().to_string()))
}
