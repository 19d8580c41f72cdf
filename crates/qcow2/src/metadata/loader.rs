//! Reading and decoding each metadata structure, within QEMU's limits.

use super::error::MetadataError;
use super::source::MetaSource;
use crate::format::be::words;
use crate::format::bitmap::{self, BitmapDirectoryEntry};
use crate::format::error::{FormatError, Location, Structure};
use crate::format::header::{Header, Strictness};
use crate::format::snapshot::{SnapshotTableCursor, SnapshotTableEntry};
use crate::format::{limits, Geometry};

/// Loads metadata from one file at one strictness.
pub(crate) struct Loader<'a, R> {
    src: &'a R,
    strictness: Strictness,
}

/// A structure being read, named for both kinds of error: what was being done when a read
/// failed, and what lies past the end of the file.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    /// The structure, as a noun.
    pub name: &'static str,
    /// Reading it, as an I/O error says what failed.
    pub reading: &'static str,
}

const HEADER: Piece = Piece {
    name: "header",
    reading: "reading the header",
};
const SNAPSHOT_ENTRY: Piece = Piece {
    name: "snapshot entry",
    reading: "reading the snapshot table",
};
const BITMAP_DIRECTORY: Piece = Piece {
    name: "bitmap directory",
    reading: "reading the bitmap directory",
};
/// The active L1 table or a snapshot's.
pub(crate) const L1_TABLE: Piece = Piece {
    name: "L1 table",
    reading: "reading the L1 table",
};
/// A bitmap's table.
pub(crate) const BITMAP_TABLE: Piece = Piece {
    name: "bitmap table",
    reading: "reading a bitmap table",
};
pub(crate) const REFCOUNT_TABLE: Piece = Piece {
    name: "refcount table",
    reading: "reading the refcount table",
};

/// The header's first sector holds the cluster size, which says how much to read.
const PROBE_LEN: u64 = 512;
/// Bytes of the first cluster decoded before reading all of it (see `header`).
const HEADER_PREFIX: u64 = 64 << 10;

impl<'a, R: MetaSource> Loader<'a, R> {
    /// A loader over `src` at `strictness`.
    pub fn new(src: &'a R, strictness: Strictness) -> Self {
        Loader { src, strictness }
    }

    /// Length of the file being loaded.
    pub fn file_len(&self) -> u64 {
        self.src.file_len()
    }

    async fn read_raw(&self, what: Piece, offset: u64, len: u64) -> Result<R::Buf, MetadataError> {
        let io = |source| MetadataError::Io {
            what: what.reading,
            offset,
            len,
            source,
        };
        let n = usize::try_from(len).map_err(|_| io(std::io::ErrorKind::OutOfMemory.into()))?;
        self.src.read(offset, n).await.map_err(io)
    }

    /// Reads a structure that must lie inside the file, refusing it before allocating.
    async fn read_inside(
        &self,
        at: Location,
        what: Piece,
        offset: u64,
        len: u64,
    ) -> Result<R::Buf, MetadataError> {
        let file_len = self.file_len();
        if offset.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(MetadataError::PastEnd {
                at,
                what: what.name,
                offset,
                len,
                file_len,
            });
        }
        self.read_raw(what, offset, len).await
    }

    /// The header, with its extensions and backing file name. It fits in the first cluster:
    /// the cluster size comes from the first sector, then just that cluster is read (or the
    /// whole file, if it is shorter; a file shorter than a sector reads as zero-padded).
    pub async fn header(&self) -> Result<Header, MetadataError> {
        let probe = self.read_raw(HEADER, 0, PROBE_LEN).await?;

        let bits = u32::from_be_bytes([probe[20], probe[21], probe[22], probe[23]])
            .clamp(limits::MIN_CLUSTER_BITS, limits::MAX_CLUSTER_BITS);
        let first_len = self.file_len().min(1 << bits).max(PROBE_LEN);
        // A header with its extensions and backing name takes a few KiB even when the
        // cluster is 2 MiB: decode them from a prefix when it holds all of them; otherwise
        // read the whole cluster, so that a damaged header is judged, and reported, on
        // everything QEMU would read.
        if first_len > HEADER_PREFIX {
            let prefix = self.read_raw(HEADER, 0, HEADER_PREFIX).await?;
            if let Some(h) = Header::decode_prefix(&prefix, self.strictness) {
                return Ok(h);
            }
        }
        let first = self.read_raw(HEADER, 0, first_len).await?;
        Ok(Header::decode_with(&first, self.strictness)?)
    }

    /// The raw 64-bit words of a table of `len` bytes at `offset` (the L1 or refcount table).
    /// At [`Strictness::Open`] the table must lie inside the file; a check reads what is
    /// past the end as zeros, as QEMU does, and reports the damage itself.
    pub async fn table(
        &self,
        structure: Structure,
        what: Piece,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, MetadataError> {
        let raw = match self.strictness {
            Strictness::Open => {
                let at = Location::at(structure, offset);
                self.read_inside(at, what, offset, len).await?
            }
            Strictness::Check => self.read_raw(what, offset, len).await?,
        };
        Ok(words(&raw))
    }

    /// The snapshot table, one entry at a time (so a few snapshots do not cost a 64 MiB
    /// read), each entry with the bytes it occupies including padding. What lies past the
    /// end of the file reads as zeros, as QEMU reads it (an empty entry), whatever the
    /// strictness: QEMU opens such an image.
    pub async fn snapshot_table(
        &self,
        header: &Header,
    ) -> Result<Vec<(SnapshotTableEntry, u64)>, MetadataError> {
        let table = header.snapshots_offset;
        let mut cursor = SnapshotTableCursor::new(table);
        // nb_snapshots ≤ 65536 was checked with the header, and the entries add up to at
        // most QEMU's 64 MiB (checked below, before each is read).
        let mut out = Vec::new();
        let mut total = 0u64;
        for index in 0..u64::from(header.nb_snapshots) {
            let offset = cursor.next_offset()?;
            let at = Location::entry(Structure::SnapshotTable, table, index);
            let fixed = limits::SNAPSHOT_ENTRY_FIXED_SIZE;
            let head = self.read_raw(SNAPSHOT_ENTRY, offset, fixed).await?;
            let len = SnapshotTableEntry::entry_len(&head, at)?;
            total = total.saturating_add(len as u64);
            if total > limits::MAX_SNAPSHOT_TABLE_BYTES {
                return Err(FormatError::SnapshotTableTooBig {
                    at,
                    overhanging: u64::from(header.nb_snapshots) - index,
                }
                .into());
            }
            let whole = self.read_raw(SNAPSHOT_ENTRY, offset, len as u64).await?;
            let (entry, used) = SnapshotTableEntry::decode(&whole, offset, index)?;
            cursor.advance(used)?;
            out.push((entry, used as u64));
        }
        Ok(out)
    }

    /// The bitmap directory, if the bitmaps extension is present and consistent. At
    /// [`Strictness::Open`] a bitmap table too large for QEMU, or too small for the disk, is
    /// refused, as QEMU refuses it; a check reports it in its own words.
    pub async fn bitmap_directory(
        &self,
        header: &Header,
        geom: &Geometry,
    ) -> Result<Vec<BitmapDirectoryEntry>, MetadataError> {
        let Some(ext) = header.bitmaps() else {
            return Ok(Vec::new());
        };
        let at = Location::at(Structure::BitmapDirectory, ext.directory_offset);
        let (offset, len) = (ext.directory_offset, ext.directory_size);
        // directory_size ≤ 64 MiB was checked when the extension was decoded.
        let dir = match self.strictness {
            Strictness::Open => self.read_inside(at, BITMAP_DIRECTORY, offset, len).await?,
            Strictness::Check => self.read_raw(BITMAP_DIRECTORY, offset, len).await?,
        };
        let entries = bitmap::decode_directory(&dir, ext, geom)?;
        if self.strictness == Strictness::Open {
            self.bitmaps_fit(&entries, offset, header, geom)?;
        }
        Ok(entries)
    }

    fn bitmaps_fit(
        &self,
        entries: &[BitmapDirectoryEntry],
        directory: u64,
        header: &Header,
        geom: &Geometry,
    ) -> Result<(), FormatError> {
        for (index, entry) in entries.iter().enumerate() {
            let at = Location::entry(Structure::BitmapDirectory, directory, index as u64);
            entry.check_table_size(header.size, geom.cluster_size(), at)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::header::field;
    use crate::metadata::{run_ready, MetadataError, SyncSource};
    use test_support::Dir;

    /// A fresh 64 KiB-cluster image from qemu-img, as bytes.
    fn image(opts: &str) -> Vec<u8> {
        let dir = Dir::new();
        dir.create("a.qcow2", "qcow2", opts, None, "1G");
        dir.read("a.qcow2")
    }

    fn put_be64(bytes: &mut [u8], at: usize, value: u64) {
        bytes[at..at + 8].copy_from_slice(&value.to_be_bytes());
    }

    fn l1_at<'a>(loader: &Loader<'a, SyncSource<'a, [u8]>>) -> Result<Vec<u64>, MetadataError> {
        run_ready(async {
            let h = loader.header().await?;
            let len = u64::from(h.l1_size) * 8;
            loader
                .table(Structure::L1Table, L1_TABLE, h.l1_table_offset, len)
                .await
        })
    }

    #[test]
    fn a_table_past_the_end_is_refused_on_open_and_reads_as_zeros_for_a_check() {
        let mut bytes = image("");
        let beyond = (bytes.len() as u64).next_multiple_of(65536);
        put_be64(&mut bytes, field::L1_TABLE_OFFSET, beyond);
        let src = SyncSource::new(bytes.as_slice()).unwrap();
        let err = l1_at(&Loader::new(&src, Strictness::Open)).unwrap_err();
        assert!(
            matches!(err, MetadataError::PastEnd { offset, .. } if offset == beyond),
            "{err}"
        );
        let words = l1_at(&Loader::new(&src, Strictness::Check)).unwrap();
        assert!(!words.is_empty() && words.iter().all(|&w| w == 0));
    }

    #[test]
    fn a_file_shorter_than_a_sector_reads_zero_padded() {
        let bytes = image("");
        let src = SyncSource::new(&bytes[..4]).unwrap();
        // The magic survives; the zeros after it make the version invalid.
        let err = run_ready(Loader::new(&src, Strictness::Open).header()).unwrap_err();
        assert!(matches!(err, MetadataError::Format(_)), "{err}");
        let empty = SyncSource::new(&bytes[..0]).unwrap();
        let err = run_ready(Loader::new(&empty, Strictness::Check).header()).unwrap_err();
        assert!(
            matches!(
                err,
                MetadataError::Format(FormatError::BadMagic { found: 0 })
            ),
            "{err}"
        );
    }

    /// QEMU reads snapshot entries past the end of the file as zeros and opens the image
    /// (iotest 080 opens one with 65536 of them, and `qemu-img info` lists them).
    #[test]
    fn snapshot_entries_past_the_end_read_as_empty_ones() {
        let dir = Dir::new();
        dir.create("a.qcow2", "qcow2", "", None, "1G");
        let mut bytes = dir.read("a.qcow2");
        let end = bytes.len() as u64;
        bytes[field::NB_SNAPSHOTS..field::NB_SNAPSHOTS + 4].copy_from_slice(&2u32.to_be_bytes());
        put_be64(
            &mut bytes,
            field::SNAPSHOTS_OFFSET,
            end.next_multiple_of(65536),
        );
        std::fs::write(dir.path("a.qcow2"), &bytes).unwrap();
        let info = dir.info("a.qcow2");
        let listed = info["snapshots"].as_array().map_or(0, Vec::len);
        assert_eq!(listed, 2, "qemu-img info: {info}");

        let src = SyncSource::new(bytes.as_slice()).unwrap();
        let loader = Loader::new(&src, Strictness::Open);
        let table = run_ready(async {
            let h = loader.header().await?;
            loader.snapshot_table(&h).await
        })
        .unwrap();
        assert_eq!(table.len(), 2);
        for (entry, len) in table {
            assert_eq!(len, 40);
            assert_eq!((entry.l1_table_offset, entry.l1_size), (0, 0));
            assert!(entry.id.is_empty() && entry.name.is_empty());
        }
    }
}
