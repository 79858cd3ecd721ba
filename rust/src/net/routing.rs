//! Which server holds an id: rendezvous (highest-random-weight) hashing.
//!
//! Each server is named by the address string the client was given. An id goes to the server
//! whose `mix64(mix64(id) ^ key(name))` is largest. Every client with the same list of names
//! routes every id the same way, whatever the order of the list. Adding a server to N moves only
//! the ids that the new server now wins, about 1/(N+1) of them; removing one moves only its own
//! ids. The cost is one hash per server per id, small next to the network for the cluster sizes
//! this version targets (tens of servers).

use crate::hash::mix64;

/// The key of a name (a server's address, a dense table's name): FNV-1a, mixed.
pub fn key(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// Routes ids to servers.
#[derive(Debug, Clone)]
pub struct Router {
    keys: Vec<u64>,
}

impl Router {
    /// A router over servers named `names`.
    pub fn new<S: AsRef<str>>(names: &[S]) -> Self {
        Self {
            keys: names.iter().map(|n| key(n.as_ref())).collect(),
        }
    }

    /// Number of servers.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when there is no server.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
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

    /// The positions of `ids` per server, in the order of `ids`.
    pub fn split(&self, ids: &[u64]) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); self.keys.len()];
        if self.keys.len() == 1 {
            out[0] = (0..ids.len() as u32).collect();
            return out;
        }
        for (p, &id) in ids.iter().enumerate() {
            out[self.server_of(id)].push(p as u32);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:7070")).collect()
    }

    #[test]
    fn order_of_the_list_does_not_matter() {
        let a = names(4);
        let mut b = a.clone();
        b.reverse();
        let (ra, rb) = (Router::new(&a), Router::new(&b));
        for id in 0..10_000u64 {
            assert_eq!(a[ra.server_of(id)], b[rb.server_of(id)]);
        }
    }

    #[test]
    fn adding_a_server_moves_about_one_in_n_plus_one() {
        let n = 100_000u64;
        for servers in 1..6 {
            let before = names(servers);
            let after = names(servers + 1);
            let (r0, r1) = (Router::new(&before), Router::new(&after));
            let mut moved = 0;
            for id in 0..n {
                let (x, y) = (r0.server_of(id), r1.server_of(id));
                if before[x] != after[y] {
                    // Only to the new server, never between old ones.
                    assert_eq!(y, servers);
                    moved += 1;
                }
            }
            let want = n as f64 / (servers + 1) as f64;
            assert!(
                (moved as f64 - want).abs() < 0.05 * want,
                "{servers}: {moved}"
            );
        }
    }

    #[test]
    fn load_is_even() {
        let r = Router::new(&names(3));
        let ids: Vec<u64> = (0..90_000u64).collect();
        for part in r.split(&ids) {
            assert!((part.len() as i64 - 30_000).abs() < 1_000, "{}", part.len());
        }
    }
}
