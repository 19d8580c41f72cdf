//! Checking a file by path from synchronous code (the `qcow2-nbd check` command): a private
//! single-threaded runtime runs the async checker over io_uring (the thread-pool backend
//! where io_uring is unavailable): on tmpfs and in the page cache the reads are then plain
//! `pread`s on this thread, without a hand-off to a pool thread for each table.

use super::error::CheckError;
use super::report::Finding;
use super::run::{check, CheckOutcome, Repair};
use std::path::Path;
use storage::{Aio, FileOpener, Locking, OpenOptions, Opener};

/// Checks the image at `path` like `qemu-img check [-r ...] [-U] PATH`; the file is opened
/// read-only unless `repair` allows writes, and locked as `locking` says (`force_share`:
/// check it even while another process writes it, as `-U` does).
pub fn check_path(
    path: &Path,
    repair: Repair,
    locking: Locking,
    force_share: bool,
    log: &mut dyn FnMut(Finding),
) -> Result<CheckOutcome, CheckError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CheckError::io("starting the I/O runtime", 0, e))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let opener = FileOpener {
            aio: Aio::IoUring,
            direct: false,
            locking,
        };
        let read_only = repair == Repair::None;
        let opts = OpenOptions {
            read_only,
            force_share,
            ..OpenOptions::default()
        };
        let file = opener
            .open(path, opts)
            .await
            .map_err(|e| CheckError::io("opening the image", 0, e))?;
        check(&file, repair, log).await
    })
}
