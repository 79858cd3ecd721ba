//! Moving slots between the servers of a running cluster (decision 0103): the driver.
//!
//! [`Client::move_slots`] takes a slot table over the same server list and moves every slot
//! whose owner changes, a batch of slots at a time, while workers train: mark the batch as
//! copying on its old owner (which records from then on the rows written, created or removed
//! in it) and copy its rows (every table, with optimizer state and metadata) to the new owner
//! while writes go on (decision 0114); then freeze the batch, copy the rows recorded meanwhile
//! (a removed row as a removal), the seqs and the request ids of the pushes the old owner
//! answered lately; publish the routing that gives the batch to the new owner (the next routing
//! epoch, on every server), then drop the old owner's copy. Workers see "moving" (retried) for
//! the batch's slots only while it is frozen (the delta), then "moved", and follow
//! (`reshard.rs`); nothing is lost or applied twice.

use std::time::{Duration, Instant};

use super::Client;
use crate::error::{invalid, Error, Result};
use crate::net::proto::*;
use crate::net::routing::{SlotTable, SLOTS};

/// The most slots moved at once: a batch's rows are copied while writes go on, then what was
/// written meanwhile while its slots are frozen.
const BATCH_SLOTS: usize = 512;

/// What a move did.
#[derive(Debug, Clone, Default)]
pub struct MoveReport {
    /// Slots that changed owner.
    pub slots: usize,
    /// Sparse rows copied to new owners (a dense table's value counts one).
    pub rows: u64,
    /// Rows copied again under the freeze, written during their batch's pre-copy (a removal
    /// counts one).
    pub delta_rows: u64,
    /// Batches, each published under its own routing epoch.
    pub batches: usize,
    /// The routing epoch in force at the end.
    pub epoch: u64,
    /// Wall-clock time of the whole move.
    pub seconds: f64,
    /// The longest time one batch's slots were frozen.
    pub max_frozen_seconds: f64,
}

/// Refuses a pace that is not a positive number of rows a second (before anything changes).
pub(super) fn check_pace(max_rows_per_second: Option<f64>) -> Result<()> {
    match max_rows_per_second {
        Some(r) if !(r.is_finite() && r > 0.0) => Err(invalid(format!(
            "max_rows_per_second must be a positive number of rows a second, got {r}; nothing \
             was changed"
        ))),
        _ => Ok(()),
    }
}

/// Runs of the slots `set` holds.
fn runs(set: &[usize]) -> SlotSet {
    let mut out = SlotSet::default();
    for &s in set {
        match out.ends.last_mut() {
            Some(e) if *e as usize == s => *e += 1,
            _ => {
                out.starts.push(s as u32);
                out.ends.push(s as u32 + 1);
            }
        }
    }
    out
}

impl Client {
    /// Moves every slot whose owner differs between the cluster's routing and `target` (a table
    /// over this client's server list; its epoch is not used: each batch is published under
    /// the next epoch) to its new owner while workers train, and returns what moved.
    /// `max_rows_per_second` paces the move: after each batch it waits, with no slot frozen,
    /// until the rows copied so far average at most that rate (None: batches back to back).
    pub fn move_slots(
        &self,
        target: &SlotTable,
        max_rows_per_second: Option<f64>,
    ) -> Result<MoveReport> {
        let t0 = Instant::now();
        check_pace(max_rows_per_second)?;
        let n = self.n();
        if target.servers() != n {
            return Err(invalid(format!(
                "the slot table addresses {} servers, the cluster has {n}",
                target.servers()
            )));
        }
        self.drain();
        // Start from the newest routing the servers hold.
        if let Some((list, table)) = self.held_routing()? {
            let names = self.names();
            if super::reshard::names_of(&list) != names {
                return Err(invalid(format!(
                    "the servers route by another list ([{}]) than the one the slot table was \
                     made for ([{}]): make the table over their list",
                    super::reshard::describe(&list),
                    names.join(", ")
                )));
            }
            self.adopt(table)?;
        }
        let mut current = self.route().table.clone();
        let mut report = MoveReport::default();
        // Batches of slots with one old and one new owner, in slot order.
        let mut pairs: std::collections::BTreeMap<(usize, usize), Vec<usize>> = Default::default();
        for s in 0..SLOTS {
            let (a, b) = (current.owner_of_slot(s), target.owner_of_slot(s));
            if a != b {
                pairs.entry((a, b)).or_default().push(s);
            }
        }
        for ((from, to), slots) in pairs {
            report.slots += slots.len();
            for batch in slots.chunks(BATCH_SLOTS) {
                let mut owners = current.owners().to_vec();
                for &s in batch {
                    owners[s] = to as u32;
                }
                let next = SlotTable::from_owners(current.epoch() + 1, n, owners)?;
                let set = runs(batch);
                let moved = self.move_batch(from, to, &set, &next);
                if moved.is_err() {
                    // Given up: the old owner serves the batch again, and stops recording.
                    let thaw = FreezeSlotsRequest {
                        slots: Some(set.clone()),
                        thaw: true,
                        copy: false,
                    };
                    let _ = self.fan_out(vec![(from, thaw)], |mut c, r| async move {
                        c.freeze_slots(r).await
                    });
                }
                let (rows, delta, frozen) = moved?;
                report.rows += rows;
                report.delta_rows += delta;
                report.max_frozen_seconds = report.max_frozen_seconds.max(frozen);
                // The new owner's copy is on its disk before the old owner's goes (a durable
                // new owner that crashed in between would lose rows both had held).
                self.fan_out(vec![(to, FlushRequest {})], |mut c, r| async move {
                    c.flush(r).await
                })?;
                // The old owner's copy goes once every server routes by `next`.
                let drop = DropSlotsRequest { slots: Some(set) };
                self.fan_out(vec![(from, drop)], |mut c, r| async move {
                    c.drop_slots(r).await
                })?;
                report.batches += 1;
                current = next;
                if let Some(rate) = max_rows_per_second {
                    // Paced: training has the cores to itself until the average is back down.
                    let due = Duration::from_secs_f64(report.rows as f64 / rate);
                    if let Some(wait) = due.checked_sub(t0.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
            }
        }
        report.epoch = current.epoch();
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    /// The tables `from` holds.
    fn tables_of(&self, from: usize) -> Result<Vec<String>> {
        Ok(self
            .fan_out(vec![(from, ListTablesRequest {})], |mut c, r| async move {
                c.list_tables(r).await
            })?
            .into_iter()
            .flat_map(|x| x.tables)
            .map(|t| t.name)
            .collect())
    }

    /// Copies table `name`'s rows of `set` from `from` to `to`: all of them, or (`dirty`) those
    /// written, created or removed since the batch was marked copying, removals as removals;
    /// then (`seq`) the table's seq. Returns the rows written.
    fn copy_table(
        &self,
        from: usize,
        to: usize,
        name: &str,
        set: &SlotSet,
        dirty: bool,
        seq: bool,
    ) -> Result<u64> {
        let mut rows = 0u64;
        let mut shard = 0;
        loop {
            let req = ExportSlotsRequest {
                table: name.to_string(),
                slots: Some(set.clone()),
                shard,
                dirty,
            };
            let a = self
                .fan_out(vec![(from, req)], |mut c, r| async move {
                    c.export_slots(r).await
                })?
                .pop()
                .ok_or_else(|| Error::Internal("no answer".into()))?;
            let dense = a.dense;
            if !a.words.is_empty() || !a.removed_ids.is_empty() {
                let load = BulkLoadRequest {
                    table: name.to_string(),
                    config_json: a.config_json.clone(),
                    ids: a.ids.clone(),
                    words: a.words.clone(),
                    seq: None,
                    applied_request_ids: Default::default(),
                    // A dense value comes in chunks, each written where it falls.
                    dense_offset: dense.then_some(a.dense_offset),
                    removed_ids: a.removed_ids.clone(),
                };
                let r =
                    self.fan_out(
                        vec![(to, load)],
                        |mut c, r| async move { c.bulk_load(r).await },
                    )?;
                rows += r.iter().map(|x| x.rows).sum::<u64>();
                rows += (a.removed_ids.len() / 8) as u64;
            }
            if a.next_shard >= a.shards {
                if seq && !dense {
                    let seq = BulkLoadRequest {
                        table: name.to_string(),
                        config_json: a.config_json,
                        seq: Some(a.seq),
                        ..Default::default()
                    };
                    self.fan_out(
                        vec![(to, seq)],
                        |mut c, r| async move { c.bulk_load(r).await },
                    )?;
                }
                return Ok(rows);
            }
            shard = a.next_shard;
        }
    }

    /// Copies `set`'s rows from `from` to `to` while writes go on (the batch marked copying on
    /// `from`), then freezes it there, copies what was written meanwhile (and tables created
    /// meanwhile whole), the seqs and the recent request ids, and publishes `next`; returns the
    /// rows copied whole, those copied again under the freeze, and how long the batch was
    /// frozen.
    fn move_batch(
        &self,
        from: usize,
        to: usize,
        set: &SlotSet,
        next: &SlotTable,
    ) -> Result<(u64, u64, f64)> {
        let mark = |copy: bool| FreezeSlotsRequest {
            slots: Some(set.clone()),
            thaw: false,
            copy,
        };
        // Pre-copy: writes go on, and `from` records what they touch.
        self.fan_out(vec![(from, mark(true))], |mut c, r| async move {
            c.freeze_slots(r).await
        })?;
        let copied = self.tables_of(from)?;
        let mut rows = 0u64;
        for name in &copied {
            rows += self.copy_table(from, to, name, set, false, false)?;
        }
        // The freeze covers the delta only.
        let frozen = Instant::now();
        self.fan_out(vec![(from, mark(false))], |mut c, r| async move {
            c.freeze_slots(r).await
        })?;
        // The tables `from` holds once the batch is frozen: one created since the pre-copy
        // listed them (by a worker of any list) is copied whole, and none arrive later. `to`
        // lacking one is given its definition at the first load (`definitions.rs`).
        let mut delta = 0u64;
        for name in &self.tables_of(from)? {
            if copied.contains(name) {
                delta += self.copy_table(from, to, name, set, true, true)?;
            } else {
                rows += self.copy_table(from, to, name, set, false, true)?;
            }
        }
        // The pushes `from` answered lately: a retry of one of them, split to `to` once the
        // batch is published there, is answered, not applied again.
        let ids = ExportSlotsRequest {
            table: String::new(),
            slots: Some(set.clone()),
            shard: 0,
            dirty: false,
        };
        let a = self
            .fan_out(vec![(from, ids)], |mut c, r| async move {
                c.export_slots(r).await
            })?
            .pop()
            .ok_or_else(|| Error::Internal("no answer".into()))?;
        if !a.request_ids.is_empty() {
            let load = BulkLoadRequest {
                applied_request_ids: a.request_ids,
                ..Default::default()
            };
            self.fan_out(
                vec![(to, load)],
                |mut c, r| async move { c.bulk_load(r).await },
            )?;
        }
        // The old owner first: one that refuses it (a promoted primary whose slots thawed
        // under the move, decision 0125) leaves every other server at the current routing. Not
        // for the first routing the servers hold: a server holding none checks a call routed by
        // the new one against its layout hash and refuses it, where one holding the routing
        // before answers "epoch_ahead" (retried) until the publish reaches it.
        let first = (next.epoch() > 1).then_some(from);
        self.publish_routing_after(next.clone(), first)?;
        Ok((rows, delta, frozen.elapsed().as_secs_f64()))
    }
}
