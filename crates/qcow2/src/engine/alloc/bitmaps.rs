//! Persistent bitmaps on disk: marking them in use before the first write of a read-write
//! open, and storing them back on a clean close, in QEMU's layout and order.
//!
//! Crash safety: while the image is open every loaded bitmap is marked in use on disk, so a
//! crash leaves it inconsistent, as QEMU leaves it. Storing writes the new data clusters,
//! tables and directory into free clusters and makes them and their refcounts durable before
//! one header write points at them; only then are the old clusters freed. A crash before
//! the header write leaves the old, in-use directory in charge (and leaks the new clusters);
//! after it, the new one is complete.

use super::Allocator;
use crate::engine::infra::bitmaps::{
    in_use_entry, read_table, stored_entry, Bitmap, Bitmaps, State,
};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::overlap::MetaKind;
use crate::format::bitmap::{encode_directory, BitmapDirectoryEntry, BitmapsExtension};
use crate::format::bitmap_data::BitmapData;
use crate::format::features::AUTOCLEAR_BITMAPS;
use crate::format::{be, header, BitmapTableEntry, HostOffset};
use storage::Storage;

impl<S: Storage + 'static> Allocator<S> {
    /// The bitmaps extension as the header holds it.
    fn bitmaps_extension(&self) -> Option<BitmapsExtension> {
        self.meta().header.borrow().bitmaps().copied()
    }

    /// Marks every loaded bitmap in use on disk before anything is written, as QEMU does on
    /// open: the autoclear bit is dropped while the directory is rewritten in place, so a
    /// crash in between leaves the extension ignored rather than half-written.
    pub(crate) async fn claim_bitmaps(&self) -> Result<()> {
        let entries: Vec<BitmapDirectoryEntry> = {
            let set = self.bitmaps.borrow();
            if set.list.iter().all(|b| b.entry.in_use()) {
                return Ok(());
            }
            set.list.iter().map(|b| in_use_entry(&b.entry)).collect()
        };
        let Some(ext) = self.bitmaps_extension() else {
            return Ok(());
        };
        let dir = self.encode_directory(&entries)?;
        let bits = self.meta().header.borrow().autoclear_features;
        self.update_header(header::autoclear_update(bits & !AUTOCLEAR_BITMAPS))
            .await?;
        self.sync().await?;
        self.write_meta("marking the bitmaps in use", ext.directory_offset, &dir)
            .await?;
        self.sync().await?;
        self.update_header(header::autoclear_update(bits)).await?;
        self.sync().await?;
        for (b, e) in self.bitmaps.borrow_mut().list.iter_mut().zip(entries) {
            b.entry = e;
        }
        Ok(())
    }

    fn encode_directory(&self, entries: &[BitmapDirectoryEntry]) -> Result<Vec<u8>> {
        encode_directory(entries).map_err(|source| EngineError::Format {
            image: self.top().name.clone(),
            source,
        })
    }

    /// Stores every bitmap that changed, clears the in-use marks and frees what the old
    /// directory used (see the module documentation for the order).
    pub(crate) async fn store_bitmaps(&self) -> Result<()> {
        if !self.bitmaps.borrow().needs_store() {
            return Ok(());
        }
        let _g = self.meta_lock.lock().await;
        // Moved out rather than copied (the data may be up to 1 GiB) and put back whatever
        // happens; a close runs after the last request, so nothing is marked meanwhile.
        let mut set = std::mem::take(&mut *self.bitmaps.borrow_mut());
        let stored = self.store_set(&mut set).await;
        *self.bitmaps.borrow_mut() = set;
        stored
    }

    /// Stores `set`; it is updated (new tables, nothing changed, nothing removed) once the
    /// header names the new directory.
    async fn store_set(&self, set: &mut Bitmaps) -> Result<()> {
        let mut freed: Vec<BitmapDirectoryEntry> = set.removed.clone();
        let mut entries = Vec::with_capacity(set.list.len());
        for b in &set.list {
            let (entry, old) = self.stored_form(b).await?;
            freed.extend(old);
            entries.push(entry);
        }
        let old_ext = self.bitmaps_extension();
        let new_ext = self.write_directory(&entries).await?;
        // Everything the new directory names, and its refcounts, before the header names it.
        self.refcounts
            .flush()
            .await
            .map_err(|e| self.cache_err(e))?;
        self.sync().await?;
        self.switch_bitmaps_extension(new_ext).await?;
        // From here the new directory is the image's: a failure to free the old clusters
        // leaks them, it must not make a later close free them twice.
        set.removed.clear();
        for (b, e) in set.list.iter_mut().zip(entries) {
            b.entry = e;
            if let State::Loaded { changed, .. } = &mut b.state {
                *changed = false;
            }
        }
        self.sync().await?;
        self.free_old_bitmaps(old_ext, &freed).await
    }

    /// The directory entry bitmap `b` is stored with, writing its data first; with the entry
    /// whose clusters the new one replaces. Like QEMU, every loaded bitmap gets new clusters,
    /// changed or not, so the file's layout after a store is the one QEMU's would have.
    async fn stored_form(
        &self,
        b: &Bitmap,
    ) -> Result<(BitmapDirectoryEntry, Option<BitmapDirectoryEntry>)> {
        let State::Loaded { data, enabled, .. } = &b.state else {
            return Ok((b.entry.clone(), None));
        };
        let stored = b.entry.table_offset != 0;
        let (table, size) = self.write_bitmap_data(data).await?;
        let old = stored.then(|| b.entry.clone());
        Ok((stored_entry(b, table.0, size, *enabled), old))
    }

    /// Writes the non-zero clusters of `data` and a table naming them: the table's offset
    /// and entry count.
    async fn write_bitmap_data(&self, data: &BitmapData) -> Result<(HostOffset, u32)> {
        let cs = self.meta().geom.cluster_size();
        let n = data.data_bytes().div_ceil(cs);
        let mut table = Vec::with_capacity(n as usize);
        for i in 0..n {
            let bytes = data.serialize(i * cs, cs as usize);
            if bytes.iter().all(|&b| b == 0) {
                table.push(0);
                continue;
            }
            let at = self.alloc_clusters(1).await?;
            self.write_meta("writing bitmap data", at.0, &bytes).await?;
            table.push(at.0);
        }
        let table_len = (n * 8).max(1);
        let clusters = table_len.div_ceil(cs);
        let at = self.alloc_clusters(clusters).await?;
        let bytes = be::table_bytes(&table, (clusters * cs) as usize);
        self.write_meta("writing a bitmap table", at.0, &bytes)
            .await?;
        self.meta
            .borrow_mut()
            .insert(at, clusters * cs, MetaKind::BitmapTable);
        // At most QEMU's table limit, checked when the bitmap was made or loaded.
        Ok((at, n as u32))
    }

    /// Writes the new directory into free clusters; `None` when no bitmap is left.
    async fn write_directory(
        &self,
        entries: &[BitmapDirectoryEntry],
    ) -> Result<Option<BitmapsExtension>> {
        if entries.is_empty() {
            return Ok(None);
        }
        let cs = self.meta().geom.cluster_size();
        let dir = self.encode_directory(entries)?;
        let clusters = (dir.len() as u64).div_ceil(cs);
        let at = self.alloc_clusters(clusters).await?;
        self.write_meta("writing the bitmap directory", at.0, &dir)
            .await?;
        self.meta
            .borrow_mut()
            .insert(at, clusters * cs, MetaKind::BitmapDirectory);
        Ok(Some(BitmapsExtension {
            // At most 65535 bitmaps, checked when one was added.
            nb_bitmaps: entries.len() as u32,
            reserved: 0,
            directory_size: dir.len() as u64,
            directory_offset: at.0,
        }))
    }

    /// Points the header at the new directory (or drops the extension) in one write of the
    /// header, as QEMU rewrites it.
    async fn switch_bitmaps_extension(&self, ext: Option<BitmapsExtension>) -> Result<()> {
        let meta = self.meta();
        let mut h = meta.header.borrow().clone();
        h.set_bitmaps(ext);
        let bytes = h
            .encode(meta.geom.cluster_size())
            .map_err(|source| EngineError::Format {
                image: self.top().name.clone(),
                source,
            })?;
        self.write_meta("updating the bitmaps extension", 0, &bytes)
            .await?;
        self.mapping_changed();
        *meta.header.borrow_mut() = h;
        Ok(())
    }

    /// Frees the old directory and the clusters of replaced and removed bitmaps. A table
    /// that cannot be read is left allocated (a leak `check -r` repairs), as QEMU leaves it.
    async fn free_old_bitmaps(
        &self,
        old_ext: Option<BitmapsExtension>,
        freed: &[BitmapDirectoryEntry],
    ) -> Result<()> {
        let cs = self.meta().geom.cluster_size();
        if let Some(ext) = old_ext {
            self.meta
                .borrow_mut()
                .remove(HostOffset(ext.directory_offset));
            let n = ext.directory_size.div_ceil(cs);
            self.free_clusters(HostOffset(ext.directory_offset), n, false)
                .await?;
        }
        for entry in freed {
            let table = match read_table(self.top(), self.meta(), entry).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(image = %self.top().name, "leaving bitmap clusters allocated: {e}");
                    continue;
                }
            };
            for e in table {
                if let BitmapTableEntry::Cluster(at) = e {
                    self.free_clusters(at, 1, false).await?;
                }
            }
            self.meta
                .borrow_mut()
                .remove(HostOffset(entry.table_offset));
            let n = (u64::from(entry.table_size) * 8).div_ceil(cs);
            self.free_clusters(HostOffset(entry.table_offset), n, false)
                .await?;
        }
        Ok(())
    }
}
