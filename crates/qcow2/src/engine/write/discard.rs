//! Discard (NBD TRIM), as QEMU does it: only whole clusters, the range reads as zeros
//! afterwards whenever a backing file could otherwise show through, and clusters whose
//! refcount drops to zero are freed (and punched out of the file with discard passthrough).

use crate::engine::alloc::{L2Change, Precedes};
use crate::engine::infra::error::Result;
use crate::engine::infra::image::Image;
use crate::engine::infra::range_lock::LockMode;
use crate::format::l2;
use crate::format::l2_extended::ALL_ZERO_BITMAP;
use crate::format::GuestOffset;
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Discards `[offset, offset + len)`: advisory, so unaligned edges are simply kept.
    pub async fn discard(&self, offset: GuestOffset, len: u64) -> Result<()> {
        self.inner.check_writable()?;
        self.inner.check_range(offset, len)?;
        // The whole request, as QEMU marks it, even the parts that stay as they were.
        self.inner.track(offset, len);
        let offset = offset.0;
        let top = self.inner.top();
        if top.luks().is_some() {
            // A hole under a LUKS volume would read back as noise: QEMU's `luks` driver
            // discards nothing either.
            return Ok(());
        }
        let Some(meta) = top.qcow2() else {
            let punch = self.inner.punches_holes();
            if punch && len > 0 {
                top.file
                    .discard_at(offset, len)
                    .await
                    .map_err(|e| top.io_error("discarding", offset, e))?;
            }
            return Ok(());
        };
        let w = self.inner.alloc()?;
        let g = &meta.geom;
        let cs = g.cluster_size();
        let size = top.size.get();
        let has_backing = self.inner.has_backing();
        let v3 = meta.header.borrow().version >= 3;
        if !v3 && has_backing {
            // Without the zero flag, freeing would expose the backing file: QEMU declines too.
            return Ok(());
        }
        let start = offset.div_ceil(cs) * cs;
        let end = if offset + len == size {
            size
        } else {
            (offset + len) / cs * cs
        };
        if start >= end {
            return Ok(());
        }
        let _guard = self
            .inner
            .lock_range(GuestOffset(start), end - start, LockMode::Exclusive)
            .await;
        if meta.data_raw {
            // Discarded clusters read as zeros, so the raw data file must too.
            if let Some(d) = &meta.data_file {
                d.write_zeroes_at(start, end - start, true)
                    .await
                    .map_err(|e| top.io_error("zeroing the raw data file", start, e))?;
            }
        }
        let entries = w.l2_entries(GuestOffset(start), end - start).await?;
        for e in entries {
            if e.table.is_none() {
                continue;
            }
            let allocated = l2::holds_cluster(e.word);
            if !has_backing && !allocated {
                continue;
            }
            let (word, bitmap) = if g.extended_l2() {
                (0, ALL_ZERO_BITMAP)
            } else if v3 {
                (l2::zeroed_word(0), 0)
            } else {
                (0, 0)
            };
            if (word, bitmap) == (e.word, e.bitmap) {
                continue;
            }
            // The entry reaches disk before the refcount drops, and after any data
            // written before it.
            let change = L2Change::set(e.cluster, word, bitmap)
                .releasing(e.word, self.inner.punches_holes());
            w.change_l2(Precedes::Data, [change]).await?;
        }
        Ok(())
    }
}
