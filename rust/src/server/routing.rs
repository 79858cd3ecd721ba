//! The routing a server holds: the cluster's server list, the slot table over it (whose epoch is
//! the *routing epoch*) and this server's position in the list.
//!
//! A server holds no routing until one is published to it (`SetRouting`, decision 0102); then
//! every call that names ids (Pull, Push, Contains, Remove) or a dense table (DensePull,
//! DensePush) is checked against it: an id whose slot another position owns, or a dense table
//! whose name's slot another position owns, makes the whole call fail before anything is read
//! or applied, with FAILED_PRECONDITION, `pstore-error: moved` and the held epoch in
//! `pstore-epoch`. The client then fetches the routing (`GetRouting`), splits the batch again
//! and resends it with the same request ids. A request routed by a *newer* epoch than the held
//! one (a publish still under way) gets UNAVAILABLE `epoch_ahead`, which clients retry.
//!
//! A call carrying the client's epoch (`x-pstore-epoch`) to a server that holds a routing is not
//! held to the layout hash: the owners change under resharding by design, and the per-id check
//! is the stronger one (it refuses exactly the ids that went astray). A call without it (a client
//! generated from the .proto) is still checked against the layout hash, which a publish re-pins
//! to the new routing's. A durable server keeps its routing in the meta key [`ROUTING_META`].
//!
//! The list carries each position's replica group (`Routing.groups`, decision 0109): a client
//! that follows a changed list learns the members of every group from it. A routing without
//! groups (published before they were carried, or kept so on disk) reads as groups of one.

use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use tonic::{Request, Status};

use crate::error::{corrupt, invalid, Result};
use crate::net::proto;
use crate::net::routing::{key, layout_hash, slot_of, SlotTable, SlotTableSpec};
use crate::net::ERROR_KIND;
use crate::store::Store;

/// The metadata key of the routing epoch a client routed a call by.
pub const EPOCH_KEY: &str = "x-pstore-epoch";

/// The metadata key of the held epoch in a "moved" status.
pub const MOVED_EPOCH_KEY: &str = "pstore-epoch";

/// The `pstore-error` kind of a call that reached a server that does not own its rows.
pub const MOVED: &str = "moved";

/// The `pstore-error` kind of a call routed by an epoch newer than the server's.
pub const EPOCH_AHEAD: &str = "epoch_ahead";

/// The meta key under which a durable server keeps its routing.
pub const ROUTING_META: &str = "cluster/routing";

/// The kept form of a routing.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Kept {
    servers: Vec<String>,
    index: u32,
    slots: SlotTableSpec,
    /// Each position's members (empty: groups of one; absent in the form kept before groups
    /// were carried).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    groups: Vec<Vec<String>>,
}

/// A routing this server holds.
pub(super) struct Held {
    table: SlotTable,
    servers: Vec<String>,
    /// Each position's members, primary first as the publisher knew (empty: every position a
    /// group of one).
    groups: Vec<Vec<String>>,
    index: usize,
    /// The epoch from which this server list is held (after a restart: the held epoch). A
    /// job's clock call routed by an earlier epoch went by another list (decision 0125).
    list_epoch: u64,
}

impl Held {
    fn to_proto(&self) -> proto::Routing {
        proto::Routing {
            slots: Some(self.table.to_proto()),
            servers: self.servers.clone(),
            index: self.index as u32,
            groups: groups_to_proto(&self.groups),
        }
    }

    fn kept(&self) -> Result<Vec<u8>> {
        let kept = Kept {
            servers: self.servers.clone(),
            index: self.index as u32,
            slots: self.table.spec(),
            groups: self.groups.clone(),
        };
        serde_json::to_vec(&kept).map_err(|e| crate::Error::Internal(format!("routing: {e}")))
    }

    /// The list epoch of `new`, which replaces this routing: this one's when the list is the
    /// same, else `new`'s own epoch.
    fn list_since(&self, new: &Held) -> u64 {
        if self.servers == new.servers {
            self.list_epoch.min(new.table.epoch())
        } else {
            new.table.epoch()
        }
    }

    /// The layout hash of this routing (what clients without the epoch metadata must send).
    pub(super) fn layout_hash(&self) -> String {
        layout_hash(&self.servers, &self.table)
    }
}

/// What a request is routed by.
pub(super) enum Target<'a> {
    /// Nothing: any server answers it.
    None,
    /// Ids, as the wire's little-endian u64 bytes.
    Ids(&'a [u8]),
    /// A dense table's name.
    Name(&'a str),
}

/// A request message, and what it is routed by.
pub(super) trait Routed {
    fn target(&self) -> Target<'_> {
        Target::None
    }
}

macro_rules! unrouted {
    ($($t:ty),*) => { $(impl Routed for $t {})* };
}
unrouted!(
    proto::BulkLoadRequest,
    proto::ClockRequest,
    proto::CreateTableRequest,
    proto::DropTableRequest,
    proto::EvictRequest,
    proto::FlushRequest,
    proto::GetTableRequest,
    proto::ListTablesRequest,
    proto::LoadSnapshotRequest,
    proto::ReplicaAckRequest,
    proto::ReplicateRequest,
    proto::SetLrRequest,
    proto::SnapshotRequest,
    proto::StatusRequest,
    proto::GetRoutingRequest,
    proto::SetRoutingRequest,
    proto::FreezeSlotsRequest,
    proto::ExportSlotsRequest,
    proto::DropSlotsRequest
);

macro_rules! by_ids {
    ($($t:ty),*) => { $(impl Routed for $t {
        fn target(&self) -> Target<'_> {
            Target::Ids(&self.ids)
        }
    })* };
}
by_ids!(
    proto::PullRequest,
    proto::PushRequest,
    proto::ContainsRequest,
    proto::RemoveRequest
);

impl Routed for proto::DensePullRequest {
    fn target(&self) -> Target<'_> {
        Target::Name(&self.table)
    }
}

impl Routed for proto::DensePushRequest {
    fn target(&self) -> Target<'_> {
        Target::Name(&self.table)
    }
}

/// The routing this server holds, if any.
#[derive(Default)]
pub(super) struct Routes(RwLock<Option<Arc<Held>>>);

/// The epoch a call carries, if it carries one.
pub(super) fn epoch_of<T>(req: &Request<T>) -> Option<u64> {
    req.metadata()
        .get(EPOCH_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

impl Routes {
    /// The routing a durable store kept, if any (none for an in-memory store).
    pub(super) fn load(store: &Store) -> Result<Self> {
        let Some(f) = store.flusher() else {
            return Ok(Self::default());
        };
        let Some(bytes) = f.storage().read(|r| r.meta(ROUTING_META))? else {
            return Ok(Self::default());
        };
        let bad = |why: String| {
            corrupt(format!(
                "{}: the meta key {ROUTING_META} is not a routing: {why}",
                f.storage().path().display()
            ))
        };
        let k: Kept = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        let table = SlotTable::from_spec(&k.slots).map_err(|e| bad(e.to_string()))?;
        let held = check(table, k.servers, k.groups, k.index).map_err(|e| bad(e.to_string()))?;
        Ok(Self(RwLock::new(Some(Arc::new(held)))))
    }

    fn held(&self) -> Option<Arc<Held>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The held routing (an empty message when none).
    pub(super) fn get(&self) -> proto::Routing {
        self.held().map(|h| h.to_proto()).unwrap_or_default()
    }

    /// Installs `r` (checked; kept first by a durable store); returns the routing now held.
    /// `pin` re-pins the layout hash to the new routing's.
    pub(super) fn set(
        &self,
        store: &Store,
        r: proto::SetRoutingRequest,
        pin: impl FnOnce(&str) -> Result<()>,
    ) -> Result<proto::Routing> {
        let r = r
            .routing
            .ok_or_else(|| invalid("SetRouting needs a routing"))?;
        let slots = r
            .slots
            .as_ref()
            .ok_or_else(|| invalid("SetRouting needs the routing's slot table (slots)"))?;
        let table = SlotTable::from_proto(slots)?;
        if table.epoch() == 0 {
            return Err(invalid(
                "routing epoch 0 is the one clients take without a held routing; a published \
                 routing has epoch 1 or more",
            ));
        }
        let mut new = check(table, r.servers, groups_of(r.groups), r.index)?;
        let mut g = self.0.write().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = g.as_ref() {
            new.list_epoch = h.list_since(&new);
            let same = h.table == new.table
                && h.servers == new.servers
                && h.groups == new.groups
                && h.index == new.index;
            if same {
                return Ok(h.to_proto());
            }
            if new.table.epoch() <= h.table.epoch() {
                return Err(invalid(format!(
                    "routing epoch {} is not newer than the held epoch {} (a routing is replaced \
                     only by a higher epoch; fetch the current one with GetRouting)",
                    new.table.epoch(),
                    h.table.epoch()
                )));
            }
        }
        if let Some(f) = store.flusher() {
            let bytes = new.kept()?;
            f.storage().write(|w| w.put_meta(ROUTING_META, &bytes))?;
        }
        pin(&new.layout_hash())?;
        let out = new.to_proto();
        *g = Some(Arc::new(new));
        Ok(out)
    }

    /// Replaces the held routing with `r` (none: holds none), as a follower takes its
    /// primary's (decision 0101): checked, kept first by a durable store, whatever its epoch.
    pub(super) fn replace(&self, store: &Store, r: Option<proto::Routing>) -> Result<()> {
        let mut new = match r.filter(|r| r.slots.is_some()) {
            None => None,
            Some(r) => {
                let slots = r.slots.as_ref().expect("filtered");
                let table = SlotTable::from_proto(slots)?;
                Some(check(table, r.servers, groups_of(r.groups), r.index)?)
            }
        };
        let mut g = self.0.write().unwrap_or_else(|e| e.into_inner());
        if let (Some(h), Some(n)) = (g.as_ref(), new.as_mut()) {
            n.list_epoch = h.list_since(n);
        }
        if let Some(f) = store.flusher() {
            match &new {
                Some(h) => {
                    let bytes = h.kept()?;
                    f.storage().write(|w| w.put_meta(ROUTING_META, &bytes))?;
                }
                None => f.storage().write(|w| w.delete_meta(ROUTING_META))?,
            }
        }
        *g = new.map(Arc::new);
        Ok(())
    }

    /// The held routing, if any.
    pub(super) fn held_proto(&self) -> Option<proto::Routing> {
        self.held().map(|h| h.to_proto())
    }

    /// Whether this server owns slot `s` at its held routing (None: it holds none).
    pub(super) fn owns_slot(&self, s: usize) -> Option<bool> {
        self.held().map(|h| h.table.owner_of_slot(s) == h.index)
    }

    /// Whether this server owns a slot at the routing held now (every slot when none is).
    pub(super) fn owned_now(&self) -> impl Fn(usize) -> bool {
        let h = self.held();
        move |k| {
            h.as_ref()
                .is_none_or(|h| h.table.owner_of_slot(k) == h.index)
        }
    }

    /// A job's clock call routed by `epoch` (the one it carried, if any) went by a server list
    /// older than the one held (decision 0125): "moved", with the held epoch, so that the
    /// client takes the routing and reports its clock to the servers of the new list (a server
    /// that joined takes part in the job's later steps; one that left must not keep a worker
    /// waiting). `None` when the list is the held one, or no routing or epoch is known.
    pub(super) fn list_moved(&self, epoch: Option<u64>) -> Option<Status> {
        let e = epoch?;
        let h = self.held()?;
        if e >= h.list_epoch {
            return None;
        }
        let held = h.table.epoch();
        let mut st = Status::failed_precondition(format!(
            "moved: the server list changed at routing epoch {} ([{}]); this job's clock call \
             was routed by epoch {e}, over an older list: fetch the routing (GetRouting) and \
             report the clock to the servers of the new list",
            h.list_epoch,
            h.servers.join(", ")
        ));
        if let Ok(v) = MOVED.parse() {
            st.metadata_mut().insert(ERROR_KIND, v);
        }
        if let Ok(v) = held.to_string().parse() {
            st.metadata_mut().insert(MOVED_EPOCH_KEY, v);
        }
        Some(st)
    }

    /// Whether the layout check gives way to the routing check for `req`: this server holds a
    /// routing and the call carries the epoch it was routed by.
    pub(super) fn replaces_layout<T>(&self, req: &Request<T>) -> bool {
        epoch_of(req).is_some() && self.0.read().is_ok_and(|g| g.is_some())
    }

    /// Refuses a call that names an id or a dense table another position owns ("moved"), or
    /// that was routed by a newer epoch than the held one and names rows this server does not
    /// own yet ("epoch_ahead"). Passes everything while no routing is held.
    pub(super) fn check<T: Routed>(&self, req: &Request<T>) -> std::result::Result<(), Status> {
        let target = req.get_ref().target();
        if matches!(target, Target::None) {
            return Ok(());
        }
        let Some(h) = self.held() else {
            return Ok(());
        };
        let (owner, what) = match target {
            Target::None => return Ok(()),
            Target::Ids(bytes) => {
                // Malformed ids are the handler's to report.
                let Some((owner, id)) = bytes.chunks_exact(8).find_map(|b| {
                    let id = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                    let o = h.table.server_of(id);
                    (o != h.index).then_some((o, id))
                }) else {
                    return Ok(());
                };
                (owner, format!("id {id} (slot {})", slot_of(id)))
            }
            Target::Name(name) => {
                let owner = h.table.dense_home(name);
                if owner == h.index {
                    return Ok(());
                }
                (
                    owner,
                    format!("dense table {name:?} (slot {})", slot_of(key(name))),
                )
            }
        };
        let held = h.table.epoch();
        let owner_name = h.servers.get(owner).map_or("?", String::as_str);
        let (mut st, kind) = match epoch_of(req) {
            Some(e) if e > held => (
                Status::unavailable(format!(
                    "{what} is not on this server at its routing epoch {held}; the call was \
                     routed by epoch {e}, which is being published: retry"
                )),
                EPOCH_AHEAD,
            ),
            _ => (
                Status::failed_precondition(format!(
                    "moved: {what} belongs to position {owner} ({owner_name}) at routing epoch \
                     {held}, not to this server (position {}); fetch the routing (GetRouting) \
                     and send it there",
                    h.index
                )),
                MOVED,
            ),
        };
        if let Ok(v) = kind.parse() {
            st.metadata_mut().insert(ERROR_KIND, v);
        }
        if let Ok(v) = held.to_string().parse() {
            st.metadata_mut().insert(MOVED_EPOCH_KEY, v);
        }
        Err(st)
    }
}

/// The groups of a routing message, as lists of members.
fn groups_of(groups: Vec<proto::RoutingGroup>) -> Vec<Vec<String>> {
    groups.into_iter().map(|g| g.members).collect()
}

/// The groups of a routing, as the message carries them.
fn groups_to_proto(groups: &[Vec<String>]) -> Vec<proto::RoutingGroup> {
    groups
        .iter()
        .map(|m| proto::RoutingGroup { members: m.clone() })
        .collect()
}

/// A routing from its parts, checked: a list of distinct, non-empty addresses, a table over
/// exactly that many positions, each position's group (none: groups of one; otherwise one per
/// position, each naming the position's address, no address in two places), and an index in
/// the list (or its length: not in it). Groups that are all of one member are held as none, so
/// the same routing compares equal in either form.
fn check(
    table: SlotTable,
    servers: Vec<String>,
    mut groups: Vec<Vec<String>>,
    index: u32,
) -> Result<Held> {
    if servers.len() != table.servers() {
        return Err(invalid(format!(
            "routing: the slot table addresses {} servers, the list has {}",
            table.servers(),
            servers.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for s in &servers {
        if s.is_empty() {
            return Err(invalid("routing: a server address is empty"));
        }
        if !seen.insert(s) {
            return Err(invalid(format!("routing: server {s} is listed twice")));
        }
    }
    if !groups.is_empty() {
        if groups.len() != servers.len() {
            return Err(invalid(format!(
                "routing: {} replica groups for a list of {} positions (give one per position, \
                 or none)",
                groups.len(),
                servers.len()
            )));
        }
        for (i, (g, s)) in groups.iter().zip(&servers).enumerate() {
            if !g.contains(s) {
                return Err(invalid(format!(
                    "routing: the replica group of position {i} [{}] does not name its address \
                     {s}",
                    g.join(", ")
                )));
            }
            for m in g.iter().filter(|m| *m != s) {
                if m.is_empty() {
                    return Err(invalid("routing: a group member's address is empty"));
                }
                if !seen.insert(m) {
                    return Err(invalid(format!("routing: server {m} is listed twice")));
                }
            }
            if g.iter().filter(|m| *m == s).count() > 1 {
                return Err(invalid(format!("routing: server {s} is listed twice")));
            }
        }
        if groups.iter().all(|g| g.len() == 1) {
            groups.clear();
        }
    }
    // The index past the end: a server that left the list (it owns no slot).
    if index as usize > servers.len() {
        return Err(invalid(format!(
            "routing: index {index} is neither a position of the {}-server list nor its length \
             (a server that left it)",
            servers.len()
        )));
    }
    Ok(Held {
        list_epoch: table.epoch(),
        table,
        servers,
        groups,
        index: index as usize,
    })
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    fn routing(groups: Vec<Vec<&str>>) -> proto::Routing {
        proto::Routing {
            slots: Some(SlotTable::uniform(2).unwrap().to_proto()),
            servers: vec!["a:1".into(), "c:1".into()],
            index: 1,
            groups: groups
                .into_iter()
                .map(|m| proto::RoutingGroup {
                    members: m.into_iter().map(String::from).collect(),
                })
                .collect(),
        }
    }

    fn held(r: proto::Routing) -> Result<Held> {
        let table = SlotTable::from_proto(r.slots.as_ref().unwrap())?;
        check(table, r.servers, groups_of(r.groups), r.index)
    }

    #[test]
    fn groups_travel_in_the_message_and_the_kept_form() {
        let r = routing(vec![vec!["b:1", "a:1"], vec!["c:1", "d:1"]]);
        let bytes = r.encode_to_vec();
        let h = held(proto::Routing::decode(bytes.as_slice()).unwrap()).unwrap();
        assert_eq!(h.groups, vec![vec!["b:1", "a:1"], vec!["c:1", "d:1"]]);
        assert_eq!(h.to_proto(), r);
        let k: Kept = serde_json::from_slice(&h.kept().unwrap()).unwrap();
        assert_eq!(k.groups, h.groups);
        assert_eq!((k.servers, k.index), (h.servers.clone(), 1));
    }

    #[test]
    fn a_routing_without_groups_reads_as_groups_of_one() {
        // The message of a version before groups: fields 1-3 only.
        let old = proto::Routing {
            groups: vec![],
            ..routing(vec![])
        };
        let h = held(proto::Routing::decode(old.encode_to_vec().as_slice()).unwrap()).unwrap();
        assert!(h.groups.is_empty());
        assert_eq!(h.to_proto(), old);
        // Groups of one member each are the same routing as none.
        let ones = held(routing(vec![vec!["a:1"], vec!["c:1"]])).unwrap();
        assert!(ones.groups.is_empty() && ones.to_proto() == old);
        // The kept form before groups (no "groups" key) still reads; groups of one write it
        // so again.
        let spec = serde_json::to_value(SlotTable::uniform(2).unwrap().spec()).unwrap();
        let before = serde_json::json!({"servers": ["a:1", "c:1"], "index": 1, "slots": spec});
        let k: Kept = serde_json::from_value(before.clone()).unwrap();
        assert!(k.groups.is_empty());
        let again: serde_json::Value = serde_json::from_slice(&h.kept().unwrap()).unwrap();
        assert_eq!(again, before);
    }

    #[test]
    fn the_list_epoch_moves_with_the_list_and_an_older_clock_call_is_moved() {
        let store = Store::new(crate::store::StoreConfig::default()).unwrap();
        let routes = Routes::default();
        let set = |epoch: u64, servers: &[&str], owner: u32| {
            let n = servers.len();
            let table =
                SlotTable::from_owners(epoch, n, vec![owner; crate::net::routing::SLOTS]).unwrap();
            let r = proto::SetRoutingRequest {
                routing: Some(proto::Routing {
                    slots: Some(table.to_proto()),
                    servers: servers.iter().map(|s| s.to_string()).collect(),
                    index: 0,
                    groups: vec![],
                }),
            };
            routes.set(&store, r, |_| Ok(())).unwrap();
        };
        // No routing held: nothing is moved.
        assert!(routes.list_moved(Some(0)).is_none());
        set(1, &["a:1", "c:1"], 0);
        assert!(routes.list_moved(Some(0)).is_some());
        // Slots moved over the same list: the list epoch stays.
        set(2, &["a:1", "c:1"], 1);
        assert!(routes.list_moved(Some(1)).is_none() && routes.list_moved(None).is_none());
        // A server joined at epoch 3: a clock call routed by epoch 2 went by the old list.
        set(3, &["a:1", "c:1", "d:1"], 1);
        let st = routes.list_moved(Some(2)).unwrap();
        assert_eq!(st.code(), tonic::Code::FailedPrecondition);
        assert_eq!(st.metadata().get(ERROR_KIND).unwrap(), MOVED);
        assert_eq!(st.metadata().get(MOVED_EPOCH_KEY).unwrap(), "3");
        assert!(
            st.message().contains("changed at routing epoch 3"),
            "{}",
            st.message()
        );
        assert!(routes.list_moved(Some(3)).is_none());
        set(4, &["a:1", "c:1", "d:1"], 2);
        assert!(routes.list_moved(Some(2)).is_some() && routes.list_moved(Some(3)).is_none());
    }

    #[test]
    fn bad_groups_are_refused_naming_the_problem() {
        let e = |g: Vec<Vec<&str>>| held(routing(g)).err().unwrap().to_string();
        assert!(e(vec![vec!["a:1", "b:1"]]).contains("1 replica groups for a list of 2"));
        assert!(e(vec![vec!["b:1"], vec!["c:1"]]).contains("does not name its address a:1"));
        assert!(e(vec![vec!["a:1", "c:1"], vec!["c:1"]]).contains("c:1 is listed twice"));
        assert!(e(vec![vec!["a:1", "b:1"], vec!["c:1", "b:1"]]).contains("b:1 is listed twice"));
        assert!(e(vec![vec!["a:1", ""], vec!["c:1"]]).contains("empty"));
    }
}
