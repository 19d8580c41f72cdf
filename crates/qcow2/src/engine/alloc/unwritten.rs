//! Which subclusters of the data clusters allocated in this session have never been written:
//! their bytes in the file are still the zeros of the hole they were allocated from.
//!
//! A write of part of an unallocated subcluster must leave the rest of the subcluster reading
//! as zeros. Where the file already holds zeros there, nothing needs writing; asking the file
//! (`SEEK_DATA`) costs a system call that waits for the inode lock every allocating direct
//! write holds, so at queue depth it stalls the thread that runs every request. What the
//! allocator handed out from past the end of everything written, and what was written into it
//! since, answers the same question from memory.
//!
//! The record is only ever an under-statement of what reads as zeros:
//! - a cluster enters it only when allocated fresh (past everything the file may hold);
//! - every data write clears the subclusters it touches before it is issued (a write that
//!   fails may still have written some of its bytes);
//! - a cluster leaves it whenever its refcount leaves or reaches 0, or the file is cut below
//!   it, so a cluster freed and handed out again (perhaps to metadata, whose writes do not
//!   pass through here) is never taken for a hole.
//!
//! Holes the record does not know of (an image opened with unwritten parts, a record that is
//! full) are still found by asking the file.

use std::collections::VecDeque;

use crate::format::{Geometry, HostCluster, HostOffset};

/// How many clusters the record follows at most: 4 bytes each, so 256 KiB. Past it, the
/// oldest are let go and their holes are found by asking the file.
const MAX_CLUSTERS: u64 = 1 << 16;

/// The never-written subclusters of freshly allocated clusters (see the module's text).
/// Fresh clusters come from the end of the file, in increasing order, so the clusters
/// followed form one window: a word per cluster from `base` on, rather than a map entry.
pub(super) struct Unwritten {
    /// Per cluster from `base` on, a bit per subcluster never written (bit `i`: subcluster
    /// `i`); 0 for a cluster not followed. Never starts with a 0.
    window: VecDeque<u32>,
    base: u64,
    geom: Geometry,
    /// Off for images without subclusters (a cluster is written whole when allocated) and
    /// for encrypted ones (a hole does not read as enciphered zeros).
    on: bool,
}

impl Unwritten {
    pub(super) fn new(geom: &Geometry, encrypted: bool) -> Unwritten {
        Unwritten {
            window: VecDeque::new(),
            base: 0,
            geom: *geom,
            on: geom.extended_l2() && !encrypted,
        }
    }

    /// `n` clusters from `first` were just allocated past everything the file may hold.
    pub(super) fn allocated_fresh(&mut self, first: HostOffset, n: u64) {
        if !self.on {
            return;
        }
        // Extended L2 entries: 32 subclusters, a bit each.
        let HostCluster(c) = self.geom.host_cluster(first);
        let end = c.saturating_add(n);
        // Of a longer run, only the last clusters fit in the window.
        for k in c.max(end.saturating_sub(MAX_CLUSTERS))..end {
            if let Some(bits) = self.slot(k) {
                *bits = u32::MAX;
            }
        }
    }

    /// The word of cluster `k`, the window moved or grown to hold it (`None` for a cluster
    /// below the window, which is not followed).
    fn slot(&mut self, k: u64) -> Option<&mut u32> {
        if self.window.is_empty() {
            self.base = k;
        }
        let mut idx = k.checked_sub(self.base)?;
        if idx >= MAX_CLUSTERS {
            // Let the oldest go, so that `k` is the window's last place.
            let past = (idx - MAX_CLUSTERS + 1).min(self.window.len() as u64);
            self.window.drain(..past as usize);
            self.base += past;
            self.trim_front();
            if self.window.is_empty() {
                self.base = k;
            }
            idx = k - self.base;
        }
        let idx = idx as usize;
        if idx >= self.window.len() {
            self.window.resize(idx + 1, 0);
        }
        self.window.get_mut(idx)
    }

    /// The word of cluster `k`, if the window holds it.
    fn word(&self, k: u64) -> Option<u32> {
        let idx = usize::try_from(k.checked_sub(self.base)?).ok()?;
        self.window.get(idx).copied()
    }

    /// Lets go of the clusters at the window's start that have nothing left unwritten.
    fn trim_front(&mut self) {
        while self.window.front() == Some(&0) {
            self.window.pop_front();
            self.base += 1;
        }
    }

    /// `[host, host + len)` is about to be written: its subclusters may hold data from now on.
    pub(super) fn writing(&mut self, host: HostOffset, len: u64) {
        if self.window.is_empty() || len == 0 {
            return;
        }
        let Some(last) = host.0.checked_add(len - 1) else {
            self.clear();
            return;
        };
        let (first, end) = self.cluster_span(host, last);
        let from = first.max(self.base);
        let to = end.min(self.base + self.window.len() as u64 - 1);
        for c in from..=to {
            let touched = self.touched(c, host.0, last);
            if let Some(bits) = self.window.get_mut((c - self.base) as usize) {
                *bits &= !touched;
            }
        }
        self.trim_front();
    }

    /// Whether every byte of `[host, host + len)` lies in subclusters never written.
    pub(super) fn is_unwritten(&self, host: HostOffset, len: u64) -> bool {
        if self.window.is_empty() || len == 0 {
            return false;
        }
        let Some(last) = host.0.checked_add(len - 1) else {
            return false;
        };
        let (first, end) = self.cluster_span(host, last);
        (first..=end).all(|c| {
            let want = self.touched(c, host.0, last);
            self.word(c).is_some_and(|bits| bits & want == want)
        })
    }

    /// The cluster's refcount left or reached 0: whatever it holds next is not ours to know.
    pub(super) fn forget(&mut self, HostCluster(c): HostCluster) {
        if let Some(idx) = c.checked_sub(self.base) {
            if let Some(bits) = self.window.get_mut(idx as usize) {
                *bits = 0;
            }
        }
        self.trim_front();
    }

    /// The file now ends at `end`.
    pub(super) fn truncated(&mut self, end: u64) {
        let first_gone = self.geom.size_to_clusters(end);
        let keep = first_gone.saturating_sub(self.base);
        if keep < self.window.len() as u64 {
            self.window.truncate(keep as usize);
        }
    }

    /// Everything the record holds is void (the image was emptied).
    pub(super) fn clear(&mut self) {
        self.window.clear();
    }

    /// Whether cluster `c` is followed (some subcluster of it never written).
    #[cfg(test)]
    fn follows(&self, c: u64) -> bool {
        self.word(c).is_some_and(|bits| bits != 0)
    }

    /// The indexes of the clusters from the one holding `host` to the one holding `last`.
    fn cluster_span(&self, host: HostOffset, last: u64) -> (u64, u64) {
        let HostCluster(first) = self.geom.host_cluster(host);
        let HostCluster(end) = self.geom.host_cluster(HostOffset(last));
        (first, end)
    }

    /// The bits of cluster `c`'s subclusters that `[from, last]` touches.
    fn touched(&self, c: u64, from: u64, last: u64) -> u32 {
        let cs = self.geom.cluster_size();
        let start = c * cs;
        let sub = self.geom.subcluster_bits();
        let lo = (from.max(start) - start) >> sub;
        let hi = (last.min(start + cs - 1) - start) >> sub;
        let upto = if hi >= 31 {
            u32::MAX
        } else {
            (1u32 << (hi + 1)) - 1
        };
        upto & !((1u32 << lo) - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 KiB clusters of 32 subclusters of 2 KiB.
    fn record() -> Unwritten {
        let geom = Geometry::new(16, true, 4, 1 << 30).expect("geometry");
        Unwritten::new(&geom, false)
    }

    const CS: u64 = 64 * 1024;
    const SUB: u64 = 2048;

    #[test]
    fn a_fresh_cluster_is_unwritten_until_written() {
        let mut u = record();
        assert!(!u.is_unwritten(HostOffset(CS), SUB), "nothing followed yet");
        u.allocated_fresh(HostOffset(CS), 2);
        assert!(u.is_unwritten(HostOffset(CS), 2 * CS));
        u.writing(HostOffset(CS + 5 * SUB + 100), 10);
        assert!(!u.is_unwritten(HostOffset(CS + 5 * SUB), SUB));
        assert!(
            !u.is_unwritten(HostOffset(CS + 5 * SUB + 200), 1),
            "the whole subcluster"
        );
        assert!(u.is_unwritten(HostOffset(CS + 4 * SUB), SUB));
        assert!(u.is_unwritten(HostOffset(CS + 6 * SUB), CS - 6 * SUB + CS));
        assert!(!u.is_unwritten(HostOffset(CS + 4 * SUB), 2 * SUB + 1));
    }

    #[test]
    fn clusters_allocated_apart_are_followed_and_the_gap_is_not() {
        let mut u = record();
        u.allocated_fresh(HostOffset(4 * CS), 1);
        u.allocated_fresh(HostOffset(8 * CS), 2);
        assert!(u.is_unwritten(HostOffset(4 * CS), CS));
        assert!(
            !u.is_unwritten(HostOffset(5 * CS), 1),
            "a cluster in the gap"
        );
        assert!(u.is_unwritten(HostOffset(8 * CS), 2 * CS));
        assert!(!u.is_unwritten(HostOffset(3 * CS), 1), "below the window");
        // The first cluster written whole: the window now starts at the next one followed.
        u.writing(HostOffset(4 * CS), CS);
        assert_eq!(u.base, 8);
        assert!(u.is_unwritten(HostOffset(8 * CS), 2 * CS));
        u.forget(HostCluster(8));
        u.truncated(9 * CS + 1);
        assert!(
            u.is_unwritten(HostOffset(9 * CS), CS),
            "the cut keeps a partial cluster"
        );
        u.truncated(8 * CS);
        assert!(u.window.is_empty());
    }

    #[test]
    fn a_write_across_clusters_clears_both_ends() {
        let mut u = record();
        u.allocated_fresh(HostOffset(0), 2);
        u.writing(HostOffset(CS - 1), 2);
        assert!(!u.is_unwritten(HostOffset(CS - SUB), SUB));
        assert!(!u.is_unwritten(HostOffset(CS), SUB));
        assert!(u.is_unwritten(HostOffset(CS - 2 * SUB), SUB));
        assert!(u.is_unwritten(HostOffset(CS + SUB), SUB));
    }

    #[test]
    fn a_cluster_written_whole_or_freed_is_forgotten() {
        let mut u = record();
        u.allocated_fresh(HostOffset(0), 3);
        u.writing(HostOffset(0), CS);
        assert!(!u.follows(0));
        u.forget(HostCluster(1));
        assert!(!u.is_unwritten(HostOffset(CS), 1));
        u.truncated(2 * CS + 1);
        assert!(
            u.is_unwritten(HostOffset(2 * CS), CS),
            "the cut keeps a partial cluster"
        );
        u.truncated(2 * CS);
        assert!(!u.is_unwritten(HostOffset(2 * CS), 1));
    }

    #[test]
    fn off_without_subclusters_or_with_encryption() {
        let std = Geometry::new(16, false, 4, 1 << 30).expect("geometry");
        let mut u = Unwritten::new(&std, false);
        u.allocated_fresh(HostOffset(0), 1);
        assert!(!u.is_unwritten(HostOffset(0), 1));
        let ext = Geometry::new(16, true, 4, 1 << 30).expect("geometry");
        let mut u = Unwritten::new(&ext, true);
        u.allocated_fresh(HostOffset(0), 1);
        assert!(!u.is_unwritten(HostOffset(0), 1));
    }

    #[test]
    fn the_record_is_bounded_and_ends_of_the_address_space_are_safe() {
        let mut u = record();
        u.allocated_fresh(HostOffset(0), MAX_CLUSTERS + 10);
        assert_eq!(u.window.len() as u64, MAX_CLUSTERS);
        assert!(!u.follows(9), "the oldest are let go");
        assert!(
            u.follows(10) && u.follows(MAX_CLUSTERS + 9),
            "the newest are followed"
        );
        // A fresh cluster far past the window starts it anew.
        u.allocated_fresh(HostOffset(10 * MAX_CLUSTERS * CS), 1);
        assert_eq!(u.window.len(), 1);
        assert!(u.is_unwritten(HostOffset(10 * MAX_CLUSTERS * CS), CS));
        assert!(!u.is_unwritten(HostOffset(u64::MAX - 1), 10));
        u.writing(HostOffset(u64::MAX - 1), 10);
        assert!(
            u.window.is_empty(),
            "an impossible write forgets everything"
        );
    }
}
