//! Counting references from L1 and L2 tables (QEMU's `check_refcounts_l1`/`_l2`), with the
//! checks QEMU makes on their entries along the way: reserved bits, alignment, subcluster
//! bitmaps, compressed descriptors, and the cluster statistics of the active table.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::pass::Pass;
use super::report::FindingKind;
use crate::engine::infra::overlap::MetaKind;
use crate::format::be::words;
use crate::format::l2_extended::{pack_bitmap, unpack_bitmap};
use crate::format::limits;
use crate::format::{l1, l2};
use storage::{IoBuf, Storage};

/// Whether an extended L2 bitmap marks some subcluster both allocated and zero (corrupt).
fn alloc_and_zero(bitmap: u64) -> bool {
    let (alloc, zero) = unpack_bitmap(bitmap);
    alloc & zero != 0
}

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
    if l2::is_compressed(entry) {
        ClusterType::Compressed
    } else if l2::has_zero_flag(entry) && !extended {
        if l2::host_of(entry) != 0 {
            ClusterType::ZeroAlloc
        } else {
            ClusterType::ZeroPlain
        }
    } else if l2::host_of(entry) == 0 {
        if data_file && l2::is_copied(entry) {
            ClusterType::Normal
        } else {
            ClusterType::Unallocated
        }
    } else {
        ClusterType::Normal
    }
}

/// One L2 table being counted.
struct L2Walk {
    /// Where the table is.
    offset: u64,
    /// Which L1 table it belongs to.
    which: Which,
    /// Its bytes, with the entries repaired so far.
    table: IoBuf,
    /// Where the next data cluster would be if the active table's were contiguous, for
    /// counting fragmented clusters.
    next_contiguous: u64,
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
            if l1::reserved_bits(entry) != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR found L1 entry with reserved bits set: {entry:x}"),
                );
                self.res.corruptions += 1;
            }
            let l2_offset = l1::table_of(entry);
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
        // One cluster, at most 2 MiB.
        let len = self.meta.l2_bytes() as usize;
        let buf = self.table_buffer(len);
        let table = match io::read_into(self.file, "reading an L2 table", l2_offset, buf).await {
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
        let mut walk = L2Walk {
            offset: l2_offset,
            which,
            table,
            next_contiguous: 0,
        };
        let entries = self.meta.l2_entries as usize;
        let mut i = 0;
        while i < entries {
            i = self.count_plain(imrt, &mut walk, i);
            if i < entries {
                self.count_entry(imrt, &mut walk, i).await?;
                i += 1;
            }
        }
        self.give_back(walk.table);
        Ok(())
    }

    /// Checks and counts entry `i` of the table in `walk`, whatever it holds.
    async fn count_entry(
        &mut self,
        imrt: &mut Imrt,
        walk: &mut L2Walk,
        i: usize,
    ) -> Result<(), CheckError> {
        let (extended, data_file) = (self.meta.extended, self.meta.data_file);
        let (entry, bitmap) = l2::entry_at(&walk.table, i, extended).unwrap_or((0, 0));
        let kind = cluster_type(entry, extended, data_file);
        if kind != ClusterType::Compressed && l2::standard_reserved_bits(entry) != 0 {
            self.log(
                FindingKind::Error,
                format!("ERROR found l2 entry with reserved bits set: {entry:x}"),
            );
            self.res.corruptions += 1;
        }
        match kind {
            ClusterType::Compressed => self.count_compressed(imrt, i, entry, bitmap, walk.which),
            ClusterType::ZeroAlloc | ClusterType::Normal => {
                self.count_allocated(imrt, walk, i, entry, bitmap).await
            }
            ClusterType::ZeroPlain => Ok(()),
            ClusterType::Unallocated => {
                self.check_unallocated(bitmap);
                Ok(())
            }
        }
    }

    /// Counts the entries of the table in `walk` from `from` on while they need nothing but
    /// counting, and returns the first one that needs [`Pass::count_entry`] (or the end of
    /// the table). Plain entries are the bulk of any image: unallocated or zero entries
    /// without reserved bits (or allocated subclusters), and data clusters that are aligned,
    /// inside the file, below the refcount limit and with a sound subcluster bitmap. For
    /// these this does exactly what `count_entry` would, without its per-entry dispatch; an
    /// external data file always takes the general path.
    fn count_plain(&mut self, imrt: &mut Imrt, walk: &mut L2Walk, from: usize) -> usize {
        let m = &self.meta;
        if m.data_file {
            return from;
        }
        let (cs, bits, extended) = (m.cluster_size, m.cluster_bits, m.extended);
        let esize = m.l2_entry_size as usize;
        let limit = Imrt::limit(m.refcount_max);
        // What `inc` accepts: a cluster ending at most a partial cluster past the end of
        // the file, and inside the largest file qcow2 can describe.
        let end_bound = self
            .file_len
            .saturating_add(cs)
            .min(limits::MAX_FILE_OFFSET + 1);
        let active = walk.which == Which::Active;
        let table = walk.table.get(from * esize..).unwrap_or(&[]);
        for (n, bytes) in table.chunks_exact(esize).enumerate() {
            let Some(&word) = bytes.first_chunk::<8>() else {
                return from + n;
            };
            let entry = u64::from_be_bytes(word);
            // Extended entries carry their subcluster bitmap in the second word.
            let bitmap = match bytes.get(8..).and_then(<[u8]>::first_chunk::<8>) {
                Some(&b) if extended => u64::from_be_bytes(b),
                _ => 0,
            };
            if l2::is_compressed(entry) || l2::standard_reserved_bits(entry) != 0 {
                return from + n;
            }
            let offset = l2::host_of(entry);
            if offset == 0 {
                // Unallocated or a plain zero cluster: nothing to count, unless its bitmap
                // claims allocated subclusters.
                if unpack_bitmap(bitmap).0 != 0 {
                    return from + n;
                }
                continue;
            }
            let k = offset >> bits;
            if alloc_and_zero(bitmap)
                || offset & (cs - 1) != 0
                || offset + cs >= end_bound
                || k >= imrt.len()
                || !imrt.increment(k, limit)
            {
                return from + n;
            }
            if active {
                self.res.allocated_clusters += 1;
                if walk.next_contiguous != 0 && offset != walk.next_contiguous {
                    self.res.fragmented_clusters += 1;
                }
                walk.next_contiguous = offset + cs;
            }
        }
        from + table.len() / esize.max(1)
    }

    /// An unallocated cluster has no allocated subclusters.
    fn check_unallocated(&mut self, bitmap: u64) {
        if unpack_bitmap(bitmap).0 != 0 {
            self.res.corruptions += 1;
            self.log(
                FindingKind::Error,
                "ERROR: Unallocated cluster has non-zero subcluster allocation map".into(),
            );
        }
    }

    /// Counts the bytes compressed cluster `i` of an L2 table occupies, after checking its
    /// flags: a compressed cluster is never COPIED, and needs the image's own file and no
    /// subcluster bitmap.
    fn count_compressed(
        &mut self,
        imrt: &mut Imrt,
        i: usize,
        mut entry: u64,
        bitmap: u64,
        which: Which,
    ) -> Result<(), CheckError> {
        if l2::is_copied(entry) {
            self.log(
                FindingKind::Error,
                format!(
                    "ERROR: coffset=0x{:x}: copied flag must never be set for compressed clusters",
                    entry & self.meta.coffset_mask
                ),
            );
            entry = l2::with_copied(entry, false);
            self.res.corruptions += 1;
        }
        if self.meta.data_file {
            self.log(
                FindingKind::Error,
                format!("ERROR compressed cluster {i} with data file, entry=0x{entry:x}"),
            );
            self.res.corruptions += 1;
            return Ok(());
        }
        if bitmap != 0 {
            self.log(
                FindingKind::Error,
                format!("ERROR compressed cluster {i} with non-zero subcluster allocation bitmap, entry=0x{entry:x}"),
            );
            self.res.corruptions += 1;
            return Ok(());
        }
        let m = &self.meta;
        let coffset = entry & m.coffset_mask;
        let sectors = ((entry >> m.csize_shift) & m.csize_mask) + 1;
        let csize = sectors * 512 - (coffset & 511);
        self.inc(imrt, coffset, csize)?;
        if which == Which::Active {
            self.res.allocated_clusters += 1;
            self.res.compressed_clusters += 1;
            // Compressed clusters share sectors, so they always count as fragmented, as in
            // QEMU.
            self.res.fragmented_clusters += 1;
        }
        Ok(())
    }

    /// Counts the host cluster that entry `i` of the table in `walk` (a data or preallocated
    /// zero cluster) points to, after checking its subcluster bitmap and alignment.
    async fn count_allocated(
        &mut self,
        imrt: &mut Imrt,
        walk: &mut L2Walk,
        i: usize,
        entry: u64,
        bitmap: u64,
    ) -> Result<(), CheckError> {
        let offset = l2::host_of(entry);
        if alloc_and_zero(bitmap) {
            self.res.corruptions += 1;
            self.log(
                FindingKind::Error,
                format!("ERROR offset={offset:x}: Allocated cluster has corrupted subcluster allocation bitmap"),
            );
        }
        if self.meta.in_cluster(offset) != 0 && self.misaligned(walk, i, entry, bitmap).await? {
            // The entry no longer points anywhere: nothing to count.
            return Ok(());
        }
        let cs = self.meta.cluster_size;
        if walk.which == Which::Active {
            self.res.allocated_clusters += 1;
            if walk.next_contiguous != 0 && offset != walk.next_contiguous {
                self.res.fragmented_clusters += 1;
            }
            walk.next_contiguous = offset.wrapping_add(cs);
        }
        if !self.meta.data_file {
            self.inc(imrt, offset, cs)?;
        }
        Ok(())
    }

    /// Reports entry `i` of the table in `walk`, whose cluster is not aligned. A preallocated
    /// cluster (no data in it) is turned into a zero cluster by `-r all`: returns whether it
    /// was.
    async fn misaligned(
        &mut self,
        walk: &mut L2Walk,
        i: usize,
        entry: u64,
        bitmap: u64,
    ) -> Result<bool, CheckError> {
        let offset = l2::host_of(entry);
        self.res.corruptions += 1;
        let has_data = if self.meta.extended {
            unpack_bitmap(bitmap).0 != 0
        } else {
            !l2::has_zero_flag(entry)
        };
        if has_data {
            self.log(
                FindingKind::Error,
                format!("ERROR offset={offset:x}: Data cluster is not properly aligned; L2 entry corrupted."),
            );
            return Ok(false);
        }
        let fixing = self.fix.errors;
        self.log(
            if fixing { FindingKind::Repair } else { FindingKind::Error },
            format!("{} offset={offset:x}: Preallocated cluster is not properly aligned; L2 entry corrupted.", Self::verb(fixing)),
        );
        Ok(fixing && self.zero_entry(walk, i).await?)
    }

    /// Turns entry `index` of the table in `walk` into a zero cluster (its present subclusters
    /// into zero subclusters) on disk (QEMU's `fix_l2_entry_by_zero`). Returns whether it was
    /// fixed; an overlap with metadata ends the check.
    async fn zero_entry(&mut self, walk: &mut L2Walk, index: usize) -> Result<bool, CheckError> {
        let extended = self.meta.extended;
        let Some((_, bitmap)) = l2::entry_at(&walk.table, index, extended) else {
            return Ok(false);
        };
        let (word, bitmap) = if extended {
            let (alloc, zero) = unpack_bitmap(bitmap);
            (0, pack_bitmap(0, alloc | zero))
        } else {
            (l2::zeroed_word(0), 0)
        };
        l2::set_entry_at(&mut walk.table, index, extended, word, bitmap);
        let esize = self.meta.l2_entry_size as usize;
        let at = index * esize;
        let entry = walk.table[at..at + esize].to_vec();
        // A snapshot's L2 tables are "inactive", a section the cached overlap set never
        // checks, so ignoring it changes nothing.
        let ignore: &[MetaKind] = match walk.which {
            Which::Active => &[MetaKind::L2Table],
            Which::Snapshot => &[],
        };
        let entry_offset = walk.offset + at as u64;
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
