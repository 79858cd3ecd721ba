//! The request ids of a sparse table's applied writes, kept beside the rows: a durable store's
//! flusher takes them with the rows (under the same hold, see `hold_changes`) and writes both
//! in one transaction per environment, so a store server recognises a retried write after a
//! restart ([`crate::table::Applied`]).

use super::SparseTable;
use crate::error::Result;

impl SparseTable {
    /// Records that the write request `(client, seq)` was applied (called under the change
    /// hold of the write that applied it).
    pub(super) fn note_applied(&self, client: u64, seq: u64) {
        self.common.applied.note(client, seq);
    }

    /// Per environment of the replica (one for an in-memory store), whether the write request
    /// `(client, seq)` was applied there (an error when it is older than what the table
    /// remembers of its client).
    pub fn was_applied(&self, client: u64, seq: u64) -> Result<Vec<bool>> {
        self.common.applied.check(client, seq)
    }

    /// The applied ids to write, one set per environment, if they changed since the last take
    /// (call while holding changes off, so they match the rows taken).
    pub(crate) fn take_applied(&self) -> Option<Vec<Vec<u8>>> {
        self.common.applied.take()
    }

    /// Marks the applied ids to be written again (a write that took them failed).
    pub(crate) fn untake_applied(&self) {
        self.common.applied.untake()
    }
}
