//! The COPIED flag of the active L1 and L2 entries must say exactly "refcount is 1" (QEMU's
//! `check_oflag_copied`); runs after the refcounts were repaired, so repairs here rely on
//! them.

use super::error::CheckError;
use super::io;
use super::ondisk::Refblocks;
use super::pass::{Fix, Pass};
use super::report::FindingKind;
use super::tables::{cluster_type, ClusterType};
use crate::engine::overlap::MetaKind;
use crate::format::l1::{L1_COPIED, L1_OFFSET_MASK};
use crate::format::l2::{L2_COPIED, L2_OFFSET_MASK};
use storage::Storage;

/// QEMU writes one L1 entry as the 512-byte sector around it.
const L1_WRITE_SECTOR: u64 = 512;

impl<S: Storage> Pass<'_, S> {
    /// Checks (and with `fix`, repairs) the COPIED flags of the active tables.
    pub async fn check_copied(&mut self, fix: Fix) -> Result<(), CheckError> {
        let repair = fix.errors
            || (fix.leaks
                && self.res.check_errors == 0
                && self.res.corruptions == 0
                && self.res.leaks == 0);
        let mut rb = Refblocks::default();
        let bits = self.meta.cluster_bits;
        let verb = Self::verb(repair);
        let kind = if repair {
            FindingKind::Repair
        } else {
            FindingKind::Error
        };
        for i in 0..self.meta.l1.len() {
            let l1_entry = self.meta.l1[i];
            let l2_offset = l1_entry & L1_OFFSET_MASK;
            if l2_offset == 0 {
                continue;
            }
            // A refcount that cannot be read was reported already.
            let Ok(refcount) = self.stored_refcount(&mut rb, l2_offset >> bits).await else {
                continue;
            };
            if (refcount == 1) != (l1_entry & L1_COPIED != 0) {
                self.res.corruptions += 1;
                self.log(
                    kind,
                    format!("{verb} OFLAG_COPIED L2 cluster: l1_index={i} l1_entry={l1_entry:x} refcount={refcount}"),
                );
                if repair {
                    self.meta.l1[i] = if refcount == 1 {
                        l1_entry | L1_COPIED
                    } else {
                        l1_entry & !L1_COPIED
                    };
                    if let Err(e) = self.write_l1_entry(i).await {
                        self.res.check_errors += 1;
                        return Err(e);
                    }
                    self.res.corruptions -= 1;
                    self.res.corruptions_fixed += 1;
                }
            }
            let mut table = match io::read(
                self.file,
                "reading an L2 table",
                l2_offset,
                // One cluster.
                self.meta.l2_bytes() as usize,
            )
            .await
            {
                Ok(t) => t,
                Err(e) => {
                    self.log(
                        FindingKind::Error,
                        format!("ERROR: Could not read L2 table: {e}"),
                    );
                    self.res.check_errors += 1;
                    return Err(e);
                }
            };
            let esize = self.meta.l2_entry_size as usize;
            let mut dirty = 0u64;
            for j in 0..self.meta.l2_entries as usize {
                let at = j * esize;
                let Some(word) = table.get(at..at + 8) else {
                    break;
                };
                let entry = u64::from_be_bytes(word.try_into().unwrap_or([0; 8]));
                let kind_of = cluster_type(entry, self.meta.extended, self.meta.data_file);
                if !matches!(kind_of, ClusterType::Normal | ClusterType::ZeroAlloc) {
                    continue;
                }
                let refcount = if self.meta.data_file {
                    1
                } else {
                    match self
                        .stored_refcount(&mut rb, (entry & L2_OFFSET_MASK) >> bits)
                        .await
                    {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                };
                if (refcount == 1) != (entry & L2_COPIED != 0) {
                    self.res.corruptions += 1;
                    self.log(
                        kind,
                        format!("{verb} OFLAG_COPIED data cluster: l2_entry={entry:x} refcount={refcount}"),
                    );
                    if repair {
                        let fixed = if refcount == 1 {
                            entry | L2_COPIED
                        } else {
                            entry & !L2_COPIED
                        };
                        table[at..at + 8].copy_from_slice(&fixed.to_be_bytes());
                        dirty += 1;
                    }
                }
            }
            if dirty > 0 {
                let cs = self.meta.cluster_size as usize;
                let bytes = table.get(..cs).unwrap_or(&table).to_vec();
                match self
                    .guarded_write(
                        "writing an L2 table",
                        l2_offset,
                        &bytes,
                        &[MetaKind::L2Table],
                    )
                    .await
                {
                    Ok(()) => {}
                    Err(e) => {
                        let what = if matches!(e, CheckError::Overlap { .. }) {
                            "ERROR: Could not write L2 table; metadata overlap check failed"
                        } else {
                            "ERROR: Could not write L2 table"
                        };
                        self.log(FindingKind::Error, format!("{what}: {e}"));
                        self.res.check_errors += 1;
                        return Err(e);
                    }
                }
                self.res.corruptions -= dirty;
                self.res.corruptions_fixed += dirty;
            }
        }
        Ok(())
    }

    /// Writes the sector of the active L1 table that holds entry `index`.
    async fn write_l1_entry(&mut self, index: usize) -> Result<(), CheckError> {
        let per_sector = (L1_WRITE_SECTOR / 8) as usize;
        let first = index / per_sector * per_sector;
        let last = (first + per_sector).min(self.meta.l1.len());
        let mut bytes = Vec::with_capacity(L1_WRITE_SECTOR as usize);
        for &e in &self.meta.l1[first..last] {
            bytes.extend_from_slice(&e.to_be_bytes());
        }
        let offset = self.meta.l1_offset + first as u64 * 8;
        self.guarded_write(
            "updating the L1 table",
            offset,
            &bytes,
            &[MetaKind::L1Table],
        )
        .await?;
        io::flush(self.file).await
    }
}
