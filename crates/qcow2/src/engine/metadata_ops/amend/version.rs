//! Changing the compatibility level. The header is rewritten in one write of as few
//! sectors as it takes (one for a version 2 header, and for a version 3 one, which then
//! leaves out the optional feature name table when it would need a second sector), after
//! everything it describes is durable.

use super::entry::AmendError;
use super::progress::Steps;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::load::snapshot_table;
use crate::engine::metadata_ops::create::feature_table;
use crate::format::extensions::HeaderExtension;
use crate::format::features::{AUTOCLEAR_DATA_FILE_RAW, INCOMPAT_COMPRESSION};
use crate::format::{limits, Header, SnapshotTableEntry};
use storage::Storage;

/// What one sector holds: a header that fits is written atomically.
const SECTOR: usize = 512;

/// Bytes 8..16 of a snapshot's extra data: its disk size.
const EXTRA_DISK_SIZE_END: usize = 16;
/// Bytes 16..24: the instruction count; version 3 entries have at least this much.
const EXTRA_V3_END: usize = 24;

impl<S: Storage + 'static> Image<S> {
    fn amend_error(&self, source: AmendError) -> EngineError {
        EngineError::Amend {
            image: self.inner.name(),
            source,
        }
    }

    /// The snapshot table of the writable layer.
    pub(super) async fn snapshot_list(&self) -> Result<Vec<SnapshotTableEntry>> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let h = meta.header.borrow().clone();
        if h.nb_snapshots == 0 {
            return Ok(Vec::new());
        }
        let table = snapshot_table(&top.file, &top.name, &h, meta.file_end.get()).await?;
        Ok(table.into_iter().map(|(s, _)| s).collect())
    }

    /// The snapshot table as version 3 wants it, if it differs: every entry's extra data
    /// holds at least the VM state size, the disk size and the instruction count. What an
    /// old entry lacks is filled in as QEMU reads such an entry: the 32-bit VM state size,
    /// the disk's current size, and an unknown count (all ones); anything an entry has
    /// beyond them is kept.
    pub(super) async fn upgraded_snapshots(
        &self,
    ) -> Result<Option<(Vec<SnapshotTableEntry>, Vec<SnapshotTableEntry>)>> {
        let old = self.snapshot_list().await?;
        if old.iter().all(|s| s.extra_data.len() >= EXTRA_V3_END) {
            return Ok(None);
        }
        let size = self.inner.top().size.get();
        let new = old
            .iter()
            .map(|s| {
                let mut e = s.clone();
                if e.extra_data.len() < 8 {
                    e.extra_data = u64::from(s.vm_state_size_32).to_be_bytes().to_vec();
                }
                if e.extra_data.len() < EXTRA_DISK_SIZE_END {
                    e.extra_data.truncate(8);
                    e.extra_data.extend_from_slice(&size.to_be_bytes());
                }
                if e.extra_data.len() < EXTRA_V3_END {
                    e.extra_data.truncate(EXTRA_DISK_SIZE_END);
                    e.extra_data.extend_from_slice(&u64::MAX.to_be_bytes());
                }
                e
            })
            .collect();
        Ok(Some((old, new)))
    }

    /// Everything QEMU refuses to downgrade, checked before the downgrade changes anything;
    /// `refcount_order` is the refcount width.
    pub(super) async fn check_downgrade(&self, refcount_order: u32) -> Result<()> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let refuse = |e| Err(self.amend_error(e));
        if refcount_order != 4 {
            return refuse(AmendError::DowngradeRefcountBits);
        }
        if meta.data_file.is_some() {
            return refuse(AmendError::DowngradeDataFile);
        }
        let size = top.size.get();
        for s in self.snapshot_list().await? {
            let word = |at: usize| {
                s.extra_data
                    .get(at..at + 8)
                    .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
            };
            let vm_state = word(0).unwrap_or(u64::from(s.vm_state_size_32));
            let disk = word(8).unwrap_or(size);
            if vm_state > u64::from(u32::MAX) || disk != size {
                return refuse(AmendError::DowngradeSnapshots);
            }
        }
        // The dirty bit goes with a clean close; compression is handled below.
        let other = meta.header.borrow().incompatible_features
            & !(INCOMPAT_COMPRESSION | crate::format::features::INCOMPAT_DIRTY);
        if other != 0 {
            return refuse(AmendError::DowngradeFeatures(other));
        }
        if self.inner.alloc()?.with_bitmaps(|b| !b.list.is_empty()) {
            return refuse(AmendError::DowngradeBitmaps);
        }
        let scan = self.scan_snapshot_tables().await?;
        let zstd = meta.header.borrow().compression_type != 0;
        if zstd && (scan.compressed || self.active_has_compressed().await?) {
            return refuse(AmendError::DowngradeZstd);
        }
        Ok(())
    }

    /// Writes a version 3 header (QEMU's upgrade: no feature bits yet). Snapshots of
    /// version 2 that lack what version 3 requires get it first, in a new table that
    /// version 2 reads as well, so a crash between the two writes leaves a valid image.
    pub(super) async fn upgrade(&self, steps: &Steps<'_>) -> Result<()> {
        steps.at(0, 2);
        if let Some((old, new)) = self.upgraded_snapshots().await? {
            self.inner.flush().await?;
            let w = self.inner.alloc()?;
            w.replace_snapshot_table(&old, &new).await?;
            self.inner.flush().await?;
            w.sync().await?;
        }
        let meta = self.inner.top().qcow2_required()?;
        let mut h = meta.header.borrow().clone();
        // The length a new version 3 header has (with the compression type and its
        // padding), as QEMU writes it on upgrade too.
        let fresh = Header::new(3, h.cluster_bits, h.size);
        h.version = 3;
        h.header_length = fresh.header_length;
        h.incompatible_features = 0;
        h.compatible_features = 0;
        h.autoclear_features = 0;
        h.compression_type = fresh.compression_type;
        h.unknown_header_tail = fresh.unknown_header_tail;
        h.extensions
            .push(HeaderExtension::FeatureNameTable(feature_table()));
        self.inner.flush().await?;
        steps.at(1, 2);
        self.write_header(h).await?;
        steps.at(2, 2);
        Ok(())
    }

    /// Turns zero clusters into data, clears the dirty bit, and writes a version 2 header.
    pub(super) async fn downgrade(&self, steps: &Steps<'_>) -> Result<()> {
        let meta = self.inner.top().qcow2_required()?;
        self.expand_zero_clusters(steps).await?;
        let w = self.inner.alloc()?;
        w.disable_lazy_refcounts();
        self.inner.flush().await?;
        w.mark_clean().await?;
        let mut h = meta.header.borrow().clone();
        h.version = 2;
        h.header_length = limits::V2_HEADER_LENGTH;
        h.incompatible_features = 0;
        h.compatible_features = 0;
        h.autoclear_features = 0;
        h.compression_type = 0;
        h.unknown_header_tail.clear();
        h.extensions.retain(|e| {
            !matches!(
                e,
                HeaderExtension::FeatureNameTable(_) | HeaderExtension::Bitmaps(_)
            )
        });
        self.write_header(h).await
    }

    /// Renames the external data file (`Some("")` drops the name) and sets whether it is
    /// a raw image, in one header write.
    pub(super) async fn set_data_file(&self, name: Option<&str>, raw: bool) -> Result<()> {
        let meta = self.inner.top().qcow2_required()?;
        let mut h = meta.header.borrow().clone();
        if let Some(name) = name {
            h.extensions
                .retain(|e| !matches!(e, HeaderExtension::ExternalDataFile(_)));
            if !name.is_empty() {
                h.extensions
                    .push(HeaderExtension::ExternalDataFile(name.as_bytes().to_vec()));
            }
        }
        if raw {
            h.autoclear_features |= AUTOCLEAR_DATA_FILE_RAW;
        } else {
            h.autoclear_features &= !AUTOCLEAR_DATA_FILE_RAW;
        }
        self.inner.flush().await?;
        self.write_header(h).await
    }

    /// Writes `h` over the first sectors of the file and makes it the header in memory.
    async fn write_header(&self, mut h: Header) -> Result<()> {
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        let w = self.inner.alloc()?;
        let cs = meta.geom.cluster_size();
        let fmt = |source| EngineError::Format {
            image: top.name.clone(),
            source,
        };
        let mut bytes = h.encode(cs).map_err(fmt)?;
        if used_sectors(&bytes) > 1 {
            // The feature name table is optional: one sector keeps the write atomic.
            h.extensions
                .retain(|e| !matches!(e, HeaderExtension::FeatureNameTable(_)));
            bytes = h.encode(cs).map_err(fmt)?;
        }
        let len = used_sectors(&bytes) * SECTOR;
        w.write_meta("rewriting the header", 0, &bytes[..len.min(bytes.len())])
            .await?;
        w.sync().await?;
        *meta.header.borrow_mut() = h;
        w.mapping_changed();
        Ok(())
    }
}

/// Sectors from the start of `bytes` up to its last non-zero byte (at least one).
fn used_sectors(bytes: &[u8]) -> usize {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(1, |i| i + 1);
    end.div_ceil(SECTOR)
}
