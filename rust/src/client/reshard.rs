//! Following the cluster's routing (decision 0102): the slot table this client routes by, and
//! what it does when a server answers "moved".
//!
//! Every call carries the epoch of the client's table (`x-pstore-epoch`). A server that holds a
//! routing refuses a call naming rows it does not own with FAILED_PRECONDITION `moved` (nothing
//! read or applied); the client then fetches that server's routing (`GetRouting`), and the
//! operation sends the refused part again, split by the new table: reads and dense calls are
//! simply sent again, a sparse push resends only its refused parts, each sub-part with a
//! new request id and the ids of the parts it came from (`split_from`), so a server that
//! remembers one of those as applied answers from its memory instead of applying it twice.

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::Status;

use super::Client;
use crate::error::{invalid, Error, Result};
use crate::net::proto::*;
use crate::net::routing::SlotTable;
use crate::net::splice::SplicedGrads;
use crate::net::{error_of, wire, ERROR_KIND};
use crate::server::routing::MOVED;

/// How many times one operation follows a routing change before it reports the refusal (a
/// move publishes an epoch per batch of slots, so a call may meet several in a row).
const MAX_REROUTES: u32 = 64;

/// The table a client routes by, and the metadata it sends with every call.
pub(super) struct Route {
    pub(super) table: SlotTable,
    /// Whether each position owns at least one slot.
    pub(super) owns_slots: Vec<bool>,
    pub(super) layout: MetadataValue<Ascii>,
    pub(super) epoch: MetadataValue<Ascii>,
}

impl Route {
    /// `replicas`: each position's members after its first (a replica group counts in the
    /// layout hash by its position only: `cluster::layout_hash_groups`).
    pub(super) fn new(
        servers: &[String],
        replicas: &[Vec<String>],
        table: SlotTable,
    ) -> Result<Self> {
        let ascii = |s: String| {
            s.parse()
                .map_err(|_| Error::Internal("routing metadata is ASCII".into()))
        };
        Ok(Self {
            layout: ascii(super::cluster::layout_hash_groups(
                servers, replicas, &table,
            ))?,
            epoch: ascii(table.epoch().to_string())?,
            owns_slots: table.slots_per_server().iter().map(|&n| n > 0).collect(),
            table,
        })
    }
}

/// Whether a status is a server's "moved" refusal.
pub(super) fn is_moved(s: &Status) -> bool {
    s.code() == tonic::Code::FailedPrecondition
        && s.metadata()
            .get(ERROR_KIND)
            .is_some_and(|v| v.as_bytes() == MOVED.as_bytes())
}

/// Whether a status is a server's "moving" answer (a frozen slot: retry).
pub(super) fn is_moving(s: &Status) -> bool {
    s.code() == tonic::Code::Unavailable && s.message().starts_with("moving: ")
}

impl Client {
    /// The table this client routes by now.
    pub(super) fn route(&self) -> Arc<Route> {
        Arc::clone(&self.route.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Routes by `table` from now on, unless the current table is newer.
    pub(super) fn adopt(&self, table: SlotTable) -> Result<()> {
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        if table.epoch() >= g.table.epoch() && table != g.table {
            *g = Arc::new(Route::new(
                &self.config.servers,
                &self.config.replicas,
                table,
            )?);
        }
        Ok(())
    }

    /// The newest routing the servers hold (its list and table), if any holds one. A server
    /// older than the routing calls counts as holding none.
    pub(super) fn held_routing(&self) -> Result<Option<(Vec<String>, SlotTable)>> {
        let t = self.config.timeout;
        let answers = self.rt.block_on(async {
            let calls = (0..self.servers.len()).map(|i| {
                self.call_status(
                    i,
                    GetRoutingRequest {},
                    t,
                    true,
                    false,
                    |mut c, r| async move { c.get_routing(r).await },
                )
            });
            super::futures_join_all(calls).await
        });
        let mut best: Option<(Vec<String>, SlotTable)> = None;
        for (i, a) in answers.into_iter().enumerate() {
            let r = match a {
                Ok(r) => r,
                Err(s) if s.code() == tonic::Code::Unimplemented => continue,
                Err(s) => return Err(error_of(&s, &self.servers[i].name)),
            };
            let Some(slots) = &r.slots else { continue };
            let table = SlotTable::from_proto(slots)?;
            if best.as_ref().is_none_or(|(_, b)| table.epoch() > b.epoch()) {
                best = Some((r.servers, table));
            }
        }
        Ok(best)
    }

    /// Takes the routing server `i` holds, when it is newer than this client's. A routing over
    /// another server list is an error: this client's connections are to its own list.
    pub(super) async fn refresh_routing(&self, i: usize) -> Result<()> {
        let name = &self.servers[i].name;
        let req = self.request(GetRoutingRequest {}, self.config.timeout);
        let r = self.servers[i]
            .group
            .primary()
            .stub
            .clone()
            .get_routing(req)
            .await
            .map_err(|s| error_of(&s, name))?
            .into_inner();
        let Some(slots) = &r.slots else {
            return Ok(());
        };
        let table = SlotTable::from_proto(slots)?;
        if table.epoch() <= self.route().table.epoch() {
            return Ok(());
        }
        if r.servers != self.config.servers {
            return Err(invalid(format!(
                "server {name} routes by epoch {} over the servers [{}]; this client is \
                 connected to [{}]: connect again to follow the new list",
                table.epoch(),
                r.servers.join(", "),
                self.config.servers.join(", ")
            )));
        }
        self.adopt(table)
    }

    /// Publishes `table` as the cluster's routing: every server of this client's list gets it
    /// with its position (`SetRouting`), then this client routes by it. Its epoch must be above
    /// this client's and the servers' (a publish of the same routing again is accepted). Moves
    /// no rows: what the servers held under the old owners stays where it is, so this is the
    /// last step of a move, after the rows are on their new owners.
    pub fn publish_routing(&self, table: SlotTable) -> Result<()> {
        let n = self.servers.len();
        if table.servers() != n {
            return Err(invalid(format!(
                "the slot table addresses {} servers, the cluster has {n}",
                table.servers()
            )));
        }
        let have = self.route().table.epoch();
        if table.epoch() <= have && table != self.route().table {
            return Err(invalid(format!(
                "routing epoch {} is not above this client's epoch {have}",
                table.epoch()
            )));
        }
        let slots = table.to_proto();
        let targets = (0..n)
            .map(|i| {
                (
                    i,
                    SetRoutingRequest {
                        routing: Some(Routing {
                            slots: Some(slots.clone()),
                            servers: self.config.servers.clone(),
                            index: i as u32,
                        }),
                    },
                )
            })
            .collect();
        self.fan_out(targets, |mut c, r| async move { c.set_routing(r).await })?;
        self.adopt(table)
    }

    /// Runs `op` again while it fails with FAILED_PRECONDITION after this client's routing
    /// changed under it (a server answered "moved" and its routing was taken).
    pub(super) fn rerouted<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let mut rounds = 0;
        loop {
            let before = self.route().table.epoch();
            match op() {
                Err(Error::Remote { code: 9, .. })
                    if rounds < MAX_REROUTES && self.route().table.epoch() > before =>
                {
                    rounds += 1;
                }
                r => return r,
            }
        }
    }

    /// Sends the parts of one push; a part refused as moved is split by the refreshed table and
    /// its sub-parts sent with its request id. Answers `(server, result)` for every part sent
    /// last: the parts that applied and those that failed for good.
    pub(super) async fn send_push_parts(
        &self,
        targets: Vec<(usize, PushRequest)>,
        epoch: u64,
        dim: usize,
    ) -> Vec<(usize, Result<PushResponse>)> {
        let t = self.config.timeout;
        // Each part with the epoch of the table it was split by.
        let mut pending: Vec<(usize, PushRequest, u64)> =
            targets.into_iter().map(|(i, m)| (i, m, epoch)).collect();
        let mut done = Vec::new();
        for round in 0..=MAX_REROUTES {
            let results = super::futures_join_all(pending.iter().map(|(i, m, _)| {
                self.call(*i, m.clone(), t, true, |mut c, mut r| async move {
                    // The gradients go on the wire from their own buffer (`net/splice.rs`).
                    let g = std::mem::take(&mut r.get_mut().grads);
                    r.extensions_mut().insert(SplicedGrads(g));
                    c.push(r).await
                })
            }))
            .await;
            let mut again = Vec::new();
            for ((i, m, split_by), r) in pending.into_iter().zip(results) {
                // Refused as moved, and this client now routes by a newer table than the part
                // was split by: split it again.
                let rerouted = round < MAX_REROUTES && self.route().table.epoch() > split_by;
                match r {
                    Err(Error::Remote { code: 9, .. }) if rerouted => match self.resplit(&m, dim) {
                        Some(parts) => again.extend(parts),
                        None => done.push((i, r)),
                    },
                    r => done.push((i, r)),
                }
            }
            if again.is_empty() {
                break;
            }
            pending = again;
        }
        done
    }

    /// The parts of a refused push part under the current table: each with a request id of
    /// its own and the ids of the parts it was split from (`split_from`), so that a server
    /// that remembers one of those as applied (a retry whose first answer was lost, the rows
    /// moved since) answers it without applying it again.
    fn resplit(&self, m: &PushRequest, dim: usize) -> Option<Vec<(usize, PushRequest, u64)>> {
        let d = wire::dtype(m.dtype).ok()?;
        let row = dim * wire::width(d);
        let ids = wire::ids(&m.ids).ok()?;
        if m.grads.len() != ids.len() * row {
            return None;
        }
        let mut split_from = m.split_from.clone();
        split_from.extend(m.request_id);
        let route = self.route();
        let mut out = Vec::new();
        for (j, pos) in route.table.split(&ids).into_iter().enumerate() {
            if pos.is_empty() {
                continue;
            }
            let request_id = self.next_id();
            let mut grads = Vec::with_capacity(pos.len() * row);
            for &p in &pos {
                let p = p as usize;
                grads.extend_from_slice(&m.grads[p * row..(p + 1) * row]);
            }
            out.push((
                j,
                PushRequest {
                    ids: wire::encode_ids_at(&ids, &pos),
                    grads: grads.into(),
                    request_id,
                    split_from: split_from.clone(),
                    // The server it was meant for counted (or will not count) the push.
                    continued: true,
                    uncounted: true,
                    version_only: false,
                    ..m.clone()
                },
                route.table.epoch(),
            ));
        }
        Some(out)
    }
}
