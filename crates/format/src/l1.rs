//! L1 table entries: a pointer to an L2 table plus the COPIED flag.

use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};

/// Bits 9-55: the L2 table offset.
pub const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bit 63: the L2 table's refcount is exactly one.
pub const L1_COPIED: u64 = 1 << 63;
/// Bits 0-8 and 56-62 must be zero.
pub const L1_RESERVED_MASK: u64 = 0x7f00_0000_0000_01ff;

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

/// Reads raw entry `index` from an L1 table held as big-endian bytes, or `None` past its end.
pub fn entry_at(table: &[u8], index: usize) -> Option<u64> {
    let start = index.checked_mul(8)?;
    let bytes = table.get(start..start.checked_add(8)?)?;
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}
