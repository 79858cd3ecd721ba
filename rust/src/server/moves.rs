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

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::error::{invalid, Error, Result};
use crate::net::proto::{DropSlotsResponse, ExportSlotsRequest, ExportSlotsResponse, SlotSet};
use crate::net::routing::{key, slot_of, SLOTS};
use crate::net::wire;
use crate::store::{Store, Table};
use crate::table::{BudgetEvict, BudgetGuard, BudgetRow};

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

/// The frozen slots, the slots being copied, and the gate writers pass while they apply.
pub(super) struct Frozen {
    slots: RwLock<Slots>,
    /// What was written in the slots being copied since they were marked (decision 0114).
    dirty: Mutex<Dirty>,
    /// Per slot, [`FROZEN`] and [`COPYING`] as `slots` holds them, for a table's `max_rows`
    /// budget (decision 0122): its evictions hold the read side (under a writer's pass, or under
    /// none when a BSP step is applied: `slots` itself cannot be read again under a pass), and
    /// every change of `slots`, and a publish (which changes what this server owns), the write
    /// side, always taken after `slots`' write side.
    budget: RwLock<Vec<u8>>,
}

/// A slot of [`Frozen::budget`] that is frozen.
const FROZEN: u8 = 1;
/// A slot of [`Frozen::budget`] that is being copied.
const COPYING: u8 = 2;

/// Writes `g`'s slots into the budget's copy.
fn mirror(flags: &mut [u8], g: &Slots) {
    for ((f, &fr), &c) in flags.iter_mut().zip(&g.frozen).zip(&g.copying) {
        *f = if fr { FROZEN } else { 0 } | if c { COPYING } else { 0 };
    }
}

/// Per slot: frozen (writes answer "moving"), and copying (writes go on, and are recorded).
pub(super) struct Slots {
    frozen: Vec<bool>,
    copying: Vec<bool>,
    /// Whether any slot is copying (a write checks nothing more when none is).
    any_copying: bool,
    /// Slots this server owned frozen when it was promoted, thawed then (decision 0125): their
    /// move's copy may lack the writes taken since, so a routing that gives one away is
    /// refused until a move freezes (or thaws) it again.
    interrupted: Vec<bool>,
}

/// The rows written, created or removed in copying slots, by table, and the dense tables
/// written whose name's slot is copying.
#[derive(Default)]
struct Dirty {
    rows: HashMap<String, HashSet<u64>>,
    dense: HashSet<String>,
}

impl Dirty {
    /// Forgets what was recorded in `set`.
    fn clear(&mut self, set: &[bool]) {
        for ids in self.rows.values_mut() {
            ids.retain(|&id| !set[slot_of(id)]);
        }
        self.rows.retain(|_, ids| !ids.is_empty());
        self.dense.retain(|name| !set[slot_of(key(name))]);
    }
}

impl Default for Frozen {
    fn default() -> Self {
        Self {
            slots: RwLock::new(Slots {
                frozen: vec![false; SLOTS],
                copying: vec![false; SLOTS],
                any_copying: false,
                interrupted: vec![false; SLOTS],
            }),
            dirty: Mutex::new(Dirty::default()),
            budget: RwLock::new(vec![0; SLOTS]),
        }
    }
}

/// A writer's pass: while it lives, no slot it touches can be frozen (or marked copying).
pub(super) type Pass<'a> = RwLockReadGuard<'a, Slots>;

fn moving(what: String) -> Error {
    Error::Remote {
        server: String::new(),
        code: tonic::Code::Unavailable as i32,
        message: format!("moving: {what} is being moved to another server; retry"),
    }
}

impl Frozen {
    fn write(&self) -> RwLockWriteGuard<'_, Slots> {
        self.slots.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> Pass<'_> {
        self.slots.read().unwrap_or_else(|e| e.into_inner())
    }

    fn dirty(&self) -> MutexGuard<'_, Dirty> {
        self.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The budget's copy of the slots, to change (after `slots`' write side).
    fn budget_write(&self) -> RwLockWriteGuard<'_, Vec<u8>> {
        self.budget.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `ids` of `table` whose slots are copying (under a writer's pass `g`).
    fn record(&self, g: &Slots, table: &str, ids: &[u64]) {
        if !g.any_copying {
            return;
        }
        self.note(
            table,
            ids.iter().copied().filter(|&id| g.copying[slot_of(id)]),
        );
    }

    /// Records `ids` of `table` (of copying slots).
    fn note(&self, table: &str, it: impl Iterator<Item = u64>) {
        let mut it = it.peekable();
        if it.peek().is_none() {
            return;
        }
        let mut d = self.dirty();
        match d.rows.get_mut(table) {
            Some(set) => set.extend(it),
            None => {
                d.rows.insert(table.to_string(), it.collect());
            }
        }
    }

    /// Records the rows of pending BSP steps in slots being copied (`rows`: a sparse table's
    /// ids, or `None` for a dense table), which their steps will write after the mark.
    pub(super) fn note_pending(&self, rows: Vec<(String, Option<Vec<u64>>)>) {
        for (table, ids) in rows {
            match ids {
                Some(ids) => self.note(&table, ids.into_iter()),
                None => {
                    self.dirty().dense.insert(table);
                }
            }
        }
    }

    /// Freezes (or thaws) `set`; returns how many slots are frozen afterwards. When it returns
    /// after a freeze, every write admitted before it has finished. A thaw also ends the
    /// copying of `set` and forgets what was recorded there (a move given up).
    pub(super) fn set(&self, set: &[bool], freeze: bool) -> usize {
        let mut g = self.write();
        let mut b = self.budget_write();
        for (f, &s) in g.frozen.iter_mut().zip(set) {
            if s {
                *f = freeze;
            }
        }
        // A move of these slots starts again (or is given up): its own copy decides.
        for (i, &s) in g.interrupted.iter_mut().zip(set) {
            if s {
                *i = false;
            }
        }
        if !freeze {
            self.end_copying(&mut g, set);
        }
        mirror(&mut b, &g);
        g.frozen.iter().filter(|&&f| f).count()
    }

    /// Thaws `set` and keeps it copying, with its record (a freeze that waits for a BSP step
    /// boundary lets the step's pushes in meanwhile, decision 0123).
    pub(super) fn unfreeze(&self, set: &[bool]) {
        let mut g = self.write();
        let mut b = self.budget_write();
        for (f, &s) in g.frozen.iter_mut().zip(set) {
            if s {
                *f = false;
            }
        }
        mirror(&mut b, &g);
    }

    /// Marks `set` as copying: writes to it go on, and the ids they write, create or remove are
    /// recorded from now on (what was recorded there before is forgotten). When it returns,
    /// every write admitted before it has finished, so a copy read from now on holds it.
    /// Returns how many slots are copying afterwards.
    pub(super) fn copy(&self, set: &[bool]) -> usize {
        let mut g = self.write();
        let mut b = self.budget_write();
        self.dirty().clear(set);
        let slots = &mut *g;
        for ((c, i), &s) in slots
            .copying
            .iter_mut()
            .zip(slots.interrupted.iter_mut())
            .zip(set)
        {
            if s {
                *c = true;
                *i = false;
            }
        }
        g.any_copying = g.copying.iter().any(|&c| c);
        mirror(&mut b, &g);
        g.copying.iter().filter(|&&c| c).count()
    }

    fn end_copying(&self, g: &mut Slots, set: &[bool]) {
        if !g.any_copying {
            return;
        }
        for (c, &s) in g.copying.iter_mut().zip(set) {
            if s {
                *c = false;
            }
        }
        g.any_copying = g.copying.iter().any(|&c| c);
        self.dirty().clear(set);
    }

    /// The ids of `table` recorded in `set` since it was marked copying, in order; refused
    /// unless every slot of `set` is copying and frozen (so the answer is whole, and stays so
    /// while the delta is read: a restart or a promotion since the mark loses the record, and
    /// the move must start the batch again).
    pub(super) fn dirty_ids(&self, table: &str, set: &[bool]) -> Result<Vec<u64>> {
        let g = self.read();
        if let Some(k) = (0..SLOTS).find(|&k| set[k] && !(g.copying[k] && g.frozen[k])) {
            return Err(invalid(format!(
                "export of the rows written during the copy: slot {k} is not {} on this server \
                 (a restart or a failover since the copy began loses what was written there): \
                 move the batch again",
                if g.copying[k] {
                    "frozen"
                } else {
                    "being copied"
                }
            )));
        }
        let d = self.dirty();
        let mut ids: Vec<u64> = d
            .rows
            .get(table)
            .map(|s| s.iter().copied().filter(|&id| set[slot_of(id)]).collect())
            .unwrap_or_default();
        ids.sort_unstable();
        Ok(ids)
    }

    /// Whether dense table `name` was written since its name's slot was marked copying.
    pub(super) fn dense_dirty(&self, name: &str) -> bool {
        self.dirty().dense.contains(name)
    }

    /// Runs `publish` (a routing change) with every write held off, then thaws the slots
    /// `moved` says this server no longer owns (ending their copying), and runs `after` with the
    /// slots still frozen before any write goes on (a primary hands the change to its followers
    /// there): a write that passed its ownership check under its pass finishes first, and one
    /// after it checks against the new routing.
    pub(super) fn publish<R>(
        &self,
        publish: impl FnOnce() -> Result<R>,
        moved: impl Fn(usize) -> bool,
        after: impl FnOnce(&[bool]) -> Result<()>,
    ) -> Result<R> {
        let mut g = self.write();
        // Held through the routing change too: a budget's eviction reads what it owns.
        let mut b = self.budget_write();
        let out = publish()?;
        let mut gone = vec![false; SLOTS];
        let slots = &mut *g;
        for (s, f) in slots.frozen.iter_mut().enumerate() {
            if (*f || slots.copying[s]) && moved(s) {
                *f = false;
                gone[s] = true;
            }
        }
        self.end_copying(&mut g, &gone);
        mirror(&mut b, &g);
        drop(b);
        after(&g.frozen)?;
        Ok(out)
    }

    /// This server was promoted (decision 0125): every frozen slot is thawed (and every copy
    /// ended, its record forgotten: it was lost with the old primary's memory anyway), so that
    /// writes to them are taken by the new primary instead of waiting for a move driver that
    /// talked to the old one. The slots it `owns` among them are remembered as interrupted (see
    /// [`interrupted`](Self::interrupted)). Returns how many were frozen.
    pub(super) fn thaw_on_promotion(&self, owns: impl Fn(usize) -> bool) -> usize {
        let mut g = self.write();
        let mut b = self.budget_write();
        let slots = &mut *g;
        let mut n = 0;
        for (k, f) in slots.frozen.iter_mut().enumerate() {
            if *f {
                n += 1;
                *f = false;
                slots.interrupted[k] = owns(k);
            }
        }
        let every = vec![true; SLOTS];
        self.end_copying(&mut g, &every);
        mirror(&mut b, &g);
        n
    }

    /// The slots whose move a promotion interrupted (thawed then, and frozen or thawed by no
    /// move since): a routing must not give them away, since the new owner's copy may lack
    /// what this server took since.
    pub(super) fn interrupted(&self) -> Vec<usize> {
        let g = self.read();
        (0..SLOTS).filter(|&k| g.interrupted[k]).collect()
    }

    /// The frozen slots.
    pub(super) fn slots(&self) -> Vec<bool> {
        self.read().frozen.clone()
    }

    /// Replaces the frozen slots with `set` (a follower taking its primary's).
    pub(super) fn replace(&self, set: &[bool]) {
        let mut g = self.write();
        let mut b = self.budget_write();
        let n = g.frozen.len();
        g.frozen.copy_from_slice(&set[..n]);
        g.interrupted.fill(false);
        mirror(&mut b, &g);
    }

    /// A write of `ids` of `table` may go on (holding the pass while it applies), unless one is
    /// frozen, or (`owned` false: a routing published since the call was admitted gave it away)
    /// no longer this server's: then "moving", and the retry meets the routing check ("moved").
    /// Ids of copying slots are recorded.
    pub(super) fn pass_ids(&self, table: &str, ids: &[u64], routes: &Routes) -> Result<Pass<'_>> {
        let g = self.read();
        // Read under the pass: a publish (which holds every pass off) is wholly before or after.
        let owned = routes.owned_now();
        if let Some(&id) = ids
            .iter()
            .find(|&&id| g.frozen[slot_of(id)] || !owned(slot_of(id)))
        {
            return Err(moving(format!("id {id} (slot {})", slot_of(id))));
        }
        self.record(&g, table, ids);
        Ok(g)
    }

    /// A pull that creates the rows of `ids` of `table` it does not hold may go on (holding the
    /// pass while it runs), unless a routing published since the call was admitted gave one
    /// away: then "moving" (the retry meets "moved"). Frozen slots are read as usual. A publish
    /// waits for the pass, so once it returned no pull of the old routing is left to create a
    /// row after the old owner's `DropSlots`. Ids of slots copying and not frozen are recorded
    /// (a row created there reaches the new owner with the delta; one created under the freeze
    /// is created again there at the same initial value).
    pub(super) fn pass_owned(&self, table: &str, ids: &[u64], routes: &Routes) -> Result<Pass<'_>> {
        let g = self.read();
        let owned = routes.owned_now();
        if let Some(&id) = ids.iter().find(|&&id| !owned(slot_of(id))) {
            return Err(moving(format!("id {id} (slot {})", slot_of(id))));
        }
        if g.any_copying {
            let open: Vec<u64> = ids
                .iter()
                .copied()
                .filter(|&id| !g.frozen[slot_of(id)])
                .collect();
            self.record(&g, table, &open);
        }
        Ok(g)
    }

    /// An `Evict` of `table` may go on while slots move (holding the pass while it runs): the
    /// rows it may remove are those of slots this server owns and that are not frozen (a row
    /// of a frozen slot is on its way to the new owner as it is: it is kept, and evicted there
    /// later if it stays idle); a row it removes from a slot being copied is recorded, so the
    /// delta removes it from the new owner too. `evict(may)` runs the eviction, asking `may(id)`
    /// of each row that is old enough to go (and of no other), and answers how many it removed.
    pub(super) fn evict<R>(
        &self,
        table: &str,
        routes: &Routes,
        evict: impl FnOnce(&dyn Fn(u64) -> bool) -> Result<R>,
    ) -> Result<R> {
        let g = self.read();
        let owned = routes.owned_now();
        let removed = Mutex::new(Vec::new());
        let may = |id: u64| {
            let s = slot_of(id);
            let yes = !g.frozen[s] && owned(s);
            if yes && g.copying[s] {
                removed.lock().unwrap_or_else(|e| e.into_inner()).push(id);
            }
            yes
        };
        let out = evict(&may);
        // Recorded even when the eviction failed part way: a row recorded and still held goes
        // again with the delta, as it is.
        let removed = removed.into_inner().unwrap_or_else(|e| e.into_inner());
        self.record(&g, table, &removed);
        out
    }

    /// A table's `max_rows` budget evicting while slots move (decision 0122): `evict(by_slot)`
    /// runs the eviction with each slot's class. A row of a slot this server does not
    /// own (copied in before the publish that gives it the slot, or left until `DropSlots`)
    /// is neither counted nor evicted; one of a frozen slot is counted and kept (it is on its
    /// way to the new owner as it is); any other may go, and one evicted from a slot being
    /// copied is recorded, so the delta removes it from the new owner too. Holds the budget's
    /// read side, so no slot is frozen, marked or given away while the eviction runs: it may
    /// run under a writer's pass or under none.
    pub(super) fn budget(&self, table: &str, routes: &Routes, evict: &mut BudgetEvict<'_>) {
        let flags = self.budget.read().unwrap_or_else(|e| e.into_inner());
        let owned = routes.owned_now();
        let by_slot: Vec<BudgetRow> = (0..SLOTS)
            .map(|s| {
                if !owned(s) {
                    BudgetRow::Skip
                } else if flags[s] & FROZEN != 0 {
                    BudgetRow::Keep
                } else {
                    BudgetRow::Evict
                }
            })
            .collect();
        let evicted = evict(&by_slot);
        self.note(
            table,
            evicted
                .into_iter()
                .filter(|&id| flags[slot_of(id)] & COPYING != 0),
        );
    }

    /// A write of dense table `name` may go on, unless its name's slot is frozen or no longer
    /// owned (as [`pass_ids`](Self::pass_ids)); recorded when its name's slot is copying.
    pub(super) fn pass_name(&self, name: &str, routes: &Routes) -> Result<Pass<'_>> {
        let g = self.read();
        let owned = routes.owned_now();
        let s = slot_of(key(name));
        if g.frozen[s] || !owned(s) {
            return Err(moving(format!("dense table {name:?} (slot {s})")));
        }
        if g.copying[s] {
            self.dirty().dense.insert(name.to_string());
        }
        Ok(g)
    }
}

/// The server's [`BudgetGuard`]: its tables' `max_rows` budgets evict as [`Frozen::budget`]
/// says (any row once the server is gone).
pub(super) struct Guard(pub(super) std::sync::Weak<super::Inner>);

impl BudgetGuard for Guard {
    fn budget(&self, table: &str, evict: &mut BudgetEvict<'_>) {
        match self.0.upgrade() {
            Some(inner) => inner.frozen.budget(table, &inner.routing, evict),
            None => {
                evict(&[BudgetRow::Evict; SLOTS]);
            }
        }
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
                dense: false,
                ..Default::default()
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
                dense: true,
                dense_offset: start as u64,
                ..Default::default()
            })
        }
    }
}

/// The rows of `r.table` written, created or removed in `r.slots` since they were marked
/// copying (`r.dirty`; the slots frozen): the recorded ids from index `r.shard` on, up to about
/// [`EXPORT_BYTES`], rows this server holds in `ids` and `words`, the others in `removed_ids`. A
/// dense table: its value (as [`export`]) when it was written, nothing otherwise.
pub(super) fn export_dirty(
    store: &Store,
    frozen: &Frozen,
    r: &ExportSlotsRequest,
) -> Result<ExportSlotsResponse> {
    let set = slots_of(r.slots.as_ref())?;
    // Refused unless the slots are copying and frozen.
    let dirty = frozen.dirty_ids(&r.table, &set)?;
    match store.table(&r.table)? {
        Table::Sparse(t) => {
            t.load_all()?;
            let config_json = serde_json::to_string(t.config())
                .map_err(|e| Error::Internal(format!("export: {e}")))?;
            let from = (r.shard as usize).min(dirty.len());
            let per_row = 4 * t.row_words() + 8;
            let take = (EXPORT_BYTES / per_row).max(1);
            let page = &dirty[from..(from + take).min(dirty.len())];
            let (mut ids, mut removed) = (Vec::new(), Vec::new());
            let mut words: Vec<u8> = Vec::new();
            t.copy_rows_of(
                page,
                |id, w| {
                    ids.push(id);
                    for x in w {
                        words.extend_from_slice(&x.to_le_bytes());
                    }
                },
                |id| removed.push(id),
            );
            Ok(ExportSlotsResponse {
                config_json,
                ids: wire::encode_ids(&ids),
                words: words.into(),
                next_shard: (from + page.len()) as u32,
                shards: dirty.len() as u32,
                seq: t.seq(),
                removed_ids: wire::encode_ids(&removed),
                ..Default::default()
            })
        }
        Table::Dense(_) if frozen.dense_dirty(&r.table) => export(store, r),
        Table::Dense(d) => Ok(ExportSlotsResponse {
            config_json: serde_json::to_string(d.config())
                .map_err(|e| Error::Internal(format!("export: {e}")))?,
            next_shard: 1,
            shards: 1,
            seq: d.step() as u64,
            dense: true,
            ..Default::default()
        }),
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
            .pass_ids("t", &[1, id], all)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("moving:") && e.contains(&format!("slot {s}")),
            "{e}"
        );
        // Other slots pass.
        let other = (0..).find(|&x| slot_of(x) != s).unwrap();
        drop(f.pass_ids("t", &[other], all).unwrap());
        f.publish(|| Ok(()), |k| k == s, |_| Ok(())).unwrap();
        drop(f.pass_ids("t", &[id], all).unwrap());
        assert_eq!(f.set(&one, false), 0);
    }

    #[test]
    fn a_freeze_waits_for_writes_under_way() {
        let f = std::sync::Arc::new(Frozen::default());
        let pass = f.pass_ids("t", &[7], &Routes::default()).unwrap();
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
        assert!(f.pass_ids("t", &[7], &Routes::default()).is_err());
    }

    #[test]
    fn a_creating_pull_reads_frozen_slots_and_holds_a_publish_off() {
        let f = std::sync::Arc::new(Frozen::default());
        let mut one = vec![false; SLOTS];
        one[slot_of(7)] = true;
        f.set(&one, true);
        // Frozen slots are read (and created) as usual while their rows are copied.
        let pass = f.pass_owned("t", &[7], &Routes::default()).unwrap();
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
                dirty: false,
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

    /// Two ids of different slots, and the set of the first one's slot.
    fn two_slots() -> (u64, u64, Vec<bool>) {
        let a = 7u64;
        let b = (8..).find(|&x| slot_of(x) != slot_of(a)).unwrap();
        let mut set = vec![false; SLOTS];
        set[slot_of(a)] = true;
        (a, b, set)
    }

    #[test]
    fn copying_slots_take_writes_and_record_what_they_touch() {
        let f = Frozen::default();
        let all = &Routes::default();
        let (a, b, set) = two_slots();
        // Nothing is recorded before the mark.
        drop(f.pass_ids("t", &[a], all).unwrap());
        assert_eq!(f.copy(&set), 1);
        // Writes go on; only the copying slot's ids are recorded, per table.
        drop(f.pass_ids("t", &[a, b], all).unwrap());
        drop(f.pass_ids("u", &[a], all).unwrap());
        // A creating pull records too, while the slot is not frozen.
        let c = (a + 1..).find(|&x| slot_of(x) == slot_of(a)).unwrap();
        drop(f.pass_owned("t", &[c, b], all).unwrap());
        // The record is given only once the slots are frozen too.
        let e = f.dirty_ids("t", &set).unwrap_err().to_string();
        assert!(e.contains("not frozen"), "{e}");
        assert_eq!(f.set(&set, true), 1);
        // Frozen: writes are refused, and a creating pull is no longer recorded.
        assert!(f.pass_ids("t", &[a], all).is_err());
        let d = (c + 1..).find(|&x| slot_of(x) == slot_of(a)).unwrap();
        drop(f.pass_owned("t", &[d], all).unwrap());
        let mut want = vec![a, c];
        want.sort_unstable();
        assert_eq!(f.dirty_ids("t", &set).unwrap(), want);
        assert_eq!(f.dirty_ids("u", &set).unwrap(), vec![a]);
        assert!(f.dirty_ids("none", &set).unwrap().is_empty());
        // A slot outside the copy is refused by name.
        let mut other = vec![false; SLOTS];
        other[slot_of(b)] = true;
        let e = f.dirty_ids("t", &other).unwrap_err().to_string();
        assert!(
            e.contains("not being copied") && e.contains(&format!("slot {}", slot_of(b))),
            "{e}"
        );
        // A thaw ends the copy and forgets the record.
        assert_eq!(f.set(&set, false), 0);
        assert!(f.dirty_ids("t", &set).is_err());
        drop(f.pass_ids("t", &[a], all).unwrap());
        f.copy(&set);
        f.set(&set, true);
        assert!(f.dirty_ids("t", &set).unwrap().is_empty());
    }

    #[test]
    fn a_promotion_thaws_frozen_slots_and_remembers_the_owned_ones_until_moved_again() {
        let f = Frozen::default();
        let all = &Routes::default();
        let (a, b, set) = two_slots();
        let mut other = vec![false; SLOTS];
        other[slot_of(b)] = true;
        f.copy(&set);
        f.set(&set, true);
        f.set(&other, true);
        assert!(f.pass_ids("t", &[a], all).is_err());
        // Slot of b is not this server's at its routing: thawed, not remembered.
        let owned_a = |k: usize| k == slot_of(a);
        assert_eq!(f.thaw_on_promotion(owned_a), 2);
        assert_eq!(f.slots().iter().filter(|&&x| x).count(), 0);
        drop(f.pass_ids("t", &[a, b], all).unwrap());
        assert_eq!(f.interrupted(), vec![slot_of(a)]);
        // The copy's record is gone with it.
        assert!(f.dirty_ids("t", &set).is_err());
        // A move of the slot starts again (or is given up): no longer interrupted.
        f.copy(&set);
        assert!(f.interrupted().is_empty());
        f.set(&set, true);
        assert_eq!(f.thaw_on_promotion(|_| true), 1);
        f.set(&set, false);
        assert!(f.interrupted().is_empty());
    }

    #[test]
    fn a_dense_table_is_recorded_by_its_name_slot_and_a_publish_ends_the_copy() {
        let f = Frozen::default();
        let all = &Routes::default();
        let home = slot_of(key("d"));
        let mut set = vec![false; SLOTS];
        set[home] = true;
        drop(f.pass_name("d", all).unwrap());
        f.copy(&set);
        assert!(!f.dense_dirty("d"));
        drop(f.pass_name("d", all).unwrap());
        assert!(f.dense_dirty("d"));
        let id = (0..).find(|&x| slot_of(x) == home).unwrap();
        drop(f.pass_ids("t", &[id], all).unwrap());
        f.set(&set, true);
        assert_eq!(f.dirty_ids("t", &set).unwrap(), vec![id]);
        // The publish that gives the slot away thaws it and forgets its record.
        f.publish(
            || Ok(()),
            |k| k == home,
            |frozen| {
                assert!(!frozen[home]);
                Ok(())
            },
        )
        .unwrap();
        assert!(!f.dense_dirty("d"));
        assert!(f.dirty_ids("t", &set).is_err());
    }

    #[test]
    fn a_mark_waits_for_writes_under_way() {
        let f = std::sync::Arc::new(Frozen::default());
        let (a, _, set) = two_slots();
        let pass = f.pass_ids("t", &[a], &Routes::default()).unwrap();
        let g = std::sync::Arc::clone(&f);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            g.copy(&set);
            tx.send(set).unwrap();
        });
        // The mark cannot finish while a write admitted before it holds its pass: a copy read
        // after the mark holds that write.
        assert!(rx
            .recv_timeout(std::time::Duration::from_millis(100))
            .is_err());
        drop(pass);
        let set = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        t.join().unwrap();
        f.set(&set, true);
        // The write admitted before the mark is not in the record (the copy holds it).
        assert!(f.dirty_ids("t", &set).unwrap().is_empty());
    }

    #[test]
    fn a_delta_export_gives_rows_held_and_removals_in_pages() {
        use crate::store::StoreConfig;
        let store = Store::new(StoreConfig::default()).unwrap();
        let t = store
            .create_sparse_table(
                "t",
                crate::table::SparseTableConfig {
                    dim: 2,
                    optimizer: Default::default(),
                    initializer: crate::init::Initializer::Zeros,
                    seed: 0,
                    lifecycle: Default::default(),
                    refuse_nonfinite: false,
                },
            )
            .unwrap();
        let f = Frozen::default();
        let all = &Routes::default();
        let every = vec![true; SLOTS];
        let ids: Vec<u64> = (0..10).collect();
        t.push(&ids, &[1.0; 20]).unwrap();
        f.copy(&every);
        drop(f.pass_ids("t", &[1, 2, 3], all).unwrap());
        t.remove(&[3]).unwrap();
        f.set(&every, true);
        let r = ExportSlotsRequest {
            table: "t".into(),
            slots: Some(SlotSet {
                starts: vec![0],
                ends: vec![SLOTS as u32],
            }),
            shard: 0,
            dirty: true,
        };
        let a = export_dirty(&store, &f, &r).unwrap();
        assert_eq!(wire::ids(&a.ids).unwrap(), vec![1, 2]);
        assert_eq!(wire::ids(&a.removed_ids).unwrap(), vec![3]);
        assert_eq!((a.next_shard, a.shards), (3, 3));
        assert_eq!(a.words.len(), 2 * 4 * t.row_words());
        // From a later index on: the rest only.
        let b = export_dirty(
            &store,
            &f,
            &ExportSlotsRequest {
                shard: 2,
                ..r.clone()
            },
        )
        .unwrap();
        assert!(b.ids.is_empty());
        assert_eq!(wire::ids(&b.removed_ids).unwrap(), vec![3]);
    }

    /// A store's budget guard over a [`Frozen`] (the server's holds its `Inner` instead).
    struct Over(std::sync::Arc<Frozen>, Routes);

    impl BudgetGuard for Over {
        fn budget(&self, table: &str, evict: &mut BudgetEvict<'_>) {
            self.0.budget(table, &self.1, evict)
        }
    }

    /// Classes rows by their slot alone.
    struct By(Vec<BudgetRow>);

    impl BudgetGuard for By {
        fn budget(&self, _: &str, evict: &mut BudgetEvict<'_>) {
            evict(&self.0);
        }
    }

    fn budgeted(store: &Store, max_rows: u64) -> std::sync::Arc<crate::SparseTable> {
        let config = crate::table::SparseTableConfig {
            dim: 2,
            optimizer: Default::default(),
            initializer: crate::init::Initializer::Zeros,
            seed: 0,
            lifecycle: crate::table::Lifecycle {
                max_rows: Some(max_rows),
                ..Default::default()
            },
            refuse_nonfinite: false,
        };
        store.create_sparse_table("t", config).unwrap()
    }

    #[test]
    fn a_budget_keeps_frozen_rows_and_records_what_it_evicts_from_copying_slots() {
        use crate::store::StoreConfig;
        let store = Store::new(StoreConfig::default()).unwrap();
        let t = budgeted(&store, 100);
        let f = std::sync::Arc::new(Frozen::default());
        store.set_budget_guard(Some(std::sync::Arc::new(Over(
            std::sync::Arc::clone(&f),
            Routes::default(),
        ))));
        let old: Vec<u64> = (0..100).collect();
        t.push(&old, &[1.0; 200]).unwrap(); // at the budget, one version
                                            // Frozen: the slots of ids 0..30; copying: the other slots of ids 30..60.
        let mut frozen = vec![false; SLOTS];
        let mut copying = vec![false; SLOTS];
        for id in 0..30 {
            frozen[slot_of(id)] = true;
        }
        for id in 30..60 {
            copying[slot_of(id)] = !frozen[slot_of(id)];
        }
        f.set(&frozen, true);
        f.copy(&copying);
        // 20 new rows: down to 99, the 21 oldest (ties by id) among the rows not frozen.
        let new: Vec<u64> = (1000..1020).collect();
        t.push(&new, &[1.0; 40]).unwrap();
        let gone: Vec<u64> = old
            .iter()
            .copied()
            .filter(|&id| !frozen[slot_of(id)])
            .take(21)
            .collect();
        let held = t.contains(&old).unwrap();
        for (&id, &h) in old.iter().zip(&held) {
            assert_eq!(h, !gone.contains(&id), "id {id}");
        }
        assert_eq!(t.len(), 99);
        let mut recorded: Vec<u64> = f.dirty().rows["t"].iter().copied().collect();
        recorded.sort_unstable();
        let want: Vec<u64> = gone
            .iter()
            .copied()
            .filter(|&id| copying[slot_of(id)])
            .collect();
        assert!(!want.is_empty());
        assert_eq!(recorded, want);
        // Only frozen rows left to take: the table stays over its budget until they go.
        f.set(&vec![true; SLOTS], true);
        t.push(&(2000..2050).collect::<Vec<_>>(), &[1.0; 100])
            .unwrap();
        assert_eq!(t.len(), 149);
        f.set(&vec![true; SLOTS], false);
        t.push(&[3000], &[1.0; 2]).unwrap();
        assert_eq!(t.len(), 99);
        assert_eq!(t.stats().rows_evicted, 21 + 51);
    }

    #[test]
    fn a_budget_does_not_count_rows_it_skips() {
        use crate::store::StoreConfig;
        let store = Store::new(StoreConfig::default()).unwrap();
        let t = budgeted(&store, 100);
        // The slots of the first half are another server's (rows copied in before a publish):
        // not counted.
        let by_slot: Vec<BudgetRow> = (0..SLOTS)
            .map(|s| {
                if s < SLOTS / 2 {
                    BudgetRow::Skip
                } else {
                    BudgetRow::Evict
                }
            })
            .collect();
        store.set_budget_guard(Some(std::sync::Arc::new(By(by_slot))));
        let theirs: Vec<u64> = (0..).filter(|&x| slot_of(x) < SLOTS / 2).take(50).collect();
        let ours: Vec<u64> = (0..)
            .filter(|&x| slot_of(x) >= SLOTS / 2)
            .take(102)
            .collect();
        t.push(&theirs, &[1.0; 100]).unwrap();
        t.push(&ours[..100], &[1.0; 200]).unwrap();
        assert_eq!(t.len(), 150);
        t.push(&ours[100..101], &[1.0; 2]).unwrap();
        // 101 counted: down to 99, the two oldest counted rows; none of the skipped.
        assert_eq!(t.len(), 99 + 50);
        assert!(t.contains(&ours[..2]).unwrap().iter().all(|&h| !h));
        assert!(t.contains(&ours[2..101]).unwrap().iter().all(|&h| h));
        assert!(t.contains(&theirs).unwrap().iter().all(|&h| h));
        // Without a guard every row counts and any may go: the skipped ones are the oldest.
        store.set_budget_guard(None);
        t.push(&ours[101..], &[1.0; 2]).unwrap();
        assert_eq!(t.len(), 99);
        assert!(t.contains(&theirs).unwrap().iter().all(|&h| !h));
    }

    #[test]
    fn request_ids_round_trip_and_odd_lengths_are_refused() {
        let ids = vec![(1u64, 2u64), (u64::MAX, 0)];
        assert_eq!(request_ids(&encode_request_ids(&ids)).unwrap(), ids);
        assert!(request_ids(&[0u8; 15]).is_err());
    }
}
