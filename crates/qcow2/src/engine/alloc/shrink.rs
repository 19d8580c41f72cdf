//! Giving space back after the disk shrank, as QEMU does: refcount blocks that count nothing
//! but themselves leave the refcount table, and the file loses its tail of free clusters.
//!
//! Order: the refcount table without those blocks is durable before anything else refers to
//! their clusters as free, and the file is cut only past the last cluster with a reference,
//! so a crash at any point leaves a consistent image with at worst leaked clusters.

use super::reftable::RefTable;
use super::Allocator;
use crate::engine::infra::error::Result;
use crate::format::{be, refcount, HostCluster, HostOffset};
use storage::Storage;

/// A refcount block that counts nothing but (perhaps) itself.
struct Unused {
    /// Its refcount-table index.
    index: usize,
    /// Where it lives.
    offset: u64,
    /// It holds its own refcount (so nothing else must be decremented for it).
    self_counted: bool,
}

impl<S: Storage + 'static> Allocator<S> {
    /// Drops every refcount block that counts no cluster but itself from the refcount
    /// table, and frees it. The caller holds the meta lock and has flushed the caches.
    pub(crate) async fn drop_unused_refblocks(&self) -> Result<()> {
        let unused = self.unused_refblocks().await?;
        if unused.is_empty() {
            return Ok(());
        }
        let (cs, _, _) = self.rc_geometry();
        let mut table = self.reftable.borrow().to_vec();
        for u in &unused {
            table[u.index] = 0;
        }
        let (offset, clusters) = {
            let h = self.meta().header.borrow();
            (
                h.refcount_table_offset,
                u64::from(h.refcount_table_clusters),
            )
        };
        let bytes = be::table_bytes(&table, (clusters * cs) as usize);
        self.write_meta("updating the refcount table", offset, &bytes)
            .await?;
        self.sync().await?;
        *self.reftable.borrow_mut() = RefTable::from_entries(table);
        for u in &unused {
            self.refcounts.forget(|&k| k == HostOffset(u.offset));
            self.meta.borrow_mut().remove(HostOffset(u.offset));
            // A block counted by itself left with its own count; any other is counted in
            // a block that stays.
            if !u.self_counted {
                self.free_clusters(HostOffset(u.offset), 1, true).await?;
            } else {
                let _ = self.top().file.discard_at(u.offset, cs).await;
            }
        }
        Ok(())
    }

    /// The refcount blocks that count nothing but themselves, in table order.
    async fn unused_refblocks(&self) -> Result<Vec<Unused>> {
        let (_, order, epb) = self.rc_geometry();
        let table = self.reftable.borrow().used().to_vec();
        let mut out = Vec::new();
        for (index, &offset) in table.iter().enumerate() {
            if offset == 0 {
                continue;
            }
            let own = self.cluster_of(HostOffset(offset)).0;
            let self_counted = own / epb == index as u64;
            let own_slot = (own % epb) as usize;
            let empty = self
                .refcounts
                .read(HostOffset(offset), |b| {
                    (0..epb as usize).all(|i| {
                        let v = refcount::get(b, order, i).unwrap_or(1);
                        v == 0 || (self_counted && i == own_slot)
                    })
                })
                .await
                .map_err(|e| self.cache_err(e))?;
            if empty {
                out.push(Unused {
                    index,
                    offset,
                    self_counted,
                });
            }
        }
        Ok(out)
    }

    /// Cuts the file after its last cluster with a reference. The caller holds the meta
    /// lock and has flushed the caches (nothing cached may write past the new end).
    pub(crate) async fn truncate_free_tail(&self) -> Result<()> {
        let (cs, _, _) = self.rc_geometry();
        let top = self.top();
        let len = top
            .file
            .len()
            .await
            .map_err(|e| top.io_error("getting the file size", 0, e))?;
        let mut end = len.div_ceil(cs);
        while end > 0 && self.refcount(HostCluster(end - 1)).await? == 0 {
            end -= 1;
        }
        let end = self.offset_of(HostCluster(end)).0;
        if end >= len {
            return Ok(());
        }
        self.truncate_file(end).await?;
        if self.free_hint.get().0 > end / cs {
            self.free_hint.set(HostCluster(end / cs));
        }
        Ok(())
    }
}
