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

/// The number of hash slots (`net::routing` routes by them).
pub const SLOTS: usize = 16_384;

/// Bits of `mix64(id)` that name the slot (the top ones).
pub(crate) const SLOT_BITS: u32 = 14;

/// The slot of `id`: the top 14 bits of `mix64(id)`.
#[inline]
pub fn slot_of(id: u64) -> usize {
    slot_of_mix(mix64(id))
}

/// The slot of the id whose `mix64` is `mix`.
#[inline]
pub fn slot_of_mix(mix: u64) -> usize {
    (mix >> (64 - SLOT_BITS)) as usize
}

/// The inverse of an odd multiplier modulo 2^64 (Newton's iteration; each step doubles the
/// correct low bits, from 3 for any odd number).
const fn inverse(c: u64) -> u64 {
    let mut x = c;
    let mut k = 0;
    while k < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(x)));
        k += 1;
    }
    x
}

/// The inverse of [`mix64`]: `unmix64(mix64(x)) == x`. It names the id of a replica key
/// (`mix64(id)`) whose value is damaged.
pub fn unmix64(mut x: u64) -> u64 {
    x ^= (x >> 31) ^ (x >> 62);
    x = x.wrapping_mul(const { inverse(0x94d0_49bb_1331_11eb) });
    x ^= (x >> 27) ^ (x >> 54);
    x = x.wrapping_mul(const { inverse(0xbf58_476d_1ce4_e5b9) });
    x ^ (x >> 30) ^ (x >> 60)
}

/// The shard of `id` among `num_shards`: the high bits of the mixed id, scaled (no modulo bias).
#[inline]
pub fn shard_of(id: u64, num_shards: usize) -> usize {
    shard_of_mix(mix64(id), num_shards)
}

/// [`shard_of`] of the id whose [`mix64`] is `mix`.
#[inline]
pub fn shard_of_mix(mix: u64, num_shards: usize) -> usize {
    ((mix as u128 * num_shards as u128) >> 64) as usize
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

    /// A uniform draw from the open interval (0, 1).
    #[inline]
    pub fn next_open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal draw: the inverse normal CDF of one uniform draw.
    #[inline]
    pub fn next_normal(&mut self) -> f64 {
        inverse_normal_cdf(self.next_open01())
    }

    /// Fills `p` with `a + b * next_open01()` of the next `p.len()` draws, in order (the same
    /// bits as drawing one at a time). The compiler runs the loop several draws wide; with
    /// AVX2 (checked once per call) four, which filled 64-float Normal rows about 1.1x faster
    /// than two-wide SSE2.
    pub fn open01_many(&mut self, a: f64, b: f64, p: &mut [f64]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { self.open01_many_avx2(a, b, p) };
        }
        self.open01_many_portable(a, b, p)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn open01_many_avx2(&mut self, a: f64, b: f64, p: &mut [f64]) {
        self.open01_many_portable(a, b, p)
    }

    #[inline(always)]
    fn open01_many_portable(&mut self, a: f64, b: f64, p: &mut [f64]) {
        for v in p {
            *v = a + b * self.next_open01();
        }
    }
}

/// Acklam's coefficients: the central region's numerator (`A`) and denominator (`B`), the
/// tails' (`C`, `D`), and where the tails start (`LOW`, and `1 - LOW` above).
const A: [f64; 6] = [
    -3.969_683_028_665_376e1,
    2.209_460_984_245_205e2,
    -2.759_285_104_469_687e2,
    1.383_577_518_672_69e2,
    -3.066_479_806_614_716e1,
    2.506_628_277_459_239,
];
const B: [f64; 5] = [
    -5.447_609_879_822_406e1,
    1.615_858_368_580_409e2,
    -1.556_989_798_598_866e2,
    6.680_131_188_771_972e1,
    -1.328_068_155_288_572e1,
];
const C: [f64; 6] = [
    -7.784_894_002_430_293e-3,
    -3.223_964_580_411_365e-1,
    -2.400_758_277_161_838,
    -2.549_732_539_343_734,
    4.374_664_141_464_968,
    2.938_163_982_698_783,
];
const D: [f64; 4] = [
    7.784_695_709_041_462e-3,
    3.224_671_290_700_398e-1,
    2.445_134_137_142_996,
    3.754_408_661_907_416,
];
const LOW: f64 = 0.02425;

/// The central region's formula, for `p` in `[LOW, 1 - LOW]` (any `p` gives a finite or NaN
/// value, never a trap, so a batch may compute it for every element and keep what it needs).
#[inline(always)]
fn central(p: f64) -> f64 {
    let q = p - 0.5;
    let r = q * q;
    (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
        / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
}

#[inline(always)]
fn in_tail(p: f64) -> bool {
    !(LOW..=1.0 - LOW).contains(&p)
}

/// The standard normal quantile of `p` in (0, 1), by P. J. Acklam's rational approximation
/// (relative error below 1.2e-9): one uniform draw per normal draw, no trigonometry, and a
/// truncated normal is a quantile of a narrowed uniform, with no rejection.
#[inline]
pub fn inverse_normal_cdf(p: f64) -> f64 {
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - LOW {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        central(p)
    }
}

/// [`inverse_normal_cdf`] of every element of `p`, written to `z` (of the same length), with
/// the same bits. The central formula, which 95% of draws take, runs for every element without
/// a branch (four lanes wide where the CPU has AVX, checked once per call); the few elements in
/// the tails are then computed one by one. A new row's initial values come from here: drawing
/// them one at a time took a third of the time to create a 16-float row.
pub fn inverse_normal_cdf_many(p: &[f64], z: &mut [f64]) {
    assert_eq!(p.len(), z.len(), "inverse_normal_cdf_many: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU supports AVX, checked just above.
        unsafe { central_many_avx(p, z) };
        return tails_many(p, z);
    }
    central_many(p, z);
    tails_many(p, z)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn central_many_avx(p: &[f64], z: &mut [f64]) {
    central_many(p, z)
}

/// Separate multiplications and additions (Rust never fuses them), so every lane rounds as the
/// scalar formula does.
#[inline(always)]
fn central_many(p: &[f64], z: &mut [f64]) {
    for (z, &p) in z.iter_mut().zip(p) {
        *z = central(p);
    }
}

/// Recomputes the elements in the tails.
fn tails_many(p: &[f64], z: &mut [f64]) {
    for (z, &p) in z.iter_mut().zip(p) {
        if in_tail(p) {
            *z = inverse_normal_cdf(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmix64_inverts_mix64() {
        for k in 0..10_000u64 {
            let x = mix64(k ^ 0x5555) ^ k.rotate_left(17);
            assert_eq!(unmix64(mix64(x)), x);
            assert_eq!(mix64(unmix64(x)), x);
        }
        assert_eq!(unmix64(mix64(u64::MAX)), u64::MAX);
    }

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
    fn quantiles_match_known_values() {
        for (p, z) in [
            (0.5, 0.0),
            (0.975, 1.959_963_984_540_054),
            (0.022_750_131_948_179_2, -2.0),
            (1e-6, -4.753_424_308_822_899),
        ] {
            assert!((inverse_normal_cdf(p) - z).abs() < 1e-8, "{p}");
        }
    }

    #[test]
    fn batched_quantiles_have_the_scalar_bits() {
        let mut r = SplitMix64::for_row(11, 12);
        let mut p: Vec<f64> = (0..100_003).map(|_| r.next_open01()).collect();
        // The edges of the regions and of (0, 1), and lengths that are not a multiple of 4.
        p.extend([
            LOW,
            1.0 - LOW,
            LOW.next_down(),
            LOW.next_up(),
            0.5,
            1e-300,
            1.0 - 1e-16,
        ]);
        for len in [0, 1, 3, 5, p.len()] {
            let p = &p[..len];
            let mut z = vec![f64::NAN; len];
            inverse_normal_cdf_many(p, &mut z);
            let mut portable = vec![f64::NAN; len];
            central_many(p, &mut portable);
            tails_many(p, &mut portable);
            for ((&p, &z), &zp) in p.iter().zip(&z).zip(&portable) {
                let want = inverse_normal_cdf(p);
                assert_eq!(z.to_bits(), want.to_bits(), "p = {p}");
                assert_eq!(zp.to_bits(), want.to_bits(), "p = {p}");
            }
        }
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
