//! One check pass over an image (QEMU's `qcow2_co_check_locked`): the state it carries and the
//! helpers every step uses: logging findings, counting references into the in-memory refcount
//! table, and guarded writes for repairs.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::meta::Meta;
use super::report::{CheckReport, Finding, FindingKind};
use crate::engine::infra::overlap::{MetaIndex, MetaKind};
use crate::format::features::{AUTOCLEAR_KNOWN, INCOMPAT_CORRUPT};
use crate::format::{header, HostOffset};
use storage::{IoBuf, Storage};

/// What a pass may repair (QEMU's `BdrvCheckMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Fix {
    /// Drop refcounts nothing uses.
    pub leaks: bool,
    /// Fix refcounts that are too low, flags and entries, rebuilding refcounts if needed.
    pub errors: bool,
}

impl Fix {
    pub const NONE: Fix = Fix {
        leaks: false,
        errors: false,
    };
    pub const LEAKS: Fix = Fix {
        leaks: true,
        errors: false,
    };

    /// Any repair at all.
    pub fn any(self) -> bool {
        self.leaks || self.errors
    }
}

/// The state of one pass.
pub(crate) struct Pass<'a, S: Storage> {
    pub file: &'a S,
    pub meta: Meta,
    /// Current length of the file (repairs may grow it).
    pub file_len: u64,
    /// What this pass repairs; with none, nothing is written.
    pub fix: Fix,
    pub res: CheckReport,
    log: &'a mut dyn FnMut(Finding),
    /// A corruption was signalled once already (QEMU then stays quiet on writable images).
    signalled: bool,
    /// Housekeeping after a repair: findings are not reported.
    pub quiet: bool,
    /// QEMU's overlap sections of `meta`, built at the first guarded write and dropped by
    /// [`Pass::layout_changed`]: a repair may write one table after another, and the index is
    /// only worth building when all of them use it.
    sections: Option<MetaIndex>,
    /// A table buffer to read the next L2 table into: the walks read every table, and a fresh
    /// zeroed buffer each time costs more in page faults than the read itself.
    spare: Option<IoBuf>,
}

impl<'a, S: Storage> Pass<'a, S> {
    /// A pass over an image already loaded.
    pub fn new(
        file: &'a S,
        meta: Meta,
        file_len: u64,
        fix: Fix,
        log: &'a mut dyn FnMut(Finding),
    ) -> Self {
        Pass {
            file,
            meta,
            file_len,
            fix,
            res: CheckReport::default(),
            log,
            signalled: false,
            quiet: false,
            sections: None,
            spare: None,
        }
    }

    /// A buffer of `len` bytes to read into (its contents are overwritten by the read).
    pub fn table_buffer(&mut self, len: usize) -> IoBuf {
        match self.spare.take() {
            Some(buf) if buf.len() == len => buf,
            _ => IoBuf::zeroed(len),
        }
    }

    /// Keeps `buf` for the next [`Pass::table_buffer`].
    pub fn give_back(&mut self, buf: IoBuf) {
        self.spare = Some(buf);
    }

    /// Reports one finding.
    pub fn log(&mut self, kind: FindingKind, message: String) {
        if !self.quiet {
            (self.log)(Finding { kind, message });
        }
    }

    /// "Repairing" when `repairing`, else "ERROR": how QEMU starts a line about a problem.
    pub fn verb(repairing: bool) -> &'static str {
        if repairing {
            "Repairing"
        } else {
            "ERROR"
        }
    }

    /// Counts one reference to every cluster in `[offset, offset + size)` (QEMU's
    /// `qcow2_inc_refcounts_imrt`): a region reaching a cluster or more past the end of the
    /// file, or a refcount that would overflow the image's width, is a corruption instead.
    pub fn inc(&mut self, imrt: &mut Imrt, offset: u64, size: u64) -> Result<(), CheckError> {
        if size == 0 {
            return Ok(());
        }
        let cs = self.meta.cluster_size;
        let end = offset
            .checked_add(size)
            .filter(|&e| e <= crate::format::limits::MAX_FILE_OFFSET);
        let Some(end) = end.filter(|&e| e <= self.file_len || e - self.file_len < cs) else {
            self.log(
                FindingKind::Error,
                format!("ERROR: counting reference for region exceeding the end of the file by one cluster or more: offset {offset:#x} size {size:#x}"),
            );
            self.res.corruptions += 1;
            return Ok(());
        };
        let bits = self.meta.cluster_bits;
        let limit = Imrt::limit(self.meta.refcount_max);
        for k in (offset >> bits)..=((end - 1) >> bits) {
            if k >= imrt.len() {
                imrt.grow(k + 1)?;
            }
            if !imrt.increment(k, limit) {
                self.log(
                    FindingKind::Error,
                    format!("ERROR: overflow cluster offset={:#x}", k << bits),
                );
                self.log(
                    FindingKind::Error,
                    "Use qemu-img amend to increase the refcount entry width or qemu-img convert to create a clean copy if the image cannot be opened for writing".into(),
                );
                self.res.corruptions += 1;
            }
        }
        Ok(())
    }

    /// Writes repair data, refusing (and marking the image corrupt, as QEMU's overlap check
    /// does) when it would land on metadata other than the sections in `ignore`.
    pub async fn guarded_write(
        &mut self,
        what: &'static str,
        offset: u64,
        bytes: &[u8],
        ignore: &[MetaKind],
    ) -> Result<(), CheckError> {
        let len = bytes.len() as u64;
        let sections = self
            .sections
            .get_or_insert_with(|| self.meta.qemu_sections());
        debug_assert!(
            *sections == self.meta.qemu_sections(),
            "the metadata moved without Pass::layout_changed"
        );
        let hit = sections.qemu_check(HostOffset(offset), len, self.meta.cluster_size, ignore);
        if let Some(hit) = hit {
            let detail = format!(
                "Preventing invalid write on metadata (overlaps with {})",
                hit.qemu_name()
            );
            self.signal_corruption(detail).await;
            return Err(CheckError::Overlap {
                offset,
                len,
                what: hit.qemu_name(),
            });
        }
        io::write(self.file, what, offset, bytes).await?;
        self.file_len = self.file_len.max(offset.saturating_add(len));
        Ok(())
    }

    /// Says that `meta` now places the L1, refcount or snapshot tables elsewhere, so the next
    /// guarded write looks at where they are now.
    pub fn layout_changed(&mut self) {
        self.sections = None;
    }

    /// Reports an inconsistency found while accessing metadata (QEMU's
    /// `qcow2_signal_corruption`): a repair pass marks the image corrupt on disk.
    pub async fn signal_corruption(&mut self, detail: String) {
        if self.fix.any() {
            if self.signalled {
                return;
            }
            self.signalled = true;
            self.log(
                FindingKind::Error,
                format!("qcow2: Marking image as corrupt: {detail}; further corruption events will be suppressed"),
            );
            if self.meta.header.version >= 3 && !self.meta.is_corrupt() {
                let bits = self.meta.incompatible | INCOMPAT_CORRUPT;
                let done = io::write_header(
                    self.file,
                    "marking the image corrupt",
                    header::incompatible_update(bits),
                )
                .await
                .is_ok()
                    && io::flush(self.file).await.is_ok();
                if done {
                    self.meta.incompatible = bits;
                }
            }
        } else {
            self.log(
                FindingKind::Error,
                format!("qcow2: Image is corrupt: {detail}"),
            );
        }
    }

    /// Drops the autoclear bits we do not understand, as every read-write open does (a
    /// repairing check opens the image read-write, as qemu-img's does): whoever set such a
    /// bit must learn that the structure it vouches for may now be stale.
    pub async fn clear_unknown_autoclear(&mut self) -> Result<(), CheckError> {
        let bits = self.meta.header.autoclear_features;
        let known = bits & AUTOCLEAR_KNOWN;
        if self.meta.header.version < 3 || known == bits {
            return Ok(());
        }
        io::write_header(
            self.file,
            "updating the header",
            header::autoclear_update(known),
        )
        .await?;
        io::flush(self.file).await?;
        self.meta.header.autoclear_features = known;
        Ok(())
    }

    /// Rewrites the incompatible feature bits (version 3 headers only) and flushes.
    pub async fn write_incompatible(&mut self, bits: u64) -> Result<(), CheckError> {
        if self.meta.header.version < 3 || bits == self.meta.incompatible {
            return Ok(());
        }
        io::flush(self.file).await?;
        io::write_header(
            self.file,
            "updating the header",
            header::incompatible_update(bits),
        )
        .await?;
        io::flush(self.file).await?;
        self.meta.incompatible = bits;
        Ok(())
    }
}
