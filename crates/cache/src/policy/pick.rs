//! How a policy picks its victim among candidates that may be clean, dirty or busy.

/// How a slot may be evicted right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Candidate {
    /// Loading, being written back or forgotten: not now.
    Busy,
    /// Can be dropped at once.
    Clean,
    /// Must be written back before it can be dropped.
    Dirty,
}

/// How many evictable entries, coldest first, are searched for a clean one before the coldest
/// dirty entry is chosen instead. Writing back on the miss path costs a write; going much
/// further up the recency order would evict entries that are about to be used again.
pub(crate) const CLEAN_SEARCH_WINDOW: usize = 16;

/// Picks the first clean candidate among the first `CLEAN_SEARCH_WINDOW` evictable ones,
/// falling back to the first dirty one.
#[derive(Default)]
pub(crate) struct Pick {
    seen: usize,
    first_dirty: Option<usize>,
}

impl Pick {
    /// Consider `slot`; `Some` means the choice is made.
    pub(crate) fn offer(&mut self, slot: usize, candidate: Candidate) -> Option<usize> {
        match candidate {
            Candidate::Busy => return None,
            Candidate::Clean => return Some(slot),
            Candidate::Dirty => {
                self.first_dirty.get_or_insert(slot);
            }
        }
        self.seen += 1;
        if self.seen >= CLEAN_SEARCH_WINDOW {
            return self.first_dirty;
        }
        None
    }

    /// The fallback once every candidate was offered.
    pub(crate) fn finish(self) -> Option<usize> {
        self.first_dirty
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_gives_up_on_clean_after_the_window() {
        let mut pick = Pick::default();
        for slot in 0..CLEAN_SEARCH_WINDOW - 1 {
            assert_eq!(pick.offer(slot, Candidate::Dirty), None);
        }
        assert_eq!(pick.offer(99, Candidate::Busy), None);
        assert_eq!(pick.offer(100, Candidate::Dirty), Some(0));
    }
}
