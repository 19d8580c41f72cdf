//! The qcow2 image engine: open an image and its backing chain over the [`storage`] seam, and
//! read, write, zero, discard, flush and query block status, with metadata cached by the
//! [`cache`] crate.
//!
//! One image is driven by one thread (a tokio current-thread runtime with a `LocalSet`): many
//! requests are in flight at once, metadata needs no locks because every change to a cached
//! table is a synchronous closure, and requests wait for each other only where they touch the
//! same guest clusters while one of them changes where those clusters live
//! ([`range_lock`]).
//!
//! Files: `open` (opening and validating a chain), `layer` (one file of the chain), `map`
//! (guest range → runs through one layer's L2 entries), `resolve` (through the whole chain),
//! `read`, `block_status`, `metacache` (cache keys and backends), `compress` (codecs),
//! `range_lock`, `backing_name` (which backing names we follow); the write side: `writer`
//! (refcount table, header bits), `refcount` (refcounts and the allocator), `l2_table`
//! (writable L2 tables), `l2_entry` (entry updates), `write` (allocation and copy-on-write),
//! `zero`, `discard`, `flush`, `overlap` (metadata that data must never overwrite).

mod backing_map;
pub mod backing_name;
mod block_status;
mod chain_walk;
pub mod check;
pub mod compress;
mod create;
mod discard;
mod error;
mod flush;
mod join_all;
mod l2_entry;
mod l2_table;
mod layer;
mod map;
mod metacache;
mod open;
mod overlap;
mod prealloc_detect;
pub mod range_lock;
mod read;
mod read_sparse;
mod refcount;
mod resize;
mod resolve;
mod write;
mod write_compressed;
mod writer;
mod zero;

pub use block_status::Extent;
pub use create::{create, create_file, CreateOptions, Preallocation};
pub use error::{libc_errno, EngineError, Result};
pub use open::{Format, OpenOptions};
pub use read_sparse::ReadPart;

use layer::Layer;
use metacache::{L2Backend, L2Key};
use range_lock::{LockMode, RangeGuard, RangeLocks};
use std::cell::RefCell;
use std::rc::Rc;
use storage::Storage;

/// The L2 cache shared by every layer of a chain.
pub(crate) type L2Cache<S> = cache::Cache<L2Key, L2Backend<S>>;

/// An open image (and its backing chain). Cheap to clone: clones share everything.
pub struct Image<S: Storage + 'static> {
    inner: Rc<Inner<S>>,
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
    layer: usize,
    raw: u64,
    data: Rc<[u8]>,
}

pub(crate) struct Inner<S: Storage + 'static> {
    /// Layer 0 is the opened image, layer n its n-th backing file.
    pub layers: Rc<Vec<Layer<S>>>,
    /// L2 slices of every layer.
    pub l2: Rc<L2Cache<S>>,
    /// No writes at all (read-only open, a snapshot, or a corrupt image).
    pub read_only: bool,
    /// Guest-cluster locks of layer 0.
    pub locks: RangeLocks,
    pub decompressed: RefCell<Option<Decompressed>>,
    /// The cache sizes in use.
    pub cache_sizes: cache::ResolvedCacheSizes,
    /// Which backing layer provides each granule (chains with two or more backing layers).
    pub backing_map: Option<backing_map::BackingMap<S>>,
    /// Refcounts and allocation state (writable qcow2 images only).
    pub writer: Option<writer::Writer<S>>,
    /// Punch holes in the file when a guest discard (or zeroing with unmap) frees clusters.
    pub discard_passthrough: bool,
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
        self.inner.layers[0].size.get()
    }

    /// True when writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    /// Number of layers in the chain (1 without a backing file).
    pub fn chain_len(&self) -> usize {
        self.inner.layers.len()
    }

    /// Facts about the image.
    pub fn facts(&self) -> ImageFacts {
        let top = &self.inner.layers[0];
        let (cluster_size, subcluster_size) = top.qcow2().map_or((512, 512), |m| {
            (m.geom.cluster_size(), m.geom.subcluster_size())
        });
        ImageFacts {
            size: top.size.get(),
            cluster_size,
            subcluster_size,
            qcow2: top.qcow2().is_some(),
            read_only: self.inner.read_only,
            chain: self.inner.layers.iter().map(|l| l.name.clone()).collect(),
        }
    }

    /// Statistics of the shared L2 cache.
    pub fn l2_cache_stats(&self) -> cache::CacheStats {
        self.inner.l2.stats()
    }

    /// Statistics of the merged backing map's cache, for chains that have one.
    pub fn backing_map_stats(&self) -> Option<cache::CacheStats> {
        self.inner.backing_map.as_ref().map(|m| m.stats())
    }

    /// The cache sizes resolved from the options and the image.
    pub fn cache_sizes(&self) -> cache::ResolvedCacheSizes {
        self.inner.cache_sizes
    }

    /// Drops metadata not used since the previous call (QEMU's `cache-clean-interval`).
    pub async fn clean_idle_caches(&self) -> Result<()> {
        if let Some(map) = &self.inner.backing_map {
            map.clean_idle().await?;
        }
        if let Some(w) = &self.inner.writer {
            w.refcounts
                .clean_idle()
                .await
                .map_err(|source| EngineError::Cache {
                    image: self.inner.layers[0].name.clone(),
                    source,
                })?;
        }
        self.inner
            .l2
            .clean_idle()
            .await
            .map_err(|source| EngineError::Cache {
                image: self.inner.layers[0].name.clone(),
                source,
            })
    }
}

impl<S: Storage + 'static> Inner<S> {
    /// Refuses requests that leave the disk.
    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.layers[0].size.get();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(EngineError::OutOfRange { offset, len, size }),
        }
    }

    /// Locks the layer-0 clusters under `[offset, offset + len)`. Read-only images change
    /// nothing, so they need no locks.
    pub(crate) async fn lock_range(
        &self,
        offset: u64,
        len: u64,
        mode: LockMode,
    ) -> Option<RangeGuard<'_>> {
        if self.read_only || len == 0 {
            return None;
        }
        let bits = self.layers[0].qcow2().map_or(9, |m| m.geom.cluster_bits());
        let first = offset >> bits;
        let last = (offset + len - 1) >> bits;
        Some(self.locks.lock(first, last + 1, mode).await)
    }
}
