//! Conversions at the boundary: errors to Python exceptions, Python config dicts to core configs,
//! and the guard against using a store's threads after `fork()`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use crate::error::Error;
use crate::init::Initializer;
use crate::optimizer::{OptimizerConfig, OptimizerKind};

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

fn bad(msg: String) -> PyErr {
    err(Error::InvalidArgument(msg))
}

fn get_f64(d: &Bound<'_, PyDict>, key: &str, default: Option<f64>) -> PyResult<f64> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => v.extract::<f64>().map_err(|_| {
            bad(format!(
                "optimizer/initializer field {key:?} must be a number"
            ))
        }),
        _ => default.ok_or_else(|| bad(format!("missing field {key:?}"))),
    }
}

fn get_opt(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<f64>> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => Ok(Some(get_f64(d, key, None)?)),
        _ => Ok(None),
    }
}

fn get_kind(d: &Bound<'_, PyDict>) -> PyResult<String> {
    d.get_item("kind")?
        .ok_or_else(|| bad("missing field \"kind\"".into()))?
        .extract::<String>()
        .map_err(|_| bad("field \"kind\" must be a string".into()))
}

/// An optimizer from its dict form (`pstore.optim.*._spec()`).
pub fn optimizer_from(d: &Bound<'_, PyDict>) -> PyResult<OptimizerConfig> {
    let kind = match get_kind(d)?.as_str() {
        "sgd" => OptimizerKind::Sgd {
            momentum: get_f64(d, "momentum", Some(0.0))?,
            weight_decay: get_f64(d, "weight_decay", Some(0.0))?,
            nesterov: match d.get_item("nesterov")? {
                Some(v) => v.is_truthy()?,
                None => false,
            },
        },
        "adagrad" => OptimizerKind::Adagrad {
            initial_accumulator_value: get_f64(d, "initial_accumulator_value", Some(0.1))?,
            eps: get_f64(d, "eps", Some(1e-10))?,
            weight_decay: get_f64(d, "weight_decay", Some(0.0))?,
        },
        "adam" => OptimizerKind::Adam {
            beta1: get_f64(d, "beta1", Some(0.9))?,
            beta2: get_f64(d, "beta2", Some(0.999))?,
            eps: get_f64(d, "eps", Some(1e-8))?,
            weight_decay: get_f64(d, "weight_decay", Some(0.0))?,
        },
        "ftrl" => OptimizerKind::Ftrl {
            beta: get_f64(d, "beta", Some(1.0))?,
            l1: get_f64(d, "l1", Some(0.0))?,
            l2: get_f64(d, "l2", Some(0.0))?,
        },
        other => return Err(bad(format!("unknown optimizer kind {other:?}"))),
    };
    let cfg = OptimizerConfig {
        kind,
        lr: get_f64(d, "lr", None)?,
        clip_value: get_opt(d, "clip_value")?,
        clip_norm: get_opt(d, "clip_norm")?,
    };
    cfg.validate().map_err(err)?;
    Ok(cfg)
}

/// An initialiser from its dict form (`pstore.init.*._spec()`).
pub fn initializer_from(d: &Bound<'_, PyDict>) -> PyResult<Initializer> {
    let f = |k: &str| get_f64(d, k, None);
    let init = match get_kind(d)?.as_str() {
        "zeros" => Initializer::Zeros,
        "constant" => Initializer::Constant(f("value")?),
        "uniform" => Initializer::Uniform {
            low: f("low")?,
            high: f("high")?,
        },
        "normal" => Initializer::Normal {
            mean: f("mean")?,
            std: f("std")?,
        },
        "truncated_normal" => Initializer::TruncatedNormal {
            mean: f("mean")?,
            std: f("std")?,
        },
        other => return Err(bad(format!("unknown initializer kind {other:?}"))),
    };
    init.validate().map_err(err)?;
    Ok(init)
}

/// The dict form of an optimizer, as `pstore.optim.*._spec()` builds it.
pub fn optimizer_spec<'py>(py: Python<'py>, o: &OptimizerConfig) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", o.name())?;
    d.set_item("lr", o.lr)?;
    d.set_item("clip_value", o.clip_value)?;
    d.set_item("clip_norm", o.clip_norm)?;
    match o.kind {
        OptimizerKind::Sgd {
            momentum,
            weight_decay,
            nesterov,
        } => {
            d.set_item("momentum", momentum)?;
            d.set_item("weight_decay", weight_decay)?;
            d.set_item("nesterov", nesterov)?;
        }
        OptimizerKind::Adagrad {
            initial_accumulator_value,
            eps,
            weight_decay,
        } => {
            d.set_item("initial_accumulator_value", initial_accumulator_value)?;
            d.set_item("eps", eps)?;
            d.set_item("weight_decay", weight_decay)?;
        }
        OptimizerKind::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            d.set_item("beta1", beta1)?;
            d.set_item("beta2", beta2)?;
            d.set_item("eps", eps)?;
            d.set_item("weight_decay", weight_decay)?;
        }
        OptimizerKind::Ftrl { beta, l1, l2 } => {
            d.set_item("beta", beta)?;
            d.set_item("l1", l1)?;
            d.set_item("l2", l2)?;
        }
    }
    Ok(d)
}

/// The dict form of an initialiser, as `pstore.init.*._spec()` builds it.
pub fn initializer_spec<'py>(py: Python<'py>, i: &Initializer) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match *i {
        Initializer::Zeros => d.set_item("kind", "zeros")?,
        Initializer::Constant(v) => {
            d.set_item("kind", "constant")?;
            d.set_item("value", v)?;
        }
        Initializer::Uniform { low, high } => {
            d.set_item("kind", "uniform")?;
            d.set_item("low", low)?;
            d.set_item("high", high)?;
        }
        Initializer::Normal { mean, std } | Initializer::TruncatedNormal { mean, std } => {
            let kind = if matches!(i, Initializer::Normal { .. }) {
                "normal"
            } else {
                "truncated_normal"
            };
            d.set_item("kind", kind)?;
            d.set_item("mean", mean)?;
            d.set_item("std", std)?;
        }
    }
    Ok(d)
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
