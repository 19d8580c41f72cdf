//! The in-memory refcount table (QEMU's IMRT): the refcount every cluster should have,
//! computed from the references the check finds, indexed by host cluster.

use super::error::CheckError;

/// Clusters per chunk of the table (chunks are allocated on first use).
const CHUNK_BITS: u32 = 16;
const CHUNK: u64 = 1 << CHUNK_BITS;

/// Computed refcounts, one per host cluster.
///
/// Stored in chunks that exist only where some cluster is used, so a table that covers a
/// sparse file (or one a repair grew) costs memory only for what is referenced, plus one
/// directory slot per chunk up to the highest one used (16 bytes per 64 Ki clusters: a check
/// counts at most 2^31 clusters, so at most half a MiB). The directory is indexed directly:
/// looking a chunk up is the inner step of counting every cluster of a large image. Counts are
/// `u32`: a cluster cannot be referenced more often than there are references in the image,
/// and counting 2^32 of them would take far longer than any check runs. Counts stop at the
/// image's refcount limit, where QEMU reports an overflow.
pub(crate) struct Imrt {
    /// Slot `c` holds clusters `[c * CHUNK, (c + 1) * CHUNK)`, `None` while all are zero.
    chunks: Vec<Option<Box<[u32]>>>,
    len: u64,
}

impl Imrt {
    /// A table of `clusters` zero refcounts.
    pub fn new(clusters: u64) -> Result<Imrt, CheckError> {
        let mut t = Imrt {
            chunks: Vec::new(),
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

    /// The chunk slot and the index inside the chunk of cluster `k`.
    fn split(k: u64) -> (usize, usize) {
        // Chunk numbers of covered clusters index an allocated directory, so they fit a
        // usize; offsets inside a chunk are below 2^16.
        ((k >> CHUNK_BITS) as usize, (k & (CHUNK - 1)) as usize)
    }

    fn chunk(&self, c: usize) -> Option<&[u32]> {
        self.chunks.get(c).and_then(Option::as_deref)
    }

    /// The chunk in slot `c`, allocated (zeroed) on first use.
    #[inline]
    fn chunk_mut(&mut self, c: usize) -> &mut [u32] {
        if self.chunk(c).is_none() {
            self.allocate(c);
        }
        self.chunks[c].as_deref_mut().unwrap_or_default()
    }

    #[cold]
    fn allocate(&mut self, c: usize) {
        if c >= self.chunks.len() {
            self.chunks.resize_with(c + 1, || None);
        }
        self.chunks[c] = Some(vec![0u32; CHUNK as usize].into_boxed_slice());
    }

    /// The refcount of cluster `k` (0 past the end).
    #[inline]
    pub fn get(&self, k: u64) -> u64 {
        let (c, i) = Self::split(k);
        self.chunk(c)
            .and_then(|chunk| chunk.get(i))
            .map_or(0, |&v| u64::from(v))
    }

    /// Sets the refcount of cluster `k`, which must be covered; values past `u32` saturate.
    pub fn set(&mut self, k: u64, value: u64) {
        if k >= self.len || (value == 0 && self.get(k) == 0) {
            return;
        }
        let (c, i) = Self::split(k);
        if let Some(v) = self.chunk_mut(c).get_mut(i) {
            *v = u32::try_from(value).unwrap_or(u32::MAX);
        }
    }

    /// The counts from cluster `k` up to `end` (at most `len`) or the end of `k`'s chunk,
    /// whichever comes first, and how many clusters that is: `None` for counts that are all
    /// zero. Lets a caller walk a range a chunk at a time without a lookup per cluster.
    pub fn counts_at(&self, k: u64, end: u64) -> (Option<&[u32]>, u64) {
        let end = end.min(self.len);
        if k >= end {
            return (None, 0);
        }
        let (c, from) = Self::split(k);
        // Both bounds lie in this chunk, so the count is at most 2^16.
        let n = (end - k).min(CHUNK - from as u64);
        let counts = self
            .chunk(c)
            .and_then(|chunk| chunk.get(from..from + n as usize));
        (counts, n)
    }

    /// Adds one to the count of cluster `k`, which must be covered, unless it has reached
    /// `limit`: returns false then (an overflow). One lookup, for the hot path of counting.
    #[inline]
    pub fn increment(&mut self, k: u64, limit: u64) -> bool {
        if k >= self.len {
            return true;
        }
        let (c, i) = Self::split(k);
        match self.chunk_mut(c).get_mut(i) {
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
        for (c, chunk) in self.chunks.iter().enumerate().skip(first) {
            let Some(chunk) = chunk else { continue };
            let from = if c == first { skip } else { 0 };
            if let Some(pos) = chunk.iter().skip(from).position(|&v| v != 0) {
                let found = ((c as u64) << CHUNK_BITS) + (from + pos) as u64;
                return (found < self.len).then_some(found);
            }
        }
        None
    }

    /// The first cluster whose count exceeds `max`, if any (a width change refuses the
    /// image then).
    pub fn first_above(&self, max: u64) -> Option<u64> {
        let mut k = 0;
        while k < self.len {
            let (counts, n) = self.counts_at(k, self.len);
            if let Some(pos) = counts.and_then(|s| s.iter().position(|&v| u64::from(v) > max)) {
                return Some(k + pos as u64);
            }
            k += n;
        }
        None
    }

    /// Whether any cluster in `[start, end)` has a non-zero count.
    pub fn any_used(&self, start: u64, end: u64) -> bool {
        let mut k = start;
        while k < end.min(self.len) {
            let (counts, n) = self.counts_at(k, end);
            if counts.is_some_and(|s| s.iter().any(|&v| v != 0)) {
                return true;
            }
            k += n;
        }
        false
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
        // The most clusters a check counts.
        let mut t = Imrt::new(1 << 31).unwrap();
        t.set(3, 1);
        t.set((1 << 30) + 7, 2);
        assert_eq!(t.chunks.iter().flatten().count(), 2);
        assert_eq!(t.next_used(0), Some(3));
        assert_eq!(t.next_used(4), Some((1 << 30) + 7));
        assert_eq!(t.next_used((1 << 30) + 8), None);
        assert!(t.any_used(0, 4));
        assert!(!t.any_used(4, 1 << 30));
        assert!(t.any_used((1 << 30) + 7, (1 << 30) + 8));
        t.set(5, 0);
        assert_eq!(
            t.chunks.iter().flatten().count(),
            2,
            "a zero allocates nothing"
        );
        t.clear();
        assert_eq!(t.next_used(0), None);
        assert_eq!(t.len(), 1 << 31);
    }

    #[test]
    fn counts_come_a_chunk_at_a_time_up_to_the_end() {
        let mut t = Imrt::new(3 * CHUNK - 5).unwrap();
        let k = CHUNK - 2;
        for c in [k, k + 1, k + 2] {
            assert!(t.increment(c, 10));
        }
        assert_eq!(t.counts_at(k - 1, 3 * CHUNK), (Some(&[0, 1, 1][..]), 3));
        assert_eq!(t.counts_at(CHUNK, CHUNK + 2), (Some(&[1, 0][..]), 2));
        assert_eq!(t.counts_at(2 * CHUNK + 1, 3 * CHUNK), (None, CHUNK - 6));
        assert_eq!(t.counts_at(3 * CHUNK - 5, 3 * CHUNK), (None, 0));
        assert_eq!(t.counts_at(9, 9), (None, 0));
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

    #[test]
    fn the_first_count_above_a_width_is_found_across_chunks() {
        let mut t = Imrt::new(2 * CHUNK + 3).unwrap();
        t.set(2, 1);
        assert_eq!(t.first_above(1), None);
        t.set(CHUNK + 4, 2);
        t.set(2 * CHUNK + 2, 5);
        assert_eq!(t.first_above(1), Some(CHUNK + 4));
        assert_eq!(t.first_above(2), Some(2 * CHUNK + 2));
        assert_eq!(t.first_above(5), None);
    }
}
