//! `LoadSnapshot`: a server-side restore. The server reads every part of a cluster snapshot
//! from a location it reaches and writes the rows a new server list routes to it, as they are
//! (weights, optimizer state, step, version, frequency), with the embedded restore's chain code
//! ([`crate::snapshot`]) and the client's slot table ([`crate::net::routing`]).
//!
//! Everything is read and checked before the first row is written: the location, every part's
//! chain (its last manifest must be the one the client checked, by id and checksum) and every
//! table's dim and optimizer. A server that cannot read the location fails naming the path.

use std::path::{Component, Path, PathBuf};
use std::sync::atomic::AtomicU64;

use crate::durable::TableRecord;
use crate::error::{invalid, Result};
use crate::net::proto::{LoadSnapshotRequest, LoadSnapshotResponse};
use crate::net::routing::{Rendezvous, Routing, SlotTable};
use crate::snapshot::location::{self, Uri};
use crate::snapshot::{load_chain, Manifest, TableEntry, MANIFEST};
use crate::store::{Store, Table};

/// The local directory of a snapshot location: an absolute path, or `file://` and one. The one
/// place where a server turns a location string into a directory.
pub fn snapshot_location(location: &str) -> Result<PathBuf> {
    let path = match location.strip_prefix("file://") {
        Some(p) => p,
        None => {
            if let Some((scheme, _)) = location.split_once("://") {
                return Err(invalid(format!(
                    "snapshot location {location:?}: scheme {scheme}:// is not supported by this \
                     server; give a directory (or file://DIR) it can read"
                )));
            }
            location
        }
    };
    let dir = PathBuf::from(path);
    if !dir.is_absolute() {
        return Err(invalid(format!(
            "snapshot location {location:?} is not an absolute path: a server reads it from its \
             own working directory"
        )));
    }
    Ok(dir)
}

/// What a server cannot read at `path`, with the fallback.
fn unreadable(path: &Path, why: impl std::fmt::Display) -> crate::Error {
    invalid(format!(
        "cannot read the cluster snapshot at {} on this server: {why}; nothing was loaded \
         (when the servers do not reach the snapshot's directory, restore with via=\"client\", \
         which sends the rows through the client)",
        path.display()
    ))
}

/// A part's directory inside the snapshot: one plain relative name or path, never `..`.
fn part_dir(root: &Path, dir: &str) -> Result<PathBuf> {
    let rel = Path::new(dir);
    if dir.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(invalid(format!(
            "load snapshot: part directory {dir:?} is not a relative path inside the snapshot"
        )));
    }
    Ok(root.join(rel))
}

/// Does the work of `LoadSnapshot` on `store`: an object-store location (`s3://`) is
/// downloaded into a staging directory of this server's first (removed afterwards), a local one
/// is read where it is.
pub(super) fn load_snapshot(store: &Store, r: LoadSnapshotRequest) -> Result<LoadSnapshotResponse> {
    if let Uri::S3 { .. } = location::parse(&r.location)? {
        let staged = location::stage(&r.location)?;
        let root = staged.dir().to_path_buf();
        return load_from(store, root, r).map_err(|e| staged.explain(e));
    }
    let root = snapshot_location(&r.location)?;
    load_from(store, root, r)
}

fn load_from(store: &Store, root: PathBuf, r: LoadSnapshotRequest) -> Result<LoadSnapshotResponse> {
    let me = r.index as usize;
    if me >= r.servers.len() {
        return Err(invalid(format!(
            "load snapshot: index {me} is outside the server list of {}",
            r.servers.len()
        )));
    }
    if r.parts.len() != r.snapshot_servers.len() || r.parts.is_empty() {
        return Err(invalid(format!(
            "load snapshot: {} parts for {} snapshot servers",
            r.parts.len(),
            r.snapshot_servers.len()
        )));
    }
    let router = match &r.slots {
        Some(p) => SlotTable::from_proto(p).map_err(|e| invalid(format!("load snapshot: {e}")))?,
        None => SlotTable::uniform(r.servers.len())?,
    };
    if router.servers() != r.servers.len() {
        return Err(invalid(format!(
            "load snapshot: the slot table addresses {} servers, the list has {}",
            router.servers(),
            r.servers.len()
        )));
    }
    let old = match &r.snapshot_slots {
        Some(p) => Routing::Slots(
            SlotTable::from_proto(p)
                .map_err(|e| invalid(format!("load snapshot: the snapshot's {e}")))?,
        ),
        None => Routing::Rendezvous(Rendezvous::new(&r.snapshot_servers)),
    };
    if let Routing::Slots(t) = &old {
        if t.servers() != r.snapshot_servers.len() {
            return Err(invalid(format!(
                "load snapshot: the snapshot's slot table addresses {} servers, its list has {}",
                t.servers(),
                r.snapshot_servers.len()
            )));
        }
    }
    match std::fs::metadata(&root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(unreadable(&root, "not a directory")),
        Err(e) => return Err(unreadable(&root, e)),
    }
    // Every part's chain, read and matched against what the client checked.
    let mut chains = Vec::with_capacity(r.parts.len());
    for p in &r.parts {
        let dir = part_dir(&root, &p.dir)?;
        let mpath = dir.join(MANIFEST);
        let bytes = std::fs::read(&mpath)
            .map_err(|e| unreadable(&root, format!("{}: {e}", mpath.display())))?;
        if crc32fast::hash(&bytes) != p.manifest_crc32 {
            return Err(unreadable(
                &root,
                format!(
                    "{} is not the manifest the client checked (another checksum): the server \
                     sees another directory at this path",
                    mpath.display()
                ),
            ));
        }
        let chain = Manifest::chain(&dir).map_err(|e| unreadable(&root, e))?;
        let last_id = chain.last().map(|(_, m)| m.id.as_str()).unwrap_or_default();
        if last_id != p.manifest_id {
            return Err(unreadable(
                &root,
                format!(
                    "part {} holds snapshot {last_id}, the client checked {}",
                    p.dir, p.manifest_id
                ),
            ));
        }
        chains.push(chain);
    }
    // Every table: present here, of the snapshot's kind, dim (shape) and optimizer.
    let mut tables = Vec::with_capacity(r.tables.len());
    for name in &r.tables {
        let table = store.table(name)?;
        let entries: Vec<Option<&TableEntry>> = chains
            .iter()
            .map(|c| {
                c.last()
                    .and_then(|(_, m)| m.tables.iter().find(|e| &e.name == name))
            })
            .collect();
        for e in entries.iter().flatten() {
            check_fits(name, &table, &e.record)?;
        }
        tables.push((name, table, entries));
    }
    // An in-memory table's rows are written on its own pool; a durable one's beside it.
    let own_pool = store.path().is_none();
    let done = AtomicU64::new(0);
    let mut rows = 0u64;
    for (name, table, entries) in tables {
        // A `sync` store commits each table's rows before the answer; a failed commit undoes
        // them (the load is idempotent, so its retry is safe).
        let epoch = table.handle().common().revert_epoch();
        match &table {
            Table::Sparse(t) => {
                let total: u64 = entries.iter().flatten().map(|e| e.total_rows).sum();
                t.reserve((total as usize).div_ceil(r.servers.len()));
                let mut seq = 0;
                for (chain, e) in chains.iter().zip(&entries) {
                    let Some(e) = e else { continue };
                    rows += load_chain(
                        chain,
                        e,
                        &table,
                        |id| router.server_of(id) == me,
                        own_pool,
                        &done,
                    )?;
                    if let TableRecord::Sparse { seq: s, .. } = &e.record {
                        seq = seq.max(*s);
                    }
                }
                t.set_seq(t.seq().max(seq));
            }
            Table::Dense(_) => {
                // The value is in the part of the server the name routed to when it was taken.
                let home = old.dense_home(name);
                if router.dense_home(name) == me {
                    if let Some(e) = entries[home] {
                        rows += load_chain(&chains[home], e, &table, |_| true, own_pool, &done)?;
                    }
                }
            }
        }
        table
            .handle()
            .common()
            .durable_wait_change(epoch, "snapshot load")?;
    }
    Ok(LoadSnapshotResponse {
        rows,
        rows_read: done.into_inner(),
    })
}

/// Refuses rows of another kind, dim (shape) or optimizer than the table's, naming both.
fn check_fits(name: &str, table: &Table, record: &TableRecord) -> Result<()> {
    let opt = |o: &crate::optimizer::OptimizerConfig| serde_json::to_string(o).unwrap_or_default();
    let bad = match (table, record) {
        (Table::Sparse(t), TableRecord::Sparse { config, .. }) => {
            let have = t.config();
            (have.dim != config.dim || have.optimizer != config.optimizer).then(|| {
                format!(
                    "the table has dim {} and optimizer {}, the snapshot's has dim {} and \
                     optimizer {}",
                    have.dim,
                    opt(&have.optimizer),
                    config.dim,
                    opt(&config.optimizer)
                )
            })
        }
        (Table::Dense(d), TableRecord::Dense { config, .. }) => {
            let have = d.config();
            (have.shape != config.shape || have.optimizer != config.optimizer).then(|| {
                format!(
                    "the table has shape {:?} and optimizer {}, the snapshot's has shape {:?} \
                     and optimizer {}",
                    have.shape,
                    opt(&have.optimizer),
                    config.shape,
                    opt(&config.optimizer)
                )
            })
        }
        (Table::Sparse(_), _) => Some("the table is sparse, the snapshot's is dense".into()),
        (Table::Dense(_), _) => Some("the table is dense, the snapshot's is sparse".into()),
    };
    match bad {
        Some(why) => Err(invalid(format!(
            "load snapshot into table {name:?}: {why}; nothing was loaded"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::proto::SnapshotPart;
    use crate::store::StoreConfig;
    use crate::table::SparseTableConfig;

    fn config() -> SparseTableConfig {
        SparseTableConfig {
            dim: 2,
            optimizer: Default::default(),
            initializer: crate::init::Initializer::Zeros,
            seed: 0,
            lifecycle: Default::default(),
            refuse_nonfinite: false,
        }
    }

    /// Two "old servers", each an embedded store with its own ids, snapshotted as the parts of
    /// one cluster snapshot in `root`; returns the request for new server `index` of `servers`.
    fn parts(root: &Path, servers: &[&str], index: u32) -> LoadSnapshotRequest {
        // A snapshot of version 2: rendezvous routing over the old addresses.
        let old = ["a:1", "b:2"];
        let router = Rendezvous::new(&old);
        let mut out = Vec::new();
        for (i, _) in old.iter().enumerate() {
            let dir = root.join(format!("server-{i}"));
            if !dir.exists() {
                let s = Store::new(StoreConfig::default()).unwrap();
                let t = s.create_sparse_table("t", config()).unwrap();
                let ids: Vec<u64> = (0..1000u64)
                    .filter(|&id| router.server_of(id) == i)
                    .collect();
                t.push(&ids, &vec![0.5; 2 * ids.len()]).unwrap();
                s.snapshot(&dir, false).unwrap();
            }
            let bytes = std::fs::read(dir.join(MANIFEST)).unwrap();
            out.push(SnapshotPart {
                dir: format!("server-{i}"),
                manifest_id: Manifest::read(&dir).unwrap().id,
                manifest_crc32: crc32fast::hash(&bytes),
            });
        }
        LoadSnapshotRequest {
            location: root.to_string_lossy().into_owned(),
            parts: out,
            snapshot_servers: old.iter().map(|s| s.to_string()).collect(),
            servers: servers.iter().map(|s| s.to_string()).collect(),
            index,
            tables: vec!["t".into()],
            snapshot_slots: None,
            slots: None,
        }
    }

    #[test]
    fn each_server_keeps_its_rows_and_bad_locations_write_nothing() {
        let root = std::env::temp_dir().join(format!("pstore-load-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let new = ["x:1", "y:2", "z:3"];
        let router = SlotTable::uniform(3).unwrap();
        let mut total = 0;
        for i in 0..3u32 {
            let s = Store::new(StoreConfig::default()).unwrap();
            let t = s.create_sparse_table("t", config()).unwrap();
            let r = load_snapshot(&s, parts(&root, &new, i)).unwrap();
            assert_eq!((r.rows, r.rows_read), (t.len() as u64, 1000));
            let mine: Vec<u64> = (0..1000u64)
                .filter(|&id| router.server_of(id) == i as usize)
                .collect();
            assert_eq!(t.len(), mine.len());
            assert!(t.contains(&mine).unwrap().iter().all(|&c| c));
            total += t.len();
        }
        assert_eq!(total, 1000);

        let s = Store::new(StoreConfig::default()).unwrap();
        let t = s.create_sparse_table("t", config()).unwrap();
        let good = parts(&root, &new, 0);
        let fails = |r: LoadSnapshotRequest, what: &str| {
            let e = load_snapshot(&s, r).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
            assert_eq!(t.len(), 0);
        };
        let missing = root.join("nowhere");
        fails(
            LoadSnapshotRequest {
                location: missing.to_string_lossy().into_owned(),
                ..good.clone()
            },
            &format!("cannot read the cluster snapshot at {}", missing.display()),
        );
        fails(
            LoadSnapshotRequest {
                location: "relative/dir".into(),
                ..good.clone()
            },
            "not an absolute path",
        );
        fails(
            LoadSnapshotRequest {
                location: "gs://bucket/x".into(),
                ..good.clone()
            },
            "not supported",
        );
        let mut other = good.clone();
        other.parts[1].manifest_crc32 ^= 1;
        fails(other, "not the manifest the client checked");
        let mut escape = good.clone();
        escape.parts[0].dir = "../server-0".into();
        fails(escape, "not a relative path inside the snapshot");
        fails(
            LoadSnapshotRequest {
                index: 3,
                ..good.clone()
            },
            "outside the server list",
        );
        fails(
            LoadSnapshotRequest {
                slots: Some(SlotTable::uniform(2).unwrap().to_proto()),
                ..good.clone()
            },
            "addresses 2 servers, the list has 3",
        );
        let mut bad = SlotTable::uniform(3).unwrap().to_proto();
        bad.starts[1] = 0;
        fails(
            LoadSnapshotRequest {
                slots: Some(bad),
                ..good.clone()
            },
            "does not continue",
        );
        // Rows of another dim: refused, naming both.
        let s2 = Store::new(StoreConfig::default()).unwrap();
        s2.create_sparse_table("t", SparseTableConfig { dim: 3, ..config() })
            .unwrap();
        let e = load_snapshot(&s2, good.clone()).unwrap_err().to_string();
        assert!(e.contains("dim 3") && e.contains("dim 2"), "{e}");
        // file:// works like the path.
        let r = load_snapshot(
            &s,
            LoadSnapshotRequest {
                location: format!("file://{}", root.display()),
                ..good
            },
        )
        .unwrap();
        assert_eq!(r.rows, t.len() as u64);
        let _ = std::fs::remove_dir_all(&root);
    }
}
