//! In-place updates of header fields: the bytes the engine writes over the first sector to
//! change a field, or several contiguous fields in one write.

use super::field;
use super::model::Header;

/// Bytes that change header fields in place: write `bytes` at file offset `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldUpdate<const N: usize> {
    /// File offset of the first field.
    pub offset: u64,
    /// The fields, encoded.
    pub bytes: [u8; N],
}

impl<const N: usize> FieldUpdate<N> {
    fn new(field: usize, bytes: [u8; N]) -> Self {
        FieldUpdate {
            offset: field as u64,
            bytes,
        }
    }
}

fn concat<const N: usize>(a: &[u8], b: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out[..a.len()].copy_from_slice(a);
    out[a.len()..].copy_from_slice(b);
    out
}

/// The update that sets the guest size.
pub fn size_update(size: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::SIZE, size.to_be_bytes())
}

/// The update that points the header at another L1 table (`l1_size` and `l1_table_offset`
/// together, in one write).
pub fn l1_update(l1_size: u32, l1_table_offset: u64) -> FieldUpdate<12> {
    FieldUpdate::new(
        field::L1_SIZE,
        concat(&l1_size.to_be_bytes(), &l1_table_offset.to_be_bytes()),
    )
}

/// The update that switches the active disk in one write: guest size, `crypt_method` (kept),
/// `l1_size` and `l1_table_offset` are contiguous, so a crash shows the old disk or the new.
pub fn active_disk_update(
    size: u64,
    crypt_method: u32,
    l1_size: u32,
    l1_table_offset: u64,
) -> FieldUpdate<24> {
    let mut bytes = [0u8; 24];
    bytes[..8].copy_from_slice(&size.to_be_bytes());
    bytes[8..12].copy_from_slice(&crypt_method.to_be_bytes());
    bytes[12..16].copy_from_slice(&l1_size.to_be_bytes());
    bytes[16..].copy_from_slice(&l1_table_offset.to_be_bytes());
    FieldUpdate::new(field::SIZE, bytes)
}

/// The update that points the header at another refcount table (offset and cluster count
/// together, in one write).
pub fn reftable_update(offset: u64, clusters: u32) -> FieldUpdate<12> {
    FieldUpdate::new(
        field::REFCOUNT_TABLE_OFFSET,
        concat(&offset.to_be_bytes(), &clusters.to_be_bytes()),
    )
}

/// The update that switches to a refcount structure of another width in one write: every
/// field from `refcount_table_offset` to `refcount_order` (52 bytes, inside the first
/// sector), the fields between them taken from `h` as they are.
pub fn refcount_structure_update(
    h: &Header,
    table_offset: u64,
    table_clusters: u32,
    order: u32,
) -> FieldUpdate<52> {
    let mut bytes = [0u8; 52];
    let mut put = |field: usize, value: &[u8]| {
        let at = field - field::REFCOUNT_TABLE_OFFSET;
        bytes[at..at + value.len()].copy_from_slice(value);
    };
    put(field::REFCOUNT_TABLE_OFFSET, &table_offset.to_be_bytes());
    put(
        field::REFCOUNT_TABLE_CLUSTERS,
        &table_clusters.to_be_bytes(),
    );
    put(field::NB_SNAPSHOTS, &h.nb_snapshots.to_be_bytes());
    put(field::SNAPSHOTS_OFFSET, &h.snapshots_offset.to_be_bytes());
    put(
        field::INCOMPATIBLE_FEATURES,
        &h.incompatible_features.to_be_bytes(),
    );
    put(
        field::COMPATIBLE_FEATURES,
        &h.compatible_features.to_be_bytes(),
    );
    put(
        field::AUTOCLEAR_FEATURES,
        &h.autoclear_features.to_be_bytes(),
    );
    put(field::REFCOUNT_ORDER, &order.to_be_bytes());
    FieldUpdate::new(field::REFCOUNT_TABLE_OFFSET, bytes)
}

/// The update that points the header at the L1 and refcount tables of an emptied image in
/// one write: `l1_table_offset`, `refcount_table_offset` and `refcount_table_clusters` are
/// contiguous (`l1_size` stays, since the emptied L1 table keeps its size).
pub fn emptied_tables_update(
    l1_table_offset: u64,
    refcount_table_offset: u64,
    refcount_table_clusters: u32,
) -> FieldUpdate<20> {
    let mut bytes = [0u8; 20];
    bytes[..8].copy_from_slice(&l1_table_offset.to_be_bytes());
    bytes[8..16].copy_from_slice(&refcount_table_offset.to_be_bytes());
    bytes[16..].copy_from_slice(&refcount_table_clusters.to_be_bytes());
    FieldUpdate::new(field::L1_TABLE_OFFSET, bytes)
}

/// The update that sets `nb_snapshots` and `snapshots_offset` together.
pub fn snapshots_update(nb_snapshots: u32, snapshots_offset: u64) -> FieldUpdate<12> {
    FieldUpdate::new(
        field::NB_SNAPSHOTS,
        concat(&nb_snapshots.to_be_bytes(), &snapshots_offset.to_be_bytes()),
    )
}

/// The update that sets `nb_snapshots` alone.
pub fn nb_snapshots_update(nb_snapshots: u32) -> FieldUpdate<4> {
    FieldUpdate::new(field::NB_SNAPSHOTS, nb_snapshots.to_be_bytes())
}

/// The update that sets the incompatible feature bits (version 3).
pub fn incompatible_update(bits: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::INCOMPATIBLE_FEATURES, bits.to_be_bytes())
}

/// The update that sets the compatible feature bits (version 3).
pub fn compatible_update(bits: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::COMPATIBLE_FEATURES, bits.to_be_bytes())
}

/// The update that sets the autoclear feature bits (version 3).
pub fn autoclear_update(bits: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::AUTOCLEAR_FEATURES, bits.to_be_bytes())
}
