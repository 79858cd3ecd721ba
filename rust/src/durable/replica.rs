//! The replica as the rows source of its tables: a table of a durable store loads each row from
//! the replica on first touch (see [`RowSource`]).

use std::path::Path;

use crate::error::{corrupt, Result};
use crate::storage::{words_into, Db, Storage};
use crate::table::RowSource;

/// The words of a row of table `table` (rows of `m` words) as the replica at `store` holds them
/// (its payload), into `out` (cleared first); a payload of the wrong length is a corrupt replica.
pub(crate) fn replica_row(
    store: &Path,
    table: &str,
    m: usize,
    id: u64,
    payload: &[u8],
    out: &mut Vec<u32>,
) -> Result<()> {
    out.clear();
    words_into(payload, out);
    if out.len() == m {
        return Ok(());
    }
    Err(wrong_len(store, table, m, id, out.len()))
}

/// The error of a row of `n` words where its table's rows have `m`.
fn wrong_len(store: &Path, table: &str, m: usize, id: u64, n: usize) -> crate::Error {
    corrupt(format!(
        "{}: table {table:?} row {id} holds {n} words, not {m}",
        store.display(),
    ))
}

impl RowSource for Storage {
    fn read_rows(
        &self,
        table: &str,
        m: usize,
        ids: &[u64],
        found: &mut dyn FnMut(usize, &[u32]),
    ) -> Result<()> {
        let mut value = Vec::with_capacity(m + 3);
        self.read(|r| {
            let rows = r.open(Db::Rows, table);
            r.rows_words_in(rows.as_ref(), table, ids, &mut value, &mut |k, words| {
                if words.len() != m {
                    return Err(wrong_len(self.path(), table, m, ids[k], words.len()));
                }
                found(k, words);
                Ok(())
            })
        })
    }

    fn has_rows(&self, table: &str, ids: &[u64], has: &mut dyn FnMut(usize, bool)) -> Result<()> {
        self.read(|r| {
            for (k, &id) in ids.iter().enumerate() {
                has(k, r.get(Db::Rows, table, id)?.is_some());
            }
            Ok(())
        })
    }

    fn scan_rows(
        &self,
        table: &str,
        m: usize,
        each: &mut dyn FnMut(u64, &[u32]) -> Result<()>,
    ) -> Result<()> {
        let mut words = Vec::with_capacity(m);
        // No flush may commit during the scan: a row it deletes after the scan read it could
        // otherwise come back.
        self.read_exclusive(|r| {
            r.scan(Db::Rows, table, |id, v| {
                replica_row(self.path(), table, m, id, v, &mut words)?;
                each(id, &words)
            })
        })
    }
}
