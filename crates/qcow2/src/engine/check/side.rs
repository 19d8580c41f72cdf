//! The COPIED-flag walk of a report-only check, run on a second core while the first counts
//! and compares the refcounts.
//!
//! Without repairs the walk reads only stored refcounts and L2 tables, which nothing else in
//! the pass changes, so it can run at the same time as the counting, over its own handle on
//! the file. Its findings are kept and reported where the walk would have run; they are used
//! only when the counting found no corruption and no check error, because then nothing that
//! pass did (a corruption already signalled, a refcount found unreadable) could have changed
//! what the walk says. Otherwise the walk simply runs again in order.

use std::path::{Path, PathBuf};

use super::error::CheckError;
use super::meta;
use super::pass::{Fix, Pass};
use super::report::Finding;
use storage::{Aio, FileOpener, Locking, OpenOptions, Opener, Storage};
use tokio::sync::oneshot;

/// What the walk on the other core found.
pub(crate) struct CopiedOutcome {
    /// COPIED flags that disagree with their refcount.
    pub corruptions: u64,
    /// The lines it would have logged, in order.
    pub findings: Vec<Finding>,
    /// Things it could not look at.
    check_errors: u64,
}

/// A COPIED walk running on its own thread.
pub(crate) struct CopiedWalk {
    done: oneshot::Receiver<Result<CopiedOutcome, CheckError>>,
}

impl CopiedWalk {
    /// Starts the walk over the image at `path`, or returns `None` when no thread can be
    /// started (the check then walks in order, as without it).
    pub fn spawn(path: &Path) -> Option<CopiedWalk> {
        let (tx, rx) = oneshot::channel();
        let path: PathBuf = path.to_owned();
        std::thread::Builder::new()
            .name("check-copied".into())
            .spawn(move || {
                // The receiver may be gone (the check ended early); nothing waits then.
                let _ = tx.send(walk_path(&path));
            })
            .ok()?;
        Some(CopiedWalk { done: rx })
    }

    /// The walk's outcome, or `None` when it failed: the in-order walk then meets the same
    /// failure and reports it as the check always has.
    pub async fn outcome(self) -> Option<CopiedOutcome> {
        let outcome = self.done.await.ok()?.ok()?;
        (outcome.check_errors == 0).then_some(outcome)
    }
}

fn walk_path(path: &Path) -> Result<CopiedOutcome, CheckError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CheckError::io("starting the I/O runtime", 0, e))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        // The checking thread holds this process's lock on the image already.
        let opener = FileOpener {
            aio: Aio::IoUring,
            direct: false,
            locking: Locking::Off,
        };
        let opts = OpenOptions {
            read_only: true,
            force_share: true,
            ..OpenOptions::default()
        };
        let file = opener
            .open(path, opts)
            .await
            .map_err(|e| CheckError::io("opening the image", 0, e))?;
        walk(&file).await
    })
}

/// The report-only COPIED walk of a pass over `file`, on its own.
async fn walk<S: Storage>(file: &S) -> Result<CopiedOutcome, CheckError> {
    let file_len = file
        .len()
        .await
        .map_err(|e| CheckError::io("getting the file size", 0, e))?;
    let meta = meta::load(file, file_len).await?;
    let mut findings = Vec::new();
    let mut log = |f: Finding| findings.push(f);
    let mut pass = Pass::new(file, meta, file_len, Fix::NONE, &mut log);
    pass.check_copied(Fix::NONE).await?;
    let (corruptions, check_errors) = (pass.res.corruptions, pass.res.check_errors);
    drop(pass);
    Ok(CopiedOutcome {
        corruptions,
        findings,
        check_errors,
    })
}
