//! Preallocation (`preallocation=metadata|falloc|full`), for `create` (the whole disk) and
//! for the space `resize` adds: L2 tables and data clusters allocated up front, the data
//! area reserved with fallocate (`falloc`) or written with zeros (`full`). With extended L2
//! entries the clusters are reserved but their subclusters stay unallocated, as QEMU leaves
//! them.
//!
//! Order: the clusters' refcounts reach the disk before the L2 entries that point to them
//! (the L2 cache depends on the refcount cache), and the data area exists in the file before
//! either; the caller flushes before it reports the space as part of the disk.

use crate::engine::alloc::{Allocator, L2Change, Precedes};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::layer::{write_zero_data, write_zeros_into};
use crate::engine::metadata_ops::create::Preallocation;
use crate::format::{l2, GuestOffset, HostOffset};
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Allocates L2 tables and data clusters for the whole disk.
    pub async fn preallocate(&self, mode: Preallocation) -> Result<()> {
        let size = self.inner.top().size.get();
        self.preallocate_range(0, size, mode).await?;
        self.inner.flush().await
    }
}

impl<S: Storage + 'static> Image<S> {
    /// Preallocates every unallocated cluster of `[from, to)` (`from` cluster-aligned; `to`
    /// may lie past the disk's current size, which a growing resize sets only afterwards).
    /// Clusters that already map something are left as they are.
    pub(crate) async fn preallocate_range(
        &self,
        from: u64,
        to: u64,
        mode: Preallocation,
    ) -> Result<()> {
        if mode == Preallocation::Off {
            return Ok(());
        }
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let meta = top.qcow2().ok_or_else(|| EngineError::Unsupported {
            image: top.name.clone(),
            what: "metadata preallocation of a raw image".into(),
        })?;
        let g = meta.geom;
        let cs = g.cluster_size();
        let per_table = g.l2_entries() * cs;
        let _paused = (mode == Preallocation::Metadata).then(|| w.pause_growth());
        let mut pos = from;
        while pos < to {
            let table_end = (pos - pos % per_table).saturating_add(per_table).min(to);
            {
                let _g = w.exclusive().await;
                w.l2_for_write(g.l1_index(GuestOffset(pos))).await?;
            }
            let entries = w.l2_entries(GuestOffset(pos), table_end - pos).await?;
            let mut i = 0;
            while i < entries.len() {
                let free =
                    |e: &crate::engine::alloc::l2_entry::RawEntry| (e.word, e.bitmap) == (0, 0);
                if !free(&entries[i]) {
                    i += 1;
                    continue;
                }
                let run = entries[i..].iter().take_while(|e| free(e)).count();
                let first = entries[i].cluster;
                let placed = if meta.data_file.is_some() {
                    self.preallocate_data_file_run(first, run as u64, cs, mode)
                        .await?
                } else {
                    self.preallocate_run(run as u64, cs, mode).await?
                };
                place_run(w, first, placed, run as u64, cs).await?;
                i += run;
            }
            pos = table_end;
        }
        Ok(())
    }

    /// Gives a run of `n` unallocated guest clusters (all in one L2 table) one contiguous
    /// run of new host clusters, with the data area `mode` asks for, and orders their
    /// refcounts before the entries that will point to them. Returns the run's first host
    /// cluster.
    async fn preallocate_run(&self, n: u64, cs: u64, mode: Preallocation) -> Result<Placed> {
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let host = {
            let txn = w.exclusive().await;
            txn.claim_clusters(n).await?.0
        };
        let len = n * cs;
        let end = host + len;
        match mode {
            Preallocation::Falloc => top
                .file
                .write_zeroes_at(host, len, false)
                .await
                .map_err(|e| top.io_error("preallocating", host, e))?,
            Preallocation::Full => write_zero_data(top, host, len).await?,
            Preallocation::Metadata | Preallocation::Off => {}
        }
        // Reading a cluster past the end of the file would fail: the file reaches the run.
        let file_len = top
            .file
            .len()
            .await
            .map_err(|e| top.io_error("getting the file size", 0, e))?;
        if file_len < end {
            top.file
                .set_len(end)
                .await
                .map_err(|source| EngineError::GrowFile {
                    image: top.name.clone(),
                    source,
                })?;
        }
        w.note_file_end(HostOffset(end));
        Ok(Placed {
            host,
            claimed: true,
        })
    }

    /// [`Self::preallocate_run`] for an image with an external data file: there every guest
    /// cluster lives at its own offset of the data file (as QEMU maps them), so nothing is
    /// allocated in the image file and no refcount changes; the data file reaches the run.
    async fn preallocate_data_file_run(
        &self,
        first: GuestOffset,
        n: u64,
        cs: u64,
        mode: Preallocation,
    ) -> Result<Placed> {
        let top = self.inner.top();
        let data = top.data_storage();
        let host = first.0;
        let len = n * cs;
        let end = host
            .checked_add(len)
            .ok_or_else(|| top.corrupt(format!("a run of {n} clusters at {host:#x} overflows")))?;
        match mode {
            Preallocation::Falloc => data
                .write_zeroes_at(host, len, false)
                .await
                .map_err(|e| top.io_error("preallocating the data file", host, e))?,
            Preallocation::Full => write_zeros_into(top, data, host, len).await?,
            Preallocation::Metadata | Preallocation::Off => {}
        }
        let data_len = data
            .len()
            .await
            .map_err(|e| top.io_error("getting the data file size", 0, e))?;
        if data_len < end {
            data.set_len(end)
                .await
                .map_err(|e| top.io_error("extending the data file", end, e))?;
        }
        Ok(Placed {
            host,
            claimed: false,
        })
    }
}

/// Where a preallocated run of guest clusters lives.
struct Placed {
    /// Host offset of the run's first cluster.
    host: u64,
    /// The clusters were claimed in the image file: their refcounts reach disk before the
    /// entries.
    claimed: bool,
}

/// Points the `n` guest clusters from `first` at the run `placed`, one cluster each.
async fn place_run<S: Storage + 'static>(
    w: &Allocator<S>,
    first: GuestOffset,
    placed: Placed,
    n: u64,
    cs: u64,
) -> Result<()> {
    let changes =
        (0..n).map(|i| L2Change::set(first + i * cs, l2::owned_word(placed.host + i * cs), 0));
    w.change_l2(
        Precedes::CallerOrder {
            refcounts: placed.claimed,
        },
        changes,
    )
    .await
}
