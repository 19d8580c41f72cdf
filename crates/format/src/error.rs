//! `FormatError`: every way untrusted qcow2 bytes can be wrong, each naming the structure, the
//! field and the file offset so a user can find the broken byte with a hex editor.

use std::fmt;

/// The on-disk structure an error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Structure {
    /// The fixed image header at offset 0.
    Header,
    /// The header extension area after the header.
    HeaderExtension,
    /// The feature name table header extension.
    FeatureNameTable,
    /// The backing file name stored in the first cluster.
    BackingFileName,
    /// The active (or a snapshot's) L1 table.
    L1Table,
    /// An L2 table.
    L2Table,
    /// A compressed cluster descriptor inside an L2 entry.
    CompressedDescriptor,
    /// The refcount table.
    RefcountTable,
    /// A refcount block.
    RefcountBlock,
    /// The internal snapshot table.
    SnapshotTable,
    /// The bitmaps header extension.
    BitmapsExtension,
    /// The bitmap directory.
    BitmapDirectory,
    /// A bitmap table.
    BitmapTable,
    /// Geometry derived from header fields (no single file offset).
    Geometry,
}

impl fmt::Display for Structure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Structure::Header => "header",
            Structure::HeaderExtension => "header extension",
            Structure::FeatureNameTable => "feature name table",
            Structure::BackingFileName => "backing file name",
            Structure::L1Table => "L1 table",
            Structure::L2Table => "L2 table",
            Structure::CompressedDescriptor => "compressed cluster descriptor",
            Structure::RefcountTable => "refcount table",
            Structure::RefcountBlock => "refcount block",
            Structure::SnapshotTable => "snapshot table",
            Structure::BitmapsExtension => "bitmaps extension",
            Structure::BitmapDirectory => "bitmap directory",
            Structure::BitmapTable => "bitmap table",
            Structure::Geometry => "geometry",
        })
    }
}

/// Where in the file an error was found: a structure at a file offset, optionally one of its
/// entries. Displays as `L2 table at 0x50000: entry 17`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Which structure.
    pub structure: Structure,
    /// File offset of the structure (or of the offending field when there is no table).
    pub offset: u64,
    /// Index of the entry inside a table, when the structure is a table.
    pub entry: Option<u64>,
}

impl Location {
    /// A structure (or field) at a file offset.
    pub const fn at(structure: Structure, offset: u64) -> Self {
        Location {
            structure,
            offset,
            entry: None,
        }
    }

    /// Entry `index` of the table that starts at `table_offset`.
    pub const fn entry(structure: Structure, table_offset: u64, index: u64) -> Self {
        Location {
            structure,
            offset: table_offset,
            entry: Some(index),
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {:#x}", self.structure, self.offset)?;
        if let Some(entry) = self.entry {
            write!(f, ": entry {entry}")?;
        }
        Ok(())
    }
}

/// One unsupported incompatible feature bit, with its name if the image's feature name table
/// has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownFeature {
    /// Bit number in `incompatible_features`.
    pub bit: u32,
    /// Name from the image's feature name table, if present.
    pub name: Option<String>,
}

impl fmt::Display for UnknownFeature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "bit {} ({name})", self.bit),
            None => write!(f, "bit {} (unnamed)", self.bit),
        }
    }
}

/// Small values read best in decimal (counts, lengths, bit numbers), large ones in hex
/// (offsets, masks).
struct Num(u64);

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 < 0x1_0000 {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{:#x}", self.0)
        }
    }
}

fn list_features(features: &[UnknownFeature]) -> String {
    features
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Errors from decoding or encoding qcow2 structures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The snapshot table passes QEMU's 64 MiB with the entry `at` names: it and the
    /// `overhanging` entries from it on do not fit.
    #[error("{at}: the snapshot table passes 64 MiB here: {overhanging} snapshots from this entry on do not fit (QEMU refuses snapshot tables larger than 64 MiB)")]
    SnapshotTableTooBig {
        /// The first entry that does not fit.
        at: Location,
        /// Entries from it to the end of the table.
        overhanging: u64,
    },
    /// The bytes end before the structure does.
    #[error("{at}: truncated: {what} needs {need} bytes but only {have} are available")]
    Truncated {
        /// Where.
        at: Location,
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// The file does not start with the qcow2 magic.
    #[error("not a qcow2 image: magic at offset 0x0 is {found:#010x}, expected 0x514649fb (\"QFI\\xfb\")")]
    BadMagic {
        /// The magic found.
        found: u32,
    },
    /// A field holds a value the format does not allow.
    #[error("{at}: {field} = {}: {reason}", Num(*.value))]
    InvalidValue {
        /// Where.
        at: Location,
        /// Field name as in the specification.
        field: &'static str,
        /// The value found.
        value: u64,
        /// Why it is wrong.
        reason: &'static str,
    },
    /// A field exceeds one of QEMU's sanity limits (see `limits`).
    #[error("{at}: {field} = {} exceeds the limit {} ({why})", Num(*.value), Num(*.limit))]
    LimitExceeded {
        /// Where.
        at: Location,
        /// Field name.
        field: &'static str,
        /// The value found.
        value: u64,
        /// The largest allowed value.
        limit: u64,
        /// Which limit and why it exists.
        why: &'static str,
    },
    /// Reserved bits are set.
    #[error("{at}: {field}: reserved bits {bits:#x} are set")]
    ReservedBits {
        /// Where.
        at: Location,
        /// Field name.
        field: &'static str,
        /// The reserved bits that are set.
        bits: u64,
    },
    /// An offset that must be cluster-aligned is not.
    #[error("{at}: {field} {offset:#x} is not aligned to the cluster size {cluster_size:#x}")]
    Unaligned {
        /// Where.
        at: Location,
        /// Field name.
        field: &'static str,
        /// The offset found.
        offset: u64,
        /// The cluster size it must be a multiple of.
        cluster_size: u64,
    },
    /// An extended L2 entry's subcluster bitmap contradicts itself or its descriptor.
    #[error(
        "{at}: invalid extended L2 entry (allocation bits {alloc:#010x}, zero bits {zero:#010x}): {problem}"
    )]
    InvalidSubclusters {
        /// Where.
        at: Location,
        /// Allocation bitmap (bits 0-31 of the second word).
        alloc: u32,
        /// Zero bitmap (bits 32-63 of the second word).
        zero: u32,
        /// What is wrong.
        problem: &'static str,
    },
    /// The image sets incompatible feature bits this implementation does not know.
    #[error("header at 0x48: unsupported incompatible feature(s): {}", list_features(.features))]
    UnsupportedIncompatibleFeatures {
        /// The unknown bits, with their names when the image's feature name table has them.
        features: Vec<UnknownFeature>,
    },
    /// Two fields (or a field and a feature bit) contradict each other.
    #[error("{at}: {problem}")]
    Inconsistent {
        /// Where.
        at: Location,
        /// What is wrong.
        problem: &'static str,
    },
    /// Offset or size arithmetic on untrusted values would overflow.
    #[error("{at}: arithmetic overflow computing {what}")]
    Overflow {
        /// Where.
        at: Location,
        /// What was being computed.
        what: &'static str,
    },
    /// A refcount does not fit in the image's refcount width.
    #[error("refcount {value} does not fit in {bits} bits")]
    RefcountTooLarge {
        /// The value.
        value: u64,
        /// The refcount width in bits.
        bits: u32,
    },
    /// A refcount index is outside the block, or the order is not 0..=6.
    #[error("refcount block of {block_len} bytes with refcount_order {order}: index {index} is out of range")]
    RefcountIndex {
        /// Index requested.
        index: usize,
        /// refcount_order used.
        order: u32,
        /// Block length in bytes.
        block_len: usize,
    },
    /// An encrypted image without the header extension that locates its encryption header
    /// (QEMU's words).
    #[error("Missing CRYPTO header for crypt method {method}")]
    MissingCryptoHeader {
        /// The header's `crypt_method`.
        method: u32,
    },
    /// An encoder's output does not fit where it must go.
    #[error("{at}: {what} needs {need} bytes but only {available} are available")]
    DoesNotFit {
        /// Where.
        at: Location,
        /// What did not fit.
        what: &'static str,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        available: u64,
    },
}

impl FormatError {
    /// What QEMU's qcow2 driver says when it refuses to open an image for this reason, for
    /// the header checks it makes the same way (table sizes and placement, the disk size
    /// against the L1 table); `None` for the rest, which keep our own wording.
    pub fn qemu_open_message(&self) -> Option<String> {
        let table = |field: &str| match field {
            "refcount_table_offset" | "refcount_table_clusters" => Some("Reference count table"),
            "snapshots_offset" | "nb_snapshots" => Some("Snapshot table"),
            "l1_table_offset" | "l1_size" => Some("Active L1 table"),
            _ => None,
        };
        let header = |at: &Location| at.structure == Structure::Header;
        match self {
            FormatError::LimitExceeded { at, field, .. } if header(at) => match *field {
                "size" => Some("Image is too big".into()),
                f => table(f).map(|t| format!("{t} too large")),
            },
            FormatError::InvalidValue { at, field, .. } if header(at) => match *field {
                "l1_size" => Some("L1 table is too small".into()),
                "refcount_table_clusters" => {
                    Some("Image does not contain a reference count table".into())
                }
                f => table(f).map(|t| format!("{t} offset invalid")),
            },
            FormatError::Unaligned { at, field, .. } if header(at) => {
                table(field).map(|t| format!("{t} offset invalid"))
            }
            FormatError::LimitExceeded {
                at:
                    Location {
                        structure: Structure::SnapshotTable,
                        entry: Some(i),
                        ..
                    },
                field: "extra_data_size",
                ..
            } => Some(format!(
                "Too much extra metadata in snapshot table entry {i}\nYou can force-remove this extra metadata with qemu-img check -r all"
            )),
            FormatError::MissingCryptoHeader { .. } => Some(self.to_string()),
            FormatError::SnapshotTableTooBig { overhanging, .. } => Some(format!(
                "Snapshot table is too big\nYou can force-remove all {overhanging} overhanging snapshots with qemu-img check -r all"
            )),
            _ => None,
        }
    }
}
