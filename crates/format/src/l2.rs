//! Standard (64-bit) L2 table entries: how one guest cluster maps to the file.

use super::compressed::CompressedDescriptor;
use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};

/// Bit 63: the cluster's refcount is exactly one.
pub(crate) const L2_COPIED: u64 = 1 << 63;
/// Bit 62: the cluster is compressed.
pub(crate) const L2_COMPRESSED: u64 = 1 << 62;
/// Bit 0 of a standard descriptor: the cluster reads as zeros.
pub(crate) const L2_ZERO: u64 = 1;
/// Bits 9-55 of a standard descriptor: the host cluster offset.
pub(crate) const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bits 1-8 and 56-61 of a standard descriptor must be zero.
pub(crate) const L2_STANDARD_RESERVED_MASK: u64 = 0x3f00_0000_0000_01fe;

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

/// `word` with the zero flag cleared, every other bit kept.
pub fn without_zero_flag(word: u64) -> u64 {
    word & !L2_ZERO
}

/// True when a raw entry word has the COPIED flag (its cluster's refcount is exactly one).
pub fn is_copied(word: u64) -> bool {
    word & L2_COPIED != 0
}

/// `word` with the COPIED flag set or cleared, every other bit kept.
pub fn with_copied(word: u64, copied: bool) -> u64 {
    if copied {
        word | L2_COPIED
    } else {
        word & !L2_COPIED
    }
}

/// The reserved bits set in a standard (not compressed) entry word; the zero flag is not
/// among them (extended entries reserve it too: see [`L2Entry::decode`]).
pub fn standard_reserved_bits(word: u64) -> u64 {
    word & L2_STANDARD_RESERVED_MASK
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

/// The bytes of an L2 table (or slice) that hold entry `index`, with its subcluster bitmap
/// when `extended`: what [`entry_at`] and [`set_entry_at`] read and change for that index.
pub fn entry_bytes(index: usize, extended: bool) -> Option<std::ops::Range<usize>> {
    let size = if extended { 16 } else { 8 };
    let start = index.checked_mul(size)?;
    Some(start..start.checked_add(size)?)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_read_through_its_own_bytes_is_the_one_in_the_table() {
        for extended in [false, true] {
            let mut table = vec![0u8; 256];
            assert!(set_entry_at(&mut table, 3, extended, 0x1_0000, 0x5));
            let bytes = entry_bytes(3, extended).unwrap();
            assert_eq!(
                entry_at(&table[bytes.clone()], 0, extended),
                entry_at(&table, 3, extended)
            );
            assert_eq!(bytes.len(), if extended { 16 } else { 8 });
        }
        assert_eq!(entry_bytes(usize::MAX, false), None);
    }

    #[test]
    fn raw_word_accessors_split_offset_and_flags() {
        let host = 0x0000_0042_0000_0000;
        let word = owned_word(host);
        assert_eq!(host_of(word), host);
        assert!(is_copied(word));
        assert!(!is_copied(with_copied(word, false)));
        assert_eq!(with_copied(with_copied(word, false), true), word);
        assert!(holds_cluster(word));
        assert!(!is_compressed(word));
        let zeroed = zeroed_word(word);
        assert!(has_zero_flag(zeroed));
        assert_eq!(host_of(zeroed), host);
        assert_eq!(without_zero_flag(zeroed), word);
        assert!(has_zero_flag(zeroed_word(0)));
        assert!(!holds_cluster(zeroed_word(0)));
    }

    #[test]
    fn reserved_bits_exclude_offset_flags_and_zero_bit() {
        assert_eq!(standard_reserved_bits(zeroed_word(owned_word(1 << 16))), 0);
        assert_eq!(
            standard_reserved_bits(0x0100_0000_0000_0002),
            0x0100_0000_0000_0002
        );
        // A compressed word is never read as having the zero flag.
        let compressed = compressed_word(1);
        assert!(is_compressed(compressed));
        assert!(!has_zero_flag(compressed));
        assert!(holds_cluster(compressed));
    }

    #[test]
    fn accessors_agree_with_decode() {
        let g = Geometry::new(16, false, 4, 1 << 30).unwrap();
        let word = owned_word(7 << 16);
        assert_eq!(
            L2Entry::decode(word, &g, 0, HostOffset(0)).unwrap(),
            L2Entry::Normal {
                host: HostOffset(host_of(word)),
                copied: is_copied(word),
            }
        );
        assert_eq!(
            L2Entry::decode(zeroed_word(0), &g, 0, HostOffset(0)).unwrap(),
            L2Entry::Zero {
                preallocated: None,
                copied: false,
            }
        );
    }
}
