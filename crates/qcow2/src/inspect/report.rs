//! The `info` report: a serializable model whose JSON keys are exactly `qemu-img info
//! --output=json`'s for every fact both tools show.

use serde::Serialize;

use super::read::ImageMetadata;
use crate::format::header::{CRYPT_AES, CRYPT_LUKS};

/// What `info` reports about one image (one element of `--backing-chain`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ImageInfo {
    /// The image's file name as given (or as resolved for backing files).
    pub filename: String,
    /// `qcow2` or `raw`.
    pub format: String,
    /// Virtual disk size in bytes.
    pub virtual_size: u64,
    /// Bytes the file occupies on disk (allocated blocks), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actual_size: Option<u64>,
    /// Cluster size (qcow2 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_size: Option<u64>,
    /// Present (and true) only for encrypted images.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encrypted: Option<bool>,
    /// The dirty bit (`None` where QEMU shows none: an image read over NBD).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_flag: Option<bool>,
    /// Backing file name as stored in the image.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backing_filename: Option<String>,
    /// Backing file name resolved against the image's directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub full_backing_filename: Option<String>,
    /// Backing file format from the header extension.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backing_filename_format: Option<String>,
    /// Internal snapshots (omitted when there are none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<Vec<SnapshotInfo>>,
    /// qcow2-specific facts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format_specific: Option<FormatSpecific>,
    /// The protocol node below the format node (the image file itself).
    pub children: Vec<ChildInfo>,
    /// Under `--untrusted` only (QEMU has no such key): every file the image names, and
    /// whether it would be refused and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untrusted_references: Option<Vec<ReferenceReport>>,
}

/// One file an image names, as `info --untrusted` judges it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ReferenceReport {
    /// `backing file` or `external data file`.
    pub kind: String,
    /// Where in the image the name is kept.
    pub place: String,
    /// The name as the image gives it.
    pub name: String,
    /// What a `json:` name describes: the node driver of the file, `file` for a plain path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// Where it resolves to, when it could be resolved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolved: Option<String>,
    /// Why it would be refused; absent when it is admitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// One internal snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct SnapshotInfo {
    /// Unique ID.
    pub id: String,
    /// Name (tag).
    pub name: String,
    /// VM state size in bytes.
    pub vm_state_size: u64,
    /// Date, seconds since the epoch.
    pub date_sec: u64,
    /// Date, nanoseconds part.
    pub date_nsec: u64,
    /// Guest clock, whole seconds.
    pub vm_clock_sec: u64,
    /// Guest clock, nanoseconds part.
    pub vm_clock_nsec: u64,
    /// Instruction count, when recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icount: Option<u64>,
}

impl SnapshotInfo {
    /// What `info` and `snapshot -l` show of a snapshot table entry.
    pub fn from_entry(s: &crate::format::SnapshotTableEntry) -> SnapshotInfo {
        SnapshotInfo {
            id: s.id_lossy(),
            name: s.name_lossy(),
            vm_state_size: s.vm_state_size(),
            date_sec: s.date_sec.into(),
            date_nsec: s.date_nsec.into(),
            vm_clock_sec: s.vm_clock_nsec / 1_000_000_000,
            vm_clock_nsec: s.vm_clock_nsec % 1_000_000_000,
            icount: s.icount(),
        }
    }
}

/// `format-specific`: `{ "type": "qcow2", "data": {...} }` (or `luks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FormatSpecific {
    /// `qcow2` or `luks`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The facts.
    pub data: SpecificData,
}

/// The facts of one format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum SpecificData {
    /// A qcow2 image's.
    Qcow2(Qcow2Specific),
    /// A LUKS volume's: its header, as a qcow2 image's `encrypt` shows it without `format`.
    Luks(EncryptInfo),
}

impl SpecificData {
    /// The qcow2 facts, if this is a qcow2 image.
    pub fn qcow2(&self) -> Option<&Qcow2Specific> {
        match self {
            SpecificData::Qcow2(q) => Some(q),
            SpecificData::Luks(_) => None,
        }
    }
}

/// qcow2-specific facts, keyed like qemu-img's `ImageInfoSpecificQCow2`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Qcow2Specific {
    /// `0.10` (version 2) or `1.1` (version 3).
    pub compat: String,
    /// `zlib` or `zstd`.
    pub compression_type: String,
    /// Lazy refcounts (version 3 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lazy_refcounts: Option<bool>,
    /// Persistent bitmaps (omitted when there are none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bitmaps: Option<Vec<BitmapInfo>>,
    /// Refcount width.
    pub refcount_bits: u32,
    /// Encryption format, and the LUKS header's facts (serialized where qemu-img puts it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encrypt: Option<EncryptInfo>,
    /// Corrupt bit (version 3 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub corrupt: Option<bool>,
    /// Extended L2 entries (version 3 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extended_l2: Option<bool>,
    /// External data file name, if recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_file: Option<String>,
    /// Whether the external data file is raw (only with an external data file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_file_raw: Option<bool>,
}

/// Encryption: its format and, for LUKS, the header's facts (in qemu-img's key order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct EncryptInfo {
    /// IV generator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ivgen_alg: Option<String>,
    /// Always false: the header lives inside the qcow2 file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detached_header: Option<bool>,
    /// PBKDF2 hash.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hash_alg: Option<String>,
    /// Cipher.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cipher_alg: Option<String>,
    /// The volume UUID.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// `aes` or `luks` (absent for a LUKS volume, where the format says it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Cipher mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cipher_mode: Option<String>,
    /// Key slots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<Vec<EncryptSlot>>,
    /// Payload offset in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_offset: Option<u64>,
    /// Master key digest iterations.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master_key_iters: Option<u32>,
}

/// One LUKS key slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct EncryptSlot {
    /// Holds a key.
    pub active: bool,
    /// PBKDF2 iterations (active slots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iters: Option<u32>,
    /// Key material offset in bytes.
    pub key_offset: u64,
    /// AF stripes (active slots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stripes: Option<u32>,
}

impl EncryptInfo {
    /// Just the format (legacy AES, or a LUKS header that could not be read).
    pub fn format_only(format: &str) -> EncryptInfo {
        EncryptInfo {
            ivgen_alg: None,
            detached_header: None,
            hash_alg: None,
            cipher_alg: None,
            uuid: None,
            format: Some(format.into()),
            cipher_mode: None,
            slots: None,
            payload_offset: None,
            master_key_iters: None,
        }
    }

    /// A LUKS header's facts.
    pub fn luks(l: &crate::crypto::LuksInfo) -> EncryptInfo {
        EncryptInfo {
            ivgen_alg: Some(l.ivgen_alg.clone()),
            detached_header: Some(false),
            hash_alg: Some(l.hash_alg.clone()),
            cipher_alg: Some(l.cipher_alg.clone()),
            uuid: Some(l.uuid.clone()),
            format: Some("luks".into()),
            cipher_mode: Some(l.cipher_mode.clone()),
            slots: Some(
                l.slots
                    .iter()
                    .map(|s| EncryptSlot {
                        active: s.active,
                        iters: s.iters,
                        key_offset: s.key_offset,
                        stripes: s.stripes,
                    })
                    .collect(),
            ),
            payload_offset: Some(l.payload_offset),
            master_key_iters: Some(l.master_key_iters),
        }
    }
}

/// One persistent bitmap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BitmapInfo {
    /// `in-use` and/or `auto`.
    pub flags: Vec<String>,
    /// Name.
    pub name: String,
    /// Bytes per bit.
    pub granularity: u64,
}

/// The protocol (file) node under an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChildInfo {
    /// Always `file`.
    pub name: String,
    /// Facts about the file.
    pub info: FileNodeInfo,
}

/// Facts about the image file itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct FileNodeInfo {
    /// No children.
    pub children: Vec<ChildInfo>,
    /// File length in bytes.
    pub virtual_size: u64,
    /// File name.
    pub filename: String,
    /// Always `file`.
    pub format: String,
    /// Allocated bytes on disk, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actual_size: Option<u64>,
    /// `{ "type": "file", "data": {} }` for a file; none for NBD.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format_specific: Option<FileSpecific>,
    /// False for a file; none for NBD.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_flag: Option<bool>,
}

/// The file node's (empty) format-specific facts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileSpecific {
    /// Always `file`.
    #[serde(rename = "type")]
    pub kind: String,
    /// No facts.
    pub data: EmptyData,
}

/// An empty JSON object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EmptyData {}

impl ChildInfo {
    /// The file node for `filename`. Like QEMU, the length is reported in whole 512-byte
    /// sectors, rounded up.
    pub fn file(filename: &str, file_len: u64, actual_size: Option<u64>) -> ChildInfo {
        ChildInfo {
            name: "file".into(),
            info: FileNodeInfo {
                children: Vec::new(),
                virtual_size: file_len.div_ceil(512).saturating_mul(512),
                filename: filename.into(),
                format: "file".into(),
                actual_size,
                format_specific: Some(FileSpecific {
                    kind: "file".into(),
                    data: EmptyData {},
                }),
                dirty_flag: Some(false),
            },
        }
    }
}

impl ImageInfo {
    /// The report for a decoded qcow2 image. File-system facts (allocated size, resolved
    /// backing name) are left for the caller, which knows the path.
    pub fn from_metadata(meta: &ImageMetadata, filename: &str) -> ImageInfo {
        let h = &meta.header;
        let v3 = h.version >= 3;
        let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let bitmaps: Vec<BitmapInfo> = meta
            .bitmaps
            .iter()
            .map(|b| BitmapInfo {
                flags: [(b.in_use(), "in-use"), (b.auto(), "auto")]
                    .iter()
                    .filter(|(set, _)| *set)
                    .map(|(_, name)| (*name).to_owned())
                    .collect(),
                name: b.name_lossy(),
                granularity: b.granularity(),
            })
            .collect();
        let snapshots: Vec<SnapshotInfo> = meta
            .snapshots
            .iter()
            .map(SnapshotInfo::from_entry)
            .collect();
        let encrypt = match h.crypt_method {
            CRYPT_AES => Some(EncryptInfo::format_only("aes")),
            CRYPT_LUKS => Some(
                meta.luks
                    .as_ref()
                    .map_or_else(|| EncryptInfo::format_only("luks"), EncryptInfo::luks),
            ),
            _ => None,
        };
        let data = Qcow2Specific {
            compat: if v3 { "1.1" } else { "0.10" }.into(),
            compression_type: h.compression_type_name().into(),
            lazy_refcounts: v3.then(|| h.has_lazy_refcounts()),
            bitmaps: (!bitmaps.is_empty()).then_some(bitmaps),
            refcount_bits: meta.geometry.refcount_bits(),
            corrupt: v3.then(|| h.is_corrupt()),
            extended_l2: v3.then(|| h.has_extended_l2()),
            data_file: h.data_file_name().map(lossy),
            data_file_raw: h.has_data_file().then(|| h.data_file_is_raw()),
            encrypt,
        };
        ImageInfo {
            filename: filename.into(),
            format: "qcow2".into(),
            virtual_size: h.size,
            actual_size: None,
            cluster_size: Some(meta.geometry.cluster_size()),
            encrypted: (h.crypt_method != 0).then_some(true),
            dirty_flag: Some(h.is_dirty()),
            backing_filename: h
                .backing_file
                .as_deref()
                .filter(|n| !n.is_empty())
                .map(lossy),
            full_backing_filename: None,
            backing_filename_format: h.backing_format().map(lossy),
            snapshots: (!snapshots.is_empty()).then_some(snapshots),
            format_specific: Some(FormatSpecific {
                kind: "qcow2".into(),
                data: SpecificData::Qcow2(data),
            }),
            children: vec![ChildInfo::file(filename, meta.file_len, None)],
            untrusted_references: None,
        }
    }

    /// The report for a raw image (a backing file without qcow2 metadata); its size is the
    /// file length in whole sectors, as QEMU reports it.
    pub fn raw(filename: &str, file_len: u64) -> ImageInfo {
        ImageInfo {
            filename: filename.into(),
            format: "raw".into(),
            virtual_size: file_len.div_ceil(512).saturating_mul(512),
            actual_size: None,
            cluster_size: None,
            encrypted: None,
            dirty_flag: Some(false),
            backing_filename: None,
            full_backing_filename: None,
            backing_filename_format: None,
            snapshots: None,
            format_specific: None,
            children: vec![ChildInfo::file(filename, file_len, None)],
            untrusted_references: None,
        }
    }

    /// The report for a LUKS volume (QEMU's `luks` driver): its disk is the file after the
    /// payload offset, and its header's facts are the format's (`None` when the header
    /// could not be read).
    pub fn luks(
        filename: &str,
        file_len: u64,
        header: Option<&crate::crypto::LuksInfo>,
    ) -> ImageInfo {
        let payload = header.map_or(0, |l| l.payload_offset);
        ImageInfo {
            filename: filename.into(),
            format: "luks".into(),
            virtual_size: file_len.saturating_sub(payload),
            actual_size: None,
            cluster_size: None,
            encrypted: Some(true),
            dirty_flag: Some(false),
            backing_filename: None,
            full_backing_filename: None,
            backing_filename_format: None,
            snapshots: None,
            format_specific: header.map(|l| FormatSpecific {
                kind: "luks".into(),
                data: SpecificData::Luks(EncryptInfo {
                    format: None,
                    ..EncryptInfo::luks(l)
                }),
            }),
            children: vec![ChildInfo::file(filename, file_len, None)],
            untrusted_references: None,
        }
    }

    /// Marks the image as read through a network protocol driver (its file node is
    /// `protocol`, such as `nbd`), shown as QEMU shows one: no dirty flag and no
    /// file-specific facts.
    pub fn set_file_protocol(&mut self, protocol: &str) {
        if self.format == "raw" {
            self.dirty_flag = None;
        }
        for child in &mut self.children {
            child.info.format = protocol.into();
            child.info.format_specific = None;
            child.info.dirty_flag = None;
        }
    }

    /// Makes the report one of a protocol node opened on its own (`driver=nbd`): QEMU shows
    /// the protocol as the format, and no file node below it.
    pub fn set_protocol_node(&mut self, protocol: &str) {
        self.format = protocol.into();
        self.dirty_flag = None;
        self.children.clear();
    }

    /// Marks the file node as a `null-co` device rather than a file.
    pub fn set_null_co(&mut self) {
        for child in &mut self.children {
            child.info.format = "null-co".into();
        }
    }

    /// Records the allocated size on disk for the image and its file node.
    pub fn set_actual_size(&mut self, actual: u64) {
        self.actual_size = Some(actual);
        for child in &mut self.children {
            child.info.actual_size = Some(actual);
        }
    }
}
