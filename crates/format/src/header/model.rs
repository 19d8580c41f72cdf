//! The decoded header: every field, and what the feature bits and `compression_type` say.

use super::values::{COMPRESSION_ZLIB, COMPRESSION_ZSTD, CRYPT_NONE};
use crate::error::{FormatError, Location, Structure};
use crate::extensions::HeaderExtension;
use crate::features;
use crate::geometry::Geometry;
use crate::limits;

/// A decoded image header with everything stored in the first cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Offset of the backing file name (0: none). Recomputed by [`Header::encode`].
    pub backing_file_offset: u64,
    /// Length of the backing file name. Recomputed by [`Header::encode`].
    pub backing_file_size: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// 0 none, 1 AES, 2 LUKS.
    pub crypt_method: u32,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// File offset of the active L1 table.
    pub l1_table_offset: u64,
    /// File offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Clusters occupied by the refcount table.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// File offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (0 for version 2).
    pub incompatible_features: u64,
    /// Compatible feature bits (0 for version 2).
    pub compatible_features: u64,
    /// Autoclear feature bits (0 for version 2).
    pub autoclear_features: u64,
    /// log2 of the refcount width (4 for version 2).
    pub refcount_order: u32,
    /// Header length in bytes (72 for version 2).
    pub header_length: u32,
    /// 0 zlib, 1 zstd; only stored when `header_length > 104`.
    pub compression_type: u8,
    /// Bytes 105..header_length: padding and additional fields we do not know, kept verbatim.
    pub unknown_header_tail: Vec<u8>,
    /// Header extensions in file order.
    pub extensions: Vec<HeaderExtension>,
    /// Backing file name, if any (not NUL-terminated).
    pub backing_file: Option<Vec<u8>>,
}
/// A location in the header at file offset `offset`.
pub(super) const fn at(offset: u64) -> Location {
    Location::at(Structure::Header, offset)
}

impl Header {
    /// A fresh header with no tables placed yet: version 3 gets `header_length` 112 (with a
    /// zero compression_type and padding), version 2 gets 72. Refcount order 4.
    pub fn new(version: u32, cluster_bits: u32, size: u64) -> Header {
        let v3 = version >= 3;
        Header {
            version,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits,
            size,
            crypt_method: CRYPT_NONE,
            l1_size: 0,
            l1_table_offset: 0,
            refcount_table_offset: 0,
            refcount_table_clusters: 0,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: if v3 { 112 } else { limits::V2_HEADER_LENGTH },
            compression_type: COMPRESSION_ZLIB,
            unknown_header_tail: if v3 { vec![0; 7] } else { Vec::new() },
            extensions: Vec::new(),
            backing_file: None,
        }
    }

    /// Cluster size in bytes (cluster_bits is validated by `decode`; others saturate).
    pub fn cluster_size(&self) -> u64 {
        1u64.checked_shl(self.cluster_bits).unwrap_or(0)
    }

    /// The geometry the header describes.
    pub fn geometry(&self) -> Result<Geometry, FormatError> {
        Geometry::new(
            self.cluster_bits,
            self.has_extended_l2(),
            self.refcount_order,
            self.size,
        )
        .map(|g| g.with_data_file(self.has_data_file()))
    }

    /// Refcounts may be inconsistent (lazy refcounts were in use).
    pub fn is_dirty(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_DIRTY != 0
    }

    /// The image is marked corrupt.
    pub fn is_corrupt(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_CORRUPT != 0
    }

    /// Guest data lives in an external data file.
    pub fn has_data_file(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_DATA_FILE != 0
    }

    /// The external data file is a consistent raw image.
    pub fn data_file_is_raw(&self) -> bool {
        self.autoclear_features & features::AUTOCLEAR_DATA_FILE_RAW != 0
    }

    /// L2 entries are extended (subclusters).
    pub fn has_extended_l2(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_EXTENDED_L2 != 0
    }

    /// Lazy refcounts are enabled.
    pub fn has_lazy_refcounts(&self) -> bool {
        self.compatible_features & features::COMPAT_LAZY_REFCOUNTS != 0
    }

    /// The compression type's name as qemu-img prints it.
    pub fn compression_type_name(&self) -> &'static str {
        match self.compression_type {
            COMPRESSION_ZSTD => "zstd",
            _ => "zlib",
        }
    }
}
