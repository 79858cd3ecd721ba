//! One shard of a sparse table: an id -> slot index and a chunked arena of rows, plus the grouping
//! of a batch by shard.
//!
//! Row layout, in 32-bit words: `[id_lo, id_hi, step, flags, version_lo, version_hi, updated_at,
//! freq | weights (dim) | state]`. Everything after the id (with `flags` zeroed) is what the LMDB
//! replica and snapshots store for a row. The id is kept in the row, so the index stores only a slot and 32 bits of the id's hash (8 bytes an entry)
//! and is rebuilt on growth from those bits alone (see `Index`). The optimizer state follows the weights, so a
//! push reads and writes one neighbourhood of memory.

use crate::buffer::Buffer;
use crate::hash::{mix64, shard_of_mix};

/// Words of row header before the weights.
pub const HEADER: usize = 8;
const STEP: usize = 2;
const FLAGS: usize = 3;
/// Header word of the row's version: the table's update sequence number at its last update (u64).
pub const VERSION: usize = 4;
/// Header word of the unix second of the row's last update.
pub const UPDATED_AT: usize = 6;
/// Header word counting how often the id was pushed (saturating).
pub const FREQ: usize = 7;
/// Words of a row after its id: the metadata the replica and snapshots keep, then the body.
pub const META: usize = HEADER - 2;
/// Flag: the row is in the shard's change list.
const MARKED: u32 = 1;
/// The flags word's bits above this hold the generation in which the row's change was last
/// logged for incremental snapshots (see [`Shard::take_changed`]).
const LOGGED_SHIFT: u32 = 8;
/// At most 2 MiB of rows a chunk (one huge page, see `buffer.rs`): chunks never move, and the
/// last one grows geometrically.
const CHUNK_WORDS: usize = 1 << 19;
/// A slot value meaning "no row".
pub const NO_SLOT: u32 = u32::MAX;
/// How far ahead the batched lookup prefetches (ids per pipeline stage).
const AHEAD: usize = 8;

/// The 32 bits of an id's hash that an index entry keeps: the low half of its [`mix64`], while
/// the shard comes from the high bits (so one shard's ids still spread over its whole index).
#[inline]
fn frag(id: u64) -> u32 {
    frag_of_mix(mix64(id))
}

/// [`frag`] of the id whose [`mix64`] is `mix` (a batch carries its ids' mixes).
#[inline]
fn frag_of_mix(mix: u64) -> u32 {
    mix as u32
}

/// Asks the CPU to start loading the cache line at `p`; a hint with no effect on memory.
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and never changes memory, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Starts loading every cache line of `s`.
#[inline]
pub fn prefetch_lines<T>(s: &[T]) {
    let bytes = std::mem::size_of_val(s);
    let base = s.as_ptr().cast::<u8>();
    let mut off = 0;
    while off < bytes {
        prefetch(base.wrapping_add(off));
        off += 64;
    }
}

/// The slot of the first entry of `table` (an [`Index`]'s) carrying fragment `f`, probing from
/// position `home` up to the first empty entry, or `NO_SLOT`.
#[inline(always)]
fn first_candidate(table: &[u64], home: usize, f: u32) -> u32 {
    let mask = table.len() - 1;
    let mut p = home;
    loop {
        let e = table[p];
        if e == 0 {
            return NO_SLOT;
        }
        if (e >> 32) as u32 == f {
            return (e as u32).wrapping_sub(1);
        }
        p = (p + 1) & mask;
    }
}

/// The chunk of `slot` and the word where its row starts there, for chunks of `chunk_rows` rows
/// of `stride` words (`chunk_magic` is `ceil(2^64 / chunk_rows)`, see [`Shard`]).
#[inline(always)]
fn chunk_offset(chunk_magic: u64, chunk_rows: usize, stride: usize, slot: u32) -> (usize, usize) {
    let c = ((chunk_magic as u128 * slot as u128) >> 64) as usize;
    (c, (slot as usize - c * chunk_rows) * stride)
}

/// An open-addressing index with linear probing: `id -> slot` in 8 bytes an entry.
///
/// An entry is `(frag << 32) | (slot + 1)`, 0 meaning empty. The id itself lives in the row, so an
/// entry's fragment only selects candidates, and a candidate is confirmed by the id in its row. An
/// entry's home position is derived from its fragment alone, so the table grows (at a load of 0.8)
/// without reading any row. Deletion shifts later entries back (no tombstones).
struct Index {
    table: Buffer<u64>,
    bits: u32,
    len: usize,
}

impl Index {
    fn new() -> Self {
        Self {
            table: Buffer::zeroed(16),
            bits: 4,
            len: 0,
        }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.table.len() - 1
    }

    #[inline]
    fn home(&self, frag: u32) -> usize {
        (frag >> (32 - self.bits)) as usize
    }

    /// The (position, slot) of every entry carrying fragment `f`, in probe order from the home
    /// position up to the first empty entry.
    #[inline]
    fn probe(&self, f: u32) -> impl Iterator<Item = (usize, u32)> + '_ {
        let mask = self.mask();
        let mut p = self.home(f);
        std::iter::from_fn(move || loop {
            let e = self.table[p];
            if e == 0 {
                return None;
            }
            let here = p;
            p = (p + 1) & mask;
            if (e >> 32) as u32 == f {
                return Some((here, (e as u32).wrapping_sub(1)));
            }
        })
    }

    /// The (position, slot) of the entry whose row `row_id` says holds `id`.
    #[inline]
    fn find(&self, id: u64, f: u32, row_id: impl Fn(u32) -> u64) -> Option<(usize, u32)> {
        self.probe(f).find(|&(_, slot)| row_id(slot) == id)
    }

    /// The first slot whose entry carries fragment `f`, or `NO_SLOT` (then no row has this id).
    #[inline]
    fn candidate(&self, f: u32) -> u32 {
        first_candidate(&self.table, self.home(f), f)
    }

    /// Adds an entry for an id known to be absent.
    fn insert(&mut self, f: u32, slot: u32) {
        if (self.len + 1) * 5 > self.table.len() * 4 {
            self.grow();
        }
        self.place(((f as u64) << 32) | (slot as u64 + 1));
        self.len += 1;
    }

    #[inline]
    fn place(&mut self, e: u64) {
        let mask = self.mask();
        let mut p = self.home((e >> 32) as u32);
        while self.table[p] != 0 {
            p = (p + 1) & mask;
        }
        self.table[p] = e;
    }

    /// Grows the table so that `n` entries fit without another growth.
    fn reserve(&mut self, n: usize) {
        while n * 5 > self.table.len() * 4 {
            self.grow();
        }
    }

    fn grow(&mut self) {
        assert!(self.bits < 32, "a shard index holds at most 2^31 rows");
        let old = std::mem::replace(&mut self.table, Buffer::zeroed(1 << (self.bits + 1)));
        self.bits += 1;
        for &e in old.iter().filter(|&&e| e != 0) {
            self.place(e);
        }
    }

    /// Empties position `p` and shifts the entries after it back where their probes allow.
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let e = self.table[j];
            if e == 0 {
                break;
            }
            let k = self.home((e >> 32) as u32);
            // The entry at j may move into the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < k && k <= j
            } else {
                hole < k || k <= j
            };
            if !stays {
                self.table[hole] = e;
                hole = j;
            }
        }
        self.table[hole] = 0;
        self.len -= 1;
    }

    fn bytes(&self) -> usize {
        self.table.bytes()
    }

    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.table
            .iter()
            .filter(|&&e| e != 0)
            .map(|&e| (e as u32).wrapping_sub(1))
    }
}

/// What a lookup across shards reads of one shard ([`Shard::for_each_found_across`]): its
/// index and row chunks, borrowed for as long as the shard is.
#[derive(Clone, Copy)]
pub struct View<'a> {
    index: &'a [u64],
    shift: u32,
    chunks: &'a [Buffer<u32>],
    chunk_magic: u64,
    chunk_rows: usize,
    stride: usize,
}

impl<'a> View<'a> {
    fn of(shard: &'a Shard) -> Self {
        Self {
            index: &shard.index.table,
            shift: 32 - shard.index.bits,
            chunks: &shard.chunks,
            chunk_magic: shard.chunk_magic,
            chunk_rows: shard.chunk_rows,
            stride: shard.stride,
        }
    }

    /// The index entry where the probe for fragment `f` starts.
    #[inline(always)]
    fn entry(&self, f: u32) -> *const u64 {
        // `f >> shift` is below 2^bits, the index's length.
        self.index[(f >> self.shift) as usize..].as_ptr()
    }

    /// The row of the first entry carrying fragment `f` (as [`Index::candidate`]), or `None`.
    #[inline(always)]
    fn candidate(&self, f: u32) -> Option<&'a [u32]> {
        let slot = first_candidate(self.index, (f >> self.shift) as usize, f);
        if slot == NO_SLOT {
            return None;
        }
        let (c, off) = chunk_offset(self.chunk_magic, self.chunk_rows, self.stride, slot);
        self.chunks.get(c)?.get(off..off + self.stride)
    }
}

/// Views 32-bit words as f32 values.
#[inline]
pub fn as_f32(words: &[u32]) -> &[f32] {
    // SAFETY: u32 and f32 have the same size and alignment, and every bit pattern is a valid value
    // of both; the lifetime and borrow of the slice are carried over unchanged.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<f32>(), words.len()) }
}

/// Views 32-bit words as f32 values, mutably.
#[inline]
pub fn as_f32_mut(words: &mut [u32]) -> &mut [f32] {
    // SAFETY: as in `as_f32`; the exclusive borrow is carried over, so no alias is created.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<f32>(), words.len()) }
}

/// A shard's rows.
pub struct Shard {
    stride: usize,
    /// Rows a full chunk holds: as many as fit in `CHUNK_WORDS`, so that a full chunk fills its
    /// huge pages instead of spilling a tail onto 4 KiB pages (a power of two of rows would leave
    /// up to half a huge page of rows on small pages).
    chunk_rows: usize,
    /// `ceil(2^64 / chunk_rows)`: a slot's chunk is `(slot * chunk_magic) >> 64`, exact for
    /// every 32-bit slot (Lemire, Kaser and Kurz 2019, "Faster remainder by direct computation").
    chunk_magic: u64,
    index: Index,
    /// Row storage; every chunk but the last is full (`chunk_rows` rows).
    chunks: Vec<Buffer<u32>>,
    free: Vec<u32>,
    next_slot: u32,
    /// Whether changes are recorded (in `changed` and `gone`) for a consumer: the flusher of a
    /// durable store, or the next incremental snapshot of an in-memory one.
    track: bool,
    /// Slots of the rows changed since the consumer last took them (each row once: `MARKED`; a
    /// slot freed meanwhile has its flags cleared, so a stale entry is skipped).
    changed: Vec<u32>,
    /// Ids removed since the consumer last took them.
    gone: std::collections::HashSet<u64>,
}

impl Shard {
    /// An empty shard for rows of `stride` words (header included).
    pub fn new(stride: usize) -> Self {
        // At least two rows, so that the magic number fits in 64 bits (rows are far smaller than
        // a chunk: a row holds at most 3 x 4096 floats and its header).
        let chunk_rows = (CHUNK_WORDS / stride).max(2);
        Self {
            stride,
            chunk_rows,
            chunk_magic: u64::MAX / chunk_rows as u64 + 1,
            index: Index::new(),
            chunks: Vec::new(),
            free: Vec::new(),
            next_slot: 0,
            track: false,
            changed: Vec::new(),
            gone: Default::default(),
        }
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.index.len
    }

    /// True when no row is stored.
    pub fn is_empty(&self) -> bool {
        self.index.len == 0
    }

    /// One past the highest slot handed out (every slot of a row is below it).
    pub fn slot_end(&self) -> u32 {
        self.next_slot
    }

    /// Bytes held: the arena's allocation, the index and the free list.
    pub fn bytes(&self) -> usize {
        let arena: usize = self.chunks.iter().map(|c| c.bytes()).sum();
        arena + self.index.bytes() + self.free.capacity() * 4 + self.chunks.capacity() * 24
    }

    /// Bytes of the arena and the index in ranges the kernel accepted `MADV_HUGEPAGE` for (a
    /// part of [`Shard::bytes`]): a shard's small beginnings and the tail of a growing last
    /// chunk stay on small pages.
    pub fn huge_page_bytes(&self) -> usize {
        let arena: usize = self.chunks.iter().map(|c| c.huge_page_bytes()).sum();
        arena + self.index.table.huge_page_bytes()
    }

    #[inline]
    fn locate(&self, slot: u32) -> (usize, usize) {
        chunk_offset(self.chunk_magic, self.chunk_rows, self.stride, slot)
    }

    /// The row words of `slot`.
    #[inline]
    pub fn row(&self, slot: u32) -> &[u32] {
        let (c, off) = self.locate(slot);
        &self.chunks[c][off..off + self.stride]
    }

    /// The row words of `slot`, mutably.
    #[inline]
    pub fn row_mut(&mut self, slot: u32) -> &mut [u32] {
        let (c, off) = self.locate(slot);
        &mut self.chunks[c][off..off + self.stride]
    }

    /// Starts loading the first `words` words of the row of `slot` into the cache.
    #[inline]
    pub fn prefetch_row(&self, slot: u32, words: usize) {
        let (c, off) = self.locate(slot);
        if let Some(chunk) = self.chunks.get(c) {
            let end = (off + words.min(self.stride)).min(chunk.len());
            let mut w = off;
            while w < end {
                prefetch(chunk[w..].as_ptr());
                w += 16;
            }
        }
    }

    /// The id stored in the row of `slot` (`u64::MAX ^ slot` for a slot past the arena, which no
    /// candidate can be).
    #[inline]
    fn id_at(&self, slot: u32) -> u64 {
        let (c, off) = self.locate(slot);
        match self.chunks.get(c).and_then(|ch| ch.get(off..off + 2)) {
            Some(r) => r[0] as u64 | ((r[1] as u64) << 32),
            None => u64::MAX ^ slot as u64,
        }
    }

    /// The slot of `id`, if it has a row.
    #[inline]
    pub fn find(&self, id: u64) -> Option<u32> {
        self.index
            .find(id, frag(id), |s| self.id_at(s))
            .map(|(_, slot)| slot)
    }

    /// The slots of `ids[p]` for every position `p` of `positions`, in order, `NO_SLOT` where
    /// there is no row (see [`Shard::for_each_found`]).
    pub fn find_many(&self, ids: &[u64], part: Part<'_>, row_words: usize, out: &mut Vec<u32>) {
        out.clear();
        out.reserve(part.positions.len());
        self.for_each_found(ids, part, row_words, |_, slot| out.push(slot));
    }

    /// Calls `f(k, slot)` for every `k` in order, with the slot of `ids[part.positions[k]]` or
    /// `NO_SLOT` where there is no row.
    ///
    /// Lookups are pipelined: the index line of an id is prefetched `AHEAD` ids before it is
    /// probed, and the candidate row (its header and the next `row_words` words, which `f` reads)
    /// `AHEAD` ids before it is confirmed and handed to `f`, so many cache misses are in flight
    /// at once and `f` finds the row in cache.
    #[inline]
    pub fn for_each_found(
        &self,
        ids: &[u64],
        part: Part<'_>,
        row_words: usize,
        mut f: impl FnMut(usize, u32),
    ) {
        const RING: usize = 2 * AHEAD;
        let (positions, mixes) = (part.positions, part.mixes);
        let n = positions.len();
        let mut cands = [NO_SLOT; RING];
        for i in 0..n + 2 * AHEAD {
            if i < n {
                prefetch(&self.index.table[self.index.home(frag_of_mix(mixes[i]))]);
            }
            if i >= AHEAD && i - AHEAD < n {
                let j = i - AHEAD;
                let c = self.index.candidate(frag_of_mix(mixes[j]));
                cands[j % RING] = c;
                if c != NO_SLOT {
                    // The candidate is almost always the row: load what `f` will read.
                    self.prefetch_row(c, HEADER + row_words);
                }
                // The batch's ids are read in shard order, not in memory order: load ahead.
                prefetch(&ids[positions[j] as usize]);
            }
            if i >= 2 * AHEAD {
                let k = i - 2 * AHEAD;
                let id = ids[positions[k] as usize];
                let c = cands[k % RING];
                let slot = if c == NO_SLOT {
                    NO_SLOT
                } else if self.id_at(c) == id {
                    c
                } else {
                    // Two ids share the 32-bit fragment: probe past the first candidate.
                    self.find(id).unwrap_or(NO_SLOT)
                };
                f(k, slot);
            }
        }
    }

    /// Calls `f(k, row)` for every `k` in order, with the words of the row of `ids[k]` (its
    /// shard among `shards`, a table's shards, all of them, in order), or `None` where it has
    /// no row.
    ///
    /// The batch is read in its own order, with no grouping by shard: the pipeline of
    /// [`Shard::for_each_found`] (index line `AHEAD` ids before the probe, the row `AHEAD` ids
    /// before `f`, here its lines from `HEADER + row_words` words) runs over the whole batch,
    /// whichever shard each id falls in, so it never drains at a shard's boundary, and `f` is
    /// called at consecutive positions. Each shard's fields are read once per call into a
    /// [`View`], and a row is located once (its address travels down the pipeline): a pull
    /// from the cache spends its time in the copy, not in bookkeeping.
    #[inline(always)]
    pub fn for_each_found_across<'a>(
        shards: &[&'a Shard],
        ids: &[u64],
        row_words: usize,
        mut f: impl FnMut(usize, Option<&'a [u32]>),
    ) {
        // Entries live 2 * AHEAD steps; a ring of twice that is never overwritten while read.
        const RING: usize = 4 * AHEAD;
        let views: Vec<View<'a>> = shards.iter().map(|s| View::of(s)).collect();
        let n = ids.len();
        let reach = (HEADER + row_words) * 4;
        let mut mixes = [0u64; RING];
        let mut at = [0usize; RING];
        let mut rows: [Option<&'a [u32]>; RING] = [None; RING];
        for i in 0..n + 2 * AHEAD {
            if i < n {
                let m = mix64(ids[i]);
                let s = shard_of_mix(m, views.len());
                prefetch(views[s].entry(frag_of_mix(m)));
                (mixes[i % RING], at[i % RING]) = (m, s);
            }
            if i >= AHEAD && i - AHEAD < n {
                let j = (i - AHEAD) % RING;
                let row = views[at[j]].candidate(frag_of_mix(mixes[j]));
                if let Some(r) = row {
                    // The candidate is almost always the row: load the lines `f` will read.
                    let start = r.as_ptr() as usize;
                    let mut line = start & !63;
                    while line < start + reach {
                        prefetch(line as *const u8);
                        line += 64;
                    }
                }
                rows[j] = row;
            }
            if i >= 2 * AHEAD {
                let k = i - 2 * AHEAD;
                let id = ids[k];
                let row = match rows[k % RING] {
                    Some(r) if r[0] as u64 | ((r[1] as u64) << 32) == id => Some(r),
                    None => None,
                    // Two ids share the 32-bit fragment: probe past the first candidate.
                    Some(_) => {
                        let shard = shards[at[k % RING]];
                        shard.find(id).map(|slot| shard.row(slot))
                    }
                };
                f(k, row);
            }
        }
    }

    /// The slot of `id`, and whether it was created now. A new row gets its header, and its body
    /// (weights and state) is written by `init`.
    #[inline]
    pub fn find_or_insert(&mut self, id: u64, init: impl FnOnce(&mut [u32])) -> (u32, bool) {
        if let Some(slot) = self.find(id) {
            return (slot, false);
        }
        (self.insert_absent(id, init), true)
    }

    /// Adds a row for `id`, which the caller knows has none; its body is written by `init`.
    #[inline]
    pub fn insert_absent(&mut self, id: u64, init: impl FnOnce(&mut [u32])) -> u32 {
        let slot = self.alloc_slot();
        let row = self.row_mut(slot);
        row[0] = id as u32;
        row[1] = (id >> 32) as u32;
        row[2..HEADER].fill(0);
        init(&mut row[HEADER..]);
        self.index.insert(frag(id), slot);
        slot
    }

    /// Removes the row of `id`; true if there was one.
    pub fn remove(&mut self, id: u64) -> bool {
        match self.index.find(id, frag(id), |s| self.id_at(s)) {
            Some((pos, slot)) => {
                self.index.remove_at(pos);
                self.free.push(slot);
                // A stale entry of the change list must not take the freed row.
                self.row_mut(slot)[FLAGS] = 0;
                if self.track {
                    self.gone.insert(id);
                }
                true
            }
            None => false,
        }
    }

    fn alloc_slot(&mut self) -> u32 {
        if let Some(slot) = self.free.pop() {
            return slot;
        }
        let slot = self.next_slot;
        let full = self.chunk_rows * self.stride;
        let (c, end) = self.locate(slot);
        let end = end + self.stride;
        if c == self.chunks.len() {
            self.chunks
                .push(Buffer::zeroed((self.stride * 16).min(full)));
        }
        let chunk = &mut self.chunks[c];
        if end > chunk.len() {
            // Only the last chunk grows, geometrically, up to its full size; a full-size chunk is
            // allocated once and never moves.
            let mut grown = Buffer::zeroed((chunk.len() * 2).max(end).min(full));
            grown[..chunk.len()].copy_from_slice(chunk);
            *chunk = grown;
        }
        self.next_slot = slot
            .checked_add(1)
            .filter(|&n| n != NO_SLOT)
            .expect("a shard holds fewer than 2^32 - 1 rows");
        slot
    }

    /// Makes room for `n` rows in the index (a bulk load sized in advance).
    pub fn reserve(&mut self, n: usize) {
        self.index.reserve(n);
    }

    /// Starts or stops recording changes; stopping forgets what was recorded.
    pub fn set_tracking(&mut self, on: bool) {
        self.track = on;
        if !on {
            for slot in std::mem::take(&mut self.changed) {
                self.row_mut(slot)[FLAGS] &= !MARKED;
            }
            self.gone.clear();
        }
    }

    /// Records that the row of `slot` changed (when tracking).
    #[inline]
    pub fn mark(&mut self, slot: u32) {
        if !self.track {
            return;
        }
        let row = self.row_mut(slot);
        if row[FLAGS] & MARKED == 0 {
            row[FLAGS] |= MARKED;
            self.changed.push(slot);
        }
    }

    /// Marks the row of `slot` changed again after a flush took it and did not commit. If that
    /// take logged the row's change (`logged`: its first in the generation), forgets that, since
    /// the log entry was not committed either; an entry an earlier cycle committed stays noted.
    pub fn remark(&mut self, slot: u32, logged: bool) {
        if logged {
            self.row_mut(slot)[FLAGS] &= (1 << LOGGED_SHIFT) - 1;
        }
        self.mark(slot);
    }

    /// Records an update of the row of `slot`: its version, time and `hits` more pushes.
    #[inline]
    pub fn touch(&mut self, slot: u32, version: u64, now: u32, hits: u32) {
        let row = self.row_mut(slot);
        // Concurrent pushes take their versions before they reach the shard, so a later one may
        // carry the smaller number: a row's version and time only move forward.
        if version > row_version(row) {
            row[VERSION] = version as u32;
            row[VERSION + 1] = (version >> 32) as u32;
        }
        row[UPDATED_AT] = row[UPDATED_AT].max(now);
        row[FREQ] = row[FREQ].saturating_add(hits);
        self.mark(slot);
    }

    /// Hands every changed row to `f` and clears the change list: its id, its words after the id
    /// (with the `flags` word as stored: the caller zeroes it in its copy), and whether its change
    /// is the first since generation `gen` began (then the row is noted as logged in `gen`).
    /// Rows are prefetched a few entries ahead.
    pub fn take_changed(&mut self, gen: u32, mut f: impl FnMut(u64, &[u32], bool)) {
        let changed = std::mem::take(&mut self.changed);
        let gen = gen & (u32::MAX >> LOGGED_SHIFT);
        let words = self.stride;
        for (k, &slot) in changed.iter().enumerate() {
            if let Some(&ahead) = changed.get(k + 8) {
                self.prefetch_row(ahead, words);
            }
            let row = self.row_mut(slot);
            let flags = row[FLAGS];
            if flags & MARKED != 0 {
                let first = flags >> LOGGED_SHIFT != gen;
                row[FLAGS] = (flags & !MARKED & ((1 << LOGGED_SHIFT) - 1)) | (gen << LOGGED_SHIFT);
                let id = row[0] as u64 | ((row[1] as u64) << 32);
                f(id, &row[2..], first);
            }
        }
        // Keep the allocation for the next round.
        self.changed = changed;
        self.changed.clear();
    }

    /// Clears the change list and returns the ids of its marked rows (a `sync` store going back
    /// to its last commit: these are the rows changed since).
    pub fn take_marked(&mut self) -> Vec<u64> {
        let changed = std::mem::take(&mut self.changed);
        let mut ids = Vec::with_capacity(changed.len());
        for &slot in &changed {
            let row = self.row_mut(slot);
            if row[FLAGS] & MARKED != 0 {
                row[FLAGS] &= !MARKED;
                ids.push(row[0] as u64 | ((row[1] as u64) << 32));
            }
        }
        self.changed = changed;
        self.changed.clear();
        ids
    }

    /// Drops the row of `id` from memory without recording a removal (a row created since the
    /// last commit, when going back to it); true if there was one.
    pub fn discard(&mut self, id: u64) -> bool {
        let track = std::mem::replace(&mut self.track, false);
        let had = self.remove(id);
        self.track = track;
        had
    }

    /// The words after the id of the row at `slot` (as [`Shard::take_changed`] hands them out)
    /// when they are what the last committed flush cycle wrote to the replica: in a durable
    /// store every change of a row marks it (a push, a pull that creates it, a restore) and only
    /// a cycle's take unmarks it, so an unmarked row, taken while no cycle runs, is the row the
    /// last cycle wrote or loaded, unless it is a new row of an id removed since (`id` is
    /// still in the removed set then).
    pub fn settled(&self, slot: u32, id: u64) -> Option<&[u32]> {
        let row = self.row(slot);
        (row[FLAGS] & MARKED == 0 && !self.is_gone(id)).then(|| &row[2..])
    }

    /// Rows in the change list (an upper bound of what [`Shard::take_changed`] hands out).
    pub fn changed_len(&self) -> usize {
        self.changed.len()
    }

    /// The ids removed since [`Shard::forget_gone`] last dropped them.
    pub fn gone(&self) -> Vec<u64> {
        self.gone.iter().copied().collect()
    }

    /// True when `id` was removed and not yet forgotten.
    #[inline]
    pub fn is_gone(&self, id: u64) -> bool {
        !self.gone.is_empty() && self.gone.contains(&id)
    }

    /// Drops `ids` from the removed set (their removal has been consumed).
    pub fn forget_gone(&mut self, ids: &[u64]) {
        for id in ids {
            self.gone.remove(id);
        }
    }

    /// Stores a row given as its words after the id (metadata and body, as
    /// [`Shard::take_changed`] hands them out), replacing any row of `id`; the flags stay. Returns
    /// the slot and whether the row is new.
    pub fn put_words(&mut self, id: u64, words: &[u32]) -> (u32, bool) {
        let slot = self.find(id).unwrap_or(NO_SLOT);
        self.put_words_at(id, slot, words)
    }

    /// Stores a row's words (as in [`Shard::put_words`]) at the slot of `id`, or in a new row
    /// when `slot` is `NO_SLOT` (the caller found no row of `id`).
    pub fn put_words_at(&mut self, id: u64, slot: u32, words: &[u32]) -> (u32, bool) {
        let (slot, new) = if slot == NO_SLOT {
            (self.insert_absent(id, |_| {}), true)
        } else {
            (slot, false)
        };
        let row = self.row_mut(slot);
        let flags = row[FLAGS];
        row[2..].copy_from_slice(words);
        row[FLAGS] = flags;
        if !self.gone.is_empty() {
            self.gone.remove(&id);
        }
        (slot, new)
    }

    /// Every stored (id, slot), in slot order: the order of the rows in memory.
    pub fn iter_by_slot(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        let mut slots: Vec<u32> = self.index.slots().collect();
        slots.sort_unstable();
        slots.into_iter().map(move |slot| (self.id_at(slot), slot))
    }

    /// Every stored (id, slot), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.index.slots().map(move |slot| (self.id_at(slot), slot))
    }
}

/// The version (update sequence number) of a row.
#[inline]
pub fn row_version(row: &[u32]) -> u64 {
    row[VERSION] as u64 | ((row[VERSION + 1] as u64) << 32)
}

/// Reads and bumps the per-row step count (used for Adam's bias correction).
#[inline]
pub fn bump_step(row: &mut [u32]) -> u32 {
    row[STEP] = row[STEP].saturating_add(1);
    row[STEP]
}

/// A batch grouped by shard: `positions[offsets[s]..offsets[s + 1]]` are the positions (in the
/// caller's arrays) of the ids that live in shard `s`, in increasing order, and `mixes` holds the
/// [`mix64`] of the id at each of those positions (the shard and the index hash both come from
/// it, so an id is hashed once per batch).
pub struct Grouped {
    /// Positions in the caller's arrays, shard after shard.
    pub positions: Vec<u32>,
    /// The `mix64` of the id at each position.
    pub mixes: Vec<u64>,
    /// Where each shard's positions start (one more entry than shards).
    pub offsets: Vec<usize>,
}

/// One shard's share of a [`Grouped`] batch.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    /// Positions in the caller's arrays of the shard's ids.
    pub positions: &'a [u32],
    /// The `mix64` of the id at each position.
    pub mixes: &'a [u64],
}

impl Grouped {
    /// Groups `ids` over `num_shards` shards with one counting sort.
    pub fn new(ids: &[u64], num_shards: usize) -> Self {
        let mixes: Vec<u64> = ids.iter().map(|&id| mix64(id)).collect();
        let mut offsets = vec![0usize; num_shards + 1];
        for &m in &mixes {
            offsets[shard_of_mix(m, num_shards) + 1] += 1;
        }
        for s in 0..num_shards {
            offsets[s + 1] += offsets[s];
        }
        let mut next = offsets.clone();
        let mut positions = vec![0u32; ids.len()];
        let mut grouped = vec![0u64; ids.len()];
        for (pos, &m) in mixes.iter().enumerate() {
            let n = &mut next[shard_of_mix(m, num_shards)];
            positions[*n] = pos as u32;
            grouped[*n] = m;
            *n += 1;
        }
        Self {
            positions,
            mixes: grouped,
            offsets,
        }
    }

    /// The positions of shard `s`.
    #[inline]
    pub fn of(&self, s: usize) -> &[u32] {
        &self.positions[self.offsets[s]..self.offsets[s + 1]]
    }

    /// Shard `s`'s positions and their ids' mixes.
    #[inline]
    pub fn part(&self, s: usize) -> Part<'_> {
        let r = self.offsets[s]..self.offsets[s + 1];
        Part {
            positions: &self.positions[r.clone()],
            mixes: &self.mixes[r],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn insert_find_remove_against_a_hashmap() {
        let mut shard = Shard::new(HEADER + 3);
        let mut model: HashMap<u64, f32> = HashMap::new();
        let mut x = 12345u64;
        for step in 0..200_000u32 {
            x = crate::hash::mix64(x);
            let id = x % 5_000 + (x >> 60 << 60);
            match step % 5 {
                0..=2 => {
                    let v = step as f32;
                    let (slot, created) = shard.find_or_insert(id, |body| {
                        as_f32_mut(body).fill(v);
                    });
                    assert_eq!(created, !model.contains_key(&id));
                    let got = as_f32(&shard.row(slot)[HEADER..])[0];
                    assert_eq!(got, *model.entry(id).or_insert(v));
                }
                3 => assert_eq!(shard.remove(id), model.remove(&id).is_some()),
                _ => {
                    assert_eq!(shard.find(id).is_some(), model.contains_key(&id));
                    let ids: Vec<u64> = (0..64).map(|k| (id + k * 31) % 5_000).collect();
                    let pos: Vec<u32> = (0..64).rev().collect();
                    let mixes: Vec<u64> = pos.iter().map(|&p| mix64(ids[p as usize])).collect();
                    let part = Part {
                        positions: &pos,
                        mixes: &mixes,
                    };
                    let mut slots = Vec::new();
                    shard.find_many(&ids, part, 1, &mut slots);
                    for (&p, &slot) in pos.iter().zip(&slots) {
                        assert_eq!(slot, shard.find(ids[p as usize]).unwrap_or(NO_SLOT));
                    }
                }
            }
            assert_eq!(shard.len(), model.len());
        }
        let mut seen: Vec<u64> = shard.iter().map(|(id, _)| id).collect();
        seen.sort_unstable();
        let mut want: Vec<u64> = model.keys().copied().collect();
        want.sort_unstable();
        assert_eq!(seen, want);
    }

    #[test]
    fn index_handles_shared_fragments_wraparound_and_removal() {
        // Ids whose "row" is the slot itself, with fragments forced to collide and to sit at the
        // end of the table so probes wrap around.
        let row_id = |s: u32| s as u64 * 10;
        let mut ix = Index::new();
        let frags = [u32::MAX, u32::MAX, u32::MAX - 1, 0, u32::MAX, 0, 7 << 28];
        for (slot, &f) in frags.iter().enumerate() {
            ix.insert(f, slot as u32);
        }
        for (slot, &f) in frags.iter().enumerate() {
            let (_, s) = ix.find(slot as u64 * 10, f, row_id).unwrap();
            assert_eq!(s, slot as u32);
        }
        let mut removed = Vec::new();
        for victim in [1usize, 3, 0] {
            let (p, _) = ix.find(victim as u64 * 10, frags[victim], row_id).unwrap();
            ix.remove_at(p);
            removed.push(victim);
            for (slot, &f) in frags.iter().enumerate() {
                let found = ix.find(slot as u64 * 10, f, row_id).is_some();
                assert_eq!(found, !removed.contains(&slot), "slot {slot}");
            }
        }
        assert_eq!(ix.len, frags.len() - 3);
        for i in 0..10_000u32 {
            ix.insert(i.wrapping_mul(0x9e37_79b9), 100 + i);
        }
        assert_eq!(ix.slots().count(), frags.len() - 3 + 10_000);
        assert!(ix.table.len() * 4 >= ix.len * 5);
    }

    #[test]
    fn chunks_never_move_rows_and_stay_small() {
        let stride = HEADER + 64;
        let mut shard = Shard::new(stride);
        for id in 0..100_000u64 {
            shard.find_or_insert(id, |b| b.fill(id as u32));
        }
        for id in (0..100_000u64).step_by(997) {
            let slot = shard.find(id).unwrap();
            assert!(shard.row(slot)[HEADER..].iter().all(|&w| w == id as u32));
        }
        let raw = 100_000 * stride * 4;
        assert!(shard.bytes() < raw * 13 / 10, "{} vs {raw}", shard.bytes());
    }

    #[test]
    fn a_slot_locates_by_exact_division_and_full_chunks_fill_whole_huge_pages() {
        for dim in [1, 3, 16, 64, 100, 128, 4096, 3 * 4096] {
            let stride = HEADER + dim;
            let shard = Shard::new(stride);
            let rows = shard.chunk_rows;
            assert!(rows * stride <= CHUNK_WORDS || rows == 2);
            assert!(
                (rows + 1) * stride > CHUNK_WORDS,
                "dim {dim}: room for another row"
            );
            // A full chunk is padded to a whole huge page: none of its rows is on a small page.
            let full = Buffer::<u32>::zeroed(rows * stride);
            assert_eq!(full.bytes(), CHUNK_WORDS * 4, "dim {dim}");
            let slots = (0..100_000u32)
                .chain((0..100_000u32).map(|k| u32::MAX - 1 - k))
                .chain((1..64u32).map(|k| k * rows as u32 - 1))
                .chain((1..64u32).map(|k| k * rows as u32));
            for slot in slots {
                let want = (slot as usize / rows, slot as usize % rows * stride);
                assert_eq!(shard.locate(slot), want, "dim {dim}, slot {slot}");
            }
        }
    }

    #[test]
    fn grouping_is_a_stable_partition() {
        let ids: Vec<u64> = (0..10_000u64).map(|i| i * 7919 % 3001).collect();
        let g = Grouped::new(&ids, 7);
        let mut all: Vec<u32> = g.positions.clone();
        all.sort_unstable();
        assert_eq!(all, (0..10_000u32).collect::<Vec<_>>());
        for s in 0..7 {
            let p = g.of(s);
            assert!(p.windows(2).all(|w| w[0] < w[1]));
            assert!(p
                .iter()
                .all(|&i| crate::hash::shard_of(ids[i as usize], 7) == s));
            let part = g.part(s);
            assert!(part
                .positions
                .iter()
                .zip(part.mixes)
                .all(|(&i, &m)| m == mix64(ids[i as usize])));
        }
    }
}
