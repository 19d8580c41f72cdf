//! The merged backing map: for the backing part of a chain (layers 1..n, read-only while the
//! image is open, so the answer never changes), which layer provides each granule of the disk
//! and where its data is.
//!
//! Without it, a read of a region the top layer does not hold walks every layer below, and
//! with one L2 cache budget shared by the chain, deep chains keep evicting each other's L2
//! slices, which costs QEMU both time and memory on long chains. With it,
//! the chain is walked once per window of the disk, and afterwards a request costs one map
//! lookup however deep the chain is. The map has its own cache, sized like the L2 cache of a
//! single layer, so memory does not grow with the chain's length.
//!
//! A granule is the smallest allocation unit of any backing layer. Granules that do not
//! resolve to one thing (compressed clusters, a layer ending inside the granule) are marked
//! "descend" and walked on each request, which is correct, only slower.

use super::piece::{Piece, Source};
use super::walk::walk;
use super::window::walk_window;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::layer::Layer;
use crate::engine::infra::metacache::L2Cache;
use crate::format::{GuestOffset, HostOffset};
use std::io;
use std::rc::Rc;
use storage::Storage;

/// Bytes of map per cache entry.
const SLOT_BYTES: usize = 16384;
/// Bytes per granule in the map: kind and layer, then the host offset.
const GRANULE_BYTES: usize = 16;
/// Granules per cache entry.
const PER_SLOT: u64 = (SLOT_BYTES / GRANULE_BYTES) as u64;

const ABSENT: u64 = 1;
const ZERO: u64 = 2;
const DATA: u64 = 3;
const DESCEND: u64 = 4;
/// Zeros whose cluster keeps a host cluster, at the offset stored with it.
const ZERO_AT: u64 = 5;

/// Computes map slots by walking the backing chain.
pub(crate) struct MapBackend<S: Storage + 'static> {
    layers: Rc<Vec<Layer<S>>>,
    l2: Rc<L2Cache<S>>,
    granule_bits: u32,
}

/// The map and its cache.
pub(crate) struct BackingMap<S: Storage + 'static> {
    cache: cache::Cache<u64, MapBackend<S>>,
    granule_bits: u32,
    image: String,
}

fn encode(kind: u64, layer: usize, host: u64, out: &mut [u8]) {
    out[..8].copy_from_slice(&(kind | (layer as u64) << 8).to_ne_bytes());
    out[8..16].copy_from_slice(&host.to_ne_bytes());
}

fn decode(bytes: &[u8]) -> (u64, usize, u64) {
    let w0 = u64::from_ne_bytes(bytes[..8].try_into().expect("8 bytes"));
    let w1 = u64::from_ne_bytes(bytes[8..16].try_into().expect("8 bytes"));
    (w0 & 0xff, (w0 >> 8) as usize, w1)
}

impl<S: Storage + 'static> cache::Backend<u64> for MapBackend<S> {
    async fn load(&self, slot: u64, buf: &mut [u8]) -> io::Result<()> {
        let g = 1u64 << self.granule_bits;
        let span = PER_SLOT << self.granule_bits;
        let start = slot
            .checked_mul(span)
            .ok_or_else(|| io::Error::other("backing map slot out of range"))?;
        let len = span.min(u64::MAX - start);
        let mut pieces = Vec::new();
        walk_window(
            &self.layers,
            &self.l2,
            GuestOffset(start),
            len,
            1,
            &mut pieces,
        )
        .await
        .map_err(|e| io::Error::other(e.to_string()))?;
        let mut p = 0;
        for i in 0..PER_SLOT {
            let gs = start + i * g;
            let ge = gs.saturating_add(g);
            while p < pieces.len() && pieces[p].end().0 <= gs {
                p += 1;
            }
            let out = &mut buf[i as usize * GRANULE_BYTES..(i as usize + 1) * GRANULE_BYTES];
            match pieces.get(p) {
                Some(q) if q.start.0 <= gs && q.end().0 >= ge => match q.src {
                    // The map stores plain words: the typed offsets end here.
                    Source::Zero { host: Some(h) } => {
                        encode(ZERO_AT, q.layer, h.0 + (gs - q.start.0), out)
                    }
                    Source::Zero { host: None } if q.present => encode(ZERO, q.layer, 0, out),
                    Source::Zero { host: None } => encode(ABSENT, q.layer, 0, out),
                    Source::Data { host } => encode(DATA, q.layer, host.0 + (gs - q.start.0), out),
                    Source::Compressed { .. } => encode(DESCEND, q.layer, 0, out),
                },
                _ => encode(DESCEND, 1, 0, out),
            }
        }
        Ok(())
    }

    type Snapshot = ();
    fn snapshot(&self, _: &[u8]) {}
    async fn write_back(&self, _: u64, _: usize, _: ()) -> io::Result<()> {
        Err(io::Error::other("the backing map is never dirty"))
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

impl<S: Storage + 'static> BackingMap<S> {
    /// A map for `layers` (used when there are at least two backing layers), with up to
    /// `budget` bytes of cache.
    pub fn new(layers: &Rc<Vec<Layer<S>>>, l2: &Rc<L2Cache<S>>, budget: u64) -> Result<Self> {
        let granule = layers[1..]
            .iter()
            .filter_map(|l| l.qcow2().map(|m| m.geom.subcluster_size()))
            .min()
            .unwrap_or(65536)
            .max(512);
        let granule_bits = granule.trailing_zeros();
        // Enough slots to cover the disk, within the budget, and at least two.
        let disk = layers[0].size.get();
        let slots_needed = disk.div_ceil(PER_SLOT << granule_bits).max(2);
        let slots = slots_needed.min(budget / SLOT_BYTES as u64).max(2);
        let image = layers[0].name.clone();
        let cache = cache::Cache::new(
            cache::CacheConfig::new("backing map", SLOT_BYTES, slots * SLOT_BYTES as u64),
            MapBackend {
                layers: layers.clone(),
                l2: l2.clone(),
                granule_bits,
            },
        )
        .map_err(|source| EngineError::Cache {
            image: image.clone(),
            source,
        })?;
        Ok(BackingMap {
            cache,
            granule_bits,
            image,
        })
    }

    /// Appends the pieces of `[start, start + len)` as the backing layers provide them.
    pub async fn resolve(&self, start: GuestOffset, len: u64, out: &mut Vec<Piece>) -> Result<()> {
        let start = start.0;
        let bits = self.granule_bits;
        let end = start + len;
        let mut descend: Vec<(u64, u64)> = Vec::new();
        let mut pos = start;
        while pos < end {
            let slot = (pos >> bits) / PER_SLOT;
            let slot_end = ((slot + 1) * PER_SLOT)
                .checked_shl(bits)
                .unwrap_or(u64::MAX);
            let chunk_end = end.min(slot_end);
            let first = (pos >> bits) % PER_SLOT;
            let from = pos;
            self.cache
                .read(slot, |bytes| {
                    let mut at = from;
                    let mut i = first as usize;
                    while at < chunk_end {
                        let gs = ((at >> bits) << bits).max(from);
                        let ge = (((at >> bits) + 1) << bits).min(chunk_end);
                        let (kind, layer, host) =
                            decode(&bytes[i * GRANULE_BYTES..(i + 1) * GRANULE_BYTES]);
                        let g0 = (at >> bits) << bits;
                        let piece = match kind {
                            ABSENT => Some((Source::Zero { host: None }, false)),
                            ZERO => Some((Source::Zero { host: None }, true)),
                            ZERO_AT => Some((
                                Source::Zero {
                                    host: Some(HostOffset(host + (gs - g0))),
                                },
                                true,
                            )),
                            DATA => Some((
                                Source::Data {
                                    host: HostOffset(host + (gs - g0)),
                                },
                                true,
                            )),
                            _ => None,
                        };
                        match piece {
                            Some((src, present)) => push_piece(
                                out,
                                Piece {
                                    start: GuestOffset(gs),
                                    len: ge - gs,
                                    src,
                                    layer,
                                    present,
                                },
                            ),
                            None => match descend.last_mut() {
                                Some(d) if d.0 + d.1 == gs => d.1 += ge - gs,
                                _ => descend.push((gs, ge - gs)),
                            },
                        }
                        at = ge;
                        i += 1;
                    }
                })
                .await
                .map_err(|source| EngineError::Cache {
                    image: self.image.clone(),
                    source,
                })?;
            pos = chunk_end;
        }
        for (s, l) in descend {
            // `walk` needs the layers and L2 cache the backend already holds.
            let b = self.cache.backend();
            walk(&b.layers, &b.l2, GuestOffset(s), l, 1, None, out).await?;
        }
        Ok(())
    }

    /// Drops map slots not used since the previous call.
    pub async fn clean_idle(&self) -> Result<()> {
        self.cache
            .clean_idle()
            .await
            .map_err(|source| EngineError::Cache {
                image: self.image.clone(),
                source,
            })
    }

    /// Statistics of the map's cache.
    pub fn stats(&self) -> cache::CacheStats {
        self.cache.stats()
    }
}

/// Appends a piece, merging it into the previous one when it continues it exactly.
fn push_piece(out: &mut Vec<Piece>, p: Piece) {
    if let Some(last) = out.last_mut() {
        if last.end() == p.start && last.layer == p.layer && last.present == p.present {
            let merge = match (last.src, p.src) {
                (Source::Zero { host: a }, Source::Zero { host: b }) => {
                    super::piece::host_continues(a, last.len, b)
                }
                (Source::Data { host: a }, Source::Data { host: b }) => a.0 + last.len == b.0,
                _ => false,
            };
            if merge {
                last.len += p.len;
                return;
            }
        }
    }
    out.push(p);
}
