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
    /// How QEMU would have walked the old refcount table for the same change, for the
    /// progress it reports.
    pub walks: Walks,
}

/// The walks QEMU's width change makes over the old refcount table: walks that allocate
/// the new blocks, as long as one allocated anything, then one that writes them. Each walk
/// reports its progress entry by entry out of a total that grows with the walks, so the
/// percentages `amend -p` prints go back when a walk more is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Walks {
    /// Entries of the old refcount table (QEMU's steps per walk).
    pub entries: u64,
    /// Walks that allocate, before the one that writes.
    pub allocating: u64,
}

impl Walks {
    /// Every (done, total) pair QEMU reports, in order.
    pub fn reports(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let rt = self.entries;
        (0..=self.allocating).flat_map(move |walk| {
            let total = if walk < self.allocating {
                (walk + 2).max(3)
            } else {
                walk + 1
            };
            (0..=rt).map(move |i| (walk * rt + i, total * rt))
        })
    }

    /// Replays QEMU's allocating walks over `used` (the stored refcounts, old width): each
    /// new block that covers a used cluster gets a cluster when the walk has passed all it
    /// covers, from the first free one on, and after a walk that allocated, the new table
    /// gets clusters (the one taken before freed first). Allocation starts at cluster 0,
    /// as QEMU's does in a freshly opened image.
    fn replay(used: &Imrt, entries: u64, old_per_block: u64, new_per_block: u64, cs: u64) -> Self {
        let span = entries.saturating_mul(old_per_block);
        let blocks = span.div_ceil(new_per_block.max(1));
        let mut sim = Replay {
            used,
            changed: std::collections::BTreeMap::new(),
            free_from: 0,
        };
        let per_table_cluster = (cs / 8).max(1);
        let mut table: Vec<bool> = Vec::new();
        let mut table_at: Option<(u64, u64)> = None;
        let mut allocating = 0u64;
        loop {
            let mut allocated = false;
            for j in 0..blocks {
                let (a, b) = (j * new_per_block, ((j + 1) * new_per_block).min(span));
                let has = table.get(j as usize).copied().unwrap_or(false);
                if !has && sim.any_used(a, b) {
                    if table.len() as u64 <= j {
                        let len = (j + 1).next_multiple_of(per_table_cluster);
                        table.resize(len as usize, false);
                    }
                    table[j as usize] = true;
                    sim.take(1);
                    allocated = true;
                }
            }
            allocating += 1;
            // A walk allocates only blocks it has not got: the walks end, and the bound
            // only guards against a replay that would not.
            if !allocated || allocating > blocks.saturating_add(2) {
                break;
            }
            if let Some((first, n)) = table_at {
                sim.free(first, n);
            }
            let n = (table.len() as u64 * 8).div_ceil(cs).max(1);
            table_at = Some((sim.take(n), n));
        }
        Walks {
            entries,
            allocating,
        }
    }
}

/// The stored refcounts as QEMU's allocations during the walks change them.
struct Replay<'a> {
    used: &'a Imrt,
    /// Clusters taken (true) or freed again (false) by the replay.
    changed: std::collections::BTreeMap<u64, bool>,
    /// Where QEMU's search for a free cluster starts.
    free_from: u64,
}

impl Replay<'_> {
    fn is_used(&self, k: u64) -> bool {
        self.changed
            .get(&k)
            .copied()
            .unwrap_or_else(|| self.used.get(k) > 0)
    }

    /// Clusters the replay frees are ones it took, never ones in use before.
    fn any_used(&self, a: u64, b: u64) -> bool {
        self.used.any_used(a, b) || self.changed.range(a..b).any(|(_, &v)| v)
    }

    /// Takes `n` contiguous free clusters, the first run from `free_from` on.
    fn take(&mut self, n: u64) -> u64 {
        let mut start = self.free_from;
        let mut k = start;
        while k < start + n {
            if self.is_used(k) {
                start = k + 1;
            }
            k += 1;
        }
        for c in start..start + n {
            self.changed.insert(c, true);
        }
        self.free_from = start + n;
        start
    }

    fn free(&mut self, first: u64, n: u64) {
        for c in first..first + n {
            self.changed.insert(c, false);
        }
        self.free_from = self.free_from.min(first);
    }
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
        let walks = Walks::replay(
            &imrt,
            self.meta.reftable.len() as u64,
            self.meta.refblock_entries(),
            (self.meta.cluster_size * 8) >> order,
            self.meta.cluster_size,
        );
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
            walks,
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
