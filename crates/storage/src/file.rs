//! What every file backend shares: the [`Storage`] semantics (full transfers, zeros past EOF,
//! fallocate with fallbacks) and O_DIRECT handling, built on a small [`RawFile`] primitive set
//! that io_uring and the thread pool each implement.
//!
//! O_DIRECT: aligned requests go straight through. Unaligned reads use an aligned bounce
//! buffer. Unaligned writes read-modify-write the covering blocks while holding an exclusive
//! lock on them, and every other write, zeroing or discard locks its blocks too, so two
//! concurrent sub-block writes into one block cannot lose an update. A padded write past EOF
//! would leave the file longer than asked; the length is trimmed back to the furthest end any
//! issued operation asked for.

mod block_locks;

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::path::Path;

use block_locks::BlockLocks;

use crate::error::{checked_end, len_u64};
use crate::sys::{PUNCH_HOLE, ZERO_RANGE};
use crate::{BufResult, IoBuf, OpenOptions, Slice, Storage};

/// The primitive operations a file backend provides; [`FileStorage`] builds the rest.
#[allow(async_fn_in_trait)] // single-threaded by design
pub trait RawFile {
    /// One read into `buf` at `offset`; may be short, 0 at end of file.
    async fn read(&self, buf: Slice, offset: u64) -> (io::Result<usize>, Slice);
    /// One write of `buf` at `offset`; may be short.
    async fn write(&self, buf: Slice, offset: u64) -> (io::Result<usize>, Slice);
    /// `fallocate(mode, offset, len)`.
    async fn fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<()>;
    /// `fdatasync`.
    async fn fdatasync(&self) -> io::Result<()>;
    /// `ftruncate`.
    async fn set_len(&self, len: u64) -> io::Result<()>;
    /// The open file, for quick synchronous metadata calls (fstat).
    fn file(&self) -> &File;
}

/// Largest zero buffer written when fallocate cannot zero a range.
const ZERO_CHUNK: usize = 1 << 20;

/// A [`Storage`] over a file, generic over how raw I/O is performed.
pub struct FileStorage<R> {
    raw: R,
    /// 1 when buffered; the O_DIRECT offset/length alignment otherwise.
    align: u64,
    cheap_zeroes: Cell<bool>,
    locks: BlockLocks,
    /// O_DIRECT: the length the file would have if every issued operation completed; padded
    /// read-modify-write never leaves the file longer than this.
    logical_end: Cell<u64>,
    /// tmpfs or ramfs: `SEEK_HOLE` walks every page up to the next hole there, so a data run
    /// is reported without looking for its end.
    memory_fs: bool,
    /// Counts modifications as they complete (writes, zeroing, discards, size changes,
    /// failed ones included: they may have changed part of the file).
    changes: Cell<u64>,
    /// The count of modifications the last successful `fdatasync` covers: a flush with
    /// nothing new to make durable skips the call, as QEMU's block layer does, so closing an
    /// image that was only read costs no disk flush.
    synced: Cell<u64>,
    /// Opened with [`OpenOptions::ignore_flush`]: flushes do nothing.
    ignore_flush: bool,
}

/// What a file storage learns about its file once, when it is opened: on a file system that
/// does not answer these calls block too, so the bounded open makes them off the caller's
/// thread ([`open_file`]).
#[derive(Debug, Clone, Copy)]
pub struct FileFacts {
    /// 1 when buffered; the O_DIRECT offset/length alignment otherwise.
    align: u64,
    cheap_zeroes: bool,
    size: u64,
    memory_fs: bool,
    ignore_flush: bool,
}

impl FileFacts {
    /// The facts of `file`; `direct` says it was opened with O_DIRECT.
    pub fn of(file: &File, direct: bool) -> FileFacts {
        FileFacts {
            align: if direct {
                len_u64(crate::sys::direct_alignment(file))
            } else {
                1
            },
            cheap_zeroes: crate::sys::fs_has_cheap_zeroes(file),
            size: file.metadata().map(|m| m.len()).unwrap_or(0),
            memory_fs: crate::sys::fs_is_memory(file),
            ignore_flush: false,
        }
    }

    /// The file lives in memory (tmpfs, ramfs).
    pub fn memory_fs(&self) -> bool {
        self.memory_fs
    }
}

/// Opens `path` as `opts` asks (a regular file or a block device, locked) and learns its
/// facts, all on a thread of its own within `opts.bound` ([`crate::bounded`]).
pub async fn open_file(path: &Path, opts: OpenOptions) -> io::Result<(File, FileFacts)> {
    let owned = path.to_path_buf();
    crate::bounded::run("opening", path, opts.bound, move || {
        let file = crate::sys::open(&owned, opts)?;
        let facts = FileFacts {
            ignore_flush: opts.ignore_flush,
            ..FileFacts::of(&file, opts.direct)
        };
        Ok((file, facts))
    })
    .await
}

impl<R: RawFile> FileStorage<R> {
    /// Wrap `raw`; `direct` says it was opened with O_DIRECT (alignment is then detected).
    pub fn from_file(raw: R, direct: bool) -> FileStorage<R> {
        let facts = FileFacts::of(raw.file(), direct);
        FileStorage::with_facts(raw, facts)
    }

    /// Wrap `raw`, whose facts are known.
    pub fn with_facts(raw: R, facts: FileFacts) -> FileStorage<R> {
        FileStorage {
            raw,
            align: facts.align,
            cheap_zeroes: Cell::new(facts.cheap_zeroes),
            locks: BlockLocks::default(),
            logical_end: Cell::new(facts.size),
            memory_fs: facts.memory_fs,
            changes: Cell::new(0),
            synced: Cell::new(0),
            ignore_flush: facts.ignore_flush,
        }
    }

    /// The underlying raw file.
    pub fn raw(&self) -> &R {
        &self.raw
    }

    fn direct(&self) -> bool {
        self.align > 1
    }

    /// How many modifications completed, and how many of them the last `fdatasync` covers.
    #[cfg(test)]
    pub(crate) fn sync_counts(&self) -> (u64, u64) {
        (self.changes.get(), self.synced.get())
    }

    fn is_aligned(&self, offset: u64, len: usize) -> bool {
        offset % self.align == 0 && len_u64(len) % self.align == 0
    }

    /// O_DIRECT also needs the memory address aligned (IoBuf is; a sub-slice may not be).
    fn slice_aligned(&self, buf: &Slice) -> bool {
        self.is_aligned(len_u64(buf.as_ptr().addr()), buf.len())
    }

    /// The blocks covering `[offset, end)` (O_DIRECT), as block indices.
    fn blocks(&self, offset: u64, end: u64) -> std::ops::Range<u64> {
        offset / self.align..end.div_ceil(self.align)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.raw.file().metadata()?.len())
    }

    fn note_end(&self, end: u64) {
        self.logical_end.set(self.logical_end.get().max(end));
    }

    /// Read all of `buf` at `offset`, zero-filling past end of file.
    async fn read_full(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        let whole = buf.range();
        let mut done = 0usize;
        let mut buf = buf;
        while done < whole.len() {
            let part = buf.with_range(whole.start + done..whole.end);
            let (res, back) = self.raw.read(part, offset + len_u64(done)).await;
            buf = back;
            match res {
                Ok(0) => break,
                Ok(n) => {
                    done += n;
                    // O_DIRECT returns an unaligned count only at end of file.
                    if self.direct() && (offset + len_u64(done)) % self.align != 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return (
                        Err(at("read", offset, whole.len(), e)),
                        buf.with_range(whole),
                    )
                }
            }
        }
        let mut buf = buf.with_range(whole);
        let len = buf.len();
        buf[done.min(len)..].fill(0);
        (Ok(()), buf)
    }

    /// Write all of `buf` at `offset`.
    async fn write_full(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        let whole = buf.range();
        let mut done = 0usize;
        let mut buf = buf;
        while done < whole.len() {
            let part = buf.with_range(whole.start + done..whole.end);
            let (res, back) = self.raw.write(part, offset + len_u64(done)).await;
            buf = back;
            match res {
                Ok(0) => {
                    let e = io::Error::new(io::ErrorKind::WriteZero, "write returned 0");
                    return (
                        Err(at("write", offset, whole.len(), e)),
                        buf.with_range(whole),
                    );
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return (
                        Err(at("write", offset, whole.len(), e)),
                        buf.with_range(whole),
                    )
                }
            }
        }
        (Ok(()), buf.with_range(whole))
    }

    /// Read through an aligned bounce buffer covering `[offset, offset+len)`.
    async fn read_bounced(&self, mut buf: Slice, offset: u64) -> BufResult<Slice> {
        let end = offset + len_u64(buf.len());
        let start = offset - offset % self.align;
        let bounce_len = end.next_multiple_of(self.align) - start;
        let Ok(n) = usize::try_from(bounce_len) else {
            return (Err(too_big("read_at", offset)), buf);
        };
        let (res, bounce) = self.read_full(IoBuf::zeroed(n).into(), start).await;
        if let Err(e) = res {
            return (Err(e), buf);
        }
        let skip = usize::try_from(offset - start).unwrap_or(0);
        let len = buf.len();
        buf.copy_from_slice(&bounce[skip..skip + len]);
        (Ok(()), buf)
    }

    /// O_DIRECT write of an unaligned range; the caller holds the lock on its blocks.
    async fn write_rmw(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset + len_u64(buf.len());
        let start = offset - offset % self.align;
        let aligned_end = end.next_multiple_of(self.align);
        let n = usize::try_from(aligned_end - start).map_err(|_| too_big("write_at", offset))?;
        let block = usize::try_from(self.align).map_err(|_| too_big("write_at", offset))?;
        let mut bounce = Slice::from(IoBuf::zeroed(n));
        if offset != start {
            let (res, back) = self.read_full(bounce.with_range(0..block), start).await;
            res?;
            bounce = back;
        }
        if end != aligned_end && (n > block || offset == start) {
            let (res, back) = self
                .read_full(bounce.with_range(n - block..n), aligned_end - self.align)
                .await;
            res?;
            bounce = back;
        }
        let mut bounce = bounce.with_range(0..n);
        let skip = usize::try_from(offset - start).unwrap_or(0);
        bounce[skip..skip + buf.len()].copy_from_slice(buf);
        let (res, _) = self.write_full(bounce, start).await;
        res?;
        if aligned_end > end {
            self.trim_padding()?;
        }
        Ok(())
    }

    /// Cut the zero padding a read-modify-write appended past the intended end of file.
    ///
    /// Synchronous on purpose: between deciding the length and truncating, no other operation
    /// may be issued, or one extending the file could be cut.
    fn trim_padding(&self) -> io::Result<()> {
        let target = self.logical_end.get();
        if self.size()? > target {
            self.raw.file().set_len(target)?;
        }
        Ok(())
    }

    /// Write `buf`, assuming the O_DIRECT block lock (if any) is held.
    async fn write_locked(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if !self.direct() || self.slice_aligned(&buf) && self.is_aligned(offset, buf.len()) {
            return self.write_full(buf, offset).await;
        }
        let res = self.write_rmw(&buf, offset).await;
        (res, buf)
    }

    /// Write zeros with plain writes (fallocate could not); the lock (if any) is held.
    async fn write_zero_data(&self, offset: u64, len: u64) -> io::Result<()> {
        let chunk = len.min(len_u64(ZERO_CHUNK));
        let Ok(chunk) = usize::try_from(chunk) else {
            return Err(too_big("write_zeroes_at", offset));
        };
        let mut buf = IoBuf::zeroed(chunk);
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = usize::try_from((end - pos).min(len_u64(chunk))).unwrap_or(chunk);
            let (res, back) = self.write_locked(buf.slice(0..n), pos).await;
            res?;
            buf = back.into_inner();
            buf[..n].fill(0);
            pos += len_u64(n);
        }
        Ok(())
    }

    /// Extend the file to at least `end` without ever shrinking it (a concurrent write may
    /// have grown it meanwhile): one zero byte at `end - 1`, inside the caller's range.
    async fn extend_to(&self, end: u64) -> io::Result<()> {
        if end == 0 || self.size()? >= end {
            return Ok(());
        }
        self.write_zero_data(end - 1, 1).await
    }

    /// fallocate `mode`; `Ok(false)` when the file system does not support it.
    async fn try_fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<bool> {
        match self.raw.fallocate(mode, offset, len).await {
            Ok(()) => Ok(true),
            Err(e) if crate::sys::is_unsupported(&e) => Ok(false),
            Err(e) => Err(at("fallocate", offset, usize::MAX, e)),
        }
    }

    async fn zero_locked(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        if unmap && self.try_fallocate(PUNCH_HOLE, offset, len).await? {
            return self.extend_to(offset + len).await;
        }
        if self.try_fallocate(ZERO_RANGE, offset, len).await? {
            return Ok(());
        }
        if !unmap && self.try_fallocate(PUNCH_HOLE, offset, len).await? {
            return self.extend_to(offset + len).await;
        }
        self.cheap_zeroes.set(false);
        self.write_zero_data(offset, len).await
    }
}

impl<R: RawFile> FileStorage<R> {
    /// Records that a modification completed (see `changes`).
    fn note_change(&self) {
        self.changes.set(self.changes.get() + 1);
    }
}

fn too_big(op: &str, offset: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{op} at offset {offset}: request too large for this platform"),
    )
}

/// Add the operation and range to an OS error, keeping its kind.
fn at(op: &str, offset: u64, len: usize, e: io::Error) -> io::Error {
    let len = if len == usize::MAX {
        String::new()
    } else {
        format!(" (length {len})")
    };
    io::Error::new(e.kind(), format!("{op} at offset {offset}{len}: {e}"))
}

impl<R: RawFile> Storage for FileStorage<R> {
    fn allocated_size(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        let m = self.raw.file().metadata().ok()?;
        m.blocks().checked_mul(512)
    }

    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let (data, mut end) = crate::sys::data_run(self.raw.file(), offset, !self.memory_fs)?;
        if data && end != u64::MAX {
            // With O_DIRECT, QEMU's file driver answers in whole blocks: a data run that ends
            // at an end of file inside a block reaches that block's end.
            end = end.checked_next_multiple_of(self.align).unwrap_or(end);
        }
        Ok((data, end.saturating_sub(offset).min(len).max(1).min(len)))
    }

    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if let Err(e) = checked_end("read_at", offset, len_u64(buf.len())) {
            return (Err(e.into()), buf);
        }
        if buf.is_empty() {
            return (Ok(()), buf);
        }
        if !self.direct() || self.slice_aligned(&buf) && self.is_aligned(offset, buf.len()) {
            self.read_full(buf, offset).await
        } else {
            self.read_bounced(buf, offset).await
        }
    }

    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        let end = match checked_end("write_at", offset, len_u64(buf.len())) {
            Ok(end) => end,
            Err(e) => return (Err(e.into()), buf),
        };
        if buf.is_empty() {
            return (Ok(()), buf);
        }
        let done = if !self.direct() {
            self.write_full(buf, offset).await
        } else {
            let _guard = self.locks.lock(self.blocks(offset, end)).await;
            self.note_end(end);
            self.write_locked(buf, offset).await
        };
        self.note_change();
        done
    }

    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        let end = checked_end("write_zeroes_at", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let _guard = if self.direct() {
            self.note_end(end);
            Some(self.locks.lock(self.blocks(offset, end)).await)
        } else {
            None
        };
        let done = self.zero_locked(offset, len, unmap).await;
        self.note_change();
        done
    }

    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        checked_end("discard_at", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let _guard = if self.direct() {
            Some(self.locks.lock(self.blocks(offset, offset + len)).await)
        } else {
            None
        };
        // Best effort: a file system without hole punching keeps the data, which is allowed.
        let done = self.try_fallocate(PUNCH_HOLE, offset, len).await.map(drop);
        self.note_change();
        done
    }

    async fn flush(&self) -> io::Result<()> {
        // Only modifications complete now are the flush's to make durable (as for a flush
        // request over NBD); one completing during the fdatasync counts after it.
        let covered = self.changes.get();
        if covered == self.synced.get() || self.ignore_flush {
            return Ok(());
        }
        self.raw
            .fdatasync()
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("fdatasync: {e}")))?;
        self.synced.set(self.synced.get().max(covered));
        Ok(())
    }

    async fn len(&self) -> io::Result<u64> {
        if self.direct() {
            // A padded read-modify-write may be in flight; never report its padding.
            return Ok(self.size()?.min(self.logical_end.get()));
        }
        self.size()
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        checked_end("set_len", len, 0)?;
        self.logical_end.set(len);
        let done = self
            .raw
            .set_len(len)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("set_len to {len}: {e}")));
        self.note_change();
        done
    }

    fn zeroes_are_cheap(&self) -> bool {
        self.cheap_zeroes.get()
    }

    fn alignment(&self) -> usize {
        usize::try_from(self.align).unwrap_or(1)
    }
}
