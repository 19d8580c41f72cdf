//! The image as a check sees it: what QEMU loads when it opens an image for checking. That is
//! less than a normal open validates (a check must work on images a normal open refuses): the
//! snapshot table is read later, by the check itself, and a refcount table of zero clusters is
//! allowed.

use super::error::CheckError;
use super::io::read;
use crate::format::be::words;
use crate::format::features::INCOMPAT_CORRUPT;
use crate::format::header::Strictness;
use crate::format::{limits, BitmapDirectoryEntry, BitmapsExtension, Header};
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

fn be32(buf: &[u8], pos: usize) -> u32 {
    buf.get(pos..pos + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_be_bytes)
}

/// Loads the header, the active L1 table and the refcount table of the image in `file`.
pub(crate) async fn load<S: Storage>(file: &S, file_len: u64) -> Result<Meta, CheckError> {
    let first_len = file_len.min(1 << limits::MAX_CLUSTER_BITS);
    // ≤ 2 MiB, so it fits.
    let first = read(file, "reading the header", 0, first_len as usize).await?;
    let magic = be32(&first, 0);
    if first.len() < 4 || magic != crate::format::header::QCOW2_MAGIC {
        return Err(CheckError::NotQcow2 { found: magic });
    }
    // A check looks at images a normal open refuses for their refcount or snapshot table.
    let header = Header::decode_with(&first, Strictness::Check)
        .map_err(|source| CheckError::Open { source })?;

    let geom = header
        .geometry()
        .map_err(|source| CheckError::Open { source })?;
    let cluster_bits = geom.cluster_bits();
    let cs = geom.cluster_size();
    // Validated by the decoder: the L1 table is at most 32 MiB, the refcount table 8 MiB.
    let l1_bytes = u64::from(header.l1_size) * 8;
    let l1_raw = read(
        file,
        "reading the L1 table",
        header.l1_table_offset,
        l1_bytes as usize,
    )
    .await?;
    let reftable_bytes = u64::from(header.refcount_table_clusters) * cs;
    let reftable_raw = read(
        file,
        "reading the refcount table",
        header.refcount_table_offset,
        reftable_bytes as usize,
    )
    .await?;
    let bitmaps = header.bitmaps().copied();
    let bitmap_dir = match &bitmaps {
        Some(ext) if ext.nb_bitmaps > 0 => {
            super::bitmaps::load_directory(file, ext, &geom, file_len).await?
        }
        _ => Vec::new(),
    };
    let csize_shift = 62 - (cluster_bits - 8);
    let refcount_order = header.refcount_order;
    Ok(Meta {
        cluster_bits,
        cluster_size: cs,
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
        l1: words(&l1_raw),
        reftable_offset: header.refcount_table_offset,
        reftable: words(&reftable_raw),
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
    })
}
