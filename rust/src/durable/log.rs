//! The commit log a durable store hands to a listener (a store server that replicates): after
//! every flush cycle that committed something, the changes it committed, as written, under the
//! cycle's number (its log sequence number, LSN). A sink may take a one-transaction cycle's
//! entry just before its commit, then learn whether it committed (decision 0116).
//!
//! An entry holds, per table, the rows as the replica stores them (words after the id), the ids
//! deleted, a dense table's value, the applied request ids (environment 0's set, which holds
//! every write's id), and the table record when it changed; and the tables created or dropped
//! since the last entry. Applying the entries in order to another store, rows as they are,
//! gives the same tables; applying one twice changes nothing (each carries whole states).

use std::sync::Mutex;

/// What one cycle committed of one table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TableCommit {
    /// The table's name.
    pub name: String,
    /// The table record (JSON) when the cycle wrote it, or when the table was created since
    /// the last entry.
    pub record: Option<Vec<u8>>,
    /// Sparse: the ids of the rows written.
    pub ids: Vec<u64>,
    /// Sparse: the rows written, `ids.len()` rows of the table's row words (after the id).
    pub words: Vec<u32>,
    /// Sparse: the ids deleted.
    pub gone: Vec<u64>,
    /// Dense: the value written (`[step, 0, weights, state]`).
    pub dense: Option<Vec<u32>>,
    /// The applied request ids written (environment 0's set, encoded).
    pub applied: Option<Vec<u8>>,
}

/// What one cycle committed: the changes of every table it wrote.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommitEntry {
    /// The cycle's number.
    pub lsn: u64,
    /// Tables dropped since the last entry (before the tables below changed).
    pub dropped: Vec<String>,
    /// The changes, table by table.
    pub tables: Vec<TableCommit>,
    /// What the server holds beside its tables (its routing, ...), encoded by the server,
    /// when it changed since the last entry; opaque here.
    pub held: Option<Vec<u8>>,
    /// The server's synchronous-job records since the last entry, in order, encoded by the
    /// server; opaque here.
    pub job: Vec<Vec<u8>>,
}

impl CommitEntry {
    /// Nothing in it.
    pub fn is_empty(&self) -> bool {
        self.dropped.is_empty()
            && self.tables.is_empty()
            && self.held.is_none()
            && self.job.is_empty()
    }

    /// The bytes its rows and values take (what a bounded log counts).
    pub fn bytes(&self) -> usize {
        self.tables
            .iter()
            .map(|t| {
                t.ids.len() * 8
                    + t.words.len() * 4
                    + t.gone.len() * 8
                    + t.dense.as_ref().map_or(0, |d| d.len() * 4)
                    + t.applied.as_ref().map_or(0, Vec::len)
                    + t.record.as_ref().map_or(0, Vec::len)
                    + t.name.len()
            })
            .sum::<usize>()
            + self.dropped.iter().map(String::len).sum::<usize>()
            + self.held.as_ref().map_or(0, Vec::len)
            + self.job.iter().map(Vec::len).sum::<usize>()
    }

    fn table(&mut self, name: &str) -> &mut TableCommit {
        match self.tables.iter().position(|t| t.name == name) {
            Some(i) => &mut self.tables[i],
            None => {
                self.tables.push(TableCommit {
                    name: name.to_string(),
                    ..TableCommit::default()
                });
                self.tables.last_mut().expect("just pushed")
            }
        }
    }
}

/// Who receives the entries: called on the flusher's thread, after each cycle that committed,
/// in cycle order; it must not wait for the flusher.
pub trait CommitSink: Send + Sync {
    /// Whether entries are wanted now (when not, the flusher copies nothing and calls
    /// [`CommitSink::skipped`] instead).
    fn wanted(&self) -> bool;
    /// The changes the cycle `entry.lsn` committed.
    fn committed(&self, entry: CommitEntry);
    /// Cycle `lsn` committed while no entries were wanted.
    fn skipped(&self, lsn: u64);
    /// Whether a cycle's entry may be handed on before its commit (decision 0116): then
    /// [`CommitSink::shipped`] comes before the commit and [`CommitSink::settled`] after it,
    /// instead of [`CommitSink::committed`].
    fn early(&self) -> bool {
        false
    }
    /// The entry of cycle `entry.lsn`, handed on before its commit.
    fn shipped(&self, entry: CommitEntry) {
        let _ = entry;
    }
    /// Cycle `lsn`, shipped before its commit, committed (`ok`) or failed: its entry is
    /// retracted, and its number is never used again.
    fn settled(&self, lsn: u64, ok: bool) {
        let _ = (lsn, ok);
    }
}

/// The flusher's side: the sink, and the entry of the cycle in progress.
#[derive(Default)]
pub(super) struct Shipping {
    sink: Mutex<Option<std::sync::Arc<dyn CommitSink>>>,
    /// The cycle in progress (and the creations and drops since the last entry).
    pending: Mutex<CommitEntry>,
    /// Entries are being collected for the cycle in progress.
    on: std::sync::atomic::AtomicBool,
}

impl Shipping {
    pub(super) fn set(&self, sink: Option<std::sync::Arc<dyn CommitSink>>) {
        *self.sink.lock().unwrap_or_else(|e| e.into_inner()) = sink;
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, CommitEntry> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// At a cycle's start: whether to collect its changes.
    pub(super) fn begin(&self) -> bool {
        let on = self
            .sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|s| s.wanted());
        self.on.store(on, std::sync::atomic::Ordering::Relaxed);
        on
    }

    /// Whether the cycle in progress collects.
    pub(super) fn collecting(&self) -> bool {
        self.on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether creations or drops wait for an entry.
    pub(super) fn has_pending(&self) -> bool {
        !self.pending().is_empty()
    }

    /// Rows of `name` committed.
    pub(super) fn rows(&self, name: &str, ids: &[u64], words: &[u32], gone: &[u64]) {
        let mut p = self.pending();
        let t = p.table(name);
        t.ids.extend_from_slice(ids);
        t.words.extend_from_slice(words);
        t.gone.extend_from_slice(gone);
    }

    /// The record, dense value and applied ids of `name` committed.
    pub(super) fn meta(
        &self,
        name: &str,
        record: Option<Vec<u8>>,
        dense: Option<Vec<u32>>,
        applied: Option<Vec<u8>>,
    ) {
        let mut p = self.pending();
        let t = p.table(name);
        if record.is_some() {
            t.record = record;
        }
        if dense.is_some() {
            t.dense = dense;
        }
        if applied.is_some() {
            t.applied = applied;
        }
    }

    fn has_sink(&self) -> bool {
        self.sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// A table was created (its record committed outside a cycle).
    pub(super) fn created(&self, name: &str, record: Vec<u8>, dense: Option<Vec<u32>>) {
        if !self.has_sink() {
            return;
        }
        let mut p = self.pending();
        // A table dropped and created again within one entry: the drop goes first.
        if let Some(i) = p.tables.iter().position(|t| t.name == name) {
            p.tables.remove(i);
        }
        let t = p.table(name);
        t.record = Some(record);
        t.dense = dense;
    }

    /// A table was dropped.
    pub(super) fn dropped(&self, name: &str) {
        if !self.has_sink() {
            return;
        }
        let mut p = self.pending();
        p.tables.retain(|t| t.name != name);
        p.dropped.push(name.to_string());
    }

    /// The server's held state changed (the newest replaces one not handed on yet).
    pub(super) fn held(&self, held: Vec<u8>) {
        if !self.has_sink() {
            return;
        }
        self.pending().held = Some(held);
    }

    /// A record of the server's synchronous job (appended after those not handed on yet).
    pub(super) fn job(&self, record: Vec<u8>) {
        if !self.has_sink() {
            return;
        }
        self.pending().job.push(record);
    }

    /// Whether the sink takes entries before their commit.
    pub(super) fn early(&self) -> bool {
        self.sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|s| s.early())
    }

    /// Before cycle `lsn`'s only commit: hands its entry to the sink (which must be early).
    pub(super) fn publish_early(&self, lsn: u64) {
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut entry = std::mem::take(&mut *self.pending());
        entry.lsn = lsn;
        if let Some(s) = sink {
            s.shipped(entry);
        }
    }

    /// After the commit of cycle `lsn`, shipped early: whether it committed.
    pub(super) fn settle(&self, lsn: u64, ok: bool) {
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(s) = sink {
            s.settled(lsn, ok);
        }
    }

    /// After cycle `lsn` committed something: hands its entry to the sink.
    pub(super) fn publish(&self, lsn: u64) {
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut entry = std::mem::take(&mut *self.pending());
        entry.lsn = lsn;
        if let Some(s) = sink {
            if self.collecting() {
                s.committed(entry);
            } else {
                s.skipped(lsn);
            }
        }
    }
}
