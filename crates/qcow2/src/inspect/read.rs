//! Reading an image's metadata over a [`ByteSource`], each structure within QEMU's limits.

use std::io;

use super::source::ByteSource;

use crate::format::bitmap::{self, BitmapDirectoryEntry};
use crate::format::error::{FormatError, Location, Structure};
use crate::format::geometry::{Geometry, HostOffset};
use crate::format::header::Header;
use crate::format::l1::{self, L1Entry};
use crate::format::limits;
use crate::format::refcount::RefcountTableEntry;
use crate::format::snapshot::{SnapshotTableCursor, SnapshotTableEntry};

/// Errors from inspecting an image.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// Reading from the source failed.
    #[error("reading {what} ({len} bytes at offset {offset:#x}): {source}")]
    Io {
        /// What was being read.
        what: &'static str,
        /// File offset.
        offset: u64,
        /// Bytes requested.
        len: u64,
        /// The underlying error.
        source: io::Error,
    },
    /// A structure lies (partly) past the end of the file.
    #[error("{at}: {what} ({len} bytes at offset {offset:#x}) extends past the end of the file ({file_len} bytes)")]
    PastEnd {
        /// Where the structure is described.
        at: Location,
        /// What was being read.
        what: &'static str,
        /// File offset.
        offset: u64,
        /// Bytes needed.
        len: u64,
        /// File length.
        file_len: u64,
    },
    /// The bytes read are not valid qcow2.
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// Everything `info` needs from a qcow2 image, decoded and validated.
#[derive(Debug, Clone)]
pub struct ImageMetadata {
    /// The header with extensions and backing file name.
    pub header: Header,
    /// Geometry derived from the header.
    pub geometry: Geometry,
    /// Length of the image file in bytes.
    pub file_len: u64,
    /// Internal snapshots.
    pub snapshots: Vec<SnapshotTableEntry>,
    /// Persistent bitmaps (empty unless the bitmaps extension is present and consistent).
    pub bitmaps: Vec<BitmapDirectoryEntry>,
}

/// Reads `len` bytes at `offset`, refusing anything past the end of the source before
/// allocating.
fn read<S: ByteSource + ?Sized>(
    src: &S,
    file_len: u64,
    at: Location,
    what: &'static str,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, InspectError> {
    let past_end = || InspectError::PastEnd {
        at,
        what,
        offset,
        len,
        file_len,
    };
    let end = offset.checked_add(len).ok_or_else(past_end)?;
    if end > file_len {
        return Err(past_end());
    }
    let len_usize = usize::try_from(len).map_err(|_| past_end())?;
    let mut buf = vec![0u8; len_usize];
    src.read_exact_at(offset, &mut buf)
        .map_err(|source| InspectError::Io {
            what,
            offset,
            len,
            source,
        })?;
    Ok(buf)
}

/// The source's length in bytes.
fn file_len<S: ByteSource + ?Sized>(src: &S) -> Result<u64, InspectError> {
    src.byte_len().map_err(|source| InspectError::Io {
        what: "file length",
        offset: 0,
        len: 0,
        source,
    })
}

/// Decodes the header from the first cluster of `src`.
pub fn read_header<S: ByteSource + ?Sized>(src: &S) -> Result<(Header, u64), InspectError> {
    let file_len = file_len(src)?;
    let at = Location::at(Structure::Header, 0);
    // Read enough for cluster_bits first, then the whole first cluster (or file).
    let probe = read(src, file_len, at, "header", 0, file_len.min(512))?;
    let cluster_bits = probe
        .get(20..24)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_be_bytes);
    let first = match cluster_bits {
        Some(bits @ limits::MIN_CLUSTER_BITS..=limits::MAX_CLUSTER_BITS) if file_len > 512 => read(
            src,
            file_len,
            at,
            "first cluster",
            0,
            file_len.min(1 << bits),
        )?,
        _ => probe,
    };
    Ok((Header::decode(&first)?, file_len))
}

/// Decodes header, extensions, snapshot table and bitmap directory.
pub fn inspect<S: ByteSource + ?Sized>(src: &S) -> Result<ImageMetadata, InspectError> {
    let (header, file_len) = read_header(src)?;
    let geometry = header.geometry()?;
    let snapshots = read_snapshots(src, file_len, &header, &geometry)?;
    let bitmaps = read_bitmaps(src, file_len, &header, &geometry)?;
    Ok(ImageMetadata {
        header,
        geometry,
        file_len,
        snapshots,
        bitmaps,
    })
}

fn read_snapshots<S: ByteSource + ?Sized>(
    src: &S,
    file_len: u64,
    header: &Header,
    geometry: &Geometry,
) -> Result<Vec<SnapshotTableEntry>, InspectError> {
    let fixed = limits::SNAPSHOT_ENTRY_FIXED_SIZE;
    let mut cursor = SnapshotTableCursor::new(header.snapshots_offset);
    // nb_snapshots ≤ 65536 was checked by Header::decode; each entry is at least 40 bytes and
    // must be in the file, so the Vec never outgrows the file.
    let mut entries = Vec::new();
    for index in 0..u64::from(header.nb_snapshots) {
        let offset = cursor.next_offset()?;
        let at = Location::entry(Structure::SnapshotTable, header.snapshots_offset, index);
        let head = read(src, file_len, at, "snapshot entry", offset, fixed)?;
        let len = SnapshotTableEntry::entry_len(&head, at)?;
        let whole = read(src, file_len, at, "snapshot entry", offset, len as u64)?;
        let (entry, used) = SnapshotTableEntry::decode(&whole, offset, index, geometry)?;
        cursor.advance(used)?;
        entries.push(entry);
    }
    Ok(entries)
}

fn read_bitmaps<S: ByteSource + ?Sized>(
    src: &S,
    file_len: u64,
    header: &Header,
    geometry: &Geometry,
) -> Result<Vec<BitmapDirectoryEntry>, InspectError> {
    let Some(ext) = header.bitmaps() else {
        return Ok(Vec::new());
    };
    let at = Location::at(Structure::BitmapDirectory, ext.directory_offset);
    // directory_size ≤ 64 MiB was checked when the extension was decoded.
    let dir = read(
        src,
        file_len,
        at,
        "bitmap directory",
        ext.directory_offset,
        ext.directory_size,
    )?;
    let entries = bitmap::decode_directory(&dir, ext, geometry)?;
    for (index, entry) in entries.iter().enumerate() {
        // QEMU refuses a bitmap whose data could not fit in the file at all.
        let phys = u64::from(entry.table_size).saturating_mul(geometry.cluster_size());
        if phys > file_len {
            return Err(FormatError::LimitExceeded {
                at: Location::entry(
                    Structure::BitmapDirectory,
                    ext.directory_offset,
                    index as u64,
                ),
                field: "bitmap_table_size",
                value: entry.table_size.into(),
                limit: file_len / geometry.cluster_size(),
                why: "the bitmap's clusters cannot all fit in the image file",
            }
            .into());
        }
    }
    Ok(entries)
}

/// Reads and decodes the active L1 table (not needed for `info`; used by checks, tests and
/// fuzzing).
pub fn read_l1_table<S: ByteSource + ?Sized>(
    src: &S,
    header: &Header,
) -> Result<Vec<L1Entry>, InspectError> {
    let geometry = header.geometry()?;
    let file_len = file_len(src)?;
    let at = Location::at(Structure::L1Table, header.l1_table_offset);
    // l1_size * 8 ≤ 32 MiB was checked by Header::decode.
    let len = u64::from(header.l1_size) * 8;
    let raw = read(src, file_len, at, "L1 table", header.l1_table_offset, len)?;
    (0..header.l1_size as usize)
        .map(|i| {
            let word = l1::entry_at(&raw, i).ok_or(FormatError::Truncated {
                at,
                what: "L1 entry",
                need: len,
                have: raw.len() as u64,
            })?;
            Ok(L1Entry::decode(
                word,
                &geometry,
                i as u64,
                HostOffset(header.l1_table_offset),
            )?)
        })
        .collect()
}

/// Reads and decodes the refcount table.
pub fn read_refcount_table<S: ByteSource + ?Sized>(
    src: &S,
    header: &Header,
) -> Result<Vec<RefcountTableEntry>, InspectError> {
    let geometry = header.geometry()?;
    let file_len = file_len(src)?;
    let at = Location::at(Structure::RefcountTable, header.refcount_table_offset);
    // ≤ 8 MiB, checked by Header::decode.
    let len = u64::from(header.refcount_table_clusters) * geometry.cluster_size();
    let raw = read(
        src,
        file_len,
        at,
        "refcount table",
        header.refcount_table_offset,
        len,
    )?;
    raw.chunks_exact(8)
        .enumerate()
        .map(|(i, c)| {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            Ok(RefcountTableEntry::decode(
                u64::from_be_bytes(word),
                &geometry,
                i as u64,
                HostOffset(header.refcount_table_offset),
            )?)
        })
        .collect()
}
