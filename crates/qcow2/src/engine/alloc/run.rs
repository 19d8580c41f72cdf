//! Allocation for a run of guest clusters that a write fills: the transaction a write asks
//! for before its data I/O, and the release of what its new L2 entries replaced.

use super::Allocator;
use crate::engine::error::Result;
use crate::format::{GuestOffset, HostOffset, L1Index};
use storage::Storage;

/// Host clusters given to a run of guest clusters, not yet referenced by any L2 entry.
pub(crate) struct Allocation {
    /// Where the run's first cluster lives; the others follow it.
    pub host: HostOffset,
    /// The clusters were allocated for this run (their refcounts must reach disk before the
    /// L2 entries that point to them, and a failed write gives them back).
    pub allocated: bool,
    /// The clusters lie past everything the file may hold, so they read as zeros unwritten.
    pub fresh: bool,
    clusters: u64,
}

/// Clusters an L2 entry referenced before a write replaced it.
pub(crate) enum Replaced {
    /// A standard cluster shared with a snapshot or another entry.
    Shared(HostOffset),
    /// A compressed cluster, by its raw L2 descriptor.
    Compressed(u64),
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
    ) -> Result<Allocation> {
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
            host,
            allocated,
            fresh,
            clusters: n,
        })
    }

    /// Gives back the clusters of an allocation whose data could not be written.
    pub(crate) async fn abandon(&self, a: &Allocation) {
        if a.allocated {
            let _g = self.meta_lock.lock().await;
            if let Err(e2) = self.free_clusters(a.host, a.clusters, false).await {
                tracing::warn!("could not release clusters after a failed write: {e2}");
            }
        }
    }

    /// Releases what the new L2 entries of a run no longer use.
    pub(crate) async fn release(&self, replaced: impl IntoIterator<Item = Replaced>) -> Result<()> {
        let _g = self.meta_lock.lock().await;
        for old in replaced {
            match old {
                Replaced::Shared(host) => self.free_clusters(host, 1, false).await?,
                Replaced::Compressed(raw) => self.free_compressed(raw).await?,
            }
        }
        Ok(())
    }
}
