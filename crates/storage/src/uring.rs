//! The io_uring file backend: every read, write, fallocate and fdatasync is an io_uring
//! operation submitted through the thread's [`Reactor`].

mod reactor;

pub use reactor::{Reactor, ReactorStats, DEFAULT_ENTRIES};

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::rc::Rc;

use io_uring::{opcode, types};

use crate::file::{FileStorage, RawFile};
use crate::{OpenOptions, Slice};
use reactor::Held;

/// Largest single read/write handed to the kernel (the SQE length is 32 bits); longer
/// requests are split by the short-transfer loop in [`FileStorage`].
const MAX_IO: usize = 1 << 30;

/// On a memory-backed file system, writes at least this long still go through the ring: the
/// kernel worker that takes them copies in parallel with this thread, which pays off once
/// the copy is much longer than the hand-off and wake-up (a bulk copy such as `convert`),
/// while the small writes of a busy server stay inline.
const INLINE_WRITE_MAX: usize = 256 << 10;

/// A file whose I/O goes through io_uring.
pub struct UringFile {
    file: Rc<File>,
    reactor: Reactor,
    /// Data reads and small writes are plain syscalls on this thread (see
    /// [`UringFile::new`] and [`INLINE_WRITE_MAX`]).
    inline: bool,
    /// On a memory-backed file system, one large write at a time goes to the ring: the file
    /// system serializes writers on the inode lock, so more kernel workers would only spin
    /// on it (a bulk copy then sometimes took four times as long).
    large_writes: tokio::sync::Mutex<()>,
}

/// io_uring-backed file storage.
pub type UringStorage = FileStorage<UringFile>;

impl UringStorage {
    /// Open `path` on the calling thread's reactor.
    pub async fn open(path: &Path, opts: OpenOptions) -> io::Result<UringStorage> {
        UringStorage::open_with(Reactor::current()?, path, opts).await
    }

    /// Open `path` (a regular file or a block device) within `opts.bound` on a given
    /// reactor (benchmarks compare reactor settings this way).
    pub async fn open_with(
        reactor: Reactor,
        path: &Path,
        opts: OpenOptions,
    ) -> io::Result<UringStorage> {
        let (file, facts) = crate::file::open_file(path, opts).await?;
        let raw = UringFile::with_memory_fs(reactor, file, facts.memory_fs());
        Ok(UringStorage::with_facts(raw, facts))
    }
}

impl UringFile {
    /// Wrap an open file. On a memory-backed file system a read or write is a copy that
    /// cannot wait for a device, but io_uring would still hand it to a kernel worker (those
    /// file systems refuse non-blocking I/O) and interrupt this thread on completion: there
    /// the data I/O is done inline instead, as the plain syscall, for a fraction of the CPU.
    pub fn new(reactor: Reactor, file: File) -> UringFile {
        let memory_fs = crate::sys::fs_is_memory(&file);
        UringFile::with_memory_fs(reactor, file, memory_fs)
    }

    /// Wrap an open file known to be (or not) on a memory-backed file system.
    pub fn with_memory_fs(reactor: Reactor, file: File, inline: bool) -> UringFile {
        UringFile {
            file: Rc::new(file),
            reactor,
            inline,
            large_writes: tokio::sync::Mutex::new(()),
        }
    }

    /// Whether data I/O runs inline rather than through the ring.
    pub fn is_inline(&self) -> bool {
        self.inline
    }

    fn fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    async fn run(
        &self,
        entry: io_uring::squeue::Entry,
        buf: Option<Slice>,
    ) -> (i32, Option<Slice>) {
        let held = Held {
            file: Rc::clone(&self.file),
            buf,
        };
        // SAFETY: callers build `entry` from `buf` (moved into `held`) and `self.file` (an Rc
        // clone of which is in `held`), so all memory and the descriptor it names outlive the
        // operation.
        unsafe { self.reactor.submit(entry, held) }.await
    }

    async fn run_plain(&self, entry: io_uring::squeue::Entry) -> io::Result<()> {
        let (res, _) = self.run(entry, None).await;
        cqe_result(res).map(drop)
    }

    /// Run an I/O on `buf`; the built entry references only the buffer's memory.
    async fn run_buf(
        &self,
        mut buf: Slice,
        build: impl FnOnce(*mut u8, u32) -> io_uring::squeue::Entry,
    ) -> (io::Result<usize>, Slice) {
        let len = u32::try_from(buf.len().min(MAX_IO)).unwrap_or(u32::MAX);
        let entry = build(buf.as_mut_ptr(), len);
        let range = buf.range();
        let (res, back) = self.run(entry, Some(buf)).await;
        // `run` always returns the buffer it was given once the operation has finished.
        let back = back.unwrap_or_else(|| unreachable_buffer(range));
        (cqe_result(res), back)
    }
}

/// The buffer handed to `run` comes back with its completion; an empty stand-in keeps this
/// path panic-free should that invariant ever break.
fn unreachable_buffer(range: std::ops::Range<usize>) -> Slice {
    tracing::error!("io_uring operation lost its buffer (range {range:?})");
    crate::IoBuf::zeroed(0).slice(0..0)
}

fn cqe_result(res: i32) -> io::Result<usize> {
    usize::try_from(res).map_err(|_| io::Error::from_raw_os_error(res.saturating_neg()))
}

impl RawFile for UringFile {
    async fn read(&self, mut buf: Slice, offset: u64) -> (io::Result<usize>, Slice) {
        if self.inline {
            let len = buf.len().min(MAX_IO);
            let res = crate::sys::pread(&self.file, &mut buf[..len], offset);
            return (res, buf);
        }
        let fd = self.fd();
        self.run_buf(buf, |ptr, len| {
            opcode::Read::new(fd, ptr, len).offset(offset).build()
        })
        .await
    }

    async fn write(&self, buf: Slice, offset: u64) -> (io::Result<usize>, Slice) {
        if self.inline && buf.len() < INLINE_WRITE_MAX {
            let len = buf.len().min(MAX_IO);
            let res = crate::sys::pwrite(&self.file, &buf[..len], offset);
            return (res, buf);
        }
        let _one_at_a_time = if self.inline {
            Some(self.large_writes.lock().await)
        } else {
            None
        };
        let fd = self.fd();
        self.run_buf(buf, |ptr, len| {
            opcode::Write::new(fd, ptr, len).offset(offset).build()
        })
        .await
    }

    async fn fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<()> {
        let entry = opcode::Fallocate::new(self.fd(), len)
            .offset(offset)
            .mode(mode)
            .build();
        self.run_plain(entry).await
    }

    async fn fdatasync(&self) -> io::Result<()> {
        let entry = opcode::Fsync::new(self.fd())
            .flags(types::FsyncFlags::DATASYNC)
            .build();
        self.run_plain(entry).await
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        if self.reactor.supports_ftruncate() {
            self.run_plain(opcode::Ftruncate::new(self.fd(), len).build())
                .await
        } else {
            // Older kernels: ftruncate is a quick metadata call, done inline.
            self.file.set_len(len)
        }
    }

    fn file(&self) -> &File {
        &self.file
    }
}
