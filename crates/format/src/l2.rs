//! Standard (64-bit) L2 table entries: how one guest cluster maps to the file.

use super::compressed::CompressedDescriptor;
use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};

/// Bit 63: the cluster's refcount is exactly one.
pub const L2_COPIED: u64 = 1 << 63;
/// Bit 62: the cluster is compressed.
pub const L2_COMPRESSED: u64 = 1 << 62;
/// Bit 0 of a standard descriptor: the cluster reads as zeros.
pub const L2_ZERO: u64 = 1;
/// Bits 9-55 of a standard descriptor: the host cluster offset.
pub const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bits 1-8 and 56-61 of a standard descriptor must be zero.
pub const L2_STANDARD_RESERVED_MASK: u64 = 0x3f00_0000_0000_01fe;

/// The host cluster a raw entry word points to (0: none). Compressed words hold a descriptor
/// instead; test [`is_compressed`] first.
pub fn host_of(word: u64) -> u64 {
    word & L2_OFFSET_MASK
}

/// True when a raw entry word describes a compressed cluster.
pub fn is_compressed(word: u64) -> bool {
    word & L2_COMPRESSED != 0
}

/// True when a raw entry word holds a cluster (a host cluster or compressed data).
pub fn holds_cluster(word: u64) -> bool {
    word & (L2_OFFSET_MASK | L2_COMPRESSED) != 0
}

/// The word of a cluster at `host` that only this entry uses (refcount one).
pub fn owned_word(host: u64) -> u64 {
    host | L2_COPIED
}

/// The word of a compressed cluster with descriptor bits `descriptor`.
pub fn compressed_word(descriptor: u64) -> u64 {
    descriptor | L2_COMPRESSED
}

/// `word` with the zero flag set (standard entries of version 3 images): reads as zeros,
/// keeping any preallocated host cluster.
pub fn zeroed_word(word: u64) -> u64 {
    word | L2_ZERO
}

/// True when a standard entry word has the zero flag (reads as zeros, version 3 only).
pub fn has_zero_flag(word: u64) -> bool {
    word & L2_ZERO != 0 && !is_compressed(word)
}

/// One decoded L2 entry (the first 64 bits of an extended entry decode the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2Entry {
    /// Not allocated: reads from the backing file, or zeros without one.
    Unallocated,
    /// Reads as zeros; may keep a preallocated host cluster for a later write.
    Zero {
        /// Host cluster kept for the guest cluster, if any.
        preallocated: Option<HostOffset>,
        /// The preallocated cluster's refcount is exactly one.
        copied: bool,
    },
    /// Data at a host cluster.
    Normal {
        /// Host cluster offset (0 is valid only with an external data file).
        host: HostOffset,
        /// The cluster's refcount is exactly one.
        copied: bool,
    },
    /// Compressed data.
    Compressed(CompressedDescriptor),
}

/// Reads raw entry `index` from an L2 table (or slice) held as big-endian bytes: the entry word
/// and, for extended entries, the subcluster bitmap word (0 otherwise). `None` past the end.
pub fn entry_at(table: &[u8], index: usize, extended: bool) -> Option<(u64, u64)> {
    let size = if extended { 16 } else { 8 };
    let start = index.checked_mul(size)?;
    let bytes = table.get(start..start.checked_add(size)?)?;
    let word = u64::from_be_bytes(bytes.get(..8)?.try_into().ok()?);
    let bitmap = if extended {
        u64::from_be_bytes(bytes.get(8..16)?.try_into().ok()?)
    } else {
        0
    };
    Some((word, bitmap))
}

/// Writes raw entry `index` into an L2 table buffer; `false` if it lies past the end.
pub fn set_entry_at(
    table: &mut [u8],
    index: usize,
    extended: bool,
    word: u64,
    bitmap: u64,
) -> bool {
    let size = if extended { 16 } else { 8 };
    let Some(start) = index.checked_mul(size) else {
        return false;
    };
    let Some(bytes) = start
        .checked_add(size)
        .and_then(|end| table.get_mut(start..end))
    else {
        return false;
    };
    bytes[..8].copy_from_slice(&word.to_be_bytes());
    if extended {
        bytes[8..].copy_from_slice(&bitmap.to_be_bytes());
    }
    true
}

impl L2Entry {
    /// Decodes the first word of entry `index` of the L2 table at `table_offset`. With
    /// extended L2 entries the zero flag (bit 0) is reserved, since the bitmap says it.
    pub fn decode(
        raw: u64,
        geometry: &Geometry,
        index: u64,
        table_offset: HostOffset,
    ) -> Result<L2Entry, FormatError> {
        let at = Location::entry(Structure::L2Table, table_offset.0, index);
        if raw & L2_COMPRESSED != 0 {
            if raw & L2_COPIED != 0 {
                return Err(FormatError::InvalidValue {
                    at,
                    field: "L2 entry",
                    value: raw,
                    reason: "COPIED flag set on a compressed cluster",
                });
            }
            if geometry.has_data_file() {
                return Err(FormatError::InvalidValue {
                    at,
                    field: "L2 entry",
                    value: raw,
                    reason: "compressed cluster in an image with an external data file",
                });
            }
            return CompressedDescriptor::decode(raw, geometry.cluster_bits(), at)
                .map(L2Entry::Compressed);
        }
        let mut reserved = raw & L2_STANDARD_RESERVED_MASK;
        if geometry.extended_l2() {
            reserved |= raw & L2_ZERO;
        }
        if reserved != 0 {
            return Err(FormatError::ReservedBits {
                at,
                field: "L2 entry",
                bits: reserved,
            });
        }
        let offset = raw & L2_OFFSET_MASK;
        if !geometry.is_cluster_aligned(offset) {
            return Err(FormatError::Unaligned {
                at,
                field: "host cluster offset",
                offset,
                cluster_size: geometry.cluster_size(),
            });
        }
        let copied = raw & L2_COPIED != 0;
        if raw & L2_ZERO != 0 {
            let preallocated = (offset != 0).then_some(HostOffset(offset));
            return Ok(L2Entry::Zero {
                preallocated,
                copied,
            });
        }
        if offset != 0 {
            return Ok(L2Entry::Normal {
                host: HostOffset(offset),
                copied,
            });
        }
        if copied {
            // Host offset 0 is ambiguous; the spec resolves it with COPIED, which is always
            // set for clusters in an external data file.
            if geometry.has_data_file() {
                return Ok(L2Entry::Normal {
                    host: HostOffset(0),
                    copied: true,
                });
            }
            return Err(FormatError::InvalidValue {
                at,
                field: "L2 entry",
                value: raw,
                reason: "COPIED flag set on an unallocated cluster",
            });
        }
        Ok(L2Entry::Unallocated)
    }

    /// Encodes the first word of the entry.
    pub fn encode(&self, geometry: &Geometry) -> Result<u64, FormatError> {
        let at = Location::at(Structure::L2Table, 0);
        let offset_bits = |host: HostOffset| {
            if host.0 & !L2_OFFSET_MASK != 0 || !geometry.is_cluster_aligned(host.0) {
                Err(FormatError::InvalidValue {
                    at,
                    field: "host cluster offset",
                    value: host.0,
                    reason: "must be cluster-aligned and below 2^56",
                })
            } else {
                Ok(host.0)
            }
        };
        let copied_bit = |copied: bool| if copied { L2_COPIED } else { 0 };
        match *self {
            L2Entry::Unallocated => Ok(0),
            L2Entry::Zero {
                preallocated,
                copied,
            } => {
                if geometry.extended_l2() {
                    return Err(FormatError::Inconsistent {
                        at,
                        problem:
                            "extended L2 entries express zero clusters in the subcluster bitmap",
                    });
                }
                Ok(preallocated.map_or(Ok(0), offset_bits)? | L2_ZERO | copied_bit(copied))
            }
            L2Entry::Normal { host, copied } => {
                if host.0 == 0 && !(geometry.has_data_file() && copied) {
                    return Err(FormatError::Inconsistent {
                        at,
                        problem:
                            "host offset 0 is only valid with an external data file and COPIED",
                    });
                }
                Ok(offset_bits(host)? | copied_bit(copied))
            }
            L2Entry::Compressed(d) => Ok(d.encode(geometry.cluster_bits())? | L2_COMPRESSED),
        }
    }

    /// The host cluster this entry points at, if any (compressed entries return `None`).
    pub fn host_cluster(&self) -> Option<HostOffset> {
        match *self {
            L2Entry::Normal { host, .. } => Some(host),
            L2Entry::Zero { preallocated, .. } => preallocated,
            L2Entry::Unallocated | L2Entry::Compressed(_) => None,
        }
    }
}
