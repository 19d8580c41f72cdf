//! Every change to an L2 entry of the writable layer goes through one function,
//! [`Allocator::change_l2`]: it takes the changes as [`L2Change`] values (the guest cluster,
//! its new words or the rule that updates them, and what the clusters the entry referenced
//! before become) and a [`Precedes`] that says what must reach disk before them. A write
//! that needs new clusters first gets an [`Allocation`] (`allocate` or `allocate_packed`:
//! writable L2 tables and host clusters, under the allocator's own lock), writes its data,
//! and then hands the allocation to `change_l2` (or gives it back with
//! [`Allocation::abandon`] after a failed data write).
//!
//! Ordering before an L2 update, in one place: with lazy refcounts the dirty bit is set
//! first; otherwise the refcounts of clusters just allocated reach disk before the entry
//! (compressed bytes always, as QEMU orders them); data written for the entry reaches disk
//! before the L2 table does. Old clusters are freed only after their entries changed.
//! Preallocation and amend's zero-cluster expansion keep an order of their own
//! ([`Precedes::CallerOrder`]: refcounts first even with lazy refcounts, no dirty bit).

use super::Allocator;
use crate::engine::infra::error::{EngineError, Result};
use crate::format::l2;
use crate::format::l2_extended::{pack_bitmap, unpack_bitmap};
use crate::format::{GuestOffset, HostOffset, L1Index};
use storage::Storage;

/// Host clusters given to a run of guest clusters, not yet referenced by any L2 entry:
/// write their data, then point entries at them with [`Precedes::Allocation`] or give them
/// back with [`abandon`](Allocation::abandon).
#[must_use = "an allocation is referenced only once entries point at it"]
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

/// One change to the L2 entry of a guest cluster of the writable layer.
pub(crate) struct L2Change {
    /// Guest offset of the cluster's first byte.
    pub cluster: GuestOffset,
    /// What the entry becomes.
    pub new: NewWords,
    /// What the clusters the entry referenced before become once it changed.
    pub old: OldClusters,
}

impl L2Change {
    /// Points the guest cluster at `cluster` at `word`/`bitmap`, keeping what it held.
    pub(crate) fn set(cluster: GuestOffset, word: u64, bitmap: u64) -> L2Change {
        L2Change {
            cluster,
            new: NewWords::Set { word, bitmap },
            old: OldClusters::Kept,
        }
    }

    /// As it is, dropping the reference of the entry `old_word` held (0: none) once the
    /// entry changed (`punch`: punch a cluster that is then free out of the file).
    pub(crate) fn releasing(self, old_word: u64, punch: bool) -> L2Change {
        let old = match (old_word, punch) {
            (0, _) => OldClusters::Kept,
            (w, false) => OldClusters::Freed(w),
            (w, true) => OldClusters::Punched(w),
        };
        L2Change { old, ..self }
    }
}

/// What an L2 entry becomes.
pub(crate) enum NewWords {
    /// These words (`bitmap`: the subcluster bitmap, 0 without extended L2 entries).
    Set { word: u64, bitmap: u64 },
    /// Its own words with the subclusters `bits` allocated (their zero bits cleared), after a
    /// write filled the cluster in place at `host`. An entry that no longer points at `host`
    /// means the image changed under the write: it stays as it is and the image is marked
    /// corrupt.
    MarkAllocated { host: HostOffset, bits: u32 },
}

/// What the clusters an L2 entry referenced become once the entry changed.
pub(crate) enum OldClusters {
    /// Still referenced, or nothing to release.
    Kept,
    /// One reference dropped; the raw word of the entry as it was (standard or compressed).
    Freed(u64),
    /// As [`Freed`](OldClusters::Freed), and a standard cluster left unreferenced is punched
    /// out of the file.
    Punched(u64),
}

/// What must reach disk before the L2 entries of a [`change_l2`](Allocator::change_l2).
pub(crate) enum Precedes<'a, S: Storage + 'static> {
    /// Nothing but the dirty bit (lazy refcounts): the entries point at no new cluster and
    /// no data was written for them.
    Nothing,
    /// Data written for the entries (and the dirty bit).
    Data,
    /// The clusters of an allocation the entries point at: their refcounts (unless lazy
    /// refcounts cover them; compressed bytes always), the data written into them, the dirty
    /// bit.
    Allocation(Allocation<'a, S>),
    /// The caller's own order, for a metadata operation (preallocation, zero-cluster
    /// expansion) that claimed its clusters through a [`MetaTxn`](super::MetaTxn): no dirty
    /// bit; `refcounts`: the refcounts of the clusters it claimed reach disk first, even with
    /// lazy refcounts.
    CallerOrder { refcounts: bool },
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
                let fresh = h.0 >= fresh_from;
                if fresh {
                    self.unwritten.borrow_mut().allocated_fresh(h, n);
                }
                (h, true, fresh)
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

    /// Applies `changes` to layer 0's L2 entries, after what `before` says must precede
    /// them on disk; then drops the references the old entries held, as each change says.
    /// The only way an L2 entry of the writable layer changes; its table must already be
    /// writable (`allocate`, or [`l2_for_write`](Self::l2_for_write) under the caller's
    /// [`MetaTxn`](super::MetaTxn)).
    pub(crate) async fn change_l2(
        &self,
        before: Precedes<'_, S>,
        changes: impl IntoIterator<Item = L2Change>,
    ) -> Result<()> {
        match before {
            Precedes::Nothing => self.before_l2_update(false, false).await?,
            Precedes::Data => self.before_l2_update(false, true).await?,
            Precedes::Allocation(a) => {
                let refcounts = a.allocated && (a.packed || !self.lazy_refcounts());
                self.before_l2_update(refcounts, true).await?;
            }
            Precedes::CallerOrder { refcounts: true } => self.refcounts_before_l2().await?,
            Precedes::CallerOrder { refcounts: false } => {}
        }
        let mut released = Vec::new();
        for c in changes {
            self.apply(c.cluster, c.new).await?;
            match c.old {
                OldClusters::Kept => {}
                OldClusters::Freed(word) => released.push((word, false)),
                OldClusters::Punched(word) => released.push((word, true)),
            }
        }
        self.release(released).await
    }

    /// Sets what must precede an L2 update on disk: the refcounts (`refcounts_first`), the
    /// dirty bit (lazy refcounts), and the data written before it (`after_data`).
    async fn before_l2_update(&self, refcounts_first: bool, after_data: bool) -> Result<()> {
        self.ensure_usable()?;
        if refcounts_first {
            self.refcounts_before_l2().await?;
        }
        if self.lazy_refcounts() {
            self.mark_dirty().await?;
        }
        if after_data {
            self.l2.set_flush_before_writeback();
        }
        Ok(())
    }

    /// Makes the L2 cache write back only after the refcount cache: the refcounts of clusters
    /// just allocated reach disk before any L2 entry that points to them.
    async fn refcounts_before_l2(&self) -> Result<()> {
        self.ensure_usable()?;
        self.l2
            .set_dependency(self.refcounts_flush())
            .await
            .map_err(|source| EngineError::Cache {
                image: self.top().name.clone(),
                source,
            })
    }

    /// Stores the new words of the entry of the guest cluster at `cluster`.
    async fn apply(&self, cluster: GuestOffset, new: NewWords) -> Result<()> {
        let (host, bits) = match new {
            NewWords::Set { word, bitmap } => {
                return self
                    .update_l2_entry(cluster, |_, _| Some((word, bitmap)))
                    .await
                    .map(drop)
            }
            NewWords::MarkAllocated { host, bits } => (host, bits),
        };
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

    /// Drops the reference each old L2 entry word held on its host cluster(s), if any
    /// (`true`: punch a cluster left unreferenced out of the file).
    async fn release(&self, old: Vec<(u64, bool)>) -> Result<()> {
        // Clusters in an external data file are not refcounted.
        if old.is_empty() || self.meta().data_file.is_some() {
            return Ok(());
        }
        self.ensure_usable()?;
        let _g = self.meta_lock.lock().await;
        for (word, punch) in old {
            if l2::is_compressed(word) {
                self.free_compressed(word).await?;
            } else if l2::host_of(word) != 0 {
                self.free_clusters(HostOffset(l2::host_of(word)), 1, punch)
                    .await?;
            }
        }
        Ok(())
    }
}

impl<S: Storage + 'static> Allocation<'_, S> {
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
