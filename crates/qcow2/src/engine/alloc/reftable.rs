//! The refcount table as the allocator holds it: the entries up to the last one that names a
//! refcount block, and how many entries the table has room for in the file. The table fills
//! whole clusters, so a 2 MiB-cluster image has a 2 MiB table of which a few words are used;
//! holding only those keeps the rest out of memory.

/// Block offset per refcount-table index (0 = no block), with the table's capacity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RefTable {
    /// Entries `0..used.len()`; every entry past them is 0.
    used: Vec<u64>,
    /// Entries the table has room for.
    capacity: usize,
}

impl RefTable {
    /// A table of `entries.len()` entries holding `entries`.
    pub(super) fn from_entries(mut entries: Vec<u64>) -> Self {
        let capacity = entries.len();
        let used = entries.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        entries.truncate(used);
        entries.shrink_to_fit();
        RefTable {
            used: entries,
            capacity,
        }
    }

    /// A table of `capacity` entries whose first ones are `used` (the rest are 0).
    pub(super) fn from_prefix(used: Vec<u64>, capacity: usize) -> Self {
        let mut t = Self::from_entries(used);
        t.capacity = capacity.max(t.used.len());
        t
    }

    /// Entries the table has room for.
    pub(super) fn len(&self) -> usize {
        self.capacity
    }

    /// Entry `index`, or `None` past the table's capacity.
    pub(super) fn get(&self, index: usize) -> Option<u64> {
        (index < self.capacity).then(|| self.used.get(index).copied().unwrap_or(0))
    }

    /// Sets entry `index` (which must be below the capacity; an index past it is ignored,
    /// since the table in the file has no room for it either).
    pub(super) fn set(&mut self, index: usize, block: u64) {
        if index >= self.capacity {
            return;
        }
        if index >= self.used.len() {
            if block == 0 {
                return;
            }
            self.used.resize(index + 1, 0);
        }
        self.used[index] = block;
    }

    /// The entries up to the last non-zero one (every later entry is 0).
    pub(super) fn used(&self) -> &[u64] {
        &self.used
    }

    /// Every entry, the zeros past the used ones included: the table as the file holds it.
    pub(super) fn to_vec(&self) -> Vec<u64> {
        let mut all = self.used.clone();
        all.resize(self.capacity, 0);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_used_prefix_is_held_and_every_entry_reads_as_the_file_has_it() {
        let mut entries = vec![0u64; 262_144];
        entries[0] = 0x20_0000;
        entries[2] = 0x40_0000;
        let t = RefTable::from_entries(entries.clone());
        assert_eq!(t.used(), &[0x20_0000, 0, 0x40_0000]);
        assert_eq!(t.len(), 262_144);
        assert_eq!(t.get(2), Some(0x40_0000));
        assert_eq!(t.get(262_143), Some(0));
        assert_eq!(t.get(262_144), None);
        assert_eq!(t.to_vec(), entries);
    }

    #[test]
    fn setting_grows_the_prefix_only_for_blocks_and_never_past_the_capacity() {
        let mut t = RefTable::from_entries(vec![0; 16]);
        assert!(t.used().is_empty());
        t.set(9, 0);
        assert!(t.used().is_empty());
        t.set(5, 0x1000);
        assert_eq!(t.used().len(), 6);
        t.set(16, 0x2000);
        assert_eq!(t.get(16), None);
        assert_eq!(t.used().len(), 6);
        let p = RefTable::from_prefix(vec![7, 0, 0], 4);
        assert_eq!((p.used(), p.len()), (&[7u64][..], 4));
    }
}
