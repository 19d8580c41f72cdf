//! Growing the virtual disk: a larger L1 table if needed, the new space preallocated as asked
//! and zeroed where a longer backing file would otherwise show through, then the new size.
//!
//! Order: the new L1 table and its refcounts are durable before one header write switches
//! `l1_size` and `l1_table_offset` together, and the old table is freed last. Everything
//! the new space needs (preallocated clusters, zero flags) is flushed before the size field
//! is written: until then a crash leaves the old disk, with at worst leaked clusters and
//! entries past its end that nothing reads.

use super::ResizeError;
use crate::engine::alloc::MetaTxn;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::layer::write_zero_data;
use crate::engine::infra::layer::Qcow2Meta;
use crate::engine::infra::overlap::MetaKind;
use crate::engine::metadata_ops::create::Preallocation;
use crate::format::{be, header, l2, limits, Geometry, GuestOffset, HostOffset};
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Grows the disk to `new_size` bytes (checked by the caller: larger, aligned).
    pub(super) async fn grow(&self, new_size: u64, prealloc: Preallocation) -> Result<()> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let old_size = top.size.get();
        let needed = l1_entries_for(meta, &top.name, new_size)?;
        // QEMU zeroes the new space when the backing file is longer than the old disk, so
        // that growing never uncovers old backing data.
        let hide_backing = self
            .inner
            .backing()
            .is_some_and(|b| b.size.get() > old_size);
        if hide_backing && meta.header.borrow().version < 3 {
            return Err(EngineError::Resize {
                image: top.name.clone(),
                source: ResizeError::V2LongerBacking,
            });
        }
        let w = self.inner.alloc()?;
        if needed > meta.l1.borrow().len() as u64 {
            let txn = w.exclusive().await;
            self.grow_l1(needed, &txn).await?;
        }
        let cs = meta.geom.cluster_size();
        // The partial cluster at the old end already belongs to the disk: it keeps what it has,
        // but the file space of its tail, now part of the disk, is reserved as asked. When
        // it has no host cluster yet, it gets one with the rest, in guest order, and its head
        // (inside the old disk) is written with zeros as QEMU's copy-on-write writes it: the
        // file then has as few extents as QEMU's, and a guest write into that head later
        // splits none (on ext4 a fifth extent costs a block of extent tree, which would
        // make the file take more room after all).
        let first_new = old_size.div_ceil(cs) * cs;
        let tail = old_size - old_size % cs;
        let whole_tail = first_new != old_size
            && matches!(prealloc, Preallocation::Falloc | Preallocation::Full)
            && self.free_hidden_cluster(tail).await?;
        let start = if whole_tail { tail } else { first_new };
        self.preallocate_range(start, new_size, prealloc).await?;
        if whole_tail {
            self.write_head_zeros(tail, old_size % cs).await?;
        } else if first_new != old_size {
            self.reserve_partial_tail(old_size, prealloc).await?;
        }
        if hide_backing {
            self.zero_new_space(old_size, new_size).await?;
        }
        self.inner.flush().await?;
        self.set_qcow2_size(new_size).await
    }

    /// Whether the guest cluster at `cluster` has no host cluster and no backing file shows
    /// through it: preallocating it whole changes nothing the guest reads.
    async fn free_hidden_cluster(&self, cluster: u64) -> Result<bool> {
        let top = self.inner.top();
        let cs = top.qcow2_required()?.geom.cluster_size();
        let w = self.inner.alloc()?;
        let unallocated = w
            .l2_entries(GuestOffset(cluster), cs)
            .await?
            .first()
            .is_some_and(|e| (e.word, e.bitmap) == (0, 0));
        let hidden = self.inner.backing().is_none_or(|b| b.size.get() <= cluster);
        Ok(unallocated && hidden)
    }

    /// Writes zeros over the first `len` bytes of the host cluster the guest cluster at
    /// `cluster` was just given (they read as zeros already).
    async fn write_head_zeros(&self, cluster: u64, len: u64) -> Result<()> {
        let Some(host) = self.own_host_cluster(cluster).await? else {
            return Ok(());
        };
        if len == 0 {
            return Ok(());
        }
        self.inner
            .alloc()?
            .check_overlap(HostOffset(host), len)
            .await?;
        write_zero_data(self.inner.top(), host, len).await
    }

    /// The host cluster the guest cluster at `cluster` has of its own: `None` when it is
    /// unallocated, zero or compressed.
    async fn own_host_cluster(&self, cluster: u64) -> Result<Option<u64>> {
        let cs = self.inner.top().qcow2_required()?.geom.cluster_size();
        let entries = self
            .inner
            .alloc()?
            .l2_entries(GuestOffset(cluster), cs)
            .await?;
        Ok(entries.first().and_then(|e| {
            let host = l2::host_of(e.word);
            (host != 0 && !l2::is_compressed(e.word)).then_some(host)
        }))
    }

    /// With `falloc` or `full`, reserves (or writes zeros into) the host space of the cluster
    /// at the old end from `old_size` on, when that cluster has a host cluster: QEMU gives
    /// it a freshly reserved one, so that writes into the grown space never make the file
    /// take more room; reserving the tail of its host cluster in place has the same effect.
    async fn reserve_partial_tail(&self, old_size: u64, prealloc: Preallocation) -> Result<()> {
        if !matches!(prealloc, Preallocation::Falloc | Preallocation::Full) {
            return Ok(());
        }
        let top = self.inner.top();
        let cs = top.qcow2_required()?.geom.cluster_size();
        let cluster = old_size - old_size % cs;
        // Unallocated (with a backing file showing through its head, else the caller has
        // preallocated it whole), zero or compressed: nothing of its own to reserve.
        let Some(host) = self.own_host_cluster(cluster).await? else {
            return Ok(());
        };
        let (at, len) = (host + old_size % cs, cs - old_size % cs);
        match prealloc {
            Preallocation::Full => write_zero_data(top, at, len).await,
            _ => top
                .file
                .write_zeroes_at(at, len, false)
                .await
                .map_err(|e| top.io_error("preallocating", at, e)),
        }
    }

    /// Zeroes `[old_size, new_size)` before the header shows it. The zeroing code works on
    /// the disk as it is in memory, so the size there moves first, and back if it fails.
    async fn zero_new_space(&self, old_size: u64, new_size: u64) -> Result<()> {
        let top = self.inner.top();
        top.size.set(new_size);
        let res = self
            .zero_untracked(old_size, new_size - old_size, false, false)
            .await;
        if res.is_err() {
            top.size.set(old_size);
        }
        res
    }

    /// Replaces the L1 table with one of at least `entries` entries. Holds the meta lock.
    async fn grow_l1(&self, entries: u64, txn: &MetaTxn<'_, S>) -> Result<()> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let w = self.inner.alloc()?;
        let cs = meta.geom.cluster_size();
        let old: Vec<u64> = meta.l1.borrow().clone();
        // Grow by half again, as QEMU does, so that small steps do not copy every time.
        let len = entries
            .max(old.len() as u64 + old.len() as u64 / 2)
            .min(limits::MAX_L1_SIZE_BYTES / 8);
        let clusters = (len * 8).div_ceil(cs);
        let new_off = txn.claim_clusters(clusters).await?.0;
        // Its refcounts must be durable before the header points to it.
        w.flush_refcounts().await?;
        let table = be::table_bytes(&old, (clusters * cs) as usize);
        w.write_meta("writing the L1 table", new_off, &table)
            .await?;
        w.sync().await?;
        w.update_header(header::l1_update(len as u32, new_off))
            .await?;
        w.sync().await?;
        let old_off = meta.l1_offset.replace(new_off);
        let old_clusters = (old.len() as u64 * 8).div_ceil(cs);
        meta.l1.borrow_mut().resize(len as usize, 0);
        {
            let mut h = meta.header.borrow_mut();
            h.l1_size = len as u32;
            h.l1_table_offset = new_off;
        }
        w.forget_metadata(HostOffset(old_off));
        w.record_metadata(HostOffset(new_off), clusters * cs, MetaKind::L1Table);
        if old_clusters > 0 {
            txn.release_clusters(HostOffset(old_off), old_clusters, false)
                .await?;
        }
        Ok(())
    }
}

/// The L1 entries a disk of `size` bytes needs, refused past QEMU's L1 size limit.
pub(super) fn l1_entries_for<S>(meta: &Qcow2Meta<S>, image: &str, size: u64) -> Result<u64> {
    let g = &meta.geom;
    let geom = Geometry::new(g.cluster_bits(), g.extended_l2(), g.refcount_order(), size).map_err(
        |source| EngineError::Format {
            image: image.to_string(),
            source,
        },
    )?;
    let needed = geom.l1_entries_needed();
    if needed * 8 > limits::MAX_L1_SIZE_BYTES {
        return Err(EngineError::NoSpace {
            image: image.to_string(),
            detail: "the L1 table would exceed QEMU's 32 MiB limit".into(),
        });
    }
    Ok(needed)
}
