//! Byte offsets of the header's fields (the layout in qcow2.txt). This is the one place they
//! are written down: the decoder, the encoder and every in-place update of a field use them.

/// `magic` (u32).
pub const MAGIC: usize = 0;
/// `version` (u32).
pub const VERSION: usize = 4;
/// `backing_file_offset` (u64).
pub const BACKING_FILE_OFFSET: usize = 8;
/// `backing_file_size` (u32).
pub const BACKING_FILE_SIZE: usize = 16;
/// `cluster_bits` (u32).
pub const CLUSTER_BITS: usize = 20;
/// `size` (u64), the guest size.
pub const SIZE: usize = 24;
/// `crypt_method` (u32).
pub const CRYPT_METHOD: usize = 32;
/// `l1_size` (u32), followed by `l1_table_offset`.
pub const L1_SIZE: usize = 36;
/// `l1_table_offset` (u64).
pub const L1_TABLE_OFFSET: usize = 40;
/// `refcount_table_offset` (u64), followed by `refcount_table_clusters`.
pub const REFCOUNT_TABLE_OFFSET: usize = 48;
/// `refcount_table_clusters` (u32).
pub const REFCOUNT_TABLE_CLUSTERS: usize = 56;
/// `nb_snapshots` (u32), followed by `snapshots_offset`.
pub const NB_SNAPSHOTS: usize = 60;
/// `snapshots_offset` (u64).
pub const SNAPSHOTS_OFFSET: usize = 64;
/// `incompatible_features` (u64, version 3).
pub const INCOMPATIBLE_FEATURES: usize = 72;
/// `compatible_features` (u64, version 3).
pub const COMPATIBLE_FEATURES: usize = 80;
/// `autoclear_features` (u64, version 3).
pub const AUTOCLEAR_FEATURES: usize = 88;
/// `refcount_order` (u32, version 3).
pub const REFCOUNT_ORDER: usize = 96;
/// `header_length` (u32, version 3).
pub const HEADER_LENGTH: usize = 100;
/// `compression_type` (u8), the first additional field.
pub const COMPRESSION_TYPE: usize = 104;
