//! A write's side of the allocator, as one transaction per run of guest clusters:
//! `allocate` (writable L2 tables and host clusters, under the allocator's own lock), then the
//! caller writes the data, then [`Allocation::commit`] points the L2 entries at it in the
//! order a crash needs and frees what they replaced (or [`Allocation::abandon`] gives the
//! clusters back after a failed data write). The L2 changes that allocate nothing (discard,
//! zeroing, `make_empty`, shrinking, a write marking subclusters allocated) go through
//! [`Allocator::remap`] and [`Allocator::mark_allocated`] here too. Preallocation and amend's
//! zero-cluster expansion keep an order of their own (refcounts first even with lazy
//! refcounts, no dirty bit) through [`Allocator::refcounts_before_l2`] and `set_l2_entry`.
//!
//! Ordering before an L2 update, in one place: with lazy refcounts the dirty bit is set
//! first; otherwise the refcounts of clusters just allocated reach disk before the entry
//! (compressed bytes always, as QEMU orders them); data written for the entry reaches disk
//! before the L2 table does. Old clusters are freed only after their entries changed.

use super::Allocator;
use crate::engine::infra::error::{EngineError, Result};
use crate::format::l2;
use crate::format::l2_extended::{pack_bitmap, unpack_bitmap};
use crate::format::{GuestOffset, HostOffset, L1Index};
use storage::Storage;

/// Host clusters given to a run of guest clusters, not yet referenced by any L2 entry:
/// write their data, then [`commit`](Allocation::commit) or [`abandon`](Allocation::abandon).
#[must_use = "an allocation is referenced only once it is committed"]
pub(crate) struct Allocation<'a, S: Storage + 'static> {
    alloc: &'a Allocator<S>,
    /// Where the run's first cluster (or the compressed bytes) lives; the others follow it.
    pub host: HostOffset,
    /// The clusters lie past everything the file may hold, so they read as zeros unwritten.
    pub fresh: bool,
    /// The clusters were allocated for this run (their refcounts must reach disk before the
    /// L2 entries that point to them, and a failed write gives them back).
    allocated: bool,
    /// Bytes for a compressed cluster rather than whole clusters.
    packed: bool,
    clusters: u64,
}

/// Clusters an L2 entry referenced before a write replaced it.
pub(crate) enum Replaced {
    /// A standard cluster shared with a snapshot or another entry.
    Shared(HostOffset),
    /// A compressed cluster, by its raw L2 descriptor.
    Compressed(u64),
}

/// One L2 entry a commit writes: the guest cluster, its new words, and what it held before
/// that the commit frees.
pub(crate) struct NewEntry {
    pub cluster: GuestOffset,
    pub word: u64,
    /// Subcluster bitmap (0 without extended L2 entries).
    pub bitmap: u64,
    pub replaced: Option<Replaced>,
}

impl<S: Storage + 'static> Allocator<S> {
    /// Makes writable the L2 tables of `l1_indexes` and gives the run of `n` guest clusters
    /// starting at `first` its host clusters: `preset` when the run already has them, the
    /// guest's own offsets in an external data file, new clusters otherwise. Holds the
    /// metadata lock only while it allocates (never across the data I/O that follows).
    pub(crate) async fn allocate(
        &self,
        l1_indexes: impl IntoIterator<Item = L1Index>,
        first: GuestOffset,
        n: u64,
        preset: Option<HostOffset>,
    ) -> Result<Allocation<'_, S>> {
        let _g = self.meta_lock.lock().await;
        let mut last_l1 = None;
        for l1i in l1_indexes {
            if last_l1 != Some(l1i) {
                self.l2_for_write(l1i).await?;
                last_l1 = Some(l1i);
            }
        }
        let fresh_from = self.physical_len.get();
        let (host, allocated, fresh) = match preset {
            Some(h) => (h, false, false),
            // The data file mirrors the guest's layout.
            None if self.meta().data_file.is_some() => (HostOffset(first.0), false, false),
            None => {
                let h = self.alloc_clusters(n).await?;
                (h, true, h.0 >= fresh_from)
            }
        };
        Ok(Allocation {
            alloc: self,
            host,
            fresh,
            allocated,
            packed: false,
            clusters: n,
        })
    }

    /// Makes writable the L2 table of the guest cluster at `cluster` and gives its
    /// compressed data `len` bytes, packed after the previous compressed cluster's.
    pub(crate) async fn allocate_packed(
        &self,
        cluster: GuestOffset,
        len: u64,
    ) -> Result<Allocation<'_, S>> {
        let _g = self.meta_lock.lock().await;
        self.l2_for_write(self.meta().geom.l1_index(cluster))
            .await?;
        let host = self.alloc_bytes(len).await?;
        Ok(Allocation {
            alloc: self,
            host,
            fresh: false,
            allocated: true,
            packed: true,
            clusters: 0,
        })
    }

    /// Sets what must precede an L2 update on disk: the dirty bit (lazy refcounts), the
    /// refcounts (`refcounts_first`), and the data written before it.
    async fn before_l2_update(&self, refcounts_first: bool) -> Result<()> {
        self.ensure_usable()?;
        if refcounts_first {
            self.refcounts_before_l2().await?;
        }
        if self.lazy_refcounts() {
            self.mark_dirty().await?;
        }
        self.l2.set_flush_before_writeback();
        Ok(())
    }

    /// Makes the L2 cache write back only after the refcount cache: the refcounts of clusters
    /// just allocated reach disk before any L2 entry that points to them.
    pub(crate) async fn refcounts_before_l2(&self) -> Result<()> {
        self.ensure_usable()?;
        self.l2
            .set_dependency(self.refcounts_flush())
            .await
            .map_err(|source| EngineError::Cache {
                image: self.top().name.clone(),
                source,
            })
    }

    /// Sets the allocation bits `bits` (clearing their zero bits) of the entry of the guest
    /// cluster at `cluster`, which a write just filled in place at `host`, after its data.
    /// An entry that no longer points at `host` means the image changed under the write: it
    /// is marked corrupt.
    pub(crate) async fn mark_allocated(
        &self,
        cluster: GuestOffset,
        host: HostOffset,
        bits: u32,
    ) -> Result<()> {
        self.before_l2_update(false).await?;
        let (word, _) = self
            .update_l2_entry(cluster, |word, bitmap| {
                if l2::host_of(word) != host.0 {
                    return None;
                }
                let (alloc, zero) = unpack_bitmap(bitmap);
                let alloc = alloc | bits;
                Some((word, pack_bitmap(alloc, zero & !alloc)))
            })
            .await?;
        if l2::host_of(word) != host.0 {
            return Err(self
                .mark_corrupt(format!(
                    "L2 entry of guest cluster {:#x} changed under a write ({:#x} != {:#x})",
                    cluster.0,
                    l2::host_of(word),
                    host.0
                ))
                .await);
        }
        Ok(())
    }

    /// Points the guest cluster at `cluster` at `word`/`bitmap` (nothing, or zeros), which
    /// allocates nothing, and then drops the references the old entry `released` held (0:
    /// none; `punch`: punch freed clusters out of the file). `after_data`: data was written
    /// that this entry must not reach disk before.
    pub(crate) async fn remap(
        &self,
        cluster: GuestOffset,
        (word, bitmap): (u64, u64),
        released: u64,
        punch: bool,
        after_data: bool,
    ) -> Result<()> {
        self.ensure_usable()?;
        if after_data {
            self.l2.set_flush_before_writeback();
        }
        if self.lazy_refcounts() {
            self.mark_dirty().await?;
        }
        self.set_l2_entry(cluster, word, bitmap).await?;
        if released == 0 {
            return Ok(());
        }
        self.release_entry(released, punch).await
    }

    /// Points the guest cluster at `cluster` at `word`/`bitmap` for a metadata operation
    /// (preallocation, zero-cluster expansion) that claimed the clusters through its
    /// [`MetaTxn`](super::MetaTxn) and ordered their refcounts before this entry itself: no
    /// ordering, dirty marking or release of its own, so the operation's crash order is the
    /// one it chose.
    pub(crate) async fn place(&self, cluster: GuestOffset, word: u64, bitmap: u64) -> Result<()> {
        self.set_l2_entry(cluster, word, bitmap).await
    }

    /// Drops the reference an old L2 entry `old_word` held on its host cluster(s), if any.
    async fn release_entry(&self, old_word: u64, punch: bool) -> Result<()> {
        // Clusters in an external data file are not refcounted.
        if self.meta().data_file.is_some() {
            return Ok(());
        }
        self.ensure_usable()?;
        let _g = self.meta_lock.lock().await;
        if l2::is_compressed(old_word) {
            self.free_compressed(old_word).await
        } else if l2::host_of(old_word) != 0 {
            self.free_clusters(HostOffset(l2::host_of(old_word)), 1, punch)
                .await
        } else {
            Ok(())
        }
    }
}

impl<S: Storage + 'static> Allocation<'_, S> {
    /// Points `entries` at the allocation (in the order a crash needs, see the module doc),
    /// then frees what they replaced.
    pub(crate) async fn commit(self, entries: impl IntoIterator<Item = NewEntry>) -> Result<()> {
        let a = self.alloc;
        a.before_l2_update(self.allocated && (self.packed || !a.lazy_refcounts()))
            .await?;
        let mut replaced = Vec::new();
        for e in entries {
            a.set_l2_entry(e.cluster, e.word, e.bitmap).await?;
            replaced.extend(e.replaced);
        }
        if replaced.is_empty() {
            return Ok(());
        }
        let _g = a.meta_lock.lock().await;
        for old in replaced {
            match old {
                Replaced::Shared(host) => a.free_clusters(host, 1, false).await?,
                Replaced::Compressed(raw) => a.free_compressed(raw).await?,
            }
        }
        Ok(())
    }

    /// Gives back the clusters of an allocation whose data could not be written.
    pub(crate) async fn abandon(self) {
        if self.allocated && !self.packed {
            let a = self.alloc;
            let _g = a.meta_lock.lock().await;
            if let Err(e2) = a.free_clusters(self.host, self.clusters, false).await {
                tracing::warn!("could not release clusters after a failed write: {e2}");
            }
        }
    }
}
