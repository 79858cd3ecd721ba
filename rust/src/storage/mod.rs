//! The LMDB replica of a durable store (format in docs/FORMAT.md).
//!
//! One or several LMDB environments per store directory (the directory itself, holding `meta`
//! and the first key range, and `env-<k>` for the others), each with its own writer, so several
//! threads can write a flush cycle at once. The in-memory tables stay the hot copy; this module
//! only moves bytes: it opens and checks the environments, runs write transactions (growing a
//! map when it fills), and gives readers a view.
//!
//! Every key of a table's database is the id's placement hash (`mix64(id)`, the hash whose high
//! bits choose the shard) as 8 big-endian bytes: the rows of one shard, for any shard count, are
//! one contiguous key range, so a flush that writes shard after shard writes LMDB pages in order
//! (a cycle rewrites each page it touches once, not once per shard). The id itself is in the value:
//! a row's value is the id (u64 LE) then the row's words after its id (u32 LE); a `changed` or
//! `removed` value is the cycle (u64 LE) then the id (u64 LE).
//!
//! `format` holds the on-disk format (keys, values, the format record and its checks), `read`
//! and `write` the transactions, `inspect` the read-only look at a store directory.

mod check;
mod format;
mod groupsum;
mod inspect;
mod read;
mod write;

pub use check::check_data_file;
pub use format::{
    bytes_of, check_row, cycle_of, encode_row, key, row_sum, row_value_len, words_into, Db,
    FormatRecord, DEFAULT_MAP_SIZE, FORMAT_NAME, FORMAT_VERSION, MAX_ENVIRONMENTS, ROW_SUM_BYTES,
};
pub use inspect::{inspect, StoreSummary};
pub use read::{DbHandle, Reader};
pub use write::Writer;

use format::{
    check_format, decode, part_dir, part_of_key, PartRecord, MAX_DBS, ROW_SUMS_KEY, ROW_SUMS_SINCE,
};

use std::collections::HashMap;
use std::fs::File;
use std::ops::Bound;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, RwLock, TryLockError};

use heed::types::Bytes;
use heed::{Database, Env, EnvOpenOptions, MdbError, RoTxn, WithoutTls};

use crate::error::{corrupt, invalid, storage, Error, Result};

fn lmdb_err(path: &Path, what: &str, e: heed::Error) -> Error {
    // LMDB reports a short write (what a full disk or a file size limit causes) as EIO.
    let full = match &e {
        heed::Error::Io(io) => matches!(
            io.raw_os_error(),
            Some(libc::EIO | libc::ENOSPC | libc::EFBIG | libc::EDQUOT)
        ),
        _ => false,
    };
    let hint = if full {
        " (the disk may be full or failing: free space and the store goes on)"
    } else {
        ""
    };
    storage(format!(
        "{what} the LMDB replica at {}: {e}{hint}",
        path.display()
    ))
}

fn is_map_full(e: &heed::Error) -> bool {
    matches!(e, heed::Error::Mdb(MdbError::MapFull))
}

/// One LMDB environment of a store: the store directory itself (environment 0, which also holds
/// `meta`) or its sub-directory `env-<k>`.
struct Part {
    dir: PathBuf,
    env: Env<WithoutTls>,
    /// Its `meta` database (the store's in environment 0; the `part` record, the last cycle
    /// and table sequence numbers it wrote in the others).
    meta: Database<Bytes, Bytes>,
    /// Readers and writers hold it shared; growing the map takes it alone (LMDB allows a resize
    /// only while no transaction is open).
    gate: RwLock<usize>,
    /// Serialises writers (LMDB has one writer per environment; this keeps the resize retry
    /// simple).
    writer: Mutex<()>,
    /// Whether its rows carry checksums (format version 3, or upgraded and marked).
    sums: bool,
}

impl Part {
    /// Its data file, as errors name it.
    fn file(&self) -> PathBuf {
        self.dir.join("data.mdb")
    }
}

/// Opens (creating when `create`) the LMDB environment in `dir`, its map at least `map_size`
/// and twice its data file.
fn open_env(dir: &Path, create: bool, map_size: usize) -> Result<(Env<WithoutTls>, usize)> {
    if create {
        std::fs::create_dir_all(dir)
            .map_err(|e| storage(format!("creating {}: {e}", dir.display())))?;
    }
    // A data file cut short would be mapped past its end (SIGBUS on the first read there).
    check_data_file(dir, "store")?;
    let page = crate::buffer::page_size();
    let map_size = map_size.max(page).div_ceil(page) * page;
    let existing = std::fs::metadata(dir.join("data.mdb"))
        .map(|m| m.len() as usize)
        .unwrap_or(0);
    let map_size = map_size.max((existing * 2).div_ceil(page) * page);
    let mut opts = EnvOpenOptions::new().read_txn_without_tls();
    opts.map_size(map_size).max_dbs(MAX_DBS).max_readers(1024);
    // SAFETY: the store directory is locked (`pstore.lock`) before any of its environments is
    // opened, so no other process (nor another Store of this one) opens them while we hold it.
    let env = unsafe { opts.open(dir) }.map_err(|e| lmdb_err(dir, "opening", e))?;
    Ok((env, map_size))
}

/// The names of a table's databases held by an environment whose table has no record: left by
/// a crash between the steps of creating or dropping a table.
fn orphans(
    env: &Env<WithoutTls>,
    txn: &RoTxn<'_>,
    live: &dyn Fn(&str) -> bool,
) -> heed::Result<Vec<String>> {
    let mut out = Vec::new();
    let Some(main): Option<Database<Bytes, Bytes>> = env.open_database(txn, None)? else {
        return Ok(out);
    };
    for item in main.iter(txn)? {
        let (k, _) = item?;
        let name = String::from_utf8_lossy(k);
        let table = [Db::Rows, Db::Changed, Db::Removed]
            .iter()
            .find_map(|db| name.strip_prefix(db.prefix()));
        if let Some(t) = table {
            if !live(t) {
                out.push(name.into_owned());
            }
        }
    }
    Ok(out)
}

/// A table's database in one environment: (environment, role, table).
type DbKey = (usize, Db, String);

/// An open store directory.
pub struct Storage {
    path: PathBuf,
    /// Held for the life of the store: one process owns a store directory.
    _lock: File,
    /// The environments; rows go to `part_of_key(key, parts.len())`.
    parts: Vec<Part>,
    /// `meta`, in environment 0.
    meta: Database<Bytes, Bytes>,
    dbs: Mutex<HashMap<DbKey, Database<Bytes, Bytes>>>,
    /// Called before waiting for the writer (the flusher's writes may run at idle priority:
    /// this lifts them).
    on_wait: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Storage {
    /// Opens the store directory `path`, creating it when `create` and it holds no store yet
    /// (with `environments` LMDB environments; an existing store keeps the number it was created
    /// with). Returns the storage and whether it was created now. A directory of another format
    /// or version is refused.
    pub fn open(
        path: &Path,
        create: bool,
        map_size: usize,
        environments: usize,
    ) -> Result<(Self, bool)> {
        if !(1..=MAX_ENVIRONMENTS).contains(&environments) {
            return Err(invalid(format!(
                "environments must be between 1 and {MAX_ENVIRONMENTS}, got {environments}"
            )));
        }
        let io = |what: &str, e: std::io::Error| storage(format!("{what} {}: {e}", path.display()));
        if !path.exists() {
            if !create {
                return Err(invalid(format!("no store at {}", path.display())));
            }
            std::fs::create_dir_all(path).map_err(|e| io("creating", e))?;
        } else if !path.is_dir() {
            return Err(invalid(format!(
                "{} is not a directory (a store is a directory)",
                path.display()
            )));
        }
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path.join("pstore.lock"))
            .map_err(|e| io("locking", e))?;
        // SAFETY: flock on a valid descriptor we own; it only reads its arguments.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(storage(format!(
                "the store at {} is open in another process (or another Store of this one)",
                path.display()
            )));
        }
        let fresh = !path.join("data.mdb").exists();
        if fresh && !create {
            return Err(invalid(format!("no store at {}", path.display())));
        }
        let (env, size) = open_env(path, false, map_size)?;
        let mut wtxn = env.write_txn().map_err(|e| lmdb_err(path, "opening", e))?;
        // An environment holding anything but our databases is somebody else's: refuse it. An
        // empty one is a store whose creation was interrupted.
        let main: Option<Database<Bytes, Bytes>> = env
            .open_database(&wtxn, None)
            .map_err(|e| lmdb_err(path, "reading", e))?;
        let empty = match main {
            None => true,
            Some(m) => m
                .is_empty(&wtxn)
                .map_err(|e| lmdb_err(path, "reading", e))?,
        };
        let has_meta = env
            .open_database::<Bytes, Bytes>(&wtxn, Some("meta"))
            .map_err(|e| lmdb_err(path, "reading", e))?
            .is_some();
        if !empty && !has_meta {
            return Err(corrupt(format!(
                "{} holds an LMDB environment that is not a pstore store (no format record)",
                path.display()
            )));
        }
        let meta: Database<Bytes, Bytes> = env
            .create_database(&mut wtxn, Some("meta"))
            .map_err(|e| lmdb_err(path, "opening", e))?;
        let record = meta
            .get(&wtxn, b"format")
            .map_err(|e| lmdb_err(path, "reading", e))?
            .map(<[u8]>::to_vec);
        let (created, environments, version) = match record {
            None if fresh || empty => (true, environments, FORMAT_VERSION),
            None => {
                return Err(corrupt(format!(
                    "{} holds an LMDB environment that is not a pstore store (no format record)",
                    path.display()
                )))
            }
            Some(bytes) => {
                let rec = check_format(path, &bytes)?;
                (false, rec.environments as usize, rec.version)
            }
        };
        wtxn.commit().map_err(|e| lmdb_err(path, "opening", e))?;
        let mut parts = vec![Part {
            dir: path.to_path_buf(),
            env,
            meta,
            gate: RwLock::new(size),
            writer: Mutex::new(()),
            sums: version >= ROW_SUMS_SINCE,
        }];
        for k in 1..environments {
            parts.push(open_part(
                path,
                k,
                environments,
                created,
                map_size,
                version,
            )?);
        }
        let mut s = Self {
            path: path.to_path_buf(),
            _lock: lock,
            parts,
            meta,
            dbs: Mutex::new(HashMap::new()),
            on_wait: OnceLock::new(),
        };
        s.drop_orphans()?;
        if !created && version < ROW_SUMS_SINCE {
            s.add_row_sums(environments)?;
        }
        if created {
            // Written last: a store whose creation stopped before this is created again.
            let rec = FormatRecord {
                format: FORMAT_NAME.into(),
                version: FORMAT_VERSION,
                environments: environments as u32,
            };
            let bytes = serde_json::to_vec(&rec).map_err(|e| Error::Internal(e.to_string()))?;
            s.write(|w| w.put_meta("format", &bytes))?;
        }
        Ok((s, created))
    }

    /// Empties the table databases of tables without a record (a crash between the steps of
    /// creating or dropping a table leaves them).
    fn drop_orphans(&self) -> Result<()> {
        let live: std::collections::HashSet<String> = self.read(|r| {
            Ok(r.meta_prefix("table/")?
                .into_iter()
                .map(|(k, _)| k["table/".len()..].to_string())
                .collect())
        })?;
        for part in &self.parts {
            let txn = part
                .env
                .read_txn()
                .map_err(|e| lmdb_err(&part.dir, "reading", e))?;
            let names = orphans(&part.env, &txn, &|t| live.contains(t))
                .map_err(|e| lmdb_err(&part.dir, "reading", e))?;
            // The sequence numbers and applied request ids another environment keeps of tables
            // (`seq/<name>`, `applied/<name>`).
            let mut keys = Vec::new();
            let prefixes: &[&[u8]] = if part.dir != self.path {
                &[b"seq/", b"applied/"]
            } else {
                &[]
            };
            for prefix in prefixes {
                for item in part
                    .meta
                    .prefix_iter(&txn, prefix)
                    .map_err(|e| lmdb_err(&part.dir, "reading", e))?
                {
                    let (k, _) = item.map_err(|e| lmdb_err(&part.dir, "reading", e))?;
                    if !live.contains(String::from_utf8_lossy(&k[prefix.len()..]).as_ref()) {
                        keys.push(k.to_vec());
                    }
                }
            }
            drop(txn);
            if names.is_empty() && keys.is_empty() {
                continue;
            }
            let mut w = part
                .env
                .write_txn()
                .map_err(|e| lmdb_err(&part.dir, "writing", e))?;
            for n in &names {
                let d: Option<Database<Bytes, Bytes>> = part
                    .env
                    .open_database(&w, Some(n))
                    .map_err(|e| lmdb_err(&part.dir, "reading", e))?;
                if let Some(d) = d {
                    d.clear(&mut w)
                        .map_err(|e| lmdb_err(&part.dir, "writing", e))?;
                }
            }
            for k in &keys {
                part.meta
                    .delete(&mut w, k)
                    .map_err(|e| lmdb_err(&part.dir, "writing", e))?;
            }
            w.commit()
                .map_err(|e| lmdb_err(&part.dir, "committing to", e))?;
        }
        Ok(())
    }

    /// Upgrades a store of format version 1 or 2 to version 3: every row value of each
    /// environment gets its checksum, in one write transaction per environment, environment 0
    /// (whose transaction also writes the format record) last. An environment upgraded before
    /// an interruption is marked (`row-sums` in its `meta`) and skipped when opened again.
    fn add_row_sums(&mut self, environments: usize) -> Result<()> {
        let n = self.parts.len();
        for k in (1..n).chain([0]) {
            if self.parts[k].sums {
                continue;
            }
            while !self.add_row_sums_in(k, environments)? {
                self.grow(k)?;
            }
            self.parts[k].sums = true;
        }
        Ok(())
    }

    /// [`Storage::add_row_sums`] of environment `k`: false if its map filled (nothing kept).
    fn add_row_sums_in(&self, k: usize, environments: usize) -> Result<bool> {
        /// Rows rewritten per batch (read, then put: a cursor cannot put while it reads).
        const BATCH_BYTES: usize = 16 << 20;
        let part = &self.parts[k];
        let r = (|| -> std::result::Result<(), AddSumsError> {
            let mut w = part.env.write_txn()?;
            let mut names = Vec::new();
            let main: Option<Database<Bytes, Bytes>> = part.env.open_database(&w, None)?;
            if let Some(m) = main {
                for item in m.iter(&w)? {
                    let (name, _) = item?;
                    if name.starts_with(Db::Rows.prefix().as_bytes()) {
                        names.push(String::from_utf8_lossy(name).into_owned());
                    }
                }
            }
            for name in &names {
                let Some(d): Option<Database<Bytes, Bytes>> =
                    part.env.open_database(&w, Some(name))?
                else {
                    continue;
                };
                let table = &name[Db::Rows.prefix().len()..];
                let mut after: Option<Vec<u8>> = None;
                loop {
                    let mut batch: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
                    let mut bytes = 0;
                    let range = match &after {
                        Some(a) => (Bound::Excluded(&a[..]), Bound::Unbounded),
                        None => (Bound::Unbounded, Bound::Unbounded),
                    };
                    for item in d.range(&w, &range)? {
                        let (key, v) = item?;
                        let (id, payload) = decode(Db::Rows, table, &part.dir, false, key, v)
                            .map_err(AddSumsError::Decode)?;
                        let mut value = Vec::with_capacity(row_value_len(payload.len()));
                        encode_row(id, payload, &mut value).map_err(heed::Error::Io)?;
                        bytes += value.len();
                        batch.push((key.to_vec(), value));
                        if bytes >= BATCH_BYTES {
                            break;
                        }
                    }
                    let Some((last, _)) = batch.last() else {
                        break;
                    };
                    after = Some(last.clone());
                    for (key, value) in &batch {
                        d.put(&mut w, key, value)?;
                    }
                }
            }
            if k == 0 {
                let rec = FormatRecord {
                    format: FORMAT_NAME.into(),
                    version: FORMAT_VERSION,
                    environments: environments as u32,
                };
                let bytes = serde_json::to_vec(&rec)
                    .map_err(|e| AddSumsError::Decode(Error::Internal(e.to_string())))?;
                part.meta.put(&mut w, b"format", &bytes)?;
            } else {
                part.meta.put(&mut w, ROW_SUMS_KEY.as_bytes(), b"crc32")?;
            }
            w.commit()?;
            Ok(())
        })();
        match r {
            Ok(()) => Ok(true),
            Err(AddSumsError::Lmdb(e)) if is_map_full(&e) => Ok(false),
            Err(AddSumsError::Lmdb(e)) => Err(lmdb_err(&part.dir, "adding row checksums to", e)),
            Err(AddSumsError::Decode(e)) => Err(e),
        }
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number of LMDB environments.
    pub fn environments(&self) -> usize {
        self.parts.len()
    }

    /// The environment that holds `id`'s rows.
    #[inline]
    pub fn environment_of(&self, id: u64) -> usize {
        part_of_key(key(id), self.parts.len())
    }

    /// Bytes of the maps (the most the data files may grow to before a map doubles).
    pub fn map_size(&self) -> usize {
        self.parts
            .iter()
            .map(|p| *p.gate.read().unwrap_or_else(|e| e.into_inner()))
            .sum()
    }

    /// Bytes of the data files on disk.
    pub fn file_size(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| {
                std::fs::metadata(p.dir.join("data.mdb"))
                    .map(|m| m.len())
                    .unwrap_or(0)
            })
            .sum()
    }

    fn db_name(db: Db, table: &str) -> String {
        format!("{}{table}", db.prefix())
    }

    /// The handle of a table's database in environment `k`, if created and committed.
    fn handle(&self, k: usize, db: Db, table: &str) -> Option<Database<Bytes, Bytes>> {
        let dbs = self.dbs.lock().unwrap_or_else(|e| e.into_inner());
        dbs.get(&(k, db, table.to_string())).copied()
    }

    /// The handles of a table's database in every environment (`None` if it has none).
    fn handles(&self, db: Db, table: &str) -> Option<DbHandle> {
        let d: Vec<_> = (0..self.parts.len())
            .map(|k| self.handle(k, db, table))
            .collect();
        d.iter().any(Option::is_some).then_some(DbHandle { db, d })
    }

    /// Creates (or opens) the databases of a table in every environment, committed, so readers
    /// find them.
    pub fn ensure_table(&self, table: &str) -> Result<()> {
        self.write(|w| {
            for db in [Db::Rows, Db::Changed, Db::Removed] {
                w.open(db, table)?;
            }
            Ok(())
        })
    }

    /// The value of a meta key as `txn` (a read or a write transaction of environment 0) sees it.
    fn meta_in(&self, txn: &RoTxn<'_>, key: &str) -> Result<Option<Vec<u8>>> {
        self.meta
            .get(txn, key.as_bytes())
            .map(|v| v.map(<[u8]>::to_vec))
            .map_err(|e| lmdb_err(&self.path, "reading", e))
    }

    /// Runs `f` with a read transaction per environment: a consistent view of the last committed
    /// state of each (of all of them together while no write commits meanwhile, which callers
    /// that need it arrange: the flusher's cycles held off, or [`Storage::read_exclusive`]).
    pub fn read<R>(&self, f: impl FnOnce(&Reader<'_>) -> Result<R>) -> Result<R> {
        let _gates: Vec<_> = self
            .parts
            .iter()
            .map(|p| p.gate.read().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let txns = self
            .parts
            .iter()
            .map(|p| p.env.read_txn().map_err(|e| lmdb_err(&p.dir, "reading", e)))
            .collect::<Result<Vec<_>>>()?;
        f(&Reader {
            storage: self,
            txns,
        })
    }

    /// Locks the writer of every environment, in order (lifting an idle write first if one
    /// holds a lock).
    fn lock_writers(&self) -> Vec<std::sync::MutexGuard<'_, ()>> {
        self.parts
            .iter()
            .map(|p| match p.writer.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    if let Some(lift) = self.on_wait.get() {
                        lift();
                    }
                    p.writer.lock().unwrap_or_else(|e| e.into_inner())
                }
            })
            .collect()
    }

    /// Like [`Storage::read`], with no write committing meanwhile: what `f` reads stays the
    /// newest state until it returns.
    pub fn read_exclusive<R>(&self, f: impl FnOnce(&Reader<'_>) -> Result<R>) -> Result<R> {
        let _all = self.lock_writers();
        self.read(f)
    }

    /// Sets what to call before waiting for a write in progress (once).
    pub(crate) fn set_on_wait(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_wait.set(f);
    }

    /// Runs `f` in one write transaction per environment it writes to and commits them (to
    /// disk, with fsync), environment 0 (which holds `meta`) last. When a map is full the
    /// transactions are dropped, that map doubles and `f` runs again, so `f` must be
    /// repeatable. On any other error nothing of `f` is kept, unless a commit itself fails after
    /// another environment's committed (a crash or a full disk in between): what committed
    /// stays, each row whole.
    pub fn write<R>(&self, f: impl FnMut(&mut Writer<'_>) -> Result<R>) -> Result<R> {
        let _all = self
            .parts
            .iter()
            .map(|p| p.writer.lock().unwrap_or_else(|e| e.into_inner()))
            .collect::<Vec<_>>();
        self.write_locked(None, f)
    }

    /// Runs `f(k, writer)` for each environment `k` of `which`, each in its own write
    /// transaction on a thread of its own (the calling thread takes the first), so the
    /// environments are written and committed in parallel; the first error, if any. A writer
    /// given to `f` writes environment `k` only (and `meta` when `k` is 0). Each transaction
    /// commits on its own: when one fails, the others may have committed.
    ///
    /// Each thread calls `enter` first and holds what it returns until its transaction has
    /// committed (the flusher's idle priority). Unless `parallel`, the calling thread writes
    /// the environments one after the other instead (environment 0 last) and stops at the first
    /// error.
    pub fn write_each<G>(
        &self,
        which: &[usize],
        parallel: bool,
        enter: &(dyn Fn() -> G + Sync),
        f: &(dyn Fn(usize, &mut Writer<'_>) -> Result<()> + Sync),
    ) -> Result<()> {
        let one = |k: usize| -> Result<()> {
            let _entered = enter();
            let _held = self.parts[k]
                .writer
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.write_locked(Some(k), |w| f(k, w))
        };
        if !parallel {
            let rest = which.iter().filter(|&&k| k != 0);
            let zero = which.iter().filter(|&&k| k == 0);
            return rest.chain(zero).try_for_each(|&k| one(k));
        }
        let Some((&first, rest)) = which.split_first() else {
            return Ok(());
        };
        std::thread::scope(|s| {
            let others: Vec<_> = rest
                .iter()
                .map(|&k| {
                    std::thread::Builder::new()
                        .name("pstore-writer".into())
                        .spawn_scoped(s, move || one(k))
                })
                .collect();
            let mut r = one(first);
            for h in others {
                let got = match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(Error::Internal("a writer thread panicked".into()))
                    }),
                    Err(e) => Err(storage(format!("starting a writer thread: {e}"))),
                };
                if r.is_ok() {
                    r = got;
                }
            }
            r
        })
    }

    /// The write loop of [`Storage::write`] (`only`: one environment), writer locks held.
    fn write_locked<R>(
        &self,
        only: Option<usize>,
        mut f: impl FnMut(&mut Writer<'_>) -> Result<R>,
    ) -> Result<R> {
        loop {
            let full = {
                let _gates: Vec<_> = self
                    .parts
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| only.is_none_or(|o| o == *k))
                    .map(|(_, p)| p.gate.read().unwrap_or_else(|e| e.into_inner()))
                    .collect();
                let mut w = Writer {
                    storage: self,
                    txns: (0..self.parts.len()).map(|_| None).collect(),
                    only,
                    map_full: None,
                    created: Vec::new(),
                };
                let r = f(&mut w);
                match (r, w.map_full) {
                    (_, Some(k)) => k,
                    (Err(e), None) => return Err(e),
                    (Ok(r), None) => match w.commit() {
                        Ok(()) => return Ok(r),
                        Err(Ok(k)) => k,
                        Err(Err(e)) => return Err(e),
                    },
                }
            };
            self.grow(full)?;
        }
    }

    /// Doubles the map of environment `k`. No transaction of it is open: its gate is held alone.
    fn grow(&self, k: usize) -> Result<()> {
        let part = &self.parts[k];
        let mut size = part.gate.write().unwrap_or_else(|e| e.into_inner());
        let new = size
            .checked_mul(2)
            .ok_or_else(|| storage("the LMDB map cannot grow past the address space"))?;
        // SAFETY: the gate is held exclusively, so no transaction of this process is open in
        // this environment, and the directory lock keeps every other process out.
        unsafe { part.env.resize(new) }.map_err(|e| lmdb_err(&part.dir, "growing", e))?;
        *size = new;
        Ok(())
    }
}

/// Why [`Storage::add_row_sums_in`] stopped.
enum AddSumsError {
    Lmdb(heed::Error),
    Decode(Error),
}

impl From<heed::Error> for AddSumsError {
    fn from(e: heed::Error) -> Self {
        AddSumsError::Lmdb(e)
    }
}

/// Opens environment `k` >= 1 of `n` of the store at `path` (creating it when `create`), and
/// checks (or writes) its `part` record. `version`: the store's format version.
fn open_part(
    path: &Path,
    k: usize,
    n: usize,
    create: bool,
    map_size: usize,
    version: u32,
) -> Result<Part> {
    let dir = part_dir(path, k);
    if !create && !dir.join("data.mdb").is_file() {
        return Err(corrupt(format!(
            "{}: environment {k} of {n} ({}) is missing",
            path.display(),
            dir.display()
        )));
    }
    let (env, size) = open_env(&dir, create, map_size)?;
    let want = PartRecord {
        format: FORMAT_NAME.into(),
        environment: k,
        environments: n,
    };
    let err = |what: &str, e| lmdb_err(&dir, what, e);
    let mut w = env.write_txn().map_err(|e| err("opening", e))?;
    let meta: Database<Bytes, Bytes> = env
        .create_database(&mut w, Some("meta"))
        .map_err(|e| err("opening", e))?;
    let found: Option<PartRecord> = meta
        .get(&w, b"part")
        .map_err(|e| err("reading", e))?
        .and_then(|v| serde_json::from_slice(v).ok());
    if create {
        let bytes = serde_json::to_vec(&want).map_err(|e| Error::Internal(e.to_string()))?;
        meta.put(&mut w, b"part", &bytes)
            .map_err(|e| err("writing", e))?;
    } else if found.as_ref() != Some(&want) {
        return Err(corrupt(format!(
            "{} is not environment {k} of {n} of the store at {} (its part record: {found:?})",
            dir.display(),
            path.display()
        )));
    }
    let sums = version >= ROW_SUMS_SINCE
        || meta
            .get(&w, ROW_SUMS_KEY.as_bytes())
            .map_err(|e| err("reading", e))?
            .is_some();
    w.commit().map_err(|e| err("opening", e))?;
    Ok(Part {
        dir,
        env,
        meta,
        gate: RwLock::new(size),
        writer: Mutex::new(()),
        sums,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pstore-storage-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Rows `(id, value)` in key order.
    fn in_key_order(rows: &mut [(u64, Vec<u32>)]) {
        rows.sort_by_key(|(id, _)| key(*id));
    }

    #[test]
    fn rows_put_in_order_overwrite_and_insert_by_walk_and_by_descent() {
        let d = dir("in-order");
        let (s, _) = Storage::open(&d, true, 1 << 20, 1).unwrap();
        let words = 256;
        let mut rows: Vec<(u64, Vec<u32>)> = (0..3000u64).map(|id| (id, vec![1; words])).collect();
        in_key_order(&mut rows);
        let put = |rows: &[(u64, Vec<u32>)]| {
            s.write(|w| {
                let h = w.open(Db::Rows, "t")?;
                let v: Vec<(u64, &[u8])> = rows.iter().map(|(id, r)| (*id, bytes_of(r))).collect();
                w.put_rows_in_order(&h, &v)
            })
            .unwrap()
        };
        // Into an empty database (inserts), growing the 1 MiB map on the way.
        put(&rows);
        assert!(s.map_size() > 3 << 20);
        // Dense: every other stored row rewritten where it stands, plus 500 new ids.
        let mut dense: Vec<(u64, Vec<u32>)> = (0..3000u64)
            .step_by(2)
            .chain(10_000..10_500)
            .map(|id| (id, vec![id as u32 + 7; words]))
            .collect();
        in_key_order(&mut dense);
        put(&dense);
        // Sparse: 20 rows among 3500, each found by a descent.
        let mut sparse: Vec<(u64, Vec<u32>)> = (1..3000u64)
            .step_by(150)
            .map(|id| (id, vec![9; words]))
            .collect();
        in_key_order(&mut sparse);
        put(&sparse);
        let mut want: std::collections::HashMap<u64, Vec<u32>> = rows.into_iter().collect();
        want.extend(dense);
        want.extend(sparse);
        s.read(|r| {
            assert_eq!(r.len(Db::Rows, "t")?, 3500);
            for (id, row) in &want {
                let mut got = Vec::new();
                words_into(r.get(Db::Rows, "t", *id)?.unwrap(), &mut got);
                assert_eq!(&got, row, "row {id}");
            }
            Ok(())
        })
        .unwrap();
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn rows_survive_reopen_and_the_map_grows() {
        let d = dir("grow");
        {
            let (s, created) = Storage::open(&d, true, 1 << 20, 1).unwrap();
            assert!(created);
            let row = vec![7u32; 1024];
            // 4 MiB of rows into a 1 MiB map: it must double a few times. (Databases of a table
            // without a record are emptied at open.)
            s.write(|w| {
                w.put_meta("table/t", b"{}")?;
                for id in 0..1000u64 {
                    w.put(Db::Rows, "t", id, bytes_of(&row))?;
                }
                Ok(())
            })
            .unwrap();
            assert!(s.map_size() > 4 << 20);
        }
        let (s, created) = Storage::open(&d, false, 1 << 20, 1).unwrap();
        assert!(!created);
        s.ensure_table("t").unwrap();
        s.read(|r| {
            assert_eq!(r.len(Db::Rows, "t")?, 1000);
            let v = r.get(Db::Rows, "t", 999)?.unwrap();
            let mut w = Vec::new();
            words_into(v, &mut w);
            assert_eq!(w, vec![7u32; 1024]);
            let mut ids = Vec::new();
            r.scan(Db::Rows, "t", |id, _| {
                ids.push(id);
                Ok(())
            })?;
            // Key order is placement-hash order.
            let mut want: Vec<u64> = (0..1000).collect();
            want.sort_by_key(|&id| crate::hash::mix64(id));
            assert_eq!(ids, want);
            Ok(())
        })
        .unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_second_open_is_refused_and_a_failed_write_keeps_nothing() {
        let d = dir("lock");
        let (s, _) = Storage::open(&d, true, 1 << 20, 1).unwrap();
        let e = Storage::open(&d, true, 1 << 20, 1).err().unwrap();
        assert!(matches!(e, Error::Storage(ref m) if m.contains("open in another")));
        let e = s
            .write(|w| {
                w.put(Db::Rows, "t", 1, b"abcd")?;
                Err::<(), _>(invalid("no"))
            })
            .unwrap_err();
        assert_eq!(e, invalid("no"));
        s.read(|r| {
            assert!(r.get(Db::Rows, "t", 1)?.is_none());
            Ok(())
        })
        .unwrap();
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_unknown_version_is_refused() {
        let d = dir("version");
        {
            let (s, _) = Storage::open(&d, true, 1 << 20, 1).unwrap();
            s.write(|w| w.put_meta("format", br#"{"format":"pstore-lmdb","version":99}"#))
                .unwrap();
        }
        let e = Storage::open(&d, false, 1 << 20, 1).err().unwrap();
        assert!(
            matches!(e, Error::Corrupt(ref m) if m.contains("version 99")),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Rows `0..n` of `words` words, each filled with `id + add`.
    fn rows_of(n: u64, words: usize, add: u32) -> Vec<(u64, Vec<u32>)> {
        let mut rows: Vec<(u64, Vec<u32>)> = (0..n)
            .map(|id| (id, vec![id as u32 + add; words]))
            .collect();
        in_key_order(&mut rows);
        rows
    }

    #[test]
    fn several_environments_split_rows_by_key_range_and_write_in_parallel() {
        let d = dir("environments");
        let n = 3;
        {
            let (s, created) = Storage::open(&d, true, 1 << 20, n).unwrap();
            assert!(created);
            assert_eq!(s.environments(), n);
            s.ensure_table("t").unwrap();
            s.write(|w| w.put_meta("table/t", b"{}")).unwrap();
            // Written by one transaction per environment, on three threads at once; 3 MiB of
            // rows grow each 1 MiB map.
            let rows = rows_of(3000, 256, 0);
            let write = |k: usize, w: &mut Writer<'_>| -> Result<()> {
                let h = w.open(Db::Rows, "t")?;
                let mine: Vec<(u64, &[u8])> = rows
                    .iter()
                    .filter(|(id, _)| s.environment_of(*id) == k)
                    .map(|(id, r)| (*id, bytes_of(r)))
                    .collect();
                w.put_rows_in_order(&h, &mine)?;
                if k == 0 {
                    w.put_meta("cycle", &1u64.to_le_bytes())?;
                }
                Ok(())
            };
            let threads = std::sync::Mutex::new(std::collections::HashSet::new());
            let enter = || {
                threads.lock().unwrap().insert(std::thread::current().id());
            };
            s.write_each(&[0, 1, 2], true, &enter, &write).unwrap();
            assert_eq!(threads.lock().unwrap().len(), 3, "a thread per environment");
            // In turn, on the calling thread only.
            threads.lock().unwrap().clear();
            s.write_each(&[0, 1, 2], false, &enter, &write).unwrap();
            let only: Vec<_> = threads.lock().unwrap().iter().copied().collect();
            assert_eq!(only, vec![std::thread::current().id()]);
            // A writer of one environment refuses the rows of another.
            let e = s
                .write_each(&[1], true, &|| (), &|_, w| {
                    w.put(Db::Rows, "t", rows[0].0, b"abcdefgh")
                })
                .unwrap_err();
            assert!(matches!(e, Error::Internal(_)), "{e}");
            // A write over all environments: rows of every range, in one call.
            let dense = rows_of(3000, 256, 5);
            let some: Vec<(u64, &[u8])> = dense
                .iter()
                .step_by(3)
                .map(|(id, r)| (*id, bytes_of(r)))
                .collect();
            s.write(|w| {
                let h = w.open(Db::Rows, "t")?;
                w.put_rows_in_order(&h, &some)
            })
            .unwrap();
            assert!(s.map_size() > 3 << 20);
        }
        for k in 1..n {
            assert!(d.join(format!("env-{k}")).join("data.mdb").is_file());
        }
        // Reopened asking for one environment: the store keeps its three.
        let (s, created) = Storage::open(&d, false, 1 << 20, 1).unwrap();
        assert!(!created);
        assert_eq!(s.environments(), n);
        s.ensure_table("t").unwrap();
        s.read(|r| {
            assert_eq!(r.len(Db::Rows, "t")?, 3000);
            let mut per = vec![0u64; n];
            let mut ids = Vec::new();
            r.scan(Db::Rows, "t", |id, v| {
                per[s.environment_of(id)] += 1;
                ids.push(id);
                let mut w = Vec::new();
                words_into(v, &mut w);
                let rank = (0..3000u64)
                    .filter(|&i| crate::hash::mix64(i) < crate::hash::mix64(id))
                    .count();
                let add = if rank % 3 == 0 { 5 } else { 0 };
                assert_eq!(w, vec![id as u32 + add; 256], "row {id}");
                Ok(())
            })?;
            let mut want: Vec<u64> = (0..3000).collect();
            want.sort_by_key(|&id| crate::hash::mix64(id));
            assert_eq!(ids, want, "one key order across the environments");
            assert!(per.iter().all(|&c| c > 800), "{per:?}");
            let h = r.open(Db::Rows, "t");
            assert!(r.get_in(h.as_ref(), "t", 2999)?.is_some());
            assert!(r.get_in(h.as_ref(), "t", 3000)?.is_none());
            assert_eq!(r.meta("cycle")?, Some(1u64.to_le_bytes().to_vec()));
            Ok(())
        })
        .unwrap();
        drop(s);
        let summary = inspect(&d).unwrap();
        assert_eq!(summary.format.environments, n as u32);
        assert_eq!(summary.format.version, FORMAT_VERSION);
        assert_eq!(summary.tables[0].2, 3000, "rows of every environment");
        // A missing environment is refused by name.
        std::fs::remove_dir_all(d.join("env-2")).unwrap();
        let e = Storage::open(&d, false, 1 << 20, 1).err().unwrap();
        assert!(
            matches!(e, Error::Corrupt(ref m) if m.contains("environment 2 of 3")),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn databases_without_a_table_record_are_emptied_at_open() {
        let d = dir("orphans");
        {
            let (s, _) = Storage::open(&d, true, 1 << 20, 2).unwrap();
            s.write(|w| {
                w.put_meta("table/kept", b"{}")?;
                for id in 0..200u64 {
                    w.put(Db::Rows, "kept", id, b"keep")?;
                    w.put(Db::Rows, "gone", id, b"gone")?;
                    w.put(Db::Changed, "gone", id, &[0; 8])?;
                }
                w.put_part_meta(1, "seq/kept", &7u64.to_le_bytes())?;
                w.put_part_meta(1, "seq/gone", &9u64.to_le_bytes())?;
                Ok(())
            })
            .unwrap();
        }
        let (s, _) = Storage::open(&d, false, 1 << 20, 2).unwrap();
        s.ensure_table("kept").unwrap();
        s.ensure_table("gone").unwrap();
        s.read(|r| {
            assert_eq!(r.len(Db::Rows, "kept")?, 200);
            assert_eq!(r.len(Db::Rows, "gone")?, 0);
            assert_eq!(r.len(Db::Changed, "gone")?, 0);
            assert_eq!(
                r.part_meta(1, "seq/kept")?,
                Some(7u64.to_le_bytes().to_vec())
            );
            assert_eq!(r.part_meta(1, "seq/gone")?, None);
            Ok(())
        })
        .unwrap();
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_version_1_store_reads_as_one_environment() {
        let d = dir("version-1");
        {
            let (s, _) = Storage::open(&d, true, 1 << 20, 1).unwrap();
            s.write(|w| w.put_meta("format", br#"{"format":"pstore-lmdb","version":1}"#))
                .unwrap();
        }
        let (s, _) = Storage::open(&d, false, 1 << 20, 4).unwrap();
        assert_eq!(s.environments(), 1);
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Every single-bit flip of a row value (id, header words, weights, state, checksum) is
    /// refused by name; an untouched value decodes to what was encoded.
    #[test]
    fn row_values_round_trip_and_every_bit_flip_is_detected() {
        let file = Path::new("store");
        for (n, id) in [
            (0usize, 0u64),
            (1, 7),
            (14, u64::MAX),
            (70, 0x0123_4567_89ab_cdef),
        ] {
            let payload: Vec<u8> = (0..n * 4)
                .map(|b| crate::hash::mix64(id ^ b as u64) as u8)
                .collect();
            let mut v = Vec::new();
            encode_row(id, &payload, &mut v).unwrap();
            assert_eq!(v.len(), row_value_len(payload.len()));
            let k = key(id);
            let (got, p) = check_row(file, "t", &k, &v).unwrap();
            assert_eq!((got, p), (id, &payload[..]));
            for bit in 0..v.len() * 8 {
                let mut bad = v.clone();
                bad[bit / 8] ^= 1 << (bit % 8);
                let e = check_row(file, "t", &k, &bad).unwrap_err();
                let m = e.to_string();
                assert!(matches!(e, Error::Corrupt(_)), "{m}");
                // The id is named even when the flip is in the stored id: from the key.
                assert!(
                    m.contains(&format!("row {id} is damaged")) && m.contains("store/data.mdb"),
                    "bit {bit}: {m}"
                );
                assert!(m.contains("table \"t\""), "{m}");
            }
            // Cut short, or a value of another format: refused.
            assert!(check_row(file, "t", &k, &v[..v.len() - 1]).is_err());
            assert!(check_row(file, "t", &k, &v[..8]).is_err());
        }
    }

    /// Writes `rows` into environment `k` of `s` as format version 2 stored them (no checksum).
    fn put_version_2(s: &Storage, k: usize, table: &str, rows: &[(u64, Vec<u32>)]) {
        let part = &s.parts[k];
        let mut w = part.env.write_txn().unwrap();
        let d: Database<Bytes, Bytes> = part
            .env
            .create_database(&mut w, Some(&format!("rows/{table}")))
            .unwrap();
        for (id, row) in rows {
            let mut v = id.to_le_bytes().to_vec();
            v.extend_from_slice(bytes_of(row));
            d.put(&mut w, &key(*id), &v).unwrap();
        }
        w.commit().unwrap();
    }

    #[test]
    fn a_version_2_store_gets_row_checksums_at_open() {
        let d = dir("version-2");
        let rows = rows_of(2000, 40, 3);
        let n = 2;
        {
            let (s, _) = Storage::open(&d, true, 1 << 20, n).unwrap();
            s.write(|w| {
                w.put_meta("table/t", b"{}")?;
                w.put_meta(
                    "format",
                    br#"{"format":"pstore-lmdb","version":2,"environments":2}"#,
                )
            })
            .unwrap();
            for k in 0..n {
                let mine: Vec<_> = rows
                    .iter()
                    .filter(|(id, _)| s.environment_of(*id) == k)
                    .cloned()
                    .collect();
                put_version_2(&s, k, "t", &mine);
            }
        }
        // Opened as it is, read-only: the format record still says version 2.
        assert_eq!(inspect(&d).unwrap().format.version, 2);
        // Opened (with a 1 MiB map, which the upgrade grows): every row has its checksum.
        let (s, _) = Storage::open(&d, false, 1 << 20, n).unwrap();
        s.ensure_table("t").unwrap();
        let check = |s: &Storage| {
            s.read(|r| {
                assert_eq!(r.len(Db::Rows, "t")?, 2000);
                let mut seen = 0;
                r.scan(Db::Rows, "t", |id, v| {
                    let mut w = Vec::new();
                    words_into(v, &mut w);
                    assert_eq!(w, vec![id as u32 + 3; 40], "row {id}");
                    seen += 1;
                    Ok(())
                })?;
                assert_eq!(seen, 2000);
                for k in 0..n {
                    let txn = &r.txns[k];
                    let d = s.handle(k, Db::Rows, "t").unwrap();
                    for item in d.iter(txn).unwrap() {
                        let (key, v) = item.unwrap();
                        check_row(Path::new("x"), "t", key, v).unwrap();
                    }
                }
                Ok(())
            })
            .unwrap()
        };
        check(&s);
        drop(s);
        assert_eq!(inspect(&d).unwrap().format.version, FORMAT_VERSION);
        // Opened again: nothing is added twice.
        let (s, _) = Storage::open(&d, false, 1 << 20, n).unwrap();
        s.ensure_table("t").unwrap();
        check(&s);
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_upgrade_interrupted_between_environments_goes_on() {
        let d = dir("upgrade-interrupted");
        let rows = rows_of(500, 8, 1);
        let n = 3;
        {
            let (s, _) = Storage::open(&d, true, 1 << 20, n).unwrap();
            s.write(|w| {
                w.put_meta("table/t", b"{}")?;
                let h = w.open(Db::Rows, "t")?;
                // Environments 1 and 2 upgraded (rows with checksums, marked) ...
                let upgraded: Vec<(u64, &[u8])> = rows
                    .iter()
                    .filter(|(id, _)| s.environment_of(*id) != 0)
                    .map(|(id, r)| (*id, bytes_of(r)))
                    .collect();
                w.put_rows_in_order(&h, &upgraded)?;
                w.put_part_meta(1, ROW_SUMS_KEY, b"crc32")?;
                w.put_part_meta(2, ROW_SUMS_KEY, b"crc32")?;
                w.put_meta(
                    "format",
                    br#"{"format":"pstore-lmdb","version":2,"environments":3}"#,
                )
            })
            .unwrap();
            // ... environment 0 not yet.
            let zero: Vec<_> = rows
                .iter()
                .filter(|(id, _)| s.environment_of(*id) == 0)
                .cloned()
                .collect();
            assert!(!zero.is_empty());
            put_version_2(&s, 0, "t", &zero);
        }
        let (s, _) = Storage::open(&d, false, 1 << 20, n).unwrap();
        s.ensure_table("t").unwrap();
        s.read(|r| {
            let mut seen = 0;
            r.scan(Db::Rows, "t", |id, v| {
                let mut w = Vec::new();
                words_into(v, &mut w);
                assert_eq!(w, vec![id as u32 + 1; 8], "row {id}");
                seen += 1;
                Ok(())
            })?;
            assert_eq!(seen, 500);
            Ok(())
        })
        .unwrap();
        drop(s);
        assert_eq!(inspect(&d).unwrap().format.version, FORMAT_VERSION);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_damaged_row_is_refused_by_get_and_scan_naming_table_id_and_file() {
        let d = dir("damaged");
        let (s, _) = Storage::open(&d, true, 1 << 20, 1).unwrap();
        let rows = rows_of(50, 6, 0);
        s.write(|w| {
            w.put_meta("table/t", b"{}")?;
            for (id, r) in &rows {
                w.put(Db::Rows, "t", *id, bytes_of(r))?;
            }
            Ok(())
        })
        .unwrap();
        // One bit of row 17's weights flipped behind pstore's back.
        {
            let part = &s.parts[0];
            let mut w = part.env.write_txn().unwrap();
            let db = s.handle(0, Db::Rows, "t").unwrap();
            let mut v = db.get(&w, &key(17)).unwrap().unwrap().to_vec();
            v[20] ^= 4;
            db.put(&mut w, &key(17), &v).unwrap();
            w.commit().unwrap();
        }
        let want = |e: Error| {
            let m = e.to_string();
            assert!(matches!(e, Error::Corrupt(_)), "{m}");
            assert!(
                m.contains("row 17 is damaged") && m.contains("table \"t\""),
                "{m}"
            );
            assert!(m.contains(&d.join("data.mdb").display().to_string()), "{m}");
        };
        s.read(|r| {
            assert!(r.get(Db::Rows, "t", 16)?.is_some());
            want(r.get(Db::Rows, "t", 17).unwrap_err());
            want(r.scan(Db::Rows, "t", |_, _| Ok(())).unwrap_err());
            // Rows read by id a group at a time: the rows before the damaged one are handed
            // on in order, then the damaged one is refused by name.
            let h = r.open(Db::Rows, "t");
            let mut out = Vec::new();
            let mut seen = Vec::new();
            let ids: Vec<u64> = (0..50).collect();
            want(
                r.rows_words_in(h.as_ref(), "t", &ids, &mut out, &mut |k, w| {
                    seen.push((k, w.to_vec()));
                    Ok(())
                })
                .unwrap_err(),
            );
            assert_eq!(
                seen.iter().map(|s| s.0).collect::<Vec<_>>(),
                (0..=16).collect::<Vec<_>>()
            );
            // Without it (and with an id that has no row): every other row, whole.
            seen.clear();
            let ids: Vec<u64> = (0..17).chain(18..50).chain([1000]).collect();
            r.rows_words_in(h.as_ref(), "t", &ids, &mut out, &mut |k, w| {
                seen.push((k, w.to_vec()));
                Ok(())
            })?;
            assert_eq!(seen.len(), 49);
            for (k, w) in &seen {
                assert_eq!(w, &vec![ids[*k] as u32; 6], "id {}", ids[*k]);
            }
            Ok(())
        })
        .unwrap();
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
