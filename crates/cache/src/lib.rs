//! A QEMU-compatible metadata cache for qcow2 L2 slices and refcount blocks.
//!
//! A [`Cache`] holds fixed-size entries (slices of L2 tables, refcount blocks) of one
//! image layer, keyed by anything `Copy + Eq + Hash + Debug` (for example a layer id and a
//! table offset, so that a whole backing chain can share one budget). It loads entries
//! through a [`Backend`], hands out borrowed access to their bytes, writes dirty entries back
//! before it drops them, and orders its write-backs after those of other caches it depends on
//! ([`Cache::set_dependency`], [`Cache::set_flush_before_writeback`]).
//!
//! It is built for one thread running many tasks (a tokio current-thread runtime with a
//! `LocalSet`): two tasks missing the same key share one load, an entry can be read and
//! modified while a copy of it is being written back, the byte budget holds while loads and
//! write-backs are in flight, and no borrow is held across an `.await`.
//!
//! A cache is given its byte budget and entry size ([`CacheConfig`]); how big an image's
//! caches should be (QEMU's `l2-cache-size`, `cache-size` and friends) is decided by the qcow2
//! engine, which knows the image geometry those rules depend on. Idle entries can be dropped
//! and their memory returned to the OS ([`Cache::clean_idle`], [`Cache::idle_cleaner`]).
//!
//! # Example
//!
//! ```
//! use std::cell::RefCell;
//! use std::collections::HashMap;
//! use cache::{Backend, Cache, CacheConfig};
//!
//! /// Tables in memory, keyed by offset.
//! #[derive(Default)]
//! struct Disk(RefCell<HashMap<u64, Vec<u8>>>);
//!
//! impl Backend<u64> for Disk {
//!     async fn load(&self, key: u64, buf: &mut [u8]) -> std::io::Result<()> {
//!         match self.0.borrow().get(&key) {
//!             Some(bytes) => buf.copy_from_slice(bytes),
//!             None => buf.fill(0),
//!         }
//!         Ok(())
//!     }
//!     type Snapshot = Vec<u8>;
//!     fn snapshot(&self, data: &[u8]) -> Vec<u8> {
//!         data.to_vec()
//!     }
//!     async fn write_back(&self, key: u64, at: usize, data: Vec<u8>) -> std::io::Result<()> {
//!         let mut disk = self.0.borrow_mut();
//!         let entry = disk.entry(key).or_insert_with(|| vec![0; 4096]);
//!         entry[at..at + data.len()].copy_from_slice(&data);
//!         Ok(())
//!     }
//!     async fn flush(&self) -> std::io::Result<()> {
//!         Ok(())
//!     }
//! }
//!
//! let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! tokio::task::LocalSet::new().block_on(&rt, async {
//!     // Two 4 KiB entries.
//!     let l2 = Cache::new(CacheConfig::new("l2", 4096, 8192), Disk::default()).unwrap();
//!     l2.create(0x10000, |slice| slice[..8].copy_from_slice(&0x5_0000u64.to_be_bytes()))
//!         .await
//!         .unwrap();
//!     let entry = l2
//!         .read(0x10000, |slice| u64::from_be_bytes(slice[..8].try_into().unwrap()))
//!         .await
//!         .unwrap();
//!     assert_eq!(entry, 0x5_0000);
//!     // Two more tables: the cache is full, and the clean entry is evicted, not the dirty one.
//!     l2.read(0x20000, |_| ()).await.unwrap();
//!     l2.read(0x30000, |_| ()).await.unwrap();
//!     assert!(l2.contains(&0x10000) && !l2.contains(&0x20000));
//!     // Flushing writes the dirty entry back.
//!     l2.flush().await.unwrap();
//!     assert_eq!(l2.backend().0.borrow()[&0x10000][..8], 0x5_0000u64.to_be_bytes());
//!     let stats = l2.stats();
//!     assert_eq!((stats.misses, stats.evictions, stats.write_backs), (2, 1, 1));
//! });
//! ```
//!
//! # How it works
//!
//! - **Memory.** Each cache owns one anonymous `mmap` of its whole budget, cut into slots of
//!   `entry_size` bytes. Untouched slots cost no memory; [`Cache::clean_idle`] gives the
//!   pages of freed slots back with `madvise(MADV_DONTNEED)`, as QEMU does. The budget counts
//!   slots, including those reserved for loads in flight, so it is never exceeded; the only
//!   memory outside it is the copy of an entry made for each write-back in flight.
//! - **Concurrency.** A miss reserves a slot and records the key as loading before it
//!   awaits the backend; a second task missing the same key waits for that load instead of
//!   issuing its own. A write-back copies the entry, clears its dirty flag and writes the
//!   copy, so the entry stays readable and writable meanwhile and stays dirty if modified; a
//!   failed (or cancelled) write-back marks it dirty again. At most one write-back per entry
//!   is in flight. An entry [forgotten](Cache::forget) while its I/O is in flight keeps its
//!   key busy until that I/O ends, so a new table at the same place is never written
//!   before an old write lands.
//! - **Ordering.** QEMU's dependencies: see [`Cache::set_dependency`] and
//!   [`Cache::set_flush_before_writeback`]. A chain of dependencies is kept one link long by flushing when a new link
//!   would extend it (as QEMU does), so cycles cannot form and flushes cannot deadlock.
//! - **Eviction.** The policy (default: 2Q) names candidates, coldest first; the first clean
//!   one among the 16 coldest is dropped, else the coldest dirty one is written back first.
//!
//! # Choosing the eviction policy
//!
//! 2Q is the default: on replayed L2-slice traces (`cargo bench -p cache`) it misses less
//! often than LRU when accesses are skewed and a sequential scan runs beside them, and gives up
//! almost nothing when accesses are uniform, where no policy helps. Its extra bookkeeping on a
//! miss costs a fraction of the read that the miss costs. LRU and CLOCK remain available
//! through [`EvictionPolicy`]. The measured hit ratios and costs are in `benches/RESULTS.md`.

mod arena;
mod cache;
mod config;
mod dependency;
mod error;
mod event;
mod flush;
mod idle;
mod pages;
mod policy;
mod state;
mod write_back;

pub use cache::{Backend, Cache};
pub use config::{CacheConfig, CacheStats, EvictionPolicy};
pub use error::CacheError;
pub use flush::{Flush, FlushFuture};
pub use pages::PAGE;
