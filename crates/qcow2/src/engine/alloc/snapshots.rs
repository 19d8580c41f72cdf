//! Internal snapshots on disk: the references a whole L1 tree holds, raising and dropping
//! them, the COPIED flags that follow from the refcounts, and the snapshot table.
//!
//! QEMU counts references per path: an L2 table gets one reference per L1 table naming it,
//! and a data cluster one per L2 entry reached through every L1 table, so a data cluster in
//! an L2 table that the active disk and one snapshot share has refcount 2. A COPIED flag says
//! "refcount exactly 1": only then may a write go to the cluster in place.
//!
//! A COPIED flag and the refcount it describes live in different clusters, so no single
//! write changes both; the callers (`snapshot_ops.rs`) change them in separate, flushed
//! steps chosen so that a crash in between leaves an extra reference that is not used (a
//! leak) beside a flag that is still right for the references that are used.

use super::Allocator;
use crate::engine::infra::error::{EngineError, Result, SnapshotError};
use crate::engine::infra::metacache::L2Key;
use crate::engine::infra::overlap::MetaKind;
use crate::format::snapshot::encode_qemu_table;
use crate::format::{
    be, header, l1, l2, limits, refcount, CompressedDescriptor, HostCluster, HostOffset, Location,
    SnapshotTableEntry, Structure,
};
use std::collections::BTreeMap;
use storage::Storage;

/// References a tree holds, by host cluster index.
pub(crate) type RefCounts = BTreeMap<u64, u64>;

impl<S: Storage + 'static> Allocator<S> {
    /// Slices per L2 table and entries per slice of the shared L2 cache.
    fn l2_slicing(&self) -> (u64, usize) {
        let g = self.meta().geom;
        let slice = self.l2.entry_size() as u64;
        (
            g.cluster_size() / slice,
            (slice / g.l2_entry_size()) as usize,
        )
    }

    /// The raw words of every entry of one slice of L2 table `table`, read through the cache
    /// (which may hold newer entries than the file).
    async fn l2_slice_words(&self, table: u64, slice: u64) -> Result<Vec<(u64, u64)>> {
        let ext = self.meta().geom.extended_l2();
        let (_, per_slice) = self.l2_slicing();
        let key = L2Key {
            layer: 0,
            table: HostOffset(table),
            // At most cluster size / 512 slices.
            slice: slice as u32,
        };
        self.l2
            .read(key, |b| {
                (0..per_slice)
                    .map(|i| l2::entry_at(b, i, ext).unwrap_or((0, 0)))
                    .collect()
            })
            .await
            .map_err(|e| self.cache_err(e))
    }

    /// Every reference the tree under `l1` holds, counted as QEMU counts them.
    pub(crate) async fn tree_refs(&self, l1: &[u64]) -> Result<RefCounts> {
        let mut refs = RefCounts::new();
        let (slices, _) = self.l2_slicing();
        for &word in l1 {
            let table = l1::table_of(word);
            if table == 0 {
                continue;
            }
            *refs.entry(self.cluster_index(table)).or_default() += 1;
            for slice in 0..slices {
                for (word, _) in self.l2_slice_words(table, slice).await? {
                    self.count_entry(word, table, &mut refs).await?;
                }
            }
        }
        Ok(refs)
    }

    fn cluster_index(&self, offset: u64) -> u64 {
        offset >> self.meta().geom.cluster_bits()
    }

    /// Adds the clusters L2 entry `word` (of table `table`) uses to `refs`.
    async fn count_entry(&self, word: u64, table: u64, refs: &mut RefCounts) -> Result<()> {
        for c in self.entry_clusters(word, table).await? {
            *refs.entry(c).or_default() += 1;
        }
        Ok(())
    }

    /// The host clusters an L2 entry uses: its data cluster (also a zero cluster's
    /// preallocated one), or every cluster a compressed cluster's bytes touch.
    async fn entry_clusters(&self, word: u64, table: u64) -> Result<std::ops::Range<u64>> {
        let g = self.meta().geom;
        if l2::is_compressed(word) {
            let at = Location::at(Structure::L2Table, table);
            let desc = CompressedDescriptor::decode(word, g.cluster_bits(), at)
                .map_err(|e| self.fmt_err(e))?;
            let (off, len) = desc.byte_range();
            let last = off.saturating_add(len.max(1) - 1);
            return Ok(self.cluster_index(off)..self.cluster_index(last) + 1);
        }
        let host = l2::host_of(word);
        if host == 0 {
            return Ok(0..0);
        }
        if host % g.cluster_size() != 0 {
            return Err(self
                .mark_corrupt(format!(
                    "L2 table at {table:#x}: data cluster offset {host:#x} is not aligned to a cluster"
                ))
                .await);
        }
        let c = self.cluster_index(host);
        Ok(c..c + 1)
    }

    /// Refuses references that a refcount cannot hold (say, a second one with 1-bit
    /// refcounts), or that reach a cluster without a refcount block, before any refcount
    /// changes. QEMU fails the same references with the same errno, but only once it gets
    /// to them, having raised the refcounts before; here none is raised.
    pub(crate) async fn check_refs_fit(&self, refs: &RefCounts) -> Result<()> {
        let max = refcount::max_value(self.meta().refcount_geom.get().refcount_order())
            .unwrap_or(u64::MAX);
        let (_, _, epb) = self.rc_geometry();
        let refused = |source| EngineError::Snapshot {
            image: self.top().name.clone(),
            source,
        };
        for (&c, &n) in refs {
            let offset = c << self.meta().geom.cluster_bits();
            let ti = c / epb;
            if !self.has_block(ti) {
                // QEMU creates the missing block (growing the table, with half as many
                // entries again to spare, unless that passes its limit, which it compares
                // with the entry count) and then asks its caller to start over.
                let entries = ti.saturating_add(1);
                let grown = entries.saturating_add(entries.div_ceil(2));
                let fits = ti < self.reftable.borrow().len() as u64
                    || grown <= limits::MAX_REFCOUNT_TABLE_BYTES;
                return Err(refused(if fits {
                    SnapshotError::RefcountBlockMissing(offset)
                } else {
                    SnapshotError::BeyondRefcountTable(offset)
                }));
            }
            let now = self.refcount(HostCluster(c)).await?;
            if now.checked_add(n).is_none_or(|v| v > max) {
                return Err(refused(SnapshotError::RefcountLimit {
                    offset,
                    refcount: now,
                    max,
                }));
            }
        }
        Ok(())
    }

    /// Raises the refcounts by `refs` (in the refcount cache; the caller flushes).
    pub(crate) async fn add_refs(&self, refs: &RefCounts) -> Result<()> {
        for (&c, &n) in refs {
            // At most the number of L2 entries in the image: far below i64::MAX.
            self.update_refcount(HostCluster(c), n as i64).await?;
        }
        Ok(())
    }

    /// Drops the references `refs`; a cluster no longer used is discarded in the file, as
    /// QEMU discards what a snapshot operation frees.
    pub(crate) async fn drop_refs(&self, refs: &RefCounts) -> Result<()> {
        let bits = self.meta().geom.cluster_bits();
        for (&c, &n) in refs {
            for _ in 0..n {
                self.free_clusters(HostOffset(c << bits), 1, true).await?;
            }
        }
        Ok(())
    }

    /// Sets the COPIED flag of every L2 entry under `l1`, and of every entry of `l1`, by
    /// QEMU's rule: set when the cluster's refcount is exactly 1 once the references in
    /// `pending` are dropped (compressed clusters never). The L2 tables change through the
    /// cache (the caller flushes); returns the L1 words with their flags set.
    pub(crate) async fn recompute_copied(
        &self,
        l1: &[u64],
        pending: &RefCounts,
    ) -> Result<Vec<u64>> {
        let mut out = Vec::with_capacity(l1.len());
        let (slices, _) = self.l2_slicing();
        for &word in l1 {
            let table = l1::table_of(word);
            if table == 0 {
                out.push(word);
                continue;
            }
            for slice in 0..slices {
                self.recompute_slice(table, slice, pending).await?;
            }
            let owned = self
                .sole_reference(self.cluster_index(table), pending)
                .await?;
            out.push(l1::with_copied(word, owned));
        }
        Ok(out)
    }

    /// Whether cluster `c` will have refcount 1 once `pending` is dropped.
    async fn sole_reference(&self, c: u64, pending: &RefCounts) -> Result<bool> {
        let now = self.refcount(HostCluster(c)).await?;
        let drop = pending.get(&c).copied().unwrap_or(0);
        Ok(now.checked_sub(drop) == Some(1))
    }

    /// [`Allocator::recompute_copied`] for one slice of L2 table `table`; writes the slice
    /// only if a flag changes.
    async fn recompute_slice(&self, table: u64, slice: u64, pending: &RefCounts) -> Result<()> {
        let mut changes = Vec::new();
        for (i, (word, _)) in self
            .l2_slice_words(table, slice)
            .await?
            .into_iter()
            .enumerate()
        {
            let owned = if l2::is_compressed(word) {
                false
            } else {
                match self.entry_clusters(word, table).await? {
                    r if r.is_empty() => false,
                    r => self.sole_reference(r.start, pending).await?,
                }
            };
            let new = l2::with_copied(word, owned);
            if new != word {
                changes.push((i, new));
            }
        }
        if changes.is_empty() {
            return Ok(());
        }
        let ext = self.meta().geom.extended_l2();
        let key = L2Key {
            layer: 0,
            table: HostOffset(table),
            slice: slice as u32,
        };
        self.l2
            .modify(key, |b| {
                for &(i, word) in &changes {
                    let bitmap = l2::entry_at(b, i, ext).map_or(0, |e| e.1);
                    l2::set_entry_at(b, i, ext, word, bitmap);
                }
            })
            .await
            .map_err(|e| self.cache_err(e))?;
        self.mapping_changed();
        Ok(())
    }

    /// Writes the active L1 table in place (the whole table, as QEMU does) and records it.
    pub(crate) async fn write_active_l1(&self, words: Vec<u64>) -> Result<()> {
        let meta = self.meta();
        let bytes = be::table_bytes(&words, words.len() * 8);
        self.top().announce(storage::Event::L1Update);
        self.write_meta("writing the L1 table", meta.l1_offset.get(), &bytes)
            .await?;
        *meta.l1.borrow_mut() = words;
        self.mapping_changed();
        Ok(())
    }

    /// Writes `words` as a table in new clusters (refcount 1); returns its offset (0 for an
    /// empty table, which needs no clusters).
    pub(crate) async fn write_new_l1(&self, words: &[u64], kind: MetaKind) -> Result<u64> {
        if words.is_empty() {
            return Ok(0);
        }
        let cs = self.meta().geom.cluster_size();
        let clusters = (words.len() as u64 * 8).div_ceil(cs);
        let at = self.alloc_clusters(clusters).await?;
        let bytes = be::table_bytes(words, (clusters * cs) as usize);
        self.write_meta("writing an L1 table", at.0, &bytes).await?;
        self.meta.borrow_mut().insert(at, clusters * cs, kind);
        Ok(at.0)
    }

    /// Frees the clusters of an L1 table of `entries` entries at `offset`.
    pub(crate) async fn free_l1(&self, offset: u64, entries: u64) -> Result<()> {
        if offset == 0 || entries == 0 {
            return Ok(());
        }
        let clusters = (entries * 8).div_ceil(self.meta().geom.cluster_size());
        self.meta.borrow_mut().remove(HostOffset(offset));
        self.free_clusters(HostOffset(offset), clusters, true).await
    }

    /// Replaces the snapshot table `old` with `new`: the new table is written to free
    /// clusters and made durable with its refcounts, then one flushed header write switches
    /// `nb_snapshots` and `snapshots_offset` together, and only then is the old table freed.
    /// A crash leaves the old table or the new one in charge, with a leak at worst.
    pub(crate) async fn replace_snapshot_table(
        &self,
        old: &[SnapshotTableEntry],
        new: &[SnapshotTableEntry],
    ) -> Result<()> {
        let (offset, clusters) = self.switch_snapshot_table(old, new).await?;
        self.free_old_snapshot_table(offset, clusters).await
    }

    /// Frees the clusters of a snapshot table [`Self::switch_snapshot_table`] replaced.
    pub(crate) async fn free_old_snapshot_table(&self, offset: u64, clusters: u64) -> Result<()> {
        if offset != 0 && clusters > 0 {
            self.free_clusters(HostOffset(offset), clusters, true)
                .await?;
        }
        Ok(())
    }

    /// The first part of [`Self::replace_snapshot_table`]: the new table takes charge, and
    /// the old one's place (offset, clusters) is returned for the caller to free.
    pub(crate) async fn switch_snapshot_table(
        &self,
        old: &[SnapshotTableEntry],
        new: &[SnapshotTableEntry],
    ) -> Result<(u64, u64)> {
        let cs = self.meta().geom.cluster_size();
        let bytes = encode_qemu_table(new).map_err(|e| self.fmt_err(e))?;
        let old_len = encode_qemu_table(old).map_err(|e| self.fmt_err(e))?.len() as u64;
        let offset = if new.is_empty() {
            0
        } else {
            let at = self
                .alloc_clusters((bytes.len() as u64).div_ceil(cs))
                .await?;
            self.write_meta("writing the snapshot table", at.0, &bytes)
                .await?;
            self.refcounts
                .flush()
                .await
                .map_err(|e| self.cache_err(e))?;
            self.sync().await?;
            at.0
        };
        // At most 65536 entries: checked by the caller.
        let count = new.len() as u32;
        self.update_header(header::snapshots_update(count, offset))
            .await?;
        self.sync().await?;
        let old_offset = {
            let mut h = self.meta().header.borrow_mut();
            h.nb_snapshots = count;
            std::mem::replace(&mut h.snapshots_offset, offset)
        };
        {
            let mut m = self.meta.borrow_mut();
            m.remove(HostOffset(old_offset));
            m.insert(
                HostOffset(offset),
                (bytes.len() as u64).div_ceil(cs) * cs,
                MetaKind::SnapshotTable,
            );
        }
        Ok((old_offset, old_len.div_ceil(cs)))
    }
}
