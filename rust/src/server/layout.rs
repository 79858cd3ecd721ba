//! Which cluster a server belongs to: the hash of the server list its tables were made under.
//!
//! The client sends the hash of its server list and slot table
//! (`crate::client::cluster::layout_hash`) as the metadata `x-pstore-layout` of every call. A
//! server that holds tables answers only calls whose hash is the one it recorded, so a worker
//! started with another list or another order (which would route ids elsewhere and train some
//! of them twice) fails at its first call with an error naming both
//! hashes. A server with no table takes the hash of the next call that carries one (a new
//! cluster, or a restore onto a new list); calls without the metadata (clients generated from
//! the .proto) are not checked. A durable server keeps the hash in its replica (the meta key
//! [`LAYOUT_META`], written when it is taken), so a restarted server still refuses another list.

use std::sync::Mutex;

use tonic::{Request, Status};

use crate::error::{corrupt, invalid, Result};
use crate::net::status_of;
use crate::store::Store;

/// The metadata key of the layout hash.
pub const LAYOUT_KEY: &str = "x-pstore-layout";

/// The meta key under which a durable server keeps the layout hash.
pub const LAYOUT_META: &str = "cluster/layout";

/// The layout this server's tables belong to.
#[derive(Default)]
pub(super) struct Layout(Mutex<Option<String>>);

impl Layout {
    /// The layout a durable store kept, if any (none for an in-memory store).
    pub(super) fn load(store: &Store) -> Result<Self> {
        let Some(f) = store.flusher() else {
            return Ok(Self::default());
        };
        let kept = f.storage().read(|r| r.meta(LAYOUT_META))?;
        let hash = kept
            .map(|b| {
                String::from_utf8(b).map_err(|_| {
                    corrupt(format!(
                        "{}: the meta key {LAYOUT_META} is not a layout hash",
                        f.storage().path().display()
                    ))
                })
            })
            .transpose()?;
        Ok(Self(Mutex::new(hash)))
    }

    /// Takes `hash` as this server's layout (a published routing's; kept first by a durable
    /// store), whatever it held.
    pub(super) fn pin(&self, store: &Store, hash: &str) -> Result<()> {
        let mut pinned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = store.flusher() {
            f.storage()
                .write(|w| w.put_meta(LAYOUT_META, hash.as_bytes()))?;
        }
        *pinned = Some(hash.to_string());
        Ok(())
    }

    /// The pinned hash, if any.
    pub(super) fn pinned(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the pinned hash with `hash` (none: none pinned), as a follower takes its
    /// primary's (decision 0101); kept first by a durable store.
    pub(super) fn replace(&self, store: &Store, hash: Option<String>) -> Result<()> {
        let mut pinned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = store.flusher() {
            match &hash {
                Some(h) => f
                    .storage()
                    .write(|w| w.put_meta(LAYOUT_META, h.as_bytes()))?,
                None => f.storage().write(|w| w.delete_meta(LAYOUT_META))?,
            }
        }
        *pinned = hash;
        Ok(())
    }

    /// Refuses a request whose layout is not this server's while it holds tables; `Ok(true)`
    /// when it took the request's hash as its own just now.
    pub(super) fn check<T>(
        &self,
        store: &Store,
        req: &Request<T>,
    ) -> std::result::Result<bool, Status> {
        let Some(given) = req.metadata().get(LAYOUT_KEY).and_then(|v| v.to_str().ok()) else {
            return Ok(false);
        };
        let mut pinned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match pinned.as_deref() {
            Some(p) if p == given => Ok(false),
            Some(p) if !store.tables().is_empty() => Err(status_of(&invalid(format!(
                "this server holds tables of the cluster whose layout (server list and slot \
                 table) hashes to {p}; this client's layout hashes to {given}: every worker must \
                 connect with the same list of servers, in the same order, with the same slot \
                 table (a new list needs a cluster snapshot and `pstore reshard`)"
            )))),
            _ => {
                if let Some(f) = store.flusher() {
                    // Kept before it is taken: a restart refuses other lists from the start.
                    f.storage()
                        .write(|w| w.put_meta(LAYOUT_META, given.as_bytes()))
                        .map_err(|e| status_of(&e))?;
                }
                *pinned = Some(given.to_string());
                Ok(true)
            }
        }
    }
}
