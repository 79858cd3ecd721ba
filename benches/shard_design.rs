//! Which concurrency design should a sparse table's shards use?
//!
//! Many Python threads pull and push the same table at once. No worker may serialise on a table-wide
//! lock, and no reader may see a torn row. This bench compares two designs on a model of a sharded
//! sparse table (64 shards, each an id -> slot map plus an arena of rows `[w; 64][adagrad sum; 64]`,
//! about 1M rows pre-populated), with skewed ids:
//!
//! * **A (locks)**: each shard behind a `RwLock`. A batch is grouped by shard; a push write-locks each
//!   shard it touches once and applies Adagrad there, a pull read-locks each shard once and copies the
//!   rows out. The shards of one batch run in parallel on a rayon pool of `WORKERS` threads.
//! * **B (writer per shard)**: `WORKERS` writer threads own disjoint shards and are fed by `std::sync::mpsc`
//!   queues (lock-free in the fast path). A push copies each writer's sub-batches (ids and gradients)
//!   into a message and waits for the acks, so it returns once applied. Pulls go through the same
//!   queues as requests: a pull creates missing rows and the arena may move when it grows, so only the
//!   owner can touch a shard without a lock; the writer copies rows straight into the caller's output.
//!
//! The work inside a shard (map lookups, coalescing duplicate ids, Adagrad in f64, row copies) is the
//! same code in both designs; only the dispatch differs. Run with
//! `cargo bench --bench shard_design`. Self-contained: only std and rayon.

use rayon::prelude::*;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Barrier, RwLock};
use std::thread;
use std::time::{Duration, Instant};

const DIM: usize = 64;
/// Weights then the Adagrad accumulator, side by side.
const STRIDE: usize = 2 * DIM;
const NUM_SHARDS: usize = 64;
const NUM_ROWS: u64 = 1 << 20;
/// Rayon threads for A, writer threads for B: the cores of this machine.
const WORKERS: usize = 2;
const CALLERS: [usize; 3] = [1, 2, 4];
const BATCHES: [usize; 2] = [4096, 65536];
const REPS: usize = 9;
/// Ids handled by all callers together in one timed run.
const IDS_PER_RUN: usize = 1 << 18;

const LR: f64 = 0.01;
const EPS: f64 = 1e-10;
const INITIAL_ACC: f32 = 0.1;

/// splitmix64's finaliser: a multiply-xorshift mix of all 64 bits.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The shard comes from a salted hash, independent of the map's hash: with the same hash, every key
/// of a shard would share the bits the map uses to pick a bucket (low bits) or its tag (top bits).
fn shard_of(id: u64) -> usize {
    ((u128::from(mix(id ^ 0x5EED_5EED_5EED_5EED)) * NUM_SHARDS as u128) >> 64) as usize
}

/// A fast hasher for u64 ids: one multiply, then fold the high half into the low half so that both
/// the bucket bits (low) and the tag bits (high) depend on every bit of the id.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, id: u64) {
        let h = (id ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type IdMap = HashMap<u64, u32, BuildHasherDefault<IdHasher>>;

/// One shard: id -> slot, and the rows in one contiguous arena.
struct Shard {
    map: IdMap,
    arena: Vec<f32>,
}

impl Shard {
    fn with_capacity(rows: usize) -> Self {
        Shard {
            map: IdMap::with_capacity_and_hasher(rows, Default::default()),
            arena: Vec::with_capacity(rows * STRIDE),
        }
    }

    fn slot(&self, id: u64) -> Option<usize> {
        self.map.get(&id).map(|&s| s as usize)
    }

    /// Initialisation is a pure function of the id, so both designs start from the same table.
    fn slot_or_insert(&mut self, id: u64) -> usize {
        let next = self.map.len() as u32;
        let slot = *self.map.entry(id).or_insert(next) as usize;
        if slot == next as usize {
            let mut r = mix(id) | 1;
            for _ in 0..DIM {
                r = xorshift(r);
                self.arena
                    .push(((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02);
            }
            self.arena.resize(self.arena.len() + DIM, INITIAL_ACC);
        }
        slot
    }

    fn weights(&self, slot: usize) -> &[f32] {
        &self.arena[slot * STRIDE..slot * STRIDE + DIM]
    }

    /// Duplicate ids are coalesced (gradients summed in f64), then Adagrad runs once per row.
    fn push<'g>(&mut self, rows: impl Iterator<Item = (u64, &'g [f32])>) {
        let mut pairs: Vec<(usize, &[f32])> =
            rows.map(|(id, g)| (self.slot_or_insert(id), g)).collect();
        pairs.sort_unstable_by_key(|&(slot, _)| slot);
        let mut sum = [0f64; DIM];
        for run in pairs.chunk_by(|a, b| a.0 == b.0) {
            sum.fill(0.0);
            for (_, g) in run {
                for (s, &x) in sum.iter_mut().zip(g.iter()) {
                    *s += f64::from(x);
                }
            }
            let row = &mut self.arena[run[0].0 * STRIDE..(run[0].0 + 1) * STRIDE];
            let (w, acc) = row.split_at_mut(DIM);
            for ((w, acc), &g) in w.iter_mut().zip(acc.iter_mut()).zip(sum.iter()) {
                let a = f64::from(*acc) + g * g;
                *acc = a as f32;
                *w = (f64::from(*w) - LR * g / (a.sqrt() + EPS)) as f32;
            }
        }
    }
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// Fills shard `s` of a fresh table with every id below `NUM_ROWS` that hashes to it.
fn build_shards(wanted: impl Fn(usize) -> bool) -> Vec<Option<Shard>> {
    let per_shard = (NUM_ROWS as usize / NUM_SHARDS) * 11 / 10;
    let mut shards: Vec<Option<Shard>> = (0..NUM_SHARDS)
        .map(|s| wanted(s).then(|| Shard::with_capacity(per_shard)))
        .collect();
    for id in 0..NUM_ROWS {
        if let Some(shard) = shards[shard_of(id)].as_mut() {
            shard.slot_or_insert(id);
        }
    }
    shards
}

/// A batch's positions, sorted by shard (a counting sort).
struct Grouped {
    order: Vec<u32>,
    starts: [usize; NUM_SHARDS + 1],
}

impl Grouped {
    fn new(ids: &[u64]) -> Self {
        let shard: Vec<u8> = ids.iter().map(|&id| shard_of(id) as u8).collect();
        let mut starts = [0usize; NUM_SHARDS + 1];
        for &s in &shard {
            starts[s as usize + 1] += 1;
        }
        for s in 0..NUM_SHARDS {
            starts[s + 1] += starts[s];
        }
        let mut next = starts;
        let mut order = vec![0u32; ids.len()];
        for (p, &s) in shard.iter().enumerate() {
            order[next[s as usize]] = p as u32;
            next[s as usize] += 1;
        }
        Grouped { order, starts }
    }

    fn positions(&self, shard: usize) -> &[u32] {
        &self.order[self.starts[shard]..self.starts[shard + 1]]
    }
}

/// The output of a pull, whose rows are written by several threads at once.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);

// SAFETY: a batch's positions are partitioned by shard, so each row is written by one thread only, and
// the caller neither reads nor frees the buffer before every shard of the pull has finished.
unsafe impl Send for OutRows {}
// SAFETY: as for Send.
unsafe impl Sync for OutRows {}

impl OutRows {
    /// # Safety
    /// Row `pos` is in bounds and no other thread touches it while the returned slice lives.
    unsafe fn row<'a>(self, pos: u32) -> &'a mut [f32] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(pos as usize * DIM), DIM) }
    }
}

trait Table: Sync {
    /// The rows of `ids`, `ids.len() * DIM` floats, creating missing rows.
    fn pull(&self, ids: &[u64]) -> Vec<f32>;
    /// Applies `grads` (`ids.len() * DIM` floats); returns once applied.
    fn push(&self, ids: &[u64], grads: &[f32]);
}

/// Design A: a `RwLock` per shard, each shard locked once per batch, shards in parallel on rayon.
struct Locked {
    shards: Vec<RwLock<Shard>>,
    pool: rayon::ThreadPool,
}

impl Locked {
    fn new() -> Self {
        let shards = build_shards(|_| true)
            .into_iter()
            .map(|s| RwLock::new(s.expect("every shard is built")))
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(WORKERS)
            .build()
            .expect("rayon pool");
        Locked { shards, pool }
    }
}

impl Table for Locked {
    fn pull(&self, ids: &[u64]) -> Vec<f32> {
        let grouped = Grouped::new(ids);
        let mut out = vec![0f32; ids.len() * DIM];
        let rows = OutRows(out.as_mut_ptr());
        self.pool.install(|| {
            (0..NUM_SHARDS).into_par_iter().for_each(|s| {
                let positions = grouped.positions(s);
                if positions.is_empty() {
                    return;
                }
                let mut missing = Vec::new();
                {
                    let shard = self.shards[s].read().expect("poisoned");
                    for &p in positions {
                        match shard.slot(ids[p as usize]) {
                            Some(slot) => {
                                // SAFETY: position p belongs to shard s only; `out` outlives the
                                // install.
                                unsafe { rows.row(p) }.copy_from_slice(shard.weights(slot))
                            }
                            None => missing.push(p),
                        }
                    }
                }
                if !missing.is_empty() {
                    let mut shard = self.shards[s].write().expect("poisoned");
                    for p in missing {
                        let slot = shard.slot_or_insert(ids[p as usize]);
                        // SAFETY: as above.
                        unsafe { rows.row(p) }.copy_from_slice(shard.weights(slot));
                    }
                }
            })
        });
        out
    }

    fn push(&self, ids: &[u64], grads: &[f32]) {
        let grouped = Grouped::new(ids);
        self.pool.install(|| {
            (0..NUM_SHARDS).into_par_iter().for_each(|s| {
                let positions = grouped.positions(s);
                if positions.is_empty() {
                    return;
                }
                let mut shard = self.shards[s].write().expect("poisoned");
                shard.push(positions.iter().map(|&p| {
                    let p = p as usize;
                    (ids[p], &grads[p * DIM..(p + 1) * DIM])
                }));
            })
        });
    }
}

/// One writer's share of a batch: `(shard, end)` runs over `ids` (and `grads` or `positions`).
enum Request {
    Push {
        runs: Vec<(usize, usize)>,
        ids: Vec<u64>,
        grads: Vec<f32>,
        done: Sender<()>,
    },
    Pull {
        runs: Vec<(usize, usize)>,
        ids: Vec<u64>,
        positions: Vec<u32>,
        out: OutRows,
        done: Sender<()>,
    },
}

/// Design B: writer `w` owns shards `s` with `s % WORKERS == w` and serves requests from its queue.
struct Writers {
    queues: Vec<Sender<Request>>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Writers {
    fn new() -> Self {
        let (queues, threads) = (0..WORKERS)
            .map(|w| {
                let shards: Vec<Shard> = build_shards(|s| s % WORKERS == w)
                    .into_iter()
                    .flatten()
                    .collect();
                let (tx, rx) = mpsc::channel();
                (tx, thread::spawn(move || writer(shards, rx)))
            })
            .unzip();
        Writers { queues, threads }
    }

    /// Sends each writer its part of the batch, built by `make`; waits for every ack.
    fn dispatch(
        &self,
        grouped: &Grouped,
        make: impl Fn(Vec<(usize, usize)>, &[u32], Sender<()>) -> Request,
    ) {
        let (done, acks) = mpsc::channel();
        let mut sent = 0;
        let mut positions = Vec::new();
        for (w, queue) in self.queues.iter().enumerate() {
            positions.clear();
            let mut runs = Vec::new();
            for s in (w..NUM_SHARDS).step_by(WORKERS) {
                let p = grouped.positions(s);
                if !p.is_empty() {
                    positions.extend_from_slice(p);
                    runs.push((s / WORKERS, positions.len()));
                }
            }
            if !runs.is_empty() {
                queue
                    .send(make(runs, &positions, done.clone()))
                    .expect("writer gone");
                sent += 1;
            }
        }
        for _ in 0..sent {
            acks.recv().expect("writer gone");
        }
    }
}

fn writer(mut shards: Vec<Shard>, queue: Receiver<Request>) {
    for request in queue {
        match request {
            Request::Push {
                runs,
                ids,
                grads,
                done,
            } => {
                let mut start = 0;
                for (s, end) in runs {
                    shards[s].push(
                        ids[start..end]
                            .iter()
                            .copied()
                            .zip(grads[start * DIM..end * DIM].chunks_exact(DIM)),
                    );
                    start = end;
                }
                let _ = done.send(());
            }
            Request::Pull {
                runs,
                ids,
                positions,
                out,
                done,
            } => {
                let mut start = 0;
                for (s, end) in runs {
                    let shard = &mut shards[s];
                    for (&id, &p) in ids[start..end].iter().zip(&positions[start..end]) {
                        let slot = shard.slot_or_insert(id);
                        // SAFETY: position p is in this request only; the caller waits for the ack.
                        unsafe { out.row(p) }.copy_from_slice(shard.weights(slot));
                    }
                    start = end;
                }
                let _ = done.send(());
            }
        }
    }
}

impl Table for Writers {
    fn pull(&self, ids: &[u64]) -> Vec<f32> {
        let grouped = Grouped::new(ids);
        let mut out = vec![0f32; ids.len() * DIM];
        let rows = OutRows(out.as_mut_ptr());
        self.dispatch(&grouped, |runs, positions, done| Request::Pull {
            runs,
            ids: positions.iter().map(|&p| ids[p as usize]).collect(),
            positions: positions.to_vec(),
            out: rows,
            done,
        });
        out
    }

    fn push(&self, ids: &[u64], grads: &[f32]) {
        let grouped = Grouped::new(ids);
        self.dispatch(&grouped, |runs, positions, done| {
            let mut g = Vec::with_capacity(positions.len() * DIM);
            for &p in positions {
                let p = p as usize;
                g.extend_from_slice(&grads[p * DIM..(p + 1) * DIM]);
            }
            Request::Push {
                runs,
                ids: positions.iter().map(|&p| ids[p as usize]).collect(),
                grads: g,
                done,
            }
        });
    }
}

impl Drop for Writers {
    fn drop(&mut self) {
        self.queues.clear();
        for t in self.threads.drain(..) {
            t.join().expect("writer panicked");
        }
    }
}

/// Skewed ids: 90% from a power law over `[0, NUM_ROWS)` (density ~ x^-0.83), 10% uniform.
fn make_ids(n: usize, seed: u64) -> Vec<u64> {
    let mut r = mix(seed) | 1;
    (0..n)
        .map(|_| {
            r = xorshift(r);
            let u = (r >> 11) as f64 / (1u64 << 53) as f64;
            r = xorshift(r);
            let x = if r.is_multiple_of(10) { u } else { u.powi(6) };
            ((x * NUM_ROWS as f64) as u64).min(NUM_ROWS - 1)
        })
        .collect()
}

fn make_grads(n: usize, seed: u64) -> Vec<f32> {
    let mut r = mix(seed) | 1;
    (0..n * DIM)
        .map(|_| {
            r = xorshift(r);
            ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

struct RunResult {
    ids_per_sec: f64,
    cpu_ns_per_id: f64,
    push_latencies: Vec<Duration>,
}

/// CPU time of the whole process (every thread, live or exited), from `/proc/self/stat`.
/// Other processes share this machine, so CPU time per id is reported next to wall-clock rates.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or("");
    let ticks: u64 = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|t| t.parse::<u64>().ok())
        .sum();
    // USER_HZ is 100 on every Linux ABI.
    Duration::from_millis(ticks * 10)
}

/// Every caller thread runs its batches (`mixed`: pull then push the same batch, else push only).
fn run(
    table: &dyn Table,
    work: &[Vec<u64>],
    grads: &[Vec<f32>],
    batch: usize,
    mixed: bool,
) -> RunResult {
    let barrier = Barrier::new(work.len() + 1);
    thread::scope(|scope| {
        let callers: Vec<_> = work
            .iter()
            .zip(grads)
            .map(|(ids, grads)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let mut latencies = Vec::new();
                    for ids in ids.chunks_exact(batch) {
                        if mixed {
                            black_box(table.pull(ids));
                        }
                        let t = Instant::now();
                        table.push(ids, grads);
                        latencies.push(t.elapsed());
                    }
                    latencies
                })
            })
            .collect();
        let cpu = process_cpu();
        barrier.wait();
        let start = Instant::now();
        let mut push_latencies = Vec::new();
        for c in callers {
            push_latencies.extend(c.join().expect("caller panicked"));
        }
        let elapsed = start.elapsed().as_secs_f64();
        let cpu = (process_cpu() - cpu).as_secs_f64();
        let ids = work.iter().map(Vec::len).sum::<usize>() as f64;
        RunResult {
            ids_per_sec: ids / elapsed,
            cpu_ns_per_id: cpu * 1e9 / ids,
            push_latencies,
        }
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn percentile(xs: &mut [Duration], q: f64) -> Duration {
    xs.sort_unstable();
    xs[((xs.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Both designs must give the same rows before and after the same push.
fn check_same(a: &dyn Table, b: &dyn Table) {
    let ids = make_ids(10_000, 99);
    let grads = make_grads(ids.len(), 99);
    let before = a.pull(&ids);
    assert_eq!(before, b.pull(&ids), "designs disagree before a push");
    a.push(&ids, &grads);
    b.push(&ids, &grads);
    let after = a.pull(&ids);
    assert_eq!(after, b.pull(&ids), "designs disagree after a push");
    assert_ne!(before, after, "push changed nothing");
}

/// One design's results in one cell of the table.
#[derive(Default)]
struct Samples {
    rates: Vec<f64>,
    cpu: Vec<f64>,
    latencies: Vec<Duration>,
}

impl Samples {
    fn add(&mut self, r: RunResult) {
        self.rates.push(r.ids_per_sec);
        self.cpu.push(r.cpu_ns_per_id);
        self.latencies.extend(r.push_latencies);
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn geomean(xs: &[f64]) -> f64 {
    (xs.iter().map(|x| x.ln()).sum::<f64>() / xs.len() as f64).exp()
}

fn main() {
    let started = Instant::now();
    let a = Locked::new();
    let b = Writers::new();
    check_same(&a, &b);
    println!(
        "shard_design: {NUM_SHARDS} shards, {NUM_ROWS} rows of dim {DIM} (+ Adagrad state), \
         {WORKERS} workers (A: rayon threads, B: writer threads), {} cores, {REPS} reps, \
         built in {:.1} s, load average {}",
        thread::available_parallelism().map_or(0, |n| n.get()),
        started.elapsed().as_secs_f64(),
        load_average()
    );
    for &batch in &BATCHES {
        let ids = make_ids(batch, 7);
        let distinct = ids.iter().collect::<HashSet<_>>().len();
        println!(
            "batch {batch}: {:.0}% distinct ids",
            100.0 * distinct as f64 / batch as f64
        );
    }
    println!(
        "ids/s: median over reps (mixed = pull then push of the same batch, each id counted once \
         per step); B/A: median of the ratios of back-to-back runs (order alternates); \
         cpu ns/id: process CPU time per id; push ms: latency of one push call, p50 and p99"
    );
    println!();
    println!(
        "{:>7} {:>6} {:>5} {:>10} {:>10} {:>5} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "callers",
        "batch",
        "loop",
        "A ids/s",
        "B ids/s",
        "B/A",
        "A cpuns",
        "B cpuns",
        "A p50ms",
        "B p50ms",
        "A p99ms",
        "B p99ms"
    );
    let mut ratios: Vec<(bool, f64, f64)> = Vec::new();
    for mixed in [false, true] {
        for &batch in &BATCHES {
            for &callers in &CALLERS {
                let per_caller = (IDS_PER_RUN / callers / batch).max(2) * batch;
                let work: Vec<Vec<u64>> = (0..callers)
                    .map(|c| make_ids(per_caller, 1000 + c as u64))
                    .collect();
                let grads: Vec<Vec<f32>> = (0..callers)
                    .map(|c| make_grads(batch, 2000 + c as u64))
                    .collect();
                let (mut sa, mut sb) = (Samples::default(), Samples::default());
                let mut paired = Vec::new();
                for rep in 0..REPS {
                    let (ra, rb) = if rep % 2 == 0 {
                        let ra = run(&a, &work, &grads, batch, mixed);
                        (ra, run(&b, &work, &grads, batch, mixed))
                    } else {
                        let rb = run(&b, &work, &grads, batch, mixed);
                        (run(&a, &work, &grads, batch, mixed), rb)
                    };
                    paired.push(rb.ids_per_sec / ra.ids_per_sec);
                    sa.add(ra);
                    sb.add(rb);
                }
                let ratio = median(paired);
                let (ca, cb) = (median(sa.cpu), median(sb.cpu));
                ratios.push((mixed, ratio, cb / ca));
                println!(
                    "{:>7} {:>6} {:>5} {:>10.0} {:>10.0} {:>5.2} {:>7.0} {:>7.0} {:>7.2} {:>7.2} \
                     {:>7.2} {:>7.2}",
                    callers,
                    batch,
                    if mixed { "mixed" } else { "push" },
                    median(sa.rates),
                    median(sb.rates),
                    ratio,
                    ca,
                    cb,
                    ms(percentile(&mut sa.latencies, 0.5)),
                    ms(percentile(&mut sb.latencies, 0.5)),
                    ms(percentile(&mut sa.latencies, 0.99)),
                    ms(percentile(&mut sb.latencies, 0.99)),
                );
            }
        }
    }
    let summary = |mixed: bool| {
        let rate: Vec<f64> = ratios
            .iter()
            .filter(|x| x.0 == mixed)
            .map(|x| x.1)
            .collect();
        let cpu: Vec<f64> = ratios
            .iter()
            .filter(|x| x.0 == mixed)
            .map(|x| x.2)
            .collect();
        let min = rate.iter().copied().fold(f64::INFINITY, f64::min);
        let max = rate.iter().copied().fold(0.0, f64::max);
        format!(
            "ids/s B/A geomean {:.2} (range {min:.2}-{max:.2}), CPU per id B/A {:.2}",
            geomean(&rate),
            geomean(&cpu)
        )
    };
    let all: Vec<f64> = ratios.iter().map(|x| x.1).collect();
    let overall = geomean(&all);
    let verdict = if overall > 1.05 {
        "B (writer per shard) is faster"
    } else if overall < 0.95 {
        "A (per-shard locks) is faster"
    } else {
        "no throughput difference beyond 5%"
    };
    println!();
    println!(
        "conclusion: push-only {}; mixed {}; overall B/A {overall:.2}: {verdict}. \
         Total {:.0} s, load average {}.",
        summary(false),
        summary(true),
        started.elapsed().as_secs_f64(),
        load_average()
    );
}
