//! What does routing an id to its server cost, with the slot table against rendezvous hashing?
//!
//! Rendezvous (the routing of cluster snapshots up to version 2) hashes each id once per
//! server; the slot table hashes it once and reads one entry of a 16,384-entry table. For 3, 100
//! and 1,000 servers (simulated: only the addresses and the table exist) this times
//! `server_of` over a batch of ids and the client's `split` of a 4,096-id batch into per-server
//! positions, and reports nanoseconds per id (median of `REPS` runs); then how many of a
//! table's 64 shards hold one server's ids under the uniform (striped) table and under
//! contiguous runs in slot order. Run with `cargo bench --bench routing`.

use std::hint::black_box;
use std::time::Instant;

use pstore::hash::shard_of;
use pstore::net::routing::{Rendezvous, SlotTable, SLOTS};

const SERVERS: [usize; 3] = [3, 100, 1000];
const REPS: usize = 9;
const BATCH: usize = 4096;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// Nanoseconds per id of `f` over `ids`, median of REPS runs after one warm-up.
fn per_id(ids: &[u64], mut f: impl FnMut(&[u64]) -> usize) -> f64 {
    black_box(f(ids));
    let runs = (0..REPS)
        .map(|_| {
            let t = Instant::now();
            black_box(f(ids));
            t.elapsed().as_secs_f64() * 1e9 / ids.len() as f64
        })
        .collect();
    median(runs)
}

fn main() {
    // Ids as a recommender sees them: spread, not consecutive.
    let ids: Vec<u64> = (0..1u64 << 20)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 13)
        .collect();
    let batch = &ids[..BATCH];
    println!("routing cost per id (ns), median of {REPS} runs");
    println!(
        "{:>8} | {:>16} {:>16} | {:>16} {:>16}",
        "servers", "rendezvous", "slot table", "rendezvous split", "slot table split"
    );
    for n in SERVERS {
        let names: Vec<String> = (0..n)
            .map(|i| format!("10.0.{}.{}:7070", i / 250, i % 250))
            .collect();
        let rv = Rendezvous::new(&names);
        let st = SlotTable::uniform(n).expect("a table of n servers");
        // Rendezvous over 1,000 servers is slow: fewer ids keep the run short.
        let some = &ids[..if n >= 1000 { 1 << 14 } else { ids.len() }];
        let rv_one = per_id(some, |ids| ids.iter().map(|&id| rv.server_of(id)).sum());
        let st_one = per_id(&ids, |ids| ids.iter().map(|&id| st.server_of(id)).sum());
        let rv_split = per_id(batch, |ids| {
            let mut out = vec![Vec::new(); n];
            for (p, &id) in ids.iter().enumerate() {
                out[rv.server_of(id)].push(p as u32);
            }
            out.iter().map(Vec::len).sum()
        });
        let st_split = per_id(batch, |ids| st.split(ids).iter().map(Vec::len).sum());
        println!("{n:>8} | {rv_one:>16.2} {st_one:>16.2} | {rv_split:>16.2} {st_split:>16.2}");
    }
    // Where a server's ids land inside it: a table's 64 shards are ranges of mix64(id), as the
    // slots are, so the uniform table's shape decides how many shards a server's ids use.
    println!("\nshards (of 64) holding server 0's ids: uniform (striped) table, contiguous runs");
    for n in SERVERS {
        let striped = SlotTable::uniform(n).expect("a table of n servers");
        let contiguous =
            SlotTable::from_owners(0, n, (0..SLOTS).map(|s| (s * n / SLOTS) as u32).collect())
                .expect("a table of n servers");
        let used = |t: &SlotTable| {
            let mut shards = std::collections::HashSet::new();
            for &id in &ids {
                if t.server_of(id) == 0 {
                    shards.insert(shard_of(id, 64));
                }
            }
            shards.len()
        };
        println!("{n:>8} | {:>4} {:>4}", used(&striped), used(&contiguous));
    }
}
