//! Resolving a guest range through the whole chain: which layer provides each byte, and how.

use super::error::Result;
use super::layer::{Layer, LayerFormat};
use super::map::{map_layer, Prefetched, Run, RunKind};
use super::Inner;
use super::L2Cache;
use storage::Storage;

/// Where the bytes of a piece come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// Zeros (a zero cluster or subcluster, or nothing allocated anywhere).
    Zero,
    /// Bytes at `host` of the layer's data storage.
    Data { host: u64 },
    /// Part of a compressed cluster (raw L2 word, guest offset of the cluster's start).
    Compressed { raw: u64, cluster: u64 },
}

/// A run of guest bytes and where they come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// First guest byte.
    pub start: u64,
    /// Length.
    pub len: u64,
    /// Where the bytes come from.
    pub src: Source,
    /// The layer that decided: the one holding the data or zero flag when `present`,
    /// otherwise the deepest layer whose size covers the range (qemu-img map's `depth`).
    pub layer: usize,
    /// Allocated (as data or zeros) in some layer.
    pub present: bool,
}

impl Piece {
    /// True when `next` is data that continues this data piece in the same file, in guest
    /// and host order alike, so one I/O can read both.
    pub(crate) fn continues_data(&self, next: &Piece) -> bool {
        match (self.src, next.src) {
            (Source::Data { host: a }, Source::Data { host: b }) => {
                next.layer == self.layer && b == a + self.len && next.start == self.start + self.len
            }
            _ => false,
        }
    }
}

impl<S: Storage + 'static> Inner<S> {
    /// Appends the pieces of `[start, start + len)` as seen from layer `from` downwards, in
    /// guest order. The range must lie within layer `from`'s size. Ranges that fall through
    /// to the backing chain are answered by the merged backing map when there is one.
    pub(crate) async fn resolve(
        &self,
        start: u64,
        len: u64,
        from: usize,
        out: &mut Vec<Piece>,
    ) -> Result<()> {
        match &self.backing_map {
            Some(map) if from == 0 => {
                let first = out.len();
                let mut below = Vec::new();
                walk(&self.layers, &self.l2, start, len, 0, Some(&mut below), out).await?;
                for (s, l) in below {
                    map.resolve(s, l, out).await?;
                }
                out[first..].sort_unstable_by_key(|p| p.start);
                Ok(())
            }
            _ => walk(&self.layers, &self.l2, start, len, from, None, out).await,
        }
    }
}

/// Walks the chain from layer `from` for `[start, start + len)`, appending pieces in guest
/// order. With `stop_below`, ranges unallocated in layer `from` are handed back there instead
/// of being followed down the chain.
pub(crate) async fn walk<S: Storage + 'static>(
    layers: &[Layer<S>],
    l2: &L2Cache<S>,
    start: u64,
    len: u64,
    from: usize,
    mut stop_below: Option<&mut Vec<(u64, u64)>>,
    out: &mut Vec<Piece>,
) -> Result<()> {
    let first = out.len();
    let mut todo = vec![(from, start, len)];
    let mut runs: Vec<Run> = Vec::new();
    let mut below = Vec::new();
    while let Some((li, s, l)) = todo.pop() {
        if li > from {
            if let Some(stop) = stop_below.as_deref_mut() {
                stop.push((s, l));
                continue;
            }
        }
        if li >= layers.len() {
            out.push(absent(s, l, li.saturating_sub(1)));
            continue;
        }
        step(layers, l2, li, s, l, None, &mut runs, out, &mut below).await?;
        todo.extend(below.drain(..).map(|(s, l)| (li + 1, s, l)));
    }
    out[first..].sort_unstable_by_key(|p| p.start);
    Ok(())
}

/// Resolves `[s, s + l)` in layer `li` (which must exist) alone: appends to `out` what this
/// layer decides and to `below` the ranges it leaves to the next layer. Slices in `pre` are
/// used instead of the L2 cache.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn step<S: Storage + 'static>(
    layers: &[Layer<S>],
    l2: &L2Cache<S>,
    li: usize,
    s: u64,
    l: u64,
    pre: Option<&Prefetched>,
    runs: &mut Vec<Run>,
    out: &mut Vec<Piece>,
    below: &mut Vec<(u64, u64)>,
) -> Result<()> {
    let layer = &layers[li];
    let size = layer.size.get();
    if s >= size {
        // Past the end of this (shorter) backing layer: zeros, and QEMU does not look
        // further down.
        out.push(absent(s, l, li.saturating_sub(1)));
        return Ok(());
    }
    let inside = l.min(size - s);
    if inside < l {
        out.push(absent(s + inside, l - inside, li.saturating_sub(1)));
    }
    match &layer.format {
        LayerFormat::Raw => out.push(Piece {
            start: s,
            len: inside,
            src: Source::Data { host: s },
            layer: li,
            present: true,
        }),
        LayerFormat::Qcow2(_) => {
            runs.clear();
            map_layer(layers, l2, li, s, inside, pre, runs).await?;
            for r in runs.iter() {
                let src = match r.kind {
                    RunKind::Unallocated => {
                        below.push((r.start, r.len));
                        continue;
                    }
                    RunKind::Zero => Source::Zero,
                    RunKind::Data { host } => Source::Data { host },
                    RunKind::Compressed { raw, cluster } => Source::Compressed { raw, cluster },
                };
                out.push(Piece {
                    start: r.start,
                    len: r.len,
                    src,
                    layer: li,
                    present: true,
                });
            }
        }
    }
    Ok(())
}

/// Zeros nobody allocated; `deepest` is the last layer that covers them.
pub(crate) fn absent(start: u64, len: u64, deepest: usize) -> Piece {
    Piece {
        start,
        len,
        src: Source::Zero,
        layer: deepest,
        present: false,
    }
}
