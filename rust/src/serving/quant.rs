//! How a serving artifact stores a row: float32, float16, or int8 with a per-row scale.

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Result};

/// The element type of an artifact's sparse rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 4 bytes per element, exact.
    Float32,
    /// IEEE half precision: 2 bytes per element, relative error at most 2^-11.
    Float16,
    /// A float32 scale (the row's largest magnitude / 127), then one int8 per element: error at
    /// most half a step, `scale / 2`.
    Int8,
}

impl Dtype {
    /// Parses `"float32"`, `"float16"` or `"int8"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "float32" => Ok(Dtype::Float32),
            "float16" => Ok(Dtype::Float16),
            "int8" => Ok(Dtype::Int8),
            _ => Err(invalid(format!(
                "unknown dtype {s:?}; expected float32, float16 or int8"
            ))),
        }
    }

    /// The name `parse` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Int8 => "int8",
        }
    }

    /// Bytes of one stored row of `dim` elements.
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            Dtype::Float32 => 4 * dim,
            Dtype::Float16 => 2 * dim,
            Dtype::Int8 => 4 + dim,
        }
    }

    /// Appends the stored form of `row`. A float16 row whose finite value overflows float16 is
    /// an error (the caller names the table and id); float32 and int8 take any finite row.
    pub fn encode(self, row: &[f32], out: &mut Vec<u8>) -> std::result::Result<(), f32> {
        match self {
            Dtype::Float32 => {
                for w in row {
                    out.extend_from_slice(&w.to_le_bytes());
                }
            }
            Dtype::Float16 => {
                for &w in row {
                    let h = half::f16::from_f32(w);
                    if h.is_infinite() && w.is_finite() {
                        return Err(w);
                    }
                    out.extend_from_slice(&h.to_bits().to_le_bytes());
                }
            }
            Dtype::Int8 => {
                let max = row.iter().fold(0.0f32, |m, w| m.max(w.abs()));
                if !max.is_finite() {
                    return Err(max);
                }
                // A row of tiny (subnormal) values whose step would underflow to zero gets the
                // smallest positive step instead: every subnormal is a whole number of those, so
                // such a row is kept (exactly, when its largest value is at most 127 steps)
                // rather than quantized to zeros.
                let mut scale = max / 127.0;
                if scale == 0.0 && max > 0.0 {
                    scale = f32::from_bits(1);
                }
                out.extend_from_slice(&scale.to_le_bytes());
                for &w in row {
                    let q = if scale > 0.0 {
                        (w / scale).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    };
                    out.push(q as u8);
                }
            }
        }
        Ok(())
    }

    /// Writes the float32 values of a stored row into `out` (`out.len()` elements). `bytes` must
    /// be `row_bytes(out.len())` long.
    #[inline]
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Dtype::Float32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::Float16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            Dtype::Int8 => {
                let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                for (o, &q) in out.iter_mut().zip(&bytes[4..]) {
                    *o = f32::from(q as i8) * scale;
                }
            }
        }
    }

    /// [`Dtype::decode`] with the same values, using F16C and AVX2 where the CPU has them (the
    /// lookup path).
    #[inline]
    pub fn decode_fast(self, bytes: &[u8], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self != Dtype::Float32
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has the features the function is compiled for.
            unsafe { decode_avx2(self, bytes, out) };
            return;
        }
        self.decode(bytes, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn decode_avx2(d: Dtype, bytes: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    match d {
        Dtype::Float16 => {
            let n = out.len();
            let whole = n / 8 * 8;
            for i in (0..whole).step_by(8) {
                let src = &bytes[2 * i..2 * i + 16];
                let dst = &mut out[i..i + 8];
                // SAFETY: 16 bytes read from `src` and 8 floats written to `dst`, both of
                // those lengths; unaligned loads and stores.
                unsafe {
                    let h = _mm_loadu_si128(src.as_ptr().cast());
                    _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_cvtph_ps(h));
                }
            }
            for i in whole..n {
                out[i] = half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
                    .to_f32();
            }
        }
        // The same loop as `decode`, vectorized with AVX2 here.
        _ => d.decode(bytes, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(d: Dtype, row: &[f32]) -> Vec<f32> {
        let mut b = Vec::new();
        d.encode(row, &mut b).unwrap();
        assert_eq!(b.len(), d.row_bytes(row.len()));
        let mut out = vec![f32::NAN; row.len()];
        d.decode(&b, &mut out);
        out
    }

    #[test]
    fn float32_is_exact() {
        let row = [1.5f32, -0.0, 3.25e-30, -7e20];
        assert_eq!(round_trip(Dtype::Float32, &row), row);
    }

    #[test]
    fn float16_within_its_bound() {
        let row: Vec<f32> = (0..200).map(|i| (i as f32 - 100.0) * 0.0137).collect();
        for (a, b) in row.iter().zip(round_trip(Dtype::Float16, &row)) {
            assert!(
                (a - b).abs() <= a.abs() * (2f32).powi(-11) + 2f32.powi(-25),
                "{a} {b}"
            );
        }
        let mut b = Vec::new();
        assert_eq!(Dtype::Float16.encode(&[1e6], &mut b), Err(1e6));
    }

    #[test]
    fn int8_within_half_a_step() {
        let row: Vec<f32> = (0..64)
            .map(|i| ((i * 37) % 23) as f32 * 0.01 - 0.1)
            .collect();
        let scale = row.iter().fold(0.0f32, |m, w| m.max(w.abs())) / 127.0;
        for (a, b) in row.iter().zip(round_trip(Dtype::Int8, &row)) {
            assert!((a - b).abs() <= scale * 0.5 + 1e-7, "{a} {b}");
        }
        assert_eq!(round_trip(Dtype::Int8, &[0.0, 0.0]), [0.0, 0.0]);
    }

    #[test]
    fn the_fast_decode_gives_the_same_bits() {
        let row: Vec<f32> = (0..77).map(|i| (i as f32 - 30.0) * 0.37).collect();
        for d in [Dtype::Float32, Dtype::Float16, Dtype::Int8] {
            let mut b = Vec::new();
            d.encode(&row, &mut b).unwrap();
            let (mut x, mut y) = (vec![0.0; 77], vec![1.0; 77]);
            d.decode(&b, &mut x);
            d.decode_fast(&b, &mut y);
            assert_eq!(
                x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn int8_keeps_rows_of_subnormal_values() {
        let tiny = f32::from_bits(1);
        for row in [vec![9.0 * tiny, -3.0 * tiny, 0.0], vec![200.0 * tiny, tiny]] {
            let back = round_trip(Dtype::Int8, &row);
            assert!(back.iter().any(|&x| x != 0.0), "{row:?} -> {back:?}");
            for (a, b) in row.iter().zip(&back) {
                assert!((a - b).abs() <= 1e-38, "{a} {b}");
            }
        }
        let exact = [9.0 * tiny, -3.0 * tiny, 0.0];
        assert_eq!(round_trip(Dtype::Int8, &exact), exact);
    }
}
