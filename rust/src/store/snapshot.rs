//! Snapshots of a store and restores into a new one: the store's side of [`crate::snapshot`]
//! (which tables, under which locks, in which order).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::{DurableConfig, Store, StoreConfig};
use crate::durable::{Durability, TableRecord};
use crate::error::{corrupt, invalid, storage, Error, Result};
use crate::hash::shard_of;
use crate::snapshot::files::{self, FileInfo, PartSchema, PartWriter, RowBatch};
use crate::snapshot::location::{self, Location, StagingDir};
use crate::snapshot::{
    dense_entry, dir_of, fsync_dir, load_chain, new_id, open_parts, parts_for, relative_to,
    unix_time, Manifest, Parent, Part, SnapshotInfo, TableEntry, BATCH_ROWS, FORMAT_NAME,
    FORMAT_VERSION, MANIFEST, SETTLED_BYTES, SNAPSHOT_KEY,
};
use crate::storage::{cycle_of, words_into, Db};
use crate::table::{Table, TableHandle};

impl Store {
    /// Writes a snapshot of every table into the new directory `dir` (its missing parents are
    /// created): all rows, or with
    /// `incremental` only the rows changed since this store's previous snapshot plus tombstones
    /// for ids removed or evicted since then. Training may go on meanwhile.
    pub fn snapshot(&self, dir: &Path, incremental: bool) -> Result<SnapshotInfo> {
        self.snapshot_counted(dir, incremental, &AtomicU64::new(0))
    }

    /// [`Store::snapshot`], adding the rows written to `done` as it goes (for progress bars).
    pub fn snapshot_counted(
        &self,
        dir: &Path,
        incremental: bool,
        done: &AtomicU64,
    ) -> Result<SnapshotInfo> {
        if dir.exists() {
            return Err(invalid(format!(
                "{} exists; a snapshot is written into a new directory",
                dir.display()
            )));
        }
        let parent_dir = dir.parent().filter(|p| !p.as_os_str().is_empty());
        let parent_dir = parent_dir.unwrap_or(Path::new("."));
        if !parent_dir.exists() {
            // `snaps/0001` with no `snaps/` yet: the parents are created.
            std::fs::create_dir_all(parent_dir)
                .map_err(|e| storage(format!("creating {}: {e}", parent_dir.display())))?;
        }
        if !parent_dir.is_dir() {
            return Err(invalid(format!(
                "cannot write a snapshot into {}: {} is not a directory",
                dir.display(),
                parent_dir.display()
            )));
        }
        // Pushes queued before the call are in the snapshot.
        while !self.flush_timeout(std::time::Duration::from_secs(3600)) {}
        let parent = if incremental {
            let p = self.previous()?;
            if location::is_uri(&p.path) {
                return Err(invalid(format!(
                    "{} cannot build on {}: an increment is written into the store (or bucket) \
                     of the snapshot it builds on; take a full snapshot there first",
                    dir.display(),
                    p.path
                )));
            }
            Some(Parent {
                path: relative_to(dir, Path::new(&p.path)),
                ..p
            })
        } else {
            None
        };
        let name = dir
            .file_name()
            .ok_or_else(|| invalid(format!("{} has no file name", dir.display())))?
            .to_string_lossy()
            .into_owned();
        let id = new_id();
        let tmp = parent_dir.join(format!(".{name}.tmp-{id}"));
        std::fs::create_dir(&tmp)
            .map_err(|e| storage(format!("creating {}: {e}", tmp.display())))?;
        let r = self.write_snapshot(&tmp, id, parent, done);
        match r {
            Ok((manifest, bytes)) => {
                std::fs::rename(&tmp, dir).map_err(|e| {
                    let _ = std::fs::remove_dir_all(&tmp);
                    storage(format!(
                        "renaming {} to {}: {e}",
                        tmp.display(),
                        dir.display()
                    ))
                })?;
                fsync_dir(parent_dir)?;
                let abs = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
                self.snapshot_taken(abs.to_string_lossy().into_owned(), &manifest)?;
                Ok(SnapshotInfo { manifest, bytes })
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                self.snapshot_failed();
                Err(e)
            }
        }
    }

    /// Writes a snapshot into `dest`: a local directory (as [`Store::snapshot`]) or an
    /// object-store prefix (`s3://bucket/prefix`, see [`crate::snapshot::location`]). A remote
    /// snapshot is written into a local staging directory, then uploaded file by file with the
    /// manifest last; a prefix that holds objects already is refused, and an increment must go
    /// into the bucket of the snapshot it builds on.
    pub fn snapshot_to(
        &self,
        dest: &str,
        incremental: bool,
        done: &AtomicU64,
    ) -> Result<SnapshotInfo> {
        let remote = match Location::open(dest)? {
            Location::Local(dir) => return self.snapshot_counted(&dir, incremental, done),
            Location::Remote(r) => r,
        };
        let here = Location::Remote(remote.clone());
        if here.exists()? {
            return Err(invalid(format!(
                "{dest} exists (objects lie under it); a snapshot is written into a new prefix"
            )));
        }
        // Pushes queued before the call are in the snapshot.
        while !self.flush_timeout(std::time::Duration::from_secs(3600)) {}
        let parent = if incremental {
            let p = self.previous()?;
            let at = if location::is_uri(&p.path) {
                Location::open(&p.path)?
            } else {
                Location::Local(PathBuf::from(&p.path))
            };
            Some(Parent {
                path: here.relative(&at)?,
                ..p
            })
        } else {
            None
        };
        let staging = StagingDir::new()?;
        let tmp = staging.path().join("snapshot");
        std::fs::create_dir(&tmp)
            .map_err(|e| storage(format!("creating {}: {e}", tmp.display())))?;
        let r = self
            .write_snapshot(&tmp, new_id(), parent, done)
            .and_then(|(manifest, bytes)| remote.upload_dir(&tmp).map(|_| (manifest, bytes)));
        drop(staging);
        match r {
            Ok((manifest, bytes)) => {
                self.snapshot_taken(remote.uri(), &manifest)?;
                Ok(SnapshotInfo { manifest, bytes })
            }
            Err(e) => {
                self.snapshot_failed();
                Err(e)
            }
        }
    }

    /// After a failed snapshot of an in-memory store, whose shards' change records were
    /// consumed: only a full snapshot is safe now.
    fn snapshot_failed(&self) {
        if self.path().is_none() {
            *self.last_snapshot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// The snapshot an increment builds on: this store's last one.
    fn previous(&self) -> Result<Parent> {
        self.last_parent()?.ok_or_else(|| {
            invalid(
                "no previous snapshot of this store to build an increment on; take a full one \
                 first",
            )
        })
    }

    /// The last snapshot of this store, if any.
    fn last_parent(&self) -> Result<Option<Parent>> {
        match self.flusher() {
            Some(f) => f
                .storage()
                .read(|r| r.meta(SNAPSHOT_KEY))?
                .map(|v| {
                    serde_json::from_slice(&v)
                        .map_err(|e| corrupt(format!("the store's snapshot record: {e}")))
                })
                .transpose(),
            None if self.path().is_some() => Err(storage("the store is closed")),
            None => Ok(self
                .last_snapshot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()),
        }
    }

    /// Writes the files and the manifest into `tmp`; returns the manifest and the bytes.
    fn write_snapshot(
        &self,
        tmp: &Path,
        id: String,
        parent: Option<Parent>,
        done: &AtomicU64,
    ) -> Result<(Manifest, u64)> {
        let tables: Vec<(String, Table)> = self
            .tables()
            .into_iter()
            .filter_map(|n| self.table(&n).ok().map(|t| (n, t)))
            .collect();
        let incremental = parent.is_some();
        let (entries, cycle) = match self.flusher() {
            Some(f) => self.write_from_replica(&f, tmp, &tables, parent.as_ref(), done)?,
            None if self.path().is_some() => return Err(storage("the store is closed")),
            None => (self.write_from_memory(tmp, &tables, incremental, done)?, 0),
        };
        let mut manifest = Manifest {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            id: id.clone(),
            kind: if incremental { "incremental" } else { "full" }.into(),
            parent,
            created_at: unix_time(),
            source_path: self.path().map(|p| p.to_string_lossy().into_owned()),
            cycle,
            tables: entries,
            checksum: None,
        };
        let bytes = manifest.sealed()?;
        let mpath = tmp.join(MANIFEST);
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&mpath)
                .map_err(|e| storage(format!("writing {}: {e}", mpath.display())))?;
            f.write_all(&bytes)
                .and_then(|_| f.sync_all())
                .map_err(|e| storage(format!("writing {}: {e}", mpath.display())))?;
        }
        for e in &manifest.tables {
            fsync_dir(&tmp.join(&e.dir))?;
        }
        fsync_dir(tmp)?;
        let total: u64 = manifest
            .tables
            .iter()
            .flat_map(|e| e.files.iter().chain(e.tombstones.iter()))
            .map(|f| f.bytes)
            .sum::<u64>()
            + bytes.len() as u64;
        Ok((manifest, total))
    }

    /// Records the snapshot as the parent of the next increment (and, in a durable store, drops
    /// the change records it covers).
    /// `at` is where the snapshot lies: an absolute directory or a URI.
    fn snapshot_taken(&self, at: String, m: &Manifest) -> Result<()> {
        let p = Parent {
            id: m.id.clone(),
            path: at,
            cycle: m.cycle,
        };
        match self.flusher() {
            Some(f) => {
                let rec = serde_json::to_vec(&p).map_err(|e| Error::Internal(e.to_string()))?;
                let names: Vec<String> = m.tables.iter().map(|t| t.name.clone()).collect();
                f.exclusive(|| {
                    // The record first: with several environments the prune commits apart, and
                    // a crash between the two then leaves entries the new parent covers (the
                    // next increment carries those rows again), never a parent older than what
                    // was pruned.
                    let st = f.storage();
                    if st.environments() > 1 {
                        st.write(|w| w.put_meta(SNAPSHOT_KEY, &rec))?;
                    }
                    st.write(|w| {
                        // When no cycle has committed since the snapshot's view, every entry is
                        // one the snapshot covers: the databases are emptied whole (LMDB frees
                        // their pages without visiting each entry) instead of entry by entry.
                        let last = w.meta(crate::durable::CYCLE_KEY)?;
                        let covered = last.map_or(0, |v| cycle_of(&v)) == m.cycle;
                        for n in &names {
                            for db in [Db::Changed, Db::Removed] {
                                if covered {
                                    w.clear(db, n)?;
                                } else {
                                    w.prune(db, n, m.cycle)?;
                                }
                            }
                        }
                        w.put_meta(SNAPSHOT_KEY, &rec)
                    })
                })
            }
            None => {
                *self.last_snapshot.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                Ok(())
            }
        }
    }

    /// An in-memory store's tables, shard by shard under each shard's lock; from the first
    /// snapshot on, shards record their changes for the next increment.
    fn write_from_memory(
        &self,
        tmp: &Path,
        tables: &[(String, Table)],
        incremental: bool,
        done: &AtomicU64,
    ) -> Result<Vec<TableEntry>> {
        let mut entries = Vec::new();
        for (i, (name, table)) in tables.iter().enumerate() {
            let dir = format!("table-{i:04}");
            std::fs::create_dir(tmp.join(&dir))
                .map_err(|e| storage(format!("creating {}: {e}", tmp.join(&dir).display())))?;
            let record = TableRecord::of(table);
            let entry = match table {
                Table::Sparse(t) => {
                    let schema = PartSchema {
                        dim: t.dim(),
                        state_len: t.state_len(),
                    };
                    let expect = if incremental {
                        t.changed_rows()
                    } else {
                        t.len() as u64
                    };
                    let parts = parts_for(t, expect);
                    let rows = std::sync::atomic::AtomicU64::new(0);
                    let gone = Mutex::new(Vec::new());
                    let files: Vec<FileInfo> = self.pool_install(|| {
                        (0..parts)
                            .into_par_iter()
                            .map(|k| {
                                let fname = format!("{dir}/part-{k:05}.arrow");
                                let mut writer =
                                    PartWriter::create(&tmp.join(&fname), &fname, schema)?;
                                // A shard's rows, copied into columns under its lock and
                                // written from there.
                                let mut batch = RowBatch::default();
                                for s in (k..t.num_shards()).step_by(parts) {
                                    batch.clear();
                                    let g = t.copy_shard(s, incremental, |id, words| {
                                        batch.push_words(id, words, schema)
                                    });
                                    writer.write_chunked(&batch, BATCH_ROWS)?;
                                    let n = batch.len() as u64;
                                    rows.fetch_add(n, Ordering::Relaxed);
                                    done.fetch_add(n, Ordering::Relaxed);
                                    gone.lock().unwrap_or_else(|e| e.into_inner()).extend(g);
                                }
                                writer.finish()
                            })
                            .collect::<Result<Vec<_>>>()
                    })?;
                    let mut gone = gone.into_inner().unwrap_or_else(|e| e.into_inner());
                    gone.sort_unstable();
                    let tombstones = if incremental {
                        let fname = format!("{dir}/tombstones.arrow");
                        Some(files::write_ids(&tmp.join(&fname), &fname, &gone)?)
                    } else {
                        None
                    };
                    TableEntry {
                        name: name.clone(),
                        dir,
                        record,
                        dim: t.dim(),
                        state_len: t.state_len(),
                        rows: rows.into_inner(),
                        total_rows: t.len() as u64,
                        files,
                        tombstones,
                    }
                }
                Table::Dense(d) => dense_entry(tmp, name, dir, record, d.words())?,
            };
            entries.push(entry);
        }
        Ok(entries)
    }

    /// A durable store's tables from one read transaction of its replica, after a flush.
    fn write_from_replica(
        &self,
        f: &Arc<crate::durable::Flusher>,
        tmp: &Path,
        tables: &[(String, Table)],
        parent: Option<&Parent>,
        done: &AtomicU64,
    ) -> Result<(Vec<TableEntry>, u64)> {
        f.flush()?;
        let guard = f.hold_cycles();
        f.next_log_gen();
        let st = Arc::clone(f.storage());
        st.read(|r| {
            // The last cycle this view holds: every change entry up to it is in the view.
            let cycle = r
                .meta(crate::durable::CYCLE_KEY)?
                .map_or(0, |v| cycle_of(&v));
            // An increment's changed rows, and those of them memory holds as the view does:
            // with cycles still held off, a row that is not marked is what the last cycle
            // wrote, so it is copied from memory instead of read back from the replica.
            let mut settled = Vec::with_capacity(tables.len());
            let mut budget = SETTLED_BYTES;
            for (name, table) in tables {
                settled.push(match (parent, table) {
                    (Some(p), Table::Sparse(t)) => {
                        let mut changed = Vec::new();
                        r.scan(Db::Changed, name, |id, v| {
                            if cycle_of(v) > p.cycle {
                                changed.push(id);
                            }
                            Ok(())
                        })?;
                        let bytes = changed.len() * t.row_words() * 4;
                        let copied = (bytes <= budget).then(|| t.copy_settled(&changed));
                        budget -= if copied.is_some() { bytes } else { 0 };
                        Some((changed, copied))
                    }
                    _ => None,
                });
            }
            // The read transaction is open: later cycles may commit, this view stays.
            drop(guard);
            let mut entries = Vec::new();
            for (i, ((name, table), settled)) in tables.iter().zip(settled).enumerate() {
                let dir = format!("table-{i:04}");
                std::fs::create_dir(tmp.join(&dir))
                    .map_err(|e| storage(format!("creating {}: {e}", tmp.join(&dir).display())))?;
                let record = match r.meta(&crate::durable::table_key(name))? {
                    Some(v) => serde_json::from_slice(&v).map_err(|e| {
                        corrupt(format!("the record of table {name:?} in the replica: {e}"))
                    })?,
                    None => continue, // dropped meanwhile
                };
                let entry = match table {
                    Table::Sparse(t) => {
                        let schema = PartSchema {
                            dim: t.dim(),
                            state_len: t.state_len(),
                        };
                        let m = t.row_words();
                        let expect = match &settled {
                            None => r.len(Db::Rows, name)?,
                            Some((changed, _)) => changed.len() as u64,
                        };
                        let n = parts_for(t, expect);
                        let mut parts = open_parts(tmp, &dir, n, schema, done)?;
                        let mut rows = 0u64;
                        let mut words = Vec::with_capacity(m);
                        let mut add = |id: u64, row: &[u32]| -> Result<()> {
                            rows += 1;
                            parts[shard_of(id, t.num_shards()) % n].add(id, row)
                        };
                        let mut gone = Vec::new();
                        match (parent, settled) {
                            (None, _) | (_, None) => r.scan(Db::Rows, name, |id, v| {
                                crate::durable::replica_row(st.path(), name, m, id, v, &mut words)?;
                                add(id, &words)
                            })?,
                            (Some(p), Some((changed, copied))) => {
                                // Rows memory did not hold settled are read back from the
                                // view, one B+tree descent each.
                                let rows_db = r.open(Db::Rows, name);
                                let read = |id| r.get_in(rows_db.as_ref(), name, id);
                                for (k, &id) in changed.iter().enumerate() {
                                    if let Some(row) = copied.as_ref().and_then(|c| c.row(k)) {
                                        add(id, row)?;
                                    } else if let Some(v) = read(id)? {
                                        crate::durable::replica_row(
                                            st.path(),
                                            name,
                                            m,
                                            id,
                                            v,
                                            &mut words,
                                        )?;
                                        add(id, &words)?;
                                    }
                                }
                                r.scan(Db::Removed, name, |id, v| {
                                    if cycle_of(v) > p.cycle {
                                        gone.push(id);
                                    }
                                    Ok(())
                                })?;
                                let mut live = Vec::with_capacity(gone.len());
                                for id in gone.drain(..) {
                                    if read(id)?.is_none() {
                                        live.push(id);
                                    }
                                }
                                gone = live;
                            }
                        }
                        let files = parts
                            .into_iter()
                            .map(Part::finish)
                            .collect::<Result<Vec<_>>>()?;
                        let tombstones = match parent {
                            Some(_) => {
                                let fname = format!("{dir}/tombstones.arrow");
                                Some(files::write_ids(&tmp.join(&fname), &fname, &gone)?)
                            }
                            None => None,
                        };
                        TableEntry {
                            name: name.clone(),
                            dir,
                            record,
                            dim: t.dim(),
                            state_len: t.state_len(),
                            rows,
                            total_rows: r.len(Db::Rows, name)?,
                            files,
                            tombstones,
                        }
                    }
                    Table::Dense(_) => {
                        let v = r.meta(&crate::durable::dense_key(name))?.ok_or_else(|| {
                            corrupt(format!("dense table {name:?} has no value in the replica"))
                        })?;
                        let mut w = Vec::new();
                        words_into(&v, &mut w);
                        dense_entry(tmp, name, dir, record, w)?
                    }
                };
                entries.push(entry);
            }
            Ok((entries, cycle))
        })
    }

    /// Rebuilds a store from the snapshot in `dir` and its chain of increments, into any shard
    /// count; a durable store when `durable` names a directory that holds no store yet. A
    /// damaged file fails the restore with an error naming it, and no store is left behind.
    pub fn restore(
        dir: &Path,
        config: StoreConfig,
        durable: Option<DurableConfig>,
    ) -> Result<Store> {
        Self::restore_counted(dir, config, durable, &AtomicU64::new(0))
    }

    /// [`Store::restore_counted`] from a location string: a directory, `file://DIR` or an
    /// object-store URI (`s3://bucket/prefix`), which is downloaded with its chain into a
    /// staging directory first (removed afterwards); errors name the URI.
    pub fn restore_from(
        src: &str,
        config: StoreConfig,
        durable: Option<DurableConfig>,
        done: &AtomicU64,
    ) -> Result<Store> {
        let staged = location::stage(src)?;
        Self::restore_counted(staged.dir(), config, durable, done).map_err(|e| staged.explain(e))
    }

    /// [`Store::restore`], adding the rows loaded to `done` as it goes (for progress bars).
    pub fn restore_counted(
        dir: &Path,
        config: StoreConfig,
        durable: Option<DurableConfig>,
        done: &AtomicU64,
    ) -> Result<Store> {
        let chain = Manifest::chain(dir)?;
        // What to clean up if the restore fails: the directory if it creates it, else the
        // files it puts into an empty one.
        let cleanup = match &durable {
            Some(d) if d.path.join("data.mdb").exists() => {
                return Err(invalid(format!(
                    "{} holds a store already; restore into a new directory",
                    d.path.display()
                )))
            }
            Some(d) if !d.path.exists() => Some((d.path.clone(), true)),
            Some(d) => {
                let empty = std::fs::read_dir(&d.path)
                    .map(|mut it| it.next().is_none())
                    .unwrap_or(false);
                if !empty {
                    return Err(invalid(format!(
                        "{} is not empty; restore into a new or empty directory",
                        d.path.display()
                    )));
                }
                Some((d.path.clone(), false))
            }
            None => None,
        };
        let r = Self::restore_into(&chain, config, durable, done);
        if r.is_err() {
            if let Some((path, created)) = cleanup {
                if created {
                    let _ = std::fs::remove_dir_all(&path);
                } else if let Ok(entries) = std::fs::read_dir(&path) {
                    for e in entries.flatten() {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        r
    }

    fn restore_into(
        chain: &[(PathBuf, Manifest)],
        config: StoreConfig,
        durable: Option<DurableConfig>,
        done: &AtomicU64,
    ) -> Result<Store> {
        let (_, last) = chain.last().expect("a chain has a snapshot");
        let store = match durable {
            // Writing happens once at the end: no flush cycles while loading.
            Some(mut d) => {
                let mode = d.durability;
                d.durability = Durability::None;
                (Store::open(config.clone(), d.clone())?, Some((d, mode)))
            }
            None => (Store::new(config.clone())?, None),
        };
        let (store, reopen) = store;
        if !store.tables().is_empty() {
            return Err(invalid("restore needs an empty store"));
        }
        for entry in &last.tables {
            match &entry.record {
                TableRecord::Sparse { config, .. } => {
                    let t = store.create_sparse_table(&entry.name, config.clone())?;
                    t.common().set_uid(entry.record.uid());
                }
                TableRecord::Dense { config, .. } => {
                    let t = store.create_dense_table(&entry.name, config.clone())?;
                    t.common().set_uid(entry.record.uid());
                }
            }
        }
        for entry in &last.tables {
            if let Ok(Table::Sparse(t)) = store.table(&entry.name) {
                t.reserve(entry.total_rows as usize);
            }
        }
        for entry in &last.tables {
            let table = store.table(&entry.name)?;
            load_chain(chain, entry, &table, |_| true, true, done)?;
        }
        for entry in &last.tables {
            let table = store.table(&entry.name)?;
            match (&entry.record, &table) {
                (
                    TableRecord::Sparse {
                        lr, seq, counters, ..
                    },
                    Table::Sparse(t),
                ) => {
                    t.set_seq(*seq);
                    t.set_lr(*lr)?;
                    crate::durable::restore_counters(t.as_ref(), counters);
                    if t.len() as u64 != entry.total_rows {
                        return Err(corrupt(format!(
                            "{}: table {:?} should have {} rows after the chain, has {}",
                            dir_of(chain),
                            entry.name,
                            entry.total_rows,
                            t.len()
                        )));
                    }
                }
                (TableRecord::Dense { lr, counters, .. }, Table::Dense(t)) => {
                    t.set_lr(*lr)?;
                    crate::durable::restore_counters(t.as_ref(), counters);
                }
                _ => return Err(corrupt(format!("table {:?} changed kind", entry.name))),
            }
        }
        if let Some(f) = store.flusher() {
            f.flush()?;
        }
        match reopen {
            None => Ok(store),
            Some((mut d, mode)) => {
                store.close()?;
                drop(store);
                d.durability = mode;
                Store::open(config, d)
            }
        }
    }
}
