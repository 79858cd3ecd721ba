//! Which server holds an id: a fixed table of hash slots.
//!
//! An id's *slot* is the top 14 bits of `mix64(id)` ([`slot_of`]), one of [`SLOTS`] = 16,384.
//! Because the LMDB key of a row is `mix64(id)` big-endian (`storage::format::key`), a slot is a
//! contiguous key range in every environment. A [`SlotTable`] gives each slot an *owner*: a
//! position in the cluster's server list (not an address, so a server that moves keeps its ids),
//! and carries an epoch that every routing change raises. Routing an id is one hash and one
//! table lookup, whatever the number of servers. A dense table lives on the owner of the slot of
//! its name's [`key`].
//!
//! A table without explicit ranges is the *uniform* one of `n` servers ([`SlotTable::uniform`]),
//! a function of `n` alone, so every client with the same number of servers routes alike. [`Rendezvous`] is the routing of cluster snapshots of format version 2 and older
//! (highest random weight over the address strings), kept to read them.

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Result};
use crate::hash::{mix64, SLOT_BITS};
/// The slots themselves are the hash layer's (a table's budget classes its shards by them).
pub use crate::hash::{slot_of, slot_of_mix, SLOTS};

/// The most servers a slot table addresses.
pub const MAX_SERVERS: usize = SLOTS;

/// Stripes of the uniform table: the default shard count of a sparse table.
const STRIPES: usize = 64;

/// The first and one-past-the-last LMDB key (`mix64(id)` big-endian) of slot `s`.
pub fn slot_key_range(s: usize) -> (u64, Option<u64>) {
    let lo = (s as u64) << (64 - SLOT_BITS);
    let hi = (s + 1 < SLOTS).then(|| ((s + 1) as u64) << (64 - SLOT_BITS));
    (lo, hi)
}

/// The key of a name (a server's address, a dense table's name): FNV-1a, mixed.
pub fn key(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// One run of slots with one owner: `[start, end)` owned by server position `owner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRange {
    /// The first slot.
    pub start: u32,
    /// One past the last slot.
    pub end: u32,
    /// The owner's position in the server list.
    pub owner: u32,
}

/// The serde form of a slot table: `{"epoch": e, "servers": n, "ranges": [[start, end, owner],
/// ...]}`, the ranges covering `0..16384` in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotTableSpec {
    /// The routing epoch.
    pub epoch: u64,
    /// How many servers the table addresses (owners are below it).
    pub servers: u32,
    /// `[start, end, owner]` triples, contiguous from slot 0 to 16384.
    pub ranges: Vec<[u32; 3]>,
}

/// Each slot's owner, and the epoch of this assignment.
#[derive(Clone, PartialEq, Eq)]
pub struct SlotTable {
    epoch: u64,
    servers: usize,
    owners: Box<[u32]>,
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable")
            .field("epoch", &self.epoch)
            .field("servers", &self.servers)
            .field("ranges", &self.ranges().len())
            .finish()
    }
}

impl SlotTable {
    /// The uniform table of `servers` servers at epoch 0: every server owns 16384 / servers
    /// slots (give or take one), contiguous ranges in *striped* order. The slots are 64 stripes
    /// of 256 (stripe `s / 256`, offset `s % 256`); slot `s` has rank `offset * 64 + stripe`
    /// and is owned by `rank * servers / 16384`. So up to 256 servers, each owns one run of
    /// slots in every stripe: a server's ids spread over all 64 shards of its tables and over
    /// all its LMDB environments (both are ranges of `mix64(id)`, as the stripes are), where
    /// contiguous runs in slot order would put them all into 64 / servers of its shards.
    pub fn uniform(servers: usize) -> Result<Self> {
        check_count(servers)?;
        let per_stripe = SLOTS / STRIPES;
        let owners = (0..SLOTS)
            .map(|s| {
                let rank = (s % per_stripe) * STRIPES + s / per_stripe;
                (rank * servers / SLOTS) as u32
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Ok(Self {
            epoch: 0,
            servers,
            owners,
        })
    }

    /// A table from its ranges, checked: they cover every slot once, in order, and every owner
    /// is below `servers`.
    pub fn from_ranges(epoch: u64, servers: usize, ranges: &[SlotRange]) -> Result<Self> {
        check_count(servers)?;
        let mut owners = vec![0u32; SLOTS];
        let mut next = 0u32;
        for r in ranges {
            if r.start != next || r.end <= r.start || r.end as usize > SLOTS {
                return Err(invalid(format!(
                    "slot table: range [{}, {}) does not continue at slot {next} (the ranges \
                     must cover slots 0 to {SLOTS} in order, each non-empty)",
                    r.start, r.end
                )));
            }
            if r.owner as usize >= servers {
                return Err(invalid(format!(
                    "slot table: range [{}, {}) is owned by server {}, the table has {servers} \
                     servers (positions 0 to {})",
                    r.start,
                    r.end,
                    r.owner,
                    servers - 1
                )));
            }
            owners[r.start as usize..r.end as usize].fill(r.owner);
            next = r.end;
        }
        if next as usize != SLOTS {
            return Err(invalid(format!(
                "slot table: the ranges end at slot {next}, they must reach {SLOTS}"
            )));
        }
        Ok(Self {
            epoch,
            servers,
            owners: owners.into_boxed_slice(),
        })
    }

    /// A table from its owners, one per slot.
    pub fn from_owners(epoch: u64, servers: usize, owners: Vec<u32>) -> Result<Self> {
        check_count(servers)?;
        if owners.len() != SLOTS {
            return Err(invalid(format!(
                "slot table: {} owners, one per slot ({SLOTS}) expected",
                owners.len()
            )));
        }
        if let Some((s, o)) = owners
            .iter()
            .enumerate()
            .find(|(_, &o)| o as usize >= servers)
        {
            return Err(invalid(format!(
                "slot table: slot {s} is owned by server {o}, the table has {servers} servers"
            )));
        }
        Ok(Self {
            epoch,
            servers,
            owners: owners.into_boxed_slice(),
        })
    }

    /// The table of a serde form.
    pub fn from_spec(spec: &SlotTableSpec) -> Result<Self> {
        let ranges: Vec<SlotRange> = spec
            .ranges
            .iter()
            .map(|&[start, end, owner]| SlotRange { start, end, owner })
            .collect();
        Self::from_ranges(spec.epoch, spec.servers as usize, &ranges)
    }

    /// The serde form.
    pub fn spec(&self) -> SlotTableSpec {
        SlotTableSpec {
            epoch: self.epoch,
            servers: self.servers as u32,
            ranges: self
                .ranges()
                .iter()
                .map(|r| [r.start, r.end, r.owner])
                .collect(),
        }
    }

    /// Parses the JSON of a serde form.
    pub fn from_json(text: &str) -> Result<Self> {
        let spec: SlotTableSpec = serde_json::from_str(text).map_err(|e| {
            invalid(format!(
                "slot table: {e} (expected {{\"epoch\": E, \"servers\": N, \"ranges\": \
                 [[START, END, OWNER], ...]}})"
            ))
        })?;
        Self::from_spec(&spec)
    }

    /// The JSON of the serde form.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.spec()).unwrap_or_default()
    }

    /// The same owners under another epoch.
    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many servers the table addresses.
    pub fn servers(&self) -> usize {
        self.servers
    }

    /// The owner of slot `s`.
    #[inline]
    pub fn owner_of_slot(&self, s: usize) -> usize {
        self.owners[s] as usize
    }

    /// The owner of `id`.
    #[inline]
    pub fn server_of(&self, id: u64) -> usize {
        self.owners[slot_of(id)] as usize
    }

    /// The server of a dense table: the owner of the slot of its name's key.
    pub fn dense_home(&self, name: &str) -> usize {
        self.server_of(key(name))
    }

    /// Each slot's owner.
    pub fn owners(&self) -> &[u32] {
        &self.owners
    }

    /// The runs of equal owners, in slot order.
    pub fn ranges(&self) -> Vec<SlotRange> {
        let mut out: Vec<SlotRange> = Vec::new();
        for (s, &o) in self.owners.iter().enumerate() {
            match out.last_mut() {
                Some(r) if r.owner == o => r.end = s as u32 + 1,
                _ => out.push(SlotRange {
                    start: s as u32,
                    end: s as u32 + 1,
                    owner: o,
                }),
            }
        }
        out
    }

    /// The slots each server owns.
    pub fn slots_per_server(&self) -> Vec<usize> {
        let mut n = vec![0; self.servers];
        for &o in self.owners.iter() {
            n[o as usize] += 1;
        }
        n
    }

    /// A digest of the owners (not the epoch): equal for tables that route alike.
    pub fn digest(&self) -> u64 {
        let mut h = mix64(self.servers as u64 ^ 0x5107_5107);
        for r in self.ranges() {
            h = mix64(h ^ ((r.start as u64) << 32 | r.owner as u64));
        }
        h
    }

    /// The positions of `ids` per server, in the order of `ids`.
    pub fn split(&self, ids: &[u64]) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); self.servers];
        if self.servers == 1 {
            out[0] = (0..ids.len() as u32).collect();
            return out;
        }
        for (p, &id) in ids.iter().enumerate() {
            out[self.server_of(id)].push(p as u32);
        }
        out
    }
}

impl SlotTable {
    /// The wire form.
    pub fn to_proto(&self) -> crate::net::proto::SlotOwners {
        let ranges = self.ranges();
        crate::net::proto::SlotOwners {
            epoch: self.epoch,
            servers: self.servers as u32,
            starts: ranges.iter().map(|r| r.start).collect(),
            owners: ranges.iter().map(|r| r.owner).collect(),
        }
    }

    /// A table from its wire form, checked as [`from_ranges`](Self::from_ranges).
    pub fn from_proto(p: &crate::net::proto::SlotOwners) -> Result<Self> {
        if p.starts.len() != p.owners.len() {
            return Err(invalid(format!(
                "slot table: {} starts and {} owners",
                p.starts.len(),
                p.owners.len()
            )));
        }
        let ranges: Vec<SlotRange> = (0..p.starts.len())
            .map(|i| SlotRange {
                start: p.starts[i],
                end: p.starts.get(i + 1).copied().unwrap_or(SLOTS as u32),
                owner: p.owners[i],
            })
            .collect();
        Self::from_ranges(p.epoch, p.servers as usize, &ranges)
    }
}

/// The hash of a cluster's layout: its server list, in order, and the owners of its slot table
/// (not the epoch). Two clients route alike exactly when their hashes are equal.
pub fn layout_hash<S: AsRef<str>>(servers: &[S], table: &SlotTable) -> String {
    let mut h = mix64(servers.len() as u64 ^ 0x51_0715);
    for s in servers {
        h = mix64(h ^ key(s.as_ref()));
    }
    h = mix64(h ^ table.digest());
    format!("{h:016x}")
}

fn check_count(servers: usize) -> Result<()> {
    if servers == 0 || servers > MAX_SERVERS {
        return Err(invalid(format!(
            "slot table: {servers} servers; a table has 1 to {MAX_SERVERS}"
        )));
    }
    Ok(())
}

/// Rendezvous (highest random weight) routing over address strings: the routing of cluster
/// snapshots of format version 2 and older. An id goes to the server whose
/// `mix64(mix64(id) ^ key(name))` is largest; one hash per server per id.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    keys: Vec<u64>,
}

impl Rendezvous {
    /// A router over servers named `names`.
    pub fn new<S: AsRef<str>>(names: &[S]) -> Self {
        Self {
            keys: names.iter().map(|n| key(n.as_ref())).collect(),
        }
    }

    /// The server of one id.
    pub fn server_of(&self, id: u64) -> usize {
        let h = mix64(id);
        let mut best = 0;
        let mut best_score = 0u64;
        for (i, &k) in self.keys.iter().enumerate() {
            let s = mix64(h ^ k);
            if i == 0 || s > best_score {
                best = i;
                best_score = s;
            }
        }
        best
    }
}

/// How a set of rows was spread over servers: the routing of a cluster snapshot or of a
/// cluster.
#[derive(Debug, Clone)]
pub enum Routing {
    /// Hash slots (format version 3 and this build's clusters).
    Slots(SlotTable),
    /// Rendezvous over address strings (cluster snapshots of version 2 and older).
    Rendezvous(Rendezvous),
}

impl Routing {
    /// The server of one id.
    pub fn server_of(&self, id: u64) -> usize {
        match self {
            Routing::Slots(t) => t.server_of(id),
            Routing::Rendezvous(r) => r.server_of(id),
        }
    }

    /// The server of a dense table.
    pub fn dense_home(&self, name: &str) -> usize {
        self.server_of(key(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_contiguous_key_ranges() {
        for id in 0..20_000u64 {
            let m = mix64(id);
            let s = slot_of(id);
            let (lo, hi) = slot_key_range(s);
            assert!(m >= lo && hi.is_none_or(|h| m < h), "{id}");
        }
        assert_eq!(slot_key_range(SLOTS - 1).1, None);
        assert_eq!(slot_key_range(1).0, 1u64 << 50);
    }

    #[test]
    fn uniform_tables_are_even_and_striped() {
        for n in [1usize, 2, 3, 7, 100, 256, 1000] {
            let t = SlotTable::uniform(n).unwrap();
            if n <= 256 {
                // One run per server per stripe.
                assert_eq!(
                    t.ranges().len(),
                    n * STRIPES - (STRIPES - 1) * (n == 1) as usize
                );
                for server in 0..n {
                    let stripes: std::collections::HashSet<usize> = (0..SLOTS)
                        .filter(|&s| t.owner_of_slot(s) == server)
                        .map(|s| s / (SLOTS / STRIPES))
                        .collect();
                    assert_eq!(stripes.len(), STRIPES, "{n} servers: server {server}");
                }
            }
            let per = t.slots_per_server();
            let (lo, hi) = (per.iter().min().unwrap(), per.iter().max().unwrap());
            assert!(hi - lo <= 1, "{n}: {lo} to {hi}");
            assert_eq!(SlotTable::from_spec(&t.spec()).unwrap(), t);
        }
        let t = SlotTable::uniform(3).unwrap();
        let ids: Vec<u64> = (0..90_000u64).collect();
        for part in t.split(&ids) {
            assert!((part.len() as i64 - 30_000).abs() < 1_000, "{}", part.len());
        }
    }

    #[test]
    fn bad_tables_are_refused_with_the_reason() {
        let bad = |json: &str, what: &str| {
            let e = SlotTable::from_json(json).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        bad(
            r#"{"epoch": 1, "servers": 2, "ranges": [[0, 100, 0]]}"#,
            "reach 16384",
        );
        bad(
            r#"{"epoch": 1, "servers": 2, "ranges": [[0, 100, 0], [101, 16384, 1]]}"#,
            "continue at slot 100",
        );
        bad(
            r#"{"epoch": 1, "servers": 2, "ranges": [[0, 16384, 2]]}"#,
            "owned by server 2",
        );
        bad(r#"{"epoch": 1, "servers": 0, "ranges": []}"#, "0 servers");
        bad(r#"{"epoch": 1, "ranges": []}"#, "servers");
        bad(
            r#"{"epoch": 1, "servers": 1, "ranges": [], "x": 1}"#,
            "unknown field",
        );
        let t = SlotTable::uniform(5).unwrap().with_epoch(3);
        assert_eq!(SlotTable::from_proto(&t.to_proto()).unwrap(), t);
        let e = SlotTable::from_owners(0, 2, vec![0; 10]).unwrap_err();
        assert!(e.to_string().contains("one per slot"), "{e}");
    }

    #[test]
    fn digest_tells_routings_apart_and_ignores_the_epoch() {
        let a = SlotTable::uniform(3).unwrap();
        let b = SlotTable::uniform(4).unwrap();
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.digest(), a.clone().with_epoch(9).digest());
        let mut owners = a.owners().to_vec();
        owners[5] = 2;
        let c = SlotTable::from_owners(0, 3, owners).unwrap();
        assert_ne!(a.digest(), c.digest());
    }

    #[test]
    fn rendezvous_is_kept_for_old_snapshots() {
        let names: Vec<String> = (0..4).map(|i| format!("10.0.0.{i}:7070")).collect();
        let mut rev = names.clone();
        rev.reverse();
        let (a, b) = (Rendezvous::new(&names), Rendezvous::new(&rev));
        for id in 0..10_000u64 {
            assert_eq!(names[a.server_of(id)], rev[b.server_of(id)]);
        }
    }
}
