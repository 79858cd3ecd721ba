//! pstore: an embedding-table parameter store for recommender systems.
//!
//! The core holds sparse tables (u64 id -> float32 row, created on first touch) and dense tensors,
//! and applies gradients with server-side optimizers. It has no Python in it; the PyO3 binding
//! lives in `python/`, behind the `python` feature.
//!
//! ```
//! use pstore::{Store, StoreConfig, SparseTableConfig, OptimizerConfig, OptimizerKind, Initializer};
//! use std::sync::Arc;
//!
//! let store = Store::new(StoreConfig::default()).unwrap();
//! let user = store
//!     .create_sparse_table(
//!         "user",
//!         SparseTableConfig {
//!             dim: 4,
//!             optimizer: OptimizerConfig {
//!                 kind: OptimizerKind::Adagrad {
//!                     initial_accumulator_value: 0.1,
//!                     eps: 1e-10,
//!                     weight_decay: 0.0,
//!                 },
//!                 lr: 0.05,
//!                 clip_value: None,
//!                 clip_norm: None,
//!             },
//!             initializer: Initializer::Zeros,
//!             seed: 7,
//!             lifecycle: Default::default(),
//!             refuse_nonfinite: false,
//!         },
//!     )
//!     .unwrap();
//! let ids = [3u64, 9, 3];
//! let rows = user.pull(&ids).unwrap();
//! assert_eq!(rows.len(), 3 * 4);
//! user.push(&ids, &[1.0; 12]).unwrap();
//! assert!(user.pull(&[3]).unwrap()[0] < 0.0);
//! ```

pub mod api;
mod buffer;
pub mod client;
pub mod durable;
pub mod error;
pub mod executor;
pub mod hash;
mod idle;
pub mod init;
pub mod net;
pub mod openmp;
pub mod ops;
pub mod optimizer;
pub mod reference;
pub mod server;
pub mod serving;
pub mod shard;
pub mod snapshot;
pub mod storage;
pub mod store;
pub mod table;

#[cfg(feature = "python")]
mod python;

pub use api::{AnyTable, DenseTableApi, PushPolicy, SparseTableApi, StalePolicy, Stats, StoreApi};
pub use durable::Durability;
pub use error::{Error, Result};
pub use executor::PushHandle;
pub use init::Initializer;
pub use optimizer::{OptimizerConfig, OptimizerKind};
pub use store::{DurableConfig, Store, StoreConfig, Table};
pub use table::{
    DenseTable, DenseTableConfig, EvictPolicy, Lifecycle, SparseTable, SparseTableConfig,
    TableHandle, TableStats,
};
