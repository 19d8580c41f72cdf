//! The sections QEMU's overlap check guards by default (its "cached" set) in the image being
//! checked: what the checker's repair writes must not land on (see [`crate::engine::overlap`]).

use super::meta::Meta;
use crate::engine::infra::overlap::{MetaIndex, MetaKind};
use crate::format::{l1, refcount, HostOffset};

impl Meta {
    /// Indexes the header cluster, the active L1 table and its L2 tables, the refcount table
    /// and its blocks, the snapshot table, the snapshots' L1 tables and the bitmap directory,
    /// as they are now. Tables are their exact bytes, as QEMU keeps them: its check widens the
    /// write to whole clusters instead. On a corrupt image these may overlap each other.
    pub fn qemu_sections(&self) -> MetaIndex {
        let mut index = MetaIndex::default();
        let mut add = |offset: u64, len: u64, kind| index.insert(HostOffset(offset), len, kind);
        let cs = self.cluster_size;
        add(0, cs, MetaKind::Header);
        add(self.l1_offset, self.l1.len() as u64 * 8, MetaKind::L1Table);
        add(
            self.reftable_offset,
            self.reftable.len() as u64 * 8,
            MetaKind::RefcountTable,
        );
        add(
            self.snapshots_offset,
            self.snapshots_size,
            MetaKind::SnapshotTable,
        );
        for s in &self.snapshots {
            add(
                s.l1_offset,
                u64::from(s.l1_size) * 8,
                MetaKind::SnapshotL1Table,
            );
        }
        for &entry in &self.l1 {
            let offset = l1::table_of(entry);
            if offset != 0 {
                add(offset, cs, MetaKind::L2Table);
            }
        }
        for &entry in &self.reftable {
            let offset = refcount::block_of(entry);
            if offset != 0 {
                add(offset, cs, MetaKind::RefcountBlock);
            }
        }
        if let Some(b) = &self.bitmaps {
            add(
                b.directory_offset,
                b.directory_size,
                MetaKind::BitmapDirectory,
            );
        }
        index
    }
}

#[cfg(test)]
mod tests {
    use super::super::error::CheckError;
    use super::super::meta;
    use super::super::pass::{Fix, Pass};
    use super::super::report::Finding;
    use crate::engine::infra::overlap::MetaKind;
    use crate::engine::{create, CreateOptions};
    use storage::MemStorage;

    /// A repair write over the sections at `far` of a fresh image whose metadata was moved
    /// there in memory by `corrupt`: what the write was refused for, and the messages.
    fn refused_write(
        corrupt: impl FnOnce(&mut meta::Meta, u64),
        len: u64,
        ignore: &[MetaKind],
    ) -> (Option<&'static str>, Vec<String>, bool) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let file = MemStorage::new();
            let opts = CreateOptions {
                size: 1 << 30,
                ..CreateOptions::default()
            };
            create(&file, &opts).await.unwrap();
            let before = file.to_vec();
            let mut meta = meta::load(&file, file.size()).await.unwrap();
            // Past everything a fresh image has.
            let far = 100 * meta.cluster_size;
            corrupt(&mut meta, far);
            let mut findings = Vec::new();
            let mut log = |f: Finding| findings.push(f.message);
            let mut pass = Pass::new(&file, meta, file.size(), Fix::NONE, &mut log);
            let bytes = vec![0xa5; len as usize];
            let what = match pass.guarded_write("testing", far, &bytes, ignore).await {
                Err(CheckError::Overlap { what, .. }) => Some(what),
                Err(e) => panic!("{e}"),
                Ok(()) => None,
            };
            (what, findings, file.to_vec() == before)
        })
    }

    /// A snapshot table at `far`, and right after it an L2 table that is a refcount block too.
    fn tables_on_top_of_each_other(m: &mut meta::Meta, far: u64) {
        let cs = m.cluster_size;
        m.snapshots_offset = far;
        m.snapshots_size = 100;
        m.l1[0] = far + cs;
        m.reftable[1] = far + cs;
    }

    #[test]
    fn reports_the_section_qemu_tests_first() {
        let cs = 1 << 16;
        let (what, findings, untouched) = refused_write(tables_on_top_of_each_other, 2 * cs, &[]);
        // The write starts in the snapshot table and ends in the L2 table: QEMU names the
        // snapshot table, which it tests first.
        assert_eq!(what, Some("snapshot table"));
        assert_eq!(
            findings,
            ["qcow2: Image is corrupt: Preventing invalid write on metadata (overlaps with snapshot table)"]
        );
        assert!(untouched, "a refused write must not reach the file");

        // The L2 table and the refcount block are the same cluster: QEMU tests active L2
        // tables before refcount blocks.
        let (what, ..) = refused_write(
            tables_on_top_of_each_other,
            2 * cs,
            &[MetaKind::SnapshotTable],
        );
        assert_eq!(what, Some("active L2 table"));
        let (what, ..) = refused_write(
            tables_on_top_of_each_other,
            2 * cs,
            &[MetaKind::SnapshotTable, MetaKind::L2Table],
        );
        assert_eq!(what, Some("refcount block"));
    }

    #[test]
    fn a_write_beside_the_metadata_goes_through() {
        let (what, findings, untouched) = refused_write(|_, _| {}, 4096, &[]);
        assert_eq!((what, findings.len(), untouched), (None, 0, false));
    }
}
