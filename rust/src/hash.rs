//! Hashing and the seeded random streams behind initialisers.
//!
//! Everything here is a pure function of its inputs, so a row's initial value and its shard do not
//! depend on the shard count, thread timing or call order.

/// The splitmix64 finaliser: a bijective mix of all 64 bits.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The shard of `id` among `num_shards`: the high bits of the mixed id, scaled (no modulo bias).
#[inline]
pub fn shard_of(id: u64, num_shards: usize) -> usize {
    ((mix64(id) as u128 * num_shards as u128) >> 64) as usize
}

/// The hash used inside a shard's index. It is drawn from different bits than [`shard_of`], so the
/// ids of one shard still spread over the whole index.
#[inline]
pub fn index_hash(id: u64) -> u64 {
    mix64(id ^ 0x9e37_79b9_7f4a_7c15)
}

/// A splitmix64 stream: tiny, fast, and good enough for initial weights.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream of initial values of row `id` in a table seeded with `seed`.
    pub fn for_row(seed: u64, id: u64) -> Self {
        Self {
            state: mix64(seed.wrapping_mul(0xd1b5_4a32_d192_ed03) ^ mix64(id)),
        }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// A uniform draw from [0, 1) with 53 random bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal draw (Box-Muller; one of the pair is used, which keeps the stream simple).
    #[inline]
    pub fn next_normal(&mut self) -> f64 {
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_all_and_are_balanced() {
        let n = 8;
        let mut counts = [0usize; 8];
        for id in 0..80_000u64 {
            counts[shard_of(id, n)] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "unbalanced: {counts:?}");
        }
    }

    #[test]
    fn row_streams_differ_by_seed_and_id() {
        let a = SplitMix64::for_row(1, 5).next_u64();
        assert_eq!(a, SplitMix64::for_row(1, 5).next_u64());
        assert_ne!(a, SplitMix64::for_row(2, 5).next_u64());
        assert_ne!(a, SplitMix64::for_row(1, 6).next_u64());
    }

    #[test]
    fn normal_draws_have_unit_variance() {
        let mut r = SplitMix64::for_row(3, 3);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.next_normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }
}
