//! Emptying layer 0, as `qemu-img commit` does to the top image once the base holds its
//! data: every L2 entry becomes unallocated (not zero: the backing file is meant to show
//! through again). A version 3 image whose clusters all belong to the active disk gets a new,
//! minimal structure, as in QEMU (`alloc/empty.rs`); any other image has the clusters its
//! entries held released one by one.

use crate::engine::alloc::{L2Change, Precedes};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::range_lock::LockMode;
use crate::format::GuestOffset;
use storage::Storage;

/// Clusters looked at per step, so that the entries of a huge disk are never all in memory.
const STEP_CLUSTERS: u64 = 1 << 16;

impl<S: Storage + 'static> Image<S> {
    /// Drops every cluster mapping of the image, so that every guest byte reads from the
    /// backing file. Internal snapshots keep their clusters (only this view's references go).
    pub async fn make_empty(&self) -> Result<()> {
        self.inner.check_writable()?;
        let top = self.inner.top();
        let unsupported = |what: &str| EngineError::Unsupported {
            image: top.name.clone(),
            what: what.into(),
        };
        let meta = top
            .qcow2()
            .ok_or_else(|| unsupported("emptying a raw image"))?;
        if meta.data_raw {
            // Its raw data file would have to be emptied too, which only its owner can do.
            return Err(unsupported(
                "emptying an image whose external data file is a raw image",
            ));
        }
        let size = top.size.get();
        if size == 0 {
            return Ok(());
        }
        self.inner.track(GuestOffset(0), size);
        let _guard = self
            .inner
            .lock_range(GuestOffset(0), size, LockMode::Exclusive)
            .await;
        let w = self.inner.alloc()?;
        if w.can_empty_completely() {
            return w.make_completely_empty().await;
        }
        let step = STEP_CLUSTERS.saturating_mul(meta.geom.cluster_size());
        let mut pos = 0;
        while pos < size {
            let n = step.min(size - pos);
            for e in w.l2_entries(GuestOffset(pos), n).await? {
                if e.table.is_none() || (e.word, e.bitmap) == (0, 0) {
                    continue;
                }
                let change =
                    L2Change::set(e.cluster, 0, 0).releasing(e.word, self.inner.punches_holes());
                w.change_l2(Precedes::Data, [change]).await?;
            }
            pos += n;
        }
        Ok(())
    }
}
