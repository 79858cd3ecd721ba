//! What a durable store keeps besides rows: the durability modes, the record of each table
//! (also a snapshot manifest's entry) and the meta keys.

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Error, Result};
use crate::table::{DenseTableConfig, SparseTableConfig, Table, TableHandle};

/// When a push is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// A push returns after the transaction holding its rows has committed to disk.
    Sync,
    /// A background flusher commits every `flush_interval`: a crash loses the pushes of the
    /// last interval plus the cycle in progress (up to five intervals plus two writes when its
    /// idle-priority writes wait for busy cores, the interval stretched up to
    /// [`MAX_STRETCH`](super::MAX_STRETCH) times while they cannot keep up; see [`crate::idle`] and
    /// `Flusher::adapt`).
    Async,
    /// Rows reach disk only on `flush()`, `close()` and snapshots.
    None,
}

impl Durability {
    /// The mode's name: `"sync"`, `"async"` or `"none"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Async => "async",
            Self::None => "none",
        }
    }
}

impl std::str::FromStr for Durability {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sync" => Ok(Self::Sync),
            "async" => Ok(Self::Async),
            "none" => Ok(Self::None),
            _ => Err(invalid(format!(
                "durability must be \"sync\", \"async\" or \"none\", got {s:?}"
            ))),
        }
    }
}

/// The counters a table record keeps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CountersRecord {
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
    /// Rows removed by eviction.
    pub rows_evicted: u64,
    /// Pushes a store server received (the table version; 0, and left out, where no server
    /// counted any).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub received: u64,
    /// Pushes a store server counted for its cluster (one per push over all servers; left out
    /// when 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub counted: u64,
    /// Updates that left a non-finite weight.
    #[serde(default)]
    pub rows_nonfinite: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// The meta record of a table (`table/<name>`), also a snapshot manifest's entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TableRecord {
    /// A sparse table.
    Sparse {
        /// The table's configuration.
        config: SparseTableConfig,
        /// The learning rate in force.
        lr: f64,
        /// The update sequence number.
        seq: u64,
        /// The counters.
        counters: CountersRecord,
        /// Tells a table from an earlier one of the same name (dropped and created again).
        #[serde(default)]
        uid: u64,
    },
    /// A dense table; its value is under `dense/<name>` in the meta database.
    Dense {
        /// The table's configuration.
        config: DenseTableConfig,
        /// The learning rate in force.
        lr: f64,
        /// The update sequence number.
        seq: u64,
        /// The counters.
        counters: CountersRecord,
        /// As for sparse tables.
        #[serde(default)]
        uid: u64,
    },
}

impl TableRecord {
    /// The record of a table as it is now.
    pub fn of(table: &Table) -> Self {
        match table {
            Table::Sparse(t) => TableRecord::Sparse {
                config: t.config().clone(),
                lr: t.lr(),
                seq: t.seq(),
                counters: counters_of(t.as_ref()),
                uid: t.common().uid(),
            },
            Table::Dense(t) => TableRecord::Dense {
                config: t.config().clone(),
                lr: t.lr(),
                seq: t.stats().seq,
                counters: counters_of(t.as_ref()),
                uid: t.common().uid(),
            },
        }
    }

    /// The table's unique id (0 in records written before it existed).
    pub fn uid(&self) -> u64 {
        match self {
            TableRecord::Sparse { uid, .. } | TableRecord::Dense { uid, .. } => *uid,
        }
    }

    /// The counters.
    pub fn counters(&self) -> &CountersRecord {
        match self {
            TableRecord::Sparse { counters, .. } | TableRecord::Dense { counters, .. } => counters,
        }
    }

    /// Serialised.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a table record serialises")
    }
}

fn counters_of(t: &dyn TableHandle) -> CountersRecord {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &t.common().counters;
    CountersRecord {
        pushes: c.pushes.load(Relaxed),
        pulls: c.pulls.load(Relaxed),
        ids_pushed: c.ids_pushed.load(Relaxed),
        ids_pulled: c.ids_pulled.load(Relaxed),
        rows_updated: c.rows_updated.load(Relaxed),
        rows_created: c.rows_created.load(Relaxed),
        rows_evicted: c.rows_evicted.load(Relaxed),
        received: c.received.load(Relaxed),
        counted: c.counted.load(Relaxed),
        rows_nonfinite: c.rows_nonfinite.load(Relaxed),
    }
}

/// Sets a table's counters from a record.
pub(crate) fn restore_counters(t: &dyn TableHandle, r: &CountersRecord) {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &t.common().counters;
    c.pushes.store(r.pushes, Relaxed);
    c.pulls.store(r.pulls, Relaxed);
    c.ids_pushed.store(r.ids_pushed, Relaxed);
    c.ids_pulled.store(r.ids_pulled, Relaxed);
    c.rows_updated.store(r.rows_updated, Relaxed);
    c.rows_created.store(r.rows_created, Relaxed);
    c.rows_evicted.store(r.rows_evicted, Relaxed);
    c.received.store(r.received, Relaxed);
    c.counted.store(r.counted, Relaxed);
    c.rows_nonfinite.store(r.rows_nonfinite, Relaxed);
}

/// The meta key of a table's record.
pub fn table_key(name: &str) -> String {
    format!("table/{name}")
}

/// The meta key of a dense table's value.
pub fn dense_key(name: &str) -> String {
    format!("dense/{name}")
}

/// The meta key of the last cycle number.
pub const CYCLE_KEY: &str = "cycle";

/// The key, in the `meta` of environments after the first, of the table sequence number that
/// the environment's rows of table `name` are at most (see docs/FORMAT.md, "Several
/// environments").
pub fn seq_key(name: &str) -> String {
    format!("seq/{name}")
}
