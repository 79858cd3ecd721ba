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
//! A table's version is its `received` counter, kept in the table's record: a durable server
//! commits it with the rows of each flush cycle and reads it back at a restart, so staleness
//! goes on counting from where it was (a push whose pulled version is ahead of the server's has
//! no known staleness).

use std::sync::atomic::Ordering;

use crate::table::TableHandle;

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

/// The table's version now.
pub fn get(t: &dyn TableHandle) -> u64 {
    t.common().counters.received.load(Ordering::Acquire)
}

/// Counts a push of the table that arrived (unless it is a `continued` chunk) and returns its
/// staleness (pushes received since the version `pulled`, when it is known and not ahead of
/// this server's) and the version after it.
pub fn arrive(t: &dyn TableHandle, pulled: Option<u64>, continued: bool) -> (Option<u64>, u64) {
    let c = &t.common().counters.received;
    let before = if continued {
        c.load(Ordering::Acquire)
    } else {
        c.fetch_add(1, Ordering::AcqRel)
    };
    let stale = pulled.and_then(|p| before.checked_sub(p));
    (stale, before + u64::from(!continued))
}

/// Counts a push of the table for the cluster's `pushes` counter (call for one request per
/// push: the one without `uncounted`).
pub fn count(t: &dyn TableHandle) {
    t.common().counters.counted.fetch_add(1, Ordering::Relaxed);
}

/// The pushes counted for the cluster on this server (see [`count`]).
pub fn counted(t: &dyn TableHandle) -> u64 {
    t.common().counters.counted.load(Ordering::Relaxed)
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
        let store = crate::store::Store::new(crate::store::StoreConfig::default()).unwrap();
        let t = store
            .create_sparse_table(
                "t",
                crate::table::SparseTableConfig {
                    dim: 2,
                    optimizer: Default::default(),
                    initializer: crate::init::Initializer::Zeros,
                    seed: 0,
                    lifecycle: Default::default(),
                    refuse_nonfinite: false,
                },
            )
            .unwrap();
        let t: &dyn TableHandle = t.as_ref();
        assert_eq!(get(t), 0);
        let pulled = get(t);
        for _ in 0..3 {
            arrive(t, None, false);
        }
        // A chunk of the same push does not count again.
        assert_eq!(arrive(t, Some(pulled), false), (Some(3), 4));
        assert_eq!(arrive(t, Some(pulled), true), (Some(4), 4));
        // Pulled before a restart: unknown.
        assert_eq!(arrive(t, Some(99), false), (None, 5));
        assert_eq!(get(t), 5);
    }
}
