//! Comparing the stored refcounts with the computed ones (QEMU's `compare_refcounts`): a
//! stored refcount above the use is a leak, below it a corruption, and zero for a used
//! cluster means the refcount structure has to be rebuilt.

use super::error::CheckError;
use super::imrt::Imrt;
use super::ondisk::Refblocks;
use super::pass::{Fix, Pass};
use super::report::FindingKind;
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
        for k in 0..imrt.len() {
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
}
