//! Counting the clusters of persistent dirty bitmaps (QEMU's `qcow2_check_bitmaps_refcounts`):
//! the directory, every bitmap table and every data cluster the tables point to.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::meta::words;
use super::pass::Pass;
use crate::format::bitmap::{self, BITMAP_TABLE_OFFSET_MASK, BITMAP_TABLE_RESERVED_MASK};
use crate::format::Geometry;
use storage::Storage;

/// Bit 0 of a bitmap table entry without a cluster: the bitmap data reads as all ones.
const ALL_ONES: u64 = 1;
/// Bitmap tables are read this many entries at a time, so a large table costs little memory.
const TABLE_CHUNK: u64 = 8192;

impl<S: Storage> Pass<'_, S> {
    /// Counts the bitmap directory, tables and data clusters.
    pub async fn count_bitmaps(&mut self, imrt: &mut Imrt) -> Result<(), CheckError> {
        let Some(ext) = self.meta.bitmaps else {
            return Ok(());
        };
        if ext.nb_bitmaps == 0 {
            return Ok(());
        }
        self.inc(imrt, ext.directory_offset, ext.directory_size)?;
        let broken = |detail: String| CheckError::Bitmaps {
            offset: ext.directory_offset,
            detail,
        };
        // The extension was validated on load: the directory is at most 64 MiB.
        let dir = io::read(
            self.file,
            "reading the bitmap directory",
            ext.directory_offset,
            ext.directory_size as usize,
        )
        .await?;
        let geom = Geometry::new(
            self.meta.cluster_bits,
            self.meta.extended,
            self.meta.refcount_order,
            self.meta.virtual_size,
        )
        .map_err(|e| broken(e.to_string()))?;
        let entries = match bitmap::decode_directory(&dir, &ext, &geom) {
            Ok(e) => e,
            Err(e) => {
                self.res.corruptions += 1;
                return Err(broken(e.to_string()));
            }
        };
        let cs = self.meta.cluster_size;
        for e in &entries {
            if !e.extra_data.is_empty() {
                self.res.corruptions += 1;
                return Err(broken("Bitmap extra data is not supported".into()));
            }
            if u64::from(e.table_size).saturating_mul(cs) > self.file_len {
                self.res.corruptions += 1;
                return Err(broken(format!(
                    "Bitmap '{}' doesn't satisfy the constraints",
                    e.name_lossy()
                )));
            }
        }
        for e in &entries {
            let table_bytes = u64::from(e.table_size) * 8;
            self.inc(imrt, e.table_offset, table_bytes)?;
            let mut done = 0u64;
            while done < u64::from(e.table_size) {
                let n = TABLE_CHUNK.min(u64::from(e.table_size) - done);
                let raw = match io::read(
                    self.file,
                    "reading a bitmap table",
                    e.table_offset + done * 8,
                    // At most 64 KiB.
                    (n * 8) as usize,
                )
                .await
                {
                    Ok(raw) => raw,
                    Err(err) => {
                        self.res.corruptions += 1;
                        return Err(err);
                    }
                };
                for entry in words(&raw) {
                    let offset = entry & BITMAP_TABLE_OFFSET_MASK;
                    let bad = entry & BITMAP_TABLE_RESERVED_MASK != 0
                        || (offset != 0 && (entry & ALL_ONES != 0 || offset % cs != 0));
                    if bad {
                        self.res.corruptions += 1;
                        continue;
                    }
                    if offset != 0 {
                        self.inc(imrt, offset, cs)?;
                    }
                }
                done += n;
            }
        }
        Ok(())
    }
}
