//! Growing the virtual disk, and with it the L1 table.
//!
//! Order: the new L1 table and its refcounts are durable before one header write switches
//! `l1_size` and `l1_table_offset` together; the size field is written after that, and the old
//! table is freed last. A crash at any point leaves the old or the new table in use (each
//! large enough for the size on disk), with at worst leaked clusters.

use super::error::{EngineError, Result};
use super::image::{Image, Inner};
use super::overlap::MetaKind;
use crate::format::{be, header, limits, Geometry, HostOffset};
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Grows the virtual disk to `new_size` bytes (rounded up to 512); the new space reads as
    /// zeros (or, as in QEMU, from a longer backing file). Shrinking is refused.
    pub async fn resize(&self, new_size: u64) -> Result<()> {
        self.inner.resize(new_size).await
    }
}

impl<S: Storage + 'static> Inner<S> {
    async fn resize(&self, new_size: u64) -> Result<()> {
        self.check_writable()?;
        let top = self.chain.top();
        let unsupported = |what: &str| EngineError::Unsupported {
            image: top.name.clone(),
            what: what.into(),
        };
        let meta = top
            .qcow2()
            .ok_or_else(|| unsupported("resizing a raw image"))?;
        let new_size = new_size
            .checked_next_multiple_of(512)
            .ok_or_else(|| unsupported("a size that large"))?;
        let old_size = top.size.get();
        if new_size < old_size {
            return Err(unsupported("shrinking an image"));
        }
        if new_size == old_size {
            return Ok(());
        }
        if !self.alloc()?.bitmaps.borrow().list.is_empty() {
            // Their data covers the old size; storing them for the new one is not done yet.
            return Err(unsupported(
                "resizing an image with persistent bitmaps (remove them first)",
            ));
        }
        let g = &meta.geom;
        let geom = Geometry::new(
            g.cluster_bits(),
            g.extended_l2(),
            g.refcount_order(),
            new_size,
        )
        .map_err(|source| EngineError::Format {
            image: top.name.clone(),
            source,
        })?;
        let needed = geom.l1_entries_needed();
        if needed * 8 > limits::MAX_L1_SIZE_BYTES {
            return Err(EngineError::NoSpace {
                image: top.name.clone(),
                detail: "the L1 table would exceed QEMU's 32 MiB limit".into(),
            });
        }
        let w = self.alloc()?;
        let _g = w.meta_lock.lock().await;
        if needed > meta.l1.borrow().len() as u64 {
            self.grow_l1(needed).await?;
        }
        w.update_header(header::size_update(new_size)).await?;
        w.sync().await?;
        meta.header.borrow_mut().size = new_size;
        top.size.set(new_size);
        Ok(())
    }

    /// Replaces the L1 table with one of at least `entries` entries. Holds the meta lock.
    async fn grow_l1(&self, entries: u64) -> Result<()> {
        let top = self.chain.top();
        let meta = top.qcow2().expect("qcow2");
        let w = self.alloc()?;
        let cs = meta.geom.cluster_size();
        let old: Vec<u64> = meta.l1.borrow().clone();
        // Grow by half again, as QEMU does, so that small steps do not copy every time.
        let len = entries
            .max(old.len() as u64 + old.len() as u64 / 2)
            .min(limits::MAX_L1_SIZE_BYTES / 8);
        let clusters = (len * 8).div_ceil(cs);
        let new_off = w.alloc_clusters(clusters).await?.0;
        // Its refcounts must be durable before the header points to it.
        w.refcounts
            .flush()
            .await
            .map_err(|source| EngineError::Cache {
                image: top.name.clone(),
                source,
            })?;
        let table = be::table_bytes(&old, (clusters * cs) as usize);
        w.write_meta("writing the L1 table", new_off, &table)
            .await?;
        w.sync().await?;
        w.update_header(header::l1_update(len as u32, new_off))
            .await?;
        w.sync().await?;
        let old_off = meta.l1_offset.replace(new_off);
        let old_clusters = (old.len() as u64 * 8).div_ceil(cs);
        {
            let mut l1 = meta.l1.borrow_mut();
            l1.resize(len as usize, 0);
        }
        {
            let mut h = meta.header.borrow_mut();
            h.l1_size = len as u32;
            h.l1_table_offset = new_off;
        }
        {
            let mut m = w.meta.borrow_mut();
            m.remove(HostOffset(old_off));
            m.insert(HostOffset(new_off), clusters * cs, MetaKind::L1Table);
        }
        if old_clusters > 0 {
            w.free_clusters(HostOffset(old_off), old_clusters, false)
                .await?;
        }
        Ok(())
    }
}
