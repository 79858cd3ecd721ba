//! The request ids of the writes a table applied, kept in the replica with the rows they
//! changed: the flusher writes them (`applied/<table>`) in the same transaction as the rows,
//! so after a crash a retried push is recognised if its rows were committed and applied again
//! if they were not. Exactly once across restarts, for every write of a durable store (sparse
//! and dense pushes, removals, evictions).
//!
//! With several environments each one keeps its own set ([`Applied`]): the ids of the writes
//! whose rows in that environment it committed. Environments commit apart, so after a crash a
//! write may be known to some and not to others; its retry then applies the part of the
//! environments that do not know it (the server filters the ids).
//!
//! Per client, a window of [`WINDOW`] request seqs below the newest one applied (a bitmap); per
//! table, the [`CLIENTS`] clients that wrote last. A seq older than its client's window is
//! neither known applied nor known new: asking about it is an error, never a second apply.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::error::{corrupt, invalid, Result};

/// Seqs remembered below a client's newest applied one.
pub const WINDOW: u64 = 4096;

/// Clients remembered per table (those that wrote last).
pub const CLIENTS: usize = 1024;

const WORDS: usize = (WINDOW / 64) as usize;
const MAGIC: &[u8; 4] = b"PSAI";

/// The meta key of a table's applied ids.
pub fn applied_key(name: &str) -> String {
    format!("applied/{name}")
}

#[derive(Clone, PartialEq, Debug)]
struct Window {
    /// The newest seq applied.
    max: u64,
    /// When the client wrote last (a counter of the table's writes).
    touched: u64,
    /// Bit `i` set: seq `max - i` applied.
    bits: [u64; WORDS],
}

impl Window {
    fn get(&self, i: u64) -> bool {
        self.bits[(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    fn set(&mut self, i: u64) {
        self.bits[(i / 64) as usize] |= 1 << (i % 64);
    }

    /// Moves the window up by `k` seqs: bit `i` becomes bit `i + k`.
    fn shift(&mut self, k: u64) {
        if k >= WINDOW {
            self.bits = [0; WORDS];
            return;
        }
        let (w, b) = ((k / 64) as usize, (k % 64) as u32);
        for j in (0..WORDS).rev() {
            let lo = if j >= w { self.bits[j - w] } else { 0 };
            let below = if j > w { self.bits[j - w - 1] } else { 0 };
            self.bits[j] = if b == 0 {
                lo
            } else {
                (lo << b) | (below >> (64 - b))
            };
        }
    }
}

/// The applied request ids of one table.
#[derive(Default, Clone, PartialEq, Debug)]
pub struct AppliedIds {
    clients: HashMap<u64, Window>,
    writes: u64,
}

impl AppliedIds {
    /// Whether `(client, seq)` was applied; an error when the seq is older than the client's
    /// window (whether it applied is not known).
    pub fn contains(&self, client: u64, seq: u64) -> Result<bool> {
        let Some(w) = self.clients.get(&client) else {
            return Ok(false);
        };
        if seq > w.max {
            return Ok(false);
        }
        let i = w.max - seq;
        if i >= WINDOW {
            return Err(invalid(format!(
                "request {client:#x}/{seq} is more than {WINDOW} requests older than the \
                 newest this table applied from that client: whether it was applied is not \
                 known, so it is not applied"
            )));
        }
        Ok(w.get(i))
    }

    /// Records that `(client, seq)` was applied.
    pub fn insert(&mut self, client: u64, seq: u64) {
        self.writes += 1;
        let writes = self.writes;
        let w = self.clients.entry(client).or_insert(Window {
            max: seq,
            touched: writes,
            bits: [0; WORDS],
        });
        w.touched = writes;
        if seq > w.max {
            w.shift(seq - w.max);
            w.max = seq;
        }
        let i = w.max - seq;
        if i < WINDOW {
            w.set(i);
        }
        if self.clients.len() > CLIENTS {
            if let Some(old) = self
                .clients
                .iter()
                .min_by_key(|(_, w)| w.touched)
                .map(|(c, _)| *c)
            {
                self.clients.remove(&old);
            }
        }
    }

    /// The bytes kept in the replica.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(12 + self.clients.len() * (24 + WORDS * 8));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.writes.to_le_bytes());
        let mut clients: Vec<_> = self.clients.iter().collect();
        clients.sort_by_key(|(c, _)| **c);
        for (c, w) in clients {
            out.extend_from_slice(&c.to_le_bytes());
            out.extend_from_slice(&w.max.to_le_bytes());
            out.extend_from_slice(&w.touched.to_le_bytes());
            for b in &w.bits {
                out.extend_from_slice(&b.to_le_bytes());
            }
        }
        out
    }

    /// Reads what [`encode`](Self::encode) wrote; `what` names it in the error.
    pub fn decode(b: &[u8], what: &str) -> Result<Self> {
        let bad = || corrupt(format!("{what}: not a list of applied request ids"));
        let per = 24 + WORDS * 8;
        if b.len() < 12 || &b[..4] != MAGIC || !(b.len() - 12).is_multiple_of(per) {
            return Err(bad());
        }
        let u = |x: &[u8]| u64::from_le_bytes(x.try_into().expect("8 bytes"));
        let mut out = Self {
            clients: HashMap::new(),
            writes: u(&b[4..12]),
        };
        for c in b[12..].chunks_exact(per) {
            let mut bits = [0u64; WORDS];
            for (k, x) in bits.iter_mut().enumerate() {
                *x = u(&c[24 + k * 8..32 + k * 8]);
            }
            out.clients.insert(
                u(&c[..8]),
                Window {
                    max: u(&c[8..16]),
                    touched: u(&c[16..24]),
                    bits,
                },
            );
        }
        Ok(out)
    }
}

/// A table's applied request ids, one set per environment of its store's replica (one for an
/// in-memory store), and whether they changed since the flusher took them.
pub struct Applied(Mutex<(Vec<AppliedIds>, bool)>);

impl Default for Applied {
    fn default() -> Self {
        Self(Mutex::new((vec![AppliedIds::default()], false)))
    }
}

impl Applied {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<AppliedIds>, bool)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps one set per environment of a replica with `n` environments.
    pub(crate) fn set_environments(&self, n: usize) {
        let mut a = self.lock();
        let first = a.0[0].clone();
        a.0.resize(n.max(1), first);
    }

    /// Records that `(client, seq)` was applied, in every environment (call under the change
    /// hold of the write that applied it, so a flush takes both or neither).
    pub(crate) fn note(&self, client: u64, seq: u64) {
        let mut a = self.lock();
        for ids in a.0.iter_mut() {
            ids.insert(client, seq);
        }
        a.1 = true;
    }

    /// Per environment, whether `(client, seq)` was applied there (an error when it is older
    /// than what the table remembers of its client).
    pub fn check(&self, client: u64, seq: u64) -> Result<Vec<bool>> {
        self.lock()
            .0
            .iter()
            .map(|ids| ids.contains(client, seq))
            .collect()
    }

    /// The sets to write, one per environment, if they changed since the last take (call
    /// while holding changes off, so they match the rows taken).
    pub(crate) fn take(&self) -> Option<Vec<Vec<u8>>> {
        let mut a = self.lock();
        if !a.1 {
            return None;
        }
        a.1 = false;
        Some(a.0.iter().map(AppliedIds::encode).collect())
    }

    /// Marks the sets to be written again (a write that took them failed).
    pub(crate) fn untake(&self) {
        self.lock().1 = true;
    }

    /// Loads the sets a durable store kept, one per environment (`None`: the environment
    /// kept none, as stores written before environments kept their own: it takes the first
    /// environment's).
    pub(crate) fn load(&self, kept: &[Option<Vec<u8>>], what: &str) -> Result<()> {
        let mut sets = Vec::with_capacity(kept.len());
        for (k, b) in kept.iter().enumerate() {
            sets.push(match b {
                Some(b) => Some(AppliedIds::decode(b, &format!("{what} (environment {k})"))?),
                None => None,
            });
        }
        let first = sets.first().cloned().flatten().unwrap_or_default();
        let sets: Vec<AppliedIds> = sets
            .into_iter()
            .map(|s| s.unwrap_or_else(|| first.clone()))
            .collect();
        let mut a = self.lock();
        if !sets.is_empty() {
            a.0 = sets;
        }
        a.1 = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_in_the_window_are_known_and_older_ones_refused() {
        let mut a = AppliedIds::default();
        for s in [5, 3, 9, 70, 200] {
            a.insert(1, s);
        }
        for s in [5, 3, 9, 70, 200] {
            assert!(a.contains(1, s).unwrap(), "{s}");
        }
        for s in [4, 6, 71, 199, 201] {
            assert!(!a.contains(1, s).unwrap(), "{s}");
        }
        assert!(!a.contains(2, 5).unwrap());
        a.insert(1, 200 + WINDOW);
        assert!(!a.contains(1, 201).unwrap() && a.contains(1, 200 + WINDOW).unwrap());
        assert!(a.contains(1, 200).is_err());
        let back = AppliedIds::decode(&a.encode(), "t").unwrap();
        assert_eq!(back, a);
        assert!(AppliedIds::decode(b"PSAI", "t").is_err());
    }

    #[test]
    fn shifting_keeps_every_bit() {
        for k in [1, 63, 64, 65, 130, 4000] {
            let mut a = AppliedIds::default();
            for s in (0..100).step_by(3) {
                a.insert(7, 1000 + s);
            }
            a.insert(7, 1099 + k);
            for s in 0..100u64 {
                let want = s % 3 == 0 && 1099 + k - (1000 + s) < WINDOW;
                assert_eq!(a.contains(7, 1000 + s).unwrap_or(false), want, "{k} {s}");
            }
        }
    }

    #[test]
    fn environments_keep_their_own_sets() {
        let a = Applied::default();
        a.set_environments(3);
        a.note(1, 5);
        assert_eq!(a.check(1, 5).unwrap(), vec![true, true, true]);
        let kept = a.take().unwrap();
        assert!(a.take().is_none());
        // Environment 1 committed a later write, the others did not.
        let b = Applied::default();
        let mut later = AppliedIds::decode(&kept[1], "t").unwrap();
        later.insert(1, 6);
        b.load(&[Some(kept[0].clone()), Some(later.encode()), None], "t")
            .unwrap();
        assert_eq!(b.check(1, 6).unwrap(), vec![false, true, false]);
        assert_eq!(b.check(1, 5).unwrap(), vec![true, true, true]);
        b.note(1, 6);
        assert_eq!(b.check(1, 6).unwrap(), vec![true, true, true]);
        assert!(b.load(&[Some(b"PSAI".to_vec())], "t").is_err());
    }

    #[test]
    fn the_oldest_clients_are_forgotten() {
        let mut a = AppliedIds::default();
        for c in 0..(CLIENTS as u64 + 1) {
            a.insert(c, 1);
        }
        assert!(!a.contains(0, 1).unwrap());
        assert!(a.contains(CLIENTS as u64, 1).unwrap());
    }
}
