//! Serving artifacts: read-only copies of trained tables, built from a snapshot and its chain of
//! increments (format `pstore-serving`, docs/FORMAT.md).
//!
//! An artifact is one LMDB environment: weights only, no optimizer state, rows optionally
//! quantized ([`Dtype`]). Serving processes open it read-only and share its pages through the
//! page cache; one writer at a time (`ServingStore.apply`, `pstore serving follow`) applies newer
//! snapshots, each in one write transaction, so a lookup (one read transaction) sees the old
//! version or the new one, never a mix.

pub mod quant;
pub mod rowfile;
mod scan;

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use heed::types::Bytes;
use heed::{Database, Env, EnvFlags, EnvOpenOptions, MdbError, RoTxn, RwTxn, WithoutTls};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::durable::TableRecord;
use crate::error::{corrupt, invalid, storage, Error, Result};
use crate::snapshot::files::{self, PartSchema};
use crate::snapshot::{fsync_dir, unix_time, Manifest, TableEntry, MANIFEST};
pub use quant::Dtype;

/// The format's name, in the format record and the manifest.
pub const FORMAT_NAME: &str = "pstore-serving";
/// The format version this build writes (it reads version 1 too: rows in LMDB, no row files).
pub const FORMAT_VERSION: u32 = 2;
/// The directory of the row files, in the artifact's.
const TABLES_DIR: &str = "tables";
/// The generation hint file, in the artifact's directory.
const HINT: &str = "generation";

/// `MODEL_DIR/generation`: 8 bytes, the generation the artifact's LMDB holds, stored by the
/// writer through its shared mapping after each commit. A reader whose pinned generation equals
/// it skips LMDB; otherwise it reads the generation in a read transaction (the authority).
struct Hint {
    map: rowfile::Map,
}

impl Hint {
    fn open(dir: &Path, writable: bool) -> Result<Option<Hint>> {
        let path = dir.join(HINT);
        let io = |e: std::io::Error| storage(format!("opening {}: {e}", path.display()));
        let f = if writable {
            let f = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io)?;
            f.set_len(8).map_err(io)?;
            f
        } else {
            match File::open(&path) {
                Ok(f) if f.metadata().map(|m| m.len() == 8).unwrap_or(false) => f,
                _ => return Ok(None),
            }
        };
        let map = rowfile::Map::new(&f, 8, writable).map_err(io)?;
        Ok(Some(Hint { map }))
    }

    fn cell(&self) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned, 8 bytes long and lives as long as `self`; every
        // access to it goes through this atomic.
        unsafe { &*self.map.ptr().cast::<AtomicU64>() }
    }

    fn load(&self) -> u64 {
        u64::from_le(self.cell().load(Ordering::Acquire))
    }

    fn store(&self, generation: u64) {
        self.cell().store(generation.to_le(), Ordering::Release);
    }
}
/// The LMDB map of a writer: address space only (the file grows as rows are written). Readers
/// take the size from the environment, so it is never resized under them.
const MAP_SIZE: usize = 1 << 40;
/// Named databases at most: one per sparse table ever held.
const MAX_DBS: u32 = 4096;
/// How an opened artifact's row files are checked (decision 0119).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// A background thread verifies each row file once, whole; reads check the rows it has
    /// not verified yet on their first read, and nothing once it found the file sound.
    Background,
    /// Reads check each row and slot on its first read in the process (decision 0117).
    OnRead,
}

/// The environment setting that chooses [`Verify`] where the caller does not.
pub const VERIFY_ENV: &str = "PSTORE_SERVING_VERIFY";

impl Verify {
    /// `"background"` or `"on-read"`.
    pub fn parse(s: &str) -> Result<Verify> {
        match s {
            "background" => Ok(Verify::Background),
            "on-read" => Ok(Verify::OnRead),
            _ => Err(invalid(format!(
                "verify must be \"background\" or \"on-read\", got {s:?}"
            ))),
        }
    }

    /// [`VERIFY_ENV`]'s choice, [`Verify::Background`] when it is unset.
    pub fn from_env() -> Result<Verify> {
        match std::env::var(VERIFY_ENV) {
            Ok(v) => Verify::parse(&v).map_err(|e| invalid(format!("{VERIFY_ENV}: {e}"))),
            Err(_) => Ok(Verify::Background),
        }
    }
}

/// What [`Artifact::verified`] reports of a table's row file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    /// Rows whose checksum this process verified.
    pub rows_verified: u64,
    /// Rows the file holds.
    pub rows: u64,
    /// Bytes of the bitmaps of verified rows and slots.
    pub bitmap_bytes: usize,
    /// Where the background check of the whole file stands.
    pub scan: rowfile::Scan,
}

/// Lookups of more ids than this are split over the thread pool.
const PARALLEL_MIN_IDS: usize = 2048;
/// Ids per part of a split lookup (row files).
const PARALLEL_PART_IDS: usize = 512;

/// The key of an id: 8 bytes big-endian, so keys sort as ids do.
pub fn key(id: u64) -> [u8; 8] {
    id.to_be_bytes()
}

/// What one table of an artifact holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableMeta {
    /// The table's name.
    pub name: String,
    /// `"sparse"` or `"dense"`.
    pub kind: String,
    /// Row width (sparse) or element count (dense).
    pub dim: usize,
    /// A dense table's shape (empty for sparse ones).
    pub shape: Vec<usize>,
    /// How sparse rows are stored (dense values are always float32).
    pub dtype: Dtype,
    /// Rows (sparse) or 1 (dense).
    pub rows: u64,
    /// The training table's record at the snapshot: configuration (the initializer a lookup's
    /// `initial` default uses), learning rate, update sequence number, counters.
    pub record: TableRecord,
    /// A sparse table's row file (format version 2); `None` in version 1, whose rows are in
    /// the LMDB database `rows/<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<IndexRef>,
}

/// Where a sparse table's rows are: a row file (docs/FORMAT.md, "Row files").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexRef {
    /// The file, relative to the artifact's directory.
    pub file: String,
    /// The generation that wrote it (its header says the same).
    pub generation: u64,
}

/// The snapshot an artifact is at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRef {
    /// Its id.
    pub id: String,
    /// `"full"` or `"incremental"`.
    pub kind: String,
    /// Its directory when it was applied.
    pub path: String,
    /// Unix seconds when training took it.
    pub created_at: f64,
}

/// The state of an artifact, stored with its rows (key `state` of the `meta` database) and
/// changed by the same transaction as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version.
    pub version: u32,
    /// How sparse rows are stored.
    pub dtype: Dtype,
    /// The tables the artifact was exported with (`None`: all; later tables join).
    pub select: Option<Vec<String>>,
    /// The tables, in the snapshot's order.
    pub tables: Vec<TableMeta>,
    /// The snapshot applied last.
    pub snapshot: SnapshotRef,
    /// Snapshots applied since the export built it from a chain (the chain counts as one).
    pub updates: u64,
    /// Bumped by every applied snapshot.
    pub generation: u64,
    /// Unix seconds of the export.
    pub created_at: f64,
    /// Unix seconds when the last snapshot was applied.
    pub applied_at: f64,
    /// A random id made by the export; every row file of the artifact carries it (0 in format
    /// version 1).
    #[serde(default)]
    pub artifact: u64,
}

impl State {
    /// The table `name`, if the artifact has it.
    pub fn table(&self, name: &str) -> Option<&TableMeta> {
        self.tables.iter().find(|t| t.name == name)
    }

    fn wants(&self, name: &str) -> bool {
        self.select
            .as_ref()
            .is_none_or(|s| s.iter().any(|n| n == name))
    }
}

/// What a lookup returns for ids the artifact lacks.
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// Zeros.
    Zeros,
    /// The row the training table would have created: the table's initializer at (seed, id).
    Initial,
    /// This row (of the table's dim).
    Row(Vec<f32>),
}

/// What [`Artifact::lookup_owned`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Looked {
    /// `ids.len() * dim` floats, row after row.
    pub rows: Vec<f32>,
    /// The table's dim.
    pub dim: usize,
    /// Which ids the artifact has.
    pub found: Vec<bool>,
    /// The generation read.
    pub generation: u64,
}

/// What applying a snapshot did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Applied {
    /// The snapshot's id.
    pub id: String,
    /// Its directory.
    pub path: String,
    /// `"full"` or `"incremental"`.
    pub kind: String,
    /// Rows written.
    pub rows: u64,
    /// Rows deleted by tombstones.
    pub deleted: u64,
    /// The generation it made.
    pub generation: u64,
}

fn lmdb(path: &Path, what: &str, e: heed::Error) -> Error {
    match e {
        heed::Error::Mdb(MdbError::MapFull) => storage(format!(
            "{what} the serving artifact at {}: it reached the LMDB map size of {} GiB",
            path.display(),
            MAP_SIZE >> 30
        )),
        e => storage(format!(
            "{what} the serving artifact at {}: {e}",
            path.display()
        )),
    }
}

/// Opened artifacts of this process by directory: LMDB allows one environment per file and
/// process, so every `open` of a directory shares it.
fn registry() -> &'static Mutex<HashMap<PathBuf, Weak<Artifact>>> {
    static R: OnceLock<Mutex<HashMap<PathBuf, Weak<Artifact>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// A cached table view: its meta and database at a generation.
#[derive(Clone)]
struct View {
    generation: u64,
    meta: Arc<TableMeta>,
}

/// An open serving artifact.
pub struct Artifact {
    path: PathBuf,
    env: Env<WithoutTls>,
    meta: Database<Bytes, Bytes>,
    /// Database handles of the tables' rows by table name.
    dbs: RwLock<HashMap<String, Database<Bytes, Bytes>>>,
    /// Parsed table metas, valid for one generation.
    views: RwLock<HashMap<String, View>>,
    /// Opened for writing (apply); the writer lock file is held.
    writable: bool,
    /// Device and inode of the data file when opened (an artifact exported again at the same
    /// path is another file).
    file_id: Option<(u64, u64)>,
    _lock: Option<File>,
    writer: Mutex<()>,
    /// Held by every transaction that opens a database handle, from its start to its end, and
    /// by every write transaction: LMDB forbids opening handles in two transactions at once
    /// (both would take the same free slot, and one handle would turn `MDB_BAD_DBI`).
    dbi: Mutex<()>,
    /// The tables at the generation read last, their row files mapped.
    pinned: RwLock<Option<Arc<Pinned>>>,
    /// The generation hint (absent in version 1 artifacts opened read-only).
    hint: Option<Hint>,
    /// Row files are verified whole in the background ([`Verify::Background`]): set when any
    /// opening of the directory in this process asked for it.
    background: AtomicBool,
}

/// One generation of an artifact as lookups use it: the table records and mapped row files.
/// A lookup holds it for its whole batch, so it reads one generation, even when a writer
/// replaces the files meanwhile (a mapped file stays readable after it is deleted).
struct Pinned {
    generation: u64,
    tables: HashMap<String, PinnedTable>,
}

struct PinnedTable {
    meta: Arc<TableMeta>,
    file: Option<Arc<rowfile::RowFile>>,
}

impl std::fmt::Debug for Artifact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Artifact")
            .field("path", &self.path)
            .field("writable", &self.writable)
            .finish()
    }
}

fn file_id(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir.join("data.mdb"))
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn check_dir(path: &Path) -> Result<()> {
    if path.join("data.mdb").is_file() {
        return Ok(());
    }
    let hint = if path.join(MANIFEST).is_file() && Manifest::read(path).is_ok() {
        "; it is a snapshot: build an artifact from it with `pstore export`"
    } else {
        ""
    };
    Err(invalid(format!(
        "no serving artifact at {} (no data.mdb){hint}",
        path.display()
    )))
}

impl Artifact {
    /// Opens the artifact in `path`: read-only, or `writable` to apply snapshots to it (one
    /// writer at a time, across processes). Opening a directory this process has open already
    /// shares that opening (a read-only one cannot become writable).
    pub fn open(path: &Path, writable: bool) -> Result<Arc<Artifact>> {
        Self::open_with(path, writable, None)
    }

    /// [`Artifact::open`] with the row files' checks chosen (`None`: [`VERIFY_ENV`], else
    /// [`Verify::Background`]). The background check runs when any opening of the directory
    /// in this process asked for it.
    pub fn open_with(path: &Path, writable: bool, verify: Option<Verify>) -> Result<Arc<Artifact>> {
        let verify = match verify {
            Some(v) => v,
            None => Verify::from_env()?,
        };
        let a = Self::open_shared(path, writable)?;
        if verify == Verify::Background && !a.background.swap(true, Ordering::AcqRel) {
            // Files pinned by an opening that did not ask for it.
            let pinned = a.pinned.read().unwrap_or_else(|e| e.into_inner()).clone();
            for f in pinned.iter().flat_map(|p| p.tables.values()) {
                if let Some(f) = &f.file {
                    scan::schedule(f);
                }
            }
        }
        Ok(a)
    }

    fn open_shared(path: &Path, writable: bool) -> Result<Arc<Artifact>> {
        check_dir(path)?;
        let canon = path
            .canonicalize()
            .map_err(|e| storage(format!("opening {}: {e}", path.display())))?;
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        reg.retain(|_, w| w.strong_count() > 0);
        if let Some(a) = reg.get(&canon).and_then(Weak::upgrade) {
            if a.file_id != file_id(&canon) {
                return Err(invalid(format!(
                    "the artifact at {} was replaced on disk while this process still has the \
                     old one open; close every ServingStore of it first",
                    path.display()
                )));
            }
            if writable && !a.writable {
                return Err(invalid(format!(
                    "the artifact at {} is open read-only in this process; close it before \
                     opening it for writing",
                    path.display()
                )));
            }
            return Ok(a);
        }
        let a = Arc::new(Self::open_env(&canon, writable, false)?);
        reg.insert(canon, Arc::downgrade(&a));
        Ok(a)
    }

    fn open_env(path: &Path, writable: bool, create: bool) -> Result<Artifact> {
        let lock = if writable {
            let f = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(path.join("writer.lock"))
                .map_err(|e| storage(format!("locking {}: {e}", path.display())))?;
            // SAFETY: flock on a descriptor we own; it only reads its arguments.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(storage(format!(
                    "the artifact at {} is being updated by another process",
                    path.display()
                )));
            }
            Some(f)
        } else {
            None
        };
        // A data file cut short would be mapped past its end (SIGBUS on the first read there).
        crate::storage::check_data_file(path, "artifact")?;
        let mut opts = EnvOpenOptions::new().read_txn_without_tls();
        opts.max_dbs(MAX_DBS).max_readers(4096);
        if writable {
            opts.map_size(MAP_SIZE);
        } else {
            // SAFETY: READ_ONLY only stops this process from writing.
            unsafe { opts.flags(EnvFlags::READ_ONLY) };
        }
        // SAFETY: `open` keeps one environment per directory in this process (the registry),
        // and the writer lock keeps a second writer process out; LMDB coordinates readers.
        let env = unsafe { opts.open(path) }.map_err(|e| lmdb(path, "opening", e))?;
        let meta = if create {
            let mut w = env.write_txn().map_err(|e| lmdb(path, "creating", e))?;
            let m: Database<Bytes, Bytes> = env
                .create_database(&mut w, Some("meta"))
                .map_err(|e| lmdb(path, "creating", e))?;
            let rec = serde_json::json!({"format": FORMAT_NAME, "version": FORMAT_VERSION});
            m.put(&mut w, b"format", rec.to_string().as_bytes())
                .map_err(|e| lmdb(path, "creating", e))?;
            w.commit().map_err(|e| lmdb(path, "creating", e))?;
            m
        } else {
            let r = env.read_txn().map_err(|e| lmdb(path, "opening", e))?;
            let m: Option<Database<Bytes, Bytes>> = env
                .open_database(&r, Some("meta"))
                .map_err(|e| lmdb(path, "opening", e))?;
            let m = m.ok_or_else(|| {
                corrupt(format!(
                    "{} holds an LMDB environment that is not a pstore serving artifact",
                    path.display()
                ))
            })?;
            let rec = m
                .get(&r, b"format")
                .map_err(|e| lmdb(path, "reading", e))?
                .map(<[u8]>::to_vec);
            let rec: serde_json::Value = rec
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            if rec["format"] != FORMAT_NAME {
                return Err(corrupt(format!(
                    "{} is not a pstore serving artifact (format record {rec})",
                    path.display()
                )));
            }
            if rec["version"] != 1 && rec["version"] != FORMAT_VERSION {
                return Err(corrupt(format!(
                    "{} is a serving artifact of format version {}; this pstore reads versions \
                     1 to {FORMAT_VERSION}",
                    path.display(),
                    rec["version"]
                )));
            }
            // Makes the handle valid beyond this transaction (heed: a read transaction that
            // opens a database must commit).
            r.commit().map_err(|e| lmdb(path, "opening", e))?;
            m
        };
        let a = Artifact {
            path: path.to_path_buf(),
            file_id: file_id(path),
            env,
            meta,
            dbs: RwLock::new(HashMap::new()),
            views: RwLock::new(HashMap::new()),
            writable,
            _lock: lock,
            writer: Mutex::new(()),
            dbi: Mutex::new(()),
            pinned: RwLock::new(None),
            hint: if create {
                None
            } else {
                Hint::open(path, writable)?
            },
            background: AtomicBool::new(false),
        };
        if writable && !create {
            if a.state()?.version < FORMAT_VERSION {
                a.migrate()?;
            }
            a.store_hint()?;
        }
        Ok(a)
    }

    /// Stores the generation LMDB holds in the hint file.
    fn store_hint(&self) -> Result<()> {
        if let Some(h) = &self.hint {
            let txn = self.read_txn()?;
            h.store(self.generation_in(&txn)?);
        }
        Ok(())
    }

    /// Turns a version 1 artifact (rows in LMDB) into a version 2 one in one write
    /// transaction: a row file per sparse table, the LMDB rows cleared, the format record and
    /// state at version 2, the generation bumped (readers of this pstore move over to the
    /// files; older pstores refuse the artifact when they open it).
    fn migrate(&self) -> Result<()> {
        let _one = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut state = self.state()?;
        let old = state.clone();
        state.artifact = new_artifact_id();
        state.generation += 1;
        state.version = FORMAT_VERSION;
        let generation = state.generation;
        let r = self.write(|txn| {
            let dir = self.path.join(TABLES_DIR);
            std::fs::create_dir_all(&dir)
                .map_err(|err| storage(format!("creating {}: {err}", dir.display())))?;
            for (k, t) in state.tables.iter_mut().enumerate() {
                if t.kind != "sparse" {
                    continue;
                }
                let db: Database<Bytes, Bytes> = self
                    .env
                    .open_database(txn, Some(&format!("rows/{}", t.name)))
                    .map_err(|e| lmdb(&self.path, "migrating", e))?
                    .ok_or_else(|| {
                        corrupt(format!(
                            "the serving artifact at {} lists table {:?} but has no rows \
                             database",
                            self.path.display(),
                            t.name
                        ))
                    })?;
                let n = db.len(txn).map_err(|e| lmdb(&self.path, "migrating", e))?;
                if n != t.rows {
                    return Err(corrupt(format!(
                        "the serving artifact at {}: table {:?} has {n} rows, its record says {}",
                        self.path.display(),
                        t.name,
                        t.rows
                    )));
                }
                let rel = format!("{TABLES_DIR}/g{generation:010}-t{k:04}.rows");
                let want = rowfile::Expect {
                    artifact: state.artifact,
                    generation,
                    dtype: t.dtype,
                    dim: t.dim,
                    rows: n,
                };
                let mut w = rowfile::Writer::create(&self.path.join(&rel), want)?;
                let width = t.dtype.row_bytes(t.dim);
                for kv in db.iter(txn).map_err(|e| lmdb(&self.path, "migrating", e))? {
                    let (k, v) = kv.map_err(|e| lmdb(&self.path, "migrating", e))?;
                    if k.len() != 8 || v.len() != width {
                        return Err(corrupt(format!(
                            "the serving artifact at {}: an entry of table {:?} has a \
                             {}-byte key and a {}-byte row",
                            self.path.display(),
                            t.name,
                            k.len(),
                            v.len()
                        )));
                    }
                    w.put(u64::from_be_bytes(k.try_into().expect("8 bytes")), v)?;
                }
                w.finish()?;
                db.clear(txn)
                    .map_err(|e| lmdb(&self.path, "migrating", e))?;
                t.index = Some(IndexRef {
                    file: rel,
                    generation,
                });
                let b = serde_json::to_vec(&*t).map_err(|e| Error::Internal(e.to_string()))?;
                self.meta
                    .put(txn, format!("table/{}", t.name).as_bytes(), &b)
                    .map_err(|e| lmdb(&self.path, "migrating", e))?;
            }
            fsync_dir(&dir)?;
            let rec = serde_json::json!({"format": FORMAT_NAME, "version": FORMAT_VERSION});
            let b = serde_json::to_vec(&state).map_err(|e| Error::Internal(e.to_string()))?;
            for (k, v) in [
                (&b"format"[..], rec.to_string().into_bytes()),
                (&b"state"[..], b),
                (&b"generation"[..], generation.to_le_bytes().to_vec()),
            ] {
                self.meta
                    .put(txn, k, &v)
                    .map_err(|e| lmdb(&self.path, "migrating", e))?;
            }
            Ok(())
        });
        if r.is_err() {
            prune(&self.path, &[&old]);
        }
        r
    }

    /// The artifact's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether it was opened for writing.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Bytes of the LMDB data file and the row files.
    pub fn file_bytes(&self) -> u64 {
        let rows: u64 = std::fs::read_dir(self.path.join(TABLES_DIR))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        std::fs::metadata(self.path.join("data.mdb")).map_or(0, |m| m.len()) + rows
    }

    fn read_txn(&self) -> Result<RoTxn<'_, WithoutTls>> {
        self.env
            .read_txn()
            .map_err(|e| lmdb(&self.path, "reading", e))
    }

    fn state_in(&self, txn: &RoTxn<'_, WithoutTls>) -> Result<State> {
        let bytes = self
            .meta
            .get(txn, b"state")
            .map_err(|e| lmdb(&self.path, "reading", e))?
            .ok_or_else(|| {
                corrupt(format!(
                    "the serving artifact at {} has no state record",
                    self.path.display()
                ))
            })?;
        serde_json::from_slice(bytes).map_err(|e| {
            corrupt(format!(
                "the serving artifact at {}: state record unreadable: {e}",
                self.path.display()
            ))
        })
    }

    fn generation_in(&self, txn: &RoTxn<'_, WithoutTls>) -> Result<u64> {
        let g = self
            .meta
            .get(txn, b"generation")
            .map_err(|e| lmdb(&self.path, "reading", e))?;
        match g {
            Some(b) if b.len() == 8 => Ok(u64::from_le_bytes(b.try_into().expect("8 bytes"))),
            _ => Err(corrupt(format!(
                "the serving artifact at {} has no generation record",
                self.path.display()
            ))),
        }
    }

    /// The current state.
    pub fn state(&self) -> Result<State> {
        let txn = self.read_txn()?;
        self.state_in(&txn)
    }

    fn cached_db(&self, table: &str) -> Option<Database<Bytes, Bytes>> {
        let dbs = self.dbs.read().unwrap_or_else(|e| e.into_inner());
        dbs.get(table).copied()
    }

    /// The database of `table`'s rows, opened once (in its own read transaction, committed so
    /// the handle outlives it).
    fn rows_db(&self, table: &str) -> Result<Database<Bytes, Bytes>> {
        let _open = self.dbi.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(db) = self.cached_db(table) {
            return Ok(db);
        }
        let txn = self.read_txn()?;
        let db: Option<Database<Bytes, Bytes>> = self
            .env
            .open_database(&txn, Some(&format!("rows/{table}")))
            .map_err(|e| lmdb(&self.path, "reading", e))?;
        txn.commit().map_err(|e| lmdb(&self.path, "reading", e))?;
        let db = db.ok_or_else(|| {
            corrupt(format!(
                "the serving artifact at {} lists table {table:?} but has no rows database",
                self.path.display()
            ))
        })?;
        self.dbs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(table.to_string(), db);
        Ok(db)
    }

    /// The meta of `table` as the transaction sees it.
    fn view(&self, txn: &RoTxn<'_, WithoutTls>, table: &str) -> Result<(u64, Arc<TableMeta>)> {
        let generation = self.generation_in(txn)?;
        if let Some(v) = self
            .views
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(table)
        {
            if v.generation == generation {
                return Ok((generation, Arc::clone(&v.meta)));
            }
        }
        let bytes = self
            .meta
            .get(txn, format!("table/{table}").as_bytes())
            .map_err(|e| lmdb(&self.path, "reading", e))?
            .ok_or_else(|| Error::UnknownTable(table.to_string()))?;
        let meta: TableMeta = serde_json::from_slice(bytes).map_err(|e| {
            corrupt(format!(
                "the serving artifact at {}: table record {table:?} unreadable: {e}",
                self.path.display()
            ))
        })?;
        let meta = Arc::new(meta);
        self.views
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                table.to_string(),
                View {
                    generation,
                    meta: Arc::clone(&meta),
                },
            );
        Ok((generation, meta))
    }

    fn sparse_view(
        &self,
        txn: &RoTxn<'_, WithoutTls>,
        table: &str,
    ) -> Result<(u64, Arc<TableMeta>)> {
        let (g, meta) = self.view(txn, table)?;
        if meta.kind != "sparse" {
            return Err(Error::WrongKind(format!(
                "table {table:?} is a dense table; read it with dense()"
            )));
        }
        Ok((g, meta))
    }

    /// The row width of sparse `table`.
    pub fn dim(&self, table: &str) -> Result<usize> {
        let p = self.pin()?;
        let t = p
            .tables
            .get(table)
            .ok_or_else(|| Error::UnknownTable(table.to_string()))?;
        if t.meta.kind != "sparse" {
            return Err(Error::WrongKind(format!(
                "table {table:?} is a dense table; read it with dense()"
            )));
        }
        Ok(t.meta.dim)
    }

    /// The generation the artifact is at, its tables and their row files mapped: reused while
    /// the generation stays (one LMDB read of the `generation` key), else read in one read
    /// transaction. A row file the writer deleted meanwhile (two generations on) means the
    /// artifact moved on: read again.
    fn pin(&self) -> Result<Arc<Pinned>> {
        if let Some(h) = &self.hint {
            let p = self.pinned.read().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = p.as_ref().filter(|p| p.generation == h.load()) {
                return Ok(Arc::clone(p));
            }
        }
        let mut attempts = 0;
        loop {
            let txn = self.read_txn()?;
            let generation = self.generation_in(&txn)?;
            let old = self
                .pinned
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if let Some(p) = &old {
                if p.generation == generation {
                    return Ok(Arc::clone(p));
                }
            }
            let state = self.state_in(&txn)?;
            let mut tables = HashMap::new();
            let mut gone = None;
            for t in state.tables {
                let file = match (&t.index, t.kind.as_str()) {
                    (Some(ix), "sparse") => {
                        let same = old
                            .as_ref()
                            .and_then(|p| p.tables.get(&t.name))
                            .filter(|p| p.meta.index.as_ref() == Some(ix))
                            .and_then(|p| p.file.clone());
                        match same {
                            Some(f) => Some(f),
                            None => {
                                let path = self.path.join(&ix.file);
                                if !path.exists() {
                                    gone = Some(path);
                                    break;
                                }
                                let f = Arc::new(rowfile::RowFile::open(
                                    &path,
                                    rowfile::Expect {
                                        artifact: state.artifact,
                                        generation: ix.generation,
                                        dtype: t.dtype,
                                        dim: t.dim,
                                        rows: t.rows,
                                    },
                                )?);
                                if self.background.load(Ordering::Acquire) {
                                    scan::schedule(&f);
                                }
                                Some(f)
                            }
                        }
                    }
                    _ => None,
                };
                tables.insert(
                    t.name.clone(),
                    PinnedTable {
                        meta: Arc::new(t),
                        file,
                    },
                );
            }
            drop(txn);
            if let Some(path) = gone {
                attempts += 1;
                if attempts > 20 {
                    return Err(corrupt(format!(
                        "the serving artifact at {}: its table record names the row file {}, \
                         which does not exist",
                        self.path.display(),
                        path.display()
                    )));
                }
                continue;
            }
            let p = Arc::new(Pinned { generation, tables });
            let mut slot = self.pinned.write().unwrap_or_else(|e| e.into_inner());
            if slot.as_ref().is_none_or(|q| q.generation < generation) {
                *slot = Some(Arc::clone(&p));
            }
            return Ok(p);
        }
    }

    /// The pinned generation and `table`'s row file, or `None` when the table's rows are in
    /// LMDB (format version 1).
    fn pinned_file(&self, table: &str) -> Result<Option<(Arc<Pinned>, Arc<rowfile::RowFile>)>> {
        let p = self.pin()?;
        let t = p
            .tables
            .get(table)
            .ok_or_else(|| Error::UnknownTable(table.to_string()))?;
        if t.meta.kind != "sparse" {
            return Err(Error::WrongKind(format!(
                "table {table:?} is a dense table; read it with dense()"
            )));
        }
        Ok(t.file.clone().map(|f| (p, f)))
    }

    /// The rows of `ids` (`fallback` for ids the artifact lacks), all from one generation.
    pub fn lookup_owned(&self, table: &str, ids: &[u64], fallback: &Fallback) -> Result<Looked> {
        let Some((p, f)) = self.pinned_file(table)? else {
            return self.lookup_owned_lmdb(table, ids, fallback);
        };
        let meta = &p.tables[table].meta;
        let mut rows = vec![0.0; ids.len() * meta.dim];
        let mut found = vec![false; ids.len()];
        gather(meta, &f, ids, fallback, &mut rows, &mut found)?;
        Ok(Looked {
            rows,
            dim: meta.dim,
            found,
            generation: p.generation,
        })
    }

    /// Writes the rows of `ids` into `out` (`ids.len() * dim` floats), `fallback` for ids the
    /// artifact lacks, and marks found ids in `found` when given. All rows come from one
    /// version of the artifact. Returns how many ids were found and the generation read.
    pub fn lookup(
        &self,
        table: &str,
        ids: &[u64],
        fallback: &Fallback,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<(usize, u64)> {
        let Some((p, f)) = self.pinned_file(table)? else {
            return self.lookup_lmdb(table, ids, fallback, out, found);
        };
        let meta = &p.tables[table].meta;
        if out.len() != ids.len() * meta.dim {
            return Err(invalid(format!(
                "table {table:?} changed dim while it was read; look it up again"
            )));
        }
        let mut scratch;
        let found: &mut [bool] = match found {
            Some(f) => f,
            None => {
                scratch = vec![false; ids.len()];
                &mut scratch
            }
        };
        gather(meta, &f, ids, fallback, out, found)?;
        Ok((found.iter().filter(|&&f| f).count(), p.generation))
    }

    /// `table`'s rows as the current generation has them, for a batch looked up in parts that
    /// must all read one version (the model server's streamed answers); `None` when the
    /// table's rows are in LMDB (format 1).
    pub fn reader(&self, table: &str) -> Result<Option<TableReader>> {
        Ok(self.pinned_file(table)?.map(|(pinned, file)| TableReader {
            meta: Arc::clone(&pinned.tables[table].meta),
            generation: pinned.generation,
            file,
        }))
    }

    /// How far this process verified sparse `table`'s current row file: rows whose checksum
    /// it verified (on a read or by the background check), the rows it holds, the bytes of the
    /// bitmaps, and the background check's state. `None` for a table whose rows are in LMDB
    /// (format version 1).
    pub fn verified(&self, table: &str) -> Result<Option<Verified>> {
        Ok(self.pinned_file(table)?.map(|(_, f)| Verified {
            rows_verified: f.rows_verified(),
            rows: f.rows(),
            bitmap_bytes: f.bitmap_bytes(),
            scan: f.scan_state(),
        }))
    }

    /// Which of `ids` the artifact has rows for.
    pub fn contains(&self, table: &str, ids: &[u64]) -> Result<Vec<bool>> {
        let Some((_, f)) = self.pinned_file(table)? else {
            return self.contains_lmdb(table, ids);
        };
        ids.iter()
            .map(|&id| f.contains(id).map_err(in_table(table)))
            .collect()
    }

    /// Every row of sparse `table` as stored, in id order: ids, the stored bytes (row after row,
    /// `dtype.row_bytes(dim)` each), dim and dtype. For exporters (ONNX) and tools.
    pub fn scan(&self, table: &str) -> Result<(Vec<u64>, Vec<u8>, usize, Dtype)> {
        let Some((p, f)) = self.pinned_file(table)? else {
            return self.scan_lmdb(table);
        };
        let meta = &p.tables[table].meta;
        let mut entries = f.entries().map_err(in_table(table))?;
        entries.sort_unstable_by_key(|&(id, _)| id);
        let want = meta.dtype.row_bytes(meta.dim);
        let mut bytes = Vec::with_capacity(entries.len() * want);
        for &(id, r) in &entries {
            bytes.extend_from_slice(f.stored(id, r).map_err(in_table(table))?);
        }
        Ok((
            entries.into_iter().map(|(id, _)| id).collect(),
            bytes,
            meta.dim,
            meta.dtype,
        ))
    }

    /// The rows of `ids` from LMDB (format version 1). A
    /// batch under the parallel threshold is read in one transaction, table metadata included.
    fn lookup_owned_lmdb(&self, table: &str, ids: &[u64], fallback: &Fallback) -> Result<Looked> {
        let db = self.table_db(table)?;
        let mut found = vec![false; ids.len()];
        if ids.len() < PARALLEL_MIN_IDS {
            let txn = self.read_txn()?;
            let (generation, meta) = self.sparse_view(&txn, table)?;
            let mut rows = vec![0.0; ids.len() * meta.dim];
            self.read_rows(&txn, db, &meta, ids, fallback, &mut rows, &mut found)?;
            return Ok(Looked {
                rows,
                dim: meta.dim,
                found,
                generation,
            });
        }
        let dim = self.dim(table)?;
        let mut rows = vec![0.0; ids.len() * dim];
        let (_, generation) =
            self.lookup_lmdb(table, ids, fallback, &mut rows, Some(&mut found))?;
        Ok(Looked {
            rows,
            dim,
            found,
            generation,
        })
    }

    /// [`Artifact::lookup`] from LMDB (format version 1).
    fn lookup_lmdb(
        &self,
        table: &str,
        ids: &[u64],
        fallback: &Fallback,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<(usize, u64)> {
        let (generation, meta) = {
            let txn = self.read_txn()?;
            self.sparse_view(&txn, table)?
        };
        let dim = meta.dim;
        if out.len() != ids.len() * dim {
            return Err(invalid(format!(
                "table {table:?} changed dim while it was read; look it up again"
            )));
        }
        let db = self.table_db(table)?;
        let mut scratch;
        let found: &mut [bool] = match found {
            Some(f) => f,
            None => {
                scratch = vec![false; ids.len()];
                &mut scratch
            }
        };
        if ids.len() >= PARALLEL_MIN_IDS {
            // Each chunk reads in its own transaction; if a snapshot was applied meanwhile the
            // chunks may disagree, and the whole lookup is read again in one transaction.
            let chunk = ids.len().div_ceil(rayon::current_num_threads().max(1) * 2);
            let gens: Result<Vec<u64>> = ids
                .par_chunks(chunk)
                .zip(out.par_chunks_mut(chunk * dim))
                .zip(found.par_chunks_mut(chunk))
                .map(|((ids, out), found)| {
                    let txn = self.read_txn()?;
                    let g = self.generation_in(&txn)?;
                    self.read_rows(&txn, db, &meta, ids, fallback, out, found)?;
                    Ok(g)
                })
                .collect();
            let gens = gens?;
            if gens.iter().all(|&g| g == generation) {
                return Ok((found.iter().filter(|&&f| f).count(), generation));
            }
        }
        let txn = self.read_txn()?;
        let (g, meta) = self.sparse_view(&txn, table)?;
        if meta.dim != dim {
            return Err(invalid(format!(
                "table {table:?} changed dim while it was read; look it up again"
            )));
        }
        self.read_rows(&txn, db, &meta, ids, fallback, out, found)?;
        Ok((found.iter().filter(|&&f| f).count(), g))
    }

    #[allow(clippy::too_many_arguments)]
    fn read_rows(
        &self,
        txn: &RoTxn<'_, WithoutTls>,
        db: Database<Bytes, Bytes>,
        meta: &TableMeta,
        ids: &[u64],
        fallback: &Fallback,
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        let dim = meta.dim;
        let want = meta.dtype.row_bytes(dim);
        let mut init: Option<crate::SparseTableConfig> = None;
        for ((&id, row), hit) in ids.iter().zip(out.chunks_exact_mut(dim)).zip(found) {
            let v = db
                .get(txn, &key(id))
                .map_err(|e| lmdb(&self.path, "reading", e))?;
            *hit = v.is_some();
            match v {
                Some(b) if b.len() == want => meta.dtype.decode(b, row),
                Some(b) => {
                    return Err(corrupt(format!(
                    "the serving artifact at {}: row {id} of table {:?} has {} bytes, not {want}",
                    self.path.display(),
                    meta.name,
                    b.len()
                )))
                }
                None => fill_missing(meta, fallback, id, row, &mut init)?,
            }
        }
        Ok(())
    }

    /// The rows database of sparse `table`, opened before the caller's read transaction
    /// begins (LMDB refuses a handle opened after the transaction that uses it started).
    fn table_db(&self, table: &str) -> Result<Database<Bytes, Bytes>> {
        if let Some(db) = self.cached_db(table) {
            return Ok(db);
        }
        {
            let txn = self.read_txn()?;
            self.sparse_view(&txn, table)?;
        }
        self.rows_db(table)
    }

    /// [`Artifact::contains`] from LMDB (format version 1).
    fn contains_lmdb(&self, table: &str, ids: &[u64]) -> Result<Vec<bool>> {
        let db = self.table_db(table)?;
        let txn = self.read_txn()?;
        self.sparse_view(&txn, table)?;
        ids.iter()
            .map(|&id| {
                db.get(&txn, &key(id))
                    .map(|v| v.is_some())
                    .map_err(|e| lmdb(&self.path, "reading", e))
            })
            .collect()
    }

    /// A dense table's shape and value.
    pub fn dense(&self, table: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let txn = self.read_txn()?;
        let (_, meta) = self.view(&txn, table)?;
        if meta.kind != "dense" {
            return Err(Error::WrongKind(format!(
                "table {table:?} is a sparse table; read it with lookup()"
            )));
        }
        let b = self
            .meta
            .get(&txn, format!("dense/{table}").as_bytes())
            .map_err(|e| lmdb(&self.path, "reading", e))?
            .ok_or_else(|| {
                corrupt(format!(
                    "the serving artifact at {} has no value for dense table {table:?}",
                    self.path.display()
                ))
            })?;
        if b.len() != meta.dim * 4 {
            return Err(corrupt(format!(
                "the serving artifact at {}: dense table {table:?} has {} bytes, not {}",
                self.path.display(),
                b.len(),
                meta.dim * 4
            )));
        }
        let mut v = vec![0.0; meta.dim];
        Dtype::Float32.decode(b, &mut v);
        Ok((meta.shape.clone(), v))
    }

    /// [`Artifact::scan`] from LMDB (format version 1).
    fn scan_lmdb(&self, table: &str) -> Result<(Vec<u64>, Vec<u8>, usize, Dtype)> {
        let db = self.table_db(table)?;
        let txn = self.read_txn()?;
        let (_, meta) = self.sparse_view(&txn, table)?;
        let want = meta.dtype.row_bytes(meta.dim);
        let mut ids = Vec::with_capacity(meta.rows as usize);
        let mut bytes = Vec::with_capacity(meta.rows as usize * want);
        for kv in db.iter(&txn).map_err(|e| lmdb(&self.path, "reading", e))? {
            let (k, v) = kv.map_err(|e| lmdb(&self.path, "reading", e))?;
            if k.len() != 8 || v.len() != want {
                return Err(corrupt(format!(
                    "the serving artifact at {}: an entry of table {table:?} has a {}-byte key \
                     and a {}-byte row",
                    self.path.display(),
                    k.len(),
                    v.len()
                )));
            }
            ids.push(u64::from_be_bytes(k.try_into().expect("8 bytes")));
            bytes.extend_from_slice(v);
        }
        Ok((ids, bytes, meta.dim, meta.dtype))
    }

    /// Applies the snapshot in `dir` in one write transaction: a full snapshot replaces every
    /// table; an increment must build on the snapshot the artifact is at. Returns `None` when the
    /// artifact is at that snapshot already.
    pub fn apply(&self, dir: &Path) -> Result<Option<Applied>> {
        if !self.writable {
            return Err(invalid(format!(
                "the artifact at {} is open read-only; open it writable to apply snapshots",
                self.path.display()
            )));
        }
        let m = Manifest::read(dir)?;
        let _one = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let state = self.state()?;
        if m.id == state.snapshot.id {
            return Ok(None);
        }
        if m.kind != "full" {
            let parent = m.parent.as_ref().map(|p| p.id.as_str()).unwrap_or("");
            if parent != state.snapshot.id {
                return Err(invalid(format!(
                    "{} is an increment of snapshot {parent}, but the artifact is at snapshot \
                     {} ({}); apply the snapshots in order (`pstore serving follow` does)",
                    dir.display(),
                    state.snapshot.id,
                    state.snapshot.path
                )));
            }
        }
        let applied = match self.write(|txn| apply_one(self, txn, dir, &m, &state)) {
            Ok(a) => a,
            Err(e) => {
                prune(&self.path, &[&state]);
                return Err(e);
            }
        };
        self.store_hint()?;
        // The previous generation's files stay for readers that pinned it a moment ago.
        if let Ok(new) = self.state() {
            prune(&self.path, &[&new, &state]);
        }
        self.views
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        Ok(Some(applied))
    }

    /// Brings the artifact to the newest snapshot under `root` (by creation time): the
    /// increments after the one it is at, or, when that snapshot is not in the newest one's
    /// chain, the newest chain from its full snapshot. Each snapshot is one transaction.
    pub fn follow(&self, root: &Path) -> Result<Vec<Applied>> {
        let todo = self.pending(root)?;
        let mut out = Vec::new();
        for dir in todo {
            if let Some(a) = self.apply(&dir)? {
                out.push(a);
            }
        }
        Ok(out)
    }

    /// The snapshots under `root` that `follow` would apply, in order.
    pub fn pending(&self, root: &Path) -> Result<Vec<PathBuf>> {
        let state = self.state()?;
        let Some(newest) = newest_snapshot(root)? else {
            return Ok(Vec::new());
        };
        // Back from the newest through its parents to the snapshot the artifact is at: only the
        // increments after it are needed (older ones may have been deleted).
        let mut back = Vec::new();
        let mut at = newest.clone();
        loop {
            let m = Manifest::read(&at)?;
            if m.id == state.snapshot.id {
                back.reverse();
                return Ok(back);
            }
            let parent = m.parent.clone();
            back.push(at.clone());
            match parent {
                Some(p) if back.len() < 100_000 => {
                    let next = crate::snapshot::resolve(&at, &p.path);
                    if !next.join(MANIFEST).is_file() {
                        break;
                    }
                    at = next;
                }
                _ => break,
            }
        }
        // Not in the newest chain: its whole chain from its full snapshot, if it is newer.
        let chain = Manifest::chain(&newest)?;
        let newest_at = chain.last().map_or(0.0, |(_, m)| m.created_at);
        if newest_at <= state.snapshot.created_at {
            return Ok(Vec::new());
        }
        Ok(chain.into_iter().map(|(p, _)| p).collect())
    }

    fn write<R>(&self, f: impl FnOnce(&mut RwTxn<'_>) -> Result<R>) -> Result<R> {
        // Write transactions open handles (`create_database`): none may run beside a reader
        // opening one.
        let _open = self.dbi.lock().unwrap_or_else(|e| e.into_inner());
        let mut txn = self
            .env
            .write_txn()
            .map_err(|e| lmdb(&self.path, "writing", e))?;
        let r = f(&mut txn)?;
        txn.commit()
            .map_err(|e| lmdb(&self.path, "committing to", e))?;
        Ok(r)
    }
}

/// Rows of a row file for `ids` into `out`, the fallback for the ids it lacks; batches of
/// [`PARALLEL_MIN_IDS`] or more are split over the thread pool (all parts read one pinned
/// generation).
fn gather(
    meta: &TableMeta,
    f: &rowfile::RowFile,
    ids: &[u64],
    fallback: &Fallback,
    out: &mut [f32],
    found: &mut [bool],
) -> Result<()> {
    let dim = meta.dim;
    let part = |ids: &[u64], out: &mut [f32], found: &mut [bool]| -> Result<()> {
        f.gather(ids, out, found).map_err(in_table(&meta.name))?;
        let mut init = None;
        for (i, &id) in ids.iter().enumerate() {
            if !found[i] {
                fill_missing(
                    meta,
                    fallback,
                    id,
                    &mut out[i * dim..(i + 1) * dim],
                    &mut init,
                )?;
            }
        }
        Ok(())
    };
    if ids.len() < PARALLEL_MIN_IDS || dim == 0 {
        return part(ids, out, found);
    }
    // Parts of at most 512 ids: a part a descheduled helper holds up is short, and the
    // caller takes the parts nobody started (cores here are often shared).
    let chunk = ids
        .len()
        .div_ceil(rayon::current_num_threads().max(1))
        .min(PARALLEL_PART_IDS);
    ids.par_chunks(chunk)
        .zip(out.par_chunks_mut(chunk * dim))
        .zip(found.par_chunks_mut(chunk))
        .try_for_each(|((ids, out), found)| part(ids, out, found))
}

/// One generation of a sparse table's row file (see [`Artifact::reader`]): every lookup
/// through it reads that generation, whatever is applied meanwhile (the mapping stays valid
/// after the writer deletes the file).
pub struct TableReader {
    meta: Arc<TableMeta>,
    generation: u64,
    file: Arc<rowfile::RowFile>,
}

impl TableReader {
    /// The row width.
    pub fn dim(&self) -> usize {
        self.meta.dim
    }

    /// The generation read.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Writes the rows of `ids` into `out` (`ids.len() * dim` floats), `fallback` for ids the
    /// artifact lacks: the same rows as [`Artifact::lookup`] at this generation.
    pub fn lookup(&self, ids: &[u64], fallback: &Fallback, out: &mut [f32]) -> Result<()> {
        if out.len() != ids.len() * self.meta.dim {
            return Err(invalid(format!(
                "a lookup of {} ids in table {:?} (dim {}) needs {} floats of output, got {}",
                ids.len(),
                self.meta.name,
                self.meta.dim,
                ids.len() * self.meta.dim,
                out.len()
            )));
        }
        let mut found = vec![false; ids.len()];
        gather(&self.meta, &self.file, ids, fallback, out, &mut found)
    }
}

/// Names `table` in a row file's error (the file knows its path only).
fn in_table(table: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::Corrupt(m) => corrupt(format!("table {table:?}: {m}")),
        e => e,
    }
}

/// Writes what a lookup returns for `id`, which the artifact lacks, into `row`. `init` caches
/// the table's configuration between calls.
fn fill_missing(
    meta: &TableMeta,
    fallback: &Fallback,
    id: u64,
    row: &mut [f32],
    init: &mut Option<crate::SparseTableConfig>,
) -> Result<()> {
    match fallback {
        Fallback::Zeros => row.fill(0.0),
        Fallback::Row(r) if r.len() == row.len() => row.copy_from_slice(r),
        Fallback::Row(r) => {
            return Err(crate::error::shape(format!(
                "the default row has {} elements; table {:?} has dim {}",
                r.len(),
                meta.name,
                row.len()
            )))
        }
        Fallback::Initial => {
            if init.is_none() {
                *init = Some(match &meta.record {
                    TableRecord::Sparse { config, .. } => config.clone(),
                    TableRecord::Dense { .. } => {
                        return Err(Error::Internal("dense record of a sparse table".into()))
                    }
                });
            }
            let c = init.as_ref().expect("set above");
            c.initializer.fill(c.seed, id, row);
        }
    }
    Ok(())
}

/// A new artifact's id: random enough that two artifacts never share one.
fn new_artifact_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let addr = &local as *const u8 as u64;
    crate::hash::mix64(t ^ crate::hash::mix64(u64::from(std::process::id()) ^ addr.rotate_left(32)))
        .max(1)
}

/// The row files the states name.
fn files_of(states: &[&State]) -> std::collections::HashSet<String> {
    states
        .iter()
        .flat_map(|s| s.tables.iter())
        .filter_map(|t| t.index.as_ref().map(|ix| ix.file.clone()))
        .collect()
}

/// Deletes the row files in the artifact that none of `keep` names (a reader still using one
/// keeps its mapping; a reader about to open one finds it gone and reads the newer state).
fn prune(path: &Path, keep: &[&State]) {
    let keep = files_of(keep);
    let Ok(entries) = std::fs::read_dir(path.join(TABLES_DIR)) else {
        return;
    };
    for e in entries.flatten() {
        let rel = format!("{TABLES_DIR}/{}", e.file_name().to_string_lossy());
        if !keep.contains(&rel) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Writes table `e`'s row file for the generation after `state`'s: the rows of `old` (the
/// table as the artifact holds it, `None` for a table loaded whole) that the snapshot neither
/// rewrote nor deleted, then the snapshot's rows but those deleted. Checks the row count the
/// snapshot's manifest gives before writing. Returns where it is, its rows and the ids deleted.
fn write_rows(
    a: &Artifact,
    state: &State,
    position: usize,
    e: &TableEntry,
    rows: &Rows,
    tombs: &[u64],
    old: Option<&TableMeta>,
) -> Result<(IndexRef, u64, u64)> {
    let generation = state.generation + 1;
    let dtype = state.dtype;
    let old_file = match old.and_then(|o| o.index.as_ref().map(|ix| (o, ix))) {
        Some((o, ix)) => Some(rowfile::RowFile::open(
            &a.path.join(&ix.file),
            rowfile::Expect {
                artifact: state.artifact,
                generation: ix.generation,
                dtype: o.dtype,
                dim: o.dim,
                rows: o.rows,
            },
        )?),
        None => None,
    };
    let tombs: std::collections::HashSet<u64> = tombs.iter().copied().collect();
    let in_new = |id: u64| rows.ids.binary_search(&id).is_ok();
    let mut kept = Vec::new();
    let mut deleted = 0u64;
    for &t in &tombs {
        let held = match &old_file {
            Some(f) => f.contains(t).map_err(in_table(&e.name))?,
            None => false,
        };
        if held || in_new(t) {
            deleted += 1;
        }
    }
    if let Some(f) = &old_file {
        kept = f.entries().map_err(in_table(&e.name))?;
        kept.retain(|&(id, _)| !in_new(id) && !tombs.contains(&id));
    }
    let fresh = rows.ids.iter().filter(|id| !tombs.contains(id)).count() as u64;
    let n = kept.len() as u64 + fresh;
    if n != e.total_rows {
        return Err(corrupt(format!(
            "table {:?} should have {} rows after this snapshot, the artifact would have {n}; \
             is the artifact from this chain of snapshots?",
            e.name, e.total_rows
        )));
    }
    let dir = a.path.join(TABLES_DIR);
    std::fs::create_dir_all(&dir)
        .map_err(|err| storage(format!("creating {}: {err}", dir.display())))?;
    let rel = format!("{TABLES_DIR}/g{generation:010}-t{position:04}.rows");
    let want = rowfile::Expect {
        artifact: state.artifact,
        generation,
        dtype,
        dim: e.dim,
        rows: n,
    };
    let mut w = rowfile::Writer::create(&a.path.join(&rel), want)?;
    if let Some(f) = &old_file {
        // Verified as copied: a damaged row is not given a new checksum.
        for &(id, r) in &kept {
            w.put(id, f.stored(id, r).map_err(in_table(&e.name))?)?;
        }
    }
    let width = dtype.row_bytes(e.dim);
    for (i, &id) in rows.ids.iter().enumerate() {
        if !tombs.contains(&id) {
            w.put(id, &rows.bytes[i * width..(i + 1) * width])?;
        }
    }
    w.finish()?;
    fsync_dir(&dir)?;
    Ok((
        IndexRef {
            file: rel,
            generation,
        },
        n,
        deleted,
    ))
}

/// The snapshot under `root` taken last (directories with a readable manifest; hidden
/// directories, which are snapshots being written, are skipped).
pub fn newest_snapshot(root: &Path) -> Result<Option<PathBuf>> {
    let entries = std::fs::read_dir(root).map_err(|e| {
        invalid(format!(
            "cannot read the snapshot root {}: {e}",
            root.display()
        ))
    })?;
    let mut best: Option<(f64, PathBuf)> = None;
    for e in entries.flatten() {
        let p = e.path();
        let hidden = e.file_name().to_string_lossy().starts_with('.');
        if hidden || !p.join(MANIFEST).is_file() {
            continue;
        }
        if let Ok(m) = Manifest::read(&p) {
            if best.as_ref().is_none_or(|(t, _)| m.created_at > *t) {
                best = Some((m.created_at, p));
            }
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// One table's rows of one snapshot, stored form, sorted by id.
struct Rows {
    ids: Vec<u64>,
    bytes: Vec<u8>,
}

/// Reads and encodes the rows of a sparse table entry (every file checked first), sorted by id.
fn read_sparse(dir: &Path, e: &TableEntry, dtype: Dtype) -> Result<Rows> {
    let schema = PartSchema {
        dim: e.dim,
        state_len: e.state_len,
    };
    let width = dtype.row_bytes(e.dim);
    let parts: Result<Vec<Rows>> = e
        .files
        .par_iter()
        .map(|fi| {
            let mut r = Rows {
                ids: Vec::with_capacity(fi.rows as usize),
                bytes: Vec::with_capacity(fi.rows as usize * width),
            };
            files::read_part(&dir.join(&fi.name), schema, fi, |b| {
                for (i, &id) in b.ids.iter().enumerate() {
                    let row = &b.weights[i * e.dim..(i + 1) * e.dim];
                    dtype.encode(row, &mut r.bytes).map_err(|w| {
                        invalid(format!(
                            "table {:?}, id {id}: the value {w} does not fit {}; export as \
                             float32",
                            e.name,
                            dtype.as_str()
                        ))
                    })?;
                    r.ids.push(id);
                }
                Ok(())
            })?;
            Ok(r)
        })
        .collect();
    let parts = parts?;
    let n: usize = parts.iter().map(|p| p.ids.len()).sum();
    let mut order: Vec<(u64, u32, u32)> = Vec::with_capacity(n);
    for (pi, p) in parts.iter().enumerate() {
        for (i, &id) in p.ids.iter().enumerate() {
            order.push((id, pi as u32, i as u32));
        }
    }
    order.par_sort_unstable_by_key(|&(id, _, _)| id);
    let mut out = Rows {
        ids: Vec::with_capacity(n),
        bytes: Vec::with_capacity(n * width),
    };
    for (id, pi, i) in order {
        let p = &parts[pi as usize];
        out.ids.push(id);
        out.bytes
            .extend_from_slice(&p.bytes[i as usize * width..(i as usize + 1) * width]);
    }
    Ok(out)
}

/// Applies one snapshot inside `txn` to an artifact in `state`.
fn apply_one(
    a: &Artifact,
    txn: &mut RwTxn<'_>,
    dir: &Path,
    m: &Manifest,
    state: &State,
) -> Result<Applied> {
    let full = m.kind == "full";
    let dtype = state.dtype;
    let mut tables: Vec<TableMeta> = Vec::new();
    let (mut written, mut deleted) = (0u64, 0u64);
    for e in &m.tables {
        if !state.wants(&e.name) {
            continue;
        }
        let old = state.table(&e.name);
        let uid = e.record.uid();
        let same = old.is_some_and(|o| o.record.uid() == uid && o.kind == kind_of(e));
        match &e.record {
            TableRecord::Sparse { .. } => {
                let fresh = full || !same;
                let rows = read_sparse(dir, e, dtype)?;
                let tombs = match (&e.tombstones, fresh) {
                    (Some(fi), false) => files::read_ids(&dir.join(&fi.name), fi)?,
                    _ => Vec::new(),
                };
                let old = if fresh { None } else { old };
                let kept =
                    old.filter(|o| rows.ids.is_empty() && tombs.is_empty() && o.index.is_some());
                let (index, n) = match kept {
                    // Nothing changed: the table keeps its file.
                    Some(o) if o.rows != e.total_rows => {
                        return Err(corrupt(format!(
                            "{}: table {:?} should have {} rows after this snapshot, the \
                             artifact would have {}; is the artifact from this chain of \
                             snapshots?",
                            dir.display(),
                            e.name,
                            e.total_rows,
                            o.rows
                        )))
                    }
                    Some(o) => (o.index.clone(), o.rows),
                    None => {
                        let (ix, n, d) = write_rows(a, state, tables.len(), e, &rows, &tombs, old)?;
                        deleted += d;
                        (Some(ix), n)
                    }
                };
                written += rows.ids.len() as u64;
                tables.push(TableMeta {
                    name: e.name.clone(),
                    kind: "sparse".into(),
                    dim: e.dim,
                    shape: Vec::new(),
                    dtype,
                    rows: n,
                    record: e.record.clone(),
                    index,
                });
            }
            TableRecord::Dense { config, .. } => {
                let v = crate::snapshot::dense_value(dir, e)?.weights;
                let mut b = Vec::with_capacity(v.len() * 4);
                Dtype::Float32
                    .encode(&v, &mut b)
                    .map_err(|_| Error::Internal("float32 encodes anything".into()))?;
                a.meta
                    .put(txn, format!("dense/{}", e.name).as_bytes(), &b)
                    .map_err(|err| lmdb(&a.path, "writing", err))?;
                written += 1;
                tables.push(TableMeta {
                    name: e.name.clone(),
                    kind: "dense".into(),
                    dim: v.len(),
                    shape: config.shape.clone(),
                    dtype: Dtype::Float32,
                    rows: 1,
                    record: e.record.clone(),
                    index: None,
                });
            }
        }
    }
    // Tables the snapshot no longer has were dropped by training.
    for old in &state.tables {
        if tables.iter().any(|t| t.name == old.name) {
            continue;
        }
        if old.kind != "sparse" {
            a.meta
                .delete(txn, format!("dense/{}", old.name).as_bytes())
                .map_err(|err| lmdb(&a.path, "writing", err))?;
        }
        a.meta
            .delete(txn, format!("table/{}", old.name).as_bytes())
            .map_err(|err| lmdb(&a.path, "writing", err))?;
    }
    for t in &tables {
        let b = serde_json::to_vec(t).map_err(|e| Error::Internal(e.to_string()))?;
        a.meta
            .put(txn, format!("table/{}", t.name).as_bytes(), &b)
            .map_err(|err| lmdb(&a.path, "writing", err))?;
    }
    let generation = state.generation + 1;
    let path = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let new = State {
        tables,
        snapshot: SnapshotRef {
            id: m.id.clone(),
            kind: m.kind.clone(),
            path: path.display().to_string(),
            created_at: m.created_at,
        },
        updates: state.updates + 1,
        generation,
        applied_at: unix_time(),
        ..state.clone()
    };
    let b = serde_json::to_vec(&new).map_err(|e| Error::Internal(e.to_string()))?;
    a.meta
        .put(txn, b"state", &b)
        .map_err(|err| lmdb(&a.path, "writing", err))?;
    a.meta
        .put(txn, b"generation", &generation.to_le_bytes())
        .map_err(|err| lmdb(&a.path, "writing", err))?;
    Ok(Applied {
        id: m.id.clone(),
        path: path.display().to_string(),
        kind: m.kind.clone(),
        rows: written,
        deleted,
        generation,
    })
}

fn kind_of(e: &TableEntry) -> &'static str {
    match e.record {
        TableRecord::Sparse { .. } => "sparse",
        TableRecord::Dense { .. } => "dense",
    }
}

/// What an export reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Exported {
    /// The artifact's state.
    pub state: State,
    /// Bytes of the data file.
    pub file_bytes: u64,
    /// Snapshots of the chain applied.
    pub chain: usize,
}

/// Builds the artifact `out` (a new or empty directory) from the snapshot in `snapshot` and its
/// chain: the tables `select` (all when `None`), sparse rows stored as `dtype`. Written into a
/// temporary directory beside `out` and renamed into place; on an error nothing is left.
/// `done` counts the snapshots applied.
pub fn export(
    snapshot: &Path,
    out: &Path,
    select: Option<Vec<String>>,
    dtype: Dtype,
    done: &AtomicU64,
) -> Result<Exported> {
    let chain = Manifest::chain(snapshot)?;
    let last = &chain.last().expect("a chain has a snapshot").1;
    if let Some(sel) = &select {
        if sel.is_empty() {
            return Err(invalid("select at least one table"));
        }
        for name in sel {
            if !last.tables.iter().any(|t| &t.name == name) {
                let have: Vec<&str> = last.tables.iter().map(|t| t.name.as_str()).collect();
                return Err(Error::UnknownTable(format!(
                    "{name} (the snapshot has: {})",
                    have.join(", ")
                )));
            }
        }
    }
    if out.exists() {
        let empty = std::fs::read_dir(out)
            .map(|mut it| it.next().is_none())
            .unwrap_or(false);
        if !empty {
            return Err(invalid(format!(
                "{} exists and is not empty; export into a new directory",
                out.display()
            )));
        }
    }
    let name = out
        .file_name()
        .ok_or_else(|| invalid(format!("{} has no directory name", out.display())))?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent)
        .map_err(|e| storage(format!("creating {}: {e}", parent.display())))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)
        .map_err(|e| storage(format!("creating {}: {e}", tmp.display())))?;
    let r = build(&tmp, &chain, select, dtype, done);
    let r = r.and_then(|ex| {
        if out.exists() {
            std::fs::remove_dir(out)
                .map_err(|e| storage(format!("replacing {}: {e}", out.display())))?;
        }
        std::fs::rename(&tmp, out)
            .map_err(|e| storage(format!("renaming into {}: {e}", out.display())))?;
        fsync_dir(&parent)?;
        Ok(ex)
    });
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    r
}

fn build(
    tmp: &Path,
    chain: &[(PathBuf, Manifest)],
    select: Option<Vec<String>>,
    dtype: Dtype,
    done: &AtomicU64,
) -> Result<Exported> {
    let a = Artifact::open_env(tmp, true, true)?;
    let now = unix_time();
    let mut state = State {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        dtype,
        select,
        tables: Vec::new(),
        snapshot: SnapshotRef {
            id: String::new(),
            kind: String::new(),
            path: String::new(),
            created_at: 0.0,
        },
        updates: 0,
        generation: 0,
        created_at: now,
        applied_at: now,
        artifact: new_artifact_id(),
    };
    for (dir, m) in chain {
        a.write(|txn| apply_one(&a, txn, dir, m, &state))?;
        let new = a.state()?;
        prune(tmp, &[&new]);
        state = new;
        done.fetch_add(1, Ordering::Relaxed);
    }
    // The chain counts as one update.
    state.updates = 1;
    a.write(|txn| {
        let b = serde_json::to_vec(&state).map_err(|e| Error::Internal(e.to_string()))?;
        a.meta
            .put(txn, b"state", &b)
            .map_err(|err| lmdb(&a.path, "writing", err))
    })?;
    let manifest = serde_json::json!({
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": dtype.as_str(),
        "created_at": state.created_at,
        "snapshot": state.snapshot,
        "select": state.select,
        "tables": state.tables.iter().map(|t| serde_json::json!({
            "name": t.name, "kind": t.kind, "dim": t.dim, "shape": t.shape, "rows": t.rows,
            "row_bytes": if t.kind == "sparse" { t.dtype.row_bytes(t.dim) } else { t.dim * 4 },
        })).collect::<Vec<_>>(),
        "note": "the artifact's current state (after live increments) is the `state` record in \
                 its LMDB `meta` database; this file describes it as exported",
    });
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Internal(e.to_string()))?;
    let mpath = tmp.join(MANIFEST);
    std::fs::write(&mpath, bytes)
        .and_then(|()| File::open(&mpath)?.sync_all())
        .map_err(|e| storage(format!("writing {}: {e}", mpath.display())))?;
    a.env.force_sync().map_err(|e| lmdb(tmp, "syncing", e))?;
    let hint = tmp.join(HINT);
    std::fs::write(&hint, state.generation.to_le_bytes())
        .and_then(|()| File::open(&hint)?.sync_all())
        .map_err(|e| storage(format!("writing {}: {e}", hint.display())))?;
    let file_bytes = a.file_bytes();
    drop(a);
    fsync_dir(tmp)?;
    Ok(Exported {
        state,
        file_bytes,
        chain: chain.len(),
    })
}
