//! Writing the replica: one write transaction per environment written, rows put in key order.

use heed::types::Bytes;
use heed::{Database, RwTxn};

use super::format::{cycle_of, decode, encode, key, part_of_key, value_len, Db};
use super::read::DbHandle;
use super::{is_map_full, lmdb_err, DbKey, Storage};
use crate::error::{Error, Result};

/// A cursor step costs about this fraction of a descent of the tree: a write walks a key range
/// when it rewrites at least one stored row in this many.
pub(super) const WALK_PER_DESCENT: u64 = 8;

/// The key of a cursor's entry, copied (`None` past the end).
pub(super) fn key_of(entry: Option<heed::Result<(&[u8], &[u8])>>) -> heed::Result<Option<[u8; 8]>> {
    Ok(entry.transpose()?.and_then(|(k, _)| k.try_into().ok()))
}

/// Write access inside one transaction per environment written.
pub struct Writer<'s> {
    pub(super) storage: &'s Storage,
    /// Per environment, opened when first written.
    pub(super) txns: Vec<Option<RwTxn<'s>>>,
    /// The one environment this writer may write (see [`Storage::write_each`]).
    pub(super) only: Option<usize>,
    /// The environment whose map filled.
    pub(super) map_full: Option<usize>,
    pub(super) created: Vec<(DbKey, Database<Bytes, Bytes>)>,
}

impl<'s> Writer<'s> {
    pub(super) fn fail(&mut self, k: usize, what: &str, e: heed::Error) -> Error {
        if is_map_full(&e) {
            self.map_full = Some(k);
        }
        lmdb_err(&self.storage.parts[k].dir, what, e)
    }

    pub(super) fn check(&mut self, k: usize, what: &str, r: heed::Result<()>) -> Result<()> {
        r.map_err(|e| self.fail(k, what, e))
    }

    /// The environments this writer may write.
    pub(super) fn reach(&self) -> std::ops::Range<usize> {
        match self.only {
            Some(k) => k..k + 1,
            None => 0..self.txns.len(),
        }
    }

    /// The transaction of environment `k`, begun on first use.
    pub(super) fn txn(&mut self, k: usize) -> Result<&mut RwTxn<'s>> {
        if !self.reach().contains(&k) {
            return Err(Error::Internal(format!(
                "a writer of environments {:?} asked for environment {k}",
                self.reach()
            )));
        }
        if self.txns[k].is_none() {
            let p = &self.storage.parts[k];
            let t = p
                .env
                .write_txn()
                .map_err(|e| lmdb_err(&p.dir, "writing", e))?;
            self.txns[k] = Some(t);
        }
        Ok(self.txns[k].as_mut().expect("begun above"))
    }

    /// Commits every transaction begun, environment 0 last. `Err(Ok(k))`: environment `k`'s
    /// map is full (it and those after it did not commit).
    pub(super) fn commit(mut self) -> std::result::Result<(), std::result::Result<usize, Error>> {
        let n = self.txns.len();
        for k in (1..n).chain([0]) {
            let Some(t) = self.txns[k].take() else {
                continue;
            };
            match t.commit() {
                Ok(()) => {
                    // Handles of databases created by a transaction are valid only once it has
                    // committed.
                    let mut dbs = self.storage.dbs.lock().unwrap_or_else(|e| e.into_inner());
                    dbs.extend(self.created.iter().filter(|(c, _)| c.0 == k).cloned());
                }
                Err(e) if is_map_full(&e) => return Err(Ok(k)),
                Err(e) => {
                    return Err(Err(lmdb_err(
                        &self.storage.parts[k].dir,
                        "committing to",
                        e,
                    )))
                }
            }
        }
        Ok(())
    }

    /// A table's database in environment `k`, created in this transaction if need be.
    pub(super) fn db(&mut self, k: usize, db: Db, table: &str) -> Result<Database<Bytes, Bytes>> {
        let storage = self.storage;
        if let Some(d) = storage.handle(k, db, table) {
            return Ok(d);
        }
        let id = (k, db, table.to_string());
        if let Some((_, d)) = self.created.iter().find(|(c, _)| *c == id) {
            return Ok(*d);
        }
        let name = Storage::db_name(db, table);
        let txn = self.txn(k)?;
        match storage.parts[k]
            .env
            .create_database::<Bytes, Bytes>(txn, Some(&name))
        {
            Ok(d) => {
                self.created.push((id, d));
                Ok(d)
            }
            Err(e) => Err(self.fail(k, "writing", e)),
        }
    }

    /// The value of a meta key, as this transaction sees it.
    pub fn meta(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let storage = self.storage;
        let txn = self.txn(0)?;
        storage.meta_in(txn, key)
    }

    /// Sets a meta key.
    pub fn put_meta(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let meta = self.storage.meta;
        let r = meta.put(self.txn(0)?, key.as_bytes(), value);
        self.check(0, "writing", r)
    }

    /// Sets a key of environment `k`'s own `meta` (environment 0's is the store's).
    pub fn put_part_meta(&mut self, k: usize, key: &str, value: &[u8]) -> Result<()> {
        let meta = self.storage.parts[k].meta;
        let r = meta.put(self.txn(k)?, key.as_bytes(), value);
        self.check(k, "writing", r)
    }

    /// Deletes a key of environment `k`'s own `meta`.
    pub fn delete_part_meta(&mut self, k: usize, key: &str) -> Result<()> {
        let meta = self.storage.parts[k].meta;
        let r = meta.delete(self.txn(k)?, key.as_bytes()).map(|_| ());
        self.check(k, "writing", r)
    }

    /// Deletes a meta key.
    pub fn delete_meta(&mut self, key: &str) -> Result<()> {
        let meta = self.storage.meta;
        let r = meta.delete(self.txn(0)?, key.as_bytes()).map(|_| ());
        self.check(0, "writing", r)
    }

    /// Sets `id`'s payload in a table's database. The value is written straight into LMDB's
    /// page (`MDB_RESERVE`), with no intermediate copy.
    pub fn put(&mut self, db: Db, table: &str, id: u64, payload: &[u8]) -> Result<()> {
        let h = self.open(db, table)?;
        self.put_in(&h, id, payload)
    }

    /// A table's database (in the environments this writer reaches), looked up once for many
    /// [`Writer::put_in`] (a lookup by name takes a lock and hashes the name: a cost per row
    /// when done for each).
    pub fn open(&mut self, db: Db, table: &str) -> Result<DbHandle> {
        let mut d = vec![None; self.txns.len()];
        for k in self.reach() {
            d[k] = Some(self.db(k, db, table)?);
        }
        Ok(DbHandle { db, d })
    }

    /// The database of `h` in environment `k`.
    pub(super) fn reached(h: &DbHandle, k: usize) -> Result<Database<Bytes, Bytes>> {
        h.d[k].ok_or_else(|| {
            Error::Internal(format!(
                "a database handle used in environment {k}, which it does not reach"
            ))
        })
    }

    /// [`Writer::put`] into a database opened by [`Writer::open`].
    pub fn put_in(&mut self, h: &DbHandle, id: u64, payload: &[u8]) -> Result<()> {
        let k = key(id);
        let p = part_of_key(k, self.txns.len());
        let (db, d) = (h.db, Self::reached(h, p)?);
        let r = d.put_reserved(self.txn(p)?, &k, value_len(db, payload.len()), |space| {
            encode(db, id, payload, space)
        });
        self.check(p, "writing", r)
    }

    /// [`Writer::put_in`] of many rows, `rows` in key order (ascending [`key`]). Where the rows
    /// are dense among those stored in their key range, a cursor walks the range and rewrites
    /// each row where it stands (`MDB_CURRENT`: same-size values are overwritten in place, with
    /// no descent of the tree per row); ids it does not find are put afterwards like any other.
    /// A descent per row compared keys at every level and looked each page up among the
    /// transaction's dirty pages: about a third of a flush's time.
    pub fn put_rows_in_order(&mut self, h: &DbHandle, rows: &[(u64, &[u8])]) -> Result<()> {
        let n = self.txns.len();
        let mut rest = rows;
        while let Some(first) = rest.first() {
            let p = part_of_key(key(first.0), n);
            let cut = rest.partition_point(|r| part_of_key(key(r.0), n) <= p);
            let (here, after) = rest.split_at(cut);
            self.put_rows_in_part(h, p, here)?;
            rest = after;
        }
        Ok(())
    }

    /// [`Writer::put_rows_in_order`] of rows that environment `p` holds.
    pub(super) fn put_rows_in_part(
        &mut self,
        h: &DbHandle,
        p: usize,
        rows: &[(u64, &[u8])],
    ) -> Result<()> {
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
            return Ok(());
        };
        let d = Self::reached(h, p)?;
        let n = self.txns.len() as u64;
        let (lo, hi) = (key(first.0), key(last.0));
        let stored = {
            let r = d.len(self.txn(p)?);
            r.map_err(|e| self.fail(p, "reading", e))?
        };
        // The rows stored in [lo, hi], keys being uniform hashes over the environment's range.
        let span = u64::from_be_bytes(hi) - u64::from_be_bytes(lo);
        let width = (u64::MAX / n) as f64;
        let in_range = (stored as f64 * (span as f64 / width).min(1.0)).ceil() as u64 + 1;
        if (rows.len() as u64) * WALK_PER_DESCENT < in_range {
            for &(id, payload) in rows {
                self.put_in(h, id, payload)?;
            }
            return Ok(());
        }
        let mut absent = Vec::new();
        let mut value = Vec::with_capacity(value_len(h.db, first.1.len()));
        let db = h.db;
        let txn = self.txn(p)?;
        let r = (|| -> heed::Result<()> {
            let range = (
                std::ops::Bound::Included(&lo[..]),
                std::ops::Bound::Included(&hi[..]),
            );
            let mut it = d.range_mut(txn, &range)?;
            // The key the cursor stands on (copied: the database's bytes may move on a write).
            let mut at = key_of(it.next())?;
            for &(id, payload) in rows {
                let k = key(id);
                while at.is_some_and(|a| a < k) {
                    at = key_of(it.next())?;
                }
                if at == Some(k) {
                    value.clear();
                    encode(db, id, payload, &mut value)?;
                    // SAFETY: no key or value of the database is held across the write (`at`
                    // is a copy), and the key is the one the cursor stands on.
                    unsafe { it.put_current(&k[..], &value[..])? };
                } else {
                    absent.push((id, payload));
                }
            }
            Ok(())
        })();
        self.check(p, "writing", r)?;
        for (id, payload) in absent {
            self.put_in(h, id, payload)?;
        }
        Ok(())
    }

    /// Deletes `id` from a table's database; true if it was there.
    pub fn delete(&mut self, db: Db, table: &str, id: u64) -> Result<bool> {
        let k = key(id);
        let p = part_of_key(k, self.txns.len());
        let d = self.db(p, db, table)?;
        let r = d.delete(self.txn(p)?, &k);
        r.map_err(|e| self.fail(p, "writing", e))
    }

    /// Empties a table's database.
    pub fn clear(&mut self, db: Db, table: &str) -> Result<()> {
        for p in self.reach() {
            let d = self.db(p, db, table)?;
            let r = d.clear(self.txn(p)?);
            self.check(p, "writing", r)?;
        }
        Ok(())
    }

    /// Deletes the entries of a table's database whose value (a u64 LE cycle) is at most `upto`.
    pub fn prune(&mut self, db: Db, table: &str, upto: u64) -> Result<()> {
        for p in self.reach() {
            let d = self.db(p, db, table)?;
            let (dir, sums) = (&self.storage.parts[p].dir, self.storage.parts[p].sums);
            let txn = self.txn(p)?;
            // Deleted where the cursor stands, in one pass: no second descent of the tree per
            // entry.
            let r = (|| -> std::result::Result<(), PruneError> {
                let mut iter = d.iter_mut(txn).map_err(PruneError::Lmdb)?;
                while let Some(item) = iter.next() {
                    let (k, v) = item.map_err(PruneError::Lmdb)?;
                    let (_, cycle) =
                        decode(db, table, dir, sums, k, v).map_err(PruneError::Decode)?;
                    let old = cycle_of(cycle) <= upto;
                    if old {
                        // SAFETY: nothing read from the database (this entry's key and value,
                        // last used just above) is used after the deletion.
                        unsafe { iter.del_current() }.map_err(PruneError::Lmdb)?;
                    }
                }
                Ok(())
            })();
            match r {
                Ok(()) => {}
                Err(PruneError::Decode(e)) => return Err(e),
                Err(PruneError::Lmdb(e)) => return Err(self.fail(p, "writing", e)),
            }
        }
        Ok(())
    }
}

/// Why [`Writer::prune`] stopped.
pub(super) enum PruneError {
    Lmdb(heed::Error),
    Decode(Error),
}
