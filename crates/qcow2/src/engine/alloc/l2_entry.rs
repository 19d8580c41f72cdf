//! Reading and writing raw L2 entries of the writable layer through the cache (the write
//! side's view; reads use `map`).

use super::Allocator;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::metacache::L2Key;
use crate::format::{l2, GuestOffset, HostOffset};
use storage::Storage;

/// One L2 entry of layer 0: the guest cluster it maps and its raw words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawEntry {
    /// Guest offset of the cluster's first byte.
    pub cluster: GuestOffset,
    /// First word (descriptor and flags).
    pub word: u64,
    /// Subcluster bitmap (0 without extended L2 entries).
    pub bitmap: u64,
    /// The L2 table holding it (`None` when the L1 entry is empty).
    pub table: Option<HostOffset>,
}

impl RawEntry {
    /// Where the entry lives, for messages and decode errors (0 when it has no table).
    pub(crate) fn table_offset(&self) -> HostOffset {
        self.table.unwrap_or_default()
    }
}

impl<S: Storage + 'static> Allocator<S> {
    fn l2_key(&self, table: HostOffset, cluster: GuestOffset) -> (L2Key, usize) {
        let g = self.meta().geom;
        let per_slice = self.l2.entry_size() as u64 / g.l2_entry_size();
        let index = g.l2_index(cluster) as u64;
        (
            L2Key {
                layer: 0,
                table,
                slice: (index / per_slice) as u32,
            },
            (index % per_slice) as usize,
        )
    }

    fn l2_cache_err(&self, source: cache::CacheError) -> EngineError {
        EngineError::Cache {
            image: self.top().name.clone(),
            source,
        }
    }

    /// The raw L2 entries of layer 0 for every cluster touching `[offset, offset + len)`.
    pub(crate) async fn l2_entries(&self, offset: GuestOffset, len: u64) -> Result<Vec<RawEntry>> {
        let meta = self.meta();
        let g = &meta.geom;
        let cs = g.cluster_size();
        let ext = g.extended_l2();
        let mut out = Vec::new();
        if len == 0 {
            return Ok(out);
        }
        let mut c = GuestOffset(g.align_down(offset.0));
        let end = offset + len;
        while c < end {
            let Some(table) = meta.l2_table(g.l1_index(c)) else {
                out.push(RawEntry {
                    cluster: c,
                    word: 0,
                    bitmap: 0,
                    table: None,
                });
                c = c + cs;
                continue;
            };
            // Every entry of this slice that the range needs, in one cache access.
            let (key, first) = self.l2_key(table, c);
            let per_slice = self.l2.entry_size() as u64 / g.l2_entry_size();
            let left_in_slice = per_slice - first as u64;
            let n = left_in_slice.min((end - c).div_ceil(cs));
            let base = c;
            let got = self
                .l2
                .read(key, |b| {
                    (0..n)
                        .map(|i| {
                            let (word, bitmap) =
                                l2::entry_at(b, first + i as usize, ext).unwrap_or((0, 0));
                            RawEntry {
                                cluster: base + i * cs,
                                word,
                                bitmap,
                                table: Some(table),
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .await
                .map_err(|e| self.l2_cache_err(e))?;
            out.extend(got);
            c = c + n * cs;
        }
        Ok(out)
    }

    /// Read-modify-write of one L2 entry of layer 0 in a single synchronous step, so that
    /// concurrent updates of other bits of the same entry are never lost; its table must
    /// already be writable (COPIED). Only [`Allocator::change_l2`] calls it, after ordering
    /// what the entry points to before it. `f` gets the current
    /// words and returns the new ones (`None`: leave it). Returns the words `f` saw.
    pub(super) async fn update_l2_entry(
        &self,
        cluster: GuestOffset,
        f: impl FnOnce(u64, u64) -> Option<(u64, u64)>,
    ) -> Result<(u64, u64)> {
        let meta = self.meta();
        let g = &meta.geom;
        let ext = g.extended_l2();
        let table = meta.l2_table(g.l1_index(cluster)).ok_or_else(|| {
            self.top().corrupt(format!(
                "no L2 table for guest cluster {:#x} after allocating one",
                cluster.0
            ))
        })?;
        let (key, idx) = self.l2_key(table, cluster);
        let outside = || {
            self.top().corrupt(format!(
                "L2 entry for guest cluster {:#x} is outside its slice",
                cluster.0
            ))
        };
        let bytes = l2::entry_bytes(idx, ext)
            .filter(|b| b.end <= self.l2.entry_size())
            .ok_or_else(outside)?;
        // Only the entry's own bytes change, so a write-back writes only their page.
        let seen = self
            .l2
            .modify_part(key, bytes, |b| {
                let old = l2::entry_at(b, 0, ext)?;
                if let Some((word, bitmap)) = f(old.0, old.1) {
                    l2::set_entry_at(b, 0, ext, word, bitmap);
                    self.mapping_changed();
                }
                Some(old)
            })
            .await
            .map_err(|e| self.l2_cache_err(e))?;
        seen.ok_or_else(outside)
    }
}
