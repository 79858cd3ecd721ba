//! Moving slots to another server while workers train: the old owner's side (decision 0103).
//!
//! A move of a set of slots from this server runs in four steps, driven by a client
//! (`crate::client::moves`): **freeze** the slots here (`FreezeSlots`: from then on a push,
//! remove or dense push touching one is answered UNAVAILABLE `moving`, which clients retry, and
//! when the call returns no write to them is under way: writers hold the freeze gate's read
//! side while they apply); **export** their rows, table by table, a range of shards at a time,
//! and the request ids of the pushes answered lately (`ExportSlots`), which the client loads on
//! the new owner (`BulkLoad`); **publish** the routing that gives the slots to the new owner
//! (`SetRouting`, which thaws them here: calls for them are "moved" from then on); **drop**
//! this server's copy (`DropSlots`, refused for slots this server owns). Reads are not frozen:
//! they change nothing a move carries (a pull that creates a row creates its initial value,
//! which the new owner creates alike); but a pull that creates rows holds the same pass, so
//! none admitted under the old routing creates a row after the publish (and the drop).

use std::sync::{RwLock, RwLockReadGuard};

use crate::error::{invalid, Error, Result};
use crate::net::proto::{DropSlotsResponse, ExportSlotsRequest, ExportSlotsResponse, SlotSet};
use crate::net::routing::{key, slot_of, SLOTS};
use crate::net::wire;
use crate::store::{Store, Table};

use super::routing::Routes;

/// The slots of a wire set, checked: runs inside 0..16384, each non-empty.
pub(super) fn slots_of(p: Option<&SlotSet>) -> Result<Vec<bool>> {
    let p = p.ok_or_else(|| invalid("the request needs its slots"))?;
    if p.starts.len() != p.ends.len() {
        return Err(invalid(format!(
            "slot set: {} starts and {} ends",
            p.starts.len(),
            p.ends.len()
        )));
    }
    let mut set = vec![false; SLOTS];
    for (&a, &b) in p.starts.iter().zip(&p.ends) {
        if a >= b || b as usize > SLOTS {
            return Err(invalid(format!(
                "slot set: run [{a}, {b}) is not a non-empty run of slots 0 to {SLOTS}"
            )));
        }
        set[a as usize..b as usize].fill(true);
    }
    Ok(set)
}

/// The frozen slots, and the gate writers pass while they apply.
pub(super) struct Frozen(RwLock<Vec<bool>>);

impl Default for Frozen {
    fn default() -> Self {
        Self(RwLock::new(vec![false; SLOTS]))
    }
}

/// A writer's pass: while it lives, no slot it touches can be frozen.
pub(super) type Pass<'a> = RwLockReadGuard<'a, Vec<bool>>;

fn moving(what: String) -> Error {
    Error::Remote {
        server: String::new(),
        code: tonic::Code::Unavailable as i32,
        message: format!("moving: {what} is being moved to another server; retry"),
    }
}

impl Frozen {
    /// Freezes (or thaws) `set`; returns how many slots are frozen afterwards. When it returns
    /// after a freeze, every write admitted before it has finished.
    pub(super) fn set(&self, set: &[bool], freeze: bool) -> usize {
        let mut g = self.0.write().unwrap_or_else(|e| e.into_inner());
        for (f, &s) in g.iter_mut().zip(set) {
            if s {
                *f = freeze;
            }
        }
        g.iter().filter(|&&f| f).count()
    }

    /// Runs `publish` (a routing change) with every write held off, then thaws the slots
    /// `moved` says this server no longer owns, and runs `after` with the slots still frozen
    /// before any write goes on (a primary hands the change to its followers there): a write
    /// that passed its ownership check under its pass finishes first, and one after it checks
    /// against the new routing.
    pub(super) fn publish<R>(
        &self,
        publish: impl FnOnce() -> Result<R>,
        moved: impl Fn(usize) -> bool,
        after: impl FnOnce(&[bool]) -> Result<()>,
    ) -> Result<R> {
        let mut g = self.0.write().unwrap_or_else(|e| e.into_inner());
        let out = publish()?;
        for (s, f) in g.iter_mut().enumerate() {
            if *f && moved(s) {
                *f = false;
            }
        }
        after(&g)?;
        Ok(out)
    }

    /// The frozen slots.
    pub(super) fn slots(&self) -> Vec<bool> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the frozen slots with `set` (a follower taking its primary's).
    pub(super) fn replace(&self, set: &[bool]) {
        let mut g = self.0.write().unwrap_or_else(|e| e.into_inner());
        let n = g.len();
        g.copy_from_slice(&set[..n]);
    }

    /// A write of `ids` may go on (holding the pass while it applies), unless one is frozen,
    /// or (`owned` false: a routing published since the call was admitted gave it away) no
    /// longer this server's: then "moving", and the retry meets the routing check ("moved").
    pub(super) fn pass_ids(&self, ids: &[u64], routes: &Routes) -> Result<Pass<'_>> {
        let g = self.0.read().unwrap_or_else(|e| e.into_inner());
        // Read under the pass: a publish (which holds every pass off) is wholly before or after.
        let owned = routes.owned_now();
        if let Some(&id) = ids
            .iter()
            .find(|&&id| g[slot_of(id)] || !owned(slot_of(id)))
        {
            return Err(moving(format!("id {id} (slot {})", slot_of(id))));
        }
        Ok(g)
    }

    /// A pull that creates the rows of `ids` it does not hold may go on (holding the pass
    /// while it runs), unless a routing published since the call was admitted gave one away:
    /// then "moving" (the retry meets "moved"). Frozen slots are read as usual. A publish waits
    /// for the pass, so once it returned no pull of the old routing is left to create a row
    /// after the old owner's `DropSlots`.
    pub(super) fn pass_owned(&self, ids: &[u64], routes: &Routes) -> Result<Pass<'_>> {
        let g = self.0.read().unwrap_or_else(|e| e.into_inner());
        let owned = routes.owned_now();
        if let Some(&id) = ids.iter().find(|&&id| !owned(slot_of(id))) {
            return Err(moving(format!("id {id} (slot {})", slot_of(id))));
        }
        Ok(g)
    }

    /// A write of dense table `name` may go on, unless its name's slot is frozen or no longer
    /// owned (as [`pass_ids`](Self::pass_ids)).
    pub(super) fn pass_name(&self, name: &str, routes: &Routes) -> Result<Pass<'_>> {
        let g = self.0.read().unwrap_or_else(|e| e.into_inner());
        let owned = routes.owned_now();
        let s = slot_of(key(name));
        if g[s] || !owned(s) {
            return Err(moving(format!("dense table {name:?} (slot {s})")));
        }
        Ok(g)
    }
}

/// How many of the last answered request ids an export gives (a retry comes within seconds).
pub(super) const EXPORTED_REQUEST_IDS: usize = 1 << 18;

/// Request ids as (client, seq) little-endian u64 pairs.
pub(super) fn encode_request_ids(ids: &[(u64, u64)]) -> bytes::Bytes {
    let mut out = Vec::with_capacity(ids.len() * 16);
    for (c, s) in ids {
        out.extend_from_slice(&c.to_le_bytes());
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.into()
}

/// The request ids of (client, seq) little-endian u64 pairs.
pub(super) fn request_ids(b: &[u8]) -> Result<Vec<(u64, u64)>> {
    if !b.len().is_multiple_of(16) {
        return Err(invalid(format!(
            "applied_request_ids: {} bytes, not a whole number of (client, seq) u64 pairs",
            b.len()
        )));
    }
    Ok(b.chunks_exact(16)
        .map(|c| {
            let (a, s) = c.split_at(8);
            (
                u64::from_le_bytes(a.try_into().unwrap_or([0; 8])),
                u64::from_le_bytes(s.try_into().unwrap_or([0; 8])),
            )
        })
        .collect())
}

/// The largest export answer, in bytes (more shards are read while under it).
const EXPORT_BYTES: usize = 4 << 20;

/// The rows of `r.table` in `r.slots`, from shard `r.shard` on, up to about [`EXPORT_BYTES`]
/// (at least one shard).
pub(super) fn export(store: &Store, r: &ExportSlotsRequest) -> Result<ExportSlotsResponse> {
    let set = slots_of(r.slots.as_ref())?;
    match store.table(&r.table)? {
        Table::Sparse(t) => {
            // A durable table's rows may wait in the replica: all in memory first.
            t.load_all()?;
            let config_json = serde_json::to_string(t.config())
                .map_err(|e| Error::Internal(format!("export: {e}")))?;
            let shards = t.num_shards();
            let mut ids = Vec::new();
            let mut words: Vec<u8> = Vec::new();
            let mut s = r.shard as usize;
            while s < shards && (s == r.shard as usize || words.len() < EXPORT_BYTES) {
                t.copy_rows_where(
                    s,
                    |id| set[slot_of(id)],
                    |id, w| {
                        ids.push(id);
                        for x in w {
                            words.extend_from_slice(&x.to_le_bytes());
                        }
                    },
                );
                s += 1;
            }
            Ok(ExportSlotsResponse {
                config_json,
                ids: wire::encode_ids(&ids),
                words: words.into(),
                next_shard: s as u32,
                shards: shards as u32,
                seq: t.seq(),
                request_ids: Default::default(),
                dense: false,
                dense_offset: 0,
            })
        }
        Table::Dense(d) => {
            let config_json = serde_json::to_string(d.config())
                .map_err(|e| Error::Internal(format!("export: {e}")))?;
            let home = set[slot_of(key(&r.table))];
            // A chunk of the value per `shard`, so a value larger than a message moves too.
            let chunk = EXPORT_BYTES / 4;
            let total = d.words_len();
            let chunks = if home { total.div_ceil(chunk) } else { 1 };
            let start = r.shard as usize * chunk;
            let words: Vec<u8> = if home && start < total {
                d.words_at(start, chunk)
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect()
            } else {
                Vec::new()
            };
            Ok(ExportSlotsResponse {
                config_json,
                ids: Default::default(),
                words: words.into(),
                next_shard: r.shard.saturating_add(1),
                shards: chunks as u32,
                seq: d.step() as u64,
                request_ids: Default::default(),
                dense: true,
                dense_offset: start as u64,
            })
        }
    }
}

/// Removes every table's rows in `set` (which this server does not own).
pub(super) fn drop_slots(store: &Store, set: &[bool]) -> Result<DropSlotsResponse> {
    let mut rows = 0u64;
    for name in store.tables() {
        let Ok(Table::Sparse(t)) = store.table(&name) else {
            continue;
        };
        t.load_all()?;
        let mut ids = Vec::new();
        for s in 0..t.num_shards() {
            t.copy_rows_where(s, |id| set[slot_of(id)], |id, _| ids.push(id));
        }
        rows += t.remove(&ids)? as u64;
    }
    Ok(DropSlotsResponse { rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(runs: &[(u32, u32)]) -> SlotSet {
        SlotSet {
            starts: runs.iter().map(|r| r.0).collect(),
            ends: runs.iter().map(|r| r.1).collect(),
        }
    }

    #[test]
    fn slot_sets_are_checked() {
        let s = slots_of(Some(&set(&[(0, 2), (10, 11)]))).unwrap();
        assert_eq!(s.iter().filter(|&&x| x).count(), 3);
        assert!(s[0] && s[1] && !s[2] && s[10]);
        for bad in [set(&[(3, 3)]), set(&[(5, 2)]), set(&[(0, 16385)])] {
            let e = slots_of(Some(&bad)).unwrap_err().to_string();
            assert!(e.contains("non-empty run"), "{e}");
        }
        assert!(slots_of(None).is_err());
    }

    #[test]
    fn a_frozen_slot_refuses_writes_until_thawed() {
        let f = Frozen::default();
        let id = 12345u64;
        let s = slot_of(id);
        let mut one = vec![false; SLOTS];
        one[s] = true;
        assert_eq!(f.set(&one, true), 1);
        let all = &Routes::default();
        let e = f
            .pass_ids(&[1, id], all)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("moving:") && e.contains(&format!("slot {s}")),
            "{e}"
        );
        // Other slots pass.
        let other = (0..).find(|&x| slot_of(x) != s).unwrap();
        drop(f.pass_ids(&[other], all).unwrap());
        f.publish(|| Ok(()), |k| k == s, |_| Ok(())).unwrap();
        drop(f.pass_ids(&[id], all).unwrap());
        assert_eq!(f.set(&one, false), 0);
    }

    #[test]
    fn a_freeze_waits_for_writes_under_way() {
        let f = std::sync::Arc::new(Frozen::default());
        let pass = f.pass_ids(&[7], &Routes::default()).unwrap();
        let g = std::sync::Arc::clone(&f);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let mut all = vec![false; SLOTS];
            all[slot_of(7)] = true;
            g.set(&all, true);
            tx.send(()).unwrap();
        });
        // The freeze cannot finish while the write holds its pass.
        assert!(rx
            .recv_timeout(std::time::Duration::from_millis(100))
            .is_err());
        drop(pass);
        rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        t.join().unwrap();
        assert!(f.pass_ids(&[7], &Routes::default()).is_err());
    }

    #[test]
    fn a_creating_pull_reads_frozen_slots_and_holds_a_publish_off() {
        let f = std::sync::Arc::new(Frozen::default());
        let mut one = vec![false; SLOTS];
        one[slot_of(7)] = true;
        f.set(&one, true);
        // Frozen slots are read (and created) as usual while their rows are copied.
        let pass = f.pass_owned(&[7], &Routes::default()).unwrap();
        let g = std::sync::Arc::clone(&f);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            g.publish(|| Ok(()), |_| true, |_| Ok(())).unwrap();
            tx.send(()).unwrap();
        });
        // The publish cannot finish while the pull holds its pass.
        assert!(rx
            .recv_timeout(std::time::Duration::from_millis(100))
            .is_err());
        drop(pass);
        rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn a_dense_value_larger_than_a_chunk_moves_in_chunks() {
        use crate::net::proto::BulkLoadRequest;
        use crate::store::StoreConfig;
        use crate::table::DenseTableConfig;
        let config = DenseTableConfig {
            shape: vec![1_500_000],
            optimizer: crate::optimizer::OptimizerConfig {
                kind: crate::optimizer::OptimizerKind::Adagrad {
                    initial_accumulator_value: 0.1,
                    eps: 1e-10,
                    weight_decay: 0.0,
                },
                ..Default::default()
            },
            initializer: crate::init::Initializer::Zeros,
            seed: 0,
        };
        let (from, to) = (
            Store::new(StoreConfig::default()).unwrap(),
            Store::new(StoreConfig::default()).unwrap(),
        );
        let d = from.create_dense_table("d", config.clone()).unwrap();
        let e = to.create_dense_table("d", config).unwrap();
        let g: Vec<f32> = (0..1_500_000).map(|k| (k % 7) as f32 - 3.0).collect();
        d.push(&g).unwrap();
        let runs = SlotSet {
            starts: vec![0],
            ends: vec![SLOTS as u32],
        };
        let (mut shard, mut chunks) = (0, 0);
        loop {
            let req = ExportSlotsRequest {
                table: "d".into(),
                slots: Some(runs.clone()),
                shard,
            };
            let a = export(&from, &req).unwrap();
            assert!(
                a.dense && a.words.len() <= EXPORT_BYTES,
                "{}",
                a.words.len()
            );
            let load = BulkLoadRequest {
                table: "d".into(),
                config_json: a.config_json,
                words: a.words,
                dense_offset: Some(a.dense_offset),
                ..Default::default()
            };
            crate::server::bulk::bulk_load(&to, load).unwrap();
            chunks += 1;
            if a.next_shard >= a.shards {
                break;
            }
            shard = a.next_shard;
        }
        // Weights and Adagrad state: 12 MB, three chunks of at most 4 MiB.
        assert_eq!(chunks, 3);
        assert_eq!(e.words(), d.words());
        // A chunk past the value's end is refused and writes nothing.
        let over = BulkLoadRequest {
            table: "d".into(),
            config_json: serde_json::to_string(e.config()).unwrap(),
            words: vec![0u8; 8].into(),
            dense_offset: Some(e.words_len() as u64 - 1),
            ..Default::default()
        };
        assert!(crate::server::bulk::bulk_load(&to, over).is_err());
        let huge = BulkLoadRequest {
            table: "d".into(),
            config_json: serde_json::to_string(e.config()).unwrap(),
            words: vec![0u8; 8].into(),
            dense_offset: Some(u64::MAX),
            ..Default::default()
        };
        assert!(crate::server::bulk::bulk_load(&to, huge).is_err());
        assert_eq!(e.words(), d.words());
    }

    #[test]
    fn request_ids_round_trip_and_odd_lengths_are_refused() {
        let ids = vec![(1u64, 2u64), (u64::MAX, 0)];
        assert_eq!(request_ids(&encode_request_ids(&ids)).unwrap(), ids);
        assert!(request_ids(&[0u8; 15]).is_err());
    }
}
