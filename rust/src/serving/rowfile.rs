//! A sparse table's rows for lookups: one read-only file per table and generation holding a
//! hashed index (open addressing, linear probing) over cache-line-aligned rows. Serving
//! processes map it (`MAP_SHARED`, read-only), so they share one copy through the page cache,
//! and opening reads only its first page. Layout: docs/FORMAT.md, "Row files".

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::quant::Dtype;
use crate::error::{corrupt, storage, Result};
use crate::hash::mix64;

/// The first bytes of every row file.
pub const MAGIC: [u8; 8] = *b"PSTROWS\0";
/// The row file layout this build writes (it reads layouts 1 and 2 too).
/// Layout 1: no checks. Layout 2: each row is followed by its checksum ([`row_sum`]), and each
/// slot carries a check of itself ([`slot_check`]) above its row index. Layout 3: slots as in
/// layout 2, rows at the stride of their bytes (as in layout 1), their checksums in an array
/// after the rows: a row verified once in a process is read later without the checksum's line.
pub const FILE_VERSION: u32 = 3;
/// Bits of a layout 2 slot's second word that hold the row index plus one; the check of the
/// slot is in the bits above.
const INDEX_BITS: u32 = 40;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// Bytes of a row's checksum, right after its stored bytes (layout 2).
pub const ROW_SUM_BYTES: usize = 4;
/// The header: one page, so the slots and rows start page-aligned.
const HEADER: usize = 4096;
/// Header bytes covered by its CRC-32 (stored right after them).
const HEADER_CRC_AT: usize = 64;
/// A slot: the id (u64 LE), then its row's index plus one (u64 LE; 0 marks an empty slot).
const SLOT: usize = 16;
/// Slots per batch stage: the misses of one stage overlap.
const BLOCK: usize = 32;
/// Rows whose ids one pass of [`RowFile::verify_all`] collects from the index (8 bytes each).
const SCAN_WINDOW: usize = 1 << 22;
/// Rows or slots [`RowFile::verify_all`] handles between two looks at whether to stop.
const SCAN_STEP: usize = 1 << 16;

/// Where the whole-file check of a row file stands ([`RowFile::verify_all`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// Not asked for (or layout 1: nothing to check): reads check rows and slots themselves.
    Off,
    /// Queued or under way: reads check what it has not verified yet.
    Running,
    /// Every row and slot verified: reads check nothing more.
    Verified,
    /// Damage found: the damaged rows or slots are refused on every read; reads keep checking.
    Damaged,
    /// Stopped before its end (the file was closed): reads keep checking.
    Stopped,
}

impl Scan {
    fn code(self) -> u8 {
        self as u8
    }

    fn of(code: u8) -> Scan {
        [
            Scan::Off,
            Scan::Running,
            Scan::Verified,
            Scan::Damaged,
            Scan::Stopped,
        ][code as usize]
    }

    /// The name `verified()` reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Scan::Off => "off",
            Scan::Running => "running",
            Scan::Verified => "verified",
            Scan::Damaged => "damaged",
            Scan::Stopped => "stopped",
        }
    }
}

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

/// The checksum of row `id` with `bytes` (as stored): CRC-32 of the id (u64 LE) then the bytes.
/// It follows the row in a layout 2 file.
#[inline]
pub fn row_sum(id: u64, bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&id.to_le_bytes());
    h.update(bytes);
    h.finalize()
}

/// The check of a slot holding `id` and row index plus one `r1` (24 bits, the high bits of a
/// layout 2 slot's second word): a probe checks every slot it passes, so an id damaged in its
/// slot is not taken for an absent one.
#[inline(always)]
pub fn slot_check(id: u64, r1: u64) -> u64 {
    mix64(id ^ mix64(r1 ^ 0x7073_7472_6f77_7332)) >> INDEX_BITS
}

/// Bytes a row takes in a file of `version` (its stored bytes, then its checksum in layout 2).
fn entry_bytes(version: u32, row_bytes: usize) -> usize {
    if version == 2 {
        row_bytes + ROW_SUM_BYTES
    } else {
        row_bytes
    }
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
    /// Layout 3: where the array of the rows' checksums starts (layout 2: after each row).
    sums_at: Option<usize>,
    /// Layouts 2 and 3: slots and rows carry checks, each verified on its first read here.
    checked: bool,
    /// One bit per row (layout 2): set once this process verified the row's checksum, so later
    /// lookups skip it. The file never changes (a generation that changes rows writes a new
    /// file, opened with a bitmap of its own), so a set bit never covers other bytes.
    verified: Box<[AtomicU64]>,
    /// One bit per index slot (layout 2): set once this process verified the slot's check.
    slots_verified: Box<[AtomicU64]>,
    /// A [`Scan`]: `Verified` once a whole-file check found every row and slot sound; lookups
    /// then take layout 1's path (no bitmap, no checksum line), testing this once a batch.
    scan: AtomicU8,
}

impl std::fmt::Debug for RowFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowFile")
            .field("path", &self.path)
            .field("rows", &self.rows)
            .finish()
    }
}

/// The layout of a file of `version` with `rows` rows: (slots, where the rows start, file
/// length). Layout 3 ends with the rows' checksums (4 bytes a row, right after the rows).
fn layout(version: u32, rows: u64, stride: usize) -> (u64, usize, usize) {
    let slots = slots_for(rows);
    let rows_at = (HEADER + slots as usize * SLOT).div_ceil(4096) * 4096;
    let sums = if version >= 3 {
        rows as usize * ROW_SUM_BYTES
    } else {
        0
    };
    (slots, rows_at, rows_at + rows as usize * stride + sums)
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
        if !(1..=FILE_VERSION).contains(&version) {
            return Err(bad(format!(
                "has layout version {version}; this pstore reads versions 1 to {FILE_VERSION}"
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
        let st = stride(entry_bytes(version, row_bytes));
        let (want_slots, rows_at, want_len) = layout(version, rows, st);
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
            sums_at: (version >= 3).then(|| rows_at + rows as usize * st),
            checked: version >= 2,
            verified: if version >= 2 {
                (0..rows.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
            } else {
                Box::default()
            },
            slots_verified: if version >= 2 {
                (0..slots.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
            } else {
                Box::default()
            },
            scan: AtomicU8::new(Scan::Off.code()),
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

    /// Where row `r`'s checksum is (layouts 2 and 3).
    #[inline(always)]
    fn sum_at(&self, r: usize) -> usize {
        match self.sums_at {
            Some(s) => s + r * ROW_SUM_BYTES,
            None => self.rows_at + r * self.stride + self.row_bytes,
        }
    }

    /// Whether row `r` (< rows) needs no check: layout 1, or verified before in this process.
    #[inline(always)]
    fn trusted(&self, r: usize) -> bool {
        !self.checked || self.verified[r / 64].load(Ordering::Relaxed) & (1 << (r % 64)) != 0
    }

    /// Whether reads check nothing: layout 1, or every row and slot verified by
    /// [`RowFile::verify_all`]. Tested once a batch.
    #[inline(always)]
    fn unchecked(&self) -> bool {
        !self.checked || self.scan.load(Ordering::Acquire) == Scan::Verified.code()
    }

    /// Where the whole-file check stands.
    pub fn scan_state(&self) -> Scan {
        Scan::of(self.scan.load(Ordering::Acquire))
    }

    /// Marks the file queued for [`RowFile::verify_all`]; false when it needs none (layout 1)
    /// or was queued before.
    pub fn queue_scan(&self) -> bool {
        self.checked
            && self
                .scan
                .compare_exchange(
                    Scan::Off.code(),
                    Scan::Running.code(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Marks a queued file as not scanned after all (no thread to scan it).
    pub fn unqueue_scan(&self) {
        let _ = self.scan.compare_exchange(
            Scan::Running.code(),
            Scan::Off.code(),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Rows of the file whose checksum this process verified (layout 2; 0 for layout 1).
    pub fn rows_verified(&self) -> u64 {
        self.verified
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum()
    }

    /// Bytes of the bitmaps of verified rows and slots.
    pub fn bitmap_bytes(&self) -> usize {
        (self.verified.len() + self.slots_verified.len()) * 8
    }

    /// The stored bytes of row `r` (< rows) of `id`: its checksum verified on its first read
    /// in this process (layout 2), later reads trust that check.
    #[inline(always)]
    fn row<const CHECK: bool>(&self, id: u64, r: usize) -> Result<&[u8]> {
        if !CHECK || self.trusted(r) {
            let at = self.rows_at + r * self.stride;
            return Ok(&self.map.bytes()[at..at + self.row_bytes]);
        }
        let row = self.checked_row(id, r)?;
        // Relaxed: the bit covers bytes of a file that never changes, read by every thread.
        self.verified[r / 64].fetch_or(1 << (r % 64), Ordering::Relaxed);
        Ok(row)
    }

    /// The stored bytes of row `r` (< rows) of `id`, its checksum verified now (layout 2).
    fn checked_row(&self, id: u64, r: usize) -> Result<&[u8]> {
        let at = self.rows_at + r * self.stride;
        let b = self.map.bytes();
        let row = &b[at..at + self.row_bytes];
        if self.checked {
            let stored = u32_at(b, self.sum_at(r));
            let found = row_sum(id, row);
            if stored != found {
                return Err(corrupt(format!(
                    "the row file {}: the row of id {id} is damaged (checksum {stored:08x} \
                     stored, {found:08x} computed); it is not served: export the artifact again",
                    self.path.display()
                )));
            }
        }
        Ok(row)
    }

    /// The row index plus one of slot `i` holding `k` and `w` (its second word), its check
    /// verified (layout 2); 0 for an empty slot. `looking`: the id whose probe reads it.
    /// A slot verified before in this process is trusted (its bit in `slots_verified`).
    #[inline(always)]
    fn slot_row<const CHECK: bool>(&self, i: usize, k: u64, w: u64, looking: u64) -> Result<u64> {
        if !CHECK {
            // Layout 1 (no check bits) or every slot verified.
            return Ok(w & INDEX_MASK);
        }
        if !self.checked || w == 0 {
            return Ok(w);
        }
        let bit = 1 << (i % 64);
        if self.slots_verified[i / 64].load(Ordering::Relaxed) & bit != 0 {
            return Ok(w & INDEX_MASK);
        }
        let r1 = self.slot_row_now(i, k, w, looking)?;
        self.slots_verified[i / 64].fetch_or(bit, Ordering::Relaxed);
        Ok(r1)
    }

    /// As [`RowFile::slot_row`], the check verified now whatever earlier reads found.
    #[inline(always)]
    fn slot_row_now(&self, i: usize, k: u64, w: u64, looking: u64) -> Result<u64> {
        if !self.checked || w == 0 {
            return Ok(w);
        }
        let r1 = w & INDEX_MASK;
        if r1 == 0 || w >> INDEX_BITS != slot_check(k, r1) {
            return Err(self.damaged_slot(i, k, w, looking));
        }
        Ok(r1)
    }

    /// The error of slot `i` (holding `k`, `w`) whose check fails. A single flipped bit is
    /// undone to name the id the slot was written for, where one explains it.
    #[cold]
    fn damaged_slot(&self, i: usize, k: u64, w: u64, looking: u64) -> crate::error::Error {
        let fits = |k: u64, w: u64| {
            w & INDEX_MASK != 0 && w >> INDEX_BITS == slot_check(k, w & INDEX_MASK)
        };
        let was = (0..64)
            .map(|b| k ^ (1 << b))
            .find(|&k| fits(k, w))
            .or_else(|| (0..64).any(|b| fits(k, w ^ (1 << b))).then_some(k));
        let whose = match was {
            Some(id) => format!("the slot of id {id}"),
            None => format!("holding id {k}"),
        };
        corrupt(format!(
            "the row file {}: index slot {i} ({whose}) is damaged, found looking up id \
             {looking}; no row is served through it: export the artifact again",
            self.path.display()
        ))
    }

    /// The row index of `id`, starting the probe at slot `h & mask`.
    #[inline(always)]
    fn find_from<const CHECK: bool>(&self, id: u64, h: u64) -> Result<Option<usize>> {
        let mut i = h as usize & self.mask;
        for _ in 0..=self.mask {
            let (k, w) = self.slot(i);
            let r = self.slot_row::<CHECK>(i, k, w, id)?;
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
        let found = if self.unchecked() {
            self.find_from::<false>(id, mix64(id))?
        } else {
            self.find_from::<true>(id, mix64(id))?
        };
        Ok(found.is_some())
    }

    /// Decodes the rows of `ids` into `out` (`ids.len() * dim` floats) and marks `found`; ids
    /// the file lacks are left to the caller (their rows untouched). A row or slot whose check
    /// fails stops the batch with `CorruptError` naming the id. Stages of 32 ids: the slots
    /// of the next stage are prefetched while this stage's rows are decoded, and this stage's
    /// rows are prefetched as its slots are probed, so the misses of a stage overlap.
    pub fn gather(&self, ids: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        if self.unchecked() {
            self.gather_with::<false>(ids, out, found)
        } else {
            self.gather_with::<true>(ids, out, found)
        }
    }

    /// [`RowFile::gather`] with the per-read checks (`CHECK`) or without (layout 1, or a file
    /// [`RowFile::verify_all`] found sound).
    #[inline(always)]
    fn gather_with<const CHECK: bool>(
        &self,
        ids: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        let dim = self.dim;
        let row_bytes = self.row_bytes;
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
                at[k] = match self.find_from::<CHECK>(id, hashes[k])? {
                    Some(r) => {
                        // A verified row's checksum is not read: its line is not fetched.
                        let p = self.row_ptr(r);
                        let mut n = row_bytes;
                        if CHECK && !self.trusted(r) {
                            match self.sums_at {
                                Some(_) => prefetch(self.map.ptr.wrapping_add(self.sum_at(r))),
                                None => n += ROW_SUM_BYTES,
                            }
                        }
                        let lines = (p as usize % 64 + n).div_ceil(64);
                        let first = p.wrapping_sub(p as usize % 64);
                        for l in 0..lines {
                            // A prefetch never faults; these lines hold the row's bytes.
                            prefetch(first.wrapping_add(l * 64));
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
                    let row = self.row::<CHECK>(chunk[k], r)?;
                    self.dtype
                        .decode_fast(row, &mut out[i * dim..(i + 1) * dim]);
                }
            }
        }
        Ok(())
    }

    /// Every (id, row index) the index holds, in slot order (each slot's check verified now).
    pub fn entries(&self) -> Result<Vec<(u64, usize)>> {
        let mut out = Vec::with_capacity(self.rows as usize);
        for i in 0..=self.mask {
            let (k, w) = self.slot(i);
            let r = self.slot_row_now(i, k, w, k)?;
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

    /// The stored bytes of row index `r` of `id` (from [`RowFile::entries`]), its checksum
    /// verified now, whatever earlier reads found (rows copied into a new file or exported).
    pub fn stored(&self, id: u64, r: usize) -> Result<&[u8]> {
        self.checked_row(id, r)
    }

    /// Verifies every slot and row of the file once, in file order (the index, then the rows:
    /// sequential reads), setting their bits as reads would. Sets [`Scan::Verified`] when all
    /// are sound, so reads check nothing more; else [`Scan::Damaged`] (the bitmaps stay in use,
    /// the damaged rows and slots unverified, so every read of them is refused) or, when `stop`
    /// says so (looked at every [`SCAN_STEP`] rows or slots), [`Scan::Stopped`]. Ids are
    /// gathered for [`SCAN_WINDOW`] rows at a time (8 bytes a row); a file of more rows reads
    /// its index once per window.
    pub fn verify_all(&self, stop: &dyn Fn() -> bool) -> Scan {
        self.verify_all_in(SCAN_WINDOW, stop)
    }

    /// [`RowFile::verify_all`] gathering ids for `window` rows at a time.
    fn verify_all_in(&self, window: usize, stop: &dyn Fn() -> bool) -> Scan {
        // Windows start on a bitmap word.
        debug_assert!(window > 0 && window.is_multiple_of(64));
        let end = |s: Scan| {
            self.scan.store(s.code(), Ordering::Release);
            s
        };
        if !self.checked {
            return Scan::Off;
        }
        let rows = self.rows as usize;
        let slots = self.mask + 1;
        let mut damaged = false;
        let mut lo = 0;
        loop {
            let hi = rows.min(lo + window);
            let mut ids = vec![0u64; hi - lo];
            let mut have = vec![0u64; (hi - lo).div_ceil(64)];
            for base in (0..slots).step_by(64) {
                if base.is_multiple_of(SCAN_STEP) && stop() {
                    return end(Scan::Stopped);
                }
                let mut sound = 0u64;
                for j in 0..64.min(slots - base) {
                    let (k, w) = self.slot(base + j);
                    if w == 0 {
                        continue;
                    }
                    let r1 = w & INDEX_MASK;
                    if r1 == 0 || r1 > self.rows || w >> INDEX_BITS != slot_check(k, r1) {
                        damaged = true;
                        continue;
                    }
                    sound |= 1 << j;
                    let r = r1 as usize - 1;
                    if (lo..hi).contains(&r) {
                        let (word, bit) = ((r - lo) / 64, 1u64 << ((r - lo) % 64));
                        if have[word] & bit != 0 {
                            // Two slots name one row: one of them is damaged.
                            damaged = true;
                            continue;
                        }
                        have[word] |= bit;
                        ids[r - lo] = k;
                    }
                }
                if lo == 0 && sound != 0 {
                    self.slots_verified[base / 64].fetch_or(sound, Ordering::Relaxed);
                }
            }
            for start in (lo..hi).step_by(64) {
                if (start - lo).is_multiple_of(SCAN_STEP) {
                    if stop() {
                        return end(Scan::Stopped);
                    }
                    self.will_need(start + SCAN_STEP, SCAN_STEP);
                }
                let mut sound = 0u64;
                for r in start..hi.min(start + 64) {
                    let (word, bit) = ((r - lo) / 64, 1u64 << ((r - lo) % 64));
                    // A row no slot names cannot be checked (its id is unknown): damage.
                    if have[word] & bit == 0 || self.checked_row(ids[r - lo], r).is_err() {
                        damaged = true;
                        continue;
                    }
                    sound |= 1 << (r % 64);
                }
                if sound != 0 {
                    self.verified[start / 64].fetch_or(sound, Ordering::Relaxed);
                }
            }
            if hi == rows {
                break;
            }
            lo = hi;
        }
        end(if damaged {
            Scan::Damaged
        } else {
            Scan::Verified
        })
    }

    /// Asks the kernel to read rows `from..from + n` ahead (the mapping is advised random for
    /// lookups, which turns off read-ahead).
    fn will_need(&self, from: usize, n: usize) {
        let from = (from as u64).min(self.rows) as usize;
        let to = (from + n).min(self.rows as usize);
        if to <= from {
            return;
        }
        let start = (self.rows_at + from * self.stride) & !4095;
        let len = self.rows_at + to * self.stride - start;
        // SAFETY: advice on a page-aligned range inside our own mapping; it reads nothing.
        unsafe { libc::madvise(self.map.ptr.add(start).cast(), len, libc::MADV_WILLNEED) };
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
        if want.rows >= INDEX_MASK {
            return Err(crate::error::invalid(format!(
                "a table of {} rows does not fit a row file (at most {})",
                want.rows,
                INDEX_MASK - 1
            )));
        }
        let row_bytes = want.dtype.row_bytes(want.dim);
        let st = stride(entry_bytes(FILE_VERSION, row_bytes));
        let (slots, rows_at, len) = layout(FILE_VERSION, want.rows, st);
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
                let r1 = r as u64 + 1;
                // SAFETY: as above.
                unsafe {
                    let p = self.map.ptr.add(at);
                    p.cast::<u64>().write(id);
                    p.add(8)
                        .cast::<u64>()
                        .write(r1 | slot_check(id, r1) << INDEX_BITS);
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
        let sum_at = self.rows_at + self.want.rows as usize * self.stride + r * ROW_SUM_BYTES;
        let sum = row_sum(id, bytes).to_le_bytes();
        // SAFETY: row r's bytes and its checksum in the array after the rows lie inside the
        // mapping (r < rows); nothing else borrows them.
        unsafe {
            let p = self.map.ptr;
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(at), self.row_bytes);
            std::ptr::copy_nonoverlapping(sum.as_ptr(), p.add(sum_at), ROW_SUM_BYTES);
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

    /// A small float32 file of ids `id * 7919` for 0 <= id < n, at `path`.
    fn write_small(path: &Path, n: u64) -> Vec<f32> {
        let mut w = Writer::create(path, want(n, Dtype::Float32)).unwrap();
        let mut all = Vec::new();
        for id in 0..n {
            let row: Vec<f32> = (0..5).map(|j| (id * 10 + j) as f32 + 0.25).collect();
            let mut b = Vec::new();
            Dtype::Float32.encode(&row, &mut b).unwrap();
            w.put(id * 7919, &b).unwrap();
            all.extend(row);
        }
        w.finish().unwrap();
        all
    }

    /// Each row's (id, its slot's byte offset, its row's offset, its checksum's offset).
    fn places_of(f: &RowFile) -> Vec<(u64, usize, usize, usize)> {
        let mut places = Vec::new();
        for (id, r) in f.entries().unwrap() {
            let slot = (0..=f.mask).find(|&i| f.slot(i).0 == id).unwrap();
            places.push((
                id,
                HEADER + slot * SLOT,
                f.rows_at + r * f.stride,
                f.sum_at(r),
            ));
        }
        places
    }

    fn flip(path: &Path, at: usize, bit: usize) {
        let mut b = std::fs::read(path).unwrap();
        b[at] ^= 1 << bit;
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn every_bit_flip_in_a_row_or_its_slot_is_refused_naming_the_id() {
        let dir = std::env::temp_dir().join(format!("pstore-rowfile-flip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.rows");
        let n = 12u64;
        let rows = write_small(&path, n);
        let pristine = std::fs::read(&path).unwrap();
        let ids: Vec<u64> = (0..n).map(|i| i * 7919).collect();
        let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
        let places = places_of(&f);
        drop(f);
        let lookup = || {
            let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
            let mut out = vec![0.0; ids.len() * 5];
            let mut found = vec![false; ids.len()];
            f.gather(&ids, &mut out, &mut found).map(|()| (out, found))
        };
        for &(id, slot_at, row_at, sum_at) in &places {
            let bytes = (slot_at..slot_at + SLOT)
                .chain(row_at..row_at + 20)
                .chain(sum_at..sum_at + ROW_SUM_BYTES);
            for at in bytes {
                for bit in 0..8 {
                    std::fs::write(&path, &pristine).unwrap();
                    flip(&path, at, bit);
                    let e = lookup().unwrap_err().to_string();
                    assert!(e.contains(&format!("id {id}")), "byte {at} bit {bit}: {e}");
                }
            }
        }
        // A flip in an empty slot's id word changes nothing.
        std::fs::write(&path, &pristine).unwrap();
        let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
        let empty = (0..=f.mask).find(|&i| f.slot(i).1 == 0).unwrap();
        drop(f);
        flip(&path, HEADER + empty * SLOT + 3, 5);
        let (out, found) = lookup().unwrap();
        assert!(found.iter().all(|&f| f));
        assert_eq!(out, rows);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_whole_file_check_verifies_sound_files_and_never_a_damaged_one() {
        let dir = std::env::temp_dir().join(format!("pstore-rowfile-scan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.rows");
        let n = 200u64;
        let rows = write_small(&path, n);
        let pristine = std::fs::read(&path).unwrap();
        let ids: Vec<u64> = (0..n).map(|i| i * 7919).collect();
        let open = || RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
        let lookup = |f: &RowFile, ids: &[u64]| {
            let mut out = vec![0.0; ids.len() * 5];
            let mut found = vec![false; ids.len()];
            f.gather(ids, &mut out, &mut found).map(|()| out)
        };
        // Sound: every row and slot verified, in one window or several (64 rows each).
        for window in [SCAN_WINDOW, 64] {
            let f = open();
            assert_eq!(f.scan_state(), Scan::Off);
            assert!(f.queue_scan());
            assert!(!f.queue_scan());
            assert_eq!(f.verify_all_in(window, &|| false), Scan::Verified);
            assert_eq!(f.scan_state(), Scan::Verified);
            assert_eq!(f.rows_verified(), n);
            assert!(f.unchecked());
            assert_eq!(lookup(&f, &ids).unwrap(), rows);
        }
        // Asked to stop: stopped, and reads keep checking.
        let f = open();
        assert_eq!(f.verify_all(&|| true), Scan::Stopped);
        assert!(!f.unchecked());
        drop(f);
        // A damaged row (its bytes, its checksum) or slot: never `Verified`; the damaged id is
        // refused after the check, the others served.
        let (places, f) = {
            let f = open();
            let places = places_of(&f);
            (places, f)
        };
        drop(f);
        let (id, slot_at, row_at, sum_at) = places[17];
        for (at, window) in [
            (row_at + 3, SCAN_WINDOW),
            (sum_at + 2, 64),
            (slot_at + 2, 64),
        ] {
            std::fs::write(&path, &pristine).unwrap();
            flip(&path, at, 1);
            let f = open();
            assert_eq!(f.verify_all_in(window, &|| false), Scan::Damaged);
            assert!(!f.unchecked());
            assert!(f.rows_verified() < n);
            let e = lookup(&f, &[id]).unwrap_err().to_string();
            assert!(e.contains(&format!("id {id}")), "{e}");
            let others: Vec<u64> = ids.iter().copied().filter(|&i| i != id).collect();
            let got = lookup(&f, &others).unwrap();
            let want: Vec<f32> = (0..n as usize)
                .filter(|&r| ids[r] != id)
                .flat_map(|r| rows[r * 5..r * 5 + 5].to_vec())
                .collect();
            assert_eq!(got, want);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn layout_1_and_2_files_still_read() {
        for version in [1, 2] {
            read_old_layout(version);
        }
    }

    fn read_old_layout(version: u32) {
        let dir =
            std::env::temp_dir().join(format!("pstore-rowfile-v{version}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.rows");
        // Written as layout 1 did: slots of (id, row + 1), rows at stride(row bytes), no sums;
        // layout 2: slots with their check, each row followed by its checksum.
        let (n, dim) = (40u64, 5usize);
        let st = stride(entry_bytes(version, 4 * dim));
        let (slots, rows_at, len) = layout(version, n, st);
        let mut b = vec![0u8; len];
        for r in 0..n {
            let id = r * 31 + 5;
            let mut i = mix64(id) as usize & (slots as usize - 1);
            while u64_at(&b, HEADER + i * SLOT + 8) != 0 {
                i = (i + 1) & (slots as usize - 1);
            }
            b[HEADER + i * SLOT..][..8].copy_from_slice(&id.to_le_bytes());
            let check = if version == 2 {
                slot_check(id, r + 1) << INDEX_BITS
            } else {
                0
            };
            b[HEADER + i * SLOT + 8..][..8].copy_from_slice(&((r + 1) | check).to_le_bytes());
            let at = rows_at + r as usize * st;
            for j in 0..dim {
                let v = (id * 10 + j as u64) as f32;
                b[at + 4 * j..][..4].copy_from_slice(&v.to_le_bytes());
            }
            if version == 2 {
                let sum = row_sum(id, &b[at..at + 4 * dim]);
                b[at + 4 * dim..][..4].copy_from_slice(&sum.to_le_bytes());
            }
        }
        let h = &mut b[..HEADER_CRC_AT + 4];
        h[..8].copy_from_slice(&MAGIC);
        for (at, v) in [(8, version), (12, 0), (16, dim as u32), (20, st as u32)] {
            h[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        for (at, v) in [(24, n), (32, slots), (40, 3), (48, len as u64), (56, 7)] {
            h[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        let crc = crc32fast::hash(&h[..HEADER_CRC_AT]);
        h[HEADER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
        let ids: Vec<u64> = (0..n).map(|r| r * 31 + 5).chain([4, 6]).collect();
        let mut out = vec![-1.0; ids.len() * dim];
        let mut found = vec![false; ids.len()];
        f.gather(&ids, &mut out, &mut found).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let have = i < n as usize;
            assert_eq!(found[i], have);
            let row: Vec<f32> = (0..dim)
                .map(|j| {
                    if have {
                        (id * 10 + j as u64) as f32
                    } else {
                        -1.0
                    }
                })
                .collect();
            assert_eq!(&out[i * dim..(i + 1) * dim], &row[..]);
        }
        assert_eq!(f.entries().unwrap().len(), n as usize);
        assert_eq!(f.rows_verified(), if version == 2 { n } else { 0 });
        drop(f);
        if version == 2 {
            // Row 0 (id 5) damaged: refused on its first read.
            flip(&path, rows_at + 2, 3);
            let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
            let e = f.gather(&[5], &mut out[..dim], &mut found[..1]);
            let e = e.unwrap_err().to_string();
            assert!(e.contains("id 5 is damaged"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
