//! Internal snapshot table entries (with their extra data) and whole-table decoding within
//! QEMU's limits.

use super::be;
use super::error::{FormatError, Location, Structure};
use super::header::Strictness;
use super::limits;

/// Why QEMU will not use a snapshot's L1 table, in its words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotL1Problem {
    /// More entries than QEMU keeps in memory (it fails with EFBIG).
    #[error("Snapshot L1 table too large")]
    TooLarge,
    /// Not aligned to a cluster, or ending past 2^63 bytes (it fails with EINVAL).
    #[error("Snapshot L1 table offset invalid")]
    OffsetInvalid,
}

/// One snapshot table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotTableEntry {
    /// File offset of the snapshot's L1 table.
    pub l1_table_offset: u64,
    /// Entries in the snapshot's L1 table.
    pub l1_size: u32,
    /// Unique ID string (not NUL-terminated).
    pub id: Vec<u8>,
    /// Name (not NUL-terminated).
    pub name: Vec<u8>,
    /// Seconds since the epoch when the snapshot was taken.
    pub date_sec: u32,
    /// Sub-second part of the date, in nanoseconds.
    pub date_nsec: u32,
    /// Guest run time at the snapshot, in nanoseconds.
    pub vm_clock_nsec: u64,
    /// 32-bit VM state size (superseded by the 64-bit one in the extra data).
    pub vm_state_size_32: u32,
    /// Extra data, kept verbatim: bytes 0-7 the 64-bit VM state size, 8-15 the virtual disk
    /// size, 16-23 the instruction count; anything after is for future use.
    pub extra_data: Vec<u8>,
}

/// The lengths of an entry's variable parts, as its 40-byte fixed part gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotEntrySizes {
    /// extra_data_size: bytes of extra data after the fixed part.
    pub extra_data: u32,
    /// id_str_size: bytes of the ID after the extra data.
    pub id: u16,
    /// name_size: bytes of the name after the ID.
    pub name: u16,
}

impl SnapshotEntrySizes {
    /// Reads the sizes from an entry's fixed part, whatever their values.
    pub fn decode(fixed: &[u8], at: Location) -> Result<SnapshotEntrySizes, FormatError> {
        Ok(SnapshotEntrySizes {
            extra_data: be::u32_at(fixed, 36, at, "snapshot entry")?,
            id: be::u16_at(fixed, 12, at, "snapshot entry")?,
            name: be::u16_at(fixed, 14, at, "snapshot entry")?,
        })
    }

    /// Whether the entry has more extra data than QEMU accepts.
    pub fn extra_data_too_large(&self) -> bool {
        self.extra_data > limits::MAX_SNAPSHOT_EXTRA_DATA
    }

    /// The extra data a reader keeps at `strictness`: all of it to open an image (which
    /// refuses more than QEMU's limit), at most QEMU's limit for a check, whose repair drops
    /// the rest as `qemu-img check -r all` does.
    pub fn kept_extra_data(&self, strictness: Strictness) -> u32 {
        match strictness {
            Strictness::Open => self.extra_data,
            Strictness::Check => self.extra_data.min(limits::MAX_SNAPSHOT_EXTRA_DATA),
        }
    }

    /// Length of the entry's data without padding, with the extra data kept at `strictness`;
    /// opening refuses more extra data than QEMU accepts.
    fn kept_len(&self, at: Location, strictness: Strictness) -> Result<usize, FormatError> {
        if strictness == Strictness::Open && self.extra_data_too_large() {
            return Err(FormatError::LimitExceeded {
                at,
                field: "extra_data_size",
                value: self.extra_data.into(),
                limit: limits::MAX_SNAPSHOT_EXTRA_DATA.into(),
                why: "QEMU allows at most 1 KiB of snapshot extra data",
            });
        }
        // At most 40 + 1024 + 2 * 65535 bytes: no overflow possible.
        Ok(limits::SNAPSHOT_ENTRY_FIXED_SIZE as usize
            + self.kept_extra_data(strictness) as usize
            + usize::from(self.id)
            + usize::from(self.name))
    }
}

fn extra_u64(extra: &[u8], pos: usize) -> Option<u64> {
    extra
        .get(pos..pos + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes)
}

impl SnapshotTableEntry {
    /// VM state size in bytes (the 64-bit field when the extra data has it).
    pub fn vm_state_size(&self) -> u64 {
        extra_u64(&self.extra_data, 0).unwrap_or(self.vm_state_size_32.into())
    }

    /// Extra data holding the three fields QEMU writes (64-bit VM state size, virtual disk
    /// size, instruction count, all ones for "not recorded") followed by `rest`, kept
    /// verbatim.
    pub fn full_extra_data(
        vm_state_size: u64,
        disk_size: u64,
        icount: u64,
        rest: &[u8],
    ) -> Vec<u8> {
        let mut extra = Vec::with_capacity(24 + rest.len());
        extra.extend_from_slice(&vm_state_size.to_be_bytes());
        extra.extend_from_slice(&disk_size.to_be_bytes());
        extra.extend_from_slice(&icount.to_be_bytes());
        extra.extend_from_slice(rest);
        extra
    }

    /// The entry `qemu-img snapshot -c` writes: the disk state only (no VM state, VM clock 0,
    /// instruction count 0), with the complete extra data QEMU writes for every snapshot.
    pub fn disk_only(
        id: Vec<u8>,
        name: Vec<u8>,
        date: (u32, u32),
        l1: (u64, u32),
        disk_size: u64,
    ) -> SnapshotTableEntry {
        SnapshotTableEntry {
            l1_table_offset: l1.0,
            l1_size: l1.1,
            id,
            name,
            date_sec: date.0,
            date_nsec: date.1,
            vm_clock_nsec: 0,
            vm_state_size_32: 0,
            extra_data: Self::full_extra_data(0, disk_size, 0, &[]),
        }
    }

    /// The unpadded length of the encoded entry (the table's last entry is not padded).
    pub fn encoded_len(&self) -> usize {
        limits::SNAPSHOT_ENTRY_FIXED_SIZE as usize
            + self.extra_data.len()
            + self.id.len()
            + self.name.len()
    }

    /// Virtual disk size at the snapshot, if the extra data records it.
    pub fn disk_size(&self) -> Option<u64> {
        extra_u64(&self.extra_data, 8)
    }

    /// Guest instruction count at the snapshot, if recorded (-1 means "not recorded").
    pub fn icount(&self) -> Option<u64> {
        extra_u64(&self.extra_data, 16).filter(|&v| v != u64::MAX)
    }

    /// ID for display (invalid UTF-8 replaced), up to its first NUL byte, where QEMU,
    /// which keeps it as a C string, ends it too.
    pub fn id_lossy(&self) -> String {
        c_string_lossy(&self.id)
    }

    /// Name for display, as [`Self::id_lossy`].
    pub fn name_lossy(&self) -> String {
        c_string_lossy(&self.name)
    }

    /// Length of the entry's data (fixed part, extra data, ID and name, without the padding
    /// to 8 bytes) given its 40-byte fixed part, so a reader can fetch one entry at a time.
    /// The padding of the last entry need not be in the file: QEMU never reads it.
    pub fn entry_len(fixed: &[u8], at: Location) -> Result<usize, FormatError> {
        SnapshotEntrySizes::decode(fixed, at)?.kept_len(at, Strictness::Open)
    }

    /// Decodes entry `index` from `buf`, which starts at the entry; returns it and its length
    /// including padding (where the next entry starts). Where its L1 table is, is not
    /// judged: QEMU opens an image whatever its snapshots' L1 tables look like, and judges
    /// one only when it uses it ([`SnapshotTableEntry::l1_table_problem`]).
    pub fn decode(
        buf: &[u8],
        entry_offset: u64,
        index: u64,
    ) -> Result<(SnapshotTableEntry, usize), FormatError> {
        Self::decode_with(buf, entry_offset, index, Strictness::Open)
    }

    /// What QEMU finds wrong with the snapshot's L1 table when it is about to use it (to
    /// apply, delete or load the snapshot, or expand its zero clusters), if anything: more
    /// entries than its 32 MiB, or an offset not aligned to a cluster or with the table
    /// ending past 2^63.
    pub fn l1_table_problem(&self, cluster_size: u64) -> Option<SnapshotL1Problem> {
        let entries = u64::from(self.l1_size);
        if entries > limits::MAX_L1_SIZE_BYTES / 8 {
            return Some(SnapshotL1Problem::TooLarge);
        }
        let ends_past = (i64::MAX as u64) - entries * 8 < self.l1_table_offset;
        if ends_past || cluster_size == 0 || self.l1_table_offset % cluster_size != 0 {
            return Some(SnapshotL1Problem::OffsetInvalid);
        }
        None
    }

    /// Decodes the entry's bytes without judging where its L1 table is. At
    /// [`Strictness::Check`], `buf` holds only the extra data
    /// [`SnapshotEntrySizes::kept_extra_data`] keeps, followed by the ID and name, and the
    /// length returned is that of the entry as laid out in `buf`.
    pub fn decode_with(
        buf: &[u8],
        entry_offset: u64,
        index: u64,
        strictness: Strictness,
    ) -> Result<(SnapshotTableEntry, usize), FormatError> {
        let at = Location::entry(Structure::SnapshotTable, entry_offset, index);
        let sizes = SnapshotEntrySizes::decode(buf, at)?;
        let len = sizes.kept_len(at, strictness)?;
        let l1_table_offset = be::u64_at(buf, 0, at, "snapshot entry")?;
        let l1_size = be::u32_at(buf, 8, at, "snapshot entry")?;
        let id_len = usize::from(sizes.id);
        let name_len = usize::from(sizes.name);
        let extra_len = sizes.kept_extra_data(strictness) as usize; // ≤ 1024, checked or capped
        let fixed = limits::SNAPSHOT_ENTRY_FIXED_SIZE as usize;
        let extra_data = be::bytes_at(buf, fixed, extra_len, at, "snapshot extra data")?.to_vec();
        let id = be::bytes_at(buf, fixed + extra_len, id_len, at, "snapshot ID")?.to_vec();
        let name = be::bytes_at(
            buf,
            fixed + extra_len + id_len,
            name_len,
            at,
            "snapshot name",
        )?
        .to_vec();
        let padded = be::pad8(len).ok_or(FormatError::Overflow {
            at,
            what: "snapshot entry length",
        })?;

        let entry = SnapshotTableEntry {
            l1_table_offset,
            l1_size,
            id,
            name,
            date_sec: be::u32_at(buf, 16, at, "snapshot entry")?,
            date_nsec: be::u32_at(buf, 20, at, "snapshot entry")?,
            vm_clock_nsec: be::u64_at(buf, 24, at, "snapshot entry")?,
            vm_state_size_32: be::u32_at(buf, 32, at, "snapshot entry")?,
            extra_data,
        };
        Ok((entry, padded))
    }

    /// Appends the encoded entry (with zero padding) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), FormatError> {
        let at = Location::at(Structure::SnapshotTable, 0);
        let too_long = |field, len: usize| FormatError::LimitExceeded {
            at,
            field,
            value: len as u64,
            limit: u16::MAX.into(),
            why: "the length field is 16 bits",
        };
        let id_len =
            u16::try_from(self.id.len()).map_err(|_| too_long("id_str_size", self.id.len()))?;
        let name_len =
            u16::try_from(self.name.len()).map_err(|_| too_long("name_size", self.name.len()))?;
        let extra_len = u32::try_from(self.extra_data.len())
            .ok()
            .filter(|&l| l <= limits::MAX_SNAPSHOT_EXTRA_DATA)
            .ok_or(FormatError::LimitExceeded {
                at,
                field: "extra_data_size",
                value: self.extra_data.len() as u64,
                limit: limits::MAX_SNAPSHOT_EXTRA_DATA.into(),
                why: "QEMU allows at most 1 KiB of snapshot extra data",
            })?;
        let start = out.len();
        out.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&self.l1_size.to_be_bytes());
        out.extend_from_slice(&id_len.to_be_bytes());
        out.extend_from_slice(&name_len.to_be_bytes());
        out.extend_from_slice(&self.date_sec.to_be_bytes());
        out.extend_from_slice(&self.date_nsec.to_be_bytes());
        out.extend_from_slice(&self.vm_clock_nsec.to_be_bytes());
        out.extend_from_slice(&self.vm_state_size_32.to_be_bytes());
        out.extend_from_slice(&extra_len.to_be_bytes());
        out.extend_from_slice(&self.extra_data);
        out.extend_from_slice(&self.id);
        out.extend_from_slice(&self.name);
        let len = out.len() - start;
        out.resize(start + be::pad8(len).unwrap_or(len), 0);
        Ok(())
    }
}

/// `bytes` up to the first NUL byte, invalid UTF-8 replaced.
fn c_string_lossy(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Running limits while reading a snapshot table entry by entry.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotTableCursor {
    table_offset: u64,
    consumed: u64,
}

impl SnapshotTableCursor {
    /// Starts at the table's file offset.
    pub fn new(table_offset: u64) -> Self {
        SnapshotTableCursor {
            table_offset,
            consumed: 0,
        }
    }

    /// File offset of the next entry.
    pub fn next_offset(&self) -> Result<u64, FormatError> {
        self.table_offset
            .checked_add(self.consumed)
            .ok_or(FormatError::Overflow {
                at: Location::at(Structure::SnapshotTable, self.table_offset),
                what: "snapshot entry offset",
            })
    }

    /// Accounts for an entry of `len` bytes, failing once the table exceeds 64 MiB.
    pub fn advance(&mut self, len: usize) -> Result<(), FormatError> {
        self.consumed = self.consumed.saturating_add(len as u64);
        if self.consumed > limits::MAX_SNAPSHOT_TABLE_BYTES {
            return Err(FormatError::LimitExceeded {
                at: Location::at(Structure::SnapshotTable, self.table_offset),
                field: "snapshot table size",
                value: self.consumed,
                limit: limits::MAX_SNAPSHOT_TABLE_BYTES,
                why: "QEMU loads the whole table into memory, at most 64 MiB",
            });
        }
        Ok(())
    }
}

/// Decodes `nb_snapshots` entries from `buf`, which holds the table starting at file offset
/// `table_offset`.
pub fn decode_table(
    buf: &[u8],
    table_offset: u64,
    nb_snapshots: u32,
) -> Result<Vec<SnapshotTableEntry>, FormatError> {
    if nb_snapshots > limits::MAX_SNAPSHOTS {
        return Err(FormatError::LimitExceeded {
            at: Location::at(Structure::Header, 60),
            field: "nb_snapshots",
            value: nb_snapshots.into(),
            limit: limits::MAX_SNAPSHOTS.into(),
            why: "QEMU supports at most 65536 snapshots",
        });
    }
    let mut cursor = SnapshotTableCursor::new(table_offset);
    let mut entries = Vec::new();
    let mut pos = 0usize;
    for index in 0..u64::from(nb_snapshots) {
        let entry_offset = cursor.next_offset()?;
        let rest = buf.get(pos..).unwrap_or(&[]);
        let (entry, len) = SnapshotTableEntry::decode(rest, entry_offset, index)?;
        cursor.advance(len)?;
        pos += len; // len was read from within buf
        entries.push(entry);
    }
    Ok(entries)
}

/// Encodes a whole snapshot table as QEMU writes it: every entry padded to 8 bytes but the
/// last, so the table ends where its last entry does (its length is what QEMU allocates and
/// later frees). Refuses a table past QEMU's 64 MiB limit.
pub fn encode_qemu_table(entries: &[SnapshotTableEntry]) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::new();
    let mut end = 0;
    for entry in entries {
        let start = out.len();
        entry.encode(&mut out)?;
        end = start + entry.encoded_len();
    }
    out.truncate(end);
    if out.len() as u64 > limits::MAX_SNAPSHOT_TABLE_BYTES {
        return Err(FormatError::LimitExceeded {
            at: Location::at(Structure::SnapshotTable, 0),
            field: "snapshot table size",
            value: out.len() as u64,
            limit: limits::MAX_SNAPSHOT_TABLE_BYTES,
            why: "QEMU loads the whole table into memory, at most 64 MiB",
        });
    }
    Ok(out)
}

/// The ID QEMU gives a new snapshot: one more than the largest ID read as C's `strtoul`
/// reads it (leading blanks, a sign, decimal digits; anything else reads as 0, overflow as
/// the largest value, a minus sign negates modulo 2^64), printed in decimal.
pub fn next_snapshot_id(entries: &[SnapshotTableEntry]) -> Vec<u8> {
    let max = entries.iter().map(|e| strtoul(&e.id)).max().unwrap_or(0);
    max.wrapping_add(1).to_string().into_bytes()
}

fn strtoul(s: &[u8]) -> u64 {
    let mut rest = s;
    while let [b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c, tail @ ..] = rest {
        rest = tail;
    }
    let negative = rest.first() == Some(&b'-');
    if let [b'+' | b'-', tail @ ..] = rest {
        rest = tail;
    }
    let mut value = 0u64;
    for &b in rest.iter().take_while(|b| b.is_ascii_digit()) {
        match value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(b - b'0')))
        {
            Some(v) => value = v,
            // strtoul saturates, and then ignores the sign.
            None => return u64::MAX,
        }
    }
    if negative {
        value.wrapping_neg()
    } else {
        value
    }
}

/// Encodes a whole snapshot table.
pub fn encode_table(entries: &[SnapshotTableEntry]) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::new();
    for entry in entries {
        entry.encode(&mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_ids(ids: &[&str]) -> Vec<SnapshotTableEntry> {
        ids.iter()
            .map(|id| {
                SnapshotTableEntry::disk_only(
                    id.as_bytes().to_vec(),
                    b"n".to_vec(),
                    (0, 0),
                    (0, 0),
                    0,
                )
            })
            .collect()
    }

    #[test]
    fn next_id_reads_ids_as_strtoul_does() {
        assert_eq!(next_snapshot_id(&[]), b"1");
        assert_eq!(next_snapshot_id(&with_ids(&["1", "7", "3"])), b"8");
        assert_eq!(
            next_snapshot_id(&with_ids(&["name", " 12abc", "+4"])),
            b"13"
        );
        // -1 is 2^64 - 1 to strtoul: the next ID wraps to 0, as in QEMU.
        assert_eq!(next_snapshot_id(&with_ids(&["-1"])), b"0");
        assert_eq!(
            next_snapshot_id(&with_ids(&["99999999999999999999999"])),
            b"0"
        );
    }

    #[test]
    fn qemu_tables_end_with_the_last_entry() {
        let entries = with_ids(&["1", "22"]);
        let t = encode_qemu_table(&entries).expect("encodes");
        // 40 + 24 + 1 + 1 = 66, padded to 72; then 40 + 24 + 2 + 1 = 67, unpadded.
        assert_eq!(t.len(), 72 + 67);
        assert_eq!(decode_table(&t, 1 << 16, 2).expect("decodes"), entries);
    }
}
