//! Snapshots: full and incremental copies of a store's tables as Arrow IPC files plus a manifest
//! (format in docs/FORMAT.md).
//!
//! A snapshot is written into a temporary directory beside its destination: the part files of
//! every table (fsynced), then `manifest.json` (fsynced), then the directory is renamed into place
//! and its parent fsynced. A directory without a manifest is not a snapshot.
//!
//! Every row is copied whole under its shard's lock (in-memory stores) or read from one LMDB
//! read transaction (durable stores), so its weights and optimizer state belong to one update,
//! while training goes on.

pub mod files;
pub mod location;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::durable::TableRecord;
use crate::error::{corrupt, invalid, storage, Error, Result};
use crate::table::{SparseTable, Table, TableHandle};
use files::{FileInfo, PartSchema, PartWriter, RowBatch};

/// The format's name, in every manifest.
pub const FORMAT_NAME: &str = "pstore-snapshot";
/// The manifest version this build writes; it reads this one and version 1 (written before
/// manifests carried their `checksum`).
pub const FORMAT_VERSION: u32 = 2;
/// The first manifest version whose manifests must carry their checksum.
pub const SEALED_VERSION: u32 = 2;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// Part files per sparse table at most (rows go to part `shard % parts`).
pub(crate) const MAX_PARTS: usize = 16;
/// Rows per record batch.
pub(crate) const BATCH_ROWS: usize = 8192;

/// The snapshot an increment builds on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parent {
    /// The parent's id.
    pub id: String,
    /// The parent's directory, relative to the child's parent directory when both share it.
    pub path: String,
    /// The store's flush cycle the parent was taken at (durable stores).
    pub cycle: u64,
}

/// One table of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    /// The table's name.
    pub name: String,
    /// Its directory inside the snapshot.
    pub dir: String,
    /// Configuration, learning rate, update sequence number and counters.
    pub record: TableRecord,
    /// Row width (sparse) or element count (dense).
    pub dim: usize,
    /// Floats of optimizer state per row (sparse) or in all (dense).
    pub state_len: usize,
    /// Rows in the files of this snapshot (all rows of a full one, changed ones of an increment).
    pub rows: u64,
    /// Rows of the table at the snapshot.
    pub total_rows: u64,
    /// The part files.
    pub files: Vec<FileInfo>,
    /// Ids removed since the parent (increments).
    pub tombstones: Option<FileInfo>,
}

/// A snapshot's manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version.
    pub version: u32,
    /// A unique id.
    pub id: String,
    /// `"full"` or `"incremental"`.
    pub kind: String,
    /// The snapshot an increment builds on.
    pub parent: Option<Parent>,
    /// Unix seconds when it was taken.
    pub created_at: f64,
    /// The store's directory, if durable.
    pub source_path: Option<String>,
    /// The store's flush cycle the rows were read at (durable stores; 0 otherwise).
    pub cycle: u64,
    /// The tables.
    pub tables: Vec<TableEntry>,
    /// `crc32:` and 8 hex digits: the CRC-32 of the file's bytes with these 8 digits written as
    /// zeros (see [`seal_json`]). Absent in version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

impl Manifest {
    /// Reads and checks the manifest of the snapshot in `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(invalid(format!(
                    "{} is not a snapshot: it has no {MANIFEST} (a snapshot without its \
                     manifest does not exist)",
                    dir.display()
                )))
            }
            Err(e) => return Err(storage(format!("reading {}: {e}", path.display()))),
        };
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses and checks the manifest bytes read from `name`.
    pub fn from_bytes(bytes: &[u8], name: &str) -> Result<Self> {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| corrupt(format!("{name}: not a readable manifest: {e}")))?;
        if m.format != FORMAT_NAME {
            return Err(corrupt(format!(
                "{name}: format {:?}, not {FORMAT_NAME:?}",
                m.format
            )));
        }
        if !(1..=FORMAT_VERSION).contains(&m.version) {
            return Err(corrupt(format!(
                "{name}: a snapshot of format version {}; this pstore reads versions 1 to \
                 {FORMAT_VERSION}",
                m.version
            )));
        }
        check_seal(
            name,
            bytes,
            m.checksum.as_deref(),
            m.version >= SEALED_VERSION,
        )?;
        Ok(m)
    }

    /// The manifest's file: its JSON with its own checksum, which is also set in `self`.
    pub fn sealed(&mut self) -> Result<Vec<u8>> {
        self.checksum = Some(SEAL_PLACEHOLDER.into());
        let (bytes, sum) = seal_json(&*self)?;
        self.checksum = Some(sum);
        Ok(bytes)
    }

    /// The chain from the base snapshot to `dir`, base first.
    pub fn chain(dir: &Path) -> Result<Vec<(PathBuf, Manifest)>> {
        let mut out = Vec::new();
        let mut at = dir.to_path_buf();
        loop {
            let m = Manifest::read(&at)?;
            let parent = m.parent.clone();
            out.push((at.clone(), m));
            let Some(p) = parent else { break };
            let next = resolve(&at, &p.path);
            if out.len() > 100_000 {
                return Err(corrupt(format!(
                    "{}: the chain of parents loops",
                    dir.display()
                )));
            }
            let pm = Manifest::read(&next).map_err(|e| match e {
                Error::InvalidArgument(msg) => invalid(format!(
                    "{msg} (the parent of {}, which the increment needs)",
                    at.display()
                )),
                e => e,
            })?;
            if pm.id != p.id {
                return Err(corrupt(format!(
                    "{}: its parent should be snapshot {}, but {} holds snapshot {}",
                    at.display(),
                    p.id,
                    next.display(),
                    pm.id
                )));
            }
            at = next;
        }
        out.reverse();
        if out[0].1.kind != "full" {
            return Err(corrupt(format!(
                "{}: the chain does not start with a full snapshot",
                out[0].0.display()
            )));
        }
        Ok(out)
    }
}

/// The checksum field's value while the checksum is computed.
pub(crate) const SEAL_PLACEHOLDER: &str = "crc32:00000000";

/// The JSON file of `v` (pretty-printed), whose `checksum` field holds [`SEAL_PLACEHOLDER`] and
/// is its last field: the file's bytes with the placeholder's digits replaced by the CRC-32 of
/// the file as it is with the placeholder. Returns the bytes and the checksum's value.
pub(crate) fn seal_json<T: Serialize>(v: &T) -> Result<(Vec<u8>, String)> {
    let mut bytes = serde_json::to_vec_pretty(v).map_err(|e| Error::Internal(e.to_string()))?;
    let quoted = format!("\"{SEAL_PLACEHOLDER}\"");
    let at = find_last(&bytes, quoted.as_bytes())
        .ok_or_else(|| Error::Internal("a sealed file without its checksum field".into()))?;
    let sum = format!("crc32:{:08x}", crc32fast::hash(&bytes));
    bytes[at + 1..at + 1 + sum.len()].copy_from_slice(sum.as_bytes());
    Ok((bytes, sum))
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    (0..=hay.len().checked_sub(needle.len())?)
        .rev()
        .find(|&i| &hay[i..i + needle.len()] == needle)
}

/// Checks the file `path` of `bytes` against its checksum field `checksum` (see [`seal_json`]);
/// `required` when its version must carry one. Any edit of the file (a digit of a learning
/// rate, a seed, a path) makes it fail.
pub(crate) fn check_seal(
    path: &str,
    bytes: &[u8],
    checksum: Option<&str>,
    required: bool,
) -> Result<()> {
    let bad = |why: &str| {
        corrupt(format!(
            "{}: {why}; the file was edited or damaged after it was written, so nothing in it \
             is trusted",
            path
        ))
    };
    let Some(sum) = checksum else {
        return if required {
            Err(bad("it has no checksum field"))
        } else {
            Ok(())
        };
    };
    let digits = sum.strip_prefix("crc32:").unwrap_or("");
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad(&format!(
            "its checksum {sum:?} is not crc32: and 8 hex digits"
        )));
    }
    let quoted = format!("\"{sum}\"");
    let Some(at) = find_last(bytes, quoted.as_bytes()) else {
        return Err(bad(
            "its checksum field is not written as this pstore writes it",
        ));
    };
    let mut plain = bytes.to_vec();
    plain[at + 1..at + 1 + SEAL_PLACEHOLDER.len()].copy_from_slice(SEAL_PLACEHOLDER.as_bytes());
    let want = u32::from_str_radix(digits, 16).unwrap_or(0);
    let got = crc32fast::hash(&plain);
    if got != want {
        return Err(bad(&format!(
            "its content does not match its checksum (CRC-32 {got:08x}, recorded {want:08x})"
        )));
    }
    Ok(())
}

/// The parent directory named by `rel`, as seen from the snapshot directory `child`.
pub(crate) fn resolve(child: &Path, rel: &str) -> PathBuf {
    let p = Path::new(rel);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        child.parent().unwrap_or(Path::new(".")).join(p)
    }
}

/// How `parent` is named from `child`'s directory: by file name when they share a directory.
pub(crate) fn relative_to(child: &Path, parent: &Path) -> String {
    let same = match (
        child.parent().and_then(|p| p.canonicalize().ok()),
        parent.parent().and_then(|p| p.canonicalize().ok()),
    ) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    };
    match (same, parent.file_name()) {
        (true, Some(n)) => n.to_string_lossy().into_owned(),
        _ => parent
            .canonicalize()
            .unwrap_or_else(|_| parent.to_path_buf())
            .to_string_lossy()
            .into_owned(),
    }
}

pub(crate) fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub(crate) fn new_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let salt = crate::hash::mix64(t ^ ((std::process::id() as u64) << 40));
    format!("{t:016x}-{salt:016x}")
}

pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| storage(format!("syncing {}: {e}", dir.display())))
}

/// What a snapshot reports.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotInfo {
    /// The manifest written.
    pub manifest: Manifest,
    /// Bytes of all files, the manifest included.
    pub bytes: u64,
}

/// The meta key of a durable store's last snapshot.
pub(crate) const SNAPSHOT_KEY: &str = "snapshot";

/// Rows headed for one part file: batches are written when full.
pub(crate) struct Part<'c> {
    pub(crate) writer: PartWriter,
    pub(crate) batch: RowBatch,
    pub(crate) schema: PartSchema,
    pub(crate) done: &'c AtomicU64,
}

impl Part<'_> {
    pub(crate) fn add(&mut self, id: u64, words: &[u32]) -> Result<()> {
        self.batch.push_words(id, words, self.schema);
        if self.batch.len() >= BATCH_ROWS {
            self.writer.write(&self.batch)?;
            self.done
                .fetch_add(self.batch.len() as u64, Ordering::Relaxed);
            self.batch.clear();
        }
        Ok(())
    }

    pub(crate) fn finish(mut self) -> Result<FileInfo> {
        if !self.batch.is_empty() {
            self.writer.write(&self.batch)?;
            self.done
                .fetch_add(self.batch.len() as u64, Ordering::Relaxed);
        }
        self.writer.finish()
    }
}

pub(crate) fn open_parts<'c>(
    tmp: &Path,
    dir: &str,
    n: usize,
    schema: PartSchema,
    done: &'c AtomicU64,
) -> Result<Vec<Part<'c>>> {
    (0..n)
        .map(|k| {
            let name = format!("{dir}/part-{k:05}.arrow");
            Ok(Part {
                writer: PartWriter::create(&tmp.join(&name), &name, schema)?,
                batch: RowBatch::default(),
                schema,
                done,
            })
        })
        .collect()
}

/// Part files for `rows` rows of `t`: one per 256Ki rows, at most [`MAX_PARTS`] and the shard
/// count (a small increment is one file, not sixteen fsynced ones).
pub(crate) fn parts_for(t: &SparseTable, rows: u64) -> usize {
    (rows.div_ceil(1 << 18) as usize).clamp(1, t.num_shards().min(MAX_PARTS))
}

/// The most bytes of rows an increment of a durable store copies from memory before it writes
/// them (see [`SparseTable::copy_settled`]); the changed rows of tables beyond it are read back
/// from the replica.
pub(crate) const SETTLED_BYTES: usize = 256 << 20;

/// The entry of a dense table of `words` (two header words, the first the step, then the tensor
/// and its state), its one row written to `tmp`.
pub(crate) fn dense_entry(
    tmp: &Path,
    name: &str,
    dir: String,
    record: TableRecord,
    words: Vec<u32>,
) -> Result<TableEntry> {
    let TableRecord::Dense { config, .. } = &record else {
        return Err(Error::Internal("a dense entry of a sparse table".into()));
    };
    let numel = config.numel();
    let schema = PartSchema {
        dim: numel,
        state_len: words.len() - 2 - numel,
    };
    // One row, id 0: [step, version, updated_at, freq] then the tensor and its state.
    let mut w = vec![words[0], 0, 0, 0, 0, 0];
    w.extend_from_slice(&words[2..]);
    let fname = format!("{dir}/value.arrow");
    // Progress counts the rows of sparse tables only.
    let uncounted = AtomicU64::new(0);
    let mut part = Part {
        writer: PartWriter::create(&tmp.join(&fname), &fname, schema)?,
        batch: RowBatch::default(),
        schema,
        done: &uncounted,
    };
    part.add(0, &w)?;
    Ok(TableEntry {
        name: name.to_string(),
        dir,
        record,
        dim: schema.dim,
        state_len: schema.state_len,
        rows: 1,
        total_rows: 1,
        files: vec![part.finish()?],
        tombstones: None,
    })
}

/// Loads table `last` (an entry of the chain's last manifest) from the whole `chain` into
/// `table`, keeping only the ids `keep` accepts (every id for the embedded restore; the ids a
/// server owns in a new layout for a cluster restore). Returns the rows written.
///
/// The chain is applied newest first: a member's tombstones, then its rows, each id decided by
/// the newest member that names it. The result is the embedded rules' (rows in chain order, each
/// member's tombstones after its rows), without writing a row that a later member replaces, and
/// a tombstone only ever hides the chain's own older rows: rows of `table` that the chain does
/// not name are left as they are. Entries of an earlier table of the same name (another uid,
/// dropped later in the chain) are skipped.
///
/// Files are read in parallel on the table's pool, or with `own_pool` false on rayon's global
/// pool: a durable store's flusher holds the table's change lock while it runs work on the
/// table's pool, so rows written into a live durable table must not wait on that pool.
pub(crate) fn load_chain<F>(
    chain: &[(PathBuf, Manifest)],
    last: &TableEntry,
    table: &Table,
    keep: F,
    own_pool: bool,
    done: &AtomicU64,
) -> Result<u64>
where
    F: Fn(u64) -> bool + Sync,
{
    let uid = last.record.uid();
    let members: Vec<(&Path, &TableEntry)> = chain
        .iter()
        .filter_map(|(p, m)| {
            m.tables
                .iter()
                .find(|e| e.name == last.name && (e.record.uid() == 0 || e.record.uid() == uid))
                .map(|e| (p.as_path(), e))
        })
        .collect();
    if let Table::Dense(_) = table {
        let Some((dir, e)) = members.last() else {
            return Ok(0);
        };
        if !keep(0) {
            return Ok(0);
        }
        load_entry(dir, e, table, |_| true, None, own_pool, done)?;
        return Ok(1);
    }
    let mut decided = std::collections::HashSet::<u64>::new();
    let mut rows = 0;
    for (k, (dir, e)) in members.iter().enumerate().rev() {
        if let Some(fi) = &e.tombstones {
            let gone = files::read_ids(&dir.join(&fi.name), fi)?;
            decided.extend(gone.into_iter().filter(|&id| keep(id)));
        }
        // The oldest member's ids need no record: nothing older is left to hide.
        let written = (k > 0).then(|| std::sync::Mutex::new(Vec::new()));
        let check = !decided.is_empty();
        let keep_here = |id: u64| keep(id) && !(check && decided.contains(&id));
        rows += load_entry(dir, e, table, keep_here, written.as_ref(), own_pool, done)?;
        if let Some(w) = written {
            decided.extend(w.into_inner().unwrap_or_else(|e| e.into_inner()));
        }
    }
    Ok(rows)
}

/// Loads the rows (or value) of `entry`, in the snapshot `dir`, into `table`: the rows whose id
/// `keep` accepts (their ids also go to `written` when given). Returns the rows written.
fn load_entry<F>(
    dir: &Path,
    entry: &TableEntry,
    table: &Table,
    keep: F,
    written: Option<&std::sync::Mutex<Vec<u64>>>,
    own_pool: bool,
    done: &AtomicU64,
) -> Result<u64>
where
    F: Fn(u64) -> bool + Sync,
{
    let schema = PartSchema {
        dim: entry.dim,
        state_len: entry.state_len,
    };
    match table {
        Table::Sparse(t) => {
            if t.dim() != entry.dim || t.state_len() != entry.state_len {
                return Err(corrupt(format!(
                    "{}: table {:?} has rows of dim {} and state {}, the chain's last \
                     config says {} and {}",
                    dir.display(),
                    entry.name,
                    entry.dim,
                    entry.state_len,
                    t.dim(),
                    t.state_len()
                )));
            }
            let rows = AtomicU64::new(0);
            let load = || {
                entry.files.par_iter().try_for_each(|fi| {
                    let path = dir.join(&fi.name);
                    let mut ids = Vec::new();
                    let mut words = Vec::new();
                    files::read_part(&path, schema, fi, |b| {
                        ids.clear();
                        words.clear();
                        for i in 0..b.len() {
                            if keep(b.ids[i]) {
                                ids.push(b.ids[i]);
                                b.row_words(i, schema, &mut words);
                            }
                        }
                        t.put_rows(&ids, &words)?;
                        if let Some(w) = written {
                            w.lock().unwrap_or_else(|e| e.into_inner()).extend(&ids);
                        }
                        rows.fetch_add(ids.len() as u64, Ordering::Relaxed);
                        done.fetch_add(b.len() as u64, Ordering::Relaxed);
                        Ok(())
                    })
                })
            };
            if own_pool {
                t.common().exec.install(load)?;
            } else {
                load()?;
            }
            Ok(rows.into_inner())
        }
        Table::Dense(d) => {
            let b = dense_value(dir, entry)?;
            let mut w = Vec::new();
            b.row_words(0, schema, &mut w);
            let mut words = vec![w[0], 0];
            words.extend_from_slice(&w[crate::shard::META..]);
            d.set_words(&words)?;
            Ok(1)
        }
    }
}

/// The one row of dense table `entry` in the snapshot `dir` (value and optimizer state),
/// checked like every part file.
pub(crate) fn dense_value(dir: &Path, entry: &TableEntry) -> Result<files::RowBatch> {
    let schema = PartSchema {
        dim: entry.dim,
        state_len: entry.state_len,
    };
    let fi = entry.files.first().ok_or_else(|| {
        corrupt(format!(
            "{}: dense table {:?} has no file",
            dir.display(),
            entry.name
        ))
    })?;
    let mut value = None;
    files::read_part(&dir.join(&fi.name), schema, fi, |b| {
        if b.len() == 1 {
            value = Some(b.to_batch());
        }
        Ok(())
    })?;
    value.ok_or_else(|| {
        corrupt(format!(
            "{}: dense table {:?} has no value",
            dir.display(),
            entry.name
        ))
    })
}

/// Checks every file of the chain ending at `dir` against its manifest (sizes and checksums);
/// returns the bytes checked.
pub fn verify(dir: &Path) -> Result<u64> {
    let mut bytes = 0;
    for (path, m) in Manifest::chain(dir)? {
        for e in &m.tables {
            let schema = PartSchema {
                dim: e.dim,
                state_len: e.state_len,
            };
            for fi in &e.files {
                files::read_part(&path.join(&fi.name), schema, fi, |_| Ok(()))?;
                bytes += fi.bytes;
            }
            if let Some(fi) = &e.tombstones {
                files::read_ids(&path.join(&fi.name), fi)?;
                bytes += fi.bytes;
            }
        }
    }
    Ok(bytes)
}

pub(crate) fn dir_of(chain: &[(PathBuf, Manifest)]) -> String {
    chain
        .last()
        .map(|(p, _)| p.display().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod seal_tests {
    use super::*;

    #[derive(Serialize)]
    struct Doc {
        lr: f64,
        name: String,
        checksum: Option<String>,
    }

    #[test]
    fn a_sealed_file_checks_and_any_edit_fails() {
        let doc = Doc {
            lr: 0.1,
            name: "crc32:00000000".into(),
            checksum: Some(SEAL_PLACEHOLDER.into()),
        };
        let (bytes, sum) = seal_json(&doc).unwrap();
        let path = "m.json";
        check_seal(path, &bytes, Some(&sum), true).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        let edited = text.replacen("0.1", "0.9", 1);
        let e = check_seal(path, edited.as_bytes(), Some(&sum), true).unwrap_err();
        assert!(matches!(e, Error::Corrupt(_)) && e.to_string().contains("m.json"));
        // Another checksum value, or none where one is required.
        assert!(check_seal(path, &bytes, Some("crc32:0000000g"), true).is_err());
        assert!(check_seal(path, &bytes, None, true).is_err());
        assert!(check_seal(path, &bytes, None, false).is_ok());
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            assert!(check_seal(path, &b, Some(&sum), true).is_err(), "byte {i}");
        }
    }
}
