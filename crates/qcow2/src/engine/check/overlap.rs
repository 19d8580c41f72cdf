//! QEMU's metadata overlap check (the default "cached" set) for the checker's own repair
//! writes: a repair computed from a corrupt image must never land on live metadata.

use super::meta::Meta;
use crate::format::l1::L1_OFFSET_MASK;
use crate::format::refcount::REFTABLE_OFFSET_MASK;

/// A kind of metadata a write may overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    MainHeader,
    ActiveL1,
    ActiveL2,
    RefcountTable,
    RefcountBlock,
    SnapshotTable,
    InactiveL1,
    BitmapDirectory,
}

impl Section {
    /// QEMU's name for the section, as its corruption message says it.
    pub fn name(self) -> &'static str {
        match self {
            Section::MainHeader => "qcow2_header",
            Section::ActiveL1 => "active L1 table",
            Section::ActiveL2 => "active L2 table",
            Section::RefcountTable => "refcount table",
            Section::RefcountBlock => "refcount block",
            Section::SnapshotTable => "snapshot table",
            Section::InactiveL1 => "inactive L1 table",
            Section::BitmapDirectory => "bitmap directory",
        }
    }
}

fn overlaps(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

impl Meta {
    /// The first metadata section (not in `ignore`) that `[offset, offset + len)` overlaps,
    /// after widening the range to whole clusters as QEMU does.
    pub fn overlap(&self, ignore: &[Section], offset: u64, len: u64) -> Option<Section> {
        if len == 0 {
            return None;
        }
        let m = self;
        let check = |s: Section| !ignore.contains(&s);
        if check(Section::MainHeader) && offset < m.cluster_size {
            return Some(Section::MainHeader);
        }
        let start = offset - m.in_cluster(offset);
        let len = (m.in_cluster(offset).saturating_add(len))
            .div_ceil(m.cluster_size)
            .saturating_mul(m.cluster_size);
        let hit = |b: u64, b_len: u64| overlaps(start, len, b, b_len);
        if check(Section::ActiveL1) && hit(m.l1_offset, m.l1.len() as u64 * 8) {
            return Some(Section::ActiveL1);
        }
        if check(Section::RefcountTable) && hit(m.reftable_offset, m.reftable.len() as u64 * 8) {
            return Some(Section::RefcountTable);
        }
        if check(Section::SnapshotTable) && hit(m.snapshots_offset, m.snapshots_size) {
            return Some(Section::SnapshotTable);
        }
        if check(Section::InactiveL1)
            && m.snapshots
                .iter()
                .any(|s| hit(s.l1_offset, u64::from(s.l1_size) * 8))
        {
            return Some(Section::InactiveL1);
        }
        if check(Section::ActiveL2)
            && m.l1.iter().any(|&e| {
                let off = e & L1_OFFSET_MASK;
                off != 0 && hit(off, m.cluster_size)
            })
        {
            return Some(Section::ActiveL2);
        }
        if check(Section::RefcountBlock)
            && m.reftable.iter().any(|&e| {
                let off = e & REFTABLE_OFFSET_MASK;
                off != 0 && hit(off, m.cluster_size)
            })
        {
            return Some(Section::RefcountBlock);
        }
        if check(Section::BitmapDirectory) {
            if let Some(b) = &m.bitmaps {
                if hit(b.directory_offset, b.directory_size) {
                    return Some(Section::BitmapDirectory);
                }
            }
        }
        None
    }
}
