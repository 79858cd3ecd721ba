//! Arrays on the wire: ids as little-endian u64, rows as little-endian float32, float16 or
//! bfloat16, packed in `bytes` fields.
//!
//! Decoding copies at most once: a field whose bytes are suitably aligned in the received buffer
//! is read in place, any other is copied once into an aligned vector (or converted once, for the
//! 16-bit types).

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::sync::Mutex;

use bytes::Bytes;

use super::proto::Dtype;
use crate::error::{invalid, shape, Result};

/// The element type of a values field, checked.
pub fn dtype(raw: i32) -> Result<Dtype> {
    Dtype::try_from(raw).map_err(|_| invalid(format!("unknown dtype {raw} on the wire")))
}

/// Bytes per element of a values field.
pub fn width(d: Dtype) -> usize {
    match d {
        Dtype::Float32 => 4,
        Dtype::Float16 | Dtype::Bfloat16 => 2,
    }
}

/// Reads `b` as `[T]` in place when it is aligned and the machine is little-endian.
fn in_place<T: Copy>(b: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if cfg!(target_endian = "little")
        && (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        // SAFETY: the pointer is aligned for T, the length is a whole number of T (checked by the
        // callers), the bytes live as long as the borrow, and T (u64, u32 or f32) is valid for every
        // bit pattern.
        Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / size) })
    } else {
        None
    }
}

/// A field of little-endian `T` (`ty` names it in errors), in place when aligned.
fn le_array<'a, T: Copy>(
    b: &'a Bytes,
    what: &str,
    ty: &str,
    from: impl Fn(&[u8]) -> T,
) -> Result<Cow<'a, [T]>> {
    let size = std::mem::size_of::<T>();
    if !b.len().is_multiple_of(size) {
        return Err(shape(format!(
            "{what} must be little-endian {ty} ({size} bytes each), got {} bytes",
            b.len()
        )));
    }
    Ok(match in_place::<T>(b) {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(b.chunks_exact(size).map(from).collect()),
    })
}

/// The ids of an `ids` field.
pub fn ids(b: &Bytes) -> Result<Cow<'_, [u64]>> {
    le_array(b, "ids", "u64", |c| {
        u64::from_le_bytes(c.try_into().expect("8 bytes"))
    })
}

/// The u32 words of a `words` field (bulk loads).
pub fn words(b: &Bytes) -> Result<Cow<'_, [u32]>> {
    le_array(b, "words", "u32", |c| {
        u32::from_le_bytes(c.try_into().expect("4 bytes"))
    })
}

/// The values of a rows or gradients field, `expected` of them.
pub fn values<'a>(b: &'a Bytes, d: Dtype, expected: usize, what: &str) -> Result<Cow<'a, [f32]>> {
    let w = width(d);
    if b.len() != expected * w {
        return Err(shape(format!(
            "{what} must hold {expected} {} values ({} bytes), got {} bytes",
            d.as_str_name().to_ascii_lowercase(),
            expected * w,
            b.len()
        )));
    }
    Ok(match d {
        Dtype::Float32 => match in_place::<f32>(b) {
            Some(s) => Cow::Borrowed(s),
            None => Cow::Owned(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
        },
        Dtype::Float16 => Cow::Owned(
            b.chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        Dtype::Bfloat16 => Cow::Owned(
            b.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
    })
}

/// Answer buffers kept for reuse, so a server's steady stream of pulls does not fault in fresh
/// pages for every answer. At most `POOL_BYTES` are kept.
static POOL: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());
const POOL_BYTES: usize = 64 << 20;

pub(crate) fn pooled(n: usize) -> Vec<u32> {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    // The smallest kept buffer that is large enough, if it is not more than twice too large.
    let best = pool
        .iter()
        .enumerate()
        .filter(|(_, v)| v.capacity() >= n && v.capacity() <= 2 * n.max(1024))
        .min_by_key(|(_, v)| v.capacity())
        .map(|(i, _)| i);
    match best {
        Some(i) => pool.swap_remove(i),
        None => Vec::with_capacity(n),
    }
}

pub(crate) fn give_back(mut v: Vec<u32>) {
    v.clear();
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let kept: usize = pool.iter().map(|v| v.capacity() * 4).sum();
    if kept + v.capacity() * 4 <= POOL_BYTES {
        pool.push(v);
    }
}

/// A buffer of `n` little-endian float32 values written by `fill` (which must write all of
/// them), as `Bytes` without a further copy.
pub fn fill_f32(
    n: usize,
    fill: impl FnOnce(&mut [std::mem::MaybeUninit<f32>]) -> Result<()>,
) -> Result<Bytes> {
    if cfg!(target_endian = "big") {
        let mut v: Vec<f32> = Vec::with_capacity(n);
        fill(&mut v.spare_capacity_mut()[..n])?;
        // SAFETY: `fill` returned Ok, so it wrote all n elements.
        unsafe { v.set_len(n) };
        return Ok(encode_values(&v, Dtype::Float32));
    }
    // A Vec<u32> is 4-byte aligned; its bytes become the answer, reinterpreted as u8.
    let mut words: Vec<u32> = pooled(n);
    let spare = &mut words.spare_capacity_mut()[..n];
    // SAFETY: MaybeUninit<u32> and MaybeUninit<f32> have the same size and alignment.
    let as_f32 = unsafe {
        std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<std::mem::MaybeUninit<f32>>(), n)
    };
    if let Err(e) = fill(as_f32) {
        give_back(words);
        return Err(e);
    }
    // SAFETY: `fill` returned Ok, so it wrote all n elements.
    unsafe { words.set_len(n) };
    Ok(Bytes::from_owner(U32Bytes(words)))
}

/// A `Vec<u32>` seen as its bytes (little-endian machines); back to the pool when dropped.
struct U32Bytes(Vec<u32>);

impl AsRef<[u8]> for U32Bytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: any initialised u32 memory is valid as bytes; the length is in bytes.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 4) }
    }
}

impl Drop for U32Bytes {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

/// A field received in pieces (the frames that carried it, see `splice.rs`) as one buffer:
/// a single piece as it is, several copied once into a 4-byte aligned buffer (from the pool),
/// so that [`values`] then reads float32 values in place.
pub fn join(chunks: Vec<Bytes>) -> Bytes {
    let mut chunks = chunks;
    chunks.retain(|c| !c.is_empty());
    if chunks.len() <= 1 {
        return chunks.pop().unwrap_or_default();
    }
    let total: usize = chunks.iter().map(Bytes::len).sum();
    let n = total.div_ceil(4);
    let mut words = pooled(n);
    let dst = words.spare_capacity_mut()[..n].as_mut_ptr().cast::<u8>();
    let mut at = 0;
    for c in &chunks {
        // SAFETY: `at + c.len() <= total <= 4 * n` bytes of the spare capacity are written, a
        // fresh buffer that does not overlap the received pieces.
        unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), dst.add(at), c.len()) };
        at += c.len();
    }
    // The last word's padding bytes, so that every word is initialised.
    // SAFETY: bytes `total .. 4 * n` lie within the same spare capacity.
    unsafe { std::ptr::write_bytes(dst.add(total), 0, 4 * n - total) };
    // SAFETY: all n words were written above.
    unsafe { words.set_len(n) };
    Bytes::from_owner(U32Bytes(words)).slice(..total)
}

/// Writes the rows of a values field into `out`: row `k` of the field goes to row `pos[k]` of
/// `out` (each `dim` wide). The field must hold `pos.len() * dim` values of type `d`.
pub fn scatter_rows(
    b: &Bytes,
    d: Dtype,
    pos: &[u32],
    dim: usize,
    out: &mut [MaybeUninit<f32>],
) -> Result<()> {
    scatter_chunks(std::slice::from_ref(b), d, pos, dim, out)
}

/// [`scatter_rows`] for a field received in pieces (the frames that carried it, see
/// `splice.rs`): each row is read once, straight from the pieces into `out`.
pub fn scatter_chunks(
    chunks: &[Bytes],
    d: Dtype,
    pos: &[u32],
    dim: usize,
    out: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let w = width(d);
    let total: usize = chunks.iter().map(Bytes::len).sum();
    if total != pos.len() * dim * w {
        return Err(shape(format!(
            "rows must hold {} values ({} bytes), got {} bytes",
            pos.len() * dim,
            pos.len() * dim * w,
            total
        )));
    }
    let row_bytes = dim * w;
    let mut pieces = chunks.iter().filter(|c| !c.is_empty());
    let mut cur: &[u8] = &[];
    let mut straddling = Vec::new();
    let native = d == Dtype::Float32 && cfg!(target_endian = "little");
    let mut i = 0;
    while i < pos.len() {
        let p = pos[i] as usize;
        if cur.is_empty() {
            cur = pieces.next().map_or(&[][..], |c| &c[..]);
        }
        // Whole float32 rows of this piece going to consecutive positions (a batch for one
        // server is in order): one copy for all of them.
        let whole = if native && row_bytes > 0 {
            cur.len() / row_bytes
        } else {
            0
        };
        let run = (1..whole.min(pos.len() - i))
            .take_while(|&k| pos[i + k] as usize == p + k)
            .count()
            + 1;
        if whole >= 2 && run >= 2 {
            let dst = &mut out[p * dim..(p + run) * dim];
            let (rows, rest) = cur.split_at(run * row_bytes);
            // SAFETY: as in `write_row`: `rows` holds `dst.len()` little-endian f32 values, the
            // native layout here; `dst` is the caller's output, `rows` a received buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    rows.as_ptr(),
                    dst.as_mut_ptr().cast::<u8>(),
                    rows.len(),
                );
            }
            cur = rest;
            i += run;
            continue;
        }
        i += 1;
        let dst = &mut out[p * dim..(p + 1) * dim];
        let src = if cur.len() >= row_bytes {
            let (row, rest) = cur.split_at(row_bytes);
            cur = rest;
            row
        } else {
            // A row split between two pieces is put together first.
            straddling.clear();
            while straddling.len() < row_bytes {
                if cur.is_empty() {
                    cur = pieces.next().map_or(&[][..], |c| &c[..]);
                }
                let k = (row_bytes - straddling.len()).min(cur.len());
                straddling.extend_from_slice(&cur[..k]);
                cur = &cur[k..];
            }
            &straddling[..]
        };
        write_row(src, d, dst);
    }
    Ok(())
}

/// Converts one row of wire values into `dst`.
fn write_row(src: &[u8], d: Dtype, dst: &mut [MaybeUninit<f32>]) {
    match d {
        Dtype::Float32 if cfg!(target_endian = "little") => {
            // SAFETY: `src` holds `dst.len()` little-endian f32 values (4 bytes each, checked by
            // the caller), the native layout on this machine; the two do not overlap (`dst` is
            // the caller's output, `src` a received buffer) and any bytes are a valid f32.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    dst.as_mut_ptr().cast::<u8>(),
                    dst.len() * 4,
                );
            }
        }
        Dtype::Float32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                o.write(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
        Dtype::Float16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                o.write(half::f16::from_le_bytes([c[0], c[1]]).to_f32());
            }
        }
        Dtype::Bfloat16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                o.write(half::bf16::from_le_bytes([c[0], c[1]]).to_f32());
            }
        }
    }
}

/// Packs ids.
pub fn encode_ids(ids: &[u64]) -> Bytes {
    let mut out = Vec::with_capacity(ids.len() * 8);
    for &i in ids {
        out.extend_from_slice(&i.to_le_bytes());
    }
    Bytes::from(out)
}

/// Packs the ids at positions `pos` of `ids`.
pub fn encode_ids_at(ids: &[u64], pos: &[u32]) -> Bytes {
    let mut out = Vec::with_capacity(pos.len() * 8);
    for &p in pos {
        out.extend_from_slice(&ids[p as usize].to_le_bytes());
    }
    Bytes::from(out)
}

/// Appends values in the element type `d` (rounding to nearest even for the 16-bit types).
fn put_values(out: &mut Vec<u8>, v: &[f32], d: Dtype) {
    match d {
        Dtype::Float32 if cfg!(target_endian = "little") => {
            // SAFETY: f32 memory is valid as bytes; the length is in bytes.
            let b = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) };
            out.extend_from_slice(b);
        }
        Dtype::Float32 => {
            for &x in v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Dtype::Float16 => {
            for &x in v {
                out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
            }
        }
        Dtype::Bfloat16 => {
            for &x in v {
                out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
            }
        }
    }
}

/// Packs values in the element type `d`.
pub fn encode_values(v: &[f32], d: Dtype) -> Bytes {
    let mut out = Vec::with_capacity(v.len() * width(d));
    put_values(&mut out, v, d);
    Bytes::from(out)
}

/// Packs the rows (`dim` wide) at positions `pos` of `v` in the element type `d`: the rows of
/// one server's part of a batch, gathered straight into the message.
pub fn encode_rows_at(v: &[f32], dim: usize, pos: &[u32], d: Dtype) -> Bytes {
    let mut out = Vec::with_capacity(pos.len() * dim * width(d));
    for &p in pos {
        put_values(&mut out, &v[p as usize * dim..(p as usize + 1) * dim], d);
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_aligned_and_not() {
        let ids_in = [0u64, 1, u64::MAX, 1 << 63, 42];
        let b = encode_ids(&ids_in);
        assert_eq!(&*ids(&b).unwrap(), &ids_in);
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&b);
        let b2 = Bytes::from(shifted).slice(1..);
        assert_eq!(&*ids(&b2).unwrap(), &ids_in);
        assert!(ids(&Bytes::from_static(&[1, 2, 3])).is_err());
    }

    #[test]
    fn gathered_ids_and_rows() {
        let ids = [10u64, 20, 30];
        assert_eq!(
            &*super::ids(&encode_ids_at(&ids, &[2, 0])).unwrap(),
            &[30, 10]
        );
        let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = encode_rows_at(&v, 2, &[2, 0], Dtype::Float32);
        assert_eq!(
            &*values(&b, Dtype::Float32, 4, "rows").unwrap(),
            &[5.0, 6.0, 1.0, 2.0]
        );
    }

    #[test]
    fn filled_buffers_and_scattered_rows() {
        let b = fill_f32(6, |out| {
            for (i, o) in out.iter_mut().enumerate() {
                o.write(i as f32 * 1.5);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(
            &*values(&b, Dtype::Float32, 6, "rows").unwrap(),
            &[0.0, 1.5, 3.0, 4.5, 6.0, 7.5]
        );
        assert!(fill_f32(2, |_| Err(shape("no"))).is_err());
        for d in [Dtype::Float32, Dtype::Float16, Dtype::Bfloat16] {
            let rows = encode_values(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], d);
            let mut out = [MaybeUninit::<f32>::uninit(); 9];
            scatter_rows(&rows, d, &[2, 0, 1], 3, &mut out[..]).unwrap_err();
            let mut out = [MaybeUninit::<f32>::uninit(); 6];
            scatter_rows(&rows, d, &[1, 0], 3, &mut out).unwrap();
            // SAFETY: scatter_rows wrote every row.
            let out = out.map(|x| unsafe { x.assume_init() });
            assert_eq!(out, [4.0, 5.0, 6.0, 1.0, 2.0, 3.0]);
            // The same field in pieces of every size, rows split between pieces.
            for piece in 1..rows.len() {
                let chunks: Vec<Bytes> = (0..rows.len())
                    .step_by(piece)
                    .map(|a| rows.slice(a..(a + piece).min(rows.len())))
                    .chain([Bytes::new()])
                    .collect();
                let mut out = [MaybeUninit::<f32>::uninit(); 6];
                scatter_chunks(&chunks, d, &[1, 0], 3, &mut out).unwrap();
                // SAFETY: scatter_chunks wrote every row.
                let out = out.map(|x| unsafe { x.assume_init() });
                assert_eq!(
                    out,
                    [4.0, 5.0, 6.0, 1.0, 2.0, 3.0],
                    "{d:?} in pieces of {piece}"
                );
                let short = &chunks[..chunks.len() - 2];
                scatter_chunks(short, d, &[1, 0], 3, &mut [MaybeUninit::uninit(); 6]).unwrap_err();
            }
        }
    }

    #[test]
    fn rows_in_runs_of_positions_are_scattered_whole() {
        // Runs of consecutive positions, broken runs, rows split between pieces.
        let dim = 3;
        let pos: Vec<u32> = vec![0, 1, 2, 3, 7, 8, 4, 5, 6, 10, 9, 11];
        let v: Vec<f32> = (0..pos.len() * dim).map(|i| i as f32 + 0.5).collect();
        let want: Vec<f32> = {
            let mut w = vec![0.0; v.len()];
            for (k, &p) in pos.iter().enumerate() {
                let p = p as usize;
                w[p * dim..(p + 1) * dim].copy_from_slice(&v[k * dim..(k + 1) * dim]);
            }
            w
        };
        for d in [Dtype::Float32, Dtype::Float16] {
            let rows = encode_values(&v, d);
            for piece in [1usize, 5, 12, 13, 24, 40, rows.len()] {
                let chunks: Vec<Bytes> = (0..rows.len())
                    .step_by(piece)
                    .map(|a| rows.slice(a..(a + piece).min(rows.len())))
                    .collect();
                let mut out = vec![MaybeUninit::<f32>::uninit(); v.len()];
                scatter_chunks(&chunks, d, &pos, dim, &mut out).unwrap();
                // SAFETY: scatter_chunks wrote every row.
                let got: Vec<f32> = out.iter().map(|x| unsafe { x.assume_init() }).collect();
                let expect: Vec<f32> = match d {
                    Dtype::Float32 => want.clone(),
                    _ => want
                        .iter()
                        .map(|&x| half::f16::from_f32(x).to_f32())
                        .collect(),
                };
                assert_eq!(got, expect, "{d:?} in pieces of {piece}");
            }
        }
    }

    #[test]
    fn joined_pieces_are_one_aligned_buffer() {
        let v: Vec<f32> = (0..1001).map(|i| i as f32 * 0.25).collect();
        let b = encode_values(&v, Dtype::Float32);
        for piece in [1usize, 3, 4, 1000, 4004] {
            let chunks: Vec<Bytes> = (0..b.len())
                .step_by(piece)
                .map(|a| b.slice(a..(a + piece).min(b.len())))
                .collect();
            let j = join(chunks);
            assert_eq!(j, b);
            if piece < b.len() {
                assert_eq!(j.as_ptr() as usize % 4, 0);
                assert!(matches!(
                    values(&j, Dtype::Float32, v.len(), "g").unwrap(),
                    Cow::Borrowed(_)
                ));
            }
        }
        assert_eq!(
            join(vec![Bytes::new(), Bytes::from_static(b"abc")]),
            &b"abc"[..]
        );
        assert!(join(Vec::new()).is_empty());
        // Odd byte counts (16-bit values) keep their length.
        let odd = join(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cde")]);
        assert_eq!(odd, &b"abcde"[..]);
    }

    #[test]
    fn values_round_trip_within_the_dtype_bound() {
        let v: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.0137).collect();
        for (d, rel) in [
            (Dtype::Float32, 0.0f32),
            (Dtype::Float16, 2f32.powi(-11)),
            (Dtype::Bfloat16, 2f32.powi(-8)),
        ] {
            let b = encode_values(&v, d);
            assert_eq!(b.len(), v.len() * width(d));
            let back = values(&b, d, v.len(), "rows").unwrap();
            for (&x, &y) in v.iter().zip(back.iter()) {
                assert!((x - y).abs() <= rel * x.abs() + 1e-7, "{d:?}: {x} -> {y}");
            }
        }
        assert!(values(&Bytes::from_static(&[0; 6]), Dtype::Float32, 2, "rows").is_err());
        assert!(dtype(7).is_err());
    }
}
