//! The life of rows: admission of ids pushed often enough, removal, eviction by age and by the
//! `max_rows` budget.

use std::collections::HashMap;

use super::{EvictPolicy, SparseTable};
use crate::error::Result;
use crate::hash::{slot_of, slot_of_mix};
use crate::shard::{row_version, Shard, FREQ, NO_SLOT};
use crate::table::BudgetRow;
use crate::table::{Counters, TableHandle};

impl SparseTable {
    pub(super) fn admit_after(&self) -> u32 {
        self.config.lifecycle.admit_after.max(1)
    }

    /// Removes the rows of `ids` (and forgets their admission counts); returns how many existed.
    /// Removed ids become tombstones of the next incremental snapshot.
    pub fn remove(&self, ids: &[u64]) -> Result<usize> {
        self.remove_as(ids, None)
    }

    /// [`remove`](Self::remove) of the write request `rid` (client, seq), which is recorded
    /// with the rows it removed (see `once.rs`).
    pub fn remove_as(&self, ids: &[u64], rid: Option<(u64, u64)>) -> Result<usize> {
        self.check_live()?;
        let removed = {
            let _changing = self.changing();
            let removed = self.remove_rows(ids)?;
            if let Some((client, seq)) = rid {
                self.note_applied(client, seq);
            }
            removed
        };
        self.common.durable_wait()?;
        Ok(removed)
    }

    pub(super) fn remove_rows(&self, ids: &[u64]) -> Result<usize> {
        let g = self.group(ids);
        let mut removed = 0;
        for s in 0..self.shards.len() {
            let pos = g.of(s);
            if pos.is_empty() {
                continue;
            }
            let mut shard = self.write(s);
            let mut absent = Vec::new();
            for &p in pos {
                let id = ids[p as usize];
                if shard.remove(id) {
                    removed += 1;
                } else {
                    absent.push(id);
                }
            }
            if !absent.is_empty() && self.lazy().is_some() {
                absent.sort_unstable();
                absent.dedup();
                // A row still in the replica: load it, then remove it like any other.
                let found = self.fault_in(&mut shard, &absent)?;
                for (&id, f) in absent.iter().zip(found) {
                    if f && shard.remove(id) {
                        removed += 1;
                    }
                }
            }
            let mut cand = self.candidates[s].lock().unwrap_or_else(|e| e.into_inner());
            if !cand.is_empty() {
                for &p in pos {
                    cand.remove(&ids[p as usize]);
                }
            }
        }
        Ok(removed)
    }

    /// Removes the rows whose last update is older than `before_seq` (a version) or
    /// `before_secs` (a unix second); returns how many. Rows still waiting in the replica are
    /// loaded first.
    pub fn evict(&self, before_seq: Option<u64>, before_secs: Option<u32>) -> Result<usize> {
        self.evict_as(before_seq, before_secs, None, &|_| true)
    }

    /// [`evict`](Self::evict) of the write request `rid` (client, seq), recorded with the rows
    /// it removed (see `once.rs`), among the ids for which `among` holds (a retry that some
    /// environments of the replica committed evicts in the others only). `among` is asked
    /// only of rows old enough to go, and every row it accepts is removed.
    pub fn evict_as(
        &self,
        before_seq: Option<u64>,
        before_secs: Option<u32>,
        rid: Option<(u64, u64)>,
        among: &dyn Fn(u64) -> bool,
    ) -> Result<usize> {
        self.check_live()?;
        self.load_all()?;
        // `among` last: it is asked only of rows old enough to go, and each row it accepts is
        // removed (a caller may record them).
        let evicted = self.evict_where(rid, |id, row| {
            (before_seq.is_some_and(|v| row_version(row) < v)
                || before_secs.is_some_and(|t| row[crate::shard::UPDATED_AT] < t))
                && among(id)
        });
        self.common.durable_wait()?;
        Ok(evicted.len())
    }

    /// Removes the rows for which `evict(id, row)` holds (the row's words with its header) and
    /// counts them as evicted; returns their ids.
    fn evict_where(
        &self,
        rid: Option<(u64, u64)>,
        evict: impl Fn(u64, &[u32]) -> bool,
    ) -> Vec<u64> {
        let _changing = self.changing();
        let mut evicted = Vec::new();
        for s in 0..self.shards.len() {
            let mut shard = self.write(s);
            let victims: Vec<u64> = shard
                .iter()
                .filter(|&(id, slot)| evict(id, shard.row(slot)))
                .map(|(id, _)| id)
                .collect();
            for id in victims {
                if shard.remove(id) {
                    evicted.push(id);
                }
            }
        }
        Counters::add(&self.common.counters.rows_evicted, evicted.len());
        if let Some((client, seq)) = rid {
            self.note_applied(client, seq);
        }
        evicted
    }

    /// Keeps the table within `max_rows`: past it, evicts by the policy down to 99% of it,
    /// among the rows the store's [`BudgetGuard`](crate::table::BudgetGuard) lets it evict (any
    /// row without one).
    pub(super) fn enforce_budget(&self) -> Result<()> {
        let Some(max) = self.config.lifecycle.max_rows else {
            return Ok(());
        };
        if (self.len() as u64) <= max {
            return Ok(());
        }
        let Ok(_one) = self.evicting.try_lock() else {
            return Ok(()); // another thread is at it
        };
        self.load_all()?;
        if self.len() as u64 <= max {
            return Ok(());
        }
        match self.common.budget_guard() {
            None => {
                self.evict_budget(max, None);
            }
            Some(g) => g.budget(&self.common.name, &mut |by_slot| {
                self.evict_budget(max, Some(by_slot))
            }),
        }
        Ok(())
    }

    /// Evicts by the policy, among the rows whose slot `by_slot` says to evict (every row
    /// without it), down to 99% of `max` of the rows it counts (those it keeps are counted: the
    /// budget takes other rows in their place, or stays over while only kept rows are left);
    /// returns the ids evicted.
    fn evict_budget(&self, max: u64, by_slot: Option<&[BudgetRow]>) -> Vec<u64> {
        let lfu = self.config.lifecycle.policy == EvictPolicy::Lfu;
        // Scores: LFU by push count then version; LRU by version; ties by id, so the rows kept
        // do not depend on the shard layout.
        let score = |id: u64, row: &[u32]| -> (u64, u64, u64) {
            if lfu {
                (row[FREQ] as u64, row_version(row), id)
            } else {
                (row_version(row), 0, id)
            }
        };
        let class = |id: u64| by_slot.map_or(BudgetRow::Evict, |c| c[slot_of(id)]);
        let n = self.shards.len();
        let mut counted = 0u64;
        let mut scores: Vec<(u64, u64, u64)> = Vec::with_capacity(self.len());
        for s in 0..n {
            let shard = self.read(s);
            // A shard holds a run of slots: one class for all of them spares a hash a row.
            match by_slot.map_or(Some(BudgetRow::Evict), |c| one_class(c, s, n)) {
                Some(BudgetRow::Skip) => {}
                Some(BudgetRow::Keep) => counted += shard.len() as u64,
                Some(BudgetRow::Evict) => {
                    counted += shard.len() as u64;
                    scores.extend(shard.iter().map(|(id, slot)| score(id, shard.row(slot))));
                }
                None => {
                    for (id, slot) in shard.iter() {
                        match class(id) {
                            BudgetRow::Evict => {
                                counted += 1;
                                scores.push(score(id, shard.row(slot)));
                            }
                            BudgetRow::Keep => counted += 1,
                            BudgetRow::Skip => {}
                        }
                    }
                }
            }
        }
        let target = max - max / 100;
        if counted <= max || scores.is_empty() {
            return Vec::new();
        }
        let excess = (counted - target) as usize;
        let k = excess.min(scores.len()) - 1;
        let (_, &mut cut, _) = scores.select_nth_unstable(k);
        self.evict_where(None, |id, row| {
            score(id, row) <= cut && class(id) == BudgetRow::Evict
        })
    }

    /// Creates the rows of the shard's missing ids that are admitted now; returns the slot of
    /// every position (`NO_SLOT` for an id still waiting for admission).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn admit(
        &self,
        s: usize,
        shard: &mut Shard,
        ids: &[u64],
        pos: &[u32],
        slots: &mut [u32],
        version: u64,
        now: u32,
    ) -> u64 {
        let after = self.admit_after();
        let mut made = 0u64;
        if after <= 1 {
            for (&p, slot) in pos.iter().zip(slots.iter_mut()) {
                if *slot == NO_SLOT {
                    let id = ids[p as usize];
                    let (sl, new) = shard.find_or_insert(id, |b| self.init_body(id, b));
                    if new {
                        shard.touch(sl, version, now, 0);
                        made += 1;
                    }
                    *slot = sl;
                }
            }
            return made;
        }
        let mut seen: HashMap<u64, u32> = HashMap::new();
        for (&p, &slot) in pos.iter().zip(slots.iter()) {
            if slot == NO_SLOT {
                *seen.entry(ids[p as usize]).or_default() += 1;
            }
        }
        let mut cand = self.candidates[s].lock().unwrap_or_else(|e| e.into_inner());
        let mut admitted: HashMap<u64, u32> = HashMap::new();
        for (id, n) in seen {
            let total = cand.get(&id).copied().unwrap_or(0).saturating_add(n);
            if total >= after {
                cand.remove(&id);
                let (sl, new) = shard.find_or_insert(id, |b| self.init_body(id, b));
                if new {
                    // Counts of the pushes before this one; this one adds its own.
                    shard.touch(sl, version, now, total - n);
                    made += 1;
                }
                admitted.insert(id, sl);
            } else {
                cand.insert(id, total);
            }
        }
        for (&p, slot) in pos.iter().zip(slots.iter_mut()) {
            if *slot == NO_SLOT {
                *slot = admitted.get(&ids[p as usize]).copied().unwrap_or(NO_SLOT);
            }
        }
        made
    }
}

/// The class of every slot of shard `s` of `n`, when they share one. Shard `s` holds the ids
/// whose `mix64` lies in `[ceil(s 2^64 / n), ceil((s+1) 2^64 / n))` (`hash::shard_of_mix`), and
/// a slot is the top bits of the same `mix64` (`hash::slot_of`), so a run of slots.
fn one_class(by_slot: &[BudgetRow], s: usize, n: usize) -> Option<BudgetRow> {
    let (lo, hi) = shard_slots(s, n);
    let first = by_slot[lo];
    by_slot[lo..=hi]
        .iter()
        .all(|&c| c == first)
        .then_some(first)
}

/// The first and last slot of shard `s` of `n`.
fn shard_slots(s: usize, n: usize) -> (usize, usize) {
    let start = |k: usize| ((k as u128) << 64).div_ceil(n as u128);
    let lo = start(s) as u64;
    let hi = (start(s + 1) - 1) as u64;
    (slot_of_mix(lo), slot_of_mix(hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{mix64, shard_of_mix};

    #[test]
    fn a_shard_holds_a_run_of_slots() {
        for n in [1usize, 3, 4, 64, 100] {
            let mut x = 1u64;
            for _ in 0..20_000 {
                x = mix64(x);
                let s = shard_of_mix(mix64(x), n);
                let (lo, hi) = shard_slots(s, n);
                assert!((lo..=hi).contains(&slot_of(x)), "n {n} id {x}");
            }
            // The runs cover the slots in order, touching or sharing an end slot.
            assert_eq!(shard_slots(0, n).0, 0);
            assert_eq!(shard_slots(n - 1, n).1, crate::hash::SLOTS - 1);
            for s in 1..n {
                assert!(shard_slots(s, n).0 <= shard_slots(s - 1, n).1 + 1);
            }
        }
    }
}
