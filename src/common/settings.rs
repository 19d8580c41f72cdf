//! What this run was told about every image it opens, set once from the command line:
//! `--locking`, `--untrusted` with its `--allow-dir` directories and caps, and the file
//! opener they make. A leaf: everything that opens an image asks here.

use storage::{Aio, FileOpener, Locking};

/// The `--locking` mode of this run, set once from the command line.
static LOCKING: std::sync::OnceLock<Locking> = std::sync::OnceLock::new();

/// Records the `--locking` mode every file open of this process uses.
pub fn set_locking(locking: Locking) {
    let _ = LOCKING.set(locking);
}

/// The `--locking` mode of this run (`auto` unless the command line said otherwise).
pub fn locking() -> Locking {
    LOCKING.get().copied().unwrap_or_default()
}

/// `--untrusted`, `--allow-dir` and the caps, set once from the command line.
static UNTRUSTED: std::sync::OnceLock<(bool, qcow2::engine::Untrusted)> =
    std::sync::OnceLock::new();

/// Records `--untrusted`, the `--allow-dir` directories (made canonical; each must be a
/// directory) and the caps on what an untrusted image may declare.
pub fn set_untrusted(
    untrusted: bool,
    allow: &[std::path::PathBuf],
    caps: qcow2::declared::Caps,
) -> std::io::Result<()> {
    let allow = storage::AllowDirs::new(allow)?.leak();
    let _ = UNTRUSTED.set((untrusted, qcow2::engine::Untrusted { allow, caps }));
    Ok(())
}

/// How an image marked untrusted (`--untrusted`, or an export's `untrusted=on`) is opened:
/// the `--allow-dir` directories (none unless given) and the caps.
pub fn untrusted_settings() -> qcow2::engine::Untrusted {
    static NONE: storage::AllowDirs = storage::AllowDirs::none();
    UNTRUSTED.get().map_or(
        qcow2::engine::Untrusted {
            allow: &NONE,
            caps: qcow2::declared::Caps::default(),
        },
        |u| u.1,
    )
}

/// The confinement every image opened by this run gets: `Some` under `--untrusted`.
pub fn untrusted() -> Option<qcow2::engine::Untrusted> {
    UNTRUSTED
        .get()
        .is_some_and(|u| u.0)
        .then(untrusted_settings)
}

/// The file opener every subcommand uses: io_uring (falling back to threads), page cache on,
/// image locks as `--locking` says.
pub fn opener() -> FileOpener {
    FileOpener {
        aio: Aio::IoUring,
        direct: false,
        locking: locking(),
    }
}
