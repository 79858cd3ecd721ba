//! Dense tables: one named float32 tensor with its own optimizer, updated as a whole.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use super::{check_finite, Common, Counters, TableHandle, TableStats};
use crate::error::{invalid, shape, Result};
use crate::executor::PushHandle;
use crate::init::Initializer;
use crate::optimizer::OptimizerConfig;

/// The most elements a dense table may hold (16 GiB of float32 weights).
const MAX_NUMEL: usize = 1 << 32;

/// How a dense table is built.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DenseTableConfig {
    /// The tensor's shape; every extent at least 1.
    pub shape: Vec<usize>,
    /// The optimizer applied by pushes; `clip_norm` applies to the whole gradient.
    pub optimizer: OptimizerConfig,
    /// The tensor's initial value, one stream of `seed` over the elements in C order.
    pub initializer: Initializer,
    /// The seed of the initialiser.
    pub seed: u64,
}

impl DenseTableConfig {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.shape.is_empty() || self.shape.contains(&0) {
            return Err(invalid(format!(
                "dense shape needs at least one dimension, each >= 1, got {:?}",
                self.shape
            )));
        }
        let numel = self
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= MAX_NUMEL);
        if numel.is_none() {
            return Err(invalid(format!(
                "dense shape {:?} has more than {MAX_NUMEL} elements",
                self.shape
            )));
        }
        self.optimizer.validate()?;
        self.initializer.validate()
    }
}

struct DenseState {
    weights: Vec<f32>,
    state: Vec<f32>,
    step: u32,
}

/// A dense table. A push locks the tensor once; pulls share a read lock.
pub struct DenseTable {
    common: Common,
    config: DenseTableConfig,
    data: RwLock<DenseState>,
    /// Changed since the flusher last took the value.
    dirty: AtomicBool,
}

impl DenseTable {
    pub(crate) fn new(common: Common, config: DenseTableConfig) -> Result<Self> {
        config.validate()?;
        let n = config.numel();
        let mut weights = vec![0.0; n];
        config.initializer.fill(config.seed, 0, &mut weights);
        let mut state = vec![0.0; config.optimizer.state_len(n)];
        config.optimizer.init_state(&mut state);
        Ok(Self {
            common,
            dirty: AtomicBool::new(true),
            config,
            data: RwLock::new(DenseState {
                weights,
                state,
                step: 0,
            }),
        })
    }

    /// The table's configuration.
    pub fn config(&self) -> &DenseTableConfig {
        &self.config
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, DenseState> {
        // An update writes the tensor element by element; a panic cannot occur midway (plain
        // arithmetic), so a poisoned lock still guards a consistent tensor.
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of pushes applied (Adam's step count).
    pub fn step(&self) -> u32 {
        self.read().step
    }

    /// A copy of the tensor, in C order.
    pub fn pull(&self) -> Result<Vec<f32>> {
        self.check_live()?;
        let v = self.read().weights.clone();
        Counters::add(&self.common.counters.pulls, 1);
        Ok(v)
    }

    /// A copy of the optimizer state, in C order per state slot.
    pub fn optimizer_state(&self) -> Vec<f32> {
        self.read().state.clone()
    }

    /// Checks a gradient without applying it.
    pub fn validate_push(&self, grad: &[f32]) -> Result<()> {
        self.check_live()?;
        let n = self.config.numel();
        if grad.len() != n {
            return Err(shape(format!(
                "table {:?}: gradient must have shape {:?} ({n} values), got {} values",
                self.common.name,
                self.config.shape,
                grad.len()
            )));
        }
        check_finite(
            &self.common.exec,
            &self.common.name,
            grad,
            *self.config.shape.last().unwrap_or(&1),
        )?;
        self.common.durable_check()
    }

    /// Applies one gradient of the whole tensor.
    pub fn push(self: &Arc<Self>, grad: &[f32]) -> Result<()> {
        self.push_scaled(grad, 1.0)
    }

    /// [`push`](Self::push) with the learning rate multiplied by `lr_scale` for this push only.
    pub fn push_scaled(self: &Arc<Self>, grad: &[f32], lr_scale: f64) -> Result<()> {
        self.validate_push(grad)?;
        self.push_validated(grad, lr_scale)
    }

    /// [`push_scaled`](Self::push_scaled) of a gradient that
    /// [`validate_push`](Self::validate_push) accepted already.
    pub(crate) fn push_validated(self: &Arc<Self>, grad: &[f32], lr_scale: f64) -> Result<()> {
        self.push_validated_as(grad, lr_scale, None)
    }

    /// [`push_validated`](Self::push_validated) of the write request `rid` (client, seq),
    /// recorded with the value it changed (a durable store commits both together).
    pub(crate) fn push_validated_as(
        self: &Arc<Self>,
        grad: &[f32],
        lr_scale: f64,
        rid: Option<(u64, u64)>,
    ) -> Result<()> {
        super::check_scale(lr_scale)?;
        self.common.durable_check()?;
        if self.common.exec.pending() > 0 {
            return self.queue(grad.to_vec(), lr_scale, rid)?.wait();
        }
        let epoch = self.apply(grad, lr_scale, rid);
        self.common.durable_wait_push(epoch)
    }

    /// Per environment of the replica, whether the write request `(client, seq)` was applied
    /// (an error when it is older than what the table remembers of its client).
    pub fn was_applied(&self, client: u64, seq: u64) -> Result<Vec<bool>> {
        self.common.applied.check(client, seq)
    }

    /// Queues one gradient and returns at once.
    pub fn push_async(self: &Arc<Self>, grad: Vec<f32>) -> Result<PushHandle> {
        self.validate_push(&grad)?;
        self.queue(grad, 1.0, None)
    }

    fn queue(
        self: &Arc<Self>,
        grad: Vec<f32>,
        lr_scale: f64,
        rid: Option<(u64, u64)>,
    ) -> Result<PushHandle> {
        let me = Arc::clone(self);
        self.common.exec.submit(
            grad.len() * 4,
            Box::new(move || {
                let epoch = me.apply(&grad, lr_scale, rid);
                me.common.durable_wait_push(epoch)
            }),
        )
    }

    /// Applies one gradient; returns the revert epoch it was applied in.
    fn apply(&self, grad: &[f32], lr_scale: f64, rid: Option<(u64, u64)>) -> u64 {
        let mut g: Vec<f64> = grad.iter().map(|&x| x as f64).collect();
        let lr = self.lr() * lr_scale;
        let mut d = self.data.write().unwrap_or_else(|e| e.into_inner());
        let epoch = self.common.revert_epoch();
        let d = &mut *d;
        d.step = d.step.saturating_add(1);
        let finite = self
            .config
            .optimizer
            .apply(lr, d.step, &mut d.weights, &mut d.state, &mut g);
        if let Some((client, seq)) = rid {
            // Under the write lock: a flush takes the value and the id together.
            self.common.applied.note(client, seq);
        }
        if !finite {
            Counters::add(&self.common.counters.rows_nonfinite, 1);
        }
        self.dirty.store(true, Ordering::Release);
        Counters::add(&self.common.counters.pushes, 1);
        Counters::add(&self.common.counters.rows_updated, 1);
        epoch
    }

    /// The value as words `[step, 0, weights, state]` if it changed since the last take, the
    /// applied request ids if they changed (one set per environment), with what `f` returns
    /// while no push can run (the record that matches the value).
    #[allow(clippy::type_complexity)]
    pub(crate) fn take_dirty_words<R>(
        &self,
        f: impl FnOnce() -> R,
    ) -> (Option<Vec<u32>>, Option<Vec<Vec<u8>>>, R) {
        let d = self.read();
        let words = self
            .dirty
            .swap(false, Ordering::AcqRel)
            .then(|| Self::words_of(&d));
        (words, self.common.applied.take(), f())
    }

    fn words_of(d: &DenseState) -> Vec<u32> {
        let mut w = Vec::with_capacity(2 + d.weights.len() + d.state.len());
        w.push(d.step);
        w.push(0);
        w.extend(d.weights.iter().map(|x| x.to_bits()));
        w.extend(d.state.iter().map(|x| x.to_bits()));
        w
    }

    /// The value as words `[step, 0, weights, state]`.
    pub fn words(&self) -> Vec<u32> {
        Self::words_of(&self.read())
    }

    /// How many words [`words`](Self::words) has.
    pub fn words_len(&self) -> usize {
        let d = self.read();
        2 + d.weights.len() + d.state.len()
    }

    /// Words `start..start + len` of [`words`](Self::words) (fewer at the end), read under
    /// one lock without copying the rest.
    pub fn words_at(&self, start: usize, len: usize) -> Vec<u32> {
        let d = self.read();
        let (n, m) = (d.weights.len(), d.state.len());
        let end = start.saturating_add(len).min(2 + n + m);
        (start..end)
            .map(|k| match k {
                0 => d.step,
                1 => 0,
                k if k < 2 + n => d.weights[k - 2].to_bits(),
                k => d.state[k - 2 - n].to_bits(),
            })
            .collect()
    }

    /// Writes `words` over the value from word `start` on (a value loaded in chunks), refusing
    /// words past its end before writing any.
    pub fn set_words_at(&self, start: usize, words: &[u32]) -> Result<()> {
        let mut d = self.data.write().unwrap_or_else(|e| e.into_inner());
        let (n, m) = (d.weights.len(), d.state.len());
        if start
            .checked_add(words.len())
            .is_none_or(|end| end > 2 + n + m)
        {
            return Err(crate::error::invalid(format!(
                "dense table {:?}: {} words from word {start} on are past the value's {} words",
                self.common.name,
                words.len(),
                2 + n + m
            )));
        }
        for (k, &w) in (start..).zip(words) {
            match k {
                0 => d.step = w,
                1 => {}
                k if k < 2 + n => d.weights[k - 2] = f32::from_bits(w),
                k => d.state[k - 2 - n] = f32::from_bits(w),
            }
        }
        self.dirty.store(true, Ordering::Release);
        Ok(())
    }

    /// Marks the value as written (it was just loaded from the replica).
    pub(crate) fn mark_clean(&self) {
        self.dirty.store(false, Ordering::Release);
    }

    /// Marks the value changed (a failed flush gives it back).
    pub(crate) fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// Replaces the value by words `[step, 0, weights, state]`.
    pub fn set_words(&self, words: &[u32]) -> Result<()> {
        let mut d = self.data.write().unwrap_or_else(|e| e.into_inner());
        self.load_words(&mut d, words)?;
        self.dirty.store(true, Ordering::Release);
        Ok(())
    }

    /// Loads the value `d` (under its write lock) from words `[step, 0, weights, state]`,
    /// checking their count.
    fn load_words(&self, d: &mut DenseState, words: &[u32]) -> Result<()> {
        let (n, m) = (d.weights.len(), d.state.len());
        if words.len() != 2 + n + m {
            return Err(crate::error::corrupt(format!(
                "dense table {:?}: a stored value of {} words, not {}",
                self.common.name,
                words.len(),
                2 + n + m
            )));
        }
        d.step = words[0];
        for (x, &w) in d.weights.iter_mut().zip(&words[2..2 + n]) {
            *x = f32::from_bits(w);
        }
        for (x, &w) in d.state.iter_mut().zip(&words[2 + n..]) {
            *x = f32::from_bits(w);
        }
        Ok(())
    }

    /// Goes back to the value `words` the replica holds (a `sync` store whose commit failed;
    /// see `Flusher::revert_all`).
    pub(crate) fn revert_to(&self, words: &[u32], applied: Option<Vec<u8>>) -> Result<()> {
        let mut d = self.data.write().unwrap_or_else(|e| e.into_inner());
        self.load_words(&mut d, words)?;
        self.common
            .applied
            .load(&[applied], "the applied request ids")?;
        self.dirty.store(false, Ordering::Release);
        self.common.note_reverted();
        Ok(())
    }

    /// The table's counters and sizes.
    pub fn stats(&self) -> TableStats {
        let d = self.read();
        let c = &self.common.counters;
        TableStats {
            rows: 1,
            bytes_used: ((d.weights.capacity() + d.state.capacity()) * 4) as u64,
            huge_page_bytes: 0,
            pushes: Counters::get(&c.pushes),
            pulls: Counters::get(&c.pulls),
            ids_pushed: 0,
            ids_pulled: 0,
            rows_updated: Counters::get(&c.rows_updated),
            rows_created: 0,
            rows_evicted: 0,
            rows_nonfinite: Counters::get(&c.rows_nonfinite),
            seq: Counters::get(&c.pushes),
            rows_unloaded: 0,
            lr: self.lr(),
        }
    }
}

impl TableHandle for DenseTable {
    fn common(&self) -> &Common {
        &self.common
    }
}
