//! Rewriting the snapshot table after `-r all` dropped oversized extra data or found entries
//! without the extra data version 3 requires (QEMU's `qcow2_check_fix_snapshot_table`).
//!
//! The new table needs clusters, and clusters need refcounts: the table is placed with the
//! in-memory refcount table, a new refcount structure that counts it is written and switched
//! to, and only then does the header point to the new table. Each step leaves a consistent
//! image behind; what the old table and structure used is freed at the end.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::pass::{Fix, Pass};
use crate::format::limits;
use storage::Storage;

/// Byte offset of `nb_snapshots` (followed by `snapshots_offset`).
const SNAPSHOT_FIELDS: u64 = 60;
/// Extra data QEMU writes for every snapshot at least: VM state size, disk size, icount.
const KNOWN_EXTRA_DATA: usize = 24;

impl<S: Storage> Pass<'_, S> {
    /// Writes the snapshot table again from what was read, with complete extra data.
    pub async fn rewrite_snapshot_table(&mut self) -> Result<(), CheckError> {
        let table = self.encode_snapshot_table()?;
        let saved_res = std::mem::take(&mut self.res);
        let saved_fix = std::mem::replace(&mut self.fix, Fix::NONE);
        self.quiet = true;
        let placed = self.place_snapshot_table(&table).await;
        self.quiet = false;
        self.fix = saved_fix;
        self.res = saved_res;
        placed
    }

    fn encode_snapshot_table(&self) -> Result<Vec<u8>, CheckError> {
        let mut out = Vec::new();
        for sn in &self.meta.snapshots {
            out.resize(out.len().next_multiple_of(8), 0);
            let extra_len = KNOWN_EXTRA_DATA + sn.unknown_extra.len();
            // Both came from 16-bit fields, and extra data is at most 1 KiB.
            let (id_len, name_len) = (sn.id.len() as u16, sn.name.len() as u16);
            out.extend_from_slice(&sn.l1_offset.to_be_bytes());
            out.extend_from_slice(&sn.l1_size.to_be_bytes());
            out.extend_from_slice(&id_len.to_be_bytes());
            out.extend_from_slice(&name_len.to_be_bytes());
            out.extend_from_slice(&sn.date_sec.to_be_bytes());
            out.extend_from_slice(&sn.date_nsec.to_be_bytes());
            out.extend_from_slice(&sn.vm_clock_nsec.to_be_bytes());
            // A VM state too large for the old field reads as a disk-only snapshot there.
            let small = u32::try_from(sn.vm_state_size).unwrap_or(0);
            out.extend_from_slice(&small.to_be_bytes());
            out.extend_from_slice(&(extra_len as u32).to_be_bytes());
            out.extend_from_slice(&sn.vm_state_size.to_be_bytes());
            out.extend_from_slice(&sn.disk_size.to_be_bytes());
            out.extend_from_slice(&sn.icount.to_be_bytes());
            out.extend_from_slice(&sn.unknown_extra);
            out.extend_from_slice(&sn.id);
            out.extend_from_slice(&sn.name);
        }
        if out.len() as u64 > limits::MAX_SNAPSHOT_TABLE_BYTES {
            return Err(CheckError::SnapshotTable {
                offset: self.meta.snapshots_offset,
                detail: "the rewritten table would exceed 64 MiB: File too large".into(),
            });
        }
        Ok(out)
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
        let mut fields = [0u8; 12];
        fields[..4].copy_from_slice(&(self.meta.snapshots.len() as u32).to_be_bytes());
        fields[4..].copy_from_slice(&offset.to_be_bytes());
        io::write(
            self.file,
            "switching the header to the new snapshot table",
            SNAPSHOT_FIELDS,
            &fields,
        )
        .await?;
        io::flush(self.file).await?;
        self.meta.snapshots_offset = offset;
        self.meta.snapshots_size = table.len() as u64;
        self.meta.nb_snapshots = self.meta.snapshots.len() as u32;
        for sn in &mut self.meta.snapshots {
            sn.extra_data_size = (KNOWN_EXTRA_DATA + sn.unknown_extra.len()) as u32;
        }
        // The old table and refcount structure are unused now: free them.
        imrt.clear();
        self.calculate(&mut imrt, &mut rebuild).await?;
        self.compare(&imrt, Fix::LEAKS, &mut rebuild).await?;
        Ok(())
    }
}
