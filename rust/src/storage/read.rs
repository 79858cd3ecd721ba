//! Reading the replica: a view of the last committed state, one read transaction per
//! environment.

use heed::types::Bytes;
use heed::{Database, RoTxn, WithoutTls};

use super::format::{bytes_of, check_row, decode, key, part_of_key, words_into, Db, ROW_SUM_BYTES};
use super::groupsum::{group_rows, group_sound, Expected, GROUP_ROWS};
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
        let Some((db, p, k, v)) = self.value_in(h, id)? else {
            return Ok(None);
        };
        let part = &self.storage.parts[p];
        let (stored, payload) = decode(db, table, &part.dir, part.sums, &k, v)?;
        self.same_id(p, table, id, stored)?;
        Ok(Some(payload))
    }

    /// The payload words of row `id` in a table's rows database opened by [`Reader::open`]
    /// (`None` if it holds no row of `id`), in `out`: [`Reader::get_in`] of [`Db::Rows`] with
    /// the payload as words, and the same checks and errors.
    ///
    /// The value is read from the map once: copied whole into `out`, its checksum is then
    /// verified on that copy (in cache), and the copy's payload is what is returned.
    pub fn row_words_in<'o>(
        &self,
        h: Option<&DbHandle>,
        table: &str,
        id: u64,
        out: &'o mut Vec<u32>,
    ) -> Result<Option<&'o [u32]>> {
        let Some(stored) = self.value_in(h, id)? else {
            return Ok(None);
        };
        self.words_of(stored, table, id, out, false).map(Some)
    }

    /// [`Reader::row_words_in`] of each of `ids` in turn: `found(k, words)` for each `ids[k]`
    /// with a row, in order. Rows with checksums are checked a group at a time where the CPU
    /// can (`groupsum`: a group of sound rows is copied without a check each), and a group
    /// that fails row by row, which names the damaged row.
    pub fn rows_words_in(
        &self,
        h: Option<&DbHandle>,
        table: &str,
        ids: &[u64],
        out: &mut Vec<u32>,
        found: &mut dyn FnMut(usize, &[u32]) -> Result<()>,
    ) -> Result<()> {
        let mut group: Vec<(usize, Stored<'_>)> = Vec::with_capacity(GROUP_ROWS);
        let mut expected = Expected::default();
        let mut room = 0;
        for (k, &id) in ids.iter().enumerate() {
            let Some(stored) = self.value_in(h, id)? else {
                continue;
            };
            let (db, p, _, v) = stored;
            let groupable = db == Db::Rows && self.storage.parts[p].sums && v.len() % 4 == 0;
            if !groupable || group.first().is_some_and(|g| g.1 .3.len() != v.len()) {
                self.words_group(table, ids, &mut group, &mut expected, out, found)?;
            }
            if groupable && group.is_empty() {
                room = group_rows(v.len());
            }
            if groupable && room >= 2 {
                group.push((k, stored));
                if group.len() == room {
                    self.words_group(table, ids, &mut group, &mut expected, out, found)?;
                }
                continue;
            }
            found(k, self.words_of(stored, table, id, out, false)?)?;
        }
        self.words_group(table, ids, &mut group, &mut expected, out, found)
    }

    /// Hands the rows of `group` (values of one length, with checksums) to `found` and empties
    /// it: unchecked one by one where [`group_sound`] finds them all sound, else each checked.
    fn words_group(
        &self,
        table: &str,
        ids: &[u64],
        group: &mut Vec<(usize, Stored<'_>)>,
        expected: &mut Expected,
        out: &mut Vec<u32>,
        found: &mut dyn FnMut(usize, &[u32]) -> Result<()>,
    ) -> Result<()> {
        if group.is_empty() {
            return Ok(());
        }
        let mut values = [&[][..]; GROUP_ROWS];
        for (slot, g) in values.iter_mut().zip(group.iter()) {
            *slot = g.1 .3;
        }
        let sound = group_sound(&values[..group.len()], expected) == Some(true);
        for &(k, stored) in group.iter() {
            found(k, self.words_of(stored, table, ids[k], out, sound)?)?;
        }
        group.clear();
        Ok(())
    }

    /// The payload words of a value read for `id`, copied into `out` (see
    /// [`Reader::row_words_in`]); its checksum verified unless `sound` (its group was).
    fn words_of<'o>(
        &self,
        (db, p, k, v): Stored<'_>,
        table: &str,
        id: u64,
        out: &'o mut Vec<u32>,
        sound: bool,
    ) -> Result<&'o [u32]> {
        let part = &self.storage.parts[p];
        out.clear();
        if db != Db::Rows || !part.sums || v.len() % 4 != 0 {
            // Rows without checksums, or a value no row of format 3 has: as `get_in`.
            let (stored, payload) = decode(db, table, &part.dir, part.sums, &k, v)?;
            self.same_id(p, table, id, stored)?;
            words_into(payload, out);
            return Ok(&out[..]);
        }
        let n = v.len() / 4;
        out.reserve(n);
        // SAFETY: `out` has room for `n` words (reserved above), which are `v.len()` bytes; the
        // map and the vector do not overlap; every byte of the `n` words is written before the
        // length is set, and any bytes are a valid u32.
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr(), out.as_mut_ptr().cast::<u8>(), v.len());
            out.set_len(n);
        }
        let stored = if sound {
            out[0] as u64 | (out[1] as u64) << 32
        } else {
            check_row(&part.dir, table, &k, bytes_of(out))?.0
        };
        self.same_id(p, table, id, stored)?;
        // The id's two words before the payload, the checksum's word after it.
        Ok(&out[2..n - 1])
    }

    /// The database of `h` in the environment of `id`'s key, that key, and its value there.
    fn value_in(&self, h: Option<&DbHandle>, id: u64) -> Result<Option<Stored<'_>>> {
        let Some(h) = h else {
            return Ok(None);
        };
        let k = key(id);
        let p = part_of_key(k, self.txns.len());
        let Some(d) = h.d[p] else {
            return Ok(None);
        };
        let v = d.get(&self.txns[p], &k).map_err(|e| self.fail(p, e))?;
        Ok(v.map(|v| (h.db, p, k, v)))
    }

    /// Fails unless the value under `id`'s key in environment `p` holds `id` itself.
    fn same_id(&self, p: usize, table: &str, id: u64, stored: u64) -> Result<()> {
        if stored == id {
            return Ok(());
        }
        Err(corrupt(format!(
            "{}: table {table:?}: the key of id {id} holds id {stored}",
            self.storage.parts[p].dir.display()
        )))
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
            // Rows with checksums are checked a group at a time where the CPU can
            // (`groupsum`); a group that fails is checked row by row, which names the row.
            let grouped = db == Db::Rows && part.sums;
            let mut group: Vec<(&[u8], &[u8])> = Vec::with_capacity(GROUP_ROWS);
            let mut expected = Expected::default();
            let mut room = 0;
            for item in d.iter(txn).map_err(|e| self.fail(k, e))? {
                let (key, v) = item.map_err(|e| self.fail(k, e))?;
                if grouped {
                    if group.first().is_some_and(|g| g.1.len() != v.len()) {
                        self.emit_group(db, table, k, &mut group, &mut expected, &mut f)?;
                    }
                    if group.is_empty() {
                        room = group_rows(v.len());
                    }
                    if room >= 2 {
                        group.push((key, v));
                        if group.len() == room {
                            self.emit_group(db, table, k, &mut group, &mut expected, &mut f)?;
                        }
                        continue;
                    }
                }
                self.emit(db, table, k, key, v, None, &mut f)?;
            }
            self.emit_group(db, table, k, &mut group, &mut expected, &mut f)?;
        }
        Ok(())
    }

    /// Hands the values of `group` (of one length) to `f` and empties it: without their checks
    /// where [`group_sound`] finds them all sound, else one by one with theirs.
    fn emit_group(
        &self,
        db: Db,
        table: &str,
        k: usize,
        group: &mut Vec<(&[u8], &[u8])>,
        expected: &mut Expected,
        f: &mut impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        if group.is_empty() {
            return Ok(());
        }
        let mut values = [&[][..]; GROUP_ROWS];
        for (slot, (_, v)) in values.iter_mut().zip(group.iter()) {
            *slot = v;
        }
        let sound = group_sound(&values[..group.len()], expected) == Some(true);
        for &(key, v) in group.iter() {
            let checked = sound.then(|| {
                let id = u64::from_le_bytes(v[..8].try_into().expect("8 bytes"));
                (id, &v[8..v.len() - ROW_SUM_BYTES])
            });
            self.emit(db, table, k, key, v, checked, f)?;
        }
        group.clear();
        Ok(())
    }

    /// Hands one value to `f`: its id and payload from `checked` (already verified) or decoded
    /// here (a row's checksum verified), after checking that a row's key is its id's.
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &self,
        db: Db,
        table: &str,
        k: usize,
        key: &[u8],
        v: &[u8],
        checked: Option<(u64, &[u8])>,
        f: &mut impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let part = &self.storage.parts[k];
        let (id, payload) = match checked {
            Some(c) => c,
            None => decode(db, table, &part.dir, part.sums, key, v)?,
        };
        if db == Db::Rows && key != self::key(id) {
            return Err(corrupt(format!(
                "{}: table {table:?}: the key of id {} holds id {id}",
                part.file().display(),
                crate::hash::unmix64(u64::from_be_bytes(key.try_into().unwrap_or([0; 8])))
            )));
        }
        f(id, payload)
    }
}

/// A value found by its id: its database, the environment holding it, the id's key, the bytes.
type Stored<'r> = (Db, usize, [u8; 8], &'r [u8]);

/// A table's database in every environment, looked up once by [`Reader::open`] or
/// [`Writer::open`] for many reads or writes.
#[derive(Clone)]
pub struct DbHandle {
    pub(super) db: Db,
    /// Per environment (`None` where this handle does not reach it).
    pub(super) d: Vec<Option<Database<Bytes, Bytes>>>,
}
