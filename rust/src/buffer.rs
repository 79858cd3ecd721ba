//! A fixed-size, zero-initialised buffer that asks the kernel for transparent huge pages when it
//! is large.
//!
//! Rows and index entries are reached at random, so with 4 KiB pages nearly every access also
//! misses the TLB (and under virtualisation a page walk is expensive). numpy asks for huge pages
//! for its large arrays too; a table that did not would lose to a plain `take` for that reason
//! alone. Buffers of 2 MiB or more are aligned to 2 MiB and marked `MADV_HUGEPAGE` (Linux).
//! The kernel backs only whole aligned 2 MiB ranges with a huge page, so the tail of a 2.3 MiB
//! buffer would sit on 4 KiB pages, and a 1.99 MiB buffer would get none: a buffer that an
//! eighth or less of padding brings to a whole number of huge pages (a full row chunk, see
//! `shard.rs`) gets that padding; one that would need more (the last chunk of a shard while it
//! grows) keeps its size, and its tail stays on small pages.

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
    /// The memory is a mapping of its own (see [`map_huge`]), not the allocator's.
    mapped: bool,
    /// The kernel accepted `MADV_HUGEPAGE` for the whole buffer.
    huge: bool,
    _owns: PhantomData<T>,
}

// SAFETY: a `Buffer` owns its elements exclusively, like a `Box<[T]>`.
unsafe impl<T: Zeroable + Send> Send for Buffer<T> {}
// SAFETY: shared access only hands out `&[T]`, like a `Box<[T]>`.
unsafe impl<T: Zeroable + Sync> Sync for Buffer<T> {}

impl<T: Zeroable> Buffer<T> {
    fn layout(len: usize) -> Layout {
        let size = len.max(1) * std::mem::size_of::<T>();
        let whole = size.next_multiple_of(HUGE);
        let (size, align) = if whole - size <= whole / 8 {
            // Padding of an eighth or less makes it whole huge pages (a full row chunk).
            (whole, HUGE)
        } else if size >= HUGE {
            (size, HUGE)
        } else {
            (size, std::mem::align_of::<T>().max(64))
        };
        Layout::from_size_align(size, align).expect("buffer size overflows")
    }

    /// `len` zeroed elements.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        let huge = layout.align() == HUGE;
        if huge {
            if let Some((raw, advised)) = map_huge(layout.size()) {
                return Self {
                    ptr: raw.cast(),
                    len,
                    mapped: true,
                    huge: advised,
                    _owns: PhantomData,
                };
            }
        }
        Self::from_allocator(len)
    }

    /// `len` zeroed elements from the allocator: small buffers, and huge ones where no mapping
    /// could be made (the process's limit on mappings, say).
    fn from_allocator(len: usize) -> Self {
        let layout = Self::layout(len);
        let huge = layout.align() == HUGE;
        // A huge buffer is zeroed below, after the advice, so that its first touch already
        // faults in huge pages.
        // SAFETY: the layout has a non-zero size.
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
        let advised = huge && advise_huge(raw, layout.size());
        if huge {
            // SAFETY: `raw` is valid for `layout.size()` bytes of writes.
            unsafe { std::ptr::write_bytes(raw, 0, layout.size()) };
        }
        Self {
            ptr,
            len,
            mapped: false,
            huge: advised,
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

    /// Bytes in a range the kernel accepted `MADV_HUGEPAGE` for: all of [`Buffer::bytes`] or
    /// none (small buffers are never advised). The kernel backs such a range with huge pages
    /// where it has them; whether it did is its own accounting (`AnonHugePages` in smaps).
    pub fn huge_page_bytes(&self) -> usize {
        if self.huge {
            self.bytes()
        } else {
            0
        }
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
        if self.mapped {
            unmap_huge(self.ptr.cast(), layout.size());
        } else {
            // SAFETY: allocated in `from_allocator` with exactly this layout.
            unsafe { dealloc(self.ptr.as_ptr().cast(), layout) }
        }
    }
}

/// A mapping of its own for `size` zeroed bytes, aligned to 2 MiB and advised to be backed by
/// huge pages, and whether the kernel took that advice; `None` where none can be made (then the
/// allocator serves the buffer).
///
/// Such a buffer goes back to the kernel when dropped. Through the allocator, a freed huge buffer
/// (an index that grew, the last chunk of a shard that grew) stayed in its free lists, and the
/// 2 MiB alignment left gaps that other allocations then touched, so a table's resident memory
/// exceeded its own bytes by 5 to 30%. The kernel hands the pages out zeroed, and the rows' first
/// writes fault them in. A process may hold only so many mappings (`vm.max_map_count`, 65530 by
/// default: about 128 GiB of 2 MiB row chunks); past that the allocator serves huge buffers too.
#[cfg(target_os = "linux")]
fn map_huge(size: usize) -> Option<(NonNull<u8>, bool)> {
    let span = size.next_multiple_of(page_size());
    let total = span.checked_add(HUGE)?;
    // SAFETY: an anonymous private mapping of a fresh range; no existing memory is touched.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return None;
    }
    let start = map as usize;
    let aligned = start.next_multiple_of(HUGE);
    let end = aligned + span;
    // SAFETY: both trimmed ranges lie inside the mapping just made and outside the part kept
    // (`aligned .. end`), which nothing else refers to; a failure would only leave them mapped.
    unsafe {
        if aligned > start {
            libc::munmap(map, aligned - start);
        }
        if start + total > end {
            libc::munmap(end as *mut libc::c_void, start + total - end);
        }
    }
    let advised = advise_huge(aligned as *mut u8, span);
    NonNull::new(aligned as *mut u8).map(|p| (p, advised))
}

#[cfg(not(target_os = "linux"))]
fn map_huge(_size: usize) -> Option<(NonNull<u8>, bool)> {
    None
}

/// Returns a mapping of [`map_huge`] of `size` bytes to the kernel.
fn unmap_huge(ptr: NonNull<u8>, size: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: `ptr .. ptr + size` rounded to pages is the range `map_huge` kept mapped, and the
    // buffer that owned it is gone.
    unsafe {
        libc::munmap(ptr.as_ptr().cast(), size.next_multiple_of(page_size()));
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, size);
}

/// Asks the kernel to back `ptr .. ptr + size` with huge pages (Linux); whether it accepted
/// (a kernel without transparent huge pages, or with them `never`, refuses: harmless).
fn advise_huge(ptr: *mut u8, size: usize) -> bool {
    #[cfg(target_os = "linux")]
    // SAFETY: the range is memory of ours; the advice only changes how the kernel backs it,
    // never its contents.
    unsafe {
        libc::madvise(ptr.cast(), size, libc::MADV_HUGEPAGE) == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, size);
        false
    }
}

/// The size of a small page, the granularity of a mapping.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_huge_buffers_are_zeroed_and_writable() {
        for len in [0usize, 1, 1000, (4 << 20) / 4, 7281 * 72] {
            let mut b = Buffer::<u32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
            if len * 4 >= HUGE {
                // Aligned and a whole number of huge pages, so no tail is left on small pages.
                assert_eq!(b.ptr.as_ptr() as usize % HUGE, 0);
                assert_eq!(b.bytes() % HUGE, 0);
                assert!(b.bytes() >= len * 4 && b.bytes() < len * 4 + HUGE);
                assert_eq!(b.mapped, cfg!(target_os = "linux"));
            }
        }
        // Padding to whole huge pages only where it is small: 2.36 MiB stays as it is.
        let b = Buffer::<u32>::zeroed(8192 * 72);
        assert_eq!(b.bytes(), 8192 * 72 * 4);
        // A huge buffer from the allocator (where no mapping can be made) works the same way.
        let mut b = Buffer::<u32>::from_allocator(7281 * 72);
        assert!(!b.mapped && b.iter().all(|&x| x == 0));
        assert_eq!(b.ptr.as_ptr() as usize % HUGE, 0);
        b[7281 * 72 - 1] = 3;
        assert_eq!(b.bytes(), HUGE);
        drop(b);
        // Just under one huge page (a full chunk of 9-word rows): padded to it, and aligned.
        let b = Buffer::<u32>::zeroed(58_254 * 9);
        assert_eq!(b.bytes(), HUGE);
        assert_eq!(b.ptr.as_ptr() as usize % HUGE, 0);
    }

    #[test]
    fn huge_page_bytes_count_only_advised_buffers() {
        // A kernel with transparent huge pages accepts the advice (whatever its policy).
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists();
        for b in [
            Buffer::<u32>::zeroed(4 << 20),
            Buffer::<u32>::from_allocator(4 << 20),
        ] {
            assert_eq!(b.huge_page_bytes(), if thp { b.bytes() } else { 0 });
        }
        // Small buffers are never advised.
        assert_eq!(Buffer::<u32>::zeroed(1000).huge_page_bytes(), 0);
        assert_eq!(Buffer::<u64>::zeroed(16).huge_page_bytes(), 0);
    }
}
