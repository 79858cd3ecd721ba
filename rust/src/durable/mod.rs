//! Durability of a store with a path: the background flusher that copies changed rows from the
//! in-memory tables into the LMDB replica in batched write transactions (group commit).
//!
//! A *cycle* takes, table by table, every changed row and removed id, shard by shard (each under
//! its lock, so a row is copied whole: weights and optimizer state of one update) while the
//! table's changes are held off, so it takes each push whole; it then writes a table's rows and
//! record in one transaction (beyond [`ONE_TXN_BYTES`], a bulk load, in transactions of
//! [`CHUNK_BYTES`]). A cycle that fails gives back what it took, so the next cycle writes it
//! again. Cycles that write are numbered for the store's life; the number of the cycle that last
//! wrote a row (or deleted it) is kept in `changed/` (`removed/`) for incremental snapshots.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod log;
mod record;
mod replica;

pub use log::{CommitEntry, CommitSink, TableCommit};

pub use crate::table::{applied_key, AppliedIds};

pub(crate) use record::restore_counters;
pub use record::{
    dense_key, seq_key, table_key, CountersRecord, Durability, TableRecord, CYCLE_KEY,
};
pub(crate) use replica::replica_row;

use crate::error::{storage, Error, Result};
use crate::idle::IdleWrites;
use crate::storage::{bytes_of, Db, Storage};
use crate::table::{ChangeHook, DenseTable, SparseTable, Table, TableHandle, Taken};

/// A table's changes up to this size are written in one transaction (a push is then all or
/// nothing in the replica).
pub const ONE_TXN_BYTES: usize = 1 << 30;
/// Past [`ONE_TXN_BYTES`] (a bulk load), the transactions carry this much each.
pub const CHUNK_BYTES: usize = 64 << 20;

struct FlushState {
    /// The ticket of the next cycle run.
    next: u64,
    /// The ticket of the last cycle run.
    done: u64,
    /// The highest ticket someone waits for.
    wanted: u64,
    /// The number of the last cycle that wrote (kept on disk under `cycle`).
    cycle: u64,
    /// The error of the last completed cycle, if it failed.
    failed: Option<Error>,
    stop: bool,
    last_end: Instant,
    /// When the last cycle that succeeded started: everything applied before is durable.
    last_ok_start: Instant,
    /// The running cycle is a timed one nobody waits for.
    background: bool,
    /// How many background writes gave way to `flush()`.
    superseded: u64,
    /// The `async` interval in use is `interval * stretch` (see `Flusher::adapt`).
    stretch: u32,
}

/// How far `async` mode may stretch its interval: 16 x `flush_interval`.
pub const MAX_STRETCH: u32 = 16;

/// How long a background write may stay idle before the watchdog lifts it: two intervals.
fn idle_allowance(interval: Duration) -> Duration {
    interval * 2
}

/// The background flusher of a durable store.
pub struct Flusher {
    storage: Arc<Storage>,
    mode: Durability,
    interval: Duration,
    tables: Arc<RwLock<BTreeMap<String, Table>>>,
    state: Mutex<FlushState>,
    cv: Condvar,
    /// Held by a running cycle; table creation, drop and snapshots take it to see no cycle
    /// half done.
    cycle_lock: Mutex<()>,
    /// The log generation: a row's id is written to `changed/` on its first change in a
    /// generation only (its entry then exists until a snapshot prunes it). Each snapshot starts
    /// a new generation; rows loaded from disk carry none, so they are logged on first change.
    log_gen: std::sync::atomic::AtomicU32,
    /// The record last written per table, to skip writing an unchanged one.
    written: Mutex<HashMap<String, Vec<u8>>>,
    /// The row buffers of earlier cycles.
    spare: Spare,
    /// Background writes of `async` mode at idle priority (see [`crate::idle`]).
    idle: Arc<IdleWrites>,
    /// Set by `flush()` during a background cycle: the cycle's write in progress gives its rows
    /// back and the cycle ends, since the cycle `flush()` waits for takes them anyway (so they
    /// are written once, not twice, while somebody waits).
    supersede: AtomicBool,
    /// Set when the cycle in progress committed a transaction.
    committed: AtomicBool,
    /// The commit log handed to a listener (a replicating server).
    ship: log::Shipping,
    /// The cycle in progress handed its entry on before its commit (decision 0116).
    shipped_early: AtomicBool,
    /// A cycle shipped early failed and no cycle has committed since: the number it took is
    /// not on disk, so no entry leaves before its commit until one commits (after a crash,
    /// the only number that may have left unrecorded is the one after the disk's).
    early_blocked: AtomicBool,
    /// Tests: the next transaction of `write_chunk` fails (after an early hand-on), once the
    /// test says so on this channel.
    #[cfg(test)]
    pub(crate) fail_next: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Flusher {
    /// Starts the flusher; cycles are numbered from `last_cycle + 1`.
    pub(crate) fn start(
        storage: Arc<Storage>,
        mode: Durability,
        interval: Duration,
        tables: Arc<RwLock<BTreeMap<String, Table>>>,
        last_cycle: u64,
    ) -> Result<Arc<Self>> {
        let f = Arc::new(Self {
            storage,
            mode,
            interval,
            tables,
            state: Mutex::new(FlushState {
                next: 1,
                done: 0,
                wanted: 0,
                cycle: last_cycle,
                failed: None,
                stop: false,
                last_end: Instant::now(),
                last_ok_start: Instant::now(),
                background: false,
                superseded: 0,
                stretch: 1,
            }),
            cv: Condvar::new(),
            cycle_lock: Mutex::new(()),
            log_gen: std::sync::atomic::AtomicU32::new(1),
            written: Mutex::new(HashMap::new()),
            spare: Spare::default(),
            idle: IdleWrites::start(mode == Durability::Async, idle_allowance(interval)),
            supersede: AtomicBool::new(false),
            committed: AtomicBool::new(false),
            ship: log::Shipping::default(),
            shipped_early: AtomicBool::new(false),
            early_blocked: AtomicBool::new(false),
            #[cfg(test)]
            fail_next: Mutex::new(None),
            thread: Mutex::new(None),
        });
        let idle = Arc::clone(&f.idle);
        f.storage.set_on_wait(Box::new(move || idle.lift()));
        let me = Arc::clone(&f);
        let h = std::thread::Builder::new()
            .name("pstore-flusher".into())
            .spawn(move || me.run())
            .map_err(|e| crate::error::storage(format!("starting the flusher thread: {e}")))?;
        *f.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(f)
    }

    /// Hands the changes of every cycle that commits from now on to `sink` (or to nobody).
    pub fn set_commit_sink(&self, sink: Option<Arc<dyn CommitSink>>) {
        let _held = self.hold_cycles();
        self.ship.set(sink);
    }

    /// Skips a cycle number: records `last + 1` as the last cycle on disk, so that cycles from
    /// now on are numbered past any number a run before a crash may have handed on without
    /// committing it (decision 0116). Returns the last number before (the newest commit).
    pub fn skip_cycle_number(&self) -> Result<u64> {
        let _held = self.hold_cycles();
        let last = self.lock().cycle;
        let n = last + 1;
        self.storage
            .write(|w| w.put_meta(CYCLE_KEY, &n.to_le_bytes()))?;
        self.lock().cycle = n;
        Ok(last)
    }

    /// A table was created (its record, and a dense table's value, committed): the next entry
    /// of the commit log says so.
    pub(crate) fn table_created(&self, name: &str, record: Vec<u8>, dense: Option<Vec<u32>>) {
        self.ship.created(name, record, dense);
        self.cycle_soon();
    }

    /// A table was dropped: the next entry of the commit log says so.
    pub(crate) fn table_dropped(&self, name: &str) {
        self.ship.dropped(name);
        self.cycle_soon();
    }

    /// What the server holds beside its tables changed (`held`, encoded by the server): the
    /// next entry of the commit log carries it. Asks for a cycle without waiting for it.
    pub fn ship_held(&self, held: Vec<u8>) {
        self.ship.held(held);
        self.cycle_soon();
    }

    /// A record of the server's synchronous job (`record`, encoded by the server): the next
    /// entry of the commit log carries it, after the records before it. Asks for a cycle
    /// without waiting for it.
    pub fn ship_job(&self, record: Vec<u8>) {
        self.ship.job(record);
        self.cycle_soon();
    }

    /// When the commit log has creations or drops to hand on: asks for a cycle without
    /// waiting for it (the caller may hold cycles off), so they do not wait for the next write.
    fn cycle_soon(&self) {
        if self.ship.has_pending() {
            let mut st = self.lock();
            st.wanted = st.wanted.max(st.next);
            self.cv.notify_all();
        }
    }

    /// The durability mode.
    pub fn mode(&self) -> Durability {
        self.mode
    }

    /// The flush interval of `async` mode.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The storage.
    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    fn lock(&self) -> MutexGuard<'_, FlushState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether background writes run at idle priority (`async` mode, and the process can lift
    /// them again).
    pub fn idle_writes(&self) -> bool {
        self.idle.enabled()
    }

    /// How often an idle write was lifted back to normal priority (by a waiter or the
    /// watchdog).
    pub fn idle_lifts(&self) -> u64 {
        self.idle.lifts()
    }

    /// How many background writes gave way to a `flush()` (their rows went to its cycle).
    pub fn superseded_writes(&self) -> u64 {
        self.lock().superseded
    }

    /// Holds off cycles while `f` runs (table creation and drop, snapshots).
    pub(crate) fn exclusive<R>(&self, f: impl FnOnce() -> R) -> R {
        let _held = self.hold_cycles();
        f()
    }

    /// The current log generation (never 0: rows loaded from disk carry 0).
    fn log_gen(&self) -> u32 {
        self.log_gen.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Starts a new log generation: called by a snapshot, with cycles held off, before it reads.
    /// Changes taken from then on are logged anew, so the entries the snapshot prunes (those of
    /// cycles it covers) are written again for rows that change after it.
    pub(crate) fn next_log_gen(&self) {
        let g = self.log_gen() % ((u32::MAX >> 8) - 1) + 1;
        self.log_gen.store(g, std::sync::atomic::Ordering::Release);
    }

    /// Holds off cycles until the guard is dropped (a running cycle is lifted to normal
    /// priority first).
    pub(crate) fn hold_cycles(&self) -> MutexGuard<'_, ()> {
        self.idle
            .wait_for(|| self.cycle_lock.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn run(&self) {
        loop {
            let ticket = {
                let mut st = self.lock();
                loop {
                    if st.wanted >= st.next {
                        break;
                    }
                    if st.stop {
                        return;
                    }
                    if self.mode == Durability::Async {
                        let due = st.last_end + self.interval * st.stretch;
                        let now = Instant::now();
                        if now >= due {
                            break;
                        }
                        st = self
                            .cv
                            .wait_timeout(st, due - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    } else {
                        st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                }
                // A timed cycle nobody waits for writes at idle priority.
                st.background = self.mode == Durability::Async && st.wanted < st.next;
                self.idle.begin(st.background);
                self.supersede.store(false, Ordering::Relaxed);
                st.next += 1;
                st.next - 1
            };
            let number = self.lock().cycle + 1;
            let started = Instant::now();
            let r = {
                let _held = self.cycle_lock.lock().unwrap_or_else(|e| e.into_inner());
                self.committed.store(false, Ordering::Relaxed);
                self.shipped_early.store(false, Ordering::Relaxed);
                self.ship.begin();
                let r = self.cycle(number);
                if self.shipped_early.load(Ordering::Relaxed) {
                    // Its entry left before its (only) commit: it stands or is retracted.
                    let ok = self.committed.load(Ordering::Relaxed);
                    self.ship.settle(number, ok);
                    self.early_blocked.store(!ok, Ordering::Relaxed);
                } else if self.committed.load(Ordering::Relaxed) {
                    // Even a cycle that failed after some of its transactions committed hands
                    // those on (a `sync` store then goes back to exactly what they hold).
                    self.ship.publish(number);
                }
                match r {
                    // In `sync` mode whoever changed something waits for this cycle or the next:
                    // a failed one undoes every change since the last commit, so that those
                    // calls fail having changed nothing.
                    Err(e) if self.mode == Durability::Sync => match self.revert_all() {
                        Ok(()) => Err(e),
                        Err(r) => Err(storage(format!(
                            "{e} (and going back to the last commit failed: {r})"
                        ))),
                    },
                    r => r,
                }
            };
            let mut st = self.lock();
            if st.background {
                self.adapt(&mut st, started.elapsed());
            }
            st.done = ticket;
            st.background = false;
            if self.committed.load(Ordering::Relaxed) {
                // A number that committed anything is never used again.
                st.cycle = number;
                self.early_blocked.store(false, Ordering::Relaxed);
            }
            if self.shipped_early.load(Ordering::Relaxed) {
                // Nor one whose entry left.
                st.cycle = number;
            }
            match r {
                Ok(done) => {
                    if done.wrote {
                        st.cycle = number;
                    }
                    st.failed = None;
                    if done.superseded {
                        st.superseded += 1;
                    } else {
                        st.last_ok_start = started;
                    }
                }
                Err(e) => st.failed = Some(e),
            }
            st.last_end = Instant::now();
            self.cv.notify_all();
        }
    }

    /// After a background cycle that took `took`: the interval in use doubles, or grows at once
    /// to the power of two of intervals that the cycle took (up to [`MAX_STRETCH`] x
    /// `flush_interval`), when the watchdog had to lift the cycle's write and the cycle
    /// outlasted the interval, that is, when training leaves too little spare CPU
    /// to write what changes in one interval; it halves (down to `flush_interval`) when the
    /// cycle finished at idle priority. The watchdog's allowance follows it (two intervals).
    /// Cycles then come less often and each one writes at idle priority for longer: a row
    /// changed many times between cycles is written once, so the replica costs training less,
    /// and the loss window grows with the interval (five intervals plus two writes at most).
    fn adapt(&self, st: &mut FlushState, took: Duration) {
        let o = self.idle.outcome();
        let stretch = if o.starved && took > self.interval * st.stretch {
            // At least double; at once to the interval the cycle took, when that is longer.
            let took_intervals = (took.as_secs_f64() / self.interval.as_secs_f64()).ceil();
            let need = (took_intervals.min(f64::from(MAX_STRETCH)) as u32).next_power_of_two();
            (st.stretch * 2).max(need).min(MAX_STRETCH)
        } else if o.stayed_idle {
            (st.stretch / 2).max(1)
        } else {
            st.stretch
        };
        if stretch != st.stretch {
            st.stretch = stretch;
            self.idle
                .set_allowance(idle_allowance(self.interval * stretch));
        }
    }

    /// The interval `async` mode uses now: `flush_interval`, stretched while background writes
    /// cannot finish at idle priority (see `adapt`).
    pub fn current_interval(&self) -> Duration {
        self.interval * self.lock().stretch
    }

    /// The flush lag: how long ago the last successful cycle started. What was applied before
    /// then is on disk; what came after may not be yet.
    pub fn lag(&self) -> Duration {
        self.lock().last_ok_start.elapsed()
    }

    /// Runs a cycle that starts after this call and waits for it; its error, if it failed.
    pub fn flush(&self) -> Result<()> {
        let mut st = self.lock();
        if st.stop {
            return Err(storage("the store is closed"));
        }
        let target = st.next;
        st.wanted = st.wanted.max(target);
        // The running cycle (if any) goes on at normal priority, or, if it is a background one,
        // gives up its write to the cycle this call waits for. Under this lock the flusher
        // starts none that could miss `wanted`.
        if st.background {
            self.supersede.store(true, Ordering::Relaxed);
        }
        self.idle.lift();
        self.cv.notify_all();
        while st.done < target {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match &st.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Before a push: refuses it while the replica cannot be written. After a failed cycle it
    /// tries once more; the push goes ahead when that succeeds.
    pub(crate) fn check(&self) -> Result<()> {
        let failed = self.lock().failed.is_some();
        if !failed {
            return Ok(());
        }
        self.flush().map_err(|e| {
            storage(format!(
                "{e}; the push was not applied (it will be accepted once the store can write \
                 again)"
            ))
        })
    }

    /// After a change was applied: in `sync` mode, waits until it is committed (the caller
    /// says what a failure means for its change).
    pub(crate) fn after_push(&self) -> Result<()> {
        if self.mode != Durability::Sync {
            return Ok(());
        }
        self.flush()
    }

    /// After a failed cycle of a `sync` store: every table goes back to what the replica holds
    /// (its last commit). The changes since then were all made by calls still waiting for a
    /// commit (a `sync` push returns only after one), so each of them fails and changes
    /// nothing, and a retry applies it once. Rows are read back from the replica (one not in it
    /// is dropped from memory: it was created since, and is created again from its seed on the
    /// next touch); a sparse table's applied request ids are read back too. Removals, evictions
    /// and learning rates stay applied (their callers say so).
    fn revert_all(&self) -> Result<()> {
        let tables = self.table_list();
        for (name, table) in tables {
            match &table {
                Table::Sparse(t) => {
                    // Each environment's own set, as the store's open reads them.
                    let key = applied_key(&name);
                    let applied = self.storage.read(|r| {
                        let mut a = vec![r.meta(&key)?];
                        for k in 1..self.storage.environments() {
                            a.push(r.part_meta(k, &key)?);
                        }
                        Ok(a)
                    })?;
                    t.revert_to(self.storage.as_ref(), &applied)?;
                }
                Table::Dense(t) => {
                    let (words, applied) = self
                        .storage
                        .read(|r| Ok((r.meta(&dense_key(&name))?, r.meta(&applied_key(&name))?)))?;
                    if let Some(w) = words {
                        let mut v = Vec::new();
                        crate::storage::words_into(&w, &mut v);
                        t.revert_to(&v, applied)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Records that `name`'s record on disk is `rec` (a table just created or loaded).
    pub(crate) fn record_loaded(&self, name: &str, rec: Vec<u8>) {
        self.record_written(name, rec);
    }

    /// Forgets a dropped table's record.
    pub(crate) fn record_dropped(&self, name: &str) {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
    }

    /// The number of the last cycle that wrote (over the store's life).
    pub fn done_cycle(&self) -> u64 {
        self.lock().cycle
    }

    /// The error of the last cycle, if it failed.
    pub fn last_error(&self) -> Option<Error> {
        self.lock().failed.clone()
    }

    /// Writes what is left and stops the thread. Returns the final cycle's error.
    pub(crate) fn shutdown(&self) -> Result<()> {
        let r = self.flush();
        self.lock().stop = true;
        self.cv.notify_all();
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
        self.idle.stop();
        r
    }

    /// The tables with their names, taken out of the map (so no lock is held while they work).
    fn table_list(&self) -> Vec<(String, Table)> {
        self.tables
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// One cycle over every table.
    fn cycle(&self, cycle: u64) -> Result<CycleDone> {
        let tables = self.table_list();
        let mut done = CycleDone::default();
        // The entry may leave before the commit when the cycle commits once: one table (a
        // sparse one, not a bulk load: checked below), and a cycle somebody waits for (a
        // background one may give way to `flush()` after its entry left).
        let early = self.ship.collecting()
            && tables.len() == 1
            && !self.early_blocked.load(Ordering::Relaxed)
            && self.storage.environments() == 1
            && !self.lock().background
            && self.ship.early();
        for (name, table) in tables {
            let wrote = match &table {
                Table::Sparse(t) => match self.flush_sparse(&name, t, &table, cycle, early)? {
                    Some(wrote) => wrote,
                    None => {
                        done.superseded = true;
                        break;
                    }
                },
                Table::Dense(t) => self.flush_dense(&name, t, &table, cycle)?,
            };
            done.wrote |= wrote;
        }
        if !done.wrote && !done.superseded && self.ship.collecting() && self.ship.has_pending() {
            // Tables created or dropped since the last cycle: an entry of their own.
            self.storage
                .write(|w| w.put_meta(CYCLE_KEY, &cycle.to_le_bytes()))?;
            self.committed.store(true, Ordering::Relaxed);
            done.wrote = true;
        }
        Ok(done)
    }

    /// The record to write for `table`, unless it equals the last one written.
    fn record_if_changed(&self, name: &str, table: &Table) -> Option<Vec<u8>> {
        let rec = TableRecord::of(table).to_json();
        let written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        (written.get(name) != Some(&rec)).then_some(rec)
    }

    fn record_written(&self, name: &str, rec: Vec<u8>) {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), rec);
    }

    /// Writes a table's changes: whether it wrote anything, or None when `flush()` superseded
    /// the write (its rows are marked again).
    fn flush_sparse(
        &self,
        name: &str,
        t: &SparseTable,
        table: &Table,
        cycle: u64,
        early: bool,
    ) -> Result<Option<bool>> {
        let mut taken: Vec<Taken> = Vec::new();
        let mut bytes = 0;
        let rec = {
            // No push runs while the shards are taken: each is taken whole, with the record
            // (its seq) that matches the rows.
            let _held = t.hold_changes();
            let gen = self.log_gen();
            // The pushes wait meanwhile: take the shards on all cores.
            let all: Vec<Taken> = t.take_all(gen, &|| self.spare.take());
            for one in all {
                if one.ids.is_empty() && one.forget.is_empty() {
                    self.spare.give_back(one);
                    continue;
                }
                bytes += one.words.len() * 4 + one.ids.len() * 8 + one.gone.len() * 8;
                taken.push(one);
            }
            (
                self.record_if_changed(name, table),
                t.seq(),
                t.take_applied(),
            )
        };
        let (rec, seq, applied) = rec;
        if taken.is_empty() && rec.is_none() && applied.is_none() {
            return Ok(Some(false));
        }
        if bytes > ONE_TXN_BYTES {
            // A bulk load: bounded transactions; the record goes with the last.
            let mut rest = taken.into_iter().peekable();
            let mut chunk = Vec::new();
            let mut size = 0;
            while let Some(one) = rest.next() {
                size += one.words.len() * 4 + one.ids.len() * 8 + one.gone.len() * 8;
                chunk.push(one);
                if size >= CHUNK_BYTES && rest.peek().is_some() {
                    if let Err(e) =
                        self.write_chunk(name, t, &mut chunk, cycle, seq, None, None, false, false)
                    {
                        for one in rest {
                            t.untake(&one);
                        }
                        if applied.is_some() {
                            t.untake_applied();
                        }
                        return Err(e);
                    }
                    size = 0;
                }
            }
            taken = chunk;
        }
        // A bulk load's earlier chunks have committed under this cycle's number: its last chunk
        // does not give way (the number must then count as written).
        let supersedable = bytes <= ONE_TXN_BYTES;
        let had_applied = applied.is_some();
        let wrote = self.write_chunk(
            name,
            t,
            &mut taken,
            cycle,
            seq,
            rec.clone(),
            applied,
            supersedable,
            early && supersedable,
        );
        if !matches!(wrote, Ok(true)) && had_applied {
            t.untake_applied();
        }
        if !wrote? {
            return Ok(None);
        }
        if let Some(rec) = rec {
            self.record_written(name, rec);
        }
        Ok(Some(true))
    }

    /// Tests: the failure the next transaction of `write_chunk` meets (see `fail_next`),
    /// once the test lets it go.
    #[cfg(test)]
    fn test_fault(&self) -> Option<Error> {
        let go = self
            .fail_next
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let _ = go.recv();
        Some(storage("a commit failed (test)"))
    }

    #[cfg(not(test))]
    #[inline(always)]
    fn test_fault(&self) -> Option<Error> {
        None
    }

    /// Writes what `chunk` took in one transaction; on failure, gives it back to the table
    /// (and the rest of the cycle is left for the next one). False when the write gave way to
    /// `flush()` (if `supersedable`; see `Flusher::supersede`): nothing was committed and the
    /// rows are marked again.
    #[allow(clippy::too_many_arguments)]
    fn write_chunk(
        &self,
        name: &str,
        t: &SparseTable,
        chunk: &mut Vec<Taken>,
        cycle: u64,
        seq: u64,
        record: Option<Vec<u8>>,
        applied: Option<Vec<Vec<u8>>>,
        supersedable: bool,
        early: bool,
    ) -> Result<bool> {
        let superseded = || supersedable && self.supersede.load(Ordering::Relaxed);
        let m = t.row_words();
        let tag = cycle.to_le_bytes();
        let st = &self.storage;
        let n = st.environments();
        // Each database is written in key order: consecutive puts then land on the same leaf
        // page, already in cache and already copied for this transaction.
        let orders: Vec<Vec<u32>> = chunk.iter().map(|t| key_order(&t.ids)).collect();
        // The environments hold consecutive key ranges: per shard taken, where each one's rows
        // start and end in the key order.
        let bounds: Vec<Vec<usize>> = chunk
            .iter()
            .zip(&orders)
            .map(|(t, o)| {
                (0..=n)
                    .map(|p| o.partition_point(|&i| st.environment_of(t.ids[i as usize]) < p))
                    .collect()
            })
            .collect();
        // Environment 0 always (it holds the record and the cycle); the others when they have
        // something to write.
        let which: Vec<usize> = (0..n)
            .filter(|&p| {
                p == 0
                    || chunk.iter().zip(&bounds).any(|(t, b)| {
                        b[p] < b[p + 1] || t.gone.iter().any(|&id| st.environment_of(id) == p)
                    })
            })
            .collect();
        let write = |p: usize, w: &mut crate::storage::Writer<'_>| -> Result<()> {
            let (rows, changed) = (w.open(Db::Rows, name)?, w.open(Db::Changed, name)?);
            for ((taken, order), b) in chunk.iter().zip(&orders).zip(&bounds) {
                if superseded() {
                    return Err(storage("the write gave way to flush()"));
                }
                let mine = &order[b[p]..b[p + 1]];
                let sorted: Vec<(u64, &[u8])> = mine
                    .iter()
                    .map(|&i| {
                        let i = i as usize;
                        (taken.ids[i], bytes_of(&taken.words[i * m..(i + 1) * m]))
                    })
                    .collect();
                w.put_rows_in_order(&rows, &sorted)?;
                // Only a row's first change in the log generation writes its entry: later ones
                // find it there, with a cycle after the last snapshot's.
                for &i in mine.iter().filter(|&&i| taken.log[i as usize]) {
                    w.put_in(&changed, taken.ids[i as usize], &tag)?;
                }
                for &id in taken.gone.iter().filter(|&&id| st.environment_of(id) == p) {
                    w.delete(Db::Rows, name, id)?;
                    w.put(Db::Removed, name, id, &tag)?;
                }
            }
            if p == 0 {
                if let Some(rec) = &record {
                    w.put_meta(&table_key(name), rec)?;
                }
                if let Some(a) = applied.as_ref().and_then(|a| a.first()) {
                    // The request ids of the writes whose rows this transaction carries.
                    w.put_meta(&applied_key(name), a)?;
                }
                w.put_meta(CYCLE_KEY, &tag)?;
            } else {
                // Each environment commits on its own: it keeps the cycle and the table's seq
                // its rows belong to, so that a reopen after a crash between the commits
                // numbers cycles and row versions past everything any environment holds.
                w.put_part_meta(p, CYCLE_KEY, &tag)?;
                w.put_part_meta(p, &seq_key(name), &seq.to_le_bytes())?;
                if let Some(a) = applied.as_ref().and_then(|a| a.get(p)) {
                    // Its own set: the writes whose rows in this environment it commits.
                    w.put_part_meta(p, &applied_key(name), a)?;
                }
            }
            Ok(())
        };
        // The transactions only (no table lock is held in them) may run at idle priority. With
        // several environments each is written and committed by a thread of its own, except in
        // a background cycle (nobody waits for it): that one writes them in turn on this
        // thread, so that training, which fills the cores then, has one idle writer beside it,
        // not one per environment (measured: two idle writers slowed W5's training loop at 8M
        // rows). When one environment fails, the others may have committed: every row is given
        // back below all the same, and the next cycle writes them again.
        let parallel = !self.lock().background;
        if early {
            // The entry leaves before the commit, so that followers write it while this
            // store does (decision 0116); `run` then says whether it committed.
            for taken in chunk.iter() {
                self.ship.rows(name, &taken.ids, &taken.words, &taken.gone);
            }
            let a = applied.as_ref().and_then(|a| a.first()).cloned();
            self.ship.meta(name, record.clone(), None, a);
            self.ship.publish_early(cycle);
            self.shipped_early.store(true, Ordering::Relaxed);
        }
        let r = match self.test_fault() {
            Some(e) => Err(e),
            None => st.write_each(&which, parallel, &|| self.idle.writing(), &write),
        };
        match r {
            Ok(()) => {
                self.committed.store(true, Ordering::Relaxed);
                let ship = self.ship.collecting() && !early;
                for taken in chunk.drain(..) {
                    if ship {
                        self.ship.rows(name, &taken.ids, &taken.words, &taken.gone);
                    }
                    t.forget(&taken);
                    self.spare.give_back(taken);
                }
                if ship {
                    let applied = applied.as_ref().and_then(|a| a.first()).cloned();
                    self.ship.meta(name, record, None, applied);
                }
                Ok(true)
            }
            Err(e) => {
                for taken in chunk.drain(..) {
                    t.untake(&taken);
                    self.spare.give_back(taken);
                }
                if superseded() {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }

    fn flush_dense(&self, name: &str, t: &DenseTable, table: &Table, cycle: u64) -> Result<bool> {
        let (value, applied, rec) = t.take_dirty_words(|| self.record_if_changed(name, table));
        if value.is_none() && rec.is_none() && applied.is_none() {
            return Ok(false);
        }
        let tag = cycle.to_le_bytes();
        let writing = self.idle.writing();
        let r = self.storage.write(|w| {
            if let Some(v) = &value {
                w.put_meta(&dense_key(name), bytes_of(v))?;
            }
            if let Some(rec) = &rec {
                w.put_meta(&table_key(name), rec)?;
            }
            if let Some(a) = applied.as_ref().and_then(|a| a.first()) {
                // The request ids of the pushes this value holds (a dense table lives in
                // environment 0).
                w.put_meta(&applied_key(name), a)?;
            }
            w.put_meta(CYCLE_KEY, &tag)
        });
        drop(writing);
        match r {
            Ok(()) => {
                self.committed.store(true, Ordering::Relaxed);
                if self.ship.collecting() {
                    let a = applied.as_ref().and_then(|a| a.first()).cloned();
                    self.ship.meta(name, rec.clone(), value, a);
                }
                if let Some(rec) = rec {
                    self.record_written(name, rec);
                }
                Ok(true)
            }
            Err(e) => {
                if value.is_some() {
                    t.mark_dirty();
                }
                if applied.is_some() {
                    t.common().applied.untake();
                }
                Err(e)
            }
        }
    }
}

impl ChangeHook for Flusher {
    fn before_change(&self) -> Result<()> {
        self.check()
    }
    fn after_change(&self) -> Result<()> {
        self.after_push()
    }
    fn revert_caveat(&self) -> &'static str {
        if self.storage.environments() > 1 {
            " as the replica holds it (with several environments, the rows of environments \
             whose commit succeeded are kept)"
        } else {
            ""
        }
    }
}

/// Buffers of earlier flushes, for the next ones to take: a flush copies every changed row out
/// of the shards, and fresh buffers for that would cost a page fault and a zeroed page for every
/// 4 KiB copied, each cycle. At most [`Spare::KEEP`] bytes are kept.
#[derive(Default)]
struct Spare(Mutex<Vec<(Vec<u64>, Vec<u32>)>>);

impl Spare {
    /// The most bytes of buffers kept between flushes (a single transaction's worth).
    const KEEP: usize = ONE_TXN_BYTES;

    /// Empty buffers, reused if any are kept.
    fn take(&self) -> (Vec<u64>, Vec<u32>) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        v.pop().unwrap_or_default()
    }

    /// Keeps the buffers of `t` for later flushes, up to [`Spare::KEEP`] bytes in all.
    fn give_back(&self, t: Taken) {
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

/// What a cycle did.
#[derive(Default)]
struct CycleDone {
    /// It committed something.
    wrote: bool,
    /// `flush()` superseded its write: tables after the superseded one were not taken.
    superseded: bool,
}

/// The positions of `ids` in the order of their LMDB keys ([`crate::storage::key`]).
fn key_order(ids: &[u64]) -> Vec<u32> {
    let mut order: Vec<([u8; 8], u32)> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| (crate::storage::key(id), i as u32))
        .collect();
    order.sort_unstable();
    order.into_iter().map(|(_, i)| i).collect()
}
