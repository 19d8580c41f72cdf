//! What every operation of an open image stands on: the image's shared state and how it is
//! opened, the layers of the chain and how a guest range resolves through them, the metadata
//! caches, the guest-range locks, errors, and the rules and codecs the operations share.
//!
//! - `image`: [`Image`](super::Image), the public handle, and `Inner`, the state one open
//!   image's requests share (its fields are private to `image`);
//! - `open`, `load`, `layer`, `cache_sizing`, `backing_name`: opening a chain;
//! - `chain`: which layer provides each guest byte, and where;
//! - `metacache`: the L2 and refcount caches' keys and backends;
//! - `range_lock`: the guest-cluster locks requests wait on;
//! - `overlap`: where metadata lives, so that no write lands on it;
//! - `bitmaps`: the persistent bitmaps in memory;
//! - `compress`, `span_pool`, `join_all`, `error`: shared helpers.

pub mod backing_name;
pub(crate) mod bitmaps;
pub(crate) mod cache_sizing;
pub(crate) mod chain;
pub mod compress;
pub(crate) mod error;
pub(crate) mod image;
pub(crate) mod join_all;
pub(crate) mod layer;
pub(crate) mod load;
pub(crate) mod metacache;
pub(crate) mod open;
pub(crate) mod overlap;
pub mod range_lock;
pub(crate) mod span_pool;
