//! Feature bit constants and their names, as QEMU writes them into the feature name table.

/// Incompatible: refcounts may be inconsistent (lazy refcounts in use).
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
/// Incompatible: the image is corrupt and must not be written.
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
/// Incompatible: guest data lives in an external data file.
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
/// Incompatible: `compression_type` is non-zero.
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
/// Incompatible: L2 entries are 128-bit with subcluster bitmaps.
pub const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
/// Every incompatible bit this implementation understands.
pub const INCOMPAT_KNOWN: u64 = INCOMPAT_DIRTY
    | INCOMPAT_CORRUPT
    | INCOMPAT_DATA_FILE
    | INCOMPAT_COMPRESSION
    | INCOMPAT_EXTENDED_L2;

/// Compatible: lazy refcount updates may be used.
pub const COMPAT_LAZY_REFCOUNTS: u64 = 1 << 0;
/// Every compatible bit this implementation understands.
pub const COMPAT_KNOWN: u64 = COMPAT_LAZY_REFCOUNTS;

/// Autoclear: the bitmaps extension is consistent.
pub const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// Autoclear: the external data file is a valid raw image on its own.
pub const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;
/// Every autoclear bit this implementation understands.
pub const AUTOCLEAR_KNOWN: u64 = AUTOCLEAR_BITMAPS | AUTOCLEAR_DATA_FILE_RAW;

/// Which of the three feature bitmaps a bit belongs to (the feature name table's type byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FeatureKind {
    /// `incompatible_features`: unknown bits make the image unreadable.
    Incompatible,
    /// `compatible_features`: unknown bits may be ignored.
    Compatible,
    /// `autoclear_features`: unknown bits must be cleared before writing.
    Autoclear,
}

impl FeatureKind {
    /// The type byte used in the feature name table.
    pub const fn to_byte(self) -> u8 {
        match self {
            FeatureKind::Incompatible => 0,
            FeatureKind::Compatible => 1,
            FeatureKind::Autoclear => 2,
        }
    }

    /// Parses a feature name table type byte; other values are unknown kinds.
    pub const fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            0 => Some(FeatureKind::Incompatible),
            1 => Some(FeatureKind::Compatible),
            2 => Some(FeatureKind::Autoclear),
            _ => None,
        }
    }
}

/// The name of a feature bit we know, as QEMU spells it in its feature name table.
pub const fn known_feature_name(kind: FeatureKind, bit: u32) -> Option<&'static str> {
    match (kind, bit) {
        (FeatureKind::Incompatible, 0) => Some("dirty bit"),
        (FeatureKind::Incompatible, 1) => Some("corrupt bit"),
        (FeatureKind::Incompatible, 2) => Some("external data file"),
        (FeatureKind::Incompatible, 3) => Some("compression type"),
        (FeatureKind::Incompatible, 4) => Some("extended L2 entries"),
        (FeatureKind::Compatible, 0) => Some("lazy refcounts"),
        (FeatureKind::Autoclear, 0) => Some("bitmaps"),
        (FeatureKind::Autoclear, 1) => Some("raw external data"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_bytes_round_trip_and_unknown_kinds_are_none() {
        for kind in [
            FeatureKind::Incompatible,
            FeatureKind::Compatible,
            FeatureKind::Autoclear,
        ] {
            assert_eq!(FeatureKind::from_byte(kind.to_byte()), Some(kind));
        }
        assert_eq!(FeatureKind::from_byte(3), None);
    }

    #[test]
    fn known_masks_match_named_bits() {
        for (kind, mask) in [
            (FeatureKind::Incompatible, INCOMPAT_KNOWN),
            (FeatureKind::Compatible, COMPAT_KNOWN),
            (FeatureKind::Autoclear, AUTOCLEAR_KNOWN),
        ] {
            for bit in 0..64 {
                assert_eq!(
                    known_feature_name(kind, bit).is_some(),
                    mask & (1 << bit) != 0
                );
            }
        }
    }
}
