//! The engine's error type: what went wrong and where, convertible to an errno at the edges.

pub mod libc_errno;
mod ops;

pub use ops::{AmendError, BitmapError, ResizeError, SnapshotError};

use super::backing_name::BackingError;
use super::cache_sizing::CacheSizeError;
use super::compress::CompressError;
use crate::format::FormatError;
use crate::metadata::MetadataError;
use std::io;
use thiserror::Error;

/// Result alias for engine operations.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything an image operation can fail with.
#[derive(Debug, Error)]
pub enum EngineError {
    /// An I/O error from the storage below, with what we were doing.
    #[error("{image}: {what} at {offset:#x}: {source}")]
    Io {
        /// Image (file name) the I/O was for.
        image: String,
        /// What was being read or written.
        what: &'static str,
        /// File offset.
        offset: u64,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An encrypted image could not be unlocked, or its encryption header is bad.
    #[error("Could not open '{image}': {source}")]
    Crypto {
        /// The image.
        image: String,
        /// What is wrong.
        #[source]
        source: crate::crypto::CryptoError,
    },
    /// A backing file could not be opened: `images` are the chain above it, from the top,
    /// the last one naming it.
    #[error("could not open {path} (the backing file of {}): {source}", .images.last().map_or("", String::as_str))]
    BackingOpen {
        /// The images whose chain needs it, from the top.
        images: Vec<String>,
        /// The backing file, resolved.
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file could not be opened.
    #[error("could not open {path}: {source}")]
    Open {
        /// The path.
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The file could not be made long enough for clusters being preallocated (QEMU's
    /// words: a file system out of space, or an NBD export, which cannot grow).
    #[error("Could not resize image: {source}")]
    GrowFile {
        /// Image whose file would have grown (the caller's message names it, as QEMU's does).
        image: String,
        /// What the storage said.
        #[source]
        source: io::Error,
    },
    /// A structure failed to decode or broke a limit.
    #[error("{image}: {source}")]
    Format {
        /// Image the structure belongs to.
        image: String,
        /// The decoding error (names structure, field and offset).
        #[source]
        source: FormatError,
    },
    /// Structures that decode fine but contradict each other (pointers past the end of the
    /// file, overlapping tables, ...).
    #[error("{image}: {detail}")]
    Corrupt {
        /// Image the inconsistency was found in.
        image: String,
        /// What is wrong and where.
        detail: String,
    },
    /// The image was already marked corrupt, or was marked corrupt by us, so writes are refused.
    #[error("{image}: the image is marked corrupt; it can only be opened read-only (repair it with `qcow2-nbd check -r all`)")]
    MarkedCorrupt {
        /// The image.
        image: String,
    },
    /// A write to a read-only image.
    #[error("{image}: the image is open read-only")]
    ReadOnly {
        /// The image.
        image: String,
    },
    /// A request outside the virtual disk.
    #[error("request at {offset:#x} + {len:#x} is past the end of the disk ({size:#x} bytes)")]
    OutOfRange {
        /// Start of the request.
        offset: u64,
        /// Its length.
        len: u64,
        /// Virtual disk size.
        size: u64,
    },
    /// A persistent bitmap operation was refused.
    #[error("{image}: {source}")]
    Bitmap {
        /// The image.
        image: String,
        /// Why.
        #[source]
        source: BitmapError,
    },
    /// An untrusted image declares a size past its cap (`--untrusted`).
    #[error("{image}: {source}")]
    Declared {
        /// The image.
        image: String,
        /// The size and its cap.
        source: crate::declared::Exceeded,
    },
    /// A feature or combination we do not implement (refused, never half-done).
    #[error("{image}: {what} is not supported")]
    Unsupported {
        /// The image.
        image: String,
        /// What is not supported.
        what: String,
    },
    /// An external data file was given for an image that has none.
    #[error("{image}: 'data-file' can only be set for images with an external data file")]
    DataFileNotUsed {
        /// The image.
        image: String,
    },
    /// A resize QEMU would refuse too, with its reason.
    #[error("{image}: {source}")]
    Resize {
        /// The image.
        image: String,
        /// Why, in QEMU's words.
        #[source]
        source: ResizeError,
    },
    /// An amendment QEMU would refuse too (or one we refuse rather than damage the image).
    #[error("{image}: {source}")]
    Amend {
        /// The image.
        image: String,
        /// Why.
        #[source]
        source: AmendError,
    },
    /// A fast zero request that could only be done by writing data.
    #[error("zeroing {offset:#x} + {len:#x} would have to write data")]
    ZeroNotFast {
        /// Start of the request.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// The image cannot grow any further (host offsets or table limits).
    #[error("{image}: no space: {detail}")]
    NoSpace {
        /// The image.
        image: String,
        /// Which limit was hit.
        detail: String,
    },
    /// A backing file name we refuse to follow, a loop, or a chain too deep.
    #[error(transparent)]
    Backing(#[from] BackingError),
    /// A compressed cluster failed to decode.
    #[error("{image}: compressed cluster at {offset:#x}: {source}")]
    Compressed {
        /// The image.
        image: String,
        /// Host offset of the compressed data.
        offset: u64,
        /// The codec's error.
        #[source]
        source: CompressError,
    },
    /// The metadata cache failed (a load or write-back error, or a misconfiguration).
    #[error("{image}: metadata cache: {source}")]
    Cache {
        /// The image.
        image: String,
        /// The cache's error.
        #[source]
        source: cache::CacheError,
    },
    /// Cache size options that do not fit the image.
    #[error("{image}: {source}")]
    CacheSize {
        /// The image.
        image: String,
        /// The sizing error.
        #[source]
        source: CacheSizeError,
    },
    /// An internal snapshot operation that cannot be done on this image.
    #[error("{image}: {source}")]
    Snapshot {
        /// The image.
        image: String,
        /// What is in the way.
        #[source]
        source: SnapshotError,
    },
    /// Deleting a snapshot failed after it left the snapshot table: its clusters stay
    /// allocated (leaked, which `check -r leaks` repairs).
    #[error("{image}: releasing the clusters of a deleted snapshot: {source}")]
    SnapshotRelease {
        /// The image.
        image: String,
        /// What failed.
        #[source]
        source: Box<EngineError>,
        /// An earlier failure to free the old snapshot table (leaked too), if any.
        table_leaked: Option<Box<EngineError>>,
    },
    /// The internal snapshot to open has an L1 table QEMU would not use (QEMU's words, as
    /// every tool that loads a snapshot prints them).
    #[error("Failed to load snapshot: {problem}")]
    LoadSnapshot {
        /// The image.
        image: String,
        /// What is wrong with the table.
        problem: crate::format::SnapshotL1Problem,
    },
    /// An internal snapshot that does not exist.
    #[error("{image}: no snapshot with id or name {wanted:?}")]
    NoSuchSnapshot {
        /// The image.
        image: String,
        /// The id or name asked for.
        wanted: String,
    },
}

impl EngineError {
    /// Doing `what` at `offset` of `image`'s file failed with `source`.
    pub(crate) fn io(image: String, what: &'static str, offset: u64, source: io::Error) -> Self {
        EngineError::Io {
            image,
            what,
            offset,
            source,
        }
    }

    /// A failure to load `image`'s metadata, in the engine's terms: a structure past the
    /// end of the file contradicts the rest of the image, so it is corruption.
    pub(crate) fn from_metadata(image: &str, e: MetadataError) -> EngineError {
        let image = image.to_string();
        match e {
            MetadataError::Io {
                what,
                offset,
                source,
                ..
            } => EngineError::io(image, what, offset, source),
            MetadataError::Format(source) => EngineError::Format { image, source },
            past_end @ MetadataError::PastEnd { .. } => EngineError::Corrupt {
                image,
                detail: past_end.to_string(),
            },
        }
    }

    /// The errno an NBD server (or any POSIX-style caller) should report for this error.
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::ReadOnly { .. } => libc_errno::EPERM,
            EngineError::OutOfRange { .. }
            | EngineError::Bitmap { .. }
            | EngineError::Resize { .. }
            | EngineError::Amend { .. }
            | EngineError::DataFileNotUsed { .. }
            | EngineError::Declared { .. } => libc_errno::EINVAL,
            EngineError::Unsupported { .. } | EngineError::ZeroNotFast { .. } => {
                libc_errno::ENOTSUP
            }
            EngineError::NoSpace { .. } => libc_errno::ENOSPC,
            EngineError::Snapshot { source, .. } => source.errno(),
            EngineError::SnapshotRelease { source, .. } => source.errno(),
            EngineError::Io { source, .. }
            | EngineError::Open { source, .. }
            | EngineError::BackingOpen { source, .. } => {
                space_errno(source).unwrap_or(libc_errno::EIO)
            }
            EngineError::Cache { source, .. } => source
                .io_error()
                .and_then(space_errno)
                .unwrap_or(libc_errno::EIO),
            _ => libc_errno::EIO,
        }
    }

    /// True when this error means the image's metadata is inconsistent (as opposed to an I/O
    /// failure or a bad request).
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            EngineError::Corrupt { .. }
                | EngineError::Format { .. }
                | EngineError::Compressed { .. }
        )
    }
}

/// ENOSPC or EDQUOT when `e` says the file system is full, however many layers of context
/// were wrapped around the OS error on its way up (each keeps the kind, not the number).
fn space_errno(e: &io::Error) -> Option<i32> {
    match (e.raw_os_error(), e.kind()) {
        (Some(n @ (libc_errno::ENOSPC | libc_errno::EDQUOT)), _) => Some(n),
        (_, io::ErrorKind::StorageFull) => Some(libc_errno::ENOSPC),
        (_, io::ErrorKind::QuotaExceeded) => Some(libc_errno::EDQUOT),
        _ => e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<io::Error>())
            .and_then(space_errno),
    }
}
