//! A QEMU-compatible metadata cache for qcow2 L2 slices and refcount blocks.
//!
//! Sizes follow QEMU exactly: [`resolve_sizes`] turns `l2-cache-size`, `l2-cache-entry-size`,
//! `refcount-cache-size`, `cache-size` and `cache-clean-interval` into cache sizes, and
//! [`parse_size`] reads size strings as QEMU does.

mod config;
mod size_string;
mod sizing;

pub use config::{CacheConfig, CacheStats, EvictionPolicy};
pub use size_string::parse_size;
pub use sizing::{
    resolve_sizes, CacheOptions, ImageParams, ResolvedCacheSizes, SizeError,
    DEFAULT_CACHE_CLEAN_INTERVAL, DEFAULT_L2_CACHE_MAX_SIZE, MAX_CACHE_ENTRIES, MAX_CLUSTER_SIZE,
    MIN_CLUSTER_SIZE, MIN_L2_CACHE_ENTRIES, MIN_REFCOUNT_CACHE_CLUSTERS, SMALL_L2_ENTRY_SIZE,
};
