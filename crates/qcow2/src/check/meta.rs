//! The image as a check sees it: what QEMU loads when it opens an image for checking. That is
//! less than a normal open validates (a check must work on images a normal open refuses): the
//! snapshot table is read later, by the check itself, and a refcount table of zero clusters is
//! allowed.

use super::error::CheckError;
use crate::format::features::INCOMPAT_CORRUPT;
use crate::format::{
    refcount, BitmapDirectoryEntry, BitmapsExtension, FormatError, Geometry, Header, Structure,
};
use crate::metadata::{Loader, MetadataError, StorageSource, Strictness, L1_TABLE, REFCOUNT_TABLE};
use storage::Storage;

/// One internal snapshot, as far as a check needs it.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    /// File offset of its L1 table (unvalidated).
    pub l1_offset: u64,
    /// Entries in its L1 table (unvalidated).
    pub l1_size: u32,
    /// Its ID and name as stored.
    pub id: Vec<u8>,
    pub name: Vec<u8>,
    /// Size of its extra data as stored (after truncation by a repair).
    pub extra_data_size: u32,
    /// The fixed fields a rewrite of the table keeps.
    pub date_sec: u32,
    pub date_nsec: u32,
    pub vm_clock_nsec: u64,
    /// VM state size (the 64-bit extra field when present).
    pub vm_state_size: u64,
    /// Virtual disk size at the snapshot (the image's size when not recorded).
    pub disk_size: u64,
    /// Instruction count (all ones when not recorded).
    pub icount: u64,
    /// Extra data past the fields QEMU knows, kept verbatim.
    pub unknown_extra: Vec<u8>,
}

impl Snapshot {
    /// ID for messages.
    pub fn id_lossy(&self) -> String {
        String::from_utf8_lossy(&self.id).into_owned()
    }

    /// Name for messages.
    pub fn name_lossy(&self) -> String {
        String::from_utf8_lossy(&self.name).into_owned()
    }
}

/// Everything about the image a check uses, in QEMU's terms.
pub(crate) struct Meta {
    pub header: Header,
    pub cluster_bits: u32,
    pub cluster_size: u64,
    /// Extended (128-bit) L2 entries.
    pub extended: bool,
    /// Bytes per L2 entry (8 or 16).
    pub l2_entry_size: u64,
    /// Entries per L2 table.
    pub l2_entries: u64,
    pub refcount_order: u32,
    /// log2 of the refcounts per refcount block.
    pub refblock_bits: u32,
    /// Largest refcount the image can store.
    pub refcount_max: u64,
    /// Guest data lives in an external data file (not counted in refcounts).
    pub data_file: bool,
    /// The compressed-descriptor split for this cluster size.
    pub csize_shift: u32,
    pub csize_mask: u64,
    pub coffset_mask: u64,
    /// The active L1 table, as raw entries.
    pub l1_offset: u64,
    pub l1: Vec<u64>,
    /// The refcount table, as raw entries.
    pub reftable_offset: u64,
    pub reftable: Vec<u64>,
    /// The snapshot table, once read by the check.
    pub snapshots_offset: u64,
    pub nb_snapshots: u32,
    pub snapshots: Vec<Snapshot>,
    /// Bytes of the snapshot table actually used (QEMU's `snapshots_size`).
    pub snapshots_size: u64,
    /// The encryption header (offset, length), if any.
    pub crypto: Option<(u64, u64)>,
    /// The bitmaps extension, if the autoclear bit says it is consistent, and its directory.
    pub bitmaps: Option<BitmapsExtension>,
    pub bitmap_dir: Vec<BitmapDirectoryEntry>,
    /// Incompatible feature bits as on disk (version 3).
    pub incompatible: u64,
    /// Virtual disk size rounded down to sectors, as QEMU keeps it.
    pub virtual_size: u64,
}

impl Meta {
    /// Clusters needed for `bytes` bytes.
    pub fn clusters(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.cluster_size)
    }

    /// Offset inside its cluster.
    pub fn in_cluster(&self, offset: u64) -> u64 {
        offset & (self.cluster_size - 1)
    }

    /// Offset of the refcount block that holds cluster `k`'s refcount, as the refcount
    /// table says (0: no block, or past the table's end).
    pub fn refblock_of(&self, k: u64) -> u64 {
        usize::try_from(k >> self.refblock_bits)
            .ok()
            .and_then(|i| self.reftable.get(i))
            .map_or(0, |&raw| refcount::block_of(raw))
    }

    /// Refcounts one refcount block holds.
    pub fn refblock_entries(&self) -> u64 {
        1 << self.refblock_bits
    }

    /// Bytes of one L2 table.
    pub fn l2_bytes(&self) -> u64 {
        self.l2_entries * self.l2_entry_size
    }

    /// The corrupt bit is set.
    pub fn is_corrupt(&self) -> bool {
        self.incompatible & INCOMPAT_CORRUPT != 0
    }
}

/// Loads the header, the active L1 table, the refcount table and the bitmap directory of the
/// image in `file`, at the checker's strictness.
pub(crate) async fn load<S: Storage>(file: &S, file_len: u64) -> Result<Meta, CheckError> {
    let src = StorageSource::new(file, file_len);
    let loader = Loader::new(&src, Strictness::Check);
    let header = loader.header().await.map_err(|e| match e {
        MetadataError::Format(FormatError::BadMagic { found }) => CheckError::NotQcow2 { found },
        other => CheckError::from_metadata(other),
    })?;
    let geom = header
        .geometry()
        .map_err(|source| CheckError::Open { source })?;
    let cs = geom.cluster_size();
    // Validated with the header: the L1 table is at most 32 MiB, the refcount table 8 MiB.
    let l1_bytes = u64::from(header.l1_size) * 8;
    let l1 = loader
        .table(
            Structure::L1Table,
            L1_TABLE,
            header.l1_table_offset,
            l1_bytes,
        )
        .await
        .map_err(CheckError::from_metadata)?;
    let reftable_bytes = u64::from(header.refcount_table_clusters) * cs;
    let reftable = loader
        .table(
            Structure::RefcountTable,
            REFCOUNT_TABLE,
            header.refcount_table_offset,
            reftable_bytes,
        )
        .await
        .map_err(CheckError::from_metadata)?;
    let bitmaps = header.bitmaps().copied();
    let bitmap_dir = match &bitmaps {
        Some(ext) if ext.nb_bitmaps > 0 => {
            super::bitmaps::load_directory(&loader, file, &header, &geom).await?
        }
        _ => Vec::new(),
    };
    Ok(Meta::new(header, &geom, l1, reftable, bitmaps, bitmap_dir))
}

impl Meta {
    fn new(
        header: Header,
        geom: &Geometry,
        l1: Vec<u64>,
        reftable: Vec<u64>,
        bitmaps: Option<BitmapsExtension>,
        bitmap_dir: Vec<BitmapDirectoryEntry>,
    ) -> Meta {
        let cluster_bits = geom.cluster_bits();
        let csize_shift = 62 - (cluster_bits - 8);
        let refcount_order = header.refcount_order;
        Meta {
            cluster_bits,
            cluster_size: geom.cluster_size(),
            extended: geom.extended_l2(),
            l2_entry_size: geom.l2_entry_size(),
            l2_entries: geom.l2_entries(),
            refcount_order,
            refblock_bits: geom.refcount_block_bits(),
            refcount_max: crate::format::refcount::max_value(refcount_order).unwrap_or(u64::MAX),
            data_file: header.has_data_file(),
            csize_shift,
            csize_mask: (1u64 << (cluster_bits - 8)) - 1,
            coffset_mask: (1u64 << csize_shift) - 1,
            l1_offset: header.l1_table_offset,
            l1,
            reftable_offset: header.refcount_table_offset,
            reftable,
            snapshots_offset: header.snapshots_offset,
            nb_snapshots: header.nb_snapshots,
            snapshots: Vec::new(),
            snapshots_size: 0,
            crypto: header.fde_pointer().map(|p| (p.offset, p.length)),
            bitmaps,
            bitmap_dir,
            incompatible: header.incompatible_features,
            virtual_size: header.size / 512 * 512,
            header,
        }
    }
}
