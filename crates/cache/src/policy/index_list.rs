//! A doubly linked list threaded through slot indices (no allocation per entry), the building
//! block of the LRU and 2Q policies.

const NIL: u32 = u32::MAX;

/// Slots in recency order: front = most recent, back = least recent.
pub(crate) struct IndexList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

/// Slot indices are kept in `u32` to halve the links' memory; the cache refuses more slots.
fn idx(slot: usize) -> u32 {
    u32::try_from(slot).unwrap_or(NIL)
}

impl IndexList {
    /// An empty list over `slots` slots (`slots < u32::MAX`, checked by the cache).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            prev: vec![NIL; slots],
            next: vec![NIL; slots],
            linked: vec![false; slots],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, slot: usize) -> bool {
        self.linked.get(slot).copied().unwrap_or(false)
    }

    /// Link `slot` at the front (it must not be linked).
    pub(crate) fn push_front(&mut self, slot: usize) {
        if self.contains(slot) || slot >= self.linked.len() {
            return;
        }
        let s = idx(slot);
        self.prev[slot] = NIL;
        self.next[slot] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = s;
        } else {
            self.tail = s;
        }
        self.head = s;
        self.linked[slot] = true;
        self.len += 1;
    }

    /// Unlink `slot` if it is linked.
    pub(crate) fn remove(&mut self, slot: usize) {
        if !self.contains(slot) {
            return;
        }
        let (p, n) = (self.prev[slot], self.next[slot]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.prev[slot] = NIL;
        self.next[slot] = NIL;
        self.linked[slot] = false;
        self.len -= 1;
    }

    /// Make `slot` the most recent.
    #[inline]
    pub(crate) fn move_to_front(&mut self, slot: usize) {
        if self.head != idx(slot) {
            self.remove(slot);
            self.push_front(slot);
        }
    }

    /// Slots from the back (least recent) towards the front.
    pub(crate) fn iter_from_back(&self) -> impl Iterator<Item = usize> + '_ {
        let mut cur = self.tail;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let slot = cur as usize;
            cur = self.prev[slot];
            Some(slot)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(list: &IndexList) -> Vec<usize> {
        list.iter_from_back().collect()
    }

    #[test]
    fn keeps_recency_order() {
        let mut l = IndexList::new(5);
        for s in [0, 1, 2, 3] {
            l.push_front(s);
        }
        assert_eq!(order(&l), [0, 1, 2, 3]);
        l.move_to_front(1);
        assert_eq!(order(&l), [0, 2, 3, 1]);
        l.remove(0);
        l.remove(1);
        l.remove(4);
        assert_eq!(order(&l), [2, 3]);
        assert_eq!(l.len(), 2);
        l.push_front(2); // already linked: ignored
        assert_eq!(order(&l), [2, 3]);
        l.remove(2);
        l.remove(3);
        assert_eq!(order(&l), Vec::<usize>::new());
        l.push_front(4);
        assert_eq!(order(&l), [4]);
    }
}
