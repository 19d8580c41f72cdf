//! Walking one window of the disk through many read-only layers, with the L2 slices of the
//! next layers read concurrently in waves.
//!
//! [`walk`](super::walk::walk) asks each layer in turn and loads an L2 slice only when it
//! gets there, so a window that falls through a chain of depth 300 costs 300 dependent reads
//! (and, with one small L2 cache for the whole chain, it costs them again for the next
//! window). The backing map builds each window once, so here the layers are visited level by
//! level and, on reaching a layer whose slices are not at hand, the slices of that layer and
//! the next [`WAVE`] - 1 layers that cover the still-unresolved ranges are read at once: a
//! window through 300 layers costs two rounds of concurrent reads instead of 300 in a row.
//! A wave may read slices of layers that turn out not to be needed (when an upper layer
//! resolves everything); that waste is bounded by one wave per window.
//!
//! Only backing layers are prefetched: they are read-only while the image is open, so the
//! bytes on disk are the bytes the L2 cache would hold. The writable top layer may have dirty
//! slices in the cache and always goes through it. Prefetched slices bypass the L2 cache, so
//! building the map does not evict the slices that requests to the top layer use.

use super::layer_map::Prefetched;
use super::piece::{absent, Piece};
use super::walk::step;
use crate::engine::infra::error::Result;
use crate::engine::infra::join_all::join_all;
use crate::engine::infra::layer::Layer;
use crate::engine::infra::metacache::{L2Cache, L2Key};
use crate::format::GuestOffset;
use storage::Storage;

/// Layers whose slices are read in one round. The map exists for chains of three or more
/// layers, whose L2 slices are at most 4 KiB, and a window needs at most two slices of a layer,
/// so one round holds at most 2 MiB.
pub(crate) const WAVE: usize = 256;

/// Appends the pieces of `[start, start + len)` as seen from backing layer `from` (at least
/// 1) downwards, in guest order; the same answer as `walk` from that layer.
pub(crate) async fn walk_window<S: Storage + 'static>(
    layers: &[Layer<S>],
    l2: &L2Cache<S>,
    start: GuestOffset,
    len: u64,
    from: usize,
    out: &mut Vec<Piece>,
) -> Result<()> {
    debug_assert!(from >= 1, "the writable layer is never prefetched");
    let first = out.len();
    let mut pending: Vec<(GuestOffset, u64)> = vec![(start, len)];
    let mut pre = Prefetched::new();
    let mut fetched_to = from;
    let mut runs = Vec::new();
    let mut li = from;
    while !pending.is_empty() {
        if li >= layers.len() {
            for (s, l) in pending.drain(..) {
                out.push(absent(s, l, li.saturating_sub(1)));
            }
            break;
        }
        if li >= fetched_to && li >= 1 {
            // The previous wave's slices belong to layers already passed: free them first.
            pre.clear();
            fetched_to = (li + WAVE).min(layers.len());
            prefetch(layers, l2.entry_size(), li..fetched_to, &pending, &mut pre).await?;
        }
        let p = (li >= 1).then_some(&pre);
        let mut next: Vec<(GuestOffset, u64)> = Vec::new();
        for (s, l) in pending.drain(..) {
            step(layers, l2, li, s, l, p, &mut runs, out, &mut next).await?;
        }
        pending = next;
        li += 1;
    }
    out[first..].sort_unstable_by_key(|p| p.start);
    Ok(())
}

/// Reads, concurrently, every L2 slice of layers `range` that covers part of `pending`.
async fn prefetch<S: Storage + 'static>(
    layers: &[Layer<S>],
    slice_bytes: usize,
    range: std::ops::Range<usize>,
    pending: &[(GuestOffset, u64)],
    pre: &mut Prefetched,
) -> Result<()> {
    let mut keys: Vec<(usize, L2Key, u64)> = Vec::new();
    for li in range {
        let Some(layer) = layers.get(li) else { break };
        let Some(meta) = layer.qcow2() else { continue };
        let g = &meta.geom;
        let per_slice = (slice_bytes as u64 / g.l2_entry_size()).max(1);
        let size = layer.size.get();
        for &(GuestOffset(s), l) in pending {
            if s >= size {
                continue;
            }
            let end = s.saturating_add(l).min(size);
            let mut pos = s;
            while pos < end {
                let cluster = pos >> g.cluster_bits();
                let next_slice = (cluster - cluster % per_slice + per_slice)
                    .checked_shl(g.cluster_bits())
                    .unwrap_or(u64::MAX);
                if let Some(table) = meta.l2_table(g.l1_index(GuestOffset(pos))) {
                    let l2_index = g.l2_index(GuestOffset(pos)) as u64;
                    let key = L2Key {
                        layer: li as u32,
                        table,
                        slice: u32::try_from(l2_index / per_slice).unwrap_or(u32::MAX),
                    };
                    // Keys of other layers differ in `layer`: only this layer's can repeat.
                    let known = keys
                        .iter()
                        .rev()
                        .take_while(|k| k.0 == li)
                        .any(|k| k.1 == key);
                    if !pre.contains_key(&key) && !known {
                        let offset = u64::from(key.slice)
                            .checked_mul(slice_bytes as u64)
                            .and_then(|o| o.checked_add(table.0));
                        // An offset that overflows is left to the L2 cache to report.
                        if let Some(offset) = offset {
                            keys.push((li, key, offset));
                        }
                    }
                }
                pos = next_slice.max(pos + 1);
            }
        }
    }
    let reads = keys
        .iter()
        .map(|&(li, _, offset)| layers[li].read_file("reading L2 table", offset, slice_bytes))
        .collect();
    for ((_, key, _), got) in keys.into_iter().zip(join_all(reads).await) {
        pre.insert(key, got?);
    }
    Ok(())
}
