//! Servers joining and leaving a running cluster (decision 0098): the driver.
//!
//! The server list is part of the routing the servers hold (decision 0102): a routing epoch
//! carries the list and the slot table over it. [`Client::add_server`] gives the joining server
//! every table's definition, publishes the list with it at the end (owning no slot yet, the
//! joining server first), then moves about 1/N of the slots to it ([`Client::move_slots`]).
//! [`Client::remove_server`] moves every slot of the leaving server to the others, then
//! publishes the list without it (the others renumbered, the leaving server told it is past the
//! end of the list, where it owns nothing). Workers meet "moved" and follow the newer list
//! (`reshard.rs`); nothing is lost or applied twice, no worker restarts.
//!
//! A position may be a replica group (decision 0109): a joining group is its primary and
//! followers, the routing names every position's members, and each group gets the routing on its
//! primary, whose followers take it from the replication log.

use std::time::Duration;

use super::reshard::{describe, names_of, Position};
use super::{Client, MoveReport, Server};
use crate::error::{invalid, Error, Result};
use crate::net::proto::*;
use crate::net::routing::{SlotTable, SLOTS};
use crate::net::{error_of, PROTOCOL};

/// Owners after `k` more slots go to a new position `n` (the one past `owners`' positions): each
/// time from the position that owns the most, each giving its highest-numbered slots, so what
/// moves is a few runs per position.
fn grow(owners: &[u32], n: usize, k: usize) -> Vec<u32> {
    let mut count = vec![0usize; n];
    for &o in owners {
        count[o as usize] += 1;
    }
    let mut give = vec![0usize; n];
    for _ in 0..k {
        let Some(o) = (0..n).max_by_key(|&o| (count[o], std::cmp::Reverse(o))) else {
            break;
        };
        if count[o] == 0 {
            break;
        }
        count[o] -= 1;
        give[o] += 1;
    }
    let mut out = owners.to_vec();
    for s in (0..out.len()).rev() {
        let o = out[s] as usize;
        if give[o] > 0 {
            give[o] -= 1;
            out[s] = n as u32;
        }
    }
    out
}

/// Owners after position `r` gives all its slots to the others, each time to the one that owns
/// the fewest, in runs.
fn shrink(owners: &[u32], n: usize, r: usize) -> Vec<u32> {
    let mut count = vec![0usize; n];
    for &o in owners {
        count[o as usize] += 1;
    }
    let mut take = vec![0usize; n];
    for _ in 0..count[r] {
        let Some(o) = (0..n)
            .filter(|&o| o != r)
            .min_by_key(|&o| (count[o] + take[o], o))
        else {
            break;
        };
        take[o] += 1;
    }
    // Each taker's slots in one run: r's slots in order, the takers in position order.
    let mut to = (0..n)
        .filter(|&o| o != r)
        .flat_map(|o| std::iter::repeat_n(o as u32, take[o]));
    let mut out = owners.to_vec();
    for x in out.iter_mut().filter(|x| **x as usize == r) {
        if let Some(o) = to.next() {
            *x = o;
        }
    }
    out
}

/// Owners of a list without position `r` (which owns no slot): later positions move down one.
fn renumber(owners: &[u32], r: usize) -> Vec<u32> {
    owners
        .iter()
        .map(|&o| if o as usize > r { o - 1 } else { o })
        .collect()
}

impl Client {
    /// Gives `to` the definition, stale policy and learning rate of every table the first
    /// server of the list holds, except those named in `skip` (which it has).
    fn copy_definitions(&self, to: &Server, skip: &[String], t: Duration) -> Result<()> {
        let ours = self.fan_out(vec![(0, ListTablesRequest {})], |mut c, r| async move {
            c.list_tables(r).await
        })?;
        for info in ours.into_iter().flat_map(|x| x.tables) {
            if skip.contains(&info.name) {
                continue;
            }
            let (create, lr) = super::definitions::definition_of(&info);
            self.call_one(
                to,
                create,
                t,
                |mut c, r| async move { c.create_table(r).await },
            )?;
            self.call_one(to, lr, t, |mut c, r| async move { c.set_lr(r).await })?;
        }
        Ok(())
    }

    /// Takes the newest routing the servers hold, with its list when that changed.
    pub(super) fn follow_held(&self) -> Result<()> {
        self.follow_held_of(false)
    }

    /// [`follow_held`](Self::follow_held); `reachable`: the newest of the servers that answer
    /// (a server that left the list may be stopped).
    pub(super) fn follow_held_of(&self, reachable: bool) -> Result<()> {
        if let Some((list, table)) = self.held_routing_of(reachable)? {
            if table.epoch() > self.route().table.epoch() {
                if self.is_my_list(&list) {
                    self.adopt(table)?;
                } else {
                    self.adopt_list(&list, table)?;
                }
            }
        }
        Ok(())
    }

    /// Publishes the members of replica groups as `groups` says they are now (each group's
    /// members, in any order; the controller's view after it replaced a member): every position
    /// of the newest routing the servers hold that shares a member with one of `groups` and
    /// names other members gets that group's members (and, when its address is not one of
    /// them any more, the group's first member as its address), under the next epoch with the
    /// same slot table (no row moves). Answers the epoch published, or None when nothing changed or the
    /// servers hold no routing (publishing a first routing is a list change of its own, left to
    /// `add_server` and `publish_routing`).
    pub fn publish_members(&self, groups: &[Vec<String>]) -> Result<Option<u64>> {
        self.follow_held_of(true)?;
        let Some((held, table)) = self.held_routing_of(true)? else {
            return Ok(None);
        };
        let mut list = held.clone();
        for p in list.iter_mut() {
            let known: Vec<&String> = if p.members.is_empty() {
                vec![&p.name]
            } else {
                p.members.iter().collect()
            };
            let Some(g) = groups.iter().find(|g| g.iter().any(|m| known.contains(&m))) else {
                continue;
            };
            let mut a: Vec<&String> = g.iter().collect();
            let mut b = known.clone();
            a.sort_unstable();
            b.sort_unstable();
            if a != b && !g.is_empty() {
                p.members = g.clone();
                // A position is named by one of its members (the first: the primary).
                if !g.contains(&p.name) {
                    p.name = g[0].clone();
                }
            }
        }
        if list == held {
            return Ok(None);
        }
        let next = SlotTable::from_owners(table.epoch() + 1, list.len(), table.owners().to_vec())?;
        let epoch = next.epoch();
        self.publish_over(&list, next, &[])?;
        Ok(Some(epoch))
    }

    /// One call to a server that may not be in the list.
    fn call_one<M, R, F, Fut>(&self, s: &Server, msg: M, timeout: Duration, f: F) -> Result<R>
    where
        M: Clone,
        F: Fn(super::Stub, tonic::Request<M>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        self.rt
            .block_on(self.call_server(s, None, msg, timeout, true, false, f))
            .map_err(|e| error_of(&e, &s.name))
    }

    /// Adds a server, or a replica group, to the list while workers train: `members` is the
    /// server's address, or a group's members, its primary first, then its followers (each
    /// started with `--follow` the primary). It gets every table's definition, joins the list
    /// (owning nothing), then about 1/N of the slots move to it with their rows, optimizer state
    /// and metadata. Fails before changing anything for an address already in the list (of any
    /// group), a member that does not answer or speaks another protocol, a first member that is
    /// not a primary or a follower that does not follow it, or a primary that holds rows or
    /// another cluster's routing.
    pub fn add_server(
        &self,
        members: &[String],
        max_rows_per_second: Option<f64>,
    ) -> Result<MoveReport> {
        super::moves::check_pace(max_rows_per_second)?;
        let Some(addr) = members.first().cloned() else {
            return Err(invalid(
                "add_server needs the server's address, or a replica group's members (its \
                 primary first); nothing was changed",
            ));
        };
        let addr = addr.as_str();
        let mut seen = std::collections::HashSet::new();
        for m in members {
            if m.is_empty() {
                return Err(invalid(
                    "cannot add a server: an address is empty; nothing was changed",
                ));
            }
            if !seen.insert(m) {
                return Err(invalid(format!(
                    "cannot add server {addr}: {m} is given twice; nothing was changed"
                )));
            }
        }
        self.drain();
        self.follow_held()?;
        let list = self.positions();
        let names = names_of(&list);
        for m in members {
            if let Some(at) = list.iter().position(|p| p.members.contains(m)) {
                let owned = self.route().table.slots_per_server()[at];
                return Err(invalid(format!(
                    "server {m} is already in the list [{}] (position {at}, owning {owned} \
                     slots); nothing was changed (to give it slots, use move_slots)",
                    describe(&list)
                )));
            }
        }
        let joining_at = Position {
            name: addr.to_string(),
            members: members.to_vec(),
        };
        let joining = self.server_of(&joining_at, &[])?;
        // Is every member there, is the first the primary and do the others follow it, is the
        // primary empty? Checked before anything changes.
        let t = self.config.timeout.min(Duration::from_secs(10));
        for (k, m) in joining.group.members.iter().enumerate() {
            let one = Server {
                name: m.name.clone(),
                group: super::group::Group::new(vec![super::group::Member {
                    name: m.name.clone(),
                    stub: m.stub.clone(),
                    channel: m.channel.clone(),
                }]),
            };
            let st = self
                .call_one(&one, StatusRequest {}, t, |mut c, r| async move {
                    c.status(r).await
                })
                .map_err(|e| {
                    invalid(format!(
                        "cannot add server {}: it did not answer ({e}); nothing was changed",
                        m.name
                    ))
                })?;
            if st.protocol != PROTOCOL {
                return Err(invalid(format!(
                    "cannot add server {}: it speaks protocol {}, this client {PROTOCOL}; \
                     nothing was changed",
                    m.name, st.protocol
                )));
            }
            if members.len() > 1 {
                let rep: serde_json::Value =
                    serde_json::from_str(&st.replication_json).unwrap_or_default();
                let role = rep["role"].as_str().unwrap_or("primary");
                let follows = rep["primary"].as_str().unwrap_or("");
                if k == 0 && role != "primary" {
                    return Err(invalid(format!(
                        "cannot add the replica group [{}]: its first member {} is a {role} \
                         (of {follows}), not the primary; give the primary first; nothing was \
                         changed",
                        members.join(", "),
                        m.name
                    )));
                }
                if k > 0 && (role != "follower" || follows != addr) {
                    let what = if role == "follower" {
                        format!("follows {follows}")
                    } else {
                        format!("is a {role}")
                    };
                    return Err(invalid(format!(
                        "cannot add the replica group [{}]: member {} {what}, not the group's \
                         primary {addr} (start it with --follow {addr}); nothing was changed",
                        members.join(", "),
                        m.name
                    )));
                }
            }
        }
        let held = self.call_one(&joining, GetRoutingRequest {}, t, |mut c, r| async move {
            c.get_routing(r).await
        })?;
        if held.slots.is_some() && held.servers.iter().any(|s| !names.contains(s)) {
            return Err(invalid(format!(
                "cannot add server {addr}: it holds the routing of another cluster ([{}]); \
                 start it with an empty data directory; nothing was changed",
                held.servers.join(", ")
            )));
        }
        // A server holding another cluster's tables refuses this client's layout here.
        let theirs = self
            .call_one(&joining, ListTablesRequest {}, t, |mut c, r| async move {
                c.list_tables(r).await
            })
            .map_err(|e| {
                invalid(format!(
                    "cannot add server {addr}: {e}; start it with an empty data directory; \
                     nothing was changed"
                ))
            })?;
        if let Some(x) = theirs
            .tables
            .iter()
            .find(|x| x.kind == TableKind::Sparse as i32 && x.rows > 0)
        {
            return Err(invalid(format!(
                "cannot add server {addr}: it holds {} rows of table {:?} (a joining server \
                 must hold no rows); nothing was changed",
                x.rows, x.name
            )));
        }
        // Table definitions travel with the membership: every table, as the cluster has it.
        self.copy_definitions(&joining, &[], t)?;
        // So does a running job (decision 0125): its workers report their clocks to the new
        // server from the publish on, and it must know the job and where each worker is.
        self.carry_job(&joining, t)?;
        // The list with the new server at its end, owning nothing: no row moves yet.
        let current = self.route().table.clone();
        let n = list.len();
        let mut grown = list.clone();
        grown.push(joining_at);
        let joined = SlotTable::from_owners(current.epoch() + 1, n + 1, current.owners().to_vec())?;
        self.publish_over(&grown, joined.clone(), &[])?;
        // Again from the old list, now that no clock call routed over it is taken any more:
        // every clock it took before the publish reaches the new server.
        self.carry_job(&joining, t)?;
        // Again, for the tables it lacks: one created meanwhile by a worker of the old list
        // reached only the servers that worker knew (decision 0110). A create that ends after
        // this finds the new list and creates over it (`tables.rs`); a server that still lacks
        // a table is given it by the first client it refuses (`definitions.rs`).
        let have = self
            .call_one(&joining, ListTablesRequest {}, t, |mut c, r| async move {
                c.list_tables(r).await
            })?
            .tables
            .into_iter()
            .map(|x| x.name)
            .collect::<Vec<_>>();
        self.copy_definitions(&joining, &have, t)?;
        // Its share of the slots, from every position.
        let share = SLOTS / (n + 1);
        let target = SlotTable::from_owners(0, n + 1, grow(joined.owners(), n, share))?;
        self.move_slots(&target, max_rows_per_second)
    }

    /// Removes a server, or a whole replica group, from the list while workers train: `which`
    /// is the address of any member of the position, or the position's number. All its slots
    /// move to the others with their rows, then the list without it is published (it holds
    /// nothing afterwards, and answers every call on rows "moved"). Fails before changing
    /// anything for an address not in the list, a position past its end, or the last server;
    /// a move that fails half way (a server that died) leaves the slots moved so far moved and
    /// can be run again.
    pub fn remove_server(
        &self,
        which: &str,
        max_rows_per_second: Option<f64>,
    ) -> Result<MoveReport> {
        super::moves::check_pace(max_rows_per_second)?;
        self.drain();
        self.follow_held()?;
        let list = self.positions();
        let n = list.len();
        let r = if !which.is_empty() && which.bytes().all(|b| b.is_ascii_digit()) {
            match which.parse::<usize>() {
                Ok(r) if r < n => r,
                _ => {
                    return Err(invalid(format!(
                        "position {which} is not in the list [{}] (positions 0 to {}); \
                         nothing was changed",
                        describe(&list),
                        n - 1
                    )))
                }
            }
        } else {
            match list
                .iter()
                .position(|p| p.members.contains(&which.to_string()))
            {
                Some(r) => r,
                None => {
                    return Err(invalid(format!(
                        "server {which} is not in the list [{}]; nothing was changed",
                        describe(&list)
                    )))
                }
            }
        };
        let addr = list[r].name.clone();
        if n == 1 {
            return Err(invalid(format!(
                "cannot remove server {addr}: it is the last server of the cluster; nothing was \
                 changed"
            )));
        }
        let current = self.route().table.clone();
        let target = SlotTable::from_owners(0, n, shrink(current.owners(), n, r))?;
        let mut report = self.move_slots(&target, max_rows_per_second)?;
        // It owns nothing now: the list without it.
        let table = self.route().table.clone();
        if table.slots_per_server()[r] != 0 {
            return Err(Error::Internal(format!(
                "server {addr} still owns {} slots after the move",
                table.slots_per_server()[r]
            )));
        }
        // Whatever it still holds (rows of a batch whose move failed after its publish, before
        // its drop) goes: it owns no slot, so it keeps nothing.
        let all = SlotSet {
            starts: vec![0],
            ends: vec![SLOTS as u32],
        };
        self.fan_out(
            vec![(r, DropSlotsRequest { slots: Some(all) })],
            |mut c, r| async move { c.drop_slots(r).await },
        )?;
        let leaving = self.list().get(r).cloned();
        let mut rest = self.positions();
        rest.remove(r);
        let left = SlotTable::from_owners(table.epoch() + 1, n - 1, renumber(table.owners(), r))?;
        self.publish_over(&rest, left, leaving.as_slice())?;
        report.epoch = self.route().table.epoch();
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(owners: &[u32], n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for &o in owners {
            c[o as usize] += 1;
        }
        c
    }

    #[test]
    fn a_new_server_gets_its_share_from_every_position() {
        let t = SlotTable::uniform(3).unwrap();
        let g = grow(t.owners(), 3, SLOTS / 4);
        let c = counts(&g, 4);
        assert_eq!(c[3], SLOTS / 4);
        assert!(c[..3].iter().all(|&x| x.abs_diff(SLOTS / 4) <= 1), "{c:?}");
        // Only slots given to the new position change owner.
        assert!(t.owners().iter().zip(&g).all(|(&a, &b)| a == b || b == 3));
    }

    #[test]
    fn a_leaving_server_gives_every_slot_away_evenly() {
        let t = SlotTable::uniform(4).unwrap();
        let s = shrink(t.owners(), 4, 1);
        let c = counts(&s, 4);
        assert_eq!(c[1], 0);
        for o in [0, 2, 3] {
            assert!(c[o].abs_diff(SLOTS / 3) <= 1, "{c:?}");
        }
        assert!(t.owners().iter().zip(&s).all(|(&a, &b)| a == b || a == 1));
        let r = renumber(&s, 1);
        assert_eq!(counts(&r, 3), vec![c[0], c[2], c[3]]);
    }
}
