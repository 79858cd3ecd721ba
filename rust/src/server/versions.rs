//! Table versions: the clock that staleness is counted on.
//!
//! A table's version on a server is the number of pushes of that table the server received
//! (applied or dropped). A pstore client sends every push to every server, with no ids where the
//! batch has none there, and marks the further chunks of a split push `continued`, so each push
//! advances every server's version exactly once: the servers count the same events, and once
//! the pushes in flight have arrived they hold the same version. A pull answers the version it
//! read; the push computed from those rows sends it back, and its staleness is the number of
//! pushes received in between (docs/decisions/0050-table-version-counted-on-every-server.md).
//!
//! Versions are kept in memory: a restarted server counts from 0 again, and a push whose pulled
//! version is ahead of the server's (pulled before the restart) has no known staleness.

use std::collections::HashMap;
use std::sync::Mutex;

/// Upper bounds of the staleness histogram's buckets; the last bucket holds everything above
/// the last bound.
pub const BUCKET_BOUNDS: [u64; 8] = [0, 1, 2, 4, 8, 16, 32, 64];

/// Buckets of the histogram: one per bound and one for the rest.
pub const BUCKETS: usize = BUCKET_BOUNDS.len() + 1;

/// The bucket of a staleness.
pub fn bucket_of(s: u64) -> usize {
    BUCKET_BOUNDS
        .iter()
        .position(|&b| s <= b)
        .unwrap_or(BUCKET_BOUNDS.len())
}

/// The version of every table on this server.
#[derive(Default)]
pub struct Versions {
    map: Mutex<HashMap<String, u64>>,
}

impl Versions {
    /// The table's version now.
    pub fn get(&self, table: &str) -> u64 {
        let m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.get(table).copied().unwrap_or(0)
    }

    /// Counts a push of `table` that arrived (unless it is a `continued` chunk) and returns its
    /// staleness (pushes received since the version `pulled`, when it is known and not ahead of
    /// this server's) and the version after it.
    pub fn arrive(&self, table: &str, pulled: Option<u64>, continued: bool) -> (Option<u64>, u64) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let v = m.entry(table.to_string()).or_insert(0);
        let stale = pulled.and_then(|p| v.checked_sub(p));
        if !continued {
            *v += 1;
        }
        (stale, *v)
    }

    /// Forgets a dropped table.
    pub fn remove(&self, table: &str) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_their_bounds() {
        let got: Vec<usize> = [0, 1, 2, 3, 4, 5, 8, 9, 64, 65, u64::MAX]
            .iter()
            .map(|&s| bucket_of(s))
            .collect();
        assert_eq!(got, vec![0, 1, 2, 3, 3, 4, 4, 5, 7, 8, 8]);
    }

    #[test]
    fn a_push_counts_once_and_staleness_is_counted_from_its_pull() {
        let v = Versions::default();
        assert_eq!(v.get("t"), 0);
        let pulled = v.get("t");
        for _ in 0..3 {
            v.arrive("t", None, false);
        }
        // A chunk of the same push does not count again.
        assert_eq!(v.arrive("t", Some(pulled), false), (Some(3), 4));
        assert_eq!(v.arrive("t", Some(pulled), true), (Some(4), 4));
        // Pulled before a restart: unknown.
        assert_eq!(v.arrive("t", Some(99), false), (None, 5));
        v.remove("t");
        assert_eq!(v.get("t"), 0);
    }
}
