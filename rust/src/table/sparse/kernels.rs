//! The inner loops of pulls and pushes: row copies (plain and streaming) and float64 sums.

/// Adds `row` to `acc` in float64 (a push sums the gradients of one id this way); with `first`,
/// `acc` is the sum so far of nothing (its contents are ignored). Where the CPU has AVX (checked
/// once per call) the conversions and additions run 4 lanes wide instead of 2.
#[inline]
pub(super) fn add_f64(acc: &mut [f64], row: &[f32], first: bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU supports AVX, checked just above.
        return unsafe { add_f64_avx(acc, row, first) };
    }
    add_f64_portable(acc, row, first)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn add_f64_avx(acc: &mut [f64], row: &[f32], first: bool) {
    add_f64_portable(acc, row, first)
}

#[inline(always)]
fn add_f64_portable(acc: &mut [f64], row: &[f32], first: bool) {
    if first {
        // `x + 0.0` is exactly `0.0 + x` (-0.0 becomes +0.0, as in a sum started at zero), without
        // zeroing `acc` and reading it back: most ids of a batch occur once.
        for (a, &x) in acc.iter_mut().zip(row) {
            *a = x as f64 + 0.0;
        }
    } else {
        for (a, &x) in acc.iter_mut().zip(row) {
            *a += x as f64;
        }
    }
}

/// Copies `src` to `dst`: the common widths (16, 32, 64 and 128 floats) with [`copy_fixed`]'s
/// straight-line moves, others in blocks of 16 floats the compiler turns into vector moves and
/// then the remaining floats.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` floats that do not overlap `src`.
#[inline(always)]
pub(super) unsafe fn copy_floats(src: &[f32], dst: *mut f32) {
    // The common widths get a copy of fixed length: straight-line moves, no loop, no tail.
    // In each arm `src.len()` is the width, so `dst` is valid for it (the caller's promise).
    match src.len() {
        // SAFETY: as said above the match.
        16 => return unsafe { copy_fixed::<16>(src, dst) },
        // SAFETY: as said above the match.
        32 => return unsafe { copy_fixed::<32>(src, dst) },
        // SAFETY: as said above the match.
        64 => return unsafe { copy_fixed::<64>(src, dst) },
        // SAFETY: as said above the match.
        128 => return unsafe { copy_fixed::<128>(src, dst) },
        _ => {}
    }
    let (blocks, rest) = src.as_chunks::<16>();
    for (i, b) in blocks.iter().enumerate() {
        // SAFETY: block `i` lies inside the `src.len()` floats the caller vouches for.
        unsafe { dst.add(i * 16).cast::<[f32; 16]>().write_unaligned(*b) };
    }
    let done = blocks.len() * 16;
    // SAFETY: as above, for the floats after the blocks.
    unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), dst.add(done), rest.len()) };
}

/// Copies the `N` floats of `src` (which holds exactly that many, `N` a multiple of 16) to `dst`,
/// in blocks of 16: straight-line moves, as wide as the caller's target features allow.
///
/// # Safety
/// As [`copy_floats`].
#[inline(always)]
pub(super) unsafe fn copy_fixed<const N: usize>(src: &[f32], dst: *mut f32) {
    debug_assert_eq!(src.len(), N);
    debug_assert_eq!(N % 16, 0);
    let src = src.as_ptr().cast::<[f32; 16]>();
    let dst = dst.cast::<[f32; 16]>();
    for i in 0..N / 16 {
        // SAFETY: block `i < N / 16` lies inside the `N` floats of `src` and of `dst`.
        unsafe { dst.add(i).write_unaligned(src.add(i).read_unaligned()) };
    }
}

/// Copies `src` to `dst` with streaming (non-temporal) stores where it can: whole 16-byte
/// groups to a 16-byte aligned `dst` on x86_64; anything else is copied by [`copy_floats`].
/// A streaming store writes the line without reading it first and leaves it out of the cache:
/// for a pull's output, written at scattered rows and too large to stay cached, that halves the
/// memory traffic. The caller must [`stream_fence`] before anyone else reads `dst`.
///
/// # Safety
/// As [`copy_floats`].
#[inline(always)]
pub(super) unsafe fn copy_floats_streaming(src: &[f32], dst: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    if src.len().is_multiple_of(4) && (dst as usize).is_multiple_of(16) {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_stream_ps};
        for i in (0..src.len()).step_by(4) {
            // SAFETY: `i + 4 <= src.len()`; `dst + i` is 16-byte aligned (as `dst` is, and `i`
            // counts whole groups) and inside the floats the caller vouches for. SSE is part of
            // x86_64.
            unsafe { _mm_stream_ps(dst.add(i), _mm_loadu_ps(src.as_ptr().add(i))) };
        }
        return;
    }
    // SAFETY: the caller's guarantee.
    unsafe { copy_floats(src, dst) }
}

/// Orders this thread's streaming stores before its later stores (and so before whatever
/// synchronisation follows): without it another thread may read a stale output row.
#[inline(always)]
pub(super) fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a store fence has no preconditions; SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Runs [`stream_fence`] when dropped, if set.
pub(super) struct Fence(pub(super) bool);

impl Drop for Fence {
    fn drop(&mut self) {
        if self.0 {
            stream_fence();
        }
    }
}

/// Pull outputs larger than the last-level cache are written with streaming stores (see
/// [`copy_floats_streaming`]); smaller ones are written normally: their lines stay cached (the
/// caller reads them next), and a store into a cached line costs no memory read.
pub(super) fn stream_min_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| last_level_cache_bytes().unwrap_or(STREAM_MIN_BYTES_UNKNOWN))
}

/// The streaming threshold where the cache size cannot be read: a common server's last level.
const STREAM_MIN_BYTES_UNKNOWN: usize = 32 << 20;

/// The size of the largest cache level that Linux lists for CPU 0.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let path = e.ok()?.path();
        let level: u32 = std::fs::read_to_string(path.join("level"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let size = parse_cache_size(&std::fs::read_to_string(path.join("size")).ok()?)?;
        Some((level, size))
    })
    .max()
    .map(|(_, size)| size)
}

/// A cache size as sysfs writes it: `"2048K"`, `"32M"` or a plain count of bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("2048K\n"), Some(2 << 20));
        assert_eq!(parse_cache_size("266240K"), Some(260 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("65536"), Some(65536));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size("12Q"), None);
        assert!(
            stream_min_bytes() >= 1 << 20,
            "a cache size is read or assumed"
        );
    }

    #[test]
    fn row_copies_write_exactly_the_row() {
        // Every width, the fixed-length ones (16, 32, 64, 128) among them, and both copies:
        // the row lands where it should and the floats around it are left alone.
        for len in 1..=136usize {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            for streaming in [false, true] {
                // 16-byte aligned destination (as a streaming copy wants), 4 guard floats each side.
                let mut buf = vec![[f32::NAN; 4]; len.div_ceil(4) + 2];
                let floats = buf.as_mut_ptr().cast::<f32>();
                // SAFETY: the buffer holds 4 * (len.div_ceil(4) + 2) >= len + 8 floats, and `dst`
                // leaves 4 before and at least 4 after the row.
                let all = unsafe {
                    let dst = floats.add(4);
                    if streaming {
                        copy_floats_streaming(&src, dst);
                        stream_fence();
                    } else {
                        copy_floats(&src, dst);
                    }
                    std::slice::from_raw_parts(floats, len + 8)
                };
                assert_eq!(
                    &all[4..4 + len],
                    &src[..],
                    "len {len}, streaming {streaming}"
                );
                assert!(
                    all[..4].iter().all(|x| x.is_nan()),
                    "len {len}: before the row"
                );
                assert!(
                    all[4 + len..].iter().all(|x| x.is_nan()),
                    "len {len}: after the row"
                );
            }
        }
    }

    #[test]
    fn float64_sums_are_the_same_with_and_without_avx() {
        // Converting to float64 and adding are exact IEEE operations: every width gives the
        // same bits, the portable loop's as well as the dispatched one's (AVX where present).
        // A sum started with `first` equals one started at +0.0, -0.0 included.
        for dim in [1usize, 3, 4, 16, 63, 64, 4096] {
            let mut rows: Vec<Vec<f32>> = (0..5u64)
                .map(|r| {
                    (0..dim as u64)
                        .map(|i| {
                            let bits = crate::hash::mix64(r * 10_007 + i) as u32;
                            f32::from_bits(bits & 0xbfff_ffff) // finite: never all exponent bits
                        })
                        .collect()
                })
                .collect();
            rows[0][0] = -0.0;
            for start in [Some(0.5f64), None] {
                let filled = vec![start.unwrap_or(f64::NAN); dim];
                let (mut a, mut b) = (filled.clone(), filled);
                for (k, row) in rows.iter().enumerate() {
                    let first = k == 0 && start.is_none();
                    add_f64(&mut a, row, first);
                    add_f64_portable(&mut b, row, first);
                }
                let expect: Vec<u64> = (0..dim)
                    .map(|i| {
                        let s0 = start.unwrap_or(0.0);
                        rows.iter().fold(s0, |s, row| s + row[i] as f64).to_bits()
                    })
                    .collect();
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), expect, "dim {dim}, start {start:?}");
                assert_eq!(bits(&b), expect, "dim {dim}, start {start:?}");
            }
            if dim == 1 {
                // One -0.0 gradient sums to +0.0, as from zero.
                let mut a = vec![f64::NAN];
                add_f64(&mut a, &[-0.0], true);
                assert_eq!(a[0].to_bits(), 0.0f64.to_bits());
            }
        }
    }
}
