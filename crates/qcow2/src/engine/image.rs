//! An open image: the public handle [`Image`] and the state its operations share.

use super::alloc::Allocator;
use super::cache_sizing::ResolvedCacheSizes;
use super::chain::Chain;
use super::error::{EngineError, Result};
use super::load::Format;
use super::metacache::{MetaCacheCounters, MetaCacheStats};
use super::range_lock::{LockMode, RangeGuard, RangeLocks};
use super::span_pool::SpanPool;
use crate::format::GuestOffset;
use std::cell::RefCell;
use std::rc::Rc;
use storage::Storage;

/// An open image (and its backing chain). Cheap to clone: clones share everything.
pub struct Image<S: Storage + 'static> {
    pub(super) inner: Rc<Inner<S>>,
}

impl<S: Storage + 'static> Clone for Image<S> {
    fn clone(&self) -> Self {
        Image {
            inner: self.inner.clone(),
        }
    }
}

/// The most recently decompressed cluster of a read-only layer, so that small sequential reads
/// of a compressed image do not decompress the same cluster again for every request.
pub(crate) struct Decompressed {
    pub layer: usize,
    pub raw: u64,
    pub data: Rc<[u8]>,
}

pub(crate) struct Inner<S: Storage + 'static> {
    /// The layers, their shared L2 cache, and how a guest range resolves through them.
    pub chain: Chain<S>,
    /// No writes at all (read-only open, a snapshot, or a corrupt image).
    pub read_only: bool,
    /// Guest-cluster locks of layer 0.
    pub locks: RangeLocks,
    pub decompressed: RefCell<Option<Decompressed>>,
    /// The cache sizes in use.
    pub cache_sizes: ResolvedCacheSizes,
    /// Refcounts and allocation (writable qcow2 images only).
    pub alloc: Option<Allocator<S>>,
    /// Punch holes in the file when a guest discard (or zeroing with unmap) frees clusters.
    pub discard_passthrough: bool,
    /// Spare buffers for allocating writes' copy-on-write spans.
    pub spans: SpanPool,
}

/// Facts about an open image, for `info`/`map` style output and for NBD negotiation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFacts {
    /// Guest-visible size in bytes.
    pub size: u64,
    /// Cluster size of layer 0 (for raw images, 512).
    pub cluster_size: u64,
    /// Subcluster size of layer 0 (the cluster size without extended L2 entries).
    pub subcluster_size: u64,
    /// Layer 0 is qcow2 (not raw).
    pub qcow2: bool,
    /// Writes are refused.
    pub read_only: bool,
    /// File names of the chain, layer 0 first.
    pub chain: Vec<String>,
}

impl<S: Storage + 'static> Image<S> {
    /// Guest-visible size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.chain.top().size.get()
    }

    /// True when writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    /// Number of layers in the chain (1 without a backing file).
    pub fn chain_len(&self) -> usize {
        self.inner.chain.layers.len()
    }

    /// The format of each file of the chain, layer 0 first (the order of
    /// [`ImageFacts::chain`]).
    pub fn chain_formats(&self) -> Vec<Format> {
        self.inner
            .chain
            .layers
            .iter()
            .map(|l| match l.qcow2() {
                Some(_) => Format::Qcow2,
                None => Format::Raw,
            })
            .collect()
    }

    /// The guest size of each file of the chain, layer 0 first (the order of
    /// [`ImageFacts::chain`]).
    pub fn chain_sizes(&self) -> Vec<u64> {
        self.inner
            .chain
            .layers
            .iter()
            .map(|l| l.size.get())
            .collect()
    }

    /// Facts about the image.
    pub fn facts(&self) -> ImageFacts {
        let top = self.inner.chain.top();
        let (cluster_size, subcluster_size) = top.qcow2().map_or((512, 512), |m| {
            (m.geom.cluster_size(), m.geom.subcluster_size())
        });
        ImageFacts {
            size: top.size.get(),
            cluster_size,
            subcluster_size,
            qcow2: top.qcow2().is_some(),
            read_only: self.inner.read_only,
            chain: self
                .inner
                .chain
                .layers
                .iter()
                .map(|l| l.name.clone())
                .collect(),
        }
    }

    /// Statistics of the shared L2 cache.
    pub fn l2_cache_stats(&self) -> cache::CacheStats {
        self.inner.chain.l2.stats()
    }

    /// Counters and occupancy of the L2 and refcount caches, for the server's statistics.
    pub fn meta_cache_stats(&self) -> MetaCacheStats {
        MetaCacheStats {
            l2: MetaCacheCounters::from_cache(&self.inner.chain.l2),
            refcount: self
                .inner
                .alloc
                .as_ref()
                .map(|w| w.refcount_cache_counters())
                .unwrap_or_default(),
        }
    }

    /// Statistics of the merged backing map's cache, for chains that have one.
    pub fn backing_map_stats(&self) -> Option<cache::CacheStats> {
        self.inner.chain.backing_map_stats()
    }

    /// The cache sizes resolved from the options and the image.
    pub fn cache_sizes(&self) -> ResolvedCacheSizes {
        self.inner.cache_sizes
    }

    /// Drops metadata not used since the previous call (QEMU's `cache-clean-interval`).
    pub async fn clean_idle_caches(&self) -> Result<()> {
        self.inner.spans.clear();
        self.inner.chain.clean_idle().await?;
        if let Some(w) = &self.inner.alloc {
            w.clean_idle_refcounts().await?;
        }
        self.inner
            .chain
            .l2
            .clean_idle()
            .await
            .map_err(|source| EngineError::Cache {
                image: self.inner.chain.top().name.clone(),
                source,
            })
    }
}

impl<S: Storage + 'static> Inner<S> {
    /// Refuses requests that leave the disk.
    pub(crate) fn check_range(&self, offset: GuestOffset, len: u64) -> Result<()> {
        let size = self.chain.top().size.get();
        match offset.0.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(EngineError::OutOfRange {
                offset: offset.0,
                len,
                size,
            }),
        }
    }

    /// Locks the layer-0 clusters under `[offset, offset + len)`. Read-only images change
    /// nothing, so they need no locks.
    pub(crate) async fn lock_range(
        &self,
        offset: GuestOffset,
        len: u64,
        mode: LockMode,
    ) -> Option<RangeGuard<'_>> {
        if self.read_only || len == 0 {
            return None;
        }
        let bits = self
            .chain
            .top()
            .qcow2()
            .map_or(9, |m| m.geom.cluster_bits());
        let first = offset.0 >> bits;
        let last = (offset.0 + len - 1) >> bits;
        Some(self.locks.lock(first, last + 1, mode).await)
    }

    /// The allocator, or the error a write to this image gets.
    pub(crate) fn alloc(&self) -> Result<&Allocator<S>> {
        match &self.alloc {
            None => Err(EngineError::ReadOnly {
                image: self.chain.top().name.clone(),
            }),
            Some(a) => a.ensure_usable().map(|()| a),
        }
    }

    /// Refuses writes to a read-only image or one found corrupt.
    pub(crate) fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly {
                image: self.chain.top().name.clone(),
            });
        }
        match &self.alloc {
            Some(a) => a.ensure_usable(),
            None => Ok(()),
        }
    }

    /// Marks a guest-visible change of `[offset, offset + len)` in every enabled persistent
    /// bitmap, before the change is made: a failed or torn request may still have changed
    /// data, so it is marked too, as QEMU marks it.
    pub(crate) fn track(&self, offset: GuestOffset, len: u64) {
        if let Some(a) = &self.alloc {
            a.mark_bitmaps(offset.0, len);
        }
    }
}
