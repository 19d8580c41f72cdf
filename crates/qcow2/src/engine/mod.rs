//! The qcow2 image engine: open an image and its backing chain over the [`storage`] seam, and
//! read, write, zero, discard, flush and query block status, with metadata cached by the
//! [`cache`] crate.
//!
//! One image is driven by one thread (a tokio current-thread runtime with a `LocalSet`): many
//! requests are in flight at once, metadata needs no locks because every change to a cached
//! table is a synchronous closure, and requests wait for each other only where they touch the
//! same guest clusters while one of them changes where those clusters live
//! ([`range_lock`]), where the allocator's metadata is in use, and where a cache entry is
//! being loaded.
//!
//! Folders, from the bottom up:
//! - `infra`: the open image's shared state (`image`: [`Image`] and its private `Inner`), opening
//!   and loading files, the layers and how a guest range resolves through them (`chain`), the
//!   metadata caches, range locks, errors, codecs and backing-name rules;
//! - `alloc`: the allocator, the one owner of refcounts and of every change to where guest
//!   clusters live;
//! - `read`: guest reads, sparse reads and block status;
//! - `write`: guest writes, zeroing, discard, compressed writes, flush and preallocation;
//! - `metadata_ops`: whole-image operations (create, snapshots, amend, resize, bitmaps, the
//!   backing name, emptying for commit, LUKS key slots).
//!
//! docs/ARCHITECTURE.md says which module answers which question and walks one read and
//! one allocating write through them.

mod alloc;
pub(crate) mod infra;
mod metadata_ops;
mod read;
#[cfg(test)]
mod tests;
mod write;

pub use crate::declared::Untrusted;
pub use crate::format::{GuestOffset, HostOffset};
pub use infra::bitmaps::{BitmapError, BitmapInfo};
pub use infra::cache_sizing::{
    resolve_sizes, CacheOptions, CacheSizeError, ImageParams, ResolvedCacheSizes,
    DEFAULT_CACHE_CLEAN_INTERVAL, DEFAULT_L2_CACHE_MAX_SIZE, MAX_CACHE_ENTRIES, MAX_CLUSTER_SIZE,
    MIN_CLUSTER_SIZE, MIN_L2_CACHE_ENTRIES, MIN_REFCOUNT_CACHE_CLUSTERS, SMALL_L2_ENTRY_SIZE,
};
pub use infra::error::{libc_errno, EngineError, Result};
pub use infra::image::{Image, ImageFacts};
pub use infra::load::Format;
pub use infra::metacache::{MetaCacheCounters, MetaCacheStats};
pub use infra::open::OpenOptions;
pub use infra::{backing_name, compress, range_lock};
pub use metadata_ops::amend::{AmendError, AmendOptions};
pub use metadata_ops::create::{create, create_file, CreateOptions, NewEncryption, Preallocation};
pub use metadata_ops::resize::ResizeError;
pub use metadata_ops::snapshot::SnapshotError;
pub use read::block_status::Extent;
pub use read::sparse::ReadPart;
pub use write::compressed::{ClusterCompressor, PackedCluster};
