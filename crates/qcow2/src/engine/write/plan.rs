//! Planning a write: for each cluster it touches, whether it is written in place or filled
//! into a new (or its preallocated) cluster, what the fill copies, and which subcluster bits
//! the entry gets.

use crate::engine::alloc::l2_entry::RawEntry;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Inner;
use crate::format::l2_extended::subcluster_mask;
use crate::format::{ExtendedL2Entry, GuestOffset, HostOffset, L2Entry, SubclusterState};
use storage::Storage;

/// What an allocating write does with the cluster that was there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Old {
    /// Nothing to release.
    Keep,
    /// A compressed cluster: its space loses a reference.
    Compressed { raw: u64 },
    /// A cluster shared with a snapshot (or a shared preallocation): one reference released.
    Shared { host: HostOffset },
}

/// What a write does to one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    /// The cluster is ours: write at `host`, then mark `set_alloc` subclusters allocated.
    InPlace { host: HostOffset, set_alloc: u32 },
    /// Fill what the write does not cover, at `host` (or a new cluster when `None`), then
    /// point the entry at it with `alloc`/`zero` subcluster bits.
    Fill {
        host: Option<HostOffset>,
        old: Old,
        alloc: u32,
        zero: u32,
    },
}

/// A guest byte range `[start, end)`.
pub(super) type GuestRange = (GuestOffset, GuestOffset);

/// One cluster of a write.
#[derive(Clone, Debug)]
pub(super) struct ClusterPlan {
    /// Guest offset of the cluster.
    pub start: GuestOffset,
    /// Guest ranges of the cluster to copy into the (new) host cluster.
    pub fills: Vec<GuestRange>,
    pub action: Action,
}

/// Where one write meets one cluster: the entry, the part written and the cluster's end
/// (cut at the disk's end).
struct Touch<'a> {
    e: &'a RawEntry,
    /// First byte written.
    ws: GuestOffset,
    /// One past the last byte written.
    we: GuestOffset,
    cluster_end: GuestOffset,
}

impl Touch<'_> {
    fn plan(&self, fills: Vec<GuestRange>, action: Action) -> ClusterPlan {
        ClusterPlan {
            start: self.e.cluster,
            fills,
            action,
        }
    }

    /// Everything of the cluster the write does not cover.
    fn around(&self) -> Vec<GuestRange> {
        vec![(self.e.cluster, self.ws), (self.we, self.cluster_end)]
    }
}

impl<S: Storage + 'static> Inner<S> {
    /// Decides, cluster by cluster, how `[offset, offset + len)` is written.
    pub(super) async fn plan(&self, offset: GuestOffset, len: u64) -> Result<Vec<ClusterPlan>> {
        let top = self.top();
        let meta = top.qcow2().expect("qcow2");
        let g = &meta.geom;
        let cs = g.cluster_size();
        let disk_end = GuestOffset(top.size.get());
        let end = offset + len;
        let entries = self.alloc()?.l2_entries(offset, len).await?;
        let mut plans = Vec::with_capacity(entries.len());
        for e in &entries {
            let touch = Touch {
                e,
                ws: offset.max(e.cluster),
                we: end.min(e.cluster + cs),
                cluster_end: (e.cluster + cs).min(disk_end),
            };
            let plan = if g.extended_l2() {
                self.plan_extended(&touch)?
            } else {
                self.plan_standard(&touch)?
            };
            plans.push(plan);
        }
        Ok(plans)
    }

    fn decode_err(&self, source: crate::format::FormatError) -> EngineError {
        EngineError::Format {
            image: self.name(),
            source,
        }
    }

    fn plan_standard(&self, t: &Touch) -> Result<ClusterPlan> {
        let meta = self.top().qcow2().expect("qcow2");
        let g = &meta.geom;
        let e = t.e;
        let index = g.l2_index(e.cluster) as u64;
        let entry =
            L2Entry::decode(e.word, g, index, e.table_offset()).map_err(|s| self.decode_err(s))?;
        let fill = |host, old| {
            t.plan(
                t.around(),
                Action::Fill {
                    host,
                    old,
                    alloc: 0,
                    zero: 0,
                },
            )
        };
        Ok(match entry {
            L2Entry::Normal { host, copied: true } => {
                self.check_host(e, host)?;
                t.plan(Vec::new(), Action::InPlace { host, set_alloc: 0 })
            }
            L2Entry::Normal {
                host,
                copied: false,
            } => {
                self.check_host(e, host)?;
                fill(None, Old::Shared { host })
            }
            L2Entry::Zero {
                preallocated: Some(h),
                copied: true,
            } if meta.data_file.is_none() => {
                self.check_host(e, h)?;
                fill(Some(h), Old::Keep)
            }
            L2Entry::Zero {
                preallocated: Some(h),
                copied: false,
            } if meta.data_file.is_none() => fill(None, Old::Shared { host: h }),
            L2Entry::Zero { .. } | L2Entry::Unallocated => fill(None, Old::Keep),
            L2Entry::Compressed(_) => fill(None, Old::Compressed { raw: e.word }),
        })
    }

    fn plan_extended(&self, t: &Touch) -> Result<ClusterPlan> {
        let meta = self.top().qcow2().expect("qcow2");
        let g = &meta.geom;
        let e = t.e;
        let index = g.l2_index(e.cluster) as u64;
        let x = ExtendedL2Entry::decode(e.word, e.bitmap, g, index, e.table_offset())
            .map_err(|s| self.decode_err(s))?;
        let sub = Subclusters::of(g, t);
        Ok(match x.entry {
            L2Entry::Normal { host, copied: true } => {
                self.check_host(e, host)?;
                sub.owned(t, &x, host)
            }
            L2Entry::Normal {
                host,
                copied: false,
            } => {
                self.check_host(e, host)?;
                sub.shared(t, &x, host)
            }
            L2Entry::Compressed(_) => t.plan(
                t.around(),
                Action::Fill {
                    host: None,
                    old: Old::Compressed { raw: e.word },
                    alloc: u32::MAX,
                    zero: 0,
                },
            ),
            L2Entry::Unallocated | L2Entry::Zero { .. } => t.plan(
                sub.partial(t, true, true),
                Action::Fill {
                    host: None,
                    old: Old::Keep,
                    alloc: sub.touched,
                    zero: x.zero & !sub.touched,
                },
            ),
        })
    }

    /// A data cluster we are about to write must be where the entry's table says it can be.
    fn check_host(&self, e: &RawEntry, host: HostOffset) -> Result<()> {
        let meta = self.top().qcow2().expect("qcow2");
        let (table, cluster, host) = (e.table_offset().0, e.cluster.0, host.0);
        if meta.data_file.is_some() {
            if host != cluster {
                return Err(self.top().corrupt(format!(
                    "L2 table at {table:#x}: guest cluster {cluster:#x} maps to {host:#x} in the data file"
                )));
            }
        } else if host == 0 || host >= meta.file_end.get() {
            return Err(self.top().corrupt(format!(
                "L2 table at {table:#x}: guest cluster {cluster:#x} points to {host:#x}, past the end of the file"
            )));
        }
        Ok(())
    }
}

/// The subclusters one write touches in one cluster with extended L2 entries.
struct Subclusters {
    first: u32,
    last: u32,
    /// Bits of the touched subclusters.
    touched: u32,
    size: u64,
    /// Start of the first touched subcluster.
    head_start: GuestOffset,
    /// End of the last touched subcluster (cut at the cluster's end).
    tail_end: GuestOffset,
}

impl Subclusters {
    fn of(g: &crate::format::Geometry, t: &Touch) -> Subclusters {
        let size = g.subcluster_size();
        let first = g.subcluster_index(t.ws);
        let last = g.subcluster_index(GuestOffset(t.we.0 - 1));
        Subclusters {
            first,
            last,
            touched: subcluster_mask(first, last),
            size,
            head_start: GuestOffset(t.ws.0 - (t.ws - t.e.cluster) % size),
            tail_end: (t.e.cluster + (u64::from(last) + 1) * size).min(t.cluster_end),
        }
    }

    /// The parts of the first and last touched subclusters the write does not cover.
    fn partial(&self, t: &Touch, need_head: bool, need_tail: bool) -> Vec<GuestRange> {
        let mut v = Vec::new();
        if need_head && self.head_start < t.ws {
            v.push((self.head_start, t.ws));
        }
        if need_tail && t.we < self.tail_end {
            v.push((t.we, self.tail_end));
        }
        v
    }

    /// A cluster we own: in place when the touched subclusters need no filling.
    fn owned(&self, t: &Touch, x: &ExtendedL2Entry, host: HostOffset) -> ClusterPlan {
        let head_alloc = x.state(self.first) == SubclusterState::Allocated;
        let tail_alloc = x.state(self.last) == SubclusterState::Allocated;
        let fills = self.partial(t, !head_alloc, !tail_alloc);
        if fills.is_empty() {
            return t.plan(
                fills,
                Action::InPlace {
                    host,
                    set_alloc: self.touched & !x.alloc,
                },
            );
        }
        t.plan(
            fills,
            Action::Fill {
                host: Some(host),
                old: Old::Keep,
                alloc: x.alloc | self.touched,
                zero: x.zero & !self.touched,
            },
        )
    }

    /// A cluster shared with a snapshot: the copy keeps every subcluster it had allocated.
    fn shared(&self, t: &Touch, x: &ExtendedL2Entry, host: HostOffset) -> ClusterPlan {
        let mut fills = self.partial(t, true, true);
        let keep = x.alloc & !self.touched;
        let mut sc = 0u32;
        while sc < 32 {
            if keep & (1 << sc) == 0 {
                sc += 1;
                continue;
            }
            let run = (keep >> sc).trailing_ones();
            let s = t.e.cluster + u64::from(sc) * self.size;
            let end = (t.e.cluster + u64::from(sc + run) * self.size).min(t.cluster_end);
            if s < end {
                fills.push((s, end));
            }
            sc += run;
        }
        t.plan(
            fills,
            Action::Fill {
                host: None,
                old: Old::Shared { host },
                alloc: x.alloc | self.touched,
                zero: x.zero & !self.touched,
            },
        )
    }
}
