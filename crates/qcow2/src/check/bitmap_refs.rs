//! Counting the clusters of persistent dirty bitmaps (QEMU's `qcow2_check_bitmaps_refcounts`):
//! the directory, every bitmap table and every data cluster the tables point to.

use super::bitmaps::{entry_ok, for_each_entry};
use super::error::CheckError;
use super::imrt::Imrt;
use super::pass::Pass;
use crate::format::bitmap::{self, BitmapDirectoryEntry};
use storage::Storage;

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
        let cs = self.meta.cluster_size;
        let entries = std::mem::take(&mut self.meta.bitmap_dir);
        let mut counted = Ok(());
        for e in &entries {
            counted = self.count_bitmap(imrt, e, cs).await;
            if counted.is_err() {
                break;
            }
        }
        self.meta.bitmap_dir = entries;
        counted
    }

    async fn count_bitmap(
        &mut self,
        imrt: &mut Imrt,
        e: &BitmapDirectoryEntry,
        cs: u64,
    ) -> Result<(), CheckError> {
        self.inc(imrt, e.table_offset, u64::from(e.table_size) * 8)?;
        let mut clusters = Vec::new();
        let mut bad = 0u64;
        let file = self.file;
        let read = for_each_entry(file, e, |entry| {
            if !entry_ok(entry, cs) {
                bad += 1;
            } else if bitmap::table_data_of(entry) != 0 {
                clusters.push(bitmap::table_data_of(entry));
            }
            Ok(())
        })
        .await;
        if let Err(err) = read {
            self.res.corruptions += 1;
            return Err(err);
        }
        self.res.corruptions += bad;
        for offset in clusters {
            self.inc(imrt, offset, cs)?;
        }
        Ok(())
    }
}
