//! Shrinking the virtual disk, as QEMU does: every cluster past the new end is dropped, the
//! L1 entries past the new end are cleared (the table keeps its size, as QEMU keeps it) and
//! their L2 tables freed, refcount blocks left counting nothing leave the refcount table,
//! and the file loses its free tail. Only then is the new size written.
//!
//! Order, so that a crash at any instant leaves a consistent image (the old size with its
//! end dropped, or the new size), with at worst leaked clusters:
//! 1. the L2 entries past the end are cleared before the clusters' refcounts drop (the
//!    refcount cache depends on the L2 cache for decrements), and both are flushed;
//! 2. the cleared L1 entries are durable before the L2 tables' refcounts drop;
//! 3. the refcount table without the unused blocks is durable before they count as free;
//!    The freed clusters are punched out of the file after that flush, in runs of
//!    adjacent clusters, under the allocator's lock;
//! 4. the file is cut only past the last referenced cluster;
//! 5. the size field is written last.

use crate::engine::alloc::{L2Change, MetaTxn, Precedes};
use crate::engine::infra::error::Result;
use crate::engine::infra::image::Image;
use crate::engine::infra::range_lock::LockMode;
use crate::format::{l1, l2, GuestOffset, HostCluster, HostOffset};
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Shrinks the disk to `new_size` bytes (checked by the caller: smaller, aligned).
    pub(super) async fn shrink(&self, new_size: u64) -> Result<()> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let old_size = top.size.get();
        let cs = meta.geom.cluster_size();
        // The partial cluster at the new end stays whole, as in QEMU.
        let cut = new_size.div_ceil(cs) * cs;
        if cut < old_size {
            self.drop_clusters(cut, old_size).await?;
        }
        self.inner.flush().await?;
        let keep = super::grow::l1_entries_for(meta, &top.name, new_size)?;
        let w = self.inner.alloc()?;
        {
            let txn = w.exclusive().await;
            self.clear_l1_tail(keep, &txn).await?;
            self.inner.flush().await?;
            w.drop_unused_refblocks().await?;
            self.inner.flush().await?;
            w.truncate_free_tail().await?;
        }
        self.set_qcow2_size(new_size).await
    }

    /// Clears every L2 entry of `[from, to)` (`from` cluster-aligned) and drops the
    /// references they held, punching freed clusters out of the file.
    async fn drop_clusters(&self, from: u64, to: u64) -> Result<()> {
        let w = self.inner.alloc()?;
        let g = self.inner.top().qcow2_required()?.geom;
        let per_table = g.l2_entries() * g.cluster_size();
        let _guard = self
            .inner
            .lock_range(GuestOffset(from), to - from, LockMode::Exclusive)
            .await;
        // Freed clusters are punched out of the file afterwards in runs, not one by one, as
        // QEMU's merged discards do: thousands of small punches fragment the file system's
        // extent tree, which can then keep a block QEMU's file does not.
        let mut hosts = Vec::new();
        let mut pos = from;
        while pos < to {
            let table_end = (pos - pos % per_table).saturating_add(per_table).min(to);
            let entries = w.l2_entries(GuestOffset(pos), table_end - pos).await?;
            let used: Vec<_> = entries
                .into_iter()
                .filter(|e| e.table.is_some() && (e.word, e.bitmap) != (0, 0))
                .collect();
            if !used.is_empty() {
                {
                    // A table shared with a snapshot is copied first; the snapshot keeps its own.
                    let _g = w.exclusive().await;
                    w.l2_for_write(g.l1_index(GuestOffset(pos))).await?;
                }
                for e in used {
                    if !l2::is_compressed(e.word) && l2::host_of(e.word) != 0 {
                        hosts.push(l2::host_of(e.word));
                    }
                    let change = L2Change::set(e.cluster, 0, 0).releasing(e.word, false);
                    w.change_l2(Precedes::Nothing, [change]).await?;
                }
            }
            pos = table_end;
        }
        if self.inner.top().qcow2_required()?.data_file.is_some() {
            return Ok(());
        }
        // Punched once the cleared entries and lower refcounts are on disk.
        self.inner.flush().await?;
        let cs = g.cluster_size();
        // No allocation may take a freed cluster between its refcount check and the punch.
        let _g = w.exclusive().await;
        hosts.sort_unstable();
        hosts.dedup();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for host in hosts {
            if w.refcount(HostCluster(host / cs)).await? != 0 {
                continue;
            }
            match runs.last_mut() {
                Some((start, len)) if *start + *len == host => *len += cs,
                _ => runs.push((host, cs)),
            }
        }
        let top = self.inner.top();
        for (start, len) in runs {
            // Best effort, as for a single cluster: the file system may not punch holes.
            let _ = top.file.discard_at(start, len).await;
        }
        Ok(())
    }

    /// Clears the L1 entries from index `keep` on and frees their L2 tables. Holds the meta
    /// lock; the L2 tables' entries were cleared and flushed before.
    async fn clear_l1_tail(&self, keep: u64, txn: &MetaTxn<'_, S>) -> Result<()> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let w = self.inner.alloc()?;
        let old: Vec<u64> = meta.l1.borrow().clone();
        let Ok(keep) = usize::try_from(keep) else {
            return Ok(());
        };
        if keep >= old.len() || old[keep..].iter().all(|&e| e == 0) {
            return Ok(());
        }
        let zeros = vec![0u8; (old.len() - keep) * 8];
        w.write_meta(
            "clearing the L1 table's tail",
            meta.l1_offset.get() + keep as u64 * 8,
            &zeros,
        )
        .await?;
        w.sync().await?;
        meta.l1.borrow_mut()[keep..].fill(0);
        w.mapping_changed();
        for word in &old[keep..] {
            let table = l1::table_of(*word);
            if table != 0 {
                txn.release_clusters(HostOffset(table), 1, true).await?;
            }
        }
        Ok(())
    }
}
