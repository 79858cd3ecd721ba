//! The tables: sparse embedding tables (u64 id -> row) and dense tensors.

mod applied;
mod dense;
mod sparse;

pub use applied::{applied_key, Applied, AppliedIds};
pub use dense::{DenseTable, DenseTableConfig};
pub(crate) use sparse::{Backing, Taken};
pub use sparse::{EvictPolicy, Lifecycle, RowSource, SparseTable, SparseTableConfig};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::error::{Error, Result};
use crate::executor::Executor;
use crate::shard::Grouped;

/// The largest row width of a sparse table.
pub const MAX_DIM: usize = 4096;

/// Counters and sizes of a table, as `table.stats()` reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct TableStats {
    /// Rows stored (sparse) or 1 (dense).
    pub rows: u64,
    /// Bytes held by rows, state and index.
    pub bytes_used: u64,
    /// The part of `bytes_used` in ranges the kernel accepted `MADV_HUGEPAGE` for (Linux with
    /// transparent huge pages): a sparse table's full row chunks and large indexes.
    pub huge_page_bytes: u64,
    /// Push calls applied.
    pub pushes: u64,
    /// Pull calls answered.
    pub pulls: u64,
    /// Ids in applied pushes, duplicates included.
    pub ids_pushed: u64,
    /// Ids in answered pulls, duplicates included.
    pub ids_pulled: u64,
    /// Optimizer applications: one per unique id per push.
    pub rows_updated: u64,
    /// Rows created by first touch.
    pub rows_created: u64,
    /// Rows removed by eviction (by age or by the `max_rows` budget).
    pub rows_evicted: u64,
    /// Updates that left a row (or a dense tensor) with a NaN or infinite weight, refused ones
    /// included: finite gradients can still overflow a weight.
    pub rows_nonfinite: u64,
    /// The update sequence number: pushes applied over the table's life.
    pub seq: u64,
    /// Rows of the LMDB replica not loaded into memory yet (included in `rows`).
    pub rows_unloaded: u64,
    /// Learning rate in force.
    pub lr: f64,
}

/// Checks a per-push learning-rate factor.
pub(crate) fn check_scale(lr_scale: f64) -> Result<()> {
    if lr_scale.is_finite() && lr_scale > 0.0 && lr_scale <= 1.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "lr_scale must be in (0, 1], got {lr_scale}"
        )))
    }
}

/// A learning rate that can be changed while pushes run.
#[derive(Debug)]
pub struct Lr(AtomicU64);

impl Lr {
    pub(crate) fn new(lr: f64) -> Self {
        Self(AtomicU64::new(lr.to_bits()))
    }
    pub(crate) fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
    pub(crate) fn set(&self, lr: f64) -> Result<()> {
        crate::optimizer::validate_lr(lr)?;
        self.0.store(lr.to_bits(), Ordering::Relaxed);
        Ok(())
    }
}

/// A table of either kind.
#[derive(Clone)]
pub enum Table {
    /// A sparse embedding table.
    Sparse(Arc<SparseTable>),
    /// A dense tensor.
    Dense(Arc<DenseTable>),
}

impl Table {
    /// The table as its shared handle.
    pub fn handle(&self) -> &dyn TableHandle {
        match self {
            Table::Sparse(t) => t.as_ref(),
            Table::Dense(t) => t.as_ref(),
        }
    }
}

/// What a table tells the layer that keeps its changes (a durable store's flusher), around
/// every change of its rows. The table defines it; the durable layer implements it.
pub trait ChangeHook: Send + Sync {
    /// Before a change: refuses it while the changes cannot be kept.
    fn before_change(&self) -> Result<()>;
    /// After a change was applied: returns once it is kept as promised (`sync` mode: on disk).
    fn after_change(&self) -> Result<()>;
    /// What a refused push's error adds about what the revert could not undo ("" when it undid
    /// everything).
    fn revert_caveat(&self) -> &'static str {
        ""
    }
}

/// What a table's `max_rows` budget does with a row, as a [`BudgetGuard`] classes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetRow {
    /// Counted against the budget, and evicted when the policy picks it.
    Evict,
    /// Counted, but kept (a row being moved as it is: the budget takes other rows).
    Keep,
    /// Neither counted nor evicted (a row of a slot this server does not own).
    Skip,
}

/// Classes the rows a table's `max_rows` budget may evict, for the layer that serves the store
/// (a server moving slots keeps the rows of frozen slots, skips those of slots it does not own,
/// and records those evicted from slots being copied). A store without one evicts any row.
pub trait BudgetGuard: Send + Sync {
    /// Runs `evict` with the class of each slot's rows of `table`; `evict` answers the ids it
    /// evicted.
    fn budget(&self, table: &str, evict: &mut BudgetEvict<'_>);
}

/// The eviction a [`BudgetGuard`] runs: given each hash slot's class (16384 of them, a row's
/// slot as `hash::slot_of` gives it), it evicts and answers the ids it evicted.
pub type BudgetEvict<'a> = dyn FnMut(&[BudgetRow]) -> Vec<u64> + 'a;

/// A store's [`BudgetGuard`], shared by its tables (set while a server serves the store).
pub(crate) type GuardCell = Arc<std::sync::RwLock<Option<Arc<dyn BudgetGuard>>>>;

/// What every table has besides its data: a name, a run-time learning rate, the store's executor,
/// counters, and the mark set when the table is dropped from its store.
pub struct Common {
    pub(crate) name: String,
    pub(crate) lr: Lr,
    pub(crate) exec: Arc<Executor>,
    pub(crate) counters: Counters,
    dropped: AtomicBool,
    /// What keeps the table's changes (the flusher of a durable store).
    pub(crate) durable: Option<Weak<dyn ChangeHook>>,
    /// Tells this table from an earlier one of the same name (snapshot chains, the replica).
    uid: AtomicU64,
    /// The request ids of the writes applied (`applied.rs`).
    pub(crate) applied: Applied,
    /// How often a `sync` store gave back this table's changes after a failed commit (see
    /// [`Common::durable_wait_push`]).
    reverts: AtomicU64,
    /// The store's budget guard, if its server set one.
    pub(crate) guard: GuardCell,
}

impl Common {
    pub(crate) fn new(name: String, lr: f64, exec: Arc<Executor>) -> Self {
        Self {
            name,
            lr: Lr::new(lr),
            exec,
            counters: Counters::default(),
            dropped: AtomicBool::new(false),
            durable: None,
            uid: AtomicU64::new(new_uid()),
            applied: Applied::default(),
            reverts: AtomicU64::new(0),
            guard: GuardCell::default(),
        }
    }

    /// The budget guard the store's server set, if any.
    pub(crate) fn budget_guard(&self) -> Option<Arc<dyn BudgetGuard>> {
        self.guard.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The table's unique id.
    pub fn uid(&self) -> u64 {
        self.uid.load(Ordering::Relaxed)
    }

    /// Takes the unique id of the table this one restores (reopening, restoring).
    pub(crate) fn set_uid(&self, uid: u64) {
        if uid != 0 {
            self.uid.store(uid, Ordering::Relaxed);
        }
    }

    /// Refuses a push while the replica cannot be written (after retrying the write once).
    pub(crate) fn durable_check(&self) -> Result<()> {
        match self.durable.as_ref().and_then(Weak::upgrade) {
            Some(f) => f.before_change(),
            None if self.durable.is_some() => Err(Error::Storage("the store is closed".into())),
            None => Ok(()),
        }
    }

    /// In a `sync` store, waits until what was applied is committed to disk (a change that
    /// stays applied in memory when the commit fails: a removal, eviction, learning rate).
    pub(crate) fn durable_wait(&self) -> Result<()> {
        match self.durable.as_ref().and_then(Weak::upgrade) {
            Some(f) => f.after_change().map_err(|e| {
                Error::Storage(format!(
                    "{e}; the change was applied in memory but is not durable yet (it will be \
                     written once the store can write again)"
                ))
            }),
            None => Ok(()),
        }
    }

    /// The count of reverts so far: read by a push under its change hold (sparse) or value lock
    /// (dense), the hold a revert takes alone.
    pub(crate) fn revert_epoch(&self) -> u64 {
        self.reverts.load(Ordering::Acquire)
    }

    /// Notes that the table went back to its last commit (called under the hold a push reads
    /// [`Common::revert_epoch`] under).
    pub(crate) fn note_reverted(&self) {
        self.reverts.fetch_add(1, Ordering::AcqRel);
    }

    /// After a push applied at revert epoch `epoch`: in a `sync` store, waits until it is
    /// committed. A failed commit in `sync` mode gives back every change since the last
    /// commit, so the push is then undone and the error says nothing was applied (a retry
    /// applies it once); only when that giving back failed too is the push still in memory.
    pub(crate) fn durable_wait_push(&self, epoch: u64) -> Result<()> {
        self.durable_wait_change(epoch, "push")
    }

    /// [`Common::durable_wait_push`] of a change `what` ("push", "bulk load") other than a push.
    pub(crate) fn durable_wait_change(&self, epoch: u64, what: &str) -> Result<()> {
        let Some(f) = self.durable.as_ref().and_then(Weak::upgrade) else {
            return Ok(());
        };
        let r = f.after_change();
        if self.revert_epoch() != epoch {
            let why = match r {
                Err(e) => e.to_string(),
                Ok(()) => "an earlier commit failed".to_string(),
            };
            return Err(Error::Storage(format!(
                "{why}; the {what} was not applied: the table went back to its last commit{} \
                 (retry once the store can write again)",
                f.revert_caveat()
            )));
        }
        r.map_err(|e| {
            Error::Storage(format!(
                "{e}; the {what} was applied in memory but is not durable yet (it will be \
                 written once the store can write again)"
            ))
        })
    }

    /// Marks the table as dropped from its store: every later operation fails.
    pub(crate) fn mark_dropped(&self) {
        self.dropped.store(true, Ordering::Release);
    }
}

/// The operations every table shares.
pub trait TableHandle {
    /// The shared part of the table (opaque outside the crate).
    fn common(&self) -> &Common;

    /// The table's name.
    fn name(&self) -> &str {
        &self.common().name
    }

    /// Learning rate in force (`alpha` for FTRL).
    fn lr(&self) -> f64 {
        self.common().lr.get()
    }

    /// Changes the learning rate for every later push (in a `sync` durable store, committed to
    /// disk on return).
    fn set_lr(&self, lr: f64) -> Result<()> {
        self.common().lr.set(lr)?;
        self.common().durable_wait()
    }

    /// Fails once the table has been dropped from its store.
    fn check_live(&self) -> Result<()> {
        if self.common().dropped.load(Ordering::Acquire) {
            Err(Error::UnknownTable(format!(
                "{} (dropped from its store; this handle is no longer usable)",
                self.common().name
            )))
        } else {
            Ok(())
        }
    }
}

/// The counters of a table (see [`TableStats`] for each one's meaning).
#[derive(Debug, Default)]
pub struct Counters {
    /// Push calls applied.
    pub pushes: AtomicU64,
    /// Pull calls answered.
    pub pulls: AtomicU64,
    /// Ids in applied pushes, duplicates included.
    pub ids_pushed: AtomicU64,
    /// Ids in answered pulls, duplicates included.
    pub ids_pulled: AtomicU64,
    /// Optimizer applications: one per unique id per push.
    pub rows_updated: AtomicU64,
    /// Rows created by first touch.
    pub rows_created: AtomicU64,
    /// Rows removed by eviction.
    pub rows_evicted: AtomicU64,
    /// Pushes a store server received for the table, applied or not: its table version, the
    /// clock staleness is counted on (`server/versions.rs`). Kept with the table's record.
    pub received: AtomicU64,
    /// Pushes a store server counted for its cluster: one per push over all servers (the
    /// request without `uncounted`), applied ones only. Kept with the table's record.
    pub counted: AtomicU64,
    /// Updates that left a non-finite weight.
    pub rows_nonfinite: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub(crate) fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// A fresh table id: time, process and a counter, mixed.
fn new_uid() -> u64 {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    crate::hash::mix64(t ^ crate::hash::mix64(n ^ ((std::process::id() as u64) << 32))).max(1)
}

/// The current unix second (0 before 1970, saturating in 2106).
pub(crate) fn unix_now() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs().min(u32::MAX as u64) as u32)
}

/// Inputs at least this long are scanned on the pool, in parallel.
const PARALLEL_SCAN: usize = 1 << 18;

/// Fails with the position of the first NaN or infinity in `grads`, read as rows of `dim`.
pub(crate) fn check_finite(exec: &Executor, table: &str, grads: &[f32], dim: usize) -> Result<()> {
    let ok = if grads.len() >= PARALLEL_SCAN && exec.threads() > 1 {
        let chunks: Vec<&[f32]> = grads.chunks(1 << 16).collect();
        let bad = AtomicBool::new(false);
        exec.run_shared(chunks.len(), &|i| {
            if !bad.load(Ordering::Relaxed) && !all_finite(chunks[i]) {
                bad.store(true, Ordering::Relaxed);
            }
        });
        !bad.into_inner()
    } else {
        all_finite(grads)
    };
    if ok {
        return Ok(());
    }
    check_finite_slice(table, grads, dim)
}

/// Whether every value of `v` is finite.
///
/// A value is NaN or infinite when all its exponent bits are set. Each block of 1024 values is
/// tested without a branch per value (the flags of the values with all exponent bits set are
/// OR-ed together), which the compiler turns into vector code: about four times the speed of
/// testing each value with an early exit. Blocks still stop the scan soon after a bad value.
/// Where the CPU has AVX2 (checked once per call) the same loop runs on 8 lanes instead of 4.
fn all_finite(v: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { all_finite_avx2(v) };
    }
    all_finite_portable(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn all_finite_avx2(v: &[f32]) -> bool {
    all_finite_portable(v)
}

#[inline(always)]
fn all_finite_portable(v: &[f32]) -> bool {
    const EXP: u32 = 0x7f80_0000;
    v.chunks(1024).all(|block| {
        block
            .iter()
            .fold(0u32, |bad, x| bad | u32::from(x.to_bits() & EXP == EXP))
            == 0
    })
}

/// [`check_finite`] on the calling thread.
pub(crate) fn check_finite_slice(table: &str, grads: &[f32], dim: usize) -> Result<()> {
    if all_finite(grads) {
        return Ok(());
    }
    let Some(i) = grads.iter().position(|g| !g.is_finite()) else {
        return Ok(());
    };
    Err(Error::NonFinite(format!(
        "table {table:?}: gradient holds {} at row {}, column {}; nothing was applied",
        grads[i],
        i / dim.max(1),
        i % dim.max(1)
    )))
}

/// A raw pointer into a buffer that parallel tasks write at disjoint positions: the grouping of
/// a batch, a pull's output rows, an increment's copied rows (each position belongs to one task).
pub(crate) struct Disjoint<T>(pub(crate) *mut T);
// SAFETY: every user writes through it only at positions no other task writes, into a buffer
// that outlives the tasks and is read only after they are joined (rayon joins before returning).
unsafe impl<T> Send for Disjoint<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Disjoint<T> {}

impl<T> Clone for Disjoint<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Disjoint<T> {}

impl<T> Disjoint<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    #[inline]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Groups a batch by shard (see [`Grouped`]); a large batch is grouped on the pool: each part of
/// the batch hashes its ids and counts them per shard, then writes its positions into its own
/// ranges, so the result is the same as the sequential grouping.
pub(crate) fn group_ids(exec: &Executor, ids: &[u64], num_shards: usize) -> Grouped {
    let threads = exec.threads();
    if ids.len() < PARALLEL_SCAN / 8 || threads == 1 {
        return Grouped::new(ids, num_shards);
    }
    let chunk = ids.len().div_ceil(2 * threads);
    let chunks: Vec<&[u64]> = ids.chunks(chunk).collect();
    let parts: Vec<(Vec<u64>, Vec<usize>)> = exec.map_shared(chunks.len(), |k| {
        let mixes: Vec<u64> = chunks[k].iter().map(|&id| crate::hash::mix64(id)).collect();
        let mut counts = vec![0usize; num_shards];
        for &m in &mixes {
            counts[crate::hash::shard_of_mix(m, num_shards)] += 1;
        }
        (mixes, counts)
    });
    let mut offsets = vec![0usize; num_shards + 1];
    for s in 0..num_shards {
        offsets[s + 1] = offsets[s] + parts.iter().map(|(_, c)| c[s]).sum::<usize>();
    }
    // Where each part starts writing in each shard's range: after the earlier parts.
    let mut next = offsets[..num_shards].to_vec();
    let starts: Vec<Vec<usize>> = parts
        .iter()
        .map(|(_, counts)| {
            let here = next.clone();
            for (n, c) in next.iter_mut().zip(counts) {
                *n += c;
            }
            here
        })
        .collect();
    let mut positions = vec![0u32; ids.len()];
    let mut grouped = vec![0u64; ids.len()];
    let (out, out_mix) = (
        Disjoint(positions.as_mut_ptr()),
        Disjoint(grouped.as_mut_ptr()),
    );
    exec.run_shared(parts.len(), &|k| {
        let mut at = starts[k].clone();
        let base = k * chunk;
        for (i, &m) in parts[k].0.iter().enumerate() {
            let slot = &mut at[crate::hash::shard_of_mix(m, num_shards)];
            // SAFETY: `*slot` stays inside this part's range of the shard, which no other part
            // writes, and below `ids.len()`.
            unsafe {
                *out.get().add(*slot) = (base + i) as u32;
                *out_mix.get().add(*slot) = m;
            }
            *slot += 1;
        }
    });
    Grouped {
        positions,
        mixes: grouped,
        offsets,
    }
}

/// A table name must be non-empty printable text of at most
/// [`MAX_NAME_BYTES`](crate::error::MAX_NAME_BYTES) bytes.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    use crate::error::{quoted_name, MAX_NAME_BYTES};
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(|c| c.is_control()) {
        return Err(Error::InvalidArgument(format!(
            "table name must be 1 to {MAX_NAME_BYTES} bytes without control characters, got {}",
            quoted_name(name)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_finite_scan_finds_every_non_finite_value() {
        let finite = [
            0.0f32,
            -0.0,
            1.5,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
        ];
        for n in [0usize, 1, 15, 1023, 1024, 1025, 5000] {
            let v: Vec<f32> = (0..n).map(|i| finite[i % finite.len()]).collect();
            assert!(all_finite(&v) && all_finite_portable(&v));
            let signalling = f32::from_bits(0x7f80_0001);
            for bad in [
                f32::NAN,
                -f32::NAN,
                signalling,
                f32::INFINITY,
                f32::NEG_INFINITY,
            ] {
                for at in [0, n / 2, n.saturating_sub(1)] {
                    if at < n {
                        let mut w = v.clone();
                        w[at] = bad;
                        // The dispatched scan (AVX2 where the CPU has it) and the portable one.
                        assert!(!all_finite(&w), "n {n} at {at} {bad}");
                        assert!(!all_finite_portable(&w), "n {n} at {at} {bad}");
                        let e = check_finite_slice("t", &w, 4).unwrap_err().to_string();
                        assert!(
                            e.contains(&format!("row {}, column {}", at / 4, at % 4)),
                            "{e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn parallel_grouping_equals_sequential_grouping() {
        let exec = Executor::new(3, 1 << 20).unwrap();
        for n in [0usize, 5, 100_000, 262_147] {
            let ids: Vec<u64> = (0..n as u64)
                .map(|i| crate::hash::mix64(i) % 50_000)
                .collect();
            for shards in [1usize, 7, 64] {
                let a = group_ids(&exec, &ids, shards);
                let b = Grouped::new(&ids, shards);
                assert_eq!(a.offsets, b.offsets);
                assert_eq!(a.positions, b.positions, "n {n} shards {shards}");
                assert_eq!(a.mixes, b.mixes, "n {n} shards {shards}");
            }
        }
    }
}
