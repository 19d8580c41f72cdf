//! Comparing the stored refcounts with the computed ones (QEMU's `compare_refcounts`): a
//! stored refcount above the use is a leak, below it a corruption, and zero for a used
//! cluster means the refcount structure has to be rebuilt.

use super::error::CheckError;
use super::imrt::Imrt;
use super::ondisk::Refblocks;
use super::pass::{Fix, Pass};
use super::report::FindingKind;
use crate::format::refcount::REFTABLE_OFFSET_MASK;
use storage::Storage;

impl<S: Storage> Pass<'_, S> {
    /// Compares every cluster `imrt` covers, repairing what `fix` allows; returns the index of
    /// the highest cluster in use either way.
    pub async fn compare(
        &mut self,
        imrt: &Imrt,
        fix: Fix,
        rebuild: &mut bool,
    ) -> Result<u64, CheckError> {
        let mut rb = Refblocks::default();
        let mut highest = 0u64;
        let mut next = 0u64;
        while next < imrt.len() {
            if let Some(resume) = self.skip_unused(imrt, next) {
                next = resume;
                continue;
            }
            let k = next;
            next += 1;
            let stored = match self.stored_refcount(&mut rb, k).await {
                Ok(v) => v,
                Err(e) => {
                    self.log(
                        FindingKind::Error,
                        format!("Can't get refcount for cluster {k}: {}", e.reason()),
                    );
                    self.res.check_errors += 1;
                    continue;
                }
            };
            let used = imrt.get(k);
            if stored > 0 || used > 0 {
                highest = k;
            }
            if stored == used {
                continue;
            }
            let repair = if stored == 0 {
                *rebuild = true;
                false
            } else {
                (stored > used && fix.leaks) || (stored < used && fix.errors)
            };
            let (kind, verb) = if repair {
                (FindingKind::Repair, "Repairing")
            } else if stored < used {
                (FindingKind::Error, "ERROR")
            } else {
                (FindingKind::Leak, "Leaked")
            };
            self.log(
                kind,
                format!("{verb} cluster {k} refcount={stored} reference={used}"),
            );
            if repair && self.set_stored_refcount(&mut rb, k, used).await.is_ok() {
                if stored > used {
                    self.res.leaks_fixed += 1;
                } else {
                    self.res.corruptions_fixed += 1;
                }
                continue;
            }
            if stored < used {
                self.res.corruptions += 1;
            } else {
                self.res.leaks += 1;
            }
        }
        self.write_back_refblock(&mut rb).await?;
        Ok(highest)
    }

    /// Where comparing can resume when cluster `k` starts a stretch that no refcount block
    /// describes and nothing uses: both sides are zero there. `None` when `k` needs looking
    /// at. This keeps a check of a sparse file (or one a repair grew) proportional to what
    /// the image uses.
    fn skip_unused(&self, imrt: &Imrt, k: u64) -> Option<u64> {
        let bits = self.meta.refblock_bits;
        let index = k >> bits;
        let beyond_table = index >= self.meta.reftable.len() as u64;
        let no_block = beyond_table
            || usize::try_from(index)
                .ok()
                .and_then(|i| self.meta.reftable.get(i))
                .is_some_and(|&raw| raw & REFTABLE_OFFSET_MASK == 0);
        if !no_block {
            return None;
        }
        if beyond_table {
            // Every block past the table is absent: jump to the block of the next use.
            let next_used = imrt.next_used(k).unwrap_or(imrt.len());
            let resume = (next_used >> bits) << bits;
            return (resume > k).then_some(resume);
        }
        let block_end = (index + 1) << bits;
        (!imrt.any_used(k, block_end)).then_some(block_end)
    }
}
