//! A sparse table's rows for lookups: one read-only file per table and generation holding a
//! hashed index (open addressing, linear probing) over cache-line-aligned rows. Serving
//! processes map it (`MAP_SHARED`, read-only), so they share one copy through the page cache,
//! and opening reads only its first page. Layout: docs/FORMAT.md, "Row files".

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::quant::Dtype;
use crate::error::{corrupt, storage, Result};
use crate::hash::mix64;

/// The first bytes of every row file.
pub const MAGIC: [u8; 8] = *b"PSTROWS\0";
/// The row file layout this build writes and reads.
pub const FILE_VERSION: u32 = 1;
/// The header: one page, so the slots and rows start page-aligned.
const HEADER: usize = 4096;
/// Header bytes covered by its CRC-32 (stored right after them).
const HEADER_CRC_AT: usize = 64;
/// A slot: the id (u64 LE), then its row's index plus one (u64 LE; 0 marks an empty slot).
const SLOT: usize = 16;
/// Slots per batch stage: the misses of one stage overlap.
const BLOCK: usize = 32;

/// Bytes from one row to the next for rows of `row_bytes`: rows of up to a cache line take a
/// power of two (so each lies in one line); longer ones the smallest multiple of 4 at which no
/// row touches more cache lines than its size needs (`row_bytes` rounded up to lines), so
/// 256-byte rows sit on line boundaries and 68-byte int8 rows (2 lines) are packed at 68.
pub fn stride(row_bytes: usize) -> usize {
    if row_bytes <= 64 {
        return row_bytes.next_power_of_two().max(4);
    }
    let lines = row_bytes.div_ceil(64);
    let mut s = row_bytes.div_ceil(4) * 4;
    loop {
        // Rows start at multiples of gcd(s, 64) within a line; the worst start is the last.
        let worst = 64 - gcd(s, 64);
        if (row_bytes + worst).div_ceil(64) == lines {
            return s;
        }
        s += 4;
    }
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Slots for `rows` rows: a power of two with the table at most two thirds full.
pub fn slots_for(rows: u64) -> u64 {
    (rows + rows / 2 + 1).next_power_of_two().max(16)
}

/// What a row file must be to belong to a table record (a file that is not is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// The artifact's id (a file copied from another artifact has another).
    pub artifact: u64,
    /// The generation that wrote the file, as the table record says.
    pub generation: u64,
    /// How rows are stored.
    pub dtype: Dtype,
    /// Elements per row.
    pub dim: usize,
    /// Rows.
    pub rows: u64,
}

fn dtype_code(d: Dtype) -> u32 {
    match d {
        Dtype::Float32 => 0,
        Dtype::Float16 => 1,
        Dtype::Int8 => 2,
    }
}

/// A shared mapping of a whole file.
pub(super) struct Map {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is never written through while shared (writers use their own mapping
// of a file no reader has yet), and unmapped only on drop.
unsafe impl Send for Map {}
// SAFETY: as above; reads through shared references only.
unsafe impl Sync for Map {}

impl Map {
    pub(super) fn new(f: &File, len: usize, writable: bool) -> std::io::Result<Map> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Map { ptr: p.cast(), len })
    }

    /// The first byte (page-aligned).
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; nothing borrows it past `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of x86_64; a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// An open row file.
pub struct RowFile {
    map: Map,
    path: PathBuf,
    dtype: Dtype,
    dim: usize,
    row_bytes: usize,
    stride: usize,
    rows: u64,
    mask: usize,
    rows_at: usize,
}

impl std::fmt::Debug for RowFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowFile")
            .field("path", &self.path)
            .field("rows", &self.rows)
            .finish()
    }
}

/// The layout of a file of `rows` rows: (slots, where the rows start, file length).
fn layout(rows: u64, stride: usize) -> (u64, usize, usize) {
    let slots = slots_for(rows);
    let rows_at = (HEADER + slots as usize * SLOT).div_ceil(4096) * 4096;
    (slots, rows_at, rows_at + rows as usize * stride)
}

impl RowFile {
    /// Maps the file at `path` and checks its header against `want`; reads nothing else.
    pub fn open(path: &Path, want: Expect) -> Result<RowFile> {
        let bad = |what: String| {
            corrupt(format!(
                "the row file {} {what}; export the artifact again",
                path.display()
            ))
        };
        let f =
            File::open(path).map_err(|e| storage(format!("opening {}: {e}", path.display())))?;
        let len = f
            .metadata()
            .map_err(|e| storage(format!("opening {}: {e}", path.display())))?
            .len() as usize;
        if len < HEADER {
            return Err(bad(format!(
                "is torn or not a pstore row file ({len} bytes, shorter than its header)"
            )));
        }
        let map = Map::new(&f, len, false)
            .map_err(|e| storage(format!("mapping {}: {e}", path.display())))?;
        let h = &map.bytes()[..HEADER];
        if h[..8] != MAGIC {
            return Err(bad("is not a pstore row file (no PSTROWS magic)".into()));
        }
        if u32_at(h, HEADER_CRC_AT) != crc32fast::hash(&h[..HEADER_CRC_AT]) {
            return Err(bad("has a damaged header (CRC-32 mismatch)".into()));
        }
        let version = u32_at(h, 8);
        if version != FILE_VERSION {
            return Err(bad(format!(
                "has layout version {version}; this pstore reads version {FILE_VERSION}"
            )));
        }
        let (dtype, dim, stride_f, rows) =
            (u32_at(h, 12), u32_at(h, 16), u32_at(h, 20), u64_at(h, 24));
        let (slots, generation, file_len, artifact) =
            (u64_at(h, 32), u64_at(h, 40), u64_at(h, 48), u64_at(h, 56));
        if artifact != want.artifact {
            return Err(bad(format!(
                "belongs to another artifact (id {artifact:016x}, this one is {:016x})",
                want.artifact
            )));
        }
        if generation != want.generation {
            return Err(bad(format!(
                "was written by generation {generation}, but the artifact's table record names \
                 generation {}",
                want.generation
            )));
        }
        if dtype != dtype_code(want.dtype) || dim as usize != want.dim || rows != want.rows {
            return Err(bad(format!(
                "holds {rows} rows of dim {dim} (dtype code {dtype}); the table record says {} \
                 rows of dim {} as {}",
                want.rows,
                want.dim,
                want.dtype.as_str()
            )));
        }
        let row_bytes = want.dtype.row_bytes(want.dim);
        let st = stride(row_bytes);
        let (want_slots, rows_at, want_len) = layout(rows, st);
        if stride_f as usize != st || slots != want_slots || file_len as usize != want_len {
            return Err(bad("has a header that does not fit its rows".into()));
        }
        if len != want_len {
            return Err(bad(format!(
                "is torn: {len} bytes where its header says {want_len}"
            )));
        }
        // SAFETY: advice on our own mapping; lookups touch it at random.
        unsafe { libc::madvise(map.ptr.cast(), len, libc::MADV_RANDOM) };
        Ok(RowFile {
            map,
            path: path.to_path_buf(),
            dtype: want.dtype,
            dim: want.dim,
            row_bytes,
            stride: st,
            rows,
            mask: slots as usize - 1,
            rows_at,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rows held.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    #[inline(always)]
    fn slot_ptr(&self, i: usize) -> *const u8 {
        // SAFETY: i <= mask < slots: inside the slot array of the mapping.
        unsafe { self.map.ptr.add(HEADER + i * SLOT) }
    }

    #[inline(always)]
    fn slot(&self, i: usize) -> (u64, u64) {
        let p = self.slot_ptr(i);
        // SAFETY: 16 bytes of the slot array, 8-aligned (page-aligned array of 16-byte slots).
        unsafe { (p.cast::<u64>().read(), p.add(8).cast::<u64>().read()) }
    }

    #[inline(always)]
    fn row_ptr(&self, r: usize) -> *const u8 {
        // SAFETY: r < rows (checked by `find`): inside the row array.
        unsafe { self.map.ptr.add(self.rows_at + r * self.stride) }
    }

    /// The stored bytes of row `r` (< rows).
    fn row(&self, r: usize) -> &[u8] {
        let at = self.rows_at + r * self.stride;
        &self.map.bytes()[at..at + self.row_bytes]
    }

    /// The row index of `id`, starting the probe at slot `h & mask`.
    #[inline(always)]
    fn find_from(&self, id: u64, h: u64) -> Result<Option<usize>> {
        let mut i = h as usize & self.mask;
        for _ in 0..=self.mask {
            let (k, r) = self.slot(i);
            if r == 0 {
                return Ok(None);
            }
            if k == id {
                if r > self.rows {
                    break;
                }
                return Ok(Some(r as usize - 1));
            }
            i = (i + 1) & self.mask;
        }
        Err(corrupt(format!(
            "the row file {} has a damaged index (probing for id {id} found no end or a row \
             past the last); export the artifact again",
            self.path.display()
        )))
    }

    /// Whether the file holds `id`.
    pub fn contains(&self, id: u64) -> Result<bool> {
        Ok(self.find_from(id, mix64(id))?.is_some())
    }

    /// Decodes the rows of `ids` into `out` (`ids.len() * dim` floats) and marks `found`; ids
    /// the file lacks are left to the caller (their rows untouched). Stages of 32 ids: the slots
    /// of the next stage are prefetched while this stage's rows are decoded, and this stage's
    /// rows are prefetched as its slots are probed, so the misses of a stage overlap.
    pub fn gather(&self, ids: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let dim = self.dim;
        let lines = self.row_bytes.div_ceil(64);
        let mut hashes = [0u64; BLOCK];
        let mut next = [0u64; BLOCK];
        let mut at = [usize::MAX; BLOCK];
        let stage = |ids: &[u64], h: &mut [u64; BLOCK]| {
            for (k, &id) in ids.iter().enumerate() {
                h[k] = mix64(id);
                prefetch(self.slot_ptr(h[k] as usize & self.mask));
            }
        };
        let mut chunks = ids.chunks(BLOCK).enumerate().peekable();
        if let Some(&(_, first)) = chunks.peek() {
            stage(first, &mut next);
        }
        while let Some((c, chunk)) = chunks.next() {
            hashes.copy_from_slice(&next);
            for (k, &id) in chunk.iter().enumerate() {
                at[k] = match self.find_from(id, hashes[k])? {
                    Some(r) => {
                        let p = self.row_ptr(r);
                        for l in 0..lines {
                            // SAFETY: inside the row (l * 64 < row_bytes).
                            prefetch(unsafe { p.add(l * 64) });
                        }
                        r
                    }
                    None => usize::MAX,
                };
            }
            if let Some(&(_, following)) = chunks.peek() {
                stage(following, &mut next);
            }
            let base = c * BLOCK;
            for (k, &r) in at[..chunk.len()].iter().enumerate() {
                let i = base + k;
                found[i] = r != usize::MAX;
                if found[i] {
                    self.dtype
                        .decode_fast(self.row(r), &mut out[i * dim..(i + 1) * dim]);
                }
            }
        }
        Ok(())
    }

    /// Every (id, row index) the index holds, in slot order.
    pub fn entries(&self) -> Result<Vec<(u64, usize)>> {
        let mut out = Vec::with_capacity(self.rows as usize);
        for i in 0..=self.mask {
            let (k, r) = self.slot(i);
            if r != 0 {
                if r > self.rows {
                    return Err(corrupt(format!(
                        "the row file {} has a damaged index (a slot names row {} of {})",
                        self.path.display(),
                        r - 1,
                        self.rows
                    )));
                }
                out.push((k, r as usize - 1));
            }
        }
        if out.len() as u64 != self.rows {
            return Err(corrupt(format!(
                "the row file {} has a damaged index ({} ids for {} rows)",
                self.path.display(),
                out.len(),
                self.rows
            )));
        }
        Ok(out)
    }

    /// The stored bytes of row index `r` (from [`RowFile::entries`]).
    pub fn stored(&self, r: usize) -> &[u8] {
        self.row(r)
    }
}

/// Writes a new row file: `create`, `put` each row once, `finish`.
pub struct Writer {
    map: Map,
    file: File,
    path: PathBuf,
    want: Expect,
    row_bytes: usize,
    stride: usize,
    mask: usize,
    rows_at: usize,
    next: u64,
}

impl Writer {
    /// Creates the file at `path` (replacing any) sized for `want.rows` rows.
    pub fn create(path: &Path, want: Expect) -> Result<Writer> {
        let io = |e: std::io::Error| storage(format!("writing {}: {e}", path.display()));
        let row_bytes = want.dtype.row_bytes(want.dim);
        let st = stride(row_bytes);
        let (slots, rows_at, len) = layout(want.rows, st);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io)?;
        // A sparse file of zeros: every slot empty.
        file.set_len(len as u64).map_err(io)?;
        let map = Map::new(&file, len, true).map_err(io)?;
        Ok(Writer {
            map,
            file,
            path: path.to_path_buf(),
            want,
            row_bytes,
            stride: st,
            mask: slots as usize - 1,
            rows_at,
            next: 0,
        })
    }

    /// Adds row `id` with its stored bytes. An id put twice is an error.
    pub fn put(&mut self, id: u64, bytes: &[u8]) -> Result<()> {
        if self.next >= self.want.rows || bytes.len() != self.row_bytes {
            return Err(crate::error::Error::Internal(format!(
                "row file {}: row {} of {} with {} bytes (want {})",
                self.path.display(),
                self.next,
                self.want.rows,
                bytes.len(),
                self.row_bytes
            )));
        }
        let r = self.next as usize;
        let mut i = mix64(id) as usize & self.mask;
        loop {
            let at = HEADER + i * SLOT;
            // SAFETY: a slot of our own writable mapping, 8-aligned.
            let (k, v) = unsafe {
                let p = self.map.ptr.add(at);
                (p.cast::<u64>().read(), p.add(8).cast::<u64>().read())
            };
            if v == 0 {
                // SAFETY: as above.
                unsafe {
                    let p = self.map.ptr.add(at);
                    p.cast::<u64>().write(id);
                    p.add(8).cast::<u64>().write(r as u64 + 1);
                }
                break;
            }
            if k == id {
                return Err(crate::error::Error::Internal(format!(
                    "row file {}: id {id} put twice",
                    self.path.display()
                )));
            }
            i = (i + 1) & self.mask;
        }
        let at = self.rows_at + r * self.stride;
        // SAFETY: row r's bytes lie inside the mapping (r < rows); nothing else borrows them.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.ptr.add(at), self.row_bytes)
        };
        self.next += 1;
        Ok(())
    }

    /// Writes the header and syncs the file. Every row must have been put.
    pub fn finish(self) -> Result<()> {
        if self.next != self.want.rows {
            return Err(crate::error::Error::Internal(format!(
                "row file {}: {} rows put of {}",
                self.path.display(),
                self.next,
                self.want.rows
            )));
        }
        let mut h = [0u8; HEADER_CRC_AT + 4];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&FILE_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&dtype_code(self.want.dtype).to_le_bytes());
        h[16..20].copy_from_slice(&(self.want.dim as u32).to_le_bytes());
        h[20..24].copy_from_slice(&(self.stride as u32).to_le_bytes());
        h[24..32].copy_from_slice(&self.want.rows.to_le_bytes());
        h[32..40].copy_from_slice(&(self.mask as u64 + 1).to_le_bytes());
        h[40..48].copy_from_slice(&self.want.generation.to_le_bytes());
        h[48..56].copy_from_slice(&(self.map.len as u64).to_le_bytes());
        h[56..64].copy_from_slice(&self.want.artifact.to_le_bytes());
        let crc = crc32fast::hash(&h[..HEADER_CRC_AT]);
        h[HEADER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        // SAFETY: the header page of our own writable mapping.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), self.map.ptr, h.len()) };
        // SAFETY: syncs our own mapping.
        let rc = unsafe { libc::msync(self.map.ptr.cast(), self.map.len, libc::MS_SYNC) };
        if rc != 0 {
            return Err(storage(format!(
                "syncing {}: {}",
                self.path.display(),
                std::io::Error::last_os_error()
            )));
        }
        self.file
            .sync_all()
            .map_err(|e| storage(format!("syncing {}: {e}", self.path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(rows: u64, dtype: Dtype) -> Expect {
        Expect {
            artifact: 7,
            generation: 3,
            dtype,
            dim: 5,
            rows,
        }
    }

    #[test]
    fn strides_touch_no_more_lines_than_needed() {
        assert_eq!(stride(256), 256);
        assert_eq!(stride(128), 128);
        assert_eq!(stride(68), 68);
        assert_eq!(stride(36), 64);
        assert_eq!(stride(20), 32);
        assert_eq!(stride(80), 80);
        assert_eq!(stride(260), 260);
        for b in 65..600 {
            let s = stride(b);
            let lines = b.div_ceil(64);
            for r in 0..64 {
                let at = r * s;
                assert_eq!((at + b - 1) / 64 - at / 64 + 1, lines, "{b} {s} {r}");
            }
        }
    }

    #[test]
    fn rows_written_are_found_and_others_are_not() {
        let dir = std::env::temp_dir().join(format!("pstore-rowfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for dtype in [Dtype::Float32, Dtype::Float16, Dtype::Int8] {
            let path = dir.join(format!("{}.rows", dtype.as_str()));
            let n = 1000u64;
            let mut w = Writer::create(&path, want(n, dtype)).unwrap();
            for id in 0..n {
                let row: Vec<f32> = (0..5).map(|j| (id * 10 + j) as f32).collect();
                let mut b = Vec::new();
                dtype.encode(&row, &mut b).unwrap();
                w.put(id * 7919, &b).unwrap();
            }
            assert!(w.put(1, &[0; 1]).is_err());
            w.finish().unwrap();
            let f = RowFile::open(&path, want(n, dtype)).unwrap();
            let ids: Vec<u64> = (0..2 * n).map(|i| i * 7919 / 2).collect();
            let mut out = vec![-1.0; ids.len() * 5];
            let mut found = vec![false; ids.len()];
            f.gather(&ids, &mut out, &mut found).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let have = id % 7919 == 0 && id / 7919 < n;
                assert_eq!(found[i], have, "{id}");
                if have {
                    let mut row = vec![0.0; 5];
                    let src: Vec<f32> = (0..5).map(|j| (id / 7919 * 10 + j) as f32).collect();
                    let mut b = Vec::new();
                    dtype.encode(&src, &mut b).unwrap();
                    dtype.decode(&b, &mut row);
                    assert_eq!(&out[i * 5..i * 5 + 5], &row[..]);
                } else {
                    assert_eq!(&out[i * 5..i * 5 + 5], &[-1.0; 5]);
                }
            }
            assert_eq!(f.entries().unwrap().len(), n as usize);
            let mut other = want(n, dtype);
            other.generation = 2;
            let e = RowFile::open(&path, other).unwrap_err().to_string();
            assert!(e.contains("generation 3"), "{e}");
            other = want(n, dtype);
            other.artifact = 8;
            let e = RowFile::open(&path, other).unwrap_err().to_string();
            assert!(e.contains("another artifact"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
