//! Pulls and pushes on the servers' rows ports (`rows.rs`; decisions 0120, 0128, 0129).
//!
//! A list of one server (a model server or a store server) or of several store servers, every
//! one of them a single member (no replica group; not over TLS) serving a rows port: each
//! server's part goes on its own port, the first server's on the calling thread and the others'
//! at once on the runtime's blocking threads. A pull any port did not answer with rows goes
//! over gRPC whole; a push part any port did not apply goes over gRPC with its request id.

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{error_of, reshard, rows, Client, Server};
use crate::error::{shape, Result};
use crate::net::proto::{Dtype, PushRequest, PushResponse, StatusRequest, StatusResponse};
use crate::net::wire;

/// How long a server whose status could not be read is not asked again for its rows port.
const ASK_AGAIN: Duration = Duration::from_secs(5);

/// What a client knows of a server's rows port.
#[derive(Clone)]
pub(super) enum RowsPort {
    /// Read from its status: the port, or None when calls to it use none (it serves none, is a
    /// replica group, or is reached over TLS).
    Known(Option<Arc<rows::Endpoint>>),
    /// Its status could not be read then; asked again after [`ASK_AGAIN`].
    Unanswered(Instant),
}

/// The answers to the parts of a push, each with the name of the server that answered it.
pub(super) type PushResults = Vec<(String, Result<PushResponse>)>;

/// The metadata a gRPC call by `route` to its server `i` carries (`Client::request`,
/// `Group::stamp`), as text for that server's rows port.
fn rows_meta(route: &reshard::Route, i: usize) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = [
        (crate::server::layout::LAYOUT_KEY, &route.layout),
        (crate::server::routing::EPOCH_KEY, &route.epoch),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v.to_str().ok()?.to_string())))
    .collect();
    if let Some(s) = route.servers.get(i) {
        let e = s.group.epoch();
        if e > 0 {
            out.push((crate::server::fence::EPOCH_KEY, e.to_string()));
        }
    }
    out
}

fn borrowed<'a>(meta: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    meta.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// How one server's part of a pull is asked for: its ids in requests of at most `per` ids.
#[derive(Clone)]
struct PullPart {
    table: String,
    token: Option<String>,
    dtype: Dtype,
    dim: usize,
    per: usize,
    timeout: Duration,
}

impl PullPart {
    /// Pulls `ids` on `port` into `out` (`ids.len() * dim` floats). An empty batch is one
    /// (empty) request: its answer tells the generation.
    fn pull(
        &self,
        port: &rows::Endpoint,
        meta: &[(&str, &str)],
        ids: &[u64],
        out: &mut [MaybeUninit<f32>],
    ) -> rows::Pulled {
        let per = self.per.max(1);
        let asks: Vec<rows::Ask<'_>> = (0..ids.len().div_ceil(per).max(1))
            .map(|k| rows::Ask {
                table: &self.table,
                token: self.token.as_deref(),
                dtype: self.dtype,
                ids: &ids[(k * per).min(ids.len())..((k + 1) * per).min(ids.len())],
                dim: self.dim,
                meta,
            })
            .collect();
        port.pull(&asks, out, self.timeout)
    }

    /// [`pull`](Self::pull) into a buffer of its own: the generation read and the rows, or
    /// None when the port did not answer rows.
    fn pull_owned(
        &self,
        port: &rows::Endpoint,
        meta: &[(&str, &str)],
        ids: &[u64],
    ) -> Option<(u64, Vec<f32>)> {
        let n = ids.len() * self.dim;
        let mut buf: Vec<f32> = Vec::with_capacity(n);
        match self.pull(port, meta, ids, &mut buf.spare_capacity_mut()[..n]) {
            rows::Pulled::Rows(g) => {
                // SAFETY: a pull that answered rows wrote every float of its output.
                unsafe { buf.set_len(n) };
                Some((g, buf))
            }
            _ => None,
        }
    }
}

/// Work for one server of a list, run by [`Client::at_once`].
type Job<R> = Box<dyn FnOnce() -> Option<R> + Send>;

impl Client {
    /// Runs each server's job at once: the first on the calling thread, the others on the
    /// runtime's blocking threads (kept between calls, so none is started per call). Each
    /// position with its job's result (None: the job failed or panicked).
    fn at_once<R: Send + 'static>(
        &self,
        mut jobs: Vec<(usize, Job<R>)>,
    ) -> Vec<(usize, Option<R>)> {
        if jobs.is_empty() {
            return Vec::new();
        }
        let (i0, first) = jobs.remove(0);
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(i, job)| (i, self.rt.spawn_blocking(job)))
            .collect();
        let mut out = vec![(i0, first())];
        out.extend(
            self.rt.block_on(super::futures_join_all(
                handles
                    .into_iter()
                    .map(|(i, h)| async move { (i, h.await.ok().flatten()) }),
            )),
        );
        out
    }

    /// The rows port of server `s` as its status `st` names it: one for calls that go to it
    /// (not over TLS: the port is plain TCP; not to a replica group, whose pulls may go to
    /// followers and whose primary may change).
    pub(super) fn port_of_status(
        &self,
        s: &Server,
        st: &StatusResponse,
    ) -> Option<Arc<rows::Endpoint>> {
        ((st.role == "model" || st.role == "store")
            && st.rows_port != 0
            && self.config.tls_ca.is_none()
            && s.group.members.len() == 1)
            .then(|| {
                Arc::new(rows::Endpoint::new(
                    &s.name,
                    st.rows_port,
                    st.role == "store",
                ))
            })
    }

    /// The rows ports of `route`'s servers, when every one of them serves one in use (several
    /// servers: store servers only). A server first met after `connect` (one that joined the
    /// list) is asked its status once; while it does not answer, again after [`ASK_AGAIN`]
    /// (its calls go over gRPC meanwhile).
    fn ports_of(&self, route: &reshard::Route) -> Option<Vec<Arc<rows::Endpoint>>> {
        let mut ports = Vec::with_capacity(route.servers.len());
        for s in &route.servers {
            let known = self
                .rows
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&s.name)
                .cloned();
            let port = match known {
                Some(RowsPort::Known(p)) => p,
                Some(RowsPort::Unanswered(t)) if t.elapsed() < ASK_AGAIN => return None,
                _ => {
                    let st = self.rt.block_on(self.call_server(
                        s,
                        None,
                        StatusRequest {},
                        self.config.timeout,
                        true,
                        false,
                        |mut c, r| async move { c.status(r).await },
                    ));
                    let p = st.ok().map(|st| self.port_of_status(s, &st));
                    let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
                    match (rows.get(&s.name), p) {
                        // Another call read its status meanwhile.
                        (Some(RowsPort::Known(known)), _) => known.clone(),
                        (_, Some(p)) => {
                            rows.insert(s.name.clone(), RowsPort::Known(p.clone()));
                            p
                        }
                        (_, None) => {
                            rows.insert(s.name.clone(), RowsPort::Unanswered(Instant::now()));
                            return None;
                        }
                    }
                }
            };
            ports.push(port.filter(|p| p.usable())?);
        }
        (!ports.is_empty() && (ports.len() == 1 || ports.iter().all(|p| p.store))).then_some(ports)
    }

    /// A pull on the rows ports of `route`'s servers, each server's ids in requests of at most
    /// `per` ids one after the other on one connection: `None` when they do not all serve one
    /// or a port did not answer rows (the caller then pulls over gRPC and writes every row
    /// again; a model server's refusal is the caller's error), else the pull's result with the
    /// oldest version each server's parts read (as over gRPC).
    pub(super) fn pull_rows_ports(
        &self,
        table: &str,
        dim: usize,
        route: &reshard::Route,
        ids: &[u64],
        out: &mut [MaybeUninit<f32>],
        per: usize,
    ) -> Option<Result<Vec<u64>>> {
        let ports = self.ports_of(route)?;
        let part = PullPart {
            table: table.to_string(),
            token: self.config.token.clone(),
            dtype: self.config.wire,
            dim,
            per,
            timeout: self.config.timeout,
        };
        if ports.len() == 1 {
            let (port, name) = (&ports[0], &route.servers[0].name);
            // A model server reads no metadata.
            let owned = if port.store {
                rows_meta(route, 0)
            } else {
                Vec::new()
            };
            let generation = match part.pull(port, &borrowed(&owned), ids, out) {
                rows::Pulled::Transport => return None,
                // A store server's refusal: the same pull over gRPC meets it and handles it
                // (a "moved" routing refresh, a retry), writing every row again.
                rows::Pulled::Failed(_) | rows::Pulled::Dim(_) if port.store => return None,
                rows::Pulled::Failed(s) => return Some(Err(error_of(&s, name))),
                rows::Pulled::Dim(got) => {
                    return Some(Err(shape(format!(
                        "table {table:?} has dim {got} on server {name}, the client expected \
                         {dim}"
                    ))))
                }
                rows::Pulled::Rows(g) => g,
            };
            // A store server's table version, remembered for the push of the same ids as
            // `pull_routed` does. Not a model server's generation: it refuses every push, and
            // hashing the batch's ids cost a tenth of this path's client CPU.
            if port.store {
                self.remember_versions(table, ids, vec![generation]);
            }
            return Some(Ok(vec![generation]));
        }
        // Several store servers: each server's ids gathered, pulled into a buffer of its own
        // on its port, then scattered into `out`. A server that owns slots but none of these
        // ids still answers its version (as over gRPC); one that owns none is not asked.
        let split = route.table.split(ids);
        let jobs = split
            .iter()
            .enumerate()
            .filter(|&(i, pos)| !pos.is_empty() || route.owns_slots[i])
            .map(|(i, pos)| {
                let g: Vec<u64> = pos.iter().map(|&p| ids[p as usize]).collect();
                let (port, part, meta) = (Arc::clone(&ports[i]), part.clone(), rows_meta(route, i));
                let job: Job<(u64, Vec<f32>)> =
                    Box::new(move || part.pull_owned(&port, &borrowed(&meta), &g));
                (i, job)
            })
            .collect();
        let answers = self.at_once(jobs);
        let mut versions = vec![u64::MAX; ports.len()];
        for (i, a) in answers {
            let (g, buf) = a?;
            for (j, &p) in split[i].iter().enumerate() {
                let (src, at) = (&buf[j * dim..(j + 1) * dim], p as usize * dim);
                for (o, &x) in out[at..at + dim].iter_mut().zip(src) {
                    o.write(x);
                }
            }
            versions[i] = g;
        }
        self.remember_versions(table, ids, versions.clone());
        Some(Ok(versions))
    }

    /// The rows ports a push by `route` goes to: its servers', when each serves one in use
    /// and is a store server.
    pub(super) fn push_ports(&self, route: &reshard::Route) -> Option<Vec<Arc<rows::Endpoint>>> {
        self.ports_of(route).filter(|p| p.iter().all(|p| p.store))
    }

    /// Sends the parts of a push (`targets`, each for a server of `route`, with the positions
    /// of `src`'s ids it carries) on the servers' rows ports (`ports`, by position), each
    /// server's parts on one connection without waiting for the answers between them, the
    /// servers at once: the answers they gave, and the parts they did not apply (refused, or
    /// the transport failed), with their ids and gradients, which the caller sends over gRPC
    /// with the same request ids, whose retries, routing refreshes and failover handle them (a
    /// part a port applied but whose answer was lost is answered from the server's record of
    /// request ids, not applied again).
    ///
    /// A list of one server is pushed on the calling thread, each part's ids and gradients
    /// written to the socket straight from `src` when they are a run of it in float32 (the
    /// batch in order, cut by the message limit): no copy of the gradients on the client.
    pub(super) fn push_on_ports(
        &self,
        ports: &[Arc<rows::Endpoint>],
        route: &reshard::Route,
        targets: Vec<(usize, PushRequest, Vec<u32>)>,
        src: &PushSource<'_>,
    ) -> (PushResults, Vec<(usize, PushRequest)>) {
        if ports.len() == 1 && route.servers.len() == 1 {
            return self.push_on_one_port(&ports[0], route, targets, src);
        }
        let targets: Vec<(usize, PushRequest)> = targets
            .into_iter()
            .map(|(i, m, pos)| (i, src.fill(m, &pos)))
            .collect();
        let mut by_server: Vec<Vec<(usize, PushRequest)>> = vec![Vec::new(); ports.len()];
        let mut left = Vec::new();
        for t in targets {
            match by_server.get_mut(t.0) {
                Some(parts) => parts.push(t),
                None => left.push(t),
            }
        }
        let jobs = by_server
            .iter()
            .enumerate()
            .filter(|(_, parts)| !parts.is_empty())
            .map(|(i, parts)| {
                let msgs: Vec<PushRequest> = parts.iter().map(|(_, m)| m.clone()).collect();
                let (port, meta) = (Arc::clone(&ports[i]), rows_meta(route, i));
                let (token, timeout) = (self.config.token.clone(), self.config.timeout);
                let job: Job<Vec<std::result::Result<PushResponse, tonic::Status>>> =
                    Box::new(move || {
                        let views: Vec<rows::PushPart<'_>> = msgs
                            .iter()
                            .map(|m| rows::PushPart {
                                msg: m,
                                ids: &m.ids,
                                grads: &m.grads,
                            })
                            .collect();
                        port.push(&views, token.as_deref(), &borrowed(&meta), timeout)
                    });
                (i, job)
            })
            .collect();
        let mut answered: Vec<Option<_>> = vec![None; ports.len()];
        for (i, a) in self.at_once(jobs) {
            answered[i] = a;
        }
        let mut done = Vec::new();
        for ((parts, answers), server) in by_server.into_iter().zip(answered).zip(&route.servers) {
            match answers {
                None => left.extend(parts),
                Some(answers) => {
                    for (t, a) in parts.into_iter().zip(answers) {
                        match a {
                            Ok(r) => done.push((server.name.clone(), Ok(r))),
                            Err(_) => left.push(t),
                        }
                    }
                }
            }
        }
        (done, left)
    }

    /// [`push_on_ports`](Self::push_on_ports) for a list of one server, on the calling thread.
    fn push_on_one_port(
        &self,
        port: &rows::Endpoint,
        route: &reshard::Route,
        targets: Vec<(usize, PushRequest, Vec<u32>)>,
        src: &PushSource<'_>,
    ) -> (PushResults, Vec<(usize, PushRequest)>) {
        // A part's bytes: a run of `src` where they can be, else gathered here.
        let bytes: Vec<_> = targets
            .iter()
            .map(|(_, _, pos)| match src.run(pos) {
                Some((ids, grads)) => (Cow::Borrowed(ids), Cow::Borrowed(grads)),
                None => (
                    Cow::Owned(wire::encode_ids_at(src.ids, pos).into()),
                    Cow::Owned(wire::encode_rows_at(src.grads, src.dim, pos, src.dtype).into()),
                ),
            })
            .collect();
        let parts: Vec<rows::PushPart<'_>> = targets
            .iter()
            .zip(&bytes)
            .map(|((_, m, _), (ids, grads))| rows::PushPart { msg: m, ids, grads })
            .collect();
        let meta = rows_meta(route, 0);
        let token = self.config.token.as_deref();
        let answers = port.push(&parts, token, &borrowed(&meta), self.config.timeout);
        drop(parts);
        let mut done = Vec::new();
        let mut left = Vec::new();
        let name = &route.servers[0].name;
        match answers {
            Some(answers) => {
                for ((i, m, pos), a) in targets.into_iter().zip(answers) {
                    match a {
                        Ok(r) => done.push((name.clone(), Ok(r))),
                        Err(_) => left.push((i, src.fill(m, &pos))),
                    }
                }
            }
            None => left.extend(
                targets
                    .into_iter()
                    .map(|(i, m, pos)| (i, src.fill(m, &pos))),
            ),
        }
        (done, left)
    }
}

/// A push's ids and gradients (`dim` floats an id, sent as `dtype`), which its parts carry by
/// position.
pub(super) struct PushSource<'a> {
    pub(super) ids: &'a [u64],
    pub(super) grads: &'a [f32],
    pub(super) dim: usize,
    pub(super) dtype: Dtype,
}

impl PushSource<'_> {
    /// `m` with the ids and gradients at positions `pos`.
    pub(super) fn fill(&self, mut m: PushRequest, pos: &[u32]) -> PushRequest {
        m.ids = wire::encode_ids_at(self.ids, pos);
        m.grads = wire::encode_rows_at(self.grads, self.dim, pos, self.dtype);
        m
    }

    /// The wire bytes of the ids and gradients at `pos`, when they are a run of positions and
    /// the wire carries the floats as they are (float32, little-endian): slices of the batch.
    fn run(&self, pos: &[u32]) -> Option<(&[u8], &[u8])> {
        if self.dtype != Dtype::Float32 || cfg!(target_endian = "big") {
            return None;
        }
        if pos.windows(2).any(|w| w[0].checked_add(1) != Some(w[1])) {
            return None;
        }
        let a = pos.first().map_or(0, |&a| a as usize);
        let b = a + pos.len();
        let ids = &self.ids[a..b];
        let grads = &self.grads[a * self.dim..b * self.dim];
        // SAFETY: u64 and f32 memory is valid as bytes; the lengths are in bytes.
        Some(unsafe {
            (
                std::slice::from_raw_parts(ids.as_ptr().cast::<u8>(), ids.len() * 8),
                std::slice::from_raw_parts(grads.as_ptr().cast::<u8>(), grads.len() * 4),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_part_is_sent_from_the_batch_only_when_it_is_a_float32_run_of_it() {
        let ids: Vec<u64> = (0..6).map(|i| 100 + i).collect();
        let grads: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let src = |dtype| PushSource {
            ids: &ids,
            grads: &grads,
            dim: 2,
            dtype,
        };
        let f32s = src(Dtype::Float32);
        let (i, g) = f32s.run(&[2, 3, 4]).unwrap();
        assert_eq!(i, &wire::encode_ids_at(&ids, &[2, 3, 4])[..]);
        assert_eq!(
            g,
            &wire::encode_rows_at(&grads, 2, &[2, 3, 4], Dtype::Float32)[..]
        );
        assert_eq!(f32s.run(&[]).map(|(i, g)| (i.len(), g.len())), Some((0, 0)));
        for not_a_run in [
            &[4u32, 3][..],
            &[1, 3],
            &[3, 2, 4],
            &[0, 1, 1],
            &[0, 2, 1, 3],
        ] {
            assert!(f32s.run(not_a_run).is_none(), "{not_a_run:?}");
        }
        assert!(src(Dtype::Bfloat16).run(&[0, 1]).is_none());
        // What goes over gRPC instead carries the same bytes.
        let m = f32s.fill(PushRequest::default(), &[2, 3, 4]);
        assert_eq!((&m.ids[..], &m.grads[..]), (i, g));
    }
}
