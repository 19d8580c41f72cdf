//! The image header (version 2 and 3): every field, feature bits, `compression_type`, unknown
//! additional fields kept byte-for-byte, header extensions and the backing file name.

use super::be;
use super::bitmap::BitmapsExtension;
use super::error::{FormatError, Location, Structure, UnknownFeature};
use super::extensions::{
    self, ExtensionContext, FdeHeaderPointer, FeatureNameTable, HeaderExtension,
};
use super::features::{self, FeatureKind};
use super::geometry::{Geometry, TableBounds};
use super::limits;

/// "QFI\xfb".
pub const QCOW2_MAGIC: u32 = 0x5146_49fb;

/// Byte offsets of the header's fields (the layout in qcow2.txt). This is the one place they
/// are written down: the decoder, the encoder and every in-place update of a field use them.
pub mod field {
    /// `magic` (u32).
    pub const MAGIC: usize = 0;
    /// `version` (u32).
    pub const VERSION: usize = 4;
    /// `backing_file_offset` (u64).
    pub const BACKING_FILE_OFFSET: usize = 8;
    /// `backing_file_size` (u32).
    pub const BACKING_FILE_SIZE: usize = 16;
    /// `cluster_bits` (u32).
    pub const CLUSTER_BITS: usize = 20;
    /// `size` (u64), the guest size.
    pub const SIZE: usize = 24;
    /// `crypt_method` (u32).
    pub const CRYPT_METHOD: usize = 32;
    /// `l1_size` (u32), followed by `l1_table_offset`.
    pub const L1_SIZE: usize = 36;
    /// `l1_table_offset` (u64).
    pub const L1_TABLE_OFFSET: usize = 40;
    /// `refcount_table_offset` (u64), followed by `refcount_table_clusters`.
    pub const REFCOUNT_TABLE_OFFSET: usize = 48;
    /// `refcount_table_clusters` (u32).
    pub const REFCOUNT_TABLE_CLUSTERS: usize = 56;
    /// `nb_snapshots` (u32), followed by `snapshots_offset`.
    pub const NB_SNAPSHOTS: usize = 60;
    /// `snapshots_offset` (u64).
    pub const SNAPSHOTS_OFFSET: usize = 64;
    /// `incompatible_features` (u64, version 3).
    pub const INCOMPATIBLE_FEATURES: usize = 72;
    /// `compatible_features` (u64, version 3).
    pub const COMPATIBLE_FEATURES: usize = 80;
    /// `autoclear_features` (u64, version 3).
    pub const AUTOCLEAR_FEATURES: usize = 88;
    /// `refcount_order` (u32, version 3).
    pub const REFCOUNT_ORDER: usize = 96;
    /// `header_length` (u32, version 3).
    pub const HEADER_LENGTH: usize = 100;
    /// `compression_type` (u8), the first additional field.
    pub const COMPRESSION_TYPE: usize = 104;
}

/// Bytes that change header fields in place: write `bytes` at file offset `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldUpdate<const N: usize> {
    /// File offset of the first field.
    pub offset: u64,
    /// The fields, encoded.
    pub bytes: [u8; N],
}

impl<const N: usize> FieldUpdate<N> {
    fn new(field: usize, bytes: [u8; N]) -> Self {
        FieldUpdate {
            offset: field as u64,
            bytes,
        }
    }
}

fn concat<const N: usize>(a: &[u8], b: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out[..a.len()].copy_from_slice(a);
    out[a.len()..].copy_from_slice(b);
    out
}

/// The update that sets the guest size.
pub fn size_update(size: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::SIZE, size.to_be_bytes())
}

/// The update that points the header at another L1 table (`l1_size` and `l1_table_offset`
/// together, in one write).
pub fn l1_update(l1_size: u32, l1_table_offset: u64) -> FieldUpdate<12> {
    FieldUpdate::new(
        field::L1_SIZE,
        concat(&l1_size.to_be_bytes(), &l1_table_offset.to_be_bytes()),
    )
}

/// The update that switches the active disk in one write: guest size, `crypt_method` (kept),
/// `l1_size` and `l1_table_offset` are contiguous, so a crash shows the old disk or the new.
pub fn active_disk_update(
    size: u64,
    crypt_method: u32,
    l1_size: u32,
    l1_table_offset: u64,
) -> FieldUpdate<24> {
    let mut bytes = [0u8; 24];
    bytes[..8].copy_from_slice(&size.to_be_bytes());
    bytes[8..12].copy_from_slice(&crypt_method.to_be_bytes());
    bytes[12..16].copy_from_slice(&l1_size.to_be_bytes());
    bytes[16..].copy_from_slice(&l1_table_offset.to_be_bytes());
    FieldUpdate::new(field::SIZE, bytes)
}

/// The update that points the header at another refcount table (offset and cluster count
/// together, in one write).
pub fn reftable_update(offset: u64, clusters: u32) -> FieldUpdate<12> {
    FieldUpdate::new(
        field::REFCOUNT_TABLE_OFFSET,
        concat(&offset.to_be_bytes(), &clusters.to_be_bytes()),
    )
}

/// The update that switches to a refcount structure of another width in one write: every
/// field from `refcount_table_offset` to `refcount_order` (52 bytes, inside the first
/// sector), the fields between them taken from `h` as they are.
pub fn refcount_structure_update(
    h: &Header,
    table_offset: u64,
    table_clusters: u32,
    order: u32,
) -> FieldUpdate<52> {
    let mut bytes = [0u8; 52];
    let mut put = |field: usize, value: &[u8]| {
        let at = field - field::REFCOUNT_TABLE_OFFSET;
        bytes[at..at + value.len()].copy_from_slice(value);
    };
    put(field::REFCOUNT_TABLE_OFFSET, &table_offset.to_be_bytes());
    put(
        field::REFCOUNT_TABLE_CLUSTERS,
        &table_clusters.to_be_bytes(),
    );
    put(field::NB_SNAPSHOTS, &h.nb_snapshots.to_be_bytes());
    put(field::SNAPSHOTS_OFFSET, &h.snapshots_offset.to_be_bytes());
    put(
        field::INCOMPATIBLE_FEATURES,
        &h.incompatible_features.to_be_bytes(),
    );
    put(
        field::COMPATIBLE_FEATURES,
        &h.compatible_features.to_be_bytes(),
    );
    put(
        field::AUTOCLEAR_FEATURES,
        &h.autoclear_features.to_be_bytes(),
    );
    put(field::REFCOUNT_ORDER, &order.to_be_bytes());
    FieldUpdate::new(field::REFCOUNT_TABLE_OFFSET, bytes)
}

/// The update that sets `nb_snapshots` and `snapshots_offset` together.
pub fn snapshots_update(nb_snapshots: u32, snapshots_offset: u64) -> FieldUpdate<12> {
    FieldUpdate::new(
        field::NB_SNAPSHOTS,
        concat(&nb_snapshots.to_be_bytes(), &snapshots_offset.to_be_bytes()),
    )
}

/// The update that sets `nb_snapshots` alone.
pub fn nb_snapshots_update(nb_snapshots: u32) -> FieldUpdate<4> {
    FieldUpdate::new(field::NB_SNAPSHOTS, nb_snapshots.to_be_bytes())
}

/// The update that sets the incompatible feature bits (version 3).
pub fn incompatible_update(bits: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::INCOMPATIBLE_FEATURES, bits.to_be_bytes())
}

/// The update that sets the compatible feature bits (version 3).
pub fn compatible_update(bits: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::COMPATIBLE_FEATURES, bits.to_be_bytes())
}

/// The update that sets the autoclear feature bits (version 3).
pub fn autoclear_update(bits: u64) -> FieldUpdate<8> {
    FieldUpdate::new(field::AUTOCLEAR_FEATURES, bits.to_be_bytes())
}

/// How much of the header (and of a snapshot table entry) a decode insists on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strictness {
    /// Everything QEMU checks before it opens an image.
    Open,
    /// What `qemu-img check` needs to look at an image: the refcount table may be empty, and
    /// the snapshot table's placement and a snapshot entry's extra data past QEMU's limit are
    /// left to the checker, which reports and repairs them.
    Check,
}
/// compression_type: zlib (deflate).
pub const COMPRESSION_ZLIB: u8 = 0;
/// compression_type: zstd.
pub const COMPRESSION_ZSTD: u8 = 1;
/// crypt_method: none.
pub const CRYPT_NONE: u32 = 0;
/// crypt_method: legacy AES-CBC.
pub const CRYPT_AES: u32 = 1;
/// crypt_method: LUKS.
pub const CRYPT_LUKS: u32 = 2;

/// A decoded image header with everything stored in the first cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Offset of the backing file name (0: none). Recomputed by [`Header::encode`].
    pub backing_file_offset: u64,
    /// Length of the backing file name. Recomputed by [`Header::encode`].
    pub backing_file_size: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// 0 none, 1 AES, 2 LUKS.
    pub crypt_method: u32,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// File offset of the active L1 table.
    pub l1_table_offset: u64,
    /// File offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Clusters occupied by the refcount table.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// File offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (0 for version 2).
    pub incompatible_features: u64,
    /// Compatible feature bits (0 for version 2).
    pub compatible_features: u64,
    /// Autoclear feature bits (0 for version 2).
    pub autoclear_features: u64,
    /// log2 of the refcount width (4 for version 2).
    pub refcount_order: u32,
    /// Header length in bytes (72 for version 2).
    pub header_length: u32,
    /// 0 zlib, 1 zstd; only stored when `header_length > 104`.
    pub compression_type: u8,
    /// Bytes 105..header_length: padding and additional fields we do not know, kept verbatim.
    pub unknown_header_tail: Vec<u8>,
    /// Header extensions in file order.
    pub extensions: Vec<HeaderExtension>,
    /// Backing file name, if any (not NUL-terminated).
    pub backing_file: Option<Vec<u8>>,
}

const fn at(offset: u64) -> Location {
    Location::at(Structure::Header, offset)
}

impl Header {
    /// A fresh header with no tables placed yet: version 3 gets `header_length` 112 (with a
    /// zero compression_type and padding), version 2 gets 72. Refcount order 4.
    pub fn new(version: u32, cluster_bits: u32, size: u64) -> Header {
        let v3 = version >= 3;
        Header {
            version,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits,
            size,
            crypt_method: CRYPT_NONE,
            l1_size: 0,
            l1_table_offset: 0,
            refcount_table_offset: 0,
            refcount_table_clusters: 0,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: if v3 { 112 } else { limits::V2_HEADER_LENGTH },
            compression_type: COMPRESSION_ZLIB,
            unknown_header_tail: if v3 { vec![0; 7] } else { Vec::new() },
            extensions: Vec::new(),
            backing_file: None,
        }
    }

    /// Decodes and validates the header from the first cluster of the file (or the whole file
    /// if it is shorter), applying every check QEMU applies when opening an image that can be
    /// made from the first cluster alone.
    pub fn decode(buf: &[u8]) -> Result<Header, FormatError> {
        Header::decode_with(buf, Strictness::Open)
    }

    /// [`Header::decode`] at the given strictness.
    pub fn decode_with(buf: &[u8], strictness: Strictness) -> Result<Header, FormatError> {
        let mut h = Header::decode_fixed(buf)?;
        let cluster_size = 1u64 << h.cluster_bits;
        if h.version >= 3 {
            h.decode_v3_fields(buf, cluster_size)?;
        }
        if h.backing_file_offset > cluster_size {
            return Err(FormatError::InvalidValue {
                at: at(field::BACKING_FILE_OFFSET as u64),
                field: "backing_file_offset",
                value: h.backing_file_offset,
                reason: "the backing file name must be in the first cluster",
            });
        }
        h.validate_compression_type()?;
        let ctx = ExtensionContext {
            cluster_size,
            crypt_method: h.crypt_method,
            bitmaps_consistent: h.autoclear_features & features::AUTOCLEAR_BITMAPS != 0,
        };
        // Both ≤ 2 MiB (checked above), so the conversions are lossless.
        let ext_start = h.header_length as usize;
        let ext_end = if h.backing_file_offset != 0 {
            h.backing_file_offset
        } else {
            cluster_size
        } as usize;
        h.refuse_unknown_incompatible(buf, ext_start, ext_end, &ctx)?;
        let geometry = Geometry::new(
            h.cluster_bits,
            h.has_extended_l2(),
            h.refcount_order,
            h.size,
        )?;
        if h.crypt_method > CRYPT_LUKS {
            return Err(FormatError::InvalidValue {
                at: at(field::CRYPT_METHOD as u64),
                field: "crypt_method",
                value: h.crypt_method.into(),
                reason: "unsupported encryption method (0 none, 1 AES, 2 LUKS)",
            });
        }
        h.validate_tables(&geometry, strictness)?;
        h.extensions = extensions::decode_all(buf, ext_start, ext_end, &ctx, false)?;
        if h.autoclear_features & features::AUTOCLEAR_DATA_FILE_RAW != 0 && !h.has_data_file() {
            return Err(FormatError::Inconsistent {
                at: at(field::AUTOCLEAR_FEATURES as u64),
                problem: "raw external data bit set without the external data file bit",
            });
        }
        h.decode_backing_name(buf, cluster_size)?;
        Ok(h)
    }

    /// The fields every version has (the first 72 bytes), with magic, version and cluster
    /// size checked.
    fn decode_fixed(buf: &[u8]) -> Result<Header, FormatError> {
        let u32_field = |f: usize| be::u32_at(buf, f, at(f as u64), "header");
        let u64_field = |f: usize| be::u64_at(buf, f, at(f as u64), "header");
        let magic = u32_field(field::MAGIC)?;
        if magic != QCOW2_MAGIC {
            return Err(FormatError::BadMagic { found: magic });
        }
        let version = u32_field(field::VERSION)?;
        if !(2..=3).contains(&version) {
            return Err(FormatError::InvalidValue {
                at: at(field::VERSION as u64),
                field: "version",
                value: version.into(),
                reason: "only versions 2 and 3 are supported",
            });
        }
        let mut h = Header::new(version, 0, 0);
        h.backing_file_offset = u64_field(field::BACKING_FILE_OFFSET)?;
        h.backing_file_size = u32_field(field::BACKING_FILE_SIZE)?;
        h.cluster_bits = u32_field(field::CLUSTER_BITS)?;
        h.size = u64_field(field::SIZE)?;
        h.crypt_method = u32_field(field::CRYPT_METHOD)?;
        h.l1_size = u32_field(field::L1_SIZE)?;
        h.l1_table_offset = u64_field(field::L1_TABLE_OFFSET)?;
        h.refcount_table_offset = u64_field(field::REFCOUNT_TABLE_OFFSET)?;
        h.refcount_table_clusters = u32_field(field::REFCOUNT_TABLE_CLUSTERS)?;
        h.nb_snapshots = u32_field(field::NB_SNAPSHOTS)?;
        h.snapshots_offset = u64_field(field::SNAPSHOTS_OFFSET)?;
        if !(limits::MIN_CLUSTER_BITS..=limits::MAX_CLUSTER_BITS).contains(&h.cluster_bits) {
            return Err(FormatError::InvalidValue {
                at: at(field::CLUSTER_BITS as u64),
                field: "cluster_bits",
                value: h.cluster_bits.into(),
                reason: "must be 9..=21 (512 B to 2 MiB clusters)",
            });
        }
        Ok(h)
    }

    /// The version 3 fields: feature bits, refcount order, header length, and the additional
    /// fields after them (compression type, then bytes we keep as they are).
    fn decode_v3_fields(&mut self, buf: &[u8], cluster_size: u64) -> Result<(), FormatError> {
        let u32_field = |f: usize| be::u32_at(buf, f, at(f as u64), "version 3 header");
        let u64_field = |f: usize| be::u64_at(buf, f, at(f as u64), "version 3 header");
        self.incompatible_features = u64_field(field::INCOMPATIBLE_FEATURES)?;
        self.compatible_features = u64_field(field::COMPATIBLE_FEATURES)?;
        self.autoclear_features = u64_field(field::AUTOCLEAR_FEATURES)?;
        self.refcount_order = u32_field(field::REFCOUNT_ORDER)?;
        self.header_length = u32_field(field::HEADER_LENGTH)?;
        if self.header_length < limits::MIN_V3_HEADER_LENGTH {
            return Err(FormatError::InvalidValue {
                at: at(field::HEADER_LENGTH as u64),
                field: "header_length",
                value: self.header_length.into(),
                reason: "a version 3 header is at least 104 bytes",
            });
        }
        if u64::from(self.header_length) > cluster_size {
            return Err(FormatError::InvalidValue {
                at: at(field::HEADER_LENGTH as u64),
                field: "header_length",
                value: self.header_length.into(),
                reason: "the header must fit in the first cluster",
            });
        }
        let header_len = self.header_length as usize; // ≤ 2 MiB, checked above
        self.compression_type = 0;
        self.unknown_header_tail = Vec::new();
        if header_len > field::COMPRESSION_TYPE {
            let tail = be::bytes_at(
                buf,
                field::COMPRESSION_TYPE,
                header_len - field::COMPRESSION_TYPE,
                at(field::COMPRESSION_TYPE as u64),
                "additional header fields",
            )?;
            self.compression_type = tail[0];
            self.unknown_header_tail = tail[1..].to_vec();
        }
        Ok(())
    }

    /// Refuses incompatible feature bits we do not know, naming them from the feature name
    /// table when the image has one (the extensions are read leniently just for that, as QEMU
    /// does).
    fn refuse_unknown_incompatible(
        &self,
        buf: &[u8],
        ext_start: usize,
        ext_end: usize,
        ctx: &ExtensionContext,
    ) -> Result<(), FormatError> {
        let unknown = self.incompatible_features & !features::INCOMPAT_KNOWN;
        if unknown == 0 {
            return Ok(());
        }
        let exts = extensions::decode_all(buf, ext_start, ext_end, ctx, true).unwrap_or_default();
        let table = exts.iter().rev().find_map(|e| match e {
            HeaderExtension::FeatureNameTable(t) => Some(t),
            _ => None,
        });
        let features = (0..64)
            .filter(|bit| unknown & (1u64 << bit) != 0)
            .map(|bit| UnknownFeature {
                bit,
                name: table.and_then(|t| t.name_of(FeatureKind::Incompatible, bit)),
            })
            .collect();
        Err(FormatError::UnsupportedIncompatibleFeatures { features })
    }

    /// The backing file name, which must fit in the first cluster and in QEMU's 1023 bytes.
    fn decode_backing_name(&mut self, buf: &[u8], cluster_size: u64) -> Result<(), FormatError> {
        if self.backing_file_offset == 0 {
            self.backing_file_size = 0;
            return Ok(());
        }
        let offset = self.backing_file_offset as usize; // ≤ cluster size
        let room =
            (cluster_size - self.backing_file_offset).min(limits::MAX_BACKING_FILE_NAME.into());
        if u64::from(self.backing_file_size) > room {
            return Err(FormatError::LimitExceeded {
                at: at(field::BACKING_FILE_SIZE as u64),
                field: "backing_file_size",
                value: self.backing_file_size.into(),
                limit: room,
                why: "the name must fit in the first cluster and in 1023 bytes",
            });
        }
        let len = self.backing_file_size as usize; // ≤ 1023
        let name = be::bytes_at(
            buf,
            offset,
            len,
            Location::at(Structure::BackingFileName, offset as u64),
            "backing file name",
        )?;
        self.backing_file = Some(name.to_vec());
        Ok(())
    }

    fn validate_compression_type(&self) -> Result<(), FormatError> {
        let bit = self.incompatible_features & features::INCOMPAT_COMPRESSION != 0;
        match self.compression_type {
            COMPRESSION_ZLIB if bit => Err(FormatError::Inconsistent {
                at: at(field::COMPRESSION_TYPE as u64),
                problem: "compression type bit is set but compression_type is zlib (0)",
            }),
            COMPRESSION_ZLIB => Ok(()),
            COMPRESSION_ZSTD if !bit => Err(FormatError::Inconsistent {
                at: at(field::COMPRESSION_TYPE as u64),
                problem: "compression_type is non-zero but the compression type bit is clear",
            }),
            COMPRESSION_ZSTD => Ok(()),
            other => Err(FormatError::InvalidValue {
                at: at(field::COMPRESSION_TYPE as u64),
                field: "compression_type",
                value: other.into(),
                reason: "unknown compression type (0 zlib, 1 zstd)",
            }),
        }
    }

    /// QEMU's placement and size checks for the refcount table, snapshot table and L1 table.
    fn validate_tables(
        &self,
        geometry: &Geometry,
        strictness: Strictness,
    ) -> Result<(), FormatError> {
        let check = strictness == Strictness::Check;
        if self.refcount_table_clusters == 0 && !check {
            return Err(FormatError::InvalidValue {
                at: at(field::REFCOUNT_TABLE_CLUSTERS as u64),
                field: "refcount_table_clusters",
                value: 0,
                reason: "the image has no refcount table",
            });
        }
        geometry.validate_table(&TableBounds {
            at: at(field::REFCOUNT_TABLE_OFFSET as u64),
            offset_field: "refcount_table_offset",
            offset: self.refcount_table_offset,
            size_field: "refcount_table_clusters",
            // A check still wants the table's offset to be sane when the count is zero.
            entries: u64::from(self.refcount_table_clusters.max(u32::from(check))),
            entry_size: geometry.cluster_size(),
            max_bytes: limits::MAX_REFCOUNT_TABLE_BYTES,
            why: "QEMU keeps the refcount table in memory, at most 8 MiB",
        })?;
        if !check {
            geometry.validate_table(&TableBounds {
                at: at(field::SNAPSHOTS_OFFSET as u64),
                offset_field: "snapshots_offset",
                offset: self.snapshots_offset,
                size_field: "nb_snapshots",
                entries: self.nb_snapshots.into(),
                entry_size: limits::SNAPSHOT_ENTRY_FIXED_SIZE,
                max_bytes: limits::SNAPSHOT_ENTRY_FIXED_SIZE * u64::from(limits::MAX_SNAPSHOTS),
                why: "QEMU supports at most 65536 snapshots",
            })?;
        }
        geometry.validate_table(&TableBounds {
            at: at(field::L1_TABLE_OFFSET as u64),
            offset_field: "l1_table_offset",
            offset: self.l1_table_offset,
            size_field: "l1_size",
            entries: self.l1_size.into(),
            entry_size: 8,
            max_bytes: limits::MAX_L1_SIZE_BYTES,
            why: "QEMU keeps the L1 table in memory, at most 32 MiB",
        })?;
        if geometry.l1_entries_needed() > limits::MAX_L1_ENTRIES_NEEDED {
            return Err(FormatError::LimitExceeded {
                at: at(field::SIZE as u64),
                field: "size",
                value: self.size,
                limit: limits::MAX_L1_ENTRIES_NEEDED,
                why: "the image is too big: it needs more L1 entries than QEMU can index",
            });
        }
        if u64::from(self.l1_size) < geometry.l1_entries_needed() {
            return Err(FormatError::InvalidValue {
                at: at(field::L1_SIZE as u64),
                field: "l1_size",
                value: self.l1_size.into(),
                reason: "the L1 table is too small for the virtual disk size",
            });
        }
        Ok(())
    }

    /// Encodes the first cluster: header, extensions, end marker and backing file name
    /// (placed right after the end marker; `backing_file_offset`/`_size` are recomputed).
    /// Fails if it does not fit in `cluster_size` bytes or fields contradict the version.
    pub fn encode(&self, cluster_size: u64) -> Result<Vec<u8>, FormatError> {
        let v3 = self.version >= 3;
        if !(2..=3).contains(&self.version) {
            return Err(FormatError::InvalidValue {
                at: at(field::VERSION as u64),
                field: "version",
                value: self.version.into(),
                reason: "only 2 and 3 can be written",
            });
        }
        if !v3 {
            let v3_only =
                self.incompatible_features | self.compatible_features | self.autoclear_features;
            if v3_only != 0
                || self.refcount_order != 4
                || self.header_length != limits::V2_HEADER_LENGTH
                || !self.unknown_header_tail.is_empty()
                || self.compression_type != 0
            {
                return Err(FormatError::Inconsistent {
                    at: at(field::INCOMPATIBLE_FEATURES as u64),
                    problem: "version 2 headers have no feature bits, refcount order 4, length 72 and zlib",
                });
            }
        } else {
            let expected_tail = (self.header_length as usize).saturating_sub(105);
            let ok = if self.header_length < limits::MIN_V3_HEADER_LENGTH {
                false
            } else if self.header_length == limits::MIN_V3_HEADER_LENGTH {
                self.compression_type == 0 && self.unknown_header_tail.is_empty()
            } else {
                self.unknown_header_tail.len() == expected_tail
            };
            if !ok {
                return Err(FormatError::Inconsistent {
                    at: at(field::HEADER_LENGTH as u64),
                    problem: "header_length does not match compression_type and the unknown header fields",
                });
            }
        }
        let mut out = Vec::with_capacity(4096);
        out.extend_from_slice(&QCOW2_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&[0; 12]); // backing file offset and size, filled in below
        out.extend_from_slice(&self.cluster_bits.to_be_bytes());
        out.extend_from_slice(&self.size.to_be_bytes());
        out.extend_from_slice(&self.crypt_method.to_be_bytes());
        out.extend_from_slice(&self.l1_size.to_be_bytes());
        out.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&self.refcount_table_offset.to_be_bytes());
        out.extend_from_slice(&self.refcount_table_clusters.to_be_bytes());
        out.extend_from_slice(&self.nb_snapshots.to_be_bytes());
        out.extend_from_slice(&self.snapshots_offset.to_be_bytes());
        if v3 {
            out.extend_from_slice(&self.incompatible_features.to_be_bytes());
            out.extend_from_slice(&self.compatible_features.to_be_bytes());
            out.extend_from_slice(&self.autoclear_features.to_be_bytes());
            out.extend_from_slice(&self.refcount_order.to_be_bytes());
            out.extend_from_slice(&self.header_length.to_be_bytes());
            if self.header_length > limits::MIN_V3_HEADER_LENGTH {
                out.push(self.compression_type);
                out.extend_from_slice(&self.unknown_header_tail);
            }
        }
        extensions::encode_all(&self.extensions, &mut out)?;
        if let Some(name) = &self.backing_file {
            if name.len() > limits::MAX_BACKING_FILE_NAME as usize {
                return Err(FormatError::LimitExceeded {
                    at: at(field::BACKING_FILE_SIZE as u64),
                    field: "backing_file_size",
                    value: name.len() as u64,
                    limit: limits::MAX_BACKING_FILE_NAME.into(),
                    why: "QEMU reads at most 1023 bytes of backing file name",
                });
            }
            let offset = out.len() as u64;
            out[8..16].copy_from_slice(&offset.to_be_bytes());
            out[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes()); // ≤ 1023
            out.extend_from_slice(name);
        }
        if out.len() as u64 > cluster_size {
            return Err(FormatError::DoesNotFit {
                at: at(0),
                what: "header, extensions and backing file name",
                need: out.len() as u64,
                available: cluster_size,
            });
        }
        // cluster_size ≥ out.len(), so it fits in usize.
        out.resize(cluster_size as usize, 0);
        Ok(out)
    }

    /// Cluster size in bytes (cluster_bits is validated by `decode`; others saturate).
    pub fn cluster_size(&self) -> u64 {
        1u64.checked_shl(self.cluster_bits).unwrap_or(0)
    }

    /// The geometry the header describes.
    pub fn geometry(&self) -> Result<Geometry, FormatError> {
        Geometry::new(
            self.cluster_bits,
            self.has_extended_l2(),
            self.refcount_order,
            self.size,
        )
        .map(|g| g.with_data_file(self.has_data_file()))
    }

    /// Refcounts may be inconsistent (lazy refcounts were in use).
    pub fn is_dirty(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_DIRTY != 0
    }

    /// The image is marked corrupt.
    pub fn is_corrupt(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_CORRUPT != 0
    }

    /// Guest data lives in an external data file.
    pub fn has_data_file(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_DATA_FILE != 0
    }

    /// The external data file is a consistent raw image.
    pub fn data_file_is_raw(&self) -> bool {
        self.autoclear_features & features::AUTOCLEAR_DATA_FILE_RAW != 0
    }

    /// L2 entries are extended (subclusters).
    pub fn has_extended_l2(&self) -> bool {
        self.incompatible_features & features::INCOMPAT_EXTENDED_L2 != 0
    }

    /// Lazy refcounts are enabled.
    pub fn has_lazy_refcounts(&self) -> bool {
        self.compatible_features & features::COMPAT_LAZY_REFCOUNTS != 0
    }

    /// The compression type's name as qemu-img prints it.
    pub fn compression_type_name(&self) -> &'static str {
        match self.compression_type {
            COMPRESSION_ZSTD => "zstd",
            _ => "zlib",
        }
    }

    /// The feature name table, if present (the last one wins, as in QEMU).
    pub fn feature_table(&self) -> Option<&FeatureNameTable> {
        self.extensions.iter().rev().find_map(|e| match e {
            HeaderExtension::FeatureNameTable(t) => Some(t),
            _ => None,
        })
    }

    /// The name of a feature bit: from the image's feature name table, else our own.
    pub fn feature_name(&self, kind: FeatureKind, bit: u32) -> Option<String> {
        self.feature_table()
            .and_then(|t| t.name_of(kind, bit))
            .or_else(|| features::known_feature_name(kind, bit).map(str::to_owned))
    }

    /// The backing file format name, if recorded.
    pub fn backing_format(&self) -> Option<&[u8]> {
        self.extensions.iter().rev().find_map(|e| match e {
            HeaderExtension::BackingFormat(f) => Some(f.as_slice()),
            _ => None,
        })
    }

    /// The external data file name, if recorded.
    pub fn data_file_name(&self) -> Option<&[u8]> {
        self.extensions.iter().rev().find_map(|e| match e {
            HeaderExtension::ExternalDataFile(f) => Some(f.as_slice()),
            _ => None,
        })
    }

    /// The bitmaps extension, only if the autoclear bit says it is consistent.
    pub fn bitmaps(&self) -> Option<&BitmapsExtension> {
        if self.autoclear_features & features::AUTOCLEAR_BITMAPS == 0 {
            return None;
        }
        self.extensions.iter().rev().find_map(|e| match e {
            HeaderExtension::Bitmaps(b) => Some(b),
            _ => None,
        })
    }

    /// Records `ext` as the bitmaps extension and sets the autoclear bit that vouches for
    /// it; `None` drops the extension and clears the bit.
    pub fn set_bitmaps(&mut self, ext: Option<BitmapsExtension>) {
        self.extensions
            .retain(|e| !matches!(e, HeaderExtension::Bitmaps(_)));
        match ext {
            Some(ext) => {
                self.extensions.push(HeaderExtension::Bitmaps(ext));
                self.autoclear_features |= features::AUTOCLEAR_BITMAPS;
            }
            None => self.autoclear_features &= !features::AUTOCLEAR_BITMAPS,
        }
    }

    /// Names `name` as the backing file and `format` as its format (the backing format
    /// extension); `None` drops either. A backing format without a backing file means
    /// nothing, so it goes with the name. [`Header::encode`] places the name and checks that
    /// everything still fits in the first cluster.
    pub fn set_backing(&mut self, name: Option<Vec<u8>>, format: Option<Vec<u8>>) {
        self.extensions
            .retain(|e| !matches!(e, HeaderExtension::BackingFormat(_)));
        if let (Some(_), Some(f)) = (&name, format) {
            // First, where QEMU puts it whenever it writes a header, so the extensions of
            // an image we rewrite come in QEMU's order.
            self.extensions.insert(0, HeaderExtension::BackingFormat(f));
        }
        self.backing_file = name;
    }

    /// The full disk encryption header pointer, if present.
    pub fn fde_pointer(&self) -> Option<&FdeHeaderPointer> {
        self.extensions.iter().rev().find_map(|e| match e {
            HeaderExtension::FullDiskEncryption(p) => Some(p),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid 64 KiB-cluster version 3 header, encoded into its first cluster.
    fn image() -> (Header, Vec<u8>) {
        let mut h = Header::new(3, 16, 1 << 30);
        h.l1_size = 16;
        h.l1_table_offset = 3 << 16;
        h.refcount_table_offset = 1 << 16;
        h.refcount_table_clusters = 1;
        let mut buf = h.encode(1 << 16).expect("encodes");
        buf.resize(1 << 16, 0);
        (Header::decode(&buf).expect("decodes"), buf)
    }

    fn apply<const N: usize>(buf: &mut [u8], u: FieldUpdate<N>) {
        let at = usize::try_from(u.offset).expect("small");
        buf[at..at + N].copy_from_slice(&u.bytes);
    }

    #[test]
    fn field_updates_change_exactly_their_fields() {
        let (before, mut buf) = image();
        apply(&mut buf, size_update(2 << 30));
        apply(&mut buf, l1_update(32, 5 << 16));
        apply(&mut buf, reftable_update(7 << 16, 2));
        apply(&mut buf, snapshots_update(0, 9 << 16));
        apply(&mut buf, incompatible_update(features::INCOMPAT_DIRTY));
        apply(&mut buf, autoclear_update(0));
        let after = Header::decode(&buf).expect("still valid");
        let mut expected = before.clone();
        expected.size = 2 << 30;
        expected.l1_size = 32;
        expected.l1_table_offset = 5 << 16;
        expected.refcount_table_offset = 7 << 16;
        expected.refcount_table_clusters = 2;
        expected.snapshots_offset = 9 << 16;
        expected.incompatible_features = features::INCOMPAT_DIRTY;
        assert_eq!(after, expected);
        apply(&mut buf, nb_snapshots_update(3));
        let h = Header::decode_with(&buf, Strictness::Check).expect("check strictness");
        assert_eq!(h.nb_snapshots, 3);
    }

    #[test]
    fn backing_file_and_format_are_replaced_together() {
        let (mut h, _) = image();
        h.set_backing(Some(b"base.qcow2".to_vec()), Some(b"qcow2".to_vec()));
        let buf = h.encode(1 << 16).expect("encodes");
        let back = Header::decode(&buf).expect("decodes");
        assert_eq!(back.backing_file.as_deref(), Some(&b"base.qcow2"[..]));
        assert_eq!(back.backing_format(), Some(&b"qcow2"[..]));
        let mut h = back;
        h.set_backing(Some(b"other.raw".to_vec()), Some(b"raw".to_vec()));
        let back = Header::decode(&h.encode(1 << 16).expect("encodes")).expect("decodes");
        assert_eq!(back.backing_file.as_deref(), Some(&b"other.raw"[..]));
        assert_eq!(back.backing_format(), Some(&b"raw"[..]));
        let mut h = back;
        h.set_backing(None, Some(b"raw".to_vec()));
        let back = Header::decode(&h.encode(1 << 16).expect("encodes")).expect("decodes");
        assert_eq!(
            (back.backing_file.as_deref(), back.backing_format()),
            (None, None)
        );
        let mut h = Header::new(3, 9, 1 << 20);
        h.set_backing(Some(vec![b'x'; 1023]), Some(b"qcow2".to_vec()));
        assert!(
            h.encode(512).is_err(),
            "a name that does not fit the first cluster is refused"
        );
    }

    #[test]
    fn active_disk_update_switches_size_and_l1_together() {
        let (before, mut buf) = image();
        apply(&mut buf, active_disk_update(3 << 30, 0, 48, 6 << 16));
        let after = Header::decode(&buf).expect("still valid");
        let mut expected = before;
        expected.size = 3 << 30;
        expected.l1_size = 48;
        expected.l1_table_offset = 6 << 16;
        assert_eq!(after, expected);
    }

    #[test]
    fn refcount_structure_update_keeps_the_fields_between() {
        let (mut before, mut buf) = image();
        before.compatible_features = features::COMPAT_LAZY_REFCOUNTS;
        apply(&mut buf, compatible_update(features::COMPAT_LAZY_REFCOUNTS));
        let u = refcount_structure_update(&before, 8 << 16, 3, 6);
        assert!(u.offset + 52 <= 512, "one sector: the switch cannot tear");
        apply(&mut buf, u);
        let after = Header::decode(&buf).expect("still valid");
        let mut expected = before;
        expected.refcount_table_offset = 8 << 16;
        expected.refcount_table_clusters = 3;
        expected.refcount_order = 6;
        assert_eq!(after, expected);
    }

    #[test]
    fn check_strictness_accepts_what_only_the_checker_can_fix() {
        let (_, mut buf) = image();
        // No refcount table, and a snapshot table that is not cluster aligned.
        apply(&mut buf, reftable_update(1 << 16, 0));
        apply(&mut buf, snapshots_update(1, 12345));
        assert!(Header::decode(&buf).is_err());
        let h = Header::decode_with(&buf, Strictness::Check).expect("a check can look at it");
        assert_eq!(h.refcount_table_clusters, 0);
        assert_eq!((h.nb_snapshots, h.snapshots_offset), (1, 12345));
        // A refcount table offset that is not aligned is refused even by a check.
        apply(&mut buf, reftable_update(12345, 0));
        assert!(Header::decode_with(&buf, Strictness::Check).is_err());
    }
}
