//! What does checking every row a serving lookup returns cost?
//!
//! Writes one table of `ROWS` rows x 64 in each row file layout (1: no checks; 2: a CRC-32 per
//! row; 3: the word-sum check of `rowfile::row_check`), for float32, float16 and int8, then
//! looks Zipf(1.05) ids up in them with `RowFile::gather` (one thread, the file's own
//! prefetching loop, no thread pool) in batches of 1, 256 and 4096, the three layouts
//! interleaved in each of `REPS` repetitions. Prints ns per id (medians) and each layout's time
//! against layout 1's in the same run, in the thread's CPU time (not wall time: the machines
//! are shared). Run with `cargo bench --bench row_checks`
//! (`ROW_CHECKS_ROWS` sets the rows, default 1,048,576; files go to the temp directory).

use std::hint::black_box;
use std::path::Path;

use pstore::hash::mix64;
use pstore::serving::rowfile::{row_check, row_sum, Expect, RowFile, Writer, FILE_VERSION};
use pstore::serving::Dtype;

const DIM: usize = 64;
const REPS: usize = 7;
/// (batch, ids looked up per repetition)
const BATCHES: [(usize, usize); 3] = [(1, 20_000), (256, 204_800), (4096, 409_600)];

/// This thread's CPU time in ns: on a machine shared with other work, time the thread was not
/// running does not count (what it shares, caches and memory bandwidth, still does).
fn cpu_ns() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// `n` Zipf(1.05) ranks below `rows`, each turned into an id by a permutation that scatters
/// the hot ranks over the file.
fn zipf_ids(rows: u64, n: usize, seed: u64) -> Vec<u64> {
    let mut cdf = Vec::with_capacity(rows as usize);
    let mut total = 0.0;
    for k in 1..=rows {
        total += (k as f64).powf(-1.05);
        cdf.push(total);
    }
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = mix64(state.wrapping_add(0x9E37_79B9_7F4A_7C15));
            let u = (state >> 11) as f64 / (1u64 << 53) as f64 * total;
            let rank = cdf.partition_point(|&c| c < u).min(rows as usize - 1) as u64;
            // An odd multiplier permutes 0..rows when rows is a power of two; otherwise the
            // modulo only makes a few ids repeat, which a benchmark does not mind.
            rank.wrapping_mul(0x9E37_79B9_7F4A_7C15 | 1) % rows
        })
        .collect()
}

fn write(path: &Path, want: Expect, layout: u32) {
    let mut w = Writer::create_layout(path, want, layout).expect("create");
    let mut bytes = Vec::new();
    let mut row = vec![0f32; DIM];
    for id in 0..want.rows {
        for (j, x) in row.iter_mut().enumerate() {
            *x = ((mix64(id * 64 + j as u64) >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
        }
        bytes.clear();
        want.dtype.encode(&row, &mut bytes).expect("encode");
        w.put(id, &bytes).expect("put");
    }
    w.finish().expect("finish");
}

fn main() {
    let rows: u64 = std::env::var("ROW_CHECKS_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 20);
    let dir = std::env::temp_dir().join(format!("pstore-row-checks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    // The checks alone, on one row in L1: what each costs apart from the memory.
    for bytes in [68usize, 128, 256] {
        let row: Vec<u8> = (0..bytes as u64).map(|i| mix64(i) as u8).collect();
        let n = 200_000u64;
        let time = |f: &dyn Fn(u64) -> u64| {
            median(
                (0..REPS)
                    .map(|_| {
                        let t = cpu_ns();
                        let mut acc = 0u64;
                        for id in 0..n {
                            acc = acc.wrapping_add(f(black_box(id)));
                        }
                        black_box(acc);
                        (cpu_ns() - t) / n as f64
                    })
                    .collect(),
            )
        };
        let crc = time(&|id| u64::from(row_sum(id, black_box(&row))));
        let words = time(&|id| row_check(id, black_box(&row)));
        println!(
            "check of a {bytes}-byte row in cache: CRC-32 {crc:.1} ns, word sum {words:.1} ns"
        );
    }
    println!(
        "{rows} rows x {DIM}, Zipf(1.05), one thread, thread CPU time, medians of {REPS} \
         repetitions"
    );
    println!(
        "dtype    batch | ns/id layout 1 (none) / 2 (CRC-32) / 3 (word sum) | 2 vs 1 | 3 vs 1"
    );
    for dtype in [Dtype::Float32, Dtype::Float16, Dtype::Int8] {
        let files: Vec<RowFile> = (1..=FILE_VERSION)
            .map(|layout| {
                let want = Expect {
                    artifact: 1,
                    generation: 1,
                    dtype,
                    dim: DIM,
                    rows,
                };
                let path = dir.join(format!("{}-{layout}.rows", dtype.as_str()));
                write(&path, want, layout);
                RowFile::open(&path, want).expect("open")
            })
            .collect();
        for (b, (batch, per_rep)) in BATCHES.into_iter().enumerate() {
            let ids = zipf_ids(rows, per_rep, b as u64 + 1);
            let mut out = vec![0f32; batch * DIM];
            let mut found = vec![false; batch];
            let mut times = vec![Vec::new(); files.len()];
            // Ratios are taken per repetition (each layout's time against layout 1's in the
            // same repetition), so a load change between repetitions moves all three.
            let mut ratios = vec![Vec::new(); files.len()];
            for rep in 0..=REPS {
                let mut this = Vec::new();
                for f in &files {
                    let t = cpu_ns();
                    for part in ids.chunks(batch) {
                        let n = part.len();
                        f.gather(part, &mut out[..n * DIM], &mut found[..n])
                            .expect("gather");
                        black_box(&out);
                    }
                    this.push((cpu_ns() - t) / ids.len() as f64);
                }
                if rep > 0 {
                    for (l, &ns) in this.iter().enumerate() {
                        times[l].push(ns);
                        ratios[l].push(ns / this[0]);
                    }
                }
            }
            let ns: Vec<f64> = times.into_iter().map(median).collect();
            let r: Vec<f64> = ratios.into_iter().map(median).collect();
            println!(
                "{:8} {batch:5} | {:.1} / {:.1} / {:.1} | {:.3} | {:.3}",
                dtype.as_str(),
                ns[0],
                ns[1],
                ns[2],
                r[1],
                r[2]
            );
        }
        drop(files);
        for layout in 1..=FILE_VERSION {
            let _ = std::fs::remove_file(dir.join(format!("{}-{layout}.rows", dtype.as_str())));
        }
    }
    let _ = std::fs::remove_dir(&dir);
}
