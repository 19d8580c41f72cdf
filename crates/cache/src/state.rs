//! The cache's bookkeeping: which slot holds which key, in which phase, how dirty, and who
//! waits for it. Everything here is synchronous; the async operations in the other modules
//! borrow this state only between `.await`s.

use std::collections::HashMap;
use std::hash::Hash;

use crate::config::{CacheStats, EvictionPolicy};
use crate::event::LazyEvent;
use crate::pages::DirtyPages;
use crate::policy::{Candidate, Policy};

/// Where a slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Holds nothing; counted out of the budget.
    Free,
    /// Reserved for a key whose bytes are being read; only the loading task touches them.
    Loading,
    /// Holds the key's bytes.
    Ready,
}

/// One entry's slot in the arena.
pub(crate) struct Slot<K> {
    pub(crate) key: Option<K>,
    pub(crate) phase: Phase,
    /// Modified since the last write-back started.
    pub(crate) dirty: bool,
    /// The pages modified since the last write-back started (empty exactly when `dirty` is
    /// false).
    pub(crate) pages: DirtyPages,
    /// A write-back of (a copy of) this entry is in flight.
    pub(crate) writing: bool,
    /// Dropped by `forget` while a load or write-back was in flight; freed when it ends.
    pub(crate) forgotten: bool,
    /// Accessed since the last idle cleaning.
    pub(crate) used: bool,
    /// Count of modifications since the slot was filled.
    pub(crate) version: u64,
    /// The `version` whose bytes last reached the backend.
    pub(crate) written: u64,
    /// Distinguishes successive occupants of the slot, so a task that waited can tell
    /// whether the entry it was working on is still there.
    pub(crate) residency: u64,
    /// Woken when a load or write-back of this slot ends or the slot is freed.
    pub(crate) changed: LazyEvent,
}

impl<K> Slot<K> {
    fn empty() -> Self {
        Self {
            key: None,
            phase: Phase::Free,
            dirty: false,
            pages: DirtyPages::default(),
            writing: false,
            forgotten: false,
            used: false,
            version: 0,
            written: 0,
            residency: 0,
            changed: LazyEvent::default(),
        }
    }

    /// Whether (and how) the slot could be evicted now.
    pub(crate) fn candidate(&self) -> Candidate {
        if self.phase != Phase::Ready || self.writing || self.forgotten {
            Candidate::Busy
        } else if self.dirty {
            Candidate::Dirty
        } else {
            Candidate::Clean
        }
    }

    /// Resident, usable and not going away.
    pub(crate) fn is_live(&self) -> bool {
        self.phase == Phase::Ready && !self.forgotten
    }
}

/// What `make_room` found.
pub(crate) enum Room {
    /// This slot is now free for the caller, who must `occupy` it at once.
    Slot(usize),
    /// Full; this dirty entry (of that residency) must be written back first.
    WriteBack(usize, u64),
    /// Full, and every slot is busy: wait for `room`.
    Full,
}

/// Counters kept as the cache runs.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) evictions: u64,
    pub(crate) idle_drops: u64,
    pub(crate) write_backs: u64,
}

pub(crate) struct State<K> {
    pub(crate) map: HashMap<K, usize>,
    pub(crate) slots: Vec<Slot<K>>,
    /// Free slots; the last one is reused first.
    pub(crate) free: Vec<usize>,
    pub(crate) policy: Policy<K>,
    pub(crate) counters: Counters,
    /// Slots not `Free`.
    pub(crate) occupied: usize,
    /// Woken whenever a slot may have become free or evictable.
    pub(crate) room: LazyEvent,
    next_residency: u64,
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

impl<K: Copy + Eq + Hash> State<K> {
    pub(crate) fn new(slots: usize, policy: EvictionPolicy) -> Self {
        Self {
            map: HashMap::with_capacity(slots),
            slots: (0..slots).map(|_| Slot::empty()).collect(),
            // Reversed, so that slot 0 is used first and memory stays compact.
            free: (0..slots).rev().collect(),
            policy: Policy::new(policy, slots),
            counters: Counters::default(),
            occupied: 0,
            room: LazyEvent::default(),
            next_residency: 1,
        }
    }

    /// Find a slot for a new key: a free one, else an evicted clean one.
    pub(crate) fn make_room(&mut self) -> Room {
        if let Some(idx) = self.free.pop() {
            return Room::Slot(idx);
        }
        let slots = &self.slots;
        match self.policy.victim(|i| slots[i].candidate()) {
            None => Room::Full,
            Some(idx) if self.slots[idx].dirty => Room::WriteBack(idx, self.slots[idx].residency),
            Some(idx) => {
                self.drop_resident(idx, true);
                self.counters.evictions += 1;
                match self.free.pop() {
                    Some(idx) => Room::Slot(idx),
                    None => Room::Full,
                }
            }
        }
    }

    /// Reserve the free slot `idx` for `key`, in the `Loading` phase; returns its residency.
    pub(crate) fn occupy(&mut self, idx: usize, key: K) -> u64 {
        let residency = self.next_residency;
        self.next_residency += 1;
        let slot = &mut self.slots[idx];
        slot.key = Some(key);
        slot.phase = Phase::Loading;
        slot.dirty = false;
        slot.pages.clear();
        slot.writing = false;
        slot.forgotten = false;
        slot.used = true;
        slot.version = 0;
        slot.written = 0;
        slot.residency = residency;
        self.map.insert(key, idx);
        self.occupied += 1;
        residency
    }

    /// A load finished: the slot holds its key's bytes and may be evicted from now on.
    pub(crate) fn make_ready(&mut self, idx: usize) {
        let slot = &mut self.slots[idx];
        slot.phase = Phase::Ready;
        slot.changed.notify();
        if let Some(key) = slot.key {
            self.policy.inserted(idx, key);
        }
        self.room.notify();
    }

    /// Drop a resident (`Ready`, not writing) entry without writing it back.
    pub(crate) fn drop_resident(&mut self, idx: usize, evicted: bool) {
        if let Some(key) = self.slots[idx].key {
            self.policy.removed(idx, key, evicted);
        }
        self.free_slot(idx);
    }

    /// Return a slot to the free list (the policy must already have forgotten it).
    pub(crate) fn free_slot(&mut self, idx: usize) {
        let slot = &mut self.slots[idx];
        if slot.phase == Phase::Free {
            return;
        }
        if let Some(key) = slot.key.take() {
            if self.map.get(&key) == Some(&idx) {
                self.map.remove(&key);
            }
        }
        slot.phase = Phase::Free;
        slot.dirty = false;
        slot.pages.clear();
        slot.writing = false;
        slot.forgotten = false;
        slot.used = false;
        slot.changed.notify();
        self.free.push(idx);
        self.occupied -= 1;
        self.room.notify();
    }

    /// Stop caching every key `pred` matches, without writing anything back. Entries with a
    /// load or write-back in flight stay (and keep their key, so that nobody starts a second
    /// I/O on the same key) until it ends.
    pub(crate) fn forget(&mut self, pred: impl Fn(&K) -> bool) {
        let matching: Vec<usize> = self
            .map
            .iter()
            .filter(|(key, _)| pred(key))
            .map(|(_, &idx)| idx)
            .collect();
        for idx in matching {
            let slot = &mut self.slots[idx];
            if slot.forgotten {
                continue;
            }
            match slot.phase {
                Phase::Free => {}
                Phase::Ready if !slot.writing => self.drop_resident(idx, false),
                Phase::Ready => {
                    slot.forgotten = true;
                    slot.dirty = false;
                    slot.pages.clear();
                    if let Some(key) = slot.key {
                        self.policy.removed(idx, key, false);
                    }
                }
                Phase::Loading => slot.forgotten = true,
            }
        }
    }

    /// A write-back of `version` of slot `idx` ended; `unwritten` holds the pages it was to
    /// write if it failed.
    pub(crate) fn finish_write(
        &mut self,
        idx: usize,
        residency: u64,
        version: u64,
        unwritten: Option<&DirtyPages>,
    ) {
        let slot = &mut self.slots[idx];
        if slot.residency != residency || !slot.writing {
            return;
        }
        slot.writing = false;
        match unwritten {
            None => {
                slot.written = slot.written.max(version);
                self.counters.write_backs += 1;
            }
            Some(pages) if !slot.forgotten => {
                // The bytes did not reach the backend: they are still to be written.
                slot.dirty = true;
                slot.pages.merge(pages);
            }
            Some(_) => {}
        }
        slot.changed.notify();
        if slot.forgotten {
            self.free_slot(idx);
        }
        self.room.notify();
    }

    pub(crate) fn stats(&self, entry_size: usize) -> CacheStats {
        let c = &self.counters;
        let dirty = self.slots.iter().filter(|s| s.dirty).count();
        CacheStats {
            hits: c.hits,
            misses: c.misses,
            evictions: c.evictions,
            idle_drops: c.idle_drops,
            write_backs: c.write_backs,
            bytes_in_use: to_u64(self.occupied).saturating_mul(to_u64(entry_size)),
            entries: to_u64(self.occupied),
            dirty: to_u64(dirty),
            capacity: to_u64(self.slots.len()).saturating_mul(to_u64(entry_size)),
        }
    }
}
