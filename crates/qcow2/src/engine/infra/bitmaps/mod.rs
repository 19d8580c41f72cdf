//! The persistent dirty bitmaps of a writable image, in memory: which exist, in directory
//! order, what each holds, and the changes `qemu-img bitmap` makes to them. Pure: loading
//! them is `load.rs`; marking them in use and storing them is the allocator's
//! (`alloc/bitmaps.rs`).
//!
//! A bitmap found marked in use when the image was opened was not stored cleanly, so its
//! data cannot be trusted: it is kept as it is on disk (still in use), never reported clean
//! and never stored, until it is removed. This is how QEMU treats it.

mod load;

pub(crate) use load::{directory, load, load_data, read_table};

pub use super::error::BitmapError;
use crate::format::bitmap::{BitmapDirectoryEntry, FLAG_AUTO, FLAG_IN_USE, TYPE_DIRTY_TRACKING};
use crate::format::bitmap_data::{self, BitmapData};
use crate::format::limits;

/// What is known of one bitmap.
#[derive(Debug, Clone)]
pub(crate) enum State {
    /// Marked in use on disk when loaded: kept as it is.
    Inconsistent,
    /// Loaded (or new): its bits, whether it tracks writes, and whether it differs from what
    /// is stored at `entry`'s table.
    Loaded {
        data: BitmapData,
        enabled: bool,
        changed: bool,
    },
}

/// One persistent bitmap.
#[derive(Debug, Clone)]
pub(crate) struct Bitmap {
    /// Its directory entry as last stored (a new bitmap has no table yet: offset 0).
    pub entry: BitmapDirectoryEntry,
    pub state: State,
}

impl Bitmap {
    /// Its name for messages.
    pub fn name(&self) -> String {
        self.entry.name_lossy()
    }

    /// The data of a consistent bitmap.
    fn loaded(&mut self) -> Result<(&mut BitmapData, &mut bool, &mut bool), BitmapError> {
        let name = self.name();
        match &mut self.state {
            State::Loaded {
                data,
                enabled,
                changed,
            } => Ok((data, enabled, changed)),
            State::Inconsistent => Err(BitmapError::Inconsistent(name)),
        }
    }
}

/// A bitmap as `info` and the `bitmap` subcommand show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    /// Its name.
    pub name: String,
    /// Bytes of guest disk per bit.
    pub granularity: u64,
    /// It tracks writes (QEMU's `auto` flag).
    pub enabled: bool,
    /// It was in use when the image was opened and cannot be trusted (QEMU's `in-use`).
    pub inconsistent: bool,
}

impl BitmapInfo {
    /// A bitmap as its directory entry describes it.
    pub(crate) fn stored(entry: &BitmapDirectoryEntry) -> BitmapInfo {
        BitmapInfo {
            name: entry.name_lossy(),
            granularity: entry.granularity(),
            enabled: entry.auto(),
            inconsistent: entry.in_use(),
        }
    }
}

/// Every persistent bitmap of the writable layer.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bitmaps {
    pub list: Vec<Bitmap>,
    /// Directory entries of removed bitmaps whose clusters are freed when the set is stored.
    pub removed: Vec<BitmapDirectoryEntry>,
    /// Virtual disk size the bitmaps cover.
    pub disk_size: u64,
    /// The image's cluster size (bounds the bitmap table).
    pub cluster_size: u64,
}

/// QEMU's default granularity: the cluster size, within 4 KiB..64 KiB.
pub(crate) fn default_granularity(cluster_size: u64) -> u64 {
    cluster_size.clamp(4096, 65536)
}

impl Bitmaps {
    /// Marks `[offset, offset + len)` in every enabled bitmap. Writes mark before they are
    /// acknowledged, failed ones too: a bitmap may say too much, never too little.
    pub fn mark(&mut self, offset: u64, len: u64) {
        for b in &mut self.list {
            if let State::Loaded {
                data,
                enabled: true,
                changed,
            } = &mut b.state
            {
                data.mark(offset, len);
                *changed = true;
            }
        }
    }

    /// The bitmaps for display, in directory order.
    pub fn infos(&self) -> Vec<BitmapInfo> {
        self.list
            .iter()
            .map(|b| match b.state {
                State::Loaded { enabled, .. } => BitmapInfo {
                    enabled,
                    inconsistent: false,
                    ..BitmapInfo::stored(&b.entry)
                },
                State::Inconsistent => BitmapInfo {
                    inconsistent: true,
                    ..BitmapInfo::stored(&b.entry)
                },
            })
            .collect()
    }

    /// Where bitmap `name` is in the list.
    fn position(&self, name: &str) -> Result<usize, BitmapError> {
        self.list
            .iter()
            .position(|b| b.entry.name == name.as_bytes())
            .ok_or_else(|| BitmapError::NotFound(name.to_string()))
    }

    fn find(&mut self, name: &str) -> Result<&mut Bitmap, BitmapError> {
        let at = self.position(name)?;
        Ok(&mut self.list[at])
    }

    /// The data of bitmap `name`.
    pub fn data(&self, name: &str) -> Result<&BitmapData, BitmapError> {
        match &self.list[self.position(name)?].state {
            State::Loaded { data, .. } => Ok(data),
            State::Inconsistent => Err(BitmapError::Inconsistent(name.to_string())),
        }
    }

    /// Adds an empty bitmap (`granularity` defaults to QEMU's choice for the cluster size).
    pub fn add(
        &mut self,
        version: u32,
        name: &str,
        granularity: Option<u64>,
        enabled: bool,
    ) -> Result<(), BitmapError> {
        let granularity = granularity.unwrap_or(default_granularity(self.cluster_size));
        if !granularity.is_power_of_two() || !(512..=1 << 31).contains(&granularity) {
            return Err(BitmapError::Granularity);
        }
        if self.list.iter().any(|b| b.entry.name == name.as_bytes()) {
            return Err(BitmapError::Exists(name.to_string()));
        }
        if version < 3 {
            return Err(BitmapError::Version2);
        }
        if name.is_empty() || name.len() > usize::from(limits::MAX_BITMAP_NAME) {
            return Err(BitmapError::Name);
        }
        let bits = granularity.trailing_zeros() as u8;
        bitmap_data::check_size(self.disk_size, bits, self.cluster_size)
            .map_err(BitmapError::TooLarge)?;
        let entry = BitmapDirectoryEntry {
            table_offset: 0,
            table_size: 0,
            flags: 0,
            bitmap_type: TYPE_DIRTY_TRACKING,
            granularity_bits: bits,
            name: name.as_bytes().to_vec(),
            extra_data: Vec::new(),
        };
        let dir_len: usize = self
            .list
            .iter()
            .map(|b| b.entry.encoded_len())
            .sum::<usize>()
            + entry.encoded_len();
        if self.list.len() >= limits::MAX_BITMAPS as usize
            || dir_len as u64 > limits::MAX_BITMAP_DIRECTORY_SIZE
        {
            return Err(BitmapError::TooMany);
        }
        self.list.push(Bitmap {
            entry,
            state: State::Loaded {
                data: BitmapData::new(self.disk_size, bits),
                enabled,
                changed: true,
            },
        });
        Ok(())
    }

    /// Removes bitmap `name` (an inconsistent one too); its clusters are freed on store.
    pub fn remove(&mut self, name: &str) -> Result<(), BitmapError> {
        let gone = self.list.remove(self.position(name)?);
        if gone.entry.table_offset != 0 {
            self.removed.push(gone.entry);
        }
        Ok(())
    }

    /// Clears every bit of bitmap `name`.
    pub fn clear(&mut self, name: &str) -> Result<(), BitmapError> {
        let (data, _, changed) = self.find(name)?.loaded()?;
        data.clear();
        *changed = true;
        Ok(())
    }

    /// Makes bitmap `name` track writes, or stop tracking them.
    pub fn set_enabled(&mut self, name: &str, on: bool) -> Result<(), BitmapError> {
        let (_, enabled, changed) = self.find(name)?.loaded()?;
        if *enabled != on {
            *enabled = on;
            *changed = true;
        }
        Ok(())
    }

    /// Sets in bitmap `name` every chunk dirty in `source`, which covers a disk of
    /// `source_disk` bytes.
    pub fn merge(
        &mut self,
        name: &str,
        source: &BitmapData,
        source_disk: u64,
    ) -> Result<(), BitmapError> {
        let disk = self.disk_size;
        if source_disk != disk {
            return Err(BitmapError::SizeMismatch(source_disk, disk));
        }
        let (data, _, changed) = self.find(name)?.loaded()?;
        data.merge(source);
        *changed = true;
        Ok(())
    }

    /// Whether every bitmap can follow the disk to `disk_size` bytes. An inconsistent
    /// bitmap refuses, as in QEMU: it could not be stored for the new size.
    pub fn check_resize(&self, disk_size: u64) -> Result<(), BitmapError> {
        for b in &self.list {
            match &b.state {
                State::Inconsistent => return Err(BitmapError::Inconsistent(b.name())),
                State::Loaded { data, .. } => {
                    bitmap_data::check_size(disk_size, data.granularity_bits(), self.cluster_size)
                        .map_err(BitmapError::TooLarge)?;
                }
            }
        }
        Ok(())
    }

    /// Makes every bitmap follow the disk to `disk_size` bytes (see [`BitmapData::resize`]),
    /// once [`Bitmaps::check_resize`] has accepted the size.
    pub fn resize(&mut self, disk_size: u64) {
        for b in &mut self.list {
            if let State::Loaded { data, changed, .. } = &mut b.state {
                data.resize(disk_size);
                *changed = true;
            }
        }
        self.disk_size = disk_size;
    }

    /// Whether storing would change the file: a bitmap changed, was removed, or is still
    /// marked in use on disk although we hold it consistently.
    pub fn needs_store(&self) -> bool {
        !self.removed.is_empty()
            || self.list.iter().any(|b| match &b.state {
                State::Loaded { changed, .. } => *changed || b.entry.in_use(),
                State::Inconsistent => false,
            })
    }
}

/// The directory entry a consistent bitmap is stored with: its table, and the `auto` flag
/// if it is enabled; never in use.
pub(crate) fn stored_entry(
    b: &Bitmap,
    table_offset: u64,
    table_size: u32,
    enabled: bool,
) -> BitmapDirectoryEntry {
    BitmapDirectoryEntry {
        table_offset,
        table_size,
        flags: if enabled { FLAG_AUTO } else { 0 },
        ..b.entry.clone()
    }
}

/// The entry as it is marked while we hold the bitmap: in use.
pub(crate) fn in_use_entry(entry: &BitmapDirectoryEntry) -> BitmapDirectoryEntry {
    BitmapDirectoryEntry {
        flags: entry.flags | FLAG_IN_USE,
        ..entry.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> Bitmaps {
        Bitmaps {
            disk_size: 1 << 30,
            cluster_size: 65536,
            ..Bitmaps::default()
        }
    }

    #[test]
    fn only_enabled_bitmaps_track_writes() {
        let mut s = set();
        s.add(3, "on", None, true).unwrap();
        s.add(3, "off", Some(1 << 20), false).unwrap();
        s.mark(65536, 1);
        assert!(s.data("on").unwrap().get(1));
        assert!(s.data("off").unwrap().is_clear());
        s.set_enabled("off", true).unwrap();
        s.mark(0, 1);
        assert!(s.data("off").unwrap().get(0));
    }

    #[test]
    fn errors_say_what_qemu_says() {
        let mut s = set();
        s.add(3, "a", None, true).unwrap();
        assert_eq!(
            s.add(3, "a", None, true).unwrap_err().to_string(),
            "Bitmap already exists: a"
        );
        assert_eq!(
            s.remove("b").unwrap_err().to_string(),
            "Dirty bitmap 'b' not found"
        );
        assert_eq!(
            s.add(3, "b", Some(256), true),
            Err(BitmapError::Granularity)
        );
        assert_eq!(
            s.add(3, "b", Some(3 << 9), true),
            Err(BitmapError::Granularity)
        );
        assert_eq!(s.add(2, "b", None, true), Err(BitmapError::Version2));
        assert_eq!(
            s.add(3, &"n".repeat(1024), None, true),
            Err(BitmapError::Name)
        );
    }

    #[test]
    fn inconsistent_bitmaps_can_only_be_removed() {
        let mut s = set();
        s.add(3, "a", None, true).unwrap();
        s.list[0].state = State::Inconsistent;
        s.list[0].entry.table_offset = 0x30000;
        s.mark(0, 1 << 20);
        assert_eq!(s.clear("a"), Err(BitmapError::Inconsistent("a".into())));
        assert!(s.set_enabled("a", false).is_err());
        assert!(!s.needs_store());
        s.remove("a").unwrap();
        assert_eq!(s.removed.len(), 1);
        assert!(s.needs_store());
    }

    #[test]
    fn the_default_granularity_follows_the_cluster_size() {
        assert_eq!(default_granularity(512), 4096);
        assert_eq!(default_granularity(4096), 4096);
        assert_eq!(default_granularity(2 << 20), 65536);
    }
}
