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

/// The version of the on-disk format this build reads and writes.
/// (Version 1 is the same layout with one environment and no `environments` field; it is read
/// as such.)
pub const FORMAT_VERSION: u32 = 2;

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

/// Writes the stored value of `id` with `payload` (the inverse of [`decode`]).
pub(super) fn encode(
    db: Db,
    id: u64,
    payload: &[u8],
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
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

/// The id and payload of a stored value.
pub(super) fn decode<'v>(db: Db, table: &str, v: &'v [u8]) -> Result<(u64, &'v [u8])> {
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
