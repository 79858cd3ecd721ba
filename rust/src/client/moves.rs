//! Moving slots between the servers of a running cluster (decision 0103): the driver.
//!
//! [`Client::move_slots`] takes a slot table over the same server list and moves every slot
//! whose owner changes, a batch of slots at a time, while workers train: freeze the batch on
//! its old owner, copy its rows (every table, with optimizer state and metadata) and the request
//! ids of the pushes that server answered lately to the new owner, publish the routing that
//! gives the batch to the new owner (the next routing epoch, on every server), then drop the old
//! owner's copy. Workers see "moving" (retried) for the batch's slots while it is frozen, then
//! "moved", and follow (`reshard.rs`); nothing is lost or applied twice.

use std::time::Instant;

use super::Client;
use crate::error::{invalid, Error, Result};
use crate::net::proto::*;
use crate::net::routing::{SlotTable, SLOTS};

/// The most slots frozen at once: a batch's rows are copied while its slots are frozen.
const BATCH_SLOTS: usize = 512;

/// What a move did.
#[derive(Debug, Clone, Default)]
pub struct MoveReport {
    /// Slots that changed owner.
    pub slots: usize,
    /// Sparse rows copied to new owners (a dense table's value counts one).
    pub rows: u64,
    /// Batches, each published under its own routing epoch.
    pub batches: usize,
    /// The routing epoch in force at the end.
    pub epoch: u64,
    /// Wall-clock time of the whole move.
    pub seconds: f64,
    /// The longest time one batch's slots were frozen.
    pub max_frozen_seconds: f64,
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
    pub fn move_slots(&self, target: &SlotTable) -> Result<MoveReport> {
        let t0 = Instant::now();
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
                let frozen = Instant::now();
                let moved = self.move_batch(from, to, &set, &next);
                if moved.is_err() {
                    // Given up: the old owner serves the batch again.
                    let thaw = FreezeSlotsRequest {
                        slots: Some(set.clone()),
                        thaw: true,
                    };
                    let _ = self.fan_out(vec![(from, thaw)], |mut c, r| async move {
                        c.freeze_slots(r).await
                    });
                }
                report.rows += moved?;
                report.max_frozen_seconds = report
                    .max_frozen_seconds
                    .max(frozen.elapsed().as_secs_f64());
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
            }
        }
        report.epoch = current.epoch();
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Freezes `set` on `from`, copies its rows and recent request ids to `to`, and publishes
    /// `next`; returns the rows copied.
    fn move_batch(&self, from: usize, to: usize, set: &SlotSet, next: &SlotTable) -> Result<u64> {
        let freeze = FreezeSlotsRequest {
            slots: Some(set.clone()),
            thaw: false,
        };
        self.fan_out(vec![(from, freeze)], |mut c, r| async move {
            c.freeze_slots(r).await
        })?;
        // The tables `from` holds once the batch is frozen: one created since the move began
        // (by a worker of any list) has its rows of the batch there, and none arrive later.
        // `to` lacking one is given its definition at the first load (`definitions.rs`).
        let names: Vec<String> = self
            .fan_out(vec![(from, ListTablesRequest {})], |mut c, r| async move {
                c.list_tables(r).await
            })?
            .into_iter()
            .flat_map(|x| x.tables)
            .map(|t| t.name)
            .collect();
        let mut rows = 0u64;
        for name in &names {
            let mut shard = 0;
            loop {
                let req = ExportSlotsRequest {
                    table: name.clone(),
                    slots: Some(set.clone()),
                    shard,
                };
                let a = self
                    .fan_out(vec![(from, req)], |mut c, r| async move {
                        c.export_slots(r).await
                    })?
                    .pop()
                    .ok_or_else(|| Error::Internal("no answer".into()))?;
                let dense = a.dense;
                if !a.words.is_empty() {
                    let load = BulkLoadRequest {
                        table: name.clone(),
                        config_json: a.config_json.clone(),
                        ids: a.ids.clone(),
                        words: a.words.clone(),
                        seq: None,
                        applied_request_ids: Default::default(),
                        // A dense value comes in chunks, each written where it falls.
                        dense_offset: dense.then_some(a.dense_offset),
                    };
                    let r =
                        self.fan_out(
                            vec![(to, load)],
                            |mut c, r| async move { c.bulk_load(r).await },
                        )?;
                    rows += r.iter().map(|x| x.rows).sum::<u64>();
                }
                if a.next_shard >= a.shards {
                    if !dense {
                        let seq = BulkLoadRequest {
                            table: name.clone(),
                            config_json: a.config_json,
                            seq: Some(a.seq),
                            ..Default::default()
                        };
                        self.fan_out(
                            vec![(to, seq)],
                            |mut c, r| async move { c.bulk_load(r).await },
                        )?;
                    }
                    break;
                }
                shard = a.next_shard;
            }
        }
        // The pushes `from` answered lately: a retry of one of them, split to `to` once the
        // batch is published there, is answered, not applied again.
        let ids = ExportSlotsRequest {
            table: String::new(),
            slots: Some(set.clone()),
            shard: 0,
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
        self.publish_routing(next.clone())?;
        Ok(rows)
    }
}
