//! Reading the replica: a view of the last committed state, one read transaction per
//! environment.

use heed::types::Bytes;
use heed::{Database, RoTxn, WithoutTls};

use super::format::{decode, key, part_of_key, Db};
use super::{lmdb_err, Storage};
use crate::error::{corrupt, Error, Result};

/// Read access to the last committed state, one read transaction per environment.
pub struct Reader<'s> {
    pub(super) storage: &'s Storage,
    pub(super) txns: Vec<RoTxn<'s, WithoutTls>>,
}

impl Reader<'_> {
    pub(super) fn fail(&self, k: usize, e: heed::Error) -> Error {
        lmdb_err(&self.storage.parts[k].dir, "reading", e)
    }

    /// The value of a meta key.
    pub fn meta(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.storage.meta_in(&self.txns[0], key)
    }

    /// The value of a key of environment `k`'s own `meta` (environment 0's is the store's).
    pub fn part_meta(&self, k: usize, key: &str) -> Result<Option<Vec<u8>>> {
        self.storage.parts[k]
            .meta
            .get(&self.txns[k], key.as_bytes())
            .map(|v| v.map(<[u8]>::to_vec))
            .map_err(|e| self.fail(k, e))
    }

    /// Every meta (key, value) whose key starts with `prefix`, in key order.
    pub fn meta_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let mut out = Vec::new();
        for item in self
            .storage
            .meta
            .prefix_iter(&self.txns[0], prefix.as_bytes())
            .map_err(|e| self.fail(0, e))?
        {
            let (k, v) = item.map_err(|e| self.fail(0, e))?;
            out.push((String::from_utf8_lossy(k).into_owned(), v.to_vec()));
        }
        Ok(out)
    }

    /// The payload of `id` in a table's database.
    pub fn get(&self, db: Db, table: &str, id: u64) -> Result<Option<&[u8]>> {
        self.get_in(self.open(db, table).as_ref(), table, id)
    }

    /// A table's database, looked up once for many [`Reader::get_in`] (a lookup by name takes a
    /// lock and hashes the name); `None` if the table has none.
    pub fn open(&self, db: Db, table: &str) -> Option<DbHandle> {
        self.storage.handles(db, table)
    }

    /// [`Reader::get`] in a database opened by [`Reader::open`] (`table` names it in errors;
    /// a table without the database has no payload).
    pub fn get_in(&self, h: Option<&DbHandle>, table: &str, id: u64) -> Result<Option<&[u8]>> {
        let Some(h) = h else {
            return Ok(None);
        };
        let k = key(id);
        let p = part_of_key(k, self.txns.len());
        let Some(d) = h.d[p] else {
            return Ok(None);
        };
        let v = d.get(&self.txns[p], &k).map_err(|e| self.fail(p, e))?;
        match v {
            None => Ok(None),
            Some(v) => {
                let part = &self.storage.parts[p];
                let (stored, payload) = decode(h.db, table, &part.dir, part.sums, &k, v)?;
                if stored != id {
                    return Err(corrupt(format!(
                        "{}: table {table:?}: the key of id {id} holds id {stored}",
                        part.dir.display()
                    )));
                }
                Ok(Some(payload))
            }
        }
    }

    /// Entries of a table's database.
    pub fn len(&self, db: Db, table: &str) -> Result<u64> {
        let mut n = 0;
        for (k, txn) in self.txns.iter().enumerate() {
            if let Some(d) = self.storage.handle(k, db, table) {
                n += d.len(txn).map_err(|e| self.fail(k, e))?;
            }
        }
        Ok(n)
    }

    /// Calls `f(id, payload)` for every entry of a table's database, in key order (shard by
    /// shard; the environments hold consecutive key ranges). A row whose checksum or key does
    /// not match its id stops the scan with an error naming it.
    pub fn scan(
        &self,
        db: Db,
        table: &str,
        mut f: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        for (k, txn) in self.txns.iter().enumerate() {
            let Some(d) = self.storage.handle(k, db, table) else {
                continue;
            };
            let part = &self.storage.parts[k];
            for item in d.iter(txn).map_err(|e| self.fail(k, e))? {
                let (key, v) = item.map_err(|e| self.fail(k, e))?;
                let (id, payload) = decode(db, table, &part.dir, part.sums, key, v)?;
                if db == Db::Rows && key != self::key(id) {
                    return Err(corrupt(format!(
                        "{}: table {table:?}: the key of id {} holds id {id}",
                        part.file().display(),
                        crate::hash::unmix64(u64::from_be_bytes(key.try_into().unwrap_or([0; 8])))
                    )));
                }
                f(id, payload)?;
            }
        }
        Ok(())
    }
}

/// A table's database in every environment, looked up once by [`Reader::open`] or
/// [`Writer::open`] for many reads or writes.
#[derive(Clone)]
pub struct DbHandle {
    pub(super) db: Db,
    /// Per environment (`None` where this handle does not reach it).
    pub(super) d: Vec<Option<Database<Bytes, Bytes>>>,
}
