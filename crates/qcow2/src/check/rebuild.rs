//! Rebuilding the refcount structure from the in-memory refcount table (QEMU's
//! `rebuild_refcount_structure`), used by `-r all` when the stored one is beyond repair and
//! when a dirty (lazy-refcount) image is opened for writing.
//!
//! Crash safety: new refcount blocks and the new table go only into clusters nothing uses
//! (free in the in-memory table, which counts the old structure as used), and everything is
//! flushed before the header switches to the new table in one 12-byte write, which is
//! flushed too. A crash before the switch leaves the old structure in charge; after it, the
//! new one is complete. The old structure is then a leak, which the caller frees.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::pass::Pass;
use crate::format::{be, header, limits, refcount, Geometry};
use std::collections::BTreeSet;
use storage::Storage;

/// A refcount structure written into free clusters and not yet in use.
pub(crate) struct NewStructure {
    /// Where its table starts.
    pub table_offset: u64,
    /// Its table's size in clusters.
    pub table_clusters: u32,
    /// Its table's entries (refcount block offsets, 0 for none).
    pub table: Vec<u64>,
}

impl<S: Storage> Pass<'_, S> {
    /// Writes a new refcount structure describing `imrt` (which gains the clusters it uses)
    /// and switches the header to it.
    pub async fn rebuild(&mut self, imrt: &mut Imrt) -> Result<(), CheckError> {
        let new = self
            .write_structure(imrt, self.meta.refcount_order, &BTreeSet::new())
            .await?;
        io::write_header(
            self.file,
            "switching the header to the new refcount table",
            header::reftable_update(new.table_offset, new.table_clusters),
        )
        .await?;
        io::flush(self.file).await?;
        self.meta.reftable_offset = new.table_offset;
        self.meta.reftable = new.table;
        self.layout_changed();
        self.meta.header.refcount_table_offset = new.table_offset;
        self.meta.header.refcount_table_clusters = new.table_clusters;
        Ok(())
    }

    /// Writes refcount blocks of width `order` for every cluster `imrt` counts, and a table
    /// pointing to them, into clusters `imrt` has free (QEMU's `rebuild_refcount_structure`
    /// up to the header switch). The structure counts itself: blocks and table are added to
    /// `imrt`, and blocks for them are written too, until nothing more is needed. Everything
    /// is flushed before this returns, so the caller can switch the header to it.
    ///
    /// The clusters in `released` stay taken while the structure is written (so nothing
    /// lands on them) but get refcount 0 in it: what the switch to it frees.
    pub async fn write_structure(
        &mut self,
        imrt: &mut Imrt,
        order: u32,
        released: &BTreeSet<u64>,
    ) -> Result<NewStructure, CheckError> {
        let cs = self.meta.cluster_size;
        let width = Width::new(self.meta.cluster_bits, order)?;
        let end = imrt.len();
        let mut blocks = Blocks {
            width,
            released,
            table: Vec::new(),
        };
        self.write_refblocks(imrt, &mut blocks, 0, end).await?;
        let (table_offset, table_clusters) = loop {
            let clusters = self.meta.clusters(blocks.table.len() as u64 * 8);
            let mut first_free = 0;
            let start = imrt.alloc(clusters, &mut first_free)?;
            let grown = self
                .write_refblocks(imrt, &mut blocks, start, start + clusters)
                .await?;
            if !grown {
                break (start * cs, clusters);
            }
        };
        let table = blocks.table;
        let bytes = be::table_bytes(&table, table.len() * 8);
        self.guarded_write("writing the refcount table", table_offset, &bytes, &[])
            .await?;
        // Everything the new table describes must be on disk before the header uses it.
        io::flush(self.file).await?;
        let table_clusters =
            u32::try_from(table_clusters).map_err(|_| CheckError::RebuildTooLarge {
                entries: table.len() as u64,
            })?;
        Ok(NewStructure {
            table_offset,
            table_clusters,
            table,
        })
    }

    /// Writes the refcount blocks for every used cluster in `[first, end)`, allocating the
    /// blocks that `out.table` lacks (QEMU's `rebuild_refcounts_write_refblocks`). Returns
    /// whether the table had to grow.
    async fn write_refblocks(
        &mut self,
        imrt: &mut Imrt,
        out: &mut Blocks<'_>,
        first: u64,
        mut end: u64,
    ) -> Result<bool, CheckError> {
        let cs = self.meta.cluster_size;
        let bits = out.width.block_bits;
        let table = &mut out.table;
        let entries = 1u64 << bits;
        let mut first_free = 0u64;
        let mut grown = false;
        let mut cluster = first;
        while cluster < end {
            match imrt.next_used(cluster) {
                Some(used) if used < end => cluster = used,
                _ => break,
            }
            let index = cluster >> bits;
            let block_start = index << bits;
            let slot = usize::try_from(index)
                .map_err(|_| CheckError::RebuildTooLarge { entries: index })?;
            let existing = table.get(slot).copied().unwrap_or(0);
            let block = if existing != 0 {
                existing
            } else {
                // A block must not land in a range whose blocks were written already.
                first_free = first_free.max(block_start);
                let c = imrt.alloc(1, &mut first_free)?;
                if c >= end {
                    // The block holding this block's own refcount must be written too.
                    end = c + 1;
                }
                if table.len() <= slot {
                    let per_cluster = (cs / 8) as usize;
                    let len = (slot + 1).div_ceil(per_cluster) * per_cluster;
                    if len as u64 * 8 > limits::MAX_REFCOUNT_TABLE_BYTES {
                        return Err(CheckError::RebuildTooLarge {
                            entries: len as u64,
                        });
                    }
                    table.resize(len, 0);
                    grown = true;
                }
                table[slot] = c * cs;
                c * cs
            };
            let buf = self.refblock_bytes(imrt, out.width, out.released, block_start)?;
            self.guarded_write("writing a refcount block", block, &buf, &[])
                .await?;
            cluster = block_start + entries;
        }
        Ok(grown)
    }

    /// The refcount block of width `width` for the clusters from `block_start` on.
    fn refblock_bytes(
        &self,
        imrt: &Imrt,
        width: Width,
        released: &BTreeSet<u64>,
        block_start: u64,
    ) -> Result<Vec<u8>, CheckError> {
        let mut buf = vec![0u8; self.meta.cluster_size as usize];
        for i in 0..(1u64 << width.block_bits) {
            let k = block_start + i;
            let v = imrt.get(k);
            if v != 0 && !released.contains(&k) {
                // A count the width cannot hold would be lost, and the cluster taken for
                // free: callers refuse such a width first, this is the last guard.
                refcount::set(&mut buf, width.order, i as usize, v).map_err(|_| {
                    CheckError::RefcountTooWide {
                        bits: 1 << width.order,
                        offset: k << self.meta.cluster_bits,
                        refcount: v,
                    }
                })?;
            }
        }
        Ok(buf)
    }
}

/// The refcount blocks being written: their width, the clusters they give refcount 0 although
/// they are taken, and the table of the blocks written so far.
struct Blocks<'a> {
    width: Width,
    released: &'a BTreeSet<u64>,
    table: Vec<u64>,
}

/// The width of the refcounts being written, and the log2 of how many one block holds.
#[derive(Debug, Clone, Copy)]
struct Width {
    order: u32,
    block_bits: u32,
}

impl Width {
    fn new(cluster_bits: u32, order: u32) -> Result<Width, CheckError> {
        // The geometry owns the arithmetic (and refuses an order past 6).
        let geom = Geometry::new(cluster_bits, false, order, 0)
            .map_err(|source| CheckError::Open { source })?;
        Ok(Width {
            order,
            block_bits: geom.refcount_block_bits(),
        })
    }
}
