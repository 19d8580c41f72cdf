//! QEMU's guess whether a qcow2 layer was made with `preallocation=metadata`: then its data
//! clusters may sit over holes of the file, and block status asks the file which of them
//! really hold data. Otherwise a data cluster is data, whatever the file says — so `map` and
//! NBD block status agree with `qemu-img map` byte for byte.
//!
//! The test (as QEMU's `qcow2_detect_metadata_preallocation`): the clusters with a nonzero
//! refcount outnumber what the file really occupies by a ninth (and by at least two).

use crate::engine::infra::image::Image;
use crate::engine::infra::layer::Layer;
use crate::format::HostOffset;
use crate::format::{refcount, Structure};
use crate::metadata::{Loader, StorageSource, Strictness, REFCOUNT_TABLE};
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Whether layer `index` looks metadata-preallocated; decided once per layer, and any
    /// error reading refcounts simply means "no" (block status must not fail over a guess).
    ///
    /// Requests that ask while the first one is still counting wait for its answer instead of
    /// counting too: at queue depth 32 every request of a fresh connection asks at once, and
    /// each count holds the refcount table and a refcount block in memory.
    pub(crate) async fn metadata_preallocated(&self, index: usize) -> bool {
        let layer = &self.inner.layer(index);
        let Some(meta) = layer.qcow2() else {
            return false;
        };
        if meta.crypto.is_some() {
            // A hole under an encrypted cluster deciphers to noise, not zeros: its data is
            // data (QEMU does not ask the file either, as it maps no offsets for them).
            return false;
        }
        let decide = || async { self.detect(index, layer).await.unwrap_or(false) };
        *meta.metadata_prealloc.get_or_init(decide).await
    }

    async fn detect(&self, index: usize, layer: &Layer<S>) -> Option<bool> {
        let meta = layer.qcow2()?;
        let g = &meta.geom;
        let cs = g.cluster_size();
        let real_clusters = layer.file.allocated_size()? / cs;
        let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
        let file_len = layer.file.len().await.ok()?;
        let end_cluster = file_len.div_ceil(cs);
        let rg = meta.refcount_geom.get();
        let order = rg.refcount_order();
        let per_block = rg.refcount_block_entries();
        let entries = usize::try_from(per_block).ok()?;
        // Layer 0 of a writable image: its refcount blocks may be newer in the cache than in
        // the file, so count through the cache.
        let writer = self.inner.writer().filter(|_| index == 0);
        let reftable: Vec<u64> = match writer {
            Some(w) => w.refcount_table(),
            None => {
                let h = meta.header.borrow().clone();
                let len = u64::from(h.refcount_table_clusters) * cs;
                let src = StorageSource::new(&layer.file, meta.file_end.get());
                let offset = h.refcount_table_offset;
                Loader::new(&src, Strictness::Open)
                    .table(Structure::RefcountTable, REFCOUNT_TABLE, offset, len)
                    .await
                    .ok()?
                    .into_iter()
                    .map(refcount::block_of)
                    .collect()
            }
        };
        let count_block = |b: &[u8], n: usize| {
            (0..n)
                .filter(|&i| refcount::get(b, order, i).is_ok_and(|r| r != 0))
                .count() as u64
        };
        let mut counted = 0u64;
        for (i, &block) in reftable.iter().enumerate() {
            let first = (i as u64).checked_mul(per_block)?;
            if first >= end_cluster || counted >= threshold {
                break;
            }
            if block == 0 {
                continue;
            }
            let n = usize::try_from((end_cluster - first).min(per_block)).ok()?;
            counted += match writer {
                Some(w) => w
                    .read_refcount_block(HostOffset(block), |b| count_block(b, n))
                    .await
                    .ok()?,
                None => {
                    let b = layer
                        .read_file("reading a refcount block", block, usize::try_from(cs).ok()?)
                        .await
                        .ok()?;
                    count_block(&b, n.min(entries))
                }
            };
        }
        Some(counted >= threshold)
    }
}
