//! How big a new qcow2 image gets, computed exactly as `qemu-img measure` computes it, so that
//! the numbers can be compared with QEMU's and used to size a volume before a `convert`.
//!
//! Pure arithmetic, no I/O: the caller walks the source's allocation and hands each extent to
//! [`RequiredData`]. The formulas are QEMU's, including where they overestimate (the fully
//! allocated metadata is counted for the required size too), because tools that size volumes
//! rely on the numbers matching.

use crate::format::{bitmap, bitmap_data, limits};

/// Bytes of an L1 entry.
const L1_ENTRY_BYTES: u64 = 8;
/// Bytes of a refcount table entry.
const REFTABLE_ENTRY_BYTES: u64 = 8;

/// Why a size cannot be measured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeasureError {
    /// The L1 table would exceed QEMU's limit (qemu-img's words).
    #[error("The image size is too large (try using a larger cluster size)")]
    TooLarge,
    /// A cluster size that is not a power of two within 512 B..2 MiB.
    #[error("cluster size {0} is not a power of two between 512 and 2097152")]
    ClusterSize(u64),
    /// The arithmetic left 64 bits (only possible for sizes no image can have).
    #[error("the size of a {0}-byte image does not fit in 64 bits")]
    Overflow(u64),
}

/// The shape of the image being measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Cluster size in bytes (a power of two, 512..=2 MiB).
    pub cluster_size: u64,
    /// log2 of the refcount width (0..=6).
    pub refcount_order: u32,
    /// Extended (16-byte) L2 entries.
    pub extended_l2: bool,
}

impl Target {
    fn check(&self) -> Result<u64, MeasureError> {
        let cs = self.cluster_size;
        let bits = cs.trailing_zeros();
        if !cs.is_power_of_two()
            || !(limits::MIN_CLUSTER_BITS..=limits::MAX_CLUSTER_BITS).contains(&bits)
        {
            return Err(MeasureError::ClusterSize(cs));
        }
        Ok(cs)
    }

    fn l2_entry_bytes(&self) -> u64 {
        if self.extended_l2 {
            16
        } else {
            8
        }
    }

    /// Refuses a virtual size whose L1 table QEMU would not create (checked on the size the
    /// options give, before any source is looked at, as QEMU checks it).
    pub fn check_virtual_size(&self, size: u64) -> Result<(), MeasureError> {
        let cs = self.check()?;
        let clusters = size.div_ceil(cs);
        let l2_tables = clusters.div_ceil(cs / self.l2_entry_bytes());
        match l2_tables.checked_mul(L1_ENTRY_BYTES) {
            Some(b) if b <= limits::MAX_L1_SIZE_BYTES => Ok(()),
            _ => Err(MeasureError::TooLarge),
        }
    }

    /// The file size of the image fully allocated: header cluster, L2 and L1 tables for every
    /// cluster, refcount structures for all of it, and the data, as QEMU counts them
    /// (`qcow2_calc_prealloc_size`).
    pub fn fully_allocated(&self, virtual_size: u64) -> Result<u64, MeasureError> {
        let cs = self.check()?;
        let overflow = MeasureError::Overflow(virtual_size);
        let data = round_up(virtual_size, cs).ok_or(overflow.clone())?;
        let l2e = self.l2_entry_bytes();
        let l2_entries = round_up(data / cs, cs / l2e).ok_or(overflow.clone())?;
        let l2_bytes = l2_entries.checked_mul(l2e).ok_or(overflow.clone())?;
        let l1_entries = round_up(l2_bytes / cs, cs / L1_ENTRY_BYTES).ok_or(overflow.clone())?;
        let l1_bytes = l1_entries
            .checked_mul(L1_ENTRY_BYTES)
            .ok_or(overflow.clone())?;
        let meta = [cs, l2_bytes, l1_bytes]
            .iter()
            .try_fold(0u64, |acc, &b| acc.checked_add(b))
            .ok_or(overflow.clone())?;
        let counted = meta.checked_add(data).ok_or(overflow.clone())? / cs;
        let refcounts = self.refcount_metadata(counted).ok_or(overflow.clone())?;
        meta.checked_add(refcounts)
            .and_then(|m| m.checked_add(data))
            .ok_or(overflow)
    }

    /// Bytes of refcount table and blocks that count `clusters` clusters and themselves
    /// (QEMU's fixed point: blocks for everything, table clusters for the blocks).
    fn refcount_metadata(&self, clusters: u64) -> Option<u64> {
        let cs = self.cluster_size;
        let per_table_cluster = cs / REFTABLE_ENTRY_BYTES;
        let per_block = (cs * 8) >> self.refcount_order;
        let (mut table, mut blocks, mut n) = (0u64, 0u64, 0u64);
        loop {
            let last = n;
            blocks = clusters
                .checked_add(table)?
                .checked_add(blocks)?
                .div_ceil(per_block);
            table = blocks.div_ceil(per_table_cluster);
            n = clusters.checked_add(blocks)?.checked_add(table)?;
            if n == last {
                return blocks.checked_add(table)?.checked_mul(cs);
            }
        }
    }
}

/// Counts the data clusters a copy of the source needs, from its allocation extents in
/// order: a data extent takes every target cluster it touches, and the walk resumes at the
/// end of the last cluster it took, as QEMU's loop does.
#[derive(Debug, Clone)]
pub struct RequiredData {
    cluster_size: u64,
    /// Where the next extent counts from (the end of the last counted cluster).
    next: u64,
    bytes: u64,
}

impl RequiredData {
    /// A counter for a target with `cluster_size`-byte clusters.
    pub fn new(cluster_size: u64) -> RequiredData {
        RequiredData {
            cluster_size,
            next: 0,
            bytes: 0,
        }
    }

    /// Takes the extent `[start, start + len)` that reads from stored data (allocated, not
    /// zero); extents must come in increasing order.
    pub fn data(&mut self, start: u64, len: u64) {
        let cs = self.cluster_size;
        let end = start.saturating_add(len);
        let from = start.max(self.next);
        if from >= end {
            return;
        }
        let first = from - from % cs;
        let last = end.div_ceil(cs).saturating_mul(cs);
        self.bytes = self.bytes.saturating_add(last - first);
        self.next = last;
    }

    /// Bytes of data clusters counted.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// One persistent bitmap of the source, as measuring needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceBitmap {
    /// Bytes of its name.
    pub name_len: usize,
    /// Its granularity in bytes (a power of two).
    pub granularity: u64,
}

/// Bytes the source's bitmaps need in a new image of `cluster_size`-byte clusters, for a disk
/// of `disk_size` bytes: every data cluster (as if fully dirty), each bitmap's table and the
/// directory, each rounded up to clusters, as QEMU counts them.
pub fn bitmaps_size(bitmaps: &[SourceBitmap], disk_size: u64, cluster_size: u64) -> u64 {
    let mut total = 0u64;
    let mut directory = 0u64;
    for b in bitmaps {
        let bits = b.granularity.trailing_zeros().min(63) as u8;
        let clusters = bitmap_data::table_entries(disk_size, bits, cluster_size);
        total = total
            .saturating_add(clusters.saturating_mul(cluster_size))
            .saturating_add(round_up(clusters.saturating_mul(8), cluster_size).unwrap_or(u64::MAX));
        let entry = bitmap::DIRECTORY_ENTRY_FIXED_SIZE.saturating_add(b.name_len);
        directory = directory.saturating_add(round_up(entry as u64, 8).unwrap_or(u64::MAX));
    }
    total.saturating_add(round_up(directory, cluster_size).unwrap_or(u64::MAX))
}

/// `v` rounded up to a multiple of `to` (a power of two), `None` past 64 bits.
fn round_up(v: u64, to: u64) -> Option<u64> {
    v.div_ceil(to).checked_mul(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STD: Target = Target {
        cluster_size: 65536,
        refcount_order: 4,
        extended_l2: false,
    };

    #[test]
    fn fully_allocated_matches_qemu() {
        // Values printed by qemu-img 10 measure.
        assert_eq!(STD.fully_allocated(1 << 30).unwrap(), 1_074_135_040);
        assert_eq!(STD.fully_allocated(0).unwrap(), 196_608);
        assert_eq!(STD.fully_allocated(1000).unwrap(), 393_216);
        let ext = Target {
            extended_l2: true,
            ..STD
        };
        assert_eq!(ext.fully_allocated(1 << 30).unwrap(), 1_074_266_112);
        let big = Target {
            cluster_size: 2 << 20,
            ..STD
        };
        assert_eq!(big.fully_allocated(2 << 40).unwrap(), 2_199_042_129_920);
        assert_eq!(STD.fully_allocated(2 << 40).unwrap(), 2_199_359_062_016);
    }

    #[test]
    fn size_limits() {
        let small = Target {
            cluster_size: 512,
            ..STD
        };
        assert_eq!(
            small.check_virtual_size(100 << 40),
            Err(MeasureError::TooLarge)
        );
        assert!(STD.check_virtual_size(u64::MAX).is_err());
        assert!(STD.fully_allocated(u64::MAX).is_err());
        let odd = Target {
            cluster_size: 1000,
            ..STD
        };
        assert_eq!(odd.fully_allocated(1), Err(MeasureError::ClusterSize(1000)));
    }

    #[test]
    fn required_data_rounds_to_clusters_once() {
        let mut r = RequiredData::new(65536);
        r.data(512, 512);
        assert_eq!(r.bytes(), 65536);
        // The rest of that cluster is already counted.
        r.data(1024, 1024);
        assert_eq!(r.bytes(), 65536);
        r.data(65536 + 100, 65536);
        assert_eq!(r.bytes(), 3 * 65536);
        r.data(10 << 20, 1);
        assert_eq!(r.bytes(), 4 * 65536);
    }

    #[test]
    fn bitmaps_match_qemu() {
        // qemu-iotests 190: a 2 TiB disk with bitmaps of 512 B and 2 MiB granularity.
        let bms = [
            SourceBitmap {
                name_len: 2,
                granularity: 512,
            },
            SourceBitmap {
                name_len: 2,
                granularity: 2 << 20,
            },
        ];
        assert_eq!(bitmaps_size(&bms, 2 << 40, 65536), 537_198_592);
        assert_eq!(bitmaps_size(&bms, 2 << 40, 2 << 20), 545_259_520);
        assert_eq!(bitmaps_size(&[], 2 << 40, 65536), 0);
    }
}
