//! Replacement policies: which resident entry a full cache gives up. They see slots by index
//! only; the cache tells them what happens to each slot and, when it needs room, whether each
//! candidate is clean, dirty or busy (a load or write-back in flight).

mod clock;
mod index_list;
mod lru;
mod pick;
mod two_queue;

pub(crate) use pick::Candidate;

use std::hash::Hash;

use crate::config::EvictionPolicy;

/// One of the policies, dispatched statically.
pub(crate) enum Policy<K> {
    Lru(lru::Lru),
    Clock(clock::Clock),
    TwoQueue(Box<two_queue::TwoQueue<K>>),
}

impl<K: Copy + Eq + Hash> Policy<K> {
    /// A policy for `slots` slots.
    pub(crate) fn new(kind: EvictionPolicy, slots: usize) -> Self {
        match kind {
            EvictionPolicy::Lru => Self::Lru(lru::Lru::new(slots)),
            EvictionPolicy::Clock => Self::Clock(clock::Clock::new(slots)),
            EvictionPolicy::TwoQueue => Self::TwoQueue(Box::new(two_queue::TwoQueue::new(slots))),
        }
    }

    /// `slot` now holds `key` (freshly loaded or created).
    pub(crate) fn inserted(&mut self, slot: usize, key: K) {
        match self {
            Self::Lru(p) => p.inserted(slot),
            Self::Clock(p) => p.inserted(slot),
            Self::TwoQueue(p) => p.inserted(slot, key),
        }
    }

    /// `slot` was used.
    #[inline]
    pub(crate) fn accessed(&mut self, slot: usize) {
        match self {
            Self::Lru(p) => p.accessed(slot),
            Self::Clock(p) => p.accessed(slot),
            Self::TwoQueue(p) => p.accessed(slot),
        }
    }

    /// `slot` (holding `key`) left the cache; `evicted` when it was pushed out for room.
    pub(crate) fn removed(&mut self, slot: usize, key: K, evicted: bool) {
        match self {
            Self::Lru(p) => p.removed(slot),
            Self::Clock(p) => p.removed(slot),
            Self::TwoQueue(p) => p.removed(slot, key, evicted),
        }
    }

    /// The slot to evict, or `None` when every resident slot is busy.
    pub(crate) fn victim(&mut self, state: impl Fn(usize) -> Candidate) -> Option<usize> {
        match self {
            Self::Lru(p) => p.victim(state),
            Self::Clock(p) => p.victim(state),
            Self::TwoQueue(p) => p.victim(state),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_policies(slots: usize) -> Vec<Policy<u32>> {
        [
            EvictionPolicy::Lru,
            EvictionPolicy::Clock,
            EvictionPolicy::TwoQueue,
        ]
        .into_iter()
        .map(|kind| Policy::new(kind, slots))
        .collect()
    }

    #[test]
    fn every_policy_prefers_clean_and_skips_busy() {
        for mut policy in all_policies(8) {
            for slot in 0..8 {
                policy.inserted(slot, u32::try_from(slot).expect("small"));
            }
            // Slot 0..3 busy, 4..5 dirty, 6..7 clean.
            let state = |s: usize| match s {
                0..=3 => Candidate::Busy,
                4 | 5 => Candidate::Dirty,
                _ => Candidate::Clean,
            };
            let v = policy.victim(state).expect("victim");
            assert!(v >= 6, "picked {v}");
            // Only dirty ones left: one of them.
            let v = policy.victim(|s| {
                if s < 4 {
                    Candidate::Busy
                } else {
                    Candidate::Dirty
                }
            });
            assert!(matches!(v, Some(4..=7)), "picked {v:?}");
            assert_eq!(policy.victim(|_| Candidate::Busy), None);
        }
    }

    #[test]
    fn every_policy_forgets_removed_slots() {
        for mut policy in all_policies(4) {
            for slot in 0..4 {
                policy.inserted(slot, u32::try_from(slot).expect("small"));
            }
            for slot in [0, 2, 3] {
                policy.removed(slot, u32::try_from(slot).expect("small"), true);
            }
            assert_eq!(policy.victim(|_| Candidate::Clean), Some(1));
            policy.removed(1, 1, false);
            assert_eq!(policy.victim(|_| Candidate::Clean), None);
        }
    }
}
