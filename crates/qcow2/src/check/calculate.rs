//! Building the in-memory refcount table from every reference in the image (QEMU's
//! `calculate_refcounts`): header, active and snapshot L1/L2 tables, snapshot table, refcount
//! table and blocks, encryption header and bitmaps.

use super::error::CheckError;
use super::imrt::Imrt;
use super::pass::Pass;
use super::report::FindingKind;
use super::tables::Which;
use crate::format::limits;
use crate::format::refcount;
use storage::Storage;

impl<S: Storage> Pass<'_, S> {
    /// Counts every reference into `imrt`; sets `rebuild` when the refcount structure itself
    /// is broken.
    pub async fn calculate(
        &mut self,
        imrt: &mut Imrt,
        rebuild: &mut bool,
    ) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size;
        self.inc(imrt, 0, cs)?;
        let (l1_offset, l1_size) = (self.meta.l1_offset, self.meta.l1.len() as u32);
        self.count_l1(imrt, l1_offset, l1_size, Which::Active)
            .await?;

        if self.meta.data_file && !self.meta.snapshots.is_empty() {
            self.log(
                FindingKind::Error,
                format!(
                    "ERROR {} snapshots in image with data file",
                    self.meta.snapshots.len()
                ),
            );
            self.res.corruptions += 1;
        }
        for i in 0..self.meta.snapshots.len() {
            let sn = self.meta.snapshots[i].clone();
            if self.meta.in_cluster(sn.l1_offset) != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR snapshot {} ({}) l1_offset={:#x}: L1 table is not cluster aligned; snapshot table entry corrupted", sn.id_lossy(), sn.name_lossy(), sn.l1_offset),
                );
                self.res.corruptions += 1;
                continue;
            }
            if u64::from(sn.l1_size) > limits::MAX_L1_SIZE_BYTES / 8 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR snapshot {} ({}) l1_size={:#x}: L1 table is too large; snapshot table entry corrupted", sn.id_lossy(), sn.name_lossy(), sn.l1_size),
                );
                self.res.corruptions += 1;
                continue;
            }
            self.count_l1(imrt, sn.l1_offset, sn.l1_size, Which::Snapshot)
                .await?;
        }
        let (so, ss) = (self.meta.snapshots_offset, self.meta.snapshots_size);
        self.inc(imrt, so, ss)?;

        let (ro, rlen) = (
            self.meta.reftable_offset,
            self.meta.reftable.len() as u64 * 8,
        );
        self.inc(imrt, ro, rlen)?;

        if let Some((offset, len)) = self.meta.crypto {
            self.inc(imrt, offset, len)?;
        }
        self.count_bitmaps(imrt).await?;
        self.check_refblocks(imrt, rebuild).await
    }

    /// Checks every refcount table entry and counts the refcount blocks (QEMU's
    /// `check_refblocks`); a block outside the file is repaired by growing the file.
    async fn check_refblocks(
        &mut self,
        imrt: &mut Imrt,
        rebuild: &mut bool,
    ) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size;
        let bits = self.meta.cluster_bits;
        for i in 0..self.meta.reftable.len() {
            let raw = self.meta.reftable[i];
            let offset = refcount::block_of(raw);
            let cluster = offset >> bits;
            if refcount::reserved_bits(raw) != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR refcount table entry {i} has reserved bits set"),
                );
                self.res.corruptions += 1;
                *rebuild = true;
                continue;
            }
            if self.meta.in_cluster(offset) != 0 {
                self.log(
                    FindingKind::Error,
                    format!("ERROR refcount block {i} is not cluster aligned; refcount table entry corrupted"),
                );
                self.res.corruptions += 1;
                *rebuild = true;
                continue;
            }
            if cluster >= imrt.len() {
                self.res.corruptions += 1;
                let fixing = self.fix.errors;
                self.log(
                    if fixing {
                        FindingKind::Repair
                    } else {
                        FindingKind::Error
                    },
                    format!("{} refcount block {i} is outside image", Self::verb(fixing)),
                );
                if fixing {
                    match self.grow_file_to(offset).await {
                        Ok(()) => {
                            let clusters = self.meta.clusters(self.file_len);
                            imrt.grow(clusters)?;
                            if cluster < imrt.len() {
                                self.res.corruptions -= 1;
                                self.res.corruptions_fixed += 1;
                                // The new cluster is zeroed and referenced once: nothing
                                // else to check for it.
                                self.inc(imrt, offset, cs)?;
                                continue;
                            }
                            *rebuild = true;
                            self.log(
                                FindingKind::Error,
                                "ERROR could not resize image: Invalid argument".into(),
                            );
                        }
                        Err(e) => {
                            *rebuild = true;
                            self.log(
                                FindingKind::Error,
                                format!("ERROR could not resize image: {e}"),
                            );
                        }
                    }
                }
                continue;
            }
            if offset != 0 {
                self.inc(imrt, offset, cs)?;
                let r = imrt.get(cluster);
                if r != 1 {
                    self.log(
                        FindingKind::Error,
                        format!("ERROR refcount block {i} refcount={r}"),
                    );
                    self.res.corruptions += 1;
                    *rebuild = true;
                }
            }
        }
        Ok(())
    }

    /// Grows the file so that the cluster at `offset` is inside it. A file of more clusters
    /// than a check can count is refused, as the check of such a file would be.
    async fn grow_file_to(&mut self, offset: u64) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size;
        let invalid = |what| {
            CheckError::io(
                "growing the image",
                offset,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
            )
        };
        let end = offset
            .checked_add(cs)
            .filter(|&e| e <= limits::MAX_FILE_OFFSET)
            .ok_or_else(|| invalid("Invalid argument"))?;
        if self.meta.clusters(end) > i32::MAX as u64 {
            return Err(invalid("File too large"));
        }
        if end > self.file_len {
            self.file
                .set_len(end)
                .await
                .map_err(|e| CheckError::io("growing the image", end, e))?;
        }
        self.file_len = self
            .file
            .len()
            .await
            .map_err(|e| CheckError::io("getting the file size", 0, e))?;
        Ok(())
    }
}
