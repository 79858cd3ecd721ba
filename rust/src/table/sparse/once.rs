//! The request ids of applied pushes, kept beside the rows: a durable store's flusher takes
//! them with the rows (under the same hold, see `hold_changes`) and writes both in one
//! transaction, so a store server recognises a retried push after a restart
//! ([`AppliedIds`]).

use super::SparseTable;
use crate::error::Result;
use crate::table::AppliedIds;

impl SparseTable {
    fn applied_ids(&self) -> std::sync::MutexGuard<'_, (AppliedIds, bool)> {
        self.applied.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that the write request `(client, seq)` was applied (called under the change
    /// hold of the push that applied it).
    pub(super) fn note_applied(&self, client: u64, seq: u64) {
        let mut a = self.applied_ids();
        a.0.insert(client, seq);
        a.1 = true;
    }

    /// Whether the write request `(client, seq)` was applied (an error when it is older than
    /// what the table remembers of its client).
    pub fn was_applied(&self, client: u64, seq: u64) -> Result<bool> {
        self.applied_ids().0.contains(client, seq)
    }

    /// The applied ids to write, if they changed since the last take (call while holding
    /// changes off, so they match the rows taken).
    pub(crate) fn take_applied(&self) -> Option<Vec<u8>> {
        let mut a = self.applied_ids();
        if !a.1 {
            return None;
        }
        a.1 = false;
        Some(a.0.encode())
    }

    /// Marks the applied ids to be written again (a write that took them failed).
    pub(crate) fn untake_applied(&self) {
        self.applied_ids().1 = true;
    }

    /// Forgets every applied id (going back to a commit that held none).
    pub(crate) fn clear_applied(&self) {
        *self.applied_ids() = (AppliedIds::default(), false);
    }

    /// Loads the applied ids a durable store kept.
    pub(crate) fn load_applied(&self, bytes: &[u8], what: &str) -> Result<()> {
        let ids = AppliedIds::decode(bytes, what)?;
        *self.applied_ids() = (ids, false);
        Ok(())
    }
}
