//! The qcow2 image engine: open an image and its backing chain over the [`storage`] seam, and
//! read, write, zero, discard, flush and query block status, with metadata cached by the
//! [`cache`] crate.
//!
//! One image is driven by one thread (a tokio current-thread runtime with a `LocalSet`): many
//! requests are in flight at once, metadata needs no locks because every change to a cached
//! table is a synchronous closure, and requests wait for each other only where they touch the
//! same guest clusters while one of them changes where those clusters live
//! ([`range_lock`]).
//!
//! docs/ARCHITECTURE.md says which module answers which question and walks one read and
//! one allocating write through them.

mod alloc;
mod amend;
pub mod backing_name;
mod bitmap_ops;
mod bitmaps;
mod block_status;
mod cache_sizing;
mod chain;
pub mod check;
pub mod compress;
mod create;
mod discard;
mod error;
mod flush;
mod image;
mod join_all;
mod key_slots;
mod layer;
mod load;
mod make_empty;
mod metacache;
mod open;
mod overlap;
mod prealloc_detect;
mod preallocate;
pub mod range_lock;
mod read;
mod read_sparse;
mod resize;
mod set_backing;
mod snapshot_ops;
mod span_pool;
mod write;
mod write_compressed;
mod zero;

pub use crate::declared::Untrusted;
pub use crate::format::{GuestOffset, HostOffset};
pub use amend::{AmendError, AmendOptions};
pub use bitmaps::{BitmapError, BitmapInfo};
pub use block_status::Extent;
pub use cache_sizing::{
    resolve_sizes, CacheOptions, CacheSizeError, ImageParams, ResolvedCacheSizes,
    DEFAULT_CACHE_CLEAN_INTERVAL, DEFAULT_L2_CACHE_MAX_SIZE, MAX_CACHE_ENTRIES, MAX_CLUSTER_SIZE,
    MIN_CLUSTER_SIZE, MIN_L2_CACHE_ENTRIES, MIN_REFCOUNT_CACHE_CLUSTERS, SMALL_L2_ENTRY_SIZE,
};
pub use create::{create, create_file, CreateOptions, NewEncryption, Preallocation};
pub use error::{libc_errno, EngineError, Result};
pub use image::{Image, ImageFacts};
pub use load::Format;
pub use metacache::{MetaCacheCounters, MetaCacheStats};
pub use open::OpenOptions;
pub use read_sparse::ReadPart;
pub use resize::ResizeError;
pub use snapshot_ops::SnapshotError;
pub use write_compressed::{ClusterCompressor, PackedCluster};
