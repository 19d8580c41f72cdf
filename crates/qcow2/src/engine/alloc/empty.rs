//! Emptying the writable layer completely, as QEMU empties a version 3 image after a commit:
//! rather than release each cluster, the image gets a new, minimal metadata structure at the
//! start of the file (header, refcount table, one refcount block, the zeroed L1 table) and the
//! file is cut after it.
//!
//! The order is QEMU's, and so is what a failure leaves: the dirty bit goes out first, since
//! from the zeroed L1 table on the refcounts on disk no longer describe the image; then the L1
//! table is zeroed (`l1_update`), the clusters of the new structure are zeroed
//! (`empty_image_prepare`), the header points at the new L1 and refcount tables
//! (`l1_update`, `reftable_update`), and the refcount table at the first refcount block
//! (`refblock_alloc`). A failure in that stretch leaves the image unusable in this process
//! (every later write fails) and dirty on disk, for the next open to repair; once the
//! refcount block counts the new structure, the dirty bit is cleared and the file cut.

use super::reftable::RefTable;
use super::Allocator;
use crate::engine::infra::error::Result;
use crate::engine::infra::overlap::{MetaIndex, MetaKind};
use crate::format::features::INCOMPAT_DIRTY;
use crate::format::{header, refcount, HostCluster, HostOffset};
use storage::{Event, IoBuf, Storage};

/// Clusters the new structure takes before its L1 table: the header, the refcount table and
/// the first refcount block.
const LEAD_CLUSTERS: u64 = 3;

impl<S: Storage + 'static> Allocator<S> {
    /// Whether the image can be emptied completely ([`Allocator::make_completely_empty`]):
    /// version 3 (it needs the dirty bit), and nothing but the active disk holds clusters
    /// (no snapshots, no bitmaps, no LUKS header, no external data file), and the new
    /// structure's clusters are counted by one refcount block.
    pub(crate) fn can_empty_completely(&self) -> bool {
        let meta = self.meta();
        let h = meta.header.borrow();
        let (_, _, epb) = self.rc_geometry();
        h.version >= 3
            && h.nb_snapshots == 0
            && h.bitmaps().is_none()
            && h.fde_pointer().is_none()
            && h.crypt_method != header::CRYPT_LUKS
            && meta.data_file.is_none()
            && LEAD_CLUSTERS + self.l1_clusters() <= epb
    }

    /// Clusters the active L1 table fills.
    fn l1_clusters(&self) -> u64 {
        let meta = self.meta();
        let bytes = meta.l1.borrow().len() as u64 * 8;
        bytes.div_ceil(meta.geom.cluster_size())
    }

    /// Empties the image completely (see the module's text). The caller holds the whole disk
    /// exclusively and has checked [`Allocator::can_empty_completely`].
    pub(crate) async fn make_completely_empty(&self) -> Result<()> {
        self.ensure_usable()?;
        let _g = self.meta_lock.lock().await;
        // Whatever the caches hold goes out first, then they forget it: the structure they
        // describe is about to go.
        self.l2.flush().await.map_err(|e| self.cache_err(e))?;
        self.flush_refcounts().await?;
        self.l2.forget(|k| k.layer == 0);
        self.refcounts.forget(|_| true);
        self.unwritten.borrow_mut().clear();
        self.mapping_changed();
        let bits = self.meta().header.borrow().incompatible_features;
        self.write_incompatible(bits | INCOMPAT_DIRTY).await?;
        self.dirty_on_disk.set(true);
        if let Err(e) = self.rebuild_empty().await {
            // As in QEMU, the image is of no more use in this process: what the file holds
            // and what is known of it no longer agree. The dirty bit stays for the next open.
            self.corrupt.set(true);
            return Err(e);
        }
        let bits = self.meta().header.borrow().incompatible_features;
        self.write_incompatible(bits & !INCOMPAT_DIRTY).await?;
        self.dirty_on_disk.set(false);
        self.cut_after_structure().await
    }

    /// The stretch in which the refcounts on disk describe nothing: from zeroing the L1 table
    /// to the refcount block that counts the new structure.
    async fn rebuild_empty(&self) -> Result<()> {
        let meta = self.meta();
        let top = self.top();
        let cs = meta.geom.cluster_size();
        let l1_clusters = self.l1_clusters();
        let zero = |offset: u64, len: u64| async move {
            top.file
                .write_zeroes_at(offset, len, false)
                .await
                .map_err(|e| top.io_error("emptying the image", offset, e))
        };
        top.announce(Event::L1Update);
        zero(meta.l1_offset.get(), l1_clusters * cs).await?;
        meta.l1.borrow_mut().fill(0);
        top.announce(Event::EmptyImagePrepare);
        // The new structure may lie over the old tables: with the dirty bit set, losing them
        // loses nothing that is still wanted.
        zero(cs, (LEAD_CLUSTERS - 1 + l1_clusters) * cs).await?;
        top.announce(Event::L1Update);
        top.announce(Event::ReftableUpdate);
        let (l1_offset, table_offset, block_offset) = (LEAD_CLUSTERS * cs, cs, 2 * cs);
        self.update_header(header::emptied_tables_update(l1_offset, table_offset, 1))
            .await?;
        self.sync().await?;
        {
            let mut h = meta.header.borrow_mut();
            h.l1_table_offset = l1_offset;
            h.refcount_table_offset = table_offset;
            h.refcount_table_clusters = 1;
        }
        meta.l1_offset.set(l1_offset);
        *self.reftable.borrow_mut() = RefTable::from_entries(vec![0; (cs / 8) as usize]);
        top.announce(Event::RefblockAlloc);
        self.write_meta(
            "updating the refcount table",
            table_offset,
            &block_offset.to_be_bytes(),
        )
        .await?;
        self.sync().await?;
        self.reftable.borrow_mut().set(0, block_offset);
        let (_, order, _) = self.rc_geometry();
        let mut block = IoBuf::zeroed(cs as usize);
        for i in 0..(LEAD_CLUSTERS + l1_clusters) as usize {
            refcount::set(&mut block, order, i, 1).map_err(|e| self.fmt_err(e))?;
        }
        self.write_meta_buf("writing a refcount block", block_offset, block)
            .await?;
        self.sync().await?;
        let mut index = MetaIndex::default();
        index.insert(HostOffset(0), cs, MetaKind::Header);
        index.insert(HostOffset(table_offset), cs, MetaKind::RefcountTable);
        index.insert(HostOffset(block_offset), cs, MetaKind::RefcountBlock);
        index.insert(HostOffset(l1_offset), l1_clusters * cs, MetaKind::L1Table);
        *self.meta.borrow_mut() = index;
        self.free_hint.set(HostCluster(0));
        self.free_byte_offset.set(0);
        Ok(())
    }

    /// Cuts the file after the new structure, as QEMU does once the image is clean again.
    async fn cut_after_structure(&self) -> Result<()> {
        let cs = self.meta().geom.cluster_size();
        self.truncate_file((LEAD_CLUSTERS + self.l1_clusters()) * cs)
            .await
    }
}
