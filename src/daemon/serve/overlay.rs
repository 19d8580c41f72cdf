//! `-s/--snapshot`: a throw-away qcow2 overlay whose backing file is the image, so clients
//! may write while the image itself stays untouched. Like QEMU's temporary snapshot it lives
//! in `$TMPDIR` (default `/var/tmp`, where large files belong) and is deleted on exit.

use std::path::{Path, PathBuf};

use qcow2::engine::{create_file, CreateOptions, EngineError, Format, Image, OpenOptions};
use storage::{AnyStorage, FileOpener};

/// Why the overlay could not be made.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// The temporary directory could not be created.
    #[error("cannot create a temporary directory for the -s overlay in {dir}: {source}")]
    TempDir {
        /// Where we tried.
        dir: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The image path cannot be made absolute (the overlay must name it from elsewhere).
    #[error("cannot resolve {path}: {source}")]
    Resolve {
        /// The image path given.
        path: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The image path is not UTF-8, so it cannot be stored as a backing file name.
    #[error("{0}: the path is not UTF-8, so it cannot be an overlay's backing file name")]
    NotUtf8(String),
    /// Opening the image or creating the overlay failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// File name of the overlay inside its temporary directory.
const OVERLAY_NAME: &str = "overlay.qcow2";

/// A created overlay: the directory holding it is removed when this is dropped.
#[derive(Debug)]
pub struct Overlay {
    dir: tempfile::TempDir,
}

impl Overlay {
    /// Path of the overlay file.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join(OVERLAY_NAME)
    }
}

/// The directory temporary snapshots go to: `$TMPDIR`, else `/var/tmp` (QEMU's choice).
fn temp_root() -> PathBuf {
    std::env::var_os("TMPDIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from)
}

/// Creates an overlay over `image` (opened as `format`, qcow2 when `None`) with the same
/// virtual size.
pub async fn create(
    opener: &FileOpener,
    image: &Path,
    format: Option<Format>,
    base_opts: &OpenOptions,
) -> Result<Overlay, OverlayError> {
    // Walked off this thread within the open bound, as every path the server is given.
    let owned = image.to_path_buf();
    let absolute = storage::bounded::run("resolving", image, base_opts.open_bound, move || {
        std::fs::canonicalize(owned)
    })
    .await
    .map_err(|source| OverlayError::Resolve {
        path: image.display().to_string(),
        source,
    })?;
    let name = absolute
        .to_str()
        .ok_or_else(|| OverlayError::NotUtf8(absolute.display().to_string()))?
        .to_owned();
    // Opening validates the image (and its chain) before anything is created.
    let base_opts = OpenOptions {
        read_only: true,
        format,
        ..base_opts.clone()
    };
    let base: Image<AnyStorage> = Image::open(opener, &absolute, &base_opts).await?;
    let size = base.size();
    drop(base);
    let root = temp_root();
    let dir = tempfile::Builder::new()
        .prefix("qcow2-nbd-snapshot.")
        .tempdir_in(&root)
        .map_err(|source| OverlayError::TempDir {
            dir: root.display().to_string(),
            source,
        })?;
    let path = dir.path().join(OVERLAY_NAME);
    let opts = CreateOptions {
        size,
        backing: Some((name, format.unwrap_or(Format::Qcow2))),
        ..CreateOptions::default()
    };
    create_file(opener, &path, &opts).await?;
    Ok(Overlay { dir })
}
