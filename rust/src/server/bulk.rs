//! The bulk load of a store server: rows written as they are (weights, optimizer state, step,
//! version, frequency), the server's side of restoring a cluster snapshot onto any server list
//! (`crate::client::cluster`).
//!
//! A request whose rows do not fit the table (another dim, optimizer or shape) is refused before
//! anything is written, with an error naming both sides.

use crate::error::{invalid, Result};
use crate::net::proto::{BulkLoadRequest, BulkLoadResponse};
use crate::net::wire;
use crate::store::{Store, Table};
use crate::table::{DenseTableConfig, SparseTableConfig, TableHandle};

/// Writes the rows of `r` into its table on `store`.
pub(super) fn bulk_load(store: &Store, r: BulkLoadRequest) -> Result<BulkLoadResponse> {
    let bad = |e: serde_json::Error| invalid(format!("bulk load: config_json: {e}"));
    match store.table(&r.table)? {
        Table::Sparse(t) => {
            let c: SparseTableConfig = serde_json::from_str(&r.config_json).map_err(bad)?;
            let have = t.config();
            if c.dim != have.dim || c.optimizer != have.optimizer {
                return Err(invalid(format!(
                    "bulk load into table {:?}: the table has dim {} and optimizer {}, the rows \
                     have dim {} and optimizer {}; nothing was loaded",
                    r.table,
                    have.dim,
                    serde_json::to_string(&have.optimizer).unwrap_or_default(),
                    c.dim,
                    serde_json::to_string(&c.optimizer).unwrap_or_default(),
                )));
            }
            let ids = wire::ids(&r.ids)?;
            let words = wire::words(&r.words)?;
            // put_rows checks the word count before it writes anything. A `sync` store commits
            // the rows before the answer (a failed commit undoes them, and the load says so; a
            // load is idempotent, so its retry is safe either way).
            let epoch = t.common().revert_epoch();
            // Rows the old owner removed during a pre-copy move (decision 0114).
            let removed = wire::ids(&r.removed_ids)?;
            t.put_rows(&ids, &words)?;
            if !removed.is_empty() {
                t.remove(&removed)?;
            }
            t.common().durable_wait_change(epoch, "bulk load")?;
            if let Some(seq) = r.seq {
                t.set_seq(t.seq().max(seq));
            }
            Ok(BulkLoadResponse {
                rows: ids.len() as u64,
                table_rows: t.len() as u64,
            })
        }
        Table::Dense(d) => {
            let c: DenseTableConfig = serde_json::from_str(&r.config_json).map_err(bad)?;
            if c.shape != d.config().shape || c.optimizer != d.config().optimizer {
                return Err(invalid(format!(
                    "bulk load into dense table {:?}: the table has shape {:?} and optimizer {}, \
                     the value has shape {:?} and optimizer {}; nothing was loaded",
                    r.table,
                    d.config().shape,
                    serde_json::to_string(&d.config().optimizer).unwrap_or_default(),
                    c.shape,
                    serde_json::to_string(&c.optimizer).unwrap_or_default(),
                )));
            }
            if !r.ids.is_empty() || !r.removed_ids.is_empty() {
                return Err(invalid(format!(
                    "bulk load into dense table {:?}: ids and removed_ids are for sparse tables",
                    r.table
                )));
            }
            let words = wire::words(&r.words)?;
            if let Some(start) = r.dense_offset {
                // One chunk of a value that moves in several (`ExportSlots`).
                let epoch = d.common().revert_epoch();
                d.set_words_at(start as usize, &words)?;
                d.common().durable_wait_change(epoch, "bulk load")?;
                return Ok(BulkLoadResponse {
                    rows: u64::from(start == 0 && !words.is_empty()),
                    table_rows: 1,
                });
            }
            let want = d.words_len();
            if !words.is_empty() && words.len() != want {
                return Err(invalid(format!(
                    "bulk load into dense table {:?}: {} words, the table's value has {want}",
                    r.table,
                    words.len()
                )));
            }
            if !words.is_empty() {
                let epoch = d.common().revert_epoch();
                d.set_words(&words)?;
                d.common().durable_wait_change(epoch, "bulk load")?;
            }
            Ok(BulkLoadResponse {
                rows: u64::from(!words.is_empty()),
                table_rows: 1,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    fn config(dim: usize) -> SparseTableConfig {
        SparseTableConfig {
            dim,
            optimizer: Default::default(),
            initializer: crate::init::Initializer::Zeros,
            seed: 0,
            lifecycle: Default::default(),
            refuse_nonfinite: false,
        }
    }

    fn request(c: &SparseTableConfig, ids: &[u64], words: &[u32]) -> BulkLoadRequest {
        BulkLoadRequest {
            table: "t".into(),
            config_json: serde_json::to_string(c).unwrap(),
            ids: wire::encode_ids(ids),
            words: words.iter().flat_map(|w| w.to_le_bytes()).collect(),
            seq: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn rows_are_written_as_they_are_or_refused_whole() {
        let store = Store::new(StoreConfig::default()).unwrap();
        let t = store.create_sparse_table("t", config(2)).unwrap();
        let m = t.row_words();
        let words: Vec<u32> = (0..2 * m as u32).map(|w| w + 1).collect();
        // Another dim: refused, naming both, nothing written.
        let e = bulk_load(&store, request(&config(3), &[1, 2], &words)).unwrap_err();
        assert!(
            e.to_string().contains("dim 2") && e.to_string().contains("dim 3"),
            "{e}"
        );
        // Another optimizer.
        let mut other = config(2);
        other.optimizer.lr *= 2.0;
        let e = bulk_load(&store, request(&other, &[1, 2], &words)).unwrap_err();
        assert!(e.to_string().contains("optimizer"), "{e}");
        // A word short.
        assert!(bulk_load(&store, request(&config(2), &[1, 2], &words[1..])).is_err());
        assert_eq!(t.len(), 0);
        assert_eq!(t.seq(), 0);
        let r = bulk_load(&store, request(&config(2), &[1, 2], &words)).unwrap();
        assert_eq!((r.rows, r.table_rows, t.seq()), (2, 2, 7));
        let w = t.pull(&[1, 2]).unwrap();
        assert_eq!(w[0].to_bits(), words[crate::shard::META]);
        assert_eq!(w[2].to_bits(), words[m + crate::shard::META]);
    }
}
