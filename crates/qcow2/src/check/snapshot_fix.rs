//! Rewriting the snapshot table after `-r all` dropped oversized extra data or found entries
//! without the extra data version 3 requires (QEMU's `qcow2_check_fix_snapshot_table`).
//!
//! The new table goes where QEMU would put it: the first run of free clusters, by the stored
//! refcounts (which the check has just made right). Their refcounts are written and flushed
//! first, then the table, then the header switches to it in one flushed write, and only then
//! are the old table's clusters freed; a crash between any two steps leaves a leak at worst.
//! When the free run is not covered by existing refcount blocks, the table is placed with the
//! in-memory refcount table instead and a new refcount structure that counts it is written
//! (see `rebuild`) before the header switches.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::meta::Snapshot;
use super::ondisk::Refblocks;
use super::pass::{Fix, Pass};
use crate::format::refcount;
use crate::format::snapshot::encode_qemu_table;
use crate::format::{header, FormatError, SnapshotTableEntry};
use storage::Storage;

/// Extra data QEMU writes for every snapshot at least: VM state size, disk size, icount.
const KNOWN_EXTRA_DATA: usize = 24;

impl<S: Storage> Pass<'_, S> {
    /// Writes the snapshot table again from what was read, with complete extra data.
    pub async fn rewrite_snapshot_table(&mut self) -> Result<(), CheckError> {
        let table = self.encode_snapshot_table()?;
        let saved_res = std::mem::take(&mut self.res);
        let saved_fix = std::mem::replace(&mut self.fix, Fix::NONE);
        self.quiet = true;
        let placed = match self
            .alloc_stored(self.meta.clusters(table.len() as u64))
            .await
        {
            Ok(Some(start)) => self.switch_snapshot_table(&table, start).await,
            Ok(None) => self.place_snapshot_table(&table).await,
            Err(e) => Err(e),
        };
        self.quiet = false;
        self.fix = saved_fix;
        self.res = saved_res;
        placed
    }

    fn encode_snapshot_table(&self) -> Result<Vec<u8>, CheckError> {
        let broken = |detail: String| CheckError::SnapshotTable {
            offset: self.meta.snapshots_offset,
            detail,
        };
        let entries: Vec<SnapshotTableEntry> =
            self.meta.snapshots.iter().map(table_entry).collect();
        let out = encode_qemu_table(&entries).map_err(|e| match e {
            FormatError::LimitExceeded {
                field: "snapshot table size",
                ..
            } => broken("the rewritten table would exceed 64 MiB: File too large".into()),
            other => broken(other.to_string()),
        })?;
        Ok(out)
    }

    /// Finds the first `count` free clusters by the stored refcounts and sets their
    /// refcounts to 1 (durably). `None` when the run is not covered by refcount blocks.
    async fn alloc_stored(&mut self, count: u64) -> Result<Option<u64>, CheckError> {
        let mut rb = Refblocks::default();
        let limit = self.meta.clusters(self.file_len) + count;
        let (mut start, mut run) = (0u64, 0u64);
        let mut k = 0u64;
        while run < count {
            if k > limit {
                return Ok(None);
            }
            match self.stored_refcount(&mut rb, k).await {
                Ok(0) => {
                    if run == 0 {
                        start = k;
                    }
                    run += 1;
                }
                Ok(_) => run = 0,
                Err(_) => return Ok(None),
            }
            k += 1;
        }
        if (start..start + count).any(|c| !self.has_refblock(c)) {
            return Ok(None);
        }
        for c in start..start + count {
            self.set_stored_refcount(&mut rb, c, 1).await?;
        }
        self.write_back_refblock(&mut rb).await?;
        io::flush(self.file).await?;
        Ok(Some(start))
    }

    /// Whether cluster `k`'s refcount lives in an existing, aligned refcount block.
    fn has_refblock(&self, k: u64) -> bool {
        let index = k >> self.meta.refblock_bits;
        usize::try_from(index)
            .ok()
            .and_then(|i| self.meta.reftable.get(i))
            .is_some_and(|&raw| {
                let block = refcount::block_of(raw);
                block != 0 && self.meta.in_cluster(block) == 0
            })
    }

    /// Writes the table into the clusters at `start` (already counted), switches the header
    /// to it and frees the old table.
    async fn switch_snapshot_table(&mut self, table: &[u8], start: u64) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size;
        let offset = start * cs;
        self.guarded_write("writing the snapshot table", offset, table, &[])
            .await?;
        io::flush(self.file).await?;
        let (old_offset, old_size) = (self.meta.snapshots_offset, self.meta.snapshots_size);
        self.point_header_at_snapshots(offset, table.len() as u64)
            .await?;
        // One reference less for every cluster the old table used.
        let mut rb = Refblocks::default();
        if old_size > 0 {
            let bits = self.meta.cluster_bits;
            for c in (old_offset >> bits)..=((old_offset + old_size - 1) >> bits) {
                if let Ok(r) = self.stored_refcount(&mut rb, c).await {
                    if r > 0 {
                        self.set_stored_refcount(&mut rb, c, r - 1).await?;
                    }
                }
            }
        }
        self.write_back_refblock(&mut rb).await?;
        io::flush(self.file).await
    }

    /// Switches the header to the snapshot table at `offset` in one flushed write.
    async fn point_header_at_snapshots(
        &mut self,
        offset: u64,
        size: u64,
    ) -> Result<(), CheckError> {
        // At most 65536 snapshots were read.
        let count = self.meta.snapshots.len() as u32;
        io::write_header(
            self.file,
            "switching the header to the new snapshot table",
            header::snapshots_update(count, offset),
        )
        .await?;
        io::flush(self.file).await?;
        self.meta.snapshots_offset = offset;
        self.meta.snapshots_size = size;
        self.meta.nb_snapshots = self.meta.snapshots.len() as u32;
        for sn in &mut self.meta.snapshots {
            sn.extra_data_size = (KNOWN_EXTRA_DATA + sn.unknown_extra.len()) as u32;
        }
        self.layout_changed();
        Ok(())
    }

    async fn place_snapshot_table(&mut self, table: &[u8]) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size;
        let mut imrt = Imrt::new(self.meta.clusters(self.file_len))?;
        let mut rebuild = false;
        self.calculate(&mut imrt, &mut rebuild).await?;
        let mut first_free = 0;
        let start = imrt.alloc(self.meta.clusters(table.len() as u64), &mut first_free)?;
        let offset = start * cs;
        self.guarded_write("writing the snapshot table", offset, table, &[])
            .await?;
        self.rebuild(&mut imrt).await?;
        self.point_header_at_snapshots(offset, table.len() as u64)
            .await?;
        // The old table and refcount structure are unused now: free them.
        imrt.clear();
        self.calculate(&mut imrt, &mut rebuild).await?;
        self.compare(&imrt, Fix::LEAKS, &mut rebuild).await?;
        Ok(())
    }
}

/// The entry QEMU writes for a snapshot: complete extra data (VM state size, disk size,
/// icount, then what it kept of the rest), and a VM state too large for the old 32-bit
/// field as 0 there (a disk-only snapshot for readers of that field alone).
fn table_entry(sn: &Snapshot) -> SnapshotTableEntry {
    let extra_data = SnapshotTableEntry::full_extra_data(
        sn.vm_state_size,
        sn.disk_size,
        sn.icount,
        &sn.unknown_extra,
    );
    SnapshotTableEntry {
        l1_table_offset: sn.l1_offset,
        l1_size: sn.l1_size,
        id: sn.id.clone(),
        name: sn.name.clone(),
        date_sec: sn.date_sec,
        date_nsec: sn.date_nsec,
        vm_clock_nsec: sn.vm_clock_nsec,
        vm_state_size_32: u32::try_from(sn.vm_state_size).unwrap_or(0),
        extra_data,
    }
}
