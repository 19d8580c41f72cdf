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
use crate::format::{be, header, limits, refcount};
use storage::Storage;

impl<S: Storage> Pass<'_, S> {
    /// Writes a new refcount structure describing `imrt` (which gains the clusters it uses)
    /// and switches the header to it.
    pub async fn rebuild(&mut self, imrt: &mut Imrt) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size;
        let mut table: Vec<u64> = Vec::new();
        let end = imrt.len();
        self.write_refblocks(imrt, 0, end, &mut table).await?;
        let (table_offset, table_clusters) = loop {
            let clusters = self.meta.clusters(table.len() as u64 * 8);
            let mut first_free = 0;
            let start = imrt.alloc(clusters, &mut first_free)?;
            let grown = self
                .write_refblocks(imrt, start, start + clusters, &mut table)
                .await?;
            if !grown {
                break (start * cs, clusters);
            }
        };
        let bytes = be::table_bytes(&table, table.len() * 8);
        self.guarded_write("writing the refcount table", table_offset, &bytes, &[])
            .await?;
        // Everything the new table describes must be on disk before the header uses it.
        io::flush(self.file).await?;
        let clusters32 =
            u32::try_from(table_clusters).map_err(|_| CheckError::RebuildTooLarge {
                entries: table.len() as u64,
            })?;
        io::write_header(
            self.file,
            "switching the header to the new refcount table",
            header::reftable_update(table_offset, clusters32),
        )
        .await?;
        io::flush(self.file).await?;
        self.meta.reftable_offset = table_offset;
        self.meta.reftable = table;
        self.layout_changed();
        self.meta.header.refcount_table_offset = table_offset;
        self.meta.header.refcount_table_clusters = clusters32;
        Ok(())
    }

    /// Writes the refcount blocks for every used cluster in `[first, end)`, allocating the
    /// blocks that `table` lacks (QEMU's `rebuild_refcounts_write_refblocks`). Returns whether
    /// `table` had to grow.
    async fn write_refblocks(
        &mut self,
        imrt: &mut Imrt,
        first: u64,
        mut end: u64,
        table: &mut Vec<u64>,
    ) -> Result<bool, CheckError> {
        let cs = self.meta.cluster_size;
        let bits = self.meta.refblock_bits;
        let entries = self.meta.refblock_entries();
        let order = self.meta.refcount_order;
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
            let mut buf = vec![0u8; cs as usize];
            for i in 0..entries {
                let v = imrt.get(block_start + i);
                if v != 0 {
                    // i < entries of one block; v is within the width (the table stops
                    // counting at the image's maximum).
                    let _ = refcount::set(&mut buf, order, i as usize, v);
                }
            }
            self.guarded_write("writing a refcount block", block, &buf, &[])
                .await?;
            cluster = block_start + entries;
        }
        Ok(grown)
    }
}
