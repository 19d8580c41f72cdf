//! Errors of the cache: each names the cache, the entry (when there is one) and the cause.

use std::io;

/// Why a cache operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The configuration cannot describe a cache.
    #[error("{cache} cache: invalid configuration: {reason}")]
    Config {
        /// Cache name.
        cache: String,
        /// What is wrong.
        reason: String,
    },
    /// The memory for the entries could not be mapped.
    #[error("{cache} cache: cannot map {bytes} bytes for its entries: {source}")]
    Arena {
        /// Cache name.
        cache: String,
        /// Size of the mapping asked for.
        bytes: usize,
        /// The OS error.
        source: io::Error,
    },
    /// A part of an entry that does not lie inside it.
    #[error(
        "{cache} cache: bytes {start}..{end} do not lie inside an entry of {entry_size} bytes"
    )]
    Part {
        /// Cache name.
        cache: String,
        /// First byte of the part.
        start: usize,
        /// End of the part (exclusive).
        end: usize,
        /// Bytes per entry.
        entry_size: usize,
    },
    /// Reading an entry from the backend failed.
    #[error("{cache} cache: loading entry {key} failed: {source}")]
    Load {
        /// Cache name.
        cache: String,
        /// The entry's key, as `Debug` prints it.
        key: String,
        /// The backend's error.
        source: io::Error,
    },
    /// Writing a dirty entry back failed; the entry stays dirty.
    #[error("{cache} cache: writing back entry {key} failed: {source}")]
    WriteBack {
        /// Cache name.
        cache: String,
        /// The entry's key, as `Debug` prints it.
        key: String,
        /// The backend's error.
        source: io::Error,
    },
    /// Making written entries durable failed.
    #[error("{cache} cache: flushing its backend failed: {source}")]
    Flush {
        /// Cache name.
        cache: String,
        /// The backend's error.
        source: io::Error,
    },
    /// Flushing a cache this one depends on failed, so nothing of this one was written.
    #[error("{cache} cache: flushing the {dependency} cache it depends on failed: {source}")]
    Dependency {
        /// Cache name.
        cache: String,
        /// Name of the cache that had to be flushed first.
        dependency: String,
        /// Why that flush failed.
        source: Box<CacheError>,
    },
}

impl CacheError {
    /// The I/O error at the root of this one, if any (to map it to an errno).
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            Self::Config { .. } | Self::Part { .. } => None,
            Self::Arena { source, .. }
            | Self::Load { source, .. }
            | Self::WriteBack { source, .. }
            | Self::Flush { source, .. } => Some(source),
            Self::Dependency { source, .. } => source.io_error(),
        }
    }

    /// Whether the root cause is "no space left on device" (reported in preference to
    /// other errors when several write-backs fail, as QEMU does).
    pub fn is_no_space(&self) -> bool {
        self.io_error()
            .and_then(io::Error::raw_os_error)
            .is_some_and(|errno| errno == libc::ENOSPC)
            || self
                .io_error()
                .is_some_and(|e| e.kind() == io::ErrorKind::StorageFull)
    }
}
