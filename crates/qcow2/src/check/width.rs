//! Changing the refcount width of an image (`amend -o refcount_bits=N`), with the checker's
//! machinery: every stored refcount is copied into the in-memory refcount table, as QEMU
//! copies them, a narrower width that cannot hold some refcount is refused before anything
//! is written, and `rebuild` writes a structure of the new width into clusters the old one
//! leaves free.
//!
//! Crash safety: until the one header write that names the new table, its size and the new
//! width together (52 bytes inside the first sector), the old structure is in charge and the
//! new one is only leaked clusters; the new structure is durable before that write, which is
//! flushed too. After it, the old structure's clusters are unreferenced: free.
//!
//! The copy starts from what is on disk: the engine flushes (and clears a lazy-refcount
//! dirty bit) first. Refcounts that disagree with the references are carried over as they
//! are, as QEMU carries them (leaks stay leaks, a refcount below its references stays below:
//! a check repairs them after, as after QEMU's change). But a cluster in use whose refcount
//! is 0 or cannot be read is refused: the new structure takes its clusters from those that
//! read as free, and could land on it. The old structure's clusters, taken while the new one
//! is written, get refcount 0 in it.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::meta;
use super::ondisk::Refblocks;
use super::pass::{Fix, Pass};
use super::report::{Finding, FindingKind};
use crate::format::header;
use crate::format::refcount;
use std::collections::BTreeSet;
use storage::Storage;

/// The refcount structure an image was switched to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Switched {
    /// Where the new refcount table starts.
    pub table_offset: u64,
    /// Its size in clusters.
    pub table_clusters: u32,
    /// Its entries: refcount block offsets, 0 where there is none.
    pub table: Vec<u64>,
}

/// Rewrites the refcount structure of the image in `file` with refcounts of `order` (2^order
/// bits) and switches the header to it; see the module documentation.
pub(crate) async fn change_refcount_order<S: Storage>(
    file: &S,
    order: u32,
) -> Result<Switched, CheckError> {
    let file_len = file
        .len()
        .await
        .map_err(|e| CheckError::io("getting the file size", 0, e))?;
    let meta = meta::load(file, file_len).await?;
    let mut log = |f: Finding| {
        if matches!(f.kind, FindingKind::Error | FindingKind::Reported) {
            tracing::warn!("changing the refcount width: {}", f.message);
        }
    };
    let mut pass = Pass::new(file, meta, file_len, Fix::NONE, &mut log);
    pass.change_width(order).await
}

impl<S: Storage> Pass<'_, S> {
    async fn change_width(&mut self, order: u32) -> Result<Switched, CheckError> {
        let mut imrt = self.stored_counts().await?;
        let max = refcount::max_value(order).unwrap_or(u64::MAX);
        if let Some(first_over) = imrt.first_above(max) {
            return Err(CheckError::RefcountTooWide {
                bits: 1 << order,
                offset: first_over << self.meta.cluster_bits,
                refcount: imrt.get(first_over),
            });
        }
        let old = self.old_structure();
        let new = self.write_structure(&mut imrt, order, &old).await?;
        let mut h = self.meta.header.clone();
        h.incompatible_features = self.meta.incompatible;
        io::write_header(
            self.file,
            "switching the header to the new refcount structure",
            header::refcount_structure_update(&h, new.table_offset, new.table_clusters, order),
        )
        .await?;
        io::flush(self.file).await?;
        Ok(Switched {
            table_offset: new.table_offset,
            table_clusters: new.table_clusters,
            table: new.table,
        })
    }

    /// The clusters of the refcount structure in use now: the new one must not be written
    /// over them, and does not count them (the switch frees them).
    fn old_structure(&self) -> BTreeSet<u64> {
        let bits = self.meta.cluster_bits;
        let table = self.meta.reftable_offset >> bits;
        let table_clusters = self.meta.clusters(self.meta.reftable.len() as u64 * 8);
        let blocks = self
            .meta
            .reftable
            .iter()
            .map(|&raw| refcount::block_of(raw))
            .filter(|&offset| offset != 0)
            .map(|offset| offset >> bits);
        (table..table + table_clusters).chain(blocks).collect()
    }

    /// Every cluster's stored refcount, once every cluster in use is found to have one that
    /// can be read.
    async fn stored_counts(&mut self) -> Result<Imrt, CheckError> {
        self.read_snapshots().await?;
        let clusters = self.meta.clusters(self.file_len);
        if clusters > i32::MAX as u64 {
            return Err(CheckError::TooLarge { clusters });
        }
        let mut imrt = Imrt::new(clusters)?;
        let mut rebuild = false;
        self.calculate(&mut imrt, &mut rebuild).await?;
        self.compare(&imrt, Fix::NONE, &mut rebuild).await?;
        let refused = |corruptions, check_errors| CheckError::Inconsistent {
            corruptions,
            check_errors,
        };
        if rebuild || self.res.check_errors > 0 {
            return Err(refused(self.res.corruptions, self.res.check_errors));
        }
        let mut rb = Refblocks::default();
        for k in 0..imrt.len() {
            match self.stored_refcount(&mut rb, k).await {
                Ok(stored) => imrt.set(k, stored),
                Err(_) => return Err(refused(self.res.corruptions, self.res.check_errors + 1)),
            }
        }
        Ok(imrt)
    }
}
