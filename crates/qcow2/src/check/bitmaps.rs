//! Persistent dirty bitmaps: what QEMU validates before it will open (and so check) an image
//! with bitmaps, and counting their clusters (QEMU's `qcow2_check_bitmaps_refcounts`): the
//! directory, every bitmap table and every data cluster the tables point to.

use super::error::CheckError;
use super::io;
use crate::format::be::words;
use crate::format::bitmap::{self, BitmapDirectoryEntry};
use crate::format::error::{Location, Structure};
use crate::format::{Geometry, Header};
use crate::metadata::{Loader, MetaSource, MetadataError};
use storage::Storage;

/// Bitmap tables are read this many entries at a time, so a large table costs little memory.
const TABLE_CHUNK: u64 = 8192;

/// Whether a bitmap table entry is valid (QEMU's `check_table_entry`).
pub(super) fn entry_ok(entry: u64, cluster_size: u64) -> bool {
    let offset = bitmap::table_data_of(entry);
    bitmap::table_reserved_bits(entry) == 0
        && (offset == 0 || (!bitmap::table_all_ones(entry) && offset % cluster_size == 0))
}

/// Calls `f` with every entry of a bitmap's table, reading it a chunk at a time.
pub(super) async fn for_each_entry<S: Storage>(
    file: &S,
    e: &BitmapDirectoryEntry,
    mut f: impl FnMut(u64) -> Result<(), CheckError>,
) -> Result<(), CheckError> {
    let size = u64::from(e.table_size);
    let mut done = 0u64;
    while done < size {
        let n = TABLE_CHUNK.min(size - done);
        // At most 64 KiB.
        let raw = io::read(
            file,
            "reading a bitmap table",
            e.table_offset + done * 8,
            (n * 8) as usize,
        )
        .await?;
        for entry in words(&raw) {
            f(entry)?;
        }
        done += n;
    }
    Ok(())
}

/// Loads the bitmap directory and validates what QEMU validates when it opens the image
/// (`bitmap_list_load`, and `bitmap_table_load` for every bitmap not marked in use). QEMU
/// refuses to open an image failing these, so a check cannot look at it either.
pub(crate) async fn load_directory<R: MetaSource, S: Storage>(
    loader: &Loader<'_, R>,
    file: &S,
    header: &Header,
    geom: &Geometry,
) -> Result<Vec<BitmapDirectoryEntry>, CheckError> {
    let directory_offset = header.bitmaps().map_or(0, |ext| ext.directory_offset);
    let broken = |detail: String| CheckError::Bitmaps {
        offset: directory_offset,
        detail,
    };
    let entries = loader
        .bitmap_directory(header, geom)
        .await
        .map_err(|e| match e {
            MetadataError::Format(e) => broken(e.to_string()),
            other => CheckError::from_metadata(other),
        })?;
    let cs = geom.cluster_size();
    for (index, e) in entries.iter().enumerate() {
        let at = Location::entry(Structure::BitmapDirectory, directory_offset, index as u64);
        if !e.extra_data.is_empty() {
            return Err(broken("Bitmap extra data is not supported".into()));
        }
        if e.check_table_size(header.size, cs, at).is_err() {
            return Err(broken(format!(
                "Bitmap '{}' doesn't satisfy the constraints",
                e.name_lossy()
            )));
        }
    }
    for e in entries.iter().filter(|e| !e.in_use()) {
        for_each_entry(file, e, |entry| {
            if entry_ok(entry, cs) {
                Ok(())
            } else {
                Err(broken(format!(
                    "Could not read bitmap_table table from image for bitmap '{}': Invalid argument",
                    e.name_lossy()
                )))
            }
        })
        .await?;
    }
    Ok(entries)
}
