//! The model server (`pstore serve-model`): the `pstore.v1.PStore` service answered read-only
//! from a serving artifact. Pull is a lookup (ids the artifact lacks get the server's default
//! row), Contains, DensePull, GetTable, ListTables and Status work as on a store server; every
//! call that would change something is refused with PERMISSION_DENIED.

use std::mem::MaybeUninit;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use super::metrics::{Metrics, Sample, TableSample};
use super::{
    authenticate, check_token, code_name, fits, launch, on_blocking, rows, splice_rows, Busy,
    ServerConfig, ServerHandle,
};
use crate::durable::TableRecord;
use crate::error::{Error, Result};
use crate::net::proto::p_store_server::PStore;
use crate::net::proto::*;
use crate::net::{status_of, wire, PROTOCOL};
use crate::serving::{Artifact, Fallback, State, TableMeta, TableReader};

/// Batches up to this many ids are looked up on the runtime's thread (LMDB reads do not block
/// unless a page is cold); larger ones on the blocking pool.
const INLINE_IDS: usize = 1024;

struct Inner {
    artifact: Arc<Artifact>,
    fallback: Fallback,
    tokens: super::Tokens,
    metrics: Metrics,
    started: Instant,
    max_message: usize,
    inflight: Arc<AtomicUsize>,
    /// The rows port's port number (0: none), what Status tells clients.
    rows_port: u32,
}

impl Inner {
    fn info(&self, t: &TableMeta, generation: u64) -> Result<TableInfo> {
        let (config, lr, seq) = match &t.record {
            TableRecord::Sparse {
                config, lr, seq, ..
            } => (serde_json::to_string(config), *lr, *seq),
            TableRecord::Dense {
                config, lr, seq, ..
            } => (serde_json::to_string(config), *lr, *seq),
        };
        let sparse = t.kind == "sparse";
        let stats = serde_json::json!({
            "rows": t.rows, "dtype": t.dtype.as_str(),
            "row_bytes": if sparse { t.dtype.row_bytes(t.dim) } else { t.dim * 4 },
            "seq": seq, "lr": lr, "generation": generation,
        });
        Ok(TableInfo {
            name: t.name.clone(),
            kind: if sparse {
                TableKind::Sparse
            } else {
                TableKind::Dense
            } as i32,
            config_json: config.map_err(|e| Error::Internal(e.to_string()))?,
            dim: if sparse { t.dim as u32 } else { 0 },
            shape: t.shape.iter().map(|&x| x as u64).collect(),
            lr,
            rows: t.rows,
            seq,
            stale_policy: 0,
            max_staleness: 0,
            stats_json: stats.to_string(),
        })
    }

    fn sample(&self) -> (Sample, String) {
        let state = self.artifact.state();
        let mut tables = Vec::new();
        let mut extra = String::new();
        if let Ok(s) = &state {
            for t in &s.tables {
                let bytes = if t.kind == "sparse" {
                    t.rows * t.dtype.row_bytes(t.dim) as u64
                } else {
                    t.dim as u64 * 4
                };
                tables.push(TableSample {
                    name: t.name.clone(),
                    kind: if t.kind == "sparse" {
                        "sparse"
                    } else {
                        "dense"
                    },
                    rows: t.rows,
                    bytes,
                    pushes: 0,
                    pulls: 0,
                    ids_pushed: 0,
                    ids_pulled: 0,
                    rows_nonfinite: 0,
                    staleness: Default::default(),
                });
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            extra = format!(
                "# HELP pstore_model_lag_seconds Seconds since training took the snapshot the \
                 artifact is at.\n# TYPE pstore_model_lag_seconds gauge\n\
                 pstore_model_lag_seconds {}\n\
                 # HELP pstore_model_generation Snapshots applied to the artifact.\n\
                 # TYPE pstore_model_generation gauge\npstore_model_generation {}\n\
                 # HELP pstore_model_file_bytes Bytes of the artifact's data file.\n\
                 # TYPE pstore_model_file_bytes gauge\npstore_model_file_bytes {}\n",
                (now - s.snapshot.created_at).max(0.0),
                s.generation,
                self.artifact.file_bytes()
            );
        }
        (
            Sample {
                tables,
                replica: None,
                uptime: self.started.elapsed(),
                clocks: Vec::new(),
                replication: None,
            },
            extra,
        )
    }

    fn fits(&self, bytes: usize) -> Result<()> {
        fits(self.max_message, bytes, "pull")
    }

    /// The table's rows, pinned at one generation, and their width; a pull of `n` ids in wire
    /// type `d` is refused here, before any row is read, when its answer is over the limit.
    fn pinned(&self, table: &str, n: usize, d: Dtype) -> Result<(Option<TableReader>, usize)> {
        let reader = self.artifact.reader(table)?;
        let dim = match &reader {
            Some(t) => t.dim(),
            None => self.artifact.dim(table)?,
        };
        self.fits(n * dim * wire::width(d))?;
        Ok((reader, dim))
    }

    /// Looks `ids` up into `out` from `reader` (or the artifact's current version when the
    /// table has no row file); the generation read.
    fn look(
        &self,
        reader: &Option<TableReader>,
        table: &str,
        ids: &[u64],
        out: &mut [f32],
    ) -> Result<u64> {
        Ok(match reader {
            Some(t) => {
                t.lookup(ids, &self.fallback, out)?;
                t.generation()
            }
            None => {
                self.artifact
                    .lookup(table, ids, &self.fallback, out, None)?
                    .1
            }
        })
    }

    /// A pull on the rows port (`rows.rs`): the rows go into `buf` after its head, float32
    /// rows looked up in place. The buffer is the connection's, kept across calls: it is
    /// zeroed only where it grows.
    fn pull_rows(&self, c: &rows::Call<'_>, buf: &mut Vec<f32>) -> Result<rows::Rows> {
        let d = wire::dtype(c.dtype)?;
        let (reader, dim) = self.pinned(c.table, c.ids.len(), d)?;
        let n = c.ids.len() * dim;
        let at = rows::HEAD_WORDS;
        let (generation, bytes) = match d {
            Dtype::Float32 => {
                if buf.len() < at + n {
                    buf.resize(at + n, 0.0);
                }
                let g = self.look(&reader, c.table, c.ids, &mut buf[at..at + n])?;
                (g, n * 4)
            }
            _ => {
                let mut v = vec![0.0; n];
                let g = self.look(&reader, c.table, c.ids, &mut v)?;
                let enc = wire::encode_values(&v, d);
                let words = enc.len().div_ceil(4);
                if buf.len() < at + words {
                    buf.resize(at + words, 0.0);
                }
                // SAFETY: f32 memory is valid as bytes; the slice covers `words` floats.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(buf[at..].as_mut_ptr().cast::<u8>(), words * 4)
                };
                out[..enc.len()].copy_from_slice(&enc);
                (g, enc.len())
            }
        };
        Ok(rows::Rows {
            dtype: d as i32,
            dim: dim as u32,
            generation,
            bytes,
            own: None,
        })
    }

    /// A call on the rows port, counted and timed as a gRPC `Pull`.
    fn rows_call(
        &self,
        c: &rows::Call<'_>,
        buf: &mut Vec<f32>,
    ) -> std::result::Result<rows::Rows, Status> {
        let t0 = Instant::now();
        let _busy = Busy::new(&self.inflight);
        let out = check_token(&self.tokens, c.token)
            .and_then(|_| self.pull_rows(c, buf).map_err(|e| status_of(&e)));
        let code = out.as_ref().err().map(|s| code_name(s.code()));
        self.metrics.observe("Pull", t0.elapsed(), code);
        out
    }

    /// A pull: the rows are looked up straight into the answer's buffer (float32 on the wire),
    /// which then goes to the socket as it is (`net/splice.rs`), never copied into tonic's.
    /// The width and the rows come from one pinned generation.
    fn pull(&self, r: PullRequest) -> Result<PullResponse> {
        let d = wire::dtype(r.dtype)?;
        let ids = wire::ids(&r.ids)?;
        let (reader, dim) = self.pinned(&r.table, ids.len(), d)?;
        let mut generation = 0;
        let mut lookup = |out: &mut [f32]| -> Result<()> {
            generation = self.look(&reader, &r.table, &ids, out)?;
            Ok(())
        };
        let rows = match d {
            Dtype::Float32 => wire::fill_f32(ids.len() * dim, |out| lookup(zeroed(out)))?,
            _ => {
                let mut v = vec![0.0; ids.len() * dim];
                lookup(&mut v)?;
                wire::encode_values(&v, d)
            }
        };
        Ok(PullResponse {
            rows,
            dtype: d as i32,
            dim: dim as u32,
            seq: generation,
            version: generation,
        })
    }

    /// The info of every table of the artifact, as one version has them.
    fn infos(&self) -> Result<(State, Vec<TableInfo>)> {
        let state = self.artifact.state()?;
        let tables = state
            .tables
            .iter()
            .map(|t| self.info(t, state.generation))
            .collect::<Result<Vec<_>>>()?;
        Ok((state, tables))
    }
}

/// `out` with every element set to 0.0, as floats.
fn zeroed(out: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    for x in out.iter_mut() {
        x.write(0.0);
    }
    // SAFETY: every element was initialised just above; MaybeUninit<f32> has f32's layout.
    unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<f32>(), out.len()) }
}

#[derive(Clone)]
struct ModelService(Arc<Inner>);

impl ModelService {
    async fn run<T, R>(
        &self,
        method: &'static str,
        req: Request<T>,
        inline: impl Fn(&T) -> bool,
        f: impl FnOnce(&Inner, T) -> Result<R> + Send + 'static,
    ) -> std::result::Result<Response<R>, Status>
    where
        T: Send + 'static,
        R: Send + 'static,
    {
        let t0 = Instant::now();
        let _busy = Busy::new(&self.0.inflight);
        let out = match authenticate(&self.0.tokens, &req) {
            Err(s) => Err(s),
            Ok(_) => {
                let msg = req.into_inner();
                if inline(&msg) {
                    f(&self.0, msg).map_err(|e| status_of(&e))
                } else {
                    let inner = Arc::clone(&self.0);
                    on_blocking(move || f(&inner, msg)).await
                }
            }
        };
        let code = out.as_ref().err().map(|s| code_name(s.code()));
        self.0.metrics.observe(method, t0.elapsed(), code);
        out.map(Response::new)
    }

    /// Refuses a call that would change something (after the token check, so a caller without
    /// a valid token learns nothing more).
    fn refuse<T, R>(
        &self,
        method: &'static str,
        req: &Request<T>,
    ) -> std::result::Result<Response<R>, Status> {
        let t0 = Instant::now();
        let s = match authenticate(&self.0.tokens, req) {
            Err(s) => s,
            Ok(_) => Status::permission_denied(format!(
                "this is a read-only model server (pstore serve-model): {method} is refused; \
                 tables change only by applying snapshots to its artifact"
            )),
        };
        self.0
            .metrics
            .observe(method, t0.elapsed(), Some(code_name(s.code())));
        Err(s)
    }
}

type Answer<R> = std::result::Result<Response<R>, Status>;

#[tonic::async_trait]
impl PStore for ModelService {
    async fn create_table(&self, req: Request<CreateTableRequest>) -> Answer<TableInfo> {
        self.refuse("CreateTable", &req)
    }

    async fn get_table(&self, req: Request<GetTableRequest>) -> Answer<TableInfo> {
        self.run(
            "GetTable",
            req,
            |_| true,
            |s, r| {
                let state = s.artifact.state()?;
                let t = state
                    .table(&r.name)
                    .ok_or_else(|| Error::UnknownTable(r.name.clone()))?;
                s.info(t, state.generation)
            },
        )
        .await
    }

    async fn list_tables(&self, req: Request<ListTablesRequest>) -> Answer<ListTablesResponse> {
        self.run(
            "ListTables",
            req,
            |_| true,
            |s, _| {
                Ok(ListTablesResponse {
                    tables: s.infos()?.1,
                })
            },
        )
        .await
    }

    async fn drop_table(&self, req: Request<DropTableRequest>) -> Answer<DropTableResponse> {
        self.refuse("DropTable", &req)
    }

    async fn pull(&self, req: Request<PullRequest>) -> Answer<PullResponse> {
        let small = |r: &PullRequest| r.ids.len() <= INLINE_IDS * 8;
        self.run("Pull", req, small, Inner::pull)
            .await
            .map(splice_rows)
    }

    async fn push(&self, req: Request<PushRequest>) -> Answer<PushResponse> {
        self.refuse("Push", &req)
    }

    async fn contains(&self, req: Request<ContainsRequest>) -> Answer<ContainsResponse> {
        let small = |r: &ContainsRequest| r.ids.len() <= INLINE_IDS * 8;
        self.run("Contains", req, small, |s, r| {
            let ids = wire::ids(&r.ids)?;
            let mask = s.artifact.contains(&r.table, &ids)?;
            Ok(ContainsResponse {
                mask: mask.into_iter().map(u8::from).collect::<Vec<u8>>().into(),
            })
        })
        .await
    }

    async fn remove(&self, req: Request<RemoveRequest>) -> Answer<RemoveResponse> {
        self.refuse("Remove", &req)
    }

    async fn evict(&self, req: Request<EvictRequest>) -> Answer<RemoveResponse> {
        self.refuse("Evict", &req)
    }

    async fn dense_pull(&self, req: Request<DensePullRequest>) -> Answer<DensePullResponse> {
        self.run(
            "DensePull",
            req,
            |_| true,
            |s, r| {
                let d = wire::dtype(r.dtype)?;
                let (shape, v) = s.artifact.dense(&r.table)?;
                s.fits(v.len() * wire::width(d))?;
                let seq = s.artifact.state()?.generation;
                Ok(DensePullResponse {
                    values: wire::encode_values(&v, d),
                    dtype: d as i32,
                    shape: shape.iter().map(|&x| x as u64).collect(),
                    seq,
                    version: 0,
                })
            },
        )
        .await
    }

    async fn dense_push(&self, req: Request<DensePushRequest>) -> Answer<PushResponse> {
        self.refuse("DensePush", &req)
    }

    async fn set_lr(&self, req: Request<SetLrRequest>) -> Answer<TableInfo> {
        self.refuse("SetLr", &req)
    }

    async fn flush(&self, req: Request<FlushRequest>) -> Answer<FlushResponse> {
        self.refuse("Flush", &req)
    }

    async fn snapshot(&self, req: Request<SnapshotRequest>) -> Answer<SnapshotResponse> {
        self.refuse("Snapshot", &req)
    }

    async fn bulk_load(&self, req: Request<BulkLoadRequest>) -> Answer<BulkLoadResponse> {
        self.refuse("BulkLoad", &req)
    }

    async fn load_snapshot(
        &self,
        req: Request<LoadSnapshotRequest>,
    ) -> Answer<LoadSnapshotResponse> {
        self.refuse("LoadSnapshot", &req)
    }

    async fn clock(&self, req: Request<ClockRequest>) -> Answer<ClockResponse> {
        self.refuse("Clock", &req)
    }

    type ReplicateStream =
        tokio_stream::wrappers::ReceiverStream<std::result::Result<ReplicateMessage, Status>>;

    async fn replicate(&self, req: Request<ReplicateRequest>) -> Answer<Self::ReplicateStream> {
        self.refuse("Replicate", &req)
    }

    async fn replica_ack(&self, req: Request<ReplicaAckRequest>) -> Answer<ReplicaAckResponse> {
        self.refuse("ReplicaAck", &req)
    }

    async fn promote(&self, req: Request<PromoteRequest>) -> Answer<PromoteResponse> {
        self.refuse("Promote", &req)
    }

    async fn get_routing(&self, req: Request<GetRoutingRequest>) -> Answer<Routing> {
        // A model server holds no routing: every client's own table applies.
        self.run("GetRouting", req, |_| true, |_, _| Ok(Routing::default()))
            .await
    }

    async fn set_routing(&self, req: Request<SetRoutingRequest>) -> Answer<Routing> {
        self.refuse("SetRouting", &req)
    }

    async fn freeze_slots(&self, req: Request<FreezeSlotsRequest>) -> Answer<FreezeSlotsResponse> {
        self.refuse("FreezeSlots", &req)
    }

    async fn export_slots(&self, req: Request<ExportSlotsRequest>) -> Answer<ExportSlotsResponse> {
        self.refuse("ExportSlots", &req)
    }

    async fn drop_slots(&self, req: Request<DropSlotsRequest>) -> Answer<DropSlotsResponse> {
        self.refuse("DropSlots", &req)
    }

    async fn status(&self, req: Request<StatusRequest>) -> Answer<StatusResponse> {
        self.run(
            "Status",
            req,
            |_| true,
            |s, _| {
                let (state, tables) = s.infos()?;
                Ok(StatusResponse {
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    protocol: PROTOCOL,
                    path: s.artifact.path().display().to_string(),
                    durability: "read-only".to_string(),
                    uptime_seconds: s.started.elapsed().as_secs_f64(),
                    max_message_bytes: s.max_message as u64,
                    tables,
                    clocks: None,
                    flush_lag_seconds: 0.0,
                    role: "model".to_string(),
                    model_json: serde_json::to_string(&state)
                        .map_err(|e| Error::Internal(e.to_string()))?,
                    replication_json: String::new(),
                    rows_port: s.rows_port,
                })
            },
        )
        .await
    }
}

/// Serves the artifact read-only; ids it lacks get `fallback`. Returns once the ports are bound.
pub fn start(
    artifact: Arc<Artifact>,
    fallback: Fallback,
    config: ServerConfig,
) -> Result<ServerHandle> {
    // The artifact must be readable now, not at the first call.
    artifact.state()?;
    let rows_listener = rows::listen(&config)?;
    let rows_port = rows_listener.as_ref().map_or(Ok(0), rows::port_of)?;
    let inner = Arc::new(Inner {
        artifact,
        fallback,
        tokens: config.tokens.clone(),
        metrics: Metrics::default(),
        started: Instant::now(),
        max_message: config.max_message,
        inflight: Arc::new(AtomicUsize::new(0)),
        rows_port,
    });
    let m = Arc::clone(&inner);
    let render = Arc::new(move || {
        let (sample, extra) = m.sample();
        let mut text = m.metrics.render(&sample);
        text.push_str(&extra);
        text
    });
    let mut handle = launch(
        ModelService(Arc::clone(&inner)),
        &config,
        render,
        Arc::clone(&inner.inflight),
        None,
    )?;
    if let Some(l) = rows_listener {
        let i = Arc::clone(&inner);
        let handler: Arc<rows::Handler> = Arc::new(move |c, buf, _| i.rows_call(c, buf));
        let handlers = rows::Handlers {
            pull: handler,
            call: None,
        };
        handle.rows = Some(rows::serve(l, config.limits, config.max_message, handlers)?);
    }
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::super::Access;
    use super::*;

    #[test]
    fn access_is_only_read() {
        // The read methods need only a valid token; a read-only token is enough.
        let t = super::super::Tokens {
            write: None,
            read: Some(b"r".to_vec()),
        };
        let mut req = Request::new(());
        req.metadata_mut()
            .insert("authorization", "Bearer r".parse().unwrap());
        assert!(matches!(authenticate(&t, &req), Ok(Some(Access::Read))));
    }
}
