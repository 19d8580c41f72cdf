//! The bytes of one cache: a private anonymous mapping cut into equal slots. Pages of slots
//! nobody has touched cost no memory, and pages of slots that were emptied can be handed back
//! to the kernel (`MADV_DONTNEED`), which is how idle cleaning really shrinks the process.

use std::io;
use std::ptr::NonNull;

/// A mapping of `slots * entry_size` bytes (rounded up to whole pages).
pub(crate) struct Arena {
    base: NonNull<u8>,
    map_len: usize,
    entry_size: usize,
    slots: usize,
    page_size: usize,
}

fn page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}

impl Arena {
    /// Map room for `slots` entries of `entry_size` bytes; nothing is resident yet.
    pub(crate) fn new(entry_size: usize, slots: usize) -> io::Result<Self> {
        let page_size = page_size();
        let map_len = entry_size
            .checked_mul(slots)
            .and_then(|len| len.checked_next_multiple_of(page_size))
            .filter(|&len| len > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "arena size overflows"))?;
        // SAFETY: a fresh private anonymous mapping at an address of the kernel's choosing:
        // it aliases no Rust object, and every argument is valid for mmap.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Self {
            base,
            map_len,
            entry_size,
            slots,
            page_size,
        })
    }

    /// The bytes of slot `idx` (`idx < slots`, checked).
    ///
    /// # Safety
    /// While the returned slice is alive, no other reference to the same slot may exist, and
    /// `release` may not be called on a range that contains the slot.
    #[allow(clippy::mut_from_ref)] // exclusivity per slot is the caller's contract, see above
    pub(crate) unsafe fn slot_mut(&self, idx: usize) -> &mut [u8] {
        assert!(idx < self.slots, "slot {idx} out of {}", self.slots);
        // SAFETY: idx < slots, so the range [idx * entry_size, (idx + 1) * entry_size) lies
        // inside the mapping, which lives as long as `self`; the caller guarantees that no
        // other reference to these bytes exists while this one does.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.as_ptr().add(idx * self.entry_size),
                self.entry_size,
            )
        }
    }

    /// Return the pages lying wholly inside slots `first .. first + count` to the kernel;
    /// they read as zeros afterwards and cost no memory until written again.
    ///
    /// # Safety
    /// No reference to any of these slots may be alive.
    pub(crate) unsafe fn release(&self, first: usize, count: usize) -> io::Result<()> {
        let end_slot = first.saturating_add(count).min(self.slots);
        let start = (first * self.entry_size).next_multiple_of(self.page_size);
        let end = end_slot * self.entry_size / self.page_size * self.page_size;
        if start >= end {
            return Ok(());
        }
        // SAFETY: [start, end) is page-aligned and inside the mapping; the caller guarantees
        // no live reference into it, so replacing its contents by zero pages is unobservable
        // to safe code.
        let rc = unsafe {
            libc::madvise(
                self.base.as_ptr().add(start).cast(),
                end - start,
                libc::MADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: base/map_len describe the mapping made in `new`; slices into it borrow
        // `self`, so none outlives this drop.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.map_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_and_zeroed_after_release() {
        let per_page = page_size() / 512;
        let slots = 3 * per_page;
        let arena = Arena::new(512, slots).expect("map");
        let pattern = |i: usize| u8::try_from(i % 251 + 1).expect("small");
        for i in 0..slots {
            // SAFETY: one slot reference at a time.
            let slot = unsafe { arena.slot_mut(i) };
            assert!(slot.iter().all(|&b| b == 0));
            slot.fill(pattern(i));
        }
        // Slots 1 ..= 2 * per_page cover the second page wholly, the others only in part.
        // SAFETY: no slot reference is alive.
        unsafe { arena.release(1, 2 * per_page) }.expect("madvise");
        for i in 0..slots {
            // SAFETY: one slot reference at a time.
            let slot = unsafe { arena.slot_mut(i) };
            let released = (per_page..2 * per_page).contains(&i);
            let expected = if released { 0 } else { pattern(i) };
            assert!(slot.iter().all(|&b| b == expected), "slot {i}");
        }
    }

    #[test]
    fn empty_arena_is_an_error() {
        assert!(Arena::new(4096, 0).is_err());
        assert!(Arena::new(usize::MAX, 2).is_err());
    }
}
