//! What a cache is built with, and what it reports about itself.

/// How a full cache chooses the entry to drop; all of them prefer a clean entry among the
/// 16 coldest evictable ones. See the crate documentation for the measurements behind the
/// default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Least recently used (QEMU's policy), with a preference for clean entries.
    Lru,
    /// CLOCK (second chance): cheaper hits, LRU-like misses.
    Clock,
    /// Simplified 2Q: new entries wait in a FIFO and must be hit again (after leaving it)
    /// to reach the main LRU, which keeps one-off scans from flushing the hot set. The
    /// default: the best hit ratio on the L2 traces of the `cache` bench.
    #[default]
    TwoQueue,
}

/// Configuration of one cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Name used in errors and logs ("l2", "refcount", "backing-2 l2", ...).
    pub name: String,
    /// Bytes per entry (an L2 slice or a refcount block).
    pub entry_size: usize,
    /// Byte budget; the cache holds `capacity_bytes / entry_size` entries.
    pub capacity_bytes: u64,
    /// Replacement policy.
    pub policy: EvictionPolicy,
}

impl CacheConfig {
    /// A configuration with the default eviction policy.
    pub fn new(name: impl Into<String>, entry_size: usize, capacity_bytes: u64) -> Self {
        Self {
            name: name.into(),
            entry_size,
            capacity_bytes,
            policy: EvictionPolicy::default(),
        }
    }

    /// The same configuration with another eviction policy.
    pub fn with_policy(mut self, policy: EvictionPolicy) -> Self {
        self.policy = policy;
        self
    }
}

/// Counters and occupancy of one cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Accesses served from memory (including ones that waited for another task's load).
    pub hits: u64,
    /// Accesses that loaded the entry from the backend.
    pub misses: u64,
    /// Entries dropped to make room for others.
    pub evictions: u64,
    /// Entries dropped by idle cleaning.
    pub idle_drops: u64,
    /// Successful write-backs of dirty entries.
    pub write_backs: u64,
    /// Bytes of the budget occupied (resident entries and loads in flight).
    pub bytes_in_use: u64,
    /// Slots occupied (resident entries and loads in flight).
    pub entries: u64,
    /// Entries currently dirty (modified and not yet written back).
    pub dirty: u64,
    /// The byte budget actually usable: whole entries only.
    pub capacity: u64,
}
