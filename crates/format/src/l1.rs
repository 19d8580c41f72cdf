//! L1 table entries: a pointer to an L2 table plus the COPIED flag.

use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};

/// Bits 9-55: the L2 table offset.
pub(crate) const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bit 63: the L2 table's refcount is exactly one.
pub(crate) const L1_COPIED: u64 = 1 << 63;
/// Bits 0-8 and 56-62 must be zero.
pub(crate) const L1_RESERVED_MASK: u64 = 0x7f00_0000_0000_01ff;

/// One decoded L1 table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L1Entry {
    /// Where the L2 table is, or `None` if the whole range is unallocated.
    pub l2_offset: Option<HostOffset>,
    /// The L2 table's refcount is exactly one (writes need no COW of the table).
    pub copied: bool,
}

impl L1Entry {
    /// An entry with no L2 table.
    pub const UNALLOCATED: L1Entry = L1Entry {
        l2_offset: None,
        copied: false,
    };

    /// Decodes entry `index` of the L1 table at `table_offset`.
    pub fn decode(
        raw: u64,
        geometry: &Geometry,
        index: u64,
        table_offset: HostOffset,
    ) -> Result<L1Entry, FormatError> {
        let at = Location::entry(Structure::L1Table, table_offset.0, index);
        let reserved = raw & L1_RESERVED_MASK;
        if reserved != 0 {
            return Err(FormatError::ReservedBits {
                at,
                field: "L1 entry",
                bits: reserved,
            });
        }
        let offset = raw & L1_OFFSET_MASK;
        if !geometry.is_cluster_aligned(offset) {
            return Err(FormatError::Unaligned {
                at,
                field: "L2 table offset",
                offset,
                cluster_size: geometry.cluster_size(),
            });
        }
        let copied = raw & L1_COPIED != 0;
        if offset == 0 && copied {
            return Err(FormatError::InvalidValue {
                at,
                field: "L1 entry",
                value: raw,
                reason: "COPIED flag set on an entry without an L2 table",
            });
        }
        Ok(L1Entry {
            l2_offset: (offset != 0).then_some(HostOffset(offset)),
            copied,
        })
    }

    /// Encodes the entry; fails if the offset is not representable (≥ 2^56 or below 512-byte
    /// granularity).
    pub fn encode(&self) -> Result<u64, FormatError> {
        let offset = self.l2_offset.map_or(0, |o| o.0);
        if offset & !L1_OFFSET_MASK != 0 {
            return Err(FormatError::InvalidValue {
                at: Location::at(Structure::L1Table, 0),
                field: "L2 table offset",
                value: offset,
                reason: "must be a multiple of 512 below 2^56",
            });
        }
        Ok(offset | if self.copied { L1_COPIED } else { 0 })
    }
}

/// The L2 table offset a raw L1 word points to (0: none), read without judging its reserved
/// bits, as the engine and the checker need for words already in memory.
pub fn table_of(word: u64) -> u64 {
    word & L1_OFFSET_MASK
}

/// True when a raw L1 word has the COPIED flag (its L2 table's refcount is exactly one).
pub fn is_copied(word: u64) -> bool {
    word & L1_COPIED != 0
}

/// The reserved bits set in a raw L1 word (0 for a valid entry).
pub fn reserved_bits(word: u64) -> u64 {
    word & L1_RESERVED_MASK
}

/// `word` with the COPIED flag set or cleared, every other bit kept.
pub fn with_copied(word: u64, copied: bool) -> u64 {
    if copied {
        word | L1_COPIED
    } else {
        word & !L1_COPIED
    }
}

/// The word of an L2 table at `table` that only this L1 entry uses (refcount one).
pub fn owned_word(table: u64) -> u64 {
    table | L1_COPIED
}

/// Reads raw entry `index` from an L1 table held as big-endian bytes, or `None` past its end.
pub fn entry_at(table: &[u8], index: usize) -> Option<u64> {
    let start = index.checked_mul(8)?;
    let bytes = table.get(start..start.checked_add(8)?)?;
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_word_accessors_split_offset_flag_and_reserved_bits() {
        let table = 0x0012_3456_789a_0000;
        let word = owned_word(table);
        assert_eq!(table_of(word), table);
        assert!(is_copied(word));
        assert_eq!(reserved_bits(word), 0);
        assert!(!is_copied(with_copied(word, false)));
        assert_eq!(with_copied(with_copied(word, false), true), word);
        // Reserved bits are reported, and never leak into the offset.
        let bad = word | 0x0100_0000_0000_0001;
        assert_eq!(reserved_bits(bad), 0x0100_0000_0000_0001);
        assert_eq!(table_of(bad), table);
        assert_eq!(table_of(0), 0);
        assert!(!is_copied(table));
    }

    #[test]
    fn accessors_agree_with_decode_and_encode() {
        let g = Geometry::new(16, false, 4, 1 << 30).unwrap();
        let entry = L1Entry {
            l2_offset: Some(HostOffset(5 << 16)),
            copied: true,
        };
        let word = entry.encode().unwrap();
        assert_eq!(word, owned_word(5 << 16));
        let back = L1Entry::decode(word, &g, 0, HostOffset(0)).unwrap();
        assert_eq!(back.l2_offset, Some(HostOffset(table_of(word))));
        assert_eq!(back.copied, is_copied(word));
    }
}
