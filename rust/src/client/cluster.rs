//! Cluster snapshots and restores onto any server list (format in docs/FORMAT.md, "Cluster
//! snapshots").
//!
//! A cluster snapshot is a directory holding one ordinary snapshot per server (`server-<i>`,
//! written by the server itself through its `Snapshot` call, so rows never pass through the
//! client) and `cluster.json`, written last by the client: the layout (server list, slot table,
//! layout hash), the tables' configs and stale policies, and per part its manifest's id and
//! CRC-32. A directory without `cluster.json` is not a cluster snapshot.
//!
//! A restore routes every row by the client's own slot table, so a snapshot of 4 servers loads
//! onto 8 or 2: it checks everything first (every part present, every manifest's checksum, every
//! file of every part's chain, every existing target table's dim and optimizer) and creates the
//! tables that are missing. Then, [`Via::Servers`] (the default): every server at once reads the
//! parts itself with `LoadSnapshot` and keeps the rows the new list routes to it (the embedded
//! restore's chain code, increments and tombstones included); [`Via::Client`]: the client loads
//! each part's chain into a private in-memory store and sends its rows with `BulkLoad` (for
//! servers that do not reach the snapshot's directory). If a write fails after that, the tables
//! the restore created are dropped on every server that answers, and the error says so.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};

use super::{Client, CHUNK_BYTES};
use crate::error::{corrupt, invalid, storage, Error, Result};
use crate::hash::mix64;
use crate::net::proto::*;
use crate::net::routing::{key, Rendezvous, Routing, SlotTable, SlotTableSpec};
use crate::snapshot::location::{self, Location};
use crate::snapshot::{self, Manifest};
use crate::store::{Store, StoreConfig, Table};

/// The cluster manifest's file name.
pub const CLUSTER_MANIFEST: &str = location::CLUSTER_MANIFEST;
/// The format's name, in every cluster manifest.
pub const CLUSTER_FORMAT: &str = "pstore-cluster-snapshot";
/// The cluster manifest version this build writes (it reads 1 and 2 too: no `checksum` in 1,
/// rendezvous routing in both).
pub const CLUSTER_VERSION: u32 = 3;
/// How ids are routed from version 3: 16,384 hash slots, each owned by a server position
/// ([`crate::net::routing`]).
pub const ROUTING: &str = "slots-16384-mix64";
/// How ids were routed up to version 2: rendezvous hashing of the address strings.
pub const ROUTING_V2: &str = "rendezvous-fnv1a-mix64";

/// The servers a snapshot was taken from and how ids were routed among them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// The addresses, in the client's order (`server-<i>` is the i-th).
    pub servers: Vec<String>,
    /// [`ROUTING`] (version 3) or [`ROUTING_V2`] (versions 1 and 2).
    pub routing: String,
    /// [`layout_hash`] of the servers and the slot table (versions 1 and 2: the order-free
    /// hash of the servers alone).
    pub hash: String,
    /// The slot table (version 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<SlotTableSpec>,
}

impl Layout {
    /// How the snapshot's rows were spread over its servers.
    pub fn routing(&self) -> Result<Routing> {
        match &self.slots {
            Some(spec) => Ok(Routing::Slots(SlotTable::from_spec(spec)?)),
            None => Ok(Routing::Rendezvous(Rendezvous::new(&self.servers))),
        }
    }
}

pub use crate::net::routing::layout_hash;

/// The layout hash of a list of replica groups: a group of one is its address (as
/// [`layout_hash`]); a group of several members counts as its position only, so a promotion
/// inside it, or a member's machine replaced, changes no worker's layout (docs/decisions/0100).
pub fn layout_hash_groups<S: AsRef<str>>(
    servers: &[S],
    replicas: &[Vec<String>],
    table: &SlotTable,
) -> String {
    let names: Vec<&str> = servers
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if replicas.get(i).is_some_and(|r| !r.is_empty()) {
                "\u{0}replica-group"
            } else {
                s.as_ref()
            }
        })
        .collect();
    layout_hash(&names, table)
}

/// The layout hash of cluster manifests of versions 1 and 2: the server list in any order.
pub fn layout_hash_v2<S: AsRef<str>>(servers: &[S]) -> String {
    let mut keys: Vec<u64> = servers.iter().map(|s| key(s.as_ref())).collect();
    keys.sort_unstable();
    let mut h = mix64(keys.len() as u64);
    for k in keys {
        h = mix64(h ^ k);
    }
    format!("{h:016x}")
}

/// One table of a cluster snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterTable {
    /// The table's name.
    pub name: String,
    /// `"sparse"` or `"dense"`.
    pub kind: String,
    /// The table's config (the `config` object of a table record).
    pub config: serde_json::Value,
    /// `"APPLY"`, `"DROP"` or `"SCALE"`.
    pub stale_policy: String,
    /// The limit of the `DROP` policy.
    pub max_staleness: u64,
    /// The learning rate in force.
    pub lr: f64,
}

/// One server's part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterPart {
    /// The server's address.
    pub server: String,
    /// The part's directory, relative to the cluster snapshot.
    pub dir: String,
    /// The id in the part's `manifest.json`.
    pub manifest_id: String,
    /// CRC-32 of the part's `manifest.json` bytes.
    pub manifest_crc32: u32,
    /// Rows in the part's files.
    pub rows: u64,
}

/// The cluster snapshot an incremental one builds on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterParent {
    /// The parent's id.
    pub id: String,
    /// Its directory: a sibling's name, or an absolute path.
    pub path: String,
}

/// The step boundary of a job a cluster snapshot was taken at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Boundary {
    /// The job's id.
    pub job: String,
    /// The snapshot holds every push of steps <= this and none of a later step.
    pub step: u64,
}

/// `cluster.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterManifest {
    /// Always [`CLUSTER_FORMAT`].
    pub format: String,
    /// The format version.
    pub version: u32,
    /// A unique id.
    pub id: String,
    /// `"full"` or `"incremental"`.
    pub kind: String,
    /// The cluster snapshot an increment builds on.
    pub parent: Option<ClusterParent>,
    /// Unix seconds when it was taken.
    pub created_at: f64,
    /// The servers and the routing.
    pub layout: Layout,
    /// The tables.
    pub tables: Vec<ClusterTable>,
    /// The parts, one per server, in the layout's order.
    pub parts: Vec<ClusterPart>,
    /// A snapshot at a step boundary of a job: the job and the step (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary: Option<Boundary>,
    /// The file's own checksum, as a snapshot manifest's (absent in version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

impl ClusterManifest {
    /// Reads and checks the cluster manifest in `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(CLUSTER_MANIFEST);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(invalid(format!(
                    "{} is not a cluster snapshot: it has no {CLUSTER_MANIFEST}",
                    dir.display()
                )))
            }
            Err(e) => return Err(storage(format!("reading {}: {e}", path.display()))),
        };
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Reads and checks the cluster manifest at `at`, a directory or an object-store prefix.
    pub fn read_at(at: &Location) -> Result<Self> {
        let bytes = at.read(CLUSTER_MANIFEST)?.ok_or_else(|| {
            invalid(format!(
                "{at} is not a cluster snapshot: it has no {CLUSTER_MANIFEST}"
            ))
        })?;
        Self::from_bytes(&bytes, &format!("{at}/{CLUSTER_MANIFEST}"))
    }

    /// Parses and checks the cluster manifest bytes read from `path`.
    pub fn from_bytes(bytes: &[u8], path: &str) -> Result<Self> {
        let m: ClusterManifest = serde_json::from_slice(bytes)
            .map_err(|e| corrupt(format!("{path}: not a readable manifest: {e}")))?;
        if m.format != CLUSTER_FORMAT || !(1..=CLUSTER_VERSION).contains(&m.version) {
            return Err(corrupt(format!(
                "{}: format {:?} version {}, this pstore reads {CLUSTER_FORMAT:?} versions 1 \
                 to {CLUSTER_VERSION}",
                path, m.format, m.version
            )));
        }
        snapshot::check_seal(path, bytes, m.checksum.as_deref(), m.version >= 2)?;
        if m.parts.len() != m.layout.servers.len() {
            return Err(corrupt(format!(
                "{}: {} parts for {} servers",
                path,
                m.parts.len(),
                m.layout.servers.len()
            )));
        }
        let want = if m.version >= 3 {
            let spec = m
                .layout
                .slots
                .as_ref()
                .filter(|_| m.layout.routing == ROUTING);
            let Some(spec) = spec else {
                return Err(corrupt(format!(
                    "{path}: version {} needs routing {ROUTING:?} and a slot table",
                    m.version
                )));
            };
            let table = SlotTable::from_spec(spec).map_err(|e| corrupt(format!("{path}: {e}")))?;
            if table.servers() != m.layout.servers.len() {
                return Err(corrupt(format!(
                    "{path}: the slot table addresses {} servers, the layout lists {}",
                    table.servers(),
                    m.layout.servers.len()
                )));
            }
            layout_hash(&m.layout.servers, &table)
        } else {
            if m.layout.slots.is_some() {
                return Err(corrupt(format!(
                    "{path}: version {} has no slot table",
                    m.version
                )));
            }
            layout_hash_v2(&m.layout.servers)
        };
        if m.layout.hash != want {
            return Err(corrupt(format!(
                "{}: layout hash {} does not match its server list (hash {want})",
                path, m.layout.hash
            )));
        }
        Ok(m)
    }
}

/// How a cluster restore moves the rows onto the new servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Via {
    /// Every server reads the snapshot's parts itself (`LoadSnapshot`) and keeps its rows: the
    /// snapshot's directory must be readable by every server at the path the client sees.
    #[default]
    Servers,
    /// The client reads the parts and sends every row with `BulkLoad`: slower, for servers that
    /// do not reach the snapshot's directory.
    Client,
}

impl std::str::FromStr for Via {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "servers" => Ok(Via::Servers),
            "client" => Ok(Via::Client),
            _ => Err(invalid(format!(
                "via {s:?}: a cluster restore goes via \"servers\" or \"client\""
            ))),
        }
    }
}

/// What a cluster restore did.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreReport {
    /// Rows written (the last state of every row of every part's chain).
    pub rows: u64,
    /// Tables restored.
    pub tables: usize,
    /// Parts read.
    pub parts: usize,
}

fn policy_name(p: i32) -> String {
    StalePolicy::try_from(p)
        .unwrap_or(StalePolicy::Apply)
        .as_str_name()
        .to_string()
}

impl Client {
    /// Writes one snapshot of the whole cluster into `dest`, a directory (created with its
    /// parents) or an object-store prefix (`s3://bucket/prefix`): every server writes
    /// `dest/server-<i>` itself, then the client writes `dest/cluster.json`. With
    /// `incremental`, each server writes the rows changed since its previous snapshot, which
    /// must be a part of one earlier cluster snapshot: the new manifest names it as parent.
    pub fn cluster_snapshot(&self, dest: &str, incremental: bool) -> Result<ClusterManifest> {
        let (dir, tables) = self.cluster_begin(dest)?;
        let answers = self.snapshot(&dir.to_string(), incremental)?;
        self.cluster_finish(&dir, tables, &answers, incremental, None)
    }

    /// The first half of a cluster snapshot: `dest` checked and made, the tables described.
    pub(super) fn cluster_begin(&self, dest: &str) -> Result<(Location, Vec<ClusterTable>)> {
        let dir = Location::open(dest)?;
        if dir.read(CLUSTER_MANIFEST)?.is_some() {
            return Err(invalid(format!(
                "{dir} holds a cluster snapshot already; a snapshot is written into a new \
                 directory"
            )));
        }
        dir.create_dir_all()?;
        let mut tables = Vec::new();
        for name in self.list_tables()? {
            let info = self.get_table(&name)?.swap_remove(0);
            let dense = info.kind == TableKind::Dense as i32;
            tables.push(ClusterTable {
                name,
                kind: if dense { "dense" } else { "sparse" }.to_string(),
                config: serde_json::from_str(&info.config_json)
                    .map_err(|e| corrupt(format!("a server's table config: {e}")))?,
                stale_policy: policy_name(info.stale_policy),
                max_staleness: info.max_staleness,
                lr: info.lr,
            });
        }
        Ok((dir, tables))
    }

    /// The second half: `cluster.json` over the servers' answers (their parts, in the list's
    /// order), written last.
    pub(super) fn cluster_finish(
        &self,
        dir: &Location,
        tables: Vec<ClusterTable>,
        answers: &[SnapshotResponse],
        incremental: bool,
        boundary: Option<Boundary>,
    ) -> Result<ClusterManifest> {
        let mut parts = Vec::new();
        let mut parents = Vec::new();
        for (i, a) in answers.iter().enumerate() {
            let m: Manifest = serde_json::from_str(&a.manifest_json).map_err(|e| {
                corrupt(format!(
                    "server {}: its snapshot manifest does not read: {e}",
                    self.name_of(i)
                ))
            })?;
            if let Some(p) = &m.parent {
                let server_prev = dir.join(&format!("server-{i}")).resolve(&p.path)?;
                parents.push((server_prev, p.id.clone()));
            }
            parts.push(ClusterPart {
                server: self.name_of(i),
                dir: format!("server-{i}"),
                manifest_id: m.id,
                manifest_crc32: crc32fast::hash(a.manifest_json.as_bytes()),
                rows: a.rows,
            });
        }
        let parent = if incremental {
            Some(self.cluster_parent(dir, &parents)?)
        } else {
            None
        };
        let servers = self.servers();
        let mut manifest = ClusterManifest {
            format: CLUSTER_FORMAT.into(),
            version: CLUSTER_VERSION,
            id: snapshot::new_id(),
            kind: if incremental { "incremental" } else { "full" }.into(),
            parent,
            created_at: snapshot::unix_time(),
            layout: Layout {
                hash: layout_hash(&servers, &self.route().table),
                servers,
                routing: ROUTING.into(),
                slots: Some(self.route().table.spec()),
            },
            tables,
            parts,
            boundary,
            checksum: Some(snapshot::SEAL_PLACEHOLDER.into()),
        };
        let (bytes, sum) = snapshot::seal_json(&manifest)?;
        manifest.checksum = Some(sum);
        dir.write(CLUSTER_MANIFEST, &bytes)?;
        Ok(manifest)
    }

    /// The cluster snapshot whose parts are the servers' previous snapshots.
    fn cluster_parent(
        &self,
        dir: &Location,
        parents: &[(Location, String)],
    ) -> Result<ClusterParent> {
        let not_one = || {
            invalid(format!(
                "incremental cluster snapshot {dir}: the servers' previous snapshots are not the \
                 parts of one cluster snapshot (take a full cluster snapshot first)"
            ))
        };
        let first = parents.first().ok_or_else(not_one)?;
        let pdir = first.0.parent().ok_or_else(not_one)?;
        let pm = ClusterManifest::read_at(&pdir).map_err(|_| not_one())?;
        if pm.parts.len() != parents.len() {
            return Err(not_one());
        }
        for (part, (path, id)) in pm.parts.iter().zip(parents) {
            let same = path
                .parent()
                .is_some_and(|p| p.to_string() == pdir.to_string());
            if part.manifest_id != *id || !same {
                return Err(not_one());
            }
        }
        Ok(ClusterParent {
            id: pm.id,
            path: dir.relative(&pdir)?,
        })
    }

    /// Loads the cluster snapshot in `snapshot` (a directory or an object-store prefix) into
    /// this client's servers, routing every row by this client's slot table (any number of
    /// servers), the rows moved as `via` says. Tables that exist already must have the
    /// snapshot's dim and optimizer; their rows of the same ids are replaced. A remote snapshot
    /// is downloaded into a staging directory to be checked; with [`Via::Servers`] every server
    /// then reads it from the object store itself.
    pub fn restore_cluster(&self, snapshot: &str, via: Via) -> Result<RestoreReport> {
        self.drain();
        let staged = location::stage(snapshot)?;
        // The servers read a remote snapshot from the object store, a local one at the path
        // the client sees.
        let remote = staged.is_staged().then_some(snapshot);
        self.restore_staged(staged.dir(), remote, via)
            .map_err(|e| staged.explain(e))
    }

    fn restore_staged(&self, dir: &Path, remote: Option<&str>, via: Via) -> Result<RestoreReport> {
        let m = ClusterManifest::read(dir)?;
        // Everything is checked before anything is written.
        let mut part_dirs = Vec::new();
        for part in &m.parts {
            let pdir = dir.join(&part.dir);
            let mpath = pdir.join(snapshot::MANIFEST);
            let bytes = std::fs::read(&mpath).map_err(|e| {
                invalid(format!(
                    "cluster snapshot {}: part {} (server {}) is missing: {}: {e}; nothing was \
                     loaded",
                    dir.display(),
                    part.dir,
                    part.server,
                    mpath.display()
                ))
            })?;
            if crc32fast::hash(&bytes) != part.manifest_crc32 {
                return Err(corrupt(format!(
                    "cluster snapshot {}: the manifest of part {} does not match its checksum \
                     in {CLUSTER_MANIFEST}; nothing was loaded",
                    dir.display(),
                    part.dir
                )));
            }
            let pm = Manifest::read(&pdir)?;
            if pm.id != part.manifest_id {
                return Err(corrupt(format!(
                    "cluster snapshot {}: part {} holds snapshot {}, {CLUSTER_MANIFEST} names {}; \
                     nothing was loaded",
                    dir.display(),
                    part.dir,
                    pm.id,
                    part.manifest_id
                )));
            }
            snapshot::verify(&pdir)?;
            part_dirs.push(pdir);
        }
        let mut create = Vec::new();
        for t in &m.tables {
            let config_json = t.config.to_string();
            match self.get_table(&t.name) {
                Ok(infos) => {
                    for (i, info) in infos.iter().enumerate() {
                        self.check_target(t, info, &self.name_of(i))?;
                    }
                }
                Err(Error::UnknownTable(_)) => create.push(CreateTableRequest {
                    name: t.name.clone(),
                    kind: if t.kind == "dense" {
                        TableKind::Dense
                    } else {
                        TableKind::Sparse
                    } as i32,
                    config_json,
                    stale_policy: StalePolicy::from_str_name(&t.stale_policy)
                        .unwrap_or(StalePolicy::Apply) as i32,
                    max_staleness: t.max_staleness,
                    policy_unset: false,
                }),
                Err(e) => return Err(e),
            }
        }
        let mut created = Vec::new();
        let r = (|| {
            for req in create {
                let name = req.name.clone();
                self.create_table(req)?;
                created.push(name);
            }
            match via {
                Via::Servers => self.load_on_servers(dir, remote, &m),
                Via::Client => self.load_parts(&m, &part_dirs),
            }
        })();
        match r {
            Ok(report) => Ok(report),
            Err(e) if created.is_empty() => Err(e),
            Err(e) => {
                let dropped = created.iter().all(|name| self.drop_table(name).is_ok());
                let how = if dropped {
                    "were dropped"
                } else {
                    "were dropped on the servers that answered; drop them on the others"
                };
                Err(with_note(
                    e,
                    &format!(
                        "the restore failed; the tables it created ({}) {how}",
                        created.join(", ")
                    ),
                ))
            }
        }
    }

    /// Asks every server at once to read the parts from `dir` and keep its rows, then sets
    /// each table's learning rate.
    fn load_on_servers(
        &self,
        dir: &Path,
        remote: Option<&str>,
        m: &ClusterManifest,
    ) -> Result<RestoreReport> {
        // A remote snapshot's URI, or the path as the client sees it, absolute: the servers
        // resolve it the same way when they share the directory.
        let location = match remote {
            Some(uri) => uri.to_string(),
            None => dir
                .canonicalize()
                .map_err(|e| storage(format!("reading {}: {e}", dir.display())))?
                .to_string_lossy()
                .into_owned(),
        };
        let servers = self.servers();
        let base = LoadSnapshotRequest {
            location,
            parts: m
                .parts
                .iter()
                .map(|p| SnapshotPart {
                    dir: p.dir.clone(),
                    manifest_id: p.manifest_id.clone(),
                    manifest_crc32: p.manifest_crc32,
                })
                .collect(),
            snapshot_servers: m.layout.servers.clone(),
            servers,
            index: 0,
            tables: m.tables.iter().map(|t| t.name.clone()).collect(),
            snapshot_slots: match m.layout.routing()? {
                Routing::Slots(t) => Some(t.to_proto()),
                Routing::Rendezvous(_) => None,
            },
            slots: Some(self.route().table.to_proto()),
        };
        // A load takes as long as the rows need: no deadline but the client's own for a call
        // that does not answer at all is too short, so an hour per call.
        let timeout = self
            .config
            .timeout
            .max(std::time::Duration::from_secs(3600));
        let answers = self.rt.block_on(async {
            let calls = (0..self.n()).map(|i| {
                let req = LoadSnapshotRequest {
                    index: i as u32,
                    ..base.clone()
                };
                async move {
                    self.call(i, req, timeout, false, |mut c, r| async move {
                        c.load_snapshot(r).await
                    })
                    .await
                    .map_err(|e| match e {
                        Error::InvalidArgument(msg) => {
                            invalid(format!("server {}: {msg}", self.name_of(i)))
                        }
                        e => e,
                    })
                }
            });
            super::futures_join_all(calls).await
        });
        let mut rows = 0;
        for a in answers {
            rows += a?.rows;
        }
        for t in &m.tables {
            self.set_lr(&t.name, t.lr)?;
        }
        self.flush()?;
        Ok(RestoreReport {
            rows,
            tables: m.tables.len(),
            parts: m.parts.len(),
        })
    }

    /// Refuses a table of another kind, dim or optimizer on server `server`.
    fn check_target(&self, t: &ClusterTable, info: &TableInfo, server: &str) -> Result<()> {
        let have: serde_json::Value = serde_json::from_str(&info.config_json)
            .map_err(|e| corrupt(format!("server {server}: table config: {e}")))?;
        let field = |v: &serde_json::Value, k: &str| v.get(k).cloned().unwrap_or_default();
        let kind = if info.kind == TableKind::Dense as i32 {
            "dense"
        } else {
            "sparse"
        };
        let size = if t.kind == "dense" { "shape" } else { "dim" };
        if kind != t.kind
            || field(&have, size) != field(&t.config, size)
            || field(&have, "optimizer") != field(&t.config, "optimizer")
        {
            return Err(invalid(format!(
                "restore of table {:?}: server {server} has a {kind} table of {size} {} and \
                 optimizer {}, the snapshot's is a {} table of {size} {} and optimizer {}; \
                 nothing was loaded",
                t.name,
                field(&have, size),
                field(&have, "optimizer"),
                t.kind,
                field(&t.config, size),
                field(&t.config, "optimizer"),
            )));
        }
        Ok(())
    }

    /// Loads each part's chain into a private store and sends its rows where they now belong.
    fn load_parts(&self, m: &ClusterManifest, part_dirs: &[PathBuf]) -> Result<RestoreReport> {
        let mut rows = 0u64;
        let mut seqs = std::collections::HashMap::<String, u64>::new();
        let config = StoreConfig {
            num_shards: 64,
            ..StoreConfig::default()
        };
        // A dense table lives on the server its name routes to; the other parts hold unused
        // copies of its initial value.
        let old = m.layout.routing()?;
        for (i, pdir) in part_dirs.iter().enumerate() {
            let store = Store::restore_counted(pdir, config.clone(), None, &AtomicU64::new(0))?;
            for name in store.tables() {
                let Some(t) = m.tables.iter().find(|t| t.name == name) else {
                    continue;
                };
                let config_json = t.config.to_string();
                match store.table(&name)? {
                    Table::Sparse(st) => {
                        let seq = seqs.entry(name.clone()).or_default();
                        *seq = (*seq).max(st.seq());
                        rows += self.send_sparse(&name, &config_json, &st)?;
                    }
                    Table::Dense(_) if old.dense_home(&name) != i => {}
                    Table::Dense(d) => {
                        let home = self.dense_home(&name);
                        let req = BulkLoadRequest {
                            table: name.clone(),
                            config_json,
                            ids: Default::default(),
                            words: words_bytes(&d.words()).into(),
                            seq: None,
                            applied_request_ids: Default::default(),
                            removed_ids: Default::default(),
                            dense_offset: None,
                        };
                        self.fan_out(
                            vec![(home, req)],
                            |mut c, r| async move { c.bulk_load(r).await },
                        )?;
                        rows += 1;
                    }
                }
            }
        }
        for t in &m.tables {
            if let Some(&seq) = seqs.get(&t.name) {
                let req = BulkLoadRequest {
                    table: t.name.clone(),
                    config_json: t.config.to_string(),
                    ids: Default::default(),
                    words: Default::default(),
                    seq: Some(seq),
                    applied_request_ids: Default::default(),
                    removed_ids: Default::default(),
                    dense_offset: None,
                };
                self.fan_out(
                    self.all(req),
                    |mut c, r| async move { c.bulk_load(r).await },
                )?;
            }
            self.set_lr(&t.name, t.lr)?;
        }
        self.flush()?;
        Ok(RestoreReport {
            rows,
            tables: m.tables.len(),
            parts: part_dirs.len(),
        })
    }

    /// Sends every row of `t` to the server this client routes it to; returns the rows sent.
    /// Requests of about [`CHUNK_BYTES`] go out [`IN_FLIGHT`] bytes at a time, all at once.
    fn send_sparse(
        &self,
        name: &str,
        config_json: &str,
        t: &crate::table::SparseTable,
    ) -> Result<u64> {
        let n = self.n();
        let m = t.row_words();
        let per_request = (CHUNK_BYTES / (8 + 4 * m)).max(1);
        let mut ids: Vec<Vec<u64>> = vec![Vec::new(); n];
        let mut words: Vec<Vec<u8>> = vec![Vec::new(); n];
        let mut pending: Vec<(usize, BulkLoadRequest)> = Vec::new();
        let mut pending_bytes = 0usize;
        let mut sent = 0u64;
        let cut = |i: usize,
                   ids: &mut Vec<Vec<u64>>,
                   words: &mut Vec<Vec<u8>>,
                   pending: &mut Vec<(usize, BulkLoadRequest)>|
         -> usize {
            let bytes = words[i].len() + 8 * ids[i].len();
            pending.push((
                i,
                BulkLoadRequest {
                    table: name.to_string(),
                    config_json: config_json.to_string(),
                    ids: crate::net::wire::encode_ids(&std::mem::take(&mut ids[i])),
                    words: std::mem::take(&mut words[i]).into(),
                    seq: None,
                    applied_request_ids: Default::default(),
                    removed_ids: Default::default(),
                    dense_offset: None,
                },
            ));
            bytes
        };
        let send = |pending: &mut Vec<(usize, BulkLoadRequest)>| -> Result<u64> {
            let batch = std::mem::take(pending);
            let rows = self.fan_out(batch, |mut c, r| async move { c.bulk_load(r).await })?;
            Ok(rows.iter().map(|r| r.rows).sum())
        };
        let route = self.route();
        for s in 0..t.num_shards() {
            t.copy_shard(s, false, |id, w| {
                let i = route.table.server_of(id);
                ids[i].push(id);
                let out = &mut words[i];
                out.reserve(4 * w.len());
                for x in w {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            });
            for i in 0..n {
                if ids[i].len() >= per_request {
                    pending_bytes += cut(i, &mut ids, &mut words, &mut pending);
                }
            }
            if pending_bytes >= IN_FLIGHT {
                sent += send(&mut pending)?;
                pending_bytes = 0;
            }
        }
        for i in 0..n {
            if !ids[i].is_empty() {
                cut(i, &mut ids, &mut words, &mut pending);
            }
        }
        sent += send(&mut pending)?;
        Ok(sent)
    }
}

/// `e` with `note` added to its message, of the same kind.
fn with_note(e: Error, note: &str) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{m}; {note}")),
        Error::Storage(m) => Error::Storage(format!("{m}; {note}")),
        Error::Corrupt(m) => Error::Corrupt(format!("{m}; {note}")),
        Error::Remote {
            server,
            code,
            message,
        } => Error::Remote {
            server,
            code,
            message: format!("{message}; {note}"),
        },
        e => e,
    }
}

/// Bytes of bulk-load requests a restore has in flight at once.
const IN_FLIGHT: usize = 64 << 20;

fn words_bytes(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(version: u32, layout: Layout) -> Vec<u8> {
        let m = ClusterManifest {
            format: CLUSTER_FORMAT.into(),
            version,
            id: "x".into(),
            kind: "full".into(),
            parent: None,
            created_at: 0.0,
            boundary: None,
            parts: layout
                .servers
                .iter()
                .enumerate()
                .map(|(i, s)| ClusterPart {
                    server: s.clone(),
                    dir: format!("server-{i}"),
                    manifest_id: "m".into(),
                    manifest_crc32: 0,
                    rows: 0,
                })
                .collect(),
            layout,
            tables: Vec::new(),
            checksum: Some(snapshot::SEAL_PLACEHOLDER.into()),
        };
        snapshot::seal_json(&m).unwrap().0
    }

    fn servers(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:7070")).collect()
    }

    #[test]
    fn version_3_carries_and_checks_the_slot_table() {
        let s = servers(3);
        let t = SlotTable::from_ranges(
            5,
            3,
            &[
                crate::net::routing::SlotRange {
                    start: 0,
                    end: 100,
                    owner: 2,
                },
                crate::net::routing::SlotRange {
                    start: 100,
                    end: 16384,
                    owner: 0,
                },
            ],
        )
        .unwrap();
        let good = Layout {
            hash: layout_hash(&s, &t),
            servers: s.clone(),
            routing: ROUTING.into(),
            slots: Some(t.spec()),
        };
        let m = ClusterManifest::from_bytes(&manifest(3, good.clone()), "c").unwrap();
        match m.layout.routing().unwrap() {
            Routing::Slots(r) => assert_eq!(r, t),
            Routing::Rendezvous(_) => panic!("slots expected"),
        }
        // Another order of the same servers, or the uniform table: another hash.
        let mut rev = s.clone();
        rev.reverse();
        assert_ne!(layout_hash(&rev, &t), good.hash);
        assert_ne!(layout_hash(&s, &SlotTable::uniform(3).unwrap()), good.hash);
        assert_eq!(layout_hash(&s, &t.clone().with_epoch(9)), good.hash);
        let refused = |layout: Layout, what: &str| {
            let e = ClusterManifest::from_bytes(&manifest(3, layout), "c")
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{e}");
        };
        refused(
            Layout {
                slots: None,
                ..good.clone()
            },
            "needs routing",
        );
        refused(
            Layout {
                hash: layout_hash(&s, &SlotTable::uniform(3).unwrap()),
                ..good.clone()
            },
            "does not match",
        );
        let mut short = t.spec();
        short.ranges.pop();
        refused(
            Layout {
                slots: Some(short),
                ..good.clone()
            },
            "reach 16384",
        );
        refused(
            Layout {
                servers: servers(4),
                ..good.clone()
            },
            "addresses 3 servers",
        );
    }

    #[test]
    fn version_2_routes_by_rendezvous() {
        let s = servers(2);
        let v2 = Layout {
            hash: layout_hash_v2(&s),
            servers: s.clone(),
            routing: ROUTING_V2.into(),
            slots: None,
        };
        let m = ClusterManifest::from_bytes(&manifest(2, v2.clone()), "c").unwrap();
        let r = m.layout.routing().unwrap();
        let rv = Rendezvous::new(&s);
        for id in 0..1000u64 {
            assert_eq!(r.server_of(id), rv.server_of(id));
        }
        let with_slots = Layout {
            slots: Some(SlotTable::uniform(2).unwrap().spec()),
            ..v2
        };
        let e = ClusterManifest::from_bytes(&manifest(2, with_slots), "c").unwrap_err();
        assert!(e.to_string().contains("has no slot table"), "{e}");
    }
}
