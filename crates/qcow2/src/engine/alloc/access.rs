//! What the rest of the engine may ask of the allocator: every question and change is named
//! for its intent, so the allocator's state stays private to it and a reader finds every
//! change to it in `alloc/`.

use super::reftable::RefTable;
use super::Allocator;
use crate::engine::infra::bitmaps::Bitmaps;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::metacache::MetaCacheCounters;
use crate::engine::infra::overlap::{MetaIndex, MetaKind};
use crate::format::{HostCluster, HostOffset};
use storage::Storage;

/// Exclusive use of the allocator's metadata for a sequence of steps (allocation, table
/// growth, snapshot and refcount-structure changes) that must not interleave with another
/// allocation. Released when dropped; never held across guest data I/O.
#[must_use = "the allocator is exclusive only while the transaction is held"]
pub(crate) struct MetaTxn<'a, S: Storage + 'static> {
    alloc: &'a Allocator<S>,
    _guard: tokio::sync::MutexGuard<'a, ()>,
}

impl<S: Storage + 'static> MetaTxn<'_, S> {
    /// Allocates `n` contiguous clusters for a metadata operation's own use (a table, or
    /// clusters it preallocates or expands): their refcounts only. Entries reach them through
    /// [`Allocator::change_l2`] with [`Precedes::CallerOrder`](super::Precedes::CallerOrder),
    /// or after a flush.
    pub(crate) async fn claim_clusters(&self, n: u64) -> Result<HostOffset> {
        self.alloc.alloc_clusters(n).await
    }

    /// Drops one reference from each of `n` clusters at `host` that a metadata operation no
    /// longer points to (`punch`: punch those freed out of the file).
    pub(crate) async fn release_clusters(
        &self,
        host: HostOffset,
        n: u64,
        punch: bool,
    ) -> Result<()> {
        self.alloc.free_clusters(host, n, punch).await
    }
}

impl<S: Storage + 'static> Allocator<S> {
    /// Waits for exclusive use of the allocator's metadata (see [`MetaTxn`]).
    pub(crate) async fn exclusive(&self) -> MetaTxn<'_, S> {
        MetaTxn {
            alloc: self,
            _guard: self.meta_lock.lock().await,
        }
    }

    /// True when refcounts may lag behind L2 entries (the dirty bit covers them).
    pub(super) fn lazy_refcounts(&self) -> bool {
        self.lazy_refcounts.get()
    }

    /// Stops lazy refcounts: from now on refcounts go to disk before the L2 entries that
    /// use them.
    pub(crate) fn disable_lazy_refcounts(&self) {
        self.lazy_refcounts.set(false);
    }

    /// Records that the file may hold data up to `end`: clusters below it no longer read
    /// as zeros without being written.
    pub(crate) fn note_file_end(&self, end: HostOffset) {
        if end.0 > self.physical_len.get() {
            self.physical_len.set(end.0);
        }
    }

    /// Writes every dirty refcount block back to the file (not synced).
    pub(crate) async fn flush_refcounts(&self) -> Result<()> {
        self.refcounts
            .flush()
            .await
            .map_err(|source| EngineError::Cache {
                image: self.top().name.clone(),
                source,
            })
    }

    /// Drops refcount blocks not used since the previous call.
    pub(crate) async fn clean_idle_refcounts(&self) -> Result<()> {
        self.refcounts
            .clean_idle()
            .await
            .map_err(|source| EngineError::Cache {
                image: self.top().name.clone(),
                source,
            })
    }

    /// The refcount cache's counters, for statistics.
    pub(crate) fn refcount_cache_counters(&self) -> MetaCacheCounters {
        MetaCacheCounters::from_cache(&self.refcounts)
    }

    /// A copy of the refcount table's entries up to its last block (block offset per
    /// entry, 0 = no block; every later entry is 0).
    pub(crate) fn refcount_table(&self) -> Vec<u64> {
        self.reftable.borrow().used().to_vec()
    }

    /// Applies `f` to the refcount block at `block` as the allocator holds it (it may be
    /// newer in the cache than in the file).
    pub(crate) async fn read_refcount_block<R>(
        &self,
        block: HostOffset,
        f: impl FnOnce(&[u8]) -> R,
    ) -> std::result::Result<R, cache::CacheError> {
        self.refcounts.read(block, f).await
    }

    /// Makes the allocator use a new refcount structure whose table is `table`: the old
    /// blocks leave the cache unwritten (the caller made sure they were clean), `reindex`
    /// moves the metadata index from the old table to the new one, and the free-cluster
    /// search starts over.
    pub(crate) fn adopt_refcount_table(
        &self,
        table: Vec<u64>,
        reindex: impl FnOnce(&mut MetaIndex, &[u64]),
    ) {
        self.refcounts.forget(|_| true);
        reindex(&mut self.meta.borrow_mut(), self.reftable.borrow().used());
        *self.reftable.borrow_mut() = RefTable::from_entries(table);
        self.free_hint.set(HostCluster(0));
        self.free_byte_offset.set(0);
    }

    /// Records metadata of `kind` at `[start, start + len)`: data writes must never touch it.
    pub(crate) fn record_metadata(&self, start: HostOffset, len: u64, kind: MetaKind) {
        self.meta.borrow_mut().insert(start, len, kind);
    }

    /// Forgets the metadata range that starts at `start` (its clusters may now hold data).
    pub(crate) fn forget_metadata(&self, start: HostOffset) {
        self.meta.borrow_mut().remove(start);
    }

    /// Applies `f` to the persistent bitmaps as held in memory.
    pub(crate) fn with_bitmaps<R>(&self, f: impl FnOnce(&Bitmaps) -> R) -> R {
        f(&self.bitmaps.borrow())
    }

    /// Changes the persistent bitmaps held in memory (stored on close).
    pub(crate) fn change_bitmaps<R>(&self, f: impl FnOnce(&mut Bitmaps) -> R) -> R {
        f(&mut self.bitmaps.borrow_mut())
    }
}
