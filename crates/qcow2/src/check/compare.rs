//! Comparing the stored refcounts with the computed ones (QEMU's `compare_refcounts`): a
//! stored refcount above the use is a leak, below it a corruption, and zero for a used
//! cluster means the refcount structure has to be rebuilt.

use super::error::CheckError;
use super::imrt::Imrt;
use super::ondisk::Refblocks;
use super::pass::{Fix, Pass};
use super::report::FindingKind;
use crate::format::refcount;
use storage::Storage;

/// What comparing the stored refcounts with the computed ones found.
pub(crate) struct Compared {
    /// The highest cluster in use.
    pub highest: u64,
    /// Every stored refcount `imrt` covers could be read and equals the computed one.
    pub agree: bool,
}

impl<S: Storage> Pass<'_, S> {
    /// Compares every cluster `imrt` covers, repairing what `fix` allows.
    pub async fn compare(
        &mut self,
        imrt: &Imrt,
        fix: Fix,
        rebuild: &mut bool,
    ) -> Result<Compared, CheckError> {
        let mut rb = Refblocks::default();
        let mut highest = 0u64;
        let mut agree = true;
        let mut next = 0u64;
        while next < imrt.len() {
            if let Some(resume) = self.skip_unused(imrt, next) {
                next = resume;
                continue;
            }
            let agreed = self.skip_agreeing(&mut rb, imrt, next, &mut highest).await;
            if agreed > next {
                next = agreed;
                continue;
            }
            let k = next;
            next += 1;
            let stored = match self.stored_refcount(&mut rb, k).await {
                Ok(v) => v,
                Err(e) => {
                    agree = false;
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
            agree = false;
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
        Ok(Compared { highest, agree })
    }

    /// The first cluster at or after `k` in its refcount block whose stored refcount differs
    /// from the computed one, passing over those that agree a block at a time (`highest`
    /// follows the ones in use). `k` itself when its block cannot be read as is: the
    /// cluster-by-cluster path then reports why.
    async fn skip_agreeing(
        &mut self,
        rb: &mut Refblocks,
        imrt: &Imrt,
        k: u64,
        highest: &mut u64,
    ) -> u64 {
        let bits = self.meta.refblock_bits;
        let index = k >> bits;
        let block = self.meta.refblock_of(k);
        if block == 0 || self.meta.in_cluster(block) != 0 {
            return k;
        }
        if self.load_refblock(rb, block).await.is_err() {
            return k;
        }
        let Some(buf) = rb.cached() else {
            return k;
        };
        let mask = self.meta.refblock_entries() - 1;
        let block_end = (index + 1) << bits;
        // The refcount width is fixed per image: one loop per width keeps the decoding of a
        // stored refcount inline.
        match self.meta.refcount_order {
            4 => agreeing_run(imrt, k, block_end, mask, highest, |e| {
                buf.get(2 * e..2 * e + 2)
                    .map_or(0, |b| u64::from(u16::from_be_bytes([b[0], b[1]])))
            }),
            order => agreeing_run(imrt, k, block_end, mask, highest, |e| {
                refcount::get(buf, order, e).unwrap_or(0)
            }),
        }
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
                .is_some_and(|&raw| refcount::block_of(raw) == 0);
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

/// The first cluster in `[k, end)` (which one refcount block covers, its entry `e` read by
/// `stored`, `mask` the entry bits of a cluster index) whose stored refcount differs from
/// the computed one, or `end` (at most `imrt.len()`). `highest` follows the agreeing clusters
/// in use. Walks the computed counts a chunk at a time.
fn agreeing_run(
    imrt: &Imrt,
    k: u64,
    end: u64,
    mask: u64,
    highest: &mut u64,
    stored: impl Fn(usize) -> u64,
) -> u64 {
    let mut c = k;
    loop {
        let (counts, n) = imrt.counts_at(c, end);
        if n == 0 {
            return c;
        }
        // The entry index is below the entries of one cluster-sized block.
        let base = (c & mask) as usize;
        let agreed = match counts {
            Some(counts) => {
                let upto = counts
                    .iter()
                    .enumerate()
                    .position(|(i, &used)| stored(base + i) != u64::from(used))
                    .unwrap_or(counts.len());
                if let Some(last) = counts[..upto].iter().rposition(|&used| used != 0) {
                    *highest = c + last as u64;
                }
                upto as u64
            }
            None => (0..n as usize)
                .position(|i| stored(base + i) != 0)
                .map_or(n, |p| p as u64),
        };
        c += agreed;
        if agreed < n {
            return c;
        }
    }
}
