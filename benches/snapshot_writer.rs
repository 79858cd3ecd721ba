//! Should snapshot part files be written by pstore's own Arrow IPC writer or by arrow-ipc's
//! `FileWriter`? (docs/decisions/arrow-ipc-writer.md)
//!
//! Both write the same rows (`ROWS` rows, default 2M, of 64 float32 weights plus 64 Adagrad
//! state floats and the row metadata: the W5 table's shape) as one part file of record batches
//! of 8192 rows (the snapshot's batch size), through the same hashing, writeback-kicking file
//! and a final fsync, alternating, `REPS` times (default 5); the medians are reported. Each file
//! is then read back by pstore's reader (`read_part`, checksum and schema checked), which is
//! both the compatibility check and the restore-side rate.
//!
//! The `FileWriter` side is given the best case: its record batches borrow the row buffers (no
//! copy into arrays); what remains is the crate's own encoding.
//!
//! Run with `cargo bench --bench snapshot_writer` (`ROWS=... REPS=... DIR=...` to change the
//! size, repetitions and the directory the files go to; default `target/snapshot-bench`).

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
use arrow_array::{ArrayRef, FixedSizeListArray, PrimitiveArray, RecordBatch};
use arrow_buffer::{ArrowNativeType, Buffer, ScalarBuffer};
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field};
use pstore::snapshot::files::{
    part_arrow_schema, read_part, FileInfo, PartSchema, PartWriter, RowBatch,
};

const DIM: usize = 64;
const BATCH_ROWS: usize = 8192;
const WRITE_BUFFER: usize = 1 << 20;
const WRITEBACK_STEP: u64 = 8 << 20;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The rows: deterministic, distinct ids, non-trivial floats.
fn rows(n: usize, schema: PartSchema) -> RowBatch {
    let mut b = RowBatch::default();
    let mut words = vec![0u32; 6 + schema.dim + schema.state_len];
    for i in 0..n as u64 {
        let id = pstore::hash::mix64(i);
        words[0] = (i % 1000) as u32; // step
        words[1] = 0; // flags (not stored)
        words[2] = i as u32; // version, low
        words[3] = 0; // version, high
        words[4] = 1_700_000_000; // updated_at
        words[5] = (i % 7) as u32; // freq
        for (k, w) in words[6..].iter_mut().enumerate() {
            *w = ((k as f32 + i as f32) * 1e-3).to_bits();
        }
        b.push_words(id, &words, schema);
    }
    b
}

/// As the snapshot's file: hashes and counts every byte, starts writeback every 8 MiB.
struct Hashing {
    file: File,
    hasher: crc32fast::Hasher,
    bytes: u64,
    kicked: u64,
}

impl Write for Hashing {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(&buf[..buf.len().min(WRITE_BUFFER)])?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        #[cfg(target_os = "linux")]
        if self.bytes - self.kicked >= WRITEBACK_STEP {
            // SAFETY: a plain system call on our own open file; it touches no memory.
            unsafe {
                libc::sync_file_range(
                    std::os::fd::AsRawFd::as_raw_fd(&self.file),
                    self.kicked as libc::off64_t,
                    (self.bytes - self.kicked) as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
            self.kicked = self.bytes;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// A buffer that borrows `values` (no copy).
///
/// # Safety
/// The buffer and everything made of it must be dropped before `values` is.
unsafe fn borrowed<T: ArrowNativeType>(values: &[T]) -> ScalarBuffer<T> {
    let bytes = std::mem::size_of_val(values);
    let ptr = NonNull::new(values.as_ptr() as *mut u8).unwrap_or(NonNull::dangling());
    // SAFETY: `ptr` is valid for `bytes` bytes while `values` lives (the caller's promise); the
    // owner is a unit, so dropping the buffer frees nothing.
    let buf = unsafe { Buffer::from_custom_allocation(ptr, bytes, Arc::new(())) };
    ScalarBuffer::new(buf, 0, values.len())
}

/// Writes `b` with arrow-ipc's `FileWriter`.
fn write_with_crate(path: &Path, b: &RowBatch, schema: PartSchema) -> FileInfo {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap();
    let out = BufWriter::with_capacity(
        WRITE_BUFFER,
        Hashing {
            file,
            hasher: crc32fast::Hasher::new(),
            bytes: 0,
            kicked: 0,
        },
    );
    let arrow = Arc::new(part_arrow_schema(schema));
    let mut w = FileWriter::try_new(out, &arrow).unwrap();
    let list = |values: &[f32], size: usize| -> ArrayRef {
        // SAFETY: the batch is written and dropped before `b` is.
        let v = PrimitiveArray::<Float32Type>::new(unsafe { borrowed(values) }, None);
        let field = Arc::new(Field::new("item", DataType::Float32, false));
        Arc::new(FixedSizeListArray::new(
            field,
            size as i32,
            Arc::new(v),
            None,
        ))
    };
    let u64s = |v: &[u64]| -> ArrayRef {
        // SAFETY: the batch is written and dropped before `b` is.
        Arc::new(PrimitiveArray::<UInt64Type>::new(
            unsafe { borrowed(v) },
            None,
        ))
    };
    let u32s = |v: &[u32]| -> ArrayRef {
        // SAFETY: as above.
        Arc::new(PrimitiveArray::<UInt32Type>::new(
            unsafe { borrowed(v) },
            None,
        ))
    };
    let (dim, state) = (schema.dim, schema.state_len);
    for start in (0..b.len()).step_by(BATCH_ROWS) {
        let end = (start + BATCH_ROWS).min(b.len());
        let r = start..end;
        let mut columns: Vec<ArrayRef> = vec![
            u64s(&b.ids[r.clone()]),
            u32s(&b.step[r.clone()]),
            u64s(&b.version[r.clone()]),
            u32s(&b.updated_at[r.clone()]),
            u32s(&b.freq[r]),
        ];
        columns.push(list(&b.weights[start * dim..end * dim], dim));
        if state > 0 {
            columns.push(list(&b.state[start * state..end * state], state));
        }
        let batch = RecordBatch::try_new(Arc::clone(&arrow), columns).unwrap();
        w.write(&batch).unwrap();
    }
    w.finish().unwrap();
    let hashing = w.into_inner().unwrap().into_inner().ok().unwrap();
    hashing.file.sync_all().unwrap();
    FileInfo {
        name: path.file_name().unwrap().to_string_lossy().into_owned(),
        rows: b.len() as u64,
        bytes: hashing.bytes,
        crc32: hashing.hasher.finalize(),
    }
}

/// Writes `b` with pstore's own writer, in batches of the same size.
fn write_with_pstore(path: &Path, b: &RowBatch, schema: PartSchema) -> FileInfo {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let mut w = PartWriter::create(path, &name, schema).unwrap();
    w.write_chunked(b, BATCH_ROWS).unwrap();
    w.finish().unwrap()
}

/// Reads the file back with pstore's reader; returns the rows read.
fn read_back(path: &Path, schema: PartSchema, info: &FileInfo) -> u64 {
    let mut n = 0u64;
    let mut words = Vec::new();
    read_part(path, schema, info, |s| {
        for i in 0..s.len() {
            s.row_words(i, schema, &mut words);
            std::hint::black_box(&words);
        }
        n += s.len() as u64;
        Ok(())
    })
    .unwrap();
    n
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let n = env("ROWS", 2_000_000);
    let reps = env("REPS", 5).max(1);
    let dir = std::env::var("DIR").map_or_else(
        |_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/snapshot-bench"),
        PathBuf::from,
    );
    std::fs::create_dir_all(&dir).unwrap();
    let schema = PartSchema {
        dim: DIM,
        state_len: DIM,
    };
    println!("building {n} rows of dim {DIM} + {DIM} state floats");
    let b = rows(n, schema);
    type Writer = fn(&Path, &RowBatch, PartSchema) -> FileInfo;
    let sides: [(&str, Writer); 2] = [
        ("pstore writer", write_with_pstore),
        ("arrow-ipc FileWriter", write_with_crate),
    ];
    let mut write_rates = [Vec::new(), Vec::new()];
    let mut read_rates = [Vec::new(), Vec::new()];
    let mut sizes = [0u64; 2];
    for rep in 0..reps {
        // Alternate which side goes first.
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let (label, write) = sides[k];
            let path = dir.join(format!("part-{k}.arrow"));
            let _ = std::fs::remove_file(&path);
            let t = Instant::now();
            let info = write(&path, &b, schema);
            let w = t.elapsed().as_secs_f64();
            let t = Instant::now();
            assert_eq!(read_back(&path, schema, &info), n as u64, "{label}");
            let r = t.elapsed().as_secs_f64();
            write_rates[k].push(n as f64 / w);
            read_rates[k].push(n as f64 / r);
            sizes[k] = info.bytes;
            println!(
                "rep {rep} {label:>22}: write {:>6.2} M rows/s ({:>6.0} MB/s), read back {:>6.2} M rows/s",
                n as f64 / w / 1e6,
                info.bytes as f64 / w / 1e6,
                n as f64 / r / 1e6
            );
            std::fs::remove_file(&path).unwrap();
        }
    }
    println!(
        "\nmedians of {reps} ({n} rows, files of {} / {} bytes):",
        sizes[0], sizes[1]
    );
    let mut med = [0.0; 2];
    for k in 0..2 {
        med[k] = median(&mut write_rates[k]);
        println!(
            "{:>22}: write {:.2} M rows/s, read back {:.2} M rows/s",
            sides[k].0,
            med[k] / 1e6,
            median(&mut read_rates[k]) / 1e6
        );
    }
    println!("FileWriter / pstore writer: {:.2}x", med[1] / med[0]);
}
