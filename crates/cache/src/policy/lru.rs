//! Least recently used, QEMU's policy: every hit moves the entry to the front of a list.

use super::index_list::IndexList;
use super::pick::{Candidate, Pick};

pub(crate) struct Lru {
    list: IndexList,
}

impl Lru {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            list: IndexList::new(slots),
        }
    }

    pub(crate) fn inserted(&mut self, slot: usize) {
        self.list.push_front(slot);
    }

    #[inline]
    pub(crate) fn accessed(&mut self, slot: usize) {
        self.list.move_to_front(slot);
    }

    pub(crate) fn removed(&mut self, slot: usize) {
        self.list.remove(slot);
    }

    pub(crate) fn victim(&mut self, state: impl Fn(usize) -> Candidate) -> Option<usize> {
        let mut pick = Pick::default();
        for slot in self.list.iter_from_back() {
            if let Some(victim) = pick.offer(slot, state(slot)) {
                return Some(victim);
            }
        }
        pick.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut p = Lru::new(3);
        for s in 0..3 {
            p.inserted(s);
        }
        p.accessed(0);
        assert_eq!(p.victim(|_| Candidate::Clean), Some(1));
        p.accessed(1);
        assert_eq!(p.victim(|_| Candidate::Clean), Some(2));
    }
}
