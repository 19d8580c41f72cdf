//! Which parts of an entry changed since its write-back started. A write-back writes only
//! those parts: with 2 MiB clusters a refcount block or L2 table is 2 MiB, and an allocating
//! write changes a few bytes of it, so writing (and first copying) the whole entry would cost
//! 2 MiB of memory and I/O per flush where one page does.
//!
//! Parts are whole pages of [`PAGE`] bytes (the whole entry if it is smaller): a write of a
//! page is as aligned as a write of the entry, so `O_DIRECT` backends take it as they are.

use std::ops::Range;

/// Granularity of the parts written back.
pub const PAGE: usize = 4096;

/// At most this many separate runs are written per write-back; beyond that the pages
/// between the first and the last dirty one are written as one run (clean pages in it hold
/// what the backend holds already, so writing them changes nothing).
const MAX_RUNS: usize = 8;

/// A set of dirty pages of one entry (bit `i` of word `i / 64` is page `i`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct DirtyPages {
    words: Vec<u64>,
}

/// Bytes per page of an entry of `entry_size` bytes.
fn page_of(entry_size: usize) -> usize {
    PAGE.min(entry_size).max(1)
}

impl DirtyPages {
    /// True when no page is dirty.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Marks the pages that bytes `range` of an entry of `entry_size` bytes lie in (the
    /// range is clamped to the entry; an empty range marks nothing).
    pub(crate) fn mark(&mut self, range: Range<usize>, entry_size: usize) {
        let end = range.end.min(entry_size);
        if range.start >= end {
            return;
        }
        let page = page_of(entry_size);
        let pages = entry_size.div_ceil(page);
        if self.words.len() < pages.div_ceil(64) {
            self.words.resize(pages.div_ceil(64), 0);
        }
        for p in range.start / page..end.div_ceil(page) {
            self.words[p / 64] |= 1 << (p % 64);
        }
    }

    /// Takes the set, leaving it empty.
    pub(crate) fn take(&mut self) -> DirtyPages {
        let words = self.words.iter_mut().map(std::mem::take).collect();
        DirtyPages { words }
    }

    /// Adds the pages of `other`.
    pub(crate) fn merge(&mut self, other: &DirtyPages) {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (w, o) in self.words.iter_mut().zip(&other.words) {
            *w |= o;
        }
    }

    /// Empties the set.
    pub(crate) fn clear(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    /// The byte ranges to write for an entry of `entry_size` bytes: runs of adjacent dirty
    /// pages, in order, at most [`MAX_RUNS`] of them.
    pub(crate) fn runs(&self, entry_size: usize) -> Vec<Range<usize>> {
        let page = page_of(entry_size);
        let mut runs: Vec<Range<usize>> = Vec::new();
        let dirty = self.words.iter().enumerate().flat_map(|(i, &w)| {
            (0..64)
                .filter(move |b| w & (1 << b) != 0)
                .map(move |b| i * 64 + b)
        });
        for p in dirty {
            let (start, end) = (p * page, ((p + 1) * page).min(entry_size));
            match runs.last_mut() {
                Some(last) if last.end == start => last.end = end,
                _ => runs.push(start..end),
            }
        }
        if runs.len() > MAX_RUNS {
            let span = runs[0].start..runs[runs.len() - 1].end;
            runs = vec![span];
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_bytes_mark_the_page_they_lie_in() {
        let mut d = DirtyPages::default();
        d.mark(5000..5008, 2 << 20);
        assert_eq!(d.runs(2 << 20), vec![4096..8192]);
        d.mark(8190..8194, 2 << 20);
        assert_eq!(d.runs(2 << 20), vec![4096..12288]);
    }

    #[test]
    fn small_entries_are_one_page() {
        let mut d = DirtyPages::default();
        d.mark(100..101, 512);
        assert_eq!(d.runs(512), vec![0..512]);
        let mut all = DirtyPages::default();
        all.mark(0..6144, 6144);
        assert_eq!(all.runs(6144), vec![0..6144]);
    }

    #[test]
    fn many_runs_become_one_span() {
        let mut d = DirtyPages::default();
        for i in 0..20 {
            d.mark(i * 2 * PAGE..i * 2 * PAGE + 1, 1 << 20);
        }
        assert_eq!(d.runs(1 << 20), vec![0..(38 * PAGE + PAGE)]);
        let mut few = DirtyPages::default();
        few.mark(0..1, 1 << 20);
        few.mark(10 * PAGE..10 * PAGE + 1, 1 << 20);
        assert_eq!(few.runs(1 << 20), vec![0..PAGE, 10 * PAGE..11 * PAGE]);
    }

    #[test]
    fn take_empties_and_merge_restores() {
        let mut d = DirtyPages::default();
        d.mark(0..1, 1 << 20);
        d.mark(70 * PAGE..70 * PAGE + 1, 1 << 20);
        let taken = d.take();
        assert!(d.is_empty());
        assert!(!taken.is_empty());
        d.mark(3 * PAGE..3 * PAGE + 1, 1 << 20);
        d.merge(&taken);
        assert_eq!(
            d.runs(1 << 20),
            vec![0..PAGE, 3 * PAGE..4 * PAGE, 70 * PAGE..71 * PAGE]
        );
        d.clear();
        assert!(d.is_empty() && d.runs(1 << 20).is_empty());
        d.mark(10..10, 1 << 20);
        assert!(d.is_empty());
    }
}
