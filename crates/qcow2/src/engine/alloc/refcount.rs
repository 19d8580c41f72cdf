//! Refcounts of the writable layer and the cluster allocator built on them.
//!
//! Ordering (what keeps an image consistent after a crash at any instant):
//! - a new refcount block is written and flushed before the refcount table points to it, and
//!   its own cluster's refcount is durable first (or the block describes itself);
//! - a grown refcount table and its new blocks are written and flushed before the header
//!   points to them, and the old table is freed only after that;
//! - refcount *increases* are ordered before the L2 entries that use the clusters by the L2
//!   cache's dependency on the refcount cache (set by the caller), and *decreases* after the
//!   L2 entries that stopped using them by the refcount cache's dependency on the L2 cache
//!   (set here).
//!
//! Callers hold `Allocator::meta_lock` around allocation and freeing.

use super::reftable::RefTable;
use super::Allocator;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::overlap::MetaKind;
use crate::format::{be, header, limits, refcount, HostCluster, HostOffset};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use storage::{IoBuf, Storage};

impl<S: Storage + 'static> Allocator<S> {
    pub(super) fn rc_geometry(&self) -> (u64, u32, u64) {
        let g = self.meta().refcount_geom.get();
        (
            g.cluster_size(),
            g.refcount_order(),
            g.refcount_block_entries(),
        )
    }

    /// The host cluster holding byte `offset`.
    pub(super) fn cluster_of(&self, offset: HostOffset) -> HostCluster {
        self.meta().geom.host_cluster(offset)
    }

    /// The first byte of host cluster `cluster`. Clusters the allocator hands out lie below
    /// 2^56 bytes, so the product never overflows.
    pub(super) fn offset_of(&self, cluster: HostCluster) -> HostOffset {
        HostOffset(cluster.0 << self.meta().geom.cluster_bits())
    }

    pub(super) fn cache_err(&self, source: cache::CacheError) -> EngineError {
        EngineError::Cache {
            image: self.top().name.clone(),
            source,
        }
    }

    pub(super) fn fmt_err(&self, source: crate::format::FormatError) -> EngineError {
        EngineError::Format {
            image: self.top().name.clone(),
            source,
        }
    }

    /// The file offset of the refcount block covering `cluster`, if one exists.
    fn block_of(&self, cluster: HostCluster) -> Option<u64> {
        let (_, _, epb) = self.rc_geometry();
        let ti = usize::try_from(cluster.0 / epb).ok()?;
        self.reftable.borrow().get(ti).filter(|&b| b != 0)
    }

    /// Refcount of `cluster` (0 where no refcount block exists).
    pub(crate) async fn refcount(&self, cluster: HostCluster) -> Result<u64> {
        let (_, order, epb) = self.rc_geometry();
        let Some(block) = self.block_of(cluster) else {
            return Ok(0);
        };
        let idx = (cluster.0 % epb) as usize;
        self.refcounts
            .read(HostOffset(block), |b| refcount::get(b, order, idx))
            .await
            .map_err(|e| self.cache_err(e))?
            .map_err(|e| self.fmt_err(e))
    }

    /// Adds `delta` to the refcount of `cluster`, whose refcount block must exist. Underflow
    /// or overflow means the metadata is inconsistent: the image is marked corrupt. Returns
    /// the new refcount.
    pub(crate) async fn update_refcount(&self, cluster: HostCluster, delta: i64) -> Result<u64> {
        let (_, order, epb) = self.rc_geometry();
        let at = self.offset_of(cluster).0;
        let Some(block) = self.block_of(cluster) else {
            return Err(self
                .mark_corrupt(format!(
                    "cluster {at:#x} has no refcount block but its refcount must change"
                ))
                .await);
        };
        if delta < 0 {
            // The L2 (or other) entry that stopped using the cluster must reach the disk before
            // the lower refcount does.
            self.refcounts
                .set_dependency(self.l2.clone())
                .await
                .map_err(|e| self.cache_err(e))?;
        }
        let idx = (cluster.0 % epb) as usize;
        let max = refcount::max_value(order).unwrap_or(u64::MAX);
        let reach = refcount::entry_bytes(order, idx)
            .filter(|(bytes, _)| bytes.end <= self.refcounts.entry_size());
        let Some((bytes, idx)) = reach else {
            return Err(self
                .mark_corrupt(format!("refcount of cluster {at:#x} is out of reach"))
                .await);
        };
        // Only the refcount's own bytes change, so a write-back writes only their page.
        let res = self
            .refcounts
            .modify_part(
                HostOffset(block),
                bytes,
                |b| -> std::result::Result<u64, String> {
                    let old = refcount::get(b, order, idx).map_err(|e| e.to_string())?;
                    let new = if delta < 0 {
                        old.checked_sub(delta.unsigned_abs())
                    } else {
                        old.checked_add(delta as u64).filter(|&n| n <= max)
                    }
                    .ok_or_else(|| {
                        format!("refcount of cluster {at:#x} is {old}; cannot add {delta}")
                    })?;
                    refcount::set(b, order, idx, new).map_err(|e| e.to_string())?;
                    Ok(new)
                },
            )
            .await
            .map_err(|e| self.cache_err(e))?;
        match res {
            Ok(new) => {
                if new == 0 && cluster < self.free_hint.get() {
                    self.free_hint.set(cluster);
                }
                if new == 0 || (delta > 0 && new == delta.unsigned_abs()) {
                    // Freed, or taken from free: its bytes are no longer what we know of.
                    self.unwritten.borrow_mut().forget(cluster);
                }
                Ok(new)
            }
            Err(detail) => Err(self.mark_corrupt(detail).await),
        }
    }

    /// Finds `n` contiguous clusters with refcount 0, starting at the allocation hint.
    /// Clusters beyond the refcount table's reach count as free (their block is created
    /// when they are used).
    async fn find_free(&self, n: u64) -> Result<HostCluster> {
        let (cs, order, epb) = self.rc_geometry();
        let max_clusters = limits::MAX_HOST_OFFSET / cs;
        let mut c = self.free_hint.get().0;
        let mut start = c;
        let mut run = 0u64;
        loop {
            if start + n > max_clusters {
                return Err(EngineError::NoSpace {
                    image: self.top().name.clone(),
                    detail: "host offsets would exceed 2^56 bytes".into(),
                });
            }
            let block_end = (c / epb + 1) * epb;
            match self.block_of(HostCluster(c)) {
                None => {
                    if run == 0 {
                        start = c;
                    }
                    run += block_end - c;
                    if run >= n {
                        return Ok(HostCluster(start));
                    }
                    c = block_end;
                }
                Some(block) => {
                    let from = (c % epb) as usize;
                    let (found, new_start, new_run) = self
                        .refcounts
                        .read(HostOffset(block), |b| {
                            let (mut s, mut r) = (start, run);
                            for i in from..epb as usize {
                                let free =
                                    refcount::get(b, order, i).map(|v| v == 0).unwrap_or(false);
                                if free {
                                    if r == 0 {
                                        s = c - from as u64 + i as u64;
                                    }
                                    r += 1;
                                    if r == n {
                                        return (true, s, r);
                                    }
                                } else {
                                    r = 0;
                                }
                            }
                            (false, s, r)
                        })
                        .await
                        .map_err(|e| self.cache_err(e))?;
                    start = new_start;
                    run = new_run;
                    if found {
                        return Ok(HostCluster(start));
                    }
                    c = block_end;
                }
            }
        }
    }

    /// Allocates `n` contiguous clusters (refcount 0 → 1) and returns the byte offset of the
    /// first. The caller holds the meta lock and makes the L2 cache depend on the refcount
    /// cache before pointing an L2 entry at them.
    pub(super) async fn alloc_clusters(&self, n: u64) -> Result<HostOffset> {
        let (_, _, epb) = self.rc_geometry();
        self.top().announce(storage::Event::ClusterAlloc);
        'retry: loop {
            let HostCluster(start) = self.find_free(n).await?;
            for ti in start / epb..=(start + n - 1) / epb {
                if !self.has_block(ti) {
                    self.alloc_refblock(ti).await?;
                    // The new block may have taken a cluster of this run.
                    continue 'retry;
                }
            }
            for c in start..start + n {
                self.update_refcount(HostCluster(c), 1).await?;
            }
            let end = HostCluster(start + n);
            self.free_hint.set(end);
            self.note_allocated_end(self.offset_of(end).0);
            self.grow_ahead(self.offset_of(end).0).await;
            return Ok(self.offset_of(HostCluster(start)));
        }
    }

    /// Frees `n` clusters starting at byte offset `host` (refcount - 1 each), and forgets any
    /// cached table that lived there. With `punch`, clusters reaching 0 are deallocated in the
    /// file too.
    pub(super) async fn free_clusters(&self, host: HostOffset, n: u64, punch: bool) -> Result<()> {
        let (cs, _, _) = self.rc_geometry();
        let first = self.cluster_of(host).0;
        self.top().announce(storage::Event::ClusterFree);
        for c in first..first + n {
            let left = self.update_refcount(HostCluster(c), -1).await?;
            if left == 0 {
                let off = self.offset_of(HostCluster(c)).0;
                self.l2
                    .forget(|k| k.layer == 0 && k.table == HostOffset(off));
                self.refcounts.forget(|&k| k == HostOffset(off));
                self.meta.borrow_mut().remove(HostOffset(off));
                if punch {
                    let top = self.top();
                    // Best effort: a file system without hole punching just keeps the bytes.
                    let _ = top.file.discard_at(off, cs).await;
                }
            }
        }
        Ok(())
    }

    /// Frees the host clusters a compressed cluster's data touches (one reference each).
    pub(super) async fn free_compressed(&self, raw: u64) -> Result<()> {
        let meta = self.meta();
        let desc = crate::format::CompressedDescriptor::decode(
            raw,
            meta.geom.cluster_bits(),
            crate::format::Location::at(crate::format::Structure::L2Table, 0),
        )
        .map_err(|e| self.fmt_err(e))?;
        let (off, len) = desc.byte_range();
        let first = self.cluster_of(HostOffset(off)).0;
        let last = self.cluster_of(HostOffset(off + len - 1)).0;
        for c in first..=last {
            self.update_refcount(HostCluster(c), -1).await?;
        }
        Ok(())
    }

    pub(super) fn has_block(&self, ti: u64) -> bool {
        usize::try_from(ti)
            .ok()
            .and_then(|i| self.reftable.borrow().get(i))
            .is_some_and(|b| b != 0)
    }

    /// Tracks the end of everything allocated, for pointer checks.
    pub(super) fn note_allocated_end(&self, end: u64) {
        let meta = self.meta();
        if end > meta.file_end.get() {
            meta.file_end.set(end);
        }
    }

    /// Creates the refcount block for refcount-table index `ti` (growing the table first if
    /// it is too short).
    fn alloc_refblock(&self, ti: u64) -> Pin<Box<dyn Future<Output = Result<()>> + '_>> {
        Box::pin(async move {
            let (cs, order, epb) = self.rc_geometry();
            if ti >= self.reftable.borrow().len() as u64 {
                return self.grow_reftable(ti + 1).await;
            }
            let b = self.find_free(1).await?;
            let bti = b.0 / epb;
            let block_off = self.offset_of(b).0;
            // Nothing cached may describe the old contents of this cluster.
            self.l2
                .forget(|k| k.layer == 0 && k.table == HostOffset(block_off));
            self.refcounts.forget(|&k| k == HostOffset(block_off));
            let mut block = IoBuf::zeroed(cs as usize);
            if bti == ti {
                // The block describes itself.
                refcount::set(&mut block, order, (b.0 % epb) as usize, 1)
                    .map_err(|e| self.fmt_err(e))?;
            } else if self.has_block(bti) {
                self.update_refcount(b, 1).await?;
                // Its refcount must be durable before the table points to it.
                self.refcounts
                    .flush()
                    .await
                    .map_err(|e| self.cache_err(e))?;
            } else {
                // The block's own cluster needs a block first; the caller retries.
                return self.alloc_refblock(bti).await;
            }
            self.write_meta("writing a refcount block", block_off, &block)
                .await?;
            self.sync().await?;
            self.note_allocated_end(block_off + cs);
            let table_offset = self.meta().header.borrow().refcount_table_offset;
            self.write_meta(
                "updating the refcount table",
                table_offset + ti * 8,
                &be::word_bytes(block_off),
            )
            .await?;
            self.sync().await?;
            self.reftable.borrow_mut().set(ti as usize, block_off);
            self.meta
                .borrow_mut()
                .insert(HostOffset(block_off), cs, MetaKind::RefcountBlock);
            Ok(())
        })
    }

    /// Replaces the refcount table with one of at least `min_entries` entries, placed with
    /// the refcount blocks that describe it after everything allocated so far.
    async fn grow_reftable(&self, min_entries: u64) -> Result<()> {
        let (cs, order, epb) = self.rc_geometry();
        let old_len = self.reftable.borrow().len() as u64;
        let per_cluster = cs / 8;
        let meta = self.meta();
        // New metadata goes past the old table's reach and past the end of the file.
        let area = (old_len * epb).max(meta.file_end.get().div_ceil(cs));
        let mut new_len = min_entries.max(old_len + old_len / 2).max(1);
        let (mut blocks, mut table_clusters);
        loop {
            new_len = new_len.div_ceil(per_cluster) * per_cluster;
            table_clusters = new_len / per_cluster;
            blocks = 1u64;
            loop {
                let last = area + blocks + table_clusters - 1;
                let needed = last / epb - area / epb + 1;
                if needed <= blocks {
                    break;
                }
                blocks = needed;
            }
            let last_index = (area + blocks + table_clusters - 1) / epb;
            if last_index < new_len {
                break;
            }
            new_len = last_index + 1;
        }
        if new_len * 8 > limits::MAX_REFCOUNT_TABLE_BYTES {
            return Err(EngineError::NoSpace {
                image: self.top().name.clone(),
                detail: "the refcount table would exceed QEMU's 8 MiB limit".into(),
            });
        }
        let first_index = area / epb;
        // The new blocks: each describes the new clusters (blocks and table) in its range.
        let used_end = area + blocks + table_clusters;
        for j in 0..blocks {
            let ti = first_index + j;
            let mut block = IoBuf::zeroed(cs as usize);
            for c in (ti * epb).max(area)..((ti + 1) * epb).min(used_end) {
                refcount::set(&mut block, order, (c % epb) as usize, 1)
                    .map_err(|e| self.fmt_err(e))?;
            }
            let off = (area + j) * cs;
            self.l2
                .forget(|k| k.layer == 0 && k.table == HostOffset(off));
            self.refcounts.forget(|&k| k == HostOffset(off));
            self.write_meta("writing a refcount block", off, &block)
                .await?;
        }
        let mut table = self.reftable.borrow().to_vec();
        table.resize(new_len as usize, 0);
        for j in 0..blocks {
            table[(first_index + j) as usize] = (area + j) * cs;
        }
        let bytes = be::table_bytes(&table, (table_clusters * cs) as usize);
        let table_off = (area + blocks) * cs;
        self.write_meta("writing the refcount table", table_off, &bytes)
            .await?;
        self.sync().await?;
        self.note_allocated_end(used_end * cs);
        // Switch the header over in one sector-sized write.
        self.update_header(header::reftable_update(table_off, table_clusters as u32))
            .await?;
        self.sync().await?;
        // The header in memory is the one record of where the table lives.
        let (old_off, old_clusters) = {
            let mut h = meta.header.borrow_mut();
            let old = (h.refcount_table_offset, h.refcount_table_clusters);
            h.refcount_table_offset = table_off;
            h.refcount_table_clusters = table_clusters as u32;
            old
        };
        *self.reftable.borrow_mut() = RefTable::from_entries(table);
        {
            let mut m = self.meta.borrow_mut();
            m.remove(HostOffset(old_off));
            m.insert(
                HostOffset(table_off),
                table_clusters * cs,
                MetaKind::RefcountTable,
            );
            for j in 0..blocks {
                m.insert(HostOffset((area + j) * cs), cs, MetaKind::RefcountBlock);
            }
        }
        self.free_clusters(HostOffset(old_off), u64::from(old_clusters), false)
            .await
    }

    /// Allocates `len` (< cluster size) bytes for compressed data, packing compressed
    /// clusters into shared host clusters as QEMU does: every host cluster the data touches
    /// gets one reference per compressed cluster. Returns the byte offset.
    pub(super) async fn alloc_bytes(&self, len: u64) -> Result<HostOffset> {
        let (cs, order, _) = self.rc_geometry();
        let max = refcount::max_value(order).unwrap_or(u64::MAX);
        let cur = self.free_byte_offset.get();
        let current = self.cluster_of(HostOffset(cur));
        let usable = cur != 0 && self.refcount(current).await? < max;
        let off = if usable && cs - cur % cs >= len {
            self.update_refcount(current, 1).await?;
            cur
        } else {
            let new = self.alloc_clusters(1).await?.0;
            if usable && new == cur.div_ceil(cs) * cs {
                // The next cluster was free: the data spills over from the current one.
                self.update_refcount(current, 1).await?;
                cur
            } else {
                new
            }
        };
        let next = off + len;
        self.free_byte_offset
            .set(if next % cs == 0 { 0 } else { next });
        Ok(HostOffset(off))
    }

    /// The writer's refcount cache as a dependency target.
    pub(super) fn refcounts_flush(&self) -> Rc<dyn cache::Flush> {
        self.refcounts.clone()
    }
}
