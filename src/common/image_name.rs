//! Image names as the command line gives them. Storage's opener reads a name
//! ([`storage::opener::name`]: the syntax, the drivers, the refusals); what is left here is
//! the command line's part: `-f` against `--image-opts`, a `backing` node checked against
//! the image's own backing file, the TLS credentials and bitmap an `nbd` node names noted
//! for the connection, and the names read in this run, which later steps ask about
//! ([`given_name`], [`driver_options`], [`data_file_for`], [`compressed_writes`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use storage::opener::name::{ImageName, NameError, Reason, COMPRESS_OPTION};
use storage::opener::parse;

/// Checks that a `backing` node describes the image's own backing file: the same file
/// (once both are resolved) and, where the image records one, the same format.
fn check_backing_node(image: &Path, node: &(PathBuf, Option<String>)) -> Result<(), Reason> {
    let (given, driver) = node;
    let other = |found: String| Reason::OtherBacking {
        given: match driver {
            Some(d) => format!("'{}' ({d})", given.display()),
            None => format!("'{}'", given.display()),
        },
        found,
    };
    let header =
        read_header(image).ok_or_else(|| other("unknown (its header cannot be read)".into()))?;
    let Some(name) = header.backing_file.as_deref() else {
        return Err(other("none".into()));
    };
    let name = String::from_utf8_lossy(name).into_owned();
    let resolved = qcow2::engine::backing_name::resolve(image, &name)
        .map_err(|_| other(format!("'{name}'")))?;
    let same_file = match (
        std::fs::canonicalize(&resolved),
        std::fs::canonicalize(given),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => resolved == *given,
    };
    let recorded = header
        .backing_format()
        .map(|f| String::from_utf8_lossy(f).into_owned());
    let same_format = match (driver, &recorded) {
        (Some(d), Some(r)) => d == r,
        _ => true,
    };
    if same_file && same_format {
        return Ok(());
    }
    Err(other(match recorded {
        Some(r) => format!("'{name}' ({r})"),
        None => format!("'{name}'"),
    }))
}

/// The qcow2 header of the image at `path`, if it is a qcow2 image, read through the storage
/// opener (sharing writes: the subcommand's own open takes the locks it needs).
fn read_header(path: &Path) -> Option<qcow2::format::Header> {
    // A backing file name lies within the first cluster, which is at most 2 MiB.
    qcow2::format::Header::decode(&super::image_bytes::read_head(path, 2 << 20).ok()?).ok()
}

/// The names read in this run, for [`driver_options`].
static READ: Mutex<Vec<ImageName>> = Mutex::new(Vec::new());

/// Reads `name` (as [`parse`]) and puts what it names in place: `path` becomes the file, and
/// `format` the driver it names (with `--image-opts`, `-f` is refused as qemu-img refuses it).
pub fn resolve(
    path: &mut PathBuf,
    format: &mut Option<String>,
    image_opts: bool,
) -> Result<(), NameError> {
    if image_opts && format.is_some() {
        return Err(NameError::FormatWithImageOpts);
    }
    let read = parse(path.as_os_str(), image_opts)?;
    let direct = image_opts && asks_direct(&path.to_string_lossy());
    if let Some(node) = &read.backing {
        check_backing_node(&read.path, node).map_err(|reason| NameError::Open {
            name: path.display().to_string(),
            reason,
        })?;
    }
    let given = path.display().to_string();
    if let Some(id) = read.options.get("tls-creds") {
        let hostname = read.options.get("tls-hostname").cloned();
        crate::common::tls::note(&read.path, id, hostname).map_err(|reason| NameError::Open {
            name: given.clone(),
            reason: Reason::TlsCreds(reason),
        })?;
    }
    if let Some(context) = read.options.get("x-dirty-bitmap") {
        nbd_client::register_status_context(&read.path.display().to_string(), context);
    }
    *path = read.path.clone();
    if read.format.is_some() {
        format.clone_from(&read.format);
    }
    if let Ok(mut all) = READ.lock() {
        all.push(read);
    }
    if let Ok(mut names) = GIVEN.lock() {
        names.push((path.clone(), given));
    }
    if direct {
        if let Ok(mut all) = DIRECT.lock() {
            all.push(path.clone());
        }
    }
    Ok(())
}

/// The files an option list asked to be read with O_DIRECT, for [`direct_for`].
static DIRECT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Whether an `--image-opts` list asks for O_DIRECT on its file: `file.cache.direct` when
/// given, else `cache.direct` of the node above, which its `file` child inherits in QEMU.
fn asks_direct(list: &str) -> bool {
    let pairs = storage::opener::image_opts::split(list);
    let value = |key: &str| {
        pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| {
            // A bare key means `on`, as QEMU reads it.
            v.as_deref()
                .map_or(Some(true), storage::opener::image_opts::parse_bool)
                .unwrap_or(false)
        })
    };
    value("file.cache.direct")
        .or_else(|| value("cache.direct"))
        .unwrap_or(false)
}

/// Whether the image that resolved to `path` in this run was given with `cache.direct=on`
/// (QEMU's O_DIRECT), which changes how block status rounds a data run at the end of file.
pub fn direct_for(path: &Path) -> bool {
    DIRECT.lock().is_ok_and(|all| all.iter().any(|p| p == path))
}

/// The names as given on the command line, by what they resolved to, for [`given_name`].
static GIVEN: Mutex<Vec<(PathBuf, String)>> = Mutex::new(Vec::new());

/// The name that resolved to `path` as the command line gave it (an option list, a `json:`
/// name), which QEMU's errors about the image quote; `path` itself when none did.
pub fn given_name(path: &Path) -> String {
    GIVEN
        .lock()
        .ok()
        .and_then(|names| {
            names
                .iter()
                .find(|(p, _)| p == path)
                .map(|(_, g)| g.clone())
        })
        .unwrap_or_else(|| path.display().to_string())
}

/// [`resolve`] for a name that may be absent.
pub fn resolve_opt(
    path: &mut Option<PathBuf>,
    format: &mut Option<String>,
    image_opts: bool,
) -> Result<(), NameError> {
    match path {
        Some(p) => resolve(p, format, image_opts),
        None => Ok(()),
    }
}

/// The driver options (those in the pass-through list) given with the image that resolved to
/// `path` in this run.
pub fn driver_options(path: &Path) -> BTreeMap<String, String> {
    READ.lock()
        .ok()
        .and_then(|all| {
            all.iter()
                .find(|n| n.path == path)
                .map(|n| n.options.clone())
        })
        .unwrap_or_default()
}

/// The external data file given with the image that resolved to `path` in this run (its
/// `data-file` node), if any.
pub fn data_file_for(path: &Path) -> Option<PathBuf> {
    READ.lock().ok().and_then(|all| {
        all.iter()
            .find(|n| n.path == path)
            .and_then(|n| n.data_file.clone())
    })
}

/// Whether the image that resolved to `path` in this run was given under the `compress`
/// filter.
pub fn compressed_writes(path: &Path) -> bool {
    driver_options(path).contains_key(COMPRESS_OPTION)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_refuses_format_with_image_opts() {
        let mut path = PathBuf::from("driver=qcow2,file.filename=/t/z");
        // Only the image's own format: -f with --image-opts is refused before the name is read.
        let mut format = Some("qcow2".to_string());
        assert_eq!(
            resolve(&mut path, &mut format, true),
            Err(NameError::FormatWithImageOpts)
        );
        let mut format = None;
        resolve(&mut path, &mut format, true).unwrap();
        assert_eq!(
            (path.as_path(), format.as_deref()),
            (Path::new("/t/z"), Some("qcow2"))
        );
    }

    #[test]
    fn cache_direct_of_the_file_or_inherited() {
        assert!(asks_direct("driver=raw,file.filename=/t/z,cache.direct=on"));
        assert!(asks_direct(
            "driver=raw,file.filename=/t/z,file.cache.direct"
        ));
        assert!(!asks_direct("driver=raw,file.filename=/t/z"));
        assert!(!asks_direct(
            "driver=raw,file.filename=/t/z,cache.direct=on,file.cache.direct=off"
        ));
        assert!(!asks_direct(
            "driver=raw,file.filename=/t/z,cache.direct=off"
        ));
    }
}
