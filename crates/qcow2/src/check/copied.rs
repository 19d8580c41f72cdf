//! The COPIED flag of the active L1 and L2 entries must say exactly "refcount is 1" (QEMU's
//! `check_oflag_copied`); runs after the refcounts were repaired, so repairs here rely on
//! them.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::ondisk::{GetError, Refblocks};
use super::pass::{Fix, Pass};
use super::report::FindingKind;
use super::tables::{cluster_type, ClusterType};
use crate::engine::infra::overlap::MetaKind;
use crate::format::be;
use crate::format::{l1, l2};
use storage::{IoBuf, Storage};

/// QEMU writes one L1 entry as the 512-byte sector around it.
const L1_WRITE_SECTOR: u64 = 512;

impl<S: Storage> Pass<'_, S> {
    /// Checks (and with `fix`, repairs) the COPIED flags of the active tables. `known`: the
    /// computed refcounts, when the compare found every stored refcount it covers equal to
    /// them; the flags are then checked against those without reading a refcount block.
    pub async fn check_copied(&mut self, fix: Fix, known: Option<&Imrt>) -> Result<(), CheckError> {
        let repair = fix.errors
            || (fix.leaks
                && self.res.check_errors == 0
                && self.res.corruptions == 0
                && self.res.leaks == 0);
        let mut rb = Refblocks::default();
        for i in 0..self.meta.l1.len() {
            let l2_offset = l1::table_of(self.meta.l1[i]);
            if l2_offset == 0 {
                continue;
            }
            if !self.check_l1_copied(&mut rb, known, i, repair).await? {
                continue;
            }
            let mut table = self.read_l2_table(l2_offset).await?;
            let fixed = self
                .check_l2_copied(&mut rb, known, &mut table, repair)
                .await;
            if fixed > 0 {
                self.write_l2_table(l2_offset, &table, fixed).await?;
            }
            self.give_back(table);
        }
        Ok(())
    }

    /// Reports a COPIED flag that disagrees with the refcount: one corruption, and the line
    /// QEMU writes about it.
    fn copied_mismatch(&mut self, repair: bool, what: String) {
        self.res.corruptions += 1;
        let kind = if repair {
            FindingKind::Repair
        } else {
            FindingKind::Error
        };
        self.log(kind, format!("{} OFLAG_COPIED {what}", Self::verb(repair)));
    }

    /// Checks the COPIED flag of active L1 entry `i` against its L2 table's refcount, and
    /// with `repair` writes the corrected entry. Returns whether the L2 table is worth
    /// checking: not when its refcount cannot be read, as QEMU skips it then.
    async fn check_l1_copied(
        &mut self,
        rb: &mut Refblocks,
        known: Option<&Imrt>,
        i: usize,
        repair: bool,
    ) -> Result<bool, CheckError> {
        let l1_entry = self.meta.l1[i];
        let l2_offset = l1::table_of(l1_entry);
        // A refcount that cannot be read was reported already.
        let Ok(refcount) = self
            .copied_refcount(rb, known, l2_offset >> self.meta.cluster_bits)
            .await
        else {
            return Ok(false);
        };
        if (refcount == 1) == l1::is_copied(l1_entry) {
            return Ok(true);
        }
        self.copied_mismatch(
            repair,
            format!("L2 cluster: l1_index={i} l1_entry={l1_entry:x} refcount={refcount}"),
        );
        if repair {
            self.meta.l1[i] = if refcount == 1 {
                l1::with_copied(l1_entry, true)
            } else {
                l1::with_copied(l1_entry, false)
            };
            if let Err(e) = self.write_l1_entry(i).await {
                self.res.check_errors += 1;
                return Err(e);
            }
            self.res.corruptions -= 1;
            self.res.corruptions_fixed += 1;
        }
        Ok(true)
    }

    /// Reads the active L2 table at `l2_offset`; a table that cannot be read ends the check.
    async fn read_l2_table(&mut self, l2_offset: u64) -> Result<IoBuf, CheckError> {
        // One cluster.
        let len = self.meta.l2_bytes() as usize;
        let buf = self.table_buffer(len);
        match io::read_into(self.file, "reading an L2 table", l2_offset, buf).await {
            Ok(t) => Ok(t),
            Err(e) => {
                self.log(
                    FindingKind::Error,
                    format!("ERROR: Could not read L2 table: {e}"),
                );
                self.res.check_errors += 1;
                Err(e)
            }
        }
    }

    /// The refcount of cluster `k` the COPIED flags are checked against: the computed one
    /// when `known` covers it (it equals the stored one then), else the stored one.
    async fn copied_refcount(
        &mut self,
        rb: &mut Refblocks,
        known: Option<&Imrt>,
        k: u64,
    ) -> Result<u64, GetError> {
        match known {
            Some(imrt) if k < imrt.len() => Ok(imrt.get(k)),
            _ => self.stored_refcount(rb, k).await,
        }
    }

    /// Checks the COPIED flags of the data clusters in an active L2 table against their
    /// refcounts; with `repair`, corrects them in `table`. Returns how many it corrected.
    async fn check_l2_copied(
        &mut self,
        rb: &mut Refblocks,
        known: Option<&Imrt>,
        table: &mut [u8],
        repair: bool,
    ) -> u64 {
        let entries = self.meta.l2_entries as usize;
        let mut fixed = 0u64;
        let mut j = 0;
        while j < entries {
            if let Some(imrt) = known {
                j = self.copied_agree_from(imrt, table, j);
            }
            if j < entries && self.check_entry_copied(rb, known, table, j, repair).await {
                fixed += 1;
            }
            j += 1;
        }
        fixed
    }

    /// The first entry at or after `from` of an active L2 table whose COPIED flag needs
    /// [`Pass::check_entry_copied`]: one that disagrees with its computed refcount in
    /// `imrt`, or whose cluster `imrt` does not cover (or the end of the table). A
    /// synchronous loop over the entries that agree, which are all of them in a sound image.
    fn copied_agree_from(&self, imrt: &Imrt, table: &[u8], from: usize) -> usize {
        let (extended, data_file) = (self.meta.extended, self.meta.data_file);
        let esize = self.meta.l2_entry_size as usize;
        let entries = self.meta.l2_entries as usize;
        let rest = table.get(from * esize..entries * esize).unwrap_or(&[]);
        // Only the first word of an entry matters here (the bitmap of an extended entry
        // plays no part in its type or its flag).
        for (n, bytes) in rest.chunks_exact(esize).enumerate() {
            let Some(&word) = bytes.first_chunk::<8>() else {
                return from + n;
            };
            let entry = u64::from_be_bytes(word);
            let kind = cluster_type(entry, extended, data_file);
            if !matches!(kind, ClusterType::Normal | ClusterType::ZeroAlloc) {
                continue;
            }
            let refcount = if data_file {
                1
            } else {
                let k = l2::host_of(entry) >> self.meta.cluster_bits;
                if k >= imrt.len() {
                    return from + n;
                }
                imrt.get(k)
            };
            if (refcount == 1) != l2::is_copied(entry) {
                return from + n;
            }
        }
        from + rest.len() / esize.max(1)
    }

    /// Checks the COPIED flag of entry `j` of an active L2 table against its cluster's
    /// refcount; with `repair`, corrects it in `table`. Returns whether it corrected it.
    async fn check_entry_copied(
        &mut self,
        rb: &mut Refblocks,
        known: Option<&Imrt>,
        table: &mut [u8],
        j: usize,
        repair: bool,
    ) -> bool {
        let (extended, data_file) = (self.meta.extended, self.meta.data_file);
        let Some((entry, bitmap)) = l2::entry_at(table, j, extended) else {
            return false;
        };
        let kind = cluster_type(entry, extended, data_file);
        if !matches!(kind, ClusterType::Normal | ClusterType::ZeroAlloc) {
            return false;
        }
        // Clusters in an external data file have no refcount: QEMU takes them as used once.
        let refcount = if data_file {
            1
        } else {
            let cluster = l2::host_of(entry) >> self.meta.cluster_bits;
            match self.copied_refcount(rb, known, cluster).await {
                Ok(r) => r,
                Err(_) => return false,
            }
        };
        if (refcount == 1) == l2::is_copied(entry) {
            return false;
        }
        self.copied_mismatch(
            repair,
            format!("data cluster: l2_entry={entry:x} refcount={refcount}"),
        );
        if !repair {
            return false;
        }
        let entry = if refcount == 1 {
            l2::with_copied(entry, true)
        } else {
            l2::with_copied(entry, false)
        };
        l2::set_entry_at(table, j, extended, entry, bitmap);
        true
    }

    /// Writes an active L2 table whose `fixed` COPIED flags were corrected.
    async fn write_l2_table(
        &mut self,
        l2_offset: u64,
        table: &[u8],
        fixed: u64,
    ) -> Result<(), CheckError> {
        let cs = self.meta.cluster_size as usize;
        let bytes = table.get(..cs).unwrap_or(table);
        let written = self
            .guarded_write(
                "writing an L2 table",
                l2_offset,
                bytes,
                &[MetaKind::L2Table],
            )
            .await;
        if let Err(e) = written {
            let what = if matches!(e, CheckError::Overlap { .. }) {
                "ERROR: Could not write L2 table; metadata overlap check failed"
            } else {
                "ERROR: Could not write L2 table"
            };
            self.log(FindingKind::Error, format!("{what}: {e}"));
            self.res.check_errors += 1;
            return Err(e);
        }
        self.res.corruptions -= fixed;
        self.res.corruptions_fixed += fixed;
        Ok(())
    }

    /// Writes the sector of the active L1 table that holds entry `index`.
    async fn write_l1_entry(&mut self, index: usize) -> Result<(), CheckError> {
        let per_sector = (L1_WRITE_SECTOR / 8) as usize;
        let first = index / per_sector * per_sector;
        let last = (first + per_sector).min(self.meta.l1.len());
        let words = &self.meta.l1[first..last];
        let bytes = be::table_bytes(words, words.len() * 8);
        let offset = self.meta.l1_offset + first as u64 * 8;
        self.guarded_write(
            "updating the L1 table",
            offset,
            &bytes,
            &[MetaKind::L1Table],
        )
        .await?;
        io::flush(self.file).await
    }
}
