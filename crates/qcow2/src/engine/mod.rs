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
//! Files: `open` (opening and validating a chain), `layer` (one file of the chain), `map`
//! (guest range → runs through one layer's L2 entries), `resolve` (through the whole chain),
//! `read`, `block_status`, `metacache` (cache keys and backends), `compress` (codecs),
//! `range_lock`, `backing_name` (which backing names we follow); the write side: `writer`
//! (refcount table, header bits), `refcount` (refcounts and the allocator), `l2_table`
//! (writable L2 tables), `l2_entry` (entry updates), `write` (allocation and copy-on-write),
//! `zero`, `discard`, `flush`, `overlap` (where metadata lives, which neither guest data nor
//! the checker's repairs may overwrite).

mod alloc;
pub mod backing_name;
mod block_status;
mod chain;
pub mod check;
pub mod compress;
mod create;
mod discard;
mod error;
mod flush;
mod image;
mod join_all;
mod layer;
mod load;
mod metacache;
mod open;
mod overlap;
mod prealloc_detect;
pub mod range_lock;
mod read;
mod read_sparse;
mod resize;
mod write;
mod write_compressed;
mod zero;

pub use block_status::Extent;
pub use create::{create, create_file, CreateOptions, Preallocation};
pub use error::{libc_errno, EngineError, Result};
pub use image::{Image, ImageFacts};
pub use load::Format;
pub use open::OpenOptions;
pub use read_sparse::ReadPart;
