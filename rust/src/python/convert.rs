//! Conversions at the boundary: errors to Python exceptions, Python config dicts to core configs,
//! and the guard against using a store's threads after `fork()`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use crate::error::Error;
use crate::init::Initializer;
use crate::optimizer::OptimizerConfig;

/// The one mapping from core errors to the exception classes of `pstore.exceptions`, each of which
/// also derives from the built-in a Python user expects.
pub fn err(e: Error) -> PyErr {
    let class = match &e {
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::Shape(_) => "ShapeError",
        Error::NonFinite(_) => "NonFiniteError",
        Error::Dtype(_) => "DtypeError",
        Error::UnknownTable(_) => "UnknownTableError",
        Error::TableExists(_) | Error::TableMismatch(..) => "TableExistsError",
        Error::PartialPush { .. } => "PartialPushError",
        Error::WrongKind(_) => "WrongTableKindError",
        Error::Storage(_) => "StorageError",
        Error::Corrupt(_) => "CorruptError",
        Error::Internal(_) => "InternalError",
        Error::WorkerLost(_) => "WorkerLostError",
        // DEADLINE_EXCEEDED, UNAUTHENTICATED, PERMISSION_DENIED.
        Error::Remote { code: 4, .. } => "ServerTimeoutError",
        Error::Remote { code: 7 | 16, .. } => "AuthenticationError",
        Error::Remote { .. } => "ServerError",
    };
    let code = match &e {
        Error::Remote { code, .. } => Some(*code),
        Error::PartialPush { .. } => Some(14),
        _ => None,
    };
    let parts = match &e {
        Error::PartialPush {
            applied, failed, ..
        } => Some((applied.clone(), failed.clone())),
        _ => None,
    };
    let msg = e.to_string();
    Python::attach(|py| {
        let ty = py
            .import("pstore.exceptions")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match ty {
            Ok(ty) => {
                let e = PyErr::from_type(ty, msg);
                if let Some(code) = code {
                    // A Python attribute of the exception instance (`ServerError.code`).
                    let _ = e.value(py).setattr("_code", code);
                }
                if let Some((applied, failed)) = parts {
                    let _ = e.value(py).setattr("applied", applied);
                    let _ = e.value(py).setattr("failed", failed);
                }
                e
            }
            Err(import_error) => import_error,
        }
    })
}

/// A Python value of a config's serde form (dicts with str keys, lists, tuples, str, bool, int,
/// float, None) as JSON. `path` names the value in errors; a float must be finite.
fn json_of(v: &Bound<'_, PyAny>, path: &str) -> PyResult<serde_json::Value> {
    use serde_json::Value;
    let bad = |what: String| err(Error::InvalidArgument(what));
    if v.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = v.cast::<pyo3::types::PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(i) = v.extract::<i64>() {
        return Ok(Value::from(i));
    }
    if let Ok(x) = v.extract::<f64>() {
        return serde_json::Number::from_f64(x)
            .map(Value::Number)
            .ok_or_else(|| bad(format!("{path} must be finite, got {x}")));
    }
    if let Ok(s) = v.extract::<String>() {
        return Ok(Value::String(s));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        let mut m = serde_json::Map::new();
        for (k, x) in d.iter() {
            let k: String = k
                .extract()
                .map_err(|_| bad(format!("{path} has a key that is not a string")))?;
            let at = format!("{path} {k}");
            m.insert(k, json_of(&x, &at)?);
        }
        return Ok(Value::Object(m));
    }
    if let Ok(seq) = v.extract::<Vec<Bound<'_, PyAny>>>() {
        let items = seq
            .iter()
            .map(|x| json_of(x, path))
            .collect::<PyResult<_>>()?;
        return Ok(Value::Array(items));
    }
    Err(bad(format!(
        "{path} must be a number, string, bool or None, got {}",
        v.get_type().name()?
    )))
}

/// JSON as the Python value of a config's serde form.
fn py_of<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use pyo3::IntoPyObjectExt;
    use serde_json::Value;
    match v {
        Value::Null => Ok(py.None().into_bound(py)),
        Value::Bool(b) => b.into_bound_py_any(py),
        Value::Number(n) => match n.as_i64() {
            Some(i) => i.into_bound_py_any(py),
            None => n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py),
        },
        Value::String(s) => s.into_bound_py_any(py),
        Value::Array(a) => {
            let items = a
                .iter()
                .map(|x| py_of(py, x))
                .collect::<PyResult<Vec<_>>>()?;
            pyo3::types::PyList::new(py, items)?.into_bound_py_any(py)
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, py_of(py, x)?)?;
            }
            Ok(d.into_any())
        }
    }
}

/// An optimizer from its serde form (`pstore.optim.*._spec()`), validated.
pub fn optimizer_from(d: &Bound<'_, PyDict>) -> PyResult<OptimizerConfig> {
    let v = json_of(d.as_any(), "optimizer")?;
    OptimizerConfig::from_json(&v.to_string()).map_err(err)
}

/// An initialiser from its serde form (`pstore.init.*._spec()`), validated.
pub fn initializer_from(d: &Bound<'_, PyAny>) -> PyResult<Initializer> {
    let v = json_of(d, "initializer")?;
    Initializer::from_json(&v.to_string()).map_err(err)
}

/// The serde form of an optimizer, as `pstore.optim.*._spec()` builds it.
pub fn optimizer_spec<'py>(py: Python<'py>, o: &OptimizerConfig) -> PyResult<Bound<'py, PyAny>> {
    let v = serde_json::to_value(o).map_err(|e| err(Error::Internal(e.to_string())))?;
    py_of(py, &v)
}

/// The serde form of an initialiser, as `pstore.init.*._spec()` builds it.
pub fn initializer_spec<'py>(py: Python<'py>, i: &Initializer) -> PyResult<Bound<'py, PyAny>> {
    let v = serde_json::to_value(i).map_err(|e| err(Error::Internal(e.to_string())))?;
    py_of(py, &v)
}

/// The schema of the optimizers and initialisers, derived from their serde form (JSON text:
/// `{"optimizer": {"common": [...], "kinds": {...}}, "initializer": {...}}`).
#[pyfunction]
pub fn config_schema() -> String {
    serde_json::json!({
        "optimizer": crate::optimizer::schema(),
        "initializer": crate::init::schema(),
    })
    .to_string()
}

/// Remembers the process that built a store: its thread pool does not survive `fork()`, so a
/// child process gets a clear error instead of a hang.
#[derive(Clone, Copy)]
pub struct ForkGuard {
    pid: Option<u32>,
}

impl ForkGuard {
    pub fn new() -> Self {
        Self {
            pid: Some(std::process::id()),
        }
    }

    /// No guard: for objects whose work does not need the threads of their creator.
    pub fn none() -> Self {
        Self { pid: None }
    }

    pub fn check(&self) -> PyResult<()> {
        if self.pid.is_none_or(|p| p == std::process::id()) {
            Ok(())
        } else {
            Err(err(Error::InvalidArgument(
                "this store was created in another process (before fork()); its threads do not \
                 exist here: create the store in the child process"
                    .into(),
            )))
        }
    }
}
