//! Run-time choice of file backend (`--aio io_uring|threads`) and the [`Opener`] for image
//! names: what a name opens ([`name`]) is decided here and nowhere else.

pub mod blkdebug_name;
pub mod described;
pub mod image_opts;
mod json;
pub mod name;
pub mod nbd_name;
mod nodes;
mod parse_name;

pub use parse_name::{parse, protocol_path, protocol_prefix};

use name::NameKind;

use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::{BufResult, OpenOptions, Opener, Slice, Storage, ThreadsStorage, UringStorage};

/// Which file backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Aio {
    /// io_uring through our reactor (falls back to threads if io_uring cannot be set up).
    #[default]
    IoUring,
    /// Blocking syscalls on a thread pool.
    Threads,
}

impl FromStr for Aio {
    type Err = String;
    fn from_str(s: &str) -> Result<Aio, String> {
        match s {
            "io_uring" => Ok(Aio::IoUring),
            "threads" => Ok(Aio::Threads),
            other => Err(format!(
                "unknown aio mode {other:?} (expected io_uring or threads)"
            )),
        }
    }
}

/// A file storage of either backend.
pub enum AnyStorage {
    /// io_uring backend.
    Uring(UringStorage),
    /// Thread-pool backend.
    Threads(ThreadsStorage),
    /// An NBD export (the file name was an NBD name).
    Nbd(crate::nbd::NbdStorage),
    /// A `null-co` device (the file name was a `null-co://` name).
    Null(crate::null::NullStorage),
    /// A file behind QEMU's `blkdebug` fault injection (a `blkdebug:CONFIG:FILE` name or a
    /// blkdebug node's JSON name).
    Blkdebug(Box<crate::BlkdebugStorage<AnyStorage>>),
    /// Several files that vote on every read (a `quorum` node's JSON name).
    Quorum(Box<crate::QuorumStorage<AnyStorage>>),
}

impl AnyStorage {
    /// The backend actually in use (after any fallback).
    pub fn aio(&self) -> Aio {
        match self {
            AnyStorage::Uring(_) => Aio::IoUring,
            AnyStorage::Threads(_) | AnyStorage::Nbd(_) | AnyStorage::Null(_) => Aio::Threads,
            AnyStorage::Blkdebug(s) => s.inner().aio(),
            AnyStorage::Quorum(s) => s.children().first().map_or(Aio::Threads, AnyStorage::aio),
        }
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStorage::Uring($s) => $e,
            AnyStorage::Threads($s) => $e,
            AnyStorage::Nbd($s) => $e,
            AnyStorage::Null($s) => $e,
            AnyStorage::Blkdebug($s) => $e,
            AnyStorage::Quorum($s) => $e,
        }
    };
}

impl Storage for AnyStorage {
    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        each!(self, s => s.read_at(buf, offset).await)
    }
    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        each!(self, s => s.write_at(buf, offset).await)
    }
    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        each!(self, s => s.write_zeroes_at(offset, len, unmap).await)
    }
    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        each!(self, s => s.data_run(offset, len).await)
    }
    async fn status_run(&self, offset: u64, len: u64) -> io::Result<(crate::RunStatus, u64)> {
        each!(self, s => s.status_run(offset, len).await)
    }
    fn allocated_size(&self) -> Option<u64> {
        each!(self, s => s.allocated_size())
    }
    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        each!(self, s => s.discard_at(offset, len).await)
    }
    async fn flush(&self) -> io::Result<()> {
        each!(self, s => s.flush().await)
    }
    async fn len(&self) -> io::Result<u64> {
        each!(self, s => s.len().await)
    }
    async fn set_len(&self, len: u64) -> io::Result<()> {
        each!(self, s => s.set_len(len).await)
    }
    fn zeroes_are_cheap(&self) -> bool {
        each!(self, s => s.zeroes_are_cheap())
    }
    fn alignment(&self) -> usize {
        each!(self, s => s.alignment())
    }
    fn event(&self, event: crate::Event) {
        each!(self, s => s.event(event))
    }
}

/// Opens files with the chosen backend; `direct` forces O_DIRECT on every open (QEMU's
/// `cache=none`) in addition to what each open asks, and `locking` decides the image locks
/// of every file it opens (an image, its backing files, its data file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FileOpener {
    /// Backend to use.
    pub aio: Aio,
    /// Open every file with O_DIRECT.
    pub direct: bool,
    /// Image locks (QEMU's `locking=`).
    pub locking: crate::Locking,
}

impl Opener for FileOpener {
    type Storage = AnyStorage;

    async fn open(&self, path: &Path, opts: OpenOptions) -> io::Result<AnyStorage> {
        if opts.confine.is_some() {
            if let Some(what) = name::kind(path).not_a_file() {
                let refusal = crate::Refusal::NotAFile { what };
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("opening {}: {refusal}", path.display()),
                ));
            }
        }
        let text = path.to_str().unwrap_or_default();
        match name::kind(path) {
            NameKind::Nbd => return crate::nbd::NbdStorage::open(text, opts).map(AnyStorage::Nbd),
            NameKind::Null => return crate::null::NullStorage::open(text).map(AnyStorage::Null),
            NameKind::Blkdebug => {
                if let Some(storage) = self.open_blkdebug(text, opts).await {
                    return storage;
                }
            }
            NameKind::Quorum => {
                if let Some(storage) = self.open_quorum(text, opts).await {
                    return storage;
                }
            }
            NameKind::File => {}
        }
        let opts = OpenOptions {
            direct: opts.direct || self.direct,
            locking: self.locking,
            ..opts
        };
        if self.aio == Aio::IoUring {
            match crate::Reactor::current() {
                Ok(reactor) => {
                    return UringStorage::open_with(reactor, path, opts)
                        .await
                        .map(AnyStorage::Uring)
                }
                Err(e) => warn_fallback(&e),
            }
        }
        ThreadsStorage::open(path, opts)
            .await
            .map(AnyStorage::Threads)
    }

    /// Resolved on a thread of its own within `opts.bound`: walking a path on a file system
    /// that does not answer blocks like opening a file there.
    async fn canonical(&self, path: &Path, opts: OpenOptions) -> io::Result<PathBuf> {
        if name::kind(path) != NameKind::File {
            return Ok(path.to_path_buf());
        }
        let owned = path.to_path_buf();
        crate::bounded::run("resolving", path, opts.bound, move || {
            Ok(owned.canonicalize().unwrap_or(owned))
        })
        .await
    }
}

impl FileOpener {
    /// The file a `blkdebug` name wraps, opened and wrapped in its rules (`None`: the name
    /// does not parse as one, and is opened as a file of that name).
    async fn open_blkdebug(&self, text: &str, opts: OpenOptions) -> Option<io::Result<AnyStorage>> {
        let (rules, image) = if let Some((config, image)) = crate::blkdebug::split_name(text) {
            (
                crate::blkdebug::Rules::read_config(Path::new(config)),
                image.to_string(),
            )
        } else {
            let node = crate::blkdebug::Node::parse(text)?;
            (node.rules(), node.image.clone())
        };
        let rules = match rules {
            Ok(rules) => rules,
            Err(e) => return Some(Err(io::Error::new(io::ErrorKind::InvalidInput, e))),
        };
        // Boxed: opening the wrapped file is a call of `open` itself.
        let inner = match Box::pin(self.open(Path::new(&image), opts)).await {
            Ok(inner) => inner,
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(AnyStorage::Blkdebug(Box::new(
            crate::BlkdebugStorage::new(inner, rules),
        ))))
    }
}

impl FileOpener {
    /// The children a `quorum` name names, opened and wrapped (`None`: the name does not
    /// parse as one, and is opened as a file of that name).
    async fn open_quorum(&self, text: &str, opts: OpenOptions) -> Option<io::Result<AnyStorage>> {
        let node = crate::quorum::QuorumNode::parse(text)?;
        let mut children = Vec::with_capacity(node.children.len());
        for child in &node.children {
            // Boxed: opening a child is a call of `open` itself.
            match Box::pin(self.open(Path::new(child), opts)).await {
                Ok(c) => children.push(c),
                Err(e) => return Some(Err(e)),
            }
        }
        Some(
            crate::QuorumStorage::new(children, node.threshold)
                .map(|q| AnyStorage::Quorum(Box::new(q)))
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e)),
        )
    }
}

/// Say once per thread why io_uring is not used, not once per file of a backing chain.
fn warn_fallback(e: &io::Error) {
    thread_local! {
        static WARNED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if !WARNED.with(|w| w.replace(true)) {
        tracing::warn!("io_uring unavailable ({e}); falling back to the threads backend");
    }
}

/// What `name` is, when the file opener would open something other than a local file for
/// it: an NBD export, a `null-co` device, or a `blkdebug` fault-injection node.
pub fn not_a_file(name: &str) -> Option<&'static str> {
    name::kind_of_text(name).not_a_file()
}
