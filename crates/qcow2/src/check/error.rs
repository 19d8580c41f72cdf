//! Why a check could not complete (qemu-img's "Check failed"), as opposed to the findings it
//! counts in a [`super::CheckReport`].

use crate::format::FormatError;
use crate::metadata::MetadataError;
use thiserror::Error;

/// A check that stopped before it could report (qemu-img exits 1, or 63 for a non-qcow2 file).
#[derive(Debug, Error)]
pub enum CheckError {
    /// The file does not start with the qcow2 magic, so there is nothing to check.
    #[error("not a qcow2 image (magic {found:#010x}); this image format does not support checks")]
    NotQcow2 {
        /// The first four bytes of the file, big-endian.
        found: u32,
    },
    /// The header fails a check QEMU makes before it opens an image, so QEMU would not check
    /// it either.
    #[error("could not open the image: {source}")]
    Open {
        /// What is wrong in the header.
        #[source]
        source: FormatError,
    },
    /// A structure the check needs could not be loaded.
    #[error("could not open the image: {source}")]
    Load {
        /// What the loader found.
        #[source]
        source: MetadataError,
    },
    /// Reading or writing the file failed.
    #[error("{what} at {offset:#x}: {source}")]
    Io {
        /// What was being read or written.
        what: &'static str,
        /// File offset.
        offset: u64,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file has more clusters than a check can count (QEMU's limit, `EFBIG`).
    #[error("the file has {clusters} clusters, more than the 2^31 - 1 a check can count: File too large")]
    TooLarge {
        /// Clusters in the file.
        clusters: u64,
    },
    /// The snapshot table was not read, for a reason the findings have given already:
    /// the summary is QEMU's, the text of the error number.
    #[error("{0}")]
    SnapshotTableUnread(&'static str),
    /// The snapshot table cannot be read (too many snapshots, misplaced, or too big).
    #[error("snapshot table at {offset:#x}: {detail}")]
    SnapshotTable {
        /// Where the header says the table is.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// The bitmap directory or a bitmap table cannot be loaded.
    #[error("bitmap directory at {offset:#x}: {detail}")]
    Bitmaps {
        /// Where the bitmaps extension says the directory is.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// Refcounts are missing for used clusters; only `-r all` (a rebuild) can fix that.
    #[error("the refcount structure must be rebuilt (repair with -r all): Input/output error")]
    NeedsRebuild,
    /// A repair write would have landed on metadata, so the image was marked corrupt instead.
    #[error("a repair write at {offset:#x} + {len:#x} would overwrite {what}; the image was marked corrupt")]
    Overlap {
        /// Start of the write.
        offset: u64,
        /// Its length.
        len: u64,
        /// The metadata it would have hit.
        what: &'static str,
    },
    /// Rebuilding the refcount structure would need a refcount table beyond QEMU's limit.
    #[error(
        "the rebuilt refcount table would need {entries} entries, more than QEMU's 8 MiB limit"
    )]
    RebuildTooLarge {
        /// Entries the table would need.
        entries: u64,
    },
    /// A narrower refcount width cannot hold a refcount the image has (QEMU's words).
    #[error("Cannot decrease refcount entry width to {bits} bits: Cluster at offset {offset:#x} has a refcount of {refcount}")]
    RefcountTooWide {
        /// The width asked for.
        bits: u32,
        /// The first cluster whose refcount does not fit.
        offset: u64,
        /// Its refcount.
        refcount: u64,
    },
    /// A cluster in use has no refcount, or one that cannot be read, so a structure placed
    /// in clusters that read as free could land on it.
    #[error("the image has {corruptions} refcount corruptions and {check_errors} internal errors; repair it first (check -r all)")]
    Inconsistent {
        /// Corruptions a check found.
        corruptions: u64,
        /// Internal errors a check had.
        check_errors: u64,
    },
    /// A dirty image whose repair left internal errors or corruptions behind.
    #[error("could not repair the dirty image: {check_errors} internal errors and {corruptions} corruptions remain (see `qcow2-nbd check`)")]
    Unrepaired {
        /// Internal errors counted by the repair.
        check_errors: u64,
        /// Corruptions the repair could not fix.
        corruptions: u64,
    },
}

impl CheckError {
    /// A failure of the metadata loader, in the checker's terms: a header QEMU would not
    /// open is a failed open, an I/O error stays one.
    pub(crate) fn from_metadata(e: MetadataError) -> CheckError {
        match e {
            MetadataError::Io {
                what,
                offset,
                source,
                ..
            } => CheckError::Io {
                what,
                offset,
                source,
            },
            MetadataError::Format(source) => CheckError::Open { source },
            other => CheckError::Load { source: other },
        }
    }

    /// An I/O error while doing `what` at `offset`.
    pub(crate) fn io(what: &'static str, offset: u64, source: std::io::Error) -> CheckError {
        CheckError::Io {
            what,
            offset,
            source,
        }
    }
}
