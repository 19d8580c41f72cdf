//! Resolving a guest range through the whole chain: which layer provides each byte, and how.
//!
//! - [`piece`]: what the answer is made of ([`Piece`], [`Source`]);
//! - [`layer_map`]: one qcow2 layer's L2 entries as runs of data, zeros, compressed clusters
//!   and holes left to the layer below;
//! - [`walk`]: asking the layers in turn, loading each layer's L2 slices through the cache;
//! - [`window`]: the same answer for a window of the disk, with the L2 slices of many
//!   backing layers read at once;
//! - [`backing_map`]: for deep chains, the merged answer of the backing layers, kept in its
//!   own cache so a request costs one lookup however deep the chain is.

mod backing_map;
mod layer_map;
mod piece;
mod walk;
mod window;

pub(crate) use piece::{Piece, Source};

use super::error::Result;
use super::layer::Layer;
use super::metacache::L2Cache;
use crate::format::GuestOffset;
use backing_map::BackingMap;
use std::rc::Rc;
use storage::Storage;

/// Chains with at least this many layers (the image and two backing files) resolve their
/// backing part through a merged [`BackingMap`]; shallower ones walk.
const BACKING_MAP_MIN_LAYERS: usize = 3;

/// The layers of an open image, the L2 cache they share, and the merged backing map of a
/// deep chain.
pub(crate) struct Chain<S: Storage + 'static> {
    /// Layer 0 is the opened image, layer n its n-th backing file.
    pub layers: Rc<Vec<Layer<S>>>,
    /// L2 slices of every layer.
    pub l2: Rc<L2Cache<S>>,
    /// Which backing layer provides each granule (deep chains only).
    backing_map: Option<BackingMap<S>>,
}

impl<S: Storage + 'static> Chain<S> {
    /// True when a chain of `layers` layers resolves through a merged backing map, which also
    /// decides the L2 slice size the chain wants.
    pub fn wants_backing_map(layers: usize) -> bool {
        layers >= BACKING_MAP_MIN_LAYERS
    }

    /// The chain, with a backing map of `map_budget` bytes when it is deep enough for one.
    pub fn new(layers: Rc<Vec<Layer<S>>>, l2: Rc<L2Cache<S>>, map_budget: u64) -> Result<Self> {
        let backing_map = if Self::wants_backing_map(layers.len()) {
            Some(BackingMap::new(&layers, &l2, map_budget)?)
        } else {
            None
        };
        Ok(Chain {
            layers,
            l2,
            backing_map,
        })
    }

    /// The opened image (layer 0).
    pub fn top(&self) -> &Layer<S> {
        &self.layers[0]
    }

    /// Appends the pieces of `[start, start + len)` as seen from layer `from` downwards, in
    /// guest order. The range must lie within layer `from`'s size. Ranges that fall through
    /// to the backing chain are answered by the merged backing map when there is one.
    pub async fn resolve(
        &self,
        start: GuestOffset,
        len: u64,
        from: usize,
        out: &mut Vec<Piece>,
    ) -> Result<()> {
        match &self.backing_map {
            Some(map) if from == 0 => {
                let first = out.len();
                let mut below = Vec::new();
                walk::walk(&self.layers, &self.l2, start, len, 0, Some(&mut below), out).await?;
                for (s, l) in below {
                    map.resolve(s, l, out).await?;
                }
                out[first..].sort_unstable_by_key(|p| p.start);
                Ok(())
            }
            _ => walk::walk(&self.layers, &self.l2, start, len, from, None, out).await,
        }
    }

    /// Statistics of the backing map's cache, for chains that have one.
    pub fn backing_map_stats(&self) -> Option<cache::CacheStats> {
        self.backing_map.as_ref().map(|m| m.stats())
    }

    /// Drops backing-map slots not used since the previous call.
    pub async fn clean_idle(&self) -> Result<()> {
        match &self.backing_map {
            Some(map) => map.clean_idle().await,
            None => Ok(()),
        }
    }
}
