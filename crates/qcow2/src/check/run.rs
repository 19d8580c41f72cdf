//! The order of one check pass and of qemu-img's repair-then-recheck, as QEMU runs them:
//! snapshot table, refcounts (compare, repair or rebuild), COPIED flags, snapshot table
//! repair, and finally the header bits of an image found consistent.

use super::error::CheckError;
use super::imrt::Imrt;
use super::io;
use super::meta;
use super::pass::{Fix, Pass};
use super::report::{CheckReport, Finding, FindingKind};
use crate::format::features::{INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
use storage::Storage;

/// What a check may repair (`qemu-img check -r`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Repair {
    /// Report only; the image is not written.
    #[default]
    None,
    /// Drop leaked refcounts (`-r leaks`).
    Leaks,
    /// Also fix refcounts that are too low, COPIED flags and broken entries, rebuilding the
    /// refcount structure when needed (`-r all`).
    All,
}

impl Repair {
    pub(crate) fn fix(self) -> Fix {
        match self {
            Repair::None => Fix::NONE,
            Repair::Leaks => Fix::LEAKS,
            Repair::All => Fix {
                leaks: true,
                errors: true,
            },
        }
    }
}

impl std::str::FromStr for Repair {
    type Err = String;

    fn from_str(s: &str) -> Result<Repair, String> {
        match s {
            "leaks" => Ok(Repair::Leaks),
            "all" => Ok(Repair::All),
            other => Err(format!(
                "--repair (-r) expects 'leaks' or 'all', not '{other}'"
            )),
        }
    }
}

/// The outcome of `qemu-img check`: when the repair pass fixed anything, the image was
/// checked again and `report` is that second check, carrying the first one's fixed counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    /// The final report.
    pub report: CheckReport,
    /// A repair fixed something and the image was checked again.
    pub rechecked: bool,
}

/// Checks the qcow2 image in `file` like `qemu-img check [-r ...]`: one pass that repairs
/// what `repair` allows and, if it fixed anything, a second pass that only looks. Findings
/// go to `log` as they are made.
pub async fn check<S: Storage>(
    file: &S,
    repair: Repair,
    log: &mut dyn FnMut(Finding),
) -> Result<CheckOutcome, CheckError> {
    let first = check_pass(file, repair.fix(), log).await?;
    if first.corruptions_fixed == 0 && first.leaks_fixed == 0 {
        return Ok(CheckOutcome {
            report: first,
            rechecked: false,
        });
    }
    let mut report = check_pass(file, Fix::NONE, log).await?;
    report.corruptions_fixed = first.corruptions_fixed;
    report.leaks_fixed = first.leaks_fixed;
    Ok(CheckOutcome {
        report,
        rechecked: true,
    })
}

/// One check pass (QEMU's `qcow2_co_check_locked`).
pub(crate) async fn check_pass<S: Storage>(
    file: &S,
    fix: Fix,
    log: &mut dyn FnMut(Finding),
) -> Result<CheckReport, CheckError> {
    let file_len = file
        .len()
        .await
        .map_err(|e| CheckError::io("getting the file size", 0, e))?;
    let meta = meta::load(file, file_len).await?;
    let mut pass = Pass::new(file, meta, file_len, fix, log);
    pass.run().await?;
    Ok(pass.res)
}

impl<S: Storage> Pass<'_, S> {
    async fn run(&mut self) -> Result<(), CheckError> {
        if self.fix.any() {
            self.clear_unknown_autoclear().await?;
        }
        // The snapshot table's findings are counted apart and added at the end, without
        // touching the allocation statistics.
        let outer = std::mem::take(&mut self.res);
        let read = self.read_snapshots().await;
        let mut snapshot_res = std::mem::replace(&mut self.res, outer);
        read?;

        self.check_refcounts().await?;

        if snapshot_res.corruptions > 0 && self.fix.errors {
            if let Err(e) = self.rewrite_snapshot_table().await {
                self.log(
                    FindingKind::Error,
                    format!("ERROR failed to update snapshot table: {e}"),
                );
                return Err(e);
            }
            snapshot_res.corruptions_fixed += snapshot_res.corruptions;
            snapshot_res.corruptions = 0;
        }
        self.res.add(&snapshot_res, false);

        if self.fix.any() {
            if self.res.check_errors == 0 && self.res.corruptions == 0 {
                let bits = self.meta.incompatible & !(INCOMPAT_DIRTY | INCOMPAT_CORRUPT);
                self.write_incompatible(bits).await?;
            }
            io::flush(self.file).await?;
        }
        Ok(())
    }

    /// Counts every reference, compares with the stored refcounts and repairs them (QEMU's
    /// `qcow2_check_refcounts`), then checks the COPIED flags.
    async fn check_refcounts(&mut self) -> Result<(), CheckError> {
        let fix = self.fix;
        let clusters = self.meta.clusters(self.file_len);
        if clusters > i32::MAX as u64 {
            self.res.check_errors += 1;
            return Err(CheckError::TooLarge { clusters });
        }
        self.res.total_clusters = self.meta.clusters(self.meta.virtual_size);
        let mut imrt = Imrt::new(clusters)?;
        let mut rebuild = false;
        self.calculate(&mut imrt, &mut rebuild).await?;

        // Count first; when repairs are allowed and needed, compare again from the same
        // starting point with repairs on.
        let before = self.res.clone();
        let mut compared = self.compare(&imrt, Fix::NONE, &mut rebuild).await?;

        if rebuild && fix.errors {
            let old = self.res.clone();
            self.log(FindingKind::Info, "Rebuilding refcount structure".into());
            if let Err(e) = self.rebuild(&mut imrt).await {
                self.res.check_errors += 1;
                self.log(
                    FindingKind::Error,
                    format!("ERROR rebuilding the refcount structure: {e}"),
                );
                return Err(e);
            }
            self.res.corruptions = 0;
            self.res.leaks = 0;
            // The old structure is now unused: count everything again against the new one.
            rebuild = false;
            imrt.clear();
            let saved_fix = std::mem::replace(&mut self.fix, Fix::NONE);
            let counted = self.calculate(&mut imrt, &mut rebuild).await;
            self.fix = saved_fix;
            counted?;
            let mut fresh_leaks = 0;
            compared.agree = false;
            if fix.leaks {
                let saved = std::mem::take(&mut self.res);
                let result = self.compare(&imrt, Fix::LEAKS, &mut rebuild).await;
                let after = std::mem::replace(&mut self.res, saved);
                compared = result?;
                if rebuild {
                    self.log(
                        FindingKind::Error,
                        "ERROR rebuilt refcount structure is still broken".into(),
                    );
                }
                // Leaks left here were made by the rebuild and could not be freed.
                fresh_leaks = after.leaks;
            }
            if self.res.corruptions < old.corruptions {
                self.res.corruptions_fixed += old.corruptions - self.res.corruptions;
            }
            if self.res.leaks < old.leaks {
                self.res.leaks_fixed += old.leaks - self.res.leaks;
            }
            self.res.leaks += fresh_leaks;
        } else if fix.any() {
            if rebuild {
                self.log(
                    FindingKind::Error,
                    "ERROR need to rebuild refcount structures".into(),
                );
                self.res.check_errors += 1;
                return Err(CheckError::NeedsRebuild);
            }
            if self.res.leaks > 0 || self.res.corruptions > 0 {
                self.res = before;
                compared = self.compare(&imrt, fix, &mut rebuild).await?;
            }
        }

        // When the last compare found the stored refcounts equal to the computed ones, the
        // COPIED flags can be checked against the computed ones without reading a block.
        let known = compared.agree.then_some(&imrt);
        self.check_copied(fix, known).await?;
        self.res.image_end_offset = (compared.highest + 1) * self.meta.cluster_size;
        Ok(())
    }
}
