//! A fixed-size, zero-initialised buffer that asks the kernel for transparent huge pages when it
//! is large.
//!
//! Rows and index entries are reached at random, so with 4 KiB pages nearly every access also
//! misses the TLB (and under virtualisation a page walk is expensive). numpy asks for huge pages
//! for its large arrays too; a table that did not would lose to a plain `take` for that reason
//! alone. Buffers of 2 MiB or more are aligned to 2 MiB and marked `MADV_HUGEPAGE` (Linux).

use std::alloc::{alloc, alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::marker::PhantomData;
use std::ptr::NonNull;

const HUGE: usize = 2 << 20;

/// Element types whose all-zero bit pattern is a valid value.
///
/// # Safety
/// Implementors must be plain data with no invalid bit patterns and no drop glue.
pub unsafe trait Zeroable: Copy {}
// SAFETY: integers and floats are valid for every bit pattern, zero included.
unsafe impl Zeroable for u32 {}
// SAFETY: as above.
unsafe impl Zeroable for u64 {}

/// A boxed slice of `len` zeroed elements, huge-page backed when large.
pub struct Buffer<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
    _owns: PhantomData<T>,
}

// SAFETY: a `Buffer` owns its elements exclusively, like a `Box<[T]>`.
unsafe impl<T: Zeroable + Send> Send for Buffer<T> {}
// SAFETY: shared access only hands out `&[T]`, like a `Box<[T]>`.
unsafe impl<T: Zeroable + Sync> Sync for Buffer<T> {}

impl<T: Zeroable> Buffer<T> {
    fn layout(len: usize) -> Layout {
        let size = len.max(1) * std::mem::size_of::<T>();
        let align = if size >= HUGE {
            HUGE
        } else {
            std::mem::align_of::<T>().max(64)
        };
        Layout::from_size_align(size, align).expect("buffer size overflows")
    }

    /// `len` zeroed elements.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        let huge = layout.size() >= HUGE;
        // SAFETY: the layout has a non-zero size. A huge buffer is zeroed below, after the
        // advice, so that its first touch already faults in huge pages.
        let raw = unsafe {
            if huge {
                alloc(layout)
            } else {
                alloc_zeroed(layout)
            }
        };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            handle_alloc_error(layout)
        };
        if huge {
            #[cfg(target_os = "linux")]
            // SAFETY: the range is exactly our own allocation; the advice only changes how the
            // kernel backs it, never its contents. A refusal is harmless, so the result is ignored.
            unsafe {
                libc::madvise(raw.cast(), layout.size(), libc::MADV_HUGEPAGE);
            }
            // SAFETY: `raw` is valid for `layout.size()` bytes of writes.
            unsafe { std::ptr::write_bytes(raw, 0, layout.size()) };
        }
        Self {
            ptr,
            len,
            _owns: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        Self::layout(self.len).size()
    }
}

impl<T: Zeroable> std::ops::Deref for Buffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialised (zeroed or since written) elements we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> std::ops::DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> Drop for Buffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), Self::layout(self.len)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_huge_buffers_are_zeroed_and_writable() {
        for len in [0usize, 1, 1000, (4 << 20) / 4] {
            let mut b = Buffer::<u32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
            if len * 4 >= HUGE {
                assert_eq!(b.ptr.as_ptr() as usize % HUGE, 0);
            }
        }
    }
}
