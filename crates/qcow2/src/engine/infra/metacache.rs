//! The metadata caches' keys and backends: L2 slices of every layer share one cache (one
//! memory budget for the whole chain), refcount blocks of the writable layer have their own.

use super::layer::{read_exact_into, Layer};
use crate::format::HostOffset;
use std::io;
use std::rc::Rc;
use storage::{Event, IoBuf, Storage};

/// A slice of an L2 table of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct L2Key {
    /// Layer index (0 = the opened image).
    pub layer: u32,
    /// File offset of the L2 table.
    pub table: HostOffset,
    /// Which slice of the table.
    pub slice: u32,
}

/// The L2 cache shared by every layer of a chain.
pub(crate) type L2Cache<S> = cache::Cache<L2Key, L2Backend<S>>;

/// The refcount-block cache of the writable layer.
pub(crate) type RefcountCache<S> = cache::Cache<RefcountKey, RefcountBackend<S>>;

/// What statistics report of one metadata cache: counters since the image was opened and
/// its occupancy now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaCacheCounters {
    /// Lookups answered from memory.
    pub hits: u64,
    /// Lookups that read the table from the file.
    pub misses: u64,
    /// Entries dropped to make room (idle cleaning not counted).
    pub evictions: u64,
    /// Bytes modified and not yet written back.
    pub dirty_bytes: u64,
    /// Bytes of the budget in use.
    pub memory_bytes: u64,
}

impl MetaCacheCounters {
    pub(crate) fn from_cache<K, B>(cache: &cache::Cache<K, B>) -> Self
    where
        K: Copy + Eq + std::hash::Hash + std::fmt::Debug,
        B: cache::Backend<K>,
    {
        let s = cache.stats();
        let entry = u64::try_from(cache.entry_size()).unwrap_or(u64::MAX);
        Self {
            hits: s.hits,
            misses: s.misses,
            evictions: s.evictions,
            dirty_bytes: s.dirty.saturating_mul(entry),
            memory_bytes: s.bytes_in_use,
        }
    }
}

/// The statistics of an image's metadata caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaCacheStats {
    /// The L2 cache every layer of the chain shares.
    pub l2: MetaCacheCounters,
    /// The refcount-block cache (all zero on an image that is not written: it has none).
    pub refcount: MetaCacheCounters,
}

/// Loads L2 slices from any layer; writes them back only to layer 0.
pub(crate) struct L2Backend<S> {
    pub layers: Rc<Vec<Layer<S>>>,
    pub slice_bytes: usize,
}

/// A refcount block of the writable layer, by file offset.
pub(crate) type RefcountKey = HostOffset;

/// Loads and writes back refcount blocks of layer 0.
pub(crate) struct RefcountBackend<S> {
    pub layers: Rc<Vec<Layer<S>>>,
    pub block_bytes: usize,
}

/// An engine error as the cache's I/O error, keeping the kind (a full disk stays "storage
/// full" on its way back up, so the client is told ENOSPC and not EIO).
fn to_io(e: super::error::EngineError) -> io::Error {
    use super::error::EngineError;
    let kind = match &e {
        EngineError::Io { source, .. } | EngineError::Open { source, .. } => source.kind(),
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e.to_string())
}

async fn write_all<S: Storage + 'static>(file: &S, data: IoBuf, offset: u64) -> io::Result<()> {
    let (res, _) = file.write_at(data.into(), offset).await;
    res
}

/// Makes the writable layer durable: its data file first (guest data written by copy-on-write
/// must be on disk before metadata that exposes it), then the image file. Once an fdatasync
/// has failed, every later one fails too (see [`Layer::sync_failed`]).
pub(crate) async fn flush_layer<S: Storage + 'static>(layer: &Layer<S>) -> io::Result<()> {
    if layer.sync_failed.get() {
        return Err(io::Error::other(
            "an earlier fdatasync failed, so writes since the last successful flush may be lost",
        ));
    }
    let synced = async {
        if let Some(meta) = layer.qcow2() {
            if let Some(data) = &meta.data_file {
                data.flush().await?;
            }
        }
        layer.file.flush().await
    }
    .await;
    if synced.is_err() {
        layer.sync_failed.set(true);
    }
    synced
}

impl<S: Storage + 'static> cache::Backend<L2Key> for L2Backend<S> {
    async fn load(&self, key: L2Key, buf: &mut [u8]) -> io::Result<()> {
        let layer = self
            .layers
            .get(key.layer as usize)
            .ok_or_else(|| io::Error::other(format!("no layer {}", key.layer)))?;
        let offset = slice_offset(key, self.slice_bytes)?;
        layer.announce(Event::L2Load);
        read_exact_into(&layer.file, &layer.name, "reading L2 table", offset, buf)
            .await
            .map_err(to_io)
    }

    type Snapshot = IoBuf;
    fn snapshot(&self, data: &[u8]) -> IoBuf {
        IoBuf::from_slice(data)
    }
    async fn write_back(&self, key: L2Key, at: usize, data: IoBuf) -> io::Result<()> {
        if key.layer != 0 {
            return Err(io::Error::other("backing layers are read-only"));
        }
        let offset = part_offset(slice_offset(key, self.slice_bytes)?, at)?;
        self.layers[0].announce(Event::L2Update);
        write_all(&self.layers[0].file, data, offset).await
    }

    async fn flush(&self) -> io::Result<()> {
        flush_layer(&self.layers[0]).await
    }
}

fn slice_offset(key: L2Key, slice_bytes: usize) -> io::Result<u64> {
    (key.slice as u64)
        .checked_mul(slice_bytes as u64)
        .and_then(|o| o.checked_add(key.table.0))
        .ok_or_else(|| io::Error::other("L2 slice offset overflows"))
}

/// Where a part `at` bytes into an entry at `entry` lies in the file.
fn part_offset(entry: u64, at: usize) -> io::Result<u64> {
    entry
        .checked_add(at as u64)
        .ok_or_else(|| io::Error::other("cache entry part offset overflows"))
}

impl<S: Storage + 'static> cache::Backend<RefcountKey> for RefcountBackend<S> {
    async fn load(&self, key: RefcountKey, buf: &mut [u8]) -> io::Result<()> {
        let layer = &self.layers[0];
        debug_assert_eq!(buf.len(), self.block_bytes);
        layer.announce(Event::RefblockLoad);
        read_exact_into(
            &layer.file,
            &layer.name,
            "reading refcount block",
            key.0,
            buf,
        )
        .await
        .map_err(to_io)
    }

    type Snapshot = IoBuf;
    fn snapshot(&self, data: &[u8]) -> IoBuf {
        IoBuf::from_slice(data)
    }
    async fn write_back(&self, key: RefcountKey, at: usize, data: IoBuf) -> io::Result<()> {
        self.layers[0].announce(Event::RefblockUpdatePart);
        write_all(&self.layers[0].file, data, part_offset(key.0, at)?).await
    }

    async fn flush(&self) -> io::Result<()> {
        flush_layer(&self.layers[0]).await
    }
}
