//! How a sparse table is built: its configuration and lifecycle settings.

use crate::error::{invalid, Result};
use crate::init::Initializer;
use crate::optimizer::OptimizerConfig;
use crate::table::MAX_DIM;

/// How a sparse table is built.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SparseTableConfig {
    /// Row width, 1..=4096.
    pub dim: usize,
    /// The optimizer applied by pushes.
    pub optimizer: OptimizerConfig,
    /// The value of a row before its first update, a function of (seed, id).
    pub initializer: Initializer,
    /// The seed of the initialiser.
    pub seed: u64,
    /// Admission and eviction.
    #[serde(default)]
    pub lifecycle: Lifecycle,
    /// Refuse a push whose update would leave a NaN or infinite weight (finite gradients can
    /// overflow a weight): the push fails with a non-finite error and changes nothing. Such
    /// pushes of the table then run one at a time. Off: the update is applied and counted
    /// (`rows_nonfinite`).
    #[serde(default)]
    pub refuse_nonfinite: bool,
}

/// Which rows a `max_rows` budget evicts first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictPolicy {
    /// Least recently updated first.
    #[default]
    Lru,
    /// Least frequently pushed first (then least recently updated).
    Lfu,
}

/// What recommender id spaces need: admission of ids seen often enough, and a row budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Lifecycle {
    /// An id gets a row once it has been pushed this many times (0 and 1: at once). Until then
    /// pulls return its initial value without storing a row, and pushes only count it.
    pub admit_after: u32,
    /// The most rows the table keeps; past it, the policy evicts down to 99% of the budget.
    pub max_rows: Option<u64>,
    /// Which rows the budget evicts first.
    pub policy: EvictPolicy,
}

impl SparseTableConfig {
    /// The values the rows of `ids` have before their first update, row after row: a function
    /// of (seed, id) alone, the same on every store and server.
    pub fn initial_rows(&self, ids: &[u64]) -> Vec<f32> {
        let mut rows = vec![0.0; ids.len() * self.dim];
        for (row, &id) in rows.chunks_exact_mut(self.dim).zip(ids) {
            self.initializer.fill(self.seed, id, row);
        }
        rows
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.dim > MAX_DIM {
            return Err(invalid(format!(
                "dim must be in 1..={MAX_DIM}, got {}",
                self.dim
            )));
        }
        if self.lifecycle.max_rows == Some(0) {
            return Err(invalid("max_rows must be >= 1"));
        }
        self.optimizer.validate()?;
        self.initializer.validate()
    }
}
