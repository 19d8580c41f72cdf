//! `info --untrusted`: every file an image names, judged by the rules the engine opens an
//! untrusted image with (`backing_name::resolve_untrusted` and `admit`), so that `info`
//! refuses exactly what `serve --untrusted` refuses.

use std::path::{Path, PathBuf};

use qcow2::engine::backing_name::{self, BackingError, Reference};
use qcow2::inspect::{ImageInfo, ReferenceReport};
use storage::opener::described::{describe_name, Described};
use storage::AllowDirs;

/// One file an image names, with the verdict.
pub struct Judged {
    /// What the image names it as.
    pub kind: Reference,
    /// What `info --output=json` shows of it.
    pub report: ReferenceReport,
    /// Where it leads, when admitted; the refusal otherwise.
    pub verdict: Result<PathBuf, BackingError>,
}

/// Judges the backing file and the external data file `info` (of the image at `path`)
/// names.
pub fn references(path: &Path, info: &ImageInfo, allowed: &AllowDirs) -> Vec<Judged> {
    let data_file = info
        .format_specific
        .as_ref()
        .and_then(|f| f.data.qcow2()?.data_file.clone());
    let named = [
        (Reference::BackingFile, info.backing_filename.clone()),
        (Reference::DataFile, data_file),
    ];
    named
        .into_iter()
        .filter_map(|(kind, name)| Some(judge(path, &name?, kind, allowed)))
        .collect()
}

/// Judges one name `path` gives as `kind`.
fn judge(path: &Path, name: &str, kind: Reference, allowed: &AllowDirs) -> Judged {
    let driver = describe_name(name).map(|described| match described {
        Ok(Described::File(_)) => "file".to_string(),
        Ok(Described::Blkdebug(_)) => "blkdebug".to_string(),
        Err(_) => "unknown".to_string(),
    });
    let mut resolved = None;
    let verdict = backing_name::resolve_untrusted(path, name, kind).and_then(|p| {
        // A name that does not resolve is judged as it stands: absolute and plain it may
        // still lie inside (and fail to open later), with `..` it is refused.
        let canonical = p.canonicalize().unwrap_or(p);
        resolved = Some(canonical.display().to_string());
        backing_name::admit(allowed, path, name, kind, &canonical).map(|()| canonical)
    });
    Judged {
        kind,
        report: ReferenceReport {
            kind: kind.to_string(),
            place: kind.place().to_string(),
            name: name.to_string(),
            driver,
            resolved,
            refused: verdict.as_ref().err().map(ToString::to_string),
        },
        verdict,
    }
}
