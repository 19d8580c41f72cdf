//! Persistent dirty bitmaps: the bitmaps header extension, bitmap directory entries and bitmap
//! table entries.

use std::collections::HashSet;

use super::be;
use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};
use super::limits;

/// Bitmap flag: the bitmap was not saved cleanly and may be inconsistent.
pub const FLAG_IN_USE: u32 = 1 << 0;
/// Bitmap flag: the bitmap tracks every write (it is enabled).
pub const FLAG_AUTO: u32 = 1 << 1;
/// Bitmap flag: unknown extra data may be ignored.
pub const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 1 << 2;
/// Flags bits 3-31 are reserved.
pub const FLAGS_RESERVED: u32 = !(FLAG_IN_USE | FLAG_AUTO | FLAG_EXTRA_DATA_COMPATIBLE);
/// The only defined bitmap type.
pub const TYPE_DIRTY_TRACKING: u8 = 1;
/// Size of the fixed part of a bitmap directory entry.
pub const DIRECTORY_ENTRY_FIXED_SIZE: usize = 24;

/// The bitmaps header extension (24 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapsExtension {
    /// Number of bitmaps in the directory.
    pub nb_bitmaps: u32,
    /// Reserved, must be zero (kept so a rewrite preserves it).
    pub reserved: u32,
    /// Bitmap directory size in bytes.
    pub directory_size: u64,
    /// Bitmap directory file offset.
    pub directory_offset: u64,
}

impl BitmapsExtension {
    /// Encoded size in bytes.
    pub const SIZE: usize = 24;

    /// Decodes the extension data; only the length is checked here, because an extension
    /// that the autoclear bit marks inconsistent is ignored, not validated.
    pub fn decode(data: &[u8], at: Location) -> Result<BitmapsExtension, FormatError> {
        if data.len() != Self::SIZE {
            return Err(FormatError::InvalidValue {
                at,
                field: "bitmaps extension length",
                value: data.len() as u64,
                reason: "must be 24",
            });
        }
        Ok(BitmapsExtension {
            nb_bitmaps: be::u32_at(data, 0, at, "nb_bitmaps")?,
            reserved: be::u32_at(data, 4, at, "reserved")?,
            directory_size: be::u64_at(data, 8, at, "bitmap_directory_size")?,
            directory_offset: be::u64_at(data, 16, at, "bitmap_directory_offset")?,
        })
    }

    /// The checks QEMU applies to a consistent bitmaps extension.
    pub fn validate(&self, cluster_size: u64, at: Location) -> Result<(), FormatError> {
        if self.reserved != 0 {
            return Err(FormatError::ReservedBits {
                at,
                field: "bitmaps extension",
                bits: self.reserved.into(),
            });
        }
        if self.nb_bitmaps > limits::MAX_BITMAPS {
            return Err(FormatError::LimitExceeded {
                at,
                field: "nb_bitmaps",
                value: self.nb_bitmaps.into(),
                limit: limits::MAX_BITMAPS.into(),
                why: "QEMU supports at most 65535 bitmaps",
            });
        }
        if self.nb_bitmaps == 0 {
            return Err(FormatError::InvalidValue {
                at,
                field: "nb_bitmaps",
                value: 0,
                reason: "a bitmaps extension must describe at least one bitmap",
            });
        }
        if self.directory_offset % cluster_size != 0 {
            return Err(FormatError::Unaligned {
                at,
                field: "bitmap_directory_offset",
                offset: self.directory_offset,
                cluster_size,
            });
        }
        if self.directory_size > limits::MAX_BITMAP_DIRECTORY_SIZE {
            return Err(FormatError::LimitExceeded {
                at,
                field: "bitmap_directory_size",
                value: self.directory_size,
                limit: limits::MAX_BITMAP_DIRECTORY_SIZE,
                why: "at most 1 KiB per bitmap",
            });
        }
        if self.directory_size == 0 {
            return Err(FormatError::InvalidValue {
                at,
                field: "bitmap_directory_size",
                value: 0,
                reason: "the directory of a non-empty bitmap list cannot be empty",
            });
        }
        if self
            .directory_offset
            .checked_add(self.directory_size)
            .is_none_or(|end| end > limits::MAX_FILE_OFFSET)
        {
            return Err(FormatError::InvalidValue {
                at,
                field: "bitmap_directory_offset",
                value: self.directory_offset,
                reason: "directory would end past the largest file offset",
            });
        }
        Ok(())
    }

    /// Encodes the extension data.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut out = [0u8; Self::SIZE];
        out[0..4].copy_from_slice(&self.nb_bitmaps.to_be_bytes());
        out[4..8].copy_from_slice(&self.reserved.to_be_bytes());
        out[8..16].copy_from_slice(&self.directory_size.to_be_bytes());
        out[16..24].copy_from_slice(&self.directory_offset.to_be_bytes());
        out
    }
}

/// One bitmap directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapDirectoryEntry {
    /// File offset of the bitmap table.
    pub table_offset: u64,
    /// Entries in the bitmap table.
    pub table_size: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Bitmap type (1: dirty tracking).
    pub bitmap_type: u8,
    /// log2 of the bytes of guest disk one bit covers.
    pub granularity_bits: u8,
    /// Name (not NUL-terminated, unique in the image).
    pub name: Vec<u8>,
    /// Type-specific extra data, kept verbatim.
    pub extra_data: Vec<u8>,
}

impl BitmapDirectoryEntry {
    /// Bytes of guest disk per bitmap bit.
    pub fn granularity(&self) -> u64 {
        1u64.checked_shl(self.granularity_bits.into()).unwrap_or(0)
    }

    /// The bitmap was not saved cleanly.
    pub fn in_use(&self) -> bool {
        self.flags & FLAG_IN_USE != 0
    }

    /// The bitmap is enabled (tracks writes).
    pub fn auto(&self) -> bool {
        self.flags & FLAG_AUTO != 0
    }

    /// QEMU's per-entry constraints that depend on the disk (the rest of `check_dir_entry`):
    /// the data the table addresses is at most 512 MiB, and a bitmap saved cleanly (not in
    /// use) addresses the whole disk of `disk_size` bytes. An in-use bitmap may be too short,
    /// as one not saved after a resize is.
    pub fn check_table_size(
        &self,
        disk_size: u64,
        cluster_size: u64,
        at: Location,
    ) -> Result<(), FormatError> {
        let data = u64::from(self.table_size).saturating_mul(cluster_size);
        if data > limits::MAX_BITMAP_DATA_BYTES {
            return Err(FormatError::LimitExceeded {
                at,
                field: "bitmap_table_size",
                value: self.table_size.into(),
                limit: limits::MAX_BITMAP_DATA_BYTES / cluster_size.max(1),
                why: "QEMU's limit of 512 MiB of data per bitmap",
            });
        }
        // QEMU measures the disk in whole sectors. data <= 2^29 and granularity_bits <= 31
        // (checked when decoded), so the covered size fits in 64 bits.
        let disk = disk_size.div_ceil(512).saturating_mul(512);
        let covered = data
            .saturating_mul(8)
            .checked_shl(self.granularity_bits.into())
            .unwrap_or(u64::MAX);
        if !self.in_use() && disk > covered {
            return Err(FormatError::InvalidValue {
                at,
                field: "bitmap_table_size",
                value: self.table_size.into(),
                reason: "too small to cover the disk at the bitmap's granularity",
            });
        }
        Ok(())
    }

    /// The name for display (invalid UTF-8 replaced).
    pub fn name_lossy(&self) -> String {
        String::from_utf8_lossy(&self.name).into_owned()
    }

    /// Encoded length including padding.
    pub fn encoded_len(&self) -> usize {
        let raw = DIRECTORY_ENTRY_FIXED_SIZE
            .saturating_add(self.extra_data.len())
            .saturating_add(self.name.len());
        be::pad8(raw).unwrap_or(usize::MAX)
    }

    /// Decodes the entry starting at `pos` in a directory buffer that starts at file offset
    /// `dir_offset`; returns it and the position of the next entry.
    pub fn decode(
        dir: &[u8],
        pos: usize,
        dir_offset: u64,
        index: u64,
        geometry: &Geometry,
    ) -> Result<(BitmapDirectoryEntry, usize), FormatError> {
        let at = Location::entry(Structure::BitmapDirectory, dir_offset, index);
        let table_offset = be::u64_at(dir, pos, at, "bitmap directory entry")?;
        let table_size = be::u32_at(dir, pos + 8, at, "bitmap directory entry")?;
        let flags = be::u32_at(dir, pos + 12, at, "bitmap directory entry")?;
        let fixed = be::array::<8>(dir, pos + 16, at, "bitmap directory entry")?;
        let [bitmap_type, granularity_bits, n0, n1, e0, e1, e2, e3] = fixed;
        let name_size = u16::from_be_bytes([n0, n1]);
        let extra_data_size = u32::from_be_bytes([e0, e1, e2, e3]);

        let extra_start = pos + DIRECTORY_ENTRY_FIXED_SIZE;
        let extra_len = be::to_usize(extra_data_size.into(), at, "extra_data_size")?;
        let extra_data =
            be::bytes_at(dir, extra_start, extra_len, at, "bitmap extra data")?.to_vec();
        let name_start = extra_start + extra_len; // both bounded by dir.len()
        let name = be::bytes_at(dir, name_start, name_size.into(), at, "bitmap name")?.to_vec();
        let end = name_start + usize::from(name_size);
        let next = be::pad8(end).ok_or(FormatError::Overflow {
            at,
            what: "next directory entry",
        })?;
        let padding = be::bytes_at(dir, end, next - end, at, "bitmap directory entry padding")?;
        if padding.iter().any(|&b| b != 0) {
            return Err(FormatError::InvalidValue {
                at,
                field: "padding",
                value: padding
                    .iter()
                    .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)),
                reason: "bitmap directory entry padding must be zero",
            });
        }

        let entry = BitmapDirectoryEntry {
            table_offset,
            table_size,
            flags,
            bitmap_type,
            granularity_bits,
            name,
            extra_data,
        };
        entry.validate(geometry, at)?;
        Ok((entry, next))
    }

    /// QEMU's per-entry constraints (`check_dir_entry`), except the file-length check, which
    /// needs the file and lives in `inspect`.
    fn validate(&self, geometry: &Geometry, at: Location) -> Result<(), FormatError> {
        let invalid = |field, value: u64, reason| {
            Err(FormatError::InvalidValue {
                at,
                field,
                value,
                reason,
            })
        };
        if self.table_size == 0 {
            return invalid("bitmap_table_size", 0, "must not be zero");
        }
        if self.table_size > limits::MAX_BITMAP_TABLE_ENTRIES {
            return Err(FormatError::LimitExceeded {
                at,
                field: "bitmap_table_size",
                value: self.table_size.into(),
                limit: limits::MAX_BITMAP_TABLE_ENTRIES.into(),
                why: "QEMU's bitmap table limit",
            });
        }
        if self.table_offset == 0 {
            return invalid("bitmap_table_offset", 0, "must not be zero");
        }
        if !geometry.is_cluster_aligned(self.table_offset) {
            return Err(FormatError::Unaligned {
                at,
                field: "bitmap_table_offset",
                offset: self.table_offset,
                cluster_size: geometry.cluster_size(),
            });
        }
        let table_end = u64::from(self.table_size)
            .checked_mul(8)
            .and_then(|len| self.table_offset.checked_add(len));
        if table_end.is_none_or(|end| end > limits::MAX_FILE_OFFSET) {
            return invalid(
                "bitmap_table_offset",
                self.table_offset,
                "table would end past the largest file offset",
            );
        }
        if !(limits::MIN_BITMAP_GRANULARITY_BITS..=limits::MAX_BITMAP_GRANULARITY_BITS)
            .contains(&self.granularity_bits)
        {
            return invalid(
                "granularity_bits",
                self.granularity_bits.into(),
                "QEMU supports 9..=31",
            );
        }
        if self.flags & FLAGS_RESERVED != 0 {
            return Err(FormatError::ReservedBits {
                at,
                field: "flags",
                bits: (self.flags & FLAGS_RESERVED).into(),
            });
        }
        if self.name.is_empty() {
            return invalid("name_size", 0, "must not be zero");
        }
        if self.name.len() > usize::from(limits::MAX_BITMAP_NAME) {
            return Err(FormatError::LimitExceeded {
                at,
                field: "name_size",
                value: self.name.len() as u64,
                limit: limits::MAX_BITMAP_NAME.into(),
                why: "QEMU supports bitmap names up to 1023 bytes",
            });
        }
        if self.bitmap_type != TYPE_DIRTY_TRACKING {
            return invalid(
                "type",
                self.bitmap_type.into(),
                "only type 1 (dirty tracking) is defined",
            );
        }
        Ok(())
    }

    /// Appends the encoded entry (with zero padding) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), FormatError> {
        let at = Location::at(Structure::BitmapDirectory, 0);
        let name_size = u16::try_from(self.name.len()).map_err(|_| FormatError::InvalidValue {
            at,
            field: "name_size",
            value: self.name.len() as u64,
            reason: "does not fit in 16 bits",
        })?;
        let extra_size =
            u32::try_from(self.extra_data.len()).map_err(|_| FormatError::InvalidValue {
                at,
                field: "extra_data_size",
                value: self.extra_data.len() as u64,
                reason: "does not fit in 32 bits",
            })?;
        let start = out.len();
        out.extend_from_slice(&self.table_offset.to_be_bytes());
        out.extend_from_slice(&self.table_size.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.push(self.bitmap_type);
        out.push(self.granularity_bits);
        out.extend_from_slice(&name_size.to_be_bytes());
        out.extend_from_slice(&extra_size.to_be_bytes());
        out.extend_from_slice(&self.extra_data);
        out.extend_from_slice(&self.name);
        let len = out.len() - start;
        out.resize(start + be::pad8(len).unwrap_or(len), 0);
        Ok(())
    }
}

/// Decodes a whole bitmap directory (the `directory_size` bytes at `ext.directory_offset`),
/// checking that it holds exactly `ext.nb_bitmaps` entries with unique names.
pub fn decode_directory(
    dir: &[u8],
    ext: &BitmapsExtension,
    geometry: &Geometry,
) -> Result<Vec<BitmapDirectoryEntry>, FormatError> {
    let at = Location::at(Structure::BitmapDirectory, ext.directory_offset);
    let size = be::to_usize(ext.directory_size, at, "bitmap_directory_size")?;
    let dir = be::bytes_at(dir, 0, size, at, "bitmap directory")?;
    let mut entries = Vec::new();
    let mut names = HashSet::new();
    let mut pos = 0usize;
    while pos < dir.len() {
        let index = entries.len() as u64;
        if index >= u64::from(ext.nb_bitmaps) {
            return Err(FormatError::Inconsistent {
                at,
                problem:
                    "the directory holds more bitmaps than nb_bitmaps in the bitmaps extension",
            });
        }
        let (entry, next) =
            BitmapDirectoryEntry::decode(dir, pos, ext.directory_offset, index, geometry)?;
        if !names.insert(entry.name.clone()) {
            return Err(FormatError::Inconsistent {
                at: Location::entry(Structure::BitmapDirectory, ext.directory_offset, index),
                problem: "bitmap name is not unique",
            });
        }
        entries.push(entry);
        pos = next;
    }
    if entries.len() as u64 != u64::from(ext.nb_bitmaps) {
        return Err(FormatError::Inconsistent {
            at,
            problem: "the directory holds fewer bitmaps than nb_bitmaps in the bitmaps extension",
        });
    }
    Ok(entries)
}

/// Encodes a whole bitmap directory.
pub fn encode_directory(entries: &[BitmapDirectoryEntry]) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::new();
    for entry in entries {
        entry.encode(&mut out)?;
    }
    Ok(out)
}

/// Bits 9-55 of a bitmap table entry: the data cluster offset.
pub(crate) const BITMAP_TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bits 1-8 and 56-63 are reserved.
pub(crate) const BITMAP_TABLE_RESERVED_MASK: u64 = 0xff00_0000_0000_01fe;
/// Bit 0 of a bitmap table entry without a cluster: the data reads as all ones.
const BITMAP_TABLE_ALL_ONES: u64 = 1;

/// The data cluster a raw bitmap table word points to (0: none), reserved bits ignored.
pub fn table_data_of(word: u64) -> u64 {
    word & BITMAP_TABLE_OFFSET_MASK
}

/// The reserved bits set in a raw bitmap table word (0 for a valid entry).
pub fn table_reserved_bits(word: u64) -> u64 {
    word & BITMAP_TABLE_RESERVED_MASK
}

/// True when a raw bitmap table word has bit 0 set: without a cluster the data reads as all
/// ones; with one the entry is invalid.
pub fn table_all_ones(word: u64) -> bool {
    word & BITMAP_TABLE_ALL_ONES != 0
}

/// One bitmap table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BitmapTableEntry {
    /// No cluster: the bitmap data reads as all zeros.
    Zeros,
    /// No cluster: the bitmap data reads as all ones.
    Ones,
    /// Bitmap data in this cluster.
    Cluster(HostOffset),
}

impl BitmapTableEntry {
    /// Decodes entry `index` of the bitmap table at `table_offset`.
    pub fn decode(
        raw: u64,
        geometry: &Geometry,
        index: u64,
        table_offset: HostOffset,
    ) -> Result<BitmapTableEntry, FormatError> {
        let at = Location::entry(Structure::BitmapTable, table_offset.0, index);
        let reserved = raw & BITMAP_TABLE_RESERVED_MASK;
        if reserved != 0 {
            return Err(FormatError::ReservedBits {
                at,
                field: "bitmap table entry",
                bits: reserved,
            });
        }
        let offset = raw & BITMAP_TABLE_OFFSET_MASK;
        if offset == 0 {
            return Ok(if table_all_ones(raw) {
                BitmapTableEntry::Ones
            } else {
                BitmapTableEntry::Zeros
            });
        }
        if table_all_ones(raw) {
            return Err(FormatError::ReservedBits {
                at,
                field: "bitmap table entry bit 0 with an offset",
                bits: 1,
            });
        }
        if !geometry.is_cluster_aligned(offset) {
            return Err(FormatError::Unaligned {
                at,
                field: "bitmap data offset",
                offset,
                cluster_size: geometry.cluster_size(),
            });
        }
        Ok(BitmapTableEntry::Cluster(HostOffset(offset)))
    }

    /// Encodes the entry.
    pub fn encode(&self) -> Result<u64, FormatError> {
        match *self {
            BitmapTableEntry::Zeros => Ok(0),
            BitmapTableEntry::Ones => Ok(BITMAP_TABLE_ALL_ONES),
            BitmapTableEntry::Cluster(HostOffset(o))
                if o != 0 && o & !BITMAP_TABLE_OFFSET_MASK == 0 =>
            {
                Ok(o)
            }
            BitmapTableEntry::Cluster(HostOffset(o)) => Err(FormatError::InvalidValue {
                at: Location::at(Structure::BitmapTable, 0),
                field: "bitmap data offset",
                value: o,
                reason: "must be a non-zero multiple of 512 below 2^56",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_word_accessors_agree_with_decode() {
        let g = Geometry::new(16, false, 4, 0).unwrap();
        let word = BitmapTableEntry::Cluster(HostOffset(3 << 16))
            .encode()
            .unwrap();
        assert_eq!(table_data_of(word), 3 << 16);
        assert_eq!(table_reserved_bits(word), 0);
        assert!(!table_all_ones(word));
        let ones = BitmapTableEntry::Ones.encode().unwrap();
        assert!(table_all_ones(ones));
        assert_eq!(table_data_of(ones), 0);
        assert_eq!(
            BitmapTableEntry::decode(ones, &g, 0, HostOffset(0)).unwrap(),
            BitmapTableEntry::Ones
        );
        // Reserved bits are reported and kept out of the offset; decode refuses them.
        let bad = word | 0x0100_0000_0000_0002;
        assert_eq!(table_reserved_bits(bad), 0x0100_0000_0000_0002);
        assert_eq!(table_data_of(bad), 3 << 16);
        assert!(BitmapTableEntry::decode(bad, &g, 0, HostOffset(0)).is_err());
    }
}
