//! Refcount table entries and refcount block entries for every refcount_order 0..=6. Sub-byte
//! widths (1, 2, 4 bits) are packed least significant bits first, as the specification says;
//! wider ones are big-endian.

use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};
use super::limits;

/// Bits 0-8 of a refcount table entry must be zero.
pub(crate) const REFTABLE_RESERVED_MASK: u64 = 0x1ff;
/// Bits 9-63 of a refcount table entry hold the refcount block's offset. A checker reads the
/// offset through this mask without refusing the entry's reserved bits, as QEMU does.
pub(crate) const REFTABLE_OFFSET_MASK: u64 = !REFTABLE_RESERVED_MASK;

/// The refcount block offset a raw refcount table word points to (0: none), with its reserved
/// bits dropped rather than refused, as a checker reads it (and QEMU does).
pub fn block_of(word: u64) -> u64 {
    word & REFTABLE_OFFSET_MASK
}

/// The reserved bits set in a raw refcount table word (0 for a valid entry).
pub fn reserved_bits(word: u64) -> u64 {
    word & REFTABLE_RESERVED_MASK
}

/// Largest refcount representable with `order` (2^(2^order) - 1), or `None` if order > 6.
pub fn max_value(order: u32) -> Option<u64> {
    match order {
        0..=5 => Some((1u64 << (1u32 << order)) - 1),
        6 => Some(u64::MAX),
        _ => None,
    }
}

/// Number of refcounts a block of `block_len` bytes holds at `order`.
pub fn entries_in(block_len: usize, order: u32) -> usize {
    if order > limits::MAX_REFCOUNT_ORDER {
        return 0;
    }
    if order <= 3 {
        // 8 / bits entries per byte; saturating because a block is at most 2 MiB anyway.
        block_len.saturating_mul(8 >> order)
    } else {
        block_len / (1 << (order - 3))
    }
}

/// The bytes of a refcount block that hold refcount `index` at `order`, and the refcount's
/// index within them: a caller that changes one refcount can hand [`get`] and [`set`] just
/// those bytes. `None` for an order the format does not have or an index that overflows.
pub fn entry_bytes(order: u32, index: usize) -> Option<(std::ops::Range<usize>, usize)> {
    match order {
        0..=2 => {
            let per_byte = 8 >> order;
            let byte = index / per_byte;
            Some((byte..byte + 1, index % per_byte))
        }
        3..=6 => {
            let size = 1usize << (order - 3);
            let start = index.checked_mul(size)?;
            Some((start..start.checked_add(size)?, 0))
        }
        _ => None,
    }
}

fn index_error(block: &[u8], order: u32, index: usize) -> FormatError {
    FormatError::RefcountIndex {
        index,
        order,
        block_len: block.len(),
    }
}

/// Reads refcount `index` from a refcount block.
pub fn get(block: &[u8], order: u32, index: usize) -> Result<u64, FormatError> {
    if index >= entries_in(block.len(), order) {
        return Err(index_error(block, order, index));
    }
    let err = || index_error(block, order, index);
    Ok(match order {
        0..=2 => {
            let bits = 1usize << order;
            let bit = index * bits; // index < len * 8 / bits, so no overflow
            let byte = *block.get(bit / 8).ok_or_else(err)?;
            let mask = (1u8 << bits) - 1; // bits is 1, 2 or 4
            u64::from((byte >> (bit % 8)) & mask)
        }
        3 => u64::from(*block.get(index).ok_or_else(err)?),
        4 => u64::from(u16::from_be_bytes(word::<2>(block, index).ok_or_else(err)?)),
        5 => u64::from(u32::from_be_bytes(word::<4>(block, index).ok_or_else(err)?)),
        6 => u64::from_be_bytes(word::<8>(block, index).ok_or_else(err)?),
        _ => return Err(err()),
    })
}

fn word<const N: usize>(block: &[u8], index: usize) -> Option<[u8; N]> {
    let start = index.checked_mul(N)?;
    block.get(start..start.checked_add(N)?)?.try_into().ok()
}

/// Writes refcount `index` into a refcount block; fails if `value` does not fit the width.
pub fn set(block: &mut [u8], order: u32, index: usize, value: u64) -> Result<(), FormatError> {
    let Some(max) = max_value(order) else {
        return Err(index_error(block, order, index));
    };
    if value > max {
        return Err(FormatError::RefcountTooLarge {
            value,
            bits: 1 << order,
        });
    }
    if index >= entries_in(block.len(), order) {
        return Err(index_error(block, order, index));
    }
    let len = block.len();
    let err = || FormatError::RefcountIndex {
        index,
        order,
        block_len: len,
    };
    // `value <= max` was checked, so the narrowing conversions below are lossless.
    match order {
        0..=2 => {
            let bits = 1usize << order;
            let bit = index * bits;
            let mask = ((1u16 << bits) - 1) as u8;
            let byte = block.get_mut(bit / 8).ok_or_else(err)?;
            let shift = bit % 8;
            *byte = (*byte & !(mask << shift)) | ((value as u8) << shift);
        }
        3 => *block.get_mut(index).ok_or_else(err)? = value as u8,
        4 => put(block, index, &(value as u16).to_be_bytes()).ok_or_else(err)?,
        5 => put(block, index, &(value as u32).to_be_bytes()).ok_or_else(err)?,
        _ => put(block, index, &value.to_be_bytes()).ok_or_else(err)?,
    }
    Ok(())
}

fn put(block: &mut [u8], index: usize, bytes: &[u8]) -> Option<()> {
    let start = index.checked_mul(bytes.len())?;
    block
        .get_mut(start..start.checked_add(bytes.len())?)?
        .copy_from_slice(bytes);
    Some(())
}

/// One decoded refcount table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefcountTableEntry {
    /// Where the refcount block is, or `None` if all its refcounts are zero.
    pub block_offset: Option<HostOffset>,
}

impl RefcountTableEntry {
    /// Decodes entry `index` of the refcount table at `table_offset`.
    pub fn decode(
        raw: u64,
        geometry: &Geometry,
        index: u64,
        table_offset: HostOffset,
    ) -> Result<RefcountTableEntry, FormatError> {
        let at = Location::entry(Structure::RefcountTable, table_offset.0, index);
        let reserved = raw & REFTABLE_RESERVED_MASK;
        if reserved != 0 {
            return Err(FormatError::ReservedBits {
                at,
                field: "refcount table entry",
                bits: reserved,
            });
        }
        if !geometry.is_cluster_aligned(raw) {
            return Err(FormatError::Unaligned {
                at,
                field: "refcount block offset",
                offset: raw,
                cluster_size: geometry.cluster_size(),
            });
        }
        if raw > limits::MAX_FILE_OFFSET {
            return Err(FormatError::InvalidValue {
                at,
                field: "refcount block offset",
                value: raw,
                reason: "past the largest file offset (2^63 - 1)",
            });
        }
        Ok(RefcountTableEntry {
            block_offset: (raw != 0).then_some(HostOffset(raw)),
        })
    }

    /// Encodes the entry.
    pub fn encode(&self) -> Result<u64, FormatError> {
        let raw = self.block_offset.map_or(0, |o| o.0);
        if raw & REFTABLE_RESERVED_MASK != 0 || raw > limits::MAX_FILE_OFFSET {
            return Err(FormatError::InvalidValue {
                at: Location::at(Structure::RefcountTable, 0),
                field: "refcount block offset",
                value: raw,
                reason: "must be a multiple of 512 below 2^63",
            });
        }
        Ok(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refcount_read_through_its_own_bytes_is_the_one_in_the_block() {
        for order in 0..=6u32 {
            let max = max_value(order).unwrap();
            let mut block = vec![0u8; 64];
            for index in 0..entries_in(block.len(), order) {
                set(&mut block, order, index, (index as u64 * 7 + 1) & max).unwrap();
            }
            for index in 0..entries_in(block.len(), order) {
                let (bytes, within) = entry_bytes(order, index).unwrap();
                let mut part = block[bytes.clone()].to_vec();
                assert_eq!(
                    get(&part, order, within).unwrap(),
                    get(&block, order, index).unwrap()
                );
                set(&mut part, order, within, 0).unwrap();
                let mut whole = block.clone();
                set(&mut whole, order, index, 0).unwrap();
                assert_eq!(part, whole[bytes]);
            }
        }
        assert_eq!(entry_bytes(7, 0), None);
        assert_eq!(entry_bytes(6, usize::MAX), None);
    }

    #[test]
    fn table_word_accessors_split_offset_and_reserved_bits() {
        let block = 0x0000_0001_0000_0000;
        assert_eq!(block_of(block), block);
        assert_eq!(reserved_bits(block), 0);
        // A checker reads the offset of a word with reserved bits set; decode refuses it.
        let bad = block | 0x101;
        assert_eq!(block_of(bad), block);
        assert_eq!(reserved_bits(bad), 0x101);
        let g = Geometry::new(16, false, 4, 0).unwrap();
        assert!(RefcountTableEntry::decode(bad, &g, 0, HostOffset(0)).is_err());
        let entry = RefcountTableEntry::decode(block, &g, 0, HostOffset(0)).unwrap();
        assert_eq!(entry.block_offset, Some(HostOffset(block_of(block))));
        assert_eq!(entry.encode().unwrap(), block);
    }

    #[test]
    fn sub_byte_widths_are_lsb_first() {
        let mut block = [0u8; 2];
        set(&mut block, 0, 0, 1).unwrap();
        set(&mut block, 0, 9, 1).unwrap();
        assert_eq!(block, [0b0000_0001, 0b0000_0010]);
        let mut block = [0u8; 1];
        set(&mut block, 1, 1, 3).unwrap();
        assert_eq!(block, [0b0000_1100]);
        let mut block = [0u8; 1];
        set(&mut block, 2, 1, 0xa).unwrap();
        assert_eq!(block, [0xa0]);
        assert_eq!(get(&block, 2, 0).unwrap(), 0);
        assert_eq!(get(&block, 2, 1).unwrap(), 0xa);
    }

    #[test]
    fn wide_widths_are_big_endian() {
        let mut block = [0u8; 16];
        set(&mut block, 4, 1, 0x1234).unwrap();
        assert_eq!(&block[2..4], &[0x12, 0x34]);
        set(&mut block, 6, 1, u64::MAX).unwrap();
        assert_eq!(get(&block, 6, 1).unwrap(), u64::MAX);
    }

    #[test]
    fn values_that_do_not_fit_and_bad_indices_are_errors() {
        let mut block = [0u8; 8];
        for order in 0..=5 {
            let max = max_value(order).unwrap();
            assert!(matches!(
                set(&mut block, order, 0, max + 1),
                Err(FormatError::RefcountTooLarge { .. })
            ));
            let entries = entries_in(block.len(), order);
            assert!(matches!(
                get(&block, order, entries),
                Err(FormatError::RefcountIndex { .. })
            ));
            assert!(matches!(
                set(&mut block, order, entries, 0),
                Err(FormatError::RefcountIndex { .. })
            ));
        }
        assert!(get(&block, 7, 0).is_err());
        assert!(set(&mut block, 7, 0, 0).is_err());
        assert!(get(&block, 6, usize::MAX).is_err());
    }
}
