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
//!
//! The routing's list names each position's replica group (decision 0109), so a client follows
//! a changed list with groups too: it keeps the groups it has, builds the new ones from the
//! routing (reusing its connections to members it knows) and finds their primaries as on any
//! failover.

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::Status;

use super::{Client, Server};
use crate::error::{invalid, Error, Result};
use crate::net::proto::*;
use crate::net::routing::SlotTable;
use crate::net::splice::SplicedGrads;
use crate::net::{error_of, wire, ERROR_KIND};
use crate::server::routing::MOVED;

/// A part of a push: its position, its message, the routing generation it was split by
/// ([`Client::generation`]) and its server's address.
type Part = (usize, PushRequest, (u64, u64), String);

/// How many times one operation follows a routing change before it reports the refusal (a
/// move publishes an epoch per batch of slots, so a call may meet several in a row).
const MAX_REROUTES: u32 = 64;

/// How many other servers a call that cannot reach its position asks at once, early
/// ([`Client::ask_early`]).
const EARLY_ASKS: usize = 3;

/// How long each of those asks may take.
const EARLY_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// At most one early ask per position in this time.
pub(super) const EARLY_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The server list and slot table a client routes by, and the metadata it sends with every
/// call.
pub(super) struct Route {
    /// The servers, by position (the slot table's owners are positions of this list).
    pub(super) servers: Vec<Arc<Server>>,
    pub(super) table: SlotTable,
    /// Whether each position owns at least one slot.
    pub(super) owns_slots: Vec<bool>,
    pub(super) layout: MetadataValue<Ascii>,
    pub(super) epoch: MetadataValue<Ascii>,
}

impl Route {
    /// A replica group counts in the layout hash by its position only
    /// (`cluster::layout_hash_groups`).
    pub(super) fn new(servers: Vec<Arc<Server>>, table: SlotTable) -> Result<Self> {
        let ascii = |s: String| {
            s.parse()
                .map_err(|_| Error::Internal("routing metadata is ASCII".into()))
        };
        let names: Vec<&str> = servers.iter().map(|s| s.name.as_str()).collect();
        let replicas: Vec<Vec<String>> = servers
            .iter()
            .map(|s| {
                s.group.members[1..]
                    .iter()
                    .map(|m| m.name.clone())
                    .collect()
            })
            .collect();
        Ok(Self {
            layout: ascii(super::cluster::layout_hash_groups(
                &names, &replicas, &table,
            ))?,
            servers,
            epoch: ascii(table.epoch().to_string())?,
            owns_slots: table.slots_per_server().iter().map(|&n| n > 0).collect(),
            table,
        })
    }
}

/// A position of a routing's list: its address and its replica group's members, the primary
/// first as the publisher knew it (empty: the routing does not say, a routing published before
/// groups were carried).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Position {
    pub(super) name: String,
    pub(super) members: Vec<String>,
}

impl Position {
    /// Whether `s` is this position: the same address, and the same members (in any order)
    /// when the routing names them.
    fn is(&self, s: &Server) -> bool {
        let mut a: Vec<&str> = self.members.iter().map(String::as_str).collect();
        let mut b: Vec<&str> = s.group.members.iter().map(|m| m.name.as_str()).collect();
        a.sort_unstable();
        b.sort_unstable();
        self.name == s.name && (a.is_empty() || a == b)
    }
}

/// The positions of a routing's list.
pub(super) fn positions_of(r: &Routing) -> Vec<Position> {
    r.servers
        .iter()
        .enumerate()
        .map(|(i, name)| Position {
            name: name.clone(),
            members: r.groups.get(i).map_or_else(Vec::new, |g| g.members.clone()),
        })
        .collect()
}

/// The addresses of `list`.
pub(super) fn names_of(list: &[Position]) -> Vec<String> {
    list.iter().map(|p| p.name.clone()).collect()
}

/// `list` for a message: each position's address, a group of one as its address alone,
/// several members as the group joined with commas.
pub(super) fn describe(list: &[Position]) -> String {
    list.iter()
        .map(|p| {
            if p.members.len() > 1 {
                format!("[{}]", p.members.join(", "))
            } else {
                p.name.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The routing message of `table` over `list` for position `index`: with each position's
/// group when any has more than one member (otherwise in the form of a routing without groups,
/// which every server version reads).
pub(super) fn routing_over(list: &[Position], table: &SlotTable, index: usize) -> Routing {
    let groups = if list.iter().any(|p| p.members.len() > 1) {
        list.iter()
            .map(|p| RoutingGroup {
                members: if p.members.is_empty() {
                    vec![p.name.clone()]
                } else {
                    p.members.clone()
                },
            })
            .collect()
    } else {
        Vec::new()
    };
    Routing {
        slots: Some(table.to_proto()),
        servers: names_of(list),
        index: index as u32,
        groups,
    }
}

/// Whether a status is a server's "moved" refusal.
pub(super) fn is_moved(s: &Status) -> bool {
    s.code() == tonic::Code::FailedPrecondition
        && s.metadata()
            .get(ERROR_KIND)
            .is_some_and(|v| v.as_bytes() == MOVED.as_bytes())
}

/// A "moved" status made by the client itself (a call split by a list that changed since).
pub(super) fn moved_status(message: String) -> Status {
    let mut st = Status::failed_precondition(format!("moved: {message}"));
    if let Ok(v) = MOVED.parse() {
        st.metadata_mut().insert(ERROR_KIND, v);
    }
    st
}

/// Whether a status is a server's "moving" answer (a frozen slot: retry).
pub(super) fn is_moving(s: &Status) -> bool {
    s.code() == tonic::Code::Unavailable && s.message().starts_with("moving: ")
}

impl Client {
    /// This client's list: each position's address and members, its primary first as this
    /// client knows it.
    pub(super) fn positions(&self) -> Vec<Position> {
        self.list()
            .iter()
            .map(|s| {
                let g = &s.group;
                let p = g.pick(false);
                let mut members = vec![g.members[p].name.clone()];
                members.extend(
                    g.members
                        .iter()
                        .enumerate()
                        .filter(|&(k, _)| k != p)
                        .map(|(_, m)| m.name.clone()),
                );
                Position {
                    name: s.name.clone(),
                    members,
                }
            })
            .collect()
    }

    /// Whether `list` is this client's list (the same addresses, and the same members where
    /// `list` names them).
    pub(super) fn is_my_list(&self, list: &[Position]) -> bool {
        let mine = self.list();
        mine.len() == list.len() && list.iter().zip(&mine).all(|(p, s)| p.is(s))
    }

    /// The table this client routes by now.
    pub(super) fn route(&self) -> Arc<Route> {
        Arc::clone(&self.route.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Routes by `table` from now on, unless the current table is newer.
    pub(super) fn adopt(&self, table: SlotTable) -> Result<()> {
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        if table.epoch() >= g.table.epoch() && table != g.table {
            *g = Arc::new(Route::new(g.servers.clone(), table)?);
        }
        Ok(())
    }

    /// The newest routing the servers hold (its list and table), if any holds one. A server
    /// older than the routing calls counts as holding none.
    pub(super) fn held_routing(&self) -> Result<Option<(Vec<Position>, SlotTable)>> {
        self.held_routing_of(false)
    }

    /// [`held_routing`](Self::held_routing); `reachable`: from the servers that answer (one
    /// that left the list may be stopped), failing only when none does.
    pub(super) fn held_routing_of(
        &self,
        reachable: bool,
    ) -> Result<Option<(Vec<Position>, SlotTable)>> {
        let t = self.config.timeout;
        let answers = self.rt.block_on(async {
            let calls = (0..self.n()).map(|i| {
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
        let mut best: Option<(Vec<Position>, SlotTable)> = None;
        let mut failed = None;
        let asked = answers.len();
        let mut answered = 0;
        for (i, a) in answers.into_iter().enumerate() {
            let r = match a {
                Ok(r) => r,
                Err(s) if s.code() == tonic::Code::Unimplemented => continue,
                Err(s) if reachable => {
                    failed = Some(error_of(&s, &self.name_of(i)));
                    continue;
                }
                Err(s) => return Err(error_of(&s, &self.name_of(i))),
            };
            answered += 1;
            let Some(slots) = &r.slots else { continue };
            let table = SlotTable::from_proto(slots)?;
            if best.as_ref().is_none_or(|(_, b)| table.epoch() > b.epoch()) {
                best = Some((positions_of(&r), table));
            }
        }
        match failed {
            Some(e) if answered == 0 && asked > 0 => Err(e),
            _ => Ok(best),
        }
    }

    /// Takes the routing server `i` holds, when it is newer than this client's, with its
    /// server list when that changed (servers or groups joined or left).
    pub(super) async fn refresh_routing(&self, i: usize) -> Result<()> {
        let Some(server) = self.route().servers.get(i).cloned() else {
            // The list changed since the call was split: this client routes by a newer one.
            return Ok(());
        };
        let name = &server.name;
        let req = self.request(GetRoutingRequest {}, self.config.timeout);
        let r = server
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
        let list = positions_of(&r);
        if !self.is_my_list(&list) {
            let epoch = table.epoch();
            return self.adopt_list(&list, table).map_err(|e| {
                invalid(format!(
                    "server {name} routes by epoch {} over the servers [{}]; this client \
                     cannot follow it: {e}",
                    epoch,
                    describe(&list),
                ))
            });
        }
        self.adopt(table)
    }

    /// Routes by `table` over the server list `list` from now on, unless this client's table
    /// is newer: the groups it already has are kept (with the primary each knows), new ones
    /// are built from the list's members, reusing this client's connections to members it
    /// knows and opening the others on first use.
    pub(super) fn adopt_list(&self, list: &[Position], table: SlotTable) -> Result<()> {
        if table.servers() != list.len() {
            return Err(invalid(format!(
                "the slot table addresses {} servers, the list has {}",
                table.servers(),
                list.len()
            )));
        }
        let servers = self.servers_named(list)?;
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        if table.epoch() > g.table.epoch() || (table.epoch() == g.table.epoch() && table != g.table)
        {
            *g = Arc::new(Route::new(servers, table)?);
            self.list_changes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// The routing this client routes by, as a generation: its epoch, then how many times its
    /// list changed (a group's members named anew under the same epoch count as a change).
    pub(super) fn generation(&self) -> (u64, u64) {
        (
            self.route().table.epoch(),
            self.list_changes.load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Position `i` could not be reached (no answer after this client's retries, or no primary
    /// among the members it knows): asks the *other* servers of the list for the routing they
    /// hold (each once, with the usual timeout and retries) and takes the newest one when it is
    /// newer than this client's, or of the same epoch but naming members of position `i` this
    /// client does not know (a replacement follower that became primary). Answers whether this
    /// client now routes by another routing, so that the call is split again by it (with the
    /// same request ids: the unreachable part was not applied under the routing it was sent by).
    pub(super) async fn follow_the_others(&self, i: usize) -> bool {
        let route = self.route();
        let Some(failed) = route.servers.get(i).cloned() else {
            return false;
        };
        let t = self.config.timeout;
        let asks = route
            .servers
            .iter()
            .enumerate()
            .filter(|&(k, s)| k != i && s.name != failed.name)
            .map(|(_, s)| {
                let s = Arc::clone(s);
                async move {
                    self.call_server(
                        &s,
                        None,
                        GetRoutingRequest {},
                        t,
                        true,
                        false,
                        |mut c, r| async move { c.get_routing(r).await },
                    )
                    .await
                }
            });
        let answers = super::futures_join_all(asks).await;
        self.take_the_newest(i, &route, answers.into_iter().flatten())
    }

    /// The early form of [`follow_the_others`](Self::follow_the_others), asked while a call
    /// still retries or looks for its group's primary: at most [`EARLY_ASKS`] other servers,
    /// picked at random, each asked once (no retries, a short deadline), and for each
    /// position at most once per [`EARLY_EVERY`] (so a call split into many parts, or many
    /// threads meeting the same dead server, ask a few times, not once each).
    pub(super) async fn ask_early(&self, i: usize) -> bool {
        let route = self.route();
        let Some(failed) = route.servers.get(i).cloned() else {
            return false;
        };
        {
            let mut asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            if asked
                .get(&failed.name)
                .is_some_and(|t| now.duration_since(*t) < EARLY_EVERY)
            {
                return false;
            }
            asked.insert(failed.name.clone(), now);
        }
        let mut others: Vec<Arc<Server>> = route
            .servers
            .iter()
            .enumerate()
            .filter(|&(k, s)| k != i && s.name != failed.name)
            .map(|(_, s)| Arc::clone(s))
            .collect();
        // A partial Fisher-Yates shuffle: the first EARLY_ASKS are a random choice.
        let n = others.len();
        for k in 0..n.min(EARLY_ASKS) {
            let j = k + (super::random_id() as usize) % (n - k);
            others.swap(k, j);
        }
        others.truncate(EARLY_ASKS);
        let wait = self.config.timeout.min(EARLY_WAIT);
        let asks = others.into_iter().map(|s| {
            let req = self.request(GetRoutingRequest {}, wait);
            let mut stub = s.group.primary().stub.clone();
            async move {
                match tokio::time::timeout(wait, stub.get_routing(req)).await {
                    Ok(Ok(r)) => Some(r.into_inner()),
                    _ => None,
                }
            }
        });
        let answers = super::futures_join_all(asks).await;
        self.take_the_newest(i, &route, answers.into_iter().flatten())
    }

    /// Takes the newest of `answers` (routings the other servers hold) when it is newer than
    /// `route`, or of the same epoch and table but naming members of position `i` other than
    /// the ones this client knows. Whether this client now routes by another routing.
    fn take_the_newest(
        &self,
        i: usize,
        route: &Route,
        answers: impl Iterator<Item = Routing>,
    ) -> bool {
        let Some(failed) = route.servers.get(i).cloned() else {
            return false;
        };
        let mine = route.table.epoch();
        let mut best: Option<(Vec<Position>, SlotTable)> = None;
        for r in answers {
            let Some(slots) = &r.slots else { continue };
            let Ok(table) = SlotTable::from_proto(slots) else {
                continue;
            };
            let list = positions_of(&r);
            let newer = table.epoch() > mine;
            let names_others = table.epoch() == mine
                && table == route.table
                && list
                    .get(i)
                    .is_some_and(|p| !p.members.is_empty() && !p.is(&failed));
            if (newer || names_others)
                && best.as_ref().is_none_or(|(_, b)| table.epoch() > b.epoch())
            {
                best = Some((list, table));
            }
        }
        let Some((list, table)) = best else {
            return false;
        };
        let before = self.generation();
        let taken = if table.epoch() > mine {
            if self.is_my_list(&list) {
                self.adopt(table)
            } else {
                self.adopt_list(&list, table)
            }
        } else {
            self.adopt_members(&list, table)
        };
        taken.is_ok() && self.generation() > before
    }

    /// Routes by `list` (the same table and epoch as this client's, other members in some
    /// group) from now on, unless this client's routing changed meanwhile.
    fn adopt_members(&self, list: &[Position], table: SlotTable) -> Result<()> {
        if table.servers() != list.len() {
            return Ok(());
        }
        let servers = self.servers_named(list)?;
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        if table == g.table && g.servers.len() == list.len() {
            *g = Arc::new(Route::new(servers, table)?);
            self.list_changes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// The servers of `list`: this client's own where it has the same position, new ones
    /// otherwise, whose members are this client's connections where it has them and lazily
    /// connected ones else.
    pub(super) fn servers_named(&self, list: &[Position]) -> Result<Vec<Arc<Server>>> {
        let have = self.list();
        list.iter()
            .map(|p| match have.iter().find(|s| p.is(s)) {
                Some(s) => Ok(Arc::clone(s)),
                None => self.server_of(p, &have),
            })
            .collect()
    }

    /// A new server (a replica group) for position `p`: its members in the order given (the
    /// first believed primary), each reusing this client's connection to it when `have` has one.
    pub(super) fn server_of(&self, p: &Position, have: &[Arc<Server>]) -> Result<Arc<Server>> {
        let single = [p.name.clone()];
        let names = if p.members.is_empty() {
            &single[..]
        } else {
            &p.members[..]
        };
        let members = names
            .iter()
            .map(|n| {
                match have
                    .iter()
                    .flat_map(|s| s.group.members.iter())
                    .find(|m| &m.name == n)
                {
                    Some(m) => Ok(super::group::Member {
                        name: m.name.clone(),
                        stub: m.stub.clone(),
                        channel: m.channel.clone(),
                    }),
                    None => super::member(&self.rt, &self.config, n),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Server {
            name: p.name.clone(),
            group: super::group::Group::new(members),
        }))
    }

    /// Publishes `table` over the server list `list` (which may differ from this client's):
    /// servers joining the list get it first, then the others, then the servers of `gone`
    /// (leaving: they hold the new list at the position past its end, owning nothing; one that
    /// does not answer is skipped, since it owns no slot under the routing it holds). This
    /// client then routes by it. A replica group gets it on its primary, which hands it to its
    /// followers through the replication log before it answers (decision 0101).
    pub(super) fn publish_over(
        &self,
        list: &[Position],
        table: SlotTable,
        gone: &[Arc<Server>],
    ) -> Result<()> {
        let servers = self.servers_named(list)?;
        let have = self.names();
        let routing = |index: usize| SetRoutingRequest {
            routing: Some(routing_over(list, &table, index)),
        };
        let t = self.config.timeout;
        let set = |s: &Arc<Server>, index: usize| {
            let s = Arc::clone(s);
            let r = routing(index);
            async move {
                self.call_server(&s, None, r, t, true, false, |mut c, r| async move {
                    c.set_routing(r).await
                })
                .await
                .map_err(|e| error_of(&e, &s.name))
            }
        };
        let (new, old): (Vec<_>, Vec<_>) = servers
            .iter()
            .enumerate()
            .partition(|(_, s)| !have.contains(&s.name));
        self.rt.block_on(async {
            for part in [new, old] {
                for r in super::futures_join_all(part.iter().map(|(i, s)| set(s, *i))).await {
                    r?;
                }
            }
            for s in gone {
                let _ = set(s, list.len()).await;
            }
            Ok::<(), Error>(())
        })?;
        self.adopt_list(list, table)
    }

    /// Publishes `table` as the cluster's routing: every server of this client's list gets it
    /// with its position (`SetRouting`), then this client routes by it. Its epoch must be above
    /// this client's and the servers' (a publish of the same routing again is accepted). Moves
    /// no rows: what the servers held under the old owners stays where it is, so this is the
    /// last step of a move, after the rows are on their new owners.
    pub fn publish_routing(&self, table: SlotTable) -> Result<()> {
        self.publish_routing_after(table, None)
    }

    /// [`publish_routing`](Self::publish_routing), to position `first` before the others (a
    /// move's old owner, decision 0125): a routing it refuses reaches no other server.
    pub(super) fn publish_routing_after(
        &self,
        table: SlotTable,
        first: Option<usize>,
    ) -> Result<()> {
        let list = self.positions();
        let n = list.len();
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
        let target = |i: usize| {
            (
                i,
                SetRoutingRequest {
                    routing: Some(routing_over(&list, &table, i)),
                },
            )
        };
        if let Some(f) = first.filter(|&f| f < n) {
            self.fan_out(
                vec![target(f)],
                |mut c, r| async move { c.set_routing(r).await },
            )?;
        }
        let rest = (0..n).filter(|&i| Some(i) != first).map(target).collect();
        self.fan_out(rest, |mut c, r| async move { c.set_routing(r).await })?;
        self.adopt(table)
    }

    /// Runs `op` again while it fails with FAILED_PRECONDITION after this client's routing
    /// changed under it (a server answered "moved" and its routing was taken).
    pub(super) fn rerouted<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let mut rounds = 0;
        loop {
            let before = self.generation();
            match op() {
                Err(Error::Remote { code: 9, .. })
                    if rounds < MAX_REROUTES && self.generation() > before =>
                {
                    rounds += 1;
                }
                r => return r,
            }
        }
    }

    /// Sends the parts of one push; a part refused as moved is split by the refreshed table and
    /// its sub-parts sent with its request id. Answers `(server address, result)` for every
    /// part sent last: the parts that applied and those that failed for good.
    pub(super) async fn send_push_parts(
        &self,
        targets: Vec<(usize, PushRequest)>,
        route: &Route,
        dim: usize,
    ) -> Vec<(String, Result<PushResponse>)> {
        let t = self.config.timeout;
        // Each part with the generation of the routing it was split by and its server's address.
        let name = |r: &Route, i: usize| r.servers.get(i).map_or(String::new(), |s| s.name.clone());
        let split = (route.table.epoch(), self.generation().1);
        let mut pending: Vec<Part> = targets
            .into_iter()
            .map(|(i, m)| (i, m, split, name(route, i)))
            .collect();
        let mut done = Vec::new();
        for round in 0..=MAX_REROUTES {
            let results = super::futures_join_all(pending.iter().map(|(i, m, _, _)| {
                self.call(*i, m.clone(), t, true, |mut c, mut r| async move {
                    // The gradients go on the wire from their own buffer (`net/splice.rs`).
                    let g = std::mem::take(&mut r.get_mut().grads);
                    r.extensions_mut().insert(SplicedGrads(g));
                    c.push(r).await
                })
            }))
            .await;
            let mut again = Vec::new();
            for ((_, m, split_by, at), r) in pending.into_iter().zip(results) {
                // Refused as moved, and this client now routes by a newer table than the part
                // was split by: split it again.
                let rerouted = round < MAX_REROUTES && self.generation() > split_by;
                match r {
                    Err(Error::Remote { code: 9, .. }) if rerouted => match self.resplit(&m, dim) {
                        Some(parts) => again.extend(parts),
                        None => done.push((at, r)),
                    },
                    r => done.push((at, r)),
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
    fn resplit(&self, m: &PushRequest, dim: usize) -> Option<Vec<Part>> {
        let d = wire::dtype(m.dtype).ok()?;
        let row = dim * wire::width(d);
        let ids = wire::ids(&m.ids).ok()?;
        if m.grads.len() != ids.len() * row {
            return None;
        }
        let mut split_from = m.split_from.clone();
        split_from.extend(m.request_id);
        let route = self.route();
        let split = self.generation();
        let name = |r: &Route, i: usize| r.servers.get(i).map_or(String::new(), |s| s.name.clone());
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
                split,
                name(&route, j),
            ));
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(name: &str, members: &[&str]) -> Position {
        Position {
            name: name.into(),
            members: members.iter().map(|m| m.to_string()).collect(),
        }
    }

    #[test]
    fn a_routing_names_groups_only_when_a_position_has_several_members() {
        let table = SlotTable::uniform(2).unwrap();
        let singles = [at("a:1", &["a:1"]), at("c:1", &["c:1"])];
        let r = routing_over(&singles, &table, 1);
        assert!(r.groups.is_empty() && r.servers == ["a:1", "c:1"] && r.index == 1);
        // Read back: the routing does not say, so members are unknown.
        assert!(positions_of(&r).iter().all(|p| p.members.is_empty()));
        let grouped = [at("a:1", &["b:1", "a:1"]), at("c:1", &["c:1"])];
        let r = routing_over(&grouped, &table, 0);
        assert_eq!(r.groups.len(), 2);
        assert_eq!(positions_of(&r), grouped);
        assert_eq!(describe(&grouped), "[b:1, a:1], c:1");
    }
}
