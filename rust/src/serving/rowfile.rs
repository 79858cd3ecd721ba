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
/// The row file layout this build writes (it reads layouts 1 and 2 too).
/// Layout 1: no checks. Layout 2: each row is followed by its CRC-32 ([`row_sum`]), and each
/// slot carries a check of itself ([`slot_check`]) above its row index. Layout 3: slots of 32
/// bytes holding, beside what a layout 2 slot holds, the row's check, a weighted word sum
/// ([`row_check`]) several times cheaper than the CRC; rows carry nothing after their bytes,
/// so a row touches no more cache lines than in layout 1 (the slot's line is read anyway).
pub const FILE_VERSION: u32 = 3;
/// Bits of a layout 2 slot's second word that hold the row index plus one; the check of the
/// slot is in the bits above.
const INDEX_BITS: u32 = 40;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// Bytes of a row's CRC-32, right after its stored bytes (layout 2).
pub const ROW_SUM_BYTES: usize = 4;
/// Where a layout 3 slot holds its row's check (u64 LE); the slot's last 8 bytes are zeros.
const SLOT_ROW_CHECK_AT: usize = 16;
/// The odd multiplier of the word-sum keys: word `i` (the id's two words first) is weighted by
/// `KEY * (2i + 1) mod 2^32`, distinct odd keys for every position a row can have.
const KEY: u32 = 0x85EB_CA6B;
/// The header: one page, so the slots and rows start page-aligned.
const HEADER: usize = 4096;
/// Header bytes covered by its CRC-32 (stored right after them).
const HEADER_CRC_AT: usize = 64;
/// A slot of layouts 1 and 2: the id (u64 LE), then its row's index plus one (u64 LE; 0 marks
/// an empty slot). Layout 3 slots are twice that (the row's check, then 8 zero bytes).
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

/// The checksum of row `id` with `bytes` (as stored): CRC-32 of the id (u64 LE) then the bytes.
/// It follows the row in a layout 2 file.
#[inline]
pub fn row_sum(id: u64, bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&id.to_le_bytes());
    h.update(bytes);
    h.finalize()
}

/// The check of row `id` with `bytes` (as stored) in a layout 3 file: the sum, modulo 2^64, of
/// the little-endian u32 words of the id (low word, then high word) and then of the bytes (the
/// last word zero-padded), each multiplied (exactly, as u64) by its position's key
/// `KEY * (2i + 1) mod 2^32`. It follows the row.
///
/// Every damage of one or two bits in the id, the row or the stored check changes it: one bit
/// `b` of word `i` moves the sum by `±key_i × 2^b`, nonzero and under 2^63 in size; two bits
/// cancel only if `key_i × 2^b = key_j × 2^c`, which odd distinct keys rule out, and a flip in
/// the row against one in the stored check only if a key were 1 (none is, for rows of under
/// 2^30 words). Unlike a CRC the words are independent, so the sum vectorises: a few ns per
/// 256-byte row where `crc32fast` took about 37.
#[inline]
pub fn row_check(id: u64, bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the feature the function is compiled for.
        return unsafe { row_check_avx2(id, bytes) };
    }
    word_sum(id, bytes)
}

/// [`word_sum`] with AVX2: eight words a step, the even and odd ones multiplied by their keys
/// in two 4 x u64 products.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_check_avx2(id: u64, bytes: &[u8]) -> u64 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32,
        _mm256_set1_epi32, _mm256_setr_epi32, _mm256_setzero_si256, _mm256_srli_epi64,
        _mm256_storeu_si256,
    };
    let key = |i: u32| KEY.wrapping_mul(2 * i + 1) as i32;
    let blocks = bytes.len() / 32;
    let mut acc = _mm256_setzero_si256();
    let mut keys = _mm256_setr_epi32(
        key(2),
        key(3),
        key(4),
        key(5),
        key(6),
        key(7),
        key(8),
        key(9),
    );
    let step = _mm256_set1_epi32(KEY.wrapping_mul(16) as i32);
    for b in 0..blocks {
        // SAFETY: 32 bytes at b * 32 < len - 31; an unaligned load.
        let v = unsafe { _mm256_loadu_si256(bytes.as_ptr().add(32 * b).cast::<__m256i>()) };
        let even = _mm256_mul_epu32(v, keys);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(v), _mm256_srli_epi64::<32>(keys));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(even, odd));
        keys = _mm256_add_epi32(keys, step);
    }
    let mut lanes = [0u64; 4];
    // SAFETY: 32 bytes stored into a 32-byte array.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), acc) };
    let head = lanes.iter().fold(0u64, |h, &l| h.wrapping_add(l));
    word_sum_from(id, bytes, 32 * blocks, head)
}

/// The portable [`row_check`].
#[inline(always)]
fn word_sum(id: u64, bytes: &[u8]) -> u64 {
    word_sum_from(id, bytes, 0, 0)
}

/// `sum` (the terms of the words of `bytes[..from]`, `from` a multiple of 4) plus the terms of
/// the id and of the words from `from` on.
#[inline(always)]
fn word_sum_from(id: u64, bytes: &[u8], from: usize, sum: u64) -> u64 {
    let term = |w: u32, k: u32| u64::from(w) * u64::from(k);
    let mut h = sum
        .wrapping_add(term(id as u32, KEY))
        .wrapping_add(term((id >> 32) as u32, KEY.wrapping_mul(3)));
    let mut k = KEY.wrapping_mul(2 * (2 + from as u32 / 4) + 1);
    let step = KEY.wrapping_mul(2);
    let words = bytes[from..].chunks_exact(4);
    let tail = words.remainder();
    for w in words {
        h = h.wrapping_add(term(u32::from_le_bytes(w.try_into().expect("4 bytes")), k));
        k = k.wrapping_add(step);
    }
    if !tail.is_empty() {
        let mut w = [0u8; 4];
        w[..tail.len()].copy_from_slice(tail);
        h = h.wrapping_add(term(u32::from_le_bytes(w), k));
    }
    h
}

/// The check of a slot holding `id` and row index plus one `r1` (24 bits, the high bits of a
/// layout 2 slot's second word): a probe checks every slot it passes, so an id damaged in its
/// slot is not taken for an absent one.
#[inline(always)]
pub fn slot_check(id: u64, r1: u64) -> u64 {
    mix64(id ^ mix64(r1 ^ 0x7073_7472_6f77_7332)) >> INDEX_BITS
}

/// How a layout checks its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Layout 1: not at all.
    None,
    /// Layout 2: a CRC-32 ([`row_sum`]).
    Crc32,
    /// Layout 3: a word sum ([`row_check`]).
    Words,
}

impl Check {
    fn of(version: u32) -> Check {
        match version {
            1 => Check::None,
            2 => Check::Crc32,
            _ => Check::Words,
        }
    }

    /// Bytes of the check after each row.
    fn bytes(self) -> usize {
        match self {
            Check::Crc32 => ROW_SUM_BYTES,
            Check::None | Check::Words => 0,
        }
    }

    /// Bytes of a slot.
    fn slot_bytes(self) -> usize {
        match self {
            Check::Words => 2 * SLOT,
            Check::None | Check::Crc32 => SLOT,
        }
    }
}

/// Bytes a row takes in a file of `version`: its stored bytes, then its check.
fn entry_bytes(version: u32, row_bytes: usize) -> usize {
    row_bytes + Check::of(version).bytes()
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
    /// Bytes of a slot.
    slot_bytes: usize,
    /// How rows are checked (layouts 2 and 3 also check every slot a probe passes).
    check: Check,
    /// The CPU runs the AVX2 build of [`row_check`].
    avx2: bool,
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
fn file_layout(rows: u64, stride: usize, slot_bytes: usize) -> (u64, usize, usize) {
    let slots = slots_for(rows);
    let rows_at = (HEADER + slots as usize * slot_bytes).div_ceil(4096) * 4096;
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
        let check = Check::of(version);
        let (want_slots, rows_at, want_len) = file_layout(rows, st, check.slot_bytes());
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
            slot_bytes: check.slot_bytes(),
            check,
            #[cfg(target_arch = "x86_64")]
            avx2: std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            avx2: false,
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
        unsafe { self.map.ptr.add(HEADER + i * self.slot_bytes) }
    }

    #[inline(always)]
    fn slot(&self, i: usize) -> (u64, u64) {
        let p = self.slot_ptr(i);
        // SAFETY: 16 bytes of the slot array, 8-aligned (page-aligned array of 16-byte slots).
        unsafe { (p.cast::<u64>().read(), p.add(8).cast::<u64>().read()) }
    }

    /// The row check a layout 3 slot holds.
    #[inline(always)]
    fn slot_row_check(&self, i: usize) -> u64 {
        // SAFETY: a layout 3 slot is 32 bytes; its third word is inside it, 8-aligned.
        unsafe { self.slot_ptr(i).add(SLOT_ROW_CHECK_AT).cast::<u64>().read() }
    }

    #[inline(always)]
    fn row_ptr(&self, r: usize) -> *const u8 {
        // SAFETY: r < rows (checked by `find`): inside the row array.
        unsafe { self.map.ptr.add(self.rows_at + r * self.stride) }
    }

    /// The stored bytes of row `r` (< rows) of `id`, found through slot `slot`, its check
    /// verified (layouts 2 and 3).
    #[inline(always)]
    fn row(&self, id: u64, r: usize, slot: usize) -> Result<&[u8]> {
        let at = self.rows_at + r * self.stride;
        let b = self.map.bytes();
        let row = &b[at..at + self.row_bytes];
        let (stored, found) = match self.check {
            Check::None => return Ok(row),
            Check::Crc32 => (
                u64::from(u32_at(b, at + self.row_bytes)),
                u64::from(row_sum(id, row)),
            ),
            Check::Words => (
                u64::from_le(self.slot_row_check(slot)),
                self.word_check(id, row),
            ),
        };
        if stored != found {
            return Err(self.damaged_row(id, stored, found));
        }
        Ok(row)
    }

    #[inline(always)]
    fn word_check(&self, id: u64, row: &[u8]) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `avx2` is set only when the CPU has the feature.
            return unsafe { row_check_avx2(id, row) };
        }
        word_sum(id, row)
    }

    #[cold]
    fn damaged_row(&self, id: u64, stored: u64, found: u64) -> crate::error::Error {
        corrupt(format!(
            "the row file {}: the row of id {id} is damaged (check {stored:x} stored, {found:x} \
             computed); it is not served: export the artifact again",
            self.path.display()
        ))
    }

    /// The row index plus one of slot `i` holding `k` and `w` (its second word), its check
    /// verified (layout 2); 0 for an empty slot. `looking`: the id whose probe reads it.
    #[inline(always)]
    fn slot_row(&self, i: usize, k: u64, w: u64, looking: u64) -> Result<u64> {
        if self.check == Check::None || w == 0 {
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

    /// The row index of `id` and the slot naming it, starting the probe at slot `h & mask`.
    #[inline(always)]
    fn find_from(&self, id: u64, h: u64) -> Result<Option<(usize, usize)>> {
        let mut i = h as usize & self.mask;
        for _ in 0..=self.mask {
            let (k, w) = self.slot(i);
            let r = self.slot_row(i, k, w, id)?;
            if r == 0 {
                return Ok(None);
            }
            if k == id {
                if r > self.rows {
                    break;
                }
                return Ok(Some((r as usize - 1, i)));
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
    /// the file lacks are left to the caller (their rows untouched). A row or slot whose check
    /// fails stops the batch with `CorruptError` naming the id. Stages of 32 ids: the slots
    /// of the next stage are prefetched while this stage's rows are decoded, and this stage's
    /// rows are prefetched as its slots are probed, so the misses of a stage overlap.
    pub fn gather(&self, ids: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        let dim = self.dim;
        let lines = (self.row_bytes + self.check.bytes()).div_ceil(64);
        let mut hashes = [0u64; BLOCK];
        let mut next = [0u64; BLOCK];
        let mut at = [(usize::MAX, 0); BLOCK];
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
                    Some((r, slot)) => {
                        let p = self.row_ptr(r);
                        for l in 0..lines {
                            // SAFETY: inside the row (l * 64 < row_bytes).
                            prefetch(unsafe { p.add(l * 64) });
                        }
                        (r, slot)
                    }
                    None => (usize::MAX, 0),
                };
            }
            if let Some(&(_, following)) = chunks.peek() {
                stage(following, &mut next);
            }
            let base = c * BLOCK;
            for (k, &(r, slot)) in at[..chunk.len()].iter().enumerate() {
                let i = base + k;
                found[i] = r != usize::MAX;
                if found[i] {
                    let row = self.row(chunk[k], r, slot)?;
                    self.dtype
                        .decode_fast(row, &mut out[i * dim..(i + 1) * dim]);
                }
            }
        }
        Ok(())
    }

    /// Every (id, row index) the index holds, in slot order (each slot's check verified).
    pub fn entries(&self) -> Result<Vec<(u64, usize)>> {
        let mut out = Vec::with_capacity(self.rows as usize);
        for i in 0..=self.mask {
            let (k, w) = self.slot(i);
            let r = self.slot_row(i, k, w, k)?;
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

    /// The stored bytes of row index `r` of `id` (from [`RowFile::entries`]), its check
    /// verified.
    pub fn stored(&self, id: u64, r: usize) -> Result<&[u8]> {
        let slot = match self.find_from(id, mix64(id))? {
            Some((at, slot)) if at == r => slot,
            _ => {
                return Err(corrupt(format!(
                    "the row file {}: id {id} does not name row {r}",
                    self.path.display()
                )))
            }
        };
        self.row(id, r, slot)
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
    slot_bytes: usize,
    next: u64,
    layout: u32,
}

impl Writer {
    /// Creates the file at `path` (replacing any) sized for `want.rows` rows, in the layout this
    /// build writes ([`FILE_VERSION`]).
    pub fn create(path: &Path, want: Expect) -> Result<Writer> {
        Writer::create_layout(path, want, FILE_VERSION)
    }

    /// As [`Writer::create`], in row file `layout` (1 to [`FILE_VERSION`]). Artifacts are
    /// written in the newest; the older ones exist for tests of reading them and to measure
    /// what each layout's check costs (`benches/row_checks.rs`).
    pub fn create_layout(path: &Path, want: Expect, layout: u32) -> Result<Writer> {
        let io = |e: std::io::Error| storage(format!("writing {}: {e}", path.display()));
        if !(1..=FILE_VERSION).contains(&layout) {
            return Err(crate::error::invalid(format!(
                "row file layout {layout}: this pstore writes layouts 1 to {FILE_VERSION}"
            )));
        }
        if want.rows >= INDEX_MASK {
            return Err(crate::error::invalid(format!(
                "a table of {} rows does not fit a row file (at most {})",
                want.rows,
                INDEX_MASK - 1
            )));
        }
        let row_bytes = want.dtype.row_bytes(want.dim);
        let st = stride(entry_bytes(layout, row_bytes));
        let slot_bytes = Check::of(layout).slot_bytes();
        let (slots, rows_at, len) = file_layout(want.rows, st, slot_bytes);
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
            slot_bytes,
            next: 0,
            layout,
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
            let at = HEADER + i * self.slot_bytes;
            // SAFETY: a slot of our own writable mapping, 8-aligned.
            let (k, v) = unsafe {
                let p = self.map.ptr.add(at);
                (p.cast::<u64>().read(), p.add(8).cast::<u64>().read())
            };
            if v == 0 {
                let r1 = r as u64 + 1;
                let check = Check::of(self.layout);
                let w = match check {
                    Check::None => r1,
                    _ => r1 | slot_check(id, r1) << INDEX_BITS,
                };
                // SAFETY: as above (a layout 3 slot is 32 bytes).
                unsafe {
                    let p = self.map.ptr.add(at);
                    p.cast::<u64>().write(id.to_le());
                    p.add(8).cast::<u64>().write(w.to_le());
                    if check == Check::Words {
                        let c = row_check(id, bytes).to_le();
                        p.add(SLOT_ROW_CHECK_AT).cast::<u64>().write(c);
                    }
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
        let mut sum = [0u8; 4];
        let check = Check::of(self.layout);
        match check {
            Check::None => {}
            Check::Crc32 => sum[..4].copy_from_slice(&row_sum(id, bytes).to_le_bytes()),
            Check::Words => {}
        }
        let sum = &sum[..check.bytes()];
        // SAFETY: row r's bytes and check lie inside the mapping (r < rows, the stride holds
        // both); nothing else borrows them.
        unsafe {
            let p = self.map.ptr.add(at);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, self.row_bytes);
            std::ptr::copy_nonoverlapping(sum.as_ptr(), p.add(self.row_bytes), sum.len());
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
        h[8..12].copy_from_slice(&self.layout.to_le_bytes());
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
        let kinds = [Dtype::Float32, Dtype::Float16, Dtype::Int8]
            .into_iter()
            .flat_map(|d| (1..=FILE_VERSION).map(move |l| (d, l)));
        for (dtype, layout) in kinds {
            let path = dir.join(format!("{}-{layout}.rows", dtype.as_str()));
            let n = 1000u64;
            let mut w = Writer::create_layout(&path, want(n, dtype), layout).unwrap();
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

    /// A small float32 file of ids `id * 7919` for 0 <= id < n, at `path`, in `layout`.
    fn write_small(path: &Path, n: u64, layout: u32) -> Vec<f32> {
        let mut w = Writer::create_layout(path, want(n, Dtype::Float32), layout).unwrap();
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

    fn flip(path: &Path, at: usize, bit: usize) {
        let mut b = std::fs::read(path).unwrap();
        b[at] ^= 1 << bit;
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn every_bit_flip_in_a_row_or_its_slot_is_refused_naming_the_id() {
        for layout in [2, 3] {
            every_bit_flip_is_refused(layout);
        }
    }

    fn every_bit_flip_is_refused(layout: u32) {
        let dir = std::env::temp_dir().join(format!(
            "pstore-rowfile-flip-{}-{layout}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.rows");
        let n = 12u64;
        let rows = write_small(&path, n, layout);
        let pristine = std::fs::read(&path).unwrap();
        let ids: Vec<u64> = (0..n).map(|i| i * 7919).collect();
        let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
        let mut places = Vec::new();
        for (id, r) in f.entries().unwrap() {
            let slot = (0..=f.mask).find(|&i| f.slot(i).0 == id).unwrap();
            places.push((id, HEADER + slot * f.slot_bytes, f.rows_at + r * f.stride));
        }
        drop(f);
        let lookup = || {
            let f = RowFile::open(&path, want(n, Dtype::Float32)).unwrap();
            let mut out = vec![0.0; ids.len() * 5];
            let mut found = vec![false; ids.len()];
            f.gather(&ids, &mut out, &mut found).map(|()| (out, found))
        };
        for &(id, slot_at, row_at) in &places {
            // The slot's id, row index and check, and in layout 3 the row's check it holds
            // (its last 8 bytes are unused); the row's bytes and any check after them.
            let check = Check::of(layout);
            let slot_end = slot_at + SLOT + 8 * usize::from(check == Check::Words);
            let bytes = (slot_at..slot_end).chain(row_at..row_at + 20 + check.bytes());
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
        let empty_at = HEADER + empty * f.slot_bytes;
        drop(f);
        flip(&path, empty_at + 3, 5);
        let (out, found) = lookup().unwrap();
        assert!(found.iter().all(|&f| f));
        assert_eq!(out, rows);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A row of `n` bytes from a seed.
    fn bytes_of(n: usize, seed: u64) -> Vec<u8> {
        (0..n as u64).map(|i| mix64(seed ^ i) as u8).collect()
    }

    #[test]
    fn the_word_check_catches_every_flip_of_one_or_two_bits() {
        // The id (8 bytes), a row of 13 bytes (a zero-padded last word) and the stored check
        // (8 bytes), as one string of bits; every single and double flip is caught.
        let (id, row) = (0x0123_4567_89ab_cdefu64, bytes_of(13, 5));
        let mut all = id.to_le_bytes().to_vec();
        all.extend(&row);
        all.extend(row_check(id, &row).to_le_bytes());
        let caught = |b: &[u8]| {
            let id = u64::from_le_bytes(b[..8].try_into().unwrap());
            let stored = u64::from_le_bytes(b[21..].try_into().unwrap());
            row_check(id, &b[8..21]) != stored
        };
        assert!(!caught(&all));
        let bits = all.len() * 8;
        for x in 0..bits {
            let mut one = all.clone();
            one[x / 8] ^= 1 << (x % 8);
            assert!(caught(&one), "bit {x}");
            for y in x + 1..bits {
                let mut two = one.clone();
                two[y / 8] ^= 1 << (y % 8);
                assert!(caught(&two), "bits {x} and {y}");
            }
        }
        // Sign bits of two floats in a float32 row of dim 64 (a CRC-like sum modulo 2^32 would
        // miss these pairs): every pair caught.
        let row = bytes_of(256, 9);
        let want = row_check(7, &row);
        for i in 0..64 {
            for j in i + 1..64 {
                let mut two = row.clone();
                two[4 * i + 3] ^= 0x80;
                two[4 * j + 3] ^= 0x80;
                assert_ne!(row_check(7, &two), want, "words {i} and {j}");
            }
        }
        // No position's key is 1 (which would let a flip in the row cancel one in the check)
        // for rows of under 2^30 words.
        let inverse = (0..5).fold(KEY, |x, _| {
            x.wrapping_mul(2u32.wrapping_sub(KEY.wrapping_mul(x)))
        });
        assert_eq!(KEY.wrapping_mul(inverse), 1);
        assert!((inverse - 1) / 2 >= 1 << 30);
    }

    #[test]
    fn the_word_check_is_the_same_on_every_code_path() {
        // The dispatching function (AVX2 where the CPU has it) against the portable loop, and
        // against the definition written out with the keys computed one by one.
        for n in [0, 1, 3, 4, 20, 67, 68, 128, 256, 1000] {
            let row = bytes_of(n, n as u64);
            let id = mix64(n as u64);
            let mut padded = row.clone();
            padded.resize(n.div_ceil(4) * 4, 0);
            let words = [id as u32, (id >> 32) as u32].into_iter().chain(
                padded
                    .chunks(4)
                    .map(|w| u32::from_le_bytes(w.try_into().unwrap())),
            );
            let by_hand = words.enumerate().fold(0u64, |h, (i, w)| {
                let key = KEY.wrapping_mul(2 * i as u32 + 1);
                h.wrapping_add(u64::from(w) * u64::from(key))
            });
            assert_eq!(row_check(id, &row), by_hand, "{n} bytes");
            assert_eq!(word_sum(id, &row), by_hand, "{n} bytes");
        }
    }

    #[test]
    fn an_unknown_layout_is_not_written() {
        let path = std::env::temp_dir().join(format!("pstore-rowfile-l9-{}", std::process::id()));
        let e = match Writer::create_layout(&path, want(3, Dtype::Float32), FILE_VERSION + 1) {
            Ok(_) => panic!("layout {} written", FILE_VERSION + 1),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("layouts 1 to"), "{e}");
        assert!(!path.exists());
    }

    #[test]
    fn a_layout_1_file_still_reads() {
        let dir = std::env::temp_dir().join(format!("pstore-rowfile-v1-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.rows");
        // Written as layout 1 did: slots of (id, row + 1), rows at stride(row bytes), no sums.
        let (n, dim) = (40u64, 5usize);
        let st = stride(4 * dim);
        let (slots, rows_at, len) = file_layout(n, st, SLOT);
        let mut b = vec![0u8; len];
        for r in 0..n {
            let id = r * 31 + 5;
            let mut i = mix64(id) as usize & (slots as usize - 1);
            while u64_at(&b, HEADER + i * SLOT + 8) != 0 {
                i = (i + 1) & (slots as usize - 1);
            }
            b[HEADER + i * SLOT..][..8].copy_from_slice(&id.to_le_bytes());
            b[HEADER + i * SLOT + 8..][..8].copy_from_slice(&(r + 1).to_le_bytes());
            for j in 0..dim {
                let v = (id * 10 + j as u64) as f32;
                b[rows_at + r as usize * st + 4 * j..][..4].copy_from_slice(&v.to_le_bytes());
            }
        }
        let h = &mut b[..HEADER_CRC_AT + 4];
        h[..8].copy_from_slice(&MAGIC);
        for (at, v) in [(8, 1u32), (12, 0), (16, dim as u32), (20, st as u32)] {
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
