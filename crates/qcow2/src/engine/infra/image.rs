//! An open image: the public handle [`Image`] and the state its operations share.

use super::cache_sizing::ResolvedCacheSizes;
use super::chain::{Chain, Piece};
use super::error::{EngineError, Result};
use super::layer::Layer;
use super::load::Format;
use super::metacache::{L2Cache, MetaCacheCounters, MetaCacheStats};
use super::range_lock::{LockMode, RangeGuard, RangeLocks};
use super::span_pool::{SpanBuf, SpanPool};
use crate::engine::alloc::{Allocator, MetaTxn};
use crate::format::GuestOffset;
use std::cell::RefCell;
use std::rc::Rc;
use storage::{IoBuf, Storage};

/// An open image (and its backing chain). Cheap to clone: clones share everything.
pub struct Image<S: Storage + 'static> {
    pub(in crate::engine) inner: Rc<Inner<S>>,
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
struct Decompressed {
    layer: usize,
    raw: u64,
    data: Rc<[u8]>,
}

/// The state every operation of one open image shares. Its fields are private to this module:
/// operations elsewhere go through the methods below, so that what a request may touch (the
/// chain it resolves through, the allocator that changes metadata, the locks it waits on) is
/// named in one place.
pub(crate) struct Inner<S: Storage + 'static> {
    /// The layers, their shared L2 cache, and how a guest range resolves through them.
    chain: Chain<S>,
    /// No writes at all (read-only open, a snapshot, or a corrupt image).
    read_only: bool,
    /// Guest-cluster locks of layer 0.
    locks: RangeLocks,
    decompressed: RefCell<Option<Decompressed>>,
    /// The cache sizes in use.
    cache_sizes: ResolvedCacheSizes,
    /// Refcounts and allocation (writable qcow2 images only).
    alloc: Option<Allocator<S>>,
    /// Punch holes in the file when a guest discard (or zeroing with unmap) frees clusters.
    discard_passthrough: bool,
    /// Spare buffers for allocating writes' copy-on-write spans.
    spans: SpanPool,
}

/// The whole image held by one operation (see [`Inner::quiesce`]); dropping it lets
/// requests in again.
pub(crate) struct Quiesced<'a, S: Storage + 'static> {
    _range: Option<RangeGuard<'a>>,
    _meta: MetaTxn<'a, S>,
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
    /// The state of a freshly opened image.
    pub(crate) fn new(
        chain: Chain<S>,
        read_only: bool,
        cache_sizes: ResolvedCacheSizes,
        alloc: Option<Allocator<S>>,
        discard_passthrough: bool,
    ) -> Self {
        Inner {
            chain,
            read_only,
            locks: RangeLocks::new(),
            decompressed: RefCell::new(None),
            cache_sizes,
            alloc,
            discard_passthrough,
            spans: SpanPool::default(),
        }
    }

    /// Appends the pieces `[offset, offset + len)` of the guest disk is made of, as the whole
    /// chain answers it (see [`Chain::resolve`]).
    pub(crate) async fn resolve(
        &self,
        offset: GuestOffset,
        len: u64,
        pieces: &mut Vec<Piece>,
    ) -> Result<()> {
        self.chain.resolve(offset, len, 0, pieces).await
    }

    /// The L2 slices of every layer, for operations that write back, forget or order them.
    pub(crate) fn l2(&self) -> &L2Cache<S> {
        &self.chain.l2
    }

    /// The first backing file, if there is one.
    pub(crate) fn backing(&self) -> Option<&Layer<S>> {
        self.chain.layers.get(1)
    }

    /// Whether the chain holds encrypted data.
    pub(crate) fn encrypted(&self) -> bool {
        self.chain.layers.iter().any(|l| l.crypto().is_some())
    }

    /// Layer 0, the file writes go to.
    pub(crate) fn top(&self) -> &Layer<S> {
        self.chain.top()
    }

    /// Layer `index` of the chain, 0 being the top.
    pub(crate) fn layer(&self, index: usize) -> &Layer<S> {
        &self.chain.layers[index]
    }

    /// How many layers the chain has (1: no backing file).
    pub(crate) fn depth(&self) -> usize {
        self.chain.layers.len()
    }

    /// The image has a backing file under layer 0.
    pub(crate) fn has_backing(&self) -> bool {
        self.chain.layers.len() > 1
    }

    /// The name of layer 0, for errors.
    pub(crate) fn name(&self) -> String {
        self.chain.top().name.clone()
    }

    /// No writes at all (read-only open, a snapshot, or a corrupt image).
    pub(crate) fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Guest discards (and zeroing with unmap) punch holes in the file.
    pub(crate) fn punches_holes(&self) -> bool {
        self.discard_passthrough
    }

    /// The allocator when the image has one, for work that only a writable image does
    /// (flushing refcounts, bitmaps) and that a read-only image skips rather than refuses.
    pub(crate) fn writer(&self) -> Option<&Allocator<S>> {
        self.alloc.as_ref()
    }

    /// A spare copy-on-write buffer of `len` bytes; hand it back with [`Inner::give_span`].
    pub(crate) fn take_span(&self, len: usize) -> SpanBuf {
        self.spans.take(len)
    }

    /// Returns a buffer taken with [`Inner::take_span`] for the next allocating write.
    pub(crate) fn give_span(&self, span: IoBuf) {
        self.spans.give(span)
    }

    /// The cluster last decompressed, if it is the one `raw` of layer `layer` names.
    pub(crate) fn recall_decompressed(&self, layer: usize, raw: u64) -> Option<Rc<[u8]>> {
        let d = self.decompressed.borrow();
        let d = d.as_ref()?;
        (d.layer == layer && d.raw == raw).then(|| d.data.clone())
    }

    /// Remembers a decompressed cluster. Only layers nobody writes may be remembered: a
    /// written layer could reuse the place.
    pub(crate) fn remember_decompressed(&self, layer: usize, raw: u64, data: &Rc<[u8]>) {
        if self.read_only || layer > 0 {
            *self.decompressed.borrow_mut() = Some(Decompressed {
                layer,
                raw,
                data: data.clone(),
            });
        }
    }

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

    /// Keeps every other request out of the whole image: all of layer 0's guest clusters
    /// locked exclusively, then the allocator's metadata held, in that order (the order every
    /// request takes them). For operations that change the image as a whole (snapshots, the
    /// refcount width).
    pub(crate) async fn quiesce(&self) -> Result<Quiesced<'_, S>> {
        let alloc = self.alloc()?;
        let range = self
            .lock_range(GuestOffset(0), self.top().size.get(), LockMode::Exclusive)
            .await;
        let meta = alloc.exclusive().await;
        Ok(Quiesced {
            _range: range,
            _meta: meta,
        })
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
            a.change_bitmaps(|b| b.mark(offset.0, len));
        }
    }
}
