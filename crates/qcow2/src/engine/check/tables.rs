//! Counting references from L1 and L2 tables (QEMU's `check_refcounts_l1`/`_l2`), with the
//! checks QEMU makes on their entries along the way: reserved bits, alignment, subcluster
//! bitmaps, compressed descriptors, and the cluster statistics of the active table.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::pass::Pass;
use super::report::FindingKind;
use crate::engine::overlap::MetaKind;
use crate::format::be::words;
use crate::format::l1::{L1_OFFSET_MASK, L1_RESERVED_MASK};
use crate::format::l2::{
    L2_COMPRESSED, L2_COPIED, L2_OFFSET_MASK, L2_STANDARD_RESERVED_MASK, L2_ZERO,
};
use crate::format::l2_extended::ALL_ZERO_BITMAP;
use storage::Storage;

/// Allocation bits of an extended L2 bitmap (the low 32).
pub(crate) const BITMAP_ALL_ALLOC: u64 = 0xffff_ffff;

/// How QEMU classifies an L2 entry (`qcow2_get_cluster_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClusterType {
    Unallocated,
    ZeroPlain,
    ZeroAlloc,
    Normal,
    Compressed,
}

/// Classifies an L2 entry's first word. With extended L2 entries the zero flag means nothing
/// (zeros live in the bitmap); with an external data file, offset 0 plus COPIED is data.
pub(crate) fn cluster_type(entry: u64, extended: bool, data_file: bool) -> ClusterType {
    if entry & L2_COMPRESSED != 0 {
        ClusterType::Compressed
    } else if entry & L2_ZERO != 0 && !extended {
        if entry & L2_OFFSET_MASK != 0 {
            ClusterType::ZeroAlloc
        } else {
            ClusterType::ZeroPlain
        }
    } else if entry & L2_OFFSET_MASK == 0 {
        if data_file && entry & L2_COPIED != 0 {
            ClusterType::Normal
        } else {
            ClusterType::Unallocated
        }
    } else {
        ClusterType::Normal
    }
}

/// Which L1 table a walk is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Which {
    /// The active table: cluster statistics are collected and its L2 tables are "active".
    Active,
    /// A snapshot's table.
    Snapshot,
}

impl<S: Storage> Pass<'_, S> {
    /// Counts an L1 table, its L2 tables and everything they reference.
    pub async fn count_l1(
        &mut self,
        imrt: &mut Imrt,
        l1_offset: u64,
        l1_size: u32,
        which: Which,
    ) -> Result<(), CheckError> {
        if l1_size == 0 {
            return Ok(());
        }
        let bytes = u64::from(l1_size) * 8;
        self.inc(imrt, l1_offset, bytes)?;
        // l1_size is at most 4 Mi entries here (checked by the caller or the header decoder).
        let raw = match io::read(self.file, "reading an L1 table", l1_offset, bytes as usize).await
        {
            Ok(raw) => raw,
            Err(e) => {
                self.log(
                    FindingKind::Error,
                    "ERROR: I/O error in check_refcounts_l1".into(),
                );
                self.res.check_errors += 1;
                return Err(e);
            }
        };
        for entry in words(&raw) {
            if entry == 0 {
                continue;
            }
            if entry & L1_RESERVED_MASK != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR found L1 entry with reserved bits set: {entry:x}"),
                );
                self.res.corruptions += 1;
            }
            let l2_offset = entry & L1_OFFSET_MASK;
            self.inc(imrt, l2_offset, self.meta.cluster_size)?;
            if self.meta.in_cluster(l2_offset) != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR l2_offset={l2_offset:x}: Table is not cluster aligned; L1 entry corrupted"),
                );
                self.res.corruptions += 1;
            }
            self.count_l2(imrt, l2_offset, which).await?;
        }
        Ok(())
    }

    /// Counts the clusters one L2 table references.
    async fn count_l2(
        &mut self,
        imrt: &mut Imrt,
        l2_offset: u64,
        which: Which,
    ) -> Result<(), CheckError> {
        let m = &self.meta;
        let (extended, data_file, cs) = (m.extended, m.data_file, m.cluster_size);
        let mut table = match io::read(
            self.file,
            "reading an L2 table",
            l2_offset,
            // One cluster, at most 2 MiB.
            m.l2_bytes() as usize,
        )
        .await
        {
            Ok(t) => t,
            Err(e) => {
                self.log(
                    FindingKind::Error,
                    "ERROR: I/O error in check_refcounts_l2".into(),
                );
                self.res.check_errors += 1;
                return Err(e);
            }
        };
        let stats = which == Which::Active;
        let esize = self.meta.l2_entry_size as usize;
        let mut next_contiguous = 0u64;
        for i in 0..self.meta.l2_entries as usize {
            let at = i * esize;
            let word = |t: &[u8], pos: usize| {
                t.get(pos..pos + 8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_be_bytes)
            };
            let mut entry = word(&table, at);
            let bitmap = if extended { word(&table, at + 8) } else { 0 };
            let kind = cluster_type(entry, extended, data_file);
            if kind != ClusterType::Compressed && entry & L2_STANDARD_RESERVED_MASK != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR found l2 entry with reserved bits set: {entry:x}"),
                );
                self.res.corruptions += 1;
            }
            match kind {
                ClusterType::Compressed => {
                    if entry & L2_COPIED != 0 {
                        self.log(
                            FindingKind::Error,
                            format!("ERROR: coffset=0x{:x}: copied flag must never be set for compressed clusters", entry & self.meta.coffset_mask),
                        );
                        entry &= !L2_COPIED;
                        self.res.corruptions += 1;
                    }
                    if data_file {
                        self.log(
                            FindingKind::Error,
                            format!(
                                "ERROR compressed cluster {i} with data file, entry=0x{entry:x}"
                            ),
                        );
                        self.res.corruptions += 1;
                        continue;
                    }
                    if bitmap != 0 {
                        self.log(
                            FindingKind::Error,
                            format!("ERROR compressed cluster {i} with non-zero subcluster allocation bitmap, entry=0x{entry:x}"),
                        );
                        self.res.corruptions += 1;
                        continue;
                    }
                    let m = &self.meta;
                    let coffset = entry & m.coffset_mask;
                    let sectors = ((entry >> m.csize_shift) & m.csize_mask) + 1;
                    let csize = sectors * 512 - (coffset & 511);
                    self.inc(imrt, coffset, csize)?;
                    if stats {
                        self.res.allocated_clusters += 1;
                        self.res.compressed_clusters += 1;
                        // Compressed clusters share sectors, so they always count as
                        // fragmented, as in QEMU.
                        self.res.fragmented_clusters += 1;
                    }
                }
                ClusterType::ZeroAlloc | ClusterType::Normal => {
                    let offset = entry & L2_OFFSET_MASK;
                    if (bitmap >> 32) & bitmap != 0 {
                        self.res.corruptions += 1;
                        self.log(
                            FindingKind::Error,
                            format!("ERROR offset={offset:x}: Allocated cluster has corrupted subcluster allocation bitmap"),
                        );
                    }
                    if self.meta.in_cluster(offset) != 0 {
                        self.res.corruptions += 1;
                        let has_data = if extended {
                            bitmap & BITMAP_ALL_ALLOC != 0
                        } else {
                            entry & L2_ZERO == 0
                        };
                        if !has_data {
                            let fixing = self.fix.errors;
                            self.log(
                                if fixing { FindingKind::Repair } else { FindingKind::Error },
                                format!("{} offset={offset:x}: Preallocated cluster is not properly aligned; L2 entry corrupted.", Self::verb(fixing)),
                            );
                            if fixing && self.zero_entry(&mut table, l2_offset, i, which).await? {
                                // The entry no longer points anywhere: nothing to count.
                                continue;
                            }
                        } else {
                            self.log(
                                FindingKind::Error,
                                format!("ERROR offset={offset:x}: Data cluster is not properly aligned; L2 entry corrupted."),
                            );
                        }
                    }
                    if stats {
                        self.res.allocated_clusters += 1;
                        if next_contiguous != 0 && offset != next_contiguous {
                            self.res.fragmented_clusters += 1;
                        }
                        next_contiguous = offset.wrapping_add(cs);
                    }
                    if !data_file {
                        self.inc(imrt, offset, cs)?;
                    }
                }
                ClusterType::ZeroPlain => {}
                ClusterType::Unallocated => {
                    if bitmap & BITMAP_ALL_ALLOC != 0 {
                        self.res.corruptions += 1;
                        self.log(
                            FindingKind::Error,
                            "ERROR: Unallocated cluster has non-zero subcluster allocation map"
                                .into(),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Turns entry `index` of the L2 table at `l2_offset` into a zero cluster (its present
    /// subclusters into zero subclusters) on disk (QEMU's `fix_l2_entry_by_zero`). Returns
    /// whether it was fixed; an overlap with metadata ends the check.
    async fn zero_entry(
        &mut self,
        table: &mut [u8],
        l2_offset: u64,
        index: usize,
        which: Which,
    ) -> Result<bool, CheckError> {
        let esize = self.meta.l2_entry_size as usize;
        let at = index * esize;
        let Some(bytes) = table.get_mut(at..at + esize) else {
            return Ok(false);
        };
        if self.meta.extended {
            let bitmap = u64::from_be_bytes(bytes[8..16].try_into().unwrap_or([0; 8]));
            let zeroes = (bitmap | (bitmap << 32)) & ALL_ZERO_BITMAP;
            bytes[..8].copy_from_slice(&0u64.to_be_bytes());
            bytes[8..16].copy_from_slice(&zeroes.to_be_bytes());
        } else {
            bytes[..8].copy_from_slice(&L2_ZERO.to_be_bytes());
        }
        let entry = bytes.to_vec();
        // A snapshot's L2 tables are "inactive", a section the cached overlap set never
        // checks, so ignoring it changes nothing.
        let ignore: &[MetaKind] = match which {
            Which::Active => &[MetaKind::L2Table],
            Which::Snapshot => &[],
        };
        let entry_offset = l2_offset + at as u64;
        match self
            .guarded_write("fixing an L2 entry", entry_offset, &entry, ignore)
            .await
        {
            Ok(()) => {}
            Err(e @ CheckError::Overlap { .. }) => {
                self.log(FindingKind::Error, "ERROR: Overlap check failed".into());
                self.res.check_errors += 1;
                return Err(e);
            }
            Err(e) => {
                self.log(
                    FindingKind::Error,
                    format!("ERROR: Failed to overwrite L2 table entry: {e}"),
                );
                self.res.check_errors += 1;
                return Ok(false);
            }
        }
        if let Err(e) = io::flush(self.file).await {
            self.log(
                FindingKind::Error,
                format!("ERROR: Failed to overwrite L2 table entry: {e}"),
            );
            self.res.check_errors += 1;
            return Ok(false);
        }
        self.res.corruptions = self.res.corruptions.saturating_sub(1);
        self.res.corruptions_fixed += 1;
        Ok(true)
    }
}
