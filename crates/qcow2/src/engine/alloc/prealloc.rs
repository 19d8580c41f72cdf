//! Growing the image file ahead of its allocations, like QEMU's `preallocate` filter (which
//! qemu-nbd does not use by default).
//!
//! With `O_DIRECT`, a write past the end of the file, or into a hole, has to allocate blocks
//! and change the inode, so the file system takes the inode lock exclusively and io_uring
//! cannot issue it without blocking: every allocating write goes to a kernel worker, and the
//! workers queue on the lock. A file grown ahead with unwritten extents (`FALLOC_FL_ZERO_RANGE`)
//! takes those writes as overwrites instead. The extra space holds zeros that nothing
//! references, so it changes nothing an image reader sees; a clean close truncates it away,
//! and a crash leaves only unreferenced trailing zeros, which `qemu-img check` accepts.

use super::Allocator;
use storage::Storage;

/// How much the file is grown at a time, at most (the image's virtual size bounds it, so a
/// small image does not grow a large tail).
const STEP: u64 = 64 << 20;

/// Where growing ahead starts for a file of `len` bytes, or 0 (off) where it does not pay:
/// buffered files (the page cache already absorbs the allocation) and file systems without
/// cheap zeroing (growing would write the zeros).
pub(super) fn start<S: Storage>(file: &S, len: u64) -> u64 {
    if file.alignment() > 1 && file.zeroes_are_cheap() {
        len.max(1)
    } else {
        0
    }
}

impl<S: Storage + 'static> Allocator<S> {
    /// Makes sure the file reaches `end` (the end of clusters just allocated), growing it a
    /// step ahead when it does not. Best effort: if the file system refuses, growing ahead
    /// stops and the writes extend the file themselves, as without it.
    pub(super) async fn grow_ahead(&self, end: u64) {
        let grown = self.grown_to.get();
        if grown == 0 || end <= grown {
            return;
        }
        let step = STEP.min(self.top().size.get().max(1 << 20));
        let target = end.div_ceil(step).saturating_mul(step).max(end);
        // Claim the range first: a concurrent allocation past it must not grow it again.
        self.grown_to.set(target);
        let top = self.top();
        if let Err(e) = top.file.write_zeroes_at(grown, target - grown, false).await {
            tracing::debug!(image = %top.name, error = %e, "cannot grow the image file ahead");
            self.grown_to.set(0);
        }
    }

    /// Stops growing ahead until the returned guard is dropped, for metadata preallocation:
    /// its data clusters are never written, so every step grown ahead would keep reserved
    /// blocks in the middle of the file, which a close cannot give back. The guard resumes
    /// past everything allocated meanwhile, leaving the holes below it alone.
    pub(crate) fn pause_growth(&self) -> PausedGrowth<'_, S> {
        PausedGrowth {
            alloc: self,
            resume: self.grown_to.replace(0),
        }
    }

    /// Gives back what was grown ahead and never used: the file ends again with the last
    /// allocated cluster (or where it ended when opened).
    pub(crate) async fn trim_growth(&self) -> std::io::Result<()> {
        let grown = self.grown_to.get();
        let meta = self.meta();
        let end = meta.file_end.get().max(self.physical_len.get());
        if grown == 0 || grown <= end {
            return Ok(());
        }
        self.top().file.set_len(end).await?;
        self.grown_to.set(end.max(1));
        Ok(())
    }
}

/// Growing ahead held off (see [`Allocator::pause_growth`]).
pub(crate) struct PausedGrowth<'a, S: Storage + 'static> {
    alloc: &'a Allocator<S>,
    resume: u64,
}

impl<S: Storage + 'static> Drop for PausedGrowth<'_, S> {
    fn drop(&mut self) {
        if self.resume != 0 {
            let end = self.alloc.meta().file_end.get();
            self.alloc.grown_to.set(self.resume.max(end));
        }
    }
}
