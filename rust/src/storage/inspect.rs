//! Inspecting a store directory without opening it for writing.

use std::path::Path;

use heed::types::Bytes;
use heed::{Database, Env, EnvOpenOptions, RoTxn, WithoutTls};

use super::format::{check_format, cycle_of, part_dir, Db, FormatRecord, MAX_DBS};
use super::{lmdb_err, Storage};
use crate::error::{corrupt, invalid, Result};

/// What `inspect` reports of a store directory.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSummary {
    /// The format record.
    pub format: FormatRecord,
    /// The last flush cycle.
    pub cycle: u64,
    /// Bytes of the data files.
    pub file_bytes: u64,
    /// The record of the last snapshot taken (JSON), if any.
    pub snapshot: Option<String>,
    /// Per table: name, record (JSON), rows in the replica, ids changed and removed since the
    /// last snapshot.
    pub tables: Vec<(String, String, u64, u64, u64)>,
}

/// Entries of the named database `name` in an environment (0 if it has none).
pub(super) fn db_len(
    env: &Env<WithoutTls>,
    txn: &RoTxn<'_, WithoutTls>,
    name: &str,
    dir: &Path,
) -> Result<u64> {
    let err = |e| lmdb_err(dir, "reading", e);
    let d: Option<Database<Bytes, Bytes>> = env.open_database(txn, Some(name)).map_err(err)?;
    d.map_or(Ok(0), |d| d.len(txn).map_err(err))
}

/// Reads a store directory without opening it for writing (it may be open in another process).
pub fn inspect(path: &Path) -> Result<StoreSummary> {
    if !path.join("data.mdb").is_file() {
        return Err(invalid(format!(
            "no store at {} (no data.mdb)",
            path.display()
        )));
    }
    let open_ro = |dir: &Path| {
        super::check_data_file(dir, "store")?;
        let mut opts = EnvOpenOptions::new().read_txn_without_tls();
        opts.max_dbs(MAX_DBS);
        // SAFETY: read-only: this process writes nothing; LMDB's reader table handles
        // concurrent writers in other processes.
        unsafe {
            let mut o = opts;
            o.flags(heed::EnvFlags::READ_ONLY);
            o.open(dir)
        }
        .map_err(|e| lmdb_err(dir, "opening", e))
    };
    let env = open_ro(path)?;
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
    let raw = meta
        .get(&txn, b"format")
        .map_err(err)?
        .ok_or_else(|| corrupt(format!("{}: no format record", path.display())))?;
    let format = check_format(path, raw)?;
    let n = format.environments as usize;
    let cycle = meta.get(&txn, b"cycle").map_err(err)?.map_or(0, cycle_of);
    let snapshot = meta
        .get(&txn, b"snapshot")
        .map_err(err)?
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let others = (1..n)
        .map(|k| {
            let dir = part_dir(path, k);
            open_ro(&dir).map(|e| (dir, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let other_txns = others
        .iter()
        .map(|(dir, e)| e.read_txn().map_err(|x| lmdb_err(dir, "reading", x)))
        .collect::<Result<Vec<_>>>()?;
    let mut file_bytes = 0;
    for k in 0..n {
        file_bytes += std::fs::metadata(part_dir(path, k).join("data.mdb")).map_or(0, |m| m.len());
    }
    let mut tables = Vec::new();
    for item in meta.prefix_iter(&txn, b"table/").map_err(err)? {
        let (k, v) = item.map_err(err)?;
        let name = String::from_utf8_lossy(&k[6..]).into_owned();
        let mut counts = [0u64; 3];
        for (i, db) in [Db::Rows, Db::Changed, Db::Removed].into_iter().enumerate() {
            let db_name = Storage::db_name(db, &name);
            counts[i] = db_len(&env, &txn, &db_name, path)?;
            for ((dir, e), t) in others.iter().zip(&other_txns) {
                counts[i] += db_len(e, t, &db_name, dir)?;
            }
        }
        tables.push((
            name,
            String::from_utf8_lossy(v).into_owned(),
            counts[0],
            counts[1],
            counts[2],
        ));
    }
    Ok(StoreSummary {
        format,
        cycle,
        file_bytes,
        snapshot,
        tables,
    })
}
