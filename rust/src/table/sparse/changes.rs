//! Change tracking: what a flush or a snapshot takes from a table (the rows changed since the
//! last take and the ids removed), what it gives back when it fails, and how rows are put back
//! as they are (a restore).

use std::mem::MaybeUninit;
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

use rayon::prelude::*;

use super::{RowSource, SparseTable};
use crate::error::{shape, Result};
use crate::shard::NO_SLOT;
use crate::table::Disjoint;

/// Where a take gets empty buffers for the ids and words it copies (reused ones, if the taker
/// keeps any).
pub(crate) type Buffers<'a> = dyn Fn() -> (Vec<u64>, Vec<u32>) + Sync + 'a;

/// What a flush took from one shard: the changed rows and the removed ids.
pub(crate) struct Taken {
    pub(crate) shard: usize,
    pub(crate) ids: Vec<u64>,
    /// `ids.len()` rows of [`SparseTable::row_words`] words.
    pub(crate) words: Vec<u32>,
    /// Removed ids to delete from the replica (those without a row again since).
    pub(crate) gone: Vec<u64>,
    /// Every removed id taken: forgotten once the deletions are committed.
    pub(crate) forget: Vec<u64>,
    /// Per row: its first change in the flusher's current log generation, so its id must be
    /// (re)written to `changed/` (later changes in the generation need not: the entry exists).
    pub(crate) log: Vec<bool>,
}

/// The rows [`SparseTable::copy_settled`] copied, by position.
pub(crate) struct Settled {
    words: Vec<MaybeUninit<u32>>,
    ok: Vec<bool>,
    m: usize,
}

impl Settled {
    /// The replica words of position `p`'s row, if memory held it settled.
    pub(crate) fn row(&self, p: usize) -> Option<&[u32]> {
        if !self.ok[p] {
            return None;
        }
        let w = &self.words[p * self.m..(p + 1) * self.m];
        // SAFETY: every word of a row marked in `ok` was written.
        Some(unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u32>(), self.m) })
    }
}

impl SparseTable {
    /// Takes what changed in shard `s` since the last take, for a flush; `gen` is the
    /// flusher's log generation (see [`Taken::log`]).
    pub(crate) fn take_shard(&self, s: usize, gen: u32, buffers: &Buffers<'_>) -> Taken {
        let m = self.row_words();
        let (mut ids, mut words) = buffers();
        let mut shard = self.write(s);
        let n = shard.changed_len();
        ids.reserve(n);
        words.reserve(n * m);
        let mut t = Taken {
            shard: s,
            ids,
            words,
            gone: Vec::new(),
            forget: shard.gone(),
            log: Vec::with_capacity(n),
        };
        shard.take_changed(gen, |id, w, first| {
            t.ids.push(id);
            let at = t.words.len();
            t.words.extend_from_slice(&w[..m]);
            t.words[at + 1] = 0; // the flags word is not stored
            t.log.push(first);
        });
        t.gone = t
            .forget
            .iter()
            .copied()
            .filter(|&id| shard.find(id).is_none())
            .collect();
        t
    }

    /// Holds off every change to the rows (pushes, removals, restores) while the guard lives, so
    /// a flush takes each push whole: all of its rows or none.
    pub(crate) fn hold_changes(&self) -> RwLockWriteGuard<'_, ()> {
        self.changes.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Held by a change of rows; only a durable store's flusher ever waits on it, so an
    /// in-memory table takes nothing.
    pub(super) fn changing(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.backing
            .as_ref()
            .map(|_| self.changes.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Rows in the shards' change lists (an upper bound of the rows an increment takes).
    pub(crate) fn changed_rows(&self) -> u64 {
        (0..self.shards.len())
            .map(|s| self.read(s).changed_len() as u64)
            .sum()
    }

    /// [`SparseTable::take_shard`] of every shard, on the store's pool.
    pub(crate) fn take_all(&self, gen: u32, buffers: &Buffers<'_>) -> Vec<Taken> {
        let n = self.shards.len();
        if self.common.exec.threads() > 1 && n > 1 {
            self.common.exec.install(|| {
                (0..n)
                    .into_par_iter()
                    .map(|s| self.take_shard(s, gen, buffers))
                    .collect()
            })
        } else {
            (0..n).map(|s| self.take_shard(s, gen, buffers)).collect()
        }
    }

    /// Gives back what a failed flush took: the rows are marked changed again.
    pub(crate) fn untake(&self, t: &Taken) {
        let mut shard = self.write(t.shard);
        for (&id, &logged) in t.ids.iter().zip(&t.log) {
            if let Some(slot) = shard.find(id) {
                shard.remark(slot, logged);
            }
        }
    }

    /// Goes back to the last commit of a `sync` store (see `Flusher::revert_all`): every row
    /// changed since is read back from `src`, or dropped when `src` has none; the applied
    /// request ids become those each environment kept (`applied`, one per environment; none
    /// where `None`). Pushes are held off meanwhile, and each
    /// push applied before it learns so from [`Common::revert_epoch`](crate::table::Common).
    pub(crate) fn revert_to(&self, src: &dyn RowSource, applied: &[Option<Vec<u8>>]) -> Result<()> {
        let _held = self.hold_changes();
        let m = self.row_words();
        for s in 0..self.shards.len() {
            let mut shard = self.write(s);
            let ids = shard.take_marked();
            if ids.is_empty() {
                continue;
            }
            let mut found = vec![false; ids.len()];
            src.read_rows(&self.common.name, m, &ids, &mut |k, words| {
                shard.put_words(ids[k], words);
                found[k] = true;
            })?;
            for (&id, _) in ids.iter().zip(&found).filter(|(_, &f)| !f) {
                shard.discard(id);
            }
        }
        self.common
            .applied
            .load(applied, "the applied request ids")?;
        self.common.note_reverted();
        Ok(())
    }

    /// After a flush committed: the removals it wrote are done.
    pub(crate) fn forget(&self, t: &Taken) {
        if !t.forget.is_empty() {
            self.write(t.shard).forget_gone(&t.forget);
        }
    }

    /// Stores rows given as words (a restore); each replaces any row of its id.
    pub fn put_rows(&self, ids: &[u64], words: &[u32]) -> Result<()> {
        let m = self.row_words();
        if words.len() != ids.len() * m {
            return Err(shape(format!(
                "table {:?}: {} rows need {} words, got {}",
                self.common.name,
                ids.len(),
                ids.len() * m,
                words.len()
            )));
        }
        let g = self.group(ids);
        let _changing = self.changing();
        self.for_each_shard(&g, ids.len(), |s, part| {
            let pos = part.positions;
            let mut shard = self.write(s);
            let mut slots = Vec::new();
            shard.find_many(ids, part, 0, &mut slots);
            for (&p, &slot) in pos.iter().zip(&slots) {
                let p = p as usize;
                let (slot, _) = shard.put_words_at(ids[p], slot, &words[p * m..(p + 1) * m]);
                shard.mark(slot);
            }
        });
        Ok(())
    }

    /// Gives `row(id, words)` for each row of shard `s` whose id `keep` accepts, under the
    /// shard's read lock, changing nothing (words as [`copy_shard`](Self::copy_shard) gives
    /// them). Rows still waiting in a replica are not seen: load them first.
    pub fn copy_rows_where(
        &self,
        s: usize,
        keep: impl Fn(u64) -> bool,
        mut row: impl FnMut(u64, &[u32]),
    ) {
        let m = self.row_words();
        let shard = self.read(s);
        for (id, slot) in shard.iter_by_slot() {
            if keep(id) {
                row(id, &shard.row(slot)[2..2 + m]);
            }
        }
    }

    /// Gives `row(id, words)` for each of `ids` this table holds, and `absent(id)` for each it
    /// does not, each under its shard's read lock, changing nothing (words as
    /// [`copy_rows_where`](Self::copy_rows_where) gives them). Rows still waiting in a replica
    /// are not seen: load them first.
    pub fn copy_rows_of(
        &self,
        ids: &[u64],
        mut row: impl FnMut(u64, &[u32]),
        mut absent: impl FnMut(u64),
    ) {
        let m = self.row_words();
        let n = self.num_shards();
        for &id in ids {
            let shard = self.read(crate::hash::shard_of(id, n));
            match shard.find(id) {
                Some(slot) => row(id, &shard.row(slot)[2..2 + m]),
                None => absent(id),
            }
        }
    }

    /// Copies shard `s` for a snapshot of an in-memory store, under its lock: all rows, or with
    /// `incremental` the rows changed since the last copy and the ids removed since then. Either
    /// way the shard then records changes anew for the next increment.
    /// Each row goes to `row(id, words)` while the lock is held, `words` being the row's
    /// [`SparseTable::row_words`] words after its id, whose second word (the in-memory flags) is
    /// not meaningful; returns the removed ids.
    pub(crate) fn copy_shard(
        &self,
        s: usize,
        incremental: bool,
        mut row: impl FnMut(u64, &[u32]),
    ) -> Vec<u64> {
        let m = self.row_words();
        let mut shard = self.write(s);
        shard.set_tracking(true);
        if incremental {
            shard.take_changed(0, |id, w, _| row(id, &w[..m]));
        } else {
            shard.take_changed(0, |_, _, _| {});
            // In slot order: the rows are read front to back, not in hash order.
            for (id, slot) in shard.iter_by_slot() {
                row(id, &shard.row(slot)[2..2 + m]);
            }
        }
        let gone: Vec<u64> = shard
            .gone()
            .into_iter()
            .filter(|&id| shard.find(id).is_none())
            .collect();
        let all = shard.gone();
        shard.forget_gone(&all);
        if incremental {
            gone
        } else {
            Vec::new()
        }
    }

    /// For an increment of a durable store, with flush cycles held off since the last one
    /// committed: copies the rows of `ids` that memory holds as that cycle wrote them (see
    /// [`Shard::settled`]), so they need not be read back from the replica. Lookups run on the
    /// pool, pipelined as a pull's.
    pub(crate) fn copy_settled(&self, ids: &[u64]) -> Settled {
        let m = self.row_words();
        let mut words: Vec<MaybeUninit<u32>> = Vec::with_capacity(ids.len() * m);
        // SAFETY: `MaybeUninit` needs no initialisation; only rows marked in `ok` are written
        // and ever read.
        unsafe { words.set_len(ids.len() * m) };
        let mut ok = vec![false; ids.len()];
        let (wp, op) = (
            Disjoint(words.as_mut_ptr().cast::<u32>()),
            Disjoint(ok.as_mut_ptr()),
        );
        let g = self.group(ids);
        self.for_each_shard(&g, ids.len(), |s, part| {
            let pos = part.positions;
            let shard = self.read(s);
            shard.for_each_found(ids, part, m, |k, slot| {
                let p = pos[k] as usize;
                if slot == NO_SLOT {
                    return;
                }
                if let Some(w) = shard.settled(slot, ids[p]) {
                    // SAFETY: `p < ids.len()`, and only this task writes position `p` (each
                    // position belongs to one shard; see `Disjoint`).
                    unsafe {
                        let dst = std::slice::from_raw_parts_mut(wp.get().add(p * m), m);
                        dst.copy_from_slice(&w[..m]);
                        dst[1] = 0; // the flags word is not stored
                        *op.get().add(p) = true;
                    }
                }
            });
        });
        Settled { words, ok, m }
    }

    /// Starts (or stops) recording changes for incremental snapshots of an in-memory store.
    pub(crate) fn set_tracking(&self, on: bool) {
        for s in 0..self.shards.len() {
            self.write(s).set_tracking(on);
        }
    }
}
