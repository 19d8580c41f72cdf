//! Opening a dirty image for writing: with lazy refcounts, a crash can leave refcounts behind
//! the L2 tables, so they are rebuilt (a full `-r all` check) before the first write, as QEMU
//! does on open.

use super::error::CheckError;
use super::io;
use super::report::{CheckReport, FindingKind};
use super::run::{check_pass, Repair};
use crate::engine::infra::error::EngineError;
use crate::engine::infra::layer::{Layer, Qcow2Meta};
use crate::format::Structure;
use crate::metadata::{Loader, StorageSource, Strictness, L1_TABLE};
use storage::Storage;

/// Where the findings of an automatic repair go besides the log, set once per process:
/// QEMU's tools print them on stderr, as `check -r all` does, whichever tool opened the
/// image, and a program standing in for them must too.
static REPAIR_REPORTER: std::sync::OnceLock<fn(&super::report::Finding)> =
    std::sync::OnceLock::new();

/// Makes every later repair of a dirty image hand each finding to `report` (the first
/// call wins).
pub fn report_repairs_to(report: fn(&super::report::Finding)) {
    let _ = REPAIR_REPORTER.set(report);
}

/// Repairs the refcounts of the dirty image in `file` and clears its dirty bit. The external
/// data file, if any, is flushed first, so a clean header never reaches the disk before the
/// guest data it describes. Fails when the check had internal errors or left corruptions,
/// because writing to such an image could make things worse.
pub async fn repair_dirty<S: Storage>(
    file: &S,
    data_file: Option<&S>,
) -> Result<CheckReport, CheckError> {
    if let Some(d) = data_file {
        io::flush(d).await?;
    }
    let reporter = REPAIR_REPORTER.get().copied();
    let mut log = |f: super::report::Finding| {
        if let Some(report) = reporter {
            report(&f);
        }
        match f.kind {
            FindingKind::Error | FindingKind::Reported => {
                tracing::warn!("repairing a dirty image: {}", f.message)
            }
            _ => tracing::debug!("repairing a dirty image: {}", f.message),
        }
    };
    let report = check_pass(file, Repair::All.fix(), &mut log).await?;
    if report.check_errors > 0 || report.corruptions > 0 {
        return Err(CheckError::Unrepaired {
            check_errors: report.check_errors,
            corruptions: report.corruptions,
        });
    }
    tracing::info!(
        leaks_fixed = report.leaks_fixed,
        corruptions_fixed = report.corruptions_fixed,
        "repaired the refcounts of a dirty image"
    );
    Ok(report)
}

/// Repairs a dirty writable layer and reloads what the repair may have changed: the header
/// (dirty bit, refcount table) and the active L1 table (COPIED flags).
pub(crate) async fn repair_dirty_layer<S: Storage + 'static>(
    layer: &Layer<S>,
) -> Result<(), EngineError> {
    let Some(meta) = layer.qcow2() else {
        return Ok(());
    };
    let name = &layer.name;
    repair_dirty(&layer.file, meta.data_file.as_ref())
        .await
        .map_err(|e| match e {
            CheckError::Io {
                what,
                offset,
                source,
            } => EngineError::Io {
                image: name.clone(),
                what,
                offset,
                source,
            },
            other => EngineError::Corrupt {
                image: name.clone(),
                detail: format!("could not repair the dirty image: {other}"),
            },
        })?;
    let file_len = layer
        .file
        .len()
        .await
        .map_err(|e| layer.io_error("getting the file size", 0, e))?;
    let src = StorageSource::new(&layer.file, file_len);
    let loader = Loader::new(&src, Strictness::Open);
    let loaded = |e| EngineError::from_metadata(name, e);
    let header = loader.header().await.map_err(loaded)?;
    if header.is_dirty() {
        return Err(layer.corrupt("the dirty bit is still set after repairing the image".into()));
    }
    let (offset, len) = (header.l1_table_offset, u64::from(header.l1_size) * 8);
    let words = loader
        .table(Structure::L1Table, L1_TABLE, offset, len)
        .await
        .map_err(loaded)?;
    let l1 = Qcow2Meta::<S>::validate_l1(words, &meta.geom, offset, file_len, name)?;
    *meta.header.borrow_mut() = header;
    *meta.l1.borrow_mut() = l1;
    meta.file_end.set(meta.file_end.get().max(file_len));
    Ok(())
}
