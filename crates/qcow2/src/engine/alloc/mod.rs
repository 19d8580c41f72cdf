//! The allocator: everything a writable image keeps beyond what reading needs, and every
//! change to where guest clusters live goes through it.
//!
//! - this file: the state (refcount table and cache, allocation hints, the index of the
//!   metadata that data writes must never touch, see [`crate::engine::overlap`]),
//!   loading it on open, and the header bits it maintains (dirty, corrupt, autoclear);
//! - [`refcount`]: refcounts, finding and freeing clusters, refcount blocks and table growth;
//! - [`l2_table`]: giving a guest range a writable L2 table;
//! - [`l2_entry`]: reading and atomically updating L2 entries through the cache;
//! - [`empty`]: emptying the image completely after a commit, as QEMU does;
//! - [`run`]: the one door for L2 changes (`change_l2`, in the order a crash needs) and a
//!   write's allocation (`allocate`, then `change_l2` or `abandon`).
//!
//! Write, zero, discard, compressed write and resize plan what to change and call these.

mod access;
pub(crate) use access::MetaTxn;
mod bitmaps;
mod empty;
pub(crate) mod l2_entry;
mod l2_table;
mod prealloc;
mod refcount;
mod reftable;
mod run;
mod shrink;
mod snapshots;
mod unwritten;

use prealloc::{GrowAhead, PausedGrowth};
pub(crate) use run::{L2Change, NewWords, OldClusters, Precedes};
pub(crate) use snapshots::RefCounts;
use unwritten::Unwritten;

use super::infra::bitmaps::Bitmaps;
use super::infra::error::{EngineError, Result};
use super::infra::layer::{Layer, Qcow2Meta};
use super::infra::metacache::L2Cache;
use super::infra::metacache::{RefcountBackend, RefcountCache};
use super::infra::overlap::{MetaIndex, MetaKind};
use crate::format::features::{INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
use crate::format::{
    l1, BitmapDirectoryEntry, HostCluster, HostOffset, RefcountTableEntry, Structure,
};
use crate::metadata::{Loader, StorageSource, Strictness, REFCOUNT_TABLE};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use storage::{IoBuf, Storage};

use crate::format::header::{self, FieldUpdate};
use reftable::RefTable;

/// The allocator of a writable image.
pub(crate) struct Allocator<S: Storage + 'static> {
    /// The chain's layers; the allocator changes layer 0 only.
    layers: Rc<Vec<Layer<S>>>,
    /// The chain's L2 cache (the allocator updates layer 0's entries through it).
    l2: Rc<L2Cache<S>>,
    /// Refcount blocks by file offset.
    refcounts: Rc<RefcountCache<S>>,
    /// The refcount table: block offset per entry (0 = no block).
    reftable: RefCell<RefTable>,
    /// First cluster index worth looking at for a free cluster.
    free_hint: Cell<HostCluster>,
    /// Bytes of the file that may hold non-zero data; clusters allocated past it read as
    /// zeros without being written.
    physical_len: Cell<u64>,
    /// Serializes allocation and table growth (never held across guest data I/O).
    meta_lock: tokio::sync::Mutex<()>,
    /// Set once an inconsistency was found while writing: every later write fails.
    corrupt: Cell<bool>,
    /// Lazy refcounts: the dirty bit is set before the first L2 update and refcounts are not
    /// ordered before L2 writes.
    lazy_refcounts: Cell<bool>,
    /// The dirty bit is set on disk (by us, for lazy refcounts).
    dirty_on_disk: Cell<bool>,
    /// Metadata ranges that data writes must never touch.
    meta: RefCell<MetaIndex>,
    /// The persistent dirty bitmaps, loaded on open and stored on close.
    bitmaps: RefCell<Bitmaps>,
    /// Where the next compressed cluster may start (0 = start a new cluster).
    free_byte_offset: Cell<u64>,
    /// Bumped whenever a layer-0 L2 entry, L2 table or header field changes, so a write that
    /// planned under a shared lock can tell whether its plan still holds once it has the
    /// exclusive one.
    mapping_generation: Cell<u64>,
    /// How far the file has been grown ahead of the allocations.
    grow: GrowAhead,
    /// The subclusters of clusters allocated fresh that were never written.
    unwritten: RefCell<Unwritten>,
}

impl<S: Storage + 'static> Allocator<S> {
    /// Builds the allocator for layer 0 of `layers`, reading and validating the refcount table.
    pub(crate) async fn open(
        layers: &Rc<Vec<Layer<S>>>,
        l2: &Rc<L2Cache<S>>,
        refcount_cache_bytes: u64,
    ) -> Result<Allocator<S>> {
        let layer = &layers[0];
        let meta = layer
            .qcow2()
            .expect("only qcow2 images are opened with a writer");
        // A copy: the header must not stay borrowed across the reads below.
        let h = meta.header.borrow().clone();
        let cs = meta.geom.cluster_size();
        let mut index = MetaIndex::default();
        let reftable = read_reftable(layer, meta, &h, &mut index).await?;
        index_tables(meta, &h, &mut index);
        let bitmap_entries = index_bitmaps(layer, meta, &h, &mut index).await?;
        let bitmaps = super::infra::bitmaps::load(layer, meta, bitmap_entries).await?;
        index_snapshots(layer, meta, &h, &mut index).await?;
        let block_bytes = cs as usize;
        let refcounts = cache::Cache::new(
            cache::CacheConfig::new("refcount", block_bytes, refcount_cache_bytes.max(2 * cs)),
            RefcountBackend {
                layers: layers.clone(),
                block_bytes,
            },
        )
        .map_err(|source| EngineError::Cache {
            image: layer.name.clone(),
            source,
        })?;
        Ok(Allocator {
            layers: layers.clone(),
            l2: l2.clone(),
            refcounts: Rc::new(refcounts),
            reftable: RefCell::new(reftable),
            free_hint: Cell::new(HostCluster(0)),
            physical_len: Cell::new(meta.file_end.get()),
            meta_lock: tokio::sync::Mutex::new(()),
            corrupt: Cell::new(false),
            lazy_refcounts: Cell::new(h.has_lazy_refcounts() && h.version >= 3),
            dirty_on_disk: Cell::new(false),
            meta: RefCell::new(index),
            bitmaps: RefCell::new(bitmaps),
            free_byte_offset: Cell::new(0),
            mapping_generation: Cell::new(0),
            grow: GrowAhead::new(
                &layer.file,
                meta.file_end.get(),
                meta.geom.cluster_size(),
                h.has_extended_l2(),
            ),
            unwritten: RefCell::new(Unwritten::new(&meta.geom, meta.crypto.is_some())),
        })
    }

    /// Truncates layer 0's file to `end` and brings every record of where the file ends
    /// along: how far it may hold data, where the image ends, and where growing ahead goes
    /// on from.
    async fn truncate_file(&self, end: u64) -> Result<()> {
        let top = self.top();
        top.file
            .set_len(end)
            .await
            .map_err(|e| top.io_error("truncating the file", end, e))?;
        self.physical_len.set(end);
        self.meta().file_end.set(end);
        self.grow.truncated(end);
        self.unwritten.borrow_mut().truncated(end);
        Ok(())
    }

    /// Guest data is about to be written to `[host, host + len)` of layer 0's file.
    pub(crate) fn writing_data(&self, host: HostOffset, len: u64) {
        self.unwritten.borrow_mut().writing(host, len);
    }

    /// Whether `[host, host + len)` lies in subclusters allocated fresh in this session and
    /// never written since, so that the file holds zeros there (false: not known).
    pub(crate) fn known_unwritten(&self, host: HostOffset, len: u64) -> bool {
        self.unwritten.borrow().is_unwritten(host, len)
    }

    /// Makes sure the file reaches `end` (the end of clusters just allocated), growing it a
    /// step ahead when that pays (see [`GrowAhead`]).
    pub(super) async fn grow_ahead(&self, end: u64) {
        let top = self.top();
        self.grow
            .grow(&top.file, &top.name, top.size.get(), end)
            .await;
    }

    /// Stops growing ahead until the guard is dropped (see [`GrowAhead::pause`]).
    pub(crate) fn pause_growth(&self) -> PausedGrowth<'_> {
        self.grow.pause(&self.meta().file_end)
    }

    /// Gives back what was grown ahead and never used.
    pub(crate) async fn trim_growth(&self) -> std::io::Result<()> {
        let end = self.meta().file_end.get().max(self.physical_len.get());
        self.grow.trim(&self.top().file, end).await
    }

    /// Refuses to change an image found corrupt by an earlier request.
    pub(crate) fn ensure_usable(&self) -> Result<()> {
        if self.corrupt.get() {
            return Err(EngineError::MarkedCorrupt {
                image: self.top().name.clone(),
            });
        }
        Ok(())
    }

    /// The writable layer (layer 0).
    pub(crate) fn top(&self) -> &Layer<S> {
        &self.layers[0]
    }

    /// Layer 0's qcow2 metadata: an allocator exists only for a qcow2 layer 0.
    fn meta(&self) -> &Qcow2Meta<S> {
        self.top()
            .qcow2()
            .expect("an allocator is only built for a qcow2 layer")
    }

    /// The current mapping generation (see [`Allocator::mapping_changed`]).
    pub(crate) fn mapping_generation(&self) -> u64 {
        self.mapping_generation.get()
    }

    /// Records that where guest clusters live may have changed: plans made before are stale.
    pub(crate) fn mapping_changed(&self) {
        self.mapping_generation
            .set(self.mapping_generation.get().wrapping_add(1));
    }

    /// Writes header fields in place (not yet durable: callers sync when the order needs it).
    pub(crate) async fn update_header<const N: usize>(&self, u: FieldUpdate<N>) -> Result<()> {
        self.mapping_changed();
        self.write_meta("updating the header", u.offset, &u.bytes)
            .await
    }

    /// Writes `bytes` at `offset` of layer 0's file (header fields, table entries).
    pub(crate) async fn write_meta(
        &self,
        what: &'static str,
        offset: u64,
        bytes: &[u8],
    ) -> Result<()> {
        self.write_meta_buf(what, offset, IoBuf::from_slice(bytes))
            .await
            .map(drop)
    }

    /// As [`write_meta`](Self::write_meta), for a table already in an I/O buffer: a table is
    /// a whole cluster (2 MiB at most), and a second copy of it would be memory for nothing.
    /// Gives the buffer back.
    async fn write_meta_buf(&self, what: &'static str, offset: u64, buf: IoBuf) -> Result<IoBuf> {
        let len = buf.len() as u64;
        let top = self.top();
        let (res, buf) = top.file.write_at(buf.into(), offset).await;
        res.map_err(|e| top.io_error(what, offset, e))?;
        let end = offset + len;
        if end > self.physical_len.get() {
            self.physical_len.set(end);
        }
        Ok(buf.into_inner())
    }

    /// Clears the autoclear feature bits we do not understand, as the qcow2 spec asks of a
    /// writer: such a bit vouches for a structure we will not keep up to date, so whoever
    /// set it must learn that the structure may be stale. Runs once every check of a
    /// read-write open has passed.
    pub(crate) async fn clear_unknown_autoclear(&self) -> Result<()> {
        let meta = self.meta();
        let (version, bits) = {
            let h = meta.header.borrow();
            (h.version, h.autoclear_features)
        };
        let known = bits & crate::format::features::AUTOCLEAR_KNOWN;
        if version < 3 || known == bits {
            return Ok(());
        }
        tracing::info!(
            image = %self.top().name,
            cleared = format_args!("{:#x}", bits & !known),
            "clearing unknown autoclear feature bits"
        );
        meta.header.borrow_mut().autoclear_features = known;
        self.update_header(header::autoclear_update(known)).await?;
        self.sync().await
    }

    /// fdatasync of layer 0's files (data file first).
    pub(crate) async fn sync(&self) -> Result<()> {
        let top = self.top();
        super::infra::metacache::flush_layer(top)
            .await
            .map_err(|e| top.io_error("flushing", 0, e))
    }

    /// Rewrites the header's incompatible-feature bits and makes them durable.
    async fn write_incompatible(&self, bits: u64) -> Result<()> {
        let meta = self.meta();
        meta.header.borrow_mut().incompatible_features = bits;
        self.update_header(header::incompatible_update(bits))
            .await?;
        self.sync().await
    }

    /// Sets the dirty bit (lazy refcounts) before the first L2 update that may outrun its
    /// refcounts; refcounts are then rebuilt on the next open unless we close cleanly.
    async fn mark_dirty(&self) -> Result<()> {
        self.ensure_usable()?;
        if !self.lazy_refcounts.get() || self.dirty_on_disk.get() {
            return Ok(());
        }
        let _g = self.meta_lock.lock().await;
        if self.dirty_on_disk.get() {
            return Ok(());
        }
        let bits = self.meta().header.borrow().incompatible_features;
        self.write_incompatible(bits | INCOMPAT_DIRTY).await?;
        self.dirty_on_disk.set(true);
        Ok(())
    }

    /// Clears the dirty bit once every refcount is on disk (a clean close).
    pub(crate) async fn mark_clean(&self) -> Result<()> {
        if !self.dirty_on_disk.get() || self.corrupt.get() || self.top().sync_failed.get() {
            return Ok(());
        }
        let bits = self.meta().header.borrow().incompatible_features;
        self.write_incompatible(bits & !INCOMPAT_DIRTY).await?;
        self.dirty_on_disk.set(false);
        Ok(())
    }

    /// Records an inconsistency found while writing: the image is marked corrupt on disk (as
    /// QEMU does) and every later write fails. Returns the error to report.
    pub(crate) async fn mark_corrupt(&self, detail: String) -> EngineError {
        let top = self.top();
        tracing::error!(image = %top.name, "marking the image corrupt: {detail}");
        if !self.corrupt.replace(true) {
            let (version, bits) = {
                let h = self.meta().header.borrow();
                (h.version, h.incompatible_features)
            };
            if version >= 3 {
                if let Err(e) = self.write_incompatible(bits | INCOMPAT_CORRUPT).await {
                    tracing::error!(image = %top.name, "could not set the corrupt bit: {e}");
                }
            }
        }
        top.corrupt(detail)
    }

    /// Refuses a data write over metadata (and marks the image corrupt), as QEMU's overlap
    /// check does. Data in an external data file cannot overlap qcow2 metadata.
    pub(crate) async fn check_overlap(&self, host: HostOffset, len: u64) -> Result<()> {
        if self.meta().data_file.is_some() {
            self.ensure_usable()?;
            return Ok(());
        }
        self.check_overlap_but(host, len, None).await
    }

    /// As [`check_overlap`](Self::check_overlap) for a write of an L2 table the active L1
    /// table does not use (a snapshot's): it may lie where an active L2 table once was
    /// recorded, but over no other metadata.
    pub(crate) async fn check_inactive_l2_overlap(&self, host: HostOffset, len: u64) -> Result<()> {
        self.check_overlap_but(host, len, Some(MetaKind::L2Table))
            .await
    }

    async fn check_overlap_but(
        &self,
        host: HostOffset,
        len: u64,
        allowed: Option<MetaKind>,
    ) -> Result<()> {
        self.ensure_usable()?;
        // Outside a corrupt image no two metadata ranges overlap, so any one hit will do.
        let hit = self
            .meta
            .borrow()
            .overlapping(host, len)
            .find(|m| Some(m.kind) != allowed);
        if let Some(hit) = hit {
            return Err(self
                .mark_corrupt(format!(
                    "a data write to {:#x} + {len:#x} would overwrite {} at {:#x}",
                    host.0,
                    hit.kind.name(),
                    hit.start.0
                ))
                .await);
        }
        Ok(())
    }
}

/// Bytes of the refcount table read at once: the table of a 2 MiB-cluster image is a 2 MiB
/// cluster, and reading it whole would hold it twice (bytes and words) to keep a few words.
const REFTABLE_PIECE: u64 = 64 << 10;

/// Reads the refcount table, checking that every block it points to lies inside the file,
/// and records the blocks in the metadata index.
async fn read_reftable<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    h: &crate::format::Header,
    index: &mut MetaIndex,
) -> Result<RefTable> {
    let g = &meta.geom;
    let cs = g.cluster_size();
    let file_len = meta.file_end.get();
    let offset = h.refcount_table_offset;
    let clusters = u64::from(h.refcount_table_clusters);
    let table_bytes = clusters * cs;
    let src = StorageSource::new(&layer.file, file_len);
    let loader = Loader::new(&src, Strictness::Open);
    let mut used = Vec::new();
    let mut at = 0;
    while at < table_bytes {
        let len = REFTABLE_PIECE.min(table_bytes - at);
        let words = loader
            .table(Structure::RefcountTable, REFCOUNT_TABLE, offset + at, len)
            .await
            .map_err(|e| EngineError::from_metadata(&layer.name, e))?;
        let first = at / 8;
        for (k, word) in words.into_iter().enumerate() {
            let i = first + k as u64;
            let block = refblock_of(layer, g, word, i, offset, file_len)?;
            if block != 0 {
                index.insert(HostOffset(block), cs, MetaKind::RefcountBlock);
                used.resize(i as usize, 0);
                used.push(block);
            }
        }
        at += len;
    }
    index.insert(HostOffset(offset), table_bytes, MetaKind::RefcountTable);
    Ok(RefTable::from_prefix(used, (table_bytes / 8) as usize))
}

/// The block that refcount-table entry `i` (raw `word`) names, 0 for none, checked to lie
/// inside the file.
fn refblock_of<S: Storage + 'static>(
    layer: &Layer<S>,
    g: &crate::format::Geometry,
    word: u64,
    i: u64,
    offset: u64,
    file_len: u64,
) -> Result<u64> {
    let e = RefcountTableEntry::decode(word, g, i, HostOffset(offset)).map_err(|source| {
        EngineError::Format {
            image: layer.name.clone(),
            source,
        }
    })?;
    let off = e.block_offset.map_or(0, |o| o.0);
    if off != 0
        && off
            .checked_add(g.cluster_size())
            .is_none_or(|e| e > file_len)
    {
        return Err(layer.corrupt(format!(
            "refcount table at {offset:#x}: entry {i} points to a refcount block at {off:#x} past the end of the file ({file_len:#x} bytes)"
        )));
    }
    Ok(off)
}

/// Records the header cluster, the L1 table, every L2 table and the encryption header.
fn index_tables<S>(meta: &Qcow2Meta<S>, h: &crate::format::Header, index: &mut MetaIndex) {
    let cs = meta.geom.cluster_size();
    index.insert(HostOffset(0), cs, MetaKind::Header);
    let l1_len = meta.l1.borrow().len() as u64 * 8;
    index.insert(
        HostOffset(meta.l1_offset.get()),
        l1_len.div_ceil(cs) * cs,
        MetaKind::L1Table,
    );
    for &w in meta.l1.borrow().iter() {
        let off = l1::table_of(w);
        if off != 0 {
            index.insert(HostOffset(off), cs, MetaKind::L2Table);
        }
    }
    if let Some(fde) = h.fde_pointer() {
        index.insert(
            HostOffset(fde.offset),
            fde.length.div_ceil(cs) * cs,
            MetaKind::EncryptionHeader,
        );
    }
}

/// Records the bitmap directory and tables; returns the directory's entries.
async fn index_bitmaps<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    h: &crate::format::Header,
    index: &mut MetaIndex,
) -> Result<Vec<BitmapDirectoryEntry>> {
    let Some(ext) = h.bitmaps() else {
        return Ok(Vec::new());
    };
    let g = &meta.geom;
    let cs = g.cluster_size();
    let src = StorageSource::new(&layer.file, meta.file_end.get());
    let entries = Loader::new(&src, Strictness::Open)
        .bitmap_directory(h, g)
        .await
        .map_err(|e| EngineError::from_metadata(&layer.name, e))?;
    index.insert(
        HostOffset(ext.directory_offset),
        ext.directory_size.div_ceil(cs) * cs,
        MetaKind::BitmapDirectory,
    );
    for b in &entries {
        index.insert(
            HostOffset(b.table_offset),
            (u64::from(b.table_size) * 8).div_ceil(cs) * cs,
            MetaKind::BitmapTable,
        );
    }
    Ok(entries)
}

/// Records the snapshot table and the snapshots' L1 tables. Their placement was validated on
/// open; the table is read again here, which is cheap: it is small and rarely present.
async fn index_snapshots<S: Storage + 'static>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    h: &crate::format::Header,
    index: &mut MetaIndex,
) -> Result<()> {
    if h.nb_snapshots == 0 {
        return Ok(());
    }
    let g = &meta.geom;
    let cs = g.cluster_size();
    let snaps =
        super::infra::load::snapshot_table(&layer.file, &layer.name, h, meta.file_end.get())
            .await?;
    let len: u64 = snaps.iter().map(|s| s.1).sum();
    index.insert(
        HostOffset(h.snapshots_offset),
        len.div_ceil(cs) * cs,
        MetaKind::SnapshotTable,
    );
    // A table QEMU would not use is refused when it is used; it guards nothing meanwhile.
    for (s, _) in snaps
        .iter()
        .filter(|(s, _)| s.l1_table_problem(cs).is_none())
    {
        index.insert(
            HostOffset(s.l1_table_offset),
            (u64::from(s.l1_size) * 8).div_ceil(cs) * cs,
            MetaKind::SnapshotL1Table,
        );
    }
    Ok(())
}
