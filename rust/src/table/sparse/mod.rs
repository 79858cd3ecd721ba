//! Sparse embedding tables: u64 id -> float32 row, created on first touch.
//!
//! The table and its row operations (pull, push) are here; `lifecycle` admits and evicts rows,
//! `changes` hands changed rows to whoever keeps them (a flusher, a snapshot), `lazy` loads rows
//! kept outside memory, `kernels` holds the inner loops.

mod changes;
mod config;
mod kernels;
mod lazy;
mod lifecycle;
mod once;

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) use changes::Taken;
pub use config::{EvictPolicy, Lifecycle, SparseTableConfig};
use kernels::{add_f64, copy_fixed, copy_floats, copy_floats_streaming, stream_min_bytes, Fence};
pub(crate) use lazy::Backing;
pub use lazy::RowSource;

use super::{
    check_finite, group_ids, unix_now, Common, Counters, Disjoint, TableHandle, TableStats,
};
use crate::error::{shape, Result};
use crate::executor::PushHandle;
use crate::shard::{
    as_f32, as_f32_mut, bump_step, prefetch_lines, Grouped, Part, Shard, HEADER, META, NO_SLOT,
};

/// Batches smaller than this run on the calling thread: spreading them costs more than it saves.
const PARALLEL_MIN_IDS: usize = 2048;
/// How many rows ahead a push prefetches the row it will update.
const PREFETCH_RUNS: usize = 6;
/// How many gradient rows ahead a push prefetches the one it will add up.
const PREFETCH_GRADS: usize = 8;
/// A pull of at least this many ids per shard reads its batch in order across all the shards
/// (see `pull_in_order`); a smaller one is grouped by shard first.
const IN_ORDER_MIN_PER_SHARD: usize = 8;
/// Ranges an in-order pull is cut into per thread of the pool.
const RANGES_PER_THREAD: usize = 4;
/// The fewest ids of a range of an in-order pull.
const MIN_RANGE: usize = 512;
/// A shard's part of a push at least this long is checked for distinct rows (which need no sort).
const DISTINCT_MIN: usize = 32;

/// One range of an in-order pull (see `SparseTable::pull_in_order`): `ids` are the batch's ids
/// from position `base` on, read from `shards`, their rows written to `out` (`dim` floats a row).
#[derive(Clone, Copy)]
struct Range<'s, 'a> {
    shards: &'s [&'a Shard],
    ids: &'s [u64],
    base: usize,
    dim: usize,
    out: Disjoint<f32>,
}

/// Copies each found row's weights of range `r` to its place in the output, and adds the
/// positions of the ids without a row to `miss`.
///
/// The visit is compiled once for each common width, so that the copy is a fixed run of moves
/// and the width no load, and, where the CPU has AVX2, with 32-byte moves.
fn visit_in_order(r: Range<'_, '_>, miss: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { visit_in_order_avx2(r, miss) };
    }
    visit_widths(r, miss)
}

/// [`visit_in_order`] compiled with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn visit_in_order_avx2(r: Range<'_, '_>, miss: &mut Vec<u32>) {
    visit_widths(r, miss)
}

/// [`visit_in_order`] with the target features of its caller: the visit of `r.dim`'s width.
#[inline(always)]
fn visit_widths(r: Range<'_, '_>, miss: &mut Vec<u32>) {
    match r.dim {
        16 => visit_width::<16>(r, miss),
        32 => visit_width::<32>(r, miss),
        64 => visit_width::<64>(r, miss),
        128 => visit_width::<128>(r, miss),
        _ => visit_width::<0>(r, miss),
    }
}

/// [`visit_widths`] for rows of `D` weights when `D` is not 0 (a multiple of 16, known when
/// compiled), of `r.dim` when it is.
#[inline(always)]
fn visit_width<const D: usize>(r: Range<'_, '_>, miss: &mut Vec<u32>) {
    let dim = if D == 0 { r.dim } else { D };
    Shard::for_each_found_across(r.shards, r.ids, dim, |k, row| match row {
        None => miss.push((r.base + k) as u32),
        Some(row) => {
            let w = as_f32(&row[HEADER..HEADER + dim]);
            let dst = r.out.get().wrapping_add((r.base + k) * dim);
            // SAFETY: `base + k` is a position of the batch, so the row lies inside the output,
            // and only this task writes it (see `Disjoint`); `w` holds `dim` floats, `D` of them
            // when `D` is not 0.
            unsafe {
                if D == 0 {
                    copy_floats(w, dst)
                } else {
                    copy_fixed::<D>(w, dst)
                }
            };
        }
    })
}

/// True when no slot but `NO_SLOT` occurs twice in `slots` (all below `end`).
fn distinct_slots(slots: &[u32], end: u32) -> bool {
    let mut seen = vec![0u64; (end as usize).div_ceil(64)];
    for &s in slots {
        if s == NO_SLOT {
            continue;
        }
        let (w, bit) = ((s >> 6) as usize, 1u64 << (s & 63));
        if seen[w] & bit != 0 {
            return false;
        }
        seen[w] |= bit;
    }
    true
}

/// What the shard tasks of one pull that fill missing rows report: rows created, and the first
/// failure (the other shards still go on).
#[derive(Default)]
struct Filling {
    created: AtomicU64,
    failure: Mutex<Option<crate::Error>>,
}

impl Filling {
    /// [`SparseTable::fill_missing`] of shard `s`'s positions `missing`, under its write lock.
    #[allow(clippy::too_many_arguments)]
    fn shard(
        &self,
        t: &SparseTable,
        s: usize,
        ids: &[u64],
        missing: &[u32],
        out: Disjoint<f32>,
        stream: bool,
        create: bool,
    ) {
        let mut shard = t.write(s);
        match t.fill_missing(&mut shard, ids, missing, out, stream, create) {
            Ok(made) => {
                self.created.fetch_add(made, Ordering::Relaxed);
            }
            Err(e) => {
                self.failure
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
            }
        }
    }

    /// The rows created, or the first failure.
    fn result(self) -> Result<u64> {
        match self.failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(self.created.into_inner()),
        }
    }
}

/// Copies the weights of the row at `slot` to row `p` of the output at `out` (`dim` floats a row),
/// with streaming stores when `stream`.
///
/// # Safety
/// Row `p` must lie inside the output, and no other thread may access it meanwhile.
#[inline]
unsafe fn copy_row(
    shard: &Shard,
    slot: u32,
    out: Disjoint<f32>,
    p: usize,
    dim: usize,
    stream: bool,
) {
    let row = as_f32(&shard.row(slot)[HEADER..HEADER + dim]);
    let dst = out.get().wrapping_add(p * dim);
    // SAFETY: the caller's promise.
    unsafe {
        if stream {
            copy_floats_streaming(row, dst)
        } else {
            copy_floats(row, dst)
        }
    }
}

/// A shard's lock and fields on cache lines of their own: the lock word of one shard, written by
/// every reader, must not share a line with the next shard's fields another thread reads.
#[repr(align(128))]
struct Padded<T>(T);

/// A sharded sparse table. Every method takes `&self`; each shard has its own lock, held once per
/// batch, so pulls and pushes from many threads proceed in parallel.
pub struct SparseTable {
    common: Common,
    config: SparseTableConfig,
    state_len: usize,
    shards: Vec<Padded<RwLock<Shard>>>,
    /// Where the next batch starts its sweep over the shards.
    sweep: AtomicUsize,
    /// The update sequence number: pushes applied over the table's life (a row's version).
    seq: AtomicU64,
    /// Per shard, how often each not yet admitted id has been pushed.
    candidates: Vec<Mutex<HashMap<u64, u32>>>,
    /// Set while a thread enforces `max_rows`.
    evicting: Mutex<()>,
    /// Held by a push of a table that refuses non-finite weights (see `apply`).
    refusing: Mutex<()>,
    /// Held shared by every change of rows, alone by a flush taking them (see `hold_changes`).
    changes: RwLock<()>,
    backing: Option<Backing>,
}

impl SparseTable {
    /// A new empty table; `config` must be valid.
    pub(crate) fn new(
        common: Common,
        config: SparseTableConfig,
        num_shards: usize,
        backing: Option<Backing>,
    ) -> Result<Self> {
        config.validate()?;
        let state_len = config.optimizer.state_len(config.dim);
        let stride = HEADER + config.dim + state_len;
        let track = backing.is_some();
        Ok(Self {
            common,
            sweep: AtomicUsize::new(0),
            config,
            state_len,
            shards: (0..num_shards.max(1))
                .map(|_| {
                    let mut s = Shard::new(stride);
                    s.set_tracking(track);
                    Padded(RwLock::new(s))
                })
                .collect(),
            seq: AtomicU64::new(0),
            candidates: (0..num_shards.max(1)).map(|_| Mutex::default()).collect(),
            evicting: Mutex::new(()),
            refusing: Mutex::new(()),
            changes: RwLock::new(()),
            backing,
        })
    }

    /// Words of a row after its id: metadata, weights and state.
    pub fn row_words(&self) -> usize {
        META + self.config.dim + self.state_len
    }

    /// Floats of optimizer state per row.
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// The update sequence number (pushes applied over the table's life).
    pub fn seq(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    pub(crate) fn set_seq(&self, seq: u64) {
        self.seq.store(seq, Ordering::Relaxed);
    }

    /// The table's configuration (with the optimizer's initial learning rate).
    pub fn config(&self) -> &SparseTableConfig {
        &self.config
    }

    /// Row width.
    pub fn dim(&self) -> usize {
        self.config.dim
    }

    /// Number of shards.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    fn read(&self, s: usize) -> RwLockReadGuard<'_, Shard> {
        // Shard mutations leave the shard consistent at every point a panic could occur, so a
        // poisoned lock still guards valid data.
        self.shards[s].0.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Every shard's read lock, in shard order, if no writer holds any of them now (std's lock
    /// also refuses a shard that a writer waits for); `None`, holding nothing, as soon as one
    /// is refused. It never waits, so it takes part in no cycle of waits.
    fn try_read_all(&self) -> Option<Vec<RwLockReadGuard<'_, Shard>>> {
        let mut guards = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            match s.0.try_read() {
                Ok(g) => guards.push(g),
                Err(std::sync::TryLockError::Poisoned(e)) => guards.push(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        }
        Some(guards)
    }

    fn write(&self, s: usize) -> RwLockWriteGuard<'_, Shard> {
        self.shards[s].0.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows stored (in memory, plus those of the replica not loaded yet).
    pub fn len(&self) -> usize {
        (0..self.shards.len())
            .map(|s| self.read(s).len())
            .sum::<usize>()
            + self.unloaded() as usize
    }

    /// True when no row is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values the rows of `ids` have before their first update, row after row. Creates
    /// nothing.
    pub fn initial_rows(&self, ids: &[u64]) -> Vec<f32> {
        self.config.initial_rows(ids)
    }

    fn init_body(&self, id: u64, body: &mut [u32]) {
        let (w, state) = as_f32_mut(body).split_at_mut(self.config.dim);
        self.config.initializer.fill(self.config.seed, id, w);
        self.config.optimizer.init_state(state);
    }

    fn group(&self, ids: &[u64]) -> Grouped {
        group_ids(&self.common.exec, ids, self.shards.len())
    }

    /// Runs `f` for every non-empty shard of the batch, in parallel when the batch is large.
    fn for_each_shard(&self, g: &Grouped, n: usize, f: impl Fn(usize, Part<'_>) + Sync + Send) {
        let shards = self.shards.len();
        // Each batch starts its sweep at another shard, so that concurrent batches do not walk
        // the shards in lockstep, one waiting behind the other at every shard.
        let start = self.sweep.fetch_add(1, Ordering::Relaxed) % shards;
        let visit = |i: usize| {
            let s = (start + i) % shards;
            let part = g.part(s);
            if !part.positions.is_empty() {
                f(s, part);
            }
        };
        self.run_tasks(shards, n, &visit);
    }

    /// Runs `f(0..tasks)`: over the pool when the batch (`n` ids) is large and the store has
    /// more than one thread, else on the calling thread.
    fn run_tasks(&self, tasks: usize, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let threads = self.common.exec.threads();
        if n >= PARALLEL_MIN_IDS && threads > 1 {
            // A thread that joined its OpenMP team (a torch training thread) runs the tasks on
            // that team; any other runs them itself, with the store's helper threads.
            if !crate::openmp::run(tasks, threads, f) {
                self.common.exec.run_shared(tasks, f);
            }
        } else {
            (0..tasks).for_each(f);
        }
    }

    /// The rows of `ids`, as `ids.len() * dim` floats. Missing rows are created.
    pub fn pull(&self, ids: &[u64]) -> Result<Vec<f32>> {
        let n = ids.len() * self.config.dim;
        let mut out: Vec<f32> = Vec::with_capacity(n);
        self.pull_into(ids, &mut out.spare_capacity_mut()[..n])?;
        // SAFETY: `pull_into` returned Ok, so it wrote all `n` elements.
        unsafe { out.set_len(n) };
        Ok(out)
    }

    /// Writes the rows of `ids` into `out` (`ids.len() * dim` floats, row after row), creating
    /// missing rows. On success every element of `out` has been written.
    pub fn pull_into(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<()> {
        self.pull_rows(ids, out, out.len() * 4 > stream_min_bytes(), true)
    }

    /// Writes the rows of `ids` into `out` as [`SparseTable::pull_into`] does, except that an id
    /// with no row reads as its initial value and nothing is created or admitted: rows, their
    /// metadata, `seq` and `rows_created` stay as they were (only the `pulls` and `ids_pulled`
    /// traffic counters count the call). What a read-only principal of a server gets.
    pub fn pull_existing_into(&self, ids: &[u64], out: &mut [MaybeUninit<f32>]) -> Result<()> {
        self.pull_rows(ids, out, out.len() * 4 > stream_min_bytes(), false)
    }

    /// [`SparseTable::pull_existing_into`] into a new vector.
    pub fn pull_existing(&self, ids: &[u64]) -> Result<Vec<f32>> {
        let n = ids.len() * self.config.dim;
        let mut out: Vec<f32> = Vec::with_capacity(n);
        self.pull_existing_into(ids, &mut out.spare_capacity_mut()[..n])?;
        // SAFETY: `pull_existing_into` returned Ok, so it wrote all `n` elements.
        unsafe { out.set_len(n) };
        Ok(out)
    }

    /// [`SparseTable::pull_into`], writing the output with streaming stores when `stream`, and
    /// creating missing rows only when `create`.
    fn pull_rows(
        &self,
        ids: &[u64],
        out: &mut [MaybeUninit<f32>],
        stream: bool,
        create: bool,
    ) -> Result<()> {
        self.check_live()?;
        let dim = self.config.dim;
        if out.len() != ids.len() * dim {
            return Err(shape(format!(
                "table {:?}: the output holds {} values, not len(ids) x dim = {}",
                self.common.name,
                out.len(),
                ids.len() * dim
            )));
        }
        let ptr = Disjoint(out.as_mut_ptr().cast::<f32>());
        // A large batch is read in order when every shard can be read-locked at once without
        // waiting: a pull that held them all while a push waited would stall the push for the
        // whole batch (decision 0135). Otherwise it is grouped, a shard at a time.
        let in_order = if ids.len() >= IN_ORDER_MIN_PER_SHARD * self.shards.len() {
            self.try_read_all()
        } else {
            None
        };
        let created = match in_order {
            // Rows written out in order: plain stores (see `pull_in_order`).
            Some(guards) => self.pull_in_order(guards, ids, ptr, create)?,
            None => self.pull_grouped(ids, ptr, stream, create)?,
        };
        Counters::add(&self.common.counters.pulls, 1);
        Counters::add(&self.common.counters.ids_pulled, ids.len());
        Counters::add(&self.common.counters.rows_created, created as usize);
        self.enforce_budget()
    }

    /// The pull of a large batch: every shard read-locked once (`guards`, from
    /// [`SparseTable::try_read_all`]) for the whole batch, and the batch read in its own order
    /// across the shards (no grouping pass), split into consecutive ranges over the pool. The
    /// locks are released before the ids without a row are handled per shard, as
    /// [`SparseTable::pull_grouped`] does (under each shard's write lock). Returns the rows
    /// created.
    ///
    /// The output is written with plain stores, whatever its size: written in order, it ran
    /// 1.1x to 1.4x faster than with streaming stores (decision 0121), which pay where the
    /// grouped pull scatters its rows over an output larger than the cache.
    fn pull_in_order(
        &self,
        guards: Vec<RwLockReadGuard<'_, Shard>>,
        ids: &[u64],
        out: Disjoint<f32>,
        create: bool,
    ) -> Result<u64> {
        let (dim, count, n) = (self.config.dim, self.shards.len(), ids.len());
        let mut missing = {
            let shards: Vec<&Shard> = guards.iter().map(|g| &**g).collect();
            let threads = self.common.exec.threads();
            // Several ranges a thread, so that a helper that joins late still finds work.
            let per = if n >= PARALLEL_MIN_IDS && threads > 1 {
                n.div_ceil(threads * RANGES_PER_THREAD).max(MIN_RANGE)
            } else {
                n
            };
            let tasks = n.div_ceil(per);
            let missing: Mutex<Vec<u32>> = Mutex::new(Vec::new());
            let visit = |t: usize| {
                let (a, b) = ((t * per).min(n), ((t + 1) * per).min(n));
                let mut miss = Vec::new();
                let range = Range {
                    shards: &shards,
                    ids: &ids[a..b],
                    base: a,
                    dim,
                    out,
                };
                visit_in_order(range, &mut miss);
                if !miss.is_empty() {
                    missing
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .extend(miss);
                }
            };
            self.run_tasks(tasks, n, &visit);
            drop(shards);
            drop(guards); // before `fill` takes write locks
            missing.into_inner().unwrap_or_else(|e| e.into_inner())
        };
        if missing.is_empty() {
            return Ok(0);
        }
        // In batch order within each shard, as the grouped pull creates them.
        missing.sort_unstable();
        let mut of_shard: Vec<Vec<u32>> = vec![Vec::new(); count];
        for &p in &missing {
            of_shard[crate::hash::shard_of(ids[p as usize], count)].push(p);
        }
        // Shard after shard, in parallel when many (a reopened store's first pull loads its
        // rows from the replica here).
        let fill = Filling::default();
        self.run_tasks(count, missing.len(), &|s| {
            if !of_shard[s].is_empty() {
                fill.shard(self, s, ids, &of_shard[s], out, false, create);
            }
        });
        fill.result()
    }

    /// The pull of a small batch: grouped by shard, each shard's part read under its lock (in
    /// parallel over the pool for a batch of [`PARALLEL_MIN_IDS`] or more). Returns the rows
    /// created.
    fn pull_grouped(
        &self,
        ids: &[u64],
        out: Disjoint<f32>,
        stream: bool,
        create: bool,
    ) -> Result<u64> {
        let dim = self.config.dim;
        let fill = Filling::default();
        let g = self.group(ids);
        self.for_each_shard(&g, ids.len(), |s, part| {
            let pos = part.positions;
            // Every return of this task passes here: its streaming stores are ordered first.
            let _fence = Fence(stream);
            let mut missing = Vec::new();
            {
                let shard = self.read(s);
                shard.for_each_found(ids, part, dim, |k, slot| {
                    if slot == NO_SLOT {
                        missing.push(pos[k]);
                    } else {
                        // SAFETY: `pos[k] < ids.len()`, and only this task writes its rows.
                        unsafe { copy_row(&shard, slot, out, pos[k] as usize, dim, stream) };
                    }
                });
            }
            if !missing.is_empty() {
                fill.shard(self, s, ids, &missing, out, stream, create);
            }
        });
        fill.result()
    }

    /// Writes the rows of the ids at `missing` (positions of one shard's ids that had no row in
    /// memory, under that shard's write lock): rows loaded from the replica, rows created when
    /// `create` and admitted, and otherwise the initial value without a row. Returns the rows
    /// created.
    fn fill_missing(
        &self,
        shard: &mut Shard,
        ids: &[u64],
        missing: &[u32],
        out: Disjoint<f32>,
        stream: bool,
        create: bool,
    ) -> Result<u64> {
        let dim = self.config.dim;
        let missing_ids: Vec<u64> = missing.iter().map(|&p| ids[p as usize]).collect();
        self.fault_in(shard, &missing_ids)?;
        // A pull that must not create reads a row loaded from the replica above (it exists),
        // and the initial value of any other.
        let admit_now = create && self.admit_after() <= 1;
        let (version, now) = (self.seq(), unix_now());
        let mut made = 0;
        for (&p, &id) in missing.iter().zip(&missing_ids) {
            if !admit_now && shard.find(id).is_none() {
                // Not admitted yet (or not to be created): its initial value, and no row.
                // SAFETY: `p < ids.len()`, and only this caller writes row `p`.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(out.get().add(p as usize * dim), dim) };
                self.config.initializer.fill(self.config.seed, id, row);
                continue;
            }
            let (slot, new) = shard.find_or_insert(id, |b| self.init_body(id, b));
            if new {
                shard.touch(slot, version, now, 0);
                made += 1;
            }
            // SAFETY: as above.
            unsafe { copy_row(shard, slot, out, p as usize, dim, stream) };
        }
        Ok(made)
    }

    /// Which of `ids` have a row. Creates nothing.
    pub fn contains(&self, ids: &[u64]) -> Result<Vec<bool>> {
        self.check_live()?;
        let mut out = vec![false; ids.len()];
        let g = self.group(ids);
        let lazy = self.lazy();
        for s in 0..self.shards.len() {
            let pos = g.of(s);
            if pos.is_empty() {
                continue;
            }
            let shard = self.read(s);
            let mut ask = Vec::new();
            for &p in pos {
                let id = ids[p as usize];
                out[p as usize] = shard.find(id).is_some();
                if !out[p as usize] && lazy.is_some() && !shard.is_gone(id) {
                    ask.push(p);
                }
            }
            if let (Some((_, src)), false) = (&lazy, ask.is_empty()) {
                let asked: Vec<u64> = ask.iter().map(|&p| ids[p as usize]).collect();
                src.has_rows(&self.common.name, &asked, &mut |j, held| {
                    out[ask[j] as usize] = held;
                })?;
            }
        }
        Ok(out)
    }

    /// Checks a push without applying anything.
    pub fn validate_push(&self, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.check_live()?;
        let dim = self.config.dim;
        if grads.len() != ids.len() * dim {
            return Err(shape(format!(
                "table {:?}: grads must hold len(ids) x dim = {} x {} values, got {}",
                self.common.name,
                ids.len(),
                dim,
                grads.len()
            )));
        }
        check_finite(&self.common.exec, &self.common.name, grads, dim)?;
        self.common.durable_check()
    }

    /// Applies the gradients `grads` (`ids.len() * dim` floats, row per id) with the table's
    /// optimizer. Duplicate ids are summed and updated once. Returns once the update is visible to
    /// every later pull (and, in a `sync` durable store, committed to disk); if asynchronous
    /// pushes are in flight, it queues behind them so pushes from one thread apply in order. On
    /// an error of the inputs nothing is applied.
    pub fn push(self: &Arc<Self>, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.push_scaled(ids, grads, 1.0)
    }

    /// [`push`](Self::push) with the learning rate multiplied by `lr_scale` for this push only
    /// (a store server scales stale gradients this way).
    pub fn push_scaled(self: &Arc<Self>, ids: &[u64], grads: &[f32], lr_scale: f64) -> Result<()> {
        self.validate_push(ids, grads)?;
        self.push_validated(ids, grads, lr_scale)
    }

    /// [`push_scaled`](Self::push_scaled) of inputs that [`validate_push`](Self::validate_push)
    /// accepted already (a store server checks a push before it looks at its request id), so
    /// the gradients are not scanned twice.
    pub(crate) fn push_validated(
        self: &Arc<Self>,
        ids: &[u64],
        grads: &[f32],
        lr_scale: f64,
    ) -> Result<()> {
        self.push_validated_as(ids, grads, lr_scale, None)
    }

    /// [`push_validated`](Self::push_validated) of the write request `rid` (client, seq), which
    /// is recorded with the rows it changed (see `once.rs`).
    pub(crate) fn push_validated_as(
        self: &Arc<Self>,
        ids: &[u64],
        grads: &[f32],
        lr_scale: f64,
        rid: Option<(u64, u64)>,
    ) -> Result<()> {
        super::check_scale(lr_scale)?;
        let pending = self.common.exec.pending() > 0;
        if ids.is_empty() && !pending {
            // Nothing to apply: not a push (no count, no sequence number, no commit to wait for).
            return Ok(());
        }
        self.common.durable_check()?;
        if pending {
            return self
                .queue(ids.to_vec(), grads.to_vec(), lr_scale, rid)?
                .wait();
        }
        let epoch = self.apply(ids, grads, lr_scale, rid)?;
        self.common.durable_wait_push(epoch)
    }

    /// Queues a push and returns at once; the inputs are moved into the queue. Errors of the
    /// inputs are reported here, before anything is queued.
    pub fn push_async(self: &Arc<Self>, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle> {
        self.validate_push(&ids, &grads)?;
        self.queue(ids, grads, 1.0, None)
    }

    fn queue(
        self: &Arc<Self>,
        ids: Vec<u64>,
        grads: Vec<f32>,
        lr_scale: f64,
        rid: Option<(u64, u64)>,
    ) -> Result<PushHandle> {
        let bytes = ids.len() * 8 + grads.len() * 4;
        let me = Arc::clone(self);
        self.common.exec.submit(
            bytes,
            Box::new(move || {
                let epoch = me.apply(&ids, &grads, lr_scale, rid)?;
                me.common.durable_wait_push(epoch)
            }),
        )
    }

    /// Applies a validated push; returns the revert epoch it was applied in (see
    /// [`Common::durable_wait_push`]).
    fn apply(
        &self,
        ids: &[u64],
        grads: &[f32],
        lr_scale: f64,
        rid: Option<(u64, u64)>,
    ) -> Result<u64> {
        if ids.is_empty() {
            // Not a push: nothing counted, no sequence number taken.
            return Ok(self.common.revert_epoch());
        }
        let dim = self.config.dim;
        let opt = self.config.optimizer;
        let lr = self.lr() * lr_scale;
        let updated = std::sync::atomic::AtomicU64::new(0);
        let created = std::sync::atomic::AtomicU64::new(0);
        // Rows the update left with a non-finite weight, and (when the table refuses them) the
        // rows as they were before, to put back.
        let nonfinite = std::sync::atomic::AtomicU64::new(0);
        let refuse = self.config.refuse_nonfinite;
        let before: Mutex<Vec<(usize, Vec<u32>)>> = Mutex::new(Vec::new());
        // A push that may have to be undone runs alone among the table's pushes, so that no
        // other push changes its rows before they are put back.
        let _alone = refuse.then(|| self.refusing.lock().unwrap_or_else(|e| e.into_inner()));
        let g = self.group(ids);
        self.fault_in_batch(ids, &g)?;
        let changing = self.changing();
        let epoch = self.common.revert_epoch();
        let version = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let now = unix_now();
        self.for_each_shard(&g, ids.len(), |s, part| {
            let pos = part.positions;
            let mut shard = self.write(s);
            let mut slots = Vec::new();
            shard.find_many(ids, part, 0, &mut slots);
            let made = self.admit(s, &mut shard, ids, pos, &mut slots, version, now);
            let stride = HEADER + dim + self.state_len;
            let mut acc = vec![0f64; dim];
            let mut saved: Vec<u32> = Vec::new();
            let mut bad = 0u64;
            // The optimizer step of one row from its summed gradient `acc`, `hits` ids counted.
            let mut update = |shard: &mut Shard, slot: u32, acc: &mut [f64], hits: u32| {
                if refuse {
                    saved.extend_from_slice(shard.row(slot));
                }
                let row = shard.row_mut(slot);
                let step = bump_step(row);
                let (w, state) = as_f32_mut(&mut row[HEADER..]).split_at_mut(dim);
                bad += u64::from(!opt.apply(lr, step, w, state, acc));
                shard.touch(slot, version, now, hits);
            };
            let mut runs = 0u64;
            if pos.len() >= DISTINCT_MIN && distinct_slots(&slots, shard.slot_end()) {
                // Every row once (the batch's ids are distinct here, as pstore.torch pushes
                // them): the rows in the batch's order, with nothing to sum and so no sort.
                for (k, (&p, &slot)) in pos.iter().zip(&slots).enumerate() {
                    if slot == NO_SLOT {
                        continue;
                    }
                    if let Some(&ahead) = slots.get(k + PREFETCH_RUNS) {
                        if ahead != NO_SLOT {
                            shard.prefetch_row(ahead, stride);
                        }
                    }
                    let p = p as usize;
                    add_f64(&mut acc, &grads[p * dim..(p + 1) * dim], true);
                    update(&mut shard, slot, &mut acc, 1);
                    runs += 1;
                }
            } else {
                let mut pairs: Vec<u64> = pos
                    .iter()
                    .zip(&slots)
                    .filter(|&(_, &slot)| slot != NO_SLOT)
                    .map(|(&p, &slot)| ((slot as u64) << 32) | p as u64)
                    .collect();
                pairs.sort_unstable();
                let runs_at: Vec<usize> = (0..pairs.len())
                    .filter(|&i| i == 0 || pairs[i] >> 32 != pairs[i - 1] >> 32)
                    .collect();
                let mut q = 0; // index in `pairs` of the current pair
                for (r, run) in pairs.chunk_by(|a, b| a >> 32 == b >> 32).enumerate() {
                    let slot = (run[0] >> 32) as u32;
                    if let Some(&ahead) = runs_at.get(r + PREFETCH_RUNS) {
                        // Rows are visited at random: start loading the row a few runs ahead.
                        shard.prefetch_row((pairs[ahead] >> 32) as u32, stride);
                    }
                    for (k, &pair) in run.iter().enumerate() {
                        // Gradient rows too (a hot id's run reads many, from all over the batch).
                        if let Some(&later) = pairs.get(q + PREFETCH_GRADS) {
                            let p = (later & 0xffff_ffff) as usize;
                            prefetch_lines(&grads[p * dim..(p + 1) * dim]);
                        }
                        q += 1;
                        let p = (pair & 0xffff_ffff) as usize;
                        add_f64(&mut acc, &grads[p * dim..(p + 1) * dim], k == 0);
                    }
                    let hits = run.len().min(u32::MAX as usize) as u32;
                    update(&mut shard, slot, &mut acc, hits);
                    runs += 1;
                }
            }
            updated.fetch_add(runs, std::sync::atomic::Ordering::Relaxed);
            created.fetch_add(made, std::sync::atomic::Ordering::Relaxed);
            if bad > 0 {
                nonfinite.fetch_add(bad, std::sync::atomic::Ordering::Relaxed);
            }
            if refuse && !saved.is_empty() {
                before
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((s, saved));
            }
        });
        let nonfinite = nonfinite.into_inner();
        Counters::add(&self.common.counters.rows_nonfinite, nonfinite as usize);
        if refuse && nonfinite > 0 {
            let first = self.put_back(before.into_inner().unwrap_or_else(|e| e.into_inner()));
            return Err(crate::error::Error::NonFinite(format!(
                "table {:?}: the push would leave {nonfinite} row(s) with a non-finite weight \
                 (first id {first}); nothing was applied (the table refuses non-finite weights: \
                 lower the learning rate or clip the gradients)",
                self.common.name
            )));
        }
        let c = &self.common.counters;
        Counters::add(&c.pushes, 1);
        Counters::add(&c.ids_pushed, ids.len());
        Counters::add(&c.rows_updated, updated.into_inner() as usize);
        Counters::add(&c.rows_created, created.into_inner() as usize);
        if let Some((client, seq)) = rid {
            // Under the same hold as the rows: a flush takes both or neither.
            self.note_applied(client, seq);
        }
        drop(changing);
        self.enforce_budget()?;
        Ok(epoch)
    }

    /// Puts back rows as a refused push found them (whole rows, header included, by shard);
    /// returns the smallest id among them.
    fn put_back(&self, before: Vec<(usize, Vec<u32>)>) -> u64 {
        let stride = HEADER + self.config.dim + self.state_len;
        let mut first = u64::MAX;
        for (s, rows) in before {
            let mut shard = self.write(s);
            for row in rows.chunks_exact(stride) {
                let id = row[0] as u64 | ((row[1] as u64) << 32);
                first = first.min(id);
                if let Some(slot) = shard.find(id) {
                    shard.row_mut(slot).copy_from_slice(row);
                }
            }
        }
        first
    }

    /// Makes room for `rows` rows in all (a bulk load sized in advance).
    pub fn reserve(&self, rows: usize) {
        let per = rows.div_ceil(self.shards.len()) + rows.div_ceil(self.shards.len()) / 16 + 16;
        for s in 0..self.shards.len() {
            self.write(s).reserve(per);
        }
    }

    /// The table's counters and sizes.
    pub fn stats(&self) -> TableStats {
        let (mut rows, mut bytes, mut huge) = (0u64, 0u64, 0u64);
        for s in 0..self.shards.len() {
            let shard = self.read(s);
            rows += shard.len() as u64;
            bytes += shard.bytes() as u64;
            huge += shard.huge_page_bytes() as u64;
        }
        let c = &self.common.counters;
        rows += self.unloaded();
        TableStats {
            rows,
            bytes_used: bytes,
            huge_page_bytes: huge,
            pushes: Counters::get(&c.pushes),
            pulls: Counters::get(&c.pulls),
            ids_pushed: Counters::get(&c.ids_pushed),
            ids_pulled: Counters::get(&c.ids_pulled),
            rows_updated: Counters::get(&c.rows_updated),
            rows_created: Counters::get(&c.rows_created),
            rows_evicted: Counters::get(&c.rows_evicted),
            rows_nonfinite: Counters::get(&c.rows_nonfinite),
            seq: self.seq(),
            rows_unloaded: self.unloaded(),
            lr: self.lr(),
        }
    }
}

impl TableHandle for SparseTable {
    fn common(&self) -> &Common {
        &self.common
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::Initializer;

    /// A table of `dim` floats, SGD, rows drawn from N(0, 1) with `seed`.
    fn normal_config(dim: usize, seed: u64) -> SparseTableConfig {
        SparseTableConfig {
            dim,
            optimizer: Default::default(),
            initializer: Initializer::Normal {
                mean: 0.0,
                std: 1.0,
            },
            seed,
            lifecycle: Default::default(),
            refuse_nonfinite: false,
        }
    }

    #[test]
    fn pull_existing_creates_nothing() {
        // Unknown ids read as their initial value; known ids as their row; the table keeps its
        // rows, bytes, seq and rows_created. A creating pull then gives the same values.
        let exec = crate::executor::Executor::new(2, 1 << 20).unwrap();
        let config = normal_config(8, 5);
        let common = Common::new("t".to_string(), config.optimizer.lr, Arc::clone(&exec));
        let t = Arc::new(SparseTable::new(common, config, 16, None).unwrap());
        t.push(&[1, 2], &[0.5; 16]).unwrap();
        let before = t.stats();
        let ids: Vec<u64> = (0..5_000u64).collect();
        let got = t.pull_existing(&ids).unwrap();
        let after = t.stats();
        assert_eq!(
            (after.rows, after.bytes_used, after.seq, after.rows_created),
            (
                before.rows,
                before.bytes_used,
                before.seq,
                before.rows_created
            )
        );
        assert_eq!(after.pulls, before.pulls + 1);
        assert_eq!(&got[8..24], &t.pull(&[1, 2]).unwrap()[..]);
        assert_eq!(&got[24..32], &t.initial_rows(&[3])[..]);
        assert_eq!(t.len(), 2);
        assert_eq!(got, t.pull(&ids).unwrap());
        assert_eq!(t.len(), 5_000);
    }

    #[test]
    fn a_large_pull_holds_no_shard_while_it_waits_for_one_being_written() {
        // With every shard free, a large pull reads them all at once (in order); with a shard
        // write-locked it must not hold the others while it waits for that one, or a push to
        // any shard would wait for the whole pull (decision 0135).
        let exec = crate::executor::Executor::new(1, 1 << 20).unwrap();
        let config = normal_config(8, 5);
        let common = Common::new("t".to_string(), config.optimizer.lr, Arc::clone(&exec));
        let t = Arc::new(SparseTable::new(common, config, 16, None).unwrap());
        let ids: Vec<u64> = (0..4_096u64).collect();
        let want = t.pull(&ids).unwrap();
        {
            let _reader = t.read(3);
            assert_eq!(t.try_read_all().map(|g| g.len()), Some(16));
        }
        let writer = t.write(5);
        assert!(t.try_read_all().is_none());
        let puller = {
            let (t, ids) = (Arc::clone(&t), ids.clone());
            std::thread::spawn(move || t.pull(&ids).unwrap())
        };
        // Time for the pull to start and reach shard 5.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for s in [0usize, 4, 6, 15] {
            while t.shards[s].0.try_write().is_err() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "shard {s} stayed locked while the pull waited for shard 5"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        assert!(
            !puller.is_finished(),
            "the pull read shard 5 while it was written"
        );
        drop(writer);
        assert_eq!(puller.join().unwrap(), want);
    }

    #[test]
    fn grouped_streamed_grouped_cached_and_in_order_pulls_write_the_same_rows() {
        // The same pulls by the grouped path with and without streaming stores and by the
        // in-order path (split over two threads, and on one), each on a table of its own that
        // the pull itself fills (new ids created, pushed ones read, duplicates), for a width
        // that streams whole (64), one that does not (63), a narrow one, and the other widths
        // the in-order visit is compiled for (32, 128).
        let exec = crate::executor::Executor::new(2, 1 << 20).unwrap();
        let one = crate::executor::Executor::new(1, 1 << 20).unwrap();
        for dim in [64usize, 63, 16, 32, 128] {
            let config = normal_config(dim, 3);
            let ids: Vec<u64> = (0..20_000u64).map(|i| (i * 7919) % 15_000).collect();
            let grads: Vec<f32> = (0..5_000 * dim).map(|i| (i % 13) as f32 - 6.0).collect();
            let pulled = |how: usize| {
                let pool = if how == 3 { &one } else { &exec };
                let common = Common::new(format!("t{dim}"), config.optimizer.lr, Arc::clone(pool));
                let t = Arc::new(SparseTable::new(common, config.clone(), 64, None).unwrap());
                t.push(&ids[..5_000], &grads).unwrap();
                let mut out: Vec<f32> = Vec::with_capacity(ids.len() * dim);
                let ptr = Disjoint(out.as_mut_ptr());
                let made = match how {
                    0 => t.pull_grouped(&ids, ptr, true, true),
                    1 => t.pull_grouped(&ids, ptr, false, true),
                    _ => t.pull_in_order(t.try_read_all().unwrap(), &ids, ptr, true),
                }
                .unwrap();
                // SAFETY: the pull returned Ok, so it wrote every element.
                unsafe { out.set_len(ids.len() * dim) };
                let check: Vec<Vec<f32>> = ids
                    .iter()
                    .step_by(997)
                    .map(|&id| t.pull(&[id]).unwrap())
                    .collect();
                (out, made, t.len(), check)
            };
            let first = pulled(0);
            assert_eq!(first.1 as usize + 5_000, first.2, "dim {dim}: rows created");
            for how in 1..4 {
                let other = pulled(how);
                assert_eq!(first.0, other.0, "dim {dim}, path {how}");
                assert_eq!(
                    (first.1, first.2),
                    (other.1, other.2),
                    "dim {dim}, path {how}"
                );
            }
            for (k, row) in first.3.iter().enumerate() {
                let at = k * 997 * dim;
                assert_eq!(
                    &first.0[at..at + dim],
                    &row[..],
                    "dim {dim}, id {}",
                    ids[k * 997]
                );
            }
        }
    }

    #[test]
    fn the_in_order_visit_copies_the_same_rows_for_every_width_with_and_without_avx2() {
        // `visit_in_order` (AVX2 where the CPU has it, a width of its own for 16/32/64/128)
        // against `visit_widths` called from here (compiled without AVX2) and against the rows
        // one by one: the same bits, the same missing positions, offset by `base`.
        let exec = crate::executor::Executor::new(1, 1 << 20).unwrap();
        for dim in [16usize, 32, 64, 128, 40, 1] {
            let config = normal_config(dim, 5);
            let common = Common::new(format!("v{dim}"), config.optimizer.lr, Arc::clone(&exec));
            let t = SparseTable::new(common, config, 8, None).unwrap();
            let present: Vec<u64> = (0..3_000u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect();
            t.pull(&present).unwrap();
            // Every third id has no row; ids repeat.
            let ids: Vec<u64> = (0..5_000u64)
                .map(|i| {
                    if i % 3 == 0 {
                        u64::MAX - i
                    } else {
                        present[(i * 7 % 3_000) as usize]
                    }
                })
                .collect();
            let guards: Vec<_> = (0..t.shards.len()).map(|s| t.read(s)).collect();
            let shards: Vec<&Shard> = guards.iter().map(|g| &**g).collect();
            let base = 17;
            let visit = |plain: bool| {
                let mut out = vec![f32::NAN; (base + ids.len()) * dim];
                let mut miss = Vec::new();
                let range = Range {
                    shards: &shards,
                    ids: &ids,
                    base,
                    dim,
                    out: Disjoint(out.as_mut_ptr()),
                };
                if plain {
                    visit_widths(range, &mut miss);
                } else {
                    visit_in_order(range, &mut miss);
                }
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                (bits, miss)
            };
            let (fast, plain) = (visit(false), visit(true));
            assert_eq!(fast, plain, "dim {dim}");
            let want_miss: Vec<u32> = (0..ids.len())
                .filter(|i| i % 3 == 0)
                .map(|i| (base + i) as u32)
                .collect();
            assert_eq!(fast.1, want_miss, "dim {dim}");
            drop(guards);
            for (k, &id) in ids
                .iter()
                .enumerate()
                .filter(|(k, _)| k % 3 != 0)
                .step_by(97)
            {
                let row = t.pull(&[id]).unwrap();
                let at = (base + k) * dim;
                let got: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                assert_eq!(&fast.0[at..at + dim], &got[..], "dim {dim}, position {k}");
            }
        }
    }
}
