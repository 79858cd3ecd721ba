//! What the client remembers so that staleness is counted from a batch's own pull and a push
//! that failed on some servers is retried only where it did not apply.
//!
//! * Versions per batch: a pull records, under a digest of its table and ids, the table version
//!   each server answered; a later push of the same ids (the batch's gradients) takes it, so
//!   several pulls may be in flight (prefetch) and each push carries the version of its own
//!   pull. A push may also carry a version given explicitly (`pull_versioned`).
//! * Request ids per failed push: a push that failed on some server keeps the request ids of
//!   all its parts under a digest of its table, ids and gradients; the same call made again
//!   reuses them, so the servers that applied their part answer from their memory of request
//!   ids and only the missing parts apply.
//!
//! Both memories are bounded (oldest forgotten first): [`REMEMBERED_BATCHES`] pulls and
//! [`REMEMBERED_FAILURES`] failed pushes.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use super::ports::PushSource;
use super::Client;
use crate::error::{Error, Result};
use crate::hash::mix64;
use crate::net::proto::*;
use crate::net::wire;

/// Pulls whose versions are remembered for their pushes.
pub const REMEMBERED_BATCHES: usize = 4096;

/// Failed pushes whose request ids are remembered for their retry.
pub const REMEMBERED_FAILURES: usize = 1024;

type Key = (String, u64);

/// A bounded map, oldest entries forgotten first.
struct Bounded<T> {
    map: HashMap<Key, T>,
    order: VecDeque<Key>,
    cap: usize,
}

impl<T> Bounded<T> {
    fn new(cap: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap,
        }
    }

    fn put(&mut self, k: Key, v: T) {
        if self.map.insert(k.clone(), v).is_none() {
            self.order.push_back(k);
        }
        while self.map.len() > self.cap {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        if self.order.len() > 2 * self.cap {
            // Keys taken out by `take` linger in `order`; drop them now and then.
            let map = &self.map;
            self.order.retain(|k| map.contains_key(k));
        }
    }

    fn take(&mut self, k: &Key) -> Option<T> {
        self.map.remove(k)
    }
}

/// A failed push's request ids (one per part, in the order of the parts) and the versions it
/// was sent with.
type Failed = (Vec<RequestId>, Option<Vec<u64>>);

/// The client's memories of pulls and failed pushes.
pub(crate) struct Memo {
    versions: Mutex<Bounded<Vec<u64>>>,
    failed: Mutex<Bounded<Failed>>,
}

impl Default for Memo {
    fn default() -> Self {
        Self {
            versions: Mutex::new(Bounded::new(REMEMBERED_BATCHES)),
            failed: Mutex::new(Bounded::new(REMEMBERED_FAILURES)),
        }
    }
}

/// A digest of `xs` (each as `word` makes it a u64) after `seed`. Eight chains of multiplies
/// run side by side, each over every eighth element, and are folded in order at the end: one
/// chain waits a multiply's latency an element, eight keep the multiplier busy (a pull of
/// 65536 ids took its digest in a third of a millisecond with one chain, after the rows came).
fn digest<T: Copy>(seed: u64, xs: &[T], word: impl Fn(T) -> u64) -> u64 {
    const STEP: u64 = 0x9e37_79b9_7f4a_7c15;
    const LANES: usize = 8;
    let mut lanes = [0u64; LANES];
    for (i, l) in lanes.iter_mut().enumerate() {
        *l = mix64(seed ^ (i as u64 + 1).wrapping_mul(STEP));
    }
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = mix64(*l ^ word(x)).wrapping_add(STEP);
        }
    }
    let mut h = seed;
    for x in lanes
        .into_iter()
        .chain(chunks.remainder().iter().map(|&x| word(x)))
    {
        h = mix64(h ^ x).wrapping_add(STEP);
    }
    h
}

fn ids_digest(ids: &[u64]) -> u64 {
    digest(ids.len() as u64, ids, |x| x)
}

fn push_digest(ids: &[u64], grads: &[f32]) -> u64 {
    digest(ids_digest(ids), grads, |g| u64::from(g.to_bits()))
}

impl Client {
    /// Remembers the versions a pull of `ids` read, for the push of the same batch.
    pub(crate) fn remember_versions(&self, table: &str, ids: &[u64], versions: Vec<u64>) {
        let mut m = self.memo.versions.lock().unwrap_or_else(|e| e.into_inner());
        m.put((table.to_string(), ids_digest(ids)), versions);
    }

    /// Sends one push, every server getting a part (a part without ids where the batch has
    /// none there, so every server's table version counts the push), and reports which parts
    /// applied if some fail. `version` is the pulled version per server (None: the one a pull
    /// of the same ids recorded, if any). A push of no ids is not a push: nothing is sent, no
    /// version or counter moves (as on the embedded store).
    pub(crate) fn push_parts(
        &self,
        table: &str,
        dim: usize,
        ids: &[u64],
        grads: &[f32],
        version: Option<Vec<u64>>,
    ) -> Result<()> {
        self.check_grads(table, grads, dim)?;
        let route = self.route();
        let n = route.servers.len();
        let changed = self.list_changes.load(std::sync::atomic::Ordering::Relaxed) > 0;
        // A version vector of a pull before the list changed fits no position now: the push
        // goes without one (its staleness is not counted).
        let version = version.filter(|v| v.len() == n || !changed);
        if let Some(v) = &version {
            if v.len() != n {
                return Err(crate::error::invalid(format!(
                    "table {table:?}: version has {} entries, this client has {n} servers \
                     (pass the version a pull of this client returned)",
                    v.len()
                )));
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        // The digest reads every gradient (a chain of multiplies: at 65536 x 64 it cost more
        // than sending them), so it is taken only when a failed push is remembered or this one
        // fails.
        let key = || (table.to_string(), push_digest(ids, grads));
        let retry = {
            let mut f = self.memo.failed.lock().unwrap_or_else(|e| e.into_inner());
            if f.map.is_empty() {
                None
            } else {
                f.take(&key())
            }
        };
        let version = match (version, &retry) {
            (Some(v), _) => Some(v),
            (None, Some((_, v))) => v.clone(),
            (None, None) => {
                let mut m = self.memo.versions.lock().unwrap_or_else(|e| e.into_inner());
                m.take(&(table.to_string(), ids_digest(ids)))
            }
        }
        .filter(|v| v.len() == n);
        let home = self.dense_home(table);
        let d = self.config.wire;
        let (job, worker, step) = self
            .step_tag()
            .map_or((String::new(), 0, None), |(j, w, s)| (j, w, Some(s)));
        // A push to store servers that serve rows ports goes there (decision 0129).
        let ports = self.push_ports(&route);
        let mut targets = Vec::new();
        for (i, pos) in route.table.split(ids).into_iter().enumerate() {
            let mut chunks = self.chunks(&pos, 8 + dim * wire::width(d));
            // A server that owns no slot (one being emptied to leave) holds no row to count for.
            if chunks.is_empty() && route.owns_slots[i] {
                chunks.push(Vec::new());
            }
            for (k, c) in chunks.into_iter().enumerate() {
                targets.push((
                    i,
                    PushRequest {
                        ack_all: self.config.ack_all,
                        table: table.to_string(),
                        // Written from `src` by the part's route (below).
                        ids: bytes::Bytes::new(),
                        grads: bytes::Bytes::new(),
                        dtype: d as i32,
                        request_id: None,
                        pulled_seq: None,
                        pulled_version: version.as_ref().and_then(|v| v.get(i).copied()),
                        continued: k > 0,
                        uncounted: i != home || k > 0,
                        version_only: c.is_empty(),
                        step,
                        job: job.clone(),
                        worker,
                        split_from: Vec::new(),
                        pad: bytes::Bytes::new(),
                    },
                    c,
                ));
            }
        }
        let reuse = retry.map(|(r, _)| r).filter(|r| r.len() == targets.len());
        let rids: Vec<RequestId> = match reuse {
            Some(r) => r,
            None => (0..targets.len()).filter_map(|_| self.next_id()).collect(),
        };
        for ((_, m, _), r) in targets.iter_mut().zip(&rids) {
            m.request_id = Some(*r);
        }
        let src = PushSource {
            ids,
            grads,
            dim,
            dtype: d,
        };
        // Parts refused as moved go again, split by the new table (`reshard.rs`).
        let (mut results, targets) = match &ports {
            Some(p) => self.push_on_ports(p, &route, targets, &src),
            None => (
                Vec::new(),
                targets
                    .into_iter()
                    .map(|(i, m, pos)| (i, src.fill(m, &pos)))
                    .collect(),
            ),
        };
        if !targets.is_empty() {
            results.extend(self.rt.block_on(self.send_push_parts(targets, &route, dim)));
        }
        // Each server's parts applied (true) or not (false), in the order first met.
        let mut ok: Vec<(String, bool)> = Vec::new();
        let mut first_err = None;
        for (name, r) in results {
            let applied = r.is_ok();
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
            match ok.iter_mut().find(|(n, _)| *n == name) {
                Some((_, a)) => *a &= applied,
                None => ok.push((name, applied)),
            }
        }
        let Some(err) = first_err else {
            return Ok(());
        };
        {
            let mut f = self.memo.failed.lock().unwrap_or_else(|e| e.into_inner());
            f.put(key(), (rids, version));
        }
        // An error that is the caller's (a bad gradient, an unknown table) applied nowhere.
        if !ok.iter().any(|x| x.1) || !matches!(err, Error::Remote { .. } | Error::Storage(_)) {
            return Err(err);
        }
        let name = |want: bool| -> Vec<String> {
            ok.iter()
                .filter(|x| x.1 == want)
                .map(|x| x.0.clone())
                .collect()
        };
        let (applied, failed) = (name(true), name(false));
        Err(Error::PartialPush {
            message: format!(
                "push to table {table:?}: the parts of {} were applied, those of {} were not \
                 ({err}); calling push again with the same ids and gradients sends only the \
                 missing parts",
                applied.join(", "),
                failed.join(", ")
            ),
            applied,
            failed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_forgets_the_oldest() {
        let mut b = Bounded::new(2);
        for i in 0..3u64 {
            b.put(("t".to_string(), i), i);
        }
        assert_eq!(b.take(&("t".to_string(), 0)), None);
        assert_eq!(b.take(&("t".to_string(), 2)), Some(2));
        assert_eq!(b.take(&("t".to_string(), 2)), None);
    }

    #[test]
    fn digests_tell_batches_apart() {
        assert_ne!(ids_digest(&[1, 2]), ids_digest(&[2, 1]));
        assert_ne!(ids_digest(&[]), ids_digest(&[0]));
        assert_ne!(push_digest(&[1], &[1.0]), push_digest(&[1], &[2.0]));
        assert_eq!(push_digest(&[1], &[1.0]), push_digest(&[1], &[1.0]));
        // Batches past the eight chains: any two positions swapped, in one chain or in two,
        // in the chains or in the tail, and one id changed, make another digest.
        for n in [8usize, 9, 16, 23, 64] {
            let ids: Vec<u64> = (0..n as u64).map(|i| i * 7 + 3).collect();
            let d = ids_digest(&ids);
            assert_eq!(d, ids_digest(&ids.clone()));
            let mut seen = std::collections::HashSet::from([d]);
            for i in 0..n {
                for j in i + 1..n {
                    let mut s = ids.clone();
                    s.swap(i, j);
                    assert!(seen.insert(ids_digest(&s)), "n {n}: swapping {i} and {j}");
                }
                let mut c = ids.clone();
                c[i] ^= 1 << (i % 64);
                assert!(seen.insert(ids_digest(&c)), "n {n}: id {i} changed");
            }
            assert_ne!(ids_digest(&ids[..n - 1]), d);
        }
    }
}
