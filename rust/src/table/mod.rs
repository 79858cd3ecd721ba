//! The tables: sparse embedding tables (u64 id -> row) and dense tensors.

mod dense;
mod sparse;

pub use dense::{DenseTable, DenseTableConfig};
pub use sparse::{SparseTable, SparseTableConfig};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// The largest row width of a sparse table.
pub const MAX_DIM: usize = 4096;

/// Counters and sizes of a table, as `table.stats()` reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct TableStats {
    /// Rows stored (sparse) or 1 (dense).
    pub rows: u64,
    /// Bytes held by rows, state and index.
    pub bytes_used: u64,
    /// Push calls applied.
    pub pushes: u64,
    /// Pull calls answered.
    pub pulls: u64,
    /// Ids in applied pushes, duplicates included.
    pub ids_pushed: u64,
    /// Ids in answered pulls, duplicates included.
    pub ids_pulled: u64,
    /// Optimizer applications: one per unique id per push.
    pub rows_updated: u64,
    /// Rows created by first touch.
    pub rows_created: u64,
    /// Learning rate in force.
    pub lr: f64,
}

/// A learning rate that can be changed while pushes run.
#[derive(Debug)]
pub(crate) struct Lr(AtomicU64);

impl Lr {
    pub(crate) fn new(lr: f64) -> Self {
        Self(AtomicU64::new(lr.to_bits()))
    }
    pub(crate) fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
    pub(crate) fn set(&self, lr: f64) -> Result<()> {
        crate::optimizer::validate_lr(lr)?;
        self.0.store(lr.to_bits(), Ordering::Relaxed);
        Ok(())
    }
}

/// Set once a table is dropped from its store: handles still held then refuse every operation.
#[derive(Debug, Default)]
pub(crate) struct Dropped(std::sync::atomic::AtomicBool);

impl Dropped {
    pub(crate) fn mark(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub(crate) fn check(&self, name: &str) -> Result<()> {
        if self.0.load(Ordering::Acquire) {
            Err(Error::UnknownTable(format!(
                "{name} (dropped from its store; this handle is no longer usable)"
            )))
        } else {
            Ok(())
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub pushes: AtomicU64,
    pub pulls: AtomicU64,
    pub ids_pushed: AtomicU64,
    pub ids_pulled: AtomicU64,
    pub rows_updated: AtomicU64,
    pub rows_created: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub(crate) fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Fails with the position of the first NaN or infinity in `grads`, read as rows of `dim`.
pub(crate) fn check_finite(table: &str, grads: &[f32], dim: usize) -> Result<()> {
    if grads.iter().all(|g| g.is_finite()) {
        return Ok(());
    }
    let i = grads.iter().position(|g| !g.is_finite()).unwrap_or(0);
    Err(Error::NonFinite(format!(
        "table {table:?}: gradient holds {} at row {}, column {}; nothing was applied",
        grads[i],
        i / dim.max(1),
        i % dim.max(1)
    )))
}

/// A table name must be non-empty printable text.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 255 || name.chars().any(|c| c.is_control()) {
        return Err(Error::InvalidArgument(format!(
            "table name must be 1 to 255 bytes without control characters, got {name:?}"
        )));
    }
    Ok(())
}
