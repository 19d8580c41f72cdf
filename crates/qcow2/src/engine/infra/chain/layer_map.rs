//! Mapping a guest range through one qcow2 layer: which bytes are data (and where), zeros,
//! compressed, or left to the layer below. One cache access per L2 slice, one run per
//! contiguous stretch of equal kind (so a read becomes one I/O per contiguous host run, not
//! one per cluster or subcluster).

use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::layer::{Layer, Qcow2Meta};
use crate::engine::infra::metacache::{L2Cache, L2Key};
use crate::format::{l2, ExtendedL2Entry, GuestOffset, HostOffset, L2Entry, SubclusterState};
use std::collections::HashMap;
use storage::{IoBuf, Storage};

/// How a run of guest bytes reads in one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RunKind {
    /// Not allocated here: the layer below decides.
    Unallocated,
    /// Reads as zeros (zero flag, zero subclusters); `host` is where the run's first byte
    /// would be when the cluster keeps a host cluster allocated.
    Zero { host: Option<HostOffset> },
    /// Data at this offset of the layer's data storage (for the run's first byte).
    Data { host: HostOffset },
    /// Part of a compressed cluster: the raw L2 word and the guest offset where the cluster
    /// starts.
    Compressed { raw: u64, cluster: GuestOffset },
}

/// A run of guest bytes of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    /// First guest byte.
    pub start: GuestOffset,
    /// Length in bytes.
    pub len: u64,
    /// What the bytes are.
    pub kind: RunKind,
}

impl Run {
    /// One past the last guest byte.
    pub fn end(&self) -> GuestOffset {
        GuestOffset(self.start.0 + self.len)
    }
}

/// Appends a run, merging it into the previous one when they continue each other.
pub(crate) fn push_run(out: &mut Vec<Run>, start: GuestOffset, len: u64, kind: RunKind) {
    if len == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.end() == start {
            let merge = match (last.kind, kind) {
                (RunKind::Unallocated, RunKind::Unallocated) => true,
                (RunKind::Zero { host: a }, RunKind::Zero { host: b }) => {
                    super::piece::host_continues(a, last.len, b)
                }
                (RunKind::Data { host: a }, RunKind::Data { host: b }) => a.0 + last.len == b.0,
                _ => false,
            };
            if merge {
                last.len += len;
                return;
            }
        }
    }
    out.push(Run { start, len, kind });
}

/// L2 slices of read-only layers read ahead of a walk, by cache key (see chain_walk.rs).
pub(crate) type Prefetched = HashMap<L2Key, IoBuf>;

/// Maps `[start, start + len)` of qcow2 layer `li` (which must lie inside the layer's virtual
/// size) into runs appended to `out`. Slices found in `pre` are decoded from there, the others
/// come through the L2 cache.
pub(crate) async fn map_layer<S: Storage + 'static>(
    layers: &[Layer<S>],
    l2: &L2Cache<S>,
    li: usize,
    start: GuestOffset,
    len: u64,
    pre: Option<&Prefetched>,
    out: &mut Vec<Run>,
) -> Result<()> {
    let start = start.0;
    let layer = &layers[li];
    let meta = layer
        .qcow2()
        .expect("map_layer is only called on qcow2 layers");
    let g = &meta.geom;
    let bits = g.cluster_bits();
    let slice_bytes = l2.entry_size() as u64;
    let per_slice = slice_bytes / g.l2_entry_size();
    let end = start.checked_add(len).ok_or(EngineError::OutOfRange {
        offset: start,
        len,
        size: layer.size.get(),
    })?;
    let mut pos = start;
    while pos < end {
        let cluster = pos >> bits;
        let first_in_slice = cluster - cluster % per_slice;
        let slice_end = (first_in_slice + per_slice).saturating_mul(g.cluster_size());
        let chunk_end = end.min(slice_end);
        let l1_index = g.l1_index(GuestOffset(pos));
        match meta.l2_table(l1_index) {
            None => push_run(out, GuestOffset(pos), chunk_end - pos, RunKind::Unallocated),
            Some(table) => {
                let l2_index = g.l2_index(GuestOffset(pos)) as u64;
                let key = L2Key {
                    layer: li as u32,
                    table,
                    slice: u32::try_from(l2_index / per_slice).unwrap_or(u32::MAX),
                };
                let first_index = l2_index - l2_index % per_slice;
                let mut decode = |bytes: &[u8]| {
                    decode_slice(
                        layer,
                        meta,
                        bytes,
                        table.0,
                        first_index,
                        pos,
                        chunk_end,
                        out,
                    )
                };
                if let Some(bytes) = pre.and_then(|p| p.get(&key)) {
                    decode(bytes)?;
                    pos = chunk_end;
                    continue;
                }
                l2.read(key, decode)
                    .await
                    .map_err(|source| EngineError::Cache {
                        image: layer.name.clone(),
                        source,
                    })??;
            }
        }
        pos = chunk_end;
    }
    Ok(())
}

/// Decodes the entries of one cached L2 slice that cover `[pos, end)`.
#[allow(clippy::too_many_arguments)]
fn decode_slice<S>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    bytes: &[u8],
    table: u64,
    first_index: u64,
    mut pos: u64,
    end: u64,
    out: &mut Vec<Run>,
) -> Result<()> {
    let g = &meta.geom;
    let cs = g.cluster_size();
    let ext = g.extended_l2();
    while pos < end {
        let cluster_start = pos & !(cs - 1);
        let cluster_end = end.min(cluster_start.saturating_add(cs));
        let index = g.l2_index(GuestOffset(pos)) as u64;
        let (word, bitmap) =
            l2::entry_at(bytes, (index - first_index) as usize, ext).ok_or_else(|| {
                layer.corrupt(format!(
                    "L2 table at {table:#x}: entry {index} is outside the cached slice"
                ))
            })?;
        let fmt = |source| EngineError::Format {
            image: layer.name.clone(),
            source,
        };
        if ext {
            let e =
                ExtendedL2Entry::decode(word, bitmap, g, index, HostOffset(table)).map_err(fmt)?;
            match e.entry {
                L2Entry::Compressed(_) => push_run(
                    out,
                    GuestOffset(pos),
                    cluster_end - pos,
                    RunKind::Compressed {
                        raw: word,
                        cluster: GuestOffset(cluster_start),
                    },
                ),
                _ => {
                    let host = match e.entry {
                        L2Entry::Normal { host, .. } => Some(host.0),
                        _ => None,
                    };
                    if e.alloc != 0 {
                        check_data_cluster(layer, meta, table, index, host, cluster_start)?;
                    }
                    let scs = g.subcluster_size();
                    while pos < cluster_end {
                        let sc = g.subcluster_index(GuestOffset(pos));
                        let (state, count) = e.run_at(sc);
                        let run_end = cluster_end
                            .min(cluster_start + (u64::from(sc) + u64::from(count)) * scs);
                        let kind = match state {
                            SubclusterState::Unallocated => RunKind::Unallocated,
                            SubclusterState::Zero => RunKind::Zero {
                                host: host.map(|h| HostOffset(h + (pos - cluster_start))),
                            },
                            SubclusterState::Allocated => RunKind::Data {
                                // Allocated subclusters imply a host offset (decode checked).
                                host: HostOffset(host.unwrap_or(0) + (pos - cluster_start)),
                            },
                        };
                        push_run(out, GuestOffset(pos), run_end - pos, kind);
                        pos = run_end;
                    }
                    continue;
                }
            }
        } else {
            let e = L2Entry::decode(word, g, index, HostOffset(table)).map_err(fmt)?;
            let kind = match e {
                L2Entry::Unallocated => RunKind::Unallocated,
                L2Entry::Zero { preallocated, .. } => RunKind::Zero {
                    host: preallocated.map(|h| HostOffset(h.0 + (pos - cluster_start))),
                },
                L2Entry::Normal { host, .. } => {
                    check_data_cluster(layer, meta, table, index, Some(host.0), cluster_start)?;
                    RunKind::Data {
                        host: HostOffset(host.0 + (pos - cluster_start)),
                    }
                }
                L2Entry::Compressed(_) => RunKind::Compressed {
                    raw: word,
                    cluster: GuestOffset(cluster_start),
                },
            };
            push_run(out, GuestOffset(pos), cluster_end - pos, kind);
        }
        pos = cluster_end;
    }
    Ok(())
}

/// A data cluster must start inside the file (or, with an external data file, sit at the
/// guest offset, as the specification requires).
fn check_data_cluster<S>(
    layer: &Layer<S>,
    meta: &Qcow2Meta<S>,
    table: u64,
    index: u64,
    host: Option<u64>,
    guest_cluster: u64,
) -> Result<()> {
    let Some(host) = host else {
        return Err(layer.corrupt(format!(
            "L2 table at {table:#x}: entry {index} has allocated subclusters but no host cluster"
        )));
    };
    if meta.data_file.is_some() {
        if host != guest_cluster {
            return Err(layer.corrupt(format!(
                "L2 table at {table:#x}: entry {index} maps guest offset {guest_cluster:#x} to {host:#x} in the external data file, which must be the same offset"
            )));
        }
    } else if host == 0 || host >= meta.file_end.get() {
        return Err(layer.corrupt(format!(
            "L2 table at {table:#x}: entry {index} points to {host:#x}, past the end of the file ({:#x} bytes)",
            meta.file_end.get()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_run_merges_contiguous_runs_only() {
        let mut v = Vec::new();
        push_run(
            &mut v,
            GuestOffset(0),
            512,
            RunKind::Data {
                host: HostOffset(4096),
            },
        );
        push_run(
            &mut v,
            GuestOffset(512),
            512,
            RunKind::Data {
                host: HostOffset(4608),
            },
        );
        push_run(
            &mut v,
            GuestOffset(1024),
            512,
            RunKind::Data {
                host: HostOffset(8192),
            },
        );
        push_run(&mut v, GuestOffset(1536), 10, RunKind::Zero { host: None });
        push_run(&mut v, GuestOffset(1546), 10, RunKind::Zero { host: None });
        push_run(&mut v, GuestOffset(1556), 0, RunKind::Unallocated);
        let c = RunKind::Compressed {
            raw: 1,
            cluster: GuestOffset(0),
        };
        push_run(&mut v, GuestOffset(1556), 4, c);
        push_run(&mut v, GuestOffset(1560), 4, c);
        assert_eq!(
            v,
            vec![
                Run {
                    start: GuestOffset(0),
                    len: 1024,
                    kind: RunKind::Data {
                        host: HostOffset(4096)
                    }
                },
                Run {
                    start: GuestOffset(1024),
                    len: 512,
                    kind: RunKind::Data {
                        host: HostOffset(8192)
                    }
                },
                Run {
                    start: GuestOffset(1536),
                    len: 20,
                    kind: RunKind::Zero { host: None }
                },
                Run {
                    start: GuestOffset(1556),
                    len: 4,
                    kind: c
                },
                Run {
                    start: GuestOffset(1560),
                    len: 4,
                    kind: c
                },
            ]
        );
    }
}
