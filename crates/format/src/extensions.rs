//! Header extensions (backing format, feature name table, bitmaps, full-disk-encryption
//! pointer, external data file name, and unknown ones kept verbatim) and the area they live in.

use super::be;
use super::bitmap::BitmapsExtension;
use super::error::{FormatError, Location, Structure};
use super::features::FeatureKind;
use super::limits;

/// Extension type: end of the extension area.
pub const EXT_END: u32 = 0x0000_0000;
/// Extension type: backing file format name.
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Extension type: feature name table.
pub const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
/// Extension type: bitmaps.
pub const EXT_BITMAPS: u32 = 0x2385_2875;
/// Extension type: full disk encryption header pointer.
pub const EXT_FDE: u32 = 0x0537_be77;
/// Extension type: external data file name.
pub const EXT_DATA_FILE: u32 = 0x4441_5441;

/// Size of one feature name table entry.
pub const FEATURE_ENTRY_SIZE: usize = 48;
/// Bytes of name in a feature name table entry.
pub const FEATURE_NAME_LEN: usize = 46;

/// One feature name table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureNameEntry {
    /// Type byte: 0 incompatible, 1 compatible, 2 autoclear (others kept as found).
    pub kind: u8,
    /// Bit number within that bitmap.
    pub bit: u8,
    /// Name, zero-padded, not necessarily NUL-terminated.
    pub name: [u8; FEATURE_NAME_LEN],
}

impl FeatureNameEntry {
    /// Builds an entry from a name (truncated to 46 bytes).
    pub fn new(kind: FeatureKind, bit: u8, name: &str) -> Self {
        let mut buf = [0u8; FEATURE_NAME_LEN];
        let len = name.len().min(FEATURE_NAME_LEN);
        buf[..len].copy_from_slice(&name.as_bytes()[..len]);
        FeatureNameEntry {
            kind: kind.to_byte(),
            bit,
            name: buf,
        }
    }

    /// The name up to the first NUL, for display.
    pub fn name_lossy(&self) -> String {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(FEATURE_NAME_LEN);
        String::from_utf8_lossy(&self.name[..end]).into_owned()
    }
}

/// The feature name table: whole entries plus any trailing partial entry, kept verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FeatureNameTable {
    /// Entries in file order.
    pub entries: Vec<FeatureNameEntry>,
    /// Bytes after the last whole entry (the length need not be a multiple of 48).
    pub trailing: Vec<u8>,
}

impl FeatureNameTable {
    /// The name the table gives to `bit` of `kind`, if any. The table is read as QEMU reads
    /// it: a trailing partial entry counts, padded with zeros, and the first entry with an
    /// empty name ends the table.
    pub fn name_of(&self, kind: FeatureKind, bit: u32) -> Option<String> {
        let partial = (self.trailing.len() >= 2).then(|| {
            let mut name = [0u8; FEATURE_NAME_LEN];
            let tail = &self.trailing[2..];
            name[..tail.len()].copy_from_slice(tail);
            FeatureNameEntry {
                kind: self.trailing[0],
                bit: self.trailing[1],
                name,
            }
        });
        self.entries
            .iter()
            .chain(partial.as_ref())
            .take_while(|e| e.name[0] != 0)
            .find(|e| e.kind == kind.to_byte() && u32::from(e.bit) == bit)
            .map(FeatureNameEntry::name_lossy)
    }

    fn decode(data: &[u8]) -> Self {
        let mut chunks = data.chunks_exact(FEATURE_ENTRY_SIZE);
        let entries = chunks
            .by_ref()
            .map(|c| {
                let mut name = [0u8; FEATURE_NAME_LEN];
                name.copy_from_slice(&c[2..]);
                FeatureNameEntry {
                    kind: c[0],
                    bit: c[1],
                    name,
                }
            })
            .collect();
        FeatureNameTable {
            entries,
            trailing: chunks.remainder().to_vec(),
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        for e in &self.entries {
            out.push(e.kind);
            out.push(e.bit);
            out.extend_from_slice(&e.name);
        }
        out.extend_from_slice(&self.trailing);
    }
}

/// The full disk encryption header pointer (LUKS only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdeHeaderPointer {
    /// File offset of the encryption header (cluster-aligned).
    pub offset: u64,
    /// Length of the encryption header in bytes.
    pub length: u64,
}

/// One header extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderExtension {
    /// Backing file format name (e.g. `qcow2`, `raw`).
    BackingFormat(Vec<u8>),
    /// Names of feature bits.
    FeatureNameTable(FeatureNameTable),
    /// Persistent bitmaps.
    Bitmaps(BitmapsExtension),
    /// Where the LUKS header is.
    FullDiskEncryption(FdeHeaderPointer),
    /// External data file name.
    ExternalDataFile(Vec<u8>),
    /// An extension we do not know, kept verbatim so a header rewrite preserves it.
    Unknown {
        /// Its type.
        magic: u32,
        /// Its data, without padding.
        data: Vec<u8>,
    },
}

impl HeaderExtension {
    /// The extension's type (magic).
    pub fn magic(&self) -> u32 {
        match self {
            HeaderExtension::BackingFormat(_) => EXT_BACKING_FORMAT,
            HeaderExtension::FeatureNameTable(_) => EXT_FEATURE_TABLE,
            HeaderExtension::Bitmaps(_) => EXT_BITMAPS,
            HeaderExtension::FullDiskEncryption(_) => EXT_FDE,
            HeaderExtension::ExternalDataFile(_) => EXT_DATA_FILE,
            HeaderExtension::Unknown { magic, .. } => *magic,
        }
    }

    fn encode_data(&self, out: &mut Vec<u8>) {
        match self {
            HeaderExtension::BackingFormat(s) | HeaderExtension::ExternalDataFile(s) => {
                out.extend_from_slice(s)
            }
            HeaderExtension::FeatureNameTable(t) => t.encode(out),
            HeaderExtension::Bitmaps(b) => out.extend_from_slice(&b.encode()),
            HeaderExtension::FullDiskEncryption(p) => {
                out.extend_from_slice(&p.offset.to_be_bytes());
                out.extend_from_slice(&p.length.to_be_bytes());
            }
            HeaderExtension::Unknown { data, .. } => out.extend_from_slice(data),
        }
    }
}

/// Header facts the extension checks depend on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExtensionContext {
    pub cluster_size: u64,
    pub crypt_method: u32,
    pub bitmaps_consistent: bool,
    /// The buffer is only the start of the first cluster: its end is not the file's end,
    /// so running into it is an error rather than the end marker.
    pub prefix: bool,
}

/// Decodes the extension area `buf[start..end]` (file offsets, since the header is at 0).
/// With `lenient`, stops quietly at the first problem instead of failing: that mode only
/// serves to find feature names for an error message, as QEMU does.
pub(crate) fn decode_all(
    buf: &[u8],
    start: usize,
    end: usize,
    ctx: &ExtensionContext,
    lenient: bool,
) -> Result<Vec<HeaderExtension>, FormatError> {
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        match decode_one(buf, pos, end, ctx) {
            Ok(Some((ext, next))) => {
                out.push(ext);
                pos = next;
            }
            Ok(None) => break,
            Err(_) if lenient => break,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Decodes the extension at `pos`; `None` at the end marker.
fn decode_one(
    buf: &[u8],
    pos: usize,
    end: usize,
    ctx: &ExtensionContext,
) -> Result<Option<(HeaderExtension, usize)>, FormatError> {
    let at = Location::at(Structure::HeaderExtension, pos as u64);
    // A file that ends inside the first cluster reads as zeros past its end, which is the
    // end marker.
    if pos >= buf.len() && !ctx.prefix {
        return Ok(None);
    }
    let magic = be::u32_at(buf, pos, at, "extension type")?;
    let len = be::u32_at(buf, pos + 4, at, "extension length")?;
    let data_start = pos + 8;
    let remaining = end.checked_sub(data_start);
    let len_usize = be::to_usize(len.into(), at, "extension length")?;
    if remaining.is_none_or(|r| len_usize > r) {
        return Err(FormatError::InvalidValue {
            at,
            field: "extension length",
            value: len.into(),
            reason: "extends past the end of the header extension area",
        });
    }
    if magic == EXT_END {
        return Ok(None);
    }
    let data = be::bytes_at(buf, data_start, len_usize, at, "extension data")?;
    let data_at = Location::at(Structure::HeaderExtension, data_start as u64);
    let ext = match magic {
        EXT_BACKING_FORMAT => {
            if len > limits::MAX_BACKING_FORMAT_NAME {
                return Err(FormatError::LimitExceeded {
                    at,
                    field: "backing format name length",
                    value: len.into(),
                    limit: limits::MAX_BACKING_FORMAT_NAME.into(),
                    why: "QEMU stores format names in 16 bytes",
                });
            }
            HeaderExtension::BackingFormat(data.to_vec())
        }
        EXT_FEATURE_TABLE => HeaderExtension::FeatureNameTable(FeatureNameTable::decode(data)),
        EXT_FDE => {
            if ctx.crypt_method != 2 {
                return Err(FormatError::Inconsistent {
                    at,
                    problem: "full disk encryption header pointer without LUKS encryption (crypt_method 2)",
                });
            }
            if data.len() != 16 {
                return Err(FormatError::InvalidValue {
                    at,
                    field: "encryption header pointer length",
                    value: len.into(),
                    reason: "must be 16",
                });
            }
            let offset = be::u64_at(data, 0, data_at, "encryption header offset")?;
            let length = be::u64_at(data, 8, data_at, "encryption header length")?;
            if offset % ctx.cluster_size != 0 {
                return Err(FormatError::Unaligned {
                    at: data_at,
                    field: "encryption header offset",
                    offset,
                    cluster_size: ctx.cluster_size,
                });
            }
            HeaderExtension::FullDiskEncryption(FdeHeaderPointer { offset, length })
        }
        EXT_BITMAPS => {
            let ext = BitmapsExtension::decode(data, at)?;
            // An inconsistent extension (autoclear bit clear) is ignored by QEMU, not
            // validated: a program without bitmap support may have left it stale.
            if ctx.bitmaps_consistent {
                ext.validate(ctx.cluster_size, data_at)?;
            }
            HeaderExtension::Bitmaps(ext)
        }
        EXT_DATA_FILE => HeaderExtension::ExternalDataFile(data.to_vec()),
        _ => HeaderExtension::Unknown {
            magic,
            data: data.to_vec(),
        },
    };
    // The padding may run past `end` only if the area itself is unpadded; clamp to `end`.
    let next = be::pad8(data_start + len_usize)
        .unwrap_or(end)
        .min(end.max(data_start + len_usize));
    Ok(Some((ext, next)))
}

/// Appends the encoded extensions (each padded to 8 bytes) and the end marker to `out`.
pub(crate) fn encode_all(exts: &[HeaderExtension], out: &mut Vec<u8>) -> Result<(), FormatError> {
    for ext in exts {
        let start = out.len();
        out.extend_from_slice(&ext.magic().to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        ext.encode_data(out);
        let len = out.len() - start - 8;
        let len32 = u32::try_from(len).map_err(|_| FormatError::DoesNotFit {
            at: Location::at(Structure::HeaderExtension, start as u64),
            what: "header extension",
            need: len as u64,
            available: u32::MAX.into(),
        })?;
        out[start + 4..start + 8].copy_from_slice(&len32.to_be_bytes());
        let padded = be::pad8(out.len()).unwrap_or(out.len());
        out.resize(padded, 0);
    }
    out.extend_from_slice(&[0; 8]);
    Ok(())
}
