//! Reading the snapshot table the way a check does (QEMU's `qcow2_check_read_snapshot_table`):
//! leniently enough to check the rest of the image, counting what is wrong with the table
//! itself, and with `-r all` dropping snapshots past QEMU's limits.

use super::error::CheckError;
use super::io;
use super::meta::Snapshot;
use super::pass::Pass;
use super::report::FindingKind;
use crate::format::header::{self, Strictness};
use crate::format::snapshot::{SnapshotEntrySizes, SnapshotTableEntry};
use crate::format::{limits, FormatError, Location, Structure};
use storage::Storage;

/// Extra data every version 3 snapshot entry must have (VM state size and disk size).
const V3_MIN_EXTRA_DATA: u32 = 16;

/// The text of `EFBIG`, QEMU's error for a snapshot table it will not read.
const FILE_TOO_LARGE: &str = "File too large";
/// Extra data fields QEMU knows (VM state size, disk size, instruction count).
const KNOWN_EXTRA_DATA: u32 = 24;

/// What reading one snapshot table entry gave.
enum EntryRead {
    /// The entry, where the next one starts, the table's length so far, and whether its
    /// extra data was cut to QEMU's limit.
    Entry {
        snapshot: Snapshot,
        end: u64,
        len: u64,
        extra_truncated: bool,
    },
    /// The table would pass 64 MiB with this entry: it ends before it (with `-r all`). The
    /// entry's extra data may have been found too large first, which still counts.
    TableTooBig { extra_truncated: bool },
}

impl<S: Storage> Pass<'_, S> {
    /// Reads the snapshot table into `self.meta`, counting what is wrong with it into
    /// `self.res` (the caller keeps this apart from the refcount results, as QEMU does).
    pub async fn read_snapshots(&mut self) -> Result<(), CheckError> {
        let offset = self.meta.snapshots_offset;
        let (nb, mut reduced) = self.snapshot_table_placement()?;
        let mut pos = offset;
        let mut table_len = 0u64;
        let mut snapshots = Vec::new();
        let mut kept = nb;
        let mut extra_dropped = 0u32;
        for i in 0..nb {
            match self.read_snapshot_entry(i, nb, pos, table_len).await? {
                EntryRead::Entry {
                    snapshot,
                    end,
                    len,
                    extra_truncated,
                } => {
                    snapshots.push(snapshot);
                    pos = end;
                    table_len = len;
                    extra_dropped += u32::from(extra_truncated);
                }
                EntryRead::TableTooBig { extra_truncated } => {
                    extra_dropped += u32::from(extra_truncated);
                    reduced += nb - i;
                    kept = i;
                    break;
                }
            }
        }
        self.meta.snapshots = snapshots;
        self.meta.nb_snapshots = kept;
        self.meta.snapshots_size = pos - offset;
        self.layout_changed();
        self.res.corruptions += u64::from(reduced) + u64::from(extra_dropped);
        if reduced > 0 {
            self.write_snapshot_count(kept, reduced).await?;
        }
        self.flag_incomplete_snapshots();
        Ok(())
    }

    /// Checks the table's size and placement; with `-r all`, snapshots beyond QEMU's limit
    /// are dropped. Returns the entries to read and how many were dropped.
    fn snapshot_table_placement(&mut self) -> Result<(u32, u32), CheckError> {
        let offset = self.meta.snapshots_offset;
        let mut nb = self.meta.nb_snapshots;
        let mut reduced = 0;
        if nb > limits::MAX_SNAPSHOTS && self.fix.errors {
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
        let fits = offset
            .checked_add(u64::from(nb) * limits::SNAPSHOT_ENTRY_FIXED_SIZE)
            .is_some_and(|e| e <= limits::MAX_FILE_OFFSET);
        let (problem, errno) = if nb > limits::MAX_SNAPSHOTS {
            ("snapshot table too large", FILE_TOO_LARGE)
        } else if self.meta.in_cluster(offset) != 0 || !fits {
            ("snapshot table offset invalid", "Invalid argument")
        } else {
            return Ok((nb, reduced));
        };
        self.res.check_errors += 1;
        self.log(FindingKind::Reported, format!("ERROR {problem}"));
        if nb > limits::MAX_SNAPSHOTS {
            self.log(
                FindingKind::Error,
                format!(
                    "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                    nb - limits::MAX_SNAPSHOTS
                ),
            );
        }
        Err(self.give_up_on_snapshots(errno))
    }

    /// Forgets the snapshot table (the rest of the check runs without it) and returns the
    /// error that ends reading it.
    fn give_up_on_snapshots(&mut self, errno: &'static str) -> CheckError {
        self.forget_snapshots();
        CheckError::SnapshotTableUnread(errno)
    }

    /// Runs the rest of the check without the snapshot table.
    fn forget_snapshots(&mut self) -> u64 {
        let offset = self.meta.snapshots_offset;
        self.meta.snapshots_offset = 0;
        self.meta.nb_snapshots = 0;
        self.layout_changed();
        offset
    }

    /// Reads entry `i` of `nb` at `pos`, the table so far being `table_len` bytes long. An
    /// entry with too much extra data is an error, or with `-r all` keeps only what QEMU
    /// keeps; a table past 64 MiB is an error, or with `-r all` ends before this entry.
    async fn read_snapshot_entry(
        &mut self,
        i: u32,
        nb: u32,
        pos: u64,
        table_len: u64,
    ) -> Result<EntryRead, CheckError> {
        let entry_offset = pos.next_multiple_of(8);
        let head = self
            .read_snapshot_bytes(entry_offset, limits::SNAPSHOT_ENTRY_FIXED_SIZE)
            .await?;
        let at = Location::entry(Structure::SnapshotTable, entry_offset, u64::from(i));
        let sizes = match SnapshotEntrySizes::decode(&head, at) {
            Ok(sizes) => sizes,
            Err(e) => return Err(self.undecodable_snapshot_table(e)),
        };
        let extra_truncated = sizes.extra_data_too_large();
        if extra_truncated {
            self.too_much_extra_data(i, sizes.extra_data)?;
        }
        let (bytes, end) = self.read_entry_parts(entry_offset, head, sizes).await?;
        // The table's length counts only the extra data kept, as QEMU's does.
        let table_len = table_len.next_multiple_of(8) + bytes.len() as u64;
        let offset = self.meta.snapshots_offset;
        if table_len > limits::MAX_SNAPSHOT_TABLE_BYTES || end - offset > i32::MAX as u64 {
            self.snapshot_table_too_big(i, nb)?;
            return Ok(EntryRead::TableTooBig { extra_truncated });
        }
        let entry =
            SnapshotTableEntry::decode_with(&bytes, entry_offset, u64::from(i), Strictness::Check);
        let snapshot = match entry {
            Ok((entry, _)) => self.snapshot_of(entry),
            Err(e) => return Err(self.undecodable_snapshot_table(e)),
        };
        Ok(EntryRead::Entry {
            snapshot,
            end,
            len: table_len,
            extra_truncated,
        })
    }

    /// Reads the rest of the entry whose fixed part `head` starts at `entry_offset`, in the
    /// pieces QEMU reads: the extra data it knows, the rest of the extra data as far as it is
    /// kept, the ID and the name. Returns the entry with only the kept extra data, and where
    /// the entry ends in the file.
    async fn read_entry_parts(
        &mut self,
        entry_offset: u64,
        head: Vec<u8>,
        sizes: SnapshotEntrySizes,
    ) -> Result<(Vec<u8>, u64), CheckError> {
        let kept = sizes.kept_extra_data(Strictness::Check);
        let mut pos = entry_offset + limits::SNAPSHOT_ENTRY_FIXED_SIZE;
        let known = kept.min(KNOWN_EXTRA_DATA);
        let mut parts = vec![head, self.read_snapshot_bytes(pos, u64::from(known)).await?];
        if kept > known {
            let rest = u64::from(kept - known);
            parts.push(
                self.read_snapshot_bytes(pos + u64::from(known), rest)
                    .await?,
            );
        }
        pos += u64::from(sizes.extra_data);
        for len in [sizes.id, sizes.name] {
            parts.push(self.read_snapshot_bytes(pos, u64::from(len)).await?);
            pos += u64::from(len);
        }
        Ok((parts.concat(), pos))
    }

    /// Reports extra data past QEMU's limit in entry `i`: the end of reading the table, or
    /// with `-r all` a note that the excess is dropped.
    fn too_much_extra_data(&mut self, i: u32, extra: u32) -> Result<(), CheckError> {
        if !self.fix.errors {
            self.res.check_errors += 1;
            self.log(
                FindingKind::Reported,
                format!("ERROR failed to read the snapshot table: Too much extra metadata in snapshot table entry {i}"),
            );
            self.log(
                FindingKind::Error,
                "You can force-remove this extra metadata with qemu-img check -r all".into(),
            );
            return Err(self.give_up_on_snapshots(FILE_TOO_LARGE));
        }
        self.log(
            FindingKind::Repair,
            format!(
                "Discarding too much extra metadata in snapshot table entry {i} ({extra} > {})",
                limits::MAX_SNAPSHOT_EXTRA_DATA
            ),
        );
        Ok(())
    }

    /// Reports a table that passes 64 MiB with entry `i` of `nb`: the end of reading it, or
    /// with `-r all` a note that the entries from `i` on are dropped.
    fn snapshot_table_too_big(&mut self, i: u32, nb: u32) -> Result<(), CheckError> {
        if !self.fix.errors {
            self.res.check_errors += 1;
            self.log(
                FindingKind::Reported,
                "ERROR failed to read the snapshot table: Snapshot table is too big".into(),
            );
            self.log(
                FindingKind::Error,
                format!(
                    "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                    nb - i
                ),
            );
            return Err(self.give_up_on_snapshots(FILE_TOO_LARGE));
        }
        self.log(
            FindingKind::Repair,
            format!(
                "Discarding {} overhanging snapshots (snapshot table is too big)",
                nb - i
            ),
        );
        Ok(())
    }

    /// A snapshot as the check keeps it. Missing extra fields take QEMU's defaults.
    fn snapshot_of(&self, entry: SnapshotTableEntry) -> Snapshot {
        let known = (KNOWN_EXTRA_DATA as usize).min(entry.extra_data.len());
        Snapshot {
            l1_offset: entry.l1_table_offset,
            l1_size: entry.l1_size,
            // At most QEMU's 1 KiB limit: the rest was not kept.
            extra_data_size: entry.extra_data.len() as u32,
            date_sec: entry.date_sec,
            date_nsec: entry.date_nsec,
            vm_clock_nsec: entry.vm_clock_nsec,
            vm_state_size: entry.vm_state_size(),
            disk_size: entry.disk_size().unwrap_or(self.meta.virtual_size),
            icount: entry.icount().unwrap_or(u64::MAX),
            unknown_extra: entry.extra_data[known..].to_vec(),
            id: entry.id,
            name: entry.name,
        }
    }

    /// Gives up on a snapshot table whose bytes do not decode, as on one that cannot be read.
    fn undecodable_snapshot_table(&mut self, e: FormatError) -> CheckError {
        self.res.check_errors += 1;
        self.log(
            FindingKind::Reported,
            format!("ERROR failed to read the snapshot table: {e}"),
        );
        let offset = self.forget_snapshots();
        CheckError::SnapshotTable {
            offset,
            detail: e.to_string(),
        }
    }

    /// Writes the reduced snapshot count to the header, so that it agrees with what the rest
    /// of the check looks at; the dropped entries' clusters become leaks, which the check
    /// frees.
    async fn write_snapshot_count(&mut self, nb: u32, reduced: u32) -> Result<(), CheckError> {
        let written = match io::write_header(
            self.file,
            "updating the snapshot count",
            header::nb_snapshots_update(nb),
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
        Ok(())
    }

    /// Version 3 entries must carry the VM state and disk sizes: an entry without them is a
    /// corruption (which `-r all` repairs by rewriting the table).
    fn flag_incomplete_snapshots(&mut self) {
        if self.meta.header.version < 3 {
            return;
        }
        let repair = self.fix.errors;
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

    /// Reads `len` bytes of the snapshot table (at most 64 KiB: names, IDs, fixed parts).
    async fn read_snapshot_bytes(&mut self, pos: u64, len: u64) -> Result<Vec<u8>, CheckError> {
        match io::read(self.file, "reading the snapshot table", pos, len as usize).await {
            Ok(b) => Ok(b.to_vec()),
            Err(e) => {
                self.res.check_errors += 1;
                self.log(
                    FindingKind::Reported,
                    format!("ERROR failed to read the snapshot table: {e}"),
                );
                self.forget_snapshots();
                Err(e)
            }
        }
    }
}
