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

use std::cell::Cell;

use storage::Storage;

/// How much the file is grown at a time, at most (the image's virtual size bounds it, so a
/// small image does not grow a large tail).
const STEP: u64 = 64 << 20;

/// How far the image file has been grown ahead of its allocations; 0 when it is not grown
/// ahead (off, paused, or given up after the file system refused).
pub(crate) struct GrowAhead {
    to: Cell<u64>,
}

impl GrowAhead {
    /// Growing ahead for a file of `len` bytes, off where it does not pay: buffered files
    /// (the page cache already absorbs the allocation), file systems without cheap
    /// zeroing (growing would write the zeros), and images with subclusters: a write there
    /// fills only its subclusters and leaves the rest of the cluster a hole in the file,
    /// which is the disk space subclusters exist to save, while a range grown ahead keeps
    /// its blocks reserved for the whole cluster once the cluster is in use.
    pub(crate) fn new<S: Storage>(file: &S, len: u64, subclusters: bool) -> Self {
        let on = file.alignment() > 1 && file.zeroes_are_cheap() && !subclusters;
        GrowAhead {
            to: Cell::new(if on { len.max(1) } else { 0 }),
        }
    }

    /// Makes sure `file` (of image `name`, disk size `disk_size`) reaches `end`, the end of
    /// clusters just allocated, growing it a step ahead when it does not. Best effort: if the
    /// file system refuses, growing ahead stops and the writes extend the file themselves.
    pub(crate) async fn grow<S: Storage>(&self, file: &S, name: &str, disk_size: u64, end: u64) {
        let grown = self.to.get();
        if grown == 0 || end <= grown {
            return;
        }
        let step = STEP.min(disk_size.max(1 << 20));
        let target = end.div_ceil(step).saturating_mul(step).max(end);
        // Claim the range first: a concurrent allocation past it must not grow it again.
        self.to.set(target);
        if let Err(e) = file.write_zeroes_at(grown, target - grown, false).await {
            tracing::debug!(image = %name, error = %e, "cannot grow the image file ahead");
            self.to.set(0);
        }
    }

    /// Stops growing ahead until the returned guard is dropped, for metadata preallocation:
    /// its data clusters are never written, so every step grown ahead would keep reserved
    /// blocks in the middle of the file, which a close cannot give back. The guard resumes
    /// past everything allocated meanwhile (`file_end` when it is dropped), leaving the holes
    /// below it alone.
    pub(crate) fn pause<'a>(&'a self, file_end: &'a Cell<u64>) -> PausedGrowth<'a> {
        PausedGrowth {
            grow: self,
            file_end,
            resume: self.to.replace(0),
        }
    }

    /// Gives back what was grown ahead and never used: `file` ends again at `end`, the last
    /// allocated cluster (or where it ended when opened).
    pub(crate) async fn trim<S: Storage>(&self, file: &S, end: u64) -> std::io::Result<()> {
        let grown = self.to.get();
        if grown == 0 || grown <= end {
            return Ok(());
        }
        file.set_len(end).await?;
        self.to.set(end.max(1));
        Ok(())
    }

    /// The file was truncated to `end`: growing ahead, if on, goes on from there.
    pub(crate) fn truncated(&self, end: u64) {
        if self.to.get() != 0 {
            self.to.set(end.max(1));
        }
    }
}

/// Growing ahead held off (see [`GrowAhead::pause`]).
pub(crate) struct PausedGrowth<'a> {
    grow: &'a GrowAhead,
    file_end: &'a Cell<u64>,
    resume: u64,
}

impl Drop for PausedGrowth<'_> {
    fn drop(&mut self) {
        if self.resume != 0 {
            self.grow.to.set(self.resume.max(self.file_end.get()));
        }
    }
}
