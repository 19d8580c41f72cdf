//! Writing guest data: in place where the cluster is ours, otherwise allocate (only the
//! subclusters a write touches, with extended L2 entries) and copy what the write does not
//! cover from wherever the guest currently reads it (backing file, zeros, a compressed or
//! shared cluster). Copy-on-write data and guest data go out as one I/O per run of
//! clusters; copies of zeros into freshly allocated clusters are skipped.
//!
//! Concurrency: writes that keep every cluster where it is hold a shared range lock, those
//! that move or fill clusters hold an exclusive one, so two copy-on-writes of one subcluster
//! never overwrite each other's data, and a read never sees a cluster being reused.

use super::alloc::l2_entry::RawEntry;
use super::chain::{Piece, Source};
use super::error::{EngineError, Result};
use super::image::{Image, Inner};
use super::range_lock::LockMode;
use crate::format::l2;
use crate::format::l2_extended::{pack_bitmap, subcluster_mask, unpack_bitmap};
use crate::format::{ExtendedL2Entry, GuestOffset, HostOffset, L2Entry, SubclusterState};
use storage::{IoBuf, Storage};

/// What an allocating write does with the cluster that was there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Old {
    /// Nothing to release.
    Keep,
    /// A compressed cluster: its space loses a reference.
    Compressed { raw: u64 },
    /// A cluster shared with a snapshot (or a shared preallocation): one reference released.
    Shared { host: HostOffset },
}

/// What a write does to one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
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
type GuestRange = (GuestOffset, GuestOffset);

/// One cluster of a write.
#[derive(Clone, Debug)]
struct ClusterPlan {
    /// Guest offset of the cluster.
    start: GuestOffset,
    /// Guest ranges of the cluster to copy into the (new) host cluster.
    fills: Vec<GuestRange>,
    action: Action,
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

impl<S: Storage + 'static> Image<S> {
    /// Writes `buf` at guest `offset`; with `fua` the data (and the metadata that makes it
    /// reachable) is durable before this returns. The buffer is handed back either way.
    pub async fn write(&self, offset: u64, buf: IoBuf, fua: bool) -> (Result<()>, IoBuf) {
        let (res, buf) = self.inner.write(offset, buf).await;
        if res.is_ok() && fua {
            return (self.flush().await, buf);
        }
        (res, buf)
    }
}

impl<S: Storage + 'static> Inner<S> {
    pub(crate) async fn write(&self, offset: u64, buf: IoBuf) -> (Result<()>, IoBuf) {
        let len = buf.len() as u64;
        if let Err(e) = self
            .check_writable()
            .and_then(|_| self.check_range(offset, len))
        {
            return (Err(e), buf);
        }
        if len == 0 {
            return (Ok(()), buf);
        }
        self.track(offset, len);
        let top = self.chain.top();
        if top.qcow2().is_none() {
            let (res, slice) = top.file.write_at(buf.into(), offset).await;
            return (
                res.map_err(|e| top.io_error("writing data", offset, e)),
                slice.into_inner(),
            );
        }
        let generation = match self.alloc() {
            Ok(a) => a.mapping_generation(),
            Err(e) => return (Err(e), buf),
        };
        let offset = GuestOffset(offset);
        // Most writes land in clusters we own: try that under a shared lock first.
        let plans = {
            let _shared = self.lock_range(offset.0, len, LockMode::Shared).await;
            match self.plan(offset, len).await {
                Err(e) => return (Err(e), buf),
                Ok(plans)
                    if plans
                        .iter()
                        .all(|p| matches!(p.action, Action::InPlace { .. })) =>
                {
                    return self.execute(offset, buf, &plans).await;
                }
                Ok(plans) => plans,
            }
        };
        let _exclusive = self.lock_range(offset.0, len, LockMode::Exclusive).await;
        // The plan holds unless some mapping changed while we waited for the lock; only then
        // is it made again.
        match self.alloc() {
            Ok(a) if a.mapping_generation() == generation => {
                self.execute(offset, buf, &plans).await
            }
            Ok(_) => self.write_unlocked(offset.0, buf).await,
            Err(e) => (Err(e), buf),
        }
    }

    /// Writes with the caller holding an exclusive lock on the range (qcow2 layer 0 only).
    pub(crate) async fn write_unlocked(&self, offset: u64, buf: IoBuf) -> (Result<()>, IoBuf) {
        let offset = GuestOffset(offset);
        match self.plan(offset, buf.len() as u64).await {
            Err(e) => (Err(e), buf),
            Ok(plans) => self.execute(offset, buf, &plans).await,
        }
    }

    /// Decides, cluster by cluster, how `[offset, offset + len)` is written.
    async fn plan(&self, offset: GuestOffset, len: u64) -> Result<Vec<ClusterPlan>> {
        let top = self.chain.top();
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
            image: self.chain.top().name.clone(),
            source,
        }
    }

    fn plan_standard(&self, t: &Touch) -> Result<ClusterPlan> {
        let meta = self.chain.top().qcow2().expect("qcow2");
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
        let meta = self.chain.top().qcow2().expect("qcow2");
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
        let meta = self.chain.top().qcow2().expect("qcow2");
        let (table, cluster, host) = (e.table_offset().0, e.cluster.0, host.0);
        if meta.data_file.is_some() {
            if host != cluster {
                return Err(self.chain.top().corrupt(format!(
                    "L2 table at {table:#x}: guest cluster {cluster:#x} maps to {host:#x} in the data file"
                )));
            }
        } else if host == 0 || host >= meta.file_end.get() {
            return Err(self.chain.top().corrupt(format!(
                "L2 table at {table:#x}: guest cluster {cluster:#x} points to {host:#x}, past the end of the file"
            )));
        }
        Ok(())
    }

    /// Carries out a plan: one group of clusters at a time, data first, then the L2 entries.
    async fn execute(
        &self,
        offset: GuestOffset,
        mut buf: IoBuf,
        plans: &[ClusterPlan],
    ) -> (Result<()>, IoBuf) {
        let cs = self.chain.top().qcow2().expect("qcow2").geom.cluster_size();
        let mut i = 0;
        while i < plans.len() {
            let mut j = i + 1;
            let res = match plans[i].action {
                Action::InPlace { host, .. } => {
                    // Clusters whose hosts continue each other: one write.
                    while let Some(Action::InPlace { host: h, .. }) = plans.get(j).map(|p| p.action)
                    {
                        if h != host + (j - i) as u64 * cs {
                            break;
                        }
                        j += 1;
                    }
                    let (res, b) = self.in_place(offset, buf, &plans[i..j]).await;
                    buf = b;
                    res
                }
                Action::Fill { host: None, .. } => {
                    // Clusters that all need a new host cluster: allocated together.
                    while matches!(
                        plans.get(j).map(|p| p.action),
                        Some(Action::Fill { host: None, .. })
                    ) {
                        j += 1;
                    }
                    let (res, b) = self.fill_run(offset, buf, &plans[i..j]).await;
                    buf = b;
                    res
                }
                Action::Fill { host: Some(_), .. } => {
                    let (res, b) = self.fill_run(offset, buf, &plans[i..j]).await;
                    buf = b;
                    res
                }
            };
            if let Err(e) = res {
                return (Err(e), buf);
            }
            i = j;
        }
        (Ok(()), buf)
    }

    /// Writes the request bytes that fall in `[from, to)` of the guest to `host`.
    async fn write_data(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
        (from, to): GuestRange,
        host: HostOffset,
    ) -> (Result<()>, IoBuf) {
        let checked = match self.alloc() {
            Ok(a) => a.check_overlap(host, to - from).await,
            Err(e) => Err(e),
        };
        if let Err(e) = checked {
            return (Err(e), buf);
        }
        let top = self.chain.top();
        let range = (from - offset) as usize..(to - offset) as usize;
        let (res, slice) = top.data_storage().write_at(buf.slice(range), host.0).await;
        self.note_written(host + (to - from));
        (
            res.map_err(|e| top.io_error("writing data", host.0, e)),
            slice.into_inner(),
        )
    }

    /// Remembers how far the image file may hold data.
    fn note_written(&self, end: HostOffset) {
        let top = self.chain.top();
        if top.qcow2().is_some_and(|m| m.data_file.is_some()) {
            return;
        }
        if let Some(w) = &self.alloc {
            if end.0 > w.physical_len.get() {
                w.physical_len.set(end.0);
            }
        }
    }

    /// Writes clusters we own in place, then marks newly written subclusters allocated.
    async fn in_place(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
        plans: &[ClusterPlan],
    ) -> (Result<()>, IoBuf) {
        let cs = self.chain.top().qcow2().expect("qcow2").geom.cluster_size();
        let end = offset + buf.len() as u64;
        let first = &plans[0];
        let Action::InPlace { host, .. } = first.action else {
            unreachable!("in_place is given in-place clusters")
        };
        let from = offset.max(first.start);
        let to = end.min(plans[plans.len() - 1].start + cs);
        let (res, buf) = self
            .write_data(offset, buf, (from, to), host + (from - first.start))
            .await;
        if let Err(e) = res {
            return (Err(e), buf);
        }
        let res = async {
            for p in plans {
                if let Action::InPlace { host, set_alloc } = p.action {
                    if set_alloc != 0 {
                        self.mark_subclusters(p.start, host, set_alloc).await?;
                    }
                }
            }
            Ok(())
        }
        .await;
        (res, buf)
    }

    /// Sets allocation bits (clearing zero bits) of an entry we own, after its data landed.
    async fn mark_subclusters(
        &self,
        cluster: GuestOffset,
        host: HostOffset,
        bits: u32,
    ) -> Result<()> {
        self.before_l2_update(false).await?;
        let (word, _) = self
            .alloc()?
            .update_l2_entry(cluster, |word, bitmap| {
                if l2::host_of(word) != host.0 {
                    return None;
                }
                let (alloc, zero) = unpack_bitmap(bitmap);
                let alloc = alloc | bits;
                Some((word, pack_bitmap(alloc, zero & !alloc)))
            })
            .await?;
        if l2::host_of(word) != host.0 {
            return Err(self
                .mark_corrupt(format!(
                    "L2 entry of guest cluster {:#x} changed under a write ({:#x} != {:#x})",
                    cluster.0,
                    l2::host_of(word),
                    host.0
                ))
                .await);
        }
        Ok(())
    }

    /// Sets the cache obligations that must precede an L2 update: the dirty bit (lazy
    /// refcounts) or refcounts first (when clusters were allocated), and data first.
    async fn before_l2_update(&self, allocated: bool) -> Result<()> {
        let w = self.alloc()?;
        if w.lazy_refcounts {
            w.mark_dirty().await?;
        } else if allocated {
            self.chain
                .l2
                .set_dependency(w.refcounts_flush())
                .await
                .map_err(|source| EngineError::Cache {
                    image: self.chain.top().name.clone(),
                    source,
                })?;
        }
        self.chain.l2.set_flush_before_writeback();
        Ok(())
    }

    /// Writes a run of clusters that need filling (and, with `host: None`, new clusters):
    /// copy-on-write data and guest data in one I/O, then the L2 entries, then the old
    /// clusters' references are released.
    async fn fill_run(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
        plans: &[ClusterPlan],
    ) -> (Result<()>, IoBuf) {
        let top = self.chain.top();
        let meta = top.qcow2().expect("qcow2");
        let g = &meta.geom;
        let cs = g.cluster_size();
        let w = match self.alloc() {
            Ok(w) => w,
            Err(e) => return (Err(e), buf),
        };
        let n = plans.len() as u64;
        let first = plans[0].start;
        let preset = match plans[0].action {
            Action::Fill { host, .. } => host,
            Action::InPlace { .. } => unreachable!("fill_run is given filling clusters"),
        };
        // 1. Writable L2 tables and host clusters.
        let alloc = async {
            let _g = w.meta_lock.lock().await;
            let mut last_l1 = None;
            for p in plans {
                let l1i = g.l1_index(p.start);
                if last_l1 != Some(l1i) {
                    w.l2_for_write(l1i).await?;
                    last_l1 = Some(l1i);
                }
            }
            let fresh_from = w.physical_len.get();
            Ok::<_, EngineError>(match preset {
                Some(h) => (h, false, false),
                // The data file mirrors the guest's layout.
                None if meta.data_file.is_some() => (HostOffset(first.0), false, false),
                None => {
                    let h = w.alloc_clusters(n).await?;
                    (h, true, h.0 >= fresh_from)
                }
            })
        };
        let (host, allocated, fresh) = match alloc.await {
            Ok(v) => v,
            Err(e) => return (Err(e), buf),
        };
        let (res, buf) = self.fill_and_write(offset, buf, plans, host, fresh).await;
        if let Err(e) = res {
            if allocated {
                let _g = w.meta_lock.lock().await;
                if let Err(e2) = w.free_clusters(host, n, false).await {
                    tracing::warn!("could not release clusters after a failed write: {e2}");
                }
            }
            return (Err(e), buf);
        }
        // 2. Point the entries at the data.
        let res = async {
            self.before_l2_update(allocated).await?;
            for (k, p) in plans.iter().enumerate() {
                let Action::Fill { alloc, zero, .. } = p.action else {
                    continue;
                };
                let h = host + k as u64 * cs;
                let bitmap = if g.extended_l2() {
                    pack_bitmap(alloc, zero & !alloc)
                } else {
                    0
                };
                w.set_l2_entry(p.start, l2::owned_word(h.0), bitmap).await?;
            }
            // 3. Release what the entries no longer use.
            let _g = w.meta_lock.lock().await;
            for p in plans {
                match p.action {
                    Action::Fill {
                        old: Old::Shared { host },
                        ..
                    } => w.free_clusters(host, 1, false).await?,
                    Action::Fill {
                        old: Old::Compressed { raw },
                        ..
                    } => w.free_compressed(raw).await?,
                    _ => {}
                }
            }
            Ok(())
        }
        .await;
        (res, buf)
    }

    /// Builds the bytes of a filling run (copies plus guest data) and writes them.
    async fn fill_and_write(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
        plans: &[ClusterPlan],
        host: HostOffset,
        fresh: bool,
    ) -> (Result<()>, IoBuf) {
        let cs = self.chain.top().qcow2().expect("qcow2").geom.cluster_size();
        let first = plans[0].start;
        let end = offset + buf.len() as u64;
        let data_from = offset.max(first);
        let data_to = end.min(plans[plans.len() - 1].start + cs);
        // What each fill reads as now; zeros need no copy into a fresh cluster.
        let mut fills: Vec<(GuestOffset, GuestOffset, Vec<Piece>)> = Vec::new();
        for p in plans {
            for &(s, t) in &p.fills {
                if s >= t {
                    continue;
                }
                let mut pieces = Vec::new();
                if let Err(e) = self.chain.resolve(s.0, t - s, 0, &mut pieces).await {
                    return (Err(e), buf);
                }
                if fresh && pieces.iter().all(|q| q.src == Source::Zero) {
                    continue;
                }
                fills.push((s, t, pieces));
            }
        }
        if fills.is_empty() {
            return self
                .write_data(
                    offset,
                    buf,
                    (data_from, data_to),
                    host + (data_from - first),
                )
                .await;
        }
        let span_from = fills
            .iter()
            .map(|f| f.0)
            .min()
            .unwrap_or(data_from)
            .min(data_from);
        let span_to = fills
            .iter()
            .map(|f| f.1)
            .max()
            .unwrap_or(data_to)
            .max(data_to);
        let mut span = IoBuf::zeroed((span_to - span_from) as usize);
        // All fills in one call, in guest order, so that a head and a tail are read
        // concurrently, or as one request when little lies between them.
        fills.sort_by_key(|f| f.0);
        let pieces: Vec<Piece> = fills.iter().flat_map(|f| f.2.iter().copied()).collect();
        if let Err(e) = self.fill(span_from.0, &pieces, &mut span).await {
            return (Err(e), buf);
        }
        span[(data_from - span_from) as usize..(data_to - span_from) as usize]
            .copy_from_slice(&buf[(data_from - offset) as usize..(data_to - offset) as usize]);
        let len = span.len() as u64;
        let (res, _) = self
            .write_data(
                span_from,
                span,
                (span_from, span_from + len),
                host + (span_from - first),
            )
            .await;
        (res, buf)
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
