//! Write zeroes (NBD WRITE_ZEROES): zero flags (version 3) or zero subcluster bits (extended
//! L2) for every whole (sub)cluster, optionally freeing the clusters (may-unmap); unaligned
//! edges become zero flags too when the rest of their (sub)cluster already reads as zeros,
//! and are otherwise written as zero data. A fast-zero request fails with `ZeroNotFast`
//! before changing anything if any part would need data written.

use crate::engine::alloc::{L2Change, Precedes};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::range_lock::LockMode;
use crate::format::l2;
use crate::format::l2_extended::{pack_bitmap, subcluster_mask, unpack_bitmap, ALL_ZERO_BITMAP};
use crate::format::{Geometry, GuestOffset};
use storage::{IoBuf, Storage};

/// Largest zero buffer written at once when zeros must be written as data.
const ZERO_CHUNK: u64 = 1 << 20;

impl<S: Storage + 'static> Image<S> {
    /// Makes `[offset, offset + len)` read as zeros. With `may_unmap` the clusters may be
    /// freed; with `fast`, fail with [`EngineError::ZeroNotFast`] rather than write data.
    pub async fn write_zeroes(
        &self,
        offset: GuestOffset,
        len: u64,
        may_unmap: bool,
        fast: bool,
    ) -> Result<()> {
        self.inner.check_writable()?;
        self.inner.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.inner.track(offset, len);
        self.zero_untracked(offset.0, len, may_unmap, fast).await
    }

    /// Like [`Image::write_zeroes`] (never fast), but where nothing is allocated and no
    /// backing file shows through, zero flags are written all the same, as QEMU writes them:
    /// for a caller that is about to give the image a backing file whose data must not show
    /// through there (`rebase`), or that wants the image QEMU would leave (`convert`).
    pub async fn write_zero_flags(
        &self,
        offset: GuestOffset,
        len: u64,
        may_unmap: bool,
    ) -> Result<()> {
        let inner = &self.inner;
        inner.check_writable()?;
        inner.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        inner.track(offset, len);
        self.zero_range(offset.0, len, may_unmap, false, true).await
    }

    /// [`Image::write_zeroes`] of a checked, non-empty range, without marking the persistent
    /// bitmaps: for the space a resize adds, which QEMU zeroes without counting it as a write.
    pub(crate) async fn zero_untracked(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast: bool,
    ) -> Result<()> {
        self.zero_range(offset, len, may_unmap, fast, false).await
    }

    /// Zeroes a checked, non-empty range; `flag_unallocated` writes zero flags even where
    /// the range already reads as zeros because nothing is allocated and nothing is below.
    async fn zero_range(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast: bool,
        flag_unallocated: bool,
    ) -> Result<()> {
        let top = self.inner.top();
        if top.luks().is_some() {
            // Zeros of a LUKS volume are enciphered data like any other (QEMU's `luks`
            // driver has no way to zero either, and writes them).
            if fast {
                return Err(EngineError::ZeroNotFast { offset, len });
            }
            return self.inner.write_luks_zeroes(offset, len).await;
        }
        let Some(meta) = top.qcow2() else {
            if fast && !top.file.zeroes_are_cheap() {
                return Err(EngineError::ZeroNotFast { offset, len });
            }
            return top
                .file
                .write_zeroes_at(offset, len, may_unmap && self.inner.punches_holes())
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
        let z = Zeroing {
            geom: meta.geom,
            size: top.size.get(),
            // Zeroing as if a backing file showed through is what writes the flags (and,
            // without zero flags, zero data) where nothing is allocated.
            has_backing: self.inner.has_backing() || flag_unallocated,
            v3: meta.header.borrow().version >= 3,
            may_unmap,
        };
        let unit = z.unit();
        let end = offset + len;
        let lock_from = offset - offset % unit;
        let lock_to = end.div_ceil(unit).saturating_mul(unit).min(z.size);
        let _guard = self
            .inner
            .lock_range(
                GuestOffset(lock_from),
                lock_to - lock_from,
                LockMode::Exclusive,
            )
            .await;
        let (mut explicit, ms, me) = self.split_zero_range(&z, offset, end).await?;
        // Partial clusters of a compressed cluster cannot take zero bits.
        let (ms, me) = (GuestOffset(ms), GuestOffset(me));
        let entries = if ms < me {
            self.inner.alloc()?.l2_entries(ms, me - ms).await?
        } else {
            Vec::new()
        };
        let cs = z.geom.cluster_size();
        let mut meta_ranges = Vec::new();
        for e in &entries {
            let (a, b) = (ms.max(e.cluster), me.min(e.cluster + cs));
            let whole = a == e.cluster && (b == e.cluster + cs || b.0 == z.size);
            if !whole && l2::is_compressed(e.word) {
                explicit.push((a.0, b.0));
            } else {
                meta_ranges.push((e.cluster, a, b, whole));
            }
        }
        if fast && !explicit.is_empty() {
            return Err(EngineError::ZeroNotFast { offset, len });
        }
        for &(a, b) in &explicit {
            self.write_zero_data(a, b).await?;
        }
        for (cluster, a, b, whole) in meta_ranges {
            self.zero_in_metadata(&z, cluster, a, b, whole).await?;
        }
        Ok(())
    }

    /// Splits `[offset, end)` into what is written as zero data (returned as ranges) and the
    /// range `[ms, me)` zeroed in the L2 entries. Without zero flags (version 2) only an image
    /// without a backing file can zero by dropping clusters; otherwise everything is data.
    /// Only the first and the last unit can be partial: a partial unit is zeroed whole when
    /// the rest of it already reads as zeros, else its part is written as data.
    async fn split_zero_range(
        &self,
        z: &Zeroing,
        offset: u64,
        end: u64,
    ) -> Result<(Vec<(u64, u64)>, u64, u64)> {
        let mut explicit: Vec<(u64, u64)> = Vec::new();
        if !z.v3 && z.has_backing {
            explicit.push((offset, end));
            return Ok((explicit, end, end));
        }
        let unit = if z.v3 {
            z.unit()
        } else {
            z.geom.cluster_size()
        };
        let unit_end = |u: u64| (u + unit).min(z.size);
        let first_u = offset - offset % unit;
        let last_u = (end - 1) - (end - 1) % unit;
        let (mut ms, mut me) = (first_u, unit_end(last_u));
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
        Ok((explicit, ms, me.max(ms)))
    }

    /// Writes zero bytes over `[a, b)` as guest data, a bounded chunk at a time.
    async fn write_zero_data(&self, a: u64, b: u64) -> Result<()> {
        let mut pos = a;
        while pos < b {
            let n = (b - pos).min(ZERO_CHUNK);
            let (res, _) = self
                .inner
                .write_unlocked(GuestOffset(pos), IoBuf::zeroed(n as usize))
                .await;
            res?;
            pos += n;
        }
        Ok(())
    }

    /// Zeroes `[a, b)` of the guest cluster at `cluster` in its L2 entry (`whole`: the whole
    /// cluster), releasing the host cluster when the entry stops using it.
    async fn zero_in_metadata(
        &self,
        z: &Zeroing,
        cluster: GuestOffset,
        a: GuestOffset,
        b: GuestOffset,
        whole: bool,
    ) -> Result<()> {
        let w = self.inner.alloc()?;
        // Data written for the edges may have changed this very entry: use it as it is now
        // (the exclusive lock keeps it stable from here on).
        let e = w.l2_entries(cluster, 1).await?[0];
        let has_host = l2::host_of(e.word) != 0;
        let compressed = l2::is_compressed(e.word);
        let unmap = whole && (compressed || (z.may_unmap && has_host));
        let (word, bitmap) = z.zeroed_entry(e.word, e.bitmap, a.0, b.0, whole, unmap);
        // What nobody allocated and no backing file shows already reads as zeros: leave
        // it (QEMU would write a zero flag, creating L2 tables for nothing).
        let reads_zero_already =
            !z.has_backing && !has_host && !compressed && unpack_bitmap(e.bitmap).0 == 0;
        if (word, bitmap) == (e.word, e.bitmap) || reads_zero_already {
            return Ok(());
        }
        {
            let _g = w.exclusive().await;
            w.l2_for_write(z.geom.l1_index(e.cluster)).await?;
        }
        let released = if !z.v3 || unmap { e.word } else { 0 };
        let punch = z.may_unmap && self.inner.punches_holes();
        let change = L2Change::set(e.cluster, word, bitmap).releasing(released, punch);
        w.change_l2(Precedes::Nothing, [change]).await
    }

    /// True when `[offset, offset + len)` currently reads as zeros (metadata only, no data
    /// is inspected).
    pub(crate) async fn reads_zero(&self, offset: u64, len: u64) -> Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        let mut pieces = Vec::new();
        self.inner
            .resolve(GuestOffset(offset), len, &mut pieces)
            .await?;
        Ok(pieces.iter().all(|p| p.src.is_zero()))
    }
}

/// What zeroing needs to know about the image.
struct Zeroing {
    geom: Geometry,
    size: u64,
    has_backing: bool,
    /// Version 3: zero flags exist.
    v3: bool,
    may_unmap: bool,
}

impl Zeroing {
    /// The smallest range one L2 entry can zero: a subcluster with extended entries.
    fn unit(&self) -> u64 {
        if self.geom.extended_l2() {
            self.geom.subcluster_size()
        } else {
            self.geom.cluster_size()
        }
    }

    /// The entry words that make `[a, b)` of an entry read as zeros (`whole`: the whole
    /// cluster; `unmap`: drop the host cluster).
    fn zeroed_entry(
        &self,
        word: u64,
        bitmap: u64,
        a: u64,
        b: u64,
        whole: bool,
        unmap: bool,
    ) -> (u64, u64) {
        if !self.v3 {
            (0, 0)
        } else if self.geom.extended_l2() {
            if whole {
                (if unmap { 0 } else { word }, ALL_ZERO_BITMAP)
            } else {
                let first = self.geom.subcluster_index(GuestOffset(a));
                let last = self.geom.subcluster_index(GuestOffset(b - 1));
                let m = subcluster_mask(first, last);
                let (alloc, zero) = unpack_bitmap(bitmap);
                (word, pack_bitmap(alloc & !m, zero | m))
            }
        } else {
            (l2::zeroed_word(if unmap { 0 } else { word }), 0)
        }
    }
}
