//! Reading persistent bitmaps from a layer: the directory's bitmaps with their data for a
//! writable open, or one bitmap's data for an export.

use super::{Bitmap, Bitmaps, State};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::layer::{Layer, Qcow2Meta};
use crate::format::bitmap::BitmapDirectoryEntry;
use crate::format::bitmap_data::{self, BitmapData};
use crate::format::{BitmapTableEntry, HostOffset, Structure};
use crate::metadata::{Loader, StorageSource, Strictness, BITMAP_TABLE};
use storage::Storage;

/// Bytes of bitmap data a writable open holds in memory at most, over all bitmaps: QEMU's
/// per-bitmap limit is 512 MiB, and an image may hold thousands.
pub(crate) const MAX_LOADED_BITMAP_BYTES: u64 = 1 << 30;

/// Loads every bitmap of the directory: the data of those stored cleanly, and the others as
/// inconsistent, as QEMU loads them.
pub(crate) async fn load<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    entries: Vec<BitmapDirectoryEntry>,
) -> Result<Bitmaps> {
    let mut set = Bitmaps {
        disk_size: layer.size.get(),
        cluster_size: meta.geom.cluster_size(),
        ..Bitmaps::default()
    };
    let mut held = 0u64;
    for entry in entries {
        let state = if entry.in_use() {
            State::Inconsistent
        } else {
            let bits = entry.granularity_bits;
            held = held.saturating_add(bitmap_data::data_bytes(set.disk_size, bits));
            if held > MAX_LOADED_BITMAP_BYTES {
                return Err(unusable(
                    layer,
                    &entry,
                    "the bitmaps would need more than 1 GiB of memory",
                ));
            }
            State::Loaded {
                data: load_data(layer, meta, &entry, set.disk_size).await?,
                enabled: entry.auto(),
                changed: false,
            }
        };
        set.list.push(Bitmap { entry, state });
    }
    Ok(set)
}

fn unusable<S>(layer: &Layer<S>, entry: &BitmapDirectoryEntry, why: &str) -> EngineError {
    layer.corrupt(format!(
        "Could not read bitmap '{}' from image: {why}",
        entry.name_lossy()
    ))
}

/// The entries of a bitmap's table, decoded.
pub(crate) async fn read_table<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    entry: &BitmapDirectoryEntry,
) -> Result<Vec<BitmapTableEntry>> {
    let src = StorageSource::new(&layer.file, meta.file_end.get());
    let (offset, len) = (entry.table_offset, u64::from(entry.table_size) * 8);
    let words = Loader::new(&src, Strictness::Open)
        .table(Structure::BitmapTable, BITMAP_TABLE, offset, len)
        .await
        .map_err(|e| EngineError::from_metadata(&layer.name, e))?;
    words
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            BitmapTableEntry::decode(w, &meta.geom, i as u64, HostOffset(offset)).map_err(
                |source| EngineError::Format {
                    image: layer.name.clone(),
                    source,
                },
            )
        })
        .collect()
}

/// Reads a cleanly stored bitmap's data.
pub(crate) async fn load_data<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    entry: &BitmapDirectoryEntry,
    disk_size: u64,
) -> Result<BitmapData> {
    let cs = meta.geom.cluster_size();
    let bits = entry.granularity_bits;
    bitmap_data::check_size(disk_size, bits, cs)
        .map_err(|e| unusable(layer, entry, &e.to_string()))?;
    let expected = bitmap_data::table_entries(disk_size, bits, cs);
    if u64::from(entry.table_size) != expected {
        return Err(unusable(
            layer,
            entry,
            &format!(
                "its table has {} entries where the disk size needs {expected}",
                entry.table_size
            ),
        ));
    }
    let mut data = BitmapData::new(disk_size, bits);
    for (i, e) in read_table(layer, meta, entry)
        .await?
        .into_iter()
        .enumerate()
    {
        let start = i as u64 * cs;
        match e {
            BitmapTableEntry::Zeros => {}
            BitmapTableEntry::Ones => data.fill(start, cs),
            BitmapTableEntry::Cluster(at) => {
                if at
                    .0
                    .checked_add(cs)
                    .is_none_or(|end| end > meta.file_end.get())
                {
                    return Err(unusable(
                        layer,
                        entry,
                        "a data cluster lies past the end of the file",
                    ));
                }
                let bytes = layer
                    .read_file("reading bitmap data", at.0, cs as usize)
                    .await?;
                data.deserialize(start, &bytes);
            }
        }
    }
    Ok(data)
}

/// The directory of layer 0 of a read-only open, as stored.
pub(crate) async fn directory<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
) -> Result<Vec<BitmapDirectoryEntry>> {
    let h = meta.header.borrow().clone();
    let src = StorageSource::new(&layer.file, meta.file_end.get());
    Loader::new(&src, Strictness::Open)
        .bitmap_directory(&h, &meta.geom)
        .await
        .map_err(|e| EngineError::from_metadata(&layer.name, e))
}
