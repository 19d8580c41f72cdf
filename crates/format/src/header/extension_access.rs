//! What the header's extensions record (feature names, backing format, external data file,
//! bitmaps, the encryption header's place), and replacing the ones the tools change.

use super::model::Header;
use crate::bitmap::BitmapsExtension;
use crate::extensions::{FdeHeaderPointer, FeatureNameTable, HeaderExtension};
use crate::features::{self, FeatureKind};

impl Header {
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
