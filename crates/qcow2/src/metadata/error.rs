//! What can go wrong while loading metadata.

use crate::format::error::{FormatError, Location};
use std::io;

/// Errors from loading an image's metadata.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// Reading from the source failed.
    #[error("{what} ({len} bytes at offset {offset:#x}): {source}")]
    Io {
        /// What was being read.
        what: &'static str,
        /// File offset.
        offset: u64,
        /// Bytes requested.
        len: u64,
        /// The underlying error.
        source: io::Error,
    },
    /// A structure lies (partly) past the end of the file.
    #[error("{at}: {what} ({len} bytes at offset {offset:#x}) extends past the end of the file ({file_len} bytes)")]
    PastEnd {
        /// Where the structure is described.
        at: Location,
        /// What was being read.
        what: &'static str,
        /// File offset.
        offset: u64,
        /// Bytes needed.
        len: u64,
        /// File length.
        file_len: u64,
    },
    /// The bytes read are not valid qcow2.
    #[error(transparent)]
    Format(#[from] FormatError),
}
