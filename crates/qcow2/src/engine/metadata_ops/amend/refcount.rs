//! A new refcount width for an open image (`refcount_bits`): the checker counts every
//! reference and writes a structure of the new width beside the old one, switching to it in
//! one header write (`check::change_refcount_order`, where the crash-safety argument lives);
//! this file quiesces the image first and makes the allocator follow the new structure after.
//!
//! Order: no request runs meanwhile (the whole disk locked, allocation stopped), every cached
//! table is written back and a lazy-refcount dirty bit cleared before the count, so the count
//! reads what the image really holds; the in-memory state changes only after the switch is
//! durable.

use super::entry::AmendError;
use super::progress::Steps;
use crate::check::{self, CheckError, Switched};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::overlap::{MetaIndex, MetaKind};
use crate::format::HostOffset;
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Rewrites the refcount structure with refcounts `order` wide (2^order bits).
    pub(super) async fn change_refcount_width(&self, order: u32, steps: &Steps<'_>) -> Result<()> {
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let geom = meta
            .refcount_geom
            .get()
            .with_refcount_order(order)
            .map_err(|source| EngineError::Format {
                image: top.name.clone(),
                source,
            })?;
        let _quiet = self.inner.quiesce().await?;
        self.inner.flush().await?;
        w.mark_clean().await?;
        let new = match check::change_refcount_order(&top.file, order).await {
            Ok(new) => new,
            Err(e) => return Err(self.width_failed(e).await),
        };
        // The switch is durable: from here on the new structure is the image's.
        self.adopt_refcounts(&new, order);
        meta.refcount_geom.set(geom);
        for (done, total) in new.walks.reports() {
            steps.at(done, total);
        }
        Ok(())
    }

    /// Makes the allocator use the structure the header now names: the old blocks leave the
    /// cache unwritten (the cache was clean, and their clusters are free now) and the
    /// metadata index, so data may go there.
    fn adopt_refcounts(&self, new: &Switched, order: u32) {
        let Some(w) = self.inner.writer() else { return };
        let Some(meta) = self.inner.top().qcow2() else {
            return;
        };
        let cs = meta.geom.cluster_size();
        let old_table = meta.header.borrow().refcount_table_offset;
        w.adopt_refcount_table(new.table.clone(), |index, old| {
            reindex(index, (old_table, old), new, cs)
        });
        {
            let mut h = meta.header.borrow_mut();
            h.refcount_table_offset = new.table_offset;
            h.refcount_table_clusters = new.table_clusters;
            h.refcount_order = order;
        }
        // The new structure may lie past what the allocator knew of the file.
        let end = new
            .table
            .iter()
            .map(|&block| block + cs)
            .chain([new.table_offset + u64::from(new.table_clusters) * cs])
            .max()
            .unwrap_or(0);
        w.note_file_end(HostOffset(end));
        meta.file_end.set(meta.file_end.get().max(end));
        w.mapping_changed();
    }

    /// After a failed change, the old structure is still in charge, but blocks of the new
    /// one may have been written past the end the allocator knew: clusters there no longer
    /// read as zeros without being written.
    async fn width_failed(&self, e: CheckError) -> EngineError {
        let top = self.inner.top();
        if let (Some(w), Ok(len)) = (self.inner.writer(), top.file.len().await) {
            w.note_file_end(HostOffset(len));
        }
        self.width_error(e)
    }

    /// The checker's failure to change the width, as amend reports it.
    fn width_error(&self, e: CheckError) -> EngineError {
        let image = self.inner.name();
        match e {
            CheckError::RefcountTooWide {
                bits,
                offset,
                refcount,
            } => EngineError::Amend {
                image,
                source: AmendError::RefcountTooBig {
                    bits,
                    offset,
                    refcount,
                },
            },
            CheckError::Io {
                what,
                offset,
                source,
            } => EngineError::io(image, what, offset, source),
            other => EngineError::Corrupt {
                image,
                detail: format!("could not change the refcount width: {other}"),
            },
        }
    }
}

/// Replaces the old refcount table (at `old.0`, with blocks `old.1`) and its blocks by the
/// new ones in the index of metadata that data writes must not touch.
fn reindex(index: &mut MetaIndex, old: (u64, &[u64]), new: &Switched, cs: u64) {
    for &block in old.1.iter().filter(|&&b| b != 0) {
        index.remove(HostOffset(block));
    }
    index.remove(HostOffset(old.0));
    for &block in new.table.iter().filter(|&&b| b != 0) {
        index.insert(HostOffset(block), cs, MetaKind::RefcountBlock);
    }
    index.insert(
        HostOffset(new.table_offset),
        u64::from(new.table_clusters) * cs,
        MetaKind::RefcountTable,
    );
}
