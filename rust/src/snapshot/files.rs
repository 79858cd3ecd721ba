//! Snapshot data files: Arrow IPC *file* format (uncompressed), one file per part.
//!
//! A part file holds rows in the columns `id` u64, `step` u32, `version` u64, `updated_at` u32,
//! `freq` u32, `weights` FixedSizeList<f32, dim> and, when the optimizer keeps state,
//! `state` FixedSizeList<f32, state_len>; all non-null. Schema metadata
//! `pstore.format = "1"`, `pstore.kind = "rows"`. An ids file (tombstones) holds one `id` u64
//! column with `pstore.kind = "ids"`.
//!
//! The IPC file format (not the stream format) is used because its footer makes a truncated
//! file detectable by any reader, and `pyarrow.ipc.open_file` (so pandas, duckdb) reads it
//! directly. The writer hashes every byte as it goes; the manifest keeps the size and crc32, and
//! the readers check both before decoding anything.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use arrow_array::types::{ArrowPrimitiveType, Float32Type, UInt32Type, UInt64Type};
use arrow_array::{Array, ArrayRef, FixedSizeListArray, PrimitiveArray, RecordBatch};
use arrow_buffer::{ArrowNativeType, Buffer, ScalarBuffer};
use arrow_ipc::reader::{read_footer_length, FileDecoder};
use arrow_ipc::writer::FileWriter;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};

use crate::error::{corrupt, storage, Error, Result};

const FORMAT_KEY: &str = "pstore.format";
const FORMAT_VERSION: &str = "1";
const KIND_KEY: &str = "pstore.kind";
const KIND_ROWS: &str = "rows";
const KIND_IDS: &str = "ids";
const MAGIC: &[u8; 6] = b"ARROW1";
/// Buffer for the small writes (message headers, small columns) before the hashing file writer;
/// larger writes bypass it.
const WRITE_BUFFER: usize = 1 << 20;

/// The shape of a part file's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartSchema {
    /// Row width (weights per row).
    pub dim: usize,
    /// Optimizer state floats per row.
    pub state_len: usize,
}

/// Rows in columns. `weights` has `len() * dim` floats, `state` `len() * state_len`, row after
/// row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowBatch {
    /// The ids, one per row.
    pub ids: Vec<u64>,
    /// Optimizer step count of the row.
    pub step: Vec<u32>,
    /// Table update sequence number of the row's last update.
    pub version: Vec<u64>,
    /// Unix seconds of the last update.
    pub updated_at: Vec<u32>,
    /// How often the id was pushed (saturating).
    pub freq: Vec<u32>,
    /// The weights, `dim` per row.
    pub weights: Vec<f32>,
    /// The optimizer state, `state_len` per row.
    pub state: Vec<f32>,
}

impl RowBatch {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when there is no row.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Removes all rows, keeping the allocations.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.step.clear();
        self.version.clear();
        self.updated_at.clear();
        self.freq.clear();
        self.weights.clear();
        self.state.clear();
    }

    /// Appends one row whose metadata+body words are given exactly as stored in memory / LMDB:
    /// `words` = [step, reserved (ignored), version_lo, version_hi, updated_at, freq,
    /// weights (dim f32 bits), state (state_len f32 bits)].
    ///
    /// # Panics
    /// If `words.len() != 6 + dim + state_len`.
    pub fn push_words(&mut self, id: u64, words: &[u32], schema: PartSchema) {
        assert_eq!(
            words.len(),
            6 + schema.dim + schema.state_len,
            "row words do not match dim {} state_len {}",
            schema.dim,
            schema.state_len
        );
        self.ids.push(id);
        self.step.push(words[0]);
        self.version
            .push(u64::from(words[2]) | (u64::from(words[3]) << 32));
        self.updated_at.push(words[4]);
        self.freq.push(words[5]);
        let (weights, state) = words[6..].split_at(schema.dim);
        self.weights.extend_from_slice(as_floats(weights));
        self.state.extend_from_slice(as_floats(state));
    }

    /// Row `i` back as words (reserved word = 0), appended to `out`.
    pub fn row_words(&self, i: usize, schema: PartSchema, out: &mut Vec<u32>) {
        self.as_slices().row_words(i, schema, out)
    }

    /// The columns, borrowed.
    pub fn as_slices(&self) -> RowSlices<'_> {
        RowSlices {
            ids: &self.ids,
            step: &self.step,
            version: &self.version,
            updated_at: &self.updated_at,
            freq: &self.freq,
            weights: &self.weights,
            state: &self.state,
        }
    }

    /// Whether all columns agree with `len()` and `schema`.
    fn is_consistent(&self, schema: PartSchema) -> bool {
        let n = self.len();
        self.step.len() == n
            && self.version.len() == n
            && self.updated_at.len() == n
            && self.freq.len() == n
            && self.weights.len() == n * schema.dim
            && self.state.len() == n * schema.state_len
    }
}

/// Rows in borrowed columns, laid out like [`RowBatch`]'s: what [`read_part`] hands out, straight
/// from the file's bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSlices<'a> {
    /// The ids, one per row.
    pub ids: &'a [u64],
    /// Optimizer step count per row.
    pub step: &'a [u32],
    /// Table update sequence number of each row's last update.
    pub version: &'a [u64],
    /// Unix seconds of each row's last update.
    pub updated_at: &'a [u32],
    /// How often each id was pushed (saturating).
    pub freq: &'a [u32],
    /// The weights, `dim` per row.
    pub weights: &'a [f32],
    /// The optimizer state, `state_len` per row.
    pub state: &'a [f32],
}

impl RowSlices<'_> {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when there is no row.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Row `i` as words (reserved word = 0), appended to `out`; see [`RowBatch::push_words`].
    pub fn row_words(&self, i: usize, schema: PartSchema, out: &mut Vec<u32>) {
        let version = self.version[i];
        out.extend_from_slice(&[
            self.step[i],
            0,
            version as u32,
            (version >> 32) as u32,
            self.updated_at[i],
            self.freq[i],
        ]);
        out.extend_from_slice(as_words(
            &self.weights[i * schema.dim..(i + 1) * schema.dim],
        ));
        out.extend_from_slice(as_words(
            &self.state[i * schema.state_len..(i + 1) * schema.state_len],
        ));
    }

    /// An owned copy.
    pub fn to_batch(&self) -> RowBatch {
        RowBatch {
            ids: self.ids.to_vec(),
            step: self.step.to_vec(),
            version: self.version.to_vec(),
            updated_at: self.updated_at.to_vec(),
            freq: self.freq.to_vec(),
            weights: self.weights.to_vec(),
            state: self.state.to_vec(),
        }
    }
}

/// Floats as their bits, without a per-element conversion.
fn as_words(floats: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is a valid u32.
    unsafe { std::slice::from_raw_parts(floats.as_ptr().cast::<u32>(), floats.len()) }
}

/// Float bits as floats, without a per-element conversion (so the copy is a memcpy).
fn as_floats(words: &[u32]) -> &[f32] {
    // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<f32>(), words.len()) }
}

/// What the manifest records of one file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileInfo {
    /// Path relative to the snapshot directory, '/' separated.
    pub name: String,
    /// Rows in the file.
    pub rows: u64,
    /// The file's size in bytes.
    pub bytes: u64,
    /// CRC-32 of the whole file.
    pub crc32: u32,
}

// ---------------------------------------------------------------------------------------------
// Schemas

fn metadata(kind: &str) -> std::collections::HashMap<String, String> {
    [
        (FORMAT_KEY.to_string(), FORMAT_VERSION.to_string()),
        (KIND_KEY.to_string(), kind.to_string()),
    ]
    .into_iter()
    .collect()
}

/// The item field of a FixedSizeList<Float32> column.
fn list_item() -> Arc<Field> {
    Arc::new(Field::new("item", DataType::Float32, false))
}

fn float_list(size: usize) -> DataType {
    DataType::FixedSizeList(list_item(), size as i32)
}

/// The Arrow schema of a part file of `schema`.
pub fn part_arrow_schema(schema: PartSchema) -> Schema {
    let mut fields = vec![
        Field::new("id", DataType::UInt64, false),
        Field::new("step", DataType::UInt32, false),
        Field::new("version", DataType::UInt64, false),
        Field::new("updated_at", DataType::UInt32, false),
        Field::new("freq", DataType::UInt32, false),
        Field::new("weights", float_list(schema.dim), false),
    ];
    if schema.state_len > 0 {
        fields.push(Field::new("state", float_list(schema.state_len), false));
    }
    Schema::new_with_metadata(fields, metadata(KIND_ROWS))
}

fn ids_arrow_schema() -> Schema {
    Schema::new_with_metadata(
        vec![Field::new("id", DataType::UInt64, false)],
        metadata(KIND_IDS),
    )
}

/// The PartSchema a rows schema was written for, if it is one (used for messages and
/// `part_summary`; equality with `part_arrow_schema` is checked separately).
fn infer_part_schema(schema: &Schema) -> Option<PartSchema> {
    let list_size = |i: usize| match schema.fields().get(i)?.data_type() {
        DataType::FixedSizeList(_, n) => usize::try_from(*n).ok(),
        _ => None,
    };
    let dim = list_size(5)?;
    let state_len = if schema.fields().len() > 6 {
        list_size(6)?
    } else {
        0
    };
    Some(PartSchema { dim, state_len })
}

fn describe_schema(schema: &Schema) -> String {
    let fields: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| {
            let null = if f.is_nullable() { " (nullable)" } else { "" };
            format!("{}: {}{null}", f.name(), f.data_type())
        })
        .collect();
    let mut meta: Vec<_> = schema.metadata().iter().collect();
    meta.sort();
    format!("[{}] metadata {meta:?}", fields.join(", "))
}

/// Checks the format version and kind, then exact equality with `expected`.
fn check_schema(path: &Path, found: &Schema, expected: &Schema, what: &str) -> Result<()> {
    let p = path.display();
    match found.metadata().get(FORMAT_KEY) {
        Some(v) if v == FORMAT_VERSION => {}
        Some(v) => return Err(corrupt(format!("{p}: unknown pstore format version {v:?}"))),
        None => {
            return Err(corrupt(format!(
                "{p}: not a pstore file (no {FORMAT_KEY} metadata)"
            )))
        }
    }
    let want_kind = expected.metadata().get(KIND_KEY).map(String::as_str);
    let kind = found.metadata().get(KIND_KEY).map(String::as_str);
    if kind != want_kind {
        return Err(corrupt(format!(
            "{p}: wrong file kind {kind:?}, expected {want_kind:?}"
        )));
    }
    if found != expected {
        let detail = match infer_part_schema(found) {
            Some(s) if kind == Some(KIND_ROWS) && part_arrow_schema(s) == *found => {
                format!("file has dim {} state_len {}", s.dim, s.state_len)
            }
            _ => format!("file has columns {}", describe_schema(found)),
        };
        return Err(corrupt(format!(
            "{p}: wrong schema: expected {what}, {detail}"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writing

/// Written bytes after which the file's writeback is started (see [`HashingFile::kick`]).
const WRITEBACK_STEP: u64 = 8 << 20;

/// The file under the write buffer: hashes and counts every byte that reaches the OS.
struct HashingFile {
    file: File,
    hasher: crc32fast::Hasher,
    bytes: u64,
    /// Bytes whose writeback has been started.
    kicked: u64,
}

impl HashingFile {
    fn new(file: File) -> Self {
        Self {
            file,
            hasher: crc32fast::Hasher::new(),
            bytes: 0,
            kicked: 0,
        }
    }

    /// Starts writing the bytes written so far back to disk without waiting for it, so that
    /// the device works while the file is being written and the final fsync has little left
    /// to do. Only a hint: errors surface at the fsync.
    fn kick(&mut self) {
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
    }
}

impl Write for HashingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // At most one buffer's worth per call: the bytes are still in cache for the hasher.
        let n = self.file.write(&buf[..buf.len().min(WRITE_BUFFER)])?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        self.kick();
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

fn write_error(path: &Path, e: ArrowError) -> Error {
    match e {
        ArrowError::IoError(_, io) => storage(format!("writing {}: {io}", path.display())),
        other => Error::Internal(format!("writing {}: {other}", path.display())),
    }
}

/// One non-null column of a record batch, borrowed from the caller's buffers.
enum Column<'a> {
    U64(&'a [u64]),
    U32(&'a [u32]),
    /// A FixedSizeList<Float32, size> column: its values, row after row.
    List(&'a [f32], usize),
}

/// A buffer over `values` that does not own them (no copy).
///
/// # Safety
/// The buffer, and every array or batch made of it, must be dropped while `values` is still
/// borrowed.
unsafe fn borrowed<T: ArrowNativeType>(values: &[T]) -> ScalarBuffer<T> {
    let ptr = NonNull::from(values).cast::<u8>();
    // SAFETY: `ptr` is valid for `size_of_val(values)` bytes, not written, while `values` is
    // borrowed, which outlasts the buffer (the caller's promise); the owner is a unit, so
    // dropping the buffer frees nothing.
    let buffer =
        unsafe { Buffer::from_custom_allocation(ptr, std::mem::size_of_val(values), Arc::new(())) };
    ScalarBuffer::new(buffer, 0, values.len())
}

impl Column<'_> {
    /// The column as an Arrow array over the same memory.
    ///
    /// # Safety
    /// As [`borrowed`]: the array must be dropped while the column's values are borrowed.
    unsafe fn array(&self) -> ArrayRef {
        match *self {
            Column::U64(v) => {
                // SAFETY: the caller's promise.
                let values = unsafe { borrowed(v) };
                Arc::new(PrimitiveArray::<UInt64Type>::new(values, None))
            }
            Column::U32(v) => {
                // SAFETY: the caller's promise.
                let values = unsafe { borrowed(v) };
                Arc::new(PrimitiveArray::<UInt32Type>::new(values, None))
            }
            Column::List(v, size) => {
                // SAFETY: the caller's promise.
                let values = unsafe { borrowed(v) };
                let values = PrimitiveArray::<Float32Type>::new(values, None);
                Arc::new(FixedSizeListArray::new(
                    list_item(),
                    size as i32,
                    Arc::new(values),
                    None,
                ))
            }
        }
    }
}

/// Writes an Arrow IPC file batch by batch with arrow-ipc's `FileWriter`, each record batch's
/// arrays borrowing the caller's column buffers (the writer encodes them into its message; see
/// docs/decisions/arrow-ipc-writer.md). Columns are non-null.
struct IpcFile {
    path: PathBuf,
    name: String,
    rows: u64,
    schema: SchemaRef,
    writer: FileWriter<BufWriter<HashingFile>>,
}

impl IpcFile {
    fn create(path: &Path, name: &str, schema: &Schema) -> Result<Self> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| storage(format!("creating {}: {e}", path.display())))?;
        let out = BufWriter::with_capacity(WRITE_BUFFER, HashingFile::new(file));
        let schema = Arc::new(schema.clone());
        let writer = FileWriter::try_new(out, &schema).map_err(|e| write_error(path, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            name: name.to_string(),
            rows: 0,
            schema,
            writer,
        })
    }

    /// Appends one record batch of `rows` rows; `columns` follow the schema.
    fn write(&mut self, rows: usize, columns: &[Column<'_>]) -> Result<()> {
        // SAFETY: the arrays and the batch are dropped at the end of this call, while `columns`
        // is borrowed; the writer keeps nothing of a batch without dictionaries.
        let arrays: Vec<ArrayRef> = columns.iter().map(|c| unsafe { c.array() }).collect();
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), arrays)
            .map_err(|e| Error::Internal(format!("writing {}: {e}", self.path.display())))?;
        self.writer
            .write(&batch)
            .map_err(|e| write_error(&self.path, e))?;
        self.rows += rows as u64;
        Ok(())
    }

    fn finish(self) -> Result<FileInfo> {
        let path = self.path;
        let out = self
            .writer
            .into_inner()
            .map_err(|e| write_error(&path, e))?;
        let hashing = out
            .into_inner()
            .map_err(|e| storage(format!("writing {}: {}", path.display(), e.error())))?;
        hashing
            .file
            .sync_all()
            .map_err(|e| storage(format!("syncing {}: {e}", path.display())))?;
        Ok(FileInfo {
            name: self.name,
            rows: self.rows,
            bytes: hashing.bytes,
            crc32: hashing.hasher.finalize(),
        })
    }
}

/// Writes one part file: rows of a fixed `PartSchema`, appended batch by batch.
pub struct PartWriter {
    file: IpcFile,
    schema: PartSchema,
}

impl PartWriter {
    /// Creates the file at `path` (fails if it exists) for rows of `schema`. `name` is the
    /// relative name recorded in the `FileInfo`. A writer dropped before `finish` leaves a
    /// partial file behind.
    pub fn create(path: &Path, name: &str, schema: PartSchema) -> Result<Self> {
        if schema.dim == 0 || schema.dim > i32::MAX as usize || schema.state_len > i32::MAX as usize
        {
            return Err(Error::Internal(format!(
                "part file {}: unsupported dim {} state_len {}",
                path.display(),
                schema.dim,
                schema.state_len
            )));
        }
        Ok(Self {
            file: IpcFile::create(path, name, &part_arrow_schema(schema))?,
            schema,
        })
    }

    /// Appends the batch as one Arrow record batch (an empty batch writes nothing), its columns
    /// written straight from `batch`.
    pub fn write(&mut self, batch: &RowBatch) -> Result<()> {
        self.write_chunked(batch, batch.len().max(1))
    }

    /// Appends the batch as record batches of at most `max_rows` rows each.
    pub fn write_chunked(&mut self, batch: &RowBatch, max_rows: usize) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        if !batch.is_consistent(self.schema) || max_rows == 0 {
            return Err(Error::Internal(format!(
                "writing {}: row batch columns do not agree with {} rows of dim {} state_len {}",
                self.file.path.display(),
                batch.len(),
                self.schema.dim,
                self.schema.state_len
            )));
        }
        let (dim, state_len) = (self.schema.dim, self.schema.state_len);
        for start in (0..batch.len()).step_by(max_rows) {
            let end = (start + max_rows).min(batch.len());
            let mut columns = vec![
                Column::U64(&batch.ids[start..end]),
                Column::U32(&batch.step[start..end]),
                Column::U64(&batch.version[start..end]),
                Column::U32(&batch.updated_at[start..end]),
                Column::U32(&batch.freq[start..end]),
                Column::List(&batch.weights[start * dim..end * dim], dim),
            ];
            if state_len > 0 {
                columns.push(Column::List(
                    &batch.state[start * state_len..end * state_len],
                    state_len,
                ));
            }
            self.file.write(end - start, &columns)?;
        }
        Ok(())
    }

    /// Writes the footer, fsyncs the file and returns its `FileInfo` (crc32 computed while
    /// writing). The caller syncs the directory.
    pub fn finish(self) -> Result<FileInfo> {
        self.file.finish()
    }
}

/// Writes a file of ids only (tombstones): one uint64 column "id". Fsynced.
pub fn write_ids(path: &Path, name: &str, ids: &[u64]) -> Result<FileInfo> {
    let mut file = IpcFile::create(path, name, &ids_arrow_schema())?;
    if !ids.is_empty() {
        file.write(ids.len(), &[Column::U64(ids)])?;
    }
    file.finish()
}

// ---------------------------------------------------------------------------------------------
// Reading

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| storage(format!("reading {}: {e}", path.display())))
}

fn size_mismatch(path: &Path, expected: u64, found: u64) -> Error {
    let how = if found < expected {
        "truncated"
    } else {
        "too long"
    };
    corrupt(format!(
        "{}: size mismatch ({how}): expected {expected} bytes, found {found}",
        path.display()
    ))
}

/// A read-only mapping of a whole file, unmapped on drop.
struct Mapped {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value alone; sharing `&Mapped` only allows
// reads of immutable pages.
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}
impl std::panic::RefUnwindSafe for Mapped {}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `read_verified`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Maps the whole file, checking its size and crc32 against the manifest before returning it.
/// Mapping (not reading into a fresh buffer) spares a copy and the zeroing of fresh pages; the
/// file is a finished snapshot part that nothing writes.
fn read_verified(path: &Path, expect: &FileInfo) -> Result<Buffer> {
    let p = path.display();
    let io = |e: std::io::Error| storage(format!("reading {p}: {e}"));
    let file = File::open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            corrupt(format!("{p} is missing: the snapshot is incomplete"))
        } else {
            io(e)
        }
    })?;
    let len = file.metadata().map_err(io)?.len();
    if len != expect.bytes {
        return Err(size_mismatch(path, expect.bytes, len));
    }
    let len = usize::try_from(len).map_err(|_| storage(format!("reading {p}: file too large")))?;
    if len == 0 {
        return Err(corrupt(format!("{p}: empty, not an Arrow IPC file")));
    }
    // SAFETY: a fresh private read-only mapping of `len` bytes of an open file; checked below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            // Populated up front: one call maps every page, instead of a fault per page.
            libc::MAP_PRIVATE | libc::MAP_POPULATE,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io(std::io::Error::last_os_error()));
    }
    let map = Mapped {
        ptr: NonNull::new(raw.cast::<u8>()).expect("mmap does not return null on success"),
        len,
    };
    // SAFETY: the mapping is `len` readable bytes and lives as long as `map`.
    let bytes = unsafe { std::slice::from_raw_parts(map.ptr.as_ptr(), len) };
    let crc = crc32fast::hash(bytes);
    if crc != expect.crc32 {
        return Err(corrupt(format!(
            "{p}: checksum mismatch: expected crc32 {:08x}, found {crc:08x}",
            expect.crc32
        )));
    }
    let ptr = map.ptr;
    // SAFETY: `ptr` is valid for `len` bytes for as long as the owner (`map`) lives, and the
    // buffer keeps the owner.
    Ok(unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(map)) })
}

/// Decodes an Arrow IPC file held in memory into its record batches (zero-copy where aligned).
/// `check` sees the schema before any batch is decoded. The Arrow decoder can panic on crafted
/// input, so a panic is caught and reported as a corrupt file.
fn decode(
    path: &Path,
    buffer: Buffer,
    check: impl FnOnce(&Schema) -> Result<()>,
) -> Result<Vec<RecordBatch>> {
    match catch_unwind(AssertUnwindSafe(|| decode_inner(path, &buffer, check))) {
        Ok(result) => result,
        Err(_) => Err(corrupt(format!(
            "{}: not an Arrow IPC file (the decoder failed)",
            path.display()
        ))),
    }
}

fn decode_inner(
    path: &Path,
    buffer: &Buffer,
    check: impl FnOnce(&Schema) -> Result<()>,
) -> Result<Vec<RecordBatch>> {
    let p = path.display();
    let bad = |what: String| corrupt(format!("{p}: not an Arrow IPC file ({what})"));
    let len = buffer.len();
    // Leading magic + padding, trailing footer length + magic.
    if len < 8 + 10 || &buffer[..6] != MAGIC || &buffer[len - 6..] != MAGIC {
        return Err(bad("no ARROW1 magic at both ends".into()));
    }
    let mut trailer = [0u8; 10];
    trailer.copy_from_slice(&buffer[len - 10..]);
    let footer_len = read_footer_length(trailer).map_err(|e| bad(e.to_string()))?;
    if footer_len > len - 10 - 8 {
        return Err(bad(format!("footer length {footer_len} exceeds the file")));
    }
    let footer_start = len - 10 - footer_len;
    let footer = arrow_ipc::root_as_footer(&buffer[footer_start..len - 10])
        .map_err(|e| bad(format!("bad footer: {e}")))?;
    let ipc_schema = footer
        .schema()
        .ok_or_else(|| bad("footer has no schema".into()))?;
    if !ipc_schema.endianness().equals_to_target_endianness() {
        return Err(bad("big-endian file".into()));
    }
    if footer.dictionaries().is_some_and(|d| !d.is_empty()) {
        return Err(bad("unexpected dictionary batches".into()));
    }
    let schema = Arc::new(arrow_ipc::convert::fb_to_schema(ipc_schema));
    check(&schema)?;

    let blocks = footer
        .recordBatches()
        .ok_or_else(|| bad("footer lists no record batches".into()))?;
    let decoder = FileDecoder::new(schema, footer.version());
    let mut batches = Vec::with_capacity(blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        let offset = usize::try_from(block.offset()).ok();
        let meta = usize::try_from(block.metaDataLength()).ok();
        let body = usize::try_from(block.bodyLength()).ok();
        let (Some(offset), Some(meta), Some(body)) = (offset, meta, body) else {
            return Err(bad(format!("record batch {i}: negative block bounds")));
        };
        let end = offset.checked_add(meta).and_then(|x| x.checked_add(body));
        if meta < 8 || end.is_none_or(|end| end > footer_start) {
            return Err(bad(format!("record batch {i}: block outside the file")));
        }
        let data = buffer.slice_with_length(offset, meta + body);
        check_buffers(&data[..meta], body).map_err(|e| bad(format!("record batch {i}: {e}")))?;
        match decoder.read_record_batch(block, &data) {
            Ok(Some(batch)) => batches.push(batch),
            Ok(None) => return Err(bad(format!("record batch {i}: empty message"))),
            Err(e) => return Err(bad(format!("record batch {i}: {e}"))),
        }
    }
    Ok(batches)
}

/// Checks that the buffers a record batch message lists lie within its body (the Arrow decoder
/// panics otherwise) and that the body is not compressed.
fn check_buffers(meta: &[u8], body: usize) -> std::result::Result<(), String> {
    // Continuation marker and length (8 bytes), or the legacy length alone (4 bytes).
    let start = if meta[..4] == [0xff; 4] { 8 } else { 4 };
    let message = arrow_ipc::root_as_message(&meta[start..]).map_err(|e| e.to_string())?;
    let header = message
        .header_as_record_batch()
        .ok_or("not a record batch message")?;
    if header.compression().is_some() {
        return Err("compressed body".into());
    }
    for b in header.buffers().iter().flatten() {
        let end = u64::try_from(b.offset())
            .ok()
            .zip(u64::try_from(b.length()).ok())
            .and_then(|(offset, len)| offset.checked_add(len));
        if end.is_none_or(|end| end > body as u64) {
            return Err("buffer outside the message body".into());
        }
    }
    Ok(())
}

fn check_rows(path: &Path, batches: &[RecordBatch], expect: &FileInfo) -> Result<()> {
    let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
    if rows != expect.rows {
        return Err(corrupt(format!(
            "{}: row count mismatch: expected {} rows, found {rows}",
            path.display(),
            expect.rows
        )));
    }
    Ok(())
}

/// The values of a non-null primitive column (the schema is already checked).
fn column_values<'a, T: ArrowPrimitiveType>(
    path: &Path,
    array: &'a dyn Array,
) -> Result<&'a [T::Native]> {
    let array = array
        .as_any()
        .downcast_ref::<PrimitiveArray<T>>()
        .ok_or_else(|| corrupt(format!("{}: column of unexpected type", path.display())))?;
    if array.null_count() != 0 {
        return Err(corrupt(format!("{}: column holds nulls", path.display())));
    }
    Ok(array.values())
}

/// The floats of a non-null FixedSizeList<Float32, size> column.
fn list_values<'a>(path: &Path, array: &'a dyn Array, size: usize) -> Result<&'a [f32]> {
    let p = path.display();
    let list = array
        .as_any()
        .downcast_ref::<FixedSizeListArray>()
        .ok_or_else(|| corrupt(format!("{p}: list column of unexpected type")))?;
    if list.null_count() != 0 {
        return Err(corrupt(format!("{p}: list column holds nulls")));
    }
    let values = column_values::<Float32Type>(path, list.values().as_ref())?;
    if values.len() != list.len() * size {
        return Err(corrupt(format!(
            "{p}: list column has {} values for {} rows",
            values.len(),
            list.len()
        )));
    }
    Ok(values)
}

/// The columns of a decoded batch, borrowed from its buffers.
fn row_slices<'a>(
    path: &Path,
    batch: &'a RecordBatch,
    schema: PartSchema,
) -> Result<RowSlices<'a>> {
    let c = batch.columns();
    let rows = RowSlices {
        ids: column_values::<UInt64Type>(path, c[0].as_ref())?,
        step: column_values::<UInt32Type>(path, c[1].as_ref())?,
        version: column_values::<UInt64Type>(path, c[2].as_ref())?,
        updated_at: column_values::<UInt32Type>(path, c[3].as_ref())?,
        freq: column_values::<UInt32Type>(path, c[4].as_ref())?,
        weights: list_values(path, c[5].as_ref(), schema.dim)?,
        state: if schema.state_len > 0 {
            list_values(path, c[6].as_ref(), schema.state_len)?
        } else {
            &[]
        },
    };
    let n = rows.len();
    let consistent = rows.step.len() == n
        && rows.version.len() == n
        && rows.updated_at.len() == n
        && rows.freq.len() == n
        && rows.weights.len() == n * schema.dim
        && rows.state.len() == n * schema.state_len;
    if !consistent {
        return Err(corrupt(format!(
            "{}: columns of unequal length",
            path.display()
        )));
    }
    Ok(rows)
}

/// Checks the file against `expect` (size, then crc32 of all bytes, then that it is an Arrow IPC
/// file whose schema is exactly the one `PartWriter` writes for `schema`, then the row count),
/// then calls `f` with each record batch in order, its columns borrowed from the mapped file. Any
/// mismatch is `Error::Corrupt` naming the path; nothing reaches `f` unless size, checksum, schema
/// and row count are right.
pub fn read_part(
    path: &Path,
    schema: PartSchema,
    expect: &FileInfo,
    mut f: impl FnMut(&RowSlices<'_>) -> Result<()>,
) -> Result<()> {
    let bytes = read_verified(path, expect)?;
    let expected = part_arrow_schema(schema);
    let what = format!("dim {} state_len {}", schema.dim, schema.state_len);
    let batches = decode(path, bytes, |found| {
        check_schema(path, found, &expected, &what)
    })?;
    check_rows(path, &batches, expect)?;
    for batch in &batches {
        f(&row_slices(path, batch, schema)?)?;
    }
    Ok(())
}

/// Reads an ids file written by `write_ids`, checked against `expect` like `read_part`.
pub fn read_ids(path: &Path, expect: &FileInfo) -> Result<Vec<u64>> {
    let bytes = read_verified(path, expect)?;
    let expected = ids_arrow_schema();
    let batches = decode(path, bytes, |found| {
        check_schema(path, found, &expected, "an ids file")
    })?;
    check_rows(path, &batches, expect)?;
    let mut ids = Vec::with_capacity(expect.rows as usize);
    for batch in &batches {
        ids.extend_from_slice(column_values::<UInt64Type>(path, batch.column(0).as_ref())?);
    }
    Ok(ids)
}

/// For inspection without a manifest: rows and schema of a part file (no checksum).
pub fn part_summary(path: &Path) -> Result<(u64, PartSchema)> {
    let bytes = read_file(path)?;
    let mut part = None;
    let batches = decode(path, Buffer::from_vec(bytes), |found| {
        let inferred = infer_part_schema(found);
        // An unknown shape is checked against dim 1 to get the error message.
        let s = inferred.unwrap_or(PartSchema {
            dim: 1,
            state_len: 0,
        });
        check_schema(path, found, &part_arrow_schema(s), "a pstore rows file")?;
        part = inferred;
        Ok(())
    })?;
    let part = part.ok_or_else(|| Error::Internal("part schema not inferred".into()))?;
    Ok((batches.iter().map(|b| b.num_rows() as u64).sum(), part))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("pstore-files-test-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sample(rows: usize, first_id: u64, schema: PartSchema) -> RowBatch {
        let mut b = RowBatch::default();
        for r in 0..rows {
            let id = first_id + r as u64 * 7919;
            b.ids.push(id);
            b.step.push(r as u32 * 3);
            b.version.push((id << 20) ^ 0xdead_beef_0000_0001);
            b.updated_at.push(1_700_000_000 + r as u32);
            b.freq.push(u32::MAX - r as u32);
            b.weights
                .extend((0..schema.dim).map(|k| id as f32 * 0.5 - k as f32));
            b.state
                .extend((0..schema.state_len).map(|k| -(id as f32) + k as f32 * 0.25));
        }
        b
    }

    fn write_part(path: &Path, schema: PartSchema, batches: &[RowBatch]) -> FileInfo {
        let mut w = PartWriter::create(path, "p/part.arrow", schema).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap()
    }

    fn read_all(path: &Path, schema: PartSchema, info: &FileInfo) -> Result<Vec<RowBatch>> {
        let mut out = Vec::new();
        read_part(path, schema, info, |b| {
            out.push(b.to_batch());
            Ok(())
        })?;
        Ok(out)
    }

    fn expect_corrupt(r: Result<impl std::fmt::Debug>, path: &Path, what: &str) {
        match r {
            Err(Error::Corrupt(msg)) => {
                assert!(msg.contains(&path.display().to_string()), "{msg}");
                assert!(msg.contains(what), "{msg:?} does not mention {what:?}");
            }
            other => panic!("expected Corrupt({what}), got {other:?}"),
        }
    }

    const SCHEMAS: [PartSchema; 3] = [
        PartSchema {
            dim: 4,
            state_len: 4,
        },
        PartSchema {
            dim: 1,
            state_len: 0,
        },
        PartSchema {
            dim: 3,
            state_len: 7,
        },
    ];

    #[test]
    fn parts_round_trip() {
        let dir = TempDir::new("round-trip");
        for (n, schema) in SCHEMAS.into_iter().enumerate() {
            let path = dir.path(&format!("part-{n}.arrow"));
            let batches = vec![
                sample(5, 1, schema),
                RowBatch::default(),
                sample(1, 100, schema),
                sample(300, 5000, schema),
            ];
            let info = write_part(&path, schema, &batches);
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(info.name, "p/part.arrow");
            assert_eq!(info.rows, 306);
            assert_eq!(info.bytes, bytes.len() as u64);
            assert_eq!(info.crc32, crc32fast::hash(&bytes));

            let back = read_all(&path, schema, &info).unwrap();
            let written: Vec<RowBatch> = batches.into_iter().filter(|b| !b.is_empty()).collect();
            assert_eq!(back, written);
            assert_eq!(part_summary(&path).unwrap(), (306, schema));
        }
    }

    #[test]
    fn chunked_writes_split_batches() {
        let dir = TempDir::new("chunked");
        let schema = SCHEMAS[2];
        let path = dir.path("part.arrow");
        let batch = sample(20, 7, schema);
        let mut w = PartWriter::create(&path, "part.arrow", schema).unwrap();
        w.write_chunked(&batch, 8).unwrap();
        w.write_chunked(&sample(3, 99, schema), 8).unwrap();
        let info = w.finish().unwrap();
        assert_eq!(info.rows, 23);
        let back = read_all(&path, schema, &info).unwrap();
        let lens: Vec<usize> = back.iter().map(RowBatch::len).collect();
        assert_eq!(lens, [8, 8, 4, 3]);
        let mut all = RowBatch::default();
        let mut words = Vec::new();
        for b in &back[..3] {
            for i in 0..b.len() {
                words.clear();
                b.row_words(i, schema, &mut words);
                all.push_words(b.ids[i], &words, schema);
            }
        }
        assert_eq!(all, batch);
        assert_eq!(back[3], sample(3, 99, schema));
    }

    #[test]
    fn empty_part_file() {
        let dir = TempDir::new("empty-part");
        let path = dir.path("empty.arrow");
        let schema = PartSchema {
            dim: 2,
            state_len: 1,
        };
        let info = write_part(&path, schema, &[]);
        assert_eq!(info.rows, 0);
        assert!(read_all(&path, schema, &info).unwrap().is_empty());
        assert_eq!(part_summary(&path).unwrap(), (0, schema));
    }

    #[test]
    fn ids_round_trip() {
        let dir = TempDir::new("ids");
        for (n, ids) in [vec![], vec![42u64], (0..10_000u64).map(|i| i * i).collect()]
            .into_iter()
            .enumerate()
        {
            let path = dir.path(&format!("ids-{n}.arrow"));
            let info = write_ids(&path, "ids.arrow", &ids).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(info.rows, ids.len() as u64);
            assert_eq!(info.bytes, bytes.len() as u64);
            assert_eq!(info.crc32, crc32fast::hash(&bytes));
            assert_eq!(read_ids(&path, &info).unwrap(), ids);
        }
    }

    #[test]
    fn flipped_byte_is_corrupt() {
        let dir = TempDir::new("flip");
        let schema = SCHEMAS[0];
        let path = dir.path("part.arrow");
        let info = write_part(&path, schema, &[sample(50, 3, schema)]);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let mut called = false;
        let r = read_part(&path, schema, &info, |_| {
            called = true;
            Ok(())
        });
        expect_corrupt(r, &path, "checksum mismatch");
        assert!(!called);

        let ids_path = dir.path("ids.arrow");
        let info = write_ids(&ids_path, "ids.arrow", &[1, 2, 3]).unwrap();
        let mut bytes = std::fs::read(&ids_path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&ids_path, &bytes).unwrap();
        expect_corrupt(read_ids(&ids_path, &info), &ids_path, "checksum mismatch");
    }

    #[test]
    fn truncated_file_is_corrupt() {
        let dir = TempDir::new("truncated");
        let schema = SCHEMAS[2];
        let path = dir.path("part.arrow");
        let info = write_part(
            &path,
            schema,
            &[sample(50, 3, schema), sample(9, 1, schema)],
        );
        let bytes = std::fs::read(&path).unwrap();
        let cut = &bytes[..bytes.len() - 100];
        std::fs::write(&path, cut).unwrap();
        expect_corrupt(read_all(&path, schema, &info), &path, "truncated");

        // A manifest entry that matches the truncated bytes: the Arrow footer is missing.
        let forged = FileInfo {
            bytes: cut.len() as u64,
            crc32: crc32fast::hash(cut),
            ..info
        };
        expect_corrupt(
            read_all(&path, schema, &forged),
            &path,
            "not an Arrow IPC file",
        );
        expect_corrupt(part_summary(&path), &path, "not an Arrow IPC file");
    }

    #[test]
    fn wrong_file_info_is_corrupt() {
        let dir = TempDir::new("info");
        let schema = SCHEMAS[0];
        let path = dir.path("part.arrow");
        let info = write_part(&path, schema, &[sample(20, 3, schema)]);
        let rows = FileInfo {
            rows: 21,
            ..info.clone()
        };
        expect_corrupt(read_all(&path, schema, &rows), &path, "row count mismatch");
        let bytes = FileInfo {
            bytes: info.bytes - 8,
            ..info.clone()
        };
        expect_corrupt(read_all(&path, schema, &bytes), &path, "size mismatch");
        let crc = FileInfo {
            crc32: info.crc32 ^ 1,
            ..info.clone()
        };
        expect_corrupt(read_all(&path, schema, &crc), &path, "checksum mismatch");

        let ids_path = dir.path("ids.arrow");
        let info = write_ids(&ids_path, "ids.arrow", &[5, 6]).unwrap();
        let rows = FileInfo { rows: 3, ..info };
        expect_corrupt(read_ids(&ids_path, &rows), &ids_path, "row count mismatch");
    }

    #[test]
    fn other_schema_is_corrupt() {
        let dir = TempDir::new("schema");
        let path = dir.path("part.arrow");
        let written = PartSchema {
            dim: 8,
            state_len: 0,
        };
        let info = write_part(&path, written, &[sample(4, 3, written)]);
        let r = read_all(
            &path,
            PartSchema {
                dim: 4,
                state_len: 0,
            },
            &info,
        );
        expect_corrupt(r, &path, "file has dim 8 state_len 0");
        let r = read_all(
            &path,
            PartSchema {
                dim: 8,
                state_len: 8,
            },
            &info,
        );
        expect_corrupt(r, &path, "wrong schema");
        // A part file is not an ids file, and the other way round.
        expect_corrupt(read_ids(&path, &info), &path, "wrong file kind");
        let ids_path = dir.path("ids.arrow");
        let ids_info = write_ids(&ids_path, "ids.arrow", &[1]).unwrap();
        expect_corrupt(
            read_all(&ids_path, written, &ids_info),
            &ids_path,
            "wrong file kind",
        );
        expect_corrupt(part_summary(&ids_path), &ids_path, "wrong file kind");
    }

    #[test]
    fn foreign_files_are_corrupt() {
        let dir = TempDir::new("foreign");
        let path = dir.path("junk.arrow");
        std::fs::write(&path, b"this is not arrow at all, just some text").unwrap();
        expect_corrupt(part_summary(&path), &path, "not an Arrow IPC file");
        let bytes = std::fs::read(&path).unwrap();
        let info = FileInfo {
            name: "junk.arrow".into(),
            rows: 0,
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        };
        let schema = SCHEMAS[1];
        expect_corrupt(
            read_all(&path, schema, &info),
            &path,
            "not an Arrow IPC file",
        );

        // An Arrow file without pstore metadata.
        let plain = Schema::new(vec![Field::new("id", DataType::UInt64, false)]);
        let plain_path = dir.path("plain.arrow");
        let mut file = IpcFile::create(&plain_path, "plain.arrow", &plain).unwrap();
        file.write(2, &[Column::U64(&[1u64, 2])]).unwrap();
        let info = file.finish().unwrap();
        expect_corrupt(
            read_ids(&plain_path, &info),
            &plain_path,
            "not a pstore file",
        );
    }

    #[test]
    fn damaged_files_never_panic() {
        // Damage past the checksum (a manifest that matches the damaged bytes) must still end in
        // an error or a readable file, never in a panic.
        let dir = TempDir::new("damage");
        let schema = SCHEMAS[2];
        let path = dir.path("part.arrow");
        write_part(&path, schema, &[sample(3, 3, schema), sample(2, 9, schema)]);
        let good = std::fs::read(&path).unwrap();
        let damaged = dir.path("damaged.arrow");
        let check = |bytes: &[u8]| {
            std::fs::remove_file(&damaged).ok();
            std::fs::write(&damaged, bytes).unwrap();
            let info = FileInfo {
                name: "damaged.arrow".into(),
                rows: 5,
                bytes: bytes.len() as u64,
                crc32: crc32fast::hash(bytes),
            };
            let _ = part_summary(&damaged);
            let _ = read_all(&damaged, schema, &info);
        };
        for i in 0..good.len() {
            for bit in [0x01u8, 0x80] {
                let mut bytes = good.clone();
                bytes[i] ^= bit;
                check(&bytes);
            }
        }
        for len in (0..good.len()).step_by(7) {
            check(&good[..len]);
        }
    }

    #[test]
    fn create_existing_is_storage_error() {
        let dir = TempDir::new("exists");
        let path = dir.path("part.arrow");
        std::fs::write(&path, b"x").unwrap();
        match PartWriter::create(&path, "part.arrow", SCHEMAS[0]) {
            Err(Error::Storage(msg)) => assert!(msg.contains(&path.display().to_string()), "{msg}"),
            other => panic!("expected Storage, got {:?}", other.err()),
        }
        assert!(matches!(
            write_ids(&path, "part.arrow", &[1]),
            Err(Error::Storage(_))
        ));
        let missing = dir.path("missing.arrow");
        let info = FileInfo {
            name: "missing.arrow".into(),
            rows: 0,
            bytes: 0,
            crc32: 0,
        };
        assert!(
            matches!(read_ids(&missing, &info), Err(Error::Corrupt(ref m)) if m.contains("missing"))
        );
    }

    #[test]
    fn inconsistent_batch_is_rejected() {
        let dir = TempDir::new("inconsistent");
        let schema = SCHEMAS[0];
        let mut w = PartWriter::create(&dir.path("part.arrow"), "part.arrow", schema).unwrap();
        let mut b = sample(3, 1, schema);
        b.state.pop();
        assert!(matches!(w.write(&b), Err(Error::Internal(_))));
    }

    #[test]
    fn read_callback_error_stops_reading() {
        let dir = TempDir::new("callback");
        let schema = SCHEMAS[1];
        let path = dir.path("part.arrow");
        let info = write_part(&path, schema, &[sample(2, 1, schema), sample(2, 5, schema)]);
        let mut calls = 0;
        let r = read_part(&path, schema, &info, |_| {
            calls += 1;
            Err(Error::Internal("stop".into()))
        });
        assert_eq!(r, Err(Error::Internal("stop".into())));
        assert_eq!(calls, 1);
    }

    #[test]
    fn words_round_trip() {
        for schema in SCHEMAS {
            let mut batch = RowBatch::default();
            let mut rows = Vec::new();
            for r in 0..5u32 {
                let mut words = vec![
                    r * 11,
                    0xffff_ffff,
                    0x8000_0001 + r,
                    0x7fff_0000 | r,
                    1234,
                    r,
                ];
                words.extend(
                    (0..schema.dim + schema.state_len)
                        .map(|k| (r as f32 * 1.5 - k as f32).to_bits()),
                );
                batch.push_words(r as u64 * 1_000_000_007, &words, schema);
                words[1] = 0; // the reserved word comes back as 0
                rows.push(words);
            }
            assert_eq!(batch.len(), 5);
            assert_eq!(batch.version[1], 0x7fff_0001_8000_0002);
            for (i, words) in rows.iter().enumerate() {
                let mut out = vec![99];
                batch.row_words(i, schema, &mut out);
                assert_eq!(&out[1..], &words[..]);
            }
            batch.clear();
            assert!(batch.is_empty());
        }
    }
}
