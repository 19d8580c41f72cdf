//! The persistent bitmaps of an open image, as `qemu-img bitmap` and an export see them:
//! list them, change them (writable images; stored on close), read one's data.

use crate::engine::infra::bitmaps::{self, BitmapError, BitmapInfo, Bitmaps};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::layer::Layer;
use crate::format::BitmapData;
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    fn bitmap_error(&self, source: BitmapError) -> EngineError {
        EngineError::Bitmap {
            image: self.inner.name(),
            source,
        }
    }

    /// Applies `f` to the bitmaps of a writable image.
    fn change_bitmaps(
        &self,
        f: impl FnOnce(&mut Bitmaps) -> std::result::Result<(), BitmapError>,
    ) -> Result<()> {
        self.inner.check_writable()?;
        let a = self.inner.alloc()?;
        a.change_bitmaps(f).map_err(|e| self.bitmap_error(e))
    }

    /// The persistent bitmaps, in directory order: as held in memory when the image is
    /// writable, as stored otherwise.
    pub async fn bitmaps(&self) -> Result<Vec<BitmapInfo>> {
        if let Some(a) = self.inner.writer() {
            return Ok(a.with_bitmaps(|set| set.infos()));
        }
        let top = self.inner.top();
        let Some(meta) = top.qcow2() else {
            return Ok(Vec::new());
        };
        let entries = bitmaps::directory(top, meta).await?;
        Ok(entries.iter().map(BitmapInfo::stored).collect())
    }

    /// True when the opened image can hold persistent bitmaps (qcow2 version 3), whether or
    /// not it has any.
    pub fn supports_persistent_bitmaps(&self) -> bool {
        self.inner
            .top()
            .qcow2()
            .is_some_and(|m| m.header.borrow().version >= 3)
    }

    /// Adds an empty persistent bitmap (QEMU's default granularity when `None`).
    pub fn add_bitmap(&self, name: &str, granularity: Option<u64>, enabled: bool) -> Result<()> {
        let version = self
            .inner
            .top()
            .qcow2()
            .map_or(0, |m| m.header.borrow().version);
        self.change_bitmaps(|s| s.add(version, name, granularity, enabled))
    }

    /// Removes a persistent bitmap.
    pub fn remove_bitmap(&self, name: &str) -> Result<()> {
        self.change_bitmaps(|s| s.remove(name))
    }

    /// Clears every bit of a bitmap.
    pub fn clear_bitmap(&self, name: &str) -> Result<()> {
        self.change_bitmaps(|s| s.clear(name))
    }

    /// Makes a bitmap track writes (or stop).
    pub fn set_bitmap_enabled(&self, name: &str, enabled: bool) -> Result<()> {
        self.change_bitmaps(|s| s.set_enabled(name, enabled))
    }

    /// Sets in bitmap `name` every chunk dirty in `source` (of a disk of `source_disk`
    /// bytes).
    pub fn merge_bitmap(&self, name: &str, source: &BitmapData, source_disk: u64) -> Result<()> {
        self.change_bitmaps(|s| s.merge(name, source, source_disk))
    }

    /// The data of bitmap `name`: a copy of what a writable image holds, or what is stored.
    /// A bitmap left in use by a crash has no trustworthy data and is refused.
    pub async fn bitmap_data(&self, name: &str) -> Result<BitmapData> {
        if let Some(a) = self.inner.writer() {
            return a
                .with_bitmaps(|set| set.data(name).cloned())
                .map_err(|e| self.bitmap_error(e));
        }
        match self.stored_bitmap(self.inner.top(), name).await? {
            Some((_, data)) => Ok(data),
            None => Err(self.bitmap_error(BitmapError::NotFound(name.to_string()))),
        }
    }

    /// Bitmap `name` of the first backing layer that has one (below the top, which the
    /// caller looked at already), as qemu-nbd's `-B` finds a bitmap down the backing chain:
    /// its description and data, as stored (nothing writes a backing layer), sized to the
    /// image as a bitmap follows its disk. `None` when no layer has it.
    pub async fn backing_bitmap(&self, name: &str) -> Result<Option<(BitmapInfo, BitmapData)>> {
        for index in 1..self.inner.depth() {
            if let Some((info, mut data)) =
                self.stored_bitmap(self.inner.layer(index), name).await?
            {
                data.resize(self.inner.top().size.get());
                return Ok(Some((info, data)));
            }
        }
        Ok(None)
    }

    /// Bitmap `name` as stored in `layer`, if it has one; a bitmap left in use by a crash
    /// has no trustworthy data and is refused.
    async fn stored_bitmap(
        &self,
        layer: &Layer<S>,
        name: &str,
    ) -> Result<Option<(BitmapInfo, BitmapData)>> {
        let Some(meta) = layer.qcow2() else {
            return Ok(None);
        };
        let entries = bitmaps::directory(layer, meta).await?;
        let Some(entry) = entries.iter().find(|e| e.name == name.as_bytes()) else {
            return Ok(None);
        };
        if entry.in_use() {
            return Err(self.bitmap_error(BitmapError::Inconsistent(name.to_string())));
        }
        let data = bitmaps::load_data(layer, meta, entry, layer.size.get()).await?;
        Ok(Some((BitmapInfo::stored(entry), data)))
    }

    /// The dirty and clean runs `(length, dirty)` of bitmap `name` of a writable image over
    /// `[offset, offset + len)`, as tracked up to now (no copy of the bitmap is made).
    pub fn live_bitmap_runs(&self, name: &str, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
        let a = self.inner.alloc()?;
        a.with_bitmaps(|set| set.data(name).map(|data| data.runs(offset, len)))
            .map_err(|e| self.bitmap_error(e))
    }
}
