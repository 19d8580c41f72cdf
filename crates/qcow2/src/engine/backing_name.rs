//! Safe rules for following backing file names: never a `json:` name or a protocol prefix
//! (`nbd:`, `http:` ...), relative names resolved against the image's directory, loops and
//! overly deep chains refused.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Longest backing chain we follow. Real chains reach a few hundred layers; a longer one is
/// almost certainly a crafted image trying to exhaust file descriptors or time.
pub const MAX_CHAIN_DEPTH: usize = 1024;

/// Why a backing file is not followed.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// A `json:` pseudo-protocol name, which could point anywhere.
    #[error(
        "{image}: refusing to follow backing file name {name:?}: json: names are not supported"
    )]
    Json {
        /// The image naming it.
        image: String,
        /// The name.
        name: String,
    },
    /// A protocol-prefixed name (`nbd:`, `http:`, ...), which would leave the file system.
    #[error("{image}: refusing to follow backing file name {name:?}: protocol {protocol:?} is not a local file")]
    Protocol {
        /// The image naming it.
        image: String,
        /// The name.
        name: String,
        /// The prefix before ':'.
        protocol: String,
    },
    /// The chain comes back to an image already in it.
    #[error("{image}: backing chain loops back to {path}")]
    Loop {
        /// The image naming it.
        image: String,
        /// The path seen twice.
        path: String,
    },
    /// The chain is deeper than [`MAX_CHAIN_DEPTH`].
    #[error("{image}: backing chain is deeper than {MAX_CHAIN_DEPTH} images")]
    TooDeep {
        /// The image at the limit.
        image: String,
    },
}

/// The protocol prefix of `name`, if it has one: a ':' before any '/' (QEMU's rule), so
/// `./a:b` is a file and `nbd:host` is not.
pub fn protocol_prefix(name: &str) -> Option<&str> {
    let colon = name.find(':')?;
    match name.find('/') {
        Some(slash) if slash < colon => None,
        _ => Some(&name[..colon]),
    }
}

/// Resolves `name` (as stored in `image`) to a path, as QEMU's `path_combine` does: absolute
/// names as they are, relative ones against the image's directory. Refuses `json:` and
/// protocol-prefixed names.
pub fn resolve(image: &Path, name: &str) -> Result<PathBuf, BackingError> {
    if name.starts_with("json:") {
        return Err(BackingError::Json {
            image: image.display().to_string(),
            name: name.into(),
        });
    }
    if let Some(protocol) = protocol_prefix(name) {
        return Err(BackingError::Protocol {
            image: image.display().to_string(),
            name: name.into(),
            protocol: protocol.into(),
        });
    }
    let path = Path::new(name);
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    // Behind fault injection, the image's own file is what names are relative to.
    let image = image
        .to_str()
        .and_then(storage::blkdebug::split_name)
        .map_or(image, |(_, file)| Path::new(file));
    Ok(image
        .parent()
        .map_or_else(|| path.to_path_buf(), |dir| dir.join(path)))
}

/// Tracks the images already visited in one chain walk.
#[derive(Debug, Default)]
pub struct ChainGuard {
    seen: HashSet<PathBuf>,
}

impl ChainGuard {
    /// Records `path` (canonicalized when possible, on the calling thread); fails on a
    /// repeat or past the depth limit.
    pub fn enter(&mut self, image: &Path, path: &Path) -> Result<(), BackingError> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        self.enter_as(image, path, key)
    }

    /// Records `path`, known as `key` (its canonical name where the caller could find it);
    /// fails on a repeat or past the depth limit.
    pub fn enter_as(
        &mut self,
        image: &Path,
        path: &Path,
        key: PathBuf,
    ) -> Result<(), BackingError> {
        if self.seen.len() >= MAX_CHAIN_DEPTH {
            return Err(BackingError::TooDeep {
                image: image.display().to_string(),
            });
        }
        if !self.seen.insert(key) {
            return Err(BackingError::Loop {
                image: image.display().to_string(),
                path: path.display().to_string(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_prefixes_follow_qemus_rule() {
        assert_eq!(protocol_prefix("nbd:localhost:10809"), Some("nbd"));
        assert_eq!(protocol_prefix("http://x/y"), Some("http"));
        assert_eq!(protocol_prefix("./a:b.qcow2"), None);
        assert_eq!(protocol_prefix("/abs/a:b"), None);
        assert_eq!(protocol_prefix("base.qcow2"), None);
    }

    #[test]
    fn resolves_relative_names_against_the_image_directory() {
        let top = Path::new("/images/vm/top.qcow2");
        assert_eq!(
            resolve(top, "base.qcow2").unwrap(),
            PathBuf::from("/images/vm/base.qcow2")
        );
        assert_eq!(
            resolve(top, "../b.qcow2").unwrap(),
            PathBuf::from("/images/vm/../b.qcow2")
        );
        assert_eq!(
            resolve(top, "/other/b.qcow2").unwrap(),
            PathBuf::from("/other/b.qcow2")
        );
        assert_eq!(
            resolve(Path::new("top.qcow2"), "b.qcow2").unwrap(),
            PathBuf::from("b.qcow2")
        );
    }

    #[test]
    fn refuses_json_and_protocol_names() {
        let top = Path::new("top.qcow2");
        assert!(matches!(
            resolve(top, "json:{\"file\":{}}"),
            Err(BackingError::Json { .. })
        ));
        assert!(matches!(
            resolve(top, "nbd:127.0.0.1:10809"),
            Err(BackingError::Protocol { .. })
        ));
    }

    #[test]
    fn guard_detects_loops_and_depth() {
        let mut guard = ChainGuard::default();
        let img = Path::new("x");
        let enter =
            |guard: &mut ChainGuard, p: &str| guard.enter_as(img, Path::new(p), PathBuf::from(p));
        enter(&mut guard, "/nonexistent/a").unwrap();
        assert!(matches!(
            enter(&mut guard, "/nonexistent/a"),
            Err(BackingError::Loop { .. })
        ));
        for i in 1..MAX_CHAIN_DEPTH {
            enter(&mut guard, &format!("/nonexistent/{i}")).unwrap();
        }
        assert!(matches!(
            enter(&mut guard, "/nonexistent/last"),
            Err(BackingError::TooDeep { .. })
        ));
    }
}
