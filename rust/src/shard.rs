//! One shard of a sparse table: an id -> slot index and a chunked arena of rows, plus the grouping
//! of a batch by shard.
//!
//! Row layout, in 32-bit words: `[id_lo, id_hi, step, reserved | weights (dim) | state]`. The id is
//! kept in the row, so the index stores only a slot and 32 bits of the id's hash (8 bytes an entry)
//! and is rebuilt on growth from those bits alone. The optimizer state follows the weights, so a
//! push reads and writes one neighbourhood of memory.

use hashbrown::HashTable;

use crate::hash::{index_hash, shard_of};

/// Words of row header before the weights.
pub const HEADER: usize = 4;
const STEP: usize = 2;
/// About 4 MiB of rows a chunk: chunks never move, and the last one grows geometrically.
const CHUNK_WORDS: usize = 1 << 20;

#[inline]
fn entry(slot: u32, hash: u64) -> u64 {
    ((hash >> 32) << 32) | slot as u64
}

#[inline]
fn entry_slot(e: u64) -> u32 {
    e as u32
}

/// The 64-bit hash hashbrown sees, rebuilt from the 32 bits an entry keeps.
#[inline]
fn entry_hash(e: u64) -> u64 {
    let hi = e >> 32;
    (hi << 32) | (hi.wrapping_mul(0x9e37_79b9) & 0xffff_ffff)
}

#[inline]
fn full_hash(id: u64) -> u64 {
    entry_hash(entry(0, index_hash(id)))
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
    chunk_shift: u32,
    index: HashTable<u64>,
    chunks: Vec<Vec<u32>>,
    free: Vec<u32>,
    next_slot: u32,
}

impl Shard {
    /// An empty shard for rows of `stride` words (header included).
    pub fn new(stride: usize) -> Self {
        let rows_per_chunk = (CHUNK_WORDS / stride).max(1);
        // Largest power of two not above rows_per_chunk.
        let chunk_shift = usize::BITS - 1 - rows_per_chunk.leading_zeros();
        Self {
            stride,
            chunk_shift,
            index: HashTable::new(),
            chunks: Vec::new(),
            free: Vec::new(),
            next_slot: 0,
        }
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no row is stored.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes held: the arena's allocation, the index and the free list.
    pub fn bytes(&self) -> usize {
        let arena: usize = self.chunks.iter().map(|c| c.capacity() * 4).sum();
        let index = self.index.capacity() * 9 + 16;
        arena + index + self.free.capacity() * 4 + self.chunks.capacity() * 24
    }

    #[inline]
    fn locate(&self, slot: u32) -> (usize, usize) {
        let slot = slot as usize;
        let mask = (1usize << self.chunk_shift) - 1;
        (slot >> self.chunk_shift, (slot & mask) * self.stride)
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

    #[inline]
    fn id_of(chunks: &[Vec<u32>], shift: u32, stride: usize, slot: u32) -> u64 {
        let slot = slot as usize;
        let off = (slot & ((1usize << shift) - 1)) * stride;
        let row = &chunks[slot >> shift][off..off + 2];
        row[0] as u64 | ((row[1] as u64) << 32)
    }

    /// The slot of `id`, if it has a row.
    #[inline]
    pub fn find(&self, id: u64) -> Option<u32> {
        let h = full_hash(id);
        let (chunks, shift, stride) = (&self.chunks, self.chunk_shift, self.stride);
        self.index
            .find(h, |&e| {
                entry_hash(e) == h && Self::id_of(chunks, shift, stride, entry_slot(e)) == id
            })
            .map(|&e| entry_slot(e))
    }

    /// The slot of `id`, and whether it was created now. A new row gets its header, and its body
    /// (weights and state) is written by `init`.
    #[inline]
    pub fn find_or_insert(&mut self, id: u64, init: impl FnOnce(&mut [u32])) -> (u32, bool) {
        if let Some(slot) = self.find(id) {
            return (slot, false);
        }
        let slot = self.alloc_slot();
        let row = self.row_mut(slot);
        row[0] = id as u32;
        row[1] = (id >> 32) as u32;
        row[STEP] = 0;
        row[3] = 0;
        init(&mut row[HEADER..]);
        let h = full_hash(id);
        self.index
            .insert_unique(h, entry(slot, h), |&e| entry_hash(e));
        (slot, true)
    }

    /// Removes the row of `id`; true if there was one.
    pub fn remove(&mut self, id: u64) -> bool {
        let h = full_hash(id);
        let (chunks, shift, stride) = (&self.chunks, self.chunk_shift, self.stride);
        match self.index.find_entry(h, |&e| {
            entry_hash(e) == h && Self::id_of(chunks, shift, stride, entry_slot(e)) == id
        }) {
            Ok(occupied) => {
                let (e, _) = occupied.remove();
                self.free.push(entry_slot(e));
                true
            }
            Err(_) => false,
        }
    }

    fn alloc_slot(&mut self) -> u32 {
        if let Some(slot) = self.free.pop() {
            return slot;
        }
        let slot = self.next_slot;
        let chunk_rows = 1usize << self.chunk_shift;
        let c = slot as usize >> self.chunk_shift;
        if c == self.chunks.len() {
            self.chunks.push(Vec::new());
        }
        let stride = self.stride;
        let chunk = &mut self.chunks[c];
        if chunk.len() == chunk.capacity() {
            let full = chunk_rows * stride;
            let want = (chunk.capacity() * 2).max(stride * 16).min(full);
            chunk.reserve_exact(want - chunk.len());
        }
        chunk.resize(chunk.len() + stride, 0);
        self.next_slot = slot
            .checked_add(1)
            .expect("a shard holds at most 2^32 rows");
        slot
    }

    /// Every stored (id, slot), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.index.iter().map(move |&e| {
            let slot = entry_slot(e);
            (
                Self::id_of(&self.chunks, self.chunk_shift, self.stride, slot),
                slot,
            )
        })
    }
}

/// Reads and bumps the per-row step count (used for Adam's bias correction).
#[inline]
pub fn bump_step(row: &mut [u32]) -> u32 {
    row[STEP] = row[STEP].saturating_add(1);
    row[STEP]
}

/// A batch grouped by shard: `positions[offsets[s]..offsets[s + 1]]` are the positions (in the
/// caller's arrays) of the ids that live in shard `s`, in increasing order.
pub struct Grouped {
    pub positions: Vec<u32>,
    pub offsets: Vec<usize>,
}

impl Grouped {
    /// Groups `ids` over `num_shards` shards with one counting sort.
    pub fn new(ids: &[u64], num_shards: usize) -> Self {
        let shards: Vec<u32> = ids
            .iter()
            .map(|&id| shard_of(id, num_shards) as u32)
            .collect();
        let mut offsets = vec![0usize; num_shards + 1];
        for &s in &shards {
            offsets[s as usize + 1] += 1;
        }
        for s in 0..num_shards {
            offsets[s + 1] += offsets[s];
        }
        let mut next = offsets.clone();
        let mut positions = vec![0u32; ids.len()];
        for (pos, &s) in shards.iter().enumerate() {
            let n = &mut next[s as usize];
            positions[*n] = pos as u32;
            *n += 1;
        }
        Self { positions, offsets }
    }

    /// The positions of shard `s`.
    #[inline]
    pub fn of(&self, s: usize) -> &[u32] {
        &self.positions[self.offsets[s]..self.offsets[s + 1]]
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
                _ => assert_eq!(shard.find(id).is_some(), model.contains_key(&id)),
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
    fn grouping_is_a_stable_partition() {
        let ids: Vec<u64> = (0..10_000u64).map(|i| i * 7919 % 3001).collect();
        let g = Grouped::new(&ids, 7);
        let mut all: Vec<u32> = g.positions.clone();
        all.sort_unstable();
        assert_eq!(all, (0..10_000u32).collect::<Vec<_>>());
        for s in 0..7 {
            let p = g.of(s);
            assert!(p.windows(2).all(|w| w[0] < w[1]));
            assert!(p.iter().all(|&i| shard_of(ids[i as usize], 7) == s));
        }
    }
}
