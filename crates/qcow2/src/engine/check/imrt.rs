//! The in-memory refcount table (QEMU's IMRT): the refcount every cluster should have,
//! computed from the references the check finds, indexed by host cluster.

use super::error::CheckError;
use std::collections::BTreeMap;

/// Clusters per chunk of the table (chunks are allocated on first use).
const CHUNK_BITS: u32 = 16;
const CHUNK: u64 = 1 << CHUNK_BITS;

/// Computed refcounts, one per host cluster.
///
/// Stored in chunks that exist only where some cluster is used, so a table that covers a
/// sparse file (or one a repair grew) costs memory only for what is referenced. Counts are
/// `u32`: a cluster cannot be referenced more often than there are references in the image,
/// and counting 2^32 of them would take far longer than any check runs. Counts stop at the
/// image's refcount limit, where QEMU reports an overflow.
pub(crate) struct Imrt {
    chunks: BTreeMap<u64, Box<[u32]>>,
    len: u64,
}

impl Imrt {
    /// A table of `clusters` zero refcounts.
    pub fn new(clusters: u64) -> Result<Imrt, CheckError> {
        let mut t = Imrt {
            chunks: BTreeMap::new(),
            len: 0,
        };
        t.grow(clusters)?;
        Ok(t)
    }

    /// Number of clusters covered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Grows the table to cover `clusters` clusters (never shrinks).
    pub fn grow(&mut self, clusters: u64) -> Result<(), CheckError> {
        self.len = self.len.max(clusters);
        Ok(())
    }

    fn split(k: u64) -> (u64, usize) {
        // Offsets inside a chunk are below 2^16.
        (k >> CHUNK_BITS, (k & (CHUNK - 1)) as usize)
    }

    /// The refcount of cluster `k` (0 past the end).
    pub fn get(&self, k: u64) -> u64 {
        let (c, i) = Self::split(k);
        self.chunks
            .get(&c)
            .and_then(|chunk| chunk.get(i))
            .map_or(0, |&v| u64::from(v))
    }

    /// Sets the refcount of cluster `k`, which must be covered; values past `u32` saturate.
    pub fn set(&mut self, k: u64, value: u64) {
        if k >= self.len {
            return;
        }
        let (c, i) = Self::split(k);
        let chunk = match self.chunks.get_mut(&c) {
            Some(chunk) => chunk,
            None if value == 0 => return,
            None => self
                .chunks
                .entry(c)
                .or_insert_with(|| vec![0u32; CHUNK as usize].into_boxed_slice()),
        };
        if let Some(v) = chunk.get_mut(i) {
            *v = u32::try_from(value).unwrap_or(u32::MAX);
        }
    }

    /// Visits the counts of clusters `[start, end)` in order while `agree(k, count)` holds;
    /// returns the first cluster where it did not (or `end`). One table lookup per chunk
    /// rather than per cluster: this is the inner loop of comparing a large image.
    pub fn scan_while(&self, start: u64, end: u64, mut agree: impl FnMut(u64, u64) -> bool) -> u64 {
        let end = end.min(self.len);
        let mut k = start;
        while k < end {
            let (c, from) = Self::split(k);
            let chunk_end = ((c + 1) << CHUNK_BITS).min(end);
            let chunk = self.chunks.get(&c);
            // Both bounds lie in this chunk, so the indices are below 2^16.
            let to = from + (chunk_end - k) as usize;
            for i in from..to {
                let count = chunk.and_then(|ch| ch.get(i)).map_or(0, |&v| u64::from(v));
                if !agree(k, count) {
                    return k;
                }
                k += 1;
            }
        }
        end.max(start)
    }

    /// Adds one to the count of cluster `k`, which must be covered, unless it has reached
    /// `limit`: returns false then (an overflow). One lookup, for the hot path of counting.
    pub fn increment(&mut self, k: u64, limit: u64) -> bool {
        if k >= self.len {
            return true;
        }
        let (c, i) = Self::split(k);
        let chunk = self
            .chunks
            .entry(c)
            .or_insert_with(|| vec![0u32; CHUNK as usize].into_boxed_slice());
        match chunk.get_mut(i) {
            Some(v) if u64::from(*v) >= limit => false,
            Some(v) => {
                *v = v.saturating_add(1);
                true
            }
            None => true,
        }
    }

    /// The first cluster at or after `k` with a non-zero count.
    pub fn next_used(&self, k: u64) -> Option<u64> {
        let (first, skip) = Self::split(k);
        for (&c, chunk) in self.chunks.range(first..) {
            let from = if c == first { skip } else { 0 };
            if let Some(pos) = chunk.iter().skip(from).position(|&v| v != 0) {
                let found = (c << CHUNK_BITS) + (from + pos) as u64;
                return (found < self.len).then_some(found);
            }
        }
        None
    }

    /// Whether any cluster in `[start, end)` has a non-zero count.
    pub fn any_used(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
        }
        let (first, _) = Self::split(start);
        let (last, _) = Self::split(end - 1);
        self.chunks.range(first..=last).any(|(&c, chunk)| {
            let base = c << CHUNK_BITS;
            let from = start.saturating_sub(base).min(CHUNK) as usize;
            let to = (end - base).min(CHUNK) as usize;
            chunk
                .get(from..to)
                .is_some_and(|s| s.iter().any(|&v| v != 0))
        })
    }

    /// The largest count this table can hold for an image whose refcounts stop at `max`.
    pub fn limit(max: u64) -> u64 {
        max.min(u64::from(u32::MAX))
    }

    /// Zeroes every count, keeping the size.
    pub fn clear(&mut self) {
        self.chunks.clear();
    }

    /// Finds `count` contiguous free clusters at or after `*first_free`, marks them used
    /// (refcount 1) and returns the first one's index, growing the table past its end when
    /// no gap is large enough. `*first_free` moves to the first free cluster seen, as in
    /// QEMU's `alloc_clusters_imrt`.
    pub fn alloc(&mut self, count: u64, first_free: &mut u64) -> Result<u64, CheckError> {
        let mut cluster = *first_free;
        let mut run = 0u64;
        let mut first_gap = true;
        while cluster < self.len && run < count {
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

    #[test]
    fn a_huge_sparse_table_costs_only_its_used_chunks() {
        let mut t = Imrt::new(1 << 40).unwrap();
        t.set(3, 1);
        t.set((1 << 39) + 7, 2);
        assert_eq!(t.next_used(0), Some(3));
        assert_eq!(t.next_used(4), Some((1 << 39) + 7));
        assert_eq!(t.next_used((1 << 39) + 8), None);
        assert!(t.any_used(0, 4));
        assert!(!t.any_used(4, 1 << 39));
        assert!(t.any_used((1 << 39) + 7, (1 << 39) + 8));
        t.clear();
        assert_eq!(t.next_used(0), None);
        assert_eq!(t.len(), 1 << 40);
    }

    #[test]
    fn scan_crosses_chunks_and_stops_at_the_first_disagreement() {
        let mut t = Imrt::new(3 * CHUNK).unwrap();
        let k = CHUNK - 2;
        for c in [k, k + 1, k + 2, k + 4] {
            assert!(t.increment(c, 10));
        }
        assert!(t.increment(k + 4, 10));
        let mut seen = Vec::new();
        let stop = t.scan_while(k - 1, 3 * CHUNK, |c, n| {
            seen.push((c, n));
            n <= 1
        });
        assert_eq!(stop, k + 4, "the count of 2 stops the scan");
        assert_eq!(
            seen,
            [
                (k - 1, 0),
                (k, 1),
                (k + 1, 1),
                (k + 2, 1),
                (k + 3, 0),
                (k + 4, 2)
            ]
        );
        assert_eq!(t.scan_while(5, 3 * CHUNK + 9, |_, _| true), 3 * CHUNK);
        assert_eq!(t.scan_while(9, 9, |_, _| false), 9);
    }

    #[test]
    fn increment_stops_at_the_limit_and_ignores_uncovered_clusters() {
        let mut t = Imrt::new(4).unwrap();
        assert!(t.increment(1, 2));
        assert!(t.increment(1, 2));
        assert!(
            !t.increment(1, 2),
            "a third reference overflows a limit of 2"
        );
        assert_eq!(t.get(1), 2);
        assert!(t.increment(7, 2));
        assert_eq!(t.get(7), 0);
    }
}
