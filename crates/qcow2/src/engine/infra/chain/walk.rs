//! Walking the chain one layer at a time: each layer answers what it holds and hands the rest
//! down to the next layer.

use super::layer_map::{map_layer, Prefetched, Run, RunKind};
use super::piece::{absent, Piece, Source};
use crate::engine::infra::error::Result;
use crate::engine::infra::layer::{Layer, LayerFormat};
use crate::engine::infra::metacache::L2Cache;
use crate::format::{GuestOffset, HostOffset};
use storage::Storage;

/// Walks the chain from layer `from` for `[start, start + len)`, appending pieces in guest
/// order. With `stop_below`, ranges unallocated in layer `from` are handed back there instead
/// of being followed down the chain.
pub(crate) async fn walk<S: Storage + 'static>(
    layers: &[Layer<S>],
    l2: &L2Cache<S>,
    start: GuestOffset,
    len: u64,
    from: usize,
    mut stop_below: Option<&mut Vec<(GuestOffset, u64)>>,
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
    s: GuestOffset,
    l: u64,
    pre: Option<&Prefetched>,
    runs: &mut Vec<Run>,
    out: &mut Vec<Piece>,
    below: &mut Vec<(GuestOffset, u64)>,
) -> Result<()> {
    let layer = &layers[li];
    let size = layer.size.get();
    if s.0 >= size {
        // Past the end of this (shorter) backing layer: zeros, and QEMU does not look
        // further down.
        out.push(absent(s, l, li.saturating_sub(1)));
        return Ok(());
    }
    let inside = l.min(size - s.0);
    if inside < l {
        out.push(absent(
            GuestOffset(s.0 + inside),
            l - inside,
            li.saturating_sub(1),
        ));
    }
    match &layer.format {
        LayerFormat::Raw => out.push(Piece {
            start: s,
            len: inside,
            src: Source::Data {
                host: HostOffset(s.0),
            },
            layer: li,
            present: true,
        }),
        LayerFormat::Luks(m) => out.push(Piece {
            start: s,
            len: inside,
            src: Source::Data {
                host: HostOffset(m.payload.saturating_add(s.0)),
            },
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
                    RunKind::Zero { host } => Source::Zero { host },
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
