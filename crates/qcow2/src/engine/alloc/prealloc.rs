//! Growing the image file ahead of its allocations, like QEMU's `preallocate` filter (which
//! qemu-nbd does not use by default).
//!
//! With `O_DIRECT`, a write past the end of the file is an extending write: the file system
//! takes the inode lock exclusively and (ext4) completes the write synchronously under it, so
//! allocating writes at queue depth run one at a time. Growing the file ahead turns them into
//! writes inside the file. Two ways, by what the image needs:
//!
//! - *Zeroed* (standard clusters): the range grown ahead gets unwritten extents
//!   (`FALLOC_FL_ZERO_RANGE`), so allocating writes are plain overwrites that io_uring issues
//!   without a kernel worker. Every cluster is written whole once allocated, so the blocks
//!   reserved ahead are used.
//! - *Sparse* (images with subclusters, and file systems without cheap zeroing): only the
//!   file's length moves ahead (`ftruncate`, no blocks). A write fills just its subclusters
//!   and the rest of its cluster stays a hole, the disk space subclusters exist to save; the
//!   write still allocates blocks, but inside the file, which the file system does not
//!   serialise the way it does extending writes.
//!
//! Either way the range holds zeros that nothing references, so it changes nothing an image
//! reader sees; a clean close truncates it away, and a crash leaves only unreferenced trailing
//! zeros, which `qemu-img check` accepts and the next writer allocates from.

use std::cell::Cell;

use storage::Storage;

/// How much the file is grown at a time with reserved blocks, at most (the image's virtual
/// size bounds it, so a small image does not grow a large tail).
const STEP: u64 = 64 << 20;

/// How much the file's length is moved ahead at a time when it grows sparsely, at most (also
/// bounded by the virtual size). Moving the length costs no blocks, but it takes the inode
/// lock exclusively and waits for every direct write in flight, so each step stalls the
/// whole queue once: long steps keep that rare.
const SPARSE_STEP: u64 = 1 << 30;

/// How the file grows ahead (see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Growth {
    /// Unwritten extents: the blocks are reserved.
    Zeroed,
    /// The length only: no blocks.
    Sparse,
}

/// How far the image file has been grown ahead of its allocations; 0 when it is not grown
/// ahead (off, paused, or given up after the file system refused).
pub(crate) struct GrowAhead {
    to: Cell<u64>,
    how: Growth,
}

impl GrowAhead {
    /// Growing ahead for a file of `len` bytes with clusters of `cluster_size`, off for
    /// buffered files (the page cache already absorbs extending writes). Images with
    /// subclusters grow sparsely: a range grown with reserved blocks would keep every
    /// cluster's blocks once the cluster is in use, where a subcluster's write must leave the
    /// rest of its cluster a hole. So do files on a file system without cheap zeroing
    /// (growing would write the zeros). Growth starts at the first whole cluster: a file that
    /// ends inside its last cluster (a new image ends with its L1 table) keeps that
    /// cluster's unused tail a hole, as QEMU leaves it.
    pub(super) fn new<S: Storage>(
        file: &S,
        len: u64,
        cluster_size: u64,
        subclusters: bool,
    ) -> Self {
        let on = file.alignment() > 1;
        let len = len
            .div_ceil(cluster_size.max(1))
            .saturating_mul(cluster_size.max(1));
        let how = if subclusters || !file.zeroes_are_cheap() {
            Growth::Sparse
        } else {
            Growth::Zeroed
        };
        GrowAhead {
            to: Cell::new(if on { len.max(1) } else { 0 }),
            how,
        }
    }

    /// Makes sure `file` (of image `name`, disk size `disk_size`) reaches `end`, the end of
    /// clusters just allocated, growing it a step ahead when it does not. Best effort: if the
    /// file system refuses, growing ahead stops and the writes extend the file themselves.
    pub(super) async fn grow<S: Storage>(&self, file: &S, name: &str, disk_size: u64, end: u64) {
        let grown = self.to.get();
        if grown == 0 || end <= grown {
            return;
        }
        let most = match self.how {
            Growth::Zeroed => STEP,
            Growth::Sparse => SPARSE_STEP,
        };
        let step = most.min(disk_size.max(1 << 20));
        let target = end.div_ceil(step).saturating_mul(step).max(end);
        // Claim the range first: a concurrent allocation past it must not grow it again.
        self.to.set(target);
        let done = match self.how {
            Growth::Zeroed => file.write_zeroes_at(grown, target - grown, false).await,
            // Only ever longer: a write that extended the file past `grown` meanwhile lies
            // below `target` (its cluster was allocated before this claim).
            Growth::Sparse => file.set_len(target).await,
        };
        if let Err(e) = done {
            tracing::debug!(image = %name, error = %e, "cannot grow the image file ahead");
            self.to.set(0);
        }
    }

    /// Stops growing ahead until the returned guard is dropped, for metadata preallocation:
    /// its data clusters are never written, so every step grown ahead would keep reserved
    /// blocks in the middle of the file, which a close cannot give back. The guard resumes
    /// past everything allocated meanwhile (`file_end` when it is dropped), leaving the holes
    /// below it alone.
    pub(super) fn pause<'a>(&'a self, file_end: &'a Cell<u64>) -> PausedGrowth<'a> {
        PausedGrowth {
            grow: self,
            file_end,
            resume: self.to.replace(0),
        }
    }

    /// Gives back what was grown ahead and never used: `file` ends again at `end`, the last
    /// allocated cluster (or where it ended when opened).
    pub(super) async fn trim<S: Storage>(&self, file: &S, end: u64) -> std::io::Result<()> {
        let grown = self.to.get();
        if grown == 0 || grown <= end {
            return Ok(());
        }
        file.set_len(end).await?;
        self.to.set(end.max(1));
        Ok(())
    }

    /// The file was truncated to `end`: growing ahead, if on, goes on from there.
    pub(super) fn truncated(&self, end: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::io;
    use storage::{BufResult, Slice};

    /// An O_DIRECT file with cheap zeroing that records the ranges it is asked to zero.
    #[derive(Default)]
    struct Recorder {
        zeroed: RefCell<Vec<(u64, u64)>>,
        len: Cell<u64>,
    }

    impl Storage for Recorder {
        async fn read_at(&self, buf: Slice, _: u64) -> BufResult<Slice> {
            (Err(io::Error::other("not read here")), buf)
        }
        async fn write_at(&self, buf: Slice, _: u64) -> BufResult<Slice> {
            (Err(io::Error::other("not written here")), buf)
        }
        async fn write_zeroes_at(&self, offset: u64, len: u64, _: bool) -> io::Result<()> {
            self.zeroed.borrow_mut().push((offset, len));
            self.len.set(self.len.get().max(offset + len));
            Ok(())
        }
        async fn discard_at(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
        async fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        async fn len(&self) -> io::Result<u64> {
            Ok(self.len.get())
        }
        async fn set_len(&self, len: u64) -> io::Result<()> {
            self.len.set(len);
            Ok(())
        }
        fn zeroes_are_cheap(&self) -> bool {
            true
        }
        fn alignment(&self) -> usize {
            4096
        }
    }

    #[test]
    fn growth_starts_at_the_first_whole_cluster_past_the_files_end() {
        const CS: u64 = 65536;
        // A new image: header, refcount table and block, then an L1 table of 256 bytes.
        let end_of_l1 = 3 * CS + 256;
        let file = Recorder::default();
        file.len.set(end_of_l1);
        let grow = GrowAhead::new(&file, end_of_l1, CS, false);
        test_support::run(grow.grow(&file, "a.qcow2", 16 << 30, 5 * CS));
        let zeroed = file.zeroed.borrow().clone();
        assert_eq!(zeroed.len(), 1, "{zeroed:?}");
        assert_eq!(zeroed[0].0, 4 * CS, "the L1 table's cluster is left alone");
        assert!(zeroed[0].0 + zeroed[0].1 >= 5 * CS);
    }
}
