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
    Shared { host: u64 },
}

/// What a write does to one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// The cluster is ours: write at `host`, then mark `set_alloc` subclusters allocated.
    InPlace { host: u64, set_alloc: u32 },
    /// Fill what the write does not cover, at `host` (or a new cluster when `None`), then
    /// point the entry at it with `alloc`/`zero` subcluster bits.
    Fill {
        host: Option<u64>,
        old: Old,
        alloc: u32,
        zero: u32,
    },
}

/// One cluster of a write.
#[derive(Clone, Debug)]
struct ClusterPlan {
    /// Guest offset of the cluster.
    start: u64,
    /// Guest ranges of the cluster to copy into the (new) host cluster.
    fills: Vec<(u64, u64)>,
    action: Action,
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
        // Most writes land in clusters we own: try that under a shared lock first.
        let plans = {
            let _shared = self.lock_range(offset, len, LockMode::Shared).await;
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
        let _exclusive = self.lock_range(offset, len, LockMode::Exclusive).await;
        // The plan holds unless some mapping changed while we waited for the lock; only then
        // is it made again.
        match self.alloc() {
            Ok(a) if a.mapping_generation() == generation => {
                self.execute(offset, buf, &plans).await
            }
            Ok(_) => self.write_unlocked(offset, buf).await,
            Err(e) => (Err(e), buf),
        }
    }

    /// Writes with the caller holding an exclusive lock on the range (qcow2 layer 0 only).
    pub(crate) async fn write_unlocked(&self, offset: u64, buf: IoBuf) -> (Result<()>, IoBuf) {
        match self.plan(offset, buf.len() as u64).await {
            Err(e) => (Err(e), buf),
            Ok(plans) => self.execute(offset, buf, &plans).await,
        }
    }

    /// Decides, cluster by cluster, how `[offset, offset + len)` is written.
    async fn plan(&self, offset: u64, len: u64) -> Result<Vec<ClusterPlan>> {
        let top = self.chain.top();
        let meta = top.qcow2().expect("qcow2");
        let g = &meta.geom;
        let cs = g.cluster_size();
        let size = top.size.get();
        let end = offset + len;
        let entries = self.alloc()?.l2_entries(offset, len).await?;
        let mut plans = Vec::with_capacity(entries.len());
        for e in entries {
            let ws = offset.max(e.cluster);
            let we = end.min(e.cluster + cs);
            let cluster_end = (e.cluster + cs).min(size);
            let plan = if g.extended_l2() {
                self.plan_extended(&e, ws, we, cluster_end)?
            } else {
                self.plan_standard(&e, ws, we, cluster_end)?
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

    fn plan_standard(
        &self,
        e: &RawEntry,
        ws: u64,
        we: u64,
        cluster_end: u64,
    ) -> Result<ClusterPlan> {
        let meta = self.chain.top().qcow2().expect("qcow2");
        let g = &meta.geom;
        let index = g.l2_index(GuestOffset(e.cluster)) as u64;
        let entry = L2Entry::decode(e.word, g, index, HostOffset(e.table))
            .map_err(|s| self.decode_err(s))?;
        let fills = vec![(e.cluster, ws), (we, cluster_end)];
        let fill = |host, old| ClusterPlan {
            start: e.cluster,
            fills: fills.clone(),
            action: Action::Fill {
                host,
                old,
                alloc: 0,
                zero: 0,
            },
        };
        Ok(match entry {
            L2Entry::Normal { host, copied: true } => {
                self.check_host(e, host.0)?;
                ClusterPlan {
                    start: e.cluster,
                    fills: Vec::new(),
                    action: Action::InPlace {
                        host: host.0,
                        set_alloc: 0,
                    },
                }
            }
            L2Entry::Normal {
                host,
                copied: false,
            } => {
                self.check_host(e, host.0)?;
                fill(None, Old::Shared { host: host.0 })
            }
            L2Entry::Zero {
                preallocated: Some(h),
                copied: true,
            } if meta.data_file.is_none() => {
                self.check_host(e, h.0)?;
                fill(Some(h.0), Old::Keep)
            }
            L2Entry::Zero {
                preallocated: Some(h),
                copied: false,
            } if meta.data_file.is_none() => fill(None, Old::Shared { host: h.0 }),
            L2Entry::Zero { .. } | L2Entry::Unallocated => fill(None, Old::Keep),
            L2Entry::Compressed(_) => fill(None, Old::Compressed { raw: e.word }),
        })
    }

    fn plan_extended(
        &self,
        e: &RawEntry,
        ws: u64,
        we: u64,
        cluster_end: u64,
    ) -> Result<ClusterPlan> {
        let meta = self.chain.top().qcow2().expect("qcow2");
        let g = &meta.geom;
        let scs = g.subcluster_size();
        let index = g.l2_index(GuestOffset(e.cluster)) as u64;
        let x = ExtendedL2Entry::decode(e.word, e.bitmap, g, index, HostOffset(e.table))
            .map_err(|s| self.decode_err(s))?;
        let first = g.subcluster_index(GuestOffset(ws));
        let last = g.subcluster_index(GuestOffset(we - 1));
        let touched = subcluster_mask(first, last);
        let head_start = ws - (ws - e.cluster) % scs;
        let tail_end = (e.cluster + (u64::from(last) + 1) * scs).min(cluster_end);
        // The parts of the first and last touched subclusters the write does not cover.
        let partial = |need_head: bool, need_tail: bool| {
            let mut v = Vec::new();
            if need_head && head_start < ws {
                v.push((head_start, ws));
            }
            if need_tail && we < tail_end {
                v.push((we, tail_end));
            }
            v
        };
        let plan = |fills, action| ClusterPlan {
            start: e.cluster,
            fills,
            action,
        };
        Ok(match x.entry {
            L2Entry::Normal { host, copied: true } => {
                self.check_host(e, host.0)?;
                let head_alloc = x.state(first) == SubclusterState::Allocated;
                let tail_alloc = x.state(last) == SubclusterState::Allocated;
                let fills = partial(!head_alloc, !tail_alloc);
                if fills.is_empty() {
                    plan(
                        fills,
                        Action::InPlace {
                            host: host.0,
                            set_alloc: touched & !x.alloc,
                        },
                    )
                } else {
                    plan(
                        fills,
                        Action::Fill {
                            host: Some(host.0),
                            old: Old::Keep,
                            alloc: x.alloc | touched,
                            zero: x.zero & !touched,
                        },
                    )
                }
            }
            L2Entry::Normal {
                host,
                copied: false,
            } => {
                self.check_host(e, host.0)?;
                // The copy keeps every subcluster the shared cluster had allocated.
                let mut fills = partial(true, true);
                let keep = x.alloc & !touched;
                let mut sc = 0u32;
                while sc < 32 {
                    if keep & (1 << sc) != 0 {
                        let run = (keep >> sc).trailing_ones();
                        let s = e.cluster + u64::from(sc) * scs;
                        let t = (e.cluster + u64::from(sc + run) * scs).min(cluster_end);
                        if s < t {
                            fills.push((s, t));
                        }
                        sc += run;
                    } else {
                        sc += 1;
                    }
                }
                plan(
                    fills,
                    Action::Fill {
                        host: None,
                        old: Old::Shared { host: host.0 },
                        alloc: x.alloc | touched,
                        zero: x.zero & !touched,
                    },
                )
            }
            L2Entry::Compressed(_) => plan(
                vec![(e.cluster, ws), (we, cluster_end)],
                Action::Fill {
                    host: None,
                    old: Old::Compressed { raw: e.word },
                    alloc: u32::MAX,
                    zero: 0,
                },
            ),
            L2Entry::Unallocated | L2Entry::Zero { .. } => plan(
                partial(true, true),
                Action::Fill {
                    host: None,
                    old: Old::Keep,
                    alloc: touched,
                    zero: x.zero & !touched,
                },
            ),
        })
    }

    /// A data cluster we are about to write must be where the entry's table says it can be.
    fn check_host(&self, e: &RawEntry, host: u64) -> Result<()> {
        let meta = self.chain.top().qcow2().expect("qcow2");
        if meta.data_file.is_some() {
            if host != e.cluster {
                return Err(self.chain.top().corrupt(format!(
                    "L2 table at {:#x}: guest cluster {:#x} maps to {host:#x} in the data file",
                    e.table, e.cluster
                )));
            }
        } else if host == 0 || host >= meta.file_end.get() {
            return Err(self.chain.top().corrupt(format!(
                "L2 table at {:#x}: guest cluster {:#x} points to {host:#x}, past the end of the file",
                e.table, e.cluster
            )));
        }
        Ok(())
    }

    /// Carries out a plan: one group of clusters at a time, data first, then the L2 entries.
    async fn execute(
        &self,
        offset: u64,
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
        offset: u64,
        buf: IoBuf,
        from: u64,
        to: u64,
        host: u64,
    ) -> (Result<()>, IoBuf) {
        let checked = match self.alloc() {
            Ok(a) => a.check_overlap(HostOffset(host), to - from).await,
            Err(e) => Err(e),
        };
        if let Err(e) = checked {
            return (Err(e), buf);
        }
        let top = self.chain.top();
        let range = (from - offset) as usize..(to - offset) as usize;
        let (res, slice) = top.data_storage().write_at(buf.slice(range), host).await;
        self.note_written(host + (to - from));
        (
            res.map_err(|e| top.io_error("writing data", host, e)),
            slice.into_inner(),
        )
    }

    /// Remembers how far the image file may hold data.
    fn note_written(&self, end: u64) {
        let top = self.chain.top();
        if top.qcow2().is_some_and(|m| m.data_file.is_some()) {
            return;
        }
        if let Some(w) = &self.alloc {
            if end > w.physical_len.get() {
                w.physical_len.set(end);
            }
        }
    }

    /// Writes clusters we own in place, then marks newly written subclusters allocated.
    async fn in_place(
        &self,
        offset: u64,
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
            .write_data(offset, buf, from, to, host + (from - first.start))
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
    async fn mark_subclusters(&self, cluster: u64, host: u64, bits: u32) -> Result<()> {
        self.before_l2_update(false).await?;
        let (word, _) = self
            .alloc()?
            .update_l2_entry(cluster, |word, bitmap| {
                if l2::host_of(word) != host {
                    return None;
                }
                let (alloc, zero) = unpack_bitmap(bitmap);
                let alloc = alloc | bits;
                Some((word, pack_bitmap(alloc, zero & !alloc)))
            })
            .await?;
        if l2::host_of(word) != host {
            return Err(self
                .mark_corrupt(format!(
                    "L2 entry of guest cluster {cluster:#x} changed under a write ({:#x} != {host:#x})",
                    l2::host_of(word)
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
        offset: u64,
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
                let l1i = g.l1_index(GuestOffset(p.start));
                if last_l1 != Some(l1i) {
                    w.l2_for_write(l1i).await?;
                    last_l1 = Some(l1i);
                }
            }
            let fresh_from = w.physical_len.get();
            Ok::<_, EngineError>(match preset {
                Some(h) => (h, false, false),
                None if meta.data_file.is_some() => (first, false, false),
                None => {
                    let h = w.alloc_clusters(n).await?.0;
                    (h, true, h >= fresh_from)
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
                if let Err(e2) = w.free_clusters(HostOffset(host), n, false).await {
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
                w.set_l2_entry(p.start, l2::owned_word(h), bitmap).await?;
            }
            // 3. Release what the entries no longer use.
            let _g = w.meta_lock.lock().await;
            for p in plans {
                match p.action {
                    Action::Fill {
                        old: Old::Shared { host },
                        ..
                    } => w.free_clusters(HostOffset(host), 1, false).await?,
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
        offset: u64,
        buf: IoBuf,
        plans: &[ClusterPlan],
        host: u64,
        fresh: bool,
    ) -> (Result<()>, IoBuf) {
        let cs = self.chain.top().qcow2().expect("qcow2").geom.cluster_size();
        let first = plans[0].start;
        let end = offset + buf.len() as u64;
        let data_from = offset.max(first);
        let data_to = end.min(plans[plans.len() - 1].start + cs);
        // What each fill reads as now; zeros need no copy into a fresh cluster.
        let mut fills: Vec<(u64, u64, Vec<Piece>)> = Vec::new();
        for p in plans {
            for &(s, t) in &p.fills {
                if s >= t {
                    continue;
                }
                let mut pieces = Vec::new();
                if let Err(e) = self.chain.resolve(s, t - s, 0, &mut pieces).await {
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
                .write_data(offset, buf, data_from, data_to, host + (data_from - first))
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
        if let Err(e) = self.fill(span_from, &pieces, &mut span).await {
            return (Err(e), buf);
        }
        span[(data_from - span_from) as usize..(data_to - span_from) as usize]
            .copy_from_slice(&buf[(data_from - offset) as usize..(data_to - offset) as usize]);
        let len = span.len() as u64;
        let (res, _) = self
            .write_data(
                span_from,
                span,
                span_from,
                span_from + len,
                host + (span_from - first),
            )
            .await;
        (res, buf)
    }
}
