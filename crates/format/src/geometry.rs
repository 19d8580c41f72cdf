//! Cluster, subcluster, L1/L2 and refcount arithmetic, with newtypes so a guest offset, a host
//! offset and a cluster index can never be passed for one another.

use super::error::{FormatError, Location, Structure};
use super::limits;

/// A byte offset in the virtual disk the guest sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestOffset(pub u64);

/// A byte offset in the image file (or the external data file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostOffset(pub u64);

/// A guest cluster number (guest offset / cluster size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestCluster(pub u64);

/// A host cluster number (host offset / cluster size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostCluster(pub u64);

/// An index into the L1 table (the L2 table that maps a guest offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct L1Index(pub u64);

/// Byte arithmetic on offsets: an offset plus a length is an offset of the same space, and
/// the distance between two offsets of one space is a length. Offsets of different spaces
/// (guest and host) cannot be subtracted from each other.
macro_rules! offset_arithmetic {
    ($t:ident) => {
        impl std::ops::Add<u64> for $t {
            type Output = $t;
            fn add(self, bytes: u64) -> $t {
                $t(self.0 + bytes)
            }
        }

        impl std::ops::Sub for $t {
            type Output = u64;
            fn sub(self, earlier: $t) -> u64 {
                self.0 - earlier.0
            }
        }
    };
}
offset_arithmetic!(GuestOffset);
offset_arithmetic!(HostOffset);

/// The shape of an image: cluster and subcluster sizes, L2 and refcount block layouts. Built
/// once from validated header fields; every method is then total (no overflow possible).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    cluster_bits: u32,
    extended_l2: bool,
    refcount_order: u32,
    virtual_size: u64,
    data_file: bool,
    l2_bits: u32,
    l1_entries_needed: u64,
}

impl Geometry {
    /// Validates the parameters against QEMU's limits and precomputes the derived sizes.
    pub fn new(
        cluster_bits: u32,
        extended_l2: bool,
        refcount_order: u32,
        virtual_size: u64,
    ) -> Result<Geometry, FormatError> {
        if !(limits::MIN_CLUSTER_BITS..=limits::MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(FormatError::InvalidValue {
                at: Location::at(Structure::Header, 20),
                field: "cluster_bits",
                value: cluster_bits.into(),
                reason: "must be 9..=21 (512 B to 2 MiB clusters)",
            });
        }
        if extended_l2 && cluster_bits < limits::MIN_CLUSTER_BITS_EXTENDED_L2 {
            return Err(FormatError::InvalidValue {
                at: Location::at(Structure::Header, 20),
                field: "cluster_bits",
                value: cluster_bits.into(),
                reason: "extended L2 entries need at least 16 KiB clusters (512 B subclusters)",
            });
        }
        if refcount_order > limits::MAX_REFCOUNT_ORDER {
            return Err(FormatError::InvalidValue {
                at: Location::at(Structure::Header, 96),
                field: "refcount_order",
                value: refcount_order.into(),
                reason: "must be 0..=6 (refcount width at most 64 bits)",
            });
        }
        // An L2 entry is 8 bytes (2^3), or 16 (2^4) when extended.
        let l2_bits = cluster_bits - if extended_l2 { 4 } else { 3 };
        // Bytes one L1 entry maps; at most 2^(21+18) so the shift cannot overflow.
        let l1_span_bits = cluster_bits + l2_bits;
        let l1_entries_needed = virtual_size.div_ceil(1u64 << l1_span_bits);
        Ok(Geometry {
            cluster_bits,
            extended_l2,
            refcount_order,
            virtual_size,
            data_file: false,
            l2_bits,
            l1_entries_needed,
        })
    }

    /// The same geometry for an image whose guest data lives in an external data file (host
    /// offset 0 is then valid, marked by the COPIED bit).
    pub fn with_data_file(mut self, data_file: bool) -> Geometry {
        self.data_file = data_file;
        self
    }

    /// The same geometry with refcounts `order` wide (2^order bits), as after amend changed
    /// the width; an order past 6 is refused.
    pub fn with_refcount_order(self, order: u32) -> Result<Geometry, FormatError> {
        Geometry::new(
            self.cluster_bits,
            self.extended_l2,
            order,
            self.virtual_size,
        )
        .map(|g| g.with_data_file(self.data_file))
    }

    /// Whether guest data lives in an external data file.
    pub fn has_data_file(&self) -> bool {
        self.data_file
    }

    /// log2 of the cluster size.
    pub fn cluster_bits(&self) -> u32 {
        self.cluster_bits
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Whether L2 entries are extended (128-bit, with subcluster bitmaps).
    pub fn extended_l2(&self) -> bool {
        self.extended_l2
    }

    /// Virtual disk size in bytes.
    pub fn virtual_size(&self) -> u64 {
        self.virtual_size
    }

    /// log2 of the subcluster size.
    pub fn subcluster_bits(&self) -> u32 {
        if self.extended_l2 {
            self.cluster_bits - 5
        } else {
            self.cluster_bits
        }
    }

    /// Subcluster size in bytes (the cluster size without extended L2).
    pub fn subcluster_size(&self) -> u64 {
        1 << self.subcluster_bits()
    }

    /// Subclusters per cluster: 32 with extended L2 entries, else 1.
    pub fn subclusters_per_cluster(&self) -> u32 {
        if self.extended_l2 {
            32
        } else {
            1
        }
    }

    /// Size of one L2 entry in bytes: 16 when extended, else 8.
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2 {
            16
        } else {
            8
        }
    }

    /// log2 of the number of entries in one L2 table.
    pub fn l2_bits(&self) -> u32 {
        self.l2_bits
    }

    /// Entries in one L2 table.
    pub fn l2_entries(&self) -> u64 {
        1 << self.l2_bits
    }

    /// L1 entries needed to map the whole virtual disk.
    pub fn l1_entries_needed(&self) -> u64 {
        self.l1_entries_needed
    }

    /// refcount_order (log2 of the refcount width).
    pub fn refcount_order(&self) -> u32 {
        self.refcount_order
    }

    /// Refcount width in bits.
    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// Refcount entries in one refcount block.
    pub fn refcount_block_entries(&self) -> u64 {
        // cluster_size * 8 / refcount_bits, as shifts: 3 - order may be negative.
        1u64 << (self.cluster_bits + 3 - self.refcount_order)
    }

    /// log2 of [`Self::refcount_block_entries`].
    pub fn refcount_block_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.refcount_order
    }

    /// The guest cluster containing `offset`.
    pub fn guest_cluster(&self, offset: GuestOffset) -> GuestCluster {
        GuestCluster(offset.0 >> self.cluster_bits)
    }

    /// The host cluster containing `offset`.
    pub fn host_cluster(&self, offset: HostOffset) -> HostCluster {
        HostCluster(offset.0 >> self.cluster_bits)
    }

    /// Start of guest cluster `cluster`, or `None` if it lies past 2^64.
    pub fn guest_cluster_offset(&self, cluster: GuestCluster) -> Option<GuestOffset> {
        cluster.0.checked_mul(self.cluster_size()).map(GuestOffset)
    }

    /// Start of host cluster `cluster`, or `None` if it lies past 2^64.
    pub fn host_cluster_offset(&self, cluster: HostCluster) -> Option<HostOffset> {
        cluster.0.checked_mul(self.cluster_size()).map(HostOffset)
    }

    /// Index into the L1 table for a guest offset.
    pub fn l1_index(&self, offset: GuestOffset) -> L1Index {
        L1Index(offset.0 >> (self.cluster_bits + self.l2_bits))
    }

    /// Index into the L2 table for a guest offset.
    pub fn l2_index(&self, offset: GuestOffset) -> usize {
        let index = (offset.0 >> self.cluster_bits) & (self.l2_entries() - 1);
        // Masked to below 2^18, so the conversion is lossless on every platform we build for.
        index as usize
    }

    /// Index of the subcluster containing a guest offset (always 0 without extended L2).
    pub fn subcluster_index(&self, offset: GuestOffset) -> u32 {
        let index =
            (offset.0 >> self.subcluster_bits()) & u64::from(self.subclusters_per_cluster() - 1);
        // Masked to below 32.
        index as u32
    }

    /// Byte offset inside its cluster.
    pub fn offset_in_cluster(&self, offset: u64) -> u64 {
        offset & (self.cluster_size() - 1)
    }

    /// Byte offset inside its subcluster.
    pub fn offset_in_subcluster(&self, offset: u64) -> u64 {
        offset & (self.subcluster_size() - 1)
    }

    /// Whether `offset` is a multiple of the cluster size.
    pub fn is_cluster_aligned(&self, offset: u64) -> bool {
        self.offset_in_cluster(offset) == 0
    }

    /// Rounds down to a cluster boundary.
    pub fn align_down(&self, offset: u64) -> u64 {
        offset & !(self.cluster_size() - 1)
    }

    /// Rounds up to a cluster boundary, or `None` on overflow.
    pub fn align_up(&self, offset: u64) -> Option<u64> {
        offset
            .checked_add(self.cluster_size() - 1)
            .map(|v| self.align_down(v))
    }

    /// Number of clusters needed to hold `bytes` bytes.
    pub fn size_to_clusters(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.cluster_size())
    }

    /// Index into the refcount table for a host offset.
    pub fn refcount_table_index(&self, offset: HostOffset) -> u64 {
        offset.0 >> (self.cluster_bits + self.refcount_block_bits())
    }

    /// Index into the refcount block for a host offset.
    pub fn refcount_block_index(&self, offset: HostOffset) -> usize {
        let index = (offset.0 >> self.cluster_bits) & (self.refcount_block_entries() - 1);
        // Masked to below 2^24 (2 MiB clusters, 1-bit refcounts).
        index as usize
    }

    /// Checks that a table is within its size limit, cluster-aligned and addressable (what
    /// QEMU's `qcow2_validate_table` checks before reading any table).
    pub fn validate_table(&self, table: &TableBounds) -> Result<(), FormatError> {
        let at = table.at;
        let max_entries = table.max_bytes / table.entry_size.max(1);
        if table.entries > max_entries {
            return Err(FormatError::LimitExceeded {
                at,
                field: table.size_field,
                value: table.entries,
                limit: max_entries,
                why: table.why,
            });
        }
        if !self.is_cluster_aligned(table.offset) {
            return Err(FormatError::Unaligned {
                at,
                field: table.offset_field,
                offset: table.offset,
                cluster_size: self.cluster_size(),
            });
        }
        // entries * entry_size <= max_bytes, so the product cannot overflow.
        match table.offset.checked_add(table.entries * table.entry_size) {
            Some(end) if end <= limits::MAX_FILE_OFFSET => Ok(()),
            _ => Err(FormatError::InvalidValue {
                at,
                field: table.offset_field,
                value: table.offset,
                reason: "table would end past the largest file offset (2^63 - 1)",
            }),
        }
    }
}

/// A table's placement as the header describes it, for [`Geometry::validate_table`].
#[derive(Debug, Clone, Copy)]
pub struct TableBounds {
    /// Where errors point.
    pub at: Location,
    /// Name of the offset field.
    pub offset_field: &'static str,
    /// File offset of the table.
    pub offset: u64,
    /// Name of the size field.
    pub size_field: &'static str,
    /// Number of entries.
    pub entries: u64,
    /// Bytes per entry.
    pub entry_size: u64,
    /// QEMU's limit on the table size in bytes.
    pub max_bytes: u64,
    /// Why that limit exists.
    pub why: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_a_guest_offset_into_indices() {
        let g = Geometry::new(16, false, 4, 1 << 30).unwrap();
        assert_eq!(g.cluster_size(), 65536);
        assert_eq!(g.l2_entries(), 8192);
        let off = GuestOffset((3 << 29) + (5 << 16) + 123);
        assert_eq!(g.l1_index(off), L1Index(3));
        assert_eq!(g.l2_index(off), 5);
        assert_eq!(g.subcluster_index(off), 0);
        assert_eq!(g.offset_in_cluster(off.0), 123);
        assert_eq!(g.l1_entries_needed(), 2);
    }

    #[test]
    fn extended_l2_halves_l2_entries_and_has_32_subclusters() {
        let g = Geometry::new(16, true, 4, 1 << 30).unwrap();
        assert_eq!(g.l2_entries(), 4096);
        assert_eq!(g.l2_entry_size(), 16);
        assert_eq!(g.subclusters_per_cluster(), 32);
        assert_eq!(g.subcluster_size(), 2048);
        assert_eq!(g.subcluster_index(GuestOffset(65536 + 2048 * 7 + 1)), 7);
        assert_eq!(g.subcluster_index(GuestOffset(65535)), 31);
    }

    #[test]
    fn refcount_indices_for_every_order() {
        for order in 0..=6 {
            let g = Geometry::new(16, false, order, 0).unwrap();
            let entries = 65536 * 8 / (1u64 << order);
            assert_eq!(g.refcount_block_entries(), entries);
            let off = HostOffset((entries * 2 + 9) * 65536);
            assert_eq!(g.refcount_table_index(off), 2);
            assert_eq!(g.refcount_block_index(off), 9);
        }
    }

    #[test]
    fn rejects_out_of_range_parameters() {
        assert!(Geometry::new(8, false, 4, 0).is_err());
        assert!(Geometry::new(22, false, 4, 0).is_err());
        assert!(Geometry::new(13, true, 4, 0).is_err());
        assert!(Geometry::new(14, true, 4, 0).is_ok());
        assert!(Geometry::new(16, false, 7, 0).is_err());
    }

    #[test]
    fn l1_entries_needed_handles_the_largest_size_without_overflow() {
        let g = Geometry::new(9, false, 4, u64::MAX).unwrap();
        assert_eq!(g.l1_entries_needed(), u64::MAX.div_ceil(1 << 15));
    }

    #[test]
    fn alignment_helpers() {
        let g = Geometry::new(12, false, 4, 0).unwrap();
        assert_eq!(g.align_down(8191), 4096);
        assert_eq!(g.align_up(4097), Some(8192));
        assert_eq!(g.align_up(u64::MAX), None);
        assert_eq!(g.size_to_clusters(4097), 2);
        assert!(g.is_cluster_aligned(8192));
    }
}
