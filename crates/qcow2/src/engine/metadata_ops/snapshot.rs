//! Internal snapshots as `qemu-img snapshot` sees them: list, create, apply (revert the disk
//! to one) and delete, on a writable qcow2 image with no request in flight.
//!
//! Every operation starts by flushing, so the caches hold nothing dirty and each step below
//! orders only its own writes; every step that the next one relies on is flushed (refcount
//! cache, L2 cache, `fdatasync`) before the next begins. The single writes that switch from
//! the old state to the new are header writes within the first sector: `nb_snapshots` with
//! `snapshots_offset`, or the guest size with the active L1 table's size and offset.
//!
//! - create: the copy of the active L1 table is written first, as QEMU writes it (so a
//!   refusal to raise a refcount leaks its clusters, as in QEMU); the copy and the raised
//!   refcounts are durable, then the active disk's COPIED flags are cleared (a crash
//!   between leaves an unused reference beside a flag still set: a leak), then the new
//!   table is written and switched to.
//! - apply: the snapshot's references are raised and the flags of its tables cleared, a new
//!   active L1 table is written, the header switches to it (and to the snapshot's size), and
//!   only then are the old active disk's references dropped. A crash shows the old disk or
//!   the snapshot's, never a mix, with leaks at worst.
//! - delete: the table without the entry is switched to first; then the active disk's
//!   COPIED flags are set where the refcount is about to drop to 1, and only then are the
//!   snapshot's references dropped, so a flag is never clear on a cluster whose refcount
//!   is already 1.

use crate::engine::alloc::{Allocator, RefCounts};
pub use crate::engine::infra::error::SnapshotError;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::layer::{Layer, Qcow2Meta};
use crate::engine::infra::overlap::MetaKind;
use crate::format::{be, header, l1, limits, Geometry, HostOffset, SnapshotTableEntry};
use storage::Storage;

/// The one layer a snapshot operation changes, with its allocator.
struct Target<'a, S: Storage + 'static> {
    layer: &'a Layer<S>,
    meta: &'a Qcow2Meta<S>,
    alloc: &'a Allocator<S>,
}

impl<S: Storage + 'static> Image<S> {
    fn snapshot_error(&self, source: SnapshotError) -> EngineError {
        EngineError::Snapshot {
            image: self.inner.name(),
            source,
        }
    }

    /// The snapshot table of the image (empty for a raw image), in table order.
    pub async fn snapshots(&self) -> Result<Vec<SnapshotTableEntry>> {
        let top = self.inner.top();
        let Some(meta) = top.qcow2() else {
            return Ok(Vec::new());
        };
        let h = meta.header.borrow().clone();
        let table = crate::engine::infra::load::snapshot_table(
            &top.file,
            &top.name,
            &h,
            meta.file_end.get(),
        )
        .await?;
        Ok(table.into_iter().map(|(e, _)| e).collect())
    }

    /// The layer to change: a writable qcow2 image without an external data file.
    fn snapshot_target(&self) -> Result<Target<'_, S>> {
        let layer = self.inner.top();
        let meta = layer
            .qcow2()
            .ok_or_else(|| self.snapshot_error(SnapshotError::NotQcow2))?;
        if meta.data_file.is_some() {
            return Err(self.snapshot_error(SnapshotError::DataFile));
        }
        self.inner.check_writable()?;
        let alloc = self.inner.alloc()?;
        Ok(Target { layer, meta, alloc })
    }

    /// Creates a snapshot of the disk as it is now, named `name`, dated `date` (seconds and
    /// nanoseconds since the epoch), with the next free ID; returns its table entry.
    pub async fn create_snapshot(
        &self,
        name: &[u8],
        date: (u32, u32),
    ) -> Result<SnapshotTableEntry> {
        let t = self.snapshot_target()?;
        let _quiet = self.inner.quiesce().await?;
        let table = self.snapshots().await?;
        if table.len() >= limits::MAX_SNAPSHOTS as usize {
            return Err(self.snapshot_error(SnapshotError::TooMany(table.len())));
        }
        self.inner.flush().await?;
        let active: Vec<u64> = t.meta.l1.borrow().clone();
        let refs = t.alloc.tree_refs(&active).await?;
        // The copy keeps the flags as they are, as QEMU's does: a snapshot's flags are
        // never relied on. It is written before the references are judged, as QEMU writes
        // it: a refusal leaves its clusters leaked, as QEMU leaves them.
        let copy = t
            .alloc
            .write_new_l1(&active, MetaKind::SnapshotL1Table)
            .await?;
        if let Err(refused) = t.alloc.check_refs_fit(&refs).await {
            self.persist(&t).await?;
            return Err(refused);
        }
        t.alloc.add_refs(&refs).await?;
        self.persist(&t).await?;
        // Every cluster of the active disk is now shared with the snapshot.
        let flags = t.alloc.recompute_copied(&active, &RefCounts::new()).await?;
        if flags != active {
            t.alloc.write_active_l1(flags).await?;
        }
        self.persist(&t).await?;
        let entry = SnapshotTableEntry::disk_only(
            crate::format::snapshot::next_snapshot_id(&table),
            name.to_vec(),
            date,
            // At most QEMU's 32 MiB of L1 entries, checked on open and resize.
            (copy, active.len() as u32),
            self.size(),
        );
        let mut new = table.clone();
        new.push(entry.clone());
        t.alloc.replace_snapshot_table(&table, &new).await?;
        self.persist(&t).await?;
        Ok(entry)
    }

    /// Writes back both metadata caches and syncs the file.
    async fn persist(&self, t: &Target<'_, S>) -> Result<()> {
        let cache_err = |source| EngineError::Cache {
            image: t.layer.name.clone(),
            source,
        };
        self.inner.l2().flush().await.map_err(cache_err)?;
        t.alloc.flush_refcounts().await?;
        t.alloc.sync().await
    }

    /// Reads and validates a snapshot's L1 table: QEMU's judgement of where it is comes
    /// first, in QEMU's words, as the image was opened without it.
    async fn snapshot_l1(&self, t: &Target<'_, S>, sn: &SnapshotTableEntry) -> Result<Vec<u64>> {
        if let Some(problem) = sn.l1_table_problem(t.meta.geom.cluster_size()) {
            return Err(self.snapshot_error(SnapshotError::L1Table(problem)));
        }
        let len = usize::try_from(u64::from(sn.l1_size) * 8).map_err(|_| {
            t.layer
                .corrupt(format!("snapshot {:?}: L1 table too large", sn.id_lossy()))
        })?;
        let buf = t
            .layer
            .read_file("reading a snapshot's L1 table", sn.l1_table_offset, len)
            .await?;
        Qcow2Meta::<S>::validate_l1(
            be::words(&buf),
            &t.meta.geom,
            sn.l1_table_offset,
            t.meta.file_end.get(),
            &t.layer.name,
        )
    }

    /// Reverts the disk to snapshot `id_or_name` (an ID first, then a name, as QEMU looks it
    /// up), including the disk size it had. The snapshot stays.
    pub async fn apply_snapshot(&self, id_or_name: &str) -> Result<()> {
        let t = self.snapshot_target()?;
        if t.alloc.with_bitmaps(|b| !b.list.is_empty()) {
            return Err(self.snapshot_error(SnapshotError::ActiveBitmaps));
        }
        let _quiet = self.inner.quiesce().await?;
        let table = self.snapshots().await?;
        let wanted = id_or_name.as_bytes();
        let sn = table
            .iter()
            .find(|s| s.id == wanted)
            .or_else(|| table.iter().find(|s| s.name == wanted))
            .ok_or_else(|| self.snapshot_error(SnapshotError::NotFound(id_or_name.into())))?;
        self.inner.flush().await?;
        let sn_l1 = self.snapshot_l1(&t, sn).await?;
        let size = sn.disk_size().unwrap_or_else(|| self.size());
        let entries = self.l1_entries_for(&t, size, sn_l1.len())?;
        let old: Vec<u64> = t.meta.l1.borrow().clone();
        let old_refs = t.alloc.tree_refs(&old).await?;
        let refs = t.alloc.tree_refs(&sn_l1).await?;
        t.alloc.check_refs_fit(&refs).await?;
        t.alloc.add_refs(&refs).await?;
        self.persist(&t).await?;
        // Every cluster of the snapshot is now shared with the new active disk.
        let mut words = t.alloc.recompute_copied(&sn_l1, &RefCounts::new()).await?;
        words.resize(entries, 0);
        let l1_offset = t.alloc.write_new_l1(&words, MetaKind::L1Table).await?;
        self.persist(&t).await?;
        let old_offset = t.meta.l1_offset.get();
        self.switch_active_disk(&t, size, words, l1_offset).await?;
        // The old active disk is unreachable now: its references go.
        t.alloc.drop_refs(&old_refs).await?;
        t.alloc.free_l1(old_offset, old.len() as u64).await?;
        self.persist(&t).await
    }

    /// Entries the active L1 table needs to serve a disk of `size` bytes holding a snapshot
    /// table of `sn_entries`: never fewer than it has (as QEMU keeps them).
    fn l1_entries_for(&self, t: &Target<'_, S>, size: u64, sn_entries: usize) -> Result<usize> {
        let g = &t.meta.geom;
        let needed = Geometry::new(g.cluster_bits(), g.extended_l2(), g.refcount_order(), size)
            .map_err(|source| EngineError::Format {
                image: t.layer.name.clone(),
                source,
            })?
            .l1_entries_needed();
        let current = t.meta.l1.borrow().len() as u64;
        let entries = needed.max(current).max(sn_entries as u64);
        if entries * 8 > limits::MAX_L1_SIZE_BYTES {
            return Err(self.snapshot_error(SnapshotError::TooLarge(size)));
        }
        Ok(entries as usize)
    }

    /// Points the header at the new active L1 table and size in one flushed write, and
    /// records them in memory.
    async fn switch_active_disk(
        &self,
        t: &Target<'_, S>,
        size: u64,
        words: Vec<u64>,
        l1_offset: u64,
    ) -> Result<()> {
        // At most QEMU's 32 MiB of entries, checked by `l1_entries_for`.
        let entries = words.len() as u32;
        let crypt = t.meta.header.borrow().crypt_method;
        t.alloc
            .update_header(header::active_disk_update(size, crypt, entries, l1_offset))
            .await?;
        t.alloc.sync().await?;
        {
            let mut h = t.meta.header.borrow_mut();
            h.size = size;
            h.l1_size = entries;
            h.l1_table_offset = l1_offset;
        }
        let cs = t.meta.geom.cluster_size();
        for &w in &words {
            let table = l1::table_of(w);
            if table != 0 {
                t.alloc
                    .record_metadata(HostOffset(table), cs, MetaKind::L2Table);
            }
        }
        t.meta.l1_offset.set(l1_offset);
        *t.meta.l1.borrow_mut() = words;
        t.layer.size.set(size);
        t.alloc.mapping_changed();
        Ok(())
    }

    /// Deletes the snapshot with this ID and name (as `qemu-img snapshot -d` names the one
    /// it found). Once the snapshot has left the table, failures leave clusters leaked at
    /// worst: a failure to free the old table is returned as `Ok(Some(error))` (the
    /// deletion goes on, as in QEMU), and a failure to release the snapshot's clusters as
    /// [`EngineError::SnapshotRelease`].
    pub async fn delete_snapshot(&self, id: &[u8], name: &[u8]) -> Result<Option<EngineError>> {
        let t = self.snapshot_target()?;
        let _quiet = self.inner.quiesce().await?;
        let table = self.snapshots().await?;
        let Some(pos) = table.iter().position(|s| s.id == id && s.name == name) else {
            let wanted = String::from_utf8_lossy(name).into_owned();
            return Err(self.snapshot_error(SnapshotError::NotFound(wanted)));
        };
        self.inner.flush().await?;
        let sn = &table[pos];
        let sn_l1 = self.snapshot_l1(&t, sn).await?;
        let refs = t.alloc.tree_refs(&sn_l1).await?;
        let mut new = table.clone();
        new.remove(pos);
        let (old_table, clusters) = t.alloc.switch_snapshot_table(&table, &new).await?;
        let table_leaked = t
            .alloc
            .free_old_snapshot_table(old_table, clusters)
            .await
            .err()
            .map(Box::new);
        let release = async {
            // The flags first, as they will be once the references are dropped.
            let active: Vec<u64> = t.meta.l1.borrow().clone();
            let flags = t.alloc.recompute_copied(&active, &refs).await?;
            if flags != active {
                t.alloc.write_active_l1(flags).await?;
            }
            self.persist(&t).await?;
            t.alloc.drop_refs(&refs).await?;
            t.alloc
                .free_l1(sn.l1_table_offset, u64::from(sn.l1_size))
                .await?;
            self.persist(&t).await
        };
        match release.await {
            Ok(()) => Ok(table_leaked.map(|e| *e)),
            Err(source) => Err(EngineError::SnapshotRelease {
                image: t.layer.name.clone(),
                source: Box::new(source),
                table_leaked,
            }),
        }
    }
}
