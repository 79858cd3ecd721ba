//! What a server holds beside its tables that decides what it accepts: the routing
//! (`routing.rs`), the layout hash (`layout.rs`), the slots frozen by a move under way
//! (`moves.rs`) and the request ids a move copied here from the old owner of its slots
//! (decision 0101).
//!
//! A primary hands it to its followers through the replication log, in commit order: every
//! change goes into the entry of the next cycle (`Flusher::ship_held`), and a routing change,
//! a freeze and copied request ids are on every live follower's disk before the call that made
//! them returns (the cycle is flushed and the primary waits as for `ack="all"`). A resync ends
//! with the state as it is. A follower replaces what it holds with each state it receives,
//! keeps it in its replica, and so enforces it from the moment it is promoted: a stale worker's
//! write for slots its group gave away is answered "moved".

use std::sync::{Mutex, Weak};

use prost::Message;

use super::{bsp_accepted, moves, Inner};
use crate::error::{corrupt, Result};
use crate::net::proto::{HeldState, SlotSet};
use crate::store::Store;

/// The meta key under which a durable server keeps the request ids moves copied to it.
pub const COPIED_META: &str = "cluster/copied_request_ids";

/// The request ids moves copied here (the newest [`moves::EXPORTED_REQUEST_IDS`]).
#[derive(Default)]
pub(super) struct Copied(Mutex<Vec<(u64, u64)>>);

impl Copied {
    /// The ids a durable store kept (none for an in-memory store).
    pub(super) fn load(store: &Store) -> Result<Self> {
        let Some(f) = store.flusher() else {
            return Ok(Self::default());
        };
        let Some(bytes) = f.storage().read(|r| r.meta(COPIED_META))? else {
            return Ok(Self::default());
        };
        let ids = moves::request_ids(&bytes).map_err(|e| {
            corrupt(format!(
                "{}: the meta key {COPIED_META}: {e}",
                f.storage().path().display()
            ))
        })?;
        Ok(Self(Mutex::new(ids)))
    }

    pub(super) fn ids(&self) -> Vec<(u64, u64)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Adds `new` (kept first by a durable store); the oldest go past the bound.
    pub(super) fn add(&self, store: &Store, new: &[(u64, u64)]) -> Result<()> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let have: std::collections::HashSet<(u64, u64)> = g.iter().copied().collect();
        let mut all = g.clone();
        all.extend(new.iter().filter(|id| !have.contains(id)));
        let skip = all.len().saturating_sub(moves::EXPORTED_REQUEST_IDS);
        all.drain(..skip);
        keep(store, &all)?;
        *g = all;
        Ok(())
    }

    /// Replaces the ids with `ids` (a follower taking its primary's).
    fn replace(&self, store: &Store, ids: Vec<(u64, u64)>) -> Result<()> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if *g != ids {
            keep(store, &ids)?;
            *g = ids;
        }
        Ok(())
    }
}

fn keep(store: &Store, ids: &[(u64, u64)]) -> Result<()> {
    if let Some(f) = store.flusher() {
        let bytes = moves::encode_request_ids(ids);
        f.storage().write(|w| w.put_meta(COPIED_META, &bytes))?;
    }
    Ok(())
}

/// The runs of the slots `set` holds.
fn runs(set: &[bool]) -> SlotSet {
    let mut out = SlotSet::default();
    let mut s = 0;
    while s < set.len() {
        if !set[s] {
            s += 1;
            continue;
        }
        let a = s;
        while s < set.len() && set[s] {
            s += 1;
        }
        out.starts.push(a as u32);
        out.ends.push(s as u32);
    }
    out
}

/// The state `inner` holds (`frozen`: these frozen slots instead of the current ones).
fn state_of(inner: &Inner, frozen: Option<&[bool]>) -> HeldState {
    let frozen = match frozen {
        Some(f) => runs(f),
        None => runs(&inner.frozen.slots()),
    };
    HeldState {
        routing: inner.routing.held_proto(),
        layout: inner.layout.pinned().unwrap_or_default(),
        frozen: Some(frozen),
        copied_request_ids: moves::encode_request_ids(&inner.copied.ids()),
    }
}

/// On a primary: the state goes into the next entry of the log (`frozen`: as
/// [`state_of`]); with `wait`, that entry is committed and on every live follower before this
/// returns. Elsewhere nothing.
pub(super) fn ship(inner: &Inner, frozen: Option<&[bool]>, wait: bool) -> Result<()> {
    let (Some(p), Some(f)) = (inner.primary(), inner.store.flusher()) else {
        return Ok(());
    };
    f.ship_held(state_of(inner, frozen).encode_to_vec());
    if wait {
        f.flush()?;
        p.wait_all()?;
    }
    Ok(())
}

/// The server's side of [`super::repl::Held`].
pub(super) struct Link(pub(super) Weak<Inner>);

impl super::repl::Held for Link {
    fn state(&self) -> HeldState {
        self.0
            .upgrade()
            .map(|i| state_of(&i, None))
            .unwrap_or_default()
    }

    fn install(&self, h: HeldState) -> Result<()> {
        let Some(inner) = self.0.upgrade() else {
            return Ok(());
        };
        let frozen = moves::slots_of(Some(&h.frozen.unwrap_or_default()))?;
        let ids = moves::request_ids(&h.copied_request_ids)?;
        inner.routing.replace(&inner.store, h.routing)?;
        inner
            .layout
            .replace(&inner.store, (!h.layout.is_empty()).then_some(h.layout))?;
        inner.frozen.replace(&frozen);
        for &id in &ids {
            inner.pushes.remember(id, bsp_accepted(0, 0));
        }
        inner.copied.replace(&inner.store, ids)
    }

    fn job_state(&self) -> Result<Vec<Vec<u8>>> {
        match self.0.upgrade() {
            Some(inner) => inner.steps.records(),
            None => Ok(Vec::new()),
        }
    }

    fn install_job(&self, records: &[Vec<u8>]) -> Result<()> {
        match self.0.upgrade() {
            Some(inner) => inner.steps.install(records),
            None => Ok(()),
        }
    }

    fn following(&self) {
        if let Some(inner) = self.0.upgrade() {
            inner.steps.follow();
        }
    }

    fn promoted(&self) -> Result<()> {
        let Some(inner) = self.0.upgrade() else {
            return Ok(());
        };
        // Slots frozen for a move of the old primary's: the move cannot finish against it, and
        // its driver meets the new epoch; writes to them go on here (decision 0125).
        let thawed = inner
            .frozen
            .thaw_on_promotion(|k| inner.routing.owns_slot(k) != Some(false));
        if thawed > 0 {
            eprintln!("event=frozen_slots_thawed_on_promotion slots={thawed}");
        }
        inner.steps.take_over(&inner.store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_exactly_the_set() {
        let mut set = vec![false; 20];
        for s in [0, 1, 2, 7, 19] {
            set[s] = true;
        }
        let r = runs(&set);
        assert_eq!(r.starts, vec![0, 7, 19]);
        assert_eq!(r.ends, vec![3, 8, 20]);
        assert!(runs(&[false; 4]).starts.is_empty());
    }
}
