//! Batch helpers for training loops that look rows up by id: the unique ids of a batch with each
//! position's index among them, and the per-position gradients of a gather summed back into
//! per-unique rows (what a framework's `index_select` backward does, without its per-row
//! dispatch). `pstore.torch.Embedding` uses both.

use crate::error::{shape, Result};
use crate::hash::mix64;

/// The distinct ids of `ids` in order of first appearance; `inverse[i]` is set to the index of
/// `ids[i]` among them.
pub fn unique_inverse(ids: &[u64], inverse: &mut [i64]) -> Result<Vec<u64>> {
    if inverse.len() != ids.len() {
        return Err(shape(format!(
            "inverse holds {} values for {} ids",
            inverse.len(),
            ids.len()
        )));
    }
    if ids.len() >= u32::MAX as usize {
        return Err(shape(format!(
            "{} ids in one call; at most {} are supported",
            ids.len(),
            u32::MAX - 1
        )));
    }
    // Open addressing with linear probing, at most half full: a slot holds its unique index + 1,
    // 0 meaning empty.
    let cap = (ids.len() * 2).next_power_of_two().max(16);
    let mask = cap - 1;
    let mut slots = vec![0u32; cap];
    let mut unique = Vec::new();
    for (&id, inv) in ids.iter().zip(inverse.iter_mut()) {
        let mut at = mix64(id) as usize & mask;
        let k = loop {
            let s = slots[at];
            if s == 0 {
                unique.push(id);
                slots[at] = unique.len() as u32;
                break unique.len() - 1;
            }
            if unique[s as usize - 1] == id {
                break s as usize - 1;
            }
            at = (at + 1) & mask;
        };
        *inv = k as i64;
    }
    Ok(unique)
}

/// Sums the rows of `src` (`index.len()` rows of `dim` floats) into `rows` rows: row `index[i]`
/// of the result gets row `i` of `src` added. Every index must be in `0..rows`.
pub fn sum_rows(src: &[f32], index: &[i64], dim: usize, rows: usize) -> Result<Vec<f32>> {
    if src.len() != index.len() * dim {
        return Err(shape(format!(
            "{} gradient values for {} positions of dim {dim}",
            src.len(),
            index.len()
        )));
    }
    if let Some(&bad) = index.iter().find(|&&i| i < 0 || i as u64 >= rows as u64) {
        return Err(shape(format!("index {bad} is outside 0..{rows}")));
    }
    let len = rows
        .checked_mul(dim)
        .ok_or_else(|| shape(format!("{rows} rows of dim {dim} do not fit in memory")))?;
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| {
        shape(format!(
            "{rows} rows of dim {dim} ({len} floats) cannot be allocated"
        ))
    })?;
    out.resize(len, 0f32);
    for (&i, g) in index.iter().zip(src.chunks_exact(dim.max(1))) {
        let dst = &mut out[i as usize * dim..(i as usize + 1) * dim];
        for (d, s) in dst.iter_mut().zip(g) {
            *d += *s;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    #[test]
    fn unique_inverse_matches_a_hashmap() {
        let mut seed = 7;
        for n in [0usize, 1, 5, 100, 5000] {
            let ids: Vec<u64> = (0..n)
                .map(|_| lcg(&mut seed) % (n as u64 / 3 + 1))
                .collect();
            let mut inv = vec![-1i64; n];
            let unique = unique_inverse(&ids, &mut inv).unwrap();
            let mut first: HashMap<u64, usize> = HashMap::new();
            let mut want = Vec::new();
            for &id in &ids {
                first.entry(id).or_insert_with(|| {
                    want.push(id);
                    want.len() - 1
                });
            }
            assert_eq!(unique, want, "first-appearance order");
            for (i, &id) in ids.iter().enumerate() {
                assert_eq!(unique[inv[i] as usize], id);
            }
        }
        let mut short = vec![0i64; 1];
        assert!(unique_inverse(&[1, 2], &mut short).is_err());
    }

    #[test]
    fn sum_rows_adds_each_position_into_its_row() {
        let index = [2i64, 0, 2, 2];
        let src: Vec<f32> = (0..8).map(|v| v as f32).collect(); // dim 2
        let out = sum_rows(&src, &index, 2, 3).unwrap();
        assert_eq!(
            out,
            vec![2.0, 3.0, 0.0, 0.0, 0.0 + 4.0 + 6.0, 1.0 + 5.0 + 7.0]
        );
        assert!(sum_rows(&src, &index, 2, 2).is_err(), "index 2 of 2 rows");
        assert!(sum_rows(&src, &[-1, 0, 0, 0], 2, 3).is_err());
        assert!(sum_rows(&src[..7], &index, 2, 3).is_err());
        assert_eq!(sum_rows(&[], &[], 4, 2).unwrap(), vec![0.0; 8]);
        assert!(
            sum_rows(&[], &[], 1 << 40, 1 << 40).is_err(),
            "overflowing size"
        );
        assert!(
            sum_rows(&[], &[], 1 << 20, 1 << 40).is_err(),
            "unallocatable size"
        );
    }
}
