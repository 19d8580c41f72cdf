//! CLOCK (second chance): a hit only sets a bit; the hand sweeps the slots, clearing bits,
//! and takes the first slot whose bit was already clear.

use super::pick::{Candidate, Pick};

pub(crate) struct Clock {
    referenced: Vec<bool>,
    present: Vec<bool>,
    hand: usize,
}

impl Clock {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            referenced: vec![false; slots],
            present: vec![false; slots],
            hand: 0,
        }
    }

    pub(crate) fn inserted(&mut self, slot: usize) {
        if let (Some(p), Some(r)) = (self.present.get_mut(slot), self.referenced.get_mut(slot)) {
            *p = true;
            *r = true;
        }
    }

    #[inline]
    pub(crate) fn accessed(&mut self, slot: usize) {
        if let Some(r) = self.referenced.get_mut(slot) {
            *r = true;
        }
    }

    pub(crate) fn removed(&mut self, slot: usize) {
        if let (Some(p), Some(r)) = (self.present.get_mut(slot), self.referenced.get_mut(slot)) {
            *p = false;
            *r = false;
        }
    }

    pub(crate) fn victim(&mut self, state: impl Fn(usize) -> Candidate) -> Option<usize> {
        let n = self.present.len();
        let mut pick = Pick::default();
        // Two turns: the first may do nothing but clear reference bits.
        for _ in 0..2 * n {
            let slot = self.hand;
            self.hand = if slot + 1 == n { 0 } else { slot + 1 };
            if !self.present[slot] {
                continue;
            }
            let candidate = state(slot);
            if candidate == Candidate::Busy {
                continue;
            }
            if self.referenced[slot] {
                self.referenced[slot] = false;
                continue;
            }
            if let Some(victim) = pick.offer(slot, candidate) {
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
    fn gives_referenced_slots_a_second_chance() {
        let mut p = Clock::new(3);
        for s in 0..3 {
            p.inserted(s);
        }
        // All referenced: the first turn clears the bits, the second takes slot 0.
        assert_eq!(p.victim(|_| Candidate::Clean), Some(0));
        p.accessed(1);
        // Hand is at 1: 1 is referenced again, so 2 goes.
        assert_eq!(p.victim(|_| Candidate::Clean), Some(2));
    }
}
