//! Sparse embedding tables: u64 id -> float32 row, created on first touch.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use rayon::prelude::*;

use super::{
    check_finite, group_ids, unix_now, Common, Counters, Disjoint, TableHandle, TableStats, MAX_DIM,
};
use crate::error::{invalid, shape, storage, Result};
use crate::executor::PushHandle;
use crate::init::Initializer;
use crate::optimizer::OptimizerConfig;
use crate::shard::{
    as_f32, as_f32_mut, bump_step, prefetch_lines, row_version, Grouped, Part, Shard, FREQ, HEADER,
    META, NO_SLOT,
};
use crate::storage::{words_into, Db, Storage};

/// Batches smaller than this run on the calling thread: spreading them costs more than it saves.
const PARALLEL_MIN_IDS: usize = 2048;
/// How many rows ahead a push prefetches the row it will update.
const PREFETCH_RUNS: usize = 6;
/// How many gradient rows ahead a push prefetches the one it will add up.
const PREFETCH_GRADS: usize = 8;
/// A shard's part of a push at least this long is checked for distinct rows (which need no sort).
const DISTINCT_MIN: usize = 32;

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

/// How a sparse table is built.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SparseTableConfig {
    /// Row width, 1..=4096.
    pub dim: usize,
    /// The optimizer applied by pushes.
    pub optimizer: OptimizerConfig,
    /// The value of a row before its first update, a function of (seed, id).
    pub initializer: Initializer,
    /// The seed of the initialiser.
    pub seed: u64,
    /// Admission and eviction.
    #[serde(default)]
    pub lifecycle: Lifecycle,
}

/// Which rows a `max_rows` budget evicts first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictPolicy {
    /// Least recently updated first.
    #[default]
    Lru,
    /// Least frequently pushed first (then least recently updated).
    Lfu,
}

/// What recommender id spaces need: admission of ids seen often enough, and a row budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Lifecycle {
    /// An id gets a row once it has been pushed this many times (0 and 1: at once). Until then
    /// pulls return its initial value without storing a row, and pushes only count it.
    pub admit_after: u32,
    /// The most rows the table keeps; past it, the policy evicts down to 99% of the budget.
    pub max_rows: Option<u64>,
    /// Which rows the budget evicts first.
    pub policy: EvictPolicy,
}

impl SparseTableConfig {
    /// The values the rows of `ids` have before their first update, row after row: a function
    /// of (seed, id) alone, the same on every store and server.
    pub fn initial_rows(&self, ids: &[u64]) -> Vec<f32> {
        let mut rows = vec![0.0; ids.len() * self.dim];
        for (row, &id) in rows.chunks_exact_mut(self.dim).zip(ids) {
            self.initializer.fill(self.seed, id, row);
        }
        rows
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.dim > MAX_DIM {
            return Err(invalid(format!(
                "dim must be in 1..={MAX_DIM}, got {}",
                self.dim
            )));
        }
        if self.lifecycle.max_rows == Some(0) {
            return Err(invalid("max_rows must be >= 1"));
        }
        self.optimizer.validate()?;
        self.initializer.validate()
    }
}

/// The LMDB replica behind a table of a durable store.
pub(crate) struct Backing {
    pub(crate) storage: Weak<Storage>,
    /// Rows in the replica that are not in memory yet (loaded on first touch).
    pub(crate) unloaded: AtomicU64,
}

impl Backing {
    fn storage(&self) -> Result<Arc<Storage>> {
        self.storage
            .upgrade()
            .ok_or_else(|| storage("the store is closed"))
    }
}

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

/// Buffers of earlier flushes, for the next ones to take: a flush copies every changed row out
/// of the shards, and fresh buffers for that would cost a page fault and a zeroed page for every
/// 4 KiB copied, each cycle. At most [`Spare::KEEP`] bytes are kept.
#[derive(Default)]
pub(crate) struct Spare(Mutex<Vec<(Vec<u64>, Vec<u32>)>>);

impl Spare {
    /// The most bytes of buffers kept between flushes (a single transaction's worth).
    const KEEP: usize = crate::durable::ONE_TXN_BYTES;

    /// Empty buffers, reused if any are kept.
    fn take(&self) -> (Vec<u64>, Vec<u32>) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        v.pop().unwrap_or_default()
    }

    /// Keeps the buffers of `t` for later flushes, up to [`Spare::KEEP`] bytes in all.
    pub(crate) fn give_back(&self, t: Taken) {
        let (mut ids, mut words) = (t.ids, t.words);
        ids.clear();
        words.clear();
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = v
            .iter()
            .map(|(i, w)| i.capacity() * 8 + w.capacity() * 4)
            .sum();
        if held + ids.capacity() * 8 + words.capacity() * 4 <= Self::KEEP {
            v.push((ids, words));
        }
    }
}

/// A shard's lock and fields on cache lines of their own: the lock word of one shard, written by
/// every reader, must not share a line with the next shard's fields another thread reads.
#[repr(align(128))]
struct Padded<T>(T);

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

/// Adds `row` to `acc` in float64 (a push sums the gradients of one id this way); with `first`,
/// `acc` is the sum so far of nothing (its contents are ignored). Where the CPU has AVX (checked
/// once per call) the conversions and additions run 4 lanes wide instead of 2.
#[inline]
fn add_f64(acc: &mut [f64], row: &[f32], first: bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU supports AVX, checked just above.
        return unsafe { add_f64_avx(acc, row, first) };
    }
    add_f64_portable(acc, row, first)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn add_f64_avx(acc: &mut [f64], row: &[f32], first: bool) {
    add_f64_portable(acc, row, first)
}

#[inline(always)]
fn add_f64_portable(acc: &mut [f64], row: &[f32], first: bool) {
    if first {
        // `x + 0.0` is exactly `0.0 + x` (-0.0 becomes +0.0, as in a sum started at zero), without
        // zeroing `acc` and reading it back: most ids of a batch occur once.
        for (a, &x) in acc.iter_mut().zip(row) {
            *a = x as f64 + 0.0;
        }
    } else {
        for (a, &x) in acc.iter_mut().zip(row) {
            *a += x as f64;
        }
    }
}

/// Copies `src` to `dst`: the common widths (16, 32, 64 and 128 floats) with [`copy_fixed`]'s
/// straight-line moves, others in blocks of 16 floats the compiler turns into vector moves and
/// then the remaining floats.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` floats that do not overlap `src`.
#[inline(always)]
unsafe fn copy_floats(src: &[f32], dst: *mut f32) {
    // The common widths get a copy of fixed length: straight-line moves, no loop, no tail.
    // SAFETY (all four): `src.len()` is the width, so `dst` is valid for it (the caller).
    match src.len() {
        16 => return unsafe { copy_fixed::<1>(src, dst) },
        32 => return unsafe { copy_fixed::<2>(src, dst) },
        64 => return unsafe { copy_fixed::<4>(src, dst) },
        128 => return unsafe { copy_fixed::<8>(src, dst) },
        _ => {}
    }
    let (blocks, rest) = src.as_chunks::<16>();
    for (i, b) in blocks.iter().enumerate() {
        // SAFETY: block `i` lies inside the `src.len()` floats the caller vouches for.
        unsafe { dst.add(i * 16).cast::<[f32; 16]>().write_unaligned(*b) };
    }
    let done = blocks.len() * 16;
    // SAFETY: as above, for the floats after the blocks.
    unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), dst.add(done), rest.len()) };
}

/// Copies the `B * 16` floats of `src` (which holds exactly that many) to `dst`.
///
/// # Safety
/// As [`copy_floats`].
#[inline(always)]
unsafe fn copy_fixed<const B: usize>(src: &[f32], dst: *mut f32) {
    debug_assert_eq!(src.len(), B * 16);
    let src = src.as_ptr().cast::<[f32; 16]>();
    let dst = dst.cast::<[f32; 16]>();
    for i in 0..B {
        // SAFETY: block `i < B` lies inside the `B * 16` floats of `src` and of `dst`.
        unsafe { dst.add(i).write_unaligned(src.add(i).read_unaligned()) };
    }
}

/// Copies `src` to `dst` with streaming (non-temporal) stores where it can: whole 16-byte
/// groups to a 16-byte aligned `dst` on x86_64; anything else is copied by [`copy_floats`].
/// A streaming store writes the line without reading it first and leaves it out of the cache:
/// for a pull's output, written at scattered rows and too large to stay cached, that halves the
/// memory traffic. The caller must [`stream_fence`] before anyone else reads `dst`.
///
/// # Safety
/// As [`copy_floats`].
#[inline(always)]
unsafe fn copy_floats_streaming(src: &[f32], dst: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    if src.len().is_multiple_of(4) && (dst as usize).is_multiple_of(16) {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_stream_ps};
        for i in (0..src.len()).step_by(4) {
            // SAFETY: `i + 4 <= src.len()`; `dst + i` is 16-byte aligned (as `dst` is, and `i`
            // counts whole groups) and inside the floats the caller vouches for. SSE is part of
            // x86_64.
            unsafe { _mm_stream_ps(dst.add(i), _mm_loadu_ps(src.as_ptr().add(i))) };
        }
        return;
    }
    // SAFETY: the caller's guarantee.
    unsafe { copy_floats(src, dst) }
}

/// Orders this thread's streaming stores before its later stores (and so before whatever
/// synchronisation follows): without it another thread may read a stale output row.
#[inline(always)]
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a store fence has no preconditions; SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Runs [`stream_fence`] when dropped, if set.
struct Fence(bool);

impl Drop for Fence {
    fn drop(&mut self) {
        if self.0 {
            stream_fence();
        }
    }
}

/// Pull outputs larger than the last-level cache are written with streaming stores (see
/// [`copy_floats_streaming`]); smaller ones are written normally: their lines stay cached (the
/// caller reads them next), and a store into a cached line costs no memory read.
fn stream_min_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| last_level_cache_bytes().unwrap_or(STREAM_MIN_BYTES_UNKNOWN))
}

/// The streaming threshold where the cache size cannot be read: a common server's last level.
const STREAM_MIN_BYTES_UNKNOWN: usize = 32 << 20;

/// The size of the largest cache level that Linux lists for CPU 0.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let path = e.ok()?.path();
        let level: u32 = std::fs::read_to_string(path.join("level"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let size = parse_cache_size(&std::fs::read_to_string(path.join("size")).ok()?)?;
        Some((level, size))
    })
    .max()
    .map(|(_, size)| size)
}

/// A cache size as sysfs writes it: `"2048K"`, `"32M"` or a plain count of bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

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

    /// Rows of the replica not loaded into memory yet (0 without a replica).
    pub fn unloaded(&self) -> u64 {
        self.backing
            .as_ref()
            .map_or(0, |b| b.unloaded.load(Ordering::Acquire))
    }

    fn admit_after(&self) -> u32 {
        self.config.lifecycle.admit_after.max(1)
    }

    /// The replica, when rows may still wait in it.
    fn lazy(&self) -> Option<(&Backing, Arc<Storage>)> {
        let b = self.backing.as_ref()?;
        if b.unloaded.load(Ordering::Acquire) == 0 {
            return None;
        }
        b.storage().ok().map(|s| (b, s))
    }

    /// Loads the replica's rows of `ids` (absent from memory) into the shard; returns, for each,
    /// whether it had one. Ids removed since (`gone`) are not loaded.
    fn fault_in(&self, shard: &mut Shard, ids: &[u64]) -> Result<Vec<bool>> {
        let Some((b, st)) = self.lazy() else {
            return Ok(vec![false; ids.len()]);
        };
        let name = &self.common.name;
        let mut words = Vec::with_capacity(self.row_words());
        st.read(|r| {
            let rows = r.open(Db::Rows, name);
            let mut found = Vec::with_capacity(ids.len());
            for &id in ids {
                if shard.find(id).is_some() {
                    found.push(true);
                    continue;
                }
                if shard.is_gone(id) {
                    found.push(false);
                    continue;
                }
                match r.get_in(rows.as_ref(), name, id)? {
                    Some(v) => {
                        self.replica_row(st.path(), id, v, &mut words)?;
                        shard.put_words(id, &words);
                        b.unloaded.fetch_sub(1, Ordering::AcqRel);
                        found.push(true);
                    }
                    None => found.push(false),
                }
            }
            Ok(found)
        })
    }

    /// The words of a row as the replica at `store` holds them (its payload), into `out`
    /// (cleared first); a payload of the wrong length is a corrupt replica.
    pub(crate) fn replica_row(
        &self,
        store: &std::path::Path,
        id: u64,
        payload: &[u8],
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        words_into(payload, out);
        if out.len() == self.row_words() {
            return Ok(());
        }
        Err(crate::error::corrupt(format!(
            "{}: table {:?} row {id} holds {} words, not {}",
            store.display(),
            self.common.name,
            out.len(),
            self.row_words()
        )))
    }

    /// Loads every row still waiting in the replica (before a whole-table operation).
    pub fn load_all(&self) -> Result<()> {
        let Some((b, st)) = self.lazy() else {
            return Ok(());
        };
        let n = self.shards.len();
        let m = self.row_words();
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
        // No flush may commit during the scan: a row it deletes after the scan read it could
        // otherwise come back.
        st.read_exclusive(|r| {
            r.scan(Db::Rows, &self.common.name, |id, v| {
                let mut w = Vec::with_capacity(m);
                self.replica_row(st.path(), id, v, &mut w)?;
                batch.push((id, w));
                if batch.len() >= 65536 {
                    flush(&mut batch);
                }
                Ok(())
            })
        })?;
        flush(&mut batch);
        b.unloaded.store(0, Ordering::Release);
        Ok(())
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
        let threads = self.common.exec.threads();
        if n >= PARALLEL_MIN_IDS && threads > 1 {
            // A thread that joined its OpenMP team (a torch training thread) runs the shards on
            // that team; any other runs them itself, with the store's helper threads.
            if !crate::openmp::run(shards, threads, &visit) {
                self.common.exec.run_shared(shards, &visit);
            }
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
        self.pull_rows(ids, out, out.len() * 4 > stream_min_bytes())
    }

    /// [`SparseTable::pull_into`], writing the output with streaming stores when `stream`.
    fn pull_rows(&self, ids: &[u64], out: &mut [MaybeUninit<f32>], stream: bool) -> Result<()> {
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
        let created = std::sync::atomic::AtomicU64::new(0);
        let failure: Mutex<Option<crate::Error>> = Mutex::new(None);
        let g = self.group(ids);
        self.for_each_shard(&g, ids.len(), |s, part| {
            let pos = part.positions;
            let copy = |shard: &Shard, slot: u32, p: u32| {
                let row = as_f32(&shard.row(slot)[HEADER..HEADER + dim]);
                let dst = ptr.get().wrapping_add(p as usize * dim);
                // SAFETY: `p < ids.len()`, so the row lies inside `out`'s capacity, and only
                // this task writes row `p` (see `Disjoint`).
                unsafe {
                    if stream {
                        copy_floats_streaming(row, dst)
                    } else {
                        copy_floats(row, dst)
                    }
                };
            };
            // Every return of this task passes here: its streaming stores are ordered first.
            let _fence = Fence(stream);
            let mut missing = Vec::new();
            {
                let shard = self.read(s);
                shard.for_each_found(ids, part, dim, |k, slot| {
                    if slot == NO_SLOT {
                        missing.push(pos[k]);
                    } else {
                        copy(&shard, slot, pos[k]);
                    }
                });
            }
            if missing.is_empty() {
                return;
            }
            let mut shard = self.write(s);
            let missing_ids: Vec<u64> = missing.iter().map(|&p| ids[p as usize]).collect();
            if let Err(e) = self.fault_in(&mut shard, &missing_ids) {
                failure
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
                return;
            }
            let admit_now = self.admit_after() <= 1;
            let (version, now) = (self.seq(), unix_now());
            let mut made = 0;
            for (&p, &id) in missing.iter().zip(&missing_ids) {
                if !admit_now && shard.find(id).is_none() {
                    // Not admitted yet: its initial value, and no row.
                    // SAFETY: as in `copy`.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(ptr.get().add(p as usize * dim), dim)
                    };
                    self.config.initializer.fill(self.config.seed, id, out);
                    continue;
                }
                let (slot, new) = shard.find_or_insert(id, |b| self.init_body(id, b));
                if new {
                    shard.touch(slot, version, now, 0);
                    made += 1;
                }
                copy(&shard, slot, p);
            }
            created.fetch_add(made, std::sync::atomic::Ordering::Relaxed);
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        Counters::add(&self.common.counters.pulls, 1);
        Counters::add(&self.common.counters.ids_pulled, ids.len());
        Counters::add(
            &self.common.counters.rows_created,
            created.into_inner() as usize,
        );
        self.enforce_budget()
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
            if let (Some((_, st)), false) = (&lazy, ask.is_empty()) {
                st.read(|r| {
                    for &p in &ask {
                        out[p as usize] = r
                            .get(Db::Rows, &self.common.name, ids[p as usize])?
                            .is_some();
                    }
                    Ok(())
                })?;
            }
        }
        Ok(out)
    }

    /// Removes the rows of `ids` (and forgets their admission counts); returns how many existed.
    /// Removed ids become tombstones of the next incremental snapshot.
    pub fn remove(&self, ids: &[u64]) -> Result<usize> {
        self.check_live()?;
        let removed = {
            let _changing = self.changing();
            self.remove_rows(ids)?
        };
        self.common.durable_wait()?;
        Ok(removed)
    }

    fn remove_rows(&self, ids: &[u64]) -> Result<usize> {
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
        self.check_live()?;
        self.load_all()?;
        let changing = self.changing();
        let mut evicted = 0;
        for s in 0..self.shards.len() {
            let mut shard = self.write(s);
            let old: Vec<u64> = shard
                .iter()
                .filter(|&(_, slot)| {
                    let row = shard.row(slot);
                    before_seq.is_some_and(|v| row_version(row) < v)
                        || before_secs.is_some_and(|t| row[crate::shard::UPDATED_AT] < t)
                })
                .map(|(id, _)| id)
                .collect();
            for id in old {
                evicted += shard.remove(id) as usize;
            }
        }
        drop(changing);
        Counters::add(&self.common.counters.rows_evicted, evicted);
        self.common.durable_wait()?;
        Ok(evicted)
    }

    /// Keeps the table within `max_rows`: past it, evicts by the policy down to 99% of it.
    fn enforce_budget(&self) -> Result<()> {
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
        let len = self.len() as u64;
        if len <= max {
            return Ok(());
        }
        let target = max - max / 100;
        let excess = (len - target) as usize;
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
        let mut scores: Vec<(u64, u64, u64)> = Vec::with_capacity(len as usize);
        for s in 0..self.shards.len() {
            let shard = self.read(s);
            scores.extend(shard.iter().map(|(id, slot)| score(id, shard.row(slot))));
        }
        if excess == 0 || scores.is_empty() {
            return Ok(());
        }
        let k = excess.min(scores.len()) - 1;
        let (_, &mut cut, _) = scores.select_nth_unstable(k);
        let _changing = self.changing();
        let mut evicted = 0;
        for s in 0..self.shards.len() {
            let mut shard = self.write(s);
            let victims: Vec<u64> = shard
                .iter()
                .filter(|&(id, slot)| score(id, shard.row(slot)) <= cut)
                .map(|(id, _)| id)
                .collect();
            for id in victims {
                evicted += shard.remove(id) as usize;
            }
        }
        Counters::add(&self.common.counters.rows_evicted, evicted);
        Ok(())
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
        super::check_scale(lr_scale)?;
        self.common.durable_check()?;
        if self.common.exec.pending() > 0 {
            return self.queue(ids.to_vec(), grads.to_vec(), lr_scale)?.wait();
        }
        self.apply(ids, grads, lr_scale)?;
        self.common.durable_wait()
    }

    /// Queues a push and returns at once; the inputs are moved into the queue. Errors of the
    /// inputs are reported here, before anything is queued.
    pub fn push_async(self: &Arc<Self>, ids: Vec<u64>, grads: Vec<f32>) -> Result<PushHandle> {
        self.validate_push(&ids, &grads)?;
        self.queue(ids, grads, 1.0)
    }

    fn queue(
        self: &Arc<Self>,
        ids: Vec<u64>,
        grads: Vec<f32>,
        lr_scale: f64,
    ) -> Result<PushHandle> {
        let bytes = ids.len() * 8 + grads.len() * 4;
        let me = Arc::clone(self);
        self.common.exec.submit(
            bytes,
            Box::new(move || {
                me.apply(&ids, &grads, lr_scale)?;
                me.common.durable_wait()
            }),
        )
    }

    /// Loads the replica rows of the batch's ids that are not in memory, before anything is
    /// applied, so a failing read leaves every row as it was.
    fn fault_in_batch(&self, ids: &[u64], g: &Grouped) -> Result<()> {
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

    /// Creates the rows of the shard's missing ids that are admitted now; returns the slot of
    /// every position (`NO_SLOT` for an id still waiting for admission).
    #[allow(clippy::too_many_arguments)]
    fn admit(
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

    /// Applies a validated push.
    fn apply(&self, ids: &[u64], grads: &[f32], lr_scale: f64) -> Result<()> {
        let dim = self.config.dim;
        let opt = self.config.optimizer;
        let lr = self.lr() * lr_scale;
        let updated = std::sync::atomic::AtomicU64::new(0);
        let created = std::sync::atomic::AtomicU64::new(0);
        let g = self.group(ids);
        self.fault_in_batch(ids, &g)?;
        let changing = self.changing();
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
            // The optimizer step of one row from its summed gradient `acc`, `hits` ids counted.
            let update = |shard: &mut Shard, slot: u32, acc: &mut [f64], hits: u32| {
                let row = shard.row_mut(slot);
                let step = bump_step(row);
                let (w, state) = as_f32_mut(&mut row[HEADER..]).split_at_mut(dim);
                opt.apply(lr, step, w, state, acc);
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
        });
        let c = &self.common.counters;
        Counters::add(&c.pushes, 1);
        Counters::add(&c.ids_pushed, ids.len());
        Counters::add(&c.rows_updated, updated.into_inner() as usize);
        Counters::add(&c.rows_created, created.into_inner() as usize);
        drop(changing);
        self.enforce_budget()
    }

    /// Takes what changed in shard `s` since the last take, for a flush; `gen` is the
    /// flusher's log generation (see [`Taken::log`]).
    pub(crate) fn take_shard(&self, s: usize, gen: u32, spare: &Spare) -> Taken {
        let m = self.row_words();
        let (mut ids, mut words) = spare.take();
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
    fn changing(&self) -> Option<RwLockReadGuard<'_, ()>> {
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
    pub(crate) fn take_all(&self, gen: u32, spare: &Spare) -> Vec<Taken> {
        let n = self.shards.len();
        if self.common.exec.threads() > 1 && n > 1 {
            self.common.exec.install(|| {
                (0..n)
                    .into_par_iter()
                    .map(|s| self.take_shard(s, gen, spare))
                    .collect()
            })
        } else {
            (0..n).map(|s| self.take_shard(s, gen, spare)).collect()
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

    /// Makes room for `rows` rows in all (a bulk load sized in advance).
    pub fn reserve(&self, rows: usize) {
        let per = rows.div_ceil(self.shards.len()) + rows.div_ceil(self.shards.len()) / 16 + 16;
        for s in 0..self.shards.len() {
            self.write(s).reserve(per);
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

    /// The table's counters and sizes.
    pub fn stats(&self) -> TableStats {
        let (mut rows, mut bytes) = (0u64, 0u64);
        for s in 0..self.shards.len() {
            let shard = self.read(s);
            rows += shard.len() as u64;
            bytes += shard.bytes() as u64;
        }
        let c = &self.common.counters;
        rows += self.unloaded();
        TableStats {
            rows,
            bytes_used: bytes,
            pushes: Counters::get(&c.pushes),
            pulls: Counters::get(&c.pulls),
            ids_pushed: Counters::get(&c.ids_pushed),
            ids_pulled: Counters::get(&c.ids_pulled),
            rows_updated: Counters::get(&c.rows_updated),
            rows_created: Counters::get(&c.rows_created),
            rows_evicted: Counters::get(&c.rows_evicted),
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

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("2048K\n"), Some(2 << 20));
        assert_eq!(parse_cache_size("266240K"), Some(260 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("65536"), Some(65536));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size("12Q"), None);
        assert!(
            stream_min_bytes() >= 1 << 20,
            "a cache size is read or assumed"
        );
    }

    #[test]
    fn streamed_and_cached_pulls_write_the_same_rows() {
        // The same pulls with and without streaming stores, for a width that streams whole
        // (64), one that does not (63) and a narrow one, with new ids (created by the pull),
        // pushed ones and duplicates.
        let store = crate::store::Store::new(crate::store::StoreConfig {
            threads: 2,
            ..Default::default()
        })
        .unwrap();
        for dim in [64usize, 63, 16] {
            let config = SparseTableConfig {
                dim,
                optimizer: Default::default(),
                initializer: Initializer::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
                seed: 3,
                lifecycle: Default::default(),
            };
            let t = store
                .create_sparse_table(&format!("t{dim}"), config)
                .unwrap();
            let ids: Vec<u64> = (0..20_000u64).map(|i| (i * 7919) % 15_000).collect();
            let grads: Vec<f32> = (0..5_000 * dim).map(|i| (i % 13) as f32 - 6.0).collect();
            t.push(&ids[..5_000], &grads).unwrap();
            let pull = |stream: bool| {
                let mut out: Vec<f32> = Vec::with_capacity(ids.len() * dim);
                t.pull_rows(
                    &ids,
                    &mut out.spare_capacity_mut()[..ids.len() * dim],
                    stream,
                )
                .unwrap();
                // SAFETY: `pull_rows` returned Ok, so it wrote every element.
                unsafe { out.set_len(ids.len() * dim) };
                out
            };
            let streamed = pull(true);
            let cached = pull(false);
            assert_eq!(streamed, cached, "dim {dim}");
            for (k, &id) in ids.iter().enumerate().step_by(997) {
                let one = t.pull(&[id]).unwrap();
                assert_eq!(
                    &streamed[k * dim..(k + 1) * dim],
                    &one[..],
                    "dim {dim}, id {id}"
                );
            }
        }
    }

    #[test]
    fn row_copies_write_exactly_the_row() {
        // Every width, the fixed-length ones (16, 32, 64, 128) among them, and both copies:
        // the row lands where it should and the floats around it are left alone.
        for len in 1..=136usize {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            for streaming in [false, true] {
                // 16-byte aligned destination (as a streaming copy wants), 4 guard floats each side.
                let mut buf = vec![[f32::NAN; 4]; len.div_ceil(4) + 2];
                let floats = buf.as_mut_ptr().cast::<f32>();
                // SAFETY: the buffer holds 4 * (len.div_ceil(4) + 2) >= len + 8 floats, and `dst`
                // leaves 4 before and at least 4 after the row.
                let all = unsafe {
                    let dst = floats.add(4);
                    if streaming {
                        copy_floats_streaming(&src, dst);
                        stream_fence();
                    } else {
                        copy_floats(&src, dst);
                    }
                    std::slice::from_raw_parts(floats, len + 8)
                };
                assert_eq!(
                    &all[4..4 + len],
                    &src[..],
                    "len {len}, streaming {streaming}"
                );
                assert!(
                    all[..4].iter().all(|x| x.is_nan()),
                    "len {len}: before the row"
                );
                assert!(
                    all[4 + len..].iter().all(|x| x.is_nan()),
                    "len {len}: after the row"
                );
            }
        }
    }

    #[test]
    fn float64_sums_are_the_same_with_and_without_avx() {
        // Converting to float64 and adding are exact IEEE operations: every width gives the
        // same bits, the portable loop's as well as the dispatched one's (AVX where present).
        // A sum started with `first` equals one started at +0.0, -0.0 included.
        for dim in [1usize, 3, 4, 16, 63, 64, 4096] {
            let mut rows: Vec<Vec<f32>> = (0..5u64)
                .map(|r| {
                    (0..dim as u64)
                        .map(|i| {
                            let bits = crate::hash::mix64(r * 10_007 + i) as u32;
                            f32::from_bits(bits & 0xbfff_ffff) // finite: never all exponent bits
                        })
                        .collect()
                })
                .collect();
            rows[0][0] = -0.0;
            for start in [Some(0.5f64), None] {
                let filled = vec![start.unwrap_or(f64::NAN); dim];
                let (mut a, mut b) = (filled.clone(), filled);
                for (k, row) in rows.iter().enumerate() {
                    let first = k == 0 && start.is_none();
                    add_f64(&mut a, row, first);
                    add_f64_portable(&mut b, row, first);
                }
                let expect: Vec<u64> = (0..dim)
                    .map(|i| {
                        let s0 = start.unwrap_or(0.0);
                        rows.iter().fold(s0, |s, row| s + row[i] as f64).to_bits()
                    })
                    .collect();
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), expect, "dim {dim}, start {start:?}");
                assert_eq!(bits(&b), expect, "dim {dim}, start {start:?}");
            }
            if dim == 1 {
                // One -0.0 gradient sums to +0.0, as from zero.
                let mut a = vec![f64::NAN];
                add_f64(&mut a, &[-0.0], true);
                assert_eq!(a[0].to_bits(), 0.0f64.to_bits());
            }
        }
    }
}
