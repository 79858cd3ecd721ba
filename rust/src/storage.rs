//! The LMDB replica of a durable store (format in docs/FORMAT.md).
//!
//! One LMDB environment per store directory. The in-memory tables stay the hot copy; this module
//! only moves bytes: it opens and checks the environment, runs write transactions (growing the
//! map when it fills), and gives readers a consistent view.
//!
//! Every key of a table's database is the id's placement hash (`mix64(id)`, the hash whose high
//! bits choose the shard) as 8 big-endian bytes: the rows of one shard, for any shard count, are
//! one contiguous key range, so a flush that writes shard after shard writes LMDB pages in order
//! (a cycle rewrites each page it touches once, not once per shard). The id itself is in the value:
//! a row's value is the id (u64 LE) then the row's words after its id (u32 LE); a `changed` or
//! `removed` value is the cycle (u64 LE) then the id (u64 LE).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, RwLock, TryLockError};

use heed::types::Bytes;
use heed::{Database, Env, EnvOpenOptions, MdbError, RoTxn, RwTxn, WithoutTls};
use serde::{Deserialize, Serialize};

use crate::error::{corrupt, invalid, storage, Error, Result};

#[cfg(target_endian = "big")]
compile_error!("the LMDB replica stores little-endian words; big-endian hosts are not supported");

/// The format's name, in the `format` key of the meta database.
pub const FORMAT_NAME: &str = "pstore-lmdb";
/// The version of the on-disk format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The most named databases (three per table, so at most 1023 tables, plus `meta`).
const MAX_DBS: u32 = 3072;
/// The map a new environment starts with; it doubles whenever a write fills it.
pub const DEFAULT_MAP_SIZE: usize = 64 << 30;

/// The `format` record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormatRecord {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version.
    pub version: u32,
}

/// A database of the environment, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Db {
    /// `rows/<table>`: id -> row words.
    Rows,
    /// `changed/<table>`: id -> the flush cycle (u64 LE) that last wrote the row; kept until a
    /// snapshot covers it, for incremental snapshots.
    Changed,
    /// `removed/<table>`: id -> the flush cycle that deleted the row; kept until a snapshot
    /// covers it (tombstones of incremental snapshots).
    Removed,
}

impl Db {
    fn prefix(self) -> &'static str {
        match self {
            Db::Rows => "rows/",
            Db::Changed => "changed/",
            Db::Removed => "removed/",
        }
    }
}

/// The key of `id`: its placement hash, big-endian.
#[inline]
pub fn key(id: u64) -> [u8; 8] {
    crate::hash::mix64(id).to_be_bytes()
}

/// A cursor step costs about this fraction of a descent of the tree: a write walks a key range
/// when it rewrites at least one stored row in this many.
const WALK_PER_DESCENT: u64 = 8;

/// Writes the stored value of `id` with `payload` (the inverse of [`decode`]).
fn encode(db: Db, id: u64, payload: &[u8], out: &mut impl std::io::Write) -> std::io::Result<()> {
    match db {
        Db::Rows => {
            out.write_all(&id.to_le_bytes())?;
            out.write_all(payload)
        }
        Db::Changed | Db::Removed => {
            out.write_all(payload)?;
            out.write_all(&id.to_le_bytes())
        }
    }
}

/// The key of a cursor's entry, copied (`None` past the end).
fn key_of(entry: Option<heed::Result<(&[u8], &[u8])>>) -> heed::Result<Option<[u8; 8]>> {
    Ok(entry.transpose()?.and_then(|(k, _)| k.try_into().ok()))
}

/// The id and payload of a stored value.
fn decode<'v>(db: Db, table: &str, v: &'v [u8]) -> Result<(u64, &'v [u8])> {
    let bad = || {
        corrupt(format!(
            "table {table:?}: a value of {} bytes in {}{table}",
            v.len(),
            db.prefix()
        ))
    };
    let id = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    match db {
        Db::Rows if v.len() >= 8 => Ok((id(&v[..8]), &v[8..])),
        Db::Changed | Db::Removed if v.len() == 16 => Ok((id(&v[8..]), &v[..8])),
        _ => Err(bad()),
    }
}

/// The bytes of words (little-endian, as the host holds them).
#[inline]
pub fn bytes_of(words: &[u32]) -> &[u8] {
    // SAFETY: any u32 is 4 initialised bytes; u8 has alignment 1; the borrow is carried over.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// Appends the words of `bytes` (a multiple of 4, any alignment) to `out`.
pub fn words_into(bytes: &[u8], out: &mut Vec<u32>) {
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
}

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

/// An open store directory.
pub struct Storage {
    path: PathBuf,
    /// Held for the life of the store: one process owns a store directory.
    _lock: File,
    env: Env<WithoutTls>,
    meta: Database<Bytes, Bytes>,
    dbs: Mutex<HashMap<(Db, String), Database<Bytes, Bytes>>>,
    /// Readers and writers hold it shared; growing the map takes it alone (LMDB allows a resize
    /// only while no transaction is open).
    gate: RwLock<usize>,
    /// Serialises writers (LMDB has one writer; this keeps the resize retry simple).
    writer: Mutex<()>,
    /// Called before waiting for the writer (the flusher's writes may run at idle priority:
    /// this lifts them).
    on_wait: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Storage {
    /// Opens the store directory `path`, creating it when `create` and it holds no store yet.
    /// Returns the storage and whether it was created now. A directory of another format or
    /// version is refused.
    pub fn open(path: &Path, create: bool, map_size: usize) -> Result<(Self, bool)> {
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
        let page = page_size();
        let map_size = map_size.max(page).div_ceil(page) * page;
        let existing = std::fs::metadata(path.join("data.mdb"))
            .map(|m| m.len() as usize)
            .unwrap_or(0);
        let map_size = map_size.max((existing * 2).div_ceil(page) * page);
        let mut opts = EnvOpenOptions::new().read_txn_without_tls();
        opts.map_size(map_size).max_dbs(MAX_DBS).max_readers(1024);
        // SAFETY: the directory is locked above, so no other process (nor another Store in this
        // one) opens this environment while we hold it.
        let env = unsafe { opts.open(path) }.map_err(|e| lmdb_err(path, "opening", e))?;
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
        let created = match record {
            None if fresh || empty => {
                let rec = FormatRecord {
                    format: FORMAT_NAME.into(),
                    version: FORMAT_VERSION,
                };
                let bytes = serde_json::to_vec(&rec).map_err(|e| Error::Internal(e.to_string()))?;
                meta.put(&mut wtxn, b"format", &bytes)
                    .map_err(|e| lmdb_err(path, "writing", e))?;
                true
            }
            None => {
                return Err(corrupt(format!(
                    "{} holds an LMDB environment that is not a pstore store (no format record)",
                    path.display()
                )))
            }
            Some(bytes) => {
                let rec: FormatRecord = serde_json::from_slice(&bytes).map_err(|e| {
                    corrupt(format!(
                        "{}: the format record is not readable: {e}",
                        path.display()
                    ))
                })?;
                if rec.format != FORMAT_NAME {
                    return Err(corrupt(format!(
                        "{} is a {:?} store, not {FORMAT_NAME:?}",
                        path.display(),
                        rec.format
                    )));
                }
                if rec.version != FORMAT_VERSION {
                    return Err(corrupt(format!(
                        "{} is a store of format version {}; this pstore reads version \
                         {FORMAT_VERSION} only",
                        path.display(),
                        rec.version
                    )));
                }
                false
            }
        };
        wtxn.commit().map_err(|e| lmdb_err(path, "opening", e))?;
        Ok((
            Self {
                path: path.to_path_buf(),
                _lock: lock,
                env,
                meta,
                dbs: Mutex::new(HashMap::new()),
                gate: RwLock::new(map_size),
                writer: Mutex::new(()),
                on_wait: OnceLock::new(),
            },
            created,
        ))
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the map (the most the data file may grow to before the map doubles).
    pub fn map_size(&self) -> usize {
        *self.gate.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of the data file on disk.
    pub fn file_size(&self) -> u64 {
        std::fs::metadata(self.path.join("data.mdb"))
            .map(|m| m.len())
            .unwrap_or(0)
    }

    fn db_name(db: Db, table: &str) -> String {
        format!("{}{table}", db.prefix())
    }

    /// The handle of a table's database, if it has been created and committed.
    fn handle(&self, db: Db, table: &str) -> Option<Database<Bytes, Bytes>> {
        let dbs = self.dbs.lock().unwrap_or_else(|e| e.into_inner());
        dbs.get(&(db, table.to_string())).copied()
    }

    /// Creates (or opens) the databases of a table, committed, so readers find them.
    pub fn ensure_table(&self, table: &str) -> Result<()> {
        self.write(|w| {
            for db in [Db::Rows, Db::Changed, Db::Removed] {
                w.db(db, table)?;
            }
            Ok(())
        })
    }

    /// The value of a meta key as `txn` (a read or a write transaction) sees it.
    fn meta_in(&self, txn: &RoTxn<'_>, key: &str) -> Result<Option<Vec<u8>>> {
        self.meta
            .get(txn, key.as_bytes())
            .map(|v| v.map(<[u8]>::to_vec))
            .map_err(|e| lmdb_err(&self.path, "reading", e))
    }

    /// Runs `f` with a read transaction: a consistent view of the last committed state.
    pub fn read<R>(&self, f: impl FnOnce(&Reader<'_>) -> Result<R>) -> Result<R> {
        let _gate = self.gate.read().unwrap_or_else(|e| e.into_inner());
        let txn = self
            .env
            .read_txn()
            .map_err(|e| lmdb_err(&self.path, "reading", e))?;
        f(&Reader { storage: self, txn })
    }

    /// Like [`Storage::read`], with no write committing meanwhile: what `f` reads stays the
    /// newest state until it returns.
    pub fn read_exclusive<R>(&self, f: impl FnOnce(&Reader<'_>) -> Result<R>) -> Result<R> {
        let _one = match self.writer.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                if let Some(lift) = self.on_wait.get() {
                    lift();
                }
                self.writer.lock().unwrap_or_else(|e| e.into_inner())
            }
        };
        self.read(f)
    }

    /// Sets what to call before waiting for a write in progress (once).
    pub(crate) fn set_on_wait(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_wait.set(f);
    }

    /// Runs `f` in one write transaction and commits it (to disk, with fsync). When the map is
    /// full the transaction is dropped, the map doubles and `f` runs again, so `f` must be
    /// repeatable. On any other error nothing of `f` is kept.
    pub fn write<R>(&self, mut f: impl FnMut(&mut Writer<'_, '_>) -> Result<R>) -> Result<R> {
        let _one = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let attempt = {
                let _gate = self.gate.read().unwrap_or_else(|e| e.into_inner());
                let mut txn = self
                    .env
                    .write_txn()
                    .map_err(|e| lmdb_err(&self.path, "writing", e))?;
                let mut w = Writer {
                    storage: self,
                    txn: &mut txn,
                    map_full: false,
                    created: Vec::new(),
                };
                let r = f(&mut w);
                let (map_full, created) = (w.map_full, std::mem::take(&mut w.created));
                match r {
                    Ok(r) if !map_full => match txn.commit() {
                        Ok(()) => {
                            // Handles of databases created by a transaction are valid only once
                            // it has committed.
                            let mut dbs = self.dbs.lock().unwrap_or_else(|e| e.into_inner());
                            dbs.extend(created);
                            return Ok(r);
                        }
                        Err(e) if is_map_full(&e) => Err(None),
                        Err(e) => Err(Some(lmdb_err(&self.path, "committing to", e))),
                    },
                    Ok(_) => Err(None),
                    Err(_) if map_full => Err(None),
                    Err(e) => Err(Some(e)),
                }
            };
            match attempt {
                Err(Some(e)) => return Err(e),
                Err(None) => self.grow()?,
                Ok(()) => unreachable!(),
            }
        }
    }

    /// Doubles the map. No transaction is open: the gate is held alone.
    fn grow(&self) -> Result<()> {
        let mut size = self.gate.write().unwrap_or_else(|e| e.into_inner());
        let new = size
            .checked_mul(2)
            .ok_or_else(|| storage("the LMDB map cannot grow past the address space"))?;
        // SAFETY: the gate is held exclusively, so no transaction of this process is open, and
        // the directory lock keeps every other process out.
        unsafe { self.env.resize(new) }.map_err(|e| lmdb_err(&self.path, "growing", e))?;
        *size = new;
        Ok(())
    }
}

/// What `inspect` reports of a store directory.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSummary {
    /// The format record.
    pub format: FormatRecord,
    /// The last flush cycle.
    pub cycle: u64,
    /// Bytes of the data file.
    pub file_bytes: u64,
    /// The record of the last snapshot taken (JSON), if any.
    pub snapshot: Option<String>,
    /// Per table: name, record (JSON), rows in the replica, ids changed and removed since the
    /// last snapshot.
    pub tables: Vec<(String, String, u64, u64, u64)>,
}

/// Reads a store directory without opening it for writing (it may be open in another process).
pub fn inspect(path: &Path) -> Result<StoreSummary> {
    if !path.join("data.mdb").is_file() {
        return Err(invalid(format!(
            "no store at {} (no data.mdb)",
            path.display()
        )));
    }
    let mut opts = EnvOpenOptions::new().read_txn_without_tls();
    opts.max_dbs(MAX_DBS);
    // SAFETY: read-only: this process writes nothing; LMDB's reader table handles concurrent
    // writers in other processes.
    let env = unsafe {
        let mut o = opts;
        o.flags(heed::EnvFlags::READ_ONLY);
        o.open(path)
    }
    .map_err(|e| lmdb_err(path, "opening", e))?;
    let err = |e| lmdb_err(path, "reading", e);
    let txn = env.read_txn().map_err(err)?;
    let meta: Database<Bytes, Bytes> = env
        .open_database(&txn, Some("meta"))
        .map_err(err)?
        .ok_or_else(|| {
            corrupt(format!(
                "{} is not a pstore store (no meta)",
                path.display()
            ))
        })?;
    let format: FormatRecord = meta
        .get(&txn, b"format")
        .map_err(err)?
        .and_then(|v| serde_json::from_slice(v).ok())
        .ok_or_else(|| corrupt(format!("{}: no readable format record", path.display())))?;
    let cycle = meta.get(&txn, b"cycle").map_err(err)?.map_or(0, cycle_of);
    let snapshot = meta
        .get(&txn, b"snapshot")
        .map_err(err)?
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let mut tables = Vec::new();
    for item in meta.prefix_iter(&txn, b"table/").map_err(err)? {
        let (k, v) = item.map_err(err)?;
        let name = String::from_utf8_lossy(&k[6..]).into_owned();
        let mut n = [0u64; 3];
        for (i, db) in [Db::Rows, Db::Changed, Db::Removed].into_iter().enumerate() {
            let d: Option<Database<Bytes, Bytes>> = env
                .open_database(&txn, Some(&Storage::db_name(db, &name)))
                .map_err(err)?;
            if let Some(d) = d {
                n[i] = d.len(&txn).map_err(err)?;
            }
        }
        tables.push((
            name,
            String::from_utf8_lossy(v).into_owned(),
            n[0],
            n[1],
            n[2],
        ));
    }
    Ok(StoreSummary {
        format,
        cycle,
        file_bytes: std::fs::metadata(path.join("data.mdb")).map_or(0, |m| m.len()),
        snapshot,
        tables,
    })
}

/// Read access to the last committed state.
pub struct Reader<'s> {
    storage: &'s Storage,
    txn: RoTxn<'s, WithoutTls>,
}

impl Reader<'_> {
    /// The value of a meta key.
    pub fn meta(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.storage.meta_in(&self.txn, key)
    }

    /// Every meta (key, value) whose key starts with `prefix`, in key order.
    pub fn meta_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let err = |e| lmdb_err(&self.storage.path, "reading", e);
        let mut out = Vec::new();
        for item in self
            .storage
            .meta
            .prefix_iter(&self.txn, prefix.as_bytes())
            .map_err(err)?
        {
            let (k, v) = item.map_err(err)?;
            out.push((String::from_utf8_lossy(k).into_owned(), v.to_vec()));
        }
        Ok(out)
    }

    /// The payload of `id` in a table's database.
    pub fn get(&self, db: Db, table: &str, id: u64) -> Result<Option<&[u8]>> {
        self.get_in(self.open(db, table), table, id)
    }

    /// A table's database, looked up once for many [`Reader::get_in`] (a lookup by name takes a
    /// lock and hashes the name); `None` if the table has none.
    pub fn open(&self, db: Db, table: &str) -> Option<DbHandle> {
        self.storage.handle(db, table).map(|d| DbHandle { db, d })
    }

    /// [`Reader::get`] in a database opened by [`Reader::open`] (`table` names it in errors;
    /// a table without the database has no payload).
    pub fn get_in(&self, h: Option<DbHandle>, table: &str, id: u64) -> Result<Option<&[u8]>> {
        let Some(DbHandle { db, d }) = h else {
            return Ok(None);
        };
        let v = d
            .get(&self.txn, &key(id))
            .map_err(|e| lmdb_err(&self.storage.path, "reading", e))?;
        match v {
            None => Ok(None),
            Some(v) => {
                let (stored, payload) = decode(db, table, v)?;
                if stored != id {
                    return Err(corrupt(format!(
                        "{}: table {table:?}: the key of id {id} holds id {stored}",
                        self.storage.path.display()
                    )));
                }
                Ok(Some(payload))
            }
        }
    }

    /// Entries of a table's database.
    pub fn len(&self, db: Db, table: &str) -> Result<u64> {
        match self.storage.handle(db, table) {
            None => Ok(0),
            Some(d) => d
                .len(&self.txn)
                .map_err(|e| lmdb_err(&self.storage.path, "reading", e)),
        }
    }

    /// Calls `f(id, payload)` for every entry of a table's database, in key order (shard by
    /// shard).
    pub fn scan(
        &self,
        db: Db,
        table: &str,
        mut f: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let err = |e| lmdb_err(&self.storage.path, "reading", e);
        let Some(d) = self.storage.handle(db, table) else {
            return Ok(());
        };
        for item in d.iter(&self.txn).map_err(err)? {
            let (_, v) = item.map_err(err)?;
            let (id, payload) = decode(db, table, v)?;
            f(id, payload)?;
        }
        Ok(())
    }
}

/// A table's database, looked up once by [`Reader::open`] or [`Writer::open`] for many reads or
/// writes.
#[derive(Clone, Copy)]
pub struct DbHandle {
    db: Db,
    d: Database<Bytes, Bytes>,
}

/// Write access inside one transaction.
pub struct Writer<'s, 't> {
    storage: &'s Storage,
    txn: &'t mut RwTxn<'s>,
    map_full: bool,
    created: Vec<((Db, String), Database<Bytes, Bytes>)>,
}

impl Writer<'_, '_> {
    fn fail(&mut self, what: &str, e: heed::Error) -> Error {
        if is_map_full(&e) {
            self.map_full = true;
        }
        lmdb_err(&self.storage.path, what, e)
    }

    fn check(&mut self, what: &str, r: heed::Result<()>) -> Result<()> {
        r.map_err(|e| self.fail(what, e))
    }

    fn db(&mut self, db: Db, table: &str) -> Result<Database<Bytes, Bytes>> {
        if let Some(d) = self.storage.handle(db, table) {
            return Ok(d);
        }
        let k = (db, table.to_string());
        if let Some((_, d)) = self.created.iter().find(|(c, _)| *c == k) {
            return Ok(*d);
        }
        let r = self
            .storage
            .env
            .create_database::<Bytes, Bytes>(self.txn, Some(&Storage::db_name(db, table)));
        match r {
            Ok(d) => {
                self.created.push((k, d));
                Ok(d)
            }
            Err(e) => Err(self.fail("writing", e)),
        }
    }

    /// The value of a meta key, as this transaction sees it.
    pub fn meta(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.storage.meta_in(self.txn, key)
    }

    /// Sets a meta key.
    pub fn put_meta(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let r = self.storage.meta.put(self.txn, key.as_bytes(), value);
        self.check("writing", r)
    }

    /// Deletes a meta key.
    pub fn delete_meta(&mut self, key: &str) -> Result<()> {
        let r = self
            .storage
            .meta
            .delete(self.txn, key.as_bytes())
            .map(|_| ());
        self.check("writing", r)
    }

    /// Sets `id`'s payload in a table's database. The value is written straight into LMDB's
    /// page (`MDB_RESERVE`), with no intermediate copy.
    pub fn put(&mut self, db: Db, table: &str, id: u64, payload: &[u8]) -> Result<()> {
        let h = self.open(db, table)?;
        self.put_in(h, id, payload)
    }

    /// A table's database, looked up once for many [`Writer::put_in`] (a lookup by name takes
    /// a lock and hashes the name: a cost per row when done for each).
    pub fn open(&mut self, db: Db, table: &str) -> Result<DbHandle> {
        Ok(DbHandle {
            db,
            d: self.db(db, table)?,
        })
    }

    /// [`Writer::put`] into a database opened by [`Writer::open`].
    pub fn put_in(&mut self, h: DbHandle, id: u64, payload: &[u8]) -> Result<()> {
        let (db, d) = (h.db, h.d);
        let r = d.put_reserved(self.txn, &key(id), payload.len() + 8, |space| {
            encode(db, id, payload, space)
        });
        self.check("writing", r)
    }

    /// [`Writer::put_in`] of many rows, `rows` in key order (ascending [`key`]). Where the rows
    /// are dense among those stored in their key range, a cursor walks the range and rewrites
    /// each row where it stands (`MDB_CURRENT`: same-size values are overwritten in place, with
    /// no descent of the tree per row); ids it does not find are put afterwards like any other.
    /// A descent per row compared keys at every level and looked each page up among the
    /// transaction's dirty pages: about a third of a flush's time.
    pub fn put_rows_in_order(&mut self, h: DbHandle, rows: &[(u64, &[u8])]) -> Result<()> {
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
            return Ok(());
        };
        let (lo, hi) = (key(first.0), key(last.0));
        let stored = h.d.len(self.txn).map_err(|e| self.fail("reading", e))?;
        // The rows stored in [lo, hi], keys being uniform hashes.
        let span = u64::from_be_bytes(hi) - u64::from_be_bytes(lo);
        let in_range = (stored as f64 * (span as f64 / u64::MAX as f64)).ceil() as u64 + 1;
        if (rows.len() as u64) * WALK_PER_DESCENT < in_range {
            for &(id, payload) in rows {
                self.put_in(h, id, payload)?;
            }
            return Ok(());
        }
        let mut absent = Vec::new();
        let mut value = Vec::with_capacity(first.1.len() + 8);
        let r = (|| -> heed::Result<()> {
            let range = (
                std::ops::Bound::Included(&lo[..]),
                std::ops::Bound::Included(&hi[..]),
            );
            let mut it = h.d.range_mut(self.txn, &range)?;
            // The key the cursor stands on (copied: the database's bytes may move on a write).
            let mut at = key_of(it.next())?;
            for &(id, payload) in rows {
                let k = key(id);
                while at.is_some_and(|a| a < k) {
                    at = key_of(it.next())?;
                }
                if at == Some(k) {
                    value.clear();
                    encode(h.db, id, payload, &mut value)?;
                    // SAFETY: no key or value of the database is held across the write (`at`
                    // is a copy), and the key is the one the cursor stands on.
                    unsafe { it.put_current(&k[..], &value[..])? };
                } else {
                    absent.push((id, payload));
                }
            }
            Ok(())
        })();
        self.check("writing", r)?;
        for (id, payload) in absent {
            self.put_in(h, id, payload)?;
        }
        Ok(())
    }

    /// Deletes `id` from a table's database; true if it was there.
    pub fn delete(&mut self, db: Db, table: &str, id: u64) -> Result<bool> {
        let d = self.db(db, table)?;
        d.delete(self.txn, &key(id))
            .map_err(|e| self.fail("writing", e))
    }

    /// Empties a table's database.
    pub fn clear(&mut self, db: Db, table: &str) -> Result<()> {
        let d = self.db(db, table)?;
        let r = d.clear(self.txn);
        self.check("writing", r)
    }

    /// Deletes the entries of a table's database whose value (a u64 LE cycle) is at most `upto`.
    pub fn prune(&mut self, db: Db, table: &str, upto: u64) -> Result<()> {
        let d = self.db(db, table)?;
        // Deleted where the cursor stands, in one pass: no second descent of the tree per entry.
        let r = (|| -> std::result::Result<(), PruneError> {
            let mut iter = d.iter_mut(self.txn).map_err(PruneError::Lmdb)?;
            while let Some(item) = iter.next() {
                let (_, v) = item.map_err(PruneError::Lmdb)?;
                let old = cycle_of(decode(db, table, v).map_err(PruneError::Decode)?.1) <= upto;
                if old {
                    // SAFETY: nothing read from the database (this entry's key and value, last
                    // used just above) is used after the deletion.
                    unsafe { iter.del_current() }.map_err(PruneError::Lmdb)?;
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => Ok(()),
            Err(PruneError::Decode(e)) => Err(e),
            Err(PruneError::Lmdb(e)) => Err(self.fail("writing", e)),
        }
    }
}

/// Why [`Writer::prune`] stopped.
enum PruneError {
    Lmdb(heed::Error),
    Decode(Error),
}

/// The cycle stored in a `changed` or `removed` value.
pub fn cycle_of(v: &[u8]) -> u64 {
    v.try_into().map(u64::from_le_bytes).unwrap_or(0)
}

fn page_size() -> usize {
    // SAFETY: sysconf only reads its argument.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
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
        let (s, _) = Storage::open(&d, true, 1 << 20).unwrap();
        let words = 256;
        let mut rows: Vec<(u64, Vec<u32>)> = (0..3000u64).map(|id| (id, vec![1; words])).collect();
        in_key_order(&mut rows);
        let put = |rows: &[(u64, Vec<u32>)]| {
            s.write(|w| {
                let h = w.open(Db::Rows, "t")?;
                let v: Vec<(u64, &[u8])> = rows.iter().map(|(id, r)| (*id, bytes_of(r))).collect();
                w.put_rows_in_order(h, &v)
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
            let (s, created) = Storage::open(&d, true, 1 << 20).unwrap();
            assert!(created);
            let row = vec![7u32; 1024];
            // 4 MiB of rows into a 1 MiB map: it must double a few times.
            s.write(|w| {
                for id in 0..1000u64 {
                    w.put(Db::Rows, "t", id, bytes_of(&row))?;
                }
                Ok(())
            })
            .unwrap();
            assert!(s.map_size() > 4 << 20);
        }
        let (s, created) = Storage::open(&d, false, 1 << 20).unwrap();
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
        let (s, _) = Storage::open(&d, true, 1 << 20).unwrap();
        let e = Storage::open(&d, true, 1 << 20).err().unwrap();
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
            let (s, _) = Storage::open(&d, true, 1 << 20).unwrap();
            s.write(|w| w.put_meta("format", br#"{"format":"pstore-lmdb","version":99}"#))
                .unwrap();
        }
        let e = Storage::open(&d, false, 1 << 20).err().unwrap();
        assert!(
            matches!(e, Error::Corrupt(ref m) if m.contains("version 99")),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
