//! Simplified 2Q (Johnson & Shasha, VLDB 1994): new entries enter a FIFO (`a1in`, a quarter
//! of the slots); entries evicted from it are remembered by key only (`a1out`, half the slot
//! count); an entry loaded again while remembered goes to the main LRU (`am`). Entries used
//! only in a burst, like the slices a sequential scan walks through, never reach `am`.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use super::index_list::IndexList;
use super::pick::{Candidate, Pick};

pub(crate) struct TwoQueue<K> {
    a1in: IndexList,
    am: IndexList,
    in_am: Vec<bool>,
    /// Remembered keys, each with the stamp of its latest entry in `ghost_order`.
    ghosts: HashMap<K, u64>,
    ghost_order: VecDeque<(K, u64)>,
    next_stamp: u64,
    a1in_target: usize,
    ghost_limit: usize,
}

impl<K: Copy + Eq + Hash> TwoQueue<K> {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            a1in: IndexList::new(slots),
            am: IndexList::new(slots),
            in_am: vec![false; slots],
            ghosts: HashMap::new(),
            ghost_order: VecDeque::new(),
            next_stamp: 0,
            a1in_target: (slots / 4).max(1),
            ghost_limit: (slots / 2).max(1),
        }
    }

    pub(crate) fn inserted(&mut self, slot: usize, key: K) {
        let Some(in_am) = self.in_am.get_mut(slot) else {
            return;
        };
        if self.ghosts.remove(&key).is_some() {
            *in_am = true;
            self.am.push_front(slot);
        } else {
            *in_am = false;
            self.a1in.push_front(slot);
        }
    }

    #[inline]
    pub(crate) fn accessed(&mut self, slot: usize) {
        if self.in_am.get(slot).copied().unwrap_or(false) {
            self.am.move_to_front(slot);
        }
    }

    pub(crate) fn removed(&mut self, slot: usize, key: K, evicted: bool) {
        if self.a1in.contains(slot) {
            self.a1in.remove(slot);
            if evicted {
                self.remember(key);
            }
        } else {
            self.am.remove(slot);
        }
        if let Some(in_am) = self.in_am.get_mut(slot) {
            *in_am = false;
        }
    }

    fn remember(&mut self, key: K) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.ghosts.insert(key, stamp);
        self.ghost_order.push_back((key, stamp));
        while self.ghosts.len() > self.ghost_limit {
            let Some((old, old_stamp)) = self.ghost_order.pop_front() else {
                break;
            };
            if self.ghosts.get(&old) == Some(&old_stamp) {
                self.ghosts.remove(&old);
            }
        }
        // Drop stale order records so the queue cannot grow without bound.
        if self.ghost_order.len() > 2 * self.ghost_limit + 16 {
            let ghosts = &self.ghosts;
            self.ghost_order
                .retain(|(k, stamp)| ghosts.get(k) == Some(stamp));
        }
    }

    pub(crate) fn victim(&mut self, state: impl Fn(usize) -> Candidate) -> Option<usize> {
        let from_a1in_first = self.a1in.len() > self.a1in_target || self.am.len() == 0;
        let (first, second) = if from_a1in_first {
            (&self.a1in, &self.am)
        } else {
            (&self.am, &self.a1in)
        };
        for list in [first, second] {
            let mut pick = Pick::default();
            for slot in list.iter_from_back() {
                if let Some(victim) = pick.offer(slot, state(slot)) {
                    return Some(victim);
                }
            }
            if let Some(victim) = pick.finish() {
                return Some(victim);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reloaded_keys_are_promoted_and_scans_stay_in_the_fifo() {
        let mut p: TwoQueue<u32> = TwoQueue::new(4); // a1in target 1, 2 ghosts
        let mut keys = [10, 11, 12, 13];
        for (slot, key) in keys.iter().enumerate() {
            p.inserted(slot, *key);
        }
        let mut replace = |p: &mut TwoQueue<u32>, key: u32| {
            let v = p.victim(|_| Candidate::Clean).expect("victim");
            p.removed(v, keys[v], true);
            keys[v] = key;
            p.inserted(v, key);
            v
        };
        // All four sit in a1in: its oldest goes first, and is remembered.
        assert_eq!(replace(&mut p, 14), 0);
        // Key 10 comes back while remembered: it goes to am.
        let hot = replace(&mut p, 10);
        assert!(p.in_am[hot]);
        // A long scan of new keys churns through a1in and leaves the hot entry alone.
        for key in 100..200 {
            assert_ne!(replace(&mut p, key), hot, "scan evicted the hot entry");
        }
        assert!(p.ghosts.len() <= 2);
        assert!(p.ghost_order.len() <= 2 * 2 + 16);
    }
}
