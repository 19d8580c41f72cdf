//! Reading the header from the first cluster, with every check QEMU applies before it opens
//! an image that the first cluster alone can show.

use super::field;
use super::model::{at, Header};
use super::values::{Strictness, COMPRESSION_ZLIB, COMPRESSION_ZSTD, CRYPT_LUKS, QCOW2_MAGIC};
use crate::be;
use crate::error::{FormatError, Location, Structure, UnknownFeature};
use crate::extensions::{self, ExtensionContext, HeaderExtension};
use crate::features::{self, FeatureKind};
use crate::geometry::{Geometry, TableBounds};
use crate::limits;

impl Header {
    /// Decodes and validates the header from the first cluster of the file (or the whole file
    /// if it is shorter), applying every check QEMU applies when opening an image that can be
    /// made from the first cluster alone.
    pub fn decode(buf: &[u8]) -> Result<Header, FormatError> {
        Header::decode_with(buf, Strictness::Open)
    }

    /// [`Header::decode`] at the given strictness.
    pub fn decode_with(buf: &[u8], strictness: Strictness) -> Result<Header, FormatError> {
        Header::decode_from(buf, strictness, false)
    }

    /// Decodes the header from `buf`, the start of the first cluster only, if everything
    /// the header needs (extensions up to their end marker, the backing file name) lies in
    /// it; `None` if it does not, or if the header is not valid (decode the whole cluster
    /// to learn why).
    pub fn decode_prefix(buf: &[u8], strictness: Strictness) -> Option<Header> {
        Header::decode_from(buf, strictness, true).ok()
    }

    fn decode_from(
        buf: &[u8],
        strictness: Strictness,
        prefix: bool,
    ) -> Result<Header, FormatError> {
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
            prefix,
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
        // QEMU refuses every open of a LUKS image without its header extension.
        if h.crypt_method == CRYPT_LUKS && !prefix && h.fde_pointer().is_none() {
            return Err(FormatError::MissingCryptoHeader {
                method: h.crypt_method,
            });
        }
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
}
