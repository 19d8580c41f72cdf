//! The in-memory refcount table (QEMU's IMRT): the refcount every cluster should have,
//! computed from the references the check finds, indexed by host cluster.

use super::error::CheckError;

/// Computed refcounts, one per host cluster.
///
/// Stored as `u32`: a cluster cannot be referenced more often than there are references in the
/// image, and counting 2^32 of them would take far longer than any check runs. Counts stop at
/// the image's refcount limit, where QEMU reports an overflow.
pub(crate) struct Imrt {
    counts: Vec<u32>,
}

impl Imrt {
    /// A table of `clusters` zero refcounts.
    pub fn new(clusters: u64) -> Result<Imrt, CheckError> {
        let mut t = Imrt { counts: Vec::new() };
        t.grow(clusters)?;
        Ok(t)
    }

    /// Number of clusters covered.
    pub fn len(&self) -> u64 {
        self.counts.len() as u64
    }

    /// Grows the table to cover `clusters` clusters (never shrinks).
    pub fn grow(&mut self, clusters: u64) -> Result<(), CheckError> {
        let n = usize::try_from(clusters).map_err(|_| CheckError::TooLarge { clusters })?;
        if n > self.counts.len() {
            self.counts
                .try_reserve(n - self.counts.len())
                .map_err(|_| CheckError::TooLarge { clusters })?;
            self.counts.resize(n, 0);
        }
        Ok(())
    }

    /// The refcount of cluster `k` (0 past the end).
    pub fn get(&self, k: u64) -> u64 {
        usize::try_from(k)
            .ok()
            .and_then(|i| self.counts.get(i))
            .map_or(0, |&v| u64::from(v))
    }

    /// Sets the refcount of cluster `k`, which must be covered; values past `u32` saturate.
    pub fn set(&mut self, k: u64, value: u64) {
        if let Some(slot) = usize::try_from(k).ok().and_then(|i| self.counts.get_mut(i)) {
            *slot = u32::try_from(value).unwrap_or(u32::MAX);
        }
    }

    /// The largest count this table can hold for an image whose refcounts stop at `max`.
    pub fn limit(max: u64) -> u64 {
        max.min(u64::from(u32::MAX))
    }

    /// Zeroes every count, keeping the size.
    pub fn clear(&mut self) {
        self.counts.fill(0);
    }

    /// Finds `count` contiguous free clusters at or after `*first_free`, marks them used
    /// (refcount 1) and returns the first one's index, growing the table past its end when
    /// no gap is large enough. `*first_free` moves to the first free cluster seen, as in
    /// QEMU's `alloc_clusters_imrt`.
    pub fn alloc(&mut self, count: u64, first_free: &mut u64) -> Result<u64, CheckError> {
        let mut cluster = *first_free;
        let mut run = 0u64;
        let mut first_gap = true;
        while cluster < self.len() && run < count {
            if self.get(cluster) == 0 {
                run += 1;
                if first_gap {
                    *first_free = cluster;
                    first_gap = false;
                }
            } else {
                run = 0;
            }
            cluster += 1;
        }
        if run < count {
            let end = cluster
                .checked_add(count - run)
                .ok_or(CheckError::TooLarge { clusters: u64::MAX })?;
            self.grow(end)?;
        }
        let start = cluster - run;
        for i in 0..count {
            self.set(start + i, 1);
        }
        Ok(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_fills_gaps_then_grows() {
        let mut t = Imrt::new(6).unwrap();
        for k in [0, 1, 3] {
            t.set(k, 1);
        }
        let mut first = 0;
        assert_eq!(t.alloc(1, &mut first).unwrap(), 2);
        assert_eq!(first, 2);
        // Clusters 4 and 5 are free but a run of 3 needs one more at the end.
        let mut first = 0;
        assert_eq!(t.alloc(3, &mut first).unwrap(), 4);
        assert_eq!(t.len(), 7);
        assert_eq!((t.get(4), t.get(5), t.get(6)), (1, 1, 1));
        let mut first = 100;
        assert_eq!(t.alloc(2, &mut first).unwrap(), 100);
        assert_eq!(t.len(), 102);
    }

    #[test]
    fn out_of_range_reads_are_zero_and_writes_ignored() {
        let mut t = Imrt::new(2).unwrap();
        t.set(5, 3);
        assert_eq!(t.get(5), 0);
        t.set(1, u64::MAX);
        assert_eq!(t.get(1), u64::from(u32::MAX));
    }
}
