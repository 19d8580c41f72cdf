//! Getting an L2 table that a write may modify: allocate it when the L1 entry is empty, copy
//! it when it is shared with a snapshot (L1 COPIED flag clear).
//!
//! Order: the new table's refcount is made durable, the whole table is written and flushed,
//! and only then does the L1 entry point to it; a shared table loses its reference last.

use super::Allocator;
use crate::engine::infra::error::Result;
use crate::engine::infra::metacache::L2Key;
use crate::engine::infra::overlap::MetaKind;
use crate::format::{be, l1, HostOffset, L1Index};
use storage::{IoBuf, Storage};

impl<S: Storage + 'static> Allocator<S> {
    /// Writes a new, empty L2 table of `len` bytes (a cluster) at `offset` from one small
    /// zeroed buffer written as often as it takes: a buffer of the table's size would be up
    /// to 2 MiB more memory, held beside the copy-on-write buffers of the write that needed
    /// the table.
    async fn write_empty_table(&self, offset: u64, len: u64) -> Result<()> {
        const CHUNK: u64 = 64 << 10;
        // Cluster sizes are powers of two, so the chunks tile the table exactly.
        let chunk = CHUNK.min(len);
        let mut buf = IoBuf::zeroed(chunk as usize);
        for at in (0..len).step_by(chunk as usize) {
            buf = self
                .write_meta_buf("writing a new L2 table", offset + at, buf)
                .await?;
        }
        Ok(())
    }

    /// The offset of a writable (COPIED) L2 table for L1 index `l1i`, creating one if needed.
    /// The caller holds the meta lock.
    pub(crate) async fn l2_for_write(&self, l1i: L1Index) -> Result<HostOffset> {
        let top = self.top();
        let meta = self.meta();
        self.ensure_usable()?;
        let word = meta
            .l1
            .borrow()
            .get(l1i.0 as usize)
            .copied()
            .ok_or_else(|| top.corrupt(format!("L1 index {} is beyond the L1 table", l1i.0)))?;
        let old = l1::table_of(word);
        if old != 0 && l1::is_copied(word) {
            return Ok(HostOffset(old));
        }
        let cs = meta.geom.cluster_size();
        let new = self.alloc_clusters(1).await?.0;
        // The table's refcount must be on disk before anything points to it.
        self.refcounts
            .flush()
            .await
            .map_err(|source| super::EngineError::Cache {
                image: top.name.clone(),
                source,
            })?;
        if old == 0 {
            self.l2
                .forget(|k| k.layer == 0 && k.table == HostOffset(new));
            self.write_empty_table(new, cs).await?;
        } else {
            // A copy of the shared table; its clusters stay shared (not COPIED).
            let mut table = IoBuf::zeroed(cs as usize);
            let slice = self.l2.entry_size();
            for s in 0..(cs as usize / slice) {
                let key = L2Key {
                    layer: 0,
                    table: HostOffset(old),
                    slice: s as u32,
                };
                let dst = &mut table[s * slice..(s + 1) * slice];
                self.l2
                    .read(key, |b| dst.copy_from_slice(b))
                    .await
                    .map_err(|source| super::EngineError::Cache {
                        image: top.name.clone(),
                        source,
                    })?;
            }
            self.l2
                .forget(|k| k.layer == 0 && k.table == HostOffset(new));
            self.write_meta_buf("writing a new L2 table", new, table)
                .await?;
        }
        self.sync().await?;
        self.meta
            .borrow_mut()
            .insert(HostOffset(new), cs, MetaKind::L2Table);
        let entry = l1::owned_word(new);
        meta.l1.borrow_mut()[l1i.0 as usize] = entry;
        self.mapping_changed();
        self.top().announce(storage::Event::L1Update);
        self.write_meta(
            "updating the L1 table",
            meta.l1_offset.get() + l1i.0 * 8,
            &be::word_bytes(entry),
        )
        .await?;
        if old != 0 {
            // The snapshot keeps the old table; it loses the active L1's reference only once
            // the L1 entry no longer names it on disk.
            self.sync().await?;
            self.free_clusters(HostOffset(old), 1, false).await?;
        }
        Ok(HostOffset(new))
    }
}
