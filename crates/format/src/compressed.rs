//! Compressed cluster descriptors: where a compressed cluster's bytes are in the file, for every
//! cluster size from 512 B (cluster_bits 9) to 2 MiB (cluster_bits 21).

use super::error::{FormatError, Location, Structure};
use super::limits;

/// Compressed data is counted in 512-byte sectors.
pub const COMPRESSED_SECTOR_SIZE: u64 = 512;

/// A decoded compressed cluster descriptor (bits 0-61 of an L2 entry with bit 62 set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressedDescriptor {
    /// Byte offset of the compressed data (not aligned to anything).
    pub host_offset: u64,
    /// Sectors used beyond the one containing `host_offset`.
    pub additional_sectors: u64,
}

/// Bit position where the sector count starts: x = 62 - (cluster_bits - 8).
fn sector_shift(cluster_bits: u32) -> u32 {
    62 - (cluster_bits - 8)
}

/// Mask of the sector count field after shifting.
fn sector_mask(cluster_bits: u32) -> u64 {
    (1u64 << (cluster_bits - 8)) - 1
}

fn check_cluster_bits(cluster_bits: u32) -> Result<(), FormatError> {
    if (limits::MIN_CLUSTER_BITS..=limits::MAX_CLUSTER_BITS).contains(&cluster_bits) {
        Ok(())
    } else {
        Err(FormatError::InvalidValue {
            at: Location::at(Structure::Header, 20),
            field: "cluster_bits",
            value: cluster_bits.into(),
            reason: "must be 9..=21",
        })
    }
}

impl CompressedDescriptor {
    /// Decodes bits 0-61 of `raw` (bits 62-63 are the L2 entry's and are ignored here).
    pub fn decode(
        raw: u64,
        cluster_bits: u32,
        at: Location,
    ) -> Result<CompressedDescriptor, FormatError> {
        check_cluster_bits(cluster_bits)?;
        let shift = sector_shift(cluster_bits);
        let host_offset = raw & ((1u64 << shift) - 1);
        if host_offset >= limits::MAX_HOST_OFFSET {
            return Err(FormatError::InvalidValue {
                at,
                field: "compressed cluster offset",
                value: host_offset,
                reason: "bits above 55 must be zero",
            });
        }
        let additional_sectors = (raw >> shift) & sector_mask(cluster_bits);
        Ok(CompressedDescriptor {
            host_offset,
            additional_sectors,
        })
    }

    /// Encodes into bits 0-61 (the caller adds bit 62).
    pub fn encode(&self, cluster_bits: u32) -> Result<u64, FormatError> {
        check_cluster_bits(cluster_bits)?;
        let shift = sector_shift(cluster_bits);
        let at = Location::at(Structure::CompressedDescriptor, self.host_offset);
        if self.host_offset >= (1u64 << shift).min(limits::MAX_HOST_OFFSET) {
            return Err(FormatError::InvalidValue {
                at,
                field: "compressed cluster offset",
                value: self.host_offset,
                reason: "does not fit in the descriptor for this cluster size",
            });
        }
        if self.additional_sectors > sector_mask(cluster_bits) {
            return Err(FormatError::InvalidValue {
                at,
                field: "compressed sector count",
                value: self.additional_sectors,
                reason: "does not fit in the descriptor for this cluster size",
            });
        }
        Ok(self.host_offset | (self.additional_sectors << shift))
    }

    /// Builds the descriptor for `len` compressed bytes stored at `host_offset`.
    pub fn for_range(
        host_offset: u64,
        len: u64,
        cluster_bits: u32,
    ) -> Result<CompressedDescriptor, FormatError> {
        let at = Location::at(Structure::CompressedDescriptor, host_offset);
        let last = host_offset
            .checked_add(len.max(1) - 1)
            .ok_or(FormatError::Overflow {
                at,
                what: "end of compressed data",
            })?;
        let d = CompressedDescriptor {
            host_offset,
            additional_sectors: last / COMPRESSED_SECTOR_SIZE
                - host_offset / COMPRESSED_SECTOR_SIZE,
        };
        d.encode(cluster_bits)?;
        Ok(d)
    }

    /// The byte range to read: from `host_offset` to the end of the last sector. The
    /// compressed stream may end earlier; the decompressor stops after one cluster.
    pub fn byte_range(&self) -> (u64, u64) {
        // additional_sectors < 2^13 and host_offset < 2^56, so nothing overflows.
        let sectors = self.additional_sectors + 1;
        let len = sectors * COMPRESSED_SECTOR_SIZE - (self.host_offset % COMPRESSED_SECTOR_SIZE);
        (self.host_offset, len)
    }
}
