//! Reading the snapshot table the way a check does (QEMU's `qcow2_check_read_snapshot_table`):
//! leniently enough to check the rest of the image, counting what is wrong with the table
//! itself, and with `-r all` dropping snapshots past QEMU's limits.

use super::error::CheckError;
use super::io;
use super::meta::Snapshot;
use super::pass::Pass;
use super::report::FindingKind;
use crate::format::{header, limits};
use storage::Storage;

/// Extra data every version 3 snapshot entry must have (VM state size and disk size).
const V3_MIN_EXTRA_DATA: u32 = 16;
/// Extra data fields QEMU knows (VM state size, disk size, instruction count).
const KNOWN_EXTRA_DATA: u32 = 24;

fn be16(b: &[u8], pos: usize) -> u16 {
    b.get(pos..pos + 2)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u16::from_be_bytes)
}

fn be32(b: &[u8], pos: usize) -> u32 {
    b.get(pos..pos + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_be_bytes)
}

fn be64(b: &[u8], pos: usize) -> u64 {
    b.get(pos..pos + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_be_bytes)
}

impl<S: Storage> Pass<'_, S> {
    /// Reads the snapshot table into `self.meta`, counting what is wrong with it into
    /// `self.res` (the caller keeps this apart from the refcount results, as QEMU does).
    pub async fn read_snapshots(&mut self) -> Result<(), CheckError> {
        let repair = self.fix.errors;
        let offset = self.meta.snapshots_offset;
        let mut nb = self.meta.nb_snapshots;
        let mut reduced = 0u32;
        let mut extra_dropped = 0u32;
        let fail = |detail: String| CheckError::SnapshotTable { offset, detail };

        if nb > limits::MAX_SNAPSHOTS && repair {
            self.log(
                FindingKind::Repair,
                format!(
                    "Discarding {} overhanging snapshots",
                    nb - limits::MAX_SNAPSHOTS
                ),
            );
            reduced += nb - limits::MAX_SNAPSHOTS;
            nb = limits::MAX_SNAPSHOTS;
        }
        let fixed = limits::SNAPSHOT_ENTRY_FIXED_SIZE;
        let fits = offset
            .checked_add(u64::from(nb) * fixed)
            .is_some_and(|e| e <= limits::MAX_FILE_OFFSET);
        let problem = if nb > limits::MAX_SNAPSHOTS {
            Some("Snapshot table too large".to_string())
        } else if self.meta.in_cluster(offset) != 0 || !fits {
            Some("Snapshot table offset invalid".to_string())
        } else {
            None
        };
        if let Some(p) = problem {
            self.res.check_errors += 1;
            self.log(FindingKind::Error, format!("ERROR {p}"));
            if nb > limits::MAX_SNAPSHOTS {
                self.log(
                    FindingKind::Error,
                    format!("You can force-remove all {} overhanging snapshots with qemu-img check -r all", nb - limits::MAX_SNAPSHOTS),
                );
            }
            self.meta.snapshots_offset = 0;
            self.meta.nb_snapshots = 0;
            return Err(fail(p));
        }

        let mut pos = offset;
        let mut table_len = 0u64;
        let mut snapshots = Vec::new();
        let mut kept = nb;
        for i in 0..nb {
            let before = pos;
            table_len = table_len.next_multiple_of(8);
            pos = pos.next_multiple_of(8);
            let head = self.read_snapshot_bytes(pos, fixed).await?;
            pos += fixed;
            let l1_offset = be64(&head, 0);
            let l1_size = be32(&head, 8);
            let id_len = u64::from(be16(&head, 12));
            let name_len = u64::from(be16(&head, 14));
            let mut extra = be32(&head, 36);
            let mut truncate = false;
            if extra > limits::MAX_SNAPSHOT_EXTRA_DATA {
                if !repair {
                    self.res.check_errors += 1;
                    self.log(
                        FindingKind::Error,
                        format!("ERROR failed to read the snapshot table: Too much extra metadata in snapshot table entry {i}"),
                    );
                    self.log(
                        FindingKind::Error,
                        "You can force-remove this extra metadata with qemu-img check -r all"
                            .into(),
                    );
                    self.meta.snapshots_offset = 0;
                    self.meta.nb_snapshots = 0;
                    return Err(fail(format!(
                        "too much extra metadata in entry {i}: File too large"
                    )));
                }
                self.log(
                    FindingKind::Repair,
                    format!(
                        "Discarding too much extra metadata in snapshot table entry {i} ({extra} > {})",
                        limits::MAX_SNAPSHOT_EXTRA_DATA
                    ),
                );
                extra_dropped += 1;
                truncate = true;
            }
            let known = self
                .read_snapshot_bytes(pos, u64::from(extra.min(KNOWN_EXTRA_DATA)))
                .await?;
            pos += u64::from(extra.min(KNOWN_EXTRA_DATA));
            let mut unknown_extra = Vec::new();
            if extra > KNOWN_EXTRA_DATA {
                let extra_end = pos + u64::from(extra - KNOWN_EXTRA_DATA);
                if truncate {
                    extra = limits::MAX_SNAPSHOT_EXTRA_DATA;
                }
                unknown_extra = self
                    .read_snapshot_bytes(pos, u64::from(extra - KNOWN_EXTRA_DATA))
                    .await?;
                pos = extra_end;
            }
            let id = self.read_snapshot_bytes(pos, id_len).await?;
            pos += id_len;
            let name = self.read_snapshot_bytes(pos, name_len).await?;
            pos += name_len;
            table_len += fixed + u64::from(extra) + id_len + name_len;
            if table_len > limits::MAX_SNAPSHOT_TABLE_BYTES || pos - offset > i32::MAX as u64 {
                if !repair {
                    self.res.check_errors += 1;
                    self.log(
                        FindingKind::Error,
                        "ERROR failed to read the snapshot table: Snapshot table is too big".into(),
                    );
                    self.log(
                        FindingKind::Error,
                        format!("You can force-remove all {} overhanging snapshots with qemu-img check -r all", nb - i),
                    );
                    self.meta.snapshots_offset = 0;
                    self.meta.nb_snapshots = 0;
                    return Err(fail(
                        "the table is bigger than 64 MiB: File too large".into(),
                    ));
                }
                self.log(
                    FindingKind::Repair,
                    format!(
                        "Discarding {} overhanging snapshots (snapshot table is too big)",
                        nb - i
                    ),
                );
                reduced += nb - i;
                kept = i;
                pos = before;
                break;
            }
            snapshots.push(Snapshot {
                l1_offset,
                l1_size,
                id,
                name,
                extra_data_size: extra,
                date_sec: be32(&head, 16),
                date_nsec: be32(&head, 20),
                vm_clock_nsec: be64(&head, 24),
                vm_state_size: if known.len() >= 8 {
                    be64(&known, 0)
                } else {
                    u64::from(be32(&head, 32))
                },
                disk_size: if known.len() >= 16 {
                    be64(&known, 8)
                } else {
                    self.meta.virtual_size
                },
                icount: if known.len() >= 24 {
                    be64(&known, 16)
                } else {
                    u64::MAX
                },
                unknown_extra,
            });
        }
        let nb = kept;
        self.meta.snapshots = snapshots;
        self.meta.nb_snapshots = nb;
        self.meta.snapshots_size = pos - offset;
        self.res.corruptions += u64::from(reduced) + u64::from(extra_dropped);

        if reduced > 0 {
            // The header must agree with what the rest of the check looks at; the dropped
            // entries' clusters become leaks, which the check frees.
            let written = match io::write(
                self.file,
                "updating the snapshot count",
                header::nb_snapshots_update(nb).offset,
                &header::nb_snapshots_update(nb).bytes,
            )
            .await
            {
                Ok(()) => io::flush(self.file).await,
                Err(e) => Err(e),
            };
            if let Err(e) = written {
                self.res.check_errors += 1;
                self.log(
                    FindingKind::Error,
                    format!("ERROR failed to update the snapshot count in the image header: {e}"),
                );
                return Err(e);
            }
            self.meta.header.nb_snapshots = nb;
            self.res.corruptions_fixed += u64::from(reduced);
            self.res.corruptions -= u64::from(reduced);
        }

        if self.meta.header.version >= 3 {
            for i in 0..self.meta.snapshots.len() {
                if self.meta.snapshots[i].extra_data_size < V3_MIN_EXTRA_DATA {
                    self.res.corruptions += 1;
                    self.log(
                        if repair {
                            FindingKind::Repair
                        } else {
                            FindingKind::Error
                        },
                        format!(
                            "{} snapshot table entry {i} is incomplete",
                            Self::verb(repair)
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// Reads `len` bytes of the snapshot table (at most 64 KiB: names, IDs, fixed parts).
    async fn read_snapshot_bytes(&mut self, pos: u64, len: u64) -> Result<Vec<u8>, CheckError> {
        match io::read(self.file, "reading the snapshot table", pos, len as usize).await {
            Ok(b) => Ok(b.to_vec()),
            Err(e) => {
                self.res.check_errors += 1;
                self.log(
                    FindingKind::Error,
                    format!("ERROR failed to read the snapshot table: {e}"),
                );
                self.meta.snapshots_offset = 0;
                self.meta.nb_snapshots = 0;
                Err(e)
            }
        }
    }
}
