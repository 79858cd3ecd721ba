//! Sparse embedding tables: u64 id -> float32 row, created on first touch.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use rayon::prelude::*;

use super::{check_finite, group_ids, Common, Counters, TableHandle, TableStats, MAX_DIM};
use crate::error::{invalid, shape, Result};
use crate::executor::{Executor, PushHandle};
use crate::init::Initializer;
use crate::optimizer::OptimizerConfig;
use crate::shard::{
    as_f32, as_f32_mut, bump_step, prefetch_lines, Grouped, Shard, HEADER, NO_SLOT,
};

/// Batches smaller than this run on the calling thread: spreading them costs more than it saves.
const PARALLEL_MIN_IDS: usize = 2048;
/// How many rows ahead a push prefetches the row it will update.
const PREFETCH_RUNS: usize = 6;
/// How many gradient rows ahead a push prefetches the one it will add up.
const PREFETCH_GRADS: usize = 8;

/// How a sparse table is built.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseTableConfig {
    /// Row width, 1..=4096.
    pub dim: usize,
    /// The optimizer applied by pushes.
    pub optimizer: OptimizerConfig,
    /// The value of a row before its first update, a function of (seed, id).
    pub initializer: Initializer,
    /// The seed of the initialiser.
    pub seed: u64,
}

impl SparseTableConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.dim > MAX_DIM {
            return Err(invalid(format!(
                "dim must be in 1..={MAX_DIM}, got {}",
                self.dim
            )));
        }
        self.optimizer.validate()?;
        self.initializer.validate()
    }
}

/// A raw pointer to an output buffer that shard tasks write at disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every shard task writes only the rows of the positions grouped into its own shard, and
// each position belongs to exactly one shard, so no two threads write the same element.
unsafe impl Send for OutPtr {}
// SAFETY: as above; the pointer is only used for those disjoint writes.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    #[inline]
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// A sharded sparse table. Every method takes `&self`; each shard has its own lock, held once per
/// batch, so pulls and pushes from many threads proceed in parallel.
pub struct SparseTable {
    common: Common,
    config: SparseTableConfig,
    state_len: usize,
    shards: Vec<RwLock<Shard>>,
    /// Where the next batch starts its sweep over the shards.
    sweep: AtomicUsize,
}

impl SparseTable {
    /// A new empty table; `config` must be valid.
    pub(crate) fn new(
        name: String,
        config: SparseTableConfig,
        num_shards: usize,
        exec: Arc<Executor>,
    ) -> Result<Self> {
        config.validate()?;
        let state_len = config.optimizer.state_len(config.dim);
        let stride = HEADER + config.dim + state_len;
        Ok(Self {
            common: Common::new(name, config.optimizer.lr, exec),
            sweep: AtomicUsize::new(0),
            config,
            state_len,
            shards: (0..num_shards.max(1))
                .map(|_| RwLock::new(Shard::new(stride)))
                .collect(),
        })
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
        self.shards[s].read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, s: usize) -> RwLockWriteGuard<'_, Shard> {
        self.shards[s].write().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        (0..self.shards.len()).map(|s| self.read(s).len()).sum()
    }

    /// True when no row is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values the rows of `ids` have before their first update, row after row. Creates
    /// nothing.
    pub fn initial_rows(&self, ids: &[u64]) -> Vec<f32> {
        let dim = self.config.dim;
        let mut rows = vec![0.0; ids.len() * dim];
        for (row, &id) in rows.chunks_exact_mut(dim).zip(ids) {
            self.config.initializer.fill(self.config.seed, id, row);
        }
        rows
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
    fn for_each_shard(&self, g: &Grouped, n: usize, f: impl Fn(usize, &[u32]) + Sync + Send) {
        let shards = self.shards.len();
        // Each batch starts its sweep at another shard, so that concurrent batches do not walk
        // the shards in lockstep, one waiting behind the other at every shard.
        let start = self.sweep.fetch_add(1, Ordering::Relaxed) % shards;
        let visit = |i: usize| {
            let s = (start + i) % shards;
            let pos = g.of(s);
            if !pos.is_empty() {
                f(s, pos);
            }
        };
        if n >= PARALLEL_MIN_IDS && self.common.exec.threads() > 1 {
            self.common
                .exec
                .install(|| (0..shards).into_par_iter().for_each(visit));
        } else {
            (0..shards).for_each(visit);
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
        let ptr = OutPtr(out.as_mut_ptr().cast::<f32>());
        let created = std::sync::atomic::AtomicU64::new(0);
        let g = self.group(ids);
        self.for_each_shard(&g, ids.len(), |s, pos| {
            let copy = |shard: &Shard, slot: u32, p: u32| {
                let row = as_f32(&shard.row(slot)[HEADER..HEADER + dim]);
                // SAFETY: `p < ids.len()`, so the row lies inside `out`'s capacity, and only
                // this task writes row `p` (see `OutPtr`).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        ptr.get().add(p as usize * dim),
                        dim,
                    )
                };
            };
            let mut missing = Vec::new();
            {
                let shard = self.read(s);
                shard.for_each_found(ids, pos, dim, |k, slot| {
                    if slot == NO_SLOT {
                        missing.push(pos[k]);
                    } else {
                        copy(&shard, slot, pos[k]);
                    }
                });
            }
            if !missing.is_empty() {
                let mut shard = self.write(s);
                let mut made = 0;
                for &p in &missing {
                    let id = ids[p as usize];
                    let (slot, new) = shard.find_or_insert(id, |b| self.init_body(id, b));
                    made += new as u64;
                    copy(&shard, slot, p);
                }
                created.fetch_add(made, std::sync::atomic::Ordering::Relaxed);
            }
        });
        Counters::add(&self.common.counters.pulls, 1);
        Counters::add(&self.common.counters.ids_pulled, ids.len());
        Counters::add(
            &self.common.counters.rows_created,
            created.into_inner() as usize,
        );
        Ok(())
    }

    /// Which of `ids` have a row. Creates nothing.
    pub fn contains(&self, ids: &[u64]) -> Result<Vec<bool>> {
        self.check_live()?;
        let mut out = vec![false; ids.len()];
        let g = self.group(ids);
        for s in 0..self.shards.len() {
            let pos = g.of(s);
            if pos.is_empty() {
                continue;
            }
            let shard = self.read(s);
            for &p in pos {
                out[p as usize] = shard.find(ids[p as usize]).is_some();
            }
        }
        Ok(out)
    }

    /// Removes the rows of `ids`; returns how many existed.
    pub fn remove(&self, ids: &[u64]) -> Result<usize> {
        self.check_live()?;
        let g = self.group(ids);
        let mut removed = 0;
        for s in 0..self.shards.len() {
            let pos = g.of(s);
            if pos.is_empty() {
                continue;
            }
            let mut shard = self.write(s);
            removed += pos
                .iter()
                .filter(|&&p| shard.remove(ids[p as usize]))
                .count();
        }
        Ok(removed)
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
        check_finite(&self.common.exec, &self.common.name, grads, dim)
    }

    /// Applies the gradients `grads` (`ids.len() * dim` floats, row per id) with the table's
    /// optimizer. Duplicate ids are summed and updated once. Returns once the update is visible to
    /// every later pull; if asynchronous pushes are in flight, it queues behind them so pushes from
    /// one thread apply in order. On an error nothing is applied.
    pub fn push(self: &Arc<Self>, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.validate_push(ids, grads)?;
        if self.common.exec.pending() > 0 {
            return self.queue(ids.to_vec(), grads.to_vec())?.wait();
        }
        self.apply(ids, grads);
        Ok(())
    }

    /// Queues a push and returns at once; the inputs are moved into the queue. Errors of the
    /// inputs are reported here, before anything is queued.
    pub fn push_async(self: &Arc<Self>, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle> {
        self.validate_push(&ids, &grads)?;
        self.queue(ids, grads)
    }

    fn queue(self: &Arc<Self>, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle> {
        let bytes = ids.len() * 8 + grads.len() * 4;
        let me = Arc::clone(self);
        self.common.exec.submit(
            bytes,
            Box::new(move || {
                me.apply(&ids, &grads);
                Ok(())
            }),
        )
    }

    /// Applies a validated push.
    fn apply(&self, ids: &[u64], grads: &[f32]) {
        let dim = self.config.dim;
        let opt = self.config.optimizer;
        let lr = self.lr();
        let updated = std::sync::atomic::AtomicU64::new(0);
        let created = std::sync::atomic::AtomicU64::new(0);
        let g = self.group(ids);
        self.for_each_shard(&g, ids.len(), |s, pos| {
            let mut shard = self.write(s);
            let mut made = 0u64;
            let mut slots = Vec::new();
            shard.find_many(ids, pos, 0, &mut slots);
            let mut pairs: Vec<u64> = pos
                .iter()
                .zip(&slots)
                .map(|(&p, &slot)| {
                    let slot = if slot == NO_SLOT {
                        let id = ids[p as usize];
                        let (slot, new) = shard.find_or_insert(id, |b| self.init_body(id, b));
                        made += new as u64;
                        slot
                    } else {
                        slot
                    };
                    ((slot as u64) << 32) | p as u64
                })
                .collect();
            pairs.sort_unstable();
            let runs_at: Vec<usize> = (0..pairs.len())
                .filter(|&i| i == 0 || pairs[i] >> 32 != pairs[i - 1] >> 32)
                .collect();
            let mut acc = vec![0f64; dim];
            let mut runs = 0u64;
            let stride = HEADER + dim + self.state_len;
            let mut q = 0; // index in `pairs` of the current pair
            for (r, run) in pairs.chunk_by(|a, b| a >> 32 == b >> 32).enumerate() {
                let slot = (run[0] >> 32) as u32;
                if let Some(&ahead) = runs_at.get(r + PREFETCH_RUNS) {
                    // Rows are visited at random: start loading the row a few runs ahead.
                    shard.prefetch_row((pairs[ahead] >> 32) as u32, stride);
                }
                acc.fill(0.0);
                for &pair in run {
                    // Gradient rows too (a hot id's run reads many, from all over the batch).
                    if let Some(&later) = pairs.get(q + PREFETCH_GRADS) {
                        let p = (later & 0xffff_ffff) as usize;
                        prefetch_lines(&grads[p * dim..(p + 1) * dim]);
                    }
                    q += 1;
                    let p = (pair & 0xffff_ffff) as usize;
                    for (a, &x) in acc.iter_mut().zip(&grads[p * dim..(p + 1) * dim]) {
                        *a += x as f64;
                    }
                }
                let row = shard.row_mut(slot);
                let step = bump_step(row);
                let (w, state) = as_f32_mut(&mut row[HEADER..]).split_at_mut(dim);
                opt.apply(lr, step, w, state, &mut acc);
                runs += 1;
            }
            updated.fetch_add(runs, std::sync::atomic::Ordering::Relaxed);
            created.fetch_add(made, std::sync::atomic::Ordering::Relaxed);
        });
        let c = &self.common.counters;
        Counters::add(&c.pushes, 1);
        Counters::add(&c.ids_pushed, ids.len());
        Counters::add(&c.rows_updated, updated.into_inner() as usize);
        Counters::add(&c.rows_created, created.into_inner() as usize);
    }

    /// The table's counters and sizes.
    pub fn stats(&self) -> TableStats {
        let (mut rows, mut bytes) = (0u64, 0u64);
        for s in 0..self.shards.len() {
            let shard = self.read(s);
            rows += shard.len() as u64;
            bytes += shard.bytes() as u64;
        }
        let c = &self.common.counters;
        TableStats {
            rows,
            bytes_used: bytes,
            pushes: Counters::get(&c.pushes),
            pulls: Counters::get(&c.pulls),
            ids_pushed: Counters::get(&c.ids_pushed),
            ids_pulled: Counters::get(&c.ids_pulled),
            rows_updated: Counters::get(&c.rows_updated),
            rows_created: Counters::get(&c.rows_created),
            lr: self.lr(),
        }
    }
}

impl TableHandle for SparseTable {
    fn common(&self) -> &Common {
        &self.common
    }
}
