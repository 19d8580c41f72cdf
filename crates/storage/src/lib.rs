//! The storage seam: async positional I/O over files (io_uring, threads), memory and faults.
//!
//! Everything the qcow2 engine reads or writes goes through the [`Storage`] trait, so the engine
//! never calls the OS directly and crash consistency can be tested with [`FaultStorage`].
//!
//! # Execution model
//! One image is driven by one thread (a tokio current-thread runtime, usually with a
//! `LocalSet`): futures are not `Send`, and backends keep many operations in flight on that
//! thread. Buffers are passed by value ([`Slice`] over an owned, 4 KiB-aligned [`IoBuf`]) and
//! handed back with the result, because the kernel or a worker thread may still write into a
//! buffer after the future that submitted the operation was dropped.
//!
//! # Backends
//! - [`UringStorage`]: io_uring driven by our own per-thread [`Reactor`] (needs a tokio runtime
//!   with I/O enabled).
//! - [`ThreadsStorage`]: `pread`/`pwrite` on tokio's blocking thread pool; works everywhere.
//! - [`MemStorage`] / [`MemFs`]: copy-on-write memory, for tests and backing-chain tests.
//! - [`FaultStorage`]: wraps any storage, logs unflushed operations, makes crash images and
//!   injects errors.
//! - [`BlkdebugStorage`]: QEMU's `blkdebug` fault injection, driven by the events the format
//!   engine announces through [`Storage::event`].
//! - [`nbd::NbdStorage`]: an NBD export, for names like `nbd+unix:///?socket=PATH`.
//! - [`null::NullStorage`]: QEMU's `null-co` device (`null-co://`), which stores nothing.
//! - [`AnyStorage`] / [`FileOpener`]: choose io_uring or threads at run time, NBD for an
//!   NBD name, or a `null-co` device for its name.
//!
//! With `direct: true` (QEMU's `cache=none`) files are opened with `O_DIRECT`; aligned requests
//! go straight through, unaligned ones use a bounce buffer (reads) or a serialized
//! read-modify-write of the covering blocks (writes).
//!
//! # Why our own io_uring reactor
//!
//! Measured against tokio-uring and the thread pool (figures in `benches/RESULTS.md`), we
//! drive the ring from our own reactor over the `io-uring` crate. The two are equal within
//! the noise, and tokio-uring is unmaintained, pins an old io-uring and needs its own runtime,
//! so the simpler-to-own one wins. io_uring clearly beats the thread pool on random reads at
//! depth; on writes, which this disk bounds, neither wins reliably, so `threads` stays a
//! first-class choice (`Aio::Threads`). Batched submission showed no gain that stands out of
//! the noise, so [`Reactor::current`] submits at once (one `io_uring_enter` per operation);
//! batching remains available through [`Reactor::new`]. The thread pool is tokio's
//! `spawn_blocking`; a dedicated pool was not built or measured.

pub mod blkdebug;
pub mod bounded;
mod buf;
pub mod confine;
mod error;
mod event;
pub mod fault;
pub mod file;
mod first_block;
pub mod lock;
mod mem;
pub mod nbd;
pub mod null;
pub mod opener;
pub mod quorum;
pub mod rng;
pub mod size_string;
mod sys;
pub mod threads;
pub mod uring;

pub use blkdebug::BlkdebugStorage;
pub use bounded::{BoundError, OpenBound};
pub use buf::{release_spare_buffers, IoBuf, Slice, BUF_ALIGN};
pub use confine::{AllowDirs, Refusal};
pub use error::{checked_end, FileKind, NotAnImageFile, RangeError, MAX_OFFSET};
pub use event::Event;
pub use fault::{CrashPlan, FaultStats, FaultStorage, InjectedError, OpKind, Survival};
pub use first_block::{allocate_first_block, first_block_len};
pub use lock::{LockError, Locking, Permissions};
pub use mem::{MemFs, MemStorage};
pub use opener::{not_a_file, Aio, AnyStorage, FileOpener};
pub use quorum::QuorumStorage;
pub use threads::ThreadsStorage;
pub use uring::{Reactor, UringStorage};

use std::path::{Path, PathBuf};

/// What a run of a storage is, as [`Storage::status_run`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunStatus {
    /// Stored data (QEMU's `BDRV_BLOCK_DATA`).
    pub data: bool,
    /// Reads as zeros (`BDRV_BLOCK_ZERO`).
    pub zero: bool,
}

/// The result of an owned-buffer operation: the outcome and the buffer, returned either way.
pub type BufResult<T> = (std::io::Result<()>, T);

/// Asynchronous positional I/O on one file-like object (single-threaded by design).
#[allow(async_fn_in_trait)] // single-threaded by design: futures need not be Send
#[allow(clippy::len_without_is_empty)] // a file's emptiness is never the question asked
pub trait Storage {
    /// Read exactly buf.len() bytes at `offset`; bytes past end-of-file read as zeros.
    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice>;
    /// Write all of buf at `offset` (extends the file if needed).
    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice>;
    /// Make [offset, offset+len) read as zeros (extending the file like a write would); with
    /// `unmap`, deallocate (punch hole) if possible.
    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> std::io::Result<()>;
    /// Best-effort deallocation (punch hole); contents afterwards read as zeros or unchanged.
    /// Never changes the length.
    async fn discard_at(&self, offset: u64, len: u64) -> std::io::Result<()>;
    /// Whether `offset` starts a run of stored data (`true`) or a hole (`false`), and how many
    /// bytes of that run lie in `[offset, offset + len)`. Holes read as zeros; this is what lets
    /// block status say "zero" for data clusters that were never written, as QEMU does. The
    /// default says "all data", which is always safe.
    async fn data_run(&self, offset: u64, len: u64) -> std::io::Result<(bool, u64)> {
        let _ = offset;
        Ok((true, len))
    }
    /// Block status as a protocol driver tells it to QEMU: whether the run starting at
    /// `offset` is stored data and whether it reads as zeros (both, for data known to be
    /// zeros; neither, for a hole whose contents are not known, as an NBD server may say),
    /// and how many bytes of it lie in `[offset, offset + len)`. The default takes
    /// [`Storage::data_run`]: data, or a hole that reads as zeros.
    async fn status_run(&self, offset: u64, len: u64) -> std::io::Result<(RunStatus, u64)> {
        let (data, n) = self.data_run(offset, len).await?;
        Ok((RunStatus { data, zero: !data }, n))
    }
    /// Bytes the storage really occupies (a file's allocated blocks), when known. QEMU compares
    /// it with the image's allocated clusters to tell `preallocation=metadata` images apart.
    fn allocated_size(&self) -> Option<u64> {
        None
    }
    /// fdatasync: everything written before is durable when this returns.
    async fn flush(&self) -> std::io::Result<()>;
    /// Current length in bytes.
    async fn len(&self) -> std::io::Result<u64>;
    /// Truncate or extend (with zeros) to `len` bytes.
    async fn set_len(&self, len: u64) -> std::io::Result<()>;
    /// True when write_zeroes_at is a cheap metadata operation (fallocate works here).
    fn zeroes_are_cheap(&self) -> bool;
    /// Required alignment of offsets/lengths for the fast path (1, or 512/4096 with O_DIRECT).
    fn alignment(&self) -> usize;
    /// The format engine above is about to do what `event` names (QEMU's blkdebug events).
    /// Only [`BlkdebugStorage`] acts on it; wrappers pass it on.
    fn event(&self, event: Event) {
        let _ = event;
    }
}

/// How to open a storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    /// Refuse writes (the file is opened read-only).
    pub read_only: bool,
    /// Create the file when it does not exist (ignored when read-only).
    pub create: bool,
    /// Bypass the page cache (`O_DIRECT`, QEMU's `cache=none`).
    pub direct: bool,
    /// Let others write the file while we read it (qemu-img's `-U`); ignored by read-write
    /// opens, which never share writes.
    pub force_share: bool,
    /// Whether to take QEMU-compatible image locks on the file ([`lock`]). `Off` unless
    /// asked: a [`FileOpener`] (what the engine opens images with) sets its own mode, `Auto`
    /// by default. Memory storages ignore it.
    pub locking: Locking,
    /// How long a file backend waits for the file system to open the file, and how many
    /// opens given up may stay stuck ([`bounded`]). Memory storages ignore it.
    pub bound: OpenBound,
    /// The file must resolve inside these directories (it is named by an untrusted image):
    /// the descriptor opened is checked where the kernel says it is, and names that are not
    /// files (NBD, `null-co`, `blkdebug`) are refused ([`confine`]). Memory storages ignore
    /// it.
    pub confine: Option<&'static AllowDirs>,
    /// Flushes return at once without making anything durable (QEMU's `cache=unsafe`): for
    /// a file whose loss in a host crash costs nothing but redoing the work, such as the
    /// target of a copy. File storages honour it; the others ignore it.
    pub ignore_flush: bool,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions {
            read_only: false,
            create: false,
            direct: false,
            force_share: false,
            locking: Locking::Off,
            bound: OpenBound::default(),
            confine: None,
            ignore_flush: false,
        }
    }
}

impl OpenOptions {
    /// Read-only, no create, buffered.
    pub fn read_only() -> OpenOptions {
        OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        }
    }

    /// Read-write, no create, buffered.
    pub fn read_write() -> OpenOptions {
        OpenOptions::default()
    }

    /// Read-write, creating the file if missing, buffered.
    pub fn create() -> OpenOptions {
        OpenOptions {
            create: true,
            ..OpenOptions::default()
        }
    }

    /// The same options with `O_DIRECT` set as given.
    pub fn with_direct(self, direct: bool) -> OpenOptions {
        OpenOptions { direct, ..self }
    }
}

/// Opens storages by path, so the engine can open backing files and data files.
#[allow(async_fn_in_trait)] // single-threaded by design
pub trait Opener {
    /// The storage this opener produces.
    type Storage: Storage;
    /// Open `path` with `opts`.
    async fn open(&self, path: &Path, opts: OpenOptions) -> std::io::Result<Self::Storage>;

    /// The name `path` is known by when a backing chain is checked for loops: canonical
    /// where it can be found (`opts.bound` bounds the walk where the opener honours it),
    /// else `path` as given.
    async fn canonical(&self, path: &Path, opts: OpenOptions) -> std::io::Result<PathBuf> {
        let _ = opts;
        Ok(path.canonicalize().unwrap_or_else(|_| path.to_path_buf()))
    }
}
