//! Reference kernels for the benchmarks: what the memory system allows for a batch of row
//! positions, with no table logic (no ids, no hashing, no locks, no version or step).
//!
//! [`DenseRows`] holds `n` rows of `words` float32 each in one anonymous mapping, every row on a
//! 64-byte boundary and the mapping on transparent huge pages where the kernel allows
//! (`MADV_HUGEPAGE`). [`DenseRows::gather`] copies the first `dim` words of the rows at the given
//! positions into an output, the *dense-gather limit* every pull figure is set against;
//! [`DenseRows::adagrad`] and [`DenseRows::adam`] are the read-modify-write limits of a push:
//! each position's row holds `dim` weights then the optimizer's state (`dim` accumulators, or
//! `dim` first and `dim` second moments) and gets one step. They run on a persistent
//! [`Executor`] of `threads` threads, kept per thread count: the caller and `threads - 1`
//! helper threads that watch for the next batch, exactly as a table's pull and push run, so the
//! ratio of a table to these kernels measures the table's own work and not a difference in
//! thread hand-offs. With `prefetch` they ask for the row lines a fixed distance ahead.
//!
//! [`DenseRows::index`] adds the least a hashed table needs: an open-addressing index of
//! 16-byte `{id, position}` slots at a load of 0.3 (on huge pages where allowed), and
//! [`DenseRows::lookup`] is the *hashed-lookup limit*: for each id, hash, probe, then copy the
//! row, with the misses overlapped (the slot's line prefetched [`SLOT_AHEAD`] ids ahead, the
//! probe and the row's lines [`AHEAD`] ids ahead of the copy). It is what the gather costs once
//! ids are not positions, with no locks, no row header and the whole id in the slot: a table's
//! design can approach it, not pass it.
//! `benches/workloads.py` (W1, W2) runs them in the same process as the peers.

use std::sync::{Arc, Mutex};

use crate::buffer::Buffer;
use crate::error::{invalid, shape, Result};
use crate::executor::Executor;

/// Positions ahead of the copy whose row lines are prefetched.
const AHEAD: usize = 8;
/// Ids ahead of the copy whose index slot is prefetched (the hashed lookup).
const SLOT_AHEAD: usize = 16;
/// The hashed lookup's index load: ids per slot.
const LOAD: f64 = 0.3;
/// Tasks a gather is cut into per thread, so a helper that joins late still finds work.
const TASKS_PER_THREAD: usize = 4;
/// The fewest positions a gather task copies.
const MIN_TASK: usize = 512;

/// Rows at fixed positions, cache-line aligned, for the reference kernels.
pub struct DenseRows {
    ptr: *mut f32,
    bytes: usize,
    n: usize,
    words: usize,
    stride: usize,
    huge: bool,
    /// The hashed lookup's index, once [`DenseRows::index`] made it.
    index: Option<HashIndex>,
    /// The executors the kernels have run on, one per thread count, started on first use.
    pools: Mutex<Vec<Arc<Executor>>>,
}

/// Open addressing over `slots` slots of two words, `{id, position + 1}` (0: empty), probed
/// linearly from a slot chosen by the high bits of a multiplied hash (no power of two needed).
struct HashIndex {
    words: Buffer<u64>,
    slots: usize,
}

impl HashIndex {
    fn home(&self, id: u64) -> usize {
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((u128::from(h) * self.slots as u128) >> 64) as usize
    }

    /// The position of `id`'s row, probing from `slot`.
    #[inline(always)]
    fn find(&self, id: u64, mut slot: usize) -> Option<u64> {
        loop {
            let (key, at) = (self.words[2 * slot], self.words[2 * slot + 1]);
            if at == 0 {
                return None;
            }
            if key == id {
                return Some(at - 1);
            }
            slot += 1;
            if slot == self.slots {
                slot = 0;
            }
        }
    }

    fn slot_ptr(&self, slot: usize) -> *const f32 {
        self.words[2 * slot..].as_ptr().cast()
    }
}

// SAFETY: the mapping is owned by this value alone; `&self` methods only read it and `&mut self`
// methods are the only writers.
unsafe impl Send for DenseRows {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for DenseRows {}

impl Drop for DenseRows {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `bytes` are exactly the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of x86_64; a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

impl DenseRows {
    /// `n` rows of `words` float32, row `i` starting with `init[i * dim..(i + 1) * dim]` and the
    /// rest of its words set to `fill`.
    pub fn new(n: usize, words: usize, dim: usize, init: &[f32], fill: f32) -> Result<Self> {
        if dim == 0 || dim > words || init.len() != n * dim {
            return Err(shape(format!(
                "{} initial values for {n} rows of dim {dim} in rows of {words} words",
                init.len()
            )));
        }
        let stride = words.div_ceil(16) * 16;
        let bytes = (n * stride * 4).max(4096);
        // SAFETY: an anonymous private mapping; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(invalid(format!(
                "cannot map {bytes} bytes for the reference rows"
            )));
        }
        // SAFETY: advice on the mapping just made; failure only means small pages.
        let huge = unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) } == 0;
        let me = Self {
            ptr: ptr.cast(),
            bytes,
            n,
            words,
            stride,
            huge,
            index: None,
            pools: Mutex::new(Vec::new()),
        };
        for i in 0..n {
            // SAFETY: row `i` lies within the mapping (`i < n`), and nothing else refers to it.
            let row = unsafe { std::slice::from_raw_parts_mut(me.ptr.add(i * stride), words) };
            row[..dim].copy_from_slice(&init[i * dim..(i + 1) * dim]);
            row[dim..].fill(fill);
        }
        Ok(me)
    }

    /// Whether the kernel accepted `MADV_HUGEPAGE` for the rows.
    pub fn huge_pages(&self) -> bool {
        self.huge
    }

    /// The executor of `threads` threads (at least one), started on first use and kept.
    fn pool(&self, threads: usize) -> Result<Arc<Executor>> {
        let threads = threads.max(1);
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pools.iter().find(|p| p.threads() == threads) {
            return Ok(Arc::clone(p));
        }
        let p = Executor::new(threads, 1 << 20)?;
        pools.push(Arc::clone(&p));
        Ok(p)
    }

    /// `values` (in `name`) are `dim` floats for each of `keys` rows, and `dim` fits a row.
    fn check_shape(&self, keys: usize, dim: usize, values: usize, name: &str) -> Result<()> {
        if dim == 0 || dim > self.words || values != keys * dim {
            return Err(shape(format!(
                "{name} holds {values} values for {keys} rows of dim {dim}"
            )));
        }
        Ok(())
    }

    /// Every position is a row.
    fn check_positions(&self, pos: &[u64]) -> Result<()> {
        if let Some(&p) = pos.iter().find(|&&p| p as usize >= self.n) {
            return Err(invalid(format!("position {p} is past the {} rows", self.n)));
        }
        Ok(())
    }

    fn lines(&self, p: u64, words: usize) {
        // SAFETY: only an address is formed (within the mapping: `p < n` was checked).
        let base = unsafe { self.ptr.add(p as usize * self.stride) };
        for l in 0..words.div_ceil(16) {
            // SAFETY: as above; line `l` of the row is within its stride.
            prefetch(unsafe { base.add(l * 16) });
        }
    }

    /// `out[i] = rows[pos[i]][..dim]`, over `threads` threads.
    pub fn gather(
        &self,
        pos: &[u64],
        dim: usize,
        out: &mut [f32],
        threads: usize,
        prefetch: bool,
    ) -> Result<()> {
        self.check_positions(pos)?;
        self.in_tasks(pos, dim, out, threads, &|p, o| {
            for (i, &at) in p.iter().enumerate() {
                if prefetch {
                    if let Some(&ahead) = p.get(i + AHEAD) {
                        self.lines(ahead, dim);
                    }
                }
                // SAFETY: `at < n` (checked); the row's first `dim <= words` words are in the
                // mapping and only read here.
                let row = unsafe {
                    std::slice::from_raw_parts(self.ptr.add(at as usize * self.stride), dim)
                };
                o[i * dim..(i + 1) * dim].copy_from_slice(row);
            }
        })?;
        Ok(())
    }

    /// Runs `f(keys, out_rows)` over `keys` cut into tasks on `threads` threads: each task gets
    /// a run of the keys and the output rows (`dim` floats a key) they fill, its own. Refuses
    /// an `out` that is not `dim` floats a key.
    fn in_tasks(
        &self,
        keys: &[u64],
        dim: usize,
        out: &mut [f32],
        threads: usize,
        f: &(dyn Fn(&[u64], &mut [f32]) + Sync),
    ) -> Result<()> {
        self.check_shape(keys.len(), dim, out.len(), "out")?;
        let pool = self.pool(threads)?;
        let per = keys
            .len()
            .div_ceil(pool.threads() * TASKS_PER_THREAD)
            .max(MIN_TASK);
        let tasks = keys.len().div_ceil(per);
        let out_at = out.as_mut_ptr() as usize;
        pool.run_shared(tasks, &|t| {
            let k = &keys[t * per..((t + 1) * per).min(keys.len())];
            // SAFETY: task `t` alone writes the output rows of keys `t * per ..`, which lie in
            // `out` (its length is `keys.len() * dim`, checked above), and `out` outlives the
            // call.
            let o = unsafe {
                std::slice::from_raw_parts_mut(
                    (out_at as *mut f32).add(t * per * dim),
                    k.len() * dim,
                )
            };
            f(k, o);
        });
        Ok(())
    }

    /// Indexes the rows by id for [`DenseRows::lookup`]: row `i` gets `ids[i]` (one id a row,
    /// all distinct). Returns whether the index is on huge pages.
    pub fn index(&mut self, ids: &[u64]) -> Result<bool> {
        if ids.len() != self.n {
            return Err(shape(format!("{} ids for {} rows", ids.len(), self.n)));
        }
        let slots = ((self.n as f64 / LOAD).ceil() as usize).max(1);
        let mut index = HashIndex {
            words: Buffer::zeroed(2 * slots),
            slots,
        };
        for (i, &id) in ids.iter().enumerate() {
            let mut slot = index.home(id);
            while index.words[2 * slot + 1] != 0 {
                if index.words[2 * slot] == id {
                    return Err(invalid(format!("id {id} is given to two rows")));
                }
                slot = (slot + 1) % slots;
            }
            index.words[2 * slot] = id;
            index.words[2 * slot + 1] = i as u64 + 1;
        }
        let huge = index.words.huge_page_bytes() > 0;
        self.index = Some(index);
        Ok(huge)
    }

    /// `out[i] = rows[row of ids[i]][..dim]`, over `threads` threads, through the index
    /// ([`DenseRows::index`]); an id without a row gets zeros. Returns how many had none.
    /// With `prefetch` the misses overlap: the slot's line is asked for [`SLOT_AHEAD`] ids
    /// ahead, the probe and the row's lines [`AHEAD`] ids ahead of the copy.
    pub fn lookup(
        &self,
        ids: &[u64],
        dim: usize,
        out: &mut [f32],
        threads: usize,
        prefetch: bool,
    ) -> Result<usize> {
        let Some(index) = &self.index else {
            return Err(invalid(
                "the reference rows have no index: call index(ids) first",
            ));
        };
        let missing = std::sync::atomic::AtomicUsize::new(0);
        self.in_tasks(ids, dim, out, threads, &|ids, o| {
            let lost = if prefetch {
                self.lookup_pipelined(index, ids, dim, o)
            } else {
                self.lookup_plain(index, ids, dim, o)
            };
            missing.fetch_add(lost, std::sync::atomic::Ordering::Relaxed);
        })?;
        Ok(missing.into_inner())
    }

    /// Copies row `at` (or zeros for none) into `o`.
    #[inline(always)]
    fn copy_row(&self, at: Option<u64>, o: &mut [f32]) -> usize {
        match at {
            Some(p) => {
                // SAFETY: positions in the index are rows of this mapping (`index` stored
                // `i < n`); the row's first `o.len() <= words` words are only read here.
                let row = unsafe {
                    std::slice::from_raw_parts(self.ptr.add(p as usize * self.stride), o.len())
                };
                o.copy_from_slice(row);
                0
            }
            None => {
                o.fill(0.0);
                1
            }
        }
    }

    fn lookup_plain(&self, index: &HashIndex, ids: &[u64], dim: usize, o: &mut [f32]) -> usize {
        let mut lost = 0;
        for (i, &id) in ids.iter().enumerate() {
            let at = index.find(id, index.home(id));
            lost += self.copy_row(at, &mut o[i * dim..(i + 1) * dim]);
        }
        lost
    }

    /// The rolling pipeline: id `i + SLOT_AHEAD`'s slot line is prefetched, id `i + AHEAD` is
    /// probed and its row's lines prefetched, id `i`'s row is copied.
    fn lookup_pipelined(&self, index: &HashIndex, ids: &[u64], dim: usize, o: &mut [f32]) -> usize {
        const RING: usize = 32;
        const _: () = assert!(SLOT_AHEAD < RING && AHEAD < SLOT_AHEAD);
        let n = ids.len();
        let mut home = [0usize; RING];
        let mut at = [None::<u64>; RING];
        let mut lost = 0;
        for k in 0..(n + SLOT_AHEAD) {
            if k < n {
                let slot = index.home(ids[k]);
                home[k % RING] = slot;
                prefetch(index.slot_ptr(slot));
            }
            if let Some(j) = k.checked_sub(SLOT_AHEAD - AHEAD).filter(|&j| j < n) {
                let found = index.find(ids[j], home[j % RING]);
                if let Some(p) = found {
                    self.lines(p, dim);
                }
                at[j % RING] = found;
            }
            if let Some(i) = k.checked_sub(SLOT_AHEAD) {
                lost += self.copy_row(at[i % RING], &mut o[i * dim..(i + 1) * dim]);
            }
        }
        lost
    }

    /// One Adagrad step per position (`acc += g * g; w -= lr * g / (sqrt(acc) + eps)`), the
    /// weights in words `0..dim` of a row and the accumulators in `dim..2 * dim`, on
    /// `threads` threads as [`DenseRows::in_place`] splits them.
    pub fn adagrad(
        &mut self,
        pos: &[u64],
        dim: usize,
        grads: &[f32],
        lr: f32,
        threads: usize,
        prefetch: bool,
    ) -> Result<()> {
        self.check_shape(pos.len(), dim, grads.len(), "grads")?;
        let avx = avx();
        self.in_place(pos, 2 * dim, "Adagrad", threads, prefetch, &|row, i| {
            let (w, acc) = row.split_at_mut(dim);
            let g = &grads[i * dim..(i + 1) * dim];
            #[cfg(target_arch = "x86_64")]
            if avx {
                // SAFETY: the CPU has AVX (`avx()`).
                return unsafe { adagrad_avx(w, acc, g, lr) };
            }
            adagrad_row(w, acc, g, lr);
        })
    }

    /// One Adam step per position, the weights in words `0..dim` of a row, the first moments
    /// in `dim..2 * dim` and the second moments in `2 * dim..3 * dim`, bias-corrected by the
    /// batch's `step` (from 1; one count for all rows, as torch's `SparseAdam` keeps it):
    /// `m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
    /// w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`, in float32. On `threads`
    /// threads as [`DenseRows::in_place`] splits them.
    #[allow(clippy::too_many_arguments)]
    pub fn adam(
        &mut self,
        pos: &[u64],
        dim: usize,
        grads: &[f32],
        lr: f32,
        (beta1, beta2, eps): (f32, f32, f32),
        step: u32,
        threads: usize,
        prefetch: bool,
    ) -> Result<()> {
        self.check_shape(pos.len(), dim, grads.len(), "grads")?;
        if step == 0 {
            return Err(invalid("Adam's step counts from 1".to_string()));
        }
        let t = step.min(i32::MAX as u32) as i32;
        let step_size = lr / (1.0 - beta1.powi(t));
        let bc2 = 1.0 / (1.0 - beta2.powi(t)).sqrt();
        let c = AdamStep {
            beta1,
            beta2,
            eps,
            step_size,
            bc2,
        };
        let avx = avx();
        self.in_place(pos, 3 * dim, "Adam", threads, prefetch, &|row, i| {
            let (w, mv) = row.split_at_mut(dim);
            let (m, v) = mv.split_at_mut(dim);
            let g = &grads[i * dim..(i + 1) * dim];
            #[cfg(target_arch = "x86_64")]
            if avx {
                // SAFETY: the CPU has AVX (`avx()`).
                return unsafe { adam_avx(w, m, v, g, &c) };
            }
            adam_row(w, m, v, g, &c);
        })
    }

    /// Runs `update(row, i)` on the first `words` words of row `pos[i]` for every `i`, on
    /// `threads` threads: thread `t` takes the positions `p` with `p % threads == t`, so no
    /// row has two writers and repeated positions apply in batch order. With `prefetch`, the
    /// lines of the row `AHEAD` of a thread's own are asked for. `what` names the update in
    /// the error for rows too short for it.
    fn in_place(
        &mut self,
        pos: &[u64],
        words: usize,
        what: &str,
        threads: usize,
        prefetch: bool,
        update: &(dyn Fn(&mut [f32], usize) + Sync),
    ) -> Result<()> {
        self.check_positions(pos)?;
        if words > self.words {
            return Err(shape(format!(
                "{what} needs {words} words per row; the rows have {}",
                self.words
            )));
        }
        let pool = self.pool(threads)?;
        let threads = pool.threads() as u64;
        let base = self.ptr as usize;
        let stride = self.stride;
        let this = &*self;
        pool.run_shared(threads as usize, &|t| {
            let t = t as u64;
            let mine: Vec<usize> = (0..pos.len()).filter(|&i| pos[i] % threads == t).collect();
            for (k, &i) in mine.iter().enumerate() {
                if prefetch {
                    if let Some(&ahead) = mine.get(k + AHEAD) {
                        this.lines(pos[ahead], words);
                    }
                }
                // SAFETY: `pos[i] < n` (checked) and rows with `p % threads == t` are written
                // by task `t` alone, so this is the only reference to the row while it lives;
                // `words <= self.words`, and `&mut self` keeps every other user of the rows out.
                let row = unsafe {
                    std::slice::from_raw_parts_mut(
                        (base as *mut f32).add(pos[i] as usize * stride),
                        words,
                    )
                };
                update(row, i);
            }
        });
        Ok(())
    }

    /// Row `p`'s first `words` values (for checks).
    pub fn row(&self, p: usize) -> Result<Vec<f32>> {
        if p >= self.n {
            return Err(invalid(format!("position {p} is past the {} rows", self.n)));
        }
        // SAFETY: `p < n`; the row's `words` values are in the mapping.
        Ok(
            unsafe { std::slice::from_raw_parts(self.ptr.add(p * self.stride), self.words) }
                .to_vec(),
        )
    }
}

/// Whether the kernels' row updates run compiled for AVX (eight float32 lanes): the same code
/// as the portable one, so both give the same results.
fn avx() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One Adagrad step of a row, over zipped slices (no index checks: the compiler vectorizes it).
#[inline(always)]
fn adagrad_row(w: &mut [f32], acc: &mut [f32], g: &[f32], lr: f32) {
    for ((w, a), &g) in w.iter_mut().zip(acc.iter_mut()).zip(g) {
        *a += g * g;
        *w -= lr * g / (a.sqrt() + 1e-10);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn adagrad_avx(w: &mut [f32], acc: &mut [f32], g: &[f32], lr: f32) {
    adagrad_row(w, acc, g, lr);
}

/// An Adam step's constants: `step_size = lr / (1 - beta1^t)`, `bc2 = 1 / sqrt(1 - beta2^t)`.
struct AdamStep {
    beta1: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bc2: f32,
}

/// One Adam step of a row, over zipped slices (vectorized like [`adagrad_row`]).
#[inline(always)]
fn adam_row(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], c: &AdamStep) {
    for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        *m = c.beta1 * *m + (1.0 - c.beta1) * g;
        *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
        *w -= c.step_size * *m / (v.sqrt() * c.bc2 + c.eps);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn adam_avx(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], c: &AdamStep) {
    adam_row(w, m, v, g, c);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_copies_the_rows_at_the_positions_whatever_the_threads() {
        let init: Vec<f32> = (0..100 * 3).map(|x| x as f32).collect();
        let rows = DenseRows::new(100, 3, 3, &init, 0.0).unwrap();
        let pos: Vec<u64> = (0..1000).map(|i| (i * 37 % 100) as u64).collect();
        for threads in [1, 2, 3] {
            for pf in [false, true] {
                let mut out = vec![0f32; pos.len() * 3];
                rows.gather(&pos, 3, &mut out, threads, pf).unwrap();
                for (i, &p) in pos.iter().enumerate() {
                    assert_eq!(
                        &out[i * 3..i * 3 + 3],
                        &init[p as usize * 3..p as usize * 3 + 3]
                    );
                }
            }
        }
        // One executor per thread count, kept across calls (no threads started per call).
        let pools: Vec<usize> = rows
            .pools
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.threads())
            .collect();
        assert_eq!(pools, [1, 2, 3]);
        let mut out = vec![0f32; 3];
        assert!(rows.gather(&[100], 3, &mut out, 1, false).is_err());
        assert!(rows.gather(&[1], 3, &mut out[..2], 1, false).is_err());
    }

    #[test]
    fn lookup_copies_the_rows_of_the_ids_and_zeros_for_unknown_ids() {
        let (n, dim) = (1000usize, 5usize);
        let init: Vec<f32> = (0..n * dim).map(|x| x as f32).collect();
        let mut rows = DenseRows::new(n, 8, dim, &init, 0.0).unwrap();
        let mut out = vec![0f32; dim];
        assert!(rows.lookup(&[1], dim, &mut out, 1, true).is_err());
        // Ids that share high bits and low bits, so probes run into each other.
        let ids: Vec<u64> = (0..n as u64).map(|i| (i << 40) | (i % 7)).collect();
        rows.index(&ids).unwrap();
        let mut batch: Vec<u64> = (0..5000u64)
            .map(|k| ids[(k * 7919 % n as u64) as usize])
            .collect();
        batch[17] = 3; // no row has id 3
        batch[4000] = u64::MAX;
        for threads in [1, 2, 3] {
            for pf in [false, true] {
                for len in [0, 1, 9, 17, 33, batch.len()] {
                    let mut out = vec![-1f32; len * dim];
                    let lost = rows
                        .lookup(&batch[..len], dim, &mut out, threads, pf)
                        .unwrap();
                    let mut want_lost = 0;
                    for (i, &id) in batch[..len].iter().enumerate() {
                        let got = &out[i * dim..(i + 1) * dim];
                        match ids.iter().position(|&x| x == id) {
                            Some(p) => assert_eq!(got, &init[p * dim..(p + 1) * dim]),
                            None => {
                                want_lost += 1;
                                assert!(got.iter().all(|&v| v == 0.0));
                            }
                        }
                    }
                    assert_eq!(
                        lost, want_lost,
                        "{threads} threads, prefetch {pf}, {len} ids"
                    );
                }
            }
        }
        let mut dup = ids.clone();
        dup[5] = dup[6];
        assert!(rows.index(&dup).is_err());
        assert!(rows.index(&ids[1..]).is_err());
    }

    #[test]
    fn adagrad_matches_a_sequential_reference_with_repeated_positions() {
        let init = vec![0.5f32; 10 * 2];
        let pos: Vec<u64> = vec![3, 1, 3, 7, 3, 1];
        let grads: Vec<f32> = (0..pos.len() * 2).map(|x| 0.1 * (x as f32 + 1.0)).collect();
        let mut want = [[0.5f32, 0.5, 0.1, 0.1]; 10];
        for (i, &p) in pos.iter().enumerate() {
            let r = &mut want[p as usize];
            for j in 0..2 {
                let g = grads[i * 2 + j];
                r[2 + j] += g * g;
                r[j] -= 0.01 * g / (r[2 + j].sqrt() + 1e-10);
            }
        }
        for threads in [1, 2, 4] {
            let mut rows = DenseRows::new(10, 4, 2, &init, 0.1).unwrap();
            rows.adagrad(&pos, 2, &grads, 0.01, threads, true).unwrap();
            for (p, w) in want.iter().enumerate() {
                assert_eq!(
                    rows.row(p).unwrap(),
                    w.to_vec(),
                    "row {p}, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn adam_matches_a_sequential_reference_with_repeated_positions() {
        let init = vec![0.5f32; 10 * 2];
        let pos: Vec<u64> = vec![3, 1, 3, 7, 3, 1];
        let grads: Vec<f32> = (0..pos.len() * 2).map(|x| 0.1 * (x as f32 - 4.0)).collect();
        let (lr, b1, b2, eps) = (0.01f32, 0.9f32, 0.999f32, 1e-8f32);
        let mut want = [[0.5f32, 0.5, 0.0, 0.0, 0.0, 0.0]; 10];
        for step in 1..=2u32 {
            let t = step as i32;
            let (c1, c2) = (1.0 - b1.powi(t), (1.0 - b2.powi(t)).sqrt());
            for (i, &p) in pos.iter().enumerate() {
                let r = &mut want[p as usize];
                for j in 0..2 {
                    let g = grads[i * 2 + j];
                    r[2 + j] = b1 * r[2 + j] + (1.0 - b1) * g;
                    r[4 + j] = b2 * r[4 + j] + (1.0 - b2) * g * g;
                    r[j] -= lr / c1 * r[2 + j] / (r[4 + j].sqrt() * (1.0 / c2) + eps);
                }
            }
        }
        for threads in [1, 2, 4] {
            let mut rows = DenseRows::new(10, 6, 2, &init, 0.0).unwrap();
            for step in 1..=2 {
                rows.adam(&pos, 2, &grads, lr, (b1, b2, eps), step, threads, true)
                    .unwrap();
            }
            for (p, w) in want.iter().enumerate() {
                assert_eq!(
                    rows.row(p).unwrap(),
                    w.to_vec(),
                    "row {p}, {threads} threads"
                );
            }
            assert!(rows
                .adam(&pos, 2, &grads, lr, (b1, b2, eps), 0, threads, true)
                .is_err());
        }
        // Rows of 5 words hold no Adam step of dim 2 (3 x 2 words).
        let mut short = DenseRows::new(10, 5, 2, &init, 0.0).unwrap();
        assert!(short
            .adam(&pos, 2, &grads, lr, (b1, b2, eps), 1, 1, true)
            .is_err());
    }
}
