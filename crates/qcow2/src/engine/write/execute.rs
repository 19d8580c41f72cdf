//! Carrying out a write's plan: clusters written in place in one I/O per contiguous run;
//! clusters to fill go through the allocator's transaction: allocated together, their
//! copy-on-write data and the guest data written as one I/O, then committed (the allocator
//! points their L2 entries at them and releases the old clusters).

use super::plan::{Action, ClusterPlan, GuestRange, Old};
use crate::engine::alloc::{L2Change, NewWords, OldClusters, Precedes};
use crate::engine::infra::chain::Piece;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Inner;
use crate::engine::infra::span_pool::{zero_uncovered, SpanBuf};
use crate::format::l2;
use crate::format::l2_extended::pack_bitmap;
use crate::format::{GuestOffset, HostOffset};
use storage::{Event, IoBuf, Storage};

impl<S: Storage + 'static> Inner<S> {
    /// Carries out a plan: one group of clusters at a time, data first, then the L2 entries.
    pub(super) async fn execute(
        &self,
        offset: GuestOffset,
        mut buf: IoBuf,
        plans: &[ClusterPlan],
    ) -> (Result<()>, IoBuf) {
        let cs = self.top().qcow2().expect("qcow2").geom.cluster_size();
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
            Ok(a) => a.check_overlap(host, to - from).await.map(|()| {
                a.writing_data(host, to - from);
            }),
            Err(e) => Err(e),
        };
        if let Err(e) = checked {
            return (Err(e), buf);
        }
        let top = self.top();
        top.announce(Event::WriteAio);
        let range = (from - offset) as usize..(to - offset) as usize;
        if let Some(c) = top.qcow2().and_then(|m| m.crypto.as_ref()) {
            // The caller's buffer stays plain: a copy is enciphered and written.
            let mut sealed = IoBuf::from_slice(&buf[range]);
            if let Err(source) = c.encrypt(host.0, from.0, &mut sealed) {
                let e = EngineError::Crypto {
                    image: top.name.clone(),
                    source,
                };
                return (Err(e), buf);
            }
            let (res, _) = top.data_storage().write_at(sealed.into(), host.0).await;
            self.note_written(host + (to - from));
            return (
                res.map_err(|e| top.io_error("writing data", host.0, e)),
                buf,
            );
        }
        let (res, slice) = top.data_storage().write_at(buf.slice(range), host.0).await;
        self.note_written(host + (to - from));
        (
            res.map_err(|e| top.io_error("writing data", host.0, e)),
            slice.into_inner(),
        )
    }

    /// Whether `[host, host + len)` of the data file is a hole, which reads as zeros. Only
    /// asked for the part of a cluster a fill would zero, under the write's exclusive lock on
    /// that cluster: nothing else writes there meanwhile, so the answer holds until the
    /// write. The allocator knows the subclusters it handed out unwritten without asking the
    /// file; a file that cannot tell says data, and the zeros are written.
    async fn host_is_hole(&self, host: HostOffset, len: u64) -> bool {
        if self.alloc().is_ok_and(|a| a.known_unwritten(host, len)) {
            return true;
        }
        match self.top().data_storage().data_run(host.0, len).await {
            Ok((false, n)) => n >= len,
            _ => false,
        }
    }

    /// Remembers how far the image file may hold data.
    fn note_written(&self, end: HostOffset) {
        let top = self.top();
        if top.qcow2().is_some_and(|m| m.data_file.is_some()) {
            return;
        }
        if let Some(w) = self.writer() {
            w.note_file_end(end);
        }
    }

    /// Writes clusters we own in place, then marks newly written subclusters allocated.
    async fn in_place(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
        plans: &[ClusterPlan],
    ) -> (Result<()>, IoBuf) {
        let cs = self.top().qcow2().expect("qcow2").geom.cluster_size();
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
                        let change = L2Change {
                            cluster: p.start,
                            new: NewWords::MarkAllocated {
                                host,
                                bits: set_alloc,
                            },
                            old: OldClusters::Kept,
                        };
                        self.alloc()?.change_l2(Precedes::Data, [change]).await?;
                    }
                }
            }
            Ok(())
        }
        .await;
        (res, buf)
    }

    /// Writes a run of clusters that need filling (and, with `host: None`, new clusters):
    /// the allocator's transaction around copy-on-write data and guest data in one I/O.
    async fn fill_run(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
        plans: &[ClusterPlan],
    ) -> (Result<()>, IoBuf) {
        let top = self.top();
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
        // Allocate, write the data, commit.
        let l1_indexes = plans.iter().map(|p| g.l1_index(p.start));
        let allocation = match w.allocate(l1_indexes, first, n, preset).await {
            Ok(a) => a,
            Err(e) => return (Err(e), buf),
        };
        let host = allocation.host;
        let (res, buf) = self
            .fill_and_write(offset, buf, plans, host, allocation.fresh)
            .await;
        if let Err(e) = res {
            allocation.abandon().await;
            return (Err(e), buf);
        }
        let entries = plans.iter().enumerate().filter_map(|(k, p)| {
            let Action::Fill {
                alloc, zero, old, ..
            } = p.action
            else {
                return None;
            };
            Some(L2Change {
                cluster: p.start,
                new: NewWords::Set {
                    word: l2::owned_word((host + k as u64 * cs).0),
                    bitmap: if g.extended_l2() {
                        pack_bitmap(alloc, zero & !alloc)
                    } else {
                        0
                    },
                },
                old: match old {
                    Old::Shared { host } => OldClusters::Freed(l2::owned_word(host.0)),
                    Old::Compressed { raw } => OldClusters::Freed(raw),
                    Old::Keep => OldClusters::Kept,
                },
            })
        });
        let res = w.change_l2(Precedes::Allocation(allocation), entries).await;
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
        let meta = self.top().qcow2().expect("qcow2");
        let cs = meta.geom.cluster_size();
        // A cluster of an encrypted image reads as ciphertext, not zeros, even where the
        // file has a hole: every byte of it must be written, zeros enciphered like any data.
        let plain = meta.crypto.is_none();
        let first = plans[0].start;
        let end = offset + buf.len() as u64;
        let data_from = offset.max(first);
        let data_to = end.min(plans[plans.len() - 1].start + cs);
        // What each fill reads as now; zeros need no copy where the file already reads as
        // zeros: a fresh cluster, or a part of a cluster that was never written.
        let mut fills: Vec<(GuestOffset, GuestOffset, Vec<Piece>)> = Vec::new();
        for p in plans {
            for &(s, t) in &p.fills {
                if s >= t {
                    continue;
                }
                let mut pieces = Vec::new();
                if let Err(e) = self.resolve(s, t - s, &mut pieces).await {
                    return (Err(e), buf);
                }
                if plain
                    && pieces.iter().all(|q| q.src.is_zero())
                    && (fresh || self.host_is_hole(host + (s - first), t - s).await)
                {
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
        let SpanBuf {
            buf: mut span,
            zeroed,
        } = self.take_span((span_to - span_from) as usize);
        // All fills in one call, in guest order, so that a head and a tail are read
        // concurrently, or as one request when little lies between them.
        fills.sort_by_key(|f| f.0);
        if !zeroed {
            // A reused buffer holds an earlier span's bytes, and the span is written whole:
            // anything neither a fill nor the data writes must be zeroed (fills sit next to
            // the data, so this is normally nothing, but the span's bytes are not assumed).
            let mut covered: Vec<(u64, u64)> = fills.iter().map(|f| (f.0 .0, f.1 .0)).collect();
            covered.push((data_from.0, data_to.0));
            zero_uncovered(&mut span, span_from.0, &mut covered);
        }
        let pieces: Vec<Piece> = fills.iter().flat_map(|f| f.2.iter().copied()).collect();
        if let Err(e) = self.fill(span_from, &pieces, &mut span).await {
            self.give_span(span);
            return (Err(e), buf);
        }
        span[(data_from - span_from) as usize..(data_to - span_from) as usize]
            .copy_from_slice(&buf[(data_from - offset) as usize..(data_to - offset) as usize]);
        let len = span.len() as u64;
        let (res, span) = self
            .write_data(
                span_from,
                span,
                (span_from, span_from + len),
                host + (span_from - first),
            )
            .await;
        self.give_span(span);
        (res, buf)
    }
}
