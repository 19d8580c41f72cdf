//! Zero clusters for a version 2 image, which has no zero flag: a zero cluster with a host
//! cluster gets zeros written there and loses the flag; one without becomes unallocated
//! (nothing shows through without a backing file) or, over a backing file, a new cluster
//! of zeros. The active tables come first, through the L2 cache; then each snapshot's,
//! rewritten on disk (QEMU rewrites them too). And the scan that decides whether a
//! downgrade can go ahead.
//!
//! Order: the zeros (and a new cluster's refcount) are durable before the L2 entry that
//! exposes them (`set_flush_before_writeback`, and the L2 cache's dependency on the
//! refcount cache); the header still says version 3 until all of it is flushed.

use super::progress::Steps;
use crate::engine::alloc::{L2Change, Precedes};
use crate::engine::infra::error::{AmendError, EngineError, Result};
use crate::engine::infra::image::Image;
use crate::format::L1Index;
use crate::format::{l1, l2, GuestOffset, HostCluster, HostOffset};
use storage::Storage;

/// What the snapshots' L2 tables hold.
#[derive(Debug, Default)]
pub(super) struct Scan {
    pub compressed: bool,
}

impl<S: Storage + 'static> Image<S> {
    /// Whether any L2 table of an internal snapshot has a compressed cluster.
    pub(super) async fn scan_snapshot_tables(&self) -> Result<Scan> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let cs = meta.geom.cluster_size() as usize;
        let ext = meta.geom.extended_l2();
        let mut scan = Scan::default();
        for s in self.snapshot_list().await? {
            // A table QEMU will not use stops the expansion that follows, as in QEMU.
            if s.l1_table_problem(meta.geom.cluster_size()).is_some() {
                continue;
            }
            let l1_len = usize::try_from(s.l1_size).unwrap_or(usize::MAX);
            let l1 = top
                .read_file(
                    "reading a snapshot's L1 table",
                    s.l1_table_offset,
                    l1_len * 8,
                )
                .await?;
            for entry in l1.chunks_exact(8) {
                let table = l1::table_of(u64::from_be_bytes(entry.try_into().expect("8 bytes")));
                if table == 0 {
                    continue;
                }
                let t = top
                    .read_file("reading a snapshot's L2 table", table, cs)
                    .await?;
                let n = cs / meta.geom.l2_entry_size() as usize;
                for i in 0..n {
                    let (word, _) = l2::entry_at(&t, i, ext).unwrap_or((0, 0));
                    scan.compressed |= l2::is_compressed(word);
                }
            }
        }
        Ok(scan)
    }

    /// Whether the active L2 tables hold a compressed cluster (one table at a time).
    pub(super) async fn active_has_compressed(&self) -> Result<bool> {
        let w = self.inner.alloc()?;
        let meta = self.inner.top().qcow2_required()?;
        let per_table = meta.geom.l2_entries() * meta.geom.cluster_size();
        let l1_len = meta.l1.borrow().len() as u64;
        for l1i in (0..l1_len).filter(|&i| meta.l2_table(L1Index(i)).is_some()) {
            let entries = w
                .l2_entries(GuestOffset(l1i * per_table), per_table)
                .await?;
            if entries.iter().any(|e| l2::is_compressed(e.word)) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Turns every zero cluster into data (see the module doc): the active L2 tables', then
    /// the snapshots', reporting each L1 entry done to `steps` as QEMU does.
    pub(super) async fn expand_zero_clusters(&self, steps: &Steps<'_>) -> Result<()> {
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let g = meta.geom;
        let cs = g.cluster_size();
        let backed = self.inner.has_backing();
        let per_table = g.l2_entries() * cs;
        let l1_len = meta.l1.borrow().len() as u64;
        let snapshots = self.snapshot_list().await?;
        let work = snapshots
            .iter()
            .fold(l1_len, |n, s| n.saturating_add(u64::from(s.l1_size)));
        for l1i in 0..l1_len {
            if meta.l2_table(L1Index(l1i)).is_some() {
                let start = GuestOffset(l1i * per_table);
                let zeros: Vec<_> = w
                    .l2_entries(start, per_table)
                    .await?
                    .into_iter()
                    .filter(|e| l2::has_zero_flag(e.word))
                    .collect();
                if !zeros.is_empty() {
                    {
                        let _g = w.exclusive().await;
                        w.l2_for_write(L1Index(l1i)).await?;
                    }
                    self.inner.l2().set_flush_before_writeback();
                    for e in zeros {
                        self.expand_one(e.cluster, e.word, backed).await?;
                    }
                }
            }
            steps.at(l1i + 1, work);
        }
        // The snapshots' tables are rewritten on disk, past the L2 cache: everything it
        // holds goes out first, and a table rewritten here is forgotten by it.
        self.inner.flush().await?;
        let mut done = l1_len;
        for s in &snapshots {
            if let Some(problem) = s.l1_table_problem(cs) {
                return Err(EngineError::Amend {
                    image: top.name.clone(),
                    source: AmendError::ZeroExpansion(problem),
                });
            }
            let l1_len = usize::try_from(s.l1_size).unwrap_or(usize::MAX);
            let l1 = top
                .read_file(
                    "reading a snapshot's L1 table",
                    s.l1_table_offset,
                    l1_len.saturating_mul(8),
                )
                .await?;
            for entry in l1.chunks_exact(8) {
                let table = l1::table_of(u64::from_be_bytes(entry.try_into().expect("8 bytes")));
                if table != 0 {
                    self.expand_inactive_table(table, backed).await?;
                }
                done += 1;
                steps.at(done, work);
            }
        }
        Ok(())
    }

    /// Expands the zero clusters of the snapshot L2 table at `table`, which the active L1
    /// table no longer uses (the active pass made every table it uses its own). The table
    /// may be shared by several snapshots: a new cluster gets one reference per user of
    /// the table. An allocated zero cluster is zeroed in place only when the table is all
    /// that refers to it; otherwise (QEMU zeroes it anyway, which would change what another
    /// table reads there) it gets a cluster of its own.
    async fn expand_inactive_table(&self, table: u64, backed: bool) -> Result<()> {
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let g = meta.geom;
        let cs = g.cluster_size();
        let ext = g.extended_l2();
        if table % cs != 0 {
            return Err(w
                .mark_corrupt(format!(
                    "a snapshot's L2 table offset {table:#x} is unaligned"
                ))
                .await);
        }
        let mut t = top
            .read_file("reading a snapshot's L2 table", table, cs as usize)
            .await?
            .to_vec();
        let n = cs / g.l2_entry_size();
        let zeros: Vec<(usize, u64)> = (0..n as usize)
            .filter_map(|i| l2::entry_at(&t, i, ext).map(|(word, _)| (i, word)))
            .filter(|&(_, word)| !l2::is_compressed(word) && l2::has_zero_flag(word))
            .collect();
        if zeros.is_empty() {
            return Ok(());
        }
        let active = meta.l1.borrow().iter().any(|&e| l1::table_of(e) == table);
        if active {
            // The active pass made every table it uses with zeros its own.
            return Err(w
                .mark_corrupt(format!(
                    "the L2 table at {table:#x} still holds zero clusters after the active ones were expanded"
                ))
                .await);
        }
        w.check_inactive_l2_overlap(HostOffset(table), cs).await?;
        let users = w.refcount(HostCluster(table / cs)).await?;
        if users == 0 {
            return Err(w
                .mark_corrupt(format!(
                    "a snapshot's L2 table at {table:#x} has refcount 0"
                ))
                .await);
        }
        let mut released = Vec::new();
        for (i, word) in zeros {
            let host = l2::host_of(word);
            if host != 0 && host % cs != 0 {
                return Err(w
                    .mark_corrupt(format!(
                        "cluster offset {host:#x} unaligned (L2 table {table:#x}, index {i:#x})"
                    ))
                    .await);
            }
            let in_place = host != 0 && w.refcount(HostCluster(host / cs)).await? == users;
            let new_word = if in_place {
                self.zero_host(host, cs).await?;
                l2::with_copied(l2::without_zero_flag(word), users == 1)
            } else if host == 0 && !backed {
                0
            } else {
                let new = {
                    let txn = w.exclusive().await;
                    let new = txn.claim_clusters(1).await?;
                    if users > 1 {
                        w.update_refcount(HostCluster(new.0 / cs), (users - 1) as i64)
                            .await?;
                    }
                    new
                };
                self.zero_host(new.0, cs).await?;
                if host != 0 {
                    released.push(host);
                }
                l2::with_copied(l2::owned_word(new.0), users == 1)
            };
            // `i` came from an entry read from this very table.
            let placed = l2::set_entry_at(&mut t, i, ext, new_word, 0);
            debug_assert!(placed);
        }
        // The zeros and the new clusters' refcounts are durable before the table that
        // points to them.
        self.inner.flush().await?;
        self.inner
            .l2()
            .forget(|k| k.layer == 0 && k.table == HostOffset(table));
        w.write_meta("rewriting a snapshot's L2 table", table, &t)
            .await?;
        w.sync().await?;
        for host in released {
            let _g = w.exclusive().await;
            w.update_refcount(HostCluster(host / cs), -(users as i64))
                .await?;
        }
        w.mapping_changed();
        Ok(())
    }

    /// Expands one zero cluster at guest offset `cluster` whose entry word is `word`.
    async fn expand_one(&self, cluster: GuestOffset, word: u64, backed: bool) -> Result<()> {
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let cs = top.qcow2_required()?.geom.cluster_size();
        let host = l2::host_of(word);
        let owned = l2::is_copied(word);
        if host != 0 && owned {
            self.zero_host(host, cs).await?;
            let change = L2Change::set(cluster, l2::without_zero_flag(word), 0);
            return w
                .change_l2(Precedes::CallerOrder { refcounts: false }, [change])
                .await;
        }
        if host == 0 && !backed {
            return w
                .change_l2(
                    Precedes::CallerOrder { refcounts: false },
                    [L2Change::set(cluster, 0, 0)],
                )
                .await;
        }
        // A new cluster of zeros: over a backing file, or instead of a shared one.
        let new = {
            let txn = w.exclusive().await;
            txn.claim_clusters(1).await?.0
        };
        self.zero_host(new, cs).await?;
        // The shared cluster loses this entry's reference once the entry changed.
        let change = L2Change::set(cluster, l2::owned_word(new), 0).releasing(word, false);
        w.change_l2(Precedes::CallerOrder { refcounts: true }, [change])
            .await
    }

    /// Makes host cluster `host` read as zeros.
    async fn zero_host(&self, host: u64, cs: u64) -> Result<()> {
        let w = self.inner.alloc()?;
        w.check_overlap(HostOffset(host), cs).await?;
        let top = self.inner.top();
        top.file
            .write_zeroes_at(host, cs, false)
            .await
            .map_err(|e| top.io_error("writing zeros", host, e))
    }
}
