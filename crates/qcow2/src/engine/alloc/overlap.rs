//! Where the writable layer's metadata lives, so that no guest data write can land on it.
//!
//! QEMU runs the same check before every data write ("overlap check"): a corrupt L2 entry that
//! points at an L1 table, a refcount block or the header must never turn a guest write into
//! metadata corruption. A hit marks the image corrupt instead.

use std::collections::BTreeMap;

/// A kind of metadata, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MetaKind {
    Header,
    L1Table,
    L2Table,
    RefcountTable,
    RefcountBlock,
    SnapshotTable,
    SnapshotL1Table,
    BitmapDirectory,
    BitmapTable,
    EncryptionHeader,
}

impl MetaKind {
    /// A human name.
    pub fn name(self) -> &'static str {
        match self {
            MetaKind::Header => "the image header",
            MetaKind::L1Table => "the L1 table",
            MetaKind::L2Table => "an L2 table",
            MetaKind::RefcountTable => "the refcount table",
            MetaKind::RefcountBlock => "a refcount block",
            MetaKind::SnapshotTable => "the snapshot table",
            MetaKind::SnapshotL1Table => "a snapshot's L1 table",
            MetaKind::BitmapDirectory => "the bitmap directory",
            MetaKind::BitmapTable => "a bitmap table",
            MetaKind::EncryptionHeader => "the encryption header",
        }
    }
}

/// Non-overlapping metadata byte ranges of one file, by start offset.
#[derive(Default)]
pub(crate) struct MetaIndex {
    ranges: BTreeMap<u64, (u64, MetaKind)>,
}

impl MetaIndex {
    /// Records `[start, start + len)` as metadata.
    pub fn insert(&mut self, start: u64, len: u64, kind: MetaKind) {
        if len > 0 {
            self.ranges.insert(start, (start.saturating_add(len), kind));
        }
    }

    /// Forgets the metadata range that starts at `start` (its clusters were freed).
    pub fn remove(&mut self, start: u64) {
        self.ranges.remove(&start);
    }

    /// The metadata range overlapping `[start, start + len)`, if any.
    pub fn overlap(&self, start: u64, len: u64) -> Option<(u64, MetaKind)> {
        let end = start.saturating_add(len);
        // Ranges never overlap each other, so the last one starting before `end` is the only
        // one that can reach into the write: earlier ones end before it starts.
        if let Some((&s, &(e, kind))) = self.ranges.range(..end).next_back() {
            if e > start {
                return Some((s, kind));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_overlaps_at_every_edge() {
        let mut m = MetaIndex::default();
        m.insert(0, 65536, MetaKind::Header);
        m.insert(0x30000, 0x10000, MetaKind::L1Table);
        m.insert(0x50000, 0x10000, MetaKind::L2Table);
        assert_eq!(m.overlap(0xffff, 1).map(|o| o.1), Some(MetaKind::Header));
        assert_eq!(m.overlap(0x10000, 0x20000), None);
        assert_eq!(
            m.overlap(0x10000, 0x20001).map(|o| o.1),
            Some(MetaKind::L1Table)
        );
        assert_eq!(
            m.overlap(0x3ffff, 0x20000).map(|o| o.1),
            Some(MetaKind::L2Table)
        );
        assert_eq!(m.overlap(0x60000, 0x1000), None);
        m.remove(0x50000);
        assert_eq!(m.overlap(0x50000, 0x1000), None);
        assert_eq!(
            m.overlap(0x20000, 0x40000).map(|o| o.1),
            Some(MetaKind::L1Table)
        );
    }
}
