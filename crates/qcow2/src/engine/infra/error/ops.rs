//! Refusals of the image operations (amend, bitmaps, resize, snapshots), in QEMU's words: a
//! leaf, so that each operation and the engine's error type can both name them.

use super::libc_errno;
use crate::format::FormatError;
use crate::format::SnapshotL1Problem;

/// An amendment QEMU refuses too (in its words), or one we refuse where QEMU would leave a
/// damaged image.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmendError {
    #[error("Refcount width must be a power of two and may not exceed 64 bits")]
    RefcountWidth,
    #[error("Refcount widths other than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")]
    RefcountNeedsV3,
    #[error("Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")]
    LazyNeedsV3,
    #[error("Cannot amend the backing file\nYou can use 'qemu-img rebase' instead.")]
    Backing,
    #[error("data-file can only be set for images that use an external data file")]
    DataFileNotUsed,
    #[error("data-file-raw cannot be set on existing images")]
    DataFileRawOnExisting,
    #[error("Cannot decrease refcount entry width to {bits} bits: Cluster at offset {offset:#x} has a refcount of {refcount}")]
    RefcountTooBig {
        /// The width asked for.
        bits: u32,
        /// The first cluster whose refcount does not fit.
        offset: u64,
        /// Its refcount.
        refcount: u64,
    },
    #[error("compat=0.10 requires refcount_bits=16")]
    DowngradeRefcountBits,
    #[error("Cannot downgrade an image with a data file")]
    DowngradeDataFile,
    #[error("Internal snapshots prevent downgrade of image")]
    DowngradeSnapshots,
    #[error("Cannot downgrade an image with incompatible features {0:#x} set")]
    DowngradeFeatures(u64),
    #[error(
        "Cannot downgrade an image with zstd compression type and existing compressed clusters"
    )]
    DowngradeZstd,
    /// QEMU downgrades and leaves the bitmaps inconsistent and their clusters leaked.
    #[error("Cannot downgrade an image with persistent bitmaps: compat=0.10 cannot keep them (remove them first)")]
    DowngradeBitmaps,
    /// A snapshot's L1 table that QEMU will not use stopped the expansion of zero clusters
    /// (QEMU reports the problem first, then this with its errno).
    #[error("Failed to turn zero into data clusters: {}", match .0 {
        SnapshotL1Problem::TooLarge => "File too large",
        SnapshotL1Problem::OffsetInvalid => "Invalid argument",
    })]
    ZeroExpansion(SnapshotL1Problem),
}

/// Why a bitmap operation was refused, in QEMU's words where QEMU has them.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BitmapError {
    /// No bitmap of that name.
    #[error("Dirty bitmap '{0}' not found")]
    NotFound(String),
    /// A bitmap of that name exists already.
    #[error("Bitmap already exists: {0}")]
    Exists(String),
    /// The bitmap was in use when the image was opened: its data may be stale.
    #[error("Bitmap '{0}' is inconsistent and cannot be used; remove it with `bitmap --remove`")]
    Inconsistent(String),
    /// The granularity is not a power of two in 512 B..2 GiB.
    #[error("Granularity must be power of 2 and at least 512 (and at most 2 GiB)")]
    Granularity,
    /// Version 2 images have no autoclear bits to keep bitmaps consistent with.
    #[error("Cannot store dirty bitmaps in qcow2 v2 files")]
    Version2,
    /// The name is empty or too long.
    #[error("Name length must be between 1 and 1023 bytes")]
    Name,
    /// Too many bitmaps, or a directory too large, for QEMU to open.
    #[error("Too many persistent bitmaps (at most 65535, with a directory of at most 64 MiB)")]
    TooMany,
    /// The bitmap's data would exceed QEMU's limits.
    #[error("Too much space will be occupied by the bitmap. Use larger granularity ({0})")]
    TooLarge(FormatError),
    /// Images of different sizes cannot be merged.
    #[error("Bitmaps of different disk sizes ({0} and {1} bytes) cannot be merged")]
    SizeMismatch(u64, u64),
}

/// A resize QEMU refuses too, in its words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    /// QEMU sizes disks in whole sectors.
    #[error("The new size must be a multiple of 512")]
    Unaligned,
    /// Version 2 snapshots do not record their disk size, so the active size must not change.
    #[error("Can't resize a v2 image which has snapshots")]
    V2Snapshots,
    /// Preallocation describes the space a disk gains.
    #[error("Preallocation can't be used for shrinking an image")]
    PreallocShrink,
    /// A raw file has no metadata to preallocate.
    #[error("Unsupported preallocation mode: metadata")]
    RawMetadata,
    /// The new space would show the longer backing file, and version 2 has no zero clusters
    /// to hide it with.
    #[error("Failed to zero out new clusters: Operation not supported")]
    V2LongerBacking,
}

/// Why a snapshot operation cannot be done.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No snapshot has this ID or name.
    #[error("no snapshot with ID or name {0:?}")]
    NotFound(String),
    /// A raw image has no snapshot table.
    #[error("only qcow2 images hold internal snapshots")]
    NotQcow2,
    /// QEMU refuses internal snapshots of images whose data lives in an external file.
    #[error("internal snapshots of an image with an external data file are not supported")]
    DataFile,
    /// QEMU refuses to revert the disk under persistent dirty bitmaps.
    #[error("the image has persistent dirty bitmaps, which applying a snapshot would falsify")]
    ActiveBitmaps,
    /// The table is full.
    #[error("the image already has {0} snapshots, QEMU's maximum")]
    TooMany(usize),
    /// One more reference would not fit the image's refcount width.
    #[error("the refcount of cluster {offset:#x} is {refcount}; another reference would exceed the maximum of {max}")]
    RefcountLimit {
        /// The cluster's file offset.
        offset: u64,
        /// Its refcount now.
        refcount: u64,
        /// The largest refcount the image can store.
        max: u64,
    },
    /// A cluster the snapshot would reference has no refcount block, and the refcount table
    /// has room for one: QEMU would create the block and fail with EAGAIN, asking its caller
    /// to start over; nothing is created here.
    #[error("cluster {0:#x} has no refcount block")]
    RefcountBlockMissing(u64),
    /// A cluster the snapshot would reference lies beyond what a refcount table within
    /// QEMU's limit can describe.
    #[error("cluster {0:#x} lies beyond what a refcount table of QEMU's size limit can describe")]
    BeyondRefcountTable(u64),
    /// The snapshot's L1 table is not one QEMU would use (QEMU's words).
    #[error("{0}")]
    L1Table(SnapshotL1Problem),
    /// The snapshot's disk needs a larger L1 table than QEMU allows.
    #[error("the snapshot's disk of {0} bytes needs an L1 table larger than QEMU's 32 MiB")]
    TooLarge(u64),
}

impl SnapshotError {
    /// The errno QEMU fails with in the same case.
    pub fn errno(&self) -> i32 {
        match self {
            SnapshotError::NotFound(_) => libc_errno::ENOENT,
            SnapshotError::NotQcow2 | SnapshotError::DataFile => libc_errno::ENOTSUP,
            SnapshotError::ActiveBitmaps => libc_errno::EBUSY,
            SnapshotError::TooMany(_)
            | SnapshotError::TooLarge(_)
            | SnapshotError::BeyondRefcountTable(_) => libc_errno::EFBIG,
            SnapshotError::RefcountBlockMissing(_) => libc_errno::EAGAIN,
            SnapshotError::L1Table(SnapshotL1Problem::TooLarge) => libc_errno::EFBIG,
            SnapshotError::L1Table(SnapshotL1Problem::OffsetInvalid) => libc_errno::EINVAL,
            SnapshotError::RefcountLimit { .. } => libc_errno::EINVAL,
        }
    }
}
