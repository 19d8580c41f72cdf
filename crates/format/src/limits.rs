//! QEMU's sanity limits, as named constants with the reason each exists. An image outside
//! these is refused by QEMU, so we refuse it too: accepting more would let a hostile image make
//! us allocate or loop far beyond what any real image needs.

/// Smallest cluster size QEMU supports (512 B): the sector size.
pub const MIN_CLUSTER_BITS: u32 = 9;
/// Largest cluster size QEMU supports (2 MiB): an implementation limit that also keeps the
/// compressed-cluster sector field meaningful.
pub const MAX_CLUSTER_BITS: u32 = 21;
/// With extended L2 entries a cluster holds 32 subclusters, each at least 512 B.
pub const MIN_CLUSTER_BITS_EXTENDED_L2: u32 = 14;
/// refcount_bits = 1 << refcount_order may not exceed 64.
pub const MAX_REFCOUNT_ORDER: u32 = 6;

/// A version 2 header is exactly this long.
pub const V2_HEADER_LENGTH: u32 = 72;
/// A version 3 header is at least this long (through `header_length`).
pub const MIN_V3_HEADER_LENGTH: u32 = 104;

/// Active L1 table size in bytes: QEMU keeps the whole L1 table in memory.
pub const MAX_L1_SIZE_BYTES: u64 = 32 * 1024 * 1024;
/// Refcount table size in bytes: QEMU keeps it in memory too.
pub const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 * 1024 * 1024;
/// Number of internal snapshots: QEMU loads every snapshot table entry on open.
pub const MAX_SNAPSHOTS: u32 = 65_536;
/// Total snapshot table size in bytes, for the same reason.
pub const MAX_SNAPSHOT_TABLE_BYTES: u64 = 64 * 1024 * 1024;
/// Extra data per snapshot table entry: only 24 bytes are defined, the rest is future use.
pub const MAX_SNAPSHOT_EXTRA_DATA: u32 = 1024;
/// Size of the fixed part of a snapshot table entry.
pub const SNAPSHOT_ENTRY_FIXED_SIZE: u64 = 40;

/// Backing file name length: QEMU stores it in a 1024-byte, NUL-terminated buffer.
pub const MAX_BACKING_FILE_NAME: u32 = 1023;
/// Backing format name length: QEMU stores it in a 16-byte, NUL-terminated buffer.
pub const MAX_BACKING_FORMAT_NAME: u32 = 15;

/// Number of persistent bitmaps QEMU supports per image.
pub const MAX_BITMAPS: u32 = 65_535;
/// Bitmap directory size: 1 KiB per bitmap at most (name ≤ 1023 bytes, no extra data).
pub const MAX_BITMAP_DIRECTORY_SIZE: u64 = 1024 * MAX_BITMAPS as u64;
/// Smallest bitmap granularity QEMU supports (512 B, one sector per bit).
pub const MIN_BITMAP_GRANULARITY_BITS: u8 = 9;
/// Largest bitmap granularity QEMU supports (2 GiB per bit).
pub const MAX_BITMAP_GRANULARITY_BITS: u8 = 31;
/// Bitmap name length QEMU supports.
pub const MAX_BITMAP_NAME: u16 = 1023;
/// Entries in one bitmap table (QEMU's BME_MAX_TABLE_SIZE).
pub const MAX_BITMAP_TABLE_ENTRIES: u32 = 0x0800_0000;
/// Bytes of one bitmap's data (QEMU's BME_MAX_PHYS_SIZE: the bitmap is held in memory).
pub const MAX_BITMAP_DATA_BYTES: u64 = 0x2000_0000;

/// Host offsets in L1/L2 entries have 47 usable bits (9-55): every host cluster must lie below
/// 64 PiB.
pub const MAX_HOST_OFFSET: u64 = 1 << 56;
/// QEMU passes file offsets and lengths as `int64_t`; anything past this cannot be read.
pub const MAX_FILE_OFFSET: u64 = i64::MAX as u64;
/// QEMU stores the L1 index of the VM state area in an `int`.
pub const MAX_L1_ENTRIES_NEEDED: u64 = i32::MAX as u64;
