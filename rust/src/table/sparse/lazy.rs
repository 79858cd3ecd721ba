//! Rows kept outside memory: a table whose rows wait in a store behind it (a durable store's
//! replica) loads each one on first touch. The table defines what it needs of that store,
//! [`RowSource`]; the durable layer implements it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::SparseTable;
use crate::error::Result;
use crate::shard::{Grouped, Shard, NO_SLOT};

/// Rows of a table kept outside memory, as the table reads them back. Rows are given as their
/// [`SparseTable::row_words`] words after the id; a source checks their length.
pub trait RowSource: Send + Sync {
    /// Reads the rows of `ids` of table `table` (rows of `m` words) in one consistent view:
    /// `found(k, words)` for each `ids[k]` the source holds.
    fn read_rows(
        &self,
        table: &str,
        m: usize,
        ids: &[u64],
        found: &mut dyn FnMut(usize, &[u32]),
    ) -> Result<()>;

    /// Whether the source holds a row of each of `ids`: `has(k, held)` for each `ids[k]`.
    fn has_rows(&self, table: &str, ids: &[u64], has: &mut dyn FnMut(usize, bool)) -> Result<()>;

    /// Every row of table `table` (rows of `m` words), with no change of the source committed
    /// meanwhile: `each(id, words)`.
    fn scan_rows(
        &self,
        table: &str,
        m: usize,
        each: &mut dyn FnMut(u64, &[u32]) -> Result<()>,
    ) -> Result<()>;
}

/// The rows source behind a table, and how many of its rows are not in memory yet.
pub(crate) struct Backing {
    pub(crate) source: Weak<dyn RowSource>,
    /// Rows in the source that are not in memory yet (loaded on first touch).
    pub(crate) unloaded: AtomicU64,
}

impl Backing {
    /// A backing by `source`, of which `unloaded` rows are not in memory.
    pub(crate) fn new(source: Weak<dyn RowSource>, unloaded: u64) -> Self {
        Self {
            source,
            unloaded: AtomicU64::new(unloaded),
        }
    }
}

impl SparseTable {
    /// Rows of the replica not loaded into memory yet (0 without a replica).
    pub fn unloaded(&self) -> u64 {
        self.backing
            .as_ref()
            .map_or(0, |b| b.unloaded.load(Ordering::Acquire))
    }

    /// The rows source, when rows may still wait in it (and the source is still open).
    pub(super) fn lazy(&self) -> Option<(&Backing, Arc<dyn RowSource>)> {
        let b = self.backing.as_ref()?;
        if b.unloaded.load(Ordering::Acquire) == 0 {
            return None;
        }
        b.source.upgrade().map(|s| (b, s))
    }

    /// Loads the replica's rows of `ids` (absent from memory) into the shard; returns, for each,
    /// whether it had one. Ids removed since (`gone`) are not loaded.
    pub(super) fn fault_in(&self, shard: &mut Shard, ids: &[u64]) -> Result<Vec<bool>> {
        let Some((b, src)) = self.lazy() else {
            return Ok(vec![false; ids.len()]);
        };
        let mut found: Vec<bool> = ids.iter().map(|&id| shard.find(id).is_some()).collect();
        // The positions to ask for, by the id's key in the source (the placement hash: the
        // replica's key order, so consecutive reads descend to nearby pages), each id once.
        let mut ask: Vec<(u64, usize)> = (0..ids.len())
            .filter(|&k| !found[k] && !shard.is_gone(ids[k]))
            .map(|k| (crate::hash::mix64(ids[k]), k))
            .collect();
        if ask.is_empty() {
            return Ok(found);
        }
        ask.sort_unstable();
        // Where each distinct id's positions start in `ask`, and the end.
        let mut starts: Vec<usize> = (0..ask.len())
            .filter(|&i| i == 0 || ask[i].0 != ask[i - 1].0)
            .collect();
        let asked: Vec<u64> = starts.iter().map(|&i| ids[ask[i].1]).collect();
        starts.push(ask.len());
        src.read_rows(
            &self.common.name,
            self.row_words(),
            &asked,
            &mut |j, words| {
                // Each id once, and absent from the shard (checked above, under its lock).
                shard.put_words_at(asked[j], NO_SLOT, words);
                b.unloaded.fetch_sub(1, Ordering::AcqRel);
                for &(_, k) in &ask[starts[j]..starts[j + 1]] {
                    found[k] = true;
                }
            },
        )?;
        Ok(found)
    }

    /// Loads every row still waiting in the replica (before a whole-table operation).
    pub fn load_all(&self) -> Result<()> {
        let Some((b, src)) = self.lazy() else {
            return Ok(());
        };
        let n = self.shards.len();
        let mut batch: Vec<(u64, Vec<u32>)> = Vec::new();
        let flush = |batch: &mut Vec<(u64, Vec<u32>)>| {
            batch.sort_unstable_by_key(|(id, _)| crate::hash::shard_of(*id, n));
            for part in batch
                .chunk_by(|a, c| crate::hash::shard_of(a.0, n) == crate::hash::shard_of(c.0, n))
            {
                let mut shard = self.write(crate::hash::shard_of(part[0].0, n));
                for (id, w) in part {
                    if shard.find(*id).is_none() && !shard.is_gone(*id) {
                        shard.put_words(*id, w);
                        b.unloaded.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
            batch.clear();
        };
        // No flush may commit during the scan (the source guarantees it): a row it deletes
        // after the scan read it could otherwise come back.
        src.scan_rows(&self.common.name, self.row_words(), &mut |id, w| {
            batch.push((id, w.to_vec()));
            if batch.len() >= 65536 {
                flush(&mut batch);
            }
            Ok(())
        })?;
        flush(&mut batch);
        b.unloaded.store(0, Ordering::Release);
        Ok(())
    }

    /// Loads the replica rows of the batch's ids that are not in memory, before anything is
    /// applied, so a failing read leaves every row as it was.
    pub(super) fn fault_in_batch(&self, ids: &[u64], g: &Grouped) -> Result<()> {
        if self.lazy().is_none() {
            return Ok(());
        }
        for s in 0..self.shards.len() {
            let pos = g.of(s);
            if pos.is_empty() {
                continue;
            }
            let mut shard = self.write(s);
            let mut absent: Vec<u64> = pos
                .iter()
                .map(|&p| ids[p as usize])
                .filter(|&id| shard.find(id).is_none())
                .collect();
            if !absent.is_empty() {
                absent.sort_unstable();
                absent.dedup();
                self.fault_in(&mut shard, &absent)?;
            }
        }
        Ok(())
    }
}
