//! The row checks of a bulk read, a group of rows at a time.
//!
//! A row value of format 3 is its body (id and payload) followed by the body's CRC-32 (LE), so
//! the CRC-32 of a sound value is one fixed number whatever the row (the CRC's residue). The
//! CRC is linear: over several values of one length, each followed by zeros up to a multiple of
//! 64 bytes and laid end to end, the CRC-32 (from a zero state, no final inversion) of sound
//! values is also one fixed number for a given count and length, which any group of sound rows
//! reproduces. A group with one damaged value fails exactly when that value's own check would
//! (the group's CRC moves by the value's error times a power of x, invertible mod P); several
//! damaged values could cancel with odds of about 2^-32; and a group of at most [`GROUP_BYTES`]
//! keeps CRC-32's Hamming distance of 4 (any 3 flipped bits found), as a single row has it.
//!
//! [`group_sound`] computes that CRC with carry-less multiplications 64 bytes at a time
//! (`VPCLMULQDQ` on 512-bit registers, four blocks in flight), which checks a group at about
//! half the time per row of one CRC-32 call per row: a short input's CRC waits on its own chain
//! of folds, and a group keeps four chains busy. Where the CPU lacks those instructions, or the
//! values differ in length, it answers `None` and the caller checks row by row
//! ([`super::format::check_row`]), which also names a damaged row.

/// The most bytes a group spans, padding included: CRC-32 (IEEE 802.3) has Hamming distance 4 up
/// to 91,607 bits (Koopman, "32-bit cyclic redundancy codes for Internet applications", 2002).
pub(super) const GROUP_BYTES: usize = 11_264;

/// The most rows in a group.
pub(super) const GROUP_ROWS: usize = 16;

/// How many values of `len` bytes a group holds (0: check row by row).
pub(super) fn group_rows(len: usize) -> usize {
    let padded = len.div_ceil(64) * 64;
    if !(12..=GROUP_BYTES / 2).contains(&len) || !fast() {
        return 0;
    }
    (GROUP_BYTES / padded).min(GROUP_ROWS)
}

/// Whether every value of `values` (all of one length, at least 12 bytes: an id, a payload, the
/// CRC) holds the CRC-32 of its body; `None` where this cannot tell (the CPU lacks the
/// instructions, the lengths differ): check them one by one.
pub(super) fn group_sound(values: &[&[u8]], expected: &mut Expected) -> Option<bool> {
    let len = values.first()?.len();
    if len < 12 || values.iter().any(|v| v.len() != len) || !fast() {
        return None;
    }
    let want = expected.of(values.len(), len)?;
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `fast()` checked the CPU's features; every value is `len` bytes.
        Some(unsafe { x86::group_crc(values) } == want)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = want;
        None
    }
}

/// The group CRC of sound values, by count and length (a scan meets two shapes at most per
/// table: full groups and the last one).
#[derive(Default)]
pub(super) struct Expected(Vec<(usize, usize, u32)>);

impl Expected {
    fn of(&mut self, count: usize, len: usize) -> Option<u32> {
        if let Some(&(_, _, c)) = self.0.iter().find(|e| e.0 == count && e.1 == len) {
            return Some(c);
        }
        // Sound values of that shape: a zero body and its CRC.
        let mut v = vec![0u8; len];
        let sum = crc32fast::hash(&v[..len - 4]);
        v[len - 4..].copy_from_slice(&sum.to_le_bytes());
        let values = vec![&v[..]; count];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: only called after `fast()`; every value is `len` bytes.
        let c = unsafe { x86::group_crc(&values) };
        #[cfg(not(target_arch = "x86_64"))]
        let c = {
            let _ = values;
            return None;
        };
        if self.0.len() >= 8 {
            self.0.clear();
        }
        self.0.push((count, len, c));
        Some(c)
    }
}

/// Whether this CPU runs the group check (once per process).
fn fast() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FAST.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("vpclmulqdq")
                && std::arch::is_x86_feature_detected!("pclmulqdq")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `x^n mod P` for CRC-32's polynomial, bits in the usual (not reflected) order.
    const fn x_pow_mod(n: u32) -> u64 {
        let p: u64 = 0x1_04C1_1DB7;
        let mut r: u64 = 1;
        let mut i = 0;
        while i < n {
            r <<= 1;
            if r >> 32 != 0 {
                r ^= p;
            }
            i += 1;
        }
        r
    }

    /// The multiplier that moves a 64-bit half of a 128-bit lane `d` bits on, in the reflected
    /// order of the data: `x^(d+32)` for the low half (`plus`), `x^(d-32)` for the high one.
    const fn key(d: u32, plus: bool) -> i64 {
        let v = x_pow_mod(if plus { d + 32 } else { d - 32 }) as u32;
        ((v.reverse_bits() as u64) << 1) as i64
    }

    const K2048: (i64, i64) = (key(2048, true), key(2048, false));
    const K512: (i64, i64) = (key(512, true), key(512, false));
    const K128: (i64, i64) = (key(128, true), key(128, false));

    /// Moves each 128-bit lane of `a` on by the keys' distance and adds `b`.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold(a: __m512i, k: __m512i, b: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128(a, k, 0x00);
        let hi = _mm512_clmulepi64_epi128(a, k, 0x11);
        _mm512_ternarylogic_epi64(lo, hi, b, 0x96)
    }

    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn fold128(a: __m128i, k: __m128i, b: __m128i) -> __m128i {
        let lo = _mm_clmulepi64_si128(a, k, 0x00);
        let hi = _mm_clmulepi64_si128(a, k, 0x11);
        _mm_xor_si128(_mm_xor_si128(lo, hi), b)
    }

    /// The CRC-32 from a zero state, without the final inversion, of `values` (each of one
    /// length) each followed by zeros up to a multiple of 64 bytes, end to end.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW, VPCLMULQDQ and PCLMULQDQ; every value has the first
    /// one's length, at least 1 byte.
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    pub(super) unsafe fn group_crc(values: &[&[u8]]) -> u32 {
        let len = values[0].len();
        let blocks = len.div_ceil(64);
        let tail = len - 64 * (blocks - 1);
        let mask: u64 = if tail == 64 { !0 } else { (1u64 << tail) - 1 };
        let k = _mm512_set_epi64(
            K2048.1, K2048.0, K2048.1, K2048.0, K2048.1, K2048.0, K2048.1, K2048.0,
        );
        // Four accumulators, for the blocks 4 apart (256 bytes: 2048 bits); zero ones stand
        // for blocks of zeros before the data, which leave a zero state unchanged.
        let z = _mm512_setzero_si512();
        let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
        for v in values {
            let p = v.as_ptr();
            for b in 0..blocks {
                // SAFETY: the block's bytes lie in the value (the last one's bytes past its
                // end are masked off, and a masked load does not touch them).
                let d = unsafe {
                    if b + 1 < blocks {
                        _mm512_loadu_si512(p.add(64 * b).cast())
                    } else {
                        _mm512_maskz_loadu_epi8(mask, p.add(64 * b).cast())
                    }
                };
                let f = fold(a0, k, d);
                (a0, a1, a2, a3) = (a1, a2, a3, f);
            }
        }
        let k = _mm512_set_epi64(
            K512.1, K512.0, K512.1, K512.0, K512.1, K512.0, K512.1, K512.0,
        );
        let x = fold(fold(fold(a0, k, a1), k, a2), k, a3);
        let k = _mm_set_epi64x(K128.1, K128.0);
        let mut y = _mm512_extracti32x4_epi32::<0>(x);
        y = fold128(y, k, _mm512_extracti32x4_epi32::<1>(x));
        y = fold128(y, k, _mm512_extracti32x4_epi32::<2>(x));
        y = fold128(y, k, _mm512_extracti32x4_epi32::<3>(x));
        let mut rest = [0u8; 16];
        // SAFETY: `rest` holds 16 bytes.
        unsafe { _mm_storeu_si128(rest.as_mut_ptr().cast(), y) };
        // The last 128 bits, reduced like a message from a zero state (the hasher's state is
        // kept inverted).
        let mut h = crc32fast::Hasher::new_with_initial(u32::MAX);
        h.update(&rest);
        !h.finalize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sound value: `body` and its CRC-32.
    fn value(body: &[u8]) -> Vec<u8> {
        let mut v = body.to_vec();
        v.extend(crc32fast::hash(body).to_le_bytes());
        v
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    #[test]
    fn the_group_crc_is_the_crc_of_the_padded_values_end_to_end() {
        if !fast() {
            return;
        }
        for len in [1usize, 12, 16, 28, 63, 64, 65, 264, 556, 1000, 4096] {
            for count in [1usize, 2, 3, 5, 16] {
                let vs: Vec<Vec<u8>> = (0..count)
                    .map(|i| bytes(len, (len * 31 + i) as u64))
                    .collect();
                let refs: Vec<&[u8]> = vs.iter().map(|v| &v[..]).collect();
                let mut h = crc32fast::Hasher::new_with_initial(u32::MAX);
                for v in &vs {
                    h.update(v);
                    h.update(&vec![0u8; len.div_ceil(64) * 64 - len]);
                }
                // SAFETY: `fast()` holds; the values have one length.
                let got = unsafe { x86::group_crc(&refs) };
                assert_eq!(got, !h.finalize(), "{len} x {count}");
            }
        }
    }

    #[test]
    fn sound_groups_pass_and_any_flipped_bit_fails_the_group() {
        let mut expected = Expected::default();
        for len in [12usize, 40, 556] {
            let vs: Vec<Vec<u8>> = (0..5).map(|i| value(&bytes(len - 4, 7 + i))).collect();
            let refs: Vec<&[u8]> = vs.iter().map(|v| &v[..]).collect();
            if !fast() {
                assert_eq!(group_sound(&refs, &mut expected), None);
                continue;
            }
            assert_eq!(group_sound(&refs, &mut expected), Some(true));
            for row in 0..vs.len() {
                for bit in 0..len * 8 {
                    let mut bad = vs.clone();
                    bad[row][bit / 8] ^= 1 << (bit % 8);
                    let refs: Vec<&[u8]> = bad.iter().map(|v| &v[..]).collect();
                    assert_eq!(
                        group_sound(&refs, &mut expected),
                        Some(false),
                        "{len} {row} {bit}"
                    );
                }
            }
            // Two damaged rows.
            let mut bad = vs.clone();
            bad[1][3] ^= 0x10;
            bad[4][len - 1] ^= 0x80;
            let refs: Vec<&[u8]> = bad.iter().map(|v| &v[..]).collect();
            assert_eq!(group_sound(&refs, &mut expected), Some(false));
        }
        // Lengths that differ, or too short for a CRC: row by row.
        let (a, b) = (value(&[1; 20]), value(&[1; 21]));
        assert_eq!(group_sound(&[&a, &b], &mut expected), None);
        assert_eq!(group_sound(&[&[0u8; 8][..]], &mut expected), None);
        assert_eq!(group_sound(&[], &mut expected), None);
    }

    #[test]
    fn a_group_stays_within_the_bytes_that_keep_the_crcs_guarantee() {
        for len in [12usize, 100, 556, 3000, 5632, 5633] {
            let n = group_rows(len);
            assert!(n * len.div_ceil(64) * 64 <= GROUP_BYTES, "{len}");
            assert!(n <= GROUP_ROWS);
            if !fast() || len > GROUP_BYTES / 2 {
                assert_eq!(n, 0);
            } else {
                assert!(n >= 2);
            }
        }
    }
}
