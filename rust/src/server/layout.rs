//! Which cluster a server belongs to: the hash of the server list its tables were made under.
//!
//! The client sends the hash of its server list (`crate::client::cluster::layout_hash`) as the
//! metadata `x-pstore-layout` of every call. A server that holds tables answers only calls whose
//! hash is the one it recorded, so a worker started with another list (which would route ids
//! elsewhere and train some of them twice) fails at its first call with an error naming both
//! hashes. A server with no table takes the hash of the next call that carries one (a new
//! cluster, or a restore onto a new list); calls without the metadata (clients generated from
//! the .proto) are not checked. The hash lives in memory: a restarted server takes the hash of
//! its first call again.

use std::sync::Mutex;

use tonic::{Request, Status};

use crate::error::invalid;
use crate::net::status_of;
use crate::store::Store;

/// The metadata key of the layout hash.
pub const LAYOUT_KEY: &str = "x-pstore-layout";

/// The layout this server's tables belong to.
#[derive(Default)]
pub(super) struct Layout(Mutex<Option<String>>);

impl Layout {
    /// Refuses a request whose layout is not this server's while it holds tables.
    pub(super) fn check<T>(&self, store: &Store, req: &Request<T>) -> Result<(), Status> {
        let Some(given) = req.metadata().get(LAYOUT_KEY).and_then(|v| v.to_str().ok()) else {
            return Ok(());
        };
        let mut pinned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match pinned.as_deref() {
            Some(p) if p == given => Ok(()),
            Some(p) if !store.tables().is_empty() => Err(status_of(&invalid(format!(
                "this server holds tables of the cluster whose server list hashes to {p}; \
                 this client's list hashes to {given}: every worker must connect with the same \
                 list of servers (a new list needs a cluster snapshot and `pstore reshard`)"
            )))),
            _ => {
                *pinned = Some(given.to_string());
                Ok(())
            }
        }
    }
}
