//! What does routing an id to its server cost, with the slot table against rendezvous hashing?
//!
//! Rendezvous (the routing of cluster snapshots up to version 2) hashes each id once per
//! server; the slot table hashes it once and reads one entry of a 16,384-entry table. For 3, 100
//! and 1,000 servers (simulated: only the addresses and the table exist) this times
//! `server_of` over a batch of ids and the client's `split` of a 4,096-id batch into per-server
//! positions, and reports nanoseconds per id (median of `REPS` runs). Run with
//! `cargo bench --bench routing`.

use std::hint::black_box;
use std::time::Instant;

use pstore::net::routing::{Rendezvous, SlotTable};

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
}
