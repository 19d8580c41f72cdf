//! Write zeroes (NBD WRITE_ZEROES): zero flags (version 3) or zero subcluster bits (extended
//! L2) for every whole (sub)cluster, optionally freeing the clusters (may-unmap); unaligned
//! edges become zero flags too when the rest of their (sub)cluster already reads as zeros,
//! and are otherwise written as zero data. A fast-zero request fails with `ZeroNotFast`
//! before changing anything if any part would need data written.

use super::chain::Source;
use super::error::{EngineError, Result};
use super::image::{Image, Inner};
use super::range_lock::LockMode;
use crate::format::l2;
use crate::format::l2_extended::{pack_bitmap, subcluster_mask, unpack_bitmap, ALL_ZERO_BITMAP};
use crate::format::GuestOffset;
use storage::{IoBuf, Storage};

/// Largest zero buffer written at once when zeros must be written as data.
const ZERO_CHUNK: u64 = 1 << 20;

impl<S: Storage + 'static> Image<S> {
    /// Makes `[offset, offset + len)` read as zeros. With `may_unmap` the clusters may be
    /// freed; with `fast`, fail with [`EngineError::ZeroNotFast`] rather than write data.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast: bool,
    ) -> Result<()> {
        self.inner.write_zeroes(offset, len, may_unmap, fast).await
    }
}

impl<S: Storage + 'static> Inner<S> {
    pub(crate) async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast: bool,
    ) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let top = self.chain.top();
        let end = offset + len;
        let Some(meta) = top.qcow2() else {
            if fast && !top.file.zeroes_are_cheap() {
                return Err(EngineError::ZeroNotFast { offset, len });
            }
            return top
                .file
                .write_zeroes_at(offset, len, may_unmap && self.discard_passthrough)
                .await
                .map_err(|e| top.io_error("writing zeroes", offset, e));
        };
        if meta.data_raw {
            // The data file must stay a consistent raw image of the disk.
            if let Some(d) = &meta.data_file {
                d.write_zeroes_at(offset, len, may_unmap)
                    .await
                    .map_err(|e| top.io_error("zeroing the raw data file", offset, e))?;
            }
        }
        let g = &meta.geom;
        let size = top.size.get();
        let has_backing = self.chain.layers.len() > 1;
        let v3 = meta.header.borrow().version >= 3;
        let ext = g.extended_l2();
        let unit = if ext {
            g.subcluster_size()
        } else {
            g.cluster_size()
        };
        let lock_from = offset - offset % unit;
        let lock_to = end.div_ceil(unit).saturating_mul(unit).min(size);
        let _guard = self
            .lock_range(lock_from, lock_to - lock_from, LockMode::Exclusive)
            .await;

        // Without zero flags (version 2) only an image without backing file can zero by
        // dropping clusters; otherwise everything is written as data.
        let mut explicit: Vec<(u64, u64)> = Vec::new();
        let (ms, me) = if !v3 && has_backing {
            explicit.push((offset, end));
            (end, end)
        } else {
            let unit = if v3 { unit } else { g.cluster_size() };
            let unit_end = |u: u64| (u + unit).min(size);
            let first_u = offset - offset % unit;
            let last_u = (end - 1) - (end - 1) % unit;
            let (mut ms, mut me) = (first_u, unit_end(last_u));
            // Only the first and the last unit can be partial. A partial unit is zeroed whole
            // when the rest of it already reads as zeros, else its part is written as data.
            let (a, b) = (offset, end.min(unit_end(first_u)));
            if (a, b) != (first_u, unit_end(first_u))
                && !(self.reads_zero(first_u, a - first_u).await?
                    && self.reads_zero(b, unit_end(first_u) - b).await?)
            {
                explicit.push((a, b));
                ms = unit_end(first_u);
            }
            if last_u != first_u
                && end != unit_end(last_u)
                && !self.reads_zero(end, unit_end(last_u) - end).await?
            {
                explicit.push((last_u, end));
                me = last_u;
            }
            (ms, me.max(ms))
        };
        // Partial clusters of a compressed cluster cannot take zero bits.
        let entries = if ms < me {
            self.alloc()?.l2_entries(ms, me - ms).await?
        } else {
            Vec::new()
        };
        let cs = g.cluster_size();
        let mut meta_ranges = Vec::new();
        for e in &entries {
            let (a, b) = (ms.max(e.cluster), me.min(e.cluster + cs));
            let whole = a == e.cluster && (b == e.cluster + cs || b == size);
            if !whole && l2::is_compressed(e.word) {
                explicit.push((a, b));
            } else {
                meta_ranges.push((*e, a, b, whole));
            }
        }
        if fast && !explicit.is_empty() {
            return Err(EngineError::ZeroNotFast { offset, len });
        }
        for &(a, b) in &explicit {
            let mut pos = a;
            while pos < b {
                let n = (b - pos).min(ZERO_CHUNK);
                let (res, _) = self.write_unlocked(pos, IoBuf::zeroed(n as usize)).await;
                res?;
                pos += n;
            }
        }
        let w = self.alloc()?;
        for (e, a, b, whole) in meta_ranges {
            // The edges written as data above may have changed this very entry: use it as it
            // is now (the exclusive lock keeps it stable from here on).
            let e = w.l2_entries(e.cluster, 1).await?[0];
            let has_host = l2::host_of(e.word) != 0;
            let compressed = l2::is_compressed(e.word);
            let unmap = whole && (compressed || (may_unmap && has_host));
            let (word, bitmap) = if !v3 {
                (0, 0)
            } else if ext {
                if whole {
                    (if unmap { 0 } else { e.word }, ALL_ZERO_BITMAP)
                } else {
                    let first = g.subcluster_index(GuestOffset(a));
                    let last = g.subcluster_index(GuestOffset(b - 1));
                    let m = subcluster_mask(first, last);
                    let (alloc, zero) = unpack_bitmap(e.bitmap);
                    (e.word, pack_bitmap(alloc & !m, zero | m))
                }
            } else {
                (l2::zeroed_word(if unmap { 0 } else { e.word }), 0)
            };
            // What nobody allocated and no backing file shows already reads as zeros: leave
            // it (QEMU would write a zero flag, creating L2 tables for nothing).
            let reads_zero_already =
                !has_backing && !has_host && !compressed && unpack_bitmap(e.bitmap).0 == 0;
            if (word, bitmap) == (e.word, e.bitmap) || reads_zero_already {
                continue;
            }
            {
                let _g = w.meta_lock.lock().await;
                w.l2_for_write(g.l1_index(GuestOffset(e.cluster))).await?;
            }
            if w.lazy_refcounts {
                w.mark_dirty().await?;
            }
            w.set_l2_entry(e.cluster, word, bitmap).await?;
            let released = if !v3 || unmap { e.word } else { 0 };
            if released != 0 {
                self.release(released, may_unmap && self.discard_passthrough)
                    .await?;
            }
        }
        Ok(())
    }

    /// True when `[offset, offset + len)` currently reads as zeros (metadata only, no data
    /// is inspected).
    pub(crate) async fn reads_zero(&self, offset: u64, len: u64) -> Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        let mut pieces = Vec::new();
        self.chain.resolve(offset, len, 0, &mut pieces).await?;
        Ok(pieces.iter().all(|p| p.src == Source::Zero))
    }
}
