//! A fixed-size, zero-initialised buffer that asks the kernel for transparent huge pages when it
//! is large.
//!
//! Rows and index entries are reached at random, so with 4 KiB pages nearly every access also
//! misses the TLB (and under virtualisation a page walk is expensive). numpy asks for huge pages
//! for its large arrays too; a table that did not would lose to a plain `take` for that reason
//! alone. Buffers of 2 MiB or more are aligned to 2 MiB and marked `MADV_HUGEPAGE` (Linux).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
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
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE {
            return Self::mapped(len, layout);
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            handle_alloc_error(layout)
        };
        Self {
            ptr,
            len,
            _owns: PhantomData,
        }
    }

    /// A huge buffer straight from the kernel: an anonymous mapping aligned to 2 MiB and marked
    /// `MADV_HUGEPAGE`. It reads as zero until written and is faulted in, as huge pages, on first
    /// touch, so nothing is written here (an aligned allocation is zeroed in full first: a
    /// second pass over memory that every row then writes anyway). Smaller buffers come from the
    /// allocator, whose recycled memory is faulted in already (measured: mapping those too was
    /// slower).
    #[cfg(target_os = "linux")]
    fn mapped(len: usize, layout: Layout) -> Self {
        let size = layout.size();
        let span = size + HUGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            handle_alloc_error(layout)
        }
        let start = raw as usize;
        let aligned = (start + HUGE - 1) & !(HUGE - 1);
        let end = start + span;
        let used_end = aligned + Self::mapped_size(size);
        // SAFETY: both ranges lie inside the mapping just made and outside the part kept; a
        // failed unmap only leaves address space reserved.
        unsafe {
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            if end > used_end {
                libc::munmap(used_end as *mut libc::c_void, end - used_end);
            }
            // A refusal is harmless (small pages then), so the result is ignored.
            libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        Self {
            ptr: NonNull::new(aligned as *mut T).expect("mmap gave a non-null address"),
            len,
            _owns: PhantomData,
        }
    }

    /// The bytes mapped for a huge buffer of `size` bytes (whole pages).
    #[cfg(target_os = "linux")]
    fn mapped_size(size: usize) -> usize {
        size.div_ceil(4096) * 4096
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
        let layout = Self::layout(self.len);
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE {
            // SAFETY: mapped in `mapped` with exactly this size, and unmapped only here.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), Self::mapped_size(layout.size()));
            }
            return;
        }
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_huge_buffers_are_zeroed_and_writable() {
        for len in [0usize, 1, 1000, (300 << 10) / 4, (4 << 20) / 4] {
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
