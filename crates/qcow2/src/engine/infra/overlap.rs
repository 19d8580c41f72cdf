//! Where an image file's metadata lives, so that no write meant for something else lands on
//! it: QEMU's "overlap check". One index answers both of our writers:
//!
//! - the allocator keeps an index of the writable layer's metadata up to date and asks it
//!   before every guest data write: a corrupt L2 entry that points at an L1 table, a refcount
//!   block or the header must never turn a guest write into metadata corruption, so a hit
//!   marks the image corrupt instead;
//! - the checker builds one from the image it checks and asks it before each of its own
//!   repair writes, the way QEMU does it ([`MetaIndex::qemu_check`]), because a repair
//!   computed from a corrupt image must never land on live metadata either.
//!
//! On a consistent image no two metadata ranges overlap, so they sit in one map ordered by
//! start and a query is one O(log n) lookup: this is what keeps the data write path cheap. A
//! corrupt image (which the checker must still look at) may have tables on top of each other;
//! a range that overlaps one already recorded goes into a further layer, each layer disjoint
//! in itself, and a query looks into every layer.

use crate::format::HostOffset;
use std::collections::BTreeMap;

/// A kind of metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MetaKind {
    Header,
    /// The active L1 table.
    L1Table,
    /// An L2 table of the active L1 table.
    L2Table,
    RefcountTable,
    RefcountBlock,
    SnapshotTable,
    /// A snapshot's (inactive) L1 table.
    SnapshotL1Table,
    BitmapDirectory,
    BitmapTable,
    EncryptionHeader,
}

impl MetaKind {
    /// A human name, for our own messages.
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

    /// QEMU's name for the section, as its corruption message says it. QEMU's check has no
    /// section for bitmap tables or the encryption header; their names follow its style but
    /// appear in none of its messages.
    pub fn qemu_name(self) -> &'static str {
        match self {
            MetaKind::Header => "qcow2_header",
            MetaKind::L1Table => "active L1 table",
            MetaKind::L2Table => "active L2 table",
            MetaKind::RefcountTable => "refcount table",
            MetaKind::RefcountBlock => "refcount block",
            MetaKind::SnapshotTable => "snapshot table",
            MetaKind::SnapshotL1Table => "inactive L1 table",
            MetaKind::BitmapDirectory => "bitmap directory",
            MetaKind::BitmapTable => "bitmap table",
            MetaKind::EncryptionHeader => "encryption header",
        }
    }

    /// Where QEMU's check (`qcow2_check_metadata_overlap`) tests this section: it reports the
    /// first section a write hits, so when sections overlap each other on a corrupt image,
    /// this order decides which one its message names. Kinds QEMU does not check come last.
    fn qemu_rank(self) -> u8 {
        match self {
            MetaKind::Header => 0,
            MetaKind::L1Table => 1,
            MetaKind::RefcountTable => 2,
            MetaKind::SnapshotTable => 3,
            MetaKind::SnapshotL1Table => 4,
            MetaKind::L2Table => 5,
            MetaKind::RefcountBlock => 6,
            MetaKind::BitmapDirectory => 7,
            MetaKind::BitmapTable => 8,
            MetaKind::EncryptionHeader => 9,
        }
    }
}

/// One recorded metadata range that a write overlaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hit {
    /// Where the range starts.
    pub start: HostOffset,
    pub kind: MetaKind,
}

/// The metadata byte ranges of one file.
#[derive(Default, Debug, PartialEq, Eq)]
pub(crate) struct MetaIndex {
    /// Each layer maps a range's start to its end and kind, and no two ranges of one layer
    /// overlap. Everything is in the first layer unless the image is corrupt.
    layers: Vec<BTreeMap<u64, (u64, MetaKind)>>,
}

/// The ranges of `layer` that `[start, end)` overlaps, the one that starts last first.
fn layer_overlaps(
    layer: &BTreeMap<u64, (u64, MetaKind)>,
    start: u64,
    end: u64,
) -> impl Iterator<Item = (u64, u64, MetaKind)> + '_ {
    // Ranges of one layer never overlap, so their ends ascend with their starts: walking back
    // from the last range starting before `end`, the first one that ends by `start` ends the
    // overlaps.
    layer
        .range(..end)
        .rev()
        .take_while(move |(_, &(e, _))| e > start)
        .map(|(&s, &(e, kind))| (s, e, kind))
}

impl MetaIndex {
    /// Records `[start, start + len)` as metadata of `kind`.
    pub fn insert(&mut self, start: HostOffset, len: u64, kind: MetaKind) {
        if len == 0 {
            return;
        }
        let end = start.0.saturating_add(len);
        for layer in &mut self.layers {
            let clash = layer_overlaps(layer, start.0, end).next();
            match clash {
                None => {
                    layer.insert(start.0, (end, kind));
                    return;
                }
                // The same range twice (say, two L1 entries naming one L2 table) adds nothing.
                Some(same) if same == (start.0, end, kind) => return,
                Some(_) => {}
            }
        }
        self.layers.push(BTreeMap::from([(start.0, (end, kind))]));
    }

    /// Forgets the metadata that starts at `start` (its clusters were freed).
    pub fn remove(&mut self, start: HostOffset) {
        for layer in &mut self.layers {
            layer.remove(&start.0);
        }
        self.layers.retain(|layer| !layer.is_empty());
    }

    /// Every recorded range that `[start, start + len)` overlaps: layer by layer, and in each
    /// layer the one that starts last first.
    pub fn overlapping(&self, start: HostOffset, len: u64) -> impl Iterator<Item = Hit> + '_ {
        let end = start.0.saturating_add(len);
        self.layers.iter().flat_map(move |layer| {
            layer_overlaps(layer, start.0, end).map(|(s, _, kind)| Hit {
                start: HostOffset(s),
                kind,
            })
        })
    }

    /// QEMU's overlap check of a write of `len` bytes at `offset`: the write is widened to
    /// whole clusters of `cluster_size` bytes, the kinds in `ignore` (what the write is meant
    /// to change) are not looked at, and of the sections it hits, the one QEMU tests first is
    /// the answer.
    pub fn qemu_check(
        &self,
        offset: HostOffset,
        len: u64,
        cluster_size: u64,
        ignore: &[MetaKind],
    ) -> Option<MetaKind> {
        if len == 0 {
            return None;
        }
        let in_cluster = offset.0 & (cluster_size - 1);
        let widened = in_cluster
            .saturating_add(len)
            .div_ceil(cluster_size)
            .saturating_mul(cluster_size);
        self.overlapping(HostOffset(offset.0 - in_cluster), widened)
            .map(|hit| hit.kind)
            .filter(|kind| !ignore.contains(kind))
            .min_by_key(|kind| kind.qemu_rank())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CS: u64 = 0x10000;

    fn first(m: &MetaIndex, start: u64, len: u64) -> Option<MetaKind> {
        m.overlapping(HostOffset(start), len).next().map(|h| h.kind)
    }

    fn index(ranges: &[(u64, u64, MetaKind)]) -> MetaIndex {
        let mut m = MetaIndex::default();
        for &(start, len, kind) in ranges {
            m.insert(HostOffset(start), len, kind);
        }
        m
    }

    #[test]
    fn finds_overlaps_at_every_edge() {
        let mut m = index(&[
            (0, CS, MetaKind::Header),
            (0x30000, CS, MetaKind::L1Table),
            (0x50000, CS, MetaKind::L2Table),
        ]);
        assert_eq!(first(&m, 0xffff, 1), Some(MetaKind::Header));
        assert_eq!(first(&m, 0x10000, 0x20000), None);
        assert_eq!(first(&m, 0x10000, 0x20001), Some(MetaKind::L1Table));
        assert_eq!(first(&m, 0x3ffff, 0x20000), Some(MetaKind::L2Table));
        assert_eq!(first(&m, 0x60000, 0x1000), None);
        m.remove(HostOffset(0x50000));
        assert_eq!(first(&m, 0x50000, 0x1000), None);
        assert_eq!(first(&m, 0x20000, 0x40000), Some(MetaKind::L1Table));
    }

    #[test]
    fn reports_where_the_range_starts() {
        let m = index(&[(0x30000, 2 * CS, MetaKind::L1Table)]);
        let hits: Vec<_> = m.overlapping(HostOffset(0x48000), 0x1000).collect();
        assert_eq!(
            hits,
            [Hit {
                start: HostOffset(0x30000),
                kind: MetaKind::L1Table
            }]
        );
    }

    #[test]
    fn a_write_over_several_ranges_finds_them_all() {
        let m = index(&[
            (0x20000, CS, MetaKind::L2Table),
            (0x30000, CS, MetaKind::RefcountBlock),
            (0x40000, CS, MetaKind::L2Table),
        ]);
        let kinds: Vec<_> = m
            .overlapping(HostOffset(0x28000), 0x20000)
            .map(|h| h.kind)
            .collect();
        assert_eq!(
            kinds,
            [
                MetaKind::L2Table,
                MetaKind::RefcountBlock,
                MetaKind::L2Table
            ]
        );
    }

    #[test]
    fn overlapping_ranges_of_a_corrupt_image_are_all_kept() {
        // An L2 table inside a two-cluster L1 table, and the refcount table over both.
        let mut m = index(&[
            (0x30000, 2 * CS, MetaKind::L1Table),
            (0x40000, CS, MetaKind::L2Table),
            (0x40000, CS, MetaKind::L2Table),
            (0x38000, CS, MetaKind::RefcountTable),
        ]);
        let mut kinds: Vec<_> = m
            .overlapping(HostOffset(0x40000), 1)
            .map(|h| h.kind)
            .collect();
        kinds.sort_by_key(|k| k.qemu_rank());
        assert_eq!(
            kinds,
            [
                MetaKind::L1Table,
                MetaKind::RefcountTable,
                MetaKind::L2Table
            ]
        );
        // Freeing the L2 table's cluster forgets it, and only it.
        m.remove(HostOffset(0x40000));
        assert_eq!(m.overlapping(HostOffset(0x40000), 1).count(), 2);
        m.remove(HostOffset(0x38000));
        m.remove(HostOffset(0x30000));
        assert_eq!(m, MetaIndex::default());
    }

    #[test]
    fn qemu_check_reports_sections_in_qemu_order() {
        // A corrupt image: an L2 table where the refcount table is, and a refcount block
        // there too.
        let m = index(&[
            (0, CS, MetaKind::Header),
            (0x30000, CS, MetaKind::L2Table),
            (0x30000, CS, MetaKind::RefcountBlock),
            (0x30000, CS, MetaKind::RefcountTable),
        ]);
        let check = |ignore: &[MetaKind]| m.qemu_check(HostOffset(0x30000), 8, CS, ignore);
        assert_eq!(check(&[]), Some(MetaKind::RefcountTable));
        assert_eq!(check(&[MetaKind::RefcountTable]), Some(MetaKind::L2Table));
        assert_eq!(
            check(&[MetaKind::RefcountTable, MetaKind::L2Table]),
            Some(MetaKind::RefcountBlock)
        );
        assert_eq!(
            check(&[
                MetaKind::RefcountTable,
                MetaKind::L2Table,
                MetaKind::RefcountBlock
            ]),
            None
        );
        // The header comes before everything.
        assert_eq!(
            m.qemu_check(HostOffset(0xfff8), 0x20010, CS, &[]),
            Some(MetaKind::Header)
        );
    }

    #[test]
    fn qemu_check_widens_the_write_to_whole_clusters() {
        // A refcount table of 8 bytes in the middle of its cluster.
        let m = index(&[(0x30100, 8, MetaKind::RefcountTable)]);
        assert_eq!(
            m.qemu_check(HostOffset(0x30ff0), 8, CS, &[]),
            Some(MetaKind::RefcountTable)
        );
        assert_eq!(
            m.qemu_check(HostOffset(0x2fff8), 16, CS, &[]),
            Some(MetaKind::RefcountTable)
        );
        assert_eq!(m.qemu_check(HostOffset(0x2fff8), 8, CS, &[]), None);
        assert_eq!(m.qemu_check(HostOffset(0x20000), CS, CS, &[]), None);
        assert_eq!(m.qemu_check(HostOffset(0x30100), 0, CS, &[]), None);
        // Without widening, the same writes miss it.
        assert_eq!(first(&m, 0x30ff0, 8), None);
    }
}
