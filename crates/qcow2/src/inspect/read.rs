//! Reading an image's metadata for `info` over a [`ByteSource`], through the one loader at
//! open strictness.

use crate::crypto::{LuksHeader, LuksInfo};
use crate::format::bitmap::BitmapDirectoryEntry;
use crate::format::error::{FormatError, Location, Structure};
use crate::format::geometry::{Geometry, HostOffset};
use crate::format::header::Header;
use crate::format::l1::L1Entry;
use crate::format::refcount::RefcountTableEntry;
use crate::format::snapshot::SnapshotTableEntry;
use crate::metadata::MetaSource;
use crate::metadata::{
    run_ready, ByteSource, Loader, MetadataError, Strictness, SyncSource, L1_TABLE, REFCOUNT_TABLE,
};

/// Errors from inspecting an image.
pub type InspectError = MetadataError;

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
    /// The LUKS header of a LUKS-encrypted image, when it is readable and sound.
    pub luks: Option<LuksInfo>,
}

fn source<S: ByteSource + ?Sized>(src: &S) -> Result<SyncSource<'_, S>, InspectError> {
    SyncSource::new(src).map_err(|source| MetadataError::Io {
        what: "getting the file length",
        offset: 0,
        len: 0,
        source,
    })
}

/// Decodes the header from the first cluster of `src`; returns it with the file's length.
pub fn read_header<S: ByteSource + ?Sized>(src: &S) -> Result<(Header, u64), InspectError> {
    let src = source(src)?;
    let loader = Loader::new(&src, Strictness::Open);
    Ok((run_ready(loader.header())?, loader.file_len()))
}

/// Decodes header, extensions, snapshot table and bitmap directory.
pub fn inspect<S: ByteSource + ?Sized>(src: &S) -> Result<ImageMetadata, InspectError> {
    let src = source(src)?;
    let loader = Loader::new(&src, Strictness::Open);
    run_ready(async {
        let header = loader.header().await?;
        let geometry = header.geometry()?;
        let snapshots = loader.snapshot_table(&header).await?;
        let bitmaps = loader.bitmap_directory(&header, &geometry).await?;
        let luks = match header.fde_pointer() {
            Some(p) if p.length <= crate::crypto::luks::MAX_AREA => src
                .read(p.offset, p.length as usize)
                .await
                .ok()
                .and_then(|area| LuksHeader::parse(&area).ok())
                .map(|h| h.info()),
            _ => None,
        };
        Ok(ImageMetadata {
            luks,
            file_len: loader.file_len(),
            snapshots: snapshots.into_iter().map(|(entry, _)| entry).collect(),
            header,
            geometry,
            bitmaps,
        })
    })
}

/// Reads and decodes the active L1 table (not needed for `info`; used by checks, tests and
/// fuzzing).
pub fn read_l1_table<S: ByteSource + ?Sized>(
    src: &S,
    header: &Header,
) -> Result<Vec<L1Entry>, InspectError> {
    let geometry = header.geometry()?;
    let src = source(src)?;
    let offset = header.l1_table_offset;
    // l1_size * 8 ≤ 32 MiB was checked with the header.
    let len = u64::from(header.l1_size) * 8;
    let loader = Loader::new(&src, Strictness::Open);
    let words = run_ready(loader.table(Structure::L1Table, L1_TABLE, offset, len))?;
    let table = HostOffset(offset);
    let entries = words
        .iter()
        .enumerate()
        .map(|(i, &word)| L1Entry::decode(word, &geometry, i as u64, table))
        .collect::<Result<Vec<_>, FormatError>>()?;
    if entries.len() != header.l1_size as usize {
        return Err(FormatError::Truncated {
            at: Location::at(Structure::L1Table, offset),
            what: "L1 entry",
            need: len,
            have: entries.len() as u64 * 8,
        }
        .into());
    }
    Ok(entries)
}

/// Reads and decodes the refcount table.
pub fn read_refcount_table<S: ByteSource + ?Sized>(
    src: &S,
    header: &Header,
) -> Result<Vec<RefcountTableEntry>, InspectError> {
    let geometry = header.geometry()?;
    let src = source(src)?;
    let offset = header.refcount_table_offset;
    // ≤ 8 MiB, checked with the header.
    let len = u64::from(header.refcount_table_clusters) * geometry.cluster_size();
    let loader = Loader::new(&src, Strictness::Open);
    let words = run_ready(loader.table(Structure::RefcountTable, REFCOUNT_TABLE, offset, len))?;
    let table = HostOffset(offset);
    Ok(words
        .iter()
        .enumerate()
        .map(|(i, &word)| RefcountTableEntry::decode(word, &geometry, i as u64, table))
        .collect::<Result<Vec<_>, FormatError>>()?)
}
