//! The on-disk format of the replica: the format record and its checks, the databases of a
//! table, the keys (the id's placement hash), the encoding of values, the environments' key
//! ranges and directories.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{corrupt, Result};

#[cfg(target_endian = "big")]
compile_error!("the LMDB replica stores little-endian words; big-endian hosts are not supported");

/// The format's name, in the `format` key of the meta database.
pub const FORMAT_NAME: &str = "pstore-lmdb";

/// The version of the on-disk format this build writes (it opens versions 1 and 2 too, adding the
/// rows' checksums at open: see [`Storage::open`](super::Storage::open)).
/// Version 3: every row value ends with its checksum ([`row_sum`]). Version 2: the same without
/// checksums. Version 1: version 2 with one environment and no `environments` field.
pub const FORMAT_VERSION: u32 = 3;

/// The first format version whose rows carry a checksum.
pub(super) const ROW_SUMS_SINCE: u32 = 3;

/// The key, in the `meta` of an environment k >= 1, that marks its rows as carrying checksums
/// while the store's format record still says an older version (an upgrade stopped between
/// environments).
pub(super) const ROW_SUMS_KEY: &str = "row-sums";

/// The most LMDB environments a store may be split into.
pub const MAX_ENVIRONMENTS: usize = 16;

/// The most named databases (three per table, so at most 1023 tables, plus `meta`).
pub(super) const MAX_DBS: u32 = 3072;

/// The map a new environment starts with; it doubles whenever a write fills it.
pub const DEFAULT_MAP_SIZE: usize = 64 << 30;

/// The `format` record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormatRecord {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version.
    pub version: u32,
    /// The number of LMDB environments (1 in version 1, which has no such field).
    #[serde(default = "one")]
    pub environments: u32,
}

pub(super) fn one() -> u32 {
    1
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
    pub(super) fn prefix(self) -> &'static str {
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

/// The checksum of row `id` with `payload` (its words after the id: header words, weights and
/// optimizer state): CRC-32 of the id (u64 LE) then the payload. The last 4 bytes (LE) of a
/// row's value in format version 3.
#[inline]
pub fn row_sum(id: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&id.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Bytes of a row's checksum at the end of its value.
pub const ROW_SUM_BYTES: usize = 4;

/// Writes the value of row `id` with `payload` as the replica stores it (format version 3):
/// the id (u64 LE), the payload, its [`row_sum`] (u32 LE). The one encoding of a stored row,
/// for whatever ships rows elsewhere; [`check_row`] is its inverse.
pub fn encode_row(id: u64, payload: &[u8], out: &mut impl std::io::Write) -> std::io::Result<()> {
    out.write_all(&id.to_le_bytes())?;
    out.write_all(payload)?;
    out.write_all(&row_sum(id, payload).to_le_bytes())
}

/// Bytes of the value [`encode_row`] writes for a payload of `payload` bytes.
pub const fn row_value_len(payload: usize) -> usize {
    8 + payload + ROW_SUM_BYTES
}

/// The id and payload of a row value of format version 3 stored under `key` (the id's
/// [`key`]) in the environment at `dir`, its checksum verified. A value that fails names the
/// table, the id (the key's, when the id stored in the value is itself damaged) and the
/// environment's data file; its bytes are never returned.
pub fn check_row<'v>(dir: &Path, table: &str, key: &[u8], v: &'v [u8]) -> Result<(u64, &'v [u8])> {
    let file = || dir.join("data.mdb");
    if v.len() < 8 + ROW_SUM_BYTES {
        return Err(corrupt(format!(
            "{}: table {table:?}: a row value of {} bytes (id {}), too short for its id and \
             checksum",
            file().display(),
            v.len(),
            id_of_key(key)
        )));
    }
    let (body, sum) = v.split_at(v.len() - ROW_SUM_BYTES);
    let id = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
    let stored = u32::from_le_bytes(sum.try_into().expect("4 bytes"));
    let payload = &body[8..];
    // The id and the payload lie together in the value: `row_sum(id, payload)` in one call,
    // without the short input of the id on its own.
    let found = crc32fast::hash(body);
    if found != stored {
        let named = if key.len() == 8 && key == self::key(id) {
            id
        } else {
            id_of_key(key)
        };
        return Err(corrupt(format!(
            "{}: table {table:?}: row {named} is damaged (checksum {stored:08x} stored, \
             {found:08x} computed); it is not served: restore the table from a snapshot",
            file().display()
        )));
    }
    Ok((id, payload))
}

/// The id whose key is `key` (`mix64` is a bijection), or 0 for a key of the wrong length.
fn id_of_key(key: &[u8]) -> u64 {
    key.try_into()
        .map(|k| crate::hash::unmix64(u64::from_be_bytes(k)))
        .unwrap_or(0)
}

/// Writes the stored value of `id` with `payload` (the inverse of [`decode`]); rows as
/// [`encode_row`].
pub(super) fn encode(
    db: Db,
    id: u64,
    payload: &[u8],
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    match db {
        Db::Rows => encode_row(id, payload, out),
        Db::Changed | Db::Removed => {
            out.write_all(payload)?;
            out.write_all(&id.to_le_bytes())
        }
    }
}

/// Bytes of the value [`encode`] writes.
pub(super) fn value_len(db: Db, payload: usize) -> usize {
    match db {
        Db::Rows => row_value_len(payload),
        Db::Changed | Db::Removed => payload + 8,
    }
}

/// The id and payload of a value stored under `key` in the environment at `dir`; a row's
/// checksum is verified where `sums` (format version 3, or an environment already upgraded).
pub(super) fn decode<'v>(
    db: Db,
    table: &str,
    dir: &Path,
    sums: bool,
    key: &[u8],
    v: &'v [u8],
) -> Result<(u64, &'v [u8])> {
    let bad = || {
        corrupt(format!(
            "{}: table {table:?}: a value of {} bytes in {}{table} (id {})",
            dir.join("data.mdb").display(),
            v.len(),
            db.prefix(),
            id_of_key(key)
        ))
    };
    let id = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    match db {
        Db::Rows if sums => check_row(dir, table, key, v),
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

/// The environment (of `parts`) that holds the rows of `key`: the high bits of the placement
/// hash, as for shards, so each environment holds one contiguous key range.
#[inline]
pub(super) fn part_of_key(key: [u8; 8], parts: usize) -> usize {
    ((u128::from(u64::from_be_bytes(key)) * parts as u128) >> 64) as usize
}

/// The directory of environment `k` of the store at `path`.
pub(super) fn part_dir(path: &Path, k: usize) -> PathBuf {
    if k == 0 {
        path.to_path_buf()
    } else {
        path.join(format!("env-{k}"))
    }
}

/// The `part` record of environment `k` >= 1 (in its `meta` database).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct PartRecord {
    pub(super) format: String,
    pub(super) environment: usize,
    pub(super) environments: usize,
}

/// A store's `format` record (its number of environments checked); another format or an
/// unknown version is refused.
pub(super) fn check_format(path: &Path, bytes: &[u8]) -> Result<FormatRecord> {
    let rec: FormatRecord = serde_json::from_slice(bytes).map_err(|e| {
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
    if !(1..=FORMAT_VERSION).contains(&rec.version) {
        return Err(corrupt(format!(
            "{} is a store of format version {}; this pstore reads versions 1 to \
             {FORMAT_VERSION}",
            path.display(),
            rec.version
        )));
    }
    let n = rec.environments as usize;
    if !(1..=MAX_ENVIRONMENTS).contains(&n) || (rec.version == 1 && n != 1) {
        return Err(corrupt(format!(
            "{}: the format record gives {n} environments",
            path.display()
        )));
    }
    Ok(rec)
}

/// The cycle stored in a `changed` or `removed` value.
pub fn cycle_of(v: &[u8]) -> u64 {
    v.try_into().map(u64::from_le_bytes).unwrap_or(0)
}
